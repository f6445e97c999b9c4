"""The scale work of issue 5: the gap heuristic (a fast MIP start) and the lower bound every result
carries. Timing targets are measured by benchmarks/scale.py, not here."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_test_device
from poet_opt.device.costs import node_costs
from poet_opt.solver.formulation import Formulation
from poet_opt.solver import heuristics
from poet_opt.solver.heuristics import gap_plan, greedy_paging, spill_plan
from poet_opt.device.profiles import load_profile
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.decisions import Keep, build_steps, totals_of
from poet_opt.solver.driver import resolve_budgets
from poet_opt.model.zoo import build_model


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


def test_every_result_carries_a_lower_bound_between_the_plain_floor_and_its_energy():
    from poet_opt.schedule.report import summary_dict, summary_text
    from poet_opt.solver.driver import solve

    graph = random_training_graph(8, 1)
    device = make_test_device()
    for backend in ("highs", "cbc"):  # CBC through PuLP reports no bound of its own: the floor remains
        schedule = solve(graph, device, ram=21504, gap=0, backend=backend, time_limit=20)
        solver, energy = schedule.solver, schedule.totals["energy_j"]
        floor = node_costs(graph, device).plain_energy_j
        assert solver["plain_floor_j"] == pytest.approx(floor, rel=1e-12)
        assert solver["bound"] is not None and floor <= solver["bound"] <= energy
        assert energy > floor * (1 + 1e-6), "the case should need remat or paging, or the test shows nothing"
        low = summary_dict(schedule)["lower_bound"]
        assert low["bound_j"] == solver["bound"] and low["gap"] == solver["gap"]
        assert low["above_floor"] == pytest.approx((energy - floor) / energy)
        line = next(x for x in summary_text(schedule).splitlines() if x.strip().startswith("bound"))
        assert "plain-training floor" in line and "gap" in line


def test_a_time_limited_solve_is_bounded_by_the_floor_at_least():
    """HiGHS stopped before its root relaxation still yields a proven gap, from plain training."""
    from poet_opt.solver.driver import solve

    graph = build_model("resnet18-cifar")
    schedule = solve(graph, "rpi4", ram="1.5MB", runtime="1.2x", time_limit=0.01, gap=1e-9)
    solver = schedule.solver
    assert solver["bound"] >= solver["plain_floor_j"]
    assert solver["gap"] == pytest.approx((schedule.totals["energy_j"] - solver["bound"]) / schedule.totals["energy_j"])
    assert solver["gap"] < 0.01


@pytest.mark.parametrize("seed", range(6))
def test_gap_milp_is_exact_on_its_space_and_a_restriction_of_the_full_one(seed):
    """Its optimum is no dearer than the greedy on the same space, no cheaper than the full MILP's
    optimum, and a plan the full MILP accepts as a start."""
    from poet_opt.solver.gap_milp import gap_milp_plan
    from poet_opt.solver.driver import solve

    graph = random_training_graph(5 + seed, seed, skip_prob=0.4)
    device = load_profile("jetson-tx2") if seed % 2 else make_test_device()
    costs = node_costs(graph, device)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    ram = lo + (hi - lo) // 2
    budgets = resolve_budgets(graph, device, costs, ram)
    plan = gap_milp_plan(graph, costs, budgets, "joint", time_limit=20, gap=0, settle=None)
    greedy = gap_plan(graph, costs, budgets)
    if greedy is None:
        pytest.skip("nothing in the gap space fits")
    assert plan is not None
    energy = totals_of(graph, costs, build_steps(graph, plan))["energy_j"]
    assert energy <= totals_of(graph, costs, build_steps(graph, greedy))["energy_j"] * (1 + 1e-9)
    assert Formulation(graph, costs, budgets, "joint").encode(plan) is not None
    assert solve(graph, device, ram=ram, gap=0).totals["energy_j"] <= energy * (1 + 1e-9)


@pytest.mark.parametrize("seed,fraction", [(8, 0.7), (15, 0.8), (21, 0.8)])
def test_the_gap_milp_brings_a_tensor_back_early_for_a_reader_recomputed_there(monkeypatch, seed, fraction):
    """A tensor may come back inside its gap, where a reader of it is recomputed, and stay until its
    own read: cheaper than keeping it from the forward pass on or recomputing it twice (on seed 15 the
    gap MILP without such returns finds no plan at all). The plan replays within budget, the full
    MILP accepts it as a start, and the full MILP's optimum is no dearer."""
    from poet_opt.schedule import validator
    from poet_opt.schedule.document import Schedule
    from poet_opt.solver import gap_milp
    from poet_opt.solver.driver import solve

    graph = random_training_graph(8, seed, max_fan_in=3, skip_prob=0.5)
    device = load_profile("rpi4")
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, int(fraction * graph.plain_peak_bytes()))
    plan = gap_milp.gap_milp_plan(graph, costs, budgets, "remat", time_limit=20, gap=0, settle=None)
    monkeypatch.setattr(gap_milp, "MAX_EARLY_RETURNS", 0)
    late_only = gap_milp.gap_milp_plan(graph, costs, budgets, "remat", time_limit=20, gap=0, settle=None)
    energy = heuristics.plan_energy_j(graph, costs, plan)
    assert late_only is None or energy < heuristics.plan_energy_j(graph, costs, late_only) * (1 - 1e-6)
    users = graph.users()
    # recomputed in a stage that does not read it, and kept from there (a chain link is not kept)
    assert any(t not in users[i] and (t + 1, i) in plan.keep for t, i in plan.recompute)
    steps = build_steps(graph, plan)
    validator.replay(Schedule(model=graph.name, mode="remat", graph=graph, profile=device, costs=costs,
                              budgets=budgets, decisions=plan, steps=steps, totals=totals_of(graph, costs, steps),
                              plain={}, solver={}).to_dict())
    assert Formulation(graph, costs, budgets, "remat").encode(plan) is not None
    assert solve(graph, device, ram=budgets.ram_bytes, mode="remat", gap=0, order="given").totals["energy_j"] \
        <= energy * (1 + 1e-9)


