"""ampfused inside HF accelerate, against the real package: ``FusedAdamW`` built before ``prepare``, then
``ampfused.integrations.accelerate.fuse(accelerator)``.

Every run is checked step by step against the torch recipe fed the same gradients (DESIGN tolerance), and its
losses against the same script with ``torch.optim.AdamW``; the clip inside ``accelerator.clip_grad_norm_`` is
folded into the fused step (the operators of clip + step equal the plain ampfused loop's, with no host read);
``optimizer_step_was_skipped`` is true exactly on the steps whose gradients held an inf; ``save_state`` /
``load_state`` resume bit for bit. fp16: accelerate runs fp16 (autocast and its scaler) only on accelerators,
not on the CPU (there ``mixed_precision="fp16"`` silently trains in fp32), so the fp16 runs are ``gpu`` tests;
on the CPU the scaler path is run with an ``ampfused.GradScaler`` handed to ``fuse`` and fp16 autocast in the
script.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[integrations]')")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampfused  # noqa: E402
from ampfused.integrations.accelerate import fuse  # noqa: E402
from oracle import assert_bitwise  # noqa: E402
from shadow import (DEVICES, FP16_ULP, Shadow, assert_losses_match, assert_trains,  # noqa: E402
                    classification_data, kernel_calls, mlp)
from stepcount import StepCounter, host_reads  # noqa: E402

HYPER = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
GA, BATCH, STEPS = 4, 8, 50
INF_AT = (7, 23)  # optimizer steps whose gradients get an inf


def _fresh_state():
    """accelerate keeps its state in process-wide singletons; each run here builds its own Accelerator."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerator(device, **kw):
    _fresh_state()
    return Accelerator(cpu=device == "cpu", **kw)


def _run(opt_kind="fused", *, device="cpu", mixed_precision="bf16", scaler=None, fp16_autocast=False,
         steps=STEPS, inject=(), shadow=False, counter=None, report_skips=True, param_dtype=torch.float32):
    """The script: prepare, ``accumulate`` over GA micro-batches, ``backward``, ``clip_grad_norm_`` on sync steps,
    ``step``, ``zero_grad``. Returns losses, clip norms and skip answers per optimizer step, and the pieces."""
    model = mlp(param_dtype)
    opt = (ampfused.FusedAdamW(model.parameters(), **HYPER) if opt_kind == "fused" else
           torch.optim.AdamW(model.parameters(), **HYPER, fused=opt_kind == "torch-fused"))
    acc = _accelerator(device, mixed_precision=mixed_precision, gradient_accumulation_steps=GA)
    x, y = classification_data(steps * GA * BATCH)
    loader = torch.utils.data.DataLoader(list(zip(x, y)), batch_size=BATCH)
    model, opt, loader = acc.prepare(model, opt, loader)
    if opt_kind == "fused":
        fuse(acc, report_skips=report_skips, **({} if scaler is None else {"scaler": scaler}))
    fused = opt.optimizer
    check = Shadow(model.parameters(), HYPER, max_norm=1.0) if shadow else None
    autocast = (lambda: torch.autocast(device, dtype=torch.float16)) if fp16_autocast else contextlib.nullcontext
    out = dict(losses=[], norms=[], skipped=[], acc=acc, model=model, opt=opt, check=check)
    for xb, yb in loader:
        with acc.accumulate(model):
            with autocast():
                loss = nn.functional.cross_entropy(model(xb).float(), yb)
            acc.backward(loss)
            sync = acc.sync_gradients
            if sync:
                k = len(out["losses"])
                if k in inject:
                    next(model.parameters()).grad.view(-1)[3] = float("inf")
                if check is not None:
                    check.capture(1.0 / acc.scaler.get_scale() if acc.scaler is not None else 1.0)
                if counter is not None and k >= 1:  # the first step also builds the optimizer's buffers
                    counter.start()
                out["norms"].append(acc.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad()
            if sync:
                if counter is not None and k >= 1:
                    counter.stop()
                out["losses"].append(loss.item())
                if opt_kind == "fused":
                    out["skipped"].append(acc.optimizer_step_was_skipped)
                if check is not None:
                    skipped = check.step_and_check(fused, out["norms"][-1], where=f"step {k}")
                    assert out["skipped"][-1] == skipped, f"step {k}: skip reported {out['skipped'][-1]}"
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_accumulate_clip_step_match_the_torch_recipe_step_by_step(device):
    """bf16 autocast, 4 micro-batches per step, clip 1.0, two steps with an inf: every step within the DESIGN
    tolerance of the recipe fed the same gradients, the norm returned by accelerator.clip_grad_norm_ included;
    optimizer_step_was_skipped exactly on the inf steps."""
    run = _run(device=device, inject=INF_AT, shadow=True)
    assert run["skipped"] == [k in INF_AT for k in range(STEPS)]
    assert run["check"].steps == STEPS - len(INF_AT)
    assert all(bool(torch.isinf(run["norms"][k])) for k in INF_AT)
    assert_trains(run["losses"], "accelerate bf16")


def test_bf16_run_matches_the_same_script_with_torch_adamw():
    ours = _run()
    ref = _run("torch")
    alt = _run("torch-fused")
    assert_trains(ours["losses"], "accelerate bf16 ampfused")
    assert_losses_match(ours["losses"], ref["losses"], alt["losses"], "accelerate bf16")
    assert not any(ours["skipped"])


@pytest.mark.parametrize("device", DEVICES)
def test_clip_and_step_add_nothing_to_the_plain_ampfused_loop(device):
    """The operators of ``accelerator.clip_grad_norm_`` + ``step`` + ``zero_grad`` are those of the plain loop's
    ``ampfused.clip_grad_norm_`` + ``step`` + ``zero_grad``: one norm_check and one adam_step_, no clip pass, no
    host read (on CUDA: no host sync)."""
    counter = StepCounter(device)
    with counter.kernels_named():
        _run(device=device, steps=4, counter=counter)
    plain = StepCounter(device)
    model = mlp().to(device)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER)
    x, y = classification_data(4 * BATCH)
    with plain.kernels_named():
        for k in range(4):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x[k * BATCH:(k + 1) * BATCH].to(device)).float(),
                                                   y[k * BATCH:(k + 1) * BATCH].to(device))
            loss.backward()
            if k >= 1:
                plain.start()
            ampfused.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if k >= 1:
                plain.stop()
    for window in counter.windows:
        assert window == plain.windows[-1], (window, plain.windows[-1])
        assert kernel_calls(window) == {"ampfused::norm_check": 1, "ampfused::adam_step_": 1}
        assert host_reads(window) == 0
    if device == "cuda":
        assert counter.syncs == [0] * len(counter.windows), counter.sync_messages


