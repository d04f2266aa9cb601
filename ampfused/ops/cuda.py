"""The ``cuda`` backend: the ops on CUDA tensors through ``ampfused._C_cuda``.

K1 (``norm_check``/``unscale_``): a bounded grid, one block per partial; a tensor of ``n`` elements gets
``min(ceil(n / TILE), MAX_PARTIALS_PER_TENSOR)`` partials whose bits depend only on the data and sizes. A dense
gradient (any dimension order) is read in memory order where it lives. The ops take the gradients' addresses as
launch arguments, in launches of up to 48 tensors; the fused optimizers' K1 (``norm_check_tables``) reads them
from the device copy of a segment's tensor table instead (its K1 column list, below): one launch per segment,
the same partials.

K2 (the step) is one launch over all parameters of a step. Their addresses travel in the tensor table
(``step_args.h``), kept in device memory together with two work lists built from it here: the *chunks* (every
``STEP_CHUNK`` elements of every parameter that has a gradient, as ``row << WORK_SHIFT | chunk``) and the K1
*columns* (every partial of those gradients, as ``row << WORK_SHIFT | j``, for ``single_launch`` and the fused
optimizers' K1). They are cached per step tensor (one per optimizer), or for the fused optimizers per segment
table (current while the segment's stamps are those of the upload, ``Segment.restamp``; a table given without
stamps has its bytes compared): a step whose table is the same list of ints as the last one reuses the device
copy, so a warm step uploads and allocates nothing; a table whose sizes did not change (new gradient tensors, the
default loop) is uploaded alone, beside the work lists already on the device; any other changed table and its
work lists are written by one C++ pass into page-locked staging memory and uploaded by an asynchronous copy ordered on
``torch.cuda.current_stream()``, so the host never waits for the device (``ampfused/_work.py``); a changed
table while a CUDA graph is being captured is an error (a captured
step must see the tensors of its warm-up). The kernel is a persistent grid (at most the blocks resident on the
device) whose blocks each reduce all partials in the same order, return at once on found_inf, then walk the
chunks; the last block done adds 1 to ``steps[i]`` of every parameter with a gradient (an integer arrival
counter, one per step tensor, in a slab allocated once per device).

With ``single_launch=True`` (an option of :meth:`CudaBackend.adam_step_` / :meth:`CudaBackend.sgd_step_`) one
cooperative kernel runs K1 over the step's gradients into ``partials`` (then an *output* of shape
``[2, num_partials([n of each gradient])]``), a grid barrier, then K2: the same bits as ``norm_check`` over the
gradients followed by the two-kernel step. The math is ``csrc/include/ampfused/math.h``; the specification is
:mod:`ampfused.ops.reference`.

Compact state (:mod:`ampfused.ops.state_precision`) goes through the same launch, its format read from the
buffers' dtypes. With 8-bit moments (uint8 ``exp_avg``/``exp_avg_sq``/``momentum_buf`` and ``state_scales=``) the
parameters start at multiples of ``QBLOCK`` in the flat buffers, so each 256 consecutive elements of a chunk
(``STEP_CHUNK`` is a multiple of 256) are one block of codes: the kernel's block updates them in registers,
reduces the largest new value of each moment over them, and stores the codes and the block's new scale.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _native, _work
from . import checks
from . import native_factored as _AF
from . import native_args as _A
from .call import StepCall
from .cpu import CpuBackend
from .state_precision import QBLOCK as _QBLOCK

_N = _native
_SLOTS = 4096
_slabs: Dict[int, Tensor] = {}  # device index -> int32[_SLOTS] of zeroed block counters
_slots: Dict[Tuple[int, int], int] = {}  # (device index, address of a step tensor) -> its counter
_prepared: set = set()

_WORKS_LIMIT = 4096
_works: Dict[Tuple[int, int], "_Work"] = {}  # (device index, address of a step tensor) -> its cached work
_kept_for_graphs: List[Tensor] = []  # device work lists and tables that a captured CUDA graph may still read
_factored_tables: Dict[Tuple[int, int], "_FactoredWork"] = {}  # keyed as _works: factored steps' tables
stats = {"uploads": 0}  # tensor tables uploaded to a device so far (a warm step uploads none)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _slab(device: torch.device) -> Tensor:
    index = _device_index(device)
    if index not in _slabs:
        _slabs[index] = torch.zeros(_SLOTS, dtype=torch.int32, device=device)
    return _slabs[index]


def _counter(step: Tensor) -> int:
    """Address of the zeroed int32 in which a step kernel counts its finished blocks (left zero after each
    step). One per step tensor, i.e. per optimizer: steps of different optimizers on concurrent streams or
    in concurrently replayed graphs never share one. The workspace is allocated once per device."""
    key = (_device_index(step.device), step.data_ptr())
    slot = _slots.get(key)
    if slot is None:
        if len(_slots) >= _SLOTS:  # thousands of step tensors: start over (counters are zero between steps)
            _slots.clear()
        slot = _slots[key] = len(_slots)
    return _slab(step.device).data_ptr() + 4 * slot


def work_lists(rows, chunk: int, tile: int, max_partials: int, shift: int,
               device: torch.device = torch.device("cpu")) -> Tuple[Tensor, int, int]:
    """The tensor table (a flat list of ints or an int64 ``[T, 4]`` array, see ``native_args.step_table``) followed
    by its chunk list and its K1 column list, as one host int64 tensor (page-locked when ``device`` is a CUDA
    device, for an upload without a host wait); with the number of chunks and of columns. Built by one C++ pass
    (``ampfused/_work.py``)."""
    host, n_table, num_chunks, num_columns = _work.cuda_work(rows, chunk, tile, max_partials, shift, device)
    return host[:n_table + num_chunks + num_columns], num_chunks, num_columns


class _Work:
    """The device copy of one step's tensor table and its work lists: one int64 tensor ``dev`` (table, chunks,
    columns), or the table alone in ``dev`` and the lists in ``lists`` (a table whose sizes did not change since
    the lists were built: only its addresses are uploaded)."""

    __slots__ = ("basis", "codes", "dev", "lists", "table", "chunks", "num_chunks", "columns", "num_columns",
                 "streams", "list_streams", "captured")

    def __init__(self, basis, codes, dev: Tensor, num_chunks: int, num_columns: int, stream: int,
                 lists: Optional["_Work"] = None):
        self.basis, self.codes, self.dev = basis, codes, dev  # basis, codes: what a later table is compared with
        self.table = dev.data_ptr()
        self.streams = {stream}  # streams whose kernels may read dev (it was allocated on the first)
        if lists is None:
            self.lists, self.list_streams = dev, self.streams
            self.chunks = self.table + 8 * (dev.numel() - num_chunks - num_columns)  # past the table's ints
        else:  # (one set of streams per lists tensor, shared by the works that read it)
            self.lists, self.chunks, self.list_streams = lists.lists, lists.chunks, lists.list_streams
        self.num_chunks = num_chunks
        self.columns = self.chunks + 8 * num_chunks
        self.num_columns = num_columns
        self.captured = False  # read by a captured graph: must outlive this cache entry


def _retire(work: "_Work") -> None:
    if work.captured:
        _kept_for_graphs.extend((work.dev, work.lists))


class _FactoredWork:
    """What a factored step reads besides the tensors: the table and its tile layout on the device (one upload,
    again whenever the table's ints change: fresh gradient tensors), and the fp64 scratch of the partial sums
    (column sums per band, and per tile the sums of w*w, of the new row factors and of u*u), kept while the shapes
    and the parameters that have a gradient stay the same."""

    def __init__(self, layout: tuple, device: torch.device):
        self.layout, self.tile_elems = layout, _AF.AF_TILE_ELEMS
        self.info, self.num_tiles, self.num_items, self.num_colparts = _AF.tiles_of(layout, self.tile_elems)
        self.scratch = torch.empty(max(1, self.num_colparts + 3 * self.num_tiles), dtype=torch.float64,
                                   device=device)
        self.rows: Optional[List[int]] = None
        self.stamp = None  # a fused optimizer's table: the stamp of the rows uploaded

    def upload(self, rows: List[int], device: torch.device) -> None:
        host, view = _work.staging(len(rows) + len(self.info), device)
        view[:len(rows)] = rows
        view[len(rows):len(rows) + len(self.info)] = self.info
        self.table = _work.upload(host, device)  # host goes back to torch's page-locked cache once copied
        self.rows = rows
        stats["uploads"] += 1


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds of torch


def _raw_stream(index: int) -> int:
    """The handle (cudaStream_t) of the current stream of device ``index``: what the module launches on. The
    C-level query: torch.cuda.current_stream() builds a Stream object, a cost that shows in a step's host time."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def _capturing(index: int) -> bool:
    if index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


class CudaBackend(CpuBackend):
    name = "cuda"
    kind = "cuda"
    devices = ("cuda",)
    table_chunk = 1  # K1's columns here come from num_partials of the gradients' sizes

    def unavailable_reason(self) -> Optional[str]:
        why = _native.unavailable_reason(self.kind)
        if why:
            return why
        status = self._mod().device_status()
        if status:
            return f"{status}; built for {_native._describe(_native.build_info(self.kind))}"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device (torch.cuda.is_available() is False)"
        return None

    def _device_args(self, device: torch.device) -> tuple:
        index = _device_index(device)
        if index not in _prepared:  # load all kernels now, not lazily inside a graph capture later
            self._mod().prepare(index)
            _slab(device)
            _prepared.add(index)
        return (index, _raw_stream(index))

    def _scalar_device_args(self, device: torch.device) -> tuple:
        return self._device_args(device)

    # ---- the step ------------------------------------------------------------------------------------
    def _work(self, rows: List[int], codes, steps: Tensor, check) -> _Work:
        """The cached device work of this step call site (its step tensor), uploaded first when its table
        (``rows``) changed (``check`` validates the tensors before a new table is built)."""
        key = (_device_index(steps.device), steps.data_ptr())
        return self._cached_work(key, lambda w: w.basis == rows and w.codes == codes, lambda: rows, lambda: rows,
                                 codes, steps.device, check)

    def _table_work(self, table, code: int, device: torch.device, stamps=None, address=None) -> _Work:
        """The cached device work of a fused optimizer's segment, from its host tensor table (written in place by
        ampfused._host before each step): reused while the table holds the ints last uploaded, uploaded again
        when any changed. ``stamps`` (``Segment.stamps``) say so without reading the table: a new first stamp
        alone (new addresses, as fresh gradient tensors bring) uploads the table and keeps the work lists on
        the device; without stamps the table's bytes are compared with those last uploaded."""
        key = (_device_index(device), "table", table.ctypes.data if address is None else address)
        codes = (code, code)
        if stamps is None:
            now = table.tobytes()
            return self._cached_work(key, lambda w: w.basis == now and w.codes == codes,
                                     lambda: table, lambda: now, codes, device, lambda: None)
        stamps = tuple(stamps)
        return self._cached_work(key, lambda w: w.basis == stamps and w.codes == codes, lambda: table,
                                 lambda: stamps, codes, device, lambda: None,
                                 lambda w: type(w.basis) is tuple and w.basis[1] == stamps[1] and w.codes == codes,
                                 key[2])

    def _cached_work(self, key, same, rows_of, basis, codes, device: torch.device, check,
                     same_sizes=lambda w: False, address=None) -> _Work:
        index = key[0]
        stream = _raw_stream(index)
        capturing = _capturing(index)
        work = _works.get(key)
        if work is None or not same(work):
            if capturing:
                raise RuntimeError(
                    "the cuda backend cannot upload a new tensor table while a CUDA graph is being captured: the "
                    "parameters and gradients of this step (their addresses, sizes, dtypes, or which gradients are "
                    "None) are not those of the last step run eagerly with these step counts; run one step eagerly "
                    "with exactly these tensors before capturing it (the usual warm-up)")
            check()
            if work is not None and same_sizes(work):
                # only addresses changed: the table alone goes up, the work lists on the device stay
                rows = rows_of()
                dev = _work.upload_table(rows.ctypes.data if address is None else address, rows.size, device)
                new = _Work(basis(), codes, dev, work.num_chunks, work.num_columns, stream, lists=work)
            else:
                mod = self._mod()
                host, num_chunks, num_columns = work_lists(rows_of(), mod.STEP_CHUNK, mod.TILE,
                                                           mod.MAX_PARTIALS_PER_TENSOR, mod.WORK_SHIFT, device)
                # from page-locked memory: an asynchronous copy ordered on the current stream, no host wait; the
                # staging block goes back to the allocator now, which hands it out again only once this copy
                # is done
                dev = _work.upload(host, device)
                del host
                new = _Work(basis(), codes, dev, num_chunks, num_columns, stream)
            stats["uploads"] += 1
            old = _works.pop(key, None)
            if old is not None:
                _retire(old)
            if len(_works) >= _WORKS_LIMIT:  # thousands of step tensors: start over
                for w in _works.values():
                    _retire(w)
                _works.clear()
            work = _works[key] = new
        elif stream not in work.streams:  # freed later only after this stream's use of it
            work.dev.record_stream(torch.cuda.current_stream(device))
            work.streams.add(stream)
        if stream not in work.list_streams:  # (lists kept from a table uploaded on another stream)
            work.lists.record_stream(torch.cuda.current_stream(device))
            work.list_streams.add(stream)
        if capturing:
            work.captured = True
        return work

    def _check_flat(self, call: StepCall, states) -> tuple:
        if call.table is None:
            params, grads, steps = call.params, call.grads, call.steps
            for name, x in (("params", params), ("grads", grads)):
                if not isinstance(x, (list, tuple)):
                    raise TypeError(f"{name} must be a list (one entry per parameter) for the {self.name} backend, "
                                    f"got {type(x).__name__} (ampfused.ops accepts a single tensor and makes it a list)")
            if not isinstance(steps, Tensor) or steps.device.type != "cuda":
                where = steps.device if isinstance(steps, Tensor) else type(steps).__name__
                raise ValueError(f"steps must be on a CUDA device for the {self.name} backend, got {where}")
            if len(grads) != len(params) or steps.dim() != 1 or steps.numel() != len(params) \
                    or not steps.is_contiguous():
                raise ValueError(f"params, grads and steps must have one entry per parameter, got {len(params)} "
                                 f"params, {len(grads)} grads and steps of shape {tuple(steps.shape)}")
        return super()._check_flat(call, states)

    def _place_flat(self, call: StepCall, states) -> dict:
        """The step's device work (its tensor table and work lists, cached per call site: ``_Work``), where it
        runs, and ``single_launch`` (the one option: K1 over the gradients fused into the step, writing
        ``partials``)."""
        options = dict(call.options)
        single = bool(options.pop("single_launch", False))
        if options:
            raise TypeError(f"the {self.name} backend's step takes single_launch only, got {sorted(options)}")
        steps, partials, dev = call.steps, call.partials, call.steps.device
        if call.table is not None:
            code = _N.DTYPE_CODES[call.dtype]
            table = call.table
            work = self._table_work(table[2], code, dev, table[3] if len(table) > 3 else None, table[0])
            count, pcode, gcode = table[1], code, code
            single = False
        else:
            params, grads, master, state_scales = list(call.params), list(call.grads), call.master, call.state_scales
            # (8-bit moments: parameters start at multiples of a block of codes, each block with a column of scales)
            rows, total = _A.step_table(params, grads, _A.layout_align(states[0][1] if states else None))
            _A.check_state_sizes(self.name, [("master", master)] + list(states), total, dev)
            if state_scales is not None and state_scales.shape[-1] != -(-total // _QBLOCK):
                raise ValueError(f"state_scales must have {-(-total // _QBLOCK)} columns (one per block of {_QBLOCK} "
                                 f"elements of the flat buffers) for the {self.name} backend, got shape "
                                 f"{list(state_scales.shape)}")
            out_stats = call.out_stats  # (partials and out_stats: native_args.check_step)
            count, pcode, gcode = len(params), _N.DTYPE_CODES[params[0].dtype] if params else 0, _A.grad_code(grads)

            def check():
                checks.step_inputs(params, grads, master, states, steps, partials, call.inv_scale, call.lr, out_stats,
                                   call.seed, state_scales)

            work = self._work(rows, (pcode, gcode), steps, check)
            if single and (tuple(partials.shape) != (2, work.num_columns) or not partials.is_contiguous()):
                raise ValueError(f"partials must be a contiguous [2, {work.num_columns}] tensor with single_launch=True "
                                 "(the kernel writes the partials of the step's gradients into it, as norm_check "
                                 f"would), got shape {tuple(partials.shape)}, stride {partials.stride()}")
        device, stream = self._device_args(dev)
        return dict(table=work.table, count=count, param_dtype=pcode, grad_dtype=gcode, device=device, stream=stream,
                    chunks=work.chunks, num_chunks=work.num_chunks, columns=work.columns,
                    num_columns=work.num_columns, counter=_counter(steps), single_launch=single)

    # ---- the fused optimizers' own tables (see cpu.py): the same kernels and cached device work -------
    def norm_check_tables(self, segments, chunks: int, inv_scale: Tensor) -> Tensor:
        """K1 over the segments' gradients: one launch per segment, from the device copy of its tensor table and
        K1 column list (the work its step reads too), into consecutive columns of one partials tensor."""
        device = inv_scale.device
        works = [(self._table_work(s[3], _N.DTYPE_CODES[s[2]], device, s[4] if len(s) > 4 else None, s[0]),
                  _N.DTYPE_CODES[s[2]]) for s in segments]
        p = sum(w.num_columns for w, _ in works)
        partials = torch.empty(2, p, dtype=torch.float32, device=device)
        where = self._device_args(device)
        first, mod = 0, self._mod()
        for w, code in works:
            mod.norm_check_work(w.table, w.columns, w.num_columns, first, code, inv_scale.data_ptr(),
                                partials.data_ptr(), p, *where)
            first += w.num_columns
        return partials

    # ---- a factored state (see cpu.py) ---------------------------------------------------------------------
    def _place_factored(self, table, rows, count: int, steps: Tensor) -> dict:
        """The factored step's table (``rows``, or a fused optimizer's host ``table``) and its tiles uploaded to
        the device once per call site (its step tensor), asynchronously from page-locked memory, and reused while
        the table holds the same ints (a fused optimizer's: while its stamp is the same); the step is one
        cooperative launch over every tile (its op's ``csrc/cuda/<kernel>.cu``)."""
        index = _device_index(steps.device)
        key = (index, steps.data_ptr())
        work = _factored_tables.get(key)
        stamp = table[3][0] if table is not None else None
        if work is None or stamp is None or work.stamp != stamp or work.tile_elems != _AF.AF_TILE_ELEMS:
            rows = rows if table is None else table[2].reshape(-1).tolist()
            if work is None or work.rows != rows or work.tile_elems != _AF.AF_TILE_ELEMS:
                if _capturing(index):
                    raise RuntimeError("the cuda backend cannot upload a new factored-step table while a CUDA graph "
                                       "is being captured: run one step eagerly with exactly these tensors before "
                                       "capturing it")
                layout = _AF.layout(rows, count)
                if work is None or work.layout != layout or work.tile_elems != _AF.AF_TILE_ELEMS:
                    work = _factored_tables[key] = _FactoredWork(layout, steps.device)
                work.upload(rows, steps.device)
            work.stamp = stamp
        if _capturing(index):
            _kept_for_graphs.extend((work.table, work.scratch))  # the tensors the graph reads, not what holds them
        device, stream = self._device_args(steps.device)
        return dict(table=work.table.data_ptr(), device=device, stream=stream, tiles=work.num_tiles,
                    items=work.num_items, colparts=work.num_colparts, scratch=work.scratch.data_ptr(),
                    col_chunk=_AF.AF_COL_CHUNK)


BACKEND = CudaBackend()
