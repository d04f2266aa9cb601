"""Reading a step's gradients: the Python path, the host pass of ``ampfused._host``, and K1 over them.

The host pass checks, in one C++ call per segment, that every parameter is where the optimizer left it (address
and version counter) and that every gradient can be read in place, and writes the segment's tensor table
(``step_args.h``) for the backends that take tables. Anything else (a parameter changed, a gradient strided
unlike its parameter or sparse, DTensor parameters, nonfinite tracking, a cached unscale) takes the Python
path, which checks, copies or refuses each gradient and names what it refuses. With FSDP2 (DTensor
parameters) K1's partials are summed over the mesh before the update reads them.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional

import torch
from torch import Tensor

from .. import _native, ops
from ..ops.checks import same_layout
from ._segment import Segment, is_dtensor


_NO_GRAD = -1  # the numel column of a table row without a gradient (step_args.h)
_SIZES = 2  # ampfused._host.CHANGED_SIZES: the scan changed a numel column


def _host():
    """ampfused._host, or None where it is not built (the step then runs its Python path)."""
    global _HOST
    if _HOST is False:
        _HOST = _native.optional("host")
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


class ReadGradients:
    """The part of :class:`~ampfused.optim._base.FusedOptimizer` that reads the step's gradients and runs K1."""

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
        if torch.compiler.is_compiling() or self.track_nonfinite or self._clip_state.holds_partials \
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
            if was is None or type(ps) is not list or not host.same_items(ps, was):
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
            if not seg.sharded and any(p.device != seg.device or p.dtype is not seg.dtype for p in seg.params):
                # moved or cast since the segment was built: the step follows first (the Python path rebuilds
                # the segments), and the backend is resolved for where and what the state goes to, never for
                # what it leaves (a backend forced for the new device would be refused for the old one)
                return None
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

    def _k1(self, op: str, batch: _Batch, inv_scale: Tensor) -> Tensor:
        """K1 over the step's gradients: the partials K2 reads. With FSDP2 the local shards' sums of squares
        and non-finite flags are summed over the shards' process groups (on the device, no host read), so
        every rank clips by the global norm and skips on an overflow anywhere."""
        if batch.tables:
            return batch.backend.norm_check_tables(
                [(seg.table_address, len(seg), seg.dtype, seg.table, seg.stamps)
                 for seg, n in zip(self._segments, batch.counts) if n],
                batch.chunks, inv_scale)
        partials = ops.call_k1(op, batch.active, inv_scale, batch.dtypes, self.backend)
        if not self._shard_groups:
            return partials
        summed = torch.stack([partials[0].sum(), partials[1].sum()])
        for group in self._shard_groups:
            torch.distributed.all_reduce(summed, op=torch.distributed.ReduceOp.SUM, group=group)
        return summed.reshape(2, 1)
