"""ampfused.ShardedFusedMuon (ZeRO-1) on gloo processes: each rank keeps the state of its piece of every parameter's
first dimension; FusedMuon's FSDP2 path steps the pieces, joining each matrix on its owner for the iteration.

Each rank gets its own gradients (multiples of 1/64: their sums over the ranks are exact); without a clip the run
is the single-process FusedMuon's given their sum and ``grad_divisor=world`` (what ``grad_reduction="mean"``
does) bit for bit, weights, momentum, AdamW's moments and step counts. Its whole state dict and a DCP checkpoint
move between world sizes and into FusedMuon.
"""

import pytest
import torch

import ampfused
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

HYPER = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", expert_stacks=True)
STEPS = 4
SKIP = 2  # an inf in the last rank's gradient at this step: every rank skips


def _model(dtype=torch.float32):
    """Matrices of 16, 5 and 2 rows, their biases, a stack of 3 experts (Muon) and a 0-d gain (AdamW)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 2))
    model.register_parameter("experts", torch.nn.Parameter(torch.randn(3, 4, 6) * 0.1))
    model.register_parameter("gain", torch.nn.Parameter(torch.tensor(0.7)))
    return model.to(dtype)


def _groups(model):
    ps = list(model.parameters())
    return [dict(params=[p for p in ps if p.dim() >= 2]),
            dict(params=[p for p in ps if p.dim() < 2], use_muon=False, lr=1e-3, weight_decay=0.0)]


def _grads(step, rank, world, model):
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = [torch.randint(-32, 33, p.shape, generator=g) / 64.0 for p in model.parameters()]
    if step == SKIP and rank == world - 1:
        out[2].view(-1)[0] = float("inf")
    return out


def _summed(step, world, model):
    per_rank = [_grads(step, r, world, model) for r in range(world)]
    out = []
    for i in range(len(per_rank[0])):
        total = per_rank[0][i]
        for r in range(1, world):
            total = total + per_rank[r][i]
        out.append(total)
    return out


def _scaler():
    return ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)


def _train(model, opt, scaler, steps, grads_of, **step_kw):
    for k in steps:
        scaler.scale(torch.zeros(()))
        for p, g in zip(model.parameters(), grads_of(k)):
            p.grad = (g * scaler.get_scale()).to(p.dtype)
        scaler.step(opt, **step_kw)
        scaler.update()
        opt.zero_grad()


def _state(model, sd):
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of[id(p)] for g in _groups(model) for p in g["params"]]  # in the groups' order, as ids are
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for n, i in zip(names, ids):
        for key, v in sd["state"].get(i, {}).items():
            out.setdefault(key, {})[n] = torch.as_tensor(v).clone()
    return out


def _worker(rank, world, out, reduction):
    model = _model()
    opt = ampfused.ShardedFusedMuon(_groups(model), **HYPER, grad_reduction=reduction)
    if reduction is None:  # reduced already, as DDP leaves them: the mean on every rank (world 2: exact)
        grads_of = lambda k: [g / world for g in _summed(k, world, model)]  # noqa: E731
    else:
        grads_of = lambda k: _grads(k, rank, world, model)  # noqa: E731
    scaler = _scaler()
    _train(model, opt, scaler, range(STEPS), grads_of)
    save(out, rank, dict(_state(model, opt.state_dict()), scale=scaler.get_scale(), bytes=opt.state_bytes()))


def _single(world, mean=True):
    model = _model()
    opt = ampfused.FusedMuon(_groups(model), **HYPER)
    scaler = _scaler()
    _train(model, opt, scaler, range(STEPS), lambda k: _summed(k, world, model), grad_divisor=world if mean else None)
    return _state(model, opt.state_dict()), scaler.get_scale(), opt


def _assert_same(got, want, keys=("params", "momentum_buffer", "exp_avg", "exp_avg_sq", "step")):
    for r, g in enumerate(got):
        for key in keys:
            assert sorted(g[key]) == sorted(want[key]), key
            for name, a in g[key].items():
                assert_bitwise(f"rank {r}: {key}[{name}]", a, want[key][name])


@pytest.mark.parametrize("world,reduction", [(2, "mean"), (3, "mean"), (2, None)])
def test_zero1_muon_is_the_single_process_step(tmp_path, world, reduction):
    run_ranks(_worker, world, str(tmp_path), reduction)
    want, scale, single = _single(world)
    got = load(tmp_path, world)
    _assert_same(got, want)
    whole = sum(t.numel() * t.element_size() for seg in single._segs.segments
                for t in (seg.master, *seg.states.values(), seg.steps) if t is not None)
    for g in got:
        assert g["scale"] == scale  # the skipped step backed off on every rank
        assert g["bytes"] < whole * 0.75  # a share of the state, not all of it


def _resume_worker(rank, world, out, phase, ckpt, use_dcp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    model = _model()
    opt = ampfused.ShardedFusedMuon(_groups(model), **HYPER, grad_reduction="sum")
    scaler = _scaler()
    if phase == "load":
        if use_dcp:
            state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=ckpt)
            model.load_state_dict(state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
        else:
            saved = torch.load(ckpt, weights_only=False)
            model.load_state_dict(saved["model"])  # after the optimizer was built: it follows
            opt.load_state_dict(saved["optim"])
        scaler.load_state_dict({"scale": 2.0 ** 10, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 1, "_growth_tracker": 0})
        _train(model, opt, scaler, range(2, STEPS), lambda k: _grads(k, rank % 2, 2, model) if rank < 2 else
               [torch.zeros_like(p) for p in model.parameters()])
    else:
        _train(model, opt, scaler, range(2), lambda k: _grads(k, rank, world, model))
        if use_dcp:
            dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    sd = opt.state_dict()
    if rank == 0 and phase == "save" and not use_dcp:
        torch.save({"model": model.state_dict(), "optim": sd}, ckpt)
    save(out, rank, _state(model, sd))


@pytest.mark.parametrize("use_dcp", [False, True])
def test_state_moves_between_world_sizes(tmp_path, use_dcp):
    """2 ranks take 2 steps and save (the whole state dict, or a DCP checkpoint); 3 ranks (the third with zero
    gradients, so the sums are the same) load into a model and optimizer built before and take the last 2: the
    single-process run of 4 steps, bit for bit. The whole state dict loads into FusedMuon."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "w2").mkdir()
    (tmp_path / "w3").mkdir()
    run_ranks(_resume_worker, 2, str(tmp_path / "w2"), "save", ckpt, use_dcp)
    run_ranks(_resume_worker, 3, str(tmp_path / "w3"), "load", ckpt, use_dcp)
    want, _, _ = _single(2, mean=False)
    _assert_same(load(tmp_path / "w3", 3), want)
    if not use_dcp:
        saved = torch.load(ckpt, weights_only=False)
        model = _model()
        model.load_state_dict(saved["model"])
        fused = ampfused.FusedMuon(_groups(model), **HYPER)
        fused.load_state_dict(saved["optim"])
        at2 = load(tmp_path / "w2", 2)[0]
        for n, p in model.named_parameters():
            for key, v in fused.state[p].items():
                if key in at2:
                    assert_bitwise(f"{key}[{n}]", torch.as_tensor(v), at2[key][n])


def _errors(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    with pytest.raises(ValueError, match="grad_reduction must be 'mean', 'sum' or None"):
        ampfused.ShardedFusedMuon([torch.nn.Parameter(torch.ones(3, 2))], grad_reduction="avg")
    mesh = init_device_mesh("cpu", (world,))
    dt = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="is a DTensor: ShardedFusedMuon shards replicated parameters"):
        ampfused.ShardedFusedMuon([dt])
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        ampfused.ShardedFusedMuon([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="momentum should be >= 0"):
        ampfused.ShardedFusedMuon([torch.nn.Parameter(torch.ones(3, 2))], momentum=-1.0)


def test_bad_arguments_are_refused(tmp_path):
    run_ranks(_errors, 2, str(tmp_path))
