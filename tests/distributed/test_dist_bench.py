"""``python -m bench --distributed`` end to end at a tiny size on 2 gloo processes: the check passes, the CSV and
the markdown table are written, ZeRO-1 holds half of torch's optimizer bytes per rank; a torch recipe with one
rule changed stops the run before anything is timed or written. No time is asserted."""
import csv
import dataclasses
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # bench/ is a directory of the repository, not part of the installed package
    sys.path.insert(0, REPO)

from bench.distributed import run as distributed  # noqa: E402
from bench.step import cli  # noqa: E402

WIDTH, BLOCKS = 32, 2


def _argv(tmp_path, *extra):
    return ["--distributed", "--device", "cpu", "--dist-width", str(WIDTH), "--dist-blocks", str(BLOCKS),
            "--dist-batch", "4", "--reps", "5", "--warmup", "1", "--threads", "1", "--dist-timeout", "600",
            "--no-progress", "--out", str(tmp_path), "--name", "d", *extra]


def test_distributed_workload_end_to_end(tmp_path, capsys):
    assert cli.main(_argv(tmp_path)) == 0
    with open(tmp_path / "d.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == distributed.COLUMNS
        rows = {r["variant"]: r for r in reader}
    assert sorted(rows) == ["ampfused-zero1", "torch-ddp"]
    n, tensors = distributed.model_size(WIDTH, BLOCKS)
    for r in rows.values():
        assert (r["comm"], r["world"], r["check"]) == ("gloo", "2", "passed")
        assert (int(r["numel"]), int(r["tensors"]), int(r["steps_timed"])) == (n, tensors, 5)
        assert 0 < float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"])
    assert float(rows["torch-ddp"]["speedup_vs_torch_ddp"]) == pytest.approx(1.0)
    assert "AdamW(fused=True)" in rows["torch-ddp"]["optimizer"]

    # torch: fp32 master + exp_avg + exp_avg_sq (12 B per parameter) and a 4-byte step count per tensor, on every
    # rank; ZeRO-1: the same 12 B for this rank's half of the elements, plus a little alignment and step counts
    torch_bytes = int(rows["torch-ddp"]["opt_bytes_per_rank"])
    assert torch_bytes == 12 * n + 4 * tensors
    assert int(rows["torch-ddp"]["opt_bytes_all_ranks"]) == 2 * torch_bytes
    assert float(rows["torch-ddp"]["opt_bytes_per_param"]) == pytest.approx(12, rel=1e-3)
    zero = rows["ampfused-zero1"]
    zero_max, zero_all = int(zero["opt_bytes_per_rank"]), int(zero["opt_bytes_all_ranks"])
    share = -(-n // 2)
    for b in (zero_max, zero_all - zero_max):  # each of the two ranks
        assert 12 * share - 24 <= b <= 12 * share + tensors * (3 * 12 + 4), (b, n)
    assert zero_max / torch_bytes == pytest.approx(0.5, abs=0.01)
    assert float(zero["opt_bytes_per_param"]) == pytest.approx(6, rel=0.02)

    md = (tmp_path / "d.md").read_text()
    assert "| variant | median ms |" in md and "| ampfused-zero1 |" in md and "| torch-ddp |" in md
    assert "checked before timing" in md and "collectives alone" in md
    assert "| ampfused-zero1 |" in capsys.readouterr().out  # the table is printed too


def test_a_wrong_torch_recipe_stops_the_distributed_run(tmp_path, monkeypatch, capsys):
    launch = distributed.launch
    monkeypatch.setattr(distributed, "launch",
                        lambda cfg: launch(dataclasses.replace(cfg, torch_changes={"lr": 1.01e-3})))
    assert cli.main(_argv(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "ampfused-zero1 computes something else than the torch recipe" in err and "master[" in err
    assert not os.listdir(tmp_path)  # nothing is written from a run that failed its check


def test_distributed_options_are_checked():
    with pytest.raises(SystemExit, match="power of two"):
        cli.main(["--distributed", "--device", "cpu", "--world", "3"])
    with pytest.raises(SystemExit, match="--workloads.*not of --distributed"):
        cli.main(["--distributed", "--device", "cpu", "--workloads", "1Mx200"])
