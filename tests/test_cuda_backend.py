"""The native ``cuda`` backend: the checks of tests/test_cpu_backend.py on CUDA tensors (one parameter and
many: awkward sizes, channels_last, transposed and misaligned views, gradients that are None, per-parameter
step counts), single launch against the two-kernel path (bitwise), the device-side tensor table cache, and CUDA
graph capture of whole steps. Skipped without a CUDA device."""
import math

import pytest
import torch

import test_cpu_backend as T
import test_cpu_backend_errors as E
from ampfused import _native, ops
from ampfused.ops import cuda as cuda_ops
from ampfused.ops import reference as R
from oracle import assert_bitwise

pytestmark = pytest.mark.gpu
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DEV = "cuda"


@pytest.fixture(autouse=True)
def _cuda_backend_usable():
    if _native.build_info("cuda") is None:
        pytest.skip(f"ampfused._C_cuda not built: {_native.unavailable_reason('cuda')}")
    reasons = ops.registry.reasons_for("cuda", torch.device(DEV))
    assert not reasons, reasons


def chunk():
    return _native.module("cuda").STEP_CHUNK


@pytest.mark.parametrize("gdt,pdt,has_master", T.DTYPE_CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(T.ADAM_CONFIGS), ids=str)
def test_adam_matches_reference(gdt, pdt, has_master, cfg):
    T.run_and_compare(DEV, "cuda", T.single(40_009), gdt, pdt, has_master, "adam", T.ADAM_CONFIGS[cfg], legacy=True)


@pytest.mark.parametrize("gdt,pdt,has_master", T.DTYPE_CASES[:3], ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(T.SGD_CONFIGS), ids=str)
def test_sgd_matches_reference(gdt, pdt, has_master, cfg):
    T.run_and_compare(DEV, "cuda", T.single(40_009), gdt, pdt, has_master, "sgd", T.SGD_CONFIGS[cfg], legacy=True)


@pytest.mark.parametrize("gdt,pdt,has_master", T.DTYPE_CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(T.ADAM_CONFIGS), ids=str)
def test_adam_many_tensors(gdt, pdt, has_master, cfg):
    T.run_and_compare(DEV, "cuda", T.MULTI, gdt, pdt, has_master, "adam", T.ADAM_CONFIGS[cfg])


@pytest.mark.parametrize("gdt,pdt,has_master", T.DTYPE_CASES[:3], ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(T.SGD_CONFIGS), ids=str)
def test_sgd_many_tensors(gdt, pdt, has_master, cfg):
    T.run_and_compare(DEV, "cuda", T.MULTI, gdt, pdt, has_master, "sgd", T.SGD_CONFIGS[cfg])


def test_more_chunks_than_resident_blocks():
    # blocks loop over several chunks, of one parameter and across parameters, with different step counts
    big = [((chunk() * 1500 + 5,), "plain", True, 3), ((chunk() * 3,), "offset", True, 0)]
    specs = T.MULTI + big + T.MULTI[:4]
    T.run_and_compare(DEV, "cuda", specs, BF16, BF16, True, "adam", T.ADAM_CONFIGS["adamw-clip"], steps=2)
    T.run_and_compare(DEV, "cuda", specs, F32, F32, False, "sgd", T.SGD_CONFIGS["momentum-dampening-wd-clip"],
                      steps=2)


@pytest.mark.parametrize("n", [1, 7, 127, 16_383, 16_384, 16_385, 65537, 3_000_017])
def test_awkward_sizes_step(n):
    T.run_and_compare(DEV, "cuda", T.single(n), BF16, BF16, True, "adam", T.ADAM_CONFIGS["adamw-clip"], steps=2)
    T.run_and_compare(DEV, "cuda", T.single(n), F16, F32, n != 1, "sgd", T.SGD_CONFIGS["momentum-dampening-wd-clip"],
                      steps=2)


def test_fp64_step_counts():
    T.run_and_compare(DEV, "cuda", T.single(300), BF16, BF16, True, "adam", T.ADAM_CONFIGS["adamw-clip"],
                      step_dtype=torch.float64, legacy=True)
    T.run_and_compare(DEV, "cuda", T.MULTI, BF16, BF16, True, "adam", T.ADAM_CONFIGS["adamw-clip"],
                      step_dtype=torch.float64, steps=2)


