"""Ports of the generic state-dict tests of PyTorch's test/test_optim.py to the fused optimizers, each also
held against torch's optimizer on the same model: determinism of a save/load round trip, repeated param groups
(pytorch#36831), the layout of ``state_dict()`` (torch's keys, plus the documented ``master_param`` and
``max_grad_norm``), loading both ways, state that is not a parameter's, hooks on state_dict and
load_state_dict, different param group sizes, a non-tensor step, weights-only saving, deepcopy."""
from __future__ import annotations

import copy
import io
from collections import OrderedDict

import pytest
import torch

import ampfused
from suite_helpers import FUSED, grads_for, make_params, run_steps

KWARGS = {torch.optim.Adam: dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW: dict(lr=1e-2),
          torch.optim.SGD: dict(lr=1e-2, momentum=0.9, weight_decay=0.1)}
KWARGS[torch.optim.Adafactor] = dict(lr=1e-2, weight_decay=0.1)
CASES = [pytest.param(t, id=t.__name__) for t in FUSED] + [
    pytest.param(torch.optim.SGD, id="SGD-no-momentum")]


def _kwargs(torch_cls, case_id=None):
    kw = dict(KWARGS[torch_cls])
    if case_id == "SGD-no-momentum":
        kw["momentum"] = 0.0
    return kw


def _pair(torch_cls, kwargs, dtype=torch.float32, steps=2):
    """(torch's optimizer, its params, ours, our params) after ``steps`` steps on the same gradients."""
    base = make_params(dtype)
    grads = grads_for(base, steps, dtype)
    tparams = [p.detach().float().clone().requires_grad_() for p in base]
    topt = torch_cls(tparams, **kwargs)
    run_steps(topt, tparams, [[g.float() for g in s] for s in grads])
    fparams = [p.detach().clone().requires_grad_() for p in base]
    fopt = FUSED[torch_cls](fparams, **kwargs)
    run_steps(fopt, fparams, grads)
    return topt, tparams, fopt, fparams


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_deterministic(torch_cls, dtype):
    """torch's test_state_dict_deterministic: a copy loaded from the state dict steps bit for bit like the
    original, and repeated param groups (pytorch#36831) export identical entries."""
    _, _, opt, params = _pair(torch_cls, KWARGS[torch_cls], dtype)
    params2 = [p.detach().clone().requires_grad_() for p in params]
    opt2 = FUSED[torch_cls](params2, **KWARGS[torch_cls])
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    grads = grads_for(params, 3, dtype, seed=7)
    run_steps(opt, params, grads)
    run_steps(opt2, params2, grads)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)
    opt.param_groups.extend(opt.param_groups)
    sd = opt.state_dict()
    assert sd["param_groups"][-1] == sd["param_groups"][-2]


def test_repeated_param_groups_export_like_torch_and_the_step_refuses():
    topt, _, fopt, fparams = _pair(torch.optim.AdamW, KWARGS[torch.optim.AdamW])
    for opt in (topt, fopt):
        opt.param_groups.extend(opt.param_groups)
    t, f = topt.state_dict(), fopt.state_dict()
    assert [g["params"] for g in f["param_groups"]] == [g["params"] for g in t["param_groups"]]
    assert f["state"].keys() == t["state"].keys()
    before = [p.detach().clone() for p in fparams]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* is also in param_groups\[0\]"):
        fopt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, fparams))
    del fopt.param_groups[1:]  # without the repeats it steps again
    fopt.step()
    assert not torch.equal(before[0], fparams[0])


