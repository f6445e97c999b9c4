"""The window search (solver/lns.py): the exact model of a window of stages, the rest of a plan fixed.

What must hold: a window over the whole graph is the full formulation (same optimum); any window's
optimum, spliced into the plan, replays valid through the independent validator at exactly the
energy the model claims, and is never worse than the plan nor better than the full optimum; and the
search, given time, reaches the full optimum from a weaker start."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
from hypothesis import given, settings
from test_residency import streamed_cases

from conftest import make_test_device
from poet_opt.device.costs import node_costs
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule import validator
from poet_opt.schedule.decisions import Budgets, build_steps, totals_of
from poet_opt.schedule.document import Schedule
from poet_opt.solver import lns
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.formulation import Formulation
from poet_opt.solver.heuristics import plan_energy_j, starting_points

DEVICE = make_test_device()


def _case(seed: int, n_forward: int, frac: float, mode: str):
    graph = random_training_graph(n_forward, seed=seed, max_fan_in=2, skip_prob=0.4)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(int(lo + (hi - lo) * frac), math.inf, DEVICE.storage.capacity_bytes)
    starts = starting_points(graph, costs, budgets, mode)
    if not starts:
        pytest.skip("no heuristic start at this budget")
    return graph, costs, budgets, starts[-1]  # the weakest start leaves the windows something to do


def _optimum(graph, costs, budgets, mode) -> float:
    result = solve_milp(Formulation(graph, costs, budgets, mode).milp, gap=0.0, time_limit=60)
    assert result.status in ("optimal", "gap_limit")
    return result.objective


def replayed_energy(graph, costs, budgets, mode, decisions) -> float:
    """The plan's energy as the validator's replay of its steps counts it (which raises on any broken rule)."""
    steps = build_steps(graph, decisions)
    plan = Schedule(model=graph.name, mode=mode, graph=graph, profile=DEVICE, costs=costs, budgets=budgets,
                    decisions=decisions, steps=steps, totals=totals_of(graph, costs, steps), plain={}, solver={})
    doc = plan.to_dict()
    validator.replay(doc)  # raises on any broken rule or budget
    return doc["totals"]["energy_j"]


@pytest.mark.parametrize("seed, mode", [(1, "remat"), (2, "joint"), (3, "remat"), (4, "joint"), (5, "paging")])
def test_a_window_over_the_whole_graph_is_the_full_model(seed, mode):
    graph, costs, budgets, start = _case(seed, 7, 0.3, mode)
    whole = Formulation(graph, costs, budgets, mode, window=(0, len(graph) - 1), incumbent=start)
    result = solve_milp(whole.milp, gap=0.0, time_limit=60, start=whole.encode(lns.restricted(start, 0, len(graph))))
    assert result.objective == pytest.approx(_optimum(graph, costs, budgets, mode), rel=1e-7)


@pytest.mark.parametrize("seed, mode", [(11, "remat"), (12, "joint"), (13, "remat"), (14, "joint")])
def test_every_window_splices_into_a_valid_plan_between_the_optimum_and_the_start(seed, mode):
    graph, costs, budgets, start = _case(seed, 9, 0.2, mode)
    best = _optimum(graph, costs, budgets, mode)
    before = plan_energy_j(graph, costs, start)
    rng = random.Random(seed)
    T = len(graph)
    for _ in range(6):
        a = rng.randrange(T)
        b = rng.randrange(a, min(T, a + rng.randint(1, T)))
        form = Formulation(graph, costs, budgets, mode, window=(a, b), incumbent=start)
        x0 = form.encode(lns.restricted(start, a, b))
        assert x0 is not None, "the plan itself is a point of every window's model"
        assert form.milp.c @ x0 + form.milp.offset == pytest.approx(before, rel=1e-9)
        result = solve_milp(form.milp, gap=0.0, time_limit=60, start=x0)
        spliced = lns.spliced(start, form.decode(result.x), a, b)
        energy = replayed_energy(graph, costs, budgets, mode, spliced)
        assert energy == pytest.approx(result.objective, rel=1e-7)
        assert best * (1 - 1e-7) <= energy <= before * (1 + 1e-9)


def test_the_search_reaches_the_optimum_from_a_weak_start():
    graph, costs, budgets, start = _case(21, 12, 0.25, "remat")
    best = _optimum(graph, costs, budgets, "remat")
    before = plan_energy_j(graph, costs, start)
    assert before > best * (1 + 1e-6), "the start must leave room to improve"
    plan, stats = lns.improve(graph, costs, budgets, "remat", start, deadline=time.perf_counter() + 60)
    assert stats["improved"] >= 1 and stats["saved_j"] == pytest.approx(before - plan_energy_j(graph, costs, plan))
    assert replayed_energy(graph, costs, budgets, "remat", plan) == pytest.approx(best, rel=1e-6)


def test_windows_cover_every_dear_stage_the_dearest_first():
    extra = np.array([0, 5, 0, 0, 1, 1, 0, 9, 0, 0], dtype=float)
    found = lns.windows(extra, 3)
    assert found[0][0] <= 7 <= found[0][1]
    assert all(b - a + 1 == 3 for a, b in found)
    assert {1, 4, 5, 7} <= {t for a, b in found for t in range(a, b + 1)}
    assert lns.windows(np.zeros(5), 2) == []


def _fixed_outside(full: Formulation, x: np.ndarray, plan, a: int, b: int):
    """The full model's bounds with every column of stages outside a..b fixed at x (the plan's point):
    its actions there, its keeps into a and b+1 and before, and the page-outs the window may not change
    (of tensors read back by a page-in outside it)."""
    lb, ub = full.milp.lb.copy(), full.milp.ub.copy()
    for index, inside in ((full.R, lambda t: a <= t <= b), (full.Min, lambda t: a <= t <= b),
                          (full.S, lambda t: a < t <= b)):
        ts, ii = index.pairs()
        cols = index[ts, ii][[not inside(int(t)) for t in ts]]
        lb[cols] = ub[cols] = x[cols]
    read_outside = {i for t, i in plan.page_in if not a <= t <= b}
    for i in np.flatnonzero(full.Mout >= 0):
        if i in read_outside:
            lb[full.Mout[i]] = ub[full.Mout[i]] = x[full.Mout[i]]
    return lb, ub


@pytest.mark.parametrize("seed, mode", [(31, "joint"), (32, "remat"), (33, "paging"), (34, "joint")])
def test_a_window_model_has_the_optimum_of_the_full_model_with_the_other_stages_fixed(seed, mode):
    """The window's model is built over its own stages and tensors only (StageIndex); the reference is
    the full model, every column outside the window fixed at the plan's values by bounds."""
    from dataclasses import replace

    graph, costs, budgets, start = _case(seed, 8, 0.25, mode)
    full = Formulation(graph, costs, budgets, mode)
    x = full.encode(start)
    assert x is not None
    rng = random.Random(seed)
    T = len(graph)
    for _ in range(4):
        a = rng.randrange(T - 1)
        b = rng.randrange(a, min(T, a + 8))
        lb, ub = _fixed_outside(full, x, start, a, b)
        reference = solve_milp(replace(full.milp, lb=lb, ub=ub), gap=0.0, time_limit=60, start=x)
        form = Formulation(graph, costs, budgets, mode, window=(a, b), incumbent=start)
        assert form.R.cols.shape[0] == b + 2 - a, "columns only over the window's stages"
        window = solve_milp(form.milp, gap=0.0, time_limit=60, start=form.encode(lns.restricted(start, a, b)))
        assert window.objective == pytest.approx(reference.objective, rel=1e-7)
        # the tensors a search re-decides: a restriction of it, still a point at the plan
        free = lns.window_tensors(graph, start, a, b)
        small = Formulation(graph, costs, budgets, mode, window=(a, b), incumbent=start, window_tensors=free)
        x0 = small.encode(lns.restricted(start, a, b))
        assert x0 is not None and len(small.R.tensors) <= len(form.R.tensors)
        result = solve_milp(small.milp, gap=0.0, time_limit=60, start=x0)
        assert window.objective * (1 - 1e-7) <= result.objective <= plan_energy_j(graph, costs, start) * (1 + 1e-9)
        spliced = lns.spliced(start, small.decode(result.x), a, b)
        assert replayed_energy(graph, costs, budgets, mode, spliced) == pytest.approx(result.objective, rel=1e-7)


