"""Training health (``health=True``, ``opt.health()``): each number of a step against what the weights before and
after it and its gradients say, in every state mode, and the refusals."""
import copy
import pickle

import pytest
import torch

import ampfused
from ampfused.ops import state_precision as sp
from ampfused.ops.reference_common import check_health

BF16 = torch.bfloat16

# (name, constructor, options) per optimizer and state mode
MODES = {
    "adamw": (ampfused.FusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-remainders": (ampfused.FusedAdamW, dict(lr=1e-2, store_param_remainders=True)),
    "adamw-stochastic": (ampfused.FusedAdamW, dict(lr=1e-2, bf16_stochastic_round=True, seed=3)),
    "adamw-bf16-moments": (ampfused.FusedAdamW, dict(lr=1e-2, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    "adamw-8bit": (ampfused.FusedAdamW, dict(lr=1e-2, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
    "adam-l2": (ampfused.FusedAdam, dict(lr=1e-2, weight_decay=0.1)),
    "sgd-momentum": (ampfused.FusedSGD, dict(lr=1e-1, momentum=0.9, weight_decay=0.01)),
    "sgd-stochastic": (ampfused.FusedSGD, dict(lr=1e-1, bf16_stochastic_round=True)),
    "lion": (ampfused.FusedLion, dict(lr=1e-3, weight_decay=0.1)),
    "lion-remainders": (ampfused.FusedLion, dict(lr=1e-3, store_param_remainders=True)),
    "adafactor": (ampfused.FusedAdafactor, dict(lr=1e-2, weight_decay=0.1)),
    "adafactor-stochastic": (ampfused.FusedAdafactor, dict(lr=1e-2, bf16_stochastic_round=True)),
    "muon": (ampfused.FusedMuon, dict(lr=1e-2)),
    "muon-bf16-momentum": (ampfused.FusedMuon, dict(lr=1e-2, momentum_dtype=BF16, store_param_remainders=True)),
}


def _stored(opt, p):
    """The weight a step stores, as the optimizer holds it (fp32): the master, rebuilt from weight and remainder,
    or the parameter."""
    st = opt.state.get(p, {})
    if "master_param" in st:
        return st["master_param"].detach().float().clone()
    if "master_remainder" in st:
        return sp.join_master(p.detach().reshape(-1), st["master_remainder"].reshape(-1)).view(p.shape).clone()
    return p.detach().float().clone()


def _model(dtype=BF16):
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(12, 16), torch.nn.Linear(16, 8)
    frozen = torch.nn.Linear(8, 8)
    frozen.requires_grad_(False)
    return torch.nn.ModuleList([lin1, lin2, frozen]).to(dtype)


def _groups(name, model):
    if name.startswith("muon"):  # matrices by Muon, the biases by its AdamW groups
        return [{"params": [model[0].weight]}, {"params": [model[1].weight], "lr": 3e-3},
                {"params": [model[0].bias, model[1].bias], "use_muon": False},
                {"params": list(model[2].parameters()), "use_muon": False}]
    return [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters()), "lr": 3e-3},
            {"params": list(model[2].parameters())}]


def _expected(opt, before, grads, divisor):
    """Per group: the numbers from the stored weights before and after and the gradients read (``grads``:
    parameter -> gradient, for those that had one)."""
    out = []
    for group in opt.param_groups:
        g2 = u2 = w2 = 0.0
        stagnant = nonfinite = 0
        for p in group["params"]:
            if p not in grads:
                continue
            g = grads[p].float() / divisor
            g2 += g.double().square().sum().item()
            nonfinite += int((~torch.isfinite(grads[p])).sum())
            b, a = before[p], _stored(opt, p)
            u2 += (a - b).double().square().sum().item()
            w2 += a.double().square().sum().item()
            stagnant += int((a == b).sum())
        out.append(dict(grad_norm=g2 ** 0.5, update_norm=u2 ** 0.5, weight_norm=w2 ** 0.5, stagnant=stagnant,
                        nonfinite=nonfinite))
    return out


def _check(opt, expected):
    got = opt.health()
    assert len(got) == len(opt.param_groups)
    # the reference sums fp64 squares (it and this oracle differ only in order); the CPU sums fp32 squares per block
    # of 256, then fp64: at most 256 * 2**-24 (1.5e-5) relative on a sum of squares, half that on its norm
    rel = 1e-6 if opt.backend == "reference" else 1e-5
    for gi, (h, e) in enumerate(zip(got, expected)):
        assert set(h) == {"grad_norm", "update_norm", "weight_norm", "stagnant", "nonfinite"}
        for k in ("grad_norm", "update_norm", "weight_norm"):
            assert h[k].dim() == 0 and h[k].dtype == torch.float32, k
            assert h[k].item() == pytest.approx(e[k], rel=rel, abs=1e-30), (gi, k)
        for k in ("stagnant", "nonfinite"):
            assert h[k].dim() == 0 and h[k].dtype == torch.int64, k
            assert h[k].item() == e[k], (gi, k)


def _backward(model, seed):
    torch.manual_seed(seed)
    x = torch.randn(6, 12, dtype=model[0].weight.dtype)
    model[2](model[1](model[0](x))).float().square().mean().backward()


NATIVE = ("adam", "sgd", "lion", "muon")  # the optimizers whose CPU steps compute the sums
CASES = [(m, "reference") for m in sorted(MODES)] + [(m, "cpu") for m in sorted(MODES) if m.startswith(NATIVE)]


@pytest.mark.parametrize("mode, backend", CASES)
def test_each_number_is_what_the_weights_and_gradients_say(mode, backend):
    cls, options = MODES[mode]
    model = _model()
    opt = cls(_groups(mode, model), backend=backend, health=True, **options)
    for step in range(3):
        _backward(model, step)
        if step == 1:
            model[0].bias.grad = None  # a parameter without a gradient this step
        params = [p for g in opt.param_groups for p in g["params"]]
        before = {p: _stored(opt, p) for p in params}
        grads = {p: p.grad.clone() for p in params if p.grad is not None}
        divisor = 4.0 if step == 2 else 1.0  # the numbers are of the divided gradients
        opt.step(grad_divisor=divisor if step == 2 else None)
        _check(opt, _expected(opt, before, grads, divisor))
        assert opt.health()[1]["update_norm"] > 0 and opt.health()[-1]["weight_norm"] == 0  # (frozen)
        opt.zero_grad()


@pytest.mark.parametrize("mode, backend", [("adamw", "reference"), ("adamw-remainders", "reference"),
                                           ("lion", "reference"), ("muon", "reference"), ("adamw", "cpu"),
                                           ("adamw-stochastic", "cpu"), ("sgd-momentum", "cpu"), ("muon", "cpu"),
                                           ("muon-bf16-momentum", "cpu")])
def test_a_skipped_step_reports_its_gradients_and_no_update(mode, backend):
    cls, options = MODES[mode]
    model = _model()
    opt = cls(_groups(mode, model), backend=backend, health=True, **options)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    _backward(model, 1)
    model[1].weight.grad[0, :3] = float("inf")
    model[1].weight.grad[2, 1] = float("nan")
    params = [p for g in opt.param_groups for p in g["params"]]
    before = {p: _stored(opt, p) for p in params}
    grads = {p: p.grad.clone() for p in params if p.grad is not None}
    opt.step()
    assert bool(opt.last_step_skipped)
    h = opt.health()
    assert [int(x["nonfinite"]) for x in h][1] == 4
    assert all(int(x["stagnant"]) == 0 and float(x["update_norm"]) == 0 for x in h)
    assert torch.isnan(h[1]["grad_norm"])
    expected = _expected(opt, before, grads, 1.0)
    assert h[0]["grad_norm"].item() == pytest.approx(expected[0]["grad_norm"], rel=1e-6)
    for x, e in zip(h, expected):
        assert x["weight_norm"].item() == pytest.approx(e["weight_norm"], rel=1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("options", [dict(), dict(store_param_remainders=True), dict(bf16_stochastic_round=True),
                                     dict(master_weights=False, dtype=torch.float32)],
                         ids=["fp32-master", "remainders", "stochastic", "fp32-params"])
def test_updates_below_the_last_bit_of_the_stored_weight_are_counted_exactly(options, backend):
    options = dict(options)
    dtype = options.pop("dtype", BF16)
    w = torch.ones(1000, dtype=dtype)
    w[:7] = 0.0  # an update of a zero weight is stored
    w[7:10] = 2.0 ** -20  # ... and of a tiny one
    p = torch.nn.Parameter(w)
    still = torch.nn.Parameter(torch.ones(64, dtype=dtype))  # a zero update is not a stagnant one
    opt = ampfused.FusedSGD([{"params": [p]}, {"params": [still]}], lr=1e-9, backend=backend, health=True,
                            **options)
    before = _stored(opt, p)
    p.grad = torch.ones_like(p)
    still.grad = torch.zeros_like(still)
    opt.step()
    after = _stored(opt, p)
    changed = int((after != before).sum())
    assert changed >= 7  # (stochastic rounding keeps some of the tiny weights)
    h = opt.health()
    assert int(h[0]["stagnant"]) == 1000 - changed
    assert int(h[1]["stagnant"]) == 0 and float(h[1]["update_norm"]) == 0


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_weight_decay_alone_is_an_update(backend):
    p = torch.nn.Parameter(torch.ones(16, dtype=BF16))
    opt = ampfused.FusedAdamW([p], lr=1e-6, weight_decay=1e-3, backend=backend, health=True)
    p.grad = torch.zeros_like(p)
    opt.step()
    # adam's term is 0 (m = 0) and the decay 1 - 1e-9 rounds to 1 in fp32: the decay is lost
    assert int(opt.health()[0]["stagnant"]) == 16


def test_health_is_opt_in_and_refused_where_it_is_not_computed():
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=BF16))
    with pytest.raises(RuntimeError, match=r"health\(\) needs the optimizer built with health=True"):
        ampfused.FusedAdamW([p]).health()
    with pytest.raises(TypeError, match="health must be True or False"):
        ampfused.FusedAdamW([p], health="yes")
    opt = ampfused.FusedAdafactor([p], backend="cpu", health=True)
    p.grad = torch.randn_like(p)
    w = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"adafactor_step_ on the 'cpu' backend, which does not compute the "
                                           r"health sums yet"):
        opt.step()
    assert torch.equal(p, w) and len(opt.state) == 0  # refused before anything changed


def test_before_any_step_the_numbers_are_zero_and_copies_keep_working():
    model = _model()
    opt = ampfused.FusedAdamW(_groups("adamw", model), backend="reference", health=True)
    assert all(float(v) == 0 for h in opt.health() for v in h.values())
    _backward(model, 0)
    opt.step()
    copied = copy.deepcopy(opt)
    pickle.loads(pickle.dumps(opt))
    assert all(float(v) == 0 for h in copied.health() for v in h.values())  # (the copy has not stepped)
    opt.zero_grad()
    opt.step()  # no gradient at all: nothing stepped
    assert all(float(v) == 0 for h in opt.health() for v in h.values())


def test_the_op_refuses_a_health_tensor_of_the_wrong_kind():
    inv = torch.ones(())
    check_health(None, inv)
    check_health(torch.zeros(5, dtype=torch.float64), inv)
    for bad in (torch.zeros(5), torch.zeros(4, dtype=torch.float64), [0.0] * 5):
        with pytest.raises(ValueError, match=r"health must be an fp64 tensor of shape \[5\]"):
            check_health(bad, inv)


def test_fsdp2_parameters_are_refused_before_anything_changes():
    model = _model()
    opt = ampfused.FusedAdamW(_groups("adamw", model), backend="reference", health=True)
    _backward(model, 0)
    opt.step()
    opt._segs.shard_groups = (None,)  # (what DTensor parameters sharded over a mesh give)
    before = {p: _stored(opt, p) for g in opt.param_groups for p in g["params"]}
    with pytest.raises(RuntimeError, match=r"FSDP2 \(DTensor\) parameters: the per-group sums are not reduced"):
        opt.step()
    assert all(torch.equal(_stored(opt, p), w) for p, w in before.items())


@pytest.mark.parametrize("mode", [m for m in sorted(MODES) if m.startswith(NATIVE)])
def test_the_cpu_step_with_health_sums_is_the_step_without_them_bit_for_bit(mode):
    cls, options = MODES[mode]
    runs = []
    for health in (False, True):
        model = _model()
        opt = cls(_groups(mode, model), backend="cpu", health=health, max_grad_norm=0.5, **options)
        for step in range(3):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    (m0, o0), (m1, o1) = runs
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p0, p1)
        for k, v in o0.state[p0].items():
            assert torch.equal(v, o1.state[p1][k]), k


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_group_without_gradients_this_step_reports_zeros(backend):
    model = _model()
    opt = ampfused.FusedAdamW(_groups("adamw", model), backend=backend, health=True)
    _backward(model, 0)
    opt.step()
    assert float(opt.health()[1]["grad_norm"]) > 0
    model[1].weight.grad = model[1].bias.grad = None
    opt.step()
    h = opt.health()
    assert float(h[0]["update_norm"]) > 0
    assert all(float(v) == 0 for v in h[1].values())


def test_the_logged_ratio_of_a_group_that_updated_nothing_is_zero():
    from ampfused.integrations._common import health_metrics
    model = _model()
    opt = ampfused.FusedAdamW(_groups("adamw", model), backend="cpu", health=True)
    _backward(model, 0)
    opt.step()
    metrics = health_metrics([opt])
    assert float(metrics["health/group2/update_to_weight"]) == 0  # the frozen group: no NaN in the logs
    h = opt.health()[0]
    assert float(metrics["health/group0/update_to_weight"]) == pytest.approx(
        float(h["update_norm"]) / float(h["weight_norm"]))
