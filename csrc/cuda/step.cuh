// K2 (the optimizer step over the parameters of a tensor table) and its single-launch variant, for any
// optimizer `Op`:
//
//   Op::Hyper, Op::Consts
//   Op::make(coef, lr, step, hyper) -> Consts            (per-parameter constants, math.h)
//   Op::apply(g, w, s1, s2, consts)                        (one element, math.h)
//   Op::kStates (optional, default 2)                      (moments it keeps: 1 leaves state2 out of the
//                                                           compact kernels, which never touch it then)
// and, for a pass of a step split around a function of whole tensors (ops/specs.py: OpSpec.split):
//   Op::at(hyper, row, offset, param, grad, consts)        (optional: after make, once per parameter; may point
//                                                           param or grad at a scratch and finish the consts)
//   Op::kOutput (optional, default false)                  (the "weight" is a 16-bit output, written to nearest
//                                                           and never a master: the compact kernels take it)
//   Op::kAdvancesSteps (optional, default true)            (false: the pass leaves the step counts alone)
//
// Two-kernel path: K1 already wrote the partials. A persistent grid (at most the blocks that fit on the
// device at once) runs; every block reduces all partials (same order in every block) and returns at once
// on found_inf, else takes the chunks c = blockIdx.x, c + gridDim.x, ... of the work list. For each chunk,
// thread 0 reads its table row and, when the row differs from the block's previous chunk, derives that
// parameter's constants from its own step count; then the block updates the chunk's elements in memory
// order, 8 at a time with 128-bit loads and stores when the parameter and its gradient are 16-byte aligned
// (the flat state buffers always are), one at a time otherwise; the n % 8 elements after a parameter's last
// full vector go one at a time. The last block to finish adds 1 to the step count of every parameter that
// has a gradient (an integer arrival counter; no floating-point atomics).
// Compact state (math.h, ampfused/ops/state_precision.py) goes 8 elements per thread per trip too, in
// compact.cuh: update_chunk_compact (remainders, stochastic rounding, bf16 moments) and, in compact_q8.cuh,
// update_chunk_q8 (8-bit moments: one block of codes per warp, its exponent a warp-shuffle max, no barrier).
// Single launch: a cooperative grid computes K1 over the gradients into the partials (the columns of
// norm_check over the same gradients), waits at a grid barrier, then runs the same K2 body; its partials are
// bit-identical to K1's, so both paths give the same bits.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "compact_q8.cuh"

