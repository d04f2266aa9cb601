"""The state modes of K2, what each moves per element, and the instruction budget that leaves on an H100.

Every mode here is a bf16 model with bf16 gradients (the training setup the compact modes are for). Bytes per
element are the byte model's (``bench/common/bytes.py``), split into reads and writes: the gradient read once,
the weight in its format read and written, each moment read and written at its stored width, the 8-bit moments'
block scales (one fp32 per 256 elements and moment) read and written.

The budget: an H100 SXM issues about 33 T thread-instructions a second (132 SMs x 4 schedulers x 32 lanes x
1.98 GHz); streaming ``B`` bytes per element at 85% of its 3.35 TB/s leaves ``33e12 / (0.85 * 3.35e12 / B)``
instructions per element, about 11.6 B. The multi-function unit (``MUFU``: reciprocal, reciprocal square root)
issues 16 per SM per clock, an eighth of that: its own budget is an eighth of the element's.
"""
from __future__ import annotations

from dataclasses import dataclass

ISSUE_PER_S = 33e12
BANDWIDTH = 3.35e12
FRACTION = 0.85
MUFU_SHARE = 1 / 8
QBLOCK = 256

MASTER_FP32, MASTER_REMAINDER, MASTER_NONE = 0, 1, 2
FLOAT, BF16, U8 = "float", "bf16", "u8"

# the hash's second multiplier (math.h: mix32): one per stochastic-rounding draw
HASH_MARKER = 0x846CA68B


@dataclass(frozen=True)
class Mode:
    label: str
    master: int    # MASTER_*
    state: str     # FLOAT / BF16 / U8

    def moment_bytes(self) -> float:
        return {FLOAT: 4, BF16: 2, U8: 1}[self.state]


MODES = (
    Mode("fp32 master", MASTER_FP32, FLOAT),
    Mode("+rem", MASTER_REMAINDER, FLOAT),
    Mode("+bf16m", MASTER_FP32, BF16),
    Mode("+rem+bf16m", MASTER_REMAINDER, BF16),
    Mode("+sr", MASTER_NONE, FLOAT),
    Mode("+sr+bf16m", MASTER_NONE, BF16),
    Mode("+q8m", MASTER_FP32, U8),
    Mode("+rem+q8m", MASTER_REMAINDER, U8),
    Mode("+sr+q8m", MASTER_NONE, U8),
)

MOMENTS = {"adam": 2, "sgd": 1, "lion": 1}  # SGD with momentum


def read_write_bytes(mode: Mode, op: str) -> tuple:
    """(bytes read, bytes written) per element of one step in ``mode`` (bf16 gradients and weights)."""
    moments = MOMENTS[op]
    read, write = 2.0, 0.0  # the gradient
    if mode.master == MASTER_FP32:
        read, write = read + 4, write + 4 + 2  # the master, and the bf16 weight rounded from it
    elif mode.master == MASTER_REMAINDER:
        read, write = read + 4, write + 4      # weight and remainder
    else:
        read, write = read + 2, write + 2      # the weight alone
    mb = mode.moment_bytes() + (4 / QBLOCK if mode.state == U8 else 0.0)
    return read + moments * mb, write + moments * mb


def draws(mode: Mode, op: str) -> int:
    """Stochastic-rounding draws per element: one where anything is rounded stochastically (the weight without a
    master, compact moments), each stream rounding with its rotation of it (state_precision.stream_bits)."""
    return 1 if mode.master == MASTER_NONE or (mode.state != FLOAT and MOMENTS[op] > 0) else 0


def budget(bytes_per_elem: float) -> float:
    """Instructions per element an H100 can issue while streaming the bytes at 85% of its bandwidth."""
    return ISSUE_PER_S / (FRACTION * BANDWIDTH / bytes_per_elem)
