"""The whole path as one plain function: graph + profile + budgets -> validated Schedule."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from poet_opt.device.costs import NodeCosts, node_costs
from poet_opt.device.profiles import DeviceProfile, load_profile
from poet_opt.errors import InfeasibleError, NoScheduleFound, PoetError, SolveInterrupted
from poet_opt.model.graph import TrainingGraph
from poet_opt.model.orders import candidate_orders, min_peak_order
from poet_opt.schedule import validator
from poet_opt.schedule.decisions import Budgets, Decisions, build_steps, plain_decisions, totals_of
from poet_opt.schedule.document import Schedule
from poet_opt.solver.backends import (Heartbeat, Progress, SolveResult, interrupt_scope, interrupted, relative_gap,
                                     solve_milp)
from poet_opt.solver.bounds import window_bound
from poet_opt.solver.budgets import resolve_budgets
from poet_opt.solver.chain_bound import chain_bound, higher
from poet_opt.solver.cpsat import solve_cpsat
from poet_opt.solver.formulation import MODES, Formulation, decision_count
from poet_opt.solver.gap_milp import EARLY_FREE_SHARE, gap_milp_plan, within_reach
from poet_opt.solver.heuristics import fits_storage, plan_energy_j, plan_runtime_s, starting_points, refuse_on_storage
from poet_opt.solver.gap_lns import searched_plan
from poet_opt.solver.lns import BOUND_FIRST_MAX_NODES, EARLY_SHARE, search as window_search
from poet_opt.solver.residency import residency_bound
from poet_opt.solver.time_budget import check_time_limit_fits, finish_s
from poet_opt.solver.wear_budget import solve_within_wear
from poet_opt.units import format_bytes, format_seconds


def plain_summary(graph: TrainingGraph, costs: NodeCosts) -> dict:
    # What totals_of says of plain training's steps, without replaying them (seconds at 2000 nodes):
    # fsum is exactly rounded in any order, and the replayed peak is plain_peak_bytes by definition.
    return {"energy_j": costs.plain_energy_j, "runtime_s": costs.plain_runtime_s,
            "peak_ram_bytes": graph.plain_peak_bytes()}


def min_feasible_ram(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *,
                     time_limit: float = 30.0, backend: str = "highs") -> tuple[Optional[int], Optional[int]]:
    """The smallest RAM budget at which a schedule exists in this mode under the same runtime and
    storage budgets, as (best found, proven lower bound). (None, None): proven that none exists;
    (None, bound): none found within the time limit."""
    if mode == "none":
        peak = graph.plain_peak_bytes()
        return peak, peak
    relaxed = replace(budgets, ram_bytes=math.inf)
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


ORDERS = ("auto", "given")
# Graphs this small have few topological orders, and each solve takes milliseconds: with up to
# ENUMERATE_ORDERS_MAX candidates, every one is solved in full. With more, each is screened first
# (heuristics and the gap MILP, no full MILP: a third of the time of a full solve): every order up
# to SCREEN_ORDERS_MAX of them, else the SCREEN_ORDERS_MAX that go least over the RAM budget in plain
# training among up to ENUMERATE_ORDERS_RANKED, or among SAMPLED_ORDERS random ones past that. The
# FULL_SOLVE_ORDERS whose screened plans cost least, and the given order, get the full solve
# (benchmarks/ORDERS.md: the full solve in the 24 orders ranked first instead left a 10-node graph
# with 36 orders 1.41x above the true optimum, and missed every plan of one with 64 orders).
ENUMERATE_ORDERS_MAX_NODES = 24
ENUMERATE_ORDERS_MAX = 24
SCREEN_ORDERS_MAX = 720
ENUMERATE_ORDERS_RANKED = 5000
SAMPLED_ORDERS = 2000
FULL_SOLVE_ORDERS = 6
# The screen's share of the time limit (the full solves need the rest), and its cap without one.
SCREEN_SHARE = 0.4
SCREEN_MAX_S = 5.0
SCREEN_GAP_MILP_S = 1.0
SCREEN_GAP_MILP_TOP = 48


def solve(graph: TrainingGraph, device: DeviceProfile | str, *, ram, runtime=None, mode: str = "joint",
          backend: str = "highs", time_limit: Optional[float] = None, gap: float = 1e-3,
          threads: Optional[int] = None, progress: Optional[Callable[[Progress], None]] = None,
          model_name: Optional[str] = None, start=None, order: str = "auto",
          min_lifetime_steps: Optional[int] = None) -> Schedule:
    """Find the least-energy schedule (or the best one within the time limit) and validate it.

    order: ``"given"`` solves in the graph's own node order; ``"auto"`` (default) also solves in
    orders that hold less in RAM at once (``poet_opt.model.orders``), every order when the graph is
    small, and keeps the best; the time limit is shared between the orders. The schedule's graph
    is in the execution order chosen (``Schedule.order`` maps it back to the given graph).

    start: a Schedule, or (order, Decisions), or Decisions in the given order, to start the search
    from (a Pareto sweep passes the plan of a smaller budget, which fits this one); ignored where
    it breaks this problem's budgets.

    ``solver.status`` says what was proven: ``optimal`` (no valid step sequence of the graph in
    any order uses less energy: the plan reaches plain training's energy), ``optimal_for_order``
    (none in this execution order under the formulation's stage model, docs/formulation.md),
    ``gap_limit`` (within the requested gap of that order's bound), ``time_limit``, ``interrupted``
    or ``stopped`` (the solver ended above the requested gap; ``gap`` says how far).

    Raises InfeasibleError (with the smallest feasible RAM budget) when no schedule exists, or none
    in the orders tried (``proven`` False), NoScheduleFound when the solver stopped before finding
    one, PoetError for bad input.
    """
    profile = device if isinstance(device, DeviceProfile) else load_profile(device)
    if mode not in MODES:
        raise PoetError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}", field="--mode")
    if order not in ORDERS:
        raise PoetError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}", field="--order")
    if not (gap >= 0):
        raise PoetError(f"the relative gap must be >= 0, got {gap}", field="--gap")
    if time_limit is not None and not (time_limit > 0):
        raise PoetError(f"the time limit must be positive, got {time_limit}", field="--time-limit")
    began = time.perf_counter()  # the time limit covers the starts and the build too, not just the MILP
    check_time_limit_fits(graph, time_limit)
    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, ram, runtime, min_lifetime_steps)
    if mode == "none":  # exact, and never below the working set
        _check_plain_fits_some_order(graph, budgets, order)
    if budgets.ram_bytes < graph.min_working_set_bytes():
        _raise_below_working_set(graph, costs, budgets, mode)
    def solve_with(these: Budgets, limit: Optional[float]) -> Schedule:
        return _solve_orders(graph, profile, costs, these, mode, order=order, backend=backend, began=began,
                             time_limit=limit, gap=gap, threads=threads, progress=progress,
                             model_name=model_name, start=start)

    with interrupt_scope():
        if min_lifetime_steps is None:
            return solve_with(budgets, time_limit)
        free = resolve_budgets(graph, profile, costs, ram, runtime)
        return solve_within_wear(solve_with, costs, budgets, free, mode, time_limit)


def _solve_orders(graph, profile, costs, budgets, mode, *, order, backend, began, time_limit, gap, threads,
                  progress, model_name, start) -> Schedule:
    """Solve in each candidate execution order in turn, sharing the time limit, and keep the best; with more
    candidates than are worth a full solve each, only those the screen keeps (``_screen_orders``)."""
    orders = [("given", list(range(len(graph))))]
    screened = 0
    if order == "auto":
        orders = candidate_orders(graph, enumerate_up_to=SCREEN_ORDERS_MAX
                                  if len(graph) <= ENUMERATE_ORDERS_MAX_NODES else 0,
                                  ram_bytes=budgets.ram_bytes, rank_up_to=ENUMERATE_ORDERS_RANKED,
                                  sample=SAMPLED_ORDERS,  # the order searches give up after a tenth of the limit
                                  deadline=None if time_limit is None else began + 0.1 * time_limit)
        # past BOUND_FIRST_MAX_NODES the bound needs most of a solve: other orders if their screened plans are cheaper
        huge = len(graph) > BOUND_FIRST_MAX_NODES and time_limit is not None and len(orders) > 1
        if len(orders) > max(ENUMERATE_ORDERS_MAX, FULL_SOLVE_ORDERS + 1) or huge:
            orders, screened = _screen_orders(graph, profile, budgets, mode, orders, began=began, only_cheaper=huge,
                                              time_limit=time_limit, start=start, progress=progress, backend=backend)
    floor = costs.plain_energy_j
    outcomes: list[_Outcome] = []
    for k, (label, ids) in enumerate(orders):
        share = None
        if time_limit is not None and k > 0 and time.perf_counter() - began >= time_limit:
            break  # the limit is spent: the orders solved so far are the answer
        if time_limit is not None:
            # an equal share of what is left: orders that finish early leave their time to the rest
            share = max(0.05, (time_limit - (time.perf_counter() - began)) / (len(orders) - k))
        here = graph if label == "given" else graph.reordered(ids)
        with Heartbeat(progress) as heartbeat:
            outcome = _solve_in_order(here, node_costs(here, profile) if here is not graph else costs, profile,
                                      budgets, mode, backend=backend, time_limit=share, gap=gap, threads=threads,
                                      progress=progress, start=_start_for(start, ids), heartbeat=heartbeat)
        outcome.label, outcome.order = label, tuple(ids)
        outcomes.append(outcome)
        if outcome.status == "interrupted" or interrupted():
            break  # the user asked to stop: keep what was found so far
        if outcome.energy is not None and relative_gap(outcome.energy, floor) <= max(gap, 1e-12):
            break  # within the gap of plain training's energy, which bounds every order: proven

    found = [o for o in outcomes if o.decisions is not None]
    if not found:
        if all(o.status == "infeasible" for o in outcomes):
            tried = min(outcomes, key=lambda o: o.graph.plain_peak_bytes())
            left = None if time_limit is None else max(0.2, time_limit - (time.perf_counter() - began))
            _raise_infeasible(tried.graph, tried.costs, budgets, mode, backend, time_limit=left,
                              orders_tried=len(outcomes))
        if outcomes[-1].status == "interrupted" or interrupted():
            raise SolveInterrupted("the solve was interrupted before any schedule within the budgets was found")
        what = {"time_limit": "the time limit ran out"}.get(outcomes[-1].status,
                                                           f"the solver stopped ({outcomes[-1].status})")
        if outcomes[-1].full_note.startswith("skipped: building"):
            what = "no heuristic schedule fits, and the full MILP would not build and solve within the time limit"
            refuse_on_storage(outcomes[-1].graph, outcomes[-1].costs, budgets)
        raise NoScheduleFound(f"{what} before any schedule within the budgets was found; "
                              "give more time (--time-limit) or a looser budget")
    best = min(found, key=lambda o: o.energy)  # ties keep the earlier: the given order first
    steps = build_steps(best.graph, best.decisions)
    totals = totals_of(best.graph, best.costs, steps)
    objective = totals["energy_j"]
    requested_gap, order_gap = gap, relative_gap(objective, best.bound)
    if objective <= floor * (1 + 1e-9):
        status = "optimal"
    elif order_gap is not None and order_gap <= 1e-9:
        status = "optimal_for_order"
    elif order_gap is not None and order_gap <= requested_gap:
        status = "gap_limit"
    elif best.status in ("time_limit", "interrupted"):
        status = best.status
    else:
        status = "stopped"
    schedule = Schedule(
        model=model_name or graph.name, mode=mode, graph=best.graph, profile=profile, costs=best.costs,
        budgets=budgets, decisions=best.decisions, steps=steps, totals=totals, plain=plain_summary(graph, costs),
        order=best.order,
        solver={
            "backend": best.backend, "status": status,
            "objective": objective, "bound": best.bound, "gap": order_gap, "plain_floor_j": floor,
            # plain training's energy bounds every valid step sequence in every order
            "bound_any_order": floor, "gap_any_order": relative_gap(objective, floor),
            "order": order, "execution_order": best.label, "orders_tried": len(outcomes),
            # orders whose cheap plans were compared to choose the ones solved in full
            "orders_screened": screened,
            "build_s": sum(o.build_s for o in outcomes), "solve_s": sum(o.solve_s for o in outcomes),
            "variables": best.variables, "constraints": best.constraints, "full_milp": best.full_note,
            "bound_source": best.bound_source,
        },
    )
    try:
        validator.validate(schedule.to_dict())
    except validator.ScheduleInvalid as exc:
        # A bug on our side, not the user's: never hand out a plan that fails its own check.
        raise PoetError(f"internal error: the solver's schedule fails validation ({exc.message}); "
                        "please report this with the command line you used") from None
    return schedule


@dataclass
class _Outcome:
    """What the solve in one execution order found and proved."""

    graph: TrainingGraph
    costs: NodeCosts
    status: str
    decisions: Optional[Decisions] = None
    energy: Optional[float] = None
    bound: Optional[float] = None  # for this order, under the stage model
    backend: str = "highs"
    build_s: float = 0.0
    solve_s: float = 0.0
    variables: Optional[int] = None
    constraints: Optional[int] = None
    full_note: str = ""
    bound_source: str = "plain-training floor"  # what proved ``bound``
    label: str = "given"
    order: tuple = ()


def _screen_orders(graph, profile, budgets, mode, pool, *, began, time_limit, start, progress,
                   backend="highs", only_cheaper=False) -> tuple[list[tuple[str, list[int]]], int]:
    """The orders worth a full solve, out of a pool too large to solve in full, and how many were screened. Each
    order is scored by the energy of the cheapest plan found in it by the heuristics and, in the SCREEN_GAP_MILP_TOP
    orders they score best, the ENUMERATE_ORDERS_MAX the pool ranks first and those where they found none, by the
    gap MILP: a plan of that order, so an upper bound on what its full solve reaches, and a ranking, never a proof.
    The FULL_SOLVE_ORDERS cheapest are kept (``only_cheaper``: only those cheaper than the given order), with the
    given order and the order of the caller's start. No claim rests on the orders left out: "optimal" needs plain
    training's energy, and the any-order bound is that energy, whatever was screened."""
    deadline = began + (SCREEN_MAX_S if time_limit is None else SCREEN_SHARE * time_limit)
    # solved in full whatever their score, even when the screen stops at once
    kept: list[tuple[str, list[int]]] = [(label, ids) for label, ids in pool if label == "given"]
    entries = []  # [energy, pool rank, label, ids, graph in that order, its costs]
    last_report = [time.perf_counter()]

    def stop(done: int) -> bool:
        now = time.perf_counter()
        if progress is not None and now - last_report[0] >= 1.0:
            last_report[0] = now
            progress(Progress(now - began, None, None, None, f"screening execution orders ({done}/{len(pool)})"))
        return interrupted() or now > deadline

    for rank, (label, ids) in enumerate(pool):
        if stop(rank):
            break  # the pool is ranked: what was screened is the likeliest part
        if label != "given" and _start_for(start, ids) is not None:
            kept.append((label, ids))
        here = graph if label == "given" else graph.reordered(ids)
        if here.plain_peak_bytes() <= budgets.ram_bytes:
            # plain training fits in this order: no order can use less, and its full solve only confirms it
            return [(label, ids)] + [k for k in kept if k[1] != ids], rank + 1
        energy, costs = math.inf, None
        if mode != "none":  # without recomputation or paging no plan but plain training exists
            costs = node_costs(here, profile)
            energy = _cheapest(here, costs, budgets, starting_points(here, costs, budgets, mode, deadline=deadline))
        entries.append([energy, rank, label, ids, here, costs])
    if backend == "highs" and mode != "none":
        # The gap MILP often beats the heuristics (and finds plans where they find none) but takes
        # longer: only where it can change which orders are kept. One thread: the model is tiny.
        # Also in the orders ranked first by the pool: many orders can tie on the heuristics' energy
        # (benchmarks/ORDERS.md, seed 5212: 144 orders, more than SCREEN_GAP_MILP_TOP of them tied,
        # and the ones whose gap MILP plan leads to the optimum ranked behind them on the heuristics).
        scored = sorted(entries, key=lambda e: (e[0], e[1]))
        second = scored[:SCREEN_GAP_MILP_TOP] + [e for e in scored[SCREEN_GAP_MILP_TOP:] if e[1] < ENUMERATE_ORDERS_MAX]
        second += [e for e in scored[SCREEN_GAP_MILP_TOP:] if e[1] >= ENUMERATE_ORDERS_MAX and e[0] == math.inf]
        for entry in second:
            if stop(len(entries)):
                break
            found = gap_milp_plan(entry[4], entry[5], budgets, mode, threads=1, gap=1e-4, settle=None,
                                  time_limit=max(0.05, min(SCREEN_GAP_MILP_S, deadline - time.perf_counter())))
            entry[0] = min(entry[0], _cheapest(entry[4], entry[5], budgets, [] if found is None else [found]))
    # orders where no cheap plan was found stay in the running in the pool's rank, after the others
    best = sorted(entries, key=lambda e: (e[0], e[1]))
    given_energy = min((e[0] for e in entries if e[2] == "given"), default=math.inf)
    chosen = [(e[2], e[3]) for e in best if (e[2], e[3]) not in kept and not (only_cheaper and e[0] >= given_energy)]
    chosen = chosen[:FULL_SOLVE_ORDERS]
    given = [k for k in kept if k[0] == "given"]
    if best and best[0][0] <= node_costs(graph, profile).plain_energy_j * (1 + 1e-12) and best[0][2] != "given":
        # a plan at plain training's energy (free recomputations of zero-FLOP nodes): solved first, it
        # proves "optimal" and ends the solves before the given order's
        return [(best[0][2], best[0][3])] + given + [k for k in chosen + kept[len(given):] if k[1] != best[0][3]], \
            len(entries)
    return given + chosen + [k for k in kept if k[0] != "given"], len(entries)


def _cheapest(graph, costs, budgets, plans) -> float:
    """The energy of the first of these plans (cheapest first) that keeps the runtime budget."""
    fitting = next((d for d in plans if _fits_runtime(graph, costs, d, budgets)), None)
    return math.inf if fitting is None else _energy(graph, costs, fitting)


def _start_for(start, ids: list[int]):
    """The caller's start plan if it was made in this execution order, else None."""
    if start is None:
        return None
    if isinstance(start, tuple):
        start_order, decisions = start
    elif isinstance(start, Schedule):
        start_order, decisions = start.order, start.decisions
    else:
        start_order, decisions = tuple(range(len(ids))), start
    return decisions if tuple(start_order) == tuple(ids) else None


def _solve_in_order(graph: TrainingGraph, costs: NodeCosts, profile: DeviceProfile, budgets: Budgets, mode: str,
                    *, backend: str, time_limit: Optional[float], gap: float, threads, progress, start,
                    heartbeat: Optional["Heartbeat"] = None) -> _Outcome:
    """Heuristic starts, the restricted MILP, then the full MILP, in the graph's own node order."""
    began = time.perf_counter()
    heartbeat = heartbeat or Heartbeat(None)
    phase = heartbeat.phase
    phase("heuristic starts")
    # Past this size the full MILP's root LP is out of reach of any interactive time limit (ResNet-50's
    # 190k columns do not finish it in 90 s; 1000 nodes make 1.6M): the best start stands, with the
    # plain-training floor as its bound. Without a time limit the user asked to wait for the optimum,
    # up to the size whose model would not fit in memory at all.
    full_decisions = decision_count(graph, mode)
    skip_full = backend == "highs" and (full_decisions > FULL_MILP_MAX_DECISIONS if time_limit is not None
                                        else full_decisions > FULL_MILP_MEMORY_MAX_DECISIONS)
    # there, a paging start within the gap of the plain floor is proven: nothing else needs to run
    floor = costs.plain_energy_j
    good_enough = floor * (1 + gap) if skip_full and gap > 0 else None
    candidates = starting_points(graph, costs, budgets, mode, good_enough=good_enough,  # the greedy loops replay
                                 deadline=None if time_limit is None else began + 0.3 * time_limit)  # per step
    solve_s = 0.0
    reserve = 0.0 if time_limit is None else finish_s(graph)  # replay, validation, summary: last
    gap_milp_fits = time_limit is None or GAP_MILP_BUILD_S_PER_NODE_SQUARED * len(graph) ** 2 <= 0.5 * (
        time_limit - (time.perf_counter() - began) - reserve) and within_reach(graph, skip_full)
    # The caller's plan (a Pareto sweep passes the budget below's) is one more candidate, so every
    # path below can take it: the gap MILP's rival, the full MILP's start, the floor check, and the
    # plan kept on a skip.
    warm = _fitting_plan(graph, costs, budgets, mode, profile, start)
    if warm is not None and not fits_storage(costs, budgets, warm):
        warm = None
    if warm is not None:
        candidates = sorted([warm, *candidates], key=lambda d: _energy(graph, costs, d))
    # Plain training's energy bounds every plan: a start that close to it is proven within the gap
    # asked for (plain training itself when it fits), and every phase after it could only polish the
    # plan below the gap the user accepted or confirm the proof, so none runs. (A backend the user
    # named explicitly still runs, and says so if it is missing.)
    cheapest = _energy(graph, costs, candidates[0]) if candidates else None
    proven_by_floor = backend == "highs" and cheapest is not None and \
        relative_gap(cheapest, min(floor, cheapest)) <= max(gap, 1e-12)
    if backend == "highs" and graph.plain_peak_bytes() > budgets.ram_bytes and gap_milp_fits and not proven_by_floor \
            and not interrupted():
        # The compact gap MILP's optimum is a plan of the full space, a better start (not a bound); with the full
        # MILP skipped, its LP rounded and searched by windows (solver/gap_lns.py), with most of the user's limit.
        started = time.perf_counter()
        limit = GAP_MILP_TIME_S if time_limit is None else min(GAP_MILP_TIME_S, time_limit / 5)
        left = None if time_limit is None else time_limit - (time.perf_counter() - began) - reserve
        first = 0.75 if skip_full and not graph.streams_weights else EARLY_FREE_SHARE  # the first solve's share
        if skip_full and time_limit is not None:  # most, the bounds the rest (on streamed graphs less: ResNet-18's
            # gap MILP had no plan after 210 s, and the bound left 27 s fell from 20.12 J to 19.73 J)
            limit = min(time_limit * (0.3 if graph.streams_weights else 0.65), 0.7 * left)
        if time_limit is not None:  # what the heuristics left
            limit = max(0.05, min(limit, 0.9 * left))
        phase("restricted (gap) MILP", cheapest)
        search = searched_plan if skip_full and not graph.streams_weights else gap_milp_plan
        best = search(graph, costs, budgets, mode, time_limit=limit, threads=threads, first_share=first)
        if best is not None and not candidates:
            candidates = [best]
        elif best is not None:
            energy = [_energy(graph, costs, d) for d in (best, candidates[0])]
            candidates = [best, *candidates] if energy[0] <= energy[1] else [candidates[0], best, *candidates[1:]]
        solve_s += time.perf_counter() - started
    first = decisions = form = None
    build_s = 0.0
    skip_full = skip_full and bool(candidates)
    why = "" if time_limit is not None else ", too many to build in memory"
    full_note = f"skipped: {full_decisions} binaries{why}" if skip_full else "solved"
    head = cost_cap = None
    if candidates and not skip_full:
        head = _energy(graph, costs, candidates[0])
        # No plan at least as good as the best start spends more than it does above plain training on
        # any one action: the full MILP leaves out every dearer one (see Formulation's cost_cap).
        cost_cap = (head - floor) + 1e-9 * head
    if proven_by_floor:
        skip_full, full_note = True, "not needed: the best start is within the gap of the plain-training floor"
    fits = lambda d: _fitting_plan(graph, costs, budgets, mode, profile, d) is not None  # noqa: E731
    early = skip_full and bool(candidates) and backend == "highs" and time_limit is not None and mode != "none" \
        and graph.streams_weights and len(graph) > BOUND_FIRST_MAX_NODES and not proven_by_floor
    if early and not interrupted():  # the window search first: the bound needs what it leaves (solver/lns.py)
        phase("window search", _energy(graph, costs, candidates[0]))
        candidates, note = window_search(graph, costs, budgets, mode, candidates, share=EARLY_SHARE,
                                         deadline=began + time_limit - 2 * reserve, settle=True, fits=fits,
                                         threads=threads, progress=phase, stop_at=floor * (1 + gap))
        full_note += note
    window = None
    if backend == "highs" and candidates and mode != "none" and not proven_by_floor \
            and (skip_full or full_decisions > WINDOW_BOUND_MIN_DECISIONS) \
            and graph.plain_peak_bytes() > budgets.ram_bytes and not interrupted():
        # A relaxation small enough to solve at any size (poet_opt/solver/bounds.py): the bound that
        # stands where the full MILP is skipped or its root LP does not finish, and a proof that
        # makes the full MILP unnecessary when the best start is within the gap of it.
        best_start = head if head is not None else _energy(graph, costs, candidates[0])
        limit = WINDOW_BOUND_TIME_S
        if time_limit is not None:
            left = time_limit - (time.perf_counter() - began) - reserve
            # with the full MILP skipped the bounds and the window search share what is left (lns.py)
            share = (0.8 if not graph.streams_weights else 0.45) if len(graph) <= BOUND_FIRST_MAX_NODES else 0.9
            limit = share * left if skip_full else min(WINDOW_BOUND_SHARE * time_limit, 0.9 * left)
        residency, started = None, time.perf_counter()
        if limit > 0.1 and graph.streams_weights:
            phase("residency bound", best_start)  # streamed weights: each stage's reads and returns (residency.py)
            share = RESIDENCY_SHARE if len(graph) <= BOUND_FIRST_MAX_NODES else RESIDENCY_SHARE_LARGE
            residency = residency_bound(graph, costs, budgets, mode, time_limit=share * limit,
                                        threads=threads, stop_at=best_start * (1 - gap), upper=best_start)
            limit -= time.perf_counter() - started
        if limit > 0.1 and (residency is None or residency.bound < best_start * (1 - gap)):
            phase("window bound", best_start)
            until, chained = time.perf_counter() + limit, skip_full and not graph.streams_weights
            window = window_bound(graph, costs, budgets, mode, time_limit=limit * (0.1 if chained else 1),
                                  threads=threads, stop_at=best_start * (1 - gap))
            if chained and (window is None or window.bound < best_start * (1 - gap)):  # solver/chain_bound.py
                window = higher(window, chain_bound(graph, costs, budgets, mode, threads=threads,
                                                    time_limit=until - time.perf_counter()))
        window = higher(window, residency)  # the higher of the proven bounds
        solve_s += time.perf_counter() - started
        if window is not None and not skip_full and \
                relative_gap(best_start, min(window.bound, best_start)) <= gap:
            skip_full, full_note = True, "not needed: the best start is within the gap of the window bound"
    if skip_full and candidates and backend == "highs" and time_limit is not None and not early and \
            not full_note.startswith("not needed") and not interrupted():  # exact windows, the rest fixed (lns.py)
        phase("window search", _energy(graph, costs, candidates[0]))
        candidates, note = window_search(graph, costs, budgets, mode, candidates, fits=fits, threads=threads,
                                         deadline=began + time_limit - 2 * reserve, progress=phase,
                                         stop_at=(floor if window is None else window.bound) * (1 + gap))
        full_note += note
    if not skip_full and time_limit is not None and backend == "highs" and \
            not _builds_in_time(full_decisions, time_limit - (time.perf_counter() - began)):
        # The build is one numpy/scipy call chain that cannot be stopped: not started unless it fits.
        skip_full = True
        full_note = (f"skipped: building the full MILP ({full_decisions} binaries) would take more than the "
                     f"{max(0.0, time_limit - (time.perf_counter() - began)):.1f} s left of the time limit; "
                     "the best heuristic schedule stands")
    if skip_full:
        # no time limit ran out where none was given: the search ended with the model it could build (or at a Ctrl-C)
        first = SolveResult("interrupted" if interrupted() else "time_limit" if time_limit is not None else "stopped",
                            None, None, None, 0.0, backend)
        decisions = candidates[0] if candidates else None
    cp = None
    if backend == "cpsat":  # the retention-interval model in place of the MILP (docs/cpsat.md)
        remaining = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - began))
        cp = solve_cpsat(graph, costs, budgets, mode, time_limit=remaining, gap=gap, threads=threads,
                         progress=progress, starts=candidates, cost_cap=cost_cap)
        first = SolveResult(cp.status, None, cp.objective, cp.bound, cp.solve_s, "cpsat")
        solve_s, full_note = solve_s + cp.solve_s, cp.note
        # Never worse than the start it was handed (a time-limited incumbent can be). solve_cpsat has
        # replayed its plan against the runtime budget; at 2000 nodes each replay takes seconds, so
        # only the best start is checked and compared, not every candidate.
        decisions = cp.decisions
        if candidates and cp.status != "infeasible" and _fits_runtime(graph, costs, candidates[0], budgets) and (
                decisions is None or _energy(graph, costs, candidates[0]) < _energy(graph, costs, decisions)):
            decisions = candidates[0]
    for margin in (() if skip_full or cp else (0.0, 1e-6)):
        if margin and time_limit is not None and \
                not _builds_in_time(full_decisions, time_limit - (time.perf_counter() - began)):
            break  # no time to build the tightened MILP: the heuristic plans below stand
        started = time.perf_counter()
        phase("building the full MILP", head)
        form = Formulation(graph, costs, budgets, mode, runtime_margin=margin, cost_cap=cost_cap)
        build_s = time.perf_counter() - started
        mip_start = next((x for x in map(form.encode, candidates) if x is not None), None)
        # the re-solve shares the one time limit the user gave
        remaining = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - began) - reserve)
        phase("MILP (presolve or search)")
        result = solve_milp(form.milp, backend=backend, time_limit=remaining, gap=gap, threads=threads,
                            progress=heartbeat.relay(), start=mip_start)
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
    if decisions is None and first.status in ("interrupted", "time_limit"):
        # stopped before the MILP had a plan of its own: the best start is valid and within budget
        decisions = next((d for d in candidates if _fits_runtime(graph, costs, d, budgets)), None)
    if decisions is None and first.x is not None:
        # Even the tightened solve gave nothing within budget: the optimum sits on the budget's
        # edge, where only the heuristic schedules (checked by replay) are known to be exact.
        decisions = next((d for d in candidates if _fits_runtime(graph, costs, d, budgets)), None)
    if first.status == "error":
        raise PoetError("the solver failed on this model (numerical trouble); check the graph's sizes and costs "
                        "are sane, or try --solver cbc")
    outcome = _Outcome(graph=graph, costs=costs, status=first.status, backend=first.backend, build_s=build_s,
                       solve_s=solve_s, full_note=full_note,
                       variables=cp.variables if cp else form.milp.num_vars if form else None,
                       constraints=cp.constraints if cp else form.milp.num_rows if form else None)
    if first.status == "infeasible" or decisions is None:
        # With a solution that overshoots the runtime budget by less than the solver's tolerance and
        # none left once the budget is tightened by a millionth, no plan in this order fits either.
        if first.x is not None:
            outcome.status = "infeasible"
        return outcome
    energy = _energy(graph, costs, decisions)
    # Plain training's energy is a floor for every schedule (each node runs at least once, nothing else
    # is free); it is the bound left when the solver stops before its root relaxation does better.
    bound = min(floor if first.bound is None else max(first.bound, floor), energy)
    if head is not None:
        # With actions dearer than the start's extra energy left out, the MILP's bound covers only the
        # plans at least as good as the start: the start's energy caps the bound for the rest.
        bound = min(bound, head)
    source = "plain-training floor"
    if first.bound is not None and first.bound > floor:
        source = "CP-SAT" if first.backend == "cpsat" else "full MILP"
    if window is not None and window.bound > bound:
        # the window relaxation bounds every plan, not only those at least as good as the start
        where = "all stages" if window.window is None else f"stages {window.window[0]}-{window.window[1]}"
        bound, source = min(window.bound, energy), f"{window.method} ({where})"
    outcome.decisions, outcome.energy, outcome.bound, outcome.bound_source = decisions, energy, bound, source
    return outcome


