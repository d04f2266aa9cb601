// The CPU Adafactor step (ampfused/ops/reference_adafactor.py, docs/adafactor.md): per parameter, three passes
// over its elements in logical order (rows, columns, the leading dimensions a batch of matrices):
//   1. the sums of squares of the clipped gradient along each row and each column (factored), and of the
//      weight (its RMS sets the step size);
//   2. the new factors (or variance), then the sum of squares of the update u = g / sqrt(v);
//   3. the update of the weights, stored in the step's master format.
// A parameter split over ranks takes the three passes as three calls (phases), its sums over the whole parameter
// summed over the ranks between them (ampfused/ops/factored.py, ShardSums).
// Sums are fp64 in a fixed order (rows in order, each row's elements in order; each column's rows in order), so
// the result is the same whatever the thread count. Elementwise operations are fp32, each rounded as written.
// One build, not one per instruction set (the step is bound by its reductions' order): only the default set's
// object compiles it; its entry serves every set. Included by kernels_impl.h; not a header of its own.
#if defined(AMPFUSED_ISA_DEFAULT)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "ampfused/math.h"
#include "ampfused/step_args.h"

namespace ampfused {
namespace cpu {

constexpr int kAfMaxDims = 8;
// Columns of an Adafactor table row: param, grad, numel (kNoGrad without a gradient), master/weight offset,
// factors offset, ndim, then kAfMaxDims sizes and kAfMaxDims strides (elements).
constexpr int kAfCols = 6 + 2 * kAfMaxDims;
constexpr int64_t kAfColBlock = 64;  // columns summed together by the column pass

struct AfHyper {
  double beta2_decay, eps1, eps2, d, weight_decay, lr;
  float eps1_sq;
  bool maximize;
};

struct AfBufs {
  int param_dtype, grad_dtype, master_format;
  float* master;    // fp32 master, uint16 remainders (kMasterRemainder) or null
  float* factors;   // fp32
  uint64_t seed;    // stochastic rounding (kMasterNone)
};

// One parameter's geometry: B matrices of R x C (factored), or n elements in memory order.
struct AfShape {
  bool factored;
  int64_t B, R, C, sr, sc;
  int nlead;
  int64_t lead_size[kAfMaxDims], lead_stride[kAfMaxDims];

