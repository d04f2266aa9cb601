"""On a CUDA device: the host never waits for the device inside a step, fresh gradient tensors included.

torch's sync-debug mode sees only the waits torch itself makes (``.item()``, blocking copies), not, for one, a
``non_blocking`` copy from pageable memory, which CUDA may serve by draining the stream first. So each test here
queues a long device sleep, records an event behind it, runs the step (whose inputs the sleep precedes), and
asserts the event has not completed when the step returns: had the host waited for the stream at any point, the
sleep would be over. No time is measured or asserted. Skipped without CUDA.
"""
import pytest
import torch
from torch import nn

import ampfused
from ampfused import ops

pytestmark = pytest.mark.gpu

SLEEP_S = 2.0  # far longer than any host work of these steps once their kernels are compiled


def _gpu_backends():
    return [b for b in ("cuda", "triton") if b in ops.available_backends("cuda")] if torch.cuda.is_available() else []


_CYCLES = {}


def _cycles_per_second() -> float:
    """The device's torch.cuda._sleep rate, measured once (outside any step)."""
    if "rate" not in _CYCLES:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES["rate"] = 50_000_000 / (start.elapsed_time(end) / 1000.0)
    return _CYCLES["rate"]


class _Behind:
    """A device sleep queued now, and the event behind it: ``busy()`` after a step is True iff the host did not
    wait for the stream during the step."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(SLEEP_S * _cycles_per_second()))
        self.event = torch.cuda.Event()
        self.event.record()
        return self

    def __exit__(self, *exc):
        self.busy = not self.event.query()
        torch.cuda.synchronize()
        return False


def _never_waits(step, what: str) -> None:
    with _Behind() as b:
        step()
    assert b.busy, f"{what} waited for the device"


def _fresh_grads(params, keep):
    """New gradient tensors (new addresses: the old ones are kept alive), as backward hands them after
    ``zero_grad()`` sets the gradients to None."""
    keep.extend(p.grad for p in params if p.grad is not None)
    for p in params:
        p.grad = torch.randn_like(p)


def _params(n=200, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(17 + 31 * k, device="cuda", dtype=torch.bfloat16, requires_grad=True) for k in range(n)]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("cls", [ampfused.FusedAdamW, ampfused.FusedSGD])
def test_step_with_fresh_gradients_never_waits(cls, backend):
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    params, keep = _params(), []
    kw = dict(momentum=0.9) if cls is ampfused.FusedSGD else {}
    opt = cls(params, lr=1e-3, max_grad_norm=1.0, backend=backend, **kw)
    for _ in range(2):  # compiles the kernels, allocates the state
        _fresh_grads(params, keep)
        opt.step()
    for k in range(3):
        _fresh_grads(params, keep)
        _never_waits(opt.step, f"step {k} with fresh gradient tensors ({backend})")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("options", [dict(store_param_remainders=True),
                                     dict(bf16_stochastic_round=True, exp_avg_dtype=torch.bfloat16,
                                          exp_avg_sq_dtype=torch.bfloat16)], ids=["remainders", "sr-bf16-moments"])
def test_compact_state_steps_never_wait(options, backend):
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    params, keep = _params(), []
    opt = ampfused.FusedAdamW(params, lr=1e-3, max_grad_norm=1.0, backend=backend, **options)
    for _ in range(2):
        _fresh_grads(params, keep)
        opt.step()
    _fresh_grads(params, keep)
    _never_waits(opt.step, f"a step of FusedAdamW({options}) with fresh gradient tensors ({backend})")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_scaler_step_and_update_with_fresh_gradients_never_wait(backend):
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    params, keep = _params(), []
    opt = ampfused.FusedAdamW(params, lr=1e-3, max_grad_norm=1.0, backend=backend)
    scaler = ampfused.GradScaler("cuda", init_scale=1024.0)
    scaler.scale(torch.ones((), device="cuda"))
    for _ in range(2):
        _fresh_grads(params, keep)
        scaler.step(opt)
        scaler.update()
    _fresh_grads(params, keep)
    _never_waits(lambda: (scaler.step(opt), scaler.update()),
                 f"scaler.step + update with fresh gradient tensors ({backend})")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_step_after_load_state_dict_and_add_param_group_never_waits(backend):
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    params, keep = _params(50), []
    opt = ampfused.FusedAdamW(params, lr=1e-3, backend=backend)
    other = ampfused.FusedAdamW(params, lr=1e-3, backend="reference")
    for _ in range(2):
        _fresh_grads(params, keep)
        opt.step()
        other.step()
    opt.load_state_dict(other.state_dict())
    _fresh_grads(params, keep)
    _never_waits(opt.step, f"the first step after load_state_dict ({backend})")

    extra = _params(20, seed=1)  # same dtype: the new group's segment needs plans, not new kernels
    opt.add_param_group({"params": extra, "lr": 1e-4})
    _fresh_grads(params + extra, keep)
    _never_waits(opt.step, f"the first step after add_param_group ({backend})")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_default_training_loop_never_waits(backend):
    """The loop users run: zero_grad() to None, forward, backward, step, with a batch size that changes."""
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda().to(torch.bfloat16)
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, backend=backend)

    def backward(batch):
        x = torch.randn(batch, 64, device="cuda", dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()

    def step():
        opt.step()
        opt.zero_grad()

    for batch in (8, 16, 8):
        backward(batch)
        step()
    for batch in (24, 8, 40):
        # forward and backward before the sleep: the first GEMM of a new shape may make CUDA load its kernel,
        # which it may do by synchronizing the context (lazy loading), a wait of the loop's first batch of that
        # size whatever the optimizer; the step that follows reads gradients at new addresses all the same
        backward(batch)
        _never_waits(step, f"the default loop's step (batch {batch}, {backend})")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_first_step_after_a_device_move_is_reported(backend, capsys):
    """The first step after the model moves to the GPU carries the state there; it may wait (reported, not
    asserted); the steps after it must not."""
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available on cuda")
    torch.manual_seed(0)
    model = nn.Linear(32, 32).to(torch.bfloat16)
    opt = ampfused.FusedAdamW(model.parameters(), lr=1e-3)  # the CPU's default backend
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad()
    model.cuda()
    opt.backend = backend  # (the default would pick cuda: name each GPU backend in turn)
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    model(x).float().sum().backward()
    with _Behind() as b:
        opt.step()
    with capsys.disabled():
        print(f"\n[no-wait] first step after a CPU->CUDA move ({backend}): "
              f"{'no host wait' if b.busy else 'the host waited'}")
    opt.zero_grad()
    for _ in range(2):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    model(x).float().sum().backward()
    _never_waits(opt.step, f"a step after the move's first step ({backend})")


@pytest.mark.parametrize("options", [{}, dict(store_param_remainders=True, momentum_dtype=torch.uint8)],
                         ids=["fp32-master", "remainders-q8m"])
def test_muon_step_never_waits(options):
    """FusedMuon on CUDA (its Triton passes, the iteration on cuBLAS between them, AdamW's groups beside): the
    steps after the first two wait for nothing."""
    if "triton" not in _gpu_backends():
        pytest.skip("triton not available on cuda")
    torch.manual_seed(0)
    mats = [torch.randn(64 + 16 * k, 48, device="cuda", dtype=torch.bfloat16, requires_grad=True) for k in range(6)]
    vecs = [torch.randn(48, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    opt = ampfused.FusedMuon([dict(params=mats), dict(params=vecs, use_muon=False)], lr=0.02, max_grad_norm=1.0,
                             **options)
    keep = []
    for _ in range(2):
        _fresh_grads(mats + vecs, keep)
        opt.step()
    for k in range(2):
        _fresh_grads(mats + vecs, keep)
        _never_waits(opt.step, f"FusedMuon step {k} ({options})")
