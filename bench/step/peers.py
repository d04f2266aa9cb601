"""Other libraries' low-precision AdamW as benchmark variants (``python -m bench --peers``).

Each peer trains the bf16 model directly (no fp32 master) the way its users run it: bf16 gradients, no loss
scaler (bf16 has fp32's exponent range, and neither torchao's, optimi's nor flashoptim's bf16 recipes scale the
loss; torch's CUDA ``GradScaler.unscale_`` refuses bf16 gradients besides), ``clip_grad_norm_(foreach=True)``,
then the peer's ``step``. Where the benchmark's instance has a scaler, a peer runs the same instance without it
(``instance_for``): its own check steps (no overflow step, nothing to skip) against the reference of that
configuration, and its row says ``noscaler``. The packages are optional (``pip install '.[peers]'``, pinned in
setup.py); an absent one, or one that cannot run on the device, is reported unavailable with the reason.

=========================  ==================================================================  ==========
variant                    optimizer                                                           state
=========================  ==================================================================  ==========
``torchao-adamw-sr``       ``torchao.optim.AdamW(bf16_stochastic_round=True)`` (``_AdamW`` in   bf16 m, v
                           torchao 0.18, which keeps the class under that name)
``torchao-adamw8bit``      ``torchao.optim.AdamW8bit(bf16_stochastic_round=True)``               8-bit m, v
``torchao-adamw4bit``      ``torchao.optim.AdamW4bit(bf16_stochastic_round=True)``               4-bit m, v
``torchao-adamwfp8``       ``torchao.optim.AdamWFp8(bf16_stochastic_round=True)``                fp8 m, v
``optimi-adamw``           ``optimi.AdamW(kahan_sum=False)``: bf16 weights rounded to nearest    bf16 m, v
``optimi-adamw-kahan``     ``optimi.AdamW(kahan_sum=True)``: a bf16 Kahan compensation           bf16 m, v, c
``flashoptim-adamw``       ``flashoptim.FlashAdamW`` (CUDA only: its quantization needs a GPU)   its own
=========================  ==================================================================  ==========

The check before timing runs the same steps as the reference (ampfused.ops.reference, torch's AdamW) and
separates a wrong result from a difference of design:

* wrong, the row is dropped: a reported norm off the reference's (``clip_grad_norm_`` saw other gradients), a
  non-finite weight, or weights off the reference beyond what the format explains at the typical element (the
  median): a wrong rule (another learning rate, decay, epsilon or bias correction, a step taken twice) moves
  most weights, a format's error moves few;
* by design, timed: the weights against the reference within ``n`` bf16 ulps after ``n`` updates (stochastic
  rounding moves a weight at most one ulp from the fp32 result per update, round to nearest half of one) plus
  the update error the moments' format can cause (up to ``16 * 2^-7`` of an update for bf16 moments computed
  in bf16 arithmetic, the whole update for quantized moments) times Adam's bound ``lr * R`` per update
  (bench/step/modes.py). Elements beyond that are counted in a note, and every row shows its measured
  deviation from the reference (the ``dev`` column: bench/step/runner.py, weight_deviation).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..common.bytes import mode_bytes_per_param
from .check import CorrectnessError, Expected, Plan, _pick, norm_error
from .check import run_check_steps
from .modes import _weight_bound, adam_ratio_bound, bf16_ulp
from .variants import Runner, Snapshot, Unavailable, Variant
from .workloads import Instance

# relative error of a bf16 moment computed in bf16 arithmetic over a few steps (16 ulps of 2^-7: each of the
# lerp's roundings may add one); an update's error is at most this fraction of the update
PEER_BF16_REL = 16 * 2.0 ** -7
# the versions of the peers extra (setup.py); a different installed version is noted, not refused
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
    Peer("torchao-adamwfp8", "torchao", "torchao.optim", _torchao("AdamWFp8"), text="torchao AdamWFp8"),
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
    """The bf16 model, torch's clip, a peer's optimizer stepping the weights in place; no loss scaler."""

    def __init__(self, variant: str, peer: Peer, mod, inst: Instance, params: List[Tensor]):
        super().__init__(variant, "peer")
        self.inst = inst
        self.params0 = params
        self.model = [nn.Parameter(p.detach().clone()) for p in params]
        for p in self.model:
            p.grad = torch.zeros_like(p)
        self._grads = [p.grad for p in self.model]
        self.opt = peer.make(mod, self.model, inst)
        self.norm: Optional[Tensor] = None

    def set_grads(self, grads: List[Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self._grads, grads)

    def step(self) -> None:
        self.norm = None
        if self.inst.clip:
            self.norm = torch.nn.utils.clip_grad_norm_(self.model, self.inst.max_norm, foreach=True)
        self.opt.step()

    def _state(self, key: str) -> List[Optional[Tensor]]:
        out = []
        for p in self.model:
            t = self.opt.state[p].get(key)
            out.append(t.materialize() if hasattr(t, "materialize") else t)  # flashoptim's quantized container
        return out

    def snapshot(self) -> Snapshot:
        return Snapshot(param=[p.detach() for p in self.model], master=None,
                        exp_avg=[_dequantized(t) for t in self._state("exp_avg")],
                        exp_avg_sq=[_dequantized(t) for t in self._state("exp_avg_sq")],
                        scale=None, norm=self.norm)

    def state_tensors(self) -> List[Tensor]:
        out = []
        for s in self.opt.state.values():
            for t in s.values():
                if isinstance(t, Tensor):
                    out.append(t)
                else:  # flashoptim's container: whichever of its codes, scales and plain values it holds
                    out += [x for x in (getattr(t, a, None) for a in ("_quantized", "_scales", "_data"))
                            if isinstance(x, Tensor)]
        return out

    def tensors(self) -> List[Tensor]:
        from .runner import _leaves  # a quantized state's storages are its inner tensors'
        return [p.detach() for p in self.model] + self._grads + [x for t in self.state_tensors() for x in _leaves(t)]


class PeerVariant(Variant):
    backend = "peer"

    def __init__(self, peer: Peer):
        super().__init__()
        self.peer = peer
        self.name = peer.name
        self.version: Optional[str] = None

    def instance_for(self, inst: Instance) -> Instance:
        return dataclasses.replace(inst, scaler=False)

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
        inst = self.instance_for(inst)
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
        wrong, differs = compare_peer(runner, norms, exp, inst, plan)
        if wrong:
            raise CorrectnessError(f"{self.name} ({self.peer.text}) is not AdamW within its format on "
                                   f"{inst.label()}:\n  " + "\n  ".join(wrong + differs))
        runner.notes += [f"differs from the reference by its design (timed; its dev column): {d}" for d in differs]


def _is_quantized(t) -> bool:
    """A state kept in fewer than 16 bits per element (codes plus scales): a tensor subclass (torchao), a
    container that quantizes (flashoptim), or a 1-byte storage."""
    if hasattr(t, "is_quantized") and callable(t.is_quantized) and not isinstance(t, Tensor):
        return bool(t.is_quantized())
    return _code_gap(t) is not None or (isinstance(t, Tensor) and type(t) is not torch.Tensor) or \
        (isinstance(t, Tensor) and t.element_size() == 1)


def _beyond(got: List[Tensor], exp: List[Tensor], plan: Plan, n: int, mags: List[Tensor], atol: float):
    """Per tensor (index, elements beyond, elements checked, first such element's values, median of
    ``|got - exp| / bound``), with ``bound = n * ulp_bf16(max(|got|, |exp|, mag)) + atol`` (bench/step/modes.py);
    None for a tensor holding a non-finite weight."""
    out = []
    for i, (g, e, m) in enumerate(zip(got, exp, mags)):
        g64, e64 = _pick(g, plan.sample[i]).double(), e.double()
        if not bool(torch.isfinite(g64).all()):
            out.append(None)
            continue
        bound = n * bf16_ulp(torch.maximum(torch.maximum(g64.abs(), e64.abs()), m)) + atol
        ratio = (g64 - e64).abs() / bound
        bad = ratio > 1
        first = None
        if bad.any():
            j = int(bad.nonzero()[0])
            first = (j, g64[j].item(), e64[j].item())
        out.append((i, int(bad.sum()), bad.numel(), first, ratio.median().item()))
    return out


def compare_peer(runner: PeerRunner, norms, exp: Expected, inst: Instance, plan: Plan) -> Tuple[List[str], List[str]]:
    """(wrong, differs): what makes the peer's result wrong (module docstring: its row is dropped), and where its
    weights differ from the reference beyond the format's allowance at a few elements only (timed, noted). The
    weights are what every library's state must produce; moments are compared only as far as they feed them,
    since each library keeps its own form of them (optimi scales them, torchao quantizes only tensors above a
    size, flashoptim keeps its own codes)."""
    shapes = inst.workload.shapes
    e, wrong = norm_error(inst, norms, exp)
    n = exp.updates
    snap = runner.snapshot()
    quantized = any(_is_quantized(v) for p in runner.model for k, v in runner.opt.state[p].items()
                    if k != "step")
    moment_rel = 1.0 if quantized else PEER_BF16_REL
    w_atol = n * inst.lr * adam_ratio_bound(inst.betas) * moment_rel + 2 * (e if inst.clip else 0.0) * inst.lr * n
    wmag = [_weight_bound(runner.params0, exp, plan, inst, i) for i in range(len(shapes))]
    differs = []
    allowance = f"{n} bf16 ulps + {w_atol:.3g}"
    for k, r in enumerate(_beyond(snap.param, exp.master, plan, n, wmag, w_atol)):
        if r is None:
            wrong.append(f"param[{k}] (shape {tuple(shapes[k])}): non-finite weights")
            continue
        i, bad, total, first, median = r
        if not bad:
            continue
        j, got, want = first
        text = (f"param[{i}] (shape {tuple(shapes[i])}): {bad} of {total} elements further than {allowance}; "
                f"first [{j}] got {got:.9g} expected {want:.9g}")
        (wrong if median > 1 else differs).append(text + (" (the typical element too: a wrong rule)"
                                                          if median > 1 else ""))
    if exp.scale is not None and snap.scale != exp.scale:
        wrong.append(f"loss scale is {snap.scale}, expected {exp.scale}")
    return wrong, differs


def peer_variants(names: Optional[List[str]] = None) -> List[PeerVariant]:
    return [PeerVariant(p) for p in PEERS if not names or p.name in names]
