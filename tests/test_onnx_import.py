"""ONNX import on models the test exports from PyTorch itself: the same graph as the torch path."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from click.testing import CliRunner  # noqa: E402

from poet_opt.cli import main  # noqa: E402
from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples import torch_models  # noqa: E402
from poet_opt.model.onnx_import import import_onnx  # noqa: E402
from poet_opt.model.torch_import import import_torch  # noqa: E402
from poet_opt.model.zoo import build_model  # noqa: E402


def export_for_training(module, shape, path, **kwargs):
    """The TorchScript exporter in training mode keeps batch norm as an operator (eval mode folds it
    into the conv, which is not the network being trained)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(shape),), str(path), dynamo=False, external_data=False,
                          training=torch.onnx.TrainingMode.TRAINING, input_names=["x"], **kwargs)


def signature(graph):
    return [(n.name, n.kind, n.op, n.bytes, n.deps, n.param_bytes) for n in graph.nodes]


@pytest.fixture(scope="module")
def resnet18():
    return torch_models.resnet18()


def test_resnet18_same_graph_from_torch_and_onnx(resnet18, tmp_path):
    path = tmp_path / "resnet18.onnx"
    export_for_training(resnet18, (2, 3, 32, 32), path)
    from_onnx = import_onnx(path, trainable="last:3")
    from_torch = import_torch(resnet18, (2, 3, 32, 32), trainable="last:3")
    assert len(from_onnx) == len(from_torch)
    assert sum(n.bytes for n in from_onnx.nodes) == sum(n.bytes for n in from_torch.nodes)
    assert signature(from_onnx) == signature(from_torch)
    assert [n.flops for n in from_onnx.nodes] == pytest.approx([n.flops for n in from_torch.nodes])
    # and the zoo's, batch of two included
    assert signature(from_onnx) == signature(build_model("resnet18-cifar", batch_size=2, trainable="last:3"))


def test_inverted_residual_same_graph_from_torch_and_onnx(tmp_path):
    """MobileNetV2's block: depthwise conv, ReLU6 (an ONNX Clip) and the residual add (the whole
    network exports the same way, only slower)."""
    module = torch.nn.Sequential(torch_models.InvertedResidual(16, 16, 1, 6), torch_models.InvertedResidual(16, 24, 2, 6))
    path = tmp_path / "block.onnx"
    export_for_training(module, (2, 16, 16, 16), path)
    graph = import_onnx(path)
    assert signature(graph) == signature(import_torch(module, (2, 16, 16, 16)))
    assert [n.op for n in graph.nodes].count("relu6") == 4


def test_transformer_block_with_the_onnx_attention_operator(tmp_path):
    """Opset 23 has an Attention operator; the dynamo exporter (onnxscript) emits it for
    scaled_dot_product_attention, so the ONNX graph has the same fused node as the torch one."""
    pytest.importorskip("onnxscript")
    module = torch_models.EncoderBlock(d_model=64, heads=4, d_ff=256).eval()
    path = tmp_path / "block.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(1, 16, 64),), str(path), dynamo=True, opset_version=23,
                          external_data=False, verbose=False)
    from_onnx, from_torch = import_onnx(path), import_torch(module, (1, 16, 64))
    assert signature(from_onnx) == signature(from_torch)
    attention = [n for n in from_onnx.nodes if n.op == "attention"]
    assert len(attention) == 1
    assert attention[0].flops == pytest.approx(next(n.flops for n in from_torch.nodes if n.op == "attention"))
    # the TorchScript exporter spells attention out: two scalings, scores, softmax, context
    legacy_path = tmp_path / "block_legacy.onnx"
    export_for_training(module, (1, 16, 64), legacy_path)
    legacy = import_onnx(legacy_path)
    forward = [n for n in legacy.nodes if n.kind == "forward"]
    assert [n.op for n in forward].count("matmul") == 2 and len(legacy) == len(from_torch) + 2 * 4
    assert next(n for n in forward if n.op == "softmax").bytes == 1 * 4 * 16 * 16 * 4  # the scores exist here


def test_symbolic_input_needs_a_shape_and_the_error_names_the_tensor(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    path = tmp_path / "dynamic.onnx"
    export_for_training(module, (1, 8), path, dynamic_axes={"x": {0: "batch"}})
    with pytest.raises(PoetError) as err:
        import_onnx(path)
    assert "'x'" in str(err.value) and "--input-shape" in str(err.value)
    graph = import_onnx(path, input_shape="4,8")
    assert graph.nodes[0].bytes == 4 * 8 * 4 and [n.op for n in graph.nodes if n.kind == "forward"] == \
        ["input", "linear", "relu", "linear"]


def test_unsupported_onnx_operator_and_cli_errors(tmp_path):
    class Cumsum(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(x * 2.0, 1)

    path = tmp_path / "cumsum.onnx"
    export_for_training(Cumsum(), (1, 4), path)
    with pytest.raises(PoetError) as err:
        import_onnx(path)
    assert "'CumSum'" in str(err.value) and "--costs" in str(err.value)
    runner = CliRunner()
    base = ["solve", "--device", "rpi4", "--ram", "1MB"]
    result = runner.invoke(main, base + ["--onnx", str(tmp_path / "missing.onnx")])
    assert result.exit_code == 2 and "no such ONNX file" in result.output
    (tmp_path / "junk.onnx").write_bytes(b"\x00not a model")
    result = runner.invoke(main, base + ["--onnx", str(tmp_path / "junk.onnx")])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1


def test_a_tensor_shape_inference_cannot_follow_is_named(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"], name="relu"),
         helper.make_node("Mystery", ["a"], ["b"], name="mystery", domain="vendor.ops"),
         helper.make_node("Relu", ["b"], ["y"], name="relu2")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("vendor.ops", 1)])
    path = tmp_path / "mystery.onnx"
    onnx.save(model, str(path))
    with pytest.raises(PoetError) as err:
        import_onnx(path)
    assert "tensor 'b'" in str(err.value) and "Mystery" in str(err.value)
