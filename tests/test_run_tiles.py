"""`poet-opt run` on plans with streamed weights, activation strips and weight slices (issue 27).

A small CNN whose stem output alone exceeds the nRF52840 (examples' strip_cnn) is planned by
`solve --torch` in strips, with its weights streamed and, at a small --weight-tile, sliced; `run`
executes that plan step for step and must train exactly as plain PyTorch (autograd and
torch.optim.SGD on the same module and batch), hold exactly the plan's peak of live tensors and
move exactly the plan's bytes through storage, with the weights living in files there. The full
ResNet-18 case at 200 KiB is benchmarks/run_tiles.py (minutes)."""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import strip_cnn  # noqa: E402
from poet_opt.executor.tiled import TiledExecutor  # noqa: E402
from poet_opt.executor.train import lower_for_run  # noqa: E402
from poet_opt.model.load import default_tile_bytes, load_training_graph  # noqa: E402
from poet_opt.solver.driver import solve  # noqa: E402

SPEC = "poet_opt.examples.torch_models:strip_cnn"
SHAPE = "1,1,96,96"
NRF = dict(device_ram_bytes=262144, stack_reserve_bytes=4096)
RAM = 160 * 1024
LR = 0.05


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def batch(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "batch.npz"
    np.savez(path, x=rng.standard_normal((1, 1, 96, 96)).astype(np.float32), y=np.array([2]))
    return path


def torch_sgd(module, data, steps, lr=LR):
    """The losses and weights of ``steps`` plain torch.optim.SGD steps of ``module`` on the batch file."""
    with np.load(data) as b:
        x, y = torch.from_numpy(b["x"]), torch.from_numpy(b["y"])
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(x).flatten(1), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in module.named_parameters()}


def _running(module) -> dict:
    """Batch norm's running means and variances, by their state_dict names (as --weights-out has them)."""
    return {n: b.numpy() for n, b in module.named_buffers() if n.endswith(("running_mean", "running_var"))}


def _worst_running(trained, running: dict) -> float:
    """The largest difference of a running statistic from torch's, relative to that tensor's largest value."""
    return max(float(np.abs(trained[n] - r).max() / np.abs(r).max()) for n, r in running.items())


def _graph_shape(graph):
    return sorted((n.name, n.kind, n.bytes, n.op, tuple(sorted(graph.nodes[d].name for d in n.deps)),
                   tuple(graph.nodes[p].name for p in n.updates), n.writes_bytes) for n in graph.nodes)


@pytest.mark.parametrize("tile", [None, 1024])
def test_run_lowers_the_module_as_solve_does(tile):
    """run's defaults are solve's: weights auto (streamed here), a quarter of --ram per slice unless
    --weight-tile says otherwise, strips auto (needed here): the same nodes, sizes and inputs."""
    solved, _ = load_training_graph(torch=SPEC, input_shape=SHAPE, weights="auto", ram_bytes=RAM,
                                    tile_bytes=tile or default_tile_bytes([RAM]), **NRF)
    network = lower_for_run(SPEC, SHAPE, ram_bytes=RAM, tile_bytes=tile, **NRF)
    assert solved.streams_weights and solved.meta["strips"].tensors
    assert _graph_shape(network.graph) == _graph_shape(solved)
    assert bool(network.graph.meta.get("tiles")) == (tile is not None)  # at 40 KiB no layer of it is sliced


