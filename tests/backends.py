"""Which backends the CPU test suite can run: the reference always, native cpu when built, Triton when the
interpreter is on (tests/conftest.py turns it on)."""
import torch

from ampfused import ops


def cpu_backends():
    names = ["reference"]
    for n in ("cpu", "triton"):
        if not ops.registry.reasons_for(n, torch.device("cpu")):
            names.append(n)
    return names
