"""``ampfused.GradScaler``: ``torch.amp.GradScaler`` with its hot paths routed through :mod:`ampfused.ops`.

Everything a training script can observe is torch's: the public methods and their return values, the
per-optimizer state machine (READY -> UNSCALED -> STEPPED, reset by ``update``), every error, the five
``state_dict`` keys, pickling, lazy creation of the scale, and the ``found_inf`` tensors that ``step`` reads
(scripts all-reduce them in place). What changes:

* ``unscale_`` runs :func:`ampfused.ops.unscale_`: fp32 gradients come out bit for bit as torch's kernel
  leaves them, and fp16/bf16 gradients are unscaled too (fp32 math, rounded back) where torch raises.
  The same pass measures the norm of the unscaled gradients, which :func:`ampfused.clip_grad_norm_` reuses.
* ``update`` runs :func:`ampfused.ops.update_scale_` (same bits as torch's rule, no host read).
* Fused ampfused optimizers (``_ampfused_fused = True``) unscale their own flat buffers and check infs
  inside their first kernel, so ``step`` hands them the scale and skips torch's separate inf-check pass.
"""
from __future__ import annotations

import math
import numbers
import warnings
import weakref
from collections import abc, defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from . import ops
from .clip import _remember_norm

__all__ = ["GradScaler", "OptState"]

_UNSCALABLE_MSG = "GradScaler unscales floating-point gradients only (float32, bfloat16, float16, float64)"
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_OUTPUTS_MSG = "outputs must be a Tensor or an iterable of Tensors"  # torch's message


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _check_growth_factor(name: str, value) -> float:
    v = _number(name, value)
    if not (v > 1.0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 1.0, got {value}")
    return v


def _check_backoff_factor(name: str, value) -> float:
    v = _number(name, value)
    if not 0.0 < v < 1.0:
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value}")
    return v


