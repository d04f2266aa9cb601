"""Compact optimizer state at the ops level, on every backend the CPU suite runs (reference, cpu, Triton under
the interpreter), against the specification (ampfused/ops/state_precision.py, reference.py).

* Master remainders: on each backend the masters equal, bit for bit, those of the fp32-master mode fed the same
  gradients, step after step (clipping on); the weights are the masters rounded to nearest with ties away from
  zero, so they differ from the fp32-master mode's weights only at exact ties.
* Stochastic rounding (no master, bf16 moments) and 8-bit moments: the generator is keyed by (seed, step,
  index), and every backend's fp32 math is the same IEEE operations in one order (Adam's bias corrections
  included), so backends agree bit for bit, given the same clip coefficient (each sums the norm in its own
  order: without clipping, or given the same partials).
* A skipped step changes nothing (the generator's position is the step count, which does not advance); a run
  resumed from copies of its tensors equals the uninterrupted one; the CPU backend's bits do not depend on its
  thread count.
"""
import math

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference, state_precision as sp
from ampfused.ops.reference import memory_view, state_layout
from backends import cpu_backends
from oracle import assert_bitwise

BF16, F32 = torch.bfloat16, torch.float32
BACKENDS = cpu_backends()

# (shape, layout, has a gradient, step count before the first step)
PARAMS = [
    ((1,), "contiguous", True, 3),
    ((5,), "contiguous", True, 0),
    ((127,), "contiguous", True, 41),
    ((300,), "contiguous", False, 7),       # no gradient: left alone
    ((3, 4, 5, 7), "channels_last", True, 1),
    ((45, 23), "transposed", True, 0),
]
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


def _param(shape, layout, values):
    if layout == "channels_last":
        return values.reshape(shape).contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return values.reshape(shape[::-1]).t()
    return values.reshape(shape)


class Problem:
    """bf16 parameters and fp32 masters whose low 16 bits are random (so remainders are never trivial), in
    one of the formats; the same masters for every format."""

    def __init__(self, master_format: str, bf16_moments: bool, sgd: bool, gen_seed: int = 0):
        g = torch.Generator().manual_seed(gen_seed)
        numels = [math.prod(s) for s, _, _, _ in PARAMS]
        q8 = bf16_moments == "q8"
        self.offsets, total = state_layout(numels, sp.QBLOCK if q8 else reference.STATE_ALIGN)
        masters = torch.randn(total, generator=g)
        self.params = [_param(s, lay, torch.zeros(n, dtype=BF16)) for (s, lay, _, _), n in zip(PARAMS, numels)]
        if master_format == "remainder":
            weight, self.master = sp.split_master(masters)
        else:
            weight, self.master = masters.to(BF16), (masters.clone() if master_format == "fp32" else None)
        for p, o in zip(self.params, self.offsets):
            memory_view(p).copy_(weight[o:o + p.numel()])
        sdt = BF16 if bf16_moments else F32
        self.states = [torch.randn(total, generator=g).abs().to(sdt) * 1e-3 for _ in range(1 if sgd else 2)]
        self.scales = None
        if q8:  # the same values as 8-bit codes (the whole flat buffer in blocks: the parameters' own blocks)
            coded = [sp.q8_quantize(s.float(), signed=k == 0) for k, s in enumerate(self.states)]
            self.states = [c for c, _ in coded]
            self.scales = torch.stack([sc for _, sc in coded])
        self.steps = torch.tensor([float(s) for _, _, _, s in PARAMS])
        self.seed = torch.tensor(-(2 ** 40) + 12345, dtype=torch.int64) if (bf16_moments or master_format == "none") \
            else None
        self.sgd = sgd

    def tensors(self):
        out = [memory_view(p) for p in self.params] + self.states + [self.steps]
        return out + ([self.master] if self.master is not None else []) + \
            ([self.scales] if self.scales is not None else [])

    def master_values(self):
        """The fp32 masters of the parameters, concatenated (rebuilt from the remainders, or from the buffer)."""
        if self.master is None:
            return None
        if self.master.dtype == F32:
            return torch.cat([self.master[o:o + p.numel()] for p, o in zip(self.params, self.offsets)])
        return torch.cat([sp.join_master(memory_view(p), self.master[o:o + p.numel()])
                          for p, o in zip(self.params, self.offsets)])


