"""Adafactor's step in plain torch: the specification of ``adafactor_step_`` (``torch.optim.Adafactor``'s math).

Conventions are :mod:`ampfused.ops.reference`'s (parameters and gradients where they live, ``partials``,
``inv_scale``, ``lr`` and ``steps`` on the device, ``out_stats``, a skip that writes nothing), except that the
optimizer's state is not shaped like the parameters: a parameter of two or more dimensions keeps a row and a
column vector (factored second moment), any other keeps a vector shaped like itself. :func:`factor_layout`
places them in one flat fp32 buffer, ``factors``.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from .._floats import fp32
from .factored import (SPLIT_ROWS, ShardSums, factor_dims, factor_layout, factor_size, factor_views,  # noqa: F401
                       factored, shard_sums)
from .reference_common import _Compact, _commit, _prologue, check_health, memory_view, moved, sqrt_rn, state_layout

EPS1_DEFAULT = float(torch.finfo(torch.float32).eps)  # eps=(None, ...): the eps of the dtype the math runs in


# the public function's documentation (ampfused.ops.adafactor_step_, made from its record in specs.py)
DOC = """Fused ``torch.optim.Adafactor`` step over parameters where they live (math:
    :func:`ampfused.ops.reference_adafactor.adafactor_step_`).

    params: T dense tensors of one dtype (any memory layout), updated in place; grads: T entries (``None``
    leaves a parameter alone), each with its parameter's shape and layout; master: fp32 flat buffer laid out by
    ``state_layout([p.numel() ...])`` (or int16 remainders, or ``None`` for fp32 params or with ``seed`` for
    stochastic rounding of bf16 params); factors: fp32 flat buffer of ``factor_layout([p.shape ...])[1]``
    elements (each matrix's row then column vectors, each other parameter's variance); steps ``[T]`` fp32;
    partials ``[2, P]``; inv_scale, lr 0-d fp32; out_stats ``[2]`` fp32 (``[norm, found_inf]``);
    ``eps=(epsilon1 or None, epsilon2)`` as torch.optim.Adafactor takes it.
    """


def check_rules(params, hyper: dict) -> None:
    """``adafactor_step_``'s own input rules (torch.optim.Adafactor's, with its messages), after the rules every
    step shares."""
    for p in params:
        if p.is_complex():
            raise RuntimeError("Adafactor does not support complex parameters")
    if not hyper["beta2_decay"] <= 0.0:
        raise ValueError(f"beta2_decay should be <= 0 but is: {hyper['beta2_decay']}")
    if hyper["eps1"] is not None and not 0.0 <= hyper["eps1"]:
        raise ValueError(f"epsilon1 should be >= 0 but is: {hyper['eps1']}")
    if not 0.0 <= hyper["eps2"]:
        raise ValueError(f"epsilon2 should be >= 0 but is: {hyper['eps2']}")
    if not 1.0 <= hyper["d"]:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {hyper['d']}")


def _max(a: Tensor, floor: float) -> Tensor:
    """Python's ``max(floor, a)``: ``floor`` unless ``a`` is greater (a NaN gives ``floor``, as torch's loop)."""
    return torch.where(a > floor, a, torch.full_like(a, floor))


def _lerp(v: Tensor, target: Tensor, w: Tensor) -> Tensor:
    """``torch.lerp(v, target, w)`` with each operation rounded as written: its two forms by ``w``'s size."""
    return torch.where(w.abs() < 0.5, v + w * (target - v), target - (target - v) * (1 - w))


def step_scalars(t: Tensor, lr: Tensor, beta2_decay: float, weight_decay: float, cd: torch.dtype) -> tuple:
    """Per-parameter scalars of step ``t`` (fp32 count), formed in fp64 as torch forms them from Python floats,
    each rounded once to the compute dtype ``cd`` where the elements use it: ``(w2, rho, decay)`` with
    ``w2 = t**beta2_decay`` (the lerp weight of the second moment, ``1 - beta2_t``), ``rho = min(lr, 1/sqrt(t))``
    (fp64: it joins the parameter's RMS before rounding) and ``decay = 1 - lr * weight_decay``."""
    t64, lr64 = t.double(), lr.double()
    w2 = torch.pow(t64, beta2_decay).to(cd)
    rho = torch.minimum(lr64, 1.0 / t64.sqrt())
    decay = (1.0 - lr64 * weight_decay).to(cd)
    return w2, rho, decay


