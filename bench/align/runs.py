"""The training runs of ``python -m bench.align``: one model, one data order, seven ways to take the step.

| run | model | step |
| --- | --- | --- |
| ``fp32`` | fp32 | ``clip_grad_norm_`` + ``AdamW(fused=True)`` on the parameters: the truth |
| ``torch`` | bf16 | torch's recipe: fp32 master copy, ``clip_grad_norm_`` on the master grads, ``AdamW(fused=True)``, copy back |
| ``torch-again`` | bf16 | the same, once more (run-to-run control) |
| ``torch-foreach`` | bf16 | the recipe with ``AdamW(foreach=True)`` (implementation control) |
| ``ampfused`` | bf16 | ``ampfused.FusedAdamW(max_grad_norm=...)``, masters kept inside |
| ``torch-fp16`` | fp16 | the recipe under ``torch.amp.GradScaler``: scale, backward, grads to the masters, ``unscale_``, clip, ``scaler.step``, ``update``, copy back |
| ``ampfused-fp16`` | fp16 | ``ampfused.FusedAdamW(max_grad_norm=...)`` under ``ampfused.GradScaler``: scale, backward, ``step``, ``update`` |

Every run keeps its model's gradients, its fp32 masters and the model's own weights after its first three steps.
:func:`replay` takes another run's step on those gradients (the same steps without the forward pass in
between, so only the step's arithmetic differs); :func:`replay_exact` takes the step in fp64. Two variants exist
only for replays, to find out where a difference comes from: ``torch-rounded-norm`` and
``torch-fp16-rounded-norm``, torch's recipe with ``clip_grad_norm_``'s arithmetic applied to the correctly
rounded norm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import Tensor

import ampfused

from . import model as M

RUNS = ("fp32", "torch", "torch-again", "torch-foreach", "ampfused", "torch-fp16", "ampfused-fp16")
DTYPE = {"fp32": torch.float32, "torch": torch.bfloat16, "torch-again": torch.bfloat16,
         "torch-foreach": torch.bfloat16, "ampfused": torch.bfloat16, "torch-fp16": torch.float16,
         "ampfused-fp16": torch.float16, "torch-rounded-norm": torch.bfloat16,
         "torch-fp16-rounded-norm": torch.float16}
# more runs by name: (model dtype, factory(model, cfg, device) -> trainer), e.g. the state modes (bench/align/modes.py)
EXTRA: dict = {}
SNAPSHOTS = 3  # masters and model weights are kept after optimizer steps 1..SNAPSHOTS


@dataclass
class Run:
    name: str
    losses: List[float] = field(default_factory=list)
    grad_norms: List[float] = field(default_factory=list)  # before clipping, of the unscaled gradients
    scales: List[float] = field(default_factory=list)  # loss scale used at each step (fp16 runs)
    skipped: List[int] = field(default_factory=list)  # 1-based steps skipped for non-finite gradients
    masters: List[Tensor] = field(default_factory=list)  # fp32 masters (fp32 run: its parameters), flat, per snapshot
    weights: List[Tensor] = field(default_factory=list)  # the model's own parameters, flat, per snapshot
    grads: List[List[Tensor]] = field(default_factory=list)  # the model's gradients after backward, per snapshot
    final_masters: Optional[Tensor] = None
    final_weights: Optional[Tensor] = None
    seconds: float = 0.0


def _flat(ts) -> Tensor:
    return torch.cat([t.detach().reshape(-1).cpu() for t in ts])


class Optimizing:
    """What the recipes share: the learning rate set on every group, backward through the scaler if any."""

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def backward(self, loss: Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step_optimizer(self) -> None:
        """The optimizer's step (through the scaler if any), then its gradients set to None."""
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()


