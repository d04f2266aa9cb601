"""Everything else a real model does to the parameters of a fused optimizer, against torch.optim.

Tied and frozen parameters, parameters without a gradient, strided and empty ones, groups added later,
copies and pickles, checkpoints written by torch.save and safetensors, shared memory, gradient
checkpointing, a compiled model, every ``zero_grad`` mode, sparse gradients, and the inputs torch takes
that used to break (generator groups, AMSGrad state).
"""
import copy
import io
import os
import pickle
import tempfile

import pytest
import torch
from torch import nn

import ampfused
from backends import cpu_backends
from oracle import assert_bitwise, assert_close_to_oracle
from recipe import TorchRecipe, masters_of

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


class TinyGPT(nn.Module):
    """Embedding, a block, and an ``lm_head`` tied to the embedding, as GPT-2 ties them."""

    def __init__(self, vocab=11, width=8, dtype=torch.bfloat16):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.to(dtype)

    def forward(self, idx):
        h = self.wte(idx)
        h = h + self.mlp(self.ln(h))
        return self.lm_head(h)


def _loss(model, idx):
    logits = model(idx).float()
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _grads(params, gen, none=()):
    return [None if i in none else torch.randn(p.shape, generator=gen).to(p.dtype) for i, p in enumerate(params)]


def _run_against_recipe(params, opt, steps, gen, none_at=lambda k: (), what="", tcls=torch.optim.AdamW,
                        hyper=HYPER, recs=None):
    rec32, rec64 = recs or (TorchRecipe(params, tcls, hyper), TorchRecipe(params, tcls, hyper,
                                                                          master_dtype=torch.float64))
    for k in range(steps):
        grads = _grads(params, gen, none_at(k))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        rec32.step(grads)
        rec64.step(grads)
        for i, p in enumerate(params):
            if p not in opt.state:
                assert rec32.masters[i].grad is None or k == 0 and i in none_at(k)
                continue
            m = masters_of(opt, [p])[0]
            assert_close_to_oracle(f"{what} step {k} master[{i}]", m, rec32.masters[i].detach(),
                                   rec64.masters[i].detach())
            assert_bitwise(f"{what} step {k} param[{i}]", p.detach(), m.to(p.dtype))
            assert opt.state[p]["step"].item() == rec32.opt.state[rec32.masters[i]]["step"].item()
    return rec32, rec64


def _train_with_twin(model, opt, zero, steps=4):
    """Train ``model`` with ``opt`` and the fp32 recipe on a twin whose weights are set to the model's before
    each backward (so both backwards see the same weights and give the same gradients bit for bit)."""
    twin = copy.deepcopy(model)
    rec = TorchRecipe(list(model.parameters()), torch.optim.AdamW, HYPER)
    idx = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(4))
    for k in range(steps):
        zero(opt, model)
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        _loss(model, idx).backward()
        _loss(twin, idx).backward()
        grads = [q.grad for q in twin.parameters()]
        for p, g in zip(model.parameters(), grads):
            assert_bitwise(f"step {k} grad", p.grad, g)
        opt.step()
        rec.step(grads)
        for i, p in enumerate(model.parameters()):
            torch.testing.assert_close(opt.state[p]["master_param"], rec.masters[i].detach(), rtol=1e-5, atol=1e-6)
            assert_bitwise(f"step {k} param[{i}]", p.detach(), opt.state[p]["master_param"].to(p.dtype))
    return rec


@pytest.mark.parametrize("backend", cpu_backends())
def test_tied_weights_are_one_parameter_and_train_as_torch(backend):
    torch.manual_seed(0)
    model = TinyGPT()
    assert model.lm_head.weight is model.wte.weight
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, backend=backend)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    _train_with_twin(model, opt, lambda o, m: o.zero_grad())
    assert model.lm_head.weight is model.wte.weight  # still one tensor, trained once per step
    assert model.wte.weight in opt.state and opt.state[model.wte.weight]["step"].item() == 4


