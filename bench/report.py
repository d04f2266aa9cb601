"""Results as CSV rows (one per measurement, fixed columns) and as a table for people."""
from __future__ import annotations

import csv
import os
from typing import Dict, Iterable, List, Optional, Sequence

COLUMNS = ["device", "torch", "triton", "git_sha", "workload", "numel", "tensors", "grad_dtype", "param_dtype",
           "clip", "variant", "backend", "median_ms", "p20_ms", "p80_ms", "gbps_effective", "copy_gbps",
           "pct_of_copy_bw", "speedup_vs_torch_fused", "speedup_vs_torch_foreach", "host_syncs", "launches",
           "peak_mem_mb", "rmw_gbps", "host_ms"]
OPTIONAL = ("rmw_gbps", "host_ms")  # columns that runs of older versions lack
NA = "n/a"  # what cannot be measured here, or has no baseline to compare with
TORCH_VARIANTS = ("torch-foreach", "torch-fused", "torch-compile")


def _group(row: dict) -> tuple:
    return row["workload"], row["grad_dtype"], row["clip"]


def fill_speedups(rows: List[dict]) -> None:
    """Speedup of each row against torch-fused and torch-foreach on the same workload/dtype/clip."""
    base: Dict[tuple, Dict[str, float]] = {}
    for r in rows:
        if r["variant"] in TORCH_VARIANTS:
            base.setdefault(_group(r), {})[r["variant"]] = float(r["median_ms"])
    for r in rows:
        b = base.get(_group(r), {})
        for col, v in (("speedup_vs_torch_fused", "torch-fused"), ("speedup_vs_torch_foreach", "torch-foreach")):
            r[col] = f"{b[v] / float(r['median_ms']):.4g}" if v in b else NA


def fill_bandwidth(rows: List[dict], copy_gbps: float, rmw_gbps: Optional[float] = None) -> None:
    for r in rows:
        r["copy_gbps"] = f"{copy_gbps:.4g}"
        r["rmw_gbps"] = f"{rmw_gbps:.4g}" if rmw_gbps is not None else NA
        r["pct_of_copy_bw"] = f"{100 * float(r['gbps_effective']) / copy_gbps:.4g}"


def fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return NA
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def write_csv(rows: Iterable[dict], path: str, columns: Sequence[str] = COLUMNS) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, NA) for c in columns})


def read_csv(path: str) -> List[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and list(rows[0].keys()) != COLUMNS:
        missing = [c for c in COLUMNS if c not in rows[0] and c not in OPTIONAL]
        if missing:
            raise ValueError(f"{path} is not a benchmark CSV: missing columns {missing}")
    return rows


def _num(s: str) -> Optional[float]:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def best_torch_speedup(rows: List[dict], row: dict) -> Optional[float]:
    """Speedup against the fastest torch variant measured for the same workload/dtype/clip."""
    times = [float(r["median_ms"]) for r in rows if r["variant"] in TORCH_VARIANTS and _group(r) == _group(row)]
    return min(times) / float(row["median_ms"]) if times else None


def _host_cell(row: dict) -> str:
    host = _num(row.get("host_ms", NA))
    return NA if host is None else f"{host:.3f}"


def table(rows: List[dict], rmw_gbps: Optional[float] = None) -> str:
    """A fixed-width table of the results, grouped by workload, dtype and clip."""
    head = ["workload", "grad", "clip", "variant", "median ms", "p20-p80 ms", "host ms", "Mparam/s", "GB/s", "% copy",
            "% rmw", "x fused", "x foreach", "x best torch", "launches", "syncs", "peak MB"]
    body = []
    for r in rows:
        best = best_torch_speedup(rows, r)
        rmw = NA if not rmw_gbps else f"{100 * float(r['gbps_effective']) / rmw_gbps:.4g}"
        body.append([r["workload"], r["grad_dtype"], r["clip"], r["variant"], f"{float(r['median_ms']):.3f}",
                     f"{float(r['p20_ms']):.3f}-{float(r['p80_ms']):.3f}", _host_cell(r),
                     f"{int(r['numel']) / float(r['median_ms']) / 1e3:.4g}", r["gbps_effective"],
                     r["pct_of_copy_bw"], rmw, r["speedup_vs_torch_fused"], r["speedup_vs_torch_foreach"],
                     NA if best is None else f"{best:.2f}", r["launches"], r["host_syncs"], r["peak_mem_mb"]])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    prev = None
    for r, b in zip(rows, body):
        if prev is not None and _group(r) != prev:
            lines.append("")
        prev = _group(r)
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(b, widths)).rstrip())
    return "\n".join(lines)


def summary(rows: List[dict], copy_gbps: float, device: str, notes: List[str],
            rmw_gbps: Optional[float] = None) -> str:
    out = [f"device: {device}",
           f"measured bandwidth (read + write counted): copy_ {copy_gbps:.1f} GB/s"
           + (f", in-place read-modify-write {rmw_gbps:.1f} GB/s" if rmw_gbps else ""), "",
           table(rows, rmw_gbps) if rows else "(no measurements)"]
    if notes:
        out += ["", "notes:"] + [f"  {n}" for n in notes]
    out += ["", "GB/s counts the minimal bytes of a step (bench/bytes.py: 28 B/param, gradients read once); % copy "
            "is against copy_ (the CSV's pct_of_copy_bw), % rmw against the in-place read-modify-write bandwidth, "
            "which a CPU's copy_ understates by its write-allocate reads; above 100% also means part of the working "
            "set stayed in cache. x best torch is against the fastest torch variant measured; launches on CPU are "
            "outermost operators dispatched, syncs n/a on CPU; host ms (CUDA) is the time until the step call "
            "returned, its kernels queued: the CPU's cost of a step, n/a where the step's time is host time "
            "(bench/measure.py)."]
    return "\n".join(out)
