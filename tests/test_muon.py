"""FusedMuon and ``ampfused.ops.muon_step_`` against torch's recipe: ``torch.optim.Muon`` for the matrices and
``torch.optim.AdamW`` for the rest (the groups FusedMuon steps with ``use_muon=False``).

* Over several steps, within the oracle rule (tests/oracle.py): the oracle is the reference step in fp64 (the
  Newton-Schulz iteration in fp64, AdamW's groups by the reference AdamW), torch's fp32 recipe (its iteration in
  bf16, one matrix at a time) the plain implementation whose error sets the bound; with ``ampfused.GradScaler``
  and a clip by the norm over every group (torch: ``unscale_`` of both optimizers, ``clip_grad_norm_`` over all
  parameters); ``adjust_lr_fn`` both ways; Nesterov off.
* A skipped step changes nothing in any group; state precision: the remainders' run is the fp32-master run's bits,
  stochastic rounding and bf16 / 8-bit momentum within two bf16 ulps of its largest weight.
* torch.optim.Muon's arguments, defaults, messages and refusals; expert stacks behind ``expert_stacks=True``;
  state dicts both ways with torch.optim.Muon.
"""
import math

import pytest
import torch

import ampfused
from ampfused import ops
from ampfused.ops import reference, reference_muon
from backends import cpu_backends
from oracle import assert_bitwise, assert_close_to_oracle

MATRICES = [(16, 8), (8, 16), (16, 8), (5, 5), (3, 7)]  # tall, wide, square; two of one shape: one batched chain
VECTORS = [(16,), (8,)]
SHAPES = MATRICES + VECTORS
NM = len(MATRICES)
LR, AUX_LR = 0.02, 3e-3
STEPS = 5


def _init(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 0.5).to(dtype) for s in SHAPES]


def _grads(k, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(100 + k)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 0.1 * scale).to(dtype) for s in SHAPES]


def _groups(ps, **muon):
    return [dict(params=ps[:NM], **muon), dict(params=ps[NM:], use_muon=False, lr=AUX_LR)]


def _torch_run(steps, max_norm=None, scaled=False, **kw):
    """torch's recipe in fp32: Muon + AdamW (one scaler, one clip over every parameter)."""
    ps = [p.clone().requires_grad_() for p in _init()]
    muon = torch.optim.Muon(ps[:NM], lr=LR, **kw)
    adamw = torch.optim.AdamW(ps[NM:], lr=AUX_LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1) if scaled else None
    for k in range(steps):
        if scaler:
            scaler.scale(torch.zeros(()))  # (a loss would be scaled here: the scaler's scale exists from now)
        for p, g in zip(ps, _grads(k, scale=scaler.get_scale() if scaler else 1.0)):
            p.grad = g
        if scaler:
            scaler.unscale_(muon)
            scaler.unscale_(adamw)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ps, max_norm)
        if scaler:
            scaler.step(muon)
            scaler.step(adamw)
            scaler.update()
        else:
            muon.step()
            adamw.step()
    return [p.detach() for p in ps]


def _oracle(steps, max_norm=math.inf, nesterov=True, adjust_lr_fn=None):
    """The reference step in fp64 (the iteration too), the clip by the norm over every gradient."""
    ps = [p.double() for p in _init()]
    one, lr, aux_lr = torch.ones((), dtype=torch.float64), torch.tensor(LR), torch.tensor(AUX_LR)
    n_m = reference.state_layout([p.numel() for p in ps[:NM]])[1]
    n_v = reference.state_layout([p.numel() for p in ps[NM:]])[1]
    buf = torch.zeros(n_m, dtype=torch.float64)
    m, v = torch.zeros(n_v, dtype=torch.float64), torch.zeros(n_v, dtype=torch.float64)
    steps_m, steps_v, stats = torch.zeros(NM), torch.zeros(len(VECTORS)), torch.zeros(2, dtype=torch.float64)
    for k in range(steps):
        grads = _grads(k, torch.float64)
        partials = reference.norm_check(grads, one)
        reference_muon.muon_step_(ps[:NM], grads[:NM], None, buf, steps_m, partials, one, lr, stats, 0.95, nesterov,
                                  0.1, *reference_muon.NS_A_B_C, 1e-7, 5, adjust_lr_fn, max_norm)
        reference.adam_step_(ps[NM:], grads[NM:], None, m, v, steps_v, partials, one, aux_lr, stats, 0.9, 0.999,
                             1e-8, 1e-2, max_norm, True)
    return ps


