"""``python -m bench.align`` end to end on a tiny model: every run happens, the control is bitwise, the masters of
the first step agree to a few ULPs, the figures are right, and the CSV, table and plot are written."""
import csv
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # bench/ is a directory of the repository, not part of the installed package
    sys.path.insert(0, REPO)

from bench.align import report as R, run as align, runs as T  # noqa: E402

STEPS = 24
TINY = ["--steps", str(STEPS), "--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch", "4",
        "--window", "8", "--device", "cpu"]


def test_short_run_end_to_end(tmp_path, monkeypatch, capsys):
    seen = {}
    real = align.execute
    monkeypatch.setattr(align, "execute", lambda *a, **k: seen.setdefault("outcome", real(*a, **k)))
    rc = align.main(TINY + ["--out", str(tmp_path), "--name", "t", "--strict"])
    out = seen["outcome"]
    printed = capsys.readouterr().out

    assert list(out.runs) == list(T.RUNS)
    for r in out.runs.values():
        assert len(r.losses) == len(r.grad_norms) == STEPS and all(map(torch.isfinite, torch.tensor(r.losses)))
        assert len(r.masters) == T.SNAPSHOTS and r.masters[0].dtype == torch.float32
    first = {r.losses[0] for r in out.runs.values() if T.DTYPE[r.name] == torch.bfloat16}
    assert len(first) == 1  # same initial weights, same first batch
    assert out.runs["torch"].losses[-1] < out.runs["torch"].losses[0] - 0.5  # it learns

    # run-to-run control: bitwise; the other pairs differ, but not by much in 24 steps
    assert out.deterministic and out.figs[("torch-again", "torch")].bitwise
    assert out.runs["torch"].losses == out.runs["torch-again"].losses
    assert torch.equal(out.runs["torch"].final_masters, out.runs["torch-again"].final_masters)
    for key in (R.CONTROL, R.BF16, R.FP16):
        assert max(out.figs[key].steps) < 0.02
    # before chaos: the first step's masters agree to a few ULPs, in the runs and on the same gradients
    for key in (R.BF16, R.FP16):
        assert out.masters[key].max_ulps[0] <= 2 * R.FEW_ULPS, out.masters[key].max_ulps
        assert out.same[key].max_ulps[0] <= 2 * R.FEW_ULPS
    assert out.same[("ampfused", "exact")].max_ulps[0] <= R.FEW_ULPS
    assert out.masters[("torch-again", "torch")].max_ulps == [0.0] * T.SNAPSHOTS

    assert [b.name[:2] for b in out.bars] == ["1.", "2.", "3."]
    failed = any(not b.passed for b in out.bars) or not out.deterministic
    assert rc == (1 if failed else 0)  # --strict
    for b in out.bars:
        assert f"{'PASS' if b.passed else 'FAIL'}  {b.name}" in printed

    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == STEPS and rows[0]["step"] == "1"
    assert float(rows[-1]["loss_ampfused"]) == out.runs["ampfused"].losses[-1]
    assert {"loss_fp32", "grad_norm_torch-fp16", "scale_ampfused-fp16"} <= set(rows[0])
    text = (tmp_path / "t.txt").read_text()
    assert "| ampfused vs torch |" in text and "bitwise identical" in text and "1 layers, width 32" in text
    assert (tmp_path / "t.png").stat().st_size > 10_000
    for ext in ("csv", "txt", "png"):
        assert f"wrote {tmp_path / ('t.' + ext)}" in printed


def test_figures():
    a = [1.0, 2.0, 3.0, 4.0]
    b = [1.0, 2.01, 3.0, 4.0]
    rel = R.relative(a, b)
    assert rel[0] == 0 and rel[1] == pytest.approx(0.01 / 2.01)
    assert R.window_means([1, 2, 3, 4, 5], 2) == [1.5, 3.5]  # the partial window is left out
    f = R.PairFigures("x", "", rel, R.relative(R.window_means(a, 2), R.window_means(b, 2)), 2, 0, False)
    assert f.first_step_over() == 2 and f.first_window_over() == (1, 2)
    assert f.figures()["max"] == pytest.approx(0.01 / 2.01)


def test_ulp_distance():
    x = torch.tensor([1.0, 0.5, -3.0, 1e-6, 0.25])
    sizes = [1, 1, 1, 2]  # one value per tensor, then a tensor of two
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    u = R.ulp_distance(up, x, x, sizes)
    assert u[:3].tolist() == [1.0, 1.0, 1.0] and u[4] == 1.0
    # a master near zero in a tensor of larger values counts in ULPs of the tensor's RMS, not of its own
    assert 0 < u[3] < 1e-3
    assert R.ulp_distance(x, x.clone(), x, sizes).abs().sum() == 0


