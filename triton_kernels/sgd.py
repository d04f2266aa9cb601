"""K2 for SGD (momentum, dampening, Nesterov, weight decay, maximize) over a list of parameters: prologue,
then one pass.

Same tensor table, chunk list, persistent grid, prologue, skip and step-count scheme as
:mod:`ampfused.triton_kernels.adam` (see there): per chunk a program reads its parameter's old step count
(it decides the first momentum step, ``steps[i] == 0``), and the last program to arrive at the integer
counter adds 1 to the count of every parameter that has a gradient.
"""
import math

import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, TL_DTYPES, device_guard, f32, grid_size, nonempty, _advance_steps, _load,
                      _prologue, _step_chunk, _to_f32)
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
def _sgd_block(param_ptr, grad_ptr, w_ptr, buf_ptr, sc_ptr, base, idx, n, coef, lr, first, momentum,
               one_minus_dampening, weight_decay, state, key, PARAM_DTYPE: tl.constexpr,
               HAS_MASTER: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               MAXIMIZE: tl.constexpr, MASTER_FORMAT: tl.constexpr, STATE_BF16: tl.constexpr,
               STATE_Q8: tl.constexpr, USE_SEED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    # idx = base + arange(BLOCK): lanes of the chunk; sc_ptr: the chunk's first block scale (Q8)
    g = _to_f32(_load(grad_ptr, idx, n, MASKED)) * coef
    if MAXIMIZE:
        g = -g
    w = _load_weight(param_ptr, w_ptr, idx, n, MASTER_FORMAT, MASKED)
    g = tl.where(weight_decay != 0.0, g + weight_decay * w, g)
    r = _draw(key, state + idx, USE_SEED)  # one per element, at its index in the flat buffers
    if HAS_MOMENTUM:
        if STATE_Q8:
            b = _load_q8(buf_ptr, sc_ptr, idx, n, base, True, MASKED, BLOCK)
        else:
            b = _load_state(buf_ptr, idx, n, MASKED)
        # on the first step the buffer may hold anything: it is replaced, never read into the math
        b = tl.where(first, g, b * momentum + one_minus_dampening * g)
        if STATE_Q8:
            _store_q8(buf_ptr, sc_ptr, idx, n, base, b, _stream_bits(r, 1), True, MASKED, BLOCK)
        else:
            _store_state(buf_ptr, idx, n, b, _stream_bits(r, 1), STATE_BF16, MASKED)
        if NESTEROV:
            g = g + momentum * b
        else:
            g = b
    w_new = w - lr * g
    _store_weight(param_ptr, w_ptr, idx, n, w_new, r, PARAM_DTYPE, HAS_MASTER, MASTER_FORMAT, MASKED)


@triton.jit(do_not_specialize=["num_chunks", "T", "P"])
def _sgd_kernel(table_ptr, chunks_ptr, num_chunks, T, master_ptr, buf_ptr, steps_ptr, partials_ptr, inv_scale_ptr,
                lr_ptr, out_stats_ptr, counter_ptr, seed_ptr, scales_ptr, P, p_stride_row, p_stride_col,
                momentum, one_minus_dampening, weight_decay, max_norm,
                PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, CLIP: tl.constexpr,
                ALIGNED: tl.constexpr, MASTER_FORMAT: tl.constexpr, STATE_BF16: tl.constexpr,
                STATE_Q8: tl.constexpr, USE_SEED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr,
                TBLOCK: tl.constexpr):
    norm, found_inf, coef = _prologue(partials_ptr, p_stride_row, p_stride_col, P, inv_scale_ptr, max_norm,
                                      out_stats_ptr, CLIP, PBLOCK)
    if found_inf == 0.0:
        lr = tl.load(lr_ptr).to(tl.float32)
        lanes = tl.arange(0, BLOCK)
        for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
            row, param_ptr, grad_ptr, state, count, w_ptr = _step_chunk(
                table_ptr, chunks_ptr, c, master_ptr, PARAM_DTYPE, GRAD_DTYPE, HAS_MASTER, ALIGNED, CHUNK)
            w_ptr, buf_c, _unused = chunk_state_ptrs(w_ptr, master_ptr, buf_ptr, buf_ptr, state, MASTER_FORMAT,
                                                     STATE_BF16)
            step = tl.load(steps_ptr + row)
            first = step == 0.0  # this parameter's first step
            key = tl.full((), 0, tl.uint32)
            if USE_SEED:  # the stochastic rounding's key at this parameter's step t = steps[row] + 1
                key = _step_key(tl.load(seed_ptr), step.to(tl.float32) + 1.0)
            sc = scales_ptr + state // QBLOCK  # 8-bit momentum: the chunk's first block scale (state_scales[0])
            full = count // BLOCK
            for b in range(0, full):
                _sgd_block(param_ptr, grad_ptr, w_ptr, buf_c, sc, b * BLOCK, b * BLOCK + lanes, count, coef, lr,
                           first, momentum, one_minus_dampening, weight_decay, state, key, PARAM_DTYPE,
                           HAS_MASTER, HAS_MOMENTUM, NESTEROV, MAXIMIZE, MASTER_FORMAT, STATE_BF16, STATE_Q8,
                           USE_SEED, False, BLOCK)
            if full * BLOCK < count:
                _sgd_block(param_ptr, grad_ptr, w_ptr, buf_c, sc, full * BLOCK, full * BLOCK + lanes, count, coef,
                           lr, first, momentum, one_minus_dampening, weight_decay, state, key, PARAM_DTYPE,
                           HAS_MASTER, HAS_MOMENTUM, NESTEROV, MAXIMIZE, MASTER_FORMAT, STATE_BF16, STATE_Q8,
                           USE_SEED, True, BLOCK)
        _advance_steps(steps_ptr, table_ptr, T, counter_ptr, TBLOCK)


def sgd_step_(plan, count, param_dtype, grad_dtype, master, momentum_buf, steps, partials, inv_scale, lr, out_stats,
              counter, momentum: float, dampening: float, weight_decay: float, nesterov: bool, max_norm: float,
              maximize: bool = False, seed=None, state_scales=None) -> None:
    """One SGD step with torch's semantics over the parameters of ``plan``; math as
    ``ops.reference.sgd_step_``.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` and, for each parameter ``i`` with a gradient,
    ``w`` its master slice (or the parameter itself) and ``b`` its momentum slice, in fp32::

        g = c * grad (negated if maximize);  g += wd * w
        momentum != 0:  b = g if steps[i] == 0 else momentum * b + (1 - dampening) * g
                        g = g + momentum * b if nesterov else b
        w -= lr * g;  param = round_to_nearest_even(w);  steps[i] += 1;  out_stats = [norm, found_inf]

    Tensors as :func:`ampfused.triton_kernels.adam.adam_step_`; momentum_buf (a flat fp32 buffer) is
    required when momentum != 0, else ignored; a uint8 one holds 8-bit codes with their block scales in
    ``state_scales`` (``[1, blocks]`` fp32, contiguous). When found_inf, only out_stats is written.
    """
    programs = max(grid_size(plan.num_chunks, MAX_PROGRAMS), 1)
    has_momentum = momentum != 0
    fmt = launch_format(param_dtype, master, momentum_buf if has_momentum else None, seed)
    with device_guard(out_stats):
        _sgd_kernel[(programs,)](
            plan.table, plan.chunks, plan.num_chunks, count, nonempty(master, out_stats),
            nonempty(momentum_buf if has_momentum else None, out_stats), nonempty(steps, out_stats),
            nonempty(partials, out_stats), inv_scale, lr, out_stats, counter, nonempty(seed, counter),
            nonempty(state_scales if fmt.state_q8 else None, out_stats), partials.shape[1], partials.stride(0), partials.stride(1),
            *map(f32, (momentum, 1.0 - dampening, weight_decay, max_norm)),
            PARAM_DTYPE=TL_DTYPES[param_dtype], GRAD_DTYPE=TL_DTYPES[grad_dtype], HAS_MASTER=fmt.has_fp32_master,
            HAS_MOMENTUM=has_momentum, NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
            CLIP=not math.isinf(max_norm), ALIGNED=plan.aligned, MASTER_FORMAT=fmt.master,
            STATE_BF16=fmt.state_bf16, STATE_Q8=fmt.state_q8, USE_SEED=seed is not None, CHUNK=plan.chunk, BLOCK=BLOCK, PBLOCK=PBLOCK,
            TBLOCK=TBLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
