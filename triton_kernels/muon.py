"""Muon's two elementwise passes over a list of parameters, around the Newton-Schulz iteration.

Same tensor table, chunk list, persistent grid, prologue, skip and step-count scheme as
:mod:`ampfused.triton_kernels.adam` (see there). The iteration needs whole matrices and runs on torch's matmuls
between the two launches (``ampfused.ops.call.StepCall.run_on``; over FSDP2's shards, after the pieces have been
joined on their owners). Both passes read and write ``scratch``, a bf16 buffer laid out as the state:

* phase 1: ``g = c * grad``, ``m = lerp(m, g, 1 - momentum)`` (written), Nesterov's ``lerp(g, m, momentum)``
  (or ``m``) rounded to bf16 into ``scratch``: the iteration's input;
* phase 2: the iteration's output from ``scratch``, ``w = w * decay - step[i] * O``, the parameter, its master,
  the step count.

``decay`` (0-d) and ``step`` (one per parameter: ``lr * ratio`` of its whole matrix) are fp32 device tensors that
the caller forms in fp64 from the fp32 ``lr`` and rounds once, as the reference does.
"""
import math

import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, TL_DTYPES, device_guard, f32, grid_size, nonempty, _advance_steps, _load,
                      _lerp, _prologue, _round_to, _step_chunk, _store, _to_f32)
from ._compact import (_draw, _load_state, _load_weight, _state16_ptr, _step_key, _store_state, _store_weight,
                       _stream_bits, chunk_state_ptrs, launch_format)
from ._q8 import QBLOCK, _load_q8, _store_q8

BLOCK = 1024
CHUNK = 8 * BLOCK
NUM_WARPS = 4
MAX_PROGRAMS = 1024
PBLOCK = 512
TBLOCK = 1024


