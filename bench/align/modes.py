"""``python -m bench.align --modes``: ampfused's compact state modes over a long run, against its fp32-master run.

The same model, data order and initial weights as the seven runs of ``python -m bench.align``, trained with
``ampfused.FusedAdamW(max_grad_norm=...)`` in bf16 once per state mode (bench/step/modes.py names them):

| run | options | state B / param |
| --- | --- | --- |
| ``ampfused`` | fp32 masters, fp32 moments (the reference of this report) | 12 |
| ``ampfused+rem`` | ``store_param_remainders=True`` | 10 |
| ``ampfused+bf16m`` | bf16 moments | 8 |
| ``ampfused+rem+bf16m`` | both | 6 |
| ``ampfused+sr`` | ``bf16_stochastic_round=True`` (no master) | 8 |
| ``ampfused+sr+bf16m`` | no master, bf16 moments | 4 |
| ``ampfused+q8m`` | fp32 masters, 8-bit moments (``torch.uint8``: block-scaled codes) | 6.03 |
| ``ampfused+rem+q8m`` | remainders, 8-bit moments | 4.03 |
| ``ampfused+sr+q8m`` | no master, 8-bit moments | 2.03 |

and, where installed (``pip install '.[peers]'``), the other libraries' low-precision AdamW under torch's
``clip_grad_norm_``: ``optimi-adamw`` (bf16 weights and moments, 4 B), ``optimi-adamw-kahan`` (+ a bf16 Kahan
compensation, 6 B), ``torchao-adamw-sr`` (bf16 moments, stochastic rounding, 4 B). The figure per run: the
relative difference of its 50-step window means from the fp32-master run's, after warm-up (max, mean, last
window). The bar: every mode's largest window difference is within 0.5%, or no larger than that of the
peer run with the nearest state size at or below the mode's (the same format choice made elsewhere). A control,
not judged: the ``+sr`` mode trained again with ``seed=1`` (``ampfused+sr~seed1``), whose distance from the seed-0
run is the noise floor of these figures (the same math, other rounding draws).
Results go to ``<out>/align-modes-<device>.{csv,txt}``.

``--optimizer lion`` and ``--optimizer adafactor`` hold ``ampfused.FusedLion`` and ``ampfused.FusedAdafactor``
the same way, each mode against that optimizer's own fp32-master run (``ampfused-lion``, ``ampfused-adafactor``),
to the same bar: Lion (one moment, 4 B in fp32) with remainders, bf16 or 8-bit moments and no master, at lr / 3
and 3x the weight decay (Lion's update has a unit norm per element); Adafactor (factored second moment: a row and
a column vector per matrix, no per-element state) with remainders or no master, its relative step size ``lr``
1e-2 on the run's schedule. Lion's peers: optimi's ``Lion`` on the bf16 weights (2 B), with its Kahan
compensation (4 B), and bitsandbytes' ``Lion8bit`` (1.02 B: every tensor's moment in 8 bits).

``--optimizer muon`` holds ``ampfused.FusedMuon`` against torch's recipe (``torch-muon``: fp32 master copies,
``clip_grad_norm_``, ``torch.optim.Muon`` on the blocks' matrices and ``torch.optim.AdamW`` on the embeddings, head,
biases and LayerNorms; Muon's lr matched to AdamW's RMS, ``adjust_lr_fn="match_rms_adamw"``): its fp32-master run
and every mode of its master and its momentum (bf16 or 8-bit, which AdamW's groups take too), to the same bar.
Results go to ``<out>/align-modes-<optimizer>-<device>.{csv,txt}``.
"""
from __future__ import annotations

import csv
import importlib
import time
from typing import Dict, List, Optional

import torch

import ampfused

from . import model as M
from . import report as R
from . import runs as T

BAR = 0.005  # 0.5%
_BF16M = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
_Q8M = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)  # 8-bit moments: 1 B + 4 B per 256 each
MODES = {  # run -> (FusedAdamW options, state bytes per bf16 parameter)
    "ampfused+rem": (dict(store_param_remainders=True), 10),
    "ampfused+bf16m": (dict(_BF16M), 8),
    "ampfused+rem+bf16m": (dict(store_param_remainders=True, **_BF16M), 6),
    "ampfused+sr": (dict(bf16_stochastic_round=True), 8),
    "ampfused+sr+bf16m": (dict(bf16_stochastic_round=True, **_BF16M), 4),
    "ampfused+q8m": (dict(_Q8M), 6.03),
    "ampfused+rem+q8m": (dict(store_param_remainders=True, **_Q8M), 4.03),
    "ampfused+sr+q8m": (dict(bf16_stochastic_round=True, **_Q8M), 2.03),
}
PEERS = {  # run -> (module, class, options, state bytes per bf16 parameter)
    "optimi-adamw": ("optimi", "AdamW", dict(kahan_sum=False), 4),
    "optimi-adamw-kahan": ("optimi", "AdamW", dict(kahan_sum=True), 6),
    "torchao-adamw-sr": ("torchao.optim", "_AdamW", dict(bf16_stochastic_round=True), 4),
}


