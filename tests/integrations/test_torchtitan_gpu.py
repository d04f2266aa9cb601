"""ampfused in torchtitan's Trainer on a GPU: bf16 mixed precision (FSDP2's default policy), torchtitan's compile
of the model and the loss and its CUDA graphs of the forward/backward, against torchtitan's own AdamW on the same
run; a NaN in the gradients at step 3 skipped by the fused step (and not taken by the torch run)."""
import math
import os
import sys

import pytest
import torch

pytest.importorskip("torchtitan")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distributed"))

import torchtitan_harness as H  # noqa: E402
from dist_harness import load, run_ranks, save  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from ampfused.integrations.torchtitan import FusedOptimizersContainer, FusedTrainer  # noqa: E402

STEPS, NAN_STEP = 6, 3
# the forward and backward run in bf16: the optimizers' rounding differences (~1e-7 relative in the fp32
# weights) reach the loss through bf16 casts of the weights, one bf16 unit (2^-8) at most per weight
LOSS_RTOL, PARAM_ATOL = 1e-2, 1e-3


def _runs(rank, world, out):
    def config(fused, name):
        opt_cls = FusedOptimizersContainer if fused else OptimizersContainer
        return H.trainer_config(FusedTrainer if fused else Trainer,
                                opt_cls.Config(param_groups=H.adamw_groups(2e-3)),
                                out=os.path.join(out, name), steps=STEPS, max_norm=0.5, grad_accum=2, world=world,
                                compile="inductor", cuda_graphs=True)

    results = {"torch": H.run_trainer(config(False, "torch"), nan_steps=(NAN_STEP,), on_nan="skip", device="cuda"),
               "fused": H.run_trainer(config(True, "fused"), nan_steps=(NAN_STEP,), device="cuda")}
    save(out, rank, {k: {"logged": v["logged"], "params": {n: p.cpu() for n, p in v["params"].items()}}
                     for k, v in results.items()})


@pytest.mark.gpu
def test_bf16_compiled_cuda_graph_run_matches_torchtitans_adamw(tmp_path):
    run_ranks(_runs, 1, str(tmp_path), backend="nccl")
    r = load(str(tmp_path), 1)[0]
    loss_t = [m["loss_metrics/global_avg_loss"] for m in r["torch"]["logged"]]
    loss_f = [m["loss_metrics/global_avg_loss"] for m in r["fused"]["logged"]]
    assert len(loss_f) == STEPS
    for a, b in zip(loss_t, loss_f):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), (loss_t, loss_f)
    norms = [m["grad_norm"] for m in r["fused"]["logged"]]
    assert not math.isfinite(norms[NAN_STEP - 1]) and all(math.isfinite(n) for i, n in enumerate(norms)
                                                           if i != NAN_STEP - 1)
    assert [m["optimizer/skipped_steps"] for m in r["fused"]["logged"]] == [float(s >= NAN_STEP)
                                                                         for s in range(1, STEPS + 1)]
    for name, p in r["fused"]["params"].items():
        torch.testing.assert_close(p, r["torch"]["params"][name], rtol=0, atol=PARAM_ATOL, msg=name)
