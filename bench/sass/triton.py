"""K2's instructions per element in the Triton backend, compiled for sm_90 on a machine without a GPU.

``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` lowers a kernel to PTX and ptxas assembles it: no device is
asked anything, so each state mode's K2 (``triton_kernels/adam.py``, ``sgd.py``) is compiled here with the
constexprs its launcher would pass for bf16 weights and gradients (aligned tables, AdamW / SGD with momentum, a
seed where the mode draws) and disassembled like the CUDA module; the element loop and the counts are found
the same way (``bench/sass/cuda.py``). Muon's passes (``muon.py``) are compiled the same way (``muon_cubin``).
"""
from __future__ import annotations

import os
import tempfile
from typing import Dict, List

from . import cuda as C
from . import modes as M
from . import parse as P

TARGET = ("cuda", 90, 32)


def _state_ptr(mode: M.Mode) -> str:
    return {M.FLOAT: "*fp32", M.BF16: "*bf16", M.U8: "*u8"}[mode.state]


def _master_ptr(mode: M.Mode) -> str:
    return "*i16" if mode.master == M.MASTER_REMAINDER else "*fp32"


def _compile(kernel, consts: dict, ptrs: dict, ints: set, num_warps: int) -> bytes:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = kernel.arg_names
    sig = {}
    for n in names:
        sig[n] = "constexpr" if n in consts else ptrs.get(n, "i64" if n in ints else "fp32")
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget(*TARGET), options={"num_warps": num_warps, "enable_fp_fusion": False})
    return k.asm["cubin"]


def _common(mode: M.Mode, module) -> dict:
    import triton.language as tl
    return dict(PARAM_DTYPE=tl.bfloat16, GRAD_DTYPE=tl.bfloat16,
                HAS_MASTER=mode.master == M.MASTER_FP32, CLIP=True, ALIGNED=True, MASTER_FORMAT=mode.master,
                STATE_BF16=mode.state == M.BF16, STATE_Q8=mode.state == M.U8, USE_SEED=M.draws(mode, "adam") > 0,
                MAXIMIZE=False, CHUNK=module.CHUNK, BLOCK=module.BLOCK, PBLOCK=module.PBLOCK, TBLOCK=module.TBLOCK)


def adam_cubin(mode: M.Mode) -> bytes:
    from ampfused.triton_kernels import adam
    consts = dict(_common(mode, adam), DECOUPLED=True)
    ptrs = {"table_ptr": "*i64", "chunks_ptr": "*i64", "master_ptr": _master_ptr(mode),
            "exp_avg_ptr": _state_ptr(mode), "exp_avg_sq_ptr": _state_ptr(mode), "steps_ptr": "*fp32",
            "partials_ptr": "*fp32", "inv_scale_ptr": "*fp32", "lr_ptr": "*fp32", "out_stats_ptr": "*fp32",
            "counter_ptr": "*i32", "seed_ptr": "*i64", "scales_ptr": "*fp32"}
    ints = {"num_chunks", "T", "scale_cols", "P", "p_stride_row", "p_stride_col"}
    return _compile(adam._adam_kernel, consts, ptrs, ints, adam.NUM_WARPS)


def sgd_cubin(mode: M.Mode) -> bytes:
    from ampfused.triton_kernels import sgd
    consts = dict(_common(mode, sgd), HAS_MOMENTUM=True, NESTEROV=False,
                  USE_SEED=M.draws(mode, "sgd") > 0)
    ptrs = {"table_ptr": "*i64", "chunks_ptr": "*i64", "master_ptr": _master_ptr(mode),
            "buf_ptr": _state_ptr(mode), "steps_ptr": "*fp32", "partials_ptr": "*fp32", "inv_scale_ptr": "*fp32",
            "lr_ptr": "*fp32", "out_stats_ptr": "*fp32", "counter_ptr": "*i32", "seed_ptr": "*i64",
            "scales_ptr": "*fp32"}
    ints = {"num_chunks", "T", "P", "p_stride_row", "p_stride_col"}
    return _compile(sgd._sgd_kernel, consts, ptrs, ints, sgd.NUM_WARPS)


def muon_cubin(mode: M.Mode, phase: int) -> bytes:
    """One of Muon's two passes (``triton_kernels/muon.py``: 1, the momentum and the iteration's input; 2, the
    update of the weight), Nesterov with decay, compiled as its launcher would launch it in ``mode``."""
    from ampfused.triton_kernels import muon
    consts = dict(_common(mode, muon), PHASE=phase, NESTEROV=True, DECAY=True)
    del consts["MAXIMIZE"]
    ptrs = {"table_ptr": "*i64", "chunks_ptr": "*i64", "master_ptr": _master_ptr(mode), "m_ptr": _state_ptr(mode),
            "scratch_ptr": "*bf16", "steps_ptr": "*fp32", "partials_ptr": "*fp32", "inv_scale_ptr": "*fp32",
            "decay_ptr": "*fp32", "step_ptr": "*fp32", "out_stats_ptr": "*fp32", "counter_ptr": "*i32",
            "seed_ptr": "*i64", "scales_ptr": "*fp32"}
    ints = {"num_chunks", "T", "P", "p_stride_row", "p_stride_col"}
    return _compile(muon._muon_kernel, consts, ptrs, ints, muon.NUM_WARPS)


def _disassembled(cubin: bytes) -> List[P.Function]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return P.parse(C.disassemble(path))


def muon_access_widths(labels) -> Dict[str, List[str]]:
    """``{"<mode label> <phase>": widths}``: the global-memory accesses (``LDG.64``, ``STG.128``, ...) of the loops
    that store, in each of Muon's passes compiled for each mode named in ``labels`` (needs cuobjdump and nvdisasm)."""
    out = {}
    for mode in (m for m in M.MODES if m.label in labels):
        for phase in (1, 2):
            fns = _disassembled(muon_cubin(mode, phase))
            trips = [P.trip(fn, a, b) for fn in fns for a, b in P.innermost_loops(fn)]
            out[f"{mode.label} {phase}"] = sorted({w for t in trips if t.stores for w in t.widths})
    return out


def rows(ops=("adam", "sgd"), modes=M.MODES) -> List[C.Row]:
    out = []
    for op in ops:
        for mode in modes:
            found = None
            for fn in _disassembled((adam_cubin if op == "adam" else sgd_cubin)(mode)):
                found = C.element_loop(fn, mode, op) or found
            if found:
                out.append(C.Row("triton", op, mode, found[0], found[1]))
    return out
