"""The CP-SAT backend (poet_opt/solver/cpsat.py): a retention-interval model of the same problem.

It must reach the MILP's optimum where it proves one, hand out only schedules the validator accepts,
claim infeasibility only when its model is exact, keep to the time limit, and stop on Ctrl-C."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import default_sigint

from poet_opt.device.costs import node_costs
from poet_opt.errors import InfeasibleError, PoetError
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.validator import validate
from poet_opt.solver import cpsat
from poet_opt.solver.driver import resolve_budgets, solve

pytestmark = pytest.mark.skipif(not cpsat.available(), reason="OR-Tools (poet-opt[cpsat]) is not installed")

# HiGHS keeps the thread count of its first solve in a process and fails a later solve that asks for
# another (pyproject.toml), so its solves here leave it to the default, as the rest of the suite does.
THREADS = {"highs": None, "cpsat": 2}


@pytest.mark.parametrize("mode, seed", [("remat", 3), ("paging", 2), ("joint", 1)])
def test_cpsat_and_highs_agree_on_the_optimum(test_device, mode, seed):
    graph = random_training_graph(6, seed=seed)
    ram = (graph.min_working_set_bytes() + graph.plain_peak_bytes()) // 2
    energy = {}
    for backend in ("highs", "cpsat"):
        schedule = solve(graph, test_device, ram=ram, runtime="2x", mode=mode, backend=backend, gap=0,
                         time_limit=60, order="given", threads=THREADS[backend])
        validate(schedule.to_dict())
        assert schedule.solver["backend"] == backend
        # proven: the interval model of a graph this small has every interval a plan can use
        assert schedule.solver["status"] in ("optimal", "optimal_for_order"), schedule.solver
        energy[backend] = schedule.totals["energy_j"]
    assert math.isclose(energy["highs"], energy["cpsat"], rel_tol=1e-6)


def test_infeasible_budget_is_reported_as_the_milp_reports_it(test_device):
    # paging alone cannot bring this graph under this budget (the MILP proves it too)
    graph = random_training_graph(6, seed=1)
    ram = (graph.min_working_set_bytes() + graph.plain_peak_bytes()) // 2
    for backend in ("highs", "cpsat"):
        with pytest.raises(InfeasibleError):
            solve(graph, test_device, ram=ram, runtime="2x", mode="paging", backend=backend, gap=0, time_limit=60,
                  order="given", threads=THREADS[backend])


def test_a_truncated_model_never_claims_infeasible_or_optimal(test_device):
    """One interval per tensor leaves no recomputation at all: the restricted model has no plan, but
    that proves nothing about the problem, and says so."""
    graph = random_training_graph(6, seed=3)
    costs = node_costs(graph, test_device)
    ram = (graph.min_working_set_bytes() + graph.plain_peak_bytes()) // 2
    budgets = resolve_budgets(graph, test_device, costs, ram, "2x")
    result = cpsat.solve_cpsat(graph, costs, budgets, "remat", time_limit=30, gap=0, threads=2,
                               max_intervals=1, exact_intervals_per_node=0)
    assert not result.exact
    assert result.status == "no_solution" and result.bound is None and result.decisions is None


def test_time_limit_holds_and_the_schedule_validates():
    graph = random_training_graph(40, seed=0)
    limit = 3.0
    started = time.perf_counter()
    schedule = solve(graph, "rpi4", ram=int(0.7 * graph.plain_peak_bytes()), mode="remat", backend="cpsat",
                     gap=0, time_limit=limit, order="given", threads=2)
    took = time.perf_counter() - started
    validate(schedule.to_dict())
    # the child's start-up counts against the limit too; a child that overruns it is stopped, then killed
    assert took < limit + cpsat.KILL_GRACE_S + 1.0, took
    assert schedule.solver["status"] in ("time_limit", "gap_limit", "optimal_for_order", "stopped")
    if schedule.solver["status"] == "time_limit":
        assert schedule.solver["gap"] is not None and schedule.solver["bound"] <= schedule.totals["energy_j"]


def test_missing_ortools_is_a_one_line_error(test_device, monkeypatch):
    monkeypatch.setattr(cpsat, "available", lambda: False)
    graph = random_training_graph(4, seed=1)
    with pytest.raises(PoetError, match=r"pip install 'poet-opt\[cpsat\]'"):
        solve(graph, test_device, ram=graph.plain_peak_bytes(), backend="cpsat")


INTERRUPTED_SOLVE = """
import sys
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.validator import validate
from poet_opt.solver.driver import solve
graph = random_training_graph(60, seed=0)  # about 25 s to its proof on an idle 2-core machine
print("solving", flush=True)
schedule = solve(graph, "rpi4", ram=int(0.7 * graph.plain_peak_bytes()), mode="remat", backend="cpsat", gap=0,
                 time_limit=120, order="given", threads=2)
validate(schedule.to_dict())
print(schedule.solver["status"], schedule.totals["energy_j"], flush=True)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_stops_the_search_and_keeps_the_schedule():
    """Ctrl-C goes to the parent (the child ignores it); the parent asks the child to stop, and the
    solve returns the best schedule so far, marked interrupted, long before the time limit."""
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_SOLVE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=default_sigint)
    assert proc.stdout.readline().strip() == "solving"
    time.sleep(4.0)  # the starts, the child's start-up, and into the search
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr
    assert time.perf_counter() - sent < 4.0  # 1.5 s for the child to hand over, then it is killed
    assert stdout.split()[0] == "interrupted", stdout


# `poet-opt solve --solver cpsat` itself: docs/cpsat.md's command, run by tests/test_docs.py.
