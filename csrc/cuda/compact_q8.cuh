// K2 over 8-bit moments (math.h q8_*, state_precision.q8_*; reference._Compact.load_state / state_pairs): the
// moments stored as uint8 codes (state1 signed, state2 unsigned) with one scale per block of kQBlock elements of
// the flat buffers (a.state_scales: row 0 state1's, row 1 state2's), the weight kept as kFmt says.
//
// One warp updates one block of codes: its 32 lanes take a group of kVec consecutive elements each (32 x 8 == kQBlock),
// so the block's exponent is a warp-shuffle max, with no barrier; the warps of a thread block take the chunk's blocks
// in turn. The layout starts every parameter at a multiple of kQBlock and lo is a multiple of kStepChunk, so a warp's
// elements [base, base + kQBlock) are exactly one block of codes, block (offset + base) / kQBlock, which no other warp
// touches. In the reference's order: lane 0 reads the block's old scales and hands their exponents to the warp, each
// lane decodes (Q8Tables) and updates its elements, the warp reduces the largest q8_abs_bits of the new moments (an
// integer max: the same in any order), each lane encodes its elements with the block's new exponents (the element's
// draw at index offset + i, streams 1 and 2) and stores them with its weights, and lane 0 writes the block's new
// scales. Elements past the parameter's end count as 0 in the max and are neither read nor written.
#pragma once

#include "compact.cuh"

