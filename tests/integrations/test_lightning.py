"""ampfused inside PyTorch Lightning, against the real package: ``configure_optimizers`` returns ``FusedAdamW``
(or ``FusedMuon``: Muon for the hidden matrices, AdamW for the head and the biases, one optimizer) and the
Trainer gets ``plugins=[FusedMixedPrecision(...)]`` in place of ``precision=...`` (Lightning's own
``MixedPrecision`` refuses ``gradient_clip_val`` for optimizers that unscale in their step).

Each run is checked step by step against the torch recipe fed the same gradients (DESIGN tolerance), and its
losses against the same script with ``torch.optim.AdamW`` and Lightning's own precision; the clip is folded
into the fused step (the operators from ``on_before_optimizer_step`` to the end of the step equal the plain
ampfused loop's, no host read); a checkpoint resumed with ``ckpt_path=`` continues bit for bit. Lightning runs
``precision="16-mixed"`` on the CPU only through a plugin (``precision="16-mixed"`` itself turns into bf16 there),
which is what these runs use. The FusedMuon runs are checked step by step against a hand-built FusedMuon fed the
same gradients, bit for bit (tests/integrations/muon_shadow.py), and resume bit for bit too.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

try:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision
except ImportError:
    L = pytest.importorskip("pytorch_lightning", reason="neither lightning nor pytorch_lightning is installed "
                            "(pip install -e '.[integrations]')")
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.plugins.precision import MixedPrecision

import ampfused  # noqa: E402
from ampfused.integrations.lightning import FusedMixedPrecision  # noqa: E402
from muon_shadow import MuonShadow, muon_groups  # noqa: E402
from oracle import assert_bitwise  # noqa: E402
from shadow import (DEVICES, FP16_ULP, Shadow, assert_losses_match, assert_trains,  # noqa: E402
                    classification_data, kernel_calls, mlp)
from stepcount import StepCounter, host_reads, step_launches  # noqa: E402

HYPER = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
GA, BATCH, STEPS = 4, 8, 50
INF_AT = (7, 23)
OPTIMIZERS = ["fused", "muon"]  # FusedAdamW, FusedMuon


def _hidden(name, p):
    """Muon's parameters in the mlp: its matrices but the output head (``4.weight``)."""
    return p.dim() == 2 and not name.startswith("4.")


class Model(L.LightningModule):
    """The user's module; the test instruments it through the hooks Lightning calls around the step."""

    def __init__(self, opt_kind="fused", param_dtype=torch.float32, inject=(), shadow=False, counter=None):
        super().__init__()
        self.net = mlp(param_dtype)
        self.opt_kind, self.inject, self.want_shadow, self.counter = opt_kind, inject, shadow, counter
        self.losses, self.skipped, self.shadow, self._loss = [], [], None, None

    def forward(self, x):
        return self.net(x.to(next(self.net.parameters()).dtype))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self._loss = loss.detach()
        return loss

    def configure_optimizers(self):
        if self.opt_kind == "fused":
            return ampfused.FusedAdamW(self.parameters(), **HYPER)
        if self.opt_kind == "muon":
            return ampfused.FusedMuon(muon_groups(self.net.named_parameters(), _hidden, HYPER))
        return torch.optim.AdamW(self.parameters(), **HYPER, foreach=self.opt_kind == "torch")

    def on_after_backward(self):
        # every micro-batch of the step's accumulation window, before any unscale: the step's gradients overflow
        if len(self.losses) in self.inject:
            next(self.parameters()).grad.view(-1)[3] = float("inf")

    def on_before_optimizer_step(self, optimizer):
        k = len(self.losses)
        if self.want_shadow:
            if self.shadow is None and self.opt_kind == "muon":
                self.shadow = MuonShadow(_fused(optimizer), max_norm=self.trainer.gradient_clip_val)
            elif self.shadow is None:
                self.shadow = Shadow(self.parameters(), HYPER, max_norm=self.trainer.gradient_clip_val)
            scaler = self.trainer.precision_plugin.scaler
            self.shadow.capture(1.0 / scaler.get_scale() if scaler is not None else 1.0)
        if self.counter is not None and k >= 1:
            self.counter.start()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        k = len(self.losses)
        if self.counter is not None and k >= 1:
            self.counter.stop()
        self.losses.append(self._loss.item())
        if self.opt_kind in OPTIMIZERS:
            fused = _fused(optimizer)
            self.skipped.append(bool(fused.last_step_skipped))
            if isinstance(self.shadow, MuonShadow):
                assert self.shadow.step_and_check(fused, where=f"step {k}") == self.skipped[-1], f"step {k}"
            elif self.shadow is not None:
                skipped = self.shadow.step_and_check(fused, fused.last_grad_norm, where=f"step {k}")
                assert self.skipped[-1] == skipped, f"step {k}"


