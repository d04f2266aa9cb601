// Lion on the CPU (lion_math.h: lion_update; reference.lion_step_): its fp32-state loop, its compact-state step
// through compact_apply, and the step entry.
// Included by kernels_impl.h after its helpers (one object per instruction set); not a header of its own.
#include "ampfused/lion_math.h"

namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {

namespace {

template <typename G, typename P, bool kMaster>
void lion_range(const StepBufs& b, const StepTensor& t, const LionConsts& consts, int64_t lo, int64_t hi,
                bool stream) {
  const LionConsts c = consts;  // a local copy: stores to the buffers cannot alias it
  const G* __restrict g = static_cast<const G*>(t.grad);
  float* __restrict w = kMaster ? b.master + t.offset : static_cast<float*>(t.param);
  float* __restrict m = b.state1 + t.offset;
  const auto update = [=](int64_t i) {
    float wi = w[i], mi = m[i];
    lion_update(to_f32(g[i]), wi, mi, c);
    w[i] = wi;
    m[i] = mi;
    return wi;
  };
  if (kMaster) store_range(static_cast<P*>(t.param), lo, hi, stream, update);
  else update_range(lo, hi, update);
}

void lion_apply(const StepBufs& b, const StepTensor* ts, const LionConsts* c, int64_t count, int nthreads,
                const HealthSink* health) {
  if (is_compact(b) || health) {
    with_type(b.grad_dtype, [&](auto gtag) {
      compact_apply<decltype(gtag), 1>(b, ts, c, count, nthreads,
                                       [](float g, float& w, float& m, float&, const LionConsts& k) {
                                         return lion_update(g, w, m, k);
                                       }, health);
    });
    return;
  }
  with_type(b.grad_dtype, [&](auto gtag) {
    with_type(b.param_dtype, [&](auto ptag) {
      using G = decltype(gtag);
      using P = decltype(ptag);
      parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool st) {
        if (b.master) lion_range<G, P, true>(b, ts[k], c[k], lo, hi, st);
        else lion_range<G, float, false>(b, ts[k], c[k], lo, hi, st);
      });
    });
  });
}

void lion_step(const StepPack& p) {
  const double beta1 = p.h(0), beta2 = p.h(1), weight_decay = p.h(2), max_norm = p.h(3);
  const bool maximize = p.flag(4);
  // the step count is not in Lion's math (it keys only the stochastic rounding's draws)
  run_step<LionConsts>(p, max_norm, [&](float coef, float lr, double) {
    return make_lion_consts(coef, lr, beta1, beta2, weight_decay, maximize);
  }, lion_apply, weight_decay);
}

}  // namespace

AMPFUSED_CPU_STEP("lion_step_", lion_step, "beta1", "beta2", "weight_decay", "max_norm", "maximize");
// the entry writes a call's health sums when it asks for them (step_driver.h: run_step)
AMPFUSED_STEP_CONSTANT(HEALTH_lion_step_, 1);

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
