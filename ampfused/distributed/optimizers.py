"""ShardedFusedAdam, ShardedFusedAdamW and ShardedFusedSGD: the fused optimizers' math with ZeRO-1 sharding."""
from __future__ import annotations

from typing import Optional

from ..optim.adam import AdamMath
from ..optim.sgd import SgdMath
from .sharded import ShardedFusedOptimizer


class _ShardedAdamBase(AdamMath, ShardedFusedOptimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, foreach=None, fused=None, capturable=False,
                 differentiable=False):
        defaults = self.adam_defaults(lr, betas, eps, weight_decay, amsgrad, maximize, differentiable)
        super().__init__(params, defaults, process_group=process_group, grad_reduction=grad_reduction,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard)


class ShardedFusedAdam(_ShardedAdamBase):
    """Adam (L2 decay, ``torch.optim.Adam`` math) with ZeRO-1 sharding: the arguments of
    :class:`ampfused.FusedAdam`, plus ``process_group`` (``None``: the default group) and ``grad_reduction``
    (``"mean"``: gradients averaged over ranks as DDP does, ``"sum"``: summed, ``None``: already reduced, e.g. by
    DDP). ``spike_guard`` and ``max_grad_norm`` act on the global norm; ``track_nonfinite`` is not offered."""


class ShardedFusedAdamW(_ShardedAdamBase):
    """AdamW (decoupled weight decay) with ZeRO-1 sharding; see :class:`ShardedFusedAdam`."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class ShardedFusedSGD(SgdMath, ShardedFusedOptimizer):
    """SGD (``torch.optim.SGD`` math) with ZeRO-1 sharding; arguments of :class:`ampfused.FusedSGD` plus
    ``process_group`` and ``grad_reduction`` (see :class:`ShardedFusedAdam`)."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, foreach=None, fused=None, capturable=False,
                 differentiable=False):
        defaults = self.sgd_defaults(lr, momentum, dampening, weight_decay, nesterov, maximize, differentiable)
        super().__init__(params, defaults, process_group=process_group, grad_reduction=grad_reduction,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard)
