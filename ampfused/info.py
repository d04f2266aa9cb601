"""``python -m ampfused.info``: versions, the device, the native modules built, and which backend can run
each op here (with every reason where one cannot)."""
from __future__ import annotations

import platform
import re
import shutil
import subprocess
from typing import List, Tuple

import torch

from . import __version__, _native
from .ops import registry, specs

# num_partials is no custom op, but every backend answers it and the step's shapes depend on it
OPS = ("num_partials",) + tuple(specs.SPECS)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception as e:  # not installed, or broken
        return f"unavailable ({type(e).__name__})"


def _nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return "not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{nvcc} (failed: {e})"
    m = re.search(r"release (\S+),", out)
    return f"{m.group(1) if m else 'unknown'} ({nvcc})"


def cpu_name() -> str:
    """The CPU's model name (the benchmark names its result files after it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _devices() -> List[str]:
    rows = [f"cpu: {cpu_name()}, {torch.get_num_threads()} torch threads"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append(f"cuda:{i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
                        f"{p.multi_processor_count} SMs")
    else:
        rows.append("cuda: none visible to torch")
    return rows


def _native_rows() -> List[str]:
    rows = []
    for kind, name in _native.MODULES.items():
        why = _native.unavailable_reason(kind)
        if why:
            rows.append(f"{name}: not usable: {why}")
            continue
        info = _native.build_info(kind)
        extra = ""
        if kind == "cpu":
            mod = _native.module(kind)
            extra = f"; running {mod.isa()} kernels (this CPU supports {mod.supported_isas()})"
        compilers = f"compiler {info.get('compiler')}" + (f", nvcc {info['nvcc']}" if "nvcc" in info else "")
        rows.append(f"{name}: built ({_native._describe(info)}, {compilers}){extra}")
    return rows


NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False)"


def op_table() -> List[Tuple[str, str, str, str]]:
    """(op, backend, device, 'ok' or the reasons it cannot run there) for every op x backend x device."""
    devices = [torch.device("cpu"), torch.device("cuda")]
    rows = []
    for name in registry.registered_backends():
        for dev in devices:
            reasons = registry.reasons_for(name, dev, DTYPES)
            if dev.type == "cuda" and not torch.cuda.is_available():
                reasons = [NO_CUDA]  # whatever else a backend says, nothing runs on a device that is not there
            b = None if reasons and reasons[0].startswith("cannot import") else registry.get_backend(name)
            for op in OPS:
                why = list(reasons)
                step = op in specs.SPECS and specs.SPECS[op].is_step
                if b is not None and not why and not (b.has_step(op) if step else hasattr(b, op)):
                    why.append(f"backend {name!r} does not implement {op}")
                rows.append((op, name, dev.type, "ok" if not why else "; ".join(why)))
    return rows


def report() -> str:
    lines = [f"ampfused {__version__}", f"torch {torch.__version__} (CUDA {torch.version.cuda})",
             f"triton {_triton_version()}", f"nvcc {_nvcc_version()}", f"python {platform.python_version()}", "",
             "devices:"] + [f"  {r}" for r in _devices()] + ["", "native modules:"] + [f"  {r}" for r in _native_rows()]
    lines += ["", "ops x backends (fp32/bf16/fp16 tensors; 'ok' runs here, [n] cannot: reasons below):"]
    table = op_table()
    cols = list(dict.fromkeys((name, dev) for _, name, dev, _ in table))
    notes: List[str] = []
    cell = {}
    for op, name, dev, status in table:
        if status != "ok" and status not in notes:
            notes.append(status)
        cell[op, name, dev] = "ok" if status == "ok" else f"[{notes.index(status) + 1}]"
    heads = [f"{name}@{dev}" for name, dev in cols]
    width = max(len(h) for h in heads) + 1
    first = max(len(op) for op in OPS) + 1
    lines.append("  " + " " * first + "".join(f"{h:<{width}}" for h in heads))
    for op in OPS:
        lines.append(f"  {op:<{first}}" + "".join(f"{cell[op, n, d]:<{width}}" for n, d in cols))
    lines += [f"  [{i + 1}] {why}" for i, why in enumerate(notes)]
    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not torch.cuda.is_available():
            lines.append(f"  dispatch on cuda: none ({NO_CUDA})")
            continue
        picked = registry.available_backends(dev, DTYPES)
        lines.append(f"  dispatch on {dev}: {picked[0] if picked else 'no backend'}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
