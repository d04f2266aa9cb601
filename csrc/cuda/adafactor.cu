// The CUDA Adafactor step (ampfused/ops/reference_adafactor.py; the same passes as csrc/cpu/steps/adafactor.h and
// triton_kernels/adafactor.py): one cooperative launch, its blocks over tiles of every parameter (a band of whole
// rows of one matrix, or a span of a vector: ampfused/ops/native_factored.py, tiles), grid barriers between
//   1. per tile: its rows' sums of the clipped gradient's squares (a warp per row, lanes along the row) and the
//      new row factors (a band owns its rows), its columns' partial sums (a thread per column, the band's rows in
//      order), and the sums of w*w and of the new row factors; a vector's tile updates its variance and sums
//      w*w and u*u;
//   2. per column item (AfCudaHyper::col_chunk columns of one matrix): the column sums over the bands in order,
//      the new column factors;
//   3. per band: the sum of u*u (u = g / sqrt(max(row * col / max(mean(rows), eps1), eps1^2)));
//   4. per tile: the step size (fp64 from the parameter's tile sums in tile order, rounded once) and the
//      weights, in the step's master format; then block 0 advances the step counts.
// Every sum is fp64 in an order fixed by the shapes and the tile size (lanes and warps by a fixed shuffle tree,
// tiles in order), never by the grid: the same bits run to run. The build forbids fma. A block reads what other
// blocks wrote only after a grid barrier, through L2 (__ldcg).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common.cuh"
#include "entry.h"

