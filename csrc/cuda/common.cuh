// Device helpers shared by the CUDA kernels: 128-bit vector loads/stores of 8 elements, the K1 body
// (sum of squares + non-finite test of one partial), deterministic block reductions, K2's prologue and its
// advance of the step counts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ampfused/math.h"
#include "ampfused/step_args.h"
#include "launch.h"

namespace ampfused {
namespace cuda {

// ---- 8 elements <-> 8 floats, 16-byte aligned (the caller guarantees it) -----------------------------

__device__ __forceinline__ void load8(const float* p, float* x) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

template <typename T>  // bf16_t / f16_t: one 16-byte load
__device__ __forceinline__ void load8(const T* p, float* x) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = to_f32(T{uint16_t(w[k] & 0xffffu)});
    x[2 * k + 1] = to_f32(T{uint16_t(w[k] >> 16)});
  }
}

__device__ __forceinline__ void store8(float* p, const float* x) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* x) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[k] = uint32_t(from_f32<T>(x[2 * k]).bits) | (uint32_t(from_f32<T>(x[2 * k + 1]).bits) << 16);
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- deterministic block reduction (fixed shuffle tree, warps summed in order); result in thread 0 ----

__device__ __forceinline__ void block_reduce(double& sum, uint32_t& amax) {
  __shared__ double s_sum[kThreads / 32];
  __shared__ uint32_t s_max[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_sum[warp] = sum;
    s_max[warp] = amax;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sum = 0.0;
    amax = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      sum += s_sum[w];
      amax = max(amax, s_max[w]);
    }
  }
  __syncthreads();
}

// Warps of a block (8-bit moments: one block of codes per warp).
constexpr int kWarps = kThreads / 32;

// ---- K1: one partial (tiles j, j + nparts, ...) of one tensor -------------------------------------------

// Thread t handles elements [tile * kTile + t * kVec, + kVec) of each tile, in order, with one vector
// access when the 8 elements are in range and 16-byte aligned, else one element at a time: the same
// arithmetic either way (kVec == kSquaresPerSum squares summed in fp32, then added in fp64). With kWrite
// the unscaled values are stored back (unscale_).
static_assert(kVec == kSquaresPerSum, "one fp32 sum of squares per vector");
template <typename T, bool kWrite>
__device__ __forceinline__ void k1_partial(T* p, int64_t n, int64_t nparts, int64_t j, float inv_scale, double& sum,
                                           uint32_t& amax) {
  const bool aligned = (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
  for (int64_t tile = j; tile * kTile < n; tile += nparts) {
    const int64_t base = tile * kTile + int64_t(threadIdx.x) * kVec;
    float part = 0.0f;
    if (aligned && base + kVec <= n) {
      float x[kVec];
      load8(p + base, x);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        amax = max(amax, abs_bits(x[k]));
        x[k] = unscaled(x[k], inv_scale);
        part += x[k] * x[k];
      }
      if (kWrite) store8(p + base, x);
    } else {
      for (int k = 0; k < kVec && base + k < n; ++k) {
        const float x = to_f32(p[base + k]);
        amax = max(amax, abs_bits(x));
        const float u = unscaled(x, inv_scale);
        part += u * u;
        if (kWrite) p[base + k] = from_f32<T>(u);
      }
    }
    sum += double(part);
  }
}

// Computes partial j of tensor (p, n) and writes column `col` of the [2, P] partials.
template <typename T, bool kWrite>
__device__ __forceinline__ void k1_write_partial(T* p, int64_t n, int64_t nparts, int64_t j, float inv_scale,
                                                 float* partials, int64_t P, int64_t col) {
  double sum = 0.0;
  uint32_t amax = 0;
  k1_partial<T, kWrite>(p, n, nparts, j, inv_scale, sum, amax);
  block_reduce(sum, amax);
  if (threadIdx.x == 0) {
    partials[col] = float(sum);
    partials[P + col] = nonfinite_abs_bits(amax) ? 1.0f : 0.0f;
  }
}

// ---- K2 prologue: every block reduces all partials in the same fixed order ------------------------------

struct Prologue {
  float norm, coef, lr;
  int skip;
};

// Thread 0 of every block computes the same values; block 0 records [norm, found_inf] in out_stats.
__device__ __forceinline__ void step_prologue(const StepArgs& a, double max_norm, Prologue* out) {
  double sum = 0.0;
  uint32_t flag = 0;
  // __ldcg: in a single launch other blocks wrote the partials just before the grid barrier; read
  // them from L2, never from a stale L1 line
  for (int64_t k = threadIdx.x; k < a.num_partials; k += kThreads) {
    sum += double(__ldcg(a.partials + k));
    flag = max(flag, __ldcg(a.partials + a.num_partials + k) > 0.0f ? 1u : 0u);
  }
  block_reduce(sum, flag);
  if (threadIdx.x == 0) {
    const float norm = float(sqrt(sum));
    out->norm = norm;
    out->skip = flag ? 1 : 0;
    out->coef = step_coef(*a.inv_scale, norm, max_norm);
    out->lr = float(read_scalar(a.lr, a.lr_code));
    if (blockIdx.x == 0) {
      a.out_stats[0] = norm;
      a.out_stats[1] = flag ? 1.0f : 0.0f;
    }
  }
  __syncthreads();
}

// Called by every thread of every block of a step that is not skipped, once the block has read all the step
// counts it needs (thread 0 reads them). The last block to arrive adds 1 to the count of every parameter
// that has a gradient (its threads share the rows) and re-zeroes the counter for the next launch. No block
// reads a count after arriving, so no count is read after it changed.
__device__ __forceinline__ void count_and_advance_steps(const StepArgs& a, int32_t* counter) {
  __shared__ int last;
  __syncthreads();  // the block's reads of the counts are done (thread 0 made them)
  if (threadIdx.x == 0) {
    __threadfence();  // release: this block's reads come before its arrival
    last = atomicAdd(counter, 1) == int(gridDim.x) - 1 ? 1 : 0;
    if (last) {
      *counter = 0;     // every block has arrived: nobody else touches it in this launch
      __threadfence();  // acquire: the counts change only after every other block's arrival
    }
  }
  __syncthreads();
  if (!last) return;
  for (int64_t k = threadIdx.x; k < a.count; k += kThreads) {
    if (a.table[k * kTableCols + kColNumel] != kNoGrad) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
  }
}

// ---- host helpers -------------------------------------------------------------------------------------

inline std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Selects `device` in this module's runtime (its current device is separate from torch's).
std::string use_device(int device);
int sm_count(int device);

// Loads K1's kernels on `device` and caches their occupancy, so that nothing is loaded or queried lazily later
// (inside a CUDA graph capture, say); each step's own are loaded by the function its entry registered (entry.h).
std::string prepare_norm(int device);

}  // namespace cuda
}  // namespace ampfused
