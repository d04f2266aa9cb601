"""The native ``cpu`` backend against the reference (the specification).

Values follow the oracle rule of tests/oracle.py: the fp64 oracle is the reference run with fp64 master
weights and states. The helpers take ``device`` and ``backend`` so tests/test_cuda_backend.py runs the same
checks on CUDA.
"""
import math
import os

import pytest
import torch

from ampfused import _native, ops
from ampfused.ops import reference as R
from oracle import assert_bitwise, assert_close_to_oracle

if os.environ.get("AMPFUSED_SKIP_NATIVE_BUILD") == "1":
    pytest.skip("native modules not built (AMPFUSED_SKIP_NATIVE_BUILD=1)", allow_module_level=True)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (grad dtype, param dtype, has fp32 master)
DTYPE_CASES = [(BF16, BF16, True), (F16, F16, True), (F32, F32, False), (F32, BF16, True), (BF16, F32, True)]
ADAM_CONFIGS = {
    "adamw-clip": dict(decoupled=True, weight_decay=0.01, max_norm=0.5),
    "adam-l2": dict(decoupled=False, weight_decay=0.01, max_norm=math.inf),
    "adamw-maximize": dict(decoupled=True, weight_decay=0.0, max_norm=math.inf, maximize=True),
    "adam-beta1-0.3-clip": dict(decoupled=False, weight_decay=0.0, max_norm=0.5, beta1=0.3),
}
SGD_CONFIGS = {
    "plain": dict(momentum=0.0),
    "momentum-dampening-wd-clip": dict(momentum=0.9, dampening=0.1, weight_decay=0.01, max_norm=0.5),
    "nesterov-maximize": dict(momentum=0.9, nesterov=True, maximize=True),
}
LOSS_SCALE = 1024.0


def _native_partials(grads, inv, backend):
    return ops.norm_check(grads, inv, backend=backend)


def _oracle_partials(grad, inv):
    u = grad.double() * inv.double()
    return torch.stack([(u * u).sum().reshape(1), (~torch.isfinite(grad).all()).double().reshape(1)])


