"""How well 8-bit formats store real Adam moments: ``python -m bench.q8_error`` (docs/state-precision.md).

Trains the alignment study's byte-level GPT (``bench/align/model.py``, fp32, ``torch.optim.AdamW``) for a few
hundred steps, then stores its ``exp_avg`` and ``exp_avg_sq`` (each parameter on its own, blocks of 256 from its
first element) in each format and compares what comes back with the fp32 values:

* ``q8`` this project's block-scaled minifloats with a power-of-two scale (``state_precision.q8_quantize``),
  rounded to nearest, and rounded stochastically as the optimizer stores them;
* ``linear int8``: absmax per block of 256, ``round(x / absmax * 127)`` (255 levels for ``exp_avg_sq``);
* ``dynamic tree``: torchao's (bitsandbytes') ``create_dynamic_map`` table, absmax per block of 256, when
  torchao is installed.

Columns: the mean relative error ``|stored - x| / |x|`` over the nonzero elements; the share of nonzero
``exp_avg_sq`` elements stored as exact zero (Adam divides by ``sqrt(v) + eps``: a zero there turns an
element's update into ``m / eps``); the relative L2 error of the Adam direction ``m / (sqrt(v) + eps)`` computed
from the stored moments.

``--optimizer muon`` trains it with torch's recipe for Muon instead (``torch.optim.Muon`` on the blocks'
matrices, ``bench.align.modes.muon_groups``; AdamW on the rest) and stores each matrix's ``momentum_buffer``:
columns the momentum's mean relative error and relative L2 error, and the relative L2 error of the update Muon
makes from it (the Newton-Schulz iteration of the stored momentum against that of the fp32 one, in fp32, torch's
coefficients), beside the Adam direction's error above (docs/muon.md, "Alignment").
"""
from __future__ import annotations

import argparse
import torch

from ampfused.ops import state_precision as sp
from bench.align import model as M
from bench.common.env import device_name

BLOCK = sp.QBLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    pad = torch.zeros(sp.q8_blocks(x.numel()) * BLOCK, dtype=x.dtype)
    pad[:x.numel()] = x
    return pad.view(-1, BLOCK)


def q8_nearest(x, signed):
    return sp.q8_dequantize(*sp.q8_quantize(x, signed), signed)


def q8_stochastic(x, signed, _gen=[0]):
    _gen[0] += 1
    rand = sp.stream_bits(sp.random_bits(sp.step_key(12345, _gen[0]), torch.arange(x.numel())), 1)
    return sp.q8_dequantize(*sp.q8_quantize(x, signed, rand), signed)


def linear_int8(x, signed):
    b = _blocks(x)
    levels = 127 if signed else 255
    scale = b.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / levels
    return (torch.round(b / scale).clamp(-levels, levels) * scale).flatten()[:x.numel()]


def dynamic_tree():
    try:
        from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap
    except ImportError:
        return None
    maps = {s: torch.tensor(create_dynamic_map(signed=s), dtype=torch.float32) for s in (True, False)}

    def store(x, signed):
        b = _blocks(x)
        scale = b.abs().amax(dim=1, keepdim=True).clip(1e-12)  # as torchao's scale_tensor
        codes = quantize_8bit_with_qmap(b / scale, maps[signed])
        return (maps[signed][codes.long()] * scale).flatten()[:x.numel()]
    return store


