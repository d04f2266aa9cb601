"""HF accelerate: ``fuse(accelerator)``, one line after ``accelerator.prepare(...)`` (or before it).

What it changes on that ``Accelerator`` (and on the optimizers it prepared or will prepare) when they hold an
ampfused fused optimizer; everything else stays accelerate's:

* ``accelerator.clip_grad_norm_(params, max_norm)`` on exactly the parameters of one fused optimizer (those with a
  gradient) returns their total norm and folds the clip into that optimizer's next step: one read of the
  gradients for the norm and the inf check, none to clip them (accelerate would unscale, measure and scale the
  gradients in passes of their own). Under fp16 the scaler unscales first, as accelerate does.
* ``accelerator.optimizer_step_was_skipped`` is true exactly when the fused optimizer skipped its last step
  (non-finite gradients), read from the device only when asked. ``report_skips=False`` keeps accelerate's own
  answer instead, which never reads the device (with a fused optimizer it is then always False).
* With a loss scaler (fp16): accelerate's ``torch.amp.GradScaler`` is replaced by an :class:`ampfused.GradScaler`
  with the same settings and state, which hands the scale to the fused step without torch's extra inf-check pass
  and updates it on the device. ``scaler="keep"`` keeps accelerate's scaler; a GradScaler instance is installed
  as given (it is then also the scaler ``accelerator.backward``, ``save_state`` and ``load_state`` use).

Tested with accelerate 1.15. Refused for DeepSpeed, Megatron-LM, FSDP and XLA, which own the optimizer step.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ..clip import clip_grad_norm_ as _ampfused_clip
from ..optim._segments import owner_of
from ..scaler import GradScaler
from ._common import fold_clip, fused_optimizer, owning_optimizer, unscale_once, warn_once

__all__ = ["fuse"]

_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "FSDP", "XLA")


def _accelerate():
    try:
        import accelerate
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError as e:
        raise ImportError("ampfused.integrations.accelerate needs the accelerate package "
                          "(pip install 'ampfused[integrations]')") from e
    return accelerate, AcceleratedOptimizer


_CLASSES: dict = {}


def _subclass(base: type, mixin: type) -> type:
    """``base`` with ``mixin``'s overrides, made once per base class (so isinstance checks still hold)."""
    key = (base, mixin)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{mixin.__name__.lstrip('_')}[{base.__name__}]", (mixin, base),
                             {"__module__": __name__})
    return _CLASSES[key]


class _FusedAcceleratedOptimizer:
    """Overrides of accelerate's ``AcceleratedOptimizer`` for a wrapped fused optimizer."""

    _ampfused_report_skips = True
    _ampfused_stepped = False

    def step(self, closure=None):
        # accelerate's own step without the XLA and LOMO branches (refused / not fused optimizers), and without
        # patching the optimizer's step to learn whether the scaler called it: a fused optimizer is always
        # called and decides the skip itself, on the device.
        if not self.gradient_state.sync_gradients:
            return None
        if self.scaler is not None:
            out = self.scaler.step(self.optimizer) if closure is None else self.scaler.step(self.optimizer, closure)
            self.scaler.update()
        else:
            out = self.optimizer.step(closure)
        self._ampfused_stepped = True
        return out

    @property
    def step_was_skipped(self) -> bool:
        """Whether the fused optimizer skipped its last step (one read of a device flag, when asked)."""
        if not self._ampfused_report_skips:
            return bool(self._is_overflow)
        fused = fused_optimizer(self.optimizer)
        return bool(self._ampfused_stepped and fused is not None and fused.last_step_skipped)


class _FusedAccelerator:
    """Overrides of ``accelerate.Accelerator``: the clip folded into the fused step, fused optimizers wrapped as
    they are prepared."""

    def prepare_optimizer(self, optimizer, device_placement=None):
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        _fuse_prepared(self)
        return prepared

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        owner = owning_optimizer(params)
        if owner is not None:
            return fold_clip(owner, max_norm, norm_type, scaler=self.scaler, where="accelerator.clip_grad_norm_")
        fused = {id(o): o for o in (owner_of(p) for p in params if p.grad is not None) if o is not None}
        if not fused:  # no fused optimizer involved: accelerate's own clip
            return super().clip_grad_norm_(params, max_norm, norm_type)
        warn_once("accelerate-params", "accelerator.clip_grad_norm_: the parameters given are not exactly the "
                  "parameters (with gradients) of one fused ampfused optimizer, so the clip cannot be folded into its "
                  "step and runs as a pass of its own. Pass that optimizer's parameters (model.parameters() when it "
                  "holds all of them) to clip inside the fused step.")
        for acc_opt in self._optimizers:
            unscale_once(self.scaler, _inner(acc_opt))
        return _ampfused_clip(params, max_norm, norm_type)


