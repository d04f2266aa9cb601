"""Fused optimizers with fp32 master weights: the parameters and gradients read where they live, the optimizer's
own state (masters, moments, step counts) in flat buffers per segment (``_segment.py``)."""
from .adam import FusedAdam, FusedAdamW
from ._state import torch_state_dict
from .sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD", "torch_state_dict"]

from .lion import FusedLion, optimi_state_dict  # noqa: E402
__all__ += ["FusedLion", "optimi_state_dict"]
from .adafactor import FusedAdafactor  # noqa: E402

__all__ += ["FusedAdafactor"]
from .muon import FusedMuon  # noqa: E402

__all__ += ["FusedMuon"]
UNSHARDED = ()  # the fused optimizers without a ZeRO-1 version (ampfused.distributed)