def _fused_run(steps, max_norm=None, scaled=False, dtype=torch.float32, options=None, **muon):
    ps = [torch.nn.Parameter(p) for p in _init(dtype)]
    opt = ampfused.FusedMuon(_groups(ps, **muon), lr=LR, max_grad_norm=max_norm, **(options or {}))
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1) if scaled else None
    for k in range(steps):
        if scaler:
            scaler.scale(torch.zeros(()))
        for p, g in zip(ps, _grads(k, dtype, scale=scaler.get_scale() if scaler else 1.0)):
            p.grad = g
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return ps, opt


@pytest.mark.parametrize("case", ["plain", "clip+scaler", "no-nesterov", "match_rms_adamw"])
def test_the_recipe_within_the_oracle_rule(case):
    kw = {"no-nesterov": dict(nesterov=False), "match_rms_adamw": dict(adjust_lr_fn="match_rms_adamw")}.get(case, {})
    clip = dict(max_norm=0.05, scaled=True) if case == "clip+scaler" else {}
    plain = _torch_run(STEPS, **clip, **kw)
    oracle = _oracle(STEPS, clip.get("max_norm", math.inf), **kw)
    got, _ = _fused_run(STEPS, **clip, **kw)
    for i, (a, b, c) in enumerate(zip(got, plain, oracle)):
        assert_close_to_oracle(f"param[{i}] {SHAPES[i]}", a, b, c)


def test_a_skipped_step_changes_nothing_in_any_group():
    ps, opt = _fused_run(2, scaled=False)
    before = [p.detach().clone() for p in ps] + [t.clone() for s in opt._segs.segments
                                                 for t in (s.steps, *s.states.values())]
    for p, g in zip(ps, _grads(7)):
        p.grad = g
    ps[-1].grad[0] = float("inf")  # in an AdamW group: the whole step skips
    scaler = ampfused.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.zeros(()))
    scaler.step(opt)
    scaler.update()
    after = [p.detach() for p in ps] + [t for s in opt._segs.segments for t in (s.steps, *s.states.values())]
    for i, (a, b) in enumerate(zip(after, before)):
        assert_bitwise(f"[{i}]", a, b)
    assert scaler.get_scale() == 2.0


def test_state_precision_modes():
    bf16 = torch.bfloat16
    base, _ = _fused_run(3, dtype=bf16)
    rem, opt = _fused_run(3, dtype=bf16, options=dict(store_param_remainders=True))
    for i, (a, b) in enumerate(zip(rem, base)):
        assert_bitwise(f"param[{i}] with remainders", a, b)
    assert all(opt.state[p]["master_remainder"].dtype == torch.int16 for p in rem)
    # the approximate modes: within two bf16 ulps of the largest weight of the fp32-master run after three steps
    # (measured: one ulp in each mode)
    two_ulps = 2 * 2.0 ** (math.floor(math.log2(max(b.float().abs().max().item() for b in base))) - 7)
    for options in (dict(bf16_stochastic_round=True), dict(momentum_dtype=bf16), dict(momentum_dtype=torch.uint8)):
        got, opt = _fused_run(3, dtype=bf16, options=options)
        for i, (a, b) in enumerate(zip(got, base)):
            err = (a.float() - b.float()).abs().max().item()
            assert err <= two_ulps, (options, i, err, two_ulps)
        if "momentum_dtype" in options:
            assert opt.state[got[0]]["momentum_buffer"].dtype == options["momentum_dtype"]


class _Phased(ampfused.FusedMuon):
    """FusedMuon stepping its Muon groups in the two phases of FSDP2's path, the iteration between them here."""

    def _step_op(self, seg, params, grads, group, *args):
        if ampfused.optim.muon.uses_muon(group):
            return self._sharded_step(seg, params, grads, group, *args)
        return super()._step_op(seg, params, grads, group, *args)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "rem", "sr", "bf16m", "q8m"])
