"""Scale policies and stats() of ampfused.GradScaler, on CPU (one GPU test, skipped without CUDA).

Each policy's trajectory is held against a plain-Python model of its rule written here; "dynamic" against
torch.amp.GradScaler itself, bit for bit."""
import io
import math
import pickle
import struct
import warnings

import pytest
import torch

import ampfused
from ampfused.policies import (AggressivePolicy, DynamicPolicy, HysteresisPolicy, MinScaleError, StaticPolicy,
                               registered_scale_policies)
from backends import cpu_backends, set_grad
from oracle import assert_bitwise, no_host_sync

# 60 iterations: isolated overflows, bursts of 2, 3 and 7, clean runs long enough to grow several times
OVERFLOWS = {2, 9, 10, 16, 17, 18, 27, 33, 34, 35, 36, 37, 38, 39, 46}
STEPS = 60


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# --- plain-Python models of the rules --------------------------------------------------------------------------
def _model(kind, steps, overflows, init, gf, bf, gi, lo=None, hi=None, n=2, consecutive=True, first=None):
    """Per iteration (scale, tracker, at_min) after update(), as each rule's docstring states it."""
    scale, tracker, count, last, out = _f32(init), 0, 0, 0, []
    for k in range(steps):
        over = k in overflows
        before = scale
        if kind == "dynamic":  # torch: == growth_interval
            if over:
                scale, tracker = _f32(scale * bf), 0
            elif tracker + 1 == gi:
                g = _f32(scale * gf)
                scale, tracker = (g if math.isfinite(g) else scale), 0
            else:
                tracker += 1
        elif kind == "hysteresis":
            if over:
                count, tracker = min(count + 1, n), 0
                if count == n:
                    scale = _f32(scale * bf)
            else:
                count = 0 if consecutive else count
                tracker += 1
                if tracker >= gi:
                    g = _f32(scale * gf)
                    scale, tracker, count = (g if math.isfinite(g) else scale), 0, 0
        elif kind == "aggressive":
            if over:
                scale, tracker = _f32(scale * ((bf ** 2 if first is None else first) if last == 0 else bf)), 0
            else:
                tracker += 1
                if tracker >= gi:
                    g = _f32(scale * gf)
                    scale, tracker = (g if math.isfinite(g) else scale), 0
            last = int(over)
        at_min = lo is not None and over and before <= _f32(lo) and scale < before
        if lo is not None:
            scale = max(scale, _f32(lo))
        if hi is not None:
            scale = min(scale, _f32(hi))
        out.append((scale, tracker, at_min))
    return out


def _opt(value=1.0):
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), value)
    return torch.optim.SGD([p], lr=0.0), p


def _drive(scaler, steps, overflows, read=True):
    """Run update() after scripted overflows; returns per iteration (scale, tracker)."""
    opt, p = _opt()
    scaler.scale(torch.ones(()))
    trace = []
    for k in range(steps):
        set_grad(p, math.inf if k in overflows else 1.0)
        scaler.step(opt)
        scaler.update()
        if read:
            trace.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return trace


POLICIES = {
    "dynamic": (lambda **b: DynamicPolicy(**b), {}),
    "hysteresis2": (lambda **b: HysteresisPolicy(**b), dict(n=2)),
    "hysteresis3": (lambda **b: HysteresisPolicy(3, **b), dict(n=3)),
    "hysteresis2_megatron": (lambda **b: HysteresisPolicy(2, consecutive=False, **b), dict(n=2, consecutive=False)),
    "static": (lambda **b: StaticPolicy(**b), {}),
    "aggressive": (lambda **b: AggressivePolicy(**b), {}),
    "aggressive_0.1": (lambda **b: AggressivePolicy(0.1, **b), dict(first=0.1)),
}


def _kind(name):
    return name.split("_")[0].rstrip("0123456789")


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("hp", [dict(init=2.0**10, gf=2.0, bf=0.5, gi=4),
                                dict(init=3.0e5, gf=1.7, bf=0.3, gi=3),  # every product rounds
                                dict(init=2.0**125, gf=2.0, bf=0.5, gi=2)])  # growth into fp32 overflow
