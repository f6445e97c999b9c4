"""The PyTorch executor trains exactly as plain PyTorch does, holding what the plan says it holds.

Each case solves schedules that recompute and page (tight budgets on rpi4), runs three SGD steps
with the executor and compares the weights with three steps of torch.optim.SGD on a copy of the
same module and batch; the executor's measured peak of live tensor bytes and its storage traffic
are checked against the plan. Then the commands: `poet-opt run`, `poet-opt measure` (its file
round-trips through `--costs`), bad input, Ctrl-C, and every command of docs/executor.md."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import default_sigint

torch = pytest.importorskip("torch")

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import EncoderBlock, resnet18, tiny_cnn  # noqa: E402
from poet_opt.executor import runner  # noqa: E402
from poet_opt.executor.measure import costs_csv, measure_costs  # noqa: E402
from poet_opt.executor.runner import ScheduleExecutor  # noqa: E402
from poet_opt.executor.train import prepare  # noqa: E402
from poet_opt.model.measured_costs import apply_costs, load_costs  # noqa: E402
from poet_opt.solver.driver import solve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, LR = 3, 0.05
CNN = "poet_opt.examples.torch_models:tiny_cnn"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _seeded_resnet18():
    torch.manual_seed(0)
    return resnet18()


def _small_transformer_block():
    # the examples' encoder block (fused attention, head split and merge, post-LN) at d_model 32,
    # 4 heads, d_ff 64: the same operators and views as the 768-wide one, in a fraction of the time
    torch.manual_seed(0)
    return EncoderBlock(32, 4, 64)


# name -> (factory, input shape, schedules as (mode, fraction of plain training's peak)); between
# them each model's schedules recompute and page (on rpi4 the joint plan picks one or both)
CASES = {
    "tiny-cnn": (tiny_cnn, (2, 3, 32, 32), [("joint", 0.7)]),
    "resnet18-cifar": (_seeded_resnet18, (1, 3, 16, 16), [("paging", 0.5), ("remat", 0.7)]),
    "transformer-block": (_small_transformer_block, (2, 8, 32), [("joint", 0.5)]),
}


def _batch(network, seed=1):
    rng = np.random.default_rng(seed)
    shape = network.input_shape
    classes = network.layers[network.output].elements // shape[0]
    return (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)),
            torch.from_numpy(rng.integers(0, classes, shape[0]).astype(np.int64)))


def torch_sgd(module, x, y, steps=STEPS, lr=LR):
    """The reference: plain PyTorch training (mean cross-entropy of the flattened outputs, SGD)."""
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = module(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(out.shape[0], -1), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def relative_difference(trained: dict, reference: dict) -> float:
    assert set(trained) == set(reference) and trained
    return max(float(torch.linalg.vector_norm(torch.as_tensor(trained[n]) - reference[n])
                     / torch.linalg.vector_norm(reference[n])) for n in reference)


@pytest.mark.parametrize("case", list(CASES))
def test_executor_trains_exactly_as_pytorch_within_the_plan(case, tmp_path):
    factory, shape, schedules = CASES[case]
    seen_recompute = seen_paging = False
    for mode, fraction in schedules:
        module = factory()
        reference = copy.deepcopy(module)
        network = prepare(module, shape)
        x, y = _batch(network)
        plain = solve(network.graph, "rpi4", ram=10 ** 12, mode="none")
        budget = int(plain.totals["peak_ram_bytes"] * fraction)
        schedule = solve(network.graph, "rpi4", ram=budget, mode=mode, time_limit=20)
        totals = schedule.totals
        seen_recompute |= totals["recomputes"] > 0
        seen_paging |= totals["page_outs"] > 0
        storage = tmp_path / f"{mode}-storage"
        with ScheduleExecutor(network, schedule, lr=LR, storage=storage, device="cpu") as step:
            losses, stats = [], []
            for _ in range(STEPS):
                losses.append(step(x, y))
                stats.append(step.last)
            planned_out, planned_in = step.planned_traffic()
        ref_losses, ref_weights = torch_sgd(reference, x, y)
        trained = {n: p.detach() for n, p in module.named_parameters()}
        diff = relative_difference(trained, ref_weights)
        print(f"\n{case} {mode} at {budget} B: recomputes {totals['recomputes']}, page-outs {totals['page_outs']}, "
              f"peak {stats[0].peak_live_bytes} B (plan {totals['peak_ram_bytes']} B), weights differ by {diff:.3g}")
        assert diff < 1e-5
        assert np.allclose(losses, ref_losses, rtol=1e-6, atol=1e-7)
        assert losses[-1] < losses[0]
        for s in stats:
            assert s.peak_live_bytes <= budget
            assert abs(s.peak_live_bytes - totals["peak_ram_bytes"]) <= 0.05 * totals["peak_ram_bytes"]
            assert (s.storage_bytes_written, s.storage_bytes_read) == (planned_out, planned_in)
            assert s.computes == totals["computes"] and s.page_outs == totals["page_outs"]
            assert s.page_ins == totals["page_ins"] and s.wall_s > 0
        if totals["page_outs"]:
            assert planned_out > 0 and planned_in > 0
        assert not storage.exists() or not any(storage.iterdir()), "paged tensors left behind"
    assert seen_recompute and seen_paging, "the budgets no longer force both recomputation and paging"


def test_plain_schedule_holds_what_plain_training_holds():
    network = prepare(tiny_cnn(), (2, 3, 32, 32))
    plain = solve(network.graph, "rpi4", ram=10 ** 12, mode="none")
    with ScheduleExecutor(network, plain, lr=LR) as step:
        step(*_batch(network))
        assert step.last.peak_live_bytes == plain.totals["peak_ram_bytes"]
        assert step.storage is None and step.last.storage_bytes_written == 0


def test_an_optimizer_takes_the_step():
    module = tiny_cnn()
    reference = copy.deepcopy(module)
    network = prepare(module, (2, 3, 32, 32))
    x, y = _batch(network)
    schedule = solve(network.graph, "rpi4", ram="72KiB", mode="joint", time_limit=20)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    with ScheduleExecutor(network, schedule, optimizer=opt) as step:
        for _ in range(STEPS):
            step(x, y)
            ref_opt.zero_grad()
            out = reference(x)
            torch.nn.functional.cross_entropy(out, y).backward()
            ref_opt.step()
    assert relative_difference({n: p.detach() for n, p in module.named_parameters()},
                               {n: p.detach() for n, p in reference.named_parameters()}) < 1e-5


def test_a_schedule_for_another_model_or_a_wrong_batch_is_refused(tmp_path):
    cnn = prepare(tiny_cnn(), (2, 3, 32, 32))
    schedule = solve(cnn.graph, "rpi4", ram="72KiB", mode="joint", time_limit=20)
    other = prepare(_small_transformer_block(), (2, 8, 32))
    with pytest.raises(PoetError, match="another model"):
        ScheduleExecutor(other, schedule, lr=LR)
    wider = prepare(tiny_cnn(), (4, 3, 32, 32))  # same layers, another batch: other sizes
    with pytest.raises(PoetError, match=r"--schedule: the plan is for another input shape: 2,3,32,32, not "
                                        r"--input-shape 4,3,32,32"):
        ScheduleExecutor(wider, schedule, lr=LR)
    older = schedule.to_dict()
    del older["graph"]["input_shape"]  # a file from before the document carried it: told by the sizes
    with pytest.raises(PoetError, match="another model or input shape: layer 'input' holds 24,576 B there, "
                                        "49,152 B here"):
        ScheduleExecutor(wider, older, lr=LR)
    frozen = prepare(tiny_cnn(), (2, 3, 32, 32), trainable="last:1")
    with pytest.raises(PoetError, match=r"another trainable set: it trains 9 layers \(stem, stem_bn, dw, dw_bn, "
                                        r"\.\.\.\), --trainable last:1 trains fc"):
        ScheduleExecutor(frozen, schedule, lr=LR)
    with ScheduleExecutor(cnn, schedule, lr=LR, storage=tmp_path) as step:
        x, y = _batch(cnn)
        with pytest.raises(PoetError, match="--data"):
            step(x[:1], y[:1])
        with pytest.raises(PoetError, match=r"\[0, 4\)"):
            step(x, y + 10)
    with pytest.raises(PoetError, match="learning rate"):
        ScheduleExecutor(cnn, schedule, lr=-1.0)


# -- poet-opt run -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cnn_batch(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "cnn.npz"
    rng = np.random.default_rng(1)
    np.savez(path, x=rng.standard_normal((2, 3, 32, 32)).astype(np.float32), y=np.array([1, 3], dtype=np.int64))
    return path


def run_args(data, *extra, ram="72KiB", shape="2,3,32,32"):
    return ["run", "--torch", CNN, "--input-shape", shape, "--device", "rpi4", "--ram", ram, "--steps", str(STEPS),
            "--lr", str(LR), "--data", data, *extra]


def test_run_command_trains_as_pytorch_and_reports(cnn_batch, tmp_path):
    out = tmp_path / "after.npz"
    result = cli(*run_args(cnn_batch, "--storage", tmp_path / "sd", "--weights-out", out, "--json"))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert len(summary["loss"]) == STEPS and len(summary["step_s"]) == STEPS
    assert summary["peak_live_bytes"] <= 72 * 1024
    assert abs(summary["peak_live_bytes"] - summary["planned_peak_bytes"]) <= 0.05 * summary["planned_peak_bytes"]
    assert summary["storage_bytes_written"] == summary["planned_storage_bytes_written"] > 0
    assert summary["storage_bytes_read"] == summary["planned_storage_bytes_read"] > 0
    with np.load(cnn_batch) as d:
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    module = tiny_cnn()
    losses, reference = torch_sgd(module, x, y)
    # batch norm's running statistics too, under their state_dict names, as plain training moved them
    running = {n: b for n, b in module.named_buffers() if n.endswith(("running_mean", "running_var"))}
    with np.load(out) as trained:
        assert set(trained.files) == set(reference) | set(running) and running
        assert all(trained[n].dtype == np.float32 for n in trained.files)
        assert relative_difference({n: trained[n] for n in reference}, reference) < 1e-5
        assert relative_difference({n: trained[n] for n in running}, running) < 1e-5
    assert np.allclose(summary["loss"], losses, rtol=1e-6)
    assert not (tmp_path / "sd").exists()  # nor the folder run made for them
    text = cli(*run_args(cnn_batch))
    assert text.exit_code == 0 and "KiB of live tensors" in text.stdout


def test_run_refuses_bad_input_in_one_line(cnn_batch, tmp_path, monkeypatch):
    out = tmp_path / "after.npz"
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    assert_one_line_error(cli(*run_args(cnn_batch, "--storage", a_file / "sd", "--weights-out", out)),
                          "--storage", out=out)
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((3, 3, 32, 32), np.float32), y=np.zeros(3, np.int64))
    assert_one_line_error(cli(*run_args(wrong, "--weights-out", out)), "--data", "3,3,32,32", out=out)
    assert_one_line_error(cli(*run_args(cnn_batch, "--weights-out", out, shape="2,3,32")), "--data", "2,3,32", out=out)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runner, "open", full, raising=False)  # the storage directory fills up
    sd = tmp_path / "full"
    assert_one_line_error(cli(*run_args(cnn_batch, "--storage", sd, "--weights-out", out)), "--storage", "full",
                          out=out)
    assert not sd.exists()  # nor the folder run made for them
    # without --storage: the private temporary directory goes too
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert_one_line_error(cli(*run_args(cnn_batch, "--weights-out", out)), "--storage", "full", out=out)
    assert not any((tmp_path / "tmp").iterdir())


def test_run_stops_on_ctrl_c_with_nothing_written(cnn_batch, tmp_path):
    out, sd = tmp_path / "after.npz", tmp_path / "sd"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    args = run_args(cnn_batch, "--storage", sd, "--weights-out", out)
    args[args.index("--steps") + 1] = "100000"
    proc = subprocess.Popen(["poet-opt", *map(str, args)], env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 120
        # training has begun once a paged tensor is on storage (stderr is no terminal: no progress)
        while not list(sd.glob("poet-run-*/node-*.bin")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
    finally:
        proc.kill()
    assert "interrupted" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".after.npz*"))
    assert not sd.exists()  # nor the folder run made for them


# -- poet-opt run --schedule: the plan `solve --out` wrote, step for step ----------------------------

@pytest.fixture(scope="module")
def paging_plan(tmp_path_factory):
    """A plan that pages and recomputes nothing (--mode paging), as `solve --out` writes it: `run`
    without --schedule would plan otherwise (joint: it recomputes too), so following it is visible."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    solved = cli("solve", "--torch", CNN, "--input-shape", "2,3,32,32", "--device", "rpi4", "--ram", "72KiB",
                 "--mode", "paging", "--out", path, "-q")
    assert solved.exit_code == 0, solved.stderr
    doc = json.loads(path.read_text())
    assert doc["totals"]["page_outs"] > 0 and doc["totals"]["recomputes"] == 0
    return path


