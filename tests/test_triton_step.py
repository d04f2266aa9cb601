"""Triton backend: K2 (adam_step_, sgd_step_) over lists of parameters, against the fp32 reference and an
fp64 oracle.

The oracle is the reference run in fp64 (fp64 weights, states, partials, inv_scale, lr and steps). A problem
is a list of parameters of awkward sizes and layouts (empty, one element, odd sizes, channels_last, a
transpose), one without a gradient, with different step counts per parameter, and flat state buffers laid
out by ``state_layout`` whose gaps hold a sentinel. Each case runs consecutive steps, fed with partials from
the backend's own norm_check, and checks after every step: weights and states within the oracle rule, the
model copy equal to the rounded master bit for bit, the parameter without a gradient (param, state slices,
step) and the gaps unchanged bit for bit, the step counts and out_stats; then that a second run reproduces
every bit.
"""
import importlib
import math
import os
from types import SimpleNamespace

import pytest
import torch

from ampfused import _native, ops
from ampfused.ops import native_args, reference
from ampfused.ops.reference import memory_view, state_layout
from backends import TRITON_DEVICE, requires_triton
from oracle import assert_bitwise, assert_close_to_oracle

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = TRITON_DEVICE
pytestmark = requires_triton

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
SCALE = 1024.0  # loss scale of the synthetic gradients; inv_scale = 1 / SCALE
CLIP = 20.0     # below the unscaled norm (~sqrt(numel)): clipping is active
GAP = 777.0     # what the gaps between parameters in the flat state buffers hold (never touched)

# (shape, layout, has a gradient, step count before the first step)
PARAMS = [
    ((0,), "contiguous", True, 0),
    ((1,), "contiguous", True, 3),
    ((5,), "contiguous", True, 0),
    ((127,), "contiguous", True, 41),
    ((300,), "contiguous", False, 7),           # no gradient: left alone
    ((6, 4, 5, 7), "channels_last", True, 1),
    ((45, 67), "transposed", True, 0),           # 3015 elements
]

ADAM_CASES = {
    "adamw-bf16-master": (BF16, BF16, True, dict(decoupled=True, weight_decay=0.01)),
    "adamw-fp16-master-clip": (F16, F16, True, dict(decoupled=True, weight_decay=0.1, max_norm=CLIP)),
    "adam-fp32-l2-clip-maximize": (F32, F32, False, dict(decoupled=False, weight_decay=0.1, max_norm=CLIP,
                                                         maximize=True)),
    "adamw-fp32-master-bf16grad-beta1-0": (F32, BF16, True, dict(decoupled=True, beta1=0.0, beta2=0.99)),
    "adam-fp32-fp16grad": (F32, F16, False, dict(decoupled=False)),
}
SGD_CASES = {
    "sgd-nesterov-bf16-master": (BF16, BF16, True, dict(momentum=0.9, nesterov=True, weight_decay=1e-4)),
    "sgd-dampening-fp32-clip-maximize": (F32, F32, False, dict(momentum=0.9, dampening=0.1, max_norm=CLIP,
                                                               maximize=True, weight_decay=0.01)),
    "sgd-plain-fp16-master": (F16, F16, True, dict()),
}


def kernels(name):
    return importlib.import_module(f"ampfused.triton_kernels.{name}")


def backend():
    return ops.get_backend("triton")


@pytest.fixture
def small_geometry(monkeypatch):
    """Tiny blocks, chunks and program caps: parameters of several chunks, programs looping over chunks,
    masked tails, a prologue looping over partials and a step advance looping over the table."""
    monkeypatch.setattr(kernels("norm_check"), "BLOCK", 64)
    monkeypatch.setattr(kernels("norm_check"), "CHUNK", 128)
    monkeypatch.setattr(kernels("norm_check"), "MAX_PROGRAMS", 8)
    for mod in ("adam", "sgd"):
        monkeypatch.setattr(kernels(mod), "BLOCK", 64)
        monkeypatch.setattr(kernels(mod), "CHUNK", 256)
        monkeypatch.setattr(kernels(mod), "MAX_PROGRAMS", 3)
        monkeypatch.setattr(kernels(mod), "PBLOCK", 4)
        monkeypatch.setattr(kernels(mod), "TBLOCK", 4)