def test_chaos_starts_where_model_weights_part():
    m = R.MasterFigures(max_ulps=[3.0, 2.0, 900.0], weights_differ=[0, 1, 5])
    assert R.before_chaos(m) == 2  # step 3's forward pass saw a weight that step 2 rounded differently
    assert R.before_chaos(R.MasterFigures(max_ulps=[1.0, 1.0], weights_differ=[4, 0])) == 1
    assert R.before_chaos(R.MasterFigures(max_ulps=[1.0, 1.0, 1.0], weights_differ=[0, 0, 0])) == 3


def test_modes_run_against_the_fp32_master_run(tmp_path, capsys):
    """``--modes``: every state mode trains from the same start on the same batches as the fp32-master run,
    the figures are the window means' relative differences, and each mode gets a PASS/FAIL line."""
    from bench.align import modes
    rc = align.main(TINY[:-2] + ["--steps", "16", "--device", "cpu", "--modes", "--no-peers", "--out",
                                 str(tmp_path), "--name", "m"])
    printed = capsys.readouterr().out
    assert rc == 0
    for name, (_, nbytes) in modes.MODES.items():
        assert any(line.startswith(("PASS  ", "FAIL  ")) and f"{name} ({nbytes} B/param)" in line
                   for line in printed.splitlines()), name
    with open(tmp_path / "m.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 16 and list(rows[0])[1:] == ["ampfused"] + list(modes.MODES) + ["ampfused+sr~seed1"]
    losses = {n: [float(r[n]) for r in rows] for n in rows[0] if n != "step"}
    assert len({v[0] for v in losses.values()}) == 1  # same initial weights, same first batch
    assert all(v[-1] < v[0] for v in losses.values())  # each learns
    assert losses["ampfused+sr~seed1"] != losses["ampfused+sr"]  # other rounding draws: the noise floor's twin
    assert "noise floor: ampfused+sr trained again with seed 1" in printed
    ref = R.window_means(losses["ampfused"], 8)
    fig = modes.window_figures(T.Run("x", losses=losses["ampfused+sr"]), T.Run("y", losses=losses["ampfused"]),
                               align.M.Config(steps=16, window=8))
    assert fig["windows"] == R.relative(R.window_means(losses["ampfused+sr"], 8), ref)
    assert "absent: optimi-adamw: not asked for" in (tmp_path / "m.txt").read_text()


def test_modes_judge():
    from bench.align import modes
    figs = {"ampfused+sr+bf16m": dict(max=0.008), "ampfused+rem": dict(max=0.001), "optimi-adamw": dict(max=0.01),
            "ampfused+bf16m": dict(max=0.02)}
    lines = modes.judge(figs)
    assert lines[0].startswith("PASS  ampfused+rem")
    assert lines[1].startswith("FAIL  ampfused+bf16m")  # 2% and no peer of 8 B or less beats... optimi 1% < 2%
    assert lines[2].startswith("PASS  ampfused+sr+bf16m") and "optimi-adamw (4 B) 1.000%" in lines[2]


@pytest.mark.parametrize("optimizer", ["lion", "adafactor"])
def test_modes_of_other_optimizers_run_against_their_own_fp32_run(tmp_path, capsys, optimizer):
    """``--modes --optimizer lion|adafactor``: each of the optimizer's modes against its own fp32-master run."""
    from bench.align import modes
    _, _, reference, runs, _ = modes.OPTIMIZERS[optimizer]
    rc = align.main(TINY[:-2] + ["--steps", "16", "--device", "cpu", "--modes", "--optimizer", optimizer,
                                 "--no-peers", "--out", str(tmp_path), "--name", "m"])
    printed = capsys.readouterr().out
    assert rc == 0
    for name, (_, nbytes) in runs.items():
        assert any(line.startswith(("PASS  ", "FAIL  ")) and f"{name} ({nbytes} B/param)" in line
                   for line in printed.splitlines()), name
    with open(tmp_path / "m.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[1:] == [reference] + list(runs) + [modes.CONTROLS[optimizer][1]]
    assert f"noise floor: {modes.CONTROLS[optimizer][0]} trained again with seed 1" in printed
    losses = {n: [float(r[n]) for r in rows] for n in rows[0] if n != "step"}
    assert len({v[0] for v in losses.values()}) == 1
    assert all(v[-1] < v[0] for v in losses.values())
