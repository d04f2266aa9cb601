"""FSDP2 (``fully_shard``) with ampfused.FusedAdamW on gloo processes, and sharded checkpoints through
``torch.distributed.checkpoint`` for FSDP2 and ZeRO-1.

The parameters are DTensors; the optimizer keeps state for this rank's shards only and sums the shards' norm
partials and overflow flags over the mesh before the update. With the exact data of ``dist_data`` (and no
clipping) every rank's shard ends bitwise where the single-process fused step on the concatenated batch ends:
FSDP2's reduce-scatter divides by a power of two and sums integers, so the global gradient is the same bits.
"""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import ampfused
import dist_data as D
import test_dist_zero as Z
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise, assert_close_to_oracle

ROWS, STEPS = Z.ROWS, Z.STEPS
KEYS = ("master_param", "exp_avg", "exp_avg_sq")


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model, opt, **extra) -> dict:
    """Every parameter and state tensor gathered whole (a collective: every rank calls it)."""
    params = list(model.parameters())
    out = {"params": [_full(p.detach()).clone() for p in params]}
    for key in KEYS + ("step",):
        out[key] = [_full(opt.state[p][key]).clone() for p in params]
    out.update(extra)
    return out


def _single_snapshot(model, opt) -> dict:
    params = list(model.parameters())
    out = {"params": [p.detach().clone() for p in params]}
    for key in KEYS + ("step",):
        out[key] = [opt.state[p][key].clone() for p in params]
    return out


def _assert_snapshots_equal(got, want, where, keys=("params",) + KEYS + ("step",)):
    for key in keys:
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            assert_bitwise(f"{where}: {key}[{i}]", a, b)


def _fsdp_worker(rank, world, out, max_norm, fout):
    model = D.linear_model() if fout == D.FOUT else _narrow_model(fout)
    fully_shard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, max_grad_norm=max_norm,
                              spike_guard=ampfused.SpikeGuard(max_norm=Z.SPIKE_NORM))
    scaler = ampfused.GradScaler("cpu")
    x, c = Z._data(world)
    skipped = Z._loop(model, opt, scaler, x, c[..., :fout], slice(rank * ROWS, (rank + 1) * ROWS), range(STEPS))
    local = [p.to_local().numel() for p in model.parameters()]
    save(out, rank, _snapshot(model, opt, skipped=skipped, norm=opt.last_grad_norm.clone(), local=local,
                              scale=scaler.get_scale()))


def _narrow_model(fout):
    torch.manual_seed(0)
    return torch.nn.Linear(D.FIN, fout).to(torch.bfloat16)


def _single(world, max_norm, fout=D.FOUT):
    model = D.linear_model() if fout == D.FOUT else _narrow_model(fout)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, max_grad_norm=max_norm,
                              spike_guard=ampfused.SpikeGuard(max_norm=Z.SPIKE_NORM))
    x, c = Z._data(world)
    scaler = ampfused.GradScaler("cpu")
    skipped = Z._loop(model, opt, scaler, x, c[..., :fout], slice(None), range(STEPS))
    return model, opt, skipped, scaler


@pytest.mark.parametrize("world,fout", [(2, D.FOUT), (4, 3)])
def test_fsdp2_fused_adamw_is_the_single_process_step(tmp_path, world, fout):
    """An inf on rank 1 and a loss spike on rank 0 skip the same steps on every rank; the scale backs off
    alike; the shards end bitwise where the single-process step ends. With 3 output rows on 4 ranks the last
    rank holds no shard of either parameter (and still joins every collective)."""
    run_ranks(_fsdp_worker, world, str(tmp_path), None, fout)
    ranks = load(tmp_path, world)
    model, opt, skipped, scaler = _single(world, None, fout)
    assert skipped == [s in (Z.INF_STEP, Z.SPIKE_STEP) for s in range(STEPS)]
    want = _single_snapshot(model, opt)
    for r, got in enumerate(ranks):
        assert got["skipped"] == skipped, f"rank {r}"
        assert got["scale"] == scaler.get_scale(), f"rank {r}"
        _assert_snapshots_equal(got, want, f"rank {r}")
    if fout == 3:
        assert ranks[-1]["local"] == [0, 0] and all(r["local"][0] > 0 for r in ranks[:-1])


def test_fsdp2_clips_with_the_global_norm(tmp_path):
    world, max_norm = 2, 0.5
    run_ranks(_fsdp_worker, world, str(tmp_path), max_norm, D.FOUT)
    ranks = load(tmp_path, world)
    for r in range(1, world):
        assert_bitwise(f"rank {r} norm", ranks[r]["norm"], ranks[0]["norm"])
    model, opt, _, _ = _single(world, max_norm)
    # the norm is summed in another order than the single process's: the same value to fp32 rounding
    torch.testing.assert_close(ranks[0]["norm"], opt.last_grad_norm, rtol=1e-6, atol=0)
    recipes = Z.clip_oracle(world, max_norm)
    for i in range(2):
        assert_close_to_oracle(f"master[{i}]", ranks[0]["master_param"][i], recipes[0].masters[i],
                               recipes[1].masters[i])