class Launches:
    """Counts the launches of a kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.count, self.grids = kernel, 0, []

    def __getitem__(self, grid):
        self.count += 1
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    out = {}
    for mod, name in (("adam", "_adam_kernel"), ("sgd", "_sgd_kernel"), ("norm_check", "_norm_check_kernel")):
        out[name] = Launches(getattr(kernels(mod), name))
        monkeypatch.setattr(kernels(mod), name, out[name])
    return out


# ------------------------------------------------------------------------------------------------ problems

def make_tensor(shape, layout, dtype, values):
    """A tensor of ``shape`` in ``layout`` whose elements in memory order are ``values``."""
    n = math.prod(shape)
    if layout == "channels_last":
        t = torch.empty(shape, dtype=dtype, device=DEVICE).to(memory_format=torch.channels_last)
    elif layout == "transposed":
        t = torch.empty(shape[::-1], dtype=dtype, device=DEVICE).t()
    elif layout == "odd_offset":  # starts one element into its storage: not 16-byte aligned
        t = torch.empty(n + 1, dtype=dtype, device=DEVICE)[1:].view(shape)
    else:
        t = torch.empty(shape, dtype=dtype, device=DEVICE)
    memory_view(t).copy_(values.to(dtype))
    return t


def new_problem(kind, pdtype, has_master, specs, momentum=True, oracle=False, step_dtype=F32):
    """params, master, states and steps of one problem; ``oracle``: fp64 everything, the params holding the
    weights (no master). Every copy starts from the same (rounded) values."""
    gen = torch.Generator().manual_seed(1)
    offsets, total = state_layout([math.prod(s) for s, *_ in specs])
    cd = F64 if oracle else F32
    master = torch.full((total,), GAP, dtype=cd, device=DEVICE) if has_master and not oracle else None
    states = [torch.full((total,), GAP, dtype=cd, device=DEVICE) for _ in range(2 if kind == "adam" else 1)]
    params = []
    for (shape, layout, _, step0), off in zip(specs, offsets):
        n = math.prod(shape)
        w = torch.randn(n, generator=gen, dtype=F64).to(pdtype).to(F64)
        params.append(make_tensor(shape, layout, F64 if oracle else pdtype, w))
        if master is not None:
            master[off:off + n] = w.to(cd)
        sl = slice(off, off + n)
        if kind == "adam":
            states[0][sl] = (torch.randn(n, generator=gen, dtype=F64) * 1e-3).to(F32).to(cd)
            states[1][sl] = (torch.rand(n, generator=gen, dtype=F64) * 1e-6).to(F32).to(cd)
        else:  # a parameter's first step must not read its momentum
            states[0][sl] = float("nan") if step0 == 0 else (torch.randn(n, generator=gen, dtype=F64) * 1e-2).to(
                F32).to(cd)
    if kind == "sgd" and not momentum:
        states = [None]
    steps = torch.tensor([float(s[3]) for s in specs], dtype=F64 if oracle else step_dtype, device=DEVICE)
    return SimpleNamespace(params=params, master=master, states=states, steps=steps, offsets=offsets,
                           out=torch.zeros(2, dtype=cd, device=DEVICE))


def grads_for(specs, gdtype, steps, seed=2):
    """Per step, one gradient per parameter (None where the spec has none), in its parameter's layout."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        gs = []
        for shape, layout, has_grad, _ in specs:
            g = make_tensor(shape, layout, gdtype, torch.randn(math.prod(shape), generator=gen) * SCALE)
            gs.append(g if has_grad else None)
        out.append(gs)
    return out


FULL_ADAM = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_norm=math.inf, decoupled=False, maximize=False)
FULL_SGD = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, max_norm=math.inf, maximize=False)


def run_step(kind, s, grads, partials, inv_scale, lr, kw, backend_name):
    args = (s.params, grads, s.master, *s.states, s.steps, partials, inv_scale, lr, s.out)
    if backend_name == "oracle":  # the reference called directly: fp64 everywhere, no dtype checks
        full = dict(FULL_ADAM if kind == "adam" else FULL_SGD, **kw)
        (reference.adam_step_ if kind == "adam" else reference.sgd_step_)(*args, **full)
    else:
        (ops.adam_step_ if kind == "adam" else ops.sgd_step_)(*args, **kw, backend=backend_name)


