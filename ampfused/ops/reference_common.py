"""What every step of the specification shares, whatever its optimizer: the prologue (the partials reduced to
the norm and the skip flag, the clip coefficient), the layout of the flat state buffers and the memory order the
steps walk, the correctly rounded square root, the loads and stores of compact state, and the write that a
skipped step leaves undone. :mod:`ampfused.ops.reference` and the other reference modules build
their steps from these; the conventions are those of :mod:`ampfused.ops.reference`.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

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


HEALTH_FIELDS = ("grad_sq", "update_sq", "weight_sq", "stagnant", "nonfinite")


def check_health(health: Optional[Tensor], inv_scale: Tensor) -> None:
    """``health``: None, or the fp64 ``[5]`` tensor (on ``inv_scale``'s device) a step writes its sums to."""
    if health is None:
        return
    if not isinstance(health, Tensor) or health.dtype != torch.float64 or tuple(health.shape) != (5,) \
            or health.device != inv_scale.device:
        what = f"{health.dtype} of shape {tuple(health.shape)} on {health.device}" if isinstance(health, Tensor) \
            else type(health).__name__
        raise ValueError(f"health must be an fp64 tensor of shape [5] on {inv_scale.device} (the sums "
                         f"{', '.join(HEALTH_FIELDS)}), got {what}")


class HealthSums:
    """What a step call sums for the training-health numbers (``docs/api.md``, "Training health"), written to
    ``out`` (fp64 ``[5]``, in the order of ``HEALTH_FIELDS``) over the parameters that have a gradient:

    * ``grad_sq``: ``sum(u * u)`` with ``u = fp32(grad) * inv_scale`` (the unscaled gradient before any clip);
    * ``update_sq``: ``sum(d * d)`` with ``d = after - before`` in the compute dtype, where ``before`` and
      ``after`` are the stored weight (the master where there is one, rebuilt from weight and remainder with
      remainders, else the parameter) as the step found it and left it; 0 on a skipped step;
    * ``weight_sq``: ``sum(after * after)`` (``before`` on a skipped step);
    * ``stagnant``: elements with ``after == before`` whose update was not zero (``moved``: a term of the
      update, decay included, was not zero); 0 on a skipped step;
    * ``nonfinite``: gradient elements that are inf or NaN.

    Each element's square is formed in fp64 and the sums are fp64 (the fast backends sum fp32 squares per block,
    within the tolerance rule)."""

    def __init__(self, out: Tensor, inv_scale: Tensor):
        self.out = out
        self.inv_scale = inv_scale
        self.skip: Optional[Tensor] = None
        out.zero_()

    def gradient(self, g: Tensor) -> None:
        """A gradient the step reads (in any order of its elements)."""
        u = g.to(torch.promote_types(g.dtype, torch.float32)) * self.inv_scale
        self.out[0] += u.double().square().sum()
        self.out[4] += (~torch.isfinite(g)).sum()

    def weight(self, before: Tensor, after: Tensor, moved: Tensor) -> None:
        """A parameter's stored weight before and after the update (compute dtype), and where its update was
        not zero."""
        skip = self.skip
        b = before.double()
        d = (after - before).double()
        self.out[1] += torch.where(skip, 0.0, d.square().sum())
        self.out[2] += torch.where(skip, b.square().sum(), after.double().square().sum())
        self.out[3] += torch.where(skip, 0, ((after == before) & moved).sum())


def moved(w: Tensor, decay_lr: Optional[Tensor], term: Tensor) -> Tensor:
    """Where the update ``w * (1 - lr * weight_decay) - term`` is not zero (``decay_lr``: the lr, when the step
    decays; None: no decay): its term is not zero, or the weight is not zero and decays by a rate other than 0
    (whether or not ``1 - lr * weight_decay`` rounds to 1)."""
    out = term != 0
    if decay_lr is not None:
        out = out | ((decay_lr != 0) & (w != 0))
    return out


class _Compact:
    """How one step loads and stores its weights and moments: the state precision of its buffers
    (:mod:`ampfused.ops.state_precision`). In the fp32 format every method is the plain load or store.
    ``health``: the step's :class:`HealthSums` output (None: no sums), recorded by :meth:`gradient` and
    :meth:`weight_pairs`."""

    def __init__(self, params, master, states, seed, state_scales=None, health: Optional[Tensor] = None,
                 inv_scale: Optional[Tensor] = None):
        self.fmt = sp.step_format(params, master, states, seed, state_scales)
        self.seed = seed
        self.master = master
        self.scales = state_scales
        self.health = HealthSums(health, inv_scale) if health is not None else None
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

    def start(self, skip: Tensor) -> None:
        """The step's skip flag (after its prologue), for the health sums."""
        if self.health is not None:
            self.health.skip = skip

    def gradient(self, g: Tensor) -> None:
        """A gradient the step reads, for the health sums."""
        if self.health is not None:
            self.health.gradient(g)

    def weight_pairs(self, pm: Tensor, w: Tensor, w_new: Tensor, t: Tensor, sl: slice,
                     moved: Optional[Callable[[Tensor], Tensor]] = None) -> list:
        """``(tensor, new value)`` for the parameter and its master (or remainder) after the update. ``moved``
        (needed with health sums): a function of the compute copy before the update giving where the update
        is not zero (:func:`moved`)."""
        if self.fmt.master == sp.MASTER_REMAINDER:
            weight, rem = sp.split_master(w_new)
            pairs = [(pm, weight), (w, rem)]
            stored = lambda: sp.join_master(weight, rem)
        elif self.fmt.master == sp.MASTER_NONE:
            rounded = sp.round_stochastic(w_new, self._rand(sp.STREAM_WEIGHT, t, sl, pm.numel()))
            pairs = [(pm, rounded)]
            stored = lambda: rounded.to(self.cd)
        elif self.master is not None:
            pairs = [(w, w_new), (pm, w_new.to(pm.dtype))]
            stored = lambda: w_new
        else:
            pairs = [(w, w_new)]
            stored = lambda: w_new.to(w.dtype).to(self.cd)
        if self.health is not None:
            before = self.load_weight(pm, w)
            self.health.weight(before, stored(), moved(before))
        return pairs

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
