"""``python -m bench --optimizer lion``: FusedLion's step in its state modes against torch's recipe for Lion and the
peers that are installed, with the bytes each must move and the state each keeps per parameter.

Every variant steps a bf16 model (``--workloads <N>[k|M]x<tensors>``, default 4Mx16) with clipping and, unless
``--no-scaler``, a loss scale to undo:

* ``torch-lion-foreach``: fp32 masters, ``clip_grad_norm_`` (foreach), an inf check read on the host, Lion in
  ``torch._foreach_*`` ops (optimi's order: decay, signed step, moment), the masters copied back;
* ``optimi-lion`` (torch-optimi installed): optimi's ``Lion`` on the bf16 parameters themselves (its Kahan
  compensation in bf16), after the same unscale + clip;
* ``bnb-lion8bit`` (bitsandbytes installed): its ``Lion8bit`` on the bf16 parameters, every tensor's moment in
  8-bit codes with one fp32 absmax per 256 elements (``min_8bit_size=0``; by default it keeps tensors under 4096
  elements in fp32), after the same unscale + clip;
* ``flashoptim-lion`` (flashoptim installed, CUDA only): its ``FlashLion`` on the bf16 parameters (its defaults:
  quantized moment, 24-bit master weights as a correction byte beside each bf16 weight), state bytes measured from
  its state tensors, after the same unscale + clip;
* ``ampfused-<backend>[+mode]``: :class:`ampfused.FusedLion`, one step call (K1 + K2; the scaler's inverse scale
  handed over as :class:`ampfused.GradScaler` hands it).

Before timing, each FusedLion variant's first step is held against ``ampfused.ops.reference.lion_step_`` (the
reference backend on copies): bitwise in the deterministic modes (fp32 master, remainders), and in the others too
(their draws are keyed by seed, step and index). Results: ``<out>/<stem>-lion.csv`` and a table on stdout.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional

import torch

from ..common import csv_rows, measure
from ..common import env as envmod
from ..common.bytes import lion_bytes_per_param, lion_state_bytes_per_param

LR, BETAS, WD, MAX_NORM, SCALE = 1e-4, (0.9, 0.99), 0.1, 1.0, 1024.0
MODES = {  # suffix: (FusedLion options, master kind, stored bytes per moment element)
    "": ({}, "fp32", 4.0),
    "+rem": ({"store_param_remainders": True}, "remainder", 4.0),
    "+bf16m": ({"exp_avg_dtype": torch.bfloat16}, "fp32", 2.0),
    "+rem+q8m": ({"store_param_remainders": True, "exp_avg_dtype": torch.uint8}, "remainder", 1 + 4 / 256),
    "+sr": ({"bf16_stochastic_round": True}, "none", 4.0),
    "+sr+q8m": ({"bf16_stochastic_round": True, "exp_avg_dtype": torch.uint8}, "none", 1 + 4 / 256),
}
COLUMNS = ["device", "workload", "variant", "median_ms", "p20_ms", "p80_ms", "bytes_per_param", "gbps",
           "state_bytes_per_param", "threads", "torch", "git"]


def parse_workload(name: str) -> tuple:
    """``<N>[k|M|B]x<tensors>`` -> (elements per tensor, tensors)."""
    size, _, count = name.partition("x")
    mult = {"k": 1e3, "M": 1e6, "B": 1e9}.get(size[-1:], 1)
    n = int(float(size[:-1] if size[-1:] in "kMB" else size) * mult)
    return max(1, n // int(count)), int(count)


def _model(per: int, count: int, device) -> List[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(per, generator=gen) * 0.02).to(torch.bfloat16).to(device))
            for _ in range(count)]


def _grads(params, scaled: bool) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(p.shape, generator=gen) * 1e-3 * (SCALE if scaled else 1.0)).to(p.dtype).to(p.device)
            for p in params]


def _torch_lion(params, scaled: bool) -> Callable[[], None]:
    masters = [p.detach().float().requires_grad_() for p in params]
    moments = [torch.zeros_like(m) for m in masters]

    @torch.no_grad()
    def step():
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        if scaled:
            torch._foreach_mul_([m.grad for m in masters], 1.0 / SCALE)
        norm = torch.nn.utils.clip_grad_norm_(masters, MAX_NORM, foreach=True)
        if not torch.isfinite(norm).item():  # the recipe's host read: skip the step
            return
        w, g = masters, [m.grad for m in masters]
        torch._foreach_mul_(w, 1 - LR * WD)
        c = torch._foreach_lerp(moments, g, 1 - BETAS[0])
        torch._foreach_add_(w, torch._foreach_sign(c), alpha=-LR)
        torch._foreach_lerp_(moments, g, 1 - BETAS[1])
        torch._foreach_copy_([p.data for p in params], w)
    return step


PEER_DIST = {"optimi-lion": "torch-optimi", "bnb-lion8bit": "bitsandbytes", "flashoptim-lion": "flashoptim"}


def _peer_step(opt, params, scaled: bool) -> Callable[[], None]:
    """A peer's step as the bf16 recipes run it: the gradients unscaled, torch's clip, the step unless the norm
    is not finite (read on the host); ``step.opt`` is the optimizer."""
    @torch.no_grad()
    def step():
        if scaled:
            torch._foreach_mul_([p.grad for p in params], 1.0 / SCALE)
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        if torch.isfinite(norm).item():
            opt.step()
    step.opt = opt
    return step


def _optimi_lion(params, scaled: bool) -> Optional[Callable[[], None]]:
    try:
        import optimi
    except ImportError:
        return None
    return _peer_step(optimi.Lion(params, lr=LR, betas=BETAS, weight_decay=WD, foreach=True, triton=False), params,
                      scaled)


def _bnb_lion8bit(params, scaled: bool) -> Optional[Callable[[], None]]:
    try:
        import bitsandbytes
    except ImportError:
        return None
    return _peer_step(bitsandbytes.optim.Lion8bit(params, lr=LR, betas=BETAS, weight_decay=WD, min_8bit_size=0),
                      params, scaled)


def _flash_lion(params, scaled: bool) -> Optional[Callable[[], None]]:
    if params[0].device.type != "cuda":  # (its quantization needs a GPU)
        return None
    try:
        import flashoptim
    except ImportError:
        return None
    return _peer_step(flashoptim.FlashLion(params, lr=LR, betas=BETAS, weight_decay=WD), params, scaled)


def _measured_state(opt, n: int) -> float:
    """Bytes of the storages behind an optimizer's state tensors (quantized containers' inner tensors), per
    parameter: after a step, when the state exists."""
    from .runner import _leaves
    tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return measure.storage_bytes([x for t in tensors for x in _leaves(t)]) / n


def _ampfused(params, scaled: bool, backend: str, options: dict):
    import ampfused
    opt = ampfused.FusedLion(params, lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=MAX_NORM, backend=backend,
                             **options)
    inv = torch.full((), 1.0 / SCALE, device=params[0].device)

    def step():
        if scaled:
            opt._ampfused_inv_scale = inv  # as GradScaler.step hands it over
        opt.step()
    return step, opt


def _check_against_reference(params, grads, scaled, backend, options) -> None:
    """The variant's first step against the reference backend's on copies: the same bits."""
    a = [torch.nn.Parameter(p.detach().clone()) for p in params]
    b = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for x, y, g in zip(a, b, grads):
        x.grad, y.grad = g.clone(), g.clone()
    fast, _ = _ampfused(a, scaled, backend, options)
    ref, _ = _ampfused(b, scaled, "reference", options)
    fast()
    ref()
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x.detach().view(torch.int16), y.detach().view(torch.int16)):
            raise SystemExit(f"ampfused-{backend}{options}: tensor {i} differs from the reference after one step; "
                             "a wrong variant is not timed")


def main(args, device: torch.device) -> int:
    import ampfused
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.workloads or ["4Mx16"]
    scaled = not args.no_scaler
    backends = [n for n in ("cpu", "cuda", "triton") if not ampfused.ops.registry.reasons_for(n, device)]
    env = envmod.describe(device)
    warmup = args.warmup if args.warmup is not None else 1
    reps, max_s = args.reps or 10, args.max_seconds or 4.0
    rows: List[Dict] = []
    notes = []
    for wname in names:
        per, count = parse_workload(wname)
        n = per * count
        base = _model(per, count, device)
        grads = _grads(base, scaled)
        variants = [("torch-lion-foreach", lambda ps: _torch_lion(ps, scaled), "fp32", 4.0),
                    ("optimi-lion", lambda ps: _optimi_lion(ps, scaled), "kahan", 2.0),
                    ("bnb-lion8bit", lambda ps: _bnb_lion8bit(ps, scaled), "bnb8", 1 + 4 / 256),
                    ("flashoptim-lion", lambda ps: _flash_lion(ps, scaled), "measured", 0.0)]
        for be in backends[:1]:
            for suffix, (options, master, mb) in MODES.items():
                _check_against_reference(base, grads, scaled, be, options)
                variants.append((f"ampfused-{be}{suffix}",
                                 lambda ps, be=be, o=options: _ampfused(ps, scaled, be, o)[0], master, mb))
        for name, make, master, mb in variants:
            params = [torch.nn.Parameter(p.detach().clone()) for p in base]
            for p, g in zip(params, grads):
                p.grad = g
            step = make(params)
            if step is None:
                why = "CUDA only" if name == "flashoptim-lion" and device.type != "cuda" else \
                    f"not installed (pip install {PEER_DIST.get(name, 'torch-optimi')})"
                notes.append(f"{name}: {why}")
                continue
            t = measure.time_steps(step, lambda: None, device, warmup, reps, max_s)
            if master == "kahan":  # optimi on bf16 weights: weight and compensation read + written
                bpp = 2 + 2 * 2 + 2 * 2 + 2 * mb
                state = 2 + mb  # the compensation and the moment, both bf16
            elif master in ("bnb8", "measured"):  # bf16 weights read + written, the gradient read, the state
                state = mb if master == "bnb8" else _measured_state(step.opt, n)  # read + written
                bpp = 2 + 2 * 2 + 2 * state
            else:
                bpp = lion_bytes_per_param(torch.bfloat16, torch.bfloat16, master, mb)
                state = lion_state_bytes_per_param(master, mb)
            rows.append(dict(device=env["device"], workload=wname, variant=name, median_ms=round(t.median, 3),
                             p20_ms=round(t.p20, 3), p80_ms=round(t.p80, 3), bytes_per_param=round(bpp, 2),
                             gbps=round(n * bpp / (t.median / 1e3) / 1e9, 2), state_bytes_per_param=round(state, 3),
                             threads=torch.get_num_threads(), torch=torch.__version__, git=env.get("git_sha", "")))
            print(f"{wname:>10} {name:<24} {t.median:9.2f} ms  {bpp:6.2f} B/param  "
                  f"{rows[-1]['gbps']:7.2f} GB/s  state {state:5.2f} B/param", flush=True)
    stem = (args.name or envmod.device_stem(device)) + "-lion"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, stem + ".csv")
    csv_rows.write_rows(rows, path, COLUMNS)
    for line in notes:
        print(line)
    print(f"wrote {path}")
    return 0
