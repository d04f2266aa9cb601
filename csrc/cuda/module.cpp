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

// What the launch relies on beyond the checks in ampfused/ops/cuda.py (which run first).
cuda::WorkList work_list(const StepArgs& a, uintptr_t chunks, int64_t num_chunks, uintptr_t columns,
                         int64_t num_columns, bool single_launch) {
  if (a.count < 0 || num_chunks < 0 || num_columns < 0) throw std::invalid_argument("negative table or work size");
  if (a.count >= (int64_t(1) << 31)) throw std::invalid_argument("too many parameters for one step (2^31 or more)");
  if ((a.count > 0 && a.table == nullptr) || (num_chunks > 0 && chunks == 0) || (num_columns > 0 && columns == 0)) {
    throw std::invalid_argument("null tensor table or work list");
  }
  if (single_launch && a.num_partials != num_columns) {
    throw std::invalid_argument("single_launch: partials (an output here) must have " + std::to_string(num_columns) +
                                " columns (the partials of the step's gradients), got " +
                                std::to_string(a.num_partials));
  }
  cuda::WorkList w;
  w.chunks = addr<const int64_t>(chunks);
  w.num_chunks = num_chunks;
  w.columns = addr<const int64_t>(columns);
  w.num_columns = num_columns;
  return w;
}

// The moments' storage code, and what 8-bit moments need besides their codes: the draws' seed and block scales.
void check_state_format(const StepArgs& a, int64_t num_chunks) {
  if (a.state_dtype != kF32 && a.state_dtype != kBF16 && a.state_dtype != kStateU8) {
    throw std::invalid_argument("state_dtype must be 0 (fp32), 1 (bf16) or " + std::to_string(kStateU8) +
                                " (8-bit codes), got " + std::to_string(a.state_dtype));
  }
  if (a.state_dtype == kStateU8 && num_chunks > 0 && (a.state1 == nullptr || a.seed == nullptr ||
                                                      a.state_scales == nullptr || a.scale_blocks <= 0)) {
    throw std::invalid_argument("8-bit moments need their codes, a seed and their block scales (state_scales of "
                                "[moments, blocks], blocks > 0)");
  }
}

void adam_step(uintptr_t table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master, uintptr_t exp_avg,
               uintptr_t exp_avg_sq, uintptr_t steps, int step_code, uintptr_t partials, int64_t P,
               uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats, double beta1, double beta2,
               double eps, double weight_decay, double max_norm, bool decoupled, bool maximize, int device,
               uintptr_t stream, uintptr_t chunks, int64_t num_chunks, uintptr_t columns, int64_t num_columns,
               uintptr_t counter, bool single_launch, int master_format, int state_dtype, uintptr_t seed,
               uintptr_t state_scales, int64_t scale_blocks) {
  const StepArgs a = step_args(table, count, param_dtype, grad_dtype, master, exp_avg, exp_avg_sq, steps, step_code,
                               partials, P, inv_scale, lr, lr_code, out_stats, master_format, state_dtype, seed,
                               state_scales, scale_blocks);
  check_state_format(a, num_chunks);
  const cuda::WorkList w = work_list(a, chunks, num_chunks, columns, num_columns, single_launch);
  const AdamHyper h{beta1, beta2, eps, weight_decay, max_norm, decoupled, maximize, log_beta(beta1), log_beta(beta2)};
  check(cuda::adam_step(device, stream, a, w, h, addr<int32_t>(counter), single_launch));
}

void sgd_step(uintptr_t table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master,
              uintptr_t momentum_buf, uintptr_t steps, int step_code, uintptr_t partials, int64_t P,
              uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats, double momentum, double dampening,
              double weight_decay, bool nesterov, double max_norm, bool maximize, int device, uintptr_t stream,
              uintptr_t chunks, int64_t num_chunks, uintptr_t columns, int64_t num_columns, uintptr_t counter,
              bool single_launch, int master_format, int state_dtype, uintptr_t seed, uintptr_t state_scales,
              int64_t scale_blocks) {
  const StepArgs a = step_args(table, count, param_dtype, grad_dtype, master, momentum != 0.0 ? momentum_buf : 0, 0,
                               steps, step_code, partials, P, inv_scale, lr, lr_code, out_stats, master_format,
                               state_dtype, seed, state_scales, scale_blocks);
  check_state_format(a, num_chunks);
  const cuda::WorkList w = work_list(a, chunks, num_chunks, columns, num_columns, single_launch);
  const SgdHyper h{momentum, dampening, weight_decay, max_norm, nesterov, maximize};
  check(cuda::sgd_step(device, stream, a, w, h, addr<int32_t>(counter), single_launch));
}

void lion_step(uintptr_t table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master, uintptr_t exp_avg,
               uintptr_t steps, int step_code, uintptr_t partials, int64_t P, uintptr_t inv_scale, uintptr_t lr,
               int lr_code, uintptr_t out_stats, double beta1, double beta2, double weight_decay, double max_norm,
               bool maximize, int device, uintptr_t stream, uintptr_t chunks, int64_t num_chunks, uintptr_t columns,
               int64_t num_columns, uintptr_t counter, bool single_launch, int master_format, int state_dtype,
               uintptr_t seed, uintptr_t state_scales, int64_t scale_blocks) {
  const StepArgs a = step_args(table, count, param_dtype, grad_dtype, master, exp_avg, 0, steps, step_code, partials, P,
                               inv_scale, lr, lr_code, out_stats, master_format, state_dtype, seed, state_scales,
                               scale_blocks);
  check_state_format(a, num_chunks);
  const cuda::WorkList w = work_list(a, chunks, num_chunks, columns, num_columns, single_launch);
  const cuda::LionHyper h{beta1, beta2, weight_decay, max_norm, maximize};
  check(cuda::lion_step(device, stream, a, w, h, addr<int32_t>(counter), single_launch));
}

