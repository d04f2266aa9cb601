"""ampfused.integrations.torchtitan with ``"Muon"`` param groups: ``"Muon"`` and ``"AdamW"`` groups build one
FusedMuon per model part (the AdamW groups its ``use_muon=False`` groups), so the fused clip covers the whole
model; its step is a hand-built FusedMuon's, bit for bit; its checkpoints keep torch.optim.Muon's group keys for
the Muon groups and torch's AdamW keys for the others, and resume bit for bit. One process, the CPU."""
import copy
import os
import re

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

from ampfused import FusedMuon  # noqa: E402
from ampfused.integrations import torchtitan as tt  # noqa: E402
from ampfused.integrations.torchtitan import FusedOptimizersContainer  # noqa: E402
from oracle import assert_bitwise  # noqa: E402

MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}
MATRICES, VECTORS = ["0.weight", "2.weight"], ["0.bias", "2.bias"]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(dtype)


def _groups(aux="AdamW"):
    """The matrices to Muon, everything else (the biases) to ``aux``: the recipe Muon is meant for."""
    return [ParamGroupConfig(pattern=r"weight$", optimizer_name="Muon", optimizer_kwargs=dict(MUON)),
            ParamGroupConfig(pattern=r".*", optimizer_name=aux, optimizer_kwargs=dict(ADAMW))]


def _container(model, max_grad_norm=0.1, **kw):
    return FusedOptimizersContainer.Config(param_groups=_groups(), max_grad_norm=max_grad_norm, **kw).build(
        model_parts=[model])


def _by_hand(model, max_grad_norm=0.1):
    named = dict(model.named_parameters())
    return FusedMuon([dict(params=[named[n] for n in MATRICES], **MUON),
                      dict(params=[named[n] for n in VECTORS], use_muon=False, **ADAMW)],
                     max_grad_norm=max_grad_norm)


def _backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g).to(next(model.parameters()).dtype)
    model(x).float().square().sum().backward()