def present(grads):
    return [g for g in grads if g is not None]


def oracle_partials(grads, inv_scale):
    gs = present(grads)
    sq = sum(((g.double() * inv_scale.double()) ** 2).sum() for g in gs) if gs else torch.zeros((), dtype=F64)
    bad = any(not torch.isfinite(g).all() for g in gs)
    return torch.tensor([[float(sq)], [float(bad)]], dtype=F64, device=DEVICE)


def weights(s):
    """The compute copy of every parameter, in memory order, concatenated."""
    if s.master is None:
        return torch.cat([memory_view(p) for p in s.params]) if s.params else torch.zeros(0)
    return torch.cat([s.master[o:o + p.numel()] for p, o in zip(s.params, s.offsets)])


def snapshot(s):
    return [t.clone() for t in (*s.params, s.master, *s.states, s.steps) if t is not None]


def assert_same(where, a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bitwise(f"{where} [{i}]", x, y)


def check_step(where, specs, pdtype, fast, ref, orc, before, has_master):
    """Everything the oracle rule and the contract say after one step (fast = triton, ref = fp32 reference)."""
    assert_close_to_oracle(f"{where} weights", weights(fast), weights(ref), weights(orc))
    for j, st in enumerate(fast.states):
        if st is not None:
            assert_close_to_oracle(f"{where} state {j}", st, ref.states[j], orc.states[j])
    assert_close_to_oracle(f"{where} norm", fast.out[0], ref.out[0], orc.out[0])
    assert fast.out[1].item() == 0.0
    assert_bitwise(f"{where} steps", fast.steps.to(ref.steps.dtype), ref.steps)
    for i, ((shape, _, has_grad, _), p, off) in enumerate(zip(specs, fast.params, fast.offsets)):
        n = p.numel()
        if has_master:
            assert_bitwise(f"{where} params[{i}] = round(master)", memory_view(p), fast.master[off:off + n].to(pdtype))
        if not has_grad:
            assert_bitwise(f"{where} params[{i}] (no grad)", p, before.params[i])
            for name, now, then in [("master", fast.master, before.master)] + [
                    (f"state {j}", a, b) for j, (a, b) in enumerate(zip(fast.states, before.states))]:
                if now is not None:
                    assert_bitwise(f"{where} {name} of params[{i}] (no grad)", now[off:off + n], then[off:off + n])
            assert fast.steps[i].item() == before.steps[i].item()
    for name, buf in [("master", fast.master)] + [(f"state {j}", t) for j, t in enumerate(fast.states)]:
        if buf is not None:
            gaps = torch.ones(buf.numel(), dtype=torch.bool, device=DEVICE)
            for p, off in zip(fast.params, fast.offsets):
                gaps[off:off + p.numel()] = False
            assert (buf[gaps] == GAP).all(), f"{where}: a gap of {name} was written"


def run_case(kind, pdtype, gdtype, has_master, kw, specs=PARAMS, steps=2, step_dtype=F32):
    inv = torch.tensor(1 / SCALE, device=DEVICE)
    lr = torch.tensor(1e-3 if kind == "adam" else 1e-2, device=DEVICE)
    momentum = kind == "adam" or kw.get("momentum", 0) != 0
    fast, fast2, ref = (new_problem(kind, pdtype, has_master, specs, momentum, step_dtype=step_dtype)
                        for _ in range(3))
    ref.steps = ref.steps.float()
    orc = new_problem(kind, pdtype, has_master, specs, momentum, oracle=True)
    for i, grads in enumerate(grads_for(specs, gdtype, steps)):
        before = SimpleNamespace(params=[p.clone() for p in fast.params], steps=fast.steps.clone(),
                                 master=None if fast.master is None else fast.master.clone(),
                                 states=[None if t is None else t.clone() for t in fast.states])
        for s in (fast, fast2):
            run_step(kind, s, grads, ops.norm_check(present(grads), inv, backend="triton"), inv, lr, kw, "triton")
        run_step(kind, ref, grads, ops.norm_check(present(grads), inv, backend="reference"), inv, lr, kw,
                 "reference")
        run_step(kind, orc, grads, oracle_partials(grads, inv), inv.double(), lr.double(), kw, "oracle")
        check_step(f"step {i + 1}", specs, pdtype, fast, ref, orc, before, has_master)
        expected = torch.tensor([s[3] + (i + 1) * bool(s[2]) for s in specs], dtype=fast.steps.dtype)
        assert torch.equal(fast.steps.cpu(), expected)
    assert_same("rerun", snapshot(fast) + [fast.out], snapshot(fast2) + [fast2.out])
    assert backend()._counters[fast.steps.device].item() == 0
    return fast


def plan_of(s):
    """The plan the last step of ``s`` used: the most recently used slot of its call site (its steps tensor)."""
    slots = backend().step_tables._slots
    found = [plan for site, (_, plan) in slots.items() if site[1] == s.steps.data_ptr()]
    return found[-1]


# ----------------------------------------------------------------------------------------------- the cases

@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_matches_oracle(case, launches):
    run_case("adam", *ADAM_CASES[case])
    assert launches["_adam_kernel"].count == 4  # one launch per step call: 2 steps x 2 runs
    assert launches["_norm_check_kernel"].count == 4


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_oracle(case, launches):
    run_case("sgd", *SGD_CASES[case])
    assert launches["_sgd_kernel"].count == 4


@pytest.mark.parametrize("kind,case", [("adam", "adamw-fp16-master-clip"), ("sgd", "sgd-nesterov-bf16-master"),
                                       ("sgd", "sgd-dampening-fp32-clip-maximize")])
def test_chunked_grid_matches_oracle(small_geometry, launches, kind, case):
    fast = run_case(kind, *(ADAM_CASES if kind == "adam" else SGD_CASES)[case])
    plan = plan_of(fast)
    # 3015 elements in 256-chunks and the others: 19 chunks over 3 programs, each looping
    assert plan.num_chunks == 12 + 4 + 1 + 1 + 1 and plan.chunk == 256 and plan.aligned
    name = "_adam_kernel" if kind == "adam" else "_sgd_kernel"
    assert set(launches[name].grids) == {(3,)}


def test_fp64_step_counts():
    fast = run_case("adam", BF16, BF16, True, ADAM_CASES["adamw-bf16-master"][3], step_dtype=F64)
    assert fast.steps.dtype == F64


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_misaligned_parameters(small_geometry, kind):
    """A parameter and its gradient starting at an odd element (not 16-byte aligned): the launch takes the
    hint-free path and the results follow the same rules."""
    specs = [((5,), "contiguous", True, 0), ((301,), "odd_offset", True, 2), ((64, 9), "transposed", True, 1)]
    fast = run_case(kind, BF16, BF16, True, dict(weight_decay=0.01) if kind == "adam" else dict(momentum=0.9),
                    specs=specs)
    assert fast.params[1].data_ptr() % 16 and not plan_of(fast).aligned


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_skipped_step_changes_nothing(small_geometry, kind, bad):
    kw = dict(decoupled=True, weight_decay=0.1) if kind == "adam" else dict(momentum=0.9)
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    s = new_problem(kind, BF16, True, PARAMS)
    g_ok, g_bad = grads_for(PARAMS, BF16, 2)
    run_step(kind, s, g_ok, ops.norm_check(present(g_ok), inv, backend="triton"), inv, lr, kw, "triton")
    g_bad[3].view(-1)[100] = bad  # one element of one gradient
    before = snapshot(s)
    partials = ops.norm_check(present(g_bad), inv, backend="triton")
    run_step(kind, s, g_bad, partials, inv, lr, kw, "triton")
    assert_same("skipped step", snapshot(s), before)
    ref_norm, _ = reference.reduce_partials(reference.norm_check(present(g_bad), inv))
    assert s.out[1].item() == 1.0
    assert torch.equal(s.out[0].isnan(), ref_norm.isnan()) and (ref_norm.isnan() or s.out[0] == ref_norm)
    # a pre-reduced [[norm_sq], [flag]] also skips; then a good step counts from the unchanged steps
    run_step(kind, s, g_ok, torch.tensor([[1.0], [1.0]], device=DEVICE), inv, lr, kw, "triton")
    assert_same("skipped again", snapshot(s), before)
    run_step(kind, s, g_ok, ops.norm_check(present(g_ok), inv, backend="triton"), inv, lr, kw, "triton")
    assert s.steps.tolist() == [s0 + 2 * has_grad for _, _, has_grad, s0 in PARAMS]
    assert not torch.equal(s.master, before[len(PARAMS)])
    assert backend()._counters[s.steps.device].item() == 0


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_partials_layouts(kind):
    """Partials from split lists, pre-reduced, or strided give the same step (bitwise where the partials hold
    the same numbers)."""
    kw = dict(decoupled=False, weight_decay=0.01, max_norm=CLIP) if kind == "adam" else dict(momentum=0.5)
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    (grads,) = grads_for(PARAMS, F16, 1)
    gs = present(grads)
    split = torch.cat([ops.norm_check(gs[:3], inv, backend="triton"), ops.norm_check(gs[3:], inv, backend="triton")],
                      dim=1)
    reduced = torch.stack([split[0].sum(), split[1].amax()]).reshape(2, 1)
    strided = torch.zeros(split.shape[1], 3, device=DEVICE)[:, :2].t()
    strided.copy_(split)
    results = []
    for partials in (split, strided, reduced):
        s = new_problem(kind, BF16, True, PARAMS)
        run_step(kind, s, grads, partials, inv, lr, kw, "triton")
        results.append(s)
    assert_same("strided partials", snapshot(results[1]), snapshot(results[0]))
    ref = new_problem(kind, BF16, True, PARAMS)
    run_step(kind, ref, grads, reference.norm_check(gs, inv), inv, lr, kw, "reference")
    orc = new_problem(kind, BF16, True, PARAMS, oracle=True)
    run_step(kind, orc, grads, oracle_partials(grads, inv), inv.double(), lr.double(), kw, "oracle")
    for s in (results[0], results[2]):
        assert_close_to_oracle("weights", weights(s), weights(ref), weights(orc))


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_nothing_to_update_still_reports(kind):
    """No parameters, or none with a gradient: out_stats is written and nothing else changes."""
    inv, lr = torch.tensor(1.0, device=DEVICE), torch.tensor(0.1, device=DEVICE)
    nothing = torch.zeros(0, device=DEVICE)
    empty = SimpleNamespace(params=[], master=None, states=[nothing] * (2 if kind == "adam" else 1),
                            steps=torch.zeros(0, device=DEVICE), out=torch.zeros(2, device=DEVICE))
    kw = {} if kind == "adam" else dict(momentum=0.9)
    run_step(kind, empty, [], torch.tensor([[4.0], [0.0]], device=DEVICE), inv, lr, kw, "triton")
    assert empty.out.tolist() == [2.0, 0.0]
    s = new_problem(kind, BF16, True, PARAMS)
    before = snapshot(s)
    run_step(kind, s, [None] * len(PARAMS), torch.tensor([[9.0], [0.0]], device=DEVICE), inv, lr, kw, "triton")
    assert s.out.tolist() == [3.0, 0.0]
    assert_same("no gradients", snapshot(s), before)
    assert backend()._counters[s.steps.device].item() == 0


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_single_tensor_spelling_and_scalar_dtypes(kind):
    """The legacy spelling (one flat tensor, its gradient, a 0-d step that advances in place) and an fp64 lr,
    read as fp32 exactly as the reference does."""
    inv = torch.tensor(1.0, device=DEVICE)
    g = torch.randn(300, device=DEVICE)
    results = []
    for lr in (torch.tensor(1e-3, device=DEVICE), torch.tensor(1e-3, device=DEVICE).double()):
        torch.manual_seed(3)
        p = torch.randn(300, device=DEVICE)
        states = [torch.zeros(300, device=DEVICE) for _ in range(2 if kind == "adam" else 1)]
        step, out = torch.zeros((), device=DEVICE), torch.zeros(2, device=DEVICE)
        (ops.adam_step_ if kind == "adam" else ops.sgd_step_)(
            p, g, None, *states, step, ops.norm_check([g], inv, backend="triton"), inv, lr, out,
            **({} if kind == "adam" else dict(momentum=0.9)), backend="triton")
        assert step.item() == 1.0
        results.append(p)
    assert_bitwise("fp64 lr", results[0], results[1])


def test_bad_inputs_name_the_tensor_and_rule():
    n = 64
    t = dict(params=[torch.zeros(n, dtype=BF16, device=DEVICE)], grads=[torch.ones(n, dtype=BF16, device=DEVICE)],
             master=torch.zeros(n, device=DEVICE), exp_avg=torch.zeros(n, device=DEVICE),
             exp_avg_sq=torch.zeros(n + 4, device=DEVICE)[1:n + 1], steps=torch.zeros(1, device=DEVICE),
             partials=torch.tensor([[1.0], [0.0]], device=DEVICE), inv_scale=torch.tensor(1.0, device=DEVICE),
             lr=torch.tensor(0.1, device=DEVICE), out_stats=torch.zeros(2, device=DEVICE))
    hyper = (0.9, 0.999, 1e-8, 0.0, math.inf, True)
    with pytest.raises(ValueError, match="exp_avg_sq must start at a 16-byte aligned address"):
        backend().adam_step_(*t.values(), *hyper)
    t["exp_avg_sq"] = torch.zeros(n, device=DEVICE)
    t["steps"] = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="steps must have dtype"):
        backend().adam_step_(*t.values(), *hyper)
    t["steps"] = torch.zeros(1, device=DEVICE)
    t["grads"] = [torch.ones(n, dtype=torch.float64, device=DEVICE)]
    with pytest.raises(TypeError, match="grads must have dtype"):
        backend().adam_step_(*t.values(), *hyper)
    with pytest.raises(TypeError, match=r"grads\[1\] must have dtype"):
        backend().norm_check([torch.ones(3, device=DEVICE), torch.ones(3, dtype=torch.int64, device=DEVICE)],
                             torch.tensor(1.0, device=DEVICE))


