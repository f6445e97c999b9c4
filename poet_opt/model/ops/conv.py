"""Convolutions. Only the 2-d one has kernels and a window along H; 1-d and 3-d are costed."""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, register

_RULE = "2 x output elements x (input channels / groups) x kernel elements"

register(
    OpSpec("conv2d", "conv", "window", "", flop_rule=_RULE, torch_modules=("Conv2d",), torch_functions=("conv2d",),
           onnx=("Conv",), c_forward="poet_conv2d_forward", c_backward="poet_conv2d_backward_input",
           tilings=("strips", "slices"), doc="ONNX Conv becomes conv1d/2d/3d by its weight's rank"),
    OpSpec("conv1d", "conv", "whole", "", flop_rule=_RULE, torch_modules=("Conv1d",), torch_functions=("conv1d",)),
    OpSpec("conv3d", "conv", "whole", "", flop_rule=_RULE, torch_modules=("Conv3d",), torch_functions=("conv3d",)),
)
