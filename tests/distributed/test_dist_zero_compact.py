"""ZeRO-1 with compact optimizer state (docs/state-precision.md), on gloo processes.

Master remainders draw nothing, and the sharded step is elementwise on the same global gradient: a world-2 run
with remainders ends bitwise where the single-process remainder run ends, and its weights and remainders rebuild
the fp32-master run's masters. The stochastic modes draw by the element's index in each rank's own buffers, so a
run depends on the world size; what holds is checked: a world of one is bitwise the single-process optimizer,
every rank of a world of two holds the same weights, a resumed run is bitwise the uninterrupted one, a world-2
checkpoint continues at world 1 within the stochastic rounding's few ulps, and a skipped step changes nothing.
"""
import pytest
import torch

import ampfused
import dist_data as D
import test_dist_fsdp as F
import test_dist_zero as Z
import test_dist_zero_modes as M
from ampfused.ops.state_precision import join_master
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

ROWS, STEPS, INF_STEP = Z.ROWS, Z.STEPS, Z.INF_STEP
SGD = dict(lr=1e-2, momentum=0.9)
REMAINDERS = dict(store_param_remainders=True)
STOCHASTIC = dict(bf16_stochastic_round=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, seed=7)
BF16_ULP = 2.0 ** -7  # a bf16 value's spacing is at most 2**-7 of its magnitude


def _optimizer(kind, model, sharded, options):
    if kind == "adamw":
        cls = ampfused.ShardedFusedAdamW if sharded else ampfused.FusedAdamW
        return cls(Z._groups(model), **Z.ADAM, **options)
    options = {("momentum_dtype" if k == "exp_avg_dtype" else k): v for k, v in options.items()
               if k != "exp_avg_sq_dtype"}
    cls = ampfused.ShardedFusedSGD if sharded else ampfused.FusedSGD
    return cls(Z._groups(model), **SGD, **options)


def _steps(model, opt, scaler, x, c, rows, steps, on_step=None):
    for s in steps:
        if on_step is not None:
            on_step(s, "before")
        xs, cs = x[s, rows], c[s, rows]
        scaler.scale((model(xs) * cs).sum() / xs.shape[0]).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if on_step is not None:
            on_step(s, "after")


def _result(model, opt):
    return {"params": [p.detach().clone() for p in model.parameters()], "state": opt.state_dict()}


def _run_worker(rank, world, out, kind, options, align=None):
    """STEPS steps of the injected data (an inf at INF_STEP); the state around the skipped step is kept."""
    model = D.linear_model()
    opt = _optimizer(kind, model, True, options)
    if align is not None:
        opt.shard_align = align
    around = {}
    _steps(model, opt, ampfused.GradScaler("cpu"), *Z._data(world), slice(rank * ROWS, (rank + 1) * ROWS),
           range(STEPS), lambda s, when: around.__setitem__(when, _result(model, opt)) if s == INF_STEP else None)
    cuts = [(s.offsets, s.shard, seg.starts) for s in opt._spaces for seg in s.segments]
    save(out, rank, dict(_result(model, opt), around=around, cuts=cuts, bytes=opt.state_bytes()))


def _single(kind, options, world=2):
    model = D.linear_model()
    opt = _optimizer(kind, model, False, options)
    _steps(model, opt, ampfused.GradScaler("cpu"), *Z._data(world), slice(None), range(STEPS))
    return model, opt


def _assert_same(got, want, where):
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert_bitwise(f"{where}: param[{i}]", a, b)
    Z._assert_state_equal(got["state"], want["state"], where)


def _assert_within_ulps(where, got, want, n):
    """``got`` within ``n`` bf16 ulps of ``want``, on the weight's scale and on the update's (``lr``): weights that
    ``n`` stochastic roundings set apart, each of the weight (an ulp of it) or of a moment (an ulp of the update)."""
    a, b = got.float(), want.float()
    bound = n * BF16_ULP * (torch.maximum(a.abs(), b.abs()) + Z.ADAM["lr"])
    bad = (a - b).abs() > bound
    assert not bad.any(), f"{where}: {int(bad.sum())} of {bad.numel()} weights more than {n} bf16 ulps apart"


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_remainders_on_two_ranks_are_the_single_process_step(tmp_path, kind):
    run_ranks(_run_worker, 2, str(tmp_path), kind, REMAINDERS)
    model, opt = _single(kind, REMAINDERS)
    want = _result(model, opt)
    fp32_model, fp32_opt = _single(kind, {})
    masters = [fp32_opt.state[p]["master_param"] for p in fp32_model.parameters()]
    ranks = load(tmp_path, 2)
    # int16 remainder + fp32 moments (10 B; SGD's momentum: 6 B) per element, 136 elements; a step count per piece
    assert sum(got["bytes"] for got in ranks) == (10 if kind == "adamw" else 6) * 136 + 4 * 3
    for r, got in enumerate(ranks):
        _assert_same(got, want, f"rank {r}")
        for i, w in enumerate(got["params"]):
            rem = got["state"]["state"][i]["master_remainder"]
            assert rem.dtype == torch.int16 and rem.shape == w.shape
            assert_bitwise(f"rank {r}: master[{i}]", join_master(w, rem), masters[i])