@pytest.mark.parametrize("backend", cpu_backends())
def test_frozen_and_gradless_parameters_are_skipped_like_torch(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)).bfloat16()
    model[0].weight.requires_grad_(False)  # frozen, but in the list, as many fine-tuning scripts do
    params = list(model.parameters())
    opt = ampfused.FusedAdamW(params, **HYPER, backend=backend)
    frozen = params[0].detach().clone()
    gen = torch.Generator().manual_seed(1)
    # param 0 never has a gradient; param 3 has none at steps 1 and 2 (a branch not taken)
    recs = _run_against_recipe(params, opt, 5, gen, none_at=lambda k: {0} | ({3} if k in (1, 2) else set()),
                               what="gradless")
    assert_bitwise("frozen parameter", params[0].detach(), frozen)  # no weight decay ever touched it
    assert params[0] not in opt.state and recs[0].masters[0].grad is None
    assert opt.state[params[3]]["step"].item() == 3 and opt.state[params[1]]["step"].item() == 5
    params[0].requires_grad_(True)  # unfrozen later: trained from then on, with a fresh state
    _run_against_recipe(params, opt, 2, gen, what="unfrozen", recs=recs)
    assert opt.state[params[0]]["step"].item() == 2


@pytest.mark.parametrize("backend", cpu_backends())
def test_strided_and_empty_parameters(backend):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).bfloat16().to(memory_format=torch.channels_last)
    transposed = nn.Parameter(torch.randn(6, 5).bfloat16().t())  # dense, not contiguous
    empty = nn.Parameter(torch.zeros(0, 3, dtype=torch.bfloat16))
    params = [conv.weight, conv.bias, transposed, empty]
    strides = [p.stride() for p in params]
    opt = ampfused.FusedAdamW(params, **HYPER, backend=backend)
    _run_against_recipe(params, opt, 4, torch.Generator().manual_seed(2), what="strided")
    assert [p.stride() for p in params] == strides
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    for p in params:
        assert opt.state[p]["exp_avg"].shape == p.shape and opt.state[p]["exp_avg"].stride() == p.stride()
    assert opt.state[empty]["step"].item() == 4  # torch counts steps of an empty parameter too


def test_non_dense_parameter_is_refused_clearly():
    base = torch.randn(4, 6)
    gappy = nn.Parameter(base[:, :3])  # a view with gaps between rows
    with pytest.raises(ValueError, match=r"stride \(6, 1\) is not dense: fused optimizers need each parameter's "
                                         r"elements in one gap-free block"):
        ampfused.FusedAdamW([gappy])


@pytest.mark.parametrize("backend", cpu_backends())
def test_add_param_group_after_steps(backend):
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3).bfloat16(), nn.Linear(3, 2).bfloat16()
    opt = ampfused.FusedAdamW(a.parameters(), **HYPER, backend=backend)
    gen = torch.Generator().manual_seed(3)
    _run_against_recipe(list(a.parameters()), opt, 2, gen, what="first group")
    opt.add_param_group({"params": list(b.parameters()), "lr": 1e-3})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == HYPER["weight_decay"]
    for p in a.parameters():
        p.grad = None
    for p in b.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in a.parameters()]
    opt.step()
    assert all(torch.equal(x, p.detach()) for x, p in zip(before, a.parameters()))
    assert all(opt.state[p]["step"].item() == 1 for p in b.parameters())


def _trained(backend="cpu", **size):
    torch.manual_seed(0)
    model = TinyGPT(**size)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, backend=backend)
    idx = torch.randint(0, 11, (2, 6))
    for _ in range(2):
        _loss(model, idx).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, idx


def test_deepcopy_of_the_model_is_an_independent_ema_copy():
    model, opt, idx = _trained()
    ema = copy.deepcopy(model)
    ema_values = {k: v.clone() for k, v in ema.state_dict().items()}
    mine = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not mine & {p.untyped_storage().data_ptr() for p in ema.parameters()}
    _loss(model, idx).backward()
    opt.step()
    for k, v in ema.state_dict().items():
        assert torch.equal(v, ema_values[k]), k


