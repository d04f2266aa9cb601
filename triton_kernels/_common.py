"""Pieces shared by the Triton kernels: dtype conversions, expm1, the K2 prologue and step advance, the
tensor tables, and launch geometry.

Conversions between fp32 and bf16 are done on the bits, because Triton's interpreter (the CPU test path)
truncates fp32 -> bf16 instead of rounding and mis-reads bf16 subnormals; on a GPU the same integer code
costs a few ALU operations in memory-bound kernels and gives the hardware's round-to-nearest-even result,
so the interpreter and the GPU run one definition.
"""
import contextlib
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from ampfused import _work
from ampfused._floats import fp32

# The step's tensor table (csrc/include/ampfused/step_args.h): one row per parameter of {param address,
# grad address, numel (NO_GRAD when the parameter has no gradient this step), offset in the flat state
# buffers}, int64, in the memory the kernels run on.
STEP_COLS = tl.constexpr(4)
COL_PARAM = tl.constexpr(0)
COL_GRAD = tl.constexpr(1)
COL_NUMEL = tl.constexpr(2)
COL_OFFSET = tl.constexpr(3)
NO_GRAD = tl.constexpr(-1)
# K1's gradient table: one row per gradient of {address, numel, dtype code (ampfused._native.DTYPE_CODES)}.
GRAD_COLS = tl.constexpr(3)
CODE_F32 = tl.constexpr(0)
CODE_BF16 = tl.constexpr(1)
CODE_F16 = tl.constexpr(2)
ALIGN = 16  # bytes of a 128-bit access


@triton.jit
def _lerp(a, b, w):
    """``torch.lerp(a, b, w)`` as ``reference.lerp`` specifies it: torch's two forms by the weight's size, each
    operation rounded as written (no fused multiply-add)."""
    d = b - a
    return tl.where(tl.abs(w) < 0.5, a + w * d, b - d * (1.0 - w))


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


# reference.expm1_nonpositive's constants (fp64 values, rounded to fp32 where used, as there and in math.h)
_EXPM1_C9 = tl.constexpr(1 / 362880)
_EXPM1_C8 = tl.constexpr(1 / 40320)
_EXPM1_C7 = tl.constexpr(1 / 5040)
_EXPM1_C6 = tl.constexpr(1 / 720)
_EXPM1_C5 = tl.constexpr(1 / 120)
_EXPM1_C4 = tl.constexpr(1 / 24)
_EXPM1_C3 = tl.constexpr(1 / 6)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2_HI = tl.constexpr(0.693359375)
_LN2_LO = tl.constexpr(-2.12194440e-4)


@triton.jit
def _expm1_series(x):
    """``reference.expm1_series``: ``1 + x/2! + ... + x^8/9!`` (``exp(x) - 1 = x P(x)``)."""
    p = _EXPM1_C9
    p = p * x + _EXPM1_C8
    p = p * x + _EXPM1_C7
    p = p * x + _EXPM1_C6
    p = p * x + _EXPM1_C5
    p = p * x + _EXPM1_C4
    p = p * x + _EXPM1_C3
    p = p * x + 0.5
    return p * x + 1.0


@triton.jit
def _expm1(x):
    """``exp(x) - 1`` for fp32 ``x <= 0`` (scalar or block): ``reference.expm1_nonpositive``, the same IEEE
    operations in the same order (the launch forbids fma), so the same bits as every other backend."""
    small = _expm1_series(x) * x
    xe = tl.minimum(tl.maximum(x, -24.0), -0.5)
    k = tl.floor(xe * _LOG2E + 0.5)
    r = (xe - k * _LN2_HI) - k * _LN2_LO
    two_k = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    big = (1.0 + r * _expm1_series(r)) * two_k - 1.0
    return tl.where(x >= -0.5, small, tl.where(x >= -24.0, big, -1.0))


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
        # max_norm / (norm + 1e-6) as torch evaluates a Python number over a tensor: reciprocal, then times
        # max_norm (math.h's clip_coef); a correctly rounded division differs from it at an ulp
        coef = coef * tl.minimum(tl.div_rn(1.0, norm + 1e-6) * max_norm, 1.0)
    if tl.program_id(0) == 0:
        tl.store(out_stats_ptr, norm)
        tl.store(out_stats_ptr + 1, found_inf)
    return norm, found_inf, coef


