"""The intended differences from torch.optim and torch.amp.GradScaler (docs/differences-from-torch.md), each
tested to be exactly what the page says: the refusals with their errors, ``.grad`` left scaled by the fused
step, the skip on non-finite gradients without a scaler, fp32 state for low-precision parameters, the
arguments accepted where torch refuses them."""
from __future__ import annotations

import warnings

import pytest
import torch

import ampfused
from suite_helpers import DOCUMENTED_REFUSALS, FUSED, make_params


# (FusedAdafactor takes neither amsgrad nor differentiable, as torch.optim.Adafactor, and refuses complex
# parameters with torch's message: tests/test_adafactor_optim.py)
@pytest.mark.parametrize("cls", [c for c in FUSED.values() if c is not ampfused.FusedAdafactor])
def test_documented_refusals_name_the_rule(cls):
    ps = make_params(torch.float32)
    if cls is not ampfused.FusedSGD:
        error, message = DOCUMENTED_REFUSALS["amsgrad"]
        with pytest.raises(error, match=message):
            cls(ps, amsgrad=True)
    error, message = DOCUMENTED_REFUSALS["differentiable"]
    with pytest.raises(error, match=message):
        cls(ps, differentiable=True)
    for dtype in (torch.float64, torch.complex64):
        with pytest.raises(TypeError, match=f"has dtype {dtype}; fused optimizers take float32, bfloat16 or float16"):
            cls([torch.zeros(3, dtype=dtype, requires_grad=True)])
    with pytest.raises(TypeError, match="is sparse .*fused optimizers need dense parameters"):
        cls([torch.zeros(3).to_sparse().requires_grad_()])
    with pytest.raises(ValueError, match="is not dense"):
        cls([torch.zeros(4, 4)[:, :2].requires_grad_()])


def test_sgd_takes_a_number_for_weight_decay():
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        ampfused.FusedSGD(make_params(torch.float32), weight_decay=torch.tensor(0.1))
    torch.optim.SGD(make_params(torch.float32), weight_decay=torch.tensor(0.1))  # torch takes it


def test_accepted_where_torch_refuses():
    ps = make_params(torch.float32)
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        torch.optim.AdamW(ps, betas=(0, 0.9))
    ampfused.FusedAdamW(ps, betas=(0, 0.9))
    with pytest.raises(TypeError):
        torch.optim.SGD(ps, capturable=True)
    ampfused.FusedSGD(ps, capturable=True)


def test_torchs_flag_rules_still_apply():
    ps = make_params(torch.float32)
    for cls in (torch.optim.AdamW, ampfused.FusedAdamW, torch.optim.SGD, ampfused.FusedSGD):
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together."):
            cls(ps, fused=True, foreach=True)
    for cls in (torch.optim.Adam, ampfused.FusedAdam):
        with pytest.raises(ValueError, match="lr as a Tensor is not supported for capturable=False and foreach=True"):
            cls(ps, lr=torch.tensor(0.1), foreach=True)


@pytest.mark.parametrize("cls", [ampfused.FusedAdamW, ampfused.FusedSGD])
def test_the_fused_step_leaves_grad_scaled_and_unscale_writes_it(cls):
    """After scaler.step the fused optimizer's ``.grad`` still holds the scaled gradients (torch's optimizers
    leave them unscaled); calling unscale_ first writes the unscaled ones, as torch's does."""
    for unscale_first in (False, True):
        results = {}
        for name, opt_cls, scaler_cls in (("torch", FUSED_TO_TORCH[cls], torch.amp.GradScaler),
                                          ("ours", cls, ampfused.GradScaler)):
            p = torch.nn.Parameter(torch.ones(4))
            opt = opt_cls([p], lr=0.1)
            scaler = scaler_cls("cpu", init_scale=8.0)
            scaler.scale((p * 2).sum()).backward()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            results[name] = p.grad.clone()
        assert torch.equal(results["torch"], torch.full((4,), 2.0))
        assert torch.equal(results["ours"], torch.full((4,), 2.0 if unscale_first else 16.0))


FUSED_TO_TORCH = {v: k for k, v in FUSED.items()}


@pytest.mark.parametrize("cls", list(FUSED.values()))
def test_non_finite_gradients_skip_the_step_without_a_scaler(cls):
    """torch steps on a NaN gradient and writes NaN into the weights; the fused step changes nothing and says
    so on the device."""
    tp, fp = make_params(torch.float32), make_params(torch.float32)
    topt, fopt = FUSED_TO_TORCH[cls](tp, lr=0.1), cls(fp, lr=0.1)
    for ps in (tp, fp):
        for p in ps:
            p.grad = torch.ones_like(p)
        ps[0].grad[0, 0] = float("nan")
    topt.step()
    fopt.step()
    assert torch.isnan(tp[0]).any()
    assert all(torch.equal(p, q) for p, q in zip(fp, make_params(torch.float32)))
    assert bool(fopt.last_step_skipped)
    # the skipped step's parameters have (empty) state entries: step 0, zero moments; they load into torch as
    # a fresh state would
    for st in fopt.state_dict()["state"].values():
        assert all(not bool(v.any()) for v in st.values() if isinstance(v, torch.Tensor))


def test_low_precision_parameters_keep_fp32_state_and_masters():
    ps = make_params(torch.bfloat16)
    opt = ampfused.FusedAdamW(ps, lr=0.1)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    for k, st in opt.state_dict()["state"].items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        assert all(st[n].dtype == torch.float32 for n in ("exp_avg", "exp_avg_sq", "master_param"))
    ref = torch.optim.AdamW(make_params(torch.bfloat16), lr=0.1)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    ref.step()
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in ref.state_dict()["state"].values())


def test_a_param_repeated_in_a_group_is_updated_once_where_torch_updates_it_twice():
    results = {}
    for name, cls in (("torch", torch.optim.SGD), ("ours", ampfused.FusedSGD)):
        p = torch.nn.Parameter(torch.ones(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = cls([p, p], lr=0.1)
        p.grad = torch.ones(3)
        opt.step()
        results[name] = p.detach().clone()
    torch.testing.assert_close(results["torch"], torch.full((3,), 0.8))
    torch.testing.assert_close(results["ours"], torch.full((3,), 0.9))
