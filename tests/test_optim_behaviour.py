"""Fused-optimizer behaviour: skipped steps change nothing, the user's tensors stay theirs, awkward sizes, lr
handling, the long loop with torch's scaler and clip, torch.compile and the custom ops."""
import math
import warnings

import pytest
import torch

import ampfused
from ampfused import ops
from backends import cpu_backends, snapshot, set_grad
from oracle import assert_bitwise


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("make", [
    lambda ps, b: ampfused.FusedAdamW(ps, lr=1e-2, max_grad_norm=1.0, backend=b),
    lambda ps, b: ampfused.FusedAdam(ps, lr=1e-2, weight_decay=0.1, backend=b),
    lambda ps, b: ampfused.FusedSGD(ps, lr=0.1, momentum=0.9, backend=b),
], ids=["adamw", "adam", "sgd"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_skipped_step_changes_nothing(make, bad, backend):
    params = [torch.randn(6, 5, dtype=torch.bfloat16, requires_grad=True), torch.randn(3, requires_grad=True)]
    opt = make(params, backend)
    for p in params:
        set_grad(p, torch.randn_like(p))
    opt.step()  # so that states are non-trivial
    before = snapshot(opt, params)
    for p in params:
        set_grad(p, torch.randn_like(p))
    params[0].grad[2, 3] = bad
    opt.step()
    assert bool(opt.last_step_skipped) and opt.last_found_inf.item() == 1.0
    for i, (a, b) in enumerate(zip(before, snapshot(opt, params))):
        assert_bitwise(f"tensor {i}", a, b)
    for p in params:
        set_grad(p, torch.randn_like(p))
    opt.step()
    assert not bool(opt.last_step_skipped)
    assert [opt.state[p]["step"].item() for p in params] == [2, 2]


def test_parameters_and_gradients_stay_the_users_tensors():
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    params = [torch.randn(3, 3, dtype=torch.bfloat16, requires_grad=True),
              torch.randn(5, dtype=torch.bfloat16, requires_grad=True), conv.weight]
    before = [(p.data_ptr(), p.stride(), p.detach().clone()) for p in params]
    opt = ampfused.FusedAdamW(params)
    for p, (ptr, stride, value) in zip(params, before):
        assert p.data_ptr() == ptr and p.stride() == stride and torch.equal(p.detach(), value) and p.grad is None
    loss = sum((p.float() ** 2).sum() for p in params)
    loss.backward()
    grads = [p.grad for p in params]
    opt.step()
    for p, (ptr, stride, _), g in zip(params, before, grads):
        assert p.data_ptr() == ptr and p.stride() == stride and p.grad is g  # updated in place, grads untouched
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert opt.state[conv.weight]["exp_avg"].stride() == conv.weight.stride()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(params, grads))
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_model_zero_grad_set_to_none_matches_the_recipe_without_warnings():
    model = torch.nn.Linear(4, 3).bfloat16()
    opt = ampfused.FusedSGD(model.parameters(), lr=0.1)
    ref = torch.nn.Linear(4, 3).bfloat16()
    ref.load_state_dict(model.state_dict())
    master = [p.detach().float() for p in ref.parameters()]
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(x).float().sum().backward()
            opt.step()
            ref.zero_grad()
            ref(x).float().sum().backward()
            for m, p in zip(master, ref.parameters()):
                m.sub_(0.1 * p.grad.float())
                p.data.copy_(m)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_parameter_without_gradient_is_skipped_like_torch():
    params = [torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)]
    opt = ampfused.FusedAdamW(params, lr=1.0, weight_decay=0.5)
    set_grad(params[0], 1.0)
    before = params[1].detach().clone()
    opt.step()
    assert torch.equal(params[1].detach(), before) and params[1] not in opt.state  # no decay, no state
    assert opt.state[params[0]]["step"].item() == 1


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("sizes", [[1], [127], [65537], [1] * 64, [3, 70001, 5]], ids=["1", "127", "65537", "64x1", "mixed"])
def test_awkward_sizes_match_reference(sizes, backend):
    torch.manual_seed(3)
    p_ref = [torch.randn(n, dtype=torch.bfloat16, requires_grad=True) for n in sizes]
    p_new = [p.detach().clone().requires_grad_() for p in p_ref]
    o_ref = ampfused.FusedAdamW(p_ref, lr=1e-2, max_grad_norm=0.5, backend="reference")
    o_new = ampfused.FusedAdamW(p_new, lr=1e-2, max_grad_norm=0.5, backend=backend)
    for _ in range(2):
        for a, b in zip(p_ref, p_new):
            g = torch.randn_like(a)
            set_grad(a, g)
            set_grad(b, g)
        o_ref.step()
        o_new.step()
        torch.testing.assert_close(o_new.last_grad_norm, o_ref.last_grad_norm, rtol=1e-5, atol=0)
        for a, b in zip(p_ref, p_new):
            torch.testing.assert_close(o_new.state[b]["master_param"], o_ref.state[a]["master_param"], rtol=2e-6,
                                       atol=1e-7)


