"""ampfused's state-precision modes (docs/state-precision.md) as benchmark variants, and how each is checked.

A mode variant is ``ampfused-<backend>`` with options of ``FusedAdamW`` set, named by suffixes:

==================  ==========================================================  ==================  ========
suffix              options                                                     state B / bf16 p    moved B
==================  ==========================================================  ==================  ========
(none)              fp32 master, fp32 moments (the default)                     12                  28
``+rem``            ``store_param_remainders=True``                             10                  26
``+bf16m``          ``exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16``           8                   20
``+rem+bf16m``      both                                                        6                   18
``+sr``             ``bf16_stochastic_round=True`` (no master)                  8                   22
``+sr+bf16m``       ``bf16_stochastic_round=True`` + bf16 moments               4                   14
==================  ==========================================================  ==================  ========

The state bytes in the results are measured (the storages of the optimizer's state tensors), not taken
from this table; the bytes moved are ``bench.common.bytes.mode_bytes_per_param``.

How each mode is checked before it is timed, on the same check steps as every variant (bench/step/check.py):

* ``+rem`` / ``+rem+bf16m``: the contract is bitwise. Its *twin* (the same options without remainders:
  ``ampfused-<backend>`` / ``+bf16m``, same backend and seed) runs the same steps and is itself checked as
  below; the remainder mode's masters (``join(weight, remainder)``) and moments must equal the twin's bit for
  bit, and its weights differ from the twin's only at exact ties of the master (low 16 bits ``0x8000``).
* fp32 masters with bf16 moments (``+bf16m``): the masters against the reference within the usual ``RTOL``
  plus what the moments' rounding explains; the weights exactly the round to nearest even of the masters.
* moments stored in bf16: each step rounds them stochastically to one of the two bf16 neighbours of the fp32
  value, at most one bf16 ulp away, and an earlier rounding error is only multiplied by ``beta < 1`` after, so
  after ``n`` updates a moment is within ``n`` ulps of the fp32 reference, ulps of the largest magnitude it can
  have had on the way: ``|exp_avg| <= max |g|`` and ``exp_avg_sq <= max g^2`` over the unscaled gradients (a
  weighted mean with weights summing to at most 1; a moment can shrink later, and its ulp with it).
* ``+sr`` / ``+sr+bf16m`` (no master): the same argument for the weights, which are rounded stochastically
  each update: within ``n`` bf16 ulps of the reference's fp32 master, ulps of the largest magnitude the weight
  can have had (the initial one plus ``n`` updates at Adam's bound, decay included).
* wherever bf16 moments feed an update, each bf16 moment is off by a relative ``n * 2^-7`` at most (an ulp
  is at most ``2^-7`` of the value), so an update ``lr * m / sqrt(v)`` is off by at most ``lr * R *
  1.5 * n * 2^-7`` with ``R`` Adam's bound on ``|m_hat / sqrt(v_hat)|`` (Kingma & Ba, section 2.1:
  ``(1 - beta1) / sqrt(1 - beta2)`` when that exceeds 1); the allowance takes twice that over ``n`` updates.

These bounds are the formats' own error, far below what a wrong rule produces (a missed unscale or clip
changes moments by the scale or the clip coefficient; a lost update moves a weight by ``lr``-sized steps
that add up, a skipped step taken changes ``exp_avg`` by ``(1 - beta1) g``, many ulps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ampfused.ops.state_precision import join_master

from ..common.bytes import FP32, mode_bytes_per_param
from .ampfused_variant import AmpfusedVariant, OptimizerRunner
from .check import (RTOL, CorrectnessError, Expected, Plan, _compare_lists, _pick, compare, norm_error,
                    run_check_steps)
from .variants import Runner, Unavailable
from .workloads import Instance

BF16_REL_ULP = 2.0 ** -7  # a bf16 ulp is at most this fraction of the value it is the ulp of


@dataclass(frozen=True)
class Mode:
    suffix: str
    options: Dict[str, object]
    master: str  # "fp32", "remainder" or "none" (bench.common.bytes.MASTER_KINDS)
    bf16_moments: bool
    twin: Optional[str] = None  # the suffix whose masters must be bitwise equal (remainder modes)
    text: str = ""


_BF16M = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
MODES: List[Mode] = [
    Mode("+rem", dict(store_param_remainders=True), "remainder", False, twin="",
         text="store_param_remainders=True"),
    Mode("+bf16m", dict(_BF16M), "fp32", True, text="exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16"),
    Mode("+rem+bf16m", dict(store_param_remainders=True, **_BF16M), "remainder", True, twin="+bf16m",
         text="store_param_remainders=True + bf16 moments"),
    Mode("+sr", dict(bf16_stochastic_round=True), "none", False, text="bf16_stochastic_round=True"),
    Mode("+sr+bf16m", dict(bf16_stochastic_round=True, **_BF16M), "none", True,
         text="bf16_stochastic_round=True + bf16 moments"),
]
BY_SUFFIX = {m.suffix: m for m in MODES}
FP32_MODE = Mode("", {}, "fp32", False, text="fp32 master, fp32 moments")


def bf16_ulp(x: Tensor) -> Tensor:
    """The bf16 ulp at each |x| (fp64 in, fp64 out): 2^(exponent - 7), the smallest normal's below it."""
    a = x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def adam_ratio_bound(betas) -> float:
    """Kingma & Ba's bound on ``|m_hat / sqrt(v_hat)|`` (an update is at most ``lr`` times it)."""
    return max(1.0, (1 - betas[0]) / math.sqrt(1 - betas[1]))


