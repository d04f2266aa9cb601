"""K2 for Adafactor (``ops.reference_adafactor.adafactor_step_``): one launch, one program per parameter.

A program owns its parameter: it reduces the partials (the skip: nothing is written when found_inf), then walks
the parameter in 2-D tiles of logical rows and columns (the leading dimensions a batch of matrices; any memory
layout, through the strides in the table):

1. row sums of the clipped gradient's squares and of the weight's (rows outer), the new row factors;
   column sums (columns outer), the new column factors;
2. the mean of each matrix's new row factors, and the update's sum of squares;
3. the step size (fp64 from the fp32 sums, rounded once) and the weights, in the step's master format;
and advances its own step count. Unfactored parameters take one pass for the variance and both sums, one for
the weights. Sums are fp64 over fp32 tile sums, in a fixed order, and the launch forbids fma: the same bits
run to run. With the scaler the step is K1, this launch and the scale update: three launches.

Parallelism is one program per parameter: enough for models of many tensors; a single large matrix runs on one
program (docs/adafactor.md gives the split across programs that a GPU wants for those).

Table (``ops/native_factored.py``): one row of ``AF_COLS`` int64 per parameter: param and grad
addresses, numel (-1 without a gradient), offset in ``master``, offset in ``factors``, ndim, 8 sizes, 8 strides.

Parameters split over ranks (FSDP2) take the three passes as three launches (``PHASE`` 1 to 3; 0 is the whole
step), each whole parameter's sums in ``sums`` summed over the ranks between them (``ops/factored.py``,
``ShardSums``; after the table's rows, ``SH_COLS`` ints per parameter say how it is split and where its sums
are). One rank's phases are the whole step's bits.
"""
import math
import struct

import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, TL_DTYPES, _lerp, _prologue, _round_to, _to_f32, device_guard, f32,
                      nonempty)
from ._compact import (MASTER_NONE, MASTER_REMAINDER, _join_master, _random_bits, _round_stochastic, _split_master,
                       _step_key)

AF_COLS = tl.constexpr(22)
MAX_DIMS = tl.constexpr(8)
SH_COLS = tl.constexpr(9)  # a phase over shards: the shard table's ints per parameter (ops/factored.py, ShardSums)
SPLIT_ROWS = tl.constexpr(1)
BR = 16
BC = 64
BLOCK = 1024
PBLOCK = 512
NUM_WARPS = 4


@triton.jit
def _clamp_min(x, lo):
    """``torch.clamp(min=lo)``: a NaN stays NaN."""
    return tl.where(x < lo, lo, x)


@triton.jit
def _max64(x, floor):
    """Python's ``max(floor, x)`` in fp64 (a NaN gives ``floor``)."""
    return tl.where(x > floor, x, floor)


@triton.jit
def _weight(param_ptr, w_ptr, off, mask, MASTER_FORMAT: tl.constexpr, HAS_MASTER: tl.constexpr):
    if MASTER_FORMAT == MASTER_REMAINDER:
        return _join_master(tl.load(param_ptr + off, mask=mask, other=0.0), tl.load(w_ptr + off, mask=mask, other=0))
    elif HAS_MASTER:
        return tl.load(w_ptr + off, mask=mask, other=0.0)
    else:
        return _to_f32(tl.load(param_ptr + off, mask=mask, other=0.0))


@triton.jit
def _store_w(param_ptr, w_ptr, off, mask, w, key, index, PARAM_DTYPE: tl.constexpr, MASTER_FORMAT: tl.constexpr,
             HAS_MASTER: tl.constexpr):
    if MASTER_FORMAT == MASTER_REMAINDER:
        weight, rem = _split_master(w)
        tl.store(w_ptr + off, rem, mask=mask)
        tl.store(param_ptr + off, weight, mask=mask)
    elif MASTER_FORMAT == MASTER_NONE:
        tl.store(param_ptr + off, _round_stochastic(w, _random_bits(key, index)), mask=mask)
    elif HAS_MASTER:
        tl.store(w_ptr + off, w, mask=mask)
        tl.store(param_ptr + off, _round_to(w, PARAM_DTYPE), mask=mask)
    else:
        tl.store(param_ptr + off, w, mask=mask)


