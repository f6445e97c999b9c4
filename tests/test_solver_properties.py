"""Property tests of solve() on random training graphs: every answer is a valid schedule within its
budgets whose reported totals the independent validator reproduces, or a correct InfeasibleError;
and optimal energies move the right way as budgets and modes change.

Hypothesis runs derandomized, so CI sees the same examples every time.
"""

from __future__ import annotations

import inspect
import json
import math

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from conftest import TEST_PROFILE, make_test_device
from poet_opt.device.costs import node_costs
from poet_opt.errors import InfeasibleError
from poet_opt.device.profiles import DeviceProfile, load_profile
from poet_opt.model.random_graph import random_training_graph
from poet_opt.solver.driver import solve
from poet_opt.schedule.validator import TOTAL_KEYS, validate
from poet_opt.model.orders import min_peak_order, plain_peak
from poet_opt.schedule.document import STATUSES

MODES = ("joint", "remat", "paging", "none")
REL = 1e-9  # energies compared across solves (all at gap=0)
TIME_LIMIT = 20.0  # a bound, never reached on these sizes
DEFAULT_GAP = inspect.signature(solve).parameters["gap"].default

DEVICES = {
    "test": make_test_device(),
    "rpi4": load_profile("rpi4"),
    "nrf52840": load_profile("nrf52840"),
    "jetson-tx2": load_profile("jetson-tx2"),
}
SIZE_CHOICES = [
    (1024, 2048, 4096, 8192),
    (512, 4096, 32768),
    (4096,),
    (100, 1000, 10000),  # not multiples of anything
]

# No shrinking: a failing example is reported as drawn (graph, device, budgets are all printed), and
# shrinking would re-solve hundreds of variants. Remove `phases` locally to get a minimal example.
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, print_blob=True,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(PROPERTY, max_examples=12)


# The validator's documented slack on the runtime budget (validator.RUNTIME_SLACK).
RUNTIME_SLACK = 1e-9


@st.composite
def graphs(draw, n_min=2, n_max=8):
    n = draw(st.integers(n_min, n_max), label="n_forward")
    seed = draw(st.integers(0, 2**20), label="seed")
    skip = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]), label="skip_prob")
    sizes = draw(st.sampled_from(SIZE_CHOICES), label="size_choices")
    zero = draw(st.sampled_from([0.0, 0.0, 0.5]), label="zero_cost_prob")
    event(f"{2 * n} nodes")
    return random_training_graph(n, seed, skip_prob=skip, size_choices=sizes, zero_cost_prob=zero)


devices = st.sampled_from(sorted(DEVICES))


