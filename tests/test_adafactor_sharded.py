"""Adafactor's step over shards (FSDP2: ``ampfused.ops.reference_adafactor.adafactor_step_sharded_``), without a
process group: each rank is a thread, and the reduction sums the ranks' buffers in rank order.

* One rank: the whole-parameter step (``adafactor_step_``) bit for bit.
* Two and three ranks, each parameter split along rows, columns or a batch dimension in ``torch.chunk``'s pieces
  (so some ranks hold fewer rows, or none): the pieces joined are the whole step within the oracle rule
  (tests/oracle.py: the fp64 whole step is the oracle, the fp32 one sets the bound), factors included.
"""
import math
import threading

import pytest
import torch

from ampfused.ops import reference
from ampfused.ops.reference_adafactor import (adafactor_step_, adafactor_step_sharded_, factor_layout, factor_views,
                                              shard_sums)
from oracle import assert_bitwise, assert_close_to_oracle

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


def _grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 0.1).to(dtype) for s, _ in SPLITS]


def _args(params, dtype):
    factors = torch.zeros(factor_layout([p.shape for p in params])[1], dtype=dtype)
    return factors, torch.zeros(len(params)), torch.zeros(2)


def _whole_run(dtype, max_norm):
    torch.manual_seed(0)
    params = [torch.randn(s).to(dtype) for s, _ in SPLITS]
    factors, steps, stats = _args(params, dtype)
    for k in range(STEPS):
        grads = _grads(k, dtype)
        partials = reference.norm_check(grads, torch.ones(()))
        adafactor_step_(params, grads, None, factors, steps, partials, torch.ones(()), torch.tensor(1e-2), stats,
                        max_norm=max_norm, **HYPER)
    return params, factors


class _Ranks:
    """A reduction over ``world`` threads: each rank's buffer, summed in rank order, handed to every rank."""

    def __init__(self, world):
        self.world, self.bufs = world, [None] * world
        self.barrier = threading.Barrier(world)

    def reduce_of(self, rank):
        def reduce(t):
            self.bufs[rank] = t.clone()
            self.barrier.wait()
            total = self.bufs[0].clone()
            for b in self.bufs[1:]:
                total = total + b
            self.barrier.wait()
            t.copy_(total)
        return reduce


def _sharded_run(world, max_norm, dims=None):
    torch.manual_seed(0)
    whole = [torch.randn(s) for s, _ in SPLITS]
    dims = [d for _, d in SPLITS] if dims is None else dims
    ranks = _Ranks(world)
    out, errors = [None] * world, []

    def rank_main(r):
        try:
            params = [_pieces(w, world, d)[r] if d is not None else w.clone() for w, d in zip(whole, dims)]
            factors, steps, stats = _args(params, F32)
            for k in range(STEPS):
                grads_whole = _grads(k, F32)
                partials = reference.norm_check(grads_whole, torch.ones(()))  # the all-reduced norm partials
                grads = [_pieces(g, world, d)[r] if d is not None else g for g, d in zip(grads_whole, dims)]
                adafactor_step_sharded_(params, grads, None, factors, steps, partials, torch.ones(()),
                                        torch.tensor(1e-2), stats, HYPER["beta2_decay"], HYPER["eps1"],
                                        HYPER["eps2"], HYPER["d"], HYPER["weight_decay"], max_norm, False, None,
                                        [s for s, _ in SPLITS], dims, ranks.reduce_of(r))
            out[r] = (params, factors)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            ranks.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


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


@pytest.mark.parametrize("max_norm", [math.inf, 0.05])
def test_one_rank_is_the_whole_step_bit_for_bit(max_norm):
    (params, factors), = _sharded_run(1, max_norm)
    want_p, want_f = _whole_run(F32, max_norm)
    for i, (a, b) in enumerate(zip(params, want_p)):
        assert_bitwise(f"param[{i}]", a, b)
    assert_bitwise("factors", factors, want_f)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("max_norm", [math.inf, 0.05])
def test_shards_joined_are_the_whole_step(world, max_norm):
    dims = [d for _, d in SPLITS]
    out = _sharded_run(world, max_norm)
    ref32, f32 = _whole_run(F32, max_norm)
    ref64, f64 = _whole_run(F64, max_norm)
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

