"""The time limit is a promise: the whole solve() ends within limit x 1.05 + 2 s, with or without a
schedule. The phases before the MILP (execution orders, heuristic starts, building the MILP) check
the time left and give up, leaving the best heuristic schedule, or saying that none was found."""

from __future__ import annotations

import time

import pytest

from conftest import make_test_device
from poet_opt.errors import NoScheduleFound
from poet_opt.model.orders import candidate_orders, low_memory_order, min_peak_order, plain_peak
from poet_opt.model.random_graph import random_training_graph
from poet_opt.solver.driver import solve


def _within(limit: float, wall: float) -> bool:
    return wall <= limit * 1.05 + 2.0


def test_no_schedule_found_ends_within_a_10_s_limit():
    """Remat at 1.02x of plain training's runtime and 30% of the way from the working set to the
    peak: no heuristic start fits, and the full MILP (50k binaries, 3-4 s to build) would leave too
    little of the limit to solve it. The greedy checkpointing loop alone took 30-60 s here, and the
    solve 45 s in all, before the phases were bounded."""
    graph = random_training_graph(150, seed=0, max_fan_in=3, skip_prob=0.5)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    started = time.perf_counter()
    with pytest.raises(NoScheduleFound) as info:
        solve(graph, make_test_device(), ram=int(lo + (hi - lo) * 0.3), mode="remat", runtime="1.02x",
              time_limit=10)
    wall = time.perf_counter() - started
    assert _within(10, wall), f"{wall:.1f} s for a 10 s limit"
    assert "time limit" in info.value.message


def test_min_peak_order_is_linear_in_the_ready_nodes():
    """The exact order search used to try every node at every step (quadratic, with 5000-bit masks):
    over a minute at 5000 nodes before any solve began."""
    graph = random_training_graph(2500, seed=1)
    started = time.perf_counter()
    order = min_peak_order(graph)
    assert time.perf_counter() - started < 5.0
    assert order is None or sorted(order) == list(range(len(graph)))
    small = random_training_graph(30, seed=2, max_fan_in=3, skip_prob=0.5)
    exact = min_peak_order(small)
    assert plain_peak(small, exact) <= plain_peak(small, low_memory_order(small))


def test_order_searches_give_up_at_their_deadline():
    graph = random_training_graph(400, seed=3, max_fan_in=3, skip_prob=0.5)
    past = time.perf_counter() - 1.0
    assert min_peak_order(graph, deadline=past) is None
    assert low_memory_order(graph, deadline=past) is None
    assert candidate_orders(graph, deadline=past) == [("given", list(range(len(graph))))]
