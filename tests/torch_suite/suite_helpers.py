"""What the torch-suite tests share: the fused optimizer standing in for each torch.optim class, PyTorch's own
optimizer test material (``torch.testing._internal.common_optimizers``, which needs ``expecttest``), and a run
of both optimizers on the same parameters and gradients."""
from __future__ import annotations

import copy
from typing import Callable, Dict, List

import pytest
import torch

import ampfused
from backends import cpu_backends
from oracle import assert_close_to_oracle

FUSED: Dict[type, type] = {torch.optim.Adam: ampfused.FusedAdam, torch.optim.AdamW: ampfused.FusedAdamW,
                           torch.optim.SGD: ampfused.FusedSGD}
FUSED[torch.optim.Adafactor] = ampfused.FusedAdafactor
# optimizers of matrices only (torch's Muon refuses anything else): torch's material for them, not the generic tests
MATRICES: Dict[type, type] = {torch.optim.Muon: ampfused.FusedMuon}
MATRIX_SHAPES = ((5, 3), (3, 5), (4, 4))

# What the fused optimizers refuse on purpose (docs/differences-from-torch.md), with the error each raises.
# Any configuration of torch's test material not refused here must run and match torch.
DOCUMENTED_REFUSALS = {
    "amsgrad": (ValueError, "does not implement AMSGrad"),
    "differentiable": (ValueError, "updates in place without autograd"),
}


def optim_db_entries() -> List:
    """torch's OptimizerInfo entries for Adam, AdamW, SGD, Adafactor and Muon (skips the module when torch's test
    material cannot be imported)."""
    pytest.importorskip("expecttest", reason="torch.testing._internal.common_optimizers needs expecttest")
    from torch.testing._internal.common_optimizers import optim_db
    return [info for info in optim_db if info.optim_cls in FUSED or info.optim_cls in MATRICES]


def backends_to_run() -> List[str]:
    """The default dispatch (None), and the Triton interpreter where it runs here."""
    return [None] + (["triton"] if "triton" in cpu_backends() else [])


def on_cpu(value):
    """A kwarg from a CUDA configuration with its tensors on the CPU (only the kwargs are taken from it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, tuple):
        return tuple(on_cpu(v) for v in value)
    return value


def refusal_of(kwargs: dict):
    """The documented refusal a configuration meets, or None."""
    for key, expected in DOCUMENTED_REFUSALS.items():
        if kwargs.get(key):
            return expected
    return None


def make_params(dtype: torch.dtype, seed: int = 0, shapes=((5, 3), (7,), ())) -> List[torch.Tensor]:
    """Small parameters of awkward sizes (a matrix, a vector, a scalar), exactly representable in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def grads_for(params: List[torch.Tensor], steps: int, dtype: torch.dtype, seed: int = 1) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g).to(dtype) for p in params] for _ in range(steps)]


def run_steps(opt, params, grads, scheduler: Callable = None) -> None:
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(p.dtype).clone()
        opt.step()
        if scheduler is not None:
            scheduler(opt)


def torch_kwargs(kwargs: dict, dtype: torch.dtype) -> dict:
    """The kwargs for torch's optimizer on ``dtype`` parameters (tensor hyperparameters in fp64 for the fp64
    oracle, as torch takes them)."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(torch.float64 if dtype == torch.float64 else torch.float32)
        elif isinstance(v, tuple):
            v = tuple(x.to(torch.float64 if dtype == torch.float64 else torch.float32)
                      if isinstance(x, torch.Tensor) else x for x in v)
        out[k] = v
    return out


def muon_oracle(params: List[torch.Tensor], grads: List[List[torch.Tensor]], kwargs: dict) -> List[torch.Tensor]:
    """torch.optim.Muon's steps in fp64, the iteration too: ampfused's reference step on fp64 tensors."""
    from ampfused.ops import reference, reference_muon as M
    ps = [p.detach().double().clone() for p in params]
    lr = kwargs.get("lr", 1e-3)
    lr = torch.tensor(float(lr), dtype=torch.float64)
    a, b, c = kwargs.get("ns_coefficients", M.NS_A_B_C)
    buf = torch.zeros(reference.state_layout([p.numel() for p in ps])[1], dtype=torch.float64)
    counts, stats, one = torch.zeros(len(ps)), torch.zeros(2, dtype=torch.float64), torch.ones((), dtype=torch.float64)
    for step in grads:
        g = [x.double() for x in step]
        M.muon_step_(ps, g, None, buf, counts, reference.norm_check(g, one), one, lr, stats,
                     kwargs.get("momentum", 0.95), kwargs.get("nesterov", True), kwargs.get("weight_decay", 0.1), a, b,
                     c, kwargs.get("eps", M.EPS), kwargs.get("ns_steps", M.NS_STEPS), kwargs.get("adjust_lr_fn"),
                     float("inf"))
    return ps


def compare_with_torch(torch_cls, kwargs: dict, param_dtype: torch.dtype, steps: int = 3, backend=None,
                       name: str = "") -> None:
    """``steps`` steps of torch's optimizer (fp32 and the fp64 oracle) and of the fused one on the same values:
    the fused parameters (and fp32 masters) within the design tolerance of torch's."""
    kwargs = dict(kwargs)
    kwargs.pop("foreach", None)
    kwargs.pop("fused", None)
    reference_kwargs = {k: v for k, v in kwargs.items() if k != "capturable"}  # torch's capturable needs CUDA
    matrices = torch_cls in MATRICES
    base = make_params(param_dtype, shapes=MATRIX_SHAPES) if matrices else make_params(param_dtype)
    grads = grads_for(base, steps, param_dtype)
    ref = {}
    for dt in (torch.float32, torch.float64):
        ps = [p.detach().to(dt).clone().requires_grad_() for p in base]
        if matrices and dt == torch.float64:  # torch's Muon runs its iteration in bf16 whatever the dtype
            ref[dt] = muon_oracle(ps, grads, reference_kwargs)
            continue
        topt = torch_cls(ps, **torch_kwargs(reference_kwargs, dt), **({} if matrices else dict(foreach=False)))
        run_steps(topt, ps, [[g.to(dt) for g in s] for s in grads])
        ref[dt] = ps
    ours = [p.detach().clone().requires_grad_() for p in base]
    fopt = {**FUSED, **MATRICES}[torch_cls](ours, **copy.deepcopy(kwargs), backend=backend)
    run_steps(fopt, ours, grads)
    for i, (p, r32, r64) in enumerate(zip(ours, ref[torch.float32], ref[torch.float64])):
        where = f"{name} param {i} ({param_dtype})"
        if param_dtype == torch.float32:
            assert_close_to_oracle(where, p, r32, r64)
        else:
            # the plain implementation of the same math: fp32 master weights rounded to the parameter dtype
            assert_close_to_oracle(where, p, r32.to(param_dtype), r64)
            assert_close_to_oracle(where + " master", fopt.state[p]["master_param"], r32, r64)
            assert torch.equal(p.detach(), fopt.state[p]["master_param"].to(param_dtype)), \
                f"{where}: the parameter is not its master rounded"
