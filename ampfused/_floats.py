"""Host floats as the kernels hold them: shared by the specification (``ampfused.ops.reference``) and the Triton
launchers, which round their float arguments alike, and importing nothing of ampfused."""
from __future__ import annotations

import math
import struct


def fp32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest even; inf beyond its range), as a Python float, without a tensor."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # (the cast gave inf)
        return math.copysign(math.inf, x)
