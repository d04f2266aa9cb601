"""ampfused.ShardedFusedAdafactor (ZeRO-1) on gloo processes: each rank keeps the state of its piece of every
parameter's first dimension and steps it with FusedAdafactor's sharded step.

Each rank gets its own gradients; the run equals the single-process FusedAdafactor given their sum and
``grad_divisor=world`` (what ``grad_reduction="mean"`` does) within the oracle rule (tests/oracle.py: the fp64
step is the oracle), parameters bit for bit the same on every rank. Its whole state dict loads at another world
size and into FusedAdafactor and torch.optim.Adafactor; the parameters follow what the loop writes into them.
"""

import pytest
import torch

import ampfused
import dist_data as D
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise, assert_close_to_oracle

HYPER = dict(lr=1e-2, weight_decay=0.1, eps=(None, 1e-3))
STEPS = 4
SKIP = 2  # an inf in the last rank's gradient at this step: every rank skips


def _model(dtype=torch.float32):
    """Matrices of 16, 5 and 1 rows (3 ranks hold 6/5/5, 2/2/1 and 1/0/0 of them), vectors, a 3-D and a 0-d one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 1))
    model.register_parameter("kernel", torch.nn.Parameter(torch.randn(3, 4, 5) * 0.1))
    model.register_parameter("gain", torch.nn.Parameter(torch.tensor(0.7)))
    return model.to(dtype)


def _grads(step, rank, world, model):
    """Rank ``rank``'s gradients of step ``step``; an inf on the last rank at SKIP. Multiples of 1/64 up to 1/2:
    bf16 holds them, their scaled values and the sum of three ranks' exactly, so a reduce-scatter in bf16 gives
    the single-process run's gradient."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = [torch.randint(-32, 33, p.shape, generator=g) / 64.0 for p in model.parameters()]
    if step == SKIP and rank == world - 1:
        out[3].view(-1)[0] = float("inf")
    return out


def _summed(step, world, model, dtype=torch.float32):
    """The ranks' gradients summed in rank order (what the reduce-scatter sums), in ``dtype``."""
    per_rank = [_grads(step, r, world, model) for r in range(world)]
    out = []
    for i in range(len(per_rank[0])):
        total = per_rank[0][i].to(dtype)
        for r in range(1, world):
            total = total + per_rank[r][i].to(dtype)
        out.append(total)
    return out


def _scaler():
    return ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)


def _train(model, opt, scaler, steps, grads_of, **step_kw):
    for k in steps:
        scaler.scale(torch.zeros(()))  # (a loss would be scaled here)
        for p, g in zip(model.parameters(), grads_of(k)):
            p.grad = (g * scaler.get_scale()).to(p.dtype)
        scaler.step(opt, **step_kw)
        scaler.update()
        opt.zero_grad()


def _state(model, sd):
    """``{key: {name: tensor}}`` of a whole state dict (torch's layout) and ``params``."""
    names = [n for n, _ in model.named_parameters()]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for n, i in zip(names, ids):
        for key, v in sd["state"].get(i, {}).items():
            out.setdefault(key, {})[n] = torch.as_tensor(v).clone()
    return out


def _worker(rank, world, out, max_norm, dtype, opts):
    model = _model(dtype)
    opt = ampfused.ShardedFusedAdafactor(model.parameters(), **HYPER, max_grad_norm=max_norm, **opts)
    scaler = _scaler()
    if opts.get("grad_reduction", "mean") is None:  # reduced already, as DDP leaves them: the mean on every rank
        grads_of = lambda k: [g / world for g in _summed(k, world, model)]  # noqa: E731 (world 2: exact)
    else:
        grads_of = lambda k: _grads(k, rank, world, model)  # noqa: E731
    _train(model, opt, scaler, range(STEPS), grads_of)
    save(out, rank, dict(_state(model, opt.state_dict()), scale=scaler.get_scale(), bytes=opt.state_bytes(),
                         skipped=bool(opt.last_step_skipped)))


def _single(world, max_norm, dtype=torch.float32, mean=True, **opts):
    model = _model(dtype)
    opt = ampfused.FusedAdafactor(model.parameters(), **HYPER, max_grad_norm=max_norm, backend="reference", **opts)
    scaler = _scaler()
    _train(model, opt, scaler, range(STEPS), lambda k: _summed(k, world, model), grad_divisor=world if mean else None)
    return _state(model, opt.state_dict()), scaler.get_scale(), opt


