"""Ports of the grad-scaling tests of PyTorch's test/test_torch.py and test/test_cuda.py (``test_grad_scaling_*``)
to the CPU, with ``ampfused.GradScaler``, ``ampfused.clip_grad_norm_`` and the fused optimizers.

torch's harness (``_run_scaling_case``): a control run without a scaler skips the step at ``skip_iter``; the
scaling run puts an inf into a gradient at ``skip_iter`` so that the scaler skips it; both must end with the same
parameters, and the scale must have grown and backed off exactly as often as torch's rule says. Here the control
is torch's optimizer with torch's clip; the scaling run uses ampfused throughout (a plain torch.optim.SGD driven by
ampfused.GradScaler too). Gradients are scaled by powers of two (exact), so fp32 runs agree to a few ulps."""
from __future__ import annotations

import pytest
import torch

import ampfused
from backends import TRITON_DEVICE, requires_triton

TORCH_OF = {ampfused.FusedSGD: torch.optim.SGD, ampfused.FusedAdamW: torch.optim.AdamW,
            torch.optim.SGD: torch.optim.SGD}
OPTIMIZERS = [pytest.param(c, id=c.__name__) for c in TORCH_OF]
INIT_SCALE, GROWTH, BACKOFF, INTERVAL = 128.0, 2.0, 0.5, 1
SKIP_ITER = 2
TOL = dict(rtol=2e-5, atol=1e-6)


def _models(optimizer_cls, lr=1.0):
    torch.manual_seed(0)
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling.load_state_dict(control.state_dict())
    kw = dict(lr=lr if optimizer_cls is not ampfused.FusedAdamW else 1e-2)
    return control, TORCH_OF[optimizer_cls](control.parameters(), **kw), scaling, optimizer_cls(scaling.parameters(),
                                                                                                 **kw)


