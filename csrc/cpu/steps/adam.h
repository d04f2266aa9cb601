// Adam / AdamW on the CPU (math.h: adam_update; reference.adam_step_): the fp32-state loops, the compact state
// through compact_apply, and the step entry.
// Included by kernels_impl.h after its helpers (one object per instruction set); not a header of its own.
namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {

namespace {

template <typename G, typename P, bool kMaster>
void adam_range(const StepBufs& b, const StepTensor& t, const AdamConsts& consts, int64_t lo, int64_t hi,
                bool stream) {
  const AdamConsts c = consts;  // a local copy: stores to the buffers cannot alias it
  const G* __restrict g = static_cast<const G*>(t.grad);
  float* __restrict w = kMaster ? b.master + t.offset : static_cast<float*>(t.param);
  float* __restrict m = b.state1 + t.offset;
  float* __restrict v = b.state2 + t.offset;
  const auto run = [&](auto math) {
    const auto update = [=](int64_t i) {
      float wi = w[i], mi = m[i], vi = v[i];
      math(to_f32(g[i]), wi, mi, vi, c);
      w[i] = wi;
      m[i] = mi;
      v[i] = vi;
      return wi;
    };
    if (kMaster) store_range(static_cast<P*>(t.param), lo, hi, stream, update);
    else update_range(lo, hi, update);
  };
  // the common case in loops of its own: the same bits, without the general form's selects
  if (!c.use_l2 && c.lerp_small) {
    if (c.maximize) run([](float gi, float& wi, float& mi, float& vi, const AdamConsts& k) {
      adam_update_form<true, true>(gi, wi, mi, vi, k);
    });
    else run([](float gi, float& wi, float& mi, float& vi, const AdamConsts& k) {
      adam_update_form<true, false>(gi, wi, mi, vi, k);
    });
  } else {
    run([](float gi, float& wi, float& mi, float& vi, const AdamConsts& k) { adam_update(gi, wi, mi, vi, k); });
  }
}

void adam_apply(const StepBufs& b, const StepTensor* ts, const AdamConsts* c, int64_t count, int nthreads,
                const HealthSink* health) {
  if (is_compact(b) || health) {
    // every tensor's constants in the common form: its loops of their own, as the fp32 state's (same bits)
    bool plain = true;
    for (int64_t k = 0; k < count; ++k) plain = plain && !c[k].use_l2 && c[k].lerp_small && !c[k].maximize;
    with_type(b.grad_dtype, [&](auto gtag) {
      using G = decltype(gtag);
      if (plain) {
        compact_apply<G, 2>(b, ts, c, count, nthreads, [](float g, float& w, float& m, float& v, const AdamConsts& k) {
          return adam_update_form<true, false>(g, w, m, v, k);
        }, health);
      } else {
        compact_apply<G, 2>(b, ts, c, count, nthreads, [](float g, float& w, float& m, float& v, const AdamConsts& k) {
          return adam_update(g, w, m, v, k);
        }, health);
      }
    });
    return;
  }
  with_type(b.grad_dtype, [&](auto gtag) {
    with_type(b.param_dtype, [&](auto ptag) {
      using G = decltype(gtag);
      using P = decltype(ptag);
      if (b.master) {
        parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool st) {
          adam_range<G, P, true>(b, ts[k], c[k], lo, hi, st);
        });
      } else {
        parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool st) {
          adam_range<G, float, false>(b, ts[k], c[k], lo, hi, st);
        });
      }
    });
  });
}

}  // namespace

namespace {

void adam_step(const StepPack& p) {
  const double beta1 = p.h(0), beta2 = p.h(1), eps = p.h(2), weight_decay = p.h(3), max_norm = p.h(4);
  const bool decoupled = p.flag(5), maximize = p.flag(6);
  const float log_beta1 = log_beta(beta1), log_beta2 = log_beta(beta2);
  run_step<AdamConsts>(p, max_norm, [&](float coef, float lr, double step) {
    return make_adam_consts(coef, lr, float(next_step(step)), beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
                            decoupled, maximize);
  }, adam_apply, decoupled ? weight_decay : 0.0);
}

}  // namespace

AMPFUSED_CPU_STEP("adam_step_", adam_step, "beta1", "beta2", "eps", "weight_decay", "max_norm", "decoupled",
                  "maximize");
// the entry writes a call's health sums when it asks for them (step_driver.h: run_step)
AMPFUSED_STEP_CONSTANT(HEALTH_adam_step_, 1);

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
