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
  call; fp32 parameters, and a bf16 model with fp32 masters (``+bf16``) or master remainders (``+bf16+rem``);
* ``heavyball-muon`` (heavyball installed; tested with 3.2.1): its ``MuonAdamW``, one optimizer that steps the
  parameters of two or more dimensions by Muon and the others by AdamW, here with the same two groups (Muon:
  ``lr``, ``betas[0]`` as the momentum, ``weight_decay``; AdamW: torch.optim.AdamW's defaults), on the bf16
  parameters themselves as the other libraries' peers run (bench/step/lion.py): the gradients unscaled, torch's
  ``clip_grad_norm_``, the step unless the norm is not finite (read on the host). Its state is fp32 (its
  ``storage_dtype``) and it keeps no master: each updated weight is rounded to bf16 stochastically. On the CPU its
  per-function ``torch.compile`` (``heavyball.utils.compile_mode``, on by default; ``compile_step`` is off by
  default) is turned off: there it made the first step of a five-tensor model take 10 s and no later step faster
  than eager (heavyball 3.2.1, torch 2.13, 2-core CPU). On CUDA it compiles as heavyball ships, outside the timed
  steps (in the check and the warmup).

heavyball's Muon is not torch.optim.Muon's math, so it is not held to torch's oracle. Where they differ
(heavyball 3.2.1, ``heavyball.utils.zeropower_via_newtonschulz5``, ``chainable.nesterov_ema``,
``orthogonalize_update``, ``scale_by_adam``): its Newton-Schulz iteration runs five steps with a coefficient
triple of its own per step (``HEAVYBALL_NS``) where torch repeats ``(3.4445, -4.7750, 2.0315)``, and rounds its
input to bf16 stochastically after normalising in fp32 (torch rounds to nearest, then normalises in bf16); its
Nesterov update is ``g + m`` with ``m = lerp(m, g, 1 - beta)`` where torch's is ``lerp(g, m, momentum)`` (after
the iteration's normalisation heavyball weighs the new gradient as much as the average, torch ``(1 - momentum)``
to ``momentum``); the iteration's ``sqrt(max(1, rows / cols))`` scale, the eps of its normalisation (1e-7) and
the decoupled decay ``w (1 - lr wd) - lr O`` are torch's (``adjust_lr_fn=None``). Its AdamW folds the bias
correction into the averages' coefficients (the same values as torch's) and divides by ``max(sqrt(v), eps)``
where torch divides by ``sqrt(v) + eps``. Its check before timing is against that math written out here
(``_heavyball_expectation``): three steps on bf16 copies, each weight no farther from the fp64 expectation than
twice the same expectation with the iteration in bf16 is, plus one bf16 ulp of the largest weight per step (its
stochastic rounding); a row that fails is dropped with the reason. heavyball passes it at 0.3 to 0.75 of the bound
(d16 to d256); torch's Muon + AdamW run as the peer is 4 to 7 times the bound, a momentum of 0.5 for 0.95 1.3 to
1.9 times (0.9 passes).

Before timing, ampfused's first fp32 step is held to the oracle rule of tests/oracle.py on copies (no farther from
the fp64 step, its iteration in fp64, than twice torch's recipe, whose iteration runs in bf16 too), so a wrong
variant is not timed. Results:
``<out>/<stem>-muon.csv`` and a table on stdout.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Dict, List, Optional

import torch

from ..common import csv_rows, measure
from ..common import env as envmod

LR, AUX_LR, WD, MAX_NORM, SCALE = 0.02, 3e-3, 0.1, 1.0, 1024.0
MOMENTUM = 0.95  # torch.optim.Muon's default
AUX_BETAS, AUX_EPS, AUX_WD = (0.9, 0.999), 1e-8, 1e-2  # torch.optim.AdamW's defaults
# heavyball 3.2.1's Newton-Schulz coefficients, one (a, b, c) per step (heavyball.utils.zeropower_via_newtonschulz5)
HEAVYBALL_NS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
HEAVYBALL_CHECK_STEPS = 3
MODES = {  # suffix: (parameter dtype, FusedMuon options)
    "": (torch.float32, {}),
    "+bf16": (torch.bfloat16, {}),
    "+bf16+rem": (torch.bfloat16, {"store_param_remainders": True}),
}
# the elementwise passes alone (the matrices only, the iteration left out) beside AdamW's fused step over the same
# matrices, each in GB/s of the bytes it must move: suffix -> (parameter dtype, FusedMuon / FusedAdamW options,
# master kind of bench.common.bytes)
PASS_MODES = {
    "+bf16": (torch.bfloat16, {}, "fp32"),
    "+bf16+rem": (torch.bfloat16, {"store_param_remainders": True}, "remainder"),
}
COLUMNS = ["device", "workload", "variant", "median_ms", "p20_ms", "p80_ms", "matrices", "params",
           "state_bytes_per_param", "gb_per_s", "threads", "torch", "git"]


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


def _grads(params, scaled: bool, seed: int = 1) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
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


