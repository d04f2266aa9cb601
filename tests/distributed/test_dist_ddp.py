"""DistributedDataParallel with ampfused.FusedAdamW and ampfused.GradScaler on gloo processes.

DDP all-reduces the gradients into the buckets the gradients are views of (``gradient_as_bucket_view=True``),
every rank's fused step reads them there, and since every rank reduces to the same bits, every rank takes the
same step: the same global norm, the same overflow and spike decisions, bitwise the same parameters, masters and
moments. With the exact data of ``dist_data`` the run is also bitwise the single-process run on the
concatenated batch, and within the oracle's tolerance of torch's fp32-master recipe.
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ampfused
import dist_data as D
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise, assert_close_to_oracle
from recipe import TorchRecipe

ROWS = 8  # rows per rank and step
STEPS = 5
INF_STEP, SPIKE_STEP = 2, 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM = 4.0


def _data(world):
    x, c = D.batches(STEPS, world * ROWS)
    x[INF_STEP, ROWS, 0] = float("inf")  # rank 1's first row only
    c[SPIKE_STEP, :ROWS] *= 64  # rank 0's rows only
    return x, c


def _guard(spike_norm):
    return ampfused.SpikeGuard(max_norm=spike_norm)


def _train(model, x, c, world, spike_norm, rank=None):
    """The loop both sides run: ``rank=None`` is the single-process run on the whole batch."""
    params = list(model.parameters())
    net = model if rank is None else DDP(model, gradient_as_bucket_view=True)
    opt = ampfused.FusedAdamW(params, **HYPER, max_grad_norm=MAX_NORM, spike_guard=_guard(spike_norm))
    scaler = ampfused.GradScaler("cpu")
    rows = slice(None) if rank is None else slice(rank * ROWS, (rank + 1) * ROWS)
    skipped, bucket_views = [], True
    for s in range(STEPS):
        xs, cs = x[s, rows], c[s, rows]
        loss = (net(xs) * cs).sum() / xs.shape[0]
        scaler.scale(loss).backward()
        if rank is not None:  # the all-reduce landed in the gradients: one bucket, no copy
            storages = {p.grad.untyped_storage().data_ptr() for p in params}
            bucket_views &= len(storages) == 1
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(opt.last_step_skipped))
        opt.zero_grad()
    return D.snapshot(opt, params, {"skipped": skipped, "scale": scaler.get_scale(), "bucket_views": bucket_views})


def _ddp_worker(rank, world, out, init, spike_norm):
    model = D.linear_model()
    model.load_state_dict(init)
    x, c = _data(world)
    save(out, rank, _train(model, x, c, world, spike_norm, rank))


def _spike_norm(world):
    """A threshold above every clean step's global norm and below the spiked one's."""
    x, c = _data(world)
    norms = [torch.cat([g.flatten() for g in D.exact_grads(x[s], c[s], world * ROWS)]).norm() for s in range(STEPS)]
    clean = max(n for s, n in enumerate(norms) if s not in (INF_STEP, SPIKE_STEP))
    assert norms[SPIKE_STEP] > 2 * clean
    return float(2 * clean)


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_step_is_the_single_process_step_on_every_rank(tmp_path, world):
    init = D.linear_model().state_dict()
    spike = _spike_norm(world)
    run_ranks(_ddp_worker, world, str(tmp_path), init, spike)
    ranks = load(tmp_path, world)

    model = D.linear_model()
    x, c = _data(world)
    single = _train(model, x, c, world, spike)
    assert single["skipped"] == [s in (INF_STEP, SPIKE_STEP) for s in range(STEPS)]
    for r, got in enumerate(ranks):
        assert got["bucket_views"], "DDP's gradients were not views of its buckets"
        assert got["skipped"] == single["skipped"] and got["scale"] == single["scale"] == 2.0 ** 15
        for key in ("params", "master_param", "exp_avg", "exp_avg_sq", "step"):
            for i, (a, b) in enumerate(zip(got[key], single[key])):
                assert_bitwise(f"rank {r} {key}[{i}] vs the single-process run", a, b)

    # the single-process run (and so every rank) against torch's fp32-master recipe and its fp64 twin
    params = list(D.linear_model().parameters())
    hyper = dict(HYPER)
    ref32 = TorchRecipe(params, torch.optim.AdamW, hyper, max_norm=MAX_NORM)
    ref64 = TorchRecipe(params, torch.optim.AdamW, hyper, max_norm=MAX_NORM, master_dtype=torch.float64)
    for s in range(STEPS):
        if s in (INF_STEP, SPIKE_STEP):
            continue
        grads = D.exact_grads(x[s], c[s], world * ROWS)
        ref32.step(grads)
        ref64.step(grads)
    for i in range(len(params)):
        assert_close_to_oracle(f"master[{i}]", ranks[-1]["master_param"][i], ref32.masters[i], ref64.masters[i])


NOSYNC_ROWS = 4  # rows per micro-batch and rank; two micro-batches per step


def _token_mask(world, steps):
    """Rows that count as tokens: a different number on every rank and micro-batch (never none)."""
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(steps, world, 2, NOSYNC_ROWS, generator=g) < 0.6
    mask[..., 0] = True
    return mask


def _accumulate_loop(model, opt, scaler, x, c, mask, world, rank=None):
    """Sum-reduced losses over two micro-batches, one step per global batch divided by the global token count."""
    for s in range(x.shape[0]):
        if rank is None:  # every rank's micro-batches at once
            m = mask[s].reshape(-1, 1).to(torch.bfloat16)
            loss = (model(x[s]) * c[s] * m).sum()
            scaler.scale(loss).backward()
            tokens = mask[s].sum()
        else:
            tokens = torch.zeros((), dtype=torch.int64)
            for micro in range(2):
                lo = (rank * 2 + micro) * NOSYNC_ROWS
                rows = slice(lo, lo + NOSYNC_ROWS)
                m = mask[s, rank, micro].reshape(-1, 1).to(torch.bfloat16)
                if micro == 0:
                    with model.no_sync():
                        scaler.scale((model(x[s, rows]) * c[s, rows] * m).sum()).backward()
                else:
                    scaler.scale((model(x[s, rows]) * c[s, rows] * m).sum()).backward()
                tokens += mask[s, rank, micro].sum()
            tokens = ampfused.distributed.global_sum(tokens)
        scaler.step(opt, grad_divisor=tokens)
        scaler.update()
        opt.zero_grad()


def _nosync_worker(rank, world, out, init):
    model = D.linear_model()
    model.load_state_dict(init)
    ddp = DDP(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, ampfused.distributed.sum_hook)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, max_grad_norm=MAX_NORM)
    scaler = ampfused.GradScaler("cpu")
    x, c = D.batches(3, world * 2 * NOSYNC_ROWS)
    _accumulate_loop(ddp, opt, scaler, x, c, _token_mask(world, 3), world, rank)
    save(out, rank, D.snapshot(opt, list(model.parameters())))


def test_ddp_no_sync_accumulation_with_the_global_token_count(tmp_path):
    world = 4
    init = D.linear_model().state_dict()
    run_ranks(_nosync_worker, world, str(tmp_path), init)
    ranks = load(tmp_path, world)
    model = D.linear_model()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, max_grad_norm=MAX_NORM)
    x, c = D.batches(3, world * 2 * NOSYNC_ROWS)
    _accumulate_loop(model, opt, ampfused.GradScaler("cpu"), x, c, _token_mask(world, 3), world)
    single = D.snapshot(opt, list(model.parameters()))
    assert float(single["step"][0]) == 3
    for r, got in enumerate(ranks):
        for key in ("params", "master_param", "exp_avg", "exp_avg_sq", "step"):
            for i, (a, b) in enumerate(zip(got[key], single[key])):
                assert_bitwise(f"rank {r} {key}[{i}] vs the single-process run", a, b)


def test_ampfused_distributed_reached_from_the_package_alone():
    """``import ampfused`` then ``ampfused.distributed.sum_hook``, as a DDP script writes it: the submodule is
    imported on first use (a fresh interpreter, so no other test has imported it already)."""
    import subprocess
    import sys
    code = ("import ampfused, sys; assert 'ampfused.distributed' not in sys.modules; "
            "print(ampfused.distributed.sum_hook.__name__, ampfused.ShardedFusedAdamW.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sum_hook", "ShardedFusedAdamW"]
