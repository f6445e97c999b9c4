"""Pooling: a window along H (max, average), or the whole plane (global average pooling, the
executed form of an adaptive pooling to 1 x 1)."""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, register

register(
    OpSpec("maxpool", "pool", "window", "in", flop_rule="output elements x window (adaptive: input elements)",
           torch_modules=("MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d"),
           torch_functions=("max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool2d", "amax", "max"),
           onnx=("MaxPool", "GlobalMaxPool", "ReduceMax"), c_forward="poet_maxpool2d_forward",
           c_backward="poet_maxpool2d_backward"),
    OpSpec("avgpool", "pool", "window", "", flop_rule="output elements x window (adaptive, mean: input elements)",
           torch_modules=("AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
                          "AdaptiveAvgPool3d"),
           torch_functions=("avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "mean", "sum"),
           onnx=("AveragePool", "GlobalAveragePool", "ReduceMean"), c_forward="poet_avgpool2d_forward",
           c_backward="poet_avgpool2d_backward", tilings=("strips", "rows"),
           doc="global pooling is avgpool to (C,) in the zoo's graphs; of (tokens, features), the mean over tokens"),
    OpSpec("global_avgpool", "pool", "reduction", "", flop_rule="input elements", tilings=("strips",),
           c_forward="poet_global_avgpool_forward", c_backward="poet_global_avgpool_backward",
           doc="the executed form of a pooling to 1 x 1; over strips it sums strip by strip"),
)
