"""The CP-SAT side of ``poet_opt/solver/cpsat.py``, run in a child process (``python -m
poet_opt.solver.cpsat_child``): the retention-interval model, its search, and the pipe protocol.

It imports nothing of poet_opt and takes plain data (lists, numpy arrays, sets), so that the child
starts with OR-Tools and numpy only: OR-Tools bundles a HiGHS that cannot share a process with
highspy's (cpsat.py says why), and every import here is start-up time counted against the time
limit. The model, and why it is exact, are described in cpsat.py's docstring and docs/cpsat.md.
"""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import numpy as np

# Objective units: plain training's energy / ENERGY_RESOLUTION. The rounding error of a plan with N
# actions is then under N / ENERGY_RESOLUTION relative, below the driver's 1e-9 for "optimal".
ENERGY_RESOLUTION = 1e12
# Keep every integer sum CP-SAT forms well inside int64.
INT_CEILING = 2 ** 60


def relative_gap(objective, bound):
    """backends.relative_gap, repeated here to keep the child's imports to OR-Tools and numpy."""
    if objective is None or bound is None:
        return None
    if abs(objective) < 1e-12:
        return 0.0
    return max(0.0, (objective - bound) / abs(objective))


class _Model:
    """The CP-SAT model of one problem (cpsat._problem); ``round_up_times`` picks the rounding
    of the runtime row (down: a relaxation, up: a restriction)."""

    def __init__(self, cp_model, problem: dict, counts, round_up_times: bool):
        costs = SimpleNamespace(**problem["costs"])
        deps, nbytes = problem["deps"], problem["bytes"]
        allow_paging = problem["allow_paging"]  # recomputation: problem["recomputable"] says where
        T = len(deps)
        self.T, self.deps = T, deps
        m = cp_model.CpModel()
        self.m = m
        # the parent's horizons, without the cost cap (the counts encode it)
        recomputable, need, comp = problem["recomputable"], problem["need"], problem["comp"]
        self.need, self.comp = need, comp

        # -- integer units ------------------------------------------------------------------------
        floor_j = max(float(problem["plain_energy_j"]), 1e-300)
        worst = float(np.sum(counts * (costs.compute_j + costs.page_in_j)) + np.sum(costs.page_out_j))
        self.unit_j = max(floor_j / ENERGY_RESOLUTION, worst / INT_CEILING, 1e-300)

        def joules(value):  # rounded down: the model never overstates what a plan costs
            return int(math.floor(float(value) / self.unit_j))

        plain_s = float(problem["plain_runtime_s"])
        slack_s = float(problem["runtime_s"]) - plain_s
        timed = math.isfinite(slack_s)
        if timed:
            worst_s = float(np.sum(counts * (costs.compute_s + costs.page_in_s)) + np.sum(costs.page_out_s))
            unit_s = max(max(plain_s, 1e-300) / ENERGY_RESOLUTION, worst_s / INT_CEILING, 1e-300)
            rnd = math.ceil if round_up_times else math.floor

            def seconds(value):
                return int(rnd(float(value) / unit_s))

        # -- intervals ----------------------------------------------------------------------------
        self.present, self.stage, self.last, self.end, self.recompute, self.page_in = [], [], [], [], [], []
        self.page_out: list = [None] * T
        objective, runtime, storage, erased = [], [], [], []
        intervals, demands = [], []
        for i in range(T):
            pres, stg, lst, ends, rcs, pins = [], [], [], [], [], []
            can_remat = bool(recomputable[i]) and comp[i] > i
            can_page = allow_paging and need[i] > i
            for j in range(int(counts[i])):
                if j == 0:
                    p, s = m.NewConstant(1), m.NewConstant(i)
                    rc = pin = None
                else:
                    p = m.NewBoolVar(f"p{i}_{j}")
                    s = m.NewIntVar(i + 1, int(need[i]), f"s{i}_{j}")
                    rc = m.NewBoolVar(f"rc{i}_{j}") if can_remat else None
                    pin = m.NewBoolVar(f"pin{i}_{j}") if can_page else None
                    m.Add(sum(v for v in (rc, pin) if v is not None) == p)
                    if rc is not None:
                        m.Add(s <= int(comp[i])).OnlyEnforceIf(rc)
                        objective.append((rc, joules(costs.compute_j[i])))
                        if timed:
                            runtime.append((rc, seconds(costs.compute_s[i])))
                    if pin is not None:
                        objective.append((pin, joules(costs.page_in_j[i])))
                        if timed:
                            runtime.append((pin, seconds(costs.page_in_s[i])))
                    m.AddImplication(p, pres[-1])  # the used intervals come first
                    m.Add(s >= lst[-1] + 1).OnlyEnforceIf(p)  # stage-disjoint, in order: after the last one's stage
                    m.Add(s == int(need[i])).OnlyEnforceIf(p.Not())  # an absent interval is pinned (no symmetry)
                e = m.NewIntVar(i, int(need[i]), f"e{i}_{j}")
                end = m.NewIntVar(T * i + i + 1, T * int(need[i]) + T, f"end{i}_{j}")
                # released right after position l of stage e, l >= i: end = T*e + l + 1
                m.Add(end >= T * e + i + 1)
                m.Add(end <= T * e + T)
                m.Add(e >= s)
                if j > 0:
                    m.Add(e == s).OnlyEnforceIf(p.Not())
                if j == 0:
                    iv = m.NewIntervalVar(T * i + i, end - (T * i + i), end, f"iv{i}_{j}")
                else:  # CP-SAT wants each of start and size affine in one variable
                    size = m.NewIntVar(1, T * int(need[i]) + T - (T * (i + 1) + i), f"len{i}_{j}")
                    iv = m.NewOptionalIntervalVar(T * s + i, size, end, p, f"iv{i}_{j}")
                if nbytes[i] > 0:
                    intervals.append(iv)
                    demands.append(int(nbytes[i]))
                pres.append(p), stg.append(s), lst.append(e), ends.append(end), rcs.append(rc), pins.append(pin)
            if any(v is not None for v in pins):
                out = m.NewBoolVar(f"out{i}")
                used = [v for v in pins if v is not None]
                for v in used:
                    m.AddImplication(v, out)
                m.AddBoolOr(used).OnlyEnforceIf(out)  # a page-out nobody reads back buys nothing
                self.page_out[i] = out
                objective.append((out, joules(costs.page_out_j[i])))
                if timed:
                    runtime.append((out, seconds(costs.page_out_s[i])))
                storage.append((out, int(math.ceil(float(costs.storage_bytes[i])))))
                erased.append((out, int(math.ceil(float(costs.erased_bytes[i])))))
            self.present.append(pres), self.stage.append(stg), self.last.append(lst), self.end.append(ends)
            self.recompute.append(rcs), self.page_in.append(pins)

        # -- precedence: each computation lies inside an interval of each input --------------------
        self.cover: dict = {}
        for v in range(T):
            for j in range(len(self.present[v])):
                rc = None if j == 0 else self.recompute[v][j]
                if j > 0 and rc is None:
                    continue  # page-ins read nothing
                for u in sorted(set(deps[v])):
                    lits = []
                    for k in range(len(self.present[u])):
                        c = m.NewBoolVar(f"c{v}_{j}_{u}_{k}")
                        if k > 0:
                            m.AddImplication(c, self.present[u][k])
                        # starts no later (same or earlier stage: u < v, so position u comes first) ...
                        if j == 0:
                            if k > 0:
                                m.Add(self.stage[u][k] <= v).OnlyEnforceIf(c)
                            m.Add(self.end[u][k] >= T * v + v + 1).OnlyEnforceIf(c)
                        else:
                            m.Add(self.stage[u][k] <= self.stage[v][j]).OnlyEnforceIf(c)
                            m.Add(self.end[u][k] >= T * self.stage[v][j] + v + 1).OnlyEnforceIf(c)
                        # ... and ends after the reading position
                        lits.append(c)
                        self.cover[(v, j, u, k)] = c
                    if j == 0:
                        m.AddBoolOr(lits)
                    else:
                        m.AddBoolOr(lits).OnlyEnforceIf(rc)

        # -- budgets ------------------------------------------------------------------------------
        if intervals:
            m.AddCumulative(intervals, demands, int(math.floor(float(problem["ram_bytes"]))))
        if timed and runtime:
            # Integer sums: with times floored, sum <= budget holds exactly when sum <= floor(budget), a
            # relaxation (taken a hair high against float error); with times rounded up, a hair low, a
            # restriction. Never below 0: plain training, which needs no slack, always fits.
            budget = slack_s / unit_s
            budget = budget * (1 + 1e-12) + 1e-6 if not round_up_times else budget * (1 - 1e-12) - 1e-6
            m.Add(sum(c * v for v, c in runtime) <= max(0, int(math.floor(budget))))
        for terms, limit in ((storage, problem["storage_bytes"]), (erased, problem.get("erase_bytes", math.inf))):
            if terms and math.isfinite(float(limit)):
                m.Add(sum(c * v for v, c in terms) <= int(math.floor(float(limit))))
        self.offset_j = float(problem["plain_energy_j"])
        self.objective_terms = objective
        if objective:
            m.Minimize(sum(c * v for v, c in objective))
        proto = m.Proto()
        self.num_vars, self.num_constraints = len(proto.variables), len(proto.constraints)

    # -- solutions ----------------------------------------------------------------------------
    def decode(self, value) -> tuple:
        recompute, page_in, page_out, keep = set(), set(), set(), set()
        for i in range(self.T):
            for j in range(len(self.present[i])):
                if j > 0 and not value(self.present[i][j]):
                    continue
                s, e = int(value(self.stage[i][j])), int(value(self.last[i][j]))
                if j > 0:
                    rc = self.recompute[i][j]
                    (recompute if rc is not None and value(rc) else page_in).add((s, i))
                keep.update((t, i) for t in range(s + 1, e + 1))
            if self.page_out[i] is not None and value(self.page_out[i]):
                page_out.add(i)
        return frozenset(recompute), frozenset(page_in), frozenset(page_out), frozenset(keep)

    def hint(self, plan: tuple) -> bool:
        """Hand CP-SAT a known plan (recompute, page_in, page_out, keep); False (no hint) when it needs
        more intervals than the model has."""
        T, deps = self.T, self.deps
        recompute, page_in, _, keep = plan
        made: dict[int, list[tuple[int, str]]] = {i: [(i, "own")] for i in range(T)}
        for t, i in recompute:
            made[i].append((t, "rc"))
        for t, i in page_in:
            made[i].append((t, "pin"))
        computes: dict[int, set[int]] = {t: {t} for t in range(T)}
        for t, i in recompute:
            computes[t].add(i)
        assign: dict = {}
        spans: dict[int, list[tuple[int, int, int]]] = {}
        for i in range(T):
            events = sorted(made[i])
            if len(events) > len(self.present[i]):
                return False
            spans[i] = []
            for j, (s, how) in enumerate(events):
                if j > 0 and ((how == "rc" and self.recompute[i][j] is None) or
                              (how == "pin" and self.page_in[i][j] is None)):
                    return False
                e = s
                while (e + 1, i) in keep:
                    e += 1
                pos = max([k for k in computes.get(e, ()) if i in deps[k]] + [i])
                spans[i].append((s, e, pos))
                assign[self.stage[i][j]] = s
                assign[self.last[i][j]] = e
                assign[self.end[i][j]] = T * e + pos + 1
                if j > 0:
                    assign[self.present[i][j]] = 1
                    if self.recompute[i][j] is not None:
                        assign[self.recompute[i][j]] = int(how == "rc")
                    if self.page_in[i][j] is not None:
                        assign[self.page_in[i][j]] = int(how == "pin")
            for j in range(len(events), len(self.present[i])):
                assign[self.present[i][j]] = 0
                assign[self.stage[i][j]] = int(self.need[i])
                assign[self.last[i][j]] = int(self.need[i])
                assign[self.end[i][j]] = T * int(self.need[i]) + i + 1
                for v in (self.recompute[i][j], self.page_in[i][j]):
                    if v is not None:
                        assign[v] = 0
            if self.page_out[i] is not None:
                assign[self.page_out[i]] = int(any(h == "pin" for _, h in events))
        for (v, j, u, k), c in self.cover.items():
            if j >= len(spans[v]):
                assign[c] = 0
                continue
            t = spans[v][j][0]
            if k < len(spans[u]):
                s, e, pos = spans[u][k]
                assign[c] = int(s <= t and T * e + pos + 1 >= T * t + v + 1)
            else:
                assign[c] = 0
        for var, val in assign.items():
            self.m.AddHint(var, int(val))
        return True


