"""Plain-torch implementation of every ampfused op: the specification.

Each function here is written to be read. Fast backends (Triton, CPU, CUDA) must produce the same results
within the tolerance rule of the design (2x the error of the fp32 reference against an fp64 computation,
with a small absolute floor), and bitwise-identical results run to run.

Conventions shared by every backend
-----------------------------------
* The step ops take the parameters and their gradients where they live (``params``, ``grads``: lists of
  dense tensors, read and written in memory order, so ``channels_last`` and transposed parameters keep
  their layout) and the optimizer's own state in flat 1-D buffers laid out by :func:`state_layout`.
  ``params`` are fp32, bf16 or fp16; ``master`` is the fp32 master copy, or ``None`` when the parameters
  themselves are the compute-precision copy. Optimizer states (``exp_avg``, ``exp_avg_sq``,
  ``momentum_buf``) have the compute dtype: ``master.dtype`` when a master exists, else the parameters'
  dtype. The reference also accepts fp64 here, which is how tests build the fp64 oracle. ``steps`` holds
  one step count per parameter, as ``torch.optim`` keeps one per parameter; a parameter whose gradient is
  ``None`` is skipped as ``torch.optim`` skips it.
* ``partials`` is an fp32 tensor of shape ``[2, P]``: row 0 holds partial sums of squares of the unscaled
  gradients, row 1 holds non-finite flags (1.0 where a non-finite element was seen, else 0.0). Any ``[2, P]``
  tensor is valid input to the update ops, so a caller holding an already reduced norm and flag (after an
  all-reduce, or from ``unscale_``) passes ``[[norm_sq], [found_inf]]``. ``P`` is backend-specific and given
  by ``num_partials``; the reference uses one partial per gradient tensor.
* ``inv_scale`` and ``lr`` are 0-d fp32 device tensors (``steps`` a 1-D one), so nothing is read to the host and
  changing them never recompiles a kernel. ``inv_scale`` may also hold ``1 / (scale * grad_divisor)``.
* A step whose gradients hold a non-finite value changes nothing (params, master, states, steps) and reports
  ``found_inf = 1`` in ``out_stats``.
* ``max_norm = inf`` means no clipping; clipping follows ``torch.nn.utils.clip_grad_norm_``:
  ``coef = min(1, max_norm / (norm + 1e-6))``.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from .._floats import fp32
from .reference_common import (STATE_ALIGN, _Compact, _commit, _prologue, check_health, clip_coef,  # noqa: F401
                               memory_view, moved, reduce_partials, sqrt_rn, state_layout)


def num_partials(numels: List[int]) -> int:
    """Number of columns of the ``partials`` tensor produced for gradient buffers of these sizes."""
    return len(numels)


def _compute(g: Tensor) -> Tensor:
    # fp64 gradients stay fp64 (as in torch's unscale kernel); everything narrower is computed in fp32
    return g.to(torch.promote_types(g.dtype, torch.float32))


def _sumsq_and_flag(g: Tensor, inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    u = _compute(g) * inv_scale
    finite = torch.isfinite(g).all()
    return (u * u).sum(), (~finite).float()


def norm_check(grads: List[Tensor], inv_scale: Tensor) -> Tensor:
    """Per-tensor sum of squares of ``g * inv_scale`` (fp32) and per-tensor non-finite flags.

    grads: list of tensors (any shape, fp32/bf16/fp16), not modified. inv_scale: 0-d fp32.
    Returns partials ``[2, len(grads)]`` fp32. The non-finite test is per element: a finite gradient whose
    square overflows fp32 gives an infinite norm but no flag.
    """
    out = torch.zeros(2, len(grads), dtype=torch.float32, device=inv_scale.device)
    for i, g in enumerate(grads):
        s, f = _sumsq_and_flag(g, inv_scale)
        out[0, i] = s
        out[1, i] = f
    return out


def unscale_(grads: List[Tensor], inv_scale: Tensor) -> Tensor:
    """In place ``g = round_to_dtype(fp32(g) * inv_scale)``; returns partials of the unscaled values.

    Matches ``torch._amp_foreach_non_finite_check_and_unscale_`` for fp32 gradients bit for bit (one fp32
    multiply) and extends it to bf16/fp16 gradients (multiply in fp32, round to nearest even). Gradients
    holding infs or NaNs are still multiplied, as torch does; the flag tells the step to skip.
    """
    out = torch.zeros(2, len(grads), dtype=torch.float32, device=inv_scale.device)
    for i, g in enumerate(grads):
        f = (~torch.isfinite(g).all()).float()
        u = _compute(g) * inv_scale
        g.copy_(u)
        out[0, i] = (u * u).sum()
        out[1, i] = f
    return out


def update_scale_(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                  backoff_factor: float, growth_interval: int, inv_scale: Optional[Tensor] = None,
                  skipped: Optional[Tensor] = None) -> None:
    """torch's dynamic loss-scale rule, bit for bit (``torch._amp_update_scale_``), without a host read.

    scale: 0-d fp32; growth_tracker: 0-d int32; found_inf: 0-d fp32 (> 0 means overflow). In place:
    on overflow ``scale *= backoff_factor`` and the tracker resets; otherwise the tracker counts up and, when
    it reaches ``growth_interval``, ``scale *= growth_factor`` (only while the result stays finite) and the
    tracker resets. Products are formed in fp64 and rounded once to fp32, as torch's kernels do.

    Optional bookkeeping in the same op (so a scaler's iteration needs no other kernel): ``inv_scale``
    (0-d fp32) receives ``fp32(1 / fp64(new scale))``, and ``skipped`` (0-d int64) counts the overflows.
    """
    overflow = found_inf > 0
    successful = growth_tracker + 1
    grow = (~overflow) & (successful == growth_interval)
    grown = (scale.double() * growth_factor).float()
    backed_off = (scale.double() * backoff_factor).float()
    new_scale = torch.where(overflow, backed_off,
                            torch.where(grow & torch.isfinite(grown), grown, scale))
    new_tracker = torch.where(overflow | grow, torch.zeros_like(successful), successful)
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    if inv_scale is not None:  # what the next unscale multiplies by, as torch forms it: fp32(1 / fp64(scale))
        inv_scale.copy_(scale.double().reciprocal().float())
    if skipped is not None:  # a count of the updates whose iteration overflowed
        skipped.add_(overflow.to(skipped.dtype))


# exp(x) - 1 in fp32 from IEEE operations only, each rounded as written (no fma), so every backend computes it bit
# for bit alike, where a math library's expm1 or exp differs by device in its last bits: x P(x) for -0.5 <= x,
# with P(x) = 1 + x/2! + ... + x^8/9! (the first omitted term is below 3e-10 of it), and exp(r) = 1 + r P(r)
# after the reduction x = k ln2 + r, |r| <= ln2/2. Within 2 ulp of expm1 (tests/test_state_precision_ops.py).
EXPM1_SERIES = (1 / 362880, 1 / 40320, 1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0)
LOG2E, LN2_HI, LN2_LO = 1.4426950408889634, 0.693359375, -2.12194440e-4  # ln2 = LN2_HI + LN2_LO, k * LN2_HI exact


def expm1_series(x: Tensor) -> Tensor:
    """``P(x) = 1 + x/2! + ... + x^8/9!`` by Horner's rule, highest term first (``exp(x) - 1 = x P(x)``)."""
    p = torch.full_like(x, EXPM1_SERIES[0])
    for c in EXPM1_SERIES[1:]:
        p = p * x + c
    return p


def expm1_nonpositive(x: Tensor) -> Tensor:
    """``exp(x) - 1`` for fp32 ``x <= 0`` (-inf gives -1), the same bits on every backend (see above)."""
    small = expm1_series(x) * x
    xe = x.clamp(-24.0, -0.5)  # below -24, exp(x) < 2^-34 and exp(x) - 1 rounds to -1
    k = torch.floor(xe * LOG2E + 0.5)
    r = (xe - k * LN2_HI) - k * LN2_LO
    two_k = ((k.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^k, exact
    big = (1.0 + r * expm1_series(r)) * two_k - 1.0
    return torch.where(x >= -0.5, small, torch.where(x >= -24.0, big, torch.full_like(x, -1.0)))


def log_beta(beta: float) -> float:
    """``log(beta)`` for the bias corrections, on the host (fp64, then fp32 where used); ``beta = 0``, valid
    in torch's Adam, gives -inf and a correction of 1."""
    return math.log(beta) if beta > 0 else -math.inf


def bias_correction(beta: float, step: Tensor) -> Tensor:
    """``1 - beta**step`` in fp32 as ``-expm1(step * log(beta))``, so small steps keep their precision;
    ``step`` fp32, ``log(beta)`` rounded to fp32, their product rounded, then :func:`expm1_nonpositive`."""
    return -expm1_nonpositive(step * fp32(log_beta(beta)))  # (a Python scalar: no tensor to copy to the device)


def lerp(start: Tensor, end: Tensor, weight: float) -> Tensor:
    """``torch.lerp(start, end, weight)`` as every backend computes it: the weight rounded to fp32, torch's two
    forms by its size (``1 - w`` is then exact), each operation rounded as written (torch.lerp itself fuses
    into an fma where its kernel has one)."""
    w = fp32(weight)
    return start + w * (end - start) if abs(w) < 0.5 else end - (end - start) * (1 - w)


def _tensors_to_update(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
                       align: int = STATE_ALIGN):
    """``(i, param in memory order, grad in memory order, compute copy, state slice)`` per parameter with a
    gradient, in order."""
    offsets, _ = state_layout([p.numel() for p in params], align)
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        sl = slice(offsets[i], offsets[i] + p.numel())
        pm = memory_view(p)
        yield i, pm, memory_view(g), (master[sl] if master is not None else pm), sl


def adam_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor], exp_avg: Tensor,
               exp_avg_sq: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor,
               beta1: float, beta2: float, eps: float, weight_decay: float, max_norm: float,
               decoupled: bool, maximize: bool = False, seed: Optional[Tensor] = None,
               state_scales: Optional[Tensor] = None, health: Optional[Tensor] = None) -> None:
    """One Adam (``decoupled=False``, L2 decay) or AdamW (``decoupled=True``) step over a list of parameters.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` and, for each parameter ``i`` that has a
    gradient, ``w`` its master (or the parameter itself), ``m``, ``v`` its state slices and
    ``t = steps[i] + 1``::

        g = c * grad                      (in the compute dtype; negated if maximize)
        AdamW: w = w * (1 - lr * weight_decay)      Adam: g = g + weight_decay * w
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        s = sqrt(1 - beta2**t)
        w = w - (lr / (1 - beta1**t) * s) * m / (sqrt(v) + eps * s)
        param = round_to_nearest_even(w)  (when a master exists)
        steps[i] = t

    The update is torch's ``(lr / bc1) * m / (sqrt(v) / s + eps)`` with numerator and denominator multiplied by
    ``s`` (the same value, one division per element instead of two; the step is bound by its divisions on a
    CPU). Each operation is rounded as written (no fused multiply-add; torch's two forms of lerp by the weight's
    size), square roots are correctly rounded (:func:`sqrt_rn`), and ``1 - beta**t`` is
    :func:`bias_correction` (fp32, from IEEE operations alone): every backend computes these same bits.

    Tensors: ``params`` T dense tensors of one dtype on one device; ``grads`` T entries, each ``None`` (that
    parameter is left alone: no decay, no state change, its step count stays) or a tensor with its
    parameter's dtype, shape and strides. ``master``, ``exp_avg``, ``exp_avg_sq`` are 1-D flat buffers laid
    out by :func:`state_layout` (element ``j`` of parameter ``i`` in memory order sits at ``offsets[i] + j``).
    ``steps`` is ``[T]`` fp32; ``lr``, ``inv_scale`` 0-d fp32; ``out_stats`` ``[2]`` fp32 receiving
    ``[norm, found_inf]``. Nothing else changes when found_inf.

    Compact state (:mod:`ampfused.ops.state_precision`, read from the buffers' dtypes): ``master`` int16 holds
    the master remainders of bf16 params (``w = join_master(param, master)`` before, ``param, master =
    split_master(w)`` after); ``master=None`` with bf16 params and a ``seed`` (0-d int64) updates the weights
    in fp32 and stores them with ``round_stochastic`` (stream 0); bf16 ``exp_avg``/``exp_avg_sq`` are loaded
    exactly and stored with ``round_stochastic`` (streams 1, 2). Each element draws once, keyed by (seed, t,
    its index in the flat buffers), and each stream rounds with its rotation of the draw (``stream_bits``). The
    math in between is the fp32 step above. uint8 ``exp_avg`` / ``exp_avg_sq`` are 8-bit moments (``state_precision.q8_encode``): parameters start at multiples of
    ``QBLOCK`` in the flat buffers (``state_layout(numels, QBLOCK)``), ``state_scales`` (``[2, blocks]`` fp32)
    holds each block's scale; a moment is decoded with its blocks' scales, and stored as the codes of its new
    value (stochastic rounding, streams 1, 2) with each block's new scale, taken from the block's largest new
    value.

    ``health`` (fp64 ``[5]``, optional): receives the step's training-health sums
    (:class:`~ampfused.ops.reference_common.HealthSums`; the update ``w * (1 - lr * weight_decay) - term``).
    """
    check_health(health, inv_scale)
    cx = _Compact(params, master, [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)], seed, state_scales, health,
                  inv_scale)
    cd = cx.cd
    coef, skip = _prologue(partials, inv_scale, max_norm, out_stats, cd)
    cx.start(skip)
    lr_c = lr.to(cd)
    for i, pm, gm, w_buf, sl in _tensors_to_update(params, grads, master, cx.align):
        cx.gradient(gm)
        m_buf, v_buf = exp_avg[sl], exp_avg_sq[sl]
        w, m, v = cx.load_weight(pm, w_buf), cx.load_state(m_buf, 0, sl), cx.load_state(v_buf, 1, sl)
        g = gm.to(cd) * coef
        if maximize:
            g = -g
        t = steps[i].to(cd) + 1
        w_new, decaying = w, None
        if weight_decay != 0:
            if decoupled:
                decaying = lr_c
                w_new = w * (1 - lr_c * weight_decay)
            else:
                g = g + weight_decay * w
        m_new = lerp(m, g, 1 - beta1)
        v_new = v * beta2 + (1 - beta2) * g * g
        # m_hat / (sqrt(v_hat) + eps), numerator and denominator times sqrt(1 - beta2**t): one division each
        bc2_sqrt = sqrt_rn(bias_correction(beta2, t))
        step_size = lr_c / bias_correction(beta1, t) * bc2_sqrt
        denom = sqrt_rn(v_new) + eps * bc2_sqrt
        term = step_size * m_new / denom
        w_new = w_new - term
        _commit(skip, cx.state_pairs(m_buf, m_new, 0, t, sl) + cx.state_pairs(v_buf, v_new, 1, t, sl)
                + cx.weight_pairs(pm, w_buf, w_new, t, sl, lambda w0: moved(w0, decaying, term)))
        steps[i] += (~skip).to(steps.dtype)


