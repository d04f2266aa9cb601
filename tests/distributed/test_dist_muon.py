"""FusedMuon with FSDP2 (``fully_shard``) on gloo processes.

Each rank runs the step's two elementwise passes on its pieces; between them every matrix split along one of its
last two dimensions travels to the rank that owns it, is orthogonalized whole there and travels back (two
all-to-alls), and a stack of experts split along its first dimension is orthogonalized where it is. Given the
same gradients and no clip, the gathered weights and the whole state are the single-process step's bits; a DCP
checkpoint moves between world sizes and resumes bit for bit.
"""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import ampfused
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise

HYPER = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
STEPS = 4
SKIP = 2  # the step whose gradient has an inf: every rank skips it


class _Net(torch.nn.Sequential):
    def forward(self, x):  # (the experts join the output, so backward would give them a gradient)
        return super().forward(x) + 0.01 * self.experts.square().sum()


def _model(dtype=torch.float32):
    """Matrices of 16, 5 and 2 rows (3 ranks hold 6/6/4, 2/2/1 and 1/1/0 of their rows), their biases, and a
    stack of 3 experts (one per rank, or 2/1)."""
    torch.manual_seed(0)
    model = _Net(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5), torch.nn.Tanh(),
                 torch.nn.Linear(5, 2))
    model.register_parameter("experts", torch.nn.Parameter(torch.randn(3, 4, 6) * 0.1))
    return model.to(dtype)


def _groups(model):
    named = list(model.named_parameters())
    return [dict(params=[p for _, p in named if p.dim() >= 2]),
            dict(params=[p for _, p in named if p.dim() < 2], use_muon=False, lr=1e-3, weight_decay=0.0)]


def _grads(step, model):
    g = torch.Generator().manual_seed(10 + step)
    out = [torch.randn(p.shape, generator=g) * 0.5 for p in model.parameters()]
    if step == SKIP:
        out[2].view(-1)[-1] = float("inf")
    return out


def _full(t):
    """A DTensor whole on every rank (int16 remainders gathered as bf16 bits: gloo has no int16)."""
    if isinstance(t, DTensor) and t.dtype == torch.int16:
        bits = DTensor.from_local(t.to_local().view(torch.bfloat16), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
        return bits.full_tensor().view(torch.int16)
    return t.full_tensor() if isinstance(t, DTensor) else t


def _give(p, g):
    if isinstance(p, DTensor):
        g = torch.distributed.tensor.distribute_tensor(g.to(p.dtype), p.device_mesh, p.placements)
    p.grad = g.to(p.dtype)


def _train(model, opt, scaler, steps):
    for k in steps:
        scaler.scale(torch.zeros(()))
        for p, g in zip(model.parameters(), _grads(k, model)):
            _give(p, g * scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _snapshot(model, opt):
    out = {"params": {}}
    for name, p in model.named_parameters():
        out["params"][name] = _full(p.detach()).clone()
        for key, v in opt.state[p].items():
            out.setdefault(key, {})[name] = _full(torch.as_tensor(v)).clone()
    return out


def _build(model, max_norm=None, **kw):
    return ampfused.FusedMuon(_groups(model), **HYPER, max_grad_norm=max_norm, expert_stacks=True, **kw)


def _worker(rank, world, out, max_norm, dtype, kw):
    model = _model(dtype)
    fully_shard(model)
    opt = _build(model, max_norm, **kw)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    run_step, phases = ampfused.ops.run_step, []

    def recorded(call, backend):
        phases.append((call.spec.name, call.shard[0] if call.shard is not None else None))
        run_step(call, backend)

    ampfused.ops.run_step = recorded
    _train(model, opt, scaler, range(STEPS))
    ampfused.ops.run_step = run_step
    # each step: Muon's two passes around the exchange, AdamW's one
    assert phases == [c for _ in range(STEPS) for c in (("muon_step_", 1), ("muon_step_", 2),
                                                        ("adam_step_", None))], phases
    save(out, rank, dict(_snapshot(model, opt), scale=scaler.get_scale(), norm=opt.last_grad_norm.clone(),
                         local={n: tuple(p.to_local().shape) for n, p in model.named_parameters()}))


def _single(dtype, max_norm=None, **kw):
    model = _model(dtype)
    opt = _build(model, max_norm, **kw)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    _train(model, opt, scaler, range(STEPS))
    return _snapshot(model, opt), scaler.get_scale(), opt.last_grad_norm.clone()


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_muon_is_the_single_process_step(tmp_path, world):
    run_ranks(_worker, world, str(tmp_path), None, torch.float32, {})
    want, scale, _ = _single(torch.float32)
    got = load(tmp_path, world)
    if world == 3:
        assert got[2]["local"]["4.weight"] == (0, 5)  # an empty piece
        assert [g["local"]["experts"] for g in got] == [(1, 4, 6)] * 3  # whole experts: orthogonalized in place
    for r, g in enumerate(got):
        assert g["scale"] == scale  # the skipped step backed off on every rank
        for key in ("params", "momentum_buffer", "exp_avg", "exp_avg_sq", "step"):
            assert sorted(g[key]) == sorted(want[key]), key
            for name, a in g[key].items():
                assert_bitwise(f"rank {r}: {key}[{name}]", a, want[key][name])


def test_fsdp2_muon_with_a_clip(tmp_path):
    """With a clip the global norm is summed in another order (each rank's pieces, then over the ranks): the
    norm within a few fp32 ulps of one process's, the weights the same bits on every rank and within a bf16 ulp
    of the iteration's output per step of the single process's (the clip coefficient's last bit can move the
    iteration's bf16 input)."""
    run_ranks(_worker, 2, str(tmp_path), 0.5, torch.float32, {})
    want, _, norm = _single(torch.float32, 0.5)
    got = load(tmp_path, 2)
    for r, g in enumerate(got):
        torch.testing.assert_close(g["norm"], norm, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
        for name, a in g["params"].items():
            assert_bitwise(f"rank {r} vs 0: params[{name}]", a, got[0]["params"][name])
            b = want["params"][name]
            if a.dim() >= 2:  # each step moves a weight by lr * ratio * O, O's elements below 2 in magnitude
                ratio = 0.2 * max(a.shape[-2:]) ** 0.5
                bound = (STEPS - 1) * HYPER["lr"] * ratio * 2 * torch.finfo(torch.bfloat16).eps
                assert (a - b).abs().max() <= bound, (name, (a - b).abs().max(), bound)


def test_fsdp2_muon_bf16_with_remainders(tmp_path):
    """bf16 pieces with master remainders (no random draw): the single-process run's bits."""
    run_ranks(_worker, 2, str(tmp_path), None, torch.bfloat16, dict(store_param_remainders=True))
    want, _, _ = _single(torch.bfloat16, store_param_remainders=True)
    for r, g in enumerate(load(tmp_path, 2)):
        for key in ("params", "master_remainder", "momentum_buffer"):
            for name, a in g[key].items():
                assert_bitwise(f"rank {r}: {key}[{name}]", a, want[key][name])


def _dcp_worker(rank, world, out, ckpt, phase):
    model = _model()
    fully_shard(model)
    opt = _build(model)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    if phase == "load":
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                 "scaler": scaler.state_dict()}
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        scaler.load_state_dict(state["scaler"])
        _train(model, opt, scaler, range(2, STEPS))
    else:
        _train(model, opt, scaler, range(2))
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                  "scaler": scaler.state_dict()}, checkpoint_id=ckpt)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    save(out, rank, {"params": {n: _full(p.detach()).clone() for n, p in model.named_parameters()}, "optim": full})