class _Recipe(Optimizing):
    """torch's master-weight recipe around a bf16/fp16 model (or, for an fp32 model, AdamW on the model)."""

    def __init__(self, model, cfg: M.Config, impl: str, scaler: Optional[torch.amp.GradScaler],
                 rounded_norm: bool = False):
        self.model, self.cfg, self.scaler, self.rounded_norm = model, cfg, scaler, rounded_norm
        self.params = list(model.parameters())
        own = next(iter(self.params)).dtype == torch.float32
        self.masters = self.params if own else [p.detach().float().requires_grad_() for p in self.params]
        named = list(zip((n for n, _ in model.named_parameters()), self.masters))
        kw = {impl: True}
        self.opt = torch.optim.AdamW(M.param_groups(named, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                                     eps=cfg.eps, **kw)


    def step(self) -> float:
        """Everything after backward; returns the gradient norm before clipping."""
        if self.masters is not self.params:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
                p.grad = None
        if self.scaler:
            self.scaler.unscale_(self.opt)
        if self.rounded_norm:  # clip_grad_norm_'s arithmetic on the correctly rounded norm (a diagnosis)
            norm = torch.cat([m.grad.double().reshape(-1) for m in self.masters]).norm().float()
            coef = torch.clamp(self.cfg.max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([m.grad for m in self.masters], coef)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.max_norm)
        self.step_optimizer()
        if self.masters is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        return float(norm)

    def master_list(self) -> List[Tensor]:
        return self.masters


class _Fused(Optimizing):
    """``ampfused.FusedAdamW`` with the clip folded into the step, alone (bf16) or under ``ampfused.GradScaler``."""

    def __init__(self, model, cfg: M.Config, scaler: Optional[ampfused.GradScaler]):
        self.model, self.scaler = model, scaler
        self.params = list(model.parameters())
        self.opt = ampfused.FusedAdamW(M.param_groups(list(model.named_parameters()), cfg.weight_decay), lr=cfg.lr,
                                       betas=cfg.betas, eps=cfg.eps, max_grad_norm=cfg.max_norm)

    def step(self) -> float:
        self.step_optimizer()
        return float(self.opt.last_grad_norm)

    def master_list(self) -> List[Tensor]:
        return [self.opt.state[p]["master_param"] for p in self.params]


def _trainer(name: str, model, cfg: M.Config, device: torch.device):
    if name in EXTRA:
        return EXTRA[name][1](model, cfg, device)
    scaler_kw = dict(init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
    if name in ("fp32", "torch", "torch-again"):
        return _Recipe(model, cfg, "fused", None)
    if name == "torch-foreach":
        return _Recipe(model, cfg, "foreach", None)
    if name == "torch-rounded-norm":
        return _Recipe(model, cfg, "fused", None, rounded_norm=True)
    if name == "torch-fp16-rounded-norm":
        return _Recipe(model, cfg, "fused", torch.amp.GradScaler(device.type, **scaler_kw), rounded_norm=True)
    if name == "torch-fp16":
        return _Recipe(model, cfg, "fused", torch.amp.GradScaler(device.type, **scaler_kw))
    if name == "ampfused":
        return _Fused(model, cfg, None)
    if name == "ampfused-fp16":
        return _Fused(model, cfg, ampfused.GradScaler(device.type, **scaler_kw))
    raise ValueError(f"unknown run {name!r}; runs: {', '.join(RUNS)}")


def fp16_compute_dtype(device: torch.device, choice: str = "auto") -> torch.dtype:
    """What an fp16 model computes in: fp16 on CUDA; on CPU fp32 unless asked, as torch's fp16 matrix
    products on CPUs without fp16 arithmetic run tens of times slower than fp32 ones."""
    if choice == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"fp16": torch.float16, "fp32": torch.float32}[choice]


def train(name: str, cfg: M.Config, data: Tensor, offsets: Tensor, state: dict, device: torch.device,
          fp16_compute: torch.dtype, progress: Optional[Callable[[str, int], None]] = None,
          bf16_compute: torch.dtype = torch.bfloat16) -> Run:
    """``cfg.steps`` optimizer steps of run ``name`` on the shared data order from the shared initial weights (an
    fp16 model's arithmetic in ``fp16_compute``, a bf16 model's in ``bf16_compute``)."""
    dtype = EXTRA[name][0] if name in EXTRA else DTYPE[name]
    compute = {torch.float16: fp16_compute, torch.bfloat16: bf16_compute}.get(dtype, dtype)
    model = M.build(cfg, state, dtype, compute, device)
    trainer = _trainer(name, model, cfg, device)
    scaler = getattr(trainer, "scaler", None)
    run = Run(name)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x, y = M.batch(data, offsets, step, cfg.context, device)
        trainer.set_lr(cfg.lr_at(step))
        loss = model.loss(x, y)
        scale = scaler.get_scale() if scaler else 1.0
        trainer.backward(loss)
        if step < SNAPSHOTS:
            run.grads.append([p.grad.detach().clone() for p in model.parameters()])
        run.grad_norms.append(trainer.step())
        run.losses.append(float(loss.detach()))
        if scaler:
            run.scales.append(scale)
            if scaler.get_scale() < scale:
                run.skipped.append(step + 1)
        if step < SNAPSHOTS:
            run.masters.append(_flat(trainer.master_list()))
            run.weights.append(_flat(model.parameters()))
        if progress is not None:
            progress(name, step + 1)
    run.seconds = time.perf_counter() - t0
    run.final_masters = _flat(trainer.master_list())
    run.final_weights = _flat(model.parameters())
    return run


def replay(name: str, source: Run, cfg: M.Config, state: dict, device: torch.device) -> List[Tensor]:
    """Run ``name``'s step on the gradients ``source`` computed at its first steps (scaled, as backward left
    them) instead of its own: the masters after each step, which differ from ``source``'s only by the step's
    arithmetic, not by anything the model's rounded weights did to the forward pass."""
    dtype = DTYPE[name]
    model = M.build(cfg, state, dtype, dtype, device)
    trainer = _trainer(name, model, cfg, device)
    scaler = getattr(trainer, "scaler", None)
    masters = []
    for step, grads in enumerate(source.grads):
        trainer.set_lr(cfg.lr_at(step))
        if scaler:
            scaler.scale(torch.zeros((), device=device))  # what scaler.scale(loss) does to the scaler
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        trainer.step()
        masters.append(_flat(trainer.master_list()))
    return masters


def replay_exact(source: Run, cfg: M.Config, state: dict) -> List[Tensor]:
    """The exact step on ``source``'s gradients of its first steps: torch's recipe with fp64 masters, fp64 clip
    and fp64 AdamW (unscaled by the loss scale ``source`` used; a step with non-finite gradients is skipped).
    Its masters rounded to fp32 are what a correctly rounded fp32 step would give."""
    names = list(state)
    start = [v.to(DTYPE[source.name]).double() for v in state.values()]
    masters = [v.clone().requires_grad_() for v in start]
    opt = torch.optim.AdamW(M.param_groups(list(zip(names, masters)), cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                            eps=cfg.eps, foreach=False)
    out = []
    for step, grads in enumerate(source.grads):
        scale = source.scales[step] if source.scales else 1.0
        gs = [g.detach().cpu().double() / scale for g in grads]
        if all(bool(torch.isfinite(g).all()) for g in gs):
            for g in opt.param_groups:
                g["lr"] = cfg.lr_at(step)
            for m, g in zip(masters, gs):
                m.grad = g
            torch.nn.utils.clip_grad_norm_(masters, cfg.max_norm)
            opt.step()
        out.append(torch.cat([m.detach().reshape(-1) for m in masters]).float())
    return out
