"""The native ``cuda`` backend: the checks of tests/test_cpu_backend.py on CUDA tensors, plus single launch
against the two-kernel path (bitwise) and CUDA graph capture of whole steps. Skipped without a CUDA device."""
import math

import pytest
import torch

import test_cpu_backend as T
from ampfused import _native, ops
from ampfused.ops import reference as R
from oracle import assert_bitwise

pytestmark = pytest.mark.gpu
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _cuda_backend_usable():
    if _native.build_info("cuda") is None:
        pytest.skip(f"ampfused._C_cuda not built: {_native.unavailable_reason('cuda')}")
    reasons = ops.registry.reasons_for("cuda", torch.device("cuda"))
    assert not reasons, reasons


@pytest.mark.parametrize("gdt,pdt,has_master", T.DTYPE_CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(T.ADAM_CONFIGS), ids=str)
def test_adam_matches_reference(gdt, pdt, has_master, cfg):
    T.run_and_compare("cuda", "cuda", 40_009, gdt, pdt, has_master, "adam", T.ADAM_CONFIGS[cfg])


@pytest.mark.parametrize("gdt,pdt,has_master", T.DTYPE_CASES[:3], ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(T.SGD_CONFIGS), ids=str)
def test_sgd_matches_reference(gdt, pdt, has_master, cfg):
    T.run_and_compare("cuda", "cuda", 40_009, gdt, pdt, has_master, "sgd", T.SGD_CONFIGS[cfg])


@pytest.mark.parametrize("n", [1, 7, 127, 65537, 3_000_017])
def test_awkward_sizes_step(n):
    T.run_and_compare("cuda", "cuda", n, BF16, BF16, True, "adam", T.ADAM_CONFIGS["adamw-clip"], steps=2)
    T.run_and_compare("cuda", "cuda", n, F16, F32, n != 1, "sgd", T.SGD_CONFIGS["momentum-dampening-wd-clip"], steps=2)


def test_fp64_step_counter():
    T.run_and_compare("cuda", "cuda", 300, BF16, BF16, True, "adam", T.ADAM_CONFIGS["adamw-clip"],
                      step_dtype=torch.float64)


def test_norm_check():
    T.check_norm_check("cuda", "cuda")


def test_norm_check_misaligned_views():
    # views at odd element offsets take the one-element path; same sums as an aligned copy
    base = (torch.randn(100_003, device="cuda") * 100).to(BF16)
    inv = torch.tensor(0.25, device="cuda")
    for off in (1, 3, 7):
        view = base[off:]
        a = ops.norm_check([view], inv, backend="cuda")
        b = ops.norm_check([view.clone()], inv, backend="cuda")
        assert_bitwise(f"offset {off}", a, b)


def test_unscale():
    T.check_unscale("cuda", "cuda")


def test_conversions_bitwise():
    T.check_conversions("cuda", "cuda")


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_skipped_step_changes_nothing(opt):
    T.check_skip("cuda", "cuda", opt)


def test_bitwise_run_to_run():
    n = 5_000_011
    a, b = T.one_step("cuda", "cuda", n), T.one_step("cuda", "cuda", n)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bitwise(f"output {i}", x, y)


def test_update_scale_bitwise():
    T.check_update_scale("cuda", "cuda")


def test_bad_input_rejected_before_kernels():
    T.check_bad_inputs("cuda", ops.get_backend("cuda"))
    t = T.step_tensors("cuda")
    with pytest.raises(ValueError, match="must be on"):
        ops.get_backend("cuda").adam_step_(t["param"], t["grad"], t["master"], t["exp_avg"], t["exp_avg_sq"],
                                           torch.tensor(0.0), t["partials"], t["inv_scale"], t["lr"], t["out_stats"],
                                           0.9, 0.999, 1e-8, 0.0, math.inf, True)


def test_opcheck():
    T.check_opcheck("cuda", "cuda")


# ---- single launch ------------------------------------------------------------------------------------------

def _step(state, grad, partials, opt, single_launch, inv, lr, out):
    b = ops.get_backend("cuda")
    if opt == "adam":
        b.adam_step_(state["param"], grad, state["master"], state["s1"], state["s2"], state["step"], partials, inv, lr,
                     out, 0.9, 0.999, 1e-8, 0.01, 1.0, True, False, single_launch=single_launch)
    else:
        b.sgd_step_(state["param"], grad, state["master"], state["s1"], state["step"], partials, inv, lr, out, 0.9,
                    0.0, 0.01, True, 1.0, False, single_launch=single_launch)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
