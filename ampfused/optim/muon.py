"""FusedMuon: torch.optim.Muon's math (momentum orthogonalised by a Newton-Schulz iteration) in the fused step, with
AdamW for the groups that are not matrices (``use_muon=False``), in one optimizer and one step."""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from .. import ops
from ..ops import reference_muon as M
from ..ops import state_precision as sp
from ..ops.reference import STATE_ALIGN
from . import _params as P
from . import _precision
from ._base import FusedOptimizer
from ._whole_shards import WholeShards
from ._segment import is_dtensor, split_dim
from ._step_op import StepOp

# AdamW's defaults (torch.optim.AdamW's) for what a use_muon=False group does not give
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def _check_muon(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn,
                where: str = "") -> None:
    """torch.optim.Muon's rules, in its order and with its messages (NaN refused too), and those of the iteration
    it checks only when it steps."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    elif not P._is_number(lr) or not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}{where}")
    if not isinstance(ns_coefficients, (tuple, list)) or len(ns_coefficients) != 3 \
            or not all(P._is_number(v) and P._finite(v) for v in ns_coefficients):
        raise ValueError(f"Coefficients must be a tuple of exactly 3 values, got {ns_coefficients!r}{where}")
    M.check_hyper(momentum, weight_decay, adjust_lr_fn, ns_steps, eps, where)
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov must be a bool, got {nesterov!r}{where}")


def uses_muon(group: dict) -> bool:
    """Whether a group is stepped by Muon (``use_muon``, True unless a group says otherwise)."""
    return bool(group.get("use_muon", True))


def with_adamw_defaults(group: dict) -> dict:
    """A ``use_muon=False`` group with AdamW's defaults for the keys it does not give (else Muon's ``eps`` and
    ``weight_decay`` would fill them)."""
    if uses_muon(group):
        return group
    return dict(ADAMW_DEFAULTS, **group)


class MuonMath(StepOp):
    """What makes an optimizer Muon: torch.optim.Muon's arguments and rules, the step op (``muon_step_``; AdamW's
    ``adam_step_`` for a ``use_muon=False`` group) and the state (``momentum_buffer``; AdamW's ``exp_avg`` and
    ``exp_avg_sq``)."""

    step_op = "muon_step_"
    state_names = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    expert_stacks = False

    @staticmethod
    def muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) -> dict:
        _check_muon(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)
        return dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                    ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        if uses_muon(group):
            _check_muon(group["lr"], group["weight_decay"], group["momentum"], group["nesterov"],
                        group["ns_coefficients"], group["eps"], group["ns_steps"], group["adjust_lr_fn"], where)
        else:
            P.check_betas(group["betas"], where)
            P.check_eps(group["eps"], where)
            P.check_weight_decay(group["weight_decay"], where)

    def _op_for(self, group: dict) -> str:
        return "muon_step_" if uses_muon(group) else "adam_step_"

    def _state_names_for(self, group: dict) -> tuple:
        return ("momentum_buffer",) if uses_muon(group) else ("exp_avg", "exp_avg_sq")

    def _op_hyper(self, group: dict) -> dict:
        if uses_muon(group):
            a, b, c = (float(v) for v in group["ns_coefficients"])
            return dict(momentum=float(group["momentum"]), nesterov=bool(group["nesterov"]),
                        weight_decay=float(group["weight_decay"]), ns_a=a, ns_b=b, ns_c=c, eps=float(group["eps"]),
                        ns_steps=int(group["ns_steps"]), adjust_lr_fn=group["adjust_lr_fn"])
        beta1, beta2 = group["betas"]
        return dict(beta1=P.hyper_value(beta1, "betas[0]"), beta2=P.hyper_value(beta2, "betas[1]"),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]), decoupled=True,
                    maximize=False)

    def _check_shapes(self, groups, first: int = 0) -> None:
        """torch.optim.Muon's refusal of parameters that are not matrices (in a Muon group; with
        ``expert_stacks=True``, stacks of matrices over their last two dimensions are taken), and of DTensors
        (FSDP2) split other than along one dimension over one mesh dimension (their pieces are joined into whole
        matrices over that dimension's ranks)."""
        for gi, g in enumerate(groups, start=first):
            if not uses_muon(g):
                continue
            for p in g["params"]:
                p = p[1] if isinstance(p, tuple) else p
                if not isinstance(p, Tensor):
                    continue
                if is_dtensor(p):
                    split_dim(p, "FusedMuon", "docs/muon.md")
                    if sum(pl.is_shard() for pl in p.placements) > 1:
                        raise NotImplementedError(
                            f"FusedMuon got a DTensor parameter (shape {tuple(p.shape)}) placed {p.placements}: it "
                            "joins a matrix's pieces over the ranks of one mesh dimension (FSDP2's, or HSDP's "
                            "shard dimension); docs/muon.md")
                if p.is_complex():
                    raise RuntimeError("Muon does not support complex parameters")
                if p.dim() != 2 and not (self.expert_stacks and p.dim() > 2):
                    raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: "
                                     f"{p.size()}" + ("" if self.expert_stacks else
                                                      " (FusedMuon(expert_stacks=True) takes stacks of matrices)"))

    def _check_shapes_now(self) -> None:
        """Every step, before any group steps: a matrix made something else in place (``p.data = p.data.view(-1)``
        keeps its address and version) is refused with torch's message while nothing has changed (one ``dim()`` per
        parameter of a Muon group)."""
        for seg in self._segs.segments:
            group = self.param_groups[seg.group_index]
            if uses_muon(group):
                dims = {p.dim() for p in seg.params}
                if dims - {2} and (not self.expert_stacks or min(dims) < 2):
                    self._check_shapes([group], seg.group_index)

    def _step_op(self, seg, params, grads, group, partials, inv_scale, lr, max_norm, backend: str) -> None:
        if seg.sharded and uses_muon(group):
            self._sharded_step(seg, params, grads, group, partials, inv_scale, lr, max_norm, backend)
            return
        super()._step_op(seg, params, grads, group, partials, inv_scale, lr, max_norm, backend)

    def _sharded_step(self, seg, params, grads, group, partials, inv_scale, lr, max_norm, backend: str) -> None:
        """FSDP2: the step's two elementwise passes over this rank's pieces on ``backend``, and between them the
        iteration of whole matrices, each on the rank that owns it (``._whole_shards``: two all-to-alls over the
        split's ranks, every step, skipped or not)."""
        call = self._step_call(seg, group, partials, inv_scale, lr, max_norm, params=params, grads=grads)
        ops.check_step(call)
        h = call.hyper
        dims = [split_dim(p, "FusedMuon", "docs/muon.md") if is_dtensor(p) else None for p in seg.params]
        pg = self._segs.shard_groups[0] if self._segs.shard_groups else None
        nsd = M.ns_dtype(torch.float64 if seg.dtype == torch.float64 else torch.float32)
        align = sp.QBLOCK if seg.scales is not None else STATE_ALIGN
        plan = getattr(seg, "whole_shards", None)
        shapes, full = [tuple(x.shape) for x in params], [tuple(p.shape) for p in seg.params]
        key = M.MuonScratch.key_of(shapes, full, h["adjust_lr_fn"], nsd, align)
        if plan is None or plan.key != (key, tuple(dims), plan.world, plan.rank):
            scratch = M.MuonScratch(shapes, full, h["adjust_lr_fn"], nsd, params[0].device if params else "cpu", align)
            plan = seg.whole_shards = WholeShards(seg.params, params, dims, pg, scratch, type(self).__name__)
        call.shard = (1, plan.scratch)
        ops.run_step(call, backend)
        plan.apply_(params, pg, lambda x: M.orthogonalize(x, h["ns_a"], h["ns_b"], h["ns_c"], int(h["ns_steps"]),
                                                          h["eps"], x.dtype))
        call.shard = (2, plan.scratch)
        ops.run_step(call, backend)

    def _state_keys_for_load(self, saved: dict, group: Optional[dict] = None):
        return self.state_names if group is None else self._state_names_for(group)

    # torch.optim.Muon keeps no step count; this one keeps it (it keys the stochastic rounding, and AdamW's groups
    # need theirs): a Muon state without one loads as after one step
    def _import_step(self, saved: dict) -> float:
        if "step" in saved:
            return super()._import_step(saved)
        return 1.0


