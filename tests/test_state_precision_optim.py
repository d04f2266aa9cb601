"""State precision as options of the fused optimizers (docs/state-precision.md), on every backend the CPU suite
runs: the remainders' masters bit for bit those of the fp32-master mode, the skip, the follow, checkpoints
(resume bit for bit, torch's fp32 state loaded and converted, exported back to torch.optim), the state's bytes
per parameter and the options' errors. Gradients are synthetic (independent of the weights), so two optimizers
fed the same gradients can be compared bit for bit.
"""
import pytest
import torch

import ampfused
from ampfused.ops import state_precision as sp
from backends import cpu_backends
from oracle import assert_bitwise

BF16 = torch.bfloat16
SIZES = (7, 300, 2053)
COMPACT = {
    "remainders": dict(store_param_remainders=True),
    "remainders-bf16-moments": dict(store_param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
    "no-master": dict(bf16_stochastic_round=True),
    "no-master-bf16-moments": dict(bf16_stochastic_round=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
}


def _params(dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def _adamw(backend, **options):
    ps = _params()
    return ps, ampfused.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, backend=backend, seed=5,
                                   **options)


def _feed(pairs, k, bad=False):
    g = torch.Generator().manual_seed(100 + k)
    grads = [torch.randn(n, generator=g).to(BF16) for n in SIZES]
    if bad:
        grads[1][3] = float("nan")
    for ps, opt in pairs:
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()


def _everything(ps, opt):
    out = [p.detach().clone() for p in ps]
    for seg in opt._segs.segments:
        out += [seg.steps.clone()] + [t.clone() for t in seg.states.values()]
        out += [seg.master.clone()] if seg.master is not None else []
    return out


def _masters(ps, opt):
    key = "master_remainder" if "master_remainder" in opt.state[ps[0]] else "master_param"
    if key == "master_param":
        return torch.cat([opt.state[p][key] for p in ps])
    return torch.cat([sp.join_master(p.detach(), opt.state[p][key]) for p in ps])


@pytest.mark.parametrize("backend", cpu_backends())
def test_remainders_keep_the_fp32_masters_bit_for_bit(backend):
    full = _adamw(backend)
    compact = _adamw(backend, store_param_remainders=True)
    for k in range(3):
        _feed([full, compact], k)
        assert_bitwise(f"masters after step {k + 1}", _masters(*compact), _masters(*full))
        for p, q in zip(compact[0], full[0]):  # weights: the fp32 mode's, except at exact ties
            differ = p.detach().view(torch.int16) != q.detach().view(torch.int16)
            m = full[1].state[q]["master_param"]
            assert ((m.view(torch.int32) & 0xFFFF)[differ] == 0x8000).all()
    seg = compact[1]._segs.segments[0]
    assert seg.master.dtype == torch.int16
    assert sum(t.element_size() for t in [seg.master] + list(seg.states.values())) == 10  # bytes per parameter


@pytest.mark.parametrize("mode", list(COMPACT))
@pytest.mark.parametrize("backend", cpu_backends())
def test_a_skipped_step_changes_nothing(backend, mode):
    ps, opt = _adamw(backend, **COMPACT[mode])
    _feed([(ps, opt)], 0)
    before = _everything(ps, opt)
    _feed([(ps, opt)], 1, bad=True)
    for a, b in zip(_everything(ps, opt), before):
        assert_bitwise(mode, a, b)
    # the next step is the one an uninterrupted run takes (the draws are keyed by the step count)
    other = _adamw(backend, **COMPACT[mode])
    _feed([other], 0)
    _feed([other, (ps, opt)], 2)
    for a, b in zip(_everything(ps, opt), _everything(*other)):
        assert_bitwise(mode, a, b)


@pytest.mark.parametrize("backend", cpu_backends())
def test_a_weight_written_from_outside_resets_its_remainder(backend):
    ps, opt = _adamw(backend, store_param_remainders=True)
    _feed([(ps, opt)], 0)
    assert opt.state[ps[2]]["master_remainder"].ne(0).any()
    kept = opt.state[ps[1]]["master_remainder"].clone()
    with torch.no_grad():
        ps[2].mul_(0.5)
    written = ps[2].detach().clone()
    # a step with lr 0 leaves every master where the step found it: the written weight's master is its value
    # (remainder 0), the other parameters' masters are untouched
    opt.param_groups[0]["lr"] = 0.0
    _feed([(ps, opt)], 1)
    assert_bitwise("written weight", ps[2].detach(), written)
    assert not opt.state[ps[2]]["master_remainder"].any()
    assert_bitwise("untouched remainder", opt.state[ps[1]]["master_remainder"], kept)


@pytest.mark.parametrize("mode", ["remainders-bf16-moments", "no-master-bf16-moments"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_resume_is_bitwise_identical(backend, mode):
    whole = _adamw(backend, **COMPACT[mode])
    first = _adamw(backend, **COMPACT[mode])
    for k in range(2):
        _feed([whole, first], k)
    saved_weights = [p.detach().clone() for p in first[0]]
    saved = first[1].state_dict()
    resumed = _adamw(backend, **COMPACT[mode])
    with torch.no_grad():
        for p, w in zip(resumed[0], saved_weights):
            p.copy_(w)
    resumed[1].load_state_dict(saved)
    for k in range(2, 4):
        _feed([whole, resumed], k)
    for a, b in zip(_everything(*resumed), _everything(*whole)):
        assert_bitwise(mode, a, b)


def test_state_dict_layout_and_torch_round_trip():
    ps, opt = _adamw("cpu" if "cpu" in cpu_backends() else "reference", store_param_remainders=True,
                     exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    _feed([(ps, opt)], 0)
    st = opt.state_dict()["state"][0]
    assert {k: v.dtype for k, v in st.items()} == {"exp_avg": BF16, "exp_avg_sq": BF16, "master_remainder": torch.int16,
                                                  "step": torch.float32}
    # exported to torch.optim.AdamW (fp32 parameters: the moments become fp32, the remainder is ignored)
    tps = [torch.nn.Parameter(p.detach().float()) for p in ps]
    t = torch.optim.AdamW(tps, lr=1e-2, weight_decay=0.1)
    t.load_state_dict(opt.state_dict())
    assert_bitwise("exp_avg", t.state[tps[0]]["exp_avg"], opt.state[ps[0]]["exp_avg"].float())
    # torch's fp32 state loaded into the compact mode: moments rounded to nearest, remainders from the masters
    full = _adamw("reference")
    _feed([full], 0)
    sd = full[1].state_dict()
    ps2, opt2 = _adamw("reference", store_param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    with torch.no_grad():
        for p, q in zip(ps2, full[0]):
            p.copy_(q)
    opt2.load_state_dict(sd)
    assert_bitwise("exp_avg", opt2.state[ps2[2]]["exp_avg"], sd["state"][2]["exp_avg"].to(BF16))
    m = sd["state"][2]["master_param"]
    w, r = sp.split_master(m)
    expect = torch.where(w.view(torch.int16) == ps2[2].detach().view(torch.int16), r, torch.zeros_like(r))
    assert_bitwise("remainders", opt2.state[ps2[2]]["master_remainder"], expect)


def test_bytes_per_parameter_of_each_mode():
    expected = {"remainders": 10, "remainders-bf16-moments": 6, "no-master": 8, "no-master-bf16-moments": 4}
    for mode, n in expected.items():
        ps, opt = _adamw("reference", **COMPACT[mode])
        _feed([(ps, opt)], 0)
        seg = opt._segs.segments[0]
        bufs = list(seg.states.values()) + ([seg.master] if seg.master is not None else [])
        assert sum(t.element_size() for t in bufs) == n, mode


def test_sgd_options():
    ps = _params()
    opt = ampfused.FusedSGD(ps, lr=1e-2, momentum=0.9, momentum_dtype=BF16, bf16_stochastic_round=True, seed=1,
                            backend="reference")
    _feed([(ps, opt)], 0)
    assert opt.state[ps[0]]["momentum_buffer"].dtype == BF16 and "master_param" not in opt.state[ps[0]]


def test_option_errors_name_the_option():
    ps = _params()
    with pytest.raises(ValueError, match="store_param_remainders=True and bf16_stochastic_round=True"):
        ampfused.FusedAdamW(ps, store_param_remainders=True, bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="exp_avg_dtype must be torch.float32 or torch.bfloat16"):
        ampfused.FusedAdamW(ps, exp_avg_dtype=torch.float16)
    with pytest.raises(ValueError, match="exp_avg_dtype and exp_avg_sq_dtype must be the same dtype"):
        ampfused.FusedAdamW(ps, exp_avg_dtype=BF16)
    with pytest.raises(ValueError, match="store_param_remainders=True needs master weights"):
        ampfused.FusedAdamW(ps, store_param_remainders=True, master_weights=False)
    with pytest.raises(TypeError, match="seed must be an int"):
        ampfused.FusedSGD(ps, seed=1.5)
