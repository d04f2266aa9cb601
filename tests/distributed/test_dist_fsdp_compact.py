"""FSDP2 with compact optimizer state (docs/state-precision.md), on gloo processes.

Master remainders keep the fp32-master mode's masters bit for bit, so an FSDP2 run with remainders must end where
the single-process fp32-master run ends: every rank's gathered weights and remainders rebuild those masters
exactly (``join_master``). A DCP checkpoint of the compact state saved on 2 ranks loads on 1 and on 4 and
continues bitwise. bf16 moments draw their stochastic rounding from each rank's own element indices, so they are
checked for what holds across shardings: the step runs on every rank, its state is bf16, and it stays close to
the fp32-moment run.
"""
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ampfused
import dist_data as D
import test_dist_fsdp as F
import test_dist_zero as Z
from ampfused.ops.state_precision import join_master
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

STEPS = Z.STEPS


def _full(t):
    if not isinstance(t, DTensor):
        return t
    if t.dtype == torch.int16:  # gloo gathers no int16: through int32, exactly
        return t.to(torch.int32).full_tensor().to(torch.int16)
    return t.full_tensor()


def _fsdp_worker(rank, world, out, options):
    model = D.linear_model()
    fully_shard(model)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, **options)
    x, c = Z._data(world)
    skipped = Z._loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(rank * Z.ROWS, (rank + 1) * Z.ROWS),
                      range(STEPS))
    params = list(model.parameters())
    state = {k: [_full(opt.state[p][k]).clone() for p in params] for k in opt.state[params[0]] if k != "step"}
    save(out, rank, {"params": [_full(p.detach()).clone() for p in params], "state": state, "skipped": skipped})


def _single(world, **options):
    model = D.linear_model()
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, **options)
    x, c = Z._data(world)
    skipped = Z._loop(model, opt, ampfused.GradScaler("cpu"), x, c, slice(None), range(STEPS))
    return model, opt, skipped


def test_fsdp2_remainders_rebuild_the_fp32_masters_bit_for_bit(tmp_path):
    world = 2
    run_ranks(_fsdp_worker, world, str(tmp_path), dict(store_param_remainders=True))
    model, opt, skipped = _single(world)
    masters = [opt.state[p]["master_param"] for p in model.parameters()]
    for r, got in enumerate(load(tmp_path, world)):
        assert got["skipped"] == skipped, f"rank {r}"
        assert set(got["state"]) == {"exp_avg", "exp_avg_sq", "master_remainder"}
        for i, (w, rem) in enumerate(zip(got["params"], got["state"]["master_remainder"])):
            assert rem.dtype == torch.int16 and rem.shape == w.shape
            assert_bitwise(f"rank {r}: master[{i}]", join_master(w, rem), masters[i])


def test_fsdp2_bf16_moments_step_on_every_rank(tmp_path):
    world = 2
    options = dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    run_ranks(_fsdp_worker, world, str(tmp_path), options)
    model, opt, skipped = _single(world)
    for r, got in enumerate(load(tmp_path, world)):
        assert got["skipped"] == skipped, f"rank {r}"
        for i, p in enumerate(model.parameters()):
            assert got["state"]["exp_avg"][i].dtype == torch.bfloat16
            # a few bf16 roundings of the moments over STEPS steps: the weights stay within a few bf16 ulps
            torch.testing.assert_close(got["params"][i].float(), p.detach().float(), rtol=2 ** -6, atol=1e-3)


def _dcp_worker(rank, world, out, ckpt, phase):
    model = D.linear_model()
    fully_shard(model)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, store_param_remainders=True)
    F.dcp_phase(model, opt, rank, world, ckpt, phase)
    params = list(model.parameters())
    save(out, rank, {"params": [_full(p.detach()).clone() for p in params],
                     "remainders": [_full(opt.state[p]["master_remainder"]).clone() for p in params]})


def test_dcp_reshards_master_remainders(tmp_path):
    """2 ranks save after 2 steps; 1 and 4 ranks load and take 2 more: the weights and remainders rebuild the
    masters of 4 uninterrupted single-process steps of the fp32-master mode, bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "w2").mkdir()
    run_ranks(_dcp_worker, 2, str(tmp_path / "w2"), ckpt, "save")
    model = D.linear_model()
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    x, c = Z._data(2, inject=False)
    Z._loop(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, slice(None), range(4))
    masters = [opt.state[p]["master_param"] for p in model.parameters()]
    for world in (1, 4):
        (tmp_path / f"w{world}").mkdir()
        run_ranks(_dcp_worker, world, str(tmp_path / f"w{world}"), ckpt, "load")
        for r, got in enumerate(load(tmp_path / f"w{world}", world)):
            for i, (w, rem) in enumerate(zip(got["params"], got["remainders"])):
                assert_bitwise(f"{world} ranks, rank {r}: master[{i}]", join_master(w, rem), masters[i])