def _fused(optimizer):
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer  # (Lightning's wrapper)


def _loader(steps=STEPS):
    x, y = classification_data(steps * GA * BATCH)
    return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=BATCH)


def _trainer(device="cpu", *, precision=None, plugins=None, steps=STEPS, **kw):
    args = dict(max_steps=steps, gradient_clip_val=1.0, accumulate_grad_batches=GA, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                accelerator=device, devices=1, num_sanity_val_steps=0)
    args.update(kw)
    if plugins is not None:
        args["plugins"] = plugins
    else:
        args["precision"] = precision
    return L.Trainer(**args)


def _fit(model, trainer, steps=STEPS, ckpt_path=None):
    trainer.fit(model, _loader(steps), ckpt_path=ckpt_path)
    return model


def _fp16(device, scaler="ampfused"):
    s = ampfused.GradScaler(device, init_scale=2.0 ** 12) if scaler == "ampfused" else \
        torch.amp.GradScaler(device, init_scale=2.0 ** 12)
    return FusedMixedPrecision("16-mixed", device, scaler=s)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_mixed_clip_accumulate_match_the_torch_recipe_step_by_step(device):
    """bf16-mixed, gradient_clip_val=1.0, accumulate_grad_batches=4, infs on two steps: each step within the
    DESIGN tolerance of the recipe fed the same gradients, the norm included, skipped exactly on the inf steps."""
    plugin = FusedMixedPrecision("bf16-mixed", device)
    model = _fit(Model(inject=INF_AT, shadow=True), _trainer(device, plugins=[plugin]))
    assert model.skipped == [k in INF_AT for k in range(STEPS)]
    assert model.shadow.steps == STEPS - len(INF_AT)
    assert_trains(model.losses, "lightning bf16-mixed")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_muon_steps_are_a_hand_built_fused_muons_bit_for_bit(device, precision):
    """FusedMuon (Muon for the hidden matrices, AdamW for the head and the biases, one optimizer) through the
    plugin: gradient_clip_val=0.3 folded into its step (active on most steps: the norms run 0.3 to 1), 4
    micro-batches, infs on two steps (16-mixed: the gradients unscaled by the scaler's scale); each step the bits
    of a FusedMuon fed the same gradients with max_grad_norm=0.3 (weights, state, clip norm), skipped exactly on
    the inf steps in every group; the loss falls."""
    plugin = _fp16(device) if precision == "16-mixed" else FusedMixedPrecision("bf16-mixed", device)
    model = _fit(Model("muon", inject=INF_AT, shadow=True), _trainer(device, plugins=[plugin],
                                                                    gradient_clip_val=0.3))
    assert model.skipped == [k in INF_AT for k in range(STEPS)]
    assert model.shadow.steps == STEPS - len(INF_AT) and model.shadow.skips == len(INF_AT)
    assert sum(0.3 < n < float("inf") for n in model.shadow.norms) > STEPS // 2  # the clip was active
    assert_trains(model.losses, f"lightning FusedMuon {precision}")


def test_bf16_mixed_matches_the_same_script_with_torch_adamw():
    ours = _fit(Model(), _trainer(plugins=[FusedMixedPrecision("bf16-mixed", "cpu")]))
    ref = _fit(Model("torch"), _trainer(precision="bf16-mixed"))
    # Lightning refuses gradient_clip_val for torch's fused AdamW too: the other summation order is the
    # single-tensor implementation
    alt = _fit(Model("torch-single"), _trainer(precision="bf16-mixed"))
    assert_trains(ours.losses, "lightning bf16-mixed")
    assert_losses_match(ours.losses, ref.losses, alt.losses, "lightning bf16-mixed")


@pytest.mark.parametrize("scaler", ["ampfused", "torch"])
@pytest.mark.parametrize("device", DEVICES)
def test_16_mixed_matches_torch_and_the_recipe(device, scaler):
    """16-mixed through the plugin, with an ampfused.GradScaler or with torch's (Lightning's own default): the
    recipe step by step (gradients unscaled by the scaler's scale), skips and scale back-offs on the inf steps,
    and the losses of the same script with torch.optim.AdamW and torch.amp.GradScaler in Lightning's own
    MixedPrecision."""
    ours = _fit(Model(inject=INF_AT, shadow=True), _trainer(device, plugins=[_fp16(device, scaler)]))
    assert ours.skipped == [k in INF_AT for k in range(STEPS)]
    ref_plugin = MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, init_scale=2.0 ** 12))
    ref = _fit(Model("torch", inject=INF_AT), _trainer(device, plugins=[ref_plugin]))
    alt_plugin = MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, init_scale=2.0 ** 12))
    alt = _fit(Model("torch-single", inject=INF_AT), _trainer(device, plugins=[alt_plugin]))
    assert ours.trainer.precision_plugin.scaler.get_scale() == ref_plugin.scaler.get_scale() == 2.0 ** 10
    assert_trains(ours.losses, "lightning 16-mixed")
    assert_losses_match(ours.losses, ref.losses, alt.losses, "lightning 16-mixed", FP16_ULP)


