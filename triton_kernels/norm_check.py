"""K1: partial sums of squares and non-finite flags of the unscaled gradients, optionally unscaling in place.

For a gradient buffer of ``n`` elements the grid is bounded: ``P = num_partials([n])`` programs, program ``p``
walking its own contiguous run of ``BLOCK``-element blocks in order and writing column ``p`` of the
partials. The program count is a pure function of ``n`` and small (at most ``MAX_PROGRAMS``), so the update
kernel's prologue can reduce every partial in every program. No float atomics anywhere: each sum is formed
in a fixed order, so the partials are bitwise reproducible.
"""
from typing import List

import torch
import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, _is_nonfinite, _load, _round_to, _store, _to_f32, chunking,
                      device_guard)

BLOCK = 4096          # elements per program per loop iteration (16 per thread with 8 warps)
NUM_WARPS = 8
MAX_PROGRAMS = 512    # per buffer: a few waves of programs on a large GPU, and few partials for K2 to reduce


@triton.jit
def _norm_check_block(g_ptr, idx, n, inv_scale, sumsq, bad, WRITE_BACK: tl.constexpr, MASKED: tl.constexpr):
    x = _to_f32(_load(g_ptr, idx, n, MASKED))
    u = x * inv_scale
    sumsq += u * u
    # the flag looks at the stored value: a finite gradient may still overflow u * u (norm inf, no flag)
    bad = tl.maximum(bad, _is_nonfinite(x).to(tl.int32))
    if WRITE_BACK:
        _store(g_ptr, idx, n, _round_to(u, g_ptr.dtype.element_ty), MASKED)
    return sumsq, bad


@triton.jit(do_not_specialize=["n"])  # n stays a runtime value (n == 1 would become a constant)
def _norm_check_kernel(g_ptr, partials_ptr, inv_scale_ptr, n, iters, stride_row, WRITE_BACK: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    inv_scale = tl.load(inv_scale_ptr)
    lanes = tl.arange(0, BLOCK)
    sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    # 64-bit offsets: buffers over 2**31 elements are real
    first = pid.to(tl.int64) * iters
    full_blocks = n // BLOCK
    off = first * BLOCK
    for _ in range(0, tl.minimum(full_blocks - first, iters).to(tl.int32)):
        sumsq, bad = _norm_check_block(g_ptr, off + lanes, n, inv_scale, sumsq, bad, WRITE_BACK, False)
        off += BLOCK
    # the partial last block, if any, belongs to the last program
    if (pid == tl.num_programs(0) - 1) & (full_blocks * BLOCK < n):
        sumsq, bad = _norm_check_block(g_ptr, full_blocks.to(tl.int64) * BLOCK + lanes, n, inv_scale, sumsq,
                                       bad, WRITE_BACK, True)
    tl.store(partials_ptr + pid, tl.sum(sumsq, axis=0))
    tl.store(partials_ptr + stride_row + pid, tl.max(bad, axis=0).to(tl.float32))


def num_partials(numels: List[int]) -> int:
    """Columns of the partials for gradient buffers of these sizes (an empty buffer adds none)."""
    return sum(chunking(int(n), BLOCK, MAX_PROGRAMS)[0] for n in numels)


def _run(grads, inv_scale, write_back: bool) -> torch.Tensor:
    P = num_partials([g.numel() for g in grads])
    partials = torch.empty(2, P, dtype=torch.float32, device=inv_scale.device)
    col = 0
    for g in grads:
        programs, iters = chunking(g.numel(), BLOCK, MAX_PROGRAMS)
        if programs == 0:
            continue
        # Contiguous tensors of any shape are walked as flat memory. A strided one goes through a contiguous
        # copy (and, when unscaling, is copied back): correct, at the price of extra traffic.
        flat = g if g.is_contiguous() else g.contiguous()
        with device_guard(g):
            _norm_check_kernel[(programs,)](flat, partials[:, col:], inv_scale, flat.numel(), iters, P,
                                            WRITE_BACK=write_back, BLOCK=BLOCK, num_warps=NUM_WARPS,
                                            **LAUNCH_OPTIONS)
        if write_back and flat is not g:
            g.copy_(flat)
        col += programs
    return partials


def norm_check(grads: List[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Partials of ``fp32(g) * inv_scale`` over the gradient buffers; ``grads`` are not modified.

    grads: list of tensors (any shape, fp32/bf16/fp16) on one device; inv_scale: 0-d fp32.
    Returns ``[2, P]`` fp32 with ``P = num_partials([g.numel() for g in grads])``; buffer ``i`` owns the
    ``num_partials([n_i])`` columns after those of buffers ``< i``. For column ``p`` of a buffer::

        partials[0, p] = sum over the program's elements of (fp32(g) * inv_scale) ** 2     (fp32)
        partials[1, p] = 1.0 if any of them is inf or NaN else 0.0

    One launch per buffer: fine for flat buffers; a list of hundreds of per-parameter tensors pays one
    launch each.
    """
    return _run(grads, inv_scale, write_back=False)


def unscale_(grads: List[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """In place ``g = round_to_nearest_even(fp32(g) * inv_scale)`` and the partials of :func:`norm_check`
    of the unscaled (fp32, before rounding) values, in one read and one write of each gradient.

    For fp32 gradients the stored value is exactly ``g * inv_scale`` (one fp32 multiply), as
    ``torch._amp_foreach_non_finite_check_and_unscale_``. Non-finite gradients are still multiplied; the flag
    tells the step to skip.
    """
    return _run(grads, inv_scale, write_back=True)