def _grads(problem, k, dtype=BF16):
    g = torch.Generator().manual_seed(100 + k)
    return [_param(s, lay, torch.randn(math.prod(s), generator=g).to(dtype)) if has else None
            for (s, lay, has, _) in PARAMS]


def _step(problem, grads, backend, max_norm=5.0, partials=None, lr=None):
    inv_scale = torch.tensor(0.5)
    if partials is None:
        partials = ops.norm_check([g for g in grads if g is not None], inv_scale, backend=backend)
    out = torch.zeros(2)
    if problem.sgd:
        ops.sgd_step_(problem.params, grads, problem.master, problem.states[0], problem.steps, partials, inv_scale,
                      torch.tensor(lr or 1e-2), out, momentum=0.9, weight_decay=0.01, max_norm=max_norm,
                      seed=problem.seed, state_scales=problem.scales, backend=backend)
    else:
        ops.adamw_step_(problem.params, grads, problem.master, problem.states[0], problem.states[1], problem.steps,
                        partials, inv_scale, torch.tensor(lr or 1e-3), out, weight_decay=0.01, max_norm=max_norm,
                        seed=problem.seed, state_scales=problem.scales, backend=backend)
    return out


def _run(mode, sgd, backend, n_steps, **kw):
    p = Problem(*MODES[mode], sgd=sgd) if mode in MODES else Problem(mode, False, sgd=sgd)
    for k in range(n_steps):
        _step(p, _grads(p, k), backend, **kw)
    return p


# ---- the codecs (the specification itself) ----------------------------------------------------------------

def _special_and_random_bits(n=1 << 16):
    special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7F8000, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008000, 0x00018000,
               0x80008000, 0x80018000, 0x00000001, 0x7FC00001, 0x7F800001, 0x7F808000, 0xFFFF0000, 0x3F808000,
               0x3F818000, 0x3F807FFF]
    u = torch.cat([torch.randint(0, 2 ** 32, (n,), dtype=torch.int64), torch.tensor(special, dtype=torch.int64)])
    return u, torch.where(u >= 2 ** 31, u - 2 ** 32, u).to(torch.int32).view(F32)


def test_remainder_code_is_exact_and_ties_away_from_zero():
    u, x = _special_and_random_bits()
    w, r = sp.split_master(x)
    back = sp.join_master(w, r)
    nan = torch.isnan(x)
    assert_bitwise("join(split(master))", back[~nan], x[~nan])
    assert torch.isnan(back[nan]).all() and torch.isnan(w[nan].float()).all()
    # the weight is round-to-nearest-even except at exact ties with an even high half: one ulp away from zero
    rne = x.to(BF16)
    differ = (w.view(torch.int16) != rne.view(torch.int16)) & ~nan
    even_tie = ((u & 0xFFFF) == 0x8000) & (((u >> 16) & 1) == 0) & ~nan
    assert torch.equal(differ, even_tie)
    step = (w[even_tie].view(torch.int16).to(torch.int64) & 0x7FFF) - (rne[even_tie].view(torch.int16).to(torch.int64)
                                                                       & 0x7FFF)
    assert (step == 1).all()
    # a remainder of 0 is the weight's own value (what a weight written from outside re-derives)
    assert_bitwise("join(w, 0)", sp.join_master(w[~nan], torch.zeros_like(r[~nan])), w[~nan].float())


def test_stochastic_rounding_is_unbiased_and_keyed():
    x = torch.full((1 << 16,), 1.0 + 2 ** -10)  # 1/8 of a bf16 ulp above 1
    key = sp.step_key(7, 3)
    r = sp.random_bits(key, torch.arange(x.numel()))
    # each stream rounds with its own rotation of the element's one draw, and each is unbiased
    for stream in (sp.STREAM_WEIGHT, sp.STREAM_STATE1, sp.STREAM_STATE2):
        y = sp.round_stochastic(x, sp.stream_bits(r, stream)).float()
        assert set(y.unique().tolist()) == {1.0, 1.0078125}
        assert abs(y.mean().item() - x[0].item()) < 4 * (2 ** -7) * math.sqrt(0.125 * 0.875 / x.numel())
    # stream k's bits: the draw rotated left by 11 k bits
    assert sp.stream_bits(0x80000001, 0) == 0x80000001
    assert sp.stream_bits(0x80000001, 1) == (1 << 10) | (1 << 11)
    assert sp.stream_bits(0x80000001, 2) == (1 << 21) | (1 << 22)
    assert torch.equal(sp.stream_bits(r, 2), sp.stream_bits(sp.stream_bits(r, 1), 1))
    # the key is the weight's key of the three-stream generator before it (weights' draws kept across the change)
    assert key == 2219174911 and sp.step_key(2 ** 40 + 5, 9) == 1086537531
    # the keys of tensors and Python ints agree, and every component changes the draws
    assert int(sp.step_key(torch.tensor(7), torch.tensor(3))) == key
    assert len({sp.step_key(7, 3), sp.step_key(8, 3), sp.step_key(7, 4), sp.step_key(7 + 2 ** 32, 3)}) == 4
    # inf stays inf, NaN stays NaN, whatever the draw
    special = torch.tensor([math.inf, -math.inf, math.nan, -0.0])
    out = sp.round_stochastic(special, torch.full((4,), 0xFFFF, dtype=torch.int64)).float()
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2]) and out[3] == 0