# Muon's momentum in 8-bit codes: measured, not recommended (docs/muon.md, "Alignment")
Q8_MOMENTUM_WARNING = (
    "FusedMuon(momentum_dtype=torch.uint8): Muon's momentum in 8-bit codes trails torch's recipe by 2.5-2.7% in "
    "loss in the 600-step alignment run (docs/muon.md, Alignment; every other state mode stays within 0.13%): the "
    "iteration weighs every direction of the momentum alike, the codes' rounding noise included (3.75% of error "
    "in the momentum, 75% in the update: python -m bench.q8_error --optimizer muon). "
    "momentum_dtype=torch.bfloat16 keeps 2 bytes per element within 0.1%.")


class FusedMuon(MuonMath, FusedOptimizer):
    """``torch.optim.Muon`` (its arguments, defaults, refusals, state-dict keys and update) in the fused step, with
    AdamW for the parameters Muon is not for: a param group with ``use_muon=False`` is stepped by AdamW (its
    ``lr``, ``betas``, ``eps``, ``weight_decay``; torch.optim.AdamW's defaults for what it does not give), so one
    optimizer holds the whole model, as ``MuonWithAuxAdam`` does. The gradients' inf/NaN check and skip,
    ``max_grad_norm`` clipping by the global norm over every group, ``ampfused.GradScaler``, ``grad_divisor`` and
    the spike guards as the other fused optimizers, and no host read.

    The update (:func:`ampfused.ops.reference_muon.muon_step_`): ``m = lerp(m, g, 1 - momentum)``, Nesterov's
    ``lerp(g, m, momentum)``, the Newton-Schulz iteration in bf16 (one batched chain per shape of matrix),
    ``w = w (1 - lr wd) - lr ratio O`` with torch's ``adjust_lr_fn`` ratio. ``expert_stacks=True`` takes
    parameters of more than two dimensions as stacks of matrices over their last two (each orthogonalised on its
    own); torch refuses them, and so does this by default.

    ``master_weights=None`` keeps fp32 masters for fp16/bf16 parameters; ``store_param_remainders`` and
    ``bf16_stochastic_round`` as in :class:`ampfused.FusedAdam`; ``momentum_dtype`` (``torch.bfloat16`` or
    ``torch.uint8``) stores every group's moments (AdamW's too) in that precision.
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(M.NS_A, M.NS_B, M.NS_C), eps=M.EPS, ns_steps=M.NS_STEPS,
                 adjust_lr_fn: Optional[str] = None, *, max_grad_norm: Optional[float] = None,
                 master_weights: Optional[bool] = None, backend: Optional[str] = None, spike_guard=None,
                 track_nonfinite: bool = False, module=None, health: bool = False,
                 store_param_remainders: bool = False,
                 bf16_stochastic_round: bool = False, momentum_dtype: torch.dtype = torch.float32, seed: int = 0,
                 expert_stacks: bool = False):
        self.expert_stacks = bool(expert_stacks)
        if momentum_dtype == torch.uint8:
            warnings.warn(Q8_MOMENTUM_WARNING, UserWarning, stacklevel=2)
        groups = [with_adamw_defaults(g) for g in P.normalise_groups(params)]
        self._precision = _precision.make(type(self).__name__, master_weights, store_param_remainders,
                                          bf16_stochastic_round, {"momentum_dtype": momentum_dtype}, seed)
        defaults = self.muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                                      adjust_lr_fn)
        self._check_shapes(groups)
        super().__init__(groups, defaults, max_grad_norm=max_grad_norm, master_weights=master_weights,
                         backend=backend, spike_guard=spike_guard, track_nonfinite=track_nonfinite, module=module,
                         health=health)

    def add_param_group(self, param_group: dict) -> None:
        group = with_adamw_defaults(P.normalise_group(param_group))
        if hasattr(self, "defaults"):  # (construction checked every group already)
            self._check_shapes([group], len(self.param_groups))
        super().add_param_group(group)

