"""Solve for a schedule whose static arena fits the RAM budget: what `poet-opt solve --export` runs.

The MILP bounds the sum of live tensor bytes; firmware needs those tensors at fixed offsets in one
arena, and fragmentation or alignment padding can push the arena past a budget the live peak meets.
`plan_arena` first tries harder placements (restarts, a local search, a longer search when over
budget). When even that does not fit, the schedule itself must leave more room: solve again with
the RAM budget tightened by the overshoot, and repeat a few times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from poet_opt.device.profiles import DeviceProfile, load_profile
from poet_opt.errors import PoetError
from poet_opt.firmware import arena
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule import validator
from poet_opt.schedule.document import Schedule
from poet_opt.solver.backends import relative_gap
from poet_opt.solver.driver import solve
from poet_opt.units import parse_size

MAX_RESOLVES = 4


@dataclass
class FirmwarePlan:
    """A validated schedule and the arena and flash layout its header is rendered from.
    `rounds` has one entry per solve: the RAM budget it was solved at, its live peak and arena."""

    schedule: Schedule
    arena: arena.ArenaPlan
    flash: arena.FlashPlan
    rounds: list[dict] = field(default_factory=list)
    graph: Optional[TrainingGraph] = None  # the graph the schedule plans (graph_for's, after a re-tiling)

    def __iter__(self):  # schedule, plan, flash = solve_for_export(...)
        return iter((self.schedule, self.arena, self.flash))


def solve_for_export(graph: TrainingGraph, device: DeviceProfile | str, *, ram, time_limit: Optional[float] = None,
                     max_resolves: int = MAX_RESOLVES, graph_for: Optional[Callable[[int], TrainingGraph]] = None,
                     **solve_kwargs) -> FirmwarePlan:
    """`poet_opt.solver.driver.solve` (same keyword arguments), then the arena and flash plans, re-solving
    with a tighter RAM budget while the arena exceeds `ram`.

    The schedule returned states the user's budget (it meets it, with its arena too); when it was
    solved at a tighter one, `solver.ram_bytes_solved` says which, and `solver.bound`/`gap` stay
    relative to the first solve's bound, a lower bound on energy at the user's budget. With a time
    limit, each re-solve gets what is left of it but at least a quarter of it.
    ``graph_for(budget)``, when given, builds the graph again for a tightened budget before its
    re-solve: a graph tiled to fit the user's budget (activation strips) may have a node too large for
    the tighter one, which finer tiles bring within it.
    Raises PoetError (field --ram) when no schedule's arena fits after `max_resolves` re-solves, or
    when a tightened budget has no schedule.
    """
    profile = device if isinstance(device, DeviceProfile) else load_profile(device)
    budget = parse_size(ram, field="--ram")
    started = time.perf_counter()
    schedule = solve(graph, profile, ram=budget, time_limit=time_limit, **solve_kwargs)
    first_bound = schedule.solver.get("bound")
    solve_ram = budget
    rounds: list[dict] = []
    while True:
        if solve_ram != budget:
            schedule = _restate_budget(schedule, budget, solve_ram, first_bound)
        doc = schedule.to_dict()
        plan = arena.plan_arena(doc)  # through the module, so tests can substitute a planner
        rounds.append({"ram_bytes": solve_ram, "live_peak_bytes": plan.live_peak_bytes,
                       "arena_bytes": plan.arena_bytes, "energy_j": schedule.totals["energy_j"]})
        if plan.arena_bytes <= budget:
            return FirmwarePlan(schedule, plan, arena.plan_flash(doc), rounds, graph)
        head = (f"the static arena needs {plan.arena_bytes:,} B, more than the RAM budget {budget:,} B "
                f"(live peak {plan.live_peak_bytes:,} B, at best {plan.lower_bound_bytes:,} B with alignment)")
        if len(rounds) > max_resolves:
            raise PoetError(f"{head} after {max_resolves} re-solves with the budget tightened down to "
                            f"{solve_ram:,} B; give a smaller --ram", field="--ram")
        # Tighten by the overshoot, rounded to the alignment, so the next plan leaves that much room.
        solve_ram -= arena.align_up(plan.arena_bytes - budget, plan.alignment)
        remaining = None
        if time_limit is not None:
            remaining = max(time_limit - (time.perf_counter() - started), time_limit / 4)
        try:
            if graph_for is not None and graph.min_working_set_bytes() > solve_ram:
                graph = graph_for(solve_ram)
            schedule = solve(graph, profile, ram=solve_ram, time_limit=remaining, **solve_kwargs)
        except PoetError as exc:
            raise PoetError(f"{head}; re-solving at {solve_ram:,} B to leave room for it: {exc.message}",
                            field="--ram") from None


def _restate_budget(schedule: Schedule, budget: int, solved_at: int, first_bound) -> Schedule:
    """The tighter solve's plan, stated against the user's budget, which it also meets."""
    objective = schedule.totals["energy_j"]
    bound = None if first_bound is None else min(first_bound, objective)
    gap = relative_gap(objective, bound)
    status = schedule.solver["status"]
    if status in ("optimal_for_order", "gap_limit"):
        status = "optimal_for_order" if gap is not None and gap <= 1e-9 else "gap_limit"
    solver = {**schedule.solver, "status": status, "bound": bound, "gap": gap, "ram_bytes_solved": solved_at}
    restated = replace(schedule, budgets=replace(schedule.budgets, ram_bytes=budget), solver=solver)
    validator.validate(restated.to_dict())  # peak <= solved_at < budget: holds unless there is a bug
    return restated