def _mp_worker(rank, world, out):
    """fp32 sharded parameters, bf16 compute: FSDP2's MixedPrecisionPolicy; the optimizer keeps no masters."""
    model = D.linear_model().float()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    x, c = Z._data(world, inject=False)
    Z._loop(model, opt, ampfused.GradScaler("cpu", enabled=False), x, c, slice(rank * ROWS, (rank + 1) * ROWS),
            range(STEPS))
    params = list(model.parameters())
    save(out, rank, {"params": [_full(p.detach()).clone() for p in params],
                     "keys": sorted(opt.state[params[0]]),
                     "exp_avg": [_full(opt.state[p]["exp_avg"]).clone() for p in params]})


def test_fsdp2_mixed_precision_policy_with_fp32_shards(tmp_path):
    """The fp32 shards are the masters: no master_param, and the run is bitwise the fp32 single-process one
    (bf16 compute sees the same exact gradients here)."""
    world = 2
    run_ranks(_mp_worker, world, str(tmp_path))
    ranks = load(tmp_path, world)
    model = D.linear_model().float()
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    x, c = Z._data(world, inject=False)
    Z._loop(model, opt, ampfused.GradScaler("cpu", enabled=False), x.float(), c.float(), slice(None), range(STEPS))
    for r, got in enumerate(ranks):
        assert got["keys"] == ["exp_avg", "exp_avg_sq", "step"], f"rank {r}"
        for i, p in enumerate(model.parameters()):
            assert_bitwise(f"rank {r} param[{i}]", got["params"][i], p.detach())
            assert_bitwise(f"rank {r} exp_avg[{i}]", got["exp_avg"][i], opt.state[p]["exp_avg"])


def _accumulate_worker(rank, world, out):
    """Two micro-batches per step, the first without the reduce-scatter (FSDP2's counterpart of no_sync)."""
    model = D.linear_model()
    fully_shard(model)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    x, c = Z._data(world, inject=False)
    half = ROWS // 2
    for s in range(STEPS):
        for k in range(2):
            model.set_requires_gradient_sync(k == 1)
            rows = slice(rank * ROWS + k * half, rank * ROWS + (k + 1) * half)
            (model(x[s, rows]) * c[s, rows]).sum().div(ROWS).backward()
        opt.step()
        opt.zero_grad()
    save(out, rank, _snapshot(model, opt))


def test_fsdp2_accumulation_without_gradient_sync(tmp_path):
    world = 2
    run_ranks(_accumulate_worker, world, str(tmp_path))
    model = D.linear_model()
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    x, c = Z._data(world, inject=False)
    Z._loop(model, opt, ampfused.GradScaler("cpu", enabled=False), x, c, slice(None), range(STEPS))
    want = _single_snapshot(model, opt)
    for r, got in enumerate(load(tmp_path, world)):
        _assert_snapshots_equal(got, want, f"rank {r}")


def _mixed_worker(rank, world, out):
    model = torch.nn.Sequential(D.linear_model(), torch.nn.Linear(D.FOUT, 2).to(torch.bfloat16))
    fully_shard(model[0])  # the second layer stays a plain tensor: not sharded
    try:
        ampfused.FusedAdamW(model.parameters()).step()
    except ValueError as e:
        save(out, rank, str(e))


def test_fsdp2_plain_and_sharded_parameters_together_are_refused(tmp_path):
    run_ranks(_mixed_worker, 2, str(tmp_path))
    for msg in load(tmp_path, 2):
        assert "is a plain tensor but" in msg and "DTensor" in msg and "fully_shard" in msg


# --- torch.distributed.checkpoint across world sizes --------------------------------------------------------
def _build(kind, world):
    model = D.linear_model()
    if kind == "fsdp2":
        fully_shard(model)
        opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    else:
        opt = ampfused.ShardedFusedAdamW(Z._groups(model), **Z.ADAM)
    return model, opt


def _dcp_worker(rank, world, out, kind, ckpt, phase):
    model, opt = _build(kind, world)
    dcp_phase(model, opt, rank, world, ckpt, phase)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    params = [_full(p.detach()).clone() for p in model.parameters()]
    save(out, rank, {"params": params, "optim": full})


def dcp_phase(model, opt, rank, world, ckpt, phase):
    """``phase`` "save": steps 0-1, then a DCP checkpoint; "load": the checkpoint, then steps 2-3. Every run
    sees the same 16 rows per step, sliced over its own ranks."""
    x, c = Z._data(2, inject=False)
    per_rank = 2 * ROWS // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    if phase == "load":
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        steps = range(2, 4)
    else:
        steps = range(0, 2)
    Z._loop(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, rows, steps)
    if phase == "save":
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=ckpt)


