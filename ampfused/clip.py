"""``ampfused.clip_grad_norm_``: drop-in for ``torch.nn.utils.clip_grad_norm_``.

Differences from torch, all in the user's favour:

* The norm is accumulated in fp32 for fp16/bf16 gradients (torch rounds each tensor's norm to the gradient
  dtype) and returned in fp32 (fp64 when a gradient is fp64); low-precision gradients are scaled in fp32
  and rounded once.
* Right after ``ampfused.GradScaler.unscale_`` the norm is already known: the unscale pass measured it. When
  the gradients are the same tensors, unchanged since (same ``_version``), it is reused instead of reading
  every gradient again.
* Parameters of one fused ampfused optimizer get the clip folded into that optimizer's next step, and their
  ``.grad`` is left as it is (the step applies the clip). The clip means what it means where it is called: made
  on gradients a scaler has not unscaled yet (torch's recipe clips them to ``max_norm * scale``), or on gradients
  that change before the step, its coefficient is taken from the gradients as they were at the call and applied
  by the step, on the device, as an eager clip at that point would have scaled them.
* ``max_norm=inf`` never touches the gradients (torch multiplies them by NaN when the norm is infinite).

Limitation: a change made through ``grad.data`` bypasses ``_version`` (as it does for autograd), so call
this function, not a cached value, after editing gradients that way.
"""
from __future__ import annotations

import math
import types
import warnings
import weakref
from collections import deque
from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import Tensor
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from . import ops

