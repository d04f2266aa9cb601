// The CPU compact-state step over one parameter's range (ampfused/ops/state_precision.py; math.h): the
// per-span loop of compact_apply. Included by kernels_impl.h inside its namespaces (one copy per instruction
// set), after the helpers it uses; not a header of its own.

// The compact stores of a value u (fp32 bits) known not to be a NaN: the forms of math.h without their NaN
// select, the same bits for every other input (inf included). round_stochastic_bits; from_f32<bf16_t>
// (nearest even); weight_of_code(master_code_bits) (nearest, ties away from zero: |u| + 0x8000 stays below
// the sign bit, so the carry lands in the magnitude).
AF_HD uint16_t round_stochastic_finite(uint32_t u, uint32_t r) { return uint16_t((u + (r & 0xFFFFu)) >> 16); }
AF_HD uint16_t bf16_nearest_finite(uint32_t u) { return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
AF_HD uint16_t weight_of_finite(uint32_t u) { return uint16_t((u + 0x8000u) >> 16); }

// q8_decode's bits in fewer vector operations (tests/test_cpu_compact_blocks.py decodes every code at every
// block exponent against the reference), through normal fp32 values only (an fp32 subnormal operand costs a
// microcode assist on some x86 cores, dozens of times a multiply): a code whose exponent field is 0 is decoded
// as the normal value one exponent up, less that exponent's power of two `hidden` (exact: both lie in one
// binade). base is (E - top) << 23 at the block's exponent E.
template <bool kSigned>
AF_HD float q8_decode_cpu(uint32_t code, uint32_t base, float hidden) {
  const uint32_t mag = kSigned ? (code & 0x7fu) : code;
  const bool sub = mag < 8u;
  const float v = f32_from_bits((mag << 20) + base + (sub ? (1u << 23) : 0u));
  const float a = sub ? v - hidden : v;
  return kSigned ? f32_from_bits(f32_bits(a) | ((code & 0x80u) << 24)) : a;
}
template <bool kSigned>
AF_HD uint32_t q8_decode_base(int32_t block_exp) {
  return uint32_t(block_exp - Q8Format<kSigned>::kTop) << 23;
}
template <bool kSigned>
AF_HD float q8_decode_hidden(int32_t block_exp) {
  return f32_from_bits(uint32_t(block_exp - Q8Format<kSigned>::kTop + 1) << 23);
}

// Elements per block of compact_span's passes: their fp32 values (3 KB) stay in L1 between the passes.
constexpr int32_t kCompactBlock = 256;

// Compact state (math.h): n elements of one parameter from its element lo, with the weight kept as kFmt says
// (kMaster: an fp32 master buffer exists in the kMasterF32 format) and the moments stored as S (float, bf16
// with stochastic rounding, or 8-bit codes with block scales); apply(g, w, s1, s2, consts) is the optimizer's
// element update (a stateless lambda). Element j draws its random bits at index offset + lo + j of the flat
// state buffers, whose high 32 bits are the same for the whole span (compact_range splits where they change):
// the key has that half folded in once and each element hashes only the low half, a 32-bit counter; each
// stream rounds with its rotation of that one draw (stream_bits).
// Each block of kCompactBlock elements runs in passes, each a loop that vectorises on 32-bit lanes:
//  - 8-bit moments only: decode the block's codes to fp32 in L1 (a loop of byte loads is 64 lanes wide; in
//    the update loop its values would take four registers each, too many);
//  - the update: load, apply, fp32 results to buffers in L1 (the divisions and square root, long chains,
//    overlap across many elements);
//  - the stores: hash, round, pack to 16 or 8 bits. Without 8-bit moments, a block with no NaN among its
//    results (told by one sum per element) stores through the NaN-free forms above, any other block through
//    math.h's. With them, the weight is stored in the update loop instead (its hash, kept for the moments'
//    encode, fills the slots the divisions leave; measured faster with AVX-512, the same with AVX2), the block's new exponents come from
//    an integer max of its new moments, and a block whose codes are all normal is encoded by
//    q8_encode_normal, any other by q8_encode.
// With kHealth, each block also sums its health numbers into *part (reference_common.HealthSums; the step is
// not skipped): the gradients' (kHealthGrads) and the weights' (kHealthWeights: apply returns the element's
// update term). The update loop sums each element's numbers beside its update (the weight it stores is its new
// fp32 value, which the remainders and an fp32 master hold exactly); without a master the stored weight is the
// stochastically rounded one, summed where it is stored. A split step sums its gradients in its first pass and
// its weights in its second.
template <typename G, typename P, int kFmt, bool kMaster, typename S, int kStates, int kHealth = 0,
          typename Consts, typename Apply>
AF_HD void compact_span(const StepBufs& b, const StepTensor& t, const Consts& consts, int64_t lo, int32_t n,
                        uint32_t index_high, Apply apply, const HealthSink* health = nullptr,
                        HealthPart* part = nullptr) {
  const Consts k = consts;  // a local copy: stores to the buffers cannot alias it
  constexpr bool kBf16State = std::is_same<S, bf16_t>::value;
  constexpr bool kQ8State = std::is_same<S, uint8_t>::value;  // 8-bit moments: codes and block scales
  constexpr bool kBf16Param = kFmt != kMasterF32;  // remainders and stochastic rounding: bf16 weights
  constexpr bool kNearestBf16 = kFmt == kMasterF32 && std::is_same<P, bf16_t>::value;
  static_assert(kCompactBlock == kQBlock, "a block of compact_span is a block of 8-bit codes");
  const int64_t at = t.offset + lo;
  const G* __restrict g = static_cast<const G*>(t.grad) + lo;
  P* __restrict p = static_cast<P*>(t.param) + lo;
  uint16_t* __restrict pw = static_cast<uint16_t*>(t.param) + lo;
  float* __restrict master = b.master + at;
  uint16_t* __restrict rem = reinterpret_cast<uint16_t*>(b.master) + at;
  float* __restrict f1 = b.state1 + at;
  float* __restrict f2 = b.state2 + at;
  uint16_t* __restrict h1 = reinterpret_cast<uint16_t*>(b.state1) + at;
  uint16_t* __restrict h2 = reinterpret_cast<uint16_t*>(b.state2) + at;
  uint8_t* __restrict q1 = reinterpret_cast<uint8_t*>(b.state1) + at;
  uint8_t* __restrict q2 = reinterpret_cast<uint8_t*>(b.state2) + at;
  float* __restrict sc1 = b.state_scales;
  float* __restrict sc2 = b.state_scales + b.scale_blocks;
  const uint32_t kw = random_key_high(t.key, index_high);
  const uint32_t index_low = uint32_t(uint64_t(at));
  // The weight's stores: careful, math.h's forms (any value); else the NaN-free ones. r: the element's draw
  // (stream_bits<kStreamWeight> is the draw itself), read without a master only.
  const auto store_weight = [&](int32_t e, float w, uint32_t r, auto careful) {
    constexpr bool kCareful = decltype(careful)::value;
    const uint32_t u = f32_bits(w);
    if constexpr (kFmt == kMasterRemainder) {
      const uint32_t code = kCareful ? master_code_bits(w) : u;
      rem[e] = remainder_of_code(code);
      pw[e] = kCareful ? weight_of_code(code) : weight_of_finite(u);
    } else if constexpr (kFmt == kMasterNone) {
      pw[e] = kCareful ? round_stochastic_bits(w, r) : round_stochastic_finite(u, r);
    } else if constexpr (kNearestBf16) {
      pw[e] = kCareful ? from_f32<bf16_t>(w).bits : bf16_nearest_finite(u);
    } else {
      p[e] = from_f32<P>(w);
    }
  };
  alignas(64) float wb[kCompactBlock], ab[kCompactBlock], cb[kCompactBlock];
  constexpr bool kSumGrads = (kHealth & kHealthGrads) != 0, kSumWeights = (kHealth & kHealthWeights) != 0;
  // the weights' sums without a master: each element's weight as loaded and its update's term, for the stores
  constexpr bool kHealthAtStore = kSumWeights && kFmt == kMasterNone;
  alignas(64) float before[kHealthAtStore ? kCompactBlock : 1], terms[kHealthAtStore ? kCompactBlock : 1];
  const float inv_scale = kHealth ? health->inv_scale : 0.0f;
  const bool decays = kHealth && health->decays;
  // kHealthAtStore: element e's sums from its weight as stored (j: its place in the block)
  struct StoredSums {
    float d2, a2;
    int32_t stagnant;
  };
  const auto stored_sums = [&](int32_t e, int32_t j) {
    const float after = f32_from_bits(uint32_t(pw[e]) << 16), d = after - before[j];
    const bool moved = terms[j] != 0.0f || (decays && before[j] != 0.0f);
    return StoredSums{d * d, after * after, (after == before[j] && moved) ? 1 : 0};
  };
  // 8-bit moments without a master: each element's draw, hashed in the update loop for the weight and read back
  // by the encode pass for the moments (one hash per element)
  alignas(64) uint32_t rb[kQ8State && kFmt == kMasterNone ? kCompactBlock : 1];
  for (int32_t j0 = 0; j0 < n; j0 += kCompactBlock) {
    const int32_t m = std::min(kCompactBlock, n - j0);
    // 8-bit moments: with the layout's offsets at multiples of kQBlock (and lo at one of kStepBlock, or where
    // the index's high half changes), this block is one block of codes: its exponent read, then rewritten
    const int64_t blk = (at + j0) / kQBlock;
    if constexpr (kQ8State) {
      const int32_t x1 = kStates >= 1 ? q8_exponent(sc1[blk]) : 0, x2 = kStates >= 2 ? q8_exponent(sc2[blk]) : 0;
      const uint32_t base1 = q8_decode_base<true>(x1), base2 = q8_decode_base<false>(x2);
      const float hidden1 = q8_decode_hidden<true>(x1), hidden2 = q8_decode_hidden<false>(x2);
#pragma omp simd
      for (int32_t j = 0; j < m; ++j) {
        if constexpr (kStates >= 1) ab[j] = q8_decode_cpu<true>(q1[j0 + j], base1, hidden1);
        if constexpr (kStates >= 2) cb[j] = q8_decode_cpu<false>(q2[j0 + j], base2, hidden2);
      }
    }
    uint32_t nan = 0, big1 = 0, big2 = 0, small1 = 0xffffffffu, small2 = 0xffffffffu;
    float g2 = 0.0f, u2 = 0.0f, w2 = 0.0f;  // kHealth: the block's sums
    int32_t stagnant = 0;
#pragma omp simd reduction(| : nan) reduction(max : big1, big2) reduction(min : small1, small2) \
    reduction(+ : g2, u2, w2, stagnant)
    for (int32_t j = 0; j < m; ++j) {
      const int32_t e = j0 + j;
      float w;
      if constexpr (kFmt == kMasterRemainder) w = join_master_bits(pw[e], rem[e]);
      else if constexpr (kBf16Param) w = f32_from_bits(uint32_t(pw[e]) << 16);
      else if constexpr (kMaster) w = master[e];
      else w = to_f32(p[e]);
      float a = 0.0f, c = 0.0f;
      if constexpr (kStates >= 1) a = kQ8State ? ab[j] : (kBf16State ? f32_from_bits(uint32_t(h1[e]) << 16) : f1[e]);
      if constexpr (kStates >= 2) c = kQ8State ? cb[j] : (kBf16State ? f32_from_bits(uint32_t(h2[e]) << 16) : f2[e]);
      if constexpr (kSumWeights) {
        const float gx = to_f32(g[e]), w0 = w;
        const float term = apply(gx, w, a, c, k);
        if constexpr (kSumGrads) {
          const float u = gx * inv_scale;
          g2 += u * u;
        }
        if constexpr (kHealthAtStore) {
          before[j] = w0;
          terms[j] = term;
        } else {
          const float d = w - w0;
          u2 += d * d;
          w2 += w * w;
          stagnant += (w == w0 && (term != 0.0f || (decays && w0 != 0.0f))) ? 1 : 0;
        }
      } else {
        const float gx = to_f32(g[e]);
        apply(gx, w, a, c, k);
        if constexpr (kSumGrads) {
          const float u = gx * inv_scale;
          g2 += u * u;
        }
      }
      if constexpr (kStates >= 1 && !kBf16State && !kQ8State) f1[e] = a;
      if constexpr (kStates >= 2 && !kBf16State && !kQ8State) f2[e] = c;
      if constexpr (kMaster) master[e] = w;
      ab[j] = a;
      cb[j] = c;
      if constexpr (kQ8State) {
        uint32_t r = 0;
        if constexpr (kFmt == kMasterNone) r = rb[j] = random_bits_low(kw, index_low + uint32_t(e));
        store_weight(e, w, r, std::true_type{});
        if constexpr (kHealthAtStore) {
          const StoredSums q = stored_sums(e, j);
          u2 += q.d2;
          w2 += q.a2;
          stagnant += q.stagnant;
        }
        // the extremes of |x| as bits (q8_abs_bits's NaN clamp is applied to them below: it is monotonic)
        if constexpr (kStates >= 1) big1 = std::max(big1, abs_bits(a)), small1 = std::min(small1, abs_bits(a));
        if constexpr (kStates >= 2) big2 = std::max(big2, abs_bits(c)), small2 = std::min(small2, abs_bits(c));
      } else {
        wb[j] = w;
        const float sum = w + a + c;  // NaN when one of them is (or from inf - inf: then the careful stores)
        nan |= sum != sum ? 1u : 0u;
      }
    }
    if constexpr (kQ8State) {
      big1 = std::min(big1, 0x7f800000u), big2 = std::min(big2, 0x7f800000u);
      small1 = std::min(small1, 0x7f800000u), small2 = std::min(small2, 0x7f800000u);
      const int32_t y1 = q8_block_exponent(big1), y2 = q8_block_exponent(big2);
      const uint32_t off1 = q8_normal_offset<true>(y1), off2 = q8_normal_offset<false>(y2);
      const auto encode = [&](auto all_normal) {
        constexpr bool kNormal = decltype(all_normal)::value;
#pragma omp simd
        for (int32_t j = 0; j < m; ++j) {
          uint32_t r;
          if constexpr (kFmt == kMasterNone) r = rb[j];
          else r = random_bits_low(kw, index_low + uint32_t(j0 + j));
          if constexpr (kStates >= 1) {
            const uint32_t r1 = stream_bits<kStreamState1>(r);
            q1[j0 + j] = uint8_t(kNormal ? q8_encode_normal<true>(f32_bits(ab[j]), r1, off1)
                                         : q8_encode<true>(ab[j], y1, r1));
          }
          if constexpr (kStates >= 2) {
            const uint32_t r2 = stream_bits<kStreamState2>(r);
            q2[j0 + j] = uint8_t(kNormal ? q8_encode_normal<false>(f32_bits(cb[j]), r2, off2)
                                         : q8_encode<false>(cb[j], y2, r2));
          }
        }
      };
      if (small1 >= q8_normal_floor<true>(y1) && small2 >= q8_normal_floor<false>(y2)) encode(std::true_type{});
      else encode(std::false_type{});
      if constexpr (kStates >= 1) sc1[blk] = q8_scale(y1);
      if constexpr (kStates >= 2) sc2[blk] = q8_scale(y2);
    } else {
      const auto stores = [&](auto careful) {
        constexpr bool kCareful = decltype(careful)::value;
        float su2 = 0.0f, sw2 = 0.0f;  // kHealthAtStore: the sums of the stored weights
        int32_t sst = 0;
#pragma omp simd reduction(+ : su2, sw2, sst)
        for (int32_t j = 0; j < m; ++j) {
          const int32_t e = j0 + j;
          // the element's one draw (unused where nothing is rounded stochastically)
          const uint32_t r = random_bits_low(kw, index_low + uint32_t(e));
          if constexpr (kStates >= 1 && kBf16State) {
            const uint32_t r1 = stream_bits<kStreamState1>(r);
            h1[e] = kCareful ? round_stochastic_bits(ab[j], r1) : round_stochastic_finite(f32_bits(ab[j]), r1);
          }
          if constexpr (kStates >= 2 && kBf16State) {
            const uint32_t r2 = stream_bits<kStreamState2>(r);
            h2[e] = kCareful ? round_stochastic_bits(cb[j], r2) : round_stochastic_finite(f32_bits(cb[j]), r2);
          }
          store_weight(e, wb[j], r, careful);
          if constexpr (kHealthAtStore) {
            const StoredSums q = stored_sums(e, j);
            su2 += q.d2;
            sw2 += q.a2;
            sst += q.stagnant;
          }
        }
        u2 += su2;
        w2 += sw2;
        stagnant += sst;
      };
      if (nan) stores(std::true_type{});
      else stores(std::false_type{});
    }
    if constexpr (kHealth) {
      part->g2 += double(g2);
      part->u2 += double(u2);
      part->w2 += double(w2);
      part->stagnant += stagnant;
    }
  }
}

// Elements [lo, hi) of one parameter (at most kStepBlock of them), in spans whose flat indices (offset + i)
// share their high 32 bits.
template <typename G, typename P, int kFmt, bool kMaster, typename S, int kStates, int kHealth = 0,
          typename Consts, typename Apply>
void compact_range(const StepBufs& b, const StepTensor& t, const Consts& consts, int64_t lo, int64_t hi,
                   Apply apply, const HealthSink* health = nullptr, HealthPart* part = nullptr) {
  static_assert(kStepBlock <= (int64_t(1) << 30), "a span's length is an int32");
  while (lo < hi) {
    const uint64_t first = uint64_t(t.offset + lo);
    const int64_t end = std::min<int64_t>(hi, int64_t(((first >> 32) + 1) << 32) - t.offset);
    compact_span<G, P, kFmt, kMaster, S, kStates, kHealth>(b, t, consts, lo, int32_t(end - lo),
                                                           uint32_t(first >> 32), apply, health, part);
    lo = end;
  }
}
