"""A compact MILP over a restricted plan space, for good incumbents on large graphs fast.

The space is the gap heuristic's (heuristics.gap_plan), solved exactly instead of greedily: from plain
training, each tensor may leave RAM in a *gap* between two consecutive stages that touch it (the
stage that makes it, and those that read it) and come back for the stage after the gap, by a page-in
(the tensor is paged out once, right after it is made) or by recomputing it there when it is a
forward node whose inputs are in RAM in that stage, or are themselves recomputed there first (chains
up to CHAIN_DEPTH links). With recomputation it may also come back *early*, at a stage inside the
gap where a reader of it may itself come back (up to MAX_EARLY_RETURNS per gap), and stay until the
gap ends, so that the reader's recomputation there can read it. Binaries: two per way back, one
page-out per tensor and one per chain link, a small multiple of |E|, against O(T^2) in the full
formulation; rows: one per stage for RAM, one per (recomputation, input), and the runtime and
storage budgets.

Why a RAM row per stage suffices: whatever is paged in or recomputed at a gap's end is read by that
stage's node, what comes back early is kept, and everything else resident is read by the node or
kept, so nothing of that is freed before the node runs, where the stage's sum is reached. Chain
links may be freed earlier than that (after their last reader in the stage); the row counts them
until the node runs, an over-estimate, so the replayed peak never exceeds the row.

Every plan of this space is a plan of the full formulation, so its optimum is a valid schedule and a
MIP start for the full MILP; but the full space is larger (longer chains, returns at any stage,
no over-counted chain links), so this model's own bound is NOT a bound for the problem and is never
reported as one.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, build_steps, storage_limits, totals_of
from poet_opt.solver.backends import Settle, solve_milp
from poet_opt.solver.formulation import Milp

CHAIN_DEPTH = 4
# Stages inside one gap where its tensor may come back early (GapMilp): at most this many, the latest
MAX_EARLY_RETURNS = 6
# The first solve's share of the time limit (gap_milp_plan)
EARLY_FREE_SHARE = 0.5
MAX_RAM_ROW_ENTRIES = 20_000_000


class TooLarge(Exception):
    """The model would not be built within memory and time worth spending on a start."""


class GapMilp:
    def __init__(self, graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str = "joint",
                 early_returns: int = MAX_EARLY_RETURNS):
        self.graph, self.costs, self.budgets = graph, costs, budgets
        allow_paging, allow_remat = mode in ("joint", "paging"), mode in ("joint", "remat")
        nodes, T = graph.nodes, len(graph)
        size = np.array([n.bytes for n in nodes], dtype=float)
        users, self.last = graph.users(), graph.last_use()
        live = np.zeros(T + 1)
        owner, gap_a, gap_b = [], [], []
        for i in range(T):
            live[i] += size[i]
            live[self.last[i] + 1] -= size[i]
            tch = sorted({i, *users[i]})
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

        # Where a dropped tensor may come back: the stage that ends its gap, where it is read, and
        # (with recomputation) stages inside the gap where a recomputation of one of its readers may
        # need it, from where it stays until the gap ends. So a plan may recompute a tensor at stage
        # 400 for a reader recomputed there and keep it for its own read at 441, instead of keeping it
        # from the forward pass on or recomputing it twice (the plans by which CP-SAT ended below this
        # model on random layered graphs, benchmarks/HARD.md).
        stages_of: list[list[int]] = [[int(b)] for b in gap_b]  # per gap, ascending, the gap's end last
        if allow_remat and early_returns > 0:
            comes_back: dict[int, set[int]] = {}  # tensor -> stages where some gap of it may end
            for i in range(T - 1, -1, -1):  # readers come after what they read
                wanted = set()
                for j in users[i]:
                    if not nodes[j].is_backward:
                        wanted |= comes_back.get(j, set())
                for g in gaps_of.get(i, ()):
                    # the latest: they hold RAM the shortest
                    inside = sorted(t for t in wanted if gap_a[g] < t < gap_b[g])
                    stages_of[g] = inside[max(0, len(inside) - early_returns):] + stages_of[g]
                    comes_back.setdefault(i, set()).update(stages_of[g])
        # returns q: (gap, stage) pairs, each gap's in ascending stage order, its end last
        self.ret_gap = np.array([g for g in range(G) for _ in stages_of[g]], dtype=np.int64)
        self.ret_stage = np.array([t for g in range(G) for t in stages_of[g]], dtype=np.int64)
        first_ret = np.concatenate([[0], np.cumsum([len(st) for st in stages_of])]).astype(np.int64)
        R = len(self.ret_gap)
        ret_owner = self.owner[self.ret_gap] if R else np.zeros(0, dtype=np.int64)

        # A recomputation in stage b needs each input in RAM there: touched in b, kept across its gap
        # over b or back in it already, or itself recomputed in b first (a chain, up to CHAIN_DEPTH
        # deep; X[b,d]). Chain links are counted in stage b's RAM row as if they stayed until node b
        # runs: the replay frees them earlier, never later, so the row over-estimates and plans stay
        # within budget.
        x_index: dict[tuple[int, int], int] = {}
        x_keys: list[tuple[int, int]] = []
        x_dead: set[int] = set()
        needs = []  # (("C", q) or ("X", k), stage, gap holding the input or -1 when gone, X id or -1)

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
                needs.append((consumer, b, -1 if h is None else h, xk))
            return True

        can_page = np.full(R, allow_paging)
        can_recompute = np.array([allow_remat and not nodes[i].is_backward for i in ret_owner], dtype=bool)
        for q in np.flatnonzero(can_recompute):
            if not inputs_present(("C", q), ret_owner[q], self.ret_stage[q], 0):
                can_recompute[q] = False
        ncol = 0

        def columns(count):
            nonlocal ncol
            ncol += count
            return np.arange(ncol - count, ncol, dtype=np.int64)

        # Columns: P[q] page in at return q, C[q] recompute there, X[k] chain links, O[i] page i out,
        # and, before each early return q, Away[q] (continuous): the tensor is away there, i.e. comes
        # back at q or later. Stages before a gap's end return see P + C of that return instead.
        self.P = np.full(R, -1, dtype=np.int64)
        self.P[can_page] = columns(int(can_page.sum()))
        self.C = np.full(R, -1, dtype=np.int64)
        self.C[can_recompute] = columns(int(can_recompute.sum()))
        self.X = columns(len(x_keys))
        self.x_keys = x_keys
        paged_tensors = sorted({int(owner[g]) for g in range(G)}) if allow_paging else []
        self.O = np.full(T, -1, dtype=np.int64)
        self.O[paged_tensors] = columns(len(paged_tensors))
        is_early = np.ones(R, dtype=bool)
        is_early[first_ret[1:] - 1] = False
        away = np.full(R, -1, dtype=np.int64)
        away[is_early] = columns(int(is_early.sum()))
        self.away = away
        n = ncol

        def away_terms(q):
            """'The tensor is still away just before return q', as (column, coefficient) terms."""
            return [(away[q], 1.0)] if away[q] >= 0 else [(self.P[q], 1.0), (self.C[q], 1.0)]

        def away_at(h, t):
            """The terms of 'gap h's tensor is not in RAM at stage t' (t inside h)."""
            stages = self.ret_stage[first_ret[h]:first_ret[h + 1]]
            return away_terms(first_ret[h] + int(np.searchsorted(stages, t, side="right")))

        c = np.zeros(n)
        pq = np.flatnonzero(self.P >= 0)
        c[self.P[pq]] = costs.page_in_j[ret_owner[pq]]
        cq = np.flatnonzero(self.C >= 0)
        c[self.C[cq]] = costs.compute_j[ret_owner[cq]]
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
            qs = range(first_ret[g], first_ret[g + 1])
            add([(self.P[q], 1.0) for q in qs] + [(self.C[q], 1.0) for q in qs], -np.inf, 1.0)
            if allow_paging:
                add([(self.P[q], 1.0) for q in qs] + [(self.O[owner[g]], -1.0)], -np.inf, 0.0)
            for q in qs[:-1]:  # away before q: back at q, or still away before the next return
                add([(away[q], 1.0), (self.P[q], -1.0), (self.C[q], -1.0),
                     *((col, -v) for col, v in away_terms(q + 1))], 0.0, 0.0)
        for (kind, j), t, h, xk in needs:  # each input of a recomputation present in its stage
            v = self.C[j] if kind == "C" else self.X[j]
            x = self.X[xk] if xk >= 0 else -1
            if h >= 0:  # kept across h up to t (or back already), or chained
                add([(v, 1.0), (x, -1.0), *away_at(h, t)], -np.inf, 1.0)
            else:
                add([(v, 1.0), (x, -1.0)], -np.inf, 0.0)
        for k, (b, d) in enumerate(x_keys):  # never recompute what is in RAM anyway
            h = gap_holding(d, b)
            if h is not None and h >= 0:
                add([(self.X[k], 1.0), *((col, -v) for col, v in away_at(h, b))], -np.inf, 0.0)
        # RAM per stage, in units of the budget: plain use minus what is away in the dropped gaps.
        # Return q's "away" covers the stages from the previous return of its gap (or the gap's start).
        unit = float(budgets.ram_bytes)
        mem_row0 = r
        seg_from = np.empty(R, dtype=np.int64)
        for g in range(G):
            qs = np.arange(first_ret[g], first_ret[g + 1])
            seg_from[qs] = np.concatenate([[gap_a[g] + 1], self.ret_stage[qs[:-1]]])
        q_rep = np.repeat(np.arange(R), self.ret_stage - seg_from)
        t_rep = np.concatenate([np.arange(a, b) for a, b in zip(seg_from, self.ret_stage)]) if R else np.zeros(0, int)
        A_rows = [np.array(rows, dtype=np.int64)]
        A_cols = [np.array(cols, dtype=np.int64)]
        A_vals = [np.array(vals, dtype=float)]
        early_rep = is_early[q_rep]
        for colmap, which in ((away, early_rep), (self.P, ~early_rep), (self.C, ~early_rep)):
            present = which & (colmap[q_rep] >= 0)
            A_rows.append(mem_row0 + t_rep[present])
            A_cols.append(colmap[q_rep[present]])
            A_vals.append(-size[ret_owner[q_rep[present]]] / unit)
        A_rows.append(mem_row0 + x_b)
        A_cols.append(self.X)
        A_vals.append(size[x_d] / unit)
        lo.extend([-np.inf] * T)
        hi.extend(((unit - self.plain_live) / unit).tolist())
        r += T
        extra_r, extra_c, extra_v = [], [], []
        plain_s = float(costs.compute_s.sum())
        if np.isfinite(budgets.runtime_s):
            run = [(self.P[pq], costs.page_in_s[ret_owner[pq]]), (self.C[cq], costs.compute_s[ret_owner[cq]]),
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
        integrality = np.ones(n, dtype=np.int8)
        integrality[away[is_early]] = 0  # a sum of binaries by its row: integral wherever they are
        self.milp = Milp(c=c, offset=float(costs.compute_j.sum()), A=A, row_lb=np.array(lo), row_ub=np.array(hi),
                         lb=np.zeros(n), ub=ub, integrality=integrality)

    @property
    def has_early_returns(self) -> bool:
        return bool((self.away >= 0).any())

    def encode(self, decisions: Decisions) -> Optional[np.ndarray]:
        """The point of this model that decodes to ``decisions``, or None when the plan is not in its
        space (a MIP start: the plan of a smaller space, say)."""
        x = np.zeros(self.milp.num_vars)
        returned = set()
        for q in range(len(self.ret_gap)):
            g, t = int(self.ret_gap[q]), int(self.ret_stage[q])
            i = int(self.owner[g])
            if (t, i) in decisions.page_in:
                col = self.P[q]
            elif (t, i) in decisions.recompute and (t == self.gap_b[g] or (t + 1, i) in decisions.keep):
                col = self.C[q]
            else:
                continue
            if col < 0:
                return None
            x[col] = 1.0
            returned.add((t, i))
        index = {key: k for k, key in enumerate(self.x_keys)}
        for key in decisions.recompute - returned:
            if key not in index:
                return None
            x[self.X[index[key]]] = 1.0
        for i in decisions.page_out:
            if self.O[i] < 0:
                return None
            x[self.O[i]] = 1.0
        def value(col):
            return x[col] if col >= 0 else 0.0

        for q in range(len(self.ret_gap) - 1, -1, -1):  # away before q: back at q or later in its gap
            if self.away[q] >= 0:
                later = value(self.away[q + 1]) if self.away[q + 1] >= 0 else \
                    value(self.P[q + 1]) + value(self.C[q + 1])
                x[self.away[q]] = value(self.P[q]) + value(self.C[q]) + later
        return x if self.decode(x) == decisions else None

    def decode(self, x: np.ndarray) -> Decisions:
        on = np.asarray(x) > 0.5
        T = len(self.graph)
        recompute, page_in, page_out = set(), set(), set()
        gone: dict[int, list[tuple[int, int]]] = {}
        for q in range(len(self.ret_gap)):
            g, t = int(self.ret_gap[q]), int(self.ret_stage[q])
            i, a = int(self.owner[g]), int(self.gap_a[g])
            if self.P[q] >= 0 and on[self.P[q]]:
                page_in.add((t, i)), page_out.add(i)
            elif self.C[q] >= 0 and on[self.C[q]]:
                recompute.add((t, i))
            else:
                continue
            gone.setdefault(i, []).append((a, t))
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


# Streamed graphs past this many nodes get no gap MILP where the full MILP is skipped: on ResNet-18's
# strips (9,350 nodes) its model builds in about 30 s and HiGHS had no plan from it after 90, 120 or
# 210 s, even with the spill plan as start, while the residency bound, which needs that time, reached
# only its first LP in a 300 s solve on a loaded machine.
STREAMED_MAX_NODES = 2_500


def within_reach(graph: TrainingGraph, full_skipped: bool) -> bool:
    """Whether the gap MILP is worth its time on this graph (see STREAMED_MAX_NODES)."""
    return not (full_skipped and graph.streams_weights and len(graph) > STREAMED_MAX_NODES)


def gap_milp_plan(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *,
                  time_limit: float, threads: Optional[int] = None, gap: float = GAP,
                  settle: Optional[Settle] = SETTLE, first_share: float = EARLY_FREE_SHARE) -> Optional[Decisions]:
    """The cheapest plan of the gap space the solver finds within the time limit (checked by replay),
    or None. ``settle``: when it may stop short of ``gap`` (None: only at ``gap`` or the limit).

    Two solves: the space without early returns first (a third of the columns on the layered graphs,
    where HiGHS settles sooner and lower), then the whole space started from that plan, so the
    second never ends above the first. ``first_share``: the first solve's share of the time limit
    (the driver gives it more where the full MILP is skipped: on l1000 at 70% of its peak, remat, its
    first plan came after 43 s on a busy 2-core machine, and the second solve rarely adds to it)."""
    if mode == "none":
        return None
    began = time.perf_counter()
    best = None
    for early_returns in (0, MAX_EARLY_RETURNS):
        left = time_limit - (time.perf_counter() - began)
        if left <= 0.05:
            break
        try:
            model = GapMilp(graph, costs, budgets, mode, early_returns=early_returns)
        except TooLarge:
            break
        if early_returns and not model.has_early_returns:
            break
        start = None if best is None else model.encode(best)
        try:
            result = solve_milp(model.milp, time_limit=left * (first_share if not early_returns else 1.0),
                                gap=gap, threads=threads, settle=settle, start=start)
        except (ValueError, RuntimeError):
            # HiGHS 1.15 aborts on a few tiny instances ("vector::reserve" in its MIP presolve, e.g.
            # random_training_graph(7, 8192) on nrf52840 with a binding runtime budget). This model
            # only proposes a start: without it the full MILP still runs.
            continue
        if result.x is None:
            continue
        decisions = model.decode(result.x)
        totals = totals_of(graph, costs, build_steps(graph, decisions))
        if (totals["peak_ram_bytes"] > budgets.ram_bytes or totals["runtime_s"] > budgets.runtime_s
                or totals["storage_bytes"] > budgets.storage_bytes):
            continue
        if best is None or totals["energy_j"] <= totals_of(graph, costs, build_steps(graph, best))["energy_j"]:
            best = decisions
    return best
