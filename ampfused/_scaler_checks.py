"""Argument checks of :class:`ampfused.GradScaler`: each error names the argument and the rule it broke, and
every check runs before anything changes."""
from __future__ import annotations

import math
import numbers
from collections import abc
from typing import Any, Dict, Optional, Union

import torch
from torch import Tensor

_OUTPUTS_MSG = "outputs must be a Tensor or an iterable of Tensors"  # torch's message
_DIVISOR_DTYPES = (torch.int32, torch.int64)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_growth_factor(name: str, value) -> float:
    v = _number(name, value)
    if not (v > 1.0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 1.0, got {value}")
    return v


def check_backoff_factor(name: str, value) -> float:
    v = _number(name, value)
    if not 0.0 < v < 1.0:
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value}")
    return v


def check_growth_interval(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_scale_value(name: str, value, *, allow_zero: bool) -> float:
    v = _number(name, value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        rule = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {rule}, got {value}")
    return v


def check_outputs(outputs) -> None:
    """Reject what ``scale`` cannot multiply before the scale tensor is created. Lists and tuples are checked
    all the way down; other iterables stay lazy (torch returns a lazy ``map`` for them)."""
    if isinstance(outputs, Tensor):
        return
    # a str is an iterable of str, which torch's recursion would follow forever
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, abc.Iterable):
        raise ValueError(_OUTPUTS_MSG)
    if isinstance(outputs, (list, tuple)):
        for item in outputs:
            check_outputs(item)


def checked_state_dict(sd) -> Dict[str, Any]:
    """torch's five entries, each checked; other keys are left to the caller."""
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        if key not in sd:
            raise KeyError(f"GradScaler state_dict is missing the key {key!r}")
    tracker = sd["_growth_tracker"]
    if isinstance(tracker, bool) or not isinstance(tracker, numbers.Integral) or tracker < 0:
        raise ValueError(f"state_dict['_growth_tracker'] must be an int >= 0, got {tracker!r}")
    return {
        "scale": check_scale_value("state_dict['scale']", sd["scale"], allow_zero=True),
        "growth_factor": check_growth_factor("state_dict['growth_factor']", sd["growth_factor"]),
        "backoff_factor": check_backoff_factor("state_dict['backoff_factor']", sd["backoff_factor"]),
        "growth_interval": check_growth_interval("state_dict['growth_interval']", sd["growth_interval"]),
        "_growth_tracker": int(tracker),
    }


def checked_divisor(value) -> Optional[Union[float, Tensor]]:
    """``grad_divisor``: ``None``, a positive finite number, or a 1-element float/int32/int64 tensor (whose
    value is not checked: that would read it to the host)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or not (value.is_floating_point() or value.dtype in _DIVISOR_DTYPES):
            raise ValueError("grad_divisor must be a positive finite number or a 1-element float/int tensor, got a "
                             f"{value.dtype} tensor of shape {tuple(value.shape)}")
        return value.detach()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"grad_divisor must be a positive finite number or a 1-element tensor, got "
                        f"{type(value).__name__}")
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"grad_divisor must be a positive finite number or a 1-element tensor, got {value!r}")
    return v


def fold_divisor(inv_scale: Tensor, divisor: Union[float, Tensor, None]) -> Tensor:
    """``inv_scale / divisor`` in fp32 on ``inv_scale``'s device: the same coefficient a fused optimizer
    forms from ``grad_divisor``, so both paths divide the gradients identically."""
    if divisor is None:
        return inv_scale
    if isinstance(divisor, Tensor):
        return inv_scale / divisor.to(device=inv_scale.device, dtype=torch.float32).reshape(())
    return inv_scale / divisor
