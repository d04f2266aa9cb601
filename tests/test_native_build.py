"""The native build: what `pip install -e .` produced matches this checkout, the CUDA sources compile wherever
nvcc is present (a CUDA compile error fails CI even without a GPU), and `python -m ampfused.info` runs."""
import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ampfused import _native, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE_SKIPPED = os.environ.get("AMPFUSED_SKIP_NATIVE_BUILD") == "1"
CUDA_SKIPPED = NATIVE_SKIPPED or os.environ.get("AMPFUSED_SKIP_CUDA_BUILD") == "1"
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NATIVE_SKIPPED, reason="AMPFUSED_SKIP_NATIVE_BUILD=1")
def test_cpu_module_built_from_this_checkout():
    assert _native.unavailable_reason("cpu") is None, _native.unavailable_reason("cpu")
    info = _native.build_info("cpu")
    assert info["sources_hash"] == _native._checkout_sources_hash("cpu")
    mod = _native.module("cpu")
    assert "default" in info["isas"] and mod.isa() in mod.supported_isas()


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_cuda_sources_compile():
    """Built by the install when nvcc is found; with the CUDA build switched off, compiled here for one arch."""
    if not CUDA_SKIPPED:
        why = _native.unavailable_reason("cuda")
        assert why is None or why.startswith("no CUDA device") or "torch sees no CUDA" in why, (
            f"nvcc is on PATH ({NVCC}) but ampfused._C_cuda is not usable: {why}")
        info = _native.build_info("cuda")
        assert info["sources_hash"] == _native._checkout_sources_hash("cuda") and info["archs"]
        return
    listed = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    arch = next((a.split("_")[1] for a in ("compute_90", "compute_80") if a in listed), "80")
    out = os.path.join(ROOT, "build", "test_nvcc")
    os.makedirs(out, exist_ok=True)
    for src in sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))):
        cmd = [NVCC, "-c", src, "-o", os.path.join(out, os.path.basename(src) + ".o"), "-std=c++17", "--fmad=false",
               f"-I{os.path.join(ROOT, 'csrc', 'include')}", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"


@pytest.mark.skipif(CUDA_SKIPPED or NVCC is None, reason="CUDA build skipped or nvcc not on PATH")
def test_cuda_module_imports_without_a_gpu():
    """cudart is linked statically: importing never needs a driver; without a device calls say why."""
    mod = _native.module("cuda")
    status = mod.device_status()
    assert isinstance(status, str)
    if not torch.cuda.is_available():
        assert status.startswith("no CUDA device")
        reasons = ops.registry.reasons_for("cuda", torch.device("cuda"))
        assert reasons and reasons[0].startswith("no CUDA device"), reasons


@pytest.mark.skipif(CUDA_SKIPPED or NVCC is None, reason="CUDA build skipped or nvcc not on PATH")
def test_cuda_work_lists_follow_the_kernel_geometry():
    """The chunk and K1-column lists ampfused/ops/cuda.py builds from a tensor table (on the host, no GPU needed)
    are what the kernels expect: items row << WORK_SHIFT | index, rows in order, parameters without a gradient
    left out, STEP_CHUNK elements per chunk, the K1 partials of norm_check over the gradients, in its order."""
    from ampfused.ops import cuda as cuda_ops
    mod = _native.module("cuda")
    chunk, tile, most, shift = mod.STEP_CHUNK, mod.TILE, mod.MAX_PARTIALS_PER_TENSOR, mod.WORK_SHIFT
    assert mod.TABLE_COLS == 4 and chunk % 8 == 0 and chunk & (chunk - 1) == 0 and shift == 32
    numels = [5, _native.NO_GRAD, 0, chunk, chunk + 1, 3 * chunk - 1, tile * most + 1, 1]
    rows = []
    for k, n in enumerate(numels):
        rows += [0x1000 * (k + 1), 0x9000 * (k + 1) if n != _native.NO_GRAD else 0, n, 64 * k]
    host, num_chunks, num_columns = cuda_ops.work_lists(rows, chunk, tile, most, shift)
    active = [(k, n) for k, n in enumerate(numels) if n != _native.NO_GRAD]
    chunks = [(k << 32) | c for k, n in active for c in range(-(-n // chunk))]
    columns = [(k << 32) | j for k, n in active for j in range(min(-(-n // tile), most))]
    assert host.dtype == torch.int64 and host.tolist() == rows + chunks + columns
    again, _, _ = cuda_ops.work_lists(torch.tensor(rows).view(-1, 4).numpy(), chunk, tile, most, shift)
    assert again.tolist() == host.tolist()  # the fused optimizers hand over their numpy tables
    assert (num_chunks, num_columns) == (len(chunks), len(columns)) == (1 + 1 + 2 + 3 + 129 + 1, len(columns))
    assert num_columns == mod.num_partials([n for _, n in active])
    empty, nc, ncol = cuda_ops.work_lists([], chunk, tile, most, shift)
    assert empty.numel() == nc == ncol == 0


def test_missing_and_stale_builds_say_how_to_rebuild(monkeypatch):
    monkeypatch.setattr(_native, "_cache", {})
    monkeypatch.setattr(_native, "_errors", {})
    monkeypatch.setitem(_native.MODULES, "cpu", "ampfused._C_not_built")
    why = _native.unavailable_reason("cpu")
    assert "not built" in why and "pip install -e ." in why
    if NATIVE_SKIPPED:
        return
    monkeypatch.setattr(_native, "_cache", {})
    monkeypatch.setattr(_native, "_errors", {})
    monkeypatch.setitem(_native.MODULES, "cpu", "ampfused._C")
    monkeypatch.setattr(_native, "_checkout_sources_hash", lambda kind: "0123456789abcdef")
    why = _native.unavailable_reason("cpu")
    assert "stale" in why and "built from csrc/ sources" in why and "pip install -e ." in why


def test_info_runs():
    r = subprocess.run([sys.executable, "-m", "ampfused.info"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for text in ("ampfused 0.1", "torch ", "triton ", "nvcc ", "native modules:", "ampfused._C", "ampfused._C_cuda",
                 "ops x backends", "adam_step_", "dispatch on cpu"):
        assert text in r.stdout, f"{text!r} missing from python -m ampfused.info:\n{r.stdout}"


def test_a_broken_native_build_warns_once_when_ops_fall_back(monkeypatch):
    import warnings

    from ampfused.ops import registry
    cpu = registry.get_backend("cpu")
    if cpu is None or cpu.unavailable_reason():
        pytest.skip("the cpu backend is not built here")
    why = "ampfused._C is stale: built from csrc/ sources 0000; rebuild with `pip install -e .` from the checkout"
    monkeypatch.setattr(type(cpu), "unavailable_reason", lambda self: why)
    monkeypatch.setattr(registry, "_warned", set())
    ops._resolved.clear()
    g = [torch.ones(3)]
    try:
        with pytest.warns(UserWarning, match=r"the cpu backend cannot load \(ampfused\._C is stale.*pip install -e "
                                             r"\..*\); ops on cpu tensors run on the reference backend instead"):
            ops.norm_check(g, torch.ones(()))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ops.norm_check(g, torch.ones(()))  # once only
            ops._resolved.clear()
            ops.norm_check(g, torch.ones(()), backend="reference")  # a chosen backend: no word
    finally:
        ops._resolved.clear()