@pytest.mark.parametrize("mode", ["remat", "joint"])
@pytest.mark.parametrize("seed", range(4))
def test_a_plan_without_early_returns_is_the_start_of_the_model_with_them(seed, mode):
    """gap_milp_plan solves without early returns first and hands that plan to the model with them:
    it must encode there (a point that keeps every row and decodes to the same plan), or the
    second solve could end above the first."""
    from poet_opt.solver import gap_milp
    from poet_opt.solver.backends import solve_milp

    graph = random_training_graph(12, seed, max_fan_in=3, skip_prob=0.5)
    device = load_profile("rpi4")
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, int(0.85 * graph.plain_peak_bytes()))
    late = gap_milp.GapMilp(graph, costs, budgets, mode, early_returns=0)
    result = solve_milp(late.milp, time_limit=20, gap=0)
    if result.x is None:
        pytest.skip("nothing in the space without early returns fits")
    plan = late.decode(result.x)
    assert late.encode(plan) is not None
    model = gap_milp.GapMilp(graph, costs, budgets, mode)
    assert model.has_early_returns
    x = model.encode(plan)
    assert x is not None and model.decode(x) == plan
    m = model.milp
    rows = m.A @ x
    assert (rows >= m.row_lb - 1e-9).all() and (rows <= m.row_ub + 1e-9).all()
    assert (x >= m.lb).all() and (x <= m.ub).all()
    assert float(m.c @ x) + m.offset == pytest.approx(heuristics.plan_energy_j(graph, costs, plan), rel=1e-9)


