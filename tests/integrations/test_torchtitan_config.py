"""ampfused.integrations.torchtitan's configuration: what it builds, what it refuses (before anything is built),
and its checkpoint keys against torchtitan's own container, on one process."""
import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402

from ampfused import FusedAdam, FusedAdamW  # noqa: E402
from ampfused.integrations import torchtitan as tt  # noqa: E402
from ampfused.integrations.torchtitan import FusedOptimizersContainer, FusedTrainer  # noqa: E402

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _groups(*names):
    pats = [r"^0\.", r".*"] if len(names) == 2 else [r".*"]
    return [ParamGroupConfig(pattern=p, optimizer_name=n, optimizer_kwargs=dict(HYPER)) for p, n in zip(pats, names)]


def _backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 6, generator=g)).square().sum().backward()


def test_builds_fused_optimizers_per_name_with_the_clip():
    c = FusedOptimizersContainer.Config(param_groups=_groups("AdamW"), max_grad_norm=0.25).build(
        model_parts=[_model()])
    (opt,) = c.optimizers
    assert type(opt) is FusedAdamW and opt.param_groups[0]["max_grad_norm"] == 0.25
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    model = _model()
    two = FusedOptimizersContainer.Config(param_groups=_groups("Adam", "AdamW")).build(model_parts=[model])
    assert [type(o) for o in two.optimizers] == [FusedAdam, FusedAdamW]
    _backward(model)
    norm = two.last_grad_norm
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    two.step()
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)  # the norm of both optimizers' gradients


def test_step_matches_torchtitans_adamw_with_its_clip():
    """One container step (fused clip inside) against torchtitan's container after torch's clip_grad_norm_."""
    fm, tm = _model(), _model()
    fused = FusedOptimizersContainer.Config(param_groups=_groups("AdamW"), max_grad_norm=0.1,
                                            backend="reference").build(model_parts=[fm])
    ref = OptimizersContainer.Config(param_groups=_groups("AdamW"), implementation="for-loop").build(
        model_parts=[tm])
    for seed in (1, 2):
        _backward(fm, seed)
        _backward(tm, seed)
        norm = fused.last_grad_norm  # taken before the step, read after it
        ref_norm = torch.nn.utils.clip_grad_norm_(tm.parameters(), 0.1)
        fused.step()
        ref.step()
        assert ref_norm > 0.1  # the clip was active
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        for p, q in zip(fm.parameters(), tm.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        fused.zero_grad()
        ref.zero_grad()
    assert {k: float(v) for k, v in fused.skip_metrics().items()} == {
        "optimizer/skipped_steps": 0.0, "optimizer/last_step_skipped": 0.0}


def test_state_dict_has_torchs_keys_and_loads_both_ways():
    fm, tm = _model(), _model()
    fused = FusedOptimizersContainer.Config(param_groups=_groups("AdamW"), max_grad_norm=1.0).build(
        model_parts=[fm])
    ref = OptimizersContainer.Config(param_groups=_groups("AdamW"), implementation="foreach").build(
        model_parts=[tm])
    _backward(tm)
    ref.step()
    fsd, tsd = fused.state_dict(), ref.state_dict()
    assert fsd.keys() == tsd.keys()
    fused.load_state_dict(tsd)
    assert fused.optimizers[0].param_groups[0]["max_grad_norm"] == 1.0  # this run's clip, not the checkpoint's
    for k, v in fused.state_dict().items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(v, tsd[k], rtol=0, atol=0, msg=k)
    ref2 = OptimizersContainer.Config(param_groups=_groups("AdamW"), implementation="foreach").build(
        model_parts=[_model()])
    ref2.load_state_dict(fused.state_dict())
    # the implementation torchtitan's container runs after the resume is the fused container's setting ("fused")
    assert (ref2.optimizers[0].param_groups[0]["fused"], ref2.optimizers[0].param_groups[0]["foreach"]) == (
        True, False)


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="optimizer_name 'DistMuon'"):
        FusedOptimizersContainer.Config(param_groups=_groups("DistMuon")).build(model_parts=[_model()])
    with pytest.raises(ValueError, match="max_grad_norm clips by the norm of every gradient.*builds 2"):
        FusedOptimizersContainer.Config(param_groups=_groups("Adam", "AdamW"), max_grad_norm=1.0).build(
            model_parts=[_model()])
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedOptimizersContainer.Config(param_groups=_groups("AdamW"), max_grad_norm=-1.0).build(
            model_parts=[_model()])


def test_bf16_states_map_to_bf16_moments():
    """torchtitan's ``fused_opt_states_bf16`` (fp32 parameters, bf16 Adam moments) gives the fused optimizers'
    bf16 moments, saved as bf16 under torch's keys as torchtitan's own container saves them."""
    model = _model()
    c = FusedOptimizersContainer.Config(param_groups=_groups("AdamW"), implementation="fused_opt_states_bf16").build(
        model_parts=[model])
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    c.step()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    sd = c.state_dict()
    assert {v.dtype for k, v in sd.items() if k.endswith((".exp_avg", ".exp_avg_sq"))} == {torch.bfloat16}
    assert sd["param_groups.0.weight.fused"] is True
    c.load_state_dict(sd)


