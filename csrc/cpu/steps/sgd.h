// SGD on the CPU (math.h: sgd_update; reference.sgd_step_): the fp32-state loops, the compact state through
// compact_apply, and the step entry.
// Included by kernels_impl.h after its helpers (one object per instruction set); not a header of its own.
namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {

namespace {

template <typename G, typename P, bool kMaster, bool kMomentum>
void sgd_range(const StepBufs& b, const StepTensor& t, const SgdConsts& consts, int64_t lo, int64_t hi,
               bool stream) {
  SgdConsts c = consts;
  c.use_momentum = kMomentum;
  const G* __restrict g = static_cast<const G*>(t.grad);
  float* __restrict w = kMaster ? b.master + t.offset : static_cast<float*>(t.param);
  float* __restrict s = kMomentum ? b.state1 + t.offset : nullptr;
  const auto update = [=](int64_t i) {
    float wi = w[i];
    float bi = kMomentum ? s[i] : 0.0f;
    sgd_update(to_f32(g[i]), wi, bi, c);
    w[i] = wi;
    if (kMomentum) s[i] = bi;
    return wi;
  };
  if (kMaster) store_range(static_cast<P*>(t.param), lo, hi, stream, update);
  else update_range(lo, hi, update);
}

void sgd_apply(const StepBufs& b, const StepTensor* ts, const SgdConsts* c, int64_t count, int nthreads,
               const HealthSink* health) {
  if (is_compact(b) || health) {
    const auto momentum = [](float g, float& w, float& m, float&, const SgdConsts& k) {
      SgdConsts kk = k;
      kk.use_momentum = 1;
      return sgd_update(g, w, m, kk);
    };
    const auto plain = [](float g, float& w, float& m, float&, const SgdConsts& k) {
      SgdConsts kk = k;
      kk.use_momentum = 0;
      return sgd_update(g, w, m, kk);
    };
    with_type(b.grad_dtype, [&](auto gtag) {
      if (b.state1) compact_apply<decltype(gtag), 1>(b, ts, c, count, nthreads, momentum, health);
      else compact_apply<decltype(gtag), 0>(b, ts, c, count, nthreads, plain, health);
    });
    return;
  }
  with_type(b.grad_dtype, [&](auto gtag) {
    with_type(b.param_dtype, [&](auto ptag) {
      using G = decltype(gtag);
      using P = decltype(ptag);
      const bool mom = b.state1 != nullptr;
      parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool st) {
        if (b.master) {
          if (mom) sgd_range<G, P, true, true>(b, ts[k], c[k], lo, hi, st);
          else sgd_range<G, P, true, false>(b, ts[k], c[k], lo, hi, st);
        } else {
          if (mom) sgd_range<G, float, false, true>(b, ts[k], c[k], lo, hi, st);
          else sgd_range<G, float, false, false>(b, ts[k], c[k], lo, hi, st);
        }
      });
    });
  });
}

}  // namespace

namespace {

void sgd_step(const StepPack& pack) {
  const double momentum = pack.h(0), dampening = pack.h(1), weight_decay = pack.h(2), max_norm = pack.h(4);
  const bool nesterov = pack.flag(3), maximize = pack.flag(5);
  StepPack p = pack;
  if (momentum == 0.0) p.args.state1 = nullptr;  // no buffer is read or written without momentum
  run_step<SgdConsts>(p, max_norm, [&](float coef, float lr, double step) {
    return make_sgd_consts(coef, lr, float(step), momentum, dampening, weight_decay, nesterov, maximize);
  }, sgd_apply);
}

}  // namespace

AMPFUSED_CPU_STEP("sgd_step_", sgd_step, "momentum", "dampening", "weight_decay", "nesterov", "max_norm",
                  "maximize");
// the entry writes a call's health sums when it asks for them (step_driver.h: run_step)
AMPFUSED_STEP_CONSTANT(HEALTH_sgd_step_, 1);

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