def _search(job: dict, send, stop_requested: threading.Event):
    """In the child: build the model, hint, solve; the answer in the problem's terms."""
    from ortools.sat.python import cp_model

    model = _Model(cp_model, job["problem"], job["counts"], round_up_times=job["round_up"])
    if job["hint"] is not None:
        model.hint(job["hint"])
    solver = cp_model.CpSolver()
    params = solver.parameters
    if job["deadline"] is not None:
        params.max_time_in_seconds = max(0.01, job["deadline"] - time.time())
    if job["threads"]:
        params.num_workers = int(job["threads"])
    # Stop at the requested gap on the total energy, plain training included: energy >= floor, so
    # (energy - bound) <= gap * floor is enough. In model units, a hair under it for the rounding.
    params.absolute_gap_limit = max(0.0, 0.999 * float(job["gap"]) * model.offset_j / model.unit_j)
    params.relative_gap_limit = 0.0
    offset, unit = model.offset_j, model.unit_j
    last_report = [0.0]

    # Plain training's energy bounds every plan, whatever CP-SAT's own bound: an incumbent within the
    # gap of it is done (CP-SAT's bound of a model with many optional intervals can stay far lower).
    within_floor = float(job["gap"]) * model.offset_j / model.unit_j

    class Callback(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self):
            if self.ObjectiveValue() <= within_floor:
                self.StopSearch()
            now = time.perf_counter()
            if not job["progress"] or now - last_report[0] < 1.0:
                return
            last_report[0] = now
            inc = offset + self.ObjectiveValue() * unit
            bnd = offset + self.BestObjectiveBound() * unit
            send(("progress", inc, bnd, relative_gap(inc, bnd)))

    done = threading.Event()

    def watch():
        stop_requested.wait()
        # again and again: a stop that lands before Solve has started its search is not remembered
        while not done.is_set():
            solver.StopSearch()
            done.wait(0.05)

    threading.Thread(target=watch, name="cpsat-stop", daemon=True).start()
    if stop_requested.is_set():  # asked to stop while the model was built: no search at all
        return "interrupted", None, None, None, model.num_vars, model.num_constraints
    code = solver.Solve(model.m, Callback())
    done.set()
    stopped = stop_requested.is_set()
    has_solution = code in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    decisions = objective = bound = None
    if has_solution:
        decisions = model.decode(solver.Value)
        objective = offset + solver.ObjectiveValue() * unit if model.objective_terms else offset
    if code == cp_model.OPTIMAL:
        bound = offset + solver.BestObjectiveBound() * unit if model.objective_terms else objective
        # CP-SAT says OPTIMAL also when it stops at the gap limit
        name = "optimal" if not model.objective_terms or solver.BestObjectiveBound() >= solver.ObjectiveValue() \
            else "gap_limit"
    elif code == cp_model.INFEASIBLE:
        name = "infeasible"
    elif code in (cp_model.FEASIBLE, cp_model.UNKNOWN):
        if has_solution and model.objective_terms:
            bound = offset + solver.BestObjectiveBound() * unit
        # UNKNOWN without a solution is the time limit too (the driver falls back on the start)
        name = "interrupted" if stopped else "time_limit"
    else:
        raise RuntimeError(f"CP-SAT rejected the model ({solver.StatusName(code)})")
    return name, decisions, objective, bound, model.num_vars, model.num_constraints


def _child_main() -> None:
    import os
    import pickle
    import signal
    import struct
    import sys

    # Ctrl-C reaches the parent, which asks us to stop through stdin: the incumbent must survive it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Frames go to the original stdout; anything else written to fd 1 (a library's print) to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    lock = threading.Lock()

    def send(frame):
        data = pickle.dumps(frame)
        with lock:
            out.write(struct.pack("<Q", len(data)) + data)
            out.flush()

    stdin = sys.stdin.buffer
    job = pickle.load(stdin)
    stdin.readline()  # the job's end
    stop = threading.Event()

    def listen():
        stdin.readline()  # "stop", or EOF when the parent is gone
        stop.set()

    threading.Thread(target=listen, name="cpsat-listen", daemon=True).start()
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        send(("missing",))
        return
    try:
        send(("result", *_search(job, send, stop)))
    except Exception as exc:  # the parent turns it into one line
        send(("error", f"{type(exc).__name__}: {exc}"))
    out.close()
    sys.stderr.flush()
    # Straight out: the listener thread still blocks on stdin, and an orderly interpreter shutdown
    # with it (or CP-SAT's threads) around can stall or abort.
    os._exit(0)


if __name__ == "__main__":
    _child_main()
