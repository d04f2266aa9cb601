// K2 over compact state (math.h, ampfused/ops/state_precision.py): the weight as an fp32 master (or the fp32
// parameter itself), uint16 remainders beside bf16 weights, or bf16 weights alone (stochastic rounding); the
// moments as fp32, bf16 (stochastic rounding) or 8-bit codes with one scale per block of kQBlock elements.
//
// Each thread updates a *group* of kVec consecutive elements per trip, every stream of the group in one or two
// vector accesses (16 bytes of bf16 weights or gradients, 2 x 16 of fp32, 8 of codes), so that a trip has its
// loads in flight together and issues few memory instructions per element. The element math is math.h's
// (Op::apply, the codecs), in the same order as the reference; only the distribution of elements over threads
// and the width of the accesses differ from a one-element-per-thread loop, so the bits are the same.
//
// Draws: element i of a parameter draws once, at index offset + i of the flat buffers, random_bits(key, index) =
// mix32((key + hi * golden) ^ lo) with lo, hi the index's 32-bit halves, and each stream it rounds (weight,
// moments) takes its rotation of that draw (stream_bits). A vector group folds its index into the key once
// (group_key) and each element xors in its place in the group; a group whose indices cross a change of hi is
// never a vector group (update_chunk_compact sends it to the masked path, which calls random_bits).
#pragma once

#include <type_traits>

#include "common.cuh"

namespace ampfused {
namespace cuda {

// How a group's stream is accessed: one element at a time (only the first `live` elements, any alignment), one
// vector per 8 elements (16-byte aligned: bf16 as one uint4, fp32 as two float4, codes as one uint2), or, for
// 16-bit state 8-byte aligned only (a layout offset of 4 elements), two uint2.
enum Access : int { kMasked = 0, kVector = 1, kHalves = 2 };

// The moments an optimizer keeps (Op::kStates, optional: 2 when absent; SGD's 1 is its momentum buffer): a step
// never touches state2 of an Op that keeps one, so its kernels leave that stream out.
template <typename Op, typename = void>
struct OpStates {
  static constexpr int value = 2;
};
template <typename Op>
struct OpStates<Op, std::void_t<decltype(Op::kStates)>> {
  static constexpr int value = Op::kStates;
};

// ---- a group of 8 elements of one stream ---------------------------------------------------------------

template <int kAcc, typename T>  // values as fp32 (T: float, bf16_t, f16_t)
__device__ __forceinline__ void load_group(const T* __restrict__ p, int live, float* x) {
  if constexpr (kAcc == kMasked) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] = k < live ? to_f32(p[k]) : 0.0f;
  } else {
    load8(p, x);
  }
}

template <int kAcc, typename T>
__device__ __forceinline__ void store_group(T* __restrict__ p, int live, const float* x) {
  if constexpr (kAcc == kMasked) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < live) p[k] = from_f32<T>(x[k]);
    }
  } else {
    store8(p, x);
  }
}

// raw 16-bit values (bf16 weights, remainders, bf16 moments), one per uint32
template <int kAcc>
__device__ __forceinline__ void load_bits(const uint16_t* __restrict__ p, int live, uint32_t* b) {
  if constexpr (kAcc == kMasked) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) b[k] = k < live ? uint32_t(p[k]) : 0u;
  } else {
    uint32_t w[4];
    if constexpr (kAcc == kVector) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 a = reinterpret_cast<const uint2*>(p)[0], c = reinterpret_cast<const uint2*>(p)[1];
      w[0] = a.x, w[1] = a.y, w[2] = c.x, w[3] = c.y;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      b[2 * k] = w[k] & 0xffffu;
      b[2 * k + 1] = w[k] >> 16;
    }
  }
}

template <int kAcc>
__device__ __forceinline__ void store_bits(uint16_t* __restrict__ p, int live, const uint32_t* b) {
  if constexpr (kAcc == kMasked) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < live) p[k] = uint16_t(b[k]);
    }
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = (b[2 * k] & 0xffffu) | (b[2 * k + 1] << 16);
    if constexpr (kAcc == kVector) {
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      reinterpret_cast<uint2*>(p)[0] = make_uint2(w[0], w[1]);
      reinterpret_cast<uint2*>(p)[1] = make_uint2(w[2], w[3]);
    }
  }
}