_LION_Q8 = dict(exp_avg_dtype=torch.uint8)
LION_MODES = {  # run -> (FusedLion options, state bytes per bf16 parameter)
    "ampfused-lion+rem": (dict(store_param_remainders=True), 6),
    "ampfused-lion+bf16m": (dict(exp_avg_dtype=torch.bfloat16), 6),
    "ampfused-lion+q8m": (dict(_LION_Q8), 5.02),
    "ampfused-lion+sr": (dict(bf16_stochastic_round=True), 4),
    "ampfused-lion+sr+bf16m": (dict(bf16_stochastic_round=True, exp_avg_dtype=torch.bfloat16), 2),
    "ampfused-lion+sr+q8m": (dict(bf16_stochastic_round=True, **_LION_Q8), 1.02),
}
ADAFACTOR_MODES = {  # run -> (FusedAdafactor options, state bytes per bf16 parameter beyond the factors)
    "ampfused-adafactor+rem": (dict(store_param_remainders=True), 2),
    "ampfused-adafactor+sr": (dict(bf16_stochastic_round=True), 0),
}
# The noise floor of each optimizer's comparison: its stochastic-rounding mode trained again with another seed (the
# same math, other rounding draws), compared with the first; not judged, reported beside the modes.
CONTROLS = {
    "adamw": ("ampfused+sr", "ampfused+sr~seed1", dict(bf16_stochastic_round=True, seed=1), 8),
    "lion": ("ampfused-lion+sr", "ampfused-lion+sr~seed1", dict(bf16_stochastic_round=True, seed=1), 4),
    "adafactor": ("ampfused-adafactor+sr", "ampfused-adafactor+sr~seed1", dict(bf16_stochastic_round=True, seed=1), 0),
    "muon": ("ampfused-muon+sr", "ampfused-muon+sr~seed1", dict(bf16_stochastic_round=True, seed=1), 4),
}
# Muon (momentum fp32, 4 B, and an fp32 master, 4 B, per element of its matrices): every mode of its one moment and
# its master, against torch's recipe (torch.optim.Muon on the blocks' matrices, torch.optim.AdamW on the rest, on fp32
# master copies, clip_grad_norm_ over both); the state bytes are those of a Muon matrix's element
_MUON_BF16 = dict(momentum_dtype=torch.bfloat16)
_MUON_Q8 = dict(momentum_dtype=torch.uint8)
MUON_MODES = {  # run -> (FusedMuon options, state bytes per bf16 element of a Muon matrix)
    "ampfused-muon": (dict(), 8),
    "ampfused-muon+rem": (dict(store_param_remainders=True), 6),
    "ampfused-muon+bf16m": (dict(_MUON_BF16), 6),
    "ampfused-muon+q8m": (dict(_MUON_Q8), 5.02),
    "ampfused-muon+rem+bf16m": (dict(store_param_remainders=True, **_MUON_BF16), 4),
    "ampfused-muon+rem+q8m": (dict(store_param_remainders=True, **_MUON_Q8), 3.02),
    "ampfused-muon+sr": (dict(bf16_stochastic_round=True), 4),
    "ampfused-muon+sr+bf16m": (dict(bf16_stochastic_round=True, **_MUON_BF16), 2),
    "ampfused-muon+sr+q8m": (dict(bf16_stochastic_round=True, **_MUON_Q8), 1.02),
}
ADAFACTOR_LR = 1e-2  # torch.optim.Adafactor's default relative step size, at the schedule's peak
LION_PEERS = {  # run -> (module, class, options, state bytes per bf16 parameter): optimi's Lion on bf16 weights,
    # bitsandbytes' 8-bit Lion (every tensor's moment in 8-bit codes with an fp32 absmax per 256 elements)
    "optimi-lion": ("optimi", "Lion", dict(kahan_sum=False), 2),
    "optimi-lion-kahan": ("optimi", "Lion", dict(kahan_sum=True), 4),
    "bnb-lion8bit": ("bitsandbytes.optim", "Lion8bit", dict(min_8bit_size=0), 1 + 4 / 256),
}