def _data(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


def _scaler(**kw):
    return ampfused.GradScaler("cpu", init_scale=INIT_SCALE, growth_factor=GROWTH, backoff_factor=BACKOFF,
                               growth_interval=INTERVAL, **kw)


def _run_scaling_case(run, optimizer_cls, unskipped, skipped, **model_kw):
    """torch's _run_scaling_case: control (no scaler, step skipped at SKIP_ITER) against scaling (an inf at
    SKIP_ITER); equal parameters, and the scale after ``unskipped`` growths and ``skipped`` backoffs."""
    control, opt_c, scaling, opt_s = _models(optimizer_cls, **model_kw)
    data = _data()
    run(data, control, opt_c, None, SKIP_ITER)
    scaler = _scaler()
    run(data, scaling, opt_s, scaler, SKIP_ITER)
    expected = INIT_SCALE * GROWTH ** unskipped * BACKOFF ** skipped
    assert scaler.get_scale() == expected
    for c, s in zip(control.parameters(), scaling.parameters()):
        torch.testing.assert_close(s, c, **TOL)
    return control, scaling


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _scaled_step(model, opt, scaler, loss, i, skip_iter):
    """The scaled run's iteration of torch's scaling tests: backward, an inf at the skipped step, step, update."""
    scaler.scale(loss).backward()
    if i == skip_iter:
        model[1].weight.grad.data.fill_(float("inf"))
    scaler.step(opt)
    scaler.update()


def _control_step(model, opt, loss, i, skip_iter, max_norm=None):
    """The unscaled control run of torch's scaling tests: backward, the clip if any, the step unless skipped."""
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if i != skip_iter:
        opt.step()


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_grad_scaling_plain(optimizer_cls):
    def run(data, model, opt, scaler, skip_iter):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = _loss(model, x, y)
            if scaler is None:
                _control_step(model, opt, loss, i, skip_iter)
                continue
            _scaled_step(model, opt, scaler, loss, i, skip_iter)
    _run_scaling_case(run, optimizer_cls, unskipped=3, skipped=1)


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_grad_scaling_clipping_before_unscale(optimizer_cls):
    """torch's test_grad_scaling_clipping: the still-scaled gradients clipped to ``max_norm * scale`` with
    ampfused.clip_grad_norm_, then scaler.step: the clip acts where it is called (on the scaled gradients, i.e.
    at max_norm on the unscaled ones), folded into the fused step; parameters as torch's."""
    max_norm = 0.2

    def run(data, model, opt, scaler, skip_iter):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = _loss(model, x, y)
            if scaler is None:
                _control_step(model, opt, loss, i, skip_iter, max_norm)
                continue
            scaler.scale(loss).backward()
            norm = ampfused.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            assert float(norm) > max_norm * scaler.get_scale()  # the clip has an effect
            if i == skip_iter:
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.step(opt)
            scaler.update()
    control, _ = _run_scaling_case(run, optimizer_cls, unskipped=3, skipped=1)
    # and the clip mattered: an unclipped run ends elsewhere
    free, opt_f, _, _ = _models(optimizer_cls)
    for i, (x, y) in enumerate(_data()):
        opt_f.zero_grad()
        _loss(free, x, y).backward()
        if i != SKIP_ITER:
            opt_f.step()
    assert max((a - b).abs().max().item() for a, b in zip(free.parameters(), control.parameters())) > 1e-3


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_grad_scaling_clipping_separate_unscale(optimizer_cls):
    """torch's test_grad_scaling_clipping_separate_unscale: unscale_, clip at max_norm, step."""
    max_norm = 0.2

    def run(data, model, opt, scaler, skip_iter):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = _loss(model, x, y)
            if scaler is None:
                _control_step(model, opt, loss, i, skip_iter, max_norm)
                continue
            scaler.scale(loss).backward()
            if i == skip_iter:
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.unscale_(opt)
            ampfused.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            scaler.step(opt)
            scaler.update()
    _run_scaling_case(run, optimizer_cls, unskipped=3, skipped=1)


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_clip_before_a_separate_unscale_acts_on_the_scaled_gradients(optimizer_cls):
    """Not in torch's suite, the same rule: clip (scaled, max_norm * scale), then unscale_, then step."""
    max_norm = 0.2

    def run(data, model, opt, scaler, skip_iter):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = _loss(model, x, y)
            if scaler is None:
                _control_step(model, opt, loss, i, skip_iter, max_norm)
                continue
            scaler.scale(loss).backward()
            ampfused.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            if i == skip_iter:
                model[1].weight.grad.data.fill_(float("inf"))
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    _run_scaling_case(run, optimizer_cls, unskipped=3, skipped=1)


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_grad_scaling_penalty(optimizer_cls):
    """torch's test_grad_scaling_penalty: a gradient penalty from autograd.grad of the scaled loss, unscaled
    by hand, added to the loss."""
    def run(data, model, opt, scaler, skip_iter):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = _loss(model, x, y)
            scale = scaler.get_scale() if scaler is not None else 1.0
            grads = torch.autograd.grad(loss * scale, model.parameters(), create_graph=True)
            grads = [g / scale for g in grads]
            loss = loss + sum(g.pow(2).sum() for g in grads)
            if scaler is None:
                _control_step(model, opt, loss, i, skip_iter)
                continue
            _scaled_step(model, opt, scaler, loss, i, skip_iter)
    _run_scaling_case(run, optimizer_cls, unskipped=3, skipped=1)


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_grad_scaling_accumulation(optimizer_cls):
    """torch's test_grad_scaling_accumulation: two micro-batches per step."""
    per_step = 2

    def run(data, model, opt, scaler, skip_iter):
        for i, (x, y) in enumerate(data):
            loss = _loss(model, x, y) / per_step
            (loss if scaler is None else scaler.scale(loss)).backward()
            if (i + 1) % per_step == 0:
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
    _run_scaling_case(run, optimizer_cls, unskipped=2, skipped=0)


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_grad_scaling_multiple_models_losses_and_optimizers(optimizer_cls):
    """torch's test_grad_scaling_multiple: two models, two optimizers, one scaler, one of them unscaled
    separately; an inf in one model's gradients skips its optimizer's step and backs the scale off once."""
    torch.manual_seed(0)
    a_c, oa_c, a_s, oa_s = _models(optimizer_cls)
    b_c, ob_c, b_s, ob_s = _models(optimizer_cls)
    scaler = _scaler()
    for i, (x, y) in enumerate(_data()):
        for opt in (oa_c, ob_c, oa_s, ob_s):
            opt.zero_grad()
        out_c, out_s = a_c(x), a_s(x)
        l0_c, l0_s = _loss(b_c, out_c, y), _loss(b_s, out_s, y)
        l1_c, l1_s = torch.nn.functional.mse_loss(out_c, y), torch.nn.functional.mse_loss(out_s, y)
        (l0_c + l1_c).backward()
        scaler.scale(l0_s).backward(retain_graph=True)
        scaler.scale(l1_s).backward()
        oa_c.step()
        if i == SKIP_ITER:  # only the optimizer whose gradients hold the inf skips
            b_s[1].weight.grad.data.fill_(float("inf"))
        else:
            ob_c.step()
        scaler.unscale_(oa_s)  # as torch's test: one optimizer unscaled separately
        scaler.step(oa_s)
        scaler.step(ob_s)
        scaler.update()
    assert scaler.get_scale() == INIT_SCALE * GROWTH ** 3 * BACKOFF
    for c, s in zip(list(a_c.parameters()) + list(b_c.parameters()), list(a_s.parameters()) + list(b_s.parameters())):
        torch.testing.assert_close(s, c, **TOL)


@pytest.mark.parametrize("optimizer_cls", OPTIMIZERS)
def test_grad_scaling_autocast(optimizer_cls):
    """torch's test_grad_scaling_autocast on the CPU: the forward under bf16 autocast in both runs."""
    def run(data, model, opt, scaler, skip_iter):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model, x, y).float()
            if scaler is None:
                _control_step(model, opt, loss, i, skip_iter)
                continue
            _scaled_step(model, opt, scaler, loss, i, skip_iter)
    _run_scaling_case(run, optimizer_cls, unskipped=3, skipped=1)


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(lazy_init_scale):
    """torch's test_grad_scaling_state_dict, ampfused.GradScaler and torch's side by side."""
    for cls in (torch.amp.GradScaler, ampfused.GradScaler):
        s0 = cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = cls("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        s1._init_growth_tracker = 7
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0))
            assert s1._scale.dtype == torch.float32
        s1.load_state_dict(s0.state_dict())
        assert s1.get_scale() == 3.0 and s1.get_growth_factor() == 4.0
        assert s1.get_backoff_factor() == 0.5 and s1.get_growth_interval() == 2
        assert s1._init_growth_tracker == 0
        assert s1.state_dict() == s0.state_dict()


