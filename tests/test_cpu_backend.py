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

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
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
GAP = float("nan")  # what the flat state buffers hold between parameters: no step may read or write it

# ---- problems: parameters where they live, flat state, three copies (fast, fp32 reference, fp64 oracle) ----
#
# A parameter is (shape, layout, has a gradient, initial step count). Layouts: "plain" (row-major),
# "channels_last", "transposed" (a 2-D .t()), "offset" (parameter and gradient are views one element into a
# larger buffer: misaligned for 128-bit access), "grad_offset" (only the gradient is such a view).

MULTI = [((0,), "plain", True, 0), ((1,), "plain", True, 3), ((7,), "plain", True, 0), ((127,), "offset", True, 1),
         ((16385,), "plain", True, 5), ((70001,), "plain", True, 0), ((3, 5, 7, 11), "channels_last", True, 2),
         ((300,), "plain", False, 4), ((33, 40), "transposed", True, 0), ((4099,), "grad_offset", True, 7),
         ((129,), "offset", False, 0)]


def single(n):
    return [((n,), "plain", True, 0)]


def placed(values, shape, layout, device):
    """A tensor of ``shape`` laid out as ``layout`` whose elements in memory order are ``values`` (1-D)."""
    n, dtype = values.numel(), values.dtype
    if layout == "channels_last":
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    elif layout == "transposed":
        t = torch.empty(shape[::-1], dtype=dtype, device=device).t()
    elif layout == "offset":
        t = torch.empty(n + 8, dtype=dtype, device=device)[1:n + 1].view(shape)
    else:
        t = torch.empty(shape, dtype=dtype, device=device)
    R.memory_view(t).copy_(values.to(device))
    return t


def grad_layout(layout):
    return "offset" if layout == "grad_offset" else layout


def param_layout(layout):
    return "plain" if layout == "grad_offset" else layout


def make_problem(specs, pdt, has_master, device, seed=0, step_dtype=F32):
    """Three copies (fast, ref32, ref64) of one problem: dicts with params (list), master, s1, s2 (flat buffers
    laid out by state_layout, gaps holding GAP) and steps ([T]). States start nonzero like a run in progress."""
    numels = [math.prod(s[0]) for s in specs]
    offsets, total = R.state_layout(numels)
    gen = torch.Generator().manual_seed(seed)
    w, m, v = (torch.full((total,), GAP, dtype=F64) for _ in range(3))
    for off, n in zip(offsets, numels):
        w[off:off + n] = torch.randn(n, generator=gen, dtype=F64)
        m[off:off + n] = torch.randn(n, generator=gen, dtype=F64) * 1e-3
        v[off:off + n] = torch.rand(n, generator=gen, dtype=F64) * 1e-6
    copies = []
    for k, cd in enumerate((F32, F32, F64)):
        pd = pdt if has_master else cd
        params = [placed(w[off:off + n].to(pd), s[0], param_layout(s[1]), device)
                  for s, off, n in zip(specs, offsets, numels)]
        copies.append(dict(params=params, master=w.to(cd).to(device) if has_master else None, s1=m.to(cd).to(device),
                           s2=v.to(cd).to(device),
                           steps=torch.tensor([float(s[3]) for s in specs], dtype=step_dtype if k == 0 else F32,
                                              device=device)))
    return copies


def make_grads(specs, gdt, device, gen, scale=1e-2 * LOSS_SCALE):
    """One gradient per parameter with its layout (None where the spec says so), values in memory order."""
    grads = []
    for shape, layout, has_grad, _ in specs:
        if not has_grad:
            grads.append(None)
            continue
        vals = torch.randn(math.prod(shape), generator=gen) * scale
        grads.append(placed(vals.to(gdt), shape, grad_layout(layout), device))
    return grads


def oracle_partials(grads, inv):
    """[[sum of squares], [found_inf]] in fp64 over the gradients that are not None."""
    s, bad = torch.zeros((), dtype=F64), 0.0
    for g in grads:
        if g is not None:
            u = g.double().cpu() * inv.double().cpu()
            s = s + (u * u).sum()
            bad = max(bad, float(not torch.isfinite(g).all()))
    return torch.tensor([[s.item()], [bad]], dtype=F64, device=inv.device)


