// Body of the CPU drivers, compiled once per instruction set: the including file defines
// AMPFUSED_ISA (the namespace) and is built with that set's flags. Loops are plain: convert, compute
// in fp32, store; no per-element branch, so the compiler vectorises them.
#include <algorithm>
#include <vector>

#include "kernels.h"

#ifndef AMPFUSED_ISA
#error "define AMPFUSED_ISA before including kernels_impl.h"
#endif

namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {
namespace {

// Lanes of the fp64 accumulators: fixed, so every instruction set sums in the same order.
constexpr int kLanes = 16;

template <typename F>
void with_type(int code, F&& f) {
  switch (code) {
    case kBF16: f(bf16_t{}); break;
    case kF16: f(f16_t{}); break;
    default: f(float{}); break;
  }
}

// Sum of squares of x * inv_scale and the non-finite flag of x over one chunk; with kWrite the
// unscaled values are stored back (unscale_). Element i goes to lane i % kLanes; each lane adds
// kSquaresPerSum consecutive squares of its own in fp32, then into its fp64 accumulator; lanes are
// summed in order. The order depends only on the chunk's length.
template <typename T, bool kWrite>
void chunk_norm(T* __restrict p, int64_t n, float inv_scale, double* sumsq, uint32_t* bad) {
  constexpr int64_t kBlock = int64_t(kLanes) * kSquaresPerSum;
  double acc[kLanes] = {};
  uint32_t amax[kLanes] = {};
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float part[kLanes] = {};
    for (int r = 0; r < kSquaresPerSum; ++r) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) {
        const float x = to_f32(p[i + r * kLanes + j]);
        const float u = unscaled(x, inv_scale);
        part[j] += u * u;
        amax[j] = std::max(amax[j], abs_bits(x));
        if (kWrite) p[i + r * kLanes + j] = from_f32<T>(u);
      }
    }
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) acc[j] += double(part[j]);
  }
  float part[kLanes] = {};
  for (int64_t k = i; k < n; ++k) {  // the last partial block, same lanes
    const float x = to_f32(p[k]);
    const float u = unscaled(x, inv_scale);
    part[(k - i) % kLanes] += u * u;
    amax[(k - i) % kLanes] = std::max(amax[(k - i) % kLanes], abs_bits(x));
    if (kWrite) p[k] = from_f32<T>(u);
  }
  double s = 0.0;
  uint32_t m = 0;
  for (int j = 0; j < kLanes; ++j) {
    s += acc[j] + double(part[j]);
    m = std::max(m, amax[j]);
  }
  *sumsq = s;
  *bad = nonfinite_abs_bits(m) ? 1u : 0u;
}

template <typename G, typename P, bool kMaster>
void adam_range(const StepBufs& b, const StepTensor& t, const AdamConsts& consts, int64_t lo, int64_t hi) {
  const AdamConsts c = consts;  // a local copy: stores to the buffers cannot alias it
  const G* __restrict g = static_cast<const G*>(t.grad);
  P* __restrict p = static_cast<P*>(t.param);
  float* __restrict w = kMaster ? b.master + t.offset : static_cast<float*>(t.param);
  float* __restrict m = b.state1 + t.offset;
  float* __restrict v = b.state2 + t.offset;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    float wi = w[i], mi = m[i], vi = v[i];
    adam_update(to_f32(g[i]), wi, mi, vi, c);
    w[i] = wi;
    m[i] = mi;
    v[i] = vi;
    if (kMaster) p[i] = from_f32<P>(wi);
  }
}

