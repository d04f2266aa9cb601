"""``python -m ampfused.demo`` runs, its loss falls, and both comparisons come out as matches."""
from ampfused import demo


def test_demo_runs_and_matches(capsys, tmp_path):
    plot = tmp_path / "health.png"
    assert demo.main(["--steps", "80", "--every", "40", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "4. training health" in out and "hidden update/weight" in out
    assert plot.stat().st_size > 0
    assert "MATCH: ampfused reproduces torch's run bit for bit" in out
    assert "bf16 weights are the fp32 masters rounded to nearest even: yes" in out
    assert "2^14" in out and "e+06" not in out  # scales read as powers of two
