"""8-bit moments as an option of the fused optimizers (docs/state-precision.md): ``exp_avg_dtype`` /
``exp_avg_sq_dtype`` / ``momentum_dtype`` = ``torch.uint8``, with every weight format, on the reference and CPU
backends. The optimizer's step is the functional step op's bit for bit; a small model trains through skipped
steps, clipping and a scheduler; checkpoints resume bit for bit and convert from and to torch's fp32 state; the
smallest mode keeps at most 2.1 bytes of state per parameter; bad options and bad loaded scales are refused
before anything changes.
"""
import io
import math

import pytest
import torch

import ampfused
from ampfused import ops
from ampfused.ops import memory_view, state_layout
from ampfused.ops import state_precision as sp
from ampfused.optim import torch_state_dict
from ampfused.optim._precision import bytes_per_param
from backends import cpu_backends
from oracle import assert_bitwise

BF16, U8 = torch.bfloat16, torch.uint8
BACKENDS = [b for b in ("reference", "cpu") if b in cpu_backends()]
SHAPES = [(7,), (300,), (40, 53), (2, 3, 11, 13)]  # the last one channels_last, the third transposed
WEIGHTS = {"fp32-master": {}, "remainders": dict(store_param_remainders=True),
           "no-master": dict(bf16_stochastic_round=True)}
Q8_ADAM = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(BF16) for s in SHAPES]
    ps[2] = ps[2].t().contiguous().t()
    ps[3] = ps[3].contiguous(memory_format=torch.channels_last)
    return [torch.nn.Parameter(p) for p in ps]


def _grads(k, bad=False):
    g = torch.Generator().manual_seed(100 + k)
    out = [torch.randn(s, generator=g).to(BF16) for s in SHAPES]
    if bad:
        out[1][5] = float("inf")
    return out


def _feed(runs, k, bad=False):
    grads = _grads(k, bad)
    for ps, opt in runs:
        for p, g in zip(ps, grads):
            p.grad = torch.empty_like(p).copy_(g)
        opt.step()


def _make(kind, backend, weights, seed=0, **extra):
    ps = _params(seed)
    if kind == "sgd":
        opt = ampfused.FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, backend=backend, seed=7,
                                momentum_dtype=U8, **WEIGHTS[weights], **extra)
    else:
        opt = ampfused.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, backend=backend, seed=7, **Q8_ADAM,
                                  **WEIGHTS[weights], **extra)
    return ps, opt


def _everything(ps, opt):
    out = [p.detach().clone() for p in ps]
    for seg in opt._segs.segments:
        out += [seg.steps.clone(), seg.scales.clone()] + [t.clone() for t in seg.states.values()]
        out += [seg.master.clone()] if seg.master is not None else []
    return out


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_optimizer_step_is_the_functional_step(backend, kind, weights):
    ps, opt = _make(kind, backend, weights)
    # the functional op's own buffers, built as the docs describe them
    qs = [p.detach().clone() for p in ps]
    offsets, total = state_layout([p.numel() for p in qs], sp.QBLOCK)
    n_states = 1 if kind == "sgd" else 2
    states = [torch.zeros(total, dtype=U8) for _ in range(n_states)]
    scales = torch.zeros(n_states, sp.q8_blocks(total))
    master = None
    if weights == "fp32-master":
        master = torch.zeros(total)
        for p, o in zip(qs, offsets):
            master[o:o + p.numel()] = memory_view(p).float()
    elif weights == "remainders":
        master = torch.zeros(total, dtype=torch.int16)
    steps, stats, one = torch.zeros(len(qs)), torch.zeros(2), torch.ones(())
    for k in range(3):
        grads = [torch.empty_like(q).copy_(g) for q, g in zip(qs, _grads(k))]
        _feed([(ps, opt)], k)
        seg = opt._segs.segments[0]
        assert seg.states[next(iter(seg.states))].dtype == U8 and seg.offsets == [0, 256, 768, 3072]
        partials = ops.norm_check(grads, one, backend=backend)
        if kind == "sgd":
            ops.sgd_step_(qs, grads, master, states[0], steps, partials, one, torch.tensor(1e-2), stats,
                          momentum=0.9, weight_decay=0.01, seed=seg.seed, state_scales=scales, backend=backend)
        else:
            ops.adamw_step_(qs, grads, master, states[0], states[1], steps, partials, one, torch.tensor(1e-2), stats,
                            weight_decay=0.1, seed=seg.seed, state_scales=scales, backend=backend)
        for i, (p, q) in enumerate(zip(ps, qs)):
            assert_bitwise(f"params[{i}] after step {k + 1}", p.detach(), q)
        for name, mine, theirs in zip(seg.states, seg.states.values(), states):
            assert_bitwise(f"{name} after step {k + 1}", mine, theirs)
        assert_bitwise(f"scales after step {k + 1}", seg.scales, scales)
        if master is not None:
            assert_bitwise(f"master after step {k + 1}", seg.master, master)
    assert seg.scales.ne(0).all() and seg.states[next(iter(seg.states))].ne(0).any()


