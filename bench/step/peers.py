"""Other libraries' low-precision AdamW as benchmark variants (``python -m bench --peers``).

Each peer trains the bf16 model directly (no fp32 master), with torch's recipe around it: ``GradScaler``
(``unscale_``, the inf check, ``step`` skipped on overflow, ``update``) and ``clip_grad_norm_(foreach=True)``,
so a row does the same work as every other row. The packages are optional (``pip install '.[peers]'``, pinned
in setup.py); an absent one, or one that cannot run on the device, is reported unavailable with the reason.

=========================  ==================================================================  ==========
variant                    optimizer                                                           state
=========================  ==================================================================  ==========
``torchao-adamw-sr``       ``torchao.optim.AdamW(bf16_stochastic_round=True)`` (``_AdamW`` in   bf16 m, v
                           torchao 0.18, which keeps the class under that name)
``torchao-adamw8bit``      ``torchao.optim.AdamW8bit(bf16_stochastic_round=True)``               8-bit m, v
``torchao-adamw4bit``      ``torchao.optim.AdamW4bit(bf16_stochastic_round=True)``               4-bit m, v
``optimi-adamw``           ``optimi.AdamW(kahan_sum=False)``: bf16 weights rounded to nearest    bf16 m, v
``optimi-adamw-kahan``     ``optimi.AdamW(kahan_sum=True)``: a bf16 Kahan compensation           bf16 m, v, c
``flashoptim-adamw``       ``flashoptim.FlashAdamW`` (CUDA only)                                 its own
=========================  ==================================================================  ==========

The sanity check before timing (the same check steps as every variant, against ampfused.ops.reference,
which is torch's AdamW): the reported norm (torch's ``clip_grad_norm_``), the loss scale exactly, and per
tensor

* the weights, the only state every library keeps in the same form (optimi scales its moments its own way,
  torchao quantizes only tensors above a size), within ``n`` bf16 ulps after ``n`` updates (stochastic
  rounding moves a weight at most one ulp from the fp32 result per update, round to nearest half of one) plus
  the update error the moments' format can cause: up to ``16 * 2^-7`` of an update for bf16 moments computed in
  bf16 arithmetic, the whole update for quantized moments (a small element rounded to 0), times Adam's bound
  ``lr * R`` per update (bench/step/modes.py); with quantized moments up to ``QUANTIZED_OUTLIERS`` (1e-4) of a
  tensor's weights may go beyond that (a second moment coded as about 0 makes an update larger than Adam's
  bound), none of them non-finite.

A peer that runs the wrong rule (a step taken on an overflow, a missed unscale or clip, another epsilon or
decay) fails the moments by far more than these allowances.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import Tensor, nn

from ..common.bytes import mode_bytes_per_param
from .check import CorrectnessError, Expected, Plan, norm_error
from .check import run_check_steps
from .modes import _weight_bound, _within, adam_ratio_bound
from .variants import Runner, Snapshot, Unavailable, Variant
from .workloads import Instance

# the versions of the peers extra (setup.py); a different installed version is noted, not refused
# relative error of a bf16 moment computed in bf16 arithmetic over a few steps (16 ulps of 2^-7: each of the
# lerp's roundings may add one); an update's error is at most this fraction of the update
PEER_BF16_REL = 16 * 2.0 ** -7
# quantized moments: a block's scale is set by its largest element, so a small second moment in it can be coded
# as (nearly) 0 and that element's update exceed Adam's bound; a sanity check lets this fraction of a tensor's
# weights go beyond the allowance (torchao's AdamW8bit: 1 of 131072 in a 4M-parameter check)
QUANTIZED_OUTLIERS = 1e-4
PINS = {"torchao": "0.18.0", "torch-optimi": "0.3.3", "flashoptim": "0.1.4"}


@dataclass
class Peer:
    name: str
    dist: str  # the distribution (pip name), a key of PINS
    module: str
    make: Callable[[object, List[Tensor], Instance], torch.optim.Optimizer]  # (module, params, inst)
    cuda_only: bool = False
    text: str = ""


def _torchao_adamw(mod, params, inst):
    cls = getattr(mod, "AdamW", None) or getattr(mod, "_AdamW")
    return cls(params, lr=inst.lr, betas=inst.betas, eps=inst.eps, weight_decay=inst.weight_decay,
               bf16_stochastic_round=True)


def _torchao(cls_name):
    def make(mod, params, inst):
        return getattr(mod, cls_name)(params, lr=inst.lr, betas=inst.betas, eps=inst.eps,
                                      weight_decay=inst.weight_decay, bf16_stochastic_round=True)
    return make


def _optimi(kahan):
    def make(mod, params, inst):
        return mod.AdamW(params, lr=inst.lr, betas=inst.betas, eps=inst.eps, weight_decay=inst.weight_decay,
                         kahan_sum=kahan)
    return make


def _flash(mod, params, inst):
    return mod.FlashAdamW(params, lr=inst.lr, betas=inst.betas, eps=inst.eps, weight_decay=inst.weight_decay)


PEERS: List[Peer] = [
    Peer("torchao-adamw-sr", "torchao", "torchao.optim", _torchao_adamw,
         text="torchao AdamW, bf16 stochastic rounding"),
    Peer("torchao-adamw8bit", "torchao", "torchao.optim", _torchao("AdamW8bit"), text="torchao AdamW8bit"),
    Peer("torchao-adamw4bit", "torchao", "torchao.optim", _torchao("AdamW4bit"), text="torchao AdamW4bit"),
    Peer("optimi-adamw", "torch-optimi", "optimi", _optimi(False), text="optimi AdamW, bf16"),
    Peer("optimi-adamw-kahan", "torch-optimi", "optimi", _optimi(True), text="optimi AdamW, bf16 + Kahan sum"),
    Peer("flashoptim-adamw", "flashoptim", "flashoptim", _flash, cuda_only=True, text="flashoptim FlashAdamW"),
]


def _dequantized(t: Tensor) -> Tensor:
    return t.dequantize() if hasattr(t, "dequantize") and type(t) is not torch.Tensor else t


def _code_gap(t: Tensor) -> Optional[float]:
    """Half the largest gap between adjacent codes of a quantized state's map (None: not quantized)."""
    qmap = getattr(t, "qmap", None)
    if qmap is None or type(t) is torch.Tensor:
        return None
    q = qmap.detach().double().flatten().sort().values
    return float((q[1:] - q[:-1]).max()) / 2