@pytest.mark.parametrize("n", [1, 1000, 3_000_017])
def test_single_launch_equals_two_kernels(opt, n):
    two, _, _ = T.make_state(n, BF16, BF16, True, "cuda")
    one, _, _ = T.make_state(n, BF16, BF16, True, "cuda")
    inv, lr = torch.tensor(1 / 64, device="cuda"), torch.tensor(1e-3, device="cuda")
    for k in range(3):
        grad = (torch.randn(n, device="cuda") * 64).to(BF16)
        if k == 1:
            grad[n // 2] = float("inf")  # a skipped step on both paths
        p2 = ops.norm_check([grad], inv, backend="cuda")
        o2, o1 = torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda")
        _step(two, grad, p2, opt, False, inv, lr, o2)
        p1 = torch.full_like(p2, float("nan"))
        _step(one, grad, p1, opt, True, inv, lr, o1)
        assert_bitwise(f"partials (step {k})", p1, p2)
        assert_bitwise(f"out_stats (step {k})", o1, o2)
        for key in ("param", "master", "s1", "s2", "step"):
            assert_bitwise(f"{key} (step {k})", one[key], two[key])
    assert two["step"].item() == 2.0


def test_single_launch_rejects_wrong_partials():
    s, _, _ = T.make_state(1000, BF16, BF16, True, "cuda")
    grad = torch.randn(1000, device="cuda").to(BF16)
    with pytest.raises(ValueError, match="partials must be a contiguous"):
        _step(s, grad, torch.zeros(2, 5, device="cuda"), "adam", True, torch.tensor(1.0, device="cuda"),
              torch.tensor(0.1, device="cuda"), torch.zeros(2, device="cuda"))


# ---- CUDA graphs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("single_launch", [False, True])
def test_graph_capture_of_a_step(single_launch):
    """K1 + step + scale update captured once and replayed: same bits as running them eagerly."""
    n = 100_003
    inv, lr = torch.tensor(1 / 8, device="cuda"), torch.tensor(1e-3, device="cuda")
    np_ = ops.num_partials([n], device="cuda", backend="cuda")

    def scaler():
        return torch.tensor(8.0, device="cuda"), torch.tensor(0, dtype=torch.int32, device="cuda")

    def step(state, grad, out, p, sc):
        if not single_launch:
            p = ops.norm_check([grad], inv, backend="cuda")
        _step(state, grad, p, "adam", single_launch, inv, lr, out)
        ops.update_scale_(sc[0], sc[1], out[1], 2.0, 0.5, 2, backend="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up away from the default stream, as torch.cuda.graph expects
        warm, _, _ = T.make_state(n, BF16, BF16, True, "cuda")
        step(warm, torch.zeros(n, dtype=BF16, device="cuda"), torch.zeros(2, device="cuda"),
             torch.zeros(2, np_, device="cuda"), scaler())
    torch.cuda.current_stream().wait_stream(side)

    graphed, _, _ = T.make_state(n, BF16, BF16, True, "cuda")
    eager, _, _ = T.make_state(n, BF16, BF16, True, "cuda")
    static_grad, static_out = torch.zeros(n, dtype=BF16, device="cuda"), torch.zeros(2, device="cuda")
    static_partials, sc_graph, sc_eager = torch.zeros(2, np_, device="cuda"), scaler(), scaler()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(graphed, static_grad, static_out, static_partials, sc_graph)
    for k in range(4):
        grad = (torch.randn(n, device="cuda") * 8).to(BF16)
        if k == 2:
            grad[5] = float("nan")
        static_grad.copy_(grad)
        g.replay()
        out_e = torch.zeros(2, device="cuda")
        step(eager, grad, out_e, torch.zeros(2, np_, device="cuda"), sc_eager)
        torch.cuda.synchronize()
        assert_bitwise(f"out_stats (replay {k})", static_out, out_e)
        for key in ("param", "master", "s1", "s2", "step"):
            assert_bitwise(f"{key} (replay {k})", graphed[key], eager[key])
        assert_bitwise(f"scale (replay {k})", sc_graph[0], sc_eager[0])
    assert graphed["step"].item() == 3.0
    ref = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32)
    for found in (0.0, 0.0, 1.0, 0.0):
        R.update_scale_(*ref, torch.tensor(found), 2.0, 0.5, 2)
    assert sc_graph[0].item() == ref[0].item() and sc_graph[1].item() == ref[1].item()
