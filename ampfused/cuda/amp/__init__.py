"""One-line swap for ``torch.cuda.amp``: ``from ampfused.cuda.amp import GradScaler, autocast``.

``GradScaler`` here takes ``torch.cuda.amp.GradScaler``'s arguments (no ``device``; it is CUDA), is an instance
of both ``torch.cuda.amp.GradScaler`` and :class:`ampfused.GradScaler`, and, like torch's, warns once per
construction with a ``FutureWarning`` that names its non-deprecated spelling. ``autocast``, ``custom_fwd`` and
``custom_bwd`` are torch's own, re-exported so an import line that also takes them keeps working.
"""
from typing import Optional

import torch
from torch.cuda.amp import autocast, custom_bwd, custom_fwd  # noqa: F401  (re-exported unchanged)
from typing_extensions import deprecated

from ...scaler import GradScaler as _GradScaler
from ...scaler import OptState  # noqa: F401  (torch.cuda.amp.grad_scaler exports it too)

__all__ = ["GradScaler", "autocast", "custom_fwd", "custom_bwd"]


class GradScaler(_GradScaler, torch.cuda.amp.GradScaler):
    """See :class:`ampfused.GradScaler`. ``ampfused.cuda.amp.GradScaler(args...)`` is deprecated, as torch's
    is: use ``ampfused.GradScaler("cuda", args...)``."""

    @deprecated("`ampfused.cuda.amp.GradScaler(args...)` is deprecated. "
                "Please use `ampfused.GradScaler('cuda', args...)` instead.", category=FutureWarning)
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, backend: Optional[str] = None,
                 **extras) -> None:
        # extras: the keyword-only options of ampfused.GradScaler (policy=, min_scale=, ...)
        _GradScaler.__init__(self, "cuda", init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled,
                             backend=backend, **extras)
