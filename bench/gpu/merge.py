"""``python -m bench.gpu.merge OUT_DIR PART_DIR...``: one summary over the folders of ``python -m bench.gpu --part``
runs (see :mod:`bench.gpu.parts`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from .check import STAGE_NAMES, SUMMARY_JSON, SUMMARY_MD, _md_cell, _write_atomic
from .tools import FAIL, PASS, SKIP, TIMEOUT

NOT_RUN = "not selected"


def _ran(stage: dict) -> bool:
    return not (stage.get("status") == SKIP and str(stage.get("reason", "")).startswith(NOT_RUN))


def merge(parts: List[dict], names: List[str]) -> dict:
    """The merged summary of the parts' ``summary.json`` data (``names``: each part's folder, for the rows)."""
    stages = []
    for stage in STAGE_NAMES:
        chosen = None
        for name, data in zip(names, parts):
            row = next((s for s in data.get("stages", []) if s.get("name") == stage), None)
            if row is None or not _ran(row):
                continue
            if chosen is None or row.get("status") in (FAIL, TIMEOUT) and chosen.get("status") not in (FAIL, TIMEOUT):
                chosen = dict(row, part=name)
        stages.append(chosen or {"name": stage, "status": SKIP, "reason": "run by no part", "part": ""})
    counts = {s: sum(r.get("status") == s for r in stages) for s in (PASS, FAIL, TIMEOUT, SKIP)}
    overall = FAIL if counts[FAIL] or counts[TIMEOUT] else (PASS if not counts[SKIP] else "PASS with skips")
    first = parts[0] if parts else {}
    return dict(tool="python -m bench.gpu.merge", parts=names, commits=sorted({p.get("commit", "?") for p in parts}),
                started=[p.get("started") for p in parts], environment=first.get("environment", {}),
                overall=overall, counts=counts, stages=stages)


def markdown(merged: dict, bodies: List[str]) -> str:
    e = merged["environment"]
    lines = ["# ampfused GPU check (merged parts)", "",
             f"- parts: {', '.join(merged['parts'])}; commit {', '.join(merged['commits'])}",
             f"- {e.get('device', '?')} (sm_{e.get('capability', '?')}); torch {e.get('torch', '?')} (CUDA "
             f"{e.get('torch_cuda', '?')}), triton {e.get('triton', '?')}, python {e.get('python', '?')}",
             f"- **overall: {merged['overall']}** ("
             + ", ".join(f"{v} {k}" for k, v in merged["counts"].items() if v) + ")", "",
             "| stage | part | status | time | limit | what it found |", "| --- | --- | --- | --- | --- | --- |"]
    for r in merged["stages"]:
        took = "" if r.get("wall_s") is None else f"{r['wall_s']:.1f} s"
        limit = "" if r.get("limit_s") is None else f"{r['limit_s']:.0f} s"
        lines.append(f"| {r['name']} | {r.get('part', '')} | {r['status']} | {took} | {limit} | "
                     f"{_md_cell(r.get('reason', ''))} |")
    for name, body in zip(merged["parts"], bodies):
        rest = body.split("\n## ", 1)
        if len(rest) == 2:
            lines += ["", f"## From part {name}", "", "## " + rest[1].rstrip()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.merge", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("parts", metavar="PART_DIR", nargs="+", help="folders written by python -m bench.gpu --part")
    args = p.parse_args(argv)
    datas, bodies, names = [], [], []
    for d in args.parts:
        with open(os.path.join(d, SUMMARY_JSON)) as f:
            datas.append(json.load(f))
        md = os.path.join(d, SUMMARY_MD)
        bodies.append(open(md).read() if os.path.isfile(md) else "")
        names.append(os.path.basename(os.path.normpath(d)))
    merged = merge(datas, names)
    os.makedirs(args.out_dir, exist_ok=True)
    _write_atomic(os.path.join(args.out_dir, SUMMARY_JSON), json.dumps(merged, indent=1, default=str) + "\n")
    text = markdown(merged, bodies)
    _write_atomic(os.path.join(args.out_dir, SUMMARY_MD), text)
    print(text)
    return 1 if merged["overall"] == FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
