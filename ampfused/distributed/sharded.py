"""ZeRO-1: fused optimizers whose fp32 masters and moments are split over the ranks of a process group.

The model stays replicated (bf16/fp16/fp32 parameters on every rank, with or without DDP); each rank keeps the
optimizer state of ``1/world`` of the parameter elements (see :mod:`._layout`). One step:

1. the gradients are copied into one buffer per dtype and reduce-scattered (sum) into this rank's shard
   (``grad_reduction="mean"`` or ``"sum"``; with ``None`` they were reduced already, e.g. by DDP, and each rank
   reads its shard of them where they are);
2. K1 (``norm_check``) on the shard: partial sums of squares and non-finite flags;
3. one all-reduce (sum) of ``[sum of squares, flags(, loss)]``: the global norm, one overflow decision and the
   mean loss for the spike guard, the same bits on every rank;
4. K2 on the shard's pieces with the partials ``[[norm^2], [found_inf]]`` (the step op's contract), writing the
   updated pieces of the parameters in place;
5. one all-gather (per dtype) of the updated parameter shards, copied back into the parameters.

Nothing is read to the host. Overflow and spike skips are decided from the all-reduced values, so every rank
skips together; the all-gather makes the parameters bitwise identical on every rank.

The state-precision options of the fused optimizers (``store_param_remainders``, ``bf16_stochastic_round``, the
moments' dtypes, ``seed``; ``docs/state-precision.md``) apply to each rank's shard of the state as they apply to a
segment's state (see :mod:`._layout` for the stochastic rounding's draws, and for 8-bit moments, whose shards
hold whole blocks of each parameter).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .. import ops
from ..guard import SpikeGuard
from ..ops.checks import same_layout
from ..optim import _params as P
from ..optim._base import FusedOptimizer, _append_flag, _on
from ..optim._precision import Precision
from ..optim._segment import LOW_PRECISION, _keep_or_rebuild, layout_of
from ..optim._state import ParamState, run_load_pre_hooks, state_dict_with_hooks
from . import _comm as C
from ._layout import Space, build_spaces, master_key, state_dtypes
from ._sharded_state import export_sharded, import_sharded

_REDUCTIONS = ("mean", "sum", None)


def check_params(groups: List[dict], master_weights, check=None) -> torch.device:
    """The rules of a ZeRO-1 optimizer's parameters (each a dense tensor given once, all on one device, and fp32
    masters for low-precision ones unless ``master_weights`` is None or True; ``check(gi, k, p)`` the optimizer's
    own), before any state exists; returns their device (the CPU when there are none)."""
    seen, devices = set(), set()
    for gi, g in enumerate(groups):
        for k, p in enumerate(g["params"]):
            P.check_param(gi, k, p)
            p = p[1] if isinstance(p, tuple) else p
            if check is not None:
                check(gi, k, p)
            if id(p) in seen:
                raise ValueError(f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}) appears more than "
                                 "once in the parameters; each parameter may be given once")
            seen.add(id(p))
            devices.add(p.device)
            if master_weights is False and p.dtype in LOW_PRECISION:
                raise ValueError(f"master_weights=False with a {p.dtype} parameter of shape {tuple(p.shape)}: "
                                 "low-precision parameters need fp32 master weights")
    if len(devices) > 1:
        raise ValueError(f"a sharded fused optimizer's parameters must all be on one device, got "
                         f"{', '.join(sorted(map(str, devices)))}")
    return devices.pop() if devices else torch.device("cpu")


def unscale_all_ranks(params, inv_scale: Tensor, grad_divisor, device, backend, group) -> Tensor:
    """A ZeRO-1 optimizer's ``_ampfused_unscale_`` (for ``GradScaler.unscale_``): this rank's gradients of
    ``params`` unscaled in place, and the overflow flag of all ranks (all-reduced on the device; a rank without
    gradients joins with 0)."""
    FusedOptimizer._check_divisor(grad_divisor)
    inv_scale = FusedOptimizer._divide(_on(inv_scale, device), grad_divisor)
    grads = [p.grad for p in params if p.grad is not None]
    flag = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        dtypes = tuple(sorted({str(g.dtype) for g in grads}))
        flag = ops.call_k1("unscale_", grads, inv_scale, dtypes, backend)[1].sum()
    return (C.all_reduce_sum_(flag.reshape(1), group) > 0).float().reshape(())


class ShardedFusedOptimizer(torch.optim.Optimizer):
    """Base of the ZeRO-1 fused optimizers; subclasses name the state buffers and call the step op."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands over grad_scale / found_inf
    _ampfused_fused = True  # ampfused.GradScaler unscales through _ampfused_unscale_
    state_names: tuple = ()
    # shard boundaries and parameter starts at multiples of this many elements (see ._layout); a block-wise state
    # format sets its block size here (8-bit moments align their dtype's space to lcm(shard_align, QBLOCK))
    shard_align: int = 1

    def __init__(self, params, defaults: dict, *, process_group=None, grad_reduction: Optional[str] = "mean",
                 max_grad_norm: Optional[float] = None, master_weights: Optional[bool] = None,
                 backend: Optional[str] = None, spike_guard: Optional[SpikeGuard] = None,
                 precision: Optional[Precision] = None):
        if grad_reduction not in _REDUCTIONS:
            raise ValueError(f"grad_reduction must be 'mean', 'sum' or None (gradients already reduced, e.g. by "
                             f"DDP), got {grad_reduction!r}")
        group, rank, world = C.check_group(process_group, type(self).__name__)
        if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
            raise TypeError(f"spike_guard must be an ampfused.SpikeGuard, got {type(spike_guard).__name__}")
        if master_weights not in (None, True, False):
            raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")
        if backend is not None:
            ops.registry.get_backend(backend)
        P.check_max_grad_norm(max_grad_norm)
        groups = P.normalise_groups(params)
        defaults = dict(defaults, max_grad_norm=max_grad_norm)
        self._validate_group(defaults, "")
        device = check_params(groups, master_weights)
        for gi, g in enumerate(groups):
            merged = dict(defaults, **{k: v for k, v in g.items() if k != "params"})
            self._validate_group(merged, f" in param_groups[{gi}]")
            P.check_lr(merged["lr"], f" in param_groups[{gi}]")
        self.process_group, self.rank, self.world_size = group, rank, world
        self.grad_reduction = grad_reduction
        self.master_weights = master_weights
        self.backend = backend
        self.spike_guard = spike_guard
        self._precision = precision or Precision()
        self._keep_remainders = False  # set by a load: the next follow keeps the loaded remainders
        self._spaces: Optional[List[Space]] = None
        super().__init__(groups, defaults)
        f32 = dict(dtype=torch.float32, device=device)
        self._device = device
        self._stats = torch.zeros(2, **f32)  # [global norm, skipped] of the last step
        self._overflow = torch.zeros((), **f32)
        self._one = torch.ones((), **f32)
        if spike_guard is not None:
            spike_guard.to_(device)

    # --- groups and hyperparameters ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_spaces", None) is not None:
            raise RuntimeError(f"{type(self).__name__}.add_param_group after the first step (or state_dict / "
                               "load_state_dict): the shards are laid out over every group then; give all groups "
                               "to the constructor")
        super().add_param_group(P.normalise_group(param_group))

    def _validate_group(self, group: dict, where: str) -> None:
        P.check_step_lr(group["lr"], where)
        P.check_max_grad_norm(group.get("max_grad_norm"), where)

    def _use_master(self, dtype: torch.dtype) -> bool:
        return self.master_weights if self.master_weights is not None else dtype in LOW_PRECISION

    def _lr_tensor(self, seg) -> Tensor:
        lr = self.param_groups[seg.group_index]["lr"]
        if isinstance(lr, Tensor):
            if lr.device == seg.lr.device and lr.dtype == torch.float32 and lr.dim() == 0:
                return lr
            seg.lr.copy_(lr.reshape(()))
        elif lr != seg.lr_value:
            seg.lr.fill_(lr)
            seg.lr_value = lr
        return seg.lr

    # --- layout and following the parameters ---------------------------------------------------------------
    def _ensure_layout(self) -> List[Space]:
        if self._spaces is None:
            self._spaces = build_spaces(self.param_groups, self.world_size, self.rank, self._use_master,
                                        [self._state_names_for(g) for g in self.param_groups], self._precision,
                                        self.shard_align)
            self._layouts = [[layout_of(p) for p in s.params] for s in self._spaces]
            self._remember()
        return self._spaces

    def _remember(self) -> None:
        self._versions = [[p._version for p in s.params] for s in self._spaces]
        self._keep_remainders = False

    def _forget(self) -> None:
        self._versions = [[-1] * len(s.params) for s in self._spaces]

    def _follow(self) -> None:
        """Refuse parameters that changed dtype, device, shape or strides (the shards cannot follow them); for
        parameters written since the last step (a checkpoint loaded into the model, ``p.copy_``), keep each
        owned master piece where it still rounds to the parameter, else rebuild it from the values. Remainders
        are reset (the master is then the weight's value), except right after ``load_state_dict``: loaded
        remainders belong with the checkpoint's weights."""
        flat = [p for g in self.param_groups for p in g["params"]]
        mine = [p for s in self._spaces for p in s.params]
        if len(flat) != len(mine) or {id(p) for p in flat} != {id(p) for p in mine}:
            raise RuntimeError(f"the parameters of {type(self).__name__}'s param groups changed since its shards "
                               "were laid out; build a new optimizer for the new parameters")
        for s, layouts, vers in zip(self._spaces, self._layouts, self._versions):
            for j, p in enumerate(s.params):
                if layout_of(p) != layouts[j]:
                    raise RuntimeError(f"a parameter of shape {layouts[j][2]} ({layouts[j][0]} on {layouts[j][1]}) "
                                       f"is now {p.dtype} on {p.device} with shape {tuple(p.shape)} and strides "
                                       f"{p.stride()}: {type(self).__name__} does not follow moves or casts; move or "
                                       "cast the model before building the optimizer")
            changed = {j for j, p in enumerate(s.params) if p._version != vers[j]}
            if not changed:
                continue
            for seg in s.segments:
                if seg.master is None:
                    continue
                remainders = seg.master.dtype == torch.int16
                if remainders and self._keep_remainders:
                    continue
                for k, j in enumerate(seg.index):
                    if j in changed:
                        m = seg.piece(seg.master, k)
                        if remainders:
                            m.zero_()
                        else:
                            m.copy_(_keep_or_rebuild(m, seg.param_piece(k)))
        self._remember()

    # --- gradients -------------------------------------------------------------------------------------------
    def _grad(self, s: Space, j: int) -> Optional[Tensor]:
        """Parameter ``j``'s gradient in its parameter's memory order, checked."""
        p, g = s.params[j], s.params[j].grad
        if g is None:
            return None
        if g.dtype != p.dtype or g.layout != torch.strided or g.device != p.device:
            raise RuntimeError(f"a {p.dtype} parameter of shape {tuple(p.shape)} on {p.device} has a gradient that is "
                               f"{g.dtype} ({g.layout}) on {g.device}; sharded fused optimizers take dense gradients of "
                               "their parameter's dtype and device")
        if not same_layout(p, g):
            g = torch.empty_like(p).copy_(g)
        return ops.memory_view(g)

    def _reduce_grads(self, s: Space) -> List[Optional[Tensor]]:
        """Gradients into ``s.comm`` (zeros where there is none), reduce-scattered into ``s.grad_shard``; returns
        the gradient of each owned piece (``None`` where this rank's parameter has none)."""
        grads = [self._grad(s, j) for j in range(len(s.params))]
        dst = [s.region(s.comm, j) for j, g in enumerate(grads) if g is not None]
        if dst:
            torch._foreach_copy_(dst, [g for g in grads if g is not None])
        empty = [s.region(s.comm, j) for j, g in enumerate(grads) if g is None and s.params[j].numel()]
        if empty:
            torch._foreach_zero_(empty)
        C.reduce_scatter_sum(s.grad_shard, s.comm, self.process_group)
        return grads

    def _piece_grads(self, s: Space, grads: List[Optional[Tensor]]) -> List[List[Optional[Tensor]]]:
        out = []
        for seg in s.segments:
            if self.grad_reduction is None:
                out.append([None if grads[j] is None else grads[j][a:a + n]
                            for j, a, n in zip(seg.index, seg.starts, seg.lengths)])
            else:
                out.append([None if grads[j] is None else seg.shard_piece(s.grad_shard, k)
                            for k, j in enumerate(seg.index)])
        return out

    # --- the step --------------------------------------------------------------------------------------------
    def _inv_scale(self, grad_divisor) -> Tensor:
        grad_scale = _on(getattr(self, "grad_scale", None), self._device)
        inv_scale = grad_scale.double().reciprocal().float() if grad_scale is not None else self._one
        inv_scale = FusedOptimizer._divide(inv_scale, grad_divisor)
        return inv_scale / self.world_size if self.grad_reduction == "mean" else inv_scale

    @torch.no_grad()
    def step(self, closure=None, *, grad_divisor=None, loss: Optional[Tensor] = None):
        """One sharded step; every rank of the group must call it (it communicates). ``grad_divisor`` and
        ``loss`` as for :meth:`ampfused.FusedAdamW.step`; the loss the spike guard sees is the mean over ranks
        (give it on every rank or on none)."""
        FusedOptimizer._check_divisor(grad_divisor)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        spaces = self._ensure_layout()
        self._follow()
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, f" in param_groups[{gi}]")
        inv_scale = self._inv_scale(grad_divisor)
        found_inf = _on(getattr(self, "found_inf", None), self._device)

        per_space, k1 = [], []
        for s in spaces:
            grads = self._reduce_grads(s) if self.grad_reduction is not None else \
                [self._grad(s, j) for j in range(len(s.params))]
            pieces = self._piece_grads(s, grads)
            per_space.append(pieces)
            if self.grad_reduction is not None:
                k1.append(s.grad_shard)
            else:
                k1 += [g for seg_grads in pieces for g in seg_grads if g is not None]
        if k1:
            dtypes = tuple(sorted({str(g.dtype) for g in k1}))
            partials = ops.call_k1("norm_check", k1, inv_scale, dtypes, self.backend)
            summed = [partials[0].sum(), partials[1].sum()]
        else:  # this rank owns nothing with a gradient: it still joins the all-reduce
            summed = [self._one * 0, self._one * 0]
        has_loss = isinstance(loss, Tensor) and self.spike_guard is not None
        if has_loss:
            summed.append(loss.detach().to(self._device, torch.float32).reshape(()))
        reduced = C.all_reduce_sum_(torch.stack(summed), self.process_group)
        flag = reduced[1] if found_inf is None else reduced[1] + found_inf.float()
        overflow = (flag > 0).float()
        partials = torch.stack([reduced[0], overflow]).reshape(2, 1)
        norm = reduced[0].sqrt()
        self._overflow.copy_(overflow)
        skip, lr_mult, guard = overflow, None, self.spike_guard
        if guard is not None:
            mean_loss = reduced[2] / self.world_size if has_loss else None
            spike = guard.check(norm, mean_loss)
            if guard.action == "skip":
                partials = _append_flag(partials, spike.float())
                skip = torch.maximum(overflow, spike.float())
            else:
                lr_mult = torch.where(spike, guard.lr_factor, 1.0).float()
        self._stats.copy_(torch.stack([norm, skip]))

        for s, pieces in zip(spaces, per_space):
            for si, (seg, grads) in enumerate(zip(s.segments, pieces)):
                if all(g is None for g in grads):
                    continue
                group = self.param_groups[seg.group_index]
                needed = self._state_names_for(group)
                if any(name not in seg.states for name in needed):  # e.g. SGD's momentum, switched on later
                    s.segments[si] = seg = seg.with_states(needed)
                    self._bind_state([s.params[j] for j in seg.index if s.params[j] in self.state])
                max_norm = group["max_grad_norm"]
                lr = self._lr_tensor(seg)
                self._update(seg, [seg.param_piece(k) for k in range(len(seg))], grads, group, partials, inv_scale,
                             lr if lr_mult is None else lr * lr_mult, math.inf if max_norm is None else float(max_norm))
                for k, g in enumerate(grads):
                    if g is not None:
                        seg.has_state[k] = True
            self._gather_params(s)
        self._bind_state([p for s in spaces for p in s.params if p.grad is not None and p not in self.state])
        if guard is not None:
            guard.record_(norm, mean_loss, spike, overflow > 0)
        self._remember()
        return loss

    def _bind_state(self, params) -> None:
        """``state[p]`` for each of ``params``: this rank's piece of each of its state buffers (flat views in the
        buffers' dtypes, empty where this rank owns none of ``p``; 8-bit moments: codes and ``<name>_scale``, the
        scales of the piece's blocks). Every rank holds an entry for every parameter
        that has state, so code that asks whether the optimizer has state (torch.distributed.checkpoint's
        get_optimizer_state_dict does) gets the same answer on every rank. The whole state: :meth:`state_dict`."""
        where = {}
        group_of = {id(p): gi for gi, g in reversed(list(enumerate(self.param_groups))) for p in g["params"]}
        for s in self._spaces or ():
            for seg in s.segments:
                for k, j in enumerate(seg.index):
                    where[id(s.params[j])] = (seg, k)
        for p in params:
            seg_k = where.get(id(p))
            if seg_k is None:
                master, moments = state_dtypes(self._precision, p.dtype, self._use_master(p.dtype))
                names = self._state_names_for(self.param_groups[group_of[id(p)]])
                values = {name: torch.empty(0, dtype=moments, device=self._device) for name in names}
                if moments == torch.uint8:
                    values.update({f"{name}_scale": torch.empty(0, dtype=torch.float32, device=self._device)
                                   for name in names})
                if master is not None:
                    values[master_key(master)] = torch.empty(0, dtype=master, device=self._device)
            else:
                seg, k = seg_k
                values = {name: seg.piece(flat, k) for name, flat in seg.states.items()}
                if seg.scales is not None:  # 8-bit moments: the piece's block scales beside its codes
                    values.update({f"{name}_scale": seg.scale_view(name, k) for name in seg.states})
                if seg.master is not None:
                    values[master_key(seg.master.dtype)] = seg.piece(seg.master, k)
            st = ParamState()
            st._bind(values)
            dict.__setitem__(self.state, p, st)

    def _gather_params(self, s: Space) -> None:
        """Every rank's updated pieces into every rank's parameters (one all-gather per dtype)."""
        src = [seg.param_piece(k) for seg in s.segments for k in range(len(seg))]
        if src:
            torch._foreach_copy_([seg.shard_piece(s.param_shard, k) for seg in s.segments for k in range(len(seg))],
                                 src)
        C.all_gather(s.comm, s.param_shard, self.process_group)
        live = [j for j, p in enumerate(s.params) if p.numel()]
        torch._foreach_copy_([ops.memory_view(s.params[j]) for j in live], [s.region(s.comm, j) for j in live])

    def _update(self, seg, params, grads, group, partials, inv_scale, lr, max_norm) -> None:
        """K2 over this rank's pieces of one segment; ``_step_op`` is the subclass's op (AdamMath, SgdMath)."""
        self._step_op(seg, params, grads, group, partials, inv_scale, lr, max_norm,
                      self._backend_name(seg, params, grads))

    def _backend_name(self, seg, params, grads) -> str:
        return ops.step_backend(self._device, ops._step_dtypes(params, grads, seg.master), self.backend,
                                self._op_for(self.param_groups[seg.group_index]))

    # --- what the fused optimizers report ---------------------------------------------------------------------
    @property
    def last_grad_norm(self) -> Tensor:
        """0-d fp32: the global norm (all ranks) of the unscaled gradients of the last step, before clipping."""
        return self._stats[0]

    @property
    def last_found_inf(self) -> Tensor:
        """0-d fp32: 1.0 if the last step's gradients held inf/NaN on any rank."""
        return self._overflow

    @property
    def last_step_skipped(self) -> Tensor:
        """0-d bool: whether the last step changed nothing (on every rank alike)."""
        return self._stats[1] > 0

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (masters or their remainders, moments, step counts, in their
        storage precision): about ``1/world_size`` of what the unsharded optimizer holds."""
        return sum(seg.state_bytes() for s in self._ensure_layout() for seg in s.segments)

    def _ampfused_device(self) -> torch.device:
        return self._device

    @torch.no_grad()
    def _ampfused_unscale_(self, inv_scale: Tensor, grad_divisor=None) -> Tensor:
        """For ``GradScaler.unscale_``: unscale this rank's gradients in place and return the overflow flag of
        all ranks (all-reduced; a rank without gradients joins with 0)."""
        params = [p for s in self._ensure_layout() for p in s.params]
        return unscale_all_ranks(params, inv_scale, grad_divisor, self._device, self.backend, self.process_group)

    # --- state dicts -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole optimizer state in torch.optim's layout (as :class:`ampfused.FusedAdamW` saves it), gathered
        from every rank: a collective, to call on every rank. It loads into any world size, into the unsharded
        fused optimizers and into torch's."""
        def export(opt):
            opt._ensure_layout()
            return export_sharded(opt)
        return state_dict_with_hooks(self, export)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state dict (from :meth:`state_dict` at any world size, an unsharded fused optimizer or
        torch's); each rank keeps its shard. Checked in full before anything changes; no communication."""
        state_dict = run_load_pre_hooks(self, state_dict)
        self._ensure_layout()
        import_sharded(self, state_dict)
        self.state.clear()
        self._bind_state([p for g, saved in zip(self.param_groups, state_dict["param_groups"])
                          for sid, p in zip(saved["params"], g["params"]) if state_dict["state"].get(sid)])
        self._forget()  # the next step compares every master piece with its parameter's values
        self._keep_remainders = True  # (remainders: loaded with the weights they complete)
        if self.spike_guard is not None:
            self.spike_guard.load_state_dict(state_dict.get("spike_guard", {}), self._device)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _export_param_state(self, st: Dict[str, Tensor], step: float) -> dict:
        return dict(st, step=torch.tensor(step, dtype=torch.float32))

    def _import_step(self, saved: dict) -> float:
        step = saved["step"]
        return float(step.item() if isinstance(step, Tensor) else step)

    def _state_keys_for_load(self, saved: dict, group: Optional[dict] = None):
        return self.state_names

    def _state_names_for(self, group: dict) -> tuple:
        """The states a step of ``group`` reads: allocated by the first step that needs them."""
        return self.state_names
