"""ampfused inside the transformers ``Trainer``, against the real package: a tiny GPT-2 built from a config (its
``lm_head`` tied to the embedding), ``FusedAdamW`` built before ``Trainer(...)`` and given as
``optimizers=(opt, None)`` or by ``optimizer_cls_and_kwargs``, then ``ampfused.integrations.transformers.fuse
(trainer)``; ``bf16=True, use_cpu=True, max_grad_norm=1.0, gradient_accumulation_steps=4``.

Each run is checked step by step against the torch recipe fed the same gradients (DESIGN tolerance), and its
losses against the same script with ``torch.optim.AdamW``; from the Trainer's clip to the end of its step
(scheduler and zero_grad included) the operators are the plain ampfused loop's, with no host read;
``resume_from_checkpoint`` continues bit for bit (model, optimizer with its fp32 masters, scheduler), and the
model written by ``save_model()`` reloads equal. fp16 needs a GPU in the Trainer: those runs are ``gpu`` tests.
``FusedMuon`` (Muon for the blocks' matrices, AdamW for the embeddings, norms and biases, one optimizer) runs the
same way, checked step by step against a hand-built FusedMuon fed the same gradients, bit for bit
(tests/integrations/muon_shadow.py).
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install -e '.[integrations]')")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e '.[integrations]')")

import ampfused  # noqa: E402
from ampfused.integrations.transformers import fuse  # noqa: E402
from muon_shadow import MuonShadow, muon_groups  # noqa: E402
from oracle import assert_bitwise  # noqa: E402
from shadow import DEVICES, FP16_ULP, Shadow, assert_losses_match, assert_trains, kernel_calls  # noqa: E402
from stepcount import StepCounter, host_reads, step_launches  # noqa: E402

HYPER = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.0)
GA, BATCH, STEPS = 4, 2, 50
INF_AT = (7, 23)
FUSED = ["fused", "muon"]  # FusedAdamW, FusedMuon


def _hidden(name, p):
    """Muon's parameters in GPT-2: the blocks' matrices (attention and MLP); the embeddings (the head tied to
    one), the LayerNorms and the biases are AdamW's."""
    return name.startswith("transformer.h.") and p.dim() == 2


