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

**Compact state modes** (docs/state-precision.md) move fewer bytes because they keep less: the same count with
each stream at its stored width (``mode_bytes_per_param``), bf16 gradients and model:

================================  ======  =======================  ============  ===========  =====
mode (bench variant suffix)        grad    weights (read + write)   moments       model write  total
================================  ======  =======================  ============  ===========  =====
fp32 master (no suffix)            2       master 4 + 4             4 x 4         2            28
``+rem`` remainders                2       weight 2 + 2, rem 2 + 2  4 x 4         (it is)      26
``+bf16m`` bf16 moments            2       master 4 + 4             4 x 2         2            20
``+rem+bf16m``                     2       weight 2 + 2, rem 2 + 2  4 x 2         (it is)      18
``+sr`` no master                  2       weight 2 + 2             4 x 4         (it is)      22
``+sr+bf16m``                      2       weight 2 + 2             4 x 2         (it is)      14
================================  ======  =======================  ============  ===========  =====

The same counts apply to other libraries' optimizers in the same formats (torchao's and optimi's bf16
stochastic-rounding AdamW: 14; optimi's Kahan sum adds a bf16 compensation read and written: 18; 8-bit
block-wise moments: 2 x (1 + 1) plus the per-block scales, 4-bit half that).

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


MASTER_KINDS = ("fp32", "remainder", "none")


def mode_bytes_per_param(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: str = "fp32",
                         moment_bytes: float = FP32, extra_bytes: float = 0.0) -> float:
    """Least bytes per parameter a step in a state mode must move, gradients read once (table above).

    ``master``: ``"fp32"`` (a separate fp32 master, or the fp32 parameter itself), ``"remainder"`` (the weight
    plus a 16-bit remainder, both read and written) or ``"none"`` (the weight is the only copy);
    ``moment_bytes``: stored bytes of each moment element (4 fp32, 2 bf16, 1 8-bit, 0.5 4-bit; per-block
    scales included by the caller as a fraction); ``extra_bytes``: any other state read and written once per
    element (stored width, e.g. 2 for a bf16 Kahan compensation)."""
    if master not in MASTER_KINDS:
        raise ValueError(f"master must be one of {MASTER_KINDS}, got {master!r}")
    g = torch.empty((), dtype=grad_dtype).element_size()
    p = torch.empty((), dtype=param_dtype).element_size()
    moments = 2 * 2 * moment_bytes  # exp_avg and exp_avg_sq, each read and written
    if master == "fp32":
        return minimal_bytes_per_param(grad_dtype, param_dtype, param_dtype != torch.float32) - 4 * FP32 + moments \
            + 2 * extra_bytes
    if param_dtype == torch.float32:
        raise ValueError(f"master={master!r} applies to 16-bit parameters, not fp32 ones")
    weights = 2 * p + (2 * 2 if master == "remainder" else 0)  # the weight (and its remainder) read + written
    return g + weights + moments + 2 * extra_bytes


def two_pass_bytes_per_param(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: bool) -> int:
    """Bytes per parameter when the gradients are read twice (norm/check pass, then update pass)."""
    return minimal_bytes_per_param(grad_dtype, param_dtype, master) + torch.empty((), dtype=grad_dtype).element_size()


def minimal_bytes(numel: int, grad_dtype: torch.dtype, param_dtype: torch.dtype, master: bool) -> int:
    return numel * minimal_bytes_per_param(grad_dtype, param_dtype, master)


def copy_bytes(nbytes: int) -> int:
    """Bytes a ``dst.copy_(src)`` of ``nbytes`` moves: one read and one write."""
    return 2 * nbytes


# Lion (one moment, no step count in its math): per parameter it reads the gradient, reads and writes the weights
# (an fp32 master and the rounded model copy written, the weight and its remainder, or the weight alone) and its
# one moment. bf16 gradients and model: fp32 master 2 + 8 + 8 + 2 = 20 B (22 with the gradients read twice, the
# two-kernel step); remainders 2 + 8 + 8 = 18; no master with an 8-bit moment 2 + 4 + 2 x 1.016 = 8.03.

def lion_bytes_per_param(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: str = "fp32",
                         moment_bytes: float = FP32) -> float:
    """Least bytes per parameter a Lion step in a state mode must move, gradients read once (``master`` and
    ``moment_bytes`` as :func:`mode_bytes_per_param`)."""
    if master not in MASTER_KINDS:
        raise ValueError(f"master must be one of {MASTER_KINDS}, got {master!r}")
    g = torch.empty((), dtype=grad_dtype).element_size()
    p = torch.empty((), dtype=param_dtype).element_size()
    if master == "fp32":
        weights = 2 * FP32 + p if param_dtype != torch.float32 else 2 * p
    else:
        weights = 2 * p + (2 * 2 if master == "remainder" else 0)
    return g + weights + 2 * moment_bytes


