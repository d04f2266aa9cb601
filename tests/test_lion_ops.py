"""ops.lion_step_ on every backend the CPU suite runs (reference, cpu, Triton under the interpreter) against the
specification (reference.lion_step_), bit for bit given one clip coefficient, in every state-precision mode; the
skip; awkward sizes and layouts; the fp32 reference against an fp64 one within the oracle's rule; bad input.
"""
import math

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference, state_precision as sp
from ampfused.ops.reference import memory_view, state_layout
from backends import cpu_backends
from oracle import assert_bitwise, assert_close_to_oracle

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
BACKENDS = cpu_backends()

# (shape, layout, has a gradient): empty, one element, a prime, just past the CPU's block of 8192 and a Triton
# block, channels_last, a transpose, one left alone
PARAMS = [((0,), "contiguous", True), ((1,), "contiguous", True), ((127,), "contiguous", True),
          ((8193,), "contiguous", True), ((3, 4, 5, 7), "channels_last", True), ((45, 23), "transposed", True),
          ((300,), "contiguous", False)]
# parameter dtype, master ("fp32", "remainder", "none" or None: fp32 parameters are their own), moment dtype
MODES = {
    "fp32-params": (F32, None, F32),
    "fp32-params-bf16-moment": (F32, None, BF16),
    "fp32-params-q8-moment": (F32, None, torch.uint8),
    "bf16-fp32-master": (BF16, "fp32", F32),
    "fp16-fp32-master": (F16, "fp32", F32),
    "bf16-fp32-master-bf16-moment": (BF16, "fp32", BF16),
    "bf16-fp32-master-q8-moment": (BF16, "fp32", torch.uint8),
    "remainder": (BF16, "remainder", F32),
    "remainder-bf16-moment": (BF16, "remainder", BF16),
    "remainder-q8-moment": (BF16, "remainder", torch.uint8),
    "no-master": (BF16, "none", F32),
    "no-master-bf16-moment": (BF16, "none", BF16),
    "no-master-q8-moment": (BF16, "none", torch.uint8),
}


def _shaped(shape, layout, flat):
    if layout == "channels_last":
        return flat.reshape(shape).contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return flat.reshape(shape[::-1]).t()
    return flat.reshape(shape)


class Problem:
    """Parameters, master and moment of one mode, from one seed (the same values for every backend)."""

    def __init__(self, mode: str, params=PARAMS, gen_seed: int = 0):
        pdt, master, mdt = MODES[mode]
        g = torch.Generator().manual_seed(gen_seed)
        numels = [math.prod(s) for s, _, _ in params]
        self.layout = params
        self.offsets, total = state_layout(numels, sp.QBLOCK if mdt == torch.uint8 else reference.STATE_ALIGN)
        masters = torch.randn(total, generator=g)
        if master == "remainder":
            weight, self.master = sp.split_master(masters)
        else:
            weight, self.master = masters.to(pdt), (masters.clone() if master == "fp32" else None)
        self.params = [_shaped(s, lay, torch.zeros(n, dtype=pdt)) for (s, lay, _), n in zip(params, numels)]
        for p, o in zip(self.params, self.offsets):
            memory_view(p).copy_(weight[o:o + p.numel()])
        moment = torch.randn(total, generator=g) * 1e-2
        self.scales = None
        if mdt == torch.uint8:
            self.exp_avg, scales = sp.q8_quantize(moment, signed=True)
            self.scales = scales.reshape(1, -1).contiguous()
        else:
            self.exp_avg = moment.to(mdt)
        self.steps = torch.arange(len(params), dtype=F32)
        self.seed = torch.tensor(2 ** 40 + 77, dtype=torch.int64) if (mdt != F32 or master == "none") else None

    def grads(self, k, dtype=None, inject=None):
        g = torch.Generator().manual_seed(100 + k)
        dtype = dtype or self.params[0].dtype
        out = [_shaped(s, lay, torch.randn(math.prod(s), generator=g).to(dtype)) if has else None
               for s, lay, has in self.layout]
        if inject is not None:
            out[3].view(-1)[5] = inject
        return out

    def tensors(self):
        out = [memory_view(p) for p in self.params] + [self.exp_avg, self.steps]
        return out + [t for t in (self.master, self.scales) if t is not None]

    def step(self, grads, backend, max_norm=math.inf, partials=None, lr=1e-2, weight_decay=0.1, **kw):
        inv_scale = torch.tensor(0.25)
        if partials is None:  # one clip coefficient for every backend: the reference's norm, reduced
            live = [g for g in grads if g is not None]
            norm, flag = ops.reduce_partials(ops.norm_check(live, inv_scale, backend="reference"))
            partials = torch.stack([norm * norm, flag]).reshape(2, 1)
        out = torch.zeros(2)
        ops.lion_step_(self.params, grads, self.master, self.exp_avg, self.steps, partials, inv_scale,
                       torch.tensor(lr), out, beta1=kw.pop("beta1", 0.9), beta2=kw.pop("beta2", 0.99),
                       weight_decay=weight_decay, max_norm=max_norm, seed=self.seed, state_scales=self.scales,
                       backend=backend, **kw)
        return out


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("max_norm", [math.inf, 3.0])
def test_backend_bitwise_reference(backend, mode, max_norm):
    ref, fast = Problem(mode), Problem(mode)
    for k in range(3):
        ref.step(ref.grads(k), "reference", max_norm)
        fast.step(fast.grads(k), backend, max_norm)
        for i, (a, b) in enumerate(zip(fast.tensors(), ref.tensors())):
            assert_bitwise(f"{mode} step {k} tensor {i}", a, b)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("hyper", [dict(beta1=0.3, beta2=0.6, maximize=True),  # lerp's large-weight form
                                   dict(beta1=0.0, beta2=0.999, weight_decay=0.0)])
