"""Loss-scale policies: the rule that moves :class:`ampfused.GradScaler`'s scale after each iteration.

A policy updates three 0-d device tensors in place with tensor ops and never reads a value to the host, so an
iteration that runs it needs no sync and can be captured in a CUDA graph:

* ``scale``: fp32, the loss scale;
* ``growth_tracker``: int32, clean iterations counted towards the next growth (torch's tracker);
* ``found_inf``: fp32, read only, > 0 when this iteration's gradients held an inf or NaN.

The scaler owns ``growth_factor``, ``backoff_factor`` and ``growth_interval`` (they are keys of torch's
``state_dict`` and have setters) and hands their current values to its policy before every update, as the
attributes of the same names. A policy's own options are its constructor's arguments. Every policy takes
``min_scale`` / ``max_scale`` (keyword-only): :meth:`ScalePolicy.apply_` clamps the scale into them after
:meth:`ScalePolicy.update_`, so a custom rule need not.

Built in (``GradScaler(policy=name)``, or an instance for options):

========================  ===============================================================================
``"dynamic"``             torch's rule, bit for bit (:func:`ampfused.ops.update_scale_`); the default
``"hysteresis"``          back off only on the ``hysteresis``-th consecutive overflow (Megatron, DeepSpeed)
``"static"``              the scale never changes; overflowing steps are still skipped
``"aggressive"``          the first overflow of a burst backs off twice as deep (``backoff_factor ** 2``)
========================  ===============================================================================

State a policy keeps across iterations (the hysteresis counter, ...) is declared with
:meth:`ScalePolicy.add_state`: a 0-d device tensor created on the scale's device at first use, saved in the
scaler's ``state_dict`` as a plain Python number under the key ``"policy.<name>.<state>"``.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Optional, Union

import torch
from torch import Tensor

from . import ops

__all__ = ["ScalePolicy", "DynamicPolicy", "HysteresisPolicy", "StaticPolicy", "AggressivePolicy",
           "MinScaleError", "register_scale_policy", "registered_scale_policies", "make_scale_policy"]

Number = Union[int, float]
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class MinScaleError(RuntimeError):
    """The loss scale sits at ``min_scale`` and the gradients still overflow (``raise_at_min_scale=True``)."""


def _f32(value: float) -> float:
    """``value`` rounded to fp32: the bounds are compared with an fp32 scale, so they are held as fp32."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def _bound(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(value).__name__}")
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value}")
    return _f32(v)


class _DeviceState:
    """Named 0-d tensors on one device, created at first use from Python values.

    Until then, and across pickling (which reads them to the host), values are kept as Python numbers, so a
    ``state_dict`` taken or loaded before the first iteration works and lands on the scale's device later."""

    def __init__(self) -> None:
        self.dtypes: Dict[str, torch.dtype] = {}
        self.defaults: Dict[str, Number] = {}
        self.pending: Dict[str, Number] = {}
        self.tensors: Dict[str, Tensor] = {}

    def add(self, name: str, default: Number, dtype: torch.dtype) -> None:
        self.dtypes[name] = dtype
        self.defaults[name] = default
        self.pending[name] = default

    def get(self, name: str, device: torch.device) -> Tensor:
        t = self.tensors.get(name)
        if t is None:
            t = torch.full((), self.pending.pop(name), dtype=self.dtypes[name], device=device)
            self.tensors[name] = t
        return t

    def set(self, name: str, value: Number) -> None:
        if name in self.tensors:
            self.tensors[name].fill_(value)
        else:
            self.pending[name] = value

    def reset(self) -> None:
        for name, default in self.defaults.items():
            self.set(name, default)

    def snapshot(self, device: torch.device) -> Dict[str, Tensor]:
        """Every value as a fresh 0-d tensor (copies of the device tensors, no host read)."""
        return {n: self.tensors[n].clone() if n in self.tensors else
                torch.full((), self.pending[n], dtype=self.dtypes[n], device=device) for n in self.dtypes}

    def values(self) -> Dict[str, Number]:
        """Every value as a Python number (one host read for all the tensors)."""
        out = dict(self.pending)
        if self.tensors:
            names = list(self.tensors)
            wide = torch.float32 if self.tensors[names[0]].device.type == "mps" else torch.float64
            read = torch.stack([self.tensors[n].to(wide) for n in names]).tolist()
            for n, v in zip(names, read):
                out[n] = int(v) if not self.dtypes[n].is_floating_point else v
        return {n: out[n] for n in self.dtypes}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["pending"] = self.values()
        state["tensors"] = {}
        return state


