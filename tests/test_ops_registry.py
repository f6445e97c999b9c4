"""The operator registry (poet_opt/model/ops): one entry per operator, one answer per PyTorch or
ONNX name, and the graphs built from it unchanged from before the registry replaced the tables.

The digests below were taken on main before the zoo, the importers, strips and rows read the
registry (node id, name, kind, bytes, deps, FLOPs, op, parameter bytes, trainable, updates,
writes): a change to an operator's FLOP rule or backward reads changes them, and must be meant."""

from __future__ import annotations

import hashlib

import pytest

from poet_opt.model import ops
from poet_opt.model.zoo import build_model


def digest(graph) -> str:
    rows = [(n.id, n.name, n.kind, n.bytes, n.deps, n.flops, n.op, n.param_bytes, n.trainable, n.updates,
             n.writes_bytes) for n in graph.nodes]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


# (model, build options) -> digest on main at 6bf2859; the three strip graphs since the strip builder
# marks a trained layer's forward nodes trainable, as the unstripped zoo graphs do (compared node by
# node with 0cd6c38: only those flags changed)
ZOO = {
    ("mlp", ()): "e478b2481dd8ce22",
    ("mlp-residual", (("weights", "streamed"),)): "3629bbb52c2e8b4f",
    ("resnet18-cifar", ()): "799637c81087cc49",
    ("resnet18-cifar", (("weights", "streamed"), ("strips", 4))): "06b9d2fd826f226a",
    ("mcu-vww", (("weights", "streamed"), ("strips", 3), ("tile_bytes", 2048))): "1694b37754b3e472",
    ("mobilenetv2", (("weights", "streamed"), ("strips", 2), ("input_shape", "3x64x64"))): "dd18d3832fe89db8",
    ("vgg16-cifar", (("weights", "streamed"),)): "baef8ccdcf13f2cb",
    ("transformer-block", (("weights", "streamed"), ("input_shape", "16"),
                           ("rows", (("blocks", 2), ("piece", 256), ("vocab_rows", 4096))))): "5f6dcb75a0527946",
    ("bert-base", ()): "ffe2ab9e3ff93d49",
}


@pytest.mark.parametrize("model,options", list(ZOO), ids=lambda v: v if isinstance(v, str) else "")
def test_zoo_graphs_are_what_they_were_before_the_registry(model, options):
    kw = {k: dict(v) if k == "rows" else v for k, v in options}
    assert digest(build_model(model, **kw)) == ZOO[model, options]


def test_torch_imports_are_what_they_were_before_the_registry():
    pytest.importorskip("torch")
    from poet_opt.model.torch_import import import_torch

    spec = "poet_opt.examples.torch_models:"
    assert digest(import_torch(spec + "resnet18", "1,3,32,32")) == "799637c81087cc49"  # the zoo's, node for node
    assert digest(import_torch(spec + "tiny_cnn", "2,3,32,32")) == "120e3fa3f5eefc44"
    assert digest(import_torch(spec + "transformer_block", "1,16,768")) == "01bbdf1c1450c224"


def test_one_entry_per_operator_and_one_answer_per_name():
    names = [s.name for s in ops.specs()]
    assert len(names) == len(set(names))
    for attr, lookup in (("torch_modules", ops.by_torch_module), ("torch_functions", ops.by_torch_function),
                         ("onnx", ops.by_onnx)):
        for s in ops.specs():
            for n in getattr(s, attr):
                assert lookup(n) is s, (attr, n)
    assert {s.family for s in ops.specs()} == set(ops.FAMILIES)
    with pytest.raises(ValueError, match="registered twice"):
        ops.register(ops.spec("relu"))


def test_elementwise_kernels_follow_one_convention():
    """The generators call c_forward(y, *inputs, n) and c_backward(dx, dy, *saved, n): every
    operator of that convention declares both, and the header declares them."""
    from pathlib import Path

    header = (Path(ops.__file__).resolve().parents[2] / "firmware" / "kernels" / "poet_kernels.h").read_text()
    for s in ops.specs():
        for kernel in (s.c_forward, s.c_backward):
            if kernel:
                assert f"{kernel}(" in header, kernel
        if s.c_convention == "elementwise":
            assert s.c_forward and s.c_backward and s.split in ("elementwise", "whole"), s.name
