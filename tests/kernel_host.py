"""ctypes view of the reference C kernels (poet_opt/firmware/kernels) built for the host, for
tests/test_kernels.py: the prototypes of poet_kernels.h, the geometry structs, and pointer helpers
for NumPy arrays."""

from __future__ import annotations

import ctypes as C
from pathlib import Path

import numpy as np

F = C.POINTER(C.c_float)
I32 = C.POINTER(C.c_int32)
U = C.c_uint32
FL = C.c_float


class ConvShape(C.Structure):
    _fields_ = [(name, U) for name in ("n", "c_in", "h_in", "w_in", "c_out", "h_out", "w_out", "k_h", "k_w",
                                       "stride_h", "stride_w", "pad_h", "pad_w", "groups")]


class PoolShape(C.Structure):
    _fields_ = [(name, U) for name in ("n", "c", "h_in", "w_in", "h_out", "w_out", "k_h", "k_w", "stride_h",
                                       "stride_w", "pad_h", "pad_w")]


class BatchNormShape(C.Structure):
    _fields_ = [("n", U), ("c", U), ("spatial", U), ("eps", FL), ("momentum", FL)]


class AdamConfig(C.Structure):
    _fields_ = [("lr", FL), ("beta1", FL), ("beta2", FL), ("eps", FL)]


CONV = C.POINTER(ConvShape)
POOL = C.POINTER(PoolShape)
BN = C.POINTER(BatchNormShape)

# name -> (restype, argtypes), as declared in poet_kernels.h
PROTOTYPES = {
    **{f"poet_{f}": (FL, [FL]) for f in ("expf", "expm1f", "logf", "log1pf", "sqrtf", "erff", "erfcf")},
    "poet_zero": (None, [F, U]),
    "poet_copy": (None, [F, F, U]),
    "poet_accumulate": (None, [F, F, U]),
    "poet_add_forward": (None, [F, F, F, U]),
    "poet_add_backward": (None, [F, F, F, U]),
    "poet_relu_forward": (None, [F, F, U]),
    "poet_relu_backward": (None, [F, F, F, U]),
    "poet_relu6_forward": (None, [F, F, U]),
    "poet_relu6_backward": (None, [F, F, F, U]),
    "poet_gelu_forward": (None, [F, F, U]),
    "poet_gelu_backward": (None, [F, F, F, U]),
    "poet_silu_forward": (None, [F, F, U]),
    "poet_silu_backward": (None, [F, F, F, U]),
    "poet_hardswish_forward": (None, [F, F, U]),
    "poet_hardswish_backward": (None, [F, F, F, U]),
    "poet_tanh_forward": (None, [F, F, U]),
    "poet_tanh_backward": (None, [F, F, F, U]),
    "poet_linear_forward": (None, [F, F, F, F, U, U, U]),
    "poet_linear_backward_input": (None, [F, F, F, U, U, U]),
    "poet_linear_backward_input_set": (None, [F, F, F, U, U, U]),
    "poet_linear_backward_params": (None, [F, F, F, F, U, U, U]),
    "poet_matmul_forward": (None, [F, F, F, U, U, U, U]),
    "poet_matmul_backward_a": (None, [F, F, F, U, U, U, U]),
    "poet_matmul_backward_b": (None, [F, F, F, U, U, U, U]),
    "poet_softmax_forward": (None, [F, F, U, U]),
    "poet_softmax_backward": (None, [F, F, F, U, U]),
    "poet_cross_entropy_forward": (None, [F, F, I32, U, U]),
    "poet_cross_entropy_backward": (None, [F, F, I32, U, U]),
    "poet_sgd_step": (None, [F, F, U, FL]),
    "poet_embedding_forward": (None, [F, I32, F, U, U, U, U]),
    "poet_embedding_backward_params": (None, [F, F, I32, U, U, U, U]),
    "poet_embedding_backward_params_sgd": (None, [F, F, I32, U, U, U, U, FL]),
    "poet_adam_step": (None, [F, F, F, F, U, C.POINTER(AdamConfig), U]),
    "poet_conv2d_shape_ok": (C.c_int, [CONV]),
    "poet_conv2d_forward": (None, [F, F, F, F, CONV]),
    "poet_conv2d_backward_input": (None, [F, F, F, CONV]),
    "poet_conv2d_backward_input_set": (None, [F, F, F, CONV]),
    "poet_conv2d_backward_params": (None, [F, F, F, F, CONV]),
    "poet_pool2d_shape_ok": (C.c_int, [POOL]),
    "poet_maxpool2d_forward": (None, [F, F, POOL]),
    "poet_maxpool2d_backward": (None, [F, F, F, POOL]),
    "poet_avgpool2d_forward": (None, [F, F, POOL]),
    "poet_avgpool2d_backward": (None, [F, F, POOL]),
    "poet_global_avgpool_forward": (None, [F, F, U, U]),
    "poet_global_avgpool_backward": (None, [F, F, U, U]),
    "poet_batchnorm_forward": (None, [F, F, F, F, F, F, F, F, BN]),
    "poet_batchnorm_backward": (None, [F, F, F, F, F, F, F, F, BN]),
    "poet_batchnorm_eval_forward": (None, [F, F, F, F, F, F, U, U, U, FL]),
    "poet_layernorm_forward": (None, [F, F, F, F, F, F, U, U, FL]),
    "poet_layernorm_backward": (None, [F, F, F, F, F, F, F, F, U, U]),
    "poet_gemm": (None, [F, U, F, U, U, F, U, U, U, U, U, FL]),
    "poet_layernorm_rows_stats": (None, [F, F, F, U, U, U]),
    "poet_layernorm_rows_forward": (None, [F, F, F, F, F, U, U, U, FL]),
    "poet_layernorm_rows_grad_stats": (None, [F, F, F, F, F, F, U, U, U, FL]),
    "poet_layernorm_rows_backward": (None, [F, F, F, F, F, F, U, U, U, FL]),
    "poet_layernorm_rows_backward_params": (None, [F, F, F, F, F, U, U, U, FL]),
    "poet_rows_mean_forward": (None, [F, F, U, U, U, U]),
    "poet_rows_mean_backward": (None, [F, F, U, U, U, U]),
}


class Kernels:
    """The library's functions by their name without the poet_ prefix: `k.conv2d_forward(...)`."""

    def __init__(self, path: Path):
        self.lib = C.CDLL(str(path))
        for name, (restype, argtypes) in PROTOTYPES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    def __getattr__(self, name: str):
        return getattr(self.lib, f"poet_{name}")


def ptr(a: np.ndarray | None):
    """A float* into the array's own memory (so the kernel's writes land in it), or NULL."""
    if a is None:
        return None
    assert a.dtype == np.float32 and a.flags.c_contiguous, (a.dtype, a.flags)
    return a.ctypes.data_as(F)


def iptr(a: np.ndarray):
    assert a.dtype == np.int32 and a.flags.c_contiguous
    return a.ctypes.data_as(I32)


def out_size(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def conv_shape(n, c_in, h, w, c_out, k, stride, pad, groups) -> ConvShape:
    (kh, kw), (sh, sw), (ph, pw) = k, stride, pad
    return ConvShape(n, c_in, h, w, c_out, out_size(h, kh, sh, ph), out_size(w, kw, sw, pw), kh, kw, sh, sw, ph, pw,
                     groups)


def pool_shape(n, c, h, w, k, stride, pad) -> PoolShape:
    (kh, kw), (sh, sw), (ph, pw) = k, stride, pad
    return PoolShape(n, c, h, w, out_size(h, kh, sh, ph), out_size(w, kw, sw, pw), kh, kw, sh, sw, ph, pw)
