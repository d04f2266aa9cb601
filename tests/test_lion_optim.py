"""FusedLion: against a plain-torch Lion (fp32 masters, clip, skip) within tests/oracle.py's rule; with
ampfused.GradScaler and grad_divisor; checkpoint resume bit for bit in every state-precision mode; state dicts to
and from optimi's Lion; argument errors with torch's and optimi's messages."""
import copy
import math

import pytest
import torch

import ampfused
from ampfused.optim import optimi_state_dict
from backends import cpu_backends, set_grad, snapshot
from oracle import assert_bitwise, assert_close_to_oracle

SHAPES = [(7, 5), (13,), (3, 3, 3), (1,)]
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
INJECT = {4: (1, 3, math.inf), 9: (0, 0, math.nan)}
BACKENDS = [b for b in cpu_backends() if b != "triton"]  # (Triton: tests/test_lion_ops.py, op by op)


class TorchLion:
    """Lion in plain torch on master copies of ``dtype``: clip_grad_norm_'s coefficient, skip on a non-finite
    gradient, optimi's order (decay, then the signed step, then the moment)."""

    def __init__(self, init, dtype, max_norm):
        self.w = [x.to(dtype, copy=True) for x in init]
        self.m = [torch.zeros_like(x) for x in self.w]
        self.max_norm = max_norm

    def step(self, grads, lr, beta1, beta2, wd):
        g = [x.to(self.w[0].dtype) for x in grads]
        if not all(torch.isfinite(x).all() for x in g):
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g]))
        coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        for w, m, x in zip(self.w, self.m, g):
            x = x * coef
            w.mul_(1 - lr * wd)
            w.add_(torch.sign(m.lerp(x, 1 - beta1)), alpha=-lr)
            m.lerp_(x, 1 - beta2)


def _grads(k, dtype):
    gen = torch.Generator().manual_seed(k)
    out = [(torch.randn(s, generator=gen) * 1e-2).to(dtype) for s in SHAPES]
    if k in INJECT:
        t, i, v = INJECT[k]
        out[t].view(-1)[i] = v
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_plain_torch_lion_within_oracle(backend):
    init = [torch.randn(s) for s in SHAPES]
    params = [torch.nn.Parameter(x.to(torch.bfloat16)) for x in init]
    opt = ampfused.FusedLion(params, **HYPER, max_grad_norm=0.05, backend=backend)
    r32, r64 = TorchLion([p.detach().float() for p in params], torch.float32, 0.05), \
        TorchLion([p.detach().float() for p in params], torch.float64, 0.05)
    for k in range(30):
        grads = _grads(k, torch.bfloat16)
        for p, g in zip(params, grads):
            set_grad(p, g)
        opt.step()
        assert opt.last_step_skipped.item() == (k in INJECT)
        for r in (r32, r64):
            r.step(grads, 1e-3, 0.9, 0.99, 0.1)
    for i, p in enumerate(params):
        assert_close_to_oracle(f"master {i}", opt.state[p]["master_param"], r32.w[i], r64.w[i])
        assert_close_to_oracle(f"exp_avg {i}", opt.state[p]["exp_avg"], r32.m[i], r64.m[i])
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))


def test_grad_scaler_and_grad_divisor():
    """A scaled loss through ampfused.GradScaler, and grad_divisor, step as the unscaled gradient does."""
    init = [torch.randn(s) for s in SHAPES]
    a = [torch.nn.Parameter(x.to(torch.float16)) for x in init]
    b = [torch.nn.Parameter(x.to(torch.float16)) for x in init]
    c = [torch.nn.Parameter(x.to(torch.float16)) for x in init]
    oa, ob, oc = (ampfused.FusedLion(ps, **HYPER) for ps in (a, b, c))
    scaler = ampfused.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for k in range(3):
        grads = _grads(k + 20, torch.float32)
        for pa, pb, pc, g in zip(a, b, c, grads):
            set_grad(pa, g.half())
            set_grad(pb, (g * 1024).half())
            set_grad(pc, (g * 2).half())
        oa.step()
        scaler.scale(torch.ones(()))  # (the loss a loop would scale: the scaler's scale comes into being)
        scaler.step(ob)
        scaler.update()
        oc.step(grad_divisor=2)
    for pa, pb, pc in zip(a, b, c):
        assert_bitwise("scaler", oa.state[pa]["master_param"], ob.state[pb]["master_param"])
        assert_bitwise("grad_divisor", oa.state[pa]["master_param"], oc.state[pc]["master_param"])


MODES = {
    "fp32-master": dict(),
    "remainders-bf16-moment": dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16),
    "stochastic-round-q8-moment": dict(bf16_stochastic_round=True, exp_avg_dtype=torch.uint8, seed=3),
    "fp32-master-q8-moment": dict(exp_avg_dtype=torch.uint8),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_resume_bitwise(backend, mode):
    init = [torch.randn(s) for s in SHAPES]

    def make():
        ps = [torch.nn.Parameter(x.to(torch.bfloat16)) for x in init]
        return ps, ampfused.FusedLion(ps, **HYPER, max_grad_norm=0.05, backend=backend, **MODES[mode])

    pa, oa = make()
    for k in range(6):
        for p, g in zip(pa, _grads(k, torch.bfloat16)):
            set_grad(p, g)
        if k == 3:
            pb, ob = make()
            for x, y in zip(pb, pa):
                x.data.copy_(y.data)
            ob.load_state_dict(copy.deepcopy(oa.state_dict()))
        if k >= 3:
            for x, y in zip(pb, pa):
                set_grad(x, y.grad)
            ob.step()
        oa.step()
    for i, (x, y) in enumerate(zip(snapshot(ob, pb), snapshot(oa, pa))):
        assert_bitwise(f"{mode} tensor {i}", x, y)


