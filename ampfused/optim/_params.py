"""Checks of what users hand a fused optimizer: parameter lists and hyperparameters.

Every rule raises before anything changes, with torch.optim's message where torch has one, else one that
names the parameter (or group and key) and the rule. Hyperparameters are checked at construction, in
``add_param_group``, in ``load_state_dict`` and again before every step, since schedulers and users change
them through ``param_groups`` between steps.
"""
from __future__ import annotations

import math
from typing import List

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _name(gi: int, k: int, p: Tensor) -> str:
    return f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)})"


def normalise_groups(params) -> List[dict]:
    """``params`` as a list of group dicts whose ``params`` are lists (generators and other one-shot
    iterables are read exactly once), with torch.optim's errors for what it refuses."""
    if isinstance(params, Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        f"but got {torch.typename(params)}")
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return [normalise_group(g) for g in groups]


def normalise_group(group) -> dict:
    if not isinstance(group, dict):
        raise TypeError(f"param_group must be a dict, but got {type(group)}")
    group = dict(group)
    ps = group["params"]
    if isinstance(ps, Tensor):
        ps = [ps]
    elif isinstance(ps, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    group["params"] = list(ps)
    return group


def check_param(gi: int, k: int, p) -> None:
    """One parameter: a dense, floating-point leaf tensor of a supported dtype."""
    if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
        p = p[1]
    if not isinstance(p, Tensor):
        raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
    if p.layout != torch.strided:
        raise TypeError(f"{_name(gi, k, p)} is sparse ({p.layout}); fused optimizers need dense parameters")
    if p.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{_name(gi, k, p)} has dtype {p.dtype}; fused optimizers take float32, bfloat16 or "
                        "float16 parameters")
    if not p.is_leaf:
        raise ValueError("can't optimize a non-leaf Tensor")
    from ..ops.checks import is_dense
    if not is_dense(p):
        raise ValueError(f"{_name(gi, k, p)} with stride {p.stride()} is not dense: fused optimizers need each "
                         "parameter's elements in one gap-free block of memory (any dimension order)")


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


def check_lr(lr, where: str = "") -> None:
    """torch.optim's rule (a number >= 0, or a 1-element tensor), NaN refused too. A tensor's value is read
    only here, at construction or when a group is added or loaded, never in a step."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point():
            raise ValueError(f"Invalid learning rate: {lr}{where} (a tensor lr must be floating point)")
        if lr.device.type != "meta":
            value = float(lr.detach().reshape(()).cpu())
            if not value >= 0.0:
                raise ValueError(f"Invalid learning rate: {value}{where}")
        return
    if not _is_number(lr) or not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}{where}")


def check_step_lr(lr, where: str = "") -> None:
    """The per-step form of :func:`check_lr`: a tensor lr is not read (that would be a host sync)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element{where}")
        return
    if not _is_number(lr) or not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}{where}")


def check_max_grad_norm(v, where: str = "") -> None:
    if v is None:
        return
    if not _is_number(v) or not v > 0 or math.isinf(v):
        raise ValueError(f"Invalid max_grad_norm: {v}{where} (must be a positive finite number or None)")


def check_eps(eps, where: str = "") -> None:
    if not _is_number(eps) or not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}{where}")


def check_betas(betas, where: str = "") -> None:
    if isinstance(betas, Tensor) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}{where}")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor):
            raise ValueError(f"Invalid beta parameter at index {i}: fused optimizers take Python numbers for "
                             f"betas, got a tensor{where}")
        if not _is_number(b) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}{where}")


def check_weight_decay(wd, where: str = "") -> None:
    if not _is_number(wd) or not 0.0 <= wd or math.isinf(wd):
        raise ValueError(f"Invalid weight_decay value: {wd}{where}")


def check_momentum(momentum, dampening, nesterov, where: str = "") -> None:
    if not _is_number(momentum) or not 0.0 <= momentum or math.isinf(momentum):
        raise ValueError(f"Invalid momentum value: {momentum}{where}")
    if not _is_number(dampening) or math.isnan(dampening) or math.isinf(dampening):
        raise ValueError(f"Invalid dampening value: {dampening}{where}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"Nesterov momentum requires a momentum and zero dampening{where}")
