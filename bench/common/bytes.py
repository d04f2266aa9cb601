"""The byte model: the least memory traffic one AdamW step must cause, the yardstick for every variant.

Per parameter, one step with gradient clipping, an inf/NaN check and fp32 optimizer math must at least

=====================  ==============================  =========================  ==========
what                   fp32 master + bf16/fp16 model   fp32 model (no master)     bytes
=====================  ==============================  =========================  ==========
read the gradient      2 (bf16/fp16)                   4                          g
read + write weights   master 4 + 4                    param 4 + 4                8
read + write exp_avg   4 + 4                           4 + 4                      8
read + write exp_avg_sq 4 + 4                          4 + 4                      8
write the model copy   2 (round(master))               (it is the master)         p
total ("minimal")      **28**                          **28**
=====================  ==============================  =========================  ==========

The gradient is counted **once**. Clipping and the skip-on-overflow rule need the global norm and the
inf/NaN flag before any weight may change, so an implementation that does not keep the gradients in cache
reads them twice (``two_pass``: 30 B/param with bf16/fp16 gradients, 32 with fp32; the ampfused two-kernel
step). Where the gradients fit in the last-level cache the second read costs no DRAM traffic, which is why
the single-launch CUDA step is 28 B/param "from DRAM". Counting 28 makes the yardstick a true lower bound:
no correct step can move fewer bytes, so ``minimal_bytes / copy_bandwidth`` is a floor on step time (the
roofline) and ``pct_of_copy_bw`` can only be over 100% if a cache held part of the working set.

Not counted (negligible or not required): the per-step scalars (partials, scale, step, lr), the zeroing of
gradients (outside the step), and write-allocate reads of destinations that a CPU performs for stores that
are not streaming. The bandwidths the results are compared with are counted the same way, ``2 * nbytes``
(read + write) as STREAM does: ``dst.copy_(src)`` (the CSV's ``copy_gbps``) and an in-place ``x.add_(1)``.
On CPUs the copy pays a hidden write-allocate read of ``dst`` that a step, whose large streams are
read-modify-write of the same lines, mostly does not; there a step can exceed 100% of ``copy_gbps``, and the
read-modify-write figure is the stricter yardstick (shown next to it in the table).

For comparison, torch's recipe with an fp32 master moves about 112 B/param with ``AdamW(foreach=True)`` and
about 60 with ``fused=True`` (see the design notes); those are estimates, not part of the yardstick.
"""
from __future__ import annotations

import torch

FP32 = 4


def minimal_bytes_per_param(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: bool) -> int:
    """Least bytes per parameter a step must move (gradients read once); see the module docstring."""
    g = torch.empty((), dtype=grad_dtype).element_size()
    p = torch.empty((), dtype=param_dtype).element_size()
    states = 2 * FP32 + 2 * FP32  # exp_avg and exp_avg_sq, each read and written
    if master:
        return g + 2 * FP32 + states + p  # read grad, read+write master, states, write the rounded param
    return g + 2 * p + states  # read grad, read+write param, states


def two_pass_bytes_per_param(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: bool) -> int:
    """Bytes per parameter when the gradients are read twice (norm/check pass, then update pass)."""
    return minimal_bytes_per_param(grad_dtype, param_dtype, master) + torch.empty((), dtype=grad_dtype).element_size()


def minimal_bytes(numel: int, grad_dtype: torch.dtype, param_dtype: torch.dtype, master: bool) -> int:
    return numel * minimal_bytes_per_param(grad_dtype, param_dtype, master)


def copy_bytes(nbytes: int) -> int:
    """Bytes a ``dst.copy_(src)`` of ``nbytes`` moves: one read and one write."""
    return 2 * nbytes
