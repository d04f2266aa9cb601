// One step call, packed: what every step entry of the CPU and CUDA modules reads, and the registry of those
// entries. Shared by both modules, so the CPU suite tests the code that reads a CUDA step's arguments.
//
// A call is `step(op, slots, hyper[, rows])`:
//   slots  int64[kNumSlots]: the addresses, counts and codes below, by name (the module exports the names in
//          order as STEP_SLOTS; ampfused/ops/native_args.py packs by those names, a slot it does not set is 0);
//   hyper  double[n]: the op's hyperparameters in the order its entry registered them (the module exports
//          them per op as step_ops(); the Python side packs them by name, bools as 0 / 1);
//   rows   the tensor table as ints, when it is not already in the kernels' memory at slots[table].
// Each optimizer registers its entry in its own source file (AMPFUSED_STEP_ENTRY below), so the modules
// name no optimizer.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ampfused/step_args.h"

namespace ampfused {

// clang-format off
#define AMPFUSED_STEP_SLOTS(X)                                                                           \
  /* the step (step_args.h: StepArgs) */                                                                 \
  X(table) X(count) X(param_dtype) X(grad_dtype) X(master) X(state1) X(state2) X(steps) X(step_code)    \
  X(partials) X(num_partials) X(inv_scale) X(lr) X(lr_code) X(out_stats)                                 \
  X(master_format) X(state_dtype) X(seed) X(state_scales) X(scale_blocks)                                \
  /* where it runs: the CPU's thread count; the CUDA device and stream */                                \
  X(threads) X(device) X(stream)                                                                         \
  /* CUDA: the work lists beside the table (launch.h: WorkList), the block counter, the single launch */ \
  X(chunks) X(num_chunks) X(columns) X(num_columns) X(counter) X(single_launch)                          \
  /* a factored state's tiles on the GPU (their count, items and column parts; scratch) */             \
  X(tiles) X(items) X(colparts) X(scratch) X(col_chunk)                                                  \
  /* a step in phases (0: the whole step): a factored one's sums over whole parameters; a split step's */ \
  /* scratch between its passes (the scratch slot) and its fp64 lr factors, one per parameter */          \
  X(phase) X(sums) X(ratios)                                                                             \
  /* the step's health sums (reference_common.HealthSums: fp64 [5]; 0: none) */                          \
  X(health)
// clang-format on

enum StepSlot : int {
#define AMPFUSED_SLOT_ENUM(name) kSlot_##name,
  AMPFUSED_STEP_SLOTS(AMPFUSED_SLOT_ENUM)
#undef AMPFUSED_SLOT_ENUM
  kNumSlots
};

inline std::vector<std::string> step_slot_names() {
  return {
#define AMPFUSED_SLOT_NAME(name) #name,
      AMPFUSED_STEP_SLOTS(AMPFUSED_SLOT_NAME)
#undef AMPFUSED_SLOT_NAME
  };
}

// A step call as its entry reads it.
struct StepPack {
  StepArgs args;                // the step's tensors (step_args.h)
  std::vector<int64_t> slots;   // every slot, for what StepArgs does not hold
  int64_t table_ints = -1;      // ints of the tensor table passed as `rows` (-1: given as an address)
  std::string op;
  std::vector<std::string> hyper_names;
  std::vector<double> hyper;

