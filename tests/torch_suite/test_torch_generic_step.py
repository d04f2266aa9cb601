"""Ports of the generic step tests of PyTorch's test/test_optim.py to the fused optimizers, each against
torch's optimizer on the same values: param groups with their own lr / weight decay, add_param_group,
zero_grad, steps without gradients or with zero gradients, step pre/post hooks, closures, tensor lr and
tensor betas, schedulers, duplicate parameters, printing."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ampfused
from ampfused.optim import _params as P
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from suite_helpers import FUSED, grads_for, make_params, run_steps

TOL = dict(rtol=1e-6, atol=1e-7)  # fp32 parameters: the same math as torch's, a few ulps apart at most


def _twins(dtype=torch.float32):
    base = make_params(dtype)
    return [p.detach().clone().requires_grad_() for p in base], [p.detach().clone().requires_grad_() for p in base]


def _same(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **(tol or TOL))


@pytest.mark.parametrize("torch_cls", list(FUSED))
def test_param_groups_with_their_own_lr_and_weight_decay(torch_cls):
    """torch's test_param_groups_weight_decay / test_param_groups_lr."""
    tp, fp = _twins()
    groups = lambda ps: [{"params": ps[:1], "lr": 3e-2, "weight_decay": 0.2}, {"params": ps[1:]}]  # noqa: E731
    topt, fopt = torch_cls(groups(tp), lr=1e-2), FUSED[torch_cls](groups(fp), lr=1e-2)
    grads = grads_for(tp, 3, torch.float32)
    run_steps(topt, tp, grads)
    run_steps(fopt, fp, grads)
    _same(fp, tp)


@pytest.mark.parametrize("torch_cls", list(FUSED))
def test_add_param_group_mid_training(torch_cls):
    """torch's test_add_param_group: defaults fill the new group, its own keys win, state starts fresh."""
    tp, fp = _twins()
    topt, fopt = torch_cls(tp[:2], lr=1e-2), FUSED[torch_cls](fp[:2], lr=1e-2)
    grads = grads_for(tp, 4, torch.float32)
    run_steps(topt, tp[:2], [g[:2] for g in grads[:2]])
    run_steps(fopt, fp[:2], [g[:2] for g in grads[:2]])
    topt.add_param_group({"params": [tp[2]], "lr": 5e-2})
    fopt.add_param_group({"params": [fp[2]], "lr": 5e-2})
    assert set(fopt.param_groups[1]) == set(fopt.param_groups[0])
    assert {k: fopt.param_groups[1][k] for k in topt.param_groups[1]} == topt.param_groups[1] | {
        "params": fopt.param_groups[1]["params"]}
    run_steps(topt, tp, grads[2:])
    run_steps(fopt, fp, grads[2:])
    _same(fp, tp)
    with pytest.raises(ValueError, match="^some parameters appear in more than one parameter group$"):
        fopt.add_param_group({"params": [fp[0]]})
    with pytest.raises(TypeError, match="param_group must be a dict"):
        fopt.add_param_group([fp[0]])
    with pytest.raises(TypeError, match="ordering of tensors in sets will change"):
        fopt.add_param_group({"params": {torch.zeros(2, requires_grad=True)}})


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    """torch's test_zero_grad: None or zeroed in place; the next step reads whatever backward writes."""
    tp, fp = _twins()
    topt, fopt = torch.optim.AdamW(tp, lr=1e-2), ampfused.FusedAdamW(fp, lr=1e-2)
    grads = grads_for(tp, 3, torch.float32)
    for k, step_grads in enumerate(grads):
        for opt, ps in ((topt, tp), (fopt, fp)):
            if k and not set_to_none:  # accumulate into the zeroed gradients, as backward does
                for p, g in zip(ps, step_grads):
                    p.grad.add_(g)
            else:
                for p, g in zip(ps, step_grads):
                    p.grad = g.clone()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            assert all((p.grad is None) if set_to_none else bool((p.grad == 0).all()) for p in ps)
    _same(fp, tp)


@pytest.mark.parametrize("torch_cls", list(FUSED))
def test_step_without_gradients_is_a_noop(torch_cls):
    """torch's test_step_is_noop_when_params_have_no_grad: nothing changes, no state appears."""
    _, fp = _twins()
    opt = FUSED[torch_cls](fp, lr=1e-2)
    before = [p.detach().clone() for p in fp]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, fp))
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize("torch_cls", list(FUSED))
def test_step_with_zero_gradients_is_a_noop(torch_cls):
    """torch's test_step_is_noop_for_zero_grads (no weight decay): the parameters keep their values."""
    tp, fp = _twins()
    topt, fopt = torch_cls(tp, lr=1e-2, weight_decay=0.0), FUSED[torch_cls](fp, lr=1e-2, weight_decay=0.0)
    zeros = [[torch.zeros_like(p) for p in tp]] * 2
    run_steps(topt, tp, zeros)
    run_steps(fopt, fp, zeros)
    _same(fp, tp, rtol=0, atol=0)
    assert all(torch.equal(p, q) for p, q in zip(fp, make_params(torch.float32)))