def test_trajectory_matches_the_rule(name, hp):
    make, opts = POLICIES[name]
    s = ampfused.GradScaler("cpu", init_scale=hp["init"], growth_factor=hp["gf"], backoff_factor=hp["bf"],
                            growth_interval=hp["gi"], policy=make())
    got = _drive(s, STEPS, OVERFLOWS)
    want = _model(_kind(name), STEPS, OVERFLOWS, **hp, **opts)
    assert got == [w[:2] for w in want]
    if _kind(name) != "static":
        moves = [b[0] - a[0] for a, b in zip(got, got[1:])]
        assert min(moves) < 0 < max(moves)  # the scale really moved both ways


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("name", ["dynamic", "hysteresis2", "aggressive"])
def test_trajectory_matches_the_rule_on_every_backend(name, backend):
    """The scaler's ops (unscale_, and update_scale_ for "dynamic") run on each backend available here."""
    make, opts = POLICIES[name]
    hp = dict(init=3.0e5, gf=1.7, bf=0.3, gi=3)
    s = ampfused.GradScaler("cpu", init_scale=hp["init"], growth_factor=hp["gf"], backoff_factor=hp["bf"],
                            growth_interval=hp["gi"], policy=make(), backend=backend)
    assert _drive(s, 30, OVERFLOWS) == [w[:2] for w in _model(_kind(name), 30, OVERFLOWS, **hp, **opts)]


@pytest.mark.parametrize("name", list(POLICIES))
def test_bounds_hold_and_at_min_is_counted(name):
    make, opts = POLICIES[name]
    hp = dict(init=2.0**10, gf=2.0, bf=0.5, gi=3, lo=2.0**8, hi=2.0**12)
    s = ampfused.GradScaler("cpu", init_scale=hp["init"], growth_interval=hp["gi"], policy=make(max_scale=hp["hi"]),
                            min_scale=hp["lo"])
    got = _drive(s, STEPS, OVERFLOWS)
    want = _model(_kind(name), STEPS, OVERFLOWS, **hp, **opts)
    assert got == [w[:2] for w in want]
    assert all(hp["lo"] <= g[0] <= hp["hi"] for g in got)
    if _kind(name) != "static":
        assert {g[0] for g in got} >= {hp["lo"], hp["hi"]}  # both bounds were reached
    st = s.stats()
    assert st["min_scale_overflows"].item() == sum(w[2] for w in want)
    assert (st["min_scale_overflows"].item() > 0) == (_kind(name) != "static")


@pytest.mark.parametrize("hp", [dict(init_scale=2.0**10, growth_interval=4),
                                dict(init_scale=3.0e5, growth_factor=1.7, backoff_factor=0.3, growth_interval=3),
                                dict(init_scale=2.0**125, growth_interval=2)])
def test_dynamic_is_torch_bit_for_bit(hp):
    traces = [_drive(cls("cpu", **hp), STEPS, OVERFLOWS) for cls in (torch.amp.GradScaler, ampfused.GradScaler)]
    assert traces[0] == traces[1]
    s = ampfused.GradScaler("cpu", **hp, policy=HysteresisPolicy(1))  # one overflow in a row: the same rule
    assert _drive(s, STEPS, OVERFLOWS) == traces[0]


def test_default_policy_runs_update_scale_op(monkeypatch):
    calls = []
    real = ampfused.ops.call_update_scale_
    monkeypatch.setattr(ampfused.ops, "call_update_scale_", lambda *a: calls.append(a) or real(*a))
    s = ampfused.GradScaler("cpu", backend="reference")
    _drive(s, 3, set(), read=False)
    assert type(s.policy) is DynamicPolicy and len(calls) == 3
    for a in calls:  # one kernel also forms the next unscale's 1/scale and counts the overflow
        assert a[-1] == "reference" and a[6] is s._inv and a[7] is not None


def test_setters_reach_the_policy():
    s = ampfused.GradScaler("cpu", init_scale=8.0, growth_interval=100, policy="hysteresis")
    s.set_growth_interval(1)
    s.set_growth_factor(4.0)
    _drive(s, 1, set(), read=False)
    assert s.get_scale() == 32.0