def adam_kw(cfg):
    return dict(beta1=cfg.get("beta1", 0.9), beta2=0.999, eps=1e-8, weight_decay=cfg.get("weight_decay", 0.0),
                max_norm=cfg.get("max_norm", math.inf), decoupled=cfg.get("decoupled", True),
                maximize=cfg.get("maximize", False))


def sgd_kw(cfg):
    return dict(momentum=cfg.get("momentum", 0.0), dampening=cfg.get("dampening", 0.0),
                weight_decay=cfg.get("weight_decay", 0.0), nesterov=cfg.get("nesterov", False),
                max_norm=cfg.get("max_norm", math.inf), maximize=cfg.get("maximize", False))


def call_step(s, grads, partials, out, opt, cfg, inv, lr, backend=None, legacy=False):
    """One step of copy ``s``: through ampfused.ops with ``backend``, else the reference. ``legacy`` uses the
    single-tensor spelling of the ops (one parameter, its gradient, a 0-d step count)."""
    params, steps = s["params"], s["steps"]
    if legacy and backend:
        assert len(params) == 1
        params, grads, steps = params[0], grads[0], steps[0]  # steps[0]: a 0-d view, advanced in place
    if opt == "adam":
        kw = adam_kw(cfg)
        if backend:
            ops.adam_step_(params, grads, s["master"], s["s1"], s["s2"], steps, partials, inv, lr, out,
                           backend=backend, **kw)
        else:
            R.adam_step_(params, grads, s["master"], s["s1"], s["s2"], steps, partials, inv, lr, out, *kw.values())
    else:
        kw = sgd_kw(cfg)
        buf = s["s1"] if kw["momentum"] else None
        if backend:
            ops.sgd_step_(params, grads, s["master"], buf, steps, partials, inv, lr, out, backend=backend, **kw)
        else:
            R.sgd_step_(params, grads, s["master"], buf, steps, partials, inv, lr, out, *kw.values())


def flat_names(opt, cfg, has_master):
    names = ["master"] if has_master else []
    if opt == "adam" or sgd_kw(cfg)["momentum"]:
        names.append("s1")
    if opt == "adam":
        names.append("s2")
    return names


def snapshot_inactive(s, grads):
    """Copies of what a step must leave alone: the parameters without a gradient, their state slices (every
    flat buffer, gaps included: the gaps hold NaN, compared bit for bit) and their step counts."""
    offsets, _ = R.state_layout([p.numel() for p in s["params"]])
    out = {}
    for i, (p, g) in enumerate(zip(s["params"], grads)):
        if g is None:
            sl = slice(offsets[i], offsets[i] + p.numel())
            out[i] = [p.clone(), s["steps"][i].clone()] + [s[k][sl].clone() for k in ("master", "s1", "s2")
                                                           if s[k] is not None]
    return out


def check_inactive(s, grads, before, where):
    after = snapshot_inactive(s, grads)
    for i in before:
        for k, (a, b) in enumerate(zip(before[i], after[i])):
            assert_bitwise(f"params[{i}] has no gradient: tensor {k} ({where})", a, b)