@triton.jit
def _grad(grad_ptr, off, mask, coef, MAXIMIZE: tl.constexpr):
    g = _to_f32(tl.load(grad_ptr + off, mask=mask, other=0.0)) * coef
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _base(entry, b, nlead):
    """Memory offset of matrix ``b`` (row-major over the leading dimensions)."""
    off = tl.full((), 0, tl.int64)
    rest = b
    for kk in range(0, nlead):
        k = nlead - 1 - kk
        size = tl.load(entry + 6 + k)
        off += (rest % size) * tl.load(entry + 6 + MAX_DIMS + k)
        rest = rest // size
    return off


@triton.jit
def _rows_sum(rows_ptr, R, BR: tl.constexpr):
    """The sum of one matrix's (new) row factors, in a fixed order (fp64 over fp32 tile sums)."""
    acc = tl.zeros((), tl.float64)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        acc += tl.sum(tl.load(rows_ptr + rr, mask=rr < R, other=0.0), axis=0).to(tl.float64)
    return acc


@triton.jit
def _rmean(rows_ptr, R, r_full, eps1, sums_ptr, o_rsum, split, PHASE: tl.constexpr, BR: tl.constexpr):
    """``max(sum(rows) / R, eps1)`` of one matrix's new row factors: summed here (the whole step), or from the
    sums over the ranks (phase 3; phase 2 where the rows are split), phase 2 keeping its own sum for phase 3."""
    if PHASE == 0:
        acc = _rows_sum(rows_ptr, R, BR)
    elif PHASE == 3:
        acc = tl.load(sums_ptr + o_rsum)
    else:
        if split == SPLIT_ROWS:
            acc = tl.load(sums_ptr + o_rsum)
        else:
            acc = _rows_sum(rows_ptr, R, BR)
            tl.store(sums_ptr + o_rsum, acc)
    return _clamp_min(tl.div_rn(acc.to(tl.float32), r_full.to(tl.float32)), eps1)