class ModeRunner(OptimizerRunner):
    """``FusedAdamW`` with a mode's options; the snapshot's masters are the joined remainders, or None."""

    def __init__(self, variant: str, backend: str, inst: Instance, params: List[Tensor], mode: Mode):
        super().__init__(variant, backend, inst, params, opt_kwargs=mode.options)
        self.mode = mode
        self.params0 = params  # the initial parameters (the runner trains clones), for a twin

    def masters(self) -> Optional[List[Tensor]]:
        st = [self.opt.state[p] for p in self.model]
        if self.mode.master == "remainder":
            return [join_master(p.detach(), s["master_remainder"]).view(p.shape) for p, s in zip(self.model, st)]
        if self.mode.master == "fp32" and self.inst.master:
            return [s["master_param"] for s in st]
        return None

    def snapshot(self):
        snap = super().snapshot()
        snap.master = self.masters()
        return snap


class ModeVariant(AmpfusedVariant):
    """``ampfused-<backend><suffix>``: FusedAdamW with one state mode's options (bf16 models only)."""

    def __init__(self, backend: str, mode: Mode):
        super().__init__(backend, "optimizer")
        self.mode = mode
        self.name = f"ampfused-{backend}{mode.suffix}"

    def build(self, inst: Instance, params: List[Tensor]) -> Runner:
        if inst.param_dtype != torch.bfloat16:
            raise Unavailable(f"the state modes apply to bf16 models; this one is {inst.param_dtype}")
        super().build(inst, params)  # the backend's availability, with its reason
        return ModeRunner(self.name, self.backend, inst, params, self.mode)

    def bytes_per_param(self, inst: Instance) -> float:
        return mode_bytes_per_param(inst.grad_dtype, inst.param_dtype, self.mode.master,
                                    2 if self.mode.bf16_moments else FP32)

    def check_runner(self, runner: Runner, inst: Instance, plan: Plan, exp: Expected) -> None:
        check_mode(runner, inst, plan, exp, self.mode)




