"""Fused optimizers with fp32 master weights over flat buffers."""
from .adam import FusedAdam, FusedAdamW
from .sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD"]