template <typename G, typename P, bool kMaster, bool kMomentum>
void sgd_range(const StepBufs& b, const StepTensor& t, const SgdConsts& consts, int64_t lo, int64_t hi) {
  SgdConsts c = consts;
  c.use_momentum = kMomentum;
  const G* __restrict g = static_cast<const G*>(t.grad);
  P* __restrict p = static_cast<P*>(t.param);
  float* __restrict w = kMaster ? b.master + t.offset : static_cast<float*>(t.param);
  float* __restrict s = kMomentum ? b.state1 + t.offset : nullptr;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    float wi = w[i];
    float bi = kMomentum ? s[i] : 0.0f;
    sgd_update(to_f32(g[i]), wi, bi, c);
    w[i] = wi;
    if (kMomentum) s[i] = bi;
    if (kMaster) p[i] = from_f32<P>(wi);
  }
}

// One unit of parallel work: elements [lo, hi) of tensor k.
struct Work {
  int64_t k, lo, hi;
};

// Runs fn(tensor, lo, hi) over every tensor in blocks of kStepBlock, the blocks statically split across
// threads. The step is elementwise, so the split never changes a result.
template <typename F>
void parallel_blocks(const StepTensor* ts, int64_t count, int nthreads, F&& fn) {
  std::vector<Work> work;
  for (int64_t k = 0; k < count; ++k) {
    for (int64_t lo = 0; lo < ts[k].n; lo += kStepBlock) work.push_back({k, lo, std::min(ts[k].n, lo + kStepBlock)});
  }
  const int64_t nwork = int64_t(work.size());
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, nwork)));
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < nwork; ++i) fn(work[i].k, work[i].lo, work[i].hi);
}

}  // namespace

void norm_check(const Buf* bufs, int64_t nbufs, const int64_t* first_chunk, float inv_scale,
                float* partials, int64_t num_partials, bool unscale, int nthreads) {
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, num_partials)));
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t c = 0; c < num_partials; ++c) {
    // the buffer holding chunk c: last buffer whose first chunk is <= c (empty buffers own none)
    const int64_t k = int64_t(std::upper_bound(first_chunk, first_chunk + nbufs + 1, c) - first_chunk) - 1;
    const Buf& b = bufs[k];
    const int64_t lo = (c - first_chunk[k]) * kChunk;
    const int64_t len = std::min(kChunk, b.n - lo);
    double s = 0.0;
    uint32_t f = 0;
    with_type(b.dtype, [&](auto tag) {
      using T = decltype(tag);
      T* p = static_cast<T*>(b.ptr) + lo;
      if (unscale) chunk_norm<T, true>(p, len, inv_scale, &s, &f);
      else chunk_norm<T, false>(p, len, inv_scale, &s, &f);
    });
    partials[c] = float(s);
    partials[num_partials + c] = f ? 1.0f : 0.0f;
  }
}

void adam_apply(const StepBufs& b, const StepTensor* ts, const AdamConsts* c, int64_t count, int nthreads) {
  with_type(b.grad_dtype, [&](auto gtag) {
    with_type(b.param_dtype, [&](auto ptag) {
      using G = decltype(gtag);
      using P = decltype(ptag);
      if (b.master) {
        parallel_blocks(ts, count, nthreads,
                        [&](int64_t k, int64_t lo, int64_t hi) { adam_range<G, P, true>(b, ts[k], c[k], lo, hi); });
      } else {
        parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi) {
          adam_range<G, float, false>(b, ts[k], c[k], lo, hi);
        });
      }
    });
  });
}

void sgd_apply(const StepBufs& b, const StepTensor* ts, const SgdConsts* c, int64_t count, int nthreads) {
  with_type(b.grad_dtype, [&](auto gtag) {
    with_type(b.param_dtype, [&](auto ptag) {
      using G = decltype(gtag);
      using P = decltype(ptag);
      const bool mom = b.state1 != nullptr;
      parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi) {
        if (b.master) {
          if (mom) sgd_range<G, P, true, true>(b, ts[k], c[k], lo, hi);
          else sgd_range<G, P, true, false>(b, ts[k], c[k], lo, hi);
        } else {
          if (mom) sgd_range<G, float, false, true>(b, ts[k], c[k], lo, hi);
          else sgd_range<G, float, false, false>(b, ts[k], c[k], lo, hi);
        }
      });
    });
  });
}

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused
