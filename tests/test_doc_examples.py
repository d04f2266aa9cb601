"""The examples of README.md and docs/ run as written (on the CPU: ``"cuda"`` read as ``"cpu"``, float16 autocast
as bfloat16) and do what their text says; every ``python -m`` command the docs give names a module that exists.

Each document's Python examples are listed here by what they begin with, in order: an example that disappears,
moves or is added without a test fails ``test_every_example_is_tested``. The framework examples run in
``tests/integrations/test_readme_examples.py``, the distributed ones (and the DCP example of checkpoints.md) in
``tests/distributed/test_dist_readme.py``."""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampfused
from ampfused import ops, policies

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # bench/ is a directory of the repository, not part of the installed package
    sys.path.insert(0, REPO)
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))

# every Python example of each document, by its first line, and where it is tested
EXAMPLES = {
    "README.md": [("scaler = ampfused.GradScaler(", "here"), ("opt = ampfused.FusedAdamW(", "here"),
                  ("from ampfused import ops", "here"), ("# my_recipes.py", "here")],
    "docs/api.md": [("FusedAdamW(params, lr=1e-3,", "tests/test_readme.py (the signatures)"),
                    ("FusedLion(params, lr=1e-4,", "tests/test_readme.py (the signatures)"),
                    ("FusedAdafactor(params, lr=1e-2,", "tests/test_readme.py (the signatures)"),
                    ("FusedMuon(params, lr=1e-3,", "tests/test_readme.py (the signatures)"),
                    ("from ampfused.policies import HysteresisPolicy", "here"),
                    ('@ampfused.register_scale_policy("overflow_rate")', "here"),
                    ("guard = ampfused.SpikeGuard(", "here"), ("tokens = torch.zeros(", "here"),
                    ("if step % 100 == 0:", "here"),
                    ("opt = ampfused.FusedAdamW(model.parameters(), lr=1e-3, b", "here")],
    "docs/checkpoints.md": [("import torch", "here"),
                            ("import torch.distributed.checkpoint as dcp", "tests/distributed/test_dist_readme.py")],
    "docs/cuda-graphs.md": [("opt = ampfused.FusedAdamW(", "here, on a GPU")],
    "docs/distributed.md": [("model = DistributedDataParallel(", "tests/distributed/test_dist_readme.py"),
                            ("model.register_comm_hook(", "tests/distributed/test_dist_readme.py"),
                            ("opt = ampfused.ShardedFusedAdamW(", "tests/distributed/test_dist_readme.py"),
                            ("from torch.distributed.fsdp import fully_shard", "tests/distributed/test_dist_readme.py")],
    "docs/frameworks.md": [("import torch", "tests/integrations/test_readme_examples.py")] * 4,
    "docs/adafactor.md": [("opt = ampfused.FusedAdafactor(", "here")],
    "docs/muon.md": [("matrices = [p for p in model.parameters()", "here")],
}


def blocks(doc: str, lang: str = "python") -> list:
    text = open(os.path.join(REPO, doc), encoding="utf-8").read()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def example(doc: str, first_line: str, cpu: bool = True) -> str:
    found = [b for b in blocks(doc) if b.startswith(first_line)]
    assert len(found) == 1, f"{doc}: expected one example beginning {first_line!r}, found {len(found)}"
    code = found[0]
    return code.replace('"cuda"', '"cpu"').replace("torch.float16", "torch.bfloat16") if cpu else code


# the documents whose examples are listed above (the others carry tests of their own)
LISTED = ["README.md"] + [f"docs/{n}.md" for n in ("api", "frameworks", "distributed", "checkpoints", "cuda-graphs",
                                                    "benchmark", "alignment", "building", "gpu-validation",
                                                    "architecture", "adafactor", "muon")]


def test_every_example_is_tested():
    for doc in LISTED:
        firsts = [b.split("\n", 1)[0] for b in blocks(doc)]
        listed = EXAMPLES.get(doc, [])
        assert len(firsts) == len(listed) and all(f.startswith(s) or s.startswith(f) for f, (s, _) in
                                                  zip(firsts, listed)), (doc, firsts)


def test_every_command_names_a_module_that_exists():
    """``python -m bench.X`` / ``ampfused.X`` anywhere in the docs (code blocks and prose), and ``bash F.sh``."""
    named = set()
    for doc in DOCS:
        text = open(os.path.join(REPO, doc), encoding="utf-8").read()
        named |= {m for m in re.findall(r"python3? -m ((?:bench|ampfused)[\w.]*)", text)}
        for script in re.findall(r"bash ([\w/.-]+\.sh)", text):
            assert os.path.isfile(os.path.join(REPO, script)), f"{doc}: {script} does not exist"
    assert {"bench", "bench.gpu", "bench.align", "bench.distributed", "ampfused.info"} <= named
    for module in sorted(named):
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"python -m {module}: no such module"
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            assert importlib.util.find_spec(module + ".__main__") is not None, f"python -m {module}: no __main__"


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype)


def _batches(n=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g).to(dtype), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _changed(before, model):
    return all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _loss_fn(out, y):
    return F.cross_entropy(out.float(), y)


