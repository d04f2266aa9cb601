"""The distributed paths over NCCL on CUDA devices: DDP + FusedAdamW, ZeRO-1 and FSDP2, one rank per GPU
(world size 1 on a one-GPU machine still runs every collective through NCCL).

Same data and checks as the gloo suites: an inf on one rank and a loss spike on another skip the same steps
everywhere, the scale backs off alike, and every rank ends bitwise where the single-process fused step on the
same device and the concatenated batch ends; the steps after the first run with CUDA's sync debug mode set to
error (no host sync in ``scaler.step`` / ``scaler.update``). FSDP2 also round-trips a DCP checkpoint."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import ampfused
import dist_data as D
import test_dist_zero as Z
from dist_harness import load, run_ranks, save
from oracle import assert_bitwise, no_host_sync

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                                 reason="needs CUDA and NCCL")]

WORLD = max(1, min(2, torch.cuda.device_count())) if torch.cuda.is_available() else 1


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(kind, dev):
    model = D.linear_model().to(dev)
    spike = ampfused.SpikeGuard(max_norm=Z.SPIKE_NORM)
    if kind == "zero1":
        return model, model, ampfused.ShardedFusedAdamW(Z._groups(model), **Z.ADAM, spike_guard=spike)
    if kind == "fsdp2":
        fully_shard(model)
        return model, model, ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, spike_guard=spike)
    opt = ampfused.FusedAdamW(Z._groups(model), **Z.ADAM, spike_guard=spike)
    if kind == "ddp":
        return model, DistributedDataParallel(model, device_ids=[dev.index], gradient_as_bucket_view=True), opt
    return model, model, opt


def _train(model, wrapped, opt, dev, rows, world):
    x, c = Z._data(world)
    x, c = x.to(dev), c.to(dev)
    scaler = ampfused.GradScaler("cuda")
    skipped = []
    for s in range(Z.STEPS):
        xs, cs = x[s, rows], c[s, rows]
        scaler.scale((wrapped(xs) * cs).sum() / xs.shape[0]).backward()
        with no_host_sync(enabled=s > 0):
            scaler.step(opt)
            scaler.update()
        skipped.append(opt.last_step_skipped.clone())
        opt.zero_grad()
    return [bool(t) for t in skipped], scaler.get_scale()


def _worker(rank, world, out, kind):
    dev = torch.device("cuda", rank)
    model, wrapped, opt = _build(kind, dev)
    skipped, scale = _train(model, wrapped, opt, dev, slice(rank * Z.ROWS, (rank + 1) * Z.ROWS), world)
    params = list(model.parameters())
    result = {"skipped": skipped, "scale": scale, "params": [_full(p.detach()).cpu() for p in params]}
    if kind == "zero1":
        result["state"] = opt.state_dict()["state"]
    else:
        result["state"] = {i: {k: _full(v).cpu() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    if kind == "fsdp2":
        path = out + "/ckpt"
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        model2, _, opt2 = _build(kind, dev)
        state = {"optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model2, opt2, state["optim"])
        result["reloaded"] = {i: {k: _full(v).cpu() for k, v in opt2.state[p].items()}
                              for i, p in enumerate(model2.parameters())}
    save(out, rank, result)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "fsdp2"])
def test_nccl_step_is_the_single_process_step(tmp_path, kind):
    run_ranks(_worker, WORLD, str(tmp_path), kind, backend="nccl")
    dev = torch.device("cuda", 0)
    model, wrapped, opt = _build("single", dev)
    skipped, scale = _train(model, wrapped, opt, dev, slice(None), WORLD)
    assert skipped == [s in (Z.INF_STEP, Z.SPIKE_STEP) for s in range(Z.STEPS)]
    want = {i: {k: v.cpu() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
    for r, got in enumerate(load(tmp_path, WORLD)):
        assert got["skipped"] == skipped and got["scale"] == scale, f"{kind} rank {r}"
        for i, p in enumerate(model.parameters()):
            assert_bitwise(f"{kind} rank {r} param[{i}]", got["params"][i], p.detach().cpu())
            for key in ("master_param", "exp_avg", "exp_avg_sq"):
                assert_bitwise(f"{kind} rank {r} {key}[{i}]", got["state"][i][key].cpu(), want[i][key])
                if kind == "fsdp2":
                    assert_bitwise(f"reloaded {key}[{i}]", got["reloaded"][i][key], want[i][key])
