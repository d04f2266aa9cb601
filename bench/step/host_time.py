"""Host time of one fused step: ``python -m bench.step.host_time``.

Two tables, in one process:

* **the host pass**: ``opt.step()`` and ``scaler.step(opt)`` + ``scaler.update()`` of ``ampfused.FusedAdamW``
  (bf16 tensors of 16 elements, so the kernels' own work is negligible and what is measured is the host's) on
  the CPU backend, for several tensor counts, with the optimizers' host pass (``ampfused._host``) and with it
  switched off (the Python path that computes the same tables); each the median of 5 rounds' wall time;
* **each backend's host part** (``--backends``): ``opt.step()`` over bf16 parameters of ``--params`` elements in
  all (1M), split into each tensor count, with each backend as it is up to its kernels, the kernels replaced
  by calls that do nothing (:mod:`bench.step.host_stubs`: ``cpu``, ``cuda`` and ``triton`` run here without a
  device, ``reference`` is the Python path). In place (the same gradient tensors every step, as
  ``zero_grad(set_to_none=False)`` leaves them) and with fresh gradients (new tensors each step, at new
  addresses, as backward hands them after the default ``zero_grad()``); per step and per tensor, the median
  over every step of the thread's CPU time (so that a step preempted on a shared machine counts what it ran,
  not what it waited; a call of the clock costs about a microsecond of it).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import List, Optional

import torch

import ampfused
from ampfused.optim import _segments

from ..common.settings import restores_torch_settings
from . import host_stubs


def _stepper(opt, scaler_path: bool):
    """One step of ``opt``: through ``ampfused.GradScaler`` (scale, step, update) when ``scaler_path``."""
    scaler, one = ampfused.GradScaler("cpu"), torch.ones(())

    def call():
        if scaler_path:
            scaler.scale(one)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return call


def time_step(tensors: int, use_host: bool, scaler_path: bool, calls: int = 20000, rounds: int = 5) -> float:
    """Median microseconds per call over ``rounds`` rounds of ``max(20, calls // tensors)`` calls."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ampfused.FusedAdamW(params, lr=1e-3, max_grad_norm=1.0, backend="cpu")
    call = _stepper(opt, scaler_path)

    saved = _segments._HOST
    if not use_host:
        _segments._HOST = None
    try:
        for _ in range(5):
            call()
        n = max(20, calls // tensors)
        times: List[float] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            times.append((time.perf_counter() - t0) / n * 1e6)
    finally:
        _segments._HOST = saved
    return sorted(times)[len(times) // 2]


def table(counts: List[int], calls: int = 20000, rounds: int = 5) -> str:
    host = _segments._host() is not None
    rows = ["| tensors | path | `opt.step()` | `scaler.step` + `update` |", "| --- | --- | --- | --- |"]
    for t in counts:
        for use in ([False, True] if host else [False]):
            name = "`ampfused._host`" if use else "Python"
            step = time_step(t, use, False, calls, rounds)
            scaled = time_step(t, use, True, calls, rounds)
            rows.append(f"| {t} | {name} | {step:.0f} us | {scaled:.0f} us |")
    if not host:
        rows.append("")
        rows.append("(ampfused._host is not built here: only the Python path was timed)")
    return "\n".join(rows)


def _split(total: int, tensors: int) -> List[int]:
    base, extra = divmod(total, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


def time_backend(backend: str, tensors: int, params: int, fresh: bool, scaler_path: bool = False,
                 calls: int = 20000, rounds: int = 5, sets: int = 3) -> float:
    """Median microseconds of this thread's CPU time per ``opt.step()`` (with ``scaler_path``: ``scaler.step`` +
    ``update``), over ``rounds * max(20, calls // tensors)`` steps, with ``backend``'s host part (:func:`host_stubs.host_only`) over ``tensors`` bf16 parameters of ``params`` elements in all;
    ``fresh``: each step's gradients are new tensors (``sets`` sets of them in turn, assigned outside the timing)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in _split(params, tensors)]
    grads = [[torch.randn_like(p) for p in ps] for _ in range(sets if fresh else 1)]
    with host_stubs.host_only(backend) as name:
        opt = ampfused.FusedAdamW(ps, lr=1e-3, max_grad_norm=1.0, backend=name)
        call = _stepper(opt, scaler_path)

        def give(k):
            if fresh or k == 0:
                for p, g in zip(ps, grads[k % len(grads)]):
                    p.grad = g

        for k in range(6):
            give(k)
            call()
        n = max(20, calls // tensors)
        times: List[float] = []
        clock = time.thread_time  # this thread's CPU time: a step preempted on a shared machine is not charged
        for _ in range(rounds * n):
            give(len(times))
            t0 = clock()
            call()
            times.append(clock() - t0)
    return statistics.median(times) * 1e6


def backend_table(backends: List[str], counts: List[int], params: int = 1 << 20, calls: int = 20000,
                  rounds: int = 5, scaler: bool = False) -> str:
    """One row per backend and tensor count: host microseconds per step and nanoseconds per tensor, in place and
    with fresh gradients (and with the scaler in place, when asked)."""
    head = "| backend | tensors | in place | per tensor | fresh gradients | per tensor | fresh / in place |"
    rule = "| --- | --- | --- | --- | --- | --- | --- |"
    if scaler:
        head += " scaler, in place |"
        rule += " --- |"
    rows = [head, rule]
    for b in backends:
        for t in counts:
            inplace = time_backend(b, t, params, False, False, calls, rounds)
            fresh = time_backend(b, t, params, True, False, calls, rounds)
            row = (f"| {b} | {t} | {inplace:.1f} us | {inplace / t * 1e3:.0f} ns | {fresh:.1f} us | "
                   f"{fresh / t * 1e3:.0f} ns | {fresh / inplace:.2f} |")
            if scaler:
                row += f" {time_backend(b, t, params, False, True, calls, rounds):.1f} us |"
            rows.append(row)
    return "\n".join(rows)


def _ints(text: str) -> List[int]:
    return [int(float(t[:-1]) * (1 << 20)) if t.endswith("M") else int(t) for t in text.split(",")]


@restores_torch_settings
def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.step.host_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", default="1,200,2000", help="comma-separated tensor counts (default 1,200,2000)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per round, divided by the tensor count")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", default=",".join(host_stubs.NAMES),
                    help=f"backends whose host part to time (default {','.join(host_stubs.NAMES)}; empty: none)")
    ap.add_argument("--backend-tensors", default="200,2000", help="tensor counts of that table (default 200,2000)")
    ap.add_argument("--params", default="1M", help="parameters in all, split over the tensors (default 1M)")
    ap.add_argument("--scaler", action="store_true", help="also time scaler.step + update in place per backend")
    ap.add_argument("--skip-host-pass", action="store_true", help="only the table of the backends' host parts")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.skip_host_pass:
        print(table([int(t) for t in args.tensors.split(",")], args.calls, args.rounds))
        print()
    backends = [b for b in args.backends.split(",") if b]
    if backends:
        print(backend_table(backends, _ints(args.backend_tensors), _ints(args.params)[0], args.calls, args.rounds,
                            args.scaler))


if __name__ == "__main__":
    main()
