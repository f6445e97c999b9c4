"""The residency relaxation (poet_opt/solver/residency.py) is a proven lower bound on streamed graphs:
never above the exhaustive optimum (tests/exhaustive.py, the formulation's decision space written
without it), in every mode, under tight RAM, runtime and storage budgets; and on the headline's kind
of graph it rises above plain training's floor, which is the point of it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from exhaustive import exhaustive_optimum
from hypothesis import given, settings
from hypothesis import strategies as st
from small_graphs import training_graphs

from conftest import make_test_device
from poet_opt.device.costs import node_costs
from poet_opt.device.profiles import load_profile
from poet_opt.model.graph import Node, TrainingGraph
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.formulation import Formulation
from poet_opt.solver.heuristics import read_gaps
from poet_opt.solver.residency import ResidencyModel, lagrangian_bound, residency_bound

REL = 1e-7  # HiGHS's tolerances on an objective scaled to order one
SIZES = (64, 256, 1024, 4096)


def streamed(graph: TrainingGraph, picks: list[int], sizes: list[int]) -> TrainingGraph:
    """The graph with weights streamed for some forward nodes: a ``param`` node read by the forward
    node and by its gradient, which updates it in place and writes it back (as the zoo streams them)."""
    grad_of = {d: n.id for n in graph.nodes if n.name.startswith("grad:")
               for d in [next(m.id for m in graph.nodes if m.name == n.name[5:])]}
    nodes = list(graph.nodes)
    base = len(nodes)
    for k, (f, size) in enumerate(zip(picks, sizes)):
        p = base + k
        nodes.append(Node(p, f"param:{nodes[f].name}", "forward", size, (), 0.0, "param"))
        nodes[f] = replace(nodes[f], deps=tuple(sorted({*nodes[f].deps, p})))
        if f in grad_of:
            g = grad_of[f]
            nodes[g] = replace(nodes[g], deps=tuple(sorted({*nodes[g].deps, p})), updates=(p,), writes_bytes=size)
    # params first where the dependencies allow: build renumbers topologically, keeping this order
    return TrainingGraph.build(graph.name, [nodes[p] for p in range(base, len(nodes))] + nodes[:base])


@st.composite
def streamed_cases(draw):
    graph = draw(training_graphs(n_forward=draw(st.sampled_from((2, 3)))))
    forward = [n.id for n in graph.nodes if n.kind == "forward" and n.op == "op"]
    picks = draw(st.lists(st.sampled_from(forward), min_size=1, max_size=min(2, len(forward)), unique=True))
    sizes = [draw(st.sampled_from(SIZES)) for _ in picks]
    graph = streamed(graph, picks, sizes)
    mode = draw(st.sampled_from(("joint", "remat", "paging")))
    share = draw(st.sampled_from((0.0, 0.3, 0.6)))
    slow = draw(st.sampled_from((math.inf, 1.1, 1.5)))
    storage = draw(st.sampled_from((1 << 30, 0, 4096)))
    return graph, mode, share, slow, storage


DEVICE = make_test_device()


@settings(max_examples=25, deadline=None, derandomize=True, print_blob=True)
@given(streamed_cases())
def test_the_residency_bound_never_exceeds_the_exhaustive_optimum(case):
    graph, mode, share, slow, storage = case
    assert len(graph) <= 11 and graph.streams_weights
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = int(lo + share * (hi - lo))
    runtime = slow * float(costs.compute_s.sum())
    budgets = Budgets(ram_bytes=ram, runtime_s=runtime, storage_bytes=storage)
    if storage == 1 << 30 and (mode != "joint" or len(graph) <= 6):  # the exhaustive search's space
        optimum = exhaustive_optimum(graph, costs, ram, runtime, mode)
    else:
        # The exhaustive search knows no storage budget, and in joint mode past 6 nodes it takes
        # 20-40 s a case (7 nodes, budgets of 4-8 KiB): there the full MILP to a zero gap, itself
        # checked against it in tests/test_exhaustive.py.
        exact = solve_milp(Formulation(graph, costs, budgets, mode).milp, gap=0, time_limit=30)
        assert exact.status in ("optimal", "infeasible")
        optimum = exact.objective if exact.status == "optimal" else None
    model = ResidencyModel(graph, costs, budgets, mode)
    for milp in (model.relaxed(), model.milp):
        result = solve_milp(milp, gap=0, time_limit=20)
        if optimum is None:
            continue  # no plan (or storage counted in neither search): nothing to stay below
        assert result.status != "infeasible", "a plan exists, so the relaxation has a point"
        assert result.objective <= optimum * (1 + REL) + 1e-15, (result.objective, optimum)
    if optimum is not None:
        # the Lagrangian's steps aim at a plan's energy: above the optimum, as a real start is
        found = residency_bound(graph, costs, budgets, mode, time_limit=20, upper=1.5 * optimum)
        assert found is None or found.bound <= optimum * (1 + REL) + 1e-15
        found = lagrangian_bound(graph, costs, budgets, mode, upper=optimum, time_limit=10)
        assert found is None or found.bound <= optimum * (1 + REL) + 1e-15


def test_gaps_are_the_stretches_between_consecutive_reads():
    # x -> f1 -> f2 -> f3, and f3 reads x again: x is read at 0 (its own stage), 1 and 3
    nodes = [Node(0, "x", "forward", 8), Node(1, "f1", "forward", 8, (0,)), Node(2, "f2", "forward", 8, (1,)),
             Node(3, "f3", "forward", 8, (2, 0))]
    graph = TrainingGraph.build("chain", nodes)
    assert [tuple(map(int, g)) for g in zip(*read_gaps(graph, graph.users()))] == [(0, 1, 3)]  # 0-1 and 1-2, 2-3 have no stage inside


@pytest.fixture(scope="module")
def streamed_mlp():
    """The zoo MLP with streamed weights under a RAM budget that cannot hold its weights from the
    forward to the backward pass, and its plan proven optimal for its order."""
    from poet_opt.model.zoo import build_model
    from poet_opt.solver.driver import solve

    graph = build_model("mlp", input_shape=64, weights="streamed")
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = int(lo + 0.2 * (hi - lo))
    exact = solve(graph, "nrf52840", ram=ram, gap=0, order="given", time_limit=60)
    assert exact.solver["status"] in ("optimal_for_order", "optimal")
    return graph, ram, exact


def test_a_streamed_mlp_gets_a_bound_above_the_floor_that_its_plan_respects(streamed_mlp):
    """Each weight must be read again, which plain training's floor does not count; the bound
    counts it and stays below the plan the solver proves."""
    graph, ram, exact = streamed_mlp
    costs = node_costs(graph, load_profile("nrf52840"))
    budgets = Budgets(ram_bytes=ram, runtime_s=math.inf, storage_bytes=1 << 30)
    found = residency_bound(graph, costs, budgets, "joint", time_limit=20)
    assert found is not None and costs.plain_energy_j < found.bound <= exact.solver["objective"] * (1 + REL)
    quick = lagrangian_bound(graph, costs, budgets, "joint", upper=exact.solver["objective"], time_limit=10)
    assert quick is not None and costs.plain_energy_j < quick.bound <= found.bound * (1 + REL)


@pytest.mark.parametrize("mode", ["joint", "remat", "paging"])
def test_nothing_is_claimed_where_plain_training_fits(mode):
    graph = build_tiny()
    costs = node_costs(graph, DEVICE)
    budgets = Budgets(ram_bytes=graph.plain_peak_bytes(), runtime_s=math.inf, storage_bytes=1 << 30)
    assert residency_bound(graph, costs, budgets, mode, time_limit=10) is None  # the floor is the optimum


def build_tiny() -> TrainingGraph:
    nodes = [Node(0, "w", "forward", 64, (), 0.0, "param"), Node(1, "x", "forward", 32, (), 0.0, "input"),
             Node(2, "f", "forward", 32, (0, 1), 1e4, "op"), Node(3, "loss", "loss", 4, (2,), 1e3, "loss"),
             Node(4, "grad:f", "backward", 32, (3, 0, 1), 1e4, "grad", updates=(0,), writes_bytes=64)]
    return TrainingGraph.build("tiny", nodes)


def test_a_streamed_solve_past_the_size_limit_reports_the_residency_bound(monkeypatch, streamed_mlp):
    """With the full MILP skipped, as on the strip graphs, the driver runs the residency bound on a
    streamed graph (here the only one: the window bound, which on a graph this small covers most of
    it and ends higher, is switched off), names it, and it stays below the proven optimum."""
    import poet_opt.solver.driver as driver

    graph, ram, exact = streamed_mlp
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    monkeypatch.setattr(driver, "window_bound", lambda *args, **kwargs: None)
    solver = driver.solve(graph, "nrf52840", ram=ram, gap=1e-9, order="given", time_limit=20).solver
    assert solver["full_milp"].startswith("skipped")
    assert solver["bound_source"].startswith("residency"), solver["bound_source"]
    assert solver["plain_floor_j"] < solver["bound"] <= exact.solver["objective"] * (1 + REL)
