"""The workloads ``python -m bench.gpu`` runs, one subcommand each: ``python -m bench.gpu.probe NAME``.

* ``env``: versions, the device, its free memory (what the driver's summary header shows).
* ``sanitize``: every op of ``ampfused.ops`` on each backend over small tensors of awkward sizes and layouts
  (one element, odd sizes, ``channels_last``, a transpose, a view one element into its storage, a parameter
  without a gradient), the CUDA backend's single-launch step, and a few steps of each fused optimizer with
  ``ampfused.GradScaler``: short enough to run under ``compute-sanitizer``. Results are compared with the
  reference backend run on CPU copies, so the sanitizer sees ampfused's kernels and a few copies.
* ``sync-debug``: ``scaler.step(opt); scaler.update()`` of each fused optimizer (AdamW, Adam, SGD, Lion,
  Adafactor) under ``torch.cuda.set_sync_debug_mode("error")``, for a model built on the CPU and moved to the
  device after its optimizer was built, gradients set to None between steps, checked against a twin on the
  reference backend.
* ``graph``: a warmed-up ``opt.step()`` (and ``scaler.step(opt); scaler.update()``) captured in a CUDA graph
  and replayed with fresh gradient values copied into the fixed gradient tensors (one replay overflows),
  compared bit for bit with an eager twin that gets fresh gradient tensors each step.
* ``counts``: kernels per fused step (``torch.profiler``), host time per eager step and the replay time of
  the captured step, with and without the scaler, at 1M parameters in 200 and in 2000 tensors. Reported,
  not asserted.
* ``big``: a gradient of more than 2**31 elements: the norm, the update of elements past 2**31, and a NaN in
  the last element skipping the step, through the ops and through FusedSGD, on each backend.
* ``bench``: ``python -m bench`` over reduced workloads, torch-compile left out.

Every subcommand takes ``--device`` (``cuda`` when available, else ``cpu``): on the CPU the same workload
runs on the CPU backend (and the Triton interpreter when ``TRITON_INTERPRET=1``), without what only CUDA has
(the sync-debug mode, graph capture, kernel launches). ``--json FILE`` writes the checks and measurements.
Exit status: 0 every check passed, 1 a check failed, 3 the whole probe could not run here (the reason is
printed and written), 2 a usage error.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

from .probe_common import (SKIP_EXIT, Report, _torch, assert_bitwise, assert_close, pick_device, placed,  # noqa: F401
                           sync, usable_backends)
from .probe_big import BIG_NUMEL, big_bytes, big_indices, probe_big  # noqa: F401
from .probe_sanitize import _awkward_params, OPTIMIZERS, probe_sanitize, TWIN_TOL


# ------------------------------------------------------------------------------------------------------ env

def probe_env(args) -> int:
    torch = _torch()
    rep = Report("env", "host")
    info: Dict[str, object] = dict(python=platform.python_version(), executable=sys.executable,
                                   torch=torch.__version__, torch_cuda=torch.version.cuda, cpus=os.cpu_count())
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = f"unavailable ({type(e).__name__}: {e})"
    with rep.check("torch imports and reports its devices"):
        info["cuda_available"] = bool(torch.cuda.is_available())
        if info["cuda_available"]:
            i = torch.cuda.current_device()
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            info.update(device=p.name, capability=f"{p.major}{p.minor}", sms=p.multi_processor_count,
                        memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                        device_count=torch.cuda.device_count())
        else:
            info["device"] = "cpu"
    try:
        import ampfused
        info["ampfused"] = ampfused.__version__
    except Exception as e:  # noqa: BLE001 - not installed yet: the build stage installs it
        info["ampfused"] = f"not importable ({type(e).__name__}: {e})"
    rep.metrics.update(info)
    for k, v in info.items():
        print(f"{k}: {v}")
    return rep.finish(args.json)


# ----------------------------------------------------------------------------------------------- sync-debug

def _net():
    torch = _torch()
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(48, 129), nn.GELU(), nn.Linear(129, 33), nn.LayerNorm(33))
            self.head = nn.Linear(33, 1)
            self.unused = nn.Parameter(torch.randn(17))  # never reaches the loss: its gradient stays None

        def forward(self, x):
            return self.head(self.body(x))

    return Net()


def _count_syncs(caught) -> int:
    from ..common.measure import SYNC_WARNING
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def _sync_debug_one(rep: Report, device, backend: str, cls_name: str, kw: dict, steps: int) -> None:
    torch = _torch()
    import ampfused
    cls = getattr(ampfused, cls_name)
    torch.manual_seed(0)
    model = _net().to(torch.bfloat16)             # built on the CPU
    twin_model = copy.deepcopy(model)
    opt = cls(model.parameters(), **kw, backend=backend)  # the optimizer first, then the move
    model.to(device)
    twin_model.to(device)
    twin = cls(twin_model.parameters(), **kw, backend="reference")
    scaler = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    twin_scaler = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=torch.bfloat16)
    cuda = device.type == "cuda"
    first_step_syncs = None
    for k in range(steps):
        loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        twin_scaler.scale(torch.ones((), device=device))
        if k == 2:  # an overflow: the step is skipped and the scale backs off
            model.head.weight.grad.view(-1)[0] = float("inf")
        for p, q in zip(model.parameters(), twin_model.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        if cuda:
            # the first step after the move carries the optimizer to the device: its host syncs are counted and
            # reported; every later step must not sync at all
            mode = "warn" if k == 0 else "error"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode(mode)
                try:
                    scaler.step(opt)
                    scaler.update()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if k == 0:
                first_step_syncs = _count_syncs(caught)
        else:
            scaler.step(opt)
            scaler.update()
        twin_scaler.step(twin)
        twin_scaler.update()
        opt.zero_grad()   # set to None, as torch.optim's default
        twin.zero_grad()
        if bool(opt.last_step_skipped) != (k == 2) or bool(twin.last_step_skipped) != (k == 2):
            raise AssertionError(f"step {k}: skipped {bool(opt.last_step_skipped)}, reference "
                                 f"{bool(twin.last_step_skipped)}, expected {k == 2}")
        assert_close(f"step {k}: last_grad_norm", opt.last_grad_norm, twin.last_grad_norm, 1e-5, 0)
    params, twin_params = list(model.parameters()), list(twin_model.parameters())
    if not all(p.device.type == device.type for p in params):
        raise AssertionError("the model is not on the device")
    for i, (p, q) in enumerate(zip(params, twin_params)):
        if p.grad is not None:
            raise AssertionError(f"param[{i}].grad is not None after zero_grad()")
        if p is model.unused:
            continue
        st = opt.state[p]
        if "master_param" not in st or st["master_param"].device.type != device.type:
            raise AssertionError(f"param[{i}]: no fp32 master on {device.type} after the move")
        assert_close(f"param[{i}] master", st["master_param"], twin.state[q]["master_param"], *TWIN_TOL)
        assert_bitwise(f"param[{i}] is its master rounded", p, st["master_param"].to(p.dtype))
    if model.unused in opt.state and opt.state[model.unused]:
        raise AssertionError("the parameter that never had a gradient has optimizer state")
    if scaler.get_scale() != twin_scaler.get_scale():
        raise AssertionError(f"scale {scaler.get_scale()} vs reference {twin_scaler.get_scale()}")
    if cuda:
        rep.metrics.setdefault("first_step_after_move_syncs", {})[f"{cls_name}/{backend}"] = first_step_syncs


def probe_sync_debug(args) -> int:
    device = pick_device(args.device)
    rep = Report("sync-debug", str(device))
    if device.type != "cuda":
        rep.note("torch.cuda.set_sync_debug_mode is CUDA-only: on the CPU the same loop runs without it")
    for b in usable_backends(rep, device, args.backends):
        for cls_name, kw in OPTIMIZERS:
            with rep.check(f"{b} {cls_name}: CPU model moved after the optimizer was built, gradients None "
                           f"between steps, scaler.step + update" + (" under sync debug 'error'"
                                                                     if device.type == "cuda" else "")):
                _sync_debug_one(rep, device, b, cls_name, kw, args.steps)
    counts = rep.metrics.get("first_step_after_move_syncs")
    if counts:
        rep.note("host syncs in the first step after the move (it carries the optimizer to the device; not "
                 "checked): " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return rep.finish(args.json)


# ---------------------------------------------------------------------------------------------------- graph

GRAPH_SPECS = [((1,), "plain", True, 0), ((127,), "plain", True, 0), ((65537,), "plain", True, 0),
               ((2, 3, 5, 7), "channels_last", True, 0), ((45, 67), "transposed", True, 0),
               ((12289,), "offset", True, 0)]


def _opt_snapshot(opt, params) -> List[Tuple[str, object]]:
    out = [(f"param[{i}]", p.detach()) for i, p in enumerate(params)]
    for i, p in enumerate(params):
        for k, v in sorted(opt.state[p].items()):
            out.append((f"state[{i}][{k}]", v))
    out += [("last_grad_norm", opt.last_grad_norm), ("last_found_inf", opt.last_found_inf)]
    return out


def _graph_one(rep: Report, device, backend: str, cls_name: str, kw: dict, with_scaler: bool,
               replays: int = 4) -> None:
    torch = _torch()
    import ampfused
    cls = getattr(ampfused, cls_name)
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(3)
    graphed = _awkward_params(device, torch.bfloat16, gen, GRAPH_SPECS)
    eager = [torch.nn.Parameter(placed(ampfused.ops.memory_view(p.detach()), p.shape, s[1], p.dtype, device))
             for p, s in zip(graphed, GRAPH_SPECS)]
    o_g, o_e = cls(graphed, **kw, backend=backend), cls(eager, **kw, backend=backend)
    for p in graphed:  # the gradients live in fixed tensors that the graph reads
        p.grad = torch.zeros_like(p)
    for q in eager:
        q.grad = torch.zeros_like(q)
    s_g = s_e = None
    if with_scaler:
        s_g = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
        s_e = ampfused.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
        s_g.scale(torch.ones((), device=device))
        s_e.scale(torch.ones((), device=device))

    def step(opt, scaler):
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()

    graph = None
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up away from the default stream: kernels, tables, workspaces
            for _ in range(2):
                step(o_g, s_g)
                step(o_e, s_e)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(o_g, s_g)
    else:
        for _ in range(2):
            step(o_g, s_g)
            step(o_e, s_e)
    for k in range(replays):
        new = [placed(torch.randn(math.prod(s[0]), generator=gen) * 64.0, s[0], s[1], torch.bfloat16, device)
               for s in GRAPH_SPECS]
        if k == 2:  # an overflowing replay: skipped (and the scale backs off)
            ampfused.ops.memory_view(new[2])[5] = float("nan")
        for p, g in zip(graphed, new):
            p.grad.copy_(g)
        if graph is not None:
            graph.replay()
        else:
            step(o_g, s_g)
        for q, g in zip(eager, new):
            q.grad = torch.empty_like(q).copy_(g)  # fresh tensors, as backward allocates after zero_grad()
        step(o_e, s_e)
        sync(device)
        for (name, a), (_, b) in zip(_opt_snapshot(o_g, graphed), _opt_snapshot(o_e, eager)):
            assert_bitwise(f"replay {k}: {name}", a, b)
        if bool(o_g.last_step_skipped) != (k == 2):
            raise AssertionError(f"replay {k}: last_step_skipped is {bool(o_g.last_step_skipped)}")
        if with_scaler:
            assert_bitwise(f"replay {k}: scale", s_g._scale, s_e._scale)
            assert_bitwise(f"replay {k}: growth tracker", s_g._growth_tracker, s_e._growth_tracker)
    del graph


def probe_graph(args) -> int:
    device = pick_device(args.device)
    rep = Report("graph", str(device))
    if device.type != "cuda":
        rep.note("CUDA graphs are CUDA-only: on the CPU the fixed-gradient optimizer steps eagerly instead of "
                 "replaying")
    for b in usable_backends(rep, device, args.backends):
        for cls_name, kw in OPTIMIZERS:
            for with_scaler in (False, True):
                what = "scaler.step(opt) + scaler.update()" if with_scaler else "opt.step()"
                how = ("captured and replayed 4 times" if device.type == "cuda" else
                       "run 4 times on fixed gradient tensors")
                with rep.check(f"{b} {cls_name}: {what} {how} (one overflows) equals an eager twin"):
                    _graph_one(rep, device, b, cls_name, kw, with_scaler)
    return rep.finish(args.json)


# --------------------------------------------------------------------------------------------------- counts

def _median_host_ms(fn: Callable[[], None], reps: int, before: Optional[Callable[[], None]] = None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _counts_one(rep: Report, device, backend: str, tensors: int, numel: int, reps: int) -> List[dict]:
    torch = _torch()
    import ampfused
    from ..common import measure
    from ..step import workloads
    shapes = workloads.uniform(numel, tensors).shapes
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.02).to(torch.bfloat16))
              for s in shapes]
    grads = [(torch.randn(s, device=device, generator=gen) * 1e-3).to(torch.bfloat16) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g
    opt = ampfused.FusedAdamW(params, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler(device.type, init_scale=1.0, growth_interval=10**6)
    scaler.scale(torch.ones((), device=device))

    def plain():
        opt.step()

    def scaled():
        scaler.step(opt)
        scaler.update()

    rows = []
    cuda = device.type == "cuda"
    for path, fn in (("opt.step()", plain), ("scaler.step + update", scaled)):
        for _ in range(3):
            fn()
        sync(device)
        prof = measure.profile_step(fn, lambda: None, device)
        host = _median_host_ms(fn, reps)
        sync(device)
        gpu = measure.time_steps(fn, lambda: None, device, warmup=2, reps=reps).median

        def fresh():  # gradients set to None and handed over as new tensors, as backward does
            for p, g in zip(params, grads):
                p.grad = torch.empty_like(g).copy_(g)

        host_fresh = _median_host_ms(fn, max(5, reps // 5), before=fresh)
        for p, g in zip(params, grads):
            p.grad = g
        fn()
        sync(device)
        row = dict(tensors=tensors, numel=numel, backend=backend, path=path, kernels=prof.launches,
                   host_syncs=prof.host_syncs, host_ms=round(host, 4), host_ms_fresh_grads=round(host_fresh, 4),
                   device_ms=round(gpu, 4), replay_host_ms=None, replay_device_ms=None)
        if cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            sync(device)
            row["replay_host_ms"] = round(_median_host_ms(graph.replay, reps), 4)
            sync(device)
            row["replay_device_ms"] = round(measure.time_steps(graph.replay, lambda: None, device, warmup=2,
                                                               reps=reps).median, 4)
            del graph
        rows.append(row)
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def counts_table(rows: List[dict]) -> List[str]:
    """Markdown table of the counts probe's rows (the driver's summary shows it)."""
    def ms(x):
        return "n/a" if x is None else f"{x:.3f}"

    out = ["| tensors | backend | step | kernels | host ms (eager) | host ms (fresh grads) | device ms (eager) "
           "| host ms (replay) | device ms (replay) |", "|" + " --- |" * 9]
    for r in rows:
        out.append(f"| {r['tensors']} | {r['backend']} | {r['path']} | "
                   f"{'n/a' if r['kernels'] is None else r['kernels']} | {ms(r['host_ms'])} | "
                   f"{ms(r['host_ms_fresh_grads'])} | {ms(r['device_ms'])} | {ms(r['replay_host_ms'])} | "
                   f"{ms(r['replay_device_ms'])} |")
    return out


def probe_counts(args) -> int:
    device = pick_device(args.device)
    rep = Report("counts", str(device))
    if device.type != "cuda":
        rep.note("on the CPU 'kernels' counts the outermost operators of a step and there is no graph replay")
    rows: List[dict] = []
    rep.metrics["rows"] = rows
    for b in usable_backends(rep, device, args.backends):
        for tensors in args.tensors:
            with rep.check(f"{b}: {args.numel} parameters in {tensors} tensors measured"):
                rows += _counts_one(rep, device, b, tensors, args.numel, args.reps)
    if rows:
        print("\n".join(counts_table(rows)))
    return rep.finish(args.json)


# ---------------------------------------------------------------------------------------------------- bench

def probe_bench(args, extra: List[str]) -> int:
    """``python -m bench`` with the given workloads, torch's fused recipe (and foreach with --torch-foreach),
    and every ampfused variant available on the device; torch-compile left out."""
    from ..step import cli
    from ..step.ampfused_variant import ampfused_variants
    device = pick_device(args.device)
    names = (["torch-foreach"] if args.torch_foreach else []) + ["torch-fused"]
    names += [v.name for v in ampfused_variants(device)]
    argv = ["--device", str(device), "--workloads", args.workloads, "--variants", ",".join(names),
            "--out", args.out, "--name", args.name, "--no-progress"] + extra
    print("python -m bench " + " ".join(argv), flush=True)
    return cli.main(argv)


# ------------------------------------------------------------------------------------------------------ cli

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.probe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)

    def add(name, help_):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        s.add_argument("--json", default=None, help="write the checks and measurements to this file")
        return s

    add("env", "versions, the device and its free memory")
    for name, help_ in (("sanitize", "every op and a few fused steps on awkward sizes (for compute-sanitizer)"),
                        ("sync-debug", "scaler.step + update under the sync-debug mode, model moved after build"),
                        ("graph", "fused steps captured in a CUDA graph against an eager twin"),
                        ("counts", "kernels per step, host time per step, graph replay time"),
                        ("big", "a gradient of more than 2**31 elements")):
        s = add(name, help_)
        s.add_argument("--backends", type=lambda v: [x for x in v.split(",") if x], default=None,
                       help="comma list (default: cuda,triton on a GPU; cpu on the CPU)")
        if name == "sync-debug":
            s.add_argument("--steps", type=int, default=5)
        if name == "counts":
            s.add_argument("--tensors", type=lambda v: [int(x) for x in v.split(",")], default=[200, 2000])
            s.add_argument("--numel", type=int, default=1_000_000)
            s.add_argument("--reps", type=int, default=50)
        if name == "big":
            s.add_argument("--numel", type=int, default=None, help=f"elements (default {BIG_NUMEL})")
            s.add_argument("--ops-only", action="store_true", help="only the ops, not FusedSGD (less memory)")
    s = add("bench", "python -m bench over reduced workloads (arguments after -- go to it)")
    s.add_argument("--workloads", default="1Mx200,16Mx32,gpt2-small")
    s.add_argument("--out", required=True)
    s.add_argument("--name", default="bench")
    s.add_argument("--torch-foreach", action="store_true", help="time torch's foreach recipe too")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv)
    if args.probe == "bench":
        return probe_bench(args, extra)
    if extra:
        raise SystemExit(f"unexpected arguments after --: {extra}")
    run = {"env": probe_env, "sanitize": probe_sanitize, "sync-debug": probe_sync_debug, "graph": probe_graph,
           "counts": probe_counts, "big": probe_big}[args.probe]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
