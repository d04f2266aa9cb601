"""Data whose gradients are exact in bf16, so a data-parallel run and a single-process run on the concatenated
batch see bitwise the same global gradient, and what the tests compare.

The model is ``nn.Linear(FIN, FOUT)`` in bf16 with the loss ``sum(model(x) * c)``: the gradients
(``c^T x`` and ``sum(c)``) do not depend on the weights, and with small integer ``x`` and ``c`` every product
and every partial sum is an integer well inside bf16's 8 mantissa bits, whatever the order of summation.
"""
import torch

FIN, FOUT = 16, 8


def batches(steps: int, rows: int, seed: int = 1):
    """``(x, c)``: ``[steps, rows, FIN]`` and ``[steps, rows, FOUT]`` bf16 small integers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (steps, rows, FIN), generator=g).to(torch.bfloat16)
    c = torch.randint(-2, 3, (steps, rows, FOUT), generator=g).to(torch.bfloat16)
    return x, c


def linear_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(FIN, FOUT).to(torch.bfloat16)


def exact_grads(x: torch.Tensor, c: torch.Tensor, divisor: float):
    """fp64 gradients of ``sum(model(x) * c) / divisor`` for weight and bias."""
    return [c.double().T @ x.double() / divisor, c.double().sum(0) / divisor]


def snapshot(opt, params, extra=None) -> dict:
    """Everything a step leaves behind, per parameter (cloned, on the CPU)."""
    out = {"params": [p.detach().clone() for p in params]}
    for key in ("master_param", "exp_avg", "exp_avg_sq", "step", "momentum_buffer"):
        vals = [opt.state[p].get(key) for p in params]
        if all(v is not None for v in vals):
            out[key] = [torch.as_tensor(v).detach().clone() for v in vals]
    out.update(extra or {})
    return out


def checkpoint_phase(model, opt, ckpt, phase: str, rank: int, first_steps) -> None:
    """One side of a checkpoint round trip: ``save`` runs ``first_steps()`` then writes the model's weights and
    the optimizer's state dict to ``ckpt`` (rank 0 writes); ``load`` reads both back into ``model`` and ``opt``."""
    if phase == "save":
        first_steps()
        sd = {"optim": opt.state_dict(), "model": [p.detach().clone() for p in model.parameters()]}
        if rank == 0:
            torch.save(sd, ckpt)
        return
    sd = torch.load(ckpt, weights_only=False)
    with torch.no_grad():
        for p, v in zip(model.parameters(), sd["model"]):
            p.copy_(v)
    opt.load_state_dict(sd["optim"])


def adafactor_oracle(model, grads_of, steps: int, hyper: dict, max_norm, divisor: float = 1.0,
                     init_scale: float = 2.0 ** 8) -> dict:
    """The fp64 oracle of an Adafactor run (the reference step in fp64) on ``model``'s initial weights, with the
    loss scale of ``ampfused.GradScaler(init_scale=..., growth_interval=1)``: ``grads_of(k)`` gives step ``k``'s
    unscaled gradients, which the step divides by ``divisor``. Returns ``{"params"|"step"|<state key>: {name:
    tensor}}``."""
    import math

    from ampfused.ops import reference
    from ampfused.ops.reference_adafactor import adafactor_step_, factor_layout, factor_views
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach().double() for p in model.parameters()]
    factors = torch.zeros(factor_layout([p.shape for p in params])[1], dtype=torch.float64)
    counts, stats, scale = torch.zeros(len(params)), torch.zeros(2), init_scale
    eps1, eps2 = hyper["eps"]
    for k in range(steps):
        grads = [g.double() * scale for g in grads_of(k)]
        inv = torch.tensor(1.0 / (scale * divisor))
        partials = reference.norm_check(grads, inv)
        adafactor_step_(params, grads, None, factors, counts, partials, inv, torch.tensor(hyper["lr"]), stats, -0.8,
                        eps1, eps2, 1.0, hyper["weight_decay"], math.inf if max_norm is None else max_norm)
        scale = scale * 0.5 if stats[1].item() else scale * 2.0
    offs, _ = factor_layout([p.shape for p in params])
    out = {"params": dict(zip(names, params)), "step": dict(zip(names, counts.unbind()))}
    for name, p, o in zip(names, params, offs):
        for key, v in factor_views(factors, o, p.shape).items():
            out.setdefault(key, {})[name] = v
    return out
