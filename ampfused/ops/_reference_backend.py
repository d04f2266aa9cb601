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
    adam_step_ = staticmethod(reference.adam_step_)
    sgd_step_ = staticmethod(reference.sgd_step_)
    lion_step_ = staticmethod(reference.lion_step_)
    adafactor_step_ = staticmethod(reference.adafactor_step_)


BACKEND = ReferenceBackend()
