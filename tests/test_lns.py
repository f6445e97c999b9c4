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