def _trained_by_example(doc: str, first_line: str):
    """The optimizer a document's example makes (``opt``) for a bf16 model, after a few steps that change every
    parameter: ``(model, opt)``."""
    model = _model(torch.bfloat16)
    before = _params(model)
    ns = dict(torch=torch, ampfused=ampfused, model=model)
    exec(example(doc, first_line), ns)
    opt = ns["opt"]
    for x, y in _batches(dtype=torch.bfloat16):
        _loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert _changed(before, model)
    return model, opt


def test_adafactor_example_trains_a_bf16_model_with_remainders():
    model, opt = _trained_by_example("docs/adafactor.md", "opt = ampfused.FusedAdafactor(")
    assert all("master_remainder" in opt.state[p] for p in model.parameters())


def test_muon_example_trains_with_adamw_for_the_vectors():
    model, opt = _trained_by_example("docs/muon.md", "matrices = [p for p in model.parameters()")
    assert [g.get("use_muon", True) for g in opt.param_groups] == [True, False]
    assert all(("momentum_buffer" in opt.state[p]) == (p.dim() == 2) for p in model.parameters())


def test_readme_drop_in_scaler():
    model = _model()
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-2)
    before = _params(model)
    ns = dict(torch=torch, ampfused=ampfused, model=model, opt=opt, loader=_batches(), loss_fn=_loss_fn)
    exec(example("README.md", "scaler = ampfused.GradScaler("), ns)
    assert _changed(before, model)
    assert ns["scaler"].get_scale() == 2.0 ** 16 and int(opt.stats()["steps"]) == 4


def test_readme_fused_optimizer(capsys):
    model = _model(torch.bfloat16)
    x, _ = _batches(1, torch.bfloat16)[0]
    loss = model(x).float().pow(2).mean()
    before = _params(model)
    exec(example("README.md", "opt = ampfused.FusedAdamW("), dict(ampfused=ampfused, model=model, loss=loss))
    assert _changed(before, model)
    assert all(p.grad is None for p in model.parameters())
    assert "False" in capsys.readouterr().out  # last_step_skipped


def test_readme_ops():
    torch.manual_seed(0)
    params = [torch.randn(n).to(torch.bfloat16) for n in (5, 300)]
    grads = [torch.randn(p.numel()).to(torch.bfloat16) for p in params]
    offsets, total = ops.state_layout([p.numel() for p in params])
    master = torch.zeros(total)
    for o, p in zip(offsets, params):
        master[o:o + p.numel()] = p.float()
    ns = dict(ops=ops, params=params, grads=grads, master=master, exp_avg=torch.zeros(total),
              exp_avg_sq=torch.zeros(total), steps=torch.zeros(len(params)), inv_scale=torch.ones(()),
              lr=torch.tensor(1e-3), stats=torch.zeros(2))
    start = master.clone()
    exec(example("README.md", "from ampfused import ops"), ns)
    assert ns["offsets"] == offsets and ns["total"] == total
    norm = torch.cat([g.float() for g in grads]).norm()
    torch.testing.assert_close(ns["stats"][0], norm, rtol=1e-5, atol=0)
    assert ns["stats"][1].item() == 0 and ns["steps"].tolist() == [1.0, 1.0]
    assert not torch.equal(start, master)
    for o, p in zip(offsets, params):  # the model's copy is the new master, rounded
        assert torch.equal(p, master[o:o + p.numel()].to(torch.bfloat16))


def test_readme_torchtitan_recipe():
    """The README's torchtitan recipe builds torchtitan's config of the same model with the fused optimizers owning
    the clip (its trainer runs in tests/integrations/test_torchtitan.py)."""
    pytest.importorskip("torchtitan")
    from ampfused.integrations.torchtitan import FusedOptimizersContainer, FusedTrainer
    ns = {}
    exec(example("README.md", "# my_recipes.py"), ns)
    cfg = ns["llama3_8b_fused"]()
    assert isinstance(cfg, FusedTrainer.Config) and isinstance(cfg.optimizer, FusedOptimizersContainer.Config)
    assert cfg.optimizer.max_grad_norm == cfg.training.max_norm


def test_api_policy_by_name_and_instance():
    ns = dict(ampfused=ampfused)
    exec(example("docs/api.md", "from ampfused.policies import HysteresisPolicy"), ns)
    scaler = ns["scaler"]
    assert isinstance(scaler.policy, policies.HysteresisPolicy) and scaler.policy.min_scale == 1.0
    assert scaler.state_dict()["scale"] == 2.0 ** 16


def test_api_own_policy(monkeypatch):
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))  # the example's name stays in this test
    ns = dict(ampfused=ampfused, torch=torch)
    exec(example("docs/api.md", '@ampfused.register_scale_policy("overflow_rate")'), ns)
    scaler = ns["scaler"]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k, (x, y) in enumerate(_batches(3)):
        loss = _loss_fn(model(x), y) * (float("inf") if k == 1 else 1.0)  # one overflow
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    sd = scaler.state_dict()
    assert sd["scale"] == 2.0 ** 15  # backed off once
    assert abs(sd["policy.overflow_rate.rate"] - 0.1 * 0.9) < 1e-6  # the moving average saw it, one step ago