namespace ampfused {
namespace cuda {

// A table row (ampfused/ops/native_factored.py, as the CPU module's): param, grad, numel (kNoGrad without a
// gradient), offset in master, offset in factors, ndim, kAfMaxDims sizes, kAfMaxDims strides (elements). After
// the count rows, count + 1 rows of kAfInfo (native_adafactor.tiles): first tile, rows per band of a matrix
// (elements per span of a vector), offset of its column partial sums in scratch, first column item.
constexpr int kAfMaxDims = 8;
constexpr int kAfCols = 6 + 2 * kAfMaxDims;
constexpr int kAfInfo = 4;

struct AfCudaHyper {
  double beta2_decay, eps1, eps2, d, weight_decay, max_norm;
  float eps1_sq;
  bool maximize;
  float* factors;  // fp32, factor_layout of the parameters' shapes
  int64_t num_tiles, num_items, num_colparts, col_chunk;
  double* scratch;  // num_colparts column partial sums, then per tile: w*w, new row factors, u*u
};

namespace {

constexpr int kWarpsAf = kThreads / 32;

#include "factored.cuh"

// The row of the table whose tiles (col 0) or column items (col 3) hold x: info has count + 1 rows, ascending.
__device__ __forceinline__ int64_t af_find(const int64_t* info, int64_t count, int64_t x, int col) {
  int64_t lo = 0, hi = count;  // info[lo] <= x < info[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (info[mid * kAfInfo + col] <= x) lo = mid; else hi = mid;
  }
  return lo;
}

// The block's sum of xs[0..n) (fp64, read through L2), in an order fixed by n, in every thread.
__device__ __forceinline__ double af_sum_l2(const double* xs, int64_t n) {
  double s = 0.0;
  for (int64_t k = threadIdx.x; k < n; k += kThreads) s += __ldcg(xs + k);
  return block_sum_all(s);
}

// One parameter's tile: where it is and the step's scalars for its parameter.
struct AfTile {
  int64_t k, local, b, r0, r1, bands;
  const int64_t* row;
  const int64_t* info;
  double t;
  float w2;
};

__device__ __forceinline__ AfTile af_tile(const int64_t* table, const int64_t* info, int64_t count, const StepArgs& a,
                                          const AfCudaHyper& h, int64_t x, int col) {
  AfTile tl;
  tl.k = af_find(info, count, x, col);
  tl.row = table + tl.k * kAfCols;
  tl.info = info + tl.k * kAfInfo;
  tl.local = x - tl.info[col];
  tl.t = next_step(read_scalar(scalar_at(a.steps, a.step_code, tl.k), a.step_code));
  tl.w2 = float(pow(tl.t, h.beta2_decay));
  const AfCudaShape s(tl.row);
  const int64_t band = tl.info[1];
  tl.bands = s.factored ? (s.R + band - 1) / band : 0;
  tl.b = tl.r0 = tl.r1 = 0;
  if (col == 0 && s.factored) {
    tl.b = tl.local / tl.bands;
    tl.r0 = (tl.local % tl.bands) * band;
    tl.r1 = min(s.R, tl.r0 + band);
  } else if (col == 0) {
    tl.r0 = tl.local * band;  // a vector's span of elements
    tl.r1 = min(tl.row[2], tl.r0 + band);
  }
  return tl;
}

// max(mean of matrix b's new row factors, eps1), from its bands' sums in band order, in every thread.
__device__ __forceinline__ float af_rmean(const double* rowsums, const AfTile& tl, int64_t R, float eps1) {
  const double s = af_sum_l2(rowsums + tl.info[0] + tl.b * tl.bands, tl.bands);
  return af_clamp_min(__fdiv_rn(float(s), float(R)), eps1);
}

template <typename G, typename P, int kFmt>
__global__ void __launch_bounds__(kThreads) adafactor_kernel(const int64_t* table, StepArgs a, AfCudaHyper h) {
  __shared__ Prologue pro;
  step_prologue(a, h.max_norm, &pro);
  if (pro.skip) return;  // every block returns: no barrier is reached
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  const int64_t count = a.count;
  const int64_t* info = table + count * kAfCols;
  double* colparts = h.scratch;
  double* wsums = h.scratch + h.num_colparts;
  double* rowsums = wsums + h.num_tiles;
  double* usums = rowsums + h.num_tiles;
  const float eps1 = float(h.eps1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // 1. rows, column partial sums, w*w; a vector's variance and u*u
  for (int64_t x = blockIdx.x; x < h.num_tiles; x += gridDim.x) {
    const AfTile tl = af_tile(table, info, count, a, h, x, 0);
    const auto e = af_elems<G, P, kFmt>(tl.row, a, pro.coef, h.maximize);
    const AfCudaShape s(tl.row);
    float* f = h.factors + tl.row[4];
    double w_sumsq = 0.0, u_sumsq = 0.0, row_sum = 0.0;
    if (s.factored) {
      const int64_t base = s.base(tl.b), C = s.C;
      float* rows = f + tl.b * s.R;
      for (int64_t r = tl.r0 + warp; r < tl.r1; r += kWarpsAf) {  // a warp per row
        double gs = 0.0;
        for (int64_t c = lane; c < C; c += 32) {
          const int64_t j = base + r * s.sr + c * s.sc;
          const float gi = e.g(j), wi = e.w(j);
          gs += double(__fmul_rn(gi, gi));
          w_sumsq += double(__fmul_rn(wi, wi));
        }
        gs = warp_sum(gs);
        if (lane == 0) {
          const float v = af_lerp(rows[r], __fdiv_rn(float(gs), float(C)), tl.w2);
          rows[r] = v;
          row_sum += double(v);
        }
      }
      double* part = colparts + tl.info[2] + tl.local * C;
      for (int64_t c = threadIdx.x; c < C; c += kThreads) {  // a thread per column
        double gs = 0.0;
        for (int64_t r = tl.r0; r < tl.r1; ++r) {
          const float gi = e.g(base + r * s.sr + c * s.sc);
          gs += double(__fmul_rn(gi, gi));
        }
        part[c] = gs;
      }
    } else {
      for (int64_t j = tl.r0 + threadIdx.x; j < tl.r1; j += kThreads) {
        const float gi = e.g(j), wi = e.w(j);
        const float var = af_lerp(f[j], __fmul_rn(gi, gi), tl.w2);
        f[j] = var;
        const float u = __fdiv_rn(gi, __fsqrt_rn(af_clamp_min(var, h.eps1_sq)));
        w_sumsq += double(__fmul_rn(wi, wi));
        u_sumsq += double(__fmul_rn(u, u));
      }
    }
    w_sumsq = block_sum_all(w_sumsq);
    u_sumsq = block_sum_all(u_sumsq);
    row_sum = block_sum_all(row_sum);
    if (threadIdx.x == 0) {
      wsums[x] = w_sumsq;
      usums[x] = u_sumsq;  // a matrix's is written in pass 3
      rowsums[x] = row_sum;
    }
  }
  grid.sync();

  // 2. the column factors: a thread per column, the bands' partial sums in band order
  for (int64_t x = blockIdx.x; x < h.num_items; x += gridDim.x) {
    const AfTile tl = af_tile(table, info, count, a, h, x, 3);
    const AfCudaShape s(tl.row);
    const int64_t chunks = (s.C + h.col_chunk - 1) / h.col_chunk;
    const int64_t b = tl.local / chunks, c0 = (tl.local % chunks) * h.col_chunk;
    const int64_t c1 = min(s.C, c0 + h.col_chunk);
    const double* part = colparts + tl.info[2] + b * tl.bands * s.C;
    float* cols = h.factors + tl.row[4] + s.B * s.R + b * s.C;
    for (int64_t c = c0 + threadIdx.x; c < c1; c += kThreads) {
      double gs = 0.0;
      for (int64_t k = 0; k < tl.bands; ++k) gs += __ldcg(part + k * s.C + c);
      cols[c] = af_lerp(cols[c], __fdiv_rn(float(gs), float(s.R)), tl.w2);
    }
  }
  grid.sync();

  // 3. a band's sum of u*u from the new factors
  for (int64_t x = blockIdx.x; x < h.num_tiles; x += gridDim.x) {
    const AfTile tl = af_tile(table, info, count, a, h, x, 0);
    const AfCudaShape s(tl.row);
    if (!s.factored) continue;  // uniform in the block: a vector's sum is from pass 1
    const auto e = af_elems<G, P, kFmt>(tl.row, a, pro.coef, h.maximize);
    const float* rows = h.factors + tl.row[4] + tl.b * s.R;
    const float* cols = h.factors + tl.row[4] + s.B * s.R + tl.b * s.C;
    const float rm = af_rmean(rowsums, tl, s.R, eps1);
    const int64_t base = s.base(tl.b);
    double u_sumsq = 0.0;
    for (int64_t r = tl.r0 + warp; r < tl.r1; r += kWarpsAf) {
      const float rv = __ldcg(rows + r);
      for (int64_t c = lane; c < s.C; c += 32) {
        const float v = af_clamp_min(__fdiv_rn(__fmul_rn(rv, __ldcg(cols + c)), rm), h.eps1_sq);
        const float u = __fdiv_rn(e.g(base + r * s.sr + c * s.sc), __fsqrt_rn(v));
        u_sumsq += double(__fmul_rn(u, u));
      }
    }
    u_sumsq = block_sum_all(u_sumsq);
    if (threadIdx.x == 0) usums[x] = u_sumsq;
  }
  grid.sync();

  // 4. the step size of the tile's parameter and its weights
  const double lr = read_scalar(a.lr, a.lr_code);
  const float decay = float(1.0 - lr * h.weight_decay);
  const bool decays = h.weight_decay != 0.0;
  for (int64_t x = blockIdx.x; x < h.num_tiles; x += gridDim.x) {
    const AfTile tl = af_tile(table, info, count, a, h, x, 0);
    const AfCudaShape s(tl.row);
    const auto e = af_elems<G, P, kFmt>(tl.row, a, pro.coef, h.maximize);
    const int64_t n = tl.row[2];
    const int64_t ntiles = tl.info[kAfInfo] - tl.info[0];
    const double w_sumsq = af_sum_l2(wsums + tl.info[0], ntiles);
    const double u_sumsq = af_sum_l2(usums + tl.info[0], ntiles);
    const double rho = fmin(lr, 1.0 / sqrt(tl.t));
    const double root_n = sqrt(double(n));
    const double alpha = af_max(double(__fsqrt_rn(float(w_sumsq))) / root_n, h.eps2) * rho;
    const float step = float(alpha / af_max(double(__fsqrt_rn(float(u_sumsq))) / (root_n * h.d), 1.0));
    const uint32_t key = kFmt == kMasterNone ? step_key(uint64_t(*a.seed), key_step(tl.t)) : 0u;
    float* f = h.factors + tl.row[4];
    if (s.factored) {
      const float* rows = f + tl.b * s.R;
      const float* cols = f + s.B * s.R + tl.b * s.C;
      const float rm = af_rmean(rowsums, tl, s.R, eps1);
      const int64_t base = s.base(tl.b);
      for (int64_t r = tl.r0 + warp; r < tl.r1; r += kWarpsAf) {
        const float rv = __ldcg(rows + r);
        for (int64_t c = lane; c < s.C; c += 32) {
          const int64_t j = base + r * s.sr + c * s.sc;
          const float v = af_clamp_min(__fdiv_rn(__fmul_rn(rv, __ldcg(cols + c)), rm), h.eps1_sq);
          const float u = __fdiv_rn(e.g(j), __fsqrt_rn(v));
          const float wi = e.w(j);
          e.store(j, __fsub_rn(decays ? __fmul_rn(wi, decay) : wi, __fmul_rn(step, u)), key);
        }
      }
    } else {
      for (int64_t j = tl.r0 + threadIdx.x; j < tl.r1; j += kThreads) {
        const float u = __fdiv_rn(e.g(j), __fsqrt_rn(af_clamp_min(__ldcg(f + j), h.eps1_sq)));
        const float wi = e.w(j);
        e.store(j, __fsub_rn(decays ? __fmul_rn(wi, decay) : wi, __fmul_rn(step, u)), key);
      }
    }
  }
  grid.sync();  // every block read the step counts it needed
  if (blockIdx.x == 0) {
    for (int64_t k = threadIdx.x; k < count; k += kThreads) {
      if (table[k * kAfCols + 2] != kNoGrad) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
    }
  }
}

// ---- a step over the shards of parameters split over ranks, in three phases (ampfused/ops/factored.py,
// ShardSums; the phases of csrc/cpu/steps/adafactor.h, adafactor_param): one block per parameter, the phase a
// launch argument, the sums over whole parameters in `sums` (fp64), summed over the ranks between the phases.
//   1. the sums of g*g along each row (a warp per row) and each column (a thread per column), of w*w, and (rows
//      split) of the new row factors; nothing else written;
//   2. the new factors (written), the sums of the new row factors (rows whole here), the sum of u*u;
//   3. the step size from the sums and the weights; the step count.
// The shard table follows the step's table: kShCols ints per parameter (split, the whole parameter's numel, rows
// and columns, then the offsets in sums of its w*w, u*u, row-factor sums, row sums, column sums).
constexpr int kShCols = 9;
constexpr int kSplitRows = 1;  // the rows are split: column sums and the sum of the row factors are partial here

template <typename G, typename P, int kFmt>
__global__ void __launch_bounds__(kThreads)
    adafactor_shard_kernel(const int64_t* table, StepArgs a, AfCudaHyper h, int phase, double* sums) {
  __shared__ Prologue pro;
  step_prologue(a, h.max_norm, &pro);
  if (pro.skip) return;
  const int64_t k = blockIdx.x;
  const int64_t* row = table + k * kAfCols;
  if (row[2] == kNoGrad) return;  // (uniform in the block)
  const int64_t* sh = table + a.count * kAfCols + k * kShCols;
  const int split = int(sh[0]);
  const int64_t n_full = sh[1], r_full = sh[2], c_full = sh[3];
  double* rsum = sums + sh[6];
  double* rowg = sums + sh[7];
  double* colg = sums + sh[8];
  const AfCudaShape s(row);
  const auto e = af_elems<G, P, kFmt>(row, a, pro.coef, h.maximize);
  const double t = next_step(read_scalar(scalar_at(a.steps, a.step_code, k), a.step_code));
  const float w2 = float(pow(t, h.beta2_decay));
  const float eps1 = float(h.eps1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* f = h.factors + row[4];
  const int64_t n = row[2];
  // phase 3: the step size of the whole parameter, from its sums
  const double lr = read_scalar(a.lr, a.lr_code);
  const float decay = float(1.0 - lr * h.weight_decay);
  const bool decays = h.weight_decay != 0.0;
  float step = 0.0f;
  uint32_t key = 0u;
  if (phase == 3) {
    const double rho = fmin(lr, 1.0 / sqrt(t));
    const double root_n = sqrt(double(n_full));
    const double alpha = af_max(double(__fsqrt_rn(float(__ldcg(sums + sh[4])))) / root_n, h.eps2) * rho;
    step = float(alpha / af_max(double(__fsqrt_rn(float(__ldcg(sums + sh[5])))) / (root_n * h.d), 1.0));
    if (kFmt == kMasterNone) key = step_key(uint64_t(*a.seed), key_step(t));
  }
  double w_sumsq = 0.0, u_sumsq = 0.0;
  if (s.factored) {
    const int64_t B = s.B, R = s.R, C = s.C;
    float* rows = f;
    float* cols = f + B * R;
    if (phase == 1) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t base = s.base(b);
        double new_rows = 0.0;  // (lane 0 of each warp: its rows' new factors)
        for (int64_t r = warp; r < R; r += kWarpsAf) {
          double gs = 0.0;
          for (int64_t c = lane; c < C; c += 32) {
            const int64_t j = base + r * s.sr + c * s.sc;
            const float gi = e.g(j), wi = e.w(j);
            gs += double(__fmul_rn(gi, gi));
            w_sumsq += double(__fmul_rn(wi, wi));
          }
          gs = warp_sum(gs);
          if (lane == 0) {
            rowg[b * R + r] = gs;
            new_rows += double(af_lerp(rows[b * R + r], __fdiv_rn(float(gs), float(c_full)), w2));
          }
        }
        for (int64_t c = threadIdx.x; c < C; c += kThreads) {
          double gs = 0.0;
          for (int64_t r = 0; r < R; ++r) {
            const float gi = e.g(base + r * s.sr + c * s.sc);
            gs += double(__fmul_rn(gi, gi));
          }
          colg[b * C + c] = gs;
        }
        new_rows = block_sum_all(new_rows);
        if (split == kSplitRows && threadIdx.x == 0) rsum[b] = new_rows;
      }
      w_sumsq = block_sum_all(w_sumsq);
      if (threadIdx.x == 0) sums[sh[4]] = w_sumsq;
      return;
    }
    if (phase == 2) {  // the new factors (this block their only writer), then their rows' sums
      for (int64_t br = threadIdx.x; br < B * R; br += kThreads) {
        rows[br] = af_lerp(rows[br], __fdiv_rn(float(__ldcg(rowg + br)), float(c_full)), w2);
      }
      for (int64_t bc = threadIdx.x; bc < B * C; bc += kThreads) {
        cols[bc] = af_lerp(cols[bc], __fdiv_rn(float(__ldcg(colg + bc)), float(r_full)), w2);
      }
      __syncthreads();
      if (split != kSplitRows) {
        for (int64_t b = 0; b < B; ++b) {
          double m = 0.0;
          for (int64_t r = threadIdx.x; r < R; r += kThreads) m += double(rows[b * R + r]);
          m = block_sum_all(m);
          if (threadIdx.x == 0) rsum[b] = m;
        }
      }
      __syncthreads();
    }
    for (int64_t b = 0; b < B; ++b) {  // u from the new factors: its sum of squares (2), the weights (3)
      const float rm = af_clamp_min(__fdiv_rn(float(__ldcg(rsum + b)), float(r_full)), eps1);
      const int64_t base = s.base(b);
      for (int64_t r = warp; r < R; r += kWarpsAf) {
        const float rv = rows[b * R + r];
        for (int64_t c = lane; c < C; c += 32) {
          const int64_t j = base + r * s.sr + c * s.sc;
          const float v = af_clamp_min(__fdiv_rn(__fmul_rn(rv, cols[b * C + c]), rm), h.eps1_sq);
          const float u = __fdiv_rn(e.g(j), __fsqrt_rn(v));
          if (phase == 2) {
            u_sumsq += double(__fmul_rn(u, u));
          } else {
            const float wi = e.w(j);
            e.store(j, __fsub_rn(decays ? __fmul_rn(wi, decay) : wi, __fmul_rn(step, u)), key);
          }
        }
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const float gi = e.g(j);
      if (phase == 1) {
        const float wi = e.w(j);
        w_sumsq += double(__fmul_rn(wi, wi));
      } else if (phase == 2) {
        const float var = af_lerp(f[j], __fmul_rn(gi, gi), w2);
        f[j] = var;
        const float u = __fdiv_rn(gi, __fsqrt_rn(af_clamp_min(var, h.eps1_sq)));
        u_sumsq += double(__fmul_rn(u, u));
      } else {
        const float u = __fdiv_rn(gi, __fsqrt_rn(af_clamp_min(f[j], h.eps1_sq)));
        const float wi = e.w(j);
        e.store(j, __fsub_rn(decays ? __fmul_rn(wi, decay) : wi, __fmul_rn(step, u)), key);
      }
    }
    if (phase == 1) {
      w_sumsq = block_sum_all(w_sumsq);
      if (threadIdx.x == 0) sums[sh[4]] = w_sumsq;
      return;
    }
  }
  if (phase == 2) {
    u_sumsq = block_sum_all(u_sumsq);
    if (threadIdx.x == 0) sums[sh[5]] = u_sumsq;
    return;
  }
  __syncthreads();  // every thread read the step count
  if (threadIdx.x == 0) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
}

template <typename G, typename P, int kFmt>
cudaError_t af_shard_launch(cudaStream_t st, const int64_t* table, const StepArgs& a, const AfCudaHyper& h, int phase,
                            double* sums) {
  adafactor_shard_kernel<G, P, kFmt><<<dim3(unsigned(a.count)), dim3(kThreads), 0, st>>>(table, a, h, phase, sums);
  return cudaGetLastError();
}

// Blocks of adafactor_kernel<G, P, kFmt> that fit on the device at once (cached per device): the cooperative
// launch's grid at most.
template <typename G, typename P, int kFmt>
int64_t af_resident(int device) {
  static int64_t cached[64] = {};
  if (device < 0 || device >= 64) return sm_count(device);
  if (!cached[device]) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, adafactor_kernel<G, P, kFmt>, kThreads, 0) !=
            cudaSuccess || per_sm < 1) {
      cudaGetLastError();
      per_sm = 1;
    }
    cached[device] = int64_t(per_sm) * sm_count(device);
  }
  return cached[device];
}