def _grad_bound(plan: Plan, inst: Instance, i: int) -> Tensor:
    """Per element of tensor ``i``: the largest unscaled gradient over the applied check steps, fp64. A moment
    is a weighted mean of the (clipped, so no larger) gradients with weights summing to at most 1, so
    ``|exp_avg| <= this`` and ``exp_avg_sq <= this^2`` at every step: the magnitude whose ulp bounds each
    rounding error along the way (a moment can shrink later, and its own ulp with it)."""
    scale = inst.init_scale if inst.scaler else 1.0
    out = None
    for grads in plan.grads:
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite:
            g = _pick(grads[i], plan.sample[i]).double().abs() / scale
            out = g if out is None else torch.maximum(out, g)
        elif inst.scaler:
            scale *= 0.5
    return out


def _weight_bound(param0: List[Tensor], exp: Expected, plan: Plan, inst: Instance, i: int) -> Tensor:
    """Per element: the largest magnitude a weight can take along the check steps (the initial weight plus
    every update at Adam's bound, decay included), whose ulp bounds each rounding of it."""
    w0 = _pick(param0[i], plan.sample[i]).double().abs()
    return w0 + exp.updates * inst.lr * (
        adam_ratio_bound(inst.betas) + inst.weight_decay * w0)


def _within(name: str, got: List[Tensor], exp: List[Tensor], plan: Plan, shapes, n: int, mags: List[Tensor],
            atol: float, allow_fraction: float = 0.0) -> List[str]:
    """Elementwise ``|got - exp| <= n * ulp_bf16(max(|got|, |exp|, mag)) + atol``: ``n`` roundings of at most
    one ulp each of a value never larger in magnitude than those."""
    problems = []
    for i, (g, e, m) in enumerate(zip(got, exp, mags)):
        g64, e64 = _pick(g, plan.sample[i]).double(), e.double()
        bound = n * bf16_ulp(torch.maximum(torch.maximum(g64.abs(), e64.abs()), m)) + atol
        bad = ~((g64 - e64).abs() <= bound)
        if bad.any() and not (bool(torch.isfinite(g64).all()) and int(bad.sum()) <= allow_fraction * bad.numel()):
            k = bad.nonzero().flatten()[:3].tolist()
            shown = ", ".join(f"[{j}] got {g64[j].item():.9g} expected {e64[j].item():.9g}" for j in k)
            problems.append(f"{name}[{i}] (shape {tuple(shapes[i])}): {int(bad.sum())} of {bad.numel()} elements "
                            f"further than {n} bf16 ulps + {atol:.3g}; first: {shown}")
            if len(problems) >= 3:
                break
    return problems


def compare_mode(snap, norms, exp: Expected, inst: Instance, plan: Plan, mode: Mode,
                 param0: List[Tensor]) -> List[str]:
    """Every way a non-remainder mode's state differs from the reference beyond its format's error."""
    if mode.master == "fp32" and not mode.bf16_moments:
        return compare(snap, norms, exp, inst, plan)
    shapes = inst.workload.shapes
    e, problems = norm_error(inst, norms, exp)
    e = e if inst.clip else 0.0
    n = exp.updates
    w_atol = 2 * e * inst.lr * n
    if mode.bf16_moments:  # the updates' error from the moments' rounding (module docstring)
        w_atol += 2 * inst.lr * adam_ratio_bound(inst.betas) * 1.5 * n * n * BF16_REL_ULP
    if mode.master == "none":
        if snap.master is not None:
            problems.append("keeps masters in a mode without any")
        wmag = [_weight_bound(param0, exp, plan, inst, i) for i in range(len(shapes))]
        problems += _within("param", snap.param, exp.master, plan, shapes, n, wmag, w_atol)
    else:
        if snap.master is None:
            return problems + ["reports no masters"]
        problems += _compare_lists("master", snap.master, exp.master, plan, shapes, RTOL, w_atol)
        for i, (p, w) in enumerate(zip(snap.param, snap.master)):
            if not torch.equal(p.detach().reshape(-1), w.detach().reshape(-1).to(p.dtype)):
                problems.append(f"param[{i}]: not the round-to-nearest-even of the fp32 masters")
                break
    if mode.bf16_moments:
        gmax = [_grad_bound(plan, inst, i) for i in range(len(shapes))]
        problems += _within("exp_avg", snap.exp_avg, exp.exp_avg, plan, shapes, n, gmax, 0.0)
        problems += _within("exp_avg_sq", snap.exp_avg_sq, exp.exp_avg_sq, plan, shapes, n, [g * g for g in gmax],
                            0.0)
    else:
        problems += _compare_lists("exp_avg", snap.exp_avg, exp.exp_avg, plan, shapes, RTOL + 2 * e)
        problems += _compare_lists("exp_avg_sq", snap.exp_avg_sq, exp.exp_avg_sq, plan, shapes, RTOL + 3 * e)
    if exp.scale is not None and snap.scale != exp.scale:
        problems.append(f"loss scale is {snap.scale}, expected {exp.scale}")
    return problems


