"""Where a result was measured: device name, versions, commit, and the file name derived from them."""
from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata

import torch

from ampfused.info import cpu_name

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Results go outside the checkout unless asked (committing a run under bench/results is a deliberate choice).
RESULTS = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                       "ampfused", "bench")


def device_name(device: torch.device) -> str:
    """Human-readable device: the GPU's name, or the CPU model with the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{cpu_name()} ({torch.get_num_threads()} threads)"
    return device.type


def device_stem(device: torch.device) -> str:
    """File-name stem for a device, e.g. ``cpu-Intel-Xeon-2.50GHz`` or ``NVIDIA-H100-80GB-HBM3``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        short = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@", " ", cpu_name()) if device.type == "cpu" else ""
        name = f"{device.type}-{short}" if short.strip() else device.type
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")


def triton_version() -> str:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "n/a"


def git_sha() -> str:
    """Short commit of the checkout, with ``+dirty`` when tracked files differ from it (read-only git)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"
    return (sha + ("+dirty" if dirty else "")) if sha else "n/a"


def describe(device: torch.device) -> dict:
    return dict(device=device_name(device), torch=torch.__version__, triton=triton_version(), git_sha=git_sha())
