"""What the GPU probe's stages share (``python -m bench.gpu.probe``): the report of checks and measurements,
device and backend choice, and bitwise / tolerance comparisons that report rather than raise."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from typing import Dict, List, Optional, Sequence

SKIP_EXIT = 3


# ---------------------------------------------------------------------------------------------- reporting

class Report:
    """Named checks (each one runs on, whatever the others did), measurements and notes of one probe."""

    def __init__(self, probe: str, device: str) -> None:
        self.probe, self.device = probe, device
        self.checks: List[dict] = []
        self.metrics: Dict[str, object] = {}
        self.notes: List[str] = []
        self.skip_reason: Optional[str] = None

    @contextlib.contextmanager
    def check(self, name: str):
        """Run the body as the check ``name``: an exception fails it (with its message) and is not raised."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any error is this check's failure
            msg = f"{type(e).__name__}: {e}".strip()
            self.checks.append(dict(name=name, ok=False, error=_clip(msg, 2000),
                                    seconds=round(time.perf_counter() - t0, 3)))
            print(f"FAIL {name}: {_clip(msg, 500)}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
        else:
            self.checks.append(dict(name=name, ok=True, seconds=round(time.perf_counter() - t0, 3)))
            print(f"ok   {name}", flush=True)

    def fail(self, name: str, why: str) -> None:
        self.checks.append(dict(name=name, ok=False, error=why, seconds=0.0))
        print(f"FAIL {name}: {why}", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note {text}", flush=True)

    def skip(self, reason: str) -> None:
        self.skip_reason = reason

    def finish(self, json_path: Optional[str]) -> int:
        failed = [c["name"] for c in self.checks if not c["ok"]]
        if self.skip_reason is not None and not self.checks:
            status, code = "skip", SKIP_EXIT
            line = f"probe {self.probe}: SKIP: {self.skip_reason}"
        elif failed:
            status, code = "fail", 1
            line = f"probe {self.probe}: FAILED {len(failed)} of {len(self.checks)} checks: {', '.join(failed)}"
        elif not self.checks:
            status, code = "fail", 1
            line = f"probe {self.probe}: FAILED: no check ran"
        else:
            status, code = "ok", 0
            line = f"probe {self.probe}: ok ({len(self.checks)} checks on {self.device})"
        if json_path:
            with open(json_path, "w") as f:
                json.dump(dict(probe=self.probe, device=self.device, status=status, reason=self.skip_reason,
                               summary=line, checks=self.checks, metrics=self.metrics, notes=self.notes), f,
                          indent=1, default=str)
        print(line, flush=True)
        return code


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " [...]"


# ------------------------------------------------------------------------------------------------ helpers

def _torch():
    import torch
    return torch


def pick_device(name: Optional[str]):
    torch = _torch()
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no CUDA device")
    return device


def default_backends(device) -> List[str]:
    """The fast backends this probe checks on ``device``: cuda and triton on a GPU; on the CPU the native
    backend, and Triton when its interpreter is on (``TRITON_INTERPRET=1``)."""
    if device.type == "cuda":
        return ["cuda", "triton"]
    return ["cpu"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def usable_backends(rep: Report, device, wanted: Optional[Sequence[str]]) -> List[str]:
    """The backends of ``wanted`` that can run on ``device``; each one that cannot is a failed check (on a GPU
    machine both GPU backends are expected to run: one missing is what this check is for)."""
    from ampfused import ops
    out = []
    for b in wanted or default_backends(device):
        reasons = ops.registry.reasons_for(b, device)
        if reasons:
            rep.fail(f"backend {b} on {device.type}", "cannot run: " + "; ".join(reasons))
        else:
            out.append(b)
    return out


def sync(device) -> None:
    torch = _torch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def placed(values, shape, layout: str, dtype, device):
    """A tensor of ``shape`` laid out as ``layout`` (plain, channels_last, transposed, offset: one element
    into its storage, so not 16-byte aligned) whose elements in memory order are ``values`` (1-D)."""
    torch = _torch()
    from ampfused.ops import memory_view
    n = math.prod(shape)
    if layout == "channels_last":
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    elif layout == "transposed":
        t = torch.empty(shape[::-1], dtype=dtype, device=device).t()
    elif layout == "offset":
        t = torch.empty(n + 1, dtype=dtype, device=device)[1:].view(shape)
    else:
        t = torch.empty(shape, dtype=dtype, device=device)
    memory_view(t).copy_(values.reshape(-1).to(device=device, dtype=dtype))
    return t


def assert_bitwise(what: str, a, b) -> None:
    torch = _torch()
    a, b = a.detach(), b.detach()
    if a.device != b.device:
        b = b.to(a.device)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    if not bool(same.all()):
        bad = (~same).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {int(bad.shape[0])} of {a.numel()} elements differ, first at {first}: "
                             f"{a[first].item()!r} vs {b[first].item()!r}")


def assert_close(what: str, a, b, rtol: float, atol: float) -> None:
    torch = _torch()
    a, b = a.detach().float(), b.detach().float()
    if a.device != b.device:
        b = b.to(a.device)
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


AWKWARD_SPECS = [  # (shape, layout, has a gradient, initial step count)
    ((1,), "plain", True, 3), ((7,), "plain", True, 0), ((127,), "offset", True, 1), ((16385,), "plain", True, 0),
    ((65537,), "plain", True, 5), ((2, 3, 5, 7), "channels_last", True, 2), ((300,), "plain", False, 4),
    ((45, 67), "transposed", True, 0), ((1000,), "offset", True, 0),
]
