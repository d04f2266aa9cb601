"""K2 for Lion over a list of parameters: prologue, then one pass.

Same tensor table, chunk list, persistent grid, prologue, skip and step-count scheme as
:mod:`ampfused.triton_kernels.adam` (see there). Lion keeps one moment (``exp_avg``); the step count is not in its
math and only keys the stochastic rounding's draws.
"""
import math

import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, TL_DTYPES, device_guard, f32, grid_size, nonempty, _advance_steps, _load,
                      _lerp, _prologue, _step_chunk, _to_f32)
from ._compact import (_draw, _load_state, _load_weight, _step_key, _store_state, _store_weight, _stream_bits,
                       chunk_state_ptrs, launch_format)
from ._q8 import QBLOCK, _load_q8, _store_q8

BLOCK = 1024
CHUNK = 8 * BLOCK
NUM_WARPS = 4
MAX_PROGRAMS = 1024
PBLOCK = 512
TBLOCK = 1024


@triton.jit
def _lion_block(param_ptr, grad_ptr, w_ptr, m_ptr, sc_ptr, base, idx, n, coef, lr, decay, one_minus_beta1,
                one_minus_beta2, state, key, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                MAXIMIZE: tl.constexpr, MASTER_FORMAT: tl.constexpr, STATE_BF16: tl.constexpr,
                STATE_Q8: tl.constexpr, USE_SEED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    # idx = base + arange(BLOCK): lanes of the chunk; sc_ptr: the chunk's first block scale (Q8)
    g = _to_f32(_load(grad_ptr, idx, n, MASKED)) * coef
    if MAXIMIZE:
        g = -g
    w = _load_weight(param_ptr, w_ptr, idx, n, MASTER_FORMAT, MASKED)
    if STATE_Q8:
        m = _load_q8(m_ptr, sc_ptr, idx, n, base, True, MASKED, BLOCK)
    else:
        m = _load_state(m_ptr, idx, n, MASKED)
    c = _lerp(m, g, one_minus_beta1)
    u = (c > 0.0).to(tl.float32) - (c < 0.0).to(tl.float32)  # sign, 0 at 0 and NaN (torch.sign on the CPU)
    w_new = w * decay - lr * u
    m_new = _lerp(m, g, one_minus_beta2)
    r = _draw(key, state + idx, USE_SEED)  # one per element, at its index in the flat buffers
    if STATE_Q8:
        _store_q8(m_ptr, sc_ptr, idx, n, base, m_new, _stream_bits(r, 1), True, MASKED, BLOCK)
    else:
        _store_state(m_ptr, idx, n, m_new, _stream_bits(r, 1), STATE_BF16, MASKED)
    _store_weight(param_ptr, w_ptr, idx, n, w_new, r, PARAM_DTYPE, HAS_MASTER, MASTER_FORMAT, MASKED)


@triton.jit(do_not_specialize=["num_chunks", "T", "P"])
def _lion_kernel(table_ptr, chunks_ptr, num_chunks, T, master_ptr, m_ptr, steps_ptr, partials_ptr, inv_scale_ptr,
                 lr_ptr, out_stats_ptr, counter_ptr, seed_ptr, scales_ptr, P, p_stride_row, p_stride_col,
                 one_minus_beta1, one_minus_beta2, weight_decay, max_norm, PARAM_DTYPE: tl.constexpr,
                 GRAD_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, MAXIMIZE: tl.constexpr, CLIP: tl.constexpr,
                 ALIGNED: tl.constexpr, MASTER_FORMAT: tl.constexpr, STATE_BF16: tl.constexpr,
                 STATE_Q8: tl.constexpr, USE_SEED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 PBLOCK: tl.constexpr, TBLOCK: tl.constexpr):
    norm, found_inf, coef = _prologue(partials_ptr, p_stride_row, p_stride_col, P, inv_scale_ptr, max_norm,
                                      out_stats_ptr, CLIP, PBLOCK)
    if found_inf == 0.0:  # a flagged step: no program writes anything
        lr = tl.load(lr_ptr).to(tl.float32)
        decay = 1.0 - lr * weight_decay
        lanes = tl.arange(0, BLOCK)
        for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
            row, param_ptr, grad_ptr, state, count, w_ptr = _step_chunk(
                table_ptr, chunks_ptr, c, master_ptr, PARAM_DTYPE, GRAD_DTYPE, HAS_MASTER, ALIGNED, CHUNK)
            w_ptr, m_c, _unused = chunk_state_ptrs(w_ptr, master_ptr, m_ptr, m_ptr, state, MASTER_FORMAT, STATE_BF16)
            key = tl.full((), 0, tl.uint32)
            if USE_SEED:  # the stochastic rounding's key at this parameter's step t = steps[row] + 1
                key = _step_key(tl.load(seed_ptr), tl.load(steps_ptr + row).to(tl.float32) + 1.0)
            sc = scales_ptr + state // QBLOCK  # 8-bit moment: the chunk's first block scale (state_scales[0])
            full = count // BLOCK
            for b in range(0, full):
                _lion_block(param_ptr, grad_ptr, w_ptr, m_c, sc, b * BLOCK, b * BLOCK + lanes, count, coef, lr, decay,
                            one_minus_beta1, one_minus_beta2, state, key, PARAM_DTYPE, HAS_MASTER, MAXIMIZE,
                            MASTER_FORMAT, STATE_BF16, STATE_Q8, USE_SEED, False, BLOCK)
            if full * BLOCK < count:
                _lion_block(param_ptr, grad_ptr, w_ptr, m_c, sc, full * BLOCK, full * BLOCK + lanes, count, coef, lr,
                            decay, one_minus_beta1, one_minus_beta2, state, key, PARAM_DTYPE, HAS_MASTER,
                            MAXIMIZE, MASTER_FORMAT, STATE_BF16, STATE_Q8, USE_SEED, True, BLOCK)
        _advance_steps(steps_ptr, table_ptr, T, counter_ptr, TBLOCK)


def lion_step_(plan, count, param_dtype, grad_dtype, master, exp_avg, steps, partials, inv_scale, lr, out_stats,
               counter, beta1: float, beta2: float, weight_decay: float, max_norm: float, maximize: bool = False,
               seed=None, state_scales=None) -> None:
    """One Lion step over the parameters of ``plan``; math as ``ops.reference.lion_step_``.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` and, for each parameter ``i`` with a gradient,
    ``w`` its master slice (or the parameter itself) and ``m`` its ``exp_avg`` slice, in fp32::

        g = c * grad (negated if maximize);  u = sign(lerp(m, g, 1 - beta1))
        w = w * (1 - lr * wd) - lr * u;  m = lerp(m, g, 1 - beta2)
        param = round_to_nearest_even(w);  steps[i] += 1;  out_stats = [norm, found_inf]

    Tensors as :func:`ampfused.triton_kernels.adam.adam_step_` with one moment (a uint8 ``exp_avg`` holds 8-bit
    codes with their block scales in ``state_scales``, ``[1, blocks]`` fp32). When found_inf, only out_stats is
    written.
    """
    programs = max(grid_size(plan.num_chunks, MAX_PROGRAMS), 1)
    fmt = launch_format(param_dtype, master, exp_avg, seed)
    with device_guard(out_stats):
        _lion_kernel[(programs,)](
            plan.table, plan.chunks, plan.num_chunks, count, nonempty(master, out_stats), nonempty(exp_avg, out_stats),
            nonempty(steps, out_stats), nonempty(partials, out_stats), inv_scale, lr, out_stats, counter,
            nonempty(seed, counter), nonempty(state_scales if fmt.state_q8 else None, out_stats), partials.shape[1],
            partials.stride(0), partials.stride(1), *map(f32, (1.0 - beta1, 1.0 - beta2, weight_decay, max_norm)),
            PARAM_DTYPE=TL_DTYPES[param_dtype], GRAD_DTYPE=TL_DTYPES[grad_dtype], HAS_MASTER=fmt.has_fp32_master,
            MAXIMIZE=bool(maximize), CLIP=not math.isinf(max_norm), ALIGNED=plan.aligned, MASTER_FORMAT=fmt.master,
            STATE_BF16=fmt.state_bf16, STATE_Q8=fmt.state_q8, USE_SEED=seed is not None, CHUNK=plan.chunk,
            BLOCK=BLOCK, PBLOCK=PBLOCK, TBLOCK=TBLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
