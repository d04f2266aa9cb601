"""FusedAdam and FusedAdamW: torch.optim.Adam / AdamW math on fp32 master weights, in the fused step."""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from . import _params as P
from . import _precision
from ._base import FusedOptimizer
from ._step_op import StepOp


def _check_unsupported(cls: str, amsgrad, differentiable) -> None:
    if amsgrad:
        raise ValueError(f"amsgrad=True: {cls} does not implement AMSGrad; use torch.optim.AdamW(amsgrad=True)")
    if differentiable:
        raise ValueError(f"differentiable=True: {cls} updates in place without autograd")


class AdamMath(StepOp):
    """What makes an optimizer Adam/AdamW, shared by the fused optimizers and their ZeRO-1 sharded versions:
    arguments, the rules of its hyperparameters, the step op and its state in a state dict."""

    step_op = "adam_step_"

    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False
    # what torch.optim.Adam.__setstate__ gives a group key that a loaded (older) state dict lacks
    torch_load_defaults = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                               decoupled_weight_decay=False, fused=None)

    @classmethod
    def adam_defaults(cls, lr, betas, eps, weight_decay, amsgrad, maximize, differentiable, *, foreach=None,
                      fused=None, capturable=False, decoupled_weight_decay=None) -> dict:
        """The group defaults, checked in torch.optim.Adam's order and with its messages. The keys are torch's
        (so state dicts have its layout); ``foreach``, ``fused`` and ``capturable`` are kept as given and do not
        change the step, which is always fused and capturable."""
        P.check_foreach_lr(lr, foreach, capturable)
        _check_unsupported(cls.__name__, amsgrad, differentiable)
        P.check_impl_flags(foreach, fused, differentiable)
        P.check_lr(lr)
        P.check_eps(eps)
        P.check_betas(betas, foreach=foreach, capturable=capturable)
        P.check_weight_decay(weight_decay)
        decoupled = cls.decoupled if decoupled_weight_decay is None else bool(decoupled_weight_decay)
        return dict(lr=lr, betas=P.squeeze_betas(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                    maximize=bool(maximize), foreach=foreach, capturable=bool(capturable), differentiable=False,
                    fused=fused, decoupled_weight_decay=decoupled)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        P.check_betas(group["betas"], where, foreach=group.get("foreach"), capturable=group.get("capturable", False))
        P.check_eps(group["eps"], where)
        P.check_weight_decay(group["weight_decay"], where)
        if group.get("amsgrad", False):
            raise ValueError(f"amsgrad=True{where}: {type(self).__name__} does not implement AMSGrad (it keeps no "
                             "max_exp_avg_sq); use torch.optim.AdamW(amsgrad=True) for it")
        if group.get("differentiable", False):
            raise ValueError(f"differentiable=True{where}: {type(self).__name__} updates in place without autograd")

    def _hyper(self, group: dict) -> tuple:
        """The step's (beta1, beta2, decoupled) as Python values (see :func:`._params.hyper_value`)."""
        beta1, beta2 = group["betas"]
        return (P.hyper_value(beta1, "betas[0]"), P.hyper_value(beta2, "betas[1]"),
                bool(group.get("decoupled_weight_decay", self.decoupled)))

    def _op_hyper(self, group: dict) -> dict:
        beta1, beta2, decoupled = self._hyper(group)
        return dict(beta1=beta1, beta2=beta2, eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    decoupled=decoupled, maximize=bool(group["maximize"]))

    def _state_keys_for_load(self, saved: dict, group: Optional[dict] = None):
        if "max_exp_avg_sq" in saved:
            raise ValueError(f"the loaded state has 'max_exp_avg_sq' (an AMSGrad optimizer's state): "
                             f"{type(self).__name__} does not implement AMSGrad")
        return self.state_names


class _FusedAdamBase(AdamMath, FusedOptimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None,
                 health: bool = False,
                 foreach=None, fused=None, capturable=False, differentiable=False, decoupled_weight_decay=None,
                 store_param_remainders: bool = False, bf16_stochastic_round: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32,
                 seed: int = 0):
        # state precision (docs/state-precision.md): read by the segments this constructor builds
        self._precision = _precision.make(type(self).__name__, master_weights, store_param_remainders,
                                          bf16_stochastic_round,
                                          {"exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype}, seed)
        defaults = self.adam_defaults(lr, betas, eps, weight_decay, amsgrad, maximize, differentiable,
                                      foreach=foreach, fused=fused, capturable=capturable,
                                      decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, master_weights=master_weights,
                         backend=backend, spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module,
                         health=health)


class FusedAdam(_FusedAdamBase):
    """Adam with L2 weight decay (``torch.optim.Adam`` math), fp32 master weights for fp16/bf16 parameters.

    ``master_weights=None`` keeps fp32 masters for fp16/bf16 parameters and none for fp32 ones. Each step
    checks the gradients for infs/NaNs (skipping the step on the device if any), measures their norm, clips
    to ``max_grad_norm`` when given, and updates, in two kernel launches and without a host sync.
    ``foreach``, ``fused`` and ``capturable`` are accepted for drop-in use, kept in the param groups as torch
    keeps them, and do not change the step (always fused and capturable). ``decoupled_weight_decay=True`` makes
    it AdamW, as in torch. ``betas`` may be numbers or two 1-element tensors (see docs/differences-from-torch.md
    for when a device tensor is read).

    State precision (docs/state-precision.md): ``store_param_remainders=True`` keeps for bf16 parameters only
    the 16 bits of the fp32 master that the weight lacks (10 bytes of state per parameter instead of 12, the
    masters exactly those of the fp32 mode); ``bf16_stochastic_round=True`` keeps no master for bf16 parameters
    and rounds their update stochastically; ``exp_avg_dtype``/``exp_avg_sq_dtype=torch.bfloat16`` store the
    moments in bf16 (stochastic rounding), ``torch.uint8`` as 8-bit codes with one fp32 power-of-two scale per
    block of 256 elements (stochastic rounding; about 1.02 bytes per moment). ``seed`` keys the stochastic
    rounding.
    """


class FusedAdamW(_FusedAdamBase):
    """AdamW (decoupled weight decay, ``torch.optim.AdamW`` math); see :class:`FusedAdam`. The default
    ``weight_decay`` is 1e-2 as in torch."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None,
                 health: bool = False,
                 foreach=None, fused=None, capturable=False, differentiable=False,
                 store_param_remainders: bool = False, bf16_stochastic_round: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32,
                 seed: int = 0):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module, health=health,
                         foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable,
                         decoupled_weight_decay=True, store_param_remainders=store_param_remainders,
                         bf16_stochastic_round=bf16_stochastic_round, exp_avg_dtype=exp_avg_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype, seed=seed)

    # torch.optim.AdamW stays AdamW whatever a loaded state dict's groups say (its __setstate__ sets the key)
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
