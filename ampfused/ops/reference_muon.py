"""Muon's step in plain torch: the specification of ``muon_step_`` (``torch.optim.Muon``'s math).

Conventions are :mod:`ampfused.ops.reference`'s (parameters and gradients where they live, flat state buffers laid
out by ``state_layout``, ``partials``, ``inv_scale``, ``lr`` and ``steps`` on the device, ``out_stats``, a skip
that writes nothing). The step has three parts, the shape a fused step keeps: an elementwise pass (the momentum,
Nesterov's interpolation and the input of the iteration), the Newton-Schulz iteration on torch's matmuls in bf16
(one batched chain per shape: :func:`orthogonalize`), and an elementwise pass (the decay, the update, the master
and the model's copy).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .reference import _tensors_to_update, lerp
from .reference_common import (STATE_ALIGN, _commit, _Compact, _prologue, check_health, from_logical_, memory_view,
                               moved, state_layout, to_logical)
from .state_precision import QBLOCK


NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315  # torch.optim.Muon's (Keller Jordan's) coefficients
NS_A_B_C = (NS_A, NS_B, NS_C)
EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

# the public function's documentation (ampfused.ops.muon_step_, made from its record in specs.py)
DOC = """Fused ``torch.optim.Muon`` step over parameters where they live (math:
    :func:`ampfused.ops.reference_muon.muon_step_`).

    params: T dense tensors of one dtype (any memory layout), each a matrix (or, with more dimensions, a stack of
    matrices over its last two), updated in place; grads: T entries (``None`` leaves a parameter alone), each with
    its parameter's shape and layout; master, momentum_buffer: flat buffers laid out by ``state_layout`` as
    :func:`adam_step_`'s (compact state as its: int16 master remainders, no master with a ``seed``, a bf16 or
    uint8 ``momentum_buffer`` with ``state_scales`` ``[1, blocks]``); steps ``[T]`` fp32; partials ``[2, P]``;
    inv_scale, lr 0-d fp32; out_stats ``[2]``; ``ns_coefficients=(a, b, c)`` as torch.optim.Muon takes them.
    """


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_hyper(momentum, weight_decay, adjust_lr_fn, ns_steps, eps, where: str = "") -> None:
    """torch.optim.Muon's rules of the hyperparameters the step reads (its messages; NaN and inf refused too), and
    those of the iteration torch checks only when it steps: the op's (:func:`check_rules`) and the optimizer's
    (``where`` names the group)."""
    if not _number(momentum) or not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}{where}")
    if not _number(weight_decay) or not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}{where}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 0:
        raise ValueError(f"ns_steps must be a non-negative int, got {ns_steps!r}{where}")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if not _number(eps) or not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}{where}")


def check_rules(params, hyper: dict) -> None:
    """``muon_step_``'s own input rules (torch.optim.Muon's, with its messages), after the rules every step
    shares."""
    for p in params:
        if p.is_complex():
            raise RuntimeError("Muon does not support complex parameters")
        if p.dim() < 2:
            raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}")
    check_hyper(hyper["momentum"], hyper["weight_decay"], hyper["adjust_lr_fn"], hyper["ns_steps"], hyper["eps"])


def lr_ratio(shape: Sequence[int], adjust_lr_fn: Optional[str]) -> float:
    """torch's ``_adjust_lr`` factor for a matrix of ``shape`` (the last two dimensions of a stack): ``"original"``
    (and None) ``sqrt(max(1, A / B))``, ``"match_rms_adamw"`` ``0.2 * sqrt(max(A, B))``."""
    a, b = int(shape[-2]), int(shape[-1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return 1.0


def ns_dtype(compute: torch.dtype) -> torch.dtype:
    """The iteration's dtype for a step computing in ``compute``: bf16 as torch runs it (fp64 for the oracle)."""
    return torch.float64 if compute == torch.float64 else torch.bfloat16


