"""Energy-memory Pareto sweeps (poet_opt.pareto.front and `poet-opt pareto` / `poet-opt plot`): rows for
every point whatever happens to it, the same rows from a process pool as in-process, fronts that
never get worse with more RAM, infeasible budgets below the smallest feasible one, the CSV and the
plots, and the CLI's one-line errors. Small graphs only: the whole file runs in well under a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import make_test_device
from poet_opt import pareto, plots
from poet_opt.pareto import executors
from poet_opt.schedule.document import PROVEN_STATUSES
from poet_opt.cli import main
from poet_opt.errors import PoetError
from poet_opt.device.costs import node_costs
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.decisions import build_steps, totals_of
from poet_opt.solver.driver import solve
from poet_opt.model.zoo import build_model

MLP = build_model("mlp")
MLP_MIN = MLP.min_working_set_bytes()
MLP_PLAIN = MLP.plain_peak_bytes()
# two budgets below what any schedule needs, three from the smallest feasible one up to plain training
MLP_RAMS = [MLP_MIN // 2, MLP_MIN * 3 // 4, MLP_MIN, (MLP_MIN + MLP_PLAIN) // 2, MLP_PLAIN]
RANDOM = random_training_graph(8, seed=1)
FAST = {"time_limit": 20, "gap": 0.0}


def _without_time(rows):
    return [{k: v for k, v in r.items() if k != "solve_s"} for r in rows]


@pytest.fixture(scope="module")
def mlp_rows():
    return pareto.sweep("mlp", [make_test_device()], MLP_RAMS, modes=("joint", "remat"), jobs=1, **FAST)


# ---------------------------------------------------------------- budgets


def test_ram_range_is_geometric_and_includes_both_ends():
    values = pareto.ram_range("1KB", "16KB", 5)
    assert values == [1000, 2000, 4000, 8000, 16000]
    assert pareto.ram_range(1000, 1003, 10) == [1000, 1001, 1002, 1003]  # no duplicates


@pytest.mark.parametrize("args, needle", [
    (("4KB", "1KB", 3), "reversed"),
    (("1KB", "1KB", 3), "empty"),
    (("1KB", "4KB", 1), "at least 2 points"),
    (("-1KB", "4KB", 3), "positive"),
])
def test_ram_range_refuses_bad_input(args, needle):
    with pytest.raises(PoetError, match=needle):
        pareto.ram_range(*args)


def test_parse_ram_list():
    assert pareto.parse_ram_list("2KB, 1KB,2KB") == [1000, 2000]
    for bad in ("1KB,0", "1KB,,2KB", "", "1KB,-3KB"):
        with pytest.raises(PoetError):
            pareto.parse_ram_list(bad)


# ---------------------------------------------------------------- the sweep


def test_rows_have_every_column_and_order(mlp_rows):
    assert len(mlp_rows) == 2 * len(MLP_RAMS)
    assert not mlp_rows.interrupted
    for row in mlp_rows:
        assert list(row) == pareto.COLUMNS
        assert row["status"] in pareto.STATUSES
        assert row["plain_peak_bytes"] == MLP_PLAIN
    assert [(r["mode"], r["ram_bytes"]) for r in mlp_rows] == [(m, b) for m in ("joint", "remat") for b in MLP_RAMS]


def test_infeasible_below_the_smallest_feasible_budget(mlp_rows):
    for mode in ("joint", "remat"):
        rows = [r for r in mlp_rows if r["mode"] == mode]
        solved = [r for r in rows if r["status"] in pareto.SOLVED]
        smallest = min(r["ram_bytes"] for r in solved)
        for r in rows:
            if r["ram_bytes"] < smallest:
                assert r["status"] == "infeasible" and r["energy_j"] is None
                assert r["min_feasible_ram_bytes"] == MLP_MIN
        # solved from the bottom up: the smallest budget's minimum-peak search proves the smallest
        # feasible budget, so the other infeasible budgets are skipped, not solved
        infeasible = [r for r in rows if r["status"] == "infeasible"]
        assert [r["solve_s"] > 0 for r in infeasible] == [True] + [False] * (len(infeasible) - 1)


def test_energy_never_rises_with_more_ram(mlp_rows):
    rows = [*mlp_rows, *pareto.sweep(RANDOM, [make_test_device()], [18000, 22000, 26000, 30000, 36000],
                                     modes=("joint", "paging"), jobs=1, **FAST)]
    for key in {(r["model"], r["mode"]) for r in rows}:
        energies = [r["energy_j"] for r in rows if (r["model"], r["mode"]) == key
                    and r["status"] in ("optimal", "optimal_for_order")]
        assert len(energies) >= 2, key
        assert all(b <= a * (1 + 1e-9) for a, b in zip(energies, energies[1:])), (key, energies)


def test_rows_match_single_solves(mlp_rows):
    row = next(r for r in mlp_rows if r["mode"] == "joint" and r["ram_bytes"] == MLP_RAMS[3])
    s = solve(MLP, make_test_device(), ram=MLP_RAMS[3], mode="joint", **FAST)
    assert row["energy_j"] == pytest.approx(s.totals["energy_j"])
    assert row["peak_ram_bytes"] == s.totals["peak_ram_bytes"]
    assert row["plain_energy_j"] == pytest.approx(s.plain["energy_j"])


def test_a_process_pool_gives_the_same_rows(mlp_rows):
    pooled = pareto.sweep("mlp", [make_test_device()], MLP_RAMS, modes=("joint", "remat"), jobs=2, **FAST)
    assert _without_time(pooled) == _without_time(mlp_rows)


def test_a_graph_object_runs_on_the_pool():
    rams = [20000, 30000]
    one = pareto.sweep(RANDOM, make_test_device(), rams, jobs=1, **FAST)
    two = pareto.sweep(RANDOM, make_test_device(), rams, jobs=2, **FAST)
    assert _without_time(one) == _without_time(two)
    assert {r["model"] for r in one} == {RANDOM.name}


def test_a_runtime_budget_no_device_meets_fails_before_solving():
    # below 1x, or below plain training on every device: bad input, not a sweep of failed rows
    for runtime in ("0.5x", "1us"):
        with pytest.raises(PoetError, match="below plain training"):
            pareto.sweep("mlp", [make_test_device()], [MLP_MIN, MLP_PLAIN], runtime=runtime, jobs=1, **FAST)


def test_a_runtime_budget_one_device_misses_makes_its_points_infeasible_saying_why():
    fast = make_test_device()
    slow = fast.model_copy(update={"name": "slow", "compute": fast.compute.model_copy(
        update={"flops_per_second": fast.compute.flops_per_second / 100})})
    plain_s = node_costs(build_model("mlp"), fast).plain_runtime_s
    rows = pareto.sweep("mlp", [fast, slow], [MLP_PLAIN], runtime=f"{2 * plain_s}s", jobs=1, **FAST)
    assert [(r["device"], r["status"]) for r in rows] == [(fast.name, "optimal"), ("slow", "infeasible")]
    assert "below plain training" in rows[1]["error"]


def test_bad_input_fails_before_solving():
    with pytest.raises(PoetError, match="unknown mode"):
        pareto.sweep("mlp", [make_test_device()], [MLP_PLAIN], modes=("fast",))
    with pytest.raises(PoetError, match="unknown model"):
        pareto.sweep("no-such-model", [make_test_device()], [MLP_PLAIN])
    with pytest.raises(PoetError, match="jobs"):
        pareto.sweep("mlp", [make_test_device()], [MLP_PLAIN], jobs=0)


def test_ctrl_c_keeps_the_finished_rows():
    seen = []

    def progress(done, total, row):
        seen.append(row)
        if done == 2:
            raise KeyboardInterrupt

    rows = pareto.sweep("mlp", [make_test_device()], MLP_RAMS, jobs=1, progress=progress, **FAST)
    assert rows.interrupted
    assert len(rows) == 2 and _without_time(rows) == _without_time(sorted(seen, key=lambda r: r["ram_bytes"]))


# ---------------------------------------------------------------- front, CSV, plots


def _row(device, mode, ram, energy, status="optimal"):
    return {"device": device, "mode": mode, "ram_bytes": ram, "energy_j": energy, "status": status}


def test_non_dominated_on_a_hand_made_list():
    rows = [
        _row("a", "joint", 100, 5.0),
        _row("a", "joint", 200, 3.0),
        _row("a", "joint", 300, 3.0),  # same energy, more RAM: dominated
        _row("a", "joint", 250, 4.0),  # dominated by 200
        _row("a", "joint", 400, 1.0),
        _row("a", "joint", 50, None, "infeasible"),  # no energy: never on the front
        _row("a", "remat", 300, 3.5),  # its own series
        _row("b", "joint", 150, 9.0, "time_limit"),
        _row("b", "joint", 150, 8.0, "gap_limit"),  # same RAM, less energy
    ]
    front = pareto.non_dominated(rows)
    assert [(r["device"], r["mode"], r["ram_bytes"], r["energy_j"]) for r in front] == [
        ("a", "joint", 100, 5.0), ("a", "joint", 200, 3.0), ("a", "joint", 400, 1.0),
        ("a", "remat", 300, 3.5), ("b", "joint", 150, 8.0)]


def test_csv_round_trip(mlp_rows, tmp_path):
    path = tmp_path / "sub" / "pareto.csv"
    pareto.write_csv(mlp_rows, path)
    assert path.read_text().splitlines()[0] == ",".join(pareto.COLUMNS)
    back = pareto.read_csv(path)
    assert len(back) == len(mlp_rows)
    for a, b in zip(back, mlp_rows):
        assert list(a) == pareto.COLUMNS
        for k in pareto.COLUMNS:
            if isinstance(b[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-12)
            else:
                assert a[k] == b[k], k


def test_front_plot_png_and_svg(mlp_rows, tmp_path):
    written = plots.plot_front(mlp_rows, tmp_path / "front")
    assert sorted(p.name for p in written) == ["front.png", "front.svg"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert plots.plot_front([], tmp_path / "empty.png")[0].stat().st_size > 0


@pytest.fixture(scope="module")
def schedule_file(tmp_path_factory):
    s = solve(RANDOM, make_test_device(), ram=22000, mode="joint", **FAST)
    path = tmp_path_factory.mktemp("sched") / "s.json"
    path.write_text(json.dumps(s.to_dict()))
    return path


def test_timeline_replay_and_plot(schedule_file, tmp_path):
    doc = json.loads(schedule_file.read_text())
    tl = plots.timeline(doc)
    assert max(tl["total"]) == doc["totals"]["peak_ram_bytes"]
    assert len(tl["marks"]["recompute"]) == doc["totals"]["recomputes"]
    assert len(tl["marks"]["page_in"]) == doc["totals"]["page_ins"]
    n = len(doc["graph"]["nodes"])
    assert all(tl["matrix"][t][t] == 5 for t in range(n))  # stage t computes node t
    paged = solve(RANDOM, make_test_device(), ram=22000, mode="paging", **FAST).to_dict()
    tl = plots.timeline(paged)
    assert len(tl["marks"]["page_in"]) == paged["totals"]["page_ins"] > 0
    assert len(tl["marks"]["page_out"]) == paged["totals"]["page_outs"] > 0
    assert sum(row.count(3) for row in tl["matrix"]) == paged["totals"]["page_ins"]
    written = plots.plot_timeline(doc, tmp_path / "t.svg")
    assert {p.suffix for p in written} == {".svg", ".png"}
    assert all(p.stat().st_size > 1000 for p in written)


# ---------------------------------------------------------------- CLI


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, needle, code=2):
    assert result.exit_code == code, (result.exit_code, result.stderr, result.exception)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("poet-opt: error: "), lines
    assert needle in lines[0], lines[0]
    assert result.stdout == ""


def test_cli_pareto_happy_path(tmp_path):
    out = tmp_path / "sweep"
    result = cli("pareto", "--model", "mlp", "--device", "rpi4", "--device", "nrf52840", "--ram-from", f"{MLP_MIN // 2}B",
                 "--ram-to", f"{MLP_PLAIN}B", "--points", 3, "--modes", "joint,remat", "--time-limit", 20, "--jobs", 1,
                 "-o", out)
    assert result.exit_code == 0, result.output
    for name in ("pareto.csv", "pareto_front.csv", "pareto.png", "pareto.svg"):
        assert (out / name).stat().st_size > 0, name
    rows = pareto.read_csv(out / "pareto.csv")
    assert len(rows) == 2 * 2 * 3
    assert {r["device"] for r in rows} == {"rpi4", "nrf52840"}
    front = pareto.read_csv(out / "pareto_front.csv")
    assert front and all(r["status"] in pareto.SOLVED for r in front)
    assert result.stdout.splitlines()[0].split()[:4] == ["device", "mode", "RAM", "budget"]
    assert "smallest feasible budget" in result.stdout
    # not a terminal: one progress line per point on stderr
    assert len([ln for ln in result.stderr.splitlines() if ln.startswith("[")]) == 12


@pytest.mark.parametrize("args, needle", [
    (["--ram-from", "8KB", "--ram-to", "4KB", "--points", "3"], "reversed"),
    (["--ram-from", "4KB", "--ram-to", "4KB", "--points", "3"], "empty"),
    (["--ram-from", "4KB", "--ram-to", "8KB", "--points", "1"], "--points"),
    (["--ram", "4KB,0"], "positive"),
    (["--ram", "4KB,-1KB"], "positive"),
    (["--ram", "4KB,,8KB"], "comma-separated"),
    (["--ram-from", "4KB"], "together"),
    (["--ram", "4KB", "--points", "3"], "either"),
    (["--ram", "4KB", "--modes", "joint,fast"], "unknown mode"),
    (["--ram", "4KB", "--jobs", "0"], "--jobs"),
    (["--ram", "4KB", "--time-limit", "0"], "--time-limit"),
])
def test_cli_pareto_bad_input(args, needle, tmp_path):
    out = tmp_path / "never"
    one_line_error(cli("pareto", "--model", "mlp", "--device", "rpi4", *args, "-o", out), needle)
    assert not out.exists()


def test_cli_pareto_output_not_writable(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    one_line_error(cli("pareto", "--model", "mlp", "--device", "rpi4", "--ram", "8KB", "-o", a_file),
                   "not a directory")
    one_line_error(cli("pareto", "--model", "mlp", "--device", "rpi4", "--ram", "8KB", "-o", a_file / "sub"),
                   "not a directory")


def test_cli_pareto_bad_model_and_device(tmp_path):
    one_line_error(cli("pareto", "--model", "nope", "--device", "rpi4", "--ram", "8KB", "-o", tmp_path / "o"),
                   "unknown model")
    one_line_error(cli("pareto", "--model", "mlp", "--device", "nope", "--ram", "8KB", "-o", tmp_path / "o"),
                   "unknown device")


def test_cli_plot(schedule_file, tmp_path):
    out = tmp_path / "timeline.png"
    result = cli("plot", schedule_file, "-o", out)
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 1000


def test_cli_plot_bad_input(schedule_file, tmp_path):
    out = tmp_path / "t.png"
    not_json = tmp_path / "x.json"
    not_json.write_text("{")
    one_line_error(cli("plot", not_json, "-o", out), "not valid JSON")
    broken = json.loads(schedule_file.read_text())
    broken["steps"] = broken["steps"][1:]  # the first compute goes missing
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(broken))
    one_line_error(cli("plot", bad, "-o", out), "not a valid schedule")
    one_line_error(cli("plot", schedule_file, "-o", tmp_path / "t.pdf"), ".png or .svg")
    one_line_error(cli("plot", tmp_path / "missing.json", "-o", out), "cannot read")
    assert not out.exists()


_real_run_point = executors.run_point


def _dying_run_point(task):
    """Kills the worker on one budget: as if the OOM killer took it."""
    import os

    if task["ram"] == MLP_RAMS[-1]:
        os._exit(1)
    return _real_run_point(task)


def test_a_dead_worker_costs_its_points_not_the_sweep(monkeypatch):
    # the pool pickles the function it runs by name, so its workers import this module and run the
    # patched one
    monkeypatch.setattr(executors, "run_point", _dying_run_point)
    rows = pareto.sweep("mlp", [make_test_device()], MLP_RAMS, modes=("joint",), jobs=2, **FAST)
    assert not rows.interrupted
    assert [r["ram_bytes"] for r in rows] == MLP_RAMS
    dead = rows[-1]
    assert dead["status"] == "error" and "worker process" in dead["error"] and "died" in dead["error"]
    monkeypatch.undo()
    healthy = pareto.sweep("mlp", [make_test_device()], MLP_RAMS[:-1], modes=("joint",), jobs=1, **FAST)
    assert _without_time(rows[:-1]) == _without_time(healthy)


def test_cli_pareto_on_a_graph_file(tmp_path):
    graph = Path(__file__).resolve().parents[2] / "shared" / "graphs" / "random_training_s1_n8.json"
    if not graph.exists():
        pytest.skip("shared graphs not present")
    out = tmp_path / "g"
    result = cli("pareto", "--graph", graph, "--device", "rpi4", "--ram", "40KB,80KB,200KB", "--jobs", 1, "-q", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # -q: no progress
    rows = pareto.read_csv(out / "pareto.csv")
    assert [r["model"] for r in rows] == ["random_training_s1_n8"] * 3
    assert rows[0]["status"] in pareto.INFEASIBLE and rows[-1]["status"] in ("optimal", "optimal_for_order")


# ---------------------------------------------------------------- warm starts


COSTS = node_costs(RANDOM, make_test_device())
WARM_RAMS = [18000, 22000, 23000, 24000, 28000, 33000, 36000]  # 18 KB: infeasible


def test_a_warm_sweep_gives_the_cold_energies():
    kwargs = {"modes": ("joint", "paging"), "jobs": 1, "time_limit": 20, "gap": 1e-3}
    cold = pareto.sweep(RANDOM, make_test_device(), WARM_RAMS, warm=False, **kwargs)
    warm = pareto.sweep(RANDOM, make_test_device(), WARM_RAMS, warm=True, **kwargs)
    assert [(r["mode"], r["ram_bytes"], r["status"] in pareto.SOLVED) for r in warm] == \
        [(r["mode"], r["ram_bytes"], r["status"] in pareto.SOLVED) for r in cold]
    compared = 0
    for c, w in zip(cold, warm):
        if c["status"] in PROVEN_STATUSES and w["status"] in PROVEN_STATUSES:
            # each is within the gap of the same optimum
            assert abs(w["energy_j"] - c["energy_j"]) <= 1e-3 * max(c["energy_j"], w["energy_j"]) * (1 + 1e-9), (c, w)
            assert w["peak_ram_bytes"] <= w["ram_bytes"]
            compared += 1
    assert compared >= 8


def test_each_point_starts_from_the_schedule_of_the_budget_below(monkeypatch):
    import poet_opt.solver.driver as solve_module

    calls = []
    real = solve_module.solve

    def spy(graph, device, *, ram, start=None, **kw):
        schedule = real(graph, device, ram=ram, start=start, **kw)
        calls.append((kw["mode"], ram, start, schedule))
        return schedule

    monkeypatch.setattr(solve_module, "solve", spy)
    pareto.sweep(RANDOM, make_test_device(), WARM_RAMS, modes=("joint", "remat"), jobs=1, **FAST)
    for mode in ("joint", "remat"):
        mine = [c for c in calls if c[0] == mode]
        assert [c[1] for c in mine] == sorted(c[1] for c in mine)  # bottom up
        assert mine[0][2] is None  # the first solved point has no neighbour below
        for below, here in zip(mine, mine[1:]):
            # the plan of the budget below, in its execution order, loosened for this one's extra RAM
            order, decisions = here[2]
            assert tuple(order) == below[3].order
            graph, costs = below[3].graph, below[3].costs
            assert decisions == pareto.loosen(graph, costs, below[3].decisions, here[1])
            replayed = totals_of(graph, costs, build_steps(graph, decisions))
            assert replayed["peak_ram_bytes"] <= here[1]
            assert replayed["energy_j"] <= below[3].totals["energy_j"] * (1 + 1e-12)
    calls.clear()
    pareto.sweep(RANDOM, make_test_device(), WARM_RAMS[:3], modes=("joint",), jobs=1, warm=False, **FAST)
    assert calls and all(c[2] is None for c in calls)


def test_loosen_keeps_what_the_extra_ram_allows():
    tight = solve(RANDOM, make_test_device(), ram=22000, mode="joint", **FAST)
    assert tight.totals["recomputes"] + tight.totals["page_ins"] > 0
    # the same budget: nothing can move, and the plan stays as good and as small
    same = pareto.loosen(RANDOM, COSTS, tight.decisions, 22000)
    replayed = totals_of(RANDOM, COSTS, build_steps(RANDOM, same))
    assert replayed["peak_ram_bytes"] <= 22000
    assert replayed["energy_j"] <= tight.totals["energy_j"] * (1 + 1e-12)
    # room for plain training: every recomputation and page transfer goes
    plain = pareto.loosen(RANDOM, COSTS, tight.decisions, RANDOM.plain_peak_bytes())
    replayed = totals_of(RANDOM, COSTS, build_steps(RANDOM, plain))
    assert replayed["recomputes"] == replayed["page_ins"] == replayed["page_outs"] == 0
    assert replayed["energy_j"] == pytest.approx(tight.plain["energy_j"])
    # in between: some work goes, the plan fits, and the solver accepts it as a start
    middle = pareto.loosen(RANDOM, COSTS, tight.decisions, 28000)
    replayed = totals_of(RANDOM, COSTS, build_steps(RANDOM, middle))
    assert replayed["peak_ram_bytes"] <= 28000 and replayed["energy_j"] < tight.totals["energy_j"]
    assert solve(RANDOM, make_test_device(), ram=28000, mode="joint", start=middle, **FAST).totals["energy_j"] \
        <= replayed["energy_j"] * (1 + 1e-9)


def test_solve_ignores_a_start_that_does_not_fit():
    roomy = solve(RANDOM, make_test_device(), ram=36000, mode="joint", **FAST)
    tight = solve(RANDOM, make_test_device(), ram=23000, mode="joint", **FAST)
    assert roomy.totals["peak_ram_bytes"] > 23000  # too big a plan for the tight budget
    for start in (roomy, roomy.decisions, solve(MLP, make_test_device(), ram=MLP_PLAIN, **FAST)):
        again = solve(RANDOM, make_test_device(), ram=23000, mode="joint", start=start, **FAST)
        assert again.totals["energy_j"] == pytest.approx(tight.totals["energy_j"], rel=1e-6)
        assert again.totals["peak_ram_bytes"] <= 23000
    # a plan that pages is no start for remat, which cannot page
    paging = solve(RANDOM, make_test_device(), ram=22000, mode="paging", **FAST)
    assert paging.totals["page_ins"] > 0
    remat = solve(RANDOM, make_test_device(), ram=22000, mode="remat", start=paging, **FAST)
    assert remat.totals["page_ins"] == 0


def test_a_start_is_taken_only_where_its_replay_keeps_every_rule_and_budget():
    from poet_opt.device.costs import node_costs
    from poet_opt.schedule.decisions import Budgets
    from poet_opt.solver.driver import _fitting_plan

    device = make_test_device()
    costs = node_costs(RANDOM, device)

    def budgets(ram):
        return Budgets(ram_bytes=ram, runtime_s=float("inf"), storage_bytes=device.storage.capacity_bytes)

    below = solve(RANDOM, device, ram=23000, mode="joint", **FAST)
    assert below.totals["page_ins"] + below.totals["recomputes"] > 0
    # a smaller budget's plan fits a larger one, and is refused by a budget below its peak
    assert _fitting_plan(RANDOM, costs, budgets(28000), "joint", device, below.decisions) == below.decisions
    assert _fitting_plan(RANDOM, costs, budgets(below.totals["peak_ram_bytes"] - 1), "joint", device,
                         below.decisions) is None
    # a mode that cannot do what the plan does, and a plan of another graph, are no starts
    assert _fitting_plan(RANDOM, costs, budgets(28000), "none", device, below.decisions) is None
    mlp = solve(MLP, device, ram=MLP_PLAIN, **FAST)
    assert _fitting_plan(RANDOM, costs, budgets(28000), "joint", device, mlp.decisions) is None
    # the solve that starts from it is never worse than the plan it was handed
    warm = solve(RANDOM, device, ram=28000, mode="joint", start=below, **FAST)
    assert warm.totals["energy_j"] <= below.totals["energy_j"] * (1 + 1e-9)


