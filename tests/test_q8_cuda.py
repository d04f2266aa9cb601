"""On a CUDA device: 8-bit moments (uint8 codes with one scale per block of 256 elements,
``ampfused/ops/state_precision.py``) in the native ``cuda`` backend's step, against the specification. Skipped
without CUDA.

Both sides get the same partials (one column: the summed squares of the gradients), so the clip coefficient is
the same fp32 value, and the kernel's element math is math.h's, the reference's fp32 expressions in their order:

* SGD and Adam / AdamW (every weight format): codes, block scales, weights, masters or remainders and step
  counts bit for bit equal to the reference's (computed on CPU copies), clipping on; Adam's bias corrections
  are fp32 IEEE operations on both sides (reference.expm1_nonpositive).
* Sizes that end inside a block (1, 7, 255, 257, 1300), a whole block (256), several chunks of the step kernel
  (> 16384 elements: one block of threads per chunk), a transposed parameter, a parameter without a gradient
  (untouched, its blocks too), per-parameter step counts (SGD's first step), a skipped step (nothing changes),
  and the single launch (K1 fused in) against the two kernels.
* The fused optimizers with 8-bit moments (their table entries, the segments' own layout and scales): FusedSGD
  bit for bit the reference backend's, FusedAdamW the cpu backend's.
"""
import math

import pytest
import torch

import ampfused
from ampfused import _native, ops
from ampfused.ops import native_args
from ampfused.ops import reference as R, state_precision as sp
from ampfused.ops.reference import memory_view, state_layout
from oracle import assert_bitwise

DEV, BACKEND = "cuda", "cuda"  # the device and backend under test (the reference runs on CPU copies)
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# (shape, transposed, has a gradient, step count before the first step)
PARAMS = [
    ((1,), False, True, 3),
    ((7,), False, True, 0),
    ((255,), False, True, 5),
    ((256,), False, True, 0),
    ((257,), False, True, 2),
    ((300,), False, False, 7),        # no gradient: left alone
    ((1300,), False, True, 1),
    ((2 * 16384 + 77,), False, True, 4),  # three chunks of the step kernel
    ((37, 41), True, True, 0),
]
FORMATS = {  # parameter dtype, master: "fp32" buffer, "remainder" (int16), None (fp32 params or stochastic rounding)
    "fp32-params": (F32, None),
    "bf16-fp32-master": (BF16, "fp32"),
    "fp16-fp32-master": (F16, "fp32"),
    "bf16-remainder": (BF16, "remainder"),
    "bf16-no-master": (BF16, None),
}
OPTIMIZERS = {
    "adam": dict(kind="adam", decoupled=False, weight_decay=0.01),
    "adamw": dict(kind="adam", decoupled=True, weight_decay=0.01),
    "sgd": dict(kind="sgd", momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False),
    "sgd-nesterov": dict(kind="sgd", momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True),
}


def _built():
    if _native.build_info("cuda") is None:
        pytest.skip(f"ampfused._C_cuda not built: {_native.unavailable_reason('cuda')}")


@pytest.fixture
def _backend_usable():
    _built()
    reasons = ops.registry.reasons_for(BACKEND, torch.device(DEV))
    assert not reasons, reasons


def gpu(test):
    """A test that runs the kernels: on a CUDA device (skipped without one), the backend usable there."""
    return pytest.mark.gpu(pytest.mark.usefixtures("_backend_usable")(test))


def _shaped(shape, transposed, values):
    return values.reshape(shape[::-1]).t() if transposed else values.reshape(shape)


