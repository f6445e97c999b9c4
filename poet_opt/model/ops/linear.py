"""Layers that map each token's features through a weight matrix: linear and embedding (a
gather of table rows). Both slice over output features (model/tiling.py) and go row block by
row block (model/rows.py)."""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, register

register(
    OpSpec("linear", "linear", "tokenwise", "", flop_rule="2 x output elements x input features",
           torch_modules=("Linear",), torch_functions=("linear",), onnx=("Gemm",),
           c_forward="poet_linear_forward", c_backward="poet_linear_backward_input", tilings=("rows", "slices"),
           doc="ONNX MatMul by a weight (plus its bias Add) is one linear too"),
    OpSpec("embedding", "linear", "tokenwise", "", 1, torch_modules=("Embedding",), torch_functions=("embedding",),
           c_forward="poet_embedding_forward", c_backward="poet_embedding_backward_params",
           tilings=("rows", "slices"), doc="ONNX Gather of a weight"),
)
