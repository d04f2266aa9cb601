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
``+q8m``            ``exp_avg_dtype=exp_avg_sq_dtype=torch.uint8`` (8-bit)      6.03                16.06
``+rem+q8m``        remainders + 8-bit moments                                  4.03                14.06
``+sr+q8m``         ``bf16_stochastic_round=True`` + 8-bit moments              2.03                10.06
``+health``         ``health=True`` (the training-health sums, same bytes)      12                  28
``+rem+health``     remainders + ``health=True``                                10                  26
==================  ==========================================================  ==================  ========

The ``+health`` modes run only where the step computes the sums (``Backend.computes_health``): they time what
asking for ``opt.health()`` costs a step, against their twin without it.

The state bytes in the results are measured (the storages of the optimizer's state tensors), not taken
from this table; the bytes moved are ``bench.common.bytes.mode_bytes_per_param``.

How each mode is checked before it is timed, on the same check steps as every variant (bench/step/check.py):

* ``+health`` / ``+rem+health``: the step is the same bit for bit with the sums as without them: checked as a
  remainder mode against its twin (``ampfused-<backend>`` / ``+rem``), below.
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

* 8-bit moments (``+q8m``, ``+rem+q8m``, ``+sr+q8m``): the same argument with a code's step in place of the
  ulp: a code is within one step of the fp32 value, at most ``2^-3`` of the value's magnitude, or in a block's
  subnormal range ``2^-16`` (``exp_avg``) / ``2^-32`` (``exp_avg_sq``) of the block's largest value; each
  update's error is then allowed its whole size (``lr * R``), and up to ``QUANTIZED_OUTLIERS`` of a tensor's
  weights beyond that (bench/step/peers.py: a tiny second moment next to a large one). Those bounds are loose, so
  on a backend other than the reference the mode also runs on the reference backend (its *twin*, the
  specification of the format) and at most ``Q8_TWIN_FRACTION`` of the moments and weights may differ from the
  twin's beyond one code step (each backend sums the norm in its own order, so the clip coefficient may differ
  by an ulp: a value straddling a rounding boundary then takes the neighbouring code).

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

from ampfused import ops
from ampfused.ops import memory_view
from ampfused.ops import state_precision as sp
from ampfused.ops.state_precision import join_master

from ..common.bytes import FP32, mode_bytes_per_param
from .ampfused_variant import AmpfusedVariant, OptimizerRunner
from .check import (RTOL, CorrectnessError, Expected, Plan, _compare_lists, _pick, compare, norm_error,
                    run_check_steps)
from .variants import Runner, Unavailable
from .workloads import Instance

BF16_REL_ULP = 2.0 ** -7  # a bf16 ulp is at most this fraction of the value it is the ulp of
Q8_REL_STEP = 2.0 ** -3  # an 8-bit code's step is at most this fraction of the value (normal codes)
Q8_FLOOR = {"exp_avg": 2.0 ** -16, "exp_avg_sq": 2.0 ** -32}  # subnormal step / the block's largest value
Q8_TWIN_FRACTION = 0.02  # elements that may differ from the reference backend's beyond one code step
QUANTIZED_OUTLIERS = 1e-4  # as bench/step/peers.py


@dataclass(frozen=True)
class Mode:
    suffix: str
    options: Dict[str, object]
    master: str  # "fp32", "remainder" or "none" (bench.common.bytes.MASTER_KINDS)
    bf16_moments: bool
    twin: Optional[str] = None  # the suffix whose masters must be bitwise equal (remainder modes)
    text: str = ""
    q8_moments: bool = False  # 8-bit moments (``torch.uint8``)

    @property
    def moment_bytes(self) -> float:
        """Stored bytes per moment element (8-bit: the code and its share of the block's fp32 scale)."""
        return 1 + 4 / sp.QBLOCK if self.q8_moments else 2 if self.bf16_moments else FP32


