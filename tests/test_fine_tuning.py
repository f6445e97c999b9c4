"""Partial fine-tuning, measured per-layer costs and the optimizer step (issue 6, parts 3-5)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from poet_opt.cli import main
from poet_opt.device.costs import node_costs
from poet_opt.errors import InfeasibleError, PoetError
from poet_opt.firmware.header import export
from poet_opt.model.measured_costs import apply_costs, load_costs
from poet_opt.model.optimizer import with_optimizer
from poet_opt.device.profiles import load_profile
from poet_opt.solver.driver import solve
from poet_opt.model.load import load_training_graph
from poet_opt.schedule.validator import validate
from poet_opt.model.zoo import build_model


def test_resnet18_cifar_last2_fits_a_budget_full_fine_tuning_cannot(capsys):
    full = build_model("resnet18-cifar", trainable="all")
    last2 = build_model("resnet18-cifar", trainable="last:2")
    # frozen layers: no weight gradients, and no backward below the first trained layer
    assert last2.param_grad_bytes == (512 * 10 + 10 + 2 * 512) * 4 < full.param_grad_bytes == full.param_bytes
    assert sum(n.kind == "backward" for n in last2.nodes) == 5 < sum(n.kind == "backward" for n in full.nodes)
    budget = "1MB"
    with pytest.raises(InfeasibleError):
        solve(full, "rpi4", ram=budget, time_limit=3, threads=1)
    schedule = solve(last2, "rpi4", ram=budget, threads=1)
    validate(schedule.to_dict())
    assert schedule.totals["peak_ram_bytes"] <= 1_000_000
    roomy = solve(full, "rpi4", ram="5MB", threads=1)
    assert schedule.totals["energy_j"] < roomy.totals["energy_j"]
    with capsys.disabled():
        print(f"\nResNet-18-CIFAR on rpi4: last:2 at {budget}: {schedule.totals['energy_j']:.2f} J; "
              f"full fine-tuning: infeasible at {budget}, {roomy.totals['energy_j']:.2f} J at 5MB")


def test_trainable_names_and_errors():
    graph = build_model("resnet18-cifar", trainable="layer4,fc")
    assert {n.name for n in graph.nodes if n.trainable} >= {"layer4.0.conv1", "layer4.1.bn2", "fc"}
    assert not any(n.trainable for n in graph.nodes if n.name.startswith("layer3"))
    for bad, words in (("last:0", "positive"), ("layer9", "not a layer"), ("relu", "no parameters")):
        with pytest.raises(PoetError) as err:
            build_model("resnet18-cifar", trainable=bad)
        assert words in str(err.value) and err.value.field == "--trainable"


def test_cli_trainable_and_graph_without_parameters(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--trainable",
                                  "last:1", "--json", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["memory"]["param_grad_bytes"] == (256 * 10 + 10) * 4
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps({"nodes": [{"id": 0, "cost_ram": 8}], "links": []}))
    result = runner.invoke(main, ["solve", "--graph", str(graph), "--device", "rpi4", "--ram", "1MB",
                                  "--trainable", "last:1"])
    assert result.exit_code == 2 and "--trainable" in result.output


# -- measured costs ---------------------------------------------------------------------------------

def test_measured_costs_override_by_name_then_op(tmp_path):
    profile = load_profile("rpi4")
    graph = build_model("mlp")
    table = tmp_path / "costs.csv"
    table.write_text("name,time_s,energy_j\nfc2,0.5,\nrelu,0.01,0.002\ngrad:fc2,,0.25\nrelu2,0.02,\n")
    costed = apply_costs(graph, load_costs(table))
    c, base = node_costs(costed, profile), node_costs(graph, profile)
    at = {n.name: n.id for n in graph.nodes}
    assert c.compute_s[at["fc2"]] == 0.5
    assert c.compute_j[at["fc2"]] == pytest.approx(0.5 * profile.compute.power_w)  # time only: active power
    assert c.compute_s[at["relu1"]] == 0.01 and c.compute_j[at["relu1"]] == 0.002  # by op type
    assert c.compute_s[at["relu2"]] == 0.02  # its own row wins over the op type's
    assert c.compute_j[at["relu2"]] == pytest.approx(0.02 * profile.compute.power_w)
    assert c.compute_j[at["grad:fc2"]] == 0.25 and c.compute_s[at["grad:fc2"]] == base.compute_s[at["grad:fc2"]]
    assert c.compute_s[at["fc1"]] == base.compute_s[at["fc1"]]  # untouched
    yaml_table = tmp_path / "costs.yaml"
    yaml_table.write_text("fc2: {time_s: 0.5}\nrelu: {time_s: 0.01, energy_j: 0.002}\n")
    again = node_costs(apply_costs(graph, load_costs(yaml_table)), profile)
    assert again.compute_s[at["fc2"]] == 0.5 and again.compute_j[at["relu1"]] == 0.002


def test_unknown_cost_names_list_close_matches_and_bad_files_name_the_field(tmp_path):
    graph = build_model("resnet18-cifar")
    table = tmp_path / "costs.csv"
    table.write_text("name,time_s\nlayer4.1.cnv2,0.1\n")
    with pytest.raises(PoetError) as err:
        apply_costs(graph, load_costs(table))
    assert "'layer4.1.conv2'" in str(err.value) and "layer4.1.cnv2" in str(err.value)
    for text, field in (("name,time_s\nfc,-1\n", "line 2.time_s"), ("name,time_s\nfc,abc\n", "line 2.time_s"),
                        ("name,seconds\nfc,1\n", "line 2"), ("time_s\n1\n", "line 1"), ("name,time_s\nfc,\n", "line 2")):
        table.write_text(text)
        with pytest.raises(PoetError) as err:
            load_costs(table)
        assert err.value.field == field, text
    with pytest.raises(PoetError):
        load_costs(tmp_path / "costs.txt")


def test_cli_costs_change_the_energy(tmp_path):
    table = tmp_path / "costs.csv"
    table.write_text("name,time_s,energy_j\nlinear,0.001,0.5\n")
    runner = CliRunner()
    args = ["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--json", "-q"]
    plain = json.loads(runner.invoke(main, args).output)
    costed = runner.invoke(main, args + ["--costs", str(table)])
    assert costed.exit_code == 0, costed.output
    # the four linear layers now cost 0.5 J each instead of their FLOP-model energy
    costed_j = json.loads(costed.output)["totals"]["compute_j"]
    assert 4 * 0.5 < costed_j < 4 * 0.5 + plain["totals"]["compute_j"]
    table.write_text("name,time_s\nfc5,0.1\n")
    result = runner.invoke(main, args + ["--costs", str(table)])
    assert result.exit_code == 2 and "did you mean" in result.output and len(result.output.strip().splitlines()) == 1


# -- optimizer step ---------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer, copies", [("sgd", 0), ("adam", 2)])
def test_optimizer_nodes_solve_validate_and_export(optimizer, copies):
    base = build_model("mlp", trainable="last:2")
    graph = with_optimizer(base, optimizer)
    updates = [n for n in graph.nodes if n.op == f"{optimizer}_update"]
    assert [n.name for n in updates] == ["update:fc3", "update:fc4"]
    for n in updates:  # each update reads its layer's gradient, and runs after it
        (dep,) = n.deps
        assert graph.nodes[dep].name == n.name.replace("update:", "grad:") and dep < n.id
    trained_bytes = base.param_grad_bytes
    assert sum(n.param_bytes for n in updates) == copies * trained_bytes
    schedule = solve(graph, "rpi4", ram="1MB", threads=1)
    doc = schedule.to_dict()
    validate(doc)
    memory = doc["memory"]
    assert memory["optimizer_state_bytes"] == copies * trained_bytes
    assert memory["param_bytes"] == base.param_bytes + copies * trained_bytes
    assert schedule.totals["energy_j"] > solve(base, "rpi4", ram="1MB", threads=1).totals["energy_j"]
    header, plan, flash = export(doc, prefix="P_")
    computed = {s["node"] for s in doc["steps"] if s["op"] == "compute"}
    assert {n.id for n in updates} <= computed
    assert '"update:fc4"' in header


def test_optimizer_through_the_sources_and_cli():
    graph, _ = load_training_graph(model="mlp", optimizer="adam", trainable="fc4")
    assert [n.name for n in graph.nodes if n.op == "adam_update"] == ["update:fc4"]
    assert with_optimizer(graph, "none") is graph
    with pytest.raises(PoetError) as err:
        with_optimizer(graph, "lion")
    assert err.value.field == "--optimizer"
    result = CliRunner().invoke(main, ["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB",
                                       "--optimizer", "adam", "-q"])
    assert result.exit_code == 0, result.output
    assert "optimizer state" in result.output
    assert math.isfinite(graph.nodes[-1].flops)


def test_pareto_sweeps_a_partially_fine_tuned_graph(tmp_path):
    result = CliRunner().invoke(main, ["pareto", "--model", "mlp", "--trainable", "last:1", "--optimizer", "sgd",
                                       "--device", "rpi4", "--ram", "64KB,1MB", "--jobs", "1", "--time-limit", "10",
                                       "-o", str(tmp_path / "front"), "-q"])
    assert result.exit_code == 0, result.output
    rows = (tmp_path / "front" / "pareto.csv").read_text().splitlines()
    assert len(rows) == 3 and "mlp" in rows[1]
