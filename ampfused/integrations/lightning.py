"""PyTorch Lightning: ``FusedMixedPrecision``, a ``MixedPrecision`` plugin that clips inside the fused step.

Lightning's ``MixedPrecision`` refuses ``gradient_clip_val`` for an optimizer that handles loss scaling in its
own step (``_step_supports_amp_scaling``, which ampfused's fused optimizers declare so that a scaler hands them
the scale): it cannot unscale the gradients before its clip. This plugin folds the clip into the fused
optimizer's next step instead, after the scaler has unscaled them where there is one (16-mixed): no clip pass
over the gradients. Everything else (autocast, the scaler's step and update, its checkpoint state) is
Lightning's ``MixedPrecision``.

    trainer = Trainer(plugins=[FusedMixedPrecision("bf16-mixed")], gradient_clip_val=1.0, ...)
    trainer = Trainer(plugins=[FusedMixedPrecision("16-mixed")], ...)   # ampfused.GradScaler by default

For ``lightning.pytorch`` (or, when only that is installed, ``pytorch_lightning``); a ``pytorch_lightning.Trainer``
takes the plugin from :mod:`ampfused.integrations.pytorch_lightning`. Tested with 2.6.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..scaler import GradScaler
from ._common import fold_clip, fused_optimizer, health_metrics, unscale_once


def _lightning():
    try:
        from lightning.pytorch.plugins.precision import MixedPrecision
        from lightning.pytorch.utilities import GradClipAlgorithmType
    except ImportError:
        try:
            from pytorch_lightning.plugins.precision import MixedPrecision
            from pytorch_lightning.utilities import GradClipAlgorithmType
        except ImportError as e:
            raise ImportError("ampfused.integrations.lightning needs lightning (or pytorch_lightning) "
                              "(pip install 'ampfused[integrations]')") from e
    return MixedPrecision, GradClipAlgorithmType


def plugin_class(mixed_precision: type, algorithm: type, module: str = __name__) -> type:
    """``FusedMixedPrecision`` on the ``MixedPrecision`` of one Lightning package (``lightning.pytorch`` and
    ``pytorch_lightning`` each check plugins against their own classes)."""

    class FusedMixedPrecision(mixed_precision):
        """Lightning's ``MixedPrecision`` with the gradient clip folded into an ampfused fused optimizer's step.

        Args:
            precision: ``"bf16-mixed"`` or ``"16-mixed"``.
            device: the autocast device. Default: the device type of the trainer's model once the strategy has
                moved it (``accelerator="cpu"`` on a GPU machine autocasts on the CPU); ``"cuda"`` when CUDA is
                available, else ``"cpu"``, until then.
            scaler: for ``"16-mixed"``, the loss scaler; default an :class:`ampfused.GradScaler` on ``device`` (a
                ``torch.amp.GradScaler`` works too, with one more pass over the gradients per step).

        Clipping by norm (Lightning's default algorithm) is folded into the fused step and measured in the same
        read of the gradients as the inf check. Clipping by value has no fused form: after the unscale it runs
        ``torch.nn.utils.clip_grad_value_``, a pass of its own. Optimizers that are not ampfused's are clipped as
        Lightning's ``MixedPrecision`` clips them.

        A fused optimizer built with ``health=True`` has its training-health numbers logged after each of its
        steps (``health/group{i}/grad_norm``, ``update_norm``, ``weight_norm``, ``update_to_weight``,
        ``stagnant``, ``nonfinite``), through the LightningModule's ``log_dict`` (device tensors, read when
        Lightning's loggers write).
        """

        def __init__(self, precision: str, device: Optional[str] = None,
                     scaler: Optional[torch.amp.GradScaler] = None) -> None:
            self._follows_model = device is None  # the device, and the default scaler's, follow the model
            self._own_scaler = scaler is None
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if not isinstance(device, str):
                raise TypeError(f"device must be a device type string such as 'cuda' or 'cpu', got "
                                f"{type(device).__name__}")
            if scaler is None and precision == "16-mixed":
                scaler = GradScaler(device)
            super().__init__(precision, device, scaler)

        def connect(self, model, optimizers, lr_schedulers):
            """Called by the strategy once the model is on its device: without a ``device`` argument, autocast
            (and the default scaler) go where the model is."""
            if self._follows_model:
                where = next((p.device.type for p in model.parameters()), None)
                if where is not None and where != self.device:
                    self.device = where
                    if self._own_scaler and self.scaler is not None:
                        self.scaler = GradScaler(where)
            return super().connect(model, optimizers, lr_schedulers)

        def optimizer_step(self, optimizer, model, closure, **kwargs):
            out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            metrics = health_metrics([optimizer])
            if metrics and callable(getattr(model, "log_dict", None)) and getattr(model, "_trainer", None) is not None:
                model.log_dict(metrics, on_step=True, on_epoch=False)
            return out

        def clip_gradients(self, optimizer, clip_val: Union[int, float] = 0.0,
                           gradient_clip_algorithm=algorithm.NORM) -> None:
            fused = fused_optimizer(optimizer)
            if fused is None or clip_val <= 0:
                return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
            if gradient_clip_algorithm == algorithm.NORM:
                fold_clip(fused, clip_val, scaler=self.scaler, where="FusedMixedPrecision (gradient_clip_val)")
                return None
            unscale_once(self.scaler, fused)
            self.clip_grad_by_value(fused, clip_val)
            return None

    FusedMixedPrecision.__module__ = module  # where it is importable from by name (pickles find it there)
    FusedMixedPrecision.__qualname__ = "FusedMixedPrecision"
    return FusedMixedPrecision


__all__ = ["FusedMixedPrecision"]

FusedMixedPrecision = plugin_class(*_lightning())
