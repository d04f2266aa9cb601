"""Shared machinery of the fused optimizers: validation, following the user's tensors, the two-kernel step.

The parameters are never touched by construction: they stay the user's tensors, in their own memory and
layout, and their gradients are read where backward (or a framework) put them. What the optimizer owns is
derived from them and kept in :class:`~ampfused.optim._segment.Segment` s (one per param group and dtype):
fp32 masters for fp16/bf16 parameters, the states in flat buffers, a step count per parameter.

Segments are built at the first step (or ``load_state_dict`` / ``state_dict``), from the parameters as they
are then: a model loaded, cast or moved to its device after the optimizer was built is what gets trained.
Before every later step a host check compares each parameter's address and version counter with what the
segment recorded after its own last write (no pass over the weights). ``ampfused._host`` makes that check and
writes the step's tensor tables in one C++ pass per segment (:meth:`FusedOptimizer._scan`); whatever it finds
changed, or cannot read in place, sends the step through the Python path below, which follows it:

* same place and layout, new version (``load_state_dict``, ``nn.init``, ``p.copy_``, ``p.mul_``) or new
  place, same layout (``p.data = t``, ``share_memory``): the master is kept where it still rounds to every
  value of the parameter, else rebuilt from the parameter's values (decided on the device, no host read);
* new dtype, device, shape or strides (``model.to(...)``, ``.half()``, ``channels_last``), or a group's
  parameter list changed: the group's segments are rebuilt and every state follows its parameter (moments
  and step counts moved, masters kept or rebuilt by the same rule, created or dropped as the new dtype
  needs). A change that cannot be followed (parameters now on several devices) raises first.

A step is then one ``norm_check`` over every gradient that exists (K1) and one update per segment (K2)
whose prologue reduces the partials, skips on non-finite gradients and folds unscale and clip into one
coefficient. Parameters whose ``.grad`` is ``None`` are skipped, as ``torch.optim`` skips them. Nothing is
read to the host.
"""
from __future__ import annotations

import math
import operator
import os
import weakref
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import _native, ops
from ..guard import SpikeGuard
from ..ops.checks import same_layout
from . import _params as P
from ._segment import LOW_PRECISION, Segment, addresses, build_segment, is_dtensor, layout_of, local, versions
from ._state import export_state_dict, import_state_dict, run_load_pre_hooks, state_dict_with_hooks

_is = operator.is_

# parameter -> weak reference to the fused optimizer that owns it (clip_grad_norm_ folds into that one's step)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def owner_of(p: Tensor):
    """The fused optimizer holding ``p``, or None."""
    ref = _OWNERS.get(p)
    return ref() if ref is not None else None


def _on_parameter_registered(module: torch.nn.Module, name: str, param) -> None:
    """A Parameter assigned into a module (``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``)
    replaces the one a fused optimizer holds: that optimizer trains the new one from its next step on."""
    old = module._parameters.get(name) if name in module._parameters else None
    if old is None or param is None or old is param:
        return
    opt = owner_of(old)
    if opt is not None:
        opt._replaced[old] = param


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)


_NO_GRAD = -1  # the numel column of a table row without a gradient (step_args.h)


def _host():
    """ampfused._host, or None where it is not built (the step then runs its Python path)."""
    global _HOST
    if _HOST is False:
        try:
            _HOST = _native.module("host")
        except ImportError:
            _HOST = None
    return _HOST


_HOST: Any = False


def _shard_groups(params) -> tuple:
    """For FSDP2 parameters (DTensors), the process groups of the mesh dimensions they are sharded over (the
    norm's partial sums are summed over these; replicated dimensions hold the same values and are not);
    ``()`` for plain parameters. ``params``: ``(group index, index, parameter)`` of every parameter."""
    dts = [(gi, k, p) for gi, k, p in params if is_dtensor(p)]
    if not dts:
        return ()
    name = lambda gi, k, p: f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)})"
    if len(dts) != len(params):
        plain = next(e for e in params if not is_dtensor(e[2]))
        raise ValueError(f"{name(*plain)} is a plain tensor but {name(*dts[0])} is a DTensor: a fused optimizer's "
                         "parameters must all be sharded (fully_shard the root module too) or none of them")
    gi0, k0, p0 = dts[0]
    mesh, placements = p0.device_mesh, tuple(p0.placements)
    for gi, k, p in dts[1:]:
        if p.device_mesh != mesh or tuple(p.placements) != placements:
            raise ValueError(f"{name(gi, k, p)} is placed {tuple(p.placements)} on {p.device_mesh} but "
                             f"{name(gi0, k0, p0)} is placed {placements} on {mesh}: a fused optimizer needs one "
                             "mesh and one placement for all its DTensor parameters (the global norm is summed "
                             "over the sharded dimensions)")
    if any(not (pl.is_shard() or pl.is_replicate()) for pl in placements):
        raise ValueError(f"{name(gi0, k0, p0)} is placed {placements}: fused optimizers take sharded or replicated "
                         "DTensor parameters (FSDP2), not partial ones")
    return tuple(mesh.get_group(d) for d, pl in enumerate(placements) if pl.is_shard())