def test_lr_float_tensor_and_scheduler():
    params = [torch.randn(10, requires_grad=True)]
    opt = ampfused.FusedSGD(params, lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    w = params[0].detach().clone()
    for k in range(3):
        set_grad(params[0], 1.0)
        opt.step()
        sched.step()
        w -= 0.5 * 0.1 ** k
    torch.testing.assert_close(params[0].detach(), w)
    params2 = [torch.randn(10, requires_grad=True)]
    lr = torch.tensor(0.25)
    opt2 = ampfused.FusedSGD(params2, lr=lr)
    w2 = params2[0].detach().clone()
    set_grad(params2[0], 1.0)
    opt2.step()
    lr.fill_(0.125)
    opt2.step()
    torch.testing.assert_close(params2[0].detach(), w2 - 0.375)


def test_bf16_training_without_scaler_reports_norm_and_clips():
    params = [torch.randn(50, dtype=torch.bfloat16, requires_grad=True)]
    opt = ampfused.FusedSGD(params, lr=1.0, max_grad_norm=1.0)
    master = params[0].detach().float()
    g = torch.randn(50, dtype=torch.bfloat16) * 10
    set_grad(params[0], g)
    opt.step()
    norm = g.float().norm()
    torch.testing.assert_close(opt.last_grad_norm, norm)
    torch.testing.assert_close(opt.state[params[0]]["master_param"], master - g.float() * (1.0 / (norm + 1e-6)))


def test_long_loop_with_torch_scaler_unscale_and_torch_clip():
    """scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_; scaler.step(opt): grads seen unscaled, clip once."""
    torch.manual_seed(0)
    init = [torch.randn(8, 4), torch.randn(4)]
    fparams = [w.bfloat16().requires_grad_() for w in init]
    fopt = ampfused.FusedSGD(fparams, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))
    grads = [torch.randn_like(w) for w in init]
    for p, g in zip(fparams, grads):
        set_grad(p, (g * 256).bfloat16())
    scaler.unscale_(fopt)
    torch.testing.assert_close(fparams[0].grad.float(), (grads[0] * 256).bfloat16().float() / 256)
    norm = torch.nn.utils.clip_grad_norm_(fparams, 0.5)
    assert norm > 0.5  # so the clip bites
    scaler.step(fopt)
    scaler.update()
    clipped = torch.cat([p.grad.float().flatten() for p in fparams])  # the step never writes grads back
    torch.testing.assert_close(clipped.norm(), torch.tensor(0.5), rtol=1e-2, atol=0)  # torch clipped them
    torch.testing.assert_close(fopt.last_grad_norm, clipped.norm())  # the step measured what it used
    master0 = torch.cat([w.bfloat16().float().flatten() for w in init])
    got = torch.cat([fopt.state[p]["master_param"].flatten() for p in fparams])
    torch.testing.assert_close(got, master0 - 0.1 * clipped)  # unscaled once, clipped once


