"""The user's tensors win: a fused optimizer follows whatever happens to a parameter between two steps.

Values written outside the optimizer (``load_state_dict``, ``nn.init``, ``copy_``, ``mul_``, ``p.data = t``,
a Parameter swapped into the module) are what the next step updates: the master is rebuilt from them, as a
torch recipe built on the new values would hold it. Parameters left alone keep their masters bit for bit,
and so does a parameter written with the values it already had. Casts and memory-format changes after the
optimizer is built (what ``accelerate.prepare`` and the transformers ``Trainer`` do, on the CPU here; device
moves are in test_gpu_follow.py) train as the torch recipe for the new dtype does. Gradients are synthetic
(independent of the weights), so trajectories compare step by step within the oracle rule (tests/oracle.py).
"""
import copy

import pytest
import torch
from torch import nn

import ampfused
from backends import cpu_backends
from oracle import assert_bitwise, assert_close_to_oracle
from recipe import TorchRecipe, masters_of

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _grads(params, gen, scale=1.0):
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype) for p in params]


class Trio:
    """A fused optimizer on ``model`` and the fp32 recipe with its fp64 twin, fed the same gradients."""

    def __init__(self, model, backend, cls=ampfused.FusedAdamW, tcls=torch.optim.AdamW, hyper=HYPER, max_norm=None):
        self.model = model
        self.params = list(model.parameters())
        self.opt = cls(self.params, **hyper, max_grad_norm=max_norm, backend=backend)
        self.rec32 = TorchRecipe(self.params, tcls, hyper, max_norm=max_norm)
        self.rec64 = TorchRecipe(self.params, tcls, hyper, master_dtype=torch.float64, max_norm=max_norm)
        self.gen = torch.Generator().manual_seed(7)

    def step(self, grads=None):
        params = list(self.model.parameters())
        grads = grads if grads is not None else _grads(params, self.gen)
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        self.opt.step()
        self.rec32.step(grads)
        self.rec64.step(grads)

    def reset(self, i, value):
        """The recipe's answer to new values in parameter ``i``: its master is rebuilt from them."""
        self.rec32.reset_master(i, value)
        self.rec64.reset_master(i, value)

    def check(self, what):
        params = list(self.model.parameters())
        for i, (p, m) in enumerate(zip(params, masters_of(self.opt, params))):
            assert_close_to_oracle(f"{what}: master[{i}]", m, self.rec32.masters[i].detach(),
                                   self.rec64.masters[i].detach())
            assert_bitwise(f"{what}: param[{i}] == round(master)", p.detach(), m.to(p.dtype))


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("steps_before", [0, 2], ids=["fresh", "mid-training"])
def test_load_after_build_keeps_the_loaded_weights(backend, steps_before):
    """The reproduction: bf16 Linear(4, 4), FusedAdamW built, every weight loaded as 7.0, one step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).bfloat16()
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-3, backend=backend)
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    for _ in range(steps_before):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict({"weight": torch.full((4, 4), 7.0), "bias": torch.full((4,), 7.0)})
    model(x).float().sum().backward()
    opt.step()
    tmodel = nn.Linear(4, 4).bfloat16()
    tmodel.load_state_dict({"weight": torch.full((4, 4), 7.0), "bias": torch.full((4,), 7.0)})
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-3)
    tmodel(x).float().sum().backward()
    topt.step()
    for p, q in zip(model.parameters(), tmodel.parameters()):
        assert torch.equal(p, q), "the loaded weights must be what the step updates, as with torch.optim"
        master = opt.state[p]["master_param"]
        assert (master - 7.0).abs().max() <= 1.2e-3  # one Adam step of lr 1e-3 plus decay: near 7, not the init


WRITES = {
    "load_state_dict": lambda m: m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}),
    "nn.init": lambda m: nn.init.normal_(m[0].weight),
    "copy_": lambda m: m[0].weight.detach().copy_(torch.randn_like(m[0].weight)),
    "mul_": lambda m: m[0].weight.detach().mul_(3.0),
    "p.data = t": lambda m: setattr(m[0].weight, "data", torch.randn_like(m[0].weight)),
    "swap Parameter": lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn_like(m[0].weight))),
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        {k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True),
}


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("write", list(WRITES))
def test_every_write_outside_the_optimizer_is_followed(write, backend):
    trio = Trio(_model(), backend)
    control = Trio(_model(), backend)  # the same run without the write: untouched masters stay bitwise
    for _ in range(3):
        trio.step()
        control.step()
    before = [p.detach().clone() for p in trio.model.parameters()]
    with torch.no_grad():
        WRITES[write](trio.model)
    params = list(trio.model.parameters())
    changed = [i for i, (p, b) in enumerate(zip(params, before)) if not torch.equal(p.detach(), b)]
    assert changed
    for i in changed:
        trio.reset(i, params[i].detach())
    for k in range(3):
        grads = _grads(params, trio.gen)
        trio.step(grads)
        control.step(grads)
        trio.check(f"{write}, step {k}")
    assert all(a is b for a, b in zip(trio.opt.param_groups[0]["params"], trio.model.parameters()))
    cparams = list(control.model.parameters())
    for i in set(range(len(params))) - set(changed):
        assert_bitwise(f"untouched master[{i}]", masters_of(trio.opt, params)[i],
                       masters_of(control.opt, cparams)[i])


@pytest.mark.parametrize("write", ["copy the same values", "load the same state dict", "share_memory"])
def test_writing_the_same_values_keeps_the_masters_bitwise(write):
    trio = Trio(_model(), "cpu")
    for _ in range(3):
        trio.step()
    params = list(trio.model.parameters())
    masters = [m.clone() for m in masters_of(trio.opt, params)]
    assert any(not torch.equal(m, p.detach().float()) for m, p in zip(masters, params))  # masters hold more bits
    with torch.no_grad():
        if write == "copy the same values":
            for p in params:
                p.copy_(p.detach().clone())
        elif write == "load the same state dict":
            trio.model.load_state_dict(copy.deepcopy(trio.model.state_dict()))
        else:
            trio.model.share_memory()
    trio.opt.step()  # gradients unchanged since the last step: only the check runs first, then a step
    trio.rec32.step([p.grad for p in params])
    trio.rec64.step([p.grad for p in params])
    trio.check(write)


def _conv_model(dtype=torch.float32):
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).to(dtype)


CASTS = {
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "half()": (lambda m: m.half(), torch.float16),
    "to(channels_last)": (lambda m: m.to(torch.bfloat16).to(memory_format=torch.channels_last), torch.bfloat16),
}


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("cast", list(CASTS))
def test_cast_after_build_trains_as_the_recipe_for_the_new_dtype(cast, backend):
    model = _conv_model()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, max_grad_norm=1.0, backend=backend)
    fn, dtype = CASTS[cast]
    fn(model)
    params = list(model.parameters())
    assert all(p.dtype == dtype for p in params)
    rec32 = TorchRecipe(params, torch.optim.AdamW, HYPER, max_norm=1.0)
    rec64 = TorchRecipe(params, torch.optim.AdamW, HYPER, master_dtype=torch.float64, max_norm=1.0)
    gen = torch.Generator().manual_seed(3)
    for k in range(20):
        grads = _grads(params, gen)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        rec32.step(grads)
        rec64.step(grads)
        for i, (p, m) in enumerate(zip(params, masters_of(opt, params))):
            assert m.dtype == torch.float32  # fp32 masters for the new low-precision dtype
            assert_close_to_oracle(f"{cast} step {k} master[{i}]", m, rec32.masters[i].detach(),
                                   rec64.masters[i].detach())
            assert_bitwise(f"{cast} step {k} param[{i}]", p.detach(), m.to(dtype))
    if "channels_last" in cast:
        w = model[0].weight
        assert w.is_contiguous(memory_format=torch.channels_last)
        assert opt.state[w]["exp_avg"].stride() == w.stride() == opt.state[w]["master_param"].stride()


@pytest.mark.parametrize("backend", cpu_backends())
def test_cast_mid_training_carries_moments_and_steps(backend):
    """fp32 (no masters) -> bf16 (fp32 masters from the new values) -> fp32 again (masters dropped)."""
    model = _conv_model()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, backend=backend)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, g in zip(model.parameters(), _grads(list(model.parameters()), gen)):
            p.grad = g
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for dtype in (torch.bfloat16, torch.float32):
        model.to(dtype)
        params = list(model.parameters())
        for p, g in zip(params, _grads(params, gen)):
            p.grad = g
        opt.step()  # moments and steps followed, then one more update
        sd = opt.state_dict()
        for i, p in enumerate(params):
            assert sd["state"][i]["step"].item() == saved["state"][i]["step"].item() + 1
            assert ("master_param" in opt.state[p]) == (dtype == torch.bfloat16)
        saved = copy.deepcopy(sd)
    # and the moments are torch's: the same step by torch.optim.AdamW from the carried state
    rec = TorchRecipe(params, torch.optim.AdamW, HYPER)
    rec.opt.load_state_dict(saved)
    grads = _grads(params, gen)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    rec.step(grads)
    for i, p in enumerate(params):
        torch.testing.assert_close(p.detach(), rec.params[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg"], rec.opt.state[rec.masters[i]]["exp_avg"], rtol=1e-5,
                                   atol=1e-7)


def test_memory_format_change_mid_training_keeps_each_state_with_its_element():
    model = _conv_model(torch.bfloat16)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, backend="cpu")
    w = model[0].weight
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for p, g in zip(model.parameters(), _grads(list(model.parameters()), gen)):
            p.grad = g
        opt.step()
    logical = {k: v.clone() for k, v in opt.state[w].items()}
    model.to(memory_format=torch.channels_last)
    w.grad = None
    opt.step()  # w has no gradient now: it is skipped, but its state follows the new layout
    for k, v in logical.items():
        assert torch.equal(opt.state[w][k], v), k
    assert opt.state[w]["exp_avg"].stride() == w.stride() and w.is_contiguous(memory_format=torch.channels_last)


def test_state_assigned_by_a_framework_is_what_the_optimizer_uses():
    """Frameworks move optimizer state by assigning into ``optimizer.state[p]``: the values are adopted."""
    model = _model()
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    w = model[0].weight
    opt.state[w]["exp_avg"] = torch.full_like(w, 0.5, dtype=torch.float32)
    opt.state[w] = {k: v.clone() for k, v in opt.state[w].items()}
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], torch.full(w.shape, 0.5))
    assert opt.state[w]["exp_avg"].data_ptr() == opt._segs.segments[0].view(opt._segs.segments[0].states["exp_avg"], 0).data_ptr()


def test_a_parameter_that_changed_shape_is_refused_before_any_change():
    model = _model()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[model[2].bias].items()}
    w = model[0].weight
    w.data = torch.randn(7, 6, dtype=torch.bfloat16)
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] changed shape from \(5, 6\) to "
                                         r"\(7, 6\) since the optimizer last saw it"):
        opt.step()
    for k, v in before.items():
        assert torch.equal(opt.state[model[2].bias][k], v), k


class _Float32Only(ampfused.ops.registry.Backend):
    """The reference ops, for fp32 parameters only: a backend that can run a segment's new form but not its
    old one (as the cuda backend can run a model moved to the GPU but not its CPU segments)."""
    name = "fp32-only"
    devices = ("cpu",)
    dtypes = (torch.float32,)

    def __init__(self):
        from ampfused.ops import reference
        self.calls = []
        self.num_partials = reference.num_partials
        self.norm_check = reference.norm_check

        def adam_step_(params, *args, **kw):
            self.calls.append(tuple(p.dtype for p in params))
            return reference.adam_step_(params, *args, **kw)
        self.adam_step_ = adam_step_


BACKEND = _Float32Only()


@pytest.fixture
def fp32_only():
    ampfused.ops.register_backend("fp32-only", __name__)
    yield
    ampfused.ops.registry._MODULES.pop("fp32-only")
    ampfused.ops.registry._loaded.pop("fp32-only", None)
    ampfused.ops.registry._generation[0] += 1


def test_a_backend_forced_for_the_parameters_new_form_runs_the_step_that_follows_them(fp32_only):
    """The backend named after a cast (or a device move) is checked against the parameters as they are now, after
    the state follows them, never against the segments they left."""
    model = _model(torch.bfloat16)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, backend="cpu" if "cpu" in cpu_backends() else None)
    gen = torch.Generator().manual_seed(3)
    params = list(model.parameters())
    for p, g in zip(params, _grads(params, gen)):
        p.grad = g
    opt.step()
    model.float()
    opt.backend = "fp32-only"
    for p, g in zip(params, _grads(params, gen)):
        p.grad = g
    opt.step()
    assert BACKEND.calls == [(torch.float32,) * len(params)]
    assert [s.dtype for s in opt._segs.segments] == [torch.float32]
    assert all(opt.state[p]["step"].item() == 2 for p in params)
    # a backend that cannot run the parameters as they are is still refused, naming the rule
    model.to(torch.bfloat16)
    for p, g in zip(params, _grads(params, gen)):
        p.grad = g
    with pytest.raises(RuntimeError, match="fp32-only.*not supported"):
        opt.step()
