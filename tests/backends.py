"""Shared test helpers: which backends the CPU suite can run (the reference always, native cpu when built,
Triton when the interpreter is on: tests/conftest.py turns it on), where Triton runs, optimizer snapshots."""
import os

import pytest
import torch

from ampfused import ops


def cpu_backends():
    names = ["reference"]
    for n in ("cpu", "triton"):
        if not ops.registry.reasons_for(n, torch.device("cpu")):
            names.append(n)
    return names


# Triton kernels run on CPU tensors under the interpreter, else on CUDA tensors.
TRITON_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
requires_triton = pytest.mark.skipif(
    bool(ops.registry.reasons_for("triton", torch.device(TRITON_DEVICE)))
    or (TRITON_DEVICE == "cuda" and not torch.cuda.is_available()),
    reason="triton backend cannot run here")


def set_grad(p, value):
    """Give ``p`` a gradient of its own with these values (a number or a tensor, converted as ``copy_``
    converts), as backward would after ``zero_grad()``; returns it."""
    p.grad = torch.empty_like(p).copy_(value) if isinstance(value, torch.Tensor) else torch.full_like(p, value)
    return p.grad


def snapshot(opt, params):
    """Copies of everything a fused optimizer step may change: params, step counts, states, masters."""
    out = [p.detach().clone() for p in params]
    for seg in opt._segs.segments:
        out += [seg.steps.clone()] + [t.clone() for t in seg.states.values()]
        if seg.master is not None:
            out.append(seg.master.clone())
    return out
