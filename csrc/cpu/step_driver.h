// What every CPU step entry shares: the prologue (the partials reduced, the clip coefficient, the skip), the
// rows of the tensor table that have a gradient, each parameter's constants from its own step count, and the
// step counts advanced after the update. An optimizer's entry (csrc/cpu/steps/<name>.h) reads its
// hyperparameters from the pack, runs `run_step` with its update, and registers itself with AMPFUSED_CPU_STEP.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "ampfused/step_pack.h"
#include "kernels.h"

namespace ampfused {
namespace cpu {

using CpuStepFn = void (*)(const StepPack&);
using CpuSteps = StepRegistry<CpuStepFn>;

// The pack's thread count.
inline int threads_of(const StepPack& p) { return int(p.slot(kSlot_threads)); }

// reference._prologue: reduce the partials in column order (fp64), record [norm, found_inf];
// returns false when the step is skipped.
inline bool prologue(const StepArgs& a, double max_norm, float* coef) {
  double sumsq = 0.0;
  bool found_inf = false;
  for (int64_t k = 0; k < a.num_partials; ++k) {
    sumsq += double(a.partials[k]);
    found_inf |= a.partials[a.num_partials + k] > 0.0f;
  }
  const float norm = float(std::sqrt(sumsq));
  a.out_stats[0] = norm;
  a.out_stats[1] = found_inf ? 1.0f : 0.0f;
  *coef = step_coef(*a.inv_scale, norm, max_norm);
  return !found_inf;
}

// The parameters that have a gradient, from the tensor table.
inline std::vector<int64_t> active_rows(const StepArgs& a) {
  std::vector<int64_t> rows;
  for (int64_t k = 0; k < a.count; ++k) {
    if (a.table[k * kTableCols + kColNumel] != kNoGrad) rows.push_back(k);
  }
  return rows;
}

inline StepTensor tensor_of(const StepArgs& a, int64_t k) {
  const int64_t* r = a.table + k * kTableCols;
  return StepTensor{addr<void>(uintptr_t(r[kColParam])), addr<const void>(uintptr_t(r[kColGrad])), r[kColNumel],
                    r[kColOffset], 0u};
}

inline StepBufs bufs_of(const StepArgs& a) {
  return StepBufs{a.param_dtype, a.grad_dtype, a.master, a.state1, a.state2, a.master_format, a.state_dtype,
                  a.state_scales, a.scale_blocks};
}

// The stored weight of element i of t (reference_common: the master, rebuilt from weight and remainder, or
// the parameter), fp32.
inline float stored_weight(const StepArgs& a, const StepTensor& t, int64_t i) {
  if (a.master_format == kMasterRemainder) {
    return join_master_bits(static_cast<const uint16_t*>(t.param)[i],
                            reinterpret_cast<const uint16_t*>(a.master)[t.offset + i]);
  }
  if (a.master) return a.master[t.offset + i];
  float w = 0.0f;
  with_type(a.param_dtype, [&](auto tag) { w = to_f32(static_cast<const decltype(tag)*>(t.param)[i]); });
  return w;
}

// The health sums of a skipped step: its gradients' numbers, no update, the weights as they stay (in row
// order, one thread: a skipped step is rare).
inline void skipped_health(const StepArgs& a, const std::vector<int64_t>& rows, const HealthSink& h) {
  double g2 = 0.0, w2 = 0.0, bad = 0.0;
  for (int64_t k : rows) {
    const StepTensor t = tensor_of(a, k);
    with_type(a.grad_dtype, [&](auto tag) {
      const auto* g = static_cast<const decltype(tag)*>(t.grad);
      for (int64_t i = 0; i < t.n; ++i) {
        const float x = to_f32(g[i]);
        const float u = x * h.inv_scale;
        g2 += double(u) * double(u);
        bad += double(nonfinite(x));
      }
    });
    for (int64_t i = 0; i < t.n; ++i) {
      const float w = stored_weight(a, t, i);
      w2 += double(w) * double(w);
    }
  }
  h.out[0] = g2;
  h.out[2] = w2;
  h.out[4] = bad;
}

// The pack's health sink (null when the call asks for no health sums); decay_rate: the weight decay the
// step applies besides its term (0 where the decay is in the term, as Adam's L2 and SGD's).
inline bool health_of(const StepPack& p, float lr, double decay_rate, HealthSink* h) {
  double* out = p.ptr<double>(kSlot_health);
  if (!out) return false;
  for (int k = 0; k < 5; ++k) out[k] = 0.0;
  *h = HealthSink{out, *p.args.inv_scale, decay_rate != 0.0 && lr != 0.0f};
  return true;
}

// The flat-state step: prologue (skip on found_inf), per-parameter constants from each one's own step count
// (make(coef, lr, step) -> Consts), the update over every parameter with a gradient (apply), and each such
// parameter's step count advanced by one. Never on a skipped step. With health sums asked for, apply gets
// the sink (else null); decay_rate as health_of.
template <typename Consts, typename Make, typename Apply>
void run_step(const StepPack& p, double max_norm, Make make, Apply apply, double decay_rate = 0.0) {
  check_flat_table(p);
  const StepArgs& a = p.args;
  float coef;
  HealthSink sink;
  const float lr_f = float(read_scalar(a.lr, a.lr_code));
  const bool health = health_of(p, lr_f, decay_rate, &sink);
  const bool stepped = prologue(a, max_norm, &coef);
  const std::vector<int64_t> rows = active_rows(a);
  if (!stepped) {
    if (health) skipped_health(a, rows, sink);
    return;
  }
  std::vector<StepTensor> ts;
  std::vector<Consts> cs;
  const uint64_t seed = a.seed ? uint64_t(*a.seed) : 0;
  for (int64_t k : rows) {
    const double step = read_scalar(scalar_at(a.steps, a.step_code, k), a.step_code);
    StepTensor t = tensor_of(a, k);
    if (a.seed) t.key = step_key(seed, key_step(next_step(step)));
    ts.push_back(t);
    cs.push_back(make(coef, lr_f, step));
  }
  apply(bufs_of(a), ts.data(), cs.data(), int64_t(ts.size()), threads_of(p), health ? &sink : nullptr);
  for (int64_t k : rows) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
}

}  // namespace cpu
}  // namespace ampfused

// Registers `fn` (void(const StepPack&)) as this instruction set's entry of step op `op` (its name in
// ampfused/ops/specs.py), reading the hyperparameters named after it in that order.
#define AMPFUSED_CPU_STEP(op, fn, ...) \
  AMPFUSED_STEP_ENTRY(::ampfused::cpu::CpuSteps, op, AMPFUSED_STEP_STR(AMPFUSED_ISA), fn, __VA_ARGS__)