template <typename G, typename P, int kFmt>
cudaError_t af_launch(int device, cudaStream_t st, const int64_t* table, const StepArgs& a, const AfCudaHyper& h) {
  const int64_t want = std::max(h.num_tiles, h.num_items);
  const int grid = int(std::max<int64_t>(1, std::min(want, af_resident<G, P, kFmt>(device))));
  const int64_t* t = table;
  StepArgs args = a;
  AfCudaHyper hyper = h;
  void* params[] = {&t, &args, &hyper};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(adafactor_kernel<G, P, kFmt>), dim3(grid),
                                     dim3(kThreads), params, 0, st);
}

// The step from the pack: its table (slots[table]: the rows, then the tile layout) in device memory.
std::string adafactor_step(const StepPack& p) {
  const int phase = int(p.slot(kSlot_phase));
  double* sums = p.ptr<double>(kSlot_sums);
  if (phase < 0 || phase > 3 || (phase > 0 && sums == nullptr)) {
    throw std::invalid_argument("adafactor_step_: phase must be 0 to 3, and a phase over shards needs its sums");
  }
  const int64_t num_tiles = p.slot(kSlot_tiles), num_items = p.slot(kSlot_items),
                num_colparts = p.slot(kSlot_colparts), col_chunk = p.slot(kSlot_col_chunk);
  if (num_tiles < 0 || num_items < 0 || num_colparts < 0 || col_chunk < 1) {
    throw std::invalid_argument("adafactor_step: a negative tile count or a column chunk below 1");
  }
  const StepArgs& a = p.args;
  if (a.master_format == kMasterNone && a.seed == nullptr) {
    throw std::invalid_argument("stochastic rounding needs a seed");
  }
  const double eps1 = p.h(1);
  const AfCudaHyper h{p.h(0), eps1, p.h(2), p.h(3), p.h(4), p.h(5), float(eps1 * eps1), p.flag(6), a.state1,
                      num_tiles, num_items, num_colparts, col_chunk, p.ptr<double>(kSlot_scratch)};
  const int64_t* table = a.table;
  const int device = device_of(p);
  const uintptr_t stream = stream_of(p);
  if (a.count == 0) return "";
  const std::string dev = use_device(device);
  if (!dev.empty()) return dev;
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t e = cudaSuccess;
  with_type(a.grad_dtype, [&](auto gtag) {
    with_type(a.param_dtype, [&](auto ptag) {
      using G = decltype(gtag);
      using P = decltype(ptag);
      if (phase > 0) {
        if (a.master_format == kMasterRemainder) {
          e = af_shard_launch<G, P, kMasterRemainder>(st, table, a, h, phase, sums);
        } else if (a.master_format == kMasterNone) {
          e = af_shard_launch<G, P, kMasterNone>(st, table, a, h, phase, sums);
        } else {
          e = af_shard_launch<G, P, kMasterF32>(st, table, a, h, phase, sums);
        }
      } else if (a.master_format == kMasterRemainder) {
        e = af_launch<G, P, kMasterRemainder>(device, st, table, a, h);
      } else if (a.master_format == kMasterNone) {
        e = af_launch<G, P, kMasterNone>(device, st, table, a, h);
      } else {
        e = af_launch<G, P, kMasterF32>(device, st, table, a, h);
      }
    });
  });
  if (e == cudaSuccess) return "";
  return cuda_error(phase > 0 ? "adafactor_step launch over shards" : "adafactor_step cooperative launch", e);
}