def _adamw(groups, cfg: M.Config, options: dict):
    return ampfused.FusedAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, max_grad_norm=cfg.max_norm, **options)


def _lion(groups, cfg: M.Config, options: dict, cls=None):
    for g in groups:
        g["weight_decay"] = 3 * g["weight_decay"]
    if cls is not None:  # a peer's Lion (its clip is torch's, before its step)
        return cls(groups, lr=cfg.lr / 3, betas=(0.9, 0.99), **options)
    return ampfused.FusedLion(groups, lr=cfg.lr / 3, betas=(0.9, 0.99), max_grad_norm=cfg.max_norm, **options)


def _adafactor(groups, cfg: M.Config, options: dict):
    return ampfused.FusedAdafactor(groups, lr=ADAFACTOR_LR, max_grad_norm=cfg.max_norm, **options)


def muon_groups(named, weight_decay: float) -> list:
    """Muon for the blocks' matrices; AdamW (``use_muon=False``) for the embeddings and the head (decayed) and the
    biases and LayerNorms (not), as Muon's authors split a GPT."""
    hidden = [p for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
    outer = [p for n, p in named if p.dim() >= 2 and not n.startswith("blocks.")]
    rest = [p for n, p in named if p.dim() < 2]
    return [dict(params=hidden, weight_decay=weight_decay), dict(params=outer, weight_decay=weight_decay,
                                                                 use_muon=False),
            dict(params=rest, weight_decay=0.0, use_muon=False)]


# Muon's lr: AdamW's, the update's RMS matched to AdamW's (torch's adjust_lr_fn="match_rms_adamw")
MUON_KW = dict(momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")


def _muon(groups, cfg: M.Config, options: dict):
    for g in groups:
        if g.get("use_muon", True) is False:
            g.update(betas=cfg.betas, eps=cfg.eps)
    return ampfused.FusedMuon(groups, lr=cfg.lr, max_grad_norm=cfg.max_norm, **MUON_KW, **options)


class _TorchMuon(T.Optimizing):
    """torch's recipe for Muon: fp32 master copies of the bf16 model, ``clip_grad_norm_`` over every master
    gradient, ``torch.optim.Muon`` on the blocks' matrices and ``torch.optim.AdamW(fused=True)`` on the rest, then
    the masters copied back."""

    def __init__(self, model, cfg: M.Config):
        self.model, self.cfg, self.scaler = model, cfg, None
        self.params = list(model.parameters())
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        named = list(zip((n for n, _ in model.named_parameters()), self.masters))
        groups = muon_groups(named, cfg.weight_decay)
        self.opts = [torch.optim.Muon([dict(params=groups[0]["params"], weight_decay=cfg.weight_decay)], lr=cfg.lr,
                                      **MUON_KW),
                     torch.optim.AdamW([{k: v for k, v in g.items() if k != "use_muon"} for g in groups[1:]],
                                       lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)]

    def set_lr(self, lr: float) -> None:
        for opt in self.opts:
            for g in opt.param_groups:
                g["lr"] = lr

    def step(self) -> float:
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.max_norm)
        for opt in self.opts:
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        return float(norm)

    def master_list(self):
        return self.masters


# --optimizer -> (the optimizer built from a run's config, its lr relative to the schedule's, reference run, modes,
# peers)
OPTIMIZERS = {
    "adamw": (_adamw, 1.0, "ampfused", MODES, None),  # (PEERS, below)
    "lion": (_lion, 1 / 3, "ampfused-lion", LION_MODES, LION_PEERS),
    "adafactor": (_adafactor, None, "ampfused-adafactor", ADAFACTOR_MODES, {}),
    "muon": (_muon, 1.0, "torch-muon", MUON_MODES, {}),
}
REFERENCE_BYTES = {"ampfused": 12, "ampfused-lion": 8, "ampfused-adafactor": 4, "torch-muon": 8}


class _Mode(T.Optimizing):
    """A fused optimizer with a mode's options; the clip folded in, as the ``ampfused`` run."""

    def __init__(self, model, cfg: M.Config, options: dict, optimizer: str = "adamw"):
        self.model, self.scaler = model, None
        self.params = list(model.parameters())
        build, self.lr_factor, _, _, _ = OPTIMIZERS[optimizer]
        # (Adafactor: its relative step size follows the schedule's shape from its own peak)
        self.lr_factor = self.lr_factor or ADAFACTOR_LR / cfg.lr
        split = muon_groups if optimizer == "muon" else M.param_groups
        self.opt = build(split(list(model.named_parameters()), cfg.weight_decay), cfg, dict(options))

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr * self.lr_factor

    def step(self) -> float:
        self.step_optimizer()
        return float(self.opt.last_grad_norm)

    def master_list(self):
        return self.params  # the masters this report needs are none: it compares losses


class _Peer(_Mode):
    """A peer's optimizer on the bf16 parameters, after torch's ``clip_grad_norm_``."""

    def __init__(self, model, cfg: M.Config, cls, options: dict, optimizer: str = "adamw"):
        self.model, self.scaler, self.cfg, self.lr_factor = model, None, cfg, 1.0
        self.params = list(model.parameters())
        groups = M.param_groups(list(model.named_parameters()), cfg.weight_decay)
        if optimizer == "lion":
            self.opt, self.lr_factor = _lion(groups, cfg, options, cls), OPTIMIZERS["lion"][1]
        else:
            self.opt = cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **options)

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor and refuses a float
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_norm)
        self.opt.step()
        self.opt.zero_grad()
        return float(norm)


