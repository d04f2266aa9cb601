"""FusedSGD keeps a momentum buffer only once a step has momentum, as torch.optim.SGD does: no state bytes for a
group with ``momentum=0`` in any state-precision mode, the buffer allocated by the first step after a scheduler
or the loop switches momentum on, state dicts with torch's keys (no ``momentum_buffer`` where torch writes none),
and a checkpoint with momentum loaded into an optimizer that has none yet."""
import pytest
import torch

import ampfused
from ampfused.ops import state_precision as sp
from backends import cpu_backends, set_grad
from oracle import assert_bitwise, assert_close_to_oracle

BF16 = torch.bfloat16
SIZES = (7, 300, 517)
MASTER_KEYS = ("master_param", "master_remainder", "step")
# parameter dtype, options, bytes of momentum state per element once it exists
MODES = {
    "fp32-params": (torch.float32, {}, 4),
    "fp32-master": (BF16, {}, 4),
    "remainders": (BF16, dict(store_param_remainders=True), 4),
    "no-master": (BF16, dict(bf16_stochastic_round=True), 4),
    "bf16-momentum": (BF16, dict(momentum_dtype=BF16), 2),
    "q8-momentum": (BF16, dict(momentum_dtype=torch.uint8), 1),
    "no-master-q8-momentum": (BF16, dict(bf16_stochastic_round=True, momentum_dtype=torch.uint8), 1),
}


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def _feed(ps, opt, k):
    g = torch.Generator().manual_seed(100 + k)
    for p in ps:
        set_grad(p, torch.randn(p.shape, generator=g))
    opt.step()


def _momentum_bytes(opt, ps) -> int:
    """Bytes of optimizer state kept beside each parameter's master and step count, from ``optimizer.state``."""
    return sum(v.numel() * v.element_size() for p in ps for k, v in opt.state[p].items()
               if isinstance(v, torch.Tensor) and k not in MASTER_KEYS)


def _q8_scale_bytes(n: int) -> int:
    return sp.q8_blocks(n) * 4


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_momentum_state_until_a_step_has_momentum(mode, backend):
    dtype, options, per_element = MODES[mode]
    ps = _params(dtype)
    opt = ampfused.FusedSGD(ps, lr=0.05, momentum=0.0, backend=backend, **options)
    tps = [torch.nn.Parameter(p.detach().float()) for p in ps]
    topt = torch.optim.SGD(tps, lr=0.05, momentum=0.0)
    for k in range(2):
        _feed(ps, opt, k)
        _feed(tps, topt, k)
    assert _momentum_bytes(topt, tps) == 0 and _momentum_bytes(opt, ps) == 0
    assert all(not seg.states and (seg.scales is None or seg.scales.numel() == 0) for seg in opt._segs.segments)
    assert all("momentum_buffer" not in st for st in opt.state_dict()["state"].values())

    for g in (opt.param_groups[0], topt.param_groups[0]):  # as a scheduler would
        g["momentum"] = 0.9
    _feed(ps, opt, 2)
    _feed(tps, topt, 2)
    want = sum(p.numel() * per_element + (_q8_scale_bytes(p.numel()) if per_element == 1 else 0) for p in ps)
    assert _momentum_bytes(opt, ps) == want
    assert _momentum_bytes(topt, tps) == sum(p.numel() * 4 for p in tps)
    saved = opt.state_dict()["state"]
    key = "momentum_buffer_codes" if per_element == 1 else "momentum_buffer"
    assert all(key in saved[i] for i in range(len(ps)))
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in ps)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_switched_on_later_equals_a_buffer_of_zeros(mode):
    """The buffer allocated at the switch holds zeros, as one allocated at the start (and never read) held: the
    same steps, bit for bit, as an optimizer that stepped with momentum from a zeroed buffer from the start."""
    dtype, options, _ = MODES[mode]
    a, b = _params(dtype), _params(dtype)
    kw = dict(lr=0.05, dampening=0.1, weight_decay=0.01, backend="reference", **options)
    lazy = ampfused.FusedSGD(a, momentum=0.0, **kw)
    _feed(a, lazy, 0)
    eager = ampfused.FusedSGD(b, momentum=0.0, **kw)
    _feed(b, eager, 0)
    lazy.param_groups[0]["momentum"] = 0.9
    # the other one's buffer exists before the switch and holds zeros (loaded as a checkpoint would give it)
    sd = eager.state_dict()
    for i, p in enumerate(b):
        entry = sd["state"].setdefault(i, {})  # (fp32 parameters without momentum: no entry at all)
        entry["momentum_buffer"] = torch.zeros(p.shape)
        entry["step"] = torch.tensor(1.0)  # (the step count the switched optimizer has)
    sd["param_groups"][0]["momentum"] = 0.9
    eager.load_state_dict(sd)
    for k in range(1, 4):
        _feed(a, lazy, k)
        _feed(b, eager, k)
    for i, (p, q) in enumerate(zip(a, b)):
        assert_bitwise(f"param {i}", p, q)
        assert_bitwise(f"momentum {i}", lazy.state[p]["momentum_buffer"], eager.state[q]["momentum_buffer"])