def _oracle(world, max_norm, mean=True):
    """The fp64 reference step on the summed gradients, with the same scales, clip and skip."""
    model = _model()
    return D.adafactor_oracle(model, lambda k: _summed(k, world, model, torch.float64), STEPS, HYPER, max_norm,
                              divisor=world if mean else 1)


def _assert_runs_match(got, ref32, ref64, keys=("params", "row_var", "col_var", "variance", "step")):
    """Every rank's parameters and state against the single-process run within the oracle rule."""
    for r, g in enumerate(got):
        for key in keys:
            assert sorted(g[key]) == sorted(ref32[key]), key
            for name, a in g[key].items():
                assert a.shape == ref32[key][name].shape, (key, name)
                assert_close_to_oracle(f"rank {r}: {key}[{name}]", a, ref32[key][name], ref64[key][name])


@pytest.mark.parametrize("world,max_norm,reduction", [(2, None, "mean"), (3, 0.5, "mean"), (2, 0.5, None)])
def test_zero1_adafactor_is_the_single_process_step(tmp_path, world, max_norm, reduction):
    run_ranks(_worker, world, str(tmp_path), max_norm, torch.float32, {"grad_reduction": reduction})
    ref32, scale, _ = _single(world, max_norm)
    ref64 = _oracle(world, max_norm)
    got = load(tmp_path, world)
    _assert_runs_match(got, ref32, ref64)
    for r, g in enumerate(got):
        assert g["scale"] == scale  # the skipped step backed off on every rank
        for name, a in g["params"].items():
            assert_bitwise(f"rank {r}: param {name} as rank 0's", a, got[0]["params"][name])


def test_zero1_adafactor_bf16_remainders_keep_a_share_of_the_state(tmp_path):
    """bf16 parameters with master remainders: the weights within a bf16 ulp of the single-process run, and each
    rank holds about 1/world of the remainders (the pieces of every parameter's first dimension)."""
    world = 2
    run_ranks(_worker, world, str(tmp_path), None, torch.bfloat16, {"store_param_remainders": True})
    want, _, single = _single(world, None, torch.bfloat16, store_param_remainders=True)
    for r, g in enumerate(load(tmp_path, world)):
        for name, a in g["params"].items():
            b = want["params"][name]
            ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-3)
            assert ((a.float() - b.float()).abs() <= ulp).all(), f"rank {r}: param {name}"
        assert sorted(g["master_remainder"]) == sorted(want["master_remainder"])
        whole = sum(t.numel() * t.element_size() for seg in single._segs.segments
                    for t in (seg.master, seg.states["factors"], seg.steps) if t is not None)
        assert g["bytes"] < 0.75 * whole, (g["bytes"], whole)


def _save_at_2_resume_at_3(tmp_path, worker, ckpt):
    """``worker`` saves at 2 ranks after 2 steps and resumes at 3 for the last 2 (gradients summed, not
    averaged); every rank's run is the single-process one within the oracle rule."""
    (tmp_path / "w2").mkdir()
    (tmp_path / "w3").mkdir()
    run_ranks(worker, 2, str(tmp_path / "w2"), "save", ckpt)
    run_ranks(worker, 3, str(tmp_path / "w3"), "load", ckpt)
    ref32, _, _ = _single(2, None, mean=False)
    _assert_runs_match(load(tmp_path / "w3", 3), ref32, _oracle(2, None, mean=False))


def _resume_worker(rank, world, out, phase, ckpt):
    model = _model()
    opt = ampfused.ShardedFusedAdafactor(model.parameters(), **HYPER, grad_reduction="sum")
    scaler = _scaler()
    if phase == "load":
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])  # after the optimizer was built: it follows
        opt.load_state_dict(saved["optim"])
        scaler.load_state_dict(saved["scaler"])
        _train(model, opt, scaler, range(2, STEPS), lambda k: _grads(k, rank % 2, 2, model) if rank < 2 else
               [torch.zeros_like(p) for p in model.parameters()])
    else:
        _train(model, opt, scaler, range(2), lambda k: _grads(k, rank, world, model))
    sd = opt.state_dict()
    if rank == 0 and phase == "save":
        torch.save({"model": model.state_dict(), "optim": sd, "scaler": scaler.state_dict()}, ckpt)
    save(out, rank, _state(model, sd))


