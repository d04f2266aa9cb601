"""K2 for Adam / AdamW: prologue (norm, found_inf, clip coefficient), then one pass over the flat buffers.

Grid: ``programs = min(cdiv(n, BLOCK), MAX_PROGRAMS)``-ish (see ``chunking``), each program walking its own
contiguous run of blocks, so the prologue (which reduces all partials) is paid once per program, not once
per block. Each program reads grad, master (or param), exp_avg and exp_avg_sq once and writes master,
states and param once; nothing is written when a non-finite gradient was flagged.

Step counter: every program needs the step value *before* this step, and one of them must store
``step + 1``. Each program reads ``step`` first, does its work, then ``atomic_add(counter, 1)``
(acq_rel, gpu scope, integer); the program that receives ``programs - 1`` is the last one, so every other
program's read of ``step`` happened before its increment, which happened before this acquire: it stores
``step + 1`` and resets the counter to 0 for the next launch. The ``debug_barrier`` before the atomic makes
every thread's read of ``step`` precede the (single-thread) atomic within a program.
"""
import math

import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, _advance_step, _expm1, _load, _prologue, _round_to, _store, _to_f32,
                      chunking, device_guard)

BLOCK = 1024        # elements per program per iteration (8 per thread with 4 warps)
NUM_WARPS = 4
MAX_PROGRAMS = 1024
PBLOCK = 512        # partials reduced per prologue iteration (one iteration for one K1 buffer)


@triton.jit
def _adam_block(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, idx, n, coef, decay,
                step_size, sqrt_bc2, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                HAS_MASTER: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                MASKED: tl.constexpr):
    g = _to_f32(_load(grad_ptr, idx, n, MASKED)) * coef
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        w = _load(master_ptr, idx, n, MASKED).to(tl.float32)
    else:
        w = _load(param_ptr, idx, n, MASKED).to(tl.float32)
    m = _load(exp_avg_ptr, idx, n, MASKED).to(tl.float32)
    v = _load(exp_avg_sq_ptr, idx, n, MASKED).to(tl.float32)
    if DECOUPLED:
        w_new = w * decay
    else:
        w_new = w
        g = tl.where(weight_decay != 0.0, g + weight_decay * w, g)
    # torch.lerp(m, g, 1 - beta1), with torch's two formulas for small and large weights
    diff = g - m
    m_new = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * diff, g - diff * (1.0 - one_minus_beta1))
    v_new = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v_new), sqrt_bc2) + eps
    w_new = w_new - tl.div_rn(step_size * m_new, denom)
    _store(exp_avg_ptr, idx, n, m_new, MASKED)
    _store(exp_avg_sq_ptr, idx, n, v_new, MASKED)
    if HAS_MASTER:
        _store(master_ptr, idx, n, w_new, MASKED)
    _store(param_ptr, idx, n, _round_to(w_new, param_ptr.dtype.element_ty), MASKED)


@triton.jit(do_not_specialize=["n"])
def _adam_kernel(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, partials_ptr,
                 inv_scale_ptr, lr_ptr, out_stats_ptr, counter_ptr,
                 n, iters, P, p_stride_row, p_stride_col,
                 one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay, max_norm,
                 HAS_MASTER: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, CLIP: tl.constexpr,
                 BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
    pid = tl.program_id(0)
    norm, found_inf, coef = _prologue(partials_ptr, p_stride_row, p_stride_col, P, inv_scale_ptr, max_norm,
                                      out_stats_ptr, CLIP, PBLOCK)
    # A flagged step leaves every program without a single write (and without touching the counter).
    if found_inf == 0.0:
        step = tl.load(step_ptr)
        t = step + 1.0
        lr = tl.load(lr_ptr).to(tl.float32)
        # 1 - beta**t as -expm1(t * log(beta)), as the reference computes it
        step_size = tl.div_rn(lr, -_expm1(t * log_beta1))
        sqrt_bc2 = tl.sqrt_rn(-_expm1(t * log_beta2))
        decay = 1.0 - lr * weight_decay
        lanes = tl.arange(0, BLOCK)
        # 64-bit offsets: buffers over 2**31 elements are real
        first = pid.to(tl.int64) * iters
        full_blocks = n // BLOCK
        off = first * BLOCK
        for _ in range(0, tl.minimum(full_blocks - first, iters).to(tl.int32)):
            _adam_block(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, off + lanes, n, coef,
                        decay, step_size, sqrt_bc2, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                        HAS_MASTER, DECOUPLED, MAXIMIZE, False)
            off += BLOCK
        # the partial last block, if any, belongs to the last program
        if (pid == tl.num_programs(0) - 1) & (full_blocks * BLOCK < n):
            _adam_block(param_ptr, grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr,
                        full_blocks.to(tl.int64) * BLOCK + lanes, n, coef, decay, step_size, sqrt_bc2,
                        one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, HAS_MASTER, DECOUPLED,
                        MAXIMIZE, True)
        _advance_step(step_ptr, counter_ptr, t)


def _log(beta: float) -> float:
    # log(0) = -inf gives bias correction 1 - 0**t = 1, torch's value for beta = 0
    return math.log(beta) if beta > 0 else -math.inf


def adam_step_(param, grad, master, exp_avg, exp_avg_sq, step, partials, inv_scale, lr, out_stats, counter,
               beta1: float, beta2: float, eps: float, weight_decay: float, max_norm: float, decoupled: bool,
               maximize: bool = False) -> None:
    """One Adam (L2 decay) / AdamW (decoupled decay) step; math as ``ampfused.ops.reference.adam_step_``.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` from the partials, ``w`` the master (or param)
    copy and ``t = step + 1``, all in fp32::

        g = c * grad (negated if maximize);  AdamW: w *= 1 - lr * wd;  Adam: g += wd * w
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        w -= (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
        param = round_to_nearest_even(w);  step = t;  out_stats = [norm, found_inf]

    param: 1-D, fp32/bf16/fp16 (fp32 when master is None); grad: 1-D fp32/bf16/fp16; master, exp_avg,
    exp_avg_sq: 1-D fp32; all of ``n`` elements, contiguous. step, inv_scale: 0-d fp32; lr: 0-d fp32/fp64;
    partials: ``[2, P]`` fp32 (any strides); out_stats: ``[2]`` fp32; counter: ``[1]`` int32 workspace
    holding 0, left at 0. When found_inf, only out_stats is written.
    """
    n = param.numel()
    programs, iters = chunking(n, BLOCK, MAX_PROGRAMS)
    programs = max(programs, 1)  # an empty buffer still reports out_stats and counts the step
    with device_guard(param):
        _adam_kernel[(programs,)](
            param, grad, master if master is not None else param, exp_avg, exp_avg_sq, step, partials,
            inv_scale, lr, out_stats, counter,
            n, iters, partials.shape[1], partials.stride(0), partials.stride(1),
            1.0 - beta1, beta2, 1.0 - beta2, _log(beta1), _log(beta2), eps, weight_decay, max_norm,
            HAS_MASTER=master is not None, DECOUPLED=bool(decoupled), MAXIMIZE=bool(maximize),
            CLIP=not math.isinf(max_norm), BLOCK=BLOCK, PBLOCK=PBLOCK, num_warps=NUM_WARPS,
            **LAUNCH_OPTIONS)
