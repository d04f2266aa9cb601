"""K1: partial sums of squares and non-finite flags of the unscaled gradients, optionally unscaling in place.

One launch for a whole list of gradients. The gradients are reached through a table (one int64 row per
gradient: address, numel, dtype code, so one launch mixes fp32, bf16 and fp16) and a chunk list built on the
host: one ``(row, first element)`` entry per ``CHUNK`` elements of every gradient, walked in memory order.
The grid is persistent and bounded: ``P = min(chunks, MAX_PROGRAMS)`` programs, program ``p`` taking chunks
``p, p + P, p + 2P, ...`` in that order and writing column ``p`` of the partials. ``P`` is a pure function of
the sizes, small whatever the number of gradients, so the update kernel's prologue can reduce every partial
in every program. No float atomics anywhere: each sum is formed in a fixed order (per lane in chunk order,
then across lanes), so the partials are bitwise reproducible.
"""
from typing import List

import torch
import triton
import triton.language as tl

from ._common import (CODE_BF16, CODE_F16, GRAD_COLS, LAUNCH_OPTIONS, _chunk_ptr, _is_nonfinite, _load, _load_chunk,
                      _round_to, _store, _to_f32, cdiv, device_guard, grid_size)

BLOCK = 4096          # elements per program per loop iteration (16 per thread with 8 warps)
CHUNK = 4 * BLOCK     # elements per chunk-list entry
NUM_WARPS = 8
MAX_PROGRAMS = 512    # a few waves of programs on a large GPU, and few partials for K2 to reduce


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


@triton.jit
def _norm_check_chunk(g_ptr, count, inv_scale, sumsq, bad, WRITE_BACK: tl.constexpr, BLOCK: tl.constexpr):
    """``count`` elements from ``g_ptr``: full blocks unmasked, the gradient's tail masked."""
    lanes = tl.arange(0, BLOCK)
    full = count // BLOCK
    for b in range(0, full):
        sumsq, bad = _norm_check_block(g_ptr, b * BLOCK + lanes, count, inv_scale, sumsq, bad, WRITE_BACK, False)
    if full * BLOCK < count:
        sumsq, bad = _norm_check_block(g_ptr, full * BLOCK + lanes, count, inv_scale, sumsq, bad, WRITE_BACK, True)
    return sumsq, bad


@triton.jit(do_not_specialize=["num_chunks"])
def _norm_check_kernel(table_ptr, chunks_ptr, num_chunks, partials_ptr, inv_scale_ptr, stride_row,
                       WRITE_BACK: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    inv_scale = tl.load(inv_scale_ptr)
    sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        row, start, entry = _load_chunk(table_ptr, chunks_ptr, c, GRAD_COLS)
        addr = tl.load(entry)
        count = tl.minimum(tl.load(entry + 1) - start, CHUNK).to(tl.int32)
        code = tl.load(entry + 2)
        # 64-bit offsets: gradients over 2**31 elements are real
        if code == CODE_BF16:
            sumsq, bad = _norm_check_chunk(_chunk_ptr(addr, start, tl.bfloat16, ALIGNED), count, inv_scale, sumsq,
                                           bad, WRITE_BACK, BLOCK)
        elif code == CODE_F16:
            sumsq, bad = _norm_check_chunk(_chunk_ptr(addr, start, tl.float16, ALIGNED), count, inv_scale, sumsq,
                                           bad, WRITE_BACK, BLOCK)
        else:
            sumsq, bad = _norm_check_chunk(_chunk_ptr(addr, start, tl.float32, ALIGNED), count, inv_scale, sumsq,
                                           bad, WRITE_BACK, BLOCK)
    tl.store(partials_ptr + pid, tl.sum(sumsq, axis=0))
    tl.store(partials_ptr + stride_row + pid, tl.max(bad, axis=0).to(tl.float32))


def num_chunks(numels: List[int]) -> int:
    return sum(cdiv(int(n), CHUNK) for n in numels if n > 0)


def num_partials(numels: List[int]) -> int:
    """Columns of the partials for gradients of these sizes: one per program, ``min(chunks, MAX_PROGRAMS)``."""
    return grid_size(num_chunks(numels), MAX_PROGRAMS)


def run(plan, inv_scale: torch.Tensor, write_back: bool) -> torch.Tensor:
    """K1 over the gradients of ``plan`` (``_common.make_plan`` over rows of ``GRAD_COLS``, chunked by a
    multiple of ``BLOCK``, ``CHUNK`` by default); returns the ``[2, P]`` partials."""
    programs = grid_size(plan.num_chunks, MAX_PROGRAMS)
    partials = torch.empty(2, programs, dtype=torch.float32, device=inv_scale.device)
    if programs:
        with device_guard(inv_scale):
            _norm_check_kernel[(programs,)](plan.table, plan.chunks, plan.num_chunks, partials, inv_scale, programs,
                                            WRITE_BACK=write_back, ALIGNED=plan.aligned, CHUNK=plan.chunk,
                                            BLOCK=BLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
    return partials


def grad_rows(grads: List[torch.Tensor], codes) -> List[int]:
    """The table of dense gradients as a flat list: address, numel, dtype code per gradient."""
    rows: List[int] = []
    for g in grads:
        rows += (g.data_ptr(), g.numel(), codes[g.dtype])
    return rows


def norm_check(plan, inv_scale: torch.Tensor) -> torch.Tensor:
    """Partials of ``fp32(g) * inv_scale`` over the gradients of ``plan``; the gradients are not modified.

    Returns ``[2, P]`` fp32 with ``P = num_partials(numels)``; column ``p`` covers the chunks ``p, p + P, ...``
    of the chunk list (the gradients in order, each cut into ``CHUNK``-element pieces in memory order)::

        partials[0, p] = sum over those elements of (fp32(g) * inv_scale) ** 2     (fp32)
        partials[1, p] = 1.0 if any of them is inf or NaN else 0.0
    """
    return run(plan, inv_scale, write_back=False)


def unscale_(plan, inv_scale: torch.Tensor) -> torch.Tensor:
    """In place ``g = round_to_nearest_even(fp32(g) * inv_scale)`` and the partials of :func:`norm_check`
    of the unscaled (fp32, before rounding) values, in one read and one write of each gradient.

    For fp32 gradients the stored value is exactly ``g * inv_scale`` (one fp32 multiply), as
    ``torch._amp_foreach_non_finite_check_and_unscale_``. Non-finite gradients are still multiplied; the flag
    tells the step to skip.
    """
    return run(plan, inv_scale, write_back=True)