def _state_tensors(state: dict) -> List[torch.Tensor]:
    """The tensors of one parameter's state but its step count, through the nested dicts heavyball keeps (one per
    view of the parameter)."""
    out = []
    for k, v in state.items():
        if isinstance(v, dict):
            out += _state_tensors(v)
        elif isinstance(v, torch.Tensor) and k != "step":
            out.append(v)
    return out


def _state_bytes(opts, n: int) -> float:
    tensors = [t for opt in opts for st in opt.state.values() for t in _state_tensors(st)]
    return measure.storage_bytes(tensors) / n


def _heavyball_absent() -> Optional[str]:
    try:
        import heavyball  # noqa: F401
    except ImportError as e:
        return f"not installed ({e}; pip install heavyball)"
    return None


def _heavyball_note(device: torch.device) -> str:
    import importlib.metadata
    try:
        version = importlib.metadata.version("heavyball")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return (f"heavyball-muon: heavyball {version} MuonAdamW on the bf16 parameters, checked against its own math "
            "(not torch's oracle)" + ("; its torch.compile off on the CPU" if device.type == "cpu" else ""))


def _heavyball(params, scaled: bool) -> Callable[[], None]:
    """heavyball's MuonAdamW on the bf16 parameters as the other libraries' peers run (bench/step/lion.py): the
    gradients unscaled, torch's clip, the step unless the norm is not finite (read on the host)."""
    import heavyball
    if params[0].device.type == "cpu":
        heavyball.utils.compile_mode = None  # its per-function torch.compile (module docstring)
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() != 2]
    opt = heavyball.MuonAdamW([dict(params=mats, lr=LR, betas=(MOMENTUM, AUX_BETAS[1]), weight_decay=WD),
                               dict(params=vecs, lr=AUX_LR, betas=AUX_BETAS, eps=AUX_EPS, weight_decay=AUX_WD)])

    @torch.no_grad()
    def step():
        if scaled:
            torch._foreach_mul_([p.grad for p in params], 1.0 / SCALE)
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        if torch.isfinite(norm).item():
            opt.step()
    step.opts = (opt,)
    return step


def _heavyball_ns(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """heavyball's Newton-Schulz iteration (round to nearest where heavyball rounds stochastically)."""
    x = (u / u.norm().clamp(min=1e-7)).to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    for a, b, c in HEAVYBALL_NS:
        s = x @ x.mT
        y = c * s
        y.diagonal().add_(b)
        y = y @ s
        y.diagonal().add_(a)
        x = y @ x
    return (x.mT if tall else x).double()


def _heavyball_expectation(base, grads_per_step, scaled: bool, ns_dtype: torch.dtype) -> List[torch.Tensor]:
    """heavyball's MuonAdamW steps (module docstring) in fp64 from the same weights and gradients, after the same
    unscale and torch's clip (``coef = min(1, max_norm / (norm + 1e-6))``); the iteration in ``ns_dtype``."""
    ps = [p.detach().double().cpu().clone() for p in base]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_per_step, start=1):
        gs = [g.double().cpu() * (1 / SCALE if scaled else 1.0) for g in grads]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in gs])))
        gs = [g * min(1.0, MAX_NORM / (norm + 1e-6)) for g in gs]
        for i, (p, g) in enumerate(zip(ps, gs)):
            if p.dim() == 2:
                m[i].lerp_(g, 1 - MOMENTUM)
                o = _heavyball_ns(g + m[i], ns_dtype) * math.sqrt(max(1.0, p.size(0) / p.size(1)))
                p.mul_(1 - LR * WD).add_(o, alpha=-LR)
            else:
                b1, b2 = (1 - (1 - b) / (1 - b ** t) for b in AUX_BETAS)  # its bias-corrected coefficients
                m[i].lerp_(g, 1 - b1)
                v[i].lerp_(g * g, 1 - b2)
                p.mul_(1 - AUX_LR * AUX_WD).add_(m[i] / v[i].sqrt().clamp(min=AUX_EPS), alpha=-AUX_LR)
    return ps


def _check_heavyball(base, scaled: bool, make=_heavyball, steps: int = HEAVYBALL_CHECK_STEPS) -> Optional[str]:
    """heavyball's steps on bf16 copies against their fp64 expectation (module docstring); the reason they are
    wrong, or None. ``make`` builds the step (another optimizer there checks this rule)."""
    ps = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in base]
    step = make(ps, scaled)
    seen = []
    for k in range(steps):
        grads = _grads(ps, scaled, seed=1 + k)
        seen.append(grads)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        step()
    start = [p.detach().to(torch.bfloat16) for p in base]
    e64 = _heavyball_expectation(start, seen, scaled, torch.float64)
    e16 = _heavyball_expectation(start, seen, scaled, torch.bfloat16)
    for i, (p, a, b) in enumerate(zip(ps, e64, e16)):
        got = (p.detach().double().cpu() - a).abs().max().item()
        top = a.abs().max().item()
        ulp = 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 0.0
        bound = 2 * (b - a).abs().max().item() + steps * ulp + 1e-7 * max(1.0, top)
        if not got <= bound:
            return (f"tensor {i} (shape {tuple(p.shape)}) is {got:.3g} from its expectation after {steps} steps, "
                    f"more than {bound:.3g} (twice the bf16 iteration's {(b - a).abs().max().item():.3g} + "
                    f"{steps} bf16 ulps of {top:.3g})")
    return None


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