// 8-bit codes, one per uint32
template <int kAcc>
__device__ __forceinline__ void load_codes(const uint8_t* __restrict__ p, int live, uint32_t* c) {
  if constexpr (kAcc == kMasked) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) c[k] = k < live ? uint32_t(p[k]) : 0u;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c[k] = (v.x >> (8 * k)) & 0xffu;
      c[4 + k] = (v.y >> (8 * k)) & 0xffu;
    }
  }
}

template <int kAcc>
__device__ __forceinline__ void store_codes(uint8_t* __restrict__ p, int live, const uint32_t* c) {
  if constexpr (kAcc == kMasked) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < live) p[k] = uint8_t(c[k]);
    }
  } else {
    const uint32_t x = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
    const uint32_t y = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
    *reinterpret_cast<uint2*>(p) = make_uint2(x, y);
  }
}

// ---- draws ---------------------------------------------------------------------------------------------

// A vector group's draws: random_bits(key, index0 + k) == mix32(key_hi ^ (lo0 + k)) with lo0, key_hi =
// key + hi * golden from index0's halves, while lo0 + k does not wrap (update_chunk_compact sends a group that
// would to the masked path). A vector group's index0 is a multiple of 4 (offsets are multiples of 4 elements
// where its streams are aligned), so lo0 + k == lo0 | k for k < 4 and (lo0 + 4) | (k - 4) above: each draw is
// one xor of a constant into one of two per-group values, then the hash.
struct GroupKey {
  uint32_t x0, x4;  // key_hi ^ lo0, key_hi ^ (lo0 + 4)
};
__device__ __forceinline__ GroupKey group_key(uint32_t key, int64_t index0) {
  const uint32_t hi = key + uint32_t(uint64_t(index0) >> 32) * 0x9E3779B9u, lo = uint32_t(uint64_t(index0));
  return GroupKey{hi ^ lo, hi ^ (lo + 4u)};
}

// The draws of a group's elements: in a masked group, random_bits itself (any index); in a vector group, from
// its group key.
template <int kAcc>
__device__ __forceinline__ void group_draws(uint32_t key, int64_t index0, uint32_t* r) {
  if constexpr (kAcc == kMasked) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = random_bits(key, index0 + k);
  } else {
    const GroupKey gk = group_key(key, index0);
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] = mix32(k < 4 ? gk.x0 ^ uint32_t(k) : gk.x4 ^ uint32_t(k - 4));
  }
  // Kept, not recomputed: without this the compiler may hash again in each stream's store (the moments'
  // stores sit under runtime tests of their buffers), three hashes per element instead of one.
#pragma unroll
  for (int k = 0; k < kVec; ++k) asm volatile("" : "+r"(r[k]));
}

// ---- the pointers of one chunk --------------------------------------------------------------------------

// A parameter's streams, each at the parameter's element 0 (state buffers at its offset); the unused are null.
template <typename G, typename P, typename S>
struct Streams {
  const G* grad;
  P* param;
  float* master;    // kMasterF32 with a master buffer
  uint16_t* rem;    // kMasterRemainder
  S* s1;
  S* s2;
};

// The weights of a group as fp32: master, master joined from weight and remainder, or the weight itself.
template <int kFmt, int kMain, int kS16, typename G, typename P, typename S>
__device__ __forceinline__ void load_weights(const Streams<G, P, S>& s, int64_t i, int live, float* w) {
  if constexpr (kFmt == kMasterRemainder) {
    uint32_t wb[kVec], rb[kVec];
    load_bits<kMain>(reinterpret_cast<const uint16_t*>(s.param) + i, live, wb);
    load_bits<kS16>(s.rem + i, live, rb);
#pragma unroll
    for (int k = 0; k < kVec; ++k) w[k] = join_master_bits(wb[k], rb[k]);
  } else if constexpr (kFmt == kMasterNone) {
    load_group<kMain>(s.param + i, live, w);
  } else {
    if (s.master) load_group<kMain>(s.master + i, live, w);
    else load_group<kMain>(s.param + i, live, w);
  }
}

