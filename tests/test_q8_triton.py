"""8-bit moments in the Triton step kernels, bit for bit: codes, block scales, parameters, masters or remainders,
step counts, with every weight format, step after step.

* SGD (momentum, Nesterov) against the reference (the specification) itself.
* Adam / AdamW against the specification's codec applied to the Triton backend's own fp32 step: from the same
  weights, the moments decoded (``q8_dequantize``), one step with fp32 moments, then each parameter's new
  moments quantized (``q8_quantize``) with its draws. The fp32 step's math differs from the reference's by an
  ulp at places (torch's CPU ``lerp`` is a fused multiply-add, the kernels round each operation; the bias
  corrections' ``expm1``), which test_state_precision_ops.py holds to its tolerance; what 8-bit moments add
  (decode, block exponents, encode, scales) is held exactly here.

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


def _relayout(src, src_offsets, dst, dst_offsets):
    """``dst`` with each parameter's slice of the flat buffer ``src`` copied to its place in ``dst``'s layout."""
    for n, a, b in zip(SIZES, src_offsets, dst_offsets):
        dst[b:b + n] = src[a:a + n]
    return dst


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

    def decoded(self):
        """A copy of this run with its moments decoded to fp32 (no block scales) in the fp32 layout (parameters
        at multiples of 4), the weights and steps the same."""
        wide = Run(self.fmt, self.optimizer)
        wide.offsets, total = state_layout(SIZES)
        for dst, src in zip([memory_view(p) for p in wide.params] + [wide.steps],
                            [memory_view(p) for p in self.params] + [self.steps]):
            dst.copy_(src)
        exps = sp.q8_exponent(self.scales).repeat_interleave(sp.QBLOCK, dim=1)[:, :self.states[0].numel()]
        flat = [sp.q8_decode(c, e, signed=k == 0) for k, (c, e) in enumerate(zip(self.states, exps))]
        if self.master is not None:
            flat.append(self.master)
        moved = [_relayout(t, self.offsets, t.new_zeros(total), wide.offsets) for t in flat]
        wide.states = moved[:len(self.states)]
        wide.master = moved[-1] if self.master is not None else None
        if self.fmt == "no-master":  # the same fp32 math with an fp32 master holding the weights: its new values
            # are what the weights are rounded from (with draws of this run's indices: see weights_like)
            wide.master = torch.cat([memory_view(p).float() for p in self.params])
            wide.master = _relayout(wide.master, state_layout(SIZES, 1)[0], wide.master.new_zeros(total),
                                    wide.offsets)
        wide.scales = None
        return wide

    def quantized_like(self, wide, steps_before):
        """(codes, scales) expected of this run's step: those it had, with each stepped parameter's blocks the
        quantization of ``wide``'s new fp32 moments with the parameter's draws (stream 1 + moment row)."""
        codes = [c.clone() for c in self.states]
        scales = self.scales.clone()
        for i, (p, o) in enumerate(zip(self.params, self.offsets)):
            n = p.numel()
            if i == NO_GRAD or steps_before[i] == wide.steps[i]:
                continue
            t = int(steps_before[i].item()) + 1
            first = o // sp.QBLOCK
            wo = wide.offsets[i]
            for row, m in enumerate(wide.states):
                rand = sp.random_bits(sp.stream_key(int(self.seed), t, sp.STREAM_STATE1 + row),
                                      torch.arange(o, o + n, dtype=torch.int64))
                c, sc = sp.q8_quantize(m[wo:wo + n].cpu(), row == 0, rand)
                codes[row][o:o + n] = c.to(codes[row].device)
                scales[row, first:first + sc.numel()] = sc.to(scales.device)
        return codes, scales

    def weights_like(self, wide, steps_before):
        """The parameters expected of this run's step (no master: ``wide``'s new masters rounded
        stochastically with this run's draws, stream 0), in memory order."""
        if self.fmt != "no-master":
            return [memory_view(p) for p in wide.params]
        out = []
        for i, (p, o, wo) in enumerate(zip(self.params, self.offsets, wide.offsets)):
            n = p.numel()
            if i == NO_GRAD or steps_before[i] == wide.steps[i]:
                out.append(memory_view(p).clone())
                continue
            t = int(steps_before[i].item()) + 1
            rand = sp.random_bits(sp.stream_key(int(self.seed), t, sp.STREAM_WEIGHT),
                                  torch.arange(o, o + n, dtype=torch.int64))
            out.append(sp.round_stochastic(wide.master[wo:wo + n].cpu(), rand).to(p.device))
        return out

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
@pytest.mark.parametrize("fmt, optimizer", [(f, "sgd") for f in FORMATS] + [("remainder", "sgd-nesterov")])
def test_q8_sgd_matches_the_reference_bit_for_bit(fmt, optimizer):
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


@pytest.mark.parametrize("fmt, optimizer", [(f, "adamw") for f in FORMATS] + [("fp32-master", "adam")])
def test_q8_adam_is_the_codec_around_the_fp32_step_bit_for_bit(fmt, optimizer):
    fast = Run(fmt, optimizer)
    for k in range(3):
        before = [t.clone() for t in fast.tensors()]
        wide = fast.decoded()
        steps_before = fast.steps.clone()
        out_wide, out_fast = wide.step(k, "triton"), fast.step(k, "triton")
        assert_bitwise(f"out_stats at step {k}", out_fast, out_wide)
        _check_skip_and_clip(k, out_fast, fast, before)
        codes, scales = fast.quantized_like(wide, steps_before)
        expected = fast.weights_like(wide, steps_before) + codes + [scales, wide.steps]
        if fast.master is not None:
            expected.append(_relayout(wide.master, wide.offsets, fast.master.clone(), fast.offsets))
        for i, (a, b) in enumerate(zip(fast.tensors(), expected)):
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
