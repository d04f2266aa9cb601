"""Checkpoints of the fused optimizers: round trips, bitwise resume, and torch.optim state-dict interop."""
import copy
import io

import pytest
import torch

import ampfused
from backends import cpu_backends, set_grad
from oracle import assert_bitwise

SHAPES = [(5, 4), (9,), (2, 3)]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _run(opt, params, steps, start=0):
    for k in range(start, start + steps):
        for p, g in zip(params, _grads(k, params[0].dtype)):
            set_grad(p, g)
        opt.step()


MAKERS = {
    "adamw": lambda ps, b: ampfused.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, backend=b),
    "adam": lambda ps, b: ampfused.FusedAdam(ps, lr=1e-2, weight_decay=0.01, backend=b),
    "sgd": lambda ps, b: ampfused.FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True, backend=b),
}


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", list(MAKERS))
def test_resume_from_checkpoint_is_bitwise_identical(kind, backend):
    ref_params = _params(torch.bfloat16)
    ref = MAKERS[kind](ref_params, backend)
    _run(ref, ref_params, 10)

    params = _params(torch.bfloat16)
    opt = MAKERS[kind](params, backend)
    _run(opt, params, 4)
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    params2 = _params(torch.bfloat16, seed=7)  # a fresh run with other weights, then restored
    with torch.no_grad():
        for p, w in zip(params2, ckpt["model"]):
            p.copy_(w)
    opt2 = MAKERS[kind](params2, backend)
    opt2.load_state_dict(ckpt["opt"])
    _run(opt2, params2, 6, start=4)
    for a, b in zip(ref_params, params2):
        assert_bitwise("resumed params", a.detach(), b.detach())
    sd_a, sd_b = ref.state_dict()["state"], opt2.state_dict()["state"]
    for i in sd_a:
        for k, v in sd_a[i].items():
            if isinstance(v, torch.Tensor):
                assert_bitwise(f"state[{i}][{k}]", v, sd_b[i][k])


def test_state_dict_layout_is_torchs():
    params = _params(torch.bfloat16)
    opt = ampfused.FusedAdamW(params, lr=1e-3)
    _run(opt, params, 2)
    sd = opt.state_dict()
    assert sorted(sd) == ["param_groups", "state"]
    assert sd["param_groups"][0]["params"] == [0, 1, 2]
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32 and st["step"].item() == 2
        assert st["exp_avg"].shape == p.shape and st["exp_avg"].dtype == torch.float32
        assert_bitwise("master rounds to param", st["master_param"].to(p.dtype), p.detach())


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_torch_adam_state_dict_loads_both_ways(kind):
    tcls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    fcls = ampfused.FusedAdamW if kind == "adamw" else ampfused.FusedAdam
    # torch optimizer over fp32 params, then the fused optimizer continues from its state
    tparams = _params(torch.float32)
    topt = tcls(tparams, lr=1e-2, weight_decay=0.05, foreach=False)
    _run(topt_wrap := _GradsIntoTorch(topt, tparams), tparams, 3)
    fparams = [p.detach().clone().requires_grad_() for p in tparams]
    fopt = fcls(fparams, lr=1e-3, weight_decay=0.0)
    fopt.load_state_dict(copy.deepcopy(topt.state_dict()))
    assert fopt.param_groups[0]["lr"] == 1e-2 and fopt.param_groups[0]["weight_decay"] == 0.05
    _run(topt_wrap, tparams, 3, start=3)
    _run(fopt, fparams, 3, start=3)
    for a, b in zip(tparams, fparams):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    # and back: the fused optimizer's state continues in torch's optimizer
    tparams2 = [p.detach().clone().requires_grad_() for p in fparams]
    topt2 = tcls(tparams2, lr=1e-2, foreach=False)
    topt2.load_state_dict(copy.deepcopy(fopt.state_dict()))
    _run(_GradsIntoTorch(topt2, tparams2), tparams2, 2, start=6)
    _run(fopt, fparams, 2, start=6)
    for a, b in zip(tparams2, fparams):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)


def test_torch_sgd_state_dict_loads_both_ways():
    tparams = _params(torch.float32)
    topt = torch.optim.SGD(tparams, lr=0.1, momentum=0.9, foreach=False)
    wrap = _GradsIntoTorch(topt, tparams)
    _run(wrap, tparams, 3)
    fparams = [p.detach().clone().requires_grad_() for p in tparams]
    fopt = ampfused.FusedSGD(fparams, lr=0.1, momentum=0.9)
    fopt.load_state_dict(copy.deepcopy(topt.state_dict()))
    _run(wrap, tparams, 3, start=3)
    _run(fopt, fparams, 3, start=3)
    for a, b in zip(tparams, fparams):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    topt2 = torch.optim.SGD([p.detach().clone().requires_grad_() for p in fparams], lr=0.1, momentum=0.9)
    topt2.load_state_dict(copy.deepcopy(fopt.state_dict()))
    assert all(s["momentum_buffer"] is not None for s in topt2.state.values())


def test_fresh_sgd_state_has_no_momentum_buffer_like_torch():
    params = _params(torch.float32)
    sd = ampfused.FusedSGD(params, lr=0.1, momentum=0.9).state_dict()
    assert all(s["momentum_buffer"] is None for s in sd["state"].values())


def test_load_rejects_mismatched_state_before_changing_anything():
    params = _params(torch.bfloat16)
    opt = ampfused.FusedAdamW(params, lr=1e-3)
    _run(opt, params, 2)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["state"][1]["exp_avg"] = torch.zeros(3)
    bad["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 1 must have 9 elements like the parameter"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    after = opt.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-3
    for i in before["state"]:
        for k, v in before["state"][i].items():
            assert_bitwise(f"{i}.{k}", v, after["state"][i][k])


class _GradsIntoTorch:
    """Lets _run drive a torch optimizer: gives params a .grad to copy into, then steps."""

    def __init__(self, opt, params):
        self.opt = opt
        for p in params:
            p.grad = torch.zeros_like(p)

    def step(self):
        self.opt.step()
