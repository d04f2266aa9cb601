"""SGD's momentum buffer under ZeRO-1 and FSDP2 (gloo processes): no momentum state on any rank while the group has
``momentum=0``, the buffer allocated by the first step after momentum is switched on, and the run bitwise the
single-process FusedSGD run with the same switch (the data of ``dist_data`` gives every rank the same global
gradient bits). Modes: fp32 masters on two ranks, and 8-bit momentum (whose layout changes when the buffer
appears) on one rank: its stochastic rounding draws by each rank's own element indices, so only a world of one
draws as the single-process optimizer does."""
import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ampfused
import dist_data as D
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

ROWS, STEPS, SWITCH = 8, 4, 2
SGD = dict(lr=0.05, momentum=0.0, dampening=0.1, weight_decay=0.01)
# options, world size
MODES = {"fp32-master": ({}, 2), "q8-momentum": (dict(momentum_dtype=torch.uint8), 1)}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, opt, rows, world):
    """Steps with momentum 0, then switched on; the momentum state bytes this rank held before the switch."""
    x, c = D.batches(STEPS, world * ROWS)
    held = None
    for s in range(STEPS):
        if s == SWITCH:
            held = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
                       if k.startswith("momentum_buffer") and isinstance(v, torch.Tensor))
            opt.param_groups[0]["momentum"] = 0.9
        ((model(x[s, rows]) * c[s, rows]).sum() / x[s, rows].shape[0]).backward()  # (ranks average)
        opt.step()
        opt.zero_grad()
    return held


def _zero_worker(rank, world, out, init, options):
    model = D.linear_model()
    model.load_state_dict(init)
    opt = ampfused.ShardedFusedSGD(model.parameters(), **SGD, **options)
    held = _train(model, opt, slice(rank * ROWS, (rank + 1) * ROWS), world)
    save(out, rank, {"params": [p.detach().clone() for p in model.parameters()], "held": held,
                     "state": opt.state_dict()["state"]})


def _fsdp_worker(rank, world, out, init, options):
    model = D.linear_model()
    model.load_state_dict(init)
    fully_shard(model)
    opt = ampfused.FusedSGD(model.parameters(), **SGD, **options)
    held = _train(model, opt, slice(rank * ROWS, (rank + 1) * ROWS), world)
    params = list(model.parameters())
    momentum = [opt.state[p]["momentum_buffer"] for p in params]
    save(out, rank, {"params": [_full(p.detach()).clone() for p in params], "held": held,
                     "momentum": [_full(m).clone() if m.dtype != torch.uint8 else None for m in momentum]})


def _single(options, world):
    model = D.linear_model()
    opt = ampfused.FusedSGD(model.parameters(), **SGD, **options)
    held = _train(model, opt, slice(None), world)
    assert held == 0
    return model, opt


@pytest.mark.parametrize("mode", sorted(MODES))
def test_zero1_allocates_momentum_when_switched_on(tmp_path, mode):
    options, world = MODES[mode]
    run_ranks(_zero_worker, world, str(tmp_path), D.linear_model().state_dict(), options)
    model, opt = _single(options, world)
    want = opt.state_dict()["state"]
    for r, got in enumerate(load(tmp_path, world)):
        assert got["held"] == 0, f"rank {r} held momentum state before the switch"
        for i, (a, b) in enumerate(zip(got["params"], model.parameters())):
            assert_bitwise(f"rank {r} param {i}", a, b.detach())
        assert sorted(got["state"]) == sorted(want)
        for i, st in want.items():
            assert sorted(got["state"][i]) == sorted(st), f"rank {r} state keys of parameter {i}"
            for key, v in st.items():
                assert_bitwise(f"rank {r} state[{i}][{key}]", got["state"][i][key], v)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fsdp2_allocates_momentum_when_switched_on(tmp_path, mode):
    options, world = MODES[mode]
    run_ranks(_fsdp_worker, world, str(tmp_path), D.linear_model().state_dict(), options)
    model, opt = _single(options, world)
    for r, got in enumerate(load(tmp_path, world)):
        assert got["held"] == 0, f"rank {r} held momentum state before the switch"
        for i, (a, p) in enumerate(zip(got["params"], model.parameters())):
            assert_bitwise(f"rank {r} param {i}", a, p.detach())
            if got["momentum"][i] is not None:
                assert_bitwise(f"rank {r} momentum {i}", got["momentum"][i], opt.state[p]["momentum_buffer"])
