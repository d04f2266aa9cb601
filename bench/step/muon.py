"""``python -m bench --optimizer muon``: FusedMuon's step (Muon for the matrices, AdamW for the rest, one
optimizer) against torch's recipe, with the state each keeps per parameter.

The model is a transformer's parameters (``--workloads d<width>x<layers>``, default d256x4): per layer the four
attention matrices (d x d), the MLP's (4d x d, d x 4d), and two LayerNorms' weights and biases; Muon takes the
matrices, AdamW the vectors. Every variant steps it with ``clip_grad_norm_`` by the norm over every parameter
and, unless ``--no-scaler``, a loss scale to undo:

* ``torch-muon+adamw``: fp32 parameters (the autocast recipe: torch keeps no masters), ``torch.optim.Muon`` and
  ``torch.optim.AdamW`` (foreach) under one ``torch.amp.GradScaler`` (``unscale_`` of both, the clip, both
  steps, ``update``): its iteration one matrix at a time;
* ``ampfused[+mode]``: :class:`ampfused.FusedMuon` with ``max_grad_norm`` and ``ampfused.GradScaler``, one step
  call; fp32 parameters, and a bf16 model with fp32 masters (``+bf16``) or master remainders (``+bf16+rem``).

Before timing, ampfused's first fp32 step is held to the oracle rule of tests/oracle.py on copies (no farther from
the fp64 step, its iteration in fp64, than twice torch's recipe, whose iteration runs in bf16 too), so a wrong
variant is not timed. Results:
``<out>/<stem>-muon.csv`` and a table on stdout.
"""
from __future__ import annotations

import os
from typing import Dict, List

import torch

from ..common import csv_rows, measure
from ..common import env as envmod

LR, AUX_LR, WD, MAX_NORM, SCALE = 0.02, 3e-3, 0.1, 1.0, 1024.0
MODES = {  # suffix: (parameter dtype, FusedMuon options)
    "": (torch.float32, {}),
    "+bf16": (torch.bfloat16, {}),
    "+bf16+rem": (torch.bfloat16, {"store_param_remainders": True}),
}
COLUMNS = ["device", "workload", "variant", "median_ms", "p20_ms", "p80_ms", "matrices", "params",
           "state_bytes_per_param", "threads", "torch", "git"]


def parse_workload(name: str) -> tuple:
    """``d<width>x<layers>`` -> (width, layers)."""
    if not name.startswith("d") or "x" not in name:
        raise SystemExit(f"--workloads {name}: the muon benchmark takes d<width>x<layers> (e.g. d256x4)")
    width, _, layers = name[1:].partition("x")
    return int(width), int(layers)


def shapes(width: int, layers: int) -> List[tuple]:
    """A transformer's parameter shapes: per layer q, k, v, o (d x d), the MLP (4d x d, d x 4d), two LayerNorms."""
    d = width
    per = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)] + [(d,)] * 4
    return per * layers


def _model(shp, dtype, device) -> List[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dtype).to(device)) for s in shp]


def _grads(params, scaled: bool) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(p.shape, generator=gen) * 1e-3 * (SCALE if scaled else 1.0)).to(p.dtype).to(p.device)
            for p in params]


def _torch_recipe(params, scaled: bool):
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() != 2]
    muon = torch.optim.Muon(mats, lr=LR, weight_decay=WD)
    adamw = torch.optim.AdamW(vecs, lr=AUX_LR, foreach=True)
    scaler = torch.amp.GradScaler(params[0].device.type, init_scale=SCALE, growth_interval=10 ** 9,
                                  enabled=scaled)

    def step():
        scaler.scale(torch.zeros((), device=params[0].device))  # (the loss would be scaled here)
        scaler.unscale_(muon)
        scaler.unscale_(adamw)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        scaler.step(muon)
        scaler.step(adamw)
        scaler.update()
    step.opts = (muon, adamw)
    return step


def _ampfused(params, scaled: bool, options: dict):
    import ampfused
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() != 2]
    opt = ampfused.FusedMuon([dict(params=mats), dict(params=vecs, use_muon=False, lr=AUX_LR)], lr=LR,
                             weight_decay=WD, max_grad_norm=MAX_NORM, **options)
    scaler = ampfused.GradScaler(params[0].device.type, init_scale=SCALE, growth_interval=10 ** 9, enabled=scaled)

    def step():
        scaler.scale(torch.zeros((), device=params[0].device))
        scaler.step(opt)
        scaler.update()
    step.opts = (opt,)
    return step


def _state_bytes(opts, n: int) -> float:
    tensors = [v for opt in opts for st in opt.state.values() for k, v in st.items()
               if isinstance(v, torch.Tensor) and k != "step"]
    return measure.storage_bytes(tensors) / n


