"""torchtitan's real Trainer on CPU gloo ranks: a tiny llama3 from its model registry's building blocks, synthetic
tokens, no tokenizer files, no network.

torchtitan 0.3.0 picks its device type at import (``"cuda"`` where no accelerator is found), so ``use_cpu()``
points the module-level copies of that choice at the CPU; the process group comes from ``dist_harness.run_ranks``
(torchtitan's ``init_distributed`` keeps a group that exists). Each rank runs ``Trainer.train()`` end to end:
FSDP2 (torchtitan's ``parallelize_llama``), gradient accumulation, the LR scheduler, DCP checkpoints.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, List

import torch

import torchtitan.components.metrics as tt_metrics
import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.profiler as tt_profiler
import torchtitan.tools.utils as tt_utils
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models import llama3 as tt_llama3
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim
from torchtitan.models.common import Embedding, Linear, RMSNorm
from torchtitan.models.common import ComplexRoPE
import torchtitan.trainer as tt_trainer

VOCAB = 64
SEQ = 16


def use_cpu() -> None:
    """Every module-level copy of torchtitan's device choice, set to the CPU."""
    for mod in (tt_utils, tt_metrics, tt_dist_utils, tt_parallel_dims):
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = _CPU
    tt_profiler.device_module = _CPU
    tt_metrics.build_device_memory_monitor = _CpuMemory


class _NoSleep:
    """The ``time`` module without ``sleep``: rank 0 sleeps 2 s at the end of ``Trainer.train()`` "for other ranks
    to complete", which a test of several short runs need not wait for (the harness joins the ranks itself)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds) -> None:
        pass


def keep_timeouts() -> None:
    """torchtitan 0.3.0 shortens the groups' timeouts after the first step with ``torch.distributed.set_timeout``,
    which torch 2.13 does not have (``train()`` fails there on any device): the barrier before it stays."""
    if not hasattr(torch.distributed, "set_timeout"):
        tt_dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: torch.distributed.barrier()


class _CpuModule:
    """``torch.cpu`` with an integer ``current_device()``, as torchtitan hands it to ``barrier(device_ids=...)``."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


_CPU = _CpuModule()


class _CpuMemory:
    """torchtitan's device memory monitor reads CUDA-style allocator stats, which the CPU does not keep."""

    device_name = "cpu"

    def get_peak_stats(self):
        return tt_metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


