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

// A raw address handed over from Python as an int.
template <typename T>
inline T* addr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// StepArgs from the addresses and codes the Python side passes (both modules' step entries take these).
inline StepArgs step_args(uintptr_t param, int param_dtype, uintptr_t grad, int grad_dtype, uintptr_t master,
                          uintptr_t state1, uintptr_t state2, int64_t n, uintptr_t step, int step_code,
                          uintptr_t partials, int64_t num_partials, uintptr_t inv_scale, uintptr_t lr, int lr_code,
                          uintptr_t out_stats) {
  StepArgs a;
  a.param = addr<void>(param);
  a.param_dtype = param_dtype;
  a.grad = addr<const void>(grad);
  a.grad_dtype = grad_dtype;
  a.master = addr<float>(master);
  a.state1 = addr<float>(state1);
  a.state2 = addr<float>(state2);
  a.n = n;
  a.step = addr<void>(step);
  a.step_code = step_code;
  a.partials = addr<const float>(partials);
  a.num_partials = num_partials;
  a.inv_scale = addr<const float>(inv_scale);
  a.lr = addr<const void>(lr);
  a.lr_code = lr_code;
  a.out_stats = addr<float>(out_stats);
  return a;
}

}  // namespace ampfused