def _gpt2(param_dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).to(param_dtype)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def _data(steps):
    """Arithmetic progressions mod 64 (random start, stride 1 to 3): a next token the model can learn."""
    g = torch.Generator().manual_seed(0)
    n = steps * GA * BATCH
    start = torch.randint(0, 64, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return [{"input_ids": ids, "labels": ids} for ids in (start + stride * torch.arange(16)) % 64]


class _Probe(transformers.TrainerCallback):
    """Test instrumentation at the Trainer's seams: the accelerator's clip (infs injected, gradients captured,
    counting window opened), on_optimizer_step (the recipe's check), on_step_end (window closed)."""

    def __init__(self, inject=(), shadow=False, counter=None):
        self.inject, self.want_shadow, self.counter = inject, shadow, counter
        self.shadow, self.trainer, self.norms, self.skipped = None, None, [], []

    def attach(self, trainer):
        self.trainer = trainer
        acc = trainer.accelerator
        clip = acc.clip_grad_norm_

        def probed_clip(parameters, max_norm, norm_type=2):
            params = list(parameters)
            k = trainer.state.global_step
            if k in self.inject:
                params[0].grad.view(-1)[3] = float("inf")
            if self.want_shadow:
                fused = trainer.optimizer.optimizer
                if self.shadow is None and isinstance(fused, ampfused.FusedMuon):
                    self.shadow = MuonShadow(fused, max_norm=max_norm)
                elif self.shadow is None:
                    self.shadow = Shadow(trainer.model.parameters(), HYPER, max_norm=max_norm)
                self.shadow.capture(1.0 / acc.scaler.get_scale() if acc.scaler is not None else 1.0)
            if self.counter is not None and k >= 1:
                self.counter.start()
            norm = clip(params, max_norm, norm_type)
            self.norms.append(norm)
            return norm

        acc.clip_grad_norm_ = probed_clip

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        fused = self.trainer.optimizer.optimizer
        if not isinstance(fused, (ampfused.FusedAdamW, ampfused.FusedMuon)) or self.counter is not None:
            return  # (nothing read while counting)
        self.skipped.append(bool(fused.last_step_skipped))
        if isinstance(self.shadow, MuonShadow):
            k = state.global_step
            assert self.shadow.step_and_check(fused, where=f"step {k}") == self.skipped[-1], f"step {k}"
        elif self.shadow is not None:
            k = state.global_step
            skipped = self.shadow.step_and_check(fused, self.norms[-1], where=f"step {k}",
                                                 lr=fused.param_groups[0]["lr"])
            assert skipped == self.skipped[-1], f"step {k}"

    def on_step_end(self, args, state, control, **kw):
        if self.counter is not None and state.global_step >= 2:
            self.counter.stop()


def _train(kind="fused", *, steps=STEPS, device="cpu", param_dtype=torch.float32, precision="bf16", by_class=False,
           out=None, save_steps=None, resume=None, exact_skips=False, scaler="ampfused", probe=None,
           schedule="linear", model=None):
    model = _gpt2(param_dtype) if model is None else model
    if kind == "fused":
        opt_cls, kw = ampfused.FusedAdamW, dict(HYPER)
    elif kind == "muon":
        opt_cls, kw = ampfused.FusedMuon, {}
    else:
        opt_cls, kw = torch.optim.AdamW, dict(HYPER, fused=kind == "torch-fused")
    optimizers, cls_and_kwargs = (None, None), None
    if by_class:
        cls_and_kwargs = (opt_cls, kw)  # the Trainer passes only the parameter groups
    else:
        params = muon_groups(model.named_parameters(), _hidden, HYPER) if kind == "muon" else model.parameters()
        optimizers = (opt_cls(params, **kw), None)  # built before Trainer(...), on the CPU model
    args = transformers.TrainingArguments(
        output_dir=out or "/tmp/ampfused-trainer-tests", max_steps=steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GA, learning_rate=HYPER["lr"], weight_decay=HYPER["weight_decay"],
        max_grad_norm=1.0, lr_scheduler_type=schedule, warmup_steps=2 if schedule == "linear" else 0, seed=0,
        logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=device == "cpu",
        bf16=precision == "bf16", fp16=precision == "fp16",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, save_only_model=False)
    extra = {} if cls_and_kwargs is None else {"optimizer_cls_and_kwargs": cls_and_kwargs}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(steps), optimizers=optimizers,
                                   callbacks=[probe] if probe is not None else None, **extra)
    if kind in FUSED:
        fuse(trainer, exact_skips=exact_skips, scaler=scaler)
    if probe is not None:
        probe.attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_accumulate_clip_match_the_torch_recipe_step_by_step(device):
    """optimizers=(FusedAdamW, None): every step within the DESIGN tolerance of the recipe fed the same
    gradients, the clip norm the Trainer logs within the error bound of an fp32 norm summed in any order by the
    backend's scheme (tests/norm_bound.py, derived there), skipped exactly on the inf steps."""
    probe = _Probe(inject=INF_AT, shadow=True)
    trainer, losses = _train(device=device, probe=probe)
    assert probe.skipped == [k in INF_AT for k in range(STEPS)]
    assert probe.shadow.steps == STEPS - len(INF_AT)
    assert_trains(losses, "Trainer bf16")
    assert next(trainer.model.parameters()).device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_fused_muon_steps_are_a_hand_built_fused_muons_bit_for_bit(device):
    """optimizers=(FusedMuon, None), Muon for the blocks' matrices and AdamW for the rest: the Trainer's clip
    (max_grad_norm=1.0, active on 15 of the 50 steps) folded into the step, 4 micro-batches, its warmup
    schedule; every step the bits of a FusedMuon fed the same gradients at the same lr with max_grad_norm=1.0
    (weights, state, clip norm), skipped exactly on the inf steps in every group; the loss falls."""
    probe = _Probe(inject=INF_AT, shadow=True)
    trainer, losses = _train("muon", device=device, probe=probe)
    assert [g.get("use_muon", True) for g in trainer.optimizer.optimizer.param_groups] == [True, False]
    assert probe.skipped == [k in INF_AT for k in range(STEPS)]
    assert probe.shadow.steps == STEPS - len(INF_AT) and probe.shadow.skips == len(INF_AT)
    assert sum(1.0 < n < float("inf") for n in probe.shadow.norms) >= 10  # the clip was active
    assert_trains(losses, "Trainer bf16 FusedMuon")


def test_bf16_matches_the_same_script_with_torch_adamw():
    _, ours = _train()
    _, ref = _train("torch")
    _, alt = _train("torch-fused")
    assert_trains(ours, "Trainer bf16")
    assert_losses_match(ours, ref, alt, "Trainer bf16")


