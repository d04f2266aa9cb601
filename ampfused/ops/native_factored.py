"""The table of a factored-state step (``layout="factored"`` in its record: each matrix's second moment kept as
row and column factors, each other parameter's whole) that the native and Triton kernels read, and the rules their
code relies on. A table is one row of ``AF_COLS`` ints per parameter: param and grad addresses, numel (``NO_GRAD``
without a gradient), the offset of its weights in ``master`` and of its state in ``factors``, its number of
dimensions, then ``AF_MAX_DIMS`` sizes and ``AF_MAX_DIMS`` strides (elements); the modules' constants of the same
names (``step_constants()``) say so too. A phase over shards follows the rows with ``SH_COLS`` ints per parameter
(``ops.factored.ShardSums``). The cuda backend also reads a tile layout of the table (:func:`tiles`)."""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from .. import _native as _N
from . import native_args as _A
from .factored import SH_COLS, factor_layout
from .reference_common import state_layout

AF_MAX_DIMS = 8
AF_COLS = 6 + 2 * AF_MAX_DIMS  # the modules' kAfCols (step_constants()["AF_COLS"])


def table(params: List[Tensor], grads: List[Optional[Tensor]], shard: Optional[tuple] = None) -> List[int]:
    """The table's rows of these tensors; with ``shard`` (a phase over shards, ``StepCall.shard``), followed by its
    ``SH_COLS`` ints per parameter (``ShardSums.info``)."""
    if shard is not None and len(shard[1].info) != len(params) * SH_COLS:
        raise ValueError(f"the shard sums are laid out for {len(shard[1].info) // SH_COLS} parameters, the step "
                         f"has {len(params)}")
    offsets, _ = state_layout([p.numel() for p in params])
    foffsets, _ = factor_layout([tuple(p.shape) for p in params])
    rows: List[int] = []
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.dim() > AF_MAX_DIMS:
            raise ValueError(f"params[{i}] has {p.dim()} dimensions: a factored step on a native or Triton backend "
                             f"takes at most {AF_MAX_DIMS} (the reference backend takes any)")
        pad = [0] * (AF_MAX_DIMS - p.dim())
        rows += [p.data_ptr(), 0 if g is None else g.data_ptr(), _N.NO_GRAD if g is None else p.numel(),
                 offsets[i], foffsets[i], p.dim()] + list(p.shape) + pad + list(p.stride()) + pad
    return rows if shard is None else rows + shard[1].info


def shard_slots(shard: Optional[tuple], device: torch.device) -> dict:
    """The slots of a phase over shards (``StepCall.shard``: ``(phase, ShardSums)``); none for the whole step."""
    if shard is None:
        return {}
    phase, sums = shard
    if phase not in (1, 2, 3):
        raise ValueError(f"a phase over shards is 1, 2 or 3, got {phase!r}")
    if sums.sums.dtype != torch.float64 or sums.sums.device != device:
        raise ValueError(f"the shard sums must be float64 on {device}, got {sums.sums.dtype} on {sums.sums.device}")
    return dict(phase=phase, sums=sums.sums.data_ptr())


# The cuda backend's tiles (a factored step's csrc/cuda/<kernel>.cu): a matrix is cut into bands of whole rows of about
# AF_TILE_ELEMS elements (one band per block and pass), a vector into spans of AF_TILE_ELEMS; the column sums are
# finished in items of AF_COL_CHUNK columns.
AF_TILE_ELEMS = 16384
AF_COL_CHUNK = 256
AF_INFO = 4  # ints per row of the tile layout


def layout(rows: List[int], count: int) -> tuple:
    """What a table's tile layout depends on: each parameter's shape and whether it has no gradient."""
    out = []
    for k in range(count):
        row = rows[k * AF_COLS:(k + 1) * AF_COLS]
        out.append((tuple(row[6:6 + row[5]]), row[2] == _N.NO_GRAD))
    return tuple(out)


def tiles(params: List[Tensor], grads: List[Optional[Tensor]], tile_elems: Optional[int] = None) -> tuple:
    """The tile layout of the cuda backend's factored step over these tensors (:func:`tiles_of`)."""
    return tiles_of(tuple((tuple(p.shape), g is None) for p, g in zip(params, grads)), tile_elems)


def tiles_of(shapes: tuple, tile_elems: Optional[int] = None) -> tuple:
    """The tile layout of the cuda backend's factored step (``shapes``: :func:`layout`'s pairs): ``(info, tiles,
    column items, partials)``. ``info`` holds, for each parameter and one past the last, its first tile, the rows
    of its bands (a vector: the elements of its spans), the offset of its column partial sums (fp64, a band's C
    in a row) and its first column item; a parameter without a gradient has none. ``partials``: the length of the
    column partial sums."""
    tile_elems = AF_TILE_ELEMS if tile_elems is None else int(tile_elems)
    info: List[int] = []
    first = colbase = item = 0
    for shape, no_grad in shapes:
        band = tile_elems
        ntiles = nitems = 0
        if not no_grad and len(shape) > 1:
            lead = math.prod(shape[:-2])
            r, c = shape[-2], shape[-1]
            band = max(1, min(r, tile_elems // max(c, 1)))
            ntiles = lead * (-(-r // band))
            nitems = lead * (-(-c // AF_COL_CHUNK))
        elif not no_grad:
            ntiles = -(-math.prod(shape) // tile_elems)
        info += [first, band, colbase, item]
        first += ntiles
        colbase += ntiles * (shape[-1] if len(shape) > 1 else 0)
        item += nitems
    info += [first, 1, colbase, item]
    return info, first, item, colbase


def check(backend: str, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed) -> tuple:
    """The native step's rules beyond the op's own (ops._public_step's); returns ``(master format,
    seed address)``."""
    fmt, _, seed_ptr = _A.check_step(backend, params, grads, master, [], steps, partials, inv_scale, lr, out_stats,
                                     seed)
    _A.check_state_sizes(backend, [("factors", factors)], factor_layout([tuple(p.shape) for p in params])[1],
                         steps.device)
    if factors.dtype != torch.float32:
        raise TypeError(f"factors must be float32 for the {backend} backend, got {factors.dtype}")
    return fmt, seed_ptr
