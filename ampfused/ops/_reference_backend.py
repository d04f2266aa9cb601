"""The reference ops as a registry backend: runs anywhere torch runs, and is the fallback of last resort."""
import importlib

import torch

from . import reference, specs
from .registry import Backend


def step_function(op: str):
    """Step op ``op``'s reference function: in the module its record names (``OpSpec.reference``), or None."""
    spec = specs.SPECS.get(op)
    if spec is None or not spec.is_step:
        return None
    return getattr(importlib.import_module(f"{__package__}.{spec.reference}"), op, None)


def shard_function(op: str):
    """The reference function of step op ``op``'s phases over shards (``<op>shard_``: a factored step split at
    its sums over whole parameters), or None."""
    spec = specs.SPECS.get(op)
    if spec is None or not spec.is_step:
        return None
    return getattr(importlib.import_module(f"{__package__}.{spec.reference}"), op + "shard_", None)


class ReferenceBackend(Backend):
    name = "reference"
    devices = ("cpu", "cuda", "meta", "mps", "xpu")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    num_partials = staticmethod(reference.num_partials)
    norm_check = staticmethod(reference.norm_check)
    unscale_ = staticmethod(reference.unscale_)
    update_scale_ = staticmethod(reference.update_scale_)

    def step(self, call) -> None:
        """Every step op is its reference function (the specification; the module its record names)."""
        if call.table is not None or call.options:
            raise TypeError(f"the reference backend takes a step's tensors, without options (got "
                            f"{'a table' if call.table is not None else sorted(call.options)})")
        if call.shard is not None:
            if call.health is not None:
                raise NotImplementedError("the health sums of a step in phases over shards are not computed")
            phase, sums = call.shard
            shard_function(call.spec.name)(*call.op_args(), **call.compact_kwargs(), phase=phase, shard=sums)
            return
        step_function(call.spec.name)(*call.op_args(), **call.compact_kwargs())

    def has_step(self, op: str) -> bool:
        return step_function(op) is not None

    def computes_health(self, op: str) -> bool:
        return self.has_step(op)


BACKEND = ReferenceBackend()
