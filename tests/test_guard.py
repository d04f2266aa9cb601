"""Training safety in the fused optimizers: spike guards, gradient-accumulation divisor, non-finite report,
stats. None of it reads a value to the host during step()."""
import math

import pytest
import torch

import ampfused
from backends import cpu_backends, snapshot, set_grad
from oracle import assert_bitwise


@pytest.mark.parametrize("backend", cpu_backends())
def test_grad_norm_spike_is_skipped_and_counted(backend):
    torch.manual_seed(0)
    params = [torch.randn(40, dtype=torch.bfloat16, requires_grad=True), torch.randn(7, 3, requires_grad=True)]
    guard = ampfused.SpikeGuard(factor=5.0, window=8, warmup=4)
    opt = ampfused.FusedAdamW(params, lr=1e-2, spike_guard=guard, backend=backend)
    spikes_at, skipped = {12, 20}, []
    for k in range(30):
        for p in params:
            set_grad(p, torch.randn_like(p) * (50.0 if k in spikes_at else 1.0))
        before = snapshot(opt, params)
        opt.step()
        if bool(opt.last_step_skipped):
            skipped.append(k)
            for a, b in zip(before, snapshot(opt, params)):
                assert_bitwise(f"step {k}", a, b)
        assert opt.last_found_inf.item() == 0.0  # a spike is not an overflow: a scaler must not back off
    assert set(skipped) == spikes_at
    st = opt.stats()
    assert st["steps"].item() == 28 and st["skipped_spike"].item() == 2 and st["skipped_overflow"].item() == 0


def test_absolute_threshold_and_overflow_counts():
    params = [torch.randn(10, requires_grad=True)]
    opt = ampfused.FusedSGD(params, lr=0.1, spike_guard=ampfused.SpikeGuard(max_norm=100.0))
    for k, scale in enumerate([1.0, 1e3, 1.0, math.inf, 1.0]):
        set_grad(params[0], torch.ones(10) * scale)
        opt.step()
    st = opt.stats()
    assert (st["steps"].item(), st["skipped_spike"].item(), st["skipped_overflow"].item()) == (3, 1, 1)


def test_loss_spike_skips_without_reading_the_loss():
    params = [torch.randn(10, requires_grad=True)]
    opt = ampfused.FusedSGD(params, lr=0.1, spike_guard=ampfused.SpikeGuard(loss_factor=3.0, window=5, warmup=3))
    losses = [1.0, 1.1, 0.9, 1.0, 9.0, 1.0]
    for k, l in enumerate(losses):
        set_grad(params[0], 0.5)
        opt.step(loss=torch.tensor(l))
        assert bool(opt.last_step_skipped) == (k == 4), k


def test_scale_lr_action_damps_instead_of_skipping():
    params = [torch.zeros(4, requires_grad=True)]
    opt = ampfused.FusedSGD(params, lr=1.0, spike_guard=ampfused.SpikeGuard(max_norm=10.0, action="scale_lr",
                                                                            lr_factor=0.25))
    set_grad(params[0], 100.0)
    opt.step()
    assert not bool(opt.last_step_skipped)
    torch.testing.assert_close(params[0].detach(), torch.full((4,), -25.0))
    assert opt.stats()["spikes"].item() == 1 and opt.stats()["skipped_spike"].item() == 0


@pytest.mark.parametrize("kw,msg", [(dict(factor=0.5), "factor and loss_factor must be > 1"),
                                    (dict(max_norm=-1.0), "max_norm must be a positive finite number"),
                                    (dict(window=0), "window must be an int >= 1"),
                                    (dict(action="nope"), "action must be 'skip' or 'scale_lr'")])
