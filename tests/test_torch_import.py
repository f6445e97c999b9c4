"""PyTorch import: graphs of the example networks against the zoo and against a measured forward pass."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from poet_opt.cli import main  # noqa: E402
from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples import torch_models  # noqa: E402
from poet_opt.model.torch_import import import_torch  # noqa: E402
from poet_opt.model.zoo import build_model  # noqa: E402

EXAMPLES = "poet_opt/examples/torch_models.py"


def measured_activation_bytes(module, shape) -> int:
    """Bytes of every tensor one forward pass allocates, the input included: outputs of leaf
    modules (forward hooks) and of the functional ops between them (a TorchFunctionMode). A view
    shares its base's storage, so storages are counted once: only real allocations add up."""
    from torch.overrides import TorchFunctionMode

    storages: dict[int, int] = {}
    inside = [0]

    alive = []  # held so that a freed tensor's address is not reused by the next one

    def record(t):
        if isinstance(t, torch.Tensor):
            alive.append(t)
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    def enter(_module, _inputs):
        inside[0] += 1

    def leave(_module, _inputs, out):  # returns None: the output stays as it is
        inside[0] -= 1
        record(out)

    handles = []
    for m in module.modules():
        if not list(m.children()):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]

    class Functional(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if inside[0] == 0:
                record(out)
            return out

    x = torch.randn(shape)
    record(x)
    module.eval()
    try:
        with torch.no_grad(), Functional():
            module(x)
    finally:
        for h in handles:
            h.remove()
    return sum(storages.values())


def forward_bytes(graph) -> int:
    return sum(n.bytes for n in graph.nodes if n.kind == "forward")


@pytest.mark.parametrize("factory, shape, zoo_name, zoo_shape", [
    ("resnet18", (1, 3, 32, 32), "resnet18-cifar", None),
    ("mobilenetv2", (1, 3, 64, 64), "mobilenetv2", "3x64x64"),
])
def test_cnn_graphs_match_the_zoo_and_a_measured_forward_pass(factory, shape, zoo_name, zoo_shape):
    module = getattr(torch_models, factory)()
    graph = import_torch(module, shape)
    zoo = build_model(zoo_name, input_shape=zoo_shape)
    assert len(graph) == len(zoo)
    assert [(n.name, n.op, n.bytes, n.deps, n.param_bytes) for n in graph.nodes] == \
        [(n.name, n.op, n.bytes, n.deps, n.param_bytes) for n in zoo.nodes]
    measured = measured_activation_bytes(module, shape)
    assert forward_bytes(graph) == pytest.approx(measured, rel=0.05)


def test_transformer_block_fuses_attention_and_matches_a_measured_forward_pass():
    module = torch_models.EncoderBlock(d_model=64, heads=4, d_ff=256)
    graph = import_torch(module, (2, 16, 64))
    ops = [n.op for n in graph.nodes if n.kind == "forward"]
    assert ops.count("attention") == 1 and ops.count("linear") == 6 and ops.count("layernorm") == 2
    # the zoo's block spells attention as scores, softmax and context: one node instead of three
    zoo = build_model("transformer-block")
    assert graph.meta["forward_layers"] == zoo.meta["forward_layers"] - 2
    attention = next(n for n in graph.nodes if n.op == "attention")
    grad_q = next(n for n in graph.nodes if n.name == "grad:q")
    # back through attention reads q, k, v and the attention output, as flash attention saves them
    readers = {graph.nodes[d].name for d in grad_q.deps}
    assert {"q", "k", "v", attention.name, f"grad:{attention.name}"} <= readers
    assert forward_bytes(graph) == pytest.approx(measured_activation_bytes(module, (2, 16, 64)), rel=0.05)
    # FLOPs of the fused op: two matmuls and a softmax over 2 x 4 heads of 16 x 16 scores
    assert attention.flops == 2 * 8 * 16 * 16 * (16 + 16) + 5 * 8 * 16 * 16


def test_a_real_copy_is_a_node_but_a_view_is_not():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x).transpose(1, 2)  # a view
            return y.reshape(x.shape[0], -1).relu()  # a non-contiguous reshape copies

    graph = import_torch(Net(), (2, 4, 8))
    assert [n.op for n in graph.nodes if n.kind == "forward"] == ["input", "linear", "copy", "relu"]
    assert forward_bytes(graph) == measured_activation_bytes(Net(), (2, 4, 8))


def test_file_and_module_forms_give_the_same_graph_and_trainable_applies():
    by_file = import_torch(f"{EXAMPLES}:resnet18", "1,3,32,32", trainable="last:2")
    by_module = import_torch("poet_opt.examples.torch_models:resnet18", "1x3x32x32", trainable="last:2")
    assert [(n.name, n.bytes, n.deps) for n in by_file.nodes] == [(n.name, n.bytes, n.deps) for n in by_module.nodes]
    assert [n.name for n in by_file.nodes if n.trainable] == ["layer4.1.bn2", "fc"]
    # frozen layers get no weight gradient and the backward graph stops at the first trained layer
    assert {n.name for n in by_file.nodes if n.kind == "backward"} == {"grad:fc", "grad:avgpool", "grad:layer4.1.relu2",
                                                                       "grad:layer4.1.add", "grad:layer4.1.bn2"}


class Cumsum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cumsum(self.fc(x), 1)