def test_the_two_phases_around_the_iteration_are_the_whole_step(mode, monkeypatch):
    """``muon_step_shard_``'s phase 1, the iteration over the scratch, phase 2: the whole step's bits, in every
    state mode, a clip and a skipped step included (what FSDP2's path runs on each rank's pieces)."""
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(mode, torch.bfloat16)
    options = {"rem": dict(store_param_remainders=True), "sr": dict(bf16_stochastic_round=True),
               "bf16m": dict(momentum_dtype=torch.bfloat16), "q8m": dict(momentum_dtype=torch.uint8)}.get(mode, {})
    runs = []
    for cls in (ampfused.FusedMuon, _Phased):
        monkeypatch.setattr(ampfused, "FusedMuon", cls)
        ps, opt = _fused_run(3, max_norm=0.05, scaled=True, dtype=dtype, options=options,
                             adjust_lr_fn="match_rms_adamw")
        for p, g in zip(ps, _grads(9, dtype)):
            p.grad = g
        ps[0].grad[0, 0] = float("nan")  # a skipped step
        opt.step()
        runs.append([p.detach().clone() for p in ps] + [t.clone() for s in opt._segs.segments
                                                          for t in (s.master, s.scales, s.steps, *s.states.values())
                                                          if t is not None])
        monkeypatch.undo()
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise(f"[{i}]", a, b)


PASS_BACKENDS = [b for b in cpu_backends() if b != "reference" and ops.registry.get_backend(b).has_step("muon_step_")]
MODES = {"fp32": (torch.float32, {}), "bf16": (torch.bfloat16, {}), "fp16": (torch.float16, {}),
         "rem": (torch.bfloat16, dict(store_param_remainders=True)),
         "sr": (torch.bfloat16, dict(bf16_stochastic_round=True)),
         "bf16m": (torch.bfloat16, dict(momentum_dtype=torch.bfloat16)),
         "q8m": (torch.bfloat16, dict(momentum_dtype=torch.uint8))}


def _exact_norm_grads(k, dtype, scale):
    """``_grads`` rounded to multiples of 2^-6 below 0.5 (times the loss scale, a power of two): their squares and
    every partial sum of them are exact in fp32, so every backend's K1, whatever its order of summation, gives the
    reference's norm and clip coefficient (the passes are what is compared)."""
    return [((g.double() / scale * 64).round().clamp(-31, 31) / 64 * scale).to(dtype)
            for g in _grads(k, torch.float64, scale)]


def _backend_run(backend, dtype, options, steps=3):
    ps = [torch.nn.Parameter(p) for p in _init(dtype)]
    opt = ampfused.FusedMuon(_groups(ps, adjust_lr_fn="match_rms_adamw"), lr=LR, max_grad_norm=0.05,
                             backend=backend, **options)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    for k in range(steps + 1):
        scaler.scale(torch.zeros(()))
        for p, g in zip(ps, _exact_norm_grads(k, dtype, scaler.get_scale())):
            p.grad = g
        if k == 1:
            ps[0].grad[0, 0] = float("nan")  # a skipped step
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in ps] + [t.clone() for s in opt._segs.segments
                                               for t in (s.master, s.scales, s.steps, *s.states.values())
                                               if t is not None]


