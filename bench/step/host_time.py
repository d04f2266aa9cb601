"""Host time of one fused step: ``python -m bench.step.host_time``.

Times ``opt.step()`` and ``scaler.step(opt)`` + ``scaler.update()`` of ``ampfused.FusedAdamW`` (bf16 tensors of 16
elements, so the kernels' own work is negligible and what is measured is the host's) on the CPU, for several
tensor counts, with the optimizers' host pass (``ampfused._host``) and with it switched off (the Python path
that computes the same tables). Both run in one process, each the median of 5 rounds; print a markdown table.
"""
from __future__ import annotations

import argparse
import time
from typing import List

import torch

import ampfused
from ampfused.optim import _gradients


def time_step(tensors: int, use_host: bool, scaler_path: bool, calls: int = 20000, rounds: int = 5) -> float:
    """Median microseconds per call over ``rounds`` rounds of ``max(20, calls // tensors)`` calls."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ampfused.FusedAdamW(params, lr=1e-3, max_grad_norm=1.0, backend="cpu")
    scaler = ampfused.GradScaler("cpu")
    one = torch.ones(())

    def call():
        if scaler_path:
            scaler.scale(one)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    saved = _gradients._HOST
    if not use_host:
        _gradients._HOST = None
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
        _gradients._HOST = saved
    return sorted(times)[len(times) // 2]


def table(counts: List[int], calls: int = 20000, rounds: int = 5) -> str:
    host = _gradients._host() is not None
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.step.host_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", default="1,200,2000", help="comma-separated tensor counts (default 1,200,2000)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per round, divided by the tensor count")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(table([int(t) for t in args.tensors.split(",")], args.calls, args.rounds))


if __name__ == "__main__":
    main()
