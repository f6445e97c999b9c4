"""--min-lifetime-steps at the least energy, and what it costs in energy beside the plan without it.

A wear budget only removes plans, so the plan without it is the cheapest there is; when that plan
already lasts the steps asked, it is the answer and the budget costs nothing. When the budget
cannot bind at all (paging every tensor once a step would wear no more than it allows, and it
leaves the storage row as it was) one solve with the whole time limit says so. Otherwise the plan
without the budget is solved first, in the first half of the time limit, and, if it wears too much,
the plan within the budget in what is left: the difference is what the budget costs (in the plans
found, each as proven as its own solve says).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from poet_opt.device.costs import NodeCosts
from poet_opt.errors import PoetError
from poet_opt.schedule.decisions import Budgets, step_wear_bytes
from poet_opt.schedule.document import Schedule
from poet_opt.units import format_joules

PAGING_MODES = ("joint", "paging")


def cannot_bind(costs: NodeCosts, budgets: Budgets, free: Budgets, mode: str) -> bool:
    """Whether every plan of the graph meets the wear budget: in a mode that pages nothing (the
    updates' own wear was checked against it when the budgets were resolved), or when paging every
    tensor once a step stays within what the budget allows and the storage row is unchanged."""
    if mode not in PAGING_MODES:
        return True
    if budgets.storage_bytes < free.storage_bytes:
        return False
    return float(np.sum(costs.erased_bytes)) <= budgets.erase_bytes


def solve_within_wear(solve_with: Callable[[Budgets, Optional[float]], Schedule], costs: NodeCosts,
                      budgets: Budgets, free: Budgets, mode: str, time_limit: Optional[float]) -> Schedule:
    """``solve_with(budgets, time_limit)`` solves the problem (the time limit counted from the same
    start). Returns the least-energy plan found that meets ``budgets.min_lifetime_steps``, its
    ``solver["wear_budget"]`` saying what the budget cost."""
    steps = budgets.min_lifetime_steps
    if cannot_bind(costs, budgets, free, mode):
        schedule = solve_with(budgets, time_limit)
        schedule.solver["wear_budget"] = {
            "min_lifetime_steps": steps, "binds": False, "solves": 1,
            "energy_without_j": schedule.totals["energy_j"], "cost_j": 0.0,
            # the most a plan can wear per step, within what the budget allows
            "most_worn_bytes": step_wear_bytes(schedule.profile.storage, float(np.sum(costs.erased_bytes)))}
        return schedule
    first = solve_with(free, None if time_limit is None else time_limit / 2)
    lifetime = first.lifetime_steps()
    energy_without = first.totals["energy_j"]
    if lifetime is None or lifetime >= steps:
        # the budget's rows hold for this plan: it is the plan of the budgeted problem too
        first = replace(first, budgets=budgets, solver=dict(first.solver))
        first.solver["wear_budget"] = {"min_lifetime_steps": steps, "binds": False, "solves": 1,
                                       "energy_without_j": energy_without, "cost_j": 0.0,
                                       "lifetime_without": lifetime}
        return first
    try:
        schedule = solve_with(budgets, time_limit)
    except PoetError as exc:  # say what the user can have instead
        exc.message += (f" (without --min-lifetime-steps the plan uses {format_joules(energy_without)} and lasts "
                        f"{lifetime:,} steps)")
        exc.args = (exc.one_line(),)
        raise
    schedule.solver["wear_budget"] = {
        "min_lifetime_steps": steps, "binds": True, "solves": 2, "energy_without_j": energy_without,
        "cost_j": schedule.totals["energy_j"] - energy_without, "lifetime_without": lifetime}
    return schedule

