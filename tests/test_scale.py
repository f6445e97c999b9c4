"""The scale work of issue 5: the gap heuristic (a fast MIP start) and the lower bound every result
carries. Timing targets are measured by benchmarks/scale.py, not here."""

from __future__ import annotations

import pytest

from conftest import make_test_device
from poet_opt.costs import node_costs
from poet_opt.formulation import Formulation
from poet_opt.heuristics import gap_plan, greedy_paging
from poet_opt.profiles import load_profile
from poet_opt.randgraph import random_training_graph
from poet_opt.schedule import build_steps, totals_of
from poet_opt.solve import resolve_budgets
from poet_opt.zoo import build_model


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("allow", [(True, True), (True, False), (False, True)], ids=["joint", "paging", "remat"])
def test_gap_plan_fits_its_budget_and_is_a_valid_mip_start(seed, allow):
    graph = random_training_graph(6 + seed, seed, skip_prob=0.5)
    device = make_test_device() if seed % 2 else load_profile("jetson-tx2")
    costs = node_costs(graph, device)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    for ram in (lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3, hi - 1):
        budgets = resolve_budgets(graph, device, costs, ram)
        plan = gap_plan(graph, costs, budgets, allow_paging=allow[0], allow_remat=allow[1])
        if plan is None:
            continue
        totals = totals_of(graph, costs, build_steps(graph, plan))
        assert totals["peak_ram_bytes"] <= ram
        assert allow[0] or not plan.page_in
        assert allow[1] or not plan.recompute
        mode = {(True, True): "joint", (True, False): "paging", (False, True): "remat"}[allow]
        form = Formulation(graph, costs, budgets, mode)
        x = form.encode(plan)
        assert x is not None, "the MILP rejects the plan as a start"
        assert form.milp.c @ x + form.milp.offset == pytest.approx(totals["energy_j"], rel=1e-9)


def test_gap_plan_pages_less_than_paging_for_every_reader():
    graph = build_model("resnet18-cifar")
    device = load_profile("rpi4")
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, "1.5MB")
    energy = {h.__name__: totals_of(graph, costs, build_steps(graph, h(graph, costs, budgets)))["energy_j"]
              for h in (gap_plan, greedy_paging)}
    assert energy["gap_plan"] < energy["greedy_paging"]
