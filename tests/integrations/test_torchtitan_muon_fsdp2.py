"""ampfused's FusedMuon in torchtitan's own Trainer under FSDP2 (pinned torchtitan 0.3.0): ``"Muon"`` param groups
for the transformer blocks' matrices, ``"AdamW"`` for the embeddings, norms and head, one FusedMuon per model part.

Two gloo ranks train the tiny llama3 of ``torchtitan_harness`` (FSDP2 through its ``parallelize_llama``: every
matrix a DTensor split along its rows, so each Muon step joins the pieces on their owners,
``ampfused/optim/_whole_shards.py``) for six steps of two accumulated micro-batches, with the warmup/decay LR
schedule, an active clip, a NaN in the gradients at step 3 and a DCP checkpoint at step 3. The runs:

* ``muon``: the run above; the fused step skips step 3 by itself.
* ``muon_resume``: resumed from its own step-3 checkpoint: bit for bit the same steps.
* ``muon_one_rank``: the 2-rank step-3 checkpoint resumed on one rank (DCP reshards the Muon state; the global batch
  kept by accumulating four micro-batches): the same losses and weights within float rounding.
"""
import math
import os
import sys

import pytest
import torch

pytest.importorskip("torchtitan")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distributed"))

import torchtitan_harness as H  # noqa: E402
from dist_harness import load, run_ranks, save  # noqa: E402
from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

from ampfused import FusedMuon  # noqa: E402
from ampfused.integrations.torchtitan import FusedOptimizersContainer, FusedTrainer  # noqa: E402

STEPS, NAN_STEP, CKPT = 6, 3, 3
MAX_NORM = 0.5
VECTORS = r"(tok_embeddings|lm_head|norm)"  # (the docs' grouping, docs/torchtitan.md: the rest are matrices)
# One rank against two: the same math, the gradients summed in another order (FSDP's reduce-scatter against one
# process's accumulation), so weights differ by rounding; Muon's iteration in bf16 can turn a last-bit difference
# of its input into a bf16 step of its output (2^-8 of one element of the update, lr * ratio <= 2e-2 * 0.2 *
# sqrt(96) here): 1e-4 covers a few such steps, and a wrong reshard (a weight's or a momentum's pieces swapped)
# is off by the update itself, far above it. (Measured on the 2-core CPU: the same bits.)
LOSS_RTOL, PARAM_ATOL = 1e-4, 1e-4


def _groups():
    return [ParamGroupConfig(pattern=VECTORS, optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}),
            ParamGroupConfig(pattern=r".*", optimizer_name="Muon",
                             optimizer_kwargs={"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.95,
                                               "adjust_lr_fn": "match_rms_adamw"})]


def _config(name, out, world, resume_from="", grad_accum=2):
    return H.trainer_config(FusedTrainer, FusedOptimizersContainer.Config(param_groups=_groups()),
                            out=os.path.join(out, name), steps=STEPS, max_norm=MAX_NORM, grad_accum=grad_accum,
                            checkpoint_interval=0 if resume_from else CKPT, resume_from=resume_from, world=world)


def _ckpt(out):
    return os.path.join(out, "muon", "checkpoint", f"step-{CKPT}")


def _runs(rank, world, out):
    results = {"muon": H.run_trainer(_config("muon", out, world), nan_steps=(NAN_STEP,))}
    results["muon_resume"] = H.run_trainer(_config("muon_resume", out, world, _ckpt(out)))
    if rank == 0:
        save(out, rank, results)


def _one_rank(rank, world, out):
    result = H.run_trainer(_config("one_rank", out, 1, _ckpt(out), grad_accum=4))
    os.makedirs(os.path.join(out, "one_rank"), exist_ok=True)
    save(os.path.join(out, "one_rank"), rank, {"muon_one_rank": result})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("torchtitan_muon"))
    run_ranks(_runs, 2, out)
    return out, load(out, 1)[0]


def test_muon_groups_train_under_fsdp2_with_the_skip_and_the_clip(runs):
    _, r = runs
    run = r["muon"]
    assert H.series(run, "step") == list(range(1, STEPS + 1))
    losses = H.series(run, "loss_metrics/global_avg_loss")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    norms = H.series(run, "grad_norm")
    assert not math.isfinite(norms[NAN_STEP - 1])
    assert max(n for s, n in enumerate(norms, 1) if s != NAN_STEP) > MAX_NORM  # the clip was active
    assert H.series(run, "optimizer/last_step_skipped") == [float(s == NAN_STEP) for s in range(1, STEPS + 1)]
    for name, p in run["params"].items():
        assert torch.isfinite(p).all(), name


def test_the_groups_build_one_fused_muon_over_both_kinds_of_parameter():
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({
        "attention": torch.nn.Linear(4, 4, bias=False), "attention_norm": torch.nn.LayerNorm(4)})]),
        "lm_head": torch.nn.Linear(4, 8, bias=False)})
    (opt,) = FusedOptimizersContainer.Config(param_groups=_groups()).build(model_parts=[model]).optimizers
    assert type(opt) is FusedMuon
    muon = [g for g in opt.param_groups if g.get("use_muon", True)]
    aux = [g for g in opt.param_groups if not g.get("use_muon", True)]
    assert [tuple(p.shape) for g in muon for p in g["params"]] == [(4, 4)]
    assert sorted(tuple(p.shape) for g in aux for p in g["params"]) == [(4,), (4,), (8, 4)]


def test_resume_from_own_checkpoint_is_bitwise(runs):
    _, r = runs
    run, resumed = r["muon"], r["muon_resume"]
    assert H.series(resumed, "step") == list(range(CKPT + 1, STEPS + 1))
    assert H.series(resumed, "loss_metrics/global_avg_loss") == H.series(run, "loss_metrics/global_avg_loss")[CKPT:]
    assert H.series(resumed, "grad_norm") == H.series(run, "grad_norm")[CKPT:]
    for name, p in run["params"].items():
        assert torch.equal(p, resumed["params"][name]), name


def test_two_rank_checkpoint_resumes_on_one_rank(runs):
    out, r = runs
    run_ranks(_one_rank, 1, out)
    one = load(os.path.join(out, "one_rank"), 1)[0]["muon_one_rank"]
    assert H.series(one, "step") == list(range(CKPT + 1, STEPS + 1))
    for a, b in zip(H.series(one, "loss_metrics/global_avg_loss"),
                    H.series(r["muon"], "loss_metrics/global_avg_loss")[CKPT:]):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), (a, b)
    for name, p in r["muon"]["params"].items():
        torch.testing.assert_close(one["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")
