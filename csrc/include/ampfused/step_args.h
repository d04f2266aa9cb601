// Arguments of the optimizer-step drivers, shared by the CPU and CUDA modules. All pointers are raw
// addresses handed over from Python (host memory for the CPU module, device memory for CUDA).
//
// A step updates T parameters where they live. Their addresses travel in a *tensor table*: T rows of
// four int64 (kTableCols), in the memory the kernels run on:
//
//   row k = { param address, grad address, numel, offset of the parameter's first element in the flat
//             state buffers }
//
// A parameter without a gradient this step (torch.optim skips it: no decay, no state change, its step
// count stays) has numel -1 (kNoGrad): addresses of empty tensors may be 0, so the numel says it.
//
// Parameters and gradients are walked in memory order (a dense tensor's elements fill one block of
// memory); element j of parameter k pairs with element offset + j of the master and state buffers.
// `steps` holds one step count per parameter, as torch.optim keeps one per parameter.
#pragma once

#include <cstdint>

namespace ampfused {

// Codes of the step / lr tensors (fp32 or fp64), as in ampfused/_native.py.
enum ScalarCode : int { kScalarF32 = 0, kScalarF64 = 3 };

constexpr int kTableCols = 4;
enum TableCol : int { kColParam = 0, kColGrad = 1, kColNumel = 2, kColOffset = 3 };
constexpr int64_t kNoGrad = -1;

struct StepArgs {
  const int64_t* table = nullptr;  // [count, kTableCols], see above
  int64_t count = 0;               // T
  int param_dtype = 0;             // every parameter's dtype (fp32/bf16/fp16)
  int grad_dtype = 0;              // every gradient's dtype (fp32/bf16/fp16)
  float* master = nullptr;         // fp32 master copies, or null when the parameters are the fp32 compute copy
  float* state1 = nullptr;         // exp_avg / momentum_buf (null for SGD without momentum)
  float* state2 = nullptr;         // exp_avg_sq (Adam only)
  void* steps = nullptr;           // [count], step_code
  int step_code = 0;
  const float* partials = nullptr;  // [2, num_partials], row-major
  int64_t num_partials = 0;
  const float* inv_scale = nullptr;  // 0-d fp32
  const void* lr = nullptr;          // 0-d, lr_code
  int lr_code = 0;
  float* out_stats = nullptr;        // [2] fp32: norm, found_inf
  // compact state (math.h, ampfused/ops/state_precision.py): the master's format (master then points at
  // uint16 remainders, or is null), the moments' storage dtype (kF32, kBF16, or kStateU8: 8-bit codes, state1
  // and state2 then point at uint8 and the layout's offsets are multiples of kQBlock), the stochastic
  // rounding's seed (0-d int64 in the kernels' memory; null when nothing is rounded stochastically), and the
  // 8-bit moments' block scales ([moments, blocks] fp32, row 0 state1's, row 1 state2's; null otherwise)
  int master_format = 0;
  int state_dtype = 0;
  const int64_t* seed = nullptr;
  float* state_scales = nullptr;
  int64_t scale_blocks = 0;  // columns of state_scales
};

struct AdamHyper {
  double beta1, beta2, eps, weight_decay, max_norm;
  bool decoupled, maximize;
  float log_beta1, log_beta2;  // math.h's log_beta of beta1, beta2 (on the host)
};

struct SgdHyper {
  double momentum, dampening, weight_decay, max_norm;
  bool nesterov, maximize;
};

// A raw address handed over from Python as an int.
template <typename T>
inline T* addr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// StepArgs from the addresses and codes the Python side passes (both modules' step entries take these).
inline StepArgs step_args(uintptr_t table, int64_t count, int param_dtype, int grad_dtype, uintptr_t master,
                          uintptr_t state1, uintptr_t state2, uintptr_t steps, int step_code, uintptr_t partials,
                          int64_t num_partials, uintptr_t inv_scale, uintptr_t lr, int lr_code, uintptr_t out_stats,
                          int master_format = 0, int state_dtype = 0, uintptr_t seed = 0,
                          uintptr_t state_scales = 0, int64_t scale_blocks = 0) {
  StepArgs a;
  a.table = addr<const int64_t>(table);
  a.count = count;
  a.param_dtype = param_dtype;
  a.grad_dtype = grad_dtype;
  a.master = addr<float>(master);
  a.state1 = addr<float>(state1);
  a.state2 = addr<float>(state2);
  a.steps = addr<void>(steps);
  a.step_code = step_code;
  a.partials = addr<const float>(partials);
  a.num_partials = num_partials;
  a.inv_scale = addr<const float>(inv_scale);
  a.lr = addr<const void>(lr);
  a.lr_code = lr_code;
  a.out_stats = addr<float>(out_stats);
  a.master_format = master_format;
  a.state_dtype = state_dtype;
  a.seed = addr<const int64_t>(seed);
  a.state_scales = addr<float>(state_scales);
  a.scale_blocks = scale_blocks;
  return a;
}

}  // namespace ampfused