GAP_MILP_TIME_S = 10.0
# Building the gap MILP, which cannot be stopped, takes about 3e-7 s x nodes^2 (1.2 s at 2000 nodes, 22 s at 10,000):
# not started unless it leaves as long again of the time limit.
GAP_MILP_BUILD_S_PER_NODE_SQUARED = 4e-7
# The window relaxation's share of the time limit (poet_opt/solver/bounds.py), and its time without one (the full MILP
# then runs to the optimum anyway: the window can only spare it when the start is already within the gap). Below
# WINDOW_BOUND_MIN_DECISIONS binaries the full MILP proves more, sooner.
WINDOW_BOUND_SHARE = 0.2
WINDOW_BOUND_TIME_S = 5.0
WINDOW_BOUND_MIN_DECISIONS = 20_000
# On streamed graphs the residency relaxation's share of that time (its LP: 8.5 s on ResNet-18's
# 8,223 nodes); the window bound gets the rest, unless the residency bound already proves the gap.
RESIDENCY_SHARE = 0.6
# Past lns.MAX_NODES, where the window bound's windows do not build within the time (ResNet-18's strips), the
# residency bound's LP with recomputation inputs needs it: 136,000 columns, 2-4 minutes.
RESIDENCY_SHARE_LARGE = 0.95
FULL_MILP_MAX_DECISIONS = 300_000
# Building the model takes 1.4 KiB per binary (random graphs of 600 and 1,200 nodes: 0.4 GiB for 0.3 million, 1.6
# GiB for 1.2 million), and HiGHS copies it: 6 million is some 8 GiB before that. A row-tiled bert-base has 2.3 billion.
FULL_MILP_MEMORY_MAX_DECISIONS = 6_000_000
# Seconds per binary that building the Formulation takes, with room to spare: 35-80 us measured on random graphs of
# 120-600 nodes on a loaded 2-core machine (benchmarks/ORDERS.md, time limits).
BUILD_S_PER_DECISION = 100e-6


