"""Lion sharded: ampfused.ShardedFusedLion (ZeRO-1) and FusedLion under FSDP2 (``fully_shard``) on gloo processes.

With the exact data of ``dist_data`` and no clipping, each is bitwise the single-process FusedLion on the
concatenated batch (the update is elementwise and the global gradient is the same bits), in the fp32-master mode
and with master remainders (which draw nothing; stochastic rounding, of the weights or of a bf16 or 8-bit moment,
draws by the index in each rank's buffers, so by the world size, as for ShardedFusedAdamW).
"""
import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ampfused
import dist_data as D
import test_dist_zero as Z
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

LION = dict(lr=1e-2, betas=(0.9, 0.99))
MODES = {"fp32-master": {}, "remainders": dict(store_param_remainders=True)}


def _model(bf16: bool):
    model = D.linear_model()
    return model.to(torch.bfloat16) if bf16 else model


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model, opt) -> dict:
    params = list(model.parameters())
    return {"params": [_full(p.detach()).clone() for p in params],
            "exp_avg": [_full(opt.state[p]["exp_avg"]).clone() for p in params],
            "skipped": None}


def _zero_worker(rank, world, out, init, mode, bf16):
    model = _model(bf16)
    model.load_state_dict(init)
    opt = ampfused.ShardedFusedLion(Z._groups(model), **LION, **MODES[mode])
    x, c = Z._data(world)
    skipped = Z._loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(rank * Z.ROWS, (rank + 1) * Z.ROWS),
                      range(Z.STEPS))
    save(out, rank, {"params": [p.detach().clone() for p in model.parameters()], "skipped": skipped,
                     "state": ampfused.optim.torch_state_dict(opt.state_dict())})


def _fsdp_worker(rank, world, out, init, mode, bf16):
    model = _model(bf16)
    model.load_state_dict(init)
    fully_shard(model)
    opt = ampfused.FusedLion(Z._groups(model), **LION, **MODES[mode])
    x, c = Z._data(world)
    skipped = Z._loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(rank * Z.ROWS, (rank + 1) * Z.ROWS),
                      range(Z.STEPS))
    snap = _snapshot(model, opt)
    snap["skipped"] = skipped
    save(out, rank, snap)


def _single(world, mode, bf16):
    model = _model(bf16)
    opt = ampfused.FusedLion(Z._groups(model), **LION, **MODES[mode])
    x, c = Z._data(world)
    skipped = Z._loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(None), range(Z.STEPS))
    return model, opt, skipped


@pytest.mark.parametrize("mode, bf16", [("fp32-master", False), ("remainders", True)])
def test_sharded_lion_is_the_single_process_step(tmp_path, mode, bf16):
    world = 2
    init = _model(bf16).state_dict()
    run_ranks(_zero_worker, world, str(tmp_path), init, mode, bf16)
    model, opt, skipped = _single(world, mode, bf16)
    assert skipped == [s == Z.INF_STEP for s in range(Z.STEPS)]
    want = ampfused.optim.torch_state_dict(opt.state_dict())
    for r, got in enumerate(load(tmp_path, world)):
        assert got["skipped"] == skipped, f"rank {r}"
        for i, p in enumerate(model.parameters()):
            assert_bitwise(f"rank {r} param[{i}]", got["params"][i], p.detach())
        for i, st in want["state"].items():
            assert_bitwise(f"rank {r} exp_avg[{i}]", got["state"]["state"][i]["exp_avg"], st["exp_avg"])


def test_fsdp2_lion_is_the_single_process_step(tmp_path):
    world, mode = 2, "fp32-master"
    init = _model(False).state_dict()
    run_ranks(_fsdp_worker, world, str(tmp_path), init, mode, False)
    model, opt, skipped = _single(world, mode, False)
    for r, got in enumerate(load(tmp_path, world)):
        assert got["skipped"] == skipped, f"rank {r}"
        for i, p in enumerate(model.parameters()):
            assert_bitwise(f"rank {r} param[{i}]", got["params"][i], p.detach())
            assert_bitwise(f"rank {r} exp_avg[{i}]", got["exp_avg"][i], opt.state[p]["exp_avg"])
