"""8-bit moments in the Triton step kernels: the codec of ``ampfused.ops.state_precision`` (``q8_*``, the
specification; ``csrc/include/ampfused/math.h`` holds the same expressions in C++) on int32 / uint32 blocks.

A moment of this format is a uint8 buffer of codes beside ``state_scales`` (fp32, ``[moments, blocks]``), one
power-of-two scale per block of ``QBLOCK = 256`` consecutive elements of the flat buffers. Parameters start at
multiples of QBLOCK in this layout and a chunk of the work list at a multiple of the chunk (a multiple of the
kernel's block, itself a multiple of QBLOCK) within its parameter, so a kernel block of ``BLOCK`` lanes holds
``BLOCK // QBLOCK`` whole quantization blocks, of one parameter: row ``k`` of its ``[BLOCK // QBLOCK, QBLOCK]``
reshape is the flat buffer's block ``(state + base) // QBLOCK + k``. A block past the parameter's end (the
parameter's tail block) is masked out; the lanes of a partial block past the end count as zeros in its
maximum and are never read or written. (The launchers' chunk is ``8 * BLOCK``; a table's state offsets must be
multiples of QBLOCK, as ``state_layout(numels, QBLOCK)`` makes them: the ops lay the table out so, the fused
optimizers' segments too.)

Integer arithmetic stays in int32 where values are signed (exponent fields, shifts) and in uint32 for bit
patterns, with every shift amount in [0, 31] (numpy, the interpreter's arithmetic, and the GPU agree there).
"""
import triton
import triton.language as tl

from ._compact import _random_bits

