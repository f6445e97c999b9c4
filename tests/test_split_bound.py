"""The residency LP in pieces (poet_opt/solver/split_bound.py) is a proven lower bound whatever the
pieces and whatever the stage prices: never above the full MILP's optimum on the small streamed
graphs where the recomputation-input rows bind; in one piece at zero prices it is the LP with those
rows; the zoo's graphs are cut with each layer's backward pass beside its forward pass; and a solve
past the LP's size limit reports it."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_residency import DEVICE, REL
from test_stream_bound import chain, shared_inputs, trees

from poet_opt.device.costs import node_costs
from poet_opt.model.zoo import build_model
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.formulation import Formulation
from poet_opt.solver.residency import ResidencyModel, lagrangian_bound
from poet_opt.solver.split_bound import pieces, split_bound


def _prices(data, model, graph, costs, budgets, mode, upper):
    """The Lagrangian's multipliers, random nonnegative ones of the model's scale, or none."""
    kind = data.draw(st.sampled_from(("lagrangian", "random", "zero")))
    T = len(graph)
    rows = 1 + len(model.C)
    if kind == "lagrangian":
        found = lagrangian_bound(graph, costs, budgets, mode, upper=upper, time_limit=5)
        if found is not None and found.multipliers is not None:
            return found.multipliers
        kind = "zero"
    if kind == "zero":
        return np.zeros(rows * T)
    rng = np.random.default_rng(data.draw(st.integers(0, 10_000)))
    scale = data.draw(st.sampled_from((0.1, 1.0, 10.0))) * costs.plain_energy_j / T
    return rng.exponential(scale, rows * T) * (rng.random(rows * T) < 0.5)


def _below_the_optimum(graph, mode, budgets, data):
    costs = node_costs(graph, DEVICE)
    exact = solve_milp(Formulation(graph, costs, budgets, mode).milp, gap=0, time_limit=60)
    assert exact.status in ("optimal", "infeasible")
    if exact.status == "infeasible":
        return
    model = ResidencyModel(graph, costs, budgets, mode, inputs=True, trees=data.draw(st.booleans()))
    owner = np.array(data.draw(st.lists(st.integers(0, 2), min_size=len(graph), max_size=len(graph))))
    multipliers = _prices(data, model, graph, costs, budgets, mode, exact.objective)
    value = split_bound(model, multipliers, owner, time_limit=30, workers=2)
    assert value is not None, "every piece's LP has a point where a plan exists"
    assert value <= exact.objective * (1 + REL) + 1e-15, (value, exact.objective, owner)


@settings(max_examples=60, deadline=None, derandomize=True, print_blob=True)
@given(shared_inputs(), st.data())
def test_in_any_pieces_at_any_prices_the_bound_stays_below_the_optimum(case, data):
    """Random pieces (up to three, any node anywhere), the Lagrangian's prices, random ones or none;
    every mode, with and without runtime and storage budgets (which the pieces drop)."""
    graph, mode, ram, slow, storage = case
    costs = node_costs(graph, DEVICE)
    _below_the_optimum(graph, mode, Budgets(ram_bytes=ram, runtime_s=slow * float(costs.compute_s.sum()),
                                            storage_bytes=storage), data)


@settings(max_examples=30, deadline=None, derandomize=True, print_blob=True)
@given(trees(), st.data())
def test_on_recomputation_trees_in_pieces_the_bound_stays_below_the_optimum(case, data):
    graph, mode, share, slow = case
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    _below_the_optimum(graph, mode, Budgets(ram_bytes=int(lo + share * (hi - lo)),
                                            runtime_s=slow * float(costs.compute_s.sum()), storage_bytes=1 << 30), data)


def test_in_one_piece_at_zero_prices_it_is_the_lp_with_recomputation_inputs():
    """One piece, no prices, no runtime or storage budget: the piece's level chain is the model's,
    so the bound is the LP with recomputation inputs (without the count rows, which zero prices drop)."""
    graph, costs, budgets, model = _short_chain()
    lp = solve_milp(ResidencyModel(graph, costs, budgets, "joint", inputs=True, counts=False).relaxed(),
                    gap=0, time_limit=20).objective
    value = split_bound(model, np.zeros(len(graph)), np.zeros(len(graph), dtype=np.int64), time_limit=20, workers=1)
    assert value > costs.plain_energy_j
    assert math.isclose(value, lp, rel_tol=1e-6), (value, lp)


def test_the_zoo_transformer_block_is_cut_with_each_backward_node_beside_what_it_reads():
    """Cut into three, the encoder block's pieces are within a factor two of equal, each holds
    forward and backward nodes, and each backward node that reads a forward tensor shares a piece
    with the latest one it reads."""
    graph = build_model("transformer-block", batch_size=1)
    owner = pieces(graph, nodes_per_piece=len(graph) // 3)
    sizes = np.bincount(owner)
    assert len(sizes) == 3 and sizes.max() <= 2 * sizes.min(), sizes
    for j in range(3):
        kinds = {graph.nodes[k].is_backward for k in np.flatnonzero(owner == j)}
        assert kinds == {True, False}, (j, kinds)
    for node in graph.nodes:
        ahead = [d for d in node.deps if not graph.nodes[d].is_backward]
        if node.is_backward and ahead:
            assert owner[node.id] == owner[max(ahead)], node.name
    assert np.all(pieces(graph) == 0), "one piece by default below PIECE_NODES"


def test_a_solve_past_the_lp_size_limit_reports_the_bound_in_pieces(monkeypatch):
    """Past LP_MAX_COLUMNS (bert-base), the bound is the LP in pieces at the Lagrangian's prices:
    named, above the Lagrangian alone, and below the optimum."""
    import poet_opt.solver.driver as driver
    import poet_opt.solver.residency as residency

    graph = chain()
    costs = node_costs(graph, DEVICE)
    ram = graph.min_working_set_bytes()
    budgets = Budgets(ram_bytes=ram, runtime_s=math.inf, storage_bytes=1 << 30)
    exact = solve_milp(Formulation(graph, costs, budgets, "joint").milp, gap=0, time_limit=60)
    alone = lagrangian_bound(graph, costs, budgets, "joint", upper=exact.objective, time_limit=5)
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    monkeypatch.setattr(driver, "window_bound", lambda *args, **kwargs: None)
    monkeypatch.setattr(residency, "LP_MAX_COLUMNS", 0)
    solver = driver.solve(graph, DEVICE, ram=ram, gap=1e-9, order="given", time_limit=20).solver
    assert "in pieces" in solver["bound_source"], solver["bound_source"]
    assert alone.bound < solver["bound"] <= exact.objective * (1 + REL), (alone.bound, solver["bound"])


@pytest.mark.parametrize("past_the_lp_limit", [False, True])
def test_a_ctrl_c_ends_the_residency_bound_at_once(monkeypatch, past_the_lp_limit):
    """One encoder block in strips at 200 KiB (4,731 nodes), whose bound takes some 40 s: after a
    Ctrl-C (the solve's interrupt flag set) it returns within seconds, on either side of the LP's
    size limit, with at most what it had proven."""
    import poet_opt.solver.residency as residency
    from poet_opt.solver.backends import interrupt_scope

    graph, costs, budgets = _encoder_block_in_strips()
    if past_the_lp_limit:
        monkeypatch.setattr(residency, "LP_MAX_COLUMNS", 0)
    with interrupt_scope() as flag:
        flag.set()
        started = time.perf_counter()
        found = residency.residency_bound(graph, costs, budgets, "joint", time_limit=120, upper=30.0)
        took = time.perf_counter() - started
    assert took < 5.0, took
    assert found is None or found.bound < 30.0


def test_given_the_model_the_cuts_split_fewer_of_its_rows():
    """With the model, the encoder block's three pieces are cut where fewer rows of stream_bound.py
    hold tensors of two pieces (a split row is lost to both pieces) than where the fewest bytes cross,
    and each backward node still goes with what it reads."""
    graph, costs, budgets = _encoder_block_in_strips()
    model = ResidencyModel(graph, costs, budgets, "joint", inputs=True, trees=False)
    G, T = len(model.R), len(graph)
    block = model.milp.A[model.base_rows:model.base_rows + len(model.block.lo)].tocoo()
    tensor_col = block.col < 2 * G + T
    tensor = np.where(block.col < 2 * G, model.gaps.tensor[block.col % G], block.col - 2 * G)[tensor_col]
    rows = block.row[tensor_col]

    def split_rows(owner):
        first = np.full(len(model.block.lo), T)
        last = np.full(len(model.block.lo), -1)
        np.minimum.at(first, rows, owner[tensor])
        np.maximum.at(last, rows, owner[tensor])
        return int((first < last).sum())

    by_bytes = pieces(graph, nodes_per_piece=T // 3)
    by_rows = pieces(graph, nodes_per_piece=T // 3, model=model)
    assert by_rows.max() == by_bytes.max() == 2
    assert split_rows(by_rows) < 0.5 * split_rows(by_bytes), (split_rows(by_rows), split_rows(by_bytes))
    for node in graph.nodes:
        if node.is_backward and any(not graph.nodes[d].is_backward for d in node.deps):
            assert by_rows[node.id] == max(by_rows[d] for d in node.deps if not graph.nodes[d].is_backward)


def _encoder_block_in_strips():
    """One encoder block as the solve sees it on the nRF52840 at 200 KiB: 4,731 nodes."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.model.load import default_tile_bytes, load_training_graph
    from poet_opt.solver.budgets import resolve_budgets

    profile, ram = load_profile("nrf52840"), 200 * 1024
    graph, _ = load_training_graph("transformer-block", None, None, None, batch_size=1, bytes_per_element=4,
                                   weights="auto", tile_bytes=default_tile_bytes([ram]), ram_bytes=ram,
                                   device_ram_bytes=profile.memory.ram_bytes,
                                   stack_reserve_bytes=profile.memory.stack_reserve_bytes)
    costs = node_costs(graph, profile)
    return graph, costs, resolve_budgets(graph, profile, costs, ram)


def test_a_piece_the_interior_point_fails_gets_the_simplex(monkeypatch):
    """Where the interior point returns no objective for a piece, with and without presolve (one of
    bert-base's scout pieces did), the piece is solved by the simplex: the bound is the one the
    interior point gives when it works, not none."""
    import poet_opt.solver.split_bound as split
    from poet_opt.solver.backends import SolveResult

    graph, costs, budgets, model = _short_chain()
    owner = np.arange(len(graph)) * 3 // len(graph)
    prices = lagrangian_bound(graph, costs, budgets, "joint", upper=2 * costs.plain_energy_j, time_limit=5).multipliers
    working = split_bound(model, prices, owner, time_limit=30, workers=1)
    real = split.solve_lps
    methods = []

    def failing(milps, **kwargs):
        methods.append(kwargs.get("lp_solver"))
        if kwargs.get("lp_solver") == "ipm":
            return [SolveResult("error", None, None, None, 0.0, "highs",
                                duals=np.full(milp.num_rows, 1e6)) for milp in milps]
        return real(milps, **kwargs)

    monkeypatch.setattr(split, "solve_lps", failing)
    rescued = split_bound(model, prices, owner, time_limit=30, workers=1)
    assert methods == ["ipm", "ipm", None], methods
    assert working is not None and rescued is not None
    assert math.isclose(rescued, working, rel_tol=1e-6, abs_tol=1e-9), (rescued, working)


def _short_chain():
    """The chain of tests/test_stream_bound.py with two middle nodes, a fifth of the way from its
    least working set to its plain peak, no runtime or storage budget: the graph, its costs, the
    budgets and its model with recomputation inputs."""
    graph = chain(2, 4096)
    costs = node_costs(graph, DEVICE)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = Budgets(ram_bytes=int(lo + 0.2 * (hi - lo)), runtime_s=math.inf, storage_bytes=1 << 30)
    return graph, costs, budgets, ResidencyModel(graph, costs, budgets, "joint", inputs=True)
