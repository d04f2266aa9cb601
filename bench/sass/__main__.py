"""``python -m bench.sass``: K2's instructions per element in every state mode, against an H100's budget.

Reads the machine code the kernels compile to for sm_90 (no GPU needed; ``bench/sass/cuda.py`` and
``bench/sass/triton.py`` say how) and prints, per optimizer and state mode (bf16 weights and gradients):
elements per trip of the element loop, instructions per element, the budget (``bench/sass/modes.py``), global
memory instructions per element (with their widths), the bytes those move per element against the byte model,
``MUFU`` (and its own budget), barriers and shuffles. docs/state-precision.md keeps the table.

    python -m bench.sass                      # compile csrc/cuda/{adam,adam_bf16m,adam_q8m,sgd,lion}.cu for sm_90 (~2 min)
    python -m bench.sass --module             # the sm_90 code of the built ampfused/_C_cuda
    python -m bench.sass --sass listing.sass  # a saved cuobjdump -sass listing
    python -m bench.sass --triton             # the Triton kernels too (compiled for sm_90 without a GPU)
"""
from __future__ import annotations

import argparse
import sys
from typing import List

from . import cuda as C
from . import modes as M


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.0f}"


def table(rows: List[C.Row]) -> str:
    head = ["op", "mode", "backend", "B/elem", "elems/trip", "instr/elem", "budget", "fits", "mem ops/elem",
            "widths (per trip)", "B/elem seen", "MUFU/elem", "MUFU budget", "BAR/elem", "SHFL/elem"]
    out = [head]
    for r in rows:
        t, e = r.trip, r.elems
        instr = t.insns / e
        widths = " ".join(f"{k}x{v}" for k, v in sorted(t.widths.items()))
        mufu_budget = r.budget * M.MUFU_SHARE
        fits = "yes" if instr <= r.budget and t.mufu / e <= mufu_budget else "NO"
        out.append([r.op, r.mode.label, r.backend, _fmt(r.moved), str(e), _fmt(instr), _fmt(r.budget), fits,
                    _fmt((t.loads + t.stores) / e), widths, _fmt((t.load_bytes + t.store_bytes) / e),
                    _fmt(t.mufu / e), _fmt(mufu_budget), _fmt(t.bars / e), _fmt(t.shfl / e)])
    widths_col = [max(len(row[i]) for row in out) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths_col)) + " |" for row in out]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths_col) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sass", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--module", nargs="?", const="", default=None,
                     help="read the built ampfused/_C_cuda (or the given .so / .cubin) instead of compiling")
    src.add_argument("--sass", help="read a saved cuobjdump -sass listing")
    ap.add_argument("--save", help="also write the CUDA listing here (for --sass later)")
    ap.add_argument("--triton", action="store_true", help="also compile and count the Triton kernels")
    ap.add_argument("--no-cuda", action="store_true", help="only the Triton kernels")
    args = ap.parse_args(argv)
    rows: List[C.Row] = []
    if not args.no_cuda:
        if args.sass:
            text = open(args.sass).read()
        elif args.module is not None:
            text = C.disassemble(args.module or C.built_module())
        else:
            text = C.compile_sources()
        if args.save:
            with open(args.save, "w") as f:
                f.write(text)
        rows += C.rows_from_sass(text)
    if args.triton or args.no_cuda:
        from . import triton as T
        rows += T.rows()
    if not rows:
        print("no K2 kernels found", file=sys.stderr)
        return 1
    print(table(rows))
    print(f"\nbudget: {M.ISSUE_PER_S / 1e12:.0f} T thread-instructions/s over ({M.FRACTION} x "
          f"{M.BANDWIDTH / 1e12} TB/s / B per element); MUFU issues at {M.MUFU_SHARE} of that rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
