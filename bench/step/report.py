"""Results as CSV rows (one per measurement, fixed columns) and as a table for people."""
from __future__ import annotations

import csv
from typing import Dict, Iterable, List, Optional, Sequence

from ..common.csv_rows import NA, write_rows

COLUMNS = ["device", "torch", "triton", "git_sha", "workload", "numel", "tensors", "grad_dtype", "param_dtype",
           "clip", "variant", "backend", "median_ms", "p20_ms", "p80_ms", "gbps_effective", "copy_gbps",
           "pct_of_copy_bw", "speedup_vs_torch_fused", "speedup_vs_torch_foreach", "host_syncs", "launches",
           "peak_mem_mb", "rmw_gbps", "host_ms", "pct_of_rmw_bw", "state_bytes_per_param", "bytes_per_param",
           "weight_dev"]
OPTIONAL = ("rmw_gbps", "host_ms", "pct_of_rmw_bw", "state_bytes_per_param", "bytes_per_param",
            "weight_dev")  # columns that runs of older versions lack
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


def fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return NA
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def write_csv(rows: Iterable[dict], path: str, columns: Sequence[str] = COLUMNS) -> None:
    write_rows(rows, path, columns)


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


def _state_cell(row: dict) -> str:
    x = _num(row.get("state_bytes_per_param", NA))
    return NA if x is None else f"{x:.2f}"


def pct_of_rmw(row: dict) -> Optional[float]:
    """The row's effective bandwidth as a percentage of the in-place read-modify-write bandwidth measured with
    it (None: not measured); older CSVs have no such column, only the run's bandwidth."""
    pct = _num(row.get("pct_of_rmw_bw", NA))
    if pct is not None:
        return pct
    rmw = _num(row.get("rmw_gbps", NA))
    return 100 * float(row["gbps_effective"]) / rmw if rmw else None


def bandwidth_range(rows: List[dict], column: str) -> Optional[tuple]:
    """(lowest, highest) of a bandwidth column over the rows, None when no row has it."""
    xs = [x for x in (_num(r.get(column, NA)) for r in rows) if x]
    return (min(xs), max(xs)) if xs else None


def table(rows: List[dict]) -> str:
    """A fixed-width table of the results, grouped by workload, dtype and clip."""
    head = ["workload", "grad", "clip", "variant", "median ms", "p20-p80 ms", "host ms", "Mparam/s", "GB/s", "% copy",
            "% rmw", "x fused", "x foreach", "x best torch", "state B/p", "moved B/p", "dev", "launches", "syncs",
            "peak MB"]
    body = []
    for r in rows:
        best = best_torch_speedup(rows, r)
        rmw = pct_of_rmw(r)
        rmw = NA if rmw is None else f"{rmw:.4g}"
        body.append([r["workload"], r["grad_dtype"], r["clip"], r["variant"], f"{float(r['median_ms']):.3f}",
                     f"{float(r['p20_ms']):.3f}-{float(r['p80_ms']):.3f}", _host_cell(r),
                     f"{int(r['numel']) / float(r['median_ms']) / 1e3:.4g}", r["gbps_effective"],
                     r["pct_of_copy_bw"], rmw, r["speedup_vs_torch_fused"], r["speedup_vs_torch_foreach"],
                     NA if best is None else f"{best:.2f}", _state_cell(r), r.get("bytes_per_param", NA) or NA,
                     r.get("weight_dev", NA) or NA, r["launches"], r["host_syncs"], r["peak_mem_mb"]])
    if all(_num(r.get("state_bytes_per_param", NA)) is None for r in rows):  # CSVs of older versions
        keep = [k for k, h in enumerate(head) if h not in ("state B/p", "moved B/p")]
        head, body = [head[k] for k in keep], [[b[k] for k in keep] for b in body]
    if all(_num(r.get("weight_dev", NA)) is None for r in rows):  # CSVs of older versions
        keep = [k for k, h in enumerate(head) if h != "dev"]
        head, body = [head[k] for k in keep], [[b[k] for k in keep] for b in body]
    if all(_num(r.get("host_ms", NA)) is None for r in rows):  # (host-timed devices: the step's time is host time)
        keep = [k for k, h in enumerate(head) if h != "host ms"]
        head, body = [head[k] for k in keep], [[b[k] for k in keep] for b in body]
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


def _span(r: Optional[tuple]) -> str:
    return "n/a" if r is None else (f"{r[0]:.1f}" if round(r[0], 1) == round(r[1], 1) else f"{r[0]:.1f}-{r[1]:.1f}")


def summary(rows: List[dict], device: str, notes: List[str]) -> str:
    out = [f"device: {device}",
           "bandwidth measured with each variant's timing (read + write counted): copy_ "
           f"{_span(bandwidth_range(rows, 'copy_gbps'))} GB/s, in-place read-modify-write "
           f"{_span(bandwidth_range(rows, 'rmw_gbps'))} GB/s", "",
           table(rows) if rows else "(no measurements)"]
    if notes:
        out += ["", "notes:"] + [f"  {n}" for n in notes]
    out += ["", "GB/s counts the minimal bytes of each variant's step (moved B/p: bench/common/bytes.py, 28 B/param for fp32 "
            "masters and moments, fewer in the compact state modes, gradients read once); state B/p is measured: the "
            "storages of the optimizer state the variant keeps between steps (masters, moments, remainders) per "
            "parameter; % copy "
            "is against copy_ (the CSV's pct_of_copy_bw), % rmw against the in-place read-modify-write bandwidth, "
            "which a CPU's copy_ understates by its write-allocate reads; both against the median of the row's own "
            "samples, taken right before and after its timed steps (bench/common/measure.py: Yardstick); above 100% "
            "also means part of the working set stayed in cache. x best torch is against the fastest torch variant "
            "measured; dev (the CSV's weight_dev) is how far the row's weights are from the reference after the "
            "check steps, max |w - w_ref| / max |w_ref| over the tensors (bench/step/runner.py: weight_deviation): "
            "rounding for an fp32-master step, the format's own error for a compact mode or a peer; launches on CPU "
            "are outermost operators dispatched, syncs n/a on CPU; host ms (CUDA only) is "
            "the time until the step call returned, its kernels queued: the CPU's cost of a step "
            "(bench/common/measure.py)."]
    return "\n".join(out)
