"""ShardedFusedAdafactor: ZeRO-1 for Adafactor over FSDP2's pieces (:mod:`.pieces`): each rank keeps the state
(masters or remainders, factors, step counts) of its piece of every parameter's first dimension, stepped by
:class:`ampfused.FusedAdafactor`'s FSDP2 path, which sums each whole parameter's sums over the ranks on the device
(its kernels in three phases; docs/adafactor.md, "FSDP2"). ``state_dict()`` gathers the whole state in
``torch.optim.Adafactor``'s layout (what :class:`ampfused.FusedAdafactor` saves); ``load_state_dict`` takes such a
state dict from any world size, ``FusedAdafactor`` or ``torch.optim.Adafactor``.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..optim import _params as P
from ..optim._factored_state import factor_placements, full_factor_shape
from ..optim.adafactor import AdafactorMath, FusedAdafactor
from .pieces import PieceShardedOptimizer


class ShardedFusedAdafactor(PieceShardedOptimizer):
    """Adafactor (``torch.optim.Adafactor``'s math, :class:`ampfused.FusedAdafactor`'s arguments and state
    precision options) with ZeRO-1 sharding: each rank keeps the state of its piece of every parameter's first
    dimension. Extra arguments: ``process_group`` (``None``: the default group) and ``grad_reduction``
    (``"mean"``: gradients averaged over ranks as DDP does, ``"sum"``: summed, ``None``: already reduced, e.g.
    by DDP). ``max_grad_norm`` and ``spike_guard`` act on the global norm; every rank must call :meth:`step`,
    :meth:`state_dict` and :meth:`ampfused.GradScaler.unscale_` (they communicate). The steps run
    :class:`ampfused.FusedAdafactor`'s sharded step (its kernels in three phases; docs/adafactor.md, "FSDP2")."""

    inner_class = FusedAdafactor

    def __init__(self, params, lr=1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0, *, foreach: Optional[bool] = None, maximize: bool = False,
                 process_group=None, grad_reduction: Optional[str] = "mean", max_grad_norm: Optional[float] = None,
                 master_weights: Optional[bool] = None, backend: Optional[str] = None, spike_guard=None,
                 store_param_remainders: bool = False, bf16_stochastic_round: bool = False, seed: int = 0):
        defaults = AdafactorMath.adafactor_defaults(lr, beta2_decay, eps, d, weight_decay, foreach, maximize)

        def check(gi, k, p):
            if p.is_complex():
                raise RuntimeError("Adafactor does not support complex parameters")

        super().__init__(P.normalise_groups(params), defaults,
                         dict(max_grad_norm=max_grad_norm, backend=backend, spike_guard=spike_guard,
                              store_param_remainders=store_param_remainders,
                              bf16_stochastic_round=bf16_stochastic_round, seed=seed),
                         process_group=process_group, grad_reduction=grad_reduction, master_weights=master_weights,
                         check=check)

    def _placement(self, shard, key: str) -> Tuple[tuple, tuple]:
        if key in ("row_var", "col_var"):
            return factor_placements(shard, key), full_factor_shape(tuple(shard.shape), key)
        return super()._placement(shard, key)
