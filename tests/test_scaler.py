"""ampfused.GradScaler against torch.amp.GradScaler: same scale, same skipped steps, same bits, on CPU."""
import copy
import io
import pickle

import pytest
import torch

import ampfused
from ampfused import ops
from torch.amp.grad_scaler import OptState
from oracle import assert_bitwise

# step -> (parameter index, flat element, value) written into that gradient after backward
INJECT = {3: (0, 0, float("inf")), 4: (2, 5, float("nan")), 40: (1, 3, float("-inf")), 41: (3, 1, float("inf")),
          97: (0, 7, float("nan")), 150: (2, 0, float("inf")), 151: (2, 1, float("nan")), 199: (1, 0, float("inf"))}


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches(n):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def _scalers(**kw):
    return torch.amp.GradScaler("cpu", **kw), ampfused.GradScaler("cpu", **kw)


def _skipped(scaler, opt):
    return sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0


def _run(model, opts, scaler, batches, clip=None):
    """One training run; returns per step (scale, tracker, skipped per optimizer, returned clip norm)."""
    trace = []
    params = list(model.parameters())
    for i, (x, y) in enumerate(batches):
        for o in opts:
            o.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
        scaler.scale(loss).backward()
        if i in INJECT:
            pi, k, v = INJECT[i]
            params[pi].grad.view(-1)[k] = v
        norm = None
        if clip is not None:
            for o in opts:
                scaler.unscale_(o)
            norm = clip(params, 0.5)
        skipped = []
        for o in opts:
            scaler.step(o)
            skipped.append(_skipped(scaler, o))
        scaler.update()
        trace.append((scaler.get_scale(), scaler._get_growth_tracker(), skipped, norm))
    return trace


def _two_runs(make_opts, clip_t=None, clip_a=None, steps=210, **scaler_kw):
    m_t, m_a = _model(), _model()
    st, sa = _scalers(**scaler_kw)
    batches = _batches(steps)
    tr_t = _run(m_t, make_opts(m_t), st, batches, clip_t)
    tr_a = _run(m_a, make_opts(m_a), sa, batches, clip_a)
    return m_t, m_a, tr_t, tr_a


def _assert_same_trace(tr_t, tr_a):
    for i, (a, b) in enumerate(zip(tr_t, tr_a)):
        assert a[:3] == b[:3], f"step {i}: torch {a[:3]} vs ampfused {b[:3]}"


def _assert_same_params(m_t, m_a):
    for (n, a), b in zip(m_t.named_parameters(), m_a.parameters()):
        assert_bitwise(n, a.detach(), b.detach())


SCALER_KW = dict(init_scale=2.0**118, growth_interval=5)  # grows into natural fp32 overflow as well


@pytest.mark.parametrize("opt", ["sgd", "adamw", "adam_fused"])
def test_training_loop_bitwise_like_torch(opt):
    def make(m):
        if opt == "sgd":
            return [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)]
        if opt == "adamw":
            return [torch.optim.AdamW(m.parameters(), lr=1e-3)]
        return [torch.optim.Adam(m.parameters(), lr=1e-3, fused=True)]  # torch's _step_supports_amp_scaling path
    m_t, m_a, tr_t, tr_a = _two_runs(make, steps=210 if opt == "sgd" else 120, **SCALER_KW)
    _assert_same_trace(tr_t, tr_a)
    _assert_same_params(m_t, m_a)
    skipped = [i for i, t in enumerate(tr_a) if t[2][0]]
    injected = {i for i in INJECT if i < len(tr_a)}
    assert injected <= set(skipped) and len(skipped) > len(injected)  # injected and natural overflows


def test_multi_optimizer_loop_bitwise_like_torch():
    def make(m):
        return [torch.optim.SGD(m[0].parameters(), lr=1e-3), torch.optim.AdamW(m[2].parameters(), lr=1e-3)]
    m_t, m_a, tr_t, tr_a = _two_runs(make, steps=120, **SCALER_KW)
    _assert_same_trace(tr_t, tr_a)
    _assert_same_params(m_t, m_a)
    assert any(t[2] == [True, False] for t in tr_a) and any(t[2] == [False, True] for t in tr_a)


def test_unscale_then_torch_clip_bitwise_like_torch():
    make = lambda m: [torch.optim.SGD(m.parameters(), lr=1e-3)]  # noqa: E731
    clip = torch.nn.utils.clip_grad_norm_
    m_t, m_a, tr_t, tr_a = _two_runs(make, clip, clip, steps=120, **SCALER_KW)
    _assert_same_trace(tr_t, tr_a)
    _assert_same_params(m_t, m_a)