def adamw_step_(params, grads, master, exp_avg, exp_avg_sq, steps, partials, inv_scale, lr, out_stats,
                beta1, beta2, eps, weight_decay, max_norm, maximize=False, seed=None, state_scales=None,
                health=None) -> None:
    """AdamW (decoupled weight decay); see :func:`adam_step_`."""
    adam_step_(params, grads, master, exp_avg, exp_avg_sq, steps, partials, inv_scale, lr, out_stats,
               beta1, beta2, eps, weight_decay, max_norm, True, maximize, seed, state_scales, health)


def sgd_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
              momentum_buf: Optional[Tensor], steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
              out_stats: Tensor, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
              max_norm: float, maximize: bool = False, seed: Optional[Tensor] = None,
              state_scales: Optional[Tensor] = None, health: Optional[Tensor] = None) -> None:
    """One SGD step with torch's semantics over a list of parameters (layout as :func:`adam_step_`).

    For each parameter ``i`` with a gradient::

        g = c * grad  (negated if maximize);  g = g + weight_decay * w
        if momentum: b = g on the parameter's first step (steps[i] == 0), else b = momentum * b + (1 - dampening) * g
                     g = g + momentum * b if nesterov else b
        w = w - lr * g;  param = round(w);  steps[i] = steps[i] + 1

    ``momentum_buf`` is required (a flat buffer like the master) when ``momentum != 0``, else ignored.
    Compact state as :func:`adam_step_` (a bf16 or uint8 ``momentum_buf`` is stored with stream 1, its 8-bit
    codes signed, its block scales in ``state_scales[0]``); ``t = steps[i] + 1`` keys the draws. ``health`` as
    :func:`adam_step_` (the update ``w - lr * g``).
    """
    check_health(health, inv_scale)
    cx = _Compact(params, master, [("momentum_buf", momentum_buf if momentum != 0 else None)], seed, state_scales,
                  health, inv_scale)
    cd = cx.cd
    coef, skip = _prologue(partials, inv_scale, max_norm, out_stats, cd)
    cx.start(skip)
    lr_c = lr.to(cd)
    for i, pm, gm, w_buf, sl in _tensors_to_update(params, grads, master, cx.align):
        cx.gradient(gm)
        w = cx.load_weight(pm, w_buf)
        t = steps[i].to(cd) + 1
        g = gm.to(cd) * coef
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g + weight_decay * w
        pairs = []
        if momentum != 0:
            b_buf = momentum_buf[sl]
            b_new = torch.where(steps[i] == 0, g, cx.load_state(b_buf, 0, sl) * momentum + (1 - dampening) * g)
            pairs += cx.state_pairs(b_buf, b_new, 0, t, sl)
            g = g + momentum * b_new if nesterov else b_new
        term = lr_c * g
        w_new = w - term
        _commit(skip, pairs + cx.weight_pairs(pm, w_buf, w_new, t, sl, lambda w0: moved(w0, None, term)))
        steps[i] += (~skip).to(steps.dtype)