@pytest.mark.parametrize("kind", ["fsdp2", "zero1"])
def test_dcp_checkpoint_moves_between_world_sizes(tmp_path, kind):
    """2 ranks save a DCP checkpoint after 2 steps; 1 and 4 ranks load it (model and optimizer, resharded by
    torch.distributed.checkpoint) and take 2 more: all end bitwise where 4 single-process steps end, and the
    full optimizer state dict (get_optimizer_state_dict with full_state_dict=True) is that run's state."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "w2").mkdir()
    run_ranks(_dcp_worker, 2, str(tmp_path / "w2"), kind, ckpt, "save")
    model = D.linear_model()
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    x, c = Z._data(2, inject=False)
    Z._loop(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, slice(None), range(4))
    want = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for world in (1, 4):
        (tmp_path / f"w{world}").mkdir()
        run_ranks(_dcp_worker, world, str(tmp_path / f"w{world}"), kind, ckpt, "load")
        for r, got in enumerate(load(tmp_path / f"w{world}", world)):
            where = f"{kind}, {world} ranks, rank {r}"
            for i, p in enumerate(model.parameters()):
                assert_bitwise(f"{where}: param[{i}]", got["params"][i], p.detach())
            assert sorted(got["optim"]["state"]) == sorted(want["state"]), where
            for name, st in want["state"].items():
                for key, v in st.items():
                    assert_bitwise(f"{where}: state[{name}][{key}]", _full(got["optim"]["state"][name][key]),
                                   torch.as_tensor(v))


def _plain_load_worker(rank, world, out):
    model = D.linear_model()
    fully_shard(model)
    opt = ampfused.FusedAdamW(model.parameters())
    model(torch.ones(2, D.FIN, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    before = {k: _full(v).clone() for k, v in opt.state[model.weight].items()}
    sd["state"][0] = {k: _full(v) for k, v in sd["state"][0].items()}  # whole plain tensors: not this rank's shard
    try:
        opt.load_state_dict(sd)
        msg = None
    except ValueError as e:
        msg = str(e)
    after = {k: _full(v) for k, v in opt.state[model.weight].items()}
    save(out, rank, {"msg": msg, "same": all(torch.equal(before[k], after[k]) for k in before)})


def test_fsdp2_plain_state_for_a_sharded_parameter_is_refused_before_any_change(tmp_path):
    run_ranks(_plain_load_worker, 2, str(tmp_path))
    for got in load(tmp_path, 2):
        assert got["msg"] is not None and "plain tensor" in got["msg"] and "set_optimizer_state_dict" in got["msg"]
        assert got["same"]


def _no_step_worker(rank, world, out, kind):
    model, opt = _build(kind, world)
    x, c = Z._data(world, inject=False)
    Z._loop(model, opt, ampfused.GradScaler("cpu", enabled=False), x, c, slice(rank * ROWS, (rank + 1) * ROWS),
            range(2))
    first = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    first = {n: {k: _full(v).clone() for k, v in st.items()} for n, st in first["state"].items()}
    params = [_full(p.detach()).clone() for p in model.parameters()]
    again = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    save(out, rank, {"has_state": bool(opt.state), "first": first, "params": params,
                     "again": {n: {k: _full(v) for k, v in st.items()} for n, st in again["state"].items()},
                     "params_after": [_full(p.detach()).clone() for p in model.parameters()]})


@pytest.mark.parametrize("kind", ["fsdp2", "zero1"])
def test_get_optimizer_state_dict_reads_without_stepping(tmp_path, kind):
    """torch's get_optimizer_state_dict runs a zero-gradient step on an optimizer whose ``state`` is empty:
    after a step every rank's ``state`` has entries, so reading the state twice changes nothing."""
    run_ranks(_no_step_worker, 2, str(tmp_path), kind)
    for r, got in enumerate(load(tmp_path, 2)):
        assert got["has_state"], f"rank {r}"
        for name, st in got["first"].items():
            assert st["step"].item() == 2.0, (r, name)
            for key, v in st.items():
                assert_bitwise(f"rank {r} state[{name}][{key}]", got["again"][name][key], v)
        for a, b in zip(got["params"], got["params_after"]):
            assert_bitwise(f"rank {r} param", b, a)


def test_state_dict_functions_of_torch_distributed_checkpoint_without_a_process_group():
    """get/set_optimizer_state_dict on one process: parameter names as keys, and a fresh optimizer loaded
    from them continues bitwise."""
    model = D.linear_model()
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM)
    x, c = Z._data(1, inject=False)
    loop = lambda m, o, steps: Z._loop(m, o, ampfused.GradScaler("cpu", enabled=False), x, c, slice(None), steps)
    loop(model, opt, range(2))
    osd = get_optimizer_state_dict(model, opt)
    assert sorted(osd["state"]) == ["bias", "weight"]
    assert sorted(osd["state"]["weight"]) == ["exp_avg", "exp_avg_sq", "master_param", "step"]
    model2 = D.linear_model()
    opt2 = ampfused.FusedAdamW(Z._groups(model2), **Z.ADAM)
    set_model_state_dict(model2, get_model_state_dict(model))
    set_optimizer_state_dict(model2, opt2, {"state": {n: {k: v.clone() for k, v in st.items()}
                                                      for n, st in osd["state"].items()},
                                            "param_groups": osd["param_groups"]})
    loop(model, opt, range(2, 4))
    loop(model2, opt2, range(2, 4))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert_bitwise("param", q.detach(), p.detach())
        for key in KEYS:
            assert_bitwise(key, opt2.state[q][key], opt.state[p][key])
