"""On a CUDA device: a fused optimizer built on a CPU model follows the model to the GPU, as torch.optim does.

Plain ``model.cuda()``, accelerate's ``prepare`` and the transformers ``Trainer`` (``optimizers=``) all move
the model after the optimizer was built; each run must train as the same script with ``torch.optim.AdamW``
does. Also: optimizer state saved on one device loads into an optimizer on the other. Skipped without CUDA
(and each framework's test without its package).
"""
import copy

import pytest
import torch
from torch import nn

import ampfused
from oracle import assert_bitwise, assert_close_to_oracle
from recipe import TorchRecipe, masters_of

pytestmark = pytest.mark.gpu
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _gpu_backends():
    return [b for b in ("cuda", "triton") if torch.cuda.is_available() and b in ops_available()]


def ops_available():
    return ampfused.ops.available_backends("cuda")


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 10), nn.GELU(), nn.Linear(10, 3)).to(dtype)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_model_cuda_after_build_trains_as_the_recipe_on_the_gpu(dtype, backend):
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    model = _model(dtype)
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER, max_grad_norm=1.0, backend=backend)
    cpu_ptrs = [p.data_ptr() for p in model.parameters()]
    model.cuda()
    params = list(model.parameters())
    assert all(p.is_cuda for p in params) and [p.data_ptr() for p in params] != cpu_ptrs
    rec32 = TorchRecipe(params, torch.optim.AdamW, HYPER, max_norm=1.0)
    rec64 = TorchRecipe(params, torch.optim.AdamW, HYPER, master_dtype=torch.float64, max_norm=1.0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for k in range(10):
        grads = [torch.randn(p.shape, device="cuda", generator=gen).to(dtype) for p in params]
        if k == 4:
            grads[1][0] = float("inf")
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        found = k == 4
        if not found:
            rec32.step(grads)
            rec64.step(grads)
        assert bool(opt.last_step_skipped) == found
        for i, (p, m) in enumerate(zip(params, masters_of(opt, params))):
            assert m.is_cuda
            assert_close_to_oracle(f"{dtype} step {k} master[{i}]", m, rec32.masters[i].detach(),
                                   rec64.masters[i].detach())
            if dtype != torch.float32:
                assert_bitwise(f"step {k} param[{i}]", p.detach(), m.to(dtype))
    assert opt.last_grad_norm.is_cuda


def test_state_saved_on_one_device_loads_on_the_other():
    model = _model(torch.bfloat16).cuda()
    opt = ampfused.FusedAdamW(model.parameters(), **HYPER)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    cpu_sd = copy.deepcopy({"state": {i: {k: v.cpu() for k, v in s.items()} for i, s in sd["state"].items()},
                            "param_groups": sd["param_groups"]})
    cpu_model = _model(torch.bfloat16)
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    cpu_opt = ampfused.FusedAdamW(cpu_model.parameters(), **HYPER)
    cpu_opt.load_state_dict(sd)  # cuda tensors into a CPU optimizer
    gpu_opt = ampfused.FusedAdamW(model.parameters(), **HYPER)
    gpu_opt.load_state_dict(cpu_sd)  # cpu tensors into a CUDA optimizer
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "master_param"):
            assert gpu_opt.state[p][k].is_cuda and not cpu_opt.state[q][k].is_cuda
            assert torch.equal(gpu_opt.state[p][k].cpu(), cpu_opt.state[q][k])
            assert torch.equal(gpu_opt.state[p][k], opt.state[p][k])


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 6, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _accelerate_run(opt_cls, mixed_precision, steps=40):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed
    AcceleratorState._reset_state(True)  # a fresh Accelerator per run: its mixed precision is set once a process
    GradientState._reset_state()
    set_seed(0)
    model = _model(torch.float32)  # fp32 weights on the CPU; autocast does the low precision
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=0.1)  # built before prepare, as the docs do it
    loader = torch.utils.data.DataLoader(_Data(), batch_size=16, shuffle=False)
    acc = accelerate.Accelerator(mixed_precision=mixed_precision)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert next(model.parameters()).is_cuda
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x).float(), y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_accelerate_prepare_after_build_trains_as_torch(mixed_precision):
    ours = _accelerate_run(ampfused.FusedAdamW, mixed_precision)
    ref = _accelerate_run(torch.optim.AdamW, mixed_precision)
    assert ours[-1] < ours[0]
    assert abs(ours[-1] - ref[-1]) <= 1e-3 * abs(ref[-1]) + 1e-4, (ours[-5:], ref[-5:])


def _trainer_run(make_opt, steps=20):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)  # on the CPU; the Trainer moves it
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=g)]
    opt = make_opt(model)
    args = transformers.TrainingArguments(output_dir="/tmp/ampfused-trainer", max_steps=steps, bf16=True,
                                          per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1,
                                          report_to=[], save_strategy="no", max_grad_norm=1.0, seed=0,
                                          lr_scheduler_type="constant")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(opt, None) if opt is not None else (None, None))
    trainer.train()
    assert next(model.parameters()).is_cuda
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_transformers_trainer_optimizers_argument_trains_as_torch():
    ours = _trainer_run(lambda m: ampfused.FusedAdamW(m.parameters(), lr=1e-3, weight_decay=0.0))
    ref = _trainer_run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0))
    assert ours[-1] < ours[0]
    assert abs(ours[-1] - ref[-1]) <= 1e-3 * abs(ref[-1]), (ours[-5:], ref[-5:])


def _compiled_kernels() -> int:
    """Compiled variants held by every Triton kernel of ampfused (the first entry of each device cache is its
    kernel cache in the triton versions supported)."""
    import importlib
    total = 0
    for name in ("adam", "sgd", "norm_check"):
        mod = importlib.import_module(f"ampfused.triton_kernels.{name}")
        for obj in vars(mod).values():
            caches = getattr(obj, "device_caches", None)
            if caches is not None and hasattr(obj, "run"):
                total += sum(len(entry[0]) for entry in caches.values())
    return total


@pytest.mark.parametrize("cls,changes", [
    (ampfused.FusedAdamW, [dict(lr=3e-3), dict(betas=(0.8, 0.95)), dict(eps=1e-6), dict(weight_decay=0.3),
                           dict(max_grad_norm=0.5), dict(lr="a cuda tensor")]),
    (ampfused.FusedSGD, [dict(lr=3e-3), dict(momentum=0.5), dict(dampening=0.2), dict(weight_decay=1e-4),
                         dict(max_grad_norm=0.5)]),
])
def test_triton_hyperparameter_changes_do_not_recompile(cls, changes):
    if "triton" not in _gpu_backends():
        pytest.skip("triton not available on cuda")
    model = _model(torch.bfloat16).cuda()
    kw = dict(lr=1e-2, max_grad_norm=1.0) if cls is ampfused.FusedAdamW else dict(lr=1e-2, momentum=0.9,
                                                                                   max_grad_norm=1.0)
    opt = cls(model.parameters(), **kw, backend="triton")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for _ in range(2):
        opt.step()
    compiled = _compiled_kernels()
    assert compiled > 0
    for change in changes:
        if change.get("lr") == "a cuda tensor":
            change = dict(lr=torch.tensor(1e-3, device="cuda"))
        opt.param_groups[0].update(change)
        opt.step()
    torch.cuda.synchronize()
    assert _compiled_kernels() == compiled, "a hyperparameter change compiled a new kernel"
