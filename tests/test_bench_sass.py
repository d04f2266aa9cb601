"""python -m bench.sass: the SASS reader (loops, the longest path of a trip, memory widths, elements per trip) on a
small listing written here, and on the built CUDA module's sm_90 code where cuobjdump is installed."""
import glob
import json
import os
import subprocess
import sys

import pytest

from bench.sass import __main__ as cli
from bench.sass import cuda as C
from bench.sass import modes as M
from bench.sass import parse as P

NAME = ("_ZN8ampfused4cuda11step_kernelINS_6bf16_tES2_NS0_39_GLOBAL__N__31e53292_7_adam_cu_a3cbc62c6AdamOpELi2EhEE"
        "vNS_8StepArgsENS0_8WorkListENT1_5HyperEPii")

# A K2-like kernel: a setup loop that stores nothing, then an element loop handling 2 elements per trip (two
# square roots, 2 hashes for +sr+q8m's one draw per element) with an if/else inside (the else side longer) and a
# rare slow path that calls out of line.
LISTING = f"""
	code for sm_90
		Function : {NAME}
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.64 R2, desc[UR4][R2.64] ;
        /*0020*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   LD.E.128 R8, desc[UR4][R6.64] ;
        /*0050*/                   LDG.E.U8 R12, desc[UR4][R10.64] ;
        /*0060*/                   MUFU.RSQ R13, R8 ;
        /*0070*/                   MUFU.RSQ R14, R9 ;
        /*0080*/              @P1 BRA 0xb0 ;
        /*0090*/                   FADD R15, R13, R14 ;
        /*00a0*/                   BRA 0xe0 ;
        /*00b0*/                   FMUL R15, R13, R14 ;
        /*00c0*/                   FMUL R15, R15, R14 ;
        /*00d0*/                   FMUL R15, R15, R14 ;
        /*00e0*/                   IMAD R16, R15, -0x7b935975, RZ ;
        /*00f0*/                   IMAD R17, R15, -0x7b935975, RZ ;
        /*0100*/                   IMAD R18, R15, 0x7feb352d, RZ ;
        /*0110*/                   IMAD R19, R15, 0x7feb352d, RZ ;
        /*0120*/                   IMAD R20, R15, 0x7feb352d, RZ ;
        /*0130*/                   IMAD R21, R15, 0x7feb352d, RZ ;
        /*0140*/              @!P2 BRA 0x170 ;
        /*0150*/                   MOV R0, 0x170 ;
        /*0160*/                   CALL.REL.NOINC 0x300 ;
        /*0170*/                   SHFL.BFLY PT, R22, R21, 0x10, 0x1f ;
        /*0180*/                   NOP ;
        /*0190*/                   STG.E.64 desc[UR4][R10.64], R16 ;
        /*01a0*/                   ST.E.U16 desc[UR4][R6.64], R17 ;
        /*01b0*/               @P3 BRA 0x40 ;
        /*01c0*/                   EXIT ;
        /*0300*/                   RET.REL.NODEC R0 0x0 ;
"""


def test_parse_finds_the_function_and_its_instructions():
    (fn,) = P.parse(LISTING)
    assert fn.name == NAME and fn.arch == "sm_90"
    assert fn.insns[0].op == "LDC" and fn.insns[3].pred == "@!P0" and fn.insns[3].op == "BRA"
    assert P.mem_width("LDG.E.128") == 16 and P.mem_width("STG.E.U8") == 1 and P.mem_width("LD.E.U16") == 2
    assert P.mem_width("LDG.E") == 4 and P.mem_width("STG.E.64") == 8


def test_loops_and_the_longest_path_of_a_trip():
    (fn,) = P.parse(LISTING)
    assert P.loops(fn) == [(0x10, 0x30), (0x40, 0x1b0)]
    assert P.innermost_loops(fn) == [(0x10, 0x30), (0x40, 0x1b0)]
    path = [i.addr for i in P.longest_path(fn, 0x40, 0x1b0)]
    # the longer (else) side of the if, not the FADD side; round the CALL; the NOP is not counted
    assert 0xb0 in path and 0xd0 in path and 0x90 not in path and 0xa0 not in path
    assert 0x160 not in path and 0x150 not in path and 0x180 not in path
    with_calls = [i.addr for i in P.longest_path(fn, 0x40, 0x1b0, avoid_calls=False)]
    assert 0x160 in with_calls and len(with_calls) == len(path) + 2


def test_a_trip_counts_memory_hashes_and_special_units():
    (fn,) = P.parse(LISTING)
    tr = P.trip(fn, 0x40, 0x1b0, markers=(M.HASH_MARKER,))
    assert tr.insns == 19
    assert (tr.loads, tr.load_bytes, tr.stores, tr.store_bytes) == (2, 17, 2, 10)
    assert tr.widths == {"LD.128": 1, "LDG.8": 1, "STG.64": 1, "ST.16": 1}
    assert (tr.mufu, tr.rsq, tr.shfl, tr.bars, tr.markers) == (2, 2, 1, 0, 2)


def test_the_element_loop_and_its_elements_per_trip():
    (fn,) = P.parse(LISTING)
    op, mode = C.kernel_key(fn.name)
    assert (op, mode.label) == ("adam", "+sr+q8m")
    assert M.draws(mode, op) == 1
    elems, tr = C.element_loop(fn, mode, op)  # the setup loop stores nothing: not an element loop
    assert elems == 2 and tr.start == 0x40
    (row,) = C.rows_from_sass(LISTING)
    assert row.elems == 2 and row.moved == pytest.approx(10.0625)
    text = cli.table([row])
    assert "+sr+q8m" in text and "| 9.5 " in text  # 19 instructions over 2 elements


