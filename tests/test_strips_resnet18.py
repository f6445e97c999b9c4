"""Activation strips at ResNet-18's size (model/strips.py, model/strip_order.py): the nRF52840
plans resnet18-cifar in strips within 200 KiB, its slice-block order reads fewer weights than the
greedy order, and a budget no strips reach is refused after one build.

Split from test_strips.py, which keeps the strip graph's maths on small networks: these builds of
an 8,000-node graph take most of that module's time, and with ``--dist loadfile`` one long file
keeps one worker busy alone.
"""

from __future__ import annotations

import pytest

from poet_opt.model.strips import fit_strips
from poet_opt.model.zoo import build_model

pytest.importorskip("torch")  # skipped without torch, as these tests were in test_strips.py


@pytest.fixture(scope="module")
def resnet18_200k():
    """The graph `poet-opt solve --model resnet18-cifar --device nrf52840 --ram 200KiB` plans (auto
    strips, weight slices of a quarter of the budget), built once: both tests below only read it
    (planning, costing and replaying leave it as built)."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.model.load import load_training_graph

    profile = load_profile("nrf52840")
    budget = 200 * 1024
    graph, _ = load_training_graph("resnet18-cifar", weights="auto", device_ram_bytes=profile.memory.ram_bytes,
                                   stack_reserve_bytes=profile.memory.stack_reserve_bytes, tile_bytes=budget // 4,
                                   ram_bytes=budget)
    return profile, graph


def test_resnet18_plans_on_the_nrf52840_in_strips(resnet18_200k):
    """The graph `poet-opt solve --model resnet18-cifar --device nrf52840 --ram 200KiB` plans (auto
    strips) holds every node within 200 KiB, and the start the solver keeps at that size (the
    farthest-use paging plan) replays through the independent validator within the budget and the
    device's RAM. The full command (3 minutes) is in docs/streaming.md, run by benchmarks/docs_check.py."""
    from poet_opt.device.costs import node_costs
    from poet_opt.schedule import validator
    from poet_opt.schedule.decisions import Budgets, build_steps, stored_param_bytes, totals_of
    from poet_opt.schedule.document import Schedule
    from poet_opt.solver.heuristics import farthest_use_paging

    profile, graph = resnet18_200k
    budget = 200 * 1024
    assert graph.streams_weights and graph.largest_working_set()[0] <= budget
    assert graph.meta["strips"].per_height == {"8": 4, "16": 8, "32": 16}
    costs = node_costs(graph, profile)
    budgets = Budgets(budget, float("inf"), profile.storage.capacity_bytes - stored_param_bytes(graph, profile.storage))
    decisions = farthest_use_paging(graph, budgets)
    steps = build_steps(graph, decisions)
    plan = Schedule(model=graph.name, mode="joint", graph=graph, profile=profile, costs=costs, budgets=budgets,
                    decisions=decisions, steps=steps, totals=totals_of(graph, costs, steps), plain={}, solver={})
    doc = plan.to_dict()
    validator.replay(doc)
    memory = plan.memory()
    assert doc["totals"]["peak_ram_bytes"] <= budget
    assert memory["fits_device"] and memory["fits_storage"] and memory["total_bytes"] <= profile.memory.ram_bytes


def test_resnet18_slice_blocks_start_reads_fewer_weights_than_the_greedy_order(resnet18_200k):
    """ResNet-18 at 200 KiB on the nRF52840 (8,223 nodes): in the order the loader gives it, each
    weight slice runs over a block of strips (model/strip_order.py). The spill plan, the start that
    stands at this size, is still found there, passes the validator's replay, and reads fewer bytes
    for less energy than in the greedy low-memory order, which reads a slice again for each strip."""
    from poet_opt.device.costs import node_costs
    from poet_opt.model.strips import low_memory
    from poet_opt.schedule import validator
    from poet_opt.schedule.decisions import build_steps, totals_of
    from poet_opt.schedule.document import Schedule
    from poet_opt.solver.driver import resolve_budgets
    from poet_opt.solver.heuristics import spill_plan

    profile, graph = resnet18_200k
    budget = 200 * 1024
    counts = {int(h): k for h, k in graph.meta["strips"].per_height.items()}
    greedy = low_memory(build_model("resnet18-cifar", weights="streamed", tile_bytes=budget // 4, strips=counts))
    assert sorted(n.name for n in greedy.nodes) == sorted(n.name for n in graph.nodes)
    totals = {}
    for label, g in (("greedy", greedy), ("blocks", graph)):
        costs = node_costs(g, profile)
        budgets = resolve_budgets(g, profile, costs, budget)
        decisions = spill_plan(g, costs, budgets)
        assert decisions is not None, label
        steps = build_steps(g, decisions)
        totals[label] = totals_of(g, costs, steps)
    plan = Schedule(model=graph.name, mode="joint", graph=graph, profile=profile, costs=costs, budgets=budgets,
                    decisions=decisions, steps=steps, totals=totals["blocks"], plain={}, solver={})
    validator.replay(plan.to_dict())
    assert totals["blocks"]["peak_ram_bytes"] <= budget
    assert totals["blocks"]["storage_read_bytes"] < totals["greedy"]["storage_read_bytes"]
    assert totals["blocks"]["energy_j"] < totals["greedy"]["energy_j"]


def test_a_budget_no_strips_reach_is_refused_after_one_finest_build():
    """resnet18-cifar at 40 KiB: even one-row strips leave a node over the budget, which one build
    of the finest strips shows; the doubling search built the graph 15 times (20 s) to find that."""
    budget = 40 * 1024
    built = []

    def build(counts):
        built.append(dict(counts))
        return build_model("resnet18-cifar", weights="streamed", tile_bytes=budget // 4, strips=counts)

    graph = fit_strips(build, budget)
    assert graph.largest_working_set()[0] > budget
    assert built == [{}, {32: 32, 16: 16, 8: 8, 4: 4}]
