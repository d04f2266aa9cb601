"""What every step of the specification shares, whatever its optimizer: the prologue (the partials reduced to
the norm and the skip flag, the clip coefficient), the layout of the flat state buffers and the memory order the
steps walk, the correctly rounded square root, the loads and stores of compact state, and the write that a
skipped step leaves undone. :mod:`ampfused.ops.reference` and the other reference modules build
their steps from these; the conventions are those of :mod:`ampfused.ops.reference`.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import state_precision as sp

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds this to the norm
STATE_ALIGN = 4  # elements of fp32 state between parameter starts in a flat state buffer (16 bytes)


def sqrt_rn(x: Tensor) -> Tensor:
    """The square root correctly rounded, as every backend's kernels take it: an fp32 one through fp64 (whose
    square root, within an ulp of fp64, rounds to the correctly rounded fp32 one). torch's own fp32 sqrt on the
    CPU is not always correctly rounded (an ulp off at about 0.6% of inputs, torch 2.13 with AVX-512)."""
    return x.double().sqrt().float() if x.dtype == torch.float32 else x.sqrt()


def reduce_partials(partials: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm, found_inf)``: sqrt of the summed squares, and 1.0 if any flag is set (both 0-d fp32)."""
    norm = sqrt_rn(partials[0].sum())
    found_inf = (partials[1].amax() > 0).float() if partials.shape[1] else partials.new_zeros(())
    return norm, found_inf


