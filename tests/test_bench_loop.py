"""``python -m bench.step.loop``: the step inside a training loop (fresh gradient tensors, variable sequence
lengths) for torch's recipe and ampfused's, checked against each other before anything is timed."""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.step import loop  # noqa: E402


def test_recipes_agree_then_are_timed():
    rows = loop.run("gpt-tiny", torch.device("cpu"), steps=3, warmup=1, log=lambda s: None)
    assert [r["recipe"] for r in rows] == ["torch", "ampfused", "ampfused+inplace"]
    for r in rows:
        assert r["step_ms"] > 0 and r["host_ms"] > 0 and r["iter_ms"] >= r["step_ms"]
        assert abs(r["final_loss"] - rows[0]["final_loss"]) <= loop.LOSS_RTOL * rows[0]["final_loss"]
    assert rows[0]["params"] == sum(p.numel() for p in loop._model(loop.CONFIGS["gpt-tiny"], "cpu").parameters())
    text = loop.table(rows, torch.device("cpu"), "gpt-tiny")
    assert "| ampfused | " in text and "default zero_grad" in text


def test_a_recipe_that_trains_differently_is_not_timed(monkeypatch):
    def wrong_step(self):
        self.opt.param_groups[0]["lr"] = 1.0
        self.opt.step()

    monkeypatch.setattr(loop.Ampfused, "step", wrong_step)
    with pytest.raises(AssertionError, match="not timed"):
        loop.check_losses(loop.CONFIGS["gpt-tiny"], torch.device("cpu"), ["torch", "ampfused"])


def test_fresh_gradient_tensors_reach_the_step():
    """The loop hands the step new gradient tensors (zero_grad to None): the case the in-place refill of
    python -m bench does not exercise."""
    cfg = loop.CONFIGS["gpt-tiny"]
    r = loop.Ampfused(cfg, torch.device("cpu"), 1e-3)
    seen = []
    for b in loop._batches(cfg, 3, torch.device("cpu")):
        loop._loss(r.model, b).backward()
        seen.append(r.model.wte.weight.grad)
        r.step()
        r.zero()
        assert r.model.wte.weight.grad is None
    assert len({id(g) for g in seen}) == 3