def test_dcp_checkpoint_moves_between_world_sizes(tmp_path):
    """2 ranks save a DCP checkpoint after 2 steps; 3 ranks load it and take the last 2: the single-process run's
    bits, weights and full state (get_optimizer_state_dict, full_state_dict=True)."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "w2").mkdir()
    (tmp_path / "w3").mkdir()
    run_ranks(_dcp_worker, 2, str(tmp_path / "w2"), ckpt, "save")
    run_ranks(_dcp_worker, 3, str(tmp_path / "w3"), ckpt, "load")
    want, _, _ = _single(torch.float32)
    for r, got in enumerate(load(tmp_path / "w3", 3)):
        for name, a in got["params"].items():
            assert_bitwise(f"rank {r}: param[{name}]", a, want["params"][name])
        states = got["optim"]["state"]
        assert sorted(states) == sorted(want["params"])
        for name, st in states.items():
            assert sorted(st) == sorted(k for k in want if k != "params" and name in want[k]), name
            for key, v in st.items():
                assert_bitwise(f"rank {r}: state[{name}][{key}]", _full(torch.as_tensor(v)), want[key][name])


def _refused(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh2 = init_device_mesh("cpu", (1, world))
    dist = torch.distributed.tensor.distribute_tensor
    both = torch.nn.Parameter(dist(torch.randn(4, 6), mesh2, [Shard(0), Shard(1)]))
    twice = torch.nn.Parameter(dist(torch.randn(4, 6), mesh2, [Shard(0), Shard(0)]))
    with pytest.raises(NotImplementedError, match=r"split along dimensions \[0, 1\]"):
        ampfused.FusedMuon([both])
    with pytest.raises(NotImplementedError, match="ranks of one mesh dimension"):
        ampfused.FusedMuon([twice])
    opt = ampfused.FusedMuon([dict(params=[torch.nn.Parameter(torch.randn(4, 6))]),
                              dict(params=[torch.nn.Parameter(torch.randn(6))], use_muon=False)])
    assert len(opt.param_groups) == 2


def test_parameters_split_other_than_along_one_dimension_are_refused(tmp_path):
    run_ranks(_refused, 2)
