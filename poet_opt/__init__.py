"""poet-opt: energy-optimal rematerialization and paging schedules for on-device training.

The stages, in the order data flows through them (docs/architecture.md): ``model`` (the training
graph), ``device`` (profiles and costs), ``schedule`` (plans, the document, the validator),
``solver`` (``solve``), ``firmware`` (arena, flash layout, C header), ``pareto`` (budget sweeps) and
``plots``. The names below are the public entry points, importable from here; each is loaded on
first use, so ``import poet_opt`` stays cheap for the command line.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "build_model": "poet_opt.model.zoo",
    "load_training_graph": "poet_opt.model.load",
    "load_node_link": "poet_opt.model.node_link",
    "TrainingGraph": "poet_opt.model.graph",
    "load_profile": "poet_opt.device.profiles",
    "list_profiles": "poet_opt.device.profiles",
    "DeviceProfile": "poet_opt.device.profiles",
    "node_costs": "poet_opt.device.costs",
    "Schedule": "poet_opt.schedule.document",
    "validate": "poet_opt.schedule.validator",
    "load_and_validate": "poet_opt.schedule.validator",
    "summary_text": "poet_opt.schedule.report",
    "summary_dict": "poet_opt.schedule.report",
    "solve": "poet_opt.solver.driver",
    "solve_for_export": "poet_opt.firmware.fit",
    "export_header": ("poet_opt.firmware.header", "export"),
    "sweep": "poet_opt.pareto.front",
    "ram_range": "poet_opt.pareto.front",
    "non_dominated": "poet_opt.pareto.front",
    "write_csv": "poet_opt.pareto.table",
    "read_csv": "poet_opt.pareto.table",
    "plot_front": "poet_opt.plots.front",
    "plot_timeline": "poet_opt.plots.timeline",
    "write_json_atomic": "poet_opt.files",
    "write_text_atomic": "poet_opt.files",
    "PoetError": "poet_opt.errors",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'poet_opt' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
