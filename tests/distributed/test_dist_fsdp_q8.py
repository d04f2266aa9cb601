"""FSDP2 with 8-bit moments (docs/state-precision.md), on gloo processes.

Each rank keeps its shards' codes in blocks of 256 from each local shard's first element, with their block
scales; the state dict gives the scales as each element's block exponent, a uint8 DTensor placed like the
parameter (``<name>_exponent``), so torch.distributed.checkpoint reshards them with the codes. On one rank FSDP2
is the unsharded optimizer, bit for bit. A checkpoint saved on 2 ranks resumes on 2 bit for bit (every block's
exponents agree) and loads on 1 and on 4, where blocks that straddle the old shards are encoded to nearest.
"""
import torch
from torch.distributed.fsdp import fully_shard

import ampfused
import dist_data as D
import test_dist_fsdp as F
import test_dist_fsdp_compact as C
import test_dist_zero as Z
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

U8 = torch.uint8
OPTIONS = dict(bf16_stochastic_round=True, exp_avg_dtype=U8, exp_avg_sq_dtype=U8)


def _assert_near(a, b, steps, msg):
    """Weights of two runs that differ only in their stochastic draws and 8-bit moments over ``steps`` steps: per
    step, one code step apart in exp_avg (2**-3 of it) and in exp_avg_sq (2**-3, so 2**-4 through the square root)
    moves Adam's update (at most about lr) by under 0.2 lr, and the weights' stochastic rounding by one bf16 ulp
    (2**-7 of the weight)."""
    torch.testing.assert_close(a.float(), b.float(), atol=steps * 0.2 * Z.ADAM["lr"], rtol=steps * 2 ** -7, msg=msg)


def _fsdp_worker(rank, world, out):
    model = D.linear_model()
    fully_shard(model)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, **OPTIONS)
    x, c = Z._data(world)
    skipped = Z._loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(rank * Z.ROWS, (rank + 1) * Z.ROWS),
                      range(Z.STEPS))
    params = list(model.parameters())
    sd = opt.state_dict()["state"]
    save(out, rank, {"params": [C._full(p.detach()).clone() for p in params], "skipped": skipped,
                     "keys": sorted(sd[0]),
                     "state": {k: [C._full(sd[i][k]).clone() for i in range(len(params))]
                               for k in sd[0] if k != "step"}})


def test_fsdp2_8bit_moments_on_one_rank_are_the_unsharded_optimizer(tmp_path):
    run_ranks(_fsdp_worker, 1, str(tmp_path))
    model, opt, skipped = C._single(1, **OPTIONS)
    got = load(tmp_path, 1)[0]
    assert got["skipped"] == skipped
    assert got["keys"] == ["exp_avg_codes", "exp_avg_exponent", "exp_avg_sq_codes", "exp_avg_sq_exponent", "step"]
    for i, p in enumerate(model.parameters()):
        assert_bitwise(f"param {i}", got["params"][i], p.detach())
        for name in ("exp_avg", "exp_avg_sq"):
            assert_bitwise(f"{name} {i}", got["state"][f"{name}_codes"][i], opt.state[p][name])
            field = (opt.state[p][f"{name}_scale"].view(torch.int32) >> 23) & 0xFF
            exps = got["state"][f"{name}_exponent"][i]
            assert_bitwise(f"{name} exponents {i}", exps.reshape(-1)[::256].to(torch.int32), field)


def test_fsdp2_8bit_moments_step_on_every_rank(tmp_path):
    world = 2
    run_ranks(_fsdp_worker, world, str(tmp_path))
    model, _, skipped = C._single(world)  # the fp32-state run
    for r, got in enumerate(load(tmp_path, world)):
        assert got["skipped"] == skipped, f"rank {r}"
        for i, p in enumerate(model.parameters()):
            assert got["state"]["exp_avg_codes"][i].dtype == U8
            _assert_near(got["params"][i], p.detach(), Z.STEPS, f"rank {r}: param {i}")


def _dcp_worker(rank, world, out, ckpt, phase):
    model = D.linear_model()
    fully_shard(model)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, **OPTIONS)
    F.dcp_phase(model, opt, rank, world, ckpt, phase)
    params = list(model.parameters())
    sd = opt.state_dict()["state"]
    save(out, rank, {"params": [C._full(p.detach()).clone() for p in params],
                     "codes": [C._full(sd[i]["exp_avg_sq_codes"]).clone() for i in range(len(params))]})


def _uninterrupted(rank, world, out):
    model = D.linear_model()
    fully_shard(model)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, **OPTIONS)
    x, c = Z._data(2, inject=False)
    Z._loop(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c,
            slice(rank * Z.ROWS, (rank + 1) * Z.ROWS), range(4))
    sd = opt.state_dict()["state"]
    params = list(model.parameters())
    save(out, rank, {"params": [C._full(p.detach()).clone() for p in params],
                     "codes": [C._full(sd[i]["exp_avg_sq_codes"]).clone() for i in range(len(params))]})


def test_dcp_reshards_8bit_moments(tmp_path):
    """2 ranks save after 2 steps; 2 ranks resume and end bitwise where 4 uninterrupted steps on 2 ranks end;
    1 and 4 ranks load and take the same 2 steps, ending near it (draws and blocks follow each rank's shards)."""
    ckpt = str(tmp_path / "ckpt")
    for d in ("w2", "w2b", "u", "w1", "w4"):
        (tmp_path / d).mkdir()
    run_ranks(_dcp_worker, 2, str(tmp_path / "w2"), ckpt, "save")
    run_ranks(_uninterrupted, 2, str(tmp_path / "u"))
    want = load(tmp_path / "u", 2)[0]
    run_ranks(_dcp_worker, 2, str(tmp_path / "w2b"), ckpt, "load")
    for r, got in enumerate(load(tmp_path / "w2b", 2)):
        for i, (a, b) in enumerate(zip(got["params"] + got["codes"], want["params"] + want["codes"])):
            assert_bitwise(f"2 ranks resumed, rank {r}: tensor {i}", a, b)
    for world in (1, 4):
        run_ranks(_dcp_worker, world, str(tmp_path / f"w{world}"), ckpt, "load")
        for r, got in enumerate(load(tmp_path / f"w{world}", world)):
            for i, (a, b) in enumerate(zip(got["params"], want["params"])):
                _assert_near(a, b, 2, f"{world} ranks, rank {r}: param {i}")  # the 2 steps after the load
