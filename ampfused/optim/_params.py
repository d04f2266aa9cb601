"""Checks of what users hand a fused optimizer: parameter lists and hyperparameters.

Every rule raises before anything changes, with torch.optim's message where torch has one, else one that
names the parameter (or group and key) and the rule. Hyperparameters are checked at construction, in
``add_param_group``, in ``load_state_dict`` and again before every step, since schedulers and users change
them through ``param_groups`` between steps.
"""
from __future__ import annotations

import math
import operator
from typing import Callable, List

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = (float, int, bool, str, type(None))  # hyperparameter values that cannot change in place
_is = operator.is_


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


def _finite(v) -> bool:
    """Neither inf nor NaN, by arithmetic alone: a hyperparameter that changes between compiled steps reaches the
    step's checks as a symbolic float under torch.compile, which ``math.isinf`` refuses."""
    return v - v == 0  # inf - inf and NaN - NaN are NaN


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
    if not _is_number(v) or not v > 0 or not _finite(v):
        raise ValueError(f"Invalid max_grad_norm: {v}{where} (must be a positive finite number or None)")


def check_eps(eps, where: str = "") -> None:
    if not _is_number(eps) or not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}{where}")


def squeeze_betas(betas):
    """``betas`` as torch keeps them: a tuple, 1-element tensors squeezed to 0-d (as ``torch.optim``'s
    ``_to_scalar`` does)."""
    if isinstance(betas, Tensor) or not hasattr(betas, "__len__") or len(betas) != 2:
        return betas
    return tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() != 0 else b for b in betas)


_DEVICE_VALUES = WeakIdKeyDictionary()  # device tensor hyperparameter -> (its _version, value read)


def hyper_value(t, name: str) -> float:
    """A hyperparameter's value as a Python float. A CPU tensor is read where it is (no device involved); a
    device tensor is read once per change of its version counter (an in-place edit is seen, at the cost of
    one read where it happens) and the value is remembered, so a step with an unchanged tensor reads nothing."""
    if not isinstance(t, Tensor):
        return float(t)
    if t.device.type == "cpu":
        return float(t.detach().reshape(()))
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (it holds no value)")
    seen = _DEVICE_VALUES.get(t)
    if seen is None or seen[0] != t._version:
        seen = (t._version, float(t.detach().reshape(()).cpu()))
        _DEVICE_VALUES[t] = seen
    return seen[1]


def check_betas(betas, where: str = "", *, foreach=None, capturable=False) -> None:
    """torch.optim.Adam's rules, in its order and with its messages: two numbers in [0, 1), or two 1-element
    tensors (read as :func:`hyper_value` reads them)."""
    if isinstance(betas, Tensor) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}{where}")
    tensors = [isinstance(b, Tensor) for b in betas]
    for i, b in enumerate(betas):
        if isinstance(b, Tensor):
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element{where}")
            if not b.is_floating_point():
                raise ValueError(f"Invalid beta parameter at index {i}: {b}{where} (a tensor beta must be "
                                 "floating point)")
            value = hyper_value(b, f"betas[{i}]")
        elif _is_number(b):
            value = b
        else:
            raise ValueError(f"Invalid beta parameter at index {i}: {b!r}{where}")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}{where}")
    if tensors[0] != tensors[1]:
        raise ValueError(f"betas must be either both floats or both Tensors{where}")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and foreach and not capturable:
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True{where}")


def check_foreach_lr(lr, foreach, capturable) -> None:
    """torch.optim.Adam refuses a tensor lr with ``foreach=True, capturable=False`` (its foreach kernels cannot
    take one); ampfused ignores ``foreach`` but refuses the same combination, so a script behaves the same with
    either optimizer."""
    if isinstance(lr, Tensor) and foreach and not capturable:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")


def check_impl_flags(foreach, fused, differentiable) -> None:
    """torch.optim's rules for its implementation flags (ampfused accepts and ignores them otherwise)."""
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_weight_decay(wd, where: str = "") -> None:
    if not _is_number(wd) or not 0.0 <= wd or not _finite(wd):
        raise ValueError(f"Invalid weight_decay value: {wd}{where}")


def check_momentum(momentum, dampening, nesterov, where: str = "") -> None:
    if not _is_number(momentum) or not 0.0 <= momentum or not _finite(momentum):
        raise ValueError(f"Invalid momentum value: {momentum}{where}")
    if not _is_number(dampening) or not _finite(dampening):
        raise ValueError(f"Invalid dampening value: {dampening}{where}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"Nesterov momentum requires a momentum and zero dampening{where}")


def _hyper_key(v):
    if isinstance(v, Tensor):
        return ("tensor", id(v), v._version)
    if isinstance(v, (list, tuple)):
        return tuple(_hyper_key(x) for x in v)
    return v


def check_changed_groups(groups: List[dict], checked: dict, validate: Callable[[dict, str], None]) -> None:
    """``validate(group, where)`` for each group whose hyperparameters are not those it had at its last check
    (``checked``: group index -> what was seen then, kept here). A group whose keys and values are the very
    objects of its last check, none of which can change in place (numbers, strings, tuples of them), is passed
    over without a look at its items; otherwise a list is compared by a copy of its items, tensors (alone or in
    a tuple or list) by identity and version counter: comparing tensors by value could read a device tensor."""
    for gi, group in enumerate(groups):
        last = checked.get(gi)
        if last is not None and last[0] is not None and len(group) == len(last[0]) and \
                all(map(_is, group, last[0])) and all(map(_is, group.values(), last[1])):
            continue
        key = [(k, _hyper_key(v)) for k, v in group.items() if k != "params"]
        if last is None or last[2] != key:
            validate(group, f" in param_groups[{gi}]")
        plain = all(type(v) in _PLAIN or type(v) is tuple and all(type(x) in _PLAIN for x in v)
                    for k, v in group.items() if k != "params")
        checked[gi] = (tuple(group) if plain else None, tuple(group.values()), key)