def _second_moment(g: Tensor, shape: tuple, state: Tensor, w2: Tensor, eps1: float) -> tuple:
    """The new state (flat) and the variance estimate ``v`` (shaped like ``g``, logical order) of one parameter.
    ``g``: the clipped gradient in logical order, fp32 (or fp64 for the oracle)."""
    g2 = g * g
    if not factored(shape):
        new = _lerp(state.view(shape), g2, w2)
        return new.reshape(-1), new
    b, r, c = factor_dims(shape)
    g2 = g2.reshape(b, r, c)
    rows, cols = state[:b * r].view(b, r), state[b * r:].view(b, c)
    rows = _lerp(rows, g2.sum(dim=2) / c, w2)  # sums in a fixed order per backend (see docs/adafactor.md)
    cols = _lerp(cols, g2.sum(dim=1) / r, w2)
    rmean = torch.clamp(rows.sum(dim=1, keepdim=True) / r, min=eps1)  # (a NaN stays NaN, as torch's clamp_)
    v = (rows.unsqueeze(2) * cols.unsqueeze(1)) / rmean.unsqueeze(2)
    return torch.cat([rows.reshape(-1), cols.reshape(-1)]), v.reshape(shape)


def adafactor_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
                    factors: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
                    out_stats: Tensor, beta2_decay: float, eps1: Optional[float], eps2: float, d: float,
                    weight_decay: float, max_norm: float, maximize: bool = False,
                    seed: Optional[Tensor] = None, health: Optional[Tensor] = None) -> None:
    """One ``torch.optim.Adafactor`` step over a list of parameters, without a host read.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` and, for each parameter ``i`` with a gradient,
    ``w`` its master (or itself), ``n`` its number of elements and ``t = steps[i] + 1``::

        g = c * grad                               (fp32; negated if maximize)
        w2 = fp32(t ** beta2_decay)                (1 - beta2_t)
        factored (dim >= 2, the last two dimensions rows and columns, the leading ones a batch):
            row = lerp(row, sum_c(g*g) / C, w2);  col = lerp(col, sum_r(g*g) / R, w2)
            v = row[r] * col[c] / max(sum_r(row) / R, eps1)
        else: v = lerp(variance, g*g, w2)
        u = g / sqrt(max(v, eps1 * eps1))          (correctly rounded square root)
        alpha = max(eps2, sqrt(sum(w*w)) / sqrt(n)) * min(lr, 1 / sqrt(t))     (fp64, w before the decay)
        step = fp32(alpha / max(1, sqrt(sum(u*u)) / (sqrt(n) * d)))
        w = w * fp32(1 - lr * weight_decay)        (when weight_decay != 0)
        w = w - step * u;  param = round(w);  steps[i] = t

    ``eps1=None`` is fp32's machine epsilon (the math runs in fp32 whatever the parameters' dtype). The sums
    of squares are fp32; the per-parameter scalars are formed in fp64 from them, as torch forms them from its
    ``.item()`` reads, and rounded once. Elementwise operations are rounded as written (no fused multiply-add).

    Tensors: ``params``, ``grads``, ``master``, ``steps``, ``partials``, ``inv_scale``, ``lr``, ``out_stats`` as
    :func:`ampfused.ops.reference.adam_step_`. ``factors``: 1-D fp32 (fp64 for the oracle), laid out by
    ``factor_layout([p.shape for p in params])``; rows and columns are indexed by the parameter's logical
    dimensions whatever its memory layout. State precision: an int16 ``master`` (remainders) or no master with
    a ``seed`` (stochastic rounding, stream 0) as in ``adam_step_``; ``factors`` stay fp32. ``health`` as
    ``adam_step_`` (the update ``w * (1 - lr * weight_decay) - step * u``).
    """
    check_health(health, inv_scale)
    st = _Setup(params, master, seed, partials, inv_scale, max_norm, out_stats, eps1, health)
    for i, (p, grad) in enumerate(zip(params, grads)):
        if grad is None:
            continue
        st.cx.gradient(memory_view(grad))
        x = _ParamStep(st, i, p, grad, master, steps, lr, beta2_decay, weight_decay, maximize, factors)
        new_state, v = _second_moment(x.g, x.shape, factors[x.fsl], x.w2, st.eps1)
        u = x.g / sqrt_rn(torch.clamp(v, min=st.eps1_sq))
        w_sumsq = (x.w * x.w).sum()  # w: the compute copy in memory order (the order does not change the math)
        u_sumsq = (u * u).sum()
        x.apply(st, new_state, u, w_sumsq, u_sumsq, p.numel(), eps2, d, weight_decay, factors, steps)


