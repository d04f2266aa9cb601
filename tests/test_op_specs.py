"""The op records (ampfused/ops/specs.py) and what is made from them: each registered schema is its record's,
no written argument has a default, the public functions' defaults are the records', and the eager path bumps
the versions of exactly the tensors the custom op declares written (the compact state's included)."""
import inspect
import math

import pytest
import torch

from ampfused import info, ops
from ampfused.ops import library, reference, specs, state_precision as sp
from ampfused.ops.reference_adafactor import factor_layout

BF16 = torch.bfloat16


@pytest.mark.parametrize("name", list(specs.SPECS))
def test_the_registered_op_is_its_record(name):
    spec = specs.SPECS[name]
    schema = getattr(torch.ops.ampfused, name).default._schema
    assert str(schema) == f"ampfused::{name}{spec.schema()}"
    assert [a.name for a in schema.arguments] == list(spec.arg_names)
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    assert tuple(written) == spec.written == ops._MUTATED[name]
    assert not [a.name for i, a in enumerate(schema.arguments) if i in written and a.has_default_value()]
    assert schema.arguments[spec.arg_names.index(spec.probe)].name == spec.probe


def test_a_step_op_is_laid_out_from_its_states_and_hyperparameters():
    spec = specs.step_op("toy_step_", (specs.State("m"), specs.State("v", optional=True)),
                         (specs.Hyper("beta", "float", 0.5), specs.MAXIMIZE), state_scales=False)
    assert spec.schema() == (
        "(Tensor(a0!)[] params, Tensor?[] grads, Tensor(a2!)? master, Tensor(a3!) m, Tensor(a4!)? v, "
        "Tensor(a5!) steps, Tensor partials, Tensor inv_scale, Tensor lr, Tensor(a9!) out_stats, float beta, "
        "bool maximize, str backend, Tensor? seed=None) -> ()")
    assert spec.hyper == {"beta": 0.5, "maximize": False} and spec.probe == "steps" and spec.is_step


def test_a_bad_record_is_refused():
    with pytest.raises(ValueError, match="written but is a float"):
        specs.OpSpec("x_", (specs.Arg("a", "float", True), specs.Arg("backend", "str")), probe="a").schema()
    with pytest.raises(ValueError, match="no fake implementation"):
        specs.OpSpec("x", (specs.Arg("a", "Tensor"), specs.Arg("backend", "str")), probe="a", returns="Tensor")
    with pytest.raises(ValueError, match="probe 'b'"):
        specs.OpSpec("x", (specs.Arg("a", "Tensor"), specs.Arg("backend", "str")), probe="b")


@pytest.mark.parametrize("name", [n for n, s in specs.SPECS.items() if s.is_step])
def test_the_public_defaults_are_the_records(name):
    spec = specs.SPECS[name]
    public = inspect.signature(getattr(ops, name)).parameters
    for group, members in spec.groups:  # hyperparameters the public function takes as one tuple (torch's)
        assert public[group].default == tuple(spec.hyper[m] for m in members)
    shared = [h for h in spec.hyper if h in public]
    assert len(shared) == len(spec.hyper) - sum(len(members) for _, members in spec.groups)
    assert {h: public[h].default for h in shared} == {h: spec.hyper[h] for h in shared}


def test_info_lists_every_op_in_a_column_wide_enough():
    assert info.OPS[1:] == tuple(specs.SPECS)
    rows = [r for r in info.report().splitlines() if r.strip().split(" ")[0] in info.OPS]
    assert len(rows) == len(info.OPS)
    starts = {len(r) - len(r[2:].split(" ", 1)[1].lstrip()) for r in rows}
    assert len(starts) == 1, rows


def _q8_adam(n=300):
    """A valid AdamW step with fp32 masters and 8-bit moments (so ``seed`` and ``state_scales`` are given)."""
    total = reference.state_layout([n], sp.QBLOCK)[1]
    master = torch.randn(total)
    coded = [sp.q8_quantize(torch.rand(total) * 1e-3, signed=k == 0) for k in range(2)]
    return dict(params=[master[:n].to(BF16)], grads=[torch.randn(n).to(BF16)], master=master,
                exp_avg=coded[0][0], exp_avg_sq=coded[1][0], steps=torch.zeros(1), inv_scale=torch.tensor(1.0),
                lr=torch.tensor(1e-3), out_stats=torch.zeros(2), seed=torch.tensor(7, dtype=torch.int64),
                state_scales=torch.stack([sc for _, sc in coded]))


