// Body of the CPU drivers, compiled once per instruction set: the including file defines
// AMPFUSED_ISA (the namespace) and is built with that set's flags. Loops are plain: convert, compute
// in fp32, store; no per-element branch, so the compiler vectorises them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "step_driver.h"

#ifndef AMPFUSED_ISA
#error "define AMPFUSED_ISA before including kernels_impl.h"
#endif

namespace ampfused {
namespace cpu {
namespace AMPFUSED_ISA {
namespace {

// Lanes of the fp64 accumulators: fixed, so every instruction set sums in the same order.
constexpr int kLanes = 16;

// K1 asks for its gradients this far (64 lines) ahead of the block it sums: the out-of-order window spans
// only a few lines of its loads, too few to cover the memory's latency. Without the hint two cores of an AMD
// EPYC VM read 16M bf16 gradients at about 22 GB/s, with it at 30-39 GB/s. (A prefetch never faults: past
// the end of a buffer it is dropped.)
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_block(const void* block, int64_t bytes) {
#if defined(__SSE2__)
  const char* ahead = static_cast<const char*>(block) + kPrefetchBytes;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
#else
  (void)block;
  (void)bytes;
#endif
}

// The largest |x| of a chunk, as bits, decides its non-finite flag. For 16-bit types it is taken on the
// raw bits (|x| is x with the sign bit cleared; inf and NaN are the largest), twice as many per vector: the
// same flag as abs_bits of the converted value, at half the instructions.
template <typename T>
struct AbsMax {
  static constexpr bool kNarrow = false;
  static constexpr uint16_t kInf = 0;
};
template <>
struct AbsMax<bf16_t> {
  static constexpr bool kNarrow = true;
  static constexpr uint16_t kInf = 0x7f80;
};
template <>
struct AbsMax<f16_t> {
  static constexpr bool kNarrow = true;
  static constexpr uint16_t kInf = 0x7c00;
};

inline uint16_t abs_bits16(bf16_t x) { return uint16_t(x.bits & 0x7fffu); }
inline uint16_t abs_bits16(f16_t x) { return uint16_t(x.bits & 0x7fffu); }

#if defined(__AVX2__)
// chunk_norm's whole blocks of bf16 gradients (the norm pass; not unscale_) written out for AVX2 (and run by
// the AVX-512 build too: the pass is bound by memory, not by vector width), one and a half times as fast in
// cache as GCC's vectorisation of the loops below. The same operations on the same lanes in the same
// order: a row of 16 gradients is one 256-bit load; unpacking its 16-bit halves against zero gives the fp32
// values exactly, lanes {0-3, 8-11} in one vector and {4-7, 12-15} in the other, so each lane keeps its own
// sums, and the fp64 accumulators are loaded and stored at those lanes. Adds into acc and amax16 (the first
// 16 of its lanes); returns the elements done.
inline int64_t norm_blocks_bf16(const bf16_t* p, int64_t n, float inv_scale, double* acc, uint16_t* amax16) {
  static_assert(kLanes == 16 && kSquaresPerSum == 8, "one 256-bit vector per row of lanes");
  const __m256 inv = _mm256_set1_ps(inv_scale);
  const __m256i zero = _mm256_setzero_si256(), abs_mask = _mm256_set1_epi16(0x7fff);
  __m256d a0 = _mm256_loadu_pd(acc), a1 = _mm256_loadu_pd(acc + 4);
  __m256d a2 = _mm256_loadu_pd(acc + 8), a3 = _mm256_loadu_pd(acc + 12);
  __m256i wide = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(amax16));
  int64_t i = 0;
  for (; i + kLanes * kSquaresPerSum <= n; i += kLanes * kSquaresPerSum) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes {0-3, 8-11} and {4-7, 12-15}
    prefetch_block(p + i, kLanes * kSquaresPerSum * 2);
    for (int r = 0; r < kSquaresPerSum; ++r) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + r * kLanes));
      const __m256 u_lo = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw)), inv);
      const __m256 u_hi = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw)), inv);
      lo = _mm256_add_ps(lo, _mm256_mul_ps(u_lo, u_lo));
      hi = _mm256_add_ps(hi, _mm256_mul_ps(u_hi, u_hi));
      wide = _mm256_max_epu16(wide, _mm256_and_si256(raw, abs_mask));
    }
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(lo)));
    a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_extractf128_ps(lo, 1)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_castps256_ps128(hi)));
    a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(hi, 1)));
  }
  _mm256_storeu_pd(acc, a0);
  _mm256_storeu_pd(acc + 4, a1);
  _mm256_storeu_pd(acc + 8, a2);
  _mm256_storeu_pd(acc + 12, a3);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(amax16), wide);
  return i;
}
#endif

