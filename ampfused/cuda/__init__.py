"""Mirror of ``torch.cuda`` for code that imports its scaler from there: see :mod:`ampfused.cuda.amp`."""
from . import amp  # noqa: F401

__all__ = ["amp"]
