"""How a ZeRO-1 optimizer splits its state over the ranks.

The parameters of one dtype, group after group, are laid end to end in their memory order (a *space*), padded
with zeros to ``world * shard`` elements; rank ``r`` owns elements ``[r * shard, (r + 1) * shard)``. That range
cuts through parameters: each piece of a parameter inside it is a *piece*, and the pieces of one param group form
a :class:`ShardSegment`, which holds the rank's fp32 masters, moments and per-piece step counts in flat buffers
laid out by :func:`ampfused.ops.state_layout`, exactly as a fused optimizer's segment does for whole parameters.
Every element of every parameter has exactly one owner, so the state per rank is ``1/world`` of the whole.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..ops import memory_view, state_layout


class Space:
    """The parameters of one dtype and this rank's shard of them, with the communication buffers."""

    def __init__(self, dtype: torch.dtype, entries: List[tuple], world: int, rank: int):
        self.dtype = dtype
        self.groups = [gi for gi, _ in entries]
        self.params: List[Tensor] = [p for _, p in entries]
        self.offsets: List[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard = max(1, -(-total // world))
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

    def __init__(self, space: Space, group_index: int, pieces: List[tuple], use_master: bool, state_names: tuple):
        self.space = space
        self.group_index = group_index
        self.index = [j for j, _, _, _ in pieces]  # parameter index in the space
        self.starts = [a for _, a, _, _ in pieces]
        self.lengths = [n for _, _, n, _ in pieces]
        self.shard_offsets = [o for _, _, _, o in pieces]
        self.offsets, self.total = state_layout(self.lengths)
        device = space.params[0].device
        f32 = dict(dtype=torch.float32, device=device)
        self.master: Optional[Tensor] = torch.zeros(self.total, **f32) if use_master else None
        self.states: Dict[str, Tensor] = {name: torch.zeros(self.total, **f32) for name in state_names}
        self.steps = torch.zeros(len(pieces), **f32)
        self.has_state = [False] * len(pieces)
        self.lr = torch.zeros((), **f32)
        self.lr_value = None
        if self.master is not None:
            for k in range(len(pieces)):
                self.piece(self.master, k).copy_(self.param_piece(k))

    def __len__(self) -> int:
        return len(self.index)

    def piece(self, flat: Tensor, k: int) -> Tensor:
        """Piece ``k``'s slice of one of this segment's flat state buffers."""
        return flat[self.offsets[k]:self.offsets[k] + self.lengths[k]]

    def param_piece(self, k: int) -> Tensor:
        """Piece ``k`` of the parameter itself (a 1-D view of its memory)."""
        return memory_view(self.space.params[self.index[k]])[self.starts[k]:self.starts[k] + self.lengths[k]]

    def shard_piece(self, buf: Tensor, k: int) -> Tensor:
        """Piece ``k`` in a shard-sized buffer (the reduced gradients, the outgoing parameters)."""
        return buf[self.shard_offsets[k]:self.shard_offsets[k] + self.lengths[k]]

    def state_bytes(self) -> int:
        flats = list(self.states.values()) + ([self.master] if self.master is not None else [])
        return sum(t.numel() * t.element_size() for t in flats) + self.steps.numel() * self.steps.element_size()


def build_spaces(param_groups: List[dict], world: int, rank: int, use_master, state_names: tuple) -> List[Space]:
    by_dtype: Dict[torch.dtype, List[tuple]] = {}
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            by_dtype.setdefault(p.dtype, []).append((gi, p))
    spaces = []
    for dtype, entries in by_dtype.items():
        space = Space(dtype, entries, world, rank)
        per_group: Dict[int, List[tuple]] = {}
        for gi, j, a, n, o in space.pieces():
            per_group.setdefault(gi, []).append((j, a, n, o))
        with torch.no_grad():
            space.segments = [ShardSegment(space, gi, pieces, use_master(dtype), state_names)
                              for gi, pieces in per_group.items()]
        spaces.append(space)
    return spaces
