"""Triton backend: the loss-scale update, bit for bit with the reference (torch's fp64-then-fp32 products)."""
import math
import os

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference
from backends import TRITON_DEVICE, requires_triton
from oracle import assert_bitwise

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = TRITON_DEVICE
pytestmark = requires_triton

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from ampfused.triton_kernels.update_scale import _mul_f64_rn, split_factor  # noqa: E402

FACTORS = [2.0, 0.5, 1.5, 0.7, 0.333, 1 / 3, 1.1, 1e-3, 3.14159, 65536.5, 1e30, 1e-30, -0.7]


@triton.jit
def _mul_kernel(s_ptr, out_ptr, n, f32, exact, f_hi, f_lo, f_exp, f_neg, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    s = tl.load(s_ptr + idx, mask=m, other=1.0)
    tl.store(out_ptr + idx, _mul_f64_rn(s, f32, exact != 0, f_hi, f_lo, f_exp, f_neg), mask=m)


def test_split_factor_is_exact():
    for f in FACTORS:
        f32, exact, hi, lo, e, neg = split_factor(f)
        assert (-1) ** neg * (hi * 2**26 + lo) * 2.0**e == f
        assert bool(exact) == (float(torch.tensor(f, dtype=torch.float32)) == f)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) reports inf/NaN inputs
@pytest.mark.parametrize("f", FACTORS)
def test_product_rounds_like_fp64(f):
    """fp32(fp64(s) * f) over random bit patterns (every exponent, subnormals, zeros, infs, NaNs) and over a
    run of consecutive mantissas, where double rounding (fp64 then fp32) decides some results."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-2**31, 2**31 - 1, (30000,), generator=gen, dtype=torch.int64).to(torch.int32)
    run = torch.arange(0, 30000, dtype=torch.int32) * 277 + 0x3F800000  # [1, 2): 30000 spread mantissas
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1.0, 65536.0, 1e-45, 3e38, 1.1754942e-38, 2**-130])
    s = torch.cat([bits.view(torch.float32), run.view(torch.float32), special]).to(DEVICE)
    expected = (s.double() * f).float()
    nan = expected.isnan()
    f32, exact, *parts = split_factor(f)
    for force_int in sorted({exact, 0}):  # factors exact in fp32 also through the integer path
        out = torch.empty_like(s)
        block = 16384 if INTERPRET else 256
        _mul_kernel[(triton.cdiv(s.numel(), block),)](s, out, s.numel(), f32, int(exact and not force_int), *parts,
                                                       BLOCK=block)
        assert torch.equal(out.isnan(), nan)
        assert_bitwise(f"scale * {f}", out[~nan], expected[~nan])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) reports the fp32 overflow
@pytest.mark.parametrize("growth,backoff,start", [
    (2.0, 0.5, 65536.0), (1.5, 0.7, 65536.0), (2.0, 0.333, 65536.0), (1.0001, 0.9, 65536.0),
    (2.0, 0.5, 3.0e38), (1.5, 0.7, 3.0e38),  # growth past fp32 max is refused
    (2.0, 0.5, 1.7e-38), (1.5, 0.333, 1.7e-38),  # backoff into subnormals
])
def test_update_scale_follows_reference(growth, backoff, start):
    found = [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    scale = torch.tensor(start, device=DEVICE)
    tracker = torch.tensor(0, dtype=torch.int32, device=DEVICE)
    ref_scale, ref_tracker = scale.clone(), tracker.clone()
    for i, f in enumerate(found):
        fi = torch.tensor(float(f), device=DEVICE)
        ops.update_scale_(scale, tracker, fi, growth, backoff, 3, backend="triton")
        reference.update_scale_(ref_scale, ref_tracker, fi, growth, backoff, 3)
        assert_bitwise(f"scale after {i + 1} updates", scale, ref_scale)
        assert_bitwise(f"tracker after {i + 1} updates", tracker, ref_tracker)
    assert math.isfinite(scale.item())
