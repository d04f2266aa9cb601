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
from ..guard import SpikeGuard
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
        ps = [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p for p in ps]
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


def _append_flag(partials: Tensor, flag: Tensor) -> Tensor:
    """Partials with one more column ``[0, flag]``: a flag > 0 makes the update skip."""
    return torch.cat([partials, torch.stack([torch.zeros_like(flag), flag])[:, None]], 1)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the fused optimizers; subclasses define the state buffers and call the update op."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale / found_inf
    _ampfused_fused = True  # ampfused.GradScaler and clip_grad_norm_ use the hooks below
    state_names: tuple = ()

    def __init__(self, params, defaults: dict, *, max_grad_norm: Optional[float], master_weights: Optional[bool],
                 backend: Optional[str], spike_guard: Optional[SpikeGuard] = None, track_nonfinite: bool = False,
                 module: Optional[torch.nn.Module] = None):
        groups = _check_params(params)
        if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
            raise TypeError(f"spike_guard must be an ampfused.SpikeGuard, got {type(spike_guard).__name__}")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module (used to name parameters), got {type(module).__name__}")
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
                    p = p[1] if isinstance(p, tuple) else p
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
        self.spike_guard = spike_guard
        self.track_nonfinite = bool(track_nonfinite)
        self._module_names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        self._nonfinite: List[Tensor] = []  # per segment: non-finite element count of each parameter
        self._calls = 0  # step() calls since construction or load (host counter; steps taken live on device)
        defaults = dict(defaults, max_grad_norm=max_grad_norm)
        super().__init__(groups, defaults)
        dev = self._segments[0].flat.device if self._segments else torch.device("cpu")
        self._stats = torch.zeros(2, dtype=torch.float32, device=dev)  # [norm, found_inf] of the last step
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self._overflow = torch.zeros((), dtype=torch.float32, device=dev)  # found_inf alone, when a guard runs
        self._steps_at_load = torch.zeros((), dtype=torch.float32, device=dev)
        self._spikes_at_load = 0.0  # spike-guard count when stats() started counting

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
            master = flat.data.to(torch.float32, copy=True) if use_master else None
            cd_like = master if master is not None else flat.data
            states = {name: torch.zeros_like(cd_like) for name in self.state_names}
            seg = _Segment(gi, flat, master, states)
            ends = flat.offsets[1:] + [flat.numel]
            seg.lengths = torch.tensor([e - o for o, e in zip(flat.offsets, ends)], device=flat.device)
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

    @staticmethod
    def _check_divisor(grad_divisor) -> None:
        if grad_divisor is None:
            return
        if isinstance(grad_divisor, Tensor):
            if grad_divisor.numel() != 1 or not grad_divisor.is_floating_point() and grad_divisor.dtype not in (
                    torch.int32, torch.int64):
                raise ValueError("grad_divisor must be a number or a 1-element float/int tensor, got "
                                 f"{grad_divisor.dtype} tensor of shape {tuple(grad_divisor.shape)}")
        elif isinstance(grad_divisor, bool) or not isinstance(grad_divisor, (int, float)) or not grad_divisor > 0 \
                or math.isinf(grad_divisor):
            raise ValueError(f"grad_divisor must be a positive finite number or a tensor, got {grad_divisor!r}")

    @staticmethod
    def _divide(inv_scale: Tensor, grad_divisor) -> Tensor:
        """Fold a gradient-accumulation divisor into the unscale coefficient (no extra pass)."""
        if grad_divisor is None:
            return inv_scale
        if isinstance(grad_divisor, Tensor):
            return inv_scale / grad_divisor.to(device=inv_scale.device, dtype=torch.float32).reshape(())
        return inv_scale / float(grad_divisor)

    def _partials_and_inv_scale(self, grad_divisor=None):
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
            inv_scale = self._divide(inv_scale, grad_divisor)
            partials = ops.norm_check(self._grad_buffers(), inv_scale, backend=self.backend)
        if found_inf is not None:  # e.g. all-reduced across ranks by the training script
            partials = _append_flag(partials, found_inf.float())
        return partials, inv_scale

    @torch.no_grad()
    def step(self, closure=None, *, grad_divisor=None, loss: Optional[Tensor] = None):
        """One fused step. ``grad_divisor`` (number or device tensor) divides the gradients exactly, folded
        into the unscale coefficient, so the norm, clip and inf check see the normalised gradients. ``loss``
        (a device tensor, never read) feeds the spike guard's loss rule."""
        self._check_divisor(grad_divisor)  # before anything changes
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._segments:
            return loss
        self._sync_grads()
        partials, inv_scale = self._partials_and_inv_scale(grad_divisor)
        if self.track_nonfinite:
            self._count_nonfinite()
        lr_mult = None
        guard = self.spike_guard
        if guard is not None:
            norm, overflow = ops.reduce_partials(partials)
            self._overflow.copy_(overflow)
            spike = guard.check(norm, loss if isinstance(loss, Tensor) else None)
            if guard.action == "skip":
                partials = _append_flag(partials, spike.float())
            else:
                lr_mult = torch.where(spike, guard.lr_factor, 1.0).float()
        pending, self._pending_clip = self._pending_clip, None
        for seg in self._segments:
            group = self.param_groups[seg.group_index]
            max_norm = group["max_grad_norm"]
            max_norm = math.inf if max_norm is None else float(max_norm)
            if pending is not None:
                max_norm = min(max_norm, pending)
            lr = self._lr_tensor(seg)
            self._update(seg, group, partials, inv_scale, lr if lr_mult is None else lr * lr_mult, max_norm)
        if guard is not None:
            guard.record_(norm, loss if isinstance(loss, Tensor) else None, spike, overflow > 0)
        self._calls += 1
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
        """0-d fp32 device tensor: 1.0 if the last step found non-finite gradients (what a scaler backs off on;
        a spike-guard skip is not an overflow)."""
        return self._overflow if self.spike_guard is not None else self._stats[1]

    def stats(self) -> Dict[str, Tensor]:
        """Counters as device tensors, to log every N steps without a sync per step (since construction or
        the last load_state_dict)."""
        taken = self._segments[0].step - self._steps_at_load if self._segments else self._one * 0
        spikes = self.spike_guard.spikes.float() - self._spikes_at_load if self.spike_guard is not None and \
            self.spike_guard._device is not None else torch.zeros_like(taken)
        skipped_spike = spikes if self.spike_guard is not None and self.spike_guard.action == "skip" else \
            torch.zeros_like(taken)
        return {"steps": taken, "skipped_overflow": self._calls - taken - skipped_spike,
                "skipped_spike": skipped_spike, "spikes": spikes, "last_grad_norm": self.last_grad_norm}

    def _param_name(self, gi: int, p: Tensor, index: int) -> str:
        names = self.param_groups[gi].get("param_names")
        if names is not None:
            return names[index]
        return self._module_names.get(id(p), f"param_groups[{gi}][{index}] {tuple(p.shape)}")

    def _count_nonfinite(self) -> None:
        """Per-parameter count of non-finite gradient elements (one extra read of the gradients; opt-in)."""
        self._nonfinite = []
        for seg in self._segments:
            bad = (~torch.isfinite(seg.flat.grad)).float()
            self._nonfinite.append(torch.segment_reduce(bad, "sum", lengths=seg.lengths))

    def nonfinite_report(self) -> Dict[str, int]:
        """Which parameters held infs or NaNs in the last step, and how many: ``{name: count}`` (reads to the
        host, only when asked). Needs ``track_nonfinite=True``."""
        if not self.track_nonfinite:
            raise RuntimeError("nonfinite_report() needs the optimizer built with track_nonfinite=True")
        report: Dict[str, int] = {}
        for seg, counts in zip(self._segments, self._nonfinite):
            group = self.param_groups[seg.group_index]
            for k, (p, c) in enumerate(zip(seg.flat.params, counts.tolist())):
                if c:
                    idx = [i for i, q in enumerate(group["params"]) if q is p][0]
                    report[self._param_name(seg.group_index, p, idx)] = int(c)
        return report

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
    def _ampfused_unscale_(self, inv_scale: Tensor, grad_divisor=None) -> Tensor:
        """Unscale the flat gradient buffers in place (one pass), remember their norm, return found_inf."""
        self._check_divisor(grad_divisor)
        self._sync_grads()
        inv_scale = self._divide(inv_scale, grad_divisor)
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
        sd = export_state_dict(self)
        if self.spike_guard is not None:  # an extra key: torch's optimizers ignore it on load
            sd["spike_guard"] = self.spike_guard.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        import_state_dict(self, state_dict)
        if self._segments:
            self._steps_at_load.copy_(self._segments[0].step)
            if self.spike_guard is not None:
                self.spike_guard.load_state_dict(state_dict.get("spike_guard", {}), self._segments[0].flat.device)
                self._spikes_at_load = float(self.spike_guard.spikes) if self.spike_guard._device is not None else 0.0
        self._calls = 0

    def _export_param_state(self, st: dict, step: float) -> dict:
        out = dict(st)
        out["step"] = torch.tensor(step, dtype=torch.float32)
        return out

    def _import_step(self, saved: dict) -> float:
        step = saved["step"]
        return float(step.item() if isinstance(step, Tensor) else step)

    def _state_keys_for_load(self, saved: dict):
        return self.state_names
