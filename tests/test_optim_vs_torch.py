"""The fused optimizers against the torch recipe they replace, over 120 steps with infs and NaNs injected.

Torch recipe: low-precision model, fp32 master copy, GradScaler.unscale_, clip_grad_norm_, torch.optim
optimizer on the masters, copy back. Its fp64 twin (same math on fp64 masters) is the oracle: the fused
masters must be within 2x the fp32 recipe's error against it (tests/oracle.py). Gradients are synthetic and
independent of the weights, so the trajectories can be compared step by step.
"""
import math

import pytest
import torch

import ampfused
from backends import cpu_backends, set_grad
from oracle import assert_bitwise, assert_close_to_oracle

SHAPES = [(7, 5), (13,), (3, 3, 3), (1,)]
STEPS = 120
INJECT = {10: (1, 3, math.inf), 37: (0, 0, math.nan), 38: (2, 5, -math.inf), 90: (3, 0, math.nan)}

KINDS = {
    "adamw": (ampfused.FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), 1.0),
    "adam": (ampfused.FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01), None),
    "sgd_nesterov": (ampfused.FusedSGD, torch.optim.SGD,
                     dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), 0.5),
    "sgd_dampening": (ampfused.FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.1), None),
    "sgd_plain": (ampfused.FusedSGD, torch.optim.SGD, dict(lr=0.1), 2.0),
}


class TorchRecipe:
    """Low-precision model + master copy in ``master_dtype`` + torch optimizer + scaler + clip."""

    def __init__(self, init, model_dtype, master_dtype, opt_cls, hyper, max_norm):
        self.model = [w.to(model_dtype, copy=True) for w in init]
        self.master = [m.to(master_dtype, copy=True).requires_grad_() for m in self.model]
        self.opt = opt_cls(self.master, **hyper, foreach=False)
        self.max_norm = max_norm
        self.model_dtype = model_dtype

    def clip(self):
        if self.max_norm is not None:
            return torch.nn.utils.clip_grad_norm_(self.master, self.max_norm, foreach=False)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in self.master]))

    def copy_back(self):
        for p, m in zip(self.model, self.master):
            p.copy_(m.detach())


def _make_grads(step, scale, model_dtype, gen):
    grads = [(torch.randn(s, generator=gen) * 1e-3 * scale).to(model_dtype) for s in SHAPES]
    if step in INJECT:
        t, i, v = INJECT[step]
        grads[t].view(-1)[i % grads[t].numel()] = v
    return grads


