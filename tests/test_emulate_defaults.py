"""One set of defaults: `emulate` streams and slices the weights as `solve` does, so a network that
`solve` plans is one `emulate` trains with no more options (issue 27)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_cli import cli  # noqa: E402

MLP = '''import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 10))
'''


def assert_trained_like_torch(weights_file, summary: dict, reference, batch_file, steps: int, lr: float) -> None:
    """The weights `emulate --weights-out` wrote and the losses it reported are those of ``steps``
    torch.optim.SGD steps on ``reference`` (every parameter trained) over the batch file."""
    from test_firmware_training import torch_sgd

    losses, want = torch_sgd(reference, batch_file, {n for n, _ in reference.named_parameters()}, steps=steps, lr=lr)
    with np.load(weights_file) as trained:
        got = {n: trained[n] for n in trained.files}
    largest = max(float(np.abs(w).max()) for w in want.values())
    assert max(float(np.abs(got[n] - w).max()) for n, w in want.items()) <= 1e-4 * largest
    assert np.allclose(summary["loss"], losses, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    where = tmp_path_factory.mktemp("mlp")
    (where / "mlp.py").write_text(MLP)
    rng = np.random.default_rng(0)
    np.savez(where / "b.npz", x=rng.standard_normal((4, 784)).astype(np.float32), y=np.array([1, 2, 3, 4]))
    return where


def test_solve_and_emulate_slice_an_mlp_too_big_for_the_budget_the_same_way(mlp):
    """The 1.8 MB MLP at 96 KiB: its first layer alone is 1.2 MB. `solve` slices it by default; so
    does `emulate`, into the same graph."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.firmware.trainer import STACK_BYTES
    from poet_opt.model.load import default_tile_bytes, load_training_graph
    from poet_opt.model.network import lower_network

    spec = str(mlp / "mlp.py") + ":make"
    profile = load_profile("nrf52840")
    assert profile.memory.stack_reserve_bytes == STACK_BYTES  # the two commands reserve the same stack
    tile = default_tile_bytes([96 * 1024])
    assert tile == 24 * 1024
    solved, _ = load_training_graph(torch=spec, input_shape="4,784", weights="auto", tile_bytes=tile,
                                    device_ram_bytes=profile.memory.ram_bytes,
                                    stack_reserve_bytes=profile.memory.stack_reserve_bytes, ram_bytes=96 * 1024)
    emulated = lower_network(spec, (4, 784), weights="streamed", tile_bytes=tile).graph
    assert [(n.name, n.bytes, n.deps) for n in solved.nodes] == [(n.name, n.bytes, n.deps) for n in emulated.nodes]
    assert max(n.bytes for n in solved.nodes if n.op == "param") <= tile


def test_the_mlp_trains_at_96_kib_with_defaults_equal_to_torch(mlp):
    pytest.importorskip("unicorn")
    pytest.importorskip("ziglang")

    result = cli("emulate", "--torch", str(mlp / "mlp.py") + ":make", "--input-shape", "4,784", "--device",
                 "nrf52840", "--ram", "96KiB", "--steps", "2", "--lr", "0.05", "--data", mlp / "b.npz",
                 # the defaults under test choose weights, tiles and strips; the solve's 60 s
                 # (it ends at its limit, with a gap) would only make the suite wait
                 "--time-limit", "10",
                 "--weights-out", mlp / "w.npz", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["weights"] == "streamed" and summary["tiles"]
    assert summary["ram_used_bytes"] <= summary["ram_device_bytes"]
    import importlib.util

    spec = importlib.util.spec_from_file_location("mlp_module", mlp / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = module.make()
    assert_trained_like_torch(mlp / "w.npz", summary, reference, mlp / "b.npz", steps=2, lr=0.05)


@pytest.mark.parametrize("name", ["mcu-vww", "mlp", "mlp-residual", "vgg16-cifar", "vgg16-imagenet", "resnet18-cifar",
                                  "resnet18-imagenet", "resnet50", "mobilenetv2", "transformer-block", "bert-base"])
def test_each_zoo_model_has_a_twin_lowered_to_the_zoo_graph(name):
    """`emulate --model NAME` trains a seeded PyTorch module (for resnet18-cifar the one
    `--torch ...:resnet18` names), and its lowering is the zoo's graph node for node: kinds, sizes,
    parameters, dependencies and FLOPs, and the names of the layers with weights (what --trainable
    selects). The transformers' attention is unfused, its scaling and head join folded as the zoo
    folds them (zoo_twins.lower_twin); bert-base is whole, at its 128 tokens."""
    from poet_opt.model.zoo_twins import FACTORIES, lower_twin, twin_input_shape, zoo_module
    from poet_opt.model.zoo import build_model

    assert name in FACTORIES
    zoo = build_model(name)
    module = zoo_module(name, training=False)
    lowered = lower_twin(name, module, twin_input_shape(name, zoo.meta["batch_size"], tuple(zoo.meta["input_shape"])))
    assert [(n.kind, n.bytes, n.param_bytes, n.deps) for n in lowered.nodes] == \
        [(n.kind, n.bytes, n.param_bytes, n.deps) for n in zoo.nodes]
    assert [n.flops for n in lowered.nodes] == pytest.approx([n.flops for n in zoo.nodes], rel=1e-9)
    assert [n.name for n in lowered.nodes if n.param_bytes] == [n.name for n in zoo.nodes if n.param_bytes]
    if name == "transformer-block":  # a --torch transformer's row lowering (model/torch_rows.py) folds alike
        from poet_opt.model.torch_import import lower_module
        from poet_opt.model.torch_rows import row_ops

        kept, divisors, _ = row_ops(module, *lower_module(module, (1, 128, 768)))
        assert [(o.name, o.op, o.flops) for o in kept] == \
            [(n.name, n.op, n.flops) for n in lowered.nodes if n.kind == "forward"]
        assert list(divisors.values()) == [8.0]  # sqrt(d_head): the scaling the zoo leaves implicit
    again = zoo_module(name, training=False)  # seeded: the same weights
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), again.parameters()))


