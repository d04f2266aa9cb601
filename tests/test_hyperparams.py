"""Hyperparameters as schedulers and users change them, and bad input that must change nothing.

Every value a scheduler can touch (``lr``, ``betas``, ``weight_decay``, ``eps``, ``momentum``,
``max_grad_norm``), changed per group between steps, takes effect at the next step on every backend, as in
the torch recipe given the same changes. Invalid values fail at construction, in ``add_param_group``, in
``load_state_dict`` and at the next step when set later through ``param_groups``, each before anything
changes; a state dict that does not fit leaves every buffer of the optimizer as it was.
"""
import copy
import math

import pytest
import torch
from torch import nn

import ampfused
from backends import cpu_backends, snapshot
from oracle import assert_bitwise, assert_close_to_oracle
from recipe import TorchRecipe, masters_of


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in [(4, 3), (5,), (2, 2)]]


def _groups(params, **first):
    return [dict({"params": params[:2]}, **first), {"params": params[2:], "lr": 3e-2}]


def _same_changes(torch_opt, fused_opt):
    for tg, fg in zip(torch_opt.param_groups, fused_opt.param_groups):
        for k in ("lr", "betas", "weight_decay", "eps", "momentum", "dampening"):
            if k in fg and k in tg:
                tg[k] = fg[k]


def _step_both(params, opt, recs, gen, max_norms):
    grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for rec in recs:
        _same_changes(rec.opt, opt)
        # the recipe clips each group by its own max_grad_norm from the global norm, as the fused step does
        for m, g in zip(rec.masters, grads):
            m.grad = g.to(rec.master_dtype).clone()
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in rec.masters]))
        for group, mn in zip(rec.opt.param_groups, max_norms()):
            if mn is not None:
                coef = torch.clamp(mn / (total + 1e-6), max=1.0)
                for m in group["params"]:
                    m.grad.mul_(coef)
        rec.opt.step()
        with torch.no_grad():
            for p, m in zip(rec.params, rec.masters):
                p.copy_(m.detach())


def _check(params, opt, recs, what):
    for i, (p, m) in enumerate(zip(params, masters_of(opt, params))):
        assert_close_to_oracle(f"{what} master[{i}]", m, recs[0].masters[i].detach(), recs[1].masters[i].detach())
        assert_bitwise(f"{what} param[{i}]", p.detach(), m.to(p.dtype))


def _recipes(params, cls, hyper):
    groups32, groups64 = [], []
    rec32 = TorchRecipe(params, torch.optim.SGD, dict(lr=0.1))
    rec64 = TorchRecipe(params, torch.optim.SGD, dict(lr=0.1), master_dtype=torch.float64)
    for rec, groups in ((rec32, groups32), (rec64, groups64)):
        rec.opt = cls([{"params": rec.masters[:2]}, {"params": rec.masters[2:], "lr": 3e-2}], **hyper, foreach=False)
    return rec32, rec64


