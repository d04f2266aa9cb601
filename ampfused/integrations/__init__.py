"""ampfused inside training frameworks: one module per framework, each importing its framework only when used.

* :mod:`ampfused.integrations.accelerate`: ``fuse(accelerator)`` after ``accelerator.prepare(...)``: routes
  ``accelerator.clip_grad_norm_`` into the fused optimizer's step, makes ``accelerator.optimizer_step_was_skipped``
  report the fused optimizer's own skip, and drives the step with :class:`ampfused.GradScaler` under fp16.
* :mod:`ampfused.integrations.lightning`: ``FusedMixedPrecision``, a Lightning ``MixedPrecision`` plugin that
  folds ``gradient_clip_val`` into the fused step (Lightning's own plugin refuses to clip for optimizers that
  unscale their gradients themselves); :mod:`ampfused.integrations.pytorch_lightning` has the same plugin for a
  ``pytorch_lightning.Trainer``.
* :mod:`ampfused.integrations.transformers`: ``fuse(trainer)`` after ``Trainer(...)``: the same as accelerate's
  ``fuse`` on the ``Accelerator`` the ``Trainer`` created.
* :mod:`ampfused.integrations.torchtitan`: ``FusedOptimizersContainer`` and ``FusedTrainer``, chosen in a
  torchtitan config (``fused_config(recipe())`` over an existing recipe): the fused optimizers own the clip
  (``training.max_norm``), the ``grad_norm`` torchtitan logs and the skip of non-finite steps (see
  ``docs/torchtitan.md``).

Frameworks that own their parameters and gradients in flat buffers (Megatron-style or DeepSpeed-style
optimizers) call :mod:`ampfused.ops` directly: ``norm_check`` then ``adamw_step_`` over the buffers they
allocated (see the README, "Use with training frameworks").

``import ampfused`` imports none of these modules, and none of them imports its framework before it is used.
"""