@pytest.mark.parametrize("backend", PASS_BACKENDS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_passes_of_a_backend_are_the_reference_bits(backend, mode):
    """A backend's two elementwise passes (the iteration between them on torch's matmuls): the reference's
    bits in every state mode, with a clip, the scaler and a skipped step; AdamW's groups beside them."""
    dtype, options = MODES[mode]
    want = _backend_run("reference", dtype, options)
    for i, (a, b) in enumerate(zip(_backend_run(backend, dtype, options), want)):
        assert_bitwise(f"[{i}]", a, b)


@pytest.mark.parametrize("backend", PASS_BACKENDS)
def test_the_public_op_on_a_backend_runs_both_passes(backend):
    """``ampfused.ops.muon_step_`` on a backend with Muon's passes: the reference's bits, a parameter without a
    gradient left alone, a 3-D stack and a transposed matrix among them."""
    g = torch.Generator().manual_seed(5)
    shapes = [(6, 4), (2, 5, 3), (4, 6)]
    ws = [torch.randn(s, generator=g) for s in shapes]
    ws[2] = ws[2].t().contiguous().t()
    gs = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    gs[1], gs[2] = None, gs[2].t().contiguous().t()
    out = []
    for b in ("reference", backend):
        mine = [w.clone() for w in ws]
        buf = torch.randn(reference.state_layout([w.numel() for w in ws])[1], generator=torch.Generator().manual_seed(1))
        steps, stats = torch.zeros(3), torch.zeros(2)
        ops.muon_step_(mine, gs, None, buf, steps, reference.norm_check([x for x in gs if x is not None],
                                                                        torch.ones(())),
                       torch.ones(()), torch.tensor(LR), stats, weight_decay=0.1, backend=b)
        out.append(mine + [buf, steps, stats])
    for i, (a, b) in enumerate(zip(*out)):
        assert_bitwise(f"[{i}]", a, b)
    assert_bitwise("no gradient: left alone", out[1][1], ws[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_gpu_passes_are_the_reference_bits(backend, mode):
    """On CUDA: the cuda and Triton passes (the iteration between them on cuBLAS, shared with the reference)
    against the reference step on the same device, every state mode, with a clip and a skipped step, bit for
    bit."""
    if ops.registry.reasons_for(backend, torch.device("cuda")):
        pytest.skip(f"the {backend} backend cannot run on this machine")
    dtype, options = MODES[mode]
    runs = []
    for name in ("reference", backend):
        ps = [torch.nn.Parameter(p.cuda()) for p in _init(dtype)]
        opt = ampfused.FusedMuon(_groups(ps, adjust_lr_fn="match_rms_adamw"), lr=LR, max_grad_norm=0.05,
                                 backend=name, **options)
        for k in range(4):
            for p, g in zip(ps, _exact_norm_grads(k, dtype, 1.0)):
                p.grad = g.cuda()
            if k == 1:
                ps[0].grad[0, 0] = float("nan")
            opt.step()
        runs.append([p.detach().cpu() for p in ps] + [t.cpu() for s in opt._segs.segments
                                                       for t in (s.master, s.scales, s.steps, *s.states.values())
                                                       if t is not None])
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise(f"[{i}]", a, b)


def test_owners_balance_the_iteration_cost():
    from ampfused.optim._whole_shards import owners, rows_of
    assert owners([8, 1, 1, 1, 1, 4, 4], 2) == [0, 0, 1, 0, 1, 1, 1]  # the costliest first: loads 10 and 10
    assert owners([5, 5, 5], 3) == [0, 1, 2] and owners([], 4) == []
    assert [rows_of(5, 3, r) for r in range(3)] == [(0, 2), (2, 2), (4, 1)]  # torch.chunk's pieces
    assert [rows_of(2, 3, r) for r in range(3)] == [(0, 1), (1, 1), (2, 0)]


def test_expert_stacks_are_taken_when_asked_each_matrix_on_its_own():
    g = torch.Generator().manual_seed(3)
    stack = torch.randn(3, 8, 16, generator=g)
    grads = [torch.randn(3, 8, 16, generator=g) * 0.1 for _ in range(3)]
    with pytest.raises(ValueError, match="Muon only supports 2D parameters.*expert_stacks=True"):
        ampfused.FusedMuon([torch.nn.Parameter(stack.clone())])
    p = torch.nn.Parameter(stack.clone())
    opt = ampfused.FusedMuon([p], lr=LR, expert_stacks=True)
    experts = [s.clone().requires_grad_() for s in stack]
    plain = torch.optim.Muon(experts, lr=LR)
    oracle = [s.double() for s in stack]
    buf = torch.zeros(reference.state_layout([e.numel() for e in experts])[1], dtype=torch.float64)
    counts, stats, one = torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.ones((), dtype=torch.float64)
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
        for e, ge in zip(experts, grad):
            e.grad = ge.clone()
        plain.step()
        g64 = [ge.double() for ge in grad]
        reference_muon.muon_step_(oracle, g64, None, buf, counts, reference.norm_check(g64, one), one,
                                  torch.tensor(LR), stats, 0.95, True, 0.1, *reference_muon.NS_A_B_C, 1e-7, 5, None,
                                  math.inf)
    for i in range(3):
        assert_close_to_oracle(f"expert {i}", p.detach()[i], experts[i].detach(), oracle[i])


def test_torch_arguments_defaults_and_messages():
    import inspect
    ours = inspect.signature(ampfused.FusedMuon).parameters
    theirs = inspect.signature(torch.optim.Muon).parameters
    for name, par in theirs.items():
        assert name in ours and ours[name].default == par.default, name
    w = torch.nn.Parameter(torch.randn(4, 3))
    for kw, exc, msg in [
            (dict(lr=-1.0), ValueError, "Learning rate should be >= 0 but is: -1.0"),
            (dict(momentum=-0.1), ValueError, "momentum should be >= 0 but is: -0.1"),
            (dict(weight_decay=-1.0), ValueError, "weight decay should be >= 0 but is: -1.0"),
            (dict(adjust_lr_fn="cosine"), ValueError, "Adjust learning rate function cosine is not supported"),
            (dict(ns_steps=100), ValueError, "Number of steps must be less than 100"),
            (dict(ns_coefficients=(1.0, 2.0)), ValueError, "Coefficients must be a tuple of exactly 3 values")]:
        with pytest.raises(exc, match=msg):
            ampfused.FusedMuon([w], **kw)
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters whereas we found a parameter with size: "
                                         r"torch.Size\(\[4\]\)"):
        ampfused.FusedMuon([torch.nn.Parameter(torch.randn(4))])
    opt = ampfused.FusedMuon([w])
    with pytest.raises(ValueError, match="Muon only supports 2D"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(5))]))
    opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(5))], use_muon=False))
    aux = opt.param_groups[-1]
    assert (aux["lr"], aux["betas"], aux["eps"], aux["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert opt.param_groups[0]["eps"] == reference_muon.EPS and opt.param_groups[0]["weight_decay"] == 0.1
    w.grad = torch.randn(4, 3)
    opt.param_groups[0]["adjust_lr_fn"] = "cosine"  # changed between steps: refused before anything changes
    before = w.detach().clone()
    with pytest.raises(ValueError, match="Adjust learning rate function cosine"):
        opt.step()
    assert_bitwise("w", w.detach(), before)


def test_state_dicts_both_ways_with_torch_muon():
    ps = [torch.nn.Parameter(p) for p in _init()[:NM]]
    opt = ampfused.FusedMuon(ps, lr=LR)
    theirs_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    theirs = torch.optim.Muon(theirs_ps, lr=LR)
    for k in range(2):
        for p, q, g in zip(ps, theirs_ps, _grads(k)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        theirs.step()
    ours_sd, theirs_sd = opt.state_dict(), theirs.state_dict()
    assert set(ours_sd["state"][0]) == {"momentum_buffer", "step"} and set(theirs_sd["state"][0]) == {
        "momentum_buffer"}
    # ours into torch's, torch's into ours: the same momentum, and the next steps agree within the oracle rule
    fresh_torch = torch.optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=LR)
    fresh_torch.load_state_dict(ours_sd)
    fresh_ours_ps = [torch.nn.Parameter(q.detach().clone()) for q in theirs_ps]
    fresh_ours = ampfused.FusedMuon(fresh_ours_ps, lr=LR)
    fresh_ours.load_state_dict(theirs_sd)
    for i, (p, q) in enumerate(zip(ps, fresh_ours_ps)):
        assert_bitwise(f"momentum_buffer[{i}] into torch", fresh_torch.state[fresh_torch.param_groups[0]["params"][i]][
            "momentum_buffer"], opt.state[p]["momentum_buffer"])
        assert_bitwise(f"momentum_buffer[{i}] from torch", fresh_ours.state[q]["momentum_buffer"],
                       theirs.state[theirs_ps[i]]["momentum_buffer"])


def test_the_op_on_the_reference_against_torch_one_matrix():
    w = torch.randn(6, 4)
    g = torch.randn(6, 4) * 0.1
    mine = w.clone()
    buf, steps, stats = torch.zeros(reference.state_layout([24])[1]), torch.zeros(1), torch.zeros(2)
    ops.muon_step_([mine], [g], None, buf, steps, reference.norm_check([g], torch.ones(())), torch.ones(()),
                   torch.tensor(LR), stats, weight_decay=0.1)
    theirs = w.clone().requires_grad_()
    theirs.grad = g.clone()
    torch.optim.Muon([theirs], lr=LR).step()
    assert (mine - theirs.detach()).abs().max() < 1e-6
    with pytest.raises(ValueError, match="Muon only supports 2D"):
        ops.muon_step_([torch.zeros(24)], [torch.zeros(24)], None, buf, steps, reference.norm_check(
            [g], torch.ones(())), torch.ones(()), torch.tensor(LR), stats)
    with pytest.raises(ValueError, match="ns_coefficients"):
        ops.muon_step_([mine], [g], None, buf, steps, reference.norm_check([g], torch.ones(())), torch.ones(()),
                       torch.tensor(LR), stats, ns_coefficients=(1.0, 2.0))
    assert steps.item() == 1.0


@pytest.mark.skipif("cpu" not in cpu_backends(), reason="the cpu backend is not built")
def test_a_named_backend_without_muon_is_refused_before_any_group_steps(monkeypatch):
    cpu = type(ops.registry.get_backend("cpu"))  # (a build without Muon's passes)
    monkeypatch.setattr(cpu, "has_step", lambda self, op: op != "muon_step_")
    monkeypatch.setattr(ops, "_resolved", {})
    w, v = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))
    opt = ampfused.FusedMuon([dict(params=[v], use_muon=False), dict(params=[w])], backend="cpu")
    w.grad, v.grad = torch.randn(6, 4), torch.randn(4)
    before = [v.detach().clone(), w.detach().clone()]
    with pytest.raises(RuntimeError, match="'cpu' \\(forced\\) does not implement muon_step_"):
        opt.step()
    assert_bitwise("v", v.detach(), before[0])
    assert_bitwise("w", w.detach(), before[1])