def test_run_follows_the_schedule_file_step_for_step(cnn_batch, paging_plan, tmp_path, monkeypatch):
    from poet_opt.executor.train import run_training

    doc = json.loads(paging_plan.read_text())
    planned = tuple((s["op"], s["node"]) for s in doc["steps"])
    result = run_training(torch_model=CNN, input_shape="2,3,32,32", schedule=paging_plan, steps=STEPS, lr=LR,
                          data=cnn_batch, storage=tmp_path / "sd", torch_device="cpu")
    assert [s.executed for s in result.stats] == [planned] * STEPS  # what each step did, as it did it
    with np.load(cnn_batch) as d:
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    losses, reference = torch_sgd(tiny_cnn(), x, y)
    assert relative_difference(result.weights, reference) < 1e-5
    assert np.allclose(result.losses, losses, rtol=1e-6)

    # the command: no --device, --ram or --storage needed; paged tensors go to a private temporary
    # directory that is gone afterwards
    made = []
    close = runner.Storage.close
    monkeypatch.setattr(runner.Storage, "close", lambda self: (made.append(self.dir), close(self)))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    ran = cli("run", "--torch", CNN, "--input-shape", "2,3,32,32", "--schedule", paging_plan, "--steps", STEPS,
              "--lr", LR, "--data", cnn_batch, "--json")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    totals = doc["totals"]
    assert summary["executed"] == {"computes": totals["computes"], "page_outs": totals["page_outs"],
                                   "page_ins": totals["page_ins"], "steps": len(planned)}
    assert (summary["recomputes"], summary["page_outs"]) == (0, totals["page_outs"])
    assert summary["schedule"] == str(paging_plan) and summary["loss"] == pytest.approx(losses, rel=1e-6)
    assert summary["storage_bytes_written"] == summary["planned_storage_bytes_written"] > 0
    assert made and all(d.parent == tmp_path / "tmp" and not d.exists() for d in made)
    assert not any((tmp_path / "tmp").iterdir())


