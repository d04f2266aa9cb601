"""The step benchmark's peers (other libraries' low-precision AdamW): run as bf16 recipes run, without a loss
scaler (so never handing bf16 gradients to GradScaler.unscale_, which torch's CUDA kernel refuses); a peer that
differs from the reference by its design is timed with its deviation shown, a wrong one is dropped; every
installed peer runs its check on the CPU, flashoptim excepted (its quantization needs CUDA). The Lion and Muon
benchmarks' peers (bitsandbytes' Lion8bit; heavyball's MuonAdamW, held to its own math, not torch's) run end
to end at a tiny size."""
import csv
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.step import peers, report, runner, workloads  # noqa: E402
from bench.step.check import CorrectnessError, make_plan, run_reference  # noqa: E402
from bench.step.runner import state_bytes_per_param  # noqa: E402
from bench.step.variants import Unavailable  # noqa: E402

CPU = torch.device("cpu")


def _setup(name="3001x7", clip=True, scaler=True):
    inst = workloads.expand([name], ["bf16"], [clip], CPU, scaler=scaler)[0]
    params = workloads.init_params(inst)
    plan = make_plan(inst)
    return inst, params, plan, run_reference(inst, params, plan)


class _FakeModule:
    @staticmethod
    def AdamW(ps, lr, **kw):
        return torch.optim.AdamW(ps, lr=lr, **kw)


def _fake(name="fake-adamw", lr_factor=1.0):
    return peers.Peer(name, "torchao", "fake_peer_module",
                      lambda mod, ps, i: mod.AdamW(ps, lr=lr_factor * i.lr, betas=i.betas, eps=i.eps,
                                                   weight_decay=i.weight_decay))


@pytest.fixture
def fake_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "fake_peer_module", _FakeModule)


def _own(v, inst, params):
    """The peer's own configuration (no scaler), its plan and reference."""
    mine = v.instance_for(inst)
    plan = make_plan(mine)
    return mine, plan, run_reference(mine, params, plan)


def test_a_peer_runs_without_a_scaler_and_passes_its_check(fake_module):
    inst, params, _, _ = _setup()
    v = peers.PeerVariant(_fake())
    mine, plan, expected = _own(v, inst, params)
    assert inst.scaler and not mine.scaler and mine.label() == inst.label() + " noscaler"
    r = v.build(inst, params)  # the scaler instance given: the peer builds its own
    assert not r.inst.scaler and not hasattr(r, "scaler")
    v.check_runner(r, mine, plan, expected)
    assert 3.9 < state_bytes_per_param(r, mine.workload.numel) < 4.2  # bf16 moments + step counts
    assert v.bytes_per_param(mine) > 14
    assert not r.notes


def test_a_wrong_peer_is_dropped(fake_module):
    inst, params, _, _ = _setup()
    v = peers.PeerVariant(_fake("fake-wrong-lr", lr_factor=10))
    mine, plan, expected = _own(v, inst, params)
    with pytest.raises(CorrectnessError, match="(?s)fake-wrong-lr.*a wrong rule"):
        v.check_runner(v.build(inst, params), mine, plan, expected)


class _FewOff(peers.PeerRunner):
    """A peer whose format leaves two weights far off (as flashoptim's leaves a few in 131072 beyond 2 ulps)."""

    def step(self):
        super().step()
        with torch.no_grad():
            self.model[0].view(-1)[:2] += 0.25


def test_a_peer_differing_at_a_few_weights_is_timed_with_its_deviation(fake_module):
    inst, params, _, _ = _setup()
    v = peers.PeerVariant(_fake("fake-few-off"))
    mine, plan, expected = _own(v, inst, params)
    r = _FewOff(v.name, v.peer, _FakeModule, mine, params)
    v.check_runner(r, mine, plan, expected)  # not raised: a difference of design
    assert any("2 of" in n and "by its design" in n for n in r.notes), r.notes
    dev = runner.weight_deviation(r.snapshot(), expected, plan)
    assert dev > 0.1  # the two weights' 0.5 against weights of magnitude about 1 .. 3


