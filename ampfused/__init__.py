"""ampfused: the fused mixed-precision optimizer step (unscale, inf check, norm, clip, update) for PyTorch."""
__version__ = "0.1.0"

from . import ops  # noqa: F401
from .flat import FlatBuffer
from .optim import FusedAdam, FusedAdamW, FusedSGD

__all__ = ["ops", "__version__", "FlatBuffer", "FusedAdam", "FusedAdamW", "FusedSGD"]
