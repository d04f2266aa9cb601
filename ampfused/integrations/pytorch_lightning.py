"""``pytorch_lightning`` (the standalone package): the same ``FusedMixedPrecision`` plugin as
:mod:`ampfused.integrations.lightning`, built on ``pytorch_lightning``'s ``MixedPrecision`` (a
``pytorch_lightning.Trainer`` accepts only its own package's plugins)."""
from __future__ import annotations

from .lightning import plugin_class

try:
    from pytorch_lightning.plugins.precision import MixedPrecision as _MixedPrecision
    from pytorch_lightning.utilities import GradClipAlgorithmType as _Algorithm
except ImportError as e:
    raise ImportError("ampfused.integrations.pytorch_lightning needs pytorch_lightning "
                      "(pip install 'ampfused[integrations]')") from e

__all__ = ["FusedMixedPrecision"]

FusedMixedPrecision = plugin_class(_MixedPrecision, _Algorithm, __name__)
