"""Adafactor's step over shards (FSDP2: its three phases, ``ampfused.ops.reference_adafactor.adafactor_step_shard_``
and the same phases of every backend's kernels), without a process group: the ranks run one after the other, each
phase on every rank, then each rank's sums to be summed over the ranks are summed in rank order and handed to
every rank (what the all-reduce between the phases does).

* One rank: the whole-parameter step of the same backend (``adafactor_step_``) bit for bit, whichever way the
  parameters say they are split (their sums read back from the buffer the phases share).
* Two and three ranks, each parameter split along rows, columns or a batch dimension in ``torch.chunk``'s pieces
  (so some ranks hold fewer rows, or none): the pieces joined are the whole step within the oracle rule
  (tests/oracle.py: the fp64 whole step is the oracle, the fp32 one sets the bound), factors included, on every
  backend; what every rank holds whole is the same bits on each.
"""
import math

import pytest
import torch

from ampfused import ops
from ampfused.ops import reference
from ampfused.ops.call import StepCall
from ampfused.ops.factored import ShardSums
from ampfused.ops.reference_adafactor import adafactor_step_, factor_layout, factor_views, shard_sums
from backends import cpu_backends
from oracle import assert_bitwise, assert_close_to_oracle

BACKENDS = cpu_backends()
F32, F64 = torch.float32, torch.float64
# (whole shape, the dimension it is split along)
SPLITS = [((7, 5), 0), ((13,), 0), ((3, 4, 5), 0), ((45, 23), 1), ((2, 9), 0), ((1, 6), 0), ((4, 3, 6), 2),
          ((6, 1), 0)]
HYPER = dict(beta2_decay=-0.8, eps1=1e-30, eps2=1e-3, d=1.0, weight_decay=0.1)
STEPS = 3


def _pieces(t, world, dim):
    """Rank ``r``'s piece of ``t`` split along ``dim`` as FSDP2 splits (``torch.chunk``; empty past the last)."""
    parts = list(torch.chunk(t, world, dim=dim))
    while len(parts) < world:
        shape = list(t.shape)
        shape[dim] = 0
        parts.append(t.new_empty(shape))
    return [p.contiguous() for p in parts]


def _grads(step, dtype, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 0.1).to(device, dtype) for s, _ in SPLITS]


def _args(params, dtype, device="cpu"):
    factors = torch.zeros(factor_layout([p.shape for p in params])[1], dtype=dtype, device=device)
    return factors, torch.zeros(len(params), device=device), torch.zeros(2, device=device)


def _whole_run(dtype, max_norm, backend="reference", device="cpu"):
    torch.manual_seed(0)
    params = [torch.randn(s).to(device, dtype) for s, _ in SPLITS]
    factors, steps, stats = _args(params, dtype, device)
    one, lr = torch.ones((), device=device), torch.tensor(1e-2, device=device)
    for k in range(STEPS):
        grads = _grads(k, dtype, device)
        partials = reference.norm_check(grads, one)
        if backend == "reference":
            adafactor_step_(params, grads, None, factors, steps, partials, one, lr, stats, max_norm=max_norm, **HYPER)
        else:
            h = dict(HYPER)
            eps = (h.pop("eps1"), h.pop("eps2"))
            ops.adafactor_step_(params, grads, None, factors, steps, partials, one, lr, stats, eps=eps,
                                max_norm=max_norm, backend=backend, **h)
    return params, factors


def _phases(ranks, grads_of, partials, max_norm, backend):
    """One step of every rank (``ranks``: ``(params, factors, steps, stats, ShardSums)`` each; ``grads_of(r)``:
    rank r's gradients): each phase on every rank, then the sums over the ranks."""
    for phase, part in ((1, "first"), (2, "second"), (3, None)):
        for r, (params, factors, steps, stats, sh) in enumerate(ranks):
            call = StepCall(ops.specs.SPECS["adafactor_step_"], params=params, grads=grads_of(r), master=None,
                            states={"factors": factors}, steps=steps, partials=partials,
                            inv_scale=torch.ones((), device=steps.device), lr=torch.tensor(1e-2, device=steps.device),
                            out_stats=stats, shard=(phase, sh),
                            hyper=dict(HYPER, max_norm=max_norm, maximize=False))
            ops.run_step(call, backend)
        if part is not None:
            total = None
            for *_, sh in ranks:
                piece = sh.sums[getattr(sh, part)]
                total = piece.clone() if total is None else total + piece
            for *_, sh in ranks:
                sh.sums[getattr(sh, part)].copy_(total)


def _sharded_run(world, max_norm, dims=None, backend="reference", device="cpu"):
    torch.manual_seed(0)
    whole = [torch.randn(s).to(device) for s, _ in SPLITS]
    dims = [d for _, d in SPLITS] if dims is None else dims
    ranks = []
    for r in range(world):
        params = [_pieces(w, world, d)[r] if d is not None else w.clone() for w, d in zip(whole, dims)]
        sh = ShardSums([p.shape for p in params], [s for s, _ in SPLITS], dims, device)
        ranks.append((params, *_args(params, F32, device), sh))
    for k in range(STEPS):
        grads_whole = _grads(k, F32, device)
        partials = reference.norm_check(grads_whole, torch.ones((), device=device))  # (all-reduced)
        grads = [[_pieces(g, world, d)[r] if d is not None else g for g, d in zip(grads_whole, dims)]
                 for r in range(world)]
        _phases(ranks, grads.__getitem__, partials, max_norm, backend)
    return [(params, factors) for params, factors, *_ in ranks]


