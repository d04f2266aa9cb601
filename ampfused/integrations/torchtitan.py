"""torchtitan: the fused optimizers selected from a torchtitan ``Trainer.Config``, with the clip, the gradient
norm its logging reports and the skip of non-finite steps owned by the fused step.

Two configurable classes, each chosen the way torchtitan chooses its components (a ``Config`` whose ``build``
constructs its owner):

* :class:`FusedOptimizersContainer` (``optimizer=FusedOptimizersContainer.Config(param_groups=[...])``): an
  ``OptimizersContainer`` whose ``"AdamW"``, ``"Adam"`` and ``"Muon"`` param groups build
  :class:`ampfused.FusedAdamW` / :class:`ampfused.FusedAdam` / :class:`ampfused.FusedMuon`; ``"Muon"`` groups
  and ``"AdamW"`` groups together build one ``FusedMuon`` per model part, the AdamW groups as its
  ``use_muon=False`` groups (so one clip and one skip cover the whole model). Its state dict is torchtitan's
  flat, FQN-keyed one with torch's keys, so a checkpoint saved by torchtitan's own ``AdamW`` container resumes
  here and the other way round.
* :class:`FusedTrainer` (``FusedTrainer.Config(...)`` in place of ``Trainer.Config(...)``, or
  ``fused_config(recipe())`` over an existing recipe): hands
  ``training.max_norm`` to the optimizers' ``max_grad_norm`` and turns torchtitan's own clip pass off; the norm
  its metrics log is the fused step's ``last_grad_norm`` (a device tensor, read only when torchtitan logs), and
  every log line carries ``optimizer/skipped_steps`` and ``optimizer/last_step_skipped`` (and, with
  ``FusedOptimizersContainer.Config(health=True)``, the training-health numbers ``health/group{i}/...``).

torchtitan 0.3.0 clips in ``Trainer.train_step`` through ``dist_utils.clip_grad_norm_`` with no setting that
turns the pass off (``max_norm=inf`` still reads the gradients for the norm and scales them by one), so during
its own ``train_step`` a ``FusedTrainer`` gives torchtitan's trainer module a ``dist_utils`` whose
``clip_grad_norm_`` returns the fused optimizer's norm instead; everything else in that namespace is
torchtitan's.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.trainer import Trainer

from ..optim import FusedAdam, FusedAdamW, FusedMuon
from ..optim import _params as P
from ..optim.muon import uses_muon
from ._common import health_metrics

_FACTORIES = {"AdamW": FusedAdamW, "Adam": FusedAdam, "Muon": FusedMuon}

# what torch.optim.Adam/AdamW keep in each param group: written into saved state dicts where the fused
# optimizers' groups lack them (so torchtitan's own container can load them); foreach/fused always from the
# container's implementation setting (the fused optimizers accept and ignore them). Not for FusedMuon's Muon
# groups: torch.optim.Muon's groups keep none of them (its AdamW groups get them, as torch's AdamW's).
_TORCH_ONLY_KEYS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
# what the fused optimizers keep in each group and torch's do not: a setting of this run, never a checkpoint's
_FUSED_ONLY_KEYS = ("max_grad_norm",)


# what torchtitan's ``fused_opt_states_bf16`` asks of torch's Adam: bfloat16 moments (FusedMuon's one setting
# stores every group's moments, its AdamW groups' too)
_BF16_STATES = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}
_BF16_STATES_BY_NAME = {"AdamW": _BF16_STATES, "Adam": _BF16_STATES, "Muon": {"momentum_dtype": torch.bfloat16}}


def _built_names(names) -> List[str]:
    """The optimizers a model part gets, by name: ``"Muon"`` and ``"AdamW"`` groups fold into one FusedMuon."""
    names = sorted(set(names))
    return ["Muon"] if "Muon" in names else names


class FusedOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` over ampfused's fused optimizers.

    Param groups are chosen by regex as in torchtitan (``ParamGroupConfig``); ``optimizer_name`` ``"AdamW"``
    or ``"Adam"`` builds :class:`ampfused.FusedAdamW` / :class:`ampfused.FusedAdam` with the group's
    ``optimizer_kwargs``; ``"Muon"`` builds :class:`ampfused.FusedMuon` (its ``optimizer_kwargs`` are
    ``torch.optim.Muon``'s: ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_coefficients``, ``eps``,
    ``ns_steps``, ``adjust_lr_fn``), and where a configuration has ``"Muon"`` and ``"AdamW"`` groups, one
    ``FusedMuon`` per model part holds both, each ``"AdamW"`` group a ``use_muon=False`` group with its
    ``optimizer_kwargs`` (``lr``, ``betas``, ``eps``, ``weight_decay``), in the configuration's order.
    ``"Adam"`` groups beside ``"Muon"`` groups are refused (FusedMuon's other groups are AdamW).
    ``implementation`` ``"fused"``, ``"foreach"`` and ``"for-loop"`` all run the fused step (they only decide
    the ``fused``/``foreach`` values written into checkpoints, for torchtitan's own container to read back);
    ``"fused_opt_states_bf16"`` builds them with bfloat16 moments (FusedMuon: ``momentum_dtype=torch.bfloat16``,
    its AdamW groups' moments too).

    ``max_grad_norm`` clips every parameter's gradient to that total norm inside the step (set from
    ``training.max_norm`` by :class:`FusedTrainer`); the clip needs one fused optimizer per rank, so it refuses
    pipeline stages (several model parts) and a mix of ``"Adam"`` and ``"AdamW"`` groups.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        max_grad_norm: Optional[float] = None
        """Clip the gradients to this total L2 norm inside the fused step (None: no clip). Set from
        ``training.max_norm`` by ``FusedTrainer.Config``."""

        backend: Optional[str] = None
        """Force one ampfused backend (``"cuda"``, ``"triton"``, ``"cpu"``, ``"reference"``); None picks."""

        health: bool = False
        """Build the fused optimizers with ``health=True``: a ``FusedTrainer`` logs each param group's gradient,
        update and weight norms, stagnant and non-finite counts (``docs/api.md``, "Training health")."""

    def __init__(self, config: Config, *, model_parts: List[torch.nn.Module]) -> None:
        P.check_max_grad_norm(config.max_grad_norm, " in FusedOptimizersContainer.Config")
        for pg in config.param_groups:
            if pg.optimizer_name not in _FACTORIES:
                raise ValueError(f"FusedOptimizersContainer: param group {pg.pattern!r} asks for optimizer_name "
                                 f"{pg.optimizer_name!r}; the fused optimizers are {sorted(_FACTORIES)} (use "
                                 "torchtitan's OptimizersContainer for other optimizers)")
        names = sorted({pg.optimizer_name for pg in config.param_groups})
        if "Muon" in names and "Adam" in names:
            adam = next(pg.pattern for pg in config.param_groups if pg.optimizer_name == "Adam")
            raise ValueError(f"FusedOptimizersContainer: param group {adam!r} asks for optimizer_name 'Adam' beside "
                             "'Muon' groups; FusedMuon steps the groups that are not Muon's by AdamW (decoupled "
                             "weight decay), so give them optimizer_name 'AdamW' (Adam with weight_decay=0 is AdamW "
                             "with weight_decay=0)")
        if "Muon" in names and "AdamW" in names and config.optimizer_factory_kwargs_by_name.get("AdamW"):
            raise ValueError("FusedOptimizersContainer: optimizer_factory_kwargs_by_name['AdamW'] is given, but the "
                             "'AdamW' groups are folded into the 'Muon' groups' FusedMuon; give its arguments under "
                             "'Muon'")
        built = _built_names(names)
        fused_kwargs: Dict[str, Any] = {"max_grad_norm": config.max_grad_norm, "backend": config.backend,
                                        "health": config.health}
        if config.max_grad_norm is not None and len(model_parts) * len(built) > 1:
            raise ValueError(f"FusedOptimizersContainer: max_grad_norm clips by the norm of every gradient, which "
                             f"one fused optimizer per rank measures; this configuration builds "
                             f"{len(model_parts) * len(built)} ({len(model_parts)} model part(s), optimizer names "
                             f"{names})")
        self._fused_kwargs = fused_kwargs
        self._bf16_states = config.implementation == "fused_opt_states_bf16"
        self._implementation = config.implementation
        super().__init__(config, model_parts=model_parts)
        # several optimizers (no clip): the norm of all their gradients, written after each step (a post-hook,
        # not an override of step: torch wraps each class's step to run the hooks, which would then run twice)
        self._norm = torch.zeros((), dtype=torch.float32, device=self.optimizers[0]._device)
        if len(self.optimizers) > 1:
            self.register_step_post_hook(FusedOptimizersContainer._combine_norms)

    def _combine_norms(self, args=(), kwargs=None) -> None:
        norms = torch.stack([o.last_grad_norm.to(self._norm.device) for o in self.optimizers])
        self._norm.copy_(norms.square().sum().sqrt())

    # torchtitan calls these three through the instance
    def _resolve_optimizer_factory(self, name: str):
        extra = _BF16_STATES_BY_NAME[name] if self._bf16_states else {}
        return functools.partial(_FACTORIES[name], **self._fused_kwargs, **extra)

    def _build_param_groups(self, model, param_group_configs, impl_kwargs):
        """torchtitan's groups by optimizer name; with ``"Muon"`` and ``"AdamW"`` groups, the AdamW ones become
        ``use_muon=False`` groups of the Muon optimizer, every group in the configuration's order."""
        groups, patterns = super()._build_param_groups(model, param_group_configs, impl_kwargs)
        if "Muon" not in groups or "AdamW" not in groups:
            return groups, patterns
        # torchtitan builds exactly one group per configuration entry (an entry matching nothing raises), appended
        # under its name in configuration order: the k-th entry of a name is that name's k-th group
        taken = {name: 0 for name in groups}
        folded, folded_patterns = [], []
        for pg in param_group_configs:
            name = pg.optimizer_name
            k = taken[name]
            taken[name] += 1
            group = groups[name][k]
            folded.append(group if name == "Muon" else dict(group, use_muon=False))
            folded_patterns.append(patterns[name][k])
        return {"Muon": folded}, {"Muon": folded_patterns}

    @staticmethod
    def _build_impl_kwargs(config) -> Dict[str, Any]:
        return {}  # the step is always fused; the torch keys go into checkpoints only (state_dict below)

    def _register_bf16_optimizer_state_hook(self) -> None:
        pass  # torchtitan's hook pre-fills torch Adam state; the fused optimizers were built compact instead

    # --- the fused step's results, as device tensors ------------------------------------------------------
    @property
    def last_grad_norm(self) -> torch.Tensor:
        """0-d fp32 device tensor: total norm of the last step's gradients, before clipping (a view that each
        step rewrites in place, so it may be taken before the step and read after it)."""
        return self.optimizers[0].last_grad_norm if len(self.optimizers) == 1 else self._norm

    def skip_metrics(self) -> Dict[str, torch.Tensor]:
        """``optimizer/skipped_steps`` (steps skipped for non-finite gradients since this container was built
        or loaded) and ``optimizer/last_step_skipped``, as device tensors (no host read)."""
        skipped = sum(o.stats()["skipped_overflow"] for o in self.optimizers)
        last = torch.stack([o.last_step_skipped for o in self.optimizers]).any()
        return {"optimizer/skipped_steps": skipped, "optimizer/last_step_skipped": last}

    def health_metrics(self) -> Dict[str, torch.Tensor]:
        """The fused optimizers' training-health numbers of the last step as flat metrics (device tensors; empty
        unless built with ``health=True``)."""
        return health_metrics(self.optimizers)

    # --- checkpoints: torch's keys, this run's clip -------------------------------------------------------
    def _torch_keys(self, optim) -> Dict[str, Any]:
        impl = self._implementation
        return {"foreach": impl == "foreach", "fused": impl in ("fused", "fused_opt_states_bf16"),
                "capturable": False, "differentiable": False,
                "decoupled_weight_decay": isinstance(optim, (FusedAdamW, FusedMuon))}  # (FusedMuon: its AdamW)

    def state_dict(self) -> Dict[str, Any]:
        flat = super().state_dict()
        for optim in self.optimizers:
            torch_keys = self._torch_keys(optim)
            for group in optim.param_groups:
                muon = isinstance(optim, FusedMuon) and uses_muon(group)  # torch.optim.Muon's keys only
                for fqn in group["param_names"]:
                    for key in _FUSED_ONLY_KEYS:
                        flat.pop(f"param_groups.{fqn}.{key}", None)
                    if muon:
                        continue
                    for key in _TORCH_ONLY_KEYS:
                        if key in ("foreach", "fused"):  # what torchtitan's container would run after a resume
                            flat[f"param_groups.{fqn}.{key}"] = torch_keys[key]
                        else:
                            flat.setdefault(f"param_groups.{fqn}.{key}", torch_keys[key])
        return flat

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torchtitan's load; group settings the checkpoint lacks (it was saved by torch's optimizers, or they
        are this run's settings: ``max_grad_norm``) keep their current values."""
        state_dict = dict(state_dict)
        for optim in self.optimizers:
            for group in optim.param_groups:
                for fqn in group["param_names"]:
                    for key in _FUSED_ONLY_KEYS:
                        state_dict[f"param_groups.{fqn}.{key}"] = group[key]
                    for key, value in group.items():
                        if key not in ("params", "param_names"):
                            state_dict.setdefault(f"param_groups.{fqn}.{key}", value)
        super().load_state_dict(state_dict)