def test_guard_bad_input(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ampfused.SpikeGuard(**kw)


@pytest.mark.parametrize("backend", cpu_backends())
def test_grad_accumulation_divisor_equals_full_batch(backend):
    """8 micro-batches of variable-length sequences, per-token losses summed, divided once by the token count."""
    torch.manual_seed(0)
    vocab, dim = 11, 6
    lengths = [3, 17, 5, 9, 1, 12, 7, 2]
    seqs = [torch.randint(0, vocab, (n,)) for n in lengths]
    targets = [torch.randint(0, vocab, (n,)) for n in lengths]
    total = sum(lengths)

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab))

    full, accum, naive = make(), make(), make()
    opt_full = ampfused.FusedSGD(full.parameters(), lr=0.5, backend=backend)
    opt_acc = ampfused.FusedSGD(accum.parameters(), lr=0.5, backend=backend)
    opt_naive = ampfused.FusedSGD(naive.parameters(), lr=0.5, backend=backend)
    ce = torch.nn.functional.cross_entropy
    ce(full(torch.cat(seqs)), torch.cat(targets), reduction="mean").backward()
    opt_full.step()
    for x, y in zip(seqs, targets):
        ce(accum(x), y, reduction="sum").backward()
        (ce(naive(x), y, reduction="mean") / len(seqs)).backward()
    opt_acc.step(grad_divisor=torch.tensor(float(total)))
    opt_naive.step()
    torch.testing.assert_close(opt_acc.last_grad_norm, opt_full.last_grad_norm, rtol=1e-5, atol=0)
    for a, b, c in zip(full.parameters(), accum.parameters(), naive.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    diff = max((a - c).abs().max().item() for a, c in zip(full.parameters(), naive.parameters()))
    assert diff > 1e-3, "per-micro-batch averaging should differ visibly from token normalisation"


def test_grad_divisor_bad_input():
    params = [torch.randn(3, requires_grad=True)]
    opt = ampfused.FusedSGD(params, lr=0.1)
    with pytest.raises(ValueError, match="grad_divisor must be a positive finite number"):
        opt.step(grad_divisor=0)
    with pytest.raises(ValueError, match="grad_divisor must be a number or a 1-element"):
        opt.step(grad_divisor=torch.ones(2))
    assert not opt.state and all(not any(seg.has_state) for seg in opt._segs.segments)


@pytest.mark.parametrize("how", ["module", "named_parameters"])
def test_nonfinite_report_names_exactly_the_injected_parameters(how):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).bfloat16()
    if how == "module":
        opt = ampfused.FusedAdamW(model.parameters(), track_nonfinite=True, module=model)
    else:
        opt = ampfused.FusedAdamW(model.named_parameters(), track_nonfinite=True)
    for p in model.parameters():
        set_grad(p, torch.randn_like(p))
    opt.step()
    assert opt.nonfinite_report() == {}
    model[0].bias.grad[3] = math.nan
    model[2].weight.grad[1, 2] = math.inf
    model[2].weight.grad[0, 0] = -math.inf
    opt.step()
    assert bool(opt.last_step_skipped)
    assert opt.nonfinite_report() == {"0.bias": 1, "2.weight": 2}


@pytest.mark.parametrize("backend", cpu_backends())
def test_step_never_reads_to_the_host(monkeypatch, backend):
    """With a scaler, spike guard, divisor tensor, loss and non-finite tracking, step() reads nothing back."""
    params = [torch.randn(20, dtype=torch.bfloat16, requires_grad=True), torch.randn(5, requires_grad=True)]
    opt = ampfused.FusedAdamW(params, lr=torch.tensor(1e-2), max_grad_norm=1.0, backend=backend,
                              spike_guard=ampfused.SpikeGuard(factor=4.0, loss_factor=4.0, window=4, warmup=2),
                              track_nonfinite=True)
    scaler = ampfused.GradScaler("cpu", init_scale=64.0, growth_interval=2, backend=backend)
    scaler.scale(torch.ones(()))
    divisor = torch.tensor(3.0)

    def refuse(*a, **k):
        raise AssertionError("host read during step")
    for k in range(4):
        for p in params:
            set_grad(p, torch.randn_like(p) * 64)
        params[0].grad[k] = math.inf if k == 2 else params[0].grad[k]
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
                mp.setattr(torch.Tensor, name, refuse)
            scaler.step(opt, grad_divisor=divisor, loss=torch.tensor(1.0))
            scaler.update()
        assert bool(opt.last_step_skipped) == (k == 2)
    assert opt.stats()["skipped_overflow"].item() == 1


def test_guard_state_travels_in_the_optimizer_state_dict():
    def make(ps):
        return ampfused.FusedSGD(ps, lr=0.1, spike_guard=ampfused.SpikeGuard(factor=3.0, window=4, warmup=2))
    params = [torch.randn(8, requires_grad=True)]
    opt = make(params)
    for scale in [1.0, 1.1, 0.9, 50.0]:
        set_grad(params[0], scale)
        opt.step()
    assert bool(opt.last_step_skipped)
    sd = opt.state_dict()
    assert sd["spike_guard"]["norm_count"] == 3
    params2 = [params[0].detach().clone().requires_grad_()]
    opt2 = make(params2)
    opt2.load_state_dict(sd)
    set_grad(params2[0], 40.0)
    opt2.step()  # the loaded window already knows the typical norm: a spike at once
    assert bool(opt2.last_step_skipped)
    st = opt2.stats()
    assert (st["steps"].item(), st["skipped_spike"].item(), st["skipped_overflow"].item()) == (0, 1, 0)
    torch.optim.SGD([torch.randn(8, requires_grad=True)], lr=0.1).load_state_dict(sd)  # torch ignores the key


def test_bad_divisor_changes_nothing_even_after_unscale():
    params = [torch.randn(4, requires_grad=True)]
    opt = ampfused.FusedSGD(params, lr=0.1)
    scaler = ampfused.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    set_grad(params[0], 4.0)
    scaler.unscale_(opt)
    partials = opt._clip_state.partials
    with pytest.raises(ValueError, match="grad_divisor must be a positive finite number"):
        opt.step(grad_divisor=-1.0)
    assert opt._clip_state.partials is partials and opt._segs.segments[0].steps.tolist() == [0.0]
