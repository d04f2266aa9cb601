"""ampfused in torchtitan's own Trainer (pinned torchtitan 0.3.0), against torchtitan's own AdamW on the same run.

Two gloo ranks train a tiny llama3 (torchtitan's model registry, FSDP2 through its ``parallelize_llama``) for six
steps of two accumulated micro-batches, with its warmup/decay LR schedule, a clip that is active, a NaN put into
the gradients at step 3 and DCP checkpoints every three steps. The runs:

* ``torch``: ``Trainer`` + ``OptimizersContainer`` (torch AdamW, torchtitan's clip); step 3 is not taken.
* ``fused``: ``FusedTrainer`` + ``FusedOptimizersContainer``; the fused step skips step 3 by itself.
* ``fused_resume``: the fused run resumed from its own step-3 checkpoint (bitwise the same as ``fused``).
* ``fused_from_torch`` / ``torch_from_fused``: each resumed from the other's step-3 checkpoint.
* ``fused_compiled``: ``fused_resume`` with torchtitan's compile of the model and the loss.
* ``fused_one_rank``: the fused run's 2-rank step-3 checkpoint resumed on one rank (DCP reshards).
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
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from ampfused.integrations.torchtitan import FusedOptimizersContainer, FusedTrainer  # noqa: E402

STEPS, NAN_STEP, CKPT = 6, 3, 3
MAX_NORM = 0.5
# fp32 end to end: the fused step and torch's AdamW + clip differ by rounding (operation order) only; over six
# steps of a 2e-3 learning rate they stay far under these bounds (measured: parameters within 1e-6)
LOSS_RTOL, PARAM_ATOL = 1e-4, 2e-5


def _runs(rank, world, out):
    def config(fused, name, resume_from="", compile=""):
        opt_cls = FusedOptimizersContainer if fused else OptimizersContainer
        return H.trainer_config(FusedTrainer if fused else Trainer,
                                opt_cls.Config(param_groups=H.adamw_groups(2e-3), implementation="foreach"),
                                out=os.path.join(out, name), steps=STEPS, max_norm=MAX_NORM, grad_accum=2,
                                checkpoint_interval=0 if resume_from else CKPT, resume_from=resume_from, world=world,
                                compile=compile)

    def ckpt(name):
        return os.path.join(out, name, "checkpoint", f"step-{CKPT}")

    results = {
        "torch": H.run_trainer(config(False, "torch"), nan_steps=(NAN_STEP,), on_nan="skip"),
        "fused": H.run_trainer(config(True, "fused"), nan_steps=(NAN_STEP,)),
    }
    results["fused_resume"] = H.run_trainer(config(True, "fused_resume", ckpt("fused")))
    results["fused_from_torch"] = H.run_trainer(config(True, "fused_from_torch", ckpt("torch")))
    results["torch_from_fused"] = H.run_trainer(config(False, "torch_from_fused", ckpt("fused")))
    # torchtitan's compile of the model and the loss (dynamo + AOT autograd; inductor's code generation is the
    # GPU test's), resumed from the fused checkpoint
    results["fused_compiled"] = H.run_trainer(config(True, "fused_compiled", ckpt("fused"), compile="aot_eager"))
    if rank == 0:
        save(out, rank, results)


def _one_rank(rank, world, out):
    cfg = H.trainer_config(FusedTrainer, FusedOptimizersContainer.Config(param_groups=H.adamw_groups(2e-3)),
                           out=os.path.join(out, "one_rank"), steps=STEPS, max_norm=MAX_NORM, grad_accum=4,
                           resume_from=os.path.join(out, "fused", "checkpoint", f"step-{CKPT}"), world=1)
    result = H.run_trainer(cfg)
    os.makedirs(os.path.join(out, "one_rank"), exist_ok=True)
    save(os.path.join(out, "one_rank"), rank, {"fused_one_rank": result})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("torchtitan"))
    run_ranks(_runs, 2, out)
    return out, load(out, 1)[0]


def _assert_params_close(a, b, atol=PARAM_ATOL):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def test_losses_norms_and_skips_match_torchtitans_adamw(runs):
    _, r = runs
    torch_run, fused = r["torch"], r["fused"]
    assert H.series(fused, "step") == list(range(1, STEPS + 1))
    assert fused["dist_utils_restored"]  # torchtitan's trainer module has its own dist_utils back after each step
    # the same losses at every step (step 3's NaN is in the gradients after the backward: its loss is finite)
    for a, b in zip(H.series(torch_run, "loss_metrics/global_avg_loss"),
                    H.series(fused, "loss_metrics/global_avg_loss")):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), (a, b)
    # the norm torchtitan logs is the fused step's (before clipping, so above MAX_NORM: the clip was active);
    # at the NaN step it is the non-finite norm of what the step saw and skipped
    norms_t, norms_f = H.series(torch_run, "grad_norm"), H.series(fused, "grad_norm")
    for step, (a, b) in enumerate(zip(norms_t, norms_f), start=1):
        if step == NAN_STEP:
            assert not math.isfinite(b)
        else:
            assert math.isclose(a, b, rel_tol=LOSS_RTOL), (step, a, b)
    assert max(n for s, n in enumerate(norms_t, 1) if s != NAN_STEP) > MAX_NORM
    # the skip, in torchtitan's metrics
    assert H.series(fused, "optimizer/last_step_skipped") == [float(s == NAN_STEP) for s in range(1, STEPS + 1)]
    assert H.series(fused, "optimizer/skipped_steps") == [float(s >= NAN_STEP) for s in range(1, STEPS + 1)]
    # the same model at the end: step 3 skipped on both sides, the LR schedule advanced on both
    _assert_params_close(fused["params"], torch_run["params"])
    assert H.series(fused, "lr/FusedAdamW") == H.series(torch_run, "lr/AdamW")


def test_resume_from_own_checkpoint_is_bitwise(runs):
    _, r = runs
    fused, resumed = r["fused"], r["fused_resume"]
    assert H.series(resumed, "step") == list(range(CKPT + 1, STEPS + 1))
    assert H.series(resumed, "loss_metrics/global_avg_loss") == H.series(fused, "loss_metrics/global_avg_loss")[CKPT:]
    assert H.series(resumed, "grad_norm") == H.series(fused, "grad_norm")[CKPT:]
    for name, p in fused["params"].items():
        assert torch.equal(p, resumed["params"][name]), name


def test_checkpoints_interchange_with_torchtitans_adamw(runs):
    _, r = runs
    # the fused optimizers continue a torch AdamW checkpoint, and torch AdamW continues a fused one
    _assert_params_close(r["fused_from_torch"]["params"], r["torch"]["params"])
    _assert_params_close(r["torch_from_fused"]["params"], r["torch"]["params"])
    for name in ("fused_from_torch", "torch_from_fused"):
        for a, b in zip(H.series(r[name], "loss_metrics/global_avg_loss"),
                        H.series(r["torch"], "loss_metrics/global_avg_loss")[CKPT:]):
            assert math.isclose(a, b, rel_tol=LOSS_RTOL), (name, a, b)


def test_compiled_model_and_loss(runs):
    _, r = runs
    compiled, eager = r["fused_compiled"], r["fused_resume"]
    assert H.series(compiled, "step") == list(range(CKPT + 1, STEPS + 1))
    for key in ("loss_metrics/global_avg_loss", "grad_norm"):
        for a, b in zip(H.series(compiled, key), H.series(eager, key)):
            assert math.isclose(a, b, rel_tol=LOSS_RTOL), (key, a, b)
    _assert_params_close(compiled["params"], eager["params"])


def test_two_rank_checkpoint_resumes_on_one_rank(runs):
    out, r = runs
    run_ranks(_one_rank, 1, out)
    one = load(os.path.join(out, "one_rank"), 1)[0]["fused_one_rank"]
    assert H.series(one, "step") == list(range(CKPT + 1, STEPS + 1))
    for a, b in zip(H.series(one, "loss_metrics/global_avg_loss"),
                    H.series(r["fused"], "loss_metrics/global_avg_loss")[CKPT:]):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), (a, b)
    _assert_params_close(one["params"], r["fused"]["params"])

