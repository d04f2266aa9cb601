"""Input validation shared by every op entry: each rule names the tensor and what it broke.

All checks run before any backend is called, so bad input never leaves state half-updated.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tensor(name: str, t, *, dtypes: Sequence[torch.dtype] = FLOATS, device: Optional[torch.device] = None,
           numel: Optional[int] = None, flat: bool = False, scalar: bool = False) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if scalar and t.dim() != 0:
        raise ValueError(f"{name} must be a 0-d tensor, got shape {tuple(t.shape)}")
    if flat:
        if t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D flat buffer, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a flat buffer), got stride {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")


def grads_list(name: str, grads, device: torch.device) -> None:
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(grads).__name__}")
    for i, g in enumerate(grads):
        tensor(f"{name}[{i}]", g, dtypes=FLOATS, device=device)


def scalars(**kw) -> None:
    """Python numbers: each must be a finite float (``max_norm`` may be inf)."""
    for k, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{k} must be a Python number, got {type(v).__name__}")
        if math.isnan(v) or (math.isinf(v) and k != "max_norm"):
            raise ValueError(f"{k} must be finite, got {v}")


def compute_dtype_of(params: Sequence[Tensor], master: Optional[Tensor]) -> torch.dtype:
    if master is not None:
        return master.dtype
    return params[0].dtype if len(params) else torch.float32


def is_dense(t: Tensor) -> bool:
    """True when ``t``'s elements fill one gap-free block of memory starting at ``t.data_ptr()`` (contiguous
    in some order of its dimensions: row-major, ``channels_last``, a transpose)."""
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def same_layout(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` have one shape and put every element at the same place in memory."""
    if a.shape != b.shape:
        return False
    if a.stride() == b.stride():
        return True
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def step_inputs(params: Sequence[Tensor], grads: Sequence[Optional[Tensor]], master: Optional[Tensor],
                states: Iterable[tuple], steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
                out_stats: Tensor, seed: Optional[Tensor] = None, state_scales: Optional[Tensor] = None) -> None:
    """Shared rules of the optimizer-step ops (see ``reference.adam_step_`` for the layout; compact state in
    ``state_precision``)."""
    from . import state_precision as sp
    from .reference import state_layout
    if isinstance(params, Tensor) or not isinstance(params, (list, tuple)):
        raise TypeError(f"params must be a list of tensors, got {type(params).__name__}")
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise TypeError(f"grads must be a list of tensors (or None), got {type(grads).__name__}")
    if len(grads) != len(params):
        raise ValueError(f"grads must have one entry per parameter: {len(params)} params, {len(grads)} grads")
    tensor("steps", steps, dtypes=(torch.float32, torch.float64))
    dev = steps.device
    if steps.dim() != 1 or not steps.is_contiguous() or steps.numel() != len(params):
        raise ValueError(f"steps must be a contiguous 1-D tensor with one step count per parameter ({len(params)}), "
                         f"got shape {tuple(steps.shape)}")
    pdtype = params[0].dtype if len(params) else None
    gdtype = None
    for i, p in enumerate(params):
        tensor(f"params[{i}]", p, device=dev)
        if p.dtype != pdtype:
            raise TypeError(f"params[{i}] has dtype {p.dtype} but params[0] has {pdtype}: one step takes "
                            "parameters of one dtype")
        if not is_dense(p):
            raise ValueError(f"params[{i}] (shape {tuple(p.shape)}, stride {p.stride()}) is not dense: the step "
                             "needs each parameter's elements in one gap-free block of memory")
        g = grads[i]
        if g is None:
            continue
        tensor(f"grads[{i}]", g, device=dev)
        if gdtype is None:
            gdtype = g.dtype
        elif g.dtype != gdtype:
            raise TypeError(f"grads[{i}] has dtype {g.dtype} but an earlier gradient has {gdtype}: one step takes "
                            "gradients of one dtype")
        if not same_layout(p, g):
            raise ValueError(f"grads[{i}] (shape {tuple(g.shape)}, stride {g.stride()}) must have the shape and "
                             f"memory layout of params[{i}] (shape {tuple(p.shape)}, stride {p.stride()})")
    states = list(states)
    fmt = sp.step_format(params, master, states, seed, state_scales)
    if seed is not None:
        tensor("seed", seed, dtypes=(torch.int64,), device=dev, scalar=True)
    if pdtype in LOW_PRECISION and master is None and fmt.master != sp.MASTER_NONE:
        raise ValueError(f"params have dtype {pdtype}: a {pdtype} parameter needs an fp32 master buffer "
                         "(pass master=...), int16 master remainders, or no master with seed= (bfloat16 params, "
                         "stochastic rounding)")
    _, total = state_layout([p.numel() for p in params], sp.layout_align(fmt))
    if master is not None:
        tensor("master", master, dtypes=(torch.float32, torch.float64, torch.int16), flat=True, device=dev,
               numel=total)
    cd = torch.float32 if fmt.master != sp.MASTER_FP32 else compute_dtype_of(params, master)
    for sname, s in states:
        tensor(sname, s, dtypes=(cd,) + sp.COMPACT_STATE_DTYPES if cd == torch.float32 else (cd,), flat=True,
               device=dev, numel=total)
    if state_scales is not None:
        given = sum(1 for _, s in states if s is not None)
        shape = (given, -(-total // sp.QBLOCK))
        tensor("state_scales", state_scales, dtypes=(torch.float32,), device=dev)
        if tuple(state_scales.shape) != shape or not state_scales.is_contiguous():
            raise ValueError(f"state_scales must be a contiguous fp32 tensor of shape {list(shape)} (one row per "
                             f"moment, one column per block of {sp.QBLOCK} elements of the flat buffers), got "
                             f"shape {list(state_scales.shape)}, stride {state_scales.stride()}")
    tensor("inv_scale", inv_scale, dtypes=(torch.float32,), device=dev, scalar=True)
    tensor("lr", lr, dtypes=(torch.float32, torch.float64), device=dev, scalar=True)
    tensor("partials", partials, dtypes=(torch.float32,), device=dev)
    if partials.dim() != 2 or partials.shape[0] != 2:
        raise ValueError(f"partials must have shape [2, P], got {tuple(partials.shape)}")
    tensor("out_stats", out_stats, dtypes=(torch.float32,), device=dev, numel=2)
    if not out_stats.is_contiguous():
        raise ValueError("out_stats must be contiguous")
    if dev.type != "meta":
        _no_overlap(params, master, states, steps, state_scales)
        seen = {}
        for i, p in enumerate(params):
            if p.numel():
                j = seen.setdefault(p.data_ptr(), i)
                if j != i:
                    raise ValueError(f"params[{i}] and params[{j}] are the same memory: each parameter may be given "
                                     "once (the step would update it twice)")
        for i, g in enumerate(grads):
            if g is not None and g.numel() and g.data_ptr() in seen:
                raise ValueError(f"grads[{i}] is the memory of params[{seen[g.data_ptr()]}]: a gradient must not "
                                 "share memory with a parameter the step writes")


def _span(t: Tensor) -> tuple:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _no_overlap(params, master, states, steps, state_scales=None) -> None:
    """The buffers a step writes must not share memory: each flat buffer with the others and the params."""
    flat = [(n, t) for n, t in [("master", master)] + list(states) + [("steps", steps), ("state_scales", state_scales)]
            if t is not None and t.numel()]
    spans = [(n, _span(t)) for n, t in flat]
    for i, (na, (a0, a1)) in enumerate(spans):
        for nb, (b0, b1) in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{na} and {nb} must not overlap in memory (the step writes both)")
        for j, p in enumerate(params):
            if p.numel():
                p0, p1 = _span(p)
                if a0 < p1 and p0 < a1:
                    raise ValueError(f"{na} and params[{j}] must not overlap in memory (the step writes both)")