def _versions(t):
    return {k: [x._version for x in v] if isinstance(v, list) else v._version for k, v in t.items()}


def _bumped(before, after):
    return sorted(k for k in before if before[k] != after[k])


def test_the_eager_path_bumps_what_the_custom_op_declares_written():
    t = _q8_adam()
    t["partials"] = ops.norm_check(t["grads"], t["inv_scale"], backend="reference")
    v0 = _versions(t)
    ops.adamw_step_(t["params"], t["grads"], t["master"], t["exp_avg"], t["exp_avg_sq"], t["steps"], t["partials"],
                    t["inv_scale"], t["lr"], t["out_stats"], seed=t["seed"], state_scales=t["state_scales"],
                    backend="reference")
    v1 = _versions(t)
    library.OPS["adam_step_"](t["params"], t["grads"], t["master"], t["exp_avg"], t["exp_avg_sq"], t["steps"],
                              t["partials"], t["inv_scale"], t["lr"], t["out_stats"], 0.9, 0.999, 1e-8, 0.01,
                              math.inf, True, False, "reference", t["seed"], t["state_scales"])
    v2 = _versions(t)
    declared = sorted(specs.SPECS["adam_step_"].arg_names[i] for i in specs.SPECS["adam_step_"].written)
    assert _bumped(v0, v1) == _bumped(v1, v2) == declared


def test_opcheck_of_the_ops_no_other_test_opchecks():
    backend = "cpu"
    t = _q8_adam(40)
    t["partials"] = ops.norm_check(t["grads"], t["inv_scale"], backend=backend)
    common = (t["steps"], t["partials"], t["inv_scale"], t["lr"], t["out_stats"])
    o = torch.ops.ampfused
    torch.library.opcheck(o.adam_step_.default, (t["params"], t["grads"], t["master"], t["exp_avg"],
                                                 t["exp_avg_sq"], *common, 0.9, 0.999, 1e-8, 0.01, 1.0, True,
                                                 False, backend, t["seed"], t["state_scales"]))
    state = torch.zeros_like(t["master"])
    torch.library.opcheck(o.lion_step_.default, (t["params"], t["grads"], t["master"], state, *common, 0.9, 0.99,
                                                 0.01, 1.0, False, backend, None, None))
    factors = torch.zeros(factor_layout([tuple(p.shape) for p in t["params"]])[1])
    for seed in ((), (None,)):  # seed left out: the one trailing argument with a default
        torch.library.opcheck(o.adafactor_step_.default, (t["params"], t["grads"], t["master"], factors, *common,
                                                          -0.8, None, 1e-3, 1.0, 0.0, 1.0, False, backend, *seed))
    mats = [torch.randn(6, 4), torch.randn(3, 5)]
    grads = [torch.randn_like(m) for m in mats]
    inv = torch.ones(())
    partials = ops.norm_check(grads, inv, backend="reference")
    buf = torch.zeros(reference.state_layout([m.numel() for m in mats])[1])
    torch.library.opcheck(o.muon_step_.default, (mats, grads, None, buf, torch.zeros(2), partials, inv,
                                                 torch.tensor(0.02), torch.zeros(2), 0.95, True, 0.1, 3.4445, -4.775,
                                                 2.0315, 1e-7, 5, None, math.inf, "reference", None, None))


def _sources_naming(word: str) -> list:
    """The package's source files (ampfused/, csrc/, triton_kernels/, setup.py) that name ``word`` in any case:
    what ``git grep -li`` finds there, read from the files themselves (a tree without git counts the same)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    found = []
    for top in ("ampfused", "csrc", "triton_kernels"):
        for f in sorted((root / top).rglob("*")):
            if f.suffix in (".py", ".h", ".cuh", ".cu", ".cpp") and f.is_file() and not any(
                    part.is_symlink() for part in [f, *f.parents] if root in part.parents):
                if word in f.read_text(errors="replace").lower():
                    found.append(str(f.relative_to(root)))
    if word in (root / "setup.py").read_text().lower():
        found.append("setup.py")
    return found


@pytest.mark.parametrize("word", ["lion", "adafactor", "muon"])
def test_an_optimizer_is_named_in_at_most_ten_source_files(word):
    """Adding an optimizer is its math, its kernels, its class and the export lists (docs/architecture.md's
    recipe): nothing else in the package names it."""
    found = _sources_naming(word)
    assert 0 < len(found) <= 10, found