class ScalePolicy:
    """Base class of loss-scale policies. Subclass it, implement :meth:`update_`, and register it with
    :func:`register_scale_policy` to use it by name.

    ``update_`` works on device tensors only: ``torch.where``, arithmetic and in-place copies, never
    ``.item()``, ``bool(t)`` or ``if t:``. Per-policy state is declared in ``__init__`` with
    :meth:`add_state` and fetched in ``update_`` with :meth:`state`.

    Attributes the scaler sets before each update: ``growth_factor``, ``backoff_factor``, ``growth_interval``
    and ``backend`` (the :mod:`ampfused.ops` backend the scaler was given). The class defaults are torch's,
    for a policy used on its own.
    """

    policy_name: Optional[str] = None  # set by register_scale_policy
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    backend: Optional[str] = None
    min_scale: Optional[float] = None
    max_scale: Optional[float] = None
    _bound_to_scaler: bool = False

    def __init__(self, *, min_scale: Optional[float] = None, max_scale: Optional[float] = None) -> None:
        self.set_bounds(min_scale=min_scale, max_scale=max_scale)

    # --- bounds ---------------------------------------------------------------------------------------------
    def set_bounds(self, *, min_scale: Optional[float] = None, max_scale: Optional[float] = None) -> None:
        lo, hi = _bound("min_scale", min_scale), _bound("max_scale", max_scale)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_scale ({min_scale}) must be <= max_scale ({max_scale})")
        self.min_scale, self.max_scale = lo, hi

    # --- state ----------------------------------------------------------------------------------------------
    @property
    def _dstate(self) -> _DeviceState:
        # created on first use, so a subclass that forgets super().__init__() still works
        st = self.__dict__.get("_device_state")
        if st is None:
            st = self.__dict__["_device_state"] = _DeviceState()
        return st

    def add_state(self, name: str, default: Number = 0, dtype: torch.dtype = torch.int32) -> None:
        """Declare a 0-d state tensor (int or float dtype) saved in the scaler's ``state_dict``."""
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"state name must be a non-empty str without '.', got {name!r}")
        if not (dtype.is_floating_point or dtype in _INT_DTYPES):
            raise TypeError(f"state {name!r} must have an int or float dtype, got {dtype}")
        self._dstate.add(name, default, dtype)

    def state(self, name: str, like: Tensor) -> Tensor:
        """The state tensor ``name`` on ``like``'s device (created there from its saved value at first use)."""
        if name not in self._dstate.dtypes:
            raise KeyError(f"{type(self).__name__} has no state {name!r}; declare it with add_state() in "
                           "__init__")
        return self._dstate.get(name, like.device)

    def state_dict(self) -> Dict[str, Number]:
        """The declared state as plain Python numbers (reads the device: call it where a sync is fine)."""
        return self._dstate.values()

    def load_state_dict(self, state_dict: Dict[str, Number]) -> None:
        """Load declared state; a missing key takes its default (e.g. a state dict saved by another policy,
        or by ``torch.amp.GradScaler``). Every value is checked before any is written."""
        declared = self._dstate.dtypes
        for key, value in state_dict.items():
            if key not in declared:
                raise KeyError(f"{type(self).__name__} has no state {key!r} (it keeps {sorted(declared)})")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"policy state {key!r} must be a number, got {type(value).__name__}")
            if not declared[key].is_floating_point and int(value) != value:
                raise ValueError(f"policy state {key!r} must be an integer, got {value!r}")
        for key in declared:
            self._dstate.set(key, state_dict.get(key, self._dstate.defaults[key]))

    def stats(self, device: torch.device) -> Dict[str, Tensor]:
        """A snapshot of the declared state as 0-d tensors (on ``device`` where not yet created), for
        :meth:`GradScaler.stats`; no host read."""
        return self._dstate.snapshot(device)

    # --- the rule -------------------------------------------------------------------------------------------
    def configure(self, *, growth_factor: float, backoff_factor: float, growth_interval: int,
                  backend: Optional[str] = None) -> None:
        """Called by the scaler before each update with its current hyperparameters."""
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.backend = growth_interval, backend

    def update_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        """Update ``scale`` (0-d fp32) and ``growth_tracker`` (0-d int32) in place from ``found_inf``
        (0-d fp32, > 0 on overflow), with device tensor ops only."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_(scale, growth_tracker, "
                                  "found_inf)")

    def apply_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> Optional[Tensor]:
        """:meth:`update_`, then clamp the scale into ``[min_scale, max_scale]``.

        Returns, when ``min_scale`` is set, a 0-d bool device tensor: this iteration overflowed while the
        scale already sat at ``min_scale`` and the rule asked for a lower one (what ``raise_at_min_scale``
        reports); else ``None``. No host read."""
        lo, hi = self.min_scale, self.max_scale
        if lo is None and hi is None:
            self.update_(scale, growth_tracker, found_inf)
            return None
        before = scale.clone() if lo is not None else None
        self.update_(scale, growth_tracker, found_inf)
        at_min = None if before is None else (found_inf > 0) & (before <= lo) & (scale < before)
        scale.clamp_(min=lo, max=hi)
        return at_min

    def __repr__(self) -> str:
        opts = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k not in (
            "growth_factor", "backoff_factor", "growth_interval", "backend")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


# --- registry -------------------------------------------------------------------------------------------------
_REGISTRY: Dict[str, type] = {}
_BUILTIN = ("dynamic", "hysteresis", "static", "aggressive")


def register_scale_policy(name: str, *, replace: bool = False):
    """Class decorator: make a :class:`ScalePolicy` subclass available as ``GradScaler(policy=name)``.

    ``name`` is a non-empty str without ``'.'`` (it keys the policy's state in the scaler's ``state_dict``).
    Registering another class under a taken name raises unless ``replace=True``; built-in names cannot be
    replaced."""
    if not isinstance(name, str) or not name or "." in name or name != name.strip():
        raise ValueError(f"scale policy name must be a non-empty str without '.' or surrounding spaces, got "
                         f"{name!r}")

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, ScalePolicy)):
            raise TypeError(f"register_scale_policy({name!r}) decorates a ScalePolicy subclass, got {cls!r}")
        old = _REGISTRY.get(name)
        if old is not None and old is not cls:
            if name in _BUILTIN and old.__module__ == __name__:
                raise ValueError(f"the built-in scale policy {name!r} cannot be replaced; register under another "
                                 "name")
            if not replace:
                raise ValueError(f"a scale policy named {name!r} is already registered ({old.__qualname__}); "
                                 "pass replace=True to replace it")
        cls.policy_name = name
        _REGISTRY[name] = cls
        return cls
    return decorate


def registered_scale_policies() -> Dict[str, type]:
    """``{name: class}`` of every registered policy."""
    return dict(_REGISTRY)


def make_scale_policy(policy) -> ScalePolicy:
    """A policy instance from a registered name (default options) or an instance (returned as is)."""
    if isinstance(policy, ScalePolicy):
        return policy
    if isinstance(policy, str):
        cls = _REGISTRY.get(policy)
        if cls is None:
            raise ValueError(f"unknown scale policy {policy!r}; registered policies: {', '.join(sorted(_REGISTRY))}")
        return cls()
    hint = " (pass an instance: policy=MyPolicy(...))" if isinstance(policy, type) else ""
    raise TypeError(f"policy must be a registered policy name or a ScalePolicy instance, got "
                    f"{type(policy).__name__}{hint}")


def policy_key(policy: ScalePolicy) -> str:
    """The name under which ``policy``'s state is saved: its registered name, else its class name."""
    return type(policy).__dict__.get("policy_name") or type(policy).__name__