  explicit AfShape(const int64_t* row) {
    const int nd = int(row[5]);
    const int64_t* size = row + 6;
    const int64_t* stride = row + 6 + kAfMaxDims;
    factored = nd > 1;
    B = 1;
    R = C = sr = sc = 0;
    nlead = factored ? nd - 2 : 0;
    for (int k = 0; k < nlead; ++k) {
      lead_size[k] = size[k];
      lead_stride[k] = stride[k];
      B *= size[k];
    }
    if (factored) {
      R = size[nd - 2];
      C = size[nd - 1];
      sr = stride[nd - 2];
      sc = stride[nd - 1];
    }
  }
  // Memory offset of matrix b (row-major over the leading dimensions).
  int64_t base(int64_t b) const {
    int64_t off = 0;
    for (int k = nlead - 1; k >= 0; --k) {
      off += (b % lead_size[k]) * lead_stride[k];
      b /= lead_size[k];
    }
    return off;
  }
};

// torch.lerp(v, target, w), each operation rounded as written, its two forms by |w|.
inline float af_lerp(float v, float target, float w) {
  return std::fabs(w) < 0.5f ? v + w * (target - v) : target - (target - v) * (1.0f - w);
}
// torch.clamp(x, min=lo): NaN stays NaN.
inline float af_clamp_min(float x, float lo) { return x < lo ? lo : x; }
// Python's max(floor, x): floor unless x is greater (NaN gives floor).
inline double af_max(double x, double floor) { return x > floor ? x : floor; }

// The sum over c in [0, n) of term(c) (fp64): element c in lane c % kAfLanes, lanes added in order at the end, so
// the loop vectorises where term does and the order depends only on n.
constexpr int kAfLanes = 8;
template <typename Term>
inline double af_sum(int64_t n, Term term) {
  double acc[kAfLanes] = {};
  int64_t c = 0;
  for (; c + kAfLanes <= n; c += kAfLanes) {
#pragma omp simd
    for (int l = 0; l < kAfLanes; ++l) acc[l] += term(c + l);
  }
  for (int l = 0; c + l < n; ++l) acc[l] += term(c + l);
  double sum = 0.0;
  for (int l = 0; l < kAfLanes; ++l) sum += acc[l];
  return sum;
}

template <typename G, typename P, int kFmt>
struct AfParam {
  const AfBufs& b;
  const int64_t* row;
  float coef;
  bool maximize;
  P* param() const { return reinterpret_cast<P*>(uintptr_t(row[0])); }
  const G* grad() const { return reinterpret_cast<const G*>(uintptr_t(row[1])); }
  int64_t offset() const { return row[3]; }
  float g(int64_t j) const {
    const float x = to_f32(grad()[j]) * coef;
    return maximize ? -x : x;
  }
  float w(int64_t j) const {
    if (kFmt == kMasterRemainder) {
      const uint16_t* rem = reinterpret_cast<const uint16_t*>(b.master) + offset();
      return join_master(bf16_t{reinterpret_cast<const uint16_t*>(param())[j]}, rem[j]);
    }
    if (b.master) return b.master[offset() + j];
    return to_f32(param()[j]);
  }
  void store(int64_t j, float w_new, uint32_t key) const {
    if (kFmt == kMasterRemainder) {
      bf16_t weight;
      uint16_t rem;
      split_master(w_new, weight, rem);
      reinterpret_cast<uint16_t*>(param())[j] = weight.bits;
      reinterpret_cast<uint16_t*>(b.master)[offset() + j] = rem;
    } else if (kFmt == kMasterNone) {
      reinterpret_cast<bf16_t*>(param())[j] = round_stochastic(w_new, random_bits(key, offset() + j));
    } else {
      if (b.master) b.master[offset() + j] = w_new;
      param()[j] = from_f32<P>(w_new);
    }
  }
};

// A parameter split over ranks (a sharded step's phase > 0; ampfused/ops/factored.py, ShardSums): its row of
// the shard table (kShCols ints after the table's rows) and the sums over the whole parameter in `sums` (fp64).
// Phase 0 is the whole step, its sums made here.
constexpr int kShCols = 9;
constexpr int kSplitRows = 1;  // the rows are split: column sums and the sum of the row factors are partial here

struct AfSplit {
  int split;
  int64_t n, R, C;                   // the whole parameter's
  int64_t w, u, rsum, rowg, colg;    // offsets in sums
  AfSplit(const int64_t* sh, const AfShape& s, int64_t n_here) {
    if (sh) {
      split = int(sh[0]);
      n = sh[1];
      R = sh[2];
      C = sh[3];
      w = sh[4];
      u = sh[5];
      rsum = sh[6];
      rowg = sh[7];
      colg = sh[8];
    } else {
      split = 0;
      n = n_here;
      R = s.R;
      C = s.C;
      w = u = rsum = rowg = colg = 0;
    }
  }
};

// One parameter's step, or phase `phase` of it (it has a gradient; the step is not skipped):
//   phase 1: the sums of g*g along rows and columns, of w*w, and (rows split) of the new row factors, to sums;
//   phase 2: the factors from those sums (written), the sum of u*u to sums;
//   phase 3: the weights, from the factors and the sums.
// Phase 0 runs the three in one, with its own sums: the phases of one rank are its bits.
template <typename G, typename P, int kFmt>
void adafactor_param(const AfBufs& bufs, const int64_t* row, const int64_t* shard, int phase, double* sums,
                     float coef, double t, const AfHyper& h, int nthreads) {
  const AfParam<G, P, kFmt> e{bufs, row, coef, h.maximize};
  const AfShape s(row);
  const int64_t n = row[2];
  const AfSplit sp(shard, s, n);
  const bool whole = phase == 0;
  float* f = bufs.factors + row[4];
  const float w2 = float(std::pow(t, h.beta2_decay));
  const double rho = std::fmin(h.lr, 1.0 / std::sqrt(t));
  const float decay = float(1.0 - h.lr * h.weight_decay);
  const float eps1 = float(h.eps1);
  double w_sumsq = whole || phase == 1 ? 0.0 : sums[sp.w], u_sumsq = phase == 3 ? sums[sp.u] : 0.0;
  const int64_t B = s.B, R = s.R, C = s.C;
  float* rows = f;
  float* cols = f + B * R;
  std::vector<float> rmean(size_t(B), 0.0f);  // max(mean of a matrix's new row factors, eps1)
  // the passes' loops along rows with the column stride a constant where it is 1 (they vectorise then)
  const auto with_sc = [&](auto fn) {
    if (s.sc == 1) fn(std::integral_constant<int64_t, 1>{});
    else fn(s.sc);
  };
  if (s.factored) {
    // the sums of g*g along rows and columns: here (phase 0), or in sums
    std::vector<double> own_g(size_t(whole ? B * R + B * C : 0), 0.0);
    double* row_g = whole ? own_g.data() : sums + sp.rowg;
    double* col_g = whole ? own_g.data() + B * R : sums + sp.colg;
    // the new row factors of matrix b, summed in row order
    const auto rows_sum = [&](int64_t b, auto row_factor) {
      double m = 0.0;
      for (int64_t r = 0; r < R; ++r) m += double(row_factor(b * R + r));
      return m;
    };
    const auto new_row = [&](int64_t br) { return af_lerp(rows[br], float(row_g[br]) / float(sp.C), w2); };
    if (phase <= 1) {
      std::vector<double> w_row(size_t(B * R), 0.0);
      // 1. row sums (and the weight's) by rows, column sums by columns: each sum in one fixed order
      with_sc([&](auto sc) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int64_t br = 0; br < B * R; ++br) {
          const int64_t at = s.base(br / R) + (br % R) * s.sr;
          row_g[br] = af_sum(C, [&](int64_t c) { const float gi = e.g(at + c * sc); return double(gi * gi); });
          w_row[size_t(br)] = af_sum(C, [&](int64_t c) { const float wi = e.w(at + c * sc); return double(wi * wi); });
        }
      });
      // columns in blocks of kAfColBlock, rows in order inside each: every column's sum in row order (the order
      // of one column at a time), read along the rows (a row-major matrix's memory order)
      const int64_t nblk = (C + kAfColBlock - 1) / kAfColBlock;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
      for (int64_t bk = 0; bk < B * nblk; ++bk) {
        const int64_t bb = bk / nblk, c0 = (bk % nblk) * kAfColBlock, c1 = std::min(C, c0 + kAfColBlock);
        const int64_t base = s.base(bb);
        double gs[kAfColBlock] = {};
        for (int64_t r = 0; r < R; ++r) {
          const int64_t at = base + r * s.sr;
          for (int64_t c = c0; c < c1; ++c) {
            const float gi = e.g(at + c * s.sc);
            gs[c - c0] += double(gi * gi);
          }
        }
        for (int64_t c = c0; c < c1; ++c) col_g[bb * C + c] = gs[c - c0];
      }
      for (int64_t br = 0; br < B * R; ++br) w_sumsq += w_row[size_t(br)];
      if (phase == 1) {
        sums[sp.w] = w_sumsq;
        if (sp.split == kSplitRows) {
          for (int64_t b = 0; b < B; ++b) sums[sp.rsum + b] = rows_sum(b, new_row);
        }
        return;
      }
    }
    if (phase <= 2) {  // the new factors
      for (int64_t br = 0; br < B * R; ++br) rows[br] = new_row(br);
      for (int64_t bc = 0; bc < B * C; ++bc) cols[bc] = af_lerp(cols[bc], float(col_g[bc]) / float(sp.R), w2);
    }
    for (int64_t b = 0; b < B; ++b) {
      double m;
      if (phase == 3 || (phase == 2 && sp.split == kSplitRows)) {
        m = sums[sp.rsum + b];
      } else {
        m = rows_sum(b, [&](int64_t br) { return rows[br]; });
        if (phase == 2) sums[sp.rsum + b] = m;
      }
      rmean[size_t(b)] = af_clamp_min(float(m) / float(sp.R), eps1);
    }
    if (phase != 3) {
      // 2. the update's sum of squares
      std::vector<double> u_row(size_t(B * R), 0.0);
      with_sc([&](auto sc) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int64_t br = 0; br < B * R; ++br) {
          const int64_t bb = br / R, at = s.base(bb) + (br % R) * s.sr;
          const float row_f = rows[br], rm = rmean[size_t(bb)];
          const float* col = cols + bb * C;
          u_row[size_t(br)] = af_sum(C, [&](int64_t c) {
            const float v = af_clamp_min((row_f * col[c]) / rm, h.eps1_sq);
            const float u = e.g(at + c * sc) / std::sqrt(v);
            return double(u * u);
          });
        }
      });
      for (int64_t br = 0; br < B * R; ++br) u_sumsq += u_row[size_t(br)];
      if (phase == 2) {
        sums[sp.u] = u_sumsq;
        return;
      }
    }
  } else if (phase != 3) {
    for (int64_t j = 0; j < n; ++j) {
      const float gi = e.g(j), wi = e.w(j);
      if (phase != 1) {
        f[j] = af_lerp(f[j], gi * gi, w2);
        const float u = gi / std::sqrt(af_clamp_min(f[j], h.eps1_sq));
        u_sumsq += double(u * u);
      }
      if (phase != 2) w_sumsq += double(wi * wi);
    }
    if (phase == 1) sums[sp.w] = w_sumsq;
    if (phase == 2) sums[sp.u] = u_sumsq;
    if (phase != 0) return;
  }
  // the step size: fp64 from the fp32 sums, as torch forms it from its .item() reads; rounded once
  const double root_n = std::sqrt(double(sp.n));
  const double alpha = af_max(double(std::sqrt(float(w_sumsq))) / root_n, h.eps2) * rho;
  const float step = float(alpha / af_max(double(std::sqrt(float(u_sumsq))) / (root_n * h.d), 1.0));
  const bool decays = h.weight_decay != 0.0;
  const uint32_t key = kFmt == kMasterNone ? step_key(bufs.seed, key_step(t)) : 0u;
  // 3. the weights
  if (s.factored) {
    with_sc([&](auto sc) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
      for (int64_t br = 0; br < B * R; ++br) {
        const int64_t bb = br / R, at = s.base(bb) + (br % R) * s.sr;
        const float row_f = rows[br], rm = rmean[size_t(bb)];
        const float* col = cols + bb * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const int64_t j = at + c * sc;
          const float v = af_clamp_min((row_f * col[c]) / rm, h.eps1_sq);
          const float u = e.g(j) / std::sqrt(v);
          const float wi = e.w(j);
          e.store(j, (decays ? wi * decay : wi) - step * u, key);
        }
      }
    });
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float u = e.g(j) / std::sqrt(af_clamp_min(f[j], h.eps1_sq));
      const float wi = e.w(j);
      e.store(j, (decays ? wi * decay : wi) - step * u, key);
    }
  }
}