__all__ = ["clip_grad_norm_"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --- the norm left behind by GradScaler.unscale_ ------------------------------------------------------------
class _NormRecord:
    """The partials of one unscale pass, valid while the same gradient tensors keep the same versions."""

    __slots__ = ("grads", "partials")

    def __init__(self, grads: List[Tensor], partials: Dict[torch.device, Tensor]):
        # weak references: the record must never keep a gradient alive
        self.grads = {id(g): (weakref.ref(g), g._version) for g in grads}
        self.partials = partials

    def matches(self, grads: List[Tensor]) -> bool:
        if len(grads) != len(self.grads):
            return False
        for g in grads:
            entry = self.grads.get(id(g))
            if entry is None or entry[0]() is not g or entry[1] != g._version:
                return False
        return True


# A few records, newest last: one per optimizer unscaled this iteration is what a loop needs.
_RECORDS: deque = deque(maxlen=16)


def _remember_norm(grads: List[Tensor], partials: Dict[torch.device, Tensor]) -> None:
    """Called by ``GradScaler.unscale_`` with the unscaled gradients and their partials per device."""
    _RECORDS.append(_NormRecord(grads, partials))


def _cached_partials(grads: List[Tensor]) -> Optional[Dict[torch.device, Tensor]]:
    for record in reversed(_RECORDS):
        if record.matches(grads):
            return record.partials
    return None


# --- validation ----------------------------------------------------------------------------------------------
def _param_list(parameters) -> List[Tensor]:
    if isinstance(parameters, Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    params = list(parameters)
    if is_generator and not params:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"parameters[{i}] must be a torch.Tensor, got {type(p).__name__}")
        g = p.grad
        if g is not None and g.dtype not in _GRAD_DTYPES:
            raise TypeError(f"parameters[{i}] (shape {tuple(p.shape)}) has a {g.dtype} gradient: clip_grad_norm_ "
                            "takes floating-point gradients (float32, bfloat16, float16, float64); use "
                            "torch.nn.utils.clip_grad_norm_ for complex ones")
    return params


def _checked_float(name: str, value, rule: str, ok) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not ok(v):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return v


# --- norm ----------------------------------------------------------------------------------------------------
def _by_device(grads: List[Tensor]) -> Dict[torch.device, List[Tensor]]:
    out: Dict[torch.device, List[Tensor]] = {}
    for g in grads:
        out.setdefault(g.device, []).append(g)
    return out


def _check_foreach(by_device: Dict[torch.device, List[Tensor]], foreach: Optional[bool]) -> None:
    for device in by_device:
        if foreach and not _device_has_foreach_support(device):
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")


def _norm_from_partials(partials: Dict[torch.device, Tensor], first: torch.device) -> Tensor:
    if len(partials) == 1:
        return ops.reduce_partials(next(iter(partials.values())))[0].to(first)
    return torch.stack([p[0].sum().to(first) for p in partials.values()]).sum().sqrt()


def _l2_partials(by_device: Dict[torch.device, List[Tensor]]) -> Dict[torch.device, Tensor]:
    one = {d: torch.ones((), dtype=torch.float32, device=d) for d in by_device}
    return {d: ops.norm_check(gs, one[d]) for d, gs in by_device.items()}


def _p_norm(by_device: Dict[torch.device, List[Tensor]], norm_type: float, foreach: Optional[bool],
            first: torch.device) -> Tensor:
    """torch's two-level p-norm (per tensor, then over those norms), accumulated in at least fp32."""
    norms: List[Tensor] = []
    for device, gs in by_device.items():
        # groups in order of first appearance: the order of the final sum must not depend on hashing
        for acc in dict.fromkeys(torch.promote_types(g.dtype, torch.float32) for g in gs):
            group = [g for g in gs if torch.promote_types(g.dtype, torch.float32) == acc]
            if (foreach is None and _has_foreach_support(group, device)) or foreach:
                norms.extend(torch._foreach_norm(group, norm_type, dtype=acc))
            else:
                norms.extend(torch.linalg.vector_norm(g, norm_type, dtype=acc) for g in group)
    out_dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    return torch.linalg.vector_norm(torch.stack([n.to(first, out_dtype) for n in norms]), norm_type)


def _total_norm(grads: List[Tensor], norm_type: float, foreach: Optional[bool]) -> Tensor:
    by_device = _by_device(grads)
    first = grads[0].device
    if norm_type == 2.0 and not any(g.dtype == torch.float64 for g in grads):
        partials = _cached_partials(grads)
        if partials is None:
            partials = _l2_partials(by_device)
        return _norm_from_partials(partials, first)
    return _p_norm(by_device, norm_type, foreach, first)


def _scale_grads_(grads: List[Tensor], coef: Tensor) -> None:
    # ops.unscale_ is the "multiply in place by a device scalar, in fp32, rounded once" kernel: for fp32 it
    # is bitwise torch's mul_, and it runs on the fastest backend. Its partials are not needed here.
    for device, gs in _by_device(grads).items():
        c = coef.to(device)
        wide = [g for g in gs if g.dtype == torch.float64]
        narrow = [g for g in gs if g.dtype != torch.float64]
        if wide:  # fp64 gradients keep torch's fp64 coefficient
            torch._foreach_mul_(wide, c)
        if narrow:
            ops.unscale_(narrow, c.float())


# --- the fused-optimizer hook --------------------------------------------------------------------------------
def _fold_into_owner(params: List[Tensor], max_norm: float, norm_type: float,
                     error_if_nonfinite: bool) -> Optional[Tensor]:
    """If ``params`` are exactly the parameters of one fused optimizer, let it fold the clip into its step."""
    from .optim._segments import owner_of
    owner = None
    for p in params:
        o = owner_of(p)
        if o is None:  # an optimizer outside ampfused may mark its parameters itself
            ref = getattr(p, "_ampfused_owner", None)
            o = ref() if callable(ref) else None
        if o is None or (owner is not None and o is not owner):
            return None
        owner = o
    if owner is None or not hasattr(owner, "_ampfused_fold_clip_"):
        return None
    owned = {id(q) for group in owner.param_groups for q in group["params"]}
    if {id(p) for p in params} != owned:
        return None
    return owner._ampfused_fold_clip_(max_norm, norm_type, error_if_nonfinite)


# --- the public entry ----------------------------------------------------------------------------------------
def clip_grad_norm_(parameters: Union[Tensor, Iterable[Tensor]], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> Tensor:
    """Scale the gradients of ``parameters`` in place so their total ``norm_type``-norm is at most
    ``max_norm``; return the total norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does.

    ``grad *= min(1, max_norm / (total_norm + 1e-6))``, with the coefficient left on the device (no host
    sync unless ``error_if_nonfinite``). The returned norm is a 0-d fp32 tensor (fp64 if a gradient is fp64)
    on the first gradient's device; ``torch.tensor(0.)`` when no parameter has a gradient.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped.
        max_norm: the largest allowed norm, >= 0 (``inf`` only measures).
        norm_type: the p of the p-norm (``inf`` for the max norm); any value ``torch.linalg.vector_norm``
            takes. p = 2 runs on :func:`ampfused.ops.norm_check` or reuses the norm ``unscale_`` measured.
        error_if_nonfinite: raise if the total norm is NaN or infinite (reads the norm to the host).
        foreach: as in torch; ``True`` raises for devices without foreach kernels.
    """
    with torch.no_grad():
        params = _param_list(parameters)
        max_norm = _checked_float("max_norm", max_norm, "a number >= 0 (not NaN; inf means no clipping)",
                                  lambda v: v >= 0)
        norm_type = _checked_float("norm_type", norm_type, "a number or inf (not NaN)", lambda v: not math.isnan(v))
        grads = [p.grad for p in params if p.grad is not None]
        if any(g.is_sparse for g in grads):  # the ops take dense tensors; torch handles sparse gradients
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if not grads:
            return torch.tensor(0.0)
        _check_foreach(_by_device(grads), foreach)
        folded = _fold_into_owner(params, max_norm, norm_type, error_if_nonfinite)
        if folded is not None:
            return folded
        total = _total_norm(grads, norm_type, foreach)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        if not math.isinf(max_norm):  # the coefficient would be exactly 1: skip the pass over the gradients
            _scale_grads_(grads, ops.clip_coef(total, max_norm))
        return total
