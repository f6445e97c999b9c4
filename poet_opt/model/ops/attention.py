"""Attention's pieces: products of two activations, softmax over the last axis, and PyTorch's
fused scaled-dot-product attention (costed whole)."""

from __future__ import annotations

from poet_opt.model.ops import OpSpec, register


def _softmax_backward(t, g, y):
    return t.ops.aten._softmax_backward_data(g, y, y.dim() - 1, g.dtype)


def _log_softmax_backward(t, g, y):
    return t.ops.aten._log_softmax_backward_data(g, y, y.dim() - 1, g.dtype)


register(
    OpSpec("matmul", "attention", "tokenwise", "other", flop_rule="2 x output elements x inner dimension",
           torch_functions=("matmul", "bmm", "mm"), onnx=("MatMul",), c_forward="poet_matmul_forward",
           c_backward="poet_matmul_backward_a", arity=2,
           doc="attention's scores and context; row tiles cut it by head and row block"),
    OpSpec("softmax", "attention", "tokenwise", "out", 5, torch_modules=("Softmax",), torch_functions=("softmax",),
           onnx=("Softmax",), torch_forward=lambda t, x: t.softmax(x, -1), torch_backward=_softmax_backward,
           c_forward="poet_softmax_forward", c_backward="poet_softmax_backward", doc="over the last axis"),
    OpSpec("log_softmax", "attention", "tokenwise", "out", 5, torch_modules=("LogSoftmax",),
           torch_functions=("log_softmax",), onnx=("LogSoftmax",), torch_forward=lambda t, x: t.log_softmax(x, -1),
           torch_backward=_log_softmax_backward, tilings=(), doc="over the last axis"),
    OpSpec("attention", "attention", "whole", "in+out",
           flop_rule="2 x batch-heads x seq_q x seq_k x (d_qk + d_v) + 5 x batch-heads x seq_q x seq_k",
           torch_functions=("scaled_dot_product_attention",), onnx=("Attention",), arity=3,
           doc="flash attention keeps q, k, v and its output"),
)