ADAMW = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8)
SGD = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("backend", cpu_backends())
def test_changes_to_every_hyperparameter_take_effect_at_the_next_step(backend):
    params = _params()
    opt = ampfused.FusedAdamW(_groups(params), **ADAMW, max_grad_norm=1.0, backend=backend)
    recs = _recipes(params, torch.optim.AdamW, ADAMW)
    gen = torch.Generator().manual_seed(1)
    changes = [
        {},
        {0: dict(lr=5e-3)},
        {1: dict(betas=(0.8, 0.95))},
        {0: dict(weight_decay=0.5, eps=1e-3)},
        {1: dict(max_grad_norm=0.05)},
        {0: dict(max_grad_norm=None, lr=torch.tensor(2e-2))},
    ]
    for k, change in enumerate(changes):
        for gi, kv in change.items():
            opt.param_groups[gi].update(kv)
        _step_both(params, opt, recs, gen, lambda: [g["max_grad_norm"] for g in opt.param_groups])
        _check(params, opt, recs, f"after change {k}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_sgd_momentum_and_dampening_changes(backend):
    params = _params(1)
    opt = ampfused.FusedSGD(_groups(params), **SGD, backend=backend)
    recs = _recipes(params, torch.optim.SGD, SGD)
    gen = torch.Generator().manual_seed(2)
    for k, change in enumerate([{}, {0: dict(momentum=0.5)}, {1: dict(dampening=0.3, weight_decay=0.0)}, {}]):
        for gi, kv in change.items():
            opt.param_groups[gi].update(kv)
        _step_both(params, opt, recs, gen, lambda: [None, None])
        _check(params, opt, recs, f"sgd change {k}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_one_cycle_with_momentum_cycling_and_reduce_on_plateau(backend):
    params = _params(2)
    opt = ampfused.FusedAdamW(_groups(params), **ADAMW, backend=backend)
    recs = _recipes(params, torch.optim.AdamW, ADAMW)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=6, cycle_momentum=True,
                                                base_momentum=0.8, max_momentum=0.95)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    gen = torch.Generator().manual_seed(3)
    seen = set()
    for k in range(5):
        _step_both(params, opt, recs, gen, lambda: [None, None])
        _check(params, opt, recs, f"one-cycle step {k}")
        seen.add(opt.param_groups[0]["betas"][0])
        sched.step()
        plateau.step(1.0)  # a loss that never improves: the lr halves every step
    assert len(seen) > 2  # beta1 really cycled


BAD_LATER = [
    (dict(lr=-1.0), "Invalid learning rate: -1.0 in param_groups\\[0\\]"),
    (dict(lr=math.nan), "Invalid learning rate: nan in param_groups\\[0\\]"),
    (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0: 1.0 in param_groups\\[0\\]"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1 in param_groups\\[0\\]"),
    (dict(eps=-1e-8), "Invalid epsilon value: -1e-08 in param_groups\\[0\\]"),
    (dict(weight_decay=math.nan), "Invalid weight_decay value: nan in param_groups\\[0\\]"),
    (dict(max_grad_norm=0.0), "Invalid max_grad_norm: 0.0 in param_groups\\[0\\]"),
    (dict(max_grad_norm=-1.0), "Invalid max_grad_norm: -1.0 in param_groups\\[0\\]"),
    (dict(max_grad_norm=math.nan), "Invalid max_grad_norm: nan in param_groups\\[0\\]"),
]


@pytest.mark.parametrize("bad,msg", BAD_LATER, ids=[m[:30] for _, m in BAD_LATER])
def test_bad_values_set_later_fail_at_the_next_step_before_any_change(bad, msg):
    params = _params()
    opt = ampfused.FusedAdamW(_groups(params), **ADAMW)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = snapshot(opt, params)
    opt.param_groups[0].update(bad)
    with pytest.raises(ValueError, match=msg):
        opt.step()
    for i, (a, b) in enumerate(zip(before, snapshot(opt, params))):
        assert_bitwise(f"tensor {i}", a, b)


def test_bad_sgd_momentum_set_later():
    params = _params()
    opt = ampfused.FusedSGD(params, lr=0.1, momentum=0.9)
    opt.param_groups[0]["momentum"] = -0.5
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="Invalid momentum value: -0.5 in param_groups\\[0\\]"):
        opt.step()
    assert all(not any(s.has_state) for s in opt._segs.segments)


