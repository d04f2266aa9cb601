"""Functional layer: stateless ops over parameters and gradients where they live and optimizer state in flat
buffers, dispatched to a backend, registered as custom ops.

Every function validates its inputs (raising before anything changes), picks a backend
(``backend=`` > ``AMPFUSED_BACKEND`` > the device's priority list) and calls ``torch.ops.ampfused.<op>``.
The math of each op is written in :mod:`ampfused.ops.reference`, which is the specification.
"""
from __future__ import annotations

import inspect
import math
import os
from typing import List, Optional

import torch
from torch import Tensor
from torch.utils import _python_dispatch

from . import checks, library, reference, registry, specs
from .call import StepCall
from .factored import check_factors, factor_layout
from .reference import clip_coef, memory_view, reduce_partials, state_layout
from .registry import (Backend, available_backends, get_backend, register_backend, registered_backends,
                       resolve)

__all__ = [
    "norm_check", "unscale_", "update_scale_", "adam_step_", "adamw_step_", "sgd_step_", "reduce_partials",
    "clip_coef", "num_partials", "state_layout", "factor_layout", "memory_view", "available_backends",
    "registered_backends", "register_backend", "resolve", "get_backend", "Backend", "reference",
]


def _dtypes(*ts) -> tuple:
    return tuple(sorted({str(t.dtype) for t in ts if t is not None}))


_resolved: dict = {}


@torch.compiler.assume_constant_result
def _backend_name(device: str, dtypes: tuple, backend: Optional[str], op: Optional[str] = None) -> str:
    # Resolved in Python at trace time: a compiled step holds the chosen name as a constant. Eager calls hit
    # a cache keyed by everything the choice depends on (a failed choice is not cached: it raises each time).
    key = (device, dtypes, backend, op, os.environ.get(registry.ENV_VAR), registry.generation())
    name = _resolved.get(key)
    if name is None:
        types = tuple(getattr(torch, d.split(".")[-1]) for d in dtypes)
        name = resolve(device, types, backend).name
        if op is not None and not get_backend(name).has_step(op):
            name = _next_with(op, name, device, types, backend)
        _resolved[key] = name
    return name


def _next_with(op: str, name: str, device: str, types: tuple, backend: Optional[str]) -> str:
    """A step op's backend when the one picked lacks it: the next in the device's priority that has it, unless
    the backend was named (``backend=`` or ``AMPFUSED_BACKEND``): then the call is refused with the reason."""
    if backend or os.environ.get(registry.ENV_VAR):
        raise RuntimeError(f"ampfused backend {name!r} (forced) does not implement {op}")
    for other in available_backends(torch.device(device), types):
        if get_backend(other).has_step(op):
            return other
    raise RuntimeError(f"no ampfused backend implements {op} on {device}")


def _pick(device: torch.device, dtypes: tuple, backend: Optional[str], op: Optional[str] = None) -> str:
    return _backend_name(str(device), dtypes, backend, op)


# positions of the arguments each op writes and their names, read once from the records, so the eager path
# below pays one dict lookup per call (a step's written tensors: StepCall.tensors_written)
_MUTATED = {name: spec.written for name, spec in specs.SPECS.items()}
_ARG_NAMES = {name: spec.arg_names for name, spec in specs.SPECS.items()}


def _call(op: str, probe: Tensor, *args, **kw):
    """Run ``op`` with the backend named last in ``args``. Eager calls on plain tensors go straight to the
    backend (what the custom op would run, without its dispatch cost, which dominates launch-bound steps) and
    bump the version counters of what it wrote, as the custom op would (caches such as the clip's rely on
    them); traced code, tensor subclasses and dispatch modes (fake tensors, meta) go through the custom op."""
    if _eager(probe):
        out = getattr(get_backend(args[-1]), op)(*args[:-1], **kw)
        written = []
        for i in _MUTATED[op]:
            a = args[i] if i < len(args) else kw.get(_ARG_NAMES[op][i])  # the compact state's come by name
            if isinstance(a, Tensor):
                written.append(a)
            elif isinstance(a, (list, tuple)):
                written.extend(a)
        if written:
            torch.autograd.graph.increment_version(written)
        return out
    return library.OPS[op](*_positional(op, args, kw))