def test_past_the_size_limit_the_best_start_stands_with_the_floor_as_bound(monkeypatch):
    import poet_opt.solver.driver as solve_module

    graph = random_training_graph(12, 3)
    ram = (graph.min_working_set_bytes() + graph.plain_peak_bytes()) // 2
    monkeypatch.setattr(solve_module, "FULL_MILP_MAX_DECISIONS", 0)
    # without the window relaxations (tests/test_bounds.py, tests/test_chain_bound.py), which raise
    # the bound above the floor
    monkeypatch.setattr(solve_module, "window_bound", lambda *args, **kwargs: None)
    monkeypatch.setattr(solve_module, "chain_bound", lambda *args, **kwargs: None)
    schedule = solve_module.solve(graph, make_test_device(), ram=ram, time_limit=10)
    solver = schedule.solver
    assert solver["full_milp"].startswith("skipped")
    assert solver["variables"] is None
    assert schedule.totals["peak_ram_bytes"] <= ram  # and solve() ran the validator on it
    assert solver["bound"] == pytest.approx(solver["plain_floor_j"])
    assert solver["status"] in ("gap_limit", "time_limit")


def test_without_a_time_limit_a_model_too_large_for_memory_is_not_built(monkeypatch):
    """No time limit asks to wait for the optimum, but not for a model that cannot be built: a
    row-tiled bert-base's would have 2.3 billion binaries. The best start stands, and the claim says
    why without speaking of a time limit that was never given."""
    import poet_opt.solver.driver as solve_module
    from poet_opt.schedule.report import summary_text
    from poet_opt.solver import gap_milp

    graph = random_training_graph(12, 3)
    ram = (graph.min_working_set_bytes() + graph.plain_peak_bytes()) // 2
    monkeypatch.setattr(solve_module, "FULL_MILP_MEMORY_MAX_DECISIONS", 0)
    built = []
    monkeypatch.setattr(solve_module, "Formulation", lambda *a, **k: built.append(1))
    monkeypatch.setattr(gap_milp, "MAX_RAM_ROW_ENTRIES", 0)  # and the gap MILP refuses to build as well
    monkeypatch.setattr(gap_milp, "solve_milp", lambda *a, **k: built.append("gap"))
    schedule = solve_module.solve(graph, make_test_device(), ram=ram, gap=0)
    assert not built
    solver = schedule.solver
    assert solver["full_milp"].startswith("skipped") and "too many to build in memory" in solver["full_milp"]
    assert schedule.totals["peak_ram_bytes"] <= ram
    if solver["status"] != "optimal":
        assert solver["status"] == "stopped"
        assert "too large to build in memory" in summary_text(schedule) and "time limit" not in summary_text(schedule)


def test_a_solver_abort_in_the_gap_milp_only_loses_the_start():
    """HiGHS 1.15 aborts ("vector::reserve") on this instance of the gap MILP; solve() must not."""
    from poet_opt.solver.gap_milp import gap_milp_plan
    from poet_opt.solver.driver import solve

    graph = random_training_graph(7, 8192, skip_prob=0.7, size_choices=(512, 4096, 32768))
    device = load_profile("nrf52840")
    costs = node_costs(graph, device)
    ram = graph.min_working_set_bytes()
    budgets = resolve_budgets(graph, device, costs, ram, 0.45737227318137785)
    plan = gap_milp_plan(graph, costs, budgets, "joint", time_limit=10)
    if plan is not None:
        assert totals_of(graph, costs, build_steps(graph, plan))["peak_ram_bytes"] <= ram
    from poet_opt.errors import InfeasibleError

    with pytest.raises(InfeasibleError) as info:  # a hair below the optimum's runtime, at the working set
        solve(graph, device, ram=ram, runtime=0.45737227318137785, gap=0)
    assert info.value.min_ram_bytes > ram


@pytest.mark.parametrize("mode", ["none", "remat", "paging"])
def test_starting_points_only_use_what_the_mode_allows(mode):
    from poet_opt.solver.heuristics import starting_points

    graph = random_training_graph(6, 301460, size_choices=(4096,), skip_prob=0.0)
    device = load_profile("rpi4")
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, graph.plain_peak_bytes() - 1)
    plans = starting_points(graph, costs, budgets, mode)
    assert mode != "none" or plans == []
    for plan in plans:
        assert mode != "paging" or not plan.recompute
        assert mode != "remat" or not (plan.page_in or plan.page_out)


