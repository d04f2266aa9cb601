"""The run loop: for each instance, the reference once, then each variant checked, timed and profiled; with
``rounds`` > 1 the variants are measured in turn that many times and each row pools its rounds' steps."""
from __future__ import annotations

import gc
import math
import statistics
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..common import measure
from .check import MAX_ELEMENTS, CorrectnessError, _pick, check, make_plan, run_reference
from .report import NA, fill_speedups
from .variants import TorchCompile, Unavailable, Variant
from .workloads import DTYPE_NAMES, Instance, init_params


@dataclass
class Options:
    warmup: int = 3
    reps: int = 20
    max_seconds: float = 8.0  # per measurement, once at least 5 steps are timed
    check_elements: int = MAX_ELEMENTS
    keep_going: bool = False  # after a correctness failure, go on with the other variants (exit non-zero)
    yardstick: Optional[measure.Yardstick] = None  # bandwidth measured with each variant's timing (rows' columns)
    # Measurements of each variant, in turn with the others (A B C A B C ...): on a shared machine whose speed
    # drifts over seconds, one measurement per variant puts each row in a different moment; pooling the steps
    # of several rounds spreads every row over the run
    rounds: int = 1


@dataclass
class Outcome:
    rows: List[dict]
    notes: List[str]
    failures: List[str]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _leaves(t) -> List[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a tensor subclass's inner tensors (quantized states)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _leaves(getattr(t, n))]


def state_bytes_per_param(runner, numel: int) -> Optional[float]:
    """Bytes of the distinct storages behind the runner's optimizer state, per parameter (None: not known)."""
    tensors = runner.state_tensors()
    if tensors is None:
        return None
    return measure.storage_bytes([x for t in tensors for x in _leaves(t)]) / numel


def weight_deviation(snap, exp, plan) -> Optional[float]:
    """How far the weights a variant computed are from the reference after the check steps: the largest
    ``max|w - w_ref| / max|w_ref|`` over the tensors (its fp32 masters where it keeps them, else its model weights;
    the sampled elements). A correct fp32-master step is off by roundings (about 1e-7); a peer or a compact mode by
    what its format keeps (a bf16 weight by up to an ulp per update, about 4e-3 of the largest weight)."""
    got = snap.master if snap.master is not None and exp.master is not None else snap.param
    want = exp.master if snap.master is not None and exp.master is not None else exp.weights
    if got is None or want is None:
        return None
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, want)):
        g64, e64 = _pick(g, plan.sample[i]).double(), e.double()
        top = e64.abs().max().item() if e64.numel() else 0.0
        if not bool(torch.isfinite(g64).all()):
            return math.inf
        if top > 0:
            worst = max(worst, (g64 - e64).abs().max().item() / top)
    return worst


def _row(env: dict, inst: Instance, v: Variant, timing: measure.Timing, prof: measure.StepProfile,
         persistent: int, state_bpp: Optional[float]) -> dict:
    wl = inst.workload
    bpp = v.bytes_per_param(inst)
    gbps = wl.numel * bpp / (timing.median / 1e3) / 1e9
    peak = NA if prof.transient_bytes is None else f"{(persistent + prof.transient_bytes) / 1e6:.1f}"
    return dict(env, workload=wl.name, numel=wl.numel, tensors=wl.tensors,
                grad_dtype=DTYPE_NAMES[inst.grad_dtype], param_dtype=DTYPE_NAMES[inst.param_dtype],
                clip=str(inst.clip).lower(), variant=v.name, backend=v.backend,
                median_ms=f"{timing.median:.4f}", p20_ms=f"{timing.p20:.4f}", p80_ms=f"{timing.p80:.4f}",
                host_ms=NA if timing.host_median is None else f"{timing.host_median:.4f}",
                gbps_effective=f"{gbps:.4g}",
                host_syncs=NA if prof.host_syncs is None else prof.host_syncs,
                launches=NA if prof.launches is None else prof.launches, peak_mem_mb=peak,
                state_bytes_per_param=NA if state_bpp is None else f"{state_bpp:.3f}", bytes_per_param=f"{bpp:g}",
                weight_dev=NA, copy_gbps=NA, rmw_gbps=NA, pct_of_copy_bw=NA, pct_of_rmw_bw=NA)


def _bandwidth_columns(inst: Instance, v: Variant, timing: measure.Timing, bw: measure.Bandwidth) -> dict:
    nbytes = inst.workload.numel * v.bytes_per_param(inst)
    return dict(copy_gbps=f"{statistics.median(bw.copy):.4g}", rmw_gbps=f"{statistics.median(bw.rmw):.4g}",
                pct_of_copy_bw=f"{bw.pct('copy', nbytes, timing):.4g}",
                pct_of_rmw_bw=f"{bw.pct('rmw', nbytes, timing):.4g}")