class Problem:
    """The step's tensors in one format, from fixed random values (the same for every format): moments as 8-bit
    codes of random values (the whole flat buffer quantized in blocks: each parameter's own blocks), masters
    whose low bits are random."""

    def __init__(self, fmt: str, opt: str, device, gen_seed: int = 0):
        g = torch.Generator().manual_seed(gen_seed)
        self.pdtype, master = FORMATS[fmt]
        self.cfg = OPTIMIZERS[opt]
        numels = [math.prod(s) for s, _, _, _ in PARAMS]
        self.offsets, self.total = state_layout(numels, sp.QBLOCK)
        masters = torch.randn(self.total, generator=g)
        if master == "remainder":
            weight, self.master = sp.split_master(masters)
        else:
            weight = masters.to(self.pdtype)
            self.master = masters.clone() if master == "fp32" else None
        self.params = [_shaped(s, tr, torch.zeros(n, dtype=self.pdtype)) for (s, tr, _, _), n in zip(PARAMS, numels)]
        for p, o in zip(self.params, self.offsets):
            memory_view(p).copy_(weight[o:o + p.numel()])
        moments = 1 if self.cfg["kind"] == "sgd" else 2
        # exp_avg / momentum_buf signed, exp_avg_sq (never negative) unsigned
        coded = [sp.q8_quantize(torch.randn(self.total, generator=g) * 1e-2, signed=True)]
        if moments == 2:
            coded.append(sp.q8_quantize((torch.randn(self.total, generator=g) * 1e-2) ** 2, signed=False))
        self.states = [c for c, _ in coded]
        self.scales = torch.stack([s for _, s in coded])
        self.steps = torch.tensor([float(s) for _, _, _, s in PARAMS])
        self.seed = torch.tensor(-(2 ** 40) + 12345, dtype=torch.int64)
        self.to(device)

    def to(self, device):
        for name in ("master", "scales", "steps", "seed"):
            t = getattr(self, name)
            setattr(self, name, None if t is None else t.to(device))
        self.params = [p.to(device) for p in self.params]  # (.to keeps a transposed tensor's strides)
        self.states = [s.to(device) for s in self.states]
        return self

    def tensors(self):
        """Copies on CPU of everything a step may change (the flat buffers whole: the gaps between parameters
        too), with names, in a fixed order."""
        out = [(f"params[{i}]", memory_view(p)) for i, p in enumerate(self.params)]
        out += [(f"state{k + 1}", s) for k, s in enumerate(self.states)] + [("state_scales", self.scales),
                                                                           ("steps", self.steps)]
        if self.master is not None:
            out.append(("master", self.master))
        return [(n, t.cpu().clone()) for n, t in out]


def _grads(k, pdtype, device):
    g = torch.Generator().manual_seed(100 + k)
    return [_shaped(s, tr, torch.randn(math.prod(s), generator=g).to(pdtype)).to(device) if has else None
            for (s, tr, has, _) in PARAMS]


def _partials(grads, inv_scale, skip):
    """One column: the squared norm of the unscaled gradients, the norm first rounded to 12 significant bits so
    that its square is exact in fp32 and every side's square root gives that norm exactly (torch's fp32 sqrt is
    not always correctly rounded; the kernels' is), and the overflow flag (set: the step is skipped)."""
    active = [g.cpu() for g in grads if g is not None]
    sumsq = R.norm_check(active, inv_scale.cpu())[0].double().sum().item() if active else 0.0
    mantissa, exponent = math.frexp(math.sqrt(sumsq))
    norm = math.ldexp(round(mantissa * 4096), exponent - 12)
    return torch.tensor([[norm * norm], [1.0 if skip else 0.0]], dtype=F32)


