"""The residency relaxation: a lower bound over the whole graph, of size linear in its edges.

The window relaxation (bounds.py) is exact about a few dozen stages and blind to the rest. On a
streamed, sliced and stripped graph (ResNet-18 on the nRF52840: 8,223 nodes, 904 weight slices) the
energy above plain training is spread over every stage: each weight slice read again for its
backward readers, each activation strip paged or recomputed for its gradient. This relaxation
counts, for every tensor and every stretch of stages between two consecutive reads of it, whether
the plan kept it in RAM all the way across or brought it back, and lets the RAM budget decide:

- A tensor ``i`` is read in its own stage and in the stage of each of its readers (a node's first
  computation is in its own stage in every plan). Between two consecutive such read stages
  ``a < b`` (a *gap*, with at least one stage strictly inside), a plan either materializes ``i``
  again somewhere in stages ``a+1..b`` (a recomputation, for a weight slice a read from storage, or
  a page-in), or does not. If it does not, ``i`` is in RAM at the start of every stage ``a+1..b``
  (row 2 of the full model, walked back from stage ``b``, where ``b`` reads it), so it is kept into
  ``s+1`` for every stage ``s`` strictly inside the gap, beside node ``s``'s inputs and output
  (row 9: ``i`` is neither, since ``s`` does not read it).
- So per stage ``s``: the bytes of the tensors whose gaps span ``s`` and that were not brought back
  in them fit in the budget minus node ``s``'s working set. Per gap, a return costs at least one
  recomputation (for weights: one read) or one page-in, and a tensor paged in anywhere was paged
  out once. Gaps of one tensor are disjoint ranges of stages, so the returns counted are distinct
  actions of the plan; each costs what it costs there. Runtime and storage budgets hold over them.

Every plan of the full model maps onto a point of this model (a gap's return variable set for the
first materialization in it) whose objective, plain training's energy plus the counted actions, is
at most the plan's energy: the model's LP optimum, and any dual bound HiGHS proves on its MILP,
bound every plan in this execution order under the stage model. It says nothing about what a
recomputation needs (its inputs in RAM then): the window relaxation covers that near the peak, and
the driver takes the higher of the two. Columns: three per gap (a recomputation, a page-in and the
memory level's chain terms), one page-out per tensor, one level per stage; the memory rows are a
chain (each gap enters one stage's level and leaves another's), so the matrix has O(|E| + T)
entries however long the gaps are.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, storage_limits
from poet_opt.solver.backends import interrupted, solve_milp
from poet_opt.solver.bounds import BoundResult
from poet_opt.solver.dual_bound import dual_ascent, dual_bound
from poet_opt.solver.formulation import Milp, horizons, recomputes_gradients
from poet_opt.solver.heuristics import read_gaps
from poet_opt.solver.split_bound import pieces, split_bound
from poet_opt.solver.stage_counts import StageCounts, stage_counts
from poet_opt.solver.stream_bound import support_block

# HiGHS's objective at an "optimal" LP is within its tolerances of the dual value that bounds: shaved
# by this much (relative), as in bounds.py, so the bound never claims a zero gap on its own.
SAFETY = 1e-6


@dataclass
class Relaxed:
    """What both forms of the relaxation read: every gap with a stage inside it (tensor, first and
    last read stage, a < b - 1; the spill heuristic's gaps, heuristics.read_gaps: a tensor of no
    bytes is free to keep and has none), whether a return there may be a recomputation (a weight
    read) or a page-in, and each tensor's bytes and each stage's room beside its node's working
    set, in units of the RAM budget."""

    tensor: np.ndarray
    a: np.ndarray
    b: np.ndarray
    can_r: np.ndarray
    can_p: np.ndarray
    pageable: np.ndarray
    nb: np.ndarray
    room: np.ndarray
    counts: StageCounts
    unit: float = 1.0  # the bytes ``nb`` and ``room`` are in units of (the RAM budget)

    @classmethod
    def of(cls, graph: TrainingGraph, budgets: Budgets, mode: str) -> "Relaxed":
        T = len(graph)
        allow_remat, allow_paging = mode in ("joint", "remat"), mode in ("joint", "paging")
        need, comp = horizons(graph, allow_remat, gradients=recomputes_gradients(graph, allow_remat))
        nbytes = np.array([n.bytes for n in graph.nodes], dtype=np.int64)
        size = nbytes.astype(float)
        unit = float(budgets.ram_bytes) if math.isfinite(budgets.ram_bytes) else float(max(size.sum(), 1.0))
        nb = size / unit
        i, a, b = read_gaps(graph, graph.users())
        is_param = np.array([n.op == "param" for n in graph.nodes], dtype=bool)
        # a recomputation (a weight read) in the gap needs a stage a+1..b at which i may be computed;
        # a page-in, a tensor that may be paged out at all (never weights: they are on storage)
        pageable = (need > np.arange(T)) & ~is_param if allow_paging else np.zeros(T, dtype=bool)
        work = nbytes.copy()  # a node's output and inputs, in bytes (integers, for the counts' caps)
        for node in graph.nodes:
            work[node.id] += sum(nbytes[d] for d in set(node.deps))
        counts = stage_counts(nbytes[i], int(budgets.ram_bytes) - work, int(budgets.ram_bytes)) \
            if math.isfinite(budgets.ram_bytes) else StageCounts((), [], [])
        return cls(i, a, b, comp[i] > a, pageable[i] & (need[i] > a), pageable, nb, 1.0 - work / unit, counts, unit)


class ResidencyModel:
    """The relaxation of the module docstring, as a Milp: columns R (a recomputation or weight read
    in the gap), P (a page-in in the gap), O (a tensor's page-out), L (a stage's kept bytes), and per
    divisor of stage_counts.py, C (a stage's kept count)."""

    def __init__(self, graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *,
                 inputs: bool = False, trees: bool = True, counts: bool = True, input_returns: bool = True):
        """inputs: with the rows of stream_bound.py (what a recomputation's inputs hold in RAM);
        trees: with its rows for what each recomputation stands on at every stage (more columns);
        input_returns: with its rows for what a recomputation's input read elsewhere too costs across
        the recomputation's gap (stream_bound._input_return_rows);
        counts: with the counting rows of stage_counts.py (how many large tensors fit at a stage)."""
        T = len(graph)
        gaps = Relaxed.of(graph, budgets, mode)
        i, a, b = gaps.tensor, gaps.a, gaps.b
        G = len(i)
        can_r, can_p, pageable, nb = gaps.can_r, gaps.can_p, gaps.pageable, gaps.nb
        self.gaps, self.T = gaps, T
        self.R = np.arange(G)
        self.P = G + np.arange(G)
        self.O = 2 * G + np.arange(T)
        self.L = 2 * G + T + np.arange(T)
        n = 2 * G + 2 * T
        # one count level per stage and divisor (stage_counts.py), after the byte levels
        counts = gaps.counts if counts else StageCounts((), [], [])
        self.counts = counts
        self.C = [n + k * T + np.arange(T) for k in range(len(counts.divisors))]
        n += len(self.C) * T

        c = np.zeros(n)
        c[self.R] = costs.compute_j[i]
        c[self.P] = costs.page_in_j[i]
        c[self.O] = costs.page_out_j
        lb, ub = np.zeros(n), np.ones(n)
        ub[self.R[~can_r]] = 0.0
        ub[self.P[~can_p]] = 0.0
        ub[self.O[~pageable]] = 0.0
        # the level of stage s: the bytes kept across s, at most the budget beside s's working set
        lb[self.L] = -np.inf
        ub[self.L] = gaps.room
        for C, cap in zip(self.C, counts.cap):
            lb[C], ub[C] = -np.inf, cap
        integrality = np.ones(n, dtype=np.int8)
        integrality[self.L] = 0
        for C in self.C:
            integrality[C] = 0

        rows, cols, vals = [], [], []
        lo, hi = [], []
        nrow = 0
        # R + P <= 1 per gap
        g = np.arange(G)
        rows += [g, g]
        cols += [self.R, self.P]
        vals += [np.ones(G), np.ones(G)]
        lo.append(np.full(G, -np.inf)), hi.append(np.ones(G))
        nrow += G
        # P <= O per gap: a page-in needs the page-out
        rows += [nrow + g, nrow + g]
        cols += [self.P, self.O[i]]
        vals += [np.ones(G), -np.ones(G)]
        lo.append(np.full(G, -np.inf)), hi.append(np.zeros(G))
        nrow += G
        # The level chain: L[s] - L[s-1] = (bytes of gaps entering s) - (bytes of gaps leaving after
        # s-1), each gap counted as nb * (1 - R - P). Gap (a, b) spans the stages a+1..b-1.
        # The count chains (stage_counts.py) the same way, a gap weighing its weight instead of its bytes
        self.level_row0 = nrow
        s = np.arange(T)
        enter, leave = a + 1, b  # enters level a+1, leaves at level b (not spanned any more)
        for level, w in [(self.L, nb[i])] + list(zip(self.C, counts.weight)):
            rows += [nrow + s, nrow + s[1:]]
            cols += [level, level[:-1]]
            vals += [np.ones(T), -np.ones(T - 1)]
            for idx, sign in ((enter, 1.0), (leave, -1.0)):
                inside = (idx < T) & (w > 0)
                for col in (self.R, self.P):
                    rows.append(nrow + idx[inside]), cols.append(col[inside]), vals.append(sign * w[inside])
            rhs = np.zeros(T)
            np.add.at(rhs, enter[enter < T], w[enter < T])
            np.add.at(rhs, leave[leave < T], -w[leave < T])
            lo.append(rhs), hi.append(rhs)
            nrow += T
        self.block, self.base_rows = None, nrow
        if inputs:
            allow_remat = mode in ("joint", "remat")
            need, comp = horizons(graph, allow_remat, gradients=recomputes_gradients(graph, allow_remat))
            block = support_block(graph, costs, base=n, nb=nb, gaps=gaps, R=self.R, P=self.P, O=self.O,
                                  comp=comp, need=need, pageable=pageable, trees=trees,
                                  input_returns=input_returns)
            self.block, extra = block, len(block.cost)
            c = np.concatenate([c, block.cost])
            lb = np.concatenate([lb, np.zeros(extra)])
            ub = np.concatenate([ub, block.ub])
            integrality = np.concatenate([integrality, np.zeros(extra, dtype=np.int8)])
            n += extra
            if block.level:
                st, col, val = (np.array(x) for x in zip(*block.level))
                rows.append(self.level_row0 + st), cols.append(col), vals.append(val)
            if block.rows:
                r, col, val = (np.array(x) for x in zip(*block.rows))
                rows.append(nrow + r), cols.append(col), vals.append(val)
            lo.append(block.lo), hi.append(block.hi)
            nrow += len(block.lo)
        # runtime, in units of plain training's runtime
        if math.isfinite(budgets.runtime_s):
            plain_s = float(costs.compute_s.sum())
            scale = plain_s if plain_s > 0 else 1.0
            rows += [np.full(G, nrow), np.full(G, nrow), np.full(T, nrow)]
            cols += [self.R, self.P, self.O]
            vals += [costs.compute_s[i] / scale, costs.page_in_s[i] / scale, costs.page_out_s / scale]
            lo.append([-np.inf]), hi.append([(budgets.runtime_s - plain_s) / scale])
            nrow += 1
        for per_tensor, limit in storage_limits(costs, budgets):
            if limit > 0:
                rows.append(np.full(T, nrow)), cols.append(self.O), vals.append(per_tensor / limit)
                lo.append([-np.inf]), hi.append([1.0])
                nrow += 1
            else:
                ub[self.O] = 0.0
        A = sp.csr_matrix((np.concatenate(vals).astype(float),
                           (np.concatenate(rows).astype(np.int64), np.concatenate(cols).astype(np.int64))),
                          shape=(nrow, n))
        self.milp = Milp(c=c, offset=float(costs.compute_j.sum()), A=A,
                         row_lb=np.concatenate([np.asarray(x, dtype=float) for x in lo]),
                         row_ub=np.concatenate([np.asarray(x, dtype=float) for x in hi]),
                         lb=lb, ub=ub, integrality=integrality)

    def relaxed(self) -> Milp:
        m = self.milp
        return Milp(c=m.c, offset=m.offset, A=m.A, row_lb=m.row_lb, row_ub=m.row_ub, lb=m.lb, ub=m.ub,
                    integrality=np.zeros(m.num_vars, dtype=np.int8))

    def lagrangian_duals(self, multipliers: np.ndarray, costs: NodeCosts) -> np.ndarray:
        """Row multipliers of this model whose dual function (dual_bound.py) is the Lagrangian's value
        at ``multipliers`` (lagrangian_bound's: ``lam`` per stage, then per stage and divisor of
        ``self.counts`` those of the count rows; missing ones are zero): on the level chain's row ``s``
        the sum of ``lam`` from ``s`` on (so each level's reduced cost is ``-lam[s]``, and a gap's
        return's is its cost less the keep's ``nb * lam`` over its span), on the count chains' the
        same of theirs; on each gap's ``P <= O`` row minus its share of the page-out; on its ``R + P <=
        1`` row the least of 0 and its returns' reduced costs; zero on every other row."""
        gaps, T, G = self.gaps, self.T, len(self.R)
        i = gaps.tensor
        y = np.zeros(self.milp.num_rows)
        per_tensor = np.bincount(i, minlength=T)
        share = np.where(gaps.can_p, costs.page_out_j[i] / np.maximum(per_tensor[i], 1), 0.0)
        y[G:2 * G] = -share
        keep = np.zeros(G)
        weights = [gaps.nb[i]] + self.counts.weight
        for k, w in enumerate(weights):
            lam = np.asarray(multipliers[k * T:(k + 1) * T], dtype=float)
            if len(lam) < T:
                break
            level = np.cumsum(lam[::-1])[::-1]
            y[self.level_row0 + k * T:self.level_row0 + (k + 1) * T] = level
            ahead = np.concatenate([level, [0.0]])
            keep += w * (ahead[gaps.a + 1] - ahead[gaps.b])
        d_r = np.where(gaps.can_r, costs.compute_j[i] - keep, 0.0)
        d_p = np.where(gaps.can_p, costs.page_in_j[i] + share - keep, 0.0)
        y[:G] = np.minimum(0.0, np.minimum(d_r, d_p))
        return y

    def boxed(self) -> Milp:
        """The LP relaxation with every column boxed, for dual_bound.py: the levels ``L`` get the lower
        bound 0, which every point meeting the rows has already. The level chain makes ``L[s]`` the sum
        over the gaps spanning ``s`` of ``nb * (1 - R - P)`` (each at least 0, since ``R + P <= 1``
        and ``nb >= 0``) plus the block's held bytes (``weight * V``, ``weight >= 0``, ``V >= 0``): the
        same feasible set, the same optimum, and now any row multipliers give a finite bound."""
        lp = self.relaxed()
        lb = lp.lb.copy()
        lb[self.L] = 0.0
        for C in self.C:  # the same for the counts: weights >= 0 times keeps >= 0
            lb[C] = 0.0
        return Milp(c=lp.c, offset=lp.offset, A=lp.A, row_lb=lp.row_lb, row_ub=lp.row_ub, lb=lb, ub=lp.ub,
                    integrality=lp.integrality)


# The Lagrangian's share of residency_bound's time: it answers in seconds at any size, the LP after
# it is higher where it finishes (ResNet-18: 20.10 J against 19.75 J; bert-base's LP does not finish
# in 500 s, its Lagrangian gives 277.5 J in 60 s).
LAGRANGIAN_SHARE = 0.3
# Past this many columns the simplex LP is not tried (ResNet-18's model: 45,000 columns, LP in 8.5 s;
# bert-base's: 321,000, no LP optimum in 500 s): the Lagrangian has LARGE_LAGRANGIAN_SHARE of the time
# (all of it without recomputation inputs), and the LP with recomputation inputs the rest: in pieces
# at the Lagrangian's stage prices (split_bound.py), then by dual ascent from its multipliers
# (dual_bound.py), each bound proven by its own arithmetic. (HiGHS's interior point on bert-base's
# whole model takes 8-10 s an iteration on this machine and had no answer after 35 minutes.)
LP_MAX_COLUMNS = 150_000
# bert-base's Lagrangian reaches its LP's optimum (277.5 J) in about 60 s of a lightly loaded core
# (benchmarks/STREAMING.md, "Is bert-base's Lagrangian bound converged?"; with the count rows, 296.48 J
# after 30 s and after 60 s), and the pieces after it need about 260 s of a 600 s solve's 460 s
LARGE_LAGRANGIAN_SHARE = 0.15
# The LP in pieces (split_bound.py) may take this share of what is left after the Lagrangian and the
# build, with this many pieces solved at once; dual ascent has the rest
SPLIT_SHARE = 0.85
SPLIT_WORKERS = 4
# The LP with recomputation inputs gets this share of what the plain LP left: the rest goes to the
# dual bound of its MILP (ResNet-18: 112,000 columns, LP in about 60 s on a loaded 2-core machine).
INPUTS_LP_SHARE = 0.8
# Building that model (Python loops over recomputations and their inputs) takes up to about this long
# per column of the model without it, on a loaded machine (ResNet-18: 45,000 columns, 1.2-6 s); it
# cannot be stopped, so it is not started unless twice that is left.
INPUTS_BUILD_S_PER_COLUMN = 2 * 1.4e-4
# The count rows go into the LPs when the Lagrangian's second run (every multiplier) added at least
# this share of its bound above plain training
COUNTS_WORTH = 1e-4
# ... and that run stops after this many halvings of its step while behind the first (the bytes'
# multipliers alone), which has at most this share of the Lagrangian's time when the second follows
# it: it converges in 2 s of ResNet-18's 75, and on bert-base the second run is the one that counts
GIVE_UP = 4
BYTES_RUN_SHARE = 0.1


def residency_bound(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *, time_limit: float,
                    threads: Optional[int] = None, stop_at: Optional[float] = None, upper: Optional[float] = None,
                    lp_only: bool = False, inputs: bool = True) -> Optional[BoundResult]:
    """The best of: the Lagrangian bound (``upper``, a plan's energy, steers its steps), the LP
    bound, the LP with recomputation inputs (``inputs``, stream_bound.py), and, with time left and
    short of ``stop_at``, HiGHS's dual bound on the last MILP whose LP finished. None when
    none rises above plain training's energy (or the model says no plan exists, which the caller,
    holding a plan, takes for the tolerances speaking)."""
    started = time.perf_counter()
    if mode == "none":
        return None
    floor = costs.plain_energy_j

    def left() -> float:
        return time_limit - (time.perf_counter() - started)

    def done() -> bool:  # proven enough, or a Ctrl-C: what is proven so far stands
        return interrupted() or (stop_at is not None and best is not None and best.bound >= stop_at)

    best = None
    columns = 2 * len(read_gaps(graph, graph.users())[0]) + 2 * len(graph)
    large = columns > LP_MAX_COLUMNS
    widens = inputs and mode != "paging"
    if upper is not None and upper > floor:
        share = LAGRANGIAN_SHARE if not large else LARGE_LAGRANGIAN_SHARE if widens else 1.0
        best = lagrangian_bound(graph, costs, budgets, mode, upper=upper, time_limit=share * time_limit,
                                iterations=3000 if not large else 100_000)
    # the count rows where the Lagrangian found them worth something (bert-base: 19 J), not where it
    # found nothing (ResNet-18: the same LP optimum with them, its LP with recomputation inputs 137 s
    # against 96 s, under different loads)
    counts = best is None or best.counts_gain > COUNTS_WORTH * (best.bound - floor)
    if left() <= 0.05 or done():
        return _timed(best, started)
    if large:
        if widens and best is not None and best.multipliers is not None and \
                left() > INPUTS_BUILD_S_PER_COLUMN * columns:
            # Without the tree rows: dual ascent from the Lagrangian's multipliers does not reach
            # what they add in its time, and their columns make each step dearer (bert-base, 600 s:
            # 282.6 J with them, 283.4 J without; benchmarks/STREAMING.md)
            wider = ResidencyModel(graph, costs, budgets, mode, inputs=True, trees=False, counts=counts)
            prices = best  # the Lagrangian's
            if wider.block.cost and left() > 1.0 and not done():
                # The LP cut into pieces at the Lagrangian's stage prices (split_bound.py): bert-base
                # 336.9 J where dual ascent on the whole LP reached 301.5 J in 360 s
                value = split_bound(wider, prices.multipliers, pieces(graph, model=wider), time_limit=SPLIT_SHARE * left(),
                                    workers=threads or min(os.cpu_count() or 1, SPLIT_WORKERS))
                if value is not None and value > best.bound:
                    best = BoundResult(bound=value, method="residency LP with recomputation inputs, in pieces",
                                       status="split")
            if wider.block.cost and left() > 1.0 and not done():
                start = wider.lagrangian_duals(prices.multipliers, costs)
                value, _ = dual_ascent(wider.boxed(), start, target=upper,
                                       time_limit=left() - 0.5)  # (its last bound: 0.4 s on bert-base)
                if value is not None and value > best.bound:
                    best = BoundResult(bound=value, method="residency LP with recomputation inputs, dual ascent",
                                       status="subgradient")
        return _timed(best, started)
    model = ResidencyModel(graph, costs, budgets, mode, counts=counts)
    if left() <= 0.05:
        return _timed(best, started)
    result = solve_milp(model.relaxed(), time_limit=left(), gap=0.0, threads=threads)
    if result.status in ("optimal", "gap_limit") and result.objective is not None:
        value = result.objective - SAFETY * abs(result.objective)
        if value > floor and (best is None or value > best.bound):
            best = BoundResult(bound=value, method="residency LP", status=result.status)
    elif result.status == "infeasible":
        return None
    else:  # stopped short: its multipliers still bound (dual_bound.py)
        best = _higher(best, _from_duals(model, result, floor, "residency LP"))
    named = "residency MILP"
    if widens and left() > INPUTS_BUILD_S_PER_COLUMN * columns and not done():
        # The same LP with what recomputations' inputs hold (stream_bound.py): a superset of its rows,
        # so at least as high where it finishes (ResNet-18: 20.35 J against 20.10 J)
        wider = ResidencyModel(graph, costs, budgets, mode, inputs=True, counts=counts)
        if wider.block.cost and left() > 0.2:
            # HiGHS's interior point, without crossover: its multipliers prove the bound (dual_bound.py).
            # The simplex had no optimum of this LP on one encoder block after 12 minutes; the interior
            # point answers in 35 s, and on ResNet-18 in 97 s, where the simplex took 108 s from the
            # optimal basis of the LP without recomputation inputs
            result = solve_milp(wider.relaxed(), time_limit=INPUTS_LP_SHARE * left(), gap=0.0, threads=threads,
                                lp_solver="ipm")
            if result.status != "infeasible":
                best = _higher(best, _from_duals(wider, result, floor, "residency LP with recomputation inputs"))
            if result.status in ("optimal", "gap_limit"):
                model, named = wider, "residency MILP with recomputation inputs"
    if not lp_only and left() > 0.2 and not done():
        result = solve_milp(model.milp, time_limit=left(), gap=1e-4, threads=threads)
        if result.bound is not None and math.isfinite(result.bound) and result.status != "infeasible":
            value = result.bound - SAFETY * abs(result.bound)
            if value > floor and (best is None or value > best.bound):
                best = BoundResult(bound=value, method=named, status=result.status)
    return _timed(best, started)


def _from_duals(model: ResidencyModel, result, floor: float, method: str) -> Optional[BoundResult]:
    """The bound the run's row multipliers prove on ``model``'s LP (dual_bound.py, on its boxed form),
    whatever the run's status: None when it is not above ``floor``."""
    if result.duals is None:
        return None
    value = dual_bound(model.boxed(), result.duals)
    if value is None or not value > floor:
        return None
    return BoundResult(bound=value, method=f"{method}, dual bound", status=result.status)


def _higher(best: Optional[BoundResult], other: Optional[BoundResult]) -> Optional[BoundResult]:
    return other if other is not None and (best is None or other.bound > best.bound) else best


def _timed(best: Optional[BoundResult], started: float) -> Optional[BoundResult]:
    if best is not None:
        best.solve_s = time.perf_counter() - started
    return best


def lagrangian_bound(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *, upper: float,
                     time_limit: float, iterations: int = 3000, counts: bool = True) -> Optional[BoundResult]:
    """The same relaxation with its RAM rows moved into the objective, one multiplier ``lam[s] >= 0``
    per stage (runtime and storage rows dropped, which only lowers the minimum), and with ``counts``
    the count rows of stage_counts.py too, one multiplier per stage and divisor: for any such
    multipliers the minimum over plans of (returns' energy + sum_s lam[s] (kept bytes at s - room at
    s) + the same of each count) is at most the least energy of any plan, and each gap decides alone
    there, keeping its tensor (``w * sum of lam over its span``, plus its count weights times theirs)
    or bringing it back at its cheapest, whichever is less. A page-out is charged to each paged gap
    as an equal share of it over the tensor's gaps, which a plan pays at least (it pays it whole for
    one paged gap). Subgradient steps towards ``upper`` (joules: a plan's energy) raise it; every
    iterate is a bound, the best one is kept (``multipliers``: ``lam``, then each divisor's, as
    ResidencyModel.lagrangian_duals reads them). Linear in the gaps per step, so it answers in seconds
    where the LP takes minutes (bert-base's 57,843 nodes).

    Two runs, each from zero: the bytes' multipliers alone (at most BYTES_RUN_SHARE of the time; it
    converges in 2 s on ResNet-18), then all of them with what is left. On ResNet-18, where the
    counts add nothing, all of them at once ended 1.6% lower (the more multipliers, the shorter each
    one's steps), so that run gives up once it has fallen behind the first; on bert-base it rose
    from 277.6 J to 296.5 J. Started from the first run's multipliers instead, it had 284.7 J after
    90 s. ``counts_gain`` is what the second run added."""
    started = time.perf_counter()
    if mode == "none":
        return None
    T = len(graph)
    gaps = Relaxed.of(graph, budgets, mode)
    i, a, b, nb, room = gaps.tensor, gaps.a, gaps.b, gaps.nb, gaps.room
    if not len(i):
        return None
    per_tensor = np.bincount(i, minlength=T)
    ret = np.where(gaps.can_r, costs.compute_j[i], np.inf)
    ret = np.minimum(ret, np.where(gaps.can_p, costs.page_in_j[i] + costs.page_out_j[i] / np.maximum(per_tensor[i], 1),
                                   np.inf))
    floor = costs.plain_energy_j
    target = max(upper - floor, 1e-12)
    phases = [(np.array([nb[i]]), np.array([room]))]
    if counts and gaps.counts.divisors:
        # one row per priced resource: the bytes, then each divisor's counts
        phases.append((np.array([nb[i]] + gaps.counts.weight), np.array([room] + gaps.counts.cap)))
    best, lam, gain = -np.inf, np.zeros(T), 0.0
    for k, (weight, cap) in enumerate(phases):
        found, found_lam = _ascend(weight, cap, ret, a, b, np.zeros((len(weight), T)), target, iterations=iterations,
                                   deadline=started + time_limit * (BYTES_RUN_SHARE if k < len(phases) - 1 else 1.0),
                                   behind=best if k else None)
        gain = found - best if k else 0.0
        if found > best:
            best, lam = found, found_lam
    if not math.isfinite(best):
        return None
    bound = floor + best
    bound -= SAFETY * abs(bound)
    if bound <= floor:
        return None
    return BoundResult(bound=bound, method="residency Lagrangian", solve_s=time.perf_counter() - started,
                       status="subgradient", multipliers=lam.reshape(-1), counts_gain=max(gain, 0.0))


def _ascend(weight: np.ndarray, cap: np.ndarray, ret: np.ndarray, a: np.ndarray, b: np.ndarray, lam: np.ndarray,
            target: float, *, deadline: float, iterations: int, behind: Optional[float] = None
            ) -> tuple[float, np.ndarray]:
    """lagrangian_bound's subgradient steps from ``lam`` (a row of multipliers per row of ``weight``
    and ``cap``): the best value above plain training's energy, and its multipliers. Given
    ``behind`` (another run's value), it gives up once its step has halved GIVE_UP times with its
    best still not above that."""
    K, T = lam.shape
    best, theta, stall, best_lam = -np.inf, 1.0, 0, lam
    for _ in range(iterations):
        if behind is not None and theta < 0.5 ** GIVE_UP and best <= behind:
            break
        prefix = np.concatenate([np.zeros((K, 1)), np.cumsum(lam, axis=1)], axis=1)
        keep_cost = (weight * (prefix[:, b] - prefix[:, a + 1])).sum(axis=0)  # lam over stages a+1..b-1
        keep = keep_cost < ret
        value = float(np.where(keep, keep_cost, ret).sum() - (lam * cap).sum())
        if value > best + 1e-12 * target:
            best, stall, best_lam = value, 0, lam
        else:
            stall += 1
            if stall >= 50:
                theta, stall = theta / 2, 0
        # the subgradient: bytes (counts) kept across each stage minus its room (cap)
        diff = np.zeros((K, T + 1))
        for k in range(K):
            np.add.at(diff[k], a[keep] + 1, weight[k, keep])
            np.add.at(diff[k], b[keep], -weight[k, keep])
        grad = np.cumsum(diff, axis=1)[:, :T] - cap
        grad[(lam <= 0) & (grad < 0)] = 0.0
        norm = float((grad * grad).sum())
        if norm <= 0 or theta < 1e-6 or time.perf_counter() > deadline or interrupted():
            break
        lam = np.maximum(0.0, lam + theta * max(target - value, 1e-3 * target) / norm * grad)
    return best, best_lam