def _root_lp(form: Formulation) -> float:
    import highspy

    from poet_opt.solver.backends import highs_lp

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(highs_lp(form.milp, relax=True))
    h.run()
    assert h.modelStatusToString(h.getModelStatus()) == "Optimal"
    return h.getInfo().objective_function_value  # highs_lp carries the offset


def test_stage_boundary_rows_tighten_the_root_relaxation():
    # Without them the LP keeps half of two tensors across the peak stage and releases the other half
    # twice over: its bound sits at plain energy + 0.4% while the optimum needs +9.8% (an expensive
    # recomputation). With them the relaxation already pays for most of it.
    graph = build_model("transformer-block")
    device = load_profile("rpi4")
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, int(0.7 * graph.plain_peak_bytes()))
    loose = _root_lp(Formulation(graph, costs, budgets, "remat", tighten=False))
    tight = _root_lp(Formulation(graph, costs, budgets, "remat"))
    plain = costs.plain_energy_j
    assert loose / plain < 1.01
    assert tight / plain > 1.05


@pytest.mark.parametrize("case", ["transformer-block@rpi4@0.7@joint", "transformer-block@rpi4@0.7@remat",
                                  "rand12@test@0.6@joint", "rand14@jetson-tx2@0.5@joint", "rand14@test@0.8@paging"])
def test_a_cost_cap_from_a_start_keeps_the_optimum_and_shrinks_the_model(case):
    from poet_opt.solver.heuristics import starting_points
    from poet_opt.solver.backends import solve_milp

    model, dev, fraction, mode = case.split("@")
    graph = (build_model(model) if not model.startswith("rand")
             else random_training_graph(int(model[4:]), 3, skip_prob=0.5))
    device = make_test_device() if dev == "test" else load_profile(dev)
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, int(float(fraction) * graph.plain_peak_bytes()))
    starts = starting_points(graph, costs, budgets, mode)
    assert starts, "the case needs a heuristic start to cap from"
    head = totals_of(graph, costs, build_steps(graph, starts[0]))["energy_j"]
    full = Formulation(graph, costs, budgets, mode)
    capped = Formulation(graph, costs, budgets, mode, cost_cap=head - costs.plain_energy_j + 1e-9 * head)
    assert capped.milp.num_vars <= full.milp.num_vars
    if case == "transformer-block@rpi4@0.7@joint":  # a start 0.02% above plain: no matmul is recomputed
        assert capped.milp.num_vars < 0.7 * full.milp.num_vars
    optima = []
    for form in (full, capped):
        result = solve_milp(form.milp, gap=0.0, threads=1, start=form.encode(starts[0]))
        assert result.status == "optimal"
        optima.append(result.objective)
    assert optima[1] == pytest.approx(optima[0], rel=1e-9)


def test_one_page_out_rows_stop_the_lp_paging_in_slivers():
    # Paging being cheap on the Pi's SD card, the LP pages a tensor out at 0.02 and in at 0.02 in
    # each of thirty stages; with a page-out required once for all of them the root bound almost
    # reaches the optimum (1.000215 of plain).
    from poet_opt.solver.heuristics import starting_points

    graph = random_training_graph(50, seed=1)
    device = load_profile("rpi4")
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, int(0.9 * graph.plain_peak_bytes()))
    head = totals_of(graph, costs, build_steps(graph, starting_points(graph, costs, budgets, "joint")[0]))["energy_j"]
    cap = head - costs.plain_energy_j + 1e-9 * head
    plain = costs.plain_energy_j
    loose = _root_lp(Formulation(graph, costs, budgets, "joint", tighten=False, cost_cap=cap)) / plain
    tight = _root_lp(Formulation(graph, costs, budgets, "joint", cost_cap=cap)) / plain
    assert loose < 1.00010 < 1.00020 < tight