class MuonScratch:
    """What passes between Muon's two elementwise passes when the iteration runs elsewhere (FSDP2's shards: whole
    matrices gathered to the rank that orthogonalizes them): a flat ``buffer`` in the iteration's dtype, laid out
    as the state (``state_layout`` of the shards), into which phase 1 writes each parameter's iteration input and
    in whose place its orthogonalized update is written back (in memory order) for phase 2; ``ratios`` the lr
    factor of each parameter from its whole matrix's shape (:func:`lr_ratio`: a shard's own shape is not it).
    A phase is ``(phase, MuonScratch)`` on the step call (``StepCall.shard``)."""

    def __init__(self, shapes: Sequence[Sequence[int]], full_shapes: Sequence[Sequence[int]],
                 adjust_lr_fn: Optional[str], dtype: torch.dtype, device, align: int):
        self.shapes = [tuple(s) for s in shapes]
        self.offsets, total = state_layout([math.prod(s) for s in self.shapes], align)
        self.buffer = torch.zeros(max(1, total), dtype=dtype, device=device)
        self.ratios = [lr_ratio(s, adjust_lr_fn) for s in full_shapes]
        self.key = self.key_of(shapes, full_shapes, adjust_lr_fn, dtype, align)

    @staticmethod
    def key_of(shapes, full_shapes, adjust_lr_fn, dtype, align) -> tuple:
        """What a scratch is made from: one is kept while this is the same."""
        return (tuple(tuple(s) for s in shapes), tuple(tuple(s) for s in full_shapes), adjust_lr_fn, dtype, align)

    def piece(self, i: int) -> Tensor:
        """Parameter ``i``'s slice of the buffer (its elements in memory order)."""
        return self.buffer[self.offsets[i]:self.offsets[i] + math.prod(self.shapes[i])]

    @property
    def written(self) -> List[Tensor]:
        return [self.buffer]

    def ratios_on(self, device) -> Tensor:
        """``ratios`` as an fp64 tensor on ``device``, made once (on CUDA uploaded from pinned memory, without a
        host wait; the pinned copy lives with the scratch)."""
        ratios = getattr(self, "_ratios", None)
        if ratios is None or ratios.device != torch.device(device):
            host = torch.tensor(self.ratios, dtype=torch.float64)
            if torch.device(device).type == "cuda":
                self._host_ratios = host = host.pin_memory()
            ratios = self._ratios = host.to(device, non_blocking=True)
        return ratios

    def slots(self, device) -> dict:
        """What the native modules' passes read (``csrc/include/ampfused/step_pack.h``): the scratch's address and
        the fp64 ratios' (they form ``lr * ratio`` and ``1 - lr * weight_decay`` themselves, as :meth:`scalars`)."""
        if self.buffer.dtype != torch.bfloat16 or self.buffer.device != torch.device(device):
            raise ValueError(f"the native passes take a bf16 scratch on {device}, got {self.buffer.dtype} on "
                             f"{self.buffer.device}")
        return dict(scratch=self.buffer.data_ptr(), ratios=self.ratios_on(device).data_ptr())

    def scalars(self, lr: Tensor, weight_decay: float) -> Tuple[Optional[Tensor], Tensor]:
        """Phase 2's scalars on ``lr``'s device, formed in fp64 from the fp32 ``lr`` and rounded once to fp32 (the
        reference's): the decay ``1 - lr * weight_decay`` (None without decay), one ``lr * ratio`` per parameter."""
        lr64 = lr.double()
        decay = (1.0 - lr64 * weight_decay).float() if weight_decay != 0 else None
        return decay, (lr64 * self.ratios_on(lr.device)).float()


