"""``python -m bench.step.loop``: the optimizer step inside the loop users run.

The step benchmark (``python -m bench``) refills the same gradient tensors before every timed step. A training
loop does not: ``zero_grad()`` sets the gradients to None, and backward hands the step new tensors, at new
addresses whenever the allocator's free lists moved (here: a sequence length drawn per batch, as with packed or
bucketed text). This runs a small GPT (token and position embeddings, pre-norm transformer blocks, a head tied to
the token embedding) for the same batches under each recipe, bf16 weights throughout:

* ``torch``: bf16 model, fp32 master copies of its parameters, the gradients copied into the masters' ``.grad``,
  ``clip_grad_norm_``, ``AdamW(fused=True)`` on the masters, the masters copied back (the recipe of
  ``python -m bench``'s ``torch-fused`` row);
* ``ampfused``: ``FusedAdamW(max_grad_norm=1.0)`` on the bf16 model (fp32 masters inside), ``zero_grad()`` to None;
* ``ampfused+inplace``: the same with ``zero_grad(set_to_none=False)`` (gradients written in place).

Per recipe: the step's device time (CUDA events around ``step``; elsewhere wall time with a synchronize on both
sides), its host time (until the call returned; on CUDA without a synchronize: a host time close to the device
time means the host waited), the whole iteration, and the loss after the last batch. Before anything is timed
the recipes' losses are compared over the first steps (same data, same initial weights): the bf16 weights are
the rounded fp32 masters in both, so they must agree to bf16 precision.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..common.env import describe
from ..common.measure import synchronize

LOSS_RTOL = 2e-2  # bf16 activations: the recipes' losses agree to a few bf16 ulps over the checked steps


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        block = dict(d_model=d, nhead=heads, dim_feedforward=4 * d, dropout=0.0, activation="gelu",
                     batch_first=True, norm_first=True)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(**block) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=x.dtype)
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.head(self.ln_f(x))


CONFIGS = {  # name: (vocab, d_model, layers, heads, ctx, batch, sequence lengths)
    "gpt-31M": (8192, 512, 8, 8, 512, 8, (256, 384, 512, 320)),
    "gpt-tiny": (256, 64, 2, 4, 64, 4, (16, 24, 32, 20)),
}


def _batches(cfg, steps: int, device: torch.device, seed: int = 0) -> List[torch.Tensor]:
    vocab, _, _, _, _, batch, lengths = cfg
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        t = lengths[int(torch.randint(len(lengths), (1,), generator=g))]
        out.append(torch.randint(vocab, (batch, t + 1), generator=g).to(device))
    return out


def _model(cfg, device: torch.device) -> TinyGPT:
    vocab, d, layers, heads, ctx, _, _ = cfg
    torch.manual_seed(0)
    return TinyGPT(vocab, d, layers, heads, ctx).to(device=device, dtype=torch.bfloat16)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


class Recipe:
    """One recipe's model and its step (``step()`` after backward, ``zero()`` after the step)."""
    name = ""

    def __init__(self, cfg, device: torch.device, lr: float):
        self.model = _model(cfg, device)

    def step(self) -> None:
        raise NotImplementedError

    def zero(self) -> None:
        raise NotImplementedError


class TorchMasters(Recipe):
    name = "torch"

    def __init__(self, cfg, device, lr):
        super().__init__(cfg, device, lr)
        self.params = [p for p in self.model.parameters()]
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        fused = device.type in ("cuda", "cpu")
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)

    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)

    def zero(self) -> None:
        self.model.zero_grad()
        self.opt.zero_grad()


class Ampfused(Recipe):
    name = "ampfused"
    set_to_none = True

    def __init__(self, cfg, device, lr):
        super().__init__(cfg, device, lr)
        import ampfused
        self.opt = ampfused.FusedAdamW(self.model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95),
                                       max_grad_norm=1.0)

    def step(self) -> None:
        self.opt.step()

    def zero(self) -> None:
        self.opt.zero_grad(set_to_none=self.set_to_none)


class AmpfusedInPlace(Ampfused):
    name = "ampfused+inplace"
    set_to_none = False


