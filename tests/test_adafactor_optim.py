"""FusedAdafactor against torch.optim.Adafactor: parameters of every layout and shape over several steps within
the oracle rule (torch's fp32 loop the plain implementation, torch's fp64 loop the oracle), with the scaler, the
clip, the skip and grad_divisor; the state-precision modes; state dicts both ways and a bitwise resume; the
errors (torch's own error inputs: tests/torch_suite/test_torch_optim_db.py)."""
import copy
import math

import pytest
import torch

import ampfused
from backends import cpu_backends
from oracle import assert_bitwise, assert_close_to_oracle

BACKENDS = [b for b in cpu_backends() if hasattr(ampfused.ops.get_backend(b), "adafactor_step_")]
EPS = (1.1920928955078125e-07, 1e-3)  # fp32's epsilon, spelled out so that torch's fp64 oracle runs the same math


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    vals = [torch.randn(s, generator=g) for s in [(9, 6), (6, 9), (17,), (), (1, 1), (2, 3, 4, 5), (3, 5, 2)]]
    out = [v.to(dtype) for v in vals[:3]] + [vals[3].to(dtype), vals[4].to(dtype)]
    out[1] = vals[1].t().contiguous().t().to(dtype)  # a transposed weight
    out.append(vals[5].to(dtype).contiguous(memory_format=torch.channels_last))
    out.append(vals[6].to(dtype))
    return [p.requires_grad_() for p in out]


def _grads(params, step, dtype):
    g = torch.Generator().manual_seed(10 + step)
    return [torch.randn(p.shape, generator=g).to(dtype) * (0.1 if step % 3 else 3.0) for p in params]


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = torch.empty_like(p).copy_(g)


HYPERS = [dict(lr=1e-2, weight_decay=0.1), dict(lr=0.3, maximize=True, d=1.5), dict(lr=1e-2, beta2_decay=-1.0)]
# Triton runs here under its interpreter, a hundred times slower than the native kernels: one set of hyperparameters
# (its kernels are held to the reference under every one in tests/test_adafactor_ops.py)
CELLS = [(b, h) for b in BACKENDS for h in HYPERS if b != "triton" or h is HYPERS[1]]


@pytest.mark.parametrize("backend,hyper", CELLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_adafactor(backend, hyper, dtype):
    base = _params(dtype)
    ref = {}
    for dt in (torch.float32, torch.float64):
        ps = [p.detach().to(dt).requires_grad_() for p in base]  # (to() keeps each one's memory layout)
        opt = torch.optim.Adafactor(ps, eps=EPS, **hyper)
        for k in range(8):
            _set(ps, [g.to(dt) for g in _grads(ps, k, dtype)])
            opt.step()
        ref[dt] = (ps, opt)
    ours = [p.detach().clone().requires_grad_() for p in base]
    fopt = ampfused.FusedAdafactor(ours, eps=EPS, backend=backend, **hyper)
    for k in range(8):
        _set(ours, _grads(ours, k, dtype))
        fopt.step()
    (t32, o32), (t64, o64) = ref[torch.float32], ref[torch.float64]
    for i, (p, a, b) in enumerate(zip(ours, t32, t64)):
        w = p if dtype == torch.float32 else fopt.state[p]["master_param"]
        assert w.stride() == p.stride()
        assert_close_to_oracle(f"param {i} {tuple(p.shape)}", w, a, b)
        for key in ("row_var", "col_var", "variance"):
            if key in o32.state[a]:
                assert fopt.state[p][key].shape == o32.state[a][key].shape
                assert_close_to_oracle(f"{key} {i}", fopt.state[p][key], o32.state[a][key], o64.state[b][key])
        assert fopt.state[p]["step"].item() == 8


def test_scaler_clip_skip_and_divisor():
    """ampfused.GradScaler with max_grad_norm and grad_divisor: the step sees the unscaled, divided, clipped
    gradients (torch: the same gradients clipped by clip_grad_norm_, then Adafactor), and an inf skips the step:
    nothing changes, not even the step count."""
    base = _params(torch.float32)
    ps = [p.detach().clone().requires_grad_() for p in base]
    tp = [p.detach().clone().requires_grad_() for p in base]
    fopt = ampfused.FusedAdafactor(ps, eps=EPS, max_grad_norm=0.5)
    topt = torch.optim.Adafactor(tp, eps=EPS)
    scaler = ampfused.GradScaler("cpu", init_scale=1024.0)
    for k in range(5):
        grads = _grads(ps, k, torch.float32)
        scale = scaler.scale(torch.ones(()))  # (what the loss is multiplied by)
        scaled = [g * scale * 4 for g in grads]
        if k == 2:
            scaled[0][1, 1] = math.inf
        _set(ps, scaled)
        before = [t.detach().clone() for t in ps] + [s.states["factors"].clone() for s in fopt._segs.segments]
        scaler.step(fopt, grad_divisor=4)
        scaler.update()
        if k == 2:
            for a, b in zip(before, [t.detach() for t in ps] + [s.states["factors"] for s in fopt._segs.segments]):
                assert_bitwise("after a skipped step", a, b)
            continue
        _set(tp, grads)
        torch.nn.utils.clip_grad_norm_(tp, 0.5)
        topt.step()
    for a, b in zip(ps, tp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fopt.state[ps[0]]["step"].item() == 4


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])  # (Triton's: test_adafactor_ops.py)
def test_remainders_are_the_fp32_master_run_and_sr_stays_close(backend):
    base = _params(torch.bfloat16)
    runs = {}
    for name, kw in (("fp32", {}), ("rem", dict(store_param_remainders=True)),
                     ("sr", dict(bf16_stochastic_round=True, seed=3))):
        ps = [p.detach().clone().requires_grad_() for p in base]
        opt = ampfused.FusedAdafactor(ps, backend=backend, weight_decay=0.1, **kw)
        for k in range(4):
            _set(ps, _grads(ps, k, torch.bfloat16))
            opt.step()
        runs[name] = (ps, opt)
    (pf, of), (pr, orr), (psr, osr) = runs["fp32"], runs["rem"], runs["sr"]
    for a, b in zip(pf, pr):
        from ampfused.ops import state_precision as sp
        joined = sp.join_master(b.detach(), orr.state[b]["master_remainder"])
        assert_bitwise("master", joined, of.state[a]["master_param"])
    assert_bitwise("factors", orr._segs.segments[0].states["factors"], of._segs.segments[0].states["factors"])
    for a, b in zip(pf, psr):
        assert "master_param" not in osr.state[b]
        torch.testing.assert_close(b.float(), a.float(), rtol=0.05, atol=0.02)