@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_cpu_sgd_is_the_reference_bit_for_bit(weights):
    if "cpu" not in BACKENDS:
        pytest.skip("the cpu backend is not built")
    runs = [_make("sgd", b, weights) for b in ("reference", "cpu")]
    for k in range(3):
        _feed(runs, k)
    for a, b in zip(_everything(*runs[0]), _everything(*runs[1])):
        assert_bitwise(weights, a, b)


class TinyLM(torch.nn.Module):
    """A small language model: tied input embedding and output projection, a frozen layer, bf16."""

    def __init__(self, vocab=48, width=32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.frozen = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        self.frozen.requires_grad_(False)
        self.to(BF16)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.frozen(h)
        h = h + self.mlp(self.norm(h))
        return self.head(h)


def _train(backend, steps=8, **options):
    """Train TinyLM (next-token on a fixed sequence); step 3 overflows (skipped, as a scaler would skip it)."""
    model = TinyLM()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = ampfused.FusedAdamW(params, lr=3e-2, weight_decay=0.01, max_grad_norm=1.0, backend=backend, seed=3,
                              **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 48, (4, 17), generator=g)
    losses = []
    frozen = model.frozen.weight.detach().clone()
    for k in range(steps):
        loss = torch.nn.functional.cross_entropy(model(data[:, :-1]).float().flatten(0, 1), data[:, 1:].flatten())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if k == 3:
            model.mlp[0].weight.grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in params] + [t.clone() for t in _state_tensors(opt)]
        opt.step()
        if k == 3:  # the overflowing step changes nothing: weights, codes, scales, masters, step counts
            for i, (a, b) in enumerate(zip([p.detach() for p in params] + _state_tensors(opt), before)):
                assert_bitwise(f"tensor {i} after the skipped step", a, b)
            assert opt.last_found_inf.item() == 1
        sched.step()
    assert_bitwise("frozen layer", model.frozen.weight.detach(), frozen)
    assert model.frozen.weight not in opt.state
    return losses, opt, model