def make_state(n, gdt, pdt, has_master, device, seed=0):
    """Three copies (fast, ref32, ref64) of one problem; states start nonzero like a run in progress."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen, dtype=torch.float64)
    m = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3
    v = torch.rand(n, generator=gen, dtype=torch.float64) * 1e-6
    copies = []
    for cd in (F32, F32, torch.float64):
        master = w.to(cd) if has_master else None
        param = (w.to(pdt) if has_master else w.to(cd)).to(device)
        s = dict(param=param, master=None if master is None else master.to(device),
                 step=torch.tensor(0.0, device=device), s1=m.to(cd).to(device), s2=v.to(cd).to(device))
        if cd == torch.float64 and not has_master:
            s["param"] = w.to(device)
        copies.append(s)
    return copies


def run_and_compare(device, backend, n, gdt, pdt, has_master, opt, cfg, steps=3, step_dtype=F32, seed=0):
    fast, ref32, ref64 = make_state(n, gdt, pdt, has_master, device, seed)
    fast["step"] = fast["step"].to(step_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    inv = torch.tensor(1.0 / LOSS_SCALE, device=device)
    lr = torch.tensor(1e-3, device=device)
    cfg = dict(cfg)
    for k in range(steps):
        grad = (torch.randn(n, generator=gen) * 1e-2 * LOSS_SCALE).to(gdt).to(device)
        out = [torch.zeros(2, device=device), torch.zeros(2, device=device), torch.zeros(2, dtype=torch.float64,
                                                                                      device=device)]
        parts = [_native_partials([grad], inv, backend), R.norm_check([grad], inv), _oracle_partials(grad, inv)]
        for s, p, o, be in zip((fast, ref32, ref64), parts, out, (backend, None, None)):
            w = s["master"] if has_master else None
            if opt == "adam":
                kw = dict(beta1=cfg.get("beta1", 0.9), beta2=0.999, eps=1e-8, weight_decay=cfg["weight_decay"],
                          max_norm=cfg["max_norm"], decoupled=cfg["decoupled"], maximize=cfg.get("maximize", False))
                if be:
                    ops.adam_step_(s["param"], grad, w, s["s1"], s["s2"], s["step"], p, inv, lr, o, backend=be, **kw)
                else:
                    R.adam_step_(s["param"], grad, w, s["s1"], s["s2"], s["step"], p, inv, lr, o, *kw.values())
            else:
                kw = dict(momentum=cfg["momentum"], dampening=cfg.get("dampening", 0.0),
                          weight_decay=cfg.get("weight_decay", 0.0), nesterov=cfg.get("nesterov", False),
                          max_norm=cfg.get("max_norm", math.inf), maximize=cfg.get("maximize", False))
                buf = s["s1"] if cfg["momentum"] else None
                if be:
                    ops.sgd_step_(s["param"], grad, w, buf, s["step"], p, inv, lr, o, backend=be, **kw)
                else:
                    R.sgd_step_(s["param"], grad, w, buf, s["step"], p, inv, lr, o, *kw.values())
        where = f"step {k}"
        assert_close_to_oracle(f"norm ({where})", out[0][0], out[1][0], out[2][0])
        assert out[0][1].item() == 0.0
        wf = fast["master"] if has_master else fast["param"]
        w32 = ref32["master"] if has_master else ref32["param"]
        w64 = ref64["master"] if has_master else ref64["param"]
        assert_close_to_oracle(f"weights ({where})", wf, w32, w64)
        if opt == "adam" or cfg["momentum"]:
            assert_close_to_oracle(f"exp_avg/momentum ({where})", fast["s1"], ref32["s1"], ref64["s1"])
        if opt == "adam":
            assert_close_to_oracle(f"exp_avg_sq ({where})", fast["s2"], ref32["s2"], ref64["s2"])
        if has_master:  # the model copy is the rounded master, bit for bit
            assert_bitwise(f"param ({where})", fast["param"], fast["master"].to(pdt))
        assert fast["step"].item() == k + 1
    return fast


@pytest.mark.parametrize("gdt,pdt,has_master", DTYPE_CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(ADAM_CONFIGS), ids=str)
def test_adam_matches_reference(gdt, pdt, has_master, cfg):
    run_and_compare("cpu", "cpu", 4099, gdt, pdt, has_master, "adam", ADAM_CONFIGS[cfg])


@pytest.mark.parametrize("gdt,pdt,has_master", DTYPE_CASES[:3], ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(SGD_CONFIGS), ids=str)
def test_sgd_matches_reference(gdt, pdt, has_master, cfg):
    run_and_compare("cpu", "cpu", 4099, gdt, pdt, has_master, "sgd", SGD_CONFIGS[cfg])


@pytest.mark.parametrize("n", [1, 127, 65537])
def test_awkward_sizes_step(n):
    run_and_compare("cpu", "cpu", n, BF16, BF16, True, "adam", ADAM_CONFIGS["adamw-clip"], steps=2)
    run_and_compare("cpu", "cpu", n, F16, F32, False if n == 1 else True, "sgd",
                    SGD_CONFIGS["momentum-dampening-wd-clip"], steps=2)


def test_fp64_step_counter():
    run_and_compare("cpu", "cpu", 300, BF16, BF16, True, "adam", ADAM_CONFIGS["adamw-clip"], step_dtype=torch.float64)


# ---- K1: norm_check / unscale_ ------------------------------------------------------------------------

def awkward_grads(device):
    gen = torch.Generator().manual_seed(3)
    big = [(torch.randn(n, generator=gen) * 300).to(dt) for n, dt in ((1, F32), (127, BF16), (65537, F16))]
    tiny = [(torch.randn(i % 7, generator=gen) * 300).to((F32, BF16, F16)[i % 3]) for i in range(300)]
    strided = [(torch.randn(40, 33, generator=gen) * 300).to(BF16).t(),
               (torch.randn(5000, generator=gen) * 300)[::3]]
    return [g.to(device) for g in big + tiny] + [s.to(device) for s in strided]


def check_norm_check(device, backend):
    grads = awkward_grads(device)
    inv = torch.tensor(1 / 512, device=device)
    p = ops.norm_check(grads, inv, backend=backend)
    assert p.shape == (2, ops.num_partials([g.numel() for g in grads], device=device, backend=backend))
    norm, found = R.reduce_partials(p)
    n32, _ = R.reduce_partials(R.norm_check(grads, inv))
    n64 = sum(float((g.double() * inv.double()).pow(2).sum()) for g in grads) ** 0.5
    assert_close_to_oracle("norm", norm, n32, torch.tensor(n64, dtype=torch.float64))
    assert found.item() == 0.0
    assert_bitwise("partials run to run", p, ops.norm_check(grads, inv, backend=backend))
    # a non-finite element anywhere sets the flag; a finite one whose square overflows does not
    for bad, flagged in ((float("inf"), 1.0), (float("nan"), 1.0), (3e38, 0.0)):
        g = [x.clone() for x in grads]
        g[2 if bad != 3e38 else 0].view(-1)[-1] = bad  # grads[0] is fp32: 3e38 stays finite
        norm, found = R.reduce_partials(ops.norm_check(g, inv, backend=backend))
        assert found.item() == flagged
        assert not math.isfinite(norm.item())


def check_unscale(device, backend):
    grads = awkward_grads(device)
    grads[2].view(-1)[7] = float("nan")
    ref = [g.clone() for g in grads]
    inv = torch.tensor(1 / 3.0, device=device)
    p = ops.unscale_(grads, inv, backend=backend)
    pr = R.unscale_(ref, inv)
    for i, (a, b) in enumerate(zip(grads, ref)):
        fin = ~torch.isnan(b)
        assert torch.equal(torch.isnan(a), ~fin), f"grads[{i}]: NaN placement"
        assert_bitwise(f"grads[{i}]", a[fin], b[fin])
    assert R.reduce_partials(p)[1].item() == 1.0 == R.reduce_partials(pr)[1].item()


def test_norm_check():
    check_norm_check("cpu", "cpu")


def test_unscale():
    check_unscale("cpu", "cpu")


def check_conversions(device, backend):
    """Every fp16/bf16 bit pattern through unscale_ (16-bit -> fp32 -> x inv_scale -> round), and crafted fp32
    masters (ties, subnormals, overflow) rounded into the model copy, bit for bit against torch."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dt in (F16, BF16):
        for inv in (1.0, 1 / 3, 2.0**-14, 3.0):
            g = bits.view(dt).to(device)
            ref = g.clone()
            ops.unscale_([g], torch.tensor(inv, device=device), backend=backend)
            R.unscale_([ref], torch.tensor(inv, device=device))
            nan = torch.isnan(ref)
            assert torch.equal(torch.isnan(g), nan), f"{dt} x {inv}: NaN placement"
            assert_bitwise(f"{dt} x {inv}", g[~nan], ref[~nan])
    gen = torch.Generator().manual_seed(7)
    ulps = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64).to(torch.int32).view(F32)
    special = torch.tensor([0.5 * 2**-24, 1.5 * 2**-24, 2**-25, 65504.0, 65520.0, 65519.99, 1e-40, -0.0, 3.4e38,
                            1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 2**-149, 6.1e-5, 5.96e-8])
    masters = torch.cat([ulps[torch.isfinite(ulps)], special, -special, torch.randn(1000, generator=gen)])
    masters = torch.cat([masters, torch.zeros((-masters.numel()) % 8)])
    for pdt in (F16, BF16):
        param, master = torch.zeros(masters.numel(), dtype=pdt, device=device), masters.clone().to(device)
        zero = torch.zeros(masters.numel(), device=device)
        ops.sgd_step_(param, zero.to(pdt), master, None, torch.tensor(0.0, device=device),
                      torch.zeros(2, 1, device=device), torch.tensor(1.0, device=device),
                      torch.tensor(0.0, device=device), torch.zeros(2, device=device), backend=backend)
        assert_bitwise(f"fp32 -> {pdt}", param, masters.to(device).to(pdt))