def test_deepcopy_of_model_and_optimizer_trains_like_the_original():
    model, opt, idx = _trained()
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.param_groups[0]["params"][0] is model2.wte.weight
    for m, o in ((model, opt), (model2, opt2)):
        _loss(m, idx).backward()
        o.step()
        o.zero_grad()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert_bitwise("copy", p.detach(), q.detach())
        assert p.data_ptr() != q.data_ptr()


def test_parameters_pickle_and_save_on_their_own():
    model, opt, _ = _trained()
    w = model.mlp[0].weight
    assert torch.equal(pickle.loads(pickle.dumps(w)), w)
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf), w)


def test_saved_state_dicts_hold_only_their_own_tensors():
    model, opt, _ = _trained(vocab=101, width=64)
    whole, part = io.BytesIO(), io.BytesIO()
    torch.save(model.state_dict(), whole)
    torch.save(model.mlp[2].state_dict(), part)
    own = sum(t.numel() * t.element_size() for t in model.mlp[2].state_dict().values())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(part.getvalue()) < own + 2048 < total  # not the whole model, let alone a flat buffer
    whole.seek(0)
    fresh = TinyGPT(vocab=101, width=64)
    fresh.load_state_dict(torch.load(whole))
    for (k, v), (_, u) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(v, u), k


def test_safetensors_and_save_pretrained_style_checkpoints_are_complete():
    safetensors = pytest.importorskip("safetensors.torch")
    model, opt, _ = _trained()
    with tempfile.TemporaryDirectory() as d:
        sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
        safetensors.save_file(sd, os.path.join(d, "model.safetensors"))
        safetensors.save_model(model, os.path.join(d, "pretrained.safetensors"))  # dedupes tied weights itself
        loaded = safetensors.load_file(os.path.join(d, "model.safetensors"))
        fresh = TinyGPT()
        missing, unexpected = safetensors.load_model(fresh, os.path.join(d, "pretrained.safetensors"))
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k
    assert not unexpected
    for (k, v), (_, u) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(v, u), k


def test_share_memory_after_packing_keeps_training():
    model, opt, idx = _trained()
    masters = [m.clone() for m in masters_of(opt, list(model.parameters()))]
    model.share_memory()
    assert all(p.is_shared() for p in model.parameters())
    opt.step()  # no gradients now: nothing happens, but the move is followed
    assert all(torch.equal(a, b) for a, b in zip(masters, masters_of(opt, list(model.parameters()))))
    _loss(model, idx).backward()
    opt.step()
    assert all(p.is_shared() for p in model.parameters())
    for p in model.parameters():
        assert_bitwise("shared param == round(master)", p.detach(), opt.state[p]["master_param"].to(p.dtype))


class Checkpointed(TinyGPT):
    def forward(self, idx):
        h = self.wte(idx)
        h = h + torch.utils.checkpoint.checkpoint(lambda x: self.mlp(self.ln(x)), h, use_reentrant=False)
        return self.lm_head(h)


@pytest.mark.parametrize("variant", ["gradient checkpointing", "torch.compile(model)"])
def test_checkpointing_and_a_compiled_model_train_like_the_plain_model(variant):
    torch.manual_seed(0)
    plain = TinyGPT()
    other = Checkpointed() if variant == "gradient checkpointing" else TinyGPT()
    other.load_state_dict(plain.state_dict())
    run = torch.compile(other) if variant == "torch.compile(model)" else other
    o1 = ampfused.FusedAdamW(plain.parameters(), **HYPER)
    o2 = ampfused.FusedAdamW(other.parameters(), **HYPER)
    idx = torch.randint(0, 11, (2, 6))
    for _ in range(3):
        for m, o in ((plain, o1), (run, o2)):
            _loss(m, idx).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(plain.parameters(), other.parameters()):
        if variant == "gradient checkpointing":
            assert_bitwise("checkpointed", q.detach(), p.detach())
        else:  # the compiled model's kernels round differently: the same training, not the same bits
            torch.testing.assert_close(q.detach().float(), p.detach().float(), rtol=0.05, atol=0.02)


