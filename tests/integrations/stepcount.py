"""Counting what an optimizer step costs inside a framework, to compare with the plain ampfused loop.

``StepCounter`` profiles (``torch.profiler``, CPU activity) each window opened by ``start()`` and closed by
``stop()`` (called from the framework's hooks) and counts the outermost operators dispatched in it:
``aten::`` ops and ampfused's kernels, an operator called inside another not counted, as bench/common/measure.py
counts launches on CPU. ampfused's native kernels do not go through the dispatcher, so while counting, each
backend entry point is wrapped in a profiler range named ``ampfused::<op>`` that counts as one operator (what
the registered custom op would show). On CUDA it also counts, per window, the host syncs that
``torch.cuda.set_sync_debug_mode`` reports.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from typing import List

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import ampfused
from bench.common.measure import SYNC_WARNING, outermost_operators

KERNELS = ("norm_check", "unscale_", "update_scale_")  # and every step op, through the backends' one step entry
# operators that read a device value to the host
HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal")


def _wrap(fn, name):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        with record_function(f"ampfused::{name}"):
            return fn(*args, **kwargs)
    return counted


def _wrap_step(fn):
    """A backend's step entry, its range named by the op of the call it runs."""
    @functools.wraps(fn)
    def counted(call):
        with record_function(f"ampfused::{call.spec.name}"):
            return fn(call)
    return counted


@contextlib.contextmanager
def named_kernels(device="cpu"):
    """ampfused's backend entry points wrapped in ``ampfused::<op>`` profiler ranges (restored on exit)."""
    backends = {ampfused.ops.get_backend(n) for n in ampfused.ops.available_backends(device)}
    saved = []
    for b in backends:
        for op in KERNELS:
            if hasattr(b, op):
                saved.append((b, op, b.__dict__.get(op)))
                setattr(b, op, _wrap(getattr(b, op), op))
        saved.append((b, "step", b.__dict__.get("step")))
        b.step = _wrap_step(b.step)
    try:
        yield
    finally:
        for b, op, old in saved:
            if old is None:
                delattr(b, op)
            else:
                setattr(b, op, old)


def step_launches(op: str, device="cpu", dtype=torch.float32) -> int:
    """The backend entries step op ``op`` makes per step on ``device``'s default backend: two for a split step
    (``OpSpec.split``: its passes) on a backend that has its passes, else one."""
    name = ampfused.ops.resolve(torch.device(device), (dtype,)).name
    split = ampfused.ops.specs.SPECS[op].split is not None
    return 2 if split and name != "reference" and ampfused.ops.get_backend(name).has_step(op) else 1


class StepCounter:
    """Windows opened by ``start()`` and closed by ``stop()``, each profiled on its own: ``windows[i]`` is the
    Counter of outermost operators of window i, ``syncs[i]`` (CUDA only) its host syncs. Use inside
    ``with counter.kernels_named():`` so that ampfused's kernels are counted too."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.windows: List[Counter] = []
        self.syncs: List[int] = []
        self.sync_messages: List[List[str]] = []  # what the sync debug mode said, per window
        self._prof = None

    @contextlib.contextmanager
    def kernels_named(self):
        with named_kernels(self.device.type):
            yield self

    def start(self) -> None:
        assert self._prof is None, "window opened twice"
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()
        if self.device.type == "cuda":
            self._caught = warnings.catch_warnings(record=True)
            self._seen = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        assert self._prof is not None, "window closed before it was opened"
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self._caught.__exit__(None, None, None)
            said = [f"{w.category.__name__}: {w.message}" for w in self._seen if SYNC_WARNING in str(w.message)]
            self.syncs.append(len(said))
            self.sync_messages.append(said)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.windows.append(self._count(prof.events()))

    @staticmethod
    def _count(events) -> Counter:
        return outermost_operators(events)


def host_reads(counter: Counter) -> int:
    return sum(counter[n] for n in HOST_READS)
