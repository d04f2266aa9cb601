"""Input validation shared by every op entry: each rule names the tensor and what it broke.

All checks run before any backend is called, so bad input never leaves state half-updated.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tensor(name: str, t, *, dtypes: Sequence[torch.dtype] = FLOATS, device: Optional[torch.device] = None,
           numel: Optional[int] = None, flat: bool = False, scalar: bool = False) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if scalar and t.dim() != 0:
        raise ValueError(f"{name} must be a 0-d tensor, got shape {tuple(t.shape)}")
    if flat:
        if t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D flat buffer, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a flat buffer), got stride {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements like param, got {t.numel()}")


def grads_list(name: str, grads, device: torch.device) -> None:
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(grads).__name__}")
    for i, g in enumerate(grads):
        tensor(f"{name}[{i}]", g, dtypes=FLOATS, device=device)


def scalars(**kw) -> None:
    """Python numbers: each must be a finite float (``max_norm`` may be inf)."""
    for k, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{k} must be a Python number, got {type(v).__name__}")
        if math.isnan(v) or (math.isinf(v) and k != "max_norm"):
            raise ValueError(f"{k} must be finite, got {v}")


def compute_dtype_of(param: Tensor, master: Optional[Tensor]) -> torch.dtype:
    return master.dtype if master is not None else param.dtype


def step_inputs(param: Tensor, grad: Tensor, master: Optional[Tensor], states: Iterable[tuple],
                step: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor) -> None:
    """Shared rules of the optimizer-step ops (see ``reference`` for the layout)."""
    tensor("param", param, flat=True)
    dev, n = param.device, param.numel()
    tensor("grad", grad, flat=True, device=dev, numel=n)
    if master is not None:
        tensor("master", master, dtypes=(torch.float32, torch.float64), flat=True, device=dev, numel=n)
    elif param.dtype in LOW_PRECISION:
        raise ValueError(f"param has dtype {param.dtype}: a {param.dtype} parameter needs an fp32 master "
                         "buffer (pass master=...)")
    cd = compute_dtype_of(param, master)
    for sname, s in states:
        tensor(sname, s, dtypes=(cd,), flat=True, device=dev, numel=n)
    tensor("step", step, dtypes=(torch.float32, torch.float64), device=dev, scalar=True)
    tensor("inv_scale", inv_scale, dtypes=(torch.float32,), device=dev, scalar=True)
    tensor("lr", lr, dtypes=(torch.float32, torch.float64), device=dev, scalar=True)
    tensor("partials", partials, dtypes=(torch.float32,), device=dev)
    if partials.dim() != 2 or partials.shape[0] != 2:
        raise ValueError(f"partials must have shape [2, P], got {tuple(partials.shape)}")
    tensor("out_stats", out_stats, dtypes=(torch.float32,), device=dev, numel=2)
    if not out_stats.is_contiguous():
        raise ValueError("out_stats must be contiguous")