// Sum of squares of x * inv_scale and the non-finite flag of x over one chunk; with kWrite the
// unscaled values are stored back (unscale_). Element i goes to lane i % kLanes; each lane adds
// kSquaresPerSum consecutive squares of its own in fp32, then into its fp64 accumulator; lanes are
// summed in order. The order depends only on the chunk's length.
template <typename T, bool kWrite>
void chunk_norm(T* __restrict p, int64_t n, float inv_scale, double* sumsq, uint32_t* bad) {
  constexpr int64_t kBlock = int64_t(kLanes) * kSquaresPerSum;
  // (unscale_ takes the flag of the values before it overwrites them, in its one pass)
  constexpr bool kNarrow = AbsMax<T>::kNarrow && !kWrite;
  constexpr int kWide = 2 * kLanes;  // 16-bit lanes of the narrow maximum
  double acc[kLanes] = {};
  uint32_t amax[kLanes] = {};
  uint16_t amax16[kWide] = {};
  int64_t i = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same<T, bf16_t>::value && kNarrow) i = norm_blocks_bf16(p, n, inv_scale, acc, amax16);
#endif
  for (; i + kBlock <= n; i += kBlock) {
    prefetch_block(p + i, kBlock * int64_t(sizeof(T)));
    float part[kLanes] = {};
    for (int r = 0; r < kSquaresPerSum; ++r) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) {
        const float x = to_f32(p[i + r * kLanes + j]);
        const float u = unscaled(x, inv_scale);
        part[j] += u * u;
        if (!kNarrow) amax[j] = std::max(amax[j], abs_bits(x));
        if (kWrite) p[i + r * kLanes + j] = from_f32<T>(u);
      }
    }
    if constexpr (kNarrow) {
      for (int r = 0; r < kBlock / kWide; ++r) {
#pragma omp simd
        for (int j = 0; j < kWide; ++j) {
          amax16[j] = std::max(amax16[j], abs_bits16(p[i + r * kWide + j]));
        }
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
  bool narrow_bad = false;
  for (int j = 0; j < kLanes; ++j) {
    s += acc[j] + double(part[j]);
    m = std::max(m, amax[j]);
  }
  for (int j = 0; j < kWide; ++j) narrow_bad |= kNarrow && amax16[j] >= AbsMax<T>::kInf;
  *sumsq = s;
  *bad = (nonfinite_abs_bits(m) || narrow_bad) ? 1u : 0u;
}

// Streaming (non-temporal) stores of whole 64-byte lines: the line goes to memory without first being read
// into the cache (the write-allocate read of an ordinary store) and without evicting the step's streams.
constexpr int64_t kLineBytes = 64;

inline void stream_line(void* dst, const void* src) {
#if defined(__AVX512F__)
  _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_load_si512(src));
#elif defined(__AVX__)
  const __m256i* s = static_cast<const __m256i*>(src);
  __m256i* d = static_cast<__m256i*>(dst);
  _mm256_stream_si256(d, _mm256_load_si256(s));
  _mm256_stream_si256(d + 1, _mm256_load_si256(s + 1));
#elif defined(__SSE2__)
  const __m128i* s = static_cast<const __m128i*>(src);
  __m128i* d = static_cast<__m128i*>(dst);
  for (int k = 0; k < 4; ++k) _mm_stream_si128(d + k, _mm_load_si128(s + k));
#else
  std::memcpy(dst, src, kLineBytes);
#endif
}

// Orders this thread's streaming stores before what follows (the end of the parallel region).
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