namespace ampfused {
namespace cuda {

static_assert(kQBlock == 32 * kVec && kStepChunk % kQBlock == 0, "a warp's groups are one block of codes");

__device__ __forceinline__ uint32_t warp_max(uint32_t x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// The decode tables, one per kernel block in shared memory: every code's value at block exponent 127 (scale 1;
// q8_decode, a normal fp32 value or zero), signed codes in row 0 (state1), unsigned in row 1 (state2). A code's
// value at block exponent E is its entry times the block's scale 2^(E - 127), exactly: no product leaves the
// normal range (E is clamped to [kQ8MinExp, kQ8MaxExp]). A lookup and a multiply per element instead of the
// decode's bit arithmetic.
struct Q8Tables {
  float value[2][256];
};

__device__ __forceinline__ Q8Tables* q8_tables() {
  __shared__ Q8Tables tables;  // (in the kernels that keep 8-bit moments only: the others never reach it)
  return &tables;
}

// Fills the tables; the block's first barrier after it orders the fill before every lookup.
__device__ __forceinline__ void q8_fill_tables(Q8Tables* t) {
  for (int c = threadIdx.x; c < 512; c += kThreads) {
    const uint8_t code = uint8_t(c & 255);
    t->value[c >> 8][code] = c < 256 ? q8_decode<true>(code, 127) : q8_decode<false>(code, 127);
  }
}

// q8_encode out of line: a block with a value below its codes' normal range takes it, the others
// q8_encode_normal inline. (A block spans 2^13, for exp_avg_sq 2^29, of its largest value in normal codes: in
// the alignment study's AdamW run about one exp_avg block in seven has a smaller value; python -m bench.q8_error,
// docs/state-precision.md.)
template <bool kSigned>
__device__ __noinline__ uint32_t q8_encode_any(float x, int32_t block_exp, uint32_t r) {
  return q8_encode<kSigned>(x, block_exp, r);
}

// The codes of a moment's group at block exponent e: q8_encode_normal when every value of the block is in the
// codes' normal range (a warp vote: a warp-uniform branch), else q8_encode. `a`: the values' abs_bits.
// r: the group's draws, rotated here for the moment's stream (kSigned: state1, else state2).
template <bool kSigned, int kAcc>
__device__ __forceinline__ void encode_group(const float* v, const uint32_t* a, int32_t e, const uint32_t* draws,
                                             uint32_t* codes) {
  constexpr uint32_t kStream = kSigned ? kStreamState1 : kStreamState2;
  uint32_t r[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) r[k] = stream_bits<kStream>(draws[k]);
  bool normal = kAcc != kMasked;
  if (kAcc != kMasked) {
    const uint32_t floor = q8_normal_floor<kSigned>(e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) normal = normal && a[k] >= floor;
    normal = __all_sync(0xffffffffu, normal);
  }
  if (normal) {
    const uint32_t off = q8_normal_offset<kSigned>(e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) codes[k] = q8_encode_normal<kSigned>(f32_bits(v[k]), r[k], off);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) codes[k] = q8_encode_any<kSigned>(v[k], e, r[k]);
  }
}

// One block of codes: the warp's elements [base, min(hi, base + kQBlock)), lane l's group at base + kVec * l.
template <typename Op, int kFmt, int kAcc, typename G, typename P>
__device__ __forceinline__ void q8_block(const Streams<G, P, uint8_t>& s, int64_t base, int64_t hi, int64_t offset,
                                         float* __restrict__ sc1, float* __restrict__ sc2,
                                         const typename Op::Consts& c, uint32_t key, const Q8Tables* tables) {
  const int lane = threadIdx.x % 32;
  const int64_t i = base + int64_t(lane) * kVec;
  const int live = kAcc == kMasked ? (hi - i < kVec ? (hi > i ? int(hi - i) : 0) : kVec) : kVec;
  const int64_t index0 = offset + i;
  const int64_t blk = (offset + base) / kQBlock;
  constexpr bool kS2 = OpStates<Op>::value >= 2;
  int32_t x1 = 0, x2 = 0;  // the block's exponents before the step
  if (lane == 0) {
    if (s.s1) x1 = q8_exponent(sc1[blk]);
    if (kS2 && s.s2) x2 = q8_exponent(sc2[blk]);
  }
  x1 = __shfl_sync(0xffffffffu, x1, 0);
  x2 = __shfl_sync(0xffffffffu, x2, 0);
  float g[kVec], w[kVec], v1[kVec], v2[kVec];
  uint32_t c1[kVec], c2[kVec];
  load_group<kAcc>(s.grad + i, live, g);
  load_weights<kFmt, kAcc, kAcc>(s, i, live, w);
#pragma unroll
  for (int k = 0; k < kVec; ++k) v1[k] = v2[k] = 0.0f;
  if (s.s1) {
    load_codes<kAcc>(s.s1 + i, live, c1);
    const float scale = q8_scale(x1);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v1[k] = __fmul_rn(tables->value[0][c1[k]], scale);
  }
  if (kS2 && s.s2) {
    load_codes<kAcc>(s.s2 + i, live, c2);
    const float scale = q8_scale(x2);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v2[k] = __fmul_rn(tables->value[1][c2[k]], scale);
  }
  // the block's largest q8_abs_bits of the new moments (the NaN clamp after the reduction: it is monotonic)
  uint32_t a1[kVec], a2[kVec], big1 = 0, big2 = 0;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if (kAcc != kMasked || k < live) Op::apply(g[k], w[k], v1[k], v2[k], c);
    a1[k] = abs_bits(v1[k]), a2[k] = abs_bits(v2[k]);  // 0 past the parameter's end
    big1 = max(big1, a1[k]), big2 = max(big2, a2[k]);
  }
  const int32_t e1 = q8_block_exponent(min(warp_max(big1), 0x7f800000u));
  const int32_t e2 = q8_block_exponent(min(warp_max(big2), 0x7f800000u));
  uint32_t r[kVec];
  group_draws<kAcc>(key, index0, r);
  if (s.s1) {
    encode_group<true, kAcc>(v1, a1, e1, r, c1);
    store_codes<kAcc>(s.s1 + i, live, c1);
  }
  if (kS2 && s.s2) {
    encode_group<false, kAcc>(v2, a2, e2, r, c2);
    store_codes<kAcc>(s.s2 + i, live, c2);
  }
  store_weights<kFmt, kAcc, kAcc>(s, i, live, w, r);
  if (lane == 0) {
    if (s.s1) sc1[blk] = q8_scale(e1);
    if (kS2 && s.s2) sc2[blk] = q8_scale(e2);
  }
}

// Elements [lo, min(n, lo + kStepChunk)) of one parameter: vector groups in every whole block of an aligned
// chunk (gradient and weight 16-byte aligned; the codes and remainders are, at offsets that are multiples of
// kQBlock), masked ones in the parameter's last, partial block and in a misaligned chunk.
template <typename G, typename P, typename Op, int kFmt>
__device__ __forceinline__ void update_chunk_q8(const StepArgs& a, const G* grad, P* param, int64_t n,
                                                int64_t offset, int64_t lo, const typename Op::Consts& c,
                                                uint32_t key, const Q8Tables* tables) {
  const int64_t hi = n < lo + kStepChunk ? n : lo + kStepChunk;
  Streams<G, P, uint8_t> s;
  s.grad = grad;
  s.param = param;
  s.master = kFmt == kMasterF32 && a.master ? a.master + offset : nullptr;
  s.rem = kFmt == kMasterRemainder ? reinterpret_cast<uint16_t*>(a.master) + offset : nullptr;
  s.s1 = a.state1 ? reinterpret_cast<uint8_t*>(a.state1) + offset : nullptr;
  s.s2 = a.state2 ? reinterpret_cast<uint8_t*>(a.state2) + offset : nullptr;
  float* __restrict__ sc1 = a.state_scales;
  float* __restrict__ sc2 = a.state_scales + a.scale_blocks;
  const auto addr = [&](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  // (offset a multiple of kQBlock, as the layout makes it: checked too, since a vector group's draws need it)
  const uintptr_t wide = addr(grad + lo) | addr(param + lo) | (s.master ? addr(s.master + lo) : 0) |
                         (s.rem ? addr(s.rem + lo) : 0);
  const uintptr_t codes = (s.s1 ? addr(s.s1 + lo) : 0) | (s.s2 ? addr(s.s2 + lo) : 0);
  const bool aligned = (offset % kQBlock) == 0 && (wide & 15u) == 0 && (codes & 7u) == 0;
  // whole blocks first (one loop of vector groups), then the partial last block or a misaligned chunk's blocks
  const int64_t whole = aligned ? (hi - lo) / kQBlock : 0;
  const int warp = threadIdx.x / 32;
  for (int64_t b = warp; b < whole; b += kWarps) {
    q8_block<Op, kFmt, kVector>(s, lo + b * kQBlock, hi, offset, sc1, sc2, c, key, tables);
  }
  const int64_t blocks = (hi - lo + kQBlock - 1) / kQBlock;
  for (int64_t b = whole + warp; b < blocks; b += kWarps) {
    q8_block<Op, kFmt, kMasked>(s, lo + b * kQBlock, hi, offset, sc1, sc2, c, key, tables);
  }
}

}  // namespace cuda
}  // namespace ampfused
