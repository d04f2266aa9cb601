// K1 (norm_check / unscale_) over a list of tensors, the loss-scale update, and device helpers.
//
// A launch covers up to kBatch tensors whose addresses and sizes travel in the kernel's parameters
// (nothing to allocate or copy, so it can be captured in a graph). Each block computes one partial
// of one tensor: a bounded grid (at most kMaxPartials blocks per tensor) with no atomics.
#include "common.cuh"
#include "entry.h"

namespace ampfused {
namespace cuda {
namespace {

constexpr int kBatch = 48;

struct K1Batch {
  void* ptr[kBatch];
  int64_t n[kBatch];
  int64_t nparts[kBatch];
  int64_t col[kBatch];       // first partials column of each tensor
  int32_t first_block[kBatch + 1];
  int32_t dtype[kBatch];
  int32_t count;
};

template <bool kWrite>
__global__ void __launch_bounds__(kThreads) k1_kernel(const K1Batch b, const float* __restrict__ inv_scale,
                                                      float* __restrict__ partials, int64_t P) {
  int k = 0;
  while (k + 1 < b.count && int(blockIdx.x) >= b.first_block[k + 1]) ++k;
  const int64_t j = int64_t(blockIdx.x) - b.first_block[k];
  const float inv = *inv_scale;
  switch (b.dtype[k]) {
    case kBF16:
      k1_write_partial<bf16_t, kWrite>(static_cast<bf16_t*>(b.ptr[k]), b.n[k], b.nparts[k], j, inv, partials, P,
                                       b.col[k] + j);
      break;
    case kF16:
      k1_write_partial<f16_t, kWrite>(static_cast<f16_t*>(b.ptr[k]), b.n[k], b.nparts[k], j, inv, partials, P,
                                      b.col[k] + j);
      break;
    default:
      k1_write_partial<float, kWrite>(static_cast<float*>(b.ptr[k]), b.n[k], b.nparts[k], j, inv, partials, P,
                                      b.col[k] + j);
      break;
  }
}

// K1 of a step's tensor table (device memory) in one launch: column q of this table's partials is item q of
// its columns list (partial j of row r), written to column first_col + q of the [2, P] partials. The same
// partials as k1_kernel computes for the same gradients, in the same order.
template <typename T>
__global__ void __launch_bounds__(kThreads) k1_columns_kernel(const int64_t* __restrict__ table,
                                                              const int64_t* __restrict__ columns,
                                                              int64_t num_columns, int64_t first_col,
                                                              const float* __restrict__ inv_scale,
                                                              float* __restrict__ partials, int64_t P) {
  const float inv = *inv_scale;
  for (int64_t q = blockIdx.x; q < num_columns; q += gridDim.x) {
    const int64_t item = columns[q];
    const int64_t* r = table + work_row(item) * kTableCols;
    const int64_t n = r[kColNumel];
    T* grad = reinterpret_cast<T*>(static_cast<uintptr_t>(r[kColGrad]));
    k1_write_partial<T, false>(grad, n, partials_of(n), work_index(item), inv, partials, P, first_col + q);
  }
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, const float* found_inf,
                                    double growth_factor, double backoff_factor, int64_t growth_interval,
                                    float* inv_scale, int64_t* skipped) {
  const float found = *found_inf;
  ::ampfused::update_scale(scale, growth_tracker, found, growth_factor, backoff_factor, growth_interval);
  ::ampfused::finish_scale_update(scale, found, inv_scale, skipped);
}

}  // namespace

std::string use_device(int device) {
  const cudaError_t e = cudaSetDevice(device);
  return e == cudaSuccess ? std::string() : cuda_error("cudaSetDevice", e);
}

int sm_count(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 1;
  if (!cached[device]) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    cached[device] = n > 0 ? n : 1;
  }
  return cached[device];
}

std::string prepare_norm(int device) {
  std::string err = use_device(device);
  if (!err.empty()) return err;
  cudaFuncAttributes attr;
  const void* kernels[] = {reinterpret_cast<const void*>(k1_kernel<false>), reinterpret_cast<const void*>(k1_kernel<true>),
                           reinterpret_cast<const void*>(k1_columns_kernel<float>),
                           reinterpret_cast<const void*>(k1_columns_kernel<bf16_t>),
                           reinterpret_cast<const void*>(k1_columns_kernel<f16_t>),
                           reinterpret_cast<const void*>(update_scale_kernel)};
  for (const void* k : kernels) {
    const cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return cuda_error("loading the norm kernels", e);
  }
  sm_count(device);
  return "";
}

std::string prepare(int device) {
  std::string err = prepare_norm(device);
  for (PrepareFn f : step_prepares()) {
    if (!err.empty()) break;
    err = f(device);
  }
  return err;
}

std::string device_status() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return "no CUDA device: " + cuda_error("cudaGetDeviceCount", e) + " (built with CUDA runtime " +
           std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10) + ")";
  }
  if (count == 0) return "no CUDA device";
  return "";
}

