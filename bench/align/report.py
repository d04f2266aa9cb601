"""Figures, bars, table, CSV and plot of ``python -m bench.align``.

Per pair of runs (a candidate against its reference): the relative loss difference ``|a - b| / |b|`` of every
logged step, its maximum and mean over all steps and over the last 100, the first step above 0.1%, and the same
figures for the loss averaged over windows of ``window`` steps. For pairs with fp32 masters, the masters after
optimizer steps 1, 2, 3, in the runs and on the same gradients (see ``align_runs.replay``).
"""
from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

THRESHOLD = 1e-3  # "loss within 0.1%"
LAST = 100
CONTROL_FACTOR = 1.2  # bar 1: ampfused no further from the torch recipe than torch's two implementations, x1.2
FEW_ULPS = 4  # bar 3
# (candidate, reference, what the pair measures)
PAIRS = (("torch-again", "torch", "run-to-run control (bf16)"),
         ("torch-foreach", "torch", "implementation control (bf16)"),
         ("ampfused", "torch", "ampfused vs torch recipe (bf16)"),
         ("ampfused-fp16", "torch-fp16", "ampfused vs torch recipe (fp16, loss scaler)"),
         ("torch", "fp32", "bf16 torch recipe vs fp32 truth"),
         ("ampfused", "fp32", "bf16 ampfused vs fp32 truth"),
         ("torch-fp16", "fp32", "fp16 torch recipe vs fp32 truth"),
         ("ampfused-fp16", "fp32", "fp16 ampfused vs fp32 truth"))
CONTROL, BF16, FP16 = ("torch-foreach", "torch"), ("ampfused", "torch"), ("ampfused-fp16", "torch-fp16")
MASTER_PAIRS = (("torch-again", "torch"), CONTROL, BF16, FP16)
# steps on the same gradients: (candidate, reference); which run's gradients they take is the "torch" side's
SAME_PAIRS = (CONTROL, BF16, FP16, ("ampfused", "torch-rounded-norm"), ("ampfused-fp16", "torch-fp16-rounded-norm"),
              ("torch", "exact"), ("torch-foreach", "exact"), ("ampfused", "exact"), ("torch-fp16", "exact"),
              ("ampfused-fp16", "exact"))
SNAPSHOTS_SHOWN = 3


def relative(a: Sequence[float], b: Sequence[float]) -> List[float]:
    return [abs(x - y) / abs(y) if y != 0 else (0.0 if x == y else math.inf) for x, y in zip(a, b)]


def window_means(losses: Sequence[float], window: int) -> List[float]:
    return [sum(losses[i:i + window]) / window for i in range(0, len(losses) - window + 1, window)]


def _first_over(values: Sequence[float]) -> Optional[int]:
    return next((i for i, v in enumerate(values) if v > THRESHOLD), None)