  int64_t slot(StepSlot s) const { return slots[size_t(s)]; }
  template <typename T>
  T* ptr(StepSlot s) const { return addr<T>(uintptr_t(slots[size_t(s)])); }
  double h(size_t i) const { return hyper[i]; }
  bool flag(size_t i) const { return hyper[i] != 0.0; }
};

// The tensor table of a flat-state step: count rows of kTableCols ints when it came as ints.
inline void check_flat_table(const StepPack& p) {
  if (p.table_ints >= 0 && p.table_ints != p.args.count * kTableCols) {
    throw std::invalid_argument("the tensor table must hold " + std::to_string(kTableCols) + " ints per parameter");
  }
}

// The pack, checked: slot and hyperparameter counts, then the sizes every entry relies on.
inline StepPack read_step_pack(const std::string& op, const std::vector<std::string>& hyper_names,
                               const std::vector<int64_t>& slots, const std::vector<double>& hyper,
                               int64_t table_ints) {
  if (slots.size() != size_t(kNumSlots)) {
    throw std::invalid_argument("step " + op + ": the packed call must have " + std::to_string(kNumSlots) +
                                " slots, got " + std::to_string(slots.size()));
  }
  if (hyper.size() != hyper_names.size()) {
    throw std::invalid_argument("step " + op + ": takes " + std::to_string(hyper_names.size()) +
                                " hyperparameters, got " + std::to_string(hyper.size()));
  }
  const auto at = [&](StepSlot s) { return slots[size_t(s)]; };
  const auto u = [&](StepSlot s) { return uintptr_t(slots[size_t(s)]); };
  if (at(kSlot_count) < 0 || at(kSlot_num_partials) < 0 || at(kSlot_scale_blocks) < 0) {
    throw std::invalid_argument("step " + op + ": a negative count, number of partials or of scale blocks");
  }
  StepPack p;
  p.op = op;
  p.hyper_names = hyper_names;
  p.hyper = hyper;
  p.table_ints = table_ints;
  p.slots = slots;
  StepArgs& a = p.args;
  a.table = addr<const int64_t>(u(kSlot_table));
  a.count = at(kSlot_count);
  a.param_dtype = int(at(kSlot_param_dtype));
  a.grad_dtype = int(at(kSlot_grad_dtype));
  a.master = addr<float>(u(kSlot_master));
  a.state1 = addr<float>(u(kSlot_state1));
  a.state2 = addr<float>(u(kSlot_state2));
  a.steps = addr<void>(u(kSlot_steps));
  a.step_code = int(at(kSlot_step_code));
  a.partials = addr<const float>(u(kSlot_partials));
  a.num_partials = at(kSlot_num_partials);
  a.inv_scale = addr<const float>(u(kSlot_inv_scale));
  a.lr = addr<const void>(u(kSlot_lr));
  a.lr_code = int(at(kSlot_lr_code));
  a.out_stats = addr<float>(u(kSlot_out_stats));
  a.master_format = int(at(kSlot_master_format));
  a.state_dtype = int(at(kSlot_state_dtype));
  a.seed = addr<const int64_t>(u(kSlot_seed));
  a.state_scales = addr<float>(u(kSlot_state_scales));
  a.scale_blocks = at(kSlot_scale_blocks);
  return p;
}

// The step entries of one module, each registered by its optimizer's source file. `Fn` is the module's entry
// type (the CPU's runs the step; the CUDA one's enqueues it and returns "" or an error).
template <typename Fn>
struct StepRegistry {
  struct Entry {
    std::string op;
    std::vector<std::string> hyper;  // the hyperparameters' names, in the order the entry reads them
    std::string variant;             // the CPU's instruction set ("" where there is one build)
    Fn fn;
  };

  static std::vector<Entry>& entries() {
    static std::vector<Entry> all;
    return all;
  }

  struct Add {
    Add(const char* op, std::vector<std::string> hyper, const char* variant, Fn fn) {
      entries().push_back(Entry{op, std::move(hyper), variant, fn});
    }
  };

  // The entry of `op` built for `variant`, else the one built for every variant ("").
  static const Entry& find(const std::string& op, const std::string& variant = "") {
    const Entry* shared = nullptr;
    for (const Entry& e : entries()) {
      if (e.op != op) continue;
      if (e.variant == variant) return e;
      if (e.variant.empty()) shared = &e;
    }
    if (shared) return *shared;
    std::string known;
    for (const Entry& e : entries()) {
      if (known.find(e.op) == std::string::npos) known += (known.empty() ? "" : ", ") + e.op;
    }
    throw std::invalid_argument("no step op '" + op + "' in this module; it has: " + known);
  }
};

// Integer constants a step's Python side packs by (a table's columns, say), registered beside the step.
inline std::vector<std::pair<std::string, int64_t>>& step_constants() {
  static std::vector<std::pair<std::string, int64_t>> all;
  return all;
}

struct StepConstantAdd {
  StepConstantAdd(const char* name, int64_t value) { step_constants().emplace_back(name, value); }
};

#define AMPFUSED_STEP_CAT2(a, b) a##b
#define AMPFUSED_STEP_CAT(a, b) AMPFUSED_STEP_CAT2(a, b)
#define AMPFUSED_STEP_STR2(x) #x
#define AMPFUSED_STEP_STR(x) AMPFUSED_STEP_STR2(x)

// Registers `fn` as module registry `Registry`'s entry for op `op` (its name in ampfused/ops/specs.py) reading the
// hyperparameters `...` (string literals) in that order.
#define AMPFUSED_STEP_ENTRY(Registry, op, variant, fn, ...)                                          \
  static const Registry::Add AMPFUSED_STEP_CAT(ampfused_step_entry_, __LINE__)(op, {__VA_ARGS__}, \
                                                                               variant, fn)

#define AMPFUSED_STEP_CONSTANT(name, value) \
  static const ::ampfused::StepConstantAdd AMPFUSED_STEP_CAT(ampfused_step_constant_, __LINE__)(#name, value)

}  // namespace ampfused
