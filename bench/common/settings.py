"""The process-wide torch settings a benchmark sets for its run (threads, deterministic algorithms, cuDNN and
TF32 switches, attention kernels), put back when its ``main`` returns: a run started from Python (a test, a
notebook, another tool) leaves the process as it found it."""
from __future__ import annotations

import functools
import os

import torch

_CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"


def _read() -> dict:
    b = torch.backends
    saved = dict(threads=torch.get_num_threads(), deterministic=torch.are_deterministic_algorithms_enabled(),
                 warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
                 cudnn=(b.cudnn.benchmark, b.cudnn.deterministic, b.cudnn.allow_tf32),
                 matmul_tf32=b.cuda.matmul.allow_tf32, cublas=os.environ.get(_CUBLAS_ENV))
    saved["sdp"] = (b.cuda.flash_sdp_enabled(), b.cuda.mem_efficient_sdp_enabled(), b.cuda.cudnn_sdp_enabled())
    return saved


def _restore(saved: dict) -> None:
    # Only what the run changed is set back: torch.testing (imported by the suite of torch's optimizer tests)
    # freezes the cuDNN flags, and setting one then raises even to its own value.
    now = _read()
    b = torch.backends
    if now["threads"] != saved["threads"]:
        torch.set_num_threads(saved["threads"])
    if (now["deterministic"], now["warn_only"]) != (saved["deterministic"], saved["warn_only"]):
        torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["warn_only"])
    if now["cudnn"] != saved["cudnn"]:
        b.cudnn.benchmark, b.cudnn.deterministic, b.cudnn.allow_tf32 = saved["cudnn"]
    if now["matmul_tf32"] != saved["matmul_tf32"]:
        b.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
    if now["sdp"] != saved["sdp"]:
        for enable, on in zip((b.cuda.enable_flash_sdp, b.cuda.enable_mem_efficient_sdp, b.cuda.enable_cudnn_sdp),
                              saved["sdp"]):
            enable(on)
    if saved["cublas"] is None:
        os.environ.pop(_CUBLAS_ENV, None)
    else:
        os.environ[_CUBLAS_ENV] = saved["cublas"]


def restores_torch_settings(main):
    """Decorator of a benchmark's ``main``: the settings above as they were before it, whatever it set."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        saved = _read()
        try:
            return main(*args, **kwargs)
        finally:
            _restore(saved)
    return run
