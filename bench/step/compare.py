"""Change of each measurement against a saved run: ``python -m bench.step.compare OLD.csv NEW.csv`` (or
``python -m bench --compare OLD.csv`` after a run).

Rows match on workload, gradient dtype, clip and variant; the change is ``new / old - 1`` of the median
step time (negative is faster). Rows present on one side only are listed as such.
"""
from __future__ import annotations

import argparse
from typing import List

from .report import read_csv

KEY = ("workload", "grad_dtype", "clip", "variant")


def compare_text(old: List[dict], new: List[dict], old_name: str = "old") -> str:
    o = {tuple(r[k] for k in KEY): r for r in old}
    n = {tuple(r[k] for k in KEY): r for r in new}
    head = ["workload", "grad", "clip", "variant", "old ms", "new ms", "change", "old % copy", "new % copy"]
    body = []
    for key in [k for k in n if k in o]:
        a, b = float(o[key]["median_ms"]), float(n[key]["median_ms"])
        body.append(list(key) + [f"{a:.3f}", f"{b:.3f}", f"{100 * (b / a - 1):+.1f}%",
                                 o[key]["pct_of_copy_bw"], n[key]["pct_of_copy_bw"]])
    lines = [f"change against {old_name} (median step time; negative = faster)"]
    if body:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
        lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in body]
    else:
        lines.append("(no measurement in common)")
    only_old = [" ".join(k) for k in o if k not in n]
    only_new = [" ".join(k) for k in n if k not in o]
    if only_old:
        lines.append("only in the saved run: " + "; ".join(only_old))
    if only_new:
        lines.append("only in this run: " + "; ".join(only_new))
    devices = {r["device"] for r in old} | {r["device"] for r in new}
    if len(devices) > 1:
        lines.append("note: the runs come from different devices: " + " vs ".join(sorted(devices)))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step.compare", description=__doc__)
    p.add_argument("old")
    p.add_argument("new")
    args = p.parse_args(argv)
    print(compare_text(read_csv(args.old), read_csv(args.new), args.old))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
