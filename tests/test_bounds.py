"""The window relaxation (poet_opt/solver/bounds.py) is a proven lower bound: never above the optimum.

The optimum comes from the full MILP solved to a zero gap (itself checked against the exhaustive
search in tests/test_exhaustive.py) and, on the tiniest graphs, straight from tests/exhaustive.py.
Every window of every graph, its LP and its MILP, in every mode, with and without a runtime budget."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

import poet_opt.solver.driver as driver
from conftest import make_test_device
from exhaustive import exhaustive_optimum
from poet_opt.device.costs import node_costs
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.bounds import WindowModel, peak_window, solve_window, window_bound
from poet_opt.solver.formulation import Formulation

DEVICE = make_test_device()
REL = 1e-7  # HiGHS's tolerances on an objective of order one


def random_budget_case(seed: int, sizes=(5, 6, 8), ram_shares=(0.0, 0.2, 0.5, 0.8),
                       modes=("joint", "remat", "remat", "paging")):
    """A small random graph, its costs on the test device, a RAM budget at one of ``ram_shares`` of
    the way from its working set to plain training's peak, no runtime budget half the time, a mode,
    and the generator for the rest of the case: what the bound tests check against the optimum."""
    rnd = random.Random(seed)
    graph = random_training_graph(rnd.choice(list(sizes)), seed=seed, max_fan_in=rnd.choice([1, 2, 3]),
                                  skip_prob=rnd.choice([0.3, 0.6]))
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = int(lo + (hi - lo) * rnd.choice(list(ram_shares)))
    runtime = rnd.choice([math.inf, math.inf, float(costs.compute_s.sum()) * rnd.choice([1.05, 1.3])])
    mode = rnd.choice(list(modes))
    return graph, costs, Budgets(ram_bytes=ram, runtime_s=runtime, storage_bytes=1 << 30), mode, rnd


def exact_optimum(graph, costs, budgets, mode, time_limit: float) -> float:
    """The full MILP's optimum at a zero gap, the bound tests' reference; the case is skipped when no
    plan fits its budgets, and must otherwise be proven optimal within ``time_limit``."""
    exact = solve_milp(Formulation(graph, costs, budgets, mode).milp, gap=0, time_limit=time_limit)
    if exact.status == "infeasible":
        pytest.skip("no plan fits")
    assert exact.status == "optimal"
    return exact.objective


def _case(seed: int):
    return random_budget_case(seed)


@pytest.mark.parametrize("seed", range(10))
def test_no_window_bound_exceeds_the_optimum(seed):
    graph, costs, budgets, mode, rnd = _case(seed)
    optimum = exact_optimum(graph, costs, budgets, mode, time_limit=30)
    T = len(graph)
    windows = {(a, b) for a in range(T) for b in range(a, T)}
    for a, b in sorted(rnd.sample(sorted(windows), min(len(windows), 5))) + [(0, T - 1)]:
        model = WindowModel(graph, costs, budgets, mode, a, b)
        for lp in (True, False):
            bound, status, _ = solve_window(model, lp=lp, time_limit=10)
            assert bound is not None, (a, b, lp, status)
            assert bound <= optimum * (1 + REL), (a, b, lp, bound, optimum)


@pytest.mark.parametrize("seed", [7])
def test_window_bounds_stay_below_the_exhaustive_optimum(seed):
    rnd = random.Random(seed)
    graph = random_training_graph(3, seed=seed, max_fan_in=2, skip_prob=0.5)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = int(lo + (hi - lo) * 0.3)
    mode = rnd.choice(["joint", "remat"])
    optimum = exhaustive_optimum(graph, costs, ram, mode=mode)
    assert optimum is not None
    budgets = Budgets(ram_bytes=ram, runtime_s=math.inf, storage_bytes=1 << 30)
    for a in range(len(graph)):
        for b in range(a, len(graph)):
            bound, _, _ = solve_window(WindowModel(graph, costs, budgets, mode, a, b), lp=False, time_limit=10)
            assert bound <= optimum * (1 + REL) + 1e-15


def test_the_window_bound_rises_above_the_floor_and_stays_below_the_optimum():
    graph = random_training_graph(12, seed=5, max_fan_in=3, skip_prob=0.5)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(ram_bytes=int(lo + 0.4 * (hi - lo)), runtime_s=math.inf, storage_bytes=1 << 30)
    exact = solve_milp(Formulation(graph, costs, budgets, "remat").milp, gap=0, time_limit=30)
    assert exact.status == "optimal" and exact.objective > costs.plain_energy_j
    found = window_bound(graph, costs, budgets, "remat", time_limit=3)
    assert found is not None and found.method in ("window LP", "window MILP")
    assert costs.plain_energy_j < found.bound <= exact.objective * (1 + REL)
    assert peak_window(graph, Budgets(ram_bytes=hi, runtime_s=math.inf, storage_bytes=1 << 30), 4) is None


def test_a_solve_past_the_size_limit_reports_the_window_bound_and_its_source(monkeypatch):
    graph = random_training_graph(16, seed=5, max_fan_in=3, skip_prob=0.5)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = int(lo + 0.4 * (hi - lo))
    exact = driver.solve(graph, DEVICE, ram=ram, mode="remat", gap=0, order="given")
    assert exact.solver["status"] == "optimal_for_order"
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    schedule = driver.solve(graph, DEVICE, ram=ram, mode="remat", gap=1e-9, order="given", time_limit=20)
    solver = schedule.solver
    assert solver["full_milp"].startswith("skipped")
    assert solver["bound_source"].startswith("window")
    assert solver["plain_floor_j"] < solver["bound"] <= exact.solver["objective"] * (1 + REL)
    assert solver["gap"] == pytest.approx((solver["objective"] - solver["bound"]) / solver["objective"])


def test_the_floor_is_named_when_nothing_beats_it(monkeypatch):
    graph = random_training_graph(12, 3)
    ram = (graph.min_working_set_bytes() + graph.plain_peak_bytes()) // 2
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    monkeypatch.setattr(driver, "window_bound", lambda *args, **kwargs: None)
    monkeypatch.setattr(driver, "chain_bound", lambda *args, **kwargs: None)
    solver = driver.solve(graph, DEVICE, ram=ram, time_limit=10).solver
    assert solver["bound_source"] == "plain-training floor"
    assert solver["bound"] == pytest.approx(solver["plain_floor_j"])


class _SlowHighs:
    """HiGHS whose run() first spends seconds without a callback, as its MIP presolve does on a large
    model (ResNet-50's full MILP: 8-70 s past a 120 s limit on a loaded machine)."""

    def __init__(self, delay: float):
        import highspy

        base = highspy.Highs

        class Slow(base):
            def run(self):
                time.sleep(delay)
                return base.run(self)

        self.cls = Slow


def test_a_highs_run_past_its_time_limit_is_given_up_on(monkeypatch):
    import highspy

    graph = random_training_graph(12, seed=2, max_fan_in=3, skip_prob=0.5)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(ram_bytes=int(lo + 0.3 * (hi - lo)), runtime_s=math.inf, storage_bytes=1 << 30)
    milp = Formulation(graph, costs, budgets, "remat").milp
    monkeypatch.setattr(highspy, "Highs", _SlowHighs(3.0).cls)
    started = time.perf_counter()
    result = solve_milp(milp, time_limit=0.5)
    wall = time.perf_counter() - started
    assert wall <= 0.5 * 1.05 + 1.0, f"{wall:.2f} s for a 0.5 s limit"
    assert result.status == "time_limit" and result.x is None and result.bound is None


def test_a_solve_keeps_its_time_limit_when_highs_does_not(monkeypatch):
    """Every HiGHS run (gap MILP, window bound, full MILP) stalls past the limit: the heuristic
    start stands, in time."""
    import highspy

    graph = random_training_graph(30, seed=4, max_fan_in=3, skip_prob=0.5)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    monkeypatch.setattr(highspy, "Highs", _SlowHighs(4.0).cls)
    started = time.perf_counter()
    schedule = driver.solve(graph, DEVICE, ram=int(lo + 0.5 * (hi - lo)), mode="remat", time_limit=2.0,
                            order="given")
    wall = time.perf_counter() - started
    assert wall <= 2.0 * 1.05 + 2.0, f"{wall:.2f} s for a 2 s limit"
    assert schedule.totals["peak_ram_bytes"] <= int(lo + 0.5 * (hi - lo))
    assert schedule.solver["bound"] <= schedule.solver["objective"]


def restrict(model: WindowModel, decisions) -> np.ndarray:
    """A plan's values of the window model's columns: what the relaxation argument maps it to."""
    m, a, b = model.milp, model.a, model.b
    x = np.zeros(m.num_vars)
    T = len(model.graph)
    for index, pairs, first in ((model.S, decisions.keep, a), (model.R, decisions.recompute, a),
                                (model.Min, decisions.page_in, a)):
        for t, i in pairs:
            if 0 <= t - first < index.shape[0] and index[t - first, i] >= 0:
                x[index[t - first, i]] = 1
    for i in decisions.page_out:
        if model.Mout[i] >= 0:
            x[model.Mout[i]] = 1
    for index, pairs in ((model.RR, decisions.recompute), (model.RP, decisions.page_in)):
        for t, i in pairs:
            if t > b and index[i] >= 0:
                x[index[i]] = 1
    nb = np.array([n.bytes for n in model.graph.nodes], dtype=float) / float(model.budgets.ram_bytes)
    for k in range(b - a + 1):
        held = model.S[k + 1] >= 0
        x[model.kept[k]] = float(x[model.S[k + 1][held]] @ nb[:T][held]) if held.any() else 0.0
        cols = np.flatnonzero(model.suf[k] >= 0)
        running = 0.0
        for j in sorted(cols, reverse=True):
            x[model.suf[k, j]] = running
            made = sum(x[c] for c in (model.R[k, j], model.Min[k, j]) if c >= 0)
            running += nb[j] * made
    return x


@pytest.mark.parametrize("seed", range(8))
def test_every_plan_maps_to_a_cheaper_point_of_every_window(seed):
    """The relaxation argument itself, on plans the heuristics make for larger graphs than the
    exact solver reaches: a plan restricted to a window keeps every row and costs no more."""
    from poet_opt.schedule.decisions import build_steps, totals_of
    from poet_opt.solver.gap_milp import gap_milp_plan
    from poet_opt.solver.heuristics import starting_points

    rnd = random.Random(seed)
    graph = random_training_graph(rnd.choice([20, 40]), seed=seed, max_fan_in=3, skip_prob=0.5)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    mode = rnd.choice(["joint", "remat", "paging"])
    budgets = Budgets(ram_bytes=int(lo + (hi - lo) * rnd.choice([0.5, 0.8])), runtime_s=math.inf,
                      storage_bytes=1 << 30)
    plans = starting_points(graph, costs, budgets, mode)
    plans += [p for p in [gap_milp_plan(graph, costs, budgets, mode, time_limit=5)] if p is not None]
    if not plans:
        pytest.skip("no plan found to map")
    T = len(graph)
    for plan in plans:
        energy = totals_of(graph, costs, build_steps(graph, plan))["energy_j"]
        for _ in range(4):
            a = rnd.randrange(T)
            model = WindowModel(graph, costs, budgets, mode, a, min(T - 1, a + rnd.choice([0, 3, 10])))
            x, m = restrict(model, plan), model.milp
            activity = m.A @ x
            assert np.all(activity <= m.row_ub + 1e-9) and np.all(activity >= m.row_lb - 1e-9)
            assert np.all(x >= m.lb) and np.all(x <= m.ub)
            assert float(m.c @ x) + m.offset <= energy * (1 + 1e-12)


def test_streamed_weights_read_again_in_every_mode_stay_below_the_optimum():
    """Streamed weights (op "param") may be read again even without remat: the window allows it too,
    or its bound would cover fewer plans than the full model has."""
    from poet_opt.model.zoo import build_model

    graph, mode = build_model("mlp", weights="streamed"), "paging"
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(ram_bytes=int(lo + 0.2 * (hi - lo)), runtime_s=math.inf, storage_bytes=1 << 30)
    exact = solve_milp(Formulation(graph, costs, budgets, mode).milp, gap=0, time_limit=30)
    assert exact.status == "optimal"
    T = len(graph)
    for a in range(0, T, 5):
        bound, _, _ = solve_window(WindowModel(graph, costs, budgets, mode, a, min(T - 1, a + 5)), lp=False,
                                   time_limit=10)
        assert bound <= exact.objective * (1 + REL)


def test_the_drivers_energy_and_runtime_match_the_replay_to_the_bit():
    from poet_opt.schedule.decisions import build_steps, totals_of
    from poet_opt.solver.heuristics import starting_points

    for seed in range(4):
        graph = random_training_graph(30, seed=seed, max_fan_in=3, skip_prob=0.5)
        costs = node_costs(graph, DEVICE)
        lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
        budgets = Budgets(ram_bytes=int(lo + 0.5 * (hi - lo)), runtime_s=math.inf, storage_bytes=1 << 30)
        for plan in starting_points(graph, costs, budgets, "joint"):
            totals = totals_of(graph, costs, build_steps(graph, plan))
            assert driver._energy(graph, costs, plan) == totals["energy_j"]
            tight = Budgets(ram_bytes=budgets.ram_bytes, runtime_s=totals["runtime_s"], storage_bytes=1 << 30)
            assert driver._fits_runtime(graph, costs, plan, tight)
            tighter = Budgets(ram_bytes=budgets.ram_bytes, runtime_s=totals["runtime_s"] * (1 - 1e-6),
                              storage_bytes=1 << 30)
            assert not driver._fits_runtime(graph, costs, plan, tighter)
        assert driver.plain_summary(graph, costs)["peak_ram_bytes"] == hi