# --- built-in policies ----------------------------------------------------------------------------------------
def _grown(scale: Tensor, factor: float) -> Tensor:
    # fp64 product rounded once to fp32, as torch's kernels form it
    return (scale.double() * factor).float()


@register_scale_policy("dynamic")
class DynamicPolicy(ScalePolicy):
    """torch's rule, bit for bit, on the fastest :mod:`ampfused.ops` backend (:func:`ampfused.ops.update_scale_`).

    overflow: ``scale = fp32(scale * backoff_factor)``, ``growth_tracker = 0``. clean: ``growth_tracker += 1``;
    when it reaches ``growth_interval``: ``scale = fp32(scale * growth_factor)`` if that is finite, and
    ``growth_tracker = 0``."""

    def update_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        ops.update_scale_(scale, growth_tracker, found_inf, self.growth_factor, self.backoff_factor,
                          self.growth_interval, backend=self.backend)


@register_scale_policy("static")
class StaticPolicy(ScalePolicy):
    """The scale never changes (nor does the growth tracker). Overflowing steps are still skipped, and never
    count as asking for a lower scale, so ``raise_at_min_scale`` never fires."""

    def update_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        pass


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


@register_scale_policy("hysteresis")
class HysteresisPolicy(ScalePolicy):
    """Back off only on the ``hysteresis``-th consecutive overflow, as Megatron-LM and DeepSpeed do.

    State ``overflows`` (int32): overflows counted towards a backoff, saturating at ``hysteresis``. Per
    iteration, with ``N = hysteresis``::

        overflow:  overflows = min(overflows + 1, N);  growth_tracker = 0
                   if overflows == N: scale = fp32(scale * backoff_factor)
        clean:     if consecutive: overflows = 0
                   growth_tracker += 1
                   if growth_tracker >= growth_interval:
                       scale = fp32(scale * growth_factor) if finite;  growth_tracker = 0;  overflows = 0

    Once the count reaches ``N``, every further overflow backs off too, until the count resets.
    ``consecutive=True`` (default): any clean iteration resets the count, so only a run of ``N``
    overflows in a row backs off (DeepSpeed's ``consecutive_hysteresis=True``). ``consecutive=False``: the
    count resets only when the scale grows (Megatron-LM's rule, DeepSpeed's default). ``N = 1`` is the
    dynamic rule.
    """

    def __init__(self, hysteresis: int = 2, *, consecutive: bool = True, min_scale: Optional[float] = None,
                 max_scale: Optional[float] = None) -> None:
        super().__init__(min_scale=min_scale, max_scale=max_scale)
        self.hysteresis = _check_int("hysteresis", hysteresis, 1)
        if not isinstance(consecutive, bool):
            raise TypeError(f"consecutive must be a bool, got {type(consecutive).__name__}")
        self.consecutive = consecutive
        self.add_state("overflows", 0)

    def update_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        overflows = self.state("overflows", scale)
        over = found_inf > 0
        counted = torch.where(over, (overflows + 1).clamp(max=self.hysteresis),
                              torch.zeros_like(overflows) if self.consecutive else overflows)
        successful = growth_tracker + 1
        grow = ~over & (successful >= self.growth_interval)
        back = over & (counted >= self.hysteresis)
        grown = _grown(scale, self.growth_factor)
        new_scale = torch.where(back, _grown(scale, self.backoff_factor),
                                torch.where(grow & torch.isfinite(grown), grown, scale))
        growth_tracker.copy_(torch.where(over | grow, torch.zeros_like(successful), successful))
        overflows.copy_(torch.where(grow, torch.zeros_like(counted), counted))
        scale.copy_(new_scale)


