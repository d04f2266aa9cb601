"""The Triton backend: launches the kernels of ``ampfused.triton_kernels`` (K1, K2, scale update).

Runs on CUDA tensors; on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which is how the tests run it without a GPU. Importing this module touches no GPU: it
imports triton only to learn whether it can, and the kernel modules load on the first op.

Each op is one launch whatever the number of tensors: the kernels reach the tensors through a table of
their addresses and a chunk list (see ``ampfused.triton_kernels.adam``) that live in device memory. Building
and uploading them costs host time, so they are cached: a step call site (identified by its ``steps``
tensor) keeps the table of its last call and reuses it while the parameters, gradients and state layout are
the same; K1 keeps the tables of its recent gradient lists. Tables are uploaded with an asynchronous copy
from pinned memory (no host sync). A table used while a CUDA graph was captured is kept for the life of the
backend (the graph reads it on every replay); a table that would have to be built while a graph is being
captured is refused with a RuntimeError: run one eager call with the same tensors first.

Besides the caller's tensors the step ops need one more piece of state: an int32 counter per device (see
``ampfused.triton_kernels.adam``), zero between launches. It is allocated on the first step on a device and
reused, so a warm step with unchanged tensors allocates nothing and can be captured in a CUDA graph. Two
steps running at the same time on different streams of one device would share it: steps on one device must
be stream-ordered.
"""
from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import numpy
import torch
from torch import Tensor

from .. import _native, _work
from . import native_factored as _AF
from . import native_args as _A
from . import specs
from .call import StepCall
from .checks import is_dense
from .reference import STATE_ALIGN
from .registry import Backend

try:
    import triton  # noqa: F401
    _IMPORT_ERROR: Optional[str] = None
except Exception as e:  # not installed, or broken for this platform
    _IMPORT_ERROR = f"cannot import triton ({type(e).__name__}: {e})"


def _kernels(name: str):
    return importlib.import_module(f"ampfused.triton_kernels.{name}")


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