def _plain_window(device, precision, steps=4, opt_kind="fused"):
    """The plain ampfused loop's clip + step (with the scaler: unscale_, clip, step, update)."""
    counter = StepCounter(device)
    model = mlp().to(device)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER) if opt_kind == "fused" else \
        ampfused.FusedMuon(muon_groups(model.named_parameters(), _hidden, HYPER))
    scaler = ampfused.GradScaler(device, init_scale=2.0 ** 12) if precision == "16-mixed" else None
    x, y = classification_data(steps * BATCH)
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    with counter.kernels_named():
        for k in range(steps):
            with torch.autocast(device, dtype=dtype):
                loss = nn.functional.cross_entropy(model(x[k * BATCH:(k + 1) * BATCH].to(device)).float(),
                                                   y[k * BATCH:(k + 1) * BATCH].to(device))
            (scaler.scale(loss) if scaler else loss).backward()
            if k >= 1:
                counter.start()
            if scaler:
                scaler.unscale_(opt)
            ampfused.clip_grad_norm_(model.parameters(), 1.0)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if k >= 1:
                counter.stop()
            opt.zero_grad()
    return counter.windows[-1]


@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("device", DEVICES)
def test_clip_and_step_add_nothing_to_the_plain_ampfused_loop(device, precision, opt_kind):
    """From on_before_optimizer_step to the end of the step, Lightning with the plugin dispatches the operators
    of the plain loop's clip + step: one norm_check (or unscale_, with the scaler) and one adam_step_ (FusedMuon:
    one muon_step_ and one adam_step_, its AdamW group's), no clip pass, no host read (on CUDA: no host sync)."""
    counter = StepCounter(device)
    plugin = _fp16(device) if precision == "16-mixed" else FusedMixedPrecision("bf16-mixed", device)
    with counter.kernels_named():
        _fit(Model(opt_kind, counter=counter), _trainer(device, plugins=[plugin], steps=4), steps=4)
    plain = _plain_window(device, precision, opt_kind=opt_kind)
    first = "ampfused::unscale_" if precision == "16-mixed" else "ampfused::norm_check"
    steps = {"ampfused::adam_step_": 1} if opt_kind == "fused" else {
        "ampfused::muon_step_": step_launches("muon_step_", device), "ampfused::adam_step_": 1}
    assert len(counter.windows) == 3
    for window in counter.windows:
        assert window == plain, (window, plain)
        calls = kernel_calls(window)
        assert calls.get(first) == 1 and {k: calls.get(k) for k in steps} == steps, calls
        assert host_reads(window) == 0
    if device == "cuda":
        assert counter.syncs == [0] * len(counter.windows), counter.sync_messages


