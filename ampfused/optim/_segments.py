"""A fused optimizer's segments as a whole: kept in line with the user's parameters, and each step's gradients
read from them.

A fused optimizer holds one :class:`Segments` (``opt._segs``): its segments (one per param group and dtype,
:class:`~ampfused.optim._segment.Segment`) and what keeps them current. Its methods take the optimizer, whose
param groups, state and options they read.

**Following the user's tensors.** Segments are built at the first step (or ``load_state_dict`` /
``state_dict``), from the parameters as they are then: a model loaded, cast or moved to its device after the
optimizer was built is what gets trained. Before every later step a host check compares each parameter's address
and version counter with what the segment recorded after its own last write (no pass over the weights;
``ampfused._host`` makes it in C++, :meth:`Segments.scan`). What it finds changed is followed
(:meth:`Segments.follow`):

* same place and layout, new version (``load_state_dict``, ``nn.init``, ``p.copy_``, ``p.mul_``) or new
  place, same layout (``p.data = t``, ``share_memory``): the master is kept where it still rounds to every
  value of the parameter, else rebuilt from the parameter's values (decided on the device, no host read);
* new dtype, device, shape or strides (``model.to(...)``, ``.half()``, ``channels_last``), or a group's
  parameter list changed: the group's segments are rebuilt and every state follows its parameter (moments
  and step counts moved, masters kept or rebuilt by the same rule, created or dropped as the new dtype
  needs). A change that cannot be followed (parameters now on several devices) raises first;
* a Parameter assigned into a module in place of one an optimizer holds (torch's parameter registration hook)
  takes over that one's state at the next step.

**Reading a step's gradients.** The host pass checks, in one C++ call per segment, that every parameter is where
the optimizer left it (address and version counter) and that every gradient can be read in place, and writes
the segment's tensor table (``step_args.h``) for the backends that take tables. Anything else (a parameter
changed, a gradient strided unlike its parameter or sparse, DTensor parameters, nonfinite tracking, a cached
unscale, an optimizer whose step takes no tables) takes the Python path (:meth:`Segments.collect`), which
checks, copies or refuses each gradient and names what it refuses. With FSDP2 (DTensor parameters) K1's
partials are summed over the mesh before the update reads them (:meth:`Segments.k1`).
"""
from __future__ import annotations

import operator
import os
import weakref
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import _native, ops
from ..ops.checks import same_layout
from . import _params as P
from ._precision import master_key
from ._segment import LOW_PRECISION, Segment, addresses, build_segment, is_dtensor, layout_of, local, versions
from ._state import ParamState

_is = operator.is_

_NO_GRAD = -1  # the numel column of a table row without a gradient (step_args.h)
_SIZES = 2  # ampfused._host.CHANGED_SIZES: the scan changed a numel column


def _host():
    """ampfused._host, or None where it is not built (the step then runs its Python path)."""
    global _HOST
    if _HOST is False:
        _HOST = _native.optional("host")
    return _HOST


_HOST: Any = False

# parameter -> weak reference to the fused optimizer that owns it (clip_grad_norm_ folds into that one's step)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def owner_of(p: Tensor):
    """The fused optimizer holding ``p``, or None."""
    ref = _OWNERS.get(p)
    return ref() if ref is not None else None


def claim(opt, params: Iterable[Tensor]) -> None:
    """``opt`` holds ``params`` (what :func:`owner_of` says of them)."""
    owner = weakref.ref(opt)
    for p in params:
        _OWNERS[p] = owner


def _on_parameter_registered(module: torch.nn.Module, name: str, param) -> None:
    """A Parameter assigned into a module (``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``)
    replaces the one a fused optimizer holds: that optimizer trains the new one from its next step on."""
    old = module._parameters.get(name) if name in module._parameters else None
    if old is None or param is None or old is param:
        return
    opt = owner_of(old)
    if opt is not None:
        opt._segs.replaced[old] = param


torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)


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