def _oracle(base, grads, scaled) -> List[torch.Tensor]:
    """The first step in fp64 (the iteration too: ampfused's reference step on fp64 tensors; AdamW's groups by the
    reference AdamW), with the recipe's unscale and clip by the norm over every parameter."""
    from ampfused.ops import reference, reference_muon as M
    ps = [p.detach().double().cpu().clone() for p in base]
    g64 = [g.double().cpu() for g in grads]
    inv = torch.tensor(1 / SCALE if scaled else 1.0, dtype=torch.float64)
    partials = reference.norm_check(g64, inv)
    stats = torch.zeros(2, dtype=torch.float64)
    mats = [i for i, p in enumerate(ps) if p.dim() == 2]
    vecs = [i for i, p in enumerate(ps) if p.dim() != 2]
    layout = reference.state_layout
    buf = torch.zeros(layout([ps[i].numel() for i in mats])[1], dtype=torch.float64)
    M.muon_step_([ps[i] for i in mats], [g64[i] for i in mats], None, buf, torch.zeros(len(mats)), partials, inv,
                 torch.tensor(LR), stats, 0.95, True, WD, *M.NS_A_B_C, M.EPS, M.NS_STEPS, None, MAX_NORM)
    m, v = (torch.zeros(layout([ps[i].numel() for i in vecs])[1], dtype=torch.float64) for _ in range(2))
    reference.adam_step_([ps[i] for i in vecs], [g64[i] for i in vecs], None, m, v, torch.zeros(len(vecs)), partials,
                         inv, torch.tensor(AUX_LR), stats, 0.9, 0.999, 1e-8, 1e-2, MAX_NORM, True)
    return ps


def _check_against_the_oracle(base, grads, scaled) -> None:
    """ampfused's first fp32 step within the oracle rule of tests/oracle.py: no farther from the fp64 step than
    twice torch's recipe (its iteration in bf16 too) is, plus a floor; a wrong variant is not timed."""
    a = [torch.nn.Parameter(p.detach().clone()) for p in base]
    b = [torch.nn.Parameter(p.detach().clone()) for p in base]
    for x, y, g in zip(a, b, grads):
        x.grad, y.grad = g.clone(), g.clone()
    _ampfused(a, scaled, {})()
    _torch_recipe(b, scaled)()
    for i, (x, y, o) in enumerate(zip(a, b, _oracle(base, grads, scaled))):
        ours = (x.detach().double().cpu() - o).abs().max().item()
        theirs = (y.detach().double().cpu() - o).abs().max().item()
        if not ours <= 2 * theirs + 1e-7 * max(1.0, o.abs().max().item()):
            raise SystemExit(f"ampfused's Muon step: tensor {i} is {ours:.3g} from the fp64 step, torch's recipe "
                             f"{theirs:.3g}; a wrong variant is not timed")


def main(args, device: torch.device) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.workloads or ["d256x4"]
    scaled = not args.no_scaler
    env = envmod.describe(device)
    warmup = args.warmup if args.warmup is not None else 1
    reps, max_s = args.reps or 10, args.max_seconds or 6.0
    rows: List[Dict] = []
    for wname in names:
        shp = shapes(*parse_workload(wname))
        n = sum(torch.Size(s).numel() for s in shp)
        base = _model(shp, torch.float32, device)
        _check_against_the_oracle(base, _grads(base, scaled), scaled)
        variants = [("torch-muon+adamw", torch.float32, lambda ps: _torch_recipe(ps, scaled))]
        variants += [(f"ampfused{suffix}", dtype, lambda ps, o=options: _ampfused(ps, scaled, o))
                     for suffix, (dtype, options) in MODES.items()]
        for name, dtype, make in variants:
            params = _model(shp, dtype, device)
            grads = _grads(params, scaled)

            def regrad(params=params, grads=grads):
                for p, g in zip(params, grads):
                    p.grad = g.clone()
            regrad()
            step = make(params)
            t = measure.time_steps(step, regrad, device, warmup, reps, max_s)
            state = _state_bytes(step.opts, n)
            rows.append(dict(device=env["device"], workload=wname, variant=name, median_ms=round(t.median, 3),
                             p20_ms=round(t.p20, 3), p80_ms=round(t.p80, 3),
                             matrices=sum(len(s) == 2 for s in shp), params=n, state_bytes_per_param=round(state, 3),
                             threads=torch.get_num_threads(), torch=torch.__version__, git=env.get("git_sha", "")))
            print(f"{wname:>10} {name:<20} {t.median:9.2f} ms  state {state:5.2f} B/param", flush=True)
    stem = (args.name or envmod.device_stem(device)) + "-muon"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, stem + ".csv")
    csv_rows.write_rows(rows, path, COLUMNS)
    print(f"wrote {path}")
    return 0