def test_muon_and_adamw_groups_build_one_fused_muon_with_the_clip():
    model = _model()
    c = _container(model, max_grad_norm=0.25)
    (opt,) = c.optimizers
    assert type(opt) is FusedMuon
    muon, aux = opt.param_groups
    assert (muon["param_names"], aux["param_names"]) == (MATRICES, VECTORS)
    assert tt.uses_muon(muon) and not tt.uses_muon(aux)
    assert {k: muon[k] for k in MUON} == MUON and {k: aux[k] for k in ADAMW} == ADAMW
    assert muon["max_grad_norm"] == aux["max_grad_norm"] == 0.25
    # Muon alone (every parameter a matrix) builds a FusedMuon too
    only = FusedOptimizersContainer.Config(param_groups=_groups()[:1], max_grad_norm=0.25).build(
        model_parts=[torch.nn.Linear(4, 3, bias=False)])
    assert [type(o) for o in only.optimizers] == [FusedMuon]
    # torchtitan's fused_opt_states_bf16: bf16 moments in every group (FusedMuon's momentum_dtype)
    model = _model()
    bf16 = _container(model, implementation="fused_opt_states_bf16")
    _backward(model)
    bf16.step()
    state = bf16.optimizers[0].state
    assert {v.dtype for p in model.parameters() for k, v in state[p].items() if k != "step"} == {torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_is_a_hand_built_fused_muons_bit_for_bit(dtype):
    """Same model, same gradients, three steps with the clip active: the container's weights, norm and state
    are those of ``FusedMuon([matrices, dict(vectors, use_muon=False, ...)], max_grad_norm=...)``."""
    cm, hm = _model(dtype), _model(dtype)
    c, h = _container(cm), _by_hand(hm)
    for seed in (1, 2, 3):
        _backward(cm, seed)
        _backward(hm, seed)
        norm = c.last_grad_norm
        c.step()
        h.step()
        assert norm > 0.1  # the clip was active
        assert_bitwise(f"step {seed} norm", norm, h.last_grad_norm)
        for (n, p), q in zip(cm.named_parameters(), hm.parameters()):
            assert_bitwise(f"step {seed} {n}", p.detach(), q.detach())
            for key, v in c.optimizers[0].state[p].items():
                assert_bitwise(f"step {seed} {n} {key}", v, h.state[q][key])
        c.zero_grad()
        h.zero_grad()
    assert {k: float(v) for k, v in c.skip_metrics().items()} == {
        "optimizer/skipped_steps": 0.0, "optimizer/last_step_skipped": 0.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_bit_for_bit(dtype):
    """Save after two steps, load into a fresh container over a model with the saved weights, take two more
    steps on both: the same bits (weights, fp32 masters of bf16 weights, moments). The Muon groups' keys are
    torch.optim.Muon's (none of torch's Adam-only keys), the AdamW groups' carry torch.optim.AdamW's."""
    a_model = _model(dtype)
    a = _container(a_model)
    for seed in (1, 2):
        _backward(a_model, seed)
        a.step()
        a.zero_grad()
    saved = copy.deepcopy(a.state_dict())  # (the state tensors are views the next step rewrites)
    torch_muon = torch.optim.Muon([torch.nn.Parameter(torch.zeros(3, 3))]).state_dict()["param_groups"][0]
    for name in MATRICES:
        assert f"state.{name}.momentum_buffer" in saved
        keys = {k.rpartition(".")[2] for k in saved if k.startswith(f"param_groups.{name}.")}
        assert keys == set(torch_muon) - {"params"}  # torch's Adam-only keys not among them
    for name in VECTORS:
        assert {f"state.{name}.exp_avg", f"state.{name}.exp_avg_sq"} <= saved.keys()
        assert {k: saved[f"param_groups.{name}.{k}"] for k in tt._TORCH_ONLY_KEYS} == {
            "foreach": False, "fused": True, "capturable": False, "differentiable": False,
            "decoupled_weight_decay": True}
    assert not [k for k in saved if k.endswith(".max_grad_norm")]  # this run's setting, not the checkpoint's

    b_model = _model(dtype)
    b_model.load_state_dict(a_model.state_dict())
    b = _container(b_model, max_grad_norm=0.1)
    b.load_state_dict(saved)
    assert b.optimizers[0].param_groups[0]["max_grad_norm"] == 0.1
    for seed in (3, 4):
        for model, c in ((a_model, a), (b_model, b)):
            _backward(model, seed)
            c.step()
            c.zero_grad()
    for (n, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        assert_bitwise(f"resumed {n}", p.detach(), q.detach())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        if isinstance(v, torch.Tensor):
            assert_bitwise(f"resumed {k}", v, sb[k])
        else:
            assert v == sb[k], k


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"param group '\.\*' asks for optimizer_name 'Adam' beside 'Muon'.*'AdamW'"):
        FusedOptimizersContainer.Config(param_groups=_groups("Adam")).build(model_parts=[_model()])
    with pytest.raises(ValueError, match=r"optimizer_factory_kwargs_by_name\['AdamW'\].*under 'Muon'"):
        FusedOptimizersContainer.Config(param_groups=_groups(), optimizer_factory_kwargs_by_name={
            "AdamW": {"backend": "reference"}}).build(model_parts=[_model()])
    # Muon's own rule: a matrix per parameter (a bias in a Muon group is torch.optim.Muon's error)
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        FusedOptimizersContainer.Config(param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="Muon", optimizer_kwargs=dict(MUON))]).build(
                model_parts=[_model()])
    # the clip needs one fused optimizer per rank: one per model part still, Muon or not
    with pytest.raises(ValueError, match="max_grad_norm clips by the norm of every gradient.*builds 2"):
        FusedOptimizersContainer.Config(param_groups=_groups(), max_grad_norm=1.0).build(
            model_parts=[_model(), _model()])


def test_the_docs_llama3_groups_build_one_fused_muon():
    """docs/torchtitan.md's Muon configuration, run as written, on torchtitan's llama3 (the tiny one of the
    trainer tests): the embedding, the head and the norms in an AdamW group, every other parameter (a matrix) in
    the Muon group, one FusedMuon."""
    import torchtitan_harness as H

    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "torchtitan.md")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)
               if b.startswith("optimizer=FusedOptimizersContainer.Config(")]
    scope = {"FusedOptimizersContainer": FusedOptimizersContainer, "ParamGroupConfig": ParamGroupConfig}
    exec(code, scope)
    model = H.tiny_llama3_spec().model.build()
    (opt,) = scope["optimizer"].build(model_parts=[model]).optimizers
    assert type(opt) is FusedMuon
    aux, muon = opt.param_groups
    assert not tt.uses_muon(aux) and tt.uses_muon(muon)
    assert all(p.dim() == 2 for p in muon["params"]) and len(muon["params"]) == 10
    assert sorted(aux["param_names"]) == sorted(["tok_embeddings.weight", "lm_head.weight", "norm.weight"] + [
        f"layers.{i}.{n}_norm.weight" for i in (0, 1) for n in ("attention", "ffn")])
