"""How a ZeRO-1 optimizer splits its state over the ranks.

The parameters of one dtype, group after group, are laid end to end in their memory order (a *space*), padded
with zeros to ``world * shard`` elements; rank ``r`` owns elements ``[r * shard, (r + 1) * shard)``. That range
cuts through parameters: each piece of a parameter inside it is a *piece*, and the pieces of one param group form
a :class:`ShardSegment`, which holds the rank's masters, moments and per-piece step counts in flat buffers laid
out by :func:`ampfused.ops.state_layout`, exactly as a fused optimizer's segment does for whole parameters.
Every element of every parameter has exactly one owner, so the state per rank is ``1/world`` of the whole.

The state is kept in the precision the optimizer's options ask for (``docs/state-precision.md``), as a fused
optimizer's segment keeps it: fp32 masters, int16 master remainders beside bf16 weights, or none (stochastic
rounding); moments in fp32 or bf16. The stochastic rounding draws by the element's index in the rank's own flat
buffers, keyed by the segment's seed with the rank's shard start folded in (:func:`shard_seed`): ranks draw
independent bits, and a world of one draws what the unsharded optimizer draws; other world sizes draw other bits.

``align`` (1 by default) keeps every parameter's start in the space and every shard boundary at a multiple of
``align`` elements, so a shard cuts a parameter only at multiples of ``align`` of its own elements (a block-wise
state format with blocks of ``align`` elements of each parameter keeps whole blocks per rank).

8-bit moments (uint8 codes, one fp32 scale per block of ``QBLOCK`` elements of a parameter) are such a format: a
space whose moments are uint8 is aligned to ``QBLOCK`` (the least common multiple with ``align``), so each rank
owns whole blocks of each parameter (only a parameter's last block may be partial), its pieces start at multiples
of ``QBLOCK`` in its flat buffers (``state_layout(lengths, QBLOCK)``, as the step op lays them out), and
:attr:`ShardSegment.scales` (``[moments, blocks]`` fp32) holds the scales of exactly the blocks it owns: the same
codes and scales as the unsharded optimizer's blocks of the same elements.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..ops import memory_view, state_layout
from ..ops import state_precision as sp
from ..optim._precision import Precision


def state_dtypes(precision: Precision, dtype: torch.dtype, use_master: bool) -> tuple:
    """``(master dtype or None, moments dtype)`` of the state of ``dtype`` parameters, as a fused optimizer's
    segment keeps it (``ampfused.optim._segment.Segment``)."""
    fmt = precision.master_format(dtype, use_master)
    use_master = use_master and fmt != sp.MASTER_NONE
    master = (torch.int16 if fmt == sp.MASTER_REMAINDER else torch.float32) if use_master else None
    moments = precision.moments if (use_master or dtype in (torch.float32, torch.bfloat16)) else torch.float32
    return master, moments


def master_key(master_dtype) -> str:
    """The state-dict key of a master buffer of ``master_dtype`` (int16: the remainders)."""
    return "master_remainder" if master_dtype == torch.int16 else "master_param"


def shard_seed(precision: Precision, group_index: int, dtype: torch.dtype, device, lo: int) -> Tensor:
    """The seed of one rank's segment: the unsharded segment's (:meth:`Precision.segment_seed`) xor a hash of
    the rank's first element ``lo`` in the space (0 on rank 0, so a world of one draws as the unsharded
    optimizer does). Computed on the device: no host copy."""
    salt = (sp.mix32((lo >> 32) & sp.M32) << 32) | sp.mix32(lo & sp.M32)  # mix32(0) == 0
    salt = salt - (1 << 64) if salt >= 1 << 63 else salt
    return torch.bitwise_xor(precision.segment_seed(group_index, dtype, device), salt)


class Space:
    """The parameters of one dtype and this rank's shard of them, with the communication buffers."""

    def __init__(self, dtype: torch.dtype, entries: List[tuple], world: int, rank: int, align: int = 1):
        self.dtype = dtype
        self.groups = [gi for gi, _ in entries]
        self.params: List[Tensor] = [p for _, p in entries]
        self.offsets: List[int] = []
        total = 0
        for p in self.params:
            total = -(-total // align) * align
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard = max(1, -(-total // (world * align))) * align
        self.lo = rank * self.shard
        device = self.params[0].device
        self.comm = torch.zeros(self.shard * world, dtype=dtype, device=device)  # gradients in, parameters out
        self.grad_shard = torch.zeros(self.shard, dtype=dtype, device=device)
        self.param_shard = torch.zeros(self.shard, dtype=dtype, device=device)
        self.segments: List[ShardSegment] = []

    def region(self, buf: Tensor, j: int) -> Tensor:
        """Parameter ``j``'s elements (memory order) in a whole-space buffer."""
        return buf[self.offsets[j]:self.offsets[j] + self.params[j].numel()]

    def pieces(self):
        """``(group index, parameter index, start in the parameter, length, offset in the shard)`` of every
        piece this rank owns, in order."""
        lo, hi = self.lo, self.lo + self.shard
        for j, p in enumerate(self.params):
            start, end = max(lo, self.offsets[j]), min(hi, self.offsets[j] + p.numel())
            if start < end:
                yield self.groups[j], j, start - self.offsets[j], end - start, start - lo


class ShardSegment:
    """This rank's pieces of one param group in one space, and the optimizer's state for them."""

    def __init__(self, space: Space, group_index: int, pieces: List[tuple], use_master: bool, state_names: tuple,
                 precision: Precision = Precision()):
        self.space = space
        self.group_index = group_index
        self.index = [j for j, _, _, _ in pieces]  # parameter index in the space
        self.starts = [a for _, a, _, _ in pieces]
        self.lengths = [n for _, _, n, _ in pieces]
        self.shard_offsets = [o for _, _, _, o in pieces]
        device = space.params[0].device
        f32 = dict(dtype=torch.float32, device=device)
        master_dtype, moments = state_dtypes(precision, space.dtype, use_master)
        # 8-bit moments: pieces start at multiples of QBLOCK (each block of codes is one parameter's), as the step
        # op lays them out; the space's alignment makes every piece start at a block of its parameter
        self.offsets, self.total = (state_layout(self.lengths, sp.QBLOCK) if moments == torch.uint8 and state_names
                                    else state_layout(self.lengths))
        self.master: Optional[Tensor] = (torch.zeros(self.total, dtype=master_dtype, device=device)
                                         if master_dtype is not None else None)  # remainders 0: the weights' values
        # the states a step of this group reads (SGD's momentum buffer only once a step has momentum: then
        # :meth:`with_states`)
        self.states: Dict[str, Tensor] = {name: torch.zeros(self.total, dtype=moments, device=device)
                                          for name in state_names}
        # 8-bit moments' block scales: one row per moment (``states``' order), one column per block of the flat
        # buffers (zero scales decode fresh all-zero codes as zeros)
        self.scales: Optional[Tensor] = (torch.zeros(len(state_names), sp.q8_blocks(self.total), **f32)
                                         if moments == torch.uint8 and state_names else None)
        self.use_master, self.precision, self.pieces = use_master, precision, pieces
        draws = precision.master_format(space.dtype, use_master) == sp.MASTER_NONE
        self.seed: Optional[Tensor] = (shard_seed(precision, group_index, space.dtype, device, space.lo)
                                       if draws or moments in sp.COMPACT_STATE_DTYPES else None)
        self.steps = torch.zeros(len(pieces), **f32)
        self.has_state = [False] * len(pieces)
        self.lr = torch.zeros((), **f32)
        self.lr_value = None
        if self.master is not None and self.master.dtype == torch.float32:
            for k in range(len(pieces)):
                self.piece(self.master, k).copy_(self.param_piece(k))

    def __len__(self) -> int:
        return len(self.index)

    def piece(self, flat: Tensor, k: int) -> Tensor:
        """Piece ``k``'s slice of one of this segment's flat state buffers."""
        return flat[self.offsets[k]:self.offsets[k] + self.lengths[k]]

    def blocks(self, k: int) -> slice:
        """Piece ``k``'s columns of :attr:`scales` (8-bit moments): its own blocks."""
        first = self.offsets[k] // sp.QBLOCK
        return slice(first, first + sp.q8_blocks(self.lengths[k]))

    @torch.no_grad()
    def with_states(self, names) -> "ShardSegment":
        """This segment laid out for its states and ``names`` (8-bit moments place pieces at multiples of QBLOCK),
        carrying its masters, states, step counts and lr."""
        names = tuple(dict.fromkeys([*self.states, *names]))
        new = ShardSegment(self.space, self.group_index, self.pieces, self.use_master, names, self.precision)
        for k in range(len(self)):
            for name, flat in self.states.items():
                new.piece(new.states[name], k).copy_(self.piece(flat, k))
                if self.scales is not None:
                    new.scale_view(name, k).copy_(self.scale_view(name, k))
            if self.master is not None:
                new.piece(new.master, k).copy_(self.piece(self.master, k))
        new.steps.copy_(self.steps)
        new.has_state, new.lr_value = list(self.has_state), None
        return new

    def scale_view(self, name: str, k: int, scales: Optional[Tensor] = None) -> Tensor:
        """Piece ``k``'s block scales of moment ``name`` (a view of ``scales``, the segment's by default)."""
        scales = self.scales if scales is None else scales
        return scales[list(self.states).index(name), self.blocks(k)]

    def param_piece(self, k: int) -> Tensor:
        """Piece ``k`` of the parameter itself (a 1-D view of its memory)."""
        return memory_view(self.space.params[self.index[k]])[self.starts[k]:self.starts[k] + self.lengths[k]]

    def shard_piece(self, buf: Tensor, k: int) -> Tensor:
        """Piece ``k`` in a shard-sized buffer (the reduced gradients, the outgoing parameters)."""
        return buf[self.shard_offsets[k]:self.shard_offsets[k] + self.lengths[k]]

    def state_bytes(self) -> int:
        flats = list(self.states.values()) + [t for t in (self.master, self.scales) if t is not None]
        return sum(t.numel() * t.element_size() for t in flats) + self.steps.numel() * self.steps.element_size()


def build_spaces(param_groups: List[dict], world: int, rank: int, use_master, state_names: List[tuple],
                 precision: Precision = Precision(), align: int = 1) -> List[Space]:
    """This rank's spaces (one per dtype) and their shard segments; ``state_names[gi]``: the states a step of
    param group ``gi`` reads."""
    by_dtype: Dict[torch.dtype, List[tuple]] = {}
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            by_dtype.setdefault(p.dtype, []).append((gi, p))
    spaces = []
    for dtype, entries in by_dtype.items():
        q8 = state_dtypes(precision, dtype, use_master(dtype))[1] == torch.uint8
        space = Space(dtype, entries, world, rank, math.lcm(align, sp.QBLOCK) if q8 else align)
        per_group: Dict[int, List[tuple]] = {}
        for gi, j, a, n, o in space.pieces():
            per_group.setdefault(gi, []).append((j, a, n, o))
        with torch.no_grad():
            space.segments = [ShardSegment(space, gi, pieces, use_master(dtype), state_names[gi], precision)
                              for gi, pieces in per_group.items()]
        spaces.append(space)
    return spaces