RECIPES = {r.name: r for r in (TorchMasters, Ampfused, AmpfusedInPlace)}


def check_losses(cfg, device: torch.device, names: List[str], steps: int = 4, lr: float = 1e-3) -> Dict[str, list]:
    """The recipes' losses over the first ``steps`` batches; raises if any departs from the first recipe's."""
    batches = _batches(cfg, steps, device, seed=1)
    curves = {}
    for name in names:
        r = RECIPES[name](cfg, device, lr)
        curve = []
        for b in batches:
            loss = _loss(r.model, b)
            loss.backward()
            r.step()
            r.zero()
            curve.append(float(loss))
        curves[name] = curve
    base = curves[names[0]]
    for name, curve in curves.items():
        for k, (a, b) in enumerate(zip(base, curve)):
            if not math.isfinite(b) or abs(a - b) > LOSS_RTOL * abs(a):
                raise AssertionError(f"{name}'s loss at step {k} is {b:.6f}, {names[0]}'s {a:.6f}: beyond "
                                     f"{LOSS_RTOL:.0%}; not timed")
    return curves


def time_recipe(r: Recipe, batches: List[torch.Tensor], warmup: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    step_ms, host_ms, iter_ms = [], [], []
    loss = None
    for k, b in enumerate(batches):
        synchronize(device)
        t_iter = time.perf_counter()
        loss = _loss(r.model, b)
        loss.backward()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            synchronize(device)
        t0 = time.perf_counter()
        r.step()
        t1 = time.perf_counter()
        if cuda:
            end.record()
        r.zero()
        synchronize(device)
        t2 = time.perf_counter()
        if k < warmup:
            continue
        host_ms.append((t1 - t0) * 1e3)
        step_ms.append(start.elapsed_time(end) if cuda else (t1 - t0) * 1e3)
        iter_ms.append((t2 - t_iter) * 1e3)
    return dict(recipe=r.name, step_ms=statistics.median(step_ms), host_ms=statistics.median(host_ms),
                iter_ms=statistics.median(iter_ms), final_loss=float(loss))


def run(config: str, device: torch.device, steps: int, warmup: int, names: Optional[List[str]] = None,
        lr: float = 1e-3, log: Callable[[str], None] = print) -> List[dict]:
    cfg = CONFIGS[config]
    names = names or list(RECIPES)
    check_losses(cfg, device, names, lr=lr)
    batches = _batches(cfg, steps + warmup, device)
    rows = []
    for name in names:
        r = RECIPES[name](cfg, device, lr)
        row = time_recipe(r, batches, warmup, device)
        row["params"] = sum(p.numel() for p in r.model.parameters())  # the tied head counted once
        rows.append(row)
        log(f"{name}: step {row['step_ms']:.3f} ms, host {row['host_ms']:.3f} ms")
        del r
    for row in rows:
        row["speedup"] = rows[0]["step_ms"] / row["step_ms"]
    return rows


def table(rows: List[dict], device: torch.device, config: str) -> str:
    env = describe(device)
    head = (f"{config} ({rows[0]['params'] / 1e6:.1f}M parameters), bf16 weights, variable sequence lengths, "
            f"default zero_grad; {env.get('device', device)}, torch {env.get('torch')}, commit {env.get('git_sha')}")
    lines = [head, "", "| recipe | step (device) | step (host) | iteration | speedup (step) | loss after the run |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['step_ms']:.3f} ms | {r['host_ms']:.3f} ms | {r['iter_ms']:.2f} ms | "
                     f"{r['speedup']:.2f}x | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step.loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default=None,
                   help="model size (default: gpt-31M on CUDA, gpt-tiny elsewhere)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=30, help="timed iterations per recipe (default 30)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--recipes", default=None, help=f"comma list of {', '.join(RECIPES)} (default: all)")
    p.add_argument("--out", default=None, help="write the table to this file too")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    config = args.config or ("gpt-31M" if device.type == "cuda" else "gpt-tiny")
    names = args.recipes.split(",") if args.recipes else None
    rows = run(config, device, args.steps, args.warmup, names)
    text = table(rows, device, config)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