constexpr bool kCanStream =
#if defined(__SSE2__)
    true;
#else
    false;
#endif

// Elements [lo, hi) of one parameter: update(i) advances the fp32 state of element i and returns its new
// weight, which is rounded into the model copy p[i]. With stream, the whole 64-byte lines of p are written
// with streaming stores (the same values; only how the bytes reach memory differs).
template <typename P, typename Update>
AF_HD void store_range(P* __restrict p, int64_t lo, int64_t hi, bool stream, Update update) {
  constexpr int64_t kPerLine = kLineBytes / int64_t(sizeof(P));
  const int64_t misalign = int64_t(reinterpret_cast<uintptr_t>(p + lo) % kLineBytes);
  stream = kCanStream && stream && misalign % int64_t(sizeof(P)) == 0;  // (element-aligned: any real tensor)
  int64_t i = lo;
  if (stream) {
    // streamed lines start on a line boundary: the elements before it one by one
    const int64_t body_lo = std::min(hi, lo + (misalign ? (kLineBytes - misalign) / int64_t(sizeof(P)) : 0));
#pragma omp simd
    for (int64_t k = lo; k < body_lo; ++k) p[k] = from_f32<P>(update(k));
    for (i = body_lo; i + kPerLine <= hi; i += kPerLine) {
      alignas(kLineBytes) P line[kPerLine];
#pragma omp simd
      for (int64_t j = 0; j < kPerLine; ++j) line[j] = from_f32<P>(update(i + j));
      stream_line(p + i, line);
    }
  }
#pragma omp simd
  for (int64_t k = i; k < hi; ++k) p[k] = from_f32<P>(update(k));
}

template <typename Update>
AF_HD void update_range(int64_t lo, int64_t hi, Update update) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) update(i);
}

// random_bits (math.h) split in two: the key with the index's high 32 bits folded in, one value for every
// index that shares that half (formed once per span), then the hash of it with the index's low 32 bits.
inline uint32_t random_key_high(uint32_t key, uint32_t index_high) { return key + index_high * 0x9E3779B9u; }
AF_HD uint32_t random_bits_low(uint32_t key_high, uint32_t index_low) { return mix32(key_high ^ index_low); }

#include "compact_span.h"

// One unit of parallel work: elements [lo, hi) of tensor k.
struct Work {
  int64_t k, lo, hi;
};

// Runs fn(tensor, lo, hi, stream) over every tensor in blocks of kStepBlock, the blocks statically split
// across threads. The step is elementwise, so the split never changes a result. Steps over at least
// kStreamElements elements stream the model copy out (see store_range); smaller ones leave it in cache.
template <typename F>
void parallel_blocks(const StepTensor* ts, int64_t count, int nthreads, F&& fn) {
  std::vector<Work> work;
  int64_t total = 0;
  for (int64_t k = 0; k < count; ++k) {
    total += ts[k].n;
    for (int64_t lo = 0; lo < ts[k].n; lo += kStepBlock) work.push_back({k, lo, std::min(ts[k].n, lo + kStepBlock)});
  }
  const bool stream = total >= kStreamElements;
  const int64_t nwork = int64_t(work.size());
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, nwork)));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < nwork; ++i) fn(work[i].k, work[i].lo, work[i].hi, stream);
    if (stream) stream_fence();
  }
}

// The health sums of a pass over every tensor, one part per unit of parallel_blocks' work (tensor k's block at
// lo), added into the sink in work order: the sums do not depend on the thread count.
struct HealthWork {
  std::vector<int64_t> first;  // unit of work of each tensor's first block
  std::vector<HealthPart> parts;

  HealthWork(const StepTensor* ts, int64_t count) : first(size_t(count)) {
    int64_t units = 0;
    for (int64_t k = 0; k < count; ++k) {
      first[size_t(k)] = units;
      units += (ts[k].n + kStepBlock - 1) / kStepBlock;
    }
    parts.resize(size_t(units));
  }
  HealthPart* at(int64_t k, int64_t lo) { return &parts[size_t(first[size_t(k)] + lo / kStepBlock)]; }
  void add_to(const HealthSink& h) const {
    for (const HealthPart& q : parts) {
      h.out[0] += q.g2;
      h.out[1] += q.u2;
      h.out[2] += q.w2;
      h.out[3] += double(q.stagnant);
    }
  }
};

