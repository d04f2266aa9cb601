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
