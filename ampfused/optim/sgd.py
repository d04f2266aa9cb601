"""FusedSGD: torch.optim.SGD math (momentum, dampening, nesterov, weight decay) on fp32 master weights."""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from . import _precision
from . import _params as P
from ._base import FusedOptimizer
from ._step_op import StepOp


class SgdMath(StepOp):
    """What makes an optimizer SGD, shared by :class:`FusedSGD` and its ZeRO-1 sharded version: arguments, the
    rules of its hyperparameters, the step op and torch.optim.SGD's state-dict layout."""

    step_op = "sgd_step_"
    op_states = {"momentum_buf": "momentum_buffer"}
    state_names = ("momentum_buffer",)
    # what torch.optim.SGD.__setstate__ gives a group key that a loaded (older) state dict lacks
    torch_load_defaults = dict(nesterov=False, maximize=False, foreach=None, differentiable=False, fused=False)

    @classmethod
    def sgd_defaults(cls, lr, momentum, dampening, weight_decay, nesterov, maximize, differentiable, *,
                     foreach=None, fused=None) -> dict:
        """The group defaults, with torch.optim.SGD's keys (``foreach`` and ``fused`` kept as given; they do not
        change the step)."""
        if differentiable:
            raise ValueError(f"differentiable=True: {cls.__name__} updates in place without autograd")
        P.check_impl_flags(foreach, fused, differentiable)
        P.check_lr(lr)
        P.check_momentum(momentum, dampening, nesterov)
        P.check_weight_decay(weight_decay)
        return dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    nesterov=bool(nesterov), maximize=bool(maximize), foreach=foreach, differentiable=False,
                    fused=fused)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        P.check_momentum(group["momentum"], group["dampening"], group["nesterov"], where)
        P.check_weight_decay(group["weight_decay"], where)

    def _op_hyper(self, group: dict) -> dict:
        return dict(momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                    weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                    maximize=bool(group["maximize"]))

    # torch.optim.SGD keeps no step, and state only for parameters of groups with momentum that a step saw: a
    # parameter without a momentum buffer exports only its master (when it has one), or nothing; with stochastic
    # rounding (compact modes) its step count too.
    def _export_param_state(self, st: dict, step: float, group: Optional[dict] = None) -> dict:
        groups = [group] if group is not None else self.param_groups
        has_momentum = any(g["momentum"] != 0 for g in groups)
        out = {k: st[k] for k in ("momentum_buffer", "momentum_buffer_scale", "momentum_buffer_exponent") if k in st} \
            if step > 0 and has_momentum else {}
        for key in ("master_param", "master_remainder"):
            if key in st:
                out[key] = st[key]
        precision = getattr(self, "_precision", None)
        if step > 0 and precision is not None and precision.uses_seed:
            # the stochastic rounding's draws are keyed by the step count: kept so that a resume draws as the
            # uninterrupted run (torch.optim.SGD ignores the key)
            out["step"] = torch.tensor(step, dtype=torch.float32)
        return out

    def _import_step(self, saved: dict) -> float:
        if "step" in saved:
            return super()._import_step(saved)
        return 0.0 if saved.get("momentum_buffer") is None else 1.0

    def _state_keys_for_load(self, saved: dict, group: Optional[dict] = None):
        return ("momentum_buffer",) if saved.get("momentum_buffer") is not None else ()

    def _state_names_for(self, group: dict) -> tuple:
        # as torch.optim.SGD: no momentum buffer until a step with momentum needs one
        return self.state_names if group["momentum"] != 0 else ()


class FusedSGD(SgdMath, FusedOptimizer):
    """SGD with fp32 master weights for fp16/bf16 parameters, in the fused check + norm + clip + update
    step. ``foreach``, ``fused`` and ``capturable`` are accepted for drop-in use (``foreach`` and ``fused`` kept
    in the param groups as torch keeps them) and do not change the step. State precision
    (docs/state-precision.md): ``store_param_remainders``, ``bf16_stochastic_round`` and ``seed`` as in
    :class:`ampfused.FusedAdam`; ``momentum_dtype=torch.bfloat16`` stores the momentum buffer in bf16,
    ``torch.uint8`` in 8-bit codes with block scales."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None,
                 health: bool = False,
                 foreach=None, fused=None, capturable=False, differentiable=False,
                 store_param_remainders: bool = False, bf16_stochastic_round: bool = False,
                 momentum_dtype: torch.dtype = torch.float32, seed: int = 0):
        self._precision = _precision.make(type(self).__name__, master_weights, store_param_remainders,
                                          bf16_stochastic_round, {"momentum_dtype": momentum_dtype}, seed)
        defaults = self.sgd_defaults(lr, momentum, dampening, weight_decay, nesterov, maximize, differentiable,
                                     foreach=foreach, fused=fused)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, master_weights=master_weights,
                         backend=backend, spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module,
                         health=health)

    def _check_hyperparameters(self) -> None:
        if torch.compiler.is_compiling():
            # first, before the traced step reads any segment: a group whose momentum was switched on since the
            # last step gets its buffer here, so the trace sees the segments the step will use
            for group in self.param_groups:
                if self._state_names_for(group):
                    self._init_group(group)
        super()._check_hyperparameters()

    def _init_group(self, group: dict) -> None:
        """Make the momentum buffer of ``group`` when its step now reads one that its segments lack (momentum
        switched on since the last step), carrying every other state; nothing when they hold it.

        The name is torch.optim's: torch.compile runs an optimizer's ``_init_group(param_groups[i], ...)`` as
        plain Python while it traces ``step`` (that is how torch.optim's lazily made state gets made) and traces
        the rest against the state it left, so a compiled step, ``fullgraph=True`` included, makes the buffer as
        an eager step does. Where dynamo traces this call instead (it could not map the arguments), nothing is
        made: the compiling branch of ``_check_hyperparameters`` then raises, naming the group and what to do,
        and a step compiled without ``fullgraph`` runs eagerly there."""
        if torch.compiler.is_dynamo_compiling():  # (False when dynamo runs this call as Python)
            return
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        self._validate_and_provide(group, f" in param_groups[{gi}]")
