"""On a CUDA device: the fused step with each GPU backend matches the reference, never syncs with the host,
and can be captured in a CUDA graph. Skipped without CUDA."""
import pytest
import torch

import ampfused
from ampfused import ops
from oracle import no_host_sync

pytestmark = pytest.mark.gpu


def _gpu_backends():
    return [b for b in ("cuda", "triton") if b in ops.available_backends("cuda")] if torch.cuda.is_available() else []


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("cls", [ampfused.FusedAdamW, ampfused.FusedAdam, ampfused.FusedSGD])
def test_gpu_step_matches_reference_without_host_sync(cls, backend):
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    torch.manual_seed(0)
    sizes = [1, 127, 65537, 4096 * 1024 + 3] + [5] * 300
    ref = [torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in sizes]
    new = [p.detach().clone().requires_grad_() for p in ref]
    kw = dict(lr=1e-2, max_grad_norm=1.0)
    o_ref = cls(ref, **kw, backend="reference")
    o_new = cls(new, **kw, backend=backend, spike_guard=ampfused.SpikeGuard(factor=10.0, window=4, warmup=2))
    scaler = ampfused.GradScaler("cuda", init_scale=1024.0, growth_interval=3)
    for k in range(8):
        grads = [torch.randn_like(p) for p in ref]
        if k == 4:
            grads[2][7] = float("inf")
        for a, b, g in zip(ref, new, grads):
            a.grad = g.clone()
            b.grad = g * scaler.get_scale()
        o_ref.step()
        scaler.scale(torch.ones((), device="cuda"))
        with no_host_sync():
            scaler.step(o_new)
            scaler.update()
        assert bool(o_new.last_step_skipped) == bool(o_ref.last_step_skipped) == (k == 4)
        torch.testing.assert_close(o_new.last_grad_norm, o_ref.last_grad_norm, rtol=1e-5, atol=0)
        for a, b in zip(ref, new):
            torch.testing.assert_close(o_new.state[b]["master_param"], o_ref.state[a]["master_param"],
                                       rtol=1e-5, atol=1e-6)
            assert torch.equal(b.detach(), o_new.state[b]["master_param"].to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_step_captured_in_cuda_graph(backend):
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    params = [torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    eager = [p.detach().clone().requires_grad_() for p in params]
    lr = torch.tensor(1e-2, device="cuda")
    opt = ampfused.FusedAdamW(params, lr=lr, max_grad_norm=1.0, backend=backend)
    ref = ampfused.FusedAdamW(eager, lr=lr, max_grad_norm=1.0, backend=backend)
    for p, q in zip(params, eager):  # the gradients live in fixed tensors that the graph reads
        p.grad = torch.zeros_like(p)
        q.grad = torch.zeros_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up: compile kernels, create workspaces
            opt.step()
            ref.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        opt.step()
    for k in range(3):
        for p, q in zip(params, eager):
            grad = torch.randn_like(p)
            p.grad.copy_(grad)
            q.grad.copy_(grad)
        g.replay()
        ref.step()
    torch.cuda.synchronize()
    for p, q in zip(params, eager):
        assert torch.equal(p, q)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_scaler_and_fused_step_captured_in_one_cuda_graph(backend):
    """The whole iteration after backward (scaler.step + scaler.update: K1, K2, the scale update) captured once
    and replayed equals eager iterations bit for bit, overflow skips and scale changes included."""
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    torch.manual_seed(0)
    shapes = [(300, 7), (5,), (64, 64)]
    runs = []
    start = [torch.randn(s, device="cuda", dtype=torch.float16) for s in shapes]
    for _ in range(2):  # two optimizers over equal parameters: one captured and replayed, one eager
        params = [x.clone().requires_grad_() for x in start]
        for p in params:
            p.grad = torch.zeros_like(p)  # fixed gradient tensors: the graph reads these addresses
        opt = ampfused.FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend)
        scaler = ampfused.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=2, backend=backend)
        scaler.scale(torch.ones((), device="cuda"))
        runs.append((params, opt, scaler))
    (gp, gopt, gscaler), (ep, eopt, escaler) = runs
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for params, opt, scaler in runs:  # warm-up: tables, workspaces, the scale's reciprocal
            for _ in range(2):
                scaler.step(opt)
                scaler.update()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gscaler.step(gopt)
        gscaler.update()
    for k in range(6):
        grads = [torch.randn_like(p) * 2.0 ** 12 for p in gp]
        if k == 3:
            grads[1][2] = float("inf")
        for p, q, g in zip(gp, ep, grads):
            p.grad.copy_(g)
            q.grad.copy_(g)
        graph.replay()
        escaler.step(eopt)
        escaler.update()
        torch.cuda.synchronize()
        assert gscaler.get_scale() == escaler.get_scale(), f"replay {k}: scales differ"
        for p, q in zip(gp, ep):
            assert torch.equal(p, q), f"replay {k}: parameters differ"
            assert torch.equal(gopt.state[p]["master_param"], eopt.state[q]["master_param"])