def test_optimizer_cls_and_kwargs_matches_torch():
    """The Trainer builds FusedAdamW itself, with its weight-decay groups (weight_decay=0.1 on the matrices)."""
    if "optimizer_cls_and_kwargs" not in inspect.signature(transformers.Trainer.__init__).parameters:
        pytest.skip(f"transformers {transformers.__version__} has no optimizer_cls_and_kwargs")
    global HYPER
    saved, HYPER = HYPER, dict(HYPER, weight_decay=0.1)
    try:
        trainer, ours = _train(by_class=True)
        _, ref = _train("torch", by_class=True)
        _, alt = _train("torch-fused", by_class=True)
    finally:
        HYPER = saved
    fused = trainer.optimizer.optimizer
    assert isinstance(fused, ampfused.FusedAdamW)
    assert [g["weight_decay"] for g in fused.param_groups] == [0.1, 0.0]
    assert_trains(ours, "Trainer optimizer_cls_and_kwargs")
    assert_losses_match(ours, ref, alt, "Trainer optimizer_cls_and_kwargs")


def _plain_window(device, steps=4, kind="fused"):
    """The plain ampfused loop's clip, step, scheduler step and zero_grad, on the same model."""
    model = _gpt2().to(device)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER) if kind == "fused" else \
        ampfused.FusedMuon(muon_groups(model.named_parameters(), _hidden, HYPER))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / 100)  # a new lr every step, as the Trainer's
    counter = StepCounter(device)
    data = _data(steps)
    with counter.kernels_named():
        for k in range(steps):
            ids = torch.stack([d["input_ids"] for d in data[k * BATCH:(k + 1) * BATCH]]).to(device)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if k >= 1:
                counter.start()
            ampfused.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            model.zero_grad()
            if k >= 1:
                counter.stop()
    return counter.windows[-1]


@pytest.mark.parametrize("kind", FUSED)
@pytest.mark.parametrize("device", DEVICES)
def test_step_adds_nothing_to_the_plain_ampfused_loop(device, kind):
    """From the Trainer's clip to the end of its step (skip check, scheduler, zero_grad included): the
    operators of the plain loop, one norm_check and one adam_step_ (FusedMuon: one muon_step_ and one
    adam_step_, its AdamW group's), no host read (on CUDA: no host sync). exact_skips=True adds exactly the one
    host read of the skip flag."""
    plain = _plain_window(device, kind=kind)
    steps = {"ampfused::adam_step_": 1} if kind == "fused" else {
        "ampfused::muon_step_": step_launches("muon_step_", device), "ampfused::adam_step_": 1}
    for exact, reads in ((False, 0), (True, 1)):
        counter = StepCounter(device)
        with counter.kernels_named():
            _train(kind, steps=4, device=device, probe=_Probe(counter=counter), exact_skips=exact)
        assert len(counter.windows) == 3
        for window in counter.windows:
            assert kernel_calls(window) == {"ampfused::norm_check": 1, **steps}
            assert host_reads(window) == reads, window
            if not exact:
                assert window == plain, (window, plain)
        if device == "cuda":
            assert counter.syncs == [reads] * 3, counter.sync_messages


def test_scheduler_on_skipped_steps():
    """By default the scheduler advances on every optimizer step (nothing read); exact_skips=True holds it
    back on the steps the fused optimizer skipped."""
    trainer, _ = _train(steps=12, probe=_Probe(inject=(3, 5)))
    assert trainer.lr_scheduler.last_epoch == 12
    trainer, _ = _train(steps=12, probe=_Probe(inject=(3, 5)), exact_skips=True)
    assert trainer.lr_scheduler.last_epoch == 10