def test_conversions_bitwise():
    check_conversions("cpu", "cpu")


# ---- skipped steps, determinism ---------------------------------------------------------------------------

def snapshot(*ts):
    return [t.clone() for t in ts if t is not None]


def check_skip(device, backend, opt):
    n = 1000
    fast, _, _ = make_state(n, BF16, BF16, True, device)
    grad = torch.randn(n, device=device).to(BF16)
    grad[17] = float("nan")
    inv, lr, out = torch.tensor(1.0, device=device), torch.tensor(1e-3, device=device), torch.zeros(2, device=device)
    before = snapshot(fast["param"], fast["master"], fast["s1"], fast["s2"], fast["step"])
    p = ops.norm_check([grad], inv, backend=backend)
    if opt == "adam":
        ops.adamw_step_(fast["param"], grad, fast["master"], fast["s1"], fast["s2"], fast["step"], p, inv, lr, out,
                        backend=backend)
    else:
        ops.sgd_step_(fast["param"], grad, fast["master"], fast["s1"], fast["step"], p, inv, lr, out, momentum=0.9,
                      backend=backend)
    after = snapshot(fast["param"], fast["master"], fast["s1"], fast["s2"], fast["step"])
    for i, (a, b) in enumerate(zip(before, after)):
        assert_bitwise(f"tensor {i} after a skipped step", a, b)
    assert out[1].item() == 1.0


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_skipped_step_changes_nothing(opt):
    check_skip("cpu", "cpu", opt)


