"""FlatBuffer: one contiguous storage for a list of same-dtype parameters, and one for their gradients.

Each parameter's ``.data`` and ``.grad`` become views into the two buffers, so backward accumulates straight
into one flat gradient buffer and every fused kernel sees one pointer. Offsets are padded so each view starts
on a 16-byte boundary (kernels use 128-bit accesses); the padding stays zero in every buffer, which makes it
invisible to the norm and a fixed point of every update rule.
"""
from __future__ import annotations

import warnings
from typing import List, Sequence

import torch
from torch import Tensor

ALIGN_BYTES = 16


def _aligned(n: int, elems: int) -> int:
    return (n + elems - 1) // elems * elems


class FlatBuffer:
    """Packs ``params`` (one dtype, one device) into ``self.data`` and their gradients into ``self.grad``.

    After construction ``p.data`` and ``p.grad`` are views into the buffers; existing gradients are copied in
    (a missing one reads as zero). ``sync_grads()`` repairs the case where something replaced a ``.grad``
    with a tensor of its own (``model.zero_grad(set_to_none=True)`` before backward): that gradient is copied
    in, once per step, with a one-time warning saying how to avoid the copy.
    """

    def __init__(self, params: Sequence[Tensor], align_bytes: int = ALIGN_BYTES):
        params = list(params)
        if not params:
            raise ValueError("FlatBuffer needs at least one parameter")
        self.dtype, self.device = params[0].dtype, params[0].device
        for i, p in enumerate(params):
            if p.dtype != self.dtype or p.device != self.device:
                raise ValueError(f"FlatBuffer params must share dtype and device: params[{i}] is "
                                 f"{p.dtype} on {p.device}, params[0] is {self.dtype} on {self.device}")
        elems = max(1, align_bytes // params[0].element_size())
        self.params = params
        self.offsets: List[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total = _aligned(total + p.numel(), elems)
        self.numel = total
        self.data = torch.zeros(total, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(total, dtype=self.dtype, device=self.device)
        self._grad_views: List[Tensor] = []
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                view = self.view_of(self.data, p, off)
                view.copy_(p.data)
                p.data = view
                g = self.view_of(self.grad, p, off)
                if p.grad is not None:
                    g.copy_(p.grad)
                p.grad = g
                self._grad_views.append(g)
        self._warned = False

    @staticmethod
    def view_of(flat: Tensor, p: Tensor, offset: int) -> Tensor:
        return flat[offset:offset + p.numel()].view(p.shape)

    def views(self, flat: Tensor) -> List[Tensor]:
        """Views of another flat buffer laid out like this one (master weights, optimizer states)."""
        return [self.view_of(flat, p, off) for p, off in zip(self.params, self.offsets)]

    def sync_grads(self) -> bool:
        """Bring every gradient into the flat buffer; returns True if any had to be copied."""
        copied = False
        for i, (p, view) in enumerate(zip(self.params, self._grad_views)):
            g = p.grad
            if g is view:
                continue
            copied = True
            with torch.no_grad():
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
            p.grad = view
        if copied and not self._warned:
            self._warned = True
            warnings.warn("ampfused: a parameter's .grad was replaced by a tensor of its own (for example by "
                          "zero_grad(set_to_none=True) before backward), so the fused step copied it into the "
                          "flat gradient buffer. Call the fused optimizer's zero_grad() (which zeroes the flat "
                          "buffer in place) instead of the model's to avoid this copy.", stacklevel=3)
        return copied

    def zero_grad(self) -> None:
        """Zero the whole gradient buffer with one fill, keeping the views."""
        self.grad.zero_()
        for p, view in zip(self.params, self._grad_views):
            if p.grad is not view:
                p.grad = view
