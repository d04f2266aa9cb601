"""Compact optimizer state in the Triton kernels: the codecs of ``ops.state_precision`` (the
specification), the same expressions on uint32.

``MASTER_FORMAT`` (a constexpr of the step kernels): 0 an fp32 master (or fp32 parameters that are their own
master), 1 int16 master remainders beside bf16 parameters, 2 no master (bf16 parameters, stochastic rounding).
``STATE_BF16``: the moments are bf16, loaded exactly and stored with stochastic rounding (``STATE_Q8``: 8-bit
codes with block scales, in ``_q8``). The generator is
keyed per parameter by ``_step_key(seed, t)`` (the step being taken, ``t = steps[i] + 1``) and drawn once per
element by ``_random_bits(key, index)``, ``index`` the element's int64 index in the flat state buffers, so a
chunk's draws do not depend on which program runs it; each stream rounds with its rotation of the draw
(``_stream_bits``).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ampfused import _native
from ._common import _load, _round_to, _state_ptr, _store, _to_f32

MASTER_FP32 = tl.constexpr(0)
MASTER_REMAINDER = tl.constexpr(1)
MASTER_NONE = tl.constexpr(2)


@triton.jit
def _mix32(x):
    """``state_precision.mix32`` on uint32 values (multiplication wraps mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _step_key(seed, t):
    """``state_precision.step_key``: seed an int64 scalar, t the step being taken (fp32 scalar)."""
    lo = seed.to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    k = _mix32(lo ^ tl.full((), 0x243F6A88, tl.uint32))
    k = _mix32(k ^ hi)
    k = _mix32(k ^ t.to(tl.int64).to(tl.uint32))
    return _mix32(k)


@triton.jit
def _random_bits(key, index):
    """``state_precision.random_bits``: 32 bits per element of the int64 block ``index``."""
    lo = index.to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    return _mix32((key + hi * tl.full((), 0x9E3779B9, tl.uint32)) ^ lo)


@triton.jit
def _stream_bits(r, STREAM: tl.constexpr):
    """``state_precision.stream_bits``: the bits stream ``STREAM`` (0, 1, 2) rounds with, the element's draw ``r``
    (uint32) rotated left by 11 bits per stream."""
    if STREAM == 0:
        return r
    elif STREAM == 1:
        return (r << 11) | (r >> 21)
    else:
        return (r << 22) | (r >> 10)


@triton.jit
def _draw(key, index, USE_SEED: tl.constexpr):
    """The elements' one draw ``random_bits(key, index)`` when the step has a seed (the key, unused, when not)."""
    if USE_SEED:
        return _random_bits(key, index)
    else:
        return key


@triton.jit
def _bits16(x):
    """The 16 bits of a bf16 / int16 block as uint32 (through int16: the interpreter's bf16 reads are not
    exact)."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF).to(tl.uint32)


@triton.jit
def _as_bf16(bits):
    """bf16 block from uint32 values in [0, 2**16)."""
    return bits.to(tl.int32).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_stochastic(x, r):
    """``state_precision.round_stochastic``: fp32 -> bf16, up in magnitude with probability (low bits)/2**16."""
    u = x.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = tl.where(nan, (u >> 16) | 0x40, (u + (r & 0xFFFF)) >> 16)
    return _as_bf16(out)


@triton.jit
def _join_master(weight, remainder):
    """``state_precision.join_master``: bf16 weight block and int16 remainder block -> fp32 master."""
    w = _bits16(weight)
    low = _bits16(remainder)
    high = (w & 0x7FFF) - tl.where(low >= 0x8000, 1, 0).to(tl.uint32)
    return (((w & 0x8000) << 16) | (high << 16) | low).to(tl.float32, bitcast=True)


@triton.jit
def _split_master(master):
    """``state_precision.split_master``: fp32 master -> (bf16 weight, int16 remainder)."""
    u = master.to(tl.uint32, bitcast=True)
    u = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u & 0xFFFF0000) | 0x00400000, u)
    mag = u & 0x7FFFFFFF
    low = mag & 0xFFFF
    high = (mag >> 16) + tl.where(low >= 0x8000, 1, 0).to(tl.uint32)
    weight = _as_bf16(((u & 0x80000000) >> 16) | high)
    return weight, low.to(tl.int32).to(tl.int16)


@triton.jit
def _load_weight(param_ptr, w_ptr, idx, n, MASTER_FORMAT: tl.constexpr, MASKED: tl.constexpr):
    """The fp32 compute copy: master, master rebuilt from weight and remainder, or the weight itself."""
    if MASTER_FORMAT == MASTER_REMAINDER:
        return _join_master(_load(param_ptr, idx, n, MASKED), _load(w_ptr, idx, n, MASKED))
    else:
        return _to_f32(_load(w_ptr, idx, n, MASKED))


@triton.jit
def _store_weight(param_ptr, w_ptr, idx, n, w, r, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                  MASTER_FORMAT: tl.constexpr, MASKED: tl.constexpr):
    """Writes the updated fp32 weight ``w`` back in the step's format (``r``: the elements' draws)."""
    if MASTER_FORMAT == MASTER_REMAINDER:
        weight, rem = _split_master(w)
        _store(w_ptr, idx, n, rem, MASKED)
        _store(param_ptr, idx, n, weight, MASKED)
    elif MASTER_FORMAT == MASTER_NONE:
        _store(param_ptr, idx, n, _round_stochastic(w, r), MASKED)  # (stream 0: the draw itself)
    elif HAS_MASTER:
        _store(w_ptr, idx, n, w, MASKED)
        _store(param_ptr, idx, n, _round_to(w, PARAM_DTYPE), MASKED)
    else:
        _store(param_ptr, idx, n, w, MASKED)


@triton.jit
def _load_state(ptr, idx, n, MASKED: tl.constexpr):
    return _to_f32(_load(ptr, idx, n, MASKED))


@triton.jit
def _store_state(ptr, idx, n, value, r, STATE_BF16: tl.constexpr, MASKED: tl.constexpr):
    """Writes a moment's new fp32 values (bf16: rounded with the stream's bits ``r``)."""
    if STATE_BF16:
        _store(ptr, idx, n, _round_stochastic(value, r), MASKED)
    else:
        _store(ptr, idx, n, value, MASKED)


@triton.jit
def _state16_ptr(base_ptr, start):
    """Pointer to element ``start`` of a flat 16-bit state buffer (remainders, bf16 moments): 8-byte aligned, since
    the buffers start 16-byte aligned and a chunk starts at a ``state_layout`` offset (a multiple of 4 elements)
    plus a multiple of the chunk size; told to the compiler, so 4 elements move in one 64-bit access."""
    return tl.multiple_of(base_ptr + start, 8)


@triton.jit
def chunk_state_ptrs(w_ptr, master_ptr, s1_ptr, s2_ptr, state, MASTER_FORMAT: tl.constexpr,
                     STATE_BF16: tl.constexpr):
    """A chunk's pointers into the flat buffers at element ``state``: the weight's (``w_ptr`` from
    ``_step_chunk``; the remainders' for MASTER_REMAINDER) and the two moments'."""
    if MASTER_FORMAT == MASTER_REMAINDER:
        w_ptr = _state16_ptr(master_ptr, state)
    if STATE_BF16:
        return w_ptr, _state16_ptr(s1_ptr, state), _state16_ptr(s2_ptr, state)
    else:
        return w_ptr, _state_ptr(s1_ptr, state), _state_ptr(s2_ptr, state)


class LaunchFormat(NamedTuple):
    master: int
    state_bf16: bool
    has_fp32_master: bool
    state_q8: bool            # uint8 moments: 8-bit codes and block scales (``_q8``)


def launch_format(param_dtype, master, state, seed) -> LaunchFormat:
    """The constexprs of a step launch from its buffers (checked by the ops before): ``state`` any moment
    buffer of the step (or None)."""
    fmt, code, _ = _native.compact_args(param_dtype, master, state, seed)
    return LaunchFormat(fmt, code == _native.DTYPE_CODES[torch.bfloat16], fmt == 0 and master is not None,
                        code == _native.STATE_CODES[torch.uint8])
