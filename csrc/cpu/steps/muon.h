// Muon on the CPU (split_math.h; reference_muon.muon_step_shard_): its two elementwise passes around the
// Newton-Schulz iteration, which runs on torch's matmuls between them (ampfused/ops/call.py: StepCall.run_on).
// Both read and write the scratch of the `scratch` slot, bf16 laid out as the state:
//  - phase 1: the momentum and the iteration's input, rounded to nearest into the scratch: a plain loop for an
//    fp32 momentum, else the compact loop with the scratch in the weight's place (a bf16 "parameter" without a
//    master, which the loop stores to nearest);
//  - phase 2: the orthogonalized update from the scratch in the gradient's place, the decay and the update of
//    the weight (an fp32 master or parameter in a plain loop, remainders or bf16 weights in the compact one,
//    without moments), the step counts.
// Included by kernels_impl.h after its helpers (one object per instruction set); not a header of its own.
#include <stdexcept>

#include "ampfused/split_math.h"

namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {

namespace {

// Phase 1 with an fp32 momentum, one parameter's elements [lo, hi): a plain loop (the scratch written to nearest
// by store_range, streamed in a large step as the model's copy is).
template <typename G>
void muon_momentum_range(const StepBufs& b, const StepTensor& t, const SplitMomentumConsts& consts, int64_t lo,
                         int64_t hi, bool stream) {
  const SplitMomentumConsts c = consts;  // a local copy: stores to the buffers cannot alias it
  const G* __restrict g = static_cast<const G*>(t.grad);
  float* __restrict m = b.state1 + t.offset;
  const auto run = [&](auto form) {
    constexpr int kForm = decltype(form)::value;
    store_range(static_cast<bf16_t*>(t.param), lo, hi, stream, [=](int64_t i) {
      float mi = m[i];
      const float u = split_momentum_form<kForm>(to_f32(g[i]), mi, c);
      m[i] = mi;
      return u;
    });
  };
  // the common forms in loops of their own: the same bits, without the general form's selects
  const int form = split_momentum_form_of(c);
  if (form == kSplitNesterov) run(std::integral_constant<int, kSplitNesterov>{});
  else if (form == kSplitHeavyBall) run(std::integral_constant<int, kSplitHeavyBall>{});
  else run(std::integral_constant<int, kSplitAny>{});
}

// Phase 1 over every parameter, with the step's one set of constants: ts[k].param is its piece of the scratch.
// With a health sink, the compact loop (an fp32 momentum too) sums the gradients' numbers.
void muon_momentum_apply(const StepBufs& b, const StepTensor* ts, const SplitMomentumConsts& c, int64_t count,
                         int nthreads, const HealthSink* health) {
  if (b.state_dtype != kBF16 && b.state_dtype != kStateU8 && !health) {
    with_type(b.grad_dtype, [&](auto gtag) {
      parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool st) {
        muon_momentum_range<decltype(gtag)>(b, ts[k], c, lo, hi, st);
      });
    });
    return;
  }
  HealthWork work(ts, health ? count : 0);
  const auto run = [&](auto gtag, auto stag, auto form) {
    using G = decltype(gtag);
    using S = decltype(stag);
    constexpr int kForm = decltype(form)::value;
    const auto apply = [](float g, float& u, float& m, float&, const SplitMomentumConsts& k) {
      u = split_momentum_form<kForm>(g, m, k);
    };
    parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool) {
      if (health) {
        compact_range<G, bf16_t, kMasterF32, false, S, 1, kHealthGrads>(b, ts[k], c, lo, hi, apply, health,
                                                                        work.at(k, lo));
      } else {
        compact_range<G, bf16_t, kMasterF32, false, S, 1>(b, ts[k], c, lo, hi, apply);
      }
    });
  };
  const int form = split_momentum_form_of(c);  // (the step's: the same for every parameter)
  with_type(b.grad_dtype, [&](auto gtag) {
    const auto with_form = [&](auto stag) {
      if (form == kSplitNesterov) run(gtag, stag, std::integral_constant<int, kSplitNesterov>{});
      else if (form == kSplitHeavyBall) run(gtag, stag, std::integral_constant<int, kSplitHeavyBall>{});
      else run(gtag, stag, std::integral_constant<int, kSplitAny>{});
    };
    if (b.state_dtype == kBF16) with_form(bf16_t{});
    else if (b.state_dtype == kStateU8) with_form(uint8_t{});
    else with_form(float{});
  });
  if (health) work.add_to(*health);
}

template <typename P, bool kMaster>
void muon_update_range(const StepBufs& b, const StepTensor& t, const SplitUpdateConsts& consts, int64_t lo,
                       int64_t hi, bool stream) {
  const SplitUpdateConsts c = consts;  // a local copy: stores to the buffers cannot alias it
  const bf16_t* __restrict o = static_cast<const bf16_t*>(t.grad);
  float* __restrict w = kMaster ? b.master + t.offset : static_cast<float*>(t.param);
  const auto update = [=](int64_t i) {
    float wi = w[i];
    split_update(to_f32(o[i]), wi, c);
    w[i] = wi;
    return wi;
  };
  if (kMaster) store_range(static_cast<P*>(t.param), lo, hi, stream, update);
  else update_range(lo, hi, update);
}

