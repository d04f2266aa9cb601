"""8-bit moments in the Triton step kernels, bit for bit against the reference (the specification): codes, block
scales, parameters, masters or remainders, step counts, with every weight format, step after step, for SGD
(momentum, Nesterov), AdamW and Adam (every backend's fp32 math, Adam's bias corrections included, is the same
IEEE operations in one order).

Both backends are given the same reduced partials (one column: the norm's square and the flag), so the clip
coefficient is the same correctly rounded value on both, and clipping is on. The parameters' sizes put the
last block of a parameter anywhere (1, 7, 255, 256, 257, 1300 elements) and one parameter crosses a chunk of
the work list; one has no gradient; values span many binades (blocks with tiny, huge and zero values, codes in
the subnormal range); the second step of each run sees an inf gradient and must change nothing.
"""
import math

import pytest
import torch

from ampfused import ops
from ampfused.ops import state_precision as sp
from ampfused.ops.reference import memory_view, state_layout
from backends import TRITON_DEVICE, requires_triton
from oracle import assert_bitwise

pytestmark = requires_triton

BF16, F32 = torch.bfloat16, torch.float32
CROSS = 8192 + 300                                      # over one chunk of the Triton work list
SIZES = [1, 7, 255, 256, 300, 257, 1300, CROSS]
NO_GRAD = 4                                             # the parameter of 300 elements has no gradient
FIRST_STEPS = [0.0, 3.0, 0.0, 1.0, 7.0, 2.0, 0.0, 5.0]  # step counts before the run (0: SGD's first step)
FORMATS = ["fp32-params", "fp32-master", "remainder", "no-master"]


def _spread(n, g, binades=6.0):
    """Values whose magnitudes span many binades, with whole blocks of zeros and of tiny values."""
    x = torch.randn(n, generator=g) * torch.exp2(torch.randn(n, generator=g) * binades)
    if n > 600:
        x[256:512] = 0.0                                  # an all-zero block: the minimum exponent
        x[512:600] *= 2.0 ** -60                          # a tiny block part
    return x


class Run:
    """One problem's tensors on TRITON_DEVICE, the same values for every backend."""

    def __init__(self, fmt, optimizer):
        self.fmt, self.optimizer = fmt, optimizer
        g = torch.Generator().manual_seed(7)
        self.sgd = optimizer.startswith("sgd")
        self.nesterov = optimizer == "sgd-nesterov"
        self.decoupled = optimizer == "adamw"
        self.offsets, total = state_layout(SIZES, sp.QBLOCK)
        dev = TRITON_DEVICE
        masters = _spread(total, g, 3.0)
        pdtype = F32 if fmt == "fp32-params" else BF16
        self.params = [torch.empty(n, dtype=pdtype, device=dev) for n in SIZES]
        self.params[6] = torch.empty(26, 50, dtype=pdtype, device=dev).t()        # transposed: memory order
        if fmt == "remainder":
            weight, self.master = sp.split_master(masters)
        else:
            weight = masters.to(pdtype)
            self.master = masters.clone() if fmt == "fp32-master" else None
        for p, o in zip(self.params, self.offsets):
            memory_view(p).copy_(weight[o:o + p.numel()])
        self.master = self.master.to(dev) if self.master is not None else None
        moments = [_spread(total, g) * 1e-2 for _ in range(1 if self.sgd else 2)]
        if not self.sgd:
            moments[1] = moments[1] ** 2
        coded = [sp.q8_quantize(m, signed=k == 0) for k, m in enumerate(moments)]
        self.states = [c.to(dev) for c, _ in coded]
        self.scales = torch.stack([s for _, s in coded]).to(dev)
        self.steps = torch.tensor(FIRST_STEPS, device=dev)
        self.seed = torch.tensor(-(2 ** 40) + 977, dtype=torch.int64, device=dev)
        self.grads = []
        for k in range(3):
            gk = [(torch.empty_like(p).copy_(_spread(p.numel(), g, 4.0).reshape(p.shape)) if i != NO_GRAD else None)
                  for i, p in enumerate(self.params)]  # each with its parameter's strides
            if k == 1:  # an overflow: this step is skipped
                gk[-1][17] = math.inf
            self.grads.append(gk)

    def tensors(self):
        out = [memory_view(p) for p in self.params] + self.states + [self.scales, self.steps]
        return out + ([self.master] if self.master is not None else [])

    def step(self, k, backend):
        grads = self.grads[k]
        inv_scale = torch.tensor(0.25, device=TRITON_DEVICE)
        parts = ops.norm_check([x for x in grads if x is not None], inv_scale, backend="reference")
        partials = torch.stack([parts[0].sum(), parts[1].amax()]).reshape(2, 1)
        out = torch.zeros(2, device=TRITON_DEVICE)
        if self.sgd:
            ops.sgd_step_(self.params, grads, self.master, self.states[0], self.steps, partials, inv_scale,
                          torch.tensor(1e-2, device=TRITON_DEVICE), out, momentum=0.9, dampening=0.1,
                          weight_decay=0.01, nesterov=self.nesterov, max_norm=2.0, seed=self.seed,
                          state_scales=self.scales, backend=backend)  # (None: fp32 moments)
        else:
            step = ops.adamw_step_ if self.decoupled else ops.adam_step_
            step(self.params, grads, self.master, self.states[0], self.states[1], self.steps, partials, inv_scale,
                 torch.tensor(1e-3, device=TRITON_DEVICE), out, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.01, max_norm=2.0, seed=self.seed, state_scales=self.scales, backend=backend)
        return out


