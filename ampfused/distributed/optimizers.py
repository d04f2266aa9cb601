"""ShardedFusedAdam, ShardedFusedAdamW and ShardedFusedSGD: the fused optimizers' math with ZeRO-1 sharding."""
from __future__ import annotations

from typing import Optional

from .. import ops
from ..optim import _params as P
from ..optim.adam import _check_unsupported
from .sharded import ShardedFusedOptimizer


class _ShardedAdamBase(ShardedFusedOptimizer):
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, foreach=None, fused=None, capturable=False,
                 differentiable=False):
        _check_unsupported(type(self).__name__, amsgrad, differentiable)
        P.check_lr(lr)
        P.check_eps(eps)
        P.check_betas(betas)
        P.check_weight_decay(weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=bool(maximize),
                        amsgrad=False)
        super().__init__(params, defaults, process_group=process_group, grad_reduction=grad_reduction,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        P.check_betas(group["betas"], where)
        P.check_eps(group["eps"], where)
        P.check_weight_decay(group["weight_decay"], where)
        if group.get("amsgrad", False):
            raise ValueError(f"amsgrad=True{where}: {type(self).__name__} does not implement AMSGrad")

    def _update(self, seg, params, grads, group, partials, inv_scale, lr, max_norm) -> None:
        beta1, beta2 = group["betas"]
        ops.call_step_("adam_step_", params, grads, seg.master, seg.states["exp_avg"], seg.states["exp_avg_sq"],
                       seg.steps, partials, inv_scale, lr, self._stats, float(beta1), float(beta2),
                       float(group["eps"]), float(group["weight_decay"]), max_norm, self.decoupled,
                       bool(group["maximize"]), self._backend_name(seg, params, grads))

    def _state_keys_for_load(self, saved: dict):
        if "max_exp_avg_sq" in saved:
            raise ValueError(f"the loaded state has 'max_exp_avg_sq' (an AMSGrad optimizer's state): "
                             f"{type(self).__name__} does not implement AMSGrad")
        return self.state_names


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


class ShardedFusedSGD(ShardedFusedOptimizer):
    """SGD (``torch.optim.SGD`` math) with ZeRO-1 sharding; arguments of :class:`ampfused.FusedSGD` plus
    ``process_group`` and ``grad_reduction`` (see :class:`ShardedFusedAdam`)."""

    state_names = ("momentum_buffer",)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, foreach=None, fused=None, capturable=False,
                 differentiable=False):
        if differentiable:
            raise ValueError("differentiable=True: ShardedFusedSGD updates in place without autograd")
        P.check_lr(lr)
        P.check_momentum(momentum, dampening, nesterov)
        P.check_weight_decay(weight_decay)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), maximize=bool(maximize))
        super().__init__(params, defaults, process_group=process_group, grad_reduction=grad_reduction,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        P.check_momentum(group["momentum"], group["dampening"], group["nesterov"], where)
        P.check_weight_decay(group["weight_decay"], where)

    def _update(self, seg, params, grads, group, partials, inv_scale, lr, max_norm) -> None:
        momentum = float(group["momentum"])
        ops.call_step_("sgd_step_", params, grads, seg.master,
                       seg.states["momentum_buffer"] if momentum != 0 else None, seg.steps, partials, inv_scale, lr,
                       self._stats, momentum, float(group["dampening"]), float(group["weight_decay"]),
                       bool(group["nesterov"]), max_norm, bool(group["maximize"]),
                       self._backend_name(seg, params, grads))

    # as torch.optim.SGD: no step in the state; momentum_buffer None until a step with momentum
    def _export_param_state(self, st: dict, step: float) -> dict:
        has_momentum = any(g["momentum"] != 0 for g in self.param_groups)
        out = {"momentum_buffer": st["momentum_buffer"] if step > 0 and has_momentum else None}
        if "master_param" in st:
            out["master_param"] = st["master_param"]
        return out

    def _import_step(self, saved: dict) -> float:
        if "step" in saved:
            return super()._import_step(saved)
        return 0.0 if saved.get("momentum_buffer") is None else 1.0

    def _state_keys_for_load(self, saved: dict):
        return ("momentum_buffer",) if saved.get("momentum_buffer") is not None else ()
