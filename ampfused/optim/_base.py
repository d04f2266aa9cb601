"""Shared machinery of the fused optimizers: validation, following the user's tensors, the two-kernel step.

The parameters are never touched by construction: they stay the user's tensors, in their own memory and
layout, and their gradients are read where backward (or a framework) put them. What the optimizer owns is
derived from them and kept in :class:`~ampfused.optim._segment.Segment` s (one per param group and dtype):
fp32 masters for fp16/bf16 parameters, the states in flat buffers, a step count per parameter.

Segments are built at the first step and follow the parameters from then on; each step's gradients are read
where they are, through ``ampfused._host``'s tables or the Python path. Both are the work of the optimizer's
:class:`~ampfused.optim._segments.Segments` (``self._segs``).

A step is then one ``norm_check`` over every gradient that exists (K1) and one update per segment (K2)
whose prologue reduces the partials, skips on non-finite gradients and folds unscale and clip into one
coefficient. Parameters whose ``.grad`` is ``None`` are skipped, as ``torch.optim`` skips them. Nothing is
read to the host.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .. import ops
from ..guard import SpikeGuard
from . import _params as P
from ._clip_state import ClipState, Owed
from ._segment import LOW_PRECISION, Segment, versions
from ._segments import _Batch, _host, _NO_GRAD, claim, Segments
from ._state import _StateMap, export_state_dict, import_state_dict, run_load_pre_hooks, state_dict_with_hooks
from ._step_call import hooked_step


def _append_flag(partials: Tensor, flag: Tensor) -> Tensor:
    """Partials with one more column ``[0, flag]``: a flag > 0 makes the update skip."""
    return torch.cat([partials, torch.stack([torch.zeros_like(flag), flag])[:, None]], 1)


def _on(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    return t if t is None or t.device == device else t.to(device, non_blocking=True)


class _Health:
    """The health sums of a fused optimizer's last step (``health=True``): an fp64 ``[segments, 5]`` buffer on the
    device (``HEALTH_FIELDS`` per row), each segment's K2 writing its row (``row(seg)``, read by ``_step_call``),
    and which param group each row belongs to."""

    def __init__(self):
        self.sums: Optional[Tensor] = None
        self.rows: Dict[int, Tensor] = {}
        self.groups: List[int] = []
        self.segments = None

    def row(self, seg) -> Optional[Tensor]:
        return self.rows.get(id(seg))

    def prepare(self, opt, batch: _Batch) -> None:
        """Rows for this step's segments (each step call writes its own; the rows of segments without a gradient,
        which make none, zeroed); the step's backends checked first: each must compute the sums
        (``computes_health``), on plain (not DTensor) parameters, eagerly."""
        segs = opt._segs
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{type(opt).__name__}(health=True): a compiled step does not compute the health "
                               "sums yet; compile the model and leave step() eager, or build it with health=False")
        if segs.shard_groups:
            raise RuntimeError(f"{type(opt).__name__}(health=True) with FSDP2 (DTensor) parameters: the per-group "
                               "sums are not reduced across ranks yet; build it with health=False")
        for si, seg in enumerate(segs.segments):
            if batch.segment_empty(si):
                continue
            if batch.tables:
                backend = batch.backend
            else:
                backend = ops.registry.get_backend(opt._backend_name(seg, batch.per_segment[si]))
            op = opt._op_for(opt.param_groups[seg.group_index])
            if not backend.computes_health(op):
                raise RuntimeError(f"{type(opt).__name__}(health=True): param_groups[{seg.group_index}] steps by "
                                   f"{op} on the {backend.name!r} backend, which does not compute the health sums "
                                   "yet; the 'reference' backend does (backend='reference')")
        device = opt._device
        if self.segments is not segs.segments or self.sums is None or self.sums.device != device:
            self.segments = segs.segments
            self.sums = torch.zeros(len(self.segments), 5, dtype=torch.float64, device=device)
            self.rows = {id(seg): self.sums[si] for si, seg in enumerate(self.segments)}
            self.groups = [seg.group_index for seg in self.segments]
        elif batch.empty:
            self.sums.zero_()
        else:
            for si in range(len(self.segments)):
                if batch.segment_empty(si):
                    self.sums[si].zero_()

    def per_group(self, num_groups: int, device: torch.device) -> List[Dict[str, Tensor]]:
        """The numbers of each param group from its segments' rows (device operations only)."""
        rows: List[List[Tensor]] = [[] for _ in range(num_groups)]
        for si, g in enumerate(self.groups):
            if g < num_groups:
                rows[g].append(self.sums[si].to(device))
        zero = torch.zeros(5, dtype=torch.float64, device=device)
        sums = torch.stack([r[0] if len(r) == 1 else torch.stack(r).sum(0) if r else zero for r in rows])
        norms = sums[:, :3].sqrt().float()
        counts = sums[:, 3:].to(torch.int64)
        return [dict(grad_norm=norms[g, 0], update_norm=norms[g, 1], weight_norm=norms[g, 2],
                     stagnant=counts[g, 0], nonfinite=counts[g, 1]) for g in range(num_groups)]


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the fused optimizers; subclasses define the state buffers and call the update op."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale / found_inf
    _ampfused_fused = True  # ampfused.GradScaler and clip_grad_norm_ use the hooks below
    state_names: tuple = ()
    takes_host_pass = True  # the step reads the host pass's tables (_step_op_table) when a backend takes them

    def __init__(self, params, defaults: dict, *, max_grad_norm: Optional[float], master_weights: Optional[bool],
                 backend: Optional[str], spike_guard: Optional[SpikeGuard] = None, track_nonfinite: bool = False,
                 module: Optional[torch.nn.Module] = None, health: bool = False):
        groups = P.normalise_groups(params)
        if health not in (True, False):
            raise TypeError(f"health must be True or False, got {health!r}")
        if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
            raise TypeError(f"spike_guard must be an ampfused.SpikeGuard, got {type(spike_guard).__name__}")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module (used to name parameters), got {type(module).__name__}")
        if master_weights not in (None, True, False):
            raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")
        P.check_max_grad_norm(max_grad_norm)
        defaults = dict(defaults, max_grad_norm=max_grad_norm)
        self._validate_group(defaults, "")
        if backend is not None:
            ops.registry.get_backend(backend)  # unknown names fail here, before anything changes
        self.master_weights = master_weights
        self._check_new_groups(groups, defaults, [])
        self.backend = backend
        self.spike_guard = spike_guard
        self.track_nonfinite = bool(track_nonfinite)
        self.health_enabled = bool(health)
        self._module_names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        self._init_internals()
        super().__init__(groups, defaults)
        self.state = _StateMap(dict)
        first = groups[0]["params"][0] if groups[0]["params"] else None
        first = first[1] if isinstance(first, tuple) else first
        self._make_device_tensors(first.device if isinstance(first, Tensor) else torch.device("cpu"))

    def _init_internals(self) -> None:
        self._segs = Segments()  # the segments, kept in line with the parameters, and the step's gradients
        self._clip_state = ClipState()  # what _ampfused_unscale_ and _ampfused_fold_clip_ leave to the step
        self._nonfinite: List[Tensor] = []
        self._calls = [0]  # step() calls that had gradients, since construction or load (a list: a compiled
        # step adds to it without setting an attribute of the optimizer)
        self._health = _Health()  # with health=True: the last step's health sums, one row per segment

    def _make_device_tensors(self, device: torch.device, old: Optional[dict] = None) -> None:
        """The small per-optimizer device tensors, on the parameters' device (moved along when it changes)."""
        f32 = dict(dtype=torch.float32, device=device)
        self._stats = torch.zeros(2, **f32)  # [norm, found_inf] of the last step
        self._one = torch.ones((), **f32)
        self._overflow = torch.zeros((), **f32)  # found_inf alone, when a guard runs
        self._steps_at_load = torch.zeros((), **f32)
        self._spikes_at_load = getattr(self, "_spikes_at_load", 0.0)
        if old:
            for name, t in old.items():
                getattr(self, name).copy_(t)
        if getattr(self, "spike_guard", None) is not None:
            self.spike_guard.to_(device)
        self._device = device

    # --- construction -------------------------------------------------------------------------------------
    def _check_new_groups(self, groups: List[dict], defaults: dict, existing: List[dict]) -> None:
        """Every rule for groups about to be added, checked before any of them is."""
        seen = {id(p) for g in existing for p in g["params"]}
        for gi, g in enumerate(groups, start=len(existing)):
            in_group = set()
            for k, p in enumerate(g["params"]):
                P.check_param(gi, k, p)
                p = p[1] if isinstance(p, tuple) else p
                if id(p) in seen:  # torch.optim's rule and message (a repeat inside a group only warns, there)
                    raise ValueError("some parameters appear in more than one parameter group")
                in_group.add(id(p))
                if self.master_weights is False and p.dtype in LOW_PRECISION:
                    raise ValueError(f"master_weights=False with a {p.dtype} parameter of shape {tuple(p.shape)}: "
                                     "low-precision parameters need fp32 master weights")
            seen |= in_group
            merged = dict(defaults, **{k: v for k, v in g.items() if k != "params"})
            self._validate_group(merged, f" in param_groups[{gi}]")
            P.check_lr(merged["lr"], f" in param_groups[{gi}]")

    def add_param_group(self, param_group: dict) -> None:
        group = P.normalise_group(param_group)
        if getattr(self, "_segs", None) is not None and hasattr(self, "defaults"):
            self._check_new_groups([group], self.defaults, self.param_groups)
        super().add_param_group(group)
        self._segs.add_group(self)

    def _validate_group(self, group: dict, where: str) -> None:  # subclasses check their hyperparameters
        P.check_step_lr(group["lr"], where)
        P.check_max_grad_norm(group.get("max_grad_norm"), where)

    # --- the step -----------------------------------------------------------------------------------------
    def _lr_tensor(self, seg: Segment) -> Tensor:
        lr = self.param_groups[seg.group_index]["lr"]
        if isinstance(lr, Tensor):
            if lr.device == seg.device and lr.dtype == torch.float32 and lr.dim() == 0:
                return lr
            seg.lr.copy_(lr.reshape(()))
        elif lr != seg.lr_value:  # only when the value changed: no work per step for a constant lr
            seg.lr.fill_(lr)
            seg.lr_value = lr
        return seg.lr

    def _check_hyperparameters(self) -> None:
        """Hyperparameters as they are now in ``param_groups`` (schedulers and users change them); a group
        whose values are those it had at its last check (tensors: the same tensor) is not checked again."""
        if torch.compiler.is_compiling():  # traced once per compilation: every group checked, nothing remembered
            for gi, group in enumerate(self.param_groups):
                self._validate_group(group, f" in param_groups[{gi}]")
                needed = self._state_names_for(group)
                missing = sorted({name for seg in self._segs.segments if seg.group_index == gi for name in needed
                                  if name not in seg.states})
                if missing:  # an eager step makes it (the segments are rebuilt, carrying their state)
                    raise RuntimeError(
                        f"param_groups[{gi}] now needs optimizer state it does not hold yet ({', '.join(missing)}: "
                        f"a hyperparameter such as momentum was switched on), which a compiled step cannot make: "
                        f"run one eager step() after the change, then the compiled one")
            return
        checked = self.__dict__.get("_checked_hyper")
        if checked is None:
            checked = self._checked_hyper = {}
        P.check_changed_groups(self.param_groups, checked, self._validate_and_provide)

    @torch.compiler.disable
    def _validate_and_provide(self, group: dict, where: str) -> None:
        """A changed group checked, and its segments rebuilt, carrying their state, when its step now reads a state
        they lack (SGD's momentum buffer once a scheduler or the loop switches momentum on). Eager only: a compiled
        step checks in _check_hyperparameters' compiling branch; where a step falls back to eager, dynamo may still
        trace the frames it calls, and torch 2.11's fails on this one's attribute writes to the optimizer (disabled,
        it runs eagerly)."""
        self._validate_group(group, where)
        needed = self._state_names_for(group)
        stale = {seg.group_index for seg in self._segs.segments if self.param_groups[seg.group_index] is group
                 and any(name not in seg.states for name in needed)}
        if stale:
            self._segs.repack(self, stale)

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

    def _partials_and_inv_scale(self, batch: _Batch, grad_divisor, owed: Owed):
        """Partials of the step's gradients and the coefficient that unscales them, all on the device.
        ``owed.coef``: the coefficient of a clip made on the gradients as they were before this step unscales
        them (see :meth:`_ampfused_fold_clip_`); it multiplies the unscale coefficient."""
        grad_scale = _on(getattr(self, "grad_scale", None), self._device)
        given_inv = _on(getattr(self, "_ampfused_inv_scale", None), self._device)  # ampfused.GradScaler's 1/scale
        found_inf = _on(getattr(self, "found_inf", None), self._device)
        if owed.partials is not None:
            # the gradients were measured (by a clip) or unscaled and measured already: the partials are theirs, and
            # a divisor given to this step divides what it reads (after a clip: clipped, then divided, as torch's
            # clip_grad_norm_ followed by a division of the gradients would)
            partials, inv_scale = owed.partials, self._divide(self._one, grad_divisor)
        else:
            if grad_scale is not None:
                # as torch's unscale_ forms it; ampfused.GradScaler hands it over already formed
                inv_scale = given_inv if given_inv is not None else grad_scale.double().reciprocal().float()
            else:
                inv_scale = self._one
            if owed.coef is not None:
                inv_scale = inv_scale * owed.coef
            inv_scale = self._divide(inv_scale, grad_divisor)
            partials = self._segs.k1("norm_check", batch, inv_scale, self.backend)
        if found_inf is not None:  # e.g. all-reduced across ranks by the training script
            partials = _append_flag(partials, found_inf.float())
        return partials, inv_scale

    @hooked_step
    def step(self, closure=None, *, grad_divisor=None, loss: Optional[Tensor] = None):
        """One fused step over every parameter that has a gradient. ``grad_divisor`` (number or device
        tensor) divides the gradients exactly, folded into the unscale coefficient, so the norm, clip and inf
        check see the normalised gradients. ``loss`` (a device tensor, never read) feeds the spike guard's
        loss rule."""
        self._check_divisor(grad_divisor)  # before anything changes
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_hyperparameters()
        batch = self._step_gradients()
        if self.health_enabled:
            self._health.prepare(self, batch)  # (refuses what cannot sum them, before anything changes)
        if batch.empty:  # no gradient at all: torch.optim does nothing either
            self._clip_state.reset()
            return loss
        owed = self._clip_state.consumed_by_step(batch.active, scaled=getattr(self, "grad_scale", None) is not None)
        partials, inv_scale = self._partials_and_inv_scale(batch, grad_divisor, owed)
        if self.track_nonfinite:
            self._count_nonfinite(batch)
        loss_t = loss if isinstance(loss, Tensor) else None
        guard = self.spike_guard
        lr_mult = None
        if guard is not None:
            partials, lr_mult, (norm, spike, overflow) = self._spike_check(partials, loss_t)
        self._update_segments(batch, partials, inv_scale, lr_mult, owed.max_norm)
        if guard is not None:
            guard.record_(norm, loss_t, spike, overflow > 0)
        self._calls[0] += 1
        return loss

    def _step_gradients(self) -> _Batch:
        """The step's gradients: from the host pass when nothing changed, else read after following the
        parameters."""
        segs = self._segs
        batch = segs.scan(self)
        if batch is None:
            segs.follow(self)
            batch = segs.collect(self)
        if segs.repeated:
            raise ValueError(segs.repeated)
        return batch

    def _spike_check(self, partials: Tensor, loss: Optional[Tensor]):
        """The spike guard's verdict, before any update: the partials K2 reads (a skip flag appended when the
        guard skips), the lr multiplier (when it scales the lr instead), and (norm, spike, overflow) for the
        guard's record once the step is done."""
        guard = self.spike_guard
        norm, overflow = ops.reduce_partials(partials)
        self._overflow.copy_(overflow)
        spike = guard.check(norm, loss)
        lr_mult = None
        if guard.action == "skip":
            partials = _append_flag(partials, spike.float())
        else:
            lr_mult = torch.where(spike, guard.lr_factor, 1.0).float()
        return partials, lr_mult, (norm, spike, overflow)

    def _update_segments(self, batch: _Batch, partials: Tensor, inv_scale: Tensor, lr_mult: Optional[Tensor],
                         folded_max_norm: Optional[float]) -> None:
        """K2 over every segment that has a gradient; ``folded_max_norm``: a clip folded into this step. Each
        segment's backend is resolved before any of them steps (a backend named that lacks a group's op is refused
        with nothing changed)."""
        self._check_shapes_now()
        backends = {} if batch.tables else {
            si: self._backend_name(seg, batch.per_segment[si]) for si, seg in enumerate(self._segs.segments)
            if not batch.segment_empty(si)}
        for si, seg in enumerate(self._segs.segments):
            if batch.segment_empty(si):
                continue
            group = self.param_groups[seg.group_index]
            max_norm = group["max_grad_norm"]
            max_norm = math.inf if max_norm is None else float(max_norm)
            if folded_max_norm is not None:
                max_norm = min(max_norm, folded_max_norm)
            lr = self._lr_tensor(seg)
            if lr_mult is not None:
                lr = lr * lr_mult
            if batch.tables:
                self._step_op_table(seg, batch.backend, group, partials, inv_scale, lr, max_norm)
                _host().bump(seg.params, seg.table_address, seg.record_address)
                if not seg.all_state:
                    self._segs.note_state(self, seg, [n != _NO_GRAD for n in seg.table[:, 2].tolist()])
            else:
                grads = batch.per_segment[si]
                self._update(seg, grads, group, partials, inv_scale, lr, max_norm, backends[si])
                if not torch.compiler.is_compiling():
                    seg.vers = versions(seg.tensors())
                if not seg.all_state:
                    self._segs.note_state(self, seg, [g is not None for g in grads])

    def _check_shapes_now(self) -> None:
        """A math class's refusal of parameter shapes its op cannot step (shapes changed in place since its groups
        were checked), before any segment steps; elementwise optimizers take any shape."""

    def _update(self, seg: Segment, grads: List[Optional[Tensor]], group: dict, partials: Tensor,
                inv_scale: Tensor, lr: Tensor, max_norm: float, backend: str) -> None:
        """K2 over one segment (the Python path) on ``backend``; ``_step_op`` is the subclass's op (AdamMath,
        SgdMath)."""
        self._step_op(seg, seg.tensors(), grads, group, partials, inv_scale, lr, max_norm, backend)

    def _backend_name(self, seg: Segment, grads: List[Optional[Tensor]]) -> str:
        return ops.step_backend(seg.device, ops._step_dtypes(seg.tensors(), grads, seg.master), self.backend,
                                self._op_for(self.param_groups[seg.group_index]))

    @property
    def last_grad_norm(self) -> Tensor:
        """0-d fp32 device tensor: norm of the unscaled gradients of the last step, before clipping."""
        return self._stats[0]

    @property
    def last_found_inf(self) -> Tensor:
        """0-d fp32 device tensor: 1.0 if the last step found non-finite gradients (what a scaler backs off on;
        a spike-guard skip is not an overflow)."""
        return self._overflow if self.spike_guard is not None else self._stats[1]

    @property
    def last_step_skipped(self) -> Tensor:
        """0-d bool device tensor: whether the last step changed nothing."""
        return self._stats[1] > 0

    def health(self) -> List[Dict[str, Tensor]]:
        """The last step's training-health numbers, one dict per param group (``docs/api.md``, "Training
        health"), each value a 0-d device tensor (no host read): ``grad_norm``, ``update_norm``, ``weight_norm``
        (fp32) and ``stagnant``, ``nonfinite`` (int64). Needs the optimizer built with ``health=True``."""
        if not self.health_enabled:
            raise RuntimeError(f"health() needs the optimizer built with health=True "
                               f"({type(self).__name__}(..., health=True))")
        return self._health.per_group(len(self.param_groups), self._device)

    def _steps_taken_now(self) -> Tensor:
        counts = [s.steps.max() for s in self._segs.segments if len(s)]
        return torch.stack(counts).max() if counts else self._one * 0

    def stats(self) -> Dict[str, Tensor]:
        """Counters as device tensors, to log every N steps without a sync per step (since construction or
        the last load_state_dict). ``steps`` counts the updates applied (to the most-updated parameter)."""
        taken = self._steps_taken_now().to(self._device) - self._steps_at_load
        spikes = self.spike_guard.spikes.float() - self._spikes_at_load if self.spike_guard is not None and \
            self.spike_guard._device is not None else torch.zeros_like(taken)
        skipped_spike = spikes if self.spike_guard is not None and self.spike_guard.action == "skip" else \
            torch.zeros_like(taken)
        return {"steps": taken, "skipped_overflow": self._calls[0] - taken - skipped_spike,
                "skipped_spike": skipped_spike, "spikes": spikes, "last_grad_norm": self.last_grad_norm}

    def _param_name(self, gi: int, p: Tensor, index: int) -> str:
        names = self.param_groups[gi].get("param_names")
        if names is not None:
            return names[index]
        return self._module_names.get(id(p), f"param_groups[{gi}]['params'][{index}] (shape {tuple(p.shape)})")

    def _count_nonfinite(self, batch: _Batch) -> None:
        """Per-parameter count of non-finite gradient elements (one extra read of the gradients; opt-in)."""
        self._nonfinite = []
        for seg, grads in zip(self._segs.segments, batch.per_segment):
            counts = [(~torch.isfinite(g)).sum() if g is not None else None for g in grads]
            self._nonfinite.append(counts)

    def nonfinite_report(self) -> Dict[str, int]:
        """Which parameters held infs or NaNs in the last step, and how many: ``{name: count}`` (reads to the
        host, only when asked). Needs ``track_nonfinite=True``."""
        if not self.track_nonfinite:
            raise RuntimeError("nonfinite_report() needs the optimizer built with track_nonfinite=True")
        report: Dict[str, int] = {}
        for seg, counts in zip(self._segs.segments, self._nonfinite):
            group = self.param_groups[seg.group_index]
            for p, c in zip(seg.params, counts):
                if c is not None and int(c):
                    idx = next(i for i, q in enumerate(group["params"]) if q is p)
                    report[self._param_name(seg.group_index, p, idx)] = int(c)
        return report

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``: gradients set to ``None`` (the default) or zeroed in place.
        Either way the next step reads whatever gradients backward produces, where it puts them; a clip folded
        into the next step belonged to the gradients zeroed here, and is dropped with them."""
        self._clip_state.reset()
        super().zero_grad(set_to_none)

    # --- hooks used by ampfused.GradScaler and ampfused.clip_grad_norm_ ------------------------------------
    def _ampfused_device(self) -> torch.device:
        """The device the optimizer's parameters (and so its gradients) are on now."""
        segs = self._segs
        if segs.segments and not len(segs.replaced):  # built: the first parameter tells (the step checks all)
            first = self.param_groups[0]["params"]
            if first and first[0].device == self._device:
                return self._device
        segs.follow(self)
        return self._device

    @torch.no_grad()
    def _ampfused_unscale_(self, inv_scale: Tensor, grad_divisor=None) -> Tensor:
        """Unscale the gradients in place (one pass), remember their norm, return found_inf."""
        self._check_divisor(grad_divisor)
        self._segs.follow(self)
        batch = self._segs.collect(self)
        inv_scale = self._divide(self._clip_state.unscale_coef(_on(inv_scale, self._device)), grad_divisor)
        if not batch.active:
            self._clip_state.unscaled(None, None)
            return self._one * 0
        partials = self._segs.k1("unscale_", batch, inv_scale, self.backend)
        self._clip_state.unscaled(batch.keys(), partials)
        return ops.reduce_partials(partials)[1]

    @torch.no_grad()
    def _ampfused_fold_clip_(self, max_norm: float, norm_type: float = 2.0,
                             error_if_nonfinite: bool = False) -> Optional[Tensor]:
        """Fold ``clip_grad_norm_(params, max_norm)`` into the next step; returns the total norm."""
        if float(norm_type) != 2.0:
            return None
        self._segs.follow(self)
        batch = self._segs.collect(self)
        if not batch.active:
            return None
        clip = self._clip_state
        if not clip.holds_partials_of(batch.active):
            clip.measured(batch.keys(), self._segs.k1("norm_check", batch, self._one, self.backend))
        norm = ops.reduce_partials(clip.partials)[0]
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        clip.clip_folded(norm, float(max_norm))
        return norm

    # --- state dicts (torch.optim layout; see _state.py) ---------------------------------------------------
    def state_dict(self) -> dict:
        def export(opt):
            opt._segs.follow(opt)
            return export_state_dict(opt)
        return state_dict_with_hooks(self, export)

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = run_load_pre_hooks(self, state_dict)
        self._segs.follow(self)
        self._import_state_dict(state_dict)
        self._steps_at_load.copy_(self._steps_taken_now())
        if self.spike_guard is not None:
            self.spike_guard.load_state_dict(state_dict.get("spike_guard", {}), self._device)
            self._spikes_at_load = float(self.spike_guard.spikes) if self.spike_guard._device is not None else 0.0
        self._calls[0] = 0
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _import_state_dict(self, state_dict: dict) -> None:
        import_state_dict(self, state_dict)

    def _export_param_state(self, st: dict, step: float, group: Optional[dict] = None) -> dict:
        out = {k: v for k, v in st.items() if k != "step"}
        out["step"] = torch.tensor(step, dtype=torch.float32)
        return out

    def _import_step(self, saved: dict) -> float:
        step = saved["step"]
        return float(step.item() if isinstance(step, Tensor) else step)

    def _state_keys_for_load(self, saved: dict, group: Optional[dict] = None):
        """The state keys a loaded parameter's entry must hold (``group``: the param group the parameter is in)."""
        return self.state_names

    def _state_names_for(self, group: dict) -> tuple:
        """The states a step of ``group`` reads: allocated by the first step that needs them."""
        return self.state_names

    def _use_master(self, dtype: torch.dtype) -> bool:
        """Whether parameters of ``dtype`` get an fp32 master."""
        return self.master_weights if self.master_weights is not None else dtype in LOW_PRECISION

    # --- copies and pickles -------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_checked_hyper", None)  # a memo of this process (tensor ids)
        state["_health"] = _Health()  # (rows keyed by segment ids: made again at the next step)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        old_clip = [state.pop(name, None) for name in ("_partials_cache", "_pending_clip", "_raw_clip")]
        if "_segments" in state:  # pickled when the segments were attributes of the optimizer
            state["_segs"] = Segments.from_fields(state.pop("_segments"), state.pop("_packed_groups", []),
                                                  state.pop("_repeated_params", None))
            for name in ("_replaced", "_shard_groups", "_table_memo"):
                state.pop(name, None)
        if "_segs" in state and "_clip_state" not in state:  # pickled when these were three attributes
            state["_clip_state"] = ClipState.from_fields(*old_clip)
        if "_segs" not in state:  # pickled by an older ampfused or by torch.optim.Optimizer.__getstate__
            self.__dict__.update(state)
            self._init_internals()
            self._make_device_tensors(torch.device("cpu"))
            self.__dict__.setdefault("master_weights", None)
            self.__dict__.setdefault("backend", None)
            self.__dict__.setdefault("spike_guard", None)
            self.__dict__.setdefault("track_nonfinite", False)
            self.__dict__.setdefault("_module_names", {})
            self._segs.packed = [None] * len(self.param_groups)
        else:
            self.__dict__.update(state)
        self.__dict__.setdefault("health_enabled", False)
        self.__dict__.setdefault("_health", _Health())
        super().__setstate__(dict(self.__dict__))
        for group in self.param_groups:  # pickled before the groups had torch's keys: torch's values for them
            for key, value in getattr(self, "torch_load_defaults", {}).items():
                group.setdefault(key, value)
        claim(self, [p for g in self.param_groups for p in g["params"]])