def _builds_in_time(decisions: int, left_s: float) -> bool:
    """Whether the full MILP's build would leave at least as long again for solving it."""
    return decisions * BUILD_S_PER_DECISION <= 0.5 * left_s


# What totals_of(build_steps(...)) says, to the last bit, without the replay (a solve needs it up to
# six times): heuristics.plan_energy_j, one piece of code for the starts and the driver.
_energy = plan_energy_j


def _fitting_plan(graph, costs, budgets, mode, profile, decisions):
    """The caller's plan if it is one of this graph and mode and its replay keeps every rule and
    budget; else None (a start is a hint, never a reason to fail)."""
    if decisions is None:
        return None
    if (mode in ("remat", "none") and (decisions.page_in or decisions.page_out)) or \
            (mode in ("paging", "none") and decisions.recompute):
        return None
    T = len(graph)
    # the keeps by their runs: their pairs grow with the square of the graph
    keeps = decisions.keep.runs.items()
    if any(not (0 <= i < T and 0 <= t < T) for t, i in (*decisions.recompute, *decisions.page_in)) or \
            any(not (0 <= i < T and 0 <= runs[0][0] and runs[-1][1] < T) for i, runs in keeps) or \
            any(not 0 <= i < T for i in decisions.page_out):
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
    # totals_of(build_steps(...))["runtime_s"] exactly, without the replay (see _energy)
    return plan_runtime_s(costs, decisions) <= budgets.runtime_s * (1 + 1e-9)  # the validator's float tolerance


