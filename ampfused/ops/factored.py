"""The factored state layout (``layout="factored"`` in a step op's record): a parameter of two or more dimensions
keeps its second moment as a row and a column vector (the leading dimensions a batch), any other keeps a vector
shaped like itself; one flat buffer (``factors``) holds them all, each parameter's slice where
:func:`factor_layout` places it. The layout's input rule is :func:`check_factors`."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from . import checks
from .reference_common import STATE_ALIGN, state_layout


def factored(shape: Sequence[int]) -> bool:
    """Whether a parameter of this shape keeps row and column factors (torch: ``grad.dim() > 1``)."""
    return len(shape) > 1


def factor_dims(shape: Sequence[int]) -> Tuple[int, int, int]:
    """``(B, R, C)`` of a factored shape: the leading dimensions as one batch, the last two as rows, columns."""
    return math.prod(shape[:-2]), int(shape[-2]), int(shape[-1])


def factor_size(shape: Sequence[int]) -> int:
    """Elements of ``factors`` a parameter of this shape owns: ``B*R + B*C`` (rows, then columns) when factored,
    else its number of elements."""
    if factored(shape):
        b, r, c = factor_dims(shape)
        return b * r + b * c
    return math.prod(shape)


def factor_layout(shapes: Sequence[Sequence[int]], align: int = STATE_ALIGN) -> Tuple[List[int], int]:
    """``(offsets, total)`` of each parameter's slice of ``factors`` (:func:`state_layout` of the sizes)."""
    return state_layout([factor_size(s) for s in shapes], align)


def factor_views(factors: Tensor, offset: int, shape: Sequence[int]) -> dict:
    """A parameter's state as torch.optim shows a factored second moment, as views of ``factors``: ``row_var``
    shaped ``[..., R, 1]`` and ``col_var`` ``[..., 1, C]`` (contiguous) when factored, else ``variance`` shaped
    like the parameter (contiguous)."""
    shape = tuple(shape)
    if not factored(shape):
        n = math.prod(shape)
        return {"variance": factors[offset:offset + n].view(shape)}
    b, r, c = factor_dims(shape)
    rows = factors[offset:offset + b * r].view(shape[:-1] + (1,))
    cols = factors[offset + b * r:offset + b * r + b * c].view(shape[:-2] + (1, c))
    return {"row_var": rows, "col_var": cols}


def check_factors(name: str, factors, params, master, device) -> None:
    """The rule of a factored state buffer: flat, on the step's device, ``factor_layout``'s total of elements,
    fp32 or fp64 (fp32 only with int16 master remainders; fp64 only with an fp64 master or fp64 parameters)."""
    _, total = factor_layout([tuple(p.shape) for p in params])
    dtypes = (torch.float32, torch.float64) if master is None or master.dtype != torch.int16 else (torch.float32,)
    checks.tensor(name, factors, dtypes=dtypes, flat=True, device=device, numel=total)
    if factors.dtype == torch.float64 and master is not None and master.dtype != torch.float64:
        raise TypeError(f"{name} is float64: the fp64 form needs a float64 master (or float64 params)")


# ---- a factored step over the shards of parameters split over ranks (FSDP2, ZeRO-1) ---------------------------
# Its sums over a whole parameter (of the gradient's squares along rows or columns, of the weight's and the
# update's squares, of a matrix's new row factors) are partial on each rank where the parameter is split across
# them: the step runs in three phases, each rank's sums summed over the ranks between them (ShardSums).
SPLIT_NONE, SPLIT_ROWS, SPLIT_COLS = 0, 1, 2
SH_COLS = 9  # ints per parameter of ShardSums.info


def shard_sums(shape: Sequence[int], dim) -> Tuple[bool, bool]:
    """For a parameter split over ranks along ``dim`` (None: not split), whether its row sums (over columns) and
    its column sums (over rows) are partial on each rank: ``(dim is the column dimension, dim is the row
    dimension)`` for a factored shape; a split along a batch dimension leaves both whole."""
    if dim is None or not factored(shape):
        return False, False
    dim = dim % len(shape)
    return dim == len(shape) - 1, dim == len(shape) - 2