def run_trajectory(kind, model_dtype, backend, steps=STEPS, fscaler_cls=torch.amp.GradScaler, long_loop=False):
    """``long_loop``: scaler.unscale_(opt); ampfused.clip_grad_norm_(params); scaler.step(opt), with the clip
    folded into the fused step; else the short loop with ``max_grad_norm`` on the optimizer."""
    fcls, tcls, hyper, max_norm = KINDS[kind]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    use_scaler = model_dtype == torch.float16
    rec32 = TorchRecipe(init, model_dtype, torch.float32, tcls, hyper, max_norm)
    rec64 = TorchRecipe(init, model_dtype, torch.float64, tcls, hyper, max_norm)
    params = [w.to(model_dtype, copy=True).requires_grad_() for w in init]
    fopt = fcls(params, **hyper, max_grad_norm=None if long_loop else max_norm, backend=backend)
    kw = dict(init_scale=2.0 ** 14, growth_interval=10)
    tscaler = torch.amp.GradScaler("cpu", enabled=use_scaler, **kw)
    fscaler = fscaler_cls("cpu", enabled=use_scaler, **kw)
    history = []
    for step in range(steps):
        if use_scaler:
            tscaler.scale(torch.ones(())), fscaler.scale(torch.ones(()))  # creates the scale lazily
        scale = tscaler.get_scale() if use_scaler else 1.0
        assert scale == (fscaler.get_scale() if use_scaler else 1.0), f"step {step}: scales diverged"
        grads = _make_grads(step, scale, model_dtype, gen)
        # fp32 torch recipe, with torch's scaler deciding the step
        # the long loop unscales the low-precision gradients in place, so what the step sees is rounded to
        # their dtype; the recipes get exactly those values (scale is a power of two: re-scaling is exact)
        seen = [(g.float() / scale).to(model_dtype) for g in grads] if long_loop else None
        for m, g, u in zip(rec32.master, grads, seen or grads):
            m.grad = u.float() * scale if long_loop else g.float()
        if use_scaler:
            tscaler.unscale_(rec32.opt)
            found = sum(v.item() for v in tscaler._found_inf_per_device(rec32.opt).values()) > 0
        else:
            found = not all(bool(torch.isfinite(g).all()) for g in grads)
        norm32 = rec32.clip()
        if use_scaler:
            tscaler.step(rec32.opt)
            tscaler.update()
        elif not found:
            rec32.opt.step()
        rec32.copy_back()
        # fp64 twin: the same decisions, fp64 math
        for m, g, u in zip(rec64.master, grads, seen or grads):
            m.grad = u.double() if long_loop else g.double() / scale
        norm64 = rec64.clip()
        if not found:
            rec64.opt.step()
        rec64.copy_back()
        # fused
        for p, g in zip(params, grads):
            set_grad(p, g)
        if use_scaler:
            if long_loop:
                fscaler.unscale_(fopt)
                if max_norm is not None:
                    ampfused.clip_grad_norm_(params, max_norm)
            fscaler.step(fopt)
            fscaler.update()
        else:
            fopt.step()
        skipped = bool(fopt.last_step_skipped)
        assert skipped == found, f"step {step}: fused skipped={skipped}, torch found_inf={found}"
        if not found:
            assert_close_to_oracle(f"step {step} grad norm", fopt.last_grad_norm, norm32, norm64)
        for i, p in enumerate(params):
            master = fopt.state[p].get("master_param", p.detach())
            assert_close_to_oracle(f"step {step} master[{i}]", master, rec32.master[i].detach(),
                                   rec64.master[i].detach())
            assert_bitwise(f"step {step} model[{i}] == round(master)", p.detach(), master.to(model_dtype))
        history.append((skipped, [p.detach().clone() for p in params]))
    return history


def _cells(kinds, triton_kinds):
    """(kind, backend) pairs: every kind on the reference and native backends; on Triton, which runs here under
    its interpreter (a hundred times slower), only ``triton_kinds``: the others differ from them by flags its
    kernels are held to the reference under (tests/test_triton_step.py)."""
    return [(k, b) for b in cpu_backends() for k in kinds if b != "triton" or k in triton_kinds]


def _steps(backend: str) -> int:
    """A trajectory's length: Triton's (interpreted here) ends after the first three injected non-finite steps."""
    return 45 if backend == "triton" else STEPS


def _injected(hist) -> int:
    return sum(1 for step in INJECT if step < len(hist))


@pytest.mark.parametrize("kind,backend", _cells(KINDS, ("adamw", "sgd_nesterov")))
def test_bf16_trajectory_matches_torch_recipe(kind, backend):
    hist = run_trajectory(kind, torch.bfloat16, backend, steps=_steps(backend))
    assert sum(s for s, _ in hist) == _injected(hist)


@pytest.mark.parametrize("kind,backend", _cells(["adamw", "sgd_nesterov"], ("adamw",)))
def test_fp16_with_grad_scaler_matches_torch_recipe(kind, backend):
    hist = run_trajectory(kind, torch.float16, backend, steps=_steps(backend))
    assert sum(s for s, _ in hist) >= _injected(hist)  # injected plus natural fp16 overflows as the scale grows


@pytest.mark.parametrize("backend", cpu_backends())
def test_fp32_params_without_master(backend):
    run_trajectory("adamw", torch.float32, backend, steps=40)


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])  # (interpreted: numpy here)
def test_bitwise_identical_when_run_twice(backend):
    a = run_trajectory("adamw", torch.bfloat16, backend, steps=30)
    b = run_trajectory("adamw", torch.bfloat16, backend, steps=30)
    for (sa, pa), (sb, pb) in zip(a, b):
        assert sa == sb
        for x, y in zip(pa, pb):
            assert_bitwise("rerun", x, y)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("long_loop", [False, True], ids=["short", "long"])
def test_fp16_with_ampfused_scaler_short_and_long_loop(long_loop, backend):
    hist = run_trajectory("adamw", torch.float16, backend, steps=60, fscaler_cls=ampfused.GradScaler,
                          long_loop=long_loop)
    assert sum(s for s, _ in hist) >= 2