def orthogonalize(x: Tensor, a: float, b: float, c: float, steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """torch.optim.Muon's Newton-Schulz iteration over a stack of matrices ``x`` ``[k, m, n]`` in ``dtype`` (bf16
    as torch runs it; fp64 for the oracle), each matrix on its own: transposed when it has more rows than columns,
    divided by ``max(its Frobenius norm, eps)``, then ``steps`` times ``A = X X^T``, ``B = b A + c A A``,
    ``X = a X + B X`` (torch's ``addmm`` chain, batched)."""
    x = x.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


def muon_step_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
               momentum_buffer: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
               out_stats: Tensor, momentum: float, nesterov: bool, weight_decay: float, ns_a: float, ns_b: float,
               ns_c: float, eps: float, ns_steps: int, adjust_lr_fn: Optional[str], max_norm: float,
               seed: Optional[Tensor] = None, state_scales: Optional[Tensor] = None,
               health: Optional[Tensor] = None) -> None:
    """One ``torch.optim.Muon`` step over a list of matrices, without a host read.

    With ``c = inv_scale * min(1, max_norm / (norm + 1e-6))`` and, for each parameter ``i`` with a gradient,
    ``w`` its master (or itself) and ``m`` its ``momentum_buffer`` slice::

        g = c * grad                                  (in the compute dtype)
        m = lerp(m, g, 1 - momentum)
        u = lerp(g, m, momentum) if nesterov else m
        O = NS(u)                                     (orthogonalize: bf16, per matrix, batched by shape)
        w = w * fp32(1 - lr * weight_decay) - fp32(lr * ratio) * O      (ratio: lr_ratio of its shape)
        param = round(w);  steps[i] += 1

    ``lerp`` is :func:`ampfused.ops.reference.lerp` (torch's two forms, no fused multiply-add); the scalars are
    formed in fp64 from the fp32 ``lr`` and rounded once, as torch forms them from its Python floats. A parameter
    of more than two dimensions is a stack of matrices over its last two, each orthogonalized on its own (torch's
    Muon refuses them; :class:`ampfused.FusedMuon` takes them when asked). ``steps`` is not in the math: it keys
    the stochastic rounding (``t = steps[i] + 1``). Compact state as :func:`ampfused.ops.reference.adam_step_`
    with one moment (a bf16 or uint8 ``momentum_buffer``, signed codes, stream 1). ``health`` as
    :func:`ampfused.ops.reference.adam_step_` (the update ``w * (1 - lr * weight_decay) - lr * ratio * O``).
    """
    check_health(health, inv_scale)
    cx = _Compact(params, master, [("momentum_buffer", momentum_buffer)], seed, state_scales, health, inv_scale)
    cd = cx.cd
    coef, skip = _prologue(partials, inv_scale, max_norm, out_stats, cd)
    cx.start(skip)
    lr64 = lr.double()
    decay = (1.0 - lr64 * weight_decay).to(cd) if weight_decay != 0 else None
    # 1. the momentum and the iteration's input, in memory order; grouped by shape for the iteration
    by_shape: Dict[Tuple[int, ...], list] = {}
    for i, pm, gm, w_buf, sl in _tensors_to_update(params, grads, master, cx.align):
        cx.gradient(gm)
        m_buf = momentum_buffer[sl]
        g = gm.to(cd) * coef
        m_new = lerp(cx.load_state(m_buf, 0, sl), g, 1 - momentum)
        u = lerp(g, m_new, momentum) if nesterov else m_new
        t = steps[i].to(cd) + 1
        by_shape.setdefault(tuple(params[i].shape), []).append((i, pm, w_buf, sl, m_buf, m_new, u, t))
    nsd = ns_dtype(cd)
    for shape, work in by_shape.items():
        # 2. the iteration: the inputs in logical order, one batched chain of every matrix of this shape
        logical = []
        for i, *_, u, _t in work:
            x = torch.empty_like(params[i], dtype=cd)
            memory_view(x).copy_(u)
            logical.append(x.reshape(-1, shape[-2], shape[-1]))
        ortho = orthogonalize(torch.cat(logical), ns_a, ns_b, ns_c, int(ns_steps), eps, nsd)
        step = (lr64 * lr_ratio(shape, adjust_lr_fn)).to(cd)
        per = len(logical[0])
        # 3. the update, back in memory order
        for k, (i, pm, w_buf, sl, m_buf, m_new, _u, t) in enumerate(work):
            o = torch.empty_like(params[i], dtype=cd)
            o.copy_(ortho[k * per:(k + 1) * per].reshape(shape))
            w = cx.load_weight(pm, w_buf)
            term = step * memory_view(o)
            w_new = (w * decay if decay is not None else w) - term
            _commit(skip, cx.state_pairs(m_buf, m_new, 0, t, sl)
                    + cx.weight_pairs(pm, w_buf, w_new, t, sl,
                                      lambda w0: moved(w0, lr if decay is not None else None, term)))
            steps[i] += (~skip).to(steps.dtype)


def orthogonalize_scratch_(params: Sequence[Tensor], which: Sequence[int], shard: MuonScratch, ns_a: float,
                           ns_b: float, ns_c: float, eps: float, ns_steps: int) -> None:
    """Between the two phases, for parameters ``which`` whose pieces are whole matrices (or stacks of them): each
    input in ``shard`` replaced by its orthogonalized update, one batched chain per shape of matrix."""
    by_shape: Dict[Tuple[int, ...], list] = {}
    for i in which:
        by_shape.setdefault(tuple(params[i].shape[-2:]), []).append(i)
    for (a, b), idx in by_shape.items():
        xs = [to_logical(shard.piece(i), params[i]).reshape(-1, a, b) for i in idx]
        ortho = orthogonalize(torch.cat(xs), ns_a, ns_b, ns_c, int(ns_steps), eps, shard.buffer.dtype)
        at = 0
        for i, x in zip(idx, xs):
            from_logical_(shard.piece(i), ortho[at:at + len(x)].reshape(params[i].shape), params[i])
            at += len(x)