class _FoldedClipUtils:
    """torchtitan's ``dist_utils`` namespace with ``clip_grad_norm_`` answered by the fused optimizers: the
    trainer's call returns their ``last_grad_norm`` (filled by the step that follows) and clips nothing."""

    def __init__(self, real, trainer: "FusedTrainer"):
        self._real = real
        self._trainer = trainer

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None,
                        pp_mesh=None, ep_enabled=False):
        optimizers = self._trainer.optimizers
        configured = optimizers.optimizers[0].param_groups[0]["max_grad_norm"]
        if float(norm_type) != 2.0 or error_if_nonfinite or pp_mesh is not None or ep_enabled:
            raise RuntimeError(f"FusedTrainer: the fused step clips by the L2 norm of one optimizer's gradients; "
                               f"torchtitan asked for norm_type={norm_type}, error_if_nonfinite="
                               f"{error_if_nonfinite}, pipeline stages={pp_mesh is not None}, "
                               f"expert parallel={ep_enabled}")
        if (configured is None) != (max_norm is None or math.isinf(float(max_norm))) or (
                configured is not None and float(configured) != float(max_norm)):
            raise RuntimeError(f"FusedTrainer: training.max_norm is {max_norm} but the fused optimizers clip to "
                               f"max_grad_norm={configured}; set one value (FusedTrainer.Config hands "
                               "training.max_norm over)")
        return optimizers.last_grad_norm