def _without_unread_page_outs(decisions):
    """A page-out never paged back in costs energy and buys nothing; a time-limited incumbent can contain one."""
    read_back = {i for _, i in decisions.page_in}
    return replace(decisions, page_out=frozenset(i for i in decisions.page_out if i in read_back))


def _raise_below_working_set(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str) -> None:
    """A budget below the largest working set of one step fails in every order, and the graph alone
    says by how much: answered at once, without a solver."""
    need, node = graph.largest_working_set()
    head = (f"no schedule fits {format_bytes(budgets.ram_bytes)} of RAM: computing {node.name} holds its inputs and "
            f"its output, {format_bytes(need)} ({need} B), at once, in any order")
    # Paging everything out and back in one input at a time needs no more than that working set, so
    # with paging, unlimited time and room on storage it is exactly the smallest feasible budget.
    enough = (mode in ("joint", "paging") and math.isinf(budgets.runtime_s)
              and sum(n.bytes for n in graph.nodes if n.op != "param") <= budgets.storage_bytes)
    if enough:
        raise InfeasibleError(f"{head}; the smallest feasible budget is {format_bytes(need)} ({need} B)",
                              min_ram_bytes=need, min_ram_lower_bound=need, field="--ram")
    raise InfeasibleError(f"{head}; the smallest feasible budget is at least that", min_ram_lower_bound=need,
                          field="--ram")


