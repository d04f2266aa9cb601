"""The ``cpu`` backend: the ops on CPU tensors through ``ampfused._C`` (C++, OpenMP, vectorised loops).

K1 (``norm_check``/``unscale_``) keeps one partial per chunk of ``_C.CHUNK`` elements of each gradient,
so ``num_partials`` depends only on the sizes and the partials, reduced in chunk order by K2's prologue,
are bitwise identical whatever the thread count. K2 (the step) is one pass: convert, compute in fp32,
store, over the parameters of the tensor table (``step_args.h``: each parameter and gradient where it lives,
walked in memory order) and the flat state buffers, split into blocks across threads. The math is
``csrc/include/ampfused/math.h``, the specification :mod:`ampfused.ops.reference`. Threads:
``torch.get_num_threads()``; the GIL is released while the kernels run. The public ops check every rule of
the step first (:func:`ampfused.ops.checks.step_inputs`); this module adds what the native code relies on
(native dtypes, 16-byte aligned fp32 state buffers of the layout's size). Gradients given to
``norm_check``/``unscale_`` may be any strided tensors (a non-dense one is read through a contiguous copy).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .. import _native
from . import checks
from . import native_factored as _AF
from . import native_args as _A
from .call import StepCall
from .registry import Backend

_N = _native


def _grads_for_kernel(grads: List[Tensor]) -> List[Tensor]:
    """Each gradient where it lives, walked in memory order (a contiguous copy only for a non-dense one)."""
    return [g if g.is_contiguous() or checks.is_dense(g) else g.contiguous() for g in grads]


class CpuBackend(Backend):
    name = "cpu"
    kind = "cpu"  # which compiled module
    devices = ("cpu",)
    dtypes = _native.NATIVE_DTYPES
    deterministic = True

    # ---- plumbing that the CUDA backend overrides -------------------------------------------------
    def _mod(self):
        return _native.module(self.kind)

    def _device_args(self, device: torch.device) -> tuple:
        """Trailing arguments of every kernel call: the thread count here, device and stream for CUDA."""
        return (torch.get_num_threads(),)

    def unavailable_reason(self) -> Optional[str]:
        return _native.unavailable_reason(self.kind)

    # ---- ops -----------------------------------------------------------------------------------------
    def num_partials(self, numels: List[int]) -> int:
        return int(self._mod().num_partials([int(n) for n in numels]))

    def _k1(self, grads: List[Tensor], inv_scale: Tensor, unscale: bool) -> Tensor:
        """K1 over each gradient where it lives, in memory order: a sum of squares and a non-finite test do
        not depend on the order of the dimensions."""
        _A.check_grads(grads, inv_scale, self.name)
        work = _grads_for_kernel(list(grads))
        numels = [g.numel() for g in work]
        p = self.num_partials(numels)
        partials = torch.empty(2, p, dtype=torch.float32, device=inv_scale.device)
        self._mod().norm_check([g.data_ptr() for g in work], numels, [_N.DTYPE_CODES[g.dtype] for g in work],
                               inv_scale.data_ptr(), partials.data_ptr(), p, unscale,
                               *self._device_args(inv_scale.device))
        if unscale:  # non-dense gradients were unscaled in a contiguous copy
            for g, w in zip(grads, work):
                if w is not g:
                    g.copy_(w)
        return partials

    def norm_check(self, grads: List[Tensor], inv_scale: Tensor) -> Tensor:
        """Partials ``[2, P]`` (row 0: sums of squares of ``g * inv_scale``; row 1: non-finite flags)."""
        return self._k1(grads, inv_scale, False)

    def unscale_(self, grads: List[Tensor], inv_scale: Tensor) -> Tensor:
        """In place ``g = round(fp32(g) * inv_scale)``; partials of the unscaled values."""
        return self._k1(grads, inv_scale, True)

    def update_scale_(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                      backoff_factor: float, growth_interval: int, inv_scale: Optional[Tensor] = None,
                      skipped: Optional[Tensor] = None) -> None:
        dev = scale.device
        _A.check_scalar("scale", scale, (torch.float32,), dev, self.name)
        _A.check_scalar("growth_tracker", growth_tracker, (torch.int32,), dev, self.name)
        _A.check_scalar("found_inf", found_inf, (torch.float32,), dev, self.name)
        if inv_scale is not None:
            _A.check_scalar("inv_scale", inv_scale, (torch.float32,), dev, self.name)
        if skipped is not None:
            _A.check_scalar("skipped", skipped, (torch.int64,), dev, self.name)
        self._mod().update_scale(scale.data_ptr(), growth_tracker.data_ptr(), found_inf.data_ptr(),
                                 float(growth_factor), float(backoff_factor), int(growth_interval),
                                 _N.ptr(inv_scale), _N.ptr(skipped), *self._scalar_device_args(dev))

    def _scalar_device_args(self, device: torch.device) -> tuple:
        """Trailing arguments of the scale update: none here, device and stream for CUDA."""
        return ()

    # ---- the step: one entry for every step op ----------------------------------------------------------
    def step(self, call: StepCall) -> None:
        """The step op of ``call`` (math and tensors in :mod:`ampfused.ops.reference`): its arguments packed by
        name into the module's one step entry (``csrc/include/ampfused/step_pack.h``), which runs the kernels that
        op's source file registered."""
        if call.health is not None and not self.computes_health(call.spec.name):
            raise NotImplementedError(f"the {self.name} backend's {call.spec.name} does not compute health sums")
        if call.spec.layout == "factored":
            self._factored_step(call)
            return
        states = [(n, t) for n, t in call.used_states() if t is not None]
        fmt = self._check_flat(call, states)
        place = self._place_flat(call, states)
        mod = self._mod()
        pack = _A.packer(mod)
        flat = self._flat_slots(call, states, fmt)  # (held to the call: it keeps the partials it packed alive)
        # a pass of a split step (OpSpec.split): its phase and what its scratch gives the kernels
        phase = {} if call.shard is None else dict(phase=call.shard[0], **call.shard[1].slots(call.steps.device))
        mod.step(call.spec.name, pack.slots(place, flat, phase), pack.hyper(call), *place.get("rows", ()))

    def computes_health(self, op: str) -> bool:
        """Whether the module's entry of ``op`` writes a call's health sums (the pack's health slot): its step
        file registers ``HEALTH_<op>`` (``csrc/cpu/steps``)."""
        try:
            return op in _A.packer(self._mod()).health_ops
        except ImportError:
            return False

    def has_step(self, op: str) -> bool:
        """Whether the module has an entry for ``op`` (False when it cannot load: ``unavailable_reason`` says why)."""
        try:
            return op in _A.packer(self._mod()).hypers
        except ImportError:
            return False

    def _check_flat(self, call: StepCall, states) -> tuple:
        """What the kernels rely on beyond :func:`ampfused.ops.checks.step_inputs` (which the ops run first; a
        fused optimizer's table was checked by ``ampfused._host``); the compact-state codes (``native_args``)."""
        if call.table is not None:
            return _N.compact_args(call.dtype, call.master, states[0][1] if states else None, call.seed)
        return _A.check_step(self.name, call.params, call.grads, call.master, states, call.steps, call.partials,
                             call.inv_scale, call.lr, call.out_stats, call.seed, call.state_scales)

    def _flat_slots(self, call: StepCall, states, fmt: tuple) -> dict:
        """The slots of a flat-state step besides where its table is: its buffers, scalars and compact state."""
        partials = _A.partials_arg(call.partials)
        scales, blocks = _A.q8_args(call.state_scales)
        return dict(master=_N.ptr(call.master), state1=_N.ptr(states[0][1]) if states else 0,
                    state2=_N.ptr(states[1][1]) if len(states) > 1 else 0, steps=call.steps.data_ptr(),
                    step_code=_N.SCALAR_CODES[call.steps.dtype], partials=partials.data_ptr(),
                    num_partials=partials.shape[1], inv_scale=call.inv_scale.data_ptr(), lr=call.lr.data_ptr(),
                    lr_code=_N.SCALAR_CODES[call.lr.dtype], out_stats=call.out_stats.data_ptr(), master_format=fmt[0],
                    state_dtype=fmt[1], seed=fmt[2], state_scales=scales, scale_blocks=blocks,
                    health=_N.ptr(call.health), _keep=partials)

    def _place_flat(self, call: StepCall, states) -> dict:
        """Where the step's parameters and gradients are, as the module reads them, and where it runs: here the
        tensor table as ints (``rows``), or a fused optimizer's host table by its address."""
        if call.options:
            raise TypeError(f"the {self.name} backend takes no options, got {sorted(call.options)}")
        place = dict(threads=torch.get_num_threads())
        if call.table is not None:
            code = _N.DTYPE_CODES[call.dtype]
            place.update(table=call.table[0], count=call.table[1], param_dtype=code, grad_dtype=code)
            return place
        params, grads = call.params, call.grads
        rows, total = _A.step_table(params, grads, _A.layout_align(states[0][1] if states else None))
        _A.check_state_sizes(self.name, [("master", call.master)] + list(states), total, call.steps.device)
        place.update(count=len(params), param_dtype=_N.DTYPE_CODES[params[0].dtype] if params else 0,
                     grad_dtype=_A.grad_code(grads), rows=(rows,))
        return place

    # ---- the fused optimizers' own tables ---------------------------------------------------------
    # The optimizers' segments keep their tensor tables in host int64 buffers written by ampfused._host (each
    # parameter checked there: plain, where the optimizer left it, its gradient of its dtype, device and
    # layout) and state buffers they built themselves: these entries pass the tables' addresses and skip the
    # per-tensor checks and table building of the ops above. Results are the same bits.
    # A table is ``(address, rows, array[, stamps])``: the host int64 [rows, 4] numpy array and its address, and
    # optionally the segment's ``stamps`` (``(table, sizes)``, ``Segment.restamp``), by which a backend that keeps
    # device copies of the table knows them current without comparing the table's bytes.
    takes_tables = True

    @property
    def table_chunk(self) -> int:
        """K1's chunk: ampfused._host counts the partials of the tables' gradients with it."""
        return self._mod().CHUNK

    def norm_check_tables(self, segments, chunks: int, inv_scale: Tensor) -> Tensor:
        """K1 (``norm_check``) over the gradients of ``segments`` (``(table address, rows, grad dtype, table
        array[, stamps])`` each), in table order, as :meth:`norm_check` of the same gradients (``chunks`` partials)."""
        partials = torch.empty(2, chunks, dtype=torch.float32)
        self._mod().norm_check_tables([s[0] for s in segments], [s[1] for s in segments],
                                      [_N.DTYPE_CODES[s[2]] for s in segments], inv_scale.data_ptr(),
                                      partials.data_ptr(), chunks, False, torch.get_num_threads())
        return partials

    # ---- a factored state: a table of its own (the state is not laid out like the parameters) -------------
    def _factored_step(self, call: StepCall) -> None:
        """A step whose state is factored (``native_factored``: its table, its rules), from the tensors or from a
        fused optimizer's table (its segment's ``FactoredSegment.step_table``); a phase over shards
        (``call.shard``) from the tensors, the shard table after the step's."""
        if call.options:
            raise TypeError(f"{call.spec.name} takes no options on the {self.name} backend")
        factors = call.states[call.spec.states[0].name]
        if call.table is None:
            params, grads = list(call.params), list(call.grads)
            fmt, seed = _AF.check(self.name, params, grads, call.master, factors, call.steps, call.partials,
                                  call.inv_scale, call.lr, call.out_stats, call.seed)
            count, rows = len(params), _AF.table(params, grads, call.shard)
            pcode, gcode = _N.DTYPE_CODES[params[0].dtype] if params else 0, _A.grad_code(grads)
        else:
            fmt, _, seed = _N.compact_args(call.dtype, call.master, None, call.seed)
            count, rows = call.table[1], None
            pcode = gcode = _N.DTYPE_CODES[call.dtype]
        partials = _A.partials_arg(call.partials)  # (alive until the call below returns)
        place = self._place_factored(call.table, rows, count, call.steps)
        mod = self._mod()
        pack = _A.packer(mod)
        slots = pack.slots(place, dict(
            count=count, param_dtype=pcode, grad_dtype=gcode, master=_N.ptr(call.master), state1=factors.data_ptr(),
            steps=call.steps.data_ptr(), step_code=_N.SCALAR_CODES[call.steps.dtype], partials=partials.data_ptr(),
            num_partials=partials.shape[1], inv_scale=call.inv_scale.data_ptr(), lr=call.lr.data_ptr(),
            lr_code=_N.SCALAR_CODES[call.lr.dtype], out_stats=call.out_stats.data_ptr(), master_format=fmt,
            seed=seed, **_AF.shard_slots(call.shard, call.steps.device)))
        mod.step(call.spec.name, slots, pack.hyper(call), *place.get("rows", ()))

    def _place_factored(self, table, rows, count: int, steps: Tensor) -> dict:
        """Where a factored step's table is and where it runs: here its rows as ints, or a fused optimizer's
        host table by its address."""
        if rows is None:
            return dict(threads=torch.get_num_threads(), table=table[0])
        return dict(threads=torch.get_num_threads(), rows=(rows,))


BACKEND = CpuBackend()
