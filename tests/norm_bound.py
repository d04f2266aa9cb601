"""A bound on the error of a gradient norm computed in fp32, derived for any order of summation.

The design's tolerance for a fast result (twice the fp32 reference's own error against fp64, plus a floor) does
not fit a norm: the fp32 reference is one summation order among many, and on the CPU it happens to be a very
accurate one, so its error says nothing about the error another order, equally correct, may have. The bound
below is what rounding allows for the way the backends form the norm, whatever the order.

Notation: u = 2**-24 (fp32 unit roundoff), w = 2**-53 (fp64), gamma_k(r) = k r / (1 - k r). The result is
N^ = fl32(sqrt(S^)) where S^ approximates S = sum_i x_i**2 over the n unscaled gradient elements x_i (exact
fp32 values: the unscale multiplies by a power of two).

1. Squares: fl32(x_i * x_i) = x_i**2 (1 + d_i), |d_i| <= u (an underflowing square is off by at most 2**-150
   instead; step 5).
2. fp32 sums: every backend adds squares in fp32 in groups of at most L terms, in some order (a lane's run,
   a vector, a tree). A sum of nonnegative terms formed by additions in any order carries each term through at
   most L - 1 additions, each a factor (1 + e), |e| <= u, so the group's sum is sum_i q_i (1 + t_i) with
   |t_i| <= gamma_{L-1}(u) (Higham, Accuracy and Stability, Lemma 3.1 applied along each term's path). The
   CPU and CUDA kernels make L = kSquaresPerSum = 8 (csrc/include/ampfused/math.h: 8 consecutive squares in
   fp32, then fp64); a backend whose fp32 sums run further (Triton's lanes, the reference's per-tensor sum) is
   counted with L = n, the bound for any order.
3. The partial a block or lane writes is rounded to fp32 once more: one more factor (1 + u).
   Together: each square reaches the fp64 part with a relative error of at most gamma_{L+1}(u).
4. fp64: group sums and partials are added in fp64, at most n - 1 additions on any term's path, every term
   nonnegative: a relative error of at most gamma_{n-1}(w) more. So |S^ - S| <= eta S with
   eta = (1 + gamma_{L+1}(u)) (1 + gamma_{n-1}(w)) - 1.
5. Underflow: a square below fp32's smallest normal is rounded with an absolute error of at most 2**-150 (fp32
   additions of subnormals are exact), so S^ may be off by n 2**-150 more; sqrt(a + b) <= sqrt(a) + sqrt(b)
   turns that into at most sqrt(n 2**-150 (1 + eta)) on the norm.
6. sqrt in fp64 (relative w), then rounded to fp32 (relative u):
   |N^ - N| <= ((1 + eta)**0.5 (1 + w) (1 + u) - 1) N + sqrt(n 2**-150 (1 + eta)).

The oracle it is compared with, torch's clip_grad_norm_ in fp64 over T tensors (a norm per tensor, then the
norm of those norms), is itself within rho64 = (1 + gamma_{n+T+4}(w))**0.5 - 1 of N relatively: per tensor the
squares and sums give gamma_{n_t}(w), its sqrt and the re-squaring of that rounded sqrt three more roundings,
the sum over tensors T - 1 additions, the last sqrt one rounding. Hence

    |N^ - N64| <= (rho + rho64) N64 / (1 - rho64) + sqrt(n 2**-150 (1 + eta)).

To first order the tolerance is (L + 3) u / 2 relative: 5.5 u (3.3e-7) for the CPU and CUDA kernels, whatever
order their threads and blocks add in.
"""
from __future__ import annotations

import math
from typing import Optional

U32 = 2.0 ** -24
U64 = 2.0 ** -53
# csrc/include/ampfused/math.h kSquaresPerSum: squares added in fp32 before the fp64 accumulation
SQUARES_PER_FP32_SUM = {"cpu": 8, "cuda": 8}


def gamma(k: int, u: float) -> float:
    assert k * u < 1, (k, u)
    return k * u / (1 - k * u)


def norm_error_bound(norm64: float, n: int, tensors: int, backend: Optional[str]) -> float:
    """The largest |N^ - N64| rounding allows (module docstring) for n elements in ``tensors`` gradients, the
    norm formed by ``backend`` (None or a backend without a fixed fp32 group: any order)."""
    n = max(int(n), 1)
    group = SQUARES_PER_FP32_SUM.get(backend or "", n)
    eta = (1 + gamma(group + 1, U32)) * (1 + gamma(n - 1, U64)) - 1
    rho = math.sqrt(1 + eta) * (1 + U64) * (1 + U32) - 1
    rho64 = math.sqrt(1 + gamma(n + tensors + 4, U64)) - 1
    return (rho + rho64) * abs(norm64) / (1 - rho64) + math.sqrt(n * 2.0 ** -150 * (1 + eta))


def assert_norm_within_bound(name: str, norm: float, norm64: float, n: int, tensors: int,
                             backend: Optional[str]) -> None:
    """``norm`` (the fast fp32 result) within :func:`norm_error_bound` of the fp64 oracle ``norm64``; an
    infinite or NaN norm must be so in the oracle too."""
    if not math.isfinite(norm64):
        assert (math.isnan(norm) and math.isnan(norm64)) or norm == norm64, f"{name}: {norm!r} vs {norm64!r}"
        return
    bound = norm_error_bound(norm64, n, tensors, backend)
    err = abs(norm - norm64)
    assert err <= bound, (f"{name}: got {norm!r}, fp64 oracle {norm64!r}: |error| {err:.3g} > bound {bound:.3g} "
                          f"({n} elements, {tensors} tensors, backend {backend}: tests/norm_bound.py)")