def _state_tensors(opt):
    return [t for seg in opt._segs.segments for t in [seg.steps, *seg.states.values()]
            + ([seg.scales] if seg.scales is not None else []) + ([seg.master] if seg.master is not None else [])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_small_model_trains_with_8bit_moments_in_every_weight_format(backend):
    base, _, _ = _train(backend)
    for weights, options in WEIGHTS.items():
        losses, opt, model = _train(backend, **options, **Q8_ADAM)
        st = opt.state[model.embed.weight]
        assert st["exp_avg"].dtype == U8 and st["exp_avg_scale"].shape == (sp.q8_blocks(48 * 32),)
        # it learns as the fp32-moment run does: the loss falls, and stays near that run's
        assert losses[-1] < 0.8 * losses[0], (weights, losses)
        assert all(abs(a - b) <= 0.05 * b for a, b in zip(losses, base)), (weights, losses, base)


RESUME = {"remainders": ("adamw", "remainders"), "no-master": ("adamw", "no-master"),
          "sgd-fp32-master": ("sgd", "fp32-master")}


@pytest.mark.parametrize("mode", list(RESUME))
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_from_a_checkpoint_is_bitwise_the_uninterrupted_run(backend, mode):
    kind, weights = RESUME[mode]
    whole, first = _make(kind, backend, weights), _make(kind, backend, weights)
    for k in range(2):
        _feed([whole, first], k)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in first[0]], "opt": first[1].state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    entry = saved["opt"]["state"][3]
    names = ("momentum_buffer",) if kind == "sgd" else ("exp_avg", "exp_avg_sq")
    for name in names:  # codes shaped (and strided) like the parameter, scales of its own blocks
        codes = entry[f"{name}_codes"]
        assert name not in entry and codes.dtype == U8 and codes.shape == first[0][3].shape
        assert codes.stride() == first[0][3].stride()
        assert entry[f"{name}_scale"].dtype == torch.float32 and entry[f"{name}_scale"].shape == (4,)
    resumed = _make(kind, backend, weights, seed=9)  # other initial weights: the checkpoint's are loaded
    with torch.no_grad():
        for p, w in zip(resumed[0], saved["model"]):
            p.copy_(w)
    resumed[1].load_state_dict(saved["opt"])
    for k in range(2, 4):
        _feed([whole, resumed], k)
    _feed([whole, resumed], 4, bad=True)  # a skipped step after the resume too
    _feed([whole, resumed], 5)
    for a, b in zip(_everything(*resumed), _everything(*whole)):
        assert_bitwise(mode, a, b)


def _torch_run(steps=2):
    ps = [torch.nn.Parameter(p.detach().float()) for p in _params()]
    t = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    for k in range(steps):
        for p, g in zip(ps, _grads(k)):
            p.grad = torch.empty_like(p).copy_(g)
        t.step()
    return ps, t


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_fp32_state_converts_to_8bit_and_back(backend):
    tps, t = _torch_run()
    sd = t.state_dict()
    ps, opt = _make("adamw", backend, "fp32-master")
    with torch.no_grad():
        for p, q in zip(ps, tps):
            p.copy_(q)
    opt.load_state_dict(sd)
    for i, p in enumerate(ps):
        for name in ("exp_avg", "exp_avg_sq"):
            # round to nearest, in the parameter's memory order, blocks from its first element
            x = sd["state"][i][name]
            codes, scales = sp.q8_quantize(_in_order(x, p), sp.q8_signed(name))
            assert_bitwise(f"{name}[{i}] codes", memory_view(opt.state[p][name]), codes)
            assert_bitwise(f"{name}[{i}] scales", opt.state[p][f"{name}_scale"], scales)
    _feed([(ps, opt)], 2)  # it steps on from there
    # exported back to torch.optim.AdamW: the codes decoded exactly, within the format's rounding of torch's values
    t2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().float()) for p in ps], lr=1e-2, weight_decay=0.1)
    out = opt.state_dict()
    t2.load_state_dict(torch_state_dict(out))
    for i, (p, q) in enumerate(zip(ps, t2.param_groups[0]["params"])):
        for name in ("exp_avg", "exp_avg_sq"):
            got = t2.state[q][name]
            assert got.dtype == torch.float32 and f"{name}_scale" not in t2.state[q]
            expect = sp.q8_dequantize(memory_view(opt.state[p][name]), opt.state[p][f"{name}_scale"],
                                      sp.q8_signed(name))
            assert_bitwise(f"{name}[{i}] exported", _in_order(got, p), expect)
    # the converted state is within half a code step of torch's fp32 values (relative to its block's largest)
    tps, t = _torch_run(3)
    for i, (p, q) in enumerate(zip(ps, tps)):
        for name in ("exp_avg", "exp_avg_sq"):
            x = _in_order(t.state[q][name], p)
            back = sp.q8_dequantize(*sp.q8_quantize(x, sp.q8_signed(name)), sp.q8_signed(name))
            _within_rounding(f"{name}[{i}]", back, x, sp.q8_signed(name))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_8bit_codes_are_never_taken_for_moment_values(kind):
    """The state dict holds the codes as ``<name>_codes``: torch.optim, which casts whatever ``<name>`` it finds to
    the parameter's dtype, never steps on codes 0-255 as moments: AdamW fails at its first step, SGD starts a
    fresh momentum buffer (as it does for a parameter without one). A state dict holding the codes under
    ``<name>`` itself (as this optimizer's ``state[p]`` does) still loads bit for bit."""
    ps, opt = _make(kind, "reference", "no-master")
    for k in range(2):
        _feed([(ps, opt)], k)
    sd = opt.state_dict()
    names = ("momentum_buffer",) if kind == "sgd" else ("exp_avg", "exp_avg_sq")
    for e in sd["state"].values():
        assert all(n not in e and e[f"{n}_codes"].dtype == U8 for n in names)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    t = torch.optim.SGD(qs, lr=1e-2, momentum=0.9) if kind == "sgd" else torch.optim.AdamW(qs, lr=1e-2)
    t.load_state_dict(sd)
    for q in qs:
        q.grad = torch.ones_like(q)
    before = [q.detach().clone() for q in qs]
    if kind == "sgd":
        t.step()
        wd = t.param_groups[0]["weight_decay"]  # (the loaded group's)
        for q, b in zip(qs, before):  # the first step's buffer: the gradient with its weight decay
            assert torch.equal(t.state[q]["momentum_buffer"], q.grad.add(b, alpha=wd))
    else:
        with pytest.raises(KeyError, match=names[0]):
            t.step()
        assert all(torch.equal(q, b) for q, b in zip(qs, before))
    # codes under the moment's own name: the same state
    plain = {"param_groups": sd["param_groups"],
             "state": {k: {(key[:-len("_codes")] if key.endswith("_codes") else key): v for key, v in e.items()}
                       for k, e in sd["state"].items()}}
    ps2, opt2 = _make(kind, "reference", "no-master")
    for a, b in zip(ps2, ps):
        a.data.copy_(b.detach())
    opt2.load_state_dict(plain)
    for i, (a, b) in enumerate(zip(_everything(ps2, opt2), _everything(ps, opt))):
        assert_bitwise(f"{kind}: tensor {i}", a, b)


