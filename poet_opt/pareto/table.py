"""A sweep's rows: their columns, the statuses a point can end in, and the CSV they are written as."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Iterable

COLUMNS = [
    "model", "device", "mode", "ram_bytes", "runtime_budget_s", "status",
    "energy_j", "compute_j", "page_in_j", "page_out_j", "runtime_s", "peak_ram_bytes",
    "recomputes", "page_ins", "page_outs", "gap", "solve_s",
    "plain_energy_j", "plain_peak_bytes", "min_feasible_ram_bytes", "error",
]
# statuses of a row that carries a schedule (and so an energy)
SOLVED = ("optimal", "gap_limit", "time_limit")
STATUSES = SOLVED + ("infeasible", "no_schedule", "error")

_INT_COLUMNS = {"ram_bytes", "peak_ram_bytes", "recomputes", "page_ins", "page_outs", "plain_peak_bytes",
                "min_feasible_ram_bytes"}
_FLOAT_COLUMNS = {"runtime_budget_s", "energy_j", "compute_j", "page_in_j", "page_out_j", "runtime_s", "gap",
                  "solve_s", "plain_energy_j"}


class SweepResult(list):
    """The rows of a sweep; ``interrupted`` is True when Ctrl-C stopped it (the rows are those that
    finished)."""

    interrupted: bool = False


def empty_row(model_name: str, device_name: str, mode: str, ram: int) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(model=model_name, device=device_name, mode=mode, ram_bytes=int(ram))
    return row


def write_csv(rows: Iterable[dict], path) -> None:
    """Rows as CSV with the ``COLUMNS`` header; empty cells for missing values."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_csv(path) -> list[dict]:
    """The inverse of ``write_csv``: numbers back as int/float, empty cells as None."""
    out = []
    with open(path, newline="") as fh:
        for raw in csv.DictReader(fh):
            row = {}
            for k, v in raw.items():
                if v == "" or v is None:
                    row[k] = None
                elif k in _INT_COLUMNS:
                    row[k] = int(float(v))
                elif k in _FLOAT_COLUMNS:
                    row[k] = float(v)
                else:
                    row[k] = v
            out.append(row)
    return out