def test_q8_codes_are_unbiased_exact_to_decode_and_saturate():
    g = torch.Generator().manual_seed(3)
    for signed in (True, False):
        # values over many binades in one block of 256: decoded codes are x in expectation (stochastic rounding)
        x = torch.randn(sp.QBLOCK, generator=g) * torch.exp(torch.randn(sp.QBLOCK, generator=g) * 2)
        x = x if signed else x.abs()
        n = 2000  # draws of the whole block at once: n copies of it, each element at its own index
        _, scales = sp.q8_quantize(x, signed)
        exponent = sp.q8_exponent(scales).expand(n * sp.QBLOCK)
        rand = sp.stream_bits(sp.random_bits(sp.step_key(1, 1), torch.arange(n * sp.QBLOCK)), 1 if signed else 2)
        codes = sp.q8_encode(x.repeat(n), exponent, rand, signed)
        mean = sp.q8_decode(codes, exponent, signed).double().view(n, sp.QBLOCK).mean(dim=0)
        top = x.abs().max().item()
        # one draw errs by at most a code step (2^-3 of the value, or the subnormal spacing): the mean of n
        # draws by a few standard errors of that
        step = torch.clamp(x.abs().double() * 2 ** -3, min=top * 2 ** -16)
        assert ((mean - x.double()).abs() <= 5 * step / math.sqrt(n) + 1e-30).all()
        # the scale is the power of two of the block's largest value; to nearest, codes are within half a step
        codes, scales = sp.q8_quantize(x, signed)
        assert scales.item() == 2.0 ** math.floor(math.log2(top))
        back = sp.q8_dequantize(codes, scales, signed)
        assert ((back - x).abs() <= torch.clamp(x.abs() * 2 ** -4, min=top * 2 ** -17) * 1.0001).all()
        # every code decodes to a finite value, and decoding what it encodes gives the same code back
        every = torch.arange(256, dtype=torch.int64).to(torch.uint8)
        for e in (sp.Q8_MIN_EXP, 127, sp.Q8_MAX_EXP):
            exp = torch.full((256,), e, dtype=torch.int64)
            values = sp.q8_decode(every, exp, signed)
            assert torch.isfinite(values).all()
            again = sp.q8_encode(values, exp, None, signed)
            same = (again == every) | ((values == 0) & ((again.to(torch.int64) & 0x7F) == 0))
            assert same.all()
    # non-finite values saturate to the largest code; a fresh (zero) state decodes to zeros
    special = torch.tensor([math.inf, -math.inf, math.nan, 0.0])
    codes, scales = sp.q8_quantize(special, True)
    assert codes[:3].tolist() == [0x7F, 0xFF, 0x7F] and scales.item() == 2.0 ** (sp.Q8_MAX_EXP - 127)
    zeros = sp.q8_dequantize(torch.zeros(300, dtype=torch.uint8), torch.zeros(2), False)
    assert (zeros == 0).all()