@pytest.mark.parametrize("path", ["host pass", "Python path"])
def test_a_matrix_made_a_vector_in_place_is_refused_before_any_group_steps(path, monkeypatch):
    """``w.data = w.data.view(-1)`` keeps the address and the version counter the host pass compares: the step
    refuses it with torch's message before the AdamW group listed first has stepped, on either path."""
    from ampfused.optim import _segments
    if path == "Python path":
        monkeypatch.setattr(_segments, "_HOST", None)
    torch.manual_seed(0)
    v, w = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8, 4))
    opt = ampfused.FusedMuon([dict(params=[v], use_muon=False), dict(params=[w])], lr=0.1)
    for _ in range(2):
        v.grad, w.grad = torch.randn_like(v), torch.randn_like(w)
        opt.step()
    before = [v.detach().clone(), opt.state[v]["exp_avg"].clone(), opt.state[w]["momentum_buffer"].clone()]
    w.data = w.data.view(-1)
    v.grad, w.grad = torch.randn_like(v), torch.randn_like(w)
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters whereas we found a parameter with size: "
                                         r"torch.Size\(\[32\]\)"):
        opt.step()
    for name, a, b in zip(("v", "exp_avg", "momentum_buffer"), before,
                          (v.detach(), opt.state[v]["exp_avg"], opt.state[w]["momentum_buffer"])):
        assert_bitwise(name, b, a)


