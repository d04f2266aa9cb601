"""ZeRO-1: ampfused.ShardedFusedAdamW / ShardedFusedSGD on gloo processes.

With the exact data of ``dist_data`` and no clipping, the sharded step is bitwise the single-process fused step on
the concatenated batch (the update is elementwise, and the global gradient is the same bits); with clipping the
global norm is summed in another order, so masters are compared with the oracle's tolerance instead.
"""
import os

import pytest
import torch

import ampfused
import dist_data as D
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise, assert_close_to_oracle
from recipe import TorchRecipe

ROWS = 8
STEPS = 5
INF_STEP, SPIKE_STEP = 2, 3
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
SPIKE_NORM = 40.0  # between the clean steps' global norms (< 10) and the spiked step's (> 100)


def _data(world, steps=STEPS, inject=True):
    x, c = D.batches(steps, world * ROWS)
    if inject:
        x[INF_STEP, ROWS % (world * ROWS), 0] = float("inf")  # rank 1 only (rank 0 in a world of one)
        c[SPIKE_STEP, :ROWS] *= 64  # rank 0 only
    return x, c


def _groups(model):
    """Two groups: decay on the weight; the bias group is small enough that some ranks own none of it."""
    return [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]


def _loop(model, opt, scaler, x, c, rows, steps):
    skipped = []
    for s in steps:
        xs, cs = x[s, rows], c[s, rows]
        scaler.scale((model(xs) * cs).sum() / xs.shape[0]).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(opt.last_step_skipped))
        opt.zero_grad()
    return skipped


def _single(world, max_norm, steps=range(STEPS), inject=True, model=None, opt=None):
    model = model or D.linear_model()
    opt = opt or ampfused.FusedAdamW(_groups(model), **ADAM, max_grad_norm=max_norm,
                                     spike_guard=ampfused.SpikeGuard(max_norm=SPIKE_NORM))
    x, c = _data(world, inject=inject)
    skipped = _loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(None), steps)
    return model, opt, skipped


def _zero_worker(rank, world, out, init, max_norm):
    model = D.linear_model()
    model.load_state_dict(init)
    opt = ampfused.ShardedFusedAdamW(_groups(model), **ADAM, max_grad_norm=max_norm,
                                     spike_guard=ampfused.SpikeGuard(max_norm=SPIKE_NORM))
    x, c = _data(world)
    skipped = _loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(rank * ROWS, (rank + 1) * ROWS), range(STEPS))
    owned = sorted({seg.group_index for s in opt._spaces for seg in s.segments})
    save(out, rank, {"params": [p.detach().clone() for p in model.parameters()], "skipped": skipped,
                     "state": opt.state_dict(), "owned": owned, "norm": opt.last_grad_norm.clone()})


def _assert_state_equal(got, want, where):
    assert sorted(got["state"]) == sorted(want["state"]), where
    for i, st in want["state"].items():
        for key, v in st.items():
            assert_bitwise(f"{where}: state[{i}][{key}]", got["state"][i][key], v)
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert g == w, where


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_adamw_is_the_single_process_step(tmp_path, world):
    init = D.linear_model().state_dict()
    run_ranks(_zero_worker, world, str(tmp_path), init, None)
    ranks = load(tmp_path, world)
    model, opt, skipped = _single(world, None)
    assert skipped == [s in (INF_STEP, SPIKE_STEP) for s in range(STEPS)]
    want = opt.state_dict()
    for r, got in enumerate(ranks):
        assert got["skipped"] == skipped, f"rank {r}"
        for i, p in enumerate(model.parameters()):
            assert_bitwise(f"rank {r} param[{i}]", got["params"][i], p.detach())
        _assert_state_equal(got["state"], want, f"rank {r}")
    if world == 4:  # 128 weight + 8 bias elements in shards of 34: only the last rank holds bias state
        assert [got["owned"] for got in ranks] == [[0], [0], [0], [0, 1]]


def test_sharded_adamw_clips_with_the_global_norm(tmp_path):
    world, max_norm = 2, 0.5
    init = D.linear_model().state_dict()
    run_ranks(_zero_worker, world, str(tmp_path), init, max_norm)
    ranks = load(tmp_path, world)
    for r in range(1, world):  # bitwise across ranks, norm included
        assert_bitwise(f"rank {r} norm", ranks[r]["norm"], ranks[0]["norm"])
        for i in range(2):
            assert_bitwise(f"rank {r} param[{i}]", ranks[r]["params"][i], ranks[0]["params"][i])
        _assert_state_equal(ranks[r]["state"], ranks[0]["state"], f"rank {r}")
    recipes = clip_oracle(world, max_norm)
    state = ranks[0]["state"]["state"]
    for i in range(2):
        assert_close_to_oracle(f"master[{i}]", state[i]["master_param"], recipes[0].masters[i], recipes[1].masters[i])


