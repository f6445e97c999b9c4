"""The gap-space search (solver/gap_lns.py): the gap MILP's LP rounded, and windows of its model with
the rest of the plan fixed.

What must hold: a rounded point decodes to a plan that replays valid through the independent
validator at exactly the energy the model gives it; the window search never returns a plan worse
than its start, nor one below the gap MILP's own optimum (it searches that space only), and given
time it reaches that optimum; a plan outside the gap space is handed back as it was; and where the
driver skips the full MILP, the plan it reports is this search's or better, with honest claims."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from conftest import make_test_device
from poet_opt.device.costs import node_costs
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver import driver, gap_lns
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.baselines import dtr_decisions
from poet_opt.solver.gap_milp import MAX_EARLY_RETURNS, GapMilp
from poet_opt.solver.heuristics import gap_plan, plan_energy_j, starting_points
from test_lns import replayed_energy

DEVICE = make_test_device()
REL = 1e-6


def _case(seed: int, n_forward: int, frac: float):
    graph = random_training_graph(n_forward, seed=seed, max_fan_in=2, skip_prob=0.4)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    return graph, costs, Budgets(int(lo + (hi - lo) * frac), math.inf, DEVICE.storage.capacity_bytes)


def _gap_optimum(graph, costs, budgets, mode, early_returns=MAX_EARLY_RETURNS) -> float:
    result = solve_milp(GapMilp(graph, costs, budgets, mode, early_returns=early_returns).milp, gap=0.0,
                        time_limit=60)
    assert result.status in ("optimal", "gap_limit")
    return result.objective


def _start(graph, costs, budgets, mode):
    """The greedy gap plan, or where it finds none the rounded LP's plan (without early returns)."""
    start = gap_plan(graph, costs, budgets, allow_paging=mode != "remat", allow_remat=mode != "paging")
    if start is None:
        model = GapMilp(graph, costs, budgets, mode, early_returns=0)
        x = gap_lns.rounded_point(model, time_limit=30)
        if x is None:
            pytest.skip("neither the greedy nor the rounding finds a plan of the gap space here")
        start = model.decode(x)
    return start


@pytest.mark.parametrize("seed, mode, frac", [(1, "remat", 0.4), (2, "joint", 0.3), (3, "remat", 0.5),
                                              (4, "paging", 0.3), (5, "remat", 0.35)])
def test_a_rounded_point_replays_valid_at_the_model_energy(seed, mode, frac):
    graph, costs, budgets = _case(seed, 14, frac)
    model = GapMilp(graph, costs, budgets, mode, early_returns=0)
    x = gap_lns.rounded_point(model, time_limit=30)
    if x is None:
        pytest.skip("no point of the gap space at this budget")
    energy = replayed_energy(graph, costs, budgets, mode, model.decode(x))
    assert energy == pytest.approx(model.milp.c @ x + model.milp.offset, rel=1e-9)
    assert energy >= _gap_optimum(graph, costs, budgets, mode, early_returns=0) * (1 - REL)


@pytest.mark.parametrize("seed, mode, frac", [(11, "remat", 0.4), (12, "joint", 0.3), (13, "remat", 0.3),
                                              (14, "remat", 0.5)])
def test_the_search_stays_between_its_start_and_the_gap_optimum_and_reaches_it(seed, mode, frac):
    graph, costs, budgets = _case(seed, 16, frac)
    start = _start(graph, costs, budgets, mode)
    before = plan_energy_j(graph, costs, start)
    best = _gap_optimum(graph, costs, budgets, mode)
    plan, stats = gap_lns.improve(graph, costs, budgets, mode, start, deadline=time.perf_counter() + 60)
    energy = replayed_energy(graph, costs, budgets, mode, plan)
    assert best * (1 - REL) <= energy <= before * (1 + 1e-12)
    assert energy == pytest.approx(best, rel=REL), "given time, the windows grow to the whole gap MILP"
    assert stats["saved_j"] == pytest.approx(before - energy, abs=1e-12)
    assert (stats["improved"] > 0) == (energy < before * (1 - 1e-9))


def test_a_plan_outside_the_gap_space_is_handed_back_as_it_was():
    graph, costs, budgets = _case(21, 16, 0.4)
    plan = dtr_decisions(graph, costs, budgets.ram_bytes)
    assert plan is not None
    if GapMilp(graph, costs, budgets, "remat").encode(plan) is not None:
        pytest.skip("DTR's plan happens to be in the gap space here")
    began = time.perf_counter()
    same, stats = gap_lns.improve(graph, costs, budgets, "remat", plan, deadline=time.perf_counter() + 30)
    assert same is plan and stats["windows"] == 0 and time.perf_counter() - began < 5