def _eager(probe) -> bool:
    return (type(probe) is Tensor and not torch.compiler.is_compiling()
            and _python_dispatch._get_current_dispatch_mode() is None)


def run_step(call: StepCall, backend: str) -> None:
    """The one door from an op or an optimizer to a step kernel: ``call`` (its tensors validated, or a fused
    optimizer's checked table) on backend ``backend`` (a name). Eager calls on plain tensors go straight to the
    backend's :meth:`~ampfused.ops.registry.Backend.step` and bump the version counters of what it wrote, as the
    custom op would; traced code, tensor subclasses and dispatch modes go through ``torch.ops.ampfused.<op>``
    (a table is the fused optimizers' eager path only; a phase over shards, ``call.shard``, traced runs its
    reference)."""
    if call.table is not None:
        call.run_on(get_backend(backend))
    elif call.shard is not None and not _eager(call.steps):
        get_backend("reference").step(call)  # (a phase over shards has no custom op: traced, its torch operations)
    elif _eager(call.steps):
        call.run_on(get_backend(backend))
        written = call.tensors_written()
        if written:
            torch.autograd.graph.increment_version(written)
    else:
        op = call.spec.name
        library.OPS[op](*_positional(op, (*call.op_args(), backend), call.compact_kwargs()))


def _public_step(op: str, params, grads, master: Optional[Tensor], states: dict, steps, partials: Tensor,
                 inv_scale: Tensor, lr: Tensor, out_stats: Tensor, hyper: dict, seed: Optional[Tensor],
                 state_scales: Optional[Tensor], backend: Optional[str]) -> None:
    """A public step op: every rule of its inputs checked before anything changes, its backend picked, run."""
    params, grads, steps = _as_lists(params, grads, steps)
    call = StepCall(specs.SPECS[op], params=params, grads=grads, master=master, states=states, steps=steps,
                    partials=partials, inv_scale=inv_scale, lr=lr, out_stats=out_stats, hyper=hyper, seed=seed,
                    state_scales=state_scales)
    check_step(call)
    run_step(call, _pick(steps.device, _step_dtypes(params, grads, master), backend, op))


def check_step(call: StepCall) -> None:
    """Every rule of a step call's inputs (from its tensors), before anything changes: the rules every step
    shares, its state layout's, then its record's own (``OpSpec.rules``); the hyperparameters are then converted
    in place to the kernels' types."""
    spec, hyper = call.spec, call.hyper
    flat = spec.layout == "flat"
    given = [(n, t) for n, t in call.used_states() if t is not None] if flat else []
    checks.step_inputs(call.params, call.grads, call.master, given, call.steps, call.partials, call.inv_scale,
                       call.lr, call.out_stats, call.seed, call.state_scales)
    if not flat:
        for s in spec.states:
            check_factors(s.name, call.states[s.name], call.params, call.master, call.steps.device)
    checks.scalars(**{h.name: hyper[h.name] for h in spec.hypers if h.type == "float"})
    if spec.rules is not None:
        spec.rules(call.params, hyper)
    for h in spec.hypers:  # the kernels' types
        v = hyper[h.name]
        if h.type == "bool":
            hyper[h.name] = bool(v)
        elif v is not None and h.type.startswith("float"):
            hyper[h.name] = float(v)


def _positional(op: str, args: tuple, kw: dict) -> tuple:
    """Every argument of the custom op in schema order, the optional trailing ones (``seed``, ``state_scales``)
    from ``kw`` or ``None``: the step ops declare them without defaults (``library.py``)."""
    return tuple(args) + tuple(kw.get(name) for name in _ARG_NAMES[op][len(args):])


def num_partials(numels: List[int], device="cpu", backend: Optional[str] = None) -> int:
    """Columns of the ``partials`` that ``norm_check``/``unscale_`` return for gradients of these sizes."""
    return resolve(device, (), backend).num_partials(list(numels))