// (r: the group's draws; the weight's stream rounds with them as they are)
template <int kFmt, int kMain, int kS16, typename G, typename P, typename S>
__device__ __forceinline__ void store_weights(const Streams<G, P, S>& s, int64_t i, int live, const float* w,
                                              const uint32_t* r) {
  if constexpr (kFmt == kMasterRemainder) {
    uint32_t wb[kVec], rb[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t code = master_code_bits(w[k]);
      wb[k] = weight_of_code(code);
      rb[k] = remainder_of_code(code);
    }
    store_bits<kS16>(s.rem + i, live, rb);
    store_bits<kMain>(reinterpret_cast<uint16_t*>(s.param) + i, live, wb);
  } else if constexpr (kFmt == kMasterNone) {
    uint32_t wb[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) wb[k] = round_stochastic_bits(w[k], stream_bits<kStreamWeight>(r[k]));
    store_bits<kMain>(reinterpret_cast<uint16_t*>(s.param) + i, live, wb);
  } else {
    if (s.master) store_group<kMain>(s.master + i, live, w);
    store_group<kMain>(s.param + i, live, w);
  }
}

// One fp32 or bf16 moment of a group (S float: the main access; bf16: the 16-bit state's).
template <int kMain, int kS16, typename S>
__device__ __forceinline__ void load_moments(const S* __restrict__ p, int live, float* v) {
  if constexpr (std::is_same<S, float>::value) {
    load_group<kMain>(p, live, v);
  } else {
    uint32_t b[kVec];
    load_bits<kS16>(reinterpret_cast<const uint16_t*>(p), live, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = load_state(bf16_t{uint16_t(b[k])});
  }
}

// (kStream: the moment's stream; r: the group's draws)
template <int kMain, int kS16, uint32_t kStream, typename S>
__device__ __forceinline__ void store_moments(S* __restrict__ p, int live, const float* v, const uint32_t* r) {
  if constexpr (std::is_same<S, float>::value) {
    store_group<kMain>(p, live, v);
  } else {
    uint32_t b[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) b[k] = round_stochastic_bits(v[k], stream_bits<kStream>(r[k]));
    store_bits<kS16>(reinterpret_cast<uint16_t*>(p), live, b);
  }
}

// ---- fp32 / bf16 moments ----------------------------------------------------------------------------------

// Elements [i, i + live) of one parameter (live == kVec unless kMain == kMasked), index0 = offset + i.
template <typename Op, int kFmt, int kMain, int kS16, typename G, typename P, typename S>
__device__ __forceinline__ void compact_group(const Streams<G, P, S>& s, int64_t i, int live, int64_t index0,
                                              const typename Op::Consts& c, uint32_t key) {
  float g[kVec], w[kVec], v1[kVec], v2[kVec];
  load_group<kMain>(s.grad + i, live, g);
  load_weights<kFmt, kMain, kS16>(s, i, live, w);
#pragma unroll
  for (int k = 0; k < kVec; ++k) v1[k] = v2[k] = 0.0f;
  if (s.s1) load_moments<kMain, kS16>(s.s1 + i, live, v1);
  constexpr bool kS2 = OpStates<Op>::value >= 2;
  if (kS2 && s.s2) load_moments<kMain, kS16>(s.s2 + i, live, v2);
#pragma unroll
  for (int k = 0; k < kVec; ++k) Op::apply(g[k], w[k], v1[k], v2[k], c);
  uint32_t r[kVec];  // drawn only where something rounds stochastically
  if constexpr (kFmt == kMasterNone || !std::is_same<S, float>::value) group_draws<kMain>(key, index0, r);
  if (s.s1) store_moments<kMain, kS16, kStreamState1>(s.s1 + i, live, v1, r);
  if (kS2 && s.s2) store_moments<kMain, kS16, kStreamState2>(s.s2 + i, live, v2, r);
  store_weights<kFmt, kMain, kS16>(s, i, live, w, r);
}

// Groups [g0, g1) of the chunk starting at element lo, vector accesses, one group per thread per trip.
template <typename Op, int kFmt, int kS16, typename G, typename P, typename S>
__device__ __forceinline__ void compact_groups(const Streams<G, P, S>& s, int64_t lo, int64_t g0, int64_t g1,
                                               int64_t offset, const typename Op::Consts& c, uint32_t key) {
  for (int64_t gi = g0 + threadIdx.x; gi < g1; gi += kThreads) {
    const int64_t i = lo + gi * kVec;
    compact_group<Op, kFmt, kVector, kS16>(s, i, kVec, offset + i, c, key);
  }
}

// Elements [lo, min(n, lo + kStepChunk)) of one parameter, the weight kept as kFmt says and the moments stored
// as S (float or bf16_t). Vector groups where every stream of the chunk is aligned for them (the gradient and
// weight 16 bytes, fp32 state 16, 16-bit state 8 or 16); a group that crosses a change of the draw index's high
// half, the elements after the last whole group, and every group of a misaligned chunk go masked.
template <typename G, typename P, typename Op, int kFmt, typename S>
__device__ __forceinline__ void update_chunk_compact(const StepArgs& a, const G* grad, P* param, int64_t n,
                                                     int64_t offset, int64_t lo, const typename Op::Consts& c,
                                                     uint32_t key) {
  const int64_t hi = n < lo + kStepChunk ? n : lo + kStepChunk;
  Streams<G, P, S> s;
  s.grad = grad;
  s.param = param;
  s.master = kFmt == kMasterF32 && a.master ? a.master + offset : nullptr;
  s.rem = kFmt == kMasterRemainder ? reinterpret_cast<uint16_t*>(a.master) + offset : nullptr;
  s.s1 = a.state1 ? reinterpret_cast<S*>(a.state1) + offset : nullptr;
  s.s2 = a.state2 ? reinterpret_cast<S*>(a.state2) + offset : nullptr;
  constexpr bool kBf16 = std::is_same<S, bf16_t>::value;
  const auto addr = [&](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  const uintptr_t main_bits = addr(grad + lo) | addr(param + lo) | (s.master ? addr(s.master + lo) : 0) |
                              (!kBf16 && s.s1 ? addr(s.s1 + lo) : 0) | (!kBf16 && s.s2 ? addr(s.s2 + lo) : 0);
  // (s2 of an Op that keeps one moment is never accessed: its alignment is checked anyway, harmlessly)
  const uintptr_t s16_bits = (s.rem ? addr(s.rem + lo) : 0) | (kBf16 && s.s1 ? addr(s.s1 + lo) : 0) |
                             (kBf16 && s.s2 ? addr(s.s2 + lo) : 0);
  int64_t groups = (hi - lo) / kVec;
  const int s16 = (s16_bits & 15u) == 0 ? kVector : ((s16_bits & 7u) == 0 ? kHalves : kMasked);
  // all masked (below) unless aligned, and unless the draws' index0 is a multiple of 4 (group_key)
  if ((main_bits & 15u) != 0 || s16 == kMasked || (offset & 3) != 0) groups = 0;
  // the group holding the first element whose flat index has a new high half, if it is not that group's first
  int64_t cross = groups;
  const int64_t turn = int64_t(((uint64_t(offset + lo) >> 32) + 1) << 32) - offset;  // an element of the param
  if (turn < lo + groups * kVec && (turn - lo) % kVec != 0) cross = (turn - lo) / kVec;
  if (s16 == kVector) {
    compact_groups<Op, kFmt, kVector>(s, lo, 0, cross, offset, c, key);
    if (cross < groups) compact_groups<Op, kFmt, kVector>(s, lo, cross + 1, groups, offset, c, key);
  } else if (groups) {
    compact_groups<Op, kFmt, kHalves>(s, lo, 0, cross, offset, c, key);
    if (cross < groups) compact_groups<Op, kFmt, kHalves>(s, lo, cross + 1, groups, offset, c, key);
  }
  if (cross < groups && threadIdx.x == kThreads - 1) {
    const int64_t i = lo + cross * kVec;
    compact_group<Op, kFmt, kMasked, kMasked>(s, i, kVec, offset + i, c, key);
  }
  // the rest (after the last vector group, or the whole chunk when misaligned): masked groups
  for (int64_t i = lo + groups * kVec + int64_t(threadIdx.x) * kVec; i < hi; i += int64_t(kThreads) * kVec) {
    const int live = hi - i < kVec ? int(hi - i) : kVec;
    compact_group<Op, kFmt, kMasked, kMasked>(s, i, live, offset + i, c, key);
  }
}

}  // namespace cuda
}  // namespace ampfused
