"""A CP-SAT backend: the problem as retention intervals (the idea of Moccasin, ICML 2023).

Written from the published formulation idea, for our stage model (docs/formulation.md), not from
any project's code. Time is the stage/position axis of the formulation flattened to integers:
position k of stage t is the point ``T*t + k``. Every tensor i has a few *retention intervals*
``[start, end)`` on that axis:

- the first starts where node i is computed in its own stage (``T*i + i``), and is always there;
- each further one (optional) starts at position i of a later stage s (``T*s + i``), where i is
  either recomputed (its inputs must then be resident) or paged in (i must have been paged out,
  right after its first computation, as in the MILP);
- an interval may run across stages (the tensor is kept) and ends right after a position of its
  last stage (where its last reader there ran), so ``end = T*e + l + 1`` with ``i <= l < T``.

Intervals of one tensor are ordered and stage-disjoint (never rematerialized while resident, at
most once per stage). Precedence: every computation of a node, its own or a recomputation, lies
inside an interval of each of its inputs. Memory: one cumulative constraint over all intervals,
demand = the tensor's bytes, capacity = the RAM budget. Runtime and storage are linear rows, the
objective is the energy of recomputations, page-ins and page-outs on top of plain training.

Why this is the same problem as the MILP, and when its answers are proofs:

- Memory. Between two positions nothing starts, so the resident set at any point of the axis is a
  subset of the one at the last position before it; the cumulative constraint is exactly the peak
  that ``build_steps`` replays (it frees a tensor right after its last reader in a stage unless it
  is kept), so every solution decodes to a plan within budget, and every plan of the MILP is a
  solution with intervals ending at its last reads.
- Interval counts. Each interval after the first is a materialization that must contain a read,
  so a tensor needs at most one more interval than the stages in which its readers can run; and
  with a plan of extra energy ``cost_cap`` above plain training in hand, no plan at least as good
  has more than ``cost_cap / (cheapest way back)`` of them. The model gets that many (exact), or
  ``max_intervals`` when that is fewer (*truncated*: the published model's fixed C). Only an exact
  model's bound and infeasibility are claims about the problem; a truncated one reports no bound
  (the driver then keeps the plain-training floor) and never says infeasible.
- Numbers. CP-SAT wants integers. Energies are rounded *down* to units of 1e-12 of plain training
  (or coarser if the sum would overflow), so the model's bound is a true lower bound; times are
  rounded down first (every plan within the budget stays feasible, the bound stays valid) and, when
  the plan found overshoots the real budget by that rounding, solved again rounded up.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from poet_opt.device.costs import NodeCosts
from poet_opt.errors import PoetError
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, build_steps, totals_of
from poet_opt.solver.backends import Progress, interrupt_scope, relative_gap
from poet_opt.solver.formulation import horizons

# The published model fixes a small number of intervals per tensor; ours takes the exact count where
# it is at most this many (see the module docstring), so that the bound is a proof more often.
MAX_INTERVALS = 4
# ... unless all tensors together need at most this many per node on average: then each gets its exact
# need, however many (small graphs, where a proof is cheap and tests compare optima).
EXACT_INTERVALS_PER_NODE = 6


@dataclass
class CpSatResult:
    """What the CP-SAT search found and proved, in the problem's own terms."""

    status: str  # optimal | gap_limit | time_limit | interrupted | infeasible | no_solution | stopped
    decisions: Optional[Decisions]
    objective: Optional[float]  # the model's energy of the plan, J (the driver re-measures it by replay)
    bound: Optional[float]  # a proven lower bound on every plan (None: none beyond plain training)
    solve_s: float
    exact: bool  # every tensor got all the intervals a plan at least as good as the start can use
    variables: int
    constraints: int
    note: str = ""


def available() -> bool:
    """Whether OR-Tools is installed, without importing it here (see _run: never beside highspy)."""
    import importlib.util

    return importlib.util.find_spec("ortools") is not None


