// ampfused._host: the fused optimizers' per-step host work on the parameters, in one C++ pass.
//
// Before every step a fused optimizer must know, for each parameter of a segment, whether it is still the
// tensor it left after its last step (same address, same version counter), and where its gradient is. In
// Python that is several attribute reads per tensor (about 2 us per tensor in all); here it is one pass
// that reads each tensor's impl directly and writes the segment's tensor table (step_args.h) in place.
//
// Unlike ampfused._C and ampfused._C_cuda this module is built against torch's headers (it reads
// at::Tensor), so it is built for the torch it runs with; without it the optimizers take the Python path,
// which computes the same tables.
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "ampfused/build_id.h"
#include "ampfused/step_args.h"

#ifndef AMPFUSED_TORCH_VERSION
#define AMPFUSED_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

namespace {

// What scan() found (its first return value).
enum Status : int64_t {
  kOk = 0,              // every parameter as recorded; the table is written
  kParamChanged = 1,    // parameter `index` was written, moved or replaced since the optimizer last saw it
  kGradIrregular = 2,   // gradient `index` is not one the kernels read in place (dtype, device, layout, strides)
  kNotPlain = 3,        // parameter `index` is not a plain tensor (a subclass, or not a tensor at all)
};

// The gradient is read in place with the parameter's walk: same shape and the same stride in every
// dimension longer than 1 (as ampfused.ops.checks.same_layout).
bool same_layout(const at::Tensor& p, const at::Tensor& g) {
  if (p.sizes() != g.sizes()) return false;
  const auto ps = p.strides();
  const auto gs = g.strides();
  const auto sz = p.sizes();
  for (size_t d = 0; d < sz.size(); ++d) {
    if (sz[d] > 1 && ps[d] != gs[d]) return false;
  }
  return true;
}

const at::Tensor* plain(PyObject* obj) {
  if (!THPVariable_Check(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) return nullptr;  // e.g. a DTensor or a fake tensor
  return &t;
}

// What scan() found changed in the table (its last return value, on kOk): bits of
enum Changed : int64_t {
  kAddresses = 1,  // a parameter's or gradient's address: the table's device copy is stale
  kSizes = 2,      // a numel column (a gradient appeared or went): the work lists built from it are stale too
};

// scan(params, record, table, chunk) -> (status, index, active, chunks, changed)
//   params: the segment's parameters (a list);
//   record: int64 [T, 2] host buffer (address): each parameter's (data address, version) as the optimizer
//           left it;
//   table:  int64 [T, kTableCols] host buffer (address): the segment's tensor table; the param, grad and
//           numel columns are written, the offset column is the segment's and is left alone;
//   chunk:  K1's chunk length, to count the partials the active gradients make.
// On kOk, `active` is the number of parameters with a gradient, `chunks` their K1 chunk count and `changed`
// what differs from the table as the last scan left it (Changed bits; each row compared while it is written,
// so that a step with the same tensors as the last one needs no pass over the table to know it); on any other
// status the table is partly written and must not be used (nor compared with: its copies must be rebuilt).
py::tuple scan(py::list params, uintptr_t record, uintptr_t table, int64_t chunk) {
  const int64_t n = int64_t(PyList_GET_SIZE(params.ptr()));
  const int64_t* rec = reinterpret_cast<const int64_t*>(record);
  int64_t* rows = reinterpret_cast<int64_t*>(table);
  int64_t active = 0, chunks = 0, changed = 0;
  for (int64_t k = 0; k < n; ++k) {
    const at::Tensor* pp = plain(PyList_GET_ITEM(params.ptr(), k));
    if (pp == nullptr) return py::make_tuple(int64_t(kNotPlain), k, 0, 0, 0);
    const at::Tensor& p = *pp;
    const int64_t address = int64_t(reinterpret_cast<uintptr_t>(p.data_ptr()));
    if (address != rec[2 * k] || int64_t(p._version()) != rec[2 * k + 1]) {
      return py::make_tuple(int64_t(kParamChanged), k, 0, 0, 0);
    }
    int64_t* row = rows + k * ampfused::kTableCols;
    int64_t grad = 0, numel = ampfused::kNoGrad;
    const at::Tensor& g = p.grad();
    if (g.defined()) {
      if (g.layout() != at::kStrided || g.scalar_type() != p.scalar_type() || g.device() != p.device() ||
          g.unsafeGetTensorImpl()->is_python_dispatch() || !same_layout(p, g)) {
        return py::make_tuple(int64_t(kGradIrregular), k, 0, 0, 0);
      }
      numel = g.numel();
      grad = int64_t(reinterpret_cast<uintptr_t>(g.data_ptr()));
      ++active;
      chunks += (numel + chunk - 1) / chunk;
    }
    if (row[ampfused::kColNumel] != numel) changed |= kSizes | kAddresses;
    if (row[ampfused::kColParam] != address || row[ampfused::kColGrad] != grad) changed |= kAddresses;
    row[ampfused::kColParam] = address;
    row[ampfused::kColGrad] = grad;
    row[ampfused::kColNumel] = numel;
  }
  return py::make_tuple(int64_t(kOk), int64_t(-1), active, chunks, changed);
}

// bump(params, table, record): after the step wrote them, bump the version counter of every parameter
// that had a gradient (as an in-place torch op would; inference tensors have none) and record the new
// versions, so the next scan sees them as the optimizer's own writes.
void bump(py::list params, uintptr_t table, uintptr_t record) {
  const int64_t n = int64_t(PyList_GET_SIZE(params.ptr()));
  const int64_t* rows = reinterpret_cast<const int64_t*>(table);
  int64_t* rec = reinterpret_cast<int64_t*>(record);
  for (int64_t k = 0; k < n; ++k) {
    if (rows[k * ampfused::kTableCols + ampfused::kColNumel] == ampfused::kNoGrad) continue;
    const at::Tensor& p = THPVariable_Unpack(PyList_GET_ITEM(params.ptr(), k));
    if (!p.is_inference()) torch::autograd::impl::bump_version(p);
    rec[2 * k + 1] = int64_t(p._version());
  }
}

// Whether two lists hold the same objects in the same order (identity, not equality): the optimizer's check
// that a group's parameter list is still the one its segments were built from, without a Python loop.
bool same_items(py::list a, py::list b) {
  const Py_ssize_t n = PyList_GET_SIZE(a.ptr());
  if (PyList_GET_SIZE(b.ptr()) != n) return false;
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (PyList_GET_ITEM(a.ptr(), k) != PyList_GET_ITEM(b.ptr(), k)) return false;
  }
  return true;
}

// work_list(table, rows, cols, numel_col, chunk, cap, shift, out) -> count
//   The work items of a tensor table (int64 [rows, cols] at address `table`): for each row r in order whose
//   numel (column `numel_col`) is positive, k = min(ceil(numel / chunk), cap) items, i = 0 .. k-1:
//     shift >= 0: one int64 each, (r << shift) | i          (the CUDA kernels' chunk and K1 column lists);
//     shift <  0: two int64 each, (r, i * chunk)            (the Triton kernels' chunk list).
//   Rows without a gradient (numel kNoGrad) and empty gradients own no item. With out == 0 only counts.
//   This replaces a dozen host tensor ops per changed table (tolist, cumsum, repeat_interleave, cat) with one
//   pass that writes straight into the page-locked staging buffer the upload reads.
int64_t work_list(uintptr_t table, int64_t rows, int64_t cols, int64_t numel_col, int64_t chunk, int64_t cap,
                  int64_t shift, uintptr_t out) {
  if (chunk <= 0 || cap <= 0 || cols <= numel_col || numel_col < 0 || rows < 0) {
    throw std::invalid_argument("work_list: chunk and cap must be positive and numel_col a column of the table");
  }
  const int64_t* t = reinterpret_cast<const int64_t*>(table);
  int64_t* o = reinterpret_cast<int64_t*>(out);
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = t[r * cols + numel_col];
    if (n <= 0) continue;
    const int64_t k = std::min((n - 1) / chunk + 1, cap);
    if (o != nullptr) {
      if (shift >= 0) {
        const int64_t base = r << shift;
        for (int64_t i = 0; i < k; ++i) o[count + i] = base | i;
      } else {
        int64_t* pair = o + 2 * count;
        for (int64_t i = 0; i < k; ++i) {
          pair[2 * i] = r;
          pair[2 * i + 1] = i * chunk;
        }
      }
    }
    count += k;
  }
  return count;
}