def test_step_under_torch_compile_fullgraph():
    params = [torch.randn(5, 4, dtype=torch.bfloat16, requires_grad=True), torch.randn(9, requires_grad=True)]
    eager_params = [p.detach().clone().requires_grad_() for p in params]
    opt = ampfused.FusedAdamW(params, lr=torch.tensor(1e-2), max_grad_norm=1.0)
    eager = ampfused.FusedAdamW(eager_params, lr=torch.tensor(1e-2), max_grad_norm=1.0)
    torch._dynamo.reset()  # (frames other tests compiled in this process count against the recompile limit)
    compiled = torch.compile(opt.step, fullgraph=True)
    with pytest.raises(Exception, match=r"run one eager step\(\) \(or call state_dict\(\)\) first"):
        compiled()
    torch._dynamo.reset()
    opt.state_dict(), eager.state_dict()  # the optimizers see their parameters (eagerly) before compiling
    compiled = torch.compile(opt.step, fullgraph=True)
    for k in range(3):
        for p, q in zip(params, eager_params):
            g = torch.randn_like(p)
            set_grad(p, g)
            set_grad(q, g)
        compiled()
        eager.step()
    for p, q in zip(params, eager_params):
        assert_bitwise("compiled vs eager", p.detach(), q.detach())
    assert all(opt.state[p]["step"].item() == 3 for p in params)


def test_custom_ops_pass_opcheck():
    from torch.library import opcheck
    n = 33
    p, g = torch.randn(n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    q = torch.randn(2, 3, dtype=torch.bfloat16)
    ps, gs = [p, q], [g, None]
    total = ops.state_layout([n, q.numel()])[1]
    master, m, v = torch.randn(total), torch.zeros(total), torch.zeros(total)
    inv, lr, st, steps = torch.tensor(0.5), torch.tensor(1e-3), torch.zeros(2), torch.zeros(2)
    for b in cpu_backends():
        part = ops.norm_check([g], inv, backend=b)
        opcheck(torch.ops.ampfused.norm_check.default, ([g, g[:7]], inv, b))
        opcheck(torch.ops.ampfused.unscale_.default, ([g.clone()], inv, b))
        opcheck(torch.ops.ampfused.adam_step_.default,
                (ps, gs, master, m, v, steps, part, inv, lr, st, 0.9, 0.999, 1e-8, 0.01, 1.0, True, False, b, None, None))
        opcheck(torch.ops.ampfused.sgd_step_.default,
                (ps, gs, master, m, steps, part, inv, lr, st, 0.9, 0.0, 0.0, True, math.inf, False, b, None, None))
        opcheck(torch.ops.ampfused.update_scale_.default,
                (torch.tensor(8.0), torch.zeros((), dtype=torch.int32), torch.tensor(0.0), 2.0, 0.5, 2, None, None, b))
        opcheck(torch.ops.ampfused.update_scale_.default,
                (torch.tensor(8.0), torch.zeros((), dtype=torch.int32), torch.tensor(1.0), 2.0, 0.5, 2,
                 torch.zeros(()), torch.zeros((), dtype=torch.int64), b))


@pytest.mark.parametrize("backend", cpu_backends())
def test_master_weights_true_on_fp32_params_keeps_a_separate_master(backend):
    params = [torch.randn(10, requires_grad=True)]
    opt = ampfused.FusedAdamW(params, master_weights=True, backend=backend)
    set_grad(params[0], 1.0)
    opt.step()
    master = opt.state[params[0]]["master_param"]
    assert master.data_ptr() != params[0].data_ptr()
    assert torch.equal(master, params[0].detach()) and opt.state[params[0]]["step"].item() == 1


def test_step_runs_torch_optims_hooks_and_profiler_range():
    """The step's own call (no profiler range while no profiler records one) keeps torch.optim's step hooks, in
    torch's order, a pre hook's new arguments, autograd off inside, and the range when a profiler is on."""
    p = torch.nn.Parameter(torch.randn(8))
    p.grad = torch.ones(8)
    opt = ampfused.FusedAdamW([p], lr=0.1, backend="reference")
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", torch.is_grad_enabled())))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", kwargs.get("grad_divisor"))))
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    glob = register_optimizer_step_pre_hook(
        lambda o, args, kwargs: (args, dict(kwargs, grad_divisor=2.0)))
    try:
        before = p.detach().clone()
        opt.step()
    finally:
        glob.remove()
    assert seen == [("pre", True), ("post", 2.0)] and torch.is_grad_enabled()
    ref = ampfused.FusedAdamW([torch.nn.Parameter(before)], lr=0.1, backend="reference")
    ref.param_groups[0]["params"][0].grad = torch.ones(8)
    ref.step(grad_divisor=2.0)
    assert torch.equal(p.detach(), ref.param_groups[0]["params"][0].detach())  # the hook's grad_divisor was used
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert any(e.name == "Optimizer.step#FusedAdamW.step" for e in prof.events())
