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
from . import native_adafactor as _AF
from . import native_args as _A
from .reference_adafactor import EPS1_DEFAULT
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

    # ---- the step ------------------------------------------------------------------------------------
    def _step_head(self, params, grads, master, states, steps, partials, inv_scale, lr, out_stats):
        """Leading kernel arguments shared by every step, and the tensors that must outlive the call."""
        params = list(params)
        grads = list(grads)
        rows, total = _A.step_table(params, grads, _A.layout_align(next((s for _, s in states if s is not None), None)))
        _A.check_state_sizes(self.name, [("master", master)] + list(states), total, steps.device)
        partials = _A.partials_arg(partials)
        head = [rows, len(params), _N.DTYPE_CODES[params[0].dtype] if params else 0,
                _A.grad_code(grads), _N.ptr(master)]
        tail = [steps.data_ptr(), _N.SCALAR_CODES[steps.dtype], partials.data_ptr(), partials.shape[1],
                inv_scale.data_ptr(), lr.data_ptr(), _N.SCALAR_CODES[lr.dtype], out_stats.data_ptr()]
        return head, tail, partials

    def adam_step_(self, params, grads, master: Optional[Tensor], exp_avg: Tensor, exp_avg_sq: Tensor,
                   steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta1: float,
                   beta2: float, eps: float, weight_decay: float, max_norm: float, decoupled: bool,
                   maximize: bool = False, seed: Optional[Tensor] = None, state_scales: Optional[Tensor] = None,
                   **options) -> None:
        """Adam/AdamW; math and tensors in :func:`ampfused.ops.reference.adam_step_` (compact state included)."""
        compact = _A.check_step(self.name, params, grads, master, [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)],
                                steps, partials, inv_scale, lr, out_stats, seed, state_scales)
        compact = tuple(compact) + _A.q8_args(state_scales)
        head, tail, keep = self._step_head(params, grads, master, [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)],
                                           steps, partials, inv_scale, lr, out_stats)
        self._launch_adam(head + [exp_avg.data_ptr(), exp_avg_sq.data_ptr()] + tail
                          + [float(beta1), float(beta2), float(eps), float(weight_decay), float(max_norm),
                             bool(decoupled), bool(maximize)], steps, keep, compact, **options)

    def _launch_adam(self, args, steps: Tensor, keep, compact=(0, 0, 0, 0, 0), **options):
        if options:
            raise TypeError(f"the {self.name} backend takes no options, got {sorted(options)}")
        self._mod().adam_step(*args, *self._device_args(steps.device), *compact)

    def sgd_step_(self, params, grads, master: Optional[Tensor], momentum_buf: Optional[Tensor], steps: Tensor,
                  partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, momentum: float,
                  dampening: float, weight_decay: float, nesterov: bool, max_norm: float, maximize: bool = False,
                  seed: Optional[Tensor] = None, state_scales: Optional[Tensor] = None, **options) -> None:
        """SGD; math and tensors in :func:`ampfused.ops.reference.sgd_step_`."""
        if momentum != 0 and momentum_buf is None:
            raise ValueError("momentum_buf is required when momentum != 0")
        buf = momentum_buf if momentum != 0 else None
        states = [("momentum_buf", buf)] if buf is not None else []
        compact = _A.check_step(self.name, params, grads, master, states, steps, partials, inv_scale, lr, out_stats,
                                seed, state_scales)
        compact = tuple(compact) + _A.q8_args(state_scales)
        head, tail, keep = self._step_head(params, grads, master, states, steps, partials, inv_scale, lr, out_stats)
        self._launch_sgd(head + [_N.ptr(buf)] + tail
                         + [float(momentum), float(dampening), float(weight_decay), bool(nesterov),
                            float(max_norm), bool(maximize)], steps, keep, compact, **options)

    def _launch_sgd(self, args, steps: Tensor, keep, compact=(0, 0, 0, 0, 0), **options):
        if options:
            raise TypeError(f"the {self.name} backend takes no options, got {sorted(options)}")
        self._mod().sgd_step(*args, *self._device_args(steps.device), *compact)

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

    def _table_head(self, table: tuple, dtype, master, steps, partials, inv_scale, lr, out_stats):
        partials = _A.partials_arg(partials)
        head = [table[0], table[1], _N.DTYPE_CODES[dtype], _N.DTYPE_CODES[dtype], _N.ptr(master)]
        tail = [steps.data_ptr(), _N.SCALAR_CODES[steps.dtype], partials.data_ptr(), partials.shape[1],
                inv_scale.data_ptr(), lr.data_ptr(), _N.SCALAR_CODES[lr.dtype], out_stats.data_ptr()]
        return head, tail

    def adam_step_table(self, table: tuple, dtype, master, exp_avg, exp_avg_sq, steps, partials, inv_scale, lr,
                        out_stats, beta1, beta2, eps, weight_decay, max_norm, decoupled, maximize, seed=None,
                        state_scales=None) -> None:
        head, tail = self._table_head(table, dtype, master, steps, partials, inv_scale, lr, out_stats)
        self._mod().adam_step(*head, exp_avg.data_ptr(), exp_avg_sq.data_ptr(), *tail, beta1, beta2, eps,
                              weight_decay, max_norm, decoupled, maximize, torch.get_num_threads(),
                              *_N.compact_args(dtype, master, exp_avg, seed), *_A.q8_args(state_scales))

    def sgd_step_table(self, table: tuple, dtype, master, momentum_buf, steps, partials, inv_scale, lr, out_stats,
                       momentum, dampening, weight_decay, nesterov, max_norm, maximize, seed=None,
                       state_scales=None) -> None:
        head, tail = self._table_head(table, dtype, master, steps, partials, inv_scale, lr, out_stats)
        buf = momentum_buf if momentum != 0 else None
        self._mod().sgd_step(*head, _N.ptr(buf), *tail, momentum, dampening, weight_decay, nesterov, max_norm,
                             maximize, torch.get_num_threads(), *_N.compact_args(dtype, master, buf, seed),
                             *_A.q8_args(state_scales))

    # ---- Lion -------------------------------------------------------------------------------------------
    def lion_step_(self, params, grads, master: Optional[Tensor], exp_avg: Tensor, steps: Tensor, partials: Tensor,
                   inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta1: float, beta2: float,
                   weight_decay: float, max_norm: float, maximize: bool = False, seed: Optional[Tensor] = None,
                   state_scales: Optional[Tensor] = None, **options) -> None:
        """Lion; math and tensors in :func:`ampfused.ops.reference.lion_step_`."""
        states = [("exp_avg", exp_avg)]
        compact = _A.check_step(self.name, params, grads, master, states, steps, partials, inv_scale, lr, out_stats,
                                seed, state_scales)
        compact = tuple(compact) + _A.q8_args(state_scales)
        head, tail, keep = self._step_head(params, grads, master, states, steps, partials, inv_scale, lr, out_stats)
        self._launch_lion(head + [exp_avg.data_ptr()] + tail
                          + [float(beta1), float(beta2), float(weight_decay), float(max_norm), bool(maximize)],
                          steps, keep, compact, **options)

    def _launch_lion(self, args, steps: Tensor, keep, compact=(0, 0, 0, 0, 0), **options):
        if options:
            raise TypeError(f"the {self.name} backend takes no options, got {sorted(options)}")
        self._mod().lion_step(*args, *self._device_args(steps.device), *compact)

    def lion_step_table(self, table: tuple, dtype, master, exp_avg, steps, partials, inv_scale, lr, out_stats,
                        beta1, beta2, weight_decay, max_norm, maximize, seed=None, state_scales=None) -> None:
        head, tail = self._table_head(table, dtype, master, steps, partials, inv_scale, lr, out_stats)
        self._mod().lion_step(*head, exp_avg.data_ptr(), *tail, beta1, beta2, weight_decay, max_norm, maximize,
                              torch.get_num_threads(), *_N.compact_args(dtype, master, exp_avg, seed),
                              *_A.q8_args(state_scales))

    # ---- Adafactor: a table of its own (the factored state is not laid out like the parameters) ------------
    def adafactor_step_(self, params, grads, master: Optional[Tensor], factors: Tensor, steps: Tensor,
                        partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta2_decay: float,
                        eps1: Optional[float], eps2: float, d: float, weight_decay: float, max_norm: float,
                        maximize: bool = False, seed: Optional[Tensor] = None) -> None:
        """Adafactor; math and tensors in :func:`ampfused.ops.reference_adafactor.adafactor_step_`."""
        params, grads = list(params), list(grads)
        fmt, seed_ptr = _AF.check(self.name, params, grads, master, factors, steps, partials, inv_scale, lr,
                                  out_stats, seed)
        table, extra = self._adafactor_table(params, grads, steps)
        partials = _A.partials_arg(partials)
        self._mod().adafactor_step(
            table, len(params), _N.DTYPE_CODES[params[0].dtype] if params else 0, _A.grad_code(grads),
            _N.ptr(master), factors.data_ptr(), steps.data_ptr(), _N.SCALAR_CODES[steps.dtype], partials.data_ptr(),
            partials.shape[1], inv_scale.data_ptr(), lr.data_ptr(), _N.SCALAR_CODES[lr.dtype], out_stats.data_ptr(),
            float(beta2_decay), EPS1_DEFAULT if eps1 is None else float(eps1), float(eps2), float(d),
            float(weight_decay), float(max_norm), bool(maximize), *self._device_args(steps.device), fmt, seed_ptr,
            *extra)

    def _adafactor_table(self, params, grads, steps: Tensor) -> tuple:
        """The table argument of the Adafactor step and the arguments after its own: here its rows."""
        return _AF.table(params, grads), ()


BACKEND = CpuBackend()