@dataclass
class PairFigures:
    name: str
    what: str
    steps: List[float]  # per-step relative difference
    windows: List[float]  # per-window relative difference of the window means
    window: int
    warmup: int
    bitwise: bool

    @property
    def last(self) -> List[float]:
        return self.steps[-LAST:]

    @property
    def after_warmup(self) -> List[float]:
        """Windows that start at or after the end of warm-up (all of them when none does)."""
        first = -(-self.warmup // self.window)
        return self.windows[first:] or self.windows

    def figures(self) -> Dict[str, float]:
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        return dict(max=max(self.steps), mean=mean(self.steps), max_last=max(self.last), mean_last=mean(self.last),
                    win_max=max(self.after_warmup), win_mean=mean(self.after_warmup), win_last=self.windows[-1],
                    win_max_all=max(self.windows))

    def first_step_over(self) -> Optional[int]:
        i = _first_over(self.steps)
        return None if i is None else i + 1

    def first_window_over(self) -> Optional[Tuple[int, int]]:
        i = _first_over(self.windows)
        return None if i is None else (i * self.window + 1, (i + 1) * self.window)


def pair_figures(runs: dict, window: int, warmup: int) -> Dict[Tuple[str, str], PairFigures]:
    out = {}
    for a, b, what in PAIRS:
        if a in runs and b in runs:
            la, lb = runs[a].losses, runs[b].losses
            out[(a, b)] = PairFigures(f"{a} vs {b}", what, relative(la, lb),
                                      relative(window_means(la, window), window_means(lb, window)), window, warmup,
                                      la == lb and torch.equal(runs[a].final_masters, runs[b].final_masters))
    return out


def ulp_distance(a: Tensor, b: Tensor, before: Tensor, sizes: Sequence[int]) -> Tensor:
    """``|a - b|`` in fp32 ULPs of the master's magnitude: the largest of the master before the step, after it
    (either run) and the update, floored at the RMS of its parameter tensor. ULPs of each result alone would
    count a master that an update brought near zero (or whose Adam moment cancelled) as thousands of ULPs
    apart for a difference far below the rounding of its neighbours."""
    rms = torch.cat([t.pow(2).mean().sqrt().expand(t.numel()) for t in before.split(list(sizes))])
    scale = torch.stack([a.abs(), b.abs(), before.abs(), (b - before).abs(), rms]).amax(0)
    _, e = torch.frexp(scale)
    ulp = torch.ldexp(torch.ones_like(scale), e - 24)
    return torch.where(a == b, torch.zeros_like(a), (a - b).abs() / ulp)


@dataclass
class MasterFigures:
    max_ulps: List[float] = field(default_factory=list)  # per snapshot step
    equal: List[float] = field(default_factory=list)  # share of masters bitwise equal
    within: List[float] = field(default_factory=list)  # share within FEW_ULPS
    weights_differ: List[int] = field(default_factory=list)  # model weights that differ (runs only)


def master_figures(a: List[Tensor], b: List[Tensor], initial: Tensor, sizes: Sequence[int],
                   weights: Optional[Tuple[list, list]] = None) -> MasterFigures:
    """Masters of run ``a`` against run ``b`` after each snapshot step (``weights``: the two models' own)."""
    f = MasterFigures()
    for k, (x, y) in enumerate(zip(a, b)):
        u = ulp_distance(x, y, initial if k == 0 else b[k - 1], sizes)
        f.max_ulps.append(float(u.max()))
        f.equal.append(float((u == 0).double().mean()))
        f.within.append(float((u <= FEW_ULPS).double().mean()))
        if weights is not None:
            f.weights_differ.append(int((weights[0][k] != weights[1][k]).sum()))
    return f


def before_chaos(m: MasterFigures) -> int:
    """How many of the first steps took the same forward pass in both runs: step k + 1 does while the model
    weights after step k are bitwise equal (step 1 always: same initial weights)."""
    n = 1
    while n < len(m.max_ulps) and m.weights_differ[n - 1] == 0:
        n += 1
    return n


@dataclass
class Bar:
    name: str
    passed: bool
    lines: List[str]


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%" if x < 0.1 else f"{100 * x:.2f}%"


def evaluate_bars(figs, masters: dict, same: dict, cfg, runs: Optional[dict] = None) -> List[Bar]:
    """The issue's three bars. ``masters``: run pairs; ``same``: pairs of steps taken on the same gradients
    (keys as ``SAME_PAIRS``)."""
    bars = []
    if CONTROL in figs and BF16 in figs:
        c, a = figs[CONTROL].figures(), figs[BF16].figures()
        lines, ok = [], True
        for key, label in (("max", "max, all steps"), ("mean", "mean, all steps"), ("max_last", f"max, last {LAST}"),
                           ("mean_last", f"mean, last {LAST}")):
            good = a[key] <= CONTROL_FACTOR * c[key]
            ok &= good
            ratio = a[key] / c[key] if c[key] else math.inf
            lines.append(f"{label}: ampfused vs torch {_pct(a[key])}, torch foreach vs fused {_pct(c[key])} "
                         f"({ratio:.2f}x) {'ok' if good else 'over'}")
        if not ok and runs:
            lines += _largest_step_why(figs, runs)
        bars.append(Bar(f"1. ampfused vs torch recipe no further apart than torch's foreach vs fused AdamW "
                        f"(within {CONTROL_FACTOR}x)", ok, lines))
    if CONTROL in figs:
        control = max(figs[CONTROL].after_warmup)
        lines, ok = [], True
        for key in (BF16, FP16):
            if key not in figs:
                continue
            worst = max(figs[key].after_warmup)
            if worst <= THRESHOLD:
                good, how = True, "every window within 0.1%"
            elif control > THRESHOLD:
                good = worst <= control
                how = f"over 0.1%, as torch's foreach vs fused is ({_pct(control)}): {'within' if good else 'beyond'} that"
            else:
                good, how = False, f"over 0.1% (torch's foreach vs fused: {_pct(control)})"
            ok &= good
            lines.append(f"{figs[key].name}: largest window difference after warm-up {_pct(worst)}, {how}")
        bars.append(Bar(f"2. {cfg.window}-step window means within 0.1% after warm-up (from step {cfg.warmup_steps + 1}), "
                        "or within torch's foreach vs fused", ok, lines))
    lines, ok = [], True
    for key in (BF16, FP16):
        if key in masters:
            m = masters[key]
            n = before_chaos(m)
            good = max(m.max_ulps[:n]) <= FEW_ULPS
            ok &= good
            later = (f" (from step {n + 1} on, chaos: the forward pass saw model weights that rounded differently; "
                     f"{', '.join(f'{u:g}' for u in m.max_ulps[n:])} ULPs)" if n < len(m.max_ulps) else "")
            lines.append(f"{key[0]} vs {key[1]}, in the runs, steps 1-{n}: "
                         f"{', '.join(f'{u:g}' for u in m.max_ulps[:n])} ULPs {'ok' if good else 'over'}{later}")
    for key in (BF16, FP16):
        if key in same:
            good = max(same[key].max_ulps) <= FEW_ULPS
            ok &= good
            lines.append(f"{key[0]} vs {key[1]}, same gradients: {_ulps(same[key])} ULPs {'ok' if good else 'over'}")
    if not ok and runs and ("ampfused", "torch-rounded-norm") in same and ("ampfused", "exact") in same:
        t_err = max((abs(e) for e in norm_errors(runs["torch"]) if math.isfinite(e)), default=math.nan)
        a_err = max((abs(e) for e in norm_errors(runs["ampfused"]) if math.isfinite(e)), default=math.nan)
        lines.append(f"why: torch's clip_grad_norm_ accumulates in fp32 (its norm is off by up to {t_err:.1e} at these "
                     f"steps, ampfused's by {a_err:.1e}); given that norm correctly rounded, torch's recipe is "
                     f"{_ulps(same[('ampfused', 'torch-rounded-norm')])} ULPs from ampfused on the same gradients; "
                     f"against the exact fp64 step ampfused is {_ulps(same[('ampfused', 'exact')])} ULPs off, torch "
                     f"{_ulps(same[('torch', 'exact')])} (fp16: ampfused {_ulps(same[('ampfused-fp16', 'exact')])}, "
                     f"torch {_ulps(same[('torch-fp16', 'exact')])})")
    if lines:
        bars.append(Bar(f"3. masters within {FEW_ULPS} ULPs at steps 1-{SNAPSHOTS_SHOWN} before chaos (in the runs, and "
                        "on the same gradients)", ok, lines))
    return bars


def _largest_step_why(figs, runs: dict) -> List[str]:
    """What the runs did at the step of the largest per-step difference (a max is one step of a chaotic curve)."""
    rel = figs[BF16].steps
    k = max(range(len(rel)), key=rel.__getitem__)
    near = sorted(runs["torch"].grad_norms[max(0, k - 25):k + 25])
    names = [n for n in ("fp32", "torch", "torch-foreach", "ampfused") if n in runs]
    losses = [runs[n].losses[k] for n in names]
    p99 = lambda v: sorted(v)[int(0.99 * (len(v) - 1))]  # noqa: E731
    mean = lambda v: sum(v) / max(1, len(v))  # noqa: E731
    ctl = figs[CONTROL].steps
    between = abs(runs["ampfused"].losses[k] - runs["torch-foreach"].losses[k]) / runs["torch-foreach"].losses[k]
    return [f"why: the largest difference is one step, {k + 1}, where the gradient norm jumps (torch's "
            f"{runs['torch'].grad_norms[k]:.2f}, median of the 50 steps around it {near[len(near) // 2]:.2f}) and the "
            f"loss is most sensitive to the weights, which parted ways in their last bits since chaos set in: "
            + ", ".join(f"{n} {x:.4f}" for n, x in zip(names, losses))
            + f" spread by {_pct((max(losses) - min(losses)) / min(losses))} (ampfused vs torch-foreach "
            f"{_pct(between)}); mean per-step difference before / after that step: ampfused vs torch "
            f"{_pct(mean(rel[:k]))} / {_pct(mean(rel[k:]))}, torch foreach vs fused {_pct(mean(ctl[:k]))} / "
            f"{_pct(mean(ctl[k:]))}; 99th percentile: ampfused vs torch {_pct(p99(rel))}, torch foreach vs fused "
            f"{_pct(p99(ctl))}"]


def _ulps(m: MasterFigures) -> str:
    return ", ".join(f"{u:g}" for u in m.max_ulps)


def tables(figs, masters: dict, same: dict, cfg, runs: dict) -> List[str]:
    w = cfg.window
    out = [f"Relative loss difference |a - b| / |b| per logged step, and of the {w}-step window means "
           f"(window figures: windows after warm-up, from step {cfg.warmup_steps + 1})", "",
           f"| pair | max | mean | max, last {LAST} | mean, last {LAST} | first step > 0.1% | window max | "
           f"window mean | last window | first window > 0.1% |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in figs.values():
        v = f.figures()
        if f.bitwise:
            out.append(f"| {f.name} | bitwise identical (losses and final masters) | | | | never | | | | never |")
            continue
        first = f.first_step_over()
        win = f.first_window_over()
        out.append(f"| {f.name} | {_pct(v['max'])} | {_pct(v['mean'])} | {_pct(v['max_last'])} | "
                   f"{_pct(v['mean_last'])} | {first if first else 'never'} | {_pct(v['win_max'])} | "
                   f"{_pct(v['win_mean'])} | {_pct(v['win_last'])} | {f'{win[0]}-{win[1]}' if win else 'never'} |")
    for which, keys in (("of the implementations", [k for k in figs if k[1] != "fp32"]),
                        ("against the fp32 truth", [k for k in figs if k[1] == "fp32"])):
        overs = [(figs[k].first_step_over(), figs[k].name) for k in keys if figs[k].first_step_over()]
        if keys:
            out += ["", f"First step where any pair {which} exceeds 0.1%: "
                        + (f"step {min(overs)[0]} ({min(overs)[1]})." if overs else "none.")]
    sl = lambda v, f: " / ".join(f(x) for x in v)  # noqa: E731
    pct = lambda e: f"{100 * e:.1f}%"  # noqa: E731
    if masters:
        n = len(next(iter(masters.values())).max_ulps)
        out += ["", f"fp32 masters after optimizer steps {sl(range(1, n + 1), str)}: largest difference in ULPs of "
                    "the master's magnitude (floored at its tensor's RMS), share bitwise equal, and the model's own "
                    "weights that differ", "",
                "| pair | max ULPs | bitwise equal | model weights that differ |", "| --- | --- | --- | --- |"]
        for key, m in masters.items():
            out.append(f"| {key[0]} vs {key[1]} | {sl(m.max_ulps, '{:g}'.format)} | {sl(m.equal, pct)} | "
                       f"{sl(m.weights_differ, str)} |")
    if same:
        out += ["", "The same steps on the same gradients (the reference run's own, replayed): `exact` is the fp64 step "
                    "(fp64 masters, clip and AdamW) rounded to fp32; `*-rounded-norm` is torch's recipe with "
                    "clip_grad_norm_'s arithmetic applied to the correctly rounded norm", "",
                "| pair | max ULPs | bitwise equal |", "| --- | --- | --- |"]
        for (a, b), m in same.items():
            out.append(f"| {a} vs {b} | {sl(m.max_ulps, '{:g}'.format)} | {sl(m.equal, pct)} |")
    out += norm_table(runs)
    fp16 = [runs[n] for n in ("torch-fp16", "ampfused-fp16") if n in runs]
    if fp16:
        out.append("")
    for r in fp16:
        shown = ", ".join(map(str, r.skipped[:12])) + (", ..." if len(r.skipped) > 12 else "")
        out.append(f"{r.name}: loss scale {r.scales[0]:g} at step 1, {r.scales[-1]:g} at the last; {len(r.skipped)} "
                   f"step(s) skipped for non-finite gradients" + (f" ({shown})" if r.skipped else ""))
    if len(fp16) == 2:
        same_scales = fp16[0].scales == fp16[1].scales
        out.append(f"fp16 loss-scale curves and skipped steps {'identical' if same_scales else 'differ'} between the two")
    return out


def norm_errors(run) -> List[float]:
    """Relative error of the norm ``run``'s clip used at each snapshot step, against the fp64 norm of the same
    gradients (unscaled by the loss scale); NaN where they were not finite."""
    out = []
    for k, grads in enumerate(run.grads):
        exact = torch.cat([g.double().reshape(-1) for g in grads]).norm().item() / (run.scales[k] if run.scales else 1)
        out.append((run.grad_norms[k] - exact) / exact if math.isfinite(exact) and exact else math.nan)
    return out


def norm_table(runs: dict) -> List[str]:
    """The gradient norm each run's clip used at its first steps, against the fp64 norm of the same gradients."""
    names = [n for n in ("torch", "torch-foreach", "ampfused", "torch-fp16", "ampfused-fp16") if n in runs]
    if not names or not runs[names[0]].grads:
        return []
    n = len(runs[names[0]].grads)
    out = ["", "Gradient norm the clip used (relative error against the fp64 norm of the same gradients)", "",
           "| run | " + " | ".join(f"step {k + 1}" for k in range(n)) + " |", "| --- |" + " --- |" * n]
    for name in names:
        r = runs[name]
        cells = [f"{norm:.7g} ({err:+.1e})" for norm, err in zip(r.grad_norms, norm_errors(r))]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def write_csv(path: str, runs: dict, cfg) -> str:
    names = list(runs)
    cols = ["step", "lr"] + [f"loss_{n}" for n in names] + [f"grad_norm_{n}" for n in names] + \
        [f"scale_{n}" for n in names if runs[n].scales]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i in range(cfg.steps):
            w.writerow([i + 1, f"{cfg.lr_at(i):.6g}"] + [repr(runs[n].losses[i]) for n in names]
                       + [repr(runs[n].grad_norms[i]) for n in names]
                       + [f"{runs[n].scales[i]:g}" for n in names if runs[n].scales])
    return path


STYLE = {"fp32": ("black", "-"), "torch": ("tab:blue", "-"), "torch-again": ("tab:cyan", ":"),
         "torch-foreach": ("tab:gray", "-"), "ampfused": ("tab:red", "-"), "torch-fp16": ("tab:green", "-"),
         "ampfused-fp16": ("tab:orange", "-")}
PAIR_COLORS = {CONTROL: "tab:gray", BF16: "tab:red", FP16: "tab:orange"}
TRUTH_COLORS = {("torch", "fp32"): "tab:blue", ("ampfused", "fp32"): "tab:purple"}


def plot(path: str, runs: dict, figs, cfg, title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = cfg.window
    steps = list(range(1, cfg.steps + 1))
    centers = [i * w + (w + 1) / 2 for i in range(cfg.steps // w)]
    fig, axes = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    ax = axes[0]
    for name, r in runs.items():
        color, ls = STYLE.get(name, ("tab:brown", "-"))
        ax.plot(steps, r.losses, color=color, lw=0.4, alpha=0.35)
        ax.plot(centers, window_means(r.losses, w), color=color, ls=ls, marker=".", lw=1.2,
                label=f"{name}" + (" (same as torch)" if name == "torch-again" and figs.get(("torch-again", "torch"))
                                   and figs[("torch-again", "torch")].bitwise else ""))
    ax.set_ylabel(f"training loss (per step; dots: {w}-step means)")
    ax.legend(fontsize=8, ncol=2)
    for ax, attr, label in ((axes[1], "steps", "per-step relative loss difference"),
                            (axes[2], "windows", f"relative difference of {w}-step window means")):
        colors = {**PAIR_COLORS, **({} if attr == "steps" else TRUTH_COLORS)}
        for key, color in colors.items():
            f = figs.get(key)
            if f is None:
                continue
            ys = getattr(f, attr)
            xs = steps if attr == "steps" else centers
            pts = [(x, y) for x, y in zip(xs, ys) if y > 0]
            truth = key in TRUTH_COLORS
            if pts and attr == "steps":  # faint per step, a 25-step running mean on top
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=0.5, alpha=0.35)
                run = [sum(ys[max(0, i - 24):i + 1]) / len(ys[max(0, i - 24):i + 1]) for i in range(len(ys))]
                ax.plot(xs, run, color=color, lw=1.6, label=f"{f.name} (25-step running mean)")
            elif pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.2, ls="--" if truth else "-",
                        marker="." if truth else "o", ms=3, label=f.name)
        ax.axhline(THRESHOLD, color="k", ls="--", lw=1, label="0.1%")
        ax.axvspan(0, cfg.warmup_steps, color="0.9", zorder=0)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, which="both", alpha=0.25)
    again = figs.get(("torch-again", "torch"))
    if again is not None and again.bitwise:
        axes[1].set_title("torch-again vs torch: bitwise identical (not drawn on a log scale)", fontsize=8)
    axes[2].set_xlabel(f"optimizer step (shaded: {cfg.warmup_steps}-step warm-up)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
