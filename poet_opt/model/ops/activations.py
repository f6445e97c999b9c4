"""Activations and plain math: one output element from the same element of the input.

FLOPs per element and what the backward reads are as PyTorch's autograd saves them (relu keeps its
output, gelu its input, ...). Plain math (exp, log, ...) is how custom layers and older ONNX opsets
(GELU through Erf) spell activations. SiLU and hardswish (MobileNetV3, EfficientNet) were added
through this registry alone, with their C kernels: docs/architecture.md, "Adding an operator"; so
were tanh's (BERT's pooler, in the firmware's row tiles).
"""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, register


def _act(name, per, saves, modules=(), functions=(), onnx=(), forward=None, backward=None, c=False, doc="",
         split="elementwise", call_backward=None):
    return OpSpec(name, "activations", split, saves, per, torch_modules=modules, torch_functions=functions,
                  onnx=onnx, torch_forward=forward, torch_backward=backward, torch_backward_call=call_backward,
                  c_forward=f"poet_{name}_forward" if c else None, c_backward=f"poet_{name}_backward" if c else None,
                  c_convention="elementwise" if c else "own", doc=doc)


def _aten(torch):
    return torch.ops.aten


def _elu_backward(t, g, y, fn, arguments):
    """torch's own ELU backward from the output (as autograd runs it for an in-place ELU)."""
    return _aten(t).elu_backward(g, float(arguments.get("alpha", 1.0)), 1, 1, True, y)


def _sqrt_backward(t, g, y, fn, arguments):
    """autograd's formulas: d sqrt(x) = g / (2 sqrt(x)); d rsqrt(x) = -g rsqrt(x)^3 / 2."""
    return -0.5 * g * y.pow(3) if fn == "rsqrt" else g / (2 * y)


register(
    _act("relu", 1, "out", ("ReLU",), ("relu", "relu_"), ("Relu",), lambda t, x: t.relu(x),
         lambda t, g, y: _aten(t).threshold_backward(g, y, 0), c=True),
    _act("relu6", 2, "in", ("ReLU6",), ("relu6",), (), lambda t, x: t.nn.functional.relu6(x), c=True,
         doc="ONNX: Clip(0, 6)"),
    _act("leaky_relu", 2, "in", ("LeakyReLU",), ("leaky_relu",), ("LeakyRelu",),
         doc="the reference uses the default slope 0.01; the executor runs the traced module's own"),
    _act("gelu", 5, "in", ("GELU",), ("gelu",), ("Gelu",), lambda t, x: t.nn.functional.gelu(x), c=True,
         doc="exact (erf); the firmware refuses approximate='tanh'"),
    _act("tanh", 5, "out", ("Tanh",), ("tanh", "tanh_"), ("Tanh",), lambda t, x: t.tanh(x),
         lambda t, g, y: _aten(t).tanh_backward(g, y), c=True, doc="BERT's pooler"),
    _act("sigmoid", 4, "out", ("Sigmoid",), ("sigmoid", "sigmoid_"), ("Sigmoid",), lambda t, x: t.sigmoid(x),
         lambda t, g, y: _aten(t).sigmoid_backward(g, y)),
    _act("silu", 5, "in", ("SiLU",), ("silu",), ("Swish",), lambda t, x: t.nn.functional.silu(x), c=True,
         doc="x * sigmoid(x), MobileNetV3's and EfficientNet's swish; ONNX: Swish (opset 24), or Sigmoid then Mul "
             "as torch's exporter writes it"),
    _act("hardswish", 5, "in", ("Hardswish",), ("hardswish",), ("HardSwish",),
         lambda t, x: t.nn.functional.hardswish(x), c=True, doc="x * relu6(x + 3) / 6 (MobileNetV3)"),
    _act("hardsigmoid", 3, "in", ("Hardsigmoid",), ("hardsigmoid",), ("HardSigmoid",),
         lambda t, x: t.nn.functional.hardsigmoid(x)),
    _act("elu", 5, "out", ("ELU",), ("elu",), ("Elu",), call_backward=_elu_backward,
         doc="its backward from the output needs alpha, which only the traced call has (the executor, whole)"),
    # plain math
    _act("exp", 4, "out", (), ("exp", "exp_"), ("Exp",), lambda t, x: t.exp(x), lambda t, g, y: g * y),
    _act("log", 4, "in", (), ("log",), ("Log",), lambda t, x: t.log(x)),
    _act("sqrt", 2, "out", (), ("sqrt", "rsqrt"), ("Sqrt",), call_backward=_sqrt_backward,
         doc="rsqrt is counted as sqrt; its backward from the output differs, so only the traced call "
             "(the executor, whole) replays it"),
    _act("erf", 5, "in", (), ("erf",), ("Erf",), lambda t, x: t.erf(x)),
    _act("pow", 4, "in", (), ("pow",), ("Pow",), doc="the exponent is a constant of the traced node"),
    _act("neg", 1, "", (), ("neg",), ("Neg",), lambda t, x: t.neg(x)),
    _act("abs", 1, "in", (), ("abs",), ("Abs",), lambda t, x: t.abs(x)),
    _act("reciprocal", 1, "out", (), ("reciprocal",), ("Reciprocal",), lambda t, x: t.reciprocal(x),
         lambda t, g, y: -g * y * y),
    _act("clip", 2, "in", (), ("clamp", "clip"), doc="ONNX Clip with bounds other than (0, 6); torch.clamp, whose "
         "bounds only the traced call has (the executor, whole)"),
)

# Arithmetic of two tensors: they may broadcast (a scale per channel), so no piece of one operand
# is known to meet the same piece of the other: never split. A product reads the other operand.
# A quotient's gradient into its divisor, -a / b^2, reads both operands.
register(*(OpSpec(name, "activations", "whole", saves, 1, torch_functions=fns, onnx=(onnx,), arity=2, doc=doc)
           for name, saves, fns, onnx, doc in (
               ("sub", "", ("sub", "isub", "rsub"), "Sub", ""),
               ("mul", "other", ("mul", "imul", "rmul"), "Mul",
                "'' when one operand is a constant; a square x * x reads its input"),
               ("div", "in", ("div", "truediv", "itruediv"), "Div", "'' when the divisor is a constant"))))
