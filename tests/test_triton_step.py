"""Triton backend: K2 (adam_step_, sgd_step_) against the fp32 reference and an fp64 oracle.

The oracle is the reference run in fp64 (fp64 weights, states, partials, inv_scale, lr and step). Each case
runs several consecutive steps, fed with partials from the backend's own norm_check, and checks after every
step: master and states within the oracle rule, the model copy equal to the rounded master bit for bit,
the step count and out_stats; then that a second run reproduces every bit.
"""
import importlib
import math
import os
from types import SimpleNamespace

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference
from backends import TRITON_DEVICE, requires_triton
from oracle import assert_bitwise, assert_close_to_oracle

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = TRITON_DEVICE
pytestmark = requires_triton

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SCALE = 1024.0  # loss scale of the synthetic gradients; inv_scale = 1 / SCALE
N = 4099        # four full 1024-blocks and a partial one
CLIP = 20.0     # below the unscaled norm (~sqrt(N)): clipping is active

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


@pytest.fixture
def small_geometry(monkeypatch):
    """Tiny blocks and program caps: multi-block chunks, a masked tail, a prologue looping over partials."""
    monkeypatch.setattr(kernels("norm_check"), "BLOCK", 64)
    monkeypatch.setattr(kernels("norm_check"), "MAX_PROGRAMS", 8)
    for mod in ("adam", "sgd"):
        monkeypatch.setattr(kernels(mod), "BLOCK", 64)
        monkeypatch.setattr(kernels(mod), "MAX_PROGRAMS", 3)
        monkeypatch.setattr(kernels(mod), "PBLOCK", 4)


def new_state(kind, pdtype, has_master, n, dtype=None, device=DEVICE):
    """Param (+ master) and optimizer states; ``dtype`` forces every buffer to one dtype (the oracle)."""
    torch.manual_seed(1)
    w = torch.randn(n, device=device)
    param = w.to(pdtype).to(dtype or pdtype)  # the oracle starts from the same (rounded) weights
    master = param.float() if has_master and dtype is None else None
    cd = dtype or F32
    s = SimpleNamespace(param=param, master=master, step=torch.zeros((), dtype=cd, device=device),
                        out=torch.zeros(2, dtype=cd, device=device))
    if kind == "adam":
        s.states = [torch.zeros(n, dtype=cd, device=device), torch.zeros(n, dtype=cd, device=device)]
    else:
        s.states = [torch.full((n,), float("nan"), dtype=cd, device=device)]  # step 0 must not read it
    return s


def run_step(kind, s, grad, partials, inv_scale, lr, kw, backend):
    args = (s.param, grad, s.master, *s.states, s.step, partials, inv_scale, lr, s.out)
    if backend == "oracle":  # the reference called directly: fp64 everywhere, no dtype checks
        full = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_norm=math.inf, decoupled=False,
                    maximize=False) if kind == "adam" else dict(momentum=0.0, dampening=0.0, weight_decay=0.0,
                                                               nesterov=False, max_norm=math.inf, maximize=False)
        full.update(kw)
        fn = reference.adam_step_ if kind == "adam" else reference.sgd_step_
        fn(*args, **full)
    else:
        (ops.adam_step_ if kind == "adam" else ops.sgd_step_)(*args, **kw, backend=backend)


def oracle_partials(grad, inv_scale):
    u = grad.double() * inv_scale.double()
    return torch.stack([u.pow(2).sum(), (~torch.isfinite(grad).all()).double()]).reshape(2, 1)


def grads_for(n, gdtype, steps):
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    return [(torch.randn(n, generator=gen, device=DEVICE) * SCALE).to(gdtype) for _ in range(steps)]


def compute_copy(s):
    return s.master if s.master is not None else s.param


