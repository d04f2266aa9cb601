"""The transformers ``Trainer``: ``fuse(trainer)``, one line after ``Trainer(...)``.

The ``Trainer`` runs its step through the ``Accelerator`` it creates (``trainer.accelerator``):
``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``, then ``optimizer.step()``, then
``accelerator.optimizer_step_was_skipped`` to decide whether to step the learning-rate scheduler. ``fuse(trainer)``
applies :func:`ampfused.integrations.accelerate.fuse` to that accelerator (before it prepares the optimizer,
which the ``Trainer`` does in ``train()``): the clip folds into the fused step and, under fp16, an
:class:`ampfused.GradScaler` drives it.

The ``Trainer`` asks ``optimizer_step_was_skipped`` after every optimizer step. By default the answer is
accelerate's own, which reads nothing from the device, so the scheduler advances on every optimizer step, as in a
plain loop that calls ``scheduler.step()`` after ``optimizer.step()`` (a step the fused optimizer skipped on
non-finite gradients changes no weight). ``exact_skips=True`` holds the scheduler back on skipped steps, at the
cost of one host read per optimizer step.

The optimizer can be given built (``optimizers=(FusedAdamW(model.parameters(), ...), None)``) or by class
(``optimizer_cls_and_kwargs=(FusedAdamW, {...})``, transformers >= 4.45), in which case the ``Trainer`` builds it
with its weight-decay groups. Tested with transformers 5.23 (accelerate 1.15).

A fused optimizer built with ``health=True`` adds its training-health numbers to every training log line
(``health/group{i}/grad_norm``, ``update_norm``, ``weight_norm``, ``update_to_weight``, ``stagnant``,
``nonfinite``: the last step's, read when the ``Trainer`` logs).
"""
from __future__ import annotations

import functools

from . import accelerate as _accelerate_integration
from ._common import health_metrics

__all__ = ["fuse"]


def fuse(trainer, *, exact_skips: bool = False, scaler="ampfused"):
    """Make ``trainer`` (a ``transformers.Trainer``) run ampfused's fused optimizers through their fused step;
    call it after ``Trainer(...)`` and before ``train()``. Returns the trainer.

    Args:
        exact_skips: hold the learning-rate scheduler back on steps the fused optimizer skipped (one host read
            per optimizer step); default False: it advances on every optimizer step and nothing is read.
        scaler: as in :func:`ampfused.integrations.accelerate.fuse` (``"ampfused"``, ``"keep"`` or an instance).
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError("ampfused.integrations.transformers needs the transformers package "
                          "(pip install 'ampfused[integrations]')") from e
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    if not isinstance(exact_skips, bool):
        raise TypeError(f"exact_skips must be a bool, got {type(exact_skips).__name__}")
    _accelerate_integration.fuse(trainer.accelerator, scaler=scaler, report_skips=exact_skips)
    if not getattr(trainer.log, "_ampfused_health", False):
        log = trainer.log

        @functools.wraps(log)
        def log_with_health(logs, *args, **kwargs):
            if "loss" in logs and trainer.optimizer is not None:  # a training log line: the last step's numbers
                logs.update({k: float(v) for k, v in health_metrics([trainer.optimizer]).items()})
            return log(logs, *args, **kwargs)

        log_with_health._ampfused_health = True
        trainer.log = log_with_health
    return trainer
