"""ampfused: the fused mixed-precision optimizer step (unscale, inf check, norm, clip, update) for PyTorch."""
__version__ = "0.1.0"

from . import ops  # noqa: F401
from .guard import SpikeGuard
from .optim import FusedAdam, FusedAdamW, FusedSGD
from .scaler import GradScaler
from .policies import MinScaleError, ScalePolicy, register_scale_policy
from .clip import clip_grad_norm_
from . import cuda  # noqa: F401  (ampfused.cuda.amp.GradScaler, the torch.cuda.amp spelling)

__all__ = ["ops", "__version__", "SpikeGuard", "FusedAdam", "FusedAdamW", "FusedSGD",
           "GradScaler", "clip_grad_norm_", "cuda",
           "ScalePolicy", "register_scale_policy", "MinScaleError",
           "ShardedFusedAdam", "ShardedFusedAdamW", "ShardedFusedSGD"]

from .optim import FusedAdafactor  # noqa: E402

__all__ += ["FusedAdafactor"]

_DISTRIBUTED = ("ShardedFusedAdam", "ShardedFusedAdamW", "ShardedFusedSGD")

from .optim import FusedLion  # noqa: E402
__all__ += ["FusedLion", "ShardedFusedLion", "ShardedFusedAdafactor"]
_DISTRIBUTED += ("ShardedFusedLion", "ShardedFusedAdafactor")


def __getattr__(name):
    # imported on first use: ampfused.distributed needs torch.distributed, which some builds of torch lack
    if name in _DISTRIBUTED or name == "distributed":
        import importlib
        distributed = importlib.import_module(".distributed", __name__)  # not "from . import": that asks here first
        return distributed if name == "distributed" else getattr(distributed, name)
    raise AttributeError(f"module 'ampfused' has no attribute {name!r}")
