"""Loader of the compiled modules (``ampfused._C`` for CPU, ``ampfused._C_cuda`` for CUDA, ``ampfused._host``
for the optimizers' host pass) and the codes their arguments take.

The kernel modules are torch-free: they take addresses, sizes and dtype codes. The checks that keep a kernel from
reading or writing the wrong memory run before any of them, on the backends' side (``ops.native_args``).
``ampfused._host`` is built against torch and loads only with the torch it was built for.
A module that is missing, or was built from other sources than this checkout's ``csrc/``, is reported
with what it was built for and how to rebuild; it never breaks ``import ampfused``.
"""
from __future__ import annotations

import glob
import importlib
import os
from typing import Dict, Optional

import torch
from torch import Tensor

from . import __version__, _sources

REBUILD = "rebuild with `pip install -e .` from the ampfused checkout"
MODULES = {"cpu": "ampfused._C", "cuda": "ampfused._C_cuda", "host": "ampfused._host"}
DTYPE_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SCALAR_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.float64: 3}
NATIVE_DTYPES = tuple(DTYPE_CODES)
# storage codes of the moments (StepArgs::state_dtype): fp32, bf16 (16-bit moments), uint8 (8-bit moments)
STATE_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 4}
NO_GRAD = -1  # numel of a table row whose parameter has no gradient this step (step_args.h: kNoGrad)

_cache: Dict[str, object] = {}
_errors: Dict[str, str] = {}


def _checkout_sources_hash(kind: str) -> Optional[str]:
    """Hash of the ``csrc/`` folders module ``kind`` is built from, as setup.py stamps it, when this package runs
    from a checkout (editable)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    csrc = os.path.join(root, "csrc")
    if not (os.path.isfile(os.path.join(root, "setup.py")) and os.path.isfile(os.path.join(csrc, "include", "ampfused",
                                                                                          "math.h"))):
        return None  # an installed wheel: no checkout to compare with
    return _sources.sources_hash(csrc, kind)


def _describe(info: dict) -> str:
    keys = ("version", "python", "torch", "sources_hash", "cuda_runtime", "archs", "isas")
    return ", ".join(f"{k} {info[k]}" for k in keys if k in info)


def _load(kind: str):
    name = MODULES[kind]
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        here = os.path.dirname(os.path.abspath(__file__))
        others = [os.path.basename(p) for p in glob.glob(os.path.join(here, name.split(".")[-1] + ".*"))]
        found = f"; found {others}, built for another Python or platform" if others else ""
        what = {"cpu": "the CPU backend", "cuda": "the CUDA backend (needs nvcc at build time)",
                "host": "the optimizers' host pass (needs torch at build time: pip install --no-build-isolation)"}[kind]
        raise ImportError(f"{name} ({what}) is not built ({e}){found}; {REBUILD}") from None
    info = dict(mod.build_info())
    if info.get("version") != __version__:
        raise ImportError(f"{name} is stale: built for ampfused {info.get('version')} ({_describe(info)}), "
                          f"but this is ampfused {__version__}; {REBUILD}")
    want = _checkout_sources_hash(kind)
    if want is not None and info.get("sources_hash") != want:
        raise ImportError(f"{name} is stale: built from csrc/ sources {info.get('sources_hash')} "
                          f"({_describe(info)}), but the checkout's csrc/ is {want}; {REBUILD}")
    if kind == "host" and info.get("torch") != torch.__version__:
        raise ImportError(f"{name} was built against torch {info.get('torch')} but this is torch {torch.__version__}; "
                          f"{REBUILD}")
    if kind == "cpu" and os.environ.get("AMPFUSED_CPU_ISA"):
        mod.set_isa(os.environ["AMPFUSED_CPU_ISA"])
    return mod


def module(kind: str):
    """The compiled module for ``kind`` ('cpu' or 'cuda'); raises ImportError saying why it cannot load."""
    if kind not in _cache:
        if kind in _errors:
            raise ImportError(_errors[kind])
        try:
            _cache[kind] = _load(kind)
        except ImportError as e:
            _errors[kind] = str(e)
            raise
    return _cache[kind]


def optional(kind: str):
    """The compiled module for ``kind``, or None where it cannot load (its callers have a Python path)."""
    try:
        return module(kind)
    except ImportError:
        return None


def unavailable_reason(kind: str) -> Optional[str]:
    try:
        module(kind)
    except ImportError as e:
        return str(e)
    return None


def build_info(kind: str) -> Optional[dict]:
    try:
        return dict(module(kind).build_info())
    except ImportError:
        return None


# ---- the kernels' arguments ------------------------------------------------------------------------

def compact_args(param_dtype, master: Optional[Tensor], state: Optional[Tensor], seed: Optional[Tensor]) -> tuple:
    """The kernels' compact-state arguments for buffers a fused optimizer built itself (no checks): ``state`` any
    moment buffer of the step (or None)."""
    if master is not None and master.dtype == torch.int16:
        fmt = 1
    elif master is None and seed is not None and param_dtype == torch.bfloat16:
        fmt = 2
    else:
        fmt = 0
    code = STATE_CODES.get(state.dtype, 0) if state is not None else 0
    return fmt, code, ptr(seed)


def ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()

