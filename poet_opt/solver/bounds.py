"""Lower bounds that scale: relaxations of the full formulation small enough to solve in seconds.

The full MILP (formulation.py) has O(T^2) binaries; past a few hundred nodes its root LP alone does
not finish within an interactive time limit, and the bound stayed at plain training's energy. A
*relaxation* drops constraints (or whole stages) of that model, so every plan of the full model,
restricted to what the relaxation keeps, is a plan of the relaxation at no higher cost: the
relaxation's optimum, its LP optimum, or any dual bound a solver proves on it, is a lower bound on
the full model's optimum, i.e. on every plan in this execution order under the stage model.

The window relaxation (``WindowModel``) keeps the stages ``a..b`` around the RAM peak and drops all
the others:

- before ``a`` nothing is constrained: whichever tensors the plan holds at the start of stage ``a``
  (``S[a,i]``) are free (each was computed once, in plain training's energy, and kept since);
- in each stage ``t`` of the window: node ``t``'s inputs are kept, recomputed or paged in (row 1 of
  the full model), so are the inputs of every recomputation in the stage, a tensor is kept into the
  next stage only if it was in RAM (row 2), materialized at most once (row 3), paged in only if paged
  out (row 4), and the stage-boundary knapsack holds (row 9: whatever is kept into ``t+1`` was in RAM
  when node ``t`` ran, beside ``t``'s inputs and output). A recomputation at position ``j`` needs
  ``j`` and its inputs in RAM beside the tensors kept into ``t+1`` that are there already at ``j``.
  The full model's release variables and per-position chain (rows 5-6) are dropped: both memory rows
  here follow from them for every plan, so the window only under-counts memory;
- after ``b`` the stages are dropped, but not for free: a tensor that some node after ``b`` reads (in
  that node's own stage, so in every plan) and that is not kept into stage ``b+1`` comes back after
  ``b`` by a recomputation (``RR``) or a page-in (``RP``), each an action in a dropped stage, counted
  once per tensor; a recomputation there needs each input kept into ``b+1`` or brought back too, and
  a page-in needs the page-out;
- page-outs are charged wherever they happen (each tensor's once), and the runtime and storage
  budgets hold over the counted actions (every action takes time >= 0).

Every cost counted is a distinct action of the full plan (actions in window stages, page-outs, and
at least one return per tensor in stages after the window), all non-negative, so the window
objective of a plan never exceeds its energy. Horizons are at least the full model's (see
``_horizons``): a wider horizon only gives the relaxation more freedom.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, storage_limits
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.formulation import Milp


def _gradients_recomputed(graph: TrainingGraph, allow_remat: bool) -> bool:
    """Whether the full model lets backward nodes be recomputed on this graph (small graphs only,
    where the formulation says so)."""
    try:
        from poet_opt.solver.formulation import recomputes_gradients
    except ImportError:  # a formulation that never recomputes gradients
        return False
    return bool(recomputes_gradients(graph, allow_remat))


def _horizons(graph: TrainingGraph, allow_remat: bool) -> tuple[np.ndarray, np.ndarray]:
    """need[i]: the last stage that may read tensor i; comp[i]: the last stage that may compute node i.
    At least as wide as the full model's (formulation.horizons): every node the full model may
    compute again may be computed again here, up to the last stage anything could read it, with no
    per-node cap (a cap only narrows the full model, and a relaxation may be wider than the model it
    relaxes; so may a node whose weight update the full model never repeats)."""
    n = len(graph)
    users = graph.users()
    need = np.arange(n)
    comp = np.arange(n)
    gradients = _gradients_recomputed(graph, allow_remat)
    for i in range(n - 1, -1, -1):
        for j in users[i]:
            need[i] = max(need[i], comp[j])
        node = graph.nodes[i]
        # streamed weights (op "param") are read again in every mode: their "recompute"
        if node.op == "param" or (allow_remat and (not node.is_backward or gradients)):
            comp[i] = need[i]
    return need, comp


def horizons_of(graph: TrainingGraph, allow_remat: bool) -> tuple[np.ndarray, np.ndarray]:
    """The window relaxation's horizons (need, comp), for relaxations built beside it."""
    return _horizons(graph, allow_remat)