def train_moments(steps: int, cfg: M.Config):
    torch.manual_seed(cfg.seed)
    data, what = M.corpus()
    model = M.build(cfg, M.initial_state(cfg), torch.float32, torch.float32, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    offsets = M.batch_offsets(data.numel(), cfg)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        x, y = M.batch(data, offsets, step, cfg.context, "cpu")
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        opt.step()
    moments = [(opt.state[p]["exp_avg"].flatten(), opt.state[p]["exp_avg_sq"].flatten()) for p in model.parameters()]
    return moments, loss.item(), what


def train_muon_momenta(steps: int, cfg: M.Config):
    """The fp32 momentum buffers of the blocks' matrices after ``steps`` of torch's Muon recipe (as
    bench.align.modes' reference runs it, in fp32)."""
    from bench.align import modes
    torch.manual_seed(cfg.seed)
    data, what = M.corpus()
    model = M.build(cfg, M.initial_state(cfg), torch.float32, torch.float32, "cpu")
    hidden, *aux = modes.muon_groups(list(model.named_parameters()), cfg.weight_decay)
    kw = {k: v for k, v in modes.MUON_KW.items()}
    muon = torch.optim.Muon(hidden["params"], lr=cfg.lr, weight_decay=cfg.weight_decay, **kw)
    adamw = torch.optim.AdamW([{k: v for k, v in g.items() if k != "use_muon"} for g in aux], lr=cfg.lr,
                              betas=cfg.betas, eps=cfg.eps)
    offsets = M.batch_offsets(data.numel(), cfg)
    for step in range(steps):
        for g in muon.param_groups + adamw.param_groups:
            g["lr"] = cfg.lr_at(step)
        x, y = M.batch(data, offsets, step, cfg.context, "cpu")
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        muon.zero_grad()
        adamw.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        muon.step()
        adamw.step()
    return [muon.state[p]["momentum_buffer"] for p in hidden["params"]], loss.item(), what


def measure_muon(momenta, store):
    """(momentum mean rel. error, momentum rel. L2 error, Muon update rel. L2 error) of ``store`` over the
    momenta (signed, each matrix's elements in blocks from its first)."""
    from ampfused.ops.reference_muon import NS_A_B_C, orthogonalize
    rel, dm, m2, do, o2 = [], 0.0, 0.0, 0.0, 0.0
    for m in momenta:
        s = store(m.flatten(), True).view(m.shape)
        nz = m != 0
        rel.append(((s - m).abs()[nz] / m.abs()[nz]).double())
        dm += float(((s - m).double() ** 2).sum())
        m2 += float((m.double() ** 2).sum())
        o, os_ = (orthogonalize(x[None], *NS_A_B_C, 5, 1e-7, torch.float32)[0] for x in (m, s))
        do += float(((os_ - o).double() ** 2).sum())
        o2 += float((o.double() ** 2).sum())
    return torch.cat(rel).mean().item(), (dm / m2) ** 0.5, (do / o2) ** 0.5


def below_normal(x: torch.Tensor, signed: bool, span: int) -> tuple:
    """(spans of ``span`` elements, from the parameter's first, holding a value below their blocks' normal range,
    spans): the blocks whose codes the CUDA kernels encode out of line (``span`` 256: one block) or a vote over
    Triton's 1024-element kernel block would send to the general encoder."""
    b = _blocks(x)
    real = _blocks(torch.ones_like(x)) > 0
    e = sp.q8_block_exponent(torch.where(real, sp.q8_abs_bits(b), 0).amax(dim=1, keepdim=True))
    low = (sp.q8_abs_bits(b) < ((e - sp.Q8_TOP[signed] + 1) << 23)) & real
    per = span // BLOCK
    rows = -(-low.shape[0] // per) * per
    low = torch.cat([low.any(dim=1), low.new_zeros(rows - low.shape[0])]).view(-1, per).any(dim=1)
    spans = -(-x.numel() // span)
    return int(low[:spans].sum()), spans


def measure(moments, store, eps):
    rel = {True: [], False: []}
    zeros = nonzero = 0
    du = u2 = 0.0
    for m, v in moments:
        ms, vs = store(m, True), store(v, False)
        for x, s, signed in ((m, ms, True), (v, vs, False)):
            nz = x != 0
            rel[signed].append(((s - x).abs()[nz] / x.abs()[nz]).double())
        nonzero += int((v != 0).sum())
        zeros += int(((vs == 0) & (v != 0)).sum())
        u, uq = m / (v.sqrt() + eps), ms / (vs.clamp(min=0).sqrt() + eps)
        du += float(((uq - u).double() ** 2).sum())
        u2 += float((u.double() ** 2).sum())
    return (torch.cat(rel[True]).mean().item(), torch.cat(rel[False]).mean().item(), zeros / max(1, nonzero),
            (du / u2) ** 0.5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    args = ap.parse_args(argv)
    cfg = M.Config(steps=args.steps, layers=args.layers, width=args.width, heads=2, context=32, batch=8)
    formats = {"q8 (nearest)": q8_nearest, "q8 (stochastic)": q8_stochastic, "linear int8": linear_int8}
    tree = dynamic_tree()
    if tree is not None:
        formats["dynamic tree (torchao)"] = tree
    if args.optimizer == "muon":
        momenta, loss, what = train_muon_momenta(args.steps, cfg)
        n = sum(m.numel() for m in momenta)
        print(f"# {device_name(torch.device('cpu'))}, torch {torch.__version__}; GPT (layers {cfg.layers}, width "
              f"{cfg.width}), {args.steps} steps of torch's Muon recipe (loss {loss:.3f}) on {what}; "
              f"{len(momenta)} matrices, {n:,} momentum elements")
        formats["bf16 (stochastic)"] = lambda x, signed: sp.round_stochastic(
            x, sp.random_bits(sp.step_key(12345, 1), torch.arange(x.numel()))).float()
        print("| format | momentum mean rel. error | momentum rel. L2 error | Muon update rel. L2 error |")
        print("| --- | --- | --- | --- |")
        for name, store in formats.items():
            em, dm, do = measure_muon(momenta, store)
            print(f"| {name} | {em:.2%} | {dm:.2%} | {do:.2%} |")
        return 0
    moments, loss, what = train_moments(args.steps, cfg)
    n = sum(m.numel() for m, _ in moments)
    print(f"# {device_name(torch.device('cpu'))}, torch {torch.__version__}; GPT of {n:,} parameters "
          f"(layers {cfg.layers}, width {cfg.width}), {args.steps} AdamW steps (loss {loss:.3f}) on {what}")
    zeros_v = sum(int((v == 0).sum()) for _, v in moments)
    print(f"# exp_avg_sq: {zeros_v} of {n} elements are exactly zero in fp32")
    shares = []
    for name, k, signed in (("exp_avg", 0, True), ("exp_avg_sq", 1, False)):
        for span in (BLOCK, 4 * BLOCK):
            low, total = map(sum, zip(*(below_normal(mv[k], signed, span) for mv in moments)))
            shares.append(f"{name} {low / total:.1%} of {total} spans of {span}")
    print("# spans holding a value below their blocks' normal range (encoded by the general form): "
          + ", ".join(shares))
    print("| format | exp_avg mean rel. error | exp_avg_sq mean rel. error | exp_avg_sq nonzero stored as 0 | "
          "Adam direction rel. L2 error |")
    print("| --- | --- | --- | --- | --- |")
    for name, store in formats.items():
        em, ev, z, du = measure(moments, store, cfg.eps)
        print(f"| {name} | {em:.2%} | {ev:.2%} | {z:.2%} | {du:.2%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