def test_a_window_model_allocates_nothing_graph_squared():
    """On 2,000 forward nodes (4,000 and more stages) a window of 10 stages builds its index arrays over
    those stages and the tensors it re-decides: dense stage x tensor arrays would be 128 MiB each."""
    graph = random_training_graph(2000, seed=5, max_fan_in=2, skip_prob=0.2)
    costs = node_costs(graph, DEVICE)
    budgets = Budgets(int(0.6 * graph.plain_peak_bytes()), math.inf, DEVICE.storage.capacity_bytes)
    from poet_opt.solver.heuristics import spill_plan

    plan = spill_plan(graph, costs, budgets)
    assert plan is not None
    T = len(graph)
    a = T // 2
    free = lns.window_tensors(graph, plan, a, a + 9)
    began = time.perf_counter()
    form = Formulation(graph, costs, budgets, "joint", window=(a, a + 9), incumbent=plan, window_tensors=free)
    assert form.R.cols.shape == (11, len(form.R.tensors)) and len(form.R.tensors) <= len(free) < T
    assert form.encode(lns.restricted(plan, a, a + 9)) is not None
    assert time.perf_counter() - began < 5.0


@settings(max_examples=12, deadline=None, derandomize=True, print_blob=True)
@given(streamed_cases())
def test_on_streamed_graphs_the_search_from_the_spill_plan_is_valid_and_never_worse(case):
    graph, mode, share, slow, storage = case
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(ram_bytes=int(lo + share * (hi - lo)), runtime_s=slow * float(costs.compute_s.sum()),
                      storage_bytes=storage)
    starts = starting_points(graph, costs, budgets, mode)
    if not starts:
        return
    start = starts[-1]
    before = plan_energy_j(graph, costs, start)
    plan, stats = lns.improve(graph, costs, budgets, mode, start, deadline=time.perf_counter() + 5)
    assert replayed_energy(graph, costs, budgets, mode, plan) <= before * (1 + 1e-9)
    assert stats["saved_j"] >= 0