def one_step(device, backend, n, threads=None):
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        fast, _, _ = make_state(n, BF16, BF16, True, device)
        grad = (torch.randn(n, generator=torch.Generator().manual_seed(5)) * 10).to(BF16).to(device)
        inv, lr, out = (torch.tensor(0.5, device=device), torch.tensor(1e-3, device=device),
                        torch.zeros(2, device=device))
        p = ops.norm_check([grad], inv, backend=backend)
        ops.adamw_step_(fast["param"], grad, fast["master"], fast["s1"], fast["s2"], fast["step"], p, inv, lr, out,
                        max_norm=1.0, backend=backend)
        return [p, out, fast["param"], fast["master"], fast["s1"], fast["s2"]]
    finally:
        torch.set_num_threads(old)


def test_bitwise_across_threads_runs_and_isas():
    n = 200_003  # 13 chunks
    base = one_step("cpu", "cpu", n, threads=1)
    runs = [one_step("cpu", "cpu", n, threads=2), one_step("cpu", "cpu", n, threads=2)]
    mod = _native.module("cpu")
    current = mod.isa()
    try:
        for isa in mod.supported_isas():
            mod.set_isa(isa)
            runs.append(one_step("cpu", "cpu", n, threads=2))
    finally:
        mod.set_isa(current)
    for run in runs:
        for i, (a, b) in enumerate(zip(base, run)):
            assert_bitwise(f"output {i}", a, b)


# ---- scale update ---------------------------------------------------------------------------------------------

