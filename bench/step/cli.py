"""``python -m bench``: options, then run, then CSV + table + plot (+ comparison with a saved run)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

import torch

from ..common import env as envmod
from ..common import measure
from ..common.env import RESULTS
from ..common.settings import restores_torch_settings
from . import report, workloads
from .ampfused_variant import ampfused_backends, ampfused_variants
from .check import MAX_ELEMENTS, CorrectnessError
from .runner import Options, run
from .variants import select, torch_variants

DESCRIPTION = ("ampfused's fused optimizer step against torch's mixed-precision recipes. Every variant is "
               "checked against ampfused.ops.reference before it is timed; results go to <out>/<device>.csv, "
               ".txt and .png.")
PER_DEVICE = {  # warmup, reps, seconds per measurement, copy buffer MB, compile budget s (whole run)
    # the 2-3 check steps before timing warm a variant up too (first touch, compilation)
    "cpu": dict(warmup=1, reps=20, max_seconds=6.0, copy_mb=512, compile_budget=180.0),
    "cuda": dict(warmup=10, reps=100, max_seconds=10.0, copy_mb=2048, compile_budget=1800.0),
}


def _epilog() -> str:
    lines = ["defaults per device:"]
    for kind, d in PER_DEVICE.items():
        base, full = workloads.DEFAULTS[kind], workloads.FULL[kind]
        onoff = lambda c: "/".join("on" if x else "off" for x in c)  # noqa: E731
        lines.append(f"  {kind}: {','.join(base['workloads'])} | {','.join(base['grad_dtypes'])} | clip "
                     f"{onoff(base['clip'])} | warmup {d['warmup']}, reps {d['reps']}, {d['max_seconds']:g} s "
                     "per measurement")
        lines.append(f"  {' ' * len(kind)}  --full: {','.join(full['workloads'])} | {','.join(full['grad_dtypes'])} "
                     f"| clip {onoff(full['clip'])}")
    from ..distributed.run import DEFAULTS as DIST
    lines += ["  --distributed: ampfused-zero1 against torch-ddp on --world processes (gloo on CPU; NCCL, a GPU per "
              "rank)", "   " + " | ".join(f"{k}: warmup {d['warmup']}, reps {d['reps']}, {d['max_seconds']:g} s"
                                          for k, d in DIST.items()),
              "examples:",
              "  python -m bench                       # the default run for this machine",
              "  python -m bench --full                # the whole sweep",
              "  python -m bench --distributed         # ZeRO-1 against DDP + torch's AdamW, step time and memory",
              "  python -m bench.distributed           # the same",
              "  python -m bench --workloads 16Mx32 --variants torch-fused,ampfused-cpu --compare OLD.csv",
              "  python -m bench.step.plot bench/results/<device>.csv",
              "  python -m bench.step.compare OLD.csv NEW.csv"]
    return "\n".join(lines)


def _csv_list(s: str) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available, else cpu)")
    p.add_argument("--workloads", type=_csv_list, default=None,
                   help="comma list: gpt2-small, gpt2-medium, gpt-1.3b, <model>/<k> (width/k), or "
                        "<N>[k|M|B]x<tensors> (e.g. 16Mx32)")
    p.add_argument("--full", action="store_true",
                   help="the full sweep: all workloads of the device, fp32/bf16/fp16, with and without clipping")
    p.add_argument("--dtypes", type=_csv_list, default=None, help="gradient dtypes: fp32,bf16,fp16")
    p.add_argument("--clip", choices=["on", "off", "both"], default=None, help="gradient clipping")
    p.add_argument("--no-scaler", action="store_true",
                   help="no loss scaler in any variant (common with bf16); default: the full GradScaler recipe")
    p.add_argument("--variants", type=_csv_list, default=None,
                   help="comma list (all by default: torch-foreach, torch-fused, torch-compile, ampfused-<backend> for "
                        "every backend available on the device)")
    p.add_argument("--modes", action="store_true",
                   help="add ampfused's compact state modes on every fast backend of the device: +rem (remainders), "
                        "+bf16m "
                        "(bf16 moments), +rem+bf16m, +sr (no master, stochastic rounding), +sr+bf16m "
                        "(bench/step/modes.py; naming one in --variants adds it too)")
    p.add_argument("--peers", action="store_true",
                   help="add other libraries' low-precision AdamW where installed (pip install '.[peers]'): "
                        "torchao-adamw-sr, torchao-adamw8bit, torchao-adamw4bit, torchao-adamwfp8, optimi-adamw, "
                        "optimi-adamw-kahan, flashoptim-adamw (bench/step/peers.py), each run as bf16 recipes run, "
                        "without a loss scaler, and timed with its deviation from the reference (dev); absent ones "
                        "are reported with the reason")
    p.add_argument("--ampfused-api", choices=["auto", "optimizer", "functional"], default="auto",
                   help="drive ampfused through FusedAdamW (auto: when importable) or the functional ops")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before timing")
    p.add_argument("--reps", type=int, default=None, help="timed steps per measurement")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop timing a measurement after this long (at least 5 steps)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measure the variants in turn this many times; each row pools its rounds' steps (on a "
                        "shared machine whose speed drifts, every row then spans the run; default 1)")
    p.add_argument("--compile-budget", type=float, default=None,
                   help="seconds torch.compile may take over the whole run, after which torch-compile is "
                        "reported unavailable (default: cpu 180, cuda 1800)")
    p.add_argument("--check-elements", type=int, default=MAX_ELEMENTS,
                   help=f"check every element up to this many parameters, a per-tensor sample above "
                        f"(default {MAX_ELEMENTS})")
    p.add_argument("--copy-mb", type=int, default=None, help="buffer size for the copy-bandwidth measurement (default: cpu 512, cuda 2048)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--out", default=RESULTS, help=f"output directory (default: {RESULTS}; pass bench/results to "
                                                   "commit a run with the project)")
    p.add_argument("--name", default=None,
                   help="file stem (default: the device, e.g. cpu-Intel-Xeon-2.50GHz, + -noscaler with --no-scaler)")
    p.add_argument("--compare", metavar="FILE", default=None, help="print the change against a saved CSV")
    p.add_argument("--keep-going", action="store_true",
                   help="after a correctness failure, measure the rest (still exits non-zero)")
    p.add_argument("--no-plot", action="store_true")
    d = p.add_argument_group("distributed workload (bench/distributed/, also python -m bench.distributed)")
    d.add_argument("--distributed", action="store_true",
                   help="instead of the single-process sweep: ampfused.ShardedFusedAdamW (ZeRO-1) against DDP + "
                        "clip_grad_norm_ + AdamW(fused=True) on fp32 masters, on --world processes; writes "
                        "<out>/dist-<device>.csv and .md (--warmup, --reps, --max-seconds, --threads per rank, "
                        "--out, --name apply)")
    d.add_argument("--world", type=int, default=2, help="processes (ranks), a power of two (default 2)")
    d.add_argument("--dist-width", type=int, default=384,
                   help="model width d: blocks of LayerNorm(d), Linear(d, 4d), GELU, Linear(4d, d) (default 384)")
    d.add_argument("--dist-blocks", type=int, default=4, help="blocks (default 4: 4.7M parameters at d=384)")
    d.add_argument("--dist-batch", type=int, default=16, help="rows per rank and step (default 16)")
    d.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds the whole distributed run may take before its processes are killed (default 600)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--optimizer", choices=["adamw", "lion", "muon"], default="adamw",
                   help="lion: FusedLion in its state modes against torch's Lion recipe and optimi's Lion "
                        "(bench/step/lion.py; --workloads <N>[k|M]x<tensors>, --no-scaler, --warmup, --reps, "
                        "--max-seconds, --threads, --out, --name apply); muon: FusedMuon (Muon + AdamW groups) "
                        "against torch.optim.Muon + AdamW (bench/step/muon.py; --workloads d<width>x<layers>)")
    return p


def _plan(args, device: torch.device):
    kind = "cuda" if device.type == "cuda" else "cpu"
    base = workloads.FULL[kind] if args.full else workloads.DEFAULTS[kind]
    names = args.workloads or base["workloads"]
    dtypes = args.dtypes or base["grad_dtypes"]
    bad = [d for d in dtypes if d not in workloads.DTYPES]
    if bad:
        raise SystemExit(f"unknown dtype(s) {bad}; use {list(workloads.DTYPES)}")
    clips = {"on": [True], "off": [False], "both": [True, False], None: base["clip"]}[args.clip]
    try:
        return workloads.expand(names, dtypes, clips, device, scaler=not args.no_scaler)
    except ValueError as e:
        raise SystemExit(str(e))


def _loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def compile_only(device: torch.device, args, workload_names: List[str]) -> Optional[str]:
    """The one workload torch-compile runs on in the default CUDA run (compiling takes minutes per workload
    there): GPT-2 small when it is in the run, else the first. None (every workload) on other devices, with
    --full, or when torch-compile is asked for by name."""
    if device.type != "cuda" or args.full or (args.variants and "torch-compile" in args.variants) \
            or not workload_names:
        return None
    return "gpt2-small" if "gpt2-small" in workload_names else workload_names[0]


def extra_variants(device: torch.device, args) -> list:
    """The state modes (--modes) and the peers (--peers), and any of them named in --variants."""
    from .modes import mode_variants
    from .peers import peer_variants
    names = args.variants or []
    modes = mode_variants(device, [b for b in ampfused_backends(device) if b != "reference"] +
                          (["reference"] if any(n.startswith("ampfused-reference+") for n in names) else []), names)
    peers = peer_variants()
    out = [v for v in modes if args.modes or v.name in names]
    return out + [v for v in peers if args.peers or v.name in names]


_SWEEP_ONLY = ("workloads", "modes", "peers", "full", "dtypes", "clip", "no_scaler", "variants", "compare", "copy_mb",
               "compile_budget", "rounds")


@restores_torch_settings
def main(argv: Optional[List[str]] = None, prog: str = "python -m bench") -> int:
    args = parser(prog).parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.optimizer == "lion":
        from . import lion
        return lion.main(args, device)
    if args.optimizer == "muon":
        from . import muon
        return muon.main(args, device)
    if args.distributed:
        given = [f"--{k.replace('_', '-')}" for k in _SWEEP_ONLY if getattr(args, k) not in (None, False)]
        if given:
            raise SystemExit(f"{', '.join(given)}: options of the single-process sweep, not of --distributed")
        from ..distributed import run as distributed
        return distributed.main(args, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    d = PER_DEVICE["cuda" if device.type == "cuda" else "cpu"]
    nbytes = (args.copy_mb or d["copy_mb"]) * 2 ** 20
    opts = Options(warmup=args.warmup if args.warmup is not None else d["warmup"],
                   reps=args.reps or d["reps"], max_seconds=args.max_seconds or d["max_seconds"],
                   check_elements=args.check_elements, keep_going=args.keep_going,
                   yardstick=measure.Yardstick(device, nbytes), rounds=max(1, args.rounds or 1))
    instances = _plan(args, device)
    # --modes and --peers add their variants to those --variants names (or to all of them)
    extras = extra_variants(device, args)
    named = set(args.variants or [])
    variants = select(torch_variants(args.compile_budget or d["compile_budget"],
                                     compile_only(device, args, [i.workload.name for i in instances]))
                      + ampfused_variants(device, args.ampfused_api, args.variants)
                      + [v for v in extras if v.name in named], args.variants) \
        + [v for v in extras if v.name not in named]
    env = envmod.describe(device)
    # rows carry no scaler column: a run without one gets its own file rather than overwrite the default's
    stem = args.name or envmod.device_stem(device) + ("-noscaler" if args.no_scaler else "")
    csv_path = os.path.join(args.out, stem + ".csv")
    saved = report.read_csv(args.compare) if args.compare else None  # before this run may overwrite it
    t0 = time.perf_counter()
    load0 = _loadavg()

    copy0, rmw0 = measure.copy_bandwidth(device, nbytes), measure.rmw_bandwidth(device, nbytes)
    print(f"{env['device']}: copy_ {copy0:.1f} GB/s, read-modify-write {rmw0:.1f} GB/s; "
          f"{len(instances)} configurations x "
          f"{len(variants)} variants ({', '.join(v.name for v in variants)})", flush=True)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(instances) * len(variants) * opts.rounds, unit="run", dynamic_ncols=True,
                   file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    written = [0]

    def done(rows):  # each configuration's rows as it ends: a run stopped part-way keeps them
        for r in rows[written[0]:]:
            print(f"  {r['workload']} {r['variant']}: {r['median_ms']} ms ({r['pct_of_copy_bw']}% of copy)",
                  flush=True)
        written[0] = len(rows)
        report.write_csv(rows, csv_path)

    try:
        outcome = run(instances, variants, env, opts, progress=bar, done=done)
    except CorrectnessError as e:
        if bar is not None:
            bar.close()
        kept = (f"the configurations measured before it are in {csv_path}" if written[0] else "nothing was written")
        print(f"\nbenchmark stopped: {e}\n{kept}; a wrong variant is never timed.", file=sys.stderr)
        return 1
    if bar is not None:
        bar.close()

    elapsed = time.perf_counter() - t0
    i0 = instances[0]
    recipe = (f"step: AdamW lr={i0.lr:g} betas={i0.betas} eps={i0.eps:g} weight_decay={i0.weight_decay:g}, "
              f"clip max_norm={i0.max_norm:g} where clip=true, "
              + (f"loss scaler (init scale {i0.init_scale:g}) in every variant but the peers" if i0.scaler
                 else "no loss scaler")
              + "; bf16/fp16 models keep fp32 master weights; the peers (--peers) train the bf16 weights as bf16 "
                "recipes do: no master, no loss scaler")
    notes = [recipe, f"bandwidth at the start of the run: copy_ {copy0:.1f} GB/s, read-modify-write {rmw0:.1f} "
                     "GB/s; each row is compared with samples taken right before and after its timed steps"]
    if opts.rounds > 1:
        notes.append(f"{opts.rounds} rounds: the variants measured in turn {opts.rounds} times, each row's median and "
                     "percentiles over the steps of all its rounds")
    notes += outcome.notes + [
        f"run took {elapsed:.0f} s; 1-minute load average before it {load0} on {os.cpu_count()} CPUs (other "
        "processes make timings noisy; the run itself then adds about one per busy thread)"]
    text = report.summary(outcome.rows, env["device"], notes)
    print("\n" + text)
    if outcome.rows:
        report.write_csv(outcome.rows, csv_path)
        txt_path = os.path.join(args.out, stem + ".txt")
        with open(txt_path, "w") as f:
            f.write(text + "\n")
        print(f"\nwrote {csv_path}\nwrote {txt_path}")
        if not args.no_plot:
            from .plot import plot_csv
            png = plot_csv(csv_path, os.path.join(args.out, stem + ".png"))
            print(f"wrote {png}")
    if saved is not None:
        from .compare import compare_text
        print("\n" + compare_text(saved, outcome.rows, args.compare))
    if outcome.failures:
        print("\nFAILED correctness checks (those variants were not timed):\n" + "\n".join(outcome.failures),
              file=sys.stderr)
        return 1
    return 0
