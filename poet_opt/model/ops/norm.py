"""Normalisations: 5 FLOPs per element (mean, variance, normalise, scale, shift); the backward
reads the input. Over pieces, statistics are chained: batch norm over strips (model/strips.py),
layer norm over feature pieces (model/rows.py)."""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, register

register(
    OpSpec("batchnorm", "norm", "reduction", "in", 5, torch_modules=("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"),
           torch_functions=("batch_norm",), onnx=("BatchNormalization",), c_forward="poet_batchnorm_forward",
           c_backward="poet_batchnorm_backward", tilings=("strips",)),
    OpSpec("layernorm", "norm", "reduction", "in", 5, torch_modules=("LayerNorm",), torch_functions=("layer_norm",),
           onnx=("LayerNormalization",), c_forward="poet_layernorm_forward", c_backward="poet_layernorm_backward",
           tilings=("rows",)),
    OpSpec("groupnorm", "norm", "reduction", "in", 5, torch_modules=("GroupNorm",), torch_functions=("group_norm",),
           onnx=("GroupNormalization",)),
    OpSpec("instancenorm", "norm", "reduction", "in", 5,
           torch_modules=("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"), torch_functions=("instance_norm",),
           onnx=("InstanceNormalization",)),
)
