"""Large-neighbourhood search: the full formulation over a window of stages, the rest of the plan fixed.

Past a few hundred nodes the full MILP is too large to build within a time limit, and the best plan
is a heuristic one (the restricted gap MILP's, or a greedy start). Its weak spots are often local: a
stage that recomputes a long chain because the stage before dropped one tensor too many. The exact
model of stages a..b (Formulation with ``window``) re-decides every keep, recomputation and page-in
inside the window, and the page-outs of tensors made there that no other stage reads back; what the
plan keeps into stages a and b+1, and its other page-outs, stay fixed. Any plan it returns, spliced
into the incumbent, is a valid plan of the full problem, and the incumbent itself is a feasible point
of it (the MIP start), so a window never makes the plan worse.

Windows are ranked by the energy the incumbent spends in them above plain training, a sliding sum
over stages; the search walks them from the dearest, widens them when a round of windows found
nothing, and stops at its deadline. The model's size grows with the width times the graph (each stage
may recompute any earlier tensor), so the width is capped by the columns it would build.

Nothing here is a bound: a window optimum is optimal only for that window with the rest fixed.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, Keep
from poet_opt.solver.backends import interrupted, solve_milp
from poet_opt.solver.formulation import Formulation, WindowMismatch
from poet_opt.solver.heuristics import plan_energy_j, plan_runtime_s

# The first window's width in stages, and the most columns a window model may have: on the 1000-node
# layered graph a window of 60,000 columns builds in about a second.
FIRST_WIDTH = 24
MAX_COLUMNS = 80_000
# A window's solve gets at most this long: many small windows improve more than one stuck one.
WINDOW_TIME_S = 8.0
# The window model indexes its columns in dense stage x tensor arrays (formulation.py): past this
# many nodes those alone take gigabytes and seconds to build, and the search is not tried.
MAX_NODES = 2_500
# An improvement smaller than this (relative) is solver noise, not a better plan.
MIN_GAIN = 1e-9


def restricted(plan: Decisions, a: int, b: int) -> Decisions:
    """The plan's decisions in stages a..b, and its keeps into stages a..b+1 (the window model's
    variables), for a MIP start."""
    keep = Keep.from_ranges([(i, max(x, a), min(y, b + 1)) for i, runs in plan.keep.runs.items()
                             for x, y in runs if x <= b + 1 and y >= a])
    return Decisions(recompute=frozenset(p for p in plan.recompute if a <= p[0] <= b),
                     page_in=frozenset(p for p in plan.page_in if a <= p[0] <= b),
                     page_out=plan.page_out, keep=keep)


def spliced(plan: Decisions, window: Decisions, a: int, b: int) -> Decisions:
    """The plan with stages a..b (and its keeps into a+1..b) taken from the window's solution, and
    its page-outs (the model fixes those it may not change)."""
    outside = [(i, x, y) for i, runs in plan.keep.runs.items() for x, y in runs]
    ranges = [(i, x, min(y, a)) for i, x, y in outside] + [(i, max(x, b + 1), y) for i, x, y in outside]
    ranges += [(i, x, y) for i, runs in window.keep.runs.items() for x, y in runs]
    return Decisions(
        recompute=frozenset({p for p in plan.recompute if not a <= p[0] <= b} | set(window.recompute)),
        page_in=frozenset({p for p in plan.page_in if not a <= p[0] <= b} | set(window.page_in)),
        page_out=window.page_out, keep=Keep.from_ranges(ranges))


def stage_extra_energy(graph: TrainingGraph, costs: NodeCosts, plan: Decisions) -> np.ndarray:
    """Joules per stage that the plan spends above plain training (recomputations and page-ins)."""
    extra = np.zeros(len(graph))
    for t, i in plan.recompute:
        extra[t] += costs.compute_j[i]
    for t, i in plan.page_in:
        extra[t] += costs.page_in_j[i]
    return extra


def windows(extra: np.ndarray, width: int) -> list[tuple[int, int]]:
    """Windows of ``width`` stages, dearest first, until every stage that costs anything above
    plain training is in one. They may overlap: each is solved on the plan the previous ones left."""
    T = len(extra)
    width = min(width, T)
    sums = np.convolve(extra, np.ones(width), mode="valid")  # sums[a] = extra[a:a+width].sum()
    left = extra > 0
    out = []
    for a in np.argsort(-sums, kind="stable"):
        a = int(a)
        if sums[a] <= 0 or not left.any():
            break
        if left[a:a + width].any():
            left[a:a + width] = False
            out.append((a, a + width - 1))
    return out


def window_columns(graph: TrainingGraph, mode: str, a: int, b: int) -> int:
    """About how many columns the window model of stages a..b has (keeps, recomputations, page-ins,
    and a release and a memory level per recomputation and input), without building it."""
    from poet_opt.solver.formulation import horizons, recomputes_gradients

    allow_remat = mode in ("joint", "remat")
    need, comp = horizons(graph, allow_remat, gradients=recomputes_gradients(graph, allow_remat))
    ids = np.arange(len(graph))
    deps = np.array([len(n.deps) + 2 for n in graph.nodes])
    total = 0
    for t in range(a, min(b + 1, len(graph) - 1) + 1):
        live = (ids < t) & (t <= need)
        recompute = (ids < t) & (t <= comp)
        total += int(live.sum()) + int(deps[recompute].sum())
        if mode in ("joint", "paging"):
            total += 2 * int(live.sum())
    return total


def improve(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, plan: Decisions, *,
            deadline: float, threads: Optional[int] = None, stop_at: float = 0.0,
            progress: Optional[Callable[[str], None]] = None) -> tuple[Decisions, dict]:
    """The plan, improved by window re-optimisation until ``deadline`` (time.perf_counter()) or until
    its energy reaches ``stop_at``; and what the search did (windows solved, improved, joules saved)."""
    energy = plan_energy_j(graph, costs, plan)
    start_energy = energy
    if len(graph) > MAX_NODES:
        return plan, {"windows": 0, "improved": 0, "skipped": 0, "saved_j": 0.0}
    stats = {"windows": 0, "improved": 0, "skipped": 0}
    width = FIRST_WIDTH
    T = len(graph)
    while time.perf_counter() < deadline and energy > stop_at and not interrupted():
        found = False
        tried = windows(stage_extra_energy(graph, costs, plan), width)
        if not tried:
            break  # nothing above plain training left to re-decide
        for a, b in tried:
            left = deadline - time.perf_counter()
            if left < 0.5 or energy <= stop_at or interrupted():
                break
            if window_columns(graph, mode, a, b) > MAX_COLUMNS:
                stats["skipped"] += 1
                continue
            try:
                form = Formulation(graph, costs, budgets, mode, window=(a, b), incumbent=plan)
            except WindowMismatch:
                stats["skipped"] += 1
                continue
            start = form.encode(restricted(plan, a, b))
            result = solve_milp(form.milp, time_limit=min(WINDOW_TIME_S, left - 0.3), gap=1e-6, threads=threads,
                                start=start)
            stats["windows"] += 1
            if result.x is None or result.objective is None or result.objective >= energy * (1 - MIN_GAIN):
                continue
            candidate = spliced(plan, form.decode(result.x), a, b)
            new = plan_energy_j(graph, costs, candidate)
            if new < energy * (1 - MIN_GAIN) and plan_runtime_s(costs, candidate) <= budgets.runtime_s * (1 + 1e-9):
                plan, energy, found = candidate, new, True
                stats["improved"] += 1
                if progress:
                    progress(f"window search: stages {a}-{b}, {energy:.6g} J")
        if not found:
            if width >= T:
                break
            width *= 2
    stats["saved_j"] = start_energy - energy
    return plan, stats