def check_update_scale(device, backend):
    cases = [(65536.0, 0, 0.0), (65536.0, 1, 0.0), (65536.0, 1, 1.0), (3.3e-5, 1, 0.0), (3.0e38, 1, 0.0),
             (1.0e-38, 0, 1.0), (12345.678, 5, 0.0)]
    for gf, bf in ((2.0, 0.5), (1.5, 0.7)):
        for scale, tracker, inf in cases:
            args = [(torch.tensor(scale, device=device), torch.tensor(tracker, dtype=torch.int32, device=device),
                     torch.tensor(inf, device=device)) for _ in range(2)]
            ops.update_scale_(*args[0], gf, bf, 2, backend=backend)
            R.update_scale_(*args[1], gf, bf, 2)
            assert_bitwise(f"scale {scale} x {gf}/{bf}", args[0][0], args[1][0])
            assert_bitwise(f"tracker {tracker}", args[0][1], args[1][1])


def test_update_scale_bitwise():
    check_update_scale("cpu", "cpu")


# ---- bad input is rejected in Python, before any kernel runs ----------------------------------------------

def step_tensors(device, n=64, gdt=BF16):
    base = dict(param=torch.zeros(n, dtype=BF16, device=device), grad=torch.ones(n, dtype=gdt, device=device),
                master=torch.zeros(n, device=device), exp_avg=torch.zeros(n, device=device),
                exp_avg_sq=torch.zeros(n, device=device), step=torch.tensor(0.0, device=device),
                partials=torch.tensor([[1.0], [0.0]], device=device), inv_scale=torch.tensor(1.0, device=device),
                lr=torch.tensor(0.1, device=device), out_stats=torch.zeros(2, device=device))
    return base


def misaligned(t):
    buf = torch.zeros(t.numel() + 8, dtype=t.dtype, device=t.device)
    return buf[1:t.numel() + 1]


BAD_INPUTS = {
    "grad wrong dtype": (dict(grad=lambda t, d: torch.ones(64, dtype=torch.int32, device=d)), TypeError, "grad must"),
    "grad fp64": (dict(grad=lambda t, d: torch.ones(64, dtype=torch.float64, device=d)), TypeError, "grad must have"),
    "param not contiguous": (dict(param=lambda t, d: torch.zeros(128, dtype=BF16, device=d)[::2]), ValueError,
                             "param must be contiguous"),
    "exp_avg wrong size": (dict(exp_avg=lambda t, d: torch.zeros(63, device=d)), ValueError,
                           "exp_avg must have 64 elements"),
    "exp_avg_sq wrong dtype": (dict(exp_avg_sq=lambda t, d: torch.zeros(64, dtype=BF16, device=d)), TypeError,
                               "exp_avg_sq must have dtype"),
    "master misaligned": (dict(master=lambda t, d: misaligned(t)), ValueError, "master must start at a 16-byte"),
    "grad misaligned": (dict(grad=lambda t, d: misaligned(t)), ValueError, "grad must start at a 16-byte"),
    "param 2-d": (dict(param=lambda t, d: torch.zeros(8, 8, dtype=BF16, device=d)), ValueError, "param must be a 1-D"),
    "partials shape": (dict(partials=lambda t, d: torch.zeros(3, device=d)), ValueError, "partials must have shape"),
    "lr on meta": (dict(lr=lambda t, d: torch.tensor(0.1, device="meta")), ValueError, "lr must be on"),
    "step int": (dict(step=lambda t, d: torch.tensor(0, device=d)), TypeError, "step must have dtype"),
    "bf16 param without master": (dict(master=lambda t, d: None), ValueError, "master"),
    "grad aliases master": (dict(grad=lambda t, d: None), ValueError, "overlap"),
}