def test_a_compiled_step_is_the_eager_steps_bits():
    """``torch.compile`` of the step (its op through the custom op, the iteration traced): the eager step's bits."""
    ps = [[torch.nn.Parameter(p.clone()) for p in _init()] for _ in range(2)]
    opts = [ampfused.FusedMuon(_groups(q), lr=LR, max_grad_norm=0.5) for q in ps]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(opts[0].step)
        for k in range(2):
            for q in ps:
                for p, g in zip(q, _grads(k)):
                    p.grad = g.clone()
            compiled()
            opts[1].step()
    finally:
        torch._dynamo.reset()  # (what it compiled counts against the recompile limit of later tests' frames)
    for i, (a, b) in enumerate(zip(*ps)):
        assert_bitwise(f"param[{i}]", a.detach(), b.detach())


def test_the_format_comparison_measures_the_iteration_amplifying_8_bit_noise():
    """``python -m bench.q8_error --optimizer muon`` (docs/muon.md, Alignment): a momentum stored as it is changes
    nothing; stored in 8-bit codes, the update Muon makes from it moves by many times the momentum's own error
    (the iteration gives the small singular directions, where the codes' noise is, the weight of the large)."""
    from bench import q8_error as Q
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    m = (u * torch.logspace(0, -3, 64)) @ v.T * 1e-2
    assert Q.measure_muon([m], lambda x, signed: x) == (0.0, 0.0, 0.0)
    _, dm, do = Q.measure_muon([m], Q.q8_stochastic)
    assert 0 < dm < 0.1 and do > 5 * dm


def test_8_bit_momentum_warns_with_the_alignment_numbers():
    import warnings
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="8-bit codes trails torch's recipe by 2.5-2.7%"):
        ampfused.FusedMuon([w], momentum_dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampfused.FusedMuon([w], momentum_dtype=torch.bfloat16)