def test_unscale_then_ampfused_clip_matches_torch():
    make = lambda m: [torch.optim.SGD(m.parameters(), lr=1e-3)]  # noqa: E731
    m_t, m_a, tr_t, tr_a = _two_runs(make, torch.nn.utils.clip_grad_norm_, ampfused.clip_grad_norm_,
                                     steps=120, init_scale=2.0**16, growth_interval=5)
    _assert_same_trace(tr_t, tr_a)
    for i, (a, b) in enumerate(zip(tr_t, tr_a)):
        assert torch.isfinite(a[3]) == torch.isfinite(b[3]), i
        if torch.isfinite(a[3]):
            torch.testing.assert_close(b[3], a[3], rtol=2e-6, atol=0, msg=f"norm at step {i}")
    for a, b in zip(m_t.parameters(), m_a.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# --- unscaling ------------------------------------------------------------------------------------------------
def _opt_with_grads(dtypes, scale, sizes=(1, 7, 129, 1000)):
    g = torch.Generator().manual_seed(3)
    params = []
    for dt in dtypes:
        for n in sizes:
            p = torch.nn.Parameter(torch.zeros(n, dtype=dt))
            p.grad = (torch.randn(n, generator=g) * scale).to(dt)
            params.append(p)
    return torch.optim.SGD(params, lr=0.1), params


@pytest.mark.parametrize("init_scale", [2.0**16, 3.7, 1e-3])
def test_fp32_unscale_bitwise_torch_kernel(init_scale):
    opt, params = _opt_with_grads([torch.float32], init_scale)
    expected = [p.grad.clone() for p in params]
    found = torch.zeros(())
    inv = torch.full((), init_scale, dtype=torch.float32).double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found, inv)
    s = ampfused.GradScaler("cpu", init_scale=init_scale)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    for p, e in zip(params, expected):
        assert_bitwise("grad", p.grad, e)
    assert s._found_inf_per_device(opt)[torch.device("cpu")].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_unscale(dtype):
    opt, params = _opt_with_grads([dtype, torch.float32], 1024.0)
    before = [p.grad.clone() for p in params]
    t_opt = torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1)
    for tp, p in zip(t_opt.param_groups[0]["params"], params):
        tp.grad = p.grad.clone()
    ts = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ts.scale(torch.ones(()))
    if dtype == torch.float16:
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            ts.unscale_(t_opt)  # what ampfused improves on
    s = ampfused.GradScaler("cpu", init_scale=1024.0)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    inv = torch.tensor(1 / 1024.0)
    for p, b in zip(params, before):
        assert_bitwise("grad", p.grad, (b.float() * inv).to(b.dtype))  # fp32 math, rounded once
    # the norm measured in the same pass is the fp32 norm of the unscaled values
    partials = ampfused.clip._cached_partials([p.grad for p in params])
    exact = torch.stack([(b.double() / 1024).pow(2).sum() for b in before]).sum().sqrt()
    torch.testing.assert_close(ops.reduce_partials(partials[torch.device("cpu")])[0].double(), exact, rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_non_finite_flag_any_dtype(dtype):
    opt, params = _opt_with_grads([dtype], 8.0)
    params[2].grad[5] = float("nan")
    s = ampfused.GradScaler("cpu", init_scale=8.0)
    s.scale(torch.ones(()))
    before = params[0].detach().clone()
    s.step(opt)
    assert s._found_inf_per_device(opt)[torch.device("cpu")].item() == 1.0
    assert_bitwise("param", params[0].detach(), before)  # skipped
    s.update()
    assert s.get_scale() == 4.0


def test_fp64_unscale_keeps_fp64_precision():
    opt, params = _opt_with_grads([torch.float64], 3.0)
    expected = [p.grad.clone() for p in params]
    torch._amp_foreach_non_finite_check_and_unscale_(expected, torch.zeros(()), torch.tensor(1 / 3.0))
    s = ampfused.GradScaler("cpu", init_scale=3.0)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    for p, e in zip(params, expected):
        assert_bitwise("grad", p.grad, e)


def test_sparse_gradients_like_torch():
    def setup():
        emb = torch.nn.Embedding(10, 3, sparse=True)
        emb.weight.grad = torch.sparse_coo_tensor([[1, 1, 4]], torch.ones(3, 3) * 8, (10, 3),
                                                   check_invariants=True)
        return emb, torch.optim.SGD(emb.parameters(), lr=0.1)
    (et, ot), (ea, oa) = setup(), setup()
    st, sa = _scalers(init_scale=8.0)
    for s, o in ((st, ot), (sa, oa)):
        s.scale(torch.ones(()))
        s.unscale_(o)
    assert_bitwise("grad", ea.weight.grad.to_dense(), et.weight.grad.to_dense())


def test_multi_device_grads_split_per_device_like_torch():
    # a "meta" parameter stands in for a second device: the split, not the arithmetic, is under test
    def setup():
        a = torch.nn.Parameter(torch.ones(3))
        b = torch.nn.Parameter(torch.ones(3, device="meta"))
        a.grad, b.grad = torch.ones(3), torch.ones(3, device="meta")
        return torch.optim.SGD([a, b], lr=0.1)
    ot, oa = setup(), setup()
    st, sa = _scalers()
    for s, o in ((st, ot), (sa, oa)):
        s.scale(torch.ones(()))
        s.unscale_(o)
    assert set(sa._found_inf_per_device(oa)) == set(st._found_inf_per_device(ot)) == {
        torch.device("cpu"), torch.device("meta")}


# --- observable state -----------------------------------------------------------------------------------------
def _train_steps(scaler, model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("direction", ["torch_to_ampfused", "ampfused_to_torch"])
def test_state_dict_interop_and_weights_only(direction):
    st, sa = _scalers(init_scale=2.0**20, growth_interval=3)
    src, dst = (st, sa) if direction == "torch_to_ampfused" else (sa, st)
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    _train_steps(src, m, opt, _batches(7))
    sd = src.state_dict()
    assert set(sd) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert all(type(v) in (float, int) for v in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded == sd
    fresh = type(dst)("cpu")
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == sd
    # both continue identically from the checkpoint
    m2, opt2 = copy.deepcopy(m), None
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.01)
    _train_steps(src, m, opt, _batches(5))
    _train_steps(fresh, m2, opt2, _batches(5))
    assert fresh.state_dict() == src.state_dict()


def test_pickle_round_trip():
    s = ampfused.GradScaler("cpu", init_scale=2.0**9, growth_interval=2, backend="reference")
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    _train_steps(s, m, opt, _batches(3))
    s2 = pickle.loads(pickle.dumps(s))
    assert type(s2) is ampfused.GradScaler and s2._backend == "reference"
    assert s2._scale is None and s2.state_dict() == s.state_dict()  # tensors come back lazily, as in torch
    s3 = pickle.loads(pickle.dumps(ampfused.GradScaler("cpu")))
    assert s3.get_scale() == 2.0**16


def test_lazy_scale_creation():
    s = ampfused.GradScaler("cpu", init_scale=4.0)
    assert s._scale is None and s._growth_tracker is None and s.get_scale() == 4.0
    out = s.scale([torch.ones(2), (torch.ones(1),)])
    assert isinstance(out, list) and isinstance(out[1], tuple) and out[1][0].item() == 4.0
    assert s._scale.dtype == torch.float32 and s._growth_tracker.dtype == torch.int32
    lazy = s.scale(t for t in [torch.ones(1)])  # other iterables stay lazy, as in torch
    assert next(iter(lazy)).item() == 4.0


def test_disabled_scaler_is_a_no_op():
    s = ampfused.GradScaler("cpu", enabled=False, growth_factor=0.5)  # nothing is checked when disabled
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = _batches(1)[0]
    loss = torch.nn.functional.mse_loss(m(x), y)
    assert s.scale(loss) is loss
    loss.backward()
    grads = [p.grad.clone() for p in m.parameters()]
    before = [p.detach().clone() for p in m.parameters()]
    s.unscale_(opt)
    for p, g in zip(m.parameters(), grads):
        assert_bitwise("grad", p.grad, g)
    assert s.step(opt) is None
    s.update()
    assert any(not torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert s.get_scale() == 1.0 and s.state_dict() == {} and not s.is_enabled()
    s.load_state_dict({})
    assert pickle.loads(pickle.dumps(s)).state_dict() == {}


def test_cuda_device_without_cuda_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA fallback")
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling."):
        s = ampfused.GradScaler()
    assert not s.is_enabled()


def test_deprecated_cuda_amp_alias():
    with pytest.warns(FutureWarning, match=r"ampfused.GradScaler\('cuda', args...\)"):
        s = ampfused.cuda.amp.GradScaler(init_scale=8.0, enabled=torch.cuda.is_available())
    assert isinstance(s, ampfused.GradScaler) and isinstance(s, torch.cuda.amp.GradScaler)
    assert s._device == "cuda"
    from ampfused.cuda.amp import autocast  # noqa: F401  (the whole torch.cuda.amp import line swaps)


def test_found_inf_tensors_are_the_ones_step_reads():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = ampfused.GradScaler("cpu")
    x, y = _batches(1)[0]
    s.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
    s.unscale_(opt)
    flags = s._found_inf_per_device(opt)
    assert flags is s._per_optimizer_states[id(opt)]["found_inf_per_device"]
    before = [p.detach().clone() for p in m.parameters()]
    for t in flags.values():
        t.fill_(1.0)  # what an all-reduce from another rank that overflowed does
    s.step(opt)
    for p, b in zip(m.parameters(), before):
        assert_bitwise("param", p.detach(), b)
    s.update()
    assert s.get_scale() == 2.0**15


def test_update_with_new_scale_like_torch():
    st, sa = _scalers()
    for s in (st, sa):
        s.scale(torch.ones(()))
        s.update(3.0)
        assert s.get_scale() == 3.0
        s.update(torch.tensor(5.0))
        assert s.get_scale() == 5.0


def test_hyperparameter_getters_setters():
    s = ampfused.GradScaler("cpu")
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 7)


# --- the protocol with ampfused's fused optimizers --------------------------------------------------------------
class FakeFused(torch.optim.Optimizer):
    """Plain SGD speaking the fused protocol: unscales (and checks) in its own step when handed the scale."""

    _step_supports_amp_scaling = True
    _ampfused_fused = True

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.calls = []
        self._last = None

    def _grads(self):
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _ampfused_unscale_(self, inv_scale):
        self.calls.append(("unscale", inv_scale))
        self.unscale_found = ops.reduce_partials(ops.unscale_(self._grads(), inv_scale))[1]
        return self.unscale_found

    @torch.no_grad()
    def step(self, closure=None):
        grad_scale, found_inf = self.grad_scale, self.found_inf  # AttributeError if the scaler set neither
        self.calls.append(("step", grad_scale, found_inf))
        if grad_scale is not None:  # still scaled: unscale and check here, as the fused first kernel does
            found_inf = ops.reduce_partials(ops.unscale_(self._grads(), grad_scale.double().reciprocal().float()))[1]
        self._last = found_inf.clone()
        if not found_inf.item():
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(p.grad, alpha=-g["lr"])
        return "stepped"

    @property
    def last_found_inf(self):
        return self._last


def _no_extra_pass(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the scaler ran a separate inf-check pass for a fused optimizer")
    monkeypatch.setattr(ampfused.GradScaler, "_check_inf_per_device", refuse)
    monkeypatch.setattr(ops, "norm_check", refuse)


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_fused_protocol_matches_torch_sgd(monkeypatch, explicit_unscale):
    _no_extra_pass(monkeypatch)
    clip = (lambda params, max_norm: None) if explicit_unscale else None  # makes _run call unscale_ first
    m_t, m_a = _model(), _model()
    st, sa = _scalers(**SCALER_KW)
    fused = FakeFused(m_a.parameters(), lr=1e-3)
    tr_t = _run(m_t, [torch.optim.SGD(m_t.parameters(), lr=1e-3)], st, _batches(60), clip)
    tr_a = _run(m_a, [fused], sa, _batches(60), clip)
    _assert_same_trace(tr_t, tr_a)
    _assert_same_params(m_t, m_a)
    steps = [c for c in fused.calls if c[0] == "step"]
    unscales = [c for c in fused.calls if c[0] == "unscale"]
    assert len(steps) == 60 and len(unscales) == (60 if explicit_unscale else 0)
    for _, grad_scale, found_inf in steps:
        if explicit_unscale:
            assert grad_scale is None and found_inf is not None
        else:
            assert grad_scale is sa._scale and found_inf is None
    assert not hasattr(fused, "grad_scale") and not hasattr(fused, "found_inf")


def test_fused_protocol_state_and_identity(monkeypatch):
    _no_extra_pass(monkeypatch)
    m = _model()
    opt = FakeFused(m.parameters(), lr=1e-3)
    s = ampfused.GradScaler("cpu", init_scale=2.0**10)
    x, y = _batches(1)[0]
    s.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
    s.unscale_(opt)
    (_, inv), = opt.calls
    assert inv.item() == 2.0**-10
    flags = s._found_inf_per_device(opt)
    assert flags == {torch.device("cpu"): opt.unscale_found} and flags[torch.device("cpu")] is opt.unscale_found
    flags[torch.device("cpu")].fill_(1.0)  # an all-reduce in place reaches the optimizer's step
    before = [p.detach().clone() for p in m.parameters()]
    assert s.step(opt) == "stepped"
    assert opt.calls[-1][2] is opt.unscale_found
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    assert s._found_inf_per_device(opt)[torch.device("cpu")] is opt.last_found_inf
    for p, b in zip(m.parameters(), before):
        assert_bitwise("param", p.detach(), b)
    s.update()
    assert s.get_scale() == 2.0**9
