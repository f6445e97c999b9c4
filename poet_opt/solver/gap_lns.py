"""Plans of the gap space where the full MILP is skipped: the gap MILP's LP rounded, RINS, and windows.

``searched_plan`` rounds the LP relaxation of the gap MILP (RENS, ``rounded_point``), improves that
plan by RINS on the model with early returns (``rins_point``), then by the window search below
(``improve``) until its time is up (docs/formulation.md, "The gap-space search").

Where the full MILP is skipped (past a few hundred nodes) the plan is the gap MILP's or, when that
model has no plan within its time (l1000 at 70% of its peak, remat, on a busy 2-core machine:
its first plan came after 43 s of its own), a greedy start. The window search of solver/lns.py
re-decides stages of such a plan in the full formulation, but its windows grow with the graph
(every stage may recompute any earlier tensor) and those wide enough to move a greedy plan do not
finish in seconds. This search uses the gap MILP's model instead (solver/gap_milp.py), built once:
each *sub-solve* frees the ways back (and chain links) of the gaps whose returns fall in a window
of stages and fixes every other column at the incumbent's value. HiGHS's presolve removes the fixed
columns, so a sub-solve is a model of a few hundred binaries that ends in a fraction of a second.

Every point of the sub-model is a point of the gap MILP (the same rows, tighter column bounds), so
every plan found is a plan of the gap space, hence of the full problem; the incumbent is a feasible
point of each sub-model (the MIP start), so a window never makes the plan worse. The plan that
comes out is replayed once and returned only when the replay keeps every budget.

Windows are ranked by the energy the incumbent spends in them above plain training; a pass walks
every window, dearest first; the width doubles after a pass that found nothing, and halves after a
sub-solve that hit its time cap. Nothing here is a bound: a window optimum is optimal for that
window with the rest fixed, and the gap space is smaller than the full one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, build_steps, totals_of
from poet_opt.solver.backends import interrupted, solve_milp
from poet_opt.solver.formulation import Milp
from poet_opt.solver.gap_milp import EARLY_FREE_SHARE, GapMilp, TooLarge, gap_milp_plan
from poet_opt.solver.heuristics import plan_energy_j

# The first window's width in stages, the most a window may grow to, and each sub-solve's time cap
FIRST_WIDTH = 16
MIN_WIDTH = 4
SUB_TIME_S = 4.0
# An improvement smaller than this (relative) is solver noise, not a better plan.
MIN_GAIN = 1e-9
# searched_plan's window search stops once no window has improved the plan for this share of its
# time, and at least STALL_MIN_S: the bounds after it need the time more (on l500 at 90% of its
# peak the old path proved the gap in 8 s; a search run to its deadline would hold that for 70 s)
STALL_SHARE = 0.5
STALL_MIN_S = 8.0
# ... and once the plan is within this (relative) of the gap space's LP bound, as gap_milp.SETTLE
SETTLE_GAP = 1e-4


class _Groups:
    """Which columns of the gap MILP a window of return stages frees: the returns (and the away
    columns) of every gap with a return in the window, the chain links recomputed in it, and the
    page-outs of the tensors whose gaps are freed."""

    def __init__(self, model: GapMilp):
        n = model.milp.num_vars
        self.model = model
        self.stage = np.full(n, -1, dtype=np.int64)  # a column's stage of return (or of its chain link)
        for cols in (model.P, model.C, model.away):
            have = cols >= 0
            self.stage[cols[have]] = model.ret_stage[have]
        x_b = np.array([b for b, _ in model.x_keys], dtype=np.int64)
        self.stage[model.X] = x_b
        self.gap_of_ret = model.ret_gap
        self.integer = model.milp.integrality.astype(bool)

    def free_mask(self, a: int, b: int) -> np.ndarray:
        m = self.model
        in_window = (m.ret_stage >= a) & (m.ret_stage <= b)
        gaps = np.unique(m.ret_gap[in_window])
        rets = np.isin(m.ret_gap, gaps)
        free = np.zeros(m.milp.num_vars, dtype=bool)
        for cols in (m.P, m.C, m.away):
            sel = rets & (cols >= 0)
            free[cols[sel]] = True
        xs = self.stage[m.X]
        free[m.X[(xs >= a) & (xs <= b)]] = True
        tensors = np.unique(m.owner[gaps]) if len(gaps) else np.zeros(0, dtype=np.int64)
        outs = m.O[tensors]
        free[outs[outs >= 0]] = True
        return free


def _sub_milp(milp: Milp, A: sp.csc_matrix, free: np.ndarray, x: np.ndarray) -> Milp:
    """The MILP over the free columns, every other one fixed at its value in x: the fixed columns'
    activity moved into the row bounds, and the rows left without a free column dropped (x keeps
    them). ``A``: the model's matrix by columns."""
    fixed_activity = A[:, ~free] @ x[~free]
    A_free = A[:, free].tocsr()
    rows = np.flatnonzero(np.diff(A_free.indptr) > 0)
    sub = Milp(c=milp.c[free], offset=float(milp.offset + milp.c[~free] @ x[~free]), A=A_free[rows],
               row_lb=milp.row_lb[rows] - fixed_activity[rows], row_ub=milp.row_ub[rows] - fixed_activity[rows],
               lb=milp.lb[free], ub=milp.ub[free], integrality=milp.integrality[free])
    return sub


