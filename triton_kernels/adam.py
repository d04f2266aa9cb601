"""K2 for Adam / AdamW over a list of parameters: prologue (norm, found_inf, clip coefficient), then one pass.

The parameters and gradients are reached through the step's tensor table (one int64 row per parameter:
param address, grad address, numel or NO_GRAD, state offset; see ``_common``) and a chunk list built on the
host: one ``(row, first element)`` entry per ``CHUNK`` elements of every parameter that has a gradient.
The grid is persistent and bounded: ``programs = min(chunks, MAX_PROGRAMS)``, program ``p`` taking chunks
``p, p + programs, ...``, so the prologue (which reduces all partials) is paid once per program, not once
per chunk, and every program has work. Per chunk a program reads that parameter's step count, forms its bias
corrections, and walks the chunk in memory order: full ``BLOCK``-element blocks unmasked, the tail of the
parameter masked; element ``j`` of the parameter pairs with element ``offset + j`` of the master and states.
Each element of grad, master (or param), exp_avg and exp_avg_sq is read once and master, states and param
written once; nothing is written when a non-finite gradient was flagged.

Step counts: every program needs the counts *before* this step, and each count of a parameter with a
gradient must then advance by one. Each program reads the counts of its chunks first, does its work, then
``atomic_add(counter, 1)`` (acq_rel, gpu scope, integer); the program that receives ``programs - 1`` is the
last one, so every other program's reads happened before its increment, which happened before this
acquire: it adds 1 to ``steps[i]`` for every row ``i`` whose numel is not NO_GRAD and resets the counter to
0 for the next launch. The ``debug_barrier`` before the atomic makes every thread's reads precede the
(single-thread) atomic within a program.
"""
import math

import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, TL_DTYPES, device_guard, f32, grid_size, nonempty, _advance_steps, _expm1,
                      _lerp, _load, _prologue, _step_chunk, _to_f32)
from ._compact import (_draw, _load_state, _load_weight, _step_key, _store_state, _store_weight, _stream_bits,
                       chunk_state_ptrs, launch_format)
from ._q8 import QBLOCK, _load_q8, _store_q8

BLOCK = 1024        # elements per program per iteration (8 per thread with 4 warps)
CHUNK = 8 * BLOCK   # elements per chunk-list entry
NUM_WARPS = 4
MAX_PROGRAMS = 1024
PBLOCK = 512        # partials reduced per prologue iteration
TBLOCK = 1024       # table rows per iteration of the step advance


@triton.jit
def _adam_block(param_ptr, grad_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, sc1_ptr, sc2_ptr, base, idx, n, coef,
                decay, step_size, eps_c, one_minus_beta1, beta2, one_minus_beta2, weight_decay, state, key,
                PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, DECOUPLED: tl.constexpr,
                MAXIMIZE: tl.constexpr, MASTER_FORMAT: tl.constexpr, STATE_BF16: tl.constexpr,
                STATE_Q8: tl.constexpr, USE_SEED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    # idx = base + arange(BLOCK): lanes of the chunk; sc1_ptr, sc2_ptr: the chunk's first block scales (Q8)
    g = _to_f32(_load(grad_ptr, idx, n, MASKED)) * coef
    if MAXIMIZE:
        g = -g
    w = _load_weight(param_ptr, w_ptr, idx, n, MASTER_FORMAT, MASKED)
    if STATE_Q8:
        m = _load_q8(exp_avg_ptr, sc1_ptr, idx, n, base, True, MASKED, BLOCK)
        v = _load_q8(exp_avg_sq_ptr, sc2_ptr, idx, n, base, False, MASKED, BLOCK)
    else:
        m = _load_state(exp_avg_ptr, idx, n, MASKED)
        v = _load_state(exp_avg_sq_ptr, idx, n, MASKED)
    if DECOUPLED:
        w_new = w * decay
    else:
        w_new = w
        g = tl.where(weight_decay != 0.0, g + weight_decay * w, g)
    m_new = _lerp(m, g, one_minus_beta1)
    v_new = v * beta2 + one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v_new) + eps_c
    w_new = w_new - tl.div_rn(step_size * m_new, denom)
    r = _draw(key, state + idx, USE_SEED)  # one per element, at its index in the flat buffers
    if STATE_Q8:
        _store_q8(exp_avg_ptr, sc1_ptr, idx, n, base, m_new, _stream_bits(r, 1), True, MASKED, BLOCK)
        _store_q8(exp_avg_sq_ptr, sc2_ptr, idx, n, base, v_new, _stream_bits(r, 2), False, MASKED, BLOCK)
    else:
        _store_state(exp_avg_ptr, idx, n, m_new, _stream_bits(r, 1), STATE_BF16, MASKED)
        _store_state(exp_avg_sq_ptr, idx, n, v_new, _stream_bits(r, 2), STATE_BF16, MASKED)
    _store_weight(param_ptr, w_ptr, idx, n, w_new, r, PARAM_DTYPE, HAS_MASTER, MASTER_FORMAT, MASKED)


