"""The chained window relaxation (poet_opt/solver/chain_bound.py) is a proven lower bound: its MILP
optimum never exceeds the full MILP's optimum (itself checked against the exhaustive search in
tests/test_exhaustive.py), nor the exhaustive optimum on the tiniest graphs, for any set of
stage-disjoint windows, in every mode, with and without a runtime budget."""

from __future__ import annotations

import math
import random

import pytest

from conftest import make_test_device
from exhaustive import exhaustive_optimum
from poet_opt.device.costs import node_costs
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.chain_bound import ChainModel, chain_bound, spread_windows
from poet_opt.solver.formulation import Formulation
from test_bounds import exact_optimum, random_budget_case

DEVICE = make_test_device()
REL = 1e-7  # HiGHS's tolerances on an objective of order one


def _disjoint_windows(rnd: random.Random, T: int) -> list[tuple[int, int]]:
    """2-4 stage-disjoint windows of 1-3 stages, some with no stage between them."""
    out, a = [], rnd.randrange(0, max(1, T // 3))
    while a < T and len(out) < rnd.choice([2, 3, 4]):
        b = min(T - 1, a + rnd.choice([0, 0, 1, 2]))
        out.append((a, b))
        a = b + 1 + rnd.choice([0, 1, 2, 4])
    return out


def _case(seed: int):
    return random_budget_case(seed, sizes=(6, 8, 10), ram_shares=(0.0, 0.2, 0.4, 0.7),
                              modes=("joint", "remat", "remat", "remat", "paging"))


@pytest.mark.parametrize("seed", range(24))
def test_no_chained_bound_exceeds_the_optimum(seed):
    graph, costs, budgets, mode, rnd = _case(seed)
    optimum = exact_optimum(graph, costs, budgets, mode, time_limit=60)
    T = len(graph)
    for _ in range(6):
        windows = _disjoint_windows(rnd, T)
        if len(windows) < 2:
            continue
        result = solve_milp(ChainModel(graph, costs, budgets, mode, windows).milp, gap=0, time_limit=30)
        assert result.status == "optimal", (windows, result.status)
        assert result.objective <= optimum * (1 + REL), (windows, mode, result.objective, optimum)


@pytest.mark.parametrize("seed", range(4))
def test_chained_bounds_stay_below_the_exhaustive_optimum(seed):
    rnd = random.Random(100 + seed)
    graph = random_training_graph(3, seed=seed, max_fan_in=2, skip_prob=0.5)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = int(lo + (hi - lo) * 0.3)
    mode = rnd.choice(["joint", "remat"])
    optimum = exhaustive_optimum(graph, costs, ram, mode=mode)
    assert optimum is not None
    budgets = Budgets(ram_bytes=ram, runtime_s=math.inf, storage_bytes=1 << 30)
    T = len(graph)
    for a in range(T):
        for b in range(a, T):
            for c in range(b + 1, T):
                for d in range(c, T):
                    result = solve_milp(ChainModel(graph, costs, budgets, mode, [(a, b), (c, d)]).milp, gap=0,
                                        time_limit=10)
                    assert result.objective <= optimum * (1 + REL) + 1e-15, ((a, b), (c, d))


def test_the_chained_bound_rises_above_one_window_and_stays_below_the_optimum():
    """Where plain training overflows over many stages, the chain proves more than the floor, and
    never more than the optimum."""
    graph = random_training_graph(16, seed=5, max_fan_in=3, skip_prob=0.5)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(ram_bytes=int(lo + 0.4 * (hi - lo)), runtime_s=math.inf, storage_bytes=1 << 30)
    exact = solve_milp(Formulation(graph, costs, budgets, "remat").milp, gap=0, time_limit=60)
    assert exact.status == "optimal" and exact.objective > costs.plain_energy_j
    found = chain_bound(graph, costs, budgets, "remat", time_limit=20, width=1)
    assert found is not None and found.method.startswith("chained windows")
    assert costs.plain_energy_j < found.bound <= exact.objective * (1 + REL)


def test_no_windows_where_plain_training_fits():
    graph = random_training_graph(8, seed=1)
    costs = node_costs(graph, DEVICE)
    budgets = Budgets(ram_bytes=graph.plain_peak_bytes(), runtime_s=math.inf, storage_bytes=1 << 30)
    assert spread_windows(graph, budgets, 4, 2) == []
    assert chain_bound(graph, costs, budgets, "remat", time_limit=5) is None


def test_a_solve_past_the_size_limit_takes_the_chained_bound(monkeypatch):
    """With the full MILP skipped, the driver runs the chain after the single window (here left out,
    so the chain must prove the bound: within 0.1% of the optimum), never above the optimum."""
    import poet_opt.solver.driver as driver

    graph = random_training_graph(24, seed=3, max_fan_in=3, skip_prob=0.5)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = int(lo + 0.3 * (hi - lo))
    exact = driver.solve(graph, DEVICE, ram=ram, mode="remat", gap=0, order="given", time_limit=60).solver
    assert exact["status"] == "optimal_for_order"
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    monkeypatch.setattr(driver, "window_bound", lambda *args, **kwargs: None)
    solver = driver.solve(graph, DEVICE, ram=ram, mode="remat", gap=1e-9, order="given", time_limit=20).solver
    assert solver["full_milp"].startswith("skipped")
    assert solver["bound_source"].startswith("chained windows"), solver["bound_source"]
    assert solver["plain_floor_j"] < solver["bound"] <= exact["objective"] * (1 + REL)
    assert solver["bound"] >= exact["objective"] * (1 - 1e-3)
