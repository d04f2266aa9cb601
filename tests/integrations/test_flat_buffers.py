"""The functional ops as a backend for a framework that owns its buffers (Megatron-style or DeepSpeed-style
optimizers): bf16 weights in one flat buffer the model's parameters view into, fp32 gradients accumulated into
one flat buffer by the framework's own hooks (Megatron's ``main_grad``), and the optimizer state in flat buffers
the framework allocated by ``ops.state_layout``. The step is ``ops.norm_check`` (K1) then ``ops.adamw_step_`` (K2)
over those buffers. Checked step by step against the torch recipe fed the same gradients (DESIGN tolerance),
against the same script with ``torch.optim.AdamW`` on fp32 masters, and for what the step dispatches (the two
kernels, no host read; on CUDA no host sync). Needs no framework package.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ampfused import ops
from oracle import assert_bitwise
from recipe import TorchRecipe
from shadow import DEVICES, Shadow, assert_losses_match, assert_trains, classification_data, kernel_calls
from stepcount import StepCounter, host_reads

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS, BATCH = 60, 32
INF_AT = (9, 31)


class FlatBuffers:
    """What the framework owns: the model's weights and gradients as flat buffers, its optimizer state."""

    def __init__(self, model: nn.Module, device):
        self.params = list(model.parameters())
        n = sum(p.numel() for p in self.params)
        self.weights = torch.empty(n, dtype=torch.bfloat16, device=device)
        self.grads = torch.zeros(n, dtype=torch.float32, device=device)
        i = 0
        with torch.no_grad():
            for p in self.params:
                k = p.numel()
                self.weights[i:i + k].copy_(p.flatten())
                p.data = self.weights[i:i + k].view_as(p)  # the parameter now lives in the flat buffer
                p.main_grad = self.grads[i:i + k].view_as(p)
                p.register_post_accumulate_grad_hook(self._accumulate)
                i += k
        # optimizer state, laid out by ops.state_layout over the one flat weight buffer
        _, total = ops.state_layout([n])
        self.master = self.weights.float()
        self.exp_avg = torch.zeros(total, device=device)
        self.exp_avg_sq = torch.zeros(total, device=device)
        self.step_count = torch.zeros(1, device=device)
        self.stats = torch.zeros(2, device=device)  # [norm, found_inf] of the last step
        self.lr = torch.tensor(HYPER["lr"], device=device)
        self.one = torch.ones((), device=device)

    @staticmethod
    def _accumulate(p):
        p.main_grad.add_(p.grad)  # fp32 accumulation, as Megatron does
        p.grad = None

    def step(self):
        partials = ops.norm_check([self.grads], self.one)  # K1: norm and inf check, one read
        ops.adamw_step_([self.weights], [self.grads], self.master, self.exp_avg, self.exp_avg_sq, self.step_count,
                        partials, self.one, self.lr, self.stats, beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                        eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], max_norm=1.0)  # K2
        self.grads.zero_()


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).to(device, torch.bfloat16)


def _batches(device):
    x, y = classification_data(STEPS * BATCH)
    return [(x[i:i + BATCH].to(device, torch.bfloat16), y[i:i + BATCH].to(device))
            for i in range(0, len(x), BATCH)]


def _forward_backward(model, x, y, accumulate=2):
    for part in range(accumulate):  # two micro-batches accumulated into the flat gradient buffer
        xs, ys = x[part::accumulate], y[part::accumulate]
        loss = nn.functional.cross_entropy(model(xs).float(), ys) / accumulate
        loss.backward()
    return loss.item() * accumulate


@pytest.mark.parametrize("device", DEVICES)
def test_flat_buffers_match_the_torch_recipe_step_by_step(device):
    model = _model(device)
    fb = FlatBuffers(model, device)
    shadow = Shadow([fb.weights], HYPER, max_norm=1.0)
    losses = []
    for k, (x, y) in enumerate(_batches(device)):
        losses.append(_forward_backward(model, x, y))
        if k in INF_AT:
            fb.grads[5] = float("inf")
        shadow.grads = [fb.grads.clone()]
        before = fb.weights.clone()
        fb.step()
        skipped = shadow.step_and_check(_FlatOptimizer(fb), fb.stats[0], where=f"step {k}")
        assert skipped == (k in INF_AT) == bool(fb.stats[1] > 0)
        if skipped:
            assert_bitwise("weights of a skipped step", fb.weights, before)
        assert fb.params[0].data_ptr() == fb.weights.data_ptr()  # the model trains on the buffer itself
    assert shadow.steps == STEPS - len(INF_AT)
    assert_trains(losses, "flat buffers")


class _FlatOptimizer:
    """Shows the flat buffers to Shadow.step_and_check as an optimizer with one parameter and its master."""

    def __init__(self, fb):
        self.state = {fb.weights: {"master_param": fb.master}}


def _torch_script(device, fused):
    """The same script with torch.optim.AdamW on fp32 masters, clip_grad_norm_, the masters copied back."""
    model = _model(device)
    params = list(model.parameters())
    rec = TorchRecipe(params, torch.optim.AdamW, dict(HYPER, fused=fused), max_norm=1.0, copy_params=False)
    losses = []
    for x, y in _batches(device):
        losses.append(_forward_backward(model, x, y))
        rec.step([p.grad for p in params])
        model.zero_grad()
    return losses


def test_flat_buffers_match_the_same_script_with_torch_adamw():
    model = _model("cpu")
    fb = FlatBuffers(model, "cpu")
    ours = []
    for x, y in _batches("cpu"):
        ours.append(_forward_backward(model, x, y))
        fb.step()
    assert_losses_match(ours, _torch_script("cpu", False), _torch_script("cpu", True), "flat buffers")


@pytest.mark.parametrize("device", DEVICES)
def test_the_step_is_two_kernels_and_no_host_read(device):
    model = _model(device)
    fb = FlatBuffers(model, device)
    counter = StepCounter(device)
    with counter.kernels_named():
        for k, (x, y) in enumerate(_batches(device)[:4]):
            _forward_backward(model, x, y)
            if k >= 1:
                counter.start()
            fb.step()
            if k >= 1:
                counter.stop()
    for window in counter.windows:
        assert kernel_calls(window) == {"ampfused::norm_check": 1, "ampfused::adam_step_": 1}, window
        assert host_reads(window) == 0
        assert sum(window.values()) == 3, window  # the two kernels and zeroing the gradient buffer
    if device == "cuda":
        assert counter.syncs == [0] * 3, counter.sync_messages
