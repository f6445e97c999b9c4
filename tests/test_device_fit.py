"""A newcomer's path: plans that fit the device, one vocabulary of flags, and a wear budget."""

from __future__ import annotations

import json

import pytest
from conftest import make_test_device
from test_cli import assert_one_line_error, cli

from poet_opt import build_model, solve
from poet_opt.device.profiles import load_profile
from poet_opt.model.random_graph import random_training_graph
from poet_opt.pareto import sweep
from poet_opt.schedule.decisions import lifetime_steps, wear_levelled, wear_storage_cap

README_MCU = ["solve", "--model", "mcu-vww", "--device", "nrf52840", "--ram", "150KiB", "--runtime", "1.5x"]


@pytest.fixture(scope="module")
def mcu_plan(tmp_path_factory):
    """The README's microcontroller example, solved once: (its schedule file, its JSON summary)."""
    out = tmp_path_factory.mktemp("mcu") / "vww.json"
    result = cli(*README_MCU, "-q", "--json", "-o", out, "--time-limit", "60")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


# ---------------------------------------------------------------- device fit

def test_the_readme_microcontroller_example_fits_its_board(mcu_plan):
    memory = mcu_plan[1]["memory"]
    need = memory["total_bytes"] + memory["stack_reserve_bytes"]
    print(f"\nmcu-vww on nrf52840 at 150 KiB: needs {need} B of {memory['device_ram_bytes']} B, "
          f"{memory['device_ram_bytes'] - need} B to spare")
    assert memory["fits_device"] and need <= memory["device_ram_bytes"]
    assert memory["stack_reserve_bytes"] == 4096  # the Cortex-M profiles reserve a stack


def test_a_ram_budget_above_the_device_is_refused():
    assert_one_line_error(cli("solve", "--model", "mlp", "--device", "nrf52840", "--ram", "300KiB", "-q"),
                          "--ram", "300 KiB is more than nrf52840's 256 KiB")


def test_a_model_whose_weights_cannot_fit_is_refused_before_solving(tmp_path):
    out = tmp_path / "s.json"
    # resident weights: streamed ones fit (tests/test_streaming.py)
    result = cli("solve", "--model", "mlp", "--device", "nrf52840", "--ram", "40KiB", "-q", "-o", out,
                 "--weights", "resident")
    assert_one_line_error(result, "--device", "no plan can run on nrf52840", "--allow-oversize",
                          "--weights streamed", out=out)
    kept = cli("solve", "--model", "mlp", "--device", "nrf52840", "--ram", "40KiB", "-q", "-o", out,
               "--allow-oversize", "--weights", "resident")
    assert kept.exit_code == 0, kept.output
    assert "DOES NOT FIT" in kept.stdout and out.is_file()
    check = cli("validate", out)
    assert check.exit_code == 0 and "DOES NOT FIT" in check.stdout
    fit = json.loads(cli("validate", out, "--json").stdout)["device_fit"]
    assert not fit["fits"] and fit["needed_bytes"] > fit["device_ram_bytes"] == 256 * 1024


def test_validate_reports_a_fitting_plan(mcu_plan):
    result = cli("validate", mcu_plan[0])
    assert result.exit_code == 0 and "fits," in result.stdout and "to spare" in result.stdout


def test_pareto_stops_each_device_at_its_ram_and_marks_the_fit():
    fast = dict(time_limit=5, jobs=1, order="given", gap=1e-2)  # the fit, not the optimum, is checked here
    rows = sweep("mcu-vww", ["nrf52840"], ["150KiB", "200KiB", "300KiB"], **fast)
    assert [r["ram_bytes"] for r in rows] == [150 * 1024, 200 * 1024]  # 300 KiB is beyond the board
    assert [r["fits_device"] for r in rows] == [1, 0]  # weights and gradients push 200 KiB over
    assert all(r["device_ram_bytes"] == 256 * 1024 for r in rows)
    every = sweep("mcu-vww", ["nrf52840"], ["200KiB", "300KiB"], allow_oversize=True, **fast)
    assert [r["ram_bytes"] for r in every] == [200 * 1024, 300 * 1024]
    result = cli("pareto", "--model", "mlp", "--device", "nrf52840", "--ram", "1MiB,2MiB", "-o", "unused", "-q")
    assert_one_line_error(result, "--ram", "every budget exceeds nrf52840's 256 KiB")


