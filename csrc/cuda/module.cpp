// ampfused._C_cuda: the CUDA backend. Torch-free: device addresses (Python ints), sizes, dtype codes,
// the device index and a stream handle (torch: torch.cuda.current_stream().cuda_stream). cudart is
// linked statically, so importing this module needs no GPU or driver; calls then raise with the reason.
// ampfused/ops/cuda.py validates the tensors, and builds the tensor table and the work lists of a step in
// device memory, before any call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "ampfused/build_id.h"
#include "entry.h"
#include "launch.h"

#ifndef AMPFUSED_CUDA_ARCHS
#define AMPFUSED_CUDA_ARCHS "unknown"
#endif
#ifndef AMPFUSED_NVCC_VERSION
#define AMPFUSED_NVCC_VERSION "unknown"
#endif

namespace py = pybind11;
using namespace ampfused;

namespace {

void check(const std::string& err) {
  if (!err.empty()) throw std::runtime_error("ampfused CUDA kernel: " + err);
}

int64_t num_partials(const std::vector<int64_t>& numels) {
  int64_t p = 0;
  for (int64_t n : numels) p += cuda::partials_of(n);
  return p;
}

void norm_check(const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& numels, const std::vector<int>& dtypes,
                uintptr_t inv_scale, uintptr_t partials, int64_t P, bool unscale, int device, uintptr_t stream) {
  const size_t k = ptrs.size();
  if (numels.size() != k || dtypes.size() != k) throw std::invalid_argument("ptrs, numels and dtypes differ in length");
  if (num_partials(numels) != P) throw std::invalid_argument("partials has the wrong number of columns");
  if (P == 0) return;
  std::vector<cuda::Tensor1> ts(k);
  for (size_t i = 0; i < k; ++i) ts[i] = cuda::Tensor1{addr<void>(ptrs[i]), numels[i], dtypes[i]};
  check(cuda::norm_check(device, stream, ts.data(), int64_t(k), addr<const float>(inv_scale), addr<float>(partials), P,
                         unscale));
}

void norm_check_work(uintptr_t table, uintptr_t columns, int64_t num_columns, int64_t first_col, int grad_dtype,
                     uintptr_t inv_scale, uintptr_t partials, int64_t P, int device, uintptr_t stream) {
  if (num_columns < 0 || first_col < 0 || first_col + num_columns > P) {
    throw std::invalid_argument("norm_check_work: columns [" + std::to_string(first_col) + ", " +
                                std::to_string(first_col + num_columns) + ") do not fit partials of " +
                                std::to_string(P) + " columns");
  }
  if (num_columns > 0 && (table == 0 || columns == 0 || inv_scale == 0 || partials == 0)) {
    throw std::invalid_argument("norm_check_work: null tensor table, work list or tensor");
  }
  check(cuda::norm_check_work(device, stream, addr<const int64_t>(table), addr<const int64_t>(columns), num_columns,
                              first_col, grad_dtype, addr<const float>(inv_scale), addr<float>(partials), P));
}

// The step: the entry of `op` that its .cu file registered (entry.h), over the packed call
// (ampfused/step_pack.h); slots[table] and the work lists are device addresses (ampfused/ops/cuda.py).
void step(const std::string& op, const std::vector<int64_t>& slots, const std::vector<double>& hyper) {
  const cuda::CudaSteps::Entry& e = cuda::CudaSteps::find(op);
  check(e.fn(read_step_pack(op, e.hyper, slots, hyper, -1)));
}

py::dict step_ops() {
  py::dict d;
  for (const cuda::CudaSteps::Entry& e : cuda::CudaSteps::entries()) d[py::str(e.op)] = e.hyper;
  return d;
}

void update_scale_op(uintptr_t scale, uintptr_t growth_tracker, uintptr_t found_inf, double growth_factor,
                  double backoff_factor, int64_t growth_interval, uintptr_t inv_scale, uintptr_t skipped, int device,
                  uintptr_t stream) {
  check(cuda::update_scale(device, stream, addr<float>(scale), addr<int32_t>(growth_tracker),
                           addr<const float>(found_inf), growth_factor, backoff_factor, growth_interval,
                           addr<float>(inv_scale), addr<int64_t>(skipped)));
}

py::dict build_info() {
  py::dict d = build_identity();
  const int rt = cuda::runtime_version();
  d["cuda_runtime"] = std::to_string(rt / 1000) + "." + std::to_string(rt % 1000 / 10);
  d["nvcc"] = AMPFUSED_NVCC_VERSION;
  d["archs"] = AMPFUSED_CUDA_ARCHS;
  d["cudart"] = "static";
  d["step_chunk"] = cuda::kStepChunk;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "ampfused CUDA kernels (torch-free: device addresses, sizes, dtype codes, stream handles)";
  m.attr("__version__") = AMPFUSED_VERSION;
  m.attr("MAX_PARTIALS_PER_TENSOR") = cuda::kMaxPartials;
  m.attr("TILE") = cuda::kTile;
  m.attr("STEP_CHUNK") = cuda::kStepChunk;
  m.attr("WORK_SHIFT") = cuda::kWorkShift;
  m.attr("TABLE_COLS") = kTableCols;
  m.def("build_info", &build_info);
  m.def("device_status", &cuda::device_status, "'' when a CUDA device can run the kernels, else why not");
  m.def("driver_version", &cuda::driver_version);
  m.def("prepare", [](int device) { check(cuda::prepare(device)); }, py::arg("device"),
        "load every kernel on the device and cache launch parameters (call before capturing graphs)");
  m.def("num_partials", &num_partials, py::arg("numels"));
  m.def("norm_check", &norm_check);
  m.def("norm_check_work", &norm_check_work);
  m.attr("STEP_SLOTS") = step_slot_names();
  m.def("step", &step, py::arg("op"), py::arg("slots"), py::arg("hyper"),
        "enqueue the step op `op` over a packed call (ampfused/step_pack.h)");
  m.def("step_ops", &step_ops, "{op: the hyperparameters its entry reads, in order}");
  m.def("step_constants", [] {
    py::dict d;
    for (const auto& kv : step_constants()) d[py::str(kv.first)] = kv.second;
    return d;
  });
  m.def("update_scale", &update_scale_op);
}
