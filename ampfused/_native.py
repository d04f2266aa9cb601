"""Loader of the compiled modules (``ampfused._C`` for CPU, ``ampfused._C_cuda`` for CUDA) and the checks
that run in Python before any of their kernels.

The modules are torch-free: they take addresses, sizes and dtype codes. Everything that could make a
kernel read or write the wrong memory is therefore checked here, and each failed rule names the tensor.
A module that is missing, or was built from other sources than this checkout's ``csrc/``, is reported
with what it was built for and how to rebuild; it never breaks ``import ampfused``.
"""
from __future__ import annotations

import glob
import hashlib
import importlib
import os
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from . import __version__

REBUILD = "rebuild with `pip install -e .` from the ampfused checkout"
MODULES = {"cpu": "ampfused._C", "cuda": "ampfused._C_cuda"}
DTYPE_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SCALAR_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.float64: 3}
NATIVE_DTYPES = tuple(DTYPE_CODES)
ALIGN = 16  # bytes: the step kernels use 128-bit vector loads and stores

_cache: Dict[str, object] = {}
_errors: Dict[str, str] = {}


def _checkout_sources_hash() -> Optional[str]:
    """Hash of ``csrc/`` as setup.py computes it, when this package runs from a checkout (editable)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    csrc = os.path.join(root, "csrc")
    if not (os.path.isfile(os.path.join(root, "setup.py")) and os.path.isfile(os.path.join(csrc, "include", "ampfused",
                                                                                          "math.h"))):
        return None  # an installed wheel: no checkout to compare with
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(csrc):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".h", ".cuh", ".cpp", ".cu")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, csrc).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


def _describe(info: dict) -> str:
    keys = ("version", "python", "sources_hash", "cuda_runtime", "archs", "isas")
    return ", ".join(f"{k} {info[k]}" for k in keys if k in info)


def _load(kind: str):
    name = MODULES[kind]
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        here = os.path.dirname(os.path.abspath(__file__))
        others = [os.path.basename(p) for p in glob.glob(os.path.join(here, name.split(".")[-1] + ".*"))]
        found = f"; found {others}, built for another Python or platform" if others else ""
        what = "the CPU backend" if kind == "cpu" else "the CUDA backend (needs nvcc at build time)"
        raise ImportError(f"{name} ({what}) is not built ({e}){found}; {REBUILD}") from None
    info = dict(mod.build_info())
    if info.get("version") != __version__:
        raise ImportError(f"{name} is stale: built for ampfused {info.get('version')} ({_describe(info)}), "
                          f"but this is ampfused {__version__}; {REBUILD}")
    want = _checkout_sources_hash()
    if want is not None and info.get("sources_hash") != want:
        raise ImportError(f"{name} is stale: built from csrc/ sources {info.get('sources_hash')} "
                          f"({_describe(info)}), but the checkout's csrc/ is {want}; {REBUILD}")
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


# ---- checks at the native boundary ------------------------------------------------------------------

def _dtype_rule(name: str, t: Tensor, dtypes: Sequence[torch.dtype], backend: str) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]} for the {backend} backend, "
                        f"got {t.dtype}")


def check_device(name: str, t: Tensor, device: torch.device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def check_scalar(name: str, t: Tensor, dtypes: Sequence[torch.dtype], device: torch.device, backend: str) -> None:
    check_device(name, t, device)
    _dtype_rule(name, t, dtypes, backend)
    if t.dim() != 0:
        raise ValueError(f"{name} must be a 0-d tensor, got shape {tuple(t.shape)}")


def check_flat(name: str, t: Tensor, dtypes: Sequence[torch.dtype], device: torch.device, numel: int,
               backend: str) -> None:
    """A flat buffer of a step: 1-D, contiguous, ``numel`` elements, 16-byte aligned."""
    check_device(name, t, device)
    _dtype_rule(name, t, dtypes, backend)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D flat buffer, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a flat buffer), got stride {t.stride()}")
    if t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements like param, got {t.numel()}")
    if t.data_ptr() % ALIGN:
        raise ValueError(f"{name} must start at a {ALIGN}-byte aligned address for the {backend} backend "
                         f"(vector loads), got address {t.data_ptr():#x} (offset {t.storage_offset()} "
                         "elements into its storage)")


def check_step(backend: str, param: Tensor, grad: Tensor, master: Optional[Tensor], states, step: Tensor,
               partials: Tensor, inv_scale: Tensor, lr: Tensor, out_stats: Tensor) -> None:
    """Every rule a native step kernel relies on; ``states`` is a list of (name, tensor)."""
    check_device("param", param, param.device)
    dev, n = param.device, param.numel()
    check_flat("param", param, NATIVE_DTYPES, dev, n, backend)
    check_flat("grad", grad, NATIVE_DTYPES, dev, n, backend)
    if master is not None:
        check_flat("master", master, (torch.float32,), dev, n, backend)
    elif param.dtype != torch.float32:
        raise ValueError(f"param has dtype {param.dtype}: without a master buffer param must be float32 "
                         "(pass an fp32 master=...)")
    for sname, s in states:
        check_flat(sname, s, (torch.float32,), dev, n, backend)
    check_scalar("step", step, tuple(SCALAR_CODES), dev, backend)
    check_scalar("lr", lr, tuple(SCALAR_CODES), dev, backend)
    check_scalar("inv_scale", inv_scale, (torch.float32,), dev, backend)
    check_device("partials", partials, dev)
    _dtype_rule("partials", partials, (torch.float32,), backend)
    if partials.dim() != 2 or partials.shape[0] != 2:
        raise ValueError(f"partials must have shape [2, P], got {tuple(partials.shape)}")
    check_device("out_stats", out_stats, dev)
    _dtype_rule("out_stats", out_stats, (torch.float32,), backend)
    if out_stats.numel() != 2 or not out_stats.is_contiguous():
        raise ValueError(f"out_stats must be a contiguous [2] tensor, got shape {tuple(out_stats.shape)} "
                         f"stride {out_stats.stride()}")
    bufs = [("param", param), ("grad", grad), ("master", master)] + list(states)
    spans = [(nm, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for nm, t in bufs
             if t is not None and t.numel()]
    for i, (na, a0, a1) in enumerate(spans):
        for nb, b0, b1 in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{na} and {nb} must not overlap in memory (the step writes {na} while "
                                 f"reading {nb})")


def check_grads(grads, inv_scale: Tensor, backend: str) -> None:
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise TypeError(f"grads must be a list of tensors, got {type(grads).__name__}")
    check_scalar("inv_scale", inv_scale, (torch.float32,), inv_scale.device, backend)
    for i, g in enumerate(grads):
        check_device(f"grads[{i}]", g, inv_scale.device)
        _dtype_rule(f"grads[{i}]", g, NATIVE_DTYPES, backend)


def partials_arg(partials: Tensor) -> Tensor:
    """The partials as the kernels read them: row-major [2, P] contiguous (a copy only if needed)."""
    return partials if partials.is_contiguous() else partials.contiguous()


def ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()