def stage_costs(groups: _Groups, milp_c: np.ndarray, x: np.ndarray, T: int) -> np.ndarray:
    """Joules per return stage that the point x spends above plain training."""
    extra = np.zeros(T)
    on = (x > 0.5) & (groups.stage >= 0) & groups.integer
    np.add.at(extra, groups.stage[on], milp_c[on])
    return extra


def window_starts(extra: np.ndarray, width: int) -> list[int]:
    """Windows of ``width`` stages, overlapping by half, over every stage, dearest first."""
    T = len(extra)
    width = max(1, min(width, T))
    step = max(1, width // 2)
    starts = list(range(0, max(1, T - width + 1), step))
    if starts[-1] + width < T:
        starts.append(T - width)
    sums = np.convolve(extra, np.ones(width), mode="valid")
    return sorted(starts, key=lambda a: -float(sums[min(a, len(sums) - 1)]))


def improve(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, plan: Decisions, *,
            deadline: float, threads: Optional[int] = None, stop_at: float = 0.0,
            model: Optional[GapMilp] = None, progress: Optional[Callable[[str], None]] = None,
            stall: Optional[float] = None) -> tuple[Decisions, dict]:
    """The plan improved by gap-space windows until ``deadline`` (time.perf_counter()) or until its
    energy reaches ``stop_at`` or, with ``stall``, until no window has improved it for that share of
    the search's time (at least STALL_MIN_S); and what the search did. The plan unchanged when it is not in the
    gap space, the model does not build, or nothing better was found."""
    stats = {"windows": 0, "improved": 0, "saved_j": 0.0}
    if mode == "none" or time.perf_counter() >= deadline:
        return plan, stats
    try:
        model = model or GapMilp(graph, costs, budgets, mode)
    except TooLarge:
        return plan, stats
    x = model.encode(plan)
    if x is None:
        return plan, stats
    milp = model.milp
    groups = _Groups(model)
    A = milp.A.tocsc()
    energy = start_energy = float(milp.c @ x + milp.offset)
    T = len(graph)
    width = FIRST_WIDTH
    began = last_gain = time.perf_counter()

    def stalled() -> bool:
        now = time.perf_counter()
        return stall is not None and now - last_gain > max(STALL_MIN_S, stall * (now - began))

    while time.perf_counter() < deadline and energy > stop_at and not interrupted() and not stalled():
        found = False
        for a in window_starts(stage_costs(groups, milp.c, x, T), width):
            left = deadline - time.perf_counter()
            if left < 0.3 or energy <= stop_at or interrupted() or stalled():
                break
            free = groups.free_mask(a, a + width - 1)
            if not free.any():
                continue
            sub = _sub_milp(milp, A, free, x)
            result = solve_milp(sub, time_limit=min(SUB_TIME_S, left - 0.2), gap=1e-6, threads=threads,
                                start=x[free])
            stats["windows"] += 1
            if result.x is None or result.objective is None:
                continue
            if result.status not in ("optimal", "gap_limit") and width > MIN_WIDTH:
                width = max(MIN_WIDTH, width // 2)  # too wide to finish: smaller windows from here on
            y = x.copy()
            y[free] = result.x
            y = np.where(groups.integer, np.round(y), y)
            new = float(milp.c @ y + milp.offset)
            if new < energy * (1 - MIN_GAIN):
                x, energy, found, last_gain = y, new, True, time.perf_counter()
                stats["improved"] += 1
                if progress:
                    progress(f"gap window search: stages {a}-{a + width - 1}, {energy:.6g} J")
        if not found:
            if width >= T:
                break
            width *= 2
    if energy >= start_energy * (1 - MIN_GAIN):
        return plan, stats
    better = model.decode(x)
    if not _fits(graph, costs, budgets, better):
        return plan, stats  # the rows disagree with the replay: fail safely, the plan in hand stands
    stats["saved_j"] = start_energy - plan_energy_j(graph, costs, better)
    return better, stats


def _fits(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, plan: Decisions) -> bool:
    """Whether the plan's replay keeps the RAM, runtime and storage budgets."""
    totals = totals_of(graph, costs, build_steps(graph, plan))
    return (totals["peak_ram_bytes"] <= budgets.ram_bytes and totals["runtime_s"] <= budgets.runtime_s
            and totals["storage_bytes"] <= budgets.storage_bytes)


# The LP relaxation's share of the time limit in searched_plan, and the rounding MILP's of what is left
ROUND_LP_SHARE = 0.5
ROUND_MILP_SHARE = 0.5
FRACTIONAL = 1e-6
# RINS's share (its LP and its MILP) of the time left after the rounding; the window search has the rest
RINS_SHARE = 0.6


def rounded_point(model: GapMilp, *, time_limit: float, threads: Optional[int] = None) -> Optional[np.ndarray]:
    """A point of the gap MILP from its LP relaxation (after RENS: the MILP over the columns the
    LP optimum leaves above zero, every other one fixed at zero; where that is infeasible, only the
    zeros in stages without a fractional column are fixed), or None within the time limit."""
    began = time.perf_counter()
    milp = model.milp
    lp = solve_milp(replace(milp, integrality=np.zeros_like(milp.integrality)), time_limit=ROUND_LP_SHARE * time_limit,
                    threads=threads)
    if lp.x is None or lp.status not in ("optimal", "gap_limit"):
        return None
    integer = milp.integrality.astype(bool)
    zero = integer & (lp.x <= FRACTIONAL)
    fractional = integer & ~zero & (lp.x < 1 - FRACTIONAL)
    groups = _Groups(model)
    near = np.isin(groups.stage, np.unique(groups.stage[fractional])) & (groups.stage >= 0)
    for fixed in (zero, zero & ~near):
        left = time_limit - (time.perf_counter() - began)
        if left <= 0.05 or interrupted():
            return None
        ub = milp.ub.copy()
        ub[fixed] = 0.0
        result = solve_milp(replace(milp, ub=ub), time_limit=ROUND_MILP_SHARE * left, gap=1e-4, threads=threads)
        if result.x is not None:
            return np.where(integer, np.round(result.x), result.x)
        if result.status != "infeasible":
            return None  # out of time: the looser fixing would take longer still
    return None


def searched_plan(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *, time_limit: float,
                  threads: Optional[int] = None, first_share: float = EARLY_FREE_SHARE) -> Optional[Decisions]:
    """A plan of the gap space within ``time_limit``, for graphs where the full MILP is skipped: the
    LP relaxation of the gap MILP without early returns, rounded (rounded_point), then improved in
    the model with them by RINS (rins_point) and by gap-space windows (improve) for the rest of the
    time, or until it stalls. Where the rounding finds no plan, gap_milp_plan (``first_share`` its)
    with the time left. The plan is replayed."""
    began = time.perf_counter()
    if mode == "none":
        return None
    try:
        plain = GapMilp(graph, costs, budgets, mode, early_returns=0)
        x = rounded_point(plain, time_limit=time_limit, threads=threads)
    except TooLarge:
        x = None
    plan = None if x is None else plain.decode(x)
    if plan is None or not _fits(graph, costs, budgets, plan):
        left = time_limit - (time.perf_counter() - began)
        return gap_milp_plan(graph, costs, budgets, mode, time_limit=left, threads=threads,
                             first_share=first_share) if left > 0.05 else None
    deadline = began + time_limit
    try:
        model = GapMilp(graph, costs, budgets, mode)
    except TooLarge:
        return plan
    x, stop_at = model.encode(plan), costs.plain_energy_j
    if x is not None and deadline - time.perf_counter() > 1.0:
        y, lp = rins_point(model, x, time_limit=RINS_SHARE * (deadline - time.perf_counter()), threads=threads)
        if lp is not None:  # nothing in the gap space is cheaper: within SETTLE_GAP of it, the search stops
            stop_at = max(stop_at, lp * (1 + SETTLE_GAP))
        better = None if y is None else model.decode(y)
        if better is not None and plan_energy_j(graph, costs, better) < plan_energy_j(graph, costs, plan) \
                and _fits(graph, costs, budgets, better):
            plan = better
    if time.perf_counter() < deadline - 1.0:
        plan = improve(graph, costs, budgets, mode, plan, deadline=deadline, threads=threads,
                       stop_at=stop_at, model=model, stall=STALL_SHARE)[0]
    return plan


def rins_point(model: GapMilp, x: np.ndarray, *, time_limit: float, threads: Optional[int] = None
               ) -> tuple[Optional[np.ndarray], Optional[float]]:
    """A point of the gap MILP cheaper than ``x`` (one of its points), after RINS: the MILP over the
    binaries where x and the LP relaxation's optimum disagree, every other column fixed at x's
    value; None when the LP does not finish within half the time or nothing cheaper is found. And
    the LP's optimum: a bound on the gap space only, never on the problem."""
    began = time.perf_counter()
    milp = model.milp
    lp = solve_milp(replace(milp, integrality=np.zeros_like(milp.integrality)), time_limit=0.5 * time_limit,
                    threads=threads)
    left = time_limit - (time.perf_counter() - began)
    if lp.x is None or lp.status not in ("optimal", "gap_limit"):
        return None, None
    if left <= 0.1 or interrupted():
        return None, lp.objective
    integer = milp.integrality.astype(bool)
    free = integer & (np.abs(lp.x - x) > FRACTIONAL)
    free |= ~integer  # the away columns follow the returns
    result = solve_milp(_sub_milp(milp, milp.A.tocsc(), free, x), time_limit=left, gap=1e-6, threads=threads,
                        start=x[free])
    if result.x is None:
        return None, lp.objective
    y = x.copy()
    y[free] = result.x
    y = np.where(integer, np.round(y), y)
    return (y if milp.c @ y < milp.c @ x * (1 - MIN_GAIN) else None), lp.objective