def _in_order(x, p):
    """``x``'s values in parameter ``p``'s memory order (1-D fp32)."""
    return memory_view(torch.empty_like(p, dtype=torch.float32).copy_(x))


def _within_rounding(name, got, x, signed):
    n = x.numel()
    pad = torch.zeros(sp.q8_blocks(n) * sp.QBLOCK)
    pad[:n] = x.abs()
    top = pad.view(-1, sp.QBLOCK).amax(dim=1).repeat_interleave(sp.QBLOCK)[:n]
    floor = top * (2.0 ** -17 if signed else 2.0 ** -33)  # half the subnormal spacing of the block
    assert ((got - x).abs() <= torch.maximum(x.abs() * 2 ** -4, floor) * 1.0001).all(), name


def test_bf16_and_8bit_checkpoints_convert_between_modes():
    ps, bf = _make("adamw", "reference", "remainders")
    _feed([(ps, bf)], 0)
    # a bf16-moment checkpoint into the 8-bit mode: values rounded to nearest codes
    ps16 = _params()
    opt16 = ampfused.FusedAdamW(ps16, lr=1e-2, weight_decay=0.1, backend="reference", seed=7,
                                store_param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    _feed([(ps16, opt16)], 0)
    ps8, opt8 = _make("adamw", "reference", "remainders")
    opt8.load_state_dict(opt16.state_dict())
    for p, q in zip(ps8, ps16):
        x = memory_view(opt16.state[q]["exp_avg_sq"]).float()
        codes, scales = sp.q8_quantize(x, False)
        assert_bitwise("exp_avg_sq codes", memory_view(opt8.state[p]["exp_avg_sq"]), codes)
        assert_bitwise("exp_avg_sq scales", opt8.state[p]["exp_avg_sq_scale"], scales)
        assert_bitwise("remainders", opt8.state[p]["master_remainder"], opt16.state[q]["master_remainder"])
    # an 8-bit checkpoint into the fp32-moment mode: the codes decoded exactly
    ps32 = _params()
    opt32 = ampfused.FusedAdamW(ps32, lr=1e-2, weight_decay=0.1, backend="reference", store_param_remainders=True)
    opt32.load_state_dict(bf.state_dict())
    for p, q in zip(ps32, ps):
        expect = sp.q8_dequantize(memory_view(bf.state[q]["exp_avg"]), bf.state[q]["exp_avg_scale"], True)
        assert_bitwise("decoded exp_avg", memory_view(opt32.state[p]["exp_avg"]), expect)


def test_bad_loaded_scales_are_refused_before_anything_changes():
    ps, opt = _make("adamw", "reference", "no-master")
    _feed([(ps, opt)], 0)
    good = opt.state_dict()
    before = _everything(ps, opt)

    def bad(key, value, pid=1):
        sd = {"state": {k: dict(v) for k, v in good["state"].items()}, "param_groups": good["param_groups"]}
        if value is None:
            del sd["state"][pid][key]
        else:
            sd["state"][pid][key] = value
        return sd

    cases = [
        (bad("exp_avg_scale", torch.tensor([0.5, 0.3])), r"'exp_avg_scale' of parameter 1 must hold zeros or powers "
                                                         r"of two 2\*\*k with k in \[-87, 126\]"),
        (bad("exp_avg_sq_scale", torch.tensor([-0.5, 1.0])), "'exp_avg_sq_scale' of parameter 1 must hold zeros"),
        (bad("exp_avg_scale", torch.tensor([2.0 ** -100, 1.0])), "must hold zeros or powers of two"),
        (bad("exp_avg_scale", torch.ones(3)), r"'exp_avg_scale' of parameter 1 must be a float32 tensor of shape "
                                              r"\(2,\)"),
        (bad("exp_avg_scale", torch.ones(2, dtype=torch.float64)), "must be a float32 tensor"),
        (bad("exp_avg_sq_scale", None), "'exp_avg_sq' of parameter 1 holds 8-bit codes .* needs their block scales "
                                        "'exp_avg_sq_scale'"),
        (bad("exp_avg_codes", torch.zeros(300, dtype=torch.int8)),
         r"'exp_avg_codes' of parameter 1 must be the uint8 codes of 8-bit moments, got torch.int8"),
        (bad("exp_avg_codes", torch.zeros(40, 106, dtype=U8)[:, ::2], pid=2), "must keep the parameter's strides"),
        (bad("exp_avg", torch.zeros(300)), r"parameter 1 has both 'exp_avg' and 'exp_avg_codes' \(its 8-bit codes\)"),
    ]
    for sd, match in cases:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        for a, b in zip(_everything(ps, opt), before):
            assert_bitwise(match, a, b)
    opt.load_state_dict(good)  # the good one loads


def test_option_errors():
    ps = _params()
    with pytest.raises(ValueError, match="exp_avg_dtype and exp_avg_sq_dtype must be the same dtype"):
        ampfused.FusedAdamW(ps, exp_avg_dtype=U8)
    with pytest.raises(ValueError, match="exp_avg_dtype and exp_avg_sq_dtype must be the same dtype"):
        ampfused.FusedAdam(ps, exp_avg_dtype=U8, exp_avg_sq_dtype=BF16)
    with pytest.raises(ValueError, match=r"exp_avg_sq_dtype must be .* or torch.uint8 \(8-bit moments\), got "
                                         r"torch.int8"):
        ampfused.FusedAdamW(ps, exp_avg_dtype=U8, exp_avg_sq_dtype=torch.int8)
    with pytest.raises(ValueError, match="FusedSGD: momentum_dtype must be"):
        ampfused.FusedSGD(ps, momentum=0.9, momentum_dtype=torch.float16)


def test_the_smallest_mode_keeps_at_most_2_1_bytes_per_parameter():
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g).to(BF16)) for n in (4096, 2048, 1000, 64)]
    opt = ampfused.FusedAdamW(ps, bf16_stochastic_round=True, **Q8_ADAM, backend="reference")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    seg = opt._segs.segments[0]
    assert seg.master is None
    stored = sum(t.numel() * t.element_size() for t in [*seg.states.values(), seg.scales])
    numel = sum(p.numel() for p in ps)
    assert stored / numel <= 2.1
    # what bytes_per_param says: 2 + 2 * 4 / 256 (the last blocks' unused codes are the difference)
    expect = bytes_per_param(opt._precision, BF16, 2, False)
    assert expect == 2 + 2 * 4 / 256
    assert math.isclose(stored / numel, expect, rel_tol=0.05)
    # and with remainders: 2 (remainder) + the moments
    assert bytes_per_param(ampfused.FusedAdamW(_params(), store_param_remainders=True, **Q8_ADAM)._precision,
                           BF16, 2, True) == 4 + 2 * 4 / 256