def plain_live_bytes(graph: TrainingGraph) -> np.ndarray:
    """Bytes in RAM when node t runs in plain training (its inputs, itself, and everything read later)."""
    T = len(graph)
    size = np.array([n.bytes for n in graph.nodes], dtype=float)
    last = np.array(graph.last_use())
    delta = np.zeros(T + 1)
    np.add.at(delta, np.arange(T), size)
    np.add.at(delta, last + 1, -size)
    return np.cumsum(delta)[:T]


@dataclass
class BoundResult:
    """A proven lower bound on the energy of every plan in this execution order (joules, plain
    training's energy included), and how it was obtained."""

    bound: float
    method: str  # e.g. "window-lp", "window-milp", "knapsack"
    window: Optional[tuple[int, int]] = None
    solve_s: float = 0.0
    status: str = ""
    # the residency Lagrangian's best multipliers (one per stage), a start for dual_bound.dual_ascent
    multipliers: Optional[np.ndarray] = None
    # what the residency Lagrangian's count rows (stage_counts.py) added to it, joules: where nothing,
    # the LPs are built without them, which only makes them larger
    counts_gain: float = 0.0


class WindowModel:
    """The window relaxation of stages a..b (module docstring), as a Milp."""

    def __init__(self, graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, a: int, b: int,
                 *, returns: bool = True, entry: bool = False, own_page_outs: bool = False):
        """returns: charge the returns after ``b`` (off for a window whose later stages another window
        counts); entry: the knapsack of what is kept into ``a`` at stage ``a-1`` (row 9 there);
        own_page_outs: charge only the page-outs of tensors made in a..b (each happens in its
        tensor's own stage), so that windows over disjoint stages never count one action twice."""
        T = len(graph)
        assert 0 <= a <= b < T
        self.graph, self.costs, self.budgets, self.mode, self.a, self.b = graph, costs, budgets, mode, a, b
        allow_remat, allow_paging = mode in ("joint", "remat"), mode in ("joint", "paging")
        nodes = graph.nodes
        size = np.array([n.bytes for n in nodes], dtype=float)
        unit = float(budgets.ram_bytes)
        nb = size / unit
        need, comp = _horizons(graph, allow_remat)
        deps = [sorted(set(n.deps)) for n in nodes]
        last = np.array(graph.last_use())
        W = b - a + 1
        ids = np.arange(T)
        ncol = 0

        def alloc(mask):
            nonlocal ncol
            out = np.full(mask.shape, -1, dtype=np.int64)
            k = int(mask.sum())
            out[mask] = ncol + np.arange(k)
            ncol += k
            return out

        stages = np.arange(a, b + 2)  # S for a..b+1
        s_mask = (ids[None, :] < stages[:, None]) & (stages[:, None] <= need[None, :])
        self.S = alloc(s_mask)  # S[t - a, i]
        wst = np.arange(a, b + 1)
        r_mask = (ids[None, :] < wst[:, None]) & (wst[:, None] <= comp[None, :])
        self.R = alloc(r_mask)
        pageable = (need > ids) if allow_paging else np.zeros(T, dtype=bool)
        m_mask = (ids[None, :] < wst[:, None]) & (wst[:, None] <= need[None, :]) & pageable[None, :]
        self.Min = alloc(m_mask)
        # page-outs: of every tensor that may be paged in within the window or come back after it
        after = b + 1 < T and returns
        later = (ids <= b) & (need > b) if after else np.zeros(T, dtype=bool)  # may be in RAM after b
        self.Mout = alloc(pageable & (m_mask.any(axis=0) | later))
        # comes back after b (in a dropped stage): by a recomputation (RR) or a page-in (RP)
        self.RR = alloc(later & (comp > b))
        self.RP = alloc(later & (self.Mout >= 0))
        # memory while stage t recomputes: kept[t] = bytes kept into t+1, suf[t, j] = bytes
        # materialized in stage t at positions after j (those are not in RAM yet at j)
        self.kept = alloc(np.ones(W, dtype=bool))
        self.suf = alloc((ids[None, :] < wst[:, None]) & (ids[None, :] >= r_mask.argmax(axis=1)[:, None])
                         & r_mask.any(axis=1)[:, None])
        n = ncol

        c = np.zeros(n)
        lb = np.zeros(n)
        ub = np.ones(n)
        cont = np.concatenate([self.kept, self.suf[self.suf >= 0]])
        ub[cont] = np.inf
        integrality = np.ones(n, dtype=np.int8)
        integrality[cont] = 0
        offset = float(costs.compute_j.sum())
        rt, ri = np.nonzero(self.R >= 0)
        c[self.R[rt, ri]] = costs.compute_j[ri]
        mt, mi = np.nonzero(self.Min >= 0)
        c[self.Min[mt, mi]] = costs.page_in_j[mi]
        mo = np.flatnonzero(self.Mout >= 0)
        c[self.Mout[mo]] = costs.page_out_j[mo] * (((mo >= a) & (mo <= b)) if own_page_outs else 1.0)
        run_cols = [self.R[rt, ri], self.Min[mt, mi], self.Mout[mo]]
        run_vals = [costs.compute_s[ri], costs.page_in_s[mi], costs.page_out_s[mo]]
        const_s = 0.0

        rows, cols, vals, rlo, rhi = [], [], [], [], []
        nrow = 0

        def row(cs, vs, lo, hi):
            nonlocal nrow
            for col, v in zip(cs, vs):
                if col >= 0:
                    rows.append(nrow), cols.append(int(col)), vals.append(float(v))
            rlo.append(lo), rhi.append(hi)
            nrow += 1

        S, R, Min = self.S, self.R, self.Min

        def present(t, d):  # columns that put d in RAM in stage t: kept, recomputed, paged in
            k = t - a
            return [S[k, d], R[k, d], Min[k, d]]

        if entry and a > 0:
            # what is kept into stage a was in RAM when node a-1 ran, beside a-1's inputs and output
            fixed = {a - 1, *deps[a - 1]}
            kept = [i for i in np.flatnonzero(S[0] >= 0) if i not in fixed]
            row([S[0, i] for i in kept], [nb[i] for i in kept], -np.inf, 1.0 - sum(nb[i] for i in fixed))
        for t in range(a, b + 1):
            k = t - a
            # (1) node t's inputs, and those of each recomputation in stage t
            for d in deps[t]:
                row(present(t, d), [1, 1, 1], 1.0, np.inf)
            for j in np.flatnonzero(R[k] >= 0):
                for d in deps[j]:
                    row(present(t, d) + [R[k, j]], [1, 1, 1, -1], 0.0, np.inf)
            # (2) kept into t+1 only if in RAM in t; (3) materialized at most once
            for i in np.flatnonzero(S[k + 1] >= 0):
                if i < t:
                    row([S[k + 1, i]] + present(t, i), [1, -1, -1, -1], -np.inf, 0.0)
            for i in np.flatnonzero((S[k] >= 0) & ((R[k] >= 0) | (Min[k] >= 0))):
                row(present(t, i), [1, 1, 1], -np.inf, 1.0)
            # (9) the stage boundary: kept into t+1 beside t's inputs and output
            fixed = {t, *deps[t]}
            kept = [i for i in np.flatnonzero(S[k + 1] >= 0) if i not in fixed]
            row([S[k + 1, i] for i in kept], [nb[i] for i in kept], -np.inf, 1.0 - sum(nb[i] for i in fixed))
            # Recomputing j at position j of stage t needs j and its inputs in RAM beside what is
            # already there and kept into t+1: a tensor i < j kept into t+1 is (it arrived at i or
            # before), and one i > j is unless it is materialized after j (kept from the stage's
            # start). Rows 5-6 of the full model imply this for every plan; summed without their
            # release variables it stays valid, and the window then pays for the room a
            # recomputation needs, not only for the recomputation's energy.
            rj = np.flatnonzero(R[k] >= 0)
            if len(rj):
                held = np.flatnonzero(S[k + 1] >= 0)
                row([self.kept[k]] + [S[k + 1, i] for i in held], [1.0] + [-nb[i] for i in held], 0.0, 0.0)
                sc = self.suf[k]
                for j in range(t - 1, int(rj.min()) - 1, -1):
                    nxt = j + 1
                    terms = [sc[j]] + ([sc[nxt], R[k, nxt], Min[k, nxt]] if nxt < t else [])
                    row(terms, [1.0, -1.0, -nb[nxt], -nb[nxt]][:len(terms)], 0.0, 0.0)
                for j in rj:
                    own = [j, *deps[j]]
                    # node t itself comes at position t, after j
                    row([self.kept[k], sc[j], R[k, j], S[k + 1, t]] + [S[k + 1, d] for d in own],
                        [1.0, -1.0, sum(nb[d] for d in own), -nb[t]] + [-nb[d] for d in own], -np.inf, 1.0)
        # (4) page in only what was paged out
        for t_, i in zip(mt, mi):
            row([Min[t_, i], self.Mout[i]], [1, -1], -np.inf, 0.0)
        # Returns after the window: a tensor some node after b reads (in that node's own stage) is kept
        # into b+1 or comes back later, once at least; one that comes back by a recomputation needs
        # each input in RAM at that stage, so kept into b+1 or come back too.
        RR, RP = self.RR, self.RP
        rr, rp = np.flatnonzero(RR >= 0), np.flatnonzero(RP >= 0)
        c[RR[rr]] = costs.compute_j[rr]
        c[RP[rp]] = costs.page_in_j[rp]
        run_cols += [RR[rr], RP[rp]]
        run_vals += [costs.compute_s[rr], costs.page_in_s[rp]]
        if after:
            for i in np.flatnonzero((ids <= b) & (last > b)):
                row([S[W, i], RR[i], RP[i]], [1, 1, 1], 1.0, np.inf)
            for i in rr:
                for d in deps[i]:
                    row([S[W, d], RR[d], RP[d], RR[i]], [1, 1, 1, -1], 0.0, np.inf)
            for i in rp:
                row([RP[i], self.Mout[i]], [1, -1], -np.inf, 0.0)
        # runtime, in units of plain training's runtime
        plain_s = float(costs.compute_s.sum())
        if math.isfinite(budgets.runtime_s):
            scale = plain_s if plain_s > 0 else 1.0
            cc = np.concatenate(run_cols)
            vv = np.concatenate(run_vals) / scale
            for col, v in zip(cc, vv):
                rows.append(nrow), cols.append(int(col)), vals.append(float(v))
            rlo.append(-np.inf), rhi.append((budgets.runtime_s - plain_s - const_s) / scale)
            nrow += 1
        for per_tensor, limit in (storage_limits(costs, budgets) if len(mo) else ()):
            if limit > 0:
                row(self.Mout[mo], per_tensor[mo] / limit, -np.inf, 1.0)
            else:
                ub[self.Mout[mo]] = 0.0
        A = sp.csr_matrix((np.array(vals, dtype=float), (np.array(rows, dtype=np.int64),
                                                          np.array(cols, dtype=np.int64))), shape=(nrow, n))
        self.milp = Milp(c=c, offset=offset, A=A, row_lb=np.array(rlo, dtype=float),
                         row_ub=np.array(rhi, dtype=float), lb=lb, ub=ub, integrality=integrality)

    def relaxed(self) -> Milp:
        m = self.milp
        return Milp(c=m.c, offset=m.offset, A=m.A, row_lb=m.row_lb, row_ub=m.row_ub, lb=m.lb, ub=m.ub,
                    integrality=np.zeros(m.num_vars, dtype=np.int8))