def _ties(master: Tensor) -> Tensor:
    return (master.contiguous().view(torch.int32) & 0xFFFF) == 0x8000


def compare_twin(snap, twin) -> List[str]:
    """A remainder mode against its twin after the same steps: masters and moments bitwise, weights equal
    except at exact ties of the master."""
    problems = []
    for name in ("master", "exp_avg", "exp_avg_sq"):
        for i, (a, b) in enumerate(zip(getattr(snap, name), getattr(twin, name))):
            a, b = a.detach().reshape(-1), b.detach().reshape(-1)
            same = a.view(torch.int32) == b.view(torch.int32) if a.dtype == torch.float32 else \
                a.view(torch.int16) == b.view(torch.int16)
            if not bool(same.all()):
                j = int((~same).nonzero()[0])
                problems.append(f"{name}[{i}]: {int((~same).sum())} elements not bitwise equal to the twin's; first "
                                f"[{j}] {a[j].item():.9g} vs {b[j].item():.9g}")
                break
    for i, (p, q, m) in enumerate(zip(snap.param, twin.param, twin.master)):
        diff = p.detach().reshape(-1) != q.detach().reshape(-1)
        if bool((diff & ~_ties(m.detach().reshape(-1))).any()):
            problems.append(f"param[{i}]: {int((diff & ~_ties(m.reshape(-1))).sum())} weights differ from the "
                            "twin's where the master is not a tie")
            break
    if snap.scale != twin.scale:
        problems.append(f"loss scale {snap.scale} vs the twin's {twin.scale}")
    return problems


def check_mode(runner: Runner, inst: Instance, plan: Plan, exp: Expected, mode: Mode) -> None:
    """Run the check steps on a mode's runner; raise :class:`CorrectnessError` naming every difference."""
    norms = run_check_steps(runner, plan)
    snap = runner.snapshot()
    if mode.twin is None:
        problems = compare_mode(snap, norms, exp, inst, plan, mode, runner.params0)
    else:
        twin_mode = BY_SUFFIX.get(mode.twin, FP32_MODE)
        twin = ModeRunner(runner.variant + " (twin)", runner.backend, inst, [p.detach() for p in runner.params0],
                          twin_mode)
        twin_norms = run_check_steps(twin, plan)
        twin_snap = twin.snapshot()
        problems = [f"twin {twin_mode.suffix or 'fp32 master'}: {p}"
                    for p in compare_mode(twin_snap, twin_norms, exp, inst, plan, twin_mode, runner.params0)]
        problems += compare_twin(snap, twin_snap)
        del twin
    if problems:
        raise CorrectnessError(f"{runner.variant} ({mode.text}) computes something else than its mode allows on "
                               f"{inst.label()}:\n  " + "\n  ".join(problems))


def mode_variants(device: torch.device, backends: List[str], names: Optional[List[str]] = None) -> List[ModeVariant]:
    """Every mode on the first fast backend (and on any backend ``names`` asks for by name)."""
    out = []
    for k, b in enumerate(backends):
        for m in MODES:
            v = ModeVariant(b, m)
            if k == 0 or (names and v.name in names):
                out.append(v)
    return out
