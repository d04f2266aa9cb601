"""ZeRO-1 with 8-bit moments (docs/state-precision.md, "8-bit moments"), on gloo processes.

The model is a bf16 ``nn.Linear(48, 12)``: its 576-element weight is three blocks of 256 (the last partial), so with
the blocks aligned a world of two cuts it after its second block (rank 0 owns blocks 0-1, rank 1 block 2 and the
bias). The data are the exact small integers of ``dist_data`` (every world size sees the same global gradient).

What holds: a world of one is bitwise the single-process optimizer (its draws are the unsharded ones); at world 2
every rank holds the same weights, a skipped step changes nothing, and a resumed run is bitwise the uninterrupted
one; checkpoints hold the unsharded layout (codes shaped like the parameter, ``<name>_scale`` per block of it), so a
world-2 checkpoint loads at world 1 and into ``FusedAdamW`` with its codes and scales bit for bit, and continues.
"""
import pytest
import torch

import ampfused
from ampfused.ops.state_precision import QBLOCK, q8_blocks, q8_dequantize, q8_signed
import dist_data as D
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

FIN, FOUT = 48, 12
ROWS, STEPS, INF_STEP = 8, 5, 2
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
SGD = dict(lr=1e-2, momentum=0.9)
Q8 = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, seed=11)
MODES = {"q8": Q8, "sr+q8": dict(Q8, bf16_stochastic_round=True), "rem+q8": dict(Q8, store_param_remainders=True)}


def _model(transposed=False):
    """``transposed``: the weight's memory order is its transpose's (strides (1, FOUT)): its blocks of 256 run
    down the columns."""
    torch.manual_seed(0)
    model = torch.nn.Linear(FIN, FOUT).to(torch.bfloat16)
    if transposed:
        model.weight = torch.nn.Parameter(model.weight.detach().t().contiguous().t())
    return model


