"""Large-neighbourhood search: the full formulation over a window of stages, the rest of the plan fixed.

Past a few hundred nodes the full MILP is too large to build within a time limit, and the best plan
is a heuristic one (the restricted gap MILP's, or a greedy start). Its weak spots are often local: a
stage that recomputes a long chain because the stage before dropped one tensor too many. The exact
model of stages a..b (Formulation with ``window``) re-decides every keep, recomputation and page-in
inside the window, and the page-outs of tensors that no page-in in another stage reads back; what the
plan keeps into stages a and b+1, and its other page-outs, stay fixed. Any plan it returns, spliced
into the incumbent, is a valid plan of the full problem, and the incumbent itself is a feasible point
of it (the MIP start), so a window never makes the plan worse.

Windows are ranked by the energy the incumbent spends in them above plain training, a sliding sum
over stages; the search walks them from the dearest, widens them when a round of windows found
nothing, and stops at its deadline. A window's model has columns only in its stages and only for
the tensors it re-decides (``window_tensors``: those its stages read, make or keep, what the plan
brings back there, and inputs of recomputable ones a few links deep); every other tensor stays
where the plan has it, out of RAM. So its size follows the window, not the graph: on ResNet-18's
9,350 nodes a window of 24 stages has about 15,000 columns and builds in a fraction of a second,
where the full window model (every tensor that exists there) had 20,000 columns per stage.

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
from poet_opt.solver.formulation import Formulation, WindowMismatch, horizons, recomputes_gradients
from poet_opt.solver.heuristics import plan_energy_j, plan_runtime_s

# The first window's width in stages, and the most columns a window model may have (estimated as
# three per stage and tensor it re-decides): on the 1000-node layered graph a window of 60,000
# columns builds in about a second.
FIRST_WIDTH = 24
MAX_COLUMNS = 80_000
# A window's solve gets at most this long: many small windows improve more than one stuck one.
WINDOW_TIME_S = 8.0
# Up to this many nodes the bound phase runs first and the search takes the time it leaves. Past it
# (ResNet-18's strips: 9,350 nodes) the residency bound needs nearly all of that time, and the
# search runs before it instead, with EARLY_SHARE of what the starts left, stopping once its windows
# stop improving the plan (SETTLE_S).
BOUND_FIRST_MAX_NODES = 2_500
EARLY_SHARE = 0.3
# A search that settles stops once no window has improved the plan for half the time it has run,
# and at least this long: its time goes back to the bound.
SETTLE_S = 8.0
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


# Tensors a window frees beyond those it reads, makes or keeps: inputs of recomputable ones, this many
# links deep (a ReLU over a batch norm over a concat of convolution slices is three).
CHAIN_DEPTH = 3


def window_tensors(graph: TrainingGraph, plan: Decisions, a: int, b: int, *, depth: int = CHAIN_DEPTH,
                   last_compute: Optional[np.ndarray] = None) -> np.ndarray:
    """The tensors a window of stages a..b re-decides: its own nodes and their inputs, what the plan
    keeps into stages a..b+1 or materializes in a..b (and the inputs of its recomputations), and the
    inputs of recomputable ones among them, ``depth`` links deep. Every other tensor is nowhere in
    RAM in the window in the plan, and stays so: the window model has no column for it."""
    nodes = graph.nodes
    read = set(range(a, b + 1))
    for t in range(a, b + 1):
        read.update(nodes[t].deps)
    for t, i in plan.recompute:
        if a <= t <= b:
            read.add(i)
            read.update(nodes[i].deps)
    read.update(i for t, i in plan.page_in if a <= t <= b)
    kept = {i for i, runs in plan.keep.runs.items() if any(x <= b + 1 and y >= a for x, y in runs)}
    frontier, free = set(read), read | kept
    for _ in range(depth):
        more = set()
        for i in frontier:
            if i < b and (last_compute is None or last_compute[i] >= a) and not nodes[i].is_backward:
                more.update(d for d in nodes[i].deps if d not in free)
        free |= more
        frontier = more
    return np.array(sorted(free), dtype=np.int64)


def improve(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, plan: Decisions, *,
            deadline: float, threads: Optional[int] = None, stop_at: float = 0.0, settle: bool = False,
            progress: Optional[Callable[..., None]] = None) -> tuple[Decisions, dict]:
    """The plan, improved by window re-optimisation until ``deadline`` (time.perf_counter()) or until
    its energy reaches ``stop_at`` (or with ``settle``, until no window has improved it for half the
    time spent, at least SETTLE_S); and what the search did (windows solved, improved, joules saved)."""
    energy = plan_energy_j(graph, costs, plan)
    start_energy = energy
    stats = {"windows": 0, "improved": 0, "skipped": 0, "saved_j": 0.0}
    began = last_gain = 0.0  # from the first window on: the graph's facts take seconds at 50,000 nodes

    def settled() -> bool:  # no window has improved the plan for half the search, SETTLE_S at least
        now = time.perf_counter()
        return settle and now - last_gain >= max(SETTLE_S, 0.5 * (now - began))

    allow_remat = mode in ("joint", "remat")
    need, last_compute = horizons(graph, allow_remat, gradients=recomputes_gradients(graph, allow_remat))
    facts = (need, last_compute, graph.users())  # the same for every window's model
    began = last_gain = time.perf_counter()
    width = FIRST_WIDTH
    T = len(graph)
    while time.perf_counter() < deadline and energy > stop_at and not interrupted() and not settled():
        found = False
        tried = windows(stage_extra_energy(graph, costs, plan), width)
        if not tried:
            break  # nothing above plain training left to re-decide
        too_large = 0
        for a, b in tried:
            left = deadline - time.perf_counter()
            if left < 0.5 or energy <= stop_at or interrupted() or settled():
                break
            free = window_tensors(graph, plan, a, b, last_compute=last_compute)
            if 3 * len(free) * (b - a + 2) > MAX_COLUMNS:  # keeps, recomputations, page-ins at most
                stats["skipped"] += 1
                too_large += 1
                continue
            try:
                form = Formulation(graph, costs, budgets, mode, window=(a, b), incumbent=plan, window_tensors=free,
                                   facts=facts)
            except WindowMismatch:
                stats["skipped"] += 1
                continue
            start = form.encode(restricted(plan, a, b))
            if start is None:  # the plan holds something the model cannot: not a point of it
                stats["skipped"] += 1
                continue
            result = solve_milp(form.milp, time_limit=min(WINDOW_TIME_S, left - 0.3), gap=1e-6, threads=threads,
                                start=start)
            stats["windows"] += 1
            if result.x is None or result.objective is None or result.objective >= energy * (1 - MIN_GAIN):
                continue
            candidate = spliced(plan, form.decode(result.x), a, b)
            new = plan_energy_j(graph, costs, candidate)
            if new < energy * (1 - MIN_GAIN) and plan_runtime_s(costs, candidate) <= budgets.runtime_s * (1 + 1e-9):
                plan, energy, found, last_gain = candidate, new, True, time.perf_counter()
                stats["improved"] += 1
                if progress:
                    progress(f"window search: stages {a}-{b}", energy)
        if not found:
            if too_large == len(tried) and width > 2:
                width //= 2  # every window too large to build: narrower ones
            elif width >= T or too_large == len(tried):
                break
            else:
                width *= 2
    stats["saved_j"] = start_energy - energy
    return plan, stats


def search(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, candidates: list[Decisions], *,
           deadline: float, fits: Callable[[Decisions], bool], share: float = 1.0, threads: Optional[int] = None,
           stop_at: float = 0.0, settle: bool = False,
           progress: Optional[Callable[..., None]] = None) -> tuple[list[Decisions], str]:
    """improve() on the best of the candidates (cheapest first), for ``share`` of the time up to
    ``deadline``: the candidates with its plan in front when it is cheaper and ``fits`` (the caller's
    replay of the whole plan) accepts it, and what the search did, for the solver's note."""
    now = time.perf_counter()
    if deadline - now <= 1.0:
        return candidates, ""
    better, stats = improve(graph, costs, budgets, mode, candidates[0], deadline=now + share * (deadline - now),
                            threads=threads, stop_at=stop_at, settle=settle, progress=progress)
    if stats["improved"] and fits(better):
        return [better, *candidates], (f"; a window search improved the best start {stats['improved']} times, "
                                       f"by {stats['saved_j']:.4g} J ({stats['windows']} windows solved)")
    return candidates, (f"; a window search solved {stats['windows']} windows, none improved the best start"
                        if stats["windows"] else "")