def window_size(graph: TrainingGraph, mode: str, a: int, b: int) -> int:
    """Columns of WindowModel(a, b), without building it."""
    need, comp = _horizons(graph, mode in ("joint", "remat"))
    ids = np.arange(len(graph))
    total = 0
    for t in range(a, b + 2):
        total += int(((ids < t) & (t <= need)).sum())
    for t in range(a, b + 1):
        total += int(((ids < t) & (t <= comp)).sum())
        if mode in ("joint", "paging"):
            total += int(((ids < t) & (t <= need) & (need > ids)).sum())
    if mode in ("joint", "remat"):
        total += (b - a + 1) * len(graph)  # the memory levels of recomputing stages, at most
    return total


# HiGHS's primal objective at an "optimal" LP is within its tolerances (1e-7, on an objective scaled
# to order one) of the dual objective, which is what bounds, and a MILP's dual bound comes from such
# LPs: shave this much (relative) off either to stay below the exact figure. It also keeps a window
# bound from ever certifying a plan as optimal on its own (gap 0): only the full model does that.
SAFETY = 1e-6


def solve_window(model: WindowModel, *, lp: bool, time_limit: float, threads: Optional[int] = None,
                 gap: float = 1e-4) -> tuple[Optional[float], str, float]:
    """(proven lower bound in joules or None, status, seconds) of the window model's LP or MILP."""
    started = time.perf_counter()
    if lp:
        result = solve_milp(model.relaxed(), time_limit=time_limit, gap=0.0, threads=threads)
        bound = None
        if result.status in ("optimal", "gap_limit") and result.objective is not None:
            bound = result.objective - SAFETY * abs(result.objective)
        elif result.status == "infeasible":
            bound = math.inf
    else:
        result = solve_milp(model.milp, time_limit=time_limit, gap=gap, threads=threads)
        bound = math.inf if result.status == "infeasible" else result.bound
        if bound is not None and math.isfinite(bound):
            bound -= SAFETY * abs(bound)
    return bound, result.status, time.perf_counter() - started


