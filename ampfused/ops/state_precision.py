"""Compact optimizer state: the storage formats of a step's state buffers, in plain torch (the specification).

A step's state precision is read from its buffers, never from a flag of its own (``docs/state-precision.md``):

* ``master`` fp32: the fp32 master weights (the default). ``master`` int16 beside bf16 parameters: the
  *master remainders*, the low 16 bits of each fp32 master that its bf16 weight lacks (:func:`split_master`,
  :func:`join_master`); weight and remainder rebuild the master bit for bit. ``master=None`` beside bf16
  parameters with a ``seed``: *no master*, the bf16 weights are updated in fp32 and rounded back
  stochastically.
* moments (``exp_avg``, ``exp_avg_sq``, ``momentum_buf``) fp32, or bf16: *16-bit moments*, loaded exactly and
  stored with stochastic rounding, or uint8: *8-bit moments*, codes of a block-scaled 8-bit float format
  (:func:`q8_encode`) with one power-of-two scale per block of ``QBLOCK`` elements in a ``state_scales`` tensor
  (``[moments, blocks]`` fp32), stored with stochastic rounding too.

Stochastic rounding draws 32 bits per element from a counter-based generator (:func:`random_bits`): a hash of
the parameter's key (:func:`step_key`: the seed and the parameter's step number ``t``) and the element's index in
the flat state buffers. Each value of the element that is rounded stochastically (its *stream*: 0 the weight, 1
``exp_avg`` / ``momentum_buf``, 2 ``exp_avg_sq``) rounds with a rotation of that one draw (:func:`stream_bits`).
Nothing is drawn in sequence, so every backend, every thread count and a resumed run give the same bits, and a
skipped step (whose ``t`` does not advance) draws nothing.

All integer arithmetic here is on int64 tensors (or Python ints) holding unsigned 32-bit values, written so that
no intermediate leaves int64: the C++, CUDA and Triton versions are the same expressions on uint32.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9           # 2**32 / golden ratio: spreads small counters over 32 bits
SEED_SALT = 0x243F6A88        # (pi's fraction) so a zero seed does not start the chain at the hash's fixed point 0
STREAM_WEIGHT, STREAM_STATE1, STREAM_STATE2 = 0, 1, 2
STREAM_ROTATION = 11          # bits between the streams' rotations of an element's draw (stream_bits)

# master formats (the int codes the native and Triton kernels take)
MASTER_FP32 = 0        # fp32 master buffer, or fp32 parameters that are their own master
MASTER_REMAINDER = 1   # int16 remainders beside bf16 parameters
MASTER_NONE = 2        # bf16 parameters, no master, stochastic rounding


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32``, without an int64 overflow (two 16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M32


def mix32(x):
    """A 32-bit integer hash (xor-shift / multiply, two rounds; a bijection on [0, 2**32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def step_key(seed, t):
    """Key of one parameter's draws at its step ``t`` (1 on its first update): the seed's two 32-bit halves (an
    int64, its bits read as unsigned) and the step folded in by the hash, one at a time, then a last round.
    ``seed`` and ``t`` are Python ints or int64 tensors (the key is then a tensor: no host read)."""
    k = mix32((seed & M32) ^ SEED_SALT)
    k = mix32(k ^ ((seed >> 32) & M32))
    k = mix32(k ^ (t & M32))
    return mix32(k)


def random_bits(key, index: Tensor) -> Tensor:
    """32 random bits per element (int64 tensor of values in [0, 2**32)), ``index`` the elements' int64
    indices in the flat state buffers: ``mix32(((key + hi * GOLDEN) mod 2**32) ^ lo)`` with ``lo``, ``hi``
    the index's 32-bit halves."""
    lo, hi = index & M32, index >> 32
    return mix32(((key + _mul32(hi, GOLDEN)) & M32) ^ lo)


def stream_bits(r, stream: int):
    """The bits stream ``stream`` rounds with, from an element's draw ``r`` (:func:`random_bits`): ``r`` rotated
    left by ``STREAM_ROTATION * stream`` bits. A rotation of uniform bits is uniform, so each rounding stays
    unbiased; the roundings of one element are not independent (a stream's most significant rounding bits are
    another's least significant ones), which the alignment study measured as harmless
    (docs/state-precision.md): one hash per element instead of one per stream."""
    k = (STREAM_ROTATION * stream) % 32
    if k == 0:
        return r
    return ((r << k) & M32) | (r >> (32 - k))


def _bits(x: Tensor) -> Tensor:
    """fp32 bits as int64 in [0, 2**32)."""
    return x.float().contiguous().view(torch.int32).to(torch.int64) & M32


def _f32_of_bits(b: Tensor) -> Tensor:
    """fp32 tensor from int64 values in [0, 2**32)."""
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


def _bf16_of_bits(b: Tensor) -> Tensor:
    """bf16 tensor from int64 values in [0, 2**16)."""
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def round_stochastic(x: Tensor, rand: Tensor) -> Tensor:
    """fp32 -> bf16 rounded up in magnitude with probability (dropped 16 bits) / 2**16, so ``E[result] = x``:
    the low 16 bits of ``rand`` are added to the fp32 bits below the kept 16, and the sum truncated (a carry
    rounds up, past the largest bf16 to inf). inf stays inf; a NaN becomes the quiet NaN that round to nearest
    gives (sign and top payload kept)."""
    u = _bits(x)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = torch.where(nan, (u >> 16) | 0x40, (u + (rand & 0xFFFF)) >> 16)
    return _bf16_of_bits(out)


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 master -> (bf16 weight, int16 remainder), an exact code (see :func:`join_master`).

    On the magnitude bits ``a`` (sign kept apart): ``weight = (a >> 16) + (low >= 0x8000)``, ``remainder =
    low = a & 0xFFFF``. The weight is the master rounded to nearest with ties away from zero: it equals round
    to nearest even except where ``low == 0x8000`` and ``a >> 16`` is even (one bf16 ulp larger in magnitude
    then). A tie rule that looked at the weight's parity could not be decoded from 16 bits (an even bf16 value
    is the rounding of 65537 fp32 values, an odd one of 65535); this one can. A NaN master is first made the
    quiet NaN that round to nearest gives (its low 16 bits cleared), so its weight is that NaN and its
    remainder 0; inf and overflow to inf are exact like any other value.
    """
    u = _bits(master)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    u = torch.where(nan, (u & 0xFFFF0000) | 0x00400000, u)
    sign, mag = u & 0x80000000, u & 0x7FFFFFFF
    low = mag & 0xFFFF
    high = (mag >> 16) + (low >= 0x8000).to(torch.int64)
    return _bf16_of_bits((sign >> 16) | high), torch.where(low >= 0x8000, low - 0x10000, low).to(torch.int16)


def join_master(weight: Tensor, remainder: Tensor) -> Tensor:
    """(bf16 weight, int16 remainder) -> fp32 master: ``a = ((w_mag - (low >= 0x8000)) << 16) | low``, the
    inverse of :func:`split_master`. A remainder of 0 gives the weight's own value: a weight written from
    outside re-derives its master by clearing its remainder."""
    w = weight.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    low = remainder.to(torch.int64) & 0xFFFF
    high = (w & 0x7FFF) - (low >= 0x8000).to(torch.int64)
    u = ((w & 0x8000) << 16) | (high << 16) | low
    return torch.where(u >= 0x80000000, u - (1 << 32), u).to(torch.int32).view(torch.float32)


# ---- 8-bit moments ------------------------------------------------------------------------------------------
#
# A moment buffer of dtype uint8 holds one code per element; blocks of QBLOCK consecutive elements of the flat
# buffer share a scale S = 2**(E - 127), E the block's exponent (an fp32 power of two in ``state_scales``).
# Parameters start at multiples of QBLOCK in this format (``state_layout(numels, QBLOCK)``), so a block never
# holds two parameters and each parameter's blocks are its own (in checkpoints too).
#
# The code is a small float relative to S: exp_avg and momentum_buf signed (sign bit, 4 exponent bits, 3
# mantissa bits), exp_avg_sq unsigned (5 exponent bits, 3 mantissa bits; its values are >= 0 and span many
# more binades). A code of exponent field e >= 1 and mantissa f is (1 + f / 8) * 2**(e - top) * S; e == 0 is
# the subnormal range, f * 2**(1 - top - 3) * S, the same spacing as e == 1. ``top`` (14 signed, 30 unsigned)
# is the exponent field of the block's largest value, so a block spans 2**-13 (signed) and 2**-29 (unsigned)
# of its largest value in normal codes, 3 more binades in subnormal ones; the field above ``top`` is reached
# only by rounding up the largest value. The block exponent E is that of the block's largest magnitude,
# clamped to [Q8_MIN_EXP, Q8_MAX_EXP] so that every code decodes to a normal fp32 value or zero with exact
# integer and power-of-two arithmetic (no fp32 subnormals anywhere: a device that flushes them gives the same
# bits). A non-finite value saturates to the largest code.
#
# Stochastic rounding: in the normal range, the fp32 bits of |x| (exponent and significand) are shifted right
# by the 20 bits the code drops after adding the low 20 bits of the element's random draw, then rebased to the
# block's exponent (a carry out of the mantissa lands in the exponent: the next code up). Below it (|x| less than
# F, the smallest normal code's value 2**(E - top + 1 - 127)), |x| is first carried into the normal range as the
# fp32 sum F + |x| (rounded to nearest even: to 2**-20 of the code step; an fp32 subnormal |x| counts as 0),
# whose bits one binade down hold |x| / F * 2**23 below F's exponent, and rounded the same way. Either way the
# stored value is x in expectation (E[decode] = x) up to that 2**-20 of a step. One form for both ranges: a
# float add and a select instead of a variable shift and mask (docs/state-precision.md, "8-bit moments").

QBLOCK = 256
Q8_MIN_EXP, Q8_MAX_EXP = 40, 253
Q8_TOP = {True: 14, False: 30}        # exponent field of a block's largest value: signed, unsigned codes
Q8_MAX_MAG = {True: 0x7F, False: 0xFF}
INF_BITS = 0x7F800000


def q8_signed(name: str) -> bool:
    """Whether a moment's codes are signed: all but ``exp_avg_sq`` (never negative)."""
    return name != "exp_avg_sq"


def q8_abs_bits(x: Tensor) -> Tensor:
    """|x|'s fp32 bits (int64), a NaN counted as inf: the values a block's exponent is taken from."""
    return torch.clamp(_bits(x) & 0x7FFFFFFF, max=INF_BITS)


def q8_block_exponent(max_abs_bits):
    """A block's exponent E from the largest :func:`q8_abs_bits` of its new values (0 for an all-zero block)."""
    return torch.clamp(max_abs_bits >> 23, Q8_MIN_EXP, Q8_MAX_EXP)


def q8_scale(exponent: Tensor) -> Tensor:
    """The fp32 scale ``2**(E - 127)`` of block exponents E (int64)."""
    return (exponent << 23).to(torch.int32).view(torch.float32)


def q8_exponent(scale: Tensor) -> Tensor:
    """Block exponents E (int64) of a scale tensor: its exponent field, clamped like :func:`q8_block_exponent`
    (only the exponent is read; a zero scale, as in fresh state, reads as ``Q8_MIN_EXP``)."""
    return torch.clamp((_bits(scale) >> 23) & 0xFF, Q8_MIN_EXP, Q8_MAX_EXP)


def q8_encode(x: Tensor, exponent: Tensor, rand: Optional[Tensor], signed: bool) -> Tensor:
    """fp32 values -> uint8 codes, each with its block's exponent (``exponent`` broadcast per element), rounded
    stochastically with the low 20 bits of ``rand`` (int64 values in [0, 2**32)), or to nearest (ties up in
    magnitude) when ``rand`` is None (conversions of loaded fp32 state)."""
    top, max_mag = Q8_TOP[signed], Q8_MAX_MAG[signed]
    u = _bits(x)
    a = torch.clamp(u & 0x7FFFFFFF, max=INF_BITS)              # q8_abs_bits
    floor = (exponent - top + 1) << 23                          # bits of F, the smallest normal code's value
    # below F: the bits of F + |x| (fp32, nearest even; an fp32 subnormal |x| as 0), one binade down
    carried = (_f32_of_bits(torch.where(a < 0x800000, 0, a)) + _f32_of_bits(floor)).contiguous()
    w = torch.where(a < floor, _bits(carried) - (1 << 23), a)
    add = (1 << 19) if rand is None else rand & 0xFFFFF
    mag = torch.clamp(((w + add) >> 20) - ((exponent - top) << 3), max=max_mag)
    code = mag | ((u >> 24) & 0x80) if signed else mag
    return code.to(torch.uint8)


def q8_decode(code: Tensor, exponent: Tensor, signed: bool) -> Tensor:
    """uint8 codes -> fp32 values with their blocks' exponents (broadcast per element); exact."""
    top = Q8_TOP[signed]
    c = code.to(torch.int64)
    mag = c & (0x7F if signed else 0xFF)
    e, f = mag >> 3, mag & 7
    normal = (((exponent - top + e) << 23) | (f << 20))
    unit = ((exponent - top - 2) << 23).to(torch.int32).view(torch.float32)      # 2**(E - top - 129)
    value = torch.where(e > 0, normal.to(torch.int32).view(torch.float32), f.to(torch.float32) * unit)
    return torch.where((c & 0x80) > 0, -value, value) if signed else value


def q8_blocks(n: int) -> int:
    """Blocks of a parameter of ``n`` elements."""
    return -(-n // QBLOCK)


def q8_quantize(values: Tensor, signed: bool, rand: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """One parameter's fp32 moment (1-D, in memory order) -> (uint8 codes of the same length, fp32 scales of
    ``q8_blocks(len)`` blocks); blocks start at its first element. ``rand`` as :func:`q8_encode`."""
    n = values.numel()
    nb = q8_blocks(n)
    padded = torch.zeros(nb * QBLOCK, dtype=torch.int64, device=values.device)
    padded[:n] = q8_abs_bits(values.float())
    exponent = q8_block_exponent(padded.view(nb, QBLOCK).amax(dim=1)) if nb else padded[:0]
    codes = q8_encode(values.float(), exponent.repeat_interleave(QBLOCK)[:n], rand, signed)
    return codes, q8_scale(exponent)


def q8_dequantize(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """One parameter's codes and block scales -> its fp32 moment (exact)."""
    n = codes.numel()
    return q8_decode(codes, q8_exponent(scales).repeat_interleave(QBLOCK)[:n], signed)


class Format(NamedTuple):
    """What a step's buffers say about its state precision."""
    master: int               # MASTER_FP32 / MASTER_REMAINDER / MASTER_NONE
    state_dtype: Optional[torch.dtype]  # bf16 / uint8 for 16- / 8-bit moments, None when they have the compute dtype


COMPACT_STATE_DTYPES = (torch.bfloat16, torch.uint8)


def step_format(params: Sequence[Tensor], master: Optional[Tensor], states, seed: Optional[Tensor],
                state_scales: Optional[Tensor] = None) -> Format:
    """The format of a step from its buffers (rules in the module docstring); raises naming the tensor and the
    rule when they do not make one. ``states``: ``(name, tensor)`` pairs (tensors may be None)."""
    pdtype = params[0].dtype if len(params) else None
    if master is not None and master.dtype == torch.int16:
        if pdtype is not None and pdtype != torch.bfloat16:
            raise TypeError(f"master has dtype int16 (master remainders), which needs bfloat16 params, got {pdtype}")
        fmt = MASTER_REMAINDER
    elif master is None and seed is not None and pdtype == torch.bfloat16:
        fmt = MASTER_NONE
    else:
        fmt = MASTER_FP32
    given = [(n, s) for n, s in states if s is not None]
    compact = [(n, s) for n, s in given if s.dtype in COMPACT_STATE_DTYPES]
    state_dtype = compact[0][1].dtype if compact else None
    if compact and any(s.dtype != state_dtype for _, s in given):
        other, wide = next((n, s) for n, s in given if s.dtype != state_dtype)
        raise TypeError(f"{compact[0][0]} must have dtype in ['{wide.dtype}'] like {other}, or every moment "
                        f"{state_dtype} (one step stores all its moments in one precision), got {state_dtype}")
    label = {torch.bfloat16: "bfloat16 (16-bit moments", torch.uint8: "uint8 (8-bit moments"}.get(state_dtype)
    if compact and master is not None and master.dtype == torch.float64:
        raise TypeError(f"{label.split(' ')[0]} moments are computed in fp32: master must not be float64")
    if compact and master is None and pdtype not in (torch.float32, torch.bfloat16, None):
        raise TypeError(f"{label.split(' ')[0]} moments without a master need float32 or bfloat16 params (with "
                        f"seed), got {pdtype}")
    if compact and seed is None:  # (no master without a seed is the fp32 format)
        raise ValueError(f"{compact[0][0]} is {label}, stored with stochastic rounding): pass seed= (a 0-d int64 "
                         "tensor)")
    if seed is not None:
        if not isinstance(seed, Tensor) or seed.dtype != torch.int64 or seed.dim() != 0:
            raise TypeError("seed must be a 0-d int64 tensor (the stochastic rounding's key), got "
                            f"{getattr(seed, 'dtype', type(seed).__name__)} of shape {tuple(getattr(seed, 'shape', ()))}")
    if state_dtype == torch.uint8:
        if state_scales is None:
            raise ValueError(f"{compact[0][0]} is uint8 (8-bit moments): pass state_scales= (fp32, one row per "
                             "moment, one column per block of QBLOCK elements)")
        if not isinstance(state_scales, Tensor) or state_scales.dtype != torch.float32:
            raise TypeError("state_scales must be a float32 tensor (the 8-bit moments' block scales), got "
                            f"{getattr(state_scales, 'dtype', type(state_scales).__name__)}")
    elif state_scales is not None:
        raise ValueError("state_scales are the block scales of 8-bit (uint8) moments; this step's moments are "
                         f"{given[0][1].dtype if given else 'absent'}: pass state_scales=None")
    return Format(fmt, state_dtype)


def layout_align(fmt: Format) -> int:
    """Elements between parameter starts in the flat buffers of a step of this format (``state_layout``)."""
    return QBLOCK if fmt.state_dtype == torch.uint8 else 4


def uses_seed(fmt: Format) -> bool:
    return fmt.master == MASTER_NONE or fmt.state_dtype is not None
