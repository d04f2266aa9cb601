// Host API of the CUDA kernels, in plain C++ types: module.cpp (compiled by the C++ compiler, no CUDA
// headers) calls it with raw device addresses and a stream handle. Every function enqueues work on
// `stream` of `device` and returns "" on success or an error message; none allocates or synchronises,
// so all of them can be captured in a CUDA graph.
#pragma once

#include <cstdint>
#include <string>

#include "ampfused/math.h"
#include "ampfused/step_args.h"

namespace ampfused {
namespace cuda {

// K1 geometry: a tile is kThreads x kVec elements; a tensor of n elements gets
// min(ceil(n / kTile), kMaxPartials) partials, partial j covering tiles j, j + P, j + 2P, ...
// so the partials depend only on the sizes, never on the GPU or the grid that computed them.
constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int64_t kTile = int64_t(kThreads) * kVec;
constexpr int64_t kMaxPartials = 1024;

AF_HD int64_t partials_of(int64_t n) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  return tiles < kMaxPartials ? tiles : kMaxPartials;
}

// K2 geometry: the elements of each parameter (memory order) are cut into chunks of kStepChunk, a unit of
// work for one block. A chunk starts at a multiple of kVec elements, so a chunk of a 16-byte aligned
// parameter is 16-byte aligned too (and so is its slice of the flat state buffers, whose offsets are
// multiples of 4 fp32).
constexpr int64_t kStepChunk = 16384;
static_assert(kStepChunk % kVec == 0 && (kStepChunk & (kStepChunk - 1)) == 0, "a power of two, whole vectors");

// A work item names one table row and one unit of work of that row: (row << kWorkShift) | index, built in
// Python (ampfused/ops/cuda.py), read here.
constexpr int kWorkShift = 32;
AF_HD int64_t work_row(int64_t item) { return item >> kWorkShift; }
AF_HD int64_t work_index(int64_t item) { return item & ((int64_t(1) << kWorkShift) - 1); }

// The work of a step, in device memory next to the tensor table, built and cached by ampfused/ops/cuda.py:
//   chunks:  one item per chunk of every parameter that has a gradient, rows in order, chunks in order
//            (index = chunk number: elements [index * kStepChunk, min(n, (index + 1) * kStepChunk)));
//   columns: one item per K1 partial of those gradients (index = j, the partial's number within its tensor),
//            rows in order: column q of the partials is item q, the layout norm_check gives the same list.
struct WorkList {
  const int64_t* chunks = nullptr;
  int64_t num_chunks = 0;
  const int64_t* columns = nullptr;
  int64_t num_columns = 0;
};

struct Tensor1 {
  void* ptr;
  int64_t n;
  int dtype;
};

// "" when a CUDA device can run the kernels, else why not (no device, driver too old, ...).
std::string device_status();
int runtime_version();  // CUDART_VERSION the module was built with
int driver_version();   // 0 when no driver

// Loads every kernel on `device` and caches what launches need, so later calls (in a graph capture,
// say) load and query nothing. Called once per device before its first launch.
std::string prepare(int device);

std::string norm_check(int device, uintptr_t stream, const Tensor1* tensors, int64_t count, const float* inv_scale,
                       float* partials, int64_t num_partials, bool unscale);

// K1 over the gradients of one step's tensor table in one launch: `table` and `columns` (num_columns items,
// see WorkList) in device memory, every gradient of dtype grad_dtype; column q goes to column first_col + q
// of the [2, P] partials. Equal to norm_check over the same gradients in table order.
std::string norm_check_work(int device, uintptr_t stream, const int64_t* table, const int64_t* columns,
                            int64_t num_columns, int64_t first_col, int grad_dtype, const float* inv_scale,
                            float* partials, int64_t P);

// inv_scale (fp32(1 / fp64(new scale))) and skipped (+1 on overflow) are optional outputs (null: none).
std::string update_scale(int device, uintptr_t stream, float* scale, int32_t* growth_tracker, const float* found_inf,
                         double growth_factor, double backoff_factor, int64_t growth_interval, float* inv_scale,
                         int64_t* skipped);

}  // namespace cuda
}  // namespace ampfused
