"""The CPU backend's compact-state step runs each parameter in blocks of 256 elements (csrc/cpu/kernels_impl.h:
compact_span): a block whose new values hold no NaN stores through NaN-free forms of the roundings, any other
through the general ones. Here NaN and inf are planted in a few blocks of the weights and the moments, next
to blocks without them, on sizes around the block's length: the CPU's bits must still be the reference's
(SGD without clipping, where the backends agree bit for bit), NaNs included, except the NaNs of the bf16
weights rounded to nearest from an fp32 master, where the CPU keeps the NaN's sign and top payload bits
(math.h: from_f32<bf16_t>) and the reference does not: there a NaN only has to be a NaN.
"""
import math

import pytest
import torch

from ampfused import ops
from ampfused.ops import state_precision as sp
from ampfused.ops.reference import STATE_ALIGN, memory_view, state_layout
from backends import cpu_backends

BF16, F32 = torch.bfloat16, torch.float32
NUMELS = [255, 256, 257, 1300]  # a partial block, one block, one and a bit, five blocks and a partial one
MODES = {  # master format, bf16 moments
    "remainder": ("remainder", False),
    "remainder-bf16-moments": ("remainder", True),
    "fp32-master-bf16-moments": ("fp32", True),
    "no-master": ("none", False),
    "no-master-bf16-moments": ("none", True),
}
# in the masters a NaN with every payload bit set (its fp32 bits plus a rounding's addend would carry out of
# the exponent: only the general forms keep it a NaN), in the moments the default NaN; inf and -inf
SPECIAL_MASTER = [torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(F32).item(), math.inf, -math.inf]
SPECIAL_MOMENT = [math.nan, math.inf, -math.inf]


def _problem(master_format, bf16_moments):
    g = torch.Generator().manual_seed(7)
    offsets, total = state_layout(NUMELS, STATE_ALIGN)
    masters = torch.randn(total, generator=g)
    momentum = torch.randn(total, generator=g) * 1e-2
    # the last parameter: specials in its second block's weights and its fourth block's moments; its other
    # blocks (and the other parameters) have none
    o = offsets[-1]
    for k in range(3):
        masters[o + 256 + 17 * k] = SPECIAL_MASTER[k]
        momentum[o + 3 * 256 + 5 + 31 * k] = SPECIAL_MOMENT[k]
    if master_format == "remainder":
        weight, master = sp.split_master(masters)
    else:
        weight, master = masters.to(BF16), (masters.clone() if master_format == "fp32" else None)
    params = [weight[o:o + n].clone() for o, n in zip(offsets, NUMELS)]
    state = momentum.to(BF16) if bf16_moments else momentum
    steps = torch.tensor([3.0, 0.0, 11.0, 1.0])
    seed = torch.tensor(987654321, dtype=torch.int64) if (bf16_moments or master_format == "none") else None
    return params, master, state, steps, seed


def _run(mode, backend, n_steps=2):
    params, master, state, steps, seed = _problem(*MODES[mode])
    for k in range(n_steps):
        gen = torch.Generator().manual_seed(50 + k)
        grads = [torch.randn(n, generator=gen).to(BF16) for n in NUMELS]
        inv_scale = torch.tensor(0.5)
        partials = ops.norm_check(grads, inv_scale, backend=backend)
        ops.sgd_step_(params, grads, master, state, steps, partials, inv_scale, torch.tensor(1e-2), torch.zeros(2),
                      momentum=0.9, weight_decay=0.01, max_norm=math.inf, seed=seed, backend=backend)
    return [memory_view(p) for p in params] + [state, steps] + ([master] if master is not None else [])


def _assert_same(name, a, b, nan_bits=True):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(nan_a, nan_b), f"{name}: NaN at different elements"
    if a.dtype in (F32, BF16):
        bits = torch.int32 if a.dtype == F32 else torch.int16
        differ = a.view(bits) != b.view(bits)
    else:
        differ = a != b
    if not nan_bits:
        differ &= ~nan_a
    assert not differ.any(), f"{name}: {int(differ.sum())} elements differ, first at {differ.nonzero()[0].item()}"


@pytest.mark.parametrize("mode", list(MODES))
def test_blocks_with_nan_and_inf_match_the_reference(mode):
    if "cpu" not in cpu_backends():
        pytest.skip("the CPU backend is not built")
    ref, cpu = _run(mode, "reference"), _run(mode, "cpu")
    nearest = MODES[mode][0] == "fp32"
    for i, (a, b) in enumerate(zip(cpu, ref)):
        _assert_same(f"{mode}: tensor {i}", a, b, nan_bits=not (nearest and i < len(NUMELS)))
    # the specials did spread: the step met them (NaN in the last parameter's weights or moments)
    assert torch.isnan(cpu[len(NUMELS) - 1].float()).any() or torch.isnan(cpu[len(NUMELS)].float()).any()
