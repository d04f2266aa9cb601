"""grad_divisor through ampfused.GradScaler: gradient accumulation over variable-length micro-batches with
summed losses, normalised once by the token count, equals full-batch training (short and long loop, plain and
fused optimizers); bad divisors fail before anything changes."""
import functools
import math

import pytest
import torch

import ampfused
from backends import set_grad
from oracle import assert_bitwise

VOCAB, DIM, LENGTHS = 11, 6, [3, 17, 5, 9, 1, 12, 7, 2]  # 8 micro-batches of variable-length sequences


def _tokens(step):
    g = torch.Generator().manual_seed(step)
    return ([torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS],
            [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS])


def _lm():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.Linear(DIM, VOCAB))


@functools.lru_cache(maxsize=None)  # the full-batch and naive runs serve both divisor types
def _train(mode, optim, loop, divisor_type=float, steps=3, max_norm=0.35):
    """``full``: the whole batch, token-mean loss. ``divisor``: 8 micro-batches, summed per-token losses,
    grad_divisor=total tokens. ``naive``: per-micro-batch mean losses / 8."""
    model = _lm()
    if optim == "fused":
        opt = ampfused.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    elif optim in ("adamw", "adamw_torch_fused"):  # the second unscales inside its own step (torch's protocol)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=optim != "adamw")
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = ampfused.GradScaler("cpu", init_scale=1024.0)
    ce = torch.nn.functional.cross_entropy
    norms = []
    for k in range(steps):
        xs, ys = _tokens(k)
        divisor = None
        if mode == "full":
            scaler.scale(ce(model(torch.cat(xs)), torch.cat(ys))).backward()
        for x, y in zip(xs, ys) if mode != "full" else ():
            loss = ce(model(x), y, reduction="sum") if mode == "divisor" else ce(model(x), y) / len(xs)
            scaler.scale(loss).backward()
        if mode == "divisor":
            divisor = divisor_type(sum(LENGTHS))
        if loop == "short":
            scaler.step(opt, grad_divisor=divisor)
        else:
            scaler.unscale_(opt, grad_divisor=divisor)
            norms.append(ampfused.clip_grad_norm_(model.parameters(), max_norm).item())
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return tuple(p.detach().clone() for p in model.parameters()), tuple(norms)


@pytest.mark.parametrize("optim", ["sgd", "adamw", "adamw_torch_fused", "fused"])
@pytest.mark.parametrize("loop", ["short", "long"])
@pytest.mark.parametrize("divisor_type", [float, torch.tensor])
def test_grad_divisor_equals_full_batch_token_mean(optim, loop, divisor_type):
    full, full_norms = _train("full", optim, loop)
    acc, acc_norms = _train("divisor", optim, loop, divisor_type)
    naive, _ = _train("naive", optim, loop)
    for a, b in zip(full, acc):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if loop == "long":  # the clip saw the normalised gradients, and clipped them
        torch.testing.assert_close(torch.tensor(acc_norms), torch.tensor(full_norms), rtol=1e-5, atol=0)
        assert max(full_norms) > 0.35
    diff = max((a - c).abs().max().item() for a, c in zip(full, naive))
    assert diff > 1e-2, "per-micro-batch averaging should differ visibly from token normalisation"


@pytest.mark.parametrize("fused", [False, True])
def test_grad_divisor_with_a_disabled_scaler_still_divides(fused):
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 6.0)
    opt = ampfused.FusedSGD([p], lr=1.0) if fused else torch.optim.SGD([p], lr=1.0)
    if fused:
        set_grad(p, 6.0)
    s = ampfused.GradScaler("cpu", enabled=False)
    s.step(opt, grad_divisor=3)
    assert_bitwise("param", p.detach(), torch.full((4,), -2.0))
    set_grad(p, 6.0)
    s.unscale_(opt, grad_divisor=torch.tensor(2))
    s.step(opt)
    assert_bitwise("param", p.detach(), torch.full((4,), -5.0))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("method", ["unscale_", "step"])
@pytest.mark.parametrize("value,exc,text", [
    (0, ValueError, "grad_divisor must be a positive finite number or a 1-element tensor, got 0"),
    (-2.0, ValueError, "grad_divisor must be a positive finite number or a 1-element tensor, got -2.0"),
    (math.nan, ValueError, "grad_divisor must be a positive finite number or a 1-element tensor, got nan"),
    (math.inf, ValueError, "grad_divisor must be a positive finite number or a 1-element tensor, got inf"),
    (True, TypeError, "grad_divisor must be a positive finite number or a 1-element tensor, got bool"),
    ("8", TypeError, "grad_divisor must be a positive finite number or a 1-element tensor, got str"),
    (torch.ones(2), ValueError, r"1-element float/int tensor, got a torch.float32 tensor of shape \(2,\)"),
    (torch.tensor(True), ValueError, r"1-element float/int tensor, got a torch.bool tensor of shape \(\)"),
])
def test_bad_grad_divisor_rejected_before_any_change(fused, method, value, exc, text):
    p = torch.nn.Parameter(torch.ones(4))
    opt = ampfused.FusedSGD([p], lr=0.1) if fused else torch.optim.SGD([p], lr=0.1)
    p.grad = torch.full((4,), 8.0)
    s = ampfused.GradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    with pytest.raises(exc, match=text):
        getattr(s, method)(opt, grad_divisor=value)
    assert torch.equal(p.grad, torch.full((4,), 8.0)) and torch.equal(p.detach(), torch.ones(4))
    assert s._per_optimizer_states[id(opt)]["stage"].name == "READY"


@pytest.mark.parametrize("fused", [False, True])
def test_grad_divisor_after_unscale_is_an_error(fused):
    p = torch.nn.Parameter(torch.ones(4))
    opt = ampfused.FusedSGD([p], lr=0.1) if fused else torch.optim.SGD([p], lr=0.1)
    p.grad = torch.full((4,), 8.0)
    s = ampfused.GradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    s.unscale_(opt, grad_divisor=2)
    assert torch.equal(p.grad, torch.ones(4))
    with pytest.raises(ValueError, match=r"grad_divisor was given to step\(\) after unscale_\(\)"):
        s.step(opt, grad_divisor=2)
    assert torch.equal(p.detach(), torch.ones(4))


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_grad_divisor_after_a_clip_divides_the_clipped_gradients(optim):
    """``clip_grad_norm_`` on the gradients as they are, then ``step(grad_divisor=d)`` without a scaler: the step
    divides what the clip left, as torch's clip followed by a division of the gradients does (the divisor was
    ignored when the step reused the clip's measurement)."""
    def run(fused: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = (ampfused.FusedSGD if optim == "sgd" else ampfused.FusedAdamW)(model.parameters(), lr=0.1) if fused \
            else (torch.optim.SGD if optim == "sgd" else torch.optim.AdamW)(model.parameters(), lr=0.1)
        model(torch.randn(3, 8)).pow(2).sum().backward()
        clip = ampfused.clip_grad_norm_ if fused else torch.nn.utils.clip_grad_norm_
        norm = clip(model.parameters(), 0.5)
        if fused:
            opt.step(grad_divisor=4.0)
        else:
            for p in model.parameters():
                p.grad /= 4.0
            opt.step()
        return norm, [p.detach().clone() for p in model.parameters()]

    (norm, ours), (norm_t, theirs) = run(True), run(False)
    torch.testing.assert_close(norm, norm_t)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