def test_q8_values_below_the_normal_range_are_carried_into_it():
    """A value under F (the smallest normal code's value) is encoded through the fp32 sum F + |x|: multiples of the
    subnormal step are exact whatever the draw, an fp32 subnormal is 0, and the rest round stochastically without
    bias, down to values far below the step (2^-15 of the normal range: past the 31 bits a shift-and-mask
    encoder could drop)."""
    g = torch.Generator().manual_seed(5)
    for signed in (True, False):
        top = sp.Q8_TOP[signed]
        exponent = 127
        floor = 2.0 ** (exponent - top + 1 - 127)
        step = floor / 8
        n = 1 << 16
        e = torch.full((n,), exponent, dtype=torch.int64)
        rand = torch.randint(0, 2 ** 32, (n,), generator=g)
        for k in range(9):  # k steps: the code of magnitude k (8: the smallest normal code)
            x = torch.full((n,), (-1.0 if signed else 1.0) * k * step)
            codes = sp.q8_encode(x, e, rand, signed).to(torch.int64)
            assert ((codes & 0x7F if signed else codes) == k).all()
            assert torch.equal(sp.q8_decode(codes.to(torch.uint8), e, signed), x)
        tiny = sp.q8_encode(torch.full((n,), 1e-40), e, rand, signed)  # an fp32 subnormal
        assert (tiny == 0).all()
        for frac in (0.3, 2.0 ** -12):
            m = 1 << 22 if frac < 0.01 else n
            x = torch.full((m,), frac * step)
            r = torch.randint(0, 2 ** 32, (m,), generator=g)
            value = sp.q8_decode(sp.q8_encode(x, e[:1].expand(m), r, signed), e[:1].expand(m), signed).double()
            assert set(value.unique().tolist()) <= {0.0, step}
            p = frac  # the probability of the step
            assert abs(value.mean().item() / step - p) < 5 * math.sqrt(p * (1 - p) / m)


# ---- the step ops -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sgd", [False, True], ids=["adamw", "sgd"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_remainders_rebuild_the_fp32_masters_bit_for_bit(backend, sgd):
    full = _run("fp32", sgd, backend, 3)
    compact = _run("remainder", sgd, backend, 3)
    assert_bitwise("masters", compact.master_values(), full.master_values())
    for i, (pc, pf) in enumerate(zip(compact.params, full.params)):
        o, n = compact.offsets[i], pc.numel()
        weight, _ = sp.split_master(full.master[o:o + n])
        assert_bitwise(f"params[{i}]", memory_view(pc), weight)
        # against the fp32-master mode's weights: equal except at exact ties of the master
        low = full.master[o:o + n].view(torch.int32).to(torch.int64) & 0xFFFF
        differ = memory_view(pc).view(torch.int16) != memory_view(pf).view(torch.int16)
        assert (low[differ] == 0x8000).all()
    for a, b in zip(compact.states + [compact.steps], full.states + [full.steps]):
        assert_bitwise("states", a, b)


@pytest.mark.parametrize("mode", [m for m in MODES])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_sgd_compact_modes_match_the_reference_bit_for_bit(backend, mode):
    # no clipping: the coefficient is inv_scale on every backend, and SGD's element math is IEEE operations in
    # one order, so the stochastic rounding (same keys, same indices) must give the same bits too
    ref = _run(mode, True, "reference", 3, max_norm=math.inf)
    fast = _run(mode, True, backend, 3, max_norm=math.inf)
    for a, b in zip(fast.tensors(), ref.tensors()):
        assert_bitwise(mode, a, b)


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("mode", ["fp32"] + [m for m in MODES])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_adam_compact_modes_match_the_reference_bit_for_bit(backend, mode, clip):
    # Adam's per-step constants are IEEE operations in one order on every backend (the bias corrections'
    # expm1 included: reference.expm1_nonpositive), as is its element math, so the stochastic rounding (same
    # keys, same indices) gives the same bits too. The parameters' step counts (0 to 44) put t * log(beta1) on
    # both sides of expm1's two forms. Clipping: each backend's norm sums its partials in its own order, so
    # both are given one column of them (the clip coefficient is then one correctly rounded value).
    def run(b):
        p = Problem(*MODES[mode], sgd=False) if mode in MODES else Problem(mode, False, sgd=False)
        for k in range(3):
            grads = _grads(p, k)
            parts = ops.norm_check([g for g in grads if g is not None], torch.tensor(0.5), backend="reference")
            partials = torch.stack([parts[0].sum(), parts[1].amax()]).reshape(2, 1)  # one column: no order
            _step(p, grads, b, max_norm=5.0 if clip else math.inf, partials=partials)
        return p
    ref, fast = run("reference"), run(backend)
    for a, b in zip(fast.tensors(), ref.tensors()):
        assert_bitwise(mode, a, b)


