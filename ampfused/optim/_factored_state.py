"""A factored state in a segment (``layout="factored"``, :mod:`ampfused.ops.factored`): one flat fp32 ``factors``
buffer per segment (each matrix's row and column vectors, each other parameter's variance), shown in
``optimizer.state`` and state dicts as torch.optim shows a factored second moment (``row_var`` ``[..., R, 1]``,
``col_var`` ``[..., 1, C]``, ``variance`` shaped like the parameter)."""
from __future__ import annotations

from typing import Dict

import numpy
import torch
from torch import Tensor

from ..ops import native_factored
from ..ops.factored import factor_layout, factor_size, factor_views, factored
from ._segment import Segment, local

FACTORED_KEYS = ("row_var", "col_var")
VECTOR_KEYS = ("variance",)


def state_keys(shape) -> tuple:
    """The state-dict keys of a parameter of this shape."""
    return FACTORED_KEYS if factored(tuple(shape)) else VECTOR_KEYS


class FactoredSegment(Segment):
    """A :class:`Segment` whose state is ``factors`` (laid out by ``factor_layout``), not moments shaped like the
    parameters; masters, remainders and stochastic rounding as any segment's."""

    def __init__(self, group_index, params, use_master, state_names, precision=None):
        super().__init__(group_index, params, use_master, (), precision)
        self.factor_offsets, total = factor_layout([layout[2] for layout in self.layouts])
        self.states = {"factors": torch.zeros(total, dtype=torch.float32, device=self.device)}
        self._factored_table()

    def _factored_table(self) -> None:
        """The factored step's table (``ops.native_factored``: ``AF_COLS`` ints a row), its columns after the
        first three (offsets, sizes, strides) written here from the parameters; the host pass writes the first
        three (param, grad, numel) into the segment's tensor table, copied into this one each step
        (:meth:`step_table`). A parameter of more dimensions than the native kernels take keeps the segment on
        the Python path (``takes_tables``)."""
        tensors = self.tensors()
        self.takes_tables = not self.sharded and all(p.dim() <= native_factored.AF_MAX_DIMS for p in tensors)
        self.factored = None
        if self.takes_tables:
            rows = native_factored.table(tensors, [None] * len(tensors))
            self.factored = numpy.array(rows, dtype=numpy.int64).reshape(len(tensors), native_factored.AF_COLS)
            self.factored[:, 3] = self.offsets

    def step_table(self) -> tuple:
        t = self.factored
        t[:, :3] = self.table[:, :3]
        return t.ctypes.data, len(self.params), t, self.stamps

    def remember(self) -> None:
        super().remember()
        self._factored_table()  # (a parameter written in place may have new strides: t_(), as_strided_())

    def factor_slice(self, i: int, flat: Tensor = None) -> Tensor:
        flat = self.states["factors"] if flat is None else flat
        off = self.factor_offsets[i]
        return flat[off:off + factor_size(self.layouts[i][2])]

    def state_views(self, i: int) -> Dict[str, Tensor]:
        """Parameter ``i``'s factors as torch.optim shows them; for FSDP2, DTensors placed as
        :func:`factor_placements` says, whole shapes, over this rank's factors."""
        views = factor_views(self.states["factors"], self.factor_offsets[i], self.layouts[i][2])
        if not self.sharded:
            return views
        from torch.distributed.tensor import DTensor
        p = self.params[i]
        out = {}
        for key, v in views.items():
            shape = full_factor_shape(tuple(p.shape), key)
            out[key] = DTensor.from_local(v, p.device_mesh, factor_placements(p, key), run_check=False,
                                          shape=shape, stride=_contiguous_strides(shape))
        return out

    def carry_states(self, i: int, prev: Segment, j: int) -> None:
        """Parameter ``prev[j]``'s factors into parameter ``i`` (same shape: the caller checks)."""
        if isinstance(prev, FactoredSegment):
            self.factor_slice(i).copy_(prev.factor_slice(j))

    def load_factors(self, i: int, entry: dict, flat: Tensor) -> None:
        """Write a checked state-dict entry's factors (any float dtype, any device) into ``flat``."""
        shape = self.layouts[i][2]
        views = factor_views(flat, self.factor_offsets[i], shape)
        for key, view in views.items():
            view.copy_(local(entry[key]).detach().reshape(view.shape))


def full_factor_shape(shape: tuple, key: str) -> tuple:
    """The shape of state ``key`` of a whole parameter of ``shape`` (torch.optim's)."""
    if key == "row_var":
        return shape[:-1] + (1,)
    if key == "col_var":
        return shape[:-2] + (1, shape[-1])
    return shape


def factor_placements(p, key: str) -> tuple:
    """Where an FSDP2 parameter's state ``key`` lives: split as the parameter is, except that a parameter split
    along its rows keeps every column factor on each rank (``col_var`` replicated: each rank's is the whole one,
    computed from sums over the ranks), and one split along its columns every row factor."""
    from torch.distributed.tensor import Replicate, Shard
    if key == "variance":
        return tuple(p.placements)
    whole = p.dim() - 1 if key == "row_var" else p.dim() - 2
    return tuple(Replicate() if pl.is_shard() and pl.dim % p.dim() == whole else
                 (Shard(pl.dim % p.dim()) if pl.is_shard() else pl) for pl in p.placements)