def test_run_refuses_a_plan_for_another_model_shape_trainable_set_or_budget(cnn_batch, paging_plan, tmp_path):
    out = tmp_path / "after.npz"

    def run(*extra, shape="2,3,32,32", data=cnn_batch, plan=paging_plan):
        return cli("run", "--torch", CNN, "--input-shape", shape, "--schedule", plan, "--steps", "1", "--lr", LR,
                   "--data", data, "--weights-out", out, *extra)

    mlp = tmp_path / "mlp.json"
    assert cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--out", mlp, "-q").exit_code == 0
    assert_one_line_error(run(plan=mlp), "--schedule: the plan is for another model: its 8 forward nodes are not this "
                          "model's 16", out=out)
    four = tmp_path / "four.npz"
    np.savez(four, x=np.zeros((4, 3, 32, 32), np.float32), y=np.zeros(4, np.int64))
    assert_one_line_error(run(shape="4,3,32,32", data=four), "--schedule: the plan is for another input shape: "
                          "2,3,32,32, not --input-shape 4,3,32,32", out=out)
    # a streamed plan runs through the strip replay (tests/test_run_tiles.py), ReLU6 included: solve's
    # graph (the importer's) and run's (the strip builder's) must be the same, trainable flags and
    # weight slices too (slices once cut the importer's convolutions over the batch)
    for extra in ([], ["--weight-tile", "2KiB"]):
        other = tmp_path / "streamed.json"
        solved = cli("solve", "--torch", CNN, "--input-shape", "2,3,32,32", "--device", "rpi4", "--ram", "100KiB",
                     "--weights", "streamed", *extra, "--out", other, "-q")
        assert solved.exit_code == 0, solved.stderr
        ran = run(plan=other)
        assert ran.exit_code == 0, ran.stderr
        assert out.exists()
        out.unlink()
    other = tmp_path / "sgd.json"
    solved = cli("solve", "--torch", CNN, "--input-shape", "2,3,32,32", "--device", "rpi4", "--ram", "100KiB",
                 "--optimizer", "sgd", "--out", other, "-q")
    assert solved.exit_code == 0, solved.stderr
    assert_one_line_error(run(plan=other), "--schedule: the plan has the weight update as graph nodes", out=out)
    assert_one_line_error(run("--trainable", "last:1"), "--schedule: the plan is for another trainable set", out=out)
    assert_one_line_error(run("--ram", "64KiB"), "--schedule: the plan is for a RAM budget of 72 KiB (73,728 B), "
                          "not --ram 64KiB", out=out)
    assert_one_line_error(run("--device", "jetson-nano"), "--schedule: the plan is for device rpi4, not --device "
                          "jetson-nano", out=out)
    assert_one_line_error(run("--mode", "joint"), "--schedule: the plan is for --mode paging, not --mode joint",
                          out=out)
    assert_one_line_error(run("--runtime", "2x"), "--schedule: the plan is for no runtime budget, not --runtime 2x",
                          out=out)
    assert_one_line_error(run("--costs", mlp), "--costs: only for the plan `run` solves itself", out=out)
    assert_one_line_error(run("--time-limit", "5"), "--time-limit: only for the plan `run` solves itself", out=out)
    # the file passes the validator first, and a broken one is bad input here (exit 2), not exit 1
    broken = json.loads(paging_plan.read_text())
    broken["totals"]["page_outs"] += 1
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert_one_line_error(run(plan=tmp_path / "broken.json"), "broken.json: --schedule: totals.page_outs", out=out)
    assert_one_line_error(run(plan=tmp_path / "none.json"), "none.json: --schedule", out=out)
    assert_one_line_error(run(plan=out), "--weights-out", "same file as --schedule")
    # agreeing budgets are accepted, and without a plan --device and --ram are required
    agreed = run("--device", "rpi4", "--ram", "73728B", "--mode", "paging")
    assert agreed.exit_code == 0, agreed.stderr
    out.unlink()
    plain = run_args(cnn_batch, "--weights-out", out)
    del plain[plain.index("--ram"):plain.index("--ram") + 2]
    assert_one_line_error(cli(*plain), "--ram: give --ram, or a plan with --schedule PLAN.json", out=out)


