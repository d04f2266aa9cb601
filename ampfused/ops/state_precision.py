"""Compact optimizer state: the storage formats of a step's state buffers, in plain torch (the specification).

A step's state precision is read from its buffers, never from a flag of its own (``docs/state-precision.md``):

* ``master`` fp32: the fp32 master weights (the default). ``master`` int16 beside bf16 parameters: the
  *master remainders*, the low 16 bits of each fp32 master that its bf16 weight lacks (:func:`split_master`,
  :func:`join_master`); weight and remainder rebuild the master bit for bit. ``master=None`` beside bf16
  parameters with a ``seed``: *no master*, the bf16 weights are updated in fp32 and rounded back
  stochastically.
* moments (``exp_avg``, ``exp_avg_sq``, ``momentum_buf``) fp32, or bf16: *16-bit moments*, loaded exactly and
  stored with stochastic rounding.

Stochastic rounding draws 16 bits per element from a counter-based generator (:func:`random_bits`): a hash of
(seed, the parameter's step number ``t``, a stream id, the element's index in the flat state buffers). Nothing
is drawn in sequence, so every backend, every thread count and a resumed run give the same bits, and a skipped
step (whose ``t`` does not advance) draws nothing. Streams: 0 the weight, 1 ``exp_avg`` / ``momentum_buf``,
2 ``exp_avg_sq``.

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

# master formats (the int codes the native and Triton kernels take)
MASTER_FP32 = 0        # fp32 master buffer, or fp32 parameters that are their own master
MASTER_REMAINDER = 1   # int16 remainders beside bf16 parameters
MASTER_NONE = 2        # bf16 parameters, no master, stochastic rounding
MASTER_FORMATS = {MASTER_FP32: "fp32", MASTER_REMAINDER: "remainder", MASTER_NONE: "none"}


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


def stream_key(seed, t, stream: int):
    """Key of one parameter's draws at its step ``t`` (1 on its first update) in ``stream``: the seed's two
    32-bit halves (an int64, its bits read as unsigned), the step and the stream folded in by the hash, one at a
    time. ``seed`` and ``t`` are Python ints or int64 tensors (the key is then a tensor: no host read)."""
    k = mix32((seed & M32) ^ SEED_SALT)
    k = mix32(k ^ ((seed >> 32) & M32))
    k = mix32(k ^ (t & M32))
    return mix32(k ^ ((stream * GOLDEN) & M32))


def random_bits(key, index: Tensor) -> Tensor:
    """32 random bits per element (int64 tensor of values in [0, 2**32)), ``index`` the elements' int64
    indices in the flat state buffers: ``mix32(((key + hi * GOLDEN) mod 2**32) ^ lo)`` with ``lo``, ``hi``
    the index's 32-bit halves."""
    lo, hi = index & M32, index >> 32
    return mix32(((key + _mul32(hi, GOLDEN)) & M32) ^ lo)


def _bits(x: Tensor) -> Tensor:
    """fp32 bits as int64 in [0, 2**32)."""
    return x.float().contiguous().view(torch.int32).to(torch.int64) & M32


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


class Format(NamedTuple):
    """What a step's buffers say about its state precision."""
    master: int               # MASTER_FP32 / MASTER_REMAINDER / MASTER_NONE
    state_dtype: Optional[torch.dtype]  # bf16 for 16-bit moments, None when they have the compute dtype


def step_format(params: Sequence[Tensor], master: Optional[Tensor], states, seed: Optional[Tensor]) -> Format:
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
    compact_states = [n for n, s in given if s.dtype == torch.bfloat16]
    if compact_states and len(compact_states) != len(given):
        other, wide = next((n, s) for n, s in given if s.dtype != torch.bfloat16)
        raise TypeError(f"{compact_states[0]} must have dtype in ['{wide.dtype}'] like {other}, or every moment "
                        "bfloat16 (one step stores all its moments in one precision), got torch.bfloat16")
    state_dtype = torch.bfloat16 if compact_states else None
    if compact_states and master is not None and master.dtype == torch.float64:
        raise TypeError("bfloat16 moments are computed in fp32: master must not be float64")
    if compact_states and master is None and pdtype not in (torch.float32, torch.bfloat16, None):
        raise TypeError(f"bfloat16 moments without a master need float32 or bfloat16 params (with seed), got {pdtype}")
    if (compact_states or fmt == MASTER_NONE) and seed is None:
        raise ValueError(f"{compact_states[0]} is bfloat16 (16-bit moments, stored with stochastic rounding): "
                         "pass seed= (a 0-d int64 tensor)")
    if seed is not None:
        if not isinstance(seed, Tensor) or seed.dtype != torch.int64 or seed.dim() != 0:
            raise TypeError("seed must be a 0-d int64 tensor (the stochastic rounding's key), got "
                            f"{getattr(seed, 'dtype', type(seed).__name__)} of shape {tuple(getattr(seed, 'shape', ()))}")
    return Format(fmt, state_dtype)


def uses_seed(fmt: Format) -> bool:
    return fmt.master == MASTER_NONE or fmt.state_dtype == torch.bfloat16