def _check_growth_interval(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _check_scale_value(name: str, value, *, allow_zero: bool) -> float:
    v = _number(name, value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        rule = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {rule}, got {value}")
    return v


def _check_outputs(outputs) -> None:
    """Reject what ``scale`` cannot multiply before the scale tensor is created. Lists and tuples are checked
    all the way down; other iterables stay lazy (torch returns a lazy ``map`` for them)."""
    if isinstance(outputs, Tensor):
        return
    # a str is an iterable of str, which torch's recursion would follow forever
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, abc.Iterable):
        raise ValueError(_OUTPUTS_MSG)
    if isinstance(outputs, (list, tuple)):
        for item in outputs:
            _check_outputs(item)


def _param_grads(optimizer) -> List[Tensor]:
    """The gradients ``unscale_`` works on, validated in full before any of them is touched."""
    grads = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, param in enumerate(group["params"]):
            if not isinstance(param, Tensor):
                raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")  # torch's
            g = param.grad
            if g is None:
                continue
            if g.dtype not in _GRAD_DTYPES:
                raise TypeError(f"optimizer.param_groups[{gi}]['params'][{pi}] (shape {tuple(param.shape)}) has a "
                                f"{g.dtype} gradient: {_UNSCALABLE_MSG}")
            grads.append(param)
    return grads


def _dense_views(params: List[Tensor]) -> Dict[torch.device, List[Tensor]]:
    """Per device, the dense tensors holding the gradient values (``_values()`` of sparse gradients)."""
    by_device: Dict[torch.device, List[Tensor]] = defaultdict(list)
    for p in params:
        if p.grad.is_sparse:
            # duplicate indices of an uncoalesced fp16 gradient could overflow once summed, so check the
            # coalesced values (torch does the same)
            if p.grad.dtype is torch.float16:
                p.grad = p.grad.coalesce()
            t = p.grad._values()
        else:
            t = p.grad
        by_device[t.device].append(t)
    return by_device


def _on(t: Tensor, device: torch.device) -> Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


# optimizer -> (group sizes, device): a fused step must not walk every parameter each iteration
_FUSED_DEVICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fused_device(optimizer, default: torch.device) -> torch.device:
    """The one device of a fused optimizer's parameters (its kernels take flat buffers on one device)."""
    sizes = tuple(len(g["params"]) for g in optimizer.param_groups)
    known = _FUSED_DEVICES.get(optimizer)
    if known is not None and known[0] == sizes:
        return known[1]
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(f"{type(optimizer).__name__} is a fused optimizer with parameters on several devices "
                         f"({', '.join(sorted(map(str, devices)))}); a fused optimizer's gradients must be on one "
                         "device")
    device = devices.pop() if devices else default
    _FUSED_DEVICES[optimizer] = (sizes, device)
    return device


class GradScaler(torch.amp.GradScaler):
    """Drop-in for ``torch.amp.GradScaler`` (same arguments, methods, errors and ``state_dict``).

    Extra keyword-only argument ``backend``: the :mod:`ampfused.ops` backend to use (``None`` picks the best
    available one; a named backend that cannot run raises instead of falling back).

    Also unscales fp16 and bf16 gradients, keeps the gradient norm measured while unscaling for
    :func:`ampfused.clip_grad_norm_`, and drives ampfused's fused optimizers without an extra pass.
    """

    _backend: Optional[str] = None  # class default, so instances pickled before the attribute existed load

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 backend: Optional[str] = None) -> None:
        if backend is not None:
            ops.get_backend(backend)  # an unknown name fails here, naming the registered backends
        if enabled and device == "cuda" and torch.cuda.amp.common.amp_definitely_not_available():
            # torch's warning, raised here so that it points at the caller's line rather than at this file
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
            enabled = False
        # Called by name, not via super(): ampfused.cuda.amp.GradScaler also derives from
        # torch.cuda.amp.GradScaler (for isinstance checks), whose __init__ takes no device argument.
        # torch raises its own AssertionErrors here for growth_factor <= 1 and backoff_factor >= 1.
        torch.amp.GradScaler.__init__(self, device, init_scale, growth_factor, backoff_factor, growth_interval,
                                      enabled)
        self._backend = backend
        if self._enabled:  # torch checks nothing more; the rest are checked like any ampfused entry
            self._init_scale = _check_scale_value("init_scale", init_scale, allow_zero=False)
            self._growth_factor = _check_growth_factor("growth_factor", growth_factor)
            self._backoff_factor = _check_backoff_factor("backoff_factor", backoff_factor)
            self._growth_interval = _check_growth_interval("growth_interval", growth_interval)

    # --- scale ----------------------------------------------------------------------------------------
    def scale(self, outputs):
        """Multiply a tensor, or (nested) lists/tuples/iterables of tensors, by the current scale."""
        if self._enabled:
            _check_outputs(outputs)
        return super().scale(outputs)

    # --- unscale --------------------------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (fp32, bf16, fp16 and fp64 gradients) and
        record, per device, whether any was non-finite. Also measures the unscaled gradients' norm."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # the reciprocal is taken in fp64, as torch does, so 1/scale is the correctly rounded fp32 value
        inv_scale = (self._scale.double().reciprocal().float() if self._scale.device != torch.device("mps:0")
                     else self._scale.reciprocal())
        if getattr(optimizer, "_ampfused_fused", False):
            found_inf = optimizer._ampfused_unscale_(_on(inv_scale, _fused_device(optimizer, inv_scale.device)))
            if not (isinstance(found_inf, Tensor) and found_inf.dim() == 0):
                raise TypeError("a fused optimizer's _ampfused_unscale_ must return a 0-d found_inf tensor, got "
                                f"{type(found_inf).__name__}")
            state["found_inf_per_device"] = {found_inf.device: found_inf}
        else:
            found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = OptState.UNSCALED

    def _unscale_grads_(self, optimizer, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool) -> Dict[torch.device, Tensor]:
        """One :func:`ampfused.ops.unscale_` per device over every gradient dtype. ``found_inf`` and
        ``allow_fp16`` are accepted for torch's signature: fresh flags are made per device, and fp16 is always
        allowed. Returns ``{device: found_inf}`` (0-d fp32, 1.0 where a non-finite value was seen)."""
        return self._per_device(optimizer, inv_scale, write=True)

    def _check_inf_per_device(self, optimizer) -> Dict[torch.device, Tensor]:
        """Inf check of still-scaled gradients, for optimizers that unscale inside their own step (torch's
        ``_step_supports_amp_scaling``). Reads the gradients without writing them back."""
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        one = torch.full((), 1.0, dtype=torch.float32, device=_scale.device)
        per_device = self._per_device(optimizer, one, write=False)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return per_device

    @torch.no_grad()
    def _per_device(self, optimizer, inv_scale: Tensor, write: bool) -> Dict[torch.device, Tensor]:
        params = _param_grads(optimizer)
        dense = not any(p.grad.is_sparse for p in params)
        by_device = _dense_views(params)
        op = ops.unscale_ if write else ops.norm_check
        found: Dict[torch.device, Tensor] = {}
        partials: Dict[torch.device, Tensor] = {}
        for device, grads in by_device.items():
            partials[device] = op(grads, _on(inv_scale, device), backend=self._backend)
            found[device] = ops.reduce_partials(partials[device])[1]
        # The values of an uncoalesced sparse gradient do not give its norm, so only dense sets are kept.
        if write and dense and params:
            _remember_norm([p.grad for p in params], partials)
        return found

    # --- step -----------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """``optimizer.step(*args, **kwargs)`` unless the gradients held infs/NaNs; returns its return value.

        A fused ampfused optimizer always runs its step: it gets the scale (``grad_scale``) or the flag from an
        earlier ``unscale_`` (``found_inf``) and skips the update on the device when the gradients overflowed.
        """
        if not (self._enabled and getattr(optimizer, "_ampfused_fused", False)):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        device = _fused_device(optimizer, self._scale.device)
        unscaled = state["stage"] is OptState.UNSCALED
        # the scaler's own tensor when the devices agree (the usual case), else a copy on the optimizer's
        optimizer.grad_scale = None if unscaled else _on(self._scale, device)
        optimizer.found_inf = self._combined_found_inf(state, device) if unscaled else None
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        found_inf = optimizer.last_found_inf  # the optimizer's own check, made inside its first kernel
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.STEPPED
        return retval

    def _combined_found_inf(self, state: dict, device: torch.device) -> Tensor:
        flags = list(state["found_inf_per_device"].values())
        if len(flags) == 1:
            return flags[0]  # the very tensor a script may have all-reduced in place
        return torch.stack([_on(f, device) for f in flags]).sum()

    # --- update ---------------------------------------------------------------------------------------
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Back off the scale if any step this iteration saw infs/NaNs, else count towards growth; or set it
        to ``new_scale``. Runs on the device with no host read."""
        if not self._enabled or new_scale is not None:
            return super().update(new_scale)
        scale, tracker = self._check_scale_growth_tracker("update")
        flags = [_on(f, scale.device) for state in self._per_optimizer_states.values()
                 for f in state["found_inf_per_device"].values()]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        # summed out of place: torch adds into the first flag, which may be a tensor the script still holds
        found_inf = flags[0] if len(flags) == 1 else torch.stack([f.float() for f in flags]).sum()
        ops.update_scale_(scale, tracker, found_inf.float(), self._growth_factor, self._backoff_factor,
                          self._growth_interval, backend=self._backend)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # --- hyperparameters and state --------------------------------------------------------------------
    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = _check_growth_factor("new_factor (growth factor)", new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = _check_backoff_factor("new_factor (backoff factor)", new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = _check_growth_interval("new_interval (growth interval)", new_interval)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler``; every entry is checked first."""
        if self._enabled and isinstance(state_dict, abc.Mapping) and len(state_dict) != 0:
            state_dict = _checked_state_dict(state_dict)
        elif self._enabled and not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        super().load_state_dict(state_dict)


def _checked_state_dict(sd) -> Dict[str, Any]:
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        if key not in sd:
            raise KeyError(f"GradScaler state_dict is missing the key {key!r}")
    tracker = sd["_growth_tracker"]
    if isinstance(tracker, bool) or not isinstance(tracker, numbers.Integral) or tracker < 0:
        raise ValueError(f"state_dict['_growth_tracker'] must be an int >= 0, got {tracker!r}")
    return {
        "scale": _check_scale_value("state_dict['scale']", sd["scale"], allow_zero=True),
        "growth_factor": _check_growth_factor("state_dict['growth_factor']", sd["growth_factor"]),
        "backoff_factor": _check_backoff_factor("state_dict['backoff_factor']", sd["backoff_factor"]),
        "growth_interval": _check_growth_interval("state_dict['growth_interval']", sd["growth_interval"]),
        "_growth_tracker": int(tracker),
    }
