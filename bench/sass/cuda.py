"""K2's instructions per element in the CUDA backend, read from its sm_90 machine code.

The SASS comes from the CUDA sources compiled here for sm_90 with the project's flags (``nvcc -O3 --fmad=false
-arch=sm_90 -cubin``; no GPU needed), from a built ``ampfused._C_cuda`` (its sm_90 part), or from a saved listing;
``cuobjdump -sass`` disassembles it (``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``).

Which loop, and how many elements a trip handles: K2 is one kernel per (gradient, weight, optimizer, weight
format, moment type), ``step_kernel<G, P, Op, kFmt, S>``. Its element loop is the innermost loop (a backward
branch whose body holds no other) that stores to global memory and handles the most elements per trip; of
several that handle as many, the one with the fewest memory instructions (the vector loop, not the masked one).
Elements per trip: in a mode that rounds stochastically, the hashes in the trip over the draws each element
makes (the hash's second multiplier is an immediate operand, one per draw: exact); otherwise Adam's square roots
(one ``MUFU.RSQ`` per element); otherwise (SGD) the bytes the trip loads over the bytes an element reads, to the
nearest power of two, where the bytes it stores agree and some load is 2 or 16 bytes wide (bf16 gradients, one
or eight at a time). Instructions per element: one trip along its longest path (``parse.longest_path``: the
costliest side of every branch, out-of-line slow paths left out) over its elements; the per-chunk work outside
the loop (reading a table row, the keys) is spread over 16384 elements and left out.
"""
from __future__ import annotations

import glob
import math
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional

from . import modes as M
from . import parse as P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = {"adam": ("csrc/cuda/adam.cu", "csrc/cuda/adam_bf16m.cu", "csrc/cuda/adam_q8m.cu"),
           "sgd": ("csrc/cuda/sgd.cu",), "lion": ("csrc/cuda/lion.cu",)}
FLAGS = ["-O3", "-std=c++17", "--fmad=false", "-DNDEBUG", "-arch=sm_90", "-cubin"]

# step_kernel<bf16_t, bf16_t, XOp, kFmt, S>: S is f (float), h (uint8_t) or S2_ (bf16_t, a back-reference)
_KERNEL = re.compile(r"step_kernelINS_6bf16_tES2_NS0_\w*?\d+(Adam|Sgd|Lion)OpELi(\d)E(f|h|S2_)EE")
_STATE = {"f": M.FLOAT, "h": M.U8, "S2_": M.BF16}


def tool(name: str) -> Optional[str]:
    """A CUDA binary utility from PATH or from the nvidia-cuda-* wheels' bin directories."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
        for base in nvidia.__path__:
            hits = (glob.glob(os.path.join(base, "*", "bin", name)) +
                    glob.glob(os.path.join(base, "*", "*", "bin", name)))
            if hits:
                return hits[0]
    except ImportError:
        pass
    return None


def disassemble(binary: str, arch: Optional[str] = None) -> str:
    """``cuobjdump -sass`` of a cubin or a shared library (its nvdisasm found the same way); ``arch`` (as
    ``"sm_90"``): that architecture's code only (half a two-architecture module's listing, which is 500 MB)."""
    cuobjdump = tool("cuobjdump")
    nvdisasm = tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise RuntimeError("cuobjdump -sass needs cuobjdump and nvdisasm: pip install nvidia-cuda-cuobjdump "
                           "nvidia-cuda-nvdisasm")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([cuobjdump, "-sass", *(("-arch", arch) if arch else ()), binary], capture_output=True,
                         text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass {binary} failed: {out.stderr.strip()}")
    return out.stdout


def compile_sources(ops=("adam", "sgd", "lion"), nvcc: Optional[str] = None) -> str:
    """SASS of the K2 sources compiled for sm_90 (about 40 s per file)."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found (or pass --module / --sass)")
    texts = []
    with tempfile.TemporaryDirectory() as d:
        for op in ops:
            for src in SOURCES[op]:
                cubin = os.path.join(d, os.path.basename(src) + ".cubin")
                cmd = [nvcc] + FLAGS + [f"-I{os.path.join(ROOT, 'csrc', 'include')}", "-o", cubin,
                                        os.path.join(ROOT, src)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr}")
                texts.append(disassemble(cubin))
    return "\n".join(texts)


def built_module() -> str:
    hits = sorted(glob.glob(os.path.join(ROOT, "ampfused", "_C_cuda*.so")))
    if not hits:
        raise RuntimeError(f"no ampfused/_C_cuda*.so under {ROOT}: build it, or use --compile")
    return hits[0]


@dataclass
class Row:
    backend: str
    op: str
    mode: M.Mode
    elems: int
    trip: P.Trip

    @property
    def moved(self) -> float:
        r, w = M.read_write_bytes(self.mode, self.op)
        return r + w

    @property
    def budget(self) -> float:
        return M.budget(self.moved)

    def per_elem(self, count: float) -> float:
        return count / self.elems


def kernel_key(name: str):
    """(op, mode) of a bf16 K2 kernel's mangled name, or None."""
    m = _KERNEL.search(name)
    if not m:
        return None
    op = m.group(1).lower()
    fmt, state = int(m.group(2)), _STATE[m.group(3)]
    mode = next((x for x in M.MODES if x.master == fmt and x.state == state), None)
    return (op, mode) if mode else None


def elements_per_trip(tr: P.Trip, mode: M.Mode, op: str) -> int:
    """Elements one trip of a loop handles, 0 when it is not an element loop (module docstring)."""
    n_draws = M.draws(mode, op)
    if n_draws:
        return tr.markers // n_draws if tr.markers % n_draws == 0 else 0
    if op == "adam":  # one square root per element
        return tr.rsq
    if not any(k.endswith((".16", ".128")) and k.startswith("LD") for k in tr.widths):
        return 0  # a loop over bf16 gradients loads them 2 or 16 bytes at a time
    read, write = M.read_write_bytes(mode, op)
    by_load, by_store = tr.load_bytes / read, tr.store_bytes / write
    if by_load < 0.75 or not 0.67 <= by_load / max(by_store, 1e-9) <= 1.5:
        return 0
    return 1 << max(0, round(math.log2(by_load)))


def element_loop(fn: P.Function, mode: M.Mode, op: str):
    """(elements per trip, Trip) of the function's element loop (see the module docstring), or None."""
    best = None
    for start, end in P.innermost_loops(fn):
        tr = P.trip(fn, start, end, markers=(M.HASH_MARKER,))
        if not tr.stores:  # K1's loops and the prologue's store nothing to global memory
            continue
        elems = elements_per_trip(tr, mode, op)
        # the most elements per trip; of loops that handle as many, the fewest memory instructions (the vector
        # loop rather than the masked one beside it)
        if elems and (best is None or (elems, -(tr.loads + tr.stores)) > (best[0], -(best[1].loads + best[1].stores))):
            best = (elems, tr)
    return best


def rows_from_sass(text: str, arch: str = "sm_90") -> List[Row]:
    rows: Dict[tuple, Row] = {}
    for fn in P.parse(text):
        if fn.arch and fn.arch != arch:
            continue
        key = kernel_key(fn.name)
        if key is None or key in rows:
            continue
        op, mode = key
        found = element_loop(fn, mode, op)
        if found:
            rows[key] = Row("cuda", op, mode, found[0], found[1])
    order = {m: i for i, m in enumerate(M.MODES)}
    return sorted(rows.values(), key=lambda r: (r.op, order[r.mode]))
