"""The model, data and schedule of ``python -m bench.align``: a byte-level GPT trained on Python's own source.

Text: the source files of a fixed list of standard-library modules, read as bytes from this interpreter's
installation (nothing is downloaded; a different Python version ships different text, so the corpus size and
hash are reported with every run). Batches are drawn once, from a seeded generator, before any run starts:
every run sees the same bytes in the same order.

Model: a pre-LayerNorm decoder (token and learned position embeddings, ``layers`` blocks of causal
self-attention and a 4x GELU MLP, a final LayerNorm, an untied head over 256 bytes). Parameters keep their
dtype (fp32, bf16 or fp16); the arithmetic runs in ``compute_dtype``, with each weight cast to it where it is
used (a no-op when the dtypes agree). The loss is cross-entropy on fp32 logits.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODULES = ("argparse", "ast", "calendar", "collections", "dataclasses", "difflib", "enum", "fractions", "functools",
           "heapq", "inspect", "json.decoder", "logging", "pathlib", "pickle", "random", "shutil", "string",
           "subprocess", "tarfile", "textwrap", "typing", "unittest.case", "zipfile")


@dataclass(frozen=True)
class Config:
    steps: int = 1000
    layers: int = 3
    width: int = 128
    heads: int = 4
    context: int = 64
    batch: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * this
    warmup: int = -1  # steps of linear warm-up; -1: a tenth of the steps
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # on matrices and embeddings; none on biases and LayerNorm
    max_norm: float = 1.0
    init_scale: float = 2.0 ** 16  # fp16 runs: the loss scaler
    growth_interval: int = 200
    seed: int = 0
    window: int = 50

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup >= 0 else max(1, self.steps // 10)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine to ``min_lr_ratio``."""
        w = self.warmup_steps
        if step < w:
            return self.lr * (step + 1) / w
        progress = (step - w) / max(1, self.steps - w)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def corpus() -> Tuple[Tensor, str]:
    """The training text as a uint8 tensor, and a description (modules, bytes, sha256 prefix)."""
    chunks = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # a module without Python source in this installation
        with open(spec.origin, "rb") as f:
            chunks.append(f.read())
    data = b"\n".join(chunks)
    digest = hashlib.sha256(data).hexdigest()[:12]
    what = f"{len(chunks)} standard-library modules of this Python, {len(data) / 1e6:.2f} MB, sha256 {digest}"
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone(), what


def batch_offsets(n_bytes: int, cfg: Config) -> Tensor:
    """``[steps, batch]`` start offsets of every sequence of every step, from the seed alone."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, n_bytes - cfg.context - 1, (cfg.steps, cfg.batch), generator=g)


def batch(data: Tensor, offsets: Tensor, step: int, context: int, device) -> Tuple[Tensor, Tensor]:
    idx = offsets[step][:, None] + torch.arange(context + 1)
    seq = data[idx].long().to(device)
    return seq[:, :-1], seq[:, 1:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)


def _w(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(256, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, 256, bias=False)
        self.compute_dtype = torch.float32

    def _ln(self, ln: nn.LayerNorm, x: Tensor) -> Tensor:
        cd = self.compute_dtype
        return F.layer_norm(x, ln.normalized_shape, _w(ln.weight, cd), _w(ln.bias, cd), ln.eps)

    def _lin(self, lin: nn.Linear, x: Tensor) -> Tensor:
        cd = self.compute_dtype
        return F.linear(x, _w(lin.weight, cd), None if lin.bias is None else _w(lin.bias, cd))

    def forward(self, idx: Tensor) -> Tensor:
        cd = self.compute_dtype
        b, t = idx.shape
        x = _w(self.tok.weight, cd)[idx] + _w(self.pos.weight, cd)[:t]
        for blk in self.blocks:
            c = x.shape[-1]
            q, k, v = self._lin(blk.qkv, self._ln(blk.ln1, x)).split(c, dim=2)
            q, k, v = (z.view(b, t, blk.heads, c // blk.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self._lin(blk.proj, y)
            x = x + self._lin(blk.out, F.gelu(self._lin(blk.fc, self._ln(blk.ln2, x))))
        return self._lin(self.head, self._ln(self.ln_f, x))

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self(x).float().reshape(-1, 256), y.reshape(-1))


def initial_state(cfg: Config) -> dict:
    """GPT-2 style initial weights from the seed (normal 0.02, residual projections scaled by 1/sqrt(2 layers),
    zero biases), rounded to bf16: every run, whatever its dtype, starts from these very values."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                p.normal_(0.0, std)
            p.copy_(p.bfloat16().float())
    return {k: v.clone() for k, v in model.state_dict().items()}


def build(cfg: Config, state: dict, dtype: torch.dtype, compute_dtype: torch.dtype, device) -> GPT:
    model = GPT(cfg)
    model.load_state_dict(state)
    model = model.to(device=device, dtype=dtype)
    model.compute_dtype = compute_dtype
    return model


def param_groups(params: List[Tuple[str, Tensor]], weight_decay: float) -> List[dict]:
    """Decay on matrices and embeddings, none on biases and LayerNorm (``params``: (name, tensor) pairs)."""
    decay = [p for n, p in params if p.dim() >= 2]
    rest = [p for n, p in params if p.dim() < 2]
    return [dict(params=decay, weight_decay=weight_decay), dict(params=rest, weight_decay=0.0)]


def n_params(cfg: Config) -> int:
    return sum(v.numel() for v in initial_state(cfg).values())
