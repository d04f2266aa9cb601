"""FusedMuon in the framework suites: the param groups a model gives it (Muon for the hidden matrices, AdamW
through ``use_muon=False`` for embeddings, the output head, biases and norms), and a hand-built FusedMuon fed the
very gradients a framework handed its FusedMuon: what the framework did around the step (accumulation, the
unscale, the clip folded into the step, the skip of non-finite steps, the scheduler's lr) must leave the
framework's optimizer where the plain optimizer ends, bit for bit (FusedMuon against torch's recipe: tests/
test_muon.py)."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

import ampfused
from oracle import assert_bitwise

MUON = dict(lr=0.02, weight_decay=0.1)  # torch.optim.Muon's defaults otherwise (momentum 0.95, Nesterov)


def muon_groups(named_params, is_muon: Callable[[str, torch.Tensor], bool], adamw: dict) -> List[dict]:
    """FusedMuon's groups: the parameters ``is_muon(name, p)`` picks in a Muon group, the rest in a
    ``use_muon=False`` group with AdamW's ``adamw`` hyperparameters."""
    named = list(named_params)
    mats = [p for n, p in named if is_muon(n, p)]
    rest = [p for n, p in named if not is_muon(n, p)]
    assert mats and rest and all(p.dim() == 2 for p in mats)
    return [dict(params=mats, **MUON), dict(params=rest, use_muon=False, **adamw)]


class MuonShadow:
    """A FusedMuon with ``opt``'s groups over copies of its parameters (taken at construction: before the first
    step), stepped on the gradients ``capture`` took, at each group's current lr, with the clip as
    ``max_grad_norm``; ``step_and_check`` asserts the framework's FusedMuon is its bits (weights, fp32 masters,
    state, clip norm, skip)."""

    def __init__(self, opt: ampfused.FusedMuon, max_norm: Optional[float]):
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.copies = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        it = iter(self.copies)
        groups = [dict({k: v for k, v in g.items() if k not in ("params", "param_names", "max_grad_norm")},
                       params=[next(it) for _ in g["params"]]) for g in opt.param_groups]
        self.opt = ampfused.FusedMuon(groups, max_grad_norm=max_norm)
        self.grads: Optional[List[Optional[torch.Tensor]]] = None
        self.steps = self.skips = 0
        self.norms: List[float] = []  # each step's clip norm (to tell whether the clip was active)

    def capture(self, inv_scale: float = 1.0) -> None:
        """The gradients as they are now; a scaled run gives 1/scale (a power of two: the unscale is exact)."""
        self.grads = [None if p.grad is None else (p.grad.detach() * inv_scale if inv_scale != 1.0 else
                                                   p.grad.detach().clone()) for p in self.params]

    def step_and_check(self, opt: ampfused.FusedMuon, where: str = "") -> bool:
        """One step of the hand-built optimizer on the captured gradients; the framework's ``opt`` (stepped
        already) must hold its bits. Returns whether the step was skipped."""
        assert self.grads is not None, "capture() first"
        for mine, theirs in zip(self.opt.param_groups, opt.param_groups):
            mine["lr"] = theirs["lr"]
        for c, g in zip(self.copies, self.grads):
            c.grad = g
        self.opt.step()
        skipped = bool(self.opt.last_step_skipped)
        self.skips += skipped
        self.steps += not skipped
        assert bool(opt.last_step_skipped) == skipped, f"{where}: skipped {bool(opt.last_step_skipped)}"
        assert_bitwise(f"{where} clip norm", opt.last_grad_norm, self.opt.last_grad_norm)
        self.norms.append(float(self.opt.last_grad_norm))
        for i, (p, c) in enumerate(zip(self.params, self.copies)):
            assert_bitwise(f"{where} param[{i}]", p.detach(), c.detach())
            for key, v in opt.state[p].items():
                assert_bitwise(f"{where} param[{i}] {key}", v, self.opt.state[c][key])
        self.grads = None
        return skipped
