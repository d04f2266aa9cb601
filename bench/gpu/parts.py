"""The GPU check in parts, each sized for one command of at most 300 s, and the merge of their summaries.

A leased GPU machine comes for 15 minutes, its start included, at most 10 minutes a command. The whole build takes
80 to 120 s on the 16 cores of an H200 machine (measured 2026-11-27: its last eight objects 77 s after a first
attempt was stopped at 39 s), so the check runs as four parts of at most 300 s: ``kernels`` first on a fresh
machine (the build, the GPU-marked tests, the no-wait tests), then ``probes``, ``suite`` (the rest of the suite)
and ``sanitize`` on the same machine, whose build finds nothing to do; two or three of them fit one lease.
``python -m bench.gpu OUT --part NAME`` runs one part (its stages within the part's budget; the stages' own
limits, or the part's, add up to it); ``python -m bench.gpu.merge OUT PART_DIR...``
then writes one ``summary.md`` and ``summary.json`` over the parts' folders: each stage's row comes from the part
that ran it (a part that only skipped it, "not selected", gives no row), ``env`` and ``build``, which every part
runs, from the first part that ran them unless a later one failed there.
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


_WARM_BUILD = {"build": 30.0}  # after the kernels part on the same machine: ninja has nothing left to do

PARTS: Dict[str, Part] = {
    "kernels": Part("build (the whole build on a fresh machine), info, the GPU-marked tests and the no-wait tests",
                    ("build", "info", "suite-gpu", "no-wait")),
    "probes": Part("build (nothing to do after the kernels part), sync-debug, graph capture, launch counts, the "
                   "2**31-element buffer, the benchmark and the default loop",
                   ("build", "sync-debug", "graph-capture", "launch-counts", "big-buffer", "bench", "loop"),
                   dict(_WARM_BUILD)),
    "suite": Part("build (nothing to do after the kernels part), the rest of the suite with CUDA present (it ran 91% "
                  "of its tests in 163 s on an H200 machine, 2026-11-27: it needs a part of its own)",
                  ("build", "suite-rest"), dict(_WARM_BUILD)),
    "sanitize": Part("build (nothing to do after the kernels part), compute-sanitizer memcheck, racecheck, synccheck "
                     "and initcheck", ("build", "sanitizer"), dict(_WARM_BUILD)),
}