@pytest.mark.parametrize("name, why", [("transformer-block", "no classifier head")])
@pytest.mark.parametrize("command", ["emulate", "run"])
def test_a_twin_the_firmware_and_run_cannot_train_is_refused_up_front_saying_what_to_use(name, why, command,
                                                                                        tmp_path):
    """Before the data is read or anything solved (--data names a file that is not there): one
    line, exit 2, naming why, that `solve` plans it, and the encoder with a head to train instead."""
    from test_cli import assert_one_line_error

    result = cli(command, "--model", name, "--device", "nrf52840", "--ram", "200KiB", "--steps", "1", "--lr", "0.1",
                 "--data", tmp_path / "missing.npz")
    assert_one_line_error(result, "--model", why, f"solve --model {name}", "torch_models:encoder_classifier")


def test_emulate_refuses_bert_base_up_front_saying_run_trains_it(tmp_path):
    """A step of bert-base is about 1e11 emulated instructions, close to an hour of emulation (the
    firmware has its kernels: tests/test_emulate_embedding.py trains a reduced twin in row tiles):
    `emulate --model bert-base` is refused before the data is read, in one line that says so and
    that `run --model bert-base` trains it; `run` itself gets past the model to the missing batch file."""
    from test_cli import assert_one_line_error

    args = ["--model", "bert-base", "--device", "nrf52840", "--ram", "200KiB", "--steps", "1", "--lr", "0.1",
            "--data", tmp_path / "missing.npz"]
    assert_one_line_error(cli("emulate", *args), "--model", "1e11 emulated instructions", "has its kernels",
                          "run --model bert-base")
    assert_one_line_error(cli("run", *args), "--data", "missing.npz")


def test_a_zoo_model_with_a_new_twin_trains_in_firmware_equal_to_torch(tmp_path):
    """`emulate --model mlp-residual`, refused before its twin existed, streams its 1.3 MB of
    weights through 64 KiB and ends with the weights of one torch.optim.SGD step on the twin."""
    pytest.importorskip("unicorn")
    pytest.importorskip("ziglang")

    from poet_opt.model.zoo_twins import zoo_module

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "b.npz", x=rng.standard_normal((1, 784)).astype(np.float32), y=np.array([3]))
    result = cli("emulate", "--model", "mlp-residual", "--device", "nrf52840", "--ram", "64KiB", "--steps", "1",
                 "--lr", "0.05", "--data", tmp_path / "b.npz", "--weights-out", tmp_path / "w.npz",
                 "--time-limit", "5", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["weights"] == "streamed" and summary["ram_used_bytes"] <= summary["ram_device_bytes"]
    reference = zoo_module("mlp-residual")
    assert_trained_like_torch(tmp_path / "w.npz", summary, reference, tmp_path / "b.npz", steps=1, lr=0.05)
