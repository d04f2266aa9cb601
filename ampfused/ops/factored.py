"""The factored state layout (``layout="factored"`` in a step op's record): a parameter of two or more dimensions
keeps its second moment as a row and a column vector (the leading dimensions a batch), any other keeps a vector
shaped like itself; one flat buffer (``factors``) holds them all, each parameter's slice where
:func:`factor_layout` places it. The layout's input rule is :func:`check_factors`."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from . import checks
from .reference_common import STATE_ALIGN, state_layout


def factored(shape: Sequence[int]) -> bool:
    """Whether a parameter of this shape keeps row and column factors (torch: ``grad.dim() > 1``)."""
    return len(shape) > 1


def factor_dims(shape: Sequence[int]) -> Tuple[int, int, int]:
    """``(B, R, C)`` of a factored shape: the leading dimensions as one batch, the last two as rows, columns."""
    return math.prod(shape[:-2]), int(shape[-2]), int(shape[-1])


def factor_size(shape: Sequence[int]) -> int:
    """Elements of ``factors`` a parameter of this shape owns: ``B*R + B*C`` (rows, then columns) when factored,
    else its number of elements."""
    if factored(shape):
        b, r, c = factor_dims(shape)
        return b * r + b * c
    return math.prod(shape)


def factor_layout(shapes: Sequence[Sequence[int]], align: int = STATE_ALIGN) -> Tuple[List[int], int]:
    """``(offsets, total)`` of each parameter's slice of ``factors`` (:func:`state_layout` of the sizes)."""
    return state_layout([factor_size(s) for s in shapes], align)


def factor_views(factors: Tensor, offset: int, shape: Sequence[int]) -> dict:
    """A parameter's state as torch.optim shows a factored second moment, as views of ``factors``: ``row_var``
    shaped ``[..., R, 1]`` and ``col_var`` ``[..., 1, C]`` (contiguous) when factored, else ``variance`` shaped
    like the parameter (contiguous)."""
    shape = tuple(shape)
    if not factored(shape):
        n = math.prod(shape)
        return {"variance": factors[offset:offset + n].view(shape)}
    b, r, c = factor_dims(shape)
    rows = factors[offset:offset + b * r].view(shape[:-1] + (1,))
    cols = factors[offset + b * r:offset + b * r + b * c].view(shape[:-2] + (1, c))
    return {"row_var": rows, "col_var": cols}


def check_factors(name: str, factors, params, master, device) -> None:
    """The rule of a factored state buffer: flat, on the step's device, ``factor_layout``'s total of elements,
    fp32 or fp64 (fp32 only with int16 master remainders; fp64 only with an fp64 master or fp64 parameters)."""
    _, total = factor_layout([tuple(p.shape) for p in params])
    dtypes = (torch.float32, torch.float64) if master is None or master.dtype != torch.int16 else (torch.float32,)
    checks.tensor(name, factors, dtypes=dtypes, flat=True, device=device, numel=total)
    if factors.dtype == torch.float64 and master is not None and master.dtype != torch.float64:
        raise TypeError(f"{name} is float64: the fp64 form needs a float64 master (or float64 params)")