_BF16M = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
_Q8M = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
MODES: List[Mode] = [
    Mode("+rem", dict(store_param_remainders=True), "remainder", False, twin="",
         text="store_param_remainders=True"),
    Mode("+bf16m", dict(_BF16M), "fp32", True, text="exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16"),
    Mode("+rem+bf16m", dict(store_param_remainders=True, **_BF16M), "remainder", True, twin="+bf16m",
         text="store_param_remainders=True + bf16 moments"),
    Mode("+sr", dict(bf16_stochastic_round=True), "none", False, text="bf16_stochastic_round=True"),
    Mode("+sr+bf16m", dict(bf16_stochastic_round=True, **_BF16M), "none", True,
         text="bf16_stochastic_round=True + bf16 moments"),
    Mode("+q8m", dict(_Q8M), "fp32", False, text="exp_avg_dtype=exp_avg_sq_dtype=torch.uint8", q8_moments=True),
    Mode("+rem+q8m", dict(store_param_remainders=True, **_Q8M), "remainder", False,
         text="store_param_remainders=True + 8-bit moments", q8_moments=True),
    Mode("+sr+q8m", dict(bf16_stochastic_round=True, **_Q8M), "none", False,
         text="bf16_stochastic_round=True + 8-bit moments", q8_moments=True),
    Mode("+health", dict(health=True), "fp32", False, twin="", text="health=True"),
    Mode("+rem+health", dict(store_param_remainders=True, health=True), "remainder", False, twin="+rem",
         text="store_param_remainders=True + health=True"),
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
        if self.mode.q8_moments:  # the codes decoded (exactly) with their block scales
            st = [self.opt.state[p] for p in self.model]
            snap.exp_avg = [_decoded(p, s, "exp_avg") for p, s in zip(self.model, st)]
            snap.exp_avg_sq = [_decoded(p, s, "exp_avg_sq") for p, s in zip(self.model, st)]
        return snap


def _decoded(p: Tensor, st: dict, name: str) -> Tensor:
    """Parameter ``p``'s 8-bit moment ``name`` as fp32 values shaped (and strided) like ``p``."""
    out = torch.empty_like(p, dtype=torch.float32)
    memory_view(out).copy_(sp.q8_dequantize(memory_view(st[name]), st[f"{name}_scale"], sp.q8_signed(name)))
    return out


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
        return mode_bytes_per_param(inst.grad_dtype, inst.param_dtype, self.mode.master, self.mode.moment_bytes)

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
    if mode.master == "fp32" and not mode.bf16_moments and not mode.q8_moments:
        return compare(snap, norms, exp, inst, plan)
    shapes = inst.workload.shapes
    e, problems = norm_error(inst, norms, exp)
    e = e if inst.clip else 0.0
    n = exp.updates
    w_atol = 2 * e * inst.lr * n
    if mode.bf16_moments:  # the updates' error from the moments' rounding (module docstring)
        w_atol += 2 * inst.lr * adam_ratio_bound(inst.betas) * 1.5 * n * n * BF16_REL_ULP
    outliers = 0.0
    if mode.q8_moments:  # each update allowed its whole size, a few weights beyond (module docstring)
        w_atol += 2 * inst.lr * adam_ratio_bound(inst.betas) * n
        outliers = QUANTIZED_OUTLIERS
    wmag = [_weight_bound(param0, exp, plan, inst, i) for i in range(len(shapes))]
    if mode.master == "none":
        if snap.master is not None:
            problems.append("keeps masters in a mode without any")
        problems += _within("param", snap.param, exp.master, plan, shapes, n, wmag, w_atol, outliers)
    else:
        if snap.master is None:
            return problems + ["reports no masters"]
        if mode.q8_moments:
            rel = RTOL * max(float(e.double().abs().max()) for e in exp.master)
            problems += _within("master", snap.master, exp.master, plan, shapes, 0, wmag, w_atol + rel, outliers)
        else:
            problems += _compare_lists("master", snap.master, exp.master, plan, shapes, RTOL, w_atol)
        for i, (p, w) in enumerate(zip(snap.param, snap.master)):
            differ = p.detach().reshape(-1) != w.detach().reshape(-1).to(p.dtype)
            if mode.master == "remainder":  # ties away from zero (docs/state-precision.md)
                differ &= ~_ties(w.detach().reshape(-1))
            if bool(differ.any()):
                problems.append(f"param[{i}]: not the round to nearest of the fp32 masters")
                break
    if mode.q8_moments:
        gmax = [_grad_bound(plan, inst, i) for i in range(len(shapes))]
        atol = (RTOL + 3 * e)
        problems += _within_q8("exp_avg", snap.exp_avg, exp.exp_avg, plan, shapes, n, gmax, atol)
        problems += _within_q8("exp_avg_sq", snap.exp_avg_sq, exp.exp_avg_sq, plan, shapes, n, [g * g for g in gmax],
                               atol)
    elif mode.bf16_moments:
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


def _q8_step(name: str, mag: Tensor) -> Tensor:
    """Per element: the largest step of an 8-bit code of a value no larger than ``mag`` in a block whose values
    are no larger than ``mag``'s largest (fp64)."""
    return torch.maximum(mag * Q8_REL_STEP, mag.max() * Q8_FLOOR[name]) + 1e-30


def _within_q8(name: str, got: List[Tensor], exp: List[Tensor], plan: Plan, shapes, n: int, mags: List[Tensor],
               rtol: float) -> List[str]:
    """Decoded 8-bit moments against the reference: ``n`` roundings of at most one code step each (steps of the
    largest magnitude the moment can have had), plus ``rtol`` of the largest expected value (the norm's error)."""
    problems = []
    for i, (g, e, m) in enumerate(zip(got, exp, mags)):
        g64, e64 = _pick(g, plan.sample[i]).double(), e.double()
        bound = n * _q8_step(name, m) + rtol * e64.abs().max()
        bad = ~((g64 - e64).abs() <= bound)
        if bad.any():
            j = int(bad.nonzero()[0])
            problems.append(f"{name}[{i}] (shape {tuple(shapes[i])}): {int(bad.sum())} of {bad.numel()} elements "
                            f"further than {n} code steps; first [{j}] got {g64[j].item():.9g} expected "
                            f"{e64[j].item():.9g}")
    return problems


def compare_q8_twin(snap, twin, w_atol: float) -> List[str]:
    """An 8-bit mode against the same mode on the reference backend after the same steps: moments within one code
    step, weights (masters) within one ulp of their dtype plus ``w_atol`` (what a code one step away changes in
    the updates), at all but ``Q8_TWIN_FRACTION`` of the elements."""
    problems = []
    for name in ("exp_avg", "exp_avg_sq", "param", "master"):
        mine, theirs = getattr(snap, name), getattr(twin, name)
        if mine is None or theirs is None:
            if (mine is None) != (theirs is None):
                problems.append(f"{name}: kept by one backend only")
            continue
        for i, (a, b) in enumerate(zip(mine, theirs)):
            a64, b64 = a.detach().reshape(-1).double(), b.detach().reshape(-1).double()
            if name in ("exp_avg", "exp_avg_sq"):
                tol = _q8_step(name, b64.abs())
            else:
                tol = b64.abs() * torch.finfo(a.dtype).eps + torch.finfo(a.dtype).tiny + w_atol
            far = ~((a64 - b64).abs() <= tol)
            if int(far.sum()) > Q8_TWIN_FRACTION * far.numel():
                problems.append(f"{name}[{i}]: {int(far.sum())} of {far.numel()} elements differ from the reference "
                                f"backend's beyond one step (at most {Q8_TWIN_FRACTION:.0%} may)")
                break
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
        if mode.q8_moments and runner.backend != "reference":  # the format's specification, on the same steps
            twin = ModeRunner(runner.variant + " (reference twin)", "reference", inst,
                              [p.detach() for p in runner.params0], mode)
            run_check_steps(twin, plan)
            w_atol = inst.lr * adam_ratio_bound(inst.betas) * 1.5 * Q8_REL_STEP * exp.updates
            problems += [f"against the reference backend: {p}"
                         for p in compare_q8_twin(snap, twin.snapshot(), w_atol)]
            del twin
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
    """Every mode on every fast backend in ``backends`` (on CUDA both cuda and triton: each has its own compact
    kernels); on the reference backend, the specification rather than a contender, only the modes ``names`` asks
    for by name."""
    out = []
    for b in backends:
        for m in MODES:
            v = ModeVariant(b, m)
            if m.options.get("health") and not ops.registry.get_backend(b).computes_health("adam_step_"):
                continue
            if b != "reference" or (names and v.name in names):
                out.append(v)
    return out