# ------------------------------------------------------------------------------------------- table cache

def test_table_cache_reuses_and_rebuilds(small_geometry):
    """Unchanged tensors reuse the device table (no build); new addresses, or a gradient going missing, build
    a new one, and the results follow the reference either way."""
    kw = dict(decoupled=True, weight_decay=0.01)
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    fast, ref = new_problem("adam", BF16, True, PARAMS), new_problem("adam", BF16, True, PARAMS)
    orc = new_problem("adam", BF16, True, PARAMS, oracle=True)
    tables = backend().step_tables
    grad_sets = grads_for(PARAMS, BF16, 5)
    fixed = [None if g is None else g.clone() for g in grad_sets[0]]
    builds = []
    for k, grads in enumerate(grad_sets):
        if k < 3:  # the same gradient tensors, refilled in place
            for f, g in zip(fixed, grads):
                if f is not None:
                    f.copy_(g)
            grads = fixed
        elif k == 4:  # a gradient goes missing
            grads = list(grads)
            grads[1] = None
        before = tables.builds
        run_step("adam", fast, grads, ops.norm_check(present(grads), inv, backend="triton"), inv, lr, kw, "triton")
        builds.append(tables.builds - before)
        run_step("adam", ref, grads, ops.norm_check(present(grads), inv, backend="reference"), inv, lr, kw,
                 "reference")
        run_step("adam", orc, grads, oracle_partials(grads, inv), inv.double(), lr.double(), kw, "oracle")
        assert_close_to_oracle(f"step {k} weights", weights(fast), weights(ref), weights(orc))
        assert_bitwise(f"step {k} steps", fast.steps, ref.steps)
    assert builds[1:] == [0, 0, 1, 1]
    # K1 reuses its table for the same list too
    before = backend().grad_tables.builds
    ops.norm_check(present(fixed), inv, backend="triton")
    ops.norm_check(present(fixed), inv, backend="triton")
    assert backend().grad_tables.builds == before


