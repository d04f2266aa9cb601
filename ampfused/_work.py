"""Work lists of a tensor table, and the page-locked staging that uploads them without a host wait.

The CUDA and Triton steps read the parameters and gradients through a table of their addresses (``step_args.h``)
and walk it by *work items*: for each table row whose numel is positive, ``k = min(ceil(numel / chunk), cap)``
items ``i = 0 .. k-1``, written as

* ``(row << shift) | i``, one int64 each (``shift >= 0``): the CUDA kernels' chunk list and K1 column list;
* the pair ``(row, i * chunk)`` (``shift < 0``): the Triton kernels' chunk list.

A step whose table changed (a gradient appeared or went, a load, a new group) builds its table and work lists on
the host and uploads them; one whose table changed only in its addresses (fresh gradient tensors of the same
sizes) uploads the table alone (:func:`upload_table`) and keeps the lists already on the device. Both halves are
written so the host never waits for the device:

* the lists are written by one C++ pass (``ampfused._host.work_list``) straight into the staging buffer, with a
  numpy path of the same result where ``_host`` is not built (:func:`python_work_list`, also the tests' oracle);
* the staging buffer is page-locked memory from torch's caching host allocator (:func:`staging`): a copy from
  it with ``non_blocking=True`` is a true asynchronous DMA, ordered on the stream, and the allocator does not
  hand the block out again until that copy has completed (it records an event on the copy's stream). A copy
  from ordinary (pageable) memory would instead let CUDA wait for the stream to drain first: a host wait that
  torch's sync-debug mode does not report.
* nothing keeps a staging buffer past its copy: freed at once, its block is free again as soon as the copy is
  done, so the next changed table reuses it. Kept with the cached device work (one block per cache entry, the
  Python path's entry holding its own for good), a changed table found every block of its size held and had
  the allocator make a new one: ``cudaHostAlloc``, which CUDA lists among the calls that synchronize
  implicitly, inside a step, with the device busy.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

import numpy
import torch

from . import _native

_HOST: Any = False
TABLE_COLS = 4  # columns of a step's tensor table (step_args.h: kTableCols)
NUMEL_COL = 2   # its numel column (kColNumel)
UNCAPPED = 1 << 62


def _host():
    """ampfused._host, or None where it is not built."""
    global _HOST
    if _HOST is False:
        _HOST = _native.optional("host")
    return _HOST


def as_table(table, cols: int) -> numpy.ndarray:
    """A table given as a flat list of ints or an int64 array, as a C-contiguous int64 ``[rows, cols]`` array."""
    t = numpy.ascontiguousarray(table, dtype=numpy.int64)
    return t.reshape(-1, cols)


def python_work_list(table: numpy.ndarray, numel_col: int, chunk: int, cap: int, shift: int,
                     out: Optional[numpy.ndarray] = None) -> int:
    """The numpy form of ``ampfused._host.work_list``: same items, same order (see the module docstring)."""
    n = table[:, numel_col]
    rows = numpy.flatnonzero(n > 0)
    k = numpy.minimum((n[rows] - 1) // chunk + 1, cap)
    total = int(k.sum())
    if out is None or total == 0:
        return total
    row = numpy.repeat(rows.astype(numpy.int64), k)
    first = numpy.cumsum(k) - k
    i = numpy.arange(total, dtype=numpy.int64) - numpy.repeat(first, k)
    if shift >= 0:
        out[:total] = (row << shift) | i
    else:
        out[0:2 * total:2] = row
        out[1:2 * total:2] = i * chunk
    return total


def work_list(table: numpy.ndarray, numel_col: int, chunk: int, cap: int, shift: int,
              out: Optional[numpy.ndarray] = None) -> int:
    """Count the work items of ``table`` (a C-contiguous int64 ``[rows, cols]`` array), and write them into
    ``out`` (a contiguous int64 array with room for them) when given; returns the count."""
    if chunk <= 0 or cap <= 0:
        raise ValueError(f"work_list: chunk and cap must be positive, got chunk={chunk}, cap={cap}")
    host = _host()
    if host is None:
        return python_work_list(table, numel_col, chunk, cap, shift, out)
    if table.dtype != numpy.int64 or table.ndim != 2 or not table.flags.c_contiguous:
        raise ValueError("work_list: table must be a C-contiguous 2-D int64 array")
    rows, cols = table.shape
    count = host.work_list(table.ctypes.data, rows, cols, numel_col, chunk, cap, shift, 0)
    if out is None or count == 0:
        return count
    if out.dtype != numpy.int64 or not out.flags.c_contiguous or out.size < count * (1 if shift >= 0 else 2):
        raise ValueError(f"work_list: out must be a contiguous int64 array with room for {count} items")
    return host.work_list(table.ctypes.data, rows, cols, numel_col, chunk, cap, shift, out.ctypes.data)


def staging(n: int, device: torch.device) -> Tuple[torch.Tensor, numpy.ndarray]:
    """A host int64 buffer of ``n`` elements to upload to ``device`` from, and a numpy view to fill it through:
    page-locked (torch's caching host allocator) when ``device`` is a CUDA device, ordinary memory otherwise."""
    pinned = device.type == "cuda"
    buf = torch.empty(max(n, 1), dtype=torch.int64, pin_memory=pinned)
    # a view of the new buffer by its address (it reads nothing: Tensor.numpy would look like a host read)
    view = numpy.ctypeslib.as_array((ctypes.c_int64 * buf.numel()).from_address(buf.data_ptr()))
    return buf, view


def upload_table(address: int, n: int, device: torch.device) -> torch.Tensor:
    """The device copy of ``n`` int64 at host ``address`` (a tensor table), staged as :func:`staging` stages and
    uploaded as :func:`upload` uploads; on the CPU a copy of its own (the table is rewritten in place)."""
    host = torch.empty(max(n, 1), dtype=torch.int64, pin_memory=device.type == "cuda")
    ctypes.memmove(host.data_ptr(), address, 8 * n)
    return upload(host, device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The device copy of ``host`` (from :func:`staging`), ordered on the current stream, with no host wait on a
    CUDA device (the source is page-locked). On the CPU (the Triton interpreter) the buffer itself."""
    if device.type != "cuda":
        return host
    dev = torch.empty(host.numel(), dtype=torch.int64, device=device)
    dev.copy_(host, non_blocking=True)
    return dev


def cuda_work(table, chunk: int, tile: int, max_partials: int, shift: int,
              device: torch.device) -> Tuple[torch.Tensor, int, int, int]:
    """The CUDA step's host buffer: ``[table | chunks | K1 columns]`` (see ``ampfused/ops/cuda.py``), staged for
    an upload to ``device``; with the number of table ints, of chunks and of columns."""
    t = as_table(table, TABLE_COLS)
    num_chunks = work_list(t, NUMEL_COL, chunk, UNCAPPED, shift)
    num_columns = work_list(t, NUMEL_COL, tile, max_partials, shift)
    n_table = t.size
    host, view = staging(n_table + num_chunks + num_columns, device)
    view[:n_table] = t.reshape(-1)
    work_list(t, NUMEL_COL, chunk, UNCAPPED, shift, view[n_table:n_table + num_chunks])
    work_list(t, NUMEL_COL, tile, max_partials, shift, view[n_table + num_chunks:n_table + num_chunks + num_columns])
    return host, n_table, num_chunks, num_columns