def test_the_byte_model_is_the_benchmarks():
    import torch
    from bench.common.bytes import mode_bytes_per_param
    kinds = {M.MASTER_FP32: "fp32", M.MASTER_REMAINDER: "remainder", M.MASTER_NONE: "none"}
    for mode in M.MODES:
        r, w = M.read_write_bytes(mode, "adam")
        scales = 2 * 2 * 4 / M.QBLOCK if mode.state == M.U8 else 0.0
        want = mode_bytes_per_param(torch.bfloat16, torch.bfloat16, kinds[mode.master], mode.moment_bytes())
        assert r + w == pytest.approx(want + scales), mode.label
    assert M.budget(10.0) == pytest.approx(33e12 / (0.85 * 3.35e12 / 10.0))


def test_every_bf16_kernel_name_maps_to_its_mode():
    # an Op in an anonymous namespace (Lion's, SGD's) and one in ampfused::cuda (Adam's, shared by three files)
    for base in ("_ZN8ampfused4cuda11step_kernelINS_6bf16_tES2_NS0_39_GLOBAL__N__31e53292_7_adam_cu_a3cbc62c6AdamOpELi{}"
                 "E{}EE", "_ZN8ampfused4cuda11step_kernelINS_6bf16_tES2_NS0_6AdamOpELi{}E{}EE"):
        for mode in M.MODES:
            s = {M.FLOAT: "f", M.BF16: "S2_", M.U8: "h"}[mode.state]
            assert C.kernel_key(base.format(mode.master, s)) == ("adam", mode)
    assert C.kernel_key(base.format(0, "f").replace("INS_6bf16_tES2_", "IfS2_")) is None  # fp32 gradients


def _built_cuda_module():
    hits = glob.glob(os.path.join(C.ROOT, "ampfused", "_C_cuda*.so"))
    return hits[0] if hits else None


@pytest.mark.skipif(C.tool("cuobjdump") is None or C.tool("nvdisasm") is None,
                    reason="needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
@pytest.mark.skipif(_built_cuda_module() is None, reason="needs the CUDA backend built (nvcc)")
@pytest.mark.slow
def test_built_module_every_compact_mode_moves_8_elements_a_trip_in_wide_accesses():
    try:
        text = C.disassemble(_built_cuda_module(), arch="sm_90")
    except RuntimeError:  # (cuobjdump refuses an architecture the module lacks)
        text = ""
    if "sm_90" not in text:
        pytest.skip("needs the CUDA backend built for sm_90 (AMPFUSED_CUDA_ARCHS)")
    rows = {(r.op, r.mode.label): r for r in C.rows_from_sass(text)}
    for op in ("adam", "sgd"):
        for mode in M.MODES:
            r = rows[(op, mode.label)]
            assert r.elems == 8, (op, mode.label)
            assert r.trip.bars == 0, (op, mode.label)
            # the gradient, the weight and its remainder in 16-byte accesses: no 1- or 2-byte ones
            assert not any(k.endswith((".8", ".16")) for k in r.trip.widths), (op, mode.label, r.trip.widths)


def _compiled(code: str):
    """What ``code`` prints last (JSON), run after ``import json`` and ``bench.sass``'s ``modes as M, triton as T``
    in a process of its own without TRITON_INTERPRET (set here when there is no GPU): compiled, not interpreted."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    code = "import json; from bench.sass import modes as M, triton as T; " + code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_triton_muon_passes_compile_for_sm90():
    """Muon's Triton passes run under the interpreter here, which takes what the compiler may refuse: both compile
    for sm_90 (triton's own ptxas, no GPU) with a master, with remainders and bf16 momentum, and with neither and
    8-bit momentum (a draw per element). Where the disassembler is installed, no loop that stores moves an element
    of 2 bytes alone: the bf16 scratch between the passes goes 4 elements an access, as the bf16 state does."""
    labels = ("fp32 master", "+rem+bf16m", "+sr+q8m")
    if C.tool("cuobjdump") is None or C.tool("nvdisasm") is None:
        sizes = _compiled(f"print(json.dumps([len(T.muon_cubin(m, ph)) for m in M.MODES if m.label in {labels!r} "
                          "for ph in (1, 2)]))")
        assert len(sizes) == 6 and all(sizes), sizes
        return
    widths = _compiled(f"print(json.dumps(T.muon_access_widths({labels!r})))")
    assert len(widths) == 6 and all(widths.values()), widths
    narrow = {k: [w for w in ws if w.endswith((".8", ".16"))] for k, ws in widths.items()}
    assert not any(narrow.values()), narrow


@pytest.mark.skipif(C.tool("cuobjdump") is None or C.tool("nvdisasm") is None,
                    reason="needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_triton_compact_kernel_for_sm90_moves_8_elements_a_trip_in_wide_accesses():
    backend, elems, widths = _compiled(
        "mode = next(m for m in M.MODES if m.label == '+rem+bf16m'); "
        "(r,) = T.rows(ops=('adam',), modes=(mode,)); print(json.dumps([r.backend, r.elems, r.trip.widths]))")
    assert backend == "triton" and elems == 8
    # remainders and bf16 moments 4 elements per access at least (8-byte aligned), the rest 16 bytes
    assert not any(k.endswith((".8", ".16", ".32")) for k in widths), widths
