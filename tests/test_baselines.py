"""Heuristic baselines (poet_opt/solver/baselines.py): every plan replays and validates under our cost
model, sqrt(n) checkpointing cuts a chain's peak, DTR respects the budget it is given, and our
exact solver is never worse than any baseline that fits."""

from __future__ import annotations

import math

import pytest

from poet_opt.solver.baselines import bottlenecks, dtr_decisions, evaluate, run_baselines, sqrt_n_checkpoints, sqrt_n_decisions
from poet_opt.device.costs import node_costs
from poet_opt.device.profiles import load_profile
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.decisions import build_steps, totals_of
from poet_opt.solver.driver import resolve_budgets, solve
from poet_opt.model.zoo import build_model

GRAPHS = {
    "mlp": lambda: build_model("mlp"),
    "mcu-vww": lambda: build_model("mcu-vww"),
    "transformer-block": lambda: build_model("transformer-block"),
    "resnet18-cifar": lambda: build_model("resnet18-cifar"),
    "random-n60": lambda: random_training_graph(60, 4),
    "random-n30-wide": lambda: random_training_graph(30, 7, max_fan_in=3, skip_prob=0.6),
}


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("fraction", [0.9, 0.5])
def test_every_baseline_validates(name, fraction):
    graph = GRAPHS[name]()
    profile = load_profile("rpi4")
    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, int(fraction * graph.plain_peak_bytes()))
    results = run_baselines(graph, profile, costs, budgets)
    assert set(results) == {"checkpoint-all", "sqrt-n", "dtr"}
    plain = results["checkpoint-all"]
    assert plain.totals["peak_ram_bytes"] == graph.plain_peak_bytes() and not plain.fits
    assert math.isclose(plain.totals["energy_j"], costs.plain_energy_j, rel_tol=1e-12)
    for result in results.values():
        if result.totals is None:
            assert result.name == "dtr"  # the only budget-driven method may give up
            continue
        # every node computed at least once; recomputation only adds energy
        assert result.totals["computes"] >= len(graph)
        assert result.totals["energy_j"] >= costs.plain_energy_j * (1 - 1e-12)
        assert result.fits == (result.totals["peak_ram_bytes"] <= budgets.ram_bytes)
    if results["dtr"].decisions is not None:
        assert results["dtr"].fits


def test_sqrt_n_cuts_the_peak_of_a_chain():
    chain = random_training_graph(100, 0, skip_prob=0.0, size_choices=(4096,))
    costs = node_costs(chain, load_profile("rpi4"))
    totals = totals_of(chain, costs, build_steps(chain, sqrt_n_decisions(chain)))
    # about 2 sqrt(n) activations instead of n: far below half the plain peak at n = 100
    assert totals["peak_ram_bytes"] < 0.35 * chain.plain_peak_bytes()
    # each forward node recomputed at most once (plus the last segment, which need not be)
    assert totals["recomputes"] <= 99
    assert len(sqrt_n_checkpoints(chain)) in range(9, 13)


def test_bottlenecks_are_block_boundaries():
    graph = build_model("resnet18-cifar")
    names = {graph.nodes[i].name for i in bottlenecks(graph)}
    assert {"input", "layer1.0.relu2", "layer2.1.relu2", "layer4.1.relu2", "loss"} <= names
    # the first conv of a residual block is bypassed by the skip connection
    assert not names & {"layer1.0.conv1", "layer2.0.bn1", "layer3.1.relu1"}


def test_dtr_fits_its_budget_or_says_it_cannot():
    graph = build_model("resnet18-cifar")
    profile = load_profile("rpi4")
    costs = node_costs(graph, profile)
    at_peak = dtr_decisions(graph, costs, graph.plain_peak_bytes())
    assert at_peak is not None and not at_peak.recompute  # nothing to evict at the plain peak
    for fraction in (0.7, 0.35):
        ram = int(fraction * graph.plain_peak_bytes())
        decisions = dtr_decisions(graph, costs, ram)
        assert decisions is not None and decisions.recompute
        budgets = resolve_budgets(graph, profile, costs, ram)
        result = evaluate(graph, profile, costs, budgets, "dtr", decisions)
        assert result.fits and result.totals["peak_ram_bytes"] <= ram
    assert dtr_decisions(graph, costs, graph.min_working_set_bytes() - 1) is None


@pytest.mark.parametrize("seed", [1, 2])
def test_our_optimum_is_never_worse_than_a_baseline_that_fits(seed):
    graph = random_training_graph(8, seed)
    profile = load_profile("rpi4")
    costs = node_costs(graph, profile)
    for fraction in (0.9, 0.7):
        ram = int(fraction * graph.plain_peak_bytes())
        budgets = resolve_budgets(graph, profile, costs, ram)
        ours = solve(graph, profile, ram=ram, gap=0, threads=1).totals["energy_j"]
        fitting = [r for r in run_baselines(graph, profile, costs, budgets).values() if r.fits]
        assert fitting  # otherwise this test checks nothing
        for result in fitting:
            assert ours <= result.totals["energy_j"] * (1 + 1e-9), result.name


@pytest.mark.parametrize("name", ["mcu-vww", "random-n30-wide"])
def test_fitting_baselines_are_mip_starts_for_both_formulations(name):
    """A plan that fits must be a feasible point of our MILP and of the dense one (idle keeps
    pruned), so either solver can start from it."""
    from poet_opt.solver.dense import DenseFormulation
    from poet_opt.solver.formulation import Formulation

    graph = GRAPHS[name]()
    profile = load_profile("rpi4")
    costs = node_costs(graph, profile)
    checked = 0
    for fraction in (0.9, 0.5):
        budgets = resolve_budgets(graph, profile, costs, int(fraction * graph.plain_peak_bytes()))
        ours, dense = Formulation(graph, costs, budgets, "remat"), DenseFormulation(graph, costs, budgets, "remat")
        for result in run_baselines(graph, profile, costs, budgets).values():
            if result.fits:
                assert ours.encode(result.decisions) is not None, result.name
                assert dense.encode(result.decisions) is not None, result.name
                checked += 1
    assert checked >= 1


def test_solver_starts_from_a_fitting_baseline():
    """Our solve must end no worse than DTR even when stopped at once: DTR's plan is a MIP start."""
    from poet_opt.solver.heuristics import starting_points

    graph = random_training_graph(50, 1)
    profile = load_profile("nrf52840")
    costs = node_costs(graph, profile)
    ram = int(0.7 * graph.plain_peak_bytes())
    budgets = resolve_budgets(graph, profile, costs, ram)
    dtr = run_baselines(graph, profile, costs, budgets)["dtr"]
    assert dtr.fits
    starts = starting_points(graph, costs, budgets, "joint")
    best_start = totals_of(graph, costs, build_steps(graph, starts[0]))["energy_j"]
    assert best_start <= dtr.totals["energy_j"] * (1 + 1e-12)
    ours = solve(graph, profile, ram=ram, time_limit=1, threads=1)
    assert ours.totals["energy_j"] <= dtr.totals["energy_j"] * (1 + 1e-9)
