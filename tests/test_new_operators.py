"""SiLU and hardswish, added through the operator registry alone (issue 27, item 6): every backend
runs them as PyTorch does.

The two operators are the proof that adding an operator is one registry entry
(poet_opt/model/ops/activations.py), its C kernels (poet_kernels_basic.c) and this test: a small
CNN with nn.SiLU and an MLP with nn.Hardswish (and their functional spellings) import with the
registry's costs from PyTorch and ONNX, train one step in firmware on the emulated Cortex-M
(`poet-opt emulate`) and through the PyTorch executor (`poet-opt run`), each equal to one step of
torch.optim.SGD on the same module and batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_cli import cli  # noqa: E402

from poet_opt.model import ops  # noqa: E402
from poet_opt.model.torch_import import import_torch  # noqa: E402

LR = 0.05
MODELS = '''
import torch
from torch import nn
import torch.nn.functional as F


class SiluCnn(nn.Module):
    """conv - BN - SiLU twice, a functional hardswish, global pooling, a linear head"""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.act1 = nn.SiLU()
        self.conv2, self.bn2 = nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.act1(self.bn1(self.conv1(x)))
        x = F.silu(self.bn2(self.conv2(x)))
        x = F.hardswish(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def silu_cnn():
    torch.manual_seed(3)
    return SiluCnn()


def hardswish_mlp():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(12, 16), nn.Hardswish(), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 3))
'''
SHAPES = {"silu_cnn": "2,3,8,8", "hardswish_mlp": "4,12"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    (d / "act_models.py").write_text(MODELS)
    namespace: dict = {}
    exec(compile(MODELS, str(d / "act_models.py"), "exec"), namespace)
    return d / "act_models.py", namespace


def _batch(path, shape, classes, seed):
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.standard_normal(shape).astype(np.float32), y=rng.integers(0, classes, shape[0]))
    return path


def _sgd_step(module, data, steps: int = 1):
    """Parameters and batch norm's running statistics after ``steps`` of plain training: emulate's
    and run's --weights-out write both."""
    with np.load(data) as d:
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
    out = {n: p.detach().numpy() for n, p in module.named_parameters()}
    out.update({n: b.numpy() for n, b in module.named_buffers() if n.endswith(("running_mean", "running_var"))})
    return out


def test_the_registry_describes_both():
    for name in ("silu", "hardswish"):
        s = ops.spec(name)
        assert (s.split, s.saves, s.flops_per_element) == ("elementwise", "in", 5)
        assert (s.c_forward, s.c_backward, s.c_convention) == (f"poet_{name}_forward", f"poet_{name}_backward",
                                                               "elementwise")
        assert {"strips", "rows"} <= set(s.tiled)
    assert ops.by_torch_module("SiLU").name == "silu" and ops.by_torch_function("hardswish").name == "hardswish"
    assert ops.by_onnx("HardSwish").name == "hardswish"
    x = torch.linspace(-5, 5, 41, dtype=torch.float64)
    g = torch.rand(41, dtype=torch.float64)
    for name, fn in (("silu", torch.nn.functional.silu), ("hardswish", torch.nn.functional.hardswish)):
        leaf = x.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(fn(leaf), leaf, g)
        assert torch.equal(ops.spec(name).torch_forward(torch, x), fn(x))
        assert torch.allclose(ops.spec(name).torch_gradient(torch, g, x=x), expected)


def test_torch_and_onnx_import_cost_them_from_the_registry(models, tmp_path):
    _, ns = models
    graph = import_torch(ns["silu_cnn"](), SHAPES["silu_cnn"])
    acts = {n.name: n for n in graph.nodes if n.op in ("silu", "hardswish")}
    assert set(acts) == {"act1", "silu", "hardswish"}
    for n in acts.values():  # 5 FLOPs per element of a (2, C, H, W) output; the backward reads the input
        assert n.flops == 5 * n.bytes / 4
        grad = next(g for g in graph.nodes if g.name == f"grad:{graph.nodes[n.deps[0]].name}")
        assert n.deps[0] in grad.deps
    path = tmp_path / "mlp.onnx"
    torch.onnx.export(ns["hardswish_mlp"](), (torch.zeros(4, 12),), str(path), dynamo=False)
    from poet_opt.model.onnx_import import import_onnx

    onnx_ops = [n.op for n in import_onnx(path).nodes if n.kind == "forward"]
    # ONNX has no SiLU: the exporter writes x * sigmoid(x), and the importer costs those two
    assert onnx_ops == ["input", "linear", "hardswish", "linear", "sigmoid", "mul", "linear"]
    torch_ops = [n.op for n in import_torch(ns["hardswish_mlp"](), SHAPES["hardswish_mlp"]).nodes
                 if n.kind == "forward"]
    assert torch_ops == ["input", "linear", "hardswish", "linear", "silu", "linear"]
    # opset 24's Swish is SiLU (alpha 1): one silu node with the registry's cost
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"), helper.make_node("Swish", ["h"], ["s"], name="act"),
         helper.make_node("MatMul", ["s", "w2"], ["y"], name="out")],
        "swish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [w, numpy_helper.from_array(np.ones((4, 2), np.float32), "w2")])
    swish = tmp_path / "swish.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]), str(swish))
    nodes = [n for n in import_onnx(swish).nodes if n.kind == "forward"]
    assert [n.op for n in nodes] == ["input", "linear", "silu", "linear"]
    assert nodes[2].flops == 5 * 2 * 4


