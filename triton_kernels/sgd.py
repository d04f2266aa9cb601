"""K2 for SGD (momentum, dampening, Nesterov, weight decay, maximize): prologue, then one pass.

Same grid, prologue, skip and step-counter scheme as :mod:`ampfused.triton_kernels.adam` (see there): every
program reads the old ``step`` (it decides the first momentum step, ``step == 0``), and the last program to
arrive at the integer counter stores ``step + 1``.
"""
import math

import triton
import triton.language as tl

from ._common import (LAUNCH_OPTIONS, _advance_step, _load, _prologue, _round_to, _store, _to_f32, chunking,
                      device_guard)

BLOCK = 1024
NUM_WARPS = 4
MAX_PROGRAMS = 1024
PBLOCK = 512


@triton.jit
def _sgd_block(param_ptr, grad_ptr, master_ptr, buf_ptr, idx, n, coef, lr, first, momentum,
               one_minus_dampening, weight_decay, HAS_MASTER: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
               NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, MASKED: tl.constexpr):
    g = _to_f32(_load(grad_ptr, idx, n, MASKED)) * coef
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        w = _load(master_ptr, idx, n, MASKED).to(tl.float32)
    else:
        w = _load(param_ptr, idx, n, MASKED).to(tl.float32)
    g = tl.where(weight_decay != 0.0, g + weight_decay * w, g)
    if HAS_MOMENTUM:
        b = _load(buf_ptr, idx, n, MASKED).to(tl.float32)
        # on the first step the buffer may hold anything: it is replaced, never read into the math
        b = tl.where(first, g, b * momentum + one_minus_dampening * g)
        _store(buf_ptr, idx, n, b, MASKED)
        if NESTEROV:
            g = g + momentum * b
        else:
            g = b
    w_new = w - lr * g
    if HAS_MASTER:
        _store(master_ptr, idx, n, w_new, MASKED)
    _store(param_ptr, idx, n, _round_to(w_new, param_ptr.dtype.element_ty), MASKED)


@triton.jit(do_not_specialize=["n"])
def _sgd_kernel(param_ptr, grad_ptr, master_ptr, buf_ptr, step_ptr, partials_ptr, inv_scale_ptr, lr_ptr,
                out_stats_ptr, counter_ptr,
                n, iters, P, p_stride_row, p_stride_col,
                momentum, one_minus_dampening, weight_decay, max_norm,
                HAS_MASTER: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                MAXIMIZE: tl.constexpr, CLIP: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
    pid = tl.program_id(0)
    norm, found_inf, coef = _prologue(partials_ptr, p_stride_row, p_stride_col, P, inv_scale_ptr, max_norm,
                                      out_stats_ptr, CLIP, PBLOCK)
    if found_inf == 0.0:
        step = tl.load(step_ptr)
        first = step == 0.0
        lr = tl.load(lr_ptr).to(tl.float32)
        lanes = tl.arange(0, BLOCK)
        first_block = pid.to(tl.int64) * iters
        full_blocks = n // BLOCK
        off = first_block * BLOCK
        for _ in range(0, tl.minimum(full_blocks - first_block, iters).to(tl.int32)):
            _sgd_block(param_ptr, grad_ptr, master_ptr, buf_ptr, off + lanes, n, coef, lr, first, momentum,
                       one_minus_dampening, weight_decay, HAS_MASTER, HAS_MOMENTUM, NESTEROV, MAXIMIZE, False)
            off += BLOCK
        if (pid == tl.num_programs(0) - 1) & (full_blocks * BLOCK < n):
            _sgd_block(param_ptr, grad_ptr, master_ptr, buf_ptr, full_blocks.to(tl.int64) * BLOCK + lanes, n,
                       coef, lr, first, momentum, one_minus_dampening, weight_decay, HAS_MASTER, HAS_MOMENTUM,
                       NESTEROV, MAXIMIZE, True)
        _advance_step(step_ptr, counter_ptr, step + 1.0)


def sgd_step_(param, grad, master, momentum_buf, step, partials, inv_scale, lr, out_stats, counter,
              momentum: float, dampening: float, weight_decay: float, nesterov: bool, max_norm: float,
              maximize: bool = False) -> None:
    """One SGD step with torch's semantics; math as ``ampfused.ops.reference.sgd_step_``.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` and ``w`` the master (or param) copy, in fp32::

        g = c * grad (negated if maximize);  g += wd * w
        momentum != 0:  b = g if step == 0 else momentum * b + (1 - dampening) * g
                        g = g + momentum * b if nesterov else b
        w -= lr * g;  param = round_to_nearest_even(w);  step += 1;  out_stats = [norm, found_inf]

    param: 1-D fp32/bf16/fp16 (fp32 when master is None); grad: 1-D fp32/bf16/fp16; master and
    momentum_buf (required when momentum != 0, else ignored): 1-D fp32; all of ``n`` elements, contiguous.
    step, inv_scale: 0-d fp32; lr: 0-d fp32/fp64; partials ``[2, P]`` fp32; out_stats ``[2]`` fp32;
    counter ``[1]`` int32 workspace holding 0. When found_inf, only out_stats is written.
    """
    n = param.numel()
    programs, iters = chunking(n, BLOCK, MAX_PROGRAMS)
    programs = max(programs, 1)
    has_momentum = momentum != 0
    with device_guard(param):
        _sgd_kernel[(programs,)](
            param, grad, master if master is not None else param,
            momentum_buf if has_momentum else param, step, partials, inv_scale, lr, out_stats, counter,
            n, iters, partials.shape[1], partials.stride(0), partials.stride(1),
            momentum, 1.0 - dampening, weight_decay, max_norm,
            HAS_MASTER=master is not None, HAS_MOMENTUM=has_momentum, NESTEROV=bool(nesterov),
            MAXIMIZE=bool(maximize), CLIP=not math.isinf(max_norm), BLOCK=BLOCK, PBLOCK=PBLOCK,
            num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
