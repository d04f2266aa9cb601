"""The unscale and clip a fused step inherits (ampfused/optim/_clip_state.py): its transitions, and optimizers
pickled when it was three attributes of the optimizer (``_partials_cache``, ``_pending_clip``, ``_raw_clip``)."""
import io
import pickle

import pytest
import torch

import ampfused
from ampfused.optim._clip_state import ClipState, Partials
from oracle import assert_bitwise


def _setup(before_step):
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (5, 130)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 8.0
    opt = ampfused.FusedAdamW(params, lr=0.1)
    if before_step in ("unscale, clip", "unscale"):
        opt._ampfused_unscale_(torch.tensor(0.25))
    if before_step != "unscale":
        ampfused.clip_grad_norm_(params, 1.5)
    if before_step == "clip, unscale":
        opt._ampfused_unscale_(torch.tensor(0.25))
    return params, opt


def _as_pickled_before(opt, with_raw_clip=True) -> dict:
    """``opt.__getstate__()`` as an optimizer with the same pending unscale and clip gave it before."""
    state = opt.__getstate__()
    clip = state.pop("_clip_state")
    state["_partials_cache"] = None if clip.held is Partials.NONE else (clip.keys, clip.partials, clip.held.value)
    state["_pending_clip"] = clip.max_norm
    if with_raw_clip:
        state["_raw_clip"] = clip.coef
    else:
        assert clip.coef is None
    return state


@pytest.mark.parametrize("before_step", ["clip", "unscale, clip", "clip, unscale", "unscale"])
def test_optimizer_pickled_with_the_three_attributes_steps_the_same(before_step):
    ref_params, ref = _setup(before_step)
    params, opt = _setup(before_step)
    expected = (ref._clip_state.held, ref._clip_state.max_norm, ref._clip_state.coef is None)
    oldest = ref._clip_state.coef is None  # also as pickled before _raw_clip existed
    state = _as_pickled_before(opt, with_raw_clip=not oldest)
    twin = object.__new__(type(opt))
    twin.__setstate__(state)
    assert not any(name in twin.__dict__ for name in ("_partials_cache", "_pending_clip", "_raw_clip"))
    clip = twin._clip_state
    assert (clip.held, clip.max_norm, clip.coef is None) == expected
    ref.step()
    twin.step()
    for p, q in zip(ref_params, params):
        assert_bitwise(before_step, q.detach(), p.detach())
    assert twin._clip_state.held is Partials.NONE and twin._clip_state.max_norm is None


def test_pending_clip_survives_torch_save():
    params, opt = _setup("clip")
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back._clip_state.held is Partials.AS_THEY_ARE and back._clip_state.max_norm == 1.5
    assert pickle.loads(pickle.dumps(Partials.UNSCALED)) is Partials.UNSCALED


def test_transitions():
    g = [torch.ones(3), torch.ones(4)]
    keys = [(t, t._version) for t in g]
    partials = torch.zeros(2, 1)
    s = ClipState()
    s.measured(keys, partials)
    s.clip_folded(torch.tensor(4.0), 2.0)
    s.clip_folded(torch.tensor(4.0), 3.0)
    assert s.held is Partials.AS_THEY_ARE and s.max_norm == 2.0 and s.coef is not None
    owed = s.consumed_by_step(g, scaled=False)  # the same gradients, not unscaled by the step: K2 clips
    assert owed.partials is partials and owed.coef is None and owed.max_norm == 2.0
    assert (s.held, s.partials, s.max_norm, s.coef) == (Partials.NONE, None, None, None)

    s.measured(keys, partials)
    s.clip_folded(torch.tensor(4.0), 2.0)
    owed = s.consumed_by_step(g, scaled=True)  # the step unscales: the clip joins the unscale coefficient
    assert owed.partials is None and owed.max_norm is None and float(owed.coef) == pytest.approx(0.5, rel=1e-5)

    s.measured(keys, partials)
    s.clip_folded(torch.tensor(4.0), 2.0)
    g[0].add_(1)  # changed since the clip measured it
    owed = s.consumed_by_step(g, scaled=False)
    assert owed.partials is None and owed.max_norm is None and owed.coef is not None

    s.measured(keys, partials)
    s.clip_folded(torch.tensor(4.0), 2.0)
    assert float(s.unscale_coef(torch.tensor(0.5))) == pytest.approx(0.25, rel=1e-5)
    assert s.coef is None and s.max_norm is None
    keys = [(t, t._version) for t in g]
    s.unscaled(keys, partials)
    s.clip_folded(torch.tensor(4.0), 2.0)  # after the unscale: only K2's max_norm
    assert s.held is Partials.UNSCALED and s.coef is None and s.holds_partials_of(g)
    s.reset()
    assert (s.held, s.partials, s.max_norm, s.coef) == (Partials.NONE, None, None, None)