class _Setup:
    """What every parameter's step shares: the compact-state helper, the clip coefficient and skip flag, the
    layouts of the weights and the factors, and eps1 (and its square) in the compute dtype."""

    def __init__(self, params, master, seed, partials, inv_scale, max_norm, out_stats, eps1, health=None):
        self.cx = _Compact(params, master, [], seed, health=health, inv_scale=inv_scale)
        self.cd = self.cx.cd
        self.eps1 = EPS1_DEFAULT if eps1 is None else float(eps1)
        self.coef, self.skip = _prologue(partials, inv_scale, max_norm, out_stats, self.cd)
        self.cx.start(self.skip)
        self.w_offsets, _ = state_layout([p.numel() for p in params], self.cx.align)
        self.f_offsets, _ = factor_layout([tuple(p.shape) for p in params])
        self.eps1_sq = self.eps1 * self.eps1 if self.cd == torch.float64 else fp32(self.eps1 * self.eps1)


class _ParamStep:
    """Parameter ``i``'s inputs to its step: its weight (compute copy), its clipped gradient in logical
    (row-major) order (rows and columns are logical dimensions), step ``t`` and its scalars, its factors' slice."""

    def __init__(self, st: _Setup, i, p, grad, master, steps, lr, beta2_decay, weight_decay, maximize, factors):
        self.i, self.shape = i, tuple(p.shape)
        self.sl = slice(st.w_offsets[i], st.w_offsets[i] + p.numel())
        self.pm = memory_view(p)
        self.w_buf = master[self.sl] if master is not None else self.pm
        self.w = st.cx.load_weight(self.pm, self.w_buf)
        g = grad.to(st.cd) * st.coef
        if maximize:
            g = -g
        self.g = g.contiguous()
        self.t = steps[i].float() + 1
        self.w2, self.rho, self.decay = step_scalars(self.t, lr, beta2_decay, weight_decay, st.cd)
        self.lr = lr
        self.fsl = slice(st.f_offsets[i], st.f_offsets[i] + factor_size(self.shape))
        self.p = p

    def apply(self, st: _Setup, new_state, u, w_sumsq, u_sumsq, n: int, eps2, d, weight_decay, factors, steps):
        """The step size from the sums of squares (of a whole parameter of ``n`` elements), the update, the
        factors (``new_state``; None: left as they are) and the step count, written unless the step is
        skipped."""
        root_n = math.sqrt(n)
        alpha = _max(sqrt_rn(w_sumsq).double() / root_n, eps2) * self.rho
        step = (alpha / _max(sqrt_rn(u_sumsq).double() / (root_n * d), 1.0)).to(st.cd)
        # u in the parameter's memory order
        u_mem = memory_view(torch.empty_like(self.p, dtype=st.cd).copy_(u.view(self.shape)))
        w_new = self.w * self.decay if weight_decay != 0 else self.w
        term = step * u_mem
        w_new = w_new - term
        decaying = self.lr if weight_decay != 0 else None
        _commit(st.skip, ([] if new_state is None else [(factors[self.fsl], new_state)])
                + st.cx.weight_pairs(self.pm, self.w_buf, w_new, self.t, self.sl,
                                     lambda w0: moved(w0, decaying, term)))
        steps[self.i] += (~st.skip).to(steps.dtype)


