"""A compact MILP over a restricted plan space, for good incumbents on large graphs fast.

The space is the gap heuristic's (heuristics.gap_plan), solved exactly instead of greedily: from plain
training, each tensor may leave RAM in a *gap* between two consecutive stages that touch it (the
stage that makes it, and those that read it) and come back for the stage after the gap, by a page-in
(the tensor is paged out once, right after it is made) or by recomputing it there when it is a
forward node whose inputs are in RAM in that stage, or are themselves recomputed there first (chains
up to CHAIN_DEPTH links). Binaries: two per gap, one page-out per tensor and one per chain link, a
small multiple of |E|, against O(T^2) in the full formulation; rows: one per stage for RAM, one per
(recomputation, input), and the runtime and storage budgets.

Why a RAM row per stage suffices: whatever is paged in or recomputed at a gap's end is read by that
stage's node, and everything else resident is read by it or kept, so nothing of that is freed before
the node runs, where the stage's sum is reached. Chain links may be freed earlier than that (after
their last reader in the stage); the row counts them until the node runs, an over-estimate, so the
replayed peak never exceeds the row.

Every plan of this space is a plan of the full formulation, so its optimum is a valid schedule and a
MIP start for the full MILP; but the full space is larger (longer chains, page-ins for later stages,
no over-counted chain links), so this model's own bound is NOT a bound for the problem and is never
reported as one.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, build_steps, storage_limits, totals_of
from poet_opt.solver.backends import Settle, solve_milp
from poet_opt.solver.formulation import Milp

CHAIN_DEPTH = 4
MAX_RAM_ROW_ENTRIES = 20_000_000


class TooLarge(Exception):
    """The model would not be built within memory and time worth spending on a start."""


class GapMilp:
    def __init__(self, graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str = "joint"):
        self.graph, self.costs, self.budgets = graph, costs, budgets
        allow_paging, allow_remat = mode in ("joint", "paging"), mode in ("joint", "remat")
        nodes, T = graph.nodes, len(graph)
        size = np.array([n.bytes for n in nodes], dtype=float)
        users, self.last = graph.users(), graph.last_use()
        live = np.zeros(T + 1)
        owner, gap_a, gap_b = [], [], []
        touches = []
        for i in range(T):
            live[i] += size[i]
            live[self.last[i] + 1] -= size[i]
            tch = sorted({i, *users[i]})
            touches.append(tch)
            for a, b in zip(tch, tch[1:]):
                if b - a >= 2 and size[i] > 0:
                    owner.append(i), gap_a.append(a), gap_b.append(b)
        self.plain_live = np.cumsum(live)[:T]
        # each gap puts one entry in the RAM row of every stage it spans: quadratic in a long graph
        # (325 million entries, 7 GiB of arrays, for a row-tiled bert-base), where no MILP would solve
        spans = sum(b - a - 1 for a, b in zip(gap_a, gap_b))
        if spans > MAX_RAM_ROW_ENTRIES:
            raise TooLarge(f"{spans:,} RAM-row entries")
        self.owner, self.gap_a, self.gap_b = np.array(owner, dtype=np.int64), np.array(gap_a), np.array(gap_b)
        G = len(owner)
        # columns: P[g] page in after gap g, C[g] recompute after gap g, O[i] page i out
        can_page = np.full(G, allow_paging)
        can_recompute = np.array([allow_remat and not nodes[i].is_backward for i in owner], dtype=bool)
        gaps_of: dict[int, list[int]] = {}
        for g, i in enumerate(owner):
            gaps_of.setdefault(i, []).append(g)

        def gap_holding(d, t):
            """The gap of d with t strictly inside, -1 when d is touched at t, None when d is gone."""
            if not (d <= t <= self.last[d]):
                return None
            for g in gaps_of.get(d, ()):
                if gap_a[g] < t < gap_b[g]:
                    return g
            return -1

        # A recomputation in stage b needs each input in RAM there: touched in b, kept across its gap
        # over b, or itself recomputed in b first (a chain, up to CHAIN_DEPTH deep; X[b,d]). Chain
        # links are counted in stage b's RAM row as if they stayed until node b runs: the replay
        # frees them earlier, never later, so the row over-estimates and plans stay within budget.
        x_index: dict[tuple[int, int], int] = {}
        x_keys: list[tuple[int, int]] = []
        x_dead: set[int] = set()
        needs = []  # (("C", g) or ("X", k), gap holding the input or -1 when it is gone, X id or -1)

        def chain_var(b, d, depth):
            if (b, d) not in x_index:
                k = x_index[(b, d)] = len(x_keys)
                x_keys.append((b, d))
                if not inputs_present(("X", k), d, b, depth):
                    x_dead.add(k)
            return x_index[(b, d)]

        def inputs_present(consumer, node, b, depth) -> bool:
            for d in nodes[node].deps:
                h = gap_holding(d, b)
                if h == -1:
                    continue
                xk = -1
                if allow_remat and not nodes[d].is_backward and depth < CHAIN_DEPTH:
                    xk = chain_var(b, d, depth + 1)
                if h is None and xk < 0:
                    return False
                needs.append((consumer, -1 if h is None else h, xk))
            return True

        for g in np.flatnonzero(can_recompute):
            if not inputs_present(("C", g), owner[g], gap_b[g], 0):
                can_recompute[g] = False
        ncol = 0
        self.P = np.where(can_page, np.arange(G), -1); ncol = G
        self.C = np.full(G, -1, dtype=np.int64)
        self.C[can_recompute] = ncol + np.arange(int(can_recompute.sum())); ncol += int(can_recompute.sum())
        self.X = ncol + np.arange(len(x_keys), dtype=np.int64); ncol += len(x_keys)
        self.x_keys = x_keys
        paged_tensors = sorted({int(owner[g]) for g in range(G)}) if allow_paging else []
        self.O = np.full(T, -1, dtype=np.int64)
        self.O[paged_tensors] = ncol + np.arange(len(paged_tensors)); ncol += len(paged_tensors)
        n = ncol

        c = np.zeros(n)
        pg = np.flatnonzero(self.P >= 0)
        c[self.P[pg]] = costs.page_in_j[self.owner[pg]]
        cg = np.flatnonzero(self.C >= 0)
        c[self.C[cg]] = costs.compute_j[self.owner[cg]]
        c[self.O[paged_tensors]] = costs.page_out_j[paged_tensors]
        x_b = np.array([b for b, _ in x_keys], dtype=np.int64)
        x_d = np.array([d for _, d in x_keys], dtype=np.int64)
        c[self.X] = costs.compute_j[x_d]

        rows, cols, vals, lo, hi = [], [], [], [], []
        r = 0

        def add(rc, lo_, hi_):
            nonlocal r
            for col, v in rc:
                if col >= 0:
                    rows.append(r), cols.append(col), vals.append(v)
            lo.append(lo_), hi.append(hi_)
            r += 1

        for g in range(G):  # one way back per gap; a page-in needs the page-out
            add([(self.P[g], 1.0), (self.C[g], 1.0)], -np.inf, 1.0)
            if self.P[g] >= 0:
                add([(self.P[g], 1.0), (self.O[owner[g]], -1.0)], -np.inf, 0.0)
        for (kind, j), h, xk in needs:  # each input of a recomputation present in its stage
            v = self.C[j] if kind == "C" else self.X[j]
            x = self.X[xk] if xk >= 0 else -1
            if h >= 0:  # kept across h (neither paged in nor recomputed after it), or chained
                add([(v, 1.0), (x, -1.0), (self.P[h], 1.0), (self.C[h], 1.0)], -np.inf, 1.0)
            else:
                add([(v, 1.0), (x, -1.0)], -np.inf, 0.0)
        for k, (b, d) in enumerate(x_keys):  # never recompute what is kept in RAM anyway
            h = gap_holding(d, b)
            if h is not None and h >= 0:
                add([(self.X[k], 1.0), (self.P[h], -1.0), (self.C[h], -1.0)], -np.inf, 0.0)
        # RAM per stage, in units of the budget: plain use minus what the dropped gaps free
        unit = float(budgets.ram_bytes)
        mem_row0 = r
        lengths = self.gap_b - self.gap_a - 1
        g_rep = np.repeat(np.arange(G), lengths)
        t_rep = np.concatenate([np.arange(a + 1, b) for a, b in zip(gap_a, gap_b)]) if G else np.zeros(0, int)
        A_rows = [np.array(rows, dtype=np.int64)]
        A_cols = [np.array(cols, dtype=np.int64)]
        A_vals = [np.array(vals, dtype=float)]
        for colmap in (self.P, self.C):
            present = colmap[g_rep] >= 0
            A_rows.append(mem_row0 + t_rep[present])
            A_cols.append(colmap[g_rep[present]])
            A_vals.append(-size[owner_arr := self.owner][g_rep[present]] / unit)
        A_rows.append(mem_row0 + x_b)
        A_cols.append(self.X)
        A_vals.append(size[x_d] / unit)
        lo.extend([-np.inf] * T)
        hi.extend(((unit - self.plain_live) / unit).tolist())
        r += T
        extra_r, extra_c, extra_v = [], [], []
        plain_s = float(costs.compute_s.sum())
        if np.isfinite(budgets.runtime_s):
            run = [(self.P[pg], costs.page_in_s[owner_arr[pg]]), (self.C[cg], costs.compute_s[owner_arr[cg]]),
                   (self.X, costs.compute_s[x_d]),
                   (self.O[paged_tensors], costs.page_out_s[paged_tensors])]
            scale = plain_s if plain_s > 0 else 1.0
            for cl, v in run:
                extra_r.append(np.full(len(cl), r)), extra_c.append(cl), extra_v.append(np.asarray(v) / scale)
            lo.append(-np.inf), hi.append((budgets.runtime_s - plain_s) / scale)
            r += 1
        limits = storage_limits(costs, budgets) if paged_tensors else []
        no_storage = any(limit <= 0 for _, limit in limits)  # a wear budget that forbids paging
        for per_tensor, limit in ([] if no_storage else limits):
            extra_r.append(np.full(len(paged_tensors), r)), extra_c.append(self.O[paged_tensors])
            extra_v.append(per_tensor[paged_tensors] / limit)
            lo.append(-np.inf), hi.append(1.0)
            r += 1
        A = sp.csr_matrix((np.concatenate(A_vals + extra_v), (np.concatenate(A_rows + extra_r),
                                                              np.concatenate(A_cols + extra_c))), shape=(r, n))
        ub = np.ones(n)
        ub[self.X[sorted(x_dead)]] = 0.0
        if no_storage:
            ub[self.O[paged_tensors]] = 0.0
        self.milp = Milp(c=c, offset=float(costs.compute_j.sum()), A=A, row_lb=np.array(lo), row_ub=np.array(hi),
                         lb=np.zeros(n), ub=ub, integrality=np.ones(n, dtype=np.int8))

    def decode(self, x: np.ndarray) -> Decisions:
        on = np.asarray(x) > 0.5
        T = len(self.graph)
        recompute, page_in, page_out = set(), set(), set()
        gone: dict[int, list[tuple[int, int]]] = {}
        for g in range(len(self.owner)):
            i, a, b = int(self.owner[g]), int(self.gap_a[g]), int(self.gap_b[g])
            if self.P[g] >= 0 and on[self.P[g]]:
                page_in.add((b, i)), page_out.add(i)
            elif self.C[g] >= 0 and on[self.C[g]]:
                recompute.add((b, i))
            else:
                continue
            gone.setdefault(i, []).append((a, b))
        recompute.update(key for k, key in enumerate(self.x_keys) if on[self.X[k]])
        keep = set()
        for i in range(T):
            away = {t for a, b in gone.get(i, ()) for t in range(a + 1, b + 1)}
            keep.update((t, i) for t in range(i + 1, self.last[i] + 1) if t not in away)
        return Decisions(frozenset(recompute), frozenset(page_in), frozenset(page_out), frozenset(keep))


# The gap MILP searches to a gap of 1e-6 but may settle (backends.Settle) once within 1e-4, where it
# used to stop: past 1e-4 it still finds cheaper plans for a while, and those were the plans by which
# CP-SAT ended below the default path on MobileNetV2 and on the 100-node layered graph at 70% (joint)
# (0.0002%-0.009%, benchmarks/HARD.md, "Primal"), for 0.03-2.2 s more; it stops once they stop coming.
# The order screen (driver._screen_orders) still stops at 1e-4: it only ranks orders by these plans.
GAP = 1e-6
SETTLE = Settle(gap=1e-4)


def gap_milp_plan(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *,
                  time_limit: float, threads: Optional[int] = None, gap: float = GAP,
                  settle: Optional[Settle] = SETTLE) -> Optional[Decisions]:
    """The cheapest plan of the gap space the solver finds within the time limit (checked by replay),
    or None. ``settle``: when it may stop short of ``gap`` (None: only at ``gap`` or the limit)."""
    if mode == "none":
        return None
    try:
        model = GapMilp(graph, costs, budgets, mode)
    except TooLarge:
        return None
    try:
        result = solve_milp(model.milp, time_limit=time_limit, gap=gap, threads=threads, settle=settle)
    except (ValueError, RuntimeError):
        # HiGHS 1.15 aborts on a few tiny instances ("vector::reserve" in its MIP presolve, e.g.
        # random_training_graph(7, 8192) on nrf52840 with a binding runtime budget). This model only
        # proposes a start: without it the full MILP still runs.
        return None
    if result.x is None:
        return None
    decisions = model.decode(result.x)
    totals = totals_of(graph, costs, build_steps(graph, decisions))
    if (totals["peak_ram_bytes"] > budgets.ram_bytes or totals["runtime_s"] > budgets.runtime_s
            or totals["storage_bytes"] > budgets.storage_bytes):
        return None
    return decisions
