"""The Triton backend: launches the kernels of ``ampfused.triton_kernels`` (K1, K2, scale update).

Runs on CUDA tensors; on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which is how the tests run it without a GPU. Importing this module touches no GPU: it
imports triton only to learn whether it can, and the kernel modules load on the first op.

Besides the caller's tensors the step ops need one piece of state: an int32 counter per device (see
``ampfused.triton_kernels.adam``), zero between launches. It is allocated on the first step on a device and
reused, so a warm step allocates nothing and can be captured in a CUDA graph. Two steps running at the
same time on different streams of one device would share it: steps on one device must be stream-ordered.
"""
from __future__ import annotations

import importlib
import os
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .registry import Backend

try:
    import triton  # noqa: F401
    _IMPORT_ERROR: Optional[str] = None
except Exception as e:  # not installed, or broken for this platform
    _IMPORT_ERROR = f"cannot import triton ({type(e).__name__}: {e})"


def _kernels(name: str):
    return importlib.import_module(f"ampfused.triton_kernels.{name}")


class TritonBackend(Backend):
    name = "triton"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    deterministic = True

    def __init__(self) -> None:
        self._counters: Dict[torch.device, Tensor] = {}

    @property
    def devices(self) -> tuple:
        # CPU tensors only work when every kernel is interpreted
        return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)

    def unavailable_reason(self) -> Optional[str]:
        return _IMPORT_ERROR

    def not_supported_reasons(self, device: torch.device, dtypes=()) -> List[str]:
        reasons = super().not_supported_reasons(device, dtypes)
        if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            reasons.append("torch sees no CUDA device (torch.cuda.is_available() is False)")
        return reasons

    # --------------------------------------------------------------------------------------------- helpers

    def _counter(self, device: torch.device) -> Tensor:
        c = self._counters.get(device)
        if c is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the triton backend allocates its step counter on the first step on a "
                                   f"device: run one step on {device} before capturing a CUDA graph")
            c = self._counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return c

    @staticmethod
    def _check_step_tensors(step: Tensor, lr: Tensor) -> None:
        if step.dtype != torch.float32:
            raise TypeError(f"step must be float32 for the triton backend, got {step.dtype}")
        if lr.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"lr must be float32 or float64, got {lr.dtype}")

    # ------------------------------------------------------------------------------------------------- ops

    def num_partials(self, numels: List[int]) -> int:
        return _kernels("norm_check").num_partials(numels)

    def norm_check(self, grads: List[Tensor], inv_scale: Tensor) -> Tensor:
        return _kernels("norm_check").norm_check(list(grads), inv_scale)

    def unscale_(self, grads: List[Tensor], inv_scale: Tensor) -> Tensor:
        return _kernels("norm_check").unscale_(list(grads), inv_scale)

    def update_scale_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                      backoff_factor: float, growth_interval: int) -> None:
        _kernels("update_scale").update_scale_(scale, growth_tracker, found_inf, growth_factor,
                                               backoff_factor, growth_interval)

    def adam_step_(self, param, grad, master, exp_avg, exp_avg_sq, step, partials, inv_scale, lr, out_stats,
                   beta1, beta2, eps, weight_decay, max_norm, decoupled, maximize=False) -> None:
        self._check_step_tensors(step, lr)
        _kernels("adam").adam_step_(param, grad, master, exp_avg, exp_avg_sq, step, partials, inv_scale, lr,
                                    out_stats, self._counter(param.device), beta1, beta2, eps, weight_decay,
                                    max_norm, decoupled, maximize)

    def sgd_step_(self, param, grad, master, momentum_buf, step, partials, inv_scale, lr, out_stats, momentum,
                  dampening, weight_decay, nesterov, max_norm, maximize=False) -> None:
        self._check_step_tensors(step, lr)
        _kernels("sgd").sgd_step_(param, grad, master, momentum_buf, step, partials, inv_scale, lr, out_stats,
                                  self._counter(param.device), momentum, dampening, weight_decay, nesterov,
                                  max_norm, maximize)


BACKEND = TritonBackend()
