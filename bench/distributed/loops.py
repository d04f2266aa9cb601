"""The distributed benchmark's model, data and its two training loops (``python -m bench --distributed``; see
:mod:`bench.distributed.run`): ampfused's ZeRO-1 step and torch's DDP recipe, run on each rank."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import ampfused

from ..step.variants import Snapshot, TorchRecipe
from ..step.workloads import GRAD_NORM, Instance

BATCHES = 4  # distinct batches per rank, used in turn


@dataclass
class Config:
    world: int = 2
    width: int = 384
    blocks: int = 4
    batch: int = 16  # rows per rank and step
    warmup: int = 3
    reps: int = 30
    max_seconds: float = 30.0
    threads: int = 1  # torch threads per rank (CPU)
    comm: str = "gloo"  # gloo (CPU) or nccl (one GPU per rank)
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    # the torch recipe's hyperparameters changed from the instance's (a deliberately wrong recipe, for tests)
    torch_changes: Dict[str, object] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return f"mlp-{self.width}x{self.blocks}"


# --- the model, its data and the check gradients ------------------------------------------------------------

class Block(nn.Module):
    """A transformer's MLP half: ``x + Linear(4d, d)(gelu(Linear(d, 4d)(LayerNorm(x))))``."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build_model(cfg: Config, device: torch.device) -> nn.Module:
    """The bf16 model, the same bits on every rank (torch's default initialisation from ``cfg.seed``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = nn.Sequential(*[Block(cfg.width) for _ in range(cfg.blocks)])
    return model.to(device=device, dtype=torch.bfloat16)


def model_size(width: int, blocks: int) -> tuple:
    """``(parameters, tensors)`` of the model: per block 8 d^2 + 7 d parameters in 6 tensors."""
    return blocks * (8 * width * width + 7 * width), 6 * blocks


def batches(cfg: Config, rank: int, device: torch.device) -> List[tuple]:
    """This rank's ``BATCHES`` batches ``(x, target)``, bf16, from a generator of its own."""
    g = torch.Generator().manual_seed(1_000 + 7_919 * cfg.seed + rank)
    out = []
    for _ in range(BATCHES):
        x = torch.randn(cfg.batch, cfg.width, generator=g).to(device=device, dtype=torch.bfloat16)
        y = torch.randn(cfg.batch, cfg.width, generator=g).to(device=device, dtype=torch.bfloat16)
        out.append((x, y))
    return out


def check_grads(params: List[Tensor], rank: int, step: int, seed: int = 0) -> List[Tensor]:
    """Gradients of check step ``step`` on ``rank``: integers in [-4, 4] times one power of two, in bf16.

    Any partial sum over up to 64 ranks is an integer of magnitude at most 256 times that power, exact in bf16
    whatever the order of summation, and dividing by a power-of-two world size is exact too: DDP's mean (divide,
    then all-reduce) and ZeRO-1's (reduce-scatter the sum, then divide in fp32) give the same global gradient,
    bit for bit. The power of two puts the global norm near ``GRAD_NORM`` (4), so ``max_norm=1`` clips."""
    n = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(104_729 * (seed + 1) + 7_919 * step + rank)
    flat = torch.randint(-4, 5, (n,), generator=g, dtype=torch.int32)
    # randint(-4, 5) has standard deviation sqrt(20/3); the mean over W ranks about that / sqrt(W), which the
    # power of two does not follow: the norm stays within a factor 8 of GRAD_NORM for W <= 64
    power = 2.0 ** round(math.log2(GRAD_NORM / (math.sqrt(n) * math.sqrt(20 / 3))))
    flat = (flat.float() * power).to(torch.bfloat16)
    out, at = [], 0
    for p in params:
        out.append(flat[at:at + p.numel()].view(p.shape).to(p.device))
        at += p.numel()
    return out