def test_windows_cover_every_stage_the_dearest_first():
    extra = np.array([0, 5, 0, 0, 1, 1, 0, 9, 0, 0], dtype=float)
    starts = gap_lns.window_starts(extra, 4)
    assert 4 <= starts[0] <= 7  # the window over stage 7 (9 J) comes first
    assert {t for a in starts for t in range(a, a + 4)} == set(range(10))


@pytest.mark.parametrize("seed, frac", [(31, 0.35), (32, 0.45)])
def test_searched_plan_is_valid_and_never_above_the_greedy_nor_below_the_gap_optimum(seed, frac):
    graph, costs, budgets = _case(seed, 16, frac)
    greedy = gap_plan(graph, costs, budgets, allow_paging=False, allow_remat=True)
    plan = gap_lns.searched_plan(graph, costs, budgets, "remat", time_limit=60)
    assert plan is not None
    energy = replayed_energy(graph, costs, budgets, "remat", plan)
    assert energy >= _gap_optimum(graph, costs, budgets, "remat") * (1 - REL)
    if greedy is not None:
        assert energy <= plan_energy_j(graph, costs, greedy) * (1 + 1e-12)


def test_where_the_full_milp_is_skipped_the_driver_reports_the_searched_plan_honestly(monkeypatch):
    graph, costs, budgets = _case(41, 20, 0.35)
    calls = []

    def spy(*args, **kwargs):
        calls.append(gap_lns.searched_plan(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    monkeypatch.setattr(driver, "searched_plan", spy)
    schedule = driver.solve(graph, DEVICE, ram=budgets.ram_bytes, mode="remat", gap=1e-3, order="given",
                            time_limit=20)
    solver = schedule.solver
    assert solver["full_milp"].startswith("skipped") and len(calls) == 1
    energy = schedule.totals["energy_j"]
    starts = starting_points(graph, costs, budgets, "remat")
    assert all(energy <= plan_energy_j(graph, costs, d) * (1 + 1e-12) for d in starts + [c for c in calls if c])
    assert solver["bound"] <= energy * (1 + 1e-12)
    assert solver["gap"] == pytest.approx((energy - solver["bound"]) / energy, abs=1e-12)
    assert solver["status"] in ("gap_limit", "optimal_for_order", "optimal") or solver["gap"] > 1e-3
    assert solver["status"] != "gap_limit" or solver["gap"] <= 1e-3


@pytest.mark.parametrize("seed, mode, frac", [(51, "remat", 0.35), (52, "joint", 0.3), (53, "remat", 0.45)])
def test_rins_gives_a_cheaper_valid_point_or_none(seed, mode, frac):
    graph, costs, budgets = _case(seed, 16, frac)
    start = _start(graph, costs, budgets, mode)
    model = GapMilp(graph, costs, budgets, mode)
    x = model.encode(start)
    assert x is not None, "the greedy gap plan is a point of the gap MILP"
    y, lp = gap_lns.rins_point(model, x, time_limit=30)
    assert lp is not None and lp <= plan_energy_j(graph, costs, start) * (1 + 1e-9)
    if y is None:
        return  # a heuristic: the LP may agree with the start where it would have to change
    energy = replayed_energy(graph, costs, budgets, mode, model.decode(y))
    assert energy == pytest.approx(model.milp.c @ y + model.milp.offset, rel=1e-9)
    assert lp * (1 - REL) <= _gap_optimum(graph, costs, budgets, mode) * (1 + REL)
    assert _gap_optimum(graph, costs, budgets, mode) * (1 - REL) <= energy < plan_energy_j(graph, costs, start)


def test_rins_improves_some_weak_starts():
    improved = 0
    for seed in (51, 52, 53, 54):
        graph, costs, budgets = _case(seed, 16, 0.35)
        start = gap_plan(graph, costs, budgets, allow_paging=False, allow_remat=True)
        if start is None:
            continue
        model = GapMilp(graph, costs, budgets, "remat")
        improved += gap_lns.rins_point(model, model.encode(start), time_limit=30)[0] is not None
    assert improved >= 1


def test_a_stalled_search_stops_before_its_deadline(monkeypatch):
    graph, costs, budgets = _case(11, 16, 0.4)
    start = _start(graph, costs, budgets, "remat")
    _, full = gap_lns.improve(graph, costs, budgets, "remat", start, deadline=time.perf_counter() + 60)
    monkeypatch.setattr(gap_lns, "STALL_MIN_S", 0.0)
    plan, stats = gap_lns.improve(graph, costs, budgets, "remat", start, deadline=time.perf_counter() + 60,
                                  stall=1e-9)
    assert stats["windows"] <= 1 < full["windows"]
    assert plan_energy_j(graph, costs, plan) <= plan_energy_j(graph, costs, start)
