"""Execution orders: the candidates are valid and the exact one is exact; solving in several orders
is never worse than the given one; what is claimed about a schedule names its order; budgets below
one step's working set are refused at once, in every order."""

from __future__ import annotations

import math
import random
import time

import pytest
from click.testing import CliRunner

from conftest import make_test_device
from poet_opt.cli import main
from poet_opt.errors import InfeasibleError
from poet_opt.model.graph import TrainingGraph
from poet_opt.model.orders import (candidate_orders, is_topological, low_memory_order, min_peak_order, plain_peak,
                                   topological_orders)
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.report import summary_text
from poet_opt.solver.driver import solve


def _shuffled(graph: TrainingGraph, seed: int) -> TrainingGraph:
    """The same graph numbered in a random valid topological order, as other tools export them."""
    rng = random.Random(seed)
    missing = [len(set(n.deps)) for n in graph.nodes]
    users = graph.users()
    ready = [i for i in range(len(graph)) if missing[i] == 0]
    order = []
    while ready:
        i = ready.pop(rng.randrange(len(ready)))
        order.append(i)
        for u in set(users[i]):
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    return graph.reordered(order)


GRAPHS = [_shuffled(random_training_graph(n, seed=s, max_fan_in=3, skip_prob=0.5), s)
          for n, s in [(4, 1), (5, 2), (5, 3), (6, 4), (6, 5), (7, 6)]]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.name)
def test_min_peak_order_is_the_least_peak_of_all_orders(graph):
    every = topological_orders(graph, 100_000)
    assert every is not None and all(is_topological(graph, o) for o in every)
    assert len({tuple(o) for o in every}) == len(every)
    best = min(plain_peak(graph, o) for o in every)
    exact = min_peak_order(graph)
    assert is_topological(graph, exact)
    assert plain_peak(graph, exact) == best
    assert plain_peak(graph, low_memory_order(graph)) >= best


def _low_memory_by_scanning(graph: TrainingGraph) -> list[int]:
    """low_memory_order's rule, stated as directly as it reads: re-score every ready node at each pick."""
    users = [set(u) for u in graph.users()]
    waiting = [len(u) for u in users]
    missing = [len(set(n.deps)) for n in graph.nodes]
    ready = [i for i in range(len(graph)) if missing[i] == 0]
    order = []

    def growth(j):
        return graph.nodes[j].bytes - sum(graph.nodes[d].bytes for d in set(graph.nodes[j].deps) if waiting[d] == 1)

    while ready:
        i = min(ready, key=lambda j: (growth(j), j))
        ready.remove(i)
        order.append(i)
        for d in set(graph.nodes[i].deps):
            waiting[d] -= 1
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    return order


@pytest.mark.parametrize("n, seed", [(3, 0), (8, 1), (20, 2), (40, 3), (60, 4), (120, 5)])
def test_low_memory_order_picks_as_the_scanning_rule_does(n, seed):
    """The heap re-scores only nodes whose score fell; every pick must be the one a full re-scan makes."""
    for fan_in, skip in ((1, 0.0), (3, 0.5), (3, 0.9)):
        graph = _shuffled(random_training_graph(n, seed=seed, max_fan_in=fan_in, skip_prob=skip), seed)
        assert low_memory_order(graph) == _low_memory_by_scanning(graph)


def test_counting_stops_at_the_limit():
    graph = GRAPHS[-1]
    every = topological_orders(graph, 100_000)
    assert topological_orders(graph, len(every)) is not None
    assert topological_orders(graph, len(every) - 1) is None


def test_candidates_are_valid_distinct_and_start_with_the_given_order():
    for graph in GRAPHS:
        orders = candidate_orders(graph, enumerate_up_to=24)
        assert orders[0] == ("given", list(range(len(graph))))
        assert len({tuple(o) for _, o in orders}) == len(orders)
        assert all(is_topological(graph, o) for _, o in orders)


def test_reordered_graph_keeps_every_edge():
    graph = GRAPHS[3]
    order = min_peak_order(graph)
    moved = graph.reordered(order)
    assert [moved.nodes[k].name for k in range(len(graph))] == [graph.nodes[i].name for i in order]
    names = {(graph.nodes[d].name, n.name) for n in graph.nodes for d in n.deps}
    assert names == {(moved.nodes[d].name, n.name) for n in moved.nodes for d in n.deps}
    with pytest.raises(ValueError):
        graph.reordered(list(reversed(range(len(graph)))))


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.name)
def test_auto_is_never_worse_than_the_given_order(graph):
    device = make_test_device()
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    for frac in (0.2, 0.6):
        ram = int(lo + (hi - lo) * frac)
        results = {}
        for order in ("given", "auto"):
            try:
                results[order] = solve(graph, device, ram=ram, order=order, gap=0, time_limit=30)
            except InfeasibleError as exc:
                assert not exc.proven or ram < lo
                results[order] = None
        if results["given"] is not None:
            assert results["auto"] is not None
            assert results["auto"].totals["energy_j"] <= results["given"].totals["energy_j"] * (1 + 1e-9)