def _data(world, steps=STEPS, inject=True):
    """``(x, c)`` of small integers: gradients ``c^T x`` exact in bf16 in any summation order; an inf at INF_STEP
    on rank 1 (in the batch of a world of one too)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (steps, world * ROWS, FIN), generator=g).to(torch.bfloat16)
    c = torch.randint(-2, 3, (steps, world * ROWS, FOUT), generator=g).to(torch.bfloat16)
    if inject:
        x[INF_STEP, ROWS % (world * ROWS), 0] = float("inf")
    return x, c


def _optimizer(kind, model, sharded, options):
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    if kind == "adamw":
        cls = ampfused.ShardedFusedAdamW if sharded else ampfused.FusedAdamW
        return cls(groups, **ADAM, **options)
    options = {("momentum_dtype" if k == "exp_avg_dtype" else k): v for k, v in options.items()
               if k != "exp_avg_sq_dtype"}
    cls = ampfused.ShardedFusedSGD if sharded else ampfused.FusedSGD
    return cls(groups, **SGD, **options)


def _steps(model, opt, scaler, x, c, rows, steps, around=None):
    for s in steps:
        if s == INF_STEP and around is not None:
            around["before"] = _result(model, opt)
        xs, cs = x[s, rows], c[s, rows]
        scaler.scale((model(xs) * cs).sum() / xs.shape[0]).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if s == INF_STEP and around is not None:
            around["after"] = _result(model, opt)


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return {k: _clone(x) for k, x in v.items()} if isinstance(v, dict) else v


def _result(model, opt):
    return {"params": [p.detach().clone() for p in model.parameters()], "state": _clone(opt.state_dict())}


def _assert_state(got, want, where):
    """Every state entry with the same keys and bitwise the same tensors (codes, scales, masters, steps)."""
    assert sorted(got["state"]) == sorted(want["state"]), where
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st), f"{where}: state[{i}] keys"
        for key, v in st.items():
            assert_bitwise(f"{where}: state[{i}][{key}]", got["state"][i][key], v)
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert g == w, where


def _assert_same(got, want, where):
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert_bitwise(f"{where}: param[{i}]", a, b)
    _assert_state(got["state"], want["state"], where)


def _train_worker(rank, world, out, kind, options):
    model = _model()
    opt = _optimizer(kind, model, True, options)
    opt.shard_align = 16  # raised to lcm(16, QBLOCK) for 8-bit moments
    around = {}
    per_rank = 2 * ROWS // world
    _steps(model, opt, ampfused.GradScaler("cpu"), *_data(2), slice(rank * per_rank, (rank + 1) * per_rank),
           range(STEPS), around)
    cuts = [(s.offsets, s.shard, seg.starts, seg.lengths) for s in opt._spaces for seg in s.segments]
    save(out, rank, dict(_result(model, opt), around=around, cuts=cuts, bytes=opt.state_bytes(),
                         piece_keys={i: sorted(st) for i, st in enumerate(opt.state[p] for p in model.parameters())}))


def _single(kind, options, steps=range(STEPS), inject=True):
    model = _model()
    opt = _optimizer(kind, model, False, options)
    _steps(model, opt, ampfused.GradScaler("cpu"), *_data(2, inject=inject), slice(None), steps)
    return model, opt


@pytest.mark.parametrize("kind,mode", [("adamw", "sr+q8"), ("adamw", "rem+q8"), ("sgd", "q8")])
def test_q8_trains_on_one_and_two_ranks(tmp_path, kind, mode):
    """World 1: bitwise the single-process optimizer (weights, codes, scales, masters). World 2: the blocks are
    cut whole, every rank holds the same weights and state dict, the skipped step changes nothing, and each rank
    keeps its share of the codes and scales."""
    options = MODES[mode]
    for world in (1, 2):
        (tmp_path / f"w{world}").mkdir()
        run_ranks(_train_worker, world, str(tmp_path / f"w{world}"), kind, options)
    model, opt = _single(kind, options)
    want = _result(model, opt)
    _assert_same(load(tmp_path / "w1", 1)[0], want, "world 1")

    ranks = load(tmp_path / "w2", 2)
    names = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
    for r, got in enumerate(ranks):
        _assert_same(got, ranks[0], f"rank {r} against rank 0")
        _assert_same(got["around"]["after"], got["around"]["before"], f"rank {r}, the skipped step")
        for i, p in enumerate(model.parameters()):
            st = got["state"]["state"][i]
            assert sorted(st) == sorted(want["state"]["state"][i]), f"rank {r}: the single-process keys"
            for name in names:
                assert st[f"{name}_codes"].dtype == torch.uint8 and st[f"{name}_codes"].shape == p.shape
                assert st[f"{name}_scale"].dtype == torch.float32
                assert st[f"{name}_scale"].shape == (q8_blocks(p.numel()),)
            assert {f"{name}_scale" for name in names} <= set(got["piece_keys"][i])
        assert all(shard == 2 * QBLOCK and offsets == [0, 3 * QBLOCK] for offsets, shard, _, _ in got["cuts"])
        if kind == "adamw":
            _assert_near_single(got, want, f"rank {r}")
    # rank 0: weight blocks 0-1; rank 1: weight block 2 (64 elements) and the bias
    assert [c[2:] for c in ranks[0]["cuts"]] == [([0], [512])]
    assert [c[2:] for c in ranks[1]["cuts"]] == [([512], [64]), ([0], [12])]
    master = {"sr+q8": 0, "rem+q8": 2, "q8": 4}[mode]  # bytes per element (fp32 masters for SGD's bf16 weights)
    blocks = 2 + 1 + 1  # scale columns: rank 0's two blocks, rank 1's weight block and bias block
    assert sum(got["bytes"] for got in ranks) == (master + len(names)) * 588 + 4 * len(names) * blocks + 4 * 3


def _assert_near_single(got, want, where):
    """A world-2 AdamW run against the single-process one, which draws other bits: decoded moments within two codes
    of the top binade (3 mantissa bits: 2**-3 of the largest value), weights within a quarter of lr per update plus
    a bf16 rounding of the weight each."""
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        bound = (STEPS - 1) * (ADAM["lr"] / 4 + 2.0 ** -7 * b.float().abs())
        assert ((a.float() - b.float()).abs() <= bound).all(), f"{where}: param[{i}] strays from the single run"
        for name in ("exp_avg", "exp_avg_sq"):
            mine, single = (q8_dequantize(st[f"{name}_codes"].reshape(-1), st[f"{name}_scale"], q8_signed(name))
                            for st in (got["state"]["state"][i], want["state"]["state"][i]))
            assert (mine - single).abs().max() <= 2 * 2.0 ** -3 * single.abs().max(), f"{where}: {name}[{i}]"


def _ckpt_worker(rank, world, out, options, ckpt, phase, transposed=False):
    """``save``: 4 steps, the checkpoint after 2 (rank 0 writes it); ``load``: the checkpoint, its state dict as
    loaded, then steps 2 and 3. Every world size sees the same 16 rows per step."""
    model = _model(transposed)
    opt = _optimizer("adamw", model, True, options)
    x, c = _data(2, inject=False)
    per_rank = 2 * ROWS // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 10)
    D.checkpoint_phase(model, opt, ckpt, phase, rank, lambda: _steps(model, opt, scaler, x, c, rows, range(2)))
    loaded = _clone(opt.state_dict()) if phase == "load" else None
    _steps(model, opt, scaler, x, c, rows, range(2, 4))
    save(out, rank, dict(_result(model, opt), loaded=loaded))


def _ckpt(tmp_path, world, options, ckpt, phase, transposed=False):
    out = tmp_path / f"{phase}-{world}-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    run_ranks(_ckpt_worker, world, str(out), options, ckpt, phase, transposed)
    return load(out, world)


def _single_from(options, sd, transposed=False):
    """FusedAdamW loaded from checkpoint ``sd``: its state dict as loaded, and after steps 2 and 3."""
    model = _model(transposed)
    with torch.no_grad():
        for p, v in zip(model.parameters(), sd["model"]):
            p.copy_(v)
    opt = _optimizer("adamw", model, False, options)
    opt.load_state_dict(sd["optim"])
    loaded = _clone(opt.state_dict())
    x, c = _data(2, inject=False)
    _steps(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, slice(None), range(2, 4))
    return loaded, _result(model, opt)


def test_q8_checkpoint_moves_between_world_sizes_and_the_single_process_optimizer(tmp_path):
    options = MODES["sr+q8"]
    ckpt = str(tmp_path / "two.pt")
    whole = _ckpt(tmp_path, 2, options, ckpt, "save")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["optim"]["state"][0]["exp_avg_codes"].dtype == torch.uint8
    assert saved["optim"]["state"][0]["exp_avg_scale"].shape == (3,)

    resumed = _ckpt(tmp_path, 2, options, ckpt, "load")
    for r in range(2):
        _assert_state(resumed[r]["loaded"], saved["optim"], f"world 2 rank {r} as loaded")
        _assert_same(resumed[r], whole[r], f"resumed rank {r}")

    one = _ckpt(tmp_path, 1, options, ckpt, "load")[0]
    _assert_state(one["loaded"], saved["optim"], "world 1 as loaded")
    single_loaded, single = _single_from(options, saved)
    _assert_state(single_loaded, saved["optim"], "FusedAdamW as loaded")
    _assert_same(one, single, "world 1 against FusedAdamW, continued")  # a world of one draws as FusedAdamW
    for i, st in single["state"]["state"].items():
        assert st["step"] == 4


def test_single_process_checkpoints_load_at_world_two(tmp_path):
    """A FusedAdamW checkpoint with 8-bit moments reshards exactly (codes and scales as saved on every rank); one
    of fp32 moments is encoded to nearest, one of 8-bit moments into fp32 moments decoded exactly, and 8-bit codes
    into a weight of another memory order (whose blocks are other elements) re-encoded to nearest, as FusedAdamW
    loads them."""
    for name, saved_options, options in (("q8", MODES["rem+q8"], MODES["rem+q8"]),
                                         ("fp32 into q8", {}, MODES["rem+q8"]),
                                         ("q8 into fp32", MODES["rem+q8"], dict(store_param_remainders=True)),
                                         ("q8 into transposed", MODES["rem+q8"], MODES["rem+q8"])):
        transposed = name.endswith("transposed")
        model, opt = _single("adamw", saved_options, steps=range(2), inject=False)
        ckpt = str(tmp_path / f"{name}.pt")
        torch.save({"optim": opt.state_dict(), "model": [p.detach().clone() for p in model.parameters()]}, ckpt)
        saved = torch.load(ckpt, weights_only=False)
        ranks = _ckpt(tmp_path, 2, options, ckpt, "load", transposed)
        single_loaded, single = _single_from(options, saved, transposed)
        if name == "q8":
            _assert_state(single_loaded, saved["optim"], name)
        if transposed:  # the codes follow the weight's memory order
            assert ranks[0]["loaded"]["state"][0]["exp_avg_codes"].stride() == (1, FOUT)
        for r, got in enumerate(ranks):
            _assert_state(got["loaded"], single_loaded, f"{name}, rank {r} as loaded")
            _assert_same(got, ranks[0], f"{name}, rank {r} against rank 0, continued")


def _dcp_worker(rank, world, out, ckpt, phase):
    """``save``: 2 steps, then a torch.distributed.checkpoint; ``load``: the checkpoint into a fresh model and
    optimizer. The state dict is kept either way."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    model = _model()
    opt = _optimizer("adamw", model, True, MODES["rem+q8"])
    if phase == "save":
        per_rank = 2 * ROWS // world
        _steps(model, opt, ampfused.GradScaler("cpu"), *_data(2, inject=False),
               slice(rank * per_rank, (rank + 1) * per_rank), range(2))
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=ckpt)
    else:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    save(out, rank, _result(model, opt))


def test_q8_dcp_checkpoint_loads_at_another_world_size(tmp_path):
    """get_optimizer_state_dict / set_optimizer_state_dict carry the codes and their block scales: a DCP checkpoint
    of 2 ranks loads on 1 with the weights, codes, scales and remainders bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    for phase, world in (("save", 2), ("load", 1)):
        (tmp_path / phase).mkdir()
        run_ranks(_dcp_worker, world, str(tmp_path / phase), ckpt, phase)
    saved = load(tmp_path / "save", 2)[0]
    assert saved["state"]["state"][0]["exp_avg_scale"].shape == (3,)
    _assert_same(load(tmp_path / "load", 1)[0], saved, "loaded at world 1")