def _emulate_cuda_unscale(monkeypatch):
    """torch's CUDA _amp_foreach_non_finite_check_and_unscale_ has no BFloat16 kernel (torch 2.11): the CPU's
    does, so a recipe handing it bf16 gradients passes here unless the restriction is emulated."""
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def cuda_like(grads, found_inf, inv_scale):
        if any(g.dtype == torch.bfloat16 for g in grads):
            raise NotImplementedError('"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for '
                                      "'BFloat16'")
        return real(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", cuda_like)


def test_peers_never_hand_bf16_gradients_to_the_scaler(fake_module, monkeypatch):
    """The benchmark with a scaler (its default) times the peer, with the CUDA kernel's dtype restriction on;
    the row carries the deviation column."""
    _emulate_cuda_unscale(monkeypatch)
    inst = workloads.expand(["3001x7"], ["bf16"], [True], CPU, scaler=True)[0]
    opts = runner.Options(warmup=0, reps=2, max_seconds=1.0)
    out = runner.run([inst], [peers.PeerVariant(_fake())], {"device": "cpu"}, opts)
    assert not out.failures, out.failures
    (row,) = out.rows
    assert row["variant"] == "fake-adamw" and 0 < float(row["weight_dev"]) < 0.05
    text = report.table(out.rows)
    assert "dev" in text.splitlines()[0]
    assert "weight_dev" in report.COLUMNS


def test_absent_and_cuda_only_peers_are_reported(fake_module):
    inst, params, _, _ = _setup()
    absent = peers.Peer("fake-absent", "torchao", "no_such_peer_module_here", _fake().make)
    with pytest.raises(Unavailable, match=r"not installed.*\.\[peers\]"):
        peers.PeerVariant(absent).build(inst, params)
    cuda_only = peers.Peer("fake-cuda", "torchao", "fake_peer_module", _fake().make, cuda_only=True)
    with pytest.raises(Unavailable, match="CUDA only"):
        peers.PeerVariant(cuda_only).build(inst, params)


@pytest.mark.parametrize("peer", [p for p in peers.PEERS if not p.cuda_only], ids=lambda p: p.name)
def test_each_installed_peer_is_checked_and_timed_on_the_cpu(peer):
    """65536 parameters in 4 tensors of 16384 (over torchao's 4096-element floor, a multiple of its blocks)."""
    pytest.importorskip(peer.module, reason=f"{peer.dist} is not installed (pip install '.[peers]')")
    inst = workloads.expand(["65536x4"], ["bf16"], [True], CPU, scaler=True)[0]
    opts = runner.Options(warmup=0, reps=2, max_seconds=1.0)
    out = runner.run([inst], [peers.PeerVariant(peer)], {"device": "cpu"}, opts)
    assert not out.failures, out.failures
    (row,) = out.rows
    # bf16 weights: off the fp32 reference by their roundings (a bf16 ulp is 2^-8 of the largest weight)
    assert 0 < float(row["weight_dev"]) < 0.05, row["weight_dev"]
    state = float(row["state_bytes_per_param"])
    assert (state < 2.5) if ("bit" in peer.name or "fp8" in peer.name) else (3.9 < state < 6.2), state


def test_flashoptim_needs_cuda():
    pytest.importorskip("flashoptim", reason="flashoptim is not installed (pip install '.[peers]')")
    inst, params, _, _ = _setup()
    flash = next(p for p in peers.PEERS if p.name == "flashoptim-adamw")
    with pytest.raises(Unavailable, match="CUDA"):
        peers.PeerVariant(flash).build(inst, params)


def test_lion_benchmark_times_the_installed_peers(tmp_path):
    """``python -m bench --optimizer lion`` on a tiny workload: torch's recipe, every FusedLion mode (each held
    against the reference before it is timed) and the installed peers, bitsandbytes' 8-bit Lion among them with
    its 1 + 4/256 bytes of state per parameter (flashoptim's FlashLion runs on CUDA only)."""
    r = subprocess.run([sys.executable, "-m", "bench", "--optimizer", "lion", "--device", "cpu", "--workloads",
                        "4kx2", "--max-seconds", "0.2", "--reps", "2", "--no-progress", "--out", str(tmp_path),
                        "--name", "t"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "t-lion.csv", newline="") as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert {"torch-lion-foreach", "ampfused-cpu", "ampfused-cpu+sr+q8m"} <= set(rows)
    assert "flashoptim-lion: CUDA only" in r.stdout
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        assert "bnb-lion8bit: not installed (pip install bitsandbytes)" in r.stdout
    else:
        assert float(rows["bnb-lion8bit"]["state_bytes_per_param"]) == round(1 + 4 / 256, 3)


def test_muon_benchmark_times_torch_recipe_and_fused_muon(tmp_path):
    """``python -m bench --optimizer muon`` on a tiny transformer: torch's recipe (Muon + AdamW, one scaler, one
    clip) and FusedMuon in fp32, bf16 with masters and bf16 with remainders, the fp32 one held against torch's
    recipe before anything is timed; the state each keeps per parameter."""
    r = subprocess.run([sys.executable, "-m", "bench", "--optimizer", "muon", "--device", "cpu", "--workloads",
                        "d16x1", "--max-seconds", "0.2", "--reps", "2", "--no-progress", "--out", str(tmp_path),
                        "--name", "t"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "t-muon.csv", newline="") as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    ours = {"torch-muon+adamw", "ampfused", "ampfused+bf16", "ampfused+bf16+rem"}
    # the passes alone beside FusedAdamW's step over the same matrices, each pair in GB/s of its bytes
    passes = {f"passes: {who}{mode}" for who in ("ampfused", "fused-adamw") for mode in ("+bf16", "+bf16+rem")}
    from ampfused import ops
    if ops.get_backend("cpu").has_step("muon_step_"):
        ours |= passes
        for name in passes:
            assert float(rows[name]["gb_per_s"]) > 0 and rows[name]["params"] == str(4 * 16 * 16 + 2 * 4 * 16 * 16)
    try:
        import heavyball  # noqa: F401
    except ImportError:
        assert set(rows) == ours and "heavyball-muon: not installed" in r.stdout
    else:  # (its check and row: test_muon_benchmark_times_heavyballs_muon_checked_against_its_own_math)
        assert set(rows) == ours | {"heavyball-muon"}, r.stdout
    n, mats = int(rows["ampfused"]["params"]), int(rows["ampfused"]["matrices"])
    assert (n, mats) == (4 * 16 * 16 + 2 * 4 * 16 * 16 + 4 * 16, 6)
    # torch's: one momentum (4 B) per matrix element, two AdamW moments (8 B) per vector element
    vec = 4 * 16
    assert float(rows["torch-muon+adamw"]["state_bytes_per_param"]) == round((4 * (n - vec) + 8 * vec) / n, 3)
    assert float(rows["ampfused+bf16+rem"]["state_bytes_per_param"]) < float(rows["ampfused+bf16"][
        "state_bytes_per_param"])


def _muon_model(width=16):
    from bench.step import muon
    return muon._model(muon.shapes(width, 1), torch.float32, CPU)


def _torch_muon_as_a_peer(params, scaled):
    """torch's Muon + AdamW on the bf16 parameters, run as the heavyball peer is: another rule than heavyball's."""
    from bench.step import muon
    mats = [p for p in params if p.dim() == 2]
    vecs = [p for p in params if p.dim() != 2]
    opts = (torch.optim.Muon(mats, lr=muon.LR, weight_decay=muon.WD), torch.optim.AdamW(vecs, lr=muon.AUX_LR))

    @torch.no_grad()
    def step():
        if scaled:
            torch._foreach_mul_([p.grad for p in params], 1.0 / muon.SCALE)
        torch.nn.utils.clip_grad_norm_(params, muon.MAX_NORM)
        for opt in opts:
            opt.step()
    return step


def test_muon_benchmark_times_heavyballs_muon_checked_against_its_own_math(tmp_path, monkeypatch):
    """heavyball's MuonAdamW (its own Newton-Schulz coefficients and Nesterov rule, not torch's) passes the check
    against its math written out in bench/step/muon.py, which refuses torch's Muon run in its place; its row keeps
    torch's state per parameter (fp32 momentum, fp32 AdamW moments, no master for its bf16 weights); its
    torch.compile is off on the CPU."""
    heavyball = pytest.importorskip("heavyball", reason="heavyball is not installed (pip install heavyball)")
    from bench.step import muon
    monkeypatch.setattr(heavyball.utils, "compile_mode", heavyball.utils.compile_mode)  # (restored after)
    base = _muon_model()
    for scaled in (True, False):
        assert muon._check_heavyball(base, scaled) is None
        assert heavyball.utils.compile_mode is None
        why = muon._check_heavyball(base, scaled, make=_torch_muon_as_a_peer)
        assert why is not None and why.startswith("tensor 0 (shape (16, 16)) is ") and "from its expectation" in why
    r = subprocess.run([sys.executable, "-m", "bench", "--optimizer", "muon", "--device", "cpu", "--workloads",
                        "d16x1", "--max-seconds", "0.2", "--reps", "2", "--no-progress", "--out", str(tmp_path),
                        "--name", "t"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MuonAdamW on the bf16 parameters, checked against its own math" in r.stdout
    assert "torch.compile off on the CPU" in r.stdout
    with open(tmp_path / "t-muon.csv", newline="") as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert float(rows["heavyball-muon"]["median_ms"]) > 0
    assert rows["heavyball-muon"]["state_bytes_per_param"] == rows["torch-muon+adamw"]["state_bytes_per_param"]


def test_muon_benchmark_reports_heavyball_absent(monkeypatch):
    from bench.step import muon
    monkeypatch.setitem(sys.modules, "heavyball", None)  # (import heavyball raises ImportError)
    assert muon._heavyball_absent().startswith("not installed (") and "pip install heavyball" in \
        muon._heavyball_absent()
