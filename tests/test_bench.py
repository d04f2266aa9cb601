"""The benchmark's own checks: variants agree with the reference, a wrong one stops the run, the CSV is whole."""
import csv
import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import ampfused

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # bench/ is a directory of the repository, not part of the installed package
    sys.path.insert(0, REPO)

from bench.common import measure  # noqa: E402
from bench.step import cli, plot, report, workloads  # noqa: E402
from bench.step.ampfused_variant import ampfused_backends, ampfused_variants  # noqa: E402
from bench.common.bytes import minimal_bytes_per_param, two_pass_bytes_per_param  # noqa: E402
from bench.step.check import CorrectnessError, check, make_plan, run_reference  # noqa: E402
from bench.step.variants import TorchForeach, TorchFused, TorchRecipe  # noqa: E402

CPU = torch.device("cpu")


def _instance(dtype="bf16", clip=True, scaler=True, name="3001x7"):
    return workloads.expand([name], [dtype], [clip], CPU, scaler=scaler)[0]


def _variants():
    everything = ["ampfused-reference", "ampfused-reference+none"]
    return ([TorchForeach(), TorchFused()] + ampfused_variants(CPU, "optimizer", everything)
            + ampfused_variants(CPU, "functional", everything))


@pytest.mark.parametrize("scaler", [True, False], ids=["scaler", "noscaler"])
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_every_variant_matches_the_reference(dtype, clip, scaler):
    inst = _instance(dtype, clip, scaler)
    params = workloads.init_params(inst)
    plan = make_plan(inst)
    expected = run_reference(inst, params, plan)
    for v in _variants():
        check(v.build(inst, params), inst, plan, expected)


