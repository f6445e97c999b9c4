"""One point of a sweep: solve a model on a device at one RAM budget, as a row that never raises.

Module-level functions fed plain data, so a process pool or a Dask worker can run them; the graph
of a zoo model is built once per process.
"""

from __future__ import annotations

import math
import os

from poet_opt.errors import InfeasibleError, NoScheduleFound, PoetError
from poet_opt.pareto.table import empty_row

_GRAPHS: dict = {}  # per process: (model, kwargs, bytes per element) -> graph


def graph_for(model, model_kwargs: dict, profile):
    if not isinstance(model, str):
        return model
    key = (model, tuple(sorted(model_kwargs.items())), profile.memory.bytes_per_element)
    if key not in _GRAPHS:
        from poet_opt.model.zoo import build_model

        _GRAPHS[key] = build_model(model, bytes_per_element=profile.memory.bytes_per_element, **model_kwargs)
    return _GRAPHS[key]


def run_point(task: dict) -> dict:
    """Solve one point; never raises (except KeyboardInterrupt): failures become a row's status,
    and solve_s is the point's wall time. Module-level and fed plain data, so a process pool can
    run it."""
    import time

    started = time.perf_counter()
    row = empty_row(task["model_name"], task["device_name"], task["mode"], task["ram"])
    try:
        row.update(_solve_point(task, row))
    finally:
        row["solve_s"] = time.perf_counter() - started
    return row


def _solve_point(task: dict, row: dict) -> dict:
    import math as _math

    from poet_opt.device.costs import node_costs
    from poet_opt.device.profiles import load_profile
    from poet_opt.solver.driver import plain_summary, resolve_budgets, solve
    from poet_opt.units import format_seconds, parse_runtime

    try:
        device = task["device"]
        profile = device if not isinstance(device, (str, os.PathLike)) else load_profile(device)
        row["device_ram_bytes"] = profile.memory.ram_bytes
        graph = graph_for(task["model"], task["model_kwargs"], profile)
        costs = node_costs(graph, profile)
        plain = plain_summary(graph, costs)
        row.update(plain_energy_j=plain["energy_j"], plain_peak_bytes=plain["peak_ram_bytes"])
        if task["runtime"] is not None:
            row["runtime_budget_s"] = parse_runtime(task["runtime"], costs.plain_runtime_s, field="--runtime")
            if row["runtime_budget_s"] < costs.plain_runtime_s * (1 - 1e-9):  # no RAM budget helps: no solve
                row.update(status="infeasible", error=f"--runtime: the runtime budget "
                           f"{format_seconds(row['runtime_budget_s'])} is below plain training on this device "
                           f"({format_seconds(costs.plain_runtime_s)}); every node must run at least once")
                return row
        start = task.get("start")
        if start is not None:  # the budget below's plan fits; with the extra RAM it can do less work
            budgets = resolve_budgets(graph, profile, costs, task["ram"], task["runtime"],
                                      task.get("min_lifetime_steps"))
            order, decisions = start  # made in that execution order: loosened in it
            ordered = graph if list(order) == list(range(len(graph))) else graph.reordered(order)
            ordered_costs = costs if ordered is graph else node_costs(ordered, profile)
            start = (order, loosen(ordered, ordered_costs, decisions, budgets.ram_bytes, budgets.runtime_s))
        schedule = solve(graph, profile, ram=task["ram"], runtime=task["runtime"], mode=task["mode"],
                         time_limit=task["time_limit"], gap=task["gap"], model_name=task["model_name"],
                         start=start, order=task.get("order", "auto"),
                         min_lifetime_steps=task.get("min_lifetime_steps"))
    except InfeasibleError as exc:
        # no message: a point skipped below it would say something else, and rows must not depend
        # on which points a pool happened to solve
        row.update(status="infeasible" if exc.proven else "infeasible_for_order",
                   min_feasible_ram_bytes=exc.min_ram_bytes,
                   _min_ram_lower_bound=exc.min_ram_lower_bound)
        return row
    except NoScheduleFound as exc:
        status = "interrupted" if "interrupted" in exc.message else "no_schedule"
        row.update(status=status, error=exc.one_line())
        return row
    except PoetError as exc:
        row.update(status="error", error=exc.one_line())
        return row
    except Exception as exc:  # a bug on our side: keep the sweep, say what happened
        row.update(status="error", error=f"internal error: {type(exc).__name__}: {exc}")
        return row
    t, solver = schedule.totals, schedule.solver
    row.update(
        status=solver["status"], energy_j=t["energy_j"], compute_j=t["compute_j"], page_in_j=t["page_in_j"],
        page_out_j=t["page_out_j"], runtime_s=t["runtime_s"], peak_ram_bytes=t["peak_ram_bytes"],
        recomputes=t["recomputes"], page_ins=t["page_ins"], page_outs=t["page_outs"], gap=solver["gap"],
    )
    # 1 when weights, gradients, the working peak and the stack reserve fit the device's RAM
    row["fits_device"] = int(schedule.memory()["fits_device"])
    row["lifetime_steps"] = schedule.lifetime_steps()  # empty: nothing written, the storage never wears
    if _math.isfinite(schedule.budgets.runtime_s):
        row["runtime_budget_s"] = float(schedule.budgets.runtime_s)
    if task.get("warm"):  # the start of the next budget up; the sweep takes it out of the row
        row["_decisions"] = (schedule.order or tuple(range(len(schedule.graph))), schedule.decisions)
    return row


