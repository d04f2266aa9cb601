// A factored step's shared device code (the table's geometry, torch's lerp and clamps as the specification rounds
// them, the block's fixed-order sums, a parameter's elements in the step's master format): what the whole step and
// its phases over shards both use. Included by the one translation unit of that step, inside its anonymous
// namespace, after its table's constants (kAfCols, kAfMaxDims) and kWarpsAf.
#pragma once

struct AfCudaShape {
  bool factored;
  int64_t B, R, C, sr, sc;
  int nlead;
  const int64_t* size;
  const int64_t* stride;

  __device__ explicit AfCudaShape(const int64_t* row) {
    const int nd = int(row[5]);
    size = row + 6;
    stride = row + 6 + kAfMaxDims;
    factored = nd > 1;
    nlead = factored ? nd - 2 : 0;
    B = 1;
    for (int k = 0; k < nlead; ++k) B *= size[k];
    R = factored ? size[nd - 2] : 0;
    C = factored ? size[nd - 1] : 0;
    sr = factored ? stride[nd - 2] : 0;
    sc = factored ? stride[nd - 1] : 0;
  }
  __device__ int64_t base(int64_t b) const {
    int64_t off = 0;
    for (int k = nlead - 1; k >= 0; --k) {
      off += (b % size[k]) * stride[k];
      b /= size[k];
    }
    return off;
  }
};

__device__ __forceinline__ float af_lerp(float v, float target, float w) {
  return fabsf(w) < 0.5f ? __fadd_rn(v, __fmul_rn(w, __fsub_rn(target, v)))
                         : __fsub_rn(target, __fmul_rn(__fsub_rn(target, v), __fsub_rn(1.0f, w)));
}
__device__ __forceinline__ float af_clamp_min(float x, float lo) { return x < lo ? lo : x; }  // NaN stays NaN
__device__ __forceinline__ double af_max(double x, double floor) { return x > floor ? x : floor; }

__device__ __forceinline__ double warp_sum(double s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// The block's sum of every thread's s, the same in every thread (thread order fixed).
__device__ __forceinline__ double block_sum_all(double s) {
  __shared__ double total;
  uint32_t unused = 0;
  block_reduce(s, unused);
  if (threadIdx.x == 0) total = s;
  __syncthreads();
  const double out = total;
  __syncthreads();
  return out;
}

template <typename G, typename P, int kFmt>
struct AfElems {
  P* param;
  const G* grad;
  float* master;  // fp32 master, uint16 remainders, or null
  int64_t offset;
  float coef;
  bool maximize;

  __device__ float g(int64_t j) const {
    const float x = __fmul_rn(to_f32(grad[j]), coef);
    return maximize ? -x : x;
  }
  __device__ float w(int64_t j) const {
    if (kFmt == kMasterRemainder) {
      return join_master_bits(reinterpret_cast<const uint16_t*>(param)[j],
                              reinterpret_cast<const uint16_t*>(master)[offset + j]);
    }
    if (master) return master[offset + j];
    return to_f32(param[j]);
  }
  __device__ void store(int64_t j, float w_new, uint32_t key) const {
    if (kFmt == kMasterRemainder) {
      bf16_t weight;
      uint16_t rem;
      split_master(w_new, weight, rem);
      reinterpret_cast<uint16_t*>(param)[j] = weight.bits;
      reinterpret_cast<uint16_t*>(master)[offset + j] = rem;
    } else if (kFmt == kMasterNone) {
      reinterpret_cast<bf16_t*>(param)[j] = round_stochastic(w_new, random_bits(key, offset + j));
    } else {
      if (master) master[offset + j] = w_new;
      param[j] = from_f32<P>(w_new);
    }
  }
};

// The elements of the parameter of table row `row`: its weights, gradient and master, the gradient scaled by coef.
template <typename G, typename P, int kFmt>
__device__ __forceinline__ AfElems<G, P, kFmt> af_elems(const int64_t* row, const StepArgs& a, float coef,
                                                        bool maximize) {
  return {reinterpret_cast<P*>(uintptr_t(row[0])), reinterpret_cast<const G*>(uintptr_t(row[1])), a.master, row[3],
          coef, maximize};
}