def test_sampled_check_matches_too():
    inst = _instance(name="40000x3")
    params = workloads.init_params(inst)
    plan = make_plan(inst, max_elements=6000)
    assert all(s is not None and s.numel() < 40000 // 3 for s in plan.sample)
    expected = run_reference(inst, params, plan)
    for v in [TorchForeach()] + ampfused_variants(CPU):
        check(v.build(inst, params), inst, plan, expected)


class _Wrong(TorchForeach):
    """torch's recipe with one rule changed: what the check must refuse to time."""

    def __init__(self, name, **change):
        super().__init__()
        self.name, self.change = name, change

    def build(self, inst, params):
        return TorchRecipe(self.name, "foreach", dataclasses.replace(inst, **self.change), params, "foreach")


@pytest.mark.parametrize("change", [dict(clip=False), dict(weight_decay=0.0), dict(lr=1.01e-3),
                                    dict(betas=(0.9, 0.96)), dict(scaler=False)],
                         ids=["no-clip", "no-decay", "lr+1%", "beta2", "no-unscale"])
def test_a_wrong_variant_fails_the_check(change):
    inst = _instance("bf16", clip=True)
    params = workloads.init_params(inst)
    plan = make_plan(inst)
    expected = run_reference(inst, params, plan)
    with pytest.raises(CorrectnessError, match="wrong computes something else than ampfused.ops.reference"):
        check(_Wrong("wrong", **change).build(inst, params), inst, plan, expected)


def _argv(tmp_path, variants, *extra):
    return ["--device", "cpu", "--workloads", "2000x5,30000x3", "--dtypes", "bf16", "--variants", variants,
            "--reps", "3", "--warmup", "1", "--copy-mb", "8", "--out", str(tmp_path), "--name", "t",
            "--no-progress", *extra]


def test_end_to_end_writes_the_csv_table_and_plot(tmp_path, capsys):
    names = ",".join(["torch-foreach", "torch-fused"] + [f"ampfused-{b}" for b in ampfused_backends(CPU)])
    assert cli.main(_argv(tmp_path, names)) == 0
    with open(tmp_path / "t.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.COLUMNS
        rows = list(reader)
    assert len(rows) == 2 * len(names.split(","))
    for r in rows:
        assert float(r["median_ms"]) > 0 and float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"])
        assert float(r["copy_gbps"]) > 0 and float(r["rmw_gbps"]) > 0 and float(r["gbps_effective"]) > 0
        assert float(r["pct_of_copy_bw"]) > 0 and float(r["pct_of_rmw_bw"]) > 0
        assert r["host_syncs"] == "n/a"  # unmeasurable on CPU, and said so
        assert r["param_dtype"] == "bf16" and r["clip"] == "true"
        if r["variant"] == "torch-fused":
            assert float(r["speedup_vs_torch_fused"]) == pytest.approx(1.0)
    assert (tmp_path / "t.png").stat().st_size > 0
    assert "x best torch" in (tmp_path / "t.txt").read_text()
    # --compare against the run just saved, which this run overwrites: the comparison reads it first
    capsys.readouterr()
    assert cli.main(_argv(tmp_path, "torch-fused", "--compare", str(tmp_path / "t.csv"), "--no-plot")) == 0
    out = capsys.readouterr().out
    assert "change against" in out and "only in the saved run" in out and "ampfused-" in out


def test_each_row_is_compared_with_bandwidth_sampled_around_its_own_steps():
    """Bandwidth samples come right before and right after a variant's timed steps, which run back to back
    (refill, step, refill, step...), and a row's percentage is against the median of its samples."""
    calls = []
    y = measure.Yardstick(CPU, 1 << 20, reps=2)
    sample = y._sample
    y._sample = lambda: (calls.append("sample"), sample())[1]
    timing, bw = y.time_steps(lambda: calls.append("step"), lambda: calls.append("refill"), warmup=1, reps=3)
    assert calls == ["sample"] + ["refill", "step"] * 4 + ["sample"]
    assert len(bw.copy) == len(bw.rmw) == 4 and min(bw.copy + bw.rmw) > 0 and len(timing.times_ms) == 3
    timing = measure.Timing([1.0, 2.0, 4.0])
    assert measure.Bandwidth([10.0], [5.0, 10.0, 20.0]).pct("rmw", 10 ** 7, timing) == pytest.approx(50.0)
    assert measure.Bandwidth([10.0], [10.0]).pct("copy", 10 ** 7, timing) == pytest.approx(50.0)
    assert report.pct_of_rmw({"gbps_effective": "30", "pct_of_rmw_bw": "40"}) == 40.0
    assert report.pct_of_rmw({"gbps_effective": "30", "rmw_gbps": "60"}) == 50.0  # an older CSV
    assert report.bandwidth_range([{"rmw_gbps": "30"}, {"rmw_gbps": "60"}, {}], "rmw_gbps") == (30.0, 60.0)


COMMITTED_CPU_RUN = os.path.join(REPO, "bench", "results", "cpu-AMD-EPYC.csv")


def test_the_committed_cpu_run_stays_above_its_roofline():
    """The plot's roofline is a floor: no measurement of the committed CPU run is faster than its minimal bytes
    at the highest bandwidth measured in its panel, which on a CPU is the in-place read-modify-write one."""
    rows = report.read_csv(COMMITTED_CPU_RUN)
    for panel in {(r["grad_dtype"], r["clip"]) for r in rows}:
        sel = [r for r in rows if (r["grad_dtype"], r["clip"]) == panel]
        bw, which, floor = plot.roofline(sel)
        assert which == "in-place read-modify-write"
        for r in sel:
            assert float(r["median_ms"]) >= floor[int(r["numel"])], (panel, r["variant"], r["workload"], bw)


def test_rounds_measure_the_variants_in_turn_and_pool_their_steps(monkeypatch):
    """--rounds 3: the variants are timed A B A B A B, each row's median over the steps of its three rounds."""
    from bench.step import runner
    order, times = [], iter(range(1, 100))

    def timed(self, step, refill, warmup, reps, max_seconds=float("inf")):
        order.append(current[0])
        ms = [float(next(times)) for _ in range(reps)]
        return measure.Timing(ms), measure.Bandwidth([10.0], [10.0])

    current = [None]
    build = runner._checked_runner

    def checked_runner(inst, v, *a, **k):
        current[0] = v.name
        return build(inst, v, *a, **k)

    monkeypatch.setattr(measure.Yardstick, "time_steps", timed)
    monkeypatch.setattr(runner, "_checked_runner", checked_runner)
    variants = [TorchForeach(), TorchFused()]
    opts = runner.Options(reps=2, warmup=0, rounds=3, yardstick=measure.Yardstick(CPU, 1 << 20, reps=1))
    out = runner.run([_instance()], variants, {}, opts)
    assert order == ["torch-foreach", "torch-fused"] * 3
    # torch-foreach's steps took 1, 2, 5, 6, 9, 10 ms; torch-fused's 3, 4, 7, 8, 11, 12
    assert [float(r["median_ms"]) for r in out.rows] == [5.5, 7.5]
    assert out.notes == []


def test_a_wrong_variant_stops_the_benchmark_loudly(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "ampfused_variants", lambda device, api, names=None: [_Wrong("wrong", clip=False)])
    assert cli.main(_argv(tmp_path, "torch-fused,wrong")) == 1
    err = capsys.readouterr().err
    assert "wrong computes something else" in err and "exp_avg" in err
    assert not (tmp_path / "t.csv").exists()  # nothing is written from a run with a wrong variant


def test_each_configuration_is_kept_as_it_ends(tmp_path, capsys):
    """A run stopped part-way (a GPU command's time limit) keeps what it measured: the CSV is rewritten after each
    configuration with every row so far, and each row is printed as its configuration ends."""
    from bench.step import runner
    seen = []
    opts = runner.Options(reps=2, warmup=0, yardstick=None)
    out = runner.run([_instance(name="2000x5"), _instance(name="3001x7")], [TorchFused()], {}, opts,
                     done=lambda rows: seen.append([r["workload"] for r in rows]))
    assert seen == [["2000x5"], ["2000x5", "3001x7"]] and len(out.rows) == 2
    assert cli.main(_argv(tmp_path, "torch-fused")) == 0
    printed = capsys.readouterr().out
    assert "  2000x5 torch-fused: " in printed and "  30000x3 torch-fused: " in printed
    assert len((tmp_path / "t.csv").read_text().splitlines()) == 3


def test_byte_model():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert minimal_bytes_per_param(bf16, bf16, True) == 28  # design: single-launch = 28 B/param from DRAM
    assert two_pass_bytes_per_param(bf16, bf16, True) == 30  # design: two-kernel step = 30 B/param
    assert minimal_bytes_per_param(fp16, fp16, True) == 28
    assert minimal_bytes_per_param(fp32, fp32, False) == 28


def test_workloads():
    gpt2 = workloads.parse("gpt2-small")
    assert (gpt2.numel, gpt2.tensors) == (124_439_808, 148)
    assert workloads.parse("gpt2-medium").numel == 354_823_168
    w = workloads.parse("1Mx200")
    assert (w.numel, w.tensors) == (1_000_000, 200)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.parse("gpt5")


def test_a_run_puts_back_the_torch_settings_it_set(monkeypatch):
    """A benchmark's main leaves the process's torch settings as it found them, also where torch.testing has
    frozen the cuDNN flags (importing it does, for the rest of the process), which the run must not touch."""
    from bench.align import run as align_run
    from bench.common import settings
    monkeypatch.setitem(torch.backends.flags_frozen.__globals__, "__allow_nonbracketed_mutation_flag", False)
    assert torch.backends.flags_frozen()
    before = settings._read()
    with pytest.raises(SystemExit, match="power of two"):
        cli.main(["--distributed", "--device", "cpu", "--world", "3"])
    with pytest.raises(SystemExit, match="at least two windows"):
        align_run.main(["--device", "cpu", "--threads", "1", "--steps", "3", "--window", "2"])
    assert settings._read() == before


def test_compile_budget_is_reported_as_unavailable():
    # in a subprocess: an interrupted compile must not leave dynamo state behind in this test session
    code = (
        "import torch\n"
        "from bench.step import workloads, check as C\n"
        "from bench.step.variants import TorchCompile, Unavailable\n"
        "inst = workloads.expand(['3000x3'], ['bf16'], [True], torch.device('cpu'))[0]\n"
        "p = workloads.init_params(inst); plan = C.make_plan(inst); exp = C.run_reference(inst, p, plan)\n"
        "try:\n"
        "    C.check(TorchCompile(budget_s=0.05).build(inst, p), inst, plan, exp)\n"
        "except Unavailable as e:\n"
        "    assert 'budget' in str(e) and e.permanent, e  # the run's budget is spent\n"
        "    print('UNAVAILABLE', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert "UNAVAILABLE" in out.stdout, out.stdout + out.stderr


def test_host_time_table_times_both_paths():
    from bench.step import host_time
    out = host_time.table([1, 3], calls=20, rounds=1)
    lines = out.splitlines()
    assert lines[0] == "| tensors | path | `opt.step()` | `scaler.step` + `update` |"
    rows = [line for line in lines[2:] if line.startswith("| ")]
    assert [r.split(" | ")[1] for r in rows] == ["Python", "`ampfused._host`"] * 2
    assert all(r.endswith(" us |") for r in rows)


def test_host_time_times_each_backends_host_part_in_place_and_fresh():
    from bench.step import host_stubs, host_time
    names = [b for b in host_stubs.NAMES if b != "triton" or importlib.util.find_spec("triton") is not None]
    out = host_time.backend_table(names, [3], params=100, calls=20, rounds=1)
    rows = [line.split(" | ") for line in out.splitlines()[2:]]
    assert [r[0][2:] for r in rows] == names and all(r[1] == "3" for r in rows)
    assert all(r[2].endswith(" us") and r[4].endswith(" us") for r in rows)
    assert ampfused.ops.registered_backends() == ["reference", "triton", "cpu", "cuda"]  # none left registered


def test_the_default_cuda_run_compiles_on_one_workload():
    from bench.step.variants import TorchCompile, Unavailable
    args = cli.parser().parse_args([])
    names = ["1Mx200", "16Mx32", "gpt2-small", "gpt2-medium"]
    assert cli.compile_only(torch.device("cuda"), args, names) == "gpt2-small"
    assert cli.compile_only(torch.device("cuda"), args, ["16Mx32", "1Mx200"]) == "16Mx32"
    assert cli.compile_only(torch.device("cpu"), args, names) is None
    assert cli.compile_only(torch.device("cuda"), cli.parser().parse_args(["--full"]), names) is None
    assert cli.compile_only(torch.device("cuda"), cli.parser().parse_args(["--variants", "torch-compile"]),
                            names) is None
    other = workloads.expand(["1Mx200"], ["bf16"], [True], torch.device("cpu"))[0]
    with pytest.raises(Unavailable, match="compiled on gpt2-small only in the default run"):
        TorchCompile(only="gpt2-small").build(other, None)
