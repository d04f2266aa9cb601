"""``adafactor_step_`` on the native backends (``csrc/cpu/adafactor.h``; CUDA: ``csrc/cuda/adafactor.cu``): the
checks the native code relies on and its table, one row of ``AF_COLS`` ints per parameter: param and grad
addresses, numel (``NO_GRAD`` without a gradient), the offset of its weights in ``master`` and of its state in
``factors``, its number of dimensions, then ``AF_MAX_DIMS`` sizes and ``AF_MAX_DIMS`` strides (elements)."""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from .. import _native as _N
from . import native_args as _A
from .reference import state_layout
from .reference_adafactor import factor_layout

AF_MAX_DIMS = 8
AF_COLS = 6 + 2 * AF_MAX_DIMS  # (csrc/cpu/adafactor.h, csrc/cuda/launch.h: kAfCols)


def table(params: List[Tensor], grads: List[Optional[Tensor]]) -> List[int]:
    offsets, _ = state_layout([p.numel() for p in params])
    foffsets, _ = factor_layout([tuple(p.shape) for p in params])
    rows: List[int] = []
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.dim() > AF_MAX_DIMS:
            raise ValueError(f"params[{i}] has {p.dim()} dimensions: the native Adafactor step takes at most "
                             f"{AF_MAX_DIMS} (the reference backend takes any)")
        pad = [0] * (AF_MAX_DIMS - p.dim())
        rows += [p.data_ptr(), 0 if g is None else g.data_ptr(), _N.NO_GRAD if g is None else p.numel(),
                 offsets[i], foffsets[i], p.dim()] + list(p.shape) + pad + list(p.stride()) + pad
    return rows


# The cuda backend's tiles (csrc/cuda/adafactor.cu): a matrix is cut into bands of whole rows of about
# AF_TILE_ELEMS elements (one band per block and pass), a vector into spans of AF_TILE_ELEMS; the column sums are
# finished in items of AF_COL_CHUNK columns.
AF_TILE_ELEMS = 16384
AF_COL_CHUNK = 256
AF_INFO = 4  # ints per row of the tile layout


