"""The dynamic loss-scale update on the device: one program, no host read, bit-exact with torch.

torch (``torch._amp_update_scale_``) forms ``scale * factor`` in fp64 and rounds the result to fp32. Without
fp64 arithmetic that product is reproduced exactly on integers: ``factor`` is split on the host into its
53-bit integer mantissa (two int32 halves), exponent and sign; the kernel forms the exact 77-bit product of
the two mantissas in two int64 limbs, rounds it to 53 bits (the fp64 result), then rounds that to fp32
(normal or subnormal, overflow to inf), both to nearest even: the double rounding of the fp64 path included.
A factor exactly representable in fp32 (2.0, 0.5, 1.5, ...) takes one fp32 multiply instead: the 48-bit
product is exact in fp64, so torch rounds once, as the multiply does (no flush of subnormals: Triton
emits ``mul.rn.f32``); zero, inf and NaN scales take it too.
"""
import math

import numpy as np
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, device_guard


@triton.jit
def _mul_f64_rn(s, f32, exact, f_hi, f_lo, f_exp, f_neg):
    """``fp32(fp64(s) * f)`` elementwise for fp32 ``s``, where ``|f| = (f_hi * 2**26 + f_lo) * 2**f_exp``,
    ``f_neg`` its sign and ``f32 = fp32(f)``; ``exact`` says ``f32 == f``."""
    bits = s.to(tl.int32, bitcast=True)
    expo = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # Normalise the mantissa to [2**23, 2**24): subnormal scales get shifted up by their leading zeros, found
    # from the exponent of their (exact) conversion to fp32.
    lead = ((mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    is_sub = (expo == 0) & (mant != 0)
    shift = tl.where(is_sub, 23 - lead, 0)
    ms = tl.where(is_sub, mant << shift, mant | 0x800000).to(tl.int64)
    es = tl.where(is_sub, -149 - shift, expo - 150)
    # exact product ms * (f_hi * 2**26 + f_lo) = hi * 2**26 + lo, with hi in [2**49, 2**52) and lo < 2**26
    a = ms * f_hi
    b = ms * f_lo
    hi = a + (b >> 26)
    lo = b & 0x3FFFFFF
    # round to 53 significant bits (fp64): drop d1 (23..25) low bits, all inside lo
    width = 50 + (hi >= (1 << 50)).to(tl.int32) + (hi >= (1 << 51)).to(tl.int32)
    d1 = width - 27
    q = (hi << (26 - d1)) | (lo >> d1)
    rem = lo & ((1 << d1) - 1)
    half = 1 << (d1 - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int64)
    e2 = es + f_exp + d1                   # the fp64 value is q * 2**e2, q in [2**52, 2**53]
    # round to fp32: keep 24 bits, or fewer where the result is subnormal (its ulp is 2**-149)
    d2 = tl.minimum(tl.maximum(-149 - e2, 29), 62).to(tl.int64)
    q2 = q >> d2
    rem2 = q & ((1 << d2) - 1)
    half2 = 1 << (d2 - 1)
    q2 = q2 + ((rem2 > half2) | ((rem2 == half2) & ((q2 & 1) == 1))).to(tl.int64)
    # fp32 bits: exponent field e2 + d2 + 150 over the 23 mantissa bits (a carry into 2**24 bumps the
    # exponent by itself; the subnormal case lands on exponent field 0); then overflow saturates to inf
    out = ((e2 + d2 + 150) << 23) + q2 - (1 << 23)
    out = tl.where(q2 == 0, 0, tl.minimum(out, 0x7F800000))
    out = out.to(tl.int32)
    out = tl.where((bits < 0) != (f_neg != 0), out | -2147483648, out)
    via_int = out.to(tl.float32, bitcast=True)
    plain = exact | (expo == 0xFF) | ((expo == 0) & (mant == 0))
    return tl.where(plain, s * f32, via_int)


# integers equal to 1 would otherwise become compile-time constants (one more compiled variant each)
@triton.jit(do_not_specialize=["growth_interval", "g_exact", "g_neg", "b_exact", "b_neg"])
def _update_scale_kernel(scale_ptr, tracker_ptr, found_inf_ptr, inv_scale_ptr, skipped_ptr, growth_interval,
                         g32, g_exact, g_hi, g_lo, g_exp, g_neg, b32, b_exact, b_hi, b_lo, b_exp, b_neg,
                         HAS_INV: tl.constexpr, HAS_SKIPPED: tl.constexpr):
    scale = tl.load(scale_ptr)
    tracker = tl.load(tracker_ptr)
    overflow = tl.load(found_inf_ptr) > 0.0
    successful = tracker + 1
    grow = (~overflow) & (successful == growth_interval)
    grown = _mul_f64_rn(scale, g32, g_exact != 0, g_hi, g_lo, g_exp, g_neg)
    backed_off = _mul_f64_rn(scale, b32, b_exact != 0, b_hi, b_lo, b_exp, b_neg)
    grown_ok = grow & (grown == grown) & (tl.abs(grown) != float("inf"))
    new_scale = tl.where(overflow, backed_off, tl.where(grown_ok, grown, scale))
    tl.store(scale_ptr, new_scale)
    tl.store(tracker_ptr, tl.where(overflow | grow, 0, successful))
    if HAS_INV:
        # fp32(1 / fp64(scale)), torch's form: the fp64 quotient of two fp32 numbers rounds to the correctly
        # rounded fp32 quotient (53 >= 2 * 24 + 2 bits), which div_rn gives without fp64
        tl.store(inv_scale_ptr, tl.div_rn(1.0, new_scale))
    if HAS_SKIPPED:
        tl.store(skipped_ptr, tl.load(skipped_ptr) + overflow.to(tl.int64))


def split_factor(f: float) -> tuple:
    """``(f32, exact, hi, lo, exp, neg)`` with ``|f| = (hi * 2**26 + lo) * 2**exp`` (hi < 2**27, lo < 2**26),
    ``f32 = fp32(f)`` and ``exact = f32 == f``: the arguments of ``_mul_f64_rn`` for a finite factor."""
    f = float(f)
    with np.errstate(over="ignore"):
        f32 = float(np.float32(f))
    exact = int(math.isfinite(f32) and f32 == f)
    if f == 0:  # taken by the plain product; the integer path needs a nonzero mantissa
        return f32, 1, 1 << 26, 0, 0, 0
    mant, e = math.frexp(abs(f))            # |f| = mant * 2**e, mant in [0.5, 1)
    m53 = int(mant * (1 << 53))             # exact: the 53-bit integer mantissa
    return f32, exact, m53 >> 26, m53 & ((1 << 26) - 1), e - 53, int(f < 0)


def update_scale_(scale, growth_tracker, found_inf, growth_factor: float, backoff_factor: float,
                  growth_interval: int, inv_scale=None, skipped=None) -> None:
    """torch's dynamic loss-scale rule in place, bit for bit with ``torch._amp_update_scale_``.

    scale: 0-d fp32; growth_tracker: 0-d int32; found_inf: 0-d fp32 (> 0 means overflow)::

        overflow:  scale = fp32(fp64(scale) * backoff_factor);  tracker = 0
        else:      tracker += 1; if tracker == growth_interval:
                       scale = fp32(fp64(scale) * growth_factor) if that is finite;  tracker = 0
        inv_scale = fp32(1 / fp64(scale))  (when given: 0-d fp32);  skipped += overflow  (when given: 0-d int64)
    """
    with device_guard(scale):
        _update_scale_kernel[(1,)](scale, growth_tracker, found_inf,
                                   inv_scale if inv_scale is not None else scale,
                                   skipped if skipped is not None else growth_tracker, int(growth_interval),
                                   *split_factor(growth_factor), *split_factor(backoff_factor),
                                   HAS_INV=inv_scale is not None, HAS_SKIPPED=skipped is not None, num_warps=1,
                                   **LAUNCH_OPTIONS)