def clip_coef(norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` as in ``clip_grad_norm_``; exactly 1 when ``max_norm`` is inf."""
    if math.isinf(max_norm):
        return torch.ones_like(norm)
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


def _prologue(partials: Tensor, inv_scale: Tensor, max_norm: float, out_stats: Tensor,
              compute_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Reduce partials, record ``[norm, found_inf]`` in ``out_stats``; return ``(coef, skip)`` (0-d)."""
    norm, found_inf = reduce_partials(partials)
    out_stats[0] = norm
    out_stats[1] = found_inf
    coef = inv_scale.to(compute_dtype) * clip_coef(norm.to(compute_dtype), max_norm)
    return coef, found_inf > 0


def state_layout(numels: Sequence[int], align: int = STATE_ALIGN) -> Tuple[List[int], int]:
    """Where each parameter's optimizer state lives in a flat state buffer: ``(offsets, total)``.

    Parameter ``i`` (``numels[i]`` elements) owns ``[offsets[i], offsets[i] + numels[i])``; each offset is a
    multiple of ``align`` elements (``STATE_ALIGN``: 16 bytes of fp32, so vector loads stay aligned; 8-bit
    moments: ``state_precision.QBLOCK``, so a block of codes never holds two parameters) and ``total`` ends
    right after the last parameter. The gaps between parameters are never read or written by the steps.
    """
    offsets: List[int] = []
    total = 0
    for n in numels:
        off = -(-total // align) * align
        offsets.append(off)
        total = off + int(n)
    return offsets, total


def memory_view(t: Tensor) -> Tensor:
    """1-D view of a dense tensor's elements in memory order (``t`` contiguous in any dimension order:
    row-major, ``channels_last``, a transpose). This is the order every step walks a parameter, its gradient
    and its slice of the flat state buffers in."""
    return t.as_strided((t.numel(),), (1,))


def to_logical(piece: Tensor, like: Tensor) -> Tensor:
    """A flat piece (elements in ``like``'s memory order) as a tensor of ``like``'s shape."""
    x = torch.empty_like(like, dtype=piece.dtype)
    memory_view(x).copy_(piece)
    return x


def from_logical_(piece: Tensor, x: Tensor, like: Tensor) -> None:
    """``x`` (``like``'s shape) written into its flat piece in ``like``'s memory order."""
    o = torch.empty_like(like, dtype=piece.dtype)
    o.copy_(x)
    piece.copy_(memory_view(o))


def _compute_dtype(params: List[Tensor], master: Optional[Tensor]) -> torch.dtype:
    if master is not None:
        return master.dtype
    return params[0].dtype if params else torch.float32


class _Compact:
    """How one step loads and stores its weights and moments: the state precision of its buffers
    (:mod:`ampfused.ops.state_precision`). In the fp32 format every method is the plain load or store."""

    def __init__(self, params, master, states, seed, state_scales=None):
        self.fmt = sp.step_format(params, master, states, seed, state_scales)
        self.seed = seed
        self.master = master
        self.scales = state_scales
        self.align = sp.layout_align(self.fmt)
        self._names = [n for n, t in states if t is not None]
        if self.fmt.master != sp.MASTER_FP32:
            self.cd = torch.float32
        else:
            self.cd = _compute_dtype(params, master)

    def load_weight(self, pm: Tensor, w: Tensor) -> Tensor:
        """The compute copy of a parameter: its master, rebuilt from weight and remainder, or the weight."""
        if self.fmt.master == sp.MASTER_REMAINDER:
            return sp.join_master(pm, w)
        return w.to(self.cd)

    def _rand(self, stream: int, t: Tensor, sl: slice, n: int) -> Tensor:
        """The bits ``stream`` rounds with: the elements' one draw, rotated for the stream."""
        key = sp.step_key(self.seed.to(t.device), t.to(torch.int64))
        r = sp.random_bits(key, torch.arange(sl.start, sl.start + n, dtype=torch.int64, device=t.device))
        return sp.stream_bits(r, stream)

    def weight_pairs(self, pm: Tensor, w: Tensor, w_new: Tensor, t: Tensor, sl: slice) -> list:
        """``(tensor, new value)`` for the parameter and its master (or remainder) after the update."""
        if self.fmt.master == sp.MASTER_REMAINDER:
            weight, rem = sp.split_master(w_new)
            return [(pm, weight), (w, rem)]
        if self.fmt.master == sp.MASTER_NONE:
            return [(pm, sp.round_stochastic(w_new, self._rand(sp.STREAM_WEIGHT, t, sl, pm.numel())))]
        if self.master is not None:
            return [(w, w_new), (pm, w_new.to(pm.dtype))]
        return [(w, w_new)]

    def _blocks(self, sl: slice) -> slice:
        """A parameter's blocks of 8-bit codes (its slice starts at a multiple of QBLOCK)."""
        first = sl.start // sp.QBLOCK
        return slice(first, first + sp.q8_blocks(sl.stop - sl.start))

    def load_state(self, s: Tensor, row: int, sl: slice) -> Tensor:
        """A moment's compute copy: 8-bit codes decoded with their blocks' scales (row ``row`` of
        ``state_scales``), other formats converted exactly."""
        if self.fmt.state_dtype == torch.uint8:
            return sp.q8_dequantize(s, self.scales[row, self._blocks(sl)], sp.q8_signed(self._names[row]))
        return s.to(self.cd)

    def state_pairs(self, s: Tensor, s_new: Tensor, row: int, t: Tensor, sl: slice) -> list:
        """``(tensor, new value)`` for a moment (row ``row`` of the step's moments, stream ``row + 1``): bf16
        moments stored with stochastic rounding; 8-bit ones as codes (stochastic rounding) and their blocks'
        new scales."""
        stream = sp.STREAM_STATE1 + row
        if self.fmt.state_dtype == torch.bfloat16:
            return [(s, sp.round_stochastic(s_new, self._rand(stream, t, sl, s.numel())))]
        if self.fmt.state_dtype == torch.uint8:
            codes, scales = sp.q8_quantize(s_new, sp.q8_signed(self._names[row]),
                                           self._rand(stream, t, sl, s.numel()))
            return [(s, codes), (self.scales[row, self._blocks(sl)], scales)]
        return [(s, s_new)]


def _commit(skip: Tensor, pairs) -> None:
    """Write each new value over its tensor unless the step is skipped (no host read)."""
    for dst, new in pairs:
        dst.copy_(torch.where(skip, dst, new))