def test_grad_scaling_scale_nested_outputs():
    """torch's test_grad_scaling_scale: tensors, and lists / tuples / iterables of them, scaled alike."""
    t, a = torch.amp.GradScaler("cpu", init_scale=2.0), ampfused.GradScaler("cpu", init_scale=2.0)
    x = torch.full((1,), 4.0)
    nested = [x, (x, x), [x, [x]]]
    for ours, theirs in ((a.scale(x), t.scale(x)), (a.scale(nested), t.scale(nested))):
        assert type(ours) is type(theirs)
        torch.testing.assert_close(torch.cat([z.flatten() for z in _flat(ours)]),
                                   torch.cat([z.flatten() for z in _flat(theirs)]), rtol=0, atol=0)
    for bad in ("x", [x, "x"]):
        with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
            a.scale(bad)


def _flat(v):
    if isinstance(v, torch.Tensor):
        return [v]
    return [z for item in v for z in _flat(item)]


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, ampfused.GradScaler])
def test_unscale_grads_private_api(scaler_cls):
    """torch's test_grad_scaling_unscale ("perfect storm" part): ``_unscale_grads_`` over gradients of mixed
    dtypes and layouts, a (1,)-shaped inv_scale and found_inf; an inf in any one is found. ampfused also writes
    the flag into the found_inf given (torch writes a copy of it)."""
    g = torch.full((20, 20), 4.0)

    def storm(inject):
        grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16)]
        if inject >= 0:
            grads[inject][2, 2] = float("inf")
        return grads

    scaler = scaler_cls("cpu")
    params = [torch.empty_like(x) for x in storm(-1)]
    opt = torch.optim.SGD(params, lr=1.0)
    inv_scale = torch.full((1,), 0.25)
    for inject in range(-1, len(params)):
        found_inf = torch.full((1,), 0.0)
        grads = storm(inject)
        for p, gr in zip(params, grads):
            p.grad = gr
        per_device = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
        assert sum(v.item() for v in per_device.values()) == (0 if inject < 0 else 1)
        if scaler_cls is ampfused.GradScaler:
            assert per_device[torch.device("cpu")] is found_inf and found_inf.item() == (inject >= 0)
        if inject < 0:
            for gr in grads:
                torch.testing.assert_close(gr, torch.ones_like(gr), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler._unscale_grads_(opt, inv_scale, torch.zeros(1), False)


def test_unscale_grads_with_fused_optimizer_and_0d_tensors():
    params = [torch.nn.Parameter(torch.ones(3))]
    params[0].grad = torch.full((3,), 8.0)
    opt = ampfused.FusedSGD(params, lr=1.0)
    found = torch.zeros(())
    out = ampfused.GradScaler("cpu")._unscale_grads_(opt, torch.tensor(0.125), found, True)
    assert out[torch.device("cpu")] is found and found.item() == 0.0
    torch.testing.assert_close(params[0].grad, torch.ones(3))
    with pytest.raises(ValueError, match="inv_scale must be a 1-element floating-point tensor"):
        ampfused.GradScaler("cpu")._unscale_grads_(opt, torch.ones(2), found, True)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("scaler_cls", [ampfused.GradScaler, torch.amp.GradScaler])
def test_clip_before_the_step_under_either_scaler_and_backend(scaler_cls, backend):
    """The clip of the scaled gradients folded into the fused step, with torch's GradScaler too (it hands the
    fused optimizer its scale the same way), on the reference and Triton kernels: torch's numbers."""
    max_norm = 0.2
    dev = TRITON_DEVICE if backend == "triton" else "cpu"  # compiled Triton runs on CUDA tensors only
    control, _, scaling, _ = _models(ampfused.FusedSGD)
    control.to(dev), scaling.to(dev)
    opt_c = torch.optim.SGD(control.parameters(), lr=1.0)
    opt_s = ampfused.FusedSGD(scaling.parameters(), lr=1.0, backend=backend)
    scaler = scaler_cls(dev, init_scale=INIT_SCALE)
    for x, y in ((x.to(dev), y.to(dev)) for x, y in _data(3)):
        opt_c.zero_grad()
        _loss(control, x, y).backward()
        torch.nn.utils.clip_grad_norm_(control.parameters(), max_norm)
        opt_c.step()
        opt_s.zero_grad()
        scaler.scale(_loss(scaling, x, y)).backward()
        ampfused.clip_grad_norm_(scaling.parameters(), max_norm * scaler.get_scale())
        scaler.step(opt_s)
        scaler.update()
    for c, s in zip(control.parameters(), scaling.parameters()):
        torch.testing.assert_close(s, c, **TOL)


def test_clip_without_a_scaler_still_folds_at_max_norm():
    """No scaler: the gradients the clip saw are the ones the step reads; the clip folds into the step as
    before (max_norm on them), and the gradients are left as they were (never written back)."""
    max_norm = 0.2
    control, opt_c, scaling, opt_s = _models(ampfused.FusedSGD)
    for x, y in _data(3):
        for model, opt, clip in ((control, opt_c, torch.nn.utils.clip_grad_norm_),
                                 (scaling, opt_s, ampfused.clip_grad_norm_)):
            opt.zero_grad()
            _loss(model, x, y).backward()
            clip(model.parameters(), max_norm)
        raw = [p.grad.clone() for p in scaling.parameters()]
        opt_c.step()
        opt_s.step()
        assert all(torch.equal(g, p.grad) for g, p in zip(raw, scaling.parameters()))
    for c, s in zip(control.parameters(), scaling.parameters()):
        torch.testing.assert_close(s, c, **TOL)


def test_clip_then_torch_scalers_own_unscale_then_step():
    """torch.amp.GradScaler unscales in place with its own kernels (the fused optimizer is not told): a clip made
    before that still acts on the gradients as they were when it was called."""
    max_norm = 0.2
    control, opt_c, scaling, opt_s = _models(ampfused.FusedAdamW)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    for x, y in _data(3):
        opt_c.zero_grad()
        _loss(control, x, y).backward()
        torch.nn.utils.clip_grad_norm_(control.parameters(), max_norm)
        opt_c.step()
        opt_s.zero_grad()
        scaler.scale(_loss(scaling, x, y)).backward()
        ampfused.clip_grad_norm_(scaling.parameters(), max_norm * scaler.get_scale())
        scaler.unscale_(opt_s)
        scaler.step(opt_s)
        scaler.update()
    for c, s in zip(control.parameters(), scaling.parameters()):
        torch.testing.assert_close(s, c, **TOL)


def test_two_clips_before_the_step_act_as_torchs_two_clips():
    control, opt_c, scaling, opt_s = _models(ampfused.FusedSGD)
    scaler = ampfused.GradScaler("cpu", init_scale=INIT_SCALE)
    for x, y in _data(2):
        opt_c.zero_grad()
        _loss(control, x, y).backward()
        for m in (0.5, 0.2):
            torch.nn.utils.clip_grad_norm_(control.parameters(), m)
        opt_c.step()
        opt_s.zero_grad()
        scaler.scale(_loss(scaling, x, y)).backward()
        for m in (0.5, 0.2):
            ampfused.clip_grad_norm_(scaling.parameters(), m * scaler.get_scale())
        scaler.step(opt_s)
        scaler.update()
    for c, s in zip(control.parameters(), scaling.parameters()):
        torch.testing.assert_close(s, c, **TOL)


def test_zero_grad_drops_a_clip_that_was_never_stepped():
    """A clip belongs to the gradients it measured: zero_grad discards both, as an eager clip's effect goes
    with the gradients it scaled."""
    control, opt_c, scaling, opt_s = _models(ampfused.FusedSGD)
    (x, y), (x2, y2) = _data(2)
    _loss(scaling, x, y).backward()
    ampfused.clip_grad_norm_(scaling.parameters(), 1e-3)
    opt_s.zero_grad()
    for model, opt in ((control, opt_c), (scaling, opt_s)):
        opt.zero_grad()
        _loss(model, x2, y2).backward()
        opt.step()
    for c, s in zip(control.parameters(), scaling.parameters()):
        torch.testing.assert_close(s, c, **TOL)
