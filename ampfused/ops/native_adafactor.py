"""``adafactor_step_`` on the native backends (``csrc/cpu/adafactor.h``; CUDA: ``csrc/cuda/adafactor.cu``): the
checks the native code relies on and its table, one row of ``AF_COLS`` ints per parameter: param and grad
addresses, numel (``NO_GRAD`` without a gradient), the offset of its weights in ``master`` and of its state in
``factors``, its number of dimensions, then ``AF_MAX_DIMS`` sizes and ``AF_MAX_DIMS`` strides (elements)."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .. import _native as _N
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


def check(backend: str, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed) -> tuple:
    """The native step's rules beyond the op's own (ops.adafactor.check_inputs); returns ``(master format,
    seed address)``."""
    fmt, _, seed_ptr = _N.check_step(backend, params, grads, master, [], steps, partials, inv_scale, lr, out_stats,
                                     seed)
    _N.check_state_sizes(backend, [("factors", factors)], factor_layout([tuple(p.shape) for p in params])[1],
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
    partials = _N.partials_arg(partials)
    self._mod().adafactor_step(
        table(params, grads), len(params), _N.DTYPE_CODES[params[0].dtype] if params else 0, _N.grad_code(grads),
        _N.ptr(master), factors.data_ptr(), steps.data_ptr(), _N.SCALAR_CODES[steps.dtype], partials.data_ptr(),
        partials.shape[1], inv_scale.data_ptr(), lr.data_ptr(), _N.SCALAR_CODES[lr.dtype], out_stats.data_ptr(),
        float(beta2_decay), EPS1_DEFAULT if eps1 is None else float(eps1), float(eps2), float(d),
        float(weight_decay), float(max_norm), bool(maximize), *self._device_args(steps.device), fmt, seed_ptr)


_device_tables: dict = {}  # (device index, address of a step tensor) -> (rows, device table, host staging)
_kept_for_graphs: list = []  # device tables that a captured CUDA graph may still read


def adafactor_step_cuda(self, params, grads, master: Optional[Tensor], factors: Tensor, steps: Tensor,
                        partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor, beta2_decay: float,
                        eps1: Optional[float], eps2: float, d: float, weight_decay: float, max_norm: float,
                        maximize: bool = False, seed: Optional[Tensor] = None) -> None:
    """Adafactor on the cuda backend (a method of ``CudaBackend``): the table uploaded to the device once per call
    site (its step tensor), asynchronously from page-locked memory, and reused while it holds the same ints."""
    from . import _work
    from .cuda import _capturing, _device_index
    from .reference_adafactor import EPS1_DEFAULT
    params, grads = list(params), list(grads)
    fmt, seed_ptr = check(self.name, params, grads, master, factors, steps, partials, inv_scale, lr, out_stats, seed)
    rows = table(params, grads)
    index = _device_index(steps.device)
    key = (index, steps.data_ptr())
    kept = _device_tables.get(key)
    if kept is None or kept[0] != rows:
        if _capturing(index):
            raise RuntimeError("the cuda backend cannot upload a new Adafactor table while a CUDA graph is being "
                               "captured: run one step eagerly with exactly these tensors before capturing it")
        host, view = _work.staging(len(rows), steps.device)
        view[:len(rows)] = rows
        kept = _device_tables[key] = (rows, _work.upload(host, steps.device), host)
    if _capturing(index):
        _kept_for_graphs.append(kept[1])
    partials = _N.partials_arg(partials)
    self._mod().adafactor_step(
        kept[1].data_ptr(), len(params), _N.DTYPE_CODES[params[0].dtype] if params else 0, _N.grad_code(grads),
        _N.ptr(master), factors.data_ptr(), steps.data_ptr(), _N.SCALAR_CODES[steps.dtype], partials.data_ptr(),
        partials.shape[1], inv_scale.data_ptr(), lr.data_ptr(), _N.SCALAR_CODES[lr.dtype], out_stats.data_ptr(),
        float(beta2_decay), EPS1_DEFAULT if eps1 is None else float(eps1), float(eps2), float(d),
        float(weight_decay), float(max_norm), bool(maximize), *self._device_args(steps.device), fmt, seed_ptr)