def norm_check(grads: List[Tensor], inv_scale: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """Sum of squares of ``g * inv_scale`` in fp32 and the non-finite test, without modifying ``grads``.

    grads: list of tensors on one device (fp32/bf16/fp16); inv_scale: 0-d fp32. Returns partials ``[2, P]``
    fp32 (row 0 sums of squares, row 1 non-finite flags); reduce them with :func:`reduce_partials` or pass
    them to a step op.
    """
    checks.tensor("inv_scale", inv_scale, dtypes=(torch.float32,), scalar=True)
    checks.grads_list("grads", grads, inv_scale.device)
    return _call("norm_check", inv_scale, list(grads), inv_scale, _pick(inv_scale.device, _dtypes(*grads), backend))


def unscale_(grads: List[Tensor], inv_scale: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """In place ``g *= inv_scale`` (computed in fp32, rounded to ``g``'s dtype); returns partials as
    :func:`norm_check` of the unscaled values."""
    checks.tensor("inv_scale", inv_scale, dtypes=(torch.float32,), scalar=True)
    checks.grads_list("grads", grads, inv_scale.device)
    return _call("unscale_", inv_scale, list(grads), inv_scale, _pick(inv_scale.device, _dtypes(*grads), backend))


def update_scale_(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                  backoff_factor: float, growth_interval: int, *, inv_scale: Optional[Tensor] = None,
                  skipped: Optional[Tensor] = None, backend: Optional[str] = None) -> None:
    """torch's dynamic loss-scale update on device tensors (scale 0-d fp32, tracker 0-d int32, found_inf
    0-d fp32), bit for bit, without a host read. In the same launch, optionally: ``inv_scale`` (0-d fp32)
    receives ``fp32(1 / fp64(new scale))`` for the next unscale, ``skipped`` (0-d int64) counts overflows."""
    checks.tensor("scale", scale, dtypes=(torch.float32,), scalar=True)
    checks.tensor("growth_tracker", growth_tracker, dtypes=(torch.int32,), scalar=True, device=scale.device)
    checks.tensor("found_inf", found_inf, dtypes=(torch.float32,), scalar=True, device=scale.device)
    if inv_scale is not None:
        checks.tensor("inv_scale", inv_scale, dtypes=(torch.float32,), scalar=True, device=scale.device)
    if skipped is not None:
        checks.tensor("skipped", skipped, dtypes=(torch.int64,), scalar=True, device=scale.device)
    checks.scalars(growth_factor=growth_factor, backoff_factor=backoff_factor)
    _call("update_scale_", scale, scale, growth_tracker, found_inf, float(growth_factor),
          float(backoff_factor), int(growth_interval), inv_scale, skipped, _pick(scale.device, (), backend))


def _as_lists(params, grads, steps):
    """Accept the single-buffer spelling too: a tensor for ``params``/``grads`` is a list of one, and a 0-d
    ``steps`` is the step count of that one parameter (a view of it, so the count advances in place)."""
    if isinstance(params, Tensor):
        params = [params]
    if isinstance(grads, Tensor) or grads is None:
        grads = [grads]
    if isinstance(steps, Tensor) and steps.dim() == 0:
        steps = steps.view(1)
    return list(params), list(grads), steps


def _step_dtypes(params, grads, master) -> tuple:
    g = next((x for x in grads if x is not None), None)
    # int16 master remainders are state storage, not a compute dtype: backends are chosen by the float dtypes
    return _dtypes(params[0] if params else None, g, master if master is None or master.is_floating_point() else None)


def _public_function(spec: specs.OpSpec):
    """The public function of step op ``spec`` (a record with a ``doc``): its tensors by position (states in the
    record's order), its hyperparameters by name with the record's defaults (those the record groups, as one
    tuple: Adam's ``betas`` style), ``seed``, ``state_scales`` where it takes them, ``backend``; every input
    checked before anything changes (:func:`_public_step`)."""
    P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    tensors = ("params", "grads", "master", *(s.name for s in spec.states), "steps", "partials", "inv_scale", "lr",
               "out_stats")
    group_of = {m: name for name, members in spec.groups for m in members}
    members = dict(spec.groups)
    defaults = {h.name: h.default for h in spec.hypers}
    keywords = []
    for h in spec.hypers:
        g = group_of.get(h.name)
        if g is None:
            keywords.append(inspect.Parameter(h.name, K, default=h.default))
        elif members[g][0] == h.name:
            keywords.append(inspect.Parameter(g, K, default=tuple(defaults[m] for m in members[g])))
    tail = ("seed", "state_scales", "backend") if "state_scales" in spec.arg_names else ("seed", "backend")
    sig = inspect.Signature([inspect.Parameter(n, P) for n in tensors] + keywords
                            + [inspect.Parameter(n, K, default=None) for n in tail], return_annotation=None)
    states = [s.name for s in spec.states]

    def op(*args, **kwargs):
        a = sig.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        hyper = {}
        for h in spec.hypers:
            g = group_of.get(h.name)
            if g is None:
                hyper[h.name] = a[h.name]
                continue
            value = a[g]
            if not isinstance(value, (tuple, list)) or len(value) != len(members[g]):
                raise ValueError(f"{g} must be a tuple of {len(members[g])} ({', '.join(members[g])}), "
                                 f"got {value!r}")
            hyper[h.name] = value[members[g].index(h.name)]
        _public_step(spec.name, a["params"], a["grads"], a["master"], {n: a[n] for n in states}, a["steps"],
                     a["partials"], a["inv_scale"], a["lr"], a["out_stats"], hyper, a["seed"],
                     a.get("state_scales"), a["backend"])

    op.__name__ = op.__qualname__ = spec.name
    op.__module__ = __name__
    op.__signature__ = sig
    op.__doc__ = spec.doc
    return op


for _spec in specs.SPECS.values():
    if _spec.is_step and _spec.doc:
        globals()[_spec.name] = _public_function(_spec)
        if _spec.name not in __all__:
            __all__.append(_spec.name)


def adamw_step_(params, grads, master, exp_avg, exp_avg_sq, steps, partials, inv_scale, lr, out_stats, *,
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, max_norm=math.inf, maximize=False,
                seed=None, state_scales=None, backend=None) -> None:
    """Fused AdamW step (decoupled weight decay); see :func:`adam_step_`."""
    adam_step_(params, grads, master, exp_avg, exp_avg_sq, steps, partials, inv_scale, lr, out_stats,
               beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, max_norm=max_norm,
               decoupled=True, maximize=maximize, seed=seed, state_scales=state_scales, backend=backend)


def call_update_scale_(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                       backoff_factor: float, growth_interval: int, inv_scale: Optional[Tensor],
                       skipped: Optional[Tensor], backend: Optional[str] = None) -> None:
    """:func:`update_scale_` for a caller whose tensors passed its checks once and stay its own (ampfused's
    GradScaler): the same op, without re-checking them every iteration."""
    _call("update_scale_", scale, scale, growth_tracker, found_inf, float(growth_factor), float(backoff_factor),
          int(growth_interval), inv_scale, skipped, _pick(scale.device, (), backend))


def call_k1(op: str, grads: List[Tensor], inv_scale: Tensor, dtypes: tuple, backend: Optional[str] = None) -> Tensor:
    """``norm_check`` / ``unscale_`` (``op``) for callers that checked the gradients themselves (the fused
    optimizers do, once per step); ``dtypes`` are the gradients' dtype names, as ``str(dtype)``."""
    return _call(op, inv_scale, grads, inv_scale, _pick(inv_scale.device, dtypes, backend))


def step_backend(device, dtypes: tuple, backend: Optional[str] = None, op: Optional[str] = None) -> str:
    """Name of the backend the step ops pick for this device and these dtype names (cached); with ``op``, one
    that has that step (the next in priority if the first lacks it)."""
    return _pick(torch.device(device), dtypes, backend, op)