class TableCache:
    """Device tables (``_common.Plan``) by call site: a slot holds the ints its plan was built from; a call
    whose ints equal them reuses the plan, anything else builds a new one into the slot. The least recently
    used slot goes when there are more than ``capacity``. ``builds`` counts the plans built."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.builds = 0
        self._slots: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._graph_plans: Dict[int, object] = {}  # used during a CUDA graph capture: replays read them

    def get(self, site: tuple, ints, build: Callable[[], object], capturing: bool, what: str):
        """The plan of ``site`` if it was built from ``ints``, else a new one from ``build()``; refused while a
        CUDA graph is being captured (the graph would keep reading a table uploaded once, outside it)."""
        return self._get(site, ints, build, capturing, what, lambda kept: kept == ints, lambda: ints)

    def get_tables(self, site: tuple, tables: tuple, build: Callable[[], object], capturing: bool, what: str,
                   stamps: Optional[tuple] = None, retable: Optional[Callable[[object], object]] = None):
        """:meth:`get` for host tensor tables (numpy arrays that ampfused._host rewrites in place each step):
        the plan is reused while every table holds the ints it was built from. With ``stamps`` (``(table,
        sizes)``, from the segments' ``stamps``) that is known without reading the tables, and a plan whose
        sizes stamp still holds keeps its chunk list: ``retable(plan)`` uploads the new table alone. Without
        them the tables' bytes are compared."""
        if stamps is None:
            now = tuple(t.tobytes() for t in tables)
            return self._get(site, tables, build, capturing, what, lambda kept: kept == now, lambda: now)
        return self._get(site, tables, build, capturing, what, lambda kept: kept == stamps, lambda: stamps,
                         lambda kept: type(kept) is tuple and kept[1] == stamps[1], retable)

    def _get(self, site: tuple, ints, build, capturing: bool, what: str, same, keep, same_sizes=None,
             retable=None):
        slot = self._slots.get(site)
        if slot is not None and same(slot[0]):
            self._slots.move_to_end(site)
            plan = slot[1]
        else:
            if capturing:
                raise RuntimeError(
                    f"the triton backend needs a new device table for {what} while a CUDA graph is being "
                    "captured: these tensors (or their addresses) differ from the last eager call's. Run one "
                    "eager call with exactly these tensors before capturing, and keep them, storage included, "
                    "for as long as the graph is replayed")
            plan = retable(slot[1]) if slot is not None and same_sizes and same_sizes(slot[0]) else build()
            self.builds += 1
            self._slots[site] = (keep(), plan)
            self._slots.move_to_end(site)
            while len(self._slots) > self.capacity:
                self._slots.popitem(last=False)
        if capturing:
            self._graph_plans[id(plan)] = plan
        return plan

    def clear(self) -> None:
        """Forget every slot (tables captured in CUDA graphs stay alive)."""
        self._slots.clear()


def _retable(plan, rows: numpy.ndarray, numel_col: int, addr_cols: tuple, device: torch.device):
    """``plan`` with ``rows`` as its table: rows of the sizes the plan was made from (so its chunk list holds),
    at new addresses. Only the table is staged and uploaded (``ampfused/_work.py``: no host wait)."""
    common = _kernels("_common")
    addresses = rows[:, list(addr_cols)]
    # every address aligned (one reduction, the usual case) settles it; else only the rows that own chunks count
    aligned = not int(numpy.bitwise_or.reduce(addresses, axis=None)) % common.ALIGN or bool(
        (addresses[rows[:, numel_col] > 0] % common.ALIGN == 0).all())
    rows = numpy.ascontiguousarray(rows)
    return plan._replace(table=_work.upload_table(rows.ctypes.data, rows.size, device), aligned=aligned)


class TritonBackend(Backend):
    name = "triton"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    deterministic = True

    def __init__(self) -> None:
        self._counters: Dict[torch.device, Tensor] = {}
        self.step_tables = TableCache(capacity=4096)  # one slot per step call site (its steps tensor)
        self.grad_tables = TableCache(capacity=64)    # K1: one slot per recent gradient list

    @property
    def devices(self) -> tuple:
        # CPU tensors only work when every kernel is interpreted
        return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)

    def unavailable_reason(self) -> Optional[str]:
        return _IMPORT_ERROR

    def not_supported_reasons(self, device: torch.device, dtypes=()) -> List[str]:
        reasons = super().not_supported_reasons(device, dtypes)
        if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            reasons.append("torch sees no CUDA device (torch.cuda.is_available() is False)")
        return reasons

    # --------------------------------------------------------------------------------------------- helpers

    def _counter(self, device: torch.device) -> Tensor:
        c = self._counters.get(device)
        if c is None:
            if _capturing(device):
                raise RuntimeError("the triton backend allocates its step counter on the first step on a "
                                   f"device: run one step on {device} before capturing a CUDA graph")
            c = self._counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return c

    def _step_plan(self, params: List[Tensor], grads: List[Optional[Tensor]], steps: Tensor, chunk: int,
                   align: int = STATE_ALIGN):
        """The tensor table and chunk list of a step (state offsets at multiples of ``align``), reused while the
        call site's tensors are unchanged."""
        return self._plan_of_rows(_A.step_table(params, grads, align)[0], steps, chunk)

    def _plan_of_rows(self, rows: List[int], steps: Tensor, chunk: int):
        device = steps.device
        common = _kernels("_common")
        return self.step_tables.get(
            (device, steps.data_ptr(), chunk), rows,
            lambda: common.make_plan(rows, 4, 2, (0, 1), chunk, device), _capturing(device),
            "the parameters and gradients of a step")

    @staticmethod
    def _step_dtypes(params: List[Tensor], grads: List[Optional[Tensor]]) -> tuple:
        pdtype = params[0].dtype if params else torch.float32
        g = next((x for x in grads if x is not None), None)
        return pdtype, (g.dtype if g is not None else pdtype)

    # ------------------------------------------------------------------------------------------------- ops

    def num_partials(self, numels: List[int]) -> int:
        return _kernels("norm_check").num_partials(list(numels))

    def _k1(self, grads: List[Tensor], inv_scale: Tensor, write_back: bool) -> Tensor:
        _A.check_grads(grads, inv_scale, self.name)
        k1, common = _kernels("norm_check"), _kernels("_common")
        # Dense gradients (row-major, channels_last, transposed) are walked in memory order where they are;
        # any other layout goes through a contiguous copy (copied back when unscaling).
        work = [g if g.is_contiguous() or is_dense(g) else g.contiguous() for g in grads]
        rows = k1.grad_rows(work, _native.DTYPE_CODES)
        device = inv_scale.device
        plan = self.grad_tables.get(
            (device, k1.CHUNK, tuple(rows)), None,
            lambda: common.make_plan(rows, 3, 1, (0,), k1.CHUNK, device), _capturing(device),
            "the gradients of norm_check/unscale_")
        partials = k1.run(plan, inv_scale, write_back)
        if write_back:
            for g, w in zip(grads, work):
                if w is not g:
                    g.copy_(w)
        return partials

    def norm_check(self, grads: List[Tensor], inv_scale: Tensor) -> Tensor:
        return self._k1(list(grads), inv_scale, False)

    def unscale_(self, grads: List[Tensor], inv_scale: Tensor) -> Tensor:
        return self._k1(list(grads), inv_scale, True)

    def update_scale_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                      backoff_factor: float, growth_interval: int, inv_scale: Optional[Tensor] = None,
                      skipped: Optional[Tensor] = None) -> None:
        _kernels("update_scale").update_scale_(scale, growth_tracker, found_inf, growth_factor,
                                               backoff_factor, growth_interval, inv_scale, skipped)

    # ---- the fused optimizers' own tables (see cpu.py): the same kernels and cached plans ----------------
    takes_tables = True
    table_chunk = 1  # K1's columns here come from num_partials of the gradients' sizes

    def norm_check_tables(self, segments, chunks: int, inv_scale: Tensor) -> Tensor:
        k1, common = _kernels("norm_check"), _kernels("_common")
        tables = tuple(s[3] for s in segments)
        device = inv_scale.device

        def grad_rows():
            parts = []
            for s in segments:
                table = s[3]
                active = table[table[:, 2] != _native.NO_GRAD]
                rows = numpy.empty((len(active), 3), dtype=numpy.int64)  # address, numel, dtype code
                rows[:, 0], rows[:, 1] = active[:, 1], active[:, 2]
                rows[:, 2] = _native.DTYPE_CODES[s[2]]
                parts.append(rows)
            return numpy.concatenate(parts) if parts else numpy.empty((0, 3), dtype=numpy.int64)

        stamps = None
        if all(len(s) > 4 for s in segments):
            stamps = (tuple(s[4][0] for s in segments), tuple(s[4][1] for s in segments))
        site = (device, k1.CHUNK, "tables", tuple((s[0], str(s[2])) for s in segments))
        plan = self.grad_tables.get_tables(
            site, tables, lambda: common.make_plan(grad_rows(), 3, 1, (0,), k1.CHUNK, device), _capturing(device),
            "the gradients of norm_check/unscale_", stamps, lambda old: _retable(old, grad_rows(), 1, (0,), device))
        return k1.run(plan, inv_scale, False)

    def _table_plan(self, table: tuple, steps: Tensor, chunk: int):
        device, array = steps.device, table[2]
        common = _kernels("_common")
        return self.step_tables.get_tables(
            (device, "table", table[0], chunk), (array,),
            lambda: common.make_plan(array, 4, 2, (0, 1), chunk, device), _capturing(device),
            "the parameters and gradients of a step", tuple(table[3]) if len(table) > 3 else None,
            lambda old: _retable(old, array, 2, (0, 1), device))

    # ---- the step: one entry for every step op ----------------------------------------------------------
    def step(self, call: StepCall) -> None:
        """The step op of ``call``: the launcher of its kernel module (``triton_kernels/<kernel>.py``, one function
        named as the op: the plan and sizes, the master, the states in the record's order, the step tensors, the
        block counter, the hyperparameters in the record's order, the compact state's), over the plan of its
        tensors (cached per call site) or of a fused optimizer's table."""
        if call.options:
            raise TypeError(f"the {self.name} backend takes no options, got {sorted(call.options)}")
        spec = call.spec
        if spec.layout == "factored":
            self._factored_step(call)
            return
        states = call.used_states()
        given = [(n, t) for n, t in states if t is not None]
        k = _kernels(spec.kernel)
        if call.table is None:
            params, grads = list(call.params), list(call.grads)
            _A.check_step(self.name, params, grads, call.master, given, call.steps, call.partials, call.inv_scale,
                          call.lr, call.out_stats, call.seed, call.state_scales)
            plan = self._step_plan(params, grads, call.steps, k.CHUNK, _A.layout_align(given[0][1] if given else None))
            count, dtypes = len(params), self._step_dtypes(params, grads)
        else:
            plan, count, dtypes = self._table_plan(call.table, call.steps, k.CHUNK), call.table[1], (call.dtype,) * 2
        phase = {} if call.shard is None else dict(phase=call.shard[0], scratch=call.shard[1])
        getattr(k, spec.name)(plan, count, *dtypes, call.master, *(t for _, t in states), call.steps, call.partials,
                              call.inv_scale, call.lr, call.out_stats, self._counter(call.steps.device),
                              *call.hyper_args(), call.seed, call.state_scales, **phase)

    def has_step(self, op: str) -> bool:
        spec = specs.SPECS.get(op)
        if spec is None or not spec.is_step:
            return False
        try:
            return hasattr(_kernels(spec.kernel), op)
        except ImportError:
            return False

    # ---- a factored state: a table of its own (the state is not laid out like the parameters) -------------
    def _factored_step(self, call: StepCall) -> None:
        """A factored step: one launch, one program per parameter (``triton_kernels/<kernel>.py``), its table
        (``native_factored.table``, or a fused optimizer's) uploaded once per call site and reused while it holds
        the same ints (a fused optimizer's: while its stamp is the same); a phase over shards (``call.shard``)
        from the tensors, its shard table after the step's."""
        master, steps, seed = call.master, call.steps, call.seed
        factors = call.states[call.spec.states[0].name]
        if call.table is None:
            params, grads = list(call.params), list(call.grads)
            _AF.check(self.name, params, grads, master, factors, steps, call.partials, call.inv_scale, call.lr,
                      call.out_stats, seed)
            rows, count = _AF.table(params, grads, call.shard), len(params)
            pdtype, gdtype = self._step_dtypes(params, grads)
        else:
            rows, count = None, call.table[1]
            pdtype = gdtype = call.dtype
        device = steps.device

        def build():
            ints = rows if rows is not None else call.table[2].reshape(-1).tolist()
            host, view = _work.staging(len(ints), device)
            view[:len(ints)] = ints
            return _work.upload(host, device), host

        site, what = (device, steps.data_ptr(), call.spec.kernel), "the parameters and gradients of a factored step"
        if rows is not None:
            table, _ = self.step_tables.get(site, rows, build, _capturing(device), what)
        else:  # a fused optimizer's table: uploaded again only when its stamps moved (the host pass says so)
            table, _ = self.step_tables.get_tables(site, (call.table[2],), build, _capturing(device), what,
                                                   stamps=call.table[3], retable=lambda _: build())
        fmt = _kernels("_compact").launch_format(pdtype, master, None, seed)
        shard = _AF.shard_slots(call.shard, device)
        getattr(_kernels(call.spec.kernel), call.spec.name)(
            table, count, pdtype, gdtype, fmt, master, factors, steps, _A.partials_arg(call.partials),
            call.inv_scale, call.lr, call.out_stats, *call.hyper_args(), seed,
            **({} if not shard else dict(phase=shard["phase"], sums=call.shard[1].sums)))


BACKEND = TritonBackend()