def _write_worker(rank, world, out):
    model = D.linear_model()
    opt = _optimizer("adamw", model, True, REMAINDERS)
    x, c = D.batches(4, world * ROWS)
    M._write_loop(model, opt, x, c, slice(rank * ROWS, (rank + 1) * ROWS))
    save(out, rank, _result(model, opt))


def test_remainders_reset_where_the_model_is_written(tmp_path):
    """A weight written between steps (a checkpoint loaded into the model) resets its remainders on the rank that
    owns them, as the single-process optimizer resets them: the runs stay bitwise equal."""
    run_ranks(_write_worker, 2, str(tmp_path))
    model = D.linear_model()
    opt = _optimizer("adamw", model, False, REMAINDERS)
    x, c = D.batches(4, 2 * ROWS)
    M._write_loop(model, opt, x, c, slice(None))
    for r, got in enumerate(load(tmp_path, 2)):
        _assert_same(got, _result(model, opt), f"rank {r}")


def test_aligned_shards_cut_parameters_at_multiples_of_the_block(tmp_path):
    """``shard_align`` (what a block-wise state format sets): every parameter starts, and every shard boundary
    falls, at a multiple of it, and the step is unchanged (the 128-element weight is cut at 80, not at 68)."""
    run_ranks(_run_worker, 2, str(tmp_path), "adamw", REMAINDERS, 16)
    model, opt = _single("adamw", REMAINDERS)
    ranks = load(tmp_path, 2)
    for r, got in enumerate(ranks):
        _assert_same(got, _result(model, opt), f"rank {r}")
        for offsets, shard, starts in got["cuts"]:
            assert shard % 16 == 0 and all(o % 16 == 0 for o in offsets) and all(a % 16 == 0 for a in starts)
    assert ranks[1]["cuts"][0][2] == [80]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_stochastic_modes_on_one_and_two_ranks(tmp_path, kind):
    """No master and bf16 moments: world 1 is bitwise the single-process optimizer; at world 2 every rank holds
    the same weights (AdamW: within a bf16 ulp per update of the fp32 run's); the skipped step changes nothing."""
    for world in (1, 2):
        (tmp_path / f"w{world}").mkdir()
        run_ranks(_run_worker, world, str(tmp_path / f"w{world}"), kind, STOCHASTIC)
    model, opt = _single(kind, STOCHASTIC, world=1)
    _assert_same(load(tmp_path / "w1", 1)[0], _result(model, opt), "world 1")

    ranks = load(tmp_path / "w2", 2)
    names = {"exp_avg", "exp_avg_sq"} if kind == "adamw" else {"momentum_buffer"}
    assert sum(got["bytes"] for got in ranks) == 2 * len(names) * 136 + 4 * 3  # bf16 moments only
    fp32_model, _ = _single(kind, {})
    for r, got in enumerate(ranks):
        for i, st in got["state"]["state"].items():
            assert set(st) - {"step"} == names, f"rank {r}: no master in this mode"
            assert all(st[name].dtype == torch.bfloat16 for name in names)
        _assert_same(got, ranks[0], f"rank {r} against rank 0")
        _assert_same(got["around"]["after"], got["around"]["before"], f"rank {r}, the skipped step")
        if kind == "adamw":  # 4 updates (one step skipped), each 1 rounding apart
            for i, p in enumerate(fp32_model.parameters()):
                _assert_within_ulps(f"rank {r} param[{i}]", got["params"][i], p.detach(), STEPS)


def _resume_worker(rank, world, out, options, ckpt, phase):
    """``save``: 4 steps, a checkpoint after 2 (rank 0 writes it); ``load``: the checkpoint, then steps 2 and 3."""
    model = D.linear_model()
    opt = _optimizer("adamw", model, True, options)
    x, c = Z._data(2, inject=False)  # the same 16 rows per step at every world size
    per_rank = 2 * ROWS // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 10)
    D.checkpoint_phase(model, opt, ckpt, phase, rank, lambda: _steps(model, opt, scaler, x, c, rows, range(2)))
    if phase == "load" and options.get("store_param_remainders"):  # a bad remainder is refused, nothing changed
        bad = opt.state_dict()
        bad["state"][1]["master_remainder"] = bad["state"][1]["master_remainder"].float()
        with pytest.raises(ValueError, match="'master_remainder' of parameter 1 must be an int16 tensor"):
            opt.load_state_dict(bad)
    _steps(model, opt, scaler, x, c, rows, range(2, 4))
    save(out, rank, _result(model, opt))


def _resume(tmp_path, world, options, ckpt, phase):
    out = tmp_path / f"{phase}-{world}-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    run_ranks(_resume_worker, world, str(out), options, ckpt, phase)
    return load(out, world)


