"""Every error of ampfused.GradScaler: torch's type and message where torch has the error (taken from torch's
own scaler at run time), and a message naming the argument and the rule where ampfused checks more. Each
case also shows that nothing changed."""
import pickle

import pytest
import torch

import ampfused
from ampfused.scaler import OptState


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the point is to capture whatever torch raises)
        return type(e), str(e)
    raise AssertionError("expected an exception")


def _setup(cls, scale=True, **kw):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    opt = torch.optim.SGD([p], lr=0.1)
    s = cls("cpu", **kw)
    if scale:
        s.scale(torch.ones(()))
    return s, opt, p


def _fake_fused(p):
    from test_scaler import FakeFused
    return FakeFused([p], lr=0.1)


def _same_error(action, scale=True, fused=False):
    """Run ``action(scaler, opt)`` on torch's scaler and ours; both must raise the same type and message."""
    st, ot, _ = _setup(torch.amp.GradScaler, scale)
    sa, oa, pa = _setup(ampfused.GradScaler, scale)
    if fused:
        oa = _fake_fused(pa)
    expected = _raised(lambda: action(st, ot))
    assert _raised(lambda: action(sa, oa)) == expected
    return sa, oa


def _unscale_twice(s, o):
    s.unscale_(o)
    s.unscale_(o)


def _unscale_after_step(s, o):
    s.step(o)
    s.unscale_(o)


def _step_twice(s, o):
    s.step(o)
    s.step(o)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("action", [_unscale_twice, _unscale_after_step, _step_twice,
                                    lambda s, o: s.step(o, closure=lambda: 0.0)])
def test_state_machine_errors_match_torch(action, fused):
    _same_error(action, fused=fused)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("method", ["unscale_", "step", "update"])
def test_use_before_scale_matches_torch(method, fused):
    def action(s, o):
        return s.update() if method == "update" else getattr(s, method)(o)
    sa, _ = _same_error(action, scale=False, fused=fused)
    assert sa._scale is None


def test_update_without_inf_checks_matches_torch():
    sa, _ = _same_error(lambda s, o: s.update())
    assert sa.get_scale() == 2.0**16


@pytest.mark.parametrize("new_scale", [torch.ones(2), torch.ones((), requires_grad=True),
                                       torch.ones((), device="meta")])
def test_update_with_bad_new_scale_matches_torch(new_scale):
    _same_error(lambda s, o: s.update(new_scale))


def test_load_empty_state_dict_while_enabled_matches_torch():
    sa, _ = _same_error(lambda s, o: s.load_state_dict({}))
    assert sa.get_scale() == 2.0**16


def test_pickle_mid_iteration_matches_torch():
    def action(s, o):
        s.unscale_(o)
        pickle.dumps(s)
    _same_error(action)


@pytest.mark.parametrize("kw", [dict(growth_factor=1.0), dict(growth_factor=0.5), dict(backoff_factor=1.0),
                                dict(backoff_factor=2.0)])
def test_constructor_errors_match_torch(kw):
    expected = _raised(lambda: torch.amp.GradScaler("cpu", **kw))
    assert _raised(lambda: ampfused.GradScaler("cpu", **kw)) == expected


@pytest.mark.parametrize("kw,exc,text", [
    (dict(growth_factor=float("nan")), ValueError, "growth_factor must be a finite number > 1.0, got nan"),
    (dict(growth_factor=float("inf")), ValueError, "growth_factor must be a finite number > 1.0, got inf"),
    (dict(backoff_factor=0.0), ValueError, "backoff_factor must be in the open interval (0, 1), got 0.0"),
    (dict(backoff_factor=-0.5), ValueError, "backoff_factor must be in the open interval (0, 1), got -0.5"),
    (dict(growth_interval=0), ValueError, "growth_interval must be >= 1, got 0"),
    (dict(growth_interval=2.5), TypeError, "growth_interval must be an int, got float"),
    (dict(growth_interval=True), TypeError, "growth_interval must be an int, got bool"),
    (dict(init_scale=0.0), ValueError, "init_scale must be a finite number > 0, got 0.0"),
    (dict(init_scale=float("nan")), ValueError, "init_scale must be a finite number > 0, got nan"),
    (dict(init_scale="big"), TypeError, "init_scale must be a real number, got str"),
])
def test_constructor_checks_beyond_torch(kw, exc, text):
    with pytest.raises(exc) as e:
        ampfused.GradScaler("cpu", **kw)
    assert str(e.value) == text


def test_unknown_backend_names_registered_ones():
    with pytest.raises(ValueError, match="unknown ampfused backend 'nope'; registered backends: "):
        ampfused.GradScaler("cpu", backend="nope")