@pytest.mark.parametrize("sgd", [False, True], ids=["adam", "sgd"])
@pytest.mark.parametrize("mode", [m for m in MODES if MODES[m][1] == "q8"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_8bit_moments_below_the_normal_range_match_the_reference(backend, mode, sgd):
    # moments and gradients spread over 2^40 in every block: most new moments fall below their block's normal
    # range (the encoder's carried form), many below its smallest code
    def run(b):
        p = Problem(*MODES[mode], sgd=sgd)
        g = torch.Generator().manual_seed(199)
        total = p.states[0].numel()
        wide = [torch.randn(total, generator=g) * torch.exp2(-40 * torch.rand(total, generator=g))
                for _ in p.states]
        coded = [sp.q8_quantize(v if k == 0 else v.abs(), signed=k == 0) for k, v in enumerate(wide)]
        p.states = [c for c, _ in coded]
        p.scales = torch.stack([sc for _, sc in coded])
        for k in range(3):
            g = torch.Generator().manual_seed(200 + k)
            grads = [_param(sh, lay, (torch.randn(math.prod(sh), generator=g)
                                      * torch.exp2(-40 * torch.rand(math.prod(sh), generator=g))).to(BF16))
                     if has else None for (sh, lay, has, _) in PARAMS]
            _step(p, grads, b, max_norm=math.inf)
        return p
    ref, fast = run("reference"), run(backend)
    mag = torch.cat([s.flatten().to(torch.int64) & (0x7F if k == 0 else 0xFF) for k, s in enumerate(ref.states)])
    assert (mag < 8).float().mean() > 0.2 and ((mag > 0) & (mag < 8)).float().mean() > 0.02
    for a, b in zip(fast.tensors(), ref.tensors()):
        assert_bitwise(mode, a, b)


@pytest.mark.parametrize("beta1", [0.0, 0.1])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_adam_hyperparameters_match_the_reference_bit_for_bit(backend, beta1):
    # the other forms of the update: L2 decay (Adam), maximize, lerp's large-weight form (beta1 = 0.1: 1 - w is
    # formed from w rounded to fp32, as torch.lerp forms it; beta1 = 0: log(beta1) = -inf, a bias correction of
    # 1) and a small beta2 (t * log(beta2) past expm1's series)
    def run(b):
        p = Problem("fp32", False, sgd=False)  # fp32 masters and moments: every fp32 bit shows
        for k in range(3):
            grads = _grads(p, k)
            ops.adam_step_(p.params, grads, p.master, p.states[0], p.states[1], p.steps, torch.zeros(2, 1),
                           torch.tensor(0.5), torch.tensor(1e-3), torch.zeros(2), beta1=beta1, beta2=0.5, eps=1e-6,
                           weight_decay=0.01, max_norm=math.inf, decoupled=False, maximize=True, seed=p.seed,
                           backend=b)
        return p
    ref, fast = run("reference"), run(backend)
    for a, b in zip(fast.tensors(), ref.tensors()):
        assert_bitwise("adam", a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_rounds_each_operation_as_written(backend):
    # m + (1 - beta1) * (g - m) with each operation rounded (torch.lerp fuses it into an fma where its kernel
    # has one): for g = -9 m with few significant bits, (g - m) * 0.1f rounds to -m and the new m is exactly 0,
    # where an fma would leave -m * 2^-26. The moments stay fp32 (no rounding after), so 0 is what is stored.
    m = torch.tensor([1.5, -1.25, 1.75, 1.0, -1.5], dtype=F32) * 2.0 ** -10
    n = m.numel()
    param = torch.zeros(n, dtype=BF16)
    grad = (-9 * m / 0.5).to(BF16)  # the step multiplies by inv_scale = 0.5
    assert torch.equal(grad.float() * 0.5, -9 * m)
    exp_avg, exp_avg_sq, master = m.clone(), torch.full((n,), 1e-6), torch.zeros(n)
    ops.adamw_step_([param], [grad], master, exp_avg, exp_avg_sq, torch.tensor([4.0]), torch.tensor([[0.0], [0.0]]),
                    torch.tensor(0.5), torch.tensor(1e-3), torch.zeros(2), beta1=0.9, max_norm=math.inf,
                    backend=backend)
    assert_bitwise("exp_avg", exp_avg, torch.zeros(n))


def test_bias_corrections_are_expm1_to_two_ulp():
    # reference.expm1_nonpositive (every backend's bias corrections) against fp64 expm1 rounded to fp32, over
    # t * log(beta) from -1e-12 to -40 (and 0, -inf)
    x = torch.cat([-torch.logspace(-12, math.log10(40), 20001), torch.tensor([0.0, -0.5, -24.0, -math.inf])]).float()
    got = reference.expm1_nonpositive(x)
    want = torch.tensor([math.expm1(v) for v in x.double().tolist()], dtype=torch.float64).float()
    ulp = (want.abs().view(torch.int32) + 1).view(F32) - want.abs()
    assert ((got - want).abs() <= 2 * ulp).all()
    assert got[-4].item() == 0.0 and got[-2].item() == -1.0 and got[-1].item() == -1.0


# (each format of the weight once, and bf16 moments, which every stochastic draw of the moments goes through)
@pytest.mark.parametrize("sgd", [False, True], ids=["adamw", "sgd"])
@pytest.mark.parametrize("mode", ["remainder-bf16-moments", "no-master-bf16-moments", "fp32-master-bf16-moments",
                                  "no-master-q8-moments"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_step_changes_nothing(backend, mode, sgd):
    p = _run(mode, sgd, backend, 1)
    before = [t.clone() for t in p.tensors()]
    grads = _grads(p, 5)
    flagged = torch.tensor([[1.0], [1.0]])  # a non-finite gradient was seen
    out = _step(p, grads, backend, partials=flagged)
    assert out[1].item() == 1.0
    for a, b in zip(p.tensors(), before):
        assert_bitwise(mode, a, b)
    # and the next step draws what it would have drawn without the skip in between
    _step(p, grads, backend)
    q = _run(mode, sgd, backend, 1)
    _step(q, grads, backend)
    for a, b in zip(p.tensors(), q.tensors()):
        assert_bitwise(mode, a, b)


@pytest.mark.parametrize("mode", ["no-master-bf16-moments", "remainder-bf16-moments", "remainder-q8-moments"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_run_equals_the_uninterrupted_one(backend, mode):
    whole = _run(mode, False, backend, 3)
    first = _run(mode, False, backend, 2)
    resumed = Problem(*MODES[mode], sgd=False)
    for dst, src in zip(resumed.tensors(), first.tensors()):  # what a checkpoint holds, in fresh tensors
        dst.copy_(src)
    resumed.seed = first.seed.clone()
    _step(resumed, _grads(resumed, 2), backend)
    for a, b in zip(resumed.tensors(), whole.tensors()):
        assert_bitwise(mode, a, b)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
@pytest.mark.parametrize("mode", ["no-master-bf16-moments", "remainder", "no-master-q8-moments"])
def test_cpu_bits_do_not_depend_on_the_thread_count(mode):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(mode, False, "cpu", 2)
        torch.set_num_threads(max(2, threads))
        many = _run(mode, False, "cpu", 2)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one.tensors(), many.tensors()):
        assert_bitwise(mode, a, b)


def test_bad_compact_state_is_refused_before_anything_changes():
    p = Problem("remainder", False, sgd=False)
    grads = _grads(p, 0)
    before = [t.clone() for t in p.tensors()]
    half = [x.to(torch.float16) for x in p.params]
    with pytest.raises(TypeError, match="master has dtype int16.*bfloat16 params"):
        ops.adamw_step_(half, [g.to(torch.float16) if g is not None else None for g in grads], p.master, *p.states,
                        p.steps, torch.zeros(2, 1), torch.tensor(1.0), torch.tensor(1e-3), torch.zeros(2))
    q = Problem("fp32", True, sgd=False)
    with pytest.raises(ValueError, match="exp_avg is bfloat16.*pass seed="):
        ops.adamw_step_(q.params, grads, q.master, *q.states, q.steps, torch.zeros(2, 1), torch.tensor(1.0),
                        torch.tensor(1e-3), torch.zeros(2))
    with pytest.raises(TypeError, match="seed must be a 0-d int64 tensor"):
        ops.adamw_step_(q.params, grads, q.master, *q.states, q.steps, torch.zeros(2, 1), torch.tensor(1.0),
                        torch.tensor(1e-3), torch.zeros(2), seed=torch.tensor(1.0))
    mixed = r"exp_avg must have dtype in \[.torch.float32.\] like exp_avg_sq.*one precision"
    with pytest.raises(TypeError, match=mixed):
        ops.adamw_step_(q.params, grads, q.master, q.states[0], q.states[1].float(), q.steps, torch.zeros(2, 1),
                        torch.tensor(1.0), torch.tensor(1e-3), torch.zeros(2), seed=torch.tensor(1))
    for a, b in zip(p.tensors(), before):
        assert_bitwise("unchanged", a, b)
