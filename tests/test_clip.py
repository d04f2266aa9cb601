"""ampfused.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_, the fp64 truth, and its two shortcuts (the
norm cached by GradScaler.unscale_ and the fused-optimizer hook)."""
import gc
import math
import weakref

import pytest
import torch

import ampfused
from ampfused import ops
from oracle import assert_bitwise

SIZES = (1, 7, 129, 1031)
NORM_TYPES = [2.0, 1.0, math.inf, -math.inf, 0.5, 3.0, 0.0, "inf"]


def _params(dtype=torch.float32, scale=1.0, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
        ps.append(p)
    return ps


def _clone(ps):
    out = []
    for p in ps:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_fp32_matches_torch(norm_type, max_norm):
    ours, theirs = _params(), _params()
    n_a = ampfused.clip_grad_norm_(ours, max_norm, norm_type)
    n_t = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert n_a.dtype == n_t.dtype == torch.float32 and n_a.shape == ()
    if float(norm_type) != 2.0:  # the same per-tensor-then-total reduction as torch: the same bits
        assert_bitwise("norm", n_a, n_t)
    torch.testing.assert_close(n_a, n_t, rtol=1e-6, atol=0)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a.grad, t.grad, rtol=2e-6, atol=0)
        if max_norm == 1e6:  # coefficient exactly 1 in both
            assert_bitwise("grad", a.grad, t.grad)


def _fp64_truth(ps, max_norm, norm_type):
    g64 = [p.grad.double() for p in ps]
    per = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in g64])
    norm = torch.linalg.vector_norm(per, norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return norm, [g * coef for g in g64]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0])
def test_low_precision_more_accurate_than_torch(dtype, norm_type):
    # many elements of similar size, so that torch's per-tensor rounding to the gradient dtype shows
    sizes = (4099, 8191, 1000, 3)
    ours, theirs = _params(dtype, 0.1, sizes, seed=5), _params(dtype, 0.1, sizes, seed=5)
    norm64, clipped64 = _fp64_truth(ours, 0.25, norm_type)
    n_a = ampfused.clip_grad_norm_(ours, 0.25, norm_type)
    n_t = torch.nn.utils.clip_grad_norm_(theirs, 0.25, norm_type)
    assert n_a.dtype == torch.float32 and n_t.dtype == dtype
    err_a, err_t = abs(n_a.double() - norm64).item(), abs(n_t.double() - norm64).item()
    assert err_a * 10 < err_t and err_a <= 1e-5 * norm64.item()
    fi = torch.finfo(dtype)
    for a, t, e in zip(ours, theirs, clipped64):
        assert a.grad.dtype == dtype
        # within one unit in the last place of the exact result (subnormals included), never worse than torch
        ulp = fi.eps * e.abs() + fi.smallest_normal * fi.eps
        assert ((a.grad.double() - e).abs() <= ulp).all()
        assert (a.grad.double() - e).abs().max() <= (t.grad.double() - e).abs().max()


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_mixed_gradient_dtypes(norm_type):
    ps = _params(torch.float32, sizes=(33, 100)) + _params(torch.bfloat16, sizes=(77,), seed=1) + _params(
        torch.float16, sizes=(5,), seed=2)
    norm64, clipped64 = _fp64_truth(ps, 0.5, norm_type)
    n = ampfused.clip_grad_norm_(ps, 0.5, norm_type)
    assert n.dtype == torch.float32
    torch.testing.assert_close(n.double(), norm64, rtol=1e-6, atol=0)
    for p, e in zip(ps, clipped64):
        # the fp32 coefficient max_norm/(norm+1e-6) carries about one ulp (the norm's rounding, which depends
        # on the backend's summation order), the product half an ulp more: two ulps of the exact result
        torch.testing.assert_close(p.grad, e.to(p.grad.dtype), rtol=2 * torch.finfo(p.grad.dtype).eps, atol=0)


def test_fp64_gradients_like_torch():
    ours, theirs = _params(torch.float64), _params(torch.float64)
    n_a = ampfused.clip_grad_norm_(ours, 0.5)
    n_t = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert n_a.dtype == torch.float64
    torch.testing.assert_close(n_a, n_t, rtol=1e-14, atol=0)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a.grad, t.grad, rtol=1e-14, atol=0)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_error_if_nonfinite_like_torch(bad, norm_type):
    ours, theirs = _params(), _params()
    for ps in (ours, theirs):
        ps[2].grad[3] = bad
    before = [p.grad.clone() for p in ours]
    with pytest.raises(RuntimeError) as e_t:
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as e_a:
        ampfused.clip_grad_norm_(ours, 1.0, norm_type, error_if_nonfinite=True)
    assert str(e_a.value) == str(e_t.value)
    for p, b in zip(ours, before):
        assert_bitwise("grad", p.grad, b)  # nothing changed
    n_a = ampfused.clip_grad_norm_(ours, 1.0, norm_type)
    n_t = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert torch.isnan(n_a) == torch.isnan(n_t) and torch.isinf(n_a) == torch.isinf(n_t)


