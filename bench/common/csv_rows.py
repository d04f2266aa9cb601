"""Rows of results as a CSV file: fixed columns, ``n/a`` where a row has no value (shared by the step and the
distributed benchmark)."""
from __future__ import annotations

import csv
import os
from typing import Iterable, Sequence

NA = "n/a"  # what cannot be measured here, or has no baseline to compare with


def write_rows(rows: Iterable[dict], path: str, columns: Sequence[str]) -> None:
    """Write ``rows`` to ``path`` (its folder made if missing) with exactly ``columns``, NA for a missing value."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, NA) for c in columns})
