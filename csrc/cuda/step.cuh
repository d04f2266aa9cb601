// K2 (the optimizer step over flat buffers) and its single-launch variant, for any optimizer `Op`:
//
//   Op::Hyper, Op::Consts
//   Op::make(coef, lr, step, hyper) -> Consts            (per-step constants, math.h)
//   Op::apply(g, w, s1, s2, consts)                        (one element, math.h)
//
// Two-kernel path: K1 already wrote the partials; every block of K2 reduces them (same order in every
// block), returns at once on found_inf, else updates its grid-stride share of 8-element groups with
// 128-bit loads and stores (16-byte aligned buffers, checked in Python), and the last block done
// advances `step` (an integer counter; no floating-point atomics).
// Single launch: a cooperative grid computes K1 over grad into the partials, waits at a grid barrier,
// then runs the same K2 body; its partials are bit-identical to K1's (same geometry), so both paths
// give the same bits.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>

#include "common.cuh"

namespace ampfused {
namespace cuda {

// single_launch is a kernel argument, not a template parameter: one kernel per type pair serves both
// paths (the barrier is reached only in a cooperative launch) and the build stays small.
template <typename G, typename P, typename Op>
__global__ void __launch_bounds__(kThreads) step_kernel(const StepArgs a, const typename Op::Hyper h,
                                                        int32_t* __restrict__ counter, const int single_launch) {
  if (single_launch) {
    const int64_t nparts = partials_of(a.n);
    float* partials = const_cast<float*>(a.partials);
    for (int64_t j = blockIdx.x; j < nparts; j += gridDim.x) {
      k1_write_partial<G, false>(const_cast<G*>(static_cast<const G*>(a.grad)), a.n, nparts, j, *a.inv_scale,
                                 partials, nparts, j);
    }
    cooperative_groups::this_grid().sync();
  }
  __shared__ Prologue pro;
  step_prologue(a, h.max_norm, &pro);
  if (pro.skip) return;  // a skipped step changes nothing
  __shared__ typename Op::Consts consts;
  if (threadIdx.x == 0) {
    consts = Op::make(pro.coef, pro.lr, pro.step, h);
    count_and_advance_step(a, counter);
  }
  __syncthreads();
  const typename Op::Consts c = consts;

  const G* __restrict__ grad = static_cast<const G*>(a.grad);
  P* __restrict__ param = static_cast<P*>(a.param);
  const bool has_master = a.master != nullptr;
  float* __restrict__ w = has_master ? a.master : reinterpret_cast<float*>(a.param);
  float* __restrict__ s1 = a.state1;
  float* __restrict__ s2 = a.state2;
  const int64_t groups = a.n / kVec;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t gi = int64_t(blockIdx.x) * kThreads + threadIdx.x; gi < groups; gi += stride) {
    const int64_t off = gi * kVec;
    float g[kVec], wv[kVec], v1[kVec], v2[kVec];
    load8(grad + off, g);
    load8(w + off, wv);
    if (s1) load8(s1 + off, v1);
    if (s2) load8(s2 + off, v2);
#pragma unroll
    for (int k = 0; k < kVec; ++k) Op::apply(g[k], wv[k], v1[k], v2[k], c);
    store8(w + off, wv);
    if (s1) store8(s1 + off, v1);
    if (s2) store8(s2 + off, v2);
    if (has_master) store8(param + off, wv);
  }
  // the n % 8 elements after the last full group
  const int64_t i = groups * kVec + threadIdx.x;
  if (blockIdx.x == gridDim.x - 1 && i < a.n) {
    float wi = w[i], v1i = s1 ? s1[i] : 0.0f, v2i = s2 ? s2[i] : 0.0f;
    Op::apply(to_f32(grad[i]), wi, v1i, v2i, c);
    w[i] = wi;
    if (s1) s1[i] = v1i;
    if (s2) s2[i] = v2i;
    if (has_master) param[i] = from_f32<P>(wi);
  }
}

// Blocks of step_kernel<G, P, Op> that fit on the device at once (cached per device).
template <typename G, typename P, typename Op>
int resident_blocks(int device) {
  static int cached[64] = {};
  auto kernel = step_kernel<G, P, Op>;
  if (device < 0 || device >= 64) return sm_count(device);
  if (!cached[device]) {
    use_device(device);
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess || per_sm < 1) {
      cudaGetLastError();
      per_sm = 1;
    }
    cached[device] = per_sm * sm_count(device);
  }
  return cached[device];
}

template <typename G, typename P, typename Op>
std::string launch_step_typed(int device, cudaStream_t s, const StepArgs& a, const typename Op::Hyper& h,
                              int32_t* counter, bool single_launch) {
  const int64_t groups = a.n / kVec;
  const int64_t want = std::max<int64_t>(1, (groups + kThreads - 1) / kThreads);
  auto kernel = step_kernel<G, P, Op>;
  const int resident = resident_blocks<G, P, Op>(device);
  cudaError_t e;
  if (single_launch) {
    const int grid = int(std::min<int64_t>(std::max<int64_t>(want, partials_of(a.n)), resident));
    StepArgs args = a;
    typename Op::Hyper hyper = h;
    int flag = 1;
    void* params[] = {&args, &hyper, &counter, &flag};
    e = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(grid), dim3(kThreads), params, 0, s);
  } else {
    kernel<<<int(std::min<int64_t>(want, resident)), kThreads, 0, s>>>(a, h, counter, 0);
    e = cudaGetLastError();
  }
  return e == cudaSuccess ? std::string() : cuda_error(single_launch ? "cooperative step launch" : "step launch", e);
}

template <typename F>
void with_type(int code, F&& f) {
  switch (code) {
    case kBF16: f(bf16_t{}); break;
    case kF16: f(f16_t{}); break;
    default: f(float{}); break;
  }
}

template <typename Op>
std::string launch_step(int device, uintptr_t stream, const StepArgs& a, const typename Op::Hyper& h,
                        int32_t* counter, bool single_launch) {
  std::string err = use_device(device);
  if (!err.empty()) return err;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  with_type(a.grad_dtype, [&](auto gtag) {
    with_type(a.master ? a.param_dtype : kF32, [&](auto ptag) {
      err = launch_step_typed<decltype(gtag), decltype(ptag), Op>(device, s, a, h, counter, single_launch);
    });
  });
  return err;
}

// Loads every (grad, param) kernel of Op on `device` and caches its occupancy (see prepare_norm).
template <typename Op>
std::string prepare_step(int device) {
  std::string err = use_device(device);
  if (!err.empty()) return err;
  for (int g : {int(kF32), int(kBF16), int(kF16)}) {
    for (int p : {int(kF32), int(kBF16), int(kF16)}) {
      with_type(g, [&](auto gtag) {
        with_type(p, [&](auto ptag) { resident_blocks<decltype(gtag), decltype(ptag), Op>(device); });
      });
    }
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : cuda_error("loading the step kernels", e);
}

}  // namespace cuda
}  // namespace ampfused