// The compact step over every tensor: G the gradients' type, kStates the moments a step keeps (0-2), cs[k]
// tensor k's constants, apply the element update (returning its term). Dispatches the master format and the
// moments' storage. With a health sink (health != null; any state, the fp32 one included, then runs here),
// each unit of work sums its elements' numbers (HealthWork).
template <typename G, int kStates, typename Consts, typename Apply>
void compact_apply(const StepBufs& b, const StepTensor* ts, const Consts* cs, int64_t count, int nthreads,
                   Apply apply, const HealthSink* health = nullptr) {
  HealthWork work(ts, health ? count : 0);
  const auto run = [&](auto ptag, auto fmt, auto stag) {
    using P = decltype(ptag);
    using S = decltype(stag);
    constexpr int kFmt = decltype(fmt)::value;
    parallel_blocks(ts, count, nthreads, [&](int64_t k, int64_t lo, int64_t hi, bool) {
      if (health) {
        HealthPart* part = work.at(k, lo);
        if (kFmt == kMasterF32 && b.master) {
          compact_range<G, P, kFmt, true, S, kStates, kHealthAll>(b, ts[k], cs[k], lo, hi, apply, health, part);
        } else {
          compact_range<G, P, kFmt, false, S, kStates, kHealthAll>(b, ts[k], cs[k], lo, hi, apply, health, part);
        }
      } else if (kFmt == kMasterF32 && b.master) {
        compact_range<G, P, kFmt, true, S, kStates>(b, ts[k], cs[k], lo, hi, apply);
      } else {
        compact_range<G, P, kFmt, false, S, kStates>(b, ts[k], cs[k], lo, hi, apply);
      }
    });
  };
  const auto with_state = [&](auto ptag, auto fmt) {
    if (b.state_dtype == kBF16) run(ptag, fmt, bf16_t{});
    else if (b.state_dtype == kStateU8) run(ptag, fmt, uint8_t{});
    else run(ptag, fmt, float{});
  };
  // fp32 weights (an fp32 master, or fp32 parameters): compact only by their moments (or asked for health)
  const auto compact_moments = [&](auto ptag, auto fmt) {
    if (b.state_dtype == kStateU8) run(ptag, fmt, uint8_t{});
    else if (b.state_dtype == kBF16 || !health) run(ptag, fmt, bf16_t{});
    else run(ptag, fmt, float{});
  };

  if (b.master_format == kMasterRemainder) {
    with_state(bf16_t{}, std::integral_constant<int, kMasterRemainder>{});
  } else if (b.master_format == kMasterNone) {
    with_state(bf16_t{}, std::integral_constant<int, kMasterNone>{});
  } else if (!b.master) {
    compact_moments(float{}, std::integral_constant<int, kMasterF32>{});
  } else {
    with_type(b.param_dtype, [&](auto ptag) { compact_moments(ptag, std::integral_constant<int, kMasterF32>{}); });
  }
  if (health) work.add_to(*health);
}

inline bool is_compact(const StepBufs& b) {
  return b.master_format != kMasterF32 || b.state_dtype == kBF16 || b.state_dtype == kStateU8;
}

}  // namespace

// setup.py builds this file once per instruction set for K1 and once more per optimizer, each object with
// AMPFUSED_CPU_STEP_FILE naming one of csrc/cpu/steps/*.h: its drivers and its step entry (objects compiled in
// parallel, and a new optimizer is a new file there, named nowhere else).
#if !defined(AMPFUSED_CPU_STEP_FILE)
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
#endif

}  // namespace AMPFUSED_ISA
}  // namespace cpu
}  // namespace ampfused

// (it opens this instruction set's namespace again, after including the math it needs; the helpers above are
// its own in this object)
#if defined(AMPFUSED_CPU_STEP_FILE)
#include AMPFUSED_CPU_STEP_FILE
#endif
