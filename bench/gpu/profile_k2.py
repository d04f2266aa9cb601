"""One state mode's FusedAdamW steps at GPT-2 small on the cuda backend, for Nsight Compute to read the K2 kernel.

    ncu --clock-control none --kernel-name regex:step_kernel --launch-skip 3 --launch-count 1 \\
        python -m bench.gpu.profile_k2 +sr+q8m

Five steps of bf16 parameters with fresh bf16 gradients and clipping on (the benchmark's configuration), so the
fourth step's K2 is a steady-state one. ``fp32`` names the fp32-master mode; the others are
``bench/step/modes.py``'s suffixes.
"""
from __future__ import annotations

import sys

import torch

import ampfused
from bench.step.modes import BY_SUFFIX
from bench.step.workloads import MODELS, gpt_shapes

STEPS = 5


def main(argv) -> int:
    name = argv[0] if argv else "fp32"
    options = {} if name == "fp32" else dict(BY_SUFFIX[name].options)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = gpt_shapes(*MODELS["gpt2-small"])
    params = [torch.nn.Parameter((torch.randn(s, device=dev, generator=gen) * 0.02).to(torch.bfloat16))
              for s in shapes]
    opt = ampfused.FusedAdamW(params, lr=1e-4, max_grad_norm=1.0, backend="cuda", **options)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, device=dev, generator=gen, dtype=torch.bfloat16)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    print(f"{name}: {sum(p.numel() for p in params)} parameters in {len(params)} tensors, {STEPS} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
