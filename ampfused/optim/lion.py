"""FusedLion: the Lion optimizer (sign of an interpolated momentum, decoupled weight decay) in the fused step.

Arguments and state as optimi's ``Lion`` (``lr``, ``betas``, ``weight_decay``; one moment, ``exp_avg``), so state
dicts load both ways (:func:`optimi_state_dict` gives optimi's layout; optimi's loads as it is).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from . import _params as P
from . import _precision
from ._base import FusedOptimizer
from ._step_op import StepOp
from ._state import torch_state_dict

# optimi's group keys that the fused step has no use for (its implementation switches and Kahan summation,
# which the fp32 masters replace); dropped when an optimi state dict is loaded
_OPTIMI_ONLY = ("beta1", "beta2", "decouple_lr", "max_lr", "kahan_sum", "foreach", "triton", "gradient_release",
                "setup")


class LionMath(StepOp):
    """What makes an optimizer Lion, shared by :class:`FusedLion` and its ZeRO-1 sharded version: arguments, the
    rules of its hyperparameters, the step op and its state in a state dict."""

    step_op = "lion_step_"
    state_names = ("exp_avg",)
    torch_load_defaults = dict(maximize=False)

    @classmethod
    def lion_defaults(cls, lr, betas, weight_decay, maximize) -> dict:
        """The group defaults, checked with torch.optim's messages (optimi's rules: ``0 <= beta < 1``)."""
        P.check_lr(lr)
        P.check_betas(betas)
        P.check_weight_decay(weight_decay)
        return dict(lr=lr, betas=P.squeeze_betas(betas), weight_decay=weight_decay, maximize=bool(maximize))

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        P.check_betas(group["betas"], where)
        P.check_weight_decay(group["weight_decay"], where)

    def _betas(self, group: dict) -> tuple:
        beta1, beta2 = group["betas"]
        return P.hyper_value(beta1, "betas[0]"), P.hyper_value(beta2, "betas[1]")

    def _op_hyper(self, group: dict) -> dict:
        beta1, beta2 = self._betas(group)
        return dict(beta1=beta1, beta2=beta2, weight_decay=float(group["weight_decay"]),
                    maximize=bool(group["maximize"]))

    # optimi's Lion keeps no step count; this one keeps it (it keys the stochastic rounding's draws, and a resumed
    # run counts on): an optimi state dict loads as after one step
    def _import_step(self, saved: dict) -> float:
        if "step" in saved:
            return super()._import_step(saved)
        return 1.0

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads this optimizer's state dicts and optimi ``Lion``'s (its ``beta1``/``beta2`` become ``betas``;
        its ``kahan_comp`` is not kept: the masters hold what it compensates)."""
        if isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list):
            state_dict = dict(state_dict, param_groups=[_from_optimi(g) for g in state_dict["param_groups"]])
        super().load_state_dict(state_dict)


def _from_optimi(group):
    if not isinstance(group, dict) or "beta1" not in group or "betas" in group:
        return group
    if group.get("decouple_lr") and group.get("weight_decay", 0) != 0:
        raise ValueError("the loaded param group has decouple_lr=True with weight_decay != 0 (optimi's fully "
                         "decoupled decay, scaled by lr / max_lr): FusedLion decays by lr * weight_decay")
    out = {k: v for k, v in group.items() if k not in _OPTIMI_ONLY}
    out["betas"] = (group["beta1"], group["beta2"])
    out.setdefault("maximize", False)
    return out


def optimi_state_dict(state_dict: dict) -> dict:
    """A :class:`FusedLion` state dict in optimi ``Lion``'s layout: fp32 ``exp_avg`` (compact state decoded, as
    :func:`ampfused.optim.torch_state_dict`), ``kahan_comp`` None, groups with optimi's keys; masters dropped.
    The moments are copies: torch's ``load_state_dict`` keeps a tensor of the parameter's dtype as it is, so a view
    of this optimizer's buffers would be stepped by both optimizers."""
    sd = torch_state_dict(state_dict)
    state = {}
    for k, e in sd["state"].items():
        state[k] = ({"exp_avg": e["exp_avg"].clone(), "kahan_comp": None} if isinstance(e, dict) and "exp_avg" in e
                    else e)
    groups = []
    for g in sd["param_groups"]:
        if g.get("maximize"):
            raise ValueError("optimi's Lion has no maximize: a group with maximize=True has no optimi equivalent")
        beta1, beta2 = g["betas"]
        groups.append(dict(params=g["params"], lr=g["lr"], beta1=float(beta1), beta2=float(beta2),
                           weight_decay=g["weight_decay"], decouple_lr=False, max_lr=None, kahan_sum=False,
                           foreach=None, triton=False, gradient_release=False, setup=True))
    return {"state": state, "param_groups": groups}


class FusedLion(LionMath, FusedOptimizer):
    """Lion (``c = beta1 m + (1 - beta1) g``, ``w = w (1 - lr wd) - lr sign(c)``, ``m = beta2 m + (1 - beta2) g``)
    with fp32 master weights for fp16/bf16 parameters, in the fused check + norm + clip + update step.

    Arguments as optimi's ``Lion`` (``lr`` defaults to 1e-4, ``betas`` to (0.9, 0.99)); ``maximize`` as torch's
    optimizers. State precision (docs/state-precision.md): ``store_param_remainders``, ``bf16_stochastic_round``
    and ``seed`` as in :class:`ampfused.FusedAdam`; ``exp_avg_dtype=torch.bfloat16`` stores the moment in bf16,
    ``torch.uint8`` in 8-bit codes with block scales (with no master: about 1 byte of state per parameter)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None,
                 health: bool = False,
                 store_param_remainders: bool = False, bf16_stochastic_round: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32, seed: int = 0):
        self._precision = _precision.make(type(self).__name__, master_weights, store_param_remainders,
                                          bf16_stochastic_round, {"exp_avg_dtype": exp_avg_dtype}, seed)
        defaults = self.lion_defaults(lr, betas, weight_decay, maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, master_weights=master_weights,
                         backend=backend, spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module,
                         health=health)
