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
#include "ampfused/step_pack.h"
#include "kernels.h"
#include "step_driver.h"


namespace py = pybind11;
using namespace ampfused;
using namespace ampfused::cpu;

namespace {

struct Isa {
  const char* name;
  void (*norm_check)(const Buf*, int64_t, const int64_t*, float, float*, int64_t, bool, int);
  bool supported;
};

std::vector<Isa> make_isas() {
  std::vector<Isa> v;
#if defined(AMPFUSED_HAVE_AVX512)
  v.push_back({"avx512", isa_avx512::norm_check,
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")});
#endif
#if defined(AMPFUSED_HAVE_AVX2)
  v.push_back({"avx2", isa_avx2::norm_check, bool(__builtin_cpu_supports("avx2"))});
#endif
  v.push_back({"default", isa_default::norm_check, true});
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

// The step: the entry of `op` that this instruction set's objects registered (csrc/cpu/steps), over the packed
// call (ampfused/step_pack.h). `rows`: the tensor table as ints, or None when slots[table] is the address of a
// host int64 table (the fused optimizers' own, written by ampfused._host).
void step(const std::string& op, const std::vector<int64_t>& slots, const std::vector<double>& hyper,
          const py::object& rows) {
  const CpuSteps::Entry& e = CpuSteps::find(op, std::string("isa_") + isa().name);
  std::vector<int64_t> keep;
  std::vector<int64_t> packed = slots;
  int64_t table_ints = -1;
  if (!rows.is_none()) {
    keep = rows.cast<std::vector<int64_t>>();
    table_ints = int64_t(keep.size());
    if (packed.size() > size_t(kSlot_table)) packed[size_t(kSlot_table)] = int64_t(uintptr_t(keep.data()));
  }
  const StepPack p = read_step_pack(op, e.hyper, packed, hyper, table_ints);
  py::gil_scoped_release nogil;
  e.fn(p);
}

// The packed call as every entry of both modules reads it (read_step_pack): StepArgs' fields by name, and the
// hyperparameters by the names op's CPU entry reads them. Runs nothing (the suite checks the packing with it).
py::dict read_step(const std::string& op, const std::vector<int64_t>& slots, const std::vector<double>& hyper) {
  const CpuSteps::Entry& e = CpuSteps::find(op, std::string("isa_") + isa().name);
  const StepPack p = read_step_pack(op, e.hyper, slots, hyper, -1);
  const StepArgs& a = p.args;
  const auto u = [](const void* ptr) { return uint64_t(reinterpret_cast<uintptr_t>(ptr)); };
  py::dict d;
  d["table"] = u(a.table);
  d["count"] = a.count;
  d["param_dtype"] = a.param_dtype;
  d["grad_dtype"] = a.grad_dtype;
  d["master"] = u(a.master);
  d["state1"] = u(a.state1);
  d["state2"] = u(a.state2);
  d["steps"] = u(a.steps);
  d["step_code"] = a.step_code;
  d["partials"] = u(a.partials);
  d["num_partials"] = a.num_partials;
  d["inv_scale"] = u(a.inv_scale);
  d["lr"] = u(a.lr);
  d["lr_code"] = a.lr_code;
  d["out_stats"] = u(a.out_stats);
  d["master_format"] = a.master_format;
  d["state_dtype"] = a.state_dtype;
  d["seed"] = u(a.seed);
  d["state_scales"] = u(a.state_scales);
  d["scale_blocks"] = a.scale_blocks;
  py::dict h;
  for (size_t i = 0; i < p.hyper.size(); ++i) h[py::str(p.hyper_names[i])] = p.h(i);
  d["hyper"] = h;
  return d;
}

// Every registered step op and the hyperparameters its entry reads, in order.
py::dict step_ops() {
  py::dict d;
  for (const CpuSteps::Entry& e : CpuSteps::entries()) d[py::str(e.op)] = e.hyper;
  return d;
}

void update_scale_op(uintptr_t scale, uintptr_t growth_tracker, uintptr_t found_inf, double growth_factor,
                     double backoff_factor, int64_t growth_interval, uintptr_t inv_scale, uintptr_t skipped) {
  const float found = *addr<const float>(found_inf);
  update_scale(addr<float>(scale), addr<int32_t>(growth_tracker), found, growth_factor,
               backoff_factor, growth_interval);
  finish_scale_update(addr<const float>(scale), found, addr<float>(inv_scale), addr<int64_t>(skipped));
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
  m.attr("STEP_SLOTS") = step_slot_names();
  m.def("step", &step, py::arg("op"), py::arg("slots"), py::arg("hyper"), py::arg("rows") = py::none(),
        "the step op `op` over a packed call (ampfused/step_pack.h)");
  m.def("step_ops", &step_ops, "{op: the hyperparameters its entry reads, in order}");
  m.def("read_step", &read_step, py::arg("op"), py::arg("slots"), py::arg("hyper"),
        "the packed call's fields as the step entries read them (runs nothing)");
  m.def("step_constants", [] {
    py::dict d;
    for (const auto& kv : step_constants()) d[py::str(kv.first)] = kv.second;
    return d;
  });
  m.def("update_scale", &update_scale_op, py::call_guard<py::gil_scoped_release>());
}
