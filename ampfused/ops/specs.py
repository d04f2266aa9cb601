"""One record per op: what ``torch.ops.ampfused.<op>`` takes and writes, in schema order.

The custom op's schema, its ``mutates_args`` and fake implementation (``library.py``), the positions of the
arguments it writes and its argument names (``ampfused.ops``), the argument whose device picks the backend, and
the rows of ``python -m ampfused.info`` are all read from here. A step op is :func:`step_op` over its state
buffers and hyperparameters; the arguments every step op shares are laid out once, in :func:`step_op`.

Argument types are spelled as the schema spells them (``Tensor``, ``Tensor?``, ``Tensor[]``, ``Tensor?[]``,
``float``, ``float?``, ``bool``, ``SymInt``, ``str``). No argument has a default in the schema, except a
trailing optional one the op does not write: the reason is in ``library.py``'s docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Union

from .registry import get_backend


@dataclass(frozen=True)
class Arg:
    name: str
    type: str
    writes: bool = False


@dataclass(frozen=True)
class Hyper:
    """A scalar hyperparameter; ``default`` is the public function's default, never written into the schema."""
    name: str
    type: str
    default: object = None
    writes = False


@dataclass(frozen=True)
class State:
    """An optimizer state buffer of a step op (flat, written in place); ``optional``: may be ``None``."""
    name: str
    optional: bool = False


@dataclass(frozen=True)
class OpSpec:
    name: str
    args: Tuple[Union[Arg, Hyper], ...]
    probe: str  # the tensor argument whose device the call runs on (and the backend is picked for)
    returns: str = "()"
    fake: Optional[Callable] = None  # called with the op's arguments in schema order; None: returns nothing
    states: Tuple[State, ...] = ()
    hyper: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        names = [a.name for a in self.args]
        if len(set(names)) != len(names) or self.probe not in names or "backend" not in names:
            raise ValueError(f"op record {self.name}: argument names {names}, probe {self.probe!r}")
        if self.returns != "()" and self.fake is None:
            raise ValueError(f"op record {self.name}: returns {self.returns} but has no fake implementation")

    @property
    def arg_names(self) -> Tuple[str, ...]:
        return tuple(a.name for a in self.args)

    @property
    def written(self) -> Tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.args) if a.writes)

    @property
    def is_step(self) -> bool:
        return bool(self.states)

    def defaults(self) -> Dict[str, None]:
        """Schema defaults: ``None`` for each optional argument at the end that the op does not write."""
        out: Dict[str, None] = {}
        for a in reversed(self.args):
            if a.writes or not a.type.endswith("?"):
                break
            out[a.name] = None
        return out

    def schema(self) -> str:
        """The schema without the op's name, as ``torch.library.custom_op(schema=...)`` takes it."""
        defaults = self.defaults()
        parts = []
        for i, a in enumerate(self.args):
            t = a.type
            if a.writes:
                base, suffix = t[:6], t[6:]
                if base != "Tensor":
                    raise ValueError(f"op record {self.name}: {a.name} is written but is a {t}")
                t = f"Tensor(a{i}!){suffix}"
            parts.append(f"{t} {a.name}" + ("=None" if a.name in defaults else ""))
        return f"({', '.join(parts)}) -> {self.returns}"


def _partials(grads, inv_scale, backend):
    return inv_scale.new_empty(2, get_backend(backend).num_partials([g.numel() for g in grads]))


def _k1(name: str, writes: bool) -> OpSpec:
    return OpSpec(name, (Arg("grads", "Tensor[]", writes), Arg("inv_scale", "Tensor"), Arg("backend", "str")),
                  probe="inv_scale", returns="Tensor", fake=_partials)


MAX_NORM = Hyper("max_norm", "float", default=math.inf)
MAXIMIZE = Hyper("maximize", "bool", default=False)


def step_op(name: str, states: Tuple[State, ...], hyper: Tuple[Hyper, ...], *, state_scales: bool = True) -> OpSpec:
    """A step op: the parameters, their gradients and master, ``states``, the step counts and what K1 left,
    ``hyper``, the backend; then the compact state's arguments (``state_scales``: takes 8-bit block scales)."""
    args = (Arg("params", "Tensor[]", True), Arg("grads", "Tensor?[]"), Arg("master", "Tensor?", True),
            *(Arg(s.name, "Tensor?" if s.optional else "Tensor", True) for s in states),
            Arg("steps", "Tensor", True), Arg("partials", "Tensor"), Arg("inv_scale", "Tensor"),
            Arg("lr", "Tensor"), Arg("out_stats", "Tensor", True), *hyper, Arg("backend", "str"),
            Arg("seed", "Tensor?"), *((Arg("state_scales", "Tensor?", True),) if state_scales else ()))
    return OpSpec(name, args, probe="steps", states=tuple(states), hyper={h.name: h.default for h in hyper})


SPECS: Dict[str, OpSpec] = {s.name: s for s in (
    _k1("norm_check", writes=False),
    _k1("unscale_", writes=True),
    OpSpec("update_scale_", (
        Arg("scale", "Tensor", True), Arg("growth_tracker", "Tensor", True), Arg("found_inf", "Tensor"),
        Arg("growth_factor", "float"), Arg("backoff_factor", "float"), Arg("growth_interval", "SymInt"),
        Arg("inv_scale", "Tensor?", True), Arg("skipped", "Tensor?", True), Arg("backend", "str")),
        probe="scale"),
    step_op("adam_step_", (State("exp_avg"), State("exp_avg_sq")), (
        Hyper("beta1", "float", 0.9), Hyper("beta2", "float", 0.999), Hyper("eps", "float", 1e-8),
        Hyper("weight_decay", "float", 0.0), MAX_NORM, Hyper("decoupled", "bool", False), MAXIMIZE)),
    step_op("sgd_step_", (State("momentum_buf", optional=True),), (
        Hyper("momentum", "float", 0.0), Hyper("dampening", "float", 0.0), Hyper("weight_decay", "float", 0.0),
        Hyper("nesterov", "bool", False), MAX_NORM, MAXIMIZE)),
    step_op("lion_step_", (State("exp_avg"),), (
        Hyper("beta1", "float", 0.9), Hyper("beta2", "float", 0.99), Hyper("weight_decay", "float", 0.0),
        MAX_NORM, MAXIMIZE)),
    step_op("adafactor_step_", (State("factors"),), (
        Hyper("beta2_decay", "float", -0.8), Hyper("eps1", "float?", None), Hyper("eps2", "float", 1e-3),
        Hyper("d", "float", 1.0), Hyper("weight_decay", "float", 0.0), MAX_NORM, MAXIMIZE), state_scales=False),
)}
