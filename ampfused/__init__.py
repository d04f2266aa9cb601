"""ampfused: the fused mixed-precision optimizer step (unscale, inf check, norm, clip, update) for PyTorch."""
__version__ = "0.1.0"

from . import ops  # noqa: F401

__all__ = ["ops", "__version__"]
