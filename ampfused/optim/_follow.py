"""Following the user's tensors: what a fused optimizer does before a step when its parameters changed.

Segments (:mod:`._segment`) are built at the first step (or ``load_state_dict`` / ``state_dict``), from the
parameters as they are then: a model loaded, cast or moved to its device after the optimizer was built is what
gets trained. Before every later step a host check compares each parameter's address and version counter with
what the segment recorded after its own last write (no pass over the weights; ``ampfused._host`` makes it in
C++, :mod:`._gradients`). What it finds changed is followed here:

* same place and layout, new version (``load_state_dict``, ``nn.init``, ``p.copy_``, ``p.mul_``) or new
  place, same layout (``p.data = t``, ``share_memory``): the master is kept where it still rounds to every
  value of the parameter, else rebuilt from the parameter's values (decided on the device, no host read);
* new dtype, device, shape or strides (``model.to(...)``, ``.half()``, ``channels_last``), or a group's
  parameter list changed: the group's segments are rebuilt and every state follows its parameter (moments
  and step counts moved, masters kept or rebuilt by the same rule, created or dropped as the new dtype
  needs). A change that cannot be followed (parameters now on several devices) raises first;
* a Parameter assigned into a module in place of one an optimizer holds (torch's parameter registration hook)
  takes over that one's state at the next step.
"""
from __future__ import annotations

import operator
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _params as P
from ._gradients import _shard_groups
from ._precision import master_key
from ._segment import LOW_PRECISION, Segment, addresses, build_segment, layout_of, local, versions
from ._state import ParamState

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


class FollowParameters:
    """The part of :class:`~ampfused.optim._base.FusedOptimizer` that brings its segments in line with its
    parameters as they are now."""

    def _use_master(self, dtype: torch.dtype) -> bool:
        return self.master_weights if self.master_weights is not None else dtype in LOW_PRECISION

    def _follow_parameters(self) -> None:
        """Bring the segments in line with the parameters as they are now (see the module docstring)."""
        groups = self.param_groups
        if torch.compiler.is_compiling():
            # addresses and version counters cannot be traced: a compiled step runs with the segments built
            # by the last eager call (its guards recompile when parameters change dtype or device)
            packed_groups = self._packed_groups
            if len(packed_groups) < len(groups) or any(packed is None for packed in packed_groups):
                raise RuntimeError(f"{type(self).__name__}.step() is being compiled before the optimizer has seen "
                                   "its parameters: run one eager step() (or call state_dict()) first, then "
                                   "compile step()")
            return
        if len(self._packed_groups) < len(groups):
            self._packed_groups.extend([None] * (len(groups) - len(self._packed_groups)))
        elif len(self._packed_groups) > len(groups):  # groups were removed from param_groups by hand
            del self._packed_groups[len(groups):]
            self._packed_groups[:] = [None] * len(groups)
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
        # A parameter listed twice (torch.optim warns of a repeat inside a group; param_groups edited by hand,
        # e.g. extended with themselves, repeat one across groups) lives once in the segments, in the first
        # group that lists it. A repeat across groups is recorded here and refused by step().
        first_group: Dict[int, int] = {}
        repeated = [(gi, k, p) for gi, k, p in everything if first_group.setdefault(id(p), gi) != gi]
        self._repeated_params = None
        if repeated:
            groups_to_pack = set(range(len(self.param_groups)))
            gi, k, p = repeated[0]
            self._repeated_params = (f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}) is also in "
                                     f"param_groups[{first_group[id(p)]}]: some parameters appear in more than one "
                                     "parameter group, so their hyperparameters are ambiguous; a fused step updates "
                                     "each parameter once. state_dict() works; remove the repeats before step()")
        previous = {id(p): (seg, i) for seg in self._segments for i, p in enumerate(seg.params)}
        for new_id, old in (carried or {}).items():
            if id(old) in previous:
                seg, i = previous[id(old)]
                new = next(p for g in self.param_groups for p in g["params"] if id(p) == new_id)
                if seg.layouts[i][2] == tuple(local(new).shape):  # same shape: it takes over the old one's state
                    previous[new_id] = (seg, i)
        devices = {}
        for gi, k, p in everything:
            if gi in groups_to_pack:
                P.check_param(gi, k, p)
                if self.master_weights is False and p.dtype in LOW_PRECISION:
                    raise ValueError(f"master_weights=False with a {p.dtype} parameter "
                                     f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}): low-precision "
                                     "parameters need fp32 master weights")
            devices.setdefault(p.device, (gi, k, p))
            old = previous.get(id(p))
            # (segments record the shapes of what they update: an FSDP2 parameter's local shard)
            if old is not None and old[0].layouts[old[1]][2] != tuple(local(p).shape):
                raise ValueError(f"param_groups[{gi}]['params'][{k}] changed shape from {old[0].layouts[old[1]][2]} "
                                 f"to {tuple(local(p).shape)} since the optimizer last saw it: its optimizer state cannot "
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
            placed = set()
            for p in group["params"]:
                if first_group[id(p)] == gi and id(p) not in placed:
                    placed.add(id(p))
                    by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, ps in by_dtype.items():
                segments.append(build_segment(gi, ps, self._use_master(dtype), self._state_names_for(group), previous,
                                              getattr(self, "_precision", None),
                                              getattr(self, "segment_class", None)))
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
        self._clip_state.forget_partials()
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
        values = seg.state_views(i)  # (8-bit moments: with their block scales)
        if seg.master is not None:
            values[master_key(seg)] = seg.state_view(seg.master, i)
        values["step"] = seg.steps[i]
        st = dict.get(self.state, p)
        if not isinstance(st, ParamState):
            st = ParamState()
            dict.__setitem__(self.state, p, st)
        masters = ("master_param", "master_remainder")
        for stale in [k for k in st if k not in values and k in masters + self.state_names]:
            dict.__delitem__(st, stale)
        st._bind(values)

    def _ampfused_device(self) -> torch.device:
        """The device the optimizer's parameters (and so its gradients) are on now."""
        if self._segments and not len(self._replaced):  # built: the first parameter tells (the step checks all)
            first = self.param_groups[0]["params"]
            if first and first[0].device == self._device:
                return self._device
        self._follow_parameters()
        return self._device