@pytest.mark.parametrize("kind", FUSED)
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_resume_from_checkpoint_bit_for_bit_and_save_model_reloads(tmp_path, param_dtype, kind):
    """An uninterrupted 12-step run saves checkpoint-6; a fresh model, optimizer and Trainer resumed from it
    end bitwise where the uninterrupted run ended (weights, optimizer state with the fp32 masters of bf16
    weights, FusedMuon's momentum and its AdamW group's moments, scheduler), with the same losses; save_model()
    writes a model that reloads equal and tied."""
    out_a, out_b = str(tmp_path / "a"), str(tmp_path / "b")
    ta, la = _train(kind, steps=12, param_dtype=param_dtype, out=out_a, save_steps=6, probe=_Probe(inject=(8,)))
    tb, lb = _train(kind, steps=12, param_dtype=param_dtype, out=out_b, resume=os.path.join(out_a, "checkpoint-6"),
                    probe=_Probe(inject=(8,)))
    assert len(la) == 12 and la == lb  # the resumed log_history starts with the checkpoint's 6 steps
    for (n, a), b in zip(ta.model.named_parameters(), tb.model.parameters()):
        assert_bitwise(f"param {n}", a.detach(), b.detach())
    sa, sb = ta.optimizer.state_dict(), tb.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for key, v in sa["state"][i].items():
            assert_bitwise(f"state[{i}][{key}]", v, sb["state"][i][key])
    if param_dtype != torch.float32:
        assert all("master_param" in s for s in sa["state"].values())
    assert ta.lr_scheduler.state_dict() == tb.lr_scheduler.state_dict()

    tb.save_model(str(tmp_path / "final"))
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"), dtype=param_dtype)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    mine = tb.model.state_dict()
    for name, t in reloaded.state_dict().items():
        assert_bitwise(f"reloaded {name}", t, mine[name])


@pytest.mark.gpu
@pytest.mark.parametrize("scaler", ["ampfused", "keep"])
def test_fp16_on_cuda(scaler):
    """fp16=True: the Trainer's accelerator scaler (replaced by ampfused.GradScaler, or kept): the recipe step
    by step, skips on the inf steps, the torch script's losses; no host sync from clip to step end."""
    probe = _Probe(inject=INF_AT, shadow=True)
    trainer, _ = _train(device="cuda", precision="fp16", scaler=scaler, probe=probe)
    assert isinstance(trainer.accelerator.scaler, ampfused.GradScaler) == (scaler == "ampfused")
    # the inf steps are skipped; so is any step whose fp16 gradients overflowed on their own (each step's answer
    # is checked against the gradients the probe captured)
    assert all(probe.skipped[k] for k in INF_AT) and probe.shadow.skips == sum(probe.skipped)
    # torch's scaler holds the scheduler back on the steps it skips; exact_skips=True does the same here
    _, ours = _train(device="cuda", precision="fp16", scaler=scaler, exact_skips=True, probe=_Probe(inject=INF_AT))
    _, ref = _train("torch", device="cuda", precision="fp16", probe=_Probe(inject=INF_AT))
    _, alt = _train("torch-fused", device="cuda", precision="fp16", probe=_Probe(inject=INF_AT))
    assert_trains(ours, "Trainer fp16")
    assert_losses_match(ours, ref, alt, "Trainer fp16", FP16_ULP)
    if scaler == "ampfused":
        counter = StepCounter("cuda")
        with counter.kernels_named():
            _train(steps=4, device="cuda", precision="fp16", probe=_Probe(counter=counter))
        assert counter.syncs == [0] * 3, counter.sync_messages


def test_fuse_checks_its_arguments():
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer"):
        fuse(object())
    args = transformers.TrainingArguments(output_dir="/tmp/ampfused-trainer-tests", use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=_gpt2(), args=args)
    with pytest.raises(TypeError, match="exact_skips must be a bool"):
        fuse(trainer, exact_skips="yes")
    assert fuse(trainer) is trainer


def test_health_numbers_join_the_trainers_log_lines():
    model = _gpt2()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, backend="reference", health=True)
    args = transformers.TrainingArguments(
        output_dir="/tmp/ampfused-trainer-tests", max_steps=3, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GA, max_grad_norm=1.0, logging_steps=1, report_to=[], disable_tqdm=True,
        use_cpu=True, bf16=True, save_strategy="no")
    trainer = fuse(transformers.Trainer(model=model, args=args, train_dataset=_data(3), optimizers=(opt, None)))
    trainer.train()
    lines = [h for h in trainer.state.log_history if "loss" in h]
    assert len(lines) == 3 and all("health/group0/update_to_weight" in h for h in lines)
    last, h = lines[-1], opt.health()[0]
    for name in ("grad_norm", "update_norm", "weight_norm", "stagnant", "nonfinite"):
        assert last[f"health/group0/{name}"] == float(h[name]), name
    assert last["health/group0/grad_norm"] > 0 and last["health/group0/update_norm"] > 0
    assert "health/group0/grad_norm" not in trainer.state.log_history[-1]  # (the run's summary line)
