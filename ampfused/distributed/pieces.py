"""ZeRO-1 over FSDP2's pieces: a fused optimizer that takes FSDP2's DTensors, stepping each rank's piece of every
parameter of a replicated model.

The model stays replicated (with or without DDP); each rank keeps the optimizer state of ``1/world`` of every
parameter: the rank's piece of its first dimension, as FSDP2's ``Shard(0)`` cuts it (``torch.chunk``; a 0-d
parameter as one element). The pieces are the local shards of DTensors over a one-dimensional mesh of the process
group, stepped by the fused optimizer's own FSDP2 path (``inner_class``), which does what a step over whole
parameters needs across the ranks (sums over whole parameters, whole matrices joined on one rank).
One step:

1. the gradients are copied into one buffer per dtype, laid out rank after rank (each rank's pieces of every
   parameter, padded to the first rank's), and reduce-scattered (sum) into this rank's pieces
   (``grad_reduction="mean"`` divides by the world size in the step's unscale coefficient, ``"sum"`` does not,
   ``None``: they were reduced already, e.g. by DDP, and each rank reads its pieces where they are);
2. the inner optimizer's step on the pieces: K1 and one all-reduce of the norm's partials, the step's own
   collectives, the update, nothing read to the host;
3. one all-gather per dtype of the updated pieces, copied into the parameters (the same bits on every rank).

Whatever changes a parameter between steps (a checkpoint loaded into the model, ``p.copy_``) is followed: the
rank's piece is copied from it before the next step, and the inner optimizer rebuilds its master from it as the
unsharded one does. ``state_dict()`` gathers the whole state in the unsharded optimizer's layout; ``load_state_dict``
takes such a state dict from any world size, from the unsharded fused optimizer or from torch's, and keeps this
rank's pieces.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..optim import _params as P
from ..optim._factored_state import _contiguous_strides
from ..optim._base import FusedOptimizer
from ..optim._state import run_load_pre_hooks, state_dict_with_hooks
from ..optim._segment import is_dtensor
from . import _comm as C
from .sharded import check_params, unscale_all_ranks

REDUCTIONS = ("mean", "sum", None)


def _pieces(t: Tensor, world: int) -> List[Tensor]:
    """Every rank's piece of ``t``'s first dimension (``torch.chunk``'s, empty past the last; 0-d as 1-element)."""
    t = t.reshape(1) if t.dim() == 0 else t
    parts = list(torch.chunk(t, world, dim=0))
    while len(parts) < world:
        parts.append(t.narrow(0, t.shape[0], 0))
    return parts


class _Space:
    """The parameters of one dtype: where each rank's piece of each lies in the communication buffers."""

    def __init__(self, params: List[Tensor], world: int):
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += _pieces(p, world)[0].numel()  # the first rank's piece is the largest
        self.region = max(1, total)
        dtype, device = params[0].dtype, params[0].device
        self.comm = torch.zeros(world * self.region, dtype=dtype, device=device)
        self.shard = torch.zeros(self.region, dtype=dtype, device=device)

    def slot(self, buf: Tensor, r: int, j: int, piece: Tensor) -> Tensor:
        """Parameter ``j``'s piece of rank ``r`` in a whole buffer (``r`` None: in a one-region buffer)."""
        base = (0 if r is None else r * self.region) + self.offsets[j]
        return buf[base:base + piece.numel()].view(piece.shape)


class PieceShardedOptimizer(torch.optim.Optimizer):
    """Base of the ZeRO-1 optimizers over FSDP2's pieces: ``inner_class`` (a fused optimizer that takes FSDP2's
    DTensors) steps the pieces. Subclasses give the arguments; every rank must call :meth:`step`,
    :meth:`state_dict` and :meth:`ampfused.GradScaler.unscale_` (they communicate)."""

    _step_supports_amp_scaling = True
    _ampfused_fused = True
    inner_class: type = FusedOptimizer

    def __init__(self, groups: List[dict], defaults: dict, inner_kwargs: dict, *, process_group=None,
                 grad_reduction: Optional[str] = "mean", master_weights: Optional[bool] = None,
                 check: Optional[Callable] = None):
        """``groups``: normalised param groups; ``inner_kwargs``: the inner optimizer's arguments but its groups;
        ``check(gi, k, p)``: the optimizer's own rules of a parameter."""
        if grad_reduction not in REDUCTIONS:
            raise ValueError(f"grad_reduction must be 'mean', 'sum' or None (gradients already reduced, e.g. by "
                             f"DDP), got {grad_reduction!r}")
        group, rank, world = C.check_group(process_group, type(self).__name__)
        P.check_max_grad_norm(inner_kwargs.get("max_grad_norm"))
        name = type(self).__name__
        inner_name = self.inner_class.__name__

        def checked(gi, k, p):
            if is_dtensor(p):
                raise ValueError(f"param_groups[{gi}]['params'][{k}] (shape {tuple(p.shape)}) is a DTensor: "
                                 f"{name} shards replicated parameters (ZeRO-1); give FSDP2's "
                                 f"parameters to ampfused.{inner_name} instead")
            if check is not None:
                check(gi, k, p)

        device = check_params(groups, master_weights, checked)
        super().__init__(groups, defaults)
        self.process_group, self.rank, self.world_size = group, rank, world
        self.grad_reduction = grad_reduction
        self._device = device
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        self._mesh = DeviceMesh.from_group(group or torch.distributed.group.WORLD, self._device.type)
        self._shards: Dict[int, torch.nn.Parameter] = {}  # id(parameter) -> its DTensor of pieces
        inner_groups = []
        for g in self.param_groups:
            shards = []
            for p in g["params"]:
                whole = p.detach().reshape(1) if p.dim() == 0 else p.detach()
                local = _pieces(whole, world)[rank].clone()
                dt = DTensor.from_local(local, self._mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                        stride=_contiguous_strides(whole.shape))
                self._shards[id(p)] = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
                shards.append(self._shards[id(p)])
            inner_groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=shards))
        self._inner = self.inner_class(inner_groups, master_weights=master_weights, **inner_kwargs)
        self.spike_guard = inner_kwargs.get("spike_guard")
        by_dtype: Dict[torch.dtype, List[Tensor]] = {}
        for g in self.param_groups:
            for p in g["params"]:
                by_dtype.setdefault(p.dtype, []).append(p)
        self._spaces = [_Space(ps, world) for ps in by_dtype.values()]
        self._versions: Dict[int, int] = {}
        self._remember()

    # --- following the parameters --------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_inner", None) is not None:
            raise RuntimeError(f"{type(self).__name__}.add_param_group after construction: the pieces are laid out "
                               "over every group then; give all groups to the constructor")
        super().add_param_group(P.normalise_group(param_group))

    def _params(self) -> List[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _remember(self) -> None:
        self._versions = {id(p): p._version for p in self._params()}

    @torch.no_grad()
    def _follow(self) -> None:
        """Hyperparameters from ``param_groups`` (schedulers change them there) into the inner optimizer's groups;
        the pieces of parameters written since the last step copied from them (the user's tensors win)."""
        if len(self._params()) != len(self._shards) or any(id(p) not in self._shards for p in self._params()):
            raise RuntimeError(f"the parameters of {type(self).__name__}'s param groups changed since it was built; "
                               "build a new optimizer for the new parameters")
        for g, ig in zip(self.param_groups, self._inner.param_groups):
            for k, v in g.items():
                if k != "params":
                    ig[k] = v
        for p in self._params():
            if p._version != self._versions.get(id(p)):
                shard = self._shards[id(p)]
                piece = _pieces(p.detach(), self.world_size)[self.rank]
                if piece.shape != shard._local_tensor.shape or p.dtype != shard.dtype:
                    raise RuntimeError(f"a parameter of shape {tuple(shard.shape)} is now {p.dtype} with shape "
                                       f"{tuple(p.shape)}: {type(self).__name__} does not follow casts or reshapes")
                shard.copy_(type(shard).from_local(piece, shard.device_mesh, shard.placements, run_check=False,
                                                   shape=shard.shape, stride=shard.stride()))

    # --- the step --------------------------------------------------------------------------------------------
    def _grads_to_pieces(self) -> None:
        """Each parameter's gradient (reduce-scattered, or as it is with ``grad_reduction=None``) as its
        DTensor's gradient: this rank's piece."""
        for s in self._spaces:
            grads = [p.grad for p in s.params]
            for p, g in zip(s.params, grads):
                if g is not None and (g.dtype != p.dtype or g.layout != torch.strided or g.shape != p.shape):
                    raise RuntimeError(f"a {p.dtype} parameter of shape {tuple(p.shape)} has a gradient that is "
                                       f"{g.dtype} ({g.layout}) of shape {tuple(g.shape)}; sharded fused optimizers "
                                       "take dense gradients of their parameter's dtype and shape")
            if self.grad_reduction is not None and any(g is not None for g in grads):
                dst, src, empty = [], [], []
                for j, (p, g) in enumerate(zip(s.params, grads)):
                    for r, piece in enumerate(_pieces(g if g is not None else p.detach(), self.world_size)):
                        if piece.numel():
                            (dst if g is not None else empty).append(s.slot(s.comm, r, j, piece))
                            if g is not None:
                                src.append(piece)
                if dst:
                    torch._foreach_copy_(dst, src)
                if empty:
                    torch._foreach_zero_(empty)
                C.reduce_scatter_sum(s.shard, s.comm, self.process_group)
            for j, (p, g) in enumerate(zip(s.params, grads)):
                shard = self._shards[id(p)]
                if g is None:
                    shard.grad = None
                    continue
                local = shard._local_tensor
                # a view where it can be (the piece laid out as the shard's local tensor): the reduced buffer, or
                # the gradient, holds it until the step has read it
                piece = s.slot(s.shard, None, j, local) if self.grad_reduction is not None else \
                    _pieces(g, self.world_size)[self.rank]
                shard.grad = type(shard).from_local(piece.contiguous(), shard.device_mesh, shard.placements,
                                                    run_check=False, shape=shard.shape, stride=shard.stride())

    @torch.no_grad()
    def _gather(self) -> None:
        """Every rank's updated pieces into every rank's parameters (one all-gather per dtype)."""
        for s in self._spaces:
            locals_ = [self._shards[id(p)]._local_tensor for p in s.params]
            torch._foreach_copy_([s.slot(s.shard, None, j, x) for j, x in enumerate(locals_)], locals_)
            C.all_gather(s.comm, s.shard, self.process_group)
            dst, src = [], []
            for j, p in enumerate(s.params):
                whole = p.detach().reshape(1) if p.dim() == 0 else p.detach()
                for r, piece in enumerate(_pieces(whole, self.world_size)):
                    if piece.numel():
                        dst.append(piece)
                        src.append(s.slot(s.comm, r, j, piece))
            if dst:
                torch._foreach_copy_(dst, src)

    @torch.no_grad()
    def step(self, closure=None, *, grad_divisor=None, loss: Optional[Tensor] = None):
        """One sharded step; every rank of the group must call it. ``grad_divisor`` and ``loss`` as for the
        unsharded optimizer's ``step`` (the spike guard sees each rank's own ``loss``: give the same one, e.g.
        all-reduced, on every rank)."""
        FusedOptimizer._check_divisor(grad_divisor)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow()
        self._grads_to_pieces()
        divisor = grad_divisor
        if self.grad_reduction == "mean":
            divisor = self.world_size if divisor is None else divisor * self.world_size
        for name in ("grad_scale", "found_inf", "_ampfused_inv_scale"):
            if hasattr(self, name):
                setattr(self._inner, name, getattr(self, name))
        try:
            self._inner.step(grad_divisor=divisor, loss=loss)
        finally:
            for name in ("grad_scale", "found_inf", "_ampfused_inv_scale"):
                if name in self._inner.__dict__:
                    delattr(self._inner, name)
            for shard in self._shards.values():
                shard.grad = None
        self._gather()
        self._bind_state()
        self._remember()
        return loss

    def _bind_state(self) -> None:
        """``state[p]``: the inner optimizer's entry of ``p``'s pieces (DTensors), so code that asks whether the
        optimizer has state (torch.distributed.checkpoint's get_optimizer_state_dict does) finds it; the whole
        state: :meth:`state_dict`."""
        for p in self._params():
            st = self._inner.state.get(self._shards[id(p)])
            if st:
                dict.__setitem__(self.state, p, st)

    @torch.no_grad()
    def _ampfused_unscale_(self, inv_scale: Tensor, grad_divisor=None) -> Tensor:
        """For ``GradScaler.unscale_``: this rank's gradients unscaled in place, the overflow flag of all ranks."""
        return unscale_all_ranks(self._params(), inv_scale, grad_divisor, self._device, self._inner.backend,
                                 self.process_group)

    def _ampfused_device(self) -> torch.device:
        return self._device

    @property
    def last_grad_norm(self) -> Tensor:
        return self._inner.last_grad_norm

    @property
    def last_found_inf(self) -> Tensor:
        return self._inner.last_found_inf

    @property
    def last_step_skipped(self) -> Tensor:
        return self._inner.last_step_skipped

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its pieces' masters or remainders, moments or factors, step
        counts)."""
        flats = [t for seg in self._inner._segs.segments
                 for t in (seg.master, *seg.states.values(), seg.scales, seg.steps) if t is not None]
        return sum(t.numel() * t.element_size() for t in flats)

    def _placement(self, shard, key: str) -> Tuple[tuple, tuple]:
        """``(placements, whole shape)`` of state ``key`` of the parameter whose pieces are ``shard``: the
        parameter's own (an elementwise state); a subclass names its others."""
        return shard.placements, tuple(shard.shape)

    # --- state dicts -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict:
        """The whole state in the unsharded fused optimizer's layout (torch's keys), gathered from every rank: a
        collective. It loads into any world size, into the unsharded optimizer and into torch's. torch's state
        dict hooks run as for any optimizer."""
        return state_dict_with_hooks(self, PieceShardedOptimizer._export)

    def _export(self) -> dict:
        inner, params = self._inner.state_dict(), self._params()
        state = {}
        for sid, entry in inner["state"].items():
            if not isinstance(sid, int):  # (what a hook or the user keeps beside the parameters' state)
                state[sid] = entry
                continue
            p, out = params[sid], {}
            for key, v in entry.items():
                if is_dtensor(v):
                    elementwise = tuple(v.shape) == tuple(self._shards[id(p)].shape)
                    v = _full(v)
                    if p.dim() == 0 and elementwise:
                        v = v.reshape(())
                out[key] = v.clone() if isinstance(v, Tensor) else v
            state[sid] = out
        groups = [dict({k: v for k, v in g.items() if k != "params"}, params=list(saved["params"]))
                  for g, saved in zip(self.param_groups, inner["param_groups"])]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state dict (this optimizer's from any world size, the unsharded fused optimizer's or
        torch's): each rank keeps its pieces; checked in full before anything changes."""
        from torch.distributed.tensor import DTensor
        state_dict = run_load_pre_hooks(self, state_dict)
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (an optimizer's state_dict())")
        self._follow()
        params = self._params()
        saved_ids = [sid for g in state_dict["param_groups"] for sid in g["params"]]
        if len(saved_ids) != len(params):
            raise ValueError(f"loaded state dict has {len(saved_ids)} parameters, this optimizer has {len(params)}")
        state = {}
        for sid, p in zip(saved_ids, params):
            entry = state_dict["state"].get(sid)
            if not entry:
                continue
            shard = self._shards[id(p)]
            out = {}
            for key, v in entry.items():
                if not isinstance(v, Tensor) or key == "step":
                    out[key] = v
                    continue
                placements, full = self._placement(shard, key)
                v = _local(v)
                if v.numel() != math.prod(full):
                    raise ValueError(f"loaded state '{key}' of parameter {sid} must have shape {full}, got "
                                     f"{tuple(v.shape)}")
                v = v.reshape(full)
                local = _pieces(v, self.world_size)[self.rank] if placements[0].is_shard() else v
                out[key] = DTensor.from_local(local.contiguous(), self._mesh, placements, run_check=False, shape=full,
                                              stride=_contiguous_strides(full))
            state[sid] = out
        inner_sd = {"state": state, "param_groups": state_dict["param_groups"]}
        if "spike_guard" in state_dict:
            inner_sd["spike_guard"] = state_dict["spike_guard"]
        self._inner.load_state_dict(inner_sd)
        for g, ig in zip(self.param_groups, self._inner.param_groups):
            g.update({k: v for k, v in ig.items() if k != "params"})
        self.state.clear()
        self._bind_state()
        self._remember()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _local(v: Tensor) -> Tensor:
    return v.full_tensor() if is_dtensor(v) else v


def _full(v) -> Tensor:
    """A DTensor gathered whole on every rank (int16 remainders as bf16 bits: gloo has no int16)."""
    if v.dtype == torch.int16:
        from torch.distributed.tensor import DTensor
        bits = DTensor.from_local(v._local_tensor.view(torch.bfloat16), v.device_mesh, v.placements,
                                  run_check=False, shape=v.shape, stride=v.stride())
        return bits.full_tensor().view(torch.int16)
    return v.full_tensor()