@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_and_ckpt_path_resume_bit_for_bit(tmp_path, param_dtype, opt_kind):
    """An uninterrupted 2-epoch run saves a checkpoint after epoch 1; a fresh Trainer resumed from it with
    ckpt_path= ends bitwise where the uninterrupted run ended: parameters, optimizer state (fp32 masters of bf16
    parameters included; FusedMuon: the momentum and its AdamW group's moments). 16-mixed for the fp32
    parameters, so the scaler's state travels too."""
    steps_per_epoch = 6
    precision = "16-mixed" if param_dtype == torch.float32 else "bf16-mixed"

    def plugin():
        return _fp16("cpu") if precision == "16-mixed" else FusedMixedPrecision("bf16-mixed", "cpu")

    def trainer(**kw):
        return L.Trainer(max_epochs=2, gradient_clip_val=1.0, accumulate_grad_batches=GA, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         plugins=[plugin()], **kw)

    ckpt = ModelCheckpoint(dirpath=str(tmp_path), filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    a = Model(opt_kind, param_dtype=param_dtype, inject=(8,))
    ta = trainer(callbacks=[ckpt])
    ta.fit(a, _loader(steps_per_epoch))
    b = Model(opt_kind, param_dtype=param_dtype, inject=(2,))  # step 8 overall is step 2 of the resumed run
    tb = trainer(enable_checkpointing=False)
    tb.fit(b, _loader(steps_per_epoch), ckpt_path=os.path.join(str(tmp_path), "epoch=0.ckpt"))
    assert ta.global_step == tb.global_step == 2 * steps_per_epoch
    assert a.skipped[8] and b.skipped[2] and a.losses[steps_per_epoch:] == b.losses
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert_bitwise(f"param {n}", pa.detach(), pb.detach())
    sa, sb = ta.optimizers[0].state_dict(), tb.optimizers[0].state_dict()
    for i in sa["state"]:
        for key, v in sa["state"][i].items():
            assert_bitwise(f"state[{i}][{key}]", v, sb["state"][i][key])
    if param_dtype != torch.float32:
        assert all("master_param" in s for s in sa["state"].values())
    else:
        assert ta.precision_plugin.scaler.state_dict() == tb.precision_plugin.scaler.state_dict()


def test_clip_by_value_after_the_unscale():
    """gradient_clip_algorithm='value' has no fused form: the plugin unscales, then clamps (a pass of its own);
    the steps match the recipe fed the clamped gradients."""
    seen = []

    class Clamped(Model):
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            self.shadow.grads = [g.clamp(-1e-3, 1e-3) for g in self.shadow.grads]
            seen.append(True)

    model = Clamped(shadow=True)
    model.shadow = Shadow(model.parameters(), HYPER, max_norm=None)
    _fit(model, _trainer(plugins=[_fp16("cpu")], gradient_clip_val=1e-3, gradient_clip_algorithm="value",
                         steps=5), steps=5)
    assert len(seen) == 5 and model.shadow.steps == 5


def test_plugin_arguments():
    assert FusedMixedPrecision("bf16-mixed").scaler is None
    assert isinstance(FusedMixedPrecision("16-mixed", "cpu").scaler, ampfused.GradScaler)
    with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'"):
        FusedMixedPrecision("32-true")
    with pytest.raises(TypeError, match="device must be a device type string"):
        FusedMixedPrecision("bf16-mixed", torch.device("cpu"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_plugin_without_a_device_follows_the_trainers_accelerator(precision, monkeypatch):
    """On a GPU machine the plugin's default is CUDA autocast; with accelerator="cpu" it must autocast where the
    model is, the CPU (else the CPU model would train in fp32), and its default scaler must be a CPU one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # built as on a GPU machine
    plugin = FusedMixedPrecision(precision)
    monkeypatch.undo()
    assert plugin.device == "cuda"
    seen = []

    class Probe(Model):
        def training_step(self, batch, batch_idx):
            seen.append(torch.is_autocast_enabled("cpu"))
            return super().training_step(batch, batch_idx)

    _fit(Probe(), _trainer("cpu", plugins=[plugin], steps=2), steps=2)
    assert plugin.device == "cpu" and seen and all(seen)
    if precision == "16-mixed":
        assert isinstance(plugin.scaler, ampfused.GradScaler) and plugin.scaler._device == "cpu"
    else:
        assert plugin.scaler is None


def test_pytorch_lightning_package_takes_its_own_plugin():
    """pytorch_lightning (the standalone package) checks plugins against its own classes: its Trainer takes the
    plugin from ampfused.integrations.pytorch_lightning, and trains with the clip folded."""
    pl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
    from ampfused.integrations.pytorch_lightning import FusedMixedPrecision as PLFused

    class PLModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return ampfused.FusedAdamW(self.parameters(), **HYPER)

    model = PLModel()
    trainer = pl.Trainer(max_steps=STEPS, gradient_clip_val=1.0, accumulate_grad_batches=GA, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1, plugins=[PLFused("bf16-mixed", "cpu")])
    trainer.fit(model, _loader())
    assert isinstance(trainer.precision_plugin, PLFused) and trainer.global_step == STEPS
    assert_trains(model.losses[::GA], "pytorch_lightning bf16-mixed")


class HealthModel(Model):
    def configure_optimizers(self):
        return ampfused.FusedAdamW(self.parameters(), **HYPER, backend="reference", health=True)


def test_the_plugin_logs_the_fused_optimizers_health_numbers():
    model = _fit(HealthModel(), _trainer(plugins=[FusedMixedPrecision("bf16-mixed", "cpu")], steps=3), steps=3)
    fused = _fused(model.trainer.optimizers[0])
    logged = model.trainer.callback_metrics
    for gi, h in enumerate(fused.health()):
        for name in ("grad_norm", "update_norm", "weight_norm", "stagnant", "nonfinite"):
            assert float(logged[f"health/group{gi}/{name}"]) == float(h[name]), (gi, name)
        assert float(logged[f"health/group{gi}/update_to_weight"]) == pytest.approx(
            float(h["update_norm"]) / float(h["weight_norm"]))
    assert float(logged["health/group0/grad_norm"]) > 0 and float(logged["health/group0/update_norm"]) > 0
