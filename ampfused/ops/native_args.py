"""The checks that run in Python before any native kernel, and the packing of the arguments only the native and
Triton backends pass (the tensor table of a step, its compact-state and 8-bit moment arguments).

The kernel modules are torch-free: they take addresses, sizes and dtype codes (:mod:`ampfused._native`). Everything
that could make a kernel read or write the wrong memory is therefore checked here, and each failed rule names the
tensor.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._native import DTYPE_CODES, NATIVE_DTYPES, NO_GRAD, SCALAR_CODES, STATE_CODES, ptr
from . import state_precision as sp
from .reference import STATE_ALIGN

ALIGN = 16  # bytes: the step kernels use 128-bit vector loads and stores
_NATIVE_SET = frozenset(NATIVE_DTYPES)


def _dtype_rule(name: str, t: Tensor, dtypes: Sequence[torch.dtype], backend: str) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]} for the {backend} backend, "
                        f"got {t.dtype}")


def check_device(name: str, t: Tensor, device: torch.device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def check_scalar(name: str, t: Tensor, dtypes: Sequence[torch.dtype], device: torch.device, backend: str) -> None:
    check_device(name, t, device)
    _dtype_rule(name, t, dtypes, backend)
    if t.dim() != 0:
        raise ValueError(f"{name} must be a 0-d tensor, got shape {tuple(t.shape)}")


def check_step(backend: str, params, grads, master: Optional[Tensor], states, steps: Tensor, partials: Tensor,
               inv_scale: Tensor, lr: Tensor, out_stats: Tensor, seed: Optional[Tensor] = None,
               state_scales: Optional[Tensor] = None) -> tuple:
    """What a native step kernel relies on beyond :func:`ampfused.ops.checks.step_inputs` (which the ops run
    first): native dtypes, fp32 flat state buffers that start 16-byte aligned, one gradient dtype (compact
    state: int16 remainders, bf16 moments, an int64 seed). Returns the kernels' compact-state arguments
    ``(master format, state dtype code, seed address)``."""
    dev = steps.device
    states = list(states)
    fmt = sp.step_format(params, master, states, seed, state_scales)
    compact = fmt.master != sp.MASTER_FP32 or fmt.state_dtype is not None
    if params:
        _dtype_rule("params[0]", params[0], NATIVE_DTYPES, backend)
    g = next((x for x in grads if x is not None), None)
    if g is not None:
        _dtype_rule("grads", g, NATIVE_DTYPES, backend)
    if compact:
        _check_compact(backend, fmt, master, states, seed, dev, state_scales)
    elif master is not None:
        _dtype_rule("master", master, (torch.float32,), backend)
    elif params and params[0].dtype != torch.float32:
        raise ValueError(f"params have dtype {params[0].dtype}: without a master buffer they must be float32 "
                         "(pass an fp32 master=...)")
    for sname, s in ([] if compact else states + [("master", master)]):
        if s is None:
            continue
        _dtype_rule(sname, s, (torch.float32,), backend)
        if s.numel() and s.data_ptr() % ALIGN:
            raise ValueError(f"{sname} must start at a {ALIGN}-byte aligned address for the {backend} backend "
                             f"(vector loads), got address {s.data_ptr():#x} (offset {s.storage_offset()} "
                             "elements into its storage)")
    check_scalar("lr", lr, tuple(SCALAR_CODES), dev, backend)
    check_scalar("inv_scale", inv_scale, (torch.float32,), dev, backend)
    _dtype_rule("steps", steps, tuple(SCALAR_CODES), backend)
    check_device("partials", partials, dev)
    if partials.dtype != torch.float32 or partials.dim() != 2 or partials.shape[0] != 2:
        raise ValueError(f"partials must be a float32 [2, P] tensor, got {partials.dtype} {tuple(partials.shape)}")
    check_device("out_stats", out_stats, dev)
    if out_stats.dtype != torch.float32 or out_stats.numel() != 2 or not out_stats.is_contiguous():
        raise ValueError(f"out_stats must be a contiguous float32 tensor of 2 elements, got {out_stats.dtype} "
                         f"{tuple(out_stats.shape)}")
    if compact:
        return fmt.master, STATE_CODES[fmt.state_dtype or torch.float32], ptr(seed)
    return 0, 0, 0


def q8_args(state_scales: Optional[Tensor]) -> tuple:
    """The kernels' 8-bit moment arguments after :func:`ampfused._native.compact_args`: the block scales' address and columns
    (``(0, 0)`` without 8-bit moments)."""
    if state_scales is None:
        return 0, 0
    return state_scales.data_ptr(), state_scales.shape[-1]


def layout_align(state: Optional[Tensor]) -> int:
    """Elements between parameter starts of a step whose moments are ``state`` (any of them, or None)."""
    return sp.QBLOCK if state is not None and state.dtype == torch.uint8 else STATE_ALIGN


def _check_compact(backend: str, fmt, master, states, seed, dev, state_scales=None) -> None:
    """check_step's rules for compact state (the tensors' dtypes were matched by state_precision.step_format)."""
    if master is not None:
        _dtype_rule("master", master, (torch.int16,) if fmt.master == sp.MASTER_REMAINDER else (torch.float32,),
                    backend)
    for sname, s in states + [("master", master)]:
        if s is not None and s.numel() and s.data_ptr() % ALIGN:
            raise ValueError(f"{sname} must start at a {ALIGN}-byte aligned address for the {backend} backend, got "
                             f"address {s.data_ptr():#x}")
    if seed is not None:
        check_scalar("seed", seed, (torch.int64,), dev, backend)
    if state_scales is not None:
        check_device("state_scales", state_scales, dev)
        given = sum(1 for _, s in states if s is not None)
        if state_scales.dim() != 2 or state_scales.shape[0] != given or not state_scales.is_contiguous():
            raise ValueError(f"state_scales must be a contiguous [{given}, blocks] fp32 tensor (one row per moment) "
                             f"for the {backend} backend, got shape {list(state_scales.shape)}")


def check_state_sizes(backend: str, buffers, total: int, device: torch.device) -> None:
    """The flat buffers a native step writes hold at least the layout's ``total`` elements, on its device."""
    for name, t in buffers:
        if t is None:
            continue
        check_device(name, t, device)
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != total:
            raise ValueError(f"{name} must be a contiguous 1-D flat buffer of {total} elements (state_layout of the "
                             f"params) for the {backend} backend, got shape {tuple(t.shape)}, stride {t.stride()}")