def _grad_name(opt, seg: Segment, i: int) -> str:
    gi = seg.group_index
    p = seg.params[i]
    k = next(j for j, q in enumerate(opt.param_groups[gi]["params"]) if q is p)
    return opt._param_name(gi, p, k)


def _local_grad(opt, seg: Segment, i: int, g: Optional[Tensor]) -> Optional[Tensor]:
    """A sharded parameter's gradient as the kernels read it: this rank's shard, placed like the parameter."""
    if g is None:
        return None
    p = seg.params[i]
    if not is_dtensor(g) or g.placements != p.placements or g.device_mesh != p.device_mesh:
        where = f"{g.placements} on {g.device_mesh}" if is_dtensor(g) else "a plain tensor"
        raise RuntimeError(f"parameter {_grad_name(opt, seg, i)} is a DTensor placed {p.placements} on "
                           f"{p.device_mesh} but its gradient is {where}: the step reads the gradient's local "
                           "shard where the parameter's is")
    return g._local_tensor


def _refuse_grad(opt, seg: Segment, i: int, g: Tensor) -> None:
    if g.layout is not torch.strided:
        raise RuntimeError(f"parameter {_grad_name(opt, seg, i)} has a sparse gradient ({g.layout}): fused "
                           "optimizers do not take sparse gradients. Use a dense layer (for example "
                           "nn.Embedding(sparse=False)) or give this parameter to torch.optim.SparseAdam.")
    raise RuntimeError(f"parameter {_grad_name(opt, seg, i)} is {seg.dtype} on {seg.device} but its gradient is "
                       f"{g.dtype} on {g.device}")


