"""The residency bound past the simplex LP's size (poet_opt/solver/residency.py, LP_MAX_COLUMNS): the LP
with recomputation inputs solved by an interior-point method without crossover, its row multipliers
turned into a bound by dual_bound.py. The boxed form of the model (levels bounded below by 0, which
its rows imply) has the same optimum; the bound from any multipliers stays below the exact optimum of
small streamed graphs; and on the chain, where the input rows decide the bound, the interior-point
bound comes within 1e-4 of the LP's optimum and the driver reports it."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_residency import DEVICE, REL, streamed_cases
from test_stream_bound import _optimum, chain

import poet_opt.solver.residency as residency
from poet_opt.device.costs import node_costs
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.dual_bound import dual_ascent, dual_bound
from poet_opt.solver.formulation import Formulation
from poet_opt.solver.residency import ResidencyModel, residency_bound


def _budgets(graph, costs, share, slow, storage):
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    return Budgets(ram_bytes=int(lo + share * (hi - lo)), runtime_s=slow * float(costs.compute_s.sum()),
                   storage_bytes=storage)


def _solved(case):
    """(graph, mode, costs, budgets, the exhaustive optimum or None when no plan fits) of a case."""
    graph, mode, share, slow, storage = case
    costs = node_costs(graph, DEVICE)
    budgets = _budgets(graph, costs, share, slow, storage)
    return graph, mode, costs, budgets, _optimum(graph, costs, budgets, mode)


@settings(max_examples=25, deadline=None, derandomize=True, print_blob=True)
@given(streamed_cases(), st.integers(0, 2**32 - 1))
def test_multipliers_on_the_boxed_model_never_bound_above_the_exhaustive_optimum(case, seed):
    graph, mode, costs, budgets, optimum = _solved(case)
    if optimum is None:
        return
    model = ResidencyModel(graph, costs, budgets, mode, inputs=mode != "paging")
    boxed = model.boxed()
    assert np.all(np.isfinite(boxed.lb)) and np.all(np.isfinite(boxed.ub))
    plain = solve_milp(model.relaxed(), gap=0, time_limit=20)
    tight = solve_milp(boxed, gap=0, time_limit=20)
    assert tight.objective == plain.objective or \
        abs(tight.objective - plain.objective) <= REL * max(1.0, abs(plain.objective)) * 10
    ipm = solve_milp(boxed, gap=0, time_limit=20, lp_solver="ipm")
    rng = np.random.default_rng(seed)
    noise = rng.normal(size=boxed.num_rows)
    for y in (tight.duals, ipm.duals, tight.duals + 1e-3 * noise, noise, np.zeros(boxed.num_rows)):
        value = dual_bound(boxed, y)
        assert value is not None
        assert value <= optimum * (1 + REL) + 1e-15, (value, optimum)
    # the interior point's multipliers are close to optimal here
    assert dual_bound(boxed, ipm.duals) >= plain.objective - 1e-5 * max(1.0, abs(plain.objective))


@settings(max_examples=20, deadline=None, derandomize=True, print_blob=True)
@given(streamed_cases())
def test_past_the_lp_size_the_bound_stays_below_the_exhaustive_optimum(case):
    graph, mode, costs, budgets, optimum = _solved(case)
    if optimum is None:
        return
    saved = residency.LP_MAX_COLUMNS, residency.INPUTS_BUILD_S_PER_COLUMN
    residency.LP_MAX_COLUMNS, residency.INPUTS_BUILD_S_PER_COLUMN = 0, 0.0
    try:
        found = residency_bound(graph, costs, budgets, mode, time_limit=20, upper=1.5 * optimum)
    finally:
        residency.LP_MAX_COLUMNS, residency.INPUTS_BUILD_S_PER_COLUMN = saved
    if found is not None:
        assert costs.plain_energy_j < found.bound <= optimum * (1 + REL) + 1e-15, (found, optimum)


def test_past_the_lp_size_the_chain_gets_the_bound_with_recomputation_inputs(monkeypatch):
    """On the chain (tests/test_stream_bound.py) the Lagrangian knows nothing of recomputation inputs;
    past LP_MAX_COLUMNS, with no time for the LP in pieces (tests/test_split_bound.py), the bound is
    the LP with them by dual ascent from the Lagrangian's multipliers: above the LP without them,
    below the optimum, and the driver names it."""
    import poet_opt.solver.driver as driver

    graph = chain()
    costs = node_costs(graph, DEVICE)
    ram = graph.min_working_set_bytes()
    budgets = Budgets(ram_bytes=ram, runtime_s=math.inf, storage_bytes=1 << 30)
    exact = solve_milp(Formulation(graph, costs, budgets, "joint").milp, gap=0, time_limit=60)
    lp = solve_milp(ResidencyModel(graph, costs, budgets, "joint", inputs=True).relaxed(), gap=0, time_limit=20)
    without = solve_milp(ResidencyModel(graph, costs, budgets, "joint").relaxed(), gap=0, time_limit=20)
    monkeypatch.setattr(residency, "LP_MAX_COLUMNS", 0)
    monkeypatch.setattr(residency, "SPLIT_SHARE", 0.0)
    found = residency_bound(graph, costs, budgets, "joint", time_limit=20, upper=exact.objective)
    assert found is not None and found.method == "residency LP with recomputation inputs, dual ascent", found
    assert without.objective < found.bound <= lp.objective * (1 + REL) <= exact.objective * (1 + REL)
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    monkeypatch.setattr(driver, "window_bound", lambda *args, **kwargs: None)
    solver = driver.solve(graph, DEVICE, ram=ram, gap=1e-9, order="given", time_limit=20).solver
    assert solver["bound_source"].startswith("residency LP with recomputation inputs, dual ascent"), \
        solver["bound_source"]
    assert solver["plain_floor_j"] < without.objective < solver["bound"] <= exact.objective * (1 + REL)


@settings(max_examples=25, deadline=None, derandomize=True, print_blob=True)
@given(streamed_cases(), st.integers(0, 2**32 - 1))
def test_the_lagrangians_multipliers_carry_its_value_into_the_model(case, seed):
    """ResidencyModel.lagrangian_duals: at any stage multipliers lam >= 0, the dual function of the
    boxed model (with or without recomputation inputs) is at least the Lagrangian's value there, the
    start dual ascent climbs from; and the ascent ends at or above it and at or below the LP's optimum."""
    graph, mode, share, slow, storage = case
    costs = node_costs(graph, DEVICE)
    budgets = _budgets(graph, costs, share, slow, storage)
    model = ResidencyModel(graph, costs, budgets, mode, inputs=mode != "paging")
    gaps = model.gaps
    if not len(gaps.tensor):
        return
    rng = np.random.default_rng(seed)
    lam = rng.exponential(size=len(graph)) * rng.integers(0, 2, len(graph))  # some stages' zero
    # the Lagrangian's value at lam (lagrangian_bound's objective), recomputed here
    i, T = gaps.tensor, len(graph)
    per = np.bincount(i, minlength=T)
    ret = np.minimum(np.where(gaps.can_r, costs.compute_j[i], np.inf),
                     np.where(gaps.can_p, costs.page_in_j[i] + costs.page_out_j[i] / np.maximum(per[i], 1), np.inf))
    prefix = np.concatenate([[0.0], np.cumsum(lam)])
    keep = gaps.nb[i] * (prefix[gaps.b] - prefix[gaps.a + 1])
    lagrangian = costs.plain_energy_j + float(np.minimum(keep, ret).sum() - lam @ gaps.room)
    boxed = model.boxed()
    y = model.lagrangian_duals(lam, costs)
    start = dual_bound(boxed, y)
    assert start >= lagrangian - 1e-9 * max(1.0, abs(lagrangian)), (start, lagrangian)
    lp = solve_milp(boxed, gap=0, time_limit=20)
    if lp.status not in ("optimal", "gap_limit"):
        return
    value, _ = dual_ascent(boxed, y, target=lp.objective * 1.2 + 1e-9, time_limit=2.0)
    assert start - 1e-12 <= value <= lp.objective * (1 + REL) + 1e-15, (start, value, lp.objective)
