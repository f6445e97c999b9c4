"""--gap 0 either proves optimality or reports the exact gap reached, never a label that claims more.

HiGHS, asked for a relative gap of 0, may still stop at its own tolerances a few 1e-7 above its
bound and call that "optimal". The driver must then say "stopped" with the gap it reached, and the
words printed must not claim optimality or "within the requested gap"."""

from __future__ import annotations

import pytest

import poet_opt.solver.driver as driver
from conftest import make_test_device
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.report import claim, summary_text
from poet_opt.solver.backends import relative_gap

GRAPH = random_training_graph(8, seed=3, max_fan_in=2, skip_prob=0.4)


def _ram(graph, frac=0.5):
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    return int(lo + (hi - lo) * frac)


@pytest.fixture
def highs_stops_short(monkeypatch):
    """The full MILP ends as HiGHS does at its tolerances: a plan, and a bound 5e-7 below it (as a
    fraction of the plan's energy), reported as optimal by HiGHS, i.e. "gap_limit" by our backend."""
    real = driver.solve_milp

    def short(milp, **kw):
        result = real(milp, **kw)
        if result.x is not None and result.objective is not None:
            result.bound = result.objective - 5e-7 * abs(result.objective)
            result.status = "gap_limit"
        return result

    monkeypatch.setattr(driver, "solve_milp", short)


def test_a_solve_that_stops_at_the_tolerances_says_so_with_the_gap_reached(highs_stops_short):
    schedule = driver.solve(GRAPH, make_test_device(), ram=_ram(GRAPH), gap=0, order="given", time_limit=60)
    solver = schedule.solver
    assert solver["objective"] > solver["plain_floor_j"] * 1.001  # the MILP ran: the floor proves nothing
    assert solver["status"] == "stopped"
    assert solver["gap"] == pytest.approx(5e-7, rel=1e-3)
    assert solver["gap"] == relative_gap(solver["objective"], solver["bound"])
    words = claim(schedule)
    assert words.startswith("not proven optimal") and "5e-05%" in words
    assert "optimal in" not in summary_text(schedule)


def test_the_same_gap_within_what_was_asked_is_a_gap_limit(highs_stops_short):
    schedule = driver.solve(GRAPH, make_test_device(), ram=_ram(GRAPH), gap=1e-6, order="given", time_limit=60)
    assert schedule.solver["status"] == "gap_limit"
    assert schedule.solver["gap"] == pytest.approx(5e-7, rel=1e-3)


@pytest.mark.parametrize("seed, frac", [(1, 0.3), (2, 0.5), (4, 0.7), (5, 0.4)])
def test_gap_zero_labels_match_the_numbers(seed, frac):
    """With the real solver: "optimal" only at the floor, "optimal_for_order" only with a closed gap,
    never "gap_limit" (no gap above 0 is within 0), and any other label carries the gap reached."""
    graph = random_training_graph(9, seed=seed, max_fan_in=3, skip_prob=0.5)
    schedule = driver.solve(graph, make_test_device(), ram=_ram(graph, frac), gap=0, time_limit=60)
    solver = schedule.solver
    status, gap = solver["status"], solver["gap"]
    assert status != "gap_limit"
    assert gap == relative_gap(solver["objective"], solver["bound"])
    if status == "optimal":
        assert solver["objective"] <= solver["plain_floor_j"] * (1 + 1e-9)
    elif status == "optimal_for_order":
        assert gap <= 1e-9
    else:
        assert status in ("stopped", "time_limit") and gap > 1e-9
