"""Adafactor's step in plain torch: the specification of ``adafactor_step_`` (``torch.optim.Adafactor``'s math).

Conventions are :mod:`ampfused.ops.reference`'s (parameters and gradients where they live, ``partials``,
``inv_scale``, ``lr`` and ``steps`` on the device, ``out_stats``, a skip that writes nothing), except that the
optimizer's state is not shaped like the parameters: a parameter of two or more dimensions keeps a row and a
column vector (factored second moment), any other keeps a vector shaped like itself. :func:`factor_layout`
places them in one flat fp32 buffer, ``factors``.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .reference import STATE_ALIGN, _Compact, _commit, _prologue, fp32, memory_view, sqrt_rn, state_layout

EPS1_DEFAULT = float(torch.finfo(torch.float32).eps)  # eps=(None, ...): the eps of the dtype the math runs in


def factored(shape: Sequence[int]) -> bool:
    """Whether a parameter of this shape keeps row and column factors (torch: ``grad.dim() > 1``)."""
    return len(shape) > 1


def factor_dims(shape: Sequence[int]) -> Tuple[int, int, int]:
    """``(B, R, C)`` of a factored shape: the leading dimensions as one batch, the last two as rows, columns."""
    return math.prod(shape[:-2]), int(shape[-2]), int(shape[-1])


def factor_size(shape: Sequence[int]) -> int:
    """Elements of ``factors`` a parameter of this shape owns: ``B*R + B*C`` (rows, then columns) when factored,
    else its number of elements."""
    if factored(shape):
        b, r, c = factor_dims(shape)
        return b * r + b * c
    return math.prod(shape)


def factor_layout(shapes: Sequence[Sequence[int]], align: int = STATE_ALIGN) -> Tuple[List[int], int]:
    """``(offsets, total)`` of each parameter's slice of ``factors`` (:func:`state_layout` of the sizes)."""
    return state_layout([factor_size(s) for s in shapes], align)