def test_a_large_streamed_solve_searches_windows_before_the_bound(monkeypatch):
    """Past BOUND_FIRST_MAX_NODES (here: any size) the window search runs before the bound phase,
    and the driver's plan is valid and no dearer than the best start."""
    import poet_opt.solver.driver as driver
    from test_residency import streamed

    graph = streamed(random_training_graph(6, seed=3, max_fan_in=2, skip_prob=0.4), [2, 4], [3000, 5000])
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(int(lo + 0.2 * (hi - lo)), math.inf, DEVICE.storage.capacity_bytes)
    order = []
    real_search, real_bound = driver.window_search, driver.residency_bound
    monkeypatch.setattr(driver, "window_search", lambda *a, **k: order.append("search") or real_search(*a, **k))
    monkeypatch.setattr(driver, "residency_bound", lambda *a, **k: order.append("bound") or real_bound(*a, **k))
    monkeypatch.setattr(driver, "BOUND_FIRST_MAX_NODES", 0)
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    schedule = driver.solve(graph, DEVICE, ram=budgets.ram_bytes, order="given", time_limit=20)
    assert order[:2] == ["search", "bound"]
    start = min(plan_energy_j(graph, costs, d) for d in starting_points(graph, costs, budgets, "joint"))
    assert schedule.totals["energy_j"] <= start * (1 + 1e-9)
    assert replayed_energy(graph, costs, budgets, "joint", schedule.decisions) == pytest.approx(schedule.totals["energy_j"])