def _require_ortools() -> None:
    if not available():
        raise PoetError(_MISSING, field="--solver")


def interval_counts(graph: TrainingGraph, costs: NodeCosts, mode: str, cost_cap: Optional[float],
                    max_intervals: int = MAX_INTERVALS, exact_intervals_per_node: float = EXACT_INTERVALS_PER_NODE
                    ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Intervals per tensor (the first included), the exact need for each, and whether every tensor
    got its exact need."""
    allow_remat, allow_paging = mode in ("joint", "remat"), mode in ("joint", "paging")
    T = len(graph)
    cap = math.inf if cost_cap is None else max(float(cost_cap), 0.0)
    recomputable = np.array([allow_remat and not n.is_backward for n in graph.nodes]) & (costs.compute_j <= cap)
    need, comp = horizons(graph, allow_remat, recomputable)
    users = graph.users()
    exact = np.ones(T, dtype=np.int64)
    for i in range(T):
        can_remat = bool(recomputable[i]) and comp[i] > i
        can_page = allow_paging and need[i] > i and costs.page_out_j[i] + costs.page_in_j[i] <= cap
        if not (can_remat or can_page):
            continue
        read_stages = set()
        for r in users[i]:
            read_stages.update(range(r, (comp[r] if allow_remat else r) + 1))
        extra = len([s for s in read_stages if i < s <= need[i]])
        if math.isfinite(cap):
            cheapest = min([float(costs.compute_j[i])] * int(can_remat) + [float(costs.page_in_j[i])] * int(can_page))
            if cheapest > 0:
                # a hair over, so that rounding never drops an interval a plan could use
                extra = min(extra, int(math.floor(cap / cheapest * (1 + 1e-9) + 1e-9)))
        exact[i] = 1 + extra
    if int(exact.sum()) <= exact_intervals_per_node * T:
        return exact, exact, True  # small enough to model every interval a better plan could use
    counts = np.minimum(exact, max(1, int(max_intervals)))
    return counts, exact, bool((counts == exact).all())


def solve_cpsat(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str, *,
                time_limit: Optional[float] = None, gap: float = 1e-3, threads: Optional[int] = None,
                progress: Optional[Callable[[Progress], None]] = None, starts: tuple = (),
                cost_cap: Optional[float] = None, max_intervals: int = MAX_INTERVALS,
                exact_intervals_per_node: float = EXACT_INTERVALS_PER_NODE) -> CpSatResult:
    """Solve with CP-SAT. ``starts``: valid plans, best first (the first is the hint, and its extra
    energy ``cost_cap`` bounds the interval counts). The time limit covers both roundings of the
    runtime row; Ctrl-C (``interrupt_scope``) stops the search and keeps the incumbent."""
    _require_ortools()
    began = time.perf_counter()
    counts, exact_counts, exact = interval_counts(graph, costs, mode, cost_cap, max_intervals, exact_intervals_per_node)
    problem = _problem(graph, costs, budgets, mode)
    result = CpSatResult("time_limit", None, None, None, 0.0, exact, 0, 0)
    for round_up in (False, True):
        left = None if time_limit is None else time_limit - (time.perf_counter() - began)
        if left is not None and left <= 0.01:
            break  # the time limit went on the first rounding: its answer stands
        hint = starts[0] if starts else None
        job = dict(problem=problem, counts=counts, round_up=round_up, time_limit=left, gap=gap, threads=threads,
                   hint=None if hint is None else (hint.recompute, hint.page_in, hint.page_out, hint.keep),
                   # wall-clock, so that the child's start-up and model building count against the limit
                   deadline=None if left is None else time.time() + left,
                   progress=progress is not None, bound_is_proof=exact and not round_up)
        status, decisions, objective, model_bound, num_vars, num_rows = _run(job, progress, time.perf_counter())
        if not round_up:
            result.variables, result.constraints = num_vars, num_rows
            if exact and model_bound is not None:
                result.bound = model_bound  # times rounded down: a bound on every plan of the problem
        # With times rounded up the model is a restriction: its "none" proves nothing.
        result.status = "no_solution" if round_up and status == "infeasible" else status
        if decisions is not None and _fits_runtime(graph, costs, decisions, budgets):
            result.decisions, result.objective = decisions, objective
            if round_up and status in ("optimal", "gap_limit"):
                result.status = "stopped"  # proven for the rounded-up times only, not for the budget
            break
        if decisions is None or status == "interrupted":
            break
        # The plan overshoots the real runtime budget by the rounding of its times: solve again with
        # them rounded up, where every plan fits; the first solve's bound stays the bound.
    result.solve_s = time.perf_counter() - began
    if not exact:
        if result.status == "infeasible":
            result.status = "no_solution"  # only the truncated model has none: not a proof
        if result.status in ("optimal", "gap_limit"):
            result.status = "stopped"  # finished the restricted search, which proves nothing
    result.note = (f"cpsat: up to {int(counts.max(initial=1))} retention intervals per tensor"
                   + (" (all a plan at least as good as the start can use)" if exact else
                      f" (a plan may use up to {int(exact_counts.max(initial=1))}: the model's bound is not a "
                      "proof, plain training's floor stands)"))
    return result


def _problem(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str) -> dict:
    """What the child needs, as plain data (it imports nothing of poet_opt). Horizons without the
    cost cap: the interval counts encode it."""
    allow_remat = mode in ("joint", "remat")
    recomputable = np.array([allow_remat and not n.is_backward for n in graph.nodes], dtype=bool)
    need, comp = horizons(graph, allow_remat, recomputable)
    names = ("compute_j", "compute_s", "page_in_j", "page_in_s", "page_out_j", "page_out_s", "storage_bytes",
             "erased_bytes")
    return dict(deps=[list(n.deps) for n in graph.nodes], bytes=[int(n.bytes) for n in graph.nodes],
                allow_remat=allow_remat, allow_paging=mode in ("joint", "paging"), recomputable=recomputable,
                need=need, comp=comp, costs={k: np.asarray(getattr(costs, k), dtype=float) for k in names},
                plain_energy_j=float(costs.plain_energy_j), plain_runtime_s=float(costs.plain_runtime_s),
                ram_bytes=float(budgets.ram_bytes), runtime_s=float(budgets.runtime_s),
                storage_bytes=float(budgets.storage_bytes), erase_bytes=float(budgets.erase_bytes))


def _fits_runtime(graph, costs, decisions, budgets) -> bool:
    replayed = totals_of(graph, costs, build_steps(graph, decisions))["runtime_s"]
    return replayed <= budgets.runtime_s * (1 + 1e-9)


# -- the search, in a child process ---------------------------------------------------------------
#
# OR-Tools bundles its own HiGHS (1.12 in ortools 9.15) under the same library name as highspy's
# (libhighs.so.1, 1.15 here): whichever loads first serves both, and the other fails on a missing
# symbol. So OR-Tools is never imported in the process that runs HiGHS: the model is built and
# solved in a child (``python -m poet_opt.solver.cpsat_child``), which reads one job from stdin and writes
# length-prefixed pickles back (progress, then the result). A line on stdin, or its end, asks the
# child to stop the search and report its incumbent: that is how Ctrl-C and the time limit reach
# CP-SAT (``stop_search``), and the parent kills a child that overruns its limit by far.

# Past the time limit, when the child is asked to stop (CP-SAT keeps its own limit; this covers a
# child still starting up or building the model on a loaded machine), and when it is killed: the
# driver then falls back on the heuristic start.
STOP_GRACE_S = 0.5
KILL_GRACE_S = 3.0
# After Ctrl-C, how long the child may take to hand over its incumbent before it is killed.
INTERRUPT_GRACE_S = 1.5


def _run(job: dict, progress, began: float):
    """One CP-SAT search in a child process: (status, decisions, objective, bound, variables, rows)."""
    import os
    import pickle
    import queue
    import struct
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    with interrupt_scope() as stop:
        if stop.is_set():
            return "interrupted", None, None, None, 0, 0
        child = subprocess.Popen([sys.executable, "-m", "poet_opt.solver.cpsat_child"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        frames: "queue.Queue" = queue.Queue()

        def read():
            try:
                while True:
                    head = child.stdout.read(8)
                    if len(head) < 8:
                        break
                    frames.put(pickle.loads(child.stdout.read(struct.unpack("<Q", head)[0])))
            finally:
                frames.put(None)

        try:
            reader = threading.Thread(target=read, name="cpsat-reader", daemon=True)
            reader.start()
            try:
                child.stdin.write(pickle.dumps(job))
                child.stdin.write(b"\n")  # the job's end; the child then waits for a stop line or EOF
                child.stdin.flush()
            except BrokenPipeError:
                pass
            limit = job["time_limit"]
            asked, killed = 0.0, False
            result = None
            while True:
                try:
                    frame = frames.get(timeout=0.05)
                except queue.Empty:
                    frame = ()
                if frame is None:
                    break
                if frame and frame[0] == "progress" and progress is not None:
                    inc, bnd, _ = frame[1:]
                    if not job["bound_is_proof"]:
                        bnd = None  # the restricted model's bound says nothing about the problem
                    progress(Progress(time.perf_counter() - began, inc, bnd, relative_gap(inc, bnd), "cp-sat"))
                elif frame and frame[0] in ("result", "error", "missing"):
                    result = frame
                    break  # the child exits on its own; no need to wait for its pipes to close
                over = None if limit is None else time.perf_counter() - began - limit
                if not asked and (stop.is_set() or (over is not None and over > STOP_GRACE_S)):
                    asked = time.perf_counter()
                    try:
                        child.stdin.write(b"stop\n")
                        child.stdin.flush()
                    except (BrokenPipeError, OSError):
                        pass
                # a child that does not answer a stop in time (still starting up, on a loaded machine) is
                # killed: at the time limit, or at once after Ctrl-C, which promises to stop in seconds
                late = (over is not None and over > KILL_GRACE_S) or \
                    (stop.is_set() and asked and time.perf_counter() - asked > INTERRUPT_GRACE_S)
                if not killed and late:
                    killed = True
                    child.kill()
        except BaseException:
            # SIGTERM, or a Ctrl-C that ends the whole command: no search may outlive the command
            child.kill()
            child.wait()
            raise
        was_interrupted = stop.is_set()  # by the user, not by our own stop at the time limit
    try:
        child.stdin.close()  # EOF: the child's listener stops, if it still runs
    except OSError:
        pass
    try:
        child.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    stderr = child.stderr.read().decode(errors="replace").strip()
    if result is None:
        if killed:
            return ("interrupted" if was_interrupted else "time_limit"), None, None, None, 0, 0
        raise PoetError("the CP-SAT search process ended without an answer"
                        + (f": {stderr.splitlines()[-1]}" if stderr else f" (exit {child.returncode})"))
    if result[0] == "missing":
        raise PoetError(_MISSING, field="--solver")
    if result[0] == "error":
        raise PoetError(f"CP-SAT failed on this model: {result[1]}; please report this with the command line "
                        "you used")
    status, plan, objective, bound, num_vars, num_rows = result[1:]
    decisions = None if plan is None else Decisions(*plan)
    if was_interrupted and status in ("time_limit", "no_solution"):
        status = "interrupted"
    elif not was_interrupted and status == "interrupted":
        status = "time_limit"  # we stopped it, at the time limit
    return status, decisions, objective, bound, num_vars, num_rows


_MISSING = "--solver cpsat needs OR-Tools, which is not installed: pip install 'poet-opt[cpsat]'"
