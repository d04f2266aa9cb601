"""ampfused: the fused mixed-precision optimizer step (unscale, inf check, norm, clip, update) for PyTorch."""
__version__ = "0.1.0"

from . import ops  # noqa: F401
from . import optim
from .guard import SpikeGuard
from .optim import *  # noqa: F401,F403  (every fused optimizer: optim.__all__)
from .scaler import GradScaler
from .policies import MinScaleError, ScalePolicy, register_scale_policy
from .clip import clip_grad_norm_
from . import cuda  # noqa: F401  (ampfused.cuda.amp.GradScaler, the torch.cuda.amp spelling)

# each fused optimizer's ZeRO-1 sharded version (ampfused.distributed), imported on first use
_DISTRIBUTED = tuple("Sharded" + name for name in optim.__all__
                     if name.startswith("Fused") and name not in optim.UNSHARDED)

__all__ = ["ops", "__version__", "SpikeGuard", *(n for n in optim.__all__ if n.startswith("Fused")),
           "GradScaler", "clip_grad_norm_", "cuda", "ScalePolicy", "register_scale_policy", "MinScaleError",
           *_DISTRIBUTED]


def __getattr__(name):
    # imported on first use: ampfused.distributed needs torch.distributed, which some builds of torch lack
    if name in _DISTRIBUTED or name == "distributed":
        import importlib
        distributed = importlib.import_module(".distributed", __name__)  # not "from . import": that asks here first
        return distributed if name == "distributed" else getattr(distributed, name)
    raise AttributeError(f"module 'ampfused' has no attribute {name!r}")
