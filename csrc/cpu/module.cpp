// ampfused._C: the CPU backend. Torch-free: every function takes raw addresses (Python ints) of
// host buffers, element counts and dtype codes; ampfused/ops/cpu.py validates the tensors first.
// The GIL is released around every kernel.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampfused/build_id.h"
#include "ampfused/step_args.h"
#include "kernels.h"
#include "adafactor.h"


namespace py = pybind11;
using namespace ampfused;
using namespace ampfused::cpu;

namespace {

struct Isa {
  const char* name;
  void (*norm_check)(const Buf*, int64_t, const int64_t*, float, float*, int64_t, bool, int);
  void (*adam)(const StepBufs&, const StepTensor*, const AdamConsts*, int64_t, int);
  void (*sgd)(const StepBufs&, const StepTensor*, const SgdConsts*, int64_t, int);
  bool supported;
};

std::vector<Isa> make_isas() {
  std::vector<Isa> v;
#if defined(AMPFUSED_HAVE_AVX512)
  v.push_back({"avx512", isa_avx512::norm_check, isa_avx512::adam_apply, isa_avx512::sgd_apply,
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")});
#endif
#if defined(AMPFUSED_HAVE_AVX2)
  v.push_back({"avx2", isa_avx2::norm_check, isa_avx2::adam_apply, isa_avx2::sgd_apply,
               bool(__builtin_cpu_supports("avx2"))});
#endif
  v.push_back({"default", isa_default::norm_check, isa_default::adam_apply, isa_default::sgd_apply, true});
  return v;
}

const std::vector<Isa>& isas() {
  static const std::vector<Isa> v = make_isas();
  return v;
}

const Isa* g_isa = nullptr;

const Isa& isa() {
  if (!g_isa) {
    for (const Isa& i : isas()) {
      if (i.supported) { g_isa = &i; break; }
    }
  }
  return *g_isa;
}

void set_isa(const std::string& name) {
  for (const Isa& i : isas()) {
    if (name == i.name) {
      if (!i.supported) throw std::invalid_argument("this CPU cannot run the " + name + " kernels");
      g_isa = &i;
      return;
    }
  }
  std::string known;
  for (const Isa& i : isas()) known += std::string(known.empty() ? "" : ", ") + i.name;
  throw std::invalid_argument("unknown instruction set '" + name + "'; built: " + known);
}


int64_t chunks_of(int64_t n) { return (n + kChunk - 1) / kChunk; }

int64_t num_partials(const std::vector<int64_t>& numels) {
  int64_t p = 0;
  for (int64_t n : numels) p += chunks_of(n);
  return p;
}

void norm_check(const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& numels,
                const std::vector<int>& dtypes, uintptr_t inv_scale, uintptr_t partials, int64_t P,
                bool unscale, int nthreads) {
  const size_t k = ptrs.size();
  if (numels.size() != k || dtypes.size() != k) throw std::invalid_argument("ptrs, numels and dtypes differ in length");
  std::vector<Buf> bufs(k);
  std::vector<int64_t> first(k + 1, 0);
  for (size_t i = 0; i < k; ++i) {
    bufs[i] = Buf{addr<void>(ptrs[i]), numels[i], dtypes[i]};
    first[i + 1] = first[i] + chunks_of(numels[i]);
  }
  if (first[k] != P) throw std::invalid_argument("partials has the wrong number of columns");
  if (P == 0) return;
  py::gil_scoped_release nogil;
  isa().norm_check(bufs.data(), int64_t(k), first.data(), *addr<const float>(inv_scale), addr<float>(partials),
                   P, unscale, nthreads);
}

// norm_check over the gradients of tensor tables (host int64 [count, kTableCols] buffers at `tables`, one
// gradient dtype each), rows without a gradient left out: the partials of the gradients in table order, as
// norm_check of the same gradients as lists.
void norm_check_tables(const std::vector<uintptr_t>& tables, const std::vector<int64_t>& counts,
                       const std::vector<int>& dtypes, uintptr_t inv_scale, uintptr_t partials, int64_t P,
                       bool unscale, int nthreads) {
  if (counts.size() != tables.size() || dtypes.size() != tables.size()) {
    throw std::invalid_argument("tables, counts and dtypes differ in length");
  }
  std::vector<Buf> bufs;
  std::vector<int64_t> first(1, 0);
  for (size_t t = 0; t < tables.size(); ++t) {
    const int64_t* rows = addr<const int64_t>(tables[t]);
    for (int64_t k = 0; k < counts[t]; ++k) {
      const int64_t* r = rows + k * kTableCols;
      if (r[kColNumel] == kNoGrad) continue;
      bufs.push_back(Buf{addr<void>(uintptr_t(r[kColGrad])), r[kColNumel], dtypes[t]});
      first.push_back(first.back() + chunks_of(r[kColNumel]));
    }
  }
  if (first.back() != P) throw std::invalid_argument("partials has the wrong number of columns");
  if (P == 0) return;
  py::gil_scoped_release nogil;
  isa().norm_check(bufs.data(), int64_t(bufs.size()), first.data(), *addr<const float>(inv_scale),
                   addr<float>(partials), P, unscale, nthreads);
}

// reference._prologue: reduce the partials in column order (fp64), record [norm, found_inf];
// returns false when the step is skipped.
bool prologue(const StepArgs& a, double max_norm, float* coef) {
  double sumsq = 0.0;
  bool found_inf = false;
  for (int64_t k = 0; k < a.num_partials; ++k) {
    sumsq += double(a.partials[k]);
    found_inf |= a.partials[a.num_partials + k] > 0.0f;
  }
  const float norm = float(std::sqrt(sumsq));
  a.out_stats[0] = norm;
  a.out_stats[1] = found_inf ? 1.0f : 0.0f;
  *coef = step_coef(*a.inv_scale, norm, max_norm);
  return !found_inf;
}

// The tensor table arrives as a list of ints (host memory: no tensor to build for it).
void check_table(const std::vector<int64_t>& table, int64_t count) {
  if (count < 0 || int64_t(table.size()) != count * kTableCols) {
    throw std::invalid_argument("the tensor table must hold " + std::to_string(kTableCols) + " ints per parameter");
  }
}

// The parameters that have a gradient, from the tensor table.
std::vector<int64_t> active_rows(const StepArgs& a) {
  std::vector<int64_t> rows;
  for (int64_t k = 0; k < a.count; ++k) {
    if (a.table[k * kTableCols + kColNumel] != kNoGrad) rows.push_back(k);
  }
  return rows;
}

StepTensor tensor_of(const StepArgs& a, int64_t k) {
  const int64_t* r = a.table + k * kTableCols;
  return StepTensor{addr<void>(uintptr_t(r[kColParam])), addr<const void>(uintptr_t(r[kColGrad])), r[kColNumel],
                    r[kColOffset], 0u};
}

StepBufs bufs_of(const StepArgs& a) {
  return StepBufs{a.param_dtype, a.grad_dtype, a.master, a.state1, a.state2, a.master_format, a.state_dtype,
                  a.state_scales, a.scale_blocks};
}

// The step after the tensor table was checked: prologue (skip on found_inf), per-parameter constants from each
// one's own step count (make(coef, lr, step) -> Consts), the update over every parameter with a gradient
// (apply), and each such parameter's step count advanced by one. Never on a skipped step.
template <typename Consts, typename Make, typename Apply>
void run_step(const StepArgs& a, double max_norm, int nthreads, Make make, Apply apply) {
  float coef;
  if (!prologue(a, max_norm, &coef)) return;
  const float lr_f = float(read_scalar(a.lr, a.lr_code));
  const std::vector<int64_t> rows = active_rows(a);
  std::vector<StepTensor> ts;
  std::vector<Consts> cs;
  const uint64_t seed = a.seed ? uint64_t(*a.seed) : 0;
  for (int64_t k : rows) {
    const double step = read_scalar(scalar_at(a.steps, a.step_code, k), a.step_code);
    StepTensor t = tensor_of(a, k);
    if (a.seed) t.key = step_key(seed, key_step(next_step(step)));
    ts.push_back(t);
    cs.push_back(make(coef, lr_f, step));
  }
  apply(bufs_of(a), ts.data(), cs.data(), int64_t(ts.size()), nthreads);
  for (int64_t k : rows) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
}

// The table is a list of ints, or the address of a host int64 [count, kTableCols] buffer (the fused optimizers'
// own tables, written by ampfused._host).
uintptr_t table_address(const py::object& table, int64_t count, std::vector<int64_t>* keep) {
  if (py::isinstance<py::int_>(table)) {
    if (count < 0) throw std::invalid_argument("count must be >= 0");
    return table.cast<uintptr_t>();
  }
  *keep = table.cast<std::vector<int64_t>>();
  check_table(*keep, count);
  return uintptr_t(keep->data());
}

void adam_step(const py::object& table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master,
               uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t steps, int step_code, uintptr_t partials,
               int64_t num_partials, uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats,
               double beta1, double beta2, double eps, double weight_decay, double max_norm, bool decoupled,
               bool maximize, int nthreads, int master_format, int state_dtype, uintptr_t seed,
               uintptr_t state_scales, int64_t scale_blocks) {
  std::vector<int64_t> keep;
  const StepArgs a = step_args(table_address(table, count, &keep), count, param_dtype, grad_dtype, master, exp_avg, exp_avg_sq,
                               steps, step_code, partials, num_partials, inv_scale, lr, lr_code, out_stats,
                               master_format, state_dtype, seed, state_scales, scale_blocks);
  const float log_beta1 = log_beta(beta1), log_beta2 = log_beta(beta2);
  py::gil_scoped_release nogil;
  run_step<AdamConsts>(a, max_norm, nthreads, [&](float coef, float lr_f, double step) {
    return make_adam_consts(coef, lr_f, float(next_step(step)), beta1, beta2, log_beta1, log_beta2, eps,
                            weight_decay, decoupled, maximize);
  }, isa().adam);
}

void sgd_step(const py::object& table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master,
              uintptr_t momentum_buf, uintptr_t steps, int step_code, uintptr_t partials, int64_t num_partials,
              uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats, double momentum,
              double dampening, double weight_decay, bool nesterov, double max_norm, bool maximize, int nthreads,
              int master_format, int state_dtype, uintptr_t seed, uintptr_t state_scales, int64_t scale_blocks) {
  std::vector<int64_t> keep;
  const StepArgs a = step_args(table_address(table, count, &keep), count, param_dtype, grad_dtype, master,
                               momentum != 0.0 ? momentum_buf : 0, 0, steps, step_code, partials, num_partials, inv_scale,
                               lr, lr_code, out_stats, master_format, state_dtype, seed, state_scales, scale_blocks);
  py::gil_scoped_release nogil;
  run_step<SgdConsts>(a, max_norm, nthreads, [&](float coef, float lr_f, double step) {
    return make_sgd_consts(coef, lr_f, float(step), momentum, dampening, weight_decay, nesterov, maximize);
  }, isa().sgd);
}

// Lion's driver for the instruction set the kernels run with.
using LionApply = void (*)(const StepBufs&, const StepTensor*, const LionConsts*, int64_t, int);
LionApply lion_apply_of(const Isa& i) {
  const std::string name = i.name;
#if defined(AMPFUSED_HAVE_AVX512)
  if (name == "avx512") return isa_avx512::lion_apply;
#endif
#if defined(AMPFUSED_HAVE_AVX2)
  if (name == "avx2") return isa_avx2::lion_apply;
#endif
  return isa_default::lion_apply;
}

void lion_step(const py::object& table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master,
               uintptr_t exp_avg, uintptr_t steps, int step_code, uintptr_t partials, int64_t num_partials,
               uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats, double beta1, double beta2,
               double weight_decay, double max_norm, bool maximize, int nthreads, int master_format,
               int state_dtype, uintptr_t seed, uintptr_t state_scales, int64_t scale_blocks) {
  std::vector<int64_t> keep;
  const StepArgs a = step_args(table_address(table, count, &keep), count, param_dtype, grad_dtype, master, exp_avg,
                               0, steps, step_code, partials, num_partials, inv_scale, lr, lr_code, out_stats,
                               master_format, state_dtype, seed, state_scales, scale_blocks);
  const LionApply apply = lion_apply_of(isa());
  py::gil_scoped_release nogil;
  run_step<LionConsts>(a, max_norm, nthreads, [&](float coef, float lr_f, double) {
    return make_lion_consts(coef, lr_f, beta1, beta2, weight_decay, maximize);
  }, apply);
}

void update_scale_op(uintptr_t scale, uintptr_t growth_tracker, uintptr_t found_inf, double growth_factor,
                     double backoff_factor, int64_t growth_interval, uintptr_t inv_scale, uintptr_t skipped) {
  const float found = *addr<const float>(found_inf);
  update_scale(addr<float>(scale), addr<int32_t>(growth_tracker), found, growth_factor,
               backoff_factor, growth_interval);
  finish_scale_update(addr<const float>(scale), found, addr<float>(inv_scale), addr<int64_t>(skipped));
}

// The Adafactor step (adafactor.h) over a table of kAfCols ints per parameter (ampfused/ops/native_adafactor.py).
void adafactor_step(const std::vector<int64_t>& table, int64_t count, int param_dtype, int grad_dtype,
                    uintptr_t master, uintptr_t factors, uintptr_t steps, int step_code, uintptr_t partials,
                    int64_t num_partials, uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats,
                    double beta2_decay, double eps1, double eps2, double d, double weight_decay, double max_norm,
                    bool maximize, int nthreads, int master_format, uintptr_t seed) {
  if (count < 0 || int64_t(table.size()) != count * kAfCols) {
    throw std::invalid_argument("the Adafactor table must hold " + std::to_string(kAfCols) + " ints per parameter");
  }
  const StepArgs a = step_args(0, count, param_dtype, grad_dtype, master, 0, 0, steps, step_code, partials,
                               num_partials, inv_scale, lr, lr_code, out_stats, master_format, 0, seed);
  py::gil_scoped_release nogil;
  float coef;
  if (!prologue(a, max_norm, &coef)) return;
  AfHyper h{beta2_decay, eps1, eps2, d, weight_decay, read_scalar(a.lr, a.lr_code), float(eps1 * eps1), maximize};
  AfBufs b{param_dtype, grad_dtype, master_format, a.master, addr<float>(factors),
           a.seed ? uint64_t(*a.seed) : 0};
  std::vector<double> t(size_t(count), 0.0);
  for (int64_t k = 0; k < count; ++k) t[size_t(k)] = next_step(read_scalar(scalar_at(a.steps, a.step_code, k), a.step_code));
  adafactor_apply(b, table.data(), count, t.data(), coef, h, nthreads);
  for (int64_t k = 0; k < count; ++k) {
    if (table[size_t(k * kAfCols + 2)] != kNoGrad) add_one(scalar_at(a.steps, a.step_code, k), a.step_code);
  }
}

py::dict build_info() {
  py::dict d = build_identity();
#if defined(_OPENMP)
  d["openmp"] = int(_OPENMP);
#else
  d["openmp"] = 0;
#endif
  py::list built;
  for (const Isa& i : isas()) built.append(i.name);
  d["isas"] = built;
  d["chunk"] = kChunk;
  d["stream_elements"] = kStreamElements;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ampfused CPU kernels (torch-free: raw addresses, sizes and dtype codes)";
  m.attr("CHUNK") = kChunk;
  m.attr("TABLE_COLS") = kTableCols;
  m.attr("STREAM_ELEMENTS") = kStreamElements;
  m.attr("__version__") = AMPFUSED_VERSION;
  m.def("build_info", &build_info);
  m.def("isa", [] { return std::string(isa().name); }, "instruction set the kernels run with");
  m.def("supported_isas", [] {
    std::vector<std::string> v;
    for (const Isa& i : isas()) if (i.supported) v.push_back(i.name);
    return v;
  });
  m.def("set_isa", &set_isa, py::arg("name"));
  m.def("num_partials", &num_partials, py::arg("numels"));
  m.def("norm_check", &norm_check, py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"), py::arg("inv_scale"),
        py::arg("partials"), py::arg("num_partials"), py::arg("unscale"), py::arg("num_threads"));
  m.def("norm_check_tables", &norm_check_tables, py::arg("tables"), py::arg("counts"), py::arg("dtypes"),
        py::arg("inv_scale"), py::arg("partials"), py::arg("num_partials"), py::arg("unscale"),
        py::arg("num_threads"));
  // the compact state's arguments (master format, state dtype code, seed address; the 8-bit moments' scales
  // address and their blocks per row) come after the thread count and default to the fp32 state
  m.def("adam_step", &adam_step, py::arg("table"), py::arg("count"), py::arg("param_dtype"), py::arg("grad_dtype"),
        py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("steps"), py::arg("step_code"),
        py::arg("partials"), py::arg("num_partials"), py::arg("inv_scale"), py::arg("lr"), py::arg("lr_code"),
        py::arg("out_stats"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("max_norm"), py::arg("decoupled"), py::arg("maximize"), py::arg("num_threads"),
        py::arg("master_format") = 0, py::arg("state_dtype") = 0, py::arg("seed") = uintptr_t(0),
        py::arg("state_scales") = uintptr_t(0), py::arg("scale_blocks") = int64_t(0));
  m.def("sgd_step", &sgd_step, py::arg("table"), py::arg("count"), py::arg("param_dtype"), py::arg("grad_dtype"),
        py::arg("master"), py::arg("momentum_buf"), py::arg("steps"), py::arg("step_code"), py::arg("partials"),
        py::arg("num_partials"), py::arg("inv_scale"), py::arg("lr"), py::arg("lr_code"), py::arg("out_stats"),
        py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("max_norm"),
        py::arg("maximize"), py::arg("num_threads"), py::arg("master_format") = 0, py::arg("state_dtype") = 0,
        py::arg("seed") = uintptr_t(0), py::arg("state_scales") = uintptr_t(0), py::arg("scale_blocks") = int64_t(0));
  m.def("lion_step", &lion_step, py::arg("table"), py::arg("count"), py::arg("param_dtype"), py::arg("grad_dtype"),
        py::arg("master"), py::arg("exp_avg"), py::arg("steps"), py::arg("step_code"), py::arg("partials"),
        py::arg("num_partials"), py::arg("inv_scale"), py::arg("lr"), py::arg("lr_code"), py::arg("out_stats"),
        py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("max_norm"), py::arg("maximize"),
        py::arg("num_threads"), py::arg("master_format") = 0, py::arg("state_dtype") = 0,
        py::arg("seed") = uintptr_t(0), py::arg("state_scales") = uintptr_t(0), py::arg("scale_blocks") = int64_t(0));
  m.attr("AF_COLS") = kAfCols;
  m.attr("AF_MAX_DIMS") = kAfMaxDims;
  m.def("adafactor_step", &adafactor_step);
  m.def("update_scale", &update_scale_op, py::call_guard<py::gil_scoped_release>());
}
