"""Correctness before timing: every variant must compute what ``ampfused.ops.reference`` specifies.

For each instance the same steps run through the reference ops and through the variant, from the same
initial parameters and with the same gradients, bit for bit:

1. an ordinary step (loss-scaled gradients; clipping active when the instance clips);
2. with a scaler: a step with an ``inf`` in one gradient, which must change nothing and halve the scale;
3. an ordinary step at the backed-off scale.

What must agree, tensor by tensor:

* the gradient norm each step reports (where the variant reports one), within ``NORM_RTOL``;
* the fp32 weights (master, or the fp32 model), ``exp_avg`` and ``exp_avg_sq``, within ``RTOL`` of the
  tensor's largest magnitude, plus what the measured error of the variant's own norm explains: clipping
  multiplies the moments by ``max_norm / norm`` (``exp_avg_sq`` by its square), so a norm off by a
  relative ``e`` moves them by about ``e`` and ``2e``, and a weight by at most ``e * lr`` per step;
* a bf16/fp16 model copy: exactly the round-to-nearest-even of the variant's own master;
* the loss scale: exactly.

Why the norm allowance: torch's fp32 norm on CPU (``linalg.vector_norm``/``_foreach_norm``) accumulates with
a relative error that grows with the tensor (4e-6 at 5e5 elements, 1e-4 at 5e6, 2e-3 at 4e7, measured
against fp64), far above the reference's ``sum`` of squares. That is torch computing the same thing less
accurately, not something else. ``RTOL`` is ~100x the rounding differences between correct fp32
implementations and far below what a wrong rule produces (a missed clip or unscale changes the moments by
the clip coefficient or the scale; a wrong decay or bias correction changes the weights by a multiple of
``lr * weight_decay`` or ``lr``).

The norm and the non-finite flag always cover every element. Above ``max_elements`` the elementwise part is
checked on a sample of each tensor (its head, its tail and a stride through the middle), which keeps the
reference (plain torch ops, slow on CPU) to seconds on 100M+ parameter workloads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from ampfused.ops import reference

from .variants import Runner, Snapshot
from .workloads import Instance, make_grads

RTOL = 1e-5
NORM_RTOL = 1e-2
GROWTH, BACKOFF = 2.0, 0.5
MAX_ELEMENTS = 2 ** 22  # default: reference over every element up to this many parameters


class CorrectnessError(AssertionError):
    """A variant computed something else than the reference: the benchmark stops rather than time it."""


@dataclass
class Plan:
    grads: List[List[Tensor]]  # the gradients of each check step
    final_scale: float  # the loss scale after the check steps (what a correct scaler holds)
    sample: List[Optional[Tensor]]  # per tensor: indices checked elementwise (None = all)

    @property
    def timing_grads(self) -> List[Tensor]:
        """Finite gradients at the scale the variant holds after the check: what timed steps run on."""
        return self.grads[-1]


def _sample(numel: int, cap: int, device) -> Optional[Tensor]:
    if numel <= cap:
        return None
    edge = cap // 4
    middle = torch.linspace(edge, numel - edge - 1, cap - 2 * edge, device=device).long()
    return torch.cat([torch.arange(edge, device=device), middle,
                      torch.arange(numel - edge, numel, device=device)]).unique()


def make_plan(inst: Instance, max_elements: int = MAX_ELEMENTS) -> Plan:
    scale = inst.init_scale if inst.scaler else 1.0
    grads = []
    pattern = [False, True, False] if inst.scaler else [False, False]
    for k, inf in enumerate(pattern):
        grads.append(make_grads(inst, k, scale, inject_inf=inf))
        if inf:
            scale *= BACKOFF
    wl = inst.workload
    if wl.numel <= max_elements:
        sample = [None] * wl.tensors
    else:
        cap = max(4096, max_elements // wl.tensors)
        sample = [_sample(g.numel(), cap, inst.device) for g in grads[0]]
    return Plan(grads, scale, sample)


@dataclass
class Expected:
    master: Optional[List[Tensor]]  # sampled elements
    weights: List[Tensor]  # fp32 weights the update wrote (master, or the fp32 model), sampled
    exp_avg: List[Tensor]
    exp_avg_sq: List[Tensor]
    scale: Optional[float]
    norms: List[float]  # norm of the unscaled gradients, per step
    updates: int  # steps that were not skipped


def _pick(t: Tensor, idx: Optional[Tensor]) -> Tensor:
    flat = t.detach().reshape(-1)
    return flat if idx is None else flat[idx]


def run_reference(inst: Instance, params: List[Tensor], plan: Plan) -> Expected:
    """The check steps through ``ampfused.ops.reference``, one tensor (or sample) at a time: the same math
    as one flat buffer, since the norm and the non-finite flag are global and the rest is elementwise."""
    dev = inst.device
    param = [_pick(p, s).clone() for p, s in zip(params, plan.sample)]
    master = [p.float() for p in param] if inst.master else None
    m = [torch.zeros(p.numel(), dtype=torch.float32, device=dev) for p in param]
    v = [torch.zeros_like(x) for x in m]
    step = torch.zeros((), dtype=torch.float32, device=dev)
    lr = torch.full((), inst.lr, dtype=torch.float32, device=dev)
    stats = torch.zeros(2, dtype=torch.float32, device=dev)
    scale = torch.full((), inst.init_scale if inst.scaler else 1.0, dtype=torch.float32, device=dev)
    tracker = torch.zeros((), dtype=torch.int32, device=dev)
    norms, updates = [], 0
    for grads in plan.grads:
        inv_scale = scale.double().reciprocal().float()
        partials = reference.norm_check([g.reshape(-1) for g in grads], inv_scale)  # every element
        new_step = step
        for i, (g, s) in enumerate(zip(grads, plan.sample)):
            st = step.clone().view(1)
            reference.adamw_step_([param[i]], [_pick(g, s)], master[i] if master else None, m[i], v[i], st, partials,
                                  inv_scale, lr, stats, inst.betas[0], inst.betas[1], inst.eps,
                                  inst.weight_decay, inst.max_norm_or_inf)
            new_step = st
        updates += int(new_step.item() != step.item())
        step = new_step.reshape(())
        norms.append(float(stats[0]))
        if inst.scaler:
            reference.update_scale_(scale, tracker, stats[1], GROWTH, BACKOFF, inst.growth_interval)
    return Expected(master, master if master else param, m, v, float(scale) if inst.scaler else None,
                    norms, updates)


def _first_bad(name: str, got: Tensor, exp: Tensor, bad: Tensor, bound: float, k: int = 3) -> str:
    idx = bad.nonzero().flatten()[:k].tolist()
    shown = ", ".join(f"[{i}] got {got[i].item():.9g} expected {exp[i].item():.9g}" for i in idx)
    return f"{name}: {int(bad.sum())} of {bad.numel()} checked elements differ by more than {bound:.3g}; first: {shown}"


def _compare_lists(name: str, got: List[Tensor], exp: List[Tensor], plan: Plan, shapes, rtol: float,
                   atol: float = 0.0) -> List[str]:
    problems = []
    for i, (g, e) in enumerate(zip(got, exp)):
        if g.numel() != math.prod(shapes[i]):
            problems.append(f"{name}[{i}]: {g.numel()} elements, expected shape {tuple(shapes[i])}")
            continue
        g64, e64 = _pick(g, plan.sample[i]).double(), e.double()
        bound = rtol * e64.abs().max().item() + atol
        bad = ~((g64 - e64).abs() <= bound)  # NaN anywhere counts as bad
        if bad.any():
            problems.append(_first_bad(f"{name}[{i}] (shape {tuple(shapes[i])})", g64, e64, bad, bound))
            if len(problems) >= 3:
                break
    return problems


def norm_error(inst: Instance, got: List[Optional[float]], exp: Expected) -> tuple[float, List[str]]:
    """Largest relative error of the reported norms (steps with a finite norm), and problems."""
    err, problems = 0.0, []
    for k, (n, want) in enumerate(zip(got, exp.norms)):
        if n is None:
            continue
        if not math.isfinite(want):
            if math.isfinite(n):
                problems.append(f"step {k + 1}: reported gradient norm {n:.9g}, expected {want}")
            continue
        e = abs(n - want) / want
        err = max(err, e)
        if not e <= NORM_RTOL:
            problems.append(f"step {k + 1}: reported gradient norm {n:.9g}, expected {want:.9g} "
                            f"(relative error {e:.2g} > {NORM_RTOL:g})")
    return err, problems


def compare(snap: Snapshot, norms: List[Optional[float]], exp: Expected, inst: Instance, plan: Plan) -> List[str]:
    """Every way the variant's state differs from the reference (empty when it agrees)."""
    shapes = inst.workload.shapes
    e, problems = norm_error(inst, norms, exp)
    e = e if inst.clip else 0.0  # without clipping the norm never reaches the update
    w_atol = 2 * e * inst.lr * exp.updates
    if inst.master:
        if snap.master is None:
            return problems + ["reports no fp32 master weights for a low-precision model"]
        problems += _compare_lists("master", snap.master, exp.master, plan, shapes, RTOL, w_atol)
        for i, (p, w) in enumerate(zip(snap.param, snap.master)):
            rounded = w.detach().reshape(-1).to(p.dtype)
            if not torch.equal(p.detach().reshape(-1), rounded):
                n = int((p.detach().reshape(-1) != rounded).sum())
                problems.append(f"param[{i}] (shape {tuple(shapes[i])}): {n} elements are not the "
                                "round-to-nearest-even of the master weights")
                break
    else:
        problems += _compare_lists("param", snap.param, exp.weights, plan, shapes, RTOL, w_atol)
    problems += _compare_lists("exp_avg", snap.exp_avg, exp.exp_avg, plan, shapes, RTOL + 2 * e)
    problems += _compare_lists("exp_avg_sq", snap.exp_avg_sq, exp.exp_avg_sq, plan, shapes, RTOL + 3 * e)
    if exp.scale is not None and snap.scale != exp.scale:
        problems.append(f"loss scale is {snap.scale}, expected {exp.scale} (growth/backoff after an overflow)")
    return problems


def run_check_steps(runner: Runner, plan: Plan) -> List[Optional[float]]:
    """The plan's check steps on ``runner``; the gradient norm it reports after each (None if it reports none)."""
    norms: List[Optional[float]] = []
    for grads in plan.grads:
        runner.set_grads(grads)
        runner.step()
        n = runner.snapshot().norm
        norms.append(None if n is None else float(n))
    return norms


def check(runner: Runner, inst: Instance, plan: Plan, exp: Expected) -> None:
    """Run the check steps on ``runner``; raise :class:`CorrectnessError` naming every difference."""
    norms = run_check_steps(runner, plan)
    problems = compare(runner.snapshot(), norms, exp, inst, plan)
    if problems:
        raise CorrectnessError(f"{runner.variant} computes something else than ampfused.ops.reference on "
                               f"{inst.label()}:\n  " + "\n  ".join(problems))