@register_scale_policy("aggressive")
class AggressivePolicy(ScalePolicy):
    """Get well below the overflow threshold at once: the first overflow of a burst backs off deeper.

    State ``last_overflow`` (int32, 0 or 1): whether the previous iteration overflowed. Per iteration::

        overflow after a clean iteration:  scale = fp32(scale * first_backoff)
        overflow after an overflow:        scale = fp32(scale * backoff_factor)
        any overflow:                      growth_tracker = 0  (growth waits a full interval again)
        clean:  growth_tracker += 1
                if growth_tracker >= growth_interval:
                    scale = fp32(scale * growth_factor) if finite;  growth_tracker = 0
        last_overflow = 1 if this iteration overflowed else 0

    ``first_backoff`` defaults to ``backoff_factor ** 2`` (0.25 with torch's 0.5), taken from the scaler's
    current ``backoff_factor`` at each update; a number in (0, 1) fixes it.
    """

    def __init__(self, first_backoff: Optional[float] = None, *, min_scale: Optional[float] = None,
                 max_scale: Optional[float] = None) -> None:
        super().__init__(min_scale=min_scale, max_scale=max_scale)
        if first_backoff is not None:
            if isinstance(first_backoff, bool) or not isinstance(first_backoff, numbers.Real):
                raise TypeError(f"first_backoff must be a real number or None, got {type(first_backoff).__name__}")
            if not 0.0 < first_backoff < 1.0:
                raise ValueError(f"first_backoff must be in the open interval (0, 1), got {first_backoff}")
            first_backoff = float(first_backoff)
        self.first_backoff = first_backoff
        self.add_state("last_overflow", 0)

    def update_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        last = self.state("last_overflow", scale)
        over = found_inf > 0
        first = self.backoff_factor ** 2 if self.first_backoff is None else self.first_backoff
        backed = torch.where(last == 0, _grown(scale, first), _grown(scale, self.backoff_factor))
        successful = growth_tracker + 1
        grow = ~over & (successful >= self.growth_interval)
        grown = _grown(scale, self.growth_factor)
        new_scale = torch.where(over, backed, torch.where(grow & torch.isfinite(grown), grown, scale))
        growth_tracker.copy_(torch.where(over | grow, torch.zeros_like(successful), successful))
        last.copy_(over.to(last.dtype))
        scale.copy_(new_scale)