@triton.jit(do_not_specialize=["num_chunks", "T", "P", "scale_cols"])
def _adam_kernel(table_ptr, chunks_ptr, num_chunks, T, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, steps_ptr,
                 partials_ptr, inv_scale_ptr, lr_ptr, out_stats_ptr, counter_ptr, seed_ptr, scales_ptr, scale_cols,
                 P, p_stride_row, p_stride_col, one_minus_beta1, beta2, one_minus_beta2, log_beta1, log_beta2, eps,
                 weight_decay, max_norm, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
                 HAS_MASTER: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, CLIP: tl.constexpr,
                 ALIGNED: tl.constexpr, MASTER_FORMAT: tl.constexpr, STATE_BF16: tl.constexpr,
                 STATE_Q8: tl.constexpr, USE_SEED: tl.constexpr,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr, TBLOCK: tl.constexpr):
    norm, found_inf, coef = _prologue(partials_ptr, p_stride_row, p_stride_col, P, inv_scale_ptr, max_norm,
                                      out_stats_ptr, CLIP, PBLOCK)
    # A flagged step leaves every program without a single write (and without touching the counter).
    if found_inf == 0.0:
        lr = tl.load(lr_ptr).to(tl.float32)
        decay = 1.0 - lr * weight_decay
        lanes = tl.arange(0, BLOCK)
        for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
            row, param_ptr, grad_ptr, state, count, w_ptr = _step_chunk(
                table_ptr, chunks_ptr, c, master_ptr, PARAM_DTYPE, GRAD_DTYPE, HAS_MASTER, ALIGNED, CHUNK)
            w_ptr, exp_avg_c, exp_avg_sq_c = chunk_state_ptrs(w_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, state,
                                                              MASTER_FORMAT, STATE_BF16)
            # this parameter's step: t = steps[row] + 1; 1 - beta**t as -expm1(t * log(beta)), as the
            # reference computes it
            t = tl.load(steps_ptr + row).to(tl.float32) + 1.0
            # 8-bit moments: the chunk's first block in each row of state_scales ([2, scale_cols])
            sc1 = scales_ptr + state // QBLOCK
            sc2 = sc1 + scale_cols
            key = tl.full((), 0, tl.uint32)
            if USE_SEED:  # the stochastic rounding's key at this parameter's step
                key = _step_key(tl.load(seed_ptr), t)
            # m_hat / (sqrt(v_hat) + eps) as (lr / bc1 * sqrt(bc2)) * m / (sqrt(v) + eps * sqrt(bc2))
            sqrt_bc2 = tl.sqrt_rn(-_expm1(t * log_beta2))
            step_size = tl.div_rn(lr, -_expm1(t * log_beta1)) * sqrt_bc2
            eps_c = eps * sqrt_bc2
            full = count // BLOCK
            for b in range(0, full):
                _adam_block(param_ptr, grad_ptr, w_ptr, exp_avg_c, exp_avg_sq_c, sc1, sc2, b * BLOCK,
                            b * BLOCK + lanes, count, coef, decay, step_size, eps_c, one_minus_beta1, beta2,
                            one_minus_beta2, weight_decay, state, key, PARAM_DTYPE, HAS_MASTER,
                            DECOUPLED, MAXIMIZE, MASTER_FORMAT, STATE_BF16, STATE_Q8, USE_SEED, False, BLOCK)
            # the parameter's last, partial block
            if full * BLOCK < count:
                _adam_block(param_ptr, grad_ptr, w_ptr, exp_avg_c, exp_avg_sq_c, sc1, sc2, full * BLOCK,
                            full * BLOCK + lanes, count, coef, decay, step_size, eps_c, one_minus_beta1, beta2,
                            one_minus_beta2, weight_decay, state, key, PARAM_DTYPE, HAS_MASTER,
                            DECOUPLED, MAXIMIZE, MASTER_FORMAT, STATE_BF16, STATE_Q8, USE_SEED, True, BLOCK)
        _advance_steps(steps_ptr, table_ptr, T, counter_ptr, TBLOCK)