def test_a_parameter_changing_layout_keeps_its_moments():
    ps, opt = _make("adamw", "reference", "fp32-master")
    for k in range(2):
        _feed([(ps, opt)], k)
    before = {i: {n: opt.state[p][n].clone() for n in opt.state[p]} for i, p in enumerate(ps)}
    values = {n: _decoded(ps[2], opt.state[ps[2]], n) for n in ("exp_avg", "exp_avg_sq")}
    with torch.no_grad():
        ps[2].data = ps[2].detach().contiguous()  # another memory order: its blocks hold other elements now
    opt.state_dict()  # (the optimizer follows the change)
    assert opt.state[ps[2]]["exp_avg"].stride() == (53, 1)
    for i in (0, 1, 3):  # the others keep their codes and scales bit for bit
        for n, t in before[i].items():
            assert_bitwise(f"params[{i}] {n}", opt.state[ps[i]][n], t)
    for n, x in values.items():  # re-encoded to nearest in the new order
        got = _decoded(ps[2], opt.state[ps[2]], n)
        _within_rounding(n, _in_order(got, ps[2]), _in_order(x, ps[2]), sp.q8_signed(n))
    _feed([(ps, opt)], 2)  # and it steps on


def _decoded(p, st, name):
    out = torch.empty_like(p, dtype=torch.float32)
    memory_view(out).copy_(sp.q8_dequantize(memory_view(st[name]), st[f"{name}_scale"], sp.q8_signed(name)))
    return out