def test_run_trains_a_strip_and_slice_plan_as_pytorch_with_the_plan_s_peak(batch, tmp_path):
    """solve --out, then run --schedule: two SGD steps equal torch's within 1e-5, the measured peak
    of live tensors is the plan's, and the storage traffic is the plan's page-outs, page-ins,
    weight reads and weight write-backs, byte for byte."""
    plan, out = tmp_path / "plan.json", tmp_path / "after.npz"
    common = ["--torch", SPEC, "--input-shape", SHAPE, "--weight-tile", "1KiB", "--strips", "12"]
    solved = cli("solve", *common, "--device", "nrf52840", "--ram", "160KiB", "--time-limit", "5", "-q", "--out", plan)
    assert solved.exit_code == 0, solved.stderr
    doc = json.loads(plan.read_text())
    names = [n["name"] for n in doc["graph"]["nodes"]]
    computed = {names[s["node"]] for s in doc["steps"] if s["op"] == "compute"}
    # the plan has it all: strips (@s), slices (#) and slices over strips, weights read as param nodes
    assert any("#" in n and "@s" in n for n in computed) and any(n.startswith("param:") for n in computed)
    assert doc["totals"]["page_outs"] > 0
    ran = cli("run", *common, "--schedule", plan, "--steps", "2", "--lr", LR, "--data", batch, "--weights-out", out,
              "--storage", tmp_path / "card", "--json")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["weights"] == "streamed"
    assert summary["peak_live_bytes"] == summary["planned_peak_bytes"] == doc["totals"]["peak_ram_bytes"]
    assert summary["storage_bytes_written"] == summary["planned_storage_bytes_written"] > 0
    assert summary["storage_bytes_read"] == summary["planned_storage_bytes_read"] > 0
    totals = doc["totals"]
    assert summary["executed"] == {"computes": totals["computes"], "page_outs": totals["page_outs"],
                                   "page_ins": totals["page_ins"], "steps": len(doc["steps"])}
    torch.manual_seed(0)  # strip_cnn seeds itself: the module run trained starts from the same weights
    module = strip_cnn()
    losses, reference = torch_sgd(module, batch, 2)
    running = _running(module)  # moved from the statistics chained over 12 strips of every batch norm
    assert summary["loss"] == pytest.approx(losses, rel=1e-5)
    with np.load(out) as trained:
        assert set(trained.files) == set(reference) | set(running) and len(running) == 6
        scale = max(float(np.abs(v).max()) for v in reference.values())
        worst = max(float(np.abs(trained[n] - reference[n]).max()) for n in reference)
        worst_running = _worst_running(trained, running)
    print(f"\n12 strips, 1 KiB slices: weights - torch = {worst:.3g}, running statistics {worst_running:.3g}")
    assert worst <= 1e-5 * scale, worst
    assert worst_running <= 1e-5, worst_running
    assert not any((tmp_path / "card").iterdir())  # weights and pages removed at the end


def test_the_weights_live_on_storage_and_are_updated_there(batch, tmp_path):
    """Every param node is a file under --storage, read when the plan computes it; after a step the
    file holds the updated weights, and the module's own tensors never changed."""
    network = lower_for_run(SPEC, SHAPE, ram_bytes=RAM, **NRF)
    before = {n: p.detach().clone() for n, p in network.module.named_parameters()}
    plan = solve(network.graph, "nrf52840", ram=RAM, time_limit=5)
    with np.load(batch) as b:
        x, y = torch.from_numpy(b["x"]), torch.from_numpy(b["y"])
    params = [n for n in network.graph.nodes if n.op == "param"]
    with TiledExecutor(network, plan, lr=LR, storage=tmp_path / "card") as step:
        files = sorted(step.store.dir.iterdir())
        assert len(files) == len(params)
        assert sum(f.stat().st_size for f in files) == sum(n.bytes for n in params)
        initial = step.weights()
        step(x, y)
        reads = sum(1 for op, n in step.last.executed if op == "compute" and network.graph.nodes[n].op == "param")
        assert reads >= len(params)  # every layer's weights came through RAM at least once
        trained = step.weights()
    for name, value in before.items():
        assert torch.equal(dict(network.module.named_parameters())[name], value)  # RAM copies untouched
        assert np.array_equal(initial[name], value.numpy())
        assert not np.array_equal(trained[name], initial[name]), name  # updated, on storage
    assert not any((tmp_path / "card").iterdir())