def run_case(kind, pdtype, gdtype, has_master, kw, n=N, steps=3):
    inv = torch.tensor(1 / SCALE, device=DEVICE)
    lr = torch.tensor(1e-3 if kind == "adam" else 1e-2, device=DEVICE)
    fast, fast2 = new_state(kind, pdtype, has_master, n), new_state(kind, pdtype, has_master, n)
    ref = new_state(kind, pdtype, has_master, n)
    orc = new_state(kind, pdtype, has_master, n, dtype=torch.float64)
    if kind == "sgd" and kw.get("momentum", 0) == 0:
        for s in (fast, fast2, ref, orc):
            s.states = [None]
    for i, g in enumerate(grads_for(n, gdtype, steps)):
        for s in (fast, fast2):
            run_step(kind, s, g, ops.norm_check([g], inv, backend="triton"), inv, lr, kw, "triton")
        run_step(kind, ref, g, ops.norm_check([g], inv, backend="reference"), inv, lr, kw, "reference")
        run_step(kind, orc, g, oracle_partials(g, inv), inv.double(), lr.double(), kw, "oracle")
        where = f"step {i + 1}"
        assert_close_to_oracle(f"{where} weights", compute_copy(fast), compute_copy(ref), orc.param)
        for j, st in enumerate(fast.states):
            if st is not None:
                assert_close_to_oracle(f"{where} state {j}", st, ref.states[j], orc.states[j])
        if has_master:
            assert_bitwise(f"{where} param = round(master)", fast.param, fast.master.to(pdtype))
        assert fast.step.item() == ref.step.item() == i + 1
        assert_close_to_oracle(f"{where} norm", fast.out[0], ref.out[0], orc.out[0])
        assert fast.out[1].item() == 0.0
    for name in ("param", "master", "step", "out"):
        if getattr(fast, name) is not None:
            assert_bitwise(f"rerun {name}", getattr(fast, name), getattr(fast2, name))
    for a, b in zip(fast.states, fast2.states):
        if a is not None:
            assert_bitwise("rerun state", a, b)
    assert ops.get_backend("triton")._counters[fast.param.device].item() == 0


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_matches_oracle(case):
    run_case("adam", *ADAM_CASES[case])


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_oracle(case):
    run_case("sgd", *SGD_CASES[case])


@pytest.mark.parametrize("kind,case", [("adam", "adamw-fp16-master-clip"), ("sgd", "sgd-nesterov-bf16-master")])
def test_chunked_grid_matches_oracle(small_geometry, kind, case):
    run_case(kind, *(ADAM_CASES if kind == "adam" else SGD_CASES)[case], n=1000, steps=2)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_skipped_step_changes_nothing(kind, bad):
    kw = dict(decoupled=True, weight_decay=0.1) if kind == "adam" else dict(momentum=0.9)
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    s = new_state(kind, BF16, True, N)
    g_ok, g_bad = grads_for(N, BF16, 2)
    run_step(kind, s, g_ok, ops.norm_check([g_ok], inv, backend="triton"), inv, lr, kw, "triton")
    g_bad[N - 1] = bad
    before = [t.clone() for t in (s.param, s.master, s.step, *s.states)]
    partials = ops.norm_check([g_bad], inv, backend="triton")
    run_step(kind, s, g_bad, partials, inv, lr, kw, "triton")
    for name, b, a in zip(("param", "master", "step", "state0", "state1"), before,
                          (s.param, s.master, s.step, *s.states)):
        assert_bitwise(f"skipped {name}", a, b)
    ref_norm, _ = reference.reduce_partials(reference.norm_check([g_bad], inv))
    assert s.out[1].item() == 1.0
    assert torch.equal(s.out[0].isnan(), ref_norm.isnan()) and (ref_norm.isnan() or s.out[0] == ref_norm)
    # a pre-reduced [[norm_sq], [flag]] also skips; then a good step counts from the unchanged step
    run_step(kind, s, g_ok, torch.tensor([[1.0], [1.0]], device=DEVICE), inv, lr, kw, "triton")
    assert_bitwise("skipped again", s.master, before[1])
    run_step(kind, s, g_ok, ops.norm_check([g_ok], inv, backend="triton"), inv, lr, kw, "triton")
    assert s.step.item() == 2.0 and not torch.equal(s.master, before[1])


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_partials_layouts(kind):
    """Partials from several buffers, pre-reduced, or strided give the same step (bitwise where the
    partials hold the same numbers)."""
    kw = dict(decoupled=False, weight_decay=0.01, max_norm=CLIP) if kind == "adam" else dict(momentum=0.5)
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    (g,) = grads_for(N, F16, 1)
    split = ops.norm_check([g[:1000], g[1000:]], inv, backend="triton")  # views of one flat gradient
    reduced = torch.stack([split[0].sum(), split[1].amax()]).reshape(2, 1)
    strided = torch.zeros(split.shape[1], 3, device=DEVICE)[:, :2].t()
    strided.copy_(split)
    results = []
    for partials in (split, strided, reduced):
        s = new_state(kind, BF16, True, N)
        run_step(kind, s, g, partials, inv, lr, kw, "triton")
        results.append(s)
    assert_bitwise("strided partials", results[1].master, results[0].master)
    ref = new_state(kind, BF16, True, N)
    run_step(kind, ref, g, reference.norm_check([g], inv), inv, lr, kw, "reference")
    orc = new_state(kind, BF16, True, N, dtype=torch.float64)
    run_step(kind, orc, g, oracle_partials(g, inv), inv.double(), lr.double(), kw, "oracle")
    for s in (results[0], results[2]):
        assert_close_to_oracle("weights", s.master, ref.master, orc.param)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_empty_buffer_and_dtypes_of_scalars(kind):
    inv = torch.tensor(1.0, device=DEVICE)
    s = new_state(kind, F32, False, 0)
    run_step(kind, s, torch.zeros(0, device=DEVICE), torch.tensor([[4.0], [0.0]], device=DEVICE), inv,
             torch.tensor(0.1, device=DEVICE), {}, "triton")
    assert s.step.item() == 1.0 and s.out.tolist() == [2.0, 0.0]
    # an fp64 lr is read as fp32, exactly as the reference does
    (g,) = grads_for(300, F32, 1)
    a, b = new_state(kind, F32, False, 300), new_state(kind, F32, False, 300)
    for st, lr in ((a, torch.tensor(1e-3, device=DEVICE)), (b, torch.tensor(1e-3, device=DEVICE).double())):
        run_step(kind, st, g, ops.norm_check([g], inv, backend="triton"), inv, lr, {}, "triton")
    assert_bitwise("fp64 lr", a.param, b.param)
    b.step = b.step.double()
    with pytest.raises(TypeError, match="step must be float32"):
        ops.get_backend("triton").adam_step_(b.param, g, None, *([torch.zeros(300, device=DEVICE)] * 2), b.step,
                                             torch.zeros(2, 1, device=DEVICE), inv, inv, b.out, 0.9, 0.999,
                                             1e-8, 0.0, math.inf, True)