def run_and_compare(device, backend, specs, gdt, pdt, has_master, opt, cfg, steps=3, step_dtype=F32, seed=0,
                    legacy=False):
    """``steps`` steps of the fast backend and of the fp32 and fp64 references on the same problem, compared
    after each step by the oracle rule; parameters without a gradient stay bit for bit."""
    fast, ref32, ref64 = make_problem(specs, pdt, has_master, device, seed, step_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    inv = torch.tensor(1.0 / LOSS_SCALE, device=device)
    lr = torch.tensor(1e-3, device=device)
    offsets, _ = R.state_layout([math.prod(s[0]) for s in specs])
    for k in range(steps):
        grads = make_grads(specs, gdt, device, gen)
        active = [g for g in grads if g is not None]
        out = [torch.full((2,), -1.0, device=device), torch.zeros(2, device=device),
               torch.zeros(2, dtype=F64, device=device)]
        parts = [ops.norm_check(active, inv, backend=backend), R.norm_check(active, inv), oracle_partials(active, inv)]
        before = snapshot_inactive(fast, grads)
        steps_before = fast["steps"].clone()
        for s, p, o, be in zip((fast, ref32, ref64), parts, out, (backend, None, None)):
            call_step(s, grads, p, o, opt, cfg, inv, lr, be, legacy)
        where = f"step {k}"
        assert_close_to_oracle(f"norm ({where})", out[0][0], out[1][0], out[2][0])
        assert out[0][1].item() == 0.0
        for name in flat_names(opt, cfg, has_master):
            assert_close_to_oracle(f"{name} ({where})", fast[name], ref32[name], ref64[name])
        for i, (pf, p32, p64) in enumerate(zip(fast["params"], ref32["params"], ref64["params"])):
            if has_master:  # the model copy is the rounded master, bit for bit
                sl = slice(offsets[i], offsets[i] + pf.numel())
                assert_bitwise(f"params[{i}] ({where})", R.memory_view(pf), fast["master"][sl].to(pdt))
            else:
                assert_close_to_oracle(f"params[{i}] ({where})", R.memory_view(pf), R.memory_view(p32),
                                       R.memory_view(p64))
        check_inactive(fast, grads, before, where)
        advanced = torch.tensor([float(g is not None) for g in grads], dtype=step_dtype, device=device)
        assert_bitwise(f"steps ({where})", fast["steps"], steps_before + advanced)
    return fast


@pytest.mark.parametrize("gdt,pdt,has_master", DTYPE_CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(ADAM_CONFIGS), ids=str)
def test_adam_matches_reference(gdt, pdt, has_master, cfg):
    run_and_compare("cpu", "cpu", single(4099), gdt, pdt, has_master, "adam", ADAM_CONFIGS[cfg], legacy=True)


@pytest.mark.parametrize("gdt,pdt,has_master", DTYPE_CASES[:3], ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(SGD_CONFIGS), ids=str)
def test_sgd_matches_reference(gdt, pdt, has_master, cfg):
    run_and_compare("cpu", "cpu", single(4099), gdt, pdt, has_master, "sgd", SGD_CONFIGS[cfg], legacy=True)


@pytest.mark.parametrize("gdt,pdt,has_master", DTYPE_CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", ["adamw-clip", "adam-l2"], ids=str)
def test_adam_many_tensors(gdt, pdt, has_master, cfg):
    run_and_compare("cpu", "cpu", MULTI, gdt, pdt, has_master, "adam", ADAM_CONFIGS[cfg])


@pytest.mark.parametrize("gdt,pdt,has_master", DTYPE_CASES[:3], ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("cfg", list(SGD_CONFIGS), ids=str)
def test_sgd_many_tensors(gdt, pdt, has_master, cfg):
    # steps differ per parameter: the momentum buffer starts (steps[i] == 0) for some parameters only
    run_and_compare("cpu", "cpu", MULTI, gdt, pdt, has_master, "sgd", SGD_CONFIGS[cfg])


@pytest.mark.parametrize("n", [1, 127, 65537])
def test_awkward_sizes_step(n):
    run_and_compare("cpu", "cpu", single(n), BF16, BF16, True, "adam", ADAM_CONFIGS["adamw-clip"], steps=2)
    run_and_compare("cpu", "cpu", single(n), F16, F32, n != 1, "sgd", SGD_CONFIGS["momentum-dampening-wd-clip"],
                    steps=2)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
@pytest.mark.parametrize("pdt", [BF16, F16], ids=str)
def test_streamed_model_copy(opt, pdt):
    """Steps over at least STREAM_ELEMENTS elements write the model copy with streaming stores: the same bits
    (the copy is the rounded master), for parameters at any alignment (a head and a tail around whole lines)
    and for the small parameters of the same step."""
    n = _native.module("cpu").STREAM_ELEMENTS
    specs = MULTI + [((n // 2 + 3,), "offset", True, 0), ((n // 2 + 61,), "plain", True, 1)]
    cfg = ADAM_CONFIGS["adamw-clip"] if opt == "adam" else SGD_CONFIGS["momentum-dampening-wd-clip"]
    run_and_compare("cpu", "cpu", specs, F32 if pdt == BF16 else pdt, pdt, True, opt, cfg, steps=2)


def test_fp64_step_counts():
    run_and_compare("cpu", "cpu", single(300), BF16, BF16, True, "adam", ADAM_CONFIGS["adamw-clip"], step_dtype=F64,
                    legacy=True)
    run_and_compare("cpu", "cpu", MULTI, BF16, BF16, True, "adam", ADAM_CONFIGS["adamw-clip"], step_dtype=F64, steps=2)


def check_no_active_parameters(device, backend):
    """No parameters, or none with a gradient: out_stats is still written, nothing else changes."""
    specs = [((5,), "plain", False, 2), ((0,), "plain", False, 0), ((40,), "plain", False, 1)]
    for opt in ("adam", "sgd"):
        for sp in (specs, []):
            fast, _, _ = make_problem(sp, BF16, True, device)
            grads = [None] * len(sp)
            before = snapshot_inactive(fast, grads)
            flat = [fast[k].clone() for k in ("master", "s1", "s2")]
            inv, lr = torch.tensor(0.5, device=device), torch.tensor(1e-3, device=device)
            out = torch.full((2,), -1.0, device=device)
            partials = torch.tensor([[9.0, 16.0], [0.0, 0.0]], device=device)
            call_step(fast, grads, partials, out, opt, SGD_CONFIGS["momentum-dampening-wd-clip"]
                      if opt == "sgd" else ADAM_CONFIGS["adamw-clip"], inv, lr, backend)
            assert out.tolist() == [5.0, 0.0]
            check_inactive(fast, grads, before, f"{opt}, {len(sp)} parameters")
            for a, k in zip(flat, ("master", "s1", "s2")):
                assert_bitwise(f"{k} ({opt}, {len(sp)} parameters)", a, fast[k])


def test_no_active_parameters():
    check_no_active_parameters("cpu", "cpu")


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


def test_bf16_flags_at_every_position_and_isa():
    """bf16 chunks take their non-finite flag from the raw bits (16-bit lanes of the vectors): every inf and NaN
    pattern flags its own chunk only, the largest finite values do not, wherever the element sits (first
    vector, whole blocks, a later chunk, the tail), and every instruction set gives the same partials."""
    mod = _native.module("cpu")
    chunk = mod.CHUNK
    n = 2 * chunk + 1000 + 77  # two whole chunks, then whole blocks of 128 and a tail
    patterns = [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81, 0x7F7F, 0xFF7F]  # +-inf, NaNs, +-largest finite
    positions = [0, 31, 32, 127, chunk + 200, 2 * chunk + 640, n - 1]
    base = torch.randn(n, generator=torch.Generator().manual_seed(9)).to(BF16)
    inv = torch.tensor(1 / 64)
    current = mod.isa()
    try:
        for pattern in patterns:
            for pos in positions:
                g = base.clone()
                g.view(torch.int16)[pos] = pattern - 0x10000 if pattern >= 0x8000 else pattern
                expected = torch.zeros(-(-n // chunk))
                if pattern & 0x7FFF >= 0x7F80:
                    expected[pos // chunk] = 1.0
                outs = []
                for isa in mod.supported_isas():
                    mod.set_isa(isa)
                    outs.append(ops.norm_check([g], inv, backend="cpu"))
                    assert torch.equal(outs[-1][1], expected), f"{isa}: bits {pattern:#06x} at {pos}"
                for isa, p in zip(mod.supported_isas()[1:], outs[1:]):
                    assert_bitwise(f"{isa} partials, bits {pattern:#06x} at {pos}", outs[0], p)
    finally:
        mod.set_isa(current)


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
                            1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 2**-149, 6.1e-5, 5.96e-8,
                            float("inf"), 3.3895314e38, 3.3961775e38])  # (bf16: the largest finite, a tie to inf)
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
    mod = _native.module("cpu")
    current = mod.isa()
    try:
        for isa in mod.supported_isas():
            mod.set_isa(isa)
            check_conversions("cpu", "cpu")
    finally:
        mod.set_isa(current)


def test_nan_masters_round_alike_on_every_isa():
    """NaN masters (any payload, either sign) become the same quiet NaNs in the model copy on every
    instruction set, next to ordinary values in the same 64-byte lines."""
    payloads = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0xFF812345, 0x7FA00000],
                            dtype=torch.int64).to(torch.int32).view(F32)
    masters = torch.randn(96, generator=torch.Generator().manual_seed(4))
    masters[::16] = payloads[: masters[::16].numel()]
    mod = _native.module("cpu")
    current, outs = mod.isa(), []
    try:
        for isa in mod.supported_isas():
            mod.set_isa(isa)
            param, master = torch.zeros(96, dtype=BF16), masters.clone()
            ops.sgd_step_(param, torch.zeros(96, dtype=BF16), master, None, torch.tensor(0.0), torch.zeros(2, 1),
                          torch.tensor(1.0), torch.tensor(0.0), torch.zeros(2))
            outs.append((isa, param))
    finally:
        mod.set_isa(current)
    bits = outs[0][1].view(torch.int16)
    assert torch.isnan(outs[0][1][::16]).all() and (bits[::16] & 0x40).all()  # quiet NaNs
    for isa, p in outs[1:]:
        assert_bitwise(f"{isa} model copy", outs[0][1], p)


# ---- skipped steps, determinism ---------------------------------------------------------------------------

def snapshot(*ts):
    return [t.clone() for t in ts if t is not None]


def snapshot_problem(s):
    return [p.clone() for p in s["params"]] + snapshot(s["master"], s["s1"], s["s2"], s["steps"])


def check_skip(device, backend, opt, specs=None):
    """A non-finite gradient element: the step writes out_stats and nothing else."""
    specs = specs or single(1000)
    fast, _, _ = make_problem(specs, BF16, True, device)
    grads = make_grads(specs, BF16, device, torch.Generator().manual_seed(11), scale=1.0)
    last = max(i for i, g in enumerate(grads) if g is not None and g.numel())
    R.memory_view(grads[last])[grads[last].numel() // 2] = float("nan")
    inv, lr, out = torch.tensor(1.0, device=device), torch.tensor(1e-3, device=device), torch.zeros(2, device=device)
    before = snapshot_problem(fast)
    p = ops.norm_check([g for g in grads if g is not None], inv, backend=backend)
    cfg = ADAM_CONFIGS["adamw-clip"] if opt == "adam" else SGD_CONFIGS["momentum-dampening-wd-clip"]
    call_step(fast, grads, p, out, opt, cfg, inv, lr, backend, legacy=len(specs) == 1)
    for i, (a, b) in enumerate(zip(before, snapshot_problem(fast))):
        assert_bitwise(f"tensor {i} after a skipped step", a, b)
    assert out[1].item() == 1.0 and math.isnan(out[0].item())


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_skipped_step_changes_nothing(opt):
    check_skip("cpu", "cpu", opt)
    check_skip("cpu", "cpu", opt, MULTI)


def one_step(device, backend, n, threads=None):
    """Every output of one AdamW step (clipped) over MULTI plus a parameter of n elements."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        specs = MULTI + single(n)
        fast, _, _ = make_problem(specs, BF16, True, device)
        grads = make_grads(specs, BF16, device, torch.Generator().manual_seed(5), scale=10.0)
        inv, lr, out = (torch.tensor(0.5, device=device), torch.tensor(1e-3, device=device),
                        torch.zeros(2, device=device))
        p = ops.norm_check([g for g in grads if g is not None], inv, backend=backend)
        ops.adamw_step_(fast["params"], grads, fast["master"], fast["s1"], fast["s2"], fast["steps"], p, inv, lr, out,
                        max_norm=1.0, backend=backend)
        return [p, out] + snapshot_problem(fast)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("streamed", [False, True])
def test_bitwise_across_threads_runs_and_isas(streamed):
    # 13 chunks; or a step large enough to stream its model copy out
    n = _native.module("cpu").STREAM_ELEMENTS + 3 if streamed else 200_003
    base = one_step("cpu", "cpu", n, threads=1)
    runs = [one_step("cpu", "cpu", n, threads=2), one_step("cpu", "cpu", n, threads=2),
            one_step("cpu", "cpu", n, threads=7)]
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
