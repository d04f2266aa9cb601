"""The ops as ``torch.library`` custom ops (``torch.ops.ampfused.*``), each with a fake implementation, made
from the records in :mod:`ampfused.ops.specs`: schema, written arguments and fake all come from the record.

The backend is resolved in Python before the op is called and passed by name, so a compiled graph holds
one opaque call per op and a step under ``torch.compile(fullgraph=True)`` has no graph break.

An argument an op writes has no default value (``state_scales`` of the step ops may be ``None`` but must be
given): the dispatcher drops trailing arguments equal to their defaults before it calls a Python kernel, and
torch before 2.13 bumps the version of each written argument by its position, so a dropped one raised
IndexError (under autograd's in-place kernel, dispatch modes, ``opcheck``).
"""
from __future__ import annotations

from typing import Dict

import torch

from .call import StepCall
from .registry import get_backend
from .specs import SPECS, OpSpec


def _bind(spec: OpSpec, args: tuple, kwargs: dict) -> tuple:
    """Every argument in schema order: trailing ones the dispatcher dropped (equal to their default, ``None``)
    put back, any passed by name put in place."""
    names = spec.arg_names
    return tuple(args) + tuple(kwargs.get(n) for n in names[len(args):])


def _kernel(spec: OpSpec):
    b = spec.arg_names.index("backend")
    after = spec.arg_names[b + 1:]

    def kernel(*args, **kwargs):
        args = _bind(spec, args, kwargs)
        # those after the backend (the compact state's) go by name and only when given: a backend written
        # before them keeps its signature
        kw = {n: a for n, a in zip(after, args[b + 1:]) if a is not None}
        if spec.is_step:
            return StepCall.of_op(spec, args[:b], kw).run_on(get_backend(args[b]))
        return getattr(get_backend(args[b]), spec.name)(*args[:b], **kw)

    kernel.__name__ = kernel.__qualname__ = spec.name
    return kernel


def _partials(grads, inv_scale, backend):
    return inv_scale.new_empty(2, get_backend(backend).num_partials([g.numel() for g in grads]))


FAKES = {"partials": _partials}  # the fake implementations the records name (OpSpec.fake)


def _fake(spec: OpSpec):
    impl = None if spec.fake is None else FAKES[spec.fake]

    def fake(*args, **kwargs):
        return None if impl is None else impl(*_bind(spec, args, kwargs))
    return fake


def _define(spec: OpSpec) -> torch.library.CustomOpDef:
    op = torch.library.custom_op(f"ampfused::{spec.name}", _kernel(spec), schema=spec.schema(),
                                 mutates_args=tuple(spec.arg_names[i] for i in spec.written))
    op.register_fake(_fake(spec))
    return op


OPS: Dict[str, torch.library.CustomOpDef] = {name: _define(spec) for name, spec in SPECS.items()}
