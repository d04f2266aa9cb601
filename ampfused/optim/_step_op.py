"""An optimizer's step op: the one place where the fused optimizers (and their ZeRO-1 sharded versions) call a
step kernel. The optimizer's math class names its op (``step_op``, a record of :mod:`ampfused.ops.specs`) and its
hyperparameters of a group (``_op_hyper``); this builds the :class:`~ampfused.ops.call.StepCall` of a segment, from
its tensors or from its tensor table, and runs it through :func:`ampfused.ops.run_step`."""
from __future__ import annotations

from typing import Dict

from .. import ops
from ..ops.call import StepCall


class StepOp:
    step_op: str = ""  # the op's name in ops.specs.SPECS
    op_states: Dict[str, str] = {}  # the op's state names that the optimizer's state calls otherwise

    def _op_for(self, group: dict) -> str:
        """The step op of ``group``'s segments: ``step_op``, but in an optimizer whose groups step by different
        ops (one with AdamW's groups beside its own)."""
        return self.step_op

    def _op_hyper(self, group: dict) -> dict:
        """The op's hyperparameters but ``max_norm``, from a param group, as the kernels take them."""
        raise NotImplementedError

    def _step_call(self, seg, group: dict, partials, inv_scale, lr, max_norm: float, **source) -> StepCall:
        """The step of segment ``seg``; ``source``: its ``params`` and ``grads``, or its ``table`` and ``dtype``."""
        spec = ops.specs.SPECS[self._op_for(group)]
        hyper = self._op_hyper(group)
        hyper["max_norm"] = max_norm
        names = self.op_states
        call = StepCall(spec, master=seg.master, states={s.name: seg.states.get(names.get(s.name, s.name))
                                                         for s in spec.states},
                        steps=seg.steps, partials=partials, inv_scale=inv_scale, lr=lr, out_stats=self._stats,
                        hyper=hyper, seed=getattr(seg, "seed", None), state_scales=getattr(seg, "scales", None),
                        health=self._health.row(seg) if getattr(self, "health_enabled", False) else None, **source)
        if call.state_scales is not None and all(t is None for _, t in call.used_states()):
            call.state_scales = None  # (no moment is read this step: SGD without momentum)
        return call

    def _step_op(self, seg, params, grads, group: dict, partials, inv_scale, lr, max_norm: float,
                 backend: str) -> None:
        """K2 over one segment from its tensors (the Python path) on backend ``backend`` (a name)."""
        ops.run_step(self._step_call(seg, group, partials, inv_scale, lr, max_norm, params=params, grads=grads),
                     backend)

    def _step_op_table(self, seg, backend, group: dict, partials, inv_scale, lr, max_norm: float) -> None:
        """K2 over one segment from its tensor table (the host pass's path) on ``backend`` (a backend object). A
        split step (``OpSpec.split``) also carries the segment's tensors: its function between the passes reads
        their shapes and which have a gradient (the ones the host pass wrote into the table)."""
        source = dict(table=seg.step_table(), dtype=seg.dtype)
        if ops.specs.SPECS[self._op_for(group)].split is not None:
            source.update(params=seg.params, grads=[p.grad for p in seg.params])
        ops.run_step(self._step_call(seg, group, partials, inv_scale, lr, max_norm, **source), backend.name)