def test_step_hooks_as_in_torch():
    """torch's test_step_pre_hook / test_step_post_hook / test_step_all_hooks: global and per-optimizer hooks
    in torch's order; a pre-hook's returned (args, kwargs) reach step; removing a handle stops a hook."""
    logs = {}
    for name, cls in (("torch", torch.optim.SGD), ("ours", ampfused.FusedSGD)):
        log = logs[name] = []
        ps = make_params(torch.float32)
        opt = cls(ps, lr=1e-2)
        hs = [register_optimizer_step_pre_hook(lambda o, a, k: log.append("global pre")),
              register_optimizer_step_post_hook(lambda o, a, k: log.append("global post")),
              opt.register_step_pre_hook(lambda o, a, k: log.append("pre")),
              opt.register_step_post_hook(lambda o, a, k: log.append("post"))]
        try:
            for p in ps:
                p.grad = torch.ones_like(p)
            opt.step()
            loss = opt.step(lambda: torch.tensor(2.0))
            assert loss == 2.0
            hs.pop(2).remove()
            opt.step()
        finally:
            for h in hs:
                h.remove()
    assert logs["ours"] == logs["torch"]
    assert logs["ours"][:4] == ["global pre", "pre", "post", "global post"]


def test_step_pre_hook_can_replace_the_arguments():
    for cls in (torch.optim.SGD, ampfused.FusedSGD):
        ps = make_params(torch.float32)
        opt = cls(ps, lr=1e-2)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": lambda: torch.tensor(7.0)}))
        assert opt.step() == 7.0


@pytest.mark.parametrize("torch_cls", list(FUSED))
def test_closure_runs_with_grad_enabled_and_its_loss_is_returned(torch_cls):
    tp, fp = _twins()
    results = []
    for cls, ps in ((torch_cls, tp), (FUSED[torch_cls], fp)):
        opt = cls(ps, lr=1e-2)

        def closure():
            opt.zero_grad()
            loss = sum((p * p).sum() for p in ps)
            loss.backward()
            return loss

        results.append([float(opt.step(closure).detach()) for _ in range(3)])
    assert results[0] == pytest.approx(results[1], rel=1e-6)
    _same(fp, tp)


@pytest.mark.parametrize("torch_cls", list(FUSED))
def test_tensor_lr_changed_between_steps(torch_cls):
    """torch's test_tensor_lr: a 0-d tensor lr, edited in place between steps (as a scheduler may)."""
    tp, fp = _twins()
    tlr, flr = torch.tensor(1e-2), torch.tensor(1e-2)
    topt, fopt = torch_cls(tp, lr=tlr), FUSED[torch_cls](fp, lr=flr)
    for k, g in enumerate(grads_for(tp, 3, torch.float32)):
        run_steps(topt, tp, [g])
        run_steps(fopt, fp, [g])
        tlr.mul_(0.5)
        flr.mul_(0.5)
    _same(fp, tp)


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_tensor_betas_on_the_cpu_follow_in_place_edits(torch_cls, shape):
    """CPU tensor betas (0-d or 1-element) are read where they are at every step, as torch reads them:
    an in-place edit between steps is seen by both."""
    tp, fp = _twins()
    tb = (torch.full(shape, 0.9), torch.full(shape, 0.99))
    fb = (torch.full(shape, 0.9), torch.full(shape, 0.99))
    topt, fopt = torch_cls(tp, lr=1e-2, betas=tb), FUSED[torch_cls](fp, lr=1e-2, betas=fb)
    assert all(b.dim() == 0 for b in fopt.param_groups[0]["betas"])  # squeezed as torch squeezes them
    for g in grads_for(tp, 3, torch.float32):
        run_steps(topt, tp, [g])
        run_steps(fopt, fp, [g])
        for b in (topt.param_groups[0]["betas"][0], fopt.param_groups[0]["betas"][0]):
            b.sub_(0.1)
    _same(fp, tp)
    fopt.param_groups[0]["betas"][1].fill_(1.0)  # edited in place to an invalid value: the next step says so
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: .*in param_groups\[0\]"):
        run_steps(fopt, fp, grads_for(fp, 1, torch.float32))


def test_tensor_betas_refusals_match_torch():
    ps = make_params(torch.float32)
    for betas, message in (((0.9, torch.tensor(0.99)), "betas must be either both floats or both Tensors"),
                           ((torch.tensor([0.9, 0.8]), torch.tensor(0.99)), r"Tensor betas\[0\] must be 1-element"),
                           ((torch.tensor(1.5), torch.tensor(0.99)), "Invalid beta parameter at index 0")):
        with pytest.raises(ValueError, match=message):
            ampfused.FusedAdamW(ps, betas=betas)
    with pytest.raises(ValueError, match=r"betas\[0\] as a Tensor is not supported for capturable=False and "
                                         "foreach=True"):
        ampfused.FusedAdam(ps, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True)
    ampfused.FusedAdam(ps, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True, capturable=True)


