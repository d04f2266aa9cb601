// What every CUDA step entry shares: the registry of entries, and the launch arguments of the packed call
// (ampfused/step_pack.h) that a flat-state step reads: its device and stream, its work lists, its block counter.
// An optimizer's .cu file reads its hyperparameters from the pack, enqueues its kernel, and registers the entry
// and the function that loads its kernels with AMPFUSED_CUDA_STEP. Plain C++ (module.cpp includes it too).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampfused/step_pack.h"
#include "launch.h"

namespace ampfused {
namespace cuda {

// Enqueues the step on the pack's stream: "" or why it failed.
using CudaStepFn = std::string (*)(const StepPack&);
using CudaSteps = StepRegistry<CudaStepFn>;

// The functions that load each entry's kernels on a device (prepare() runs them all).
using PrepareFn = std::string (*)(int device);
inline std::vector<PrepareFn>& step_prepares() {
  static std::vector<PrepareFn> all;
  return all;
}

struct PrepareAdd {
  explicit PrepareAdd(PrepareFn f) { step_prepares().push_back(f); }
};

inline int device_of(const StepPack& p) { return int(p.slot(kSlot_device)); }
inline uintptr_t stream_of(const StepPack& p) { return uintptr_t(p.slot(kSlot_stream)); }
inline int32_t* counter_of(const StepPack& p) { return p.ptr<int32_t>(kSlot_counter); }
inline bool single_launch_of(const StepPack& p) { return p.slot(kSlot_single_launch) != 0; }

// The work lists of a flat-state step, and what its launch relies on beyond the checks in
// ampfused/ops/native_args.py (which run first): the moments' storage code, and what 8-bit moments need.
inline WorkList flat_work(const StepPack& p) {
  const StepArgs& a = p.args;
  const int64_t num_chunks = p.slot(kSlot_num_chunks), num_columns = p.slot(kSlot_num_columns);
  if (a.count < 0 || num_chunks < 0 || num_columns < 0) throw std::invalid_argument("negative table or work size");
  if (a.count >= (int64_t(1) << 31)) throw std::invalid_argument("too many parameters for one step (2^31 or more)");
  if ((a.count > 0 && a.table == nullptr) || (num_chunks > 0 && p.slot(kSlot_chunks) == 0) ||
      (num_columns > 0 && p.slot(kSlot_columns) == 0)) {
    throw std::invalid_argument("null tensor table or work list");
  }
  if (single_launch_of(p) && a.num_partials != num_columns) {
    throw std::invalid_argument("single_launch: partials (an output here) must have " + std::to_string(num_columns) +
                                " columns (the partials of the step's gradients), got " +
                                std::to_string(a.num_partials));
  }
  if (a.state_dtype != kF32 && a.state_dtype != kBF16 && a.state_dtype != kStateU8) {
    throw std::invalid_argument("state_dtype must be 0 (fp32), 1 (bf16) or " + std::to_string(kStateU8) +
                                " (8-bit codes), got " + std::to_string(a.state_dtype));
  }
  if (a.state_dtype == kStateU8 && num_chunks > 0 && (a.state1 == nullptr || a.seed == nullptr ||
                                                      a.state_scales == nullptr || a.scale_blocks <= 0)) {
    throw std::invalid_argument("8-bit moments need their codes, a seed and their block scales (state_scales of "
                                "[moments, blocks], blocks > 0)");
  }
  WorkList w;
  w.chunks = p.ptr<const int64_t>(kSlot_chunks);
  w.num_chunks = num_chunks;
  w.columns = p.ptr<const int64_t>(kSlot_columns);
  w.num_columns = num_columns;
  return w;
}

}  // namespace cuda
}  // namespace ampfused

// Registers `fn` (std::string(const StepPack&)) as the CUDA module's entry of step op `op` (its name in
// ampfused/ops/specs.py), reading the hyperparameters named after it in that order, and `prepare` as the
// function that loads its kernels.
#define AMPFUSED_CUDA_STEP(op, fn, prepare, ...)                                                        \
  AMPFUSED_STEP_ENTRY(::ampfused::cuda::CudaSteps, op, "", fn, __VA_ARGS__);                           \
  static const ::ampfused::cuda::PrepareAdd AMPFUSED_STEP_CAT(ampfused_step_prepare_, __LINE__)(prepare)