def _loss(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(net(x).float(), y.float())


# --- the two loops ------------------------------------------------------------------------------------------

class ZeroRunner:
    """The replicated model and ``ampfused.ShardedFusedAdamW``; the step reduces the gradients itself."""
    name = "ampfused-zero1"

    def __init__(self, module: nn.Module, inst: Instance):
        self.module = module
        self.params = list(module.parameters())
        self.opt = ampfused.ShardedFusedAdamW(self.params, lr=inst.lr, betas=inst.betas, eps=inst.eps,
                                              weight_decay=inst.weight_decay, max_grad_norm=inst.max_norm)
        self.impl = "ShardedFusedAdamW (backend " + ampfused.ops.step_backend(
            self.params[0].device, ("torch.bfloat16", "torch.float32")) + ")"

    def backward(self, x: Tensor, y: Tensor) -> None:
        self.opt.zero_grad()  # to None: backward allocates them, as in the default loop
        _loss(self.module, x, y).backward()

    def set_grads(self, grads: List[Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.grad for p in self.params], grads)

    def step(self) -> None:
        self.opt.step()

    def snapshot(self) -> Snapshot:
        """The whole state, gathered from every rank (a collective)."""
        state = self.opt.state_dict()["state"]
        st = [state[i] for i in range(len(self.params))]
        return Snapshot(param=[p.detach() for p in self.params], master=[s["master_param"] for s in st],
                        exp_avg=[s["exp_avg"] for s in st], exp_avg_sq=[s["exp_avg_sq"] for s in st],
                        norm=self.opt.last_grad_norm)

    def state_bytes(self) -> int:
        return self.opt.state_bytes()


def _defer_hook(state, bucket):
    # DDP communication hook that keeps the bucket for DdpRecipe to all-reduce in its step (no annotations:
    # DDP checks them, and this module postpones their evaluation)
    state.pending[bucket.index()] = bucket.buffer()
    fut = torch.futures.Future(devices=[bucket.buffer().device] if bucket.buffer().is_cuda else None)
    fut.set_result(bucket.buffer())
    return fut


class DdpRecipe(TorchRecipe):
    """torch's recipe (:class:`bench.step.variants.TorchRecipe`, no loss scaler) on a DDP-wrapped model, with DDP's
    gradient all-reduce moved from backward into the step, so that the timed step holds the communication of
    data parallelism as ZeRO-1's does.

    Why this way: DDP runs its all-reduce inside backward, overlapped with the gradients still being computed,
    where a step timer cannot see it. A communication hook (:func:`_defer_hook`) lets DDP do everything else as
    it always does (its buckets, their sizes and order, ``gradient_as_bucket_view=True`` so the gradients *are*
    the buckets) and only keeps each bucket; the step then does what DDP's default hook does, bucket by bucket:
    divide by the world size and start an asynchronous all-reduce, then waits for them all. So the timed
    communication is exactly DDP's (the same collectives on the same buffers, no copies), without the overlap
    with backward that DDP would get in a real loop; ZeRO-1 gets no overlap either (its reduce-scatter is in its
    step), so the comparison is like for like. A manual all-reduce per gradient would add collectives DDP does not
    make, and one of a flat copy would add two copies DDP does not make."""
    name = "torch-ddp"

    def __init__(self, inst: Instance, module: nn.Module, impl: str, device: torch.device):
        params = list(module.parameters())
        super().__init__("torch-ddp", impl, inst, params, impl)
        self.model = params  # the module's own parameters, not the copies the recipe made
        self._model_grads = []
        from torch.nn.parallel import DistributedDataParallel
        self.ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                           gradient_as_bucket_view=True)
        self.pending: Dict[int, Tensor] = {}
        self.ddp.register_comm_hook(self, _defer_hook)
        self.world = dist.get_world_size()
        self.bucket_numels: List[int] = []
        opt = "fused" if self.opt.defaults.get("fused") else "foreach"
        self.impl = f"DDP + clip_grad_norm_(foreach) + AdamW({opt}=True) on fp32 masters"

    def backward(self, x: Tensor, y: Tensor) -> None:
        self.ddp.zero_grad(set_to_none=False)  # in place: the gradients stay views of DDP's buckets
        _loss(self.ddp, x, y).backward()

    def set_grads(self, grads: List[Tensor]) -> None:
        buckets = {b.untyped_storage().data_ptr() for b in self.pending.values()}
        if any(p.grad is None or p.grad.untyped_storage().data_ptr() not in buckets for p in self.model):
            raise RuntimeError("DDP's gradients are not views of the buckets its backward handed over: the handed-in "
                               "gradients would not be the ones the step all-reduces")
        with torch.no_grad():
            torch._foreach_copy_([p.grad for p in self.model], grads)

    def all_reduce(self) -> None:
        if not self.pending:
            raise RuntimeError("torch-ddp step without a backward before it: DDP handed over no bucket")
        works = []
        self.bucket_numels = [self.pending[i].numel() for i in sorted(self.pending)]
        for i in sorted(self.pending):
            buf = self.pending[i]
            buf.div_(self.world)  # as DDP's default hook: divide, then sum
            works.append(dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True))
        for w in works:
            w.wait()
        self.pending = {}

    def step(self) -> None:
        self.all_reduce()
        self._model_grads = [p.grad for p in self.model]
        super().step()

    def state_bytes(self) -> int:
        """fp32 masters plus AdamW's state tensors (moments, step counts)."""
        tensors = [m.detach() for m in self.master]
        tensors += [t for s in self.opt.state.values() for t in s.values() if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def torch_recipe(inst: Instance, module: nn.Module, device: torch.device, notes: List[str]) -> DdpRecipe:
    try:
        return DdpRecipe(inst, module, "fused", device)
    except RuntimeError as e:  # a device without a fused AdamW kernel
        notes.append(f"torch-ddp: AdamW(fused=True) is not supported here ({str(e).splitlines()[0][:120]}); "
                     "timed with foreach=True")
        return DdpRecipe(inst, module, "foreach", device)
