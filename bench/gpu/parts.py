"""The GPU check in parts, each sized for one 10-minute command, and the merge of their summaries.

A leased GPU machine comes for 15 minutes, its start included, at most 10 minutes a command: the check runs as two
parts of at most 300 s each, so both and a rerun of one fit. ``python -m bench.gpu OUT --part NAME`` runs one part
(its stages within the part's budget; the stages' own limits add up to it); ``python -m bench.gpu.merge OUT PART_DIR...`` then writes one ``summary.md`` and
``summary.json`` over the parts' folders: each stage's row comes from the part that ran it (a part that only
skipped it, "not selected", gives no row), ``env`` and ``build``, which every part runs, from the first part
that ran them unless a later one failed there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple


@dataclass(frozen=True)
class Part:
    title: str
    only: Tuple[str, ...]
    limits: Dict[str, float] = field(default_factory=dict)
    budget: float = 300.0  # seconds: two parts and a rerun of one fit a 15-minute window with the machine's start


PARTS: Dict[str, Part] = {
    "kernels": Part("build, info, the GPU-marked tests, no-wait, sync-debug, graph capture, launch counts, the "
                    "2**31-element buffer, the benchmark and the default loop",
                    ("build", "info", "suite-gpu", "probes", "bench", "loop")),
    "rest": Part("build (nothing to do after the kernels part on the same machine), the rest of the suite with CUDA "
                 "present, compute-sanitizer memcheck, racecheck, synccheck and initcheck",
                 ("build", "suite-rest", "sanitizer")),
}
