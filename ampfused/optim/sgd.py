"""FusedSGD: torch.optim.SGD math (momentum, dampening, nesterov, weight decay) on fp32 master weights."""
from __future__ import annotations

from typing import Optional

from .. import ops
from ._base import FusedOptimizer, _check_lr


class FusedSGD(FusedOptimizer):
    """SGD over flat buffers and fp32 master weights, in the fused check + norm + clip + update step."""

    state_names = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None):
        self._check_hyper(lr, momentum, dampening, weight_decay, nesterov)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, master_weights=master_weights,
                         backend=backend, spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module)

    @staticmethod
    def _check_hyper(lr, momentum, dampening, weight_decay, nesterov) -> None:
        _check_lr(lr)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _validate_group(self, group: dict) -> None:
        self._check_hyper(group["lr"], group["momentum"], group["dampening"], group["weight_decay"],
                          group["nesterov"])

    def _update(self, seg, group, partials, inv_scale, lr, max_norm) -> None:
        ops.sgd_step_(seg.flat.data, seg.flat.grad, seg.master, seg.states["momentum_buffer"], seg.step, partials,
                      inv_scale, lr, self._stats, momentum=float(group["momentum"]),
                      dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                      nesterov=bool(group["nesterov"]), max_norm=max_norm, maximize=bool(group["maximize"]),
                      backend=self.backend)

    # torch.optim.SGD keeps no step; its momentum_buffer is None until the first step with momentum.
    def _export_param_state(self, st: dict, step: float) -> dict:
        out = {"momentum_buffer": st["momentum_buffer"] if step > 0 and self._has_momentum() else None}
        if "master_param" in st:
            out["master_param"] = st["master_param"]
        return out

    def _has_momentum(self) -> bool:
        return any(g["momentum"] != 0 for g in self.param_groups)

    def _import_step(self, saved: dict) -> float:
        if "step" in saved:
            return super()._import_step(saved)
        return 0.0 if saved.get("momentum_buffer") is None else 1.0

    def _state_keys_for_load(self, saved: dict):
        return ("momentum_buffer",) if saved.get("momentum_buffer") is not None else ()