def test_trainer_config_hands_max_norm_to_the_optimizer():
    cfg = FusedTrainer.Config(optimizer=FusedOptimizersContainer.Config(param_groups=_groups("AdamW")),
                              training=TrainingConfig(max_norm=0.5))
    assert cfg.optimizer.max_grad_norm == 0.5
    cfg = FusedTrainer.Config(optimizer=FusedOptimizersContainer.Config(param_groups=_groups("AdamW")),
                              training=TrainingConfig(max_norm=float("inf")))
    assert cfg.optimizer.max_grad_norm is None
    with pytest.raises(TypeError, match="optimizer must be a FusedOptimizersContainer.Config"):
        FusedTrainer.Config(optimizer=OptimizersContainer.Config(param_groups=_groups("AdamW")))
    # training.max_norm is the setting (as for torchtitan's own clip), also where the optimizer's says otherwise
    cfg = FusedTrainer.Config(optimizer=FusedOptimizersContainer.Config(param_groups=_groups("AdamW"),
                                                                        max_grad_norm=2.0),
                              training=TrainingConfig(max_norm=0.5))
    assert cfg.optimizer.max_grad_norm == 0.5
    cfg.training.max_norm = 0.25  # a command-line override after the config was built
    tt._hand_over_max_norm(cfg)  # (what FusedTrainer.__init__ does first)
    assert cfg.optimizer.max_grad_norm == 0.25
    with pytest.raises(ValueError, match="pipeline_parallel_degree"):
        FusedTrainer.Config(optimizer=FusedOptimizersContainer.Config(param_groups=_groups("AdamW")),
                            parallelism=ParallelismConfig(pipeline_parallel_degree=2),
                            training=TrainingConfig(disable_cuda_graphs=True))


def test_fused_config_of_a_registry_recipe():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    recipe = llama3_debugmodel()
    recipe.training.max_norm = 0.75
    cfg = tt.fused_config(recipe)
    assert type(cfg) is FusedTrainer.Config and type(cfg)._owner is FusedTrainer  # cfg.build() -> FusedTrainer
    assert isinstance(cfg.optimizer, FusedOptimizersContainer.Config)
    assert cfg.optimizer.param_groups == recipe.optimizer.param_groups
    assert cfg.optimizer.max_grad_norm == 0.75
    assert cfg.model_spec is recipe.model_spec and cfg.lr_scheduler is recipe.lr_scheduler
    with pytest.raises(TypeError, match="not torchtitan's OptimizersContainer.Config"):
        recipe.optimizer = object()
        tt.fused_config(recipe)


class _TrainerStandIn:
    """What the folded clip reads of a FusedTrainer: its optimizers."""

    def __init__(self, optimizers):
        self.optimizers = optimizers


def test_folded_clip_returns_the_steps_norm_without_a_pass():
    import torchtitan.distributed.utils as dist_utils

    model = _model()
    c = FusedOptimizersContainer.Config(param_groups=_groups("AdamW"), max_grad_norm=0.5).build(model_parts=[model])
    utils = tt._FoldedClipUtils(dist_utils, _TrainerStandIn(c))
    assert utils.dist_max is dist_utils.dist_max  # everything but the clip is torchtitan's
    _backward(model)
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.nn.utils.get_total_norm(grads)
    norm = utils.clip_grad_norm_(list(model.parameters()), 0.5, foreach=True, pp_mesh=None, ep_enabled=False)
    # nothing measured or scaled yet: the gradients are untouched, the norm is the step's own device tensor
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert norm.data_ptr() == c.optimizers[0].last_grad_norm.data_ptr()
    c.step()
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="training.max_norm is 2.0 but the fused optimizers clip to"):
        utils.clip_grad_norm_(list(model.parameters()), 2.0)
    with pytest.raises(RuntimeError, match="pipeline stages=True"):
        utils.clip_grad_norm_(list(model.parameters()), 0.5, pp_mesh=object())


def test_train_step_reads_dist_utils_of_the_trainer_module():
    import torchtitan.trainer

    assert tt._train_step_module(FusedTrainer) is torchtitan.trainer

    class MyTrainer(FusedTrainer):
        pass

    assert tt._train_step_module(MyTrainer) is torchtitan.trainer


def test_selected_from_torchtitans_command_line(tmp_path, monkeypatch):
    """``torchtitan.train``'s ConfigManager: a recipe module of the user's (``--module``/``--config``), with
    command-line overrides of torchtitan's and of ampfused's settings."""
    from torchtitan.config import ConfigManager

    (tmp_path / "fused_recipes.py").write_text(
        "from torchtitan.models.llama3.config_registry import llama3_debugmodel\n"
        "from ampfused.integrations.torchtitan import fused_config\n\n"
        "def llama3_debugmodel_fused():\n"
        "    return fused_config(llama3_debugmodel())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = ConfigManager().parse_args(["--module", "fused_recipes", "--config", "llama3_debugmodel_fused",
                                      "--training.max_norm", "2.5", "--optimizer.backend", "reference"])
    assert type(cfg)._owner is FusedTrainer  # torchtitan.train's config.build() builds a FusedTrainer
    assert (cfg.optimizer.max_grad_norm, cfg.optimizer.backend) == (2.5, "reference")


def test_health_reaches_the_optimizers_and_their_metrics():
    model = _model()
    c = FusedOptimizersContainer.Config(param_groups=_groups("AdamW"), backend="reference", health=True).build(
        model_parts=[model])
    (opt,) = c.optimizers
    assert opt.health_enabled
    _backward(model)
    c.step()
    metrics = c.health_metrics()
    h = opt.health()[0]
    assert float(metrics["health/group0/grad_norm"]) > 0
    for name in ("grad_norm", "update_norm", "weight_norm", "stagnant", "nonfinite"):
        assert float(metrics[f"health/group0/{name}"]) == float(h[name])
    off = FusedOptimizersContainer.Config(param_groups=_groups("AdamW")).build(model_parts=[_model()])
    assert off.health_metrics() == {}