def test_a_device_beta_is_read_once_per_change():
    """hyper_value, which the step uses for tensor hyperparameters: a CPU tensor is read every time; a device
    tensor's value is remembered against its version counter (read again only after an in-place edit). The
    device branch is exercised with a tensor subclass that reports a device of another type."""
    reads = []

    class OnDevice(torch.Tensor):
        @property
        def device(self):
            return torch.device("meta") if getattr(self, "_as_meta", False) else torch.device("cuda", 0)

        def cpu(self, *a, **k):
            reads.append(1)
            return torch.Tensor(self.as_subclass(torch.Tensor)).clone()

    t = torch.tensor(0.9).as_subclass(OnDevice)
    assert P.hyper_value(t, "b") == pytest.approx(0.9) and len(reads) == 1
    assert P.hyper_value(t, "b") == pytest.approx(0.9) and len(reads) == 1  # remembered
    with torch.no_grad():
        t.as_subclass(torch.Tensor).fill_(0.5)
    assert P.hyper_value(t, "b") == pytest.approx(0.5) and len(reads) == 2  # the edit bumped the version
    assert P.hyper_value(torch.tensor(0.25), "b") == 0.25


@pytest.mark.parametrize("torch_cls", list(FUSED))
def test_schedulers_drive_the_fused_optimizers_as_torchs(torch_cls):
    """torch's scheduler tests in short: StepLR then a chained LambdaLR, the same lrs and parameters."""
    tp, fp = _twins()
    out = []
    for cls, ps in ((torch_cls, tp), (FUSED[torch_cls], fp)):
        opt = cls(ps, lr=1e-1)
        sched = torch.optim.lr_scheduler.ChainedScheduler([
            torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))])
        lrs = []
        for g in grads_for(ps, 5, torch.float32):
            run_steps(opt, ps, [g])
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        out.append(lrs)
    assert out[0] == out[1]
    _same(fp, tp)


def test_one_cycle_lr_with_tensor_lr_and_momentum_cycling():
    """OneCycleLR cycles SGD's momentum and Adam's beta1 through param_groups; both follow."""
    for torch_cls, extra in ((torch.optim.SGD, dict(momentum=0.9)), (torch.optim.AdamW, {})):
        tp, fp = _twins()
        for cls, ps in ((torch_cls, tp), (FUSED[torch_cls], fp)):
            opt = cls(ps, lr=1e-2, **extra)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)
            for g in grads_for(ps, 5, torch.float32):
                run_steps(opt, ps, [g])
                sched.step()
        _same(fp, tp)


@pytest.mark.parametrize("torch_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_duplicate_parameter_in_a_group_warns_and_is_updated_once(torch_cls):
    """torch warns and updates such a parameter once per listing; the fused step warns the same and updates
    it once (docs/differences-from-torch.md): as the parameter listed once would be."""
    ps = make_params(torch.float32)
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        torch_cls(ps + ps[:1], lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fopt = FUSED[torch_cls](ps + ps[:1], lr=1e-2)
    assert any("duplicate parameters; in future, this will cause an error" in str(w.message) for w in caught)
    once = [p.detach().clone().requires_grad_() for p in ps]
    ref = FUSED[torch_cls](once, lr=1e-2)
    grads = grads_for(ps, 2, torch.float32)
    run_steps(fopt, ps, grads)
    run_steps(ref, once, grads)
    assert all(torch.equal(a, b) for a, b in zip(ps, once))
    with pytest.warns(UserWarning):
        topt = torch_cls(ps + ps[:1], lr=1e-2)
    assert fopt.state_dict()["param_groups"][0]["params"] == topt.state_dict()["param_groups"][0]["params"]


def test_duplicate_parameters_across_groups_fail_as_in_torch():
    ps = make_params(torch.float32)
    for cls in (torch.optim.AdamW, ampfused.FusedAdamW):
        with pytest.raises(ValueError, match="^some parameters appear in more than one parameter group$"):
            cls([{"params": ps[:2]}, {"params": ps[1:]}])


def test_optimizers_can_be_printed_and_copied():
    """torch's test_optimizer_can_be_printed, and a deep copy before any step."""
    for cls in FUSED.values():
        opt = cls(make_params(torch.float32), lr=torch.tensor(1e-2))
        text = repr(opt)
        assert text.startswith(cls.__name__) and "lr:" in text and "Parameter Group 0" in text
        assert repr(copy.deepcopy(opt)).startswith(cls.__name__)
