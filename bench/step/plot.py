"""Step time against parameters (log-log), one line per variant, with the roofline of the byte model.

``python -m bench.step.plot RESULTS.csv [-o OUT.png]``. One panel per (gradient dtype, clip); the roofline is
``minimal_bytes / bandwidth`` (bench/common/bytes.py), the fastest any step can be on that machine, with the highest
copy or in-place read-modify-write bandwidth measured for the panel's rows (each row's are measured around
its own timing): on CPUs ``copy_`` pays a write-allocate read of its destination that a step mostly does not,
so a roofline drawn from it alone is not a floor, and the highest of the run's measurements keeps it one.
"""
from __future__ import annotations

import argparse
import os
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from ..common.bytes import minimal_bytes
from .report import bandwidth_range, read_csv
from .workloads import DTYPES

STYLE = {"torch-foreach": ("tab:gray", "o"), "torch-fused": ("tab:blue", "s"), "torch-compile": ("tab:purple", "^")}
OTHER_COLORS = ["tab:red", "tab:green", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]


def roofline(rows: List[dict]) -> Tuple[float, str, Dict[int, float]]:
    """The floor of one panel's rows (one gradient dtype): (GB/s, which bandwidth, {parameters: ms}), with the
    highest copy_ or in-place read-modify-write bandwidth measured for them (older CSVs have copy_ only)."""
    copy = bandwidth_range(rows, "copy_gbps")
    rmw = bandwidth_range(rows, "rmw_gbps")
    bw, which = (rmw[1], "in-place read-modify-write") if rmw and (not copy or rmw[1] > copy[1]) else \
        (copy[1], "copy_")
    g = DTYPES[rows[0]["grad_dtype"]]
    sizes = {int(r["numel"]) for r in rows}
    per_param = minimal_bytes(1, g, g, g != DTYPES["fp32"])
    moved = [float(r["bytes_per_param"]) for r in rows if r.get("bytes_per_param") not in (None, "", "n/a")]
    if moved:  # compact state modes move fewer bytes: the floor is the least any row's format moves
        per_param = min(moved)
    return bw, which, {n: n * per_param / (bw * 1e9) * 1e3 for n in sizes}


def plot_rows(rows: List[dict], out: str, title: Optional[str] = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["grad_dtype"], r["clip"]) for r in rows})
    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.8 * nrows), squeeze=False)
    others = sorted({r["variant"] for r in rows} - set(STYLE))
    markers = "DvP*Xh<>"  # a new marker each time the colors come round again
    style = dict(STYLE, **{v: (OTHER_COLORS[i % len(OTHER_COLORS)], markers[i // len(OTHER_COLORS) % len(markers)])
                           for i, v in enumerate(others)})
    for ax, (dtype, clip) in zip(axes.flat, panels):
        sel = [r for r in rows if r["grad_dtype"] == dtype and r["clip"] == clip]
        lines = defaultdict(list)
        for r in sel:
            lines[r["variant"]].append((int(r["numel"]), float(r["median_ms"]), float(r["p20_ms"]),
                                        float(r["p80_ms"]), r["workload"]))
        for variant, pts in sorted(lines.items()):
            pts.sort()
            color, marker = style[variant]
            x = [p[0] for p in pts]
            y = [p[1] for p in pts]
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            ax.errorbar(x, y, yerr=err, color=color, marker=marker, label=variant, capsize=2, lw=1.5)
        bw, which, floor = roofline(sel)
        xs = sorted(floor)
        ax.plot(xs, [floor[n] for n in xs], "k--", lw=1, label=f"roofline: {bw:.0f} GB/s ({which})")
        names = {int(r["numel"]): r["workload"] for r in sel}
        for n in xs:  # workload names along the top, inside the panel, clear of the axes and their labels
            ax.annotate(names[n], (n, 0.97), xycoords=("data", "axes fraction"), fontsize=7, ha="center",
                        va="top", color="0.35")
        ax.margins(x=0.1, y=0.12)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("step time (ms, median; bars p20-p80)")
        ax.set_title(f"{dtype} gradients, {'clipped' if clip == 'true' else 'not clipped'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    first = rows[0]
    fig.suptitle(title or f"{first['device']}\ntorch {first['torch']}, ampfused {first['git_sha']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_csv(csv_path: str, out: Optional[str] = None) -> str:
    rows = read_csv(csv_path)
    if not rows:
        raise SystemExit(f"{csv_path} has no rows to plot")
    return plot_rows(rows, out or os.path.splitext(csv_path)[0] + ".png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step.plot", description=__doc__)
    p.add_argument("csv")
    p.add_argument("-o", "--out", default=None, help="PNG path (default: the CSV's path with .png)")
    args = p.parse_args(argv)
    print(plot_csv(args.csv, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