py::dict build_info() {
  py::dict d = ampfused::build_identity();
  d["torch"] = AMPFUSED_TORCH_VERSION;
  return d;
}

}  // namespace

PYBIND11_MODULE(_host, m) {
  m.doc() = "ampfused's per-step host pass over the parameters (built against torch's headers)";
  m.attr("OK") = int64_t(kOk);
  m.attr("PARAM_CHANGED") = int64_t(kParamChanged);
  m.attr("GRAD_IRREGULAR") = int64_t(kGradIrregular);
  m.attr("NOT_PLAIN") = int64_t(kNotPlain);
  m.attr("CHANGED_ADDRESSES") = int64_t(kAddresses);
  m.attr("CHANGED_SIZES") = int64_t(kSizes);
  m.def("build_info", &build_info);
  m.def("scan", &scan, py::arg("params"), py::arg("record"), py::arg("table"), py::arg("chunk"));
  m.def("bump", &bump, py::arg("params"), py::arg("table"), py::arg("record"));
  m.def("same_items", &same_items, py::arg("a"), py::arg("b"));
  m.def("work_list", &work_list, py::arg("table"), py::arg("rows"), py::arg("cols"), py::arg("numel_col"),
        py::arg("chunk"), py::arg("cap"), py::arg("shift"), py::arg("out"));
}