def test_whole_state_dict_moves_between_world_sizes_and_optimizers(tmp_path):
    """2 ranks take 2 steps and save the model, the scaler and the whole optimizer state; 3 ranks (the third
    with zero gradients, so the summed gradients are the same) load them into a model and optimizer built before
    and take the last 2: the single-process run of 4 steps. The same state dict loads into FusedAdafactor and
    torch.optim.Adafactor."""
    ckpt = str(tmp_path / "ckpt.pt")
    _save_at_2_resume_at_3(tmp_path, _resume_worker, ckpt)
    saved = torch.load(ckpt, weights_only=False)
    model = _model()
    model.load_state_dict(saved["model"])
    fused = ampfused.FusedAdafactor(model.parameters(), **HYPER)
    fused.load_state_dict(saved["optim"])
    torch_opt = torch.optim.Adafactor(model.parameters(), **HYPER)
    torch_opt.load_state_dict(saved["optim"])
    for p in model.parameters():
        assert sorted(k for k in fused.state[p] if k != "master_param") == sorted(torch_opt.state[p])
        for key, v in torch_opt.state[p].items():
            assert_bitwise(f"{key} of shape {tuple(p.shape)}", torch.as_tensor(fused.state[p][key]).float(),
                           torch.as_tensor(v).float())


def _errors(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    with pytest.raises(ValueError, match="grad_reduction must be 'mean', 'sum' or None"):
        ampfused.ShardedFusedAdafactor([torch.nn.Parameter(torch.ones(3))], grad_reduction="avg")
    mesh = init_device_mesh("cpu", (world,))
    dt = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="is a DTensor: ShardedFusedAdafactor shards replicated parameters"):
        ampfused.ShardedFusedAdafactor([dt])
    with pytest.raises(ValueError, match=r"Clipping threshold d should be >= 1 but is: 0.5"):
        ampfused.ShardedFusedAdafactor([torch.nn.Parameter(torch.ones(3))], d=0.5)


def test_bad_arguments_are_refused(tmp_path):
    run_ranks(_errors, 2, str(tmp_path))


def _dcp_worker(rank, world, out, phase, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    model = _model()
    opt = ampfused.ShardedFusedAdafactor(model.parameters(), **HYPER, grad_reduction="sum")
    scaler = _scaler()
    if phase == "load":
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=ckpt)
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        scaler.load_state_dict({"scale": 2.0 ** 10, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 1, "_growth_tracker": 0})
        _train(model, opt, scaler, range(2, STEPS), lambda k: _grads(k, rank % 2, 2, model) if rank < 2 else
               [torch.zeros_like(p) for p in model.parameters()])
    else:
        _train(model, opt, scaler, range(2), lambda k: _grads(k, rank, world, model))
        dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    save(out, rank, _state(model, opt.state_dict()))


def test_dcp_checkpoint_moves_between_world_sizes(tmp_path):
    """torch.distributed.checkpoint with get/set_optimizer_state_dict: saved by 2 ranks, loaded by 3, the run
    goes on as the single-process one."""
    _save_at_2_resume_at_3(tmp_path, _dcp_worker, str(tmp_path / "ckpt"))


def _unscale_worker(rank, world, out):
    model = _model()
    opt = ampfused.ShardedFusedAdafactor(model.parameters(), **HYPER)
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(len(sd["state"])))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("loaded"))
    scaler = _scaler()
    before = [p.detach().clone() for p in model.parameters()]
    for k in (SKIP, SKIP + 1):  # an inf on the last rank only, then a clean step
        scaler.scale(torch.zeros(()))
        for p, g in zip(model.parameters(), _grads(k, rank, world, model)):
            p.grad = g * scaler.get_scale()
        scaler.unscale_(opt)  # (as before a clip): the overflow of any rank is every rank's
        if k == SKIP:
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), _grads(k, rank, world, model))
                       if torch.isfinite(g).all())
        scaler.step(opt)
        scaler.update()
        if k == SKIP:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a rank stepped over an inf"
            assert scaler.get_scale() == 2.0 ** 7
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    save(out, rank, {"seen": seen, "scale": scaler.get_scale(),
                     "changed": any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))})


def test_unscale_skips_every_rank_and_state_dict_hooks_run(tmp_path):
    """``GradScaler.unscale_`` before the step: the gradients unscaled in place, an inf on one rank skips the step
    and backs the scale off on every rank, the next step moves the weights; torch's state-dict hooks run."""
    run_ranks(_unscale_worker, 2, str(tmp_path))
    for r, got in enumerate(load(tmp_path, 2)):
        assert got["scale"] == 2.0 ** 8 and got["changed"], (r, got)
        assert got["seen"] == [len(list(_model().parameters())), "loaded"], got["seen"]
