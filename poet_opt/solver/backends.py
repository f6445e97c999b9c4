"""MILP backends: HiGHS in-process through highspy (default), CBC or Gurobi through PuLP.

Every backend takes the same bulk-built :class:`~poet_opt.solver.formulation.Milp` and returns a
:class:`SolveResult`: the incumbent (if any), the proven bound, and a status that says why the
search stopped. A time-out with an incumbent is a result, not an error.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.solver.formulation import Milp

BACKENDS = ("highs", "cbc", "gurobi")


@dataclass
class Progress:
    elapsed_s: float
    incumbent: Optional[float]
    bound: Optional[float]
    gap: Optional[float]
    phase: str = "branch and bound"


@dataclass
class SolveResult:
    status: str  # optimal | gap_limit | time_limit | interrupted | infeasible | no_solution | error
    x: Optional[np.ndarray]
    objective: Optional[float]
    bound: Optional[float]
    solve_s: float
    backend: str
    # an LP's row multipliers as HiGHS left them (c - A'y its reduced costs), whatever its status:
    # not a claim of optimality, only what dual_bound.py turns into a bound it proves itself
    duals: Optional[np.ndarray] = None

    @property
    def gap(self) -> Optional[float]:
        return relative_gap(self.objective, self.bound)


def relative_gap(objective: Optional[float], bound: Optional[float]) -> Optional[float]:
    """(objective - bound) / |objective|, the gap reported everywhere; None when either is unknown."""
    if objective is None or bound is None:
        return None
    if abs(objective) < 1e-12:
        return 0.0
    return max(0.0, (objective - bound) / abs(objective))


_ACTIVE_FLAG: Optional[threading.Event] = None


def interrupted() -> bool:
    """Whether a Ctrl-C arrived in the current interrupt scope (see ``interrupt_scope``)."""
    return _ACTIVE_FLAG is not None and _ACTIVE_FLAG.is_set()


_CTRL_C_ENDS_ALL = threading.Event()


@contextmanager
def ctrl_c_ends_everything():
    """Within it, Ctrl-C raises KeyboardInterrupt during a solve too, as it does everywhere else:
    for a solve that is one step of a longer job (`emulate` and `run` compile and train after it),
    where keeping the best plan so far would run the rest of the job on it after the user asked
    the whole to stop."""
    if _CTRL_C_ENDS_ALL.is_set():
        yield
        return
    _CTRL_C_ENDS_ALL.set()
    try:
        yield
    finally:
        _CTRL_C_ENDS_ALL.clear()


@contextmanager
def interrupt_scope():
    """Ctrl-C asks the solver to stop and keep its incumbent instead of killing the process. One
    scope spans a whole solve: a Ctrl-C during one phase (a restricted MILP, a heuristic) is not
    forgotten by the next, which then stops at once. Nested scopes share the outer flag. Inside
    ``ctrl_c_ends_everything`` the scope leaves Ctrl-C alone, and its flag is never set."""
    global _ACTIVE_FLAG
    if _ACTIVE_FLAG is not None:
        yield _ACTIVE_FLAG
        return
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread() or _CTRL_C_ENDS_ALL.is_set():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if flag.is_set():  # a second Ctrl-C means it
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        flag.set()

    signal.signal(signal.SIGINT, handler)
    _ACTIVE_FLAG = flag
    try:
        yield flag
    finally:
        _ACTIVE_FLAG = None
        signal.signal(signal.SIGINT, previous)


def solve_milp(milp: Milp, *, backend: str = "highs", time_limit: Optional[float] = None,
               gap: float = 1e-3, threads: Optional[int] = None,
               progress: Optional[Callable[[Progress], None]] = None,
               start: Optional[np.ndarray] = None, settle: Optional["Settle"] = None,
               lp_solver: Optional[str] = None, presolve: bool = True) -> SolveResult:
    """settle (HiGHS only): stop before ``gap`` once the search is within ``settle.gap`` and has
    stopped improving (see Settle); the status is then ``gap_limit``, as for the gap asked for.
    lp_solver (HiGHS, an LP): "ipm" or "pdlp", without crossover, for row multipliers (``duals``)
    where the simplex would not finish; the objective of such a run is not a bound (dual_bound.py).
    presolve (HiGHS): off for an LP its presolve leaves the interior point stalled on."""
    if backend not in BACKENDS:
        raise PoetError(f"unknown solver {backend!r}; choose one of {', '.join(BACKENDS)}", field="--solver")
    # Energies in joules are tiny next to solver tolerances (HiGHS treats reduced costs under 1e-7
    # as zero, and a microcontroller's recompute of a small node costs 1e-8 J): solve with the
    # objective scaled to order one, and scale the answers back.
    scale = 1.0 / max(abs(milp.offset), float(np.abs(milp.c).max(initial=0.0)), 1e-300)
    scaled = replace(milp, c=milp.c * scale, offset=milp.offset * scale)
    if progress is not None:
        report = progress

        def progress(p: Progress):
            report(Progress(p.elapsed_s, _unscale(p.incumbent, scale), _unscale(p.bound, scale), p.gap, p.phase))

    if backend == "highs":
        result = _solve_highs(scaled, time_limit, gap, threads, progress, start, settle, lp_solver, presolve)
    else:
        result = _solve_pulp(scaled, backend, time_limit, gap, threads)
    result.objective = _unscale(result.objective, scale)
    result.bound = _unscale(result.bound, scale)
    if result.duals is not None:
        result.duals = result.duals / scale
    return result


def solve_lps(milps: list[Milp], *, time_limit: float, workers: int, lp_solver: Optional[str] = None,
              presolve: bool = True) -> list[Optional[SolveResult]]:
    """Several LPs with HiGHS at once, ``workers`` at a time, one thread each, largest first, all
    within ``time_limit``: each one's result (its ``duals`` for dual_bound.py), None for one not
    started in time. HiGHS releases the interpreter while it runs, so they share the cores. The
    workers are daemon threads the caller waits for: a signal that ends the command leaves them
    to leave_now_if_abandoned, as a single run left to its thread."""
    started = time.perf_counter()
    results: list[Optional[SolveResult]] = [None] * len(milps)
    queue = sorted(range(len(milps)), key=lambda k: -milps[k].A.nnz)
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                if not queue:
                    return
                k = queue.pop(0)
            left = time_limit - (time.perf_counter() - started)
            if left <= 0.05 or interrupted():
                return
            results[k] = solve_milp(milps[k], time_limit=left, gap=0.0, threads=1, lp_solver=lp_solver,
                                    presolve=presolve)

    pool = [threading.Thread(target=work, name="highs-lps", daemon=True) for _ in range(max(1, workers))]
    for thread in pool:
        thread.start()
    try:
        for thread in pool:
            while thread.is_alive():
                thread.join(0.2)
    except BaseException:
        _ABANDONED.extend(pool)
        _CUT_SHORT.extend(pool)
        raise
    return results


@dataclass(frozen=True)
class Settle:
    """When a search for a plan (not a proof) may stop short of its gap: once within ``gap`` (relative),
    as soon as no better solution has come for ``stall`` of the time spent so far, or once it has run
    ``cap`` times as long as it took to get within ``gap``; either way not before ``min_stall_s``
    more (the last steps of a solve that took a fraction of a second come a few tenths apart).

    The restricted gap MILP finds most of its plan by 0.01% and then improves it in small steps,
    often for as long again (benchmarks/HARD.md): those steps are where CP-SAT's cheaper plans were,
    and a search that has stopped improving is not worth the wait."""

    gap: float
    stall: float = 0.2
    min_stall_s: float = 0.75
    cap: float = 3.0


def _unscale(value: Optional[float], scale: float) -> Optional[float]:
    return None if value is None else value / scale


def highs_lp(milp: Milp, *, relax: bool = False):
    """The MILP as a HiGHS model in one bulk hand-over (``relax``: integrality dropped, the LP
    relaxation)."""
    import highspy

    inf = highspy.kHighsInf
    A = milp.A.tocsc()
    lp = highspy.HighsLp()
    lp.num_col_ = milp.num_vars
    lp.num_row_ = milp.num_rows
    lp.col_cost_ = milp.c
    lp.offset_ = milp.offset
    lp.col_lower_ = np.where(np.isinf(milp.lb), -inf, milp.lb)
    lp.col_upper_ = np.where(np.isinf(milp.ub), inf, milp.ub)
    lp.row_lower_ = np.where(np.isinf(milp.row_lb), -inf, milp.row_lb)
    lp.row_upper_ = np.where(np.isinf(milp.row_ub), inf, milp.row_ub)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = A.indptr.astype(np.int32)
    lp.a_matrix_.index_ = A.indices.astype(np.int32)
    lp.a_matrix_.value_ = A.data
    lp.a_matrix_.num_col_ = milp.num_vars
    lp.a_matrix_.num_row_ = milp.num_rows
    if not relax:
        lp.integrality_ = [highspy.HighsVarType.kInteger if v else highspy.HighsVarType.kContinuous
                           for v in milp.integrality]
    return lp


# How long past its time limit a HiGHS run is waited for before it is given up on: seconds, and a
# fraction of the limit (the whole solve promises limit x 1.05 + 2 s).
HIGHS_GRACE_S = 0.5
HIGHS_GRACE_REL = 0.01
# How long after a Ctrl-C a HiGHS run is waited for (the promise is 2 s to stop in all), and how
# often a phase that calls nothing back is said to be alive (Heartbeat).
INTERRUPT_GRACE_S = 0.7
HEARTBEAT_S = 3.0
_ABANDONED: list[threading.Thread] = []
# runs given up on because an exception (SIGTERM, a Ctrl-C that ends the command) left the wait,
# or None for a signal that came while HiGHS held the model but ran nothing
_CUT_SHORT: list[Optional[threading.Thread]] = []


@atexit.register
def _wait_for_abandoned_runs() -> None:
    # A thread still inside HiGHS when the interpreter shuts down may crash it on its way back into
    # Python; each was asked to stop at HiGHS's next check.
    for worker in _ABANDONED:
        worker.join(ABANDONED_EXIT_WAIT_S)


ABANDONED_EXIT_WAIT_S = 30.0


def leave_now_if_abandoned(code: int, wait_s: float = 0.3) -> None:
    """Ends the process with ``code`` at once when a HiGHS run given up on (after a time limit or a
    Ctrl-C) is still inside HiGHS after ``wait_s`` more seconds: a command that must end now (exit
    130 within 2 s of a Ctrl-C) leaves by os._exit after flushing its output, since interpreter
    shutdown would wait for that run, or crash when it comes back into Python. So does one whose
    run a signal cut short. Otherwise returns."""
    until = time.perf_counter() + wait_s
    for worker in _ABANDONED:
        worker.join(max(0.0, until - time.perf_counter()))
    # A run cut short by a signal aborts the interpreter's shutdown even once it has returned
    # (exit 134, "terminate called without an active exception": 3 in 8 SIGTERMs on ResNet-50 at
    # 6-8 s, after the run had ended), so such a process always leaves by os._exit; everything it
    # writes has landed or been removed by then.
    if _CUT_SHORT or any(worker.is_alive() for worker in _ABANDONED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _solve_highs(milp, time_limit, gap, threads, progress, start, settle=None,
                 lp_solver=None, presolve=True) -> SolveResult:
    try:
        return _run_highs(milp, time_limit, gap, threads, progress, start, settle, lp_solver, presolve)
    except KeyboardInterrupt:
        # A signal anywhere in here, before the run starts too (handing the model over takes
        # seconds): a Highs object the traceback keeps until the interpreter shuts down aborts it
        # (exit 134), so the command leaves by leave_now_if_abandoned
        _CUT_SHORT.append(None)
        raise


def _run_highs(milp, time_limit, gap, threads, progress, start, settle=None,
               lp_solver=None, presolve=True) -> SolveResult:
    import highspy

    entered = time.perf_counter()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", float(gap))
    # HiGHS's default absolute gap (1e-6) is a large fraction of a millijoule-scale objective on
    # a microcontroller; only the relative gap the user asked for should stop the search.
    h.setOptionValue("mip_abs_gap", 0.0)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    if threads:
        h.setOptionValue("threads", int(threads))
    if not presolve:
        h.setOptionValue("presolve", "off")

    h.passModel(highs_lp(milp))
    if start is not None:
        idx = np.arange(milp.num_vars, dtype=np.int32)
        h.setSolution(milp.num_vars, idx, np.asarray(start, dtype=float))
    lp = not np.any(milp.integrality)
    if lp_solver is not None and lp:
        h.setOptionValue("solver", lp_solver)
        h.setOptionValue("run_crossover", "off")
    if time_limit is not None:
        # Handing a large model over takes seconds (1-1.3 s at 156k columns, element by element
        # through pybind11): they count against the limit the caller gave.
        time_limit = max(0.01, float(time_limit) - (time.perf_counter() - entered))
        h.setOptionValue("time_limit", time_limit)

    started = time.perf_counter()
    with interrupt_scope() as stop:
        if stop.is_set():  # interrupted in an earlier phase: do not start a search
            return SolveResult("interrupted", None, None, None, 0.0, "highs")
        last_report = [0.0]

        abandoned = threading.Event()
        seen = {"x": None, "objective": None, "bound": None}
        # settle: when the search first got within settle.gap, when it last improved, whether it settled
        calm = {"within": None, "improved": started, "settled": False}

        def settled(out) -> bool:
            now = time.perf_counter()
            inc, bnd = out.mip_primal_bound, out.mip_dual_bound
            if calm["within"] is None:
                if abs(inc) >= 1e300 or abs(bnd) >= 1e300 or relative_gap(inc, bnd) > settle.gap:
                    return False
                calm["within"] = now
            spent, within = now - started, calm["within"] - started
            if spent - within < settle.min_stall_s:
                return False
            quiet = now - calm["improved"] >= max(settle.min_stall_s, settle.stall * spent)
            return quiet or spent >= settle.cap * within

        def on_interrupt(event, mip: bool = True):
            if stop.is_set() or abandoned.is_set():
                event.data_in.user_interrupt = True
            elif mip and settle is not None and settled(event.data_out):
                calm["settled"] = True
                event.data_in.user_interrupt = True
            if mip:
                bnd = event.data_out.mip_dual_bound
                if math.isfinite(bnd) and abs(bnd) < 1e300:
                    seen["bound"] = bnd
            now = time.perf_counter() - started
            if progress is None or now - last_report[0] < 1.0:
                return
            last_report[0] = now
            if not mip:  # the root LP of a large model can run for minutes before branch and bound calls back
                progress(Progress(now, None, None, None, "LP relaxation"))
                return
            out = event.data_out
            inc = out.mip_primal_bound if abs(out.mip_primal_bound) < 1e300 else None
            bnd = out.mip_dual_bound if abs(out.mip_dual_bound) < 1e300 else None
            g = out.mip_gap if inc is not None and math.isfinite(out.mip_gap) else None
            progress(Progress(now, inc, bnd, g))

        def on_lp_interrupt(event):
            on_interrupt(event, mip=False)

        def on_solution(event):  # kept for a run that is given up on (below)
            calm["improved"] = time.perf_counter()
            seen["x"] = np.array(event.data_out.mip_solution, dtype=float)
            seen["objective"] = event.data_out.objective_function_value

        h.cbMipInterrupt.subscribe(on_interrupt)
        h.cbSimplexInterrupt.subscribe(on_lp_interrupt)
        h.cbIpmInterrupt.subscribe(on_lp_interrupt)
        h.cbMipImprovingSolution.subscribe(on_solution)
        # HiGHS checks its time limit and interrupt flag only now and then: its MIP presolve on
        # ResNet-50's full model (190k columns) ran 8-70 s past a 120 s limit on a loaded machine,
        # and 10 s past a Ctrl-C, with no callback in between (benchmarks/HARD.md). It runs in a
        # thread (highspy releases the GIL) that is given up on past the limit and a grace, or
        # INTERRUPT_GRACE_S after a Ctrl-C: the answer is then what the callbacks saw, and the
        # thread stops itself at HiGHS's next check (each callback asks it to).
        failure: list[BaseException] = []

        def run():
            try:
                h.run()
            except BaseException as exc:  # raised in the caller's thread, as without one
                failure.append(exc)

        worker = threading.Thread(target=run, name="highs", daemon=True)
        worker.start()
        wait_until = (math.inf if time_limit is None
                      else started + float(time_limit) + HIGHS_GRACE_S + HIGHS_GRACE_REL * float(time_limit))
        stop_seen = None
        try:
            while worker.is_alive():
                now = time.perf_counter()
                if now >= wait_until:
                    break
                if stop.is_set():
                    stop_seen = now if stop_seen is None else stop_seen
                    if now - stop_seen >= INTERRUPT_GRACE_S:
                        break
                worker.join(min(0.2, max(0.0, wait_until - now)))
        except BaseException:
            # SIGTERM, or a Ctrl-C that ends the whole command: the run is given up on, so that
            # the command leaves by leave_now_if_abandoned; an interpreter shutting down under a
            # thread still inside HiGHS aborts (exit 134, "terminate called without an active
            # exception") instead of exiting 143 or 130.
            abandoned.set()
            _ABANDONED.append(worker)
            _CUT_SHORT.append(worker)
            raise
        if worker.is_alive():
            abandoned.set()
            _ABANDONED.append(worker)
            x, objective = seen["x"], seen["objective"]
            if x is not None and not _satisfies(milp, x):
                x = objective = None
            # without a plan of its own the caller falls back on its starts, as after a time limit
            return SolveResult("interrupted" if stop.is_set() else "time_limit", x, objective, seen["bound"],
                               time.perf_counter() - started, "highs")
        if failure:
            raise failure[0]
        interrupted = stop.is_set()
    solve_s = time.perf_counter() - started

    status = h.getModelStatus()
    info = h.getInfo()
    ms = highspy.HighsModelStatus
    has_solution = info.primal_solution_status == 2
    x = np.array(h.getSolution().col_value) if has_solution else None
    objective = info.objective_function_value if has_solution else None
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) and abs(info.mip_dual_bound) < 1e300 else None
    if status == ms.kOptimal:
        if bound is None:
            bound = objective
        # HiGHS calls a solve stopped by the relative-gap criterion "optimal"; say which it was.
        closed = objective is None or objective - bound <= 1e-9 * max(1.0, abs(objective))
        name = "optimal" if closed else "gap_limit"
    elif status in (ms.kInfeasible,):
        name = "infeasible"
    elif status == ms.kInterrupt and calm["settled"] and not interrupted and x is not None:
        name = "gap_limit"  # within settle.gap, and no longer improving
    elif status == ms.kInterrupt or interrupted:
        name = "interrupted"
    elif status in (ms.kTimeLimit, ms.kIterationLimit, ms.kSolutionLimit):
        name = "time_limit"
    else:
        name = "error"
    if name not in ("optimal", "infeasible") and x is None:
        name = "no_solution" if name in ("time_limit", "interrupted") else name
    duals = None
    if lp and not interrupted:
        row_dual = np.array(h.getSolution().row_dual, dtype=float)
        if len(row_dual) == milp.num_rows and np.all(np.isfinite(row_dual)):
            duals = row_dual
    return SolveResult(name, x, objective, bound, solve_s, "highs", duals=duals)


def _satisfies(milp: Milp, x: np.ndarray, tol: float = 1e-6) -> bool:
    """Whether x is a solution of the MILP within tolerances (a solution a callback handed over is
    checked before it is used)."""
    if len(x) != milp.num_vars or not np.all(np.isfinite(x)):
        return False
    if np.any(x < milp.lb - tol) or np.any(x > milp.ub + tol):
        return False
    integer = milp.integrality == 1
    if np.any(np.abs(x[integer] - np.round(x[integer])) > tol):
        return False
    activity = milp.A @ x
    slack = tol * np.maximum(1.0, np.abs(activity))
    return bool(np.all(activity <= milp.row_ub + slack) and np.all(activity >= milp.row_lb - slack))


def _solve_pulp(milp, backend, time_limit, gap, threads) -> SolveResult:
    # pulp 3.x warns about APIs that change in 4.0; the dependency is pinned below 4.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_pulp_model(milp, backend, time_limit, gap, threads)


def _solve_pulp_model(milp, backend, time_limit, gap, threads) -> SolveResult:
    import pulp

    prob = pulp.LpProblem("poet", pulp.LpMinimize)
    xs = [
        pulp.LpVariable(f"x{j}", lowBound=None if math.isinf(lo) else lo, upBound=None if math.isinf(hi) else hi,
                        cat=pulp.LpInteger if integer else pulp.LpContinuous)
        for j, (lo, hi, integer) in enumerate(zip(milp.lb, milp.ub, milp.integrality))
    ]
    prob += pulp.LpAffineExpression([(xs[j], float(v)) for j, v in enumerate(milp.c) if v]) + milp.offset
    A = milp.A.tocsr()
    for r in range(milp.num_rows):
        lo, hi = milp.row_lb[r], milp.row_ub[r]
        cols = A.indices[A.indptr[r]:A.indptr[r + 1]]
        vals = A.data[A.indptr[r]:A.indptr[r + 1]]
        expr = pulp.LpAffineExpression([(xs[j], float(v)) for j, v in zip(cols, vals)])
        if lo == hi:
            prob += expr == float(lo)
        else:
            if not math.isinf(hi):
                prob += expr <= float(hi)
            if not math.isinf(lo):
                prob += expr >= float(lo)

    kwargs = {"msg": False, "gapRel": gap}
    if time_limit is not None:
        kwargs["timeLimit"] = time_limit
    if threads:
        kwargs["threads"] = threads
    if backend == "cbc":
        solver = pulp.PULP_CBC_CMD(**kwargs)
    else:
        solver = pulp.GUROBI(**kwargs) if _gurobi_python_available() else pulp.GUROBI_CMD(**kwargs)
    if not solver.available():
        raise PoetError(f"the {backend} solver is not available on this machine; use --solver highs",
                        field="--solver")
    started = time.perf_counter()
    prob.solve(solver)
    solve_s = time.perf_counter() - started
    status = pulp.LpStatus[prob.status]
    # PuLP leaves variables that appear in no row or objective term unset: any value in bounds will
    # do, take the lower bound.
    lower = np.where(np.isinf(milp.lb), 0.0, milp.lb)
    values = np.array([lower[j] if v.varValue is None else v.varValue for j, v in enumerate(xs)], dtype=float)
    has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    objective = float(milp.c @ values + milp.offset) if has_solution else None
    if status == "Optimal" and prob.sol_status == pulp.LpSolutionOptimal:
        return SolveResult("optimal", values, objective, objective, solve_s, backend)
    if status == "Infeasible":
        return SolveResult("infeasible", None, None, None, solve_s, backend)
    if has_solution:
        # PuLP does not expose CBC's bound; report the gap as unknown rather than invent one.
        return SolveResult("time_limit", values, objective, None, solve_s, backend)
    return SolveResult("no_solution", None, None, None, solve_s, backend)


def _gurobi_python_available() -> bool:
    try:
        import gurobipy  # noqa: F401
    except ImportError:
        return False
    return True


class Heartbeat:
    """Says which phase of a solve runs, every HEARTBEAT_S, from a thread of its own: phases that
    call nothing back (heuristics, building a MILP, a restricted MILP) still show that the solve is
    alive, and a solve that ends within its first seconds says nothing (an error stays one line).
    A solver that reports for itself reports through ``relay()``: on the same clock, and the
    heartbeat keeps quiet while it speaks (HiGHS's presolve can call nothing back for minutes).
    It shows the least energy of the plans a phase was given (a plan of any order is a plan); never
    a bound, which holds for one execution order and is said with it in the summary."""

    def __init__(self, progress: Optional[Callable[[Progress], None]]):
        self._progress = progress
        self._name: Optional[str] = None
        self._incumbent: Optional[float] = None
        self._began = self._said = time.perf_counter()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def phase(self, name: Optional[str], incumbent: Optional[float] = None) -> None:
        self._name = name
        if incumbent is not None and (self._incumbent is None or incumbent < self._incumbent):
            self._incumbent = incumbent

    def relay(self) -> Optional[Callable[[Progress], None]]:
        """A progress callback for a solver that counts from its own start, from now on."""
        if self._progress is None:
            return None
        offset = time.perf_counter() - self._began

        def say(p: Progress) -> None:
            self._said = time.perf_counter()
            self._progress(replace(p, elapsed_s=p.elapsed_s + offset))
        return say

    def _beat(self) -> None:
        while not self._done.wait(0.25):
            now, name = time.perf_counter(), self._name
            if name is not None and now - self._said >= HEARTBEAT_S:
                self._said = now
                self._progress(Progress(now - self._began, self._incumbent, None, None, name))

    def __enter__(self) -> "Heartbeat":
        if self._progress is not None:
            self._thread = threading.Thread(target=self._beat, name="poet-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def print_progress(p: Progress) -> None:
    inc = "-" if p.incumbent is None else f"{p.incumbent:.6g} J"
    bnd = "-" if p.bound is None else f"{p.bound:.6g} J"
    gap = "-" if p.gap is None else f"{100 * p.gap:.2f}%"
    print(f"  [{p.elapsed_s:6.1f}s] {p.phase}: incumbent {inc}  bound {bnd}  gap {gap}", file=sys.stderr, flush=True)