def _ram(draw, graph):
    """From the smallest working set (0%) to 10% over the plain peak (110%), in whole percent of
    the stretch between the two, plus odd bytes: drawing bytes directly lands mostly at the ends."""
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    percent = draw(st.integers(0, 110), label="ram, % of the way from working set to plain peak")
    wobble = draw(st.integers(-3, 3), label="ram wobble (bytes)")
    return max(lo, lo + (hi - lo) * percent // 100 + wobble)


def _energy(graph, device, **kw):
    """Energy at gap=0, or None when there is no schedule."""
    try:
        return solve(graph, device, gap=0, time_limit=TIME_LIMIT, **kw).totals["energy_j"]
    except InfeasibleError:
        return None


def _leq(a, b):
    return a <= b * (1 + REL)


def check_schedule(schedule, graph, ram, runtime_s, mode):
    """Everything a returned schedule promises, checked against the independent validator."""
    doc = json.loads(json.dumps(schedule.to_dict()))  # what a schedule file holds
    recomputed = validate(doc)
    totals = schedule.totals
    for key, integer in TOTAL_KEYS.items():
        if integer:
            assert recomputed[key] == totals[key], key
        else:
            assert math.isclose(recomputed[key], totals[key], rel_tol=1e-9, abs_tol=1e-300), key
    assert schedule.budgets.ram_bytes == ram
    assert totals["peak_ram_bytes"] <= ram
    assert totals["peak_ram_bytes"] >= graph.min_working_set_bytes()
    if runtime_s is not None:
        assert totals["runtime_s"] <= runtime_s * (1 + RUNTIME_SLACK)
    assert totals["storage_bytes"] <= schedule.budgets.storage_bytes
    assert schedule.solver["status"] in STATUSES
    objective = schedule.solver["objective"]
    assert math.isclose(objective, totals["energy_j"], rel_tol=1e-6), (objective, totals["energy_j"])
    bound = schedule.solver["bound"]
    if bound is not None:
        assert bound <= objective * (1 + 1e-9)
    # plain training is a lower bound: every node runs at least once, and nothing else is free
    plain = schedule.plain
    assert totals["energy_j"] >= plain["energy_j"] * (1 - 1e-12)
    assert totals["runtime_s"] >= plain["runtime_s"] * (1 - 1e-12)
    assert plain["peak_ram_bytes"] == graph.plain_peak_bytes()
    if mode in ("paging", "none"):
        assert totals["recomputes"] == 0
    if mode in ("remat", "none"):
        assert totals["page_ins"] == totals["page_outs"] == 0 and totals["storage_bytes"] == 0
    return recomputed


def check_outcome(graph, device, ram, runtime_s, mode):
    """solve() either returns a schedule that keeps every promise, or raises an InfeasibleError
    whose smallest feasible budget is right: above the budget asked for, enough, and tight."""
    plain_peak = graph.plain_peak_bytes()
    try:
        schedule = solve(graph, device, ram=ram, runtime=runtime_s, mode=mode, time_limit=TIME_LIMIT)
    except InfeasibleError as exc:
        event(f"{mode}: infeasible")
        # plain training fits whenever the budget reaches its peak, in every mode
        assert ram < plain_peak
        # with a runtime budget of at least 1x, plain training is always within it: some RAM works
        assert exc.min_ram_bytes is not None, str(exc)
        assert graph.min_working_set_bytes() <= exc.min_ram_bytes <= plain_peak
        assert exc.min_ram_bytes > ram, (exc.min_ram_bytes, ram)
        if mode == "none":
            assert exc.min_ram_bytes == plain_peak
        at_min = solve(graph, device, ram=exc.min_ram_bytes, runtime=runtime_s, mode=mode, time_limit=TIME_LIMIT)
        check_schedule(at_min, graph, exc.min_ram_bytes, runtime_s, mode)
        # and the reported minimum is tight: one byte less has no schedule
        with pytest.raises(InfeasibleError):
            solve(graph, device, ram=exc.min_ram_bytes - 1, runtime=runtime_s, mode=mode, time_limit=TIME_LIMIT)
        return
    event(f"{mode}: solved {'at or above' if ram >= plain_peak else 'below'} the plain peak")
    if mode == "none":
        assert ram >= plain_peak
    check_schedule(schedule, graph, ram, runtime_s, mode)
    if ram >= plain_peak:
        # plain training fits and nothing is cheaper: the answer is plain training, up to the gap
        assert schedule.totals["energy_j"] <= schedule.plain["energy_j"] / (1 - DEFAULT_GAP) * (1 + 1e-12)


@given(data=st.data())
@PROPERTY
def test_solve_returns_a_valid_schedule_or_a_correct_infeasibility(data):
    graph = data.draw(graphs(), label="graph")
    device = DEVICES[data.draw(devices, label="device")]
    ram = _ram(data.draw, graph)
    factor = data.draw(st.none() | st.sampled_from([1.0, 1.01, 1.05, 1.2]) | st.floats(1.0, 3.0),
                       label="runtime factor")
    mode = data.draw(st.sampled_from(MODES), label="mode")
    event("runtime: " + ("unlimited" if factor is None else "tight (<1.3x)" if factor < 1.3 else "loose"))
    runtime_s = None if factor is None else factor * node_costs(graph, device).plain_runtime_s
    check_outcome(graph, device, ram, runtime_s, mode)


@given(data=st.data())
@PROPERTY
def test_tight_budgets_give_a_valid_schedule_or_a_correct_infeasibility(data):
    """The same, where InfeasibleError is common: low RAM, runtime near 1x, a single technique."""
    graph = data.draw(graphs(3, 8), label="graph")
    device = DEVICES[data.draw(devices, label="device")]
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = lo + (hi - lo) * data.draw(st.integers(0, 60), label="ram, % of the way to the plain peak") // 100
    factor = data.draw(st.sampled_from([1.0, 1.02, 1.1, 1.25]), label="runtime factor")
    mode = data.draw(st.sampled_from(["joint", "remat", "paging"]), label="mode")
    check_outcome(graph, device, ram, factor * node_costs(graph, device).plain_runtime_s, mode)


@given(data=st.data())
@FEW
def test_energy_never_increases_with_more_ram(data):
    graph = data.draw(graphs(3, 7), label="graph")
    device = DEVICES[data.draw(devices, label="device")]
    factor = data.draw(st.sampled_from([None, 1.2, 2.0]), label="runtime factor")
    runtime_s = None if factor is None else factor * node_costs(graph, device).plain_runtime_s
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    budgets = sorted({lo + (int(hi * 1.1) - lo) * k // 5 for k in range(6)} | {hi - 1, hi})
    budgets = [b for b in budgets if b >= lo]
    for mode in ("joint", "remat", "paging"):
        previous = None
        for ram in budgets:
            energy = _energy(graph, device, ram=ram, runtime=runtime_s, mode=mode)
            if previous is not None:
                assert energy is not None, f"{mode}: feasible below {ram} B but not at {ram} B"
                assert _leq(energy, previous[1]), (
                    f"{mode}: {energy!r} J at {ram} B > {previous[1]!r} J at {previous[0]} B")
            if energy is not None:
                previous = (ram, energy)
        # at the plain peak nothing is infeasible
        assert previous is not None


@given(data=st.data())
@FEW
def test_energy_never_increases_with_more_runtime(data):
    graph = data.draw(graphs(3, 7), label="graph")
    device = DEVICES[data.draw(devices, label="device")]
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = data.draw(st.integers(lo, hi), label="ram")
    plain_s = node_costs(graph, device).plain_runtime_s
    for mode in ("joint", "remat", "paging"):
        previous = None
        for factor in (1.0, 1.02, 1.1, 1.3, 1.7, 2.5, None):
            runtime_s = None if factor is None else factor * plain_s
            energy = _energy(graph, device, ram=ram, runtime=runtime_s, mode=mode)
            if previous is not None:
                assert energy is not None, f"{mode}: feasible at {previous[0]}x runtime but not at {factor}x"
                assert _leq(energy, previous[1]), (
                    f"{mode}: {energy!r} J at {factor}x > {previous[1]!r} J at {previous[0]}x")
            if energy is not None:
                previous = (factor, energy)


@given(data=st.data())
@FEW
def test_joint_is_never_worse_than_remat_or_paging_alone(data):
    graph = data.draw(graphs(3, 8), label="graph")
    device = DEVICES[data.draw(devices, label="device")]
    ram = _ram(data.draw, graph)
    factor = data.draw(st.sampled_from([None, 1.05, 1.5]), label="runtime factor")
    plain = node_costs(graph, device)
    runtime_s = None if factor is None else factor * plain.plain_runtime_s
    energies = {mode: _energy(graph, device, ram=ram, runtime=runtime_s, mode=mode) for mode in MODES}
    joint = energies["joint"]
    for mode in ("remat", "paging", "none"):
        if energies[mode] is not None:
            assert joint is not None, f"{mode} finds a schedule, joint does not"
            assert _leq(joint, energies[mode]), f"joint {joint!r} J > {mode} {energies[mode]!r} J"
    for mode, energy in energies.items():
        if energy is not None:
            assert energy >= plain.plain_energy_j * (1 - 1e-12), mode
    assert (energies["none"] is not None) == (ram >= graph.plain_peak_bytes())


@given(data=st.data())
@FEW
def test_mode_none_is_feasible_exactly_from_the_plain_peak(data):
    graph = data.draw(graphs(), label="graph")
    device = DEVICES[data.draw(devices, label="device")]
    peak = graph.plain_peak_bytes()
    with pytest.raises(InfeasibleError) as info:
        solve(graph, device, ram=peak - 1, mode="none", order="given")
    assert info.value.min_ram_bytes == peak
    schedule = solve(graph, device, ram=peak, mode="none", order="given")
    check_schedule(schedule, graph, peak, None, "none")
    assert schedule.totals["energy_j"] == schedule.plain["energy_j"]
    assert schedule.totals["peak_ram_bytes"] == peak
    # in any order: plain training in the order that holds least, and provably nothing below it
    least = plain_peak(graph, min_peak_order(graph))
    assert least <= peak
    with pytest.raises(InfeasibleError) as info:
        solve(graph, device, ram=least - 1, mode="none")
    assert info.value.proven and info.value.min_ram_bytes == least
    assert solve(graph, device, ram=least, mode="none").totals["peak_ram_bytes"] == least


def test_runtime_1x_admits_plain_training_on_a_slow_device():
    """At --runtime 1x only plain training fits; with plain training taking hours, a relative
    margin on the runtime row would exceed the solver's absolute tolerance and reject it."""
    slow = DeviceProfile.model_validate({**TEST_PROFILE, "compute": {"flops_per_second": 100.0, "active_power_w": 1.0}})
    graph = random_training_graph(4, 1)
    assert node_costs(graph, slow).plain_runtime_s > 10_000
    for mode in MODES:
        schedule = solve(graph, slow, ram=graph.plain_peak_bytes(), runtime="1x", mode=mode)
        assert schedule.totals["energy_j"] == schedule.plain["energy_j"], mode


# -- regressions -------------------------------------------------------------------------------
# Energies in joules used to reach HiGHS unscaled; its absolute tolerances then exceeded whole node
# costs (the 10-FLOP loss costs 1e-8..2e-8 J) and gap=0 returned plans that recompute the loss
# although plain training fits.


@pytest.mark.parametrize("dev, seed", [("test", 9), ("nrf52840", 6), ("jetson-tx2", 0)])
def test_gap_zero_does_not_recompute_the_loss_when_plain_training_fits(dev, seed):
    graph = random_training_graph(3, seed)
    schedule = solve(graph, DEVICES[dev], ram=graph.plain_peak_bytes(), runtime="1.05x", mode="remat", gap=0)
    assert schedule.decisions.recompute == frozenset()
    assert schedule.totals["energy_j"] == schedule.plain["energy_j"]


def test_gap_zero_joint_is_not_worse_than_remat():
    graph = random_training_graph(8, 1)
    joint = solve(graph, DEVICES["test"], ram=21504, mode="joint", gap=0)
    remat = solve(graph, DEVICES["test"], ram=21504, mode="remat", gap=0)
    assert joint.totals["energy_j"] <= remat.totals["energy_j"]


def test_runtime_1x_at_the_plain_peak_returns_plain_training():
    # used to recompute the loss 2.5e-8 s over the budget and fail validation (an internal error)
    graph = random_training_graph(3, 13136)
    assert graph.plain_peak_bytes() == 13316
    schedule = solve(graph, "jetson-tx2", ram=13316, runtime="1x")
    assert schedule.totals["energy_j"] == schedule.plain["energy_j"]


# -- runtime budgets on the edge of a plan -----------------------------------------------------


def _just_below_the_unconstrained_runtime(graph, device, ram, shave):
    """Solve without a runtime limit, then again with a budget a hair below that plan's runtime:
    the answer must be another plan within the budget or an InfeasibleError, never an error."""
    free = solve(graph, device, ram=ram, gap=0)
    runtime_s = free.totals["runtime_s"] - shave(free.totals["runtime_s"])
    if runtime_s < free.plain["runtime_s"]:
        return  # below plain training: refused as bad input, tested elsewhere
    try:
        schedule = solve(graph, device, ram=ram, runtime=runtime_s, gap=0)
    except InfeasibleError:
        return
    assert schedule.totals["runtime_s"] <= runtime_s * (1 + RUNTIME_SLACK)
    assert schedule.totals["energy_j"] >= free.totals["energy_j"] * (1 - REL)


@pytest.mark.parametrize("n, seed, dev, ram, shave", [
    # these used to overshoot the budget by < 1e-7 s and fail validation (an internal error)
    pytest.param(6, 15, "jetson-tx2", 30720, lambda r: r * 1e-6, id="jetson-tx2-1e-6rel"),
    pytest.param(6, 15, "jetson-tx2", 30720, lambda r: 5e-8, id="jetson-tx2-50ns"),
    pytest.param(6, 15, "test", 30720, lambda r: 2e-8, id="test-20ns"),
    # this one used to end in NoScheduleFound: the over-budget plan was the only one found
    pytest.param(5, 14, "nrf52840", 22016, lambda r: 5e-8, id="nrf52840-50ns"),
])
def test_a_runtime_budget_just_below_the_optimum_is_not_an_internal_error(n, seed, dev, ram, shave):
    _just_below_the_unconstrained_runtime(random_training_graph(n, seed), DEVICES[dev], ram, shave)


@given(n=st.integers(3, 7), seed=st.integers(0, 2**20), skip=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       sizes=st.sampled_from(SIZE_CHOICES), dev=devices, percent=st.integers(0, 100),
       shave=st.sampled_from([1e-9, 2e-8, 6e-8]))
# The case that used to end in NoScheduleFound, kept explicit whatever a derandomized run draws:
# random_training_graph(5, 14) at 22016 B.
@example(n=5, seed=14, skip=0.3, sizes=SIZE_CHOICES[0], dev="nrf52840", percent=50, shave=6e-8)
@settings(PROPERTY, max_examples=25)
def test_a_runtime_budget_just_below_an_optimum_gives_a_plan_or_infeasible(n, seed, skip, sizes, dev, percent, shave):
    graph = random_training_graph(n, seed, skip_prob=skip, size_choices=sizes)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    try:
        _just_below_the_unconstrained_runtime(graph, DEVICES[dev], lo + (hi - lo) * percent // 100, lambda r: shave)
    except InfeasibleError:
        pass  # no plan at this RAM at all
