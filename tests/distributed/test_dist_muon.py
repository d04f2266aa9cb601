"""FusedMuon with FSDP2's DTensor parameters on gloo processes: refused, with what to do, before anything is made
(its Newton-Schulz iteration needs whole matrices, which it does not gather over ranks yet); a Muon of the
replicated matrices beside an FSDP2 model is what works meanwhile."""
import pytest
import torch
from torch.distributed.tensor import Shard

import ampfused
from dist_harness import run_ranks


def _refused(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    w = torch.nn.Parameter(torch.distributed.tensor.distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    with pytest.raises(NotImplementedError, match="needs whole matrices"):
        ampfused.FusedMuon([w])
    opt = ampfused.FusedMuon([dict(params=[torch.nn.Parameter(torch.randn(4, 6))]),
                              dict(params=[torch.nn.Parameter(torch.randn(6))], use_muon=False)])
    assert len(opt.param_groups) == 2


def test_sharded_parameters_are_refused(tmp_path):
    run_ranks(_refused, 2)
