"""Each backend's host part of a step, on CPU tensors: the backend as it is up to its kernels, the kernels replaced
by calls that do nothing (what :mod:`bench.step.host_time` times).

* ``cpu``: ``ampfused._C`` replaced by a module whose entries return at once (the tables, checks and argument
  lists are the backend's own);
* ``cuda``: the CUDA backend with its compiled module replaced likewise and its device queries (stream, device
  index, capture state, counter slot) answered without a device; its tables are compared, built and "uploaded"
  as on a GPU (the upload of a CPU buffer is the buffer itself: no copy is made);
* ``triton``: the Triton backend with its two kernels (``_norm_check_kernel``, ``_adam_kernel``,
  ``_sgd_kernel``) replaced by launches that do nothing: the plans, their caches and the launchers' argument
  lists are the backend's own; Triton's own launch path (its argument binding and driver call, several
  microseconds a launch on a GPU) is not here;
* ``reference``: the reference ops replaced by ones that do nothing, so what remains is the fused optimizers'
  Python path (it takes no tables).

Each is registered as ``<name>-host`` (a backend for CPU tensors) while :func:`host_only` is active.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator

import torch

from ampfused import _native, ops

NAMES = ("cpu", "cuda", "triton", "reference")


class _NullModule:
    """A compiled module whose entries do nothing; its constants are the real module's (or the values given)."""

    def __init__(self, real=None, **constants):
        self._real = real
        self.__dict__.update(constants)

    def __getattr__(self, name):
        # constants, arithmetic on sizes and what the packed step call is made of: the real module's
        if name.isupper() or name in ("num_partials", "step_ops", "step_constants"):
            return getattr(self._real, name)
        return _nothing


def _nothing(*args, **kwargs):
    return None


class _NullLaunch:
    """A ``@triton.jit`` kernel whose launches (``kernel[grid](...)``) do nothing."""

    def __getitem__(self, grid):
        return _nothing


def _cpu_backend():
    from ampfused.ops.cpu import CpuBackend
    null = _NullModule(_native.module("cpu"))

    class HostCpu(CpuBackend):
        name = "cpu-host"

        def _mod(self):
            return null

    return HostCpu()


def _cuda_backend():
    from ampfused.ops import cuda as C
    cpu = _native.module("cpu")  # (the modules share the packed step call's layout and ops)
    null = _NullModule(None, STEP_CHUNK=16384, TILE=2048, MAX_PARTIALS_PER_TENSOR=1024, WORK_SHIFT=32,
                       num_partials=lambda numels: sum(min(-(-int(n) // 2048), 1024) for n in numels),
                       STEP_SLOTS=cpu.STEP_SLOTS, step_ops=cpu.step_ops, step_constants=cpu.step_constants)
    if _native.unavailable_reason("cuda") is None:  # the real constants where the module loads
        null = _NullModule(_native.module("cuda"))

    class HostCuda(C.CudaBackend):
        name = "cuda-host"
        devices = ("cpu",)

        def unavailable_reason(self):
            return None

        def _mod(self):
            return null

        def _device_args(self, device):
            return (0, 0)

        # a step from tensors is checked for CUDA tensors: the Python path (a first step, a step after a change)
        # does nothing here, so a step that took it would show as cheaper than it is
        def step(self, call):
            if call.table is not None:
                super().step(call)

    return HostCuda()


def _triton_backend():
    from ampfused.ops.triton import TritonBackend

    class HostTriton(TritonBackend):
        name = "triton-host"

        @property
        def devices(self):
            return ("cpu",)

    return HostTriton()


def _reference_backend():
    from ampfused.ops._reference_backend import ReferenceBackend

    class HostReference(ReferenceBackend):
        name = "reference-host"

        @staticmethod
        def norm_check(grads, inv_scale):
            return torch.zeros(2, 1)

        unscale_ = norm_check

        def step(self, call):
            return None

    return HostReference()


_MAKERS = {"cpu": _cpu_backend, "cuda": _cuda_backend, "triton": _triton_backend, "reference": _reference_backend}


@contextlib.contextmanager
def host_only(name: str) -> Iterator[str]:
    """Register ``<name>-host`` (see the module docstring) for the duration; yields its name."""
    patches = []

    def patch(obj, attr, value):
        patches.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    if name == "cuda":
        from ampfused.ops import cuda as C
        patch(C, "_counter", lambda steps: 0)
        patch(C, "_capturing", lambda index: False)
        patch(C, "_device_index", lambda device: 0)
        patch(C, "_raw_stream", lambda index: 0)
    elif name == "triton":
        from ampfused.triton_kernels import adam, norm_check, sgd
        patch(adam, "_adam_kernel", _NullLaunch())
        patch(norm_check, "_norm_check_kernel", _NullLaunch())
        patch(sgd, "_sgd_kernel", _NullLaunch())
    backend = f"{name}-host"
    module = types.ModuleType(f"_ampfused_{name}_host")
    module.BACKEND = _MAKERS[name]()
    sys.modules[module.__name__] = module
    ops.register_backend(backend, module.__name__)
    try:
        yield backend
    finally:
        ops.registry._MODULES.pop(backend, None)
        ops.registry._loaded.pop(backend, None)
        ops.registry._generation[0] += 1
        sys.modules.pop(module.__name__, None)
        for obj, attr, value in reversed(patches):
            setattr(obj, attr, value)
