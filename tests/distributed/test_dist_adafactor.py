"""FusedAdafactor with FSDP2 (``fully_shard``) on gloo processes.

Each rank steps its shards; a matrix split along its rows sums its column sums, its row-factor mean and its
sums of ``w*w`` and ``u*u`` over the ranks (two all-reduces a step, on the device). Given the same gradients, the
gathered parameters and factors are the single-process step within the oracle rule (tests/oracle.py: the sums
are added in another order), the column factors every rank holds whole are the same bits on every rank, and a
sharded checkpoint (torch.distributed.checkpoint) moves between world sizes.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import ampfused
import dist_data as D
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise, assert_close_to_oracle

HYPER = dict(lr=1e-2, weight_decay=0.1, eps=(1e-30, 1e-3))
STEPS = 4
SKIP = 2  # the step whose gradient has an inf on the last rank: every rank skips it


class _Net(torch.nn.Sequential):
    def forward(self, x):  # (the 3-D weight joins the output, so backward gives it a gradient)
        return super().forward(x) + 0.01 * self.kernel.square().sum()


def _model(dtype=torch.float32):
    """Matrices of 16, 5 and 1 rows (3 ranks hold 6/5/5, 2/2/1 and 1/0/0 of them), vectors, and a 3-D weight."""
    torch.manual_seed(0)
    model = _Net(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5), torch.nn.Tanh(),
                 torch.nn.Linear(5, 1))
    model.register_parameter("kernel", torch.nn.Parameter(torch.randn(3, 4, 5) * 0.1))
    return model.to(dtype)


def _grads(step, model):
    """The step's whole gradients (the same on every rank), an inf at SKIP."""
    g = torch.Generator().manual_seed(10 + step)
    out = [torch.randn(p.shape, generator=g) * 0.5 for p in model.parameters()]
    if step == SKIP:
        out[2].view(-1)[-1] = float("inf")
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _give(p, g):
    """``g`` (whole) as parameter ``p``'s gradient: its shard, placed like ``p``."""
    if isinstance(p, DTensor):
        g = torch.distributed.tensor.distribute_tensor(g.to(p.dtype), p.device_mesh, p.placements)
    p.grad = g.to(p.dtype)


def _train(model, opt, scaler, steps):
    for k in steps:
        scaler.scale(torch.zeros(()))  # (a loss would be scaled here: the scaler's scale exists from now)
        for p, g in zip(model.parameters(), _grads(k, model)):
            _give(p, g * scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _snapshot(model, opt):
    """``{"params": {name: whole tensor}, key: {name: whole state tensor}}`` (a collective for FSDP2)."""
    out = {"params": {}}
    for name, p in model.named_parameters():
        out["params"][name] = _full(p.detach()).clone()
        for key, v in opt.state[p].items():
            out.setdefault(key, {})[name] = _full(v).clone()
    return out


def _worker(rank, world, out, max_norm, dtype):
    model = _model(dtype)
    fully_shard(model)
    opt = ampfused.FusedAdafactor(model.parameters(), **HYPER, max_grad_norm=max_norm)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    run_step, phases = ampfused.ops.run_step, []

    def recorded(call, backend):
        phases.append((call.shard[0] if call.shard is not None else None, backend))
        run_step(call, backend)

    ampfused.ops.run_step = recorded
    _train(model, opt, scaler, range(STEPS))
    ampfused.ops.run_step = run_step
    # the step's three phases, each step, on the backend the optimizer runs (the native kernels where built)
    backend = ampfused.ops.step_backend(torch.device("cpu"), (str(dtype),), None, "adafactor_step_")
    assert phases == [(phase, backend) for _ in range(STEPS) for phase in (1, 2, 3)], phases
    w = model[4].weight  # one row: rank 0 holds it, the others an empty shard
    col_var = opt.state[w]["col_var"]
    assert isinstance(col_var, DTensor) and col_var.placements == (Replicate(),), col_var.placements
    assert opt.state[w]["row_var"].placements == (Shard(0),)
    save(out, rank, dict(_snapshot(model, opt), col_local=col_var.to_local().clone(), scale=scaler.get_scale(),
                         local={n: p.to_local().shape[0] for n, p in model.named_parameters()}))


def _single(dtype, max_norm, fp64=False):
    """The single-process run: FusedAdafactor on the reference backend, or (``fp64``) the oracle, the reference
    step in fp64 with the same scaler's scales, clipping and skip."""
    model = _model(dtype)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    if not fp64:
        opt = ampfused.FusedAdafactor(model.parameters(), **HYPER, max_grad_norm=max_norm, backend="reference")
        _train(model, opt, scaler, range(STEPS))
        return _snapshot(model, opt), scaler.get_scale()
    return D.adafactor_oracle(model, lambda k: _grads(k, model), STEPS, HYPER, max_norm), None


@pytest.mark.parametrize("world,max_norm", [(2, None), (3, 0.5)])
def test_fsdp2_adafactor_is_the_single_process_step(tmp_path, world, max_norm):
    run_ranks(_worker, world, str(tmp_path), max_norm, torch.float32)
    ref32, scale = _single(torch.float32, max_norm)
    ref64, _ = _single(torch.float32, max_norm, fp64=True)
    got = load(tmp_path, world)
    assert got[-1]["local"]["4.weight"] == 0 and got[0]["local"]["4.weight"] == 1  # empty shards
    for r, g in enumerate(got):
        assert g["scale"] == scale  # the skipped step backed off on every rank
        for key in ("params", "row_var", "col_var", "variance", "step"):
            assert sorted(g[key]) == sorted(ref32[key]), key
            for name, a in g[key].items():
                assert_close_to_oracle(f"rank {r}: {key}[{name}]", a, ref32[key][name], ref64[key][name])
        assert_bitwise(f"rank {r}: col_var held whole", g["col_local"], got[0]["col_local"])


def _bf16_worker(rank, world, out):
    model = _model(torch.bfloat16)
    fully_shard(model)
    opt = ampfused.FusedAdafactor(model.parameters(), **HYPER, store_param_remainders=True)
    _train(model, opt, ampfused.GradScaler("cpu", init_scale=2.0 ** 8), range(STEPS))
    assert all(opt.state[p]["master_remainder"].dtype == torch.int16 for p in model.parameters())
    save(out, rank, {"params": {n: _full(p.detach()).clone() for n, p in model.named_parameters()}})


def test_fsdp2_adafactor_bf16_with_remainders(tmp_path):
    """bf16 shards with master remainders: the gathered weights are the single-process run's within a bf16 ulp
    (the masters within the oracle rule would be the fp32 case; the rounding to bf16 can flip at a tie)."""
    run_ranks(_bf16_worker, 2, str(tmp_path))
    want, _ = _single(torch.bfloat16, None)
    for r, g in enumerate(load(tmp_path, 2)):
        for name, a in g["params"].items():
            b = want["params"][name]
            ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-3)
            assert ((a.float() - b.float()).abs() <= ulp).all(), f"rank {r}: param[{name}]"