def _peer_class(module: str, name: str):
    """The peer's optimizer class, or the reason it is absent."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return None, f"{module} is not installed ({e}); pip install '.[peers]'"
    cls = getattr(mod, name, None) or getattr(mod, name.lstrip("_"), None)
    return (cls, None) if cls is not None else (None, f"{module} has no {name}")


def register(peers: bool = True, device_type: str = "cpu", optimizer: str = "adamw") -> Dict[str, str]:
    """Make the runs known to ``bench.align.runs``; returns the peers left out, with the reason."""
    absent = {}
    _, _, reference, modes, peer_runs = OPTIMIZERS[optimizer]
    _, control, options, nbytes = CONTROLS[optimizer]
    runs = dict(modes, **({} if reference in T.RUNS else {reference: ({}, REFERENCE_BYTES[reference])}),
                **{control: (options, nbytes)})
    for name, (options, _) in runs.items():
        T.EXTRA[name] = (torch.bfloat16, lambda model, cfg, device, o=options: _Mode(model, cfg, o, optimizer))
    if reference == "torch-muon":
        T.EXTRA[reference] = (torch.bfloat16, lambda model, cfg, device: _TorchMuon(model, cfg))
    for name, (module, cls_name, options, _) in (PEERS if peer_runs is None else peer_runs).items():
        if not peers:
            absent[name] = "not asked for (--no-peers)"
            continue
        if module.startswith("torchao") and device_type != "cuda":
            absent[name] = ("left out on CPU: torchao compiles its step per parameter with torch.compile, which "
                            "took 200 s for 24 steps of a 0.03M-parameter model here")
            continue
        cls, why = _peer_class(module, cls_name)
        if cls is None:
            absent[name] = why
            continue
        T.EXTRA[name] = (torch.bfloat16,
                         lambda model, cfg, device, c=cls, o=options: _Peer(model, cfg, c, o, optimizer))
    return absent


def state_bytes(name: str) -> float:
    for modes in (MODES, LION_MODES, ADAFACTOR_MODES, MUON_MODES):
        if name in modes:
            return modes[name][1]
    for _, control, _, nbytes in CONTROLS.values():
        if name == control:
            return nbytes
    for peers in (PEERS, LION_PEERS):
        if name in peers:
            return peers[name][3]
    return REFERENCE_BYTES[name]


def window_figures(run: T.Run, ref: T.Run, cfg: M.Config) -> dict:
    w = R.relative(R.window_means(run.losses, cfg.window), R.window_means(ref.losses, cfg.window))
    first = -(-cfg.warmup_steps // cfg.window)  # the first window entirely after warm-up
    after = w[first:] or w[-1:]
    return dict(max=max(after), mean=sum(after) / len(after), last=after[-1], windows=w)


def judge(figs: Dict[str, dict], modes: dict = MODES) -> List[str]:
    """One line per mode: PASS/FAIL against 0.5% or the nearest peer of the same or a smaller state."""
    lines = []
    peers = {n: f for n, f in figs.items() if n in PEERS or n in LION_PEERS}
    for name in modes:
        if name not in figs:
            continue
        f = figs[name]
        near = [p for p in peers if state_bytes(p) <= state_bytes(name)]
        near.sort(key=lambda p: state_bytes(name) - state_bytes(p))
        peer = near[0] if near else None
        ok = f["max"] <= BAR or (peer is not None and f["max"] <= peers[peer]["max"])
        why = f"window max {100 * f['max']:.3f}% {'<=' if f['max'] <= BAR else '>'} 0.5%"
        if f["max"] > BAR and peer is not None:
            why += f"; {peer} ({state_bytes(peer)} B) {100 * peers[peer]['max']:.3f}%"
        lines.append(f"{'PASS' if ok else 'FAIL'}  {name} ({state_bytes(name)} B/param): {why}")
    return lines


def execute(cfg: M.Config, device: torch.device, peers: bool = True, log=print, optimizer: str = "adamw",
            bf16_compute: torch.dtype = torch.bfloat16) -> tuple:
    """Train the fp32-master run, every mode and every installed peer; returns (runs, figures, text lines)."""
    absent = register(peers, device.type, optimizer)
    _, _, reference, modes, peer_runs = OPTIMIZERS[optimizer]
    data, corpus = M.corpus()
    offsets = M.batch_offsets(len(data), cfg)
    state = M.initial_state(cfg)
    twin, control, _, _ = CONTROLS[optimizer]
    names = [reference] + list(modes) + [control] + [p for p in (PEERS if peer_runs is None else peer_runs)
                                                     if p not in absent]
    runs = {}
    t0 = time.perf_counter()
    for name in names:
        runs[name] = r = T.train(name, cfg, data, offsets, state, device, torch.bfloat16, bf16_compute=bf16_compute)
        log(f"  {name:>20}: {r.seconds:6.1f} s, loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}")
    figs = {n: window_figures(r, runs[reference], cfg) for n, r in runs.items() if n != reference}
    flag = "" if optimizer == "adamw" else f" --optimizer {optimizer}"
    lines = [f"python -m bench.align --modes{flag}: {len(runs)} runs of {cfg.steps} steps, "
             f"{M.n_params(cfg) / 1e6:.2f}M parameters ({cfg.layers} layers, width {cfg.width}, context {cfg.context}, "
             f"batch {cfg.batch}); text: {corpus}; wall time {time.perf_counter() - t0:.0f} s"
             + ("" if bf16_compute == torch.bfloat16 else "; bf16 weights and gradients, the model's arithmetic in "
                "fp32 (--bf16-compute fp32)") + f"; seed {cfg.seed}",
             f"relative difference of {cfg.window}-step window means from "
             f"{'torch' + chr(39) + 's recipe' if reference.startswith('torch') else 'the fp32-master run'} ({reference}), windows "
             f"after the {cfg.warmup_steps}-step warm-up", "",
             "| run | state B/param | window max | window mean | last window | final loss |",
             "| --- | --- | --- | --- | --- | --- |"]
    for n, f in figs.items():
        lines.append(f"| {n} | {state_bytes(n)} | {100 * f['max']:.3f}% | {100 * f['mean']:.3f}% | "
                     f"{100 * f['last']:.3f}% | {runs[n].losses[-1]:.4f} |")
    lines.append(f"| {reference} (reference) | {state_bytes(reference)} | | | | {runs[reference].losses[-1]:.4f} |")
    noise = window_figures(runs[control], runs[twin], cfg)
    lines += ["", f"noise floor: {twin} trained again with seed 1 ({control}), against the seed-0 run: window max "
                  f"{100 * noise['max']:.3f}%, mean {100 * noise['mean']:.3f}%, last {100 * noise['last']:.3f}% (the "
                  f"same math, other rounding draws)"]
    lines += [""] + judge(figs, modes)
    lines += [f"absent: {n}: {why}" for n, why in absent.items()]
    return runs, figs, lines


def write_csv(path: str, runs: Dict[str, T.Run]) -> str:
    names = list(runs)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + names)
        for k in range(len(runs[names[0]].losses)):
            w.writerow([k + 1] + [f"{runs[n].losses[k]:.6f}" for n in names])
    return path


def main(args, device: torch.device, stem: Optional[str], out: str) -> int:
    import os
    cfg = M.Config(steps=args.steps, layers=args.layers, width=args.width, heads=args.heads, context=args.context,
                   batch=args.batch, lr=args.lr, warmup=args.warmup, window=args.window, seed=args.seed)
    runs, figs, lines = execute(cfg, device, peers=not args.no_peers, log=lambda s: print(s, flush=True),
                                optimizer=args.optimizer,
                                bf16_compute={"bf16": torch.bfloat16, "fp32": torch.float32}[args.bf16_compute])
    text = "\n".join(lines)
    print(text)
    base = os.path.join(out, stem)
    os.makedirs(out, exist_ok=True)  # (the CSV's writer makes it too, but the text is written first)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    print(f"wrote {write_csv(base + '.csv', runs)}\nwrote {base}.txt")
    failed = [x for x in lines if x.startswith("FAIL")]
    return 1 if args.strict and failed else 0
