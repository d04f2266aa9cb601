"""The GPU check in parts, each sized for one 10-minute command, and the merge of their summaries.

The whole check (the suite on a GPU machine, four sanitizers, the probes and the benchmark) takes longer than one
command on a leased machine may run. ``python -m bench.gpu OUT --part NAME`` runs one part (its stages, with
limits that fit 575 s); ``python -m bench.gpu.merge OUT PART_DIR...`` then writes one ``summary.md`` and
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


PARTS: Dict[str, Part] = {
    "kernels": Part("build, info, the GPU-marked tests, no-wait, sync-debug, graph capture, launch counts, the "
                    "2**31-element buffer, the benchmark and the default loop",
                    ("build", "info", "suite-gpu", "probes", "bench", "loop"),
                    {"suite-gpu": 200, "bench": 120}),
    "suite": Part("build, then the rest of the suite (not GPU-marked)", ("build", "suite-rest"),
                  {"suite-rest": 500}),
    "sanitizers": Part("build, then compute-sanitizer memcheck, racecheck, synccheck and initcheck",
                       ("build", "sanitizer"),
                       {"sanitizer-memcheck": 100, "sanitizer-racecheck": 245, "sanitizer-synccheck": 60,
                        "sanitizer-initcheck": 100}),
}