def _contiguous_strides(shape: tuple) -> tuple:
    strides, k = [], 1
    for n in reversed(shape):
        strides.append(k)
        k *= max(1, n)
    return tuple(reversed(strides))


def check_entry(key_shapes: dict, e: dict, where: str, param=None) -> None:
    """A loaded entry's factors: floating-point dense tensors of torch.optim's shapes (``key_shapes``:
    this rank's). For a DTensor ``param`` (FSDP2), DTensors of the whole shapes placed by
    :func:`factor_placements`, whose local tensors have this rank's shapes."""
    from ._segment import is_dtensor
    for key, shape in key_shapes.items():
        v = e.get(key)
        if not isinstance(v, Tensor):
            raise ValueError(f"loaded state of {where} lacks '{key}' (a tensor of shape {tuple(shape)})")
        if param is not None and is_dtensor(param):
            want, full = factor_placements(param, key), full_factor_shape(tuple(param.shape), key)
            if not is_dtensor(v) or tuple(v.placements) != want or v.device_mesh != param.device_mesh:
                found = f"placed {v.placements} on {v.device_mesh}" if is_dtensor(v) else "a plain tensor"
                raise ValueError(f"loaded state '{key}' of {where} is {found}, but it must be a DTensor placed {want} "
                                 f"on {param.device_mesh}: load sharded optimizer state with torch.distributed."
                                 "checkpoint.state_dict.set_optimizer_state_dict (or give DTensors placed so)")
            if tuple(v.shape) != full:
                raise ValueError(f"loaded state '{key}' of {where} must have shape {full}, got {tuple(v.shape)}")
            v = v._local_tensor
        if not v.is_floating_point() or v.layout != torch.strided or v.is_meta:
            raise ValueError(f"loaded state '{key}' of {where} must be a dense floating-point tensor, got {v.dtype} "
                             f"({v.layout})")
        if tuple(v.shape) != tuple(shape) and v.numel() != torch.Size(shape).numel():
            raise ValueError(f"loaded state '{key}' of {where} must have shape {tuple(shape)}, got {tuple(v.shape)}")


def _load_master(seg, i: int, e: dict, p: Tensor, master: Tensor) -> None:
    """Parameter ``i``'s master (or remainder) from a loaded entry, else re-derived from the parameter."""
    from ._precision import remainders_from
    mine = seg.view(master, i)
    if master.dtype == torch.int16:
        if e.get("master_remainder") is not None:
            mine.copy_(local(e["master_remainder"]).reshape(p.shape))
        elif e.get("master_param") is not None:
            mine.copy_(remainders_from(local(e["master_param"]).reshape(p.shape), p.detach()))
        return
    src = e.get("master_param")
    mine.copy_(local(src).reshape(p.shape) if src is not None else p.detach())


def import_state_dict(opt, state_dict: dict) -> None:
    """``opt.load_state_dict(sd)`` for an optimizer whose state is factored, from ours or from torch.optim's:
    everything checked, the new buffers built aside, then swapped in."""
    from ._state import _saved_step, checked_groups, finish_load, swap_loaded
    saved_state, sid_of, new_groups = checked_groups(opt, state_dict)
    plans = []
    for seg in opt._segs.segments:
        entries = []
        for i, (param, p) in enumerate(zip(seg.params, seg.tensors())):
            sid = sid_of[id(param)]
            e = saved_state.get(sid)
            if not e:
                entries.append(None)
                continue
            where = f"parameter {sid}"
            if not isinstance(e, dict):
                raise ValueError(f"loaded state of {where} must be a dict, got {type(e).__name__}")
            shapes = {k: v.shape for k, v in factor_views(torch.empty(factor_size(p.shape), device="meta"), 0,
                                                          tuple(p.shape)).items()}
            check_entry(shapes, e, where, param)
            entries.append((e, _saved_step(opt, e, where)))
        plans.append((seg, entries))
    built = []
    with torch.no_grad():
        for seg, entries in plans:
            factors = torch.zeros_like(seg.states["factors"])
            master = torch.zeros_like(seg.master) if seg.master is not None else None
            steps = [0.0] * len(seg.params)
            for i, (p, entry) in enumerate(zip(seg.tensors(), entries)):
                if entry is not None:
                    seg.load_factors(i, entry[0], factors)
                    steps[i] = entry[1]
                if master is not None:
                    _load_master(seg, i, entry[0] if entry is not None else {}, p, master)
            built.append((seg, factors, master, torch.tensor(steps, dtype=torch.float32).to(seg.device),
                          [entry is not None for entry in entries]))
    for seg, factors, master, steps, has_state in built:
        swap_loaded(opt, seg, {"factors": factors}, master, steps, has_state)
    finish_load(opt, state_dict, saved_state, new_groups)