def loosen(graph, costs, decisions, ram_bytes: float, runtime_s: float = math.inf):
    """A plan made for a smaller RAM budget, improved for a larger one: tensor by tensor, most
    energy first, keep a recomputed or paged tensor in RAM from its computation to its last reader
    (as plain training does) wherever the replayed plan still fits the budgets. The result is never
    worse than the plan given, and is the MIP start a sweep hands to the next budget up."""
    from poet_opt.schedule.decisions import Decisions, build_steps, totals_of

    last = graph.last_use()
    saving: dict[int, float] = {}
    for _t, i in decisions.recompute:
        saving[i] = saving.get(i, 0.0) + float(costs.compute_j[i])
    for _t, i in decisions.page_in:
        saving[i] = saving.get(i, 0.0) + float(costs.page_in_j[i])
    for i in decisions.page_out:
        saving[i] = saving.get(i, 0.0) + float(costs.page_out_j[i])
    for i in sorted(saving, key=lambda i: (-saving[i], i)):
        trial = Decisions(
            recompute=frozenset(p for p in decisions.recompute if p[1] != i),
            page_in=frozenset(p for p in decisions.page_in if p[1] != i),
            page_out=decisions.page_out - {i},
            keep=decisions.keep | {(t, i) for t in range(i + 1, last[i] + 1)},
        )
        try:
            totals = totals_of(graph, costs, build_steps(graph, trial))
        except RuntimeError:  # not a consistent plan: leave this tensor as it was
            continue
        if totals["peak_ram_bytes"] <= ram_bytes and totals["runtime_s"] <= runtime_s * (1 + 1e-9):
            decisions = trial
    return decisions


def skipped_row(task: dict, cause: dict) -> dict:
    """A point below a budget proven infeasible in the same series: infeasible, not solved."""
    row = empty_row(task["model_name"], task["device_name"], task["mode"], task["ram"])
    for key in ("runtime_budget_s", "plain_energy_j", "plain_peak_bytes", "min_feasible_ram_bytes"):
        row[key] = cause[key]
    row.update(status=cause["status"], solve_s=0.0)
    return row


def error_row(task: dict, error: str) -> dict:
    row = empty_row(task["model_name"], task["device_name"], task["mode"], task["ram"])
    row.update(status="error", error=error)
    return row