@pytest.mark.parametrize("torch_cls", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_layout_is_torchs(torch_cls, dtype, request):
    """Same group keys as torch's (plus max_grad_norm), same state entries and keys (plus master_param where
    fp32 masters exist), same types."""
    kwargs = _kwargs(torch_cls, request.node.callspec.id.split("-", 1)[1])
    topt, _, fopt, _ = _pair(torch_cls, kwargs, dtype)
    t, f = topt.state_dict(), fopt.state_dict()
    assert f.keys() == t.keys()
    for tg, fg in zip(t["param_groups"], f["param_groups"]):
        assert set(fg) - set(tg) == {"max_grad_norm"} and set(tg) <= set(fg)
        assert [k for k in fg if k in tg] == list(tg)  # torch's keys in torch's order
        assert {k: fg[k] for k in tg} == tg
    masters = {"master_param"} if dtype != torch.float32 else set()
    if kwargs.get("momentum", None) == 0.0 and masters:  # no state in torch; the masters alone here
        assert t["state"] == {} and all(set(st) == masters for st in f["state"].values())
        return
    assert f["state"].keys() == t["state"].keys()
    for k in t["state"]:
        assert set(f["state"][k]) == set(t["state"][k]) | masters
        for name, value in t["state"][k].items():
            assert type(f["state"][k][name]) is type(value)
            if isinstance(value, torch.Tensor):
                assert f["state"][k][name].shape == value.shape and f["state"][k][name].dtype == value.dtype
    if kwargs.get("momentum", None) == 0.0 and dtype == torch.float32:
        assert f["state"] == {} == t["state"]


@pytest.mark.parametrize("torch_cls", CASES)
def test_state_dicts_load_both_ways(torch_cls, request):
    kwargs = _kwargs(torch_cls, request.node.callspec.id)
    topt, tparams, fopt, fparams = _pair(torch_cls, kwargs)
    # torch's state into a fresh fused optimizer, ours into a fresh torch one; all four continue alike
    f2_params = [p.detach().clone().requires_grad_() for p in tparams]
    f2 = FUSED[torch_cls](f2_params, **kwargs)
    f2.load_state_dict(copy.deepcopy(topt.state_dict()))
    t2_params = [p.detach().clone().requires_grad_() for p in fparams]
    t2 = torch_cls(t2_params, **kwargs)
    t2.load_state_dict(copy.deepcopy(fopt.state_dict()))
    grads = grads_for(tparams, 2, torch.float32, seed=3)
    for opt, ps in ((topt, tparams), (fopt, fparams), (f2, f2_params), (t2, t2_params)):
        run_steps(opt, ps, grads)
    for ps in (fparams, f2_params, t2_params):
        for a, b in zip(ps, tparams):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_state_that_is_not_a_parameters_is_kept_like_torch():
    """torch's state_dict keeps keys a pre-hook (or a user) puts in optimizer.state, and load_state_dict puts
    them back."""
    def pre_hook(opt):
        opt.state["extra"] = {"note": 1}

    for torch_cls in (torch.optim.AdamW, torch.optim.SGD):
        topt, _, fopt, fparams = _pair(torch_cls, KWARGS[torch_cls])
        for opt in (topt, fopt):
            opt.register_state_dict_pre_hook(pre_hook)
        t, f = topt.state_dict(), fopt.state_dict()
        assert f["state"]["extra"] == t["state"]["extra"] == {"note": 1}
        fresh = FUSED[torch_cls]([p.detach().clone().requires_grad_() for p in fparams], **KWARGS[torch_cls])
        fresh.load_state_dict(f)
        assert fresh.state["extra"] == {"note": 1}
        assert set(fresh.state_dict()["state"]) == set(f["state"])


@pytest.mark.parametrize("torch_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_state_dict_hooks_as_in_torch(torch_cls):
    """Pre-hooks run before the export, post-hooks may replace the dict; both in registration order, prepend
    honoured; the same calls as torch's optimizer gets."""
    calls = {"torch": [], "ours": []}

    def hooks(log):
        return [lambda opt: log.append("pre"),
                lambda opt, sd: (log.append("post"), sd.update(marked=True))[0],
                lambda opt: log.append("pre-first")]

    for name, opt in (("torch", _pair(torch_cls, KWARGS[torch_cls])[0]), ("ours", _pair(torch_cls,
                                                                                         KWARGS[torch_cls])[2])):
        pre, post, first = hooks(calls[name])
        handles = [opt.register_state_dict_pre_hook(pre), opt.register_state_dict_post_hook(post),
                   opt.register_state_dict_pre_hook(first, prepend=True)]
        sd = opt.state_dict()
        assert sd["marked"] is True
        for h in handles:
            h.remove()
        assert "marked" not in opt.state_dict()
    assert calls["ours"] == calls["torch"] == ["pre-first", "pre", "post"]


@pytest.mark.parametrize("torch_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_load_state_dict_hooks_get_a_copy_as_in_torch(torch_cls):
    """torch shallow-copies the dict before its pre-hooks: a hook editing it does not change the caller's;
    what a pre-hook returns is loaded; post-hooks run after the load."""
    results = {}
    for name, opt in (("torch", _pair(torch_cls, KWARGS[torch_cls])[0]),
                      ("ours", _pair(torch_cls, KWARGS[torch_cls])[2])):
        sd = copy.deepcopy(opt.state_dict())
        keys_before = set(sd)
        log = []

        def pre(o, d):
            d["scribble"] = 1
            d["param_groups"] = copy.deepcopy(d["param_groups"])
            d["param_groups"][0]["lr"] = 0.5
            log.append("pre")

        def post(o):
            log.append(("post", o.param_groups[0]["lr"]))

        opt.register_load_state_dict_pre_hook(pre)
        opt.register_load_state_dict_post_hook(post)
        opt.register_load_state_dict_pre_hook(lambda o, d: log.append("first"), prepend=True)
        opt.load_state_dict(sd)
        results[name] = (set(sd) == keys_before, sd["param_groups"][0]["lr"], log, opt.param_groups[0]["lr"])
    assert results["ours"] == results["torch"] == (True, 1e-2, ["first", "pre", ("post", 0.5)], 0.5)


def test_load_state_dict_with_different_param_group_sizes_fails_as_in_torch():
    params = make_params(torch.float32)
    for torch_cls in FUSED:
        src = torch_cls([{"params": params[:1]}, {"params": params[1:]}], lr=0.1).state_dict()
        one_group = torch_cls(params, lr=0.1)
        fused_one = FUSED[torch_cls](params, lr=0.1)
        for opt in (one_group, fused_one):
            with pytest.raises(ValueError, match="different number of parameter groups"):
                opt.load_state_dict(copy.deepcopy(src))
        swapped = [{"params": params[:2]}, {"params": params[2:]}]
        for opt in (torch_cls(swapped, lr=0.1), FUSED[torch_cls](swapped, lr=0.1)):
            with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
                opt.load_state_dict(copy.deepcopy(src))


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_load_nontensor_step(torch_cls):
    """torch's test_load_nontensor_step: a state dict whose steps are Python numbers loads and continues."""
    topt, tparams, fopt, fparams = _pair(torch_cls, KWARGS[torch_cls])
    sd = copy.deepcopy(fopt.state_dict())
    for st in sd["state"].values():
        st["step"] = float(st["step"])
    fopt.load_state_dict(sd)
    grads = grads_for(tparams, 1, torch.float32, seed=5)
    run_steps(topt, tparams, grads)
    run_steps(fopt, fparams, grads)
    for a, b in zip(fparams, tparams):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("torch_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_save_load_with_weights_only(torch_cls):
    """torch's test_save_load_equality_with_weights_only: the state dict goes through torch.save and
    torch.load(weights_only=True)."""
    _, _, fopt, fparams = _pair(torch_cls, KWARGS[torch_cls], torch.bfloat16)
    buf = io.BytesIO()
    torch.save(fopt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    params2 = [p.detach().clone().requires_grad_() for p in fparams]
    opt2 = FUSED[torch_cls](params2, **KWARGS[torch_cls])
    opt2.load_state_dict(loaded)
    grads = grads_for(fparams, 2, torch.bfloat16, seed=9)
    run_steps(fopt, fparams, grads)
    run_steps(opt2, params2, grads)
    assert all(torch.equal(a, b) for a, b in zip(fparams, params2))


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.SGD])
def test_deepcopy_copies_all_public_attrs(torch_cls):
    """torch's test_deepcopy_copies_all_public_attrs, and the copy trains on its own like the original."""
    _, _, opt, params = _pair(torch_cls, KWARGS[torch_cls], torch.bfloat16)
    opt.extra_attr = OrderedDict(a=1)
    twin = copy.deepcopy(opt)
    public = lambda o: {k for k in vars(o) if not k.startswith("_")}  # noqa: E731
    assert public(twin) == public(opt)
    assert twin.extra_attr == opt.extra_attr and twin.extra_attr is not opt.extra_attr
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(twin_params, params))
    grads = grads_for(params, 2, torch.bfloat16, seed=11)
    run_steps(opt, params, grads)
    run_steps(twin, twin_params, grads)
    assert all(torch.equal(a, b) for a, b in zip(twin_params, params))


def test_empty_state_dict_before_any_step_matches_torch():
    params = make_params(torch.float32)
    for torch_cls in FUSED:
        t, f = torch_cls(params, lr=0.1).state_dict(), FUSED[torch_cls](params, lr=0.1).state_dict()
        assert f["state"] == t["state"] == {}
        assert {k: f["param_groups"][0][k] for k in t["param_groups"][0]} == t["param_groups"][0]


def test_loading_a_state_dict_of_torchs_other_adam_keeps_the_weight_decay_kind_as_torch_does():
    """torch loads the saved group keys, decoupled_weight_decay included, except that AdamW stays AdamW (its
    __setstate__ sets the key): Adam's state dict into AdamW steps AdamW, AdamW's into Adam steps AdamW."""
    for src_cls, dst_cls in ((torch.optim.Adam, torch.optim.AdamW), (torch.optim.AdamW, torch.optim.Adam)):
        tsrc = _pair(src_cls, dict(lr=1e-2, weight_decay=0.1))[0]
        params = make_params(torch.float32)
        tparams = [p.detach().clone().requires_grad_() for p in params]
        fparams = [p.detach().clone().requires_grad_() for p in params]
        topt, fopt = dst_cls(tparams, lr=1e-2), FUSED[dst_cls](fparams, lr=1e-2)
        topt.load_state_dict(copy.deepcopy(tsrc.state_dict()))
        fopt.load_state_dict(copy.deepcopy(tsrc.state_dict()))
        assert fopt.param_groups[0]["decoupled_weight_decay"] is topt.param_groups[0]["decoupled_weight_decay"]
        grads = grads_for(params, 2, torch.float32, seed=13)
        run_steps(topt, tparams, grads)
        run_steps(fopt, fparams, grads)
        for a, b in zip(fparams, tparams):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_can_load_older_state_dict(torch_cls):
    """torch's test_can_load_older_state_dict: a state dict without the newer group keys (foreach, fused,
    capturable, differentiable, decoupled_weight_decay, maximize) loads, the optimizer keeps its values for them,
    and steps as torch's does after the same load."""
    topt, tparams, fopt, fparams = _pair(torch_cls, KWARGS[torch_cls])
    old = copy.deepcopy(topt.state_dict())
    for g in old["param_groups"]:
        for key in ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay", "maximize"):
            g.pop(key, None)
    t2p, f2p = ([p.detach().clone().requires_grad_() for p in tparams] for _ in range(2))
    t2, f2 = torch_cls(t2p, **KWARGS[torch_cls]), FUSED[torch_cls](f2p, **KWARGS[torch_cls])
    t2.load_state_dict(copy.deepcopy(old))
    f2.load_state_dict(copy.deepcopy(old))
    assert {k: f2.param_groups[0][k] for k in t2.param_groups[0] if k != "params"} == {
        k: v for k, v in t2.param_groups[0].items() if k != "params"}
    grads = grads_for(tparams, 2, torch.float32, seed=17)
    run_steps(t2, t2p, grads)
    run_steps(f2, f2p, grads)
    for a, b in zip(f2p, t2p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_named_parameters_state_dict_like_torch():
    """torch's named-parameter groups: param_names exported and loaded, the same as torch's."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    t = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    f = ampfused.FusedAdamW(model.named_parameters(), lr=1e-2)
    assert f.param_groups[0]["param_names"] == t.param_groups[0]["param_names"] == ["0.weight", "0.bias",
                                                                                    "1.weight", "1.bias"]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    f.step()
    sd = f.state_dict()
    assert sd["param_groups"][0]["param_names"] == t.state_dict()["param_groups"][0]["param_names"]
    t.load_state_dict(copy.deepcopy(sd))
    assert t.param_groups[0]["param_names"] == sd["param_groups"][0]["param_names"]


def test_unpickled_optimizer_from_before_torchs_group_keys_gets_them():
    """An optimizer pickled without torch's newer group keys gets torch's values for them when unpickled, as
    torch's __setstate__ gives them (AdamW stays AdamW)."""
    import pickle
    for cls in FUSED.values():
        opt = cls(make_params(torch.float32), lr=1e-2)
        for g in opt.param_groups:
            for key in ("foreach", "fused", "differentiable", "decoupled_weight_decay"):
                g.pop(key, None)
        back = pickle.loads(pickle.dumps(opt))
        group = back.param_groups[0]
        if cls is ampfused.FusedAdafactor:  # torch.optim.Adafactor's __setstate__ gives only foreach
            assert group["foreach"] is None and "differentiable" not in group
            continue
        assert group["foreach"] is None and group["differentiable"] is False
        if cls is not ampfused.FusedSGD:
            assert group["decoupled_weight_decay"] is (cls is ampfused.FusedAdamW)