def test_backend_bitwise_other_hyperparameters(backend, hyper):
    ref, fast = Problem("fp32-params"), Problem("fp32-params")
    for k in range(2):
        ref.step(ref.grads(k), "reference", **hyper)
        fast.step(fast.grads(k), backend, **hyper)
    for i, (a, b) in enumerate(zip(fast.tensors(), ref.tensors())):
        assert_bitwise(f"tensor {i}", a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["bf16-fp32-master", "remainder-q8-moment", "no-master-bf16-moment"])
def test_skip_changes_nothing(backend, mode):
    prob = Problem(mode)
    prob.step(prob.grads(0), backend)
    before = [t.clone() for t in prob.tensors()]
    out = prob.step(prob.grads(1, inject=math.nan), backend)
    assert out[1].item() == 1.0
    for i, (a, b) in enumerate(zip(prob.tensors(), before)):
        assert_bitwise(f"tensor {i} after a skipped step", a, b)
    prob.step(prob.grads(2), backend)  # and the next step runs
    assert not torch.equal(memory_view(prob.params[2]), memory_view(before[2]))


def test_reference_fp32_within_oracle_of_fp64():
    """The fp32 reference and the same math in fp64 (fp32 parameters, no master): the oracle rule, with a
    second fp32 evaluation (the CPU backend where built) as the fast one."""
    fast = "cpu" if "cpu" in BACKENDS else "reference"
    r32, f32 = Problem("fp32-params"), Problem("fp32-params")
    p64 = [p.double() for p in r32.params]
    m64, s64 = r32.exp_avg.double(), r32.steps.double()
    for k in range(4):
        grads = r32.grads(k)
        r32.step(grads, "reference", 3.0)
        f32.step(grads, fast, 3.0)
        live = [g.double() if g is not None else None for g in grads]
        part = reference.norm_check([g for g in live if g is not None], torch.tensor(0.25, dtype=torch.float64))
        reference.lion_step_(p64, live, None, m64, s64, part.float(), torch.tensor(0.25),
                             torch.tensor(1e-2, dtype=torch.float64), torch.zeros(2), 0.9, 0.99, 0.1, 3.0)
    for i in range(len(PARAMS)):
        assert_close_to_oracle(f"param {i}", f32.params[i], r32.params[i], p64[i])
    assert_close_to_oracle("exp_avg", f32.exp_avg, r32.exp_avg, m64)


def test_sign_of_zero_moves_nothing():
    """sign(0) = 0: a zero gradient on a zero moment leaves the weight as it is (no decay)."""
    p, g = torch.ones(5), torch.zeros(5)
    m, steps = torch.zeros(5), torch.zeros(1)
    ops.lion_step_([p], [g], None, m, steps, torch.zeros(2, 1), torch.tensor(1.0), torch.tensor(0.1), torch.zeros(2))
    assert torch.equal(p, torch.ones(5)) and torch.equal(m, torch.zeros(5)) and steps.item() == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_fail_before_any_change(backend):
    prob = Problem("bf16-fp32-master", params=PARAMS[:3])
    before = [t.clone() for t in prob.tensors()]
    grads = prob.grads(0)
    cases = [
        (dict(exp_avg=torch.zeros(3)), ValueError, "exp_avg must have"),
        (dict(exp_avg=torch.zeros(prob.exp_avg.numel(), dtype=F16)), TypeError, "exp_avg must have dtype"),
        (dict(master=None), ValueError, "needs an fp32 master"),
        (dict(beta1=math.nan), ValueError, "beta1 must be finite"),
        (dict(grads=grads[:2]), ValueError, "grads must have one entry per parameter"),
        (dict(lr=torch.tensor(1e-2, dtype=F16)), TypeError, "lr must have dtype"),
    ]
    for change, exc, msg in cases:
        args = dict(params=prob.params, grads=grads, master=prob.master, exp_avg=prob.exp_avg, steps=prob.steps,
                    partials=torch.zeros(2, 1), inv_scale=torch.tensor(1.0), lr=torch.tensor(1e-2),
                    out_stats=torch.zeros(2))
        args.update({k: v for k, v in change.items() if k in args})
        kw = {k: v for k, v in change.items() if k not in args}
        with pytest.raises(exc, match=msg):
            ops.lion_step_(*args.values(), backend=backend, **kw)
    for i, (a, b) in enumerate(zip(prob.tensors(), before)):
        assert_bitwise(f"tensor {i}", a, b)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("options", [{}, dict(bf16_stochastic_round=True, exp_avg_dtype=torch.uint8)])
def test_optimizer_tables_bitwise_reference(backend, options):
    """FusedLion through the backend's step from a table (the host pass's path) against the reference backend's
    Python path: the same bits without clipping (one coefficient: the inverse scale)."""
    import ampfused
    init = [torch.randn(s) for s in ((33, 7), (257,), (1,))]
    runs = []
    for be in (backend, "reference"):
        ps = [torch.nn.Parameter(x.to(BF16)) for x in init]
        opt = ampfused.FusedLion(ps, lr=1e-2, weight_decay=0.1, backend=be, **options)
        for k in range(3):
            for p, g in zip(ps, Problem("fp32-params", params=[(tuple(p.shape), "contiguous", True) for p in ps])
                            .grads(k, BF16)):
                p.grad = g
            opt.step()
        runs.append([p.detach() for p in ps] + [opt.state[p]["exp_avg"] for p in ps])
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise(f"tensor {i}", a, b)
