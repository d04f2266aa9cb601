// Arguments of the optimizer-step drivers, shared by the CPU and CUDA modules. All pointers are raw
// addresses handed over from Python (host memory for the CPU module, device memory for CUDA).
#pragma once

#include <cstdint>

namespace ampfused {

// Codes of the 0-d step / lr tensors (fp32 or fp64), as in ampfused/_native.py.
enum ScalarCode : int { kScalarF32 = 0, kScalarF64 = 3 };

struct StepArgs {
  void* param = nullptr;        // model copy, param_dtype (fp32/bf16/fp16)
  int param_dtype = 0;
  const void* grad = nullptr;   // grad_dtype (fp32/bf16/fp16)
  int grad_dtype = 0;
  float* master = nullptr;      // fp32 master copy, or null when param is the fp32 compute copy
  float* state1 = nullptr;      // exp_avg / momentum_buf (null for SGD without momentum)
  float* state2 = nullptr;      // exp_avg_sq (Adam only)
  int64_t n = 0;                // elements of every flat buffer
  void* step = nullptr;         // 0-d, step_code
  int step_code = 0;
  const float* partials = nullptr;  // [2, num_partials], row-major
  int64_t num_partials = 0;
  const float* inv_scale = nullptr;  // 0-d fp32
  const void* lr = nullptr;     // 0-d, lr_code
  int lr_code = 0;
  float* out_stats = nullptr;   // [2] fp32: norm, found_inf
};

struct AdamHyper {
  double beta1, beta2, eps, weight_decay, max_norm;
  bool decoupled, maximize;
};

struct SgdHyper {
  double momentum, dampening, weight_decay, max_norm;
  bool nesterov, maximize;
};

}  // namespace ampfused
