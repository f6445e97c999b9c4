"""The whole path as one plain function: graph + profile + budgets -> validated Schedule."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Optional

from poet_opt.device.costs import NodeCosts, node_costs
from poet_opt.device.profiles import DeviceProfile, load_profile
from poet_opt.errors import InfeasibleError, NoScheduleFound, PoetError
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule import validator
from poet_opt.schedule.decisions import Budgets, build_steps, plain_decisions, totals_of
from poet_opt.schedule.document import Schedule
from poet_opt.solver.backends import Progress, SolveResult, relative_gap, solve_milp
from poet_opt.solver.formulation import MODES, Formulation, decision_count
from poet_opt.solver.gap_milp import gap_milp_plan
from poet_opt.solver.heuristics import starting_points
from poet_opt.units import format_bytes, format_seconds, parse_runtime, parse_size


def resolve_budgets(graph: TrainingGraph, profile: DeviceProfile, costs: NodeCosts,
                    ram, runtime=None) -> Budgets:
    """ram: bytes or '1.5MB'; runtime: seconds, '2.5s', '1.2x' (of plain training), or None for
    unlimited."""
    ram_bytes = parse_size(ram, field="--ram")
    plain_s = costs.plain_runtime_s
    if runtime is None:
        runtime_s = math.inf
    else:
        runtime_s = parse_runtime(runtime, plain_s, field="--runtime")
        if runtime_s < plain_s * (1 - 1e-9):
            raise PoetError(
                f"the runtime budget {format_seconds(runtime_s)} is below plain training on this device "
                f"({format_seconds(plain_s)}); every node must run at least once, so give at least 1x",
                field="--runtime")
    return Budgets(ram_bytes=ram_bytes, runtime_s=runtime_s, storage_bytes=profile.storage.capacity_bytes)


def plain_summary(graph: TrainingGraph, costs: NodeCosts) -> dict:
    steps = build_steps(graph, plain_decisions(graph))
    totals = totals_of(graph, costs, steps)
    return {"energy_j": totals["energy_j"], "runtime_s": totals["runtime_s"],
            "peak_ram_bytes": totals["peak_ram_bytes"]}


def min_feasible_ram(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *,
                     time_limit: float = 30.0, backend: str = "highs") -> tuple[Optional[int], Optional[int]]:
    """The smallest RAM budget at which a schedule exists in this mode under the same runtime and
    storage budgets, as (best found, proven lower bound). (None, None): proven that none exists;
    (None, bound): none found within the time limit."""
    if mode == "none":
        peak = graph.plain_peak_bytes()
        return peak, peak
    relaxed = Budgets(ram_bytes=math.inf, runtime_s=budgets.runtime_s, storage_bytes=budgets.storage_bytes)
    form = Formulation(graph, costs, relaxed, mode, minimize_peak=True)
    # Plain training fits any runtime budget poet-opt accepts: the search starts from its peak.
    result = solve_milp(form.milp, backend=backend, time_limit=time_limit, gap=1e-6,
                        start=form.encode(plain_decisions(graph)))
    if result.x is None:
        return None, (None if result.status == "infeasible" else graph.min_working_set_bytes())
    # Peaks are sums of whole bytes: round away the solver's tolerance (in units of form.mem_unit).
    found = int(round(float(result.x[form.B]) * form.mem_unit))
    bound = (int(math.ceil(result.bound * form.mem_unit - 0.5)) if result.bound is not None
             else graph.min_working_set_bytes())
    return found, max(bound, graph.min_working_set_bytes())


def solve(graph: TrainingGraph, device: DeviceProfile | str, *, ram, runtime=None, mode: str = "joint",
          backend: str = "highs", time_limit: Optional[float] = None, gap: float = 1e-3,
          threads: Optional[int] = None, progress: Optional[Callable[[Progress], None]] = None,
          model_name: Optional[str] = None, start=None) -> Schedule:
    """Find the energy-optimal schedule (or the best one within the time limit) and validate it.

    start: a Schedule or formulation Decisions to start the search from (a Pareto sweep passes the
    plan of a smaller budget, which fits this one); ignored where it breaks this problem's budgets.

    Raises InfeasibleError (with the smallest feasible RAM budget) when no schedule exists,
    NoScheduleFound when the solver stopped before finding one, PoetError for bad input.
    """
    profile = device if isinstance(device, DeviceProfile) else load_profile(device)
    if mode not in MODES:
        raise PoetError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}", field="--mode")
    if not (gap >= 0):
        raise PoetError(f"the relative gap must be >= 0, got {gap}", field="--gap")
    if time_limit is not None and not (time_limit > 0):
        raise PoetError(f"the time limit must be positive, got {time_limit}", field="--time-limit")
    began = time.perf_counter()  # the time limit covers the starts and the build too, not just the MILP
    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, ram, runtime)

    if budgets.ram_bytes < graph.min_working_set_bytes():
        _raise_infeasible(graph, costs, budgets, mode, backend, reason="some node and its inputs alone need more",
                          time_limit=time_limit)

    candidates = starting_points(graph, costs, budgets, mode)
    solve_s = 0.0
    # Past this size the full MILP's root LP is out of reach of any interactive time limit (ResNet-50's
    # 190k columns do not finish it in 90 s; 1000 nodes make 1.6M): the best start stands, with the
    # plain-training floor as its bound. Without a time limit the user asked to wait for the optimum.
    full_decisions = decision_count(graph, mode)
    skip_full = time_limit is not None and full_decisions > FULL_MILP_MAX_DECISIONS and backend == "highs"
    if backend == "highs" and graph.plain_peak_bytes() > budgets.ram_bytes:
        # The compact gap MILP's optimum is a plan of the full space: a better start in a second or
        # two (not a bound). Its time counts against the user's limit; it gets most of it when the
        # full MILP is out of reach.
        started = time.perf_counter()
        limit = GAP_MILP_TIME_S if time_limit is None else min(GAP_MILP_TIME_S, time_limit / 5)
        if skip_full:
            limit = time_limit * 0.7
        best = gap_milp_plan(graph, costs, budgets, mode, time_limit=limit, threads=threads)
        if best is not None and not candidates:
            candidates = [best]
        elif best is not None:
            energy = [totals_of(graph, costs, build_steps(graph, d))["energy_j"] for d in (best, candidates[0])]
            candidates = [best, *candidates] if energy[0] <= energy[1] else [candidates[0], best, *candidates[1:]]
        solve_s += time.perf_counter() - started
    # The caller's plan (a Pareto sweep passes the budget below's) is one more candidate, so every
    # path below can take it: the full MILP's start, the floor check, and the plan kept on a skip.
    warm = _fitting_plan(graph, costs, budgets, mode, profile, getattr(start, "decisions", start))
    if warm is not None:
        candidates = sorted([warm, *candidates], key=lambda d: _energy(graph, costs, d))
    first = decisions = form = None
    build_s = 0.0
    skip_full = skip_full and bool(candidates)
    full_note = f"skipped: {full_decisions} binaries" if skip_full else "solved"
    floor = costs.plain_energy_j
    head = cost_cap = None
    if candidates and not skip_full:
        head = totals_of(graph, costs, build_steps(graph, candidates[0]))["energy_j"]
        # No plan at least as good as the best start spends more than it does above plain training on
        # any one action: the full MILP leaves out every dearer one (see Formulation's cost_cap).
        cost_cap = (head - floor) + 1e-9 * head
    if head is not None and backend == "highs":
        # Plain training's energy bounds every plan: a start that close to it is already proven within
        # the gap asked for (plain training itself when it fits), and the full MILP can only confirm it.
        # (A backend the user named explicitly still runs, and says so if it is missing.)
        if relative_gap(head, min(floor, head)) <= max(gap, 1e-12):
            skip_full, full_note = True, "not needed: the best start is within the gap of the plain-training floor"
    if skip_full:
        first, decisions = SolveResult("time_limit", None, None, None, 0.0, backend), candidates[0]
    for margin in (() if skip_full else (0.0, 1e-6)):
        started = time.perf_counter()
        form = Formulation(graph, costs, budgets, mode, runtime_margin=margin, cost_cap=cost_cap)
        build_s = time.perf_counter() - started
        start = next((x for x in map(form.encode, candidates) if x is not None), None)
        # the re-solve shares the one time limit the user gave
        remaining = None if time_limit is None else max(1.0, time_limit - (time.perf_counter() - began))
        result = solve_milp(form.milp, backend=backend, time_limit=remaining, gap=gap, threads=threads,
                            progress=progress, start=start)
        first = first or result  # the exact budget's bound stays valid whatever happens next
        solve_s += result.solve_s
        if result.x is None:
            break
        found = _without_unread_page_outs(form.decode(result.x))
        if _fits_runtime(graph, costs, found, budgets):
            decisions = found
            break
        # The solver's tolerances let the plan overshoot the runtime budget by a hair: solve again
        # with the budget tightened by a millionth.
    if decisions is None and first.x is not None:
        # Even the tightened solve gave nothing within budget: the optimum sits on the budget's
        # edge, where only the heuristic schedules (checked by replay) are known to be exact.
        decisions = next((d for d in candidates if _fits_runtime(graph, costs, d, budgets)), None)
    if first.status == "infeasible" or (decisions is None and first.x is not None):
        # The second case: the only plans the solver found overshoot the runtime budget by less
        # than its tolerance, and none fits once the budget is tightened by a millionth.
        _raise_infeasible(graph, costs, budgets, mode, backend, time_limit=time_limit)
    if first.status == "error":
        raise PoetError("the solver failed on this model (numerical trouble); check the graph's sizes and costs "
                        "are sane, or try --solver cbc")
    if decisions is None:
        what = {"time_limit": "the time limit ran out", "interrupted": "the solve was interrupted"}.get(
            first.status, f"the solver stopped ({first.status})")
        raise NoScheduleFound(f"{what} before any schedule within the budgets was found; "
                              "give more time (--time-limit) or a looser budget")

    steps = build_steps(graph, decisions)
    totals = totals_of(graph, costs, steps)
    objective = totals["energy_j"]
    # Plain training's energy is a floor for every schedule (each node runs at least once, nothing else
    # is free); it is the bound left when the solver stops before its root relaxation does better.
    bound = min(floor if first.bound is None else max(first.bound, floor), objective)
    if head is not None:
        # With actions dearer than the start's extra energy left out, the MILP's bound covers only the
        # plans at least as good as the start: the start's energy caps the bound for the rest.
        bound = min(bound, head)
    requested_gap, gap = gap, relative_gap(objective, bound)
    status = first.status
    if status in ("optimal", "gap_limit") or (skip_full and gap is not None and gap <= requested_gap):
        status = "optimal" if gap is not None and gap <= 1e-9 else "gap_limit"
    schedule = Schedule(
        model=model_name or graph.name, mode=mode, graph=graph, profile=profile, costs=costs, budgets=budgets,
        decisions=decisions, steps=steps, totals=totals, plain=plain_summary(graph, costs),
        solver={
            "backend": first.backend, "status": status,
            "objective": objective, "bound": bound, "gap": gap, "plain_floor_j": floor,
            "build_s": build_s, "solve_s": solve_s,
            "variables": form.milp.num_vars if form else None, "constraints": form.milp.num_rows if form else None,
            "full_milp": full_note,
        },
    )
    try:
        validator.validate(schedule.to_dict())
    except validator.ScheduleInvalid as exc:
        # A bug on our side, not the user's: never hand out a plan that fails its own check.
        raise PoetError(f"internal error: the solver's schedule fails validation ({exc.message}); "
                        "please report this with the command line you used") from None
    return schedule


GAP_MILP_TIME_S = 10.0
FULL_MILP_MAX_DECISIONS = 300_000


def _energy(graph, costs, decisions) -> float:
    return totals_of(graph, costs, build_steps(graph, decisions))["energy_j"]


def _fitting_plan(graph, costs, budgets, mode, profile, decisions):
    """The caller's plan if it is one of this graph and mode and its replay keeps every rule and
    budget; else None (a start is a hint, never a reason to fail)."""
    if decisions is None:
        return None
    if (mode in ("remat", "none") and (decisions.page_in or decisions.page_out)) or \
            (mode in ("paging", "none") and decisions.recompute):
        return None
    pairs = (*decisions.recompute, *decisions.page_in, *decisions.keep)
    if any(not (0 <= i < len(graph) and 0 <= t < len(graph)) for t, i in pairs) or \
            any(not 0 <= i < len(graph) for i in decisions.page_out):
        return None  # a plan for some other graph
    steps = build_steps(graph, decisions)
    plan = Schedule(model=graph.name, mode=mode, graph=graph, profile=profile, costs=costs, budgets=budgets,
                    decisions=decisions, steps=steps, totals=totals_of(graph, costs, steps), plain={}, solver={})
    try:
        validator.replay(plan.to_dict())
    except validator.ScheduleInvalid:
        return None
    return decisions


def _fits_runtime(graph, costs, decisions, budgets) -> bool:
    replayed = totals_of(graph, costs, build_steps(graph, decisions))["runtime_s"]
    return replayed <= budgets.runtime_s * (1 + 1e-9)  # the validator's float tolerance


def _without_unread_page_outs(decisions):
    """A page-out that is never paged back in costs energy and buys nothing; a time-limited
    incumbent can contain one."""
    read_back = {i for _, i in decisions.page_in}
    return replace(decisions, page_out=frozenset(i for i in decisions.page_out if i in read_back))


def _raise_infeasible(graph, costs, budgets, mode, backend, reason: str = "", time_limit=None) -> None:
    limit = 30.0 if time_limit is None else min(30.0, time_limit)
    found, bound = min_feasible_ram(graph, costs, budgets, mode, backend=backend, time_limit=limit)
    runtime_note = "" if math.isinf(budgets.runtime_s) else f" and runtime {format_seconds(budgets.runtime_s)}"
    head = f"no schedule fits {format_bytes(budgets.ram_bytes)} of RAM{runtime_note} in mode {mode}"
    if reason:
        head += f" ({reason})"
    if found is None and bound is not None:
        raise InfeasibleError(f"{head}; the smallest feasible budget is at least {format_bytes(bound)}, but no "
                              "schedule was found within the time limit to say how much more",
                              min_ram_lower_bound=bound, field="--ram")
    if found is None:
        advice = []
        if math.isfinite(budgets.runtime_s):
            advice.append("loosen --runtime")
        if mode != "joint":
            advice.append("use --mode joint")
        hint = f" ({' or '.join(advice)})" if advice else ""
        raise InfeasibleError(f"{head}; no RAM budget is enough in this mode under these budgets{hint}",
                              min_ram_lower_bound=math.inf, field="--ram")
    if found <= budgets.ram_bytes:
        # RAM is not what binds: the runtime budget is (to within a millionth) below every plan.
        raise InfeasibleError(f"{head}; at this RAM budget every schedule needs more time than "
                              f"{format_seconds(budgets.runtime_s)}: loosen --runtime", min_ram_lower_bound=bound,
                              field="--runtime")
    if bound is not None and bound < found:
        tail = f"the smallest feasible budget is between {format_bytes(bound)} and {format_bytes(found)}"
    else:
        tail = f"the smallest feasible budget is {format_bytes(found)} ({found} B)"
    raise InfeasibleError(f"{head}; {tail}", min_ram_bytes=found, min_ram_lower_bound=bound, field="--ram")
