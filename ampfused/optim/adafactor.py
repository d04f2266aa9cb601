"""FusedAdafactor: torch.optim.Adafactor's math (factored second moment, relative step size from the parameter's
RMS, update clipping by ``d``) in the fused step, with no host read."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import ops
from . import _params as P
from . import _precision
from ..ops.factored import ShardSums
from ._factored_state import FactoredSegment, import_state_dict
from ._base import FusedOptimizer
from ._segment import split_dim
from ._step_op import StepOp


def _check(lr, beta2_decay, eps, d, weight_decay, where: str = "") -> None:
    """torch.optim.Adafactor's rules, in its order and with its messages (NaN refused too)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    elif not P._is_number(lr) or not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}{where}")
    if not P._is_number(beta2_decay) or not 0.0 >= beta2_decay:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}{where}")
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"eps must be a pair (epsilon1 or None, epsilon2), got {eps!r}{where}")
    if eps[0] is not None and (not P._is_number(eps[0]) or not 0.0 <= eps[0]):
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}{where}")
    if not P._is_number(eps[1]) or not 0.0 <= eps[1]:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}{where}")
    if not P._is_number(d) or not 1.0 <= d:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}{where}")
    if not P._is_number(weight_decay) or not 0.0 <= weight_decay or math.isinf(weight_decay):
        raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}{where}")


def _refuse(params) -> None:
    """torch's refusal of complex parameters (before any step here), and of DTensor parameters split along more
    than one dimension, or partial (FSDP2 splits each along one, dimension 0 by default)."""
    from ._segment import is_dtensor
    groups = params if isinstance(params, (list, tuple)) else [params]
    for g in groups:
        items = g.get("params", []) if isinstance(g, dict) else [g]
        items = [items] if isinstance(items, Tensor) else items
        for p in items:
            p = p[1] if isinstance(p, tuple) else p
            if isinstance(p, Tensor) and p.is_complex():
                raise RuntimeError("Adafactor does not support complex parameters")
            if is_dtensor(p):
                shard_dim(p)


def shard_dim(p) -> Optional[int]:
    """The dimension a DTensor parameter is split along (:func:`._segment.shard_dim`): its factors' sums over a
    whole matrix are summed over the ranks of the split (docs/adafactor.md)."""
    return split_dim(p, "FusedAdafactor", "docs/adafactor.md")


class AdafactorMath(StepOp):
    """What makes an optimizer Adafactor: torch.optim.Adafactor's arguments and rules, the step op, and its state
    (``row_var``/``col_var`` or ``variance``, one flat ``factors`` buffer per segment)."""

    step_op = "adafactor_step_"
    state_names = ("row_var", "col_var", "variance")
    segment_class = FactoredSegment
    # what torch.optim.Adafactor.__setstate__ gives a group key that a loaded (older) state dict lacks
    torch_load_defaults = dict(foreach=None, maximize=False)

    @staticmethod
    def adafactor_defaults(lr, beta2_decay, eps, d, weight_decay, foreach, maximize) -> dict:
        _check(lr, beta2_decay, eps, d, weight_decay)
        return dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d, weight_decay=weight_decay,
                    foreach=foreach, maximize=bool(maximize))

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        _check(group["lr"], group["beta2_decay"], group["eps"], group["d"], group["weight_decay"], where)

    def _state_names_for(self, group: dict) -> tuple:
        return ()  # (its segments make their factored state themselves: FactoredSegment)

    def _op_hyper(self, group: dict) -> dict:
        eps1, eps2 = group["eps"]
        return dict(beta2_decay=float(group["beta2_decay"]), eps1=None if eps1 is None else float(eps1),
                    eps2=float(eps2), d=float(group["d"]), weight_decay=float(group["weight_decay"]),
                    maximize=bool(group["maximize"]))

    def _step_op(self, seg, params, grads, group, partials, inv_scale, lr, max_norm, backend: str) -> None:
        if seg.sharded:
            self._sharded_step(seg, params, grads, group, partials, inv_scale, lr, max_norm, backend)
            return
        super()._step_op(seg, params, grads, group, partials, inv_scale, lr, max_norm, backend)

    def _sharded_step(self, seg, params, grads, group, partials, inv_scale, lr, max_norm, backend: str) -> None:
        """FSDP2: the step over this rank's shards in its three phases on ``backend``, each whole parameter's sums
        summed over the ranks of the split between them on the device (two all-reduces for the segment;
        ``ampfused.ops.factored.ShardSums``)."""
        call = self._step_call(seg, group, partials, inv_scale, lr, max_norm, params=params, grads=grads)
        ops.check_step(call)
        sh = getattr(seg, "shard_sums", None)
        if sh is None or sh.shapes != [tuple(p.shape) for p in params]:
            sh = seg.shard_sums = ShardSums([tuple(p.shape) for p in params], [tuple(p.shape) for p in seg.params],
                                            [shard_dim(p) for p in seg.params], seg.steps.device)
        for phase, part in ((1, sh.first), (2, sh.second), (3, None)):
            call.shard = (phase, sh)
            ops.run_step(call, backend)
            if part is not None and part.stop > part.start:
                for pg in self._segs.shard_groups:
                    torch.distributed.all_reduce(sh.sums[part], op=torch.distributed.ReduceOp.SUM, group=pg)

    def _import_state_dict(self, state_dict: dict) -> None:
        import_state_dict(self, state_dict)


class FusedAdafactor(AdafactorMath, FusedOptimizer):
    """``torch.optim.Adafactor`` (its arguments, defaults, state-dict keys and update rule) in the fused step:
    the gradients' inf/NaN check and skip, ``max_grad_norm`` clipping, ``ampfused.GradScaler`` and
    ``grad_divisor`` as the other fused optimizers, and no host read (torch reads two norms per parameter).

    The update (:func:`ampfused.ops.reference_adafactor.adafactor_step_`): row and column factors of the second
    moment for parameters of two or more dimensions (a variance vector for the others), relative step size
    ``max(eps2, RMS(w)) * min(lr, 1/sqrt(t))``, update clipped to RMS ``d``, decoupled weight decay ``lr *
    weight_decay``. ``eps=(None, ...)`` takes fp32's epsilon (the math runs in fp32). ``foreach`` is kept in
    the groups as torch keeps it and does not change the step.

    ``master_weights=None`` keeps fp32 masters for fp16/bf16 parameters; ``store_param_remainders=True`` keeps
    only the 16 bits of each bf16 parameter's master that the weight lacks (2 bytes per parameter, the fp32-master
    run bit for bit); ``bf16_stochastic_round=True`` keeps no master and rounds bf16 weights stochastically
    (keyed by ``seed``). The row and column factors stay fp32.
    """

    def __init__(self, params, lr=1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0, *, foreach: Optional[bool] = None, maximize: bool = False,
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, track_nonfinite: bool = False, module=None,
                 health: bool = False,
                 store_param_remainders: bool = False, bf16_stochastic_round: bool = False, seed: int = 0):
        params = list(params) if not isinstance(params, (Tensor, dict)) and hasattr(params, "__iter__") else params
        self._precision = _precision.make(type(self).__name__, master_weights, store_param_remainders,
                                          bf16_stochastic_round, {}, seed)
        defaults = self.adafactor_defaults(lr, beta2_decay, eps, d, weight_decay, foreach, maximize)
        _refuse(params)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, master_weights=master_weights,
                         backend=backend, spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module,
                         health=health)