def adafactor_step_shard_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
                          factors: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
                          out_stats: Tensor, beta2_decay: float, eps1: Optional[float], eps2: float, d: float,
                          weight_decay: float, max_norm: float, maximize: bool = False,
                          seed: Optional[Tensor] = None, *, phase: int, shard: ShardSums) -> None:
    """Phase ``phase`` (1, 2 or 3) of :func:`adafactor_step_` over the local shards of parameters split over
    ranks (FSDP2): ``params`` and ``grads`` are this rank's pieces, ``factors`` is laid out by ``factor_layout``
    of their shapes (a split along the rows keeps every column factor, along the columns every row factor),
    ``partials`` are summed over the ranks already; ``shard`` (:class:`ampfused.ops.factored.ShardSums`) says
    how each parameter is split and holds the sums over whole parameters, ``shard.first`` summed over the ranks
    between phases 1 and 2, ``shard.second`` between phases 2 and 3 (on the device: no host read).

    1. the sums of ``g*g`` along each row and each column, of ``w*w``, and (rows split) of the new row factors;
    2. the new factors (from the sums), written; the sum of ``u*u``;
    3. the step size (of the whole parameter's sums and number of elements) and the weights; the step counts.

    The math is :func:`adafactor_step_`'s with each sum over a whole parameter made of the ranks' partial sums
    (kept in fp64 from the compute dtype's: one rank is :func:`adafactor_step_` bit for bit; more add them in
    another order, within the oracle rule). A skipped step writes nothing in any phase. The native and Triton
    backends run the same phases from the same buffer (``docs/adafactor.md``, "FSDP2")."""
    if phase not in (1, 2, 3):
        raise ValueError(f"phase must be 1, 2 or 3, got {phase!r}")
    st = _Setup(params, master, seed, partials, inv_scale, max_norm, out_stats, eps1)
    sums = shard.sums
    for i, (p, grad) in enumerate(zip(params, grads)):
        if grad is None:
            continue
        x = _ParamStep(st, i, p, grad, master, steps, lr, beta2_decay, weight_decay, maximize, factors)
        split, n_full, r_full, c_full, o_w, o_u, o_rsum, o_rowg, o_colg = shard.row(i)
        state = factors[x.fsl]
        if factored(x.shape):
            b, r, c = factor_dims(x.shape)
            rows_sl, cols_sl, rsum_sl = slice(o_rowg, o_rowg + b * r), slice(o_colg, o_colg + b * c), \
                slice(o_rsum, o_rsum + b)
        if phase == 1:
            pairs = [(sums[o_w:o_w + 1], (x.w * x.w).sum().reshape(1).to(sums.dtype))]
            if factored(x.shape):
                g2 = (x.g * x.g).reshape(b, r, c)
                row_sum = g2.sum(dim=2)
                pairs += [(sums[rows_sl], row_sum.reshape(-1).to(sums.dtype)),
                          (sums[cols_sl], g2.sum(dim=1).reshape(-1).to(sums.dtype))]
                if split == SPLIT_ROWS:  # the rows here are whole: their new factors' sum, partial
                    rows = _lerp(state[:b * r].view(b, r), row_sum / c_full, x.w2)
                    pairs.append((sums[rsum_sl], rows.sum(dim=1).to(sums.dtype)))
            _commit(st.skip, pairs)
            continue
        if factored(x.shape):
            rows_state, cols_state = state[:b * r].view(b, r), state[b * r:].view(b, c)
            if phase == 2:
                rows = _lerp(rows_state, sums[rows_sl].to(st.cd).view(b, r) / c_full, x.w2)
                cols = _lerp(cols_state, sums[cols_sl].to(st.cd).view(b, c) / r_full, x.w2)
                rows_sum = sums[rsum_sl].to(st.cd) if split == SPLIT_ROWS else rows.sum(dim=1)
            else:
                rows, cols, rows_sum = rows_state, cols_state, sums[rsum_sl].to(st.cd)
            rmean = torch.clamp(rows_sum.view(b, 1) / r_full, min=st.eps1)
            v = ((rows.unsqueeze(2) * cols.unsqueeze(1)) / rmean.unsqueeze(2)).reshape(x.shape)
        else:
            v = _lerp(state.view(x.shape), x.g * x.g, x.w2) if phase == 2 else state.view(x.shape)
        u = x.g / sqrt_rn(torch.clamp(v, min=st.eps1_sq))
        if phase == 2:
            new_state = torch.cat([rows.reshape(-1), cols.reshape(-1)]) if factored(x.shape) else v.reshape(-1)
            pairs = [(state, new_state), (sums[o_u:o_u + 1], (u * u).sum().reshape(1).to(sums.dtype))]
            if factored(x.shape) and split != SPLIT_ROWS:
                pairs.append((sums[rsum_sl], rows_sum.to(sums.dtype)))
            _commit(st.skip, pairs)
            continue
        x.apply(st, None, u, sums[o_w].to(st.cd), sums[o_u].to(st.cd), n_full, eps2, d, weight_decay, factors,
                steps)