QBLOCK = tl.constexpr(256)
Q8_MIN_EXP = tl.constexpr(40)
Q8_MAX_EXP = tl.constexpr(253)
INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _q8_exponent(scale):
    """``state_precision.q8_exponent``: the block exponents (int32) of fp32 scales (only the exponent field is
    read; a zero scale reads as Q8_MIN_EXP)."""
    return tl.minimum(tl.maximum((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF, Q8_MIN_EXP), Q8_MAX_EXP)


@triton.jit
def _q8_encode(x, e_block, r, SIGNED: tl.constexpr):
    """``state_precision.q8_encode`` with stochastic rounding: fp32 values, their blocks' exponents (int32,
    broadcast per element) and 32-bit draws (uint32) -> uint8 codes."""
    u = x.to(tl.uint32, bitcast=True)
    a = tl.minimum(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, INF_BITS)  # q8_abs_bits
    ex = a >> 23
    sig = ((a & 0x7FFFFF) | tl.where(ex > 0, 0x800000, 0)).to(tl.uint32)
    top: tl.constexpr = 14 if SIGNED else 30  # exponent field of a block's largest value
    e = tl.maximum(ex, 1) - e_block + top     # the code's exponent field (may be <= 0)
    shift = 20 + tl.maximum(1 - e, 0)         # significand bits the code drops
    s = tl.minimum(shift, 31).to(tl.uint32)
    low = (tl.full((), 1, tl.uint32) << s) - 1
    q = tl.where(shift > 31, 0, ((sig + (r & low)) >> s).to(tl.int32))
    if SIGNED:
        mag = tl.minimum((tl.maximum(e, 1) - 1) * 8 + q, 0x7F)
        code = mag | ((u >> 24) & 0x80).to(tl.int32)
    else:
        code = tl.minimum((tl.maximum(e, 1) - 1) * 8 + q, 0xFF)
    return code.to(tl.uint8)


@triton.jit
def _q8_decode(code, e_block, SIGNED: tl.constexpr):
    """``state_precision.q8_decode``: uint8 codes and their blocks' exponents (int32) -> fp32 values, exactly
    (integer and power-of-two arithmetic; never an fp32 subnormal)."""
    c = code.to(tl.int32)
    if SIGNED:
        mag = c & 0x7F
    else:
        mag = c
    e = mag >> 3
    f = mag & 7
    top: tl.constexpr = 14 if SIGNED else 30
    normal = (((e_block - top + e) << 23) | (f << 20)).to(tl.float32, bitcast=True)
    unit = ((e_block - top - 2) << 23).to(tl.float32, bitcast=True)  # 2**(E - top - 129)
    value = tl.where(e > 0, normal, f.to(tl.float32) * unit)
    if SIGNED:
        value = tl.where((c & 0x80) != 0, -value, value)
    return value


@triton.jit
def _per_lane(e_rows, BLOCK: tl.constexpr):
    """``[BLOCK // QBLOCK]`` per-block values -> ``[BLOCK]``, each lane its block's."""
    return tl.reshape(tl.broadcast_to(e_rows[:, None], [BLOCK // QBLOCK, QBLOCK]), [BLOCK])


@triton.jit
def _q8_decode_fast(code, base, hidden, SIGNED: tl.constexpr):
    """``_q8_decode``'s bits in fewer operations (the CPU backend's ``q8_decode_cpu``, which
    tests/test_cpu_compact_blocks.py holds against the reference for every code at every block exponent): a code
    of exponent field 0 is decoded as the normal value one exponent up less that exponent's power of two
    ``hidden`` (exact: both lie in one binade). ``base``: ``(E - top) << 23`` (uint32) at the block's exponent E;
    no intermediate reaches 2**31."""
    c = code.to(tl.uint32)
    if SIGNED:
        mag = c & 0x7F
    else:
        mag = c
    sub = mag < 8
    v = ((mag << 20) + base + tl.where(sub, 0x800000, 0).to(tl.uint32)).to(tl.float32, bitcast=True)
    a = tl.where(sub, v - hidden, v)
    if SIGNED:
        a = (a.to(tl.uint32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
    return a


@triton.jit
def _load_q8(ptr, scale_ptr, idx, n, base, SIGNED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """A moment's fp32 values at the chunk's lanes ``idx = base + arange(BLOCK)``: its codes decoded with their
    blocks' scales (``scale_ptr``: the chunk's first block in its row of ``state_scales``)."""
    k = tl.arange(0, BLOCK // QBLOCK)
    if MASKED:  # (a quantization block past the parameter's end is not read)
        code = tl.load(ptr + idx, mask=idx < n, other=0)
        scale = tl.load(scale_ptr + base // QBLOCK + k, mask=base + k * QBLOCK < n, other=0.0)
    else:
        code = tl.load(ptr + idx)
        scale = tl.load(scale_ptr + base // QBLOCK + k)
    top: tl.constexpr = 14 if SIGNED else 30
    e_rows = _q8_exponent(scale)
    # per block: (E - top) << 23 and the power of two one exponent above the codes' subnormal range
    base_rows = ((e_rows - top) << 23).to(tl.uint32)
    hidden_rows = ((e_rows - top + 1) << 23).to(tl.float32, bitcast=True)
    return _q8_decode_fast(code, _per_lane(base_rows, BLOCK), _per_lane(hidden_rows, BLOCK), SIGNED)


@triton.jit
def _store_q8(ptr, scale_ptr, idx, n, base, value, key, index, SIGNED: tl.constexpr, MASKED: tl.constexpr,
              BLOCK: tl.constexpr):
    """Stores a moment's new fp32 values as codes: each block's exponent from the largest ``q8_abs_bits`` of
    its new values (of the parameter's elements only), every element encoded with it and its draw
    ``random_bits(key, index)``, and the blocks' scales."""
    a = tl.minimum(value.to(tl.int32, bitcast=True) & 0x7FFFFFFF, INF_BITS)  # q8_abs_bits
    if MASKED:
        a = tl.where(idx < n, a, 0)
    # q8_block_exponent of each block's largest value, and its scale q8_scale
    e_rows = tl.minimum(tl.maximum(tl.max(tl.reshape(a, [BLOCK // QBLOCK, QBLOCK]), axis=1) >> 23, Q8_MIN_EXP),
                        Q8_MAX_EXP)
    scale = (e_rows << 23).to(tl.float32, bitcast=True)
    code = _q8_encode(value, _per_lane(e_rows, BLOCK), _random_bits(key, index), SIGNED)
    k = tl.arange(0, BLOCK // QBLOCK)
    if MASKED:  # (a quantization block past the parameter's end is not written)
        tl.store(ptr + idx, code, mask=idx < n)
        tl.store(scale_ptr + base // QBLOCK + k, scale, mask=base + k * QBLOCK < n)
    else:
        tl.store(ptr + idx, code)
        tl.store(scale_ptr + base // QBLOCK + k, scale)