def _check_plain_fits_some_order(graph: TrainingGraph, budgets: Budgets, order: str) -> None:
    """Without recomputation or paging every tensor stays until its last reader, so the least RAM
    plain training needs over every order is exactly the minimum-peak order's peak: below it, no
    order fits (the dynamic program is exact where it finishes)."""
    ids = list(range(len(graph))) if order == "given" else min_peak_order(graph)
    if ids is None:
        return  # too many node sets for the exact program: the solves below decide, per order
    peak = graph.reordered(ids).plain_peak_bytes()
    if budgets.ram_bytes >= peak:
        return
    where = "in the given execution order" if order == "given" else "in any execution order"
    raise InfeasibleError(f"no schedule fits {format_bytes(budgets.ram_bytes)} of RAM in mode none: plain training "
                          f"holds {format_bytes(peak)} ({peak} B) at its peak {where}; the smallest feasible budget "
                          f"is {format_bytes(peak)} ({peak} B)", min_ram_bytes=peak, min_ram_lower_bound=peak,
                          field="--ram", proven=order != "given")


def _raise_infeasible(graph, costs, budgets, mode, backend, time_limit=None, orders_tried: int = 1) -> None:
    """No plan in the orders tried: how much RAM would do, in the one whose plain training holds least."""
    limit = 30.0 if time_limit is None else min(30.0, time_limit)
    # The smallest budget comes from the MILP: CP-SAT's interval model has no budget variable.
    found, bound = min_feasible_ram(graph, costs, budgets, mode, backend="highs" if backend == "cpsat" else backend,
                                    time_limit=limit)
    runtime_note = "" if math.isinf(budgets.runtime_s) else f" and runtime {format_seconds(budgets.runtime_s)}"
    if budgets.min_lifetime_steps is not None and mode in ("joint", "paging"):
        allowed = budgets.erase_bytes if math.isfinite(budgets.erase_bytes) else budgets.storage_bytes
        runtime_note += (f" and a wear budget of {budgets.min_lifetime_steps:,} steps (at most "
                         f"{format_bytes(allowed)} of erase blocks worn by paging per step)")
    orders = "this execution order" if orders_tried == 1 else f"any of the {orders_tried} execution orders tried"
    head = f"no schedule fits {format_bytes(budgets.ram_bytes)} of RAM{runtime_note} in mode {mode} in {orders}"
    if orders_tried > 1:
        # the search below ran in one order: its bound does not cover the others
        bound = None if bound is None else min(bound, budgets.ram_bytes + 1)
    if found is None and bound is not None:
        raise InfeasibleError(f"{head}; there the smallest feasible budget is at least {format_bytes(bound)}, but no "
                              "schedule was found within the time limit to say how much more",
                              min_ram_lower_bound=bound, field="--ram", proven=False)
    if found is None:
        advice = []
        if math.isfinite(budgets.runtime_s):
            advice.append("loosen --runtime")
        if mode != "joint":
            advice.append("use --mode joint")
        hint = f" ({' or '.join(advice)})" if advice else ""
        raise InfeasibleError(f"{head}; no RAM budget is enough in this order under these budgets{hint}",
                              min_ram_lower_bound=math.inf if orders_tried == 1 else budgets.ram_bytes + 1,
                              field="--ram", proven=False)
    if found <= budgets.ram_bytes:
        # RAM is not what binds: the runtime budget is (to within a millionth) below every plan.
        raise InfeasibleError(f"{head}; at this RAM budget every schedule in it needs more time than "
                              f"{format_seconds(budgets.runtime_s)}: loosen --runtime", min_ram_lower_bound=bound,
                              field="--runtime", proven=False)
    if bound is not None and bound < found:
        tail = f"there the smallest feasible budget is between {format_bytes(bound)} and {format_bytes(found)}"
    else:
        tail = f"there the smallest feasible budget is {format_bytes(found)} ({found} B)"
    raise InfeasibleError(f"{head}; {tail}", min_ram_bytes=found, min_ram_lower_bound=bound, field="--ram",
                          proven=False)