// Loads every Adafactor kernel on `device` and caches its occupancy (see prepare_norm).
std::string prepare_adafactor(int device) {
  const std::string dev = use_device(device);
  if (!dev.empty()) return dev;
  for (int g : {int(kF32), int(kBF16), int(kF16)}) {
    for (int p : {int(kF32), int(kBF16), int(kF16)}) {
      with_type(g, [&](auto gtag) {
        with_type(p, [&](auto ptag) {
          using G = decltype(gtag);
          using P = decltype(ptag);
          af_resident<G, P, kMasterF32>(device);
          af_resident<G, P, kMasterRemainder>(device);
          af_resident<G, P, kMasterNone>(device);
        });
      });
    }
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : cuda_error("loading the Adafactor kernels", e);
}

}  // namespace

AMPFUSED_CUDA_STEP("adafactor_step_", adafactor_step, prepare_adafactor, "beta2_decay", "eps1", "eps2", "d",
                   "weight_decay", "max_norm", "maximize");
AMPFUSED_STEP_CONSTANT(AF_COLS, kAfCols);
AMPFUSED_STEP_CONSTANT(AF_INFO, kAfInfo);
AMPFUSED_STEP_CONSTANT(AF_MAX_DIMS, kAfMaxDims);
AMPFUSED_STEP_CONSTANT(SH_COLS, kShCols);

}  // namespace cuda
}  // namespace ampfused
