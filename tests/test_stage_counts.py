"""The counting rows (poet_opt/solver/stage_counts.py): their integer arithmetic at the boundaries,
their claim (no set of tensors that fits a stage's room weighs more than its cap) over random sets,
and, on a streamed graph, that they raise the residency LP to the optimum the rows without them miss.
Their validity inside the whole relaxation is checked with every other row against the exhaustive
optimum (tests/test_residency.py, tests/test_stream_bound.py: the model has them by default)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_test_device
from poet_opt.device.costs import node_costs
from poet_opt.model.graph import Node, TrainingGraph
from poet_opt.schedule.decisions import Budgets
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.formulation import Formulation
from poet_opt.solver.residency import ResidencyModel, lagrangian_bound
from poet_opt.solver.stage_counts import stage_counts

REL = 1e-7


def test_weights_and_caps_at_their_boundaries():
    budget = 1200  # divisor 4: units of 300 bytes
    counts = stage_counts([300, 301, 600, 601, 0], [300, 301, 900, 901, 0, -5], budget, divisors=(4,))
    assert counts.divisors == (4,)
    # a tensor of exactly B/4 is not above it; one byte more weighs 1; 2B/4 weighs 1, one more 2
    assert counts.weight[0].tolist() == [0, 1, 1, 2, 0]
    # room of exactly B/4 holds no tensor above B/4 (cap 0); one byte more holds one; 3B/4 holds two
    assert counts.cap[0].tolist() == [0, 1, 2, 3, 0, 0]


def test_a_divisor_no_tensor_reaches_adds_no_rows():
    counts = stage_counts([100, 200], [1000], 1000, divisors=(2, 4, 8))
    assert counts.divisors == (8,)  # nothing above 500 or 250 bytes; 200 > 125


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(1000, 5000), st.lists(st.integers(0, 5000), min_size=1, max_size=7), st.data())
def test_no_set_that_fits_weighs_more_than_the_cap(budget, sizes, data):
    room = data.draw(st.integers(-100, budget))
    counts = stage_counts(sizes, [room], budget)
    for subset in range(1 << len(sizes)):
        chosen = [k for k in range(len(sizes)) if subset >> k & 1]
        if sum(sizes[k] for k in chosen) <= room:
            for weight, cap in zip(counts.weight, counts.cap):
                assert sum(weight[k] for k in chosen) <= cap[0], (sizes, room, chosen)


def large_tensors() -> TrainingGraph:
    """Two streamed weight slices and activations that are each a large share of the budget below:
    the byte rows alone let the LP keep them at fractions."""
    nodes = [
        Node(0, "param:f0", "forward", 256, (), 0.0, "param"),
        Node(1, "param:f1", "forward", 64, (), 0.0, "param"),
        Node(2, "f0", "forward", 256, (0,), 1e5, "op"),
        Node(3, "f1", "forward", 1024, (1, 2), 1e6, "op"),
        Node(4, "loss", "loss", 64, (3,), 2e5, "loss"),
        Node(5, "grad:f1", "backward", 128, (1, 4), 1e6, "grad", updates=(1,), writes_bytes=64),
        Node(6, "grad:f0", "backward", 512, (0, 5), 5e4, "grad", updates=(0,), writes_bytes=256),
    ]
    return TrainingGraph.build("large", nodes)


def test_the_counts_close_what_the_byte_rows_leave():
    graph = large_tensors()
    costs = node_costs(graph, make_test_device())
    budgets = Budgets(ram_bytes=1497, runtime_s=math.inf, storage_bytes=1 << 30)
    optimum = solve_milp(Formulation(graph, costs, budgets, "joint").milp, gap=0, time_limit=30)
    assert optimum.status == "optimal"
    without = solve_milp(ResidencyModel(graph, costs, budgets, "joint", counts=False).relaxed(), gap=0, time_limit=20)
    model = ResidencyModel(graph, costs, budgets, "joint")
    assert model.counts.divisors, "some tensor is above a share of the budget"
    with_counts = solve_milp(model.relaxed(), gap=0, time_limit=20)
    assert without.objective < with_counts.objective * (1 - 1e-4), (without.objective, with_counts.objective)
    assert with_counts.objective <= optimum.objective * (1 + REL)
    # the Lagrangian prices the counts too: with them it ends above the byte rows' LP
    quick = lagrangian_bound(graph, costs, budgets, "joint", upper=optimum.objective, time_limit=10)
    assert quick is not None and without.objective < quick.bound <= optimum.objective * (1 + REL)