def _check_skip_and_clip(k, out_fast, fast, before):
    if k == 1:
        assert out_fast[1].item() == 1.0
        for i, (a, b) in enumerate(zip(fast.tensors(), before)):
            assert_bitwise(f"tensor {i} after a skipped step", a, b)
    else:
        assert out_fast[0].item() > 2.0  # the clip is on


# every weight format once; the variants of the update (Nesterov, L2 decay), which the 8-bit path does not see,
# with one format each (the interpreter costs seconds a step)
@pytest.mark.parametrize("fmt, optimizer", [(f, "sgd") for f in FORMATS] + [("remainder", "sgd-nesterov")]
                         + [(f, "adamw") for f in FORMATS] + [("fp32-master", "adam")])
def test_q8_step_matches_the_reference_bit_for_bit(fmt, optimizer):
    ref, fast = Run(fmt, optimizer), Run(fmt, optimizer)
    for k in range(3):
        before = [t.clone() for t in fast.tensors()]
        out_ref, out_fast = ref.step(k, "reference"), fast.step(k, "triton")
        assert_bitwise(f"out_stats at step {k}", out_fast, out_ref)
        _check_skip_and_clip(k, out_fast, fast, before)
        # (the gaps between parameters in the flat buffers, never written by the reference, held too)
        for i, (a, b) in enumerate(zip(fast.tensors(), ref.tensors())):
            assert_bitwise(f"{fmt} {optimizer}: tensor {i} after step {k}", a, b)
    assert not torch.equal(fast.scales, Run(fmt, optimizer).scales)


def test_state_scales_are_checked_before_anything_changes():
    r = Run("no-master", "adamw")
    before = [t.clone() for t in r.tensors()]
    args = (r.params, r.grads[0], r.master, r.states[0], r.states[1], r.steps, torch.zeros(2, 1, device=r.steps.device),
            torch.tensor(1.0, device=r.steps.device), torch.tensor(1e-3, device=r.steps.device),
            torch.zeros(2, device=r.steps.device))
    with pytest.raises(ValueError, match=r"exp_avg is uint8 \(8-bit moments\): pass state_scales="):
        ops.adamw_step_(*args, seed=r.seed, backend="triton")
    with pytest.raises(TypeError, match="state_scales must be a float32 tensor"):
        ops.adamw_step_(*args, seed=r.seed, state_scales=r.scales.to(torch.float16), backend="triton")
    with pytest.raises(ValueError, match="state_scales must be a contiguous fp32 tensor of shape"):
        ops.adamw_step_(*args, seed=r.seed, state_scales=r.scales[:1], backend="triton")
    with pytest.raises(ValueError, match="state_scales must be a contiguous fp32 tensor of shape"):
        ops.adamw_step_(*args, seed=r.seed, state_scales=r.scales[:, :-1], backend="triton")
    wide = [s.float() for s in r.states]
    with pytest.raises(ValueError, match="state_scales are the block scales of 8-bit"):
        ops.adamw_step_(*args[:3], *wide, *args[5:], seed=r.seed, state_scales=r.scales, backend="triton")
    for i, (a, b) in enumerate(zip(r.tensors(), before)):
        assert_bitwise(f"tensor {i}", a, b)