def lion_state_bytes_per_param(master: str = "fp32", moment_bytes: float = FP32) -> float:
    """Bytes of Lion's optimizer state per bf16 parameter (the weight itself not counted)."""
    return {"fp32": FP32, "remainder": 2, "none": 0}[master] + moment_bytes


# ---- Adafactor (docs/adafactor.md) ------------------------------------------------------------------------
# Bytes per parameter of each pass of the Adafactor step as the kernels run it, from DRAM when nothing stays in
# cache (the row and column vectors, O(rows + columns) per matrix, are left out). A matrix (factored):
#   K1       the norm and inf check: read g
#   sums     rows: read g and the weight (for its RMS); columns: read g again (columns outer)
#   update   the update's sum of squares: read g (the factors are small)
#   apply    read g, read and write the weight, write the model copy
# A vector (unfactored): K1; one pass for the variance (read + write, fp32) and both sums (g, the weight); one to
# apply (g, the variance, the weight read and written, the model copy).
# The CUDA kernel cuts a matrix into bands of whole rows and reads a band's g for its column sums right after its
# row sums (from L2, counted here as DRAM); its fp64 column partial sums add 16 / rows-per-band B/param (about 0.8
# at 768 columns), left out like the factors.
ADAFACTOR_PASSES = ("K1", "sums", "update", "apply")


def adafactor_pass_bytes(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: str = "fp32",
                         factored: bool = True) -> dict:
    """``{pass: bytes per parameter}`` of one Adafactor step (passes above; ``master`` as in
    :func:`mode_bytes_per_param`: ``"fp32"``, ``"remainder"`` or ``"none"``)."""
    if master not in MASTER_KINDS:
        raise ValueError(f"master must be one of {MASTER_KINDS}, got {master!r}")
    g = torch.empty((), dtype=grad_dtype).element_size()
    p = torch.empty((), dtype=param_dtype).element_size()
    if master == "fp32" and param_dtype != torch.float32:
        w_read, w_write = FP32, FP32 + p  # the master, and the model copy written from it
    elif master == "remainder":
        w_read, w_write = p + 2, p + 2  # the weight and its 16-bit remainder
    else:
        w_read, w_write = p, p  # the weight is the only copy
    if factored:
        return {"K1": g, "sums": 2 * g + w_read, "update": g, "apply": g + w_read + w_write}
    return {"K1": g, "sums": g + w_read + 2 * FP32, "apply": g + FP32 + w_read + w_write}


def adafactor_bytes_per_param(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: str = "fp32",
                              factored: bool = True) -> int:
    """The sum of :func:`adafactor_pass_bytes` (fp32 master, bf16 matrices: 24; remainders 22; no master 16)."""
    return sum(adafactor_pass_bytes(grad_dtype, param_dtype, master, factored).values())


# ---- Muon (docs/muon.md) ----------------------------------------------------------------------------------------
# Bytes per element of a Muon matrix in each pass of the step as the Triton kernels run it (and as the native ones
# will), from DRAM; the iteration between the passes works on the bf16 scratch with torch's matmuls (its traffic
# grows with the matrix's size, not per element: left out):
#   K1      the norm and inf check: read g
#   A       momentum (phase 1): read g, read and write the momentum, write the iteration's input (bf16)
#   NS      read the input, write the output, both bf16 (the iteration's first read and last write; its
#           intermediate matrices are m x m, not per element)
#   B       update (phase 2): read the output (bf16), read and write the weight, write the model copy
MUON_PASSES = ("K1", "A", "NS", "B")


def muon_pass_bytes(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: str = "fp32",
                    momentum_bytes: float = FP32) -> dict:
    """``{pass: bytes per element}`` of one Muon step over a matrix (passes above; ``master`` as in
    :func:`mode_bytes_per_param`; ``momentum_bytes`` 4, 2 or 1 + 4/256 for fp32, bf16 or 8-bit momentum)."""
    if master not in MASTER_KINDS:
        raise ValueError(f"master must be one of {MASTER_KINDS}, got {master!r}")
    g = torch.empty((), dtype=grad_dtype).element_size()
    p = torch.empty((), dtype=param_dtype).element_size()
    if master == "fp32" and param_dtype != torch.float32:
        w_read, w_write = FP32, FP32 + p
    elif master == "remainder":
        w_read, w_write = p + 2, p + 2
    else:
        w_read, w_write = p, p
    return {"K1": g, "A": g + 2 * momentum_bytes + 2, "NS": 2 + 2, "B": 2 + w_read + w_write}


def muon_bytes_per_param(grad_dtype: torch.dtype, param_dtype: torch.dtype, master: str = "fp32",
                         momentum_bytes: float = FP32) -> float:
    """The sum of :func:`muon_pass_bytes` (bf16 matrices: fp32 master and momentum 30; remainders 28; no master,
    bf16 momentum 20)."""
    return sum(muon_pass_bytes(grad_dtype, param_dtype, master, momentum_bytes).values())
