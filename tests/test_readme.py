"""What the docs promise about the API is the API: every signature docs/api.md prints is the real one, and its
ops table names exactly the ops that ``python -m ampfused.info`` reports; the README's two commands are the ones
CI runs."""
import ast
import inspect
import os
import re

import pytest
import torch

import ampfused
from ampfused import info

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = open(os.path.join(REPO, "docs", "api.md"), encoding="utf-8").read()


def _call_text(start: str) -> str:
    """The docs/api.md text of the call that begins with ``start`` (up to its closing parenthesis)."""
    i = API.index(start)
    depth, j = 0, API.index("(", i)
    while True:
        c = API[j]
        depth += c == "("
        depth -= c == ")"
        j += 1
        if depth == 0:
            return API[i:j]


NONE = object()  # no default


def _params_of(call: str) -> list:
    """(name, kind, default) of every parameter of a call written as a signature."""
    args = re.sub(r"\s+", " ", call[call.index("(") + 1:-1].replace("`", ""))
    fn = ast.parse(f"def f({args}): pass").body[0].args
    out = []
    positional = fn.posonlyargs + fn.args
    defaults = [None] * (len(positional) - len(fn.defaults)) + fn.defaults
    for a, d in zip(positional, defaults):
        out.append((a.arg, "positional", NONE if d is None else ast.unparse(d)))
    for a, d in zip(fn.kwonlyargs, fn.kw_defaults):
        out.append((a.arg, "keyword", NONE if d is None else ast.unparse(d)))
    return out


def _real(obj) -> list:
    sig = inspect.signature(obj)
    out = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        kind = "keyword" if p.kind is p.KEYWORD_ONLY else "positional"
        default = NONE if p.default is p.empty else p.default
        out.append((p.name, kind, default))
    return out


def _same_default(written, real) -> bool:
    if written is NONE or real is NONE:
        return written is real
    return eval(written, {"__builtins__": {}, "torch": torch}) == real  # constants, arithmetic (2.**16), dtypes


@pytest.mark.parametrize("start,obj", [
    ("FusedAdamW(params", ampfused.FusedAdamW),
    ("FusedAdam(params", ampfused.FusedAdam),
    ("FusedSGD(params", ampfused.FusedSGD),
    ("FusedLion(params", ampfused.FusedLion),
    ("FusedAdafactor(params", ampfused.FusedAdafactor),
    ("FusedMuon(params", ampfused.FusedMuon),
    ("ampfused.GradScaler(device", ampfused.GradScaler),
    ("ampfused.clip_grad_norm_(parameters", ampfused.clip_grad_norm_),
])
def test_every_public_signature_in_the_api_doc_is_the_real_one(start, obj):
    written = _params_of(_call_text(start))
    real = _real(obj)
    assert [(n, k) for n, k, _ in written] == [(n, k) for n, k, _ in real], (written, real)
    for (name, _, w), (_, _, r) in zip(written, real):
        assert _same_default(w, r), f"{start}...: {name}={w} in docs/api.md, {r!r} in the code"


def test_the_ops_table_names_the_ops_info_reports():
    table = API[API.index("## `ampfused.ops`"):API.index("Helpers (plain Python, no backend)")]
    named = re.findall(r"^\| `(\w+)\(", table, re.M)
    assert named == list(info.OPS)


def test_the_readme_gives_the_two_commands_ci_runs():
    """The README's first command installs and runs the benchmark, its second installs and runs what .ci/run runs."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("## Two commands"):readme.index("\n## ", readme.index("## Two commands") + 1)]
    bench, suite = [b.strip().split("\n")[-1] for b in re.findall(r"```bash\n(.*?)```", section, re.S)]
    ci = [line for line in open(os.path.join(REPO, ".ci", "run")).read().splitlines() if line.startswith("python3")]
    assert ci == [suite]
    install = 'python3 -m pip install --no-build-isolation -e '
    assert bench.endswith("&& python3 -m bench") and bench.split(install)[0] == suite.split(install)[0]
