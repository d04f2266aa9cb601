"""SpikeGuard: skip (or damp) a step on the device when the gradient norm or the loss spikes.

Large runs lose days to one bad batch: a gradient or loss far above its recent typical value, applied before
anyone looks. The guard decides on the device, from 0-d tensors, with no host read: a step is a spike when

    norm > max_norm                                    (absolute threshold), or
    norm > factor * median(recent accepted norms)      (once ``warmup`` steps were accepted), and likewise
    loss > max_loss  or  loss > loss_factor * median(recent accepted losses)

The window holds the last ``window`` accepted values (skipped steps never enter it). ``action="skip"``
skips the step exactly as an overflow does (nothing changes); ``action="scale_lr"`` takes the step with the
learning rate multiplied by ``lr_factor``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


class _Window:
    """Ring buffer of the last ``size`` accepted values on the device, with a fill count."""

    def __init__(self, size: int, device):
        self.values = torch.zeros(size, dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.size = size

    def median(self) -> Tensor:
        filled = torch.arange(self.size, device=self.values.device) < self.count
        # unfilled slots sort last (inf), so the median of the filled prefix is the lower middle of them
        vals = torch.where(filled, self.values, torch.full_like(self.values, math.inf)).sort().values
        mid = ((self.count.clamp(min=1) - 1) // 2).clamp(max=self.size - 1)
        return vals.gather(0, mid.reshape(1)).reshape(())

    def push_(self, value: Tensor, accept: Tensor) -> None:
        slot = (self.count % self.size).reshape(1)
        old = self.values.gather(0, slot)
        self.values.scatter_(0, slot, torch.where(accept, value.float().reshape(1), old))
        self.count.add_(accept.to(torch.int64))


class SpikeGuard:
    """On-device gradient-norm and loss spike detection for the fused optimizers (``spike_guard=``)."""

    def __init__(self, *, max_norm: Optional[float] = None, factor: Optional[float] = None,
                 max_loss: Optional[float] = None, loss_factor: Optional[float] = None, window: int = 100,
                 warmup: int = 10, action: str = "skip", lr_factor: float = 0.1):
        for name, v in (("max_norm", max_norm), ("factor", factor), ("max_loss", max_loss),
                        ("loss_factor", loss_factor)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                                  or math.isinf(v)):
                raise ValueError(f"SpikeGuard {name} must be a positive finite number or None, got {v!r}")
        if factor is not None and factor <= 1 or loss_factor is not None and loss_factor <= 1:
            raise ValueError("SpikeGuard factor and loss_factor must be > 1 (a multiple of the typical value)")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"SpikeGuard window must be an int >= 1, got {window!r}")
        if not isinstance(warmup, int) or not 1 <= warmup <= window:
            raise ValueError(f"SpikeGuard warmup must be an int in [1, window={window}], got {warmup!r}")
        if action not in ("skip", "scale_lr"):
            raise ValueError(f"SpikeGuard action must be 'skip' or 'scale_lr', got {action!r}")
        if not 0 <= lr_factor < 1:
            raise ValueError(f"SpikeGuard lr_factor must be in [0, 1), got {lr_factor!r}")
        self.max_norm, self.factor, self.max_loss, self.loss_factor = max_norm, factor, max_loss, loss_factor
        self.window, self.warmup, self.action, self.lr_factor = window, warmup, action, lr_factor
        self._device = None

    def _ensure(self, device) -> None:
        if self._device is None:
            self._device = device
            self._norms = _Window(self.window, device)
            self._losses = _Window(self.window, device)
            self.spikes = torch.zeros((), dtype=torch.int64, device=device)  # steps judged spikes

    def to_(self, device) -> None:
        """Move the windows and counters to ``device`` (the optimizer's parameters moved there)."""
        if self._device is None or torch.device(device) == self._device:
            return
        self._device = torch.device(device)
        for win in (self._norms, self._losses):
            win.values, win.count = win.values.to(device), win.count.to(device)
        self.spikes = self.spikes.to(device)

    def _over(self, value: Tensor, absolute: Optional[float], factor: Optional[float], win: _Window) -> Tensor:
        out = torch.zeros((), dtype=torch.bool, device=value.device)
        if absolute is not None:
            out = out | (value > absolute)
        if factor is not None:
            out = out | ((win.count >= self.warmup) & (value > factor * win.median()))
        return out

    def check(self, norm: Tensor, loss: Optional[Tensor] = None) -> Tensor:
        """0-d bool device tensor: whether this step is a spike (norm: the unscaled gradient norm)."""
        self._ensure(norm.device)
        spike = self._over(norm, self.max_norm, self.factor, self._norms)
        if loss is not None:
            spike = spike | self._over(loss.detach().reshape(()).float(), self.max_loss, self.loss_factor,
                                       self._losses)
        return spike

    def record_(self, norm: Tensor, loss: Optional[Tensor], spike: Tensor, overflow: Tensor) -> None:
        """Count the decision and feed the windows with the values of accepted, finite steps."""
        accept = ~spike & ~overflow
        self.spikes.add_((spike & ~overflow).to(torch.int64))
        self._norms.push_(norm, accept)
        if loss is not None:
            self._losses.push_(loss.detach().reshape(()), accept & torch.isfinite(loss.detach().reshape(())))

    def state_dict(self) -> dict:
        if self._device is None:
            return {}
        return {"norms": self._norms.values.cpu(), "norm_count": int(self._norms.count),
                "losses": self._losses.values.cpu(), "loss_count": int(self._losses.count),
                "spikes": int(self.spikes)}

    def load_state_dict(self, sd: dict, device) -> None:
        if not sd:
            return
        self._ensure(device)
        self._norms.values.copy_(sd["norms"])
        self._norms.count.fill_(sd["norm_count"])
        self._losses.values.copy_(sd["losses"])
        self._losses.count.fill_(sd["loss_count"])
        self.spikes.fill_(sd["spikes"])