def _step(p: Problem, grads, partials, backend, max_norm):
    dev = p.steps.device
    inv_scale, out = torch.tensor(0.5, device=dev), torch.zeros(2, device=dev)
    partials = partials.to(dev)
    cfg = p.cfg
    kw = dict(seed=p.seed, state_scales=p.scales)
    if cfg["kind"] == "sgd":
        if backend is None:
            R.sgd_step_(p.params, grads, p.master, p.states[0], p.steps, partials, inv_scale,
                        torch.tensor(1e-2, device=dev), out, cfg["momentum"], cfg["dampening"], cfg["weight_decay"],
                        cfg["nesterov"], max_norm, False, **kw)
        else:
            ops.get_backend(backend).sgd_step_(p.params, grads, p.master, p.states[0], p.steps, partials, inv_scale,
                                               torch.tensor(1e-2, device=dev), out, cfg["momentum"],
                                               cfg["dampening"], cfg["weight_decay"], cfg["nesterov"], max_norm,
                                               False, **kw)
    else:
        args = (p.params, grads, p.master, p.states[0], p.states[1], p.steps, partials, inv_scale,
                torch.tensor(1e-3, device=dev), out, 0.9, 0.999, 1e-8, cfg["weight_decay"], max_norm,
                cfg["decoupled"], False)
        if backend is None:
            R.adam_step_(*args, **kw)
        else:
            ops.get_backend(backend).adam_step_(*args, **kw)
    return out.cpu()


def _run(fmt, opt, backend, device, n_steps=3, skip_at=1, max_norm=1.0):
    """``n_steps`` steps (step ``skip_at`` skipped: overflow), clipping on; returns the problem and each step's
    out_stats."""
    p = Problem(fmt, opt, device)
    stats = []
    for k in range(n_steps):
        grads = _grads(k, p.pdtype, device)
        before = p.tensors() if k == skip_at else None
        stats.append(_step(p, grads, _partials(grads, torch.tensor(0.5), k == skip_at), backend, max_norm))
        if before is not None:  # a skipped step changes nothing
            for (name, a), (_, b) in zip(p.tensors(), before):
                assert_bitwise(f"{name} after the skipped step", a, b)
    return p, stats