# The first window: this many stages around plain training's RAM peak. The MILP of a window this
# small solves in a second or two up to 2000 nodes (benchmarks/HARD.md); larger windows rarely raise
# the bound much and cost more (on ResNet-50 at 0.8 of its peak, 10 to 60 stages all give +0.0171%).
FIRST_WINDOW = 10
# Windows are doubled while the time lasts, up to this many columns.
MAX_WINDOW_COLUMNS = 60_000


def peak_window(graph: TrainingGraph, budgets: Budgets, width: int) -> Optional[tuple[int, int]]:
    """``width`` stages around the stage where plain training overflows the RAM budget most, or None
    when it never does (plain training fits: its energy is the optimum)."""
    live = plain_live_bytes(graph)
    if len(live) == 0 or live.max() <= budgets.ram_bytes:
        return None
    T, p = len(graph), int(np.argmax(live))
    a = max(0, p - width // 2)
    b = min(T - 1, a + width - 1)
    return max(0, b - width + 1), b


def window_bound(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *, time_limit: float,
                 threads: Optional[int] = None, stop_at: Optional[float] = None) -> Optional[BoundResult]:
    """The best bound the window relaxations prove within ``time_limit`` seconds (None: none above
    plain training's energy). The LPs of windows around the RAM peak, doubled in width while time
    remains, then the MILP of the best of them (HiGHS's dual bound is valid when its time limit
    stops it). ``stop_at``: a bound (joules) past which more work is not worth it (the best plan's
    energy within the requested gap)."""
    started = time.perf_counter()
    floor = costs.plain_energy_j
    if mode == "none":
        return None
    best: Optional[BoundResult] = None
    best_model: Optional[WindowModel] = None

    def left() -> float:
        return time_limit - (time.perf_counter() - started)

    def done() -> bool:
        return stop_at is not None and best is not None and best.bound >= stop_at

    width = FIRST_WINDOW
    while left() > 0.1 and not done():
        window = peak_window(graph, budgets, width)
        if window is None:
            return None  # plain training fits: its energy is the bound, and the optimum
        columns = window_size(graph, mode, *window)
        if columns > MAX_WINDOW_COLUMNS or columns * BUILD_S_PER_COLUMN > 0.5 * left():
            break
        model = WindowModel(graph, costs, budgets, mode, *window)
        # an LP is only worth its time while it leaves some for the MILP after it
        bound, status, _ = solve_window(model, lp=True, time_limit=max(0.05, 0.5 * left()), threads=threads)
        if bound is not None and math.isinf(bound):
            # No plan fits even the relaxation: then none fits the problem either, but the caller has
            # a plan in hand, so this can only be the solver's tolerances speaking. Claim nothing.
            return None
        if bound is not None and bound > floor and (best is None or bound > best.bound):
            best, best_model = BoundResult(bound=bound, method="window LP", window=window, status=status), model
        if window == (0, len(graph) - 1) or status not in ("optimal", "gap_limit"):
            break  # the whole graph, or an LP that did not finish: a wider one would not either
        width *= 2
    if best_model is not None and left() > 0.1 and not done():
        bound, status, _ = solve_window(best_model, lp=False, time_limit=left(), threads=threads)
        if bound is not None and math.isfinite(bound) and bound > best.bound:
            best = BoundResult(bound=bound, method="window MILP", window=best.window, status=status)
    if best is not None:
        best.solve_s = time.perf_counter() - started
    return best


# Seconds per column that building a WindowModel takes (Python loops over its rows), with room.
BUILD_S_PER_COLUMN = 60e-6
