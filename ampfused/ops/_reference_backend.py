"""The reference ops as a registry backend: runs anywhere torch runs, and is the fallback of last resort."""
import torch

from . import reference
from .registry import Backend


class ReferenceBackend(Backend):
    name = "reference"
    devices = ("cpu", "cuda", "meta", "mps", "xpu")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    num_partials = staticmethod(reference.num_partials)
    norm_check = staticmethod(reference.norm_check)
    unscale_ = staticmethod(reference.unscale_)
    update_scale_ = staticmethod(reference.update_scale_)

    def step(self, call) -> None:
        """Every step op is its function in :mod:`ampfused.ops.reference` (the specification)."""
        if call.table is not None or call.options:
            raise TypeError(f"the reference backend takes a step's tensors, without options (got "
                            f"{'a table' if call.table is not None else sorted(call.options)})")
        getattr(reference, call.spec.name)(*call.op_args(), **call.compact_kwargs())

    def has_step(self, op: str) -> bool:
        return hasattr(reference, op)


BACKEND = ReferenceBackend()
