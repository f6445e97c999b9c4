"""`poet-opt measure --device MCU`: node costs from the generated firmware on the emulated core, and
plans solved with them predicting the emulated step (issue 30, item 3)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.examples.torch_models import tiny_cnn  # noqa: E402
from poet_opt.firmware.step_costs import cycles_per_step  # noqa: E402
from poet_opt.firmware.trainer import solve_plan  # noqa: E402
from poet_opt.model.measured_costs import load_costs  # noqa: E402

CNN = "poet_opt.examples.torch_models:tiny_cnn"
SHAPE = "2,3,16,16"
# below plain training's 26 KiB peak: the plan measured recomputes, so a node's mean over its
# computes is exercised
RAM = "20KiB"
MODEL = ("--torch", CNN, "--input-shape", SHAPE, "--device", "nrf52840", "--ram", RAM)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    where = tmp_path_factory.mktemp("costs")
    out = where / "costs.csv"
    result = cli("measure", *MODEL, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    rng = np.random.default_rng(1)
    data = where / "batch.npz"
    np.savez(data, x=rng.standard_normal((2, 3, 16, 16)).astype(np.float32), y=np.array([1, 3], dtype=np.int64))
    return out, json.loads(result.stdout), data


def test_measure_on_the_emulated_core_writes_every_node_in_seconds_and_joules(measured):
    out, report, _ = measured
    profile = load_profile("nrf52840")
    network, _ = solve_plan(tiny_cnn(), (2, 3, 16, 16), profile, ram=RAM)
    rows = load_costs(out).rows
    assert list(rows) == [n.name for n in network.graph.nodes]  # resident weights: no node is left out
    assert report["recomputes"] >= 1
    for node in report["nodes"]:
        row = rows[node["name"]]
        assert row["time_s"] == pytest.approx(node["cycles_per_compute"] / profile.compute.clock_hz, rel=1e-12)
        assert row["energy_j"] == pytest.approx(row["time_s"] * profile.compute.power_w, rel=1e-12)
    by_name = {n["name"]: n for n in report["nodes"]}
    # the stem's 3x3 convolution does far more work than the ReLU after it, and costs it
    assert by_name["stem"]["cycles_per_compute"] > 5 * by_name["stem_relu"]["cycles_per_compute"]
    assert report["node_cycles"] + report["paging_cycles"] + report["outside_cycles"] == report["step_cycles"]
    # start-up and the SGD step are outside the schedule's steps: a small share of a step
    assert 0 < report["outside_cycles"] < 0.1 * report["step_cycles"]


def test_plans_solved_with_measured_costs_predict_the_emulated_step_within_10_percent(measured):
    out, _, data = measured
    solved = cli("solve", *MODEL, "--costs", out, "--time-limit", "20", "--json")
    assert solved.exit_code == 0, solved.stderr
    runs = {}
    for name, extra in (("measured", ("--costs", out)), ("datasheet", ())):
        result = cli("emulate", *MODEL, "--steps", 1, "--lr", 0.01, "--data", data, "--json", "-q", *extra)
        assert result.exit_code == 0, result.stderr
        runs[name] = json.loads(result.stdout)
    plan = json.loads(solved.stdout)["totals"]
    assert runs["measured"]["predicted_runtime_s_per_step"] == pytest.approx(plan["runtime_s"], rel=1e-9)
    ratio = runs["measured"]["estimated_over_predicted"]
    assert ratio == pytest.approx(runs["measured"]["estimated_runtime_s_per_step"]
                                  / runs["measured"]["predicted_runtime_s_per_step"])
    assert abs(ratio - 1) <= 0.10, ratio
    # the profile's datasheet rates are what measuring corrects: they are further off
    assert abs(runs["datasheet"]["estimated_over_predicted"] - 1) > 2 * abs(ratio - 1)
    assert runs["measured"]["costs"] == str(out) and runs["datasheet"]["costs"] is None


def test_a_costs_file_of_another_model_is_refused(measured, tmp_path):
    out, _, data = measured
    assert_one_line_error(cli("solve", "--model", "mcu-vww", "--device", "nrf52840", "--ram", "150KiB", "--costs",
                              out), "--costs", "mcu-vww")
    vww = tmp_path / "vww.npz"
    np.savez(vww, x=np.zeros((1, 1, 96, 96), np.float32), y=np.array([1], dtype=np.int64))
    assert_one_line_error(cli("emulate", "--model", "mcu-vww", "--device", "nrf52840", "--ram", "150KiB", "--steps", 1,
                              "--lr", 0.01, "--data", vww, "--costs", out, "-q"), "--costs")
    assert_one_line_error(cli("measure", "--model", "mcu-vww", "--input-shape", "1,1,96,96", "--device", "nrf52840",
                              "--ram", "150KiB", "--costs", out, "-o", tmp_path / "vww.csv"), "--costs",
                          out=tmp_path / "vww.csv")


def test_measure_refuses_options_of_the_other_kind_of_measuring(tmp_path):
    out = tmp_path / "c.csv"
    assert_one_line_error(cli("measure", *MODEL, "-o", out, "--repeat", 3), "--repeat", "--device", out=out)
    assert_one_line_error(cli("measure", *MODEL[:-2], "-o", out), "--ram", out=out)
    assert_one_line_error(cli("measure", "--torch", CNN, "--input-shape", SHAPE, "--ram", RAM, "-o", out), "--ram",
                          "--device", out=out)
    assert_one_line_error(cli("measure", "--model", "mcu-vww", "--input-shape", SHAPE, "-o", out), "--model", out=out)
    assert_one_line_error(cli("measure", "--torch", CNN, "--input-shape", SHAPE, "--mode", "paging", "-o", out),
                          "--mode", "--device", out=out)
    assert_one_line_error(cli("measure", *MODEL[:-4], "--device", "rpi4", "--ram", RAM, "-o", out), "--device",
                          out=out)
    # cycles without a clock are no seconds
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "hardware_profiles" / "nrf52840.yaml").read_text()
    clockless = tmp_path / "clockless.yaml"
    clockless.write_text("\n".join(line for line in text.splitlines() if "clock_hz:" not in line))
    assert_one_line_error(cli("measure", *MODEL[:-4], "--device", clockless, "--ram", RAM, "-o", out), "--device",
                          "clock_hz", out=out)
    data = tmp_path / "b.npz"
    np.savez(data, x=np.zeros((2, 3, 16, 16), np.float32), y=np.array([0, 1]))
    assert_one_line_error(cli("emulate", *MODEL, "--steps", 1, "--lr", 0.1, "--data", data, "--costs",
                              tmp_path / "none.csv", "-q"), "--costs", "no such cost file")


def test_marks_split_one_pass_of_the_schedule_and_nothing_else():
    assert cycles_per_step([(0, 10), (1, 25), (3, 40)], 3) == {0: 15, 1: 15}
    with pytest.raises(Exception, match="one pass"):
        cycles_per_step([(0, 10), (1, 25), (0, 30), (3, 40)], 3)


def test_the_profiling_build_trains_to_the_same_bits_and_marks_every_step_also_as_a_program():
    profile = load_profile("nrf52840")
    network, plan = solve_plan(tiny_cnn(), (2, 3, 16, 16), profile, ram=RAM)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal(network.input_shape).astype(np.float32), np.array([0, 2])
    from poet_opt.firmware.trainer import run_schedule

    plain = run_schedule(network, plan, profile, steps=2, lr=0.05, x=x, y=y)
    steps = plan.schedule.to_dict()["steps"]
    marked = [s for s, step in enumerate(steps) if step["op"] != "free"] + [len(steps)]
    for program in (False, True):
        profiled = run_schedule(network, plan, profile, steps=2, lr=0.05, x=x, y=y, marks=True, program=program)
        assert profiled.losses == plain.losses
        assert all(np.array_equal(profiled.weights[k], v) for k, v in plain.weights.items())
        assert [m for m, _ in profiled.marks] == marked * 2  # each training step passes every mark once
        assert not plain.marks
        half = len(marked)
        assert sum(cycles_per_step(profiled.marks[half:], len(steps)).values()) > 0


def test_measure_device_shares_emulates_options_and_defaults():
    """`measure --device` measures the plan `emulate` runs for the same arguments only if each
    option they share has emulate's default."""
    from poet_opt.cli import main

    def options(command):
        return {p.opts[0] if p.opts[0].startswith("--") else p.opts[-1]: p for p in main.commands[command].params}

    def default(option):  # click marks an option given no default with a sentinel: the same as None
        return None if type(option.default).__name__ == "Sentinel" else option.default

    measure, emulate = options("measure"), options("emulate")
    for name in ("--model", "--torch", "--input-shape", "--device", "--ram", "--trainable", "--costs", "--time-limit",
                 "--weights", "--weight-tile", "--strips"):
        assert name in measure, f"measure lacks emulate's {name}"
        if not (measure[name].required or emulate[name].required):
            assert default(measure[name]) == default(emulate[name]), name
        assert getattr(measure[name].type, "choices", None) == getattr(emulate[name].type, "choices", None), name


