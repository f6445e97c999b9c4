"""Pareto stage: solve a model over a range of RAM budgets on several devices and modes, on a local
process pool or a Dask cluster, and keep the energy-memory front (plots live in ``poet_opt.plots``)."""

from poet_opt.pareto.executors import dask_client
from poet_opt.pareto.front import non_dominated, parse_ram_list, ram_range, sweep
from poet_opt.pareto.points import loosen
from poet_opt.pareto.table import COLUMNS, INFEASIBLE, SOLVED, STATUSES, SweepResult, read_csv, write_csv

__all__ = ["COLUMNS", "INFEASIBLE", "SOLVED", "STATUSES", "SweepResult", "dask_client", "loosen", "non_dominated",
           "parse_ram_list", "ram_range", "read_csv", "sweep", "write_csv"]
