"""``python -m bench.align``: does ampfused train to the same loss as torch's mixed-precision recipe, step by step,
over a long run?

A small byte-level GPT (``bench/align/model.py``) learns Python's own standard-library source for ``--steps``
optimizer steps, seven times over, from the same initial weights on the same batches (``bench/align/runs.py``):
an fp32 run (the truth); in bf16, torch's recipe (fp32 master copy, ``clip_grad_norm_``, ``AdamW(fused=True)``,
copy back) twice and once with ``AdamW(foreach=True)``, and ``ampfused.FusedAdamW(max_grad_norm=...)``; in fp16,
the recipe under ``torch.amp.GradScaler`` and FusedAdamW under ``ampfused.GradScaler``. Per-step losses of two
mixed-precision runs part ways after a few dozen steps whatever the implementation (any difference in the last
bit of a weight changes later batches' rounding), so ampfused is held to what torch's own two implementations
do against each other (``bench/align/report.py``):

1. ampfused against the torch recipe is no further apart than torch's foreach against its fused AdamW (max and
   mean relative loss difference, all steps and the last 100, within 1.2x);
2. the 50-step window means agree within 0.1% at every window after warm-up (or, where torch's foreach vs fused
   does not either, within that pair's own figure);
3. before chaos the fp32 masters agree to a few ULPs: after steps 1-3 of the runs, and of the same steps taken
   on the same gradients (with, to tell where a difference comes from, the exact fp64 step and torch's recipe
   given the correctly rounded gradient norm).

Results go to ``<out>/align-<device>.{csv,txt,png}``. ``--strict`` exits with 1 when a bar fails.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import model as M
from . import report as R
from . import runs as T
from ..common import env as envmod
from ..common.env import RESULTS
from ..common.settings import restores_torch_settings


DESCRIPTION = ("Does ampfused train to the same loss as torch's mixed-precision recipe, every step of a long run? "
               "Seven runs of a small byte-level GPT (fp32 truth; bf16: torch recipe twice, with foreach AdamW, "
               "ampfused; fp16 with loss scalers: torch recipe, ampfused), the relative loss difference of each pair, "
               "the masters of the first steps, and the issue's three bars. Writes <out>/align-<device>.{csv,txt,png}.")


@dataclass
class Outcome:
    runs: dict
    figs: dict
    masters: dict
    same: dict
    bars: List[R.Bar]
    deterministic: bool
    text: str
    head_lines: int


def parser() -> argparse.ArgumentParser:
    d = M.Config()
    p = argparse.ArgumentParser(prog="python -m bench.align", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="the issue's GPU configuration: --layers 4 --width 256 --context 128 --batch 32 "
                                       "(3.3M parameters)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps per run (default {d.steps})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"decoder blocks (default {d.layers})")
    p.add_argument("--width", type=int, default=d.width, help=f"model width (default {d.width})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--context", type=int, default=d.context, help=f"bytes per sequence (default {d.context})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr:g})")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (default: a tenth of --steps)")
    p.add_argument("--window", type=int, default=d.window, help=f"steps per averaging window (default {d.window})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on CPU (default 1: deterministic, and on a shared machine often faster)")
    p.add_argument("--fp16-compute", choices=["auto", "fp16", "fp32"], default="auto",
                   help="arithmetic of the fp16 model (auto: fp16 on CUDA; fp32 on CPU, where fp16 matrix "
                        "products run tens of times slower; weights and gradients stay fp16 either way)")
    p.add_argument("--out", default=RESULTS, help=f"output directory (default {RESULTS}; bench/results to commit)")
    p.add_argument("--name", default=None, help="file stem (default align-<device>)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a bar fails or the control is not bitwise")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--modes", action="store_true",
                   help="instead of the seven runs: ampfused's compact state modes (and the installed peers' "
                        "low-precision AdamW) against its fp32-master run (bench/align/modes.py); writes "
                        "<out>/align-modes-<device>.{csv,txt}")
    p.add_argument("--bf16-compute", choices=["bf16", "fp32"], default="bf16",
                   help="with --modes: the bf16 model's arithmetic (fp32 where the CPU's bf16 matrix products are slow: "
                        "without AVX-512 BF16 they ran 27x slower than fp32 ones here); weights and gradients stay "
                        "bf16, and the optimizers' own arithmetic is theirs either way")
    p.add_argument("--no-peers", action="store_true", help="with --modes: leave the other libraries out")
    p.add_argument("--optimizer", choices=["adamw", "lion", "adafactor", "muon"], default="adamw",
                   help="with --modes: the optimizer whose modes run against its own fp32-master run (default adamw; "
                        "writes <out>/align-modes-<optimizer>-<device>.{csv,txt} for the others)")
    return p


def _deterministic(device: torch.device) -> None:
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # attention by the math kernel: the fused ones' backward may accumulate in a varying order
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)


def header(cfg: M.Config, device: torch.device, fp16_compute: torch.dtype, corpus: str) -> List[str]:
    env = envmod.describe(device)
    n = M.n_params(cfg)
    fp16 = ("fp16 weights and gradients, arithmetic in fp32" if fp16_compute == torch.float32
            else "fp16 weights, gradients and arithmetic")
    return [
        f"python -m bench.align: {len(T.RUNS)} runs of {cfg.steps} optimizer steps",
        f"model: byte-level GPT, {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, context {cfg.context}, "
        f"batch {cfg.batch} ({n / 1e6:.2f}M parameters); loss on fp32 logits",
        f"step: AdamW lr {cfg.lr:g} (linear warm-up {cfg.warmup_steps} steps, cosine to {cfg.lr * cfg.min_lr_ratio:g}), "
        f"betas {cfg.betas}, eps {cfg.eps:g}, weight decay {cfg.weight_decay:g} on matrices and embeddings, "
        f"clip at {cfg.max_norm:g}",
        f"fp16 runs: {fp16}; loss scale {cfg.init_scale:g}, growth interval {cfg.growth_interval}",
        f"text: {corpus} (Python {platform.python_version()}); same batches and initial weights in every run, "
        f"seed {cfg.seed}",
        f"device: {env['device']}; torch {env['torch']}, ampfused {env['git_sha']}"
        + ("; attention by the math kernel (deterministic)" if device.type == "cuda" else ""),
    ]


def execute(cfg: M.Config, device: torch.device, fp16_compute: torch.dtype, log=print) -> Outcome:
    data, corpus = M.corpus()
    offsets = M.batch_offsets(len(data), cfg)
    state = M.initial_state(cfg)
    head = header(cfg, device, fp16_compute, corpus)
    for line in head:
        log(line)
    runs = {}
    t0 = time.perf_counter()
    for name in T.RUNS:
        runs[name] = r = T.train(name, cfg, data, offsets, state, device, fp16_compute)
        log(f"  {name:>14}: {r.seconds:6.1f} s, loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}"
            + (f", {len(r.skipped)} skipped steps" if r.skipped else ""))
    replayed = {"torch": runs["torch"].masters, "torch-fp16": runs["torch-fp16"].masters}
    for name, source in (("torch-foreach", "torch"), ("ampfused", "torch"), ("torch-rounded-norm", "torch"),
                         ("ampfused-fp16", "torch-fp16"), ("torch-fp16-rounded-norm", "torch-fp16")):
        replayed[name] = T.replay(name, runs[source], cfg, state, device)
    exact = {source: T.replay_exact(runs[source], cfg, state) for source in ("torch", "torch-fp16")}
    elapsed = time.perf_counter() - t0
    initial = torch.cat([v.reshape(-1) for v in state.values()])
    sizes = [v.numel() for v in state.values()]
    figs = R.pair_figures(runs, cfg.window, cfg.warmup_steps)
    masters = {(a, b): R.master_figures(runs[a].masters, runs[b].masters, initial, sizes,
                                        (runs[a].weights, runs[b].weights)) for a, b in R.MASTER_PAIRS}
    same = {}
    for a, b in R.SAME_PAIRS:
        ref = exact["torch-fp16" if "fp16" in a else "torch"] if b == "exact" else replayed[b]
        same[(a, b)] = R.master_figures(replayed[a], ref, initial, sizes)
    bars = R.evaluate_bars(figs, masters, same, cfg, runs)
    deterministic = figs[("torch-again", "torch")].bitwise
    lines = head + [f"wall time: {elapsed:.0f} s ("
                    + ", ".join(f"{n} {r.seconds:.0f} s" for n, r in runs.items()) + ")", ""]
    lines += R.tables(figs, masters, same, cfg, runs) + [""]
    lines.append(f"Run-to-run control: torch recipe twice {'bitwise identical' if deterministic else 'NOT IDENTICAL'}"
                 " (losses and final masters)")
    for b in bars:
        lines.append(f"{'PASS' if b.passed else 'FAIL'}  {b.name}")
        lines += [f"      {x}" for x in b.lines]
    return Outcome(runs, figs, masters, same, bars, deterministic, "\n".join(lines), len(head))


@restores_torch_settings
def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    _deterministic(device)
    cfg = M.Config(steps=args.steps, layers=args.layers, width=args.width, heads=args.heads, context=args.context,
                   batch=args.batch, lr=args.lr, warmup=args.warmup, window=args.window, seed=args.seed)
    if cfg.steps < 2 * cfg.window:
        raise SystemExit(f"--steps {cfg.steps}: needs at least two windows of --window {cfg.window} steps")
    if cfg.width % cfg.heads:
        raise SystemExit(f"--width {cfg.width} is not a multiple of --heads {cfg.heads}")
    if args.modes:
        from . import modes
        which = "" if args.optimizer == "adamw" else args.optimizer + "-"
        return modes.main(args, device, args.name or f"align-modes-{which}" + envmod.device_stem(device), args.out)
    fp16_compute = T.fp16_compute_dtype(device, args.fp16_compute)
    out = execute(cfg, device, fp16_compute, log=lambda s: print(s, flush=True))
    print("\n".join(out.text.split("\n")[out.head_lines:]))
    stem = args.name or "align-" + envmod.device_stem(device)
    base = os.path.join(args.out, stem)
    written = [R.write_csv(base + ".csv", out.runs, cfg)]
    with open(base + ".txt", "w") as f:
        f.write(out.text + "\n")
    written.append(base + ".txt")
    if not args.no_plot:
        title = out.text.split("\n")[1] + "\n" + out.text.split("\n")[5]
        written.append(R.plot(base + ".png", out.runs, out.figs, cfg, title))
    print("\n" + "\n".join(f"wrote {p}" for p in written))
    failed = [b for b in out.bars if not b.passed]
    if args.strict and (failed or not out.deterministic):
        print(f"--strict: {len(failed)} bar(s) failed" + ("" if out.deterministic else
                                                         "; the torch recipe run twice is not bitwise identical"),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
