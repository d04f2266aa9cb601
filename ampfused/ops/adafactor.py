"""The public entry of ``adafactor_step_``: its input rules and its backend choice.

A backend without Adafactor is passed over in the device's priority list unless it was named (``backend=`` or
``AMPFUSED_BACKEND``), in which case the call is refused with the reason.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional

import torch
from torch import Tensor

from . import checks, registry
from .reference_adafactor import factor_layout

OP = "adafactor_step_"


def pick(device: torch.device, dtypes: tuple, backend: Optional[str], op: str = OP) -> str:
    """The backend that runs ``op`` here: the one the step ops pick, or the next in priority that has ``op``."""
    from . import _pick
    name = _pick(device, dtypes, backend)
    if registry.get_backend(name).has_step(op):
        return name
    if backend or os.environ.get(registry.ENV_VAR):
        raise RuntimeError(f"ampfused backend {name!r} (forced) does not implement {op}")
    for other in registry.available_backends(device, tuple(getattr(torch, d.split(".")[-1]) for d in dtypes)):
        if registry.get_backend(other).has_step(op):
            return other
    raise RuntimeError(f"no ampfused backend implements {op} on {device}")


def check_inputs(params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed,
                 beta2_decay, eps1, eps2, d, weight_decay, max_norm) -> None:
    """Every rule of ``adafactor_step_``'s inputs (the step ops' shared ones, then its own), before any change."""
    checks.step_inputs(params, grads, master, [], steps, partials, inv_scale, lr, out_stats, seed)
    _, total = factor_layout([tuple(p.shape) for p in params])
    dtypes = (torch.float32, torch.float64) if master is None or master.dtype != torch.int16 else (torch.float32,)
    checks.tensor("factors", factors, dtypes=dtypes, flat=True, device=steps.device, numel=total)
    for i, p in enumerate(params):
        if p.is_complex():
            raise RuntimeError("Adafactor does not support complex parameters")
    checks.scalars(beta2_decay=beta2_decay, eps2=eps2, d=d, weight_decay=weight_decay, max_norm=max_norm)
    if not beta2_decay <= 0.0:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
    if eps1 is not None and not 0.0 <= eps1:
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps1}")
    if not 0.0 <= eps2:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps2}")
    if not 1.0 <= d:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
    if factors.dtype == torch.float64 and master is not None and master.dtype != torch.float64:
        raise TypeError("factors is float64: the fp64 form needs a float64 master (or float64 params)")


def adafactor_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
                    factors: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
                    out_stats: Tensor, *, beta2_decay: float = -0.8, eps: tuple = (None, 1e-3), d: float = 1.0,
                    weight_decay: float = 0.0, max_norm: float = math.inf, maximize: bool = False,
                    seed: Optional[Tensor] = None, backend: Optional[str] = None) -> None:
    """Fused ``torch.optim.Adafactor`` step over parameters where they live (math:
    :func:`ampfused.ops.reference_adafactor.adafactor_step_`).

    params: T dense tensors of one dtype (any memory layout), updated in place; grads: T entries (``None``
    leaves a parameter alone), each with its parameter's shape and layout; master: fp32 flat buffer laid out by
    ``state_layout([p.numel() ...])`` (or int16 remainders, or ``None`` for fp32 params or with ``seed`` for
    stochastic rounding of bf16 params); factors: fp32 flat buffer of ``factor_layout([p.shape ...])[1]``
    elements (each matrix's row then column vectors, each other parameter's variance); steps ``[T]`` fp32;
    partials ``[2, P]``; inv_scale, lr 0-d fp32; out_stats ``[2]`` fp32 (``[norm, found_inf]``).
    """
    from . import _as_lists, _call, _step_dtypes
    params, grads, steps = _as_lists(params, grads, steps)
    eps1, eps2 = eps
    check_inputs(params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed,
                 beta2_decay, eps1, eps2, d, weight_decay, max_norm)
    name = pick(steps.device, _step_dtypes(params, grads, master), backend)
    _call(OP, steps, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats,
          float(beta2_decay), None if eps1 is None else float(eps1), float(eps2), float(d), float(weight_decay),
          float(max_norm), bool(maximize), name, **({} if seed is None else {"seed": seed}))
