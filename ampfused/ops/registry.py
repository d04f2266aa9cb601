"""Backend registry: which implementation of the ops runs for given tensors.

A backend is an object with K1 and the scale update of :mod:`ampfused.ops.reference` (same signatures), one
:meth:`Backend.step` for every step op (or a method per step op, in the reference's signature, which the default
``step`` calls), capability attributes and :meth:`Backend.not_supported_reasons`. Dispatch takes the first backend in the
device's priority list that supports the inputs. A backend named by the caller (``backend=`` or the
``AMPFUSED_BACKEND`` environment variable) is used or refused with every reason: never a silent fallback.
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Dict, Iterable, List, Optional

import torch

ENV_VAR = "AMPFUSED_BACKEND"

# name -> module that defines ``BACKEND`` (imported lazily, so a missing build or triton never breaks import)
_MODULES: Dict[str, str] = {
    "reference": "ampfused.ops._reference_backend",
    "triton": "ampfused.ops.triton",
    "cpu": "ampfused.ops.cpu",
    "cuda": "ampfused.ops.cuda",
}
PRIORITY: Dict[str, List[str]] = {"cuda": ["cuda", "triton", "reference"], "cpu": ["cpu", "reference"]}
_loaded: Dict[str, "Backend"] = {}
_import_errors: Dict[str, str] = {}
_generation = [0]  # bumped whenever the set of backends changes, so cached choices are dropped


def generation() -> int:
    return _generation[0]


class Backend:
    """Base class. Subclasses set the attributes and implement the ops of ``reference``."""

    takes_tables = False  # the fused optimizers' tables: norm_check_tables and steps from a table, see cpu.py

    name: str = ""
    devices: tuple = ()
    dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)
    deterministic: bool = True

    def unavailable_reason(self) -> Optional[str]:
        """Why this backend cannot run at all on this machine (missing build, missing package), or None."""
        return None

    def step(self, call) -> None:
        """The step op of ``call`` (:class:`ampfused.ops.call.StepCall`): the one entry of every step. This default
        calls the backend's own function under the op's name (its class's method or its attribute) with the op's
        arguments (a backend written as functions, in the reference's signatures)."""
        if call.table is not None:
            raise TypeError(f"the {self.name} backend does not take the fused optimizers' tables")
        if not self.has_step(call.spec.name):
            raise NotImplementedError(f"the {self.name} backend has no {call.spec.name}")
        object.__getattribute__(self, call.spec.name)(*call.op_args(), **call.compact_kwargs(), **call.options)

    def computes_health(self, op: str) -> bool:
        """Whether this backend's step op ``op`` writes a call's health sums (``StepCall.health``)."""
        return False

    def has_step(self, op: str) -> bool:
        """Whether this backend runs step op ``op`` (a name in ``specs.SPECS``)."""
        return callable(self.__dict__.get(op)) or callable(getattr(type(self), op, None))

    def __getattr__(self, name: str):
        """A step op by its name (``backend.adam_step_(params, grads, ...)``, the reference's signature, options
        by name): its call through :meth:`step`."""
        from .specs import SPECS
        spec = SPECS.get(name)
        if spec is None or not spec.is_step or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        from .call import StepCall

        def op(*args, **kw):
            self.step(StepCall.of_op(spec, args, kw))

        op.__name__ = name
        return op

    def not_supported_reasons(self, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> List[str]:
        reasons = []
        why = self.unavailable_reason()
        if why:
            reasons.append(why)
        if device.type not in self.devices:
            reasons.append(f"device type {device.type!r} not in {list(self.devices)}")
        bad = sorted({str(d) for d in dtypes if d not in self.dtypes})
        if bad:
            reasons.append(f"dtypes {bad} not supported (supports {[str(d) for d in self.dtypes]})")
        return reasons


def register_backend(name: str, module: str) -> None:
    """Make a backend module (defining ``BACKEND``) selectable by name."""
    _MODULES[name] = module
    _generation[0] += 1
    _loaded.pop(name, None)
    _import_errors.pop(name, None)


def registered_backends() -> List[str]:
    return list(_MODULES)


def get_backend(name: str) -> Optional[Backend]:
    """The backend object, or None if its module cannot be imported (the reason is kept for messages)."""
    if name not in _MODULES:
        raise ValueError(f"unknown ampfused backend {name!r}; registered backends: {registered_backends()}")
    if name not in _loaded and name not in _import_errors:
        try:
            _loaded[name] = importlib.import_module(_MODULES[name]).BACKEND
        except Exception as e:  # ImportError, or a build for another torch/CUDA
            _import_errors[name] = f"{type(e).__name__}: {e}"
    return _loaded.get(name)


def reasons_for(name: str, device: torch.device, dtypes: Iterable[torch.dtype] = ()) -> List[str]:
    b = get_backend(name)
    if b is None:
        return [f"cannot import {_MODULES[name]} ({_import_errors[name]})"]
    return b.not_supported_reasons(device, dtypes)


def available_backends(device="cpu", dtypes: Iterable[torch.dtype] = ()) -> List[str]:
    """Backends that can run ops on ``device`` for these dtypes, in dispatch priority order."""
    device = torch.device(device)
    names = PRIORITY.get(device.type, ["reference"]) + [n for n in _MODULES if n not in PRIORITY.get(device.type, [])]
    return [n for n in names if not reasons_for(n, device, dtypes)]


_warned: set = set()


def _warn_fallback(device: torch.device, best: str, used: str) -> None:
    """Once per device type: the best backend could not load (a missing or stale build, a missing package),
    so ops run on a slower one. Naming a backend (``backend=`` or ``AMPFUSED_BACKEND``) skips this."""
    b = get_backend(best)
    why = _import_errors.get(best) if b is None else b.unavailable_reason()
    if not why or (device.type, best) in _warned:
        return  # it cannot run for another reason (device, dtypes): not a broken install
    _warned.add((device.type, best))
    warnings.warn(f"ampfused: the {best} backend cannot load ({why}); ops on {device.type} tensors run on the "
                  f"{used} backend instead, which is slower. Pass backend= (or set {ENV_VAR}) to choose a backend "
                  "and silence this warning.", stacklevel=4)


def resolve(device, dtypes: Iterable[torch.dtype] = (), backend: Optional[str] = None) -> Backend:
    """The backend to run on ``device``: the named one (argument, else ``AMPFUSED_BACKEND``) or the first
    supported one in priority order."""
    device = torch.device(device)
    dtypes = tuple(dtypes)
    name = backend or os.environ.get(ENV_VAR) or None
    if name:
        if name not in _MODULES:
            raise ValueError(f"unknown ampfused backend {name!r}; registered backends: {registered_backends()}")
        reasons = reasons_for(name, device, dtypes)
        if reasons:
            src = "backend=" if backend else f"{ENV_VAR}="
            raise RuntimeError(f"ampfused backend {name!r} (forced by {src}{name!r}) cannot run on {device} "
                               f"with dtypes {[str(d) for d in dtypes]}: " + "; ".join(reasons))
        return get_backend(name)
    tried = []
    for n in PRIORITY.get(device.type, ["reference"]):
        reasons = reasons_for(n, device, dtypes)
        if not reasons:
            if tried:
                _warn_fallback(device, PRIORITY[device.type][0], n)
            return get_backend(n)
        tried.append(f"{n}: " + "; ".join(reasons))
    raise RuntimeError(f"no ampfused backend can run on {device} with dtypes {[str(d) for d in dtypes]}: "
                       + " | ".join(tried))