def _joined_factors(out, world, dims):
    """Each parameter's row and column factors, the ranks' pieces joined as the DTensors of the state dict."""
    joined = []
    for i, ((shape, _), d) in enumerate(zip(SPLITS, dims)):
        per_rank = []
        for params, factors in out:
            offs, _ = factor_layout([p.shape for p in params])
            per_rank.append(factor_views(factors, offs[i], params[i].shape))
        row_partial, col_partial = shard_sums(shape, d)
        views = {}
        for key in per_rank[0]:
            whole_here = (key == "row_var" and row_partial) or (key == "col_var" and col_partial)
            views[key] = per_rank[0][key] if whole_here else torch.cat([v[key] for v in per_rank], dim=d)
        joined.append(views)
    return joined


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_norm", [math.inf, 0.05])
def test_one_rank_is_the_whole_step_bit_for_bit(max_norm, backend):
    want_p, want_f = _whole_run(F32, max_norm, backend)
    for dims in ([d for _, d in SPLITS], [None] * len(SPLITS)):
        (params, factors), = _sharded_run(1, max_norm, dims, backend)
        for i, (a, b) in enumerate(zip(params, want_p)):
            assert_bitwise(f"param[{i}] split along {dims[i]}", a, b)
        assert_bitwise("factors", factors, want_f)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,max_norm", [(2, math.inf), (3, 0.05)])
def test_shards_joined_are_the_whole_step(world, max_norm, backend):
    _check_joined(_sharded_run(world, max_norm, backend=backend), world, max_norm, "cpu")


def _check_joined(out, world, max_norm, device):
    dims = [d for _, d in SPLITS]
    ref32, f32 = _whole_run(F32, max_norm, device=device)
    ref64, f64 = _whole_run(F64, max_norm, device=device)
    offs, _ = factor_layout([s for s, _ in SPLITS])
    for i, ((shape, d), a32, a64) in enumerate(zip(SPLITS, ref32, ref64)):
        joined = torch.cat([params[i] for params, _ in out], dim=d)
        assert_close_to_oracle(f"param[{i}] {shape} split along {d}", joined, a32, a64)
    for i, (views, (shape, d)) in enumerate(zip(_joined_factors(out, world, dims), SPLITS)):
        want32, want64 = factor_views(f32, offs[i], shape), factor_views(f64, offs[i], shape)
        for key, v in views.items():
            assert_close_to_oracle(f"{key}[{i}] {shape} split along {d}", v, want32[key], want64[key])
    # the ranks' copies of what they all hold whole are the same bits
    for i, (shape, d) in enumerate(SPLITS):
        row_partial, col_partial = shard_sums(shape, d)
        for key, whole in (("row_var", row_partial), ("col_var", col_partial)):
            if whole:
                copies = []
                for params, factors in out:
                    o, _ = factor_layout([p.shape for p in params])
                    copies.append(factor_views(factors, o[i], params[i].shape)[key])
                for c in copies[1:]:
                    assert_bitwise(f"{key}[{i}] on every rank", c, copies[0])


def test_a_traced_phase_runs_its_reference():
    """Under a dispatch mode (as under tracing), a phase over shards has no custom op: it runs its reference, torch
    operations, whatever backend was named; the result is the reference's bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Through(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    want = _sharded_run(2, 0.05)
    backend = "cpu" if "cpu" in BACKENDS else "reference"
    with Through():
        got = _sharded_run(2, 0.05, backend=backend)
    for (pa, fa), (pb, fb) in zip(got, want):
        for i, (a, b) in enumerate(zip(pa, pb)):
            assert_bitwise(f"param[{i}]", a, b)
        assert_bitwise("factors", fa, fb)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_phases_over_shards(backend):
    """The CUDA kernel over shards (one block per parameter) and the compiled Triton phases on a GPU: one rank
    within the oracle rule of the whole step (Triton's bit for bit its whole step), two and three ranks joined
    within the oracle rule, the whole factors the same bits on every rank."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    reasons = ops.registry.reasons_for(backend, torch.device("cuda"))
    if reasons:
        pytest.skip(f"the {backend} backend cannot run on this GPU: " + "; ".join(reasons))
    (params, factors), = _sharded_run(1, 0.05, backend=backend, device="cuda")
    if backend == "triton":
        want_p, want_f = _whole_run(F32, 0.05, backend, "cuda")
        for i, (a, b) in enumerate(zip(params, want_p)):
            assert_bitwise(f"param[{i}]", a, b)
        assert_bitwise("factors", factors, want_f)
    else:
        _check_joined([(params, factors)], 1, 0.05, "cuda")
    for world, max_norm in ((2, math.inf), (3, 0.05)):
        _check_joined(_sharded_run(world, max_norm, backend=backend, device="cuda"), world, max_norm, "cuda")
