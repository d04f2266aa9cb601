"""How things are measured: step time, copy bandwidth, launches, host syncs, memory.

* Time: every step is timed on its own after warm-up. On CUDA, events recorded around the step (the
  gradient refill before each step is outside them); elsewhere ``perf_counter`` around the step with a
  device synchronize on both sides. Reported as median and the 20th/80th percentiles. On CUDA also the host
  time: ``perf_counter`` around the step call alone (until it returns, kernels queued, no synchronize), the
  CPU's cost of a step; a step whose host time exceeds its GPU time leaves the GPU waiting. (On other devices
  the step's time is host time.)
* Bandwidth: ``dst.copy_(src)`` of a buffer far larger than the caches, and the in-place read-modify-write
  ``x.add_(1)`` of one (the stricter yardstick on CPUs, see :func:`rmw_bandwidth`), both counted as read +
  write (:func:`bench.common.bytes.copy_bytes`). Sampled right before and right after each variant's timed steps
  (:class:`Yardstick`), so every row is compared with the bandwidth of its own moment: on a shared machine
  the bandwidth drifts by tens of percent within seconds. The CSV keeps each row's median ``copy_gbps`` and
  ``rmw_gbps`` and its ``pct_of_copy_bw`` and ``pct_of_rmw_bw``.
* Launches: CUDA kernels per step (device events in ``torch.profiler``). On CPU there are no launches; the
  number reported is the outermost operators dispatched per step (``aten::``/custom ops, an operator called
  inside another not counted): each foreach op or fused op is one. Code compiled by inductor on CPU calls
  plain C++ functions the profiler does not see, so it is reported as unmeasurable.
* Host syncs: on CUDA, the synchronizations ``torch.cuda.set_sync_debug_mode`` reports during one step.
  On CPU nothing waits for a device, and whether a tensor read would be a sync elsewhere cannot be told
  (optimizer step counters are host tensors by design), so it is reported as unmeasurable.
* Memory (MB = 1e6 B): what the variant holds between steps plus the peak of what one step allocates on
  top. CUDA: ``memory_allocated`` growth since the variant was built (its compiled code's buffers
  included) and ``max_memory_allocated`` over the step. CPU: the storages behind the variant's tensors
  (params, grads, masters, states, flat buffers) and the running sum of the profiler's allocation events.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from .bytes import copy_bytes


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif hasattr(torch, device.type) and hasattr(getattr(torch, device.type), "synchronize"):
        getattr(torch, device.type).synchronize()


def percentile(xs: List[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Timing:
    times_ms: List[float]
    host_ms: Optional[List[float]] = None  # CUDA: until each step call returned

    @property
    def host_median(self) -> Optional[float]:
        return statistics.median(self.host_ms) if self.host_ms else None

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def p20(self) -> float:
        return percentile(self.times_ms, 20)

    @property
    def p80(self) -> float:
        return percentile(self.times_ms, 80)


def time_steps(step: Callable[[], None], refill: Callable[[], None], device: torch.device, warmup: int,
               reps: int, max_seconds: float = float("inf"), min_reps: int = 5) -> Timing:
    """Time ``reps`` calls of ``step`` after ``warmup`` untimed ones; ``refill`` runs, untimed, before each.

    Stops early once the timed steps have taken ``max_seconds`` (but not before ``min_reps``)."""
    for _ in range(warmup):
        refill()
        step()
    synchronize(device)
    times: List[float] = []
    spent = 0.0
    if device.type == "cuda":
        host: List[float] = []
        for _ in range(reps):
            pairs = []
            # batches of events so the host reads them without a sync after every step
            for _ in range(min(10, reps - len(times))):
                refill()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e3)
                b.record()
                pairs.append((a, b))
            torch.cuda.synchronize(device)
            for a, b in pairs:
                times.append(a.elapsed_time(b))
            spent += sum(a.elapsed_time(b) for a, b in pairs) / 1e3
            if len(times) >= reps or (spent >= max_seconds and len(times) >= min_reps):
                break
        return Timing(times[:reps], host[:reps])
    for i in range(reps):
        refill()
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        dt = time.perf_counter() - t0
        times.append(dt * 1e3)
        spent += dt
        if spent >= max_seconds and len(times) >= min_reps:
            break
    return Timing(times)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Measured ``copy_`` bandwidth in GB/s (1e9 B/s), counting read + write, median of ``reps``."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)  # first touch
    t = time_steps(lambda: dst.copy_(src), lambda: None, device, warmup=2, reps=reps)
    del src, dst
    return copy_bytes(n * 4) / (t.median / 1e3) / 1e9


def rmw_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """In-place read-modify-write bandwidth (``x.add_(1)``, read + write counted), GB/s, median of ``reps``.

    A step's big streams (master, moments) are read-modify-write of the same lines. ``copy_`` writes lines it
    never read, which a CPU without streaming stores must first fetch (write-allocate), so on CPUs this is
    the stricter yardstick; on GPUs the two agree closely."""
    x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    t = time_steps(lambda: x.add_(1.0), lambda: None, device, warmup=2, reps=reps)
    n = x.numel()
    del x
    return copy_bytes(n * 4) / (t.median / 1e3) / 1e9


@dataclass
class Bandwidth:
    """``copy_`` and in-place read-modify-write GB/s sampled right before and right after a variant's timed
    steps (:class:`Yardstick`)."""
    copy: List[float]
    rmw: List[float]

    def pct(self, which: str, nbytes: int, timing: Timing) -> float:
        """The step's effective bandwidth (``nbytes`` per median step) as a percentage of the median sample of
        ``which`` ("copy" or "rmw")."""
        return 100 * nbytes / (timing.median / 1e3) / 1e9 / statistics.median(getattr(self, which))


class Yardstick:
    """The bandwidths a variant's steps are compared with, measured around them (:meth:`time_steps`).

    On a shared machine the memory bandwidth drifts by tens of percent within seconds, so one measurement
    at the start of a run says little about the moment a variant was timed: ``reps`` samples of each are taken
    right before and right after its timed steps, which themselves run back to back as a training loop runs
    them. (Samples between the steps would not do: a step after one is slower than a step after a step, by
    a third at 1M parameters on a shared 2-core VM, even with an untimed step in between.) The buffers, of
    ``nbytes`` each, are far larger than the caches; they are held for the run on the CPU and allocated for
    each sample on CUDA, so a run holds no extra device memory."""

    def __init__(self, device: torch.device, nbytes: int, reps: int = 3):
        self.device, self.n, self.reps = device, nbytes // 4, reps
        self._held = self._buffers() if device.type != "cuda" else None

    def _buffers(self):
        src = torch.ones(self.n, dtype=torch.float32, device=self.device)
        dst, x = torch.zeros_like(src), torch.zeros_like(src)
        dst.copy_(src)  # first touch
        x.add_(1.0)
        return src, dst, x

    def _gbps(self, ms: float) -> float:
        return copy_bytes(self.n * 4) / (ms / 1e3) / 1e9

    def _sample(self):
        src, dst, x = self._held if self._held is not None else self._buffers()
        rmw = time_steps(lambda: x.add_(1.0), lambda: None, self.device, warmup=0, reps=self.reps)
        copy = time_steps(lambda: dst.copy_(src), lambda: None, self.device, warmup=0, reps=self.reps)
        return [self._gbps(t) for t in copy.times_ms], [self._gbps(t) for t in rmw.times_ms]

    def time_steps(self, step: Callable[[], None], refill: Callable[[], None], warmup: int, reps: int,
                   max_seconds: float = float("inf")) -> Tuple[Timing, Bandwidth]:
        """:func:`time_steps` between two sets of bandwidth samples."""
        copy0, rmw0 = self._sample()
        timing = time_steps(step, refill, self.device, warmup, reps, max_seconds)
        copy1, rmw1 = self._sample()
        return timing, Bandwidth(copy0 + copy1, rmw0 + rmw1)


def storage_bytes(tensors: List[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        seen[(t.device, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


_OP_MARK = "::"


def _is_operator(name: str) -> bool:
    return _OP_MARK in name and not name.startswith("[")


# What torch.cuda.set_sync_debug_mode("warn") says of a synchronizing operation (and only of one: switching the
# mode on also warns once that it is a prototype, which says "Synchronization" but is no sync)
SYNC_WARNING = "called a synchronizing"


def device_kernels(events) -> list:
    """The kernels among a CUDA profile's device events: copies and memsets left out, and so are the GPU-side
    marks of user annotations (``record_function`` ranges such as ``Optimizer.step#...``, which the profiler
    also lists as device events under the name of their CPU range)."""
    import torch
    cuda = torch.autograd.DeviceType.CUDA
    host_names = {e.name for e in events if e.device_type != cuda}
    return [e for e in events if e.device_type == cuda and e.name not in host_names
            and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("Memcpy", "Memset", "[memory]"))]


def outermost_operators(events) -> "Counter[str]":
    """Profiler events of operators (``aten::``/custom ops) not called inside another operator, by name."""
    out: Counter = Counter()
    for e in events:
        if not _is_operator(e.name):
            continue
        p = e.cpu_parent
        while p is not None and not _is_operator(p.name):
            p = p.cpu_parent
        if p is None:
            out[e.name] += 1
    return out


def _outermost_operators(events) -> int:
    return sum(outermost_operators(events).values())


def _transient_peak(prof) -> Optional[int]:
    """Peak of the running sum of every allocation (+) and free (-) the profiler saw, in time order.

    Reads kineto's raw events: the FunctionEvent list folds allocations made inside an operator into that
    operator's net memory and loses when they were freed."""
    try:
        raw = prof.profiler.kineto_results.events()
    except AttributeError:  # another torch version's layout: say so rather than guess
        return None
    mem = sorted((e for e in raw if e.name() == "[memory]"), key=lambda e: e.start_ns())
    peak = run = 0
    for e in mem:
        run += e.nbytes()
        peak = max(peak, run)
    return peak


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence what native code prints straight to file descriptor 2 (the profiler's start/stop lines),
    leaving Python's own warnings and errors, which go through sys.stderr, alone."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor 2 (an embedding, a captured stream): nothing to do
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass
class StepProfile:
    launches: Optional[int]
    host_syncs: Optional[int]
    transient_bytes: Optional[int]


def profile_step(step: Callable[[], None], refill: Callable[[], None], device: torch.device,
                 compiled: bool = False) -> StepProfile:
    """Launches, host syncs and extra memory of one step (after warm-up); None where unmeasurable here."""
    from torch.profiler import ProfilerActivity, profile

    refill()
    synchronize(device)
    if device.type == "cuda":
        with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        kernels = device_kernels(prof.events())
        refill()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize(device)
        syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
        transient = torch.cuda.max_memory_allocated(device) - before
        return StepProfile(len(kernels), syncs, transient)
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return StepProfile(None if compiled else _outermost_operators(prof.events()), None, _transient_peak(prof))