def test_stochastic_checkpoint_resumes_bitwise_and_loads_at_world_one(tmp_path):
    ckpt = str(tmp_path / "two.pt")
    whole = _resume(tmp_path, 2, STOCHASTIC, ckpt, "save")
    resumed = _resume(tmp_path, 2, STOCHASTIC, ckpt, "load")
    for r in range(2):
        _assert_same(resumed[r], whole[r], f"resumed rank {r}")
    one = _resume(tmp_path, 1, STOCHASTIC, ckpt, "load")[0]
    for i, p in enumerate(whole[0]["params"]):  # 2 updates drawn otherwise: 2 roundings each way
        _assert_within_ulps(f"world 1 param[{i}]", one["params"][i], p, 4)
    for i, st in whole[0]["state"]["state"].items():
        assert one["state"]["state"][i]["step"] == st["step"] == 4
        assert one["state"]["state"][i]["exp_avg"].dtype == torch.bfloat16


def _dcp_worker(rank, world, out, ckpt, phase):
    model = D.linear_model()
    opt = _optimizer("adamw", model, True, REMAINDERS)
    F.dcp_phase(model, opt, rank, world, ckpt, phase)
    save(out, rank, _result(model, opt))


def test_remainders_dcp_checkpoint_moves_between_world_sizes(tmp_path):
    """2 ranks save a torch.distributed.checkpoint after 2 steps; 1 and 4 ranks load it and take 2 more: all end
    bitwise where 4 uninterrupted single-process steps with remainders end (weights, remainders, moments)."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "w2").mkdir()
    run_ranks(_dcp_worker, 2, str(tmp_path / "w2"), ckpt, "save")
    model = D.linear_model()
    opt = _optimizer("adamw", model, False, REMAINDERS)
    x, c = Z._data(2, inject=False)
    _steps(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, slice(None), range(4))
    want = _result(model, opt)
    for world in (1, 4):
        (tmp_path / f"w{world}").mkdir()
        run_ranks(_dcp_worker, world, str(tmp_path / f"w{world}"), ckpt, "load")
        for r, got in enumerate(load(tmp_path / f"w{world}", world)):
            _assert_same(got, want, f"{world} ranks, rank {r}")


def test_fp32_checkpoint_converts_as_the_single_process_optimizer_converts(tmp_path):
    """A checkpoint of fp32 state (masters and moments) loads into the compact modes: at world 2 with remainders,
    and at world 1 with no master and bf16 moments, the run continues bitwise as the single-process optimizer
    that loaded the same checkpoint (remainders from the masters, moments rounded to bf16)."""
    ckpt = str(tmp_path / "fp32.pt")
    _resume(tmp_path, 2, {}, ckpt, "save")
    saved = torch.load(ckpt, weights_only=False)
    assert "master_param" in saved["optim"]["state"][0]
    x, c = Z._data(2, inject=False)
    for world, options in ((2, REMAINDERS), (1, STOCHASTIC)):
        ranks = _resume(tmp_path, world, options, ckpt, "load")
        model = D.linear_model()
        with torch.no_grad():
            for p, v in zip(model.parameters(), saved["model"]):
                p.copy_(v)
        opt = _optimizer("adamw", model, False, options)
        opt.load_state_dict(saved["optim"])
        _steps(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 10), x, c, slice(None), range(2, 4))
        for r, got in enumerate(ranks):
            _assert_same(got, _result(model, opt), f"world {world} rank {r} ({options})")


@pytest.mark.parametrize("cls", [ampfused.ShardedFusedAdamW, ampfused.ShardedFusedAdam, ampfused.ShardedFusedSGD])
def test_option_errors_are_the_fused_optimizers(cls):
    """Checked first, with the unsharded optimizer's rules and messages (before the process group is asked for:
    nothing is built)."""
    model = D.linear_model()
    before = [p.detach().clone() for p in model.parameters()]
    moments = "momentum_dtype" if cls is ampfused.ShardedFusedSGD else "exp_avg_dtype"
    single = {ampfused.ShardedFusedAdamW: ampfused.FusedAdamW, ampfused.ShardedFusedAdam: ampfused.FusedAdam,
              ampfused.ShardedFusedSGD: ampfused.FusedSGD}[cls]
    cases = [(ValueError, dict(store_param_remainders=True, bf16_stochastic_round=True)),
             (ValueError, dict(store_param_remainders=True, master_weights=False)),
             (ValueError, dict(bf16_stochastic_round=True, master_weights=True)),
             (ValueError, {moments: torch.float16}),
             (TypeError, dict(seed=1.5))]
    if moments == "exp_avg_dtype":
        cases.append((ValueError, dict(exp_avg_dtype=torch.bfloat16)))  # exp_avg_sq_dtype left fp32
    for error, options in cases:
        with pytest.raises(error) as want:
            single(model.parameters(), **options)
        message = str(want.value).replace(single.__name__, cls.__name__)
        with pytest.raises(error) as got:
            cls(model.parameters(), **options)
        assert str(got.value) == message
    for p, b in zip(model.parameters(), before):
        assert_bitwise("param", p.detach(), b)
