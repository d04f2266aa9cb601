"""Segments: the optimizer's own state for the parameters of one param group that share a dtype.

The parameters stay the user's tensors, wherever they live and however they are laid out in memory. A
segment holds what the optimizer derives from them: fp32 master copies (for fp16/bf16 parameters), the
optimizer states (moments, momentum) in flat buffers (fp32, bf16, or 8-bit codes with their block scales in
``scales``: docs/state-precision.md) laid out by :func:`ampfused.ops.state_layout`,
one step count per parameter and the group's lr as a device tensor. Parameter ``i``'s slice of a flat
buffer holds its elements in the parameter's memory order, so :meth:`Segment.view` of a slice with the
parameter's strides is its state as ``torch.optim`` shapes it (``channels_last`` included).

What the segment remembers of each parameter (address, version counter, dtype, device, shape, strides) is
what the optimizer compares on the host before every step to follow changes made outside it; see
:meth:`ampfused.optim._segments.Segments.follow` (the optimizer's segments as a whole).

Parameters sharded by FSDP2 (``fully_shard``) are DTensors: a segment of them keeps this rank's shards' state,
reads and writes the local shards (:func:`local`), and hands out its states as DTensors placed like their
parameters (:meth:`Segment.state_view`), so ``torch.distributed.checkpoint`` saves and reshards them.
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional

import numpy
import torch
from torch import Tensor

from ..ops import memory_view, state_layout
from ..ops.reference import STATE_ALIGN
from ..ops import state_precision as sp
from ._precision import Precision

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None

LOW_PRECISION = (torch.bfloat16, torch.float16)
_data_ptr = Tensor.data_ptr
# Stamps name what a segment's tensor table holds: never reused in a process, so a backend's copy of a table
# (keyed by the table's address, which a later segment's table may reuse) is current iff its stamp matches.
_STAMPS = itertools.count(1)


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def split_dim(p, who: str, doc: str) -> Optional[int]:
    """The dimension a DTensor parameter is split along over its mesh (None: replicated on every mesh
    dimension); refused (naming ``who`` and ``doc``) when it is split along two, or partial."""
    dims = set()
    for pl in p.placements:
        if pl.is_shard():
            dims.add(pl.dim % max(1, p.dim()))
        elif not pl.is_replicate():
            raise ValueError(f"{who} got a DTensor parameter (shape {tuple(p.shape)}) placed {p.placements}: "
                             "it takes sharded or replicated parameters (FSDP2), not partial ones")
    if len(dims) > 1:
        raise NotImplementedError(
            f"{who} got a DTensor parameter (shape {tuple(p.shape)}) placed {p.placements}, split along "
            f"dimensions {sorted(dims)}: its sharded step splits each parameter along one dimension "
            f"(FSDP2's Shard(0) by default; {doc})")
    return dims.pop() if dims else None


def local(t: Optional[Tensor]) -> Optional[Tensor]:
    """The tensor that holds ``t``'s values on this rank: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def layout_of(p: Tensor) -> tuple:
    """What a segment's state layout depends on: dtype, device, shape and strides."""
    return p.dtype, p.device, tuple(p.shape), p.stride()


def versions(params: List[Tensor]) -> List[int]:
    return [p._version for p in params]


def addresses(params: List[Tensor]) -> List[int]:
    return list(map(_data_ptr, params))


