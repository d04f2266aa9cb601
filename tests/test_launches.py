"""A fused step launches ampfused's kernels and nothing else: no torch elementwise op around them.

On the CPU the glue that would become extra GPU launches shows as dispatched operators: a warm step (plain, or
``scaler.step`` + ``scaler.update`` with the default policy) may allocate its partials and take views, but runs
no torch kernel. On a GPU the profiler counts the kernels themselves: K1 and K2 for a plain step, and the scale
update (which also forms the next 1/scale and counts the overflow) as a third with the scaler.
"""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ampfused
from backends import cpu_backends
from bench.common.measure import device_kernels

# operators that launch no kernel: allocation, views, conversions to the dtype/device a tensor already has
NO_KERNEL = {"aten::empty", "aten::select", "aten::as_strided", "aten::view", "aten::alias", "aten::detach",
             "aten::to", "aten::_to_copy_noop"}


def _outermost(events):
    return [e.name for e in events if e.cpu_parent is None or e.cpu_parent.name.startswith("Optimizer.")]


def _setup(backend, device="cpu", zero_to_none=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(5)]).to(device, torch.bfloat16)
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler(device, init_scale=1024.0, backend=backend)

    def grads():
        if zero_to_none:
            opt.zero_grad()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.randn_like(p)
            else:
                p.grad.copy_(torch.randn_like(p))
    return model, opt, scaler, grads


# The native CPU backend: the reference computes with torch ops by design, and the Triton interpreter's own
# argument handling shows as operators (on a GPU the Triton backend is counted by its kernels, below).
@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b == "cpu"])
@pytest.mark.parametrize("zero_to_none", [True, False], ids=["grads-set-to-None", "grads-zeroed-in-place"])
def test_a_warm_fused_step_runs_no_torch_kernel(backend, zero_to_none):
    model, opt, scaler, grads = _setup(backend, zero_to_none=zero_to_none)
    scaler.scale(torch.ones(()))
    for _ in range(3):  # warm: tables built, scale and its reciprocal formed
        grads()
        scaler.step(opt)
        scaler.update()
        grads()
        opt.step()
    grads()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    plain = [n for n in _outermost(prof.events()) if not n.startswith("Optimizer.")]
    assert set(plain) <= NO_KERNEL, plain
    grads()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        scaler.step(opt)
        scaler.update()
    scaled = [n for n in _outermost(prof.events()) if not n.startswith("Optimizer.")]
    assert set(scaled) <= NO_KERNEL, scaled
    assert scaler._inv.item() == 1.0 / scaler.get_scale()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_kernels_per_step_on_the_gpu(backend):
    if backend not in ampfused.ops.available_backends("cuda"):
        pytest.skip(f"backend {backend} not available on cuda")
    model, opt, scaler, grads = _setup(backend, "cuda")
    scaler.scale(torch.ones((), device="cuda"))
    for _ in range(3):
        grads()
        scaler.step(opt)
        scaler.update()
    torch.cuda.synchronize()

    def kernels(fn):
        grads()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in device_kernels(prof.events())]

    plain = kernels(opt.step)
    assert len(plain) == 2, plain
    scaled = kernels(lambda: (scaler.step(opt), scaler.update()))
    assert len(scaled) <= 3, scaled