def test_state_dict_keys_are_optimis():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = ampfused.FusedLion([p])
    set_grad(p, 1.0)
    opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"exp_avg", "step"}
    assert sd["param_groups"][0]["betas"] == (0.9, 0.99) and sd["param_groups"][0]["lr"] == 1e-4


def test_optimi_state_dicts_both_ways():
    optimi = pytest.importorskip("optimi", reason="needs the optional package torch-optimi")
    init = [torch.randn(s) for s in SHAPES]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    fused = ampfused.FusedLion(ours, **HYPER)
    ref = optimi.Lion(theirs, **HYPER, foreach=False, triton=False)
    for k in range(3):
        for a, b, g in zip(ours, theirs, _grads(k + 40, torch.float32)):
            set_grad(a, g)
            set_grad(b, g)
        fused.step()
        ref.step()
    # optimi's state into a fresh FusedLion, ours into a fresh optimi Lion: each continues as its source
    ours2 = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    theirs2 = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    fused2 = ampfused.FusedLion(ours2)
    fused2.load_state_dict(ref.state_dict())
    ref2 = optimi.Lion(theirs2, lr=1.0, foreach=False, triton=False)
    ref2.load_state_dict(optimi_state_dict(fused.state_dict()))
    assert fused2.param_groups[0]["betas"] == (0.9, 0.99) and ref2.param_groups[0]["beta2"] == 0.99
    for a, b, g in zip(ours2, theirs2, _grads(50, torch.float32)):
        set_grad(a, g)
        set_grad(b, g)
    fused2.step()
    ref2.step()
    # each against plain torch's Lion continuing from its source's state (fp32 and fp64): the oracle's rule
    g = _grads(50, torch.float32)
    for name, dst, src_params, src_m in (("FusedLion from optimi's state", ours2, theirs,
                                          [ref.state[p]["exp_avg"] for p in theirs]),
                                         ("optimi from FusedLion's state", theirs2, ours,
                                          [fused.state[p]["exp_avg"] for p in ours])):
        r32, r64 = (TorchLion([p.detach() for p in src_params], dt, math.inf) for dt in (torch.float32, torch.float64))
        r32.m, r64.m = [m.clone() for m in src_m], [m.double() for m in src_m]
        r32.step(g, 1e-3, 0.9, 0.99, 0.1)
        r64.step(g, 1e-3, 0.9, 0.99, 0.1)
        for i, p in enumerate(dst):
            assert_close_to_oracle(f"{name}, param {i}", p.detach(), r32.w[i], r64.w[i])


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
    (dict(betas=(1.0, 0.99)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, -0.1)), ValueError, "Invalid beta parameter at index 1: -0.1"),
    (dict(weight_decay=-1e-2), ValueError, "Invalid weight_decay value: -0.01"),
    (dict(exp_avg_dtype=torch.float16), ValueError, "exp_avg_dtype must be torch.float32 or torch.bfloat16"),
    (dict(store_param_remainders=True, bf16_stochastic_round=True), ValueError, "exclude each other"),
])
def test_argument_errors(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        ampfused.FusedLion([torch.nn.Parameter(torch.zeros(3))], **kw)


def test_group_error_before_any_change():
    p = torch.nn.Parameter(torch.randn(5))
    opt = ampfused.FusedLion([p], lr=1e-2)
    set_grad(p, 1.0)
    opt.step()
    before = snapshot(opt, [p])
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):
        opt.step()
    for i, (a, b) in enumerate(zip(snapshot(opt, [p]), before)):
        assert_bitwise(f"tensor {i}", a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_spike_guard_scaler_divisor_without_a_host_read(backend, monkeypatch):
    """The whole step with a GradScaler, a spike guard and a tensor grad_divisor reads nothing to the host; the
    guard skips the spike and the scaler the overflow."""
    params = [torch.nn.Parameter(torch.randn(s).to(torch.float16)) for s in SHAPES]
    opt = ampfused.FusedLion(params, lr=1e-3, backend=backend, exp_avg_dtype=torch.bfloat16,
                             spike_guard=ampfused.SpikeGuard(factor=4.0, window=4, warmup=2))
    scaler = ampfused.GradScaler("cpu", init_scale=256.0)
    divisor = torch.tensor(2.0)

    def refuse(*a, **k):
        raise AssertionError("host read during step")
    for k in range(6):
        for p, g in zip(params, _grads(k + 60, torch.float32)):
            set_grad(p, (g * (1000.0 if k == 4 else 1.0) * 256).half())
        params[0].grad.view(-1)[0] = math.inf if k == 3 else params[0].grad.view(-1)[0]
        scaler.scale(torch.ones(()))
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
                mp.setattr(torch.Tensor, name, refuse)
            scaler.step(opt, grad_divisor=divisor)
            scaler.update()
        assert bool(opt.last_step_skipped) == (k in (3, 4)), k


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the compiled CPU backend (ampfused._C)")
@pytest.mark.parametrize("mode", ["fp32-master", "stochastic-round-q8-moment"])
def test_cpu_bits_do_not_depend_on_the_thread_count(mode):
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            params = [torch.nn.Parameter(torch.randn(40000, generator=torch.Generator().manual_seed(5)).bfloat16())]
            opt = ampfused.FusedLion(params, **HYPER, backend="cpu", **MODES[mode])
            for k in range(3):
                set_grad(params[0], torch.randn(40000, generator=torch.Generator().manual_seed(k)).bfloat16())
                opt.step()
            results.append(snapshot(opt, params))
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(*results)):
        assert_bitwise(f"tensor {i}", a, b)