def step_table(params, grads, align: int = STATE_ALIGN) -> Tuple[List[int], int]:
    """The tensor table of a step as a flat list of ints (``T`` rows of ``TABLE_COLS``: param address, grad
    address, numel or ``NO_GRAD`` for a parameter without a gradient, state offset; see step_args.h) and the
    size of the flat state buffers, laid out as :func:`ampfused.ops.state_layout` lays them out (``align``: a
    power of two, ``state_precision.layout_align`` of the step's format), in one pass over the tensors (the
    per-step host work of the native and Triton steps)."""
    rows: List[int] = []
    total = 0
    up = align - 1
    for p, g in zip(params, grads):
        n = p.numel()
        offset = (total + up) & ~up
        total = offset + n
        rows += (p.data_ptr(), 0, NO_GRAD, offset) if g is None else (p.data_ptr(), g.data_ptr(), n, offset)
    return rows, total


def grad_code(grads) -> int:
    g = next((x for x in grads if x is not None), None)
    return DTYPE_CODES[g.dtype] if g is not None else 0


def check_grads(grads, inv_scale: Tensor, backend: str) -> None:
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise TypeError(f"grads must be a list of tensors, got {type(grads).__name__}")
    check_scalar("inv_scale", inv_scale, (torch.float32,), inv_scale.device, backend)
    where = inv_scale.get_device()
    strided = torch.strided
    if all(type(g) is Tensor and g.get_device() == where and g.layout is strided and g.dtype in _NATIVE_SET
           for g in grads):
        return  # the common case in one pass; else find the first gradient that breaks a rule, and say which
    for i, g in enumerate(grads):
        check_device(f"grads[{i}]", g, inv_scale.device)
        _dtype_rule(f"grads[{i}]", g, NATIVE_DTYPES, backend)


def partials_arg(partials: Tensor) -> Tensor:
    """The partials as the kernels read them: row-major [2, P] contiguous (a copy only if needed)."""
    return partials if partials.is_contiguous() else partials.contiguous()


class Packer:
    """Packs step calls for one native module: the slots by the names the module exports (``STEP_SLOTS``, in
    ``csrc/include/ampfused/step_pack.h``'s order), the hyperparameters by name in the order the op's entry reads
    them (``step_ops()``)."""

    def __init__(self, mod):
        self.mod = mod
        self.index = {name: i for i, name in enumerate(mod.STEP_SLOTS)}
        self.size = len(self.index)
        self.hypers = {op: tuple(names) for op, names in mod.step_ops().items()}
        self._health_ops = None

    @property
    def health_ops(self) -> frozenset:
        """The ops whose entries write a call's health sums (their step files register ``HEALTH_<op>``), read
        from the module the first time they are asked for."""
        if self._health_ops is None:
            self._health_ops = frozenset(k[len("HEALTH_"):] for k, v in self.mod.step_constants().items()
                                         if k.startswith("HEALTH_") and v)
        return self._health_ops

    def slots(self, *parts: dict) -> List[int]:
        """One int per slot from ``parts`` (dicts of slot values; ``rows`` and names starting with ``_``, the
        caller's, are left out); a slot none of them sets is 0."""
        out = [0] * self.size
        index = self.index
        for part in parts:
            for name, value in part.items():
                if name != "rows" and name[0] != "_":
                    out[index[name]] = int(value)
        return out

    def hyper(self, call) -> List[float]:
        names = self.hypers.get(call.spec.name)
        if names is None:
            raise RuntimeError(f"this build of ampfused's native module has no {call.spec.name} entry (it has "
                               f"{sorted(self.hypers)}): rebuild it (pip install -e .)")
        return call.hyper_values(names)


_packers: dict = {}


def packer(mod) -> Packer:
    """The module's packer (made once per module)."""
    p = _packers.get(id(mod))
    if p is None or p.mod is not mod:
        p = _packers[id(mod)] = Packer(mod)
    return p