@pytest.mark.parametrize("factory", ["silu_cnn", "hardswish_mlp"])
def test_poet_opt_emulate_trains_them_as_torch_does(models, factory, tmp_path):
    pytest.importorskip("unicorn")
    pytest.importorskip("ziglang")
    path, ns = models
    shape = tuple(int(d) for d in SHAPES[factory].split(","))
    data = _batch(tmp_path / "b.npz", shape, classes=4 if factory == "silu_cnn" else 3, seed=5)
    weights = tmp_path / "w.npz"
    result = cli("emulate", "--torch", f"{path}:{factory}", "--input-shape", SHAPES[factory], "--device", "nrf52840",
                 "--ram", "64KiB", "--steps", 1, "--lr", LR, "--data", data, "--weights-out", weights, "--json",
                 "-o", tmp_path / "build", "-q")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["ram_used_bytes"] <= summary["ram_device_bytes"]
    source = (tmp_path / "build" / "poet_train.c").read_text()
    for kernel in ("poet_silu_forward", "poet_silu_backward") + (
            ("poet_hardswish_forward", "poet_hardswish_backward") if factory == "silu_cnn" else ()):
        assert kernel in source
    reference = _sgd_step(ns[factory](), data)
    with np.load(weights) as trained:
        assert set(trained.files) == set(reference)
        largest = max(float(np.abs(w).max()) for w in reference.values())
        worst = max(float(np.abs(trained[n] - w).max()) for n, w in reference.items())
    print(f"\n{factory}: firmware - torch = {worst:.3g} of {largest:.3g}")
    assert worst <= 1e-4 * largest


@pytest.mark.parametrize("factory", ["silu_cnn", "hardswish_mlp"])
def test_poet_opt_run_trains_them_as_torch_does(models, factory, tmp_path):
    path, ns = models
    shape = tuple(int(d) for d in SHAPES[factory].split(","))
    data = _batch(tmp_path / "b.npz", shape, classes=4 if factory == "silu_cnn" else 3, seed=6)
    weights = tmp_path / "w.npz"
    plain = cli("solve", "--torch", f"{path}:{factory}", "--input-shape", SHAPES[factory], "--device", "rpi4",
                "--ram", "1GB", "--mode", "none", "--json")
    assert plain.exit_code == 0, plain.output
    summary = json.loads(plain.stdout)
    budget = int(summary["totals"]["peak_ram_bytes"] * 0.9)  # below plain training: the plan must recompute
    result = cli("run", "--torch", f"{path}:{factory}", "--input-shape", SHAPES[factory], "--device", "rpi4",
                 "--ram", f"{budget}B", "--steps", 1, "--lr", LR, "--data", data, "--weights-out", weights, "--json")
    assert result.exit_code == 0, result.output
    reference = _sgd_step(ns[factory](), data)
    with np.load(weights) as trained:
        assert set(trained.files) == set(reference)
        worst = max(float(np.abs(trained[n] - w).max() / max(np.abs(w).max(), 1e-30)) for n, w in reference.items())
    print(f"\n{factory}: executor - torch = {worst:.3g}")
    assert worst <= 1e-5


def test_poet_opt_run_moves_batch_norm_s_running_statistics_once_under_a_recompute(models, tmp_path):
    """A plan that recomputes a batch norm: two steps of `run` leave its running mean and variance
    (in --weights-out, beside the weights) where plain training leaves them; a recompute that moved
    them again would leave them a momentum's share further on."""
    path, ns = models
    data = _batch(tmp_path / "b.npz", (2, 3, 8, 8), classes=4, seed=7)
    spec = ["--torch", f"{path}:silu_cnn", "--input-shape", SHAPES["silu_cnn"], "--device", "rpi4"]
    plain = cli("solve", *spec, "--ram", "1GB", "--mode", "none", "--json")
    assert plain.exit_code == 0, plain.output
    budget = int(json.loads(plain.stdout)["totals"]["peak_ram_bytes"] * 0.8)
    plan, weights = tmp_path / "plan.json", tmp_path / "w.npz"
    solved = cli("solve", *spec, "--ram", f"{budget}B", "--mode", "remat", "--time-limit", "5", "-q", "--out", plan)
    assert solved.exit_code == 0, solved.output
    doc = json.loads(plan.read_text())
    names = [n["name"] for n in doc["graph"]["nodes"]]
    computed = [names[s["node"]] for s in doc["steps"] if s["op"] == "compute"]
    assert any(computed.count(bn) > 1 for bn in ("bn1", "bn2")), "the plan no longer recomputes a batch norm"
    result = cli("run", *spec, "--ram", f"{budget}B", "--schedule", plan, "--steps", 2, "--lr", LR, "--data", data,
                 "--weights-out", weights, "--json")
    assert result.exit_code == 0, result.output
    reference = _sgd_step(ns["silu_cnn"](), data, steps=2)
    with np.load(weights) as trained:
        assert set(trained.files) == set(reference) and "bn1.running_var" in trained.files
        worst = {n: float(np.abs(trained[n] - w).max() / np.abs(w).max()) for n, w in reference.items()}
    print(f"\nrunning statistics: executor - torch = {max(v for n, v in worst.items() if 'running' in n):.3g}")
    assert max(worst.values()) <= 1e-5, worst