def _untouched_blocks_hold(fast: Problem, start: Problem):
    """The parameter without a gradient keeps its codes and its blocks' scales (and its weight)."""
    for i, (s, _, has, _) in enumerate(PARAMS):
        if has:
            continue
        o, n = fast.offsets[i], math.prod(s)
        blocks = slice(o // sp.QBLOCK, o // sp.QBLOCK + sp.q8_blocks(n))
        for k, (a, b) in enumerate(zip(fast.states, start.states)):
            assert_bitwise(f"state{k + 1} of params[{i}] (no gradient)", a[o:o + n].cpu(), b[o:o + n].cpu())
        assert_bitwise(f"state_scales of params[{i}] (no gradient)", fast.scales[:, blocks].cpu(),
                       start.scales[:, blocks].cpu())
        assert_bitwise(f"params[{i}] (no gradient)", memory_view(fast.params[i]).cpu(),
                       memory_view(start.params[i]).cpu())


@pytest.mark.parametrize("opt,fmt", [("sgd", f) for f in FORMATS] + [("sgd-nesterov", "fp32-params"),
                                                                      ("sgd-nesterov", "bf16-no-master")]
                         + [(o, f) for o in ("adam", "adamw") for f in FORMATS])
@gpu
def test_q8_step_matches_the_reference_bit_for_bit(opt, fmt):
    fast, fast_stats = _run(fmt, opt, BACKEND, DEV)
    ref, ref_stats = _run(fmt, opt, None, "cpu")
    for k, (a, b) in enumerate(zip(fast_stats, ref_stats)):
        assert_bitwise(f"out_stats (step {k})", a, b)
    for (name, a), (_, b) in zip(fast.tensors(), ref.tensors()):
        assert_bitwise(f"{name} ({opt}, {fmt})", a, b)
    _untouched_blocks_hold(fast, Problem(fmt, opt, "cpu"))


@pytest.mark.parametrize("opt", ["adamw", "sgd-nesterov"])  # (no weight decay: it would narrow the momentum's range)
@pytest.mark.parametrize("fmt", ["bf16-fp32-master", "bf16-no-master"])
@gpu
def test_q8_values_below_the_normal_range_match_the_reference(opt, fmt):
    """Moments and gradients spread over 2^40 in every block: most new moments fall below their block's normal
    range, so the blocks take the out-of-line encoder (q8_encode's carried form), some codes are 0."""
    def run(device, backend):
        p = Problem(fmt, opt, "cpu")
        g = torch.Generator().manual_seed(7)
        wide = [torch.randn(p.total, generator=g) * torch.exp2(-40 * torch.rand(p.total, generator=g))
                for _ in p.states]
        coded = [sp.q8_quantize(v if k == 0 else v.abs(), signed=k == 0) for k, v in enumerate(wide)]
        p.states, p.scales = [c for c, _ in coded], torch.stack([sc for _, sc in coded])
        p.to(device)
        for k in range(3):
            grads = [(x * torch.exp2(-40 * torch.rand(x.shape, generator=g)).to(x.dtype)).to(device)
                     if x is not None else None for x in _grads(k, p.pdtype, "cpu")]
            _step(p, grads, _partials(grads, torch.tensor(0.5), False), backend, 1.0)
        return p
    fast, ref = run(DEV, BACKEND), run("cpu", None)
    mag = torch.cat([s.cpu().to(torch.int64) & (0x7F if k == 0 else 0xFF) for k, s in enumerate(ref.states)])
    assert ((mag > 0) & (mag < 8)).float().mean() > 0.02
    for (name, a), (_, b) in zip(fast.tensors(), ref.tensors()):
        assert_bitwise(f"{name} ({opt}, {fmt})", a, b)


@gpu
@pytest.mark.parametrize("fmt", ["bf16-remainder", "fp32-params"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_single_launch_with_q8_equals_two_kernels(opt, fmt):
    runs = []
    for single in (False, True):
        p = Problem(fmt, opt, DEV)
        for k in range(2):
            grads = _grads(k, p.pdtype, DEV)
            inv = torch.tensor(0.5, device=DEV)
            active = [g for g in grads if g is not None]
            if single:
                n = _native.module(BACKEND).num_partials([g.numel() for g in active])
                partials = torch.empty(2, n, device=DEV)
            else:
                partials = ops.norm_check(active, inv, backend=BACKEND)
            _step_with(p, grads, partials, single)
        runs.append(p.tensors())
    for (name, a), (_, b) in zip(*runs):
        assert_bitwise(f"{name} (single launch vs two kernels)", a, b)


def _step_with(p: Problem, grads, partials, single_launch):
    """A step of the backend under test that reads (or, single_launch, writes) ``partials`` where it is."""
    inv_scale, out, cfg = torch.tensor(0.5, device=DEV), torch.zeros(2, device=DEV), p.cfg
    backend = ops.get_backend(BACKEND)
    kw = dict(seed=p.seed, state_scales=p.scales, single_launch=single_launch)
    if cfg["kind"] == "sgd":
        backend.sgd_step_(p.params, grads, p.master, p.states[0], p.steps, partials, inv_scale,
                          torch.tensor(1e-2, device=DEV), out, cfg["momentum"], cfg["dampening"], cfg["weight_decay"],
                          cfg["nesterov"], 1.0, False, **kw)
    else:
        backend.adam_step_(p.params, grads, p.master, p.states[0], p.states[1], p.steps, partials, inv_scale,
                           torch.tensor(1e-3, device=DEV), out, 0.9, 0.999, 1e-8, cfg["weight_decay"], 1.0,
                           cfg["decoupled"], False, **kw)


@gpu
def test_q8_state_scales_of_the_wrong_size_are_refused_before_the_kernel():
    p = Problem("bf16-remainder", "adamw", DEV)
    grads = _grads(0, p.pdtype, DEV)
    before = p.tensors()
    short = p.scales[:, :-1].contiguous()
    with pytest.raises(ValueError, match="state_scales"):
        _step(_with_scales(p, short), grads, _partials(grads, torch.tensor(0.5), False), BACKEND, 1.0)
    with pytest.raises(ValueError, match="state_scales"):  # one row for two moments
        _step(_with_scales(p, p.scales[:1].contiguous()), grads, _partials(grads, torch.tensor(0.5), False),
              BACKEND, 1.0)
    for (name, a), (_, b) in zip(p.tensors(), before):
        assert_bitwise(name, a, b)


def _with_scales(p: Problem, scales):
    other = object.__new__(Problem)
    other.__dict__.update(p.__dict__)
    other.scales = scales
    return other


@gpu
@pytest.mark.parametrize("weights", ["fp32-master", "remainders", "no-master"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_fused_optimizers_with_q8_moments_match(kind, weights):
    # no clipping and no scaler: the coefficient is exactly 1 on every backend; the other run on CPU copies
    other = "reference" if kind == "sgd" else "cpu"
    if ops.registry.reasons_for(other, torch.device("cpu")):
        pytest.skip(f"the {other} backend is not available")
    shapes = [(7,), (300,), (256,), (257,), (16384 + 5,)]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g).to(BF16) for s in shapes]
    extra = {"fp32-master": {}, "remainders": dict(store_param_remainders=True),
             "no-master": dict(bf16_stochastic_round=True)}[weights]
    runs = []
    for backend, dev in ((BACKEND, DEV), (other, "cpu")):
        ps = [torch.nn.Parameter(p.clone().to(dev)) for p in start]
        if kind == "sgd":
            opt = ampfused.FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, backend=backend, seed=7,
                                    momentum_dtype=torch.uint8, **extra)
        else:
            opt = ampfused.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, backend=backend, seed=7,
                                      exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, **extra)
        runs.append((ps, opt))
    for k in range(3):
        gen = torch.Generator().manual_seed(100 + k)
        grads = [torch.randn(s, generator=gen).to(BF16) for s in shapes]
        for ps, opt in runs:
            for p, grad in zip(ps, grads):
                p.grad = grad.to(p.device)
            opt.step()

    def everything(ps, opt):
        out = [(f"params[{i}]", p.detach()) for i, p in enumerate(ps)]
        for j, seg in enumerate(opt._segs.segments):
            out += [(f"segment {j} steps", seg.steps), (f"segment {j} scales", seg.scales)]
            out += [(f"segment {j} {name}", t) for name, t in seg.states.items()]
            out += [(f"segment {j} master", seg.master)] if seg.master is not None else []
        return [(n, t.cpu()) for n, t in out]

    fast, ref = everything(*runs[0]), everything(*runs[1])
    assert [n for n, _ in fast] == [n for n, _ in ref]
    for (name, a), (_, b) in zip(fast, ref):
        assert_bitwise(f"{name} ({kind}, {weights}, against {other})", a, b)


def test_module_refuses_8bit_moments_without_seed_or_scales():
    """The compiled entry's own rules, checked before it selects a device (so without a GPU too)."""
    _built()
    mod = _native.module("cuda")
    slots = dict(table=8, count=1, param_dtype=0, grad_dtype=0, master=0, state1=16, state2=32, steps=48,
                 step_code=0, partials=64, num_partials=1, inv_scale=80, lr=96, lr_code=0, out_stats=112, device=0,
                 stream=0, chunks=128, num_chunks=1, columns=144, num_columns=1, counter=160, single_launch=0)
    pack = native_args.packer(mod)
    adam = [0.9, 0.999, 1e-8, 0.0, 1.0, 1.0, 0.0]
    for bad in (dict(state_dtype=4, seed=8), dict(state_dtype=4, state_scales=8, scale_blocks=1),
                dict(state_dtype=4, seed=8, state_scales=8, scale_blocks=0)):
        with pytest.raises(ValueError, match="8-bit moments need their codes, a seed and their block scales"):
            mod.step("adam_step_", pack.slots(slots, bad), adam)
    with pytest.raises(ValueError, match="state_dtype must be 0"):
        mod.step("adam_step_", pack.slots(slots, dict(state_dtype=7)), adam)
    with pytest.raises(ValueError, match="8-bit moments need"):
        mod.step("sgd_step_", pack.slots(slots, dict(state2=0, state_dtype=4, seed=8)), [0.9, 0.0, 0.0, 0.0, 1.0, 0.0])
