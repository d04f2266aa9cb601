"""The README's Distributed examples run as written (on the CPU: "cuda" read as "cpu", float16 autocast as
bfloat16) on 2 gloo processes, with a small bf16 model, a loss and batches of this rank."""
import contextlib
import os
import re

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ampfused
from dist_harness import load, run_ranks, save

README = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()


def _examples():
    section = README[README.index("## Distributed"):README.index("## Benchmark")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3, "the Distributed section's examples: DDP, DDP with a token count, ZeRO-1"
    return [b.replace('"cuda"', '"cpu"').replace("torch.float16", "torch.bfloat16") for b in blocks]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 5)).to(torch.bfloat16)


def _worker(rank, world, out):
    ddp, tokens, zero = _examples()
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 8, generator=g).to(torch.bfloat16), torch.randint(0, 5, (4,), generator=g))
               for _ in range(2)]
    base = dict(torch=torch, F=F, ampfused=ampfused, contextlib=contextlib,
                DistributedDataParallel=DistributedDataParallel,
                loss_fn=lambda out, y: F.cross_entropy(out.float(), y))
    results = {}
    for name, code, data in (("ddp", ddp, batches), ("zero", zero, batches)):
        ns = dict(base, model=_model(), batches=data)
        exec(code, ns)
        results[name] = [p.detach().clone() for p in ns["model"].parameters()]
    ns = dict(base, model=_model(), batches=[batches])  # one global batch of two micro-batches
    exec(ddp.split("\nfor ")[0] + "\n" + tokens, ns)
    results["tokens"] = [p.detach().clone() for p in ns["model"].parameters()]
    save(out, rank, results)


def test_readme_distributed_examples_run(tmp_path):
    run_ranks(_worker, 2, str(tmp_path))
    ranks = load(tmp_path, 2)
    start = list(_model().parameters())
    for name in ("ddp", "zero", "tokens"):
        for a, b, p0 in zip(ranks[0][name], ranks[1][name], start):
            assert torch.equal(a, b), f"{name}: ranks differ"
            assert not torch.equal(a, p0.detach()), f"{name}: the example did not train"