def test_state_dict_resume_is_bitwise_and_loads_into_torch():
    base = _params(torch.bfloat16)
    ps = [p.detach().clone().requires_grad_() for p in base]
    opt = ampfused.FusedAdafactor(ps, weight_decay=0.1)
    for k in range(3):
        _set(ps, _grads(ps, k, torch.bfloat16))
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    qs = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = ampfused.FusedAdafactor(qs, weight_decay=0.1)
    opt2.load_state_dict(sd)
    for k in range(3, 6):
        g = _grads(ps, k, torch.bfloat16)
        _set(ps, g)
        _set(qs, g)
        opt.step()
        opt2.step()
    for a, b in zip(ps + [opt._segs.segments[0].states["factors"]], qs + [opt2._segs.segments[0].states["factors"]]):
        assert_bitwise("resumed", a.detach(), b.detach())
    t = torch.optim.Adafactor([p.detach().float().requires_grad_() for p in ps], weight_decay=0.1)
    t.load_state_dict(copy.deepcopy(opt.state_dict()))
    for tp, p in zip(t.param_groups[0]["params"], ps):
        for key, v in t.state[tp].items():
            assert torch.equal(v, opt.state[p][key]), key


def test_bad_state_dict_changes_nothing():
    ps = _params()
    opt = ampfused.FusedAdafactor(ps)
    _set(ps, _grads(ps, 0, torch.float32))
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["row_var"] = torch.zeros(4, 1)
    before = opt._segs.segments[0].states["factors"].clone()
    with pytest.raises(ValueError, match=r"'row_var' of parameter 0 must have shape \(9, 1\)"):
        opt.load_state_dict(sd)
    del sd["state"][1]["col_var"]
    sd["state"][0]["row_var"] = torch.zeros(9, 1)
    with pytest.raises(ValueError, match="parameter 1 lacks 'col_var'"):
        opt.load_state_dict(sd)
    assert_bitwise("factors", opt._segs.segments[0].states["factors"], before)


def test_errors_as_torch():
    p = [torch.zeros(3, 2, requires_grad=True)]
    for kw, msg in [(dict(lr=-1.0), "Learning rate should be >= 0"), (dict(beta2_decay=0.5), "beta2_decay should be"),
                    (dict(eps=(None, -1.0)), "epsilon2 should be >= 0"), (dict(d=0.9), "Clipping threshold d"),
                    (dict(weight_decay=-1.0), "weight_decay should be >= 0")]:
        with pytest.raises(ValueError, match=msg):
            torch.optim.Adafactor(p, **kw)
        with pytest.raises(ValueError, match=msg):
            ampfused.FusedAdafactor(p, **kw)
    with pytest.raises(RuntimeError, match="Adafactor does not support complex parameters"):
        ampfused.FusedAdafactor([torch.zeros(2, 3, dtype=torch.complex64, requires_grad=True)])
    opt = ampfused.FusedAdafactor(p)
    opt.param_groups[0]["d"] = 0.5
    p[0].grad = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"Clipping threshold d should be >= 1 but is: 0.5 in param_groups\[0\]"):
        opt.step()
    assert p[0].abs().sum() == 0 and not opt.state[p[0]]


def test_empty_parameter_steps_nothing():
    """torch's loop divides by the empty parameter's size (ZeroDivisionError); here it is left alone."""
    ps = [torch.zeros(0, 4, requires_grad=True), torch.ones(3, requires_grad=True)]
    opt = ampfused.FusedAdafactor(ps)
    _set(ps, [torch.zeros(0, 4), torch.ones(3)])
    opt.step()
    assert opt.state[ps[0]]["row_var"].shape == (0, 1) and opt.state[ps[0]]["col_var"].shape == (1, 4)
    assert bool(torch.isfinite(ps[1]).all())