def test_run_follows_the_tiling_of_its_plan_and_refuses_other_tiling_options(batch, tmp_path):
    """The plan file says how its network was cut (graph.tiling: the weight tile, the strips per
    height): `run --schedule` lowers the module the same way without being told again, and an
    option that cuts it otherwise is refused naming it."""
    plan = tmp_path / "plan.json"
    solved = cli("solve", "--torch", SPEC, "--input-shape", SHAPE, "--device", "nrf52840", "--ram", "160KiB",
                 "--weight-tile", "1KiB", "--time-limit", "2", "-q", "--out", plan)
    assert solved.exit_code == 0, solved.stderr
    tiling = json.loads(plan.read_text())["graph"]["tiling"]
    assert tiling["weight_tile_bytes"] == 1024 and tiling["strips_per_height"], tiling
    ran = cli("run", "--torch", SPEC, "--input-shape", SHAPE, "--schedule", plan, "--steps", "1", "--lr", LR,
              "--data", batch)
    assert ran.exit_code == 0, ran.stderr
    ran = cli("run", "--torch", SPEC, "--input-shape", SHAPE, "--schedule", plan, "--steps", "1", "--lr", LR,
              "--data", batch, "--weight-tile", "4KiB")
    assert_one_line_error(ran, "--schedule: the plan is for another model", "--weight-tile")


def test_run_refuses_what_its_strip_replay_cannot_run_in_one_line(tmp_path):
    """A LeakyReLU between strips: the strip builder splits it, the PyTorch executor's strip replay
    has no kernel for it (docs/operators.md): one line naming the layer, before any solve."""
    (tmp_path / "leaky.py").write_text(
        "import torch.nn as nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.LeakyReLU(), nn.Conv2d(4, 4, 3, padding=1),\n"
        "                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))\n")
    data = tmp_path / "small.npz"
    np.savez(data, x=np.zeros((1, 1, 16, 16), np.float32), y=np.zeros(1, np.int64))
    result = cli("run", "--torch", str(tmp_path / "leaky.py") + ":make", "--input-shape", "1,1,16,16",
                 "--device", "nrf52840", "--ram", "200KiB", "--weights", "streamed", "--strips", "2", "--steps", "1",
                 "--lr", "0.1", "--data", data)
    assert_one_line_error(result, "LeakyReLU", "the PyTorch executor streams weights only through")
    with pytest.raises(PoetError) as err:
        lower_for_run(SPEC, SHAPE, ram_bytes=RAM, strips=0, **NRF)
    assert err.value.field == "--strips"


