"""The tiled convolution and linear kernels computed on the emulated cores themselves, against
PyTorch in float64: the Cortex-M4F and M7F with their FPUs, and the Cortex-M0+, where every float
operation is a compiler-rt call. tests/test_kernels.py checks the same sources built for the host;
this checks what the cross-compiler made of the register tiles (the code paths differ per core:
register allocation, soft-float calls, the M7's FPv5)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("ziglang", "unicorn", "elftools", "torch")),
    reason="needs the emulate and torch extras")

from poet_opt.firmware.build import build_firmware  # noqa: E402
from poet_opt.firmware.emulator import Emulator  # noqa: E402
from poet_opt.firmware.targets import Target  # noqa: E402
from poet_opt.firmware.toolchain import KERNEL_DIR, kernel_sources  # noqa: E402

HARNESS = r"""
#include <stdint.h>
#include "poet_kernels.h"
volatile int32_t op;
poet_conv2d_shape cs;
uint32_t dims[3];
float x[2048], w[2048], b[64], dy[2048];
float y[2048], dx[2048], gw[2048], gb[64], dx_set[2048];
int main(void)
{
    if (op == 0) {
        poet_conv2d_forward(y, x, w, b, &cs);
        poet_conv2d_backward_input(dx, dy, w, &cs);
        poet_conv2d_backward_input_set(dx_set, dy, w, &cs); /* over NaN from the host */
        poet_conv2d_backward_params(gw, gb, dy, x, &cs);
    } else {
        poet_linear_forward(y, x, w, b, dims[0], dims[1], dims[2]);
        poet_linear_backward_input(dx, dy, w, dims[0], dims[1], dims[2]);
        poet_linear_backward_input_set(dx_set, dy, w, dims[0], dims[1], dims[2]);
        poet_linear_backward_params(gw, gb, dy, x, dims[0], dims[1], dims[2]);
    }
    return 0;
}
"""

# n, c_in, h, w, c_out, k, stride, pad (h, w), groups: tile remainders (channels 4 + 1, columns
# 8 + 4 + 1), 3x3 and 1x1 at strides 1 and 2, depthwise, a strip's rows (no padding along H)
CONV = [
    (1, 5, 5, 14, 5, 3, 1, (1, 1), 1),
    (1, 4, 6, 13, 6, 3, 2, (1, 1), 1),
    (1, 3, 5, 21, 3, 3, 1, (1, 1), 3),
    (1, 2, 6, 19, 2, 3, 2, (1, 1), 2),
    (2, 9, 3, 5, 6, 1, 1, (0, 0), 1),
    (1, 8, 7, 9, 5, 1, 2, (0, 0), 1),
    (1, 4, 5, 12, 4, 3, 1, (0, 1), 1),
    # depthwise row walks on small planes: pairs of rows, an odd height at stride 2
    (2, 4, 6, 6, 4, 3, 1, (1, 1), 4),
    (1, 3, 7, 8, 3, 3, 2, (1, 1), 3),
    # pointwise with few inputs (weights in registers), and on a 3x3 plane (its weight gradient)
    (1, 4, 5, 6, 8, 1, 1, (0, 0), 1),
    (2, 8, 3, 3, 8, 1, 1, (0, 0), 1),
    (2, 4, 3, 7, 8, 1, 1, (0, 0), 1),
    (2, 6, 2, 5, 8, 1, 1, (0, 0), 1),
    (1, 8, 2, 5, 12, 1, 1, (0, 0), 1),
    (2, 4, 5, 18, 8, 1, 2, (0, 0), 1),
    # depthwise column strips: stride 1 with 0, 1 and 2 rows after the steps of 3 and an odd width
    # (a last strip of one column); stride 2 with an even height and an odd width (the data
    # gradient's last block without its dx column), and strips of 3 and 4 with remainders
    (1, 2, 5, 7, 2, 3, 1, (1, 1), 2),
    (1, 2, 4, 3, 2, 3, 1, (1, 1), 2),
    (1, 2, 8, 7, 2, 3, 2, (1, 1), 2),
    (1, 2, 9, 13, 2, 3, 2, (1, 1), 2),
    # depthwise strips of rows (the strip executor's windows: padding 0 along H, 1 along W): the
    # window walk (passes of 3 output rows and the 1 or 2 left at stride 1, of 2 and the 1 left at
    # stride 2, 4 rows at stride 2 in one pass, in steps of 4 and 2 columns; a batch of 2), the
    # column strips of the written data gradient at stride 1 (padding 2 turned around) and 2 (an
    # odd and an even height: dx row 0 alone, a last row read by no window)
    (1, 4, 5, 6, 4, 3, 1, (0, 1), 4),
    (2, 3, 6, 7, 3, 3, 1, (0, 1), 3),
    (1, 2, 7, 5, 2, 3, 1, (0, 1), 2),
    (1, 3, 7, 8, 3, 3, 2, (0, 1), 3),
    (1, 2, 8, 9, 2, 3, 2, (0, 1), 2),
    (1, 2, 9, 24, 2, 3, 2, (0, 1), 2),
    # one input channel to several outputs (the stem): two output channels a walk, and one left
    (1, 1, 9, 10, 5, 3, 2, (1, 1), 1),
    (2, 2, 6, 7, 6, 3, 1, (1, 1), 2),
]
LINEAR = [(5, 13, 11), (1, 33, 6), (1, 7, 3), (1, 9, 2), (1, 13, 4), (1, 6, 1)]  # one row: up to 4 outputs in one pass


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    src = tmp_path_factory.mktemp("harness") / "harness.c"
    src.write_text(HARNESS)
    cache = {}

    def get(core):
        if core not in cache:
            cache[core] = build_firmware([src, *kernel_sources()], Target(core, 128 * 1024),
                                         tmp_path_factory.mktemp(core), include_dirs=[KERNEL_DIR],
                                         cflags=["-fno-math-errno"])
        return cache[core]

    return get


def run(fw, op, arrays, **symbols):
    emu = Emulator(fw)
    emu.write_symbol("op", np.int32(op))
    for name, value in {**arrays, **symbols}.items():
        emu.write_symbol(name, value)
    assert emu.run(max_instructions=200_000_000).exit_code == 0
    out = {name: emu.read_symbol(name, np.float32) for name in ("y", "dx", "gw", "gb", "dx_set")}
    emu.close()
    return out


def close(got, want):
    want = want.detach().numpy().ravel()
    err = np.abs(got[:want.size] - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= 1e-5, err


@pytest.mark.parametrize("core", ["cortex-m4f", "cortex-m7f", "cortex-m0plus"])
@pytest.mark.parametrize("case", range(len(CONV)))
def test_conv_on_the_core_equals_torch(builds, core, case):
    import torch

    n, c_in, h, w, c_out, k, stride, pad, groups = CONV[case]
    rng = np.random.default_rng(case)
    x = torch.tensor(rng.standard_normal((n, c_in, h, w)), requires_grad=True)
    wt = torch.tensor(rng.standard_normal((c_out, c_in // groups, k, k)) * 0.5, requires_grad=True)
    b = torch.tensor(rng.standard_normal(c_out), requires_grad=True)
    x32, w32, b32 = (t.detach().float().double().requires_grad_() for t in (x, wt, b))  # float32 values
    y = torch.nn.functional.conv2d(x32, w32, b32, stride=stride, padding=pad, groups=groups)
    dy = torch.tensor(rng.standard_normal(y.shape)).float().double()
    y.backward(dy)
    shape = np.array([n, c_in, h, w, c_out, y.shape[2], y.shape[3], k, k, stride, stride, *pad, groups], np.uint32)
    zeros = np.zeros(2048, np.float32)
    out = run(builds(core), 0, {"x": x32.detach().numpy().astype(np.float32).ravel(),
                                "w": w32.detach().numpy().astype(np.float32).ravel(),
                                "b": b32.detach().numpy().astype(np.float32), "dy": dy.numpy().astype(np.float32).ravel(),
                                "dx": zeros, "gw": zeros, "gb": zeros[:64],
                                "dx_set": np.full(2048, np.nan, np.float32)}, cs=shape)
    close(out["y"], y)
    close(out["dx"], x32.grad)
    close(out["dx_set"], x32.grad)  # dx = (every element written), not dx +=
    close(out["gw"], w32.grad)
    close(out["gb"], b32.grad)


@pytest.mark.parametrize("core", ["cortex-m4f", "cortex-m7f", "cortex-m0plus"])
@pytest.mark.parametrize("rows,d_in,d_out", LINEAR)
def test_linear_on_the_core_equals_torch(builds, core, rows, d_in, d_out):
    import torch

    rng = np.random.default_rng(rows)
    x = torch.tensor(rng.standard_normal((rows, d_in))).float().double().requires_grad_()
    w = torch.tensor(rng.standard_normal((d_out, d_in))).float().double().requires_grad_()
    b = torch.tensor(rng.standard_normal(d_out)).float().double().requires_grad_()
    y = torch.nn.functional.linear(x, w, b)
    dy = torch.tensor(rng.standard_normal(y.shape)).float().double()
    y.backward(dy)
    zeros = np.zeros(2048, np.float32)
    out = run(builds(core), 1, {"x": x.detach().numpy().astype(np.float32).ravel(),
                                "w": w.detach().numpy().astype(np.float32).ravel(),
                                "b": b.detach().numpy().astype(np.float32), "dy": dy.numpy().astype(np.float32).ravel(),
                                "dx": zeros, "gw": zeros, "gb": zeros[:64],
                                "dx_set": np.full(2048, np.nan, np.float32)},
              dims=np.array([rows, d_in, d_out], np.uint32))
    close(out["y"], y)
    close(out["dx"], x.grad)
    close(out["dx_set"], x.grad)
    close(out["gw"], w.grad)
    close(out["gb"], b.grad)