def test_empty_and_gradless_parameters_like_torch():
    for params in ([], [torch.nn.Parameter(torch.ones(3))]):
        out = ampfused.clip_grad_norm_(params, 1.0)
        assert torch.equal(out, torch.nn.utils.clip_grad_norm_(params, 1.0)) and out.dtype == torch.float32
    with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient clipping will occur."):
        ampfused.clip_grad_norm_((p for p in []), 1.0)


def test_single_tensor_and_generator_arguments():
    (p,), (q,) = _params(sizes=(50,)), _params(sizes=(50,))
    torch.testing.assert_close(ampfused.clip_grad_norm_(p, 0.1), torch.nn.utils.clip_grad_norm_(q, 0.1))
    torch.testing.assert_close(p.grad, q.grad)
    ps, qs = _params(), _params()
    torch.testing.assert_close(ampfused.clip_grad_norm_(iter(ps), 0.1), torch.nn.utils.clip_grad_norm_(qs, 0.1))


def test_max_norm_inf_measures_without_touching_the_gradients():
    ps = _params()
    versions = [p.grad._version for p in ps]
    expected = torch.nn.utils.clip_grad_norm_(_clone(ps), math.inf)
    torch.testing.assert_close(ampfused.clip_grad_norm_(ps, math.inf), expected)
    assert [p.grad._version for p in ps] == versions


def test_foreach_flag_like_torch():
    ours, theirs = _params(), _params()
    torch.testing.assert_close(ampfused.clip_grad_norm_(ours, 0.3, 3.0, foreach=False),
                               torch.nn.utils.clip_grad_norm_(theirs, 0.3, 3.0, foreach=False))
    meta = [torch.nn.Parameter(torch.ones(2, device="meta"))]
    meta[0].grad = torch.ones(2, device="meta")
    with pytest.raises(RuntimeError) as e_t:
        torch.nn.utils.clip_grad_norm_(meta, 1.0, foreach=True)
    with pytest.raises(RuntimeError) as e_a:
        ampfused.clip_grad_norm_(meta, 1.0, foreach=True)
    assert str(e_a.value) == str(e_t.value)