@pytest.mark.parametrize("setter,value,text", [
    ("set_growth_factor", 1.0, "new_factor (growth factor) must be a finite number > 1.0, got 1.0"),
    ("set_backoff_factor", 0.0, "new_factor (backoff factor) must be in the open interval (0, 1), got 0.0"),
    ("set_growth_interval", 0, "new_interval (growth interval) must be >= 1, got 0"),
])
def test_setters_check_their_argument(setter, value, text):
    s = ampfused.GradScaler("cpu")
    before = (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval())
    with pytest.raises(ValueError) as e:
        getattr(s, setter)(value)
    assert str(e.value) == text
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == before


@pytest.mark.parametrize("outputs", [3.0, [torch.ones(1), 3.0], (torch.ones(1), [None]), "loss"])
def test_scale_rejects_non_tensors_before_creating_the_scale(outputs):
    s = ampfused.GradScaler("cpu")
    with pytest.raises(ValueError) as e:
        s.scale(outputs)
    assert str(e.value) == "outputs must be a Tensor or an iterable of Tensors"  # torch's message
    assert s._scale is None  # torch creates the scale from the first tensor before it sees the bad item
    if not isinstance(outputs, str):  # torch recurses forever on a str
        assert _raised(lambda: torch.amp.GradScaler("cpu").scale(outputs)) == (type(e.value), str(e.value))


def _good_sd():
    return {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100,
            "_growth_tracker": 3}


@pytest.mark.parametrize("key,value,exc,text", [
    ("growth_factor", 0.9, ValueError, "state_dict['growth_factor'] must be a finite number > 1.0, got 0.9"),
    ("backoff_factor", 1.5, ValueError, "state_dict['backoff_factor'] must be in the open interval (0, 1), got 1.5"),
    ("growth_interval", 0, ValueError, "state_dict['growth_interval'] must be >= 1, got 0"),
    ("scale", float("nan"), ValueError, "state_dict['scale'] must be a finite number >= 0, got nan"),
    ("scale", torch.ones(2), TypeError, "state_dict['scale'] must be a real number, got Tensor"),
    ("_growth_tracker", -1, ValueError, "state_dict['_growth_tracker'] must be an int >= 0, got -1"),
    ("growth_factor", None, KeyError, "\"GradScaler state_dict is missing the key 'growth_factor'\""),
])
def test_load_state_dict_checks_everything_first(key, value, exc, text):
    s = ampfused.GradScaler("cpu", init_scale=8.0)
    s.scale(torch.ones(()))
    before = s.state_dict()
    sd = _good_sd()
    if value is None:
        del sd[key]
    else:
        sd[key] = value
    with pytest.raises(exc) as e:
        s.load_state_dict(sd)
    assert str(e.value) == text
    assert s.state_dict() == before and s._init_scale == 8.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_integer_or_complex_gradients_rejected_before_any_change(dtype):
    good = torch.nn.Parameter(torch.ones(3))
    good.grad = torch.full((3,), 4.0)
    bad = torch.nn.Parameter(torch.ones(2, dtype=dtype), requires_grad=dtype.is_complex)
    bad.grad = torch.ones(2, dtype=dtype)
    opt = torch.optim.SGD([{"params": [good]}, {"params": [bad]}], lr=0.1)
    s = ampfused.GradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    with pytest.raises(TypeError) as e:
        s.unscale_(opt)
    assert str(e.value) == (f"optimizer.param_groups[1]['params'][0] (shape (2,)) has a {dtype} gradient: GradScaler "
                            "unscales floating-point gradients only (float32, bfloat16, float16, float64)")
    assert torch.equal(good.grad, torch.full((3,), 4.0))  # nothing was unscaled
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    with pytest.raises(TypeError, match="has a .* gradient"):
        s.step(opt)


def test_fused_optimizer_must_return_a_0d_found_inf():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = _fake_fused(p)
    opt._ampfused_unscale_ = lambda inv_scale: 0.0
    s = ampfused.GradScaler("cpu")
    s.scale(torch.ones(()))
    with pytest.raises(TypeError, match="_ampfused_unscale_ must return a 0-d found_inf tensor, got float"):
        s.unscale_(opt)
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.READY


def test_disabled_scaler_raises_nothing():
    s, opt, p = _setup(ampfused.GradScaler, enabled=False)
    _step_twice(s, opt)
    _unscale_twice(s, opt)
    s.update()
    s.load_state_dict({})


@pytest.mark.parametrize("method", ["unscale_", "step"])
def test_fused_optimizer_on_several_devices_rejected(method):
    # a "meta" parameter stands in for a second device
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, device="meta"))
    a.grad, b.grad = torch.ones(2), torch.ones(2, device="meta")
    opt = _fake_fused(a)
    opt.add_param_group({"params": [b]})
    s = ampfused.GradScaler("cpu")
    s.scale(torch.ones(()))
    with pytest.raises(ValueError) as e:
        getattr(s, method)(opt)
    assert str(e.value) == ("FakeFused is a fused optimizer with parameters on several devices (cpu, meta); a fused "
                            "optimizer's gradients must be on one device")
    assert opt.calls == [] and torch.equal(a.grad, torch.ones(2))
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.READY
