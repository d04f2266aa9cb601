"""``ampfused.GradScaler``: ``torch.amp.GradScaler`` with its hot paths routed through :mod:`ampfused.ops`.

Everything a training script can observe is torch's: the public methods and their return values, the
per-optimizer state machine (READY -> UNSCALED -> STEPPED, reset by ``update``), every error, the five
``state_dict`` keys, pickling, lazy creation of the scale, and the ``found_inf`` tensors that ``step`` reads
(scripts all-reduce them in place). What changes:

* ``unscale_`` runs :func:`ampfused.ops.unscale_`: fp32 gradients come out bit for bit as torch's kernel
  leaves them, and fp16/bf16 gradients are unscaled too (fp32 math, rounded back) where torch raises.
  The same pass measures the norm of the unscaled gradients, which :func:`ampfused.clip_grad_norm_` reuses.
* ``update`` runs the scale policy (:mod:`ampfused.policies`; the default is torch's rule, bit for bit, on
  :func:`ampfused.ops.update_scale_`) on the device, with no host read.
* Fused ampfused optimizers (``_ampfused_fused = True``) unscale the gradients where they live and check infs
  inside their first kernel, so ``step`` hands them the scale and skips torch's separate inf-check pass.

Additions (keyword-only, so torch's signatures are unchanged): ``policy``, ``min_scale``, ``max_scale`` and
``raise_at_min_scale`` on the constructor, ``grad_divisor`` on ``unscale_`` and ``step``, and ``stats()``.
"""
from __future__ import annotations

import warnings
import weakref
from collections import abc, defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from . import ops
from ._scaler_checks import (check_backoff_factor, check_growth_factor, check_growth_interval, check_outputs,
                             check_scale_value, checked_divisor, checked_state_dict, fold_divisor)
from .clip import _remember_norm
from .policies import (DynamicPolicy, MinScaleError, ScalePolicy, _bound, _DeviceState, make_scale_policy,
                       policy_key)

__all__ = ["GradScaler", "OptState"]

_UNSCALABLE_MSG = "GradScaler unscales floating-point gradients only (float32, bfloat16, float16, float64)"
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _param_grads(optimizer) -> List[Tensor]:
    """The gradients ``unscale_`` works on, validated in full before any of them is touched."""
    grads = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, param in enumerate(group["params"]):
            if not isinstance(param, Tensor):
                raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")  # torch's
            g = param.grad
            if g is None:
                continue
            if g.dtype not in _GRAD_DTYPES:
                raise TypeError(f"optimizer.param_groups[{gi}]['params'][{pi}] (shape {tuple(param.shape)}) has a "
                                f"{g.dtype} gradient: {_UNSCALABLE_MSG}")
            grads.append(param)
    return grads


def _dense_views(params: List[Tensor]) -> Dict[torch.device, List[Tensor]]:
    """Per device, the dense tensors holding the gradient values (``_values()`` of sparse gradients)."""
    by_device: Dict[torch.device, List[Tensor]] = defaultdict(list)
    for p in params:
        if p.grad.is_sparse:
            # duplicate indices of an uncoalesced fp16 gradient could overflow once summed, so check the
            # coalesced values (torch does the same)
            if p.grad.dtype is torch.float16:
                p.grad = p.grad.coalesce()
            t = p.grad._values()
        else:
            t = p.grad
        by_device[t.device].append(t)
    return by_device


def _identity(t: Tensor) -> tuple:
    """What tells a tensor's values changed: its memory and its version counter (every write bumps it)."""
    return t.data_ptr(), t._version


def _on(t: Tensor, device: torch.device) -> Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


def _read_together(tensors: List[Tensor]) -> List[float]:
    """0-d tensors (on one device) read to the host in one transfer; fp64 keeps fp32 scales and int counts
    exact (fp32 where the device has no fp64)."""
    wide = torch.float32 if tensors[0].device.type == "mps" else torch.float64
    return torch.stack([t.to(wide) for t in tensors]).tolist()