def muon_step_shard_(params: List[Tensor], grads: List[Optional[Tensor]], master: Optional[Tensor],
                     momentum_buffer: Tensor, steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor,
                     out_stats: Tensor, momentum: float, nesterov: bool, weight_decay: float, ns_a: float,
                     ns_b: float, ns_c: float, eps: float, ns_steps: int, adjust_lr_fn: Optional[str],
                     max_norm: float, seed: Optional[Tensor] = None, state_scales: Optional[Tensor] = None, *,
                     phase: int, shard: MuonScratch) -> None:
    """:func:`muon_step_` in its two elementwise passes, for parameters whose iteration runs elsewhere (FSDP2's
    shards; ``shard``: the :class:`MuonScratch` between the passes). Phase 1: the momentum (written) and each
    parameter's iteration input ``u`` into ``shard.piece(i)`` in the iteration's dtype; between the phases the
    caller writes the orthogonalized update of the whole matrix's elements in their place; phase 2: the decay,
    the update with the whole matrix's lr factor (``shard.ratios``), the master and the parameter, the step count.
    Phase 0 is :func:`muon_step_`. Phases 1 and 2 around the iteration are :func:`muon_step_`, bit for bit."""
    if phase == 0:
        muon_step_(params, grads, master, momentum_buffer, steps, partials, inv_scale, lr, out_stats, momentum,
                   nesterov, weight_decay, ns_a, ns_b, ns_c, eps, ns_steps, adjust_lr_fn, max_norm, seed,
                   state_scales)
        return
    cx = _Compact(params, master, [("momentum_buffer", momentum_buffer)], seed, state_scales)
    cd = cx.cd
    coef, skip = _prologue(partials, inv_scale, max_norm, out_stats, cd)
    lr64 = lr.double()
    decay = (1.0 - lr64 * weight_decay).to(cd) if weight_decay != 0 else None
    for i, pm, gm, w_buf, sl in _tensors_to_update(params, grads, master, cx.align):
        m_buf = momentum_buffer[sl]
        t = steps[i].to(cd) + 1
        if phase == 1:
            g = gm.to(cd) * coef
            m_new = lerp(cx.load_state(m_buf, 0, sl), g, 1 - momentum)
            shard.piece(i).copy_(lerp(g, m_new, momentum) if nesterov else m_new)
            _commit(skip, cx.state_pairs(m_buf, m_new, 0, t, sl))
        else:
            step = (lr64 * shard.ratios[i]).to(cd)
            w = cx.load_weight(pm, w_buf)
            w_new = (w * decay if decay is not None else w) - step * shard.piece(i).to(cd)
            _commit(skip, cx.weight_pairs(pm, w_buf, w_new, t, sl))
            steps[i] += (~skip).to(steps.dtype)


class _Split:
    """``muon_step_``'s split (``OpSpec.split``): a backend's kernels are its two elementwise passes, the iteration
    runs between them here, over every matrix of the call (they are whole: a call over FSDP2's pieces gives its
    phases itself, ``ampfused/optim/_whole_shards.py``). A call site (its ``steps`` tensor) keeps its scratch while
    its shapes and settings are the same (a warm step allocates and uploads nothing)."""

    CAPACITY = 256
    hypers = ("momentum", "nesterov", "weight_decay", "max_norm")  # what the passes read (not the iteration's)

    def __init__(self):
        from collections import OrderedDict
        self._kept: "OrderedDict[tuple, MuonScratch]" = OrderedDict()

    def scratch(self, call) -> MuonScratch:
        params, m = call.params, call.states["momentum_buffer"]
        shapes = tuple([p.shape for p in params])  # (torch.Size: a tuple, hashed and compared as one)
        align = QBLOCK if m.dtype == torch.uint8 else STATE_ALIGN
        nsd = ns_dtype(params[0].dtype)
        site = (call.steps.data_ptr(), m.device, shapes, call.hyper["adjust_lr_fn"], nsd, align)
        kept = self._kept.get(site)
        if kept is not None and kept.buffer.device == m.device:
            self._kept.move_to_end(site)
            return kept
        kept = self._kept[site] = MuonScratch(shapes, shapes, call.hyper["adjust_lr_fn"], nsd, m.device, align)
        while len(self._kept) > self.CAPACITY:
            self._kept.popitem(last=False)
        return kept

    @staticmethod
    def between(call, scratch: MuonScratch) -> None:
        h = call.hyper
        which = [i for i, g in enumerate(call.grads) if g is not None]
        orthogonalize_scratch_(call.params, which, scratch, h["ns_a"], h["ns_b"], h["ns_c"], h["eps"], h["ns_steps"])


SPLIT = _Split()
