"""The ``cuda`` backend: the ops on CUDA tensors through ``ampfused._C_cuda``.

K1 (``norm_check``/``unscale_``): a bounded grid, one block per partial; a tensor of ``n`` elements gets
``min(ceil(n / TILE), MAX_PARTIALS_PER_TENSOR)`` partials whose bits depend only on the data and sizes.
K2 (the step): every block reduces all partials in the same fixed order, returns at once on found_inf, and
updates its share with 128-bit loads and stores; the last block done advances ``step``. With
``single_launch=True`` (an option of :meth:`CudaBackend.adam_step_` / :meth:`CudaBackend.sgd_step_`) one
cooperative kernel runs K1 over ``grad`` into ``partials`` (then an *output* of shape
``[2, num_partials([grad.numel()])]``), a grid barrier, then K2: same results as ``norm_check`` followed by
the two-kernel step. Everything is enqueued on ``torch.cuda.current_stream()``, nothing is allocated
during a step (the workspace, one int32 block counter per step tensor, is a slab allocated once per device),
so steps can be captured in CUDA graphs. The math is ``csrc/include/ampfused/math.h``; the specification is
:mod:`ampfused.ops.reference`.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import _native
from .cpu import CpuBackend

_SLOTS = 4096
_slabs: Dict[int, Tensor] = {}  # device index -> int32[_SLOTS] of zeroed block counters
_slots: Dict[Tuple[int, int], int] = {}  # (device index, address of a step tensor) -> its counter
_prepared: set = set()


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _slab(device: torch.device) -> Tensor:
    index = _device_index(device)
    if index not in _slabs:
        _slabs[index] = torch.zeros(_SLOTS, dtype=torch.int32, device=device)
    return _slabs[index]


def _counter(step: Tensor) -> int:
    """Address of the zeroed int32 in which a step kernel counts its finished blocks (left zero after each
    step). One per step tensor, i.e. per optimizer: steps of different optimizers on concurrent streams or
    in concurrently replayed graphs never share one. The workspace is allocated once per device."""
    key = (_device_index(step.device), step.data_ptr())
    slot = _slots.get(key)
    if slot is None:
        if len(_slots) >= _SLOTS:  # thousands of step tensors: start over (counters are zero between steps)
            _slots.clear()
        slot = _slots[key] = len(_slots)
    return _slab(step.device).data_ptr() + 4 * slot


class CudaBackend(CpuBackend):
    name = "cuda"
    kind = "cuda"
    devices = ("cuda",)

    def unavailable_reason(self) -> Optional[str]:
        why = _native.unavailable_reason(self.kind)
        if why:
            return why
        status = self._mod().device_status()
        if status:
            return f"{status}; built for {_native._describe(_native.build_info(self.kind))}"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device (torch.cuda.is_available() is False)"
        return None

    def _device_args(self, device: torch.device) -> tuple:
        index = _device_index(device)
        if index not in _prepared:  # load all kernels now, not lazily inside a graph capture later
            self._mod().prepare(index)
            _slab(device)
            _prepared.add(index)
        return (index, torch.cuda.current_stream(device).cuda_stream)

    def _update_scale(self, scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
        self._mod().update_scale(scale.data_ptr(), growth_tracker.data_ptr(), found_inf.data_ptr(), growth_factor,
                                 backoff_factor, growth_interval, *self._device_args(scale.device))

    def _step_tail(self, step: Tensor, single_launch: bool) -> list:
        return [*self._device_args(step.device), _counter(step), bool(single_launch)]

    def adam_step_(self, param, grad, master, exp_avg, exp_avg_sq, step, partials, inv_scale, lr, out_stats,
                   beta1, beta2, eps, weight_decay, max_norm, decoupled, maximize=False, *,
                   single_launch: bool = False) -> None:
        """Adam/AdamW step; ``single_launch=True`` fuses K1 over ``grad`` (writing ``partials``) into it."""
        if single_launch and isinstance(grad, Tensor):
            self._check_single_launch(grad, partials)
        super().adam_step_(param, grad, master, exp_avg, exp_avg_sq, step, partials, inv_scale, lr, out_stats, beta1,
                           beta2, eps, weight_decay, max_norm, decoupled, maximize, single_launch=single_launch)

    def sgd_step_(self, param, grad, master, momentum_buf, step, partials, inv_scale, lr, out_stats, momentum,
                  dampening, weight_decay, nesterov, max_norm, maximize=False, *, single_launch: bool = False) -> None:
        """SGD step; ``single_launch=True`` fuses K1 over ``grad`` (writing ``partials``) into it."""
        if single_launch and isinstance(grad, Tensor):
            self._check_single_launch(grad, partials)
        super().sgd_step_(param, grad, master, momentum_buf, step, partials, inv_scale, lr, out_stats, momentum,
                          dampening, weight_decay, nesterov, max_norm, maximize, single_launch=single_launch)

    def _check_single_launch(self, grad: Tensor, partials: Tensor) -> None:
        want = self.num_partials([grad.numel()])
        if not isinstance(partials, Tensor) or tuple(partials.shape) != (2, want) or not partials.is_contiguous():
            got = tuple(partials.shape) if isinstance(partials, Tensor) else type(partials).__name__
            raise ValueError(f"partials must be a contiguous [2, {want}] tensor with single_launch=True (the kernel "
                             f"writes grad's partials into it), got {got}")

    def _launch_adam(self, args, step, single_launch: bool = False):
        self._mod().adam_step(*args, *self._step_tail(step, single_launch))

    def _launch_sgd(self, args, step, single_launch: bool = False):
        self._mod().sgd_step(*args, *self._step_tail(step, single_launch))


BACKEND = CudaBackend()