@triton.jit
def _f64(bits):
    """An fp64 hyperparameter passed as its bits (a float argument would be rounded to fp32)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _update_tile(grad_ptr, col_ptr, base, row, rr, R, rm, cc, C, sr, sc, coef, eps1_sq, MAXIMIZE: tl.constexpr):
    """A tile of rows ``rr`` and columns ``cc`` of one matrix: its mask, its elements' offsets, and the update
    ``u = g / sqrt(max(row * col / mean(row), eps1^2))`` (``col_ptr``: the matrix's column factors)."""
    mask = (rr < R)[:, None] & (cc < C)[None, :]
    off = base + rr.to(tl.int64)[:, None] * sr + cc.to(tl.int64)[None, :] * sc
    col = tl.load(col_ptr + cc, mask=cc < C, other=1.0)
    v = _clamp_min(tl.div_rn(row[:, None] * col[None, :], rm), eps1_sq)
    return mask, off, tl.div_rn(_grad(grad_ptr, off, mask, coef, MAXIMIZE), tl.sqrt_rn(v))


@triton.jit
def _step_size(w_sumsq, u_sumsq, n, eps2, rho, d):
    """torch's step size: max(RMS(w), eps2) * rho / max(RMS(u) / d, 1), from fp64 sums of squares."""
    root_n = tl.sqrt(n.to(tl.float64))
    alpha = _max64(tl.sqrt_rn(w_sumsq.to(tl.float32)).to(tl.float64) / root_n, _f64(eps2)) * rho
    return (alpha / _max64(tl.sqrt_rn(u_sumsq.to(tl.float32)).to(tl.float64) / (root_n * _f64(d)), 1.0)).to(tl.float32)


@triton.jit(do_not_specialize=["P", "count", "beta2_decay", "eps2", "d", "weight_decay"])
def _adafactor_kernel(table_ptr, master_ptr, factors_ptr, steps_ptr, partials_ptr, inv_scale_ptr, lr_ptr,
                      out_stats_ptr, seed_ptr, sums_ptr, count, P, p_stride_row, p_stride_col, beta2_decay, eps1,
                      eps1_sq, eps2, d, weight_decay, max_norm, PARAM_DTYPE: tl.constexpr,
                      GRAD_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, MAXIMIZE: tl.constexpr,
                      CLIP: tl.constexpr, MASTER_FORMAT: tl.constexpr, USE_SEED: tl.constexpr,
                      DECAY: tl.constexpr, PHASE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                      BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
    norm, found_inf, coef = _prologue(partials_ptr, p_stride_row, p_stride_col, P, inv_scale_ptr, max_norm,
                                      out_stats_ptr, CLIP, PBLOCK)
    entry = table_ptr + tl.program_id(0).to(tl.int64) * AF_COLS
    n = tl.load(entry + 2)
    if (found_inf == 0.0) & (n >= 0):
        param_ptr = tl.load(entry).to(tl.pointer_type(PARAM_DTYPE))
        grad_ptr = tl.load(entry + 1).to(tl.pointer_type(GRAD_DTYPE))
        w_off = tl.load(entry + 3)
        w_ptr = master_ptr + w_off  # (int16 remainders, or the fp32 master)
        f_ptr = factors_ptr + tl.load(entry + 4)
        nd = tl.load(entry + 5)
        step = tl.load(steps_ptr + tl.program_id(0))
        t = step.to(tl.float32) + 1.0
        t64 = t.to(tl.float64)
        lr64 = tl.load(lr_ptr).to(tl.float64)
        # t ** beta2_decay as exp(beta2_decay * log(t)) in fp64 (within an fp64 ulp or two of pow, so its fp32
        # rounding is pow's but at ties; the interpreter has no libdevice pow)
        w2 = tl.exp(_f64(beta2_decay) * tl.log(t64)).to(tl.float32)
        rho = tl.minimum(lr64, 1.0 / tl.sqrt(t64))  # (fp64: correctly rounded)
        decay = (1.0 - lr64 * _f64(weight_decay)).to(tl.float32)
        key = tl.full((), 0, tl.uint32)
        if USE_SEED:
            key = _step_key(tl.load(seed_ptr), t)
        w_sumsq = tl.zeros((), tl.float64)
        u_sumsq = tl.zeros((), tl.float64)
        # a phase over shards: the whole parameter's size and where its sums are (its row of the shard table)
        sh = table_ptr + count.to(tl.int64) * AF_COLS + tl.program_id(0).to(tl.int64) * SH_COLS
        split = tl.full((), 0, tl.int64)
        n_full = n
        o_w = tl.full((), 0, tl.int64)
        o_u = o_w
        o_rsum = o_w
        o_rowg = o_w
        o_colg = o_w
        if PHASE > 0:
            split = tl.load(sh)
            n_full = tl.load(sh + 1)
            o_w = tl.load(sh + 4)
            o_u = tl.load(sh + 5)
            o_rsum = tl.load(sh + 6)
            o_rowg = tl.load(sh + 7)
            o_colg = tl.load(sh + 8)
        if PHASE == 3:
            w_sumsq = tl.load(sums_ptr + o_w)
            u_sumsq = tl.load(sums_ptr + o_u)
        if nd > 1:
            R = tl.load(entry + 6 + nd - 2)
            C = tl.load(entry + 6 + nd - 1)
            sr = tl.load(entry + 6 + MAX_DIMS + nd - 2)
            sc = tl.load(entry + 6 + MAX_DIMS + nd - 1)
            r_full = R
            c_full = C
            if PHASE > 0:
                r_full = tl.load(sh + 2)
                c_full = tl.load(sh + 3)
            nlead = nd - 2
            B = tl.full((), 1, tl.int64)
            for kk in range(0, nlead):
                B = B * tl.load(entry + 6 + kk)
            rows_ptr = f_ptr
            cols_ptr = f_ptr + B * R
            lr_ = tl.arange(0, BR)
            lc_ = tl.arange(0, BC)
            if PHASE <= 1:
                # 1. rows (rows outer): row factors and the weight's sum; columns (columns outer): column factors
                # (phase 1: their sums, and the sum of the new row factors)
                for b in range(0, B):
                    base = _base(entry, b, nlead)
                    new_rows = tl.zeros((), tl.float64)
                    for r0 in range(0, R, BR):
                        rr = r0 + lr_
                        gs = tl.zeros([BR], tl.float64)
                        for c0 in range(0, C, BC):
                            cc = c0 + lc_
                            mask = (rr < R)[:, None] & (cc < C)[None, :]
                            off = base + rr.to(tl.int64)[:, None] * sr + cc.to(tl.int64)[None, :] * sc
                            g = _grad(grad_ptr, off, mask, coef, MAXIMIZE)
                            w = _weight(param_ptr, w_ptr, off, mask, MASTER_FORMAT, HAS_MASTER)
                            gs += tl.sum(g * g, axis=1).to(tl.float64)
                            w_sumsq += tl.sum(tl.sum(w * w, axis=1), axis=0).to(tl.float64)
                        rmask = rr < R
                        old = tl.load(rows_ptr + b * R + rr, mask=rmask, other=0.0)
                        new = _lerp(old, tl.div_rn(gs.to(tl.float32), c_full.to(tl.float32)), w2)
                        if PHASE == 0:
                            tl.store(rows_ptr + b * R + rr, new, mask=rmask)
                        else:
                            tl.store(sums_ptr + o_rowg + b * R + rr, gs, mask=rmask)
                            new_rows += tl.sum(tl.where(rmask, new, 0.0), axis=0).to(tl.float64)
                    if PHASE == 1:
                        if split == SPLIT_ROWS:
                            tl.store(sums_ptr + o_rsum + b, new_rows)
                    for c0 in range(0, C, BC):
                        cc = c0 + lc_
                        cs = tl.zeros([BC], tl.float64)
                        for r0 in range(0, R, BR):
                            rr = r0 + lr_
                            mask = (rr < R)[:, None] & (cc < C)[None, :]
                            off = base + rr.to(tl.int64)[:, None] * sr + cc.to(tl.int64)[None, :] * sc
                            g = _grad(grad_ptr, off, mask, coef, MAXIMIZE)
                            cs += tl.sum(g * g, axis=0).to(tl.float64)
                        cmask = cc < C
                        if PHASE == 0:
                            old = tl.load(cols_ptr + b * C + cc, mask=cmask, other=0.0)
                            tl.store(cols_ptr + b * C + cc,
                                     _lerp(old, tl.div_rn(cs.to(tl.float32), R.to(tl.float32)), w2), mask=cmask)
                        else:
                            tl.store(sums_ptr + o_colg + b * C + cc, cs, mask=cmask)
                if PHASE == 1:
                    tl.store(sums_ptr + o_w, w_sumsq)
            if PHASE == 2:  # the new factors from the sums over the ranks
                for b in range(0, B):
                    for r0 in range(0, R, BR):
                        rr = r0 + lr_
                        rmask = rr < R
                        gs = tl.load(sums_ptr + o_rowg + b * R + rr, mask=rmask, other=0.0)
                        old = tl.load(rows_ptr + b * R + rr, mask=rmask, other=0.0)
                        tl.store(rows_ptr + b * R + rr,
                                 _lerp(old, tl.div_rn(gs.to(tl.float32), c_full.to(tl.float32)), w2), mask=rmask)
                    for c0 in range(0, C, BC):
                        cc = c0 + lc_
                        cmask = cc < C
                        cs = tl.load(sums_ptr + o_colg + b * C + cc, mask=cmask, other=0.0)
                        old = tl.load(cols_ptr + b * C + cc, mask=cmask, other=0.0)
                        tl.store(cols_ptr + b * C + cc,
                                 _lerp(old, tl.div_rn(cs.to(tl.float32), r_full.to(tl.float32)), w2), mask=cmask)
            if (PHASE == 0) | (PHASE == 2):
                # 2. the update's sum of squares
                for b in range(0, B):
                    base = _base(entry, b, nlead)
                    rm = _rmean(rows_ptr + b * R, R, r_full, eps1, sums_ptr, o_rsum + b, split, PHASE, BR)
                    for r0 in range(0, R, BR):
                        rr = r0 + lr_
                        row = tl.load(rows_ptr + b * R + rr, mask=rr < R, other=1.0)
                        for c0 in range(0, C, BC):
                            mask, off, u = _update_tile(grad_ptr, cols_ptr + b * C, base, row, rr, R, rm, c0 + lc_,
                                                        C, sr, sc, coef, eps1_sq, MAXIMIZE)
                            u = tl.where(mask, u, 0.0)
                            u_sumsq += tl.sum(tl.sum(u * u, axis=1), axis=0).to(tl.float64)
                if PHASE == 2:
                    tl.store(sums_ptr + o_u, u_sumsq)
            if (PHASE == 0) | (PHASE == 3):
                stepsize = _step_size(w_sumsq, u_sumsq, n_full, eps2, rho, d)
                # 3. the weights
                for b in range(0, B):
                    base = _base(entry, b, nlead)
                    rm = _rmean(rows_ptr + b * R, R, r_full, eps1, sums_ptr, o_rsum + b, split, PHASE, BR)
                    for r0 in range(0, R, BR):
                        rr = r0 + lr_
                        row = tl.load(rows_ptr + b * R + rr, mask=rr < R, other=1.0)
                        for c0 in range(0, C, BC):
                            mask, off, u = _update_tile(grad_ptr, cols_ptr + b * C, base, row, rr, R, rm, c0 + lc_,
                                                        C, sr, sc, coef, eps1_sq, MAXIMIZE)
                            w = _weight(param_ptr, w_ptr, off, mask, MASTER_FORMAT, HAS_MASTER)
                            if DECAY:
                                w = w * decay
                            _store_w(param_ptr, w_ptr, off, mask, w - stepsize * u, key, w_off + off, PARAM_DTYPE,
                                     MASTER_FORMAT, HAS_MASTER)
        else:
            lanes = tl.arange(0, BLOCK)
            if PHASE <= 2:
                for j0 in range(0, n, BLOCK):
                    off = (j0 + lanes).to(tl.int64)
                    mask = off < n
                    if PHASE != 1:
                        g = _grad(grad_ptr, off, mask, coef, MAXIMIZE)
                        var = _lerp(tl.load(f_ptr + off, mask=mask, other=0.0), g * g, w2)
                        tl.store(f_ptr + off, var, mask=mask)
                        u = tl.where(mask, tl.div_rn(g, tl.sqrt_rn(_clamp_min(var, eps1_sq))), 0.0)
                    if PHASE != 2:
                        w = _weight(param_ptr, w_ptr, off, mask, MASTER_FORMAT, HAS_MASTER)
                        w_sumsq += tl.sum(w * w, axis=0).to(tl.float64)
                    if PHASE != 1:
                        u_sumsq += tl.sum(u * u, axis=0).to(tl.float64)
                if PHASE == 1:
                    tl.store(sums_ptr + o_w, w_sumsq)
                if PHASE == 2:
                    tl.store(sums_ptr + o_u, u_sumsq)
            if (PHASE == 0) | (PHASE == 3):
                stepsize = _step_size(w_sumsq, u_sumsq, n_full, eps2, rho, d)
                for j0 in range(0, n, BLOCK):
                    off = (j0 + lanes).to(tl.int64)
                    mask = off < n
                    u = tl.div_rn(_grad(grad_ptr, off, mask, coef, MAXIMIZE),
                                  tl.sqrt_rn(_clamp_min(tl.load(f_ptr + off, mask=mask, other=1.0), eps1_sq)))
                    w = _weight(param_ptr, w_ptr, off, mask, MASTER_FORMAT, HAS_MASTER)
                    if DECAY:
                        w = w * decay
                    _store_w(param_ptr, w_ptr, off, mask, w - stepsize * u, key, w_off + off, PARAM_DTYPE,
                             MASTER_FORMAT, HAS_MASTER)
        if (PHASE == 0) | (PHASE == 3):
            tl.store(steps_ptr + tl.program_id(0), step + 1.0)


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def adafactor_step_(table, count, param_dtype, grad_dtype, fmt, master, factors, steps, partials, inv_scale, lr,
                    out_stats, beta2_decay, eps1, eps2, d, weight_decay, max_norm, maximize, seed, phase=0,
                    sums=None) -> None:
    """One launch over ``count`` parameters (``table``: their rows, int64 in the kernel's memory); tensors and math
    as ``ops.reference_adafactor.adafactor_step_``; ``fmt`` the step's ``_compact.LaunchFormat``. ``phase`` 1 to 3
    with ``sums`` (fp64): that phase over shards (``ops.reference_adafactor.adafactor_step_shard_``), the table's
    rows followed by the shard table (``SH_COLS`` ints per parameter)."""
    if count == 0:
        return
    with device_guard(out_stats):
        _adafactor_kernel[(count,)](
            table, nonempty(master, factors), factors, steps, partials, inv_scale, lr, out_stats,
            nonempty(seed, table), nonempty(sums, factors), count, partials.shape[1], partials.stride(0),
            partials.stride(1), _bits(beta2_decay), f32(eps1), f32(eps1 * eps1), _bits(eps2), _bits(d),
            _bits(weight_decay), f32(max_norm), PARAM_DTYPE=TL_DTYPES[param_dtype], GRAD_DTYPE=TL_DTYPES[grad_dtype],
            HAS_MASTER=fmt.has_fp32_master, MAXIMIZE=bool(maximize), CLIP=not math.isinf(max_norm),
            MASTER_FORMAT=fmt.master, USE_SEED=seed is not None, DECAY=weight_decay != 0, PHASE=int(phase), BR=BR,
            BC=BC, BLOCK=BLOCK, PBLOCK=PBLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