def test_api_health():
    model = _model(torch.bfloat16)
    x, y = _batches(1, torch.bfloat16)[0]
    ns = dict(ampfused=ampfused, model=model, x=x, loss_fn=lambda out: _loss_fn(out, y))
    exec(example("docs/api.md", "opt = ampfused.FusedAdamW(model.parameters(), lr=1e-3, b"), ns)
    h = ns["h"]
    assert set(h) == {"grad_norm", "update_norm", "weight_norm", "stagnant", "nonfinite"}
    assert 0 < float(ns["ratio"]) < 1e-2 and float(h["grad_norm"]) > 0


def test_api_spike_guard():
    model = _model(torch.bfloat16)
    x, y = _batches(1, torch.bfloat16)[0]
    loss = _loss_fn(model(x), y)
    loss.backward()
    before = _params(model)
    ns = dict(ampfused=ampfused, model=model, loss=loss)
    exec(example("docs/api.md", "guard = ampfused.SpikeGuard("), ns)
    assert _changed(before, model)  # the first step is no spike (warm-up)
    assert int(ns["opt"].stats()["spikes"]) == 0


def test_api_grad_divisor():
    model = _model()
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-2)
    scaler = ampfused.GradScaler("cpu")
    micro = _batches(2)
    micro[1][1][:5] = -100  # padding the loss ignores
    before = _params(model)
    ns = dict(torch=torch, F=F, model=model, opt=opt, scaler=scaler, micro_batches=micro)
    exec(example("docs/api.md", "tokens = torch.zeros("), ns)
    assert int(ns["tokens"]) == 27 and _changed(before, model)


def test_api_stats():
    model = _model()
    opt = ampfused.FusedAdamW(model.parameters())
    scaler = ampfused.GradScaler("cpu")
    x, y = _batches(1)[0]
    scaler.scale(_loss_fn(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    logged = []
    exec(example("docs/api.md", "if step % 100 == 0:"), dict(step=0, log=logged.append, scaler=scaler, opt=opt))
    assert logged and logged[0]["steps"] == 1 and logged[0]["scale"] == 2.0 ** 16
    assert {"skipped_overflow", "last_grad_norm", "growth_tracker"} <= set(logged[0])


def test_checkpoints_resume_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__main__"}
    exec(example("docs/checkpoints.md", "import torch\nfrom torch import nn"), ns)  # asserts the resumed run matches, bit for bit
    assert os.path.isfile(tmp_path / "ckpt.pt")
    assert "master_param" in next(iter(ns["torch_opt"].state.values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_example():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)).cuda().to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    loader = [(torch.randn(32, 64, device="cuda", generator=g).to(torch.bfloat16),
               torch.randint(0, 4, (32,), device="cuda", generator=g)) for _ in range(4)]
    before = _params(model)
    ns = dict(torch=torch, ampfused=ampfused, model=model, loader=loader, loss_fn=_loss_fn)
    exec(example("docs/cuda-graphs.md", "opt = ampfused.FusedAdamW(", cpu=False), ns)
    torch.cuda.synchronize()
    assert _changed(before, model)
    assert int(ns["opt"].stats()["steps"]) == 2 + len(loader)  # the warm-up steps and one replay per batch


class _EagerCuda:
    """The CUDA-graph calls of docs/cuda-graphs.md run eagerly, so the example's Python runs on the CPU: the capture
    block runs its body once, and each replay runs ``replay``."""

    def __init__(self, replay):
        self._replay = replay

    def Stream(self):
        return types.SimpleNamespace(wait_stream=lambda other: None)

    current_stream = Stream

    def stream(self, s):
        return contextlib.nullcontext()

    def CUDAGraph(self):
        return types.SimpleNamespace(replay=self._replay)

    def graph(self, g):
        return contextlib.nullcontext()


class _TorchWith:
    def __init__(self, cuda):
        self.cuda = cuda

    def __getattr__(self, name):
        return getattr(torch, name)


def test_cuda_graph_example_runs_eagerly_on_the_cpu():
    """The example's warm-up, capture and loop in order, with the graph calls eager: on a machine without a GPU
    this still runs every line of the example but the graph's own (a step before the scaler's first scale
    raises, as torch's does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 16, generator=g).to(torch.bfloat16), torch.randint(0, 4, (8,), generator=g))
              for _ in range(3)]
    before = _params(model)
    ns = dict(ampfused=ampfused, model=model, loader=loader, loss_fn=_loss_fn)
    ns["torch"] = _TorchWith(_EagerCuda(lambda: (ns["scaler"].step(ns["opt"]), ns["scaler"].update())))
    exec(example("docs/cuda-graphs.md", "opt = ampfused.FusedAdamW("), ns)
    assert _changed(before, model)
    assert int(ns["opt"].stats()["steps"]) == 2 + 1 + len(loader)  # warm-up, the eager "capture", the replays
