"""ZeRO-1 with DDP, with the scaler's unscale_, with summed gradients and a global token count, with SGD, with
ranks that own nothing, and its errors. Each run is compared bitwise with the single-process fused run."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ampfused
import dist_data as D
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

ROWS = 8
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _assert_same(got, want, where):
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert_bitwise(f"{where} param[{i}]", a, b)
    assert sorted(got["state"]["state"]) == sorted(want["state"]["state"]), where
    for i, st in want["state"]["state"].items():
        for key, v in st.items():
            if v is not None:
                assert_bitwise(f"{where} state[{i}][{key}]", got["state"]["state"][i][key], v)


def _result(model, opt, **extra):
    return dict({"params": [p.detach().clone() for p in model.parameters()], "state": opt.state_dict()}, **extra)


# --- with DDP (gradients already averaged) and GradScaler.unscale_ -----------------------------------------
def _unscale_loop(net, opt, x, c, rows):
    scaler, skipped = ampfused.GradScaler("cpu"), []
    for s in range(x.shape[0]):
        scaler.scale((net(x[s, rows]) * c[s, rows]).sum() / x[s, rows].shape[0]).backward()
        scaler.unscale_(opt)  # found_inf of every rank, all-reduced by the sharded optimizer
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(opt.last_step_skipped))
        opt.zero_grad()
    return skipped, scaler.get_scale()


def _ddp_data(world):
    x, c = D.batches(4, world * ROWS)
    x[1, ROWS + 1, 3] = float("nan")  # rank 1 only
    return x, c


def _ddp_worker(rank, world, out, init):
    model = D.linear_model()
    model.load_state_dict(init)
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = ampfused.ShardedFusedAdamW(model.parameters(), **ADAM, grad_reduction=None)
    x, c = _ddp_data(world)
    skipped, scale = _unscale_loop(ddp, opt, x, c, slice(rank * ROWS, (rank + 1) * ROWS))
    save(out, rank, _result(model, opt, skipped=skipped, scale=scale))


def test_sharded_with_ddp_and_unscale(tmp_path):
    world = 2
    init = D.linear_model().state_dict()
    run_ranks(_ddp_worker, world, str(tmp_path), init)
    model = D.linear_model()
    opt = ampfused.FusedAdamW(model.parameters(), **ADAM)
    x, c = _ddp_data(world)
    skipped, scale = _unscale_loop(model, opt, x, c, slice(None))
    assert skipped == [False, True, False, False]
    want = _result(model, opt)
    for r, got in enumerate(load(tmp_path, world)):
        assert got["skipped"] == skipped and got["scale"] == scale == 2.0 ** 15
        _assert_same(got, want, f"rank {r}")


# --- summed gradients, accumulation, grad_divisor = the token count of every rank -------------------------------
MICRO = 4


def _mask(world, steps):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(steps, world * 2 * MICRO, generator=g) < 0.5
    mask[:, ::MICRO] = True
    return mask


def _sum_worker(rank, world, out, init):
    model = D.linear_model()
    model.load_state_dict(init)
    opt = ampfused.ShardedFusedAdamW(model.parameters(), **ADAM, grad_reduction="sum", max_grad_norm=None)
    scaler = ampfused.GradScaler("cpu")
    x, c = D.batches(3, world * 2 * MICRO)
    mask = _mask(world, 3)
    for s in range(3):
        tokens = torch.zeros((), dtype=torch.int64)
        for micro in range(2):
            lo = (rank * 2 + micro) * MICRO
            rows = slice(lo, lo + MICRO)
            m = mask[s, rows].reshape(-1, 1).to(torch.bfloat16)
            scaler.scale((model(x[s, rows]) * c[s, rows] * m).sum()).backward()
            tokens += mask[s, rows].sum()
        scaler.step(opt, grad_divisor=ampfused.distributed.global_sum(tokens))
        scaler.update()
        opt.zero_grad()
    save(out, rank, _result(model, opt))


def test_sharded_sum_reduction_with_the_global_token_count(tmp_path):
    world = 2
    init = D.linear_model().state_dict()
    run_ranks(_sum_worker, world, str(tmp_path), init)
    model = D.linear_model()
    opt = ampfused.FusedAdamW(model.parameters(), **ADAM)
    scaler = ampfused.GradScaler("cpu")
    x, c = D.batches(3, world * 2 * MICRO)
    mask = _mask(world, 3)
    for s in range(3):
        scaler.scale((model(x[s]) * c[s] * mask[s].reshape(-1, 1).to(torch.bfloat16)).sum()).backward()
        scaler.step(opt, grad_divisor=mask[s].sum())
        scaler.update()
        opt.zero_grad()
    want = _result(model, opt)
    for r, got in enumerate(load(tmp_path, world)):
        _assert_same(got, want, f"rank {r}")


# --- SGD, and ranks that own nothing at all ---------------------------------------------------------------------
SGD = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)


def _train(model, opt, x, c, rows):
    for s in range(x.shape[0]):
        ((model(x[s, rows]) * c[s, rows]).sum() / x[s, rows].shape[0]).backward()
        opt.step()
        opt.zero_grad()


def _tiny():
    torch.manual_seed(1)
    return torch.nn.Linear(2, 1).to(torch.bfloat16)  # 3 elements


def _sgd_worker(rank, world, out, init, tiny_init):
    model = D.linear_model()
    model.load_state_dict(init)
    opt = ampfused.ShardedFusedSGD(model.parameters(), **SGD)
    x, c = D.batches(3, world * ROWS)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    _train(model, opt, x, c, rows)
    tiny = _tiny()
    tiny.load_state_dict(tiny_init)
    topt = ampfused.ShardedFusedAdamW(tiny.parameters(), **ADAM)
    tx, tc = x[..., :2], c[..., :1]
    _train(tiny, topt, tx, tc, rows)
    save(out, rank, {"sgd": _result(model, opt), "tiny": _result(tiny, topt, owned=topt.state_bytes())})


def test_sharded_sgd_and_ranks_owning_nothing(tmp_path):
    world = 4
    run_ranks(_sgd_worker, world, str(tmp_path), D.linear_model().state_dict(), _tiny().state_dict())
    model = D.linear_model()
    opt = ampfused.FusedSGD(model.parameters(), **SGD)
    x, c = D.batches(3, world * ROWS)
    _train(model, opt, x, c, slice(None))
    tiny = _tiny()
    topt = ampfused.FusedAdamW(tiny.parameters(), **ADAM)
    _train(tiny, topt, x[..., :2], c[..., :1], slice(None))
    ranks = load(tmp_path, world)
    assert ranks[3]["tiny"]["owned"] == 0  # 3 elements over 4 ranks: the last one holds no state
    for r, got in enumerate(ranks):
        _assert_same(got["sgd"], _result(model, opt), f"SGD rank {r}")
        _assert_same(got["tiny"], _result(tiny, topt), f"tiny AdamW rank {r}")


# --- errors --------------------------------------------------------------------------------------------------
def test_sharded_needs_a_process_group():
    model = D.linear_model()
    with pytest.raises(ValueError, match="grad_reduction must be"):
        ampfused.ShardedFusedAdamW(model.parameters(), grad_reduction="avg")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ampfused.ShardedFusedAdamW(model.parameters())


def _errors_worker(rank, world, out):
    model = D.linear_model()
    with pytest.raises(TypeError, match="process_group must be"):
        ampfused.ShardedFusedAdamW(model.parameters(), process_group="world")
    opt = ampfused.ShardedFusedAdamW(model.parameters(), lr=0.1)
    (model(torch.ones(2, D.FIN, dtype=torch.bfloat16)).sum()).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="after the first step"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    model.float()
    with pytest.raises(RuntimeError, match="does not follow moves or casts"):
        opt.step()
    for p, b in zip(model.parameters(), before):  # refused before anything changed
        assert torch.equal(p.detach(), b.float())
    save(out, rank, True)


def test_sharded_errors_fire_before_anything_changes(tmp_path):
    run_ranks(_errors_worker, 2, str(tmp_path))
    assert load(tmp_path, 2) == [True, True]


# --- values written into the model are followed -------------------------------------------------------------
def _write_loop(model, opt, x, c, rows):
    for s in range(x.shape[0]):
        if s == 2:  # a checkpoint loaded into the model between steps
            with torch.no_grad():
                model.weight.copy_(torch.linspace(-1, 1, model.weight.numel()).reshape(model.weight.shape))
        ((model(x[s, rows]) * c[s, rows]).sum() / x[s, rows].shape[0]).backward()
        opt.step()
        opt.zero_grad()


def _write_worker(rank, world, out, init):
    model = D.linear_model()
    model.load_state_dict(init)
    opt = ampfused.ShardedFusedAdamW(model.parameters(), **ADAM)
    x, c = D.batches(4, world * ROWS)
    _write_loop(model, opt, x, c, slice(rank * ROWS, (rank + 1) * ROWS))
    save(out, rank, _result(model, opt))


def test_sharded_follows_values_written_into_the_model(tmp_path):
    world = 2
    run_ranks(_write_worker, world, str(tmp_path), D.linear_model().state_dict())
    model = D.linear_model()
    opt = ampfused.FusedAdamW(model.parameters(), **ADAM)
    x, c = D.batches(4, world * ROWS)
    _write_loop(model, opt, x, c, slice(None))
    for r, got in enumerate(load(tmp_path, world)):
        _assert_same(got, _result(model, opt), f"rank {r}")
