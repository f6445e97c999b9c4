"""Joint rematerialization + paging as a MILP, assembled in bulk as sparse matrices.

Stages t = 0..T-1 follow the graph's topological order; stage t computes node t for the first time
and walks positions k = 0..t in order. At position k a stage may *materialize* tensor k, by
recomputing it (R[t,k]) or by paging it in from storage (Min[t,k]); node t itself is computed at
position t and may be paged out right away (Mout[t]). S[t,i] says tensor i is in RAM when stage t
starts. Memory is accounted per position, as in Checkmate: a tensor occupies RAM from the start of
the stage (if kept) or from its materialization, until its last reader in the stage, unless it is
kept for the next stage; FREE[t,i,k] = 1 lets the accounting release tensor i after position k.

Reductions that keep the optimum exact, each justified where it is made:
- backward nodes are recomputed only on graphs of up to BACKWARD_REMAT_MAX_NODES nodes (a restriction
  elsewhere, not a reduction: docs/formulation.md), and a node that updates weights never is;
- a tensor exists in a stage only up to the last stage in which anything could still read it;
- a tensor is paged out only right after its first computation: a later page-out of a copy that was
  kept in RAM all along costs the same and holds storage for less time, and a page-out of a
  recomputed copy is dominated by paging out the first;
- a tensor is materialized at most once per stage and never while already resident;
- given cost_cap (a known plan's energy above plain training), no action dearer than that exists;
- a stage that could not exceed the budget even holding everything it might hold gets no memory
  accounting at all.

Three families of rows add no rule but tighten the LP relaxation (tighten=True): (9) below, a knapsack
per stage boundary over the keep variables alone; (10), one page-out for all page-ins of a tensor;
and (11), something of an input kept for all recomputes of a tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, storage_limits
from poet_opt.solver.stage_index import Rows, StageIndex

MODES = ("joint", "remat", "paging", "none")


class WindowMismatch(ValueError):
    """The incumbent holds something a window model cannot represent: that window is skipped."""


@dataclass
class Milp:
    """min c.x + offset  s.t.  row_lb <= A x <= row_ub,  lb <= x <= ub,  x[integrality==1] integer."""

    c: np.ndarray
    offset: float
    A: sp.csr_matrix
    row_lb: np.ndarray
    row_ub: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray  # 1 = integer, 0 = continuous
    names: list[str] = field(default_factory=list)  # one per block, for messages

    @property
    def num_vars(self) -> int:
        return len(self.c)

    @property
    def num_rows(self) -> int:
        return self.A.shape[0]


# Up to this many nodes the stage model also recomputes gradients (a gradient dropped while a big
# activation is made and computed again from inputs still in RAM): exhaustive search over every
# step sequence finds small graphs whose cheapest plan, or only plan, needs it. It doubles the keep
# and recompute columns of a large graph, where it is left out (docs/formulation.md).
BACKWARD_REMAT_MAX_NODES = 32


def recomputes_gradients(graph: TrainingGraph, allow_remat: bool) -> bool:
    return allow_remat and len(graph) <= BACKWARD_REMAT_MAX_NODES


def _recomputable_kind(node, allow_remat: bool, gradients: bool) -> bool:
    if node.op == "param":  # reading weights again is no recompute
        return True
    if not allow_remat:
        return False
    if not node.is_backward:
        return True
    # an update has side effects (weights change): it runs exactly once
    return gradients and not node.updates and not node.op.endswith("_update")


def horizons(graph: TrainingGraph, allow_remat: bool,
             recomputable: np.ndarray | None = None, *, gradients: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """need[i]: the last stage in which tensor i may be read; compute[i]: the last stage in which
    node i may be computed (itself, or later when it can be recomputed for a reader).
    recomputable: an optional per-node mask of nodes the caller allows to be recomputed at all;
    gradients: backward nodes may be recomputed too (recomputes_gradients)."""
    n = len(graph)
    users = graph.users()
    need = np.arange(n)
    compute = np.arange(n)
    # weights read after their in-place update would be the new ones: no recompute past it
    cap = graph.last_compute_stage() if graph.streams_weights else None
    for i in range(n - 1, -1, -1):
        for j in users[i]:
            need[i] = max(need[i], compute[j])
        if _recomputable_kind(graph.nodes[i], allow_remat, gradients) and (recomputable is None or recomputable[i]):
            compute[i] = need[i] if cap is None else max(i, min(need[i], cap[i]))
    return need, compute


def decision_count(graph: TrainingGraph, mode: str) -> int:
    """How many binaries Formulation would have (recompute, page-in, keep, page-out), without
    building it: what decides whether the full MILP is worth building at all."""
    allow_remat, allow_paging = mode in ("joint", "remat"), mode in ("joint", "paging")
    need, comp = horizons(graph, allow_remat, gradients=recomputes_gradients(graph, allow_remat))
    ids = np.arange(len(graph))
    keep = int((need - ids).sum())
    recompute = int((comp - ids).sum())  # without remat, only streamed weights are read again
    paged = need > ids
    page = int((need - ids)[paged].sum() + paged.sum()) if allow_paging else 0
    return keep + recompute + page


class Formulation:
    """Builds the MILP for one (graph, costs, budgets, mode) and maps solutions back to decisions."""

    def __init__(self, graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str = "joint",
                 *, minimize_peak: bool = False, runtime_margin: float = 0.0, tighten: bool = True,
                 cost_cap: float | None = None, window: tuple[int, int] | None = None,
                 incumbent: Decisions | None = None, window_tensors: np.ndarray | None = None,
                 facts: tuple | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.graph, self.costs, self.budgets, self.mode = graph, costs, budgets, mode
        self.minimize_peak = minimize_peak
        self.runtime_margin = runtime_margin
        self.tighten = tighten  # add the valid inequalities (9)-(11): same optimum, tighter LP
        self.cost_cap = cost_cap  # joules above plain training that a plan worth finding may spend
        self.allow_remat = mode in ("joint", "remat")
        self.allow_paging = mode in ("joint", "paging")
        # Stages a..b only, with everything else fixed to ``incumbent`` (solver/lns.py): what it keeps
        # into stages a and b+1 and its page-outs are bounds, its actions in other stages constants.
        # window_tensors: only these tensors get columns there, every other one is left where the
        # incumbent has it, which must be nowhere in RAM in the window (else WindowMismatch).
        self.window, self.incumbent, self.window_tensors = window, incumbent, window_tensors
        # facts: (need, compute, users) of horizons() and graph.users(), from a caller that builds many
        # models of one graph (a window search); only without cost_cap, which changes the horizons
        self.facts = facts if cost_cap is None else None
        if window is not None and incumbent is None:
            raise ValueError("a window needs the incumbent plan that fixes the other stages")
        self.milp = self._build()

    # -- variable layout ---------------------------------------------------------------------
    def _build(self) -> Milp:
        g, costs, T = self.graph, self.costs, len(self.graph)
        # Every action costs energy on top of plain training's (a constant), so with a plan of extra
        # energy cost_cap in hand, no action dearer than that can be part of a plan at least as good:
        # it is left out of the model (and a tensor that cannot be recomputed stops widening the
        # horizons of its inputs). The optimum is unchanged; the model may shrink a lot.
        cap = np.inf if self.cost_cap is None else float(self.cost_cap)
        recomputable = costs.compute_j <= cap
        pageable = costs.page_out_j + costs.page_in_j <= cap
        # streamed weights are on storage already: re-reading them is their "recompute"
        pageable &= np.array([node.op != "param" for node in g.nodes], dtype=bool)
        if self.facts is None:
            gradients = recomputes_gradients(g, self.allow_remat)
            need, comp = horizons(g, self.allow_remat, recomputable, gradients=gradients)
        else:
            need, comp = self.facts[:2]
        self._last_compute = comp
        # Memory rows count in units of the RAM budget, not bytes: next to 0/1 variables, byte-sized
        # coefficients (up to 1e8) left HiGHS numerically fragile, up to wrongly claimed optima.
        self.mem_unit = (float(self.budgets.ram_bytes) if np.isfinite(self.budgets.ram_bytes)
                         else float(max(g.plain_peak_bytes(), 1)))
        nbytes = np.array([node.bytes for node in g.nodes], dtype=float) / self.mem_unit
        users = g.users() if self.facts is None else self.facts[2]
        deps = [np.array(node.deps, dtype=np.int64) for node in g.nodes]
        ncols = 0

        def alloc(mask_count):
            nonlocal ncols
            start = ncols
            ncols += mask_count
            return np.arange(start, ncols)

        # The model's stages and tensors: all of them, or in a window a..b its stages (keeps into b+1
        # too) and the tensors that exist there, made by stage b and readable in stage a or later.
        # Column families are indexed over those alone (StageIndex), so a window costs what it holds.
        a, b = self.window if self.window is not None else (0, T - 1)
        ids = np.arange(T)
        exists = (ids <= b) & (need >= a)
        if self.window_tensors is not None:
            exists &= np.isin(ids, self.window_tensors) | (ids >= a)  # the window's own nodes always
        tensors = ids if self.window is None else np.flatnonzero(exists)
        rows_n = T + 1 if self.window is None else b + 2 - a

        def index():
            return StageIndex(a, rows_n, tensors, T)

        self.R, self.Min, self.S = index(), index(), index()
        tl, il = self.R.stages(), tensors[None, :]  # global stage and tensor of each cell
        earlier = il < tl  # i < t
        staged = tl <= b  # a stage the model decides (not the keeps into b+1)

        # R[t,i], i < t: recompute, only for nodes that may be computed after their own stage.
        r_mask = earlier & (tl <= comp[il]) & staged  # without remat, comp allows only streamed weights read again
        self.R.assign(r_mask, alloc(int(r_mask.sum())))

        # Mout[i]: paging out is useful only for a tensor read in some later stage. A window has the
        # column only for its own tensors; the rest are the incumbent's, constants (_fix_outside).
        self._mo_any = (need > ids) & pageable if self.allow_paging else np.zeros(T, dtype=bool)
        mo_mask = self._mo_any & (self.R.loc >= 0)
        self.Mout = np.full(T, -1, dtype=np.int64)
        self.Mout[mo_mask] = alloc(int(mo_mask.sum()))
        self._fixed_outs = np.zeros(0, dtype=np.int64)  # a window's constant page-outs (_fix_outside)

        # Min[t,i], i < t: page in, while something could still read it.
        mi_mask = earlier & (tl <= need[il]) & mo_mask[il] & staged
        self.Min.assign(mi_mask, alloc(int(mi_mask.sum())))

        # S[t,i], i < t <= need[i]: in RAM at the start of stage t.
        s_mask = earlier & (tl <= need[il])
        self.S.assign(s_mask, alloc(int(s_mask.sum())))

        # computable[t,k]: node k may be computed in stage t (k == t, or a recompute variable exists)
        own_r, own_l = ids[a:b + 1] - a, self.R.loc[ids[a:b + 1]]  # (row, local) of node t in stage t
        computable = self.R.cols >= 0
        computable[own_r, own_l] = True
        materializable = computable | (self.Min.cols >= 0)
        # A stage whose every tensor that could be in RAM at all fits the budget together can never
        # break it: it needs no memory accounting (no U chain, no releases, no boundary row). At 0.7 of
        # the peak that is over half the stages of the 100-node random graph.
        could_hold = (materializable | (self.S.cols >= 0)).astype(float) @ nbytes[tensors]
        self.accounted = np.zeros(T, dtype=bool)
        self.accounted[a:b + 1] = True if self.minimize_peak else could_hold[:b + 1 - a] > 1.0 - 1e-9
        accounted_rows = np.append(self.accounted, False)[tl]  # per cell of the index arrays

        # FREE[t,i,k]: release i after position k of stage t. Candidates: k reads i, or k == i
        # (a tensor nobody reads later in the stage goes right after it is made).
        # A later reader of i that is node t itself (always computed) rules the release out.
        # Built in bulk: each computable (t, k) repeated once per input of k and once for k itself.
        n_deps = np.array([len(d) for d in deps], dtype=np.int64)
        dep_start = np.concatenate([[0], np.cumsum(n_deps)[:-1]]).astype(np.int64)
        dep_flat = np.concatenate(deps).astype(np.int64) if T else np.zeros(0, dtype=np.int64)
        edges = np.unique(np.repeat(ids, n_deps) * T + dep_flat)  # reads(t, i): node t reads tensor i

        def reads(t, i):
            return np.isin(t * T + i, edges)

        ct, ck = self.R.to_global(*np.nonzero(computable))
        fct, fck = self.R.to_global(*np.nonzero(computable & accounted_rows))
        per_pair = n_deps[fck] + 1
        f_t, f_k = np.repeat(fct, per_pair), np.repeat(fck, per_pair)
        within = np.arange(int(per_pair.sum())) - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
        is_self = within == n_deps[f_k]
        f_i = np.where(is_self, f_k, dep_flat[np.minimum(dep_start[f_k] + within, max(len(dep_flat) - 1, 0))]
                       if len(dep_flat) else f_k)
        ok = ~(reads(f_t, f_i) & (f_t > f_k))
        self.F_t, self.F_i, self.F_k = f_t[ok], f_i[ok], f_k[ok]
        self.F = alloc(int(ok.sum()))

        # U at every materializable position of every stage (continuous, in units of mem_unit).
        u_t, u_k = self.R.to_global(*np.nonzero(materializable & accounted_rows))
        self.U_t, self.U_k = u_t, u_k
        self.U = alloc(len(u_t))
        self.B = alloc(1)[0] if self.minimize_peak else -1
        # Q[t,i] = sum over stages w >= t of R[w,i]: suffix sums that rows (10) and (11) use in place
        # of a long run of recompute terms (a chain of two-term rows instead of O(T) terms per row).
        # Only for tensors with more recompute variables than it pays to list.
        self.Q = index()
        if self.tighten and not self.minimize_peak:
            long_runs = (self.R.cols >= 0) & ((self.R.cols >= 0).sum(axis=0) > DIRECT_RECOMPUTE_TERMS)[None, :]
            self.Q.assign(long_runs, alloc(int(long_runs.sum())))
        n_vars = ncols

        # -- bounds, objective -----------------------------------------------------------------
        lb = np.zeros(n_vars)
        ub = np.ones(n_vars)
        integrality = np.ones(n_vars, dtype=np.int8)
        ram_cap = np.inf if self.minimize_peak else 1.0
        ub[self.U] = ram_cap
        integrality[self.U] = 0
        q_cols = self.Q.cols[self.Q.cols >= 0]
        ub[q_cols] = np.inf
        integrality[q_cols] = 0
        # Releases stay binary. Continuous would be exact too (each is bounded above by binaries only, so
        # at any integral choice its best value is 0 or 1 already), but then the memory rows mix binaries
        # with continuous terms and HiGHS finds few cuts and poor incumbents on them: on the 100-node
        # random graph at half the peak (60 s, benchmarks/SCALE.md) binary releases end 0.3% lower in
        # energy with a higher proven bound; presolve marks most of them implied-integer anyway.
        # The smallest-budget MILP (minimize_peak) was not measured and keeps them continuous.
        if self.minimize_peak:
            integrality[self.F] = 0
        if self.minimize_peak:
            ub[self.B] = np.inf
            integrality[self.B] = 0

        c = np.zeros(n_vars)
        rr, ri = self.R.pairs()
        c[self.R[rr, ri]] = costs.compute_j[ri]
        mr, mi = self.Min.pairs()
        c[self.Min[mr, mi]] = costs.page_in_j[mi]
        mo = np.flatnonzero(self.Mout >= 0)
        c[self.Mout[mo]] = costs.page_out_j[mo]
        offset = float(costs.compute_j.sum())
        outside_s = 0.0
        if self.window is not None:
            offset, outside_s = self._fix_outside(lb, ub, offset)
        if self.minimize_peak:
            # Smallest budget first; energy only breaks ties, scaled far below one byte.
            energy_scale = 0.01 / self.mem_unit / max(1e-30, float(costs.compute_j.sum()) * 10 + c.sum())
            c *= energy_scale
            offset *= energy_scale
            c[self.B] = 1.0

        rows = Rows()

        # (1) a node computed in stage t has each input kept, recomputed or paged in, in stage t
        #     R[t,d] + Min[t,d] + S[t,d] - R[t,k] >= 0   (R[t,t] = 1 as a constant), one row per (t, k, d),
        #     built for all pairs at once: each computable (t, k) repeated once per input d of k.
        per_pair = n_deps[ck]
        rt, rk = np.repeat(ct, per_pair), np.repeat(ck, per_pair)
        within = np.arange(int(per_pair.sum())) - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
        rd = dep_flat[np.repeat(dep_start[ck], per_pair) + within]
        own = rk == rt
        rows.add([(self.R[rt, rd], 1.0), (self.Min[rt, rd], 1.0), (self.S[rt, rd], 1.0),
                  (np.where(own, -1, self.R[rt, rk]), -1.0)],
                 np.where(own, 1.0, 0.0), np.inf)

        # (2) kept into stage t+1 only if resident during stage t:  S[t+1,i] <= S[t,i] + R[t,i] + Min[t,i]
        st, si = self.S.pairs(self.S.stages() >= 1)  # stage of the kept copy
        prev = st - 1
        later = (prev > si) & (prev >= a)  # at prev == i the node was just computed: always possible
        rows.add([(self.S[st[later], si[later]], 1.0), (self.S[prev[later], si[later]], -1.0),
                  (self.R[prev[later], si[later]], -1.0), (self.Min[prev[later], si[later]], -1.0)],
                 -np.inf, 0.0)

        # (3) at most one of kept / recomputed / paged in per stage
        tt2, ii2 = self.S.pairs((self.R.cols >= 0) | (self.Min.cols >= 0))
        rows.add([(self.S[tt2, ii2], 1.0), (self.R[tt2, ii2], 1.0), (self.Min[tt2, ii2], 1.0)], -np.inf, 1.0)

        # (4) page in only what was paged out
        rows.add([(self.Min[mr, mi], 1.0), (self.Mout[mi], -1.0)], -np.inf, 0.0)

        # (5) release i after position k only if k runs, i is not kept, and no later reader runs
        F, Ft, Fi, Fk = self.F, self.F_t, self.F_i, self.F_k
        runs_k = np.where(Fk == Ft, -1, self.R[Ft, Fk])  # k == t always runs: no row needed
        self_release = Fi == Fk
        mat_i = np.where(self_release, self.Min[Ft, Fi], -1)
        need_row = Fk != Ft
        rows.add([(F[need_row], 1.0), (runs_k[need_row], -1.0), (mat_i[need_row], -1.0)], -np.inf, 0.0)
        kept_next = self.S[np.minimum(Ft + 1, T), Fi]
        has_keep = kept_next >= 0
        rows.add([(F[has_keep], 1.0), (kept_next[has_keep], 1.0)], -np.inf, 1.0)
        n_users = np.array([len(u) for u in users], dtype=np.int64)
        user_start = np.concatenate([[0], np.cumsum(n_users)[:-1]]).astype(np.int64)
        user_flat = np.concatenate([np.array(u, dtype=np.int64) for u in users]) if T else np.zeros(0, np.int64)
        per_f = n_users[Fi]
        lf = np.repeat(np.arange(len(F)), per_f)
        lwithin = np.arange(int(per_f.sum())) - np.repeat(np.cumsum(per_f) - per_f, per_f)
        lj = user_flat[np.repeat(user_start[Fi], per_f) + lwithin] if len(lf) else np.zeros(0, np.int64)
        lt, lk = Ft[lf], Fk[lf]
        lcol = np.where((lk < lj) & (lj < lt), self.R[lt, lj], -1)
        keep_l = lcol >= 0
        if keep_l.any():
            rows.add([(F[lf[keep_l]], 1.0), (lcol[keep_l], 1.0)], -np.inf, 1.0)

        # (6) memory: U at each materializable position, chained within a stage.
        #     U[t,p] = U[t,prev p] - released after positions in [prev p, p) + bytes(p) * materialized(p)
        #     the first position of a stage starts from the tensors kept into the stage.
        # Positions come sorted by stage, then position, so a position's predecessor in its stage is
        # the previous index when that has the same stage; node t's own bytes(t) go to the bounds.
        row_start = rows.count
        n_u = len(self.U)
        self._u_rows = (row_start, n_u)
        rows.add([(self.U, 1.0)], 0.0, 0.0)  # terms added below, row r <-> U[r]
        U_t, U_k = self.U_t, self.U_k
        u_rows = row_start + np.arange(n_u)
        other = U_k != U_t  # materialized at k by a recompute or a page-in
        for index in (self.R, self.Min):
            rows.add_sparse(u_rows[other], index[U_t[other], U_k[other]], -nbytes[U_k[other]])
        has_prev = np.zeros(n_u, dtype=bool)
        has_prev[1:] = U_t[1:] == U_t[:-1]
        rows.add_sparse(u_rows[has_prev], self.U[np.flatnonzero(has_prev) - 1], -1.0)
        # a release after position k of stage t lowers U at the next position of that stage
        u_at = StageIndex(a, rows_n, tensors, T)
        u_at.assign(materializable & accounted_rows, np.arange(n_u))  # U's order: the same cells
        f_pos = u_at[Ft, Fk]
        nxt = f_pos + 1
        counted = nxt < n_u
        counted[counted] &= U_t[np.minimum(nxt[counted], n_u - 1)] == Ft[counted]
        rows.add_sparse(row_start + nxt[counted], F[counted], nbytes[Fi[counted]])
        # the first position of a stage starts from the tensors kept into it
        first_row = np.full(T, -1, dtype=np.int64)
        first_row[U_t[~has_prev]] = u_rows[~has_prev]
        kt, ki = self.S.pairs(accounted_rows)
        rows.add_sparse(first_row[kt], self.S[kt, ki], -nbytes[ki])
        A, row_lb, row_ub = rows.matrix(n_vars)
        # constants: U[t,t] includes bytes(t) for the node computed in its own stage
        own = self.U_t == self.U_k
        row_lb[row_start:row_start + n_u][own] = nbytes[self.U_k[own]]
        row_ub[row_start:row_start + n_u][own] = nbytes[self.U_k[own]]

        extra = Rows()
        if self.minimize_peak:
            extra.add([(self.U, 1.0), (np.full(n_u, self.B), -1.0)], -np.inf, 0.0)

        # (7) runtime: compute, recompute and paging all count. The optimum may sit exactly on the
        #     budget; runtime_margin (relative) leaves room for solver tolerances when it must.
        plain_s = float(costs.compute_s.sum())
        run_cols = np.concatenate([self.R[rr, ri], self.Min[mr, mi], self.Mout[mo]])
        run_vals = np.concatenate([costs.compute_s[ri], costs.page_in_s[mi], costs.page_out_s[mo]])
        if len(run_cols):
            # In units of plain training's runtime: the solver's absolute feasibility tolerance (1e-7)
            # is then relative, whether a step takes nanoseconds or minutes.
            unit = plain_s if plain_s > 0 else max(float(run_vals.max(initial=0.0)), 1e-300)
            slack = self.budgets.runtime_s * (1 - self.runtime_margin) - plain_s - outside_s
            extra.add_row(run_cols, run_vals / unit, -np.inf, slack / unit)

        # (8) storage: what the paged tensors occupy (whole sectors or erase blocks) within what is
        #     free, and the erase blocks their page-outs wear per step within a wear budget
        for per_tensor, limit in (storage_limits(costs, self.budgets) if len(mo) else ()):
            if limit > 0:  # the row in units of its limit, as for memory (less a window's fixed page-outs)
                extra.add_row(self.Mout[mo], per_tensor[mo] / limit, -np.inf,
                              1.0 - float(per_tensor[self._fixed_outs].sum()) / limit)
            else:  # no storage at all (a wear budget the medium cannot meet): no page-out
                ub[self.Mout[mo]] = 0.0

        if self.tighten and not self.minimize_peak:
            # (9) stage boundaries as pure-binary knapsacks: what is kept into stage t+1 was resident
            #     when node t ran, beside t's inputs and output. Implied by the U chain in the LP,
            #     but written over binaries alone HiGHS's cover separators can cut on it.
            kt1, ki1 = self.S.pairs(np.append(self.accounted, False)[self.S.stages() - 1])
            kt1 = kt1 - 1  # kept into kt1 + 1: resident while node kt1 ran
            optional = ~reads(kt1, ki1) & (ki1 != kt1)
            kt1, ki1 = kt1[optional], ki1[optional]
            fixed = nbytes.copy()
            np.add.at(fixed, np.repeat(np.arange(T), n_deps), nbytes[dep_flat])
            order = np.argsort(kt1, kind="stable")
            kt1, ki1 = kt1[order], ki1[order]
            stages = np.unique(kt1)
            for t in stages:  # one row per stage: T rows, built from the sorted pairs
                lo, hi = np.searchsorted(kt1, [t, t + 1])
                extra.add_row(self.S[t + 1, ki1[lo:hi]], nbytes[ki1[lo:hi]], -np.inf, 1.0 - fixed[t])
            self._add_suffix_sum_rows(extra)
            if self.window is not None:
                pass  # rows (10) and (11) span stages the window does not decide
            elif self.allow_paging:
                self._add_one_page_out_rows(extra, users)
            if self.allow_remat and self.window is None:
                self._add_input_kept_rows(extra, users, deps)

        if extra.count:
            A2, lb2, ub2 = extra.matrix(n_vars)
            A = sp.vstack([A, A2], format="csr")
            row_lb = np.concatenate([row_lb, lb2])
            row_ub = np.concatenate([row_ub, ub2])

        return Milp(c=c, offset=offset, A=A, row_lb=row_lb, row_ub=row_ub, lb=lb, ub=ub,
                    integrality=integrality)

    def _fix_outside(self, lb, ub, offset: float) -> tuple[float, float]:
        """Bounds that fix the incumbent's page-outs and its keeps into stages a and b+1; returns the
        objective's offset and the runtime of the incumbent's actions in the other stages."""
        a, b = self.window
        plan, costs = self.incumbent, self.costs
        outs = np.flatnonzero(self.Mout >= 0)
        # A page-out is free unless a page-in in another stage reads it back. It happens in its tensor's
        # own stage, maybe before the window, but it holds no RAM there: it only costs energy, runtime
        # and storage, all counted here. So a window that brings a tensor back otherwise wherever the
        # plan paged it in may leave its page-out out.
        read_outside = np.isin(outs, [i for t, i in plan.page_in if not a <= t <= b])
        fixed = outs[read_outside]
        lb[self.Mout[fixed]] = ub[self.Mout[fixed]] = np.isin(fixed, list(plan.page_out)).astype(float)
        if any(not self._mo_any[i] for i in plan.page_out):
            raise WindowMismatch("a page-out the model has no column for")
        # the page-outs of tensors the window has no column for are constants (energy, runtime, storage)
        self._fixed_outs = np.array(sorted(i for i in plan.page_out if self.Mout[i] < 0), dtype=np.int64)
        for t in (a, b + 1):
            if t >= len(self.graph):
                continue
            held, cols = self.S.row(t)
            kept = np.array([(t, int(i)) in plan.keep for i in held], dtype=bool)
            lb[cols] = ub[cols] = kept.astype(float)
            if sum(1 for runs in plan.keep.runs.values() if any(x <= t <= y for x, y in runs)) != int(kept.sum()):
                raise WindowMismatch(f"a tensor kept into stage {t} that the model has no column for")
        outside = [(t, i) for t, i in plan.recompute if not a <= t <= b]
        paged = [(t, i) for t, i in plan.page_in if not a <= t <= b]
        energy = math.fsum([offset, *(float(costs.compute_j[i]) for _, i in outside),
                            *(float(costs.page_in_j[i]) for _, i in paged), *costs.page_out_j[self._fixed_outs]])
        runtime = math.fsum([*(float(costs.compute_s[i]) for _, i in outside),
                             *(float(costs.page_in_s[i]) for _, i in paged), *costs.page_out_s[self._fixed_outs]])
        return energy, runtime

    def _recomputes_between(self, i: int, u: int, r: int) -> tuple[list[int], list[float]]:
        """Columns and coefficients of sum_{u <= w <= r} R[w,i]: the variables themselves, or two
        suffix sums when the run is long."""
        # i's recompute stages run without a hole from i+1 to the last stage it may be computed in
        last = int(self._last_compute[i])
        if last <= i or u > min(r, last):
            return [], []
        a = max(u, i + 1)
        if self.Q[a, i] < 0:
            cols = self.R[np.arange(a, min(r, last) + 1), i].tolist()
            return cols, [1.0] * len(cols)
        cols, vals = [int(self.Q[a, i])], [1.0]
        if self.Q[r + 1, i] >= 0:
            cols.append(int(self.Q[r + 1, i]))
            vals.append(-1.0)
        return cols, vals

    def _add_suffix_sum_rows(self, extra: "Rows") -> None:
        """Q[t,i] - Q[t+1,i] - R[t,i] = 0 (Q past the last recompute stage is 0)."""
        q_t, q_i = self.Q.pairs()
        if len(q_t):
            extra.add([(self.Q[q_t, q_i], 1.0), (self.Q[q_t + 1, q_i], -1.0), (self.R[q_t, q_i], -1.0)], 0.0, 0.0)

    def _add_one_page_out_rows(self, extra: "Rows", users) -> None:
        """(10) One page-out buys every page-in: S[u,i] + sum_{u<=w<=r} R[w,i] + Mout[i] >= 1.

        Tensor i is read in stage r (its last reader's own stage), so it is in RAM then; looking back
        to any stage u in (i, r], it was already there at the start of u, or recomputed in [u, r],
        or paged in, which takes the page-out. Without these rows the LP pages i out at 0.02 and in
        at 0.02 in each of thirty stages, building up a whole copy for a fiftieth of the page-out's
        energy; row (4) only bounds each page-in by the page-out, not their sum. Rows for accounted
        stages only: elsewhere keeping is free.
        """
        rows = []
        for i in range(len(self.graph)):
            if self.Mout[i] < 0 or not users[i]:
                continue
            r = max(users[i])
            for u in range(i + 1, r + 1):
                if not self.accounted[u] or self.S[u, i] < 0:
                    continue
                cols, vals = self._recomputes_between(i, u, r)
                rows.append(([int(self.S[u, i]), int(self.Mout[i]), *cols], [1.0, 1.0, *vals]))
        _add_rows_at_least_one(extra, rows)

    def _add_input_kept_rows(self, extra: "Rows", users, deps) -> None:
        """(11) To recompute a tensor, something of its input stays: for a recomputable tensor k, an
        input d of k, and a stage u in (d, r] with r the stage of k's last reader,
            S[u,k] + Mout[k] + S[u,d] + Mout[d] + sum_{u<=w<=r} R[w,d] >= 1.
        k is in RAM in stage r. It was there at the start of u, or paged in (its page-out), or made
        in some stage of [u, r], which needed d in RAM then: d kept since before u, paged in, or
        recomputed in [u, r]. Without these rows the LP keeps 2% of d through the forward pass and
        recomputes 2% of k from it in each of thirty stages, all for 2% of d's memory.
        """
        rows = []
        for k in range(len(self.graph)):
            if not users[k] or self._last_compute[k] <= k:
                continue
            r = max(users[k])
            k_out = [int(self.Mout[k])] if self.Mout[k] >= 0 else []
            for d in map(int, deps[k]):
                d_out = [int(self.Mout[d])] if self.Mout[d] >= 0 else []
                for u in range(d + 1, r + 1):
                    if not self.accounted[u]:
                        continue
                    keeps = [int(self.S[u, j]) for j in (k, d) if j < u and self.S[u, j] >= 0]
                    cols, vals = self._recomputes_between(d, u, r)
                    fixed = keeps + k_out + d_out
                    rows.append((fixed + cols, [1.0] * len(fixed) + vals))
        _add_rows_at_least_one(extra, rows)

    # -- solutions ----------------------------------------------------------------------------
    def decode(self, x: np.ndarray) -> Decisions:
        on = np.asarray(x) > 0.5

        def pairs(index):
            t, i = index.pairs()
            chosen = on[index[t, i]]
            return frozenset(zip(t[chosen].tolist(), i[chosen].tolist()))

        outs = np.flatnonzero(self.Mout >= 0)
        return Decisions(
            recompute=pairs(self.R),
            page_in=pairs(self.Min),
            page_out=frozenset(outs[on[self.Mout[outs]]].tolist() + self._fixed_outs.tolist()),
            keep=pairs(self.S),
        )

    def encode(self, decisions: Decisions) -> np.ndarray | None:
        """The full solution vector (releases and memory levels included) of given decisions, for
        a MIP start; None when the decisions break one of the formulation's rows."""
        x = np.zeros(self.milp.num_vars)
        try:
            for t, i in decisions.recompute:
                x[_col(self.R, t, i)] = 1
            for t, i in decisions.page_in:
                x[_col(self.Min, t, i)] = 1
            for i in set(decisions.page_out).difference(self._fixed_outs.tolist()):  # the rest: constants
                x[_col(self.Mout, i)] = 1
            for t, i in decisions.keep:
                x[_col(self.S, t, i)] = 1
        except KeyError:
            return None
        for i in np.flatnonzero((self.Q.cols >= 0).any(axis=0)):  # local tensor columns
            stages = np.flatnonzero(self.Q.cols[:, i] >= 0)
            recomputed = x[self.R.cols[stages, i]]
            x[self.Q.cols[stages, i]] = np.cumsum(recomputed[::-1])[::-1]
        runs = {(t, t) for t in range(len(self.graph))} | set(decisions.recompute)
        made = runs | set(decisions.page_in)
        users = self.graph.users() if self.facts is None else self.facts[2]
        for f, t, i, k in zip(self.F, self.F_t, self.F_i, self.F_k):
            t, i, k = int(t), int(i), int(k)
            ok = ((t, k) in made) if k == i else ((t, k) in runs)
            ok = ok and (t + 1, i) not in decisions.keep
            ok = ok and not any(k < j <= t and (t, j) in runs for j in users[i])
            x[f] = 1.0 if ok else 0.0
        # Memory rows are equalities chained within a stage, in row order: solve them one by one.
        A = self.milp.A
        start, n_u = self._u_rows
        for r in range(start, start + n_u):
            lo, hi = A.indptr[r], A.indptr[r + 1]
            cols, vals = A.indices[lo:hi], A.data[lo:hi]
            u = self.U[r - start]
            rest = sum(v * x[c] for c, v in zip(cols, vals) if c != u)
            x[u] = self.milp.row_lb[r] - rest
        if self.B >= 0:
            x[self.B] = x[self.U].max(initial=0.0)
        activity = A @ x
        tol = 1e-6 * np.maximum(1.0, np.abs(activity))
        if np.any(activity > self.milp.row_ub + tol) or np.any(activity < self.milp.row_lb - tol):
            return None
        if np.any(x > self.milp.ub + 1e-9):
            return None
        return x


def _col(index: np.ndarray, *key) -> int:
    col = int(index[key])
    if col < 0:
        raise KeyError(key)
    return col


# Rows (10) and (11) sum a run of a tensor's recompute variables; past this many the tensor gets
# suffix-sum columns (Q) so that each row stays a handful of terms.
DIRECT_RECOMPUTE_TERMS = 8


def _add_rows_at_least_one(extra: Rows, rows: list[tuple[list[int], list[float]]]) -> None:
    """One row sum(vals * x[cols]) >= 1 per (cols, vals)."""
    if not rows:
        return
    first, m = extra.count, len(rows)
    extra.add([(np.full(m, -1, dtype=np.int64), 0.0)], 1.0, np.inf)
    lengths = np.array([len(c) for c, _ in rows], dtype=np.int64)
    extra.add_sparse(np.repeat(np.arange(first, first + m), lengths),
                     np.concatenate([np.array(c, dtype=np.int64) for c, _ in rows]),
                     np.concatenate([np.array(v, dtype=float) for _, v in rows]))