def test_the_tensor_table_follows_the_state_layout():
    s = new_problem("adam", BF16, True, PARAMS + [((3, 2), "transposed", True, 0)])
    (grads,) = grads_for(PARAMS + [((3, 2), "transposed", True, 0)], BF16, 1)
    rows, total = native_args.step_table(s.params, grads)
    offsets, want_total = state_layout([p.numel() for p in s.params])
    assert rows[3::4] == offsets == s.offsets and total == want_total
    assert rows[0::4] == [p.data_ptr() for p in s.params]
    assert rows[2::4] == [_native.NO_GRAD if g is None else p.numel() for p, g in zip(s.params, grads)]
    assert rows[1::4] == [0 if g is None else g.data_ptr() for g in grads]


def test_new_table_refused_while_capturing(monkeypatch):
    """While a CUDA graph is captured, a call with the tensors of the last eager call runs (its table is then
    kept for the graph's replays); one with other tensors raises instead of uploading a new table."""
    kw = dict(decoupled=True)
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    s = new_problem("adam", F32, False, PARAMS[:4])
    g1, g2 = grads_for(PARAMS[:4], F32, 2)
    partials = ops.norm_check(present(g1), inv, backend="triton")
    run_step("adam", s, g1, partials, inv, lr, kw, "triton")
    monkeypatch.setattr(importlib.import_module("ampfused.ops.triton"), "_capturing", lambda device: True)
    run_step("adam", s, g1, partials, inv, lr, kw, "triton")
    assert s.steps.tolist() == [2.0, 5.0, 2.0, 43.0]
    with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
        run_step("adam", s, g2, partials, inv, lr, kw, "triton")
    assert s.steps.tolist() == [2.0, 5.0, 2.0, 43.0]
    assert plan_of(s) in backend().step_tables._graph_plans.values()