def test_a_paging_plans_storage_commands_take_the_time_the_plan_gives_its_transfers(measured, tmp_path):
    """The emulated card answers at once; the estimate adds the commands the firmware issued at the
    profile's rates. A plan that only pages (no streamed weights, nothing read besides the paged
    tensors) issues one write per page-out and one read per page-in, so that time is the plan's
    paging time: a firmware that wrote a tensor in pieces, or read one twice, would be more."""
    _, _, data = measured
    result = cli("emulate", *MODEL, "--mode", "paging", "--steps", 2, "--lr", 0.01, "--data", data,
                 "--json", "-q")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    plan = json.loads(cli("solve", *MODEL, "--mode", "paging", "--json").stdout)["totals"]
    assert plan["page_outs"] >= 1
    profile = load_profile("nrf52840")
    paging_s = (plan["page_in_j"] / profile.storage.read.power_w + plan["page_out_j"] / profile.storage.write.power_w)
    assert summary["storage_bus_s_per_step"] == pytest.approx(paging_s, rel=0.02)
    assert summary["estimated_runtime_s_per_step"] > summary["storage_bus_s_per_step"] > 0
    # measure --device runs the same plan and prices the same commands
    found = cli("measure", *MODEL, "--mode", "paging", "-o", tmp_path / "paging.csv", "--json")
    assert found.exit_code == 0, found.stderr
    assert json.loads(found.stdout)["storage_bus_s_per_step"] == pytest.approx(summary["storage_bus_s_per_step"])