// Phase 2 over every parameter: ts[k].grad is its piece of the scratch (b has no moments). With a health sink,
// the compact loop (an fp32 master or parameter too) sums the weights' numbers.
void muon_update_apply(const StepBufs& b, const StepTensor* ts, const SplitUpdateConsts* c, int64_t count,
                       int nthreads, const HealthSink* health) {
  const auto apply = [](float o, float& w, float&, float&, const SplitUpdateConsts& k) {
    return split_update(o, w, k);
  };
  if (health) {
    HealthWork work(ts, count);
    const auto run = [&](auto ptag, auto fmt, auto master) {
      using P = decltype(ptag);
      constexpr int kFmt = decltype(fmt)::value;
      constexpr bool kMaster = decltype(master)::value;
      parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool) {
        compact_range<bf16_t, P, kFmt, kMaster, float, 0, kHealthWeights>(b, ts[k], c[k], lo, hi, apply, health,
                                                                          work.at(k, lo));
      });
    };
    if (b.master_format == kMasterRemainder) {
      run(bf16_t{}, std::integral_constant<int, kMasterRemainder>{}, std::false_type{});
    } else if (b.master_format == kMasterNone) {
      run(bf16_t{}, std::integral_constant<int, kMasterNone>{}, std::false_type{});
    } else if (!b.master) {
      run(float{}, std::integral_constant<int, kMasterF32>{}, std::false_type{});
    } else {
      with_type(b.param_dtype, [&](auto ptag) {
        run(ptag, std::integral_constant<int, kMasterF32>{}, std::true_type{});
      });
    }
    work.add_to(*health);
    return;
  }
  if (b.master_format != kMasterF32) {
    const auto run = [&](auto fmt) {
      constexpr int kFmt = decltype(fmt)::value;
      parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool) {
        compact_range<bf16_t, bf16_t, kFmt, false, float, 0>(b, ts[k], c[k], lo, hi, apply);
      });
    };
    if (b.master_format == kMasterRemainder) run(std::integral_constant<int, kMasterRemainder>{});
    else run(std::integral_constant<int, kMasterNone>{});
    return;
  }
  with_type(b.param_dtype, [&](auto ptag) {
    using P = decltype(ptag);
    parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool st) {
      if (b.master) muon_update_range<P, true>(b, ts[k], c[k], lo, hi, st);
      else muon_update_range<float, false>(b, ts[k], c[k], lo, hi, st);
    });
  });
}

void muon_step(const StepPack& p) {
  const double momentum = p.h(0), weight_decay = p.h(2), max_norm = p.h(3);
  const bool nesterov = p.flag(1);
  const int64_t phase = p.slot(kSlot_phase);
  if (phase != 1 && phase != 2) {
    throw std::invalid_argument("muon_step_ runs as its two passes around the iteration (phase 1 or 2, with their "
                                "scratch): got phase " + std::to_string(phase));
  }
  check_flat_table(p);
  const StepArgs& a = p.args;
  bf16_t* scratch = p.ptr<bf16_t>(kSlot_scratch);
  const double* ratios = p.ptr<const double>(kSlot_ratios);
  const std::vector<int64_t> rows = active_rows(a);
  if (!rows.empty() && (scratch == nullptr || (phase == 2 && ratios == nullptr))) {
    throw std::invalid_argument("muon_step_'s passes need their scratch (and, in phase 2, the lr factors)");
  }
  // the health sums: the gradients' in phase 1 (which writes the row first), the weights' in phase 2
  const double lr = read_scalar(a.lr, a.lr_code);
  HealthSink sink;
  bool health = false;
  if (phase == 1) {
    health = health_of(p, float(lr), weight_decay, &sink);
  } else if (double* out = p.ptr<double>(kSlot_health)) {
    health = true;
    sink = HealthSink{out, *a.inv_scale, weight_decay != 0.0 && float(lr) != 0.0f};
  }
  float coef;
  if (!prologue(a, max_norm, &coef)) {
    if (health && phase == 1) skipped_health(a, rows, sink);
    return;
  }
  const uint64_t seed = a.seed ? uint64_t(*a.seed) : 0;
  std::vector<StepTensor> ts;
  for (int64_t k : rows) {
    StepTensor t = tensor_of(a, k);
    if (a.seed) t.key = step_key(seed, key_step(next_step(read_scalar(scalar_at(a.steps, a.step_code, k),
                                                                     a.step_code))));
    if (phase == 1) t.param = scratch + t.offset;  // the input of the iteration, in the weight's place
    else t.grad = scratch + t.offset;              // its output, in the gradient's place
    ts.push_back(t);
  }
  StepBufs b = bufs_of(a);
  if (phase == 1) {
    b.master = nullptr;  // (the weights are not touched)
    b.master_format = kMasterF32;
    b.param_dtype = kBF16;
    muon_momentum_apply(b, ts.data(), make_split_momentum_consts(coef, momentum, nesterov), int64_t(ts.size()),
                        threads_of(p), health ? &sink : nullptr);
    return;
  }
  b.state1 = nullptr;  // (the momentum is not touched)
  b.grad_dtype = kBF16;
  std::vector<SplitUpdateConsts> cs;
  for (int64_t k : rows) cs.push_back(make_split_update_consts(lr, weight_decay, ratios[k]));
  muon_update_apply(b, ts.data(), cs.data(), int64_t(ts.size()), threads_of(p), health ? &sink : nullptr);
  for (int64_t k : rows) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
}

}  // namespace

AMPFUSED_CPU_STEP("muon_step_", muon_step, "momentum", "nesterov", "weight_decay", "max_norm");
// the entry writes a call's health sums when it asks for them (the gradients' in phase 1, the weights' in 2)
AMPFUSED_STEP_CONSTANT(HEALTH_muon_step_, 1);

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
