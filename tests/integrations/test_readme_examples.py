"""The examples of docs/frameworks.md run as written (in a scratch folder) and train: each framework's one added
line is what the suites beside this file test in depth."""
from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "frameworks.md")


def _examples():
    return re.findall(r"```python\n(.*?)```", open(DOC, encoding="utf-8").read(), re.S)


EXAMPLES = _examples()
NEEDS = ["accelerate", "lightning", "transformers", None]


def test_the_section_has_an_example_per_framework():
    assert len(EXAMPLES) == len(NEEDS)
    for code, package in zip(EXAMPLES, NEEDS):
        assert (package is None and "ampfused import ops" in code) or f"ampfused.integrations.{package}" in code


@pytest.mark.parametrize("index", range(len(NEEDS)), ids=[n or "flat-buffers" for n in NEEDS])
def test_example_runs_and_trains(index, tmp_path, monkeypatch):
    package = NEEDS[index]
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[integrations]')")
    if package in ("accelerate", "transformers"):
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    ns = {"__name__": "__main__"}
    exec(compile(EXAMPLES[index], f"docs/frameworks.md example {index + 1}", "exec"), ns)
    if package == "accelerate":
        where = next(ns["model"].parameters()).device  # the accelerator's device: a GPU where there is one
        xs, ys = (torch.stack(t).to(where) for t in zip(*ns["loader"].dataset))
        with torch.no_grad():
            assert _loss(ns["model"](xs), ys) < 1.1  # about ln(4) = 1.39 untrained
        assert math.isfinite(ns["grad_norm"].item())
        assert os.path.isdir(tmp_path / "ckpt")
    elif package == "lightning":
        assert ns["trainer"].global_step == 1024 // 8 // 4
        assert os.path.isfile(tmp_path / "classifier.ckpt")
    elif package == "transformers":
        losses = [h["loss"] for h in ns["trainer"].state.log_history if "loss" in h]
        assert losses[-1] < 0.8 * losses[0]
        assert os.path.isdir(tmp_path / "gpt2-tiny" / "final")
    else:
        with torch.no_grad():
            assert _loss(ns["model"](ns["x"].to(torch.bfloat16)), ns["y"]) < 1.1
        assert ns["stats"][1].item() == 0


def _loss(logits, y) -> float:
    return torch.nn.functional.cross_entropy(logits.float(), y).item()


def test_import_ampfused_needs_no_framework():
    """``import ampfused`` (and ``ampfused.integrations``) works with every framework package unimportable."""
    code = textwrap.dedent("""
        import sys

        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("accelerate", "lightning", "pytorch_lightning", "transformers"):
                    raise ImportError(f"{name} blocked")
                return None

        sys.meta_path.insert(0, Blocked())
        import ampfused, ampfused.integrations
        try:
            import ampfused.integrations.lightning
        except ImportError as e:
            assert "pip install 'ampfused[integrations]'" in str(e), e
        else:
            raise AssertionError("the Lightning integration imported without lightning")
        print("ok")
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
