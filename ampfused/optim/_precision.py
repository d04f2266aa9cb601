"""State precision of the fused optimizers: what their options ask for, and what a segment's buffers then are.

The options (``docs/state-precision.md``), named as TransformerEngine's and torchao's optimizers name them:

* ``store_param_remainders=True``: bf16 parameters keep, instead of an fp32 master, the 16 low bits the bf16
  weight lacks (int16 buffer); weight and remainder rebuild the fp32 master bit for bit
  (:mod:`ampfused.ops.state_precision`). fp16 parameters keep fp32 masters.
* ``bf16_stochastic_round=True``: bf16 parameters keep no master; the update is computed in fp32 and rounded
  to bf16 stochastically.
* ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (Adam) or ``momentum_dtype`` (SGD): ``torch.float32`` (default),
  ``torch.bfloat16`` (stored with stochastic rounding) or ``torch.uint8`` (8-bit moments: block-scaled 8-bit
  float codes, one fp32 power-of-two scale per block of 256 elements, stored with stochastic rounding).
* ``seed``: the stochastic rounding's seed (an int). Each segment draws with its own seed derived from it, so
  two segments never share random bits.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..ops import state_precision as sp

MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


class Precision(NamedTuple):
    remainders: bool = False
    stochastic_round: bool = False
    moments: torch.dtype = torch.float32
    seed: int = 0

    @property
    def uses_seed(self) -> bool:
        return self.stochastic_round or self.moments != torch.float32

    @property
    def q8(self) -> bool:
        """8-bit moments (uint8 codes with block scales)."""
        return self.moments == torch.uint8

    def master_format(self, dtype: torch.dtype, use_master: bool) -> int:
        """The format of a segment of ``dtype`` parameters (``use_master``: it would keep an fp32 master)."""
        if dtype == torch.bfloat16 and self.remainders and use_master:
            return sp.MASTER_REMAINDER
        if dtype == torch.bfloat16 and self.stochastic_round:
            return sp.MASTER_NONE
        return sp.MASTER_FP32

    def segment_seed(self, group_index: int, dtype: torch.dtype, device) -> Optional[Tensor]:
        """A 0-d int64 device tensor: the seed of one segment (group, dtype), or None when nothing is drawn."""
        if not self.uses_seed:
            return None
        code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)
        salt = sp.mix32(((group_index * 4 + code) * sp.GOLDEN) & sp.M32)
        mixed = (self.seed ^ (salt << 32)) & ((1 << 64) - 1)
        # a fill on the device, not torch.tensor(..., device=): that would be a blocking host-to-device copy
        return torch.full((), mixed - (1 << 64) if mixed >= 1 << 63 else mixed, dtype=torch.int64, device=device)


def make(cls_name: str, master_weights: Optional[bool], store_param_remainders: bool, bf16_stochastic_round: bool,
         moment_dtypes: dict, seed) -> Precision:
    """The options checked (each error names the option and the rule)."""
    if store_param_remainders and bf16_stochastic_round:
        raise ValueError(f"{cls_name}: store_param_remainders=True and bf16_stochastic_round=True exclude each other "
                         "(remainders complete an fp32 master; stochastic rounding keeps none)")
    if store_param_remainders and master_weights is False:
        raise ValueError(f"{cls_name}: store_param_remainders=True needs master weights (they are stored as "
                         "remainders), got master_weights=False")
    if bf16_stochastic_round and master_weights is not None:
        raise ValueError(f"{cls_name}: bf16_stochastic_round=True keeps no master for bf16 parameters; leave "
                         f"master_weights at None, got {master_weights!r}")
    dtypes = set()
    for name, d in moment_dtypes.items():
        if d not in MOMENT_DTYPES:
            raise ValueError(f"{cls_name}: {name} must be torch.float32 or torch.bfloat16, or torch.uint8 (8-bit "
                             f"moments), got {d!r}")
        dtypes.add(d)
    if len(dtypes) > 1:
        raise ValueError(f"{cls_name}: {' and '.join(moment_dtypes)} must be the same dtype (a step stores its moments "
                         f"in one precision), got {', '.join(str(d) for d in moment_dtypes.values())}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{cls_name}: seed must be an int, got {type(seed).__name__}")
    return Precision(bool(store_param_remainders), bool(bf16_stochastic_round),
                     dtypes.pop() if dtypes else torch.float32, int(seed))


def bytes_per_param(precision: Precision, dtype: torch.dtype, n_states: int, use_master: bool) -> float:
    """Bytes of optimizer state per parameter of ``dtype`` (without the weight itself); 8-bit moments count their
    block scales (4 bytes per ``QBLOCK`` elements) and not the gaps of a parameter's last, partial block."""
    fmt = precision.master_format(dtype, use_master)
    master = {sp.MASTER_REMAINDER: 2, sp.MASTER_NONE: 0}.get(fmt, 4 if use_master else 0)
    per_moment = {torch.bfloat16: 2, torch.uint8: 1 + 4 / sp.QBLOCK}.get(precision.moments, 4)
    return master + n_states * per_moment


def master_key(seg) -> str:
    """The state-dict key of a segment's master buffer: ``master_param`` (fp32), ``master_remainder`` (int16)."""
    return "master_remainder" if seg.master is not None and seg.master.dtype == torch.int16 else "master_param"


def remainders_from(master: Tensor, weight: Tensor) -> Tensor:
    """Remainders for bf16 ``weight`` from a loaded fp32 ``master`` (an fp32-master checkpoint): the master's own
    where its weight is ``weight``; 0 (the weight's value) where they disagree (ties, where the fp32 mode's
    weight is the even neighbour, or a weight changed since)."""
    w, r = sp.split_master(master.float())
    return torch.where(w.view(torch.int16) == weight.view(torch.int16), r, torch.zeros_like(r))