def clip_oracle(world, max_norm):
    """torch's master-weight recipe in fp32 and fp64 over the clean steps of ``_data(world)`` with clipping:
    the oracle pair that the masters of a clipped run are held to."""
    model = D.linear_model()
    x, c = _data(world)
    hyper = dict(ADAM, weight_decay=0.1)
    recipes = [TorchRecipe([model.weight, model.bias], torch.optim.AdamW, hyper, max_norm=max_norm, master_dtype=dt)
               for dt in (torch.float32, torch.float64)]
    for rec in recipes:
        rec.opt.param_groups[0]["weight_decay"] = 0.0  # one torch group for both: bias decay handled below
    for s in range(STEPS):
        if s in (INF_STEP, SPIKE_STEP):
            continue
        grads = D.exact_grads(x[s], c[s], world * ROWS)
        for rec in recipes:  # AdamW decay by hand on the weight only, as the two fused groups do
            with torch.no_grad():
                rec.masters[0].mul_(1 - hyper["lr"] * 0.1)
            rec.step(grads)
    return recipes


def _memory_worker(rank, world, out):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 80)).to(torch.bfloat16)
    opt = ampfused.ShardedFusedAdamW(model.parameters())
    save(out, rank, opt.state_bytes())


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_state_per_rank_is_divided_by_the_world_size(tmp_path, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 80)).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    run_ranks(_memory_worker, world, str(tmp_path))
    per_rank = load(tmp_path, world)
    # masters, exp_avg and exp_avg_sq (3 x fp32 = 12 bytes per element) of 1/world of the elements, plus at most
    # 3 elements of alignment per piece and one fp32 step count per piece (at most 4 pieces per rank here)
    share = -(-n // world)
    for r, b in enumerate(per_rank):
        assert 12 * share - 12 * world <= b <= 12 * share + 4 * (3 * 12 + 4), (r, b, n)
    assert sum(per_rank) < 12 * n / world * world + 200


def _resume_worker(rank, world, out, init, sd_path, save_path):
    """Load a whole state dict (saved at another world size), take the remaining steps, save the result."""
    model = D.linear_model()
    model.load_state_dict(init)
    opt = ampfused.ShardedFusedAdamW(_groups(model), **ADAM)
    x, c = _data(2, inject=False)  # the same 16 rows per step at every world size
    per_rank = 2 * ROWS // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    if sd_path is not None:
        sd = torch.load(sd_path, weights_only=False)
        opt.load_state_dict(sd["optim"])
        with torch.no_grad():
            for p, v in zip(model.parameters(), sd["model"]):
                p.copy_(v)
        steps = range(2, 4)
    else:
        steps = range(0, 2)
    _loop(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, rows, steps)
    sd = {"optim": opt.state_dict(), "model": [p.detach().clone() for p in model.parameters()]}
    if rank == 0 and save_path is not None:
        torch.save(sd, save_path)
    save(out, rank, sd)


def test_sharded_state_dict_moves_between_world_sizes(tmp_path):
    """2 ranks take 2 steps and save; 1 and 4 ranks (and the unsharded optimizer) load it and take 2 more:
    all of them end bitwise where 4 uninterrupted single-process steps end. Every run sees the same global
    batches, sliced over its own ranks (4 x 4 rows, 2 x 8, 1 x 16)."""
    init = D.linear_model().state_dict()
    ckpt = str(tmp_path / "two.pt")
    os.makedirs(tmp_path / "w2")
    run_ranks(_resume_worker, 2, str(tmp_path / "w2"), init, None, ckpt)
    results = {}
    for world in (1, 4):
        os.makedirs(tmp_path / f"w{world}")
        run_ranks(_resume_worker, world, str(tmp_path / f"w{world}"), init, ckpt, None)
        results[world] = load(tmp_path / f"w{world}", world)

    model = D.linear_model()
    opt = ampfused.FusedAdamW(_groups(model), **ADAM)
    x, c = _data(2, inject=False)
    _loop(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, slice(None), range(4))
    want = {"optim": opt.state_dict(), "model": [p.detach() for p in model.parameters()]}

    saved = torch.load(ckpt, weights_only=False)  # the unsharded optimizer loads a sharded checkpoint too
    model2 = D.linear_model()
    with torch.no_grad():
        for p, v in zip(model2.parameters(), saved["model"]):
            p.copy_(v)
    opt2 = ampfused.FusedAdamW(_groups(model2), **ADAM)
    opt2.load_state_dict(saved["optim"])
    _loop(model2, opt2, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, slice(None), range(2, 4))
    results["unsharded"] = [{"optim": opt2.state_dict(), "model": [p.detach() for p in model2.parameters()]}]
    for world, ranks in results.items():
        for r, got in enumerate(ranks):
            for i, p in enumerate(want["model"]):
                assert_bitwise(f"world {world} rank {r} param[{i}]", got["model"][i], p)
            _assert_state_equal(got["optim"], want["optim"], f"world {world} rank {r}")