# optimizer -> (group sizes, device): a fused step must not walk every parameter each iteration
_FUSED_DEVICES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fused_device(optimizer, default: torch.device) -> torch.device:
    """The one device of a fused optimizer's parameters (its kernels run on one device). ampfused's own
    optimizers say it themselves, after following any move of their parameters."""
    own = getattr(optimizer, "_ampfused_device", None)
    if callable(own):
        return own()
    sizes = tuple(len(g["params"]) for g in optimizer.param_groups)
    known = _FUSED_DEVICES.get(optimizer)
    if known is not None and known[0] == sizes:
        return known[1]
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(f"{type(optimizer).__name__} is a fused optimizer with parameters on several devices "
                         f"({', '.join(sorted(map(str, devices)))}); a fused optimizer's gradients must be on one "
                         "device")
    device = devices.pop() if devices else default
    _FUSED_DEVICES[optimizer] = (sizes, device)
    return device


class GradScaler(torch.amp.GradScaler):
    """Drop-in for ``torch.amp.GradScaler`` (same arguments, methods, errors and ``state_dict``).

    Extra keyword-only arguments:

    * ``backend``: the :mod:`ampfused.ops` backend to use (``None`` picks the best available one; a named
      backend that cannot run raises instead of falling back).
    * ``policy``: the rule that moves the scale, a registered name (``"dynamic"``, the default and torch's
      rule bit for bit; ``"hysteresis"``, ``"static"``, ``"aggressive"``, or one added with
      :func:`ampfused.register_scale_policy`) or a :class:`ampfused.ScalePolicy` instance (for options). The
      scaler's ``growth_factor``, ``backoff_factor`` and ``growth_interval`` are handed to it at every update.
    * ``min_scale`` / ``max_scale``: bounds every policy keeps the scale in (also accepted by the policy;
      given in both places they must agree). ``init_scale`` must lie within them.
    * ``raise_at_min_scale``: raise :class:`ampfused.policies.MinScaleError` once an iteration overflows
      while the scale already sits at ``min_scale`` and the policy asks for a lower one. Detected on the
      device in ``update()``; raised at the next host read the loop already makes: ``get_scale()``,
      ``state_dict()``, pickling, or ``step()`` of an optimizer whose skip the scaler decides on the host
      (plain torch optimizers). Fused optimizers' ``step`` and every ``update`` stay free of host reads, so
      with them the error waits for the next ``get_scale()``/``state_dict()``. Raised once per occurrence.

    Also unscales fp16 and bf16 gradients, keeps the gradient norm measured while unscaling for
    :func:`ampfused.clip_grad_norm_`, drives ampfused's fused optimizers without an extra pass, folds a
    gradient-accumulation divisor into the unscale (``grad_divisor``), and counts steps on the device
    (:meth:`stats`).
    """

    _backend: Optional[str] = None  # class defaults, so instances pickled before the attributes existed load
    _raise_at_min_scale: bool = False
    _updates: int = 0
    _at_min_reported: int = 0

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 backend: Optional[str] = None, policy: Any = "dynamic", min_scale: Optional[float] = None,
                 max_scale: Optional[float] = None, raise_at_min_scale: bool = False) -> None:
        if backend is not None:
            ops.get_backend(backend)  # an unknown name fails here, naming the registered backends
        pol, bounds = self._checked_policy(policy, min_scale, max_scale, raise_at_min_scale)
        if enabled and device == "cuda" and torch.cuda.amp.common.amp_definitely_not_available():
            # torch's warning, raised here so that it points at the caller's line rather than at this file
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
            enabled = False
        # Called by name, not via super(): ampfused.cuda.amp.GradScaler also derives from
        # torch.cuda.amp.GradScaler (for isinstance checks), whose __init__ takes no device argument.
        # torch raises its own AssertionErrors here for growth_factor <= 1 and backoff_factor >= 1.
        torch.amp.GradScaler.__init__(self, device, init_scale, growth_factor, backoff_factor, growth_interval,
                                      enabled)
        self._backend = backend
        if self._enabled:  # torch checks nothing more; the rest are checked like any ampfused entry
            self._init_scale = check_scale_value("init_scale", init_scale, allow_zero=False)
            self._growth_factor = check_growth_factor("growth_factor", growth_factor)
            self._backoff_factor = check_backoff_factor("backoff_factor", backoff_factor)
            self._growth_interval = check_growth_interval("growth_interval", growth_interval)
            lo, hi = bounds
            if (lo is not None and self._init_scale < lo) or (hi is not None and self._init_scale > hi):
                raise ValueError(f"init_scale ({init_scale}) must lie within [min_scale, max_scale] = [{lo}, {hi}]")
        pol.set_bounds(min_scale=bounds[0], max_scale=bounds[1])
        pol._bound_to_scaler = True
        self._policy = pol
        self._raise_at_min_scale = raise_at_min_scale
        self._reset_counters()

    @staticmethod
    def _checked_policy(policy, min_scale, max_scale, raise_at_min_scale):
        pol = make_scale_policy(policy)
        if pol._bound_to_scaler:
            raise ValueError(f"policy: this {type(pol).__name__} instance already drives another GradScaler; "
                             "give each scaler its own instance (or a name)")
        bounds = []
        for name, given in (("min_scale", min_scale), ("max_scale", max_scale)):
            mine, theirs = _bound(name, given), getattr(pol, name)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"{name}={given} given to GradScaler differs from the policy's {name}={theirs}; "
                                 "give it in one place")
            bounds.append(mine if mine is not None else theirs)
        if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
            raise ValueError(f"min_scale ({bounds[0]}) must be <= max_scale ({bounds[1]})")
        if not isinstance(raise_at_min_scale, bool):
            raise TypeError(f"raise_at_min_scale must be a bool, got {type(raise_at_min_scale).__name__}")
        if raise_at_min_scale and bounds[0] is None:
            raise ValueError("raise_at_min_scale=True needs min_scale (on the scaler or its policy): the error "
                             "fires when the scale sits at min_scale and still overflows")
        return pol, tuple(bounds)

    @property
    def policy(self) -> ScalePolicy:
        """The :class:`ampfused.ScalePolicy` instance that moves the scale."""
        pol = self.__dict__.get("_policy")
        if pol is None:  # an instance pickled before policies existed
            pol = self.__dict__["_policy"] = DynamicPolicy()
            pol._bound_to_scaler = True
        return pol

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.pop("_inv", None)  # formed again from the scale when needed
        state.pop("_inv_of", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_counters" not in self.__dict__:  # pickled before the counters existed
            self._reset_counters()

    def _reset_counters(self) -> None:
        counters = _DeviceState()
        counters.add("skipped", 0, torch.int64)  # update() calls whose gradients overflowed
        counters.add("at_min", 0, torch.int64)  # of those, overflows at min_scale that asked for less
        self._counters = counters
        self._updates = 0
        self._at_min_reported = 0

    # --- scale ----------------------------------------------------------------------------------------
    def scale(self, outputs):
        """Multiply a tensor, or (nested) lists/tuples/iterables of tensors, by the current scale."""
        if self._enabled:
            check_outputs(outputs)
        return super().scale(outputs)

    # --- 1 / scale --------------------------------------------------------------------------------------
    def _inv_buffer(self, scale: Tensor) -> Tensor:
        inv = self.__dict__.get("_inv")
        if inv is None or inv.device != scale.device:
            inv = self._inv = torch.empty((), dtype=torch.float32, device=scale.device)
            self._inv_of = None
        return inv

    def _inv_scale(self) -> Tensor:
        """``fp32(1 / fp64(scale))`` (torch's unscale factor) as a device tensor. The dynamic rule writes it in
        the scale update's own kernel; it is formed here only when the scale changed some other way (a policy,
        ``update(new_scale)``, ``load_state_dict``)."""
        scale = self._scale
        inv = self._inv_buffer(scale)
        if self.__dict__.get("_inv_of") != _identity(scale):
            inv.copy_(scale.double().reciprocal().float())
            self._inv_of = _identity(scale)
        return inv

    # --- unscale --------------------------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer, *, grad_divisor=None) -> None:
        """Divide the optimizer's gradients by the scale in place (fp32, bf16, fp16 and fp64 gradients) and
        record, per device, whether any was non-finite. Also measures the unscaled gradients' norm.

        ``grad_divisor`` (a positive number or a 1-element device tensor, e.g. the token count of the
        accumulated micro-batches) divides the gradients too, folded into the same coefficient
        (``inv_scale / grad_divisor`` in fp32), so the norm, a clip and the inf check see the normalised
        gradients. With the scaler disabled, ``grad_divisor`` still divides the gradients."""
        divisor = checked_divisor(grad_divisor)
        if not self._enabled:
            if divisor is not None:
                self._divide_only_(optimizer, divisor)
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # the reciprocal is taken in fp64, as torch does, so 1/scale is the correctly rounded fp32 value
        inv_scale = self._inv_scale() if self._scale.device.type != "mps" else self._scale.reciprocal()
        if getattr(optimizer, "_ampfused_fused", False):
            found_inf = self._fused_unscale(optimizer, _on(inv_scale, _fused_device(optimizer, inv_scale.device)),
                                            divisor)
            if not (isinstance(found_inf, Tensor) and found_inf.dim() == 0):
                raise TypeError("a fused optimizer's _ampfused_unscale_ must return a 0-d found_inf tensor, got "
                                f"{type(found_inf).__name__}")
            state["found_inf_per_device"] = {found_inf.device: found_inf}
        else:
            found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, fold_divisor(inv_scale, divisor),
                                                                 found_inf, True)
        state["stage"] = OptState.UNSCALED

    @staticmethod
    def _fused_unscale(optimizer, inv_scale: Tensor, divisor) -> Tensor:
        if divisor is None:  # the one-argument call keeps optimizers written before grad_divisor working
            return optimizer._ampfused_unscale_(inv_scale)
        return optimizer._ampfused_unscale_(inv_scale, grad_divisor=divisor)

    def _divide_only_(self, optimizer, divisor) -> None:
        """A disabled scaler's ``grad_divisor``: divide the gradients, nothing else."""
        if getattr(optimizer, "_ampfused_fused", False):
            device = _fused_device(optimizer, torch.device("cpu"))
            self._fused_unscale(optimizer, torch.ones((), dtype=torch.float32, device=device), divisor)
            return
        params = _param_grads(optimizer)
        if params:
            device = divisor.device if isinstance(divisor, Tensor) else params[0].grad.device
            one = torch.ones((), dtype=torch.float32, device=device)
            self._per_device(optimizer, fold_divisor(one, divisor), write=True)

    def _unscale_grads_(self, optimizer, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool) -> Dict[torch.device, Tensor]:
        """torch's private unscale (its tests and FSDP's ShardedGradScaler call it): one
        :func:`ampfused.ops.unscale_` per device over every gradient dtype. ``inv_scale`` and ``found_inf`` are
        1-element tensors (0-d or not, as torch takes them); ``found_inf`` is set to 1.0 where a gradient on its
        device is non-finite and is the flag returned for that device (flags for other devices are new tensors
        of its shape). Returns ``{device: flag}``; ``allow_fp16=False`` refuses fp16 gradients as torch does."""
        for name, t in (("inv_scale", inv_scale), ("found_inf", found_inf)):
            if not isinstance(t, Tensor) or t.numel() != 1 or not t.is_floating_point():
                raise ValueError(f"{name} must be a 1-element floating-point tensor, got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if not allow_fp16 and any(p.grad.dtype == torch.float16 for p in _param_grads(optimizer)):
            raise ValueError("Attempting to unscale FP16 gradients.")
        flags = self._per_device(optimizer, inv_scale.reshape(()).float(), write=True)
        out: Dict[torch.device, Tensor] = {}
        for device, flag in flags.items():
            if device == found_inf.device:
                found_inf.copy_(torch.where(flag.reshape(found_inf.shape) > 0, 1.0, found_inf))
                out[device] = found_inf
            else:
                out[device] = flag.to(found_inf.dtype).reshape(found_inf.shape)
        return out

    def _check_inf_per_device(self, optimizer) -> Dict[torch.device, Tensor]:
        """Inf check of still-scaled gradients, for optimizers that unscale inside their own step (torch's
        ``_step_supports_amp_scaling``). Reads the gradients without writing them back."""
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        one = torch.full((), 1.0, dtype=torch.float32, device=_scale.device)
        per_device = self._per_device(optimizer, one, write=False)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return per_device

    @torch.no_grad()
    def _per_device(self, optimizer, inv_scale: Tensor, write: bool) -> Dict[torch.device, Tensor]:
        params = _param_grads(optimizer)
        dense = not any(p.grad.is_sparse for p in params)
        by_device = _dense_views(params)
        op = ops.unscale_ if write else ops.norm_check
        found: Dict[torch.device, Tensor] = {}
        partials: Dict[torch.device, Tensor] = {}
        for device, grads in by_device.items():
            partials[device] = op(grads, _on(inv_scale, device), backend=self._backend)
            found[device] = ops.reduce_partials(partials[device])[1]
        # The values of an uncoalesced sparse gradient do not give its norm, so only dense sets are kept.
        if write and dense and params:
            _remember_norm([p.grad for p in params], partials)
        return found

    # --- step -----------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, grad_divisor=None, **kwargs: Any):
        """``optimizer.step(*args, **kwargs)`` unless the gradients held infs/NaNs; returns its return value.

        A fused ampfused optimizer always runs its step: it gets the scale (``grad_scale``) or the flag from an
        earlier ``unscale_`` (``found_inf``) and skips the update on the device when the gradients overflowed.

        ``grad_divisor`` (see :meth:`unscale_`) is for a step not preceded by ``unscale_``: a fused optimizer
        gets it as ``step(grad_divisor=...)``; for any other optimizer the scaler unscales with it first.
        After ``unscale_`` it is an error (the gradients were already unscaled: give it to ``unscale_``).
        """
        divisor = checked_divisor(grad_divisor)
        fused = getattr(optimizer, "_ampfused_fused", False)
        if not self._enabled:
            if divisor is not None:
                if fused:
                    return optimizer.step(*args, grad_divisor=divisor, **kwargs)
                self._divide_only_(optimizer, divisor)
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if divisor is not None and state["stage"] is OptState.UNSCALED:
            raise ValueError("grad_divisor was given to step() after unscale_() already unscaled this optimizer's "
                             "gradients; give it to unscale_(optimizer, grad_divisor=...) instead")
        if not fused:
            if divisor is not None:
                self.unscale_(optimizer, grad_divisor=divisor)
            return super().step(optimizer, *args, **kwargs)
        if divisor is not None:
            kwargs["grad_divisor"] = divisor
        device = _fused_device(optimizer, self._scale.device)
        unscaled = state["stage"] is OptState.UNSCALED
        # the scaler's own tensor when the devices agree (the usual case), else a copy on the optimizer's
        optimizer.grad_scale = None if unscaled else _on(self._scale, device)
        # its reciprocal as well, already formed (no kernels for it in the optimizer's step)
        optimizer._ampfused_inv_scale = None if unscaled or self._scale.device.type == "mps" else _on(
            self._inv_scale(), device)
        optimizer.found_inf = self._combined_found_inf(state, device) if unscaled else None
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
            del optimizer._ampfused_inv_scale
        found_inf = optimizer.last_found_inf  # the optimizer's own check, made inside its first kernel
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.STEPPED
        return retval

    def _combined_found_inf(self, state: dict, device: torch.device) -> Tensor:
        flags = list(state["found_inf_per_device"].values())
        if len(flags) == 1:
            return flags[0]  # the very tensor a script may have all-reduced in place
        return torch.stack([_on(f, device) for f in flags]).sum()

    def _maybe_opt_step(self, optimizer, optimizer_state: dict, *args: Any, **kwargs: Any):
        """torch's host-side skip decision; with ``raise_at_min_scale`` the same read also fetches the
        count of overflows at ``min_scale`` (one transfer), so a pending error surfaces here."""
        at_min = self._counters.tensors.get("at_min") if self._raise_at_min_scale else None
        flags = list(optimizer_state["found_inf_per_device"].values())
        if at_min is None or not flags:
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        *found, count = _read_together([_on(f, at_min.device) for f in flags] + [at_min])
        self._raise_if_at_min(count)
        return None if sum(found) else optimizer.step(*args, **kwargs)

    # --- update ---------------------------------------------------------------------------------------
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Run the scale policy on this iteration's combined inf flag (back off / count towards growth, as the
        policy says), clamp into ``[min_scale, max_scale]``, count the iteration for :meth:`stats`; or set
        the scale to ``new_scale`` as torch does (outside the policy and its bounds, and not counted).
        On the device, with no host read."""
        if not self._enabled or new_scale is not None:
            return super().update(new_scale)
        scale, tracker = self._check_scale_growth_tracker("update")
        flags = [_on(f, scale.device) for state in self._per_optimizer_states.values()
                 for f in state["found_inf_per_device"].values()]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        # summed out of place: torch adds into the first flag, which may be a tensor the script still holds
        found_inf = (flags[0] if len(flags) == 1 else torch.stack([f.float() for f in flags]).sum()).float()
        policy = self.policy
        policy.configure(growth_factor=self._growth_factor, backoff_factor=self._backoff_factor,
                         growth_interval=self._growth_interval, backend=self._backend)
        skipped = self._counters.get("skipped", scale.device)
        if type(policy) is DynamicPolicy and policy.min_scale is None and policy.max_scale is None:
            # torch's rule, the next unscale's 1/scale and the overflow count in one kernel
            # the scaler's own tensors (checked when made or loaded) and found_inf formed above as a 0-d fp32
            # tensor on the scale's device: the op without its per-call checks (each backend keeps its own)
            found_inf = found_inf if found_inf.dim() == 0 else found_inf.reshape(())
            ops.call_update_scale_(scale, tracker, found_inf, self._growth_factor, self._backoff_factor,
                                   self._growth_interval, self._inv_buffer(scale), skipped, self._backend)
            self._inv_of = _identity(scale)
            at_min = None
        else:
            at_min = policy.apply_(scale, tracker, found_inf)
            skipped.add_(found_inf > 0)
        if at_min is not None:
            self._counters.get("at_min", scale.device).add_(at_min)
        self._updates += 1
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _raise_if_at_min(self, count: float) -> None:
        if count > self._at_min_reported:
            new, self._at_min_reported = int(count) - self._at_min_reported, int(count)
            raise MinScaleError(
                f"the loss scale sits at min_scale={self.policy.min_scale} and the gradients still overflow "
                f"({new} such iteration(s) since the last check): a smaller scale cannot fix this. Look for a "
                "non-finite loss, bad data or a too high learning rate. (Raised because raise_at_min_scale=True; "
                "the overflowing steps were skipped.)")

    # --- host reads -------------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (a host read). With ``raise_at_min_scale``, the same read
        fetches the count of overflows at ``min_scale`` and raises :class:`MinScaleError` for new ones."""
        at_min = self._counters.tensors.get("at_min") if self._raise_at_min_scale else None
        if not self._enabled or at_min is None or self._scale is None:
            return super().get_scale()
        scale, count = _read_together([self._scale, _on(at_min, self._scale.device)])
        self._raise_if_at_min(count)
        return scale

    def stats(self) -> Dict[str, Tensor]:
        """A snapshot of the scaler's state as 0-d device tensors, to log every N steps without a sync per
        step (``{}`` when disabled). Counts run since construction or the last ``load_state_dict``:

        * ``scale`` (fp32), ``growth_tracker`` (int32): as ``get_scale()`` / the ``state_dict`` would read;
        * ``steps``: ``update()`` calls whose gradients were finite (iterations whose steps were taken);
        * ``skipped_overflow``: ``update()`` calls after an overflow (iterations whose steps were skipped);
        * ``min_scale_overflows`` (with ``min_scale``): of those, overflows at ``min_scale`` that asked for a
          lower scale;
        * ``policy.<state>``: the policy's state (e.g. ``policy.overflows`` of ``"hysteresis"``).
        """
        if not self._enabled:
            return {}
        if self._scale is not None:
            device = self._scale.device
            scale, tracker = self._scale.clone(), self._growth_tracker.clone()
        else:
            device = torch.device(self._device)
            scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        counts = self._counters.snapshot(device)
        out = {"scale": scale, "growth_tracker": tracker, "steps": self._updates - counts["skipped"],
               "skipped_overflow": counts["skipped"]}
        if self.policy.min_scale is not None:
            out["min_scale_overflows"] = counts["at_min"]
        out.update({f"policy.{k}": v for k, v in self.policy.stats(device).items()})
        return out

    # --- hyperparameters and state --------------------------------------------------------------------
    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = check_growth_factor("new_factor (growth factor)", new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = check_backoff_factor("new_factor (backoff factor)", new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = check_growth_interval("new_interval (growth interval)", new_interval)

    def state_dict(self) -> Dict[str, Any]:
        """torch's five entries, plus the policy's state as plain numbers under ``"policy.<name>.<state>"``
        (none for ``"dynamic"``). ``torch.amp.GradScaler.load_state_dict`` ignores the extra keys."""
        sd = super().state_dict()
        if sd:
            name = policy_key(self.policy)
            for key, value in self.policy.state_dict().items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"{type(self.policy).__name__}.state_dict()[{key!r}] must be an int or float "
                                    f"(saved as a plain number), got {type(value).__name__}")
                sd[f"policy.{name}.{key}"] = value
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler``; every entry is checked first.
        Policy state missing from it (a state dict of torch's, or of another policy) takes its defaults; a
        loaded scale outside ``[min_scale, max_scale]`` is clamped into it. Resets the :meth:`stats` counts."""
        if self._enabled and not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if not (self._enabled and len(state_dict) != 0):
            return super().load_state_dict(state_dict)
        checked = checked_state_dict(state_dict)
        policy = self.policy
        lo, hi = policy.min_scale, policy.max_scale
        checked["scale"] = min(max(checked["scale"], lo if lo is not None else 0.0),
                               hi if hi is not None else checked["scale"])
        policy.load_state_dict(self._policy_entries(state_dict))
        super().load_state_dict(checked)
        self._reset_counters()

    def _policy_entries(self, sd) -> Dict[str, Any]:
        prefix = f"policy.{policy_key(self.policy)}."
        others = sorted({k.split(".")[1] for k in sd if isinstance(k, str) and k.startswith("policy.")
                         and not k.startswith(prefix) and k.count(".") >= 2})
        if others:
            warnings.warn(f"state_dict holds state of the scale policy {others[0]!r} but this GradScaler uses "
                          f"{policy_key(self.policy)!r}: that state is not loaded (the scale, growth tracker and "
                          "factors are)", stacklevel=3)
        return {k[len(prefix):]: v for k, v in sd.items() if isinstance(k, str) and k.startswith(prefix)}
