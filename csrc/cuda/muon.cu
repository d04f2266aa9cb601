// Muon's two elementwise passes (split_math.h; reference_muon.muon_step_shard_) on step.cuh's K2, one launch each;
// the Newton-Schulz iteration runs on torch's matmuls between them (ampfused/ops/call.py: StepCall.run_on). Both
// passes address the bf16 scratch of the `scratch` slot, laid out as the state, through Op::at:
//  - phase 1 (MuonMomentumOp): the momentum in any storage, the iteration's input in the parameter's place (a bf16
//    output without a master: the compact kernels, which store it to nearest); no step count moves;
//  - phase 2 (MuonUpdateOp): the orthogonalized update in the gradient's place (bf16), no moments, the weight in
//    any master format; its constants per parameter from the lr and the `ratios` slot; the step counts.
// Scratch pieces start where the state's do (multiples of 4 elements): a parameter whose piece is not 16-byte
// aligned (an offset of 4 mod 8) takes the kernels' one-element path.
#include <stdexcept>

#include "ampfused/split_math.h"
#include "entry.h"
#include "step.cuh"

namespace ampfused {
namespace cuda {
namespace {

struct MuonMomentumHyper {
  double max_norm, momentum;
  bool nesterov;
  bf16_t* scratch;
};

struct MuonMomentumOp {
  using Hyper = MuonMomentumHyper;
  using Consts = SplitMomentumConsts;
  static constexpr int kStates = 1;  // the momentum buffer
  static constexpr bool kOutput = true;
  static constexpr bool kAdvancesSteps = false;
  __device__ __noinline__ static Consts make(float coef, float, double, const Hyper& h) {
    return make_split_momentum_consts(coef, h.momentum, h.nesterov);
  }
  __device__ static void at(const Hyper& h, int64_t, int64_t offset, void*& param, const void*&, Consts&) {
    param = h.scratch + offset;
  }
  __device__ static void apply(float g, float& u, float& m, float&, const Consts& c) { u = split_momentum(g, m, c); }
};

struct MuonUpdateHyper {
  double max_norm, weight_decay;
  const void* lr;  // read in fp64 (an fp64 lr tensor keeps its bits: the reference's lr.double())
  int lr_code;
  const double* ratios;
  const bf16_t* scratch;
};

struct MuonUpdateOp {
  using Hyper = MuonUpdateHyper;
  using Consts = SplitUpdateConsts;
  static constexpr int kStates = 0;
  __device__ __noinline__ static Consts make(float, float, double, const Hyper& h) {
    return make_split_update_consts(read_scalar(h.lr, h.lr_code), h.weight_decay, 0.0);
  }
  __device__ static void at(const Hyper& h, int64_t row, int64_t offset, void*&, const void*& grad, Consts& c) {
    grad = h.scratch + offset;
    c.step = float(read_scalar(h.lr, h.lr_code) * h.ratios[row]);
  }
  __device__ static void apply(float o, float& w, float&, float&, const Consts& c) { split_update(o, w, c); }
};

std::string muon_step(const StepPack& p) {
  const WorkList w = flat_work(p);
  const int64_t phase = p.slot(kSlot_phase);
  if (phase != 1 && phase != 2) {
    throw std::invalid_argument("muon_step_ runs as its two passes around the iteration (phase 1 or 2, with their "
                                "scratch): got phase " + std::to_string(phase));
  }
  bf16_t* scratch = p.ptr<bf16_t>(kSlot_scratch);
  const double* ratios = p.ptr<const double>(kSlot_ratios);
  if (w.num_chunks > 0 && (scratch == nullptr || (phase == 2 && ratios == nullptr))) {
    throw std::invalid_argument("muon_step_'s passes need their scratch (and, in phase 2, the lr factors)");
  }
  const int device = device_of(p);
  std::string err = use_device(device);
  if (!err.empty()) return err;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream_of(p));
  const double max_norm = p.h(3);
  StepArgs a = p.args;
  if (phase == 1) {  // (a single launch computes K1 here; phase 2 then reads the partials it wrote)
    a.master = nullptr;
    a.master_format = kMasterF32;
    const MuonMomentumHyper h{max_norm, p.h(0), p.flag(1), scratch};
    with_type(a.grad_dtype, [&](auto gtag) {
      using G = decltype(gtag);
      with_state(a.state_dtype, [&](auto stag) {
        err = launch_step_typed<G, bf16_t, MuonMomentumOp, kMasterF32, decltype(stag)>(
            device, s, a, w, h, counter_of(p), single_launch_of(p));
      });
    });
    return err;
  }
  a.state1 = nullptr;
  a.state_dtype = kF32;
  const MuonUpdateHyper h{max_norm, p.h(2), a.lr, a.lr_code, ratios, scratch};
  if (a.master_format == kMasterRemainder) {
    return launch_step_typed<bf16_t, bf16_t, MuonUpdateOp, kMasterRemainder>(device, s, a, w, h, counter_of(p), false);
  }
  if (a.master_format == kMasterNone) {
    return launch_step_typed<bf16_t, bf16_t, MuonUpdateOp, kMasterNone>(device, s, a, w, h, counter_of(p), false);
  }
  with_type(a.master ? a.param_dtype : kF32, [&](auto ptag) {
    err = launch_step_typed<bf16_t, decltype(ptag), MuonUpdateOp>(device, s, a, w, h, counter_of(p), false);
  });
  return err;
}

std::string prepare_muon(int device) {
  std::string err = use_device(device);
  if (!err.empty()) return err;
  for (int g : {int(kF32), int(kBF16), int(kF16)}) {
    with_type(g, [&](auto gtag) {
      using G = decltype(gtag);
      resident_blocks<G, bf16_t, MuonMomentumOp, kMasterF32, float>(device);
      resident_blocks<G, bf16_t, MuonMomentumOp, kMasterF32, bf16_t>(device);
      resident_blocks<G, bf16_t, MuonMomentumOp, kMasterF32, uint8_t>(device);
    });
    with_type(g, [&](auto ptag) { resident_blocks<bf16_t, decltype(ptag), MuonUpdateOp>(device); });
  }
  resident_blocks<bf16_t, bf16_t, MuonUpdateOp, kMasterRemainder>(device);
  resident_blocks<bf16_t, bf16_t, MuonUpdateOp, kMasterNone>(device);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : cuda_error("loading the muon kernels", e);
}

}  // namespace

AMPFUSED_CUDA_STEP("muon_step_", muon_step, prepare_muon, "momentum", "nesterov", "weight_decay", "max_norm");

}  // namespace cuda
}  // namespace ampfused