def tiles(params: List[Tensor], grads: List[Optional[Tensor]], tile_elems: Optional[int] = None) -> tuple:
    """The tile layout of the cuda backend's Adafactor step: ``(info, tiles, column items, partials)``. ``info``
    holds, for each parameter and one past the last, its first tile, the rows of its bands (a vector: the
    elements of its spans), the offset of its column partial sums (fp64, a band's C in a row) and its first column
    item; a parameter without a gradient has none. ``partials``: the length of the column partial sums."""
    tile_elems = AF_TILE_ELEMS if tile_elems is None else int(tile_elems)
    info: List[int] = []
    first = colbase = item = 0
    for p, g in zip(params, grads):
        shape = tuple(p.shape)
        band = tile_elems
        ntiles = nitems = 0
        if g is not None and len(shape) > 1:
            lead = math.prod(shape[:-2])
            r, c = shape[-2], shape[-1]
            band = max(1, min(r, tile_elems // max(c, 1)))
            ntiles = lead * (-(-r // band))
            nitems = lead * (-(-c // AF_COL_CHUNK))
        elif g is not None:
            ntiles = -(-p.numel() // tile_elems)
        info += [first, band, colbase, item]
        first += ntiles
        colbase += ntiles * (shape[-1] if len(shape) > 1 else 0)
        item += nitems
    info += [first, 1, colbase, item]
    return info, first, item, colbase


def check(backend: str, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed) -> tuple:
    """The native step's rules beyond the op's own (ops.adafactor.check_inputs); returns ``(master format,
    seed address)``."""
    fmt, _, seed_ptr = _A.check_step(backend, params, grads, master, [], steps, partials, inv_scale, lr, out_stats,
                                     seed)
    _A.check_state_sizes(backend, [("factors", factors)], factor_layout([tuple(p.shape) for p in params])[1],
                         steps.device)
    if factors.dtype != torch.float32:
        raise TypeError(f"factors must be float32 for the {backend} backend, got {factors.dtype}")
    return fmt, seed_ptr


def adafactor_step_(self, params, grads, master: Optional[Tensor], factors: Tensor, steps: Tensor,
                    partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta2_decay: float,
                    eps1: Optional[float], eps2: float, d: float, weight_decay: float, max_norm: float,
                    maximize: bool = False, seed: Optional[Tensor] = None) -> None:
    """Adafactor (a backend method); math and tensors in :func:`ampfused.ops.reference_adafactor.adafactor_step_`."""
    from .reference_adafactor import EPS1_DEFAULT
    params, grads = list(params), list(grads)
    fmt, seed_ptr = check(self.name, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed)
    partials = _A.partials_arg(partials)
    self._mod().adafactor_step(
        table(params, grads), len(params), _N.DTYPE_CODES[params[0].dtype] if params else 0, _A.grad_code(grads),
        _N.ptr(master), factors.data_ptr(), steps.data_ptr(), _N.SCALAR_CODES[steps.dtype], partials.data_ptr(),
        partials.shape[1], inv_scale.data_ptr(), lr.data_ptr(), _N.SCALAR_CODES[lr.dtype], out_stats.data_ptr(),
        float(beta2_decay), EPS1_DEFAULT if eps1 is None else float(eps1), float(eps2), float(d),
        float(weight_decay), float(max_norm), bool(maximize), *self._device_args(steps.device), fmt, seed_ptr)


_device_tables: dict = {}  # (device index, address of a step tensor) -> _CudaWork
_kept_for_graphs: list = []  # device tables and scratch that a captured CUDA graph may still read


class _CudaWork:
    """What the cuda backend's Adafactor step reads besides the tensors: the table and its tile layout on the
    device (one upload, again whenever the table's ints change: fresh gradient tensors), and the fp64 scratch of
    the partial sums (column sums per band, and per tile the sums of w*w, of the new row factors and of u*u), kept
    while the shapes and the parameters that have a gradient stay the same."""

    def __init__(self, layout: tuple, params, grads, device: torch.device):
        self.layout, self.tile_elems = layout, AF_TILE_ELEMS
        self.info, self.num_tiles, self.num_items, self.num_colparts = tiles(params, grads, self.tile_elems)
        self.scratch = torch.empty(max(1, self.num_colparts + 3 * self.num_tiles), dtype=torch.float64,
                                   device=device)
        self.rows: Optional[List[int]] = None

    def upload(self, rows: List[int], device: torch.device) -> None:
        from .. import _work
        host, view = _work.staging(len(rows) + len(self.info), device)
        view[:len(rows)] = rows
        view[len(rows):len(rows) + len(self.info)] = self.info
        self.table = _work.upload(host, device)  # host goes back to torch's page-locked cache once copied
        self.rows = rows


def _layout(params, grads) -> tuple:
    return tuple((tuple(p.shape), g is None) for p, g in zip(params, grads))


def adafactor_step_cuda(self, params, grads, master: Optional[Tensor], factors: Tensor, steps: Tensor,
                        partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta2_decay: float,
                        eps1: Optional[float], eps2: float, d: float, weight_decay: float, max_norm: float,
                        maximize: bool = False, seed: Optional[Tensor] = None) -> None:
    """Adafactor on the cuda backend (a method of ``CudaBackend``): the table and its tiles uploaded to the device
    once per call site (its step tensor), asynchronously from page-locked memory, and reused while the table holds
    the same ints; one cooperative launch over every tile (csrc/cuda/adafactor.cu)."""
    from .cuda import _capturing, _device_index
    from .reference_adafactor import EPS1_DEFAULT
    params, grads = list(params), list(grads)
    fmt, seed_ptr = check(self.name, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed)
    rows = table(params, grads)
    index = _device_index(steps.device)
    key = (index, steps.data_ptr())
    work = _device_tables.get(key)
    if work is None or work.rows != rows or work.tile_elems != AF_TILE_ELEMS:
        if _capturing(index):
            raise RuntimeError("the cuda backend cannot upload a new Adafactor table while a CUDA graph is being "
                               "captured: run one step eagerly with exactly these tensors before capturing it")
        layout = _layout(params, grads)
        if work is None or work.layout != layout or work.tile_elems != AF_TILE_ELEMS:
            work = _device_tables[key] = _CudaWork(layout, params, grads, steps.device)
        work.upload(rows, steps.device)
    if _capturing(index):
        _kept_for_graphs.append((work.table, work.scratch))  # the tensors the graph reads, not what holds them
    partials = _A.partials_arg(partials)
    self._mod().adafactor_step(
        work.table.data_ptr(), len(params), _N.DTYPE_CODES[params[0].dtype] if params else 0, _A.grad_code(grads),
        _N.ptr(master), factors.data_ptr(), steps.data_ptr(), _N.SCALAR_CODES[steps.dtype], partials.data_ptr(),
        partials.shape[1], inv_scale.data_ptr(), lr.data_ptr(), _N.SCALAR_CODES[lr.dtype], out_stats.data_ptr(),
        float(beta2_decay), EPS1_DEFAULT if eps1 is None else float(eps1), float(eps2), float(d),
        float(weight_decay), float(max_norm), bool(maximize), *self._device_args(steps.device), fmt, seed_ptr,
        work.num_tiles, work.num_items, work.num_colparts, work.scratch.data_ptr(), AF_COL_CHUNK)
