"""``python -m bench.adafactor``: FusedAdafactor against torch.optim.Adafactor (its loop and foreach=True).

One step over a small transformer's parameters (matrices and vectors, synthetic gradients set before each step,
not timed): the median step time over ``--steps`` steps after warm-up, rounds of every variant in turn, and the
state bytes per parameter each keeps. torch's optimizer runs on fp32 parameters (its own precision); the fused
one on fp32 parameters and on a bf16 model with each state mode. Writes ``<stem>.csv`` and ``<stem>.txt``
under ``--out`` (the machine in the name and the header).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

import torch

import ampfused
from bench.common import bytes as B
from bench.common.env import describe, device_stem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shapes(width: int, layers: int, vocab: int) -> list:
    out = [(vocab, width)]
    for _ in range(layers):
        out += [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width), (width,), (width,)]
    return out + [(width,)]


def _state_bytes(opt) -> float:
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    held = 0
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                held += v.numel() * v.element_size()
    return held / n


VARIANTS = {
    "torch-Adafactor": (torch.float32, lambda ps, device: torch.optim.Adafactor(ps, foreach=False)),
    "torch-Adafactor-foreach": (torch.float32, lambda ps, device: torch.optim.Adafactor(ps, foreach=True)),
    "ampfused-fp32": (torch.float32, lambda ps, device: ampfused.FusedAdafactor(ps)),
    "ampfused-bf16-master": (torch.bfloat16, lambda ps, device: ampfused.FusedAdafactor(ps)),
    "ampfused-bf16+rem": (torch.bfloat16, lambda ps, device: ampfused.FusedAdafactor(ps, store_param_remainders=True)),
    "ampfused-bf16+sr": (torch.bfloat16, lambda ps, device: ampfused.FusedAdafactor(ps, bf16_stochastic_round=True)),
}


def run(variant: str, shp: list, steps: int, warmup: int, device: torch.device) -> tuple:
    dtype, make = VARIANTS[variant]
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shp]
    grads = [torch.randn(s, generator=gen).to(device=device, dtype=dtype) * 1e-2 for s in shp]
    opt = make(ps, device)
    times = []
    for k in range(warmup + steps):
        for p, g in zip(ps, grads):
            p.grad = g
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return times, _state_bytes(opt)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shp = shapes(args.width, args.layers, args.vocab)
    n = sum(torch.Size(s).numel() for s in shp)
    times = {v: [] for v in args.variants}
    held = {}
    for _ in range(args.rounds):
        for v in args.variants:
            t, held[v] = run(v, shp, args.steps, args.warmup, device)
            times[v] += t
    info = describe(device)
    stem = f"adafactor-{device_stem(device)}"
    os.makedirs(args.out, exist_ok=True)
    rows = []
    base = statistics.median(times[args.variants[0]])
    for v in args.variants:
        med = statistics.median(times[v])
        rows.append(dict(variant=v, params=n, median_ms=round(med * 1e3, 3), p10_ms=round(sorted(times[v])[
            len(times[v]) // 10] * 1e3, 3), vs_first=round(base / med, 2), state_bytes_per_param=round(held[v], 3)))
    with open(os.path.join(args.out, stem + ".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(info))
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, **info))
    lines = [f"# Adafactor step, {n / 1e6:.2f}M parameters ({len(shp)} tensors: width {args.width}, {args.layers} "
             f"layers, vocab {args.vocab}), {args.rounds} rounds x {args.steps} steps",
             f"# {info['device']}, torch {info['torch']}, ampfused {info['git_sha']}",
             f"# bytes/param of the fused step's passes from DRAM (bf16 model, bench/common/bytes.py): fp32 master "
             f"{B.adafactor_bytes_per_param(torch.bfloat16, torch.bfloat16)}, +rem "
             f"{B.adafactor_bytes_per_param(torch.bfloat16, torch.bfloat16, 'remainder')}, +sr "
             f"{B.adafactor_bytes_per_param(torch.bfloat16, torch.bfloat16, 'none')}",
             f"{'variant':28s} {'median ms':>10s} {'p10 ms':>8s} {'speedup':>8s} {'state B/param':>14s}"]
    for r in rows:
        lines.append(f"{r['variant']:28s} {r['median_ms']:10.3f} {r['p10_ms']:8.3f} {r['vs_first']:8.2f} "
                     f"{r['state_bytes_per_param']:14.3f}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, stem + ".txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
