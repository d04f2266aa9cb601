// The per-element math of a split step's two passes (ampfused/ops/specs.py: OpSpec.split), shared by the CPU and
// CUDA drivers of the ops that split, on math.h's conversions and AF_HD. A function of whole tensors runs between
// the passes on torch's operations, over a bf16 scratch laid out as the state: the first pass writes each
// element's input of it there (a momentum and Nesterov's interpolation, torch.lerp's forms), the second reads its
// output back and applies it to the weight (decoupled decay, a step size per parameter).
#pragma once

#include "ampfused/math.h"

namespace ampfused {

// The first pass's constants (one set for the step).
struct SplitMomentumConsts {
  float coef;          // inv_scale * clip coefficient
  float lerp_w;        // 1 - momentum (the momentum's lerp)
  float nesterov_w;    // momentum (Nesterov's lerp)
  int small, nesterov_small, nesterov;
};

AF_HD SplitMomentumConsts make_split_momentum_consts(float coef, double momentum, bool nesterov) {
  SplitMomentumConsts c;
  c.coef = coef;
  c.lerp_w = float(1.0 - momentum);
  c.nesterov_w = float(momentum);
  c.small = fabsf(c.lerp_w) < 0.5f ? 1 : 0;
  c.nesterov_small = fabsf(c.nesterov_w) < 0.5f ? 1 : 0;
  c.nesterov = nesterov ? 1 : 0;
  return c;
}

// The first pass, one element: the momentum m updated in place; returns the input of the function between the
// passes (in fp32: the caller rounds it to bf16, to nearest even, as torch's copy into the bf16 scratch does).
//   g = c * grad;  m = lerp(m, g, 1 - momentum);  u = lerp(g, m, momentum) if nesterov else m
// With kForm other than kSplitAny the form is known when compiling (split_momentum_form_of: a momentum of at least
// 0.5, the common case, with or without Nesterov), so the selects fold away; the operations and their order are
// the same, so are the bits.
enum SplitForm : int { kSplitAny = 0, kSplitNesterov = 1, kSplitHeavyBall = 2 };

template <int kForm>
AF_HD float split_momentum_form(float g, float& m, const SplitMomentumConsts& c) {
  const bool small = kForm != kSplitAny ? true : c.small != 0;
  const bool nesterov = kForm != kSplitAny ? kForm == kSplitNesterov : c.nesterov != 0;
  const bool nesterov_small = kForm != kSplitAny ? false : c.nesterov_small != 0;
  g = g * c.coef;
  m = lerp_torch(m, g, c.lerp_w, small);
  return nesterov ? lerp_torch(g, m, c.nesterov_w, nesterov_small) : m;
}

AF_HD int split_momentum_form_of(const SplitMomentumConsts& c) {
  if (c.small == 0) return kSplitAny;
  if (!c.nesterov) return kSplitHeavyBall;
  return c.nesterov_small == 0 ? kSplitNesterov : kSplitAny;
}

AF_HD float split_momentum(float g, float& m, const SplitMomentumConsts& c) {
  return split_momentum_form<kSplitAny>(g, m, c);
}

// The second pass's constants, per parameter: formed in fp64 from the lr tensor's value and rounded once to
// fp32, as the references form them (torch from its Python floats).
struct SplitUpdateConsts {
  float decay;  // 1 - lr * weight_decay
  float step;   // lr * ratio (the parameter's factor of the lr)
  int use_decay;
};

AF_HD SplitUpdateConsts make_split_update_consts(double lr, double weight_decay, double ratio) {
  SplitUpdateConsts c;
  c.use_decay = weight_decay != 0.0 ? 1 : 0;
  c.decay = float(1.0 - lr * weight_decay);
  c.step = float(lr * ratio);
  return c;
}

// The second pass, one element: o is the function's output (a bf16 value), w the weight (its master).
//   w = w * decay - step * o
// Returns the update's term (step * o), which the health sums read.
AF_HD float split_update(float o, float& w, const SplitUpdateConsts& c) {
  const float wd = c.use_decay ? w * c.decay : w;
  const float term = c.step * o;
  w = wd - term;
  return term;
}

}  // namespace ampfused