def test_opcheck_steps():
    inv, lr = torch.tensor(0.5, device=DEVICE), torch.tensor(1e-2, device=DEVICE)
    specs = PARAMS[1:5]
    (grads,) = grads_for(specs, BF16, 1)
    partials = ops.norm_check(present(grads), inv, backend="triton")
    s = new_problem("adam", BF16, True, specs)
    torch.library.opcheck(torch.ops.ampfused.adam_step_.default,
                          (s.params, grads, s.master, *s.states, s.steps, partials, inv, lr, s.out, 0.9, 0.999, 1e-8,
                           0.01, 1.0, True, False, "triton", None, None))
    s = new_problem("sgd", BF16, True, specs)
    torch.library.opcheck(torch.ops.ampfused.sgd_step_.default,
                          (s.params, grads, s.master, *s.states, s.steps, partials, inv, lr, s.out, 0.9, 0.0, 0.0,
                           True, math.inf, False, "triton", None, None))


# ------------------------------------------------------------------------------ compiled kernels on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs a CUDA device: compiled kernels (the interpreter runs programs one by one)")
def test_every_program_reads_the_old_step():
    """1024 programs racing to the counter: a program reading an advanced step would take the momentum
    formula on a first step and read the NaN-filled buffer."""
    specs = [((1 << 23) + 3,), (5000,), (1,)]  # over 1024 chunks
    specs = [(shape, "contiguous", True, 0) for shape in specs]
    inv, lr = torch.tensor(1.0, device=DEVICE), torch.tensor(1e-2, device=DEVICE)
    (grads,) = grads_for(specs, F32, 1)
    partials = ops.norm_check(grads, inv, backend="triton")
    for trial in range(10):
        s = new_problem("sgd", F32, False, specs)
        run_step("sgd", s, grads, partials, inv, lr, dict(momentum=0.9), "triton")
        assert s.steps.tolist() == [1.0, 1.0, 1.0], f"trial {trial}"
        assert torch.isfinite(s.states[0]).all(), f"trial {trial}: a program saw steps != 0"
    assert backend()._counters[partials.device].item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs a CUDA device: compiled kernels")
def test_cuda_graph_replay_matches_eager():
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    (grads,) = grads_for(PARAMS, BF16, 1)
    graphed, eager = new_problem("adam", BF16, True, PARAMS), new_problem("adam", BF16, True, PARAMS)
    kw = dict(decoupled=True, weight_decay=0.01, max_norm=CLIP)

    def step(s):
        run_step("adam", s, grads, ops.norm_check(present(grads), inv, backend="triton"), inv, lr, kw, "triton")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, builds the tables, allocates the counter
        step(graphed)
        step(eager)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed)
    other_grads = [None if g is None else g.clone() for g in grads]  # new addresses: a table never uploaded
    partials = torch.tensor([[1.0], [0.0]], device=DEVICE)
    with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            run_step("adam", graphed, other_grads, partials, inv, lr, kw, "triton")
    backend().step_tables.clear()  # the captured tables stay alive for the graph
    for _ in range(3):
        graph.replay()
        step(eager)
    torch.cuda.synchronize()
    assert_same("graphed", snapshot(graphed) + [graphed.out], snapshot(eager) + [eager.out])
    assert graphed.steps.tolist() == [4.0, 7.0, 4.0, 45.0, 7.0, 5.0, 4.0]