def run(instances: List[Instance], variants: List[Variant], env: dict, opts: Options, progress=None,
        done=None) -> Outcome:
    """Measure every variant on every instance. ``progress``: a tqdm-like object (``update``, ``write``,
    ``set_postfix_str``) or None. Rows get their bandwidth columns from ``opts.yardstick``, measured with their
    own timing (n/a without one). Raises :class:`CorrectnessError` on the first wrong variant unless
    ``opts.keep_going``. ``done(rows)``, if given, is called after each instance with every row so far (a run
    stopped part-way keeps what it measured)."""
    rows: List[dict] = []
    notes: List[str] = []
    failures: List[str] = []

    def say(msg: str) -> None:
        notes.append(msg)
        if progress is not None:
            progress.write(msg)

    for inst in instances:
        label = inst.label()
        if progress is not None:
            progress.set_postfix_str(f"{label}: reference")
        params = init_params(inst)
        plan = make_plan(inst, opts.check_elements)
        expected = run_reference(inst, params, plan)
        own = {inst.label(): (inst, plan, expected)}  # a variant's own configuration: its plan and reference

        def configured(v: Variant, inst=inst, params=params, own=own):
            mine = v.instance_for(inst)
            if mine.label() not in own:
                p = make_plan(mine, opts.check_elements)
                own[mine.label()] = (mine, p, run_reference(mine, params, p))
            return own[mine.label()]
        measured = {}  # variant name -> Measured, its rounds pooled
        stopped = set()  # variants not measured again: unavailable or wrong
        for k in range(opts.rounds):
            for v in variants:
                if v.name in stopped:
                    continue
                if progress is not None:
                    progress.set_postfix_str(f"{label}: {v.name}" + (f" (round {k + 1})" if opts.rounds > 1 else ""))
                try:
                    vi, vplan, vexp = configured(v)
                    if v.name in measured:
                        measured[v.name] = measured[v.name].pooled(_time_one(vi, v, params, vplan, vexp, opts))
                    else:
                        measured[v.name] = _measure_one(vi, v, params, vplan, vexp, opts, say)
                except Unavailable as e:
                    if e.permanent:
                        v.disabled = str(e)
                    stopped.add(v.name)
                    later = f" in round {k + 1}; its row pools the rounds before" if v.name in measured else ""
                    say(f"{v.name} on {label}: unavailable{later}: {e}")
                except CorrectnessError as e:
                    stopped.add(v.name)
                    failures.append(str(e))
                    measured.pop(v.name, None)
                    if progress is not None:
                        progress.write(f"FAILED: {e}")
                    if not opts.keep_going:
                        raise
                finally:
                    _free(inst.device)
                    if progress is not None:
                        progress.update(1)
        for v in variants:
            if v.name in measured:
                rows.append(measured[v.name].row(env, v.instance_for(inst), v))
        del params, plan, expected, own
        _free(inst.device)
        if done is not None:
            fill_speedups(rows)
            done(rows)
    fill_speedups(rows)
    return Outcome(rows, notes, failures)


@dataclass
class Measured:
    """One variant's measurement on one instance (or several rounds of it, pooled)."""
    timing: measure.Timing
    bandwidth: Optional[measure.Bandwidth]
    prof: measure.StepProfile
    persistent: int
    state_bpp: Optional[float]
    deviation: Optional[float] = None  # weight_deviation after the check steps

    def pooled(self, more: Tuple[measure.Timing, Optional[measure.Bandwidth]]) -> "Measured":
        """With another round's steps and bandwidth samples (what a step holds and dispatches: the first's)."""
        timing, bandwidth = more
        host = (self.timing.host_ms or []) + (timing.host_ms or [])
        pooled = measure.Timing(self.timing.times_ms + timing.times_ms, host or None)
        bw = None if self.bandwidth is None else measure.Bandwidth(self.bandwidth.copy + bandwidth.copy,
                                                                    self.bandwidth.rmw + bandwidth.rmw)
        return Measured(pooled, bw, self.prof, self.persistent, self.state_bpp, self.deviation)

    def row(self, env: dict, inst: Instance, v: Variant) -> dict:
        row = _row(env, inst, v, self.timing, self.prof, self.persistent, self.state_bpp)
        row["weight_dev"] = NA if self.deviation is None else f"{self.deviation:.2g}"
        if self.bandwidth is not None:
            row.update(_bandwidth_columns(inst, v, self.timing, self.bandwidth))
        return row


def _checked_runner(inst, v, params, plan, expected):
    if v.disabled:
        raise Unavailable(f"not run: {v.disabled}")
    runner = v.build(inst, params)
    checker = getattr(v, "check_runner", None) or check
    checker(runner, inst, plan, expected)  # raises before anything is timed
    runner.deviation = weight_deviation(runner.snapshot(), expected, plan)
    return runner


def _timed(inst, runner, plan, opts) -> Tuple[measure.Timing, Optional[measure.Bandwidth]]:
    grads = plan.timing_grads

    def refill():
        runner.set_grads(grads)

    if opts.yardstick is not None:
        return opts.yardstick.time_steps(runner.step, refill, opts.warmup, opts.reps, opts.max_seconds)
    return measure.time_steps(runner.step, refill, inst.device, opts.warmup, opts.reps, opts.max_seconds), None


def _time_one(inst, v, params, plan, expected, opts) -> Tuple[measure.Timing, Optional[measure.Bandwidth]]:
    """A later round of variant ``v``: built and checked again, then timed."""
    return _timed(inst, _checked_runner(inst, v, params, plan, expected), plan, opts)


def _measure_one(inst, v, params, plan, expected, opts, say) -> Measured:
    """Checks, times and profiles variant ``v``; its notes go to ``say``."""
    cuda = inst.device.type == "cuda"
    baseline = torch.cuda.memory_allocated(inst.device) if cuda else 0
    runner = _checked_runner(inst, v, params, plan, expected)
    timing, bandwidth = _timed(inst, runner, plan, opts)
    # what the variant holds between steps: on CUDA everything it allocated (compiled code's buffers too),
    # elsewhere the storages behind its tensors
    persistent = (torch.cuda.memory_allocated(inst.device) - baseline if cuda
                  else measure.storage_bytes(runner.tensors()))
    state_bpp = state_bytes_per_param(runner, inst.workload.numel)
    prof = measure.profile_step(runner.step, lambda: runner.set_grads(plan.timing_grads), inst.device,
                                compiled=isinstance(v, TorchCompile))
    for n in runner.notes:
        say(f"{v.name} on {inst.label()}: {n}")
    return Measured(timing, bandwidth, prof, persistent, state_bpp, runner.deviation)
