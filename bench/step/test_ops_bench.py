"""Each ampfused op timed on its own, per backend (pytest-benchmark).

Run explicitly: ``pytest bench/ --benchmark-only`` (the project's ``pytest`` collects ``tests/`` only).
``AMPFUSED_BENCH_NUMEL`` sets the buffer size (default 4M parameters on CPU, 64M on CUDA); the gradient
dtype is bf16 with an fp32 master, the case the design is built around.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from ampfused import ops

from bench.step.ampfused_variant import ampfused_backends
from bench.common.measure import synchronize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUMEL = int(os.environ.get("AMPFUSED_BENCH_NUMEL", 64 * 2 ** 20 if DEVICE.type == "cuda" else 4 * 2 ** 20))
BACKENDS = ampfused_backends(DEVICE)


@pytest.fixture(scope="module")
def buffers():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    param = (torch.randn(NUMEL, generator=g, device=DEVICE) * 0.02).bfloat16()
    return dict(
        param=param, grad=(torch.randn(NUMEL, generator=g, device=DEVICE) * 1e-2).bfloat16(),
        master=param.float(), exp_avg=torch.zeros(NUMEL, device=DEVICE), exp_avg_sq=torch.zeros(NUMEL, device=DEVICE),
        step=torch.zeros((), device=DEVICE), lr=torch.full((), 1e-3, device=DEVICE),
        inv_scale=torch.ones((), device=DEVICE), out_stats=torch.zeros(2, device=DEVICE),
        scale=torch.full((), 1024.0, device=DEVICE), tracker=torch.zeros((), dtype=torch.int32, device=DEVICE))


def _run(benchmark, fn, nbytes=None):
    def timed():
        fn()
        synchronize(DEVICE)

    for _ in range(2):
        timed()
    benchmark.pedantic(timed, rounds=20 if DEVICE.type == "cpu" else 100, iterations=1)
    benchmark.extra_info.update(device=str(DEVICE), numel=NUMEL)
    if nbytes and benchmark.stats is not None:
        benchmark.extra_info["gbps"] = round(nbytes / benchmark.stats.stats.median / 1e9, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_check(benchmark, buffers, backend):
    b = buffers
    _run(benchmark, lambda: ops.norm_check([b["grad"]], b["inv_scale"], backend=backend), NUMEL * 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale(benchmark, buffers, backend):
    b = buffers  # inv_scale is 1: repeated rounds leave the gradients as they are
    _run(benchmark, lambda: ops.unscale_([b["grad"]], b["inv_scale"], backend=backend), NUMEL * 4)


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_step(benchmark, buffers, backend, clip):
    b = buffers
    partials = ops.norm_check([b["grad"]], b["inv_scale"], backend=backend)

    def step():
        ops.adamw_step_(b["param"], b["grad"], b["master"], b["exp_avg"], b["exp_avg_sq"], b["step"], partials,
                        b["inv_scale"], b["lr"], b["out_stats"], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                        max_norm=1.0 if clip else math.inf, backend=backend)

    _run(benchmark, step, NUMEL * 28)  # the step without its norm pass: 28 B/param (bench/common/bytes.py)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_scale(benchmark, buffers, backend):
    b = buffers
    found_inf = torch.zeros((), device=DEVICE)
    _run(benchmark, lambda: ops.update_scale_(b["scale"], b["tracker"], found_inf, 2.0, 0.5, 2000, backend=backend))
