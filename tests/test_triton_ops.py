"""Triton backend: K1 (norm_check, unscale_), the backend object, the custom ops, the package name.

On a machine without a GPU the kernels run under Triton's interpreter on CPU tensors (conftest turns it
on); with ``AMPFUSED_TEST_NO_INTERPRET=1`` and a GPU the same tests run compiled on CUDA tensors.
"""
import importlib
import os
import subprocess
import sys

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference
from backends import TRITON_DEVICE, requires_triton
from oracle import assert_bitwise, assert_close_to_oracle

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from ampfused.triton_kernels._common import _round_to, _to_f32  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = TRITON_DEVICE
pytestmark = requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def k1():
    return importlib.import_module("ampfused.triton_kernels.norm_check")


@pytest.fixture
def small_k1(monkeypatch):
    """Tiny blocks, chunks and program cap, so small gradients exercise multi-block chunks, tails and
    programs looping over several chunks."""
    monkeypatch.setattr(k1(), "BLOCK", 64)
    monkeypatch.setattr(k1(), "CHUNK", 128)
    monkeypatch.setattr(k1(), "MAX_PROGRAMS", 4)


class Launches:
    """Counts the launches of a kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def k1_launches(monkeypatch):
    counter = Launches(k1()._norm_check_kernel)
    monkeypatch.setattr(k1(), "_norm_check_kernel", counter)
    return counter


def chunk_sums(u, chunk, programs):
    """Expected partials row 0 of one gradient ``u`` (fp32 values in memory order): program ``p`` sums the
    chunks ``p, p + programs, ...``."""
    chunks = [u[i:i + chunk] for i in range(0, u.numel(), chunk)]
    return torch.stack([sum((c.double() ** 2).sum() for c in chunks[p::programs]) for p in range(programs)]).float()


def oracle_norm(grads, inv_scale):
    return torch.stack([(g.double() * inv_scale.double()).pow(2).sum() for g in grads]).sum().sqrt()


def check_norm(grads, inv_scale, partials):
    """partials -> (norm, found_inf) against the reference (fp32) and an fp64 oracle."""
    assert partials.shape == (2, ops.num_partials([g.numel() for g in grads], DEVICE, backend="triton"))
    norm, found = reference.reduce_partials(partials)
    ref_norm, ref_found = reference.reduce_partials(reference.norm_check([g.clone() for g in grads], inv_scale))
    assert found.item() == ref_found.item()
    assert_close_to_oracle("norm", norm, ref_norm, oracle_norm(grads, inv_scale))


# -------------------------------------------------------------------------------------------- norm_check

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 127, 65537])
def test_norm_check_matches_reference(dtype, n):
    g = (torch.randn(n, device=DEVICE) * 300).to(dtype)
    inv = torch.tensor(1 / 256, device=DEVICE)
    before = g.clone()
    p = ops.norm_check([g], inv, backend="triton")
    check_norm([g], inv, p)
    assert_bitwise("grad untouched", g, before)
    assert_bitwise("run twice", p, ops.norm_check([g], inv, backend="triton"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_check_chunked_grid(small_k1, dtype):
    # 1000 elements in 128-chunks of two 64-blocks: 8 chunks over 4 programs, the last chunk partial
    g = torch.randn(1000, device=DEVICE).to(dtype)
    inv = torch.tensor(0.5, device=DEVICE)
    p = ops.norm_check([g], inv, backend="triton")
    assert p.shape == (2, 4)
    check_norm([g], inv, p)
    # column p holds exactly the chunks p and p + 4
    torch.testing.assert_close(p[0], chunk_sums(g.float() * 0.5, 128, 4), rtol=1e-6, atol=0)


def test_many_tiny_buffers_one_launch(small_k1, k1_launches):
    shapes = [(3,), (0,), (1,), (5, 7), (64,), (65,), (2, 3, 4), (200,), (1, 1)] * 5
    grads = [torch.randn(s, device=DEVICE).to(DTYPES[i % 3]) for i, s in enumerate(shapes)]
    grads.append(torch.randn(9, 13, device=DEVICE).t())  # transposed: walked in memory order, in place
    grads.append(torch.randn(4, 6, 3, 5, device=DEVICE).to(memory_format=torch.channels_last))
    grads.append(torch.randn(9, 13, device=DEVICE)[:, ::2])  # not dense: goes through a contiguous copy
    inv = torch.tensor(2.0, device=DEVICE)
    p = ops.norm_check(grads, inv, backend="triton")
    check_norm(grads, inv, p)
    chunks = sum(-(-g.numel() // 128) for g in grads)
    assert p.shape[1] == min(chunks, 4) == k1().num_partials([g.numel() for g in grads])
    assert p[1].sum() == 0
    assert k1_launches.grids == [(4,)]  # mixed dtypes, one launch
    assert_bitwise("run to run", p, ops.norm_check(grads, inv, backend="triton"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_flags_land_in_their_program(small_k1, dtype):
    n = 1000  # 8 chunks of 128 elements; program p owns chunks p and p + 4
    cases = [(0, float("inf")), (300, float("nan")), (999, float("-inf")), (600, float("nan"))]
    for pos, val in cases:
        g = torch.randn(n, device=DEVICE).to(dtype)
        g[pos] = val
        p = ops.norm_check([g], torch.tensor(1.0, device=DEVICE), backend="triton")
        expected = torch.zeros(4, device=DEVICE)
        expected[(pos // 128) % 4] = 1.0
        assert_bitwise(f"flags for {val} at {pos}", p[1], expected)
    # chunks are numbered across the list: the second gradient's chunk is chunk 1, on program 1
    a, b = torch.randn(100, device=DEVICE).to(dtype), torch.randn(100, device=DEVICE).to(dtype)
    b[99] = float("nan")
    p = ops.norm_check([a, b], torch.tensor(1.0, device=DEVICE), backend="triton")
    assert p[1].tolist() == [0.0, 1.0]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) reports the overflow
@pytest.mark.parametrize("dtype,big", [(torch.float32, 3e38), (torch.bfloat16, 3e38), (torch.float16, 6e4)])
def test_finite_square_overflow_is_not_flagged(dtype, big):
    g = torch.zeros(300, device=DEVICE).to(dtype)
    g[7] = big
    inv = torch.tensor(1e15 if dtype == torch.float16 else 1.0, device=DEVICE)
    norm, found = reference.reduce_partials(ops.norm_check([g], inv, backend="triton"))
    assert norm.item() == float("inf") and found.item() == 0.0


# ---------------------------------------------------------------------------------------------- unscale_

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 127, 4099])
def test_unscale_matches_reference_bitwise(dtype, n):
    g = (torch.randn(n, device=DEVICE) * 1000).to(dtype)
    g[n // 2] = float("inf")
    inv = torch.tensor(1 / 3, device=DEVICE)  # not a power of two: the rounding matters
    orig, ref_g = g.clone(), g.clone()
    ref_p = reference.unscale_([ref_g], inv)
    p = ops.unscale_([g], inv, backend="triton")
    assert_bitwise("unscaled grad", g, ref_g)
    if dtype == torch.float32:
        assert_bitwise("fp32 is one multiply", g, orig * inv)
    norm, found = reference.reduce_partials(p)
    assert found.item() == 1.0 and reference.reduce_partials(ref_p)[1].item() == 1.0
    # finite case: partials are those of norm_check of the unscaled fp32 values
    g2 = (torch.randn(n, device=DEVICE) * 1000).to(dtype)
    before = g2.clone()
    p2 = ops.unscale_([g2], inv, backend="triton")
    check_norm([before], inv, p2)
    assert_bitwise("partials = norm_check's", p2, ops.norm_check([before], inv, backend="triton"))


def test_unscale_list_with_strided_and_chunked(small_k1, k1_launches):
    grads = [torch.randn(7, 11, device=DEVICE).t(), torch.randn(1000, device=DEVICE).to(torch.bfloat16),
             torch.randn(0, device=DEVICE), torch.randn(3, 5, device=DEVICE).to(torch.float16)[:, ::2],
             torch.randn(2, 6, 5, 3, device=DEVICE).to(torch.bfloat16).to(memory_format=torch.channels_last),
             torch.randn(301, device=DEVICE).to(torch.float16)[1:]]  # starts 2 bytes off alignment
    inv = torch.tensor(0.1, device=DEVICE)
    originals = [g.clone() for g in grads]
    refs = [g.clone() for g in grads]
    reference.unscale_(refs, inv)
    strides, ptrs = [g.stride() for g in grads], [g.data_ptr() for g in grads]
    p = ops.unscale_(grads, inv, backend="triton")
    for i, (g, r) in enumerate(zip(grads, refs)):
        assert_bitwise(f"grads[{i}]", g, r)
        assert g.stride() == strides[i] and g.data_ptr() == ptrs[i]
    assert len(k1_launches.grids) == 1
    check_norm(originals, inv, p)  # partials of the unscaled values
    # the misaligned gradient made the launch take the hint-free path
    (_, plan), = list(ops.get_backend("triton").grad_tables._slots.values())[-1:]
    assert not plan.aligned


def test_grad_table_cache():
    grads = [torch.randn(50, device=DEVICE), torch.randn(7, 3, device=DEVICE).to(torch.bfloat16)]
    inv = torch.tensor(0.5, device=DEVICE)
    tables = ops.get_backend("triton").grad_tables
    first = ops.norm_check(grads, inv, backend="triton")
    before = tables.builds
    assert_bitwise("same tensors", ops.norm_check(grads, inv, backend="triton"), first)
    assert tables.builds == before
    moved = [g.clone() for g in grads]
    assert_bitwise("new addresses", ops.norm_check(moved, inv, backend="triton"), first)
    assert tables.builds == before + 1


@triton.jit
def _roundtrip(x_ptr, y_ptr, w_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    tl.store(y_ptr + idx, _round_to(tl.load(x_ptr + idx, mask=m), tl.bfloat16), mask=m)
    tl.store(w_ptr + idx, _to_f32(_round_to(tl.load(x_ptr + idx, mask=m), tl.bfloat16)), mask=m)


def test_round_and_widen_bitwise():
    """The bit-level bf16 conversions (the interpreter's own truncate) against torch, on every bf16 value
    and on fp32 values at, just below and just above bf16 rounding ties."""
    every = torch.arange(-32768, 32768, device=DEVICE, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ties = every.float().view(torch.int32)
    ties = ties[(ties & 0x7F800000) != 0x7F800000]
    x = torch.cat([every.float().view(torch.int32), ties + 0x8000, ties + 0x7FFF, ties + 0x8001,
                   torch.randint(-2**31, 2**31 - 1, (20000,), device=DEVICE, dtype=torch.int32)]).view(torch.float32)
    x = x[~torch.isnan(x)]
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    w = torch.empty_like(x)
    block = 65536 if INTERPRET else 1024  # few interpreted programs; register-sized blocks on a GPU
    _roundtrip[(triton.cdiv(x.numel(), block),)](x, y, w, x.numel(), BLOCK=block)
    assert_bitwise("fp32 -> bf16", y, x.to(torch.bfloat16))
    assert_bitwise("bf16 -> fp32", w, x.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------- backend and custom ops

def test_backend_object():
    b = ops.get_backend("triton")
    assert b.name == "triton" and b.unavailable_reason() is None
    assert ("cpu" in b.devices) == INTERPRET and "cuda" in b.devices
    C, M = k1().CHUNK, k1().MAX_PROGRAMS
    assert C % k1().BLOCK == 0
    sizes = [0, 1, C, C + 1, (M - 1) * C, 10**12]
    # one partial per chunk up to MAX_PROGRAMS, over the whole list: a pure function of the sizes
    assert [b.num_partials([s]) for s in sizes] == [0, 1, 1, 2, M - 1, M]
    assert b.num_partials([1] * 5 + [0] * 3) == 5 and b.num_partials([C + 1] * (M // 2 + 1)) == M


def test_opcheck_k1_and_scale():
    g = [torch.randn(37, device=DEVICE), torch.randn(5, 3, device=DEVICE).to(torch.bfloat16)]
    inv = torch.tensor(0.25, device=DEVICE)
    torch.library.opcheck(torch.ops.ampfused.norm_check.default, (g, inv, "triton"))
    torch.library.opcheck(torch.ops.ampfused.unscale_.default, (g, inv, "triton"))
    scale = torch.tensor(1024.0, device=DEVICE)
    tracker = torch.tensor(0, dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.ampfused.update_scale_.default,
                          (scale, tracker, torch.tensor(0.0, device=DEVICE), 2.0, 0.5, 3, None, None, "triton"))
    torch.library.opcheck(torch.ops.ampfused.update_scale_.default,
                          (scale, tracker, torch.tensor(1.0, device=DEVICE), 2.0, 0.5, 3,
                           torch.zeros((), device=DEVICE), torch.zeros((), dtype=torch.int64, device=DEVICE), "triton"))


def test_kernels_only_importable_under_ampfused(tmp_path):
    pkg = importlib.import_module("ampfused.triton_kernels")
    ours = os.path.realpath(os.path.join(REPO, "triton_kernels"))  # (a checkout may reach it through a link)
    assert os.path.dirname(os.path.realpath(pkg.__file__)) == ours
    assert importlib.import_module("ampfused.triton_kernels.adam").__name__ == "ampfused.triton_kernels.adam"
    env = dict(os.environ)
    # a checkout root on PYTHONPATH would expose the folder itself; that is not what is being tested
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and os.path.abspath(p) != REPO)
    code = "import importlib.util as u; s = u.find_spec('triton_kernels'); print(s.origin if s else '')"
    top = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    # absent, or some other distribution's package (triton publishes one under that name), never this one
    assert not top.startswith(ours), f"top-level triton_kernels resolves to this package: {top}"
