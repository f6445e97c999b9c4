"""A lower bound from several windows at once, linked across the stages between them.

One window relaxation (bounds.WindowModel) counts what the plan must pay around one RAM peak: in
its stages, and once per tensor it drops that a later node reads. On a graph whose plain training
overflows the budget over hundreds of stages (the layered graphs at 70% of their peak: 900 of
2,001 stages), the same tensor may have to come back several times and the pressure of every
overflowing stage adds its own drops; one window sees none of that.

The *chained* relaxation keeps windows W_0 < W_1 < ... < W_m (each a WindowModel, stage-disjoint)
and replaces the stages between W_k and W_{k+1} (the *gap* (b_k, a_{k+1})) by what every plan does
there, at least:

- a tensor made by stage b_k that a node in the gap reads, or that is kept into a_{k+1}, and that is
  not kept into b_k + 1, is materialized in the gap at least once (``G[k, i] = 1``): it is in RAM
  at that reader's stage, or at stage a_{k+1} - 1, and was not at the start of b_k + 1;
- in remat mode (every return a recomputation) such a recomputation reads each input: kept into
  b_k + 1 or materialized in the gap too (an input made in the gap is there in its own stage);
- a return costs its recomputation's energy, or the cheaper of that and a page-in where paging is
  allowed (the page-out it needs is not counted: a relaxation may under-count).

Each window counts its own stages' actions and the page-outs of tensors made in them (each page-out
happens in its tensor's own stage), with what is kept into its first stage limited by the knapsack
of the stage before (row 9 there); only the last window also counts the returns after it. Every
counted action is then a distinct, non-negative action of the plan (an action in a window stage, a
materialization in one gap, a page-out in its own stage, a return after the last window), and every
row holds for every plan: the model's optimum, and any dual bound a solver proves on it, bounds the
energy of every plan in this execution order. tests/test_chain_bound.py checks it against the full
MILP's optimum on small graphs.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.bounds import SAFETY, BoundResult, WindowModel, horizons_of, plain_live_bytes, window_size
from poet_opt.solver.formulation import Milp


class ChainModel:
    """The chained relaxation over stage-disjoint windows (module docstring), as one Milp."""

    def __init__(self, graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str,
                 windows: list[tuple[int, int]]):
        windows = sorted(windows)
        assert windows and all(b < a for (_, b), (a, _) in zip(windows, windows[1:]))
        self.windows = windows
        allow_remat, allow_paging = mode in ("joint", "remat"), mode in ("joint", "paging")
        last = len(windows) - 1
        self.blocks = [WindowModel(graph, costs, budgets, mode, a, b, returns=k == last, entry=True,
                                   own_page_outs=True) for k, (a, b) in enumerate(windows)]
        need, comp = horizons_of(graph, allow_remat)
        users = graph.users()
        deps = [sorted(set(n.deps)) for n in graph.nodes]
        base = np.cumsum([0] + [m.milp.num_vars for m in self.blocks])
        ncol = int(base[-1])
        c_extra, rows, cols, vals, rlo, rhi = [], [], [], [], [], []
        nrow = 0

        def row(terms, lo, hi):
            nonlocal nrow
            for col, v in terms:
                rows.append(nrow), cols.append(int(col)), vals.append(float(v))
            rlo.append(lo), rhi.append(hi)
            nrow += 1

        ub_extra = []
        for k in range(last):
            (a0, b0), (a1, _) = windows[k], windows[k + 1]
            left, right = self.blocks[k], self.blocks[k + 1]
            kept_out = left.S[b0 - a0 + 1]  # kept into b0 + 1, per tensor (-1: no column)
            kept_in = right.S[0]  # kept into a1
            G = {}
            for i in range(b0 + 1):
                if need[i] <= b0:
                    continue  # nothing after b0 reads it
                read = any(b0 < u < a1 for u in users[i])
                enters = kept_in[i] >= 0
                if not (read or enters):
                    continue
                can_recompute = allow_remat and comp[i] > b0
                if not can_recompute and not allow_paging:
                    ub = 0.0
                else:
                    ub = 1.0
                G[i] = ncol
                ncol += 1
                ub_extra.append(ub)
                price = []
                if can_recompute:
                    price.append(costs.compute_j[i])
                if allow_paging:
                    price.append(costs.page_in_j[i])
                c_extra.append(min(price) if price else 0.0)
                out = int(kept_out[i])
                if read:  # kept into b0 + 1 or materialized in the gap
                    row([(base[k] + out, 1.0)] * (out >= 0) + [(G[i], 1.0)], 1.0, np.inf)
                if enters:  # kept into a1 only if kept into b0 + 1 or materialized in the gap
                    row([(base[k + 1] + kept_in[i], 1.0), (G[i], -1.0)] + [(base[k] + out, -1.0)] * (out >= 0),
                        -np.inf, 0.0)
            if allow_remat and not allow_paging:
                for i, g in G.items():
                    for d in deps[i]:
                        if d > b0:
                            continue  # made in the gap, in RAM in its own stage
                        out = int(kept_out[d])
                        terms = [(g, -1.0)] + [(base[k] + out, 1.0)] * (out >= 0)
                        if d in G:
                            terms.append((G[d], 1.0))
                        row(terms, 0.0, np.inf)
        blocks = [m.milp for m in self.blocks]
        A = sp.block_diag([m.A for m in blocks], format="csr")
        extra = len(c_extra)
        A = sp.hstack([A, sp.csr_matrix((A.shape[0], extra))], format="csr")
        link = sp.csr_matrix((np.array(vals, dtype=float), (np.array(rows, dtype=np.int64),
                                                             np.array(cols, dtype=np.int64))), shape=(nrow, ncol))
        self.milp = Milp(
            c=np.concatenate([m.c for m in blocks] + [np.array(c_extra, dtype=float)]),
            offset=blocks[0].offset,  # plain training's compute, once
            A=sp.vstack([A, link], format="csr"),
            row_lb=np.concatenate([m.row_lb for m in blocks] + [np.array(rlo, dtype=float)]),
            row_ub=np.concatenate([m.row_ub for m in blocks] + [np.array(rhi, dtype=float)]),
            lb=np.concatenate([m.lb for m in blocks] + [np.zeros(extra)]),
            ub=np.concatenate([m.ub for m in blocks] + [np.array(ub_extra, dtype=float)]),
            integrality=np.concatenate([m.integrality for m in blocks] + [np.ones(extra, dtype=np.int8)]))


def higher(a: Optional[BoundResult], b: Optional[BoundResult]) -> Optional[BoundResult]:
    """The higher of two proven bounds (None: none)."""
    return b if a is None or (b is not None and b.bound > a.bound) else a


def spread_windows(graph: TrainingGraph, budgets: Budgets, count: int, width: int) -> list[tuple[int, int]]:
    """``count`` windows of ``width`` stages over the stages where plain training overflows the RAM
    budget, one per equal share of that range, each around its share's highest plain RAM."""
    live = plain_live_bytes(graph)
    over = np.flatnonzero(live > budgets.ram_bytes)
    if len(over) == 0:
        return []
    T, lo, hi = len(graph), int(over.min()), int(over.max())
    edges = np.linspace(lo, hi + 1, count + 1).astype(int)
    out = []
    for x, y in zip(edges, edges[1:]):
        if y <= x:
            continue
        p = x + int(np.argmax(live[x:y]))
        a = max(0, min(p - width // 2, T - width))
        b = min(T - 1, a + width - 1)
        if out and a <= out[-1][1] + 1:
            continue  # keep the windows apart: at least one stage between them
        out.append((a, b))
    return out


# Columns the chained model may have: its MILP must give a dual bound within seconds.
MAX_COLUMNS = 60_000
# Seconds per column that building the windows takes (bounds.BUILD_S_PER_COLUMN), with room.
BUILD_S_PER_COLUMN = 60e-6


def chain_bound(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *, time_limit: float,
                threads: Optional[int] = None, stop_at: Optional[float] = None,
                width: int = 1) -> Optional[BoundResult]:
    """The dual bound of the chained relaxation's MILP over as many windows of ``width`` stages as
    fit MAX_COLUMNS (spread over the overflowing stages), within ``time_limit`` seconds; None when
    it proves nothing above plain training's energy."""
    started = time.perf_counter()
    if mode == "none":
        return None
    floor = costs.plain_energy_j
    probe = spread_windows(graph, budgets, 1, width)
    if not probe:
        return None
    per_window = window_size(graph, mode, *probe[0])
    count = max(1, min(len(graph) // (2 * width), MAX_COLUMNS // max(1, per_window)))
    windows = spread_windows(graph, budgets, count, width)
    if len(windows) < 2 or sum(window_size(graph, mode, a, b) for a, b in windows) * BUILD_S_PER_COLUMN \
            > 0.4 * time_limit:
        return None
    model = ChainModel(graph, costs, budgets, mode, windows)
    left = time_limit - (time.perf_counter() - started)
    if left <= 0.1:
        return None
    result = solve_milp(model.milp, time_limit=left, gap=1e-4, threads=threads)
    bound = result.bound
    if result.status == "infeasible" or bound is None or not math.isfinite(bound):
        return None  # the caller holds a plan: infeasible can only be the tolerances speaking
    bound -= SAFETY * abs(bound)
    if bound <= floor:
        return None
    return BoundResult(bound=bound, method=f"chained windows ({len(windows)} x {width} stages)",
                       window=(windows[0][0], windows[-1][1]), solve_s=time.perf_counter() - started,
                       status=result.status)