class _WithoutIteration:
    """FusedMuon's step with the Newton-Schulz iteration left out (K1 and its two elementwise passes only, the
    first pass's output taken as the update), for the passes' bandwidth; restored on exit."""

    def __enter__(self):
        from ampfused.ops import reference_muon
        self.split = reference_muon.SPLIT
        self.split.between = lambda call, scratch: None
        return self

    def __exit__(self, *exc):
        del self.split.between


def _passes(shp, device, warmup: int, reps: int, max_s: float):
    """``(variant, Timing, GB/s)`` of Muon's passes and of FusedAdamW's step over the model's matrices, per mode of
    PASS_MODES: the bytes each must move (``bench.common.bytes``: K1, pass A and pass B; AdamW's K1 and K2) over
    its median time."""
    import ampfused
    from ..common import bytes as nbytes
    native = "cuda" if device.type == "cuda" else "cpu"
    if not ampfused.ops.get_backend(native).has_step("muon_step_"):
        return []  # (the reference runs the whole step: nothing to leave out)
    mats = [s for s in shp if len(s) == 2]
    n = sum(torch.Size(s).numel() for s in mats)
    out = []
    for suffix, (dtype, options, master) in PASS_MODES.items():
        passes = nbytes.muon_pass_bytes(dtype, dtype, master)
        for name, make, per in (
                (f"passes: ampfused{suffix}",
                 lambda ps: ampfused.FusedMuon(ps, lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM, **options),
                 passes["K1"] + passes["A"] + passes["B"]),
                (f"passes: fused-adamw{suffix}",
                 lambda ps: ampfused.FusedAdamW(ps, lr=LR, weight_decay=WD, max_grad_norm=MAX_NORM, **options),
                 nbytes.mode_bytes_per_param(dtype, dtype, master) + torch.empty((), dtype=dtype).element_size())):
            params = _model(mats, dtype, device)
            grads = _grads(params, False)

            def regrad(params=params, grads=grads):
                for p, g in zip(params, grads):
                    p.grad = g.clone()
            opt = make(params)
            with _WithoutIteration():
                t = measure.time_steps(opt.step, regrad, device, warmup, reps, max_s)
            out.append((name, t, per * n / (t.median * 1e6)))
    return out


def main(args, device: torch.device) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.workloads or ["d256x4"]
    scaled = not args.no_scaler
    env = envmod.describe(device)
    warmup = args.warmup if args.warmup is not None else 1
    reps, max_s = args.reps or 10, args.max_seconds or 6.0
    rows: List[Dict] = []
    notes: List[str] = []
    for wname in names:
        shp = shapes(*parse_workload(wname))
        n = sum(torch.Size(s).numel() for s in shp)
        base = _model(shp, torch.float32, device)
        _check_against_the_oracle(base, _grads(base, scaled), scaled)
        variants = [("torch-muon+adamw", torch.float32, lambda ps: _torch_recipe(ps, scaled))]
        variants += [(f"ampfused{suffix}", dtype, lambda ps, o=options: _ampfused(ps, scaled, o))
                     for suffix, (dtype, options) in MODES.items()]
        absent = _heavyball_absent()
        wrong = None if absent else _check_heavyball(base, scaled)
        if absent:
            notes.append(f"heavyball-muon: {absent}")
        elif wrong:
            notes.append(f"heavyball-muon ({wname}): dropped, {wrong}")
        else:
            variants.append(("heavyball-muon", torch.bfloat16, lambda ps: _heavyball(ps, scaled)))
            notes.append(_heavyball_note(device))
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
        for name, t, gbps in _passes(shp, device, warmup, max(reps, 20), max_s):
            rows.append(dict(device=env["device"], workload=wname, variant=name, median_ms=round(t.median, 3),
                             p20_ms=round(t.p20, 3), p80_ms=round(t.p80, 3), matrices=sum(len(s) == 2 for s in shp),
                             params=sum(torch.Size(s).numel() for s in shp if len(s) == 2),
                             gb_per_s=float(f"{gbps:.4g}"),  # four figures: a tiny workload is well under 0.01
                             threads=torch.get_num_threads(), torch=torch.__version__, git=env.get("git_sha", "")))
            print(f"{wname:>10} {name:<32} {t.median:9.3f} ms  {gbps:6.2f} GB/s", flush=True)
    stem = (args.name or envmod.device_stem(device)) + "-muon"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, stem + ".csv")
    csv_rows.write_rows(rows, path, COLUMNS)
    for line in dict.fromkeys(notes):
        print(line)
    print(f"wrote {path}")
    return 0
