"""The step benchmark's state modes and peers: each mode checked by its own rule, a wrong one refused, the state
bytes measured, the byte model per mode, every fast backend's modes added by --modes (the peers:
tests/test_bench_peers.py)."""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common.bytes import minimal_bytes_per_param, mode_bytes_per_param  # noqa: E402
from bench.step import workloads  # noqa: E402
from bench.step.ampfused_variant import ampfused_backends  # noqa: E402
from bench.step.check import CorrectnessError, make_plan, run_reference  # noqa: E402
from bench.step.modes import MODES, ModeRunner, ModeVariant, bf16_ulp, mode_variants  # noqa: E402
from bench.step.runner import state_bytes_per_param  # noqa: E402

CPU = torch.device("cpu")
BF16 = torch.bfloat16
STATE = {"": 12, "+rem": 10, "+bf16m": 8, "+rem+bf16m": 6, "+sr": 8, "+sr+bf16m": 4, "+q8m": 6.03, "+rem+q8m": 4.03,
         "+sr+q8m": 2.03, "+health": 12, "+rem+health": 10}


def _setup(name="3001x7", clip=True, scaler=True):
    inst = workloads.expand([name], ["bf16"], [clip], CPU, scaler=scaler)[0]
    params = workloads.init_params(inst)
    plan = make_plan(inst)
    return inst, params, plan, run_reference(inst, params, plan)


def test_byte_model_per_mode():
    got = {m.suffix: mode_bytes_per_param(BF16, BF16, m.master, m.moment_bytes) for m in MODES}
    assert got == {"+rem": 26, "+bf16m": 20, "+rem+bf16m": 18, "+sr": 22, "+sr+bf16m": 14, "+q8m": 16.0625,
                   "+rem+q8m": 14.0625, "+sr+q8m": 10.0625,  # 8-bit: 1 B per moment + 4 B per 256
                   "+health": 28, "+rem+health": 26}  # (the health sums move no byte more)
    assert mode_bytes_per_param(BF16, BF16) == minimal_bytes_per_param(BF16, BF16, True) == 28
    assert mode_bytes_per_param(BF16, BF16, "none", 2, extra_bytes=2) == 18  # optimi's Kahan sum
    with pytest.raises(ValueError, match="master must be one of"):
        mode_bytes_per_param(BF16, BF16, "int8")


def test_bf16_ulp():
    x = torch.tensor([1.0, 1.5, 2.0, -3.0, 0.0], dtype=torch.float64)
    assert bf16_ulp(x).tolist()[:4] == [2 ** -7, 2 ** -7, 2 ** -6, 2 ** -6]
    assert bf16_ulp(x)[4] > 0


@pytest.mark.parametrize("clip,scaler", [(True, True), (False, False)], ids=["clip-scaler", "plain"])
def test_every_mode_passes_its_check_and_reports_its_state_bytes(clip, scaler):
    backends = [b for b in ampfused_backends(CPU) if b != "reference"] + ["reference"]
    inst, params, plan, expected = _setup(clip=clip, scaler=scaler)
    for v in mode_variants(CPU, backends[:1], [f"ampfused-{backends[0]}{m.suffix}" for m in MODES]):
        runner = v.build(inst, params)
        v.check_runner(runner, inst, plan, expected)
        bpp = state_bytes_per_param(runner, inst.workload.numel)
        # + step counts, padding (8-bit moments: each tensor starts at a multiple of 256 elements)
        gaps = 2 * 256 * len(inst.workload.shapes) / inst.workload.numel if v.mode.q8_moments else 0
        assert STATE[v.mode.suffix] <= bpp < STATE[v.mode.suffix] + 0.2 + gaps, (v.name, bpp)


class _Twice(ModeRunner):
    """A wrong step: each step taken twice (moments and weights move twice as far, an extra remainder update)."""

    def step(self):
        super().step()
        super().step()