def test_no_active_parameters():
    T.check_no_active_parameters(DEV, "cuda")


def test_norm_check():
    T.check_norm_check(DEV, "cuda")


def test_norm_check_misaligned_views():
    # views at odd element offsets take the one-element path; same sums as an aligned copy
    base = (torch.randn(100_003, device=DEV) * 100).to(BF16)
    inv = torch.tensor(0.25, device=DEV)
    for off in (1, 3, 7):
        view = base[off:]
        a = ops.norm_check([view], inv, backend="cuda")
        b = ops.norm_check([view.clone()], inv, backend="cuda")
        assert_bitwise(f"offset {off}", a, b)


def test_norm_check_reads_dense_tensors_in_memory_order():
    g = (torch.randn(8, 64, 33, 17, device=DEV) * 100).to(BF16).contiguous(memory_format=torch.channels_last)
    inv = torch.tensor(0.5, device=DEV)
    a = ops.norm_check([g], inv, backend="cuda")
    b = ops.norm_check([R.memory_view(g).clone()], inv, backend="cuda")
    assert_bitwise("channels_last vs its memory order", a, b)


def test_unscale():
    T.check_unscale(DEV, "cuda")


def test_conversions_bitwise():
    T.check_conversions(DEV, "cuda")


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_skipped_step_changes_nothing(opt):
    T.check_skip(DEV, "cuda", opt)
    T.check_skip(DEV, "cuda", opt, T.MULTI)


def test_bitwise_run_to_run():
    n = 5_000_011
    a, b = T.one_step(DEV, "cuda", n), T.one_step(DEV, "cuda", n)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bitwise(f"output {i}", x, y)


def test_update_scale_bitwise():
    T.check_update_scale(DEV, "cuda")


def test_bad_input_rejected_before_kernels():
    E.check_bad_inputs(DEV, "cuda")


def test_direct_backend_calls_checked_before_kernels():
    """The backend's own checks (calls that bypass ampfused.ops): what would make a kernel touch wrong memory."""
    b = ops.get_backend("cuda")

    def call(**change):
        t = E.step_tensors(DEV)
        t.update(change)
        b.adam_step_(t["params"], t["grads"], t["master"], t["exp_avg"], t["exp_avg_sq"], t["steps"], t["partials"],
                     t["inv_scale"], t["lr"], t["out_stats"], 0.9, 0.999, 1e-8, 0.0, math.inf, True)

    t = E.step_tensors(DEV)
    with pytest.raises(ValueError, match="steps must be on a CUDA device"):
        call(steps=torch.zeros(2))
    with pytest.raises(TypeError, match="params must be a list"):
        call(params=t["params"][0], grads=t["grads"][0], steps=torch.zeros(1, device=DEV))
    with pytest.raises(ValueError, match="one entry per parameter"):
        call(steps=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="exp_avg must be a contiguous 1-D flat buffer of 128 elements"):
        call(exp_avg=torch.zeros(64, device=DEV))
    with pytest.raises(ValueError, match="master must be on"):
        call(master=torch.zeros(128))
    with pytest.raises(ValueError, match="out_stats must be on"):
        call(out_stats=torch.zeros(2))
    with pytest.raises(ValueError, match="partials must be on"):
        call(partials=torch.zeros(2, 1))
    before = cuda_ops.stats["uploads"]
    with pytest.raises(ValueError, match=r"params\[1\] must be on"):  # a new table: every tensor is checked
        call(params=[t["params"][0], torch.zeros(8, 8, dtype=BF16)])
    with pytest.raises(ValueError, match=r"grads\[0\] .* must have the shape and memory layout"):
        call(grads=[torch.ones(63, dtype=BF16, device=DEV), t["grads"][1]])
    assert cuda_ops.stats["uploads"] == before  # nothing reached the device


def test_opcheck():
    E.check_opcheck(DEV, "cuda")


# ---- single launch ------------------------------------------------------------------------------------------

