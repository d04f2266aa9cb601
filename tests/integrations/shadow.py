"""What the framework suites share: the torch recipe fed the very gradients a framework handed the fused
optimizer (checked step by step with the DESIGN tolerance), the loss-curve comparison with the same script on
torch.optim.AdamW, tiny models and data, and the ``gpu`` parametrisation."""
from __future__ import annotations

import math
from typing import List, Optional

import pytest
import torch
from torch import nn

import ampfused.ops as ops
from norm_bound import assert_norm_within_bound
from oracle import assert_bitwise, assert_close_to_oracle
from recipe import TorchRecipe, masters_of

HAS_CUDA = torch.cuda.is_available()
# CPU always; CUDA variants are marked gpu (skipped without a device, see tests/conftest.py)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# one unit in the last place, relative: the resolution of a loss computed from bf16 / fp16 activations
BF16_ULP = 2.0 ** -8
FP16_ULP = 2.0 ** -11


class Shadow:
    """torch.optim.AdamW on fp32 masters (and its fp64 twin) fed, at each step, the gradients the framework left
    for the fused optimizer; ``check`` asserts the fused optimizer's masters and parameters are within the
    tolerance tests/oracle.py derives from the fp32 recipe's own error, and its returned norm within the bound
    rounding allows for its backend's summation in any order (tests/norm_bound.py: the fp32 recipe's norm is one
    order among many, and on the CPU an unusually accurate one)."""

    def __init__(self, params, hyper: dict, max_norm: Optional[float]):
        self.params = list(params)
        self.r32 = TorchRecipe(self.params, torch.optim.AdamW, hyper, max_norm=max_norm)
        self.r64 = TorchRecipe(self.params, torch.optim.AdamW, hyper, master_dtype=torch.float64, max_norm=max_norm)
        self.grads: Optional[List[Optional[torch.Tensor]]] = None
        self.steps = self.skips = 0

    def capture(self, inv_scale: float = 1.0) -> None:
        """Take the gradients as they are now; a scaled run gives 1/scale (a power of two: the unscale is exact)."""
        self.grads = [None if p.grad is None else
                      (p.grad.detach().float() * inv_scale if inv_scale != 1.0 else p.grad.detach().clone())
                      for p in self.params]

    @property
    def overflow(self) -> bool:
        return not all(g is None or bool(torch.isfinite(g).all()) for g in self.grads)

    def step_and_check(self, opt, norm=None, where="", lr=None) -> bool:
        """One recipe step on the captured gradients (none when they overflow), at learning rate ``lr`` when
        given (a scheduler's); checks the fused optimizer against it. Returns whether the step was skipped."""
        assert self.grads is not None, "capture() first"
        skipped = self.overflow
        if lr is not None:
            for r in (self.r32, self.r64):
                for g in r.opt.param_groups:
                    g["lr"] = lr
        if skipped:
            self.skips += 1
        else:
            n32 = self.r32.step(self.grads)
            n64 = self.r64.step(self.grads)
            self.steps += 1
            if norm is not None and n32 is not None:
                given = [g for g in self.grads if g is not None]
                assert_norm_within_bound(f"{where} clip norm", float(torch.as_tensor(norm).detach().cpu()),
                                         float(n64), sum(g.numel() for g in given), len(given),
                                         self._norm_backend(opt, given))
        for i, (p, m) in enumerate(zip(self.params, masters_of(opt, self.params))):
            assert_close_to_oracle(f"{where} master[{i}]", m.detach().cpu(), self.r32.masters[i].detach().cpu(),
                                   self.r64.masters[i].detach().cpu())
            if p.dtype != torch.float32:
                assert_bitwise(f"{where} param[{i}]", p.detach(), m.detach().to(p.dtype))
        self.grads = None
        return skipped

    def _norm_backend(self, opt, grads) -> str:
        """The backend that formed the fused optimizer's norm: its forced one, else the device's pick."""
        params = [p for p in self.params if p.grad is not None] or self.params
        return ops.step_backend(params[0].device, ops._step_dtypes(params, grads, None), getattr(opt, "backend", None))


def assert_losses_match(ours, torch_run, yardstick, what: str, ulp: float = BF16_ULP) -> None:
    """Per-step losses of two real training runs, whose weights differ by rounding and so drift apart (chaos),
    not bitwise. The bound: the larger of twice the spread between two torch.optim.AdamW runs that differ only in
    summation order (``yardstick``: the same script with ``fused=True``, or with the single-tensor loop where the
    framework will not clip for torch's fused AdamW), and one ulp (relative, ``ulp``: bf16's by default, fp16's
    for fp16 runs) of the loss, since the forward runs in low precision and weights equal to fp32 rounding can
    round an activation apart."""
    ours, ref, alt = (torch.tensor(x, dtype=torch.float64) for x in (ours, torch_run, yardstick))
    assert len(ours) == len(ref) == len(alt) and len(ours) >= 50, (len(ours), len(ref), len(alt))
    assert torch.isfinite(ours).all() and torch.isfinite(ref).all()
    spread = ((alt - ref).abs() / ref.abs()).max().item()
    bound = max(2 * spread, ulp)
    rel = (ours - ref).abs() / ref.abs()
    worst = int(rel.argmax())
    assert rel.max().item() <= bound, (f"{what}: step {worst} loss {ours[worst].item()!r} vs torch "
                                       f"{ref[worst].item()!r} (relative {rel.max().item():.3g} > bound {bound:.3g}; "
                                       f"torch vs torch spread {spread:.3g})")


def assert_trains(losses, what: str) -> None:
    """The loss falls: the mean of the last 10 steps well below the mean of the first 10."""
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert math.isfinite(last) and last < 0.8 * first, f"{what}: loss went from {first:.4f} to {last:.4f}"


def mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)).to(dtype)


def classification_data(n: int, seed: int = 1):
    """A learnable task: the class is the argmax of a fixed random linear map of the input."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return x, (x @ w).argmax(1)


def kernel_calls(counter) -> dict:
    return {k: v for k, v in counter.items() if k.startswith("ampfused::")}