def run_executor_md_section(heading: str, tmp_path, monkeypatch) -> tuple[str, dict]:
    """The sh block of docs/executor.md's section ``heading`` (a python line, then two poet-opt
    lines), line by line in ``tmp_path``: (the section's text, the last command's JSON summary)."""
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "executor.md").read_text()
    section = doc[doc.index(heading):]
    commands = [line for line in re.search(r"```sh\n(.*?)```", section, re.S).group(1).splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["python", "poet-opt", "poet-opt"]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "python":
            done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            continue
        result = cli(*argv[1:])
        assert result.exit_code == 0, (command, result.stderr)
    return section, json.loads(result.stdout)


def test_the_commands_of_docs_executor_md_on_strips_run(tmp_path, monkeypatch):
    """The sh block of docs/executor.md's "Streamed weights, strips and slices", line by line in a
    scratch directory, and what the text around it says of the result."""
    section, summary = run_executor_md_section("## Streamed weights, strips and slices", tmp_path, monkeypatch)
    assert summary["peak_live_bytes"] == summary["planned_peak_bytes"] == 162_736
    assert "(162,736 B here)" in section
    assert summary["storage_bytes_read"] == summary["planned_storage_bytes_read"] > 0
    assert summary["storage_bytes_written"] == summary["planned_storage_bytes_written"] > 0
    plan = json.loads((tmp_path / "strip_plan.json").read_text())
    names = {n["name"] for n in plan["graph"]["nodes"]}
    assert "stem@s15" in names and "stem@s16" not in names and "pool@s3" in names and "pool@s4" not in names
    module = strip_cnn()
    losses, _ = torch_sgd(module, tmp_path / "strip_batch.npz", 2)
    assert summary["loss"] == pytest.approx(losses, rel=1e-5)
    assert not any((tmp_path / "card").iterdir())
    # head_bn is one strip here (its own batch statistics), the other two a chain over 16 and 4
    assert {"stats:stem_bn@s15", "stats:dw_bn@s3", "head_bn"} <= names and "head_bn@s0" not in names
    with np.load(tmp_path / "strip_after.npz") as trained:
        worst = _worst_running(trained, _running(module))
    print(f"\ndocs plan: running statistics - torch = {worst:.3g}")
    assert worst <= 1e-5


def test_a_recompute_of_batch_norm_s_statistics_moves_the_running_statistics_once(batch):
    """The strip replay moves a batch norm's running statistics at the end of its statistics chain
    (a single strip: at its forward), once per step: the same plan with each of those nodes
    computed a second time leaves them as plain training does after two steps."""
    from poet_opt.executor.strips import run_plan
    from poet_opt.executor.tiled import running_statistics_of

    network = lower_for_run(SPEC, SHAPE, ram_bytes=RAM, **NRF)
    doc = solve(network.graph, "nrf52840", ram=RAM, time_limit=5).to_dict()
    tiling = network.graph.meta["strips"]
    again = {f"stats:{name}@s{len(tiling.tensors[name]) - 1}" if name in tiling.tensors else name
             for name, layer in tiling.layers.items() if layer.op == "batchnorm"}
    assert again == {"stats:stem_bn@s15", "stats:dw_bn@s3", "head_bn"}
    names = [n["name"] for n in doc["graph"]["nodes"]]
    steps = []
    for s in doc["steps"]:
        steps.append((s["op"], names[s["node"]]))
        if s["op"] == "compute" and names[s["node"]] in again:  # at once: its inputs are still resident
            steps += [("free", names[s["node"]]), ("compute", names[s["node"]])]
    assert len(steps) == len(doc["steps"]) + 6
    params = {name: {role: torch.from_numpy(p.value.copy()) for role, p in layer.params.items()}
              for name, layer in network.layers.items() if layer.params}
    running = running_statistics_of(network)
    with np.load(batch) as b:
        x, y = torch.from_numpy(b["x"]), torch.from_numpy(b["y"])
    for _ in range(2):
        run_plan(network.graph, steps, params, x, y, LR, running)
    module = strip_cnn()
    torch_sgd(module, batch, 2)
    want = _running(module)
    got = {layer.buffers[role].torch_name: getattr(running[name], role.split("_")[1]).numpy()
           for name, layer in network.layers.items() if name in running for role in ("running_mean", "running_var")}
    assert set(got) == set(want)
    print(f"\nrecomputed statistics: running statistics - torch = {_worst_running(got, want):.3g}")
    assert _worst_running(got, want) <= 1e-5


def test_run_solves_a_streamed_plan_itself_with_solve_s_defaults(batch):
    """Without --schedule: the same lowering, solved here, run to the plan's peak."""
    ran = cli("run", "--torch", SPEC, "--input-shape", SHAPE, "--device", "nrf52840", "--ram", "160KiB",
              "--time-limit", "5", "--steps", "1", "--lr", LR, "--data", batch, "--json")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["weights"] == "streamed" and summary["schedule"] is None
    assert summary["peak_live_bytes"] == summary["planned_peak_bytes"] <= 160 * 1024


def test_a_transformer_that_must_stream_is_refused_naming_weights_and_the_operator(tmp_path):
    """Row tiles of a torch transformer need its attention written out (matmul, softmax: see
    tests/test_run_rows.py), and the strip builder has no fused attention: one line naming --weights,
    the operator and what resident weights would need."""
    data = tmp_path / "tokens.npz"
    np.savez(data, x=np.zeros((1, 128, 768), np.float32), y=np.zeros(1, np.int64))
    result = cli("run", "--torch", "poet_opt.examples.torch_models:transformer_block", "--input-shape", "1,128,768",
                 "--device", "nrf52840", "--ram", "200KiB", "--steps", "1", "--lr", "0.1", "--data", data)
    assert_one_line_error(result, "--weights", "scaled_dot_product_attention", "of the device's 256 KiB")


@pytest.mark.parametrize("name", ["mlp", "mlp-residual"])
def test_run_model_trains_a_zoo_mlp_in_weight_slices_as_pytorch(name, tmp_path):
    """`run --model` trains a zoo model's PyTorch twin. At 64 KiB on the nRF52840 the MLPs' weights
    stream in slices whose outputs join whole (no strips): that replay crashed on the join before
    (an internal error), and a residual add after it."""
    from poet_opt.model.zoo_twins import zoo_module

    rng = np.random.default_rng(1)
    data = tmp_path / "b.npz"
    np.savez(data, x=rng.standard_normal((2, 784)).astype(np.float32), y=np.array([3, 8]))
    result = cli("run", "--model", name, "--device", "nrf52840", "--ram", "64KiB", "--steps", "2", "--lr", str(LR),
                 "--data", data, "--time-limit", "5", "--weights-out", tmp_path / "w.npz", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["weights"] == "streamed" and summary["peak_live_bytes"] == summary["planned_peak_bytes"]
    assert summary["storage_bytes_written"] == summary["planned_storage_bytes_written"]
    losses, want = torch_sgd(zoo_module(name), data, 2)
    with np.load(tmp_path / "w.npz") as trained:
        largest = max(float(np.abs(w).max()) for w in want.values())
        assert max(float(np.abs(trained[n] - w).max()) for n, w in want.items()) <= 1e-5 * largest
    assert np.allclose(summary["loss"], losses, rtol=1e-5)


def test_run_model_reads_its_data_file_once(tmp_path, monkeypatch):
    """`run --model` takes its input's shape from --data's x and hands the batch it read to the
    training: the file is read once, not once for the shape and again to train."""
    rng = np.random.default_rng(2)
    data = tmp_path / "b.npz"
    np.savez(data, x=rng.standard_normal((1, 784)).astype(np.float32), y=np.array([5]))
    reads, real_load = [], np.load

    def counted(file, *args, **kwargs):
        reads.append(str(file))
        return real_load(file, *args, **kwargs)

    monkeypatch.setattr(np, "load", counted)
    result = cli("run", "--model", "mlp", "--device", "rpi4", "--ram", "1MiB", "--weights", "resident", "--steps", "1",
                 "--lr", str(LR), "--data", data, "--time-limit", "5", "--json")
    assert result.exit_code == 0, result.stderr
    assert reads.count(str(data)) == 1, reads


def test_run_model_takes_its_shape_from_the_data(tmp_path):
    result = cli("run", "--model", "mlp", "--input-shape", "1,784", "--device", "nrf52840", "--ram", "64KiB",
                 "--steps", "1", "--lr", "0.1", "--data", tmp_path / "b.npz")
    assert_one_line_error(result, "--input-shape")
    result = cli("run", "--model", "mlp", "--torch", "x.py:make", "--device", "nrf52840", "--ram", "64KiB",
                 "--steps", "1", "--lr", "0.1", "--data", tmp_path / "b.npz")
    assert_one_line_error(result, "--torch")


def test_the_strip_replay_normalises_with_each_batch_norm_s_own_eps(batch, tmp_path):
    """A module's eps, not torch's default: the strip replay had 1e-5 written in, so a network whose
    batch norms use another trained differently in `run` than in PyTorch (the firmware's kernels
    always took the module's)."""
    factory = tmp_path / "wide_eps.py"
    factory.write_text("import torch\nfrom poet_opt.examples.torch_models import strip_cnn\n\n\n"
                       "def model():\n    module = strip_cnn()\n    for m in module.modules():\n"
                       "        if isinstance(m, torch.nn.BatchNorm2d):\n            m.eps = 0.5\n    return module\n")
    out = tmp_path / "after.npz"
    ran = cli("run", "--torch", f"{factory}:model", "--input-shape", SHAPE, "--device", "nrf52840", "--ram", "160KiB",
              "--strips", "12", "--time-limit", "5", "--steps", "2", "--lr", LR, "--data", batch, "--weights-out", out,
              "--json")
    assert ran.exit_code == 0, ran.stderr
    assert json.loads(ran.stdout)["weights"] == "streamed"
    module = strip_cnn()
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eps = 0.5
    losses, reference = torch_sgd(module, batch, 2)
    assert json.loads(ran.stdout)["loss"] == pytest.approx(losses, rel=1e-5)
    with np.load(out) as trained:
        scale = max(float(np.abs(v).max()) for v in reference.values())
        assert max(float(np.abs(trained[n] - reference[n]).max()) for n in reference) <= 1e-5 * scale
