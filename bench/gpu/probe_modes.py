"""The sanitize probe's state modes: every compact state mode of FusedAdamW (docs/state-precision.md) for a few
steps on one backend, against the same mode on the reference backend on the same device, so the sanitizers see
each mode's loads and stores (remainders, stochastic rounding, bf16 and 8-bit moments) on both GPU backends."""
from __future__ import annotations

from .probe_common import Report, _torch, assert_close

# (name, FusedAdamW options): the modes of bench/step/modes.py, spelled here so the probe imports no benchmark code
_BF16M = dict(exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16")
_Q8M = dict(exp_avg_dtype="uint8", exp_avg_sq_dtype="uint8")
STATE_MODES = [
    ("rem", dict(store_param_remainders=True)),
    ("bf16m", dict(_BF16M)),
    ("rem+bf16m", dict(store_param_remainders=True, **_BF16M)),
    ("sr", dict(bf16_stochastic_round=True)),
    ("sr+bf16m", dict(bf16_stochastic_round=True, **_BF16M)),
    ("q8m", dict(_Q8M)),
    ("rem+q8m", dict(store_param_remainders=True, **_Q8M)),
    ("sr+q8m", dict(bf16_stochastic_round=True, **_Q8M)),
]
# odd lengths and lengths around the 256-element block of the 8-bit moments
SHAPES = [(1,), (3,), (255,), (257,), (1023, 3), (4099,)]
STEPS = 3  # the second one overflows and must change nothing


def _options(opts: dict) -> dict:
    torch = _torch()
    return {k: getattr(torch, v) if k.endswith("_dtype") else v for k, v in opts.items()}


def _train(device, backend: str, opts: dict):
    """STEPS steps of FusedAdamW with ampfused.GradScaler over bf16 parameters of SHAPES; per step, whether any
    weight changed. Fresh gradient tensors each step, as backward after ``zero_grad()`` hands them over."""
    torch = _torch()
    import ampfused
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(device, torch.bfloat16)) for s in SHAPES]
    opt = ampfused.FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend, **_options(opts))
    scaler = ampfused.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=2)
    scaler.scale(torch.zeros((), device=device))
    moved = []
    for k in range(STEPS):
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 2.0 ** 10).to(device, torch.bfloat16)
        if k == 1:
            params[3].grad.view(-1)[7] = float("inf")
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved.append(any(not torch.equal(b, p) for b, p in zip(before, params)))
    return params, moved


def sanitize_modes(rep: Report, device, backend: str) -> None:
    torch = _torch()
    for name, opts in STATE_MODES:
        with rep.check(f"{backend} FusedAdamW state mode {name}, {STEPS} steps (one overflows)"):
            ref, _ = _train(device, "reference", opts)
            got, moved = _train(device, backend, opts)
            if moved != [True, False, True]:
                raise AssertionError(f"weights changed per step {moved}, expected [True, False, True]")
            for i, (a, b) in enumerate(zip(got, ref)):
                if not bool(torch.isfinite(a.float()).all()):
                    raise AssertionError(f"param[{i}]: non-finite weights")
                # a bf16 weight: within an ulp per step of the reference backend's (stochastic rounding draws
                # the same bits on every backend, so they agree unless a norm rounds apart)
                assert_close(f"param[{i}]", a, b, STEPS * 2.0 ** -7, 1e-6)