def test_unsupported_operator_names_it_and_the_costs_file_admits_it():
    with pytest.raises(PoetError) as err:
        import_torch(Cumsum(), (1, 4))
    assert "'cumsum'" in str(err.value) and "--costs" in str(err.value)
    graph = import_torch(Cumsum(), (1, 4), known_costs={"cumsum"})
    assert [n.op for n in graph.nodes if n.kind == "forward"] == ["input", "linear", "cumsum"]


def test_a_module_that_fails_to_trace_shows_the_tracers_message_in_one_line():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(PoetError) as err:
        import_torch(Branchy(), (1, 4))
    message = err.value.one_line()
    assert "torch.fx cannot trace Branchy" in message and "\n" not in message
    assert "control flow" in message


def test_cli_bad_torch_specs_are_one_line_exit_2(tmp_path):
    runner = CliRunner()
    base = ["solve", "--device", "rpi4", "--ram", "1MB", "--input-shape", "1,3,32,32"]
    for spec, expected in ((f"{EXAMPLES}:resnet19", "did you mean resnet18"),
                           ("no/such/file.py:f", "no such Python file"),
                           ("poet_opt.examples.nothing:f", "cannot import"),
                           ("resnet18", "FILE.py:FACTORY")):
        result = runner.invoke(main, base + ["--torch", spec])
        assert result.exit_code == 2, result.output
        assert expected in result.output and len(result.output.strip().splitlines()) == 1
    result = runner.invoke(main, ["solve", "--device", "rpi4", "--ram", "1MB", "--torch", f"{EXAMPLES}:resnet18"])
    assert result.exit_code == 2 and "--input-shape" in result.output
    result = runner.invoke(main, base[:-1] + ["1,3,32", "--torch", f"{EXAMPLES}:resnet18"])
    assert result.exit_code == 2 and "--input-shape" in result.output


def test_done_when_command_solves_and_validates(tmp_path):
    out = tmp_path / "s.json"
    result = CliRunner().invoke(main, ["solve", "--torch", f"{EXAMPLES}:resnet18", "--input-shape", "1,3,32,32",
                                       "--device", "rpi4", "--ram", "1.5MB", "--trainable", "last:2", "-q",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    check = CliRunner().invoke(main, ["validate", str(out)])
    assert check.exit_code == 0 and "valid" in check.output


def test_users_own_file_with_an_unsupported_operator_solves_with_measured_costs(tmp_path):
    (tmp_path / "mynet.py").write_text(
        "import torch\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)\n\n"
        "    def forward(self, x):\n"
        "        return self.fc2(torch.cumsum(self.fc1(x), 1))\n\n"
        "def build():\n"
        "    return Net()\n")
    costs = tmp_path / "costs.csv"
    costs.write_text("name,time_s,energy_j\ncumsum,0.001,0.004\ngrad:fc1,0.002,\n")
    args = ["solve", "--torch", f"{tmp_path / 'mynet.py'}:build", "--input-shape", "8,16", "--device", "rpi4",
            "--ram", "64KB", "--json", "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "'cumsum'" in result.output and "--costs" in result.output
    result = CliRunner().invoke(main, args + ["--costs", str(costs)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["totals"]["compute_j"] >= 0.004


FACTORIES = sorted(name for name, value in vars(torch_models).items()
                   if callable(value) and not isinstance(value, type) and not name.startswith("_")
                   and value.__module__ == torch_models.__name__)


@pytest.mark.parametrize("factory", FACTORIES)
def test_every_example_factory_builds_the_same_weights_in_every_process(factory):
    """`emulate --torch ...:resnet18` builds its module in a process of its own; a reference built
    anywhere else compares with it only when the factory seeds its weights. resnet18 did not, and
    its firmware step was taken for wrong by 0.38 of the largest weight (benchmarks/FIRMWARE.md)."""
    torch.manual_seed(1)
    first = getattr(torch_models, factory)().state_dict()
    torch.manual_seed(2)
    again = getattr(torch_models, factory)().state_dict()
    assert first.keys() == again.keys()
    for name, value in first.items():
        assert torch.equal(value, again[name]), (factory, name)


def test_the_resnet18_factory_builds_the_zoo_twin_emulate_model_trains():
    from poet_opt.model.zoo_twins import zoo_module

    twin = zoo_module("resnet18-cifar").state_dict()
    torch.manual_seed(5)
    built = torch_models.resnet18().state_dict()
    assert all(torch.equal(value, built[name]) for name, value in twin.items())


_CTRL_C_IN_TORCHS_IMPORT = """
import builtins, os, signal, sys
from poet_opt.model import torch_import
real = builtins.__import__
def importing(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules:
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C as torch's import starts
    return real(name, *args, **kwargs)
builtins.__import__ = importing
try:
    torch_import._torch()
except KeyboardInterrupt:
    print("interrupted after the import" if "torch.fx" in sys.modules else "interrupted inside the import")
"""


def test_a_ctrl_c_during_torchs_import_waits_for_its_end():
    """A Ctrl-C inside torch's own import can leave its native code as a TypeError with the interrupt
    lost (an internal error in CI, where it should have exited 130): the import holds SIGINT and
    SIGTERM to its end, and the interrupt is raised then."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CTRL_C_IN_TORCHS_IMPORT], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "interrupted after the import", (out.stdout, out.stderr[-2000:])
