"""FusedAdafactor with FSDP2: refused by the constructor, naming why (docs/adafactor.md: a shard holds part of a
matrix's rows, and the factors need sums over whole matrices), before any state exists."""
import pytest
import torch
from torch.distributed.fsdp import fully_shard

import ampfused
from dist_harness import run_ranks


def _refused(rank, world):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model)
    with pytest.raises(NotImplementedError, match="sharded Adafactor .* is not implemented"):
        ampfused.FusedAdafactor(model.parameters())


def test_fsdp2_parameters_are_refused():
    run_ranks(_refused, 2)
