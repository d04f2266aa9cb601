"""Pieces shared by the Triton kernels: dtype conversions, expm1, the K2 prologue, and launch geometry.

Conversions between fp32 and bf16 are done on the bits, because Triton's interpreter (the CPU test path)
truncates fp32 -> bf16 instead of rounding and mis-reads bf16 subnormals; on a GPU the same integer code
costs a few ALU operations in memory-bound kernels and gives the hardware's round-to-nearest-even result,
so the interpreter and the GPU run one definition.
"""
import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _to_f32(x):
    """Widen a loaded fp32/bf16/fp16 block to fp32 exactly."""
    if x.dtype == tl.bfloat16:
        # bf16 is the top half of an fp32: place its 16 bits above 16 zero bits.
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even (the rounding of ``torch.Tensor.to``)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        # Adding 0x7FFF plus the kept lsb rounds the 16 dropped bits to nearest, ties to even; a carry out of
        # the mantissa bumps the exponent, which is the correct result (up to inf on overflow).
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # A NaN whose payload sits only in the dropped bits would round to inf: keep it a quiet NaN.
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE)


@triton.jit
def _is_nonfinite(x):
    """Per-element inf/NaN test on fp32 values (never inferred from a sum)."""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def _load(ptr, idx, n, MASKED: tl.constexpr):
    # Full blocks go unmasked: a mask Triton cannot prove uniform over 16 bytes (n is arbitrary) would turn
    # the 128-bit vector accesses into scalar ones.
    if MASKED:
        return tl.load(ptr + idx, mask=idx < n, other=0.0)
    else:
        return tl.load(ptr + idx)


@triton.jit
def _store(ptr, idx, n, value, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + idx, value, mask=idx < n)
    else:
        tl.store(ptr + idx, value)


@triton.jit
def _expm1(x):
    """``exp(x) - 1`` in fp32 to a few ulp for any x (scalar or block).

    ``exp(x) - 1`` cancels for small |x|, so there a degree-9 Taylor polynomial is used (the first omitted
    term is below 3e-10 relative at |x| = 0.5); beyond, ``exp(x) - 1`` loses at most a few ulp.
    """
    p = 1.0 / 362880.0
    p = p * x + 1.0 / 40320.0
    p = p * x + 1.0 / 5040.0
    p = p * x + 1.0 / 720.0
    p = p * x + 1.0 / 120.0
    p = p * x + 1.0 / 24.0
    p = p * x + 1.0 / 6.0
    p = p * x + 0.5
    p = p * x + 1.0
    series = p * x
    return tl.where(tl.abs(x) < 0.5, series, tl.exp(x) - 1.0)


@triton.jit
def _prologue(partials_ptr, stride_row, stride_col, P, inv_scale_ptr, max_norm, out_stats_ptr,
              CLIP: tl.constexpr, PBLOCK: tl.constexpr):
    """Reduce the ``[2, P]`` partials in a fixed order: every program computes bitwise the same values.

    Returns ``(norm, found_inf, coef)`` as fp32 scalars, ``coef = inv_scale * min(1, max_norm / (norm +
    1e-6))`` (just ``inv_scale`` when CLIP is off); program 0 also records ``[norm, found_inf]`` in out_stats.
    """
    lanes = tl.arange(0, PBLOCK)
    sumsq = tl.zeros([PBLOCK], dtype=tl.float32)
    flag = tl.zeros([PBLOCK], dtype=tl.float32)
    for start in range(0, P, PBLOCK):
        idx = start + lanes
        m = idx < P
        sumsq += tl.load(partials_ptr + idx * stride_col, mask=m, other=0.0)
        flag = tl.maximum(flag, tl.load(partials_ptr + stride_row + idx * stride_col, mask=m, other=0.0))
    norm = tl.sqrt_rn(tl.sum(sumsq, axis=0))
    found_inf = tl.where(tl.max(flag, axis=0) > 0.0, 1.0, 0.0)
    coef = tl.load(inv_scale_ptr)
    if CLIP:
        coef = coef * tl.minimum(tl.div_rn(max_norm, norm + 1e-6), 1.0)
    if tl.program_id(0) == 0:
        tl.store(out_stats_ptr, norm)
        tl.store(out_stats_ptr + 1, found_inf)
    return norm, found_inf, coef


@triton.jit
def _advance_step(step_ptr, counter_ptr, new_step):
    """The last program of the launch to arrive stores ``new_step`` and resets the arrival counter.

    Every program read ``step`` before calling this; the barrier orders all its threads' reads before the
    (single-thread, acq_rel, integer) atomic, so no program can see the new value. See adam.py's docstring.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1)
    if arrived == tl.num_programs(0) - 1:
        tl.store(step_ptr, new_step)
        tl.atomic_xchg(counter_ptr, 0)


# ---------------------------------------------------------------------------------------------- host side

# Launch option for every kernel: no contraction of a * b + c into an fma, so the GPU rounds each operation
# as written, like the interpreter, the reference and the CUDA backend (built with --fmad=false), and stays
# the same across Triton versions (3.10 changes the default). The kernels are memory-bound: it costs nothing.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunking(n: int, block: int, max_programs: int) -> tuple:
    """``(programs, blocks_per_program)`` for a bounded grid over ``n`` elements.

    Program ``p`` owns the contiguous blocks ``[p * iters, (p + 1) * iters)``; the program count is the
    smallest that covers all blocks with at most ``max_programs`` programs, so every program has work. A pure
    function of ``n``, which makes the partial count of K1 one too.
    """
    blocks = cdiv(n, block)
    if blocks == 0:
        return 0, 0
    iters = cdiv(blocks, max_programs)
    return cdiv(blocks, iters), iters


def device_guard(t):
    """Launch on the tensor's CUDA device (Triton launches on the current one)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