class Segment:
    """Parameters ``params`` (one group, one dtype, one device) and the optimizer's state for them."""

    def __init__(self, group_index: int, params: List[Tensor], use_master: bool, state_names: tuple,
                 precision: Optional[Precision] = None):
        self.group_index = group_index
        self.params = list(params)
        self.sharded = is_dtensor(self.params[0])  # FSDP2: all of an optimizer's parameters are DTensors or none
        tensors = self.tensors()
        p0 = tensors[0]
        self.dtype, self.device = p0.dtype, p0.device
        f32 = dict(dtype=torch.float32, device=self.device)
        # state precision (docs/state-precision.md): int16 remainders in place of bf16 parameters' masters, or no
        # master (stochastic rounding); moments in fp32, bf16 or 8-bit codes; the seed of the segment's
        # stochastic rounding
        self.precision = precision or Precision()
        self.master_format = self.precision.master_format(self.dtype, use_master)
        use_master = use_master and self.master_format != sp.MASTER_NONE
        moments = self.precision.moments if (use_master or self.dtype in (torch.float32, torch.bfloat16)) \
            else torch.float32
        # 8-bit moments: parameters start at multiples of QBLOCK, so each block of codes is one parameter's (a
        # segment without states is laid out as the step ops lay out a master alone)
        self.offsets, self.total = state_layout([p.numel() for p in tensors],
                                                sp.QBLOCK if moments == torch.uint8 and state_names else STATE_ALIGN)
        self.layouts = [layout_of(p) for p in tensors]
        self.contiguous = [p.is_contiguous() for p in tensors]
        self.device_index = p0.get_device()  # what Tensor.get_device() says for tensors on this device
        master_dtype = torch.int16 if self.master_format == sp.MASTER_REMAINDER else torch.float32
        self.master: Optional[Tensor] = (torch.zeros(self.total, dtype=master_dtype, device=self.device)
                                         if use_master else None)  # gaps stay 0
        # the states a step of this group reads (``state_names``: all of the optimizer's, except SGD's momentum
        # buffer before a step has momentum, as torch.optim.SGD keeps none until then; a segment that needs more
        # is rebuilt, carrying its state: FusedOptimizer._provide_states)
        self.states: Dict[str, Tensor] = {name: torch.zeros(self.total, dtype=moments, device=self.device)
                                          for name in state_names}
        # 8-bit moments' block scales: one row per moment (in ``states``' order), one column per block (zero
        # scales decode fresh all-zero codes as zeros)
        self.scales: Optional[Tensor] = (torch.zeros(len(state_names), sp.q8_blocks(self.total), **f32)
                                         if moments == torch.uint8 and state_names else None)
        self.seed = (self.precision.segment_seed(group_index, self.dtype, self.device)
                     if self.master_format == sp.MASTER_NONE or moments in sp.COMPACT_STATE_DTYPES else None)
        self.steps = torch.zeros(len(self.params), **f32)
        self.has_state = [False] * len(self.params)  # as torch.optim: state exists once a step saw a gradient
        self.lr = torch.zeros((), **f32)
        self.lr_value = None  # the Python value last written into self.lr
        # each parameter's (address, version counter) as the optimizer last left it, and the step's tensor table
        # (step_args.h; the offset column fixed here): host buffers that ampfused._host reads and writes
        # (numpy arrays: read and written with no torch operator)
        self.record = numpy.full((len(self.params), 2), -1, dtype=numpy.int64)
        self.table = numpy.zeros((len(self.params), 4), dtype=numpy.int64)
        self.table[:, 3] = self.offsets
        self.restamp()
        self._addresses()
        self.all_state = False  # every parameter has state (no per-parameter bookkeeping after a step)
        self.keep_remainders = False  # set by a load: the next follow keeps the loaded remainders
        self.step_dtypes = tuple(sorted({str(self.dtype)} | ({"torch.float32"} if use_master else set())))

    @property
    def remainders(self) -> bool:
        return self.master_format == sp.MASTER_REMAINDER

    def set_master_from(self, i: int, p: Tensor) -> None:
        """Parameter ``i``'s master re-derived from its values: ``p`` in fp32, or (remainders) remainder 0."""
        if self.remainders:
            self.view(self.master, i).zero_()
        else:
            self.view(self.master, i).copy_(p)

    def _addresses(self) -> None:
        self.record_address = self.record.ctypes.data
        self.table_address = self.table.ctypes.data

    def __setstate__(self, state: dict) -> None:  # a copy or an unpickled segment has buffers of its own
        self.__dict__.update(state)
        self.restamp()
        self._addresses()

    takes_tables = True  # its step can run from the host pass's table (step_table)

    def step_table(self) -> tuple:
        """The step's tensor table as a backend takes it: ``(address, rows, array, stamps)``."""
        return self.table_address, len(self.params), self.table, self.stamps

    def restamp(self, addresses: bool = True, sizes: bool = True) -> None:
        """The table's contents changed: its addresses (the tensors' places), its sizes (the numel column, which
        the work lists are built from), or both. ``stamps`` is ``(table, sizes)``: the table's device copies
        are reused while the first is unchanged, the work lists built from it while the second is."""
        old = getattr(self, "stamps", (0, 0))
        self.stamps = (next(_STAMPS) if addresses or sizes else old[0], next(_STAMPS) if sizes else old[1])

    @property
    def ptrs(self) -> List[int]:
        return self.record[:, 0].tolist()

    @ptrs.setter
    def ptrs(self, values: List[int]) -> None:
        self.record[:, 0] = values

    @property
    def vers(self) -> List[int]:
        return self.record[:, 1].tolist()

    @vers.setter
    def vers(self, values: List[int]) -> None:
        self.record[:, 1] = values

    def __len__(self) -> int:
        return len(self.params)

    def tensors(self) -> List[Tensor]:
        """What the kernels read and write: the parameters, or for DTensors their local shards now."""
        return [p._local_tensor for p in self.params] if self.sharded else self.params

    def view(self, flat: Tensor, i: int) -> Tensor:
        """Parameter ``i``'s slice of a flat buffer, with the (local) parameter's shape and strides."""
        _, _, shape, stride = self.layouts[i]
        return flat.as_strided(shape, stride, self.offsets[i])  # flat buffers are whole allocations

    def state_view(self, flat: Tensor, i: int) -> Tensor:
        """:meth:`view`, as a DTensor placed like parameter ``i`` when that is one."""
        return self._placed(self.view(flat, i), i)

    def _placed(self, v: Tensor, i: int) -> Tensor:
        """``v`` (shaped like parameter ``i``'s local tensor) as a DTensor placed like it when that is one."""
        if not self.sharded:
            return v
        p = self.params[i]
        return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    # ---- 8-bit moments (docs/state-precision.md): codes in ``states``, block scales in ``scales`` -------------
    def blocks(self, i: int) -> slice:
        """Parameter ``i``'s columns of ``scales``: its own blocks (its slice starts at a multiple of QBLOCK)."""
        first = self.offsets[i] // sp.QBLOCK
        return slice(first, first + sp.q8_blocks(math.prod(self.layouts[i][2])))

    def scale_view(self, name: str, i: int, scales: Optional[Tensor] = None) -> Tensor:
        """Parameter ``i``'s block scales of moment ``name`` (a view of ``scales``, the segment's by default)."""
        scales = self.scales if scales is None else scales
        return scales[list(self.states).index(name), self.blocks(i)]

    def exponents(self, name: str, i: int) -> Tensor:
        """Parameter ``i``'s 8-bit moment ``name``: each element's block exponent (the exponent field of its block's
        scale; 0 for a fresh block), uint8, shaped and strided like the parameter and placed like it (a DTensor
        for FSDP2): the form of the block scales that reshards with the parameter. A new tensor, not a view."""
        field = (self.scale_view(name, i).view(torch.int32) >> 23) & 0xFF
        _, _, shape, stride = self.layouts[i]
        n = math.prod(shape)
        flat = field.to(torch.uint8).repeat_interleave(sp.QBLOCK)[:n].contiguous()
        return self._placed(flat.as_strided(shape, stride), i)

    def state_views(self, i: int) -> Dict[str, Tensor]:
        """Parameter ``i``'s moments as the state dict shows them: views shaped like the parameter, and for 8-bit
        moments their block scales as ``<name>_scale`` (1-D fp32)."""
        out = {name: self.state_view(flat, i) for name, flat in self.states.items()}
        if getattr(self, "scales", None) is not None:
            out.update({f"{name}_scale": self.scale_view(name, i) for name in self.states})
        return out

    def moment_values(self, name: str, i: int) -> Tensor:
        """Parameter ``i``'s moment ``name`` as fp32 values shaped like its (local) parameter: 8-bit codes decoded
        (exact), other formats converted exactly."""
        v = self.view(self.states[name], i)
        if v.dtype != torch.uint8:
            return v.float()
        values = sp.q8_dequantize(memory_view(v), self.scale_view(name, i), sp.q8_signed(name))
        _, _, shape, stride = self.layouts[i]
        return values.as_strided(shape, stride)

    def set_moment(self, name: str, i: int, values: Tensor, states: Optional[Dict[str, Tensor]] = None,
                   scales: Optional[Tensor] = None) -> None:
        """Write ``values`` (shaped like parameter ``i``) into its moment ``name`` of ``states`` / ``scales`` (the
        segment's by default): 8-bit codes rounded to nearest (:func:`state_precision.q8_quantize`) with new
        block scales, bf16 rounded to nearest even, fp32 as given."""
        states = self.states if states is None else states
        mine = self.view(states[name], i)
        if mine.dtype != torch.uint8:
            mine.copy_(values)
            return
        _, _, shape, stride = self.layouts[i]
        ordered = torch.empty_strided(shape, stride, dtype=torch.float32, device=mine.device)
        ordered.copy_(values)
        codes, block_scales = sp.q8_quantize(memory_view(ordered), sp.q8_signed(name))
        memory_view(mine).copy_(codes)
        self.scale_view(name, i, scales).copy_(block_scales)

    def carry_states(self, i: int, prev: "Segment", j: int) -> None:
        """``prev``'s parameter ``j``'s moments into parameter ``i`` (see :func:`_carry_moment`)."""
        for name in self.states:
            if name in prev.states:
                _carry_moment(self, i, prev, j, name)

    def remember(self) -> None:
        """Record the parameters' addresses and version counters as the segment's own view of them."""
        if torch.compiler.is_compiling():
            return self.forget()  # not traceable: the next eager step compares every parameter instead
        tensors = self.tensors()
        self.ptrs = addresses(tensors)
        self.vers = versions(tensors)
        self.keep_remainders = False

    def forget(self) -> None:
        """Make the next check treat every parameter as changed (after a load: values are compared then)."""
        self.record.fill(-1)

    @torch.no_grad()
    def follow_values(self, i: int) -> None:
        """Parameter ``i`` was written outside the optimizer (same place, same layout): keep its master where
        the master still rounds to every one of the parameter's values, else rebuild it from them. Decided
        on the device: no host read."""
        if self.master is None:
            return
        p = local(self.params[i])
        if self.remainders:
            # the weight is the truth: its remainder is reset (master = the weight's value), except right after a
            # load_state_dict, whose remainders belong with the checkpoint's weights
            if not self.keep_remainders:
                self.set_master_from(i, p)
            return
        m = self.view(self.master, i)
        m.copy_(_keep_or_rebuild(m, p))