def _inner(acc_opt):
    opt = acc_opt
    while hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def _ampfused_scaler(scaler: torch.amp.GradScaler) -> GradScaler:
    """An ampfused.GradScaler with the settings and state of torch's ``scaler``."""
    new = GradScaler(scaler._device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
                     backoff_factor=scaler._backoff_factor, growth_interval=scaler._growth_interval,
                     enabled=scaler._enabled)
    if scaler._enabled and getattr(scaler, "_scale", None) is not None:
        new.load_state_dict(scaler.state_dict())
    return new


def _fuse_prepared(accelerator) -> None:
    _, AcceleratedOptimizer = _accelerate()
    for i, acc_opt in enumerate(accelerator._optimizers):
        if not isinstance(acc_opt, AcceleratedOptimizer) or fused_optimizer(acc_opt) is None:
            continue
        if not isinstance(acc_opt, _FusedAcceleratedOptimizer):
            acc_opt.__class__ = _subclass(type(acc_opt), _FusedAcceleratedOptimizer)
        acc_opt._ampfused_report_skips = accelerator._ampfused_report_skips


def _set_scaler(accelerator, scaler) -> None:
    """``scaler`` becomes the accelerator's, and that of every optimizer it prepared with the one it replaces."""
    old, accelerator.scaler = accelerator.scaler, scaler
    _, AcceleratedOptimizer = _accelerate()
    for acc_opt in accelerator._optimizers:
        if not isinstance(acc_opt, AcceleratedOptimizer) or acc_opt.scaler is not old:
            continue
        acc_opt.scaler = scaler
        if old is None and not hasattr(acc_opt, "_optimizer_patched_step_method"):
            # what AcceleratedOptimizer.__init__ sets up when it is given a scaler (its __setstate__ does the
            # same); a fused optimizer's step below does not use it, any other optimizer's does
            acc_opt.__setstate__(dict(acc_opt.__dict__))


def fuse(accelerator, *, scaler: Union[str, torch.amp.GradScaler] = "ampfused", report_skips: bool = True):
    """Make ``accelerator`` drive ampfused's fused optimizers through their fused step (see the module
    docstring). Call it once, after ``Accelerator(...)``, before or after ``prepare``; returns the accelerator.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        scaler: ``"ampfused"`` (default): a torch loss scaler the accelerator created (fp16) is replaced by an
            :class:`ampfused.GradScaler` with its settings and state; ``"keep"``: the accelerator's scaler is kept;
            or a ``torch.amp.GradScaler`` / ``ampfused.GradScaler`` instance to use as the accelerator's scaler.
        report_skips: ``optimizer_step_was_skipped`` reads whether the fused optimizer skipped its last step
            (one host read each time it is asked); False keeps accelerate's answer, which reads nothing.
    """
    accelerate, _ = _accelerate()
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(report_skips, bool):
        raise TypeError(f"report_skips must be a bool, got {type(report_skips).__name__}")
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise ValueError(f"accelerator.distributed_type is {kind}: that backend owns the optimizer step (and its "
                         "clip), so a fused ampfused optimizer cannot run inside it; fuse() supports single-device "
                         "and DDP (MULTI_*) runs")
    if isinstance(scaler, str):
        if scaler not in ("ampfused", "keep"):
            raise ValueError(f"scaler must be 'ampfused', 'keep' or a GradScaler instance, got {scaler!r}")
        current = accelerator.scaler
        if scaler == "ampfused" and current is not None and not isinstance(current, GradScaler):
            if type(current) is not torch.amp.GradScaler and not isinstance(current, torch.cuda.amp.GradScaler):
                raise ValueError(f"scaler='ampfused': the accelerator's scaler is a {type(current).__name__}, which "
                                 "ampfused.GradScaler cannot stand in for; pass scaler='keep'")
            _set_scaler(accelerator, _ampfused_scaler(current))
    elif isinstance(scaler, torch.amp.GradScaler):
        _set_scaler(accelerator, scaler)
    else:
        raise TypeError(f"scaler must be 'ampfused', 'keep' or a torch.amp.GradScaler instance, got "
                        f"{type(scaler).__name__}")
    accelerator._ampfused_report_skips = report_skips
    if not isinstance(accelerator, _FusedAccelerator):
        accelerator.__class__ = _subclass(type(accelerator), _FusedAccelerator)
    _fuse_prepared(accelerator)
    return accelerator