def test_opcheck_steps():
    n = 37
    inv, lr = torch.tensor(0.5, device=DEVICE), torch.tensor(1e-2, device=DEVICE)
    g = torch.randn(n, device=DEVICE).to(BF16)
    partials = ops.norm_check([g], inv, backend="triton")

    def fresh():
        return (torch.randn(n, device=DEVICE).to(BF16), torch.randn(n, device=DEVICE), torch.zeros(n, device=DEVICE),
                torch.zeros(n, device=DEVICE), torch.zeros((), device=DEVICE), torch.zeros(2, device=DEVICE))
    p, m, s1, s2, step, out = fresh()
    torch.library.opcheck(torch.ops.ampfused.adam_step_.default,
                          (p, g, m, s1, s2, step, partials, inv, lr, out, 0.9, 0.999, 1e-8, 0.01, 1.0, True,
                           False, "triton"))
    p, m, s1, _, step, out = fresh()
    torch.library.opcheck(torch.ops.ampfused.sgd_step_.default,
                          (p, g, m, s1, step, partials, inv, lr, out, 0.9, 0.0, 0.0, True, math.inf, False,
                           "triton"))


# ------------------------------------------------------------------------------ compiled kernels on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs compiled kernels (the interpreter runs programs one by one)")
def test_every_program_reads_the_old_step():
    """1024 programs racing to the counter: a program reading the new step would take the momentum formula
    on the first step and read the NaN-filled buffer."""
    n = (1 << 22) + 3
    inv, lr = torch.tensor(1.0, device=DEVICE), torch.tensor(1e-2, device=DEVICE)
    g = torch.randn(n, device=DEVICE)
    partials = ops.norm_check([g], inv, backend="triton")
    for trial in range(20):
        s = new_state("sgd", F32, False, n)
        run_step("sgd", s, g, partials, inv, lr, dict(momentum=0.9), "triton")
        assert s.step.item() == 1.0, f"trial {trial}"
        assert torch.isfinite(s.states[0]).all(), f"trial {trial}: a program saw step != 0"
    assert ops.get_backend("triton")._counters[g.device].item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs compiled kernels")
def test_cuda_graph_replay_matches_eager():
    n = 10007
    inv, lr = torch.tensor(1 / SCALE, device=DEVICE), torch.tensor(1e-3, device=DEVICE)
    (g,) = grads_for(n, BF16, 1)
    graphed, eager = new_state("adam", BF16, True, n), new_state("adam", BF16, True, n)
    kw = dict(decoupled=True, weight_decay=0.01, max_norm=CLIP)

    def step(s):
        run_step("adam", s, g, ops.norm_check([g], inv, backend="triton"), inv, lr, kw, "triton")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, allocates the step counter
        step(graphed)
        step(eager)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed)
    for _ in range(3):
        graph.replay()
        step(eager)
    torch.cuda.synchronize()
    for name in ("param", "master", "step", "out"):
        assert_bitwise(f"graphed {name}", getattr(graphed, name), getattr(eager, name))
    assert graphed.step.item() == 4.0