def tiny_llama3_spec():
    """torchtitan's llama3 debug model at a tenth of its size, with SDPA (causal) attention: the model
    registry's spec with its model config rebuilt from the same building blocks."""
    dim, heads, layers = 32, 4, 2
    model = tt_llama3.Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=tt_llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt_llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=tt_llama3._output_linear_init(dim)),
        layers=tt_llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="none"),
            attn_backend="flex"))
    for _, _, parent, attr in model.traverse(type(model.layers[0].attention.inner_attention)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    spec = tt_llama3.model_registry("debugmodel")
    spec.model = model
    spec.parallelize_fn = _parallelize_for_gloo
    return spec


def _parallelize_for_gloo(model, **kwargs):
    """torchtitan's llama3 parallelization; then FSDP's reduce-scatter as a plain sum (torchtitan sets the
    divide factor to 1, which FSDP sends as a PREMUL_SUM that gloo lacks: the same sums either way)."""
    from torch.distributed.fsdp import FSDPModule
    model = tt_llama3.parallelize_llama(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


class SyntheticTokens(BaseDataLoader):
    """Random token sequences indexed by their place in the global batch: step ``s`` trains on samples
    ``s * global_batch ... + global_batch - 1`` however they are split over ranks and micro-batches, so runs on
    different world sizes see the same data. The saved state is the step reached (a checkpoint saved on N ranks
    resumes on M)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        global_batch: int = 2
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps=None):
        self.config = config
        self.rank, self.world = dp_rank, dp_world_size
        self.seq_len, self.local = seq_len, local_batch_size
        self.accum = config.global_batch // (dp_world_size * local_batch_size)
        self.taken = 0  # micro-batches taken by this rank

    def _sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + index)
        return torch.randint(0, VOCAB, (self.seq_len + 1,), generator=g)

    def __iter__(self):
        while True:
            step, micro = divmod(self.taken, self.accum)
            first = step * self.config.global_batch + (micro * self.world + self.rank) * self.local
            tokens = torch.stack([self._sample(first + j) for j in range(self.local)])
            self.taken += 1
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self):
        return {"step": self.taken // self.accum}

    def load_state_dict(self, state_dict):
        self.taken = int(state_dict["step"]) * self.accum


class NoTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path=None):
        super().__init__()

    def encode(self, *args, **kwargs):
        raise NotImplementedError

    def decode(self, *args, **kwargs):
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return VOCAB


def adamw_groups(lr: float = 3e-3) -> List[ParamGroupConfig]:
    return [ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})]


def trainer_config(trainer_cls, optimizer, *, out: str, steps: int, max_norm: float = 1.0, grad_accum: int = 1,
                   checkpoint_interval: int = 0, resume_from: str = "", seed: int = 0, world: int = 1,
                   compile: str = "", cuda_graphs: bool = False):
    """A ``trainer_cls.Config`` for the tiny model: local batch 2, ``grad_accum`` micro-batches per step,
    warmup-then-linear-decay schedule, log every step, DCP checkpoints every ``checkpoint_interval`` steps under
    ``out``; ``resume_from``: a checkpoint folder (another run's ``checkpoint/step-N``) to resume from;
    ``compile``: torchtitan's compile of the model and the loss with that backend (``"inductor"``,
    ``"aot_eager"``); ``cuda_graphs``: its CUDA graphs of the
    forward/backward (GPU only)."""
    local = 2
    if resume_from:
        ckpt = CheckpointManager.Config(enable=True, load_only=True, initial_load_path=os.path.abspath(resume_from),
                                        initial_load_model_only=False)
    else:
        ckpt = CheckpointManager.Config(enable=checkpoint_interval > 0, interval=max(checkpoint_interval, 1),
                                        last_save_model_only=False)
    return trainer_cls.Config(
        model_spec=tiny_llama3_spec(),
        dump_folder=out,
        tokenizer=NoTokenizer.Config(),
        dataloader=SyntheticTokens.Config(global_batch=local * world * grad_accum, seed=seed),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=local, global_batch_size=local * world * grad_accum,
                                seq_len=SEQ, steps=steps, max_norm=max_norm, disable_cuda_graphs=not cuda_graphs),
        compile=CompileConfig(enable=bool(compile), components=["model", "loss"], backend=compile or "inductor"),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, spmd_backend="partial_dtensor"),
        checkpoint=ckpt,
    )


def run_trainer(config, nan_steps=(), on_nan: str = "poison", device: str = "cpu") -> Dict[str, object]:
    """Build ``config``'s trainer on this rank and train; returns what its metrics logger received, per step,
    and the final parameters (full tensors).

    ``nan_steps``: steps whose gradients hold a NaN (one element of one gradient on rank 0, put there right
    before the optimizer step, after torchtitan's clip). ``on_nan="poison"`` leaves it to the optimizer (the
    fused step skips); ``"skip"`` does not call the optimizers at those steps (what a torch run must do to skip
    them: torch's AdamW would write NaNs), the LR schedule advancing either way. ``device="cuda"`` leaves
    torchtitan's own device choice."""
    if device == "cpu":
        use_cpu()
    keep_timeouts()
    tt_trainer.time = _NoSleep()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    trainer = config.build()
    logged: List[Dict[str, float]] = []
    sink = trainer.metrics_processor.logger
    log = sink.log

    def capture(metrics, step):
        logged.append(dict(metrics, step=step))
        return log(metrics, step)

    sink.log = capture
    optimizers = trainer.optimizers
    if nan_steps and on_nan == "poison":
        def poison(optimizer, args, kwargs):
            if trainer.step in nan_steps and rank == 0:
                p = next(q for m in trainer.model_parts for q in m.parameters() if q.grad is not None)
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = float("nan")
        optimizers.register_step_pre_hook(poison)
    elif nan_steps:
        step = optimizers.step

        def step_unless_nan(*args, **kwargs):
            if trainer.step not in nan_steps:
                return step(*args, **kwargs)
        optimizers.step = step_unless_nan
    try:
        trainer.train()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in trainer.model_parts[0].named_parameters()}
    finally:
        trainer.close()
    return {"logged": logged, "params": params, "dist_utils_restored": tt_trainer.dist_utils is tt_dist_utils}


def series(run: Dict[str, object], key: str) -> list:
    """One metric of a ``run_trainer`` result, step by step."""
    return [m[key] for m in run["logged"]]