def test_skip_answer_is_read_only_when_asked():
    """``optimizer_step_was_skipped`` reads the fused optimizer's flag when asked (one host read), never in the
    step; with report_skips=False it keeps accelerate's answer and reads nothing."""
    for report, reads in ((True, 1), (False, 0)):
        run = _run(steps=3, report_skips=report)
        acc = run["acc"]
        counter = StepCounter()
        counter.start()
        answer = acc.optimizer_step_was_skipped
        counter.stop()
        assert answer is False and host_reads(counter.windows[0]) == reads, (report, counter.windows[0])


def _save_resume(tmp_path, param_dtype, device="cpu", mixed_precision="bf16", scaler=None, autocast_fp16=False):
    """Train 6 steps, save_state, train 6 more; a fresh script load_state's and trains the same 6: bit for bit."""
    x, y = classification_data(12 * GA * BATCH)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]

    def script(load_from=None, save_to=None, start=0):
        model = mlp(param_dtype)
        opt = ampfused.FusedAdamW(model.parameters(), **HYPER)
        acc = _accelerator(device, mixed_precision=mixed_precision, gradient_accumulation_steps=GA)
        model, opt = acc.prepare(model, opt)
        fuse(acc, **({} if scaler is None else {"scaler": scaler()}))
        if load_from is not None:
            acc.load_state(load_from)
        ctx = (lambda: torch.autocast(device, dtype=torch.float16)) if autocast_fp16 else contextlib.nullcontext
        for k, (xb, yb) in enumerate(batches[start * GA:], start * GA):
            with acc.accumulate(model):
                with ctx():
                    loss = nn.functional.cross_entropy(model(xb.to(acc.device, param_dtype)).float(), yb.to(acc.device))
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            if save_to is not None and k + 1 == 6 * GA:
                acc.save_state(save_to)
        return model, opt.optimizer, acc

    ckpt = str(tmp_path / "state")
    model_a, opt_a, acc_a = script(save_to=ckpt)
    model_b, opt_b, acc_b = script(load_from=ckpt, start=6)
    for (n, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert_bitwise(f"param {n}", a.detach(), b.detach())
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert set(sa["state"][i]) == set(sb["state"][i])
        for key, v in sa["state"][i].items():
            assert_bitwise(f"state[{i}][{key}]", v, sb["state"][i][key])
    if param_dtype != torch.float32:
        assert all("master_param" in s for s in sa["state"].values())
    if acc_a.scaler is not None:
        assert acc_a.scaler.state_dict() == acc_b.scaler.state_dict()


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_save_state_load_state_resume_bit_for_bit(tmp_path, param_dtype):
    """fp32 parameters under bf16 autocast, and bf16 parameters (fp32 masters in the optimizer state)."""
    _save_resume(tmp_path, param_dtype, mixed_precision="bf16" if param_dtype == torch.float32 else "no")


# --- the loss scaler --------------------------------------------------------------------------------------
def _plain_torch_fp16(steps, inject, fused=False):
    """The reference for the CPU scaler runs: the plain torch loop, fp16 autocast, torch.amp.GradScaler."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    x, y = classification_data(steps * GA * BATCH)
    losses = []
    for k in range(steps):
        for j in range(GA):
            i = (k * GA + j) * BATCH
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x[i:i + BATCH]).float(), y[i:i + BATCH])
            scaler.scale(loss / GA).backward()
        if k in inject:
            next(model.parameters()).grad.view(-1)[3] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, scaler


def test_loss_scaler_on_cpu_through_fuse():
    """The fp16 machinery on the CPU: an ampfused.GradScaler handed to fuse() scales accelerator.backward, is
    unscaled once for the folded clip, steps and updates; the skips follow the overflows; the run matches the
    plain torch fp16 loop with torch.amp.GradScaler, and the recipe step by step."""
    mk = lambda: ampfused.GradScaler("cpu", init_scale=2.0 ** 12)  # noqa: E731
    run = _run(mixed_precision="no", scaler=mk(), fp16_autocast=True, inject=INF_AT, shadow=True)
    assert run["skipped"] == [k in INF_AT for k in range(STEPS)]
    ref_losses, ref_scaler = _plain_torch_fp16(STEPS, INF_AT)
    alt = _run(mixed_precision="no", scaler=mk(), fp16_autocast=True, inject=INF_AT)
    assert alt["losses"] == run["losses"]  # the shadow only reads
    assert run["acc"].scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 10  # backed off once per inf
    assert_trains(run["losses"], "accelerate fp16 scaler")
    alt_losses, _ = _plain_torch_fp16(STEPS, INF_AT, fused=True)
    assert_losses_match(run["losses"], ref_losses, alt_losses, "accelerate fp16 scaler vs plain torch", FP16_ULP)


def test_loss_scaler_resume_bit_for_bit(tmp_path):
    _save_resume(tmp_path, torch.float32, mixed_precision="no",
                 scaler=lambda: ampfused.GradScaler("cpu", init_scale=2.0 ** 12), autocast_fp16=True)


@pytest.mark.gpu
@pytest.mark.parametrize("scaler", ["ampfused", "keep"])
def test_fp16_on_cuda_with_the_accelerator_scaler(scaler):
    """accelerate's own fp16 (autocast + its scaler, kept or replaced by ampfused.GradScaler): the recipe step by
    step, skips on the inf steps, the torch script's losses, and no host sync in clip + step."""
    run = _run(device="cuda", mixed_precision="fp16", scaler=scaler, inject=INF_AT, shadow=True)
    assert isinstance(run["acc"].scaler, ampfused.GradScaler) == (scaler == "ampfused")
    # the inf steps are skipped; so is any step whose fp16 gradients overflowed on their own (the run checks each
    # step's answer against the gradients it captured)
    assert all(run["skipped"][k] for k in INF_AT) and run["check"].skips == sum(run["skipped"])
    ref = _run("torch", device="cuda", mixed_precision="fp16", inject=INF_AT)
    alt = _run("torch-fused", device="cuda", mixed_precision="fp16", inject=INF_AT)
    assert_trains(run["losses"], "accelerate fp16 cuda")
    assert_losses_match(run["losses"], ref["losses"], alt["losses"], "accelerate fp16 cuda", FP16_ULP)
    if scaler == "ampfused":
        counter = StepCounter("cuda")
        with counter.kernels_named():
            _run(device="cuda", mixed_precision="fp16", steps=4, counter=counter)
        assert counter.syncs == [0] * len(counter.windows), counter.sync_messages


@pytest.mark.gpu
def test_fp16_resume_on_cuda(tmp_path):
    _save_resume(tmp_path, torch.float32, device="cuda", mixed_precision="fp16")


# --- what fuse() refuses, and the clip it cannot fold ----------------------------------------------------
def test_fuse_checks_its_arguments():
    acc = _accelerator("cpu")
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        fuse(object())
    with pytest.raises(ValueError, match="scaler must be 'ampfused', 'keep' or a GradScaler"):
        fuse(acc, scaler="torch")
    with pytest.raises(TypeError, match="report_skips must be a bool"):
        fuse(acc, report_skips=1)
    assert fuse(acc) is acc and isinstance(acc, Accelerator)


def test_clip_of_other_parameters_runs_its_own_pass_and_says_why():
    """A clip over parameters that are not exactly one fused optimizer's cannot be folded: it is done (right)
    in a pass of its own, with a warning naming the rule; a norm other than L2 likewise."""
    model = mlp()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER)
    acc = _accelerator("cpu")
    model, opt = acc.prepare(model, opt)
    fuse(acc)
    x, y = classification_data(BATCH)
    nn.functional.cross_entropy(model(x), y).backward()
    some = list(model.parameters())[:2]
    copies = [p.detach().clone() for p in some]
    for c, p in zip(copies, some):
        c.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.1)
    from ampfused.integrations import _common
    _common._warned.clear()
    with pytest.warns(UserWarning, match="not exactly the parameters .* of one fused ampfused optimizer"):
        norm = acc.clip_grad_norm_(some, 0.1)
    torch.testing.assert_close(norm, expected)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in some])) <= 0.1 * (1 + 1e-5)
    with pytest.warns(UserWarning, match="norm_type=inf cannot be folded"):
        acc.clip_grad_norm_(model.parameters(), 1e9, norm_type=float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.clip_grad_norm_(model.parameters(), 1.0)  # exactly the optimizer's: folded, no warning


def test_fused_muon_with_its_adamw_groups_through_accelerate():
    """FusedMuon (Muon for the matrices, AdamW for the biases, one optimizer) prepared by accelerate and fused:
    bf16 autocast, 4 micro-batches, the clip folded into the step, two steps with an inf skipped (and reported as
    skipped) in every group, and the loss falling as it falls in the same script with torch's recipe (torch's Muon +
    AdamW, two optimizers, torch's clip, no inf injected)."""
    def losses(kind):
        model = mlp()
        mats = [p for p in model.parameters() if p.dim() == 2]
        vecs = [p for p in model.parameters() if p.dim() != 2]
        if kind == "fused":
            opts = [ampfused.FusedMuon([dict(params=mats), dict(params=vecs, use_muon=False, lr=3e-3)], lr=0.02)]
        else:
            opts = [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(vecs, lr=3e-3)]
        acc = _accelerator("cpu", mixed_precision="bf16", gradient_accumulation_steps=GA)
        x, y = classification_data(STEPS * GA * BATCH)
        loader = torch.utils.data.DataLoader(list(zip(x, y)), batch_size=BATCH)
        model, *rest = acc.prepare(model, *opts, loader)
        opts, loader = rest[:-1], rest[-1]
        if kind == "fused":
            fuse(acc)
        out, skipped = [], []
        for xb, yb in loader:
            with acc.accumulate(model):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(xb).float(), yb)
                acc.backward(loss)
                if acc.sync_gradients:
                    if kind == "fused" and len(out) in INF_AT:
                        mats[0].grad.view(-1)[3] = float("inf")
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
                if acc.sync_gradients:
                    out.append(loss.item())
                    if kind == "fused":
                        skipped.append(acc.optimizer_step_was_skipped)
        return out, skipped

    ours, skipped = losses("fused")
    ref, _ = losses("torch")
    assert skipped == [k in INF_AT for k in range(STEPS)]
    assert_trains(ours, "accelerate FusedMuon")
    assert_trains(ref, "accelerate torch Muon + AdamW")
