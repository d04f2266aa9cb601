"""Running a function on several gloo processes on this machine, with a deadline.

``run_ranks(fn, world, *args)`` spawns ``world`` processes that join one gloo process group (``backend="nccl"``:
one GPU per rank), meeting through a file store of their own (no port to race other runs for), and call
``fn(rank, world, *args)``. An exception in any rank fails the call with that rank's traceback; a run still
going at the deadline is killed and fails (a hang must not block the suite). The deadline and the group's
timeout only bound a hang: they are generous, so that a slow or busy machine never fails a test.
Workers hand results back by saving them under a directory the test gives them (``save`` / ``load``).
"""
import os
import shutil
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 600
SPAWN_EXTRA_S = 60  # spawned ranks (gloo on a GPU machine) import torch and ampfused themselves


def _entry(rank, fn, world, store, args, backend):
    torch.set_num_threads(1)  # several ranks share this machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        torch.manual_seed(0)
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "ampfused", "ampfused.distributed"]


def run_ranks(fn, world: int, *args, timeout: float = TIMEOUT_S, backend: str = "gloo") -> None:
    meeting = tempfile.mkdtemp(prefix="ampfused-ranks-")
    try:
        _run(fn, world, args, timeout, backend, os.path.join(meeting, "store"))
    finally:
        shutil.rmtree(meeting, ignore_errors=True)


def _run(fn, world: int, args: tuple, timeout: float, backend: str, store: str) -> None:
    if backend == "gloo" and torch.cuda.is_available():
        # gloo ranks are CPU ranks, as on a machine without a GPU: on a GPU machine they start as fresh
        # interpreters that see no device (else FSDP2 and accelerate would place the model on the GPU)
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            ctx = mp.start_processes(_entry, args=(fn, world, store, args, backend), nprocs=world,
                                     join=False, start_method="spawn")
        finally:
            if hidden is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        timeout += SPAWN_EXTRA_S  # each rank imports torch afresh
    else:
        # A fork server imports torch and ampfused once per session and forks every rank from that clean process
        # (no threads started yet): a rank starts in milliseconds instead of importing torch again.
        mp.set_forkserver_preload(_PRELOAD + [fn.__module__])
        ctx = mp.start_processes(_entry, args=(fn, world, store, args, backend), nprocs=world, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def save(out_dir, rank: int, obj) -> None:
    torch.save(obj, os.path.join(out_dir, f"rank{rank}.pt"))


def load(out_dir, world: int) -> list:
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