def _dcp_worker(rank, world, out, ckpt, phase):
    model = _model()
    fully_shard(model)
    opt = ampfused.FusedAdafactor(model.parameters(), **HYPER)
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
    """2 ranks save a DCP checkpoint after 2 steps; 3 ranks load it (resharded by torch.distributed.checkpoint,
    the replicated column factors included) and take the last 2: the single-process run within the oracle rule,
    and the full state dict (get_optimizer_state_dict, full_state_dict=True) is that run's state."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "w2").mkdir()
    (tmp_path / "w3").mkdir()
    run_ranks(_dcp_worker, 2, str(tmp_path / "w2"), ckpt, "save")
    run_ranks(_dcp_worker, 3, str(tmp_path / "w3"), ckpt, "load")
    ref32, _ = _single(torch.float32, None)
    ref64, _ = _single(torch.float32, None, fp64=True)
    for r, got in enumerate(load(tmp_path / "w3", 3)):
        for name, a in got["params"].items():
            assert_close_to_oracle(f"rank {r}: param[{name}]", a, ref32["params"][name], ref64["params"][name])
        states = got["optim"]["state"]
        assert sorted(states) == sorted(ref32["params"])
        for name, st in states.items():
            assert sorted(st) == sorted(k for k in ref32 if k != "params" and name in ref32[k]), name
            for key, v in st.items():
                assert_close_to_oracle(f"rank {r}: state[{name}][{key}]", _full(torch.as_tensor(v)),
                                       ref32[key][name], ref64[key][name])


def _refused(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    w = torch.nn.Parameter(torch.distributed.tensor.distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    mesh2 = init_device_mesh("cpu", (1, world))
    both = torch.nn.Parameter(torch.distributed.tensor.distribute_tensor(torch.randn(4, 6), mesh2,
                                                                         [Shard(0), Shard(1)]))
    ampfused.FusedAdafactor([w])  # one split dimension: taken
    with pytest.raises(NotImplementedError, match=r"split along dimensions \[0, 1\]"):
        ampfused.FusedAdafactor([both])


def test_parameters_split_along_two_dimensions_are_refused(tmp_path):
    run_ranks(_refused, 2)


def _loop_worker(rank, world, out, kind):
    """A real loop: forward and backward on this rank's rows of each batch, FSDP2 (or DDP with ZeRO-1)
    reducing the gradients, the scaler, clipping."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _model()
    if kind == "fsdp2":
        fully_shard(model)
        opt = ampfused.FusedAdafactor(model.parameters(), **HYPER, max_grad_norm=1.0)
    else:
        model = DDP(model)
        opt = ampfused.ShardedFusedAdafactor(model.parameters(), **HYPER, max_grad_norm=1.0, grad_reduction=None)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8)
    for x, y in _batches():
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        scaler.scale(_loss(model, x[rows], y[rows])).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    module = model.module if kind == "ddp" else model
    save(out, rank, {n: _full(p.detach()).clone() for n, p in module.named_parameters()})


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(12, 8, generator=g), torch.randn(12, 1, generator=g)) for _ in range(3)]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_a_training_loop_with_backward_is_the_single_process_one(tmp_path, kind):
    """FusedAdafactor under FSDP2, and ShardedFusedAdafactor under DDP, in a loop with backward on 2 ranks: the
    single-process run on the whole batches, up to the gradients' own rounding (the ranks' means of halves)."""
    run_ranks(_loop_worker, 2, str(tmp_path), kind)
    model = _model()
    opt = ampfused.FusedAdafactor(model.parameters(), **HYPER, max_grad_norm=1.0)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0 ** 8)
    for x, y in _batches():
        scaler.scale(_loss(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    for r, got in enumerate(load(tmp_path, 2)):
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")
