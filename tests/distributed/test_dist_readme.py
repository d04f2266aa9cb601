"""The examples of docs/distributed.md and the DCP example of docs/checkpoints.md run as written (on the CPU: "cuda" read as "cpu", float16 autocast as
bfloat16) on 2 gloo processes, with a small bf16 model, a loss and batches of this rank."""
import contextlib
import os
import re

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ampfused
from dist_harness import load, run_ranks, save

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
DISTRIBUTED = open(os.path.join(DOCS, "distributed.md"), encoding="utf-8").read()
CHECKPOINTS = open(os.path.join(DOCS, "checkpoints.md"), encoding="utf-8").read()


def _examples():
    blocks = re.findall(r"```python\n(.*?)```", DISTRIBUTED, re.S)
    assert len(blocks) == 4, "docs/distributed.md's examples: DDP, DDP with a token count, ZeRO-1, FSDP2"
    section = CHECKPOINTS[CHECKPOINTS.index("## Across world sizes"):]
    blocks += re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 5, "docs/checkpoints.md's example of torch.distributed.checkpoint across world sizes"
    return [b.replace('"cuda"', '"cpu"').replace("torch.float16", "torch.bfloat16") for b in blocks]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 5)).to(torch.bfloat16)


class _Blocks(torch.nn.Module):
    """``_model()`` as a module with ``blocks`` (what the FSDP2 example shards one by one)."""

    def __init__(self):
        super().__init__()
        seq = _model()
        self.blocks = torch.nn.ModuleList([seq[0], seq[2]])

    def forward(self, x):
        return self.blocks[1](F.gelu(self.blocks[0](x)))


def _worker(rank, world, out):
    ddp, tokens, zero, fsdp, dcp = _examples()
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
    ns = dict(base, model=_Blocks(), batches=batches, path=os.path.join(out, "ckpt"))
    exec(fsdp, ns)
    results["fsdp"] = [p.full_tensor().clone() for p in ns["model"].parameters()]
    saved, later = dcp.split("# later")
    later = later.split("\n", 1)[1]  # past the comment line
    exec(saved, ns)
    with torch.no_grad():  # the load must bring these back
        for p in ns["model"].parameters():
            p.zero_()
        for st in ns["opt"].state.values():
            st["exp_avg"].zero_()
    exec(later, ns)
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(results["fsdp"], ns["model"].parameters()))
    assert all(bool(st["exp_avg"].full_tensor().abs().sum() > 0) for st in ns["opt"].state.values())
    save(out, rank, results)


def test_readme_distributed_examples_run(tmp_path):
    run_ranks(_worker, 2, str(tmp_path))
    ranks = load(tmp_path, 2)
    start = list(_model().parameters())
    for name in ("ddp", "zero", "tokens", "fsdp"):
        for a, b, p0 in zip(ranks[0][name], ranks[1][name], start):
            assert torch.equal(a, b), f"{name}: ranks differ"
            assert not torch.equal(a, p0.detach()), f"{name}: the example did not train"