def test_the_format_comparison_script_measures_what_the_doc_says():
    """bench/q8_error.py (its numbers are in docs/state-precision.md) on synthetic moments spanning many binades:
    linear int8 flushes small second moments to 0 and wrecks the Adam direction, this format does not."""
    from bench import q8_error as Q
    g = torch.Generator().manual_seed(0)
    moments = []
    for n in (300, 1024):
        m = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) * 1e-3
        moments.append((m, m * m * (1 + torch.rand(n, generator=g))))
    ours = Q.measure(moments, Q.q8_nearest, 1e-8)
    linear = Q.measure(moments, Q.linear_int8, 1e-8)
    assert ours[0] < 2 ** -4 and ours[1] < 2 ** -4  # mean relative error within half a code step
    assert linear[2] > 10 * max(ours[2], 1e-4) and linear[3] > 100 * ours[3]
    # the share of blocks with a value below their codes' normal range (2^-13 of the largest for signed codes):
    # a block of 256 near 1 (none), then a partial block of 44 holding one value at 2^-20 (the padding past the
    # parameter's end does not count); as one 1024-element span, one of one
    x = torch.cat([torch.full((256,), 1.0), torch.full((44,), 0.5)])
    assert Q.below_normal(x, True, 256) == (0, 2)
    x[260] = 2.0 ** -20
    assert Q.below_normal(x, True, 256) == (1, 2) and Q.below_normal(x, True, 1024) == (1, 1)
    assert Q.below_normal(torch.zeros(10), False, 256) == (1, 1)  # zeros are below it too (the kernels' vote)