def factor_views(factors: Tensor, offset: int, shape: Sequence[int]) -> dict:
    """A parameter's state as ``torch.optim.Adafactor`` shows it, as views of ``factors``: ``row_var`` shaped
    ``[..., R, 1]`` and ``col_var`` ``[..., 1, C]`` (contiguous) when factored, else ``variance`` shaped like
    the parameter (contiguous)."""
    shape = tuple(shape)
    if not factored(shape):
        n = math.prod(shape)
        return {"variance": factors[offset:offset + n].view(shape)}
    b, r, c = factor_dims(shape)
    rows = factors[offset:offset + b * r].view(shape[:-1] + (1,))
    cols = factors[offset + b * r:offset + b * r + b * c].view(shape[:-2] + (1, c))
    return {"row_var": rows, "col_var": cols}


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
                    seed: Optional[Tensor] = None) -> None:
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
    a ``seed`` (stochastic rounding, stream 0) as in ``adam_step_``; ``factors`` stay fp32.
    """
    cx = _Compact(params, master, [], seed)
    cd = cx.cd
    eps1 = EPS1_DEFAULT if eps1 is None else float(eps1)
    coef, skip = _prologue(partials, inv_scale, max_norm, out_stats, cd)
    w_offsets, _ = state_layout([p.numel() for p in params], cx.align)
    f_offsets, _ = factor_layout([tuple(p.shape) for p in params])
    eps1_sq = eps1 * eps1 if cd == torch.float64 else fp32(eps1 * eps1)
    for i, (p, grad) in enumerate(zip(params, grads)):
        if grad is None:
            continue
        shape, n = tuple(p.shape), p.numel()
        sl = slice(w_offsets[i], w_offsets[i] + n)
        pm = memory_view(p)
        w_buf = master[sl] if master is not None else pm
        w = cx.load_weight(pm, w_buf)
        # logical (row-major) copies of the gradient and weight: rows and columns are logical dimensions
        g = grad.to(cd) * coef
        if maximize:
            g = -g
        t = steps[i].float() + 1
        w2, rho, decay = step_scalars(t, lr, beta2_decay, weight_decay, cd)
        fsl = slice(f_offsets[i], f_offsets[i] + factor_size(shape))
        new_state, v = _second_moment(g.contiguous(), shape, factors[fsl], w2, eps1)
        u = g.contiguous() / sqrt_rn(torch.clamp(v, min=eps1_sq))
        w_sumsq = (w * w).sum()  # w: the compute copy in memory order (the order does not change the math)
        u_sumsq = (u * u).sum()
        root_n = math.sqrt(n)
        alpha = _max(sqrt_rn(w_sumsq).double() / root_n, eps2) * rho
        step = (alpha / _max(sqrt_rn(u_sumsq).double() / (root_n * d), 1.0)).to(cd)
        u_mem = memory_view(torch.empty_like(p, dtype=cd).copy_(u.view(shape)))  # u in the parameter's memory order
        w_new = w * decay if weight_decay != 0 else w
        w_new = w_new - step * u_mem
        _commit(skip, [(factors[fsl], new_state)] + cx.weight_pairs(pm, w_buf, w_new, t, sl))
        steps[i] += (~skip).to(steps.dtype)


def shard_sums(shape: Sequence[int], dim: Optional[int]) -> Tuple[bool, bool]:
    """For a parameter split over ranks along ``dim`` (None: not split), whether its row sums (over columns) and
    its column sums (over rows) are partial on each rank: ``(dim is the column dimension, dim is the row
    dimension)`` for a factored shape; a split along a batch dimension leaves both whole."""
    if dim is None or not factored(shape):
        return False, False
    dim = dim % len(shape)
    return dim == len(shape) - 1, dim == len(shape) - 2


def adafactor_step_sharded_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
                            factors: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
                            out_stats: Tensor, beta2_decay: float, eps1: Optional[float], eps2: float, d: float,
                            weight_decay: float, max_norm: float, maximize: bool, seed: Optional[Tensor],
                            full_shapes: Sequence[Sequence[int]], dims: Sequence[Optional[int]],
                            reduce: Callable[[Tensor], None]) -> None:
    """:func:`adafactor_step_` over the local shards of parameters split over ranks (FSDP2): ``params`` and
    ``grads`` are this rank's pieces, ``full_shapes`` the whole parameters' shapes and ``dims`` the dimension each
    is split along (None: whole here); ``factors`` is laid out by ``factor_layout`` of the local shapes (a split
    along the rows keeps every column factor, along the columns every row factor); ``partials`` are summed over
    the ranks already. ``reduce(t)`` sums ``t`` over the ranks in place (on the device: no host read).

    The math is :func:`adafactor_step_`'s with each sum over a whole parameter made of the ranks' partial sums:
    the sums of ``w*w`` and ``u*u``, a factored parameter's column sums and row-factor mean when its rows are
    split, its row sums when its columns are. Two reductions per step for all parameters together, one before
    the update (those of the gradient and the weight) and one of ``u*u``. With one rank it is
    :func:`adafactor_step_` bit for bit; with more, the sums are added in another order (within the oracle rule)."""
    cx = _Compact(params, master, [], seed)
    cd = cx.cd
    eps1 = EPS1_DEFAULT if eps1 is None else float(eps1)
    coef, skip = _prologue(partials, inv_scale, max_norm, out_stats, cd)
    w_offsets, _ = state_layout([p.numel() for p in params], cx.align)
    f_offsets, _ = factor_layout([tuple(p.shape) for p in params])
    eps1_sq = eps1 * eps1 if cd == torch.float64 else fp32(eps1 * eps1)
    work, first = [], []
    for i, (p, grad) in enumerate(zip(params, grads)):  # the gradient's and the weight's sums
        if grad is None:
            continue
        shape, full = tuple(p.shape), tuple(full_shapes[i])
        row_sums_partial, col_sums_partial = shard_sums(full, dims[i])
        sl = slice(w_offsets[i], w_offsets[i] + p.numel())
        pm = memory_view(p)
        w_buf = master[sl] if master is not None else pm
        w = cx.load_weight(pm, w_buf)
        g = grad.to(cd) * coef
        if maximize:
            g = -g
        g = g.contiguous()
        t = steps[i].float() + 1
        w2, rho, decay = step_scalars(t, lr, beta2_decay, weight_decay, cd)
        fsl = slice(f_offsets[i], f_offsets[i] + factor_size(shape))
        item = dict(i=i, shape=shape, full=full, sl=sl, pm=pm, w_buf=w_buf, w=w, g=g, t=t, w2=w2, rho=rho,
                    decay=decay, fsl=fsl,                     w_sumsq=(w * w).sum().reshape(1))
        sums = [item["w_sumsq"]]
        if factored(shape):
            b, r, c = factor_dims(shape)
            g2 = (g * g).reshape(b, r, c)
            item["row_sum"], item["col_sum"] = g2.sum(dim=2), g2.sum(dim=1)
            if row_sums_partial:
                sums.append(item["row_sum"])
            if col_sums_partial:  # the rows here are whole: their new factors, and their sum for the mean
                sums.append(item["col_sum"])
                item["rows"] = _lerp(factors[fsl][:b * r].view(b, r), item["row_sum"] / full[-1], item["w2"])
                item["rows_sum"] = item["rows"].sum(dim=1, keepdim=True)
                sums.append(item["rows_sum"])
        work.append(item)
        first.extend(sums)
    _reduced(first, reduce)
    second = []
    for item in work:  # the second moment, the update and its sum of squares
        shape, full, g, w2, fsl = item["shape"], item["full"], item["g"], item["w2"], item["fsl"]
        state = factors[fsl]
        if factored(shape):
            b, r, c = factor_dims(shape)
            rows = item.get("rows")
            if rows is None:
                rows = _lerp(state[:b * r].view(b, r), item["row_sum"] / full[-1], w2)
                item["rows_sum"] = rows.sum(dim=1, keepdim=True)
            cols = _lerp(state[b * r:].view(b, c), item["col_sum"] / full[-2], w2)
            rmean = torch.clamp(item["rows_sum"] / full[-2], min=eps1)
            v = ((rows.unsqueeze(2) * cols.unsqueeze(1)) / rmean.unsqueeze(2)).reshape(shape)
            item["new_state"] = torch.cat([rows.reshape(-1), cols.reshape(-1)])
        else:
            v = _lerp(state.view(shape), g * g, w2)
            item["new_state"] = v.reshape(-1)
        item["u"] = g / sqrt_rn(torch.clamp(v, min=eps1_sq))
        item["u_sumsq"] = (item["u"] * item["u"]).sum().reshape(1)
        second.append(item["u_sumsq"])
    _reduced(second, reduce)
    for item in work:  # the step size and the update
        i, p, shape = item["i"], params[item["i"]], item["shape"]
        root_n = math.sqrt(math.prod(item["full"]))
        alpha = _max(sqrt_rn(item["w_sumsq"][0]).double() / root_n, eps2) * item["rho"]
        step = (alpha / _max(sqrt_rn(item["u_sumsq"][0]).double() / (root_n * d), 1.0)).to(cd)
        u_mem = memory_view(torch.empty_like(p, dtype=cd).copy_(item["u"].view(shape)))
        w = item["w"]
        w_new = w * item["decay"] if weight_decay != 0 else w
        w_new = w_new - step * u_mem
        _commit(skip, [(factors[item["fsl"]], item["new_state"])]
                + cx.weight_pairs(item["pm"], item["w_buf"], w_new, item["t"], item["sl"]))
        steps[i] += (~skip).to(steps.dtype)


def _reduced(parts: List[Tensor], reduce: Callable[[Tensor], None]) -> None:
    """Sum every tensor of ``parts`` over the ranks in place, in one reduction of their concatenation."""
    if not parts:  # (no gradient here, nor on any rank: the ranks hold the same parameters' shards)
        return
    flat = torch.cat([t.reshape(-1) for t in parts])
    reduce(flat)
    k = 0
    for t in parts:
        t.copy_(flat[k:k + t.numel()].view(t.shape))
        k += t.numel()