def test_input_kept_rows_stop_the_lp_recomputing_in_slivers():
    # On the nRF52840 the LP kept 2% of bn0 through the forward pass and recomputed 2% of relu0 from
    # it in each of thirty backward stages; the optimum (+1.077% of plain) recomputes whole tensors.
    from poet_opt.solver.heuristics import starting_points

    graph = build_model("mcu-vww")
    device = load_profile("nrf52840")
    costs = node_costs(graph, device)
    budgets = resolve_budgets(graph, device, costs, int(0.9 * graph.plain_peak_bytes()))
    start = starting_points(graph, costs, budgets, "joint")[0]
    head = totals_of(graph, costs, build_steps(graph, start))["energy_j"]
    cap = head - costs.plain_energy_j + 1e-9 * head
    plain = costs.plain_energy_j
    loose = _root_lp(Formulation(graph, costs, budgets, "joint", tighten=False, cost_cap=cap)) / plain
    form = Formulation(graph, costs, budgets, "joint", cost_cap=cap)
    tight = _root_lp(form) / plain
    assert loose < 1.003 < 1.009 < tight
    # the suffix-sum columns are part of a MIP start like every other column
    assert form.Q.max() >= 0 and form.encode(start) is not None


_PAIRS = st.frozensets(st.tuples(st.integers(0, 30), st.integers(0, 8)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_PAIRS, _PAIRS)
def test_keep_runs_behave_as_the_set_of_their_pairs(a, b):
    ka, kb = Keep.of(a), Keep.of(b)
    assert set(ka) == a and len(ka) == len(a) and bool(ka) == bool(a)
    assert ka == a and a == ka and (ka == kb) == (a == b)
    for t in range(-1, 32):
        for i in range(-1, 10):
            assert ((t, i) in ka) == ((t, i) in a)
    assert ka | kb == a | b and ka | b == a | b and set(a | kb) == a | b
    assert pickle.loads(pickle.dumps(ka)) == ka and hash(Keep.of(set(a))) == hash(ka)
    assert Keep.from_ranges((i, t, t) for t, i in a) == ka
    assert all(x[1] + 1 < y[0] for runs in ka.runs.values() for x, y in zip(runs, runs[1:]))


@pytest.mark.parametrize("seed", range(12))
def test_spill_plan_is_valid_and_fits_down_to_the_largest_working_set(seed):
    """The start that needs no search holds, at the all-out extreme, only what each node reads and
    writes: it must fit every budget down to the largest working set of one step when storage and
    time allow, and each plan must pass the independent validator."""
    from poet_opt.schedule import validator
    from poet_opt.schedule.document import Schedule

    graph = random_training_graph(5 + 3 * seed, seed, max_fan_in=3, skip_prob=0.5, zero_cost_prob=0.2)
    device = make_test_device() if seed % 3 else load_profile("stm32f746")
    costs = node_costs(graph, device)
    lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
    for ram in (lo, (lo + hi) // 2, hi - 1):
        budgets = resolve_budgets(graph, device, costs, max(ram, lo))
        plan = spill_plan(graph, costs, budgets)
        if seed % 3:  # storage in 4 KiB blocks, 1 GiB of it: the all-out plan always fits
            assert plan is not None, ram
        if plan is None:
            continue
        steps = build_steps(graph, plan)
        totals = totals_of(graph, costs, steps)
        assert totals["peak_ram_bytes"] <= budgets.ram_bytes
        assert not plan.recompute  # paging only: no parameters in these graphs
        doc = Schedule(model=graph.name, mode="joint", graph=graph, profile=device, costs=costs, budgets=budgets,
                       decisions=plan, steps=steps, totals=totals, plain={}, solver={}).to_dict()
        validator.replay(doc)


def test_a_paging_start_within_the_gap_of_the_floor_ends_the_search_at_once(monkeypatch):
    """Where the full MILP is skipped for its size, a linear paging start within the requested gap
    of the plain floor is proven by the floor: no other start, no gap MILP and no window search run
    (l1000 joint at 90% spent 28-45 s there; the window bound may still say, within 5 s, how much
    less the optimum can be). At 95% of plain training's peak paging a few
    tensors costs a sliver of energy."""
    import poet_opt.solver.driver as driver
    import poet_opt.solver.heuristics as heuristics

    ran = []
    graph = random_training_graph(60, seed=4, max_fan_in=3, skip_prob=0.3)
    profile = load_profile("rpi4")
    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, int(0.95 * graph.plain_peak_bytes()))
    plan = spill_plan(graph, costs, budgets)
    floor = costs.plain_energy_j
    assert plan is not None and heuristics.plan_energy_j(graph, costs, plan) <= floor * 1.01
    assert heuristics.starting_points(graph, costs, budgets, "joint", good_enough=floor * 1.01) == [plan]
    assert len(heuristics.starting_points(graph, costs, budgets, "joint")) > 1
    monkeypatch.setattr(heuristics, "gap_plan", lambda *a, **k: ran.append("gap_plan"))
    monkeypatch.setattr(driver, "gap_milp_plan", lambda *a, **k: ran.append("gap MILP"))
    monkeypatch.setattr(driver, "window_search", lambda *a, **k: ran.append("window search"))
    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    schedule = driver.solve(graph, profile, ram=budgets.ram_bytes, gap=0.01, order="given", time_limit=30)
    assert ran == []
    assert schedule.solver["status"] == "gap_limit" and schedule.solver["gap"] <= 0.01
    assert schedule.solver["full_milp"].startswith("not needed")


@pytest.mark.parametrize("order", ["given", "auto"])
def test_a_start_within_the_gap_of_the_floor_is_the_answer_at_any_size(monkeypatch, order):
    """Plain training's energy bounds every plan in every order, so a start within the requested gap
    of it is proven: on a graph small enough for the full MILP, neither the gap MILP, the window
    bound nor the full MILP runs, and no other execution order is solved (they only polished the
    plan below the gap the user accepted: 0.3 s on ResNet-50, 3.4 s on l250 joint 80%). A finer gap
    than the start reaches runs them again."""
    import poet_opt.solver.driver as driver

    graph = random_training_graph(60, seed=4, max_fan_in=3, skip_prob=0.3)
    profile = load_profile("rpi4")
    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, int(0.95 * graph.plain_peak_bytes()))
    floor = costs.plain_energy_j
    starts = heuristics.starting_points(graph, costs, budgets, "joint")
    start_gap = (heuristics.plan_energy_j(graph, costs, starts[0]) - floor) / heuristics.plan_energy_j(
        graph, costs, starts[0])
    assert 0 < start_gap < 0.01
    assert driver.decision_count(graph, "joint") <= driver.FULL_MILP_MAX_DECISIONS
    ran = []
    real = {name: getattr(driver, name) for name in ("gap_milp_plan", "window_bound", "Formulation")}
    for name, fn in real.items():
        monkeypatch.setattr(driver, name, lambda *a, _n=name, _f=fn, **k: (ran.append(_n), _f(*a, **k))[1])
    schedule = driver.solve(graph, profile, ram=budgets.ram_bytes, gap=0.01, order=order, time_limit=30)
    assert ran == []
    assert schedule.solver["status"] == "gap_limit" and schedule.solver["orders_tried"] == 1
    assert schedule.solver["bound"] == floor and schedule.solver["gap"] == pytest.approx(start_gap, rel=1e-9)
    assert schedule.solver["full_milp"] == "not needed: the best start is within the gap of the plain-training floor"
    finer = driver.solve(graph, profile, ram=budgets.ram_bytes, gap=start_gap / 2, order="given", time_limit=30)
    assert "gap_milp_plan" in ran and finer.totals["energy_j"] <= schedule.totals["energy_j"]