def _keep_or_rebuild(master: Tensor, p: Tensor) -> Tensor:
    """``master`` if it rounds to ``p`` element for element (the user's values did not change), else
    ``p`` in fp32."""
    if p.numel() == 0:
        return master
    same = torch.eq(master.to(p.dtype), p).all()
    return torch.where(same, master, p.float())


def _carry_moment(seg: Segment, i: int, prev: Segment, j: int, name: str) -> None:
    """Moment ``name`` of ``prev``'s parameter ``j`` into ``seg``'s parameter ``i``: 8-bit codes and their scales
    bit for bit while the parameter keeps its shape and strides (its blocks are then the same elements), else
    through the fp32 values (re-encoded to nearest); other formats copied (converted) as values."""
    mine, theirs = seg.view(seg.states[name], i), prev.view(prev.states[name], j)
    if mine.dtype == theirs.dtype == torch.uint8 and seg.layouts[i][2:] == prev.layouts[j][2:]:
        memory_view(mine).copy_(memory_view(theirs))
        seg.scale_view(name, i).copy_(prev.scale_view(name, j))
    elif torch.uint8 in (mine.dtype, theirs.dtype):
        seg.set_moment(name, i, prev.moment_values(name, j))
    else:
        mine.copy_(theirs)


@torch.no_grad()
def build_segment(group_index: int, params: List[Tensor], use_master: bool, state_names: tuple,
                  previous: Dict[int, tuple], precision: Optional[Precision] = None,
                  segment_class: type = None) -> Segment:
    """A segment for ``params``, carrying each one's state from ``previous`` (``id(param) -> (old segment,
    index)``) when it had some: moments and step count follow the parameter to its new device, dtype and
    memory layout; its master is kept where it still rounds to the parameter's values, else rebuilt from
    them (a master of a parameter that had none is built from its values)."""
    # a state that a parameter had keeps following it, whether or not the group's step reads it now
    names = tuple(dict.fromkeys([*state_names, *(name for param in params if id(param) in previous
                                                 for name in previous[id(param)][0].states)]))
    seg = (segment_class or Segment)(group_index, params, use_master, names, precision)
    for i, (param, p) in enumerate(zip(seg.params, seg.tensors())):
        old = previous.get(id(param))
        if old is None:
            if seg.master is not None:
                seg.set_master_from(i, p)
            continue
        prev, j = old
        seg.carry_states(i, prev, j)
        seg.steps[i:i + 1].copy_(prev.steps[j:j + 1])
        seg.has_state[i] = prev.has_state[j]
        if seg.master is not None:
            mine = seg.view(seg.master, i)
            if seg.remainders or (prev.master is not None and prev.master.dtype != torch.float32):
                # remainders follow only a parameter that stayed bf16 and kept its place in memory
                same = seg.remainders and prev.remainders and prev.tensors()[j].data_ptr() == p.data_ptr()
                if same:
                    mine.copy_(prev.view(prev.master, j))
                else:
                    seg.set_master_from(i, p)
            elif prev.master is not None:
                mine.copy_(prev.view(prev.master, j))
                mine.copy_(_keep_or_rebuild(mine, p))
            else:
                mine.copy_(p)
    seg.remember()
    return seg
