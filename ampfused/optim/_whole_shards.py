"""A split step over FSDP2's shards: the function between its two passes needs whole matrices, a rank holds a piece
of each.

Between the step's two elementwise passes (its reference's ``<op>shard_`` phases 1 and 2, which run on each rank's
pieces as any fused step does), the inputs in a segment's scratch travel to the ranks that apply the function and
back:

1. every matrix split along one of its last two dimensions is given to one rank of the split's process group
   (its owner), balanced by the cost of a matrix iteration (``m n min(m, n)`` per matrix: the largest first, each
   to the least loaded rank, the lowest rank on a tie: the same plan on every rank, from the shapes alone);
2. one ``all_to_all_single`` sends each rank's pieces to their owners, who join them into whole matrices (in the
   scratch's dtype);
3. each rank applies the function to the matrices it owns, one batch per shape of matrix;
4. one ``all_to_all_single`` returns each rank's pieces of the results, written where the inputs were.

A parameter whose pieces are whole matrices (a stack of experts split along its first dimension, or one held whole
on every rank) is done where it is, without a message. When the function treats each matrix of a batch on its own,
each matrix's result is the same bits as in one process, so the step is the single process's bit for bit when
nothing else differs (the global norm's sum is added in another order: with a clip, the clip coefficient may
differ in its last bit).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..ops.reference_common import from_logical_, to_logical


def rows_of(size: int, world: int, rank: int) -> Tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s piece of a dimension of ``size`` split as FSDP2 splits it
    (``torch.chunk``: pieces of ``ceil(size / world)``, empty past the last)."""
    per = -(-size // world) if size else 0
    start = min(size, rank * per)
    return start, min(size, start + per) - start


def owners(costs: Sequence[int], world: int) -> List[int]:
    """The rank that does each matrix: the costliest first, each to the least loaded rank (the lowest on a tie),
    the same on every rank."""
    load = [0] * world
    out = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[j] = r
        load[r] += costs[j]
    return out


def _batched(fn: Callable[[Tensor], Tensor], mats: Dict[int, Tensor], shapes: Dict[int, Tuple[int, ...]]) -> None:
    """``mats[j]`` (of shape ``shapes[j]``) replaced by ``fn`` of it, one call per shape of matrix (the last two
    dimensions) over every matrix of that shape, in the order of ``mats``."""
    by_shape: Dict[Tuple[int, ...], List[int]] = {}
    for j in mats:
        by_shape.setdefault(tuple(shapes[j][-2:]), []).append(j)
    for (a, b), idx in by_shape.items():
        xs = [mats[j].reshape(-1, a, b) for j in idx]
        out = fn(torch.cat(xs))
        k = 0
        for j, x in zip(idx, xs):
            mats[j] = out[k:k + len(x)].reshape(shapes[j])
            k += len(x)


class WholeShards:
    """One segment's plan: its scratch (the split step's: a flat ``buffer`` laid out as the state, ``piece(i)`` and
    ``key``), the parameters done where they are, and for the others their split dimension,
    each rank's piece and their owner, with the message sizes.

    ``params``: the segment's DTensor parameters; ``locals_``: this rank's pieces of them (the tensors the step's
    passes read); ``dims``: the dimension each is split along (None: whole here); ``group``: the process group of
    the split (its size and this rank's place in it; the group itself is given to each exchange: a plan keeps no
    process group, so the optimizer still copies and pickles); ``who``: the optimizer, for messages."""

    def __init__(self, params: Sequence[Tensor], locals_: Sequence[Tensor], dims: Sequence[Optional[int]], group,
                 scratch, who: str):
        import torch.distributed as dist
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        full = [tuple(p.shape) for p in params]
        self.scratch = scratch
        self.key = (scratch.key, tuple(dims), self.world, self.rank)
        self.here: List[int] = []  # done where they are
        self.moved: List[int] = []  # sent to their owners
        self.dims: Dict[int, int] = {}
        for j, (shape, d) in enumerate(zip(full, dims)):
            if d is None or d < len(shape) - 2 or self.world == 1:
                self.here.append(j)
                continue
            start, n = rows_of(shape[d], self.world, self.rank)
            want = shape[:d] + (n,) + shape[d + 1:]
            if tuple(locals_[j].shape) != want:
                raise RuntimeError(f"a DTensor parameter of shape {shape} split along dimension {d} over {self.world} "
                                   f"ranks has a local piece of shape {tuple(locals_[j].shape)} on rank {self.rank}, "
                                   f"not torch.chunk's {want}: {who} joins FSDP2's pieces (torch.chunk's) into "
                                   "whole matrices")
            self.moved.append(j)
            self.dims[j] = d
        self.full = full
        costs = []
        for j in self.moved:
            a, b = full[j][-2:]
            costs.append(a * b * min(a, b) * math.prod(full[j][:-2]))
        self.owner = dict(zip(self.moved, owners(costs, self.world)))
        # elements of each parameter's piece on each rank
        self.sizes = {j: [self._numel(j, r) for r in range(self.world)] for j in self.moved}
        self.send_splits = [sum(self.sizes[j][self.rank] for j in self.moved if self.owner[j] == r)
                            for r in range(self.world)]
        self.recv_splits = [sum(self.sizes[j][r] for j in self.mine) for r in range(self.world)]

    @property
    def mine(self) -> List[int]:
        return [j for j in self.moved if self.owner[j] == self.rank]

    def _shape(self, j: int, r: int) -> Tuple[int, ...]:
        shape, d = self.full[j], self.dims[j]
        return shape[:d] + (rows_of(shape[d], self.world, r)[1],) + shape[d + 1:]

    def _numel(self, j: int, r: int) -> int:
        n = 1
        for s in self._shape(j, r):
            n *= s
        return n

    @torch.no_grad()
    def apply_(self, locals_: Sequence[Tensor], group, fn: Callable[[Tensor], Tensor]) -> None:
        """Between the phases: every input in the scratch replaced by ``fn`` of its whole matrix (``fn``: a stack
        ``[k, m, n]`` in the scratch's dtype to one of the same shape and dtype); a collective over ``group``, the
        split's, when any matrix is split: every rank calls it, each step."""
        sc = self.scratch
        if self.here:
            mats = {j: to_logical(sc.piece(j), locals_[j]) for j in self.here}
            _batched(fn, mats, {j: tuple(locals_[j].shape) for j in self.here})
            for j, x in mats.items():
                from_logical_(sc.piece(j), x, locals_[j])
        if not self.moved:
            return
        import torch.distributed as dist
        dtype, device = sc.buffer.dtype, sc.buffer.device
        out = [to_logical(sc.piece(j), locals_[j]).reshape(-1) for r in range(self.world) for j in self.moved
               if self.owner[j] == r]
        send = torch.cat(out) if out else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(self.recv_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, self.recv_splits, self.send_splits, group=group)
        # the pieces from each rank, in the order the ranks sent them: per source rank, my matrices in order
        whole: Dict[int, List[Tensor]] = {j: [] for j in self.mine}
        at = 0
        for r in range(self.world):
            for j in self.mine:
                n = self.sizes[j][r]
                whole[j].append(recv[at:at + n].view(self._shape(j, r)))
                at += n
        joined = {j: torch.cat(parts, dim=self.dims[j]) for j, parts in whole.items()}
        _batched(fn, joined, {j: self.full[j] for j in self.mine})
        back = [joined[j].narrow(self.dims[j], *rows_of(self.full[j][self.dims[j]], self.world, r)).reshape(-1)
                for r in range(self.world) for j in self.mine]
        send = torch.cat(back) if back else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(self.send_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, self.send_splits, self.recv_splits, group=group)
        at = 0
        for r in range(self.world):
            for j in self.moved:
                if self.owner[j] != r:
                    continue
                n = self.sizes[j][self.rank]
                from_logical_(sc.piece(j), recv[at:at + n].view(self._shape(j, self.rank)), locals_[j])
                at += n