def backend_step(s, grads, partials, out, opt, cfg, inv, lr, single_launch):
    """A step through the backend object (the single_launch option is not part of ampfused.ops)."""
    b = ops.get_backend("cuda")
    if opt == "adam":
        b.adam_step_(s["params"], grads, s["master"], s["s1"], s["s2"], s["steps"], partials, inv, lr, out,
                     *T.adam_kw(cfg).values(), single_launch=single_launch)
    else:
        kw = T.sgd_kw(cfg)
        b.sgd_step_(s["params"], grads, s["master"], s["s1"] if kw["momentum"] else None, s["steps"], partials, inv,
                    lr, out, *kw.values(), single_launch=single_launch)


def num_partials_of(grads):
    return ops.num_partials([g.numel() for g in grads if g is not None], device=DEV, backend="cuda")


def compare_problems(a, b, where):
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert_bitwise(f"params[{i}] ({where})", x, y)
    for key in ("master", "s1", "s2", "steps"):
        if a[key] is not None:
            assert_bitwise(f"{key} ({where})", a[key], b[key])


@pytest.mark.parametrize("opt", ["adam", "sgd"])
@pytest.mark.parametrize("n", [1, 1000, 3_000_017])
def test_single_launch_equals_two_kernels(opt, n):
    specs = T.MULTI + T.single(n)
    two, _, _ = T.make_problem(specs, BF16, True, DEV)
    one, _, _ = T.make_problem(specs, BF16, True, DEV)
    inv, lr = torch.tensor(1 / 64, device=DEV), torch.tensor(1e-3, device=DEV)
    cfg = T.ADAM_CONFIGS["adamw-clip"] if opt == "adam" else T.SGD_CONFIGS["momentum-dampening-wd-clip"]
    gen = torch.Generator().manual_seed(4)
    for k in range(3):
        grads = T.make_grads(specs, BF16, DEV, gen, scale=64.0)
        if k == 1:
            R.memory_view(grads[-1])[n // 2] = float("inf")  # a skipped step on both paths
        p2 = ops.norm_check([g for g in grads if g is not None], inv, backend="cuda")
        o2, o1 = torch.zeros(2, device=DEV), torch.zeros(2, device=DEV)
        backend_step(two, grads, p2, o2, opt, cfg, inv, lr, False)
        p1 = torch.full((2, num_partials_of(grads)), float("nan"), device=DEV)
        backend_step(one, grads, p1, o1, opt, cfg, inv, lr, True)
        assert_bitwise(f"partials (step {k})", p1, p2)
        assert_bitwise(f"out_stats (step {k})", o1, o2)
        compare_problems(one, two, f"step {k}")
    assert two["steps"].tolist() == [s[3] + 2 * s[2] for s in specs]


def test_single_launch_without_active_parameters():
    for specs in ([], [((5,), "plain", False, 1), ((0,), "plain", True, 2)]):
        s, _, _ = T.make_problem(specs, BF16, True, DEV)
        grads = [None if not sp[2] else torch.zeros(sp[0], dtype=BF16, device=DEV) for sp in specs]
        out = torch.full((2,), -1.0, device=DEV)
        backend_step(s, grads, torch.zeros(2, 0, device=DEV), out, "adam", T.ADAM_CONFIGS["adamw-clip"],
                     torch.tensor(1.0, device=DEV), torch.tensor(1e-3, device=DEV), True)
        assert out.tolist() == [0.0, 0.0]
        assert s["steps"].tolist() == [sp[3] + sp[2] for sp in specs]  # the empty parameter's count advances


def test_single_launch_rejects_wrong_partials():
    s, _, _ = T.make_problem(T.MULTI, BF16, True, DEV)
    grads = T.make_grads(T.MULTI, BF16, DEV, torch.Generator().manual_seed(0))
    want = num_partials_of(grads)
    for bad in (torch.zeros(2, 5, device=DEV), torch.zeros(2, want + 1, device=DEV),
                torch.zeros(want, 2, device=DEV).t()):
        with pytest.raises(ValueError, match=rf"partials must be a contiguous \[2, {want}\] tensor"):
            backend_step(s, grads, bad, torch.zeros(2, device=DEV), "adam", T.ADAM_CONFIGS["adamw-clip"],
                         torch.tensor(1.0, device=DEV), torch.tensor(0.1, device=DEV), True)


# ---- the device-side tensor table ---------------------------------------------------------------------------

def test_table_reused_while_addresses_stay():
    specs = T.MULTI
    fast, ref, _ = T.make_problem(specs, BF16, True, DEV)
    gen = torch.Generator().manual_seed(9)
    grads = T.make_grads(specs, BF16, DEV, gen)
    inv, lr = torch.tensor(1 / 1024, device=DEV), torch.tensor(1e-3, device=DEV)
    cfg = T.ADAM_CONFIGS["adamw-clip"]
    uploads = []
    for k in range(4):
        if k == 2:  # new gradient tensors (new addresses): a new table, still the right results
            grads = T.make_grads(specs, BF16, DEV, gen)
        elif k == 3:  # a parameter that had a gradient has none now: a new table
            grads = list(grads)
            grads[1] = None
        else:  # refilled in place: the same table
            for g, new in zip(grads, T.make_grads(specs, BF16, DEV, gen)):
                if g is not None:
                    g.copy_(new)
        active = [g for g in grads if g is not None]
        out, out_ref = torch.zeros(2, device=DEV), torch.zeros(2, device=DEV)
        before = cuda_ops.stats["uploads"]
        T.call_step(fast, grads, ops.norm_check(active, inv, backend="cuda"), out, "adam", cfg, inv, lr, "cuda")
        uploads.append(cuda_ops.stats["uploads"] - before)
        T.call_step(ref, grads, R.norm_check(active, inv), out_ref, "adam", cfg, inv, lr)
        torch.testing.assert_close(fast["master"], ref["master"], rtol=1e-5, atol=1e-7, equal_nan=True)
        torch.testing.assert_close(fast["s2"], ref["s2"], rtol=1e-5, atol=1e-12, equal_nan=True)
        assert fast["steps"].tolist() == ref["steps"].tolist()
    assert uploads[1] == 0 and uploads[2] == 1 and uploads[3] == 1, uploads


def test_changed_table_during_capture_is_an_error():
    s, _, _ = T.make_problem(T.MULTI, BF16, True, DEV)
    grads = T.make_grads(T.MULTI, BF16, DEV, torch.Generator().manual_seed(2))
    inv, lr = torch.tensor(1.0, device=DEV), torch.tensor(1e-3, device=DEV)
    parts = torch.zeros(2, num_partials_of(grads), device=DEV)
    out = torch.zeros(2, device=DEV)
    cfg = T.ADAM_CONFIGS["adamw-clip"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up with these very tensors
        backend_step(s, grads, parts, out, "adam", cfg, inv, lr, True)
    torch.cuda.current_stream().wait_stream(side)
    other = list(grads)
    other[2] = other[2].clone()  # one new address
    before = [t.clone() for t in s["params"]] + [s["master"].clone(), s["steps"].clone()]
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
        with torch.cuda.graph(g):
            backend_step(s, other, parts, out, "adam", cfg, inv, lr, True)
    torch.cuda.synchronize()
    after = [t.clone() for t in s["params"]] + [s["master"].clone(), s["steps"].clone()]
    for i, (a, b) in enumerate(zip(before, after)):
        assert_bitwise(f"tensor {i} after the refused capture", a, b)
    g = torch.cuda.CUDAGraph()  # the tensors of the warm-up: captured fine
    with torch.cuda.graph(g):
        backend_step(s, grads, parts, out, "adam", cfg, inv, lr, True)
    g.replay()
    torch.cuda.synchronize()
    assert s["steps"].tolist() == [sp[3] + 2 * sp[2] for sp in T.MULTI]


# ---- CUDA graphs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("single_launch", [False, True])
def test_graph_capture_of_a_step(single_launch):
    """K1 + step + scale update captured once and replayed: same bits as running them eagerly."""
    specs = T.MULTI + T.single(100_003)
    inv, lr = torch.tensor(1 / 8, device=DEV), torch.tensor(1e-3, device=DEV)
    cfg = T.ADAM_CONFIGS["adamw-clip"]

    def scaler():
        return torch.tensor(8.0, device=DEV), torch.tensor(0, dtype=torch.int32, device=DEV)

    def step(state, grads, out, p, sc):
        if not single_launch:
            p = ops.norm_check([g for g in grads if g is not None], inv, backend="cuda")
        backend_step(state, grads, p, out, "adam", cfg, inv, lr, single_launch)
        ops.update_scale_(sc[0], sc[1], out[1], 2.0, 0.5, 2, backend="cuda")

    graphed, _, _ = T.make_problem(specs, BF16, True, DEV)
    eager, _, _ = T.make_problem(specs, BF16, True, DEV)
    static_grads = T.make_grads(specs, BF16, DEV, torch.Generator().manual_seed(1), scale=0.0)
    np_ = num_partials_of(static_grads)
    static_out, static_partials = torch.zeros(2, device=DEV), torch.zeros(2, np_, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up with the tensors to capture, away from the default stream
        step(graphed, static_grads, static_out, static_partials, scaler())
        step(eager, static_grads, torch.zeros(2, device=DEV), torch.zeros(2, np_, device=DEV), scaler())
    torch.cuda.current_stream().wait_stream(side)

    sc_graph, sc_eager = scaler(), scaler()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(graphed, static_grads, static_out, static_partials, sc_graph)
    gen = torch.Generator().manual_seed(2)
    for k in range(4):
        grads = T.make_grads(specs, BF16, DEV, gen, scale=8.0)
        if k == 2:
            R.memory_view(grads[5])[5] = float("nan")
        for s, new in zip(static_grads, grads):
            if s is not None:
                s.copy_(new)
        g.replay()
        out_e = torch.zeros(2, device=DEV)
        step(eager, grads, out_e, torch.zeros(2, np_, device=DEV), sc_eager)
        torch.cuda.synchronize()
        assert_bitwise(f"out_stats (replay {k})", static_out, out_e)
        compare_problems(graphed, eager, f"replay {k}")
        assert_bitwise(f"scale (replay {k})", sc_graph[0], sc_eager[0])
    assert graphed["steps"].tolist() == [s[3] + 4 * s[2] for s in specs]  # warm-up + 3 replays not skipped
    ref = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32)
    for found in (0.0, 0.0, 1.0, 0.0):
        R.update_scale_(*ref, torch.tensor(found), 2.0, 0.5, 2)
    assert sc_graph[0].item() == ref[0].item() and sc_graph[1].item() == ref[1].item()


# ---- 64-bit sizes ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_step_over_2_31_elements():
    n = 2**31 + 17
    try:
        p = torch.zeros(n, device=DEV)
        g = torch.zeros(n, dtype=BF16, device=DEV)
    except torch.cuda.OutOfMemoryError as e:
        pytest.skip(f"cannot allocate {n * 6 / 2**30:.1f} GiB on the device: {e}")
    try:
        idx = torch.tensor([0, 2**31 - 3, 2**31, 2**31 + 5, n - 1], device=DEV)
        vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], device=DEV)
        g[idx] = vals.to(BF16)
        steps = torch.zeros(1, device=DEV)
        inv, lr = torch.tensor(1.0, device=DEV), torch.tensor(0.5, device=DEV)
        b = ops.get_backend("cuda")
        for single_launch in (False, True):
            out = torch.zeros(2, device=DEV)
            parts = (torch.zeros(2, num_partials_of([g]), device=DEV) if single_launch
                     else ops.norm_check([g], inv, backend="cuda"))
            b.sgd_step_([p], [g], None, None, steps, parts, inv, lr, out, 0.0, 0.0, 0.0, False, math.inf, False,
                        single_launch=single_launch)
            assert abs(out[0].item() - math.sqrt(55.0)) < 1e-5 and out[1].item() == 0.0
        assert steps.item() == 2.0
        assert p[idx].tolist() == (-vals).tolist()  # two steps of -0.5 * g
        assert int(p.count_nonzero()) == 5
    finally:
        del p, g