# ---------------------------------------------------------------- one vocabulary

def test_a_size_without_a_unit_is_refused_with_the_units_it_could_mean():
    assert_one_line_error(cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", "200000", "-q"),
                          "--ram", "'200000' has no unit", "200000B", "KiB")


def test_device_names_are_case_insensitive_like_models():
    assert load_profile("NRF52840").name == load_profile("nrf52840").name == "nrf52840"
    assert cli("solve", "--model", "MLP", "--device", "RPi4", "--ram", "1MiB", "-q").exit_code == 0


def test_zoo_input_shape_takes_the_whole_input_batch_first_as_imports_do():
    whole = build_model("resnet18-cifar", input_shape="4,3,32,32")
    per_sample = build_model("resnet18-cifar", input_shape="3x32x32", batch_size=4)
    assert [n.bytes for n in whole.nodes] == [n.bytes for n in per_sample.nodes]
    assert whole.meta["batch_size"] == 4
    result = cli("solve", "--model", "resnet18-cifar", "--device", "rpi4", "--ram", "8MiB", "--input-shape",
                 "2,3,32,32", "--batch-size", "4", "-q")
    assert_one_line_error(result, "--batch-size", "batch is 2")


@pytest.mark.parametrize("command", [["devices"], ["models"]])
def test_listing_commands_print_json(command):
    result = cli(*command, "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert rows and all("name" in r for r in rows)


def test_export_prints_json(mcu_plan, tmp_path):
    header = tmp_path / "s.h"
    result = cli("export", mcu_plan[0], "-o", header, "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["steps"] > 0 and header.is_file()


def test_printed_sizes_are_binary(mcu_plan):
    result = cli("validate", mcu_plan[0])
    assert "KiB" in result.stdout and " KB" not in result.stdout
    text = cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MiB", "-q").stdout
    assert "KiB" in text and " KB" not in text and " MB" not in text


# ---------------------------------------------------------------- wear budget

def test_wear_caps_follow_the_medium():
    nor = load_profile("stm32f746").storage
    sd = load_profile("nrf52840").storage
    assert not wear_levelled(nor) and wear_levelled(sd)
    assert wear_storage_cap(nor, nor.endurance_cycles) == nor.capacity_bytes  # exactly enough
    assert wear_storage_cap(nor, nor.endurance_cycles + 1) == 0  # one step more: no paging at all
    cap = wear_storage_cap(sd, 1_000_000)
    assert cap == sd.endurance_cycles * sd.capacity_bytes // 1_000_000
    assert lifetime_steps(sd, int(cap)) >= 1_000_000 and lifetime_steps(sd, 0) is None


def test_a_wear_budget_beyond_raw_flash_endurance_forbids_paging():
    common = dict(ram="150KiB", mode="joint", time_limit=20, order="given", gap=1e-2)
    free = solve(build_model("mcu-vww"), "stm32f746", **common)
    bounded = solve(build_model("mcu-vww"), "stm32f746", min_lifetime_steps=200_000, **common)
    assert not bounded.decisions.page_out and bounded.lifetime_steps() is None
    assert bounded.totals["energy_j"] >= free.totals["energy_j"] * (1 - 1e-3)
    assert bounded.to_dict()["budgets"]["min_lifetime_steps"] == 200_000


def test_a_wear_budget_on_a_wear_levelled_card_caps_the_bytes_paged_per_step():
    # a small card of low endurance, so that the cap binds on a random graph that pages
    device = make_test_device(capacity_bytes=1 << 20, endurance_cycles=100)
    graph = random_training_graph(16, 3)
    ram = int(0.6 * graph.plain_peak_bytes())
    free = solve(graph, device, ram=ram, mode="paging", time_limit=20, gap=0, order="given")
    assert free.decisions.page_out, "the case must page without a wear budget"
    steps = 100 * (1 << 20) // max(1, free.erased_bytes_per_step() // 2)  # allow half the free plan's erases
    try:
        bounded = solve(graph, device, ram=ram, mode="paging", time_limit=20, gap=0, order="given",
                        min_lifetime_steps=steps)
    except Exception as exc:  # no plan pages little enough: said as infeasible, naming the wear budget
        assert "wear budget" in str(exc)
        return
    assert bounded.erased_bytes_per_step() <= free.erased_bytes_per_step() // 2
    assert bounded.lifetime_steps() >= steps
    assert bounded.totals["energy_j"] >= free.totals["energy_j"] * (1 - 1e-9)


def test_the_summary_reports_lifetime(tmp_path):
    args = ["solve", "--model", "mcu-vww", "--device", "stm32f746", "--ram", "150KiB", "--mode", "paging", "-q",
            "--order", "given", "--gap", "0.01", "--time-limit", "20", "-o", tmp_path / "s.json"]
    result = cli(*args, "--json", "--min-lifetime-steps", "1000")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["lifetime_steps"] == 100_000  # raw NOR flash: each region lasts its endurance
    assert summary["budgets"]["min_lifetime_steps"] == 1000
    assert "lasts 100,000 training steps" in cli(*args).stdout


def test_the_validator_checks_the_wear_budget_itself(tmp_path):
    from poet_opt.schedule.validator import ScheduleInvalid, replay

    plan = solve(build_model("mcu-vww"), "stm32f746", ram="150KiB", mode="paging", time_limit=20, order="given",
                 gap=1e-2, min_lifetime_steps=100_000)
    doc = plan.to_dict()
    assert doc["budgets"]["min_lifetime_steps"] == 100_000 and plan.decisions.page_out
    replay(doc)  # raw NOR flash of 100,000 cycles: exactly enough
    doc["budgets"]["min_lifetime_steps"] = 100_001
    with pytest.raises(ScheduleInvalid, match="fewer than budgets.min_lifetime_steps 100,001"):
        replay(doc)


def test_pareto_and_plot_print_json(mcu_plan, tmp_path):
    result = cli("pareto", "--model", "mcu-vww", "--device", "nrf52840", "--ram", "150KiB,160KiB", "--order", "given",
                 "--time-limit", "10", "--jobs", "1", "-o", tmp_path / "front", "--json", "-q")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert [r["ram_bytes"] for r in printed["rows"]] == [150 * 1024, 160 * 1024]
    assert all(r["fits_device"] == 1 for r in printed["rows"])
    assert any(w.endswith("pareto.csv") for w in printed["written"])
    picture = cli("plot", mcu_plan[0], "-o", tmp_path / "t.png", "--json")
    assert picture.exit_code == 0, picture.output
    assert json.loads(picture.stdout)["written"] == [str(tmp_path / "t.png")]


def test_export_refuses_a_plan_that_does_not_fit_the_device(tmp_path):
    schedule, header = tmp_path / "s.json", tmp_path / "s.h"
    assert cli("solve", "--model", "mlp", "--device", "nrf52840", "--ram", "7232B", "-q", "-o", schedule,
               "--allow-oversize", "--time-limit", "20", "--weights", "resident").exit_code == 0
    assert_one_line_error(cli("export", schedule, "-o", header), "nothing exported", "--allow-oversize", out=header)
    assert cli("export", schedule, "-o", header, "--allow-oversize").exit_code == 0 and header.is_file()
