"""The packed step call (``csrc/include/ampfused/step_pack.h``), the one entry of each native module: the modules
and the op records agree on every step op and its hyperparameters, the packing reads back as it was written (the
CPU module runs the reader the CUDA module runs), and a malformed call is refused with what is wrong."""
import math

import pytest
import torch

import ampfused
from ampfused import _native
from ampfused.ops import native_args, specs
from ampfused.ops.call import StepCall

STEP_OPS = sorted(name for name, spec in specs.SPECS.items() if spec.is_step)


def _module(kind):
    why = _native.unavailable_reason(kind)
    if why:
        pytest.skip(f"ampfused's {kind} module is not built: {why}")
    return _native.module(kind)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_every_step_op_has_an_entry_reading_its_records_hyperparameters(kind):
    mod = _module(kind)
    ops = mod.step_ops()
    assert sorted(ops) == STEP_OPS
    for name in STEP_OPS:
        spec = specs.SPECS[name]  # (a split step's passes read only their own: OpSpec.split.hypers)
        assert list(ops[name]) == [h.name for h in spec.hypers if spec.split is None or h.name in spec.split.hypers]
    assert list(mod.STEP_SLOTS) == list(_native.module("cpu").STEP_SLOTS)  # one layout, shared


def test_the_factored_tables_constants_are_the_modules():
    from ampfused.ops import native_factored
    consts = _module("cpu").step_constants()
    assert consts["AF_COLS"] == native_factored.AF_COLS and consts["AF_MAX_DIMS"] == native_factored.AF_MAX_DIMS


def _sgd_call(momentum: float, buf=True):
    p = torch.zeros(3)
    return StepCall(specs.SPECS["sgd_step_"], master=None, states=dict(momentum_buf=torch.zeros(3) if buf else None),
                    steps=torch.zeros(1), partials=torch.zeros(2, 1), inv_scale=torch.ones(()), lr=torch.ones(()),
                    out_stats=torch.zeros(2), hyper=dict(momentum=momentum, dampening=0.25, weight_decay=0.5,
                                                         nesterov=True, max_norm=math.inf, maximize=False),
                    params=[p], grads=[torch.ones(3)])


def test_the_cpu_backends_packing_reads_back_as_written():
    """What CpuBackend packs is what the entries read: every address, count and code, and each hyperparameter
    under its own name (bools as 0 / 1, max_norm inf)."""
    mod = _module("cpu")
    from ampfused.ops.cpu import BACKEND
    call = _sgd_call(0.9)
    states = [(n, t) for n, t in call.used_states() if t is not None]
    fmt = BACKEND._check_flat(call, states)
    place = BACKEND._place_flat(call, states)
    pack = native_args.packer(mod)
    read = mod.read_step("sgd_step_", pack.slots(place, BACKEND._flat_slots(call, states, fmt)), pack.hyper(call))
    assert read["count"] == 1 and read["param_dtype"] == read["grad_dtype"] == _native.DTYPE_CODES[torch.float32]
    assert read["master"] == 0 and read["state1"] == call.states["momentum_buf"].data_ptr() and read["state2"] == 0
    assert read["steps"] == call.steps.data_ptr() and read["partials"] == call.partials.data_ptr()
    assert read["num_partials"] == 1 and read["inv_scale"] == call.inv_scale.data_ptr()
    assert read["lr"] == call.lr.data_ptr() and read["out_stats"] == call.out_stats.data_ptr()
    assert (read["master_format"], read["state_dtype"], read["seed"], read["state_scales"]) == (0, 0, 0, 0)
    assert read["hyper"] == dict(momentum=0.9, dampening=0.25, weight_decay=0.5, nesterov=1.0, max_norm=math.inf,
                                 maximize=0.0)


def test_a_state_the_step_does_not_read_is_not_packed():
    """SGD without momentum: its buffer is neither read nor required (the record's ``needed_if``)."""
    assert _sgd_call(0.0).used_states() == [("momentum_buf", None)]
    assert _sgd_call(0.0, buf=False).used_states() == [("momentum_buf", None)]
    with pytest.raises(ValueError, match="momentum_buf is required when momentum != 0"):
        _sgd_call(0.9, buf=False).used_states()


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_a_malformed_pack_is_refused_with_what_is_wrong(kind):
    mod = _module(kind)
    pack = native_args.packer(mod)
    slots = pack.slots({})
    lion = [0.9, 0.99, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=f"must have {len(mod.STEP_SLOTS)} slots, got 3"):
        mod.step("lion_step_", [0, 0, 0], lion)
    with pytest.raises(ValueError, match="takes 5 hyperparameters, got 2"):
        mod.step("lion_step_", slots, [0.9, 0.99])
    with pytest.raises(ValueError, match="no step op 'nadam_step_' in this module; it has: .*lion_step_"):
        mod.step("nadam_step_", slots, lion)
    with pytest.raises(ValueError, match="a negative count"):
        mod.step("lion_step_", pack.slots(dict(count=-1)), lion)


def test_a_table_of_the_wrong_size_is_refused():
    mod = _module("cpu")
    pack = native_args.packer(mod)
    with pytest.raises(ValueError, match="the tensor table must hold 4 ints per parameter"):
        mod.step("lion_step_", pack.slots(dict(count=2)), [0.9, 0.99, 0.0, 1.0, 0.0], [0] * 7)
    with pytest.raises(ValueError, match="the Adafactor table must hold 22 ints per parameter"):
        mod.step("adafactor_step_", pack.slots(dict(count=1)), [-0.8, 1e-30, 1e-3, 1.0, 0.0, 1.0, 0.0], [0] * 4)


def test_every_backend_takes_the_step_through_one_entry():
    """A backend's step ops by name are its ``step`` (``Backend.__getattr__``): the same bits as the public op."""
    from ampfused import ops
    outs = []
    for how in ("public", "backend"):
        torch.manual_seed(0)
        p = torch.randn(10)
        g = torch.randn(10)
        m, steps, out = torch.zeros(10), torch.zeros(1), torch.zeros(2)
        inv = torch.ones(())
        parts = ops.norm_check([g], inv, backend="cpu")
        if how == "public":
            ops.lion_step_([p], [g], None, m, steps, parts, inv, torch.full((), 0.1), out, beta1=0.8, backend="cpu")
        else:
            ops.get_backend("cpu").lion_step_([p], [g], None, m, steps, parts, inv, torch.full((), 0.1), out, 0.8,
                                              0.99, 0.0, math.inf, False)
        outs.append((p, m, steps))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert ampfused.ops.get_backend("cpu").has_step("lion_step_")
    assert not ampfused.ops.get_backend("cpu").has_step("nadam_step_")
