"""ampfused as a benchmark variant, one per backend available on the device.

Two ways to drive it, same math:

* ``optimizer`` (default when importable): ``ampfused.FusedAdamW`` over the model's parameters (which stay
  where they are; the step reads each ``.grad`` where it is), with ``ampfused.GradScaler`` when the package
  has it, else the optimizer's ``grad_scale`` hook plus ``ops.update_scale_``: no host read either way.
  Two gradient loops: ``ampfused-<backend>`` refills the same gradient tensors in place, as a loop calling
  ``zero_grad(set_to_none=False)`` does; ``ampfused-<backend>+none`` sets them to ``None`` before each
  refill and hands over fresh tensors, as backward does after the default ``zero_grad()`` (the refill, like
  backward, is outside the timed step).
* ``functional``: the ops on flat buffers the benchmark owns: ``norm_check`` -> ``adamw_step_`` ->
  ``update_scale_``, i.e. the package's floor without its Python optimizer layer.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

import ampfused
from ampfused import ops

from .variants import Runner, Snapshot, Unavailable, Variant
from .workloads import Instance

GROWTH, BACKOFF = 2.0, 0.5  # torch.amp.GradScaler's defaults, used by every variant


def _inv_scale(scale: Tensor, out: Tensor) -> None:
    out.copy_(scale.double().reciprocal().float())  # as torch's unscale_ forms it


class OptimizerRunner(Runner):
    def __init__(self, variant: str, backend: str, inst: Instance, params: List[Tensor], grads_to_none=False,
                 opt_kwargs: Optional[dict] = None):
        super().__init__(variant, backend)
        self.inst = inst
        self.grads_to_none = grads_to_none
        self.model = [nn.Parameter(p.detach().clone()) for p in params]
        for p in self.model:
            p.grad = torch.zeros_like(p)
        self.opt = ampfused.FusedAdamW(self.model, lr=inst.lr, betas=inst.betas, eps=inst.eps,
                                       weight_decay=inst.weight_decay,
                                       max_grad_norm=inst.max_norm if inst.clip else None,
                                       master_weights=None, backend=backend, **(opt_kwargs or {}))
        self._grads = [p.grad for p in self.model]
        self.scaler = None
        self._scale: Optional[Tensor] = None
        if inst.scaler and hasattr(ampfused, "GradScaler"):
            self.scaler = ampfused.GradScaler(inst.device.type, init_scale=inst.init_scale,
                                              growth_interval=inst.growth_interval)
            self.scaler.scale(torch.zeros((), device=inst.device))
        elif inst.scaler:
            self.notes.append("ampfused.GradScaler not importable: scale driven by grad_scale + ops.update_scale_")
            self._scale = torch.full((), inst.init_scale, dtype=torch.float32, device=inst.device)
            self._tracker = torch.zeros((), dtype=torch.int32, device=inst.device)

    def set_grads(self, grads: List[Tensor]) -> None:
        with torch.no_grad():
            if self.grads_to_none:
                self.opt.zero_grad(set_to_none=True)
                for p, g in zip(self.model, grads):
                    p.grad = torch.empty_like(p).copy_(g)  # a fresh tensor, as backward allocates one
            else:
                torch._foreach_copy_(self._grads, grads)

    def step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        elif self._scale is not None:
            self.opt.grad_scale = self._scale
            try:
                self.opt.step()
            finally:
                del self.opt.grad_scale
            ops.update_scale_(self._scale, self._tracker, self.opt.last_found_inf, GROWTH, BACKOFF,
                              self.inst.growth_interval, backend=self.backend)
        else:
            self.opt.step()

    def snapshot(self) -> Snapshot:
        st = [self.opt.state[p] for p in self.model]
        if self.scaler is not None:
            scale = self.scaler.get_scale()
        else:
            scale = float(self._scale) if self._scale is not None else None
        return Snapshot(param=[p.detach() for p in self.model],
                        master=[s["master_param"] for s in st] if self.inst.master and "master_param" in st[0] else None,
                        exp_avg=[s["exp_avg"] for s in st], exp_avg_sq=[s["exp_avg_sq"] for s in st],
                        scale=scale, norm=self.opt.last_grad_norm)

    def state_tensors(self) -> List[Tensor]:
        return [t for s in self.opt.state.values() for t in s.values() if isinstance(t, Tensor)]

    def tensors(self) -> List[Tensor]:
        out = [p.detach() for p in self.model] + [p.grad for p in self.model if p.grad is not None]
        out += [t for s in self.opt.state.values() for t in s.values() if isinstance(t, Tensor)]
        for name in ("_stats", "_one", "_inv_scale"):
            if isinstance(getattr(self.opt, name, None), Tensor):
                out.append(getattr(self.opt, name))
        if self._scale is not None:
            out += [self._scale, self._tracker]
        return out


class FunctionalRunner(Runner):
    def __init__(self, variant: str, backend: str, inst: Instance, params: List[Tensor]):
        super().__init__(variant, backend)
        self.inst = inst
        dev = inst.device
        self.sizes = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.param = torch.cat([p.detach().reshape(-1) for p in params])
        self.grad = torch.zeros_like(self.param)
        self.master = self.param.float() if inst.master else None
        cd = torch.float32
        self.exp_avg = torch.zeros(self.param.numel(), dtype=cd, device=dev)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.step_t = torch.zeros((), dtype=torch.float32, device=dev)
        self.lr = torch.full((), inst.lr, dtype=torch.float32, device=dev)
        self.out_stats = torch.zeros(2, dtype=torch.float32, device=dev)
        self.scale = torch.full((), inst.init_scale if inst.scaler else 1.0, dtype=torch.float32, device=dev)
        self.tracker = torch.zeros((), dtype=torch.int32, device=dev)
        self.inv_scale = torch.ones((), dtype=torch.float32, device=dev)
        self._grad_views = self._views(self.grad)

    def _views(self, flat: Tensor) -> List[Tensor]:
        return [v.view(s) for v, s in zip(flat.split(self.sizes), self.shapes)]

    def set_grads(self, grads: List[Tensor]) -> None:
        torch._foreach_copy_(self._grad_views, grads)

    def step(self) -> None:
        inst, b = self.inst, self.backend
        if inst.scaler:
            _inv_scale(self.scale, self.inv_scale)
        partials = ops.norm_check([self.grad], self.inv_scale, backend=b)
        ops.adamw_step_(self.param, self.grad, self.master, self.exp_avg, self.exp_avg_sq, self.step_t, partials,
                        self.inv_scale, self.lr, self.out_stats, beta1=inst.betas[0], beta2=inst.betas[1],
                        eps=inst.eps, weight_decay=inst.weight_decay, max_norm=inst.max_norm_or_inf, backend=b)
        if inst.scaler:
            ops.update_scale_(self.scale, self.tracker, self.out_stats[1], GROWTH, BACKOFF, inst.growth_interval,
                              backend=b)

    def snapshot(self) -> Snapshot:
        return Snapshot(param=self._views(self.param),
                        master=self._views(self.master) if self.master is not None else None,
                        exp_avg=self._views(self.exp_avg), exp_avg_sq=self._views(self.exp_avg_sq),
                        scale=float(self.scale) if self.inst.scaler else None, norm=self.out_stats[0])

    def state_tensors(self) -> List[Tensor]:
        return [self.exp_avg, self.exp_avg_sq, self.step_t] + ([self.master] if self.master is not None else [])

    def tensors(self) -> List[Tensor]:
        out = [self.param, self.grad, self.exp_avg, self.exp_avg_sq, self.step_t, self.lr, self.out_stats,
               self.scale, self.tracker, self.inv_scale]
        return out + ([self.master] if self.master is not None else [])


class AmpfusedVariant(Variant):
    def __init__(self, backend: str, api: str = "auto", grads_to_none: bool = False):
        super().__init__()
        self.backend = backend
        self.grads_to_none = grads_to_none
        self.name = f"ampfused-{backend}" + ("+none" if grads_to_none else "")
        if api == "auto":
            api = "optimizer" if hasattr(ampfused, "FusedAdamW") else "functional"
        if api not in ("optimizer", "functional"):
            raise ValueError(f"unknown ampfused api {api!r}: use auto, optimizer or functional")
        self.api = api

    def build(self, inst: Instance, params: List[Tensor]) -> Runner:
        reasons = ops.registry.reasons_for(self.backend, inst.device, (inst.grad_dtype, torch.float32))
        if reasons:
            raise Unavailable(f"backend {self.backend!r}: " + "; ".join(reasons))
        if self.api == "optimizer":
            return OptimizerRunner(self.name, self.backend, inst, params, self.grads_to_none)
        if self.grads_to_none:
            raise Unavailable("the functional api owns its gradient buffers: no set-to-None loop")
        return FunctionalRunner(self.name, self.backend, inst, params)


def ampfused_backends(device: torch.device) -> List[str]:
    """Backends to time on ``device``: all available ones except the Triton interpreter (triton off CUDA)."""
    return [b for b in ops.available_backends(device) if not (b == "triton" and device.type != "cuda")]


def ampfused_variants(device: torch.device, api: str = "auto", names: Optional[List[str]] = None) -> List[Variant]:
    """Each fast backend with gradients refilled in place, the best one also with gradients set to None. The
    reference backend is the specification every variant is checked against, not a contender: it is timed
    only when ``names`` asks for it (``--variants ampfused-reference``)."""
    backends = ampfused_backends(device)
    fast = [b for b in backends if b != "reference"]
    out = [AmpfusedVariant(b, api) for b in fast]
    if fast and api != "functional":
        out.insert(1, AmpfusedVariant(fast[0], api, grads_to_none=True))
    if "reference" in backends and names and any(n.startswith("ampfused-reference") for n in names):
        out.append(AmpfusedVariant("reference", api))
        if api != "functional":
            out.append(AmpfusedVariant("reference", api, grads_to_none=True))
    return out