def check_bad_inputs(device, backend_obj):
    for case, (change, exc, msg) in BAD_INPUTS.items():
        t = step_tensors(device)
        for k, f in change.items():
            t[k] = f(t[k], device)
        if case == "grad aliases master":
            t["grad"] = t["master"]
        before = snapshot(*[v for v in t.values() if v is not None and v.device.type != "meta"])
        with pytest.raises(exc, match=msg):
            backend_obj.adam_step_(t["param"], t["grad"], t["master"], t["exp_avg"], t["exp_avg_sq"], t["step"],
                                   t["partials"], t["inv_scale"], t["lr"], t["out_stats"], 0.9, 0.999, 1e-8, 0.0,
                                   math.inf, True)
        after = snapshot(*[v for v in t.values() if v is not None and v.device.type != "meta"])
        for a, b in zip(before, after):
            assert_bitwise(f"{case}: state after a rejected call", a, b)
    inv = torch.tensor(1.0, device=device)
    with pytest.raises(TypeError, match=r"grads\[1\] must have dtype"):
        backend_obj.norm_check([torch.ones(3, device=device), torch.ones(3, dtype=torch.int64, device=device)], inv)
    with pytest.raises(TypeError, match="grads must be a list"):
        backend_obj.unscale_(torch.ones(3, device=device), inv)
    with pytest.raises(TypeError, match="inv_scale must have dtype"):
        backend_obj.norm_check([torch.ones(3, device=device)], inv.double())
    with pytest.raises(TypeError, match="growth_tracker must have dtype"):
        backend_obj.update_scale_(inv.clone(), torch.tensor(0, device=device), torch.tensor(0.0, device=device),
                                  2.0, 0.5, 10)


def test_bad_input_rejected_before_kernels():
    check_bad_inputs("cpu", ops.get_backend("cpu"))


# ---- torch.library ---------------------------------------------------------------------------------------------

def check_opcheck(device, backend):
    t = step_tensors(device, n=40)
    grads = [torch.randn(5, device=device), torch.randn(7, device=device).to(BF16)]
    inv = torch.tensor(0.5, device=device)
    o = torch.ops.ampfused
    torch.library.opcheck(o.norm_check.default, (grads, inv, backend))
    torch.library.opcheck(o.unscale_.default, ([g.clone() for g in grads], inv, backend))
    torch.library.opcheck(o.update_scale_.default, (torch.tensor(4.0, device=device),
                                                    torch.tensor(0, dtype=torch.int32, device=device),
                                                    torch.tensor(0.0, device=device), 2.0, 0.5, 1, backend))
    torch.library.opcheck(o.adam_step_.default, (t["param"], t["grad"], t["master"], t["exp_avg"], t["exp_avg_sq"],
                                                 t["step"], t["partials"], t["inv_scale"], t["lr"], t["out_stats"],
                                                 0.9, 0.999, 1e-8, 0.01, 1.0, True, False, backend))
    torch.library.opcheck(o.sgd_step_.default, (t["param"], t["grad"], t["master"], t["exp_avg"], t["step"],
                                                t["partials"], t["inv_scale"], t["lr"], t["out_stats"], 0.9, 0.0,
                                                0.01, True, 1.0, False, backend))


def test_opcheck():
    check_opcheck("cpu", "cpu")


# ---- 64-bit sizes --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_norm_check_over_2_31_elements():
    n = 2**31 + 17
    try:
        g = torch.zeros(n, dtype=BF16)
    except RuntimeError as e:  # out of memory on this machine
        pytest.skip(f"cannot allocate a {n * 2 / 2**30:.1f} GiB buffer: {e}")
    try:
        g[2**31 - 3] = 4.0
        g[-1] = 3.0
        inv = torch.tensor(1.0)
        p = ops.norm_check([g], inv, backend="cpu")
        chunk = _native.module("cpu").CHUNK
        assert p.shape[1] == -(-n // chunk)
        norm, found = R.reduce_partials(p)
        assert norm.item() == 5.0 and found.item() == 0.0
        assert p[0, (2**31 - 3) // chunk].item() == 16.0 and p[0, -1].item() == 9.0
        g[2**31 + 2] = float("inf")
        p = ops.norm_check([g], inv, backend="cpu")
        assert p[1].nonzero().flatten().tolist() == [(2**31 + 2) // chunk]
    finally:
        del g
