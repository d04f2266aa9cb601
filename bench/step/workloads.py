"""Workloads: the parameter shapes a step runs over, and the deterministic data put in them.

Nothing is downloaded: model shapes are generated from their published configurations, and parameter and
gradient values come from seeded generators, so every variant (and the reference) sees the same bits.

Names accepted by :func:`parse`:

* ``gpt2-small`` (124M parameters, 148 tensors), ``gpt2-medium`` (355M), ``gpt-1.3b`` (GPT-3 XL shapes,
  1.3B): the parameter shapes of those models (HF GPT-2 layout: Conv1D weights ``[in, out]``, tied head).
* ``<model>/<k>``: that model's tensors (same count and layers) with width, vocabulary and context divided
  by k, about 1/k^2 of the parameters; ``gpt2-small/2`` is 31M parameters in 148 tensors.
* ``<N>x<T>``: N parameters split into T tensors of near-equal size, e.g. ``1Mx200`` (launch-bound),
  ``16Mx32``; N takes a k/M/B suffix (decimal: 1M = 1,000,000).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, ...]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

PARAM_STD = 0.02  # GPT-2 initialisation
GRAD_NORM = 4.0  # expected norm of the unscaled gradients: clipping to max_norm = 1 is active at any size


@dataclass(frozen=True)
class Workload:
    name: str
    shapes: Tuple[Shape, ...]

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    @property
    def tensors(self) -> int:
        return len(self.shapes)


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gpt_shapes(n_layer: int, d: int, vocab: int = 50257, ctx: int = 1024) -> Tuple[Shape, ...]:
    """Parameter shapes of a GPT-2-style decoder (HF layout, lm_head tied to wte)."""
    shapes: List[Shape] = [(vocab, d), (ctx, d)]  # wte, wpe
    for _ in range(n_layer):
        shapes += [(d,), (d,),                    # ln_1 weight, bias
                   (d, 3 * d), (3 * d,),          # attn.c_attn
                   (d, d), (d,),                  # attn.c_proj
                   (d,), (d,),                    # ln_2
                   (d, 4 * d), (4 * d,),          # mlp.c_fc
                   (4 * d, d), (d,)]              # mlp.c_proj
    shapes += [(d,), (d,)]  # ln_f
    return tuple(shapes)


MODELS = {  # name: (n_layer, d_model, vocab, ctx)
    "gpt2-small": (12, 768, 50257, 1024),
    "gpt2-medium": (24, 1024, 50257, 1024),
    "gpt-1.3b": (24, 2048, 50257, 2048),
}

_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "B": 10**9}
_UNIFORM = re.compile(r"^(\d+(?:\.\d+)?)([kMB]?)x(\d+)$")


def uniform(numel: int, tensors: int, name: Optional[str] = None) -> Workload:
    """``numel`` parameters in ``tensors`` 1-D tensors whose sizes differ by at most one element."""
    if tensors < 1 or numel < tensors:
        raise ValueError(f"cannot split {numel} parameters into {tensors} non-empty tensors")
    base, extra = divmod(numel, tensors)
    shapes = tuple((base + (i < extra),) for i in range(tensors))
    return Workload(name or f"{numel}x{tensors}", shapes)


_SCALED = re.compile(r"^(?P<model>[\w.-]+)/(?P<k>\d+)$")


def parse(name: str) -> Workload:
    """A workload from its name (see the module docstring)."""
    m = _SCALED.match(name)
    if m and m.group("model") in MODELS and int(m.group("k")) >= 1:
        n_layer, d, vocab, ctx = MODELS[m.group("model")]
        k = int(m.group("k"))
        return Workload(name, gpt_shapes(n_layer, d // k, vocab // k, ctx // k))
    if name in MODELS:
        return Workload(name, gpt_shapes(*MODELS[name]))
    m = _UNIFORM.match(name)
    if m:
        numel = int(round(float(m.group(1)) * _SUFFIX[m.group(2)]))
        return uniform(numel, int(m.group(3)), name)
    raise ValueError(f"unknown workload {name!r}: use one of {sorted(MODELS)}, <model>/<k> (e.g. gpt2-small/2) "
                     "or <N>[k|M|B]x<tensors> (e.g. 16Mx32)")


# Default sets per device: the design's headline case (bf16 gradients, fp32 master, clipping, a loss
# scaler). The CPU default keeps a run to a few minutes on a small machine: the 16M comparison first (it
# gets the compile budget first), then the launch-bound 1M/200 and GPT-2 small's 148 tensors at half width
# (31M) for the model-shaped point; ``--full`` adds the other dtypes, no clipping, and on CPU GPT-2 small.
SWEEP = ["1Mx200", "16Mx32", "gpt2-small", "gpt2-medium", "gpt-1.3b"]
ALL_DTYPES = ["fp32", "bf16", "fp16"]
DEFAULTS = {
    "cpu": dict(workloads=["16Mx32", "1Mx200", "gpt2-small/2"], grad_dtypes=["bf16"], clip=[True]),
    "cuda": dict(workloads=SWEEP, grad_dtypes=["bf16"], clip=[True]),
}
FULL = {
    "cpu": dict(workloads=["16Mx32", "1Mx200", "gpt2-small"], grad_dtypes=ALL_DTYPES, clip=[True, False]),
    "cuda": dict(workloads=SWEEP, grad_dtypes=ALL_DTYPES, clip=[True, False]),
}


@dataclass(frozen=True)
class Instance:
    """One benchmarked configuration: a workload on a device with a gradient dtype and a clip setting.

    Parameters have the gradient's dtype (as in autocast-free mixed precision); fp16/bf16 parameters get an
    fp32 master copy, fp32 parameters are their own master.
    """
    workload: Workload
    device: torch.device
    grad_dtype: torch.dtype
    clip: bool
    scaler: bool = True
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_norm: float = 1.0
    init_scale: float = 2.0 ** 10
    growth_interval: int = 2000
    seed: int = 0

    @property
    def param_dtype(self) -> torch.dtype:
        return self.grad_dtype

    @property
    def master(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def max_norm_or_inf(self) -> float:
        return self.max_norm if self.clip else float("inf")

    def label(self) -> str:
        return (f"{self.workload.name} {DTYPE_NAMES[self.grad_dtype]} "
                f"{'clip' if self.clip else 'noclip'}{'' if self.scaler else ' noscaler'}")


def _flat_randn(numel: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.randn(numel, generator=gen, device=device, dtype=torch.float32)


def _split(flat: torch.Tensor, shapes: Sequence[Shape]) -> List[torch.Tensor]:
    sizes = [_numel(s) for s in shapes]
    return [v.view(s) for v, s in zip(flat.split(sizes), shapes)]


def init_params(inst: Instance) -> List[torch.Tensor]:
    """Initial model parameters in the model's dtype (views of one buffer; masters start as exact fp32
    copies of them). One generator call per set keeps generation cheap at 1B parameters."""
    flat = (_flat_randn(inst.workload.numel, inst.seed * 1_000_003, inst.device) * PARAM_STD).to(inst.param_dtype)
    return _split(flat, inst.workload.shapes)


def make_grads(inst: Instance, step: int, scale: float, inject_inf: bool = False) -> List[torch.Tensor]:
    """Gradients of step ``step`` as backward would leave them: ``round(g * scale)`` in the grad dtype.

    ``inject_inf`` puts one +inf in the middle tensor, the case a scaler must skip.
    """
    n = inst.workload.numel
    flat = _flat_randn(n, (inst.seed + 1) * 7_919 + step * 104_729, inst.device)
    out = _split((flat * (GRAD_NORM / math.sqrt(n) * scale)).to(inst.grad_dtype), inst.workload.shapes)
    if inject_inf:
        mid = out[len(out) // 2].view(-1)
        mid[mid.numel() // 2] = float("inf")
    return out


def expand(names: Sequence[str], grad_dtypes: Sequence[str], clips: Sequence[bool], device: torch.device,
           scaler: bool = True) -> List[Instance]:
    """Every (workload, grad dtype, clip) combination, workloads in the order given."""
    wls = [parse(n) for n in names]
    return [Instance(w, device, DTYPES[d], c, scaler) for w in wls for d in grad_dtypes for c in clips]