@triton.jit
def _momentum_block(grad_ptr, m_ptr, sc_ptr, x_ptr, base, idx, n, coef, one_minus_momentum, momentum, state, key,
                    NESTEROV: tl.constexpr, STATE_BF16: tl.constexpr, STATE_Q8: tl.constexpr,
                    USE_SEED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    # phase 1; idx = base + arange(BLOCK): lanes of the chunk; x_ptr: the chunk's scratch
    g = _to_f32(_load(grad_ptr, idx, n, MASKED)) * coef
    if STATE_Q8:
        m = _load_q8(m_ptr, sc_ptr, idx, n, base, True, MASKED, BLOCK)
    else:
        m = _load_state(m_ptr, idx, n, MASKED)
    m_new = _lerp(m, g, one_minus_momentum)
    u = m_new
    if NESTEROV:
        u = _lerp(g, m_new, momentum)
    _store(x_ptr, idx, n, _round_to(u, tl.bfloat16), MASKED)
    r = _draw(key, state + idx, USE_SEED)  # one per element, at its index in the flat buffers
    if STATE_Q8:
        _store_q8(m_ptr, sc_ptr, idx, n, base, m_new, _stream_bits(r, 1), True, MASKED, BLOCK)
    else:
        _store_state(m_ptr, idx, n, m_new, _stream_bits(r, 1), STATE_BF16, MASKED)


@triton.jit
def _update_block(param_ptr, w_ptr, x_ptr, idx, n, decay, step, state, key, PARAM_DTYPE: tl.constexpr,
                  HAS_MASTER: tl.constexpr, MASTER_FORMAT: tl.constexpr, DECAY: tl.constexpr,
                  USE_SEED: tl.constexpr, MASKED: tl.constexpr):
    # phase 2
    o = _to_f32(_load(x_ptr, idx, n, MASKED))
    w = _load_weight(param_ptr, w_ptr, idx, n, MASTER_FORMAT, MASKED)
    if DECAY:
        w = w * decay
    w_new = w - step * o
    r = _draw(key, state + idx, USE_SEED)
    _store_weight(param_ptr, w_ptr, idx, n, w_new, r, PARAM_DTYPE, HAS_MASTER, MASTER_FORMAT, MASKED)


@triton.jit(do_not_specialize=["num_chunks", "T", "P"])
def _muon_kernel(table_ptr, chunks_ptr, num_chunks, T, master_ptr, m_ptr, scratch_ptr, steps_ptr, partials_ptr,
                 inv_scale_ptr, decay_ptr, step_ptr, out_stats_ptr, counter_ptr, seed_ptr, scales_ptr, P,
                 p_stride_row, p_stride_col, one_minus_momentum, momentum, max_norm, PHASE: tl.constexpr,
                 PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                 NESTEROV: tl.constexpr, DECAY: tl.constexpr, CLIP: tl.constexpr, ALIGNED: tl.constexpr,
                 MASTER_FORMAT: tl.constexpr, STATE_BF16: tl.constexpr, STATE_Q8: tl.constexpr,
                 USE_SEED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr,
                 TBLOCK: tl.constexpr):
    norm, found_inf, coef = _prologue(partials_ptr, p_stride_row, p_stride_col, P, inv_scale_ptr, max_norm,
                                      out_stats_ptr, CLIP, PBLOCK)
    if found_inf == 0.0:  # a flagged step: no program writes anything
        decay = 1.0
        if DECAY:
            decay = tl.load(decay_ptr)
        lanes = tl.arange(0, BLOCK)
        for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
            row, param_ptr, grad_ptr, state, count, w_ptr = _step_chunk(
                table_ptr, chunks_ptr, c, master_ptr, PARAM_DTYPE, GRAD_DTYPE, HAS_MASTER, ALIGNED, CHUNK)
            w_ptr, m_c, _unused = chunk_state_ptrs(w_ptr, master_ptr, m_ptr, m_ptr, state, MASTER_FORMAT, STATE_BF16)
            x_c = _state16_ptr(scratch_ptr, state)  # (laid out as the state: 4 elements an access)
            key = tl.full((), 0, tl.uint32)
            if USE_SEED:  # the stochastic rounding's key at this parameter's step t = steps[row] + 1
                key = _step_key(tl.load(seed_ptr), tl.load(steps_ptr + row).to(tl.float32) + 1.0)
            full = count // BLOCK
            if PHASE == 1:
                sc = scales_ptr + state // QBLOCK  # 8-bit momentum: the chunk's first block scale
                for b in range(0, full):
                    _momentum_block(grad_ptr, m_c, sc, x_c, b * BLOCK, b * BLOCK + lanes, count, coef,
                                    one_minus_momentum, momentum, state, key, NESTEROV, STATE_BF16, STATE_Q8,
                                    USE_SEED, False, BLOCK)
                if full * BLOCK < count:
                    _momentum_block(grad_ptr, m_c, sc, x_c, full * BLOCK, full * BLOCK + lanes, count, coef,
                                    one_minus_momentum, momentum, state, key, NESTEROV, STATE_BF16, STATE_Q8,
                                    USE_SEED, True, BLOCK)
            else:
                step = tl.load(step_ptr + row)
                for b in range(0, full):
                    _update_block(param_ptr, w_ptr, x_c, b * BLOCK + lanes, count, decay, step, state, key,
                                  PARAM_DTYPE, HAS_MASTER, MASTER_FORMAT, DECAY, USE_SEED, False)
                if full * BLOCK < count:
                    _update_block(param_ptr, w_ptr, x_c, full * BLOCK + lanes, count, decay, step, state, key,
                                  PARAM_DTYPE, HAS_MASTER, MASTER_FORMAT, DECAY, USE_SEED, True)
        if PHASE == 2:
            _advance_steps(steps_ptr, table_ptr, T, counter_ptr, TBLOCK)


def muon_step_(plan, count, param_dtype, grad_dtype, master, momentum_buffer, steps, partials, inv_scale, lr,
               out_stats, counter, momentum: float, nesterov: bool, weight_decay: float, ns_a: float, ns_b: float,
               ns_c: float, eps: float, ns_steps: int, adjust_lr_fn, max_norm: float, seed=None, state_scales=None,
               *, phase=None, scratch=None) -> None:
    """One of Muon's two passes over the parameters of ``plan`` (``phase`` 1 or 2, ``scratch`` the
    :class:`ampfused.ops.reference_muon.MuonScratch` between them); math as
    ``ops.reference_muon.muon_step_shard_``. Tensors as :func:`ampfused.triton_kernels.adam.adam_step_` with one
    moment. The iteration's hyperparameters are not read here (it runs between the passes). When found_inf, only
    out_stats is written."""
    if phase not in (1, 2) or scratch is None:
        raise ValueError("the triton backend runs muon_step_ as its two passes around the iteration "
                         "(StepCall.run_on gives each its phase and scratch)")
    if scratch.buffer.data_ptr() % 16:  # (its pieces are read and written 4 elements at a time)
        raise ValueError("the triton backend's muon_step_ needs its scratch 16-byte aligned (a buffer of its own, "
                         "as MuonScratch allocates it)")
    programs = max(grid_size(plan.num_chunks, MAX_PROGRAMS), 1)
    fmt = launch_format(param_dtype, master, momentum_buffer, seed)
    decay = step = None
    if phase == 2:  # formed in fp64 from the fp32 lr and rounded once, as the reference forms them
        decay, step = scratch.scalars(lr, weight_decay)
    with device_guard(out_stats):
        _muon_kernel[(programs,)](
            plan.table, plan.chunks, plan.num_chunks, count, nonempty(master, out_stats),
            nonempty(momentum_buffer, out_stats), scratch.buffer, nonempty(steps, out_stats),
            nonempty(partials, out_stats), inv_scale, nonempty(decay, out_stats), nonempty(step, out_stats),
            out_stats, counter, nonempty(seed, counter), nonempty(state_scales if fmt.state_q8 else None, out_stats),
            partials.shape[1], partials.stride(0), partials.stride(1),
            *map(f32, (1.0 - momentum, momentum, max_norm)), PHASE=phase,
            PARAM_DTYPE=TL_DTYPES[param_dtype], GRAD_DTYPE=TL_DTYPES[grad_dtype], HAS_MASTER=fmt.has_fp32_master,
            NESTEROV=bool(nesterov), DECAY=weight_decay != 0, CLIP=not math.isinf(max_norm), ALIGNED=plan.aligned,
            MASTER_FORMAT=fmt.master, STATE_BF16=fmt.state_bf16, STATE_Q8=fmt.state_q8, USE_SEED=seed is not None,
            CHUNK=plan.chunk, BLOCK=BLOCK, PBLOCK=PBLOCK, TBLOCK=TBLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