# --- the min-scale error ----------------------------------------------------------------------------------------
def _fused_loop(scaler, n, overflow_at):
    p = torch.nn.Parameter(torch.ones(4))
    opt = ampfused.FusedSGD([p], lr=0.1)
    for k in range(n):
        set_grad(p, math.inf if k in overflow_at else 1.0)
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
    return opt


def test_min_scale_error_surfaces_at_the_next_host_read_fused():
    s = ampfused.GradScaler("cpu", init_scale=4.0, min_scale=4.0, raise_at_min_scale=True)
    _fused_loop(s, 3, {1})  # steps and updates after the overflow raise nothing: they read nothing
    assert s.stats()["min_scale_overflows"].item() == 1
    with pytest.raises(MinScaleError, match=r"sits at min_scale=4.0 and the gradients still overflow \(1 such"):
        s.get_scale()
    assert s.get_scale() == 4.0  # raised once per occurrence
    _fused_loop(s, 2, {0, 1})
    with pytest.raises(MinScaleError, match=r"\(2 such"):
        s.state_dict()
    assert s.state_dict()["scale"] == 4.0


def test_min_scale_error_surfaces_at_the_next_step_of_a_plain_optimizer():
    s = ampfused.GradScaler("cpu", init_scale=8.0, min_scale=4.0, raise_at_min_scale=True)
    opt, p = _opt()
    opt.param_groups[0]["lr"] = 0.1
    s.scale(torch.ones(()))
    for k, over in enumerate([True, True]):  # 8 -> 4 (reaching min is fine), then an overflow at 4
        set_grad(p, math.inf if over else 1.0)
        s.step(opt)
        s.update()
    set_grad(p, 1.0)
    before = p.detach().clone()
    with pytest.raises(MinScaleError):
        s.step(opt)  # the read that decides the skip also fetches the count: no extra sync
    assert_bitwise("param", p.detach(), before)  # raised before stepping


def test_min_scale_error_respects_the_policy():
    # hysteresis: an isolated overflow at min is tolerated; the second in a row asks for less and raises
    s = ampfused.GradScaler("cpu", init_scale=4.0, raise_at_min_scale=True, policy=HysteresisPolicy(2, min_scale=4.0))
    _fused_loop(s, 4, {0, 2})
    assert s.get_scale() == 4.0
    _fused_loop(s, 2, {0, 1})
    with pytest.raises(MinScaleError):
        s.get_scale()
    # static never asks for a lower scale
    s = ampfused.GradScaler("cpu", init_scale=4.0, min_scale=4.0, raise_at_min_scale=True, policy="static")
    _fused_loop(s, 3, {0, 1, 2})
    assert s.get_scale() == 4.0 and s.stats()["skipped_overflow"].item() == 3


def test_no_error_without_the_option_and_pickle_keeps_the_count():
    s = ampfused.GradScaler("cpu", init_scale=4.0, min_scale=4.0)
    _fused_loop(s, 2, {0, 1})
    assert s.get_scale() == 4.0 and s.stats()["min_scale_overflows"].item() == 2
    s = ampfused.GradScaler("cpu", init_scale=4.0, min_scale=4.0, raise_at_min_scale=True)
    _fused_loop(s, 1, {0})
    with pytest.raises(MinScaleError):
        pickle.dumps(s)  # pickling reads the scale too
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.stats()["min_scale_overflows"].item() == 1 and s2.get_scale() == 4.0