class PeerRunner(Runner):
    """The bf16 model, torch's GradScaler and clip, a peer's optimizer stepping the weights in place."""

    def __init__(self, variant: str, peer: Peer, mod, inst: Instance, params: List[Tensor]):
        super().__init__(variant, "peer")
        self.inst = inst
        self.params0 = params
        self.model = [nn.Parameter(p.detach().clone()) for p in params]
        for p in self.model:
            p.grad = torch.zeros_like(p)
        self._grads = [p.grad for p in self.model]
        self.opt = peer.make(mod, self.model, inst)
        self.scaler = None
        if inst.scaler:
            self.scaler = torch.amp.GradScaler(inst.device.type, init_scale=inst.init_scale,
                                               growth_interval=inst.growth_interval)
            self.scaler.scale(torch.zeros((), device=inst.device))
        self.norm: Optional[Tensor] = None

    def set_grads(self, grads: List[Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self._grads, grads)

    def step(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        self.norm = None
        if self.inst.clip:
            self.norm = torch.nn.utils.clip_grad_norm_(self.model, self.inst.max_norm, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()

    def _state(self, key: str) -> List[Tensor]:
        return [self.opt.state[p][key] for p in self.model]

    def snapshot(self) -> Snapshot:
        return Snapshot(param=[p.detach() for p in self.model], master=None,
                        exp_avg=[_dequantized(t) for t in self._state("exp_avg")],
                        exp_avg_sq=[_dequantized(t) for t in self._state("exp_avg_sq")],
                        scale=self.scaler.get_scale() if self.scaler is not None else None, norm=self.norm)

    def state_tensors(self) -> List[Tensor]:
        return [t for s in self.opt.state.values() for t in s.values() if isinstance(t, Tensor)]

    def tensors(self) -> List[Tensor]:
        from .runner import _leaves  # a quantized state's storages are its inner tensors'
        out = [p.detach() for p in self.model] + self._grads + [x for t in self.state_tensors() for x in _leaves(t)]
        if self.scaler is not None:
            out += [t for t in (self.scaler._scale, self.scaler._growth_tracker) if t is not None]
        return out


class PeerVariant(Variant):
    backend = "peer"

    def __init__(self, peer: Peer):
        super().__init__()
        self.peer = peer
        self.name = peer.name
        self.version: Optional[str] = None

    def _module(self):
        try:
            mod = importlib.import_module(self.peer.module)
        except ImportError as e:
            raise Unavailable(f"{self.peer.dist} is not installed ({type(e).__name__}: {e}); pip install "
                              f"'.[peers]' installs {self.peer.dist}=={PINS[self.peer.dist]}", permanent=True) from e
        try:
            self.version = importlib.metadata.version(self.peer.dist)
        except importlib.metadata.PackageNotFoundError:
            self.version = None
        return mod

    def build(self, inst: Instance, params: List[Tensor]) -> Runner:
        mod = self._module()
        if self.peer.cuda_only and inst.device.type != "cuda":
            raise Unavailable(f"{self.peer.dist} runs on CUDA only (its quantized state and kernels need a GPU)",
                              permanent=True)
        if inst.param_dtype != torch.bfloat16:
            raise Unavailable(f"compared on bf16 models only; this one is {inst.param_dtype}")
        try:
            runner = PeerRunner(self.name, self.peer, mod, inst, params)
        except (NotImplementedError, RuntimeError, ValueError, TypeError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise Unavailable(f"{self.peer.dist}: {type(e).__name__}: {first}", permanent=True) from e
        if self.version and self.version != PINS[self.peer.dist]:
            runner.notes.append(f"{self.peer.dist} {self.version} (the peers extra pins {PINS[self.peer.dist]})")
        return runner

    def bytes_per_param(self, inst: Instance) -> float:
        """Gradient read, bf16 weight read + written, each state byte read + written (measured state)."""
        sb = getattr(self, "_state_bpp", None)
        if sb is None:
            return mode_bytes_per_param(inst.grad_dtype, inst.param_dtype, "none", 2.0)
        return mode_bytes_per_param(inst.grad_dtype, inst.param_dtype, "none", 0.0, extra_bytes=sb)

    def check_runner(self, runner: Runner, inst: Instance, plan: Plan, exp: Expected) -> None:
        norms = run_check_steps(runner, plan)
        from .runner import state_bytes_per_param
        self._state_bpp = state_bytes_per_param(runner, inst.workload.numel)
        if "bit" in self.name and not any(_code_gap(runner.opt.state[p][k]) is not None for p in runner.model
                                          for k in ("exp_avg", "exp_avg_sq")):
            runner.notes.append("no quantized state: torchao keeps bf16 moments for tensors under 4096 elements or "
                                "whose size is not a multiple of its block size (256 for 8-bit, 128 for 4-bit)")
        problems = compare_peer(runner, norms, exp, inst, plan)
        if problems:
            raise CorrectnessError(f"{self.name} ({self.peer.text}) is not AdamW within its format on "
                                   f"{inst.label()}:\n  " + "\n  ".join(problems))


def compare_peer(runner: PeerRunner, norms, exp: Expected, inst: Instance, plan: Plan) -> List[str]:
    """The weights (what every library's state must produce) against the reference within the format's error;
    moments are compared only as far as they feed the weights, since each library keeps its own form of them
    (optimi stores them differently scaled, torchao quantizes only tensors above a size)."""
    shapes = inst.workload.shapes
    e, problems = norm_error(inst, norms, exp)
    n = exp.updates
    snap = runner.snapshot()
    quantized = any(_code_gap(runner.opt.state[p][k]) is not None for p in runner.model
                    for k in ("exp_avg", "exp_avg_sq"))
    moment_rel = 1.0 if quantized else PEER_BF16_REL
    w_atol = n * inst.lr * adam_ratio_bound(inst.betas) * moment_rel + 2 * (e if inst.clip else 0.0) * inst.lr * n
    wmag = [_weight_bound(runner.params0, exp, plan, inst, i) for i in range(len(shapes))]
    problems += _within("param", snap.param, exp.master, plan, shapes, n, wmag, w_atol,
                        QUANTIZED_OUTLIERS if quantized else 0.0)
    if exp.scale is not None and snap.scale != exp.scale:
        problems.append(f"loss scale is {snap.scale}, expected {exp.scale}")
    return problems


def peer_variants(names: Optional[List[str]] = None) -> List[PeerVariant]:
    return [PeerVariant(p) for p in PEERS if not names or p.name in names]
