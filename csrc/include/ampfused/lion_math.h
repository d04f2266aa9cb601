// Lion's per-element math (reference.lion_step_), shared by its CPU and CUDA drivers (csrc/cpu/steps/lion.h,
// csrc/cuda/lion.cu), on math.h's conversions and AF_HD.
#pragma once

#include "ampfused/math.h"

namespace ampfused {

// Per-step constants of Lion (reference.lion_step_), fp32.
struct LionConsts {
  float coef;            // inv_scale * clip coefficient
  float decay;           // 1 - lr * weight_decay (1 without decay: w * 1 is w)
  float lr;
  float lerp_w1, lerp_w2;  // 1 - beta1, 1 - beta2
  int small1, small2, maximize;
};

AF_HD LionConsts make_lion_consts(float coef, float lr, double beta1, double beta2, double weight_decay,
                                  bool maximize) {
  LionConsts c;
  c.coef = coef;
  c.decay = weight_decay != 0.0 ? 1.0f - lr * float(weight_decay) : 1.0f;
  c.lr = lr;
  c.lerp_w1 = float(1.0 - beta1);
  c.lerp_w2 = float(1.0 - beta2);
  c.small1 = fabsf(c.lerp_w1) < 0.5f ? 1 : 0;
  c.small2 = fabsf(c.lerp_w2) < 0.5f ? 1 : 0;
  c.maximize = maximize ? 1 : 0;
  return c;
}

// reference.lion_step_, one element: w and the moment m updated in place. sign(c) is (c > 0) - (c < 0), as
// torch.sign on the CPU (0 for 0 and NaN). Returns the update's term (lr * sign(c)).
AF_HD float lion_update(float g, float& w, float& m, const LionConsts& c) {
  g = g * c.coef;
  g = c.maximize ? -g : g;
  const float cm = lerp_torch(m, g, c.lerp_w1, c.small1 != 0);
  const float u = float(cm > 0.0f) - float(cm < 0.0f);
  const float term = c.lr * u;
  w = w * c.decay - term;
  m = lerp_torch(m, g, c.lerp_w2, c.small2 != 0);
  return term;
}

}  // namespace ampfused