@pytest.mark.parametrize("kw,exc,text", [
    (dict(raise_at_min_scale=True), ValueError, "raise_at_min_scale=True needs min_scale"),
    (dict(raise_at_min_scale=1, min_scale=1.0), TypeError, "raise_at_min_scale must be a bool, got int"),
    (dict(min_scale=8.0, max_scale=4.0), ValueError, r"min_scale \(8.0\) must be <= max_scale \(4.0\)"),
    (dict(min_scale=0.0), ValueError, "min_scale must be a finite number > 0 or None, got 0.0"),
    (dict(max_scale=math.inf), ValueError, "max_scale must be a finite number > 0 or None, got inf"),
    (dict(min_scale="1"), TypeError, "min_scale must be a real number or None, got str"),
    (dict(init_scale=2.0, min_scale=4.0), ValueError, r"init_scale \(2.0\) must lie within \[min_scale, max_scale\]"),
    (dict(policy="nope"), ValueError, "unknown scale policy 'nope'; registered policies: aggressive, dynamic, "),
    (dict(policy=HysteresisPolicy), TypeError, r"got type \(pass an instance: policy=MyPolicy\(...\)\)"),
    (dict(policy=HysteresisPolicy(min_scale=2.0), min_scale=1.0), ValueError,
     "min_scale=1.0 given to GradScaler differs from the policy's min_scale=2.0; give it in one place"),
])
def test_constructor_errors(kw, exc, text):
    with pytest.raises(exc, match=text):
        ampfused.GradScaler("cpu", **kw)


@pytest.mark.parametrize("make,exc,text", [
    (lambda: HysteresisPolicy(0), ValueError, "hysteresis must be >= 1, got 0"),
    (lambda: HysteresisPolicy(2.0), TypeError, "hysteresis must be an int, got float"),
    (lambda: HysteresisPolicy(consecutive=None), TypeError, "consecutive must be a bool"),
    (lambda: AggressivePolicy(1.0), ValueError, r"first_backoff must be in the open interval \(0, 1\), got 1.0"),
])
def test_policy_option_errors(make, exc, text):
    with pytest.raises(exc, match=text):
        make()


def test_a_policy_instance_drives_one_scaler():
    pol = HysteresisPolicy(3)
    ampfused.GradScaler("cpu", policy=pol)
    with pytest.raises(ValueError, match="already drives another GradScaler"):
        ampfused.GradScaler("cpu", policy=pol)


# --- a user-registered policy -----------------------------------------------------------------------------------
@ampfused.register_scale_policy("test_overflow_rate")
class OverflowRatePolicy(ampfused.ScalePolicy):
    """docs/api.md's example: back off on every overflow; grow every growth_interval clean iterations, but only
    while the recent overflow rate (an exponential moving average kept on the device) is below target."""

    def __init__(self, target=0.05, decay=0.9, **bounds):
        super().__init__(**bounds)
        self.target, self.decay = target, decay
        self.add_state("rate", 0.0, torch.float32)

    def update_(self, scale, growth_tracker, found_inf):
        rate = self.state("rate", scale)
        over = found_inf > 0
        rate.mul_(self.decay).add_(over.float() * (1 - self.decay))
        tracker = torch.where(over, 0, growth_tracker + 1)
        grow = tracker >= self.growth_interval
        factor = torch.where(over, self.backoff_factor,
                             torch.where(grow & (rate < self.target), self.growth_factor, 1.0))
        scale.mul_(factor)
        growth_tracker.copy_(torch.where(grow, 0, tracker))


def _rate_model(steps, overflows, init, gi, target=0.05, decay=0.9, rate=0.0, tracker=0):
    scale, out = init, []
    for k in range(steps):
        over = k in overflows
        rate = _f32(_f32(rate * _f32(decay)) + (_f32(1 - decay) if over else 0.0))
        tracker = 0 if over else tracker + 1
        grow = tracker >= gi
        scale = _f32(scale * (0.5 if over else 2.0 if grow and rate < _f32(target) else 1.0))
        tracker = 0 if grow else tracker
        out.append((scale, tracker, rate))
    return out