def _train_step_module(cls) -> Any:
    """The module whose ``dist_utils`` the inherited ``train_step`` reads (torchtitan's trainer, or the module
    of a torchtitan trainer subclass that defines its own)."""
    mro = cls.__mro__
    for klass in mro[mro.index(FusedTrainer) + 1:]:
        if "train_step" in vars(klass):
            return sys.modules[klass.__module__]
    return sys.modules[Trainer.__module__]


def _hand_over_max_norm(config) -> None:
    """``training.max_norm`` becomes the fused optimizers' ``max_grad_norm`` (inf: no clip); the trainer's setting
    wins, as torchtitan's own clip reads it."""
    max_norm = config.training.max_norm
    config.optimizer.max_grad_norm = None if max_norm is None or math.isinf(float(max_norm)) else float(max_norm)


class FusedTrainer(Trainer):
    """torchtitan's ``Trainer`` with the clip, the reported norm and the skip owned by the fused optimizers.

    Select it with ``FusedTrainer.Config(..., optimizer=FusedOptimizersContainer.Config(...))`` where a recipe
    returns ``Trainer.Config(...)``; ``training.max_norm`` becomes the optimizers' ``max_grad_norm``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        def __post_init__(self):
            Trainer.Config.__post_init__(self)
            if not isinstance(self.optimizer, FusedOptimizersContainer.Config):
                raise TypeError("FusedTrainer.Config: optimizer must be a FusedOptimizersContainer.Config, got "
                                f"{type(self.optimizer).__qualname__}")
            if self.parallelism.pipeline_parallel_degree > 1:
                raise ValueError("FusedTrainer.Config: pipeline_parallel_degree > 1 is not supported (the fused "
                                 "clip measures one optimizer's gradients; each stage would clip alone)")
            _hand_over_max_norm(self)

    def __init__(self, config: Config):
        _hand_over_max_norm(config)  # again: command-line overrides may have changed training.max_norm since
        super().__init__(config)
        if self.parallel_dims.ep_enabled:
            raise ValueError("FusedTrainer: expert parallelism is not supported (torchtitan clips expert and "
                             "dense gradients over different meshes)")
        metrics = self.metrics_processor
        log = metrics.log

        @functools.wraps(log)
        def log_with_skips(*args, extra_metrics=None, **kwargs):
            extra = dict(extra_metrics or {})
            extra.update({k: float(v) for k, v in self.optimizers.skip_metrics().items()})
            extra.update({k: float(v) for k, v in self.optimizers.health_metrics().items()})
            return log(*args, extra_metrics=extra, **kwargs)

        metrics.log = log_with_skips  # read at logging only, where torchtitan reads the loss and norm too

    def train_step(self, data_iterator):
        module = _train_step_module(type(self))
        real = module.dist_utils
        module.dist_utils = _FoldedClipUtils(real, self)
        try:
            return super().train_step(data_iterator)
        finally:
            module.dist_utils = real


def fused_config(config: Trainer.Config) -> "FusedTrainer.Config":
    """An existing torchtitan recipe (a ``Trainer.Config``, e.g. ``llama3_8b()``) on the fused optimizers: every
    setting kept, the optimizer's param groups, implementation and factory arguments carried into a
    :class:`FusedOptimizersContainer.Config`, ``training.max_norm`` handed to it."""
    if type(config) is not Trainer.Config:
        raise TypeError(f"fused_config takes a torchtitan Trainer.Config, got {type(config).__qualname__}: a "
                        "trainer with a Config of its own needs a FusedTrainer-like subclass of that trainer")
    opt = config.optimizer
    if not isinstance(opt, FusedOptimizersContainer.Config):
        if type(opt) is not OptimizersContainer.Config:
            raise TypeError(f"fused_config: the recipe's optimizer is a {type(opt).__qualname__}, not torchtitan's "
                            "OptimizersContainer.Config")
        opt = FusedOptimizersContainer.Config(param_groups=list(opt.param_groups), implementation=opt.implementation,
                                              optimizer_factory_kwargs_by_name=dict(
                                                  opt.optimizer_factory_kwargs_by_name))
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values["optimizer"] = opt
    return FusedTrainer.Config(**values)