// Adafactor (adafactor.cu): `table` the device address of its rows (kAfCols int64 each), then its tile layout
// (count + 1 rows of kAfInfo: ampfused/ops/native_adafactor.py, tiles); `scratch` fp64, num_colparts + 3 * num_tiles.
void adafactor_step(uintptr_t table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master,
                    uintptr_t factors, uintptr_t steps, int step_code, uintptr_t partials, int64_t P,
                    uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats, double beta2_decay,
                    double eps1, double eps2, double d, double weight_decay, double max_norm, bool maximize,
                    int device, uintptr_t stream, int master_format, uintptr_t seed, int64_t num_tiles,
                    int64_t num_items, int64_t num_colparts, uintptr_t scratch, int64_t col_chunk) {
  if (num_tiles < 0 || num_items < 0 || num_colparts < 0 || col_chunk < 1) {
    throw std::invalid_argument("adafactor_step: a negative tile count or a column chunk below 1");
  }
  const StepArgs a = step_args(0, count, param_dtype, grad_dtype, master, 0, 0, steps, step_code, partials, P,
                               inv_scale, lr, lr_code, out_stats, master_format, 0, seed);
  if (master_format == kMasterNone && seed == 0) throw std::invalid_argument("stochastic rounding needs a seed");
  const cuda::AfCudaHyper h{beta2_decay, eps1, eps2, d, weight_decay, max_norm, float(eps1 * eps1), maximize,
                            addr<float>(factors), num_tiles, num_items, num_colparts, col_chunk,
                            addr<double>(scratch)};
  check(cuda::adafactor_step(device, stream, addr<const int64_t>(table), a, h));
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
  // the compact state's arguments (master format, state dtype code, seed address; the 8-bit moments' block scales
  // address and their blocks per row) come last and default to the fp32 state
  m.def("adam_step", &adam_step, py::arg("table"), py::arg("count"), py::arg("param_dtype"), py::arg("grad_dtype"),
        py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("steps"), py::arg("step_code"),
        py::arg("partials"), py::arg("num_partials"), py::arg("inv_scale"), py::arg("lr"), py::arg("lr_code"),
        py::arg("out_stats"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("max_norm"), py::arg("decoupled"), py::arg("maximize"), py::arg("device"), py::arg("stream"),
        py::arg("chunks"), py::arg("num_chunks"), py::arg("columns"), py::arg("num_columns"), py::arg("counter"),
        py::arg("single_launch"), py::arg("master_format") = 0, py::arg("state_dtype") = 0,
        py::arg("seed") = uintptr_t(0), py::arg("state_scales") = uintptr_t(0), py::arg("scale_blocks") = int64_t(0));
  m.def("sgd_step", &sgd_step, py::arg("table"), py::arg("count"), py::arg("param_dtype"), py::arg("grad_dtype"),
        py::arg("master"), py::arg("momentum_buf"), py::arg("steps"), py::arg("step_code"), py::arg("partials"),
        py::arg("num_partials"), py::arg("inv_scale"), py::arg("lr"), py::arg("lr_code"), py::arg("out_stats"),
        py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("max_norm"),
        py::arg("maximize"), py::arg("device"), py::arg("stream"), py::arg("chunks"), py::arg("num_chunks"),
        py::arg("columns"), py::arg("num_columns"), py::arg("counter"), py::arg("single_launch"),
        py::arg("master_format") = 0, py::arg("state_dtype") = 0, py::arg("seed") = uintptr_t(0),
        py::arg("state_scales") = uintptr_t(0), py::arg("scale_blocks") = int64_t(0));
  m.def("lion_step", &lion_step, py::arg("table"), py::arg("count"), py::arg("param_dtype"), py::arg("grad_dtype"),
        py::arg("master"), py::arg("exp_avg"), py::arg("steps"), py::arg("step_code"), py::arg("partials"),
        py::arg("num_partials"), py::arg("inv_scale"), py::arg("lr"), py::arg("lr_code"), py::arg("out_stats"),
        py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("max_norm"), py::arg("maximize"),
        py::arg("device"), py::arg("stream"), py::arg("chunks"), py::arg("num_chunks"), py::arg("columns"),
        py::arg("num_columns"), py::arg("counter"), py::arg("single_launch"), py::arg("master_format") = 0,
        py::arg("state_dtype") = 0, py::arg("seed") = uintptr_t(0), py::arg("state_scales") = uintptr_t(0),
        py::arg("scale_blocks") = int64_t(0));
  m.attr("AF_COLS") = cuda::kAfCols;
  m.attr("AF_INFO") = cuda::kAfInfo;
  m.def("adafactor_step", &adafactor_step);
  m.def("update_scale", &update_scale_op);
}
