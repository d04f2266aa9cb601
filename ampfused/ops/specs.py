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

from . import reference_adafactor, reference_muon


@dataclass(frozen=True)
class Arg:
    name: str
    type: str
    writes: bool = False


@dataclass(frozen=True)
class Hyper:
    """A scalar hyperparameter; ``default`` is the public function's default, never written into the schema;
    ``none``: the value the kernels get for ``None`` (an optional hyperparameter's default, resolved)."""
    name: str
    type: str
    default: object = None
    none: Optional[float] = None
    writes = False


@dataclass(frozen=True)
class State:
    """An optimizer state buffer of a step op (flat, written in place); ``optional``: may be ``None``;
    ``needed_if``: a hyperparameter without which the step never reads it (it is then ignored, and required
    when that hyperparameter is not 0)."""
    name: str
    optional: bool = False
    needed_if: Optional[str] = None


@dataclass(frozen=True)
class OpSpec:
    name: str
    args: Tuple[Union[Arg, Hyper], ...]
    probe: str  # the tensor argument whose device the call runs on (and the backend is picked for)
    returns: str = "()"
    fake: Optional[str] = None  # its fake implementation's name in library.FAKES (called with the op's arguments in
    # schema order); None: returns nothing
    states: Tuple[State, ...] = ()
    hyper: Dict[str, object] = field(default_factory=dict)
    hypers: Tuple[Hyper, ...] = ()
    doc: str = ""  # a step op's public function (ampfused.ops.<name>), made from this record, documented so
    layout: str = "flat"  # a step's state layout: "flat" (state_layout of the numels) or "factored" (ops/factored.py)
    reference: str = "reference"  # the module of ampfused.ops that holds its reference function (the specification)
    rules: Optional[Callable] = None  # a step's own input rules, ``rules(params, hyper)``, after the shared ones
    groups: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()  # hyperparameters its public function takes as one tuple
    # a step whose kernels are two elementwise passes around a function of whole tensors (Muon's iteration): an
    # object with ``scratch(call)`` (the buffer between the passes), ``between(call, scratch)`` and ``hypers`` (the
    # hyperparameters the passes read: the native entries read only those); a backend other than the reference
    # runs phases 1 and 2 of it (StepCall.run_on); None: one launch
    split: Optional[object] = None

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
    def hyper_none(self) -> Dict[str, Optional[float]]:
        """What the kernels get for each hyperparameter given as ``None`` (:attr:`Hyper.none`)."""
        return {h.name: h.none for h in self.hypers}

    @property
    def written(self) -> Tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.args) if a.writes)

    @property
    def is_step(self) -> bool:
        return bool(self.states)

    @property
    def kernel(self) -> str:
        """The step's kernel module (``triton_kernels/<kernel>.py``): the op's name without ``_step_``."""
        return self.name[:-len("_step_")] if self.name.endswith("_step_") else self.name

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


def _k1(name: str, writes: bool) -> OpSpec:
    return OpSpec(name, (Arg("grads", "Tensor[]", writes), Arg("inv_scale", "Tensor"), Arg("backend", "str")),
                  probe="inv_scale", returns="Tensor", fake="partials")


MAX_NORM = Hyper("max_norm", "float", default=math.inf)
MAXIMIZE = Hyper("maximize", "bool", default=False)


def step_op(name: str, states: Tuple[State, ...], hyper: Tuple[Hyper, ...], *, state_scales: bool = True,
            doc: str = "", **record) -> OpSpec:
    """A step op: the parameters, their gradients and master, ``states``, the step counts and what K1 left,
    ``hyper``, the backend; then the compact state's arguments (``state_scales``: takes 8-bit block scales)."""
    args = (Arg("params", "Tensor[]", True), Arg("grads", "Tensor?[]"), Arg("master", "Tensor?", True),
            *(Arg(s.name, "Tensor?" if s.optional else "Tensor", True) for s in states),
            Arg("steps", "Tensor", True), Arg("partials", "Tensor"), Arg("inv_scale", "Tensor"),
            Arg("lr", "Tensor"), Arg("out_stats", "Tensor", True), *hyper, Arg("backend", "str"),
            Arg("seed", "Tensor?"), *((Arg("state_scales", "Tensor?", True),) if state_scales else ()))
    return OpSpec(name, args, probe="steps", states=tuple(states), hyper={h.name: h.default for h in hyper},
                  hypers=tuple(hyper), doc=doc, **record)


