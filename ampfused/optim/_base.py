"""Shared machinery of the fused optimizers: validation, flat segments, the two-kernel step, state dicts.

A *segment* is the parameters of one param group that share a dtype: one FlatBuffer, one fp32 master buffer
(when master weights are used), one flat buffer per optimizer state, one step counter and one lr tensor, all
on the device. A step is: one ``norm_check`` over every segment's gradients (K1), then one update op per
segment (K2) whose prologue reduces the partials, skips on non-finite gradients and folds unscale and clip
into one coefficient. Nothing is read to the host.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .. import ops
from ..flat import FlatBuffer
from ._state import export_state_dict, import_state_dict

LOW_PRECISION = (torch.bfloat16, torch.float16)


class _Segment:
    def __init__(self, group_index: int, flat: FlatBuffer, master: Optional[Tensor], states: Dict[str, Tensor]):
        self.group_index = group_index
        self.flat = flat
        self.master = master
        self.states = states
        device = flat.device
        self.step = torch.zeros((), dtype=torch.float32, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_value: Any = None  # the Python value last written into self.lr


def _check_params(params) -> List[dict]:
    """Normalise ``params`` to a list of group dicts and validate every parameter before anything changes."""
    if isinstance(params, Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        f"but got {torch.typename(params)}")
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen = set()
    device = None
    for gi, g in enumerate(groups):
        ps = g["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        for p in ps:
            name = f"param_groups[{gi}] parameter of shape {tuple(p.shape)}" if isinstance(p, Tensor) else ""
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
            if p.is_sparse or p.layout != torch.strided:
                raise TypeError(f"{name} is sparse ({p.layout}); fused optimizers need dense parameters")
            if not p.is_floating_point() or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"{name} has dtype {p.dtype}; fused optimizers take float32, bfloat16 or float16 "
                                "parameters")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
            if id(p) in seen:
                raise ValueError(f"{name} appears more than once in the parameters; each parameter may be "
                                 "given once")
            seen.add(id(p))
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"{name} is on {p.device} but other parameters are on {device}; a fused "
                                 "optimizer takes parameters on one device")
    return groups


def _check_lr(lr) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        return
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0.0 <= lr or math.isnan(lr):
        raise ValueError(f"Invalid learning rate: {lr}")


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the fused optimizers; subclasses define the state buffers and call the update op."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale / found_inf
    _ampfused_fused = True  # ampfused.GradScaler and clip_grad_norm_ use the hooks below
    state_names: tuple = ()

    def __init__(self, params, defaults: dict, *, max_grad_norm: Optional[float], master_weights: Optional[bool],
                 backend: Optional[str]):
        groups = _check_params(params)
        _check_lr(defaults["lr"])
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm > 0 or math.isinf(max_grad_norm)):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be a positive finite number or None)")
        for g in groups:
            if "lr" in g:
                _check_lr(g["lr"])
        if master_weights is False:
            for g in groups:
                for p in ([g["params"]] if isinstance(g["params"], Tensor) else g["params"]):
                    if p.dtype in LOW_PRECISION:
                        raise ValueError(f"master_weights=False with a {p.dtype} parameter of shape "
                                         f"{tuple(p.shape)}: low-precision parameters need fp32 master weights")
        if backend is not None:
            ops.registry.get_backend(backend)  # unknown names fail here, before anything changes
        self.master_weights = master_weights
        self.backend = backend
        self._segments: List[_Segment] = []
        self._partials_cache = None  # (partials, grad versions) left by _ampfused_unscale_ / fold clip
        self._pending_clip: Optional[float] = None
        defaults = dict(defaults, max_grad_norm=max_grad_norm)
        super().__init__(groups, defaults)
        dev = self._segments[0].flat.device if self._segments else torch.device("cpu")
        self._stats = torch.zeros(2, dtype=torch.float32, device=dev)  # [norm, found_inf] of the last step
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self._inv_scale = torch.ones((), dtype=torch.float32, device=dev)

    # --- construction -------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        self._validate_group(group)
        by_dtype: Dict[torch.dtype, List[Tensor]] = {}
        for p in group["params"]:
            if p.numel():
                by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, ps in by_dtype.items():
            flat = FlatBuffer(ps)
            use_master = self.master_weights if self.master_weights is not None else dtype in LOW_PRECISION
            master = flat.data.float() if use_master else None
            cd_like = master if master is not None else flat.data
            states = {name: torch.zeros_like(cd_like) for name in self.state_names}
            seg = _Segment(gi, flat, master, states)
            self._segments.append(seg)
            owner = weakref.ref(self)
            for p, *views in zip(ps, *(flat.views(t) for t in states.values()),
                                 *([flat.views(master)] if master is not None else [])):
                p._ampfused_owner = owner
                st = dict(zip(self.state_names, views[:len(self.state_names)]))
                if master is not None:
                    st["master_param"] = views[-1]
                st["step"] = seg.step
                self.state[p] = st

    def _validate_group(self, group: dict) -> None:  # subclasses check their hyperparameters
        _check_lr(group["lr"])

    # --- the step -----------------------------------------------------------------------------------------
    def _grad_buffers(self) -> List[Tensor]:
        return [s.flat.grad for s in self._segments]

    def _versions(self) -> tuple:
        return tuple(g._version for g in self._grad_buffers())

    def _sync_grads(self) -> None:
        for s in self._segments:
            s.flat.sync_grads()

    def _lr_tensor(self, seg: _Segment) -> Tensor:
        lr = self.param_groups[seg.group_index]["lr"]
        if isinstance(lr, Tensor):
            if lr.device == seg.lr.device and lr.dtype == torch.float32 and lr.dim() == 0:
                return lr
            seg.lr.copy_(lr.reshape(()))
        elif lr != seg.lr_value:  # only when the value changed: no work per step for a constant lr
            seg.lr.fill_(lr)
            seg.lr_value = lr
        return seg.lr

    def _partials_and_inv_scale(self):
        """Partials of the step's gradients and the coefficient that unscales them, all on the device."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        cache, self._partials_cache = self._partials_cache, None
        if cache is not None and grad_scale is None and cache[1] == self._versions():
            partials, inv_scale = cache[0], self._one  # gradients were unscaled (and measured) already
        else:
            if grad_scale is not None:
                inv_scale = grad_scale.double().reciprocal().float()  # as torch's unscale_ forms it
            else:
                inv_scale = self._one
            partials = ops.norm_check(self._grad_buffers(), inv_scale, backend=self.backend)
        if found_inf is not None:  # e.g. all-reduced across ranks by the training script
            partials = torch.cat([partials, torch.stack([torch.zeros_like(found_inf), found_inf.float()])[:, None]], 1)
        return partials, inv_scale

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._segments:
            return loss
        self._sync_grads()
        partials, inv_scale = self._partials_and_inv_scale()
        pending, self._pending_clip = self._pending_clip, None
        for seg in self._segments:
            group = self.param_groups[seg.group_index]
            max_norm = group["max_grad_norm"]
            max_norm = math.inf if max_norm is None else float(max_norm)
            if pending is not None:
                max_norm = min(max_norm, pending)
            self._update(seg, group, partials, inv_scale, self._lr_tensor(seg), max_norm)
        return loss

    def _update(self, seg: _Segment, group: dict, partials: Tensor, inv_scale: Tensor, lr: Tensor,
                max_norm: float) -> None:
        raise NotImplementedError

    @property
    def last_grad_norm(self) -> Tensor:
        """0-d fp32 device tensor: norm of the unscaled gradients of the last step, before clipping."""
        return self._stats[0]

    @property
    def last_found_inf(self) -> Tensor:
        """0-d fp32 device tensor: 1.0 if the last step was skipped for non-finite gradients."""
        return self._stats[1]

    @property
    def last_step_skipped(self) -> Tensor:
        """0-d bool device tensor: whether the last step changed nothing."""
        return self._stats[1] > 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers in place (one fill each). ``set_to_none`` is accepted for
        compatibility; the gradients stay views into the flat buffer so backward writes straight into it."""
        for s in self._segments:
            s.flat.zero_grad()

    # --- hooks used by ampfused.GradScaler and ampfused.clip_grad_norm_ ------------------------------------
    @torch.no_grad()
    def _ampfused_unscale_(self, inv_scale: Tensor) -> Tensor:
        """Unscale the flat gradient buffers in place (one pass), remember their norm, return found_inf."""
        self._sync_grads()
        partials = ops.unscale_(self._grad_buffers(), inv_scale, backend=self.backend)
        self._partials_cache = (partials, self._versions())
        return ops.reduce_partials(partials)[1]

    @torch.no_grad()
    def _ampfused_fold_clip_(self, max_norm: float, norm_type: float = 2.0,
                             error_if_nonfinite: bool = False) -> Optional[Tensor]:
        """Fold ``clip_grad_norm_(params, max_norm)`` into the next step; returns the total norm."""
        if float(norm_type) != 2.0 or not self._segments:
            return None
        self._sync_grads()
        cache = self._partials_cache
        if cache is None or cache[1] != self._versions():
            cache = (ops.norm_check(self._grad_buffers(), self._one, backend=self.backend), self._versions())
            self._partials_cache = cache
        norm = ops.reduce_partials(cache[0])[0]
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        self._pending_clip = float(max_norm) if self._pending_clip is None else min(self._pending_clip, float(max_norm))
        return norm

    # --- state dicts (torch.optim layout; see _state.py) ---------------------------------------------------
    def state_dict(self) -> dict:
        return export_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        import_state_dict(self, state_dict)

    def _export_param_state(self, st: dict, step: float) -> dict:
        out = dict(st)
        out["step"] = torch.tensor(step, dtype=torch.float32)
        return out

    def _import_step(self, saved: dict) -> float:
        step = saved["step"]
        return float(step.item() if isinstance(step, Tensor) else step)

    def _state_keys_for_load(self, saved: dict):
        return self.state_names
