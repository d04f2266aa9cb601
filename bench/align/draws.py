"""The proposed one-draw specification of stochastic rounding (docs/state-precision.md), for the alignment study.

Today each stochastically rounded value of an element draws its own 32 bits: ``random_bits(stream_key(seed, t,
stream), index)`` for the weight (stream 0) and each moment (streams 1, 2), three hashes per element in the no-master
8-bit mode. The proposal draws once per element, ``r = random_bits(stream_key(seed, t, 0), index)``, and gives stream
``k`` the bits ``rotl(r, 11 * k)``: the weight rounds with the low 16 bits of ``r``, ``exp_avg`` with those of
``rotl(r, 11)``, ``exp_avg_sq`` with those of ``rotl(r, 22)`` (a rotation of uniform bits is uniform, so each rounding
stays unbiased; the roundings of one element become dependent).

Only the reference backend is patched (:func:`one_draw`); ``python -m bench.align --modes --sr-draws one`` trains
every mode on it, so the study measures the specification's effect on the loss before any kernel changes.
"""
from __future__ import annotations

import contextlib

import torch

from ampfused.ops import reference
from ampfused.ops import state_precision as sp

ROTATION = 11  # bits between the streams' rotations of the one draw


def _rotl32(x: torch.Tensor, k: int) -> torch.Tensor:
    """Rotate the 32-bit values of an int64 tensor left by ``k``."""
    k %= 32
    if k == 0:
        return x
    return ((x << k) | (x >> (32 - k))) & sp.M32


def _one_draw_rand(self, stream: int, t: torch.Tensor, sl: slice, n: int) -> torch.Tensor:
    key = sp.stream_key(self.seed.to(t.device), t.to(torch.int64), sp.STREAM_WEIGHT)
    r = sp.random_bits(key, torch.arange(sl.start, sl.start + n, dtype=torch.int64, device=t.device))
    return _rotl32(r, ROTATION * (stream - sp.STREAM_WEIGHT))


@contextlib.contextmanager
def one_draw():
    """The reference backend's draws follow the one-draw proposal inside the block."""
    today = reference._Compact._rand
    reference._Compact._rand = _one_draw_rand
    try:
        yield
    finally:
        reference._Compact._rand = today