def _as_exponents(sd):
    """``sd`` with every 8-bit moment's ``<name>_scale`` given as FSDP2's state dicts give it: ``<name>_exponent``,
    each element's block exponent (uint8, the codes' shape and strides)."""
    out = {"param_groups": sd["param_groups"], "state": {}}
    for k, entry in sd["state"].items():
        entry = dict(entry)
        for key in [key for key in entry if key.endswith("_scale")]:
            codes, scales = entry[f"{key[:-6]}_codes"], entry.pop(key)
            field = ((scales.view(torch.int32).to(torch.int64) >> 23) & 0xFF).to(U8)
            x = torch.empty_like(codes)
            memory_view(x).copy_(field.repeat_interleave(sp.QBLOCK)[:codes.numel()])
            entry[f"{key[:-6]}_exponent"] = x
        out["state"][k] = entry
    return out


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_8bit_moments_load_from_per_element_exponents(kind):
    """FSDP2's form of the block scales (each element's block exponent, which reshards with the parameter): where
    every block has one exponent, codes and scales load bit for bit and the run continues bitwise; elsewhere the
    values are encoded to nearest in this optimizer's blocks; torch_state_dict decodes both forms alike."""
    backend = BACKENDS[-1]  # the CPU backend where it is built
    ps, opt = _make(kind, backend, "no-master")
    for k in range(3):
        _feed([(ps, opt)], k)
    sd = {"param_groups": opt.state_dict()["param_groups"],  # (state_dict's tensors are views of live buffers)
          "state": {k: {key: v.clone() for key, v in e.items()} for k, e in opt.state_dict()["state"].items()}}
    given = _as_exponents(sd)
    assert not any(key.endswith("_scale") for e in given["state"].values() for key in e)
    ps2, opt2 = _make(kind, backend, "no-master")
    for a, b in zip(ps2, ps):
        a.data.copy_(b.detach())
    opt2.load_state_dict(given)
    for i, (a, b) in enumerate(zip(_everything(ps2, opt2), _everything(ps, opt))):
        assert_bitwise(f"{kind}: tensor {i} loaded", a, b)
    _feed([(ps, opt), (ps2, opt2)], 3)
    for i, (a, b) in enumerate(zip(_everything(ps2, opt2), _everything(ps, opt))):
        assert_bitwise(f"{kind}: tensor {i} a step after", a, b)
    # decoded alike
    t1, t2 = torch_state_dict(sd), torch_state_dict(given)
    for k in t1["state"]:
        assert set(t1["state"][k]) == set(t2["state"][k])
        for key, v in t1["state"][k].items():
            if isinstance(v, torch.Tensor):
                assert_bitwise(f"{kind}: {key} decoded", t2["state"][k][key], v)
    # one block of the (300,) parameter with two exponents: its codes re-encoded to nearest from their values
    key = "momentum_buffer" if kind == "sgd" else "exp_avg"
    entry = given["state"][1]
    x = entry[f"{key}_exponent"]
    memory_view(x)[:10] = torch.clamp(memory_view(x)[:10].to(torch.int64) + 1, max=sp.Q8_MAX_EXP).to(U8)
    values = sp.q8_decode(memory_view(entry[f"{key}_codes"]), memory_view(x).to(torch.int64), True)
    opt2.load_state_dict(given)
    seg = opt2._segs.segments[0]
    codes, scales = sp.q8_quantize(values, True)
    assert_bitwise("re-encoded codes", memory_view(seg.view(seg.states[key], 1)), codes)
    assert_bitwise("re-encoded scales", seg.scale_view(key, 1), scales)
    with pytest.raises(ValueError, match="_exponent' of parameter 1 must hold 0 or block exponents"):
        memory_view(x)[0] = 7
        opt2.load_state_dict(given)


def test_zero1_loads_per_element_exponents_bit_for_bit():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of this process")
    dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    try:
        ps, opt = _make("adamw", BACKENDS[-1], "no-master")
        for k in range(3):
            _feed([(ps, opt)], k)
        sd = {"param_groups": opt.state_dict()["param_groups"],
              "state": {k: {key: v.clone() for key, v in e.items()} for k, e in opt.state_dict()["state"].items()}}
        z = ampfused.ShardedFusedAdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2,
                                       weight_decay=0.1, seed=7, bf16_stochastic_round=True, **Q8_ADAM)
        z.load_state_dict(_as_exponents(sd))
        out = z.state_dict()["state"]
        for k, e in sd["state"].items():
            for key, v in e.items():
                assert_bitwise(f"ZeRO-1 state[{k}][{key}]", out[k][key], v)
    finally:
        dist.destroy_process_group()