@pytest.mark.parametrize("kw,msg", [
    (dict(lr=math.nan), "Invalid learning rate: nan"),
    (dict(lr=torch.tensor(-1.0)), "Invalid learning rate: -1.0"),
    (dict(lr=torch.tensor(math.nan)), "Invalid learning rate: nan"),
    (dict(lr=torch.tensor([1.0, 2.0])), "Tensor lr must be 1-element"),
    (dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1: 1.0"),
    (dict(eps=-1.0), "Invalid epsilon value: -1.0"),
    (dict(max_grad_norm=0.0), "Invalid max_grad_norm: 0.0"),
    (dict(max_grad_norm=-2.0), "Invalid max_grad_norm: -2.0"),
    (dict(max_grad_norm=math.nan), "Invalid max_grad_norm: nan"),
])
def test_construction_refuses_what_torch_refuses_and_more(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ampfused.FusedAdamW(_params(), **kw)
    if "max_grad_norm" not in kw:  # the same message as torch where torch has the rule
        with pytest.raises(ValueError, match=msg):
            torch.optim.AdamW(_params(), **kw)


@pytest.mark.parametrize("group,msg", [
    (dict(max_grad_norm=-1.0), "Invalid max_grad_norm: -1.0 in param_groups\\[1\\]"),
    (dict(lr=-1.0), "Invalid learning rate: -1.0 in param_groups\\[1\\]"),
    (dict(betas=(2.0, 0.9)), "Invalid beta parameter at index 0: 2.0 in param_groups\\[1\\]"),
])
def test_add_param_group_refuses_bad_groups_without_adding_them(group, msg):
    params = _params()
    opt = ampfused.FusedAdamW(params[:2], **ADAMW)
    with pytest.raises(ValueError, match=msg):
        opt.add_param_group(dict({"params": params[2:]}, **group))
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": params[2:]})  # the parameters were not taken by the failed call
    assert len(opt.param_groups) == 2


def _trained_adamw():
    params = _params()
    opt = ampfused.FusedAdamW(_groups(params), **ADAMW, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
    return params, opt


def _mangle(sd, how):
    sd = copy.deepcopy(sd)
    if how == "group size":
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:1]
    elif how == "group count":
        sd["param_groups"] = sd["param_groups"][:1]
    elif how == "shape":
        sd["state"][1]["exp_avg"] = torch.zeros(4)
    elif how == "missing key":
        del sd["state"][2]["exp_avg_sq"]
    elif how == "dtype":
        sd["state"][0]["exp_avg"] = torch.zeros(4, 3, dtype=torch.int32)
    elif how == "meta":
        sd["state"][2]["exp_avg_sq"] = torch.zeros(2, 2, device="meta")
    elif how == "not a tensor":
        sd["state"][0]["master_param"] = [0.0] * 12
    elif how == "bad lr":
        sd["param_groups"][1]["lr"] = -3.0
    elif how == "no step":
        del sd["state"][1]["step"]
    return sd


MANGLED = {
    "group size": "doesn't match the size of optimizer's group",
    "group count": "different number of parameter groups",
    "shape": "loaded state 'exp_avg' of parameter 1 must have 5 elements like the parameter \\(shape \\(5,\\)\\)",
    "missing key": "loaded state of parameter 2 lacks \\['exp_avg_sq'\\]",
    "dtype": "loaded state 'exp_avg' of parameter 0 has dtype torch.int32",
    "meta": "loaded state 'exp_avg_sq' of parameter 2 is a meta tensor",
    "not a tensor": "loaded state 'master_param' of parameter 0 must be a tensor, got list",
    "bad lr": "Invalid learning rate: -3.0 in loaded param_groups\\[1\\]",
    "no step": "loaded optimizer state of parameter 1 has no usable step",
}


@pytest.mark.parametrize("how", list(MANGLED))
def test_load_state_dict_that_does_not_fit_changes_nothing(how):
    params, opt = _trained_adamw()
    good = opt.state_dict()
    before = snapshot(opt, params)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError, match=MANGLED[how]):
        opt.load_state_dict(_mangle(good, how))
    for i, (a, b) in enumerate(zip(before, snapshot(opt, params))):
        assert_bitwise(f"tensor {i}", a, b)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    opt.load_state_dict(good)  # and the optimizer still takes a good one


def test_a_hyperparameter_list_changed_in_place_is_checked_at_the_next_step():
    p = torch.nn.Parameter(torch.ones(4))
    opt = ampfused.FusedAdam([{"params": [p], "betas": [0.9, 0.999]}], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["betas"][1] = 1.5
    before = p.detach().clone()
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        opt.step()
    assert torch.equal(p.detach(), before)