# the public functions' documentation (ampfused.ops.adam_step_, ...)
ADAM_DOC = """Fused Adam/AdamW step (K2) over parameters where they live and flat optimizer state.

    params: list of T dense tensors (one dtype, fp32/bf16/fp16; any memory layout), updated in place;
    grads: T entries, ``None`` for a parameter to leave alone this step, else a tensor with its parameter's
    shape and layout (one dtype for all); master (fp32, or ``None`` for fp32 params), exp_avg, exp_avg_sq:
    1-D flat buffers of ``state_layout([p.numel() for p in params])[1]`` elements; steps: ``[T]`` fp32 step
    counts; partials ``[2, P]`` from :func:`norm_check`; inv_scale, lr: 0-d fp32; out_stats: ``[2]`` fp32.
    A single flat parameter may be passed as a tensor (with its gradient as a tensor and a 0-d step).
    Math: :func:`reference.adam_step_`. Compact state (``docs/state-precision.md``): ``master`` int16 (master
    remainders of bf16 params), ``master=None`` with bf16 params (stochastic rounding), bf16 moments, uint8
    moments (8-bit codes; the flat buffers laid out by ``state_layout(numels, QBLOCK)``, ``state_scales`` the
    ``[2, blocks]`` fp32 block scales); ``seed`` (0-d int64) keys the stochastic rounding and is required by all
    but the remainders.
    """

SGD_DOC = """Fused SGD step; tensors as :func:`adam_step_` (``momentum_buf`` a flat buffer, needed when
    ``momentum != 0``; uint8 with ``state_scales`` ``[1, blocks]``); math in :func:`reference.sgd_step_`."""

LION_DOC = """Fused Lion step; tensors as :func:`adam_step_` with one moment (``exp_avg``: fp32, bf16, or uint8 with
    ``state_scales`` ``[1, blocks]``); math in :func:`reference.lion_step_`."""

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
        Hyper("weight_decay", "float", 0.0), MAX_NORM, Hyper("decoupled", "bool", False), MAXIMIZE), doc=ADAM_DOC),
    step_op("sgd_step_", (State("momentum_buf", optional=True, needed_if="momentum"),), (
        Hyper("momentum", "float", 0.0), Hyper("dampening", "float", 0.0), Hyper("weight_decay", "float", 0.0),
        Hyper("nesterov", "bool", False), MAX_NORM, MAXIMIZE), doc=SGD_DOC),
    step_op("lion_step_", (State("exp_avg"),), (
        Hyper("beta1", "float", 0.9), Hyper("beta2", "float", 0.99), Hyper("weight_decay", "float", 0.0),
        MAX_NORM, MAXIMIZE), doc=LION_DOC),
    step_op("adafactor_step_", (State("factors"),), (
        Hyper("beta2_decay", "float", -0.8), Hyper("eps1", "float?", None, none=reference_adafactor.EPS1_DEFAULT),
        Hyper("eps2", "float", 1e-3), Hyper("d", "float", 1.0), Hyper("weight_decay", "float", 0.0), MAX_NORM,
        MAXIMIZE), state_scales=False, layout="factored", reference="reference_adafactor",
        rules=reference_adafactor.check_rules, groups=(("eps", ("eps1", "eps2")),), doc=reference_adafactor.DOC),
    step_op("muon_step_", (State("momentum_buffer"),), (
        Hyper("momentum", "float", 0.95), Hyper("nesterov", "bool", True), Hyper("weight_decay", "float", 0.1),
        Hyper("ns_a", "float", reference_muon.NS_A), Hyper("ns_b", "float", reference_muon.NS_B),
        Hyper("ns_c", "float", reference_muon.NS_C), Hyper("eps", "float", reference_muon.EPS),
        Hyper("ns_steps", "SymInt", reference_muon.NS_STEPS), Hyper("adjust_lr_fn", "str?", None), MAX_NORM),
        reference="reference_muon", rules=reference_muon.check_rules,
        groups=(("ns_coefficients", ("ns_a", "ns_b", "ns_c")),), doc=reference_muon.DOC,
        split=reference_muon.SPLIT),
)}