@triton.jit
def _chunk_ptr(addr, start, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed pointer to element ``start`` (int64) of the tensor at address ``addr`` (an int64 from a table).

    With ALIGNED (checked on the host: every address in the table is 16-byte aligned, and ``start`` is a
    multiple of the chunk, so of 16 bytes too) the compiler is told so, which allows full 128-bit accesses;
    without it nothing is assumed and the accesses are correct at any address.
    """
    ptr = addr.to(tl.pointer_type(DTYPE)) + start
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _state_ptr(base_ptr, start):
    """Pointer to element ``start`` (int64) of a flat fp32 state buffer: always 16-byte aligned, since the
    buffers start aligned (checked on the host) and a chunk starts at a ``state_layout`` offset (a multiple of
    4 elements) plus a multiple of the chunk size."""
    return tl.multiple_of(base_ptr + start, 16)


@triton.jit
def _load_chunk(table_ptr, chunks_ptr, c, COLS: tl.constexpr):
    """``(row, start)`` of chunk ``c`` of a chunk list and the address of that row in its table."""
    entry = chunks_ptr + tl.cast(c, tl.int64) * 2
    row = tl.load(entry)
    start = tl.load(entry + 1)
    return row, start, table_ptr + row * COLS


@triton.jit
def _step_chunk(table_ptr, chunks_ptr, c, master_ptr, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
                HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr):
    """What a step needs of chunk ``c``: ``(row, param, grad, state offset, count, w)`` with typed pointers to
    the chunk's first element of the parameter, its gradient and its compute copy ``w`` (the master's slice,
    or the parameter itself without a master), the chunk's offset in the flat state buffers and its length.
    64-bit offsets throughout: parameters and state buffers over 2**31 elements are real."""
    row, start, entry = _load_chunk(table_ptr, chunks_ptr, c, STEP_COLS)
    param_ptr = _chunk_ptr(tl.load(entry + COL_PARAM), start, PARAM_DTYPE, ALIGNED)
    grad_ptr = _chunk_ptr(tl.load(entry + COL_GRAD), start, GRAD_DTYPE, ALIGNED)
    state = tl.load(entry + COL_OFFSET) + start
    count = tl.minimum(tl.load(entry + COL_NUMEL) - start, CHUNK).to(tl.int32)
    if HAS_MASTER:
        w_ptr = _state_ptr(master_ptr, state)
    else:
        w_ptr = param_ptr
    return row, param_ptr, grad_ptr, state, count, w_ptr


@triton.jit
def _advance_steps(steps_ptr, table_ptr, T, counter_ptr, TBLOCK: tl.constexpr):
    """The last program of the launch to arrive adds 1 to ``steps[i]`` for every parameter ``i`` that has a
    gradient (a table row whose numel is not NO_GRAD) and resets the arrival counter.

    Every program read the steps of its chunks before calling this; the barrier orders all its threads'
    reads before the (single-thread, acq_rel, integer) atomic, so no program can see an advanced step. See
    adam.py's docstring.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1)
    if arrived == tl.num_programs(0) - 1:
        lanes = tl.arange(0, TBLOCK)
        for first in range(0, T, TBLOCK):
            i = first + lanes
            live = i < T
            numel = tl.load(table_ptr + i.to(tl.int64) * STEP_COLS + COL_NUMEL, mask=live, other=NO_GRAD)
            active = live & (numel != NO_GRAD)
            step = tl.load(steps_ptr + i, mask=active, other=0.0)
            tl.store(steps_ptr + i, step + 1.0, mask=active)
        tl.atomic_xchg(counter_ptr, 0)


# ---------------------------------------------------------------------------------------------- host side

# Launch option for every kernel: no contraction of a * b + c into an fma, so the GPU rounds each operation
# as written, like the interpreter, the reference and the CUDA backend (built with --fmad=false), and stays
# the same across Triton versions (3.10 changes the default). The kernels are memory-bound: it costs nothing.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def f32(x: float) -> float:
    """``x`` rounded to fp32, as a Python float: what a kernel's fp32 scalar argument holds on a GPU. Every
    float hyperparameter is passed so, so that Triton's interpreter, which keeps a scalar argument's Python value,
    computes with the same value (1.0 - 0.9 and 1.0 - fp32(0.9) differ)."""
    return fp32(x)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid_size(num_chunks: int, max_programs: int) -> int:
    """Programs of a persistent launch over ``num_chunks`` chunks: one per chunk up to ``max_programs``, each
    program then taking chunks ``pid, pid + programs, pid + 2 * programs, ...``."""
    return min(num_chunks, max_programs)


class Plan(NamedTuple):
    """A table and its chunk list in the memory the kernels run on (one upload), and facts about them."""
    table: torch.Tensor       # [rows * cols] int64
    chunks: torch.Tensor      # [num_chunks * 2] int64: (table row, first element) per chunk
    num_chunks: int
    chunk: int                # elements per chunk (a multiple of the kernel's block)
    aligned: bool             # every address of a row that owns a chunk is 16-byte aligned


def make_plan(rows, cols: int, numel_col: int, addr_cols: Sequence[int], chunk: int, device: torch.device) -> Plan:
    """Chunk a table (a flat list of ints, ``cols`` per row, or an int64 ``[rows, cols]`` array) and upload the
    table and its chunk list (``(row, first element)`` pairs, rows in order, chunks in memory order; rows of
    numel <= 0 own none) together.

    The chunk list is written by one C++ pass into page-locked staging memory, and on CUDA the upload is an
    asynchronous copy from it on the current stream: no host wait (``ampfused/_work.py``). ``aligned`` looks
    at the ``addr_cols`` of the rows that own chunks (numel > 0).
    """
    table = _work.as_table(rows, cols)
    owners = table[table[:, numel_col] > 0]
    aligned = bool((owners[:, list(addr_cols)] % ALIGN == 0).all())
    num_chunks = _work.work_list(table, numel_col, chunk, _work.UNCAPPED, -1)
    n_table, n_chunks = table.size, 2 * num_chunks
    # one buffer, never empty: [table | chunks | pad]
    host, view = _work.staging(n_table + n_chunks + 1, device)
    view[:n_table] = table.reshape(-1)
    _work.work_list(table, numel_col, chunk, _work.UNCAPPED, -1, view[n_table:n_table + n_chunks])
    view[n_table + n_chunks] = 0
    buf = _work.upload(host, device)
    # (the staging block is not kept: the allocator hands it out again only once the copy from it is done)
    return Plan(buf[:n_table], buf[n_table:n_table + n_chunks], num_chunks, chunk, aligned)


def device_guard(t):
    """Launch on the tensor's CUDA device (Triton launches on the current one)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def nonempty(t, fallback):
    """``t`` as a kernel argument, or ``fallback`` (a tensor of the same element type when it matters) when
    ``t`` is None or empty: the kernel never touches it then, and an empty tensor may have no address."""
    return t if t is not None and t.numel() else fallback
