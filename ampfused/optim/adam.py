"""FusedAdam and FusedAdamW: torch.optim.Adam / AdamW math on fp32 master weights, in the fused step."""
from __future__ import annotations

from typing import Optional

from .. import ops
from ._base import FusedOptimizer, _check_lr


class _FusedAdamBase(FusedOptimizer):
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, maximize=False,
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None):
        self._check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, master_weights=master_weights,
                         backend=backend, spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module)

    @staticmethod
    def _check_hyper(lr, betas, eps, weight_decay) -> None:
        _check_lr(lr)
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")

    def _validate_group(self, group: dict) -> None:
        self._check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _update(self, seg, group, partials, inv_scale, lr, max_norm) -> None:
        beta1, beta2 = group["betas"]
        ops.adam_step_(seg.flat.data, seg.flat.grad, seg.master, seg.states["exp_avg"], seg.states["exp_avg_sq"],
                       seg.step, partials, inv_scale, lr, self._stats, beta1=float(beta1), beta2=float(beta2),
                       eps=float(group["eps"]), weight_decay=float(group["weight_decay"]), max_norm=max_norm,
                       decoupled=self.decoupled, maximize=bool(group["maximize"]), backend=self.backend)


class FusedAdam(_FusedAdamBase):
    """Adam with L2 weight decay (``torch.optim.Adam`` math) over flat buffers and fp32 master weights.

    ``master_weights=None`` keeps fp32 masters for fp16/bf16 parameters and none for fp32 ones. Each step
    checks the gradients for infs/NaNs (skipping the step on the device if any), measures their norm, clips
    to ``max_grad_norm`` when given, and updates, in two kernel launches and without a host sync.
    """


class FusedAdamW(_FusedAdamBase):
    """AdamW (decoupled weight decay, ``torch.optim.AdamW`` math) over flat buffers and fp32 master weights.

    See :class:`FusedAdam`; the default ``weight_decay`` is 1e-2 as in torch.
    """

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, maximize=False,
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None):
        super().__init__(params, lr, betas, eps, weight_decay, maximize=maximize, max_grad_norm=max_grad_norm,
                         master_weights=master_weights, backend=backend, spike_guard=spike_guard,
                         track_nonfinite=track_nonfinite, module=module)
