// The CPU driver of Lion (math.h: lion_update): its fp32-state loop and its compact-state step through
// compact_apply. Included by kernels_impl.h inside its namespaces (one copy per instruction set), after the
// helpers it uses; not a header of its own.

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

}  // namespace

void lion_apply(const StepBufs& b, const StepTensor* ts, const LionConsts* c, int64_t count, int nthreads) {
  if (is_compact(b)) {
    with_type(b.grad_dtype, [&](auto gtag) {
      compact_apply<decltype(gtag), 1>(b, ts, c, count, nthreads,
                                       [](float g, float& w, float& m, float&, const LionConsts& k) {
                                         lion_update(g, w, m, k);
                                       });
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