def test_run_with_costs_follows_the_plan_solve_costs_writes(cnn_batch, tmp_path):
    """`run --costs` solves the same problem as `solve --costs`, with solve's defaults: the same plan."""
    from poet_opt.executor.train import run_training

    network = prepare(tiny_cnn(), (2, 3, 32, 32))
    costs = _written(tmp_path / "costs.csv", costs_csv(measure_costs(network, warmup=0, repeat=1), 4.5))
    plan = tmp_path / "plan.json"
    solved = cli("solve", "--torch", CNN, "--input-shape", "2,3,32,32", "--device", "rpi4", "--ram", "72KiB",
                 "--costs", costs, "--out", plan, "-q")
    assert solved.exit_code == 0, solved.stderr
    result = run_training(torch_model=CNN, input_shape="2,3,32,32", device="rpi4", ram="72KiB", costs=costs, steps=1,
                          lr=LR, data=cnn_batch, torch_device="cpu")
    doc = json.loads(plan.read_text())
    assert result.schedule["steps"] == doc["steps"]
    assert result.stats[0].executed == tuple((s["op"], s["node"]) for s in doc["steps"])
    assert [n["compute_s"] for n in result.schedule["graph"]["nodes"]] == [n["compute_s"] for n in doc["graph"]["nodes"]]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_run_removes_its_temporary_storage_when_stopped(cnn_batch, tmp_path, signum, code):
    """Without --storage, paged tensors go to a private directory under $TMPDIR, gone after a
    SIGTERM or Ctrl-C as after a normal end."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    args = run_args(cnn_batch)  # the joint plan at 72 KiB pages (test_run_command_trains_as_pytorch_and_reports)
    args[args.index("--steps") + 1] = "100000"
    proc = subprocess.Popen(["poet-opt", *map(str, args)], env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp.glob("poet-run-*/node-*.bin")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        assert list(tmp.glob("poet-run-*/node-*.bin")), "no paged tensor reached the temporary directory in 120 s"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err
    finally:
        proc.kill()
    assert "Traceback" not in err
    assert not list(tmp.glob("poet-run-*")), list(tmp.iterdir())


# -- poet-opt measure ---------------------------------------------------------------------------------

def test_measure_writes_the_costs_file_solve_reads(tmp_path):
    out = tmp_path / "costs.csv"
    result = cli("measure", "--torch", CNN, "--input-shape", "2,3,32,32", "-o", out, "--warmup", "1", "--repeat", "3",
                 "--watts", "4", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    network = prepare(tiny_cnn(), (2, 3, 32, 32))
    assert [n["name"] for n in report["nodes"]] == [n.name for n in network.graph.nodes]
    assert all(n["runs"] == 3 and n["median_s"] > 0 and n["spread_s"] >= 0 for n in report["nodes"])
    costs = load_costs(out)
    graph = apply_costs(network.graph, costs)
    assert graph.meta["measured_nodes"] == len(graph.nodes)
    for node, row in zip(graph.nodes, report["nodes"]):
        assert node.compute_s == pytest.approx(row["median_s"], rel=1e-12)
        assert node.compute_j == pytest.approx(4 * row["median_s"], rel=1e-12)
    solved = cli("solve", "--torch", CNN, "--input-shape", "2,3,32,32", "--device", "rpi4", "--ram", "72KiB",
                 "--costs", out, "--time-limit", "20", "--json")
    assert solved.exit_code == 0, solved.stderr
    # without --watts the file has times only: the solver costs them at the profile's power
    timings = measure_costs(network, warmup=0, repeat=1)
    rows = load_costs(_written(tmp_path / "t.csv", costs_csv(timings))).rows
    assert all(set(r) == {"time_s"} for r in rows.values()) and len(rows) == len(network.graph.nodes)


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_measure_refuses_bad_input_and_stops_on_ctrl_c(tmp_path, monkeypatch):
    out = tmp_path / "costs.csv"
    base = ["measure", "--torch", CNN, "--input-shape", "2,3,32,32", "-o", out]
    assert_one_line_error(cli(*base, "--watts", "-3"), "--watts", out=out)
    assert_one_line_error(cli(*base[:-1], tmp_path / "costs.json"), ".csv")
    assert_one_line_error(cli(*base[:-3], "2,3,32", "-o", out), "--input-shape", out=out)
    from poet_opt.executor import measure

    real = measure.measure_costs

    def interrupted(network, **kwargs):
        def on_node(name):
            raise KeyboardInterrupt

        return real(network, **{**kwargs, "on_node": on_node})

    monkeypatch.setattr(measure, "measure_costs", interrupted)
    assert_one_line_error(cli(*base), "interrupted", code=130, out=out)


# -- docs/executor.md ---------------------------------------------------------------------------------

def test_the_commands_in_docs_executor_md_run(tmp_path):
    """Every line of docs/executor.md's sh block, as written, in a scratch directory (the poet-opt
    lines in-process, to keep the test fast), then its python block as a script."""
    doc = (ROOT / "docs" / "executor.md").read_text()
    scripts = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(scripts) == 1
    commands = [line for line in re.search(r"```sh\n(.*?)```", doc, re.S).group(1).splitlines() if line.strip()]
    assert len(commands) >= 3 and all(c.startswith(("python", "poet-opt")) for c in commands)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for command in commands:
            if command.startswith("python"):
                argv = shlex.split(command)
                done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, (command, done.stderr)
                continue
            result = cli(*shlex.split(command)[1:])
            assert result.exit_code == 0, (command, result.stderr)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", scripts[0]], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("loss ") == 3
    finally:
        os.chdir(cwd)
    assert (tmp_path / "costs.csv").is_file() and (tmp_path / "plan.json").is_file()
    with np.load(tmp_path / "after.npz") as trained:
        assert "fc.weight" in trained.files
    # the loop connects: run trained with the plan solve --costs wrote, not one of its own
    summary = json.loads(result.stdout)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "--schedule plan.json" in command and summary["schedule"] == "plan.json"
    totals = plan["totals"]
    assert (summary["recomputes"], summary["page_outs"]) == (totals["recomputes"], totals["page_outs"])
    assert summary["executed"] == {"computes": totals["computes"], "page_outs": totals["page_outs"],
                                   "page_ins": totals["page_ins"], "steps": len(plan["steps"])}
    assert summary["steps"] == 3 and summary["planned_step_s"] == pytest.approx(totals["runtime_s"], rel=1e-12)
    assert not (tmp_path / "sd").exists()  # no --storage: nothing left in the working directory


class _InPlaceNet(torch.nn.Module):
    """In-place ReLU and `+=` (which must not overwrite a tensor the plan still holds), GELU, ReLU6
    and an average pooling whose backward reads nothing."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.relu = torch.nn.Conv2d(3, 8, 3, 1, 1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True)
        self.c2, self.gelu, self.relu6 = torch.nn.Conv2d(8, 8, 3, 1, 1), torch.nn.GELU(), torch.nn.ReLU6()
        self.pool, self.fc = torch.nn.AvgPool2d(2), torch.nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = self.relu(self.bn(self.c1(x)))
        y = self.c2(x)
        y += x
        return self.fc(torch.flatten(self.pool(self.relu6(self.gelu(y))), 1))