// Every parameter with a gradient (rows: the Adafactor table; shards: the shard table, phase > 0), each at its own
// step count t[k].
inline void adafactor_apply(const AfBufs& b, const int64_t* rows, const int64_t* shards, int phase, double* sums,
                            int64_t count, const double* t, float coef, const AfHyper& h, int nthreads) {
  with_type(b.grad_dtype, [&](auto gtag) {
    using G = decltype(gtag);
    with_type(b.param_dtype, [&](auto ptag) {
      using P = decltype(ptag);
      for (int64_t k = 0; k < count; ++k) {
        const int64_t* row = rows + k * kAfCols;
        const int64_t* sh = phase > 0 ? shards + k * kShCols : nullptr;
        if (row[2] == kNoGrad) continue;
        if (b.master_format == kMasterRemainder) {
          adafactor_param<G, P, kMasterRemainder>(b, row, sh, phase, sums, coef, t[k], h, nthreads);
        } else if (b.master_format == kMasterNone) {
          adafactor_param<G, P, kMasterNone>(b, row, sh, phase, sums, coef, t[k], h, nthreads);
        } else {
          adafactor_param<G, P, kMasterF32>(b, row, sh, phase, sums, coef, t[k], h, nthreads);
        }
      }
    });
  });
}

namespace {

void adafactor_step(const StepPack& p) {
  const StepArgs& a = p.args;
  const int phase = int(p.slot(kSlot_phase));
  double* sums = p.ptr<double>(kSlot_sums);
  if (phase < 0 || phase > 3 || (phase > 0 && (sums == nullptr || p.table_ints < 0))) {
    throw std::invalid_argument("adafactor_step_: phase must be 0 to 3, and a phase over shards needs its sums and "
                                "its table as ints");
  }
  const int64_t cols = phase > 0 ? kAfCols + kShCols : kAfCols;
  if (p.table_ints >= 0 && p.table_ints != a.count * cols) {  // (-1: a fused optimizer's table by address)
    throw std::invalid_argument("the Adafactor table must hold " + std::to_string(cols) + " ints per parameter");
  }
  const double beta2_decay = p.h(0), eps1 = p.h(1), eps2 = p.h(2), d = p.h(3), weight_decay = p.h(4),
               max_norm = p.h(5);
  const bool maximize = p.flag(6);
  float coef;
  if (!prologue(a, max_norm, &coef)) return;
  const AfHyper h{beta2_decay, eps1, eps2, d, weight_decay, read_scalar(a.lr, a.lr_code), float(eps1 * eps1),
                  maximize};
  const AfBufs b{a.param_dtype, a.grad_dtype, a.master_format, a.master, a.state1, a.seed ? uint64_t(*a.seed) : 0};
  std::vector<double> t(size_t(a.count), 0.0);
  for (int64_t k = 0; k < a.count; ++k) {
    t[size_t(k)] = next_step(read_scalar(scalar_at(a.steps, a.step_code, k), a.step_code));
  }
  adafactor_apply(b, a.table, a.table + a.count * kAfCols, phase, sums, a.count, t.data(), coef, h, threads_of(p));
  if (phase == 1 || phase == 2) return;  // (the step counts advance with the weights)
  for (int64_t k = 0; k < a.count; ++k) {
    if (a.table[k * kAfCols + 2] != kNoGrad) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
  }
}

}  // namespace

AMPFUSED_STEP_ENTRY(CpuSteps, "adafactor_step_", "", adafactor_step, "beta2_decay", "eps1", "eps2", "d",
                    "weight_decay", "max_norm", "maximize");
AMPFUSED_STEP_CONSTANT(AF_COLS, kAfCols);
AMPFUSED_STEP_CONSTANT(AF_MAX_DIMS, kAfMaxDims);
AMPFUSED_STEP_CONSTANT(SH_COLS, kShCols);

}  // namespace cpu
}  // namespace ampfused

#endif  // AMPFUSED_ISA_DEFAULT