def _log(beta: float) -> float:
    # log(0) = -inf gives bias correction 1 - 0**t = 1, torch's value for beta = 0
    return math.log(beta) if beta > 0 else -math.inf


def adam_step_(plan, count, param_dtype, grad_dtype, master, exp_avg, exp_avg_sq, steps, partials, inv_scale, lr,
               out_stats, counter, beta1: float, beta2: float, eps: float, weight_decay: float, max_norm: float,
               decoupled: bool, maximize: bool = False, seed=None, state_scales=None) -> None:
    """One Adam (L2 decay) / AdamW (decoupled decay) step over the parameters of ``plan``; math as
    ``ops.reference.adam_step_``.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` from the partials, and for each parameter ``i``
    with a gradient ``w`` its master slice (or the parameter itself), ``m``, ``v`` its state slices and
    ``t = steps[i] + 1``, all in fp32::

        g = c * grad (negated if maximize);  AdamW: w *= 1 - lr * wd;  Adam: g += wd * w
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        s = sqrt(1 - beta2**t);  w -= (lr / (1 - beta1**t) * s) * m / (sqrt(v) + eps * s)
        param = round_to_nearest_even(w);  steps[i] = t;  out_stats = [norm, found_inf]

    plan: the step's tensor table (``count`` rows) and chunk list (``_common.make_plan``; a chunk a multiple
    of ``BLOCK``, ``CHUNK`` by default);
    param_dtype, grad_dtype: torch dtypes of every parameter / gradient (fp32/bf16/fp16; fp32 params when
    master is None); master (or None), exp_avg, exp_avg_sq: flat fp32 buffers laid out by ``state_layout``,
    16-byte aligned; steps: ``[count]`` fp32/fp64; inv_scale: 0-d fp32; lr: 0-d fp32/fp64; partials:
    ``[2, P]`` fp32 (any strides); out_stats: ``[2]`` fp32; counter: ``[1]`` int32 workspace holding 0, left
    at 0. When found_inf, only out_stats is written. Compact state (``_compact``, read from the buffers'
    dtypes): int16 master remainders, no master with bf16 params, bf16 moments, 8-bit (uint8) moments with their
    block scales ``state_scales`` (``[2, blocks]`` fp32, contiguous; the flat buffers laid out with parameters
    at multiples of ``_q8.QBLOCK``, which ``BLOCK`` is a multiple of); ``seed`` 0-d int64.
    """
    programs = max(grid_size(plan.num_chunks, MAX_PROGRAMS), 1)  # no chunk: out_stats is still written
    fmt = launch_format(param_dtype, master, exp_avg, seed)
    with device_guard(out_stats):
        _adam_kernel[(programs,)](
            plan.table, plan.chunks, plan.num_chunks, count, nonempty(master, out_stats),
            nonempty(exp_avg, out_stats), nonempty(exp_avg_sq, out_stats), nonempty(steps, out_stats),
            nonempty(partials, out_stats), inv_scale, lr, out_stats, counter, nonempty(seed, counter),
            nonempty(state_scales, out_stats), state_scales.shape[-1] if fmt.state_q8 else 0,
            partials.shape[1], partials.stride(0), partials.stride(1),
            *map(f32, (1.0 - beta1, beta2, 1.0 - beta2, _log(beta1), _log(beta2), eps, weight_decay, max_norm)),
            PARAM_DTYPE=TL_DTYPES[param_dtype], GRAD_DTYPE=TL_DTYPES[grad_dtype], HAS_MASTER=fmt.has_fp32_master,
            DECOUPLED=bool(decoupled), MAXIMIZE=bool(maximize), CLIP=not math.isinf(max_norm),
            ALIGNED=plan.aligned, MASTER_FORMAT=fmt.master, STATE_BF16=fmt.state_bf16, STATE_Q8=fmt.state_q8,
            USE_SEED=seed is not None, CHUNK=plan.chunk, BLOCK=BLOCK, PBLOCK=PBLOCK, TBLOCK=TBLOCK, num_warps=NUM_WARPS,
            **LAUNCH_OPTIONS)