def split_code(shape: Sequence[int], dim) -> int:
    """SPLIT_ROWS when the rows of a factored parameter are split over ranks (its column sums and the sum of its
    row factors are partial here), SPLIT_COLS when its columns are (its row sums are), else SPLIT_NONE."""
    row_partial, col_partial = shard_sums(shape, dim)
    return SPLIT_ROWS if col_partial else SPLIT_COLS if row_partial else SPLIT_NONE


class ShardSums:
    """Where a sharded factored step keeps its sums over whole parameters, and which of them are partial.

    ``sums`` (fp64, on the step's device) holds, for each parameter ``i``: the sum of ``w*w`` and of ``u*u``,
    the sums of each matrix's new row factors (``B``), of the gradient's squares along each row (``B*R``, local
    rows) and each column (``B*C``, local columns). ``first`` is the slice summed over the ranks after phase 1
    (every ``w*w``, and the partial vectors), ``second`` the one summed after phase 2 (every ``u*u``); the
    rest is whole on each rank. ``info`` holds ``SH_COLS`` ints per parameter, as the kernels read them after
    the step's table: its split code, the whole parameter's numel, rows and columns (0, 0 for a vector), the
    offsets in ``sums`` of its ``w*w``, ``u*u``, row-factor sums, row sums and column sums.

    ``shapes``: the local pieces' shapes; ``full_shapes``: the whole parameters'; ``dims``: the dimension each
    is split along (None: whole here). A phase is ``(phase, ShardSums)`` on the step call (``StepCall.shard``):
    phase 1 writes the sums of the gradient and the weight (and, rows split, of the new row factors) and nothing
    else; phase 2 writes the factors and the sum of ``u*u``; phase 3 the weights, masters and step counts.
    """

    def __init__(self, shapes, full_shapes, dims, device):
        self.shapes = [tuple(s) for s in shapes]
        self.full_shapes = [tuple(s) for s in full_shapes]
        self.dims = list(dims)
        n = len(self.shapes)
        splits = [split_code(f, d) for f, d in zip(self.full_shapes, self.dims)]
        offs = {}
        at = n  # region first: every w*w, then the partial vectors
        vectors = []  # (parameter, what, size, partial)
        for i, (shape, split) in enumerate(zip(self.shapes, splits)):
            if factored(shape):
                b, r, c = factor_dims(shape)
                vectors += [(i, "rsum", b, split == SPLIT_ROWS), (i, "rowg", b * r, split == SPLIT_COLS),
                            (i, "colg", b * c, split == SPLIT_ROWS)]
        for i, what, size, partial in vectors:
            if partial:
                offs[i, what], at = at, at + size
        self.first = slice(0, at)
        self.second = slice(at, at + n)
        at += n
        for i, what, size, partial in vectors:
            if not partial:
                offs[i, what], at = at, at + size
        self.info: List[int] = []
        for i, (shape, full, split) in enumerate(zip(self.shapes, self.full_shapes, splits)):
            rc = list(factor_dims(full)[1:]) if factored(full) else [0, 0]
            self.info += [split, math.prod(full), *rc, i, self.second.start + i, offs.get((i, "rsum"), 0),
                          offs.get((i, "rowg"), 0), offs.get((i, "colg"), 0)]
        self.sums = torch.zeros(max(1, at), dtype=torch.float64, device=device)

    @property
    def written(self) -> List[torch.Tensor]:
        """What a phase writes besides the step's tensors (``StepCall.tensors_written``)."""
        return [self.sums]

    def row(self, i: int) -> List[int]:
        """Parameter ``i``'s ``SH_COLS`` ints."""
        return self.info[i * SH_COLS:(i + 1) * SH_COLS]
