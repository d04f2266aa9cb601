"""The distributed workload: ZeRO-1 (``ampfused.ShardedFusedAdamW``) against DDP + torch's fp32-master recipe.

``python -m bench --distributed`` spawns ``--world`` processes (2 by default) on this machine: NCCL with one GPU
per rank when the device is CUDA and there are enough GPUs, else gloo on the CPU. Every rank builds the same bf16
model (a stack of transformer MLP blocks: LayerNorm, Linear(d, 4d), GELU, Linear(4d, d), residual) twice, from the
same initial weights, and runs two training loops side by side on its own batches:

* ``ampfused-zero1``: the replicated model, no wrapper, and ``ShardedFusedAdamW(max_grad_norm=1.0)``. Its step
  is everything between backward and the next forward: the reduce-scatter of the gradients into this rank's
  shard, the global norm (one all-reduce), clipping and AdamW on the shard's fp32 masters and moments, and the
  all-gather of the updated bf16 parameters.
* ``torch-ddp``: the model wrapped in ``DistributedDataParallel(gradient_as_bucket_view=True)`` and the recipe of
  :class:`bench.step.variants.TorchRecipe` (fp32 master copies, their gradients copied from the model's,
  ``clip_grad_norm_(foreach=True)``, ``AdamW(fused=True)`` where supported (else ``foreach=True``), the masters
  copied back into the bf16 model), preceded by DDP's gradient all-reduce, see :class:`DdpRecipe`.

Only the step is timed (backward, data and the barrier that lines the ranks up run outside), and both steps
include the gradient communication their method needs. The two loops alternate step by step (which runs first
alternates too), so drift of a shared machine reaches both alike. Every rank times every step; a step's time is
the largest over the ranks (the step of a data-parallel job ends when its slowest rank ends), reported as the
median and 20th/80th percentiles.

Correctness before timing: from the same initial weights, both loops take ``CHECK_STEPS`` steps on gradients
handed in (:func:`check_grads`: the model's own backward runs first, then its gradients are overwritten in
place, in DDP's buckets for ``torch-ddp``), so both see the same global gradient bit for bit. ampfused's gathered
masters and moments must then match torch's under the rule of :func:`bench.step.check.compare` (the rule every
single-process variant is held to, with torch's recipe in the reference's place), ampfused's bf16 parameters
must be the rounding of its masters, and every rank's parameters must be bitwise the same as rank 0's, for both
loops, after the check and again after the timed steps. A failure stops the run before anything is timed or
written (exit code 1).

Optimizer memory per rank: ``ShardedFusedAdamW.state_bytes()`` (this rank's fp32 masters, moments and step
counts), against torch's fp32 masters plus the AdamW state tensors (moments and step counts). Neither counts the
model, its gradients or communication buffers: the torch recipe also holds fp32 master gradients (4 B/param),
ZeRO-1 a gradient/parameter buffer per dtype (2 B/param for bf16) and an fp32 gradient shard (4/W B/param).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..common import env as envmod
from ..step.check import CorrectnessError, Expected, Plan, compare
from .loops import (BATCHES, Config, ZeroRunner, batches, build_model, check_grads, model_size,
                         torch_recipe)
from ..common.measure import percentile, synchronize
from ..common.csv_rows import NA, write_rows as write_csv
from ..step.variants import Snapshot
from ..step.workloads import Instance, Workload

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

CHECK_STEPS = 3
MIN_REPS = 5
DEFAULTS = {  # warmup, reps, seconds of timed steps (the slower variant's) after which timing stops
    "cpu": dict(warmup=3, reps=30, max_seconds=30.0),
    "cuda": dict(warmup=10, reps=100, max_seconds=10.0),
}
COLUMNS = ["device", "torch", "triton", "git_sha", "comm", "world", "threads_per_rank", "model", "numel",
           "tensors", "batch_per_rank", "variant", "optimizer", "median_ms", "p20_ms", "p80_ms", "steps_timed",
           "speedup_vs_torch_ddp", "opt_bytes_per_rank", "opt_bytes_per_param", "opt_bytes_all_ranks", "check"]
VARIANTS = ("ampfused-zero1", "torch-ddp")


# --- one rank ------------------------------------------------------------------------------------------------

def instance(cfg: Config, module: nn.Module, device: torch.device) -> Instance:
    """The step's hyperparameters (the single-process bench's defaults), clipping on, no loss scaler (bf16)."""
    shapes = tuple(tuple(p.shape) for p in module.parameters())
    return Instance(Workload(cfg.model_name, shapes), device, torch.bfloat16, clip=True, scaler=False)


def compare_with_torch(inst: Instance, zero: Snapshot, zero_norms: List[Optional[float]], ref: Snapshot,
                       ref_norms: List[float], updates: int) -> List[str]:
    """What differs between ZeRO-1's state and the torch recipe's, under :func:`bench.step.check.compare`'s rule with
    the torch recipe as the expected side (masters and moments within ``RTOL`` plus what the two norms'
    difference explains; ZeRO-1's bf16 parameters exactly the rounding of its masters)."""
    flat = lambda ts: [t.detach().reshape(-1) for t in ts]  # noqa: E731
    exp = Expected(master=flat(ref.master), weights=flat(ref.master), exp_avg=flat(ref.exp_avg),
                   exp_avg_sq=flat(ref.exp_avg_sq), scale=None, norms=ref_norms, updates=updates)
    plan = Plan(grads=[], final_scale=1.0, sample=[None] * len(inst.workload.shapes))
    return compare(zero, zero_norms, exp, inst, plan)


def _flat_bits(params: List[Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def ranks_agree(params: List[Tensor], what: str) -> List[str]:
    """Problems if this rank's parameters are not bitwise rank 0's (a collective)."""
    mine = _flat_bits(params)
    every = torch.empty(dist.get_world_size() * mine.numel(), dtype=mine.dtype, device=mine.device)
    _all_gather(every, mine)
    first = every[:mine.numel()].view(torch.int16)
    differ = int((mine.view(torch.int16) != first).sum())
    if differ:
        return [f"{what}: rank {dist.get_rank()}'s parameters differ from rank 0's in {differ} of {mine.numel()} "
                "elements"]
    return []


def _raise_if_any(problems: List[str], where: str) -> None:
    """Every rank learns every rank's problems, so that all of them stop together."""
    every: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, problems)
    found = [p for ps in every for p in (ps or [])]
    if found:
        raise CorrectnessError(f"{where}:\n  " + "\n  ".join(dict.fromkeys(found)))


def _say(cfg: Config, msg: str) -> None:
    if cfg.progress and dist.get_rank() == 0:
        print(msg, flush=True)


def run_rank(cfg: Config, device: torch.device) -> dict:
    """Everything one rank does; returns what rank 0 reports (times as the max over ranks per step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    notes: List[str] = []
    base = build_model(cfg, device)
    inst = instance(cfg, base, device)
    zero = ZeroRunner(copy.deepcopy(base), inst)
    ref_inst = dataclasses.replace(inst, **cfg.torch_changes) if cfg.torch_changes else inst
    ddp = torch_recipe(ref_inst, copy.deepcopy(base), device, notes)
    del base
    runners = [zero, ddp]
    data = batches(cfg, rank, device)

    _say(cfg, f"checking: {CHECK_STEPS} steps of both loops from the same weights on the same gradients")
    norms: Dict[str, List[Optional[float]]] = {r.name: [] for r in runners}
    for k in range(CHECK_STEPS):
        grads = check_grads(zero.params, rank, k, cfg.seed)
        for r in runners:
            r.backward(*data[k % BATCHES])
            r.set_grads(grads)
            r.step()
        norms["ampfused-zero1"].append(float(zero.opt.last_grad_norm))
        # a recipe that does not clip reports no norm: its norm is not compared, and explains no difference
        norms["torch-ddp"].append(norms["ampfused-zero1"][-1] if ddp.norm is None else float(ddp.norm))
    problems = compare_with_torch(inst, zero.snapshot(), norms["ampfused-zero1"], ddp.snapshot(),
                                  norms["torch-ddp"], CHECK_STEPS)
    problems += ranks_agree(zero.params, "ampfused-zero1 after the check") + ranks_agree(ddp.model,
                                                                                         "torch-ddp after the check")
    _raise_if_any(problems, f"ampfused-zero1 computes something else than the torch recipe on {cfg.model_name}, "
                            f"{world} ranks")
    _say(cfg, "check passed; timing")

    times: Dict[str, List[float]] = {r.name: [] for r in runners}
    it = 0
    while True:
        for r in (runners if it % 2 == 0 else runners[::-1]):
            r.backward(*data[it % BATCHES])
            synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            r.step()
            synchronize(device)
            dt = (time.perf_counter() - t0) * 1e3
            if it >= cfg.warmup:
                times[r.name].append(dt)
        it += 1
        done = it - cfg.warmup
        if done >= cfg.reps:
            break
        if done >= MIN_REPS:  # the decision to stop is the same on every rank: the largest time spent
            spent = torch.tensor([max(sum(t) for t in times.values()) / 1e3], dtype=torch.float64, device=device)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            if spent.item() >= cfg.max_seconds:
                break
    problems = ranks_agree(zero.params, "ampfused-zero1 after the timed steps") + ranks_agree(
        ddp.model, "torch-ddp after the timed steps")
    _raise_if_any(problems, "ranks disagree after the timed steps")

    numel = sum(p.numel() for p in zero.params)
    notes.append(collectives_alone(ddp.bucket_numels, numel, device, min(cfg.reps, 10)))
    out = {"numel": numel, "tensors": len(zero.params), "notes": notes, "rows": {}}
    for r in runners:
        t = torch.tensor(times[r.name], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per step, the slowest rank
        per_rank: List[Optional[int]] = [None] * world
        dist.all_gather_object(per_rank, r.state_bytes())
        out["rows"][r.name] = {"times_ms": t.cpu().tolist(), "bytes_per_rank": per_rank, "optimizer": r.impl}
    return out


def _slowest_median(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median over ``reps`` calls of ``fn`` (lined up by a barrier) of the slowest rank's time, ms (a collective)."""
    ts = []
    for i in range(warmup + reps):
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if i >= warmup:
            ts.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(ts, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.cpu().tolist())


def collectives_alone(bucket_numels: List[int], numel: int, device: torch.device, reps: int) -> str:
    """The step's big collectives on their own, on bf16 buffers of the same sizes: what of each step time is
    communication on this machine and backend (ZeRO-1's shards are padded a little for alignment; not here)."""
    world = dist.get_world_size()
    bf16 = dict(dtype=torch.bfloat16, device=device)
    buckets = [torch.zeros(n, **bf16) for n in bucket_numels]

    def all_reduce():
        works = [dist.all_reduce(b, async_op=True) for b in buckets]
        for w in works:
            w.wait()

    per = -(-numel // world)
    flat, shard = torch.zeros(per * world, **bf16), torch.zeros(per, **bf16)
    ar = _slowest_median(all_reduce, device, reps)
    rs = _slowest_median(lambda: _reduce_scatter(shard, flat), device, reps)
    ag = _slowest_median(lambda: _all_gather(flat, shard), device, reps)
    return (f"the collectives alone, on bf16 buffers of the step's sizes (median of {reps}, slowest rank): DDP's "
            f"all-reduce of its {len(buckets)} bucket(s) {ar:.3g} ms; ZeRO-1's reduce-scatter {rs:.3g} ms + "
            f"all-gather {ag:.3g} ms = {rs + ag:.3g} ms")


def _entry(rank: int, cfg: Config, store: str, result_path: str) -> None:
    torch.set_num_threads(cfg.threads)
    if cfg.comm == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(cfg.comm, init_method=f"file://{store}", rank=rank, world_size=cfg.world,
                            timeout=timedelta(seconds=cfg.timeout_s))
    try:
        try:
            result = run_rank(cfg, device)
        except CorrectnessError as e:
            result = {"error": str(e)}
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "ampfused", "ampfused.distributed", __name__]


def check_world(world: int) -> Optional[str]:
    if world < 2 or world & (world - 1) or world > 64:
        return (f"--world must be a power of two from 2 to 64, got {world}: the check's gradients sum and divide "
                "exactly over such a world only (see check_grads)")
    return None


def launch(cfg: Config) -> dict:
    """Run the workload on ``cfg.world`` fresh processes; rank 0's result. Raises :class:`CorrectnessError` when
    the check failed, ``TimeoutError`` past ``cfg.timeout_s`` (every rank is then killed)."""
    import torch.multiprocessing as mp

    problem = check_world(cfg.world)
    if problem:
        raise ValueError(problem)
    with tempfile.TemporaryDirectory(prefix="ampfused-dist-") as tmp:
        path = os.path.join(tmp, "rank0.json")
        # A fork server imports torch and ampfused once (in a fresh interpreter: nothing of this process, CUDA or
        # threads, is inherited) and forks every rank from there, so a rank starts in milliseconds.
        mp.set_forkserver_preload(_PRELOAD)
        # the ranks meet through a file store in this run's folder: no port to race another run for
        ctx = mp.start_processes(_entry, args=(cfg, os.path.join(tmp, "store"), path), nprocs=cfg.world, join=False,
                                 start_method="forkserver")
        deadline = time.monotonic() + cfg.timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the distributed workload did not finish within {cfg.timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        with open(path) as f:
            result = json.load(f)
    if result.get("error"):
        raise CorrectnessError(result["error"])
    return result


# --- report --------------------------------------------------------------------------------------------------

def rows(result: dict, cfg: Config, env: dict) -> List[dict]:
    out = []
    for name in VARIANTS:
        r = result["rows"][name]
        ts = r["times_ms"]
        per_rank = r["bytes_per_rank"]
        out.append(dict(env, comm=cfg.comm, world=cfg.world, threads_per_rank=cfg.threads if cfg.comm == "gloo" else NA,
                        model=cfg.model_name, numel=result["numel"], tensors=result["tensors"],
                        batch_per_rank=cfg.batch, variant=name, optimizer=r["optimizer"],
                        median_ms=f"{statistics.median(ts):.4f}", p20_ms=f"{percentile(ts, 20):.4f}",
                        p80_ms=f"{percentile(ts, 80):.4f}", steps_timed=len(ts), opt_bytes_per_rank=max(per_rank),
                        opt_bytes_per_param=f"{max(per_rank) / result['numel']:.4g}",
                        opt_bytes_all_ranks=sum(per_rank), check="passed"))
    base = float(next(r for r in out if r["variant"] == "torch-ddp")["median_ms"])
    for r in out:
        r["speedup_vs_torch_ddp"] = f"{base / float(r['median_ms']):.4g}"
    return out


def table(rows_: List[dict]) -> str:
    """A markdown table, one row per variant."""
    head = ["variant", "median ms", "p20-p80 ms", "x torch-ddp", "optimizer bytes per rank", "bytes/param",
            "optimizer"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows_:
        lines.append("| " + " | ".join([
            r["variant"], f"{float(r['median_ms']):.3f}", f"{float(r['p20_ms']):.3f}-{float(r['p80_ms']):.3f}",
            r["speedup_vs_torch_ddp"], f"{int(r['opt_bytes_per_rank']):,}", r["opt_bytes_per_param"],
            r["optimizer"]]) + " |")
    return "\n".join(lines)


def summary(rows_: List[dict], cfg: Config, notes: List[str]) -> str:
    r0 = rows_[0]
    head = (f"device: {r0['device']}; {cfg.world} ranks over {cfg.comm}; model {cfg.model_name} (bf16, "
            f"{int(r0['numel']):,} parameters in {r0['tensors']} tensors), {cfg.batch} rows per rank and step; "
            f"torch {r0['torch']}, commit {r0['git_sha']}")
    out = [head, "", table(rows_), "", "notes:"] + [f"- {n}" for n in notes]
    return "\n".join(out)


def explain(cfg: Config) -> List[str]:
    h = {f.name: f.default for f in dataclasses.fields(Instance)}  # what instance() leaves at the defaults
    return [
        f"checked before timing: {CHECK_STEPS} steps of both from the same weights on the same gradients; ZeRO-1's "
        "masters and moments within bench/step/check.py's tolerance of torch's, its bf16 parameters the rounding of its "
        "masters, every rank's parameters bitwise rank 0's (also after the timed steps)",
        f"step: AdamW lr={h['lr']:g} betas={h['betas']} eps={h['eps']:g} weight_decay={h['weight_decay']:g}, "
        f"clipping to max_norm={h['max_norm']:g} with the global norm, no loss scaler, fp32 masters of the bf16 model",
        "time: the step only (backward and a barrier before it are not timed), the two loops alternating step by "
        f"step after {cfg.warmup} warm-up steps; each step's time is the slowest rank's; median and 20th/80th "
        "percentiles",
        "ampfused-zero1's step: reduce-scatter of the bf16 gradients, one all-reduce for the global norm, clip + "
        "AdamW on this rank's shard, all-gather of the bf16 parameters; torch-ddp's: DDP's bucketed all-reduce "
        "(moved out of backward by a communication hook), fp32 master gradients, clip_grad_norm_, AdamW, copy back",
        "optimizer bytes per rank: ampfused ShardedFusedAdamW.state_bytes() (the largest over ranks), torch its fp32 "
        "masters + AdamW's exp_avg, exp_avg_sq and step tensors; bytes/param divides by the model's parameters. "
        "Not counted on either side: the model, its gradients, torch's fp32 master gradients (4 B/param), ZeRO-1's "
        "communication buffers (2 B/param for bf16, plus an fp32 gradient shard of 4/world B/param)",
    ]


def main(args, device: torch.device) -> int:
    """``python -m bench --distributed``: run, check, print and write ``<out>/dist-<device>.{csv,md}``."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    world = args.world
    if check_world(world):
        raise SystemExit(check_world(world))
    notes: List[str] = []
    if kind == "cuda" and torch.cuda.device_count() >= world:
        comm = "nccl"
    else:
        if kind == "cuda":
            notes.append(f"{torch.cuda.device_count()} GPU(s) for {world} ranks: ran on the CPU with gloo instead")
            kind = "cpu"
        comm = "gloo"
    d = DEFAULTS[kind]
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    cfg = Config(world=world, width=args.dist_width, blocks=args.dist_blocks, batch=args.dist_batch,
                 warmup=args.warmup if args.warmup is not None else d["warmup"], reps=args.reps or d["reps"],
                 max_seconds=args.max_seconds or d["max_seconds"], threads=threads, comm=comm,
                 timeout_s=args.dist_timeout, progress=not args.no_progress)
    run_device = torch.device("cuda", 0) if comm == "nccl" else torch.device("cpu")
    env = envmod.describe(run_device)
    if comm == "gloo":
        from ampfused.info import cpu_name
        env["device"] = f"{cpu_name()} ({world} ranks x {threads} threads)"
    stem = args.name or "dist-" + envmod.device_stem(run_device)
    numel, tensors = model_size(cfg.width, cfg.blocks)
    print(f"{env['device']}: {cfg.model_name} ({numel:,} bf16 parameters, {tensors} tensors) on {world} ranks "
          f"({comm}): {', '.join(VARIANTS)}", flush=True)
    t0 = time.perf_counter()
    try:
        result = launch(cfg)
    except CorrectnessError as e:
        print(f"\nbenchmark stopped: {e}\nnothing was written; a wrong variant is never timed.", file=sys.stderr)
        return 1
    out_rows = rows(result, cfg, env)
    notes = explain(cfg) + notes + result["notes"] + [f"run took {time.perf_counter() - t0:.0f} s"]
    text = summary(out_rows, cfg, notes)
    print("\n" + text)
    csv_path, md_path = os.path.join(args.out, stem + ".csv"), os.path.join(args.out, stem + ".md")
    write_csv(out_rows, csv_path, COLUMNS)
    with open(md_path, "w") as f:
        f.write(text + "\n")
    print(f"\nwrote {csv_path}\nwrote {md_path}")
    return 0
