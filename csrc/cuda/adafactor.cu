// The CUDA Adafactor step (ampfused/ops/reference_adafactor.py; the same passes as csrc/cpu/adafactor.h and
// triton_kernels/adafactor.py): one launch, one block per parameter. A block owns its parameter, so the factors
// it writes are read by no other block and the passes need no grid-wide barrier:
//   1. row sums of the clipped gradient's squares (one warp per row, its lanes along the row) and the weight's;
//      the new row factors; column sums (each lane one column, rows in order); the new column factors;
//   2. the update's sum of squares (u = g / sqrt(max(row * col / max(mean(rows), eps1), eps1^2)));
//   3. the step size (fp64 from the fp32 sums, rounded once) and the weights, in the step's master format.
// Sums are fp64 in an order fixed by the shape (lanes and warps reduced by a fixed shuffle tree), the build
// forbids fma: the same bits run to run. Self-contained beyond common.cuh's prologue and block reduction.
#include <cuda_runtime.h>

#include "common.cuh"

namespace ampfused {
namespace cuda {
namespace {

constexpr int kWarpsAf = kThreads / 32;

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

// max(mean of matrix b's new row factors, eps1), in every thread (summed in a fixed order).
__device__ __forceinline__ float af_rmean(const float* rows, int64_t R, float eps1) {
  double s = 0.0;
  for (int64_t r = threadIdx.x; r < R; r += kThreads) s += double(rows[r]);
  return af_clamp_min(__fdiv_rn(float(block_sum_all(s)), float(R)), eps1);
}

template <typename G, typename P, int kFmt>
__global__ void __launch_bounds__(kThreads) adafactor_kernel(const int64_t* table, StepArgs a, AfCudaHyper h) {
  __shared__ Prologue pro;
  step_prologue(a, h.max_norm, &pro);
  if (pro.skip) return;
  const int64_t* row = table + int64_t(blockIdx.x) * kAfCols;
  const int64_t n = row[2];
  if (n == kNoGrad) return;
  const AfElems<G, P, kFmt> e{reinterpret_cast<P*>(uintptr_t(row[0])), reinterpret_cast<const G*>(uintptr_t(row[1])),
                              a.master, row[3], pro.coef, h.maximize};
  const AfCudaShape s(row);
  float* f = h.factors + row[4];
  void* step_at = scalar_at(a.steps, a.step_code, blockIdx.x);
  const double t = next_step(read_scalar(step_at, a.step_code));
  const double lr = read_scalar(a.lr, a.lr_code);
  const float w2 = float(pow(t, h.beta2_decay));
  const double rho = fmin(lr, 1.0 / sqrt(t));
  const float decay = float(1.0 - lr * h.weight_decay);
  const float eps1 = float(h.eps1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  double w_sumsq = 0.0, u_sumsq = 0.0;
  const int64_t B = s.B, R = s.R, C = s.C;
  float* rows = f;
  float* cols = f + B * R;
  if (s.factored) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t base = s.base(b);
      for (int64_t r = warp; r < R; r += kWarpsAf) {  // 1. rows: a warp per row
        double gs = 0.0;
        for (int64_t c = lane; c < C; c += 32) {
          const int64_t j = base + r * s.sr + c * s.sc;
          const float gi = e.g(j), wi = e.w(j);
          gs += double(__fmul_rn(gi, gi));
          w_sumsq += double(__fmul_rn(wi, wi));
        }
        gs = warp_sum(gs);
        if (lane == 0) rows[b * R + r] = af_lerp(rows[b * R + r], __fdiv_rn(float(gs), float(C)), w2);
      }
      for (int64_t c = threadIdx.x; c < C; c += kThreads) {  // columns: a thread per column
        double gs = 0.0;
        for (int64_t r = 0; r < R; ++r) {
          const float gi = e.g(base + r * s.sr + c * s.sc);
          gs += double(__fmul_rn(gi, gi));
        }
        cols[b * C + c] = af_lerp(cols[b * C + c], __fdiv_rn(float(gs), float(R)), w2);
      }
    }
    __syncthreads();
    for (int64_t b = 0; b < B; ++b) {  // 2. the update's sum of squares
      const int64_t base = s.base(b);
      const float rm = af_rmean(rows + b * R, R, eps1);
      for (int64_t r = warp; r < R; r += kWarpsAf) {
        for (int64_t c = lane; c < C; c += 32) {
          const float v = af_clamp_min(__fdiv_rn(__fmul_rn(rows[b * R + r], cols[b * C + c]), rm), h.eps1_sq);
          const float u = __fdiv_rn(e.g(base + r * s.sr + c * s.sc), __fsqrt_rn(v));
          u_sumsq += double(__fmul_rn(u, u));
        }
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const float gi = e.g(j), wi = e.w(j);
      const float var = af_lerp(f[j], __fmul_rn(gi, gi), w2);
      f[j] = var;
      const float u = __fdiv_rn(gi, __fsqrt_rn(af_clamp_min(var, h.eps1_sq)));
      w_sumsq += double(__fmul_rn(wi, wi));
      u_sumsq += double(__fmul_rn(u, u));
    }
  }
  w_sumsq = block_sum_all(w_sumsq);
  u_sumsq = block_sum_all(u_sumsq);
  const double root_n = sqrt(double(n));
  const double alpha = af_max(double(__fsqrt_rn(float(w_sumsq))) / root_n, h.eps2) * rho;
  const float step = float(alpha / af_max(double(__fsqrt_rn(float(u_sumsq))) / (root_n * h.d), 1.0));
  const bool decays = h.weight_decay != 0.0;
  const uint32_t key = kFmt == kMasterNone ? stream_key(uint64_t(*a.seed), key_step(t), kStreamWeight) : 0u;
  if (s.factored) {  // 3. the weights
    for (int64_t b = 0; b < B; ++b) {
      const int64_t base = s.base(b);
      const float rm = af_rmean(rows + b * R, R, eps1);
      for (int64_t r = warp; r < R; r += kWarpsAf) {
        for (int64_t c = lane; c < C; c += 32) {
          const int64_t j = base + r * s.sr + c * s.sc;
          const float v = af_clamp_min(__fdiv_rn(__fmul_rn(rows[b * R + r], cols[b * C + c]), rm), h.eps1_sq);
          const float u = __fdiv_rn(e.g(j), __fsqrt_rn(v));
          const float wi = e.w(j);
          e.store(j, __fsub_rn(decays ? __fmul_rn(wi, decay) : wi, __fmul_rn(step, u)), key);
        }
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const float u = __fdiv_rn(e.g(j), __fsqrt_rn(af_clamp_min(f[j], h.eps1_sq)));
      const float wi = e.w(j);
      e.store(j, __fsub_rn(decays ? __fmul_rn(wi, decay) : wi, __fmul_rn(step, u)), key);
    }
  }
  __syncthreads();  // every thread read the step count (for t) before it changes
  if (threadIdx.x == 0) add_one(step_at, a.step_code);
}

template <typename F>
void af_with_type(int code, F&& f) {
  switch (code) {
    case kBF16: f(bf16_t{}); break;
    case kF16: f(f16_t{}); break;
    default: f(float{}); break;
  }
}

}  // namespace

std::string adafactor_step(int device, uintptr_t stream, const int64_t* table, const StepArgs& a,
                           const AfCudaHyper& h) {
  if (a.count == 0) return "";
  const std::string dev = use_device(device);
  if (!dev.empty()) return dev;
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  af_with_type(a.grad_dtype, [&](auto gtag) {
    af_with_type(a.param_dtype, [&](auto ptag) {
      using G = decltype(gtag);
      using P = decltype(ptag);
      const dim3 grid(unsigned(a.count));
      if (a.master_format == kMasterRemainder) {
        adafactor_kernel<G, P, kMasterRemainder><<<grid, kThreads, 0, st>>>(table, a, h);
      } else if (a.master_format == kMasterNone) {
        adafactor_kernel<G, P, kMasterNone><<<grid, kThreads, 0, st>>>(table, a, h);
      } else {
        adafactor_kernel<G, P, kMasterF32><<<grid, kThreads, 0, st>>>(table, a, h);
      }
    });
  });
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : cuda_error("adafactor_step launch", e);
}

}  // namespace cuda
}  // namespace ampfused
