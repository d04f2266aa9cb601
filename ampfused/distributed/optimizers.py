"""ShardedFusedAdam, ShardedFusedAdamW, ShardedFusedSGD, ShardedFusedLion and ShardedFusedMuon: the fused
optimizers' math with ZeRO-1 sharding."""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.reference_muon import EPS, NS_A, NS_B, NS_C, NS_STEPS
from ..optim import _params as P
from ..optim import _precision
from ..optim.muon import FusedMuon, MuonMath, with_adamw_defaults
from ..optim.adam import AdamMath
from ..optim.sgd import SgdMath
from ..optim.lion import LionMath
from .pieces import PieceShardedOptimizer
from .sharded import ShardedFusedOptimizer


class _ShardedAdamBase(AdamMath, ShardedFusedOptimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, foreach=None, fused=None, capturable=False,
                 differentiable=False, store_param_remainders: bool = False, bf16_stochastic_round: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32,
                 seed: int = 0):
        precision = _precision.make(type(self).__name__, master_weights, store_param_remainders, bf16_stochastic_round,
                                    {"exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype}, seed)
        defaults = self.adam_defaults(lr, betas, eps, weight_decay, amsgrad, maximize, differentiable)
        super().__init__(params, defaults, process_group=process_group, grad_reduction=grad_reduction,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard, precision=precision)


class ShardedFusedAdam(_ShardedAdamBase):
    """Adam (L2 decay, ``torch.optim.Adam`` math) with ZeRO-1 sharding: the arguments of
    :class:`ampfused.FusedAdam`, plus ``process_group`` (``None``: the default group) and ``grad_reduction``
    (``"mean"``: gradients averaged over ranks as DDP does, ``"sum"``: summed, ``None``: already reduced, e.g. by
    DDP). ``spike_guard`` and ``max_grad_norm`` act on the global norm; ``track_nonfinite`` is not offered.

    State precision (``docs/state-precision.md``): ``store_param_remainders``, ``bf16_stochastic_round``,
    ``exp_avg_dtype``/``exp_avg_sq_dtype`` and ``seed`` as in :class:`ampfused.FusedAdam`, applied to each rank's
    shard of the state. Stochastic rounding draws depend on the world size (a world of one draws as
    :class:`ampfused.FusedAdam` does); remainders draw nothing, so their masters do not. With 8-bit moments
    (``torch.uint8``) the shards are cut at multiples of their 256-element blocks, so each rank keeps whole blocks
    of each parameter and their scales, and a state dict holds them as the unsharded optimizer's does."""


class ShardedFusedAdamW(_ShardedAdamBase):
    """AdamW (decoupled weight decay) with ZeRO-1 sharding; see :class:`ShardedFusedAdam`."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class ShardedFusedSGD(SgdMath, ShardedFusedOptimizer):
    """SGD (``torch.optim.SGD`` math) with ZeRO-1 sharding; arguments of :class:`ampfused.FusedSGD` plus
    ``process_group`` and ``grad_reduction`` (see :class:`ShardedFusedAdam`), state precision options included
    (``momentum_dtype`` for the momentum buffer, ``torch.uint8`` included)."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, foreach=None, fused=None, capturable=False,
                 differentiable=False, store_param_remainders: bool = False, bf16_stochastic_round: bool = False,
                 momentum_dtype: torch.dtype = torch.float32, seed: int = 0):
        precision = _precision.make(type(self).__name__, master_weights, store_param_remainders, bf16_stochastic_round,
                                    {"momentum_dtype": momentum_dtype}, seed)
        defaults = self.sgd_defaults(lr, momentum, dampening, weight_decay, nesterov, maximize, differentiable)
        super().__init__(params, defaults, process_group=process_group, grad_reduction=grad_reduction,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard, precision=precision)


class ShardedFusedLion(LionMath, ShardedFusedOptimizer):
    """Lion with ZeRO-1 sharding; arguments of :class:`ampfused.FusedLion` plus ``process_group`` and
    ``grad_reduction`` (see :class:`ShardedFusedAdam`), state precision options included (``exp_avg_dtype``)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 process_group=None, grad_reduction: Optional[str] = "mean", max_grad_norm: Optional[float] = None,
                 master_weights: Optional[bool] = None, backend: Optional[str] = None, spike_guard=None,
                 store_param_remainders: bool = False, bf16_stochastic_round: bool = False,
                 exp_avg_dtype: torch.dtype = torch.float32, seed: int = 0):
        precision = _precision.make(type(self).__name__, master_weights, store_param_remainders, bf16_stochastic_round,
                                    {"exp_avg_dtype": exp_avg_dtype}, seed)
        defaults = self.lion_defaults(lr, betas, weight_decay, maximize)
        super().__init__(params, defaults, process_group=process_group, grad_reduction=grad_reduction,
                         max_grad_norm=max_grad_norm, master_weights=master_weights, backend=backend,
                         spike_guard=spike_guard, precision=precision)


class ShardedFusedMuon(PieceShardedOptimizer):
    """Muon (:class:`ampfused.FusedMuon`'s arguments, its AdamW groups, state precision options and
    ``expert_stacks``) with ZeRO-1 sharding over FSDP2's pieces (:mod:`.pieces`): each rank keeps the state of its
    piece of every parameter's first dimension; the step joins each matrix's pieces on the rank that owns it for the
    Newton-Schulz iteration (owners balanced by the iteration's cost; two all-to-alls a step) and returns the result
    in pieces (``FusedMuon``'s FSDP2 path; docs/muon.md). Extra arguments: ``process_group`` (``None``: the
    default group) and ``grad_reduction`` (``"mean"``: gradients averaged over ranks as DDP does, ``"sum"``:
    summed, ``None``: already reduced, e.g. by DDP). Every rank must call :meth:`step`, :meth:`state_dict` and
    :meth:`ampfused.GradScaler.unscale_` (they communicate). Without a clip, and without stochastic rounding or
    8-bit moments (whose draws and blocks follow the pieces), the steps are :class:`ampfused.FusedMuon`'s bits."""

    inner_class = FusedMuon

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(NS_A, NS_B, NS_C), eps=EPS, ns_steps=NS_STEPS,
                 adjust_lr_fn: Optional[str] = None, *, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard=None, store_param_remainders: bool = False,
                 bf16_stochastic_round: bool = False, momentum_dtype: torch.dtype = torch.float32, seed: int = 0,
                 expert_stacks: bool = False):
        defaults = MuonMath.muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                                          adjust_lr_fn)
        groups = [with_adamw_defaults(g) for g in P.normalise_groups(params)]
        shapes = MuonMath()
        shapes.expert_stacks = bool(expert_stacks)
        shapes._check_shapes(groups)
        super().__init__(groups, defaults,
                         dict(max_grad_norm=max_grad_norm, backend=backend, spike_guard=spike_guard,
                              store_param_remainders=store_param_remainders,
                              bf16_stochastic_round=bf16_stochastic_round, momentum_dtype=momentum_dtype, seed=seed,
                              expert_stacks=expert_stacks),
                         process_group=process_group, grad_reduction=grad_reduction, master_weights=master_weights)