def test_the_claim_names_the_order_and_optimal_means_the_floor():
    graph, device = GRAPHS[4], make_test_device()
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    tight = solve(graph, device, ram=(lo + hi) // 2, order="given", gap=0, time_limit=30)
    floor = tight.plain["energy_j"]
    if tight.totals["energy_j"] > floor * (1 + 1e-9):
        assert tight.solver["status"] == "optimal_for_order"
        assert "optimal in the given execution order" in summary_text(tight)
        assert tight.solver["gap_any_order"] > 0
    roomy = solve(graph, device, ram=hi, order="given", gap=0, time_limit=30)
    assert roomy.solver["status"] == "optimal" and roomy.totals["energy_j"] == pytest.approx(floor)
    assert roomy.solver["gap_any_order"] == pytest.approx(0, abs=1e-12)
    doc = tight.to_dict()
    assert doc["solver"]["order"] == "given" and doc["graph"]["given_ids"] == list(range(len(graph)))


def test_a_schedule_in_another_order_maps_back_to_the_given_graph():
    graph, device = GRAPHS[1], make_test_device()
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    schedule = solve(graph, device, ram=(lo + hi) // 2, order="auto", time_limit=30)
    doc = schedule.to_dict()
    given_ids = doc["graph"]["given_ids"]
    assert sorted(given_ids) == list(range(len(graph)))
    for node in doc["graph"]["nodes"]:
        assert node["name"] == graph.nodes[given_ids[node["id"]]].name


def test_below_one_steps_working_set_is_refused_at_once_with_the_exact_minimum():
    # a long chain: the MILP would take long; the working-set check needs none of it
    graph = random_training_graph(400, seed=7)
    need = graph.min_working_set_bytes()
    started = time.perf_counter()
    with pytest.raises(InfeasibleError) as info:
        solve(graph, make_test_device(), ram=need - 1, time_limit=60)
    assert time.perf_counter() - started < 2.0
    assert info.value.proven and info.value.min_ram_bytes == need
    assert f"{need} B" in info.value.message and "in any order" in info.value.message
    with pytest.raises(InfeasibleError) as remat:
        solve(graph, make_test_device(), ram=need - 1, mode="remat", runtime="2x", time_limit=60)
    assert remat.value.min_ram_bytes is None and remat.value.min_ram_lower_bound == need


def test_cli_order_flag_and_json():
    graph = GRAPHS[2]
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    import json
    import tempfile
    from pathlib import Path

    from poet_opt.files import write_json_atomic

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.json"
        write_json_atomic({"directed": True, "multigraph": False, "graph": {},
                           "nodes": [{"id": n.id, "name": n.name, "backward": n.is_backward,
                                      "cost_cpu": 1e-3 * (1 + n.id % 3), "cost_ram": n.bytes} for n in graph.nodes],
                           "links": [{"source": d, "target": n.id} for n in graph.nodes for d in n.deps]}, path)
        for order in ("given", "auto"):
            result = CliRunner().invoke(main, ["solve", "--graph", str(path), "--device", "rpi4",
                                               "--ram", f"{(lo + hi) // 2}B", "--order", order, "--json", "-q"])
            assert result.exit_code == 0, result.output
            solver = json.loads(result.stdout)["solver"]
            assert solver["order"] == order
            assert solver["status"] in ("optimal", "optimal_for_order", "gap_limit")
            assert math.isfinite(solver["gap_any_order"])
        bad = CliRunner().invoke(main, ["solve", "--graph", str(path), "--device", "rpi4", "--ram", "1MB",
                                        "--order", "best"])
        assert bad.exit_code == 2


def test_a_plan_proven_by_plain_trainings_energy_is_claimed_for_every_order():
    """When the bound that proves the gap is plain training's energy, the claim covers every
    execution order (no step sequence in any order goes below it); a bound from a solve in one
    order is claimed for that order only."""
    from poet_opt.schedule.report import claim

    graph, device = GRAPHS[4], make_test_device()
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    near = solve(graph, device, ram=hi - (hi - lo) // 20, order="given", gap=0.5, time_limit=30)
    assert near.solver["status"] == "gap_limit" and near.solver["bound"] == near.solver["plain_floor_j"]
    assert "of the least energy in any execution order" in claim(near)
    near.solver["gap_any_order"] = 2 * near.solver["gap"]  # as if a bound above the floor had proved it
    assert "of the least energy in the given execution order" in claim(near)
