"""A sweep's rows: their columns, the statuses a point can end in, and the CSV they are written as."""

from __future__ import annotations

import csv
from typing import Iterable

from poet_opt.schedule.document import STATUSES as SCHEDULE_STATUSES

COLUMNS = [
    "model", "device", "mode", "ram_bytes", "runtime_budget_s", "status",
    "energy_j", "compute_j", "page_in_j", "page_out_j", "runtime_s", "peak_ram_bytes",
    "recomputes", "page_ins", "page_outs", "gap", "solve_s",
    "plain_energy_j", "plain_peak_bytes", "min_feasible_ram_bytes", "device_ram_bytes", "fits_device", "lifetime_steps", "error",
]
# statuses of a row that carries a schedule (and so an energy)
SOLVED = tuple(s for s in SCHEDULE_STATUSES if s != "interrupted")
# infeasible: no schedule in any order; infeasible_for_order: none in the execution orders tried
INFEASIBLE = ("infeasible", "infeasible_for_order")
STATUSES = SOLVED + INFEASIBLE + ("no_schedule", "error")

_INT_COLUMNS = {"ram_bytes", "peak_ram_bytes", "recomputes", "page_ins", "page_outs", "plain_peak_bytes",
                "min_feasible_ram_bytes", "device_ram_bytes", "fits_device", "lifetime_steps"}
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
    """Rows as CSV with the ``COLUMNS`` header; empty cells for missing values. Written whole or not
    at all (poet_opt.files.write_atomic)."""
    from poet_opt.files import write_atomic

    def write(fh):
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})

    write_atomic(path, write, field="-o", newline="")


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
