"""The ops as ``torch.library`` custom ops (``torch.ops.ampfused.*``), each with a fake implementation.

The backend is resolved in Python before the op is called and passed by name, so a compiled graph holds
one opaque call per op and a step under ``torch.compile(fullgraph=True)`` has no graph break.

An argument an op writes has no default value (``state_scales`` of the step ops may be ``None`` but must be
given): the dispatcher drops trailing arguments equal to their defaults before it calls a Python kernel, and
torch before 2.13 bumps the version of each written argument by its position, so a dropped one raised
IndexError (under autograd's in-place kernel, dispatch modes, ``opcheck``).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .registry import get_backend


@torch.library.custom_op("ampfused::norm_check", mutates_args=())
def norm_check(grads: List[Tensor], inv_scale: Tensor, backend: str) -> Tensor:
    return get_backend(backend).norm_check(grads, inv_scale)


@norm_check.register_fake
def _(grads, inv_scale, backend):
    return inv_scale.new_empty(2, get_backend(backend).num_partials([g.numel() for g in grads]))


@torch.library.custom_op("ampfused::unscale_", mutates_args=("grads",))
def unscale_(grads: List[Tensor], inv_scale: Tensor, backend: str) -> Tensor:
    return get_backend(backend).unscale_(grads, inv_scale)


@unscale_.register_fake
def _(grads, inv_scale, backend):
    return inv_scale.new_empty(2, get_backend(backend).num_partials([g.numel() for g in grads]))


@torch.library.custom_op("ampfused::update_scale_",
                         mutates_args=("scale", "growth_tracker", "inv_scale", "skipped"))
def update_scale_(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                  backoff_factor: float, growth_interval: int, inv_scale: Optional[Tensor],
                  skipped: Optional[Tensor], backend: str) -> None:
    get_backend(backend).update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                                       growth_interval, inv_scale, skipped)


@update_scale_.register_fake
def _(*args):
    return None


def _scales(state_scales: Optional[Tensor]) -> dict:
    """``state_scales`` (8-bit moments' block scales) passed to a backend only when given: a backend written
    before 8-bit moments keeps its signature."""
    return {} if state_scales is None else {"state_scales": state_scales}


@torch.library.custom_op("ampfused::adam_step_",
                         mutates_args=("params", "master", "exp_avg", "exp_avg_sq", "steps", "out_stats",
                                       "state_scales"))
def adam_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor], exp_avg: Tensor,
               exp_avg_sq: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor,
               beta1: float, beta2: float, eps: float, weight_decay: float, max_norm: float, decoupled: bool,
               maximize: bool, backend: str, seed: Optional[Tensor],
               state_scales: Optional[Tensor]) -> None:
    get_backend(backend).adam_step_(params, grads, master, exp_avg, exp_avg_sq, steps, partials, inv_scale, lr,
                                    out_stats, beta1, beta2, eps, weight_decay, max_norm, decoupled, maximize,
                                    seed=seed, **_scales(state_scales))


@adam_step_.register_fake
def _(*args):
    return None


@torch.library.custom_op("ampfused::sgd_step_",
                         mutates_args=("params", "master", "momentum_buf", "steps", "out_stats", "state_scales"))
def sgd_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
              momentum_buf: Optional[Tensor], steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
              out_stats: Tensor, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
              max_norm: float, maximize: bool, backend: str, seed: Optional[Tensor],
              state_scales: Optional[Tensor]) -> None:
    get_backend(backend).sgd_step_(params, grads, master, momentum_buf, steps, partials, inv_scale, lr, out_stats,
                                   momentum, dampening, weight_decay, nesterov, max_norm, maximize, seed=seed,
                                   **_scales(state_scales))


@sgd_step_.register_fake
def _(*args):
    return None


@torch.library.custom_op("ampfused::lion_step_",
                         mutates_args=("params", "master", "exp_avg", "steps", "out_stats", "state_scales"))
def lion_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor], exp_avg: Tensor,
               steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta1: float,
               beta2: float, weight_decay: float, max_norm: float, maximize: bool, backend: str,
               seed: Optional[Tensor], state_scales: Optional[Tensor]) -> None:
    get_backend(backend).lion_step_(params, grads, master, exp_avg, steps, partials, inv_scale, lr, out_stats,
                                    beta1, beta2, weight_decay, max_norm, maximize, seed=seed,
                                    **_scales(state_scales))


@lion_step_.register_fake
def _(*args):
    return None


@torch.library.custom_op("ampfused::adafactor_step_",
                         mutates_args=("params", "master", "factors", "steps", "out_stats"))
def adafactor_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor], factors: Tensor,
                    steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor,
                    beta2_decay: float, eps1: Optional[float], eps2: float, d: float, weight_decay: float,
                    max_norm: float, maximize: bool, backend: str, seed: Optional[Tensor] = None) -> None:
    get_backend(backend).adafactor_step_(params, grads, master, factors, steps, partials, inv_scale, lr, out_stats,
                                         beta2_decay, eps1, eps2, d, weight_decay, max_norm, maximize, seed=seed)


@adafactor_step_.register_fake
def _(*args, **kw):
    return None