ZEROS = {
    "opt.zero_grad()": lambda o, m: o.zero_grad(),
    "opt.zero_grad(set_to_none=False)": lambda o, m: o.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda o, m: m.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda o, m: m.zero_grad(set_to_none=False),
}


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("zero", list(ZEROS))
def test_every_zero_grad_mode_trains_as_torch(zero, backend):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, backend=backend)
    _train_with_twin(model, opt, ZEROS[zero])
    ZEROS[zero](opt, model)
    assert all((p.grad is None) == ("False" not in zero) for p in model.parameters())


@pytest.mark.parametrize("zero", ["set_to_none", "in_place"])
def test_sparse_gradients_are_refused_before_any_change(zero):
    emb = nn.Embedding(10, 4, sparse=True)
    lin = nn.Linear(4, 2)
    opt = ampfused.FusedAdamW(list(emb.parameters()) + list(lin.parameters()), lr=0.1,
                              module=nn.ModuleDict({"emb": emb, "lin": lin}))
    before = [p.detach().clone() for p in list(emb.parameters()) + list(lin.parameters())]
    for _ in range(2):
        opt.zero_grad(set_to_none=zero == "set_to_none")
        lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
        with pytest.raises(RuntimeError, match=r"parameter emb\.weight has a sparse gradient .*: fused optimizers "
                                               r"do not take sparse gradients"):
            opt.step()
    for b, p in zip(before, list(emb.parameters()) + list(lin.parameters())):
        assert torch.equal(b, p.detach())
    assert not opt.state


def test_generator_groups_keep_their_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = ampfused.FusedAdamW([
        {"params": (p for n, p in model.named_parameters() if n.endswith("weight"))},
        {"params": (p for n, p in model.named_parameters() if n.endswith("bias")), "weight_decay": 0.0},
    ])
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(opt.state) == 4


def test_amsgrad_is_refused_clearly():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="amsgrad=True: FusedAdamW does not implement AMSGrad"):
        ampfused.FusedAdamW(model.parameters(), amsgrad=True)
    tmodel = nn.Linear(3, 2)
    topt = torch.optim.AdamW(tmodel.parameters(), amsgrad=True)
    tmodel(torch.randn(2, 3)).sum().backward()
    topt.step()
    opt = ampfused.FusedAdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="amsgrad=True in loaded param_groups\\[0\\]: FusedAdamW does not implement"):
        opt.load_state_dict(topt.state_dict())
    sd = topt.state_dict()
    sd["param_groups"][0]["amsgrad"] = False
    with pytest.raises(ValueError, match="'max_exp_avg_sq' \\(an AMSGrad optimizer's state\\)"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for i, st in before["state"].items():
        for k, v in st.items():
            assert_bitwise(f"{i}.{k}", v, after["state"][i][k])


def test_torch_keyword_arguments_are_accepted_for_drop_in_use():
    model = nn.Linear(3, 2)
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-3, amsgrad=False, foreach=None, fused=True,
                              capturable=False)
    assert opt.param_groups[0]["amsgrad"] is False
    with pytest.raises(ValueError, match="differentiable=True"):
        ampfused.FusedSGD(model.parameters(), lr=0.1, differentiable=True)


def test_model_and_optimizer_saved_together_resume():
    model, opt, idx = _trained()
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    model2, opt2 = torch.load(buf, weights_only=False)
    assert opt2.param_groups[0]["params"][0] is model2.wte.weight
    for m, o in ((model, opt), (model2, opt2)):
        _loss(m, idx).backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert_bitwise("resumed from a pickle", q.detach(), p.detach())
