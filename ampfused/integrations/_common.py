"""What every framework integration shares: finding the fused optimizer behind a framework's wrapper, a
gradient clip folded into that optimizer's next step (after the scaler has unscaled, where there is one), and its
training-health numbers as the flat metrics a framework logs."""
from __future__ import annotations

import warnings
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import Tensor

from ..clip import clip_grad_norm_
from ..optim._segments import owner_of

# attributes under which frameworks keep the optimizer they wrap (accelerate: .optimizer, Lightning: ._optimizer)
_WRAPPED = ("optimizer", "_optimizer")


def fused_optimizer(optimizer) -> Optional[torch.optim.Optimizer]:
    """The ampfused fused optimizer ``optimizer`` is or wraps (through framework wrappers), else None."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        if getattr(optimizer, "_ampfused_fused", False) and hasattr(optimizer, "_ampfused_fold_clip_"):
            return optimizer
        seen.add(id(optimizer))
        optimizer = next((getattr(optimizer, a) for a in _WRAPPED if isinstance(getattr(optimizer, a, None),
                                                                               torch.optim.Optimizer)), None)
    return None


def health_metrics(optimizers: Sequence[torch.optim.Optimizer], prefix: str = "health") -> Dict[str, Tensor]:
    """The last step's training-health numbers of those of ``optimizers`` built with ``health=True`` (through
    framework wrappers), as flat metrics: ``{prefix}/group{i}/{name}`` per param group ``i`` (``{prefix}/opt{k}/
    group{i}/{name}`` where several optimizers have them), ``name`` each key of ``opt.health()`` and
    ``update_to_weight`` (the update's norm over the weights'; 0 for a group whose step updated nothing). Values
    are 0-d fp32 device tensors: nothing is read until the framework logs them."""
    fused = [f for f in (fused_optimizer(o) for o in optimizers) if f is not None and f.health_enabled]
    out: Dict[str, Tensor] = {}
    for k, opt in enumerate(fused):
        where = prefix if len(fused) == 1 else f"{prefix}/opt{k}"
        for gi, h in enumerate(opt.health()):
            for name, v in h.items():
                out[f"{where}/group{gi}/{name}"] = v.float()
            weight = h["weight_norm"]
            out[f"{where}/group{gi}/update_to_weight"] = h["update_norm"] / torch.where(weight > 0, weight, 1.0)
    return out


def _with_grads(params: Iterable[Tensor]) -> List[Tensor]:
    return [p for p in params if p.grad is not None]


def owning_optimizer(parameters: List[Tensor]):
    """The fused optimizer whose parameters with a gradient are exactly the given parameters with a gradient
    (parameters without one add nothing to the norm and are not clipped, so they do not matter), else None."""
    given = _with_grads(parameters)
    if not given:
        return None
    owner = owner_of(given[0])
    if owner is None or not hasattr(owner, "_ampfused_fold_clip_"):
        return None
    owned = {id(p) for g in owner.param_groups for p in g["params"] if p.grad is not None}
    return owner if {id(p) for p in given} == owned else None


def unscale_once(scaler, optimizer) -> None:
    """``scaler.unscale_(optimizer)`` unless this iteration already unscaled it (torch's scaler raises on a second
    call): a clip needs the unscaled norm."""
    if scaler is None or not getattr(scaler, "_enabled", False):
        return
    from torch.amp.grad_scaler import OptState
    if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


_warned: set = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def fold_clip(optimizer, max_norm: float, norm_type: float = 2.0, *, scaler=None, where: str) -> Tensor:
    """Clip the gradients of ``optimizer`` (an ampfused fused optimizer) to ``max_norm`` inside its next step and
    return their total norm (unscaled, before clipping), as ``clip_grad_norm_`` does. ``where`` names the caller
    in messages. A norm other than L2 cannot be folded: it is computed and applied by
    :func:`ampfused.clip_grad_norm_` in a pass of its own, with a warning."""
    max_norm = float(max_norm)
    if not max_norm >= 0:
        raise ValueError(f"{where}: max_norm must be a number >= 0 (inf only measures), got {max_norm}")
    unscale_once(scaler, optimizer)
    norm = optimizer._ampfused_fold_clip_(max_norm, float(norm_type))
    if norm is not None:
        return norm
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not _with_grads(params):
        return torch.tensor(0.0)
    if float(norm_type) != 2.0:
        warn_once(f"norm_type:{where}", f"{where}: norm_type={norm_type} cannot be folded into the fused step (it "
                   "folds the L2 norm only); the gradients are clipped in a pass of their own")
    return clip_grad_norm_(params, max_norm, norm_type)
