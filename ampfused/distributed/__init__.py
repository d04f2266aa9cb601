"""ampfused on torch.distributed: DDP helpers and the ZeRO-1 sharded fused optimizers."""
from ._comm import global_sum, sum_hook
from .optimizers import ShardedFusedAdam, ShardedFusedAdamW, ShardedFusedSGD
from .sharded import ShardedFusedOptimizer

__all__ = ["global_sum", "sum_hook", "ShardedFusedAdam", "ShardedFusedAdamW", "ShardedFusedSGD",
           "ShardedFusedOptimizer"]

from .optimizers import ShardedFusedLion  # noqa: E402
__all__ += ["ShardedFusedLion"]

from .adafactor import ShardedFusedAdafactor  # noqa: E402
__all__ += ["ShardedFusedAdafactor"]

from .optimizers import ShardedFusedMuon  # noqa: E402
__all__ += ["ShardedFusedMuon"]