@pytest.mark.parametrize("mode", ["remat", "paging"])
def test_in_place_operators_and_average_pooling(mode):
    torch.manual_seed(0)
    module = _InPlaceNet()
    reference = copy.deepcopy(module)
    network = prepare(module, (2, 3, 8, 8))
    x, y = _batch(network)
    plain = solve(network.graph, "rpi4", ram=10 ** 12, mode="none")
    schedule = solve(network.graph, "rpi4", ram=int(plain.totals["peak_ram_bytes"] * 0.7), mode=mode, time_limit=20)
    assert schedule.totals["recomputes" if mode == "remat" else "page_outs"] > 0
    with ScheduleExecutor(network, schedule, lr=LR) as step:
        losses = [step(x, y) for _ in range(STEPS)]
    ref_losses, ref_weights = torch_sgd(reference, x, y)
    assert relative_difference({n: p.detach() for n, p in module.named_parameters()}, ref_weights) < 1e-5
    assert np.allclose(losses, ref_losses, rtol=1e-6)


def test_an_operator_without_a_rule_is_named(tmp_path):
    # dropout's random mask: a recompute would draw another (every registry operator runs whole)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(), torch.nn.Linear(4, 2))
    with pytest.raises(PoetError, match="'2': its input passes through dropout.*the PyTorch executor has no rule"):
        prepare(module, (2, 4))