namespace ampfused {
namespace cuda {

// The optional members of an Op (above).
template <typename Op, typename = void>
struct OpHasAt : std::false_type {};
template <typename Op>
struct OpHasAt<Op, std::void_t<decltype(&Op::at)>> : std::true_type {};
template <typename Op, typename = void>
struct OpOutput : std::false_type {};
template <typename Op>
struct OpOutput<Op, std::void_t<decltype(Op::kOutput)>> : std::integral_constant<bool, Op::kOutput> {};
template <typename Op, typename = void>
struct OpAdvancesSteps : std::true_type {};
template <typename Op>
struct OpAdvancesSteps<Op, std::void_t<decltype(Op::kAdvancesSteps)>>
    : std::integral_constant<bool, Op::kAdvancesSteps> {};

// The parameter of a block's current chunk, set by thread 0 and read by the whole block.
template <typename Consts>
struct ChunkRow {
  Consts consts;    // from this parameter's step count
  const void* grad;
  void* param;
  int64_t n;        // elements
  int64_t offset;   // of its first element in master / state1 / state2
  int64_t row;      // table row; -1 before the first chunk
  int64_t lo;       // first element of the chunk
  uint32_t key;     // compact state: step_key at this parameter's step (each element's one draw)
};

// Elements [lo, min(n, lo + kStepChunk)) of one parameter, in memory order, by the whole block.
template <typename G, typename P, typename Op>
__device__ __forceinline__ void update_chunk(const StepArgs& a, const G* __restrict__ grad, P* __restrict__ param,
                                             int64_t n, int64_t offset, int64_t lo, const typename Op::Consts& c) {
  const int64_t hi = n < lo + kStepChunk ? n : lo + kStepChunk;
  const bool has_master = a.master != nullptr;
  // without a master the parameters are the fp32 compute copy (P is float then)
  float* __restrict__ w = has_master ? a.master + offset : reinterpret_cast<float*>(param);
  float* __restrict__ s1 = a.state1 ? a.state1 + offset : nullptr;
  float* __restrict__ s2 = a.state2 ? a.state2 + offset : nullptr;
  // lo is a multiple of kVec, and offset of 4 fp32: an aligned parameter and gradient make every pointer
  // below 16-byte aligned at lo + 8k (checked in Python: the flat buffers start 16-byte aligned)
  const bool aligned = ((reinterpret_cast<uintptr_t>(param) | reinterpret_cast<uintptr_t>(grad)) & 15u) == 0;
  int64_t first_scalar = lo;
  if (aligned) {
    const int64_t groups = (hi - lo) / kVec;
    for (int64_t gi = threadIdx.x; gi < groups; gi += kThreads) {
      const int64_t off = lo + gi * kVec;
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
    first_scalar = lo + groups * kVec;
  }
  // a misaligned chunk, or the elements after the parameter's last full vector: one element per thread
  for (int64_t i = first_scalar + threadIdx.x; i < hi; i += kThreads) {
    float wi = w[i], v1i = s1 ? s1[i] : 0.0f, v2i = s2 ? s2[i] : 0.0f;
    Op::apply(to_f32(grad[i]), wi, v1i, v2i, c);
    w[i] = wi;
    if (s1) s1[i] = v1i;
    if (s2) s2[i] = v2i;
    if (has_master) param[i] = from_f32<P>(wi);
  }
}

// single_launch is a kernel argument, not a template parameter: one kernel per type pair serves both
// paths (the barrier is reached only in a cooperative launch) and the build stays small.
template <typename G, typename P, typename Op, int kFmt = kMasterF32, typename S = float>
__global__ void __launch_bounds__(kThreads) step_kernel(const StepArgs a, const WorkList work,
                                                        const typename Op::Hyper h, int32_t* __restrict__ counter,
                                                        const int single_launch) {
  if (single_launch) {
    // K1 over every gradient of the table: column q is partial j of row r (item q of the columns list)
    float* partials = const_cast<float*>(a.partials);
    const float inv_scale = *a.inv_scale;
    for (int64_t q = blockIdx.x; q < work.num_columns; q += gridDim.x) {
      const int64_t item = work.columns[q];
      const int64_t* r = a.table + work_row(item) * kTableCols;
      const int64_t n = r[kColNumel];
      G* grad = reinterpret_cast<G*>(static_cast<uintptr_t>(r[kColGrad]));
      k1_write_partial<G, false>(grad, n, partials_of(n), work_index(item), inv_scale, partials, a.num_partials, q);
    }
    cooperative_groups::this_grid().sync();
  }
  __shared__ Prologue pro;
  step_prologue(a, h.max_norm, &pro);
  if (pro.skip) return;  // a skipped step changes nothing (out_stats aside)

  __shared__ ChunkRow<typename Op::Consts> cur;
  if (threadIdx.x == 0) cur.row = -1;  // read and written by thread 0 only until the barrier below
  if constexpr (std::is_same<S, uint8_t>::value) q8_fill_tables(q8_tables());  // (ordered by that barrier)
  for (int64_t ci = blockIdx.x; ci < work.num_chunks; ci += gridDim.x) {
    if (threadIdx.x == 0) {
      const int64_t item = work.chunks[ci];
      const int64_t row = work_row(item);
      if (row != cur.row) {
        const int64_t* r = a.table + row * kTableCols;
        cur.param = reinterpret_cast<void*>(static_cast<uintptr_t>(r[kColParam]));
        cur.grad = reinterpret_cast<const void*>(static_cast<uintptr_t>(r[kColGrad]));
        cur.n = r[kColNumel];
        cur.offset = r[kColOffset];
        cur.row = row;
        const double step = read_scalar(scalar_at(a.steps, a.step_code, row), a.step_code);
        cur.consts = Op::make(pro.coef, pro.lr, step, h);
        if constexpr (OpHasAt<Op>::value) Op::at(h, row, cur.offset, cur.param, cur.grad, cur.consts);
        if (a.seed) {
          const uint32_t t = key_step(next_step(step));
          cur.key = step_key(uint64_t(*a.seed), t);
        }
      }
      cur.lo = work_index(item) * kStepChunk;
    }
    __syncthreads();
    const typename Op::Consts c = cur.consts;
    if constexpr (kFmt == kMasterF32 && std::is_same<S, float>::value && !OpOutput<Op>::value) {
      update_chunk<G, P, Op>(a, static_cast<const G*>(cur.grad), static_cast<P*>(cur.param), cur.n, cur.offset,
                             cur.lo, c);
    } else if constexpr (std::is_same<S, uint8_t>::value) {
      update_chunk_q8<G, P, Op, kFmt>(a, static_cast<const G*>(cur.grad), static_cast<P*>(cur.param), cur.n,
                                      cur.offset, cur.lo, c, cur.key, q8_tables());
    } else {
      update_chunk_compact<G, P, Op, kFmt, S>(a, static_cast<const G*>(cur.grad), static_cast<P*>(cur.param), cur.n,
                                              cur.offset, cur.lo, c, cur.key);
    }
    __syncthreads();  // everyone is done with `cur` before thread 0 moves it to the next chunk
  }
  if constexpr (OpAdvancesSteps<Op>::value) count_and_advance_steps(a, counter);
}

// Blocks of step_kernel<G, P, Op, kFmt, S> that fit on the device at once (cached per device).
template <typename G, typename P, typename Op, int kFmt = kMasterF32, typename S = float>
int resident_blocks(int device) {
  static int cached[64] = {};
  auto kernel = step_kernel<G, P, Op, kFmt, S>;
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

template <typename G, typename P, typename Op, int kFmt = kMasterF32, typename S = float>
std::string launch_step_typed(int device, cudaStream_t s, const StepArgs& a, const WorkList& w,
                              const typename Op::Hyper& h, int32_t* counter, bool single_launch) {
  // a persistent grid: one block per unit of work, at most the resident blocks, at least one (a step with
  // no elements still records out_stats and advances the counts of its empty parameters)
  const int64_t want = single_launch ? std::max(w.num_chunks, w.num_columns) : w.num_chunks;
  const int64_t resident = resident_blocks<G, P, Op, kFmt, S>(device);
  const int grid = int(std::max<int64_t>(1, std::min(want, resident)));
  auto kernel = step_kernel<G, P, Op, kFmt, S>;
  cudaError_t e;
  if (single_launch) {
    StepArgs args = a;
    WorkList work = w;
    typename Op::Hyper hyper = h;
    int flag = 1;
    void* params[] = {&args, &work, &hyper, &counter, &flag};
    e = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(grid), dim3(kThreads), params, 0, s);
  } else {
    kernel<<<grid, kThreads, 0, s>>>(a, w, h, counter, 0);
    e = cudaGetLastError();
  }
  return e == cudaSuccess ? std::string() : cuda_error(single_launch ? "cooperative step launch" : "step launch", e);
}

// The moments' storage type of a step (StepArgs::state_dtype): fp32, bf16, or 8-bit codes.
template <typename F>
void with_state(int code, F&& f) {
  switch (code) {
    case kBF16: f(bf16_t{}); break;
    case kStateU8: f(uint8_t{}); break;
    default: f(float{}); break;
  }
}

// Which moment storage one translation unit instantiates (a file each builds in parallel: adam.cu, adam_bf16m.cu
// and adam_q8m.cu), or all of them.
enum StateSet : int { kAllStates = 0, kFp32States = 1, kBf16States = 2, kU8States = 3 };

template <int kSet, typename F>
void with_state_in(int code, F&& f) {
  if constexpr (kSet == kFp32States) {
    f(float{});
  } else if constexpr (kSet == kBf16States) {
    f(bf16_t{});
  } else if constexpr (kSet == kU8States) {
    f(uint8_t{});
  } else {
    with_state(code, f);
  }
}

template <typename Op, int kSet = kAllStates>
std::string launch_step(int device, uintptr_t stream, const StepArgs& a, const WorkList& w,
                        const typename Op::Hyper& h, int32_t* counter, bool single_launch) {
  std::string err = use_device(device);
  if (!err.empty()) return err;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  with_type(a.grad_dtype, [&](auto gtag) {
    using G = decltype(gtag);
    with_state_in<kSet>(a.state_dtype, [&](auto stag) {
      using S = decltype(stag);
      if (a.master_format == kMasterRemainder) {
        err = launch_step_typed<G, bf16_t, Op, kMasterRemainder, S>(device, s, a, w, h, counter, single_launch);
      } else if (a.master_format == kMasterNone) {
        err = launch_step_typed<G, bf16_t, Op, kMasterNone, S>(device, s, a, w, h, counter, single_launch);
      } else {
        with_type(a.master ? a.param_dtype : kF32, [&](auto ptag) {
          using P = decltype(ptag);
          err = launch_step_typed<G, P, Op, kMasterF32, S>(device, s, a, w, h, counter, single_launch);
        });
      }
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
