"""One step call, as every backend takes it: ``Backend.step(call)`` is the one door from an op or an optimizer to
a step kernel.

A call carries its op's record (:mod:`ampfused.ops.specs`), the tensors in the record's terms (the state buffers
by name, the hyperparameters by name), and where the parameters and gradients come from: either the tensors
(``params``, ``grads``: the public ops, the custom ops, an optimizer on its Python path) or a fused optimizer's
tensor table (``table``: ``(address, rows, array[, stamps])``, written by ``ampfused._host`` after its checks,
every parameter and gradient of dtype ``dtype``; only for a backend with ``takes_tables``; a split step's table
call carries the tensors too, for the function between its passes). A factored step over
the shards of parameters split over ranks runs in phases: ``shard`` is ``(phase, ShardSums)``
(:class:`ampfused.ops.factored.ShardSums`), from the tensors. ``health`` (fp64 ``[5]``, optional; only for a
backend whose ``computes_health`` says so) receives the step's training-health sums
(:class:`ampfused.ops.reference_common.HealthSums`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import Tensor

from .specs import OpSpec


class StepCall:
    __slots__ = ("spec", "params", "grads", "table", "dtype", "master", "states", "steps", "partials", "inv_scale",
                 "lr", "out_stats", "hyper", "seed", "state_scales", "options", "shard", "health")

    def __init__(self, spec: OpSpec, *, master: Optional[Tensor], states: Dict[str, Optional[Tensor]],
                 steps: Tensor, partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor,
                 hyper: Dict[str, object], params=None, grads=None, table: Optional[tuple] = None, dtype=None,
                 seed: Optional[Tensor] = None, state_scales: Optional[Tensor] = None,
                 options: Optional[dict] = None, shard: Optional[tuple] = None, health: Optional[Tensor] = None):
        self.spec = spec
        self.params, self.grads, self.table, self.dtype = params, grads, table, dtype
        self.master, self.states = master, states
        self.steps, self.partials, self.inv_scale, self.lr, self.out_stats = steps, partials, inv_scale, lr, out_stats
        self.hyper = hyper
        self.seed, self.state_scales = seed, state_scales
        self.options = options or {}
        self.shard = shard
        self.health = health

    @classmethod
    def of_op(cls, spec: OpSpec, args: tuple, kw: dict) -> "StepCall":
        """The call of op ``spec`` from its arguments in schema order up to the backend (``args``) and those after
        it or a backend's options by name (``kw``: ``seed``, ``state_scales``, ``single_launch``, ...)."""
        n, m = len(spec.states), len(spec.hypers)
        params, grads, master = args[0], args[1], args[2]
        states = dict(zip((s.name for s in spec.states), args[3:3 + n]))
        steps, partials, inv_scale, lr, out_stats = args[3 + n:8 + n]
        kw = dict(kw)
        # the hyperparameters by position or name (a trailing one left out: its record's default), then the
        # compact state's by position or name
        hyper = {h.name: kw.pop(h.name, h.default) for h in spec.hypers}
        hyper.update(zip((h.name for h in spec.hypers), args[8 + n:8 + n + m]))
        after = dict(zip(("seed", "state_scales"), args[8 + n + m:]))
        seed = kw.pop("seed", after.get("seed"))
        state_scales = kw.pop("state_scales", after.get("state_scales"))
        return cls(spec, params=params, grads=grads, master=master, states=states, steps=steps, partials=partials,
                   inv_scale=inv_scale, lr=lr, out_stats=out_stats, hyper=hyper, seed=seed,
                   state_scales=state_scales, options=kw)

    def op_args(self) -> tuple:
        """The op's arguments in schema order up to the backend (a call from tensors only)."""
        return (self.params, self.grads, self.master, *(self.states.get(s.name) for s in self.spec.states),
                self.steps, self.partials, self.inv_scale, self.lr, self.out_stats,
                *(self.hyper[h.name] for h in self.spec.hypers))

    def compact_kwargs(self) -> dict:
        """The arguments after the backend, given only when set (a backend without compact state keeps its
        signature)."""
        kw = {}
        if self.seed is not None:
            kw["seed"] = self.seed
        if self.state_scales is not None:
            kw["state_scales"] = self.state_scales
        if self.health is not None:
            kw["health"] = self.health
        return kw

    def used_states(self) -> List[Tuple[str, Optional[Tensor]]]:
        """``(name, buffer)`` of each state in the record's order, ``None`` for one this step does not read (a
        ``needed_if`` hyperparameter at 0); a needed state that is missing is an error, named."""
        out = []
        for s in self.spec.states:
            t = self.states.get(s.name)
            if s.needed_if is not None and self.hyper[s.needed_if] == 0:
                t = None
            elif t is None and not s.optional or s.needed_if is not None and t is None:
                raise ValueError(f"{s.name} is required" + (f" when {s.needed_if} != 0" if s.needed_if else ""))
            out.append((s.name, t))
        return out

    def resolved(self, name: str):
        """Hyperparameter ``name`` as given, an optional one's ``None`` as its record's ``none``."""
        v = self.hyper[name]
        return self.spec.hyper_none[name] if v is None else v

    def hyper_values(self, names) -> List[float]:
        """The hyperparameters ``names`` (in that order: the order a kernel reads them) as floats (bools as 0 / 1,
        ``None`` resolved): the native modules' arguments."""
        return [float(self.resolved(n)) for n in names]

    def hyper_args(self) -> list:
        """The hyperparameters in the record's order (``None`` resolved): the Triton launchers' arguments."""
        return [self.resolved(h.name) for h in self.spec.hypers]

    def run_on(self, backend) -> None:
        """This call on ``backend`` (an object). A step whose record splits it (``OpSpec.split``: two elementwise
        passes around a function of whole tensors) runs as phase 1, that function, phase 2, on a backend other
        than the reference (whose function is the whole step); a call that names its phase runs that phase."""
        split = self.spec.split
        if split is None or self.shard is not None or backend.name == "reference":
            backend.step(self)
            return
        scratch = split.scratch(self)
        try:
            self.shard = (1, scratch)
            backend.step(self)
            split.between(self, scratch)
            self.shard = (2, scratch)
            backend.step(self)
        finally:
            self.shard = None

    def tensors_written(self) -> List[Tensor]:
        """What the step writes (the parameters that have a gradient among them), for version counters."""
        out = [p for p, g in zip(self.params, self.grads) if g is not None] if self.params is not None else []
        out += [t for t in (self.master, *(t for _, t in self.used_states()), self.steps, self.out_stats,
                            self.state_scales, self.health) if t is not None]
        if self.shard is not None:
            out += self.shard[1].written
        return out