@pytest.mark.parametrize("suffix", ["+sr+bf16m", "+rem", "+sr+q8m", "+q8m"])
def test_a_wrong_mode_fails_its_check(suffix):
    inst, params, plan, expected = _setup()
    backend = [b for b in ampfused_backends(CPU) if b != "reference"][:1] or ["reference"]
    if "q8" in suffix and backend == ["reference"]:
        pytest.skip("8-bit modes are held against the reference backend: a fast backend is needed")
    v = ModeVariant(backend[0], next(m for m in MODES if m.suffix == suffix))
    runner = _Twice(v.name, v.backend, inst, params, v.mode)
    with pytest.raises(CorrectnessError, match=v.name.replace("+", r"\+")):
        v.check_runner(runner, inst, plan, expected)


def test_modes_refuse_non_bf16_models():
    inst = workloads.expand(["3001x7"], ["fp32"], [True], CPU)[0]
    from bench.step.variants import Unavailable
    with pytest.raises(Unavailable, match="bf16 models"):
        ModeVariant("reference", MODES[0]).build(inst, workloads.init_params(inst))


def test_cli_adds_modes_and_peers(tmp_path, capsys):
    from bench.step import cli
    rc = cli.main(["--device", "cpu", "--workloads", "2000x3", "--dtypes", "bf16", "--clip", "on", "--modes",
                   "--variants", "torch-foreach,ampfused-reference+rem,ampfused-reference+sr+bf16m,flashoptim-adamw",
                   "--reps", "2", "--warmup", "0", "--max-seconds", "1", "--copy-mb", "4", "--out", str(tmp_path),
                   "--no-progress", "--no-plot", "--name", "t"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "state B/p" in out and "moved B/p" in out
    assert "flashoptim-adamw on" in out and "unavailable" in out
    import csv
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "t.csv"))}
    # --modes adds every mode on every fast backend to the variants named
    fast = [b for b in ampfused_backends(torch.device("cpu")) if b != "reference"]
    assert {f"ampfused-{b}{m.suffix}" for b in fast for m in MODES} <= set(rows)
    assert float(rows["ampfused-reference+rem"]["state_bytes_per_param"]) == pytest.approx(10, abs=0.2)
    assert float(rows["ampfused-reference+sr+bf16m"]["bytes_per_param"]) == 14
    assert float(rows["torch-foreach"]["state_bytes_per_param"]) == pytest.approx(12, abs=0.2)


def test_modes_cover_every_fast_backend():
    """On CUDA both GPU backends have their own compact kernels: --modes times the modes on each (the backend list
    injected as a CUDA machine's; the reference only by name)."""
    got = [v.name for v in mode_variants(torch.device("cuda"), ["cuda", "triton", "reference"])]
    gpu = [m for m in MODES if "health" not in m.suffix]  # (the GPU steps do not compute the health sums yet)
    assert got == [f"ampfused-{b}{m.suffix}" for b in ("cuda", "triton") for m in gpu]
    named = mode_variants(CPU, ["cpu", "reference"], ["ampfused-reference+rem"])
    assert [v.name for v in named] == [f"ampfused-cpu{m.suffix}" for m in MODES] + ["ampfused-reference+rem"]


def test_cli_modes_on_every_backend_the_device_has(monkeypatch):
    from bench.step import cli
    monkeypatch.setattr(cli, "ampfused_backends", lambda device: ["cuda", "triton", "reference"])
    args = cli.parser("bench").parse_args(["--modes"])
    names = {v.name for v in cli.extra_variants(torch.device("cuda"), args)}
    gpu = [m for m in MODES if "health" not in m.suffix]
    assert {f"ampfused-{b}{m.suffix}" for b in ("cuda", "triton") for m in gpu} == names


def test_muon_pass_bytes():
    """Muon's passes per element of a bf16 matrix: K1, the momentum pass (its bf16 output for the iteration), the
    iteration's bf16 input and output, the update pass; each state mode at its stored width."""
    from bench.common.bytes import muon_bytes_per_param, muon_pass_bytes
    bf16 = torch.bfloat16
    assert muon_pass_bytes(bf16, bf16) == {"K1": 2, "A": 12, "NS": 4, "B": 12}
    assert muon_bytes_per_param(bf16, bf16) == 30
    assert muon_bytes_per_param(bf16, bf16, "remainder") == 28
    assert muon_bytes_per_param(bf16, bf16, "none", momentum_bytes=2) == 20
    assert muon_bytes_per_param(torch.float32, torch.float32, "none") == 4 + 14 + 4 + 10