def lion_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor], exp_avg: Tensor,
               steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta1: float,
               beta2: float, weight_decay: float, max_norm: float, maximize: bool = False,
               seed: Optional[Tensor] = None, state_scales: Optional[Tensor] = None,
               health: Optional[Tensor] = None) -> None:
    """One Lion step (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") over a list of
    parameters (layout as :func:`adam_step_`). For each parameter ``i`` with a gradient, ``w`` its master (or
    the parameter itself), ``m`` its ``exp_avg`` slice::

        g = c * grad                      (in the compute dtype; negated if maximize)
        u = sign(lerp(m, g, 1 - beta1))   (sign(0) = 0; sign(NaN) = 0, as torch.sign on the CPU)
        w = w * (1 - lr * weight_decay) - lr * u
        m = lerp(m, g, 1 - beta2)
        param = round_to_nearest_even(w)  (when a master exists);  steps[i] = steps[i] + 1

    The decay is decoupled and applied first, as optimi's ``Lion`` applies it (``param *= 1 - lr * wd``, then
    ``param -= lr * u``); here ``1 - lr * weight_decay`` is formed in fp32 from the fp32 ``lr``. ``lerp`` is
    :func:`lerp` (torch's two forms, no fused multiply-add). ``steps`` is not in the math: it keys the
    stochastic rounding's draws (``t = steps[i] + 1``). Compact state as :func:`adam_step_` with one moment:
    a bf16 or uint8 ``exp_avg`` is stored with stream 1, its 8-bit codes signed, its block scales in
    ``state_scales[0]`` (``[1, blocks]``). ``health`` as :func:`adam_step_` (the update
    ``w * (1 - lr * weight_decay) - lr * u``).
    """
    check_health(health, inv_scale)
    cx = _Compact(params, master, [("exp_avg", exp_avg)], seed, state_scales, health, inv_scale)
    cd = cx.cd
    coef, skip = _prologue(partials, inv_scale, max_norm, out_stats, cd)
    cx.start(skip)
    lr_c = lr.to(cd)
    decay = 1 - lr_c * weight_decay if weight_decay != 0 else None
    decaying = lr_c if weight_decay != 0 else None
    for i, pm, gm, w_buf, sl in _tensors_to_update(params, grads, master, cx.align):
        cx.gradient(gm)
        m_buf = exp_avg[sl]
        w, m = cx.load_weight(pm, w_buf), cx.load_state(m_buf, 0, sl)
        g = gm.to(cd) * coef
        if maximize:
            g = -g
        t = steps[i].to(cd) + 1
        c = lerp(m, g, 1 - beta1)
        u = (c > 0).to(cd) - (c < 0).to(cd)
        term = lr_c * u
        w_new = (w * decay if decay is not None else w) - term
        m_new = lerp(m, g, 1 - beta2)
        _commit(skip, cx.state_pairs(m_buf, m_new, 0, t, sl)
                + cx.weight_pairs(pm, w_buf, w_new, t, sl, lambda w0: moved(w0, decaying, term)))
        steps[i] += (~skip).to(steps.dtype)