int runtime_version() { return CUDART_VERSION; }

int driver_version() {
  int v = 0;
  return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
}

std::string norm_check(int device, uintptr_t stream, const Tensor1* tensors, int64_t count, const float* inv_scale,
                       float* partials, int64_t num_partials, bool unscale) {
  std::string err = use_device(device);
  if (!err.empty()) return err;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  int64_t col = 0;
  for (int64_t start = 0; start < count;) {
    K1Batch b{};
    int32_t blocks = 0;
    int64_t k = start;
    for (; k < count && b.count < kBatch; ++k) {
      const int64_t np = partials_of(tensors[k].n);
      if (np == 0) continue;
      const int i = b.count++;
      b.ptr[i] = tensors[k].ptr;
      b.n[i] = tensors[k].n;
      b.nparts[i] = np;
      b.col[i] = col;
      b.dtype[i] = tensors[k].dtype;
      b.first_block[i] = blocks;
      blocks += int32_t(np);
      col += np;
    }
    b.first_block[b.count] = blocks;
    start = k;
    if (b.count == 0) continue;
    if (unscale) k1_kernel<true><<<blocks, kThreads, 0, s>>>(b, inv_scale, partials, num_partials);
    else k1_kernel<false><<<blocks, kThreads, 0, s>>>(b, inv_scale, partials, num_partials);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_error("norm_check launch", e);
  }
  if (col != num_partials) return "internal error: partials columns do not match num_partials";
  return "";
}

std::string norm_check_work(int device, uintptr_t stream, const int64_t* table, const int64_t* columns,
                            int64_t num_columns, int64_t first_col, int grad_dtype, const float* inv_scale,
                            float* partials, int64_t P) {
  if (num_columns <= 0) return "";
  std::string err = use_device(device);
  if (!err.empty()) return err;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t most = 1 << 30;  // a grid-stride loop past this many blocks
  const unsigned blocks = unsigned(num_columns < most ? num_columns : most);
  switch (grad_dtype) {
    case kBF16:
      k1_columns_kernel<bf16_t><<<blocks, kThreads, 0, s>>>(table, columns, num_columns, first_col, inv_scale,
                                                             partials, P);
      break;
    case kF16:
      k1_columns_kernel<f16_t><<<blocks, kThreads, 0, s>>>(table, columns, num_columns, first_col, inv_scale,
                                                            partials, P);
      break;
    default:
      k1_columns_kernel<float><<<blocks, kThreads, 0, s>>>(table, columns, num_columns, first_col, inv_scale,
                                                            partials, P);
      break;
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : cuda_error("norm_check launch", e);
}

std::string update_scale(int device, uintptr_t stream, float* scale, int32_t* growth_tracker, const float* found_inf,
                         double growth_factor, double backoff_factor, int64_t growth_interval, float* inv_scale,
                         int64_t* skipped) {
  std::string err = use_device(device);
  if (!err.empty()) return err;
  update_scale_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(scale, growth_tracker, found_inf,
                                                                         growth_factor, backoff_factor,
                                                                         growth_interval, inv_scale, skipped);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : cuda_error("update_scale launch", e);
}

}  // namespace cuda
}  // namespace ampfused