@pytest.mark.parametrize("kw,exc,text", [
    (dict(max_norm=-1.0), ValueError, "max_norm must be a number >= 0 (not NaN; inf means no clipping), got -1.0"),
    (dict(max_norm=math.nan), ValueError, "max_norm must be a number >= 0 (not NaN; inf means no clipping), got nan"),
    (dict(max_norm="one"), TypeError, "max_norm must be a real number, got str"),
    (dict(max_norm=1.0, norm_type=math.nan), ValueError, "norm_type must be a number or inf (not NaN), got nan"),
])
def test_bad_arguments_rejected_before_any_change(kw, exc, text):
    ps = _params()
    before = [p.grad.clone() for p in ps]
    with pytest.raises(exc) as e:
        ampfused.clip_grad_norm_(ps, **kw)
    assert str(e.value) == text
    for p, b in zip(ps, before):
        assert_bitwise("grad", p.grad, b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_integer_or_complex_gradients_rejected(dtype):
    ps = _params()
    bad = torch.nn.Parameter(torch.ones(2, dtype=dtype), requires_grad=dtype.is_complex)
    bad.grad = torch.ones(2, dtype=dtype)
    before = [p.grad.clone() for p in ps]
    with pytest.raises(TypeError) as e:
        ampfused.clip_grad_norm_(ps + [bad], 0.1)
    assert str(e.value) == (f"parameters[4] (shape (2,)) has a {dtype} gradient: clip_grad_norm_ takes floating-point "
                            "gradients (float32, bfloat16, float16, float64); use torch.nn.utils.clip_grad_norm_ "
                            "for complex ones")
    for p, b in zip(ps, before):
        assert_bitwise("grad", p.grad, b)
    with pytest.raises(TypeError, match=r"parameters\[1\] must be a torch.Tensor, got int"):
        ampfused.clip_grad_norm_([ps[0], 3], 0.1)


# --- the norm cached by GradScaler.unscale_ -------------------------------------------------------------------
def _count_norm_checks(monkeypatch):
    calls = []
    real = ops.norm_check

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(ops, "norm_check", counting)
    return calls


def _unscaled(dtype=torch.float32, scale=2.0**12):
    ps = _params(dtype, scale)
    opt = torch.optim.SGD(ps, lr=0.1)
    s = ampfused.GradScaler("cpu", init_scale=scale)
    s.scale(torch.ones(()))
    s.unscale_(opt)
    return ps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reuses_the_norm_measured_by_unscale(monkeypatch, dtype):
    ps = _unscaled(dtype)
    calls = _count_norm_checks(monkeypatch)
    fresh = ampfused.clip_grad_norm_(_clone(ps), 0.5)
    assert len(calls) == 1
    norm = ampfused.clip_grad_norm_(ps, 0.5)
    assert len(calls) == 1  # no second read of the gradients
    torch.testing.assert_close(norm, fresh, rtol=1e-6 if dtype == torch.float32 else 4e-3, atol=0)
    # clipping changed the gradients in place, so the next call measures again
    again = ampfused.clip_grad_norm_(ps, 0.5)
    assert len(calls) == 2
    torch.testing.assert_close(again, torch.tensor(0.5), rtol=1e-5, atol=0)


@pytest.mark.parametrize("change", ["in_place", "replaced", "subset", "view_write"])
def test_cache_invalidated_when_gradients_change(monkeypatch, change):
    ps = _unscaled()
    if change == "in_place":
        ps[1].grad.mul_(3.0)
    elif change == "replaced":
        ps[1].grad = ps[1].grad * 3.0
    elif change == "view_write":
        ps[3].grad.view(-1)[:5] = 100.0  # writes through a view share the gradient's version counter
    calls = _count_norm_checks(monkeypatch)
    target = ps[:2] if change == "subset" else ps
    expected = torch.nn.utils.clip_grad_norm_(_clone(target), 0.5)
    norm = ampfused.clip_grad_norm_(target, 0.5)
    assert len(calls) == 1
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)


def test_cache_only_for_the_l2_norm(monkeypatch):
    ps = _unscaled()
    expected = torch.nn.utils.clip_grad_norm_(_clone(ps), 0.5, math.inf)
    torch.testing.assert_close(ampfused.clip_grad_norm_(ps, 0.5, math.inf), expected)


# --- the fused-optimizer hook ---------------------------------------------------------------------------------
class FakeOwner(torch.optim.Optimizer):
    """Stands in for a fused optimizer: its parameters point back to it and it records fold requests."""

    _ampfused_fused = True

    def __init__(self, params, answer):
        super().__init__(params, dict(lr=0.1))
        self.answer, self.folds = answer, []
        for g in self.param_groups:
            for p in g["params"]:
                p._ampfused_owner = weakref.ref(self)

    def _ampfused_fold_clip_(self, max_norm, norm_type, error_if_nonfinite):
        self.folds.append((max_norm, norm_type, error_if_nonfinite))
        return self.answer


def test_fused_owner_folds_the_clip():
    ps = _params()
    before = [p.grad.clone() for p in ps]
    owner = FakeOwner(ps, torch.tensor(7.0))
    out = ampfused.clip_grad_norm_(ps, 0.5, 2, True)
    assert out is owner.answer and owner.folds == [(0.5, 2.0, True)]
    for p, b in zip(ps, before):
        assert_bitwise("grad", p.grad, b)  # left for the optimizer's step to scale


@pytest.mark.parametrize("case", ["declines", "subset", "two_owners", "dead_owner"])
def test_fused_owner_falls_back_to_the_normal_path(case):
    ps = _params()
    expected = torch.nn.utils.clip_grad_norm_(_clone(ps), 0.5)
    owner = FakeOwner(ps if case != "two_owners" else ps[:2], None if case == "declines" else torch.tensor(7.0))
    other = FakeOwner(ps[2:], torch.tensor(8.0)) if case == "two_owners" else None
    target = ps[:3] if case == "subset" else ps
    if case == "subset":
        expected = torch.nn.utils.clip_grad_norm_(_clone(target), 0.5)
    if case == "dead_owner":
        del owner
        gc.collect()
        owner = None
    out = ampfused.clip_grad_norm_(target, 0.5)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    if case == "declines":
        assert owner.folds == [(0.5, 2.0, False)]
    elif owner is not None:
        assert owner.folds == [] and (other is None or other.folds == [])
