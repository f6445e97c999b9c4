"""Operators that route tensors rather than compute: the graph's input, the sum of two branches,
the concat that joins weight slices, a copy PyTorch makes of a non-contiguous tensor, and the
``param`` nodes that hold streamed weights (docs/streaming.md)."""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, register

register(
    OpSpec("input", "structure", "elementwise", arity=0, tilings=("strips", "rows"),
           doc="the batch; a strip is its rows, a row block its tokens"),
    OpSpec("add", "structure", "elementwise", "", 1, torch_functions=("add", "iadd", "radd"), onnx=("Add",),
           torch_forward=lambda t, a, b: t.add(a, b), c_forward="poet_add_forward", c_backward="poet_accumulate",
           c_convention="elementwise", arity=2, doc="two tensors of one shape (a residual connection)"),
    OpSpec("concat", "structure", "channels", "", 1, torch_functions=("cat", "concat", "concatenate", "stack"),
           onnx=("Concat",), torch_forward=lambda t, *xs: t.cat(xs, dim=1), arity=-1, tilings=("strips", "slices"),
           c_forward="poet_copy_strided", c_backward="poet_accumulate_strided",
           doc="along channels, as weight slices join; strips go strip by strip"),
    OpSpec("copy", "structure", "whole", "", 0, torch_forward=lambda t, x: x.clone(), c_forward="poet_copy",
           c_backward="poet_accumulate", c_convention="elementwise",
           doc="a reshape PyTorch had to copy (non-contiguous input)"),
    OpSpec("param", "structure", "whole", arity=0,
           doc="a layer's streamed weights (or optimizer state), read from storage"),
)
