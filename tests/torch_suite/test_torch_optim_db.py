"""PyTorch's own optimizer test material (``optim_db`` in torch.testing._internal.common_optimizers) against
the fused optimizers: every ``optim_inputs_func`` configuration of Adam, AdamW, SGD, Adafactor and Muon (the CUDA-only
ones too, their kwargs run on CPU tensors), fp32 and bf16 parameters with fp32 masters, a few steps against torch's
optimizer on the same values within the design tolerance; and every ``optim_error_inputs_func`` entry with
torch's exception type and message. A documented refusal (suite_helpers.DOCUMENTED_REFUSALS) must be refused
with its error; everything else must behave as torch."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

from suite_helpers import (FUSED, MATRICES, MATRIX_SHAPES, backends_to_run, compare_with_torch, make_params, on_cpu,
                           optim_db_entries, refusal_of)

ENTRIES = optim_db_entries()


def _configs():
    out = []
    for info in ENTRIES:
        seen = set()
        for device in ("cpu", "cuda"):
            for oi in info.optim_inputs_func(device=device):
                key = (oi.desc, repr(sorted(oi.kwargs.items(), key=lambda kv: kv[0])))
                if key in seen:
                    continue
                seen.add(key)
                out.append(pytest.param(info.optim_cls, {k: on_cpu(v) for k, v in oi.kwargs.items()},
                                        id=f"{info.optim_cls.__name__}-{device}-{oi.desc}"))
    return out


CONFIGS = _configs()


def test_the_material_covers_what_the_suite_claims():
    names = {info.optim_cls.__name__ for info in ENTRIES}
    assert names == {"Adam", "AdamW", "SGD", "Adafactor", "Muon"}
    descs = {p.id for p in CONFIGS}
    assert any("Tensor betas" in d for d in descs) and any("capturable" in d for d in descs)
    assert len(CONFIGS) >= 25  # 5 + 10 per Adam class, 9 for SGD in torch 2.13 (CPU and CUDA, deduplicated)


@pytest.mark.parametrize("torch_cls,kwargs", CONFIGS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_configuration_matches_torch(torch_cls, kwargs, param_dtype):
    refusal = refusal_of(kwargs)
    if refusal is not None:
        error, message = refusal
        with pytest.raises(error, match=message):
            FUSED[torch_cls](make_params(param_dtype), **kwargs)
        return
    compare_with_torch(torch_cls, kwargs, param_dtype, name=f"{torch_cls.__name__} {kwargs}")


@pytest.mark.parametrize("backend", [b for b in backends_to_run() if b is not None] or
                         [pytest.param("triton", marks=pytest.mark.skip(reason="triton cannot run here"))])
@pytest.mark.parametrize("torch_cls,kwargs", [c for c in CONFIGS if refusal_of(c.values[1]) is None
                                              and c.values[0] not in MATRICES][::3])  # (Muon: no kernels yet)
def test_configuration_matches_torch_under_triton(torch_cls, kwargs, backend):
    """Every third configuration again on the Triton kernels (the interpreter on CPU tensors)."""
    compare_with_torch(torch_cls, kwargs, torch.bfloat16, steps=2, backend=backend,
                       name=f"{torch_cls.__name__} {kwargs} on {backend}")


def _error_inputs():
    out = []
    for info in ENTRIES:
        for k, ei in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            out.append(pytest.param(info.optim_cls, ei, id=f"{info.optim_cls.__name__}-{k}-"
                                    f"{ei.optimizer_error_input.desc}"))
    return out


@pytest.mark.parametrize("torch_cls,error_input", _error_inputs())
def test_error_input_fails_as_in_torch(torch_cls, error_input):
    """As torch's test_errors: the same exception type (or warning) matched by torch's own regex."""
    from torch.testing._internal.common_optimizers import OptimizerErrorEnum
    oi = error_input.optimizer_error_input
    params = oi.params if oi.params is not None else make_params(
        torch.float32, shapes=MATRIX_SHAPES if torch_cls in MATRICES else ((5, 3), (7,), ()))
    cls = {**FUSED, **MATRICES}[torch_cls]
    if error_input.error_on == OptimizerErrorEnum.STEP_ERROR:
        # (Adafactor's complex parameters: refused by the constructor here, before any step, with torch's error)
        with pytest.raises(error_input.error_type, match=error_input.error_regex):
            cls(params, **oi.kwargs).step()
        return
    assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR
    if issubclass(error_input.error_type, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(params, **oi.kwargs)
        matched = [w for w in caught if issubclass(w.category, error_input.error_type)
                   and re.search(error_input.error_regex, str(w.message))]
        assert matched, f"no {error_input.error_type.__name__} matching {error_input.error_regex!r}: {caught}"
    else:
        with pytest.raises(error_input.error_type, match=error_input.error_regex):
            cls(params, **oi.kwargs)