def _fused_training(scaler, opt, params, steps, overflows, start=0):
    trace = []
    g = torch.Generator().manual_seed(5)
    for k in range(start, start + steps):
        loss = sum((p.float() ** 2).sum() for p in params) * torch.rand((), generator=g)
        scaler.scale(loss).backward()
        if k in overflows:
            params[0].grad.view(-1)[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        trace.append((scaler.get_scale(), scaler._get_growth_tracker(),
                      scaler.stats()["policy.rate"].item()))
    return trace


def test_registered_policy_end_to_end_and_state_dict_round_trip():
    assert registered_scale_policies()["test_overflow_rate"] is OverflowRatePolicy

    def make():
        torch.manual_seed(3)
        params = [torch.randn(13, dtype=torch.bfloat16, requires_grad=True), torch.randn(4, 5, requires_grad=True)]
        scaler = ampfused.GradScaler("cpu", init_scale=2.0**12, growth_interval=3, policy="test_overflow_rate",
                                     max_scale=2.0**14)
        return scaler, ampfused.FusedAdamW(params, lr=1e-3), params

    overflows = {4, 5, 12, 30, 31, 32}
    s, opt, params = make()
    assert isinstance(s.policy, OverflowRatePolicy)
    first = _fused_training(s, opt, params, 20, overflows)
    sd = s.state_dict()
    assert sd["policy.test_overflow_rate.rate"] == first[-1][2] > 0
    buf = io.BytesIO()
    torch.save({"scaler": sd, "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    rest = _fused_training(s, opt, params, 20, overflows, start=20)
    s2, opt2, params2 = make()
    s2.load_state_dict(ckpt["scaler"])
    opt2.load_state_dict(ckpt["opt"])
    assert _fused_training(s2, opt2, params2, 20, overflows, start=20) == rest  # resumes exactly
    want = _rate_model(40, overflows, 2.0**12, 3)
    got = first + rest
    assert [(a, b) for a, b, _ in got] == [(min(a, 2.0**14), b) for a, b, _ in want]
    assert [c for *_, c in got] == [c for *_, c in want]
    s3 = pickle.loads(pickle.dumps(s))  # pickling carries the policy state too
    assert s3.state_dict() == s.state_dict()


def test_register_errors():
    with pytest.raises(ValueError, match="already registered"):
        ampfused.register_scale_policy("test_overflow_rate")(type("Other", (ampfused.ScalePolicy,), {}))
    with pytest.raises(ValueError, match="the built-in scale policy 'dynamic' cannot be replaced"):
        ampfused.register_scale_policy("dynamic", replace=True)(type("Other", (ampfused.ScalePolicy,), {}))
    with pytest.raises(ValueError, match="without '.'"):
        ampfused.register_scale_policy("a.b")
    with pytest.raises(TypeError, match="decorates a ScalePolicy subclass"):
        ampfused.register_scale_policy("fn")(lambda: None)
    cls = ampfused.register_scale_policy("test_overflow_rate", replace=True)(OverflowRatePolicy)
    assert cls is OverflowRatePolicy

    class Forgetful(ampfused.ScalePolicy):  # no update_, no super().__init__()
        def __init__(self):
            pass
    s = ampfused.GradScaler("cpu", policy=Forgetful())
    with pytest.raises(NotImplementedError, match="Forgetful must implement update_"):
        _drive(s, 1, set(), read=False)


# --- state dicts ---------------------------------------------------------------------------------------------
def _hysteresis_scaler(**kw):
    return ampfused.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, policy=HysteresisPolicy(3), **kw)


def test_policy_state_survives_a_checkpoint_mid_burst():
    s = _hysteresis_scaler()
    _drive(s, 4, {2, 3}, read=False)  # two overflows counted, no backoff yet
    sd = s.state_dict()
    assert sd["policy.hysteresis.overflows"] == 2 and sd["scale"] == 2.0**10
    assert all(type(v) in (int, float) for v in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = _hysteresis_scaler()
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.state_dict() == sd
    _drive(fresh, 1, {0}, read=False)  # the third in a row backs off at once
    assert fresh.get_scale() == 2.0**9


def test_state_dict_with_policy_state_loads_into_torch_and_back():
    s = _hysteresis_scaler()
    _drive(s, 4, {2, 3}, read=False)
    sd = s.state_dict()
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(sd)  # torch reads its five keys and ignores the rest
    assert t.state_dict() == {k: v for k, v in sd.items() if not k.startswith("policy.")}
    back = _hysteresis_scaler()
    _drive(back, 2, {0, 1}, read=False)  # state to be replaced by the defaults
    back.load_state_dict(t.state_dict())
    assert back.state_dict() == dict(t.state_dict(), **{"policy.hysteresis.overflows": 0})


def test_state_of_another_policy_is_not_loaded_and_says_so():
    s = _hysteresis_scaler()
    _drive(s, 2, {1}, read=False)
    a = ampfused.GradScaler("cpu", policy="aggressive")
    with pytest.warns(UserWarning, match="state of the scale policy 'hysteresis' but this GradScaler uses "
                                         "'aggressive': that state is not loaded"):
        a.load_state_dict(s.state_dict())
    assert a.state_dict()["policy.aggressive.last_overflow"] == 0 and a.get_scale() == s.get_scale()
    d = ampfused.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d.load_state_dict(s.state_dict())
    assert set(d.state_dict()) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}


@pytest.mark.parametrize("value,exc,text", [(1.5, ValueError, "policy state 'overflows' must be an integer"),
                                            ("2", TypeError, "policy state 'overflows' must be a number")])
def test_bad_policy_state_rejected_before_any_change(value, exc, text):
    s = _hysteresis_scaler()
    _drive(s, 1, {0}, read=False)
    before = s.state_dict()
    sd = dict(before, scale=8.0, **{"policy.hysteresis.overflows": value})
    with pytest.raises(exc, match=text):
        s.load_state_dict(sd)
    assert s.state_dict() == before
    with pytest.raises(KeyError, match="HysteresisPolicy has no state 'nope'"):
        s.load_state_dict(dict(before, **{"policy.hysteresis.nope": 1}))


def test_loaded_scale_is_clamped_into_the_bounds():
    s = ampfused.GradScaler("cpu", init_scale=64.0, min_scale=16.0, max_scale=256.0)
    s.load_state_dict(dict(torch.amp.GradScaler("cpu", init_scale=2.0**20).state_dict()))
    assert s.get_scale() == 256.0


# --- stats and the absence of host reads ---------------------------------------------------------------------
def test_stats_after_a_scripted_run():
    s = ampfused.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, policy=HysteresisPolicy(2),
                            min_scale=2.0**8)
    st = s.stats()  # before any iteration: the initial values
    assert {k: v.item() for k, v in st.items()} == {
        "scale": 2.0**10, "growth_tracker": 0, "steps": 0, "skipped_overflow": 0, "min_scale_overflows": 0,
        "policy.overflows": 0}
    overflows = {1, 4, 5, 6, 7, 8, 9, 12}
    _drive(s, 14, overflows, read=False)
    st = s.stats()
    want = _model("hysteresis", 14, overflows, 2.0**10, 2.0, 0.5, 3, lo=2.0**8, n=2)
    assert all(v.dim() == 0 and v.device == torch.device("cpu") for v in st.values())
    assert st["scale"].dtype == torch.float32 and st["growth_tracker"].dtype == torch.int32
    assert {k: v.item() for k, v in st.items()} == {
        "scale": want[-1][0], "growth_tracker": want[-1][1], "steps": 6, "skipped_overflow": 8,
        "min_scale_overflows": sum(w[2] for w in want), "policy.overflows": 0}
    assert st["min_scale_overflows"].item() == 3  # 8 -> 7 -> 6: the 3rd..5th in a row at 2**8
    snapshot = st["scale"].item()
    _drive(s, 2, {0, 1}, read=False)
    assert st["scale"].item() == snapshot  # a snapshot, not a view
    s.load_state_dict(s.state_dict())
    assert s.stats()["steps"].item() == 0 and s.stats()["skipped_overflow"].item() == 0
    assert ampfused.GradScaler("cpu", enabled=False).stats() == {}


class _NoHostReads:
    """Make every way of reading a tensor to the host raise (item, tolist, bool, float, int, index, numpy)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        def refuse(self_, *a, **k):
            raise AssertionError("host read")
        for name in self.NAMES:
            self.mp.setattr(torch.Tensor, name, refuse)

    def __exit__(self, *exc):
        self.mp.undo()


@pytest.mark.parametrize("policy", ["dynamic", "hysteresis", "static", "aggressive", "test_overflow_rate"])
def test_no_host_read_in_step_and_update(monkeypatch, policy):
    params = [torch.randn(13, dtype=torch.bfloat16, requires_grad=True), torch.randn(4, 5, requires_grad=True)]
    opt = ampfused.FusedAdamW(params, lr=1e-3, max_grad_norm=1.0)
    s = ampfused.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, policy=policy, min_scale=2.0**6,
                            max_scale=2.0**10, raise_at_min_scale=True)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    plain.param_groups[0]["params"][0].grad = torch.ones(3)
    tokens = torch.tensor(40)
    for k in range(12):
        scaled = s.scale(sum((p.float() ** 2).sum() for p in params))
        scaled.backward()
        if k in (3, 4, 5, 6, 7):
            params[1].grad[0, 0] = math.inf
        with _NoHostReads(monkeypatch):
            if k % 2:
                s.step(opt, grad_divisor=tokens)
            else:
                s.unscale_(opt, grad_divisor=tokens)
                ampfused.clip_grad_norm_(params, 0.5)
                s.step(opt)
            s.unscale_(plain)  # torch's plain-optimizer step reads found_inf by design; update() must not
            s.update()
            stats = s.stats()
        opt.zero_grad()
    assert stats["steps"].item() + stats["skipped_overflow"].item() == 12
    assert stats["skipped_overflow"].item() == 5
    if policy != "static":  # the scale reached min_scale and overflowed there: the next host read says so
        assert stats["min_scale_overflows"].item() > 0
        with pytest.raises(MinScaleError):
            s.get_scale()


# --- on a GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["dynamic", "hysteresis", "static", "aggressive", "test_overflow_rate"])
def test_gpu_step_and_update_never_sync(policy):
    torch.manual_seed(0)
    params = [torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (1, 129, 70000)]
    opt = ampfused.FusedAdamW(params, lr=1e-3, max_grad_norm=1.0)
    s = ampfused.GradScaler("cuda", init_scale=2.0**8, growth_interval=2, policy=policy, min_scale=2.0**6,
                            max_scale=2.0**10, raise_at_min_scale=True)
    tokens = torch.tensor(1000, device="cuda")
    for k in range(10):
        s.scale(torch.ones((), device="cuda"))
        for p in params:
            set_grad(p, torch.randn_like(p) * 256.0)
        if k in (3, 4, 5, 6, 7):
            params[2].grad[5] = math.inf
        with no_host_sync():
            if k % 2:
                s.step(opt, grad_divisor=tokens)
            else:
                s.unscale_(opt, grad_divisor=tokens)
                ampfused.clip_grad_norm_(params, 0.5)
                s.step(opt)
            s.update()
            stats = s.stats()
        opt.zero_grad()
    assert stats["skipped_overflow"].item() == 5 and stats["steps"].item() == 5
    assert 2.0**6 <= stats["scale"].item() <= 2.0**10
    if policy != "static":  # the scale reached min_scale and overflowed there: the next host read says so
        with pytest.raises(MinScaleError):
            s.get_scale()


@pytest.mark.parametrize("backend", cpu_backends())
def test_scale_update_forms_the_next_reciprocal_and_counts_overflows(backend):
    """The bookkeeping outputs of update_scale_ on every backend: bitwise the reference's ``fp32(1 / fp64(s))``,
    for ordinary, subnormal-reciprocal, huge, zero and infinite scales, and the overflow count."""
    scales = [65536.0, 3.0, 1e-38, 3e38, 2.0 ** 127, 7.0e-39, 0.0, math.inf, 1.2345678e10]
    for found in (0.0, 1.0):
        for s0 in scales:
            out = {}
            for b in ("reference", backend):
                s, t = torch.tensor(s0), torch.zeros((), dtype=torch.int32)
                inv, skipped = torch.full((), -1.0), torch.tensor(5, dtype=torch.int64)
                ampfused.ops.update_scale_(s, t, torch.tensor(found), 2.0, 0.5, 1000, inv_scale=inv, skipped=skipped,
                                           backend=b)
                out[b] = (s, t, inv, skipped)
            for name, x, y in zip(("scale", "tracker", "inv_scale", "skipped"), out[backend], out["reference"]):
                assert_bitwise(f"{name} from scale {s0}, found_inf {found}", x, y)
            assert out[backend][3].item() == 5 + int(found)