def test_switched_on_later_against_torch():
    """fp32 parameters, momentum switched on at step 3 (dampening 0, so torch's buffer = g at its first momentum
    step equals ours = 0.9 * 0 + g): within the oracle rule of torch.optim.SGD and its fp64 twin."""
    ps = _params(torch.float32)
    opt = ampfused.FusedSGD(ps, lr=0.05, momentum=0.0, weight_decay=0.01)
    t32 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    t64 = [torch.nn.Parameter(p.detach().double()) for p in ps]
    o32 = torch.optim.SGD(t32, lr=0.05, momentum=0.0, weight_decay=0.01, foreach=False)
    o64 = torch.optim.SGD(t64, lr=0.05, momentum=0.0, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(4)
    for k in range(8):
        if k == 3:
            for o in (opt, o32, o64):
                o.param_groups[0]["momentum"] = 0.9
        grads = [torch.randn(n, generator=gen) for n in SIZES]
        for p, q, r, g in zip(ps, t32, t64, grads):
            set_grad(p, g), set_grad(q, g), set_grad(r, g.double())
        opt.step(), o32.step(), o64.step()
    for i, (p, q, r) in enumerate(zip(ps, t32, t64)):
        assert_close_to_oracle(f"param {i}", p.detach(), q.detach(), r.detach())


@pytest.mark.parametrize("mode", ["fp32-master", "q8-momentum"])
def test_checkpoint_with_momentum_loads_into_an_optimizer_without(mode):
    """A checkpoint saved with momentum loads into a FusedSGD built with ``momentum=0`` that has no buffer yet
    (its groups take the checkpoint's momentum): both continue bit for bit."""
    dtype, options, _ = MODES[mode]
    a, b = _params(dtype), _params(dtype)
    src = ampfused.FusedSGD(a, lr=0.05, momentum=0.9, backend="reference", **options)
    for k in range(2):
        _feed(a, src, k)
    dst = ampfused.FusedSGD(b, lr=0.05, momentum=0.0, backend="reference", **options)
    _feed(b, dst, 7)  # steps once without momentum: its segments have no buffer
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    dst.load_state_dict(src.state_dict())
    assert dst.param_groups[0]["momentum"] == 0.9
    for k in range(2, 4):
        _feed(a, src, k)
        _feed(b, dst, k)
    for i, (p, q) in enumerate(zip(a, b)):
        assert_bitwise(f"param {i}", p, q)
        assert_bitwise(f"momentum {i}", src.state[p]["momentum_buffer"], dst.state[q]["momentum_buffer"])


def test_torch_state_dict_without_momentum_matches_torch():
    """Without momentum torch.optim.SGD saves no per-parameter state; FusedSGD on fp32 parameters (no master)
    saves none either, and each loads the other's."""
    ps = _params(torch.float32)
    opt = ampfused.FusedSGD(ps, lr=0.05)
    tps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    topt = torch.optim.SGD(tps, lr=0.05)
    _feed(ps, opt, 0)
    _feed(tps, topt, 0)
    assert opt.state_dict()["state"] == topt.state_dict()["state"] == {}
    opt.load_state_dict(topt.state_dict())
    topt.load_state_dict(opt.state_dict())


def _compiled_run(fullgraph: bool, momenta, mode: str = "fp32-params", backend: str = "cpu",
                  eager_after_switch: bool = False):
    """FusedSGD stepped by ``torch.compile(opt.step)`` and an eager twin fed the same gradients, the group's momentum
    set to ``momenta[k]`` before step k; returns both optimizers, both parameter lists and the errors the compiled
    steps raised (by step)."""
    dtype, options, _ = MODES[mode]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in (10, 33)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ampfused.FusedSGD(params, lr=0.1, momentum=momenta[0], backend=backend, **options)
    ref = ampfused.FusedSGD(twins, lr=0.1, momentum=momenta[0], backend=backend, **options)
    opt.state_dict()  # the optimizer sees its parameters eagerly before compiling
    step = torch.compile(opt.step, fullgraph=fullgraph)
    errors = {}
    for k, m in enumerate(momenta):
        for p, q in zip(params, twins):
            grad = torch.randn(p.shape, generator=g)
            set_grad(p, grad)
            set_grad(q, grad)
        switched = m != opt.param_groups[0]["momentum"]
        for o in (opt, ref):
            o.param_groups[0]["momentum"] = m
        try:
            step()
        except Exception as e:  # the compiled step raised before writing anything
            errors[k] = str(e)
            if not eager_after_switch or not switched:
                raise
            opt.step()
        ref.step()
    torch._dynamo.reset()
    return opt, ref, params, twins, errors


def _assert_same_run(opt, ref, params, twins):
    for i, (p, q) in enumerate(zip(params, twins)):
        assert_bitwise(f"param {i}, compiled vs eager", p.detach(), q.detach())
        for key, value in ref.state[q].items():
            assert_bitwise(f"state '{key}' of param {i}, compiled vs eager", opt.state[p][key], value)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_momentum_changed_between_compiled_steps(fullgraph):
    """A schedule that changes momentum between compiled steps (as OneCycleLR's cycle_momentum does): the compiled
    steps equal the eager ones bit for bit (the checks of a changed value are traceable)."""
    opt, ref, params, twins, errors = _compiled_run(fullgraph, [0.5, 0.5, 0.8, 0.85, 0.9])
    assert not errors
    _assert_same_run(opt, ref, params, twins)


@pytest.mark.parametrize("mode", ["fp32-params", "fp32-master", "q8-momentum"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_momentum_switched_on_under_compile(fullgraph, mode):
    """Switched on between compiled steps, ``fullgraph=True`` included: the compiled step makes the buffer (zeros,
    every other state carried) as the eager step does, and the run equals the eager one bit for bit, buffers too."""
    _, _, per_element = MODES[mode]
    opt, ref, params, twins, errors = _compiled_run(fullgraph, [0.0, 0.0, 0.9, 0.9], mode)
    assert not errors
    assert _momentum_bytes(opt, params) >= sum(p.numel() * per_element for p in params)
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in params)
    _assert_same_run(opt, ref, params, twins)


def test_momentum_switched_on_in_a_compiled_training_step():
    """The step inside a compiled training function (forward, backward, step, zero_grad; backward breaks the
    graph there): momentum switched on between calls gives the eager run's bits. The loss is linear in the
    weights, so the compiled forward cannot round the gradients differently from the eager one."""
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(BF16)) for n in (10, 33)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ampfused.FusedSGD(params, lr=0.1, momentum=0.0, weight_decay=0.01)
    ref = ampfused.FusedSGD(twins, lr=0.1, momentum=0.0, weight_decay=0.01)
    opt.state_dict()

    def train_step(ps, o, xs):
        loss = sum((p.float() * x).sum() for p, x in zip(ps, xs))
        loss.backward()
        o.step()
        o.zero_grad()

    compiled = torch.compile(train_step)
    for m in (0.0, 0.0, 0.9, 0.9):
        for o in (opt, ref):
            o.param_groups[0]["momentum"] = m
        xs = [torch.randn(p.shape, generator=g) for p in params]
        compiled(params, opt, xs)
        train_step(twins, ref, xs)
    torch._dynamo.reset()
    _assert_same_run(opt, ref, params, twins)


def test_momentum_switched_on_where_dynamo_cannot_run_init_group(monkeypatch):
    """Where dynamo traces ``_init_group`` instead of running it (its arguments not mapped), nothing is made in the
    trace: with fullgraph the compiled step raises, naming the group and saying what to do, and writes nothing;
    after one eager step the compiled steps go on, and the run equals the eager one bit for bit."""
    from torch._dynamo.variables import optimizer as dynamo_optimizer

    def unmapped(self, *args, **kwargs):
        raise dynamo_optimizer.ArgMappingException()

    monkeypatch.setattr(dynamo_optimizer.OptimizerVariable, "get_python_args", unmapped)
    opt, ref, params, twins, errors = _compiled_run(True, [0.0, 0.0, 0.9, 0.9], eager_after_switch=True)
    assert list(errors) == [2], errors
    assert "param_groups[0]" in errors[2] and "run one eager step() after the change" in errors[2], errors[2]
    _assert_same_run(opt, ref, params, twins)
