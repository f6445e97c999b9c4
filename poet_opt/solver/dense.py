"""The dense Checkmate/POET formulation, as a baseline backend to measure our own against.

Built in bulk (numpy -> scipy.sparse) into the same :class:`~poet_opt.solver.formulation.Milp` as ours, so
:func:`poet_opt.solver.backends.solve_milp` runs it with the same solver, threads and time limit. It keeps
every variable of the published model and none of our reductions: R, S_RAM, S_SD, M_in and M_out
are T x T binaries, FREE is one binary per stage and edge, U is T x T continuous. Entries the
published code pins to zero with equality rows (the upper triangles; R's diagonal pinned to one)
are pinned here by their bounds instead: the same model after HiGHS's first presolve pass.

Two semantics of paging, both dense:

- ``"poet"``, exactly as published (Patil et al., ``poet/poet_solver.py``): a page-in during stage
  t makes the tensor resident from stage t+1 on (it enters U only through S_RAM[t+1]); a page-out
  in stage t needs the tensor in RAM at the start of stage t; paging frees no memory inside a stage.
  With ``mode="remat"`` this is Checkmate's MILP (no paging variables).
- ``"aligned"``: the same dense variables, but paging timed as in our formulation: a page-in at
  position i of stage t serves readers in that stage and counts in U from position i; a page-out
  may follow any copy resident in the stage. Its decision space contains ours and drops none of its
  freedoms (backward recomputation, later or repeated page-outs, useless keeps), so its optimum
  equalling ours is a test that our reductions are exact.

``runtime="compute"`` bounds compute time only, as POET does; ``runtime="all"`` also counts paging
time, as ours does (use it to compare under the same budgets). Neither model has a storage
capacity row (POET has none); the validator still checks a decoded plan against it.

Decoding: :meth:`DenseFormulation.replay_steps` replays a solution in the dense model's own
semantics into plain steps (an independent check by our validator and cost model, whatever the
solution does); :meth:`DenseFormulation.to_decisions` maps it onto our
:class:`~poet_opt.schedule.decisions.Decisions` where our decision space can express it (not when it
recomputes a backward node), dropping only what costs energy and buys nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule import validator
from poet_opt.schedule.decisions import Budgets, Decisions, build_steps, totals_of
from poet_opt.schedule.document import Schedule
from poet_opt.solver.backends import SolveResult, solve_milp
from poet_opt.solver.formulation import MODES, Milp, horizons

SEMANTICS = ("poet", "aligned")
RUNTIME_COUNTS = ("compute", "all")


class _Triplets:
    """COO rows assembled from numpy blocks."""

    def __init__(self):
        self.r, self.c, self.v, self.lb, self.ub = [], [], [], [], []
        self.count = 0

    def new_rows(self, m: int, lb, ub) -> np.ndarray:
        ids = np.arange(self.count, self.count + m)
        self.lb.append(np.broadcast_to(np.asarray(lb, dtype=float), (m,)))
        self.ub.append(np.broadcast_to(np.asarray(ub, dtype=float), (m,)))
        self.count += m
        return ids

    def terms(self, rows, cols, vals):
        rows, cols = np.broadcast_arrays(np.asarray(rows), np.asarray(cols))
        self.r.append(rows.ravel())
        self.c.append(cols.ravel())
        self.v.append(np.broadcast_to(np.asarray(vals, dtype=float), rows.shape).ravel())

    def matrix(self, n_vars: int):
        A = sp.csr_matrix((np.concatenate(self.v), (np.concatenate(self.r), np.concatenate(self.c))),
                          shape=(self.count, n_vars))
        A.sum_duplicates()
        return A, np.concatenate(self.lb), np.concatenate(self.ub)


class DenseFormulation:
    """The dense MILP for one (graph, costs, budgets, mode, semantics, runtime accounting)."""

    def __init__(self, graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str = "joint", *,
                 semantics: str = "poet", runtime: str = "all"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {SEMANTICS}")
        if runtime not in RUNTIME_COUNTS:
            raise ValueError(f"runtime must be one of {RUNTIME_COUNTS}")
        self.graph, self.costs, self.budgets, self.mode = graph, costs, budgets, mode
        self.semantics, self.runtime = semantics, runtime
        self.allow_remat = mode in ("joint", "remat")
        self.allow_paging = mode in ("joint", "paging")
        started = time.perf_counter()
        self.milp = self._build()
        self.build_s = time.perf_counter() - started

    # -- model -------------------------------------------------------------------------------
    def _build(self) -> Milp:
        g, costs, T = self.graph, self.costs, len(self.graph)
        aligned = self.semantics == "aligned"
        edges = np.array(g.edges, dtype=np.int64).reshape(-1, 2)
        E = len(edges)
        e_src, e_dst = edges[:, 0], edges[:, 1]
        # U in units of the RAM budget and runtime in units of plain training: a row scaling, done
        # for the same numerical reasons as in our formulation, so neither model gets an edge there.
        self.mem_unit = (float(self.budgets.ram_bytes) if math.isfinite(self.budgets.ram_bytes)
                         else float(max(g.plain_peak_bytes(), 1)))
        mem = np.array([n.bytes for n in g.nodes], dtype=float) / self.mem_unit

        TT = T * T
        self.oR, self.oS, self.oD, self.oIn, self.oOut = 0, TT, 2 * TT, 3 * TT, 4 * TT
        self.oF = 5 * TT
        self.oU = self.oF + T * E
        n_vars = self.oU + TT
        self.E = E

        def blk(offset, t, i):
            return offset + np.asarray(t) * T + np.asarray(i)

        tt, ii = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
        lower_incl = ii <= tt
        lower_strict = ii < tt

        lb = np.zeros(n_vars)
        ub = np.ones(n_vars)
        integrality = np.ones(n_vars, dtype=np.int8)
        ub[self.oU:] = 1.0 if math.isfinite(self.budgets.ram_bytes) else np.inf  # U <= RAM budget
        integrality[self.oU:] = 0

        def fix(offset, allowed):
            ub[offset:offset + TT][~allowed.ravel()] = 0.0

        r_allowed = lower_incl if self.allow_remat else (ii == tt)
        fix(self.oR, r_allowed)
        lb[self.oR + np.arange(T) * T + np.arange(T)] = 1.0  # R[t,t] = 1
        fix(self.oS, lower_strict)
        fix(self.oD, lower_strict if self.allow_paging else np.zeros_like(lower_strict))
        fix(self.oIn, lower_incl if self.allow_paging else np.zeros_like(lower_strict))
        fix(self.oOut, lower_incl if self.allow_paging else np.zeros_like(lower_strict))

        c = np.zeros(n_vars)
        c[self.oR:self.oR + TT] = np.tile(costs.compute_j, T)
        c[self.oIn:self.oIn + TT] = np.tile(costs.page_in_j, T)
        c[self.oOut:self.oOut + TT] = np.tile(costs.page_out_j, T)

        rows = _Triplets()
        t_col = np.arange(T)[:, None]

        # an op's inputs are resident when it runs: R[t,v] <= R[t,u] + S_RAM[t,u] (+ M_in[t,u])
        r = rows.new_rows(T * E, -np.inf, 0.0).reshape(T, E)
        rows.terms(r, blk(self.oR, t_col, e_dst[None, :]), 1.0)
        rows.terms(r, blk(self.oR, t_col, e_src[None, :]), -1.0)
        rows.terms(r, blk(self.oS, t_col, e_src[None, :]), -1.0)
        if aligned:
            rows.terms(r, blk(self.oIn, t_col, e_src[None, :]), -1.0)

        # in RAM at t+1 only if in RAM, computed or paged in at t; on storage only if there or paged out
        t0, i0 = np.meshgrid(np.arange(T - 1), np.arange(T), indexing="ij")
        r = rows.new_rows(t0.size, -np.inf, 0.0).reshape(t0.shape)
        rows.terms(r, blk(self.oS, t0 + 1, i0), 1.0)
        rows.terms(r, blk(self.oS, t0, i0), -1.0)
        rows.terms(r, blk(self.oR, t0, i0), -1.0)
        rows.terms(r, blk(self.oIn, t0, i0), -1.0)
        r = rows.new_rows(t0.size, -np.inf, 0.0).reshape(t0.shape)
        rows.terms(r, blk(self.oD, t0 + 1, i0), 1.0)
        rows.terms(r, blk(self.oD, t0, i0), -1.0)
        rows.terms(r, blk(self.oOut, t0, i0), -1.0)

        # page in only from storage; page out only what is in RAM (at the stage start, as published;
        # aligned: any copy resident in the stage)
        r = rows.new_rows(TT, -np.inf, 0.0).reshape(T, T)
        rows.terms(r, blk(self.oIn, tt, ii), 1.0)
        rows.terms(r, blk(self.oD, tt, ii), -1.0)
        r = rows.new_rows(TT, -np.inf, 0.0).reshape(T, T)
        rows.terms(r, blk(self.oOut, tt, ii), 1.0)
        rows.terms(r, blk(self.oS, tt, ii), -1.0)
        if aligned:
            rows.terms(r, blk(self.oR, tt, ii), -1.0)
            rows.terms(r, blk(self.oIn, tt, ii), -1.0)

        # FREE[t,(i,k)] = 1 exactly when no hazard: k runs in stage t, i is not kept into t+1, and no
        # later reader of i runs in stage t. hazards = 1 - R[t,k] + S_RAM[t+1,i] + sum R[t,j>k].
        users = g.users()
        pair_e, pair_j = [], []
        for e, (i, k) in enumerate(edges.tolist()):
            for j in users[i]:
                if j > k:
                    pair_e.append(e), pair_j.append(j)
        pair_e = np.array(pair_e, dtype=np.int64)
        pair_j = np.array(pair_j, dtype=np.int64)
        later_count = np.bincount(pair_e, minlength=E).astype(float)
        max_hazards = np.where(np.arange(T)[:, None] + 1 < T, 2.0, 1.0) + later_count[None, :]  # (T, E)
        F = self.oF + t_col * E + np.arange(E)[None, :]
        self.F_index = F
        has_next = np.arange(T) + 1 < T
        for upper in (True, False):
            if upper:  # 1 - F <= hazards:  -F + R[t,k] - S[t+1,i] - sum R[t,j] <= 0
                r = rows.new_rows(T * E, -np.inf, 0.0).reshape(T, E)
                rows.terms(r, F, -1.0)
            else:  # maxh (1 - F) >= hazards:  -maxh F + R[t,k] - S[t+1,i] - sum R[t,j] >= 1 - maxh
                r = rows.new_rows(T * E, (1.0 - max_hazards).ravel(), np.inf).reshape(T, E)
                rows.terms(r, F, -max_hazards)
            rows.terms(r, blk(self.oR, t_col, e_dst[None, :]), 1.0)
            tn = np.flatnonzero(has_next)[:, None]
            rows.terms(r[has_next], blk(self.oS, tn + 1, e_src[None, :]), -1.0)
            if len(pair_e):
                rows.terms(r[:, pair_e], blk(self.oR, t_col, pair_j[None, :]), -1.0)

        # memory: U[t,0] = R[t,0] m0 (+ M_in[t,0] m0) + sum_i S_RAM[t,i] m_i
        #         U[t,k+1] = U[t,k] + R[t,k+1] m_{k+1} (+ M_in[t,k+1] m_{k+1}) - sum_{(i,k) in E} m_i FREE[t,(i,k)]
        r = rows.new_rows(T, 0.0, 0.0)
        rows.terms(r, blk(self.oU, np.arange(T), 0), 1.0)
        rows.terms(r, blk(self.oR, np.arange(T), 0), -mem[0])
        if aligned:
            rows.terms(r, blk(self.oIn, np.arange(T), 0), -mem[0])
        rows.terms(r[:, None], blk(self.oS, t_col, np.arange(T)[None, :]), -mem[None, :])
        if T > 1:
            k0 = np.arange(T - 1)[None, :]
            r = rows.new_rows(T * (T - 1), 0.0, 0.0).reshape(T, T - 1)
            rows.terms(r, blk(self.oU, t_col, k0 + 1), 1.0)
            rows.terms(r, blk(self.oU, t_col, k0), -1.0)
            rows.terms(r, blk(self.oR, t_col, k0 + 1), -mem[1:][None, :])
            if aligned:
                rows.terms(r, blk(self.oIn, t_col, k0 + 1), -mem[1:][None, :])
            into = e_dst < T - 1
            if into.any():
                rows.terms(r[:, e_dst[into]], F[:, into], mem[e_src[into]][None, :])

        # runtime: compute only (POET) or compute + paging (ours)
        if math.isfinite(self.budgets.runtime_s):
            plain_s = float(costs.compute_s.sum())
            unit = plain_s if plain_s > 0 else 1.0
            r = rows.new_rows(1, -np.inf, self.budgets.runtime_s / unit)
            rows.terms(r, np.arange(self.oR, self.oR + TT), np.tile(costs.compute_s, T) / unit)
            if self.runtime == "all":
                rows.terms(r, np.arange(self.oIn, self.oIn + TT), np.tile(costs.page_in_s, T) / unit)
                rows.terms(r, np.arange(self.oOut, self.oOut + TT), np.tile(costs.page_out_s, T) / unit)

        A, row_lb, row_ub = rows.matrix(n_vars)
        return Milp(c=c, offset=0.0, A=A, row_lb=row_lb, row_ub=row_ub, lb=lb, ub=ub, integrality=integrality,
                    names=["R", "S_RAM", "S_SD", "M_in", "M_out", "FREE", "U"])

    @property
    def num_binaries(self) -> int:
        return int(self.milp.integrality.sum())

    # -- solutions ---------------------------------------------------------------------------
    def matrices(self, x: np.ndarray) -> dict:
        T, TT = len(self.graph), len(self.graph) ** 2
        on = np.asarray(x) > 0.5
        out = {name: on[o:o + TT].reshape(T, T) for name, o in
               (("R", self.oR), ("S", self.oS), ("D", self.oD), ("In", self.oIn), ("Out", self.oOut))}
        out["F"] = on[self.F_index] if self.E else np.zeros((T, 0), dtype=bool)
        return out

    def encode(self, decisions: Decisions, check: bool = True) -> Optional[np.ndarray]:
        """A full solution vector of the dense model for our decisions (a MIP start for it), or None
        when the dense rows reject them (e.g. 'poet' paging semantics)."""
        g, T = self.graph, len(self.graph)
        x = np.zeros(self.milp.num_vars)
        R = np.eye(T, dtype=bool)
        S = np.zeros((T, T), dtype=bool)
        In = np.zeros((T, T), dtype=bool)
        Out = np.zeros((T, T), dtype=bool)
        for t, i in decisions.recompute:
            R[t, i] = True
        for t, i in decisions.keep:
            S[t, i] = True
        for t, i in decisions.page_in:
            In[t, i] = True
        for i in decisions.page_out:
            Out[i, i] = True
        D = np.zeros((T, T), dtype=bool)
        for i in decisions.page_out:
            D[i + 1:, i] = True
        x[self.oR:self.oR + T * T] = R.ravel()
        x[self.oS:self.oS + T * T] = S.ravel()
        x[self.oD:self.oD + T * T] = D.ravel()
        x[self.oIn:self.oIn + T * T] = In.ravel()
        x[self.oOut:self.oOut + T * T] = Out.ravel()
        # FREE exactly where no hazard is left, and U from the memory equalities, all at once
        edges = np.array(g.edges, dtype=np.int64).reshape(-1, 2)
        src, dst = edges[:, 0], edges[:, 1]
        E = len(edges)
        users = g.users()
        pair_e = [e for e, (i, k) in enumerate(edges.tolist()) for j in users[i] if j > k]
        pair_j = [j for e, (i, k) in enumerate(edges.tolist()) for j in users[i] if j > k]
        later = np.zeros((T, E))
        if pair_e:
            incidence = sp.csr_matrix((np.ones(len(pair_e)), (np.arange(len(pair_e)), pair_e)),
                                      shape=(len(pair_e), E))
            later = np.asarray(incidence.T @ R[:, pair_j].T.astype(float)).T  # later readers run, per (t, e)
        kept_next = np.zeros((T, E), dtype=bool)
        kept_next[:-1] = S[1:, src]
        free = R[:, dst] & ~kept_next & (later == 0)
        x[self.F_index] = free
        mem = np.array([n.bytes for n in g.nodes], dtype=float) / self.mem_unit
        aligned = self.semantics == "aligned"
        added = mem[None, :] * (R + (In if aligned else 0))
        freed = np.zeros((T, T))
        np.add.at(freed.T, dst, (free * mem[src][None, :]).T)
        U = (S.astype(float) @ mem)[:, None] + np.cumsum(added, axis=1)
        U[:, 1:] -= np.cumsum(freed, axis=1)[:, :-1]
        x[self.oU:self.oU + T * T] = U.ravel()
        return x if check is False or not self.violations(x) else None

    def violations(self, x: np.ndarray) -> list[str]:
        """Rows (by index) and variable bounds that x breaks, for messages and tests."""
        activity = self.milp.A @ x
        tol = 1e-7 * np.maximum(1.0, np.abs(activity))
        bad = [f"row {r}" for r in np.flatnonzero((activity > self.milp.row_ub + tol) |
                                                   (activity < self.milp.row_lb - tol))]
        bad += [f"{self.var_name(j)} = {x[j]:g}" for j in np.flatnonzero((x > self.milp.ub + 1e-9) |
                                                                          (x < self.milp.lb - 1e-9))]
        return bad

    def var_name(self, j: int) -> str:
        T = len(self.graph)
        if j >= self.oU:
            return f"U[{(j - self.oU) // T},{(j - self.oU) % T}]"
        if j >= self.oF:
            return f"FREE[{(j - self.oF) // self.E},{self.graph.edges[(j - self.oF) % self.E]}]"
        block = ("R", "S_RAM", "S_SD", "M_in", "M_out")[j // (T * T)]
        return f"{block}[{(j % (T * T)) // T},{j % T}]"

    def replay_steps(self, x: np.ndarray) -> list[dict]:
        """The solution as plain steps, in the dense model's own semantics, for our validator.
        Memory frees happen where the dense accounting releases (FREE) or at the next stage's start
        (tensors not in S_RAM[t+1]); duplicates the dense model allows and pays for (recomputing or
        paging in a tensor already resident) are skipped, so the replay never costs more."""
        g, T = self.graph, len(self.graph)
        m = self.matrices(x)
        R, S, In, Out, Fr = m["R"], m["S"], m["In"], m["Out"], m["F"]
        aligned = self.semantics == "aligned"
        steps: list[dict] = []
        resident: set[int] = set()
        stored: set[int] = set()
        edges = g.edges
        frees_after: list[list[tuple[int, int]]] = [[] for _ in range(T)]
        for e, (i, k) in enumerate(edges):
            frees_after[k].append((e, i))

        def page_out(i):
            steps.append({"op": "page_out", "node": i})
            stored.add(i)

        for t in range(T):
            carry = set(np.flatnonzero(S[t]).tolist())
            for i in sorted(resident - carry):
                steps.append({"op": "free", "node": i})
                resident.discard(i)
            if not aligned and t > 0:
                # published: paged in during stage t-1, resident from stage t
                for i in np.flatnonzero(In[t - 1] & S[t]).tolist():
                    if i not in resident:
                        steps.append({"op": "page_in", "node": i})
                        resident.add(i)
            if carry - resident:
                raise RuntimeError(f"dense solution keeps {sorted(carry - resident)} into stage {t} "
                                   "without having them in RAM")
            for i in sorted(carry):  # page-outs of copies resident at the stage start
                if Out[t, i]:
                    page_out(i)
            for k in range(t + 1):
                if aligned and In[t, k] and k not in resident:
                    steps.append({"op": "page_in", "node": k})
                    resident.add(k)
                if R[t, k] and k not in resident:
                    steps.append({"op": "compute", "node": k})
                    resident.add(k)
                if aligned and Out[t, k] and k not in carry and k in resident:
                    page_out(k)
                if R[t, k]:
                    for e, i in frees_after[k]:
                        if Fr[t, e] and i in resident:
                            steps.append({"op": "free", "node": i})
                            resident.discard(i)
        for i in sorted(resident):
            steps.append({"op": "free", "node": i})
        return steps

    def to_decisions(self, x: np.ndarray) -> tuple[Optional[Decisions], str]:
        """Our decisions for the same plan (with useless keeps, duplicate materializations and
        unread page-outs dropped), or (None, why) when our decision space cannot express it."""
        g, T = self.graph, len(self.graph)
        m = self.matrices(x)
        R, S, In, Out = m["R"], m["S"], m["In"], m["Out"]
        aligned = self.semantics == "aligned"
        backward = [i for t, i in zip(*np.nonzero(R)) if i < t and g.nodes[i].is_backward]
        if backward:
            names = ", ".join(sorted({g.nodes[i].name for i in backward})[:3])
            return None, f"recomputes backward node(s) {names}, which our formulation never does"
        need, _ = horizons(g, self.allow_remat)
        recompute, page_in, keep = set(), set(), set()
        for t in range(T):
            for i in range(t):
                if t > need[i]:
                    continue  # nothing can read i any more: a keep, recompute or page-in is waste
                arrives = (In[t, i] if aligned else (t > 0 and In[t - 1, i] and not S[t - 1, i]
                                                     and not R[t - 1, i] and S[t, i]))
                if S[t, i] and not (not aligned and arrives):
                    keep.add((t, i))
                elif R[t, i]:
                    recompute.add((t, i))
                elif arrives:
                    page_in.add((t, i))
        # a keep is only real if the tensor was there during the previous stage
        changed = True
        while changed:
            changed = False
            for t, i in sorted(keep):
                if t - 1 > i and not ((t - 1, i) in keep or (t - 1, i) in recompute or (t - 1, i) in page_in):
                    keep.discard((t, i))
                    changed = True
        read_back = {i for _, i in page_in}
        page_out = {i for i in np.flatnonzero(Out.any(axis=0)).tolist() if i in read_back}
        if read_back - page_out:
            return None, "pages in a tensor it never paged out"
        return Decisions(frozenset(recompute), frozenset(page_in), frozenset(page_out), frozenset(keep)), ""


@dataclass
class DenseOutcome:
    status: str
    objective: Optional[float]  # the dense MILP's incumbent, as the solver reports it
    bound: Optional[float]
    gap: Optional[float]
    build_s: float
    solve_s: float
    num_vars: int
    num_binaries: int
    num_rows: int
    replay: Optional[dict]  # validated totals of the dense plan replayed in its own semantics
    replay_error: str
    decisions: Optional[Decisions]  # the same plan in our decision space, when expressible
    mapped: Optional[dict]  # validated totals of build_steps(decisions)
    mapped_note: str
    had_start: bool = False  # whether a MIP start was accepted


def validated_totals(graph: TrainingGraph, profile, costs: NodeCosts, budgets: Budgets, steps: list[dict],
                     *, check_runtime: bool = True) -> dict:
    """Our cost model and independent validator on a step list; raises validator.ScheduleInvalid.
    check_runtime=False leaves the runtime budget out (POET's compute-only runtime semantics)."""
    totals = totals_of(graph, costs, steps)
    checked = budgets if check_runtime else replace(budgets, runtime_s=math.inf)
    schedule = Schedule(model=graph.name, mode="dense", graph=graph, profile=profile, costs=costs,
                        budgets=checked, decisions=Decisions(frozenset(), frozenset(), frozenset(), frozenset()),
                        steps=steps, totals=totals, plain=totals, solver={})
    validator.validate(schedule.to_dict())
    return totals


def solve_dense(graph: TrainingGraph, profile, costs: NodeCosts, budgets: Budgets, mode: str = "joint", *,
                semantics: str = "poet", runtime: str = "all", time_limit: Optional[float] = None,
                gap: float = 1e-3, threads: Optional[int] = None, backend: str = "highs",
                start=None) -> DenseOutcome:
    """Build and solve the dense model, then check its plan with our validator (both as replayed in
    its own semantics and, where expressible, mapped onto our decisions). start: Decisions, or a
    list of them tried in order, as a MIP start (the first its rows accept)."""
    form = DenseFormulation(graph, costs, budgets, mode, semantics=semantics, runtime=runtime)
    candidates = [] if start is None else ([start] if isinstance(start, Decisions) else list(start))
    x0 = next((x for x in map(form.encode, candidates) if x is not None), None)
    result: SolveResult = solve_milp(form.milp, backend=backend, time_limit=time_limit, gap=gap, threads=threads,
                                     start=x0)
    replay = mapped = decisions = None
    replay_error = mapped_note = ""
    check_runtime = runtime == "all"
    if result.x is not None:
        try:
            replay = validated_totals(graph, profile, costs, budgets, form.replay_steps(result.x),
                                      check_runtime=check_runtime)
        except (validator.ScheduleInvalid, RuntimeError) as exc:
            replay_error = getattr(exc, "message", str(exc))
        decisions, mapped_note = form.to_decisions(result.x)
        if decisions is not None:
            try:
                mapped = validated_totals(graph, profile, costs, budgets, build_steps(graph, decisions),
                                          check_runtime=check_runtime)
            except (validator.ScheduleInvalid, RuntimeError) as exc:
                mapped_note = getattr(exc, "message", str(exc))
    status = result.status
    if status in ("optimal", "gap_limit") and result.gap is not None and result.gap > 1e-9:
        status = "gap_limit"
    return DenseOutcome(status=status, objective=result.objective, bound=result.bound, gap=result.gap,
                        build_s=form.build_s, solve_s=result.solve_s, num_vars=form.milp.num_vars,
                        num_binaries=form.num_binaries, num_rows=form.milp.num_rows, replay=replay,
                        replay_error=replay_error, decisions=decisions, mapped=mapped, mapped_note=mapped_note,
                        had_start=x0 is not None)

