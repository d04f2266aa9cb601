"""The CPU backend's compact-state step runs each parameter in blocks of 256 elements (csrc/cpu/compact_span.h):
a block whose new values hold no NaN stores through NaN-free forms of the roundings, any other through the
general ones; with 8-bit moments a block is one block of codes, decoded and encoded by forms of their own
(q8_decode_cpu; math.h's q8_encode_normal). Here NaN and inf are planted in a few blocks of the weights and the
moments, next to blocks without them, on sizes around the block's length: the CPU's bits must still be the
reference's (SGD without clipping, where the backends agree bit for bit), NaNs included, except the NaNs of the
bf16 weights rounded to nearest from an fp32 master, where the CPU keeps the NaN's sign and top payload bits
(math.h: from_f32<bf16_t>) and the reference does not: there a NaN only has to be a NaN. Every 8-bit code at
every block exponent decodes to the reference's value on every instruction set.
"""
import math

import pytest
import torch

from ampfused import _native, ops
from ampfused.ops import state_precision as sp
from ampfused.ops.reference import STATE_ALIGN, memory_view, state_layout
from backends import cpu_backends

BF16, F32 = torch.bfloat16, torch.float32
NUMELS = [255, 256, 257, 1300]  # a partial block, one block, one and a bit, five blocks and a partial one
MODES = {  # master format, compact moments (False: fp32, True: bf16, "q8": 8-bit codes)
    "remainder": ("remainder", False),
    "remainder-bf16-moments": ("remainder", True),
    "fp32-master-bf16-moments": ("fp32", True),
    "no-master": ("none", False),
    "no-master-bf16-moments": ("none", True),
    "remainder-q8-moments": ("remainder", "q8"),
    "fp32-master-q8-moments": ("fp32", "q8"),
    "no-master-q8-moments": ("none", "q8"),
}
# in the masters a NaN with every payload bit set (its fp32 bits plus a rounding's addend would carry out of
# the exponent: only the general forms keep it a NaN), in the moments the default NaN; inf and -inf
SPECIAL_MASTER = [torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(F32).item(), math.inf, -math.inf]
SPECIAL_MOMENT = [math.nan, math.inf, -math.inf]


def _problem(master_format, moments):
    g = torch.Generator().manual_seed(7)
    q8 = moments == "q8"
    offsets, total = state_layout(NUMELS, sp.QBLOCK if q8 else STATE_ALIGN)
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
    # 8-bit codes cannot hold a NaN (a non-finite moment saturates): the masters' specials reach the moments
    # through the weight decay
    state, scales = sp.q8_quantize(momentum, True) if q8 else (momentum.to(BF16) if moments else momentum, None)
    steps = torch.tensor([3.0, 0.0, 11.0, 1.0])
    seed = torch.tensor(987654321, dtype=torch.int64) if (moments or master_format == "none") else None
    return params, master, state, scales, steps, seed


def _run(mode, backend, n_steps=2):
    params, master, state, scales, steps, seed = _problem(*MODES[mode])
    for k in range(n_steps):
        gen = torch.Generator().manual_seed(50 + k)
        grads = [torch.randn(n, generator=gen).to(BF16) for n in NUMELS]
        inv_scale = torch.tensor(0.5)
        partials = ops.norm_check(grads, inv_scale, backend=backend)
        ops.sgd_step_(params, grads, master, state, steps, partials, inv_scale, torch.tensor(1e-2), torch.zeros(2),
                      momentum=0.9, weight_decay=0.01, max_norm=math.inf, seed=seed,
                      state_scales=None if scales is None else scales.view(1, -1), backend=backend)
    return [memory_view(p) for p in params] + [state, steps] + ([master] if master is not None else []) + \
        ([scales] if scales is not None else [])


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
    # the specials did spread: the step met them (NaN in the last parameter's weights or moments; 8-bit
    # moments saturate, their block at the largest exponent)
    assert torch.isnan(cpu[len(NUMELS) - 1].float()).any() or torch.isnan(cpu[len(NUMELS)].float()).any()
    if MODES[mode][1] == "q8":
        assert (sp.q8_exponent(cpu[-1]) == sp.Q8_MAX_EXP).any()


# ---- 8-bit codes: every code at every block exponent ------------------------------------------------------

EXPONENTS = torch.arange(sp.Q8_MIN_EXP, sp.Q8_MAX_EXP + 1)


def _on_every_isa(fn):
    """fn() run with each instruction set the CPU backend has here: [(isa, result)]."""
    mod = _native.module("cpu")
    current, outs = mod.isa(), []
    try:
        for isa in mod.supported_isas():
            mod.set_isa(isa)
            outs.append((isa, fn()))
    finally:
        mod.set_isa(current)
    return outs


def _every_code():
    """Every code once in each block of 256, block k at exponent EXPONENTS[k]: (codes, [1, blocks] scales)."""
    codes = torch.arange(256).repeat(len(EXPONENTS)).to(torch.uint8)
    return codes, sp.q8_scale(EXPONENTS).view(1, -1)


def _zero_step(backend, sgd):
    """One step from zero fp32 weights with zero gradients over every code: SGD with momentum 1, no dampening
    and lr 1 (the momentum stays its decoded value, the weight becomes 0 - that value), or Adam with beta1 0
    and beta2 1 (exp_avg_sq stays its decoded value). Returns the weights, the codes and the scales."""
    codes, scales = _every_code()
    n = codes.numel()
    param, grad, seed = torch.zeros(n), torch.zeros(n), torch.tensor(5, dtype=torch.int64)
    one, steps = torch.tensor(1.0), torch.tensor([4.0])
    partials = ops.norm_check([grad], one, backend=backend)
    if sgd:
        ops.sgd_step_([param], [grad], None, codes, steps, partials, one, one, torch.zeros(2), momentum=1.0,
                      seed=seed, state_scales=scales, backend=backend)
        return param, codes, scales
    exp_avg, both = torch.zeros(n, dtype=torch.uint8), torch.cat([torch.zeros_like(scales), scales])
    ops.adam_step_([param], [grad], None, exp_avg, codes, steps, partials, one, one, torch.zeros(2), beta1=0.0,
                   beta2=1.0, seed=seed, state_scales=both, backend=backend)
    return param, codes, both


def test_every_8bit_code_decodes_as_the_reference_on_every_isa():
    if "cpu" not in cpu_backends():
        pytest.skip("the CPU backend is not built")
    codes, scales = _every_code()
    decoded = sp.q8_decode(codes, EXPONENTS.repeat_interleave(256), True)
    ref_sgd, ref_adam = _zero_step("reference", True), _zero_step("reference", False)
    for isa, (sgd, adam) in _on_every_isa(lambda: (_zero_step("cpu", True), _zero_step("cpu", False))):
        # signed codes (momentum): the weights are 0 - the decoded values, exactly
        _assert_same(f"{isa}: weights from signed codes", sgd[0], torch.zeros_like(decoded) - decoded)
        for name, a, b in zip(("weights", "codes", "scales"), sgd, ref_sgd):
            _assert_same(f"{isa}: SGD {name}", a, b)
        # unsigned codes (exp_avg_sq), re-encoded from their unchanged values at each block's new exponent
        for name, a, b in zip(("codes", "scales"), adam[1:], ref_adam[1:]):
            _assert_same(f"{isa}: Adam exp_avg_sq {name}", a, b)
