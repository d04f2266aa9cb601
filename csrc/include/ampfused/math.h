// Per-element math of every ampfused op, written once and shared by the CPU and CUDA drivers.
//
// The reference (ampfused/ops/reference.py) is the specification; each function here names the
// expression of the reference it implements. Everything is fp32 arithmetic in the reference's order,
// and the build turns floating-point contraction off (-ffp-contract=off, nvcc --fmad=false), so a
// driver's result depends only on these expressions, never on the instruction set or thread count.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define AF_HD __host__ __device__ __forceinline__
#else
#define AF_HD inline __attribute__((always_inline))
#endif

namespace ampfused {

// Element type codes shared with the Python side (ampfused/_native.py: DTYPE_CODES).
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
// The 8-bit moments' storage code (StepArgs::state_dtype; ampfused/_native.py: STATE_CODES).
constexpr int kStateU8 = 4;

// Storage types of the 16-bit formats: raw bits, converted by the functions below.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

// Calls f with a value of the storage type of element code `code` (fp32 for any other code): the host-side
// dispatch of every backend's typed kernels.
template <typename F>
inline void with_type(int code, F&& f) {
  switch (code) {
    case kBF16: f(bf16_t{}); break;
    case kF16: f(f16_t{}); break;
    default: f(float{}); break;
  }
}

AF_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

AF_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// 1 if x is inf or NaN, else 0: an integer so drivers OR it without a branch.
AF_HD uint32_t nonfinite(float x) { return (f32_bits(x) & 0x7fffffffu) >= 0x7f800000u ? 1u : 0u; }

// |x| as ordered integer bits: a driver keeps the running max (one integer op per element) and
// tests it once with nonfinite_abs_bits, instead of testing every element.
AF_HD uint32_t abs_bits(float x) { return f32_bits(x) & 0x7fffffffu; }
AF_HD bool nonfinite_abs_bits(uint32_t max_abs_bits) { return max_abs_bits >= 0x7f800000u; }

// ---- conversions (round to nearest even; NaN stays NaN) ----------------------------------------

AF_HD float to_f32(float x) { return x; }
AF_HD float to_f32(bf16_t x) { return f32_from_bits(uint32_t(x.bits) << 16); }

// IEEE half -> float without F16C: exact, branch-free (a select), NaN and inf kept. The normal path
// rebiases the exponent with one exact multiply by 2^-112; subnormals come from a magic subtraction.
AF_HD float to_f32(f16_t x) {
  const uint32_t w = uint32_t(x.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normal = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = two_w < (1u << 27) ? f32_bits(subnormal) : f32_bits(normal);
  return f32_from_bits(sign | r);
}

template <typename T> AF_HD T from_f32(float f);

template <> AF_HD float from_f32<float>(float f) { return f; }

// float -> bfloat16, round to nearest even; a NaN keeps its sign and top payload bits, made quiet.
template <> AF_HD bf16_t from_f32<bf16_t>(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return bf16_t{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
}

// float -> IEEE half, round to nearest even, overflow to inf, NaN -> quiet NaN with the sign kept
// (the same bits as c10::Half). Rounding is done by one fp32 addition that aligns the mantissa.
template <> AF_HD f16_t from_f32<f16_t>(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return f16_t{uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

// ---- norm / check (K1) ---------------------------------------------------------------------------

// reference._sumsq_and_flag: u = fp32(g) * inv_scale; the square is rounded to fp32 (so a finite
// gradient can still give an infinite norm). Drivers add kSquaresPerSum squares in fp32 (cheap, and
// short enough to stay accurate) and accumulate those sums in fp64, in an order fixed by the sizes.
constexpr int kSquaresPerSum = 8;
AF_HD float unscaled(float g, float inv_scale) { return g * inv_scale; }

// reference.clip_coef: min(1, max_norm / (norm + 1e-6)) as torch evaluates it in fp32
// (max_norm / t is reciprocal(t) * max_norm); exactly 1 when max_norm is inf; NaN stays NaN.
AF_HD float clip_coef(float norm, double max_norm) {
  if (fabs(max_norm) == INFINITY) return 1.0f;
  const float c = (1.0f / (norm + 1e-6f)) * float(max_norm);
  return c > 1.0f ? 1.0f : c;
}

// reference._prologue: coef = inv_scale * clip_coef(norm), both fp32.
AF_HD float step_coef(float inv_scale, float norm, double max_norm) {
  return inv_scale * clip_coef(norm, max_norm);
}

// reference.adam_step_: t = step.to(fp32) + 1.
AF_HD double next_step(double step) { return double(float(step) + 1.0f); }

// reference.expm1_series: P(x) = 1 + x/2! + x^2/3! + ... + x^8/9!, so that exp(x) - 1 = x P(x).
AF_HD float expm1_series(float x) {
  float p = float(1.0 / 362880.0);
  p = p * x + float(1.0 / 40320.0);
  p = p * x + float(1.0 / 5040.0);
  p = p * x + float(1.0 / 720.0);
  p = p * x + float(1.0 / 120.0);
  p = p * x + float(1.0 / 24.0);
  p = p * x + float(1.0 / 6.0);
  p = p * x + 0.5f;
  return p * x + 1.0f;
}

// reference.expm1_nonpositive: exp(x) - 1 for x <= 0 from fp32 IEEE operations only (the same bits on every
// backend; a math library's expm1 differs by device): x P(x) above -0.5, else exp(r) = 1 + r P(r) after
// x = k ln2 + r, scaled by 2^k (exact), less 1; -1 below -24.
AF_HD float expm1_nonpositive(float x) {
  if (x >= -0.5f) return expm1_series(x) * x;
  if (!(x >= -24.0f)) return -1.0f;
  const float k = floorf(x * float(1.4426950408889634) + 0.5f);
  const float r = (x - k * 0.693359375f) - k * float(-2.12194440e-4);
  return (1.0f + r * expm1_series(r)) * f32_from_bits(uint32_t(int32_t(k) + 127) << 23) - 1.0f;
}

// reference.log_beta, on the host: log(beta) rounded to fp32 (-inf for beta = 0).
inline float log_beta(double beta) { return beta > 0.0 ? float(std::log(beta)) : -INFINITY; }

// reference.bias_correction: 1 - beta**t in fp32 as -expm1(t * log(beta)).
AF_HD float bias_correction(float log_beta, float t) { return -expm1_nonpositive(t * log_beta); }

// ---- optimizer updates (K2) ------------------------------------------------------------------------

// reference.lerp: torch.lerp(a, b, w) in the form torch picks by the weight's size (small: |w| < 0.5), each
// operation rounded as written.
AF_HD float lerp_torch(float a, float b, float w, bool small) {
  const float d = b - a;
  return small ? a + w * d : b - d * (1.0f - w);
}

// Per-step constants of Adam/AdamW, fp32, derived once per step by make_adam_consts.
struct AdamConsts {
  float coef;        // inv_scale * clip coefficient
  float decay;       // AdamW: 1 - lr * weight_decay (1 for Adam)
  float l2;          // Adam: weight_decay (0 for AdamW)
  float lerp_w;      // 1 - beta1
  float beta2, one_minus_beta2;
  float step_size;   // lr / (1 - beta1**t) * sqrt(1 - beta2**t)
  float eps;         // eps * sqrt(1 - beta2**t)
  int maximize, use_l2, lerp_small;
};

// log_beta1, log_beta2: log_beta(beta1), log_beta(beta2) from the host.
AF_HD AdamConsts make_adam_consts(float coef, float lr, float t, double beta1, double beta2, float log_beta1,
                                  float log_beta2, double eps, double weight_decay, bool decoupled, bool maximize) {
  AdamConsts c;
  c.coef = coef;
  c.decay = (decoupled && weight_decay != 0.0) ? 1.0f - lr * float(weight_decay) : 1.0f;
  c.use_l2 = (!decoupled && weight_decay != 0.0) ? 1 : 0;
  c.l2 = float(weight_decay);
  c.lerp_w = float(1.0 - beta1);
  c.lerp_small = fabsf(c.lerp_w) < 0.5f ? 1 : 0;
  c.beta2 = float(beta2);
  c.one_minus_beta2 = float(1.0 - beta2);
  const float bc2_sqrt = sqrtf(bias_correction(log_beta2, t));
  c.step_size = lr / bias_correction(log_beta1, t) * bc2_sqrt;
  c.eps = float(eps) * bc2_sqrt;
  c.maximize = maximize ? 1 : 0;
  return c;
}

// reference.adam_step_, one element: g is the raw gradient in fp32; w, m, v are updated in place. With kPlain
// the step's form is known when compiling: no L2 term (use_l2 == 0), lerp's small-weight form (lerp_small ==
// 1) and maximize == kMaximize, so the selects fold away; the operations and their order are the same, so
// are the bits. The CPU kernels run that form when a step's constants allow. Returns the update's term (what
// is subtracted from the decayed weight), which the health sums read (reference_common.moved).
template <bool kPlain, bool kMaximize = false>
AF_HD float adam_update_form(float g, float& w, float& m, float& v, const AdamConsts& c) {
  const bool maximize = kPlain ? kMaximize : c.maximize != 0;
  const bool use_l2 = kPlain ? false : c.use_l2 != 0;
  const bool lerp_small = kPlain ? true : c.lerp_small != 0;
  g = g * c.coef;
  g = maximize ? -g : g;
  g = use_l2 ? g + c.l2 * w : g;
  float wn = w * c.decay;
  // torch.lerp(m, g, 1 - beta1): the form torch picks by the weight's size
  const float d = g - m;
  const float mn = lerp_small ? m + c.lerp_w * d : g - d * (1.0f - c.lerp_w);
  const float vn = v * c.beta2 + (c.one_minus_beta2 * g) * g;
  // m_hat / (sqrt(v_hat) + eps) with numerator and denominator times sqrt(1 - beta2**t): one division
  const float denom = sqrtf(vn) + c.eps;
  const float term = (c.step_size * mn) / denom;
  wn = wn - term;
  w = wn;
  m = mn;
  v = vn;
  return term;
}

AF_HD float adam_update(float g, float& w, float& m, float& v, const AdamConsts& c) {
  return adam_update_form<false>(g, w, m, v, c);
}

struct SgdConsts {
  float coef, weight_decay, momentum, one_minus_dampening, lr;
  int maximize, use_wd, use_momentum, nesterov, first;
};

AF_HD SgdConsts make_sgd_consts(float coef, float lr, float step, double momentum, double dampening,
                                double weight_decay, bool nesterov, bool maximize) {
  SgdConsts c;
  c.coef = coef;
  c.weight_decay = float(weight_decay);
  c.use_wd = weight_decay != 0.0 ? 1 : 0;
  c.momentum = float(momentum);
  c.use_momentum = momentum != 0.0 ? 1 : 0;
  c.one_minus_dampening = float(1.0 - dampening);
  c.nesterov = nesterov ? 1 : 0;
  c.first = step == 0.0f ? 1 : 0;
  c.lr = lr;
  c.maximize = maximize ? 1 : 0;
  return c;
}

// reference.sgd_step_, one element: w and the momentum buffer b are updated in place (b untouched
// without momentum); returns the update's term (lr * g).
AF_HD float sgd_update(float g, float& w, float& b, const SgdConsts& c) {
  g = g * c.coef;
  g = c.maximize ? -g : g;
  g = c.use_wd ? g + c.weight_decay * w : g;
  if (c.use_momentum) {
    const float bn = c.first ? g : b * c.momentum + c.one_minus_dampening * g;
    g = c.nesterov ? g + c.momentum * bn : bn;
    b = bn;
  }
  const float term = c.lr * g;
  w = w - term;
  return term;
}

// ---- compact state (ampfused/ops/state_precision.py) ---------------------------------------------------

// How a step keeps its master weights: an fp32 buffer (or fp32 parameters that are their own master), the
// 16-bit remainders of bf16 parameters, or none (bf16 parameters rounded stochastically).
enum MasterFormat : int { kMasterF32 = 0, kMasterRemainder = 1, kMasterNone = 2 };
// Streams of the stochastic rounding: the weight, state1 (exp_avg / momentum_buf), state2 (exp_avg_sq), each
// rounding with its rotation of the element's one draw (stream_bits).
enum RandomStream : uint32_t { kStreamWeight = 0, kStreamState1 = 1, kStreamState2 = 2 };

// state_precision.mix32: a 32-bit integer hash (a bijection).
AF_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// state_precision.step_key: one parameter's key at its step t (the step being taken).
AF_HD uint32_t step_key(uint64_t seed, uint32_t t) {
  uint32_t k = mix32(uint32_t(seed) ^ 0x243F6A88u);
  k = mix32(k ^ uint32_t(seed >> 32));
  k = mix32(k ^ t);
  return mix32(k);
}

// The step number of a key: t = steps[i] + 1 (an integer-valued float), as an integer mod 2^32.
AF_HD uint32_t key_step(double t) { return uint32_t(uint64_t(int64_t(t))); }

// state_precision.random_bits: 32 bits for the element at `index` of the flat state buffers.
AF_HD uint32_t random_bits(uint32_t key, int64_t index) {
  const uint64_t u = uint64_t(index);
  return mix32((key + uint32_t(u >> 32) * 0x9E3779B9u) ^ uint32_t(u));
}

// state_precision.stream_bits: the bits stream S rounds with, the element's draw r rotated left by 11 S (one
// funnel shift on a GPU).
template <uint32_t S>
AF_HD uint32_t stream_bits(uint32_t r) {
  static_assert(S <= kStreamState2, "streams 0, 1, 2");
  constexpr uint32_t k = 11u * S;
  if constexpr (k == 0) {
    return r;
  } else {
    return (r << k) | (r >> (32u - k));
  }
}

// state_precision.round_stochastic: fp32 -> bf16 bits, up in magnitude with probability (dropped bits) / 2^16.
AF_HD uint16_t round_stochastic_bits(float f, uint32_t r) {
  const uint32_t u = f32_bits(f);
  const uint32_t nan = (u >> 16) | 0x40u;
  const uint32_t rounded = (u + (r & 0xFFFFu)) >> 16;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
AF_HD bf16_t round_stochastic(float f, uint32_t r) { return bf16_t{round_stochastic_bits(f, r)}; }

// state_precision.split_master, on bits: the master's bits with a NaN made quiet (low 16 bits cleared), then
// the bf16 weight (nearest, ties away from zero) and the remainder (the low 16 bits) of those bits.
AF_HD uint32_t master_code_bits(float master) {
  const uint32_t u = f32_bits(master);
  return (u & 0x7fffffffu) > 0x7f800000u ? ((u & 0xFFFF0000u) | 0x00400000u) : u;
}
AF_HD uint16_t weight_of_code(uint32_t u) {
  const uint32_t mag = u & 0x7fffffffu;
  return uint16_t(((u & 0x80000000u) >> 16) | ((mag >> 16) + ((mag & 0xFFFFu) >= 0x8000u ? 1u : 0u)));
}
AF_HD uint16_t remainder_of_code(uint32_t u) { return uint16_t(u & 0xFFFFu); }

AF_HD void split_master(float master, bf16_t& weight, uint16_t& remainder) {
  const uint32_t u = master_code_bits(master);
  weight = bf16_t{weight_of_code(u)};
  remainder = remainder_of_code(u);
}

// state_precision.join_master: the inverse of split_master (weight and remainder as raw 16-bit values).
AF_HD float join_master_bits(uint32_t w, uint32_t low) {
  const uint32_t high = (w & 0x7fffu) - (low >= 0x8000u ? 1u : 0u);
  return f32_from_bits(((w & 0x8000u) << 16) | (high << 16) | low);
}
AF_HD float join_master(bf16_t weight, uint16_t remainder) { return join_master_bits(weight.bits, remainder); }

// A 16-bit moment: loaded exactly, stored with stochastic rounding (an fp32 moment is stored as it is).
AF_HD float load_state(float s) { return s; }
AF_HD float load_state(bf16_t s) { return to_f32(s); }
AF_HD void store_state(float& dst, float s, uint32_t) { dst = s; }
AF_HD void store_state(bf16_t& dst, float s, uint32_t r) { dst = round_stochastic(s, r); }

// ---- 8-bit moments (state_precision.q8_*) ---------------------------------------------------------------
//
// Codes of a block-scaled 8-bit float: blocks of kQBlock elements of the flat buffers share an exponent E (the
// scale 2^(E - 127) in state_scales); signed codes (exp_avg, momentum_buf) have a sign bit, 4 exponent bits and
// 3 mantissa bits, unsigned ones (exp_avg_sq) 5 and 3. A driver computes a block's new values, takes the
// largest q8_abs_bits of them, the exponent q8_block_exponent of that, and encodes each value with it.

constexpr int kQBlock = 256;
constexpr int32_t kQ8MinExp = 40, kQ8MaxExp = 253;
template <bool kSigned> struct Q8Format;
template <> struct Q8Format<true> { static constexpr int32_t kTop = 14; static constexpr uint32_t kMaxMag = 0x7Fu; };
template <> struct Q8Format<false> { static constexpr int32_t kTop = 30; static constexpr uint32_t kMaxMag = 0xFFu; };

// state_precision.q8_abs_bits: |x|'s bits, a NaN counted as inf.
AF_HD uint32_t q8_abs_bits(float x) {
  const uint32_t a = f32_bits(x) & 0x7fffffffu;
  return a < 0x7f800000u ? a : 0x7f800000u;
}

AF_HD int32_t q8_clamp_exponent(int32_t e) { return e < kQ8MinExp ? kQ8MinExp : (e > kQ8MaxExp ? kQ8MaxExp : e); }

// state_precision.q8_block_exponent: E from the largest q8_abs_bits of a block's new values.
AF_HD int32_t q8_block_exponent(uint32_t max_abs_bits) { return q8_clamp_exponent(int32_t(max_abs_bits >> 23)); }

// state_precision.q8_scale / q8_exponent: the scale 2^(E - 127) and back (only the exponent field is read).
AF_HD float q8_scale(int32_t e) { return f32_from_bits(uint32_t(e) << 23); }
AF_HD int32_t q8_exponent(float scale) { return q8_clamp_exponent(int32_t((f32_bits(scale) >> 23) & 0xffu)); }

// The smallest q8_abs_bits whose code is normal (exponent field >= 1) at block exponent e.
template <bool kSigned>
AF_HD uint32_t q8_normal_floor(int32_t block_exp) {
  return uint32_t(block_exp - Q8Format<kSigned>::kTop + 1) << 23;
}

// q8_encode of x (fp32 bits u) for q8_abs_bits(x) >= q8_normal_floor(block_exp), the same bits in a few
// operations (a driver uses it for a block whose values are all that large): the code's exponent and mantissa
// fields are the fp32 bits' top 12 after the stochastic carry into them, rebased to the block's exponent by
// offset = q8_normal_offset(block_exp). q8_abs_bits's NaN clamp is not needed: a NaN's larger magnitude
// saturates the code as inf's does, since a block holding one has the largest exponent (kQ8MaxExp), where both
// are past kMaxMag.
template <bool kSigned>
AF_HD uint32_t q8_normal_offset(int32_t block_exp) { return uint32_t(block_exp - Q8Format<kSigned>::kTop) << 3; }
template <bool kSigned>
AF_HD uint32_t q8_encode_normal(uint32_t u, uint32_t r, uint32_t offset) {
  const uint32_t mag = (((u & 0x7fffffffu) + (r & 0xFFFFFu)) >> 20) - offset;
  const uint32_t sat = mag < Q8Format<kSigned>::kMaxMag ? mag : Q8Format<kSigned>::kMaxMag;
  return kSigned ? (sat | ((u >> 24) & 0x80u)) : sat;
}

// state_precision.q8_encode: x rounded stochastically (the low 20 bits of r) to the code of its block's
// exponent. A value below the codes' normal range (q8_abs_bits under q8_normal_floor) is first carried into it
// as the fp32 sum F + |x| (F the smallest normal code's value; rounded to nearest even; an fp32 subnormal |x|
// counts as 0), whose bits one binade down then take q8_encode_normal's path: one form for every value, a float
// add and a select where a variable shift and mask would be.
template <bool kSigned>
AF_HD uint8_t q8_encode(float x, int32_t block_exp, uint32_t r) {
  const uint32_t u = f32_bits(x);
  const uint32_t a = q8_abs_bits(x);
  const uint32_t floor = q8_normal_floor<kSigned>(block_exp);
  const float carried = f32_from_bits(a < 0x800000u ? 0u : a) + f32_from_bits(floor);
  const uint32_t w = a < floor ? f32_bits(carried) - 0x800000u : a;
  return uint8_t(q8_encode_normal<kSigned>(w | (u & 0x80000000u), r, q8_normal_offset<kSigned>(block_exp)));
}

// state_precision.q8_decode: a code -> its value at its block's exponent (exact: integer and power-of-two
// arithmetic; never an fp32 subnormal).
template <bool kSigned>
AF_HD float q8_decode(uint8_t code, int32_t block_exp) {
  const uint32_t c = code;
  const uint32_t mag = kSigned ? (c & 0x7fu) : c;
  const int32_t e = int32_t(mag >> 3);
  const uint32_t f = mag & 7u;
  const int32_t top = Q8Format<kSigned>::kTop;
  const float normal = f32_from_bits((uint32_t(block_exp - top + e) << 23) | (f << 20));
  const float sub = float(f) * f32_from_bits(uint32_t(block_exp - top - 2) << 23);
  const float v = e > 0 ? normal : sub;
  return (kSigned && (c & 0x80u)) ? -v : v;
}

// ---- scale policy --------------------------------------------------------------------------------

// reference.update_scale_ (torch._amp_update_scale_): products in fp64, rounded once to fp32.
AF_HD void update_scale(float* scale, int32_t* growth_tracker, float found_inf, double growth_factor,
                        double backoff_factor, int64_t growth_interval) {
  if (found_inf > 0.0f) {
    *scale = float(double(*scale) * backoff_factor);
    *growth_tracker = 0;
    return;
  }
  const int32_t successful = *growth_tracker + 1;
  if (successful == growth_interval) {
    const float grown = float(double(*scale) * growth_factor);
    if (!nonfinite(grown)) *scale = grown;
    *growth_tracker = 0;
  } else {
    *growth_tracker = successful;
  }
}

// The scale update's bookkeeping (reference.update_scale_): inv_scale = fp32(1 / fp64(scale)), the next
// unscale's factor as torch forms it; skipped counts the overflows. Either pointer may be null.
AF_HD void finish_scale_update(const float* scale, float found_inf, float* inv_scale, int64_t* skipped) {
  if (inv_scale) *inv_scale = float(1.0 / double(*scale));
  if (skipped && found_inf > 0.0f) *skipped += 1;
}

// Reads a 0-d step/lr scalar stored as fp32 (code 0) or fp64 (code 3).
AF_HD double read_scalar(const void* p, int code) {
  return code == 3 ? *static_cast<const double*>(p) : double(*static_cast<const float*>(p));
}
// Element k of a 1-D fp32 (code 0) / fp64 (code 3) array, e.g. one parameter's step count.
AF_HD void* scalar_at(void* p, int code, int64_t k) {
  return code == 3 ? static_cast<void*>(static_cast<double*>(p) + k) : static_cast<void*>(static_cast<float*>(p) + k);
}
AF_HD void add_one(void* p, int code) {
  if (code == 3) *static_cast<double*>(p) += 1.0;
  else *static_cast<float*>(p) += 1.0f;
}

}  // namespace ampfused
