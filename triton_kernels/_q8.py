"""8-bit moments in the Triton step kernels: the codec of ``ops.state_precision`` (``q8_*``, the
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
def _q8_encode(x, floor, offset, r, SIGNED: tl.constexpr):
    """``state_precision.q8_encode`` with stochastic rounding: fp32 values, their blocks' normal floors (``(E - top
    + 1) << 23``, int32) and offsets (``(E - top) << 3``, uint32), broadcast per element, and 32-bit draws
    (uint32) -> uint8 codes. A value below its block's normal range is carried into it as the fp32 sum ``F +
    |x|`` (``F`` the floor's value; an fp32 subnormal ``|x|`` as 0), whose bits one binade down are then rounded
    like a normal value's: the fp32 bits plus the draw's low 20 bits, shifted right by 20 and rebased."""
    u = x.to(tl.uint32, bitcast=True)
    a = tl.minimum(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, INF_BITS)  # q8_abs_bits
    carried = tl.where(a < 0x800000, 0, a).to(tl.float32, bitcast=True) + floor.to(tl.float32, bitcast=True)
    w = tl.where(a < floor, carried.to(tl.int32, bitcast=True) - 0x800000, a).to(tl.uint32)
    mag = ((w + (r & 0xFFFFF)) >> 20) - offset
    if SIGNED:
        code = tl.minimum(mag, 0x7F) | ((u >> 24) & 0x80)
    else:
        code = tl.minimum(mag, 0xFF)
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
    # Every code's value at block exponent 127 (scale 1), looked up per element and multiplied by the block's
    # 2**(E - 127): exact, since each table value and each product is a normal fp32 value or zero. (The table
    # is the same for every block: the compiler keeps it out of the kernel's loops.)
    table = _q8_decode(tl.arange(0, 256).to(tl.uint8), tl.full((), 127, tl.int32), SIGNED)
    scale_rows = (_q8_exponent(scale) << 23).to(tl.float32, bitcast=True)
    return tl.gather(table, code.to(tl.int32), 0) * _per_lane(scale_rows, BLOCK)


@triton.jit
def _store_q8(ptr, scale_ptr, idx, n, base, value, r, SIGNED: tl.constexpr, MASKED: tl.constexpr,
              BLOCK: tl.constexpr):
    """Stores a moment's new fp32 values as codes: each block's exponent from the largest ``q8_abs_bits`` of
    its new values (of the parameter's elements only), every element encoded with it and its stream's bits
    ``r``, and the blocks' scales."""
    a = tl.minimum(value.to(tl.int32, bitcast=True) & 0x7FFFFFFF, INF_BITS)  # q8_abs_bits
    if MASKED:
        a = tl.where(idx < n, a, 0)
    # q8_block_exponent of each block's largest value, and its scale q8_scale
    e_rows = tl.minimum(tl.maximum(tl.max(tl.reshape(a, [BLOCK // QBLOCK, QBLOCK]), axis=1) >> 23, Q8_MIN_EXP),
                        Q8_MAX_EXP)
    scale = (e_rows << 23).to(tl.float32, bitcast=True)
    top: tl.constexpr = 14 if SIGNED else 30
    floor = _per_lane((e_rows - top + 1) << 23, BLOCK)
    offset = _per_lane(((e_rows - top) << 3).to(tl.uint32), BLOCK)
    code = _q8_encode(value, floor, offset, r, SIGNED)
    k = tl.arange(0, BLOCK // QBLOCK)
    if MASKED:  # (a quantization block past the parameter's end is not written)
        tl.store(ptr + idx, code, mask=idx < n)
        tl.store(scale_ptr + base // QBLOCK + k, scale, mask=base + k * QBLOCK < n)
    else:
        tl.store(ptr + idx, code)
        tl.store(scale_ptr + base // QBLOCK + k, scale)