class Segments:
    """A fused optimizer's segments, in param-group order (``segments``), and what they were built from: per
    param group, its parameters as last packed (``packed``; ``None``: packed at the next step). ``replaced``:
    parameter -> the Parameter a module now holds in its place; ``shard_groups``: with FSDP2, the process groups
    the gradients' norm and flags are summed over; ``repeated``: why ``step()`` refuses the param groups (a
    parameter in two of them), else None."""

    def __init__(self):
        self.segments: List[Segment] = []
        self.packed: List[Optional[List[Tensor]]] = []
        self.replaced = WeakIdKeyDictionary()
        self.shard_groups: tuple = ()
        self.repeated: Optional[str] = None
        self._table_memo = None

    @classmethod
    def from_fields(cls, segments: List[Segment], packed: List[Optional[List[Tensor]]],
                    repeated: Optional[str]) -> "Segments":
        """From the attributes that optimizers pickled before this class existed held."""
        segs = cls.__new__(cls)
        segs.__setstate__(dict(segments=segments, packed=packed, repeated=repeated, _table_memo=None))
        return segs

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["replaced"] = None  # weak references do not pickle; pending swaps are taken at the next step
        state["shard_groups"] = ()  # process groups do not pickle; found again from the parameters
        state["_table_memo"] = None  # a memo of this process (backend objects, tensor ids)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.replaced = WeakIdKeyDictionary()
        self.shard_groups = _shard_groups([(0, k, p) for k, p in enumerate(
            p for seg in self.segments for p in seg.params)])

    def add_group(self, opt) -> None:
        """``opt``'s last param group, just added: its parameters are packed at the next step."""
        claim(opt, opt.param_groups[-1]["params"])
        self.packed.append(None)

    # --- following the user's tensors ---------------------------------------------------------------------
    def follow(self, opt) -> None:
        """Bring the segments in line with ``opt``'s parameters as they are now (see the module docstring)."""
        groups = opt.param_groups
        if torch.compiler.is_compiling():
            # addresses and version counters cannot be traced: a compiled step runs with the segments built
            # by the last eager call (its guards recompile when parameters change dtype or device)
            packed_groups = self.packed
            if len(packed_groups) < len(groups) or any(packed is None for packed in packed_groups):
                raise RuntimeError(f"{type(opt).__name__}.step() is being compiled before the optimizer has seen "
                                   "its parameters: run one eager step() (or call state_dict()) first, then "
                                   "compile step()")
            return
        if len(self.packed) < len(groups):
            self.packed.extend([None] * (len(groups) - len(self.packed)))
        elif len(self.packed) > len(groups):  # groups were removed from param_groups by hand
            del self.packed[len(groups):]
            self.packed[:] = [None] * len(groups)
        carried = self._take_replacements(opt) if len(self.replaced) else {}
        repack = set()
        for gi, group in enumerate(groups):
            packed = self.packed[gi]
            ps = group["params"]
            if packed is None or len(ps) != len(packed) or not all(map(_is, ps, packed)):
                repack.add(gi)
        rewritten = []
        for seg in self.segments:
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
            self.repack(opt, repack, carried)
        for seg, i in rewritten:
            if seg.group_index not in repack:
                seg.follow_values(i)
        for seg in {id(s): s for s, _ in rewritten}.values():
            if seg.group_index not in repack:
                seg.remember()

    def _take_replacements(self, opt) -> Dict[int, Tensor]:
        """Put the Parameters that modules now hold in place of ``opt``'s into its param groups (the one already
        held elsewhere in the optimizer, as when weights get tied, simply leaves its old slot); returns
        ``id(new) -> old`` so the new ones take over the old ones' state."""
        pending = {id(old): (old, new) for old, new in self.replaced.items()}
        self.replaced = WeakIdKeyDictionary()
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        carried: Dict[int, Tensor] = {}
        for g in opt.param_groups:
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
                    claim(opt, [new])
                out.append(new)
                if names is not None:
                    out_names.append(names[k])
            g["params"][:] = out
            if names is not None:
                g["param_names"] = out_names
        return carried

    def repack(self, opt, groups_to_pack: set, carried: Optional[Dict[int, Tensor]] = None) -> None:
        """Rebuild the segments of these groups from their parameters as they are now, carrying state
        (``carried``: ``id(new parameter) -> the parameter whose state it takes over``)."""
        everything = [(gi, k, p) for gi, g in enumerate(opt.param_groups) for k, p in enumerate(g["params"])]
        # A parameter listed twice (torch.optim warns of a repeat inside a group; param_groups edited by hand,
        # e.g. extended with themselves, repeat one across groups) lives once in the segments, in the first
        # group that lists it. A repeat across groups is recorded here and refused by step().
        first_group: Dict[int, int] = {}
        repeated = [(gi, k, p) for gi, k, p in everything if first_group.setdefault(id(p), gi) != gi]
        self.repeated = None
        if repeated:
            groups_to_pack = set(range(len(opt.param_groups)))
            gi, k, p = repeated[0]
            self.repeated = (f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}) is also in "
                             f"param_groups[{first_group[id(p)]}]: some parameters appear in more than one "
                             "parameter group, so their hyperparameters are ambiguous; a fused step updates "
                             "each parameter once. state_dict() works; remove the repeats before step()")
        previous = {id(p): (seg, i) for seg in self.segments for i, p in enumerate(seg.params)}
        for new_id, old in (carried or {}).items():
            if id(old) in previous:
                seg, i = previous[id(old)]
                new = next(p for g in opt.param_groups for p in g["params"] if id(p) == new_id)
                if seg.layouts[i][2] == tuple(local(new).shape):  # same shape: it takes over the old one's state
                    previous[new_id] = (seg, i)
        devices = {}
        for gi, k, p in everything:
            if gi in groups_to_pack:
                P.check_param(gi, k, p)
                if opt.master_weights is False and p.dtype in LOW_PRECISION:
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
        for gi, group in enumerate(opt.param_groups):
            if gi not in groups_to_pack:
                segments += [s for s in self.segments if s.group_index == gi]
                continue
            by_dtype: Dict[torch.dtype, List[Tensor]] = {}
            placed = set()
            for p in group["params"]:
                if first_group[id(p)] == gi and id(p) not in placed:
                    placed.add(id(p))
                    by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, ps in by_dtype.items():
                segments.append(build_segment(gi, ps, opt._use_master(dtype), opt._state_names_for(group), previous,
                                              getattr(opt, "_precision", None),
                                              getattr(opt, "segment_class", None)))
        for gi in groups_to_pack:
            self.packed[gi] = list(opt.param_groups[gi]["params"])
            claim(opt, self.packed[gi])
        kept = {id(p) for s in segments for p in s.params}
        for seg in self.segments:
            for p in seg.params:
                if id(p) not in kept:
                    opt.state.pop(p, None)
        self.segments = segments
        self.shard_groups = shard_groups
        opt._clip_state.forget_partials()
        if devices:
            device = next(iter(devices))
            if device != opt._device:
                opt._make_device_tensors(device, {n: getattr(opt, n) for n in
                                                  ("_stats", "_overflow", "_steps_at_load")})
        self.bind_state(opt)

    # --- opt.state: views of the segments' buffers --------------------------------------------------------
    def bind_state(self, opt) -> None:
        """``opt.state[p]``: views of the segments' buffers for every parameter that has state."""
        for seg in self.segments:
            for i, p in enumerate(seg.params):
                if seg.has_state[i]:
                    self._bind_one(opt, seg, i)

    def note_state(self, opt, seg: Segment, stepped: List[bool]) -> None:
        """As torch.optim: a parameter has state once a step saw its gradient."""
        for i, yes in enumerate(stepped):
            if yes and not seg.has_state[i]:
                seg.has_state[i] = True
                self._bind_one(opt, seg, i)
        seg.all_state = all(seg.has_state)

    @staticmethod
    def _bind_one(opt, seg: Segment, i: int) -> None:
        p = seg.params[i]
        values = seg.state_views(i)  # (8-bit moments: with their block scales)
        if seg.master is not None:
            values[master_key(seg)] = seg.state_view(seg.master, i)
        values["step"] = seg.steps[i]
        st = dict.get(opt.state, p)
        if not isinstance(st, ParamState):
            st = ParamState()
            dict.__setitem__(opt.state, p, st)
        masters = ("master_param", "master_remainder")
        for stale in [k for k in st if k not in values and k in masters + opt.state_names]:
            dict.__delitem__(st, stale)
        st._bind(values)

    # --- reading a step's gradients -----------------------------------------------------------------------
    def collect(self, opt) -> _Batch:
        """Every segment's gradients as the kernels read them, checked (sparse, dtype, device, layout)."""
        batch = _Batch()
        dtypes = set()
        for seg in self.segments:
            if seg.sharded:
                grads = [_local_grad(opt, seg, i, p.grad) for i, p in enumerate(seg.params)]
                tensors = seg.tensors()
            else:
                grads = [p.grad for p in seg.params]
                tensors = seg.params
            dtype, where, contiguous = seg.dtype, seg.device_index, seg.contiguous
            for i, g in enumerate(grads):
                if g is None:
                    continue
                if g.dtype is not dtype or g.layout is not torch.strided or g.get_device() != where:
                    _refuse_grad(opt, seg, i, g)
                if not (g.is_contiguous() if contiguous[i] else same_layout(tensors[i], g)):
                    # laid out unlike its parameter (assigned by hand): read a copy in the parameter's layout
                    grads[i] = torch.empty_like(tensors[i]).copy_(g)
                batch.active.append(grads[i])
                dtypes.add(dtype)
            batch.per_segment.append(grads)
        batch.dtypes = tuple(sorted(str(d) for d in dtypes))
        return batch

    def scan(self, opt) -> Optional[_Batch]:
        """The step's gradients from ampfused._host's pass over the segments (their tensor tables written in
        place), when nothing about ``opt``'s parameters changed since its last write and every gradient can be
        read where it is; else None, and the step takes the Python path (which follows the changes, copies or
        refuses gradients, and names what it refuses)."""
        if torch.compiler.is_compiling() or not opt.takes_host_pass or opt.track_nonfinite \
                or opt._clip_state.holds_partials or len(self.replaced):
            return None
        host = _host()
        if host is None:
            return None
        groups, packed = opt.param_groups, self.packed
        if len(packed) != len(groups) or not self.segments:
            return None
        for group, was in zip(groups, packed):
            ps = group["params"]
            if was is None or type(ps) is not list or not host.same_items(ps, was):
                return None
        backend = self.table_backend(opt.backend, opt._device, lambda seg: opt._op_for(groups[seg.group_index]))
        if backend is None:
            return None
        batch = _Batch()
        batch.tables = True
        batch.backend = backend
        chunk = backend.table_chunk
        dtypes = set()
        for seg in self.segments:
            status, _, active, chunks, changed = host.scan(seg.params, seg.record_address, seg.table_address,
                                                           chunk)
            if status:
                seg.restamp()  # the table is partly written: no copy of it may be taken for current
                return None
            if changed:
                seg.restamp(sizes=bool(changed & _SIZES))
            batch.counts.append(active)
            batch.chunks += chunks
            if active:
                dtypes.add(str(seg.dtype))
        batch.dtypes = tuple(sorted(dtypes))
        return batch

    def table_backend(self, backend: Optional[str], device: torch.device, op):
        """The backend that runs every segment's step and K1 over any of their gradients (``backend``: the one
        the optimizer was given, ``device``: its parameters', ``op``: its step op, or a function of a segment
        giving its op), when it takes the host pass's tables; else None.
        Remembered while the segments, ``backend`` and the backend registry (and its environment override) stay
        the same."""
        key = (id(self.segments), backend, os.environ.get(ops.registry.ENV_VAR), ops.registry.generation())
        memo = self._table_memo
        if memo is not None and memo[0] == key and memo[1] is self.segments:
            return memo[2]
        found = None
        for seg in self.segments:
            if not seg.sharded and any(p.device != seg.device or p.dtype is not seg.dtype for p in seg.params):
                # moved or cast since the segment was built: the step follows first (the Python path rebuilds
                # the segments), and the backend is resolved for where and what the state goes to, never for
                # what it leaves (a backend forced for the new device would be refused for the old one)
                return None
            b = ops.registry.get_backend(ops.step_backend(seg.device, seg.step_dtypes, backend,
                                                          op if isinstance(op, str) else op(seg)))
            k1 = ops.registry.get_backend(ops.step_backend(seg.device, (str(seg.dtype),), backend))
            if seg.sharded or not seg.takes_tables or b is None or not b.takes_tables or k1 is not b \
                    or found not in (None, b):
                found = None
                break
            found = b
        if found is not None and len({s.dtype for s in self.segments}) > 1:  # K1 over several dtypes at once
            names = tuple(sorted({str(s.dtype) for s in self.segments}))
            if ops.registry.get_backend(ops.step_backend(device, names, backend)) is not found:
                found = None
        self._table_memo = (key, self.segments, found)
        return found

    def k1(self, op: str, batch: _Batch, inv_scale: Tensor, backend: Optional[str]) -> Tensor:
        """K1 (``op``: ``"norm_check"`` or ``"unscale_"``) over the step's gradients: the partials K2 reads. With
        FSDP2 the local shards' sums of squares and non-finite flags are summed over the shards' process groups
        (on the device, no host read), so every rank clips by the global norm and skips on an overflow anywhere."""
        if batch.tables:
            return batch.backend.norm_check_tables(
                [(seg.table_address, len(seg), seg.dtype, seg.table, seg.stamps)
                 for seg, n in zip(self.segments, batch.counts) if n],
                batch.chunks, inv_scale)
        partials = ops.call_k1(op, batch.active, inv_scale, batch.dtypes, backend)
        if not self.shard_groups:
            return partials
        summed = torch.stack([partials[0].sum(), partials[1].sum()])
        for group in self.shard_groups:
            torch.distributed.all_reduce(summed, op=torch.distributed.ReduceOp.SUM, group=group)
        return summed.reshape(2, 1)