def _append_flag(partials: Tensor, flag: Tensor) -> Tensor:
    """Partials with one more column ``[0, flag]``: a flag > 0 makes the update skip."""
    return torch.cat([partials, torch.stack([torch.zeros_like(flag), flag])[:, None]], 1)


def _on(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    return t if t is None or t.device == device else t.to(device, non_blocking=True)


class ParamState(dict):
    """``optimizer.state[p]``: views of the fused optimizer's buffers. Assigning a tensor to one of its keys
    (as frameworks do when they move optimizer state between devices) copies the values into the buffer, so
    the optimizer keeps using what was assigned."""

    def __setitem__(self, key, value):
        mine = self.get(key)
        if isinstance(mine, Tensor) and isinstance(value, Tensor) and value is not mine:
            mine, value = local(mine), local(value)  # a sharded parameter's state: this rank's shard
            if value.numel() != mine.numel():
                raise ValueError(f"optimizer state '{key}' must keep {mine.numel()} elements, got a tensor of shape "
                                 f"{tuple(value.shape)}")
            with torch.no_grad():
                mine.copy_(value.reshape(mine.shape))
            return
        super().__setitem__(key, value)

    def _bind(self, values: Dict[str, Tensor]) -> None:
        for k, v in values.items():
            dict.__setitem__(self, k, v)


class _StateMap(defaultdict):
    """``optimizer.state``: replacing a parameter's whole state dict copies its tensors into the buffers."""

    def __setitem__(self, key, value):
        mine = self.get(key)
        if isinstance(mine, ParamState) and isinstance(value, dict) and value is not mine:
            for k, v in value.items():
                mine[k] = v
            return
        super().__setitem__(key, value)


class _Batch:
    """The gradients of one step: per segment a list with ``None`` for parameters without one, all of them
    (what K1 reads) and their dtype names. Or, from the host pass (``tables``): the segments' tensor tables
    hold the gradients, with ``counts`` of them per segment and ``chunks`` K1 chunks in all, for ``backend``."""

    __slots__ = ("per_segment", "active", "dtypes", "tables", "counts", "chunks", "backend")

    def __init__(self):
        self.per_segment: List[List[Optional[Tensor]]] = []
        self.active: List[Tensor] = []
        self.dtypes: tuple = ()
        self.tables = False
        self.counts: List[int] = []
        self.chunks = 0
        self.backend = None

    @property
    def empty(self) -> bool:
        return not any(self.counts) if self.tables else not self.active

    def segment_empty(self, si: int) -> bool:
        return self.counts[si] == 0 if self.tables else all(g is None for g in self.per_segment[si])

    def keys(self) -> List[tuple]:
        """What identifies these gradients as they are now (a cached norm stays valid while they match)."""
        return [(g, g._version) for g in self.active]


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the fused optimizers; subclasses define the state buffers and call the update op."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale / found_inf
    _ampfused_fused = True  # ampfused.GradScaler and clip_grad_norm_ use the hooks below
    state_names: tuple = ()

    def __init__(self, params, defaults: dict, *, max_grad_norm: Optional[float], master_weights: Optional[bool],
                 backend: Optional[str], spike_guard: Optional[SpikeGuard] = None, track_nonfinite: bool = False,
                 module: Optional[torch.nn.Module] = None):
        groups = P.normalise_groups(params)
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
        self._module_names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        self._init_internals()
        super().__init__(groups, defaults)
        self.state = _StateMap(dict)
        first = groups[0]["params"][0] if groups[0]["params"] else None
        first = first[1] if isinstance(first, tuple) else first
        self._make_device_tensors(first.device if isinstance(first, Tensor) else torch.device("cpu"))

    def _init_internals(self) -> None:
        self._replaced = WeakIdKeyDictionary()  # parameter -> the Parameter a module now holds in its place
        self._segments: List[Segment] = []
        self._packed_groups: List[Optional[List[Tensor]]] = []  # per group: its params as last packed
        self._partials_cache = None  # (grad keys, partials) left by _ampfused_unscale_ / fold clip
        self._pending_clip: Optional[float] = None
        self._nonfinite: List[Tensor] = []
        self._calls = 0  # step() calls that had gradients, since construction or load
        self._shard_groups: tuple = ()  # FSDP2: the process groups the gradients' norm and flags are summed over

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
            for k, p in enumerate(g["params"]):
                P.check_param(gi, k, p)
                p = p[1] if isinstance(p, tuple) else p
                if id(p) in seen:
                    raise ValueError("some parameters appear in more than one parameter group"
                                     if any(p is q for e in existing for q in e["params"]) else
                                     f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}) appears more "
                                     "than once in the parameters; each parameter may be given once")
                seen.add(id(p))
                if self.master_weights is False and p.dtype in LOW_PRECISION:
                    raise ValueError(f"master_weights=False with a {p.dtype} parameter of shape {tuple(p.shape)}: "
                                     "low-precision parameters need fp32 master weights")
            merged = dict(defaults, **{k: v for k, v in g.items() if k != "params"})
            self._validate_group(merged, f" in param_groups[{gi}]")
            P.check_lr(merged["lr"], f" in param_groups[{gi}]")

    def add_param_group(self, param_group: dict) -> None:
        group = P.normalise_group(param_group)
        if getattr(self, "_segments", None) is not None and hasattr(self, "defaults"):
            self._check_new_groups([group], self.defaults, self.param_groups)
        super().add_param_group(group)
        owner = weakref.ref(self)
        for p in self.param_groups[-1]["params"]:
            _OWNERS[p] = owner
        self._packed_groups.append(None)

    def _validate_group(self, group: dict, where: str) -> None:  # subclasses check their hyperparameters
        P.check_step_lr(group["lr"], where)
        P.check_max_grad_norm(group.get("max_grad_norm"), where)

    # --- following the user's tensors ---------------------------------------------------------------------
    def _use_master(self, dtype: torch.dtype) -> bool:
        return self.master_weights if self.master_weights is not None else dtype in LOW_PRECISION

    def _follow_parameters(self) -> None:
        """Bring the segments in line with the parameters as they are now (see the module docstring)."""
        groups = self.param_groups
        if len(self._packed_groups) < len(groups):
            self._packed_groups += [None] * (len(groups) - len(self._packed_groups))
        if torch.compiler.is_compiling():
            # addresses and version counters cannot be traced: a compiled step runs with the segments built
            # by the last eager call (its guards recompile when parameters change dtype or device)
            if any(packed is None for packed in self._packed_groups):
                raise RuntimeError(f"{type(self).__name__}.step() is being compiled before the optimizer has seen "
                                   "its parameters: run one eager step() (or call state_dict()) first, then "
                                   "compile step()")
            return
        carried = self._take_replacements() if len(self._replaced) else {}
        repack = set()
        for gi, group in enumerate(groups):
            packed = self._packed_groups[gi]
            ps = group["params"]
            if packed is None or len(ps) != len(packed) or not all(map(_is, ps, packed)):
                repack.add(gi)
        rewritten = []
        for seg in self._segments:
            if seg.group_index in repack:
                continue
            tensors = seg.tensors()
            ptrs, vers = addresses(tensors), versions(tensors)
            if ptrs == seg.ptrs and vers == seg.vers:
                continue
            for i, p in enumerate(tensors):
                if ptrs[i] == seg.ptrs[i] and vers[i] == seg.vers[i]:
                    continue
                if ptrs[i] != seg.ptrs[i] and layout_of(p) != seg.layouts[i]:
                    repack.add(seg.group_index)
                    break
                rewritten.append((seg, i))
        if repack:
            self._repack(repack, carried)
        for seg, i in rewritten:
            if seg.group_index not in repack:
                seg.follow_values(i)
        for seg in {id(s): s for s, _ in rewritten}.values():
            if seg.group_index not in repack:
                seg.remember()

    def _take_replacements(self) -> Dict[int, Tensor]:
        """Put the Parameters that modules now hold in place of ours into the param groups (the one already
        held elsewhere in this optimizer, as when weights get tied, simply leaves its old slot); returns
        ``id(new) -> old`` so the new ones take over the old ones' state."""
        pending = {id(old): (old, new) for old, new in self._replaced.items()}
        self._replaced = WeakIdKeyDictionary()
        held = {id(p) for g in self.param_groups for p in g["params"]}
        carried: Dict[int, Tensor] = {}
        owner = weakref.ref(self)
        for g in self.param_groups:
            names = g.get("param_names")
            out, out_names = [], []
            for k, p in enumerate(g["params"]):
                entry = pending.get(id(p))
                new = p if entry is None else entry[1]
                while id(new) in pending and pending[id(new)][1] is not new:  # replaced again since
                    new = pending[id(new)][1]
                if new is not p:
                    if id(new) in held:
                        continue
                    held.add(id(new))
                    carried[id(new)] = p
                    _OWNERS[new] = owner
                out.append(new)
                if names is not None:
                    out_names.append(names[k])
            g["params"][:] = out
            if names is not None:
                g["param_names"] = out_names
        return carried

    def _repack(self, groups_to_pack: set, carried: Optional[Dict[int, Tensor]] = None) -> None:
        """Rebuild the segments of these groups from their parameters as they are now, carrying state
        (``carried``: ``id(new parameter) -> the parameter whose state it takes over``)."""
        everything = [(gi, k, p) for gi, g in enumerate(self.param_groups) for k, p in enumerate(g["params"])]
        previous = {id(p): (seg, i) for seg in self._segments for i, p in enumerate(seg.params)}
        for new_id, old in (carried or {}).items():
            if id(old) in previous:
                seg, i = previous[id(old)]
                new = next(p for g in self.param_groups for p in g["params"] if id(p) == new_id)
                if seg.layouts[i][2] == tuple(new.shape):  # same shape: it takes over the old one's state
                    previous[new_id] = (seg, i)
        devices = {}
        seen = set()
        for gi, k, p in everything:
            if gi in groups_to_pack:
                P.check_param(gi, k, p)
                if id(p) in seen:
                    raise ValueError("some parameters appear in more than one parameter group")
                if self.master_weights is False and p.dtype in LOW_PRECISION:
                    raise ValueError(f"master_weights=False with a {p.dtype} parameter "
                                     f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}): low-precision "
                                     "parameters need fp32 master weights")
            seen.add(id(p))
            devices.setdefault(p.device, (gi, k, p))
            old = previous.get(id(p))
            if old is not None and old[0].layouts[old[1]][2] != tuple(p.shape):
                raise ValueError(f"param_groups[{gi}]['params'][{k}] changed shape from {old[0].layouts[old[1]][2]} "
                                 f"to {tuple(p.shape)} since the optimizer last saw it: its optimizer state cannot "
                                 "follow (torch.optim's cannot either). Give the optimizer a state dict for the new "
                                 "shape, or build a new optimizer.")
        if len(devices) > 1:
            where = "; ".join(f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}) is on {d}"
                              for d, (gi, k, p) in devices.items())
            raise ValueError(f"a fused optimizer's parameters must all be on one device, but {where}. Move the whole "
                             "model (or every parameter given to this optimizer) to one device.")
        shard_groups = _shard_groups(everything)
        segments: List[Segment] = []
        for gi, group in enumerate(self.param_groups):
            if gi not in groups_to_pack:
                segments += [s for s in self._segments if s.group_index == gi]
                continue
            by_dtype: Dict[torch.dtype, List[Tensor]] = {}
            for p in group["params"]:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, ps in by_dtype.items():
                segments.append(build_segment(gi, ps, self._use_master(dtype), self.state_names, previous))
        owner = weakref.ref(self)
        for gi in groups_to_pack:
            self._packed_groups[gi] = list(self.param_groups[gi]["params"])
            for p in self._packed_groups[gi]:
                _OWNERS[p] = owner
        kept = {id(p) for s in segments for p in s.params}
        for seg in self._segments:
            for p in seg.params:
                if id(p) not in kept:
                    self.state.pop(p, None)
        self._segments = segments
        self._shard_groups = shard_groups
        self._partials_cache = None
        if devices:
            device = next(iter(devices))
            if device != self._device:
                self._make_device_tensors(device, {n: getattr(self, n) for n in
                                                   ("_stats", "_overflow", "_steps_at_load")})
        self._bind_state()

    def _bind_state(self) -> None:
        """``self.state[p]``: views of the segments' buffers for every parameter that has state."""
        for seg in self._segments:
            for i, p in enumerate(seg.params):
                if seg.has_state[i]:
                    self._bind_one(seg, i)

    def _bind_one(self, seg: Segment, i: int) -> None:
        p = seg.params[i]
        values = {name: seg.state_view(flat, i) for name, flat in seg.states.items()}
        if seg.master is not None:
            values["master_param"] = seg.state_view(seg.master, i)
        values["step"] = seg.steps[i]
        st = dict.get(self.state, p)
        if not isinstance(st, ParamState):
            st = ParamState()
            dict.__setitem__(self.state, p, st)
        for stale in [k for k in st if k not in values and k in ("master_param",) + self.state_names]:
            dict.__delitem__(st, stale)
        st._bind(values)

    def _ensure_packed(self) -> None:
        self._follow_parameters()

    def _ampfused_device(self) -> torch.device:
        """The device the optimizer's parameters (and so its gradients) are on now."""
        if self._segments and not len(self._replaced):  # built: the first parameter tells (the step checks all)
            first = self.param_groups[0]["params"]
            if first and first[0].device == self._device:
                return self._device
        self._follow_parameters()
        return self._device

    # --- gradients ----------------------------------------------------------------------------------------
    def _grad_name(self, seg: Segment, i: int) -> str:
        gi = seg.group_index
        p = seg.params[i]
        k = next(j for j, q in enumerate(self.param_groups[gi]["params"]) if q is p)
        return self._param_name(gi, p, k)

    def _collect(self) -> _Batch:
        """Every segment's gradients as the kernels read them, checked (sparse, dtype, device, layout)."""
        batch = _Batch()
        dtypes = set()
        for seg in self._segments:
            if seg.sharded:
                grads = [self._local_grad(seg, i, p.grad) for i, p in enumerate(seg.params)]
                tensors = seg.tensors()
            else:
                grads = [p.grad for p in seg.params]
                tensors = seg.params
            dtype, where, contiguous = seg.dtype, seg.device_index, seg.contiguous
            for i, g in enumerate(grads):
                if g is None:
                    continue
                if g.dtype is not dtype or g.layout is not torch.strided or g.get_device() != where:
                    self._refuse_grad(seg, i, g)
                if not (g.is_contiguous() if contiguous[i] else same_layout(tensors[i], g)):
                    # laid out unlike its parameter (assigned by hand): read a copy in the parameter's layout
                    grads[i] = torch.empty_like(tensors[i]).copy_(g)
                batch.active.append(grads[i])
                dtypes.add(dtype)
            batch.per_segment.append(grads)
        batch.dtypes = tuple(sorted(str(d) for d in dtypes))
        return batch

    def _scan(self) -> Optional[_Batch]:
        """The step's gradients from ampfused._host's pass over the segments (their tensor tables written in
        place), when nothing about the parameters changed since the optimizer's last write and every gradient
        can be read where it is; else None, and the step takes the Python path (which follows the changes,
        copies or refuses gradients, and names what it refuses)."""
        if torch.compiler.is_compiling() or self.track_nonfinite or self._partials_cache is not None \
                or len(self._replaced):
            return None
        host = _host()
        if host is None:
            return None
        groups, packed = self.param_groups, self._packed_groups
        if len(packed) != len(groups) or not self._segments:
            return None
        for group, was in zip(groups, packed):
            ps = group["params"]
            if was is None or len(ps) != len(was) or not all(map(_is, ps, was)):
                return None
        backend = self._table_backend()
        if backend is None:
            return None
        batch = _Batch()
        batch.tables = True
        batch.backend = backend
        chunk = backend.table_chunk
        dtypes = set()
        for seg in self._segments:
            status, _, active, chunks = host.scan(seg.params, seg.record_address, seg.table_address, chunk)
            if status:
                return None
            batch.counts.append(active)
            batch.chunks += chunks
            if active:
                dtypes.add(str(seg.dtype))
        batch.dtypes = tuple(sorted(dtypes))
        return batch

    def _table_backend(self):
        """The backend that runs every segment's step and K1 over any of their gradients, when it takes the
        host pass's tables; else None. Remembered while the segments, ``backend`` and the backend registry
        (and its environment override) stay the same."""
        key = (id(self._segments), self.backend, os.environ.get(ops.registry.ENV_VAR), ops.registry.generation())
        memo = self.__dict__.get("_table_memo")
        if memo is not None and memo[0] == key and memo[1] is self._segments:
            return memo[2]
        found = None
        for seg in self._segments:
            b = ops.registry.get_backend(ops.step_backend(seg.device, seg.step_dtypes, self.backend))
            k1 = ops.registry.get_backend(ops.step_backend(seg.device, (str(seg.dtype),), self.backend))
            if seg.sharded or b is None or not b.takes_tables or k1 is not b or found not in (None, b):
                found = None
                break
            found = b
        if found is not None and len({s.dtype for s in self._segments}) > 1:  # K1 over several dtypes at once
            names = tuple(sorted({str(s.dtype) for s in self._segments}))
            if ops.registry.get_backend(ops.step_backend(self._device, names, self.backend)) is not found:
                found = None
        self._table_memo = (key, self._segments, found)
        return found

    def _local_grad(self, seg: Segment, i: int, g: Optional[Tensor]) -> Optional[Tensor]:
        """A sharded parameter's gradient as the kernels read it: this rank's shard, placed like the parameter."""
        if g is None:
            return None
        p = seg.params[i]
        if not is_dtensor(g) or g.placements != p.placements or g.device_mesh != p.device_mesh:
            where = f"{g.placements} on {g.device_mesh}" if is_dtensor(g) else "a plain tensor"
            raise RuntimeError(f"parameter {self._grad_name(seg, i)} is a DTensor placed {p.placements} on "
                               f"{p.device_mesh} but its gradient is {where}: the step reads the gradient's local "
                               "shard where the parameter's is")
        return g._local_tensor

    def _refuse_grad(self, seg: Segment, i: int, g: Tensor) -> None:
        if g.layout is not torch.strided:
            raise RuntimeError(f"parameter {self._grad_name(seg, i)} has a sparse gradient ({g.layout}): fused "
                               "optimizers do not take sparse gradients. Use a dense layer (for example "
                               "nn.Embedding(sparse=False)) or give this parameter to torch.optim.SparseAdam.")
        raise RuntimeError(f"parameter {self._grad_name(seg, i)} is {seg.dtype} on {seg.device} but its gradient is "
                           f"{g.dtype} on {g.device}")

    @staticmethod
    def _same_grads(keys: List[tuple], batch: _Batch) -> bool:
        return len(keys) == len(batch.active) and all(
            k[0] is g and k[1] == g._version for k, g in zip(keys, batch.active))

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
        checked = self.__dict__.setdefault("_checked_hyper", {})
        for gi, group in enumerate(self.param_groups):
            key = [(k, id(v) if isinstance(v, Tensor) else tuple(v) if isinstance(v, list) else v)
                   for k, v in group.items() if k != "params"]  # a list is compared by a copy of its items
            if checked.get(gi) == key:
                continue
            self._validate_group(group, f" in param_groups[{gi}]")
            checked[gi] = key

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

    def _partials_and_inv_scale(self, batch: _Batch, grad_divisor=None):
        """Partials of the step's gradients and the coefficient that unscales them, all on the device."""
        grad_scale = _on(getattr(self, "grad_scale", None), self._device)
        given_inv = _on(getattr(self, "_ampfused_inv_scale", None), self._device)  # ampfused.GradScaler's 1/scale
        found_inf = _on(getattr(self, "found_inf", None), self._device)
        cache, self._partials_cache = self._partials_cache, None
        if cache is not None and grad_scale is None and self._same_grads(cache[0], batch):
            partials, inv_scale = cache[1], self._one  # gradients were unscaled (and measured) already
        else:
            if grad_scale is not None:
                # as torch's unscale_ forms it; ampfused.GradScaler hands it over already formed
                inv_scale = given_inv if given_inv is not None else grad_scale.double().reciprocal().float()
            else:
                inv_scale = self._one
            inv_scale = self._divide(inv_scale, grad_divisor)
            partials = self._k1("norm_check", batch, inv_scale)
        if found_inf is not None:  # e.g. all-reduced across ranks by the training script
            partials = _append_flag(partials, found_inf.float())
        return partials, inv_scale

    def _k1(self, op: str, batch: _Batch, inv_scale: Tensor) -> Tensor:
        """K1 over the step's gradients: the partials K2 reads. With FSDP2 the local shards' sums of squares
        and non-finite flags are summed over the shards' process groups (on the device, no host read), so
        every rank clips by the global norm and skips on an overflow anywhere."""
        if batch.tables:
            return batch.backend.norm_check_tables(
                [(seg.table_address, len(seg), seg.dtype, seg.table) for seg, n in zip(self._segments, batch.counts)
                 if n],
                batch.chunks, inv_scale)
        partials = ops.call_k1(op, batch.active, inv_scale, batch.dtypes, self.backend)
        if not self._shard_groups:
            return partials
        summed = torch.stack([partials[0].sum(), partials[1].sum()])
        for group in self._shard_groups:
            torch.distributed.all_reduce(summed, op=torch.distributed.ReduceOp.SUM, group=group)
        return summed.reshape(2, 1)

    @torch.no_grad()
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
        batch = self._scan()
        if batch is None:
            self._follow_parameters()
            batch = self._collect()
        if batch.empty:  # no gradient at all: torch.optim does nothing either
            self._pending_clip = None
            self._partials_cache = None
            return loss
        partials, inv_scale = self._partials_and_inv_scale(batch, grad_divisor)
        if self.track_nonfinite:
            self._count_nonfinite(batch)
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
        for si, seg in enumerate(self._segments):
            if batch.segment_empty(si):
                continue
            group = self.param_groups[seg.group_index]
            max_norm = group["max_grad_norm"]
            max_norm = math.inf if max_norm is None else float(max_norm)
            if pending is not None:
                max_norm = min(max_norm, pending)
            lr = self._lr_tensor(seg)
            if lr_mult is not None:
                lr = lr * lr_mult
            if batch.tables:
                self._step_op_table(seg, batch.backend, group, partials, inv_scale, lr, max_norm)
                _host().bump(seg.params, seg.table_address, seg.record_address)
                if not seg.all_state:
                    self._note_state(seg, [n != _NO_GRAD for n in seg.table[:, 2].tolist()])
            else:
                grads = batch.per_segment[si]
                self._update(seg, grads, group, partials, inv_scale, lr, max_norm)
                if not torch.compiler.is_compiling():
                    seg.vers = versions(seg.tensors())
                if not seg.all_state:
                    self._note_state(seg, [g is not None for g in grads])
        if guard is not None:
            guard.record_(norm, loss if isinstance(loss, Tensor) else None, spike, overflow > 0)
        self._calls += 1
        return loss

    def _note_state(self, seg: Segment, stepped: List[bool]) -> None:
        """As torch.optim: a parameter has state once a step saw its gradient."""
        for i, yes in enumerate(stepped):
            if yes and not seg.has_state[i]:
                seg.has_state[i] = True
                self._bind_one(seg, i)
        seg.all_state = all(seg.has_state)

    def _update(self, seg: Segment, grads: List[Optional[Tensor]], group: dict, partials: Tensor,
                inv_scale: Tensor, lr: Tensor, max_norm: float) -> None:
        raise NotImplementedError

    def _backend_name(self, seg: Segment, grads: List[Optional[Tensor]]) -> str:
        return ops.step_backend(seg.device, ops._step_dtypes(seg.tensors(), grads, seg.master), self.backend)

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

    def _steps_taken_now(self) -> Tensor:
        counts = [s.steps.max() for s in self._segments if len(s)]
        return torch.stack(counts).max() if counts else self._one * 0

    def stats(self) -> Dict[str, Tensor]:
        """Counters as device tensors, to log every N steps without a sync per step (since construction or
        the last load_state_dict). ``steps`` counts the updates applied (to the most-updated parameter)."""
        taken = self._steps_taken_now().to(self._device) - self._steps_at_load
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
        return self._module_names.get(id(p), f"param_groups[{gi}]['params'][{index}] (shape {tuple(p.shape)})")

    def _count_nonfinite(self, batch: _Batch) -> None:
        """Per-parameter count of non-finite gradient elements (one extra read of the gradients; opt-in)."""
        self._nonfinite = []
        for seg, grads in zip(self._segments, batch.per_segment):
            counts = [(~torch.isfinite(g)).sum() if g is not None else None for g in grads]
            self._nonfinite.append(counts)

    def nonfinite_report(self) -> Dict[str, int]:
        """Which parameters held infs or NaNs in the last step, and how many: ``{name: count}`` (reads to the
        host, only when asked). Needs ``track_nonfinite=True``."""
        if not self.track_nonfinite:
            raise RuntimeError("nonfinite_report() needs the optimizer built with track_nonfinite=True")
        report: Dict[str, int] = {}
        for seg, counts in zip(self._segments, self._nonfinite):
            group = self.param_groups[seg.group_index]
            for p, c in zip(seg.params, counts):
                if c is not None and int(c):
                    idx = next(i for i, q in enumerate(group["params"]) if q is p)
                    report[self._param_name(seg.group_index, p, idx)] = int(c)
        return report

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``: gradients set to ``None`` (the default) or zeroed in place.
        Either way the next step reads whatever gradients backward produces, where it puts them."""
        self._partials_cache = None
        super().zero_grad(set_to_none)

    # --- hooks used by ampfused.GradScaler and ampfused.clip_grad_norm_ ------------------------------------
    @torch.no_grad()
    def _ampfused_unscale_(self, inv_scale: Tensor, grad_divisor=None) -> Tensor:
        """Unscale the gradients in place (one pass), remember their norm, return found_inf."""
        self._check_divisor(grad_divisor)
        self._follow_parameters()
        batch = self._collect()
        inv_scale = self._divide(_on(inv_scale, self._device), grad_divisor)
        if not batch.active:
            self._partials_cache = None
            return self._one * 0
        partials = self._k1("unscale_", batch, inv_scale)
        self._partials_cache = (batch.keys(), partials)
        return ops.reduce_partials(partials)[1]

    @torch.no_grad()
    def _ampfused_fold_clip_(self, max_norm: float, norm_type: float = 2.0,
                             error_if_nonfinite: bool = False) -> Optional[Tensor]:
        """Fold ``clip_grad_norm_(params, max_norm)`` into the next step; returns the total norm."""
        if float(norm_type) != 2.0:
            return None
        self._follow_parameters()
        batch = self._collect()
        if not batch.active:
            return None
        cache = self._partials_cache
        if cache is None or not self._same_grads(cache[0], batch):
            cache = (batch.keys(), self._k1("norm_check", batch, self._one))
            self._partials_cache = cache
        norm = ops.reduce_partials(cache[1])[0]
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        self._pending_clip = float(max_norm) if self._pending_clip is None else min(self._pending_clip, float(max_norm))
        return norm

    # --- state dicts (torch.optim layout; see _state.py) ---------------------------------------------------
    def state_dict(self) -> dict:
        def export(opt):
            opt._follow_parameters()
            return export_state_dict(opt)
        return state_dict_with_hooks(self, export)

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = run_load_pre_hooks(self, state_dict)
        self._follow_parameters()
        import_state_dict(self, state_dict)
        self._steps_at_load.copy_(self._steps_taken_now())
        if self.spike_guard is not None:
            self.spike_guard.load_state_dict(state_dict.get("spike_guard", {}), self._device)
            self._spikes_at_load = float(self.spike_guard.spikes) if self.spike_guard._device is not None else 0.0
        self._calls = 0
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _export_param_state(self, st: dict, step: float) -> dict:
        out = {k: v for k, v in st.items() if k != "step"}
        out["step"] = torch.tensor(step, dtype=torch.float32)
        return out

    def _import_step(self, saved: dict) -> float:
        step = saved["step"]
        return float(step.item() if isinstance(step, Tensor) else step)

    def _state_keys_for_load(self, saved: dict):
        return self.state_names

    # --- copies and pickles -------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_replaced"] = None  # weak references do not pickle; pending swaps are taken at the next step
        state["_shard_groups"] = ()  # process groups do not pickle; found again from the parameters
        state.pop("_table_memo", None)  # memos of this process (backend objects, tensor ids)
        state.pop("_checked_hyper", None)
        return state

    def __setstate__(self, state: dict) -> None:
        if "_segments" not in state:  # pickled by an older ampfused or by torch.optim.Optimizer.__getstate__
            self.__dict__.update(state)
            self._init_internals()
            self._make_device_tensors(torch.device("cpu"))
            self.__dict__.setdefault("master_weights", None)
            self.__dict__.setdefault("backend", None)
            self.__dict__.setdefault("spike_guard", None)
            self.__dict__.setdefault("track_nonfinite", False)
            self.__dict__.setdefault("_module_names", {})
            self._packed_groups = [None] * len(self.param_groups)
        else:
            self.__dict__.update(state)
            self._replaced = WeakIdKeyDictionary()
            self._shard_groups = _shard_groups([(0, k, p) for k, p in enumerate(
                p for seg in self._segments for p in seg.params)])
        super().__setstate__(dict(self.__dict__))
        owner = weakref.ref(self)
        for g in self.param_groups:
            for p in g["params"]:
                _OWNERS[p] = owner

