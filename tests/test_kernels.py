"""The reference C kernels (poet_opt/firmware/kernels) against PyTorch autograd.

The kernels are built for the host with zig cc under the strict flags they promise
(-std=c99 -Wall -Wextra -Werror -pedantic), loaded with ctypes, and every forward and every
backward is compared with torch in float64 on the same float32 inputs, so the reference carries no
rounding of its own: the error measured is the kernel's. Backward kernels accumulate, so each
gradient buffer starts out holding random values and must end at those plus the gradient. That the
same sources cross-compile for every Cortex-M and reference no library the firmware link lacks is
tests/test_kernels_cross_compile.py. The largest error per operator is printed at the end of the
module.
"""

from __future__ import annotations

import ctypes as C
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_host import (
    AdamConfig,
    BatchNormShape,
    Kernels,
    conv_shape,
    iptr,
    pool_shape,
    ptr,
)
from scipy import special

from poet_opt.firmware import toolchain

torch = pytest.importorskip("torch")
Fn = torch.nn.functional

RTOL = 1e-5
ERRORS: dict[str, float] = defaultdict(float)


@pytest.fixture(scope="session")
def k(tmp_path_factory) -> Kernels:
    return Kernels(toolchain.compile_host_library(tmp_path_factory.mktemp("kernels") / "libpoet_kernels.so"))


@pytest.fixture(scope="session")
def k_soft_sqrt(tmp_path_factory) -> Kernels:
    """The build a core without an FPU gets: the integer square root instead of the instruction."""
    out = tmp_path_factory.mktemp("kernels_soft") / "libpoet_kernels_soft.so"
    return Kernels(toolchain.compile_host_library(out, extra_flags=("-DPOET_SOFT_SQRT",)))


@pytest.fixture(scope="module", autouse=True)
def error_report(request):
    yield
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not ERRORS:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line("reference kernels: max error against torch float64 (relative to the largest "
                            "reference magnitude; maths functions in ulp)")
        for op in sorted(ERRORS):
            reporter.write_line(f"  {op:34s} {ERRORS[op]:.2e}")


def check(op: str, actual, expected, rtol: float = RTOL) -> None:
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected.shape, (op, actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    err = float(np.abs(actual - expected).max(initial=0.0)) / scale
    ERRORS[op] = max(ERRORS[op], err)
    print(f"{op}: max relative error {err:.2e}")
    assert err <= rtol, f"{op}: max relative error {err:.2e} > {rtol:.0e}"


def rand(rng, *shape, scale=1.0, offset=0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


def t64(a: np.ndarray, grad: bool = False):
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def grad_of(t):
    return t.grad.detach().numpy()


# ---- maths ----

def ulp_error(fn, xs: np.ndarray, ref: np.ndarray) -> float:
    """Largest error in units of the last place of the float32 result; a reference beyond float32's
    range must come out as the infinity it rounds to."""
    got = np.array([fn(float(x)) for x in xs], dtype=np.float64)
    with np.errstate(over="ignore"):
        ref32 = ref.astype(np.float32)
    same = (got == ref32) | (np.isnan(got) & np.isnan(ref))
    with np.errstate(invalid="ignore"):
        ulps = np.abs(got - ref) / np.spacing(np.abs(ref32)).astype(np.float64)
    return float(np.where(same, 0.0, np.where(np.isfinite(ref32), ulps, np.inf)).max())


def float_grid(rng, lo, hi, n):
    return np.unique(np.concatenate([rng.uniform(lo, hi, n), np.linspace(lo, hi, 101)]).astype(np.float32))


def positive_floats(rng, n):
    """Random bit patterns over every positive finite float, subnormals included."""
    return np.unique(rng.integers(1, 0x7F800000, n, dtype=np.uint32).view(np.float32))


def tiny_both_signs(lo=-30, hi=-2, n=200):
    t = np.logspace(lo, hi, n)
    return np.concatenate([t, -t]).astype(np.float32)


MATH_CASES = {
    "expf": (lambda rng: float_grid(rng, -104.0, 89.0, 20000), np.exp, 1.0),
    "expm1f": (lambda rng: np.concatenate([float_grid(rng, -20.0, 20.0, 10000), tiny_both_signs()]), np.expm1, 3.0),
    "logf": (lambda rng: positive_floats(rng, 20000), np.log, 1.0),
    "log1pf": (lambda rng: np.concatenate([float_grid(rng, -0.999, 10.0, 10000), tiny_both_signs(-30, -1)]),
               np.log1p, 3.0),
    "erff": (lambda rng: np.concatenate([float_grid(rng, -7.0, 7.0, 20000), tiny_both_signs()]), special.erf, 1.0),
    "erfcf": (lambda rng: np.concatenate([float_grid(rng, -7.0, 11.0, 20000), tiny_both_signs()]), special.erfc,
              3.0),
}


@pytest.mark.parametrize("name", sorted(MATH_CASES))
def test_math_function_within_ulps(k, name):
    make, ref_fn, max_ulp = MATH_CASES[name]
    xs = make(np.random.default_rng(1))
    err = ulp_error(getattr(k, name), xs, ref_fn(xs.astype(np.float64)))
    ERRORS[f"math {name} (ulp)"] = err
    assert err <= max_ulp, f"{name}: {err:.2f} ulp"


@pytest.mark.parametrize("build", ["hardware", "soft"])
def test_sqrt_is_correctly_rounded(k, k_soft_sqrt, build):
    lib = k if build == "hardware" else k_soft_sqrt
    xs = positive_floats(np.random.default_rng(2), 30000)
    got = np.array([lib.sqrtf(float(x)) for x in xs], dtype=np.float32)
    assert np.array_equal(got, np.sqrt(xs))
    ERRORS[f"math sqrtf {build} (ulp)"] = 0.0


@pytest.mark.parametrize("build", ["hardware", "soft"])
def test_math_special_values(k, k_soft_sqrt, build):
    lib = k if build == "hardware" else k_soft_sqrt
    inf, nan = float("inf"), float("nan")
    expect = {  # (x, f(x)) pairs: a dict would merge 0.0 and -0.0
        "expf": [(inf, inf), (-inf, 0.0), (0.0, 1.0), (89.0, inf), (-104.0, 0.0), (-103.5, np.exp(-103.5))],
        "expm1f": [(inf, inf), (-inf, -1.0), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30)],
        "logf": [(0.0, -inf), (-0.0, -inf), (1.0, 0.0), (inf, inf), (-1.0, nan), (2.0**-149, -149 * np.log(2.0))],
        "log1pf": [(-1.0, -inf), (0.0, 0.0), (-0.0, -0.0), (inf, inf), (-2.0, nan), (1e-30, 1e-30)],
        "sqrtf": [(0.0, 0.0), (-0.0, -0.0), (inf, inf), (-1.0, nan), (-inf, nan), (4.0, 2.0)],
        "erff": [(inf, 1.0), (-inf, -1.0), (0.0, 0.0), (-0.0, -0.0), (10.0, 1.0), (-10.0, -1.0)],
        "erfcf": [(inf, 0.0), (-inf, 2.0), (0.0, 1.0), (30.0, 0.0), (-30.0, 2.0)],
    }
    for name, cases in expect.items():
        fn = getattr(lib, name)
        assert np.isnan(fn(nan)), name
        for x, want in cases:
            got = fn(x)
            if np.isnan(want):
                assert np.isnan(got), (name, x, got)
            else:
                assert got == pytest.approx(float(np.float32(want)), rel=2e-7, abs=0.0), (name, x, got)
                assert np.signbit(got) == np.signbit(want), (name, x, got)


# ---- convolution ----

def run_conv(k, rng, n, c_in, h, w, c_out, kernel, stride, pad, groups, bias, label="conv2d"):
    s = conv_shape(n, c_in, h, w, c_out, kernel, stride, pad, groups)
    assert k.conv2d_shape_ok(C.byref(s))
    x, wt = rand(rng, n, c_in, h, w), rand(rng, c_out, c_in // groups, *kernel, scale=0.5)
    b = rand(rng, c_out) if bias else None
    tx, tw = t64(x, True), t64(wt, True)
    tb = t64(b, True) if bias else None
    ty = Fn.conv2d(tx, tw, tb, stride=stride, padding=pad, groups=groups)
    dy = rand(rng, *ty.shape)
    ty.backward(t64(dy))

    y = np.full(ty.shape, np.nan, np.float32)
    k.conv2d_forward(ptr(y), ptr(x), ptr(wt), ptr(b), C.byref(s))
    check(f"{label} forward", y, ty)

    dx0 = rand(rng, *x.shape)
    dx = dx0.copy()
    k.conv2d_backward_input(ptr(dx), ptr(dy), ptr(wt), C.byref(s))
    check(f"{label} backward input", dx, dx0 + grad_of(tx))
    # the first contribution, written (dx =): over NaN, so an element it does not write shows
    dx = np.full(x.shape, np.nan, np.float32)
    k.conv2d_backward_input_set(ptr(dx), ptr(dy), ptr(wt), C.byref(s))
    check(f"{label} backward input (dx =)", dx, grad_of(tx))

    gw0, gb0 = rand(rng, *wt.shape), rand(rng, c_out)
    gw, gb = gw0.copy(), gb0.copy()
    k.conv2d_backward_params(ptr(gw), ptr(gb) if bias else None, ptr(dy), ptr(x), C.byref(s))
    check(f"{label} backward weight", gw, gw0 + grad_of(tw))
    if bias:
        check(f"{label} backward bias", gb, gb0 + grad_of(tb))
    else:
        assert np.array_equal(gb, gb0)


CONV_CASES = {
    # name: n, c_in, h, w, c_out, kernel, stride, pad, groups, bias
    "dense 3x3 same": (2, 3, 7, 5, 4, (3, 3), (1, 1), (1, 1), 1, True),
    "stride 2 padded odd": (2, 4, 7, 5, 6, (3, 3), (2, 2), (1, 1), 1, False),
    "grouped stride 2": (3, 4, 9, 7, 6, (3, 3), (2, 2), (1, 1), 2, True),
    "depthwise": (2, 5, 7, 5, 5, (3, 3), (1, 1), (1, 1), 5, True),
    "depthwise stride 2 multiplier 2": (1, 3, 8, 7, 6, (3, 3), (2, 2), (1, 1), 3, False),
    "pointwise": (2, 6, 5, 3, 4, (1, 1), (1, 1), (0, 0), 1, True),
    "rectangular": (2, 2, 6, 9, 3, (3, 2), (1, 3), (1, 0), 1, True),
    "5x5 stride 3 pad 2": (1, 2, 11, 8, 3, (5, 5), (3, 3), (2, 2), 1, True),
    "padding wider than kernel": (1, 2, 4, 3, 2, (2, 2), (2, 1), (3, 2), 1, True),
    # The kernels' register tiles: 4 channels (here 4 + 4 + 1) by 8, 4, 2 or 1 columns away from
    # the padding, the columns next to it with their own taps; 3x3 and 1x1 at strides 1 and 2 are
    # compiled apart from the general case, and the data gradient runs over classes of columns of
    # the same phase modulo the stride.
    "tiled 3x3 same": (1, 9, 6, 19, 9, (3, 3), (1, 1), (1, 1), 1, True),
    "tiled 3x3 stride 2": (2, 5, 9, 22, 6, (3, 3), (2, 2), (1, 1), 1, False),
    "tiled strip rows (no padding along H)": (1, 8, 5, 14, 4, (3, 3), (1, 1), (0, 1), 1, True),
    "tiled 3x3 unpadded": (1, 4, 6, 13, 5, (3, 3), (1, 1), (0, 0), 1, False),
    "tiled pointwise": (2, 9, 3, 11, 10, (1, 1), (1, 1), (0, 0), 1, True),
    "tiled pointwise stride 2": (1, 8, 7, 13, 5, (1, 1), (2, 2), (0, 0), 1, False),
    "tiled depthwise": (1, 3, 5, 21, 3, (3, 3), (1, 1), (1, 1), 3, True),
    "tiled depthwise stride 2": (1, 2, 6, 37, 2, (3, 3), (2, 2), (1, 1), 2, False),
    "tiled depthwise unpadded": (2, 3, 6, 9, 3, (3, 3), (1, 1), (0, 0), 3, True),
    "tiled depthwise padded 2 and 1": (1, 2, 5, 7, 2, (3, 3), (1, 1), (2, 1), 2, False),
    # the strip executor's depthwise windows (padding 0 along H): R output rows a pass along the
    # columns, 3 and 2 (the rows left) at stride 1, 2 and 1 at stride 2, over a batch of 2
    "tiled depthwise strip rows, 5 output rows": (2, 3, 7, 8, 3, (3, 3), (1, 1), (0, 1), 3, True),
    "tiled depthwise strip rows stride 2, 3 output rows": (2, 3, 7, 11, 3, (3, 3), (2, 2), (0, 1), 3, False),
    # a batch of one: its channels in one call, the sums in registers through a plane's passes
    "tiled depthwise strip rows, 3 output rows, batch 1": (1, 4, 5, 9, 4, (3, 3), (1, 1), (0, 1), 4, True),
    "tiled depthwise strip rows stride 2, 4 output rows, batch 1": (1, 3, 9, 10, 3, (3, 3), (2, 2), (0, 1), 3, False),
    # pointwise layers with 4 or fewer input channels a group, and their remainders
    "tiled pointwise, 3 inputs": (2, 3, 5, 7, 9, (1, 1), (1, 1), (0, 0), 1, True),
    "tiled pointwise, grouped 2 inputs": (1, 4, 4, 5, 8, (1, 1), (1, 1), (0, 0), 2, False),
    "tiled pointwise, 1 input": (1, 1, 3, 3, 4, (1, 1), (1, 1), (0, 0), 1, True),
    "tiled pointwise on a 3x3 plane, batch 2": (2, 8, 3, 3, 8, (1, 1), (1, 1), (0, 0), 1, True),
    "tiled pointwise on a 2x3 plane, grouped": (1, 8, 2, 3, 16, (1, 1), (1, 1), (0, 0), 2, False),
    "tiled pointwise on a 3x7 plane, batch 2": (2, 4, 3, 7, 8, (1, 1), (1, 1), (0, 0), 1, True),
    # pointwise as a matrix product (more than 4 inputs, channels in fours), positions in 4s + 1s
    "tiled pointwise 6 -> 8 on a 2x5 plane, batch 2": (2, 6, 2, 5, 8, (1, 1), (1, 1), (0, 0), 1, True),
    "tiled pointwise 8 -> 12 on a 2x5 plane": (1, 8, 2, 5, 12, (1, 1), (1, 1), (0, 0), 1, False),
    "tiled pointwise stride 2, channels in fours, batch 2": (2, 4, 5, 18, 8, (1, 1), (2, 2), (0, 0), 1, True),
    # the depthwise row walks' edges: odd heights (a last dy row with no dx row after it at
    # stride 2), even widths, pairs of rows, and planes too narrow for the walk (w < 3)
    "tiled depthwise stride 2 odd height": (2, 3, 7, 8, 3, (3, 3), (2, 2), (1, 1), 3, True),
    "tiled depthwise stride 2, 1 x 1 plane": (1, 2, 1, 1, 2, (3, 3), (2, 2), (1, 1), 2, True),
    "tiled depthwise 6 x 6, batch 2": (2, 4, 6, 6, 4, (3, 3), (1, 1), (1, 1), 4, True),
    "tiled depthwise 3 rows by 2 columns": (1, 2, 3, 2, 2, (3, 3), (1, 1), (1, 1), 2, False),
    "tiled depthwise stride 2 on rows, 1 on columns": (1, 2, 7, 6, 2, (3, 3), (2, 1), (1, 1), 2, True),
    "tiled grouped, 4 channels a group": (1, 8, 4, 10, 8, (3, 3), (1, 1), (1, 1), 2, True),
    # one input channel a group and several outputs (mcu-vww's stem): the depthwise walks, two
    # output channels on each input window, and the odd one left over
    "tiled stem, 1 input to 5 outputs, stride 2": (2, 1, 9, 10, 5, (3, 3), (2, 2), (1, 1), 1, True),
    "tiled 1 input a group to 3 outputs, stride 1": (1, 2, 6, 7, 6, (3, 3), (1, 1), (1, 1), 2, True),
    "tiled 5x5 (general path)": (1, 4, 7, 15, 5, (5, 5), (1, 1), (2, 2), 1, True),
    "tiled 3x3 stride 3 (general path)": (1, 5, 8, 20, 4, (3, 3), (3, 3), (1, 1), 1, True),
}


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d(k, case):
    run_conv(k, np.random.default_rng(len(case)), *CONV_CASES[case])


# Depthwise 3x3 layers with padding 1 at stride 1 and 2 run in column strips (forward, data and
# weight gradients): a left strip of 2 columns, strips of 2 (stride 1) or 3 (stride 2), and what
# is left against the right edge; down each strip the first row, steps of 3 (stride 1) or 2 rows,
# 0 to 2 rows left and a last row with or without its bottom row in the padding. The data gradient
# at stride 2 walks strips of 4 dy columns, their remainder, and a last block with or without an
# odd width's dx column, over pairs of dx rows. Heights 2 to 11 and widths 3 to 14 take every one
# of those edges; 1 and 2 wide planes take the row walks.
DEPTHWISE_STRIPS = [(h, w, 1) for h, w in [(2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 3), (8, 8), (9, 9), (10, 14),
                                           (2, 2), (1, 5)]] + \
                   [(h, w, 2) for h, w in [(2, 4), (3, 5), (4, 6), (5, 7), (6, 8), (7, 9), (8, 10), (9, 11), (10, 12),
                                           (11, 13), (2, 14), (3, 3), (1, 6), (6, 1)]]


@pytest.mark.parametrize("h,w,stride", DEPTHWISE_STRIPS)
def test_depthwise_column_strips(k, h, w, stride):
    run_conv(k, np.random.default_rng(h * 100 + w * 10 + stride), 2, 3, h, w, 3, (3, 3), (stride, stride), (1, 1), 3,
             bias=(h + w) % 2 == 0, label=f"depthwise {h}x{w}/{stride}")


# The strip executor's windows: a strip of rows with its halo given, padding 0 along H and 1 along
# W. The window walk takes their forward and weight gradient (passes of 3 output rows and the 1 or
# 2 left at stride 1, of 2 and the 1 left at stride 2, and four rows at stride 2 in one pass, in
# steps of 4 and 2 columns; along every column width's steps and tails), the column strips their
# written data gradient (whose geometry turned around has padding 2 along H at stride 1: the h - 2
# rows in steps of 3 and 0 to 2 left, and the two rows each end with rows in the padding; at
# stride 2 an even and an odd number of output rows, and an even height, its last row read by no
# window). Heights 3 to 12; heights 1 and 2 are too short for a 3-row window.
DEPTHWISE_STRIP_ROWS = [(h, w, 1) for h, w in [(3, 3), (4, 4), (5, 5), (6, 6), (7, 7), (8, 14), (9, 8), (3, 2)]] + \
                       [(h, w, 2) for h, w in [(3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 13), (10, 3),
                                               (11, 14), (12, 1), (9, 24), (10, 19)]]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("h,w,stride", DEPTHWISE_STRIP_ROWS)
def test_depthwise_column_strips_on_a_strip_of_rows(k, h, w, stride, n):
    """(a batch of one takes the window walk's weight gradient over all the channels in one call)"""
    run_conv(k, np.random.default_rng(h * 100 + w * 10 + stride + 5), n, 3, h, w, 3, (3, 3), (stride, stride),
             (0, 1), 3, bias=(h + w) % 2 == 1, label=f"depthwise strip rows {n}x{h}x{w}/{stride}")


@pytest.fixture(scope="session")
def k_small(tmp_path_factory) -> Kernels:
    """The build with only the general tiles, -DPOET_KERNELS_SMALL (the default on Cortex-M0/M0+)."""
    out = tmp_path_factory.mktemp("kernels_small") / "libpoet_kernels_small.so"
    return Kernels(toolchain.compile_host_library(out, extra_flags=("-DPOET_KERNELS_SMALL",)))


@pytest.mark.parametrize("case", [c for c in CONV_CASES if c.startswith("tiled")])
def test_conv2d_small_build(k_small, case):
    """Every layer through the general tiles: the sizes and strides read at run time."""
    run_conv(k_small, np.random.default_rng(len(case)), *CONV_CASES[case], label="conv2d (small build)")


@st.composite
def conv_geometry(draw):
    groups = draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    return {"n": draw(st.integers(1, 2)), "c_in": groups * draw(st.integers(1, 3)),
            "h": draw(st.integers(max(1, kh - 2 * ph), 9)), "w": draw(st.integers(max(1, kw - 2 * pw), 9)),
            "c_out": groups * draw(st.integers(1, 3)), "kernel": (kh, kw),
            "stride": (draw(st.integers(1, 3)), draw(st.integers(1, 3))), "pad": (ph, pw), "groups": groups,
            "bias": draw(st.booleans())}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(geometry=conv_geometry(), seed=st.integers(0, 2**31))
def test_conv2d_random_geometry(k, geometry, seed):
    run_conv(k, np.random.default_rng(seed), **geometry)


@pytest.mark.parametrize("case", [c for c in CONV_CASES if c.startswith("tiled")] + ["depthwise", "pointwise"])
def test_fused_sgd_equals_the_gradient_then_sgd_bit_for_bit(k, case):
    """The fused weight update forms the very sums the gradient kernel does, tile for tile, in
    every path the tiles take (depthwise columns, 4 x 4 channel tiles, their remainders)."""
    from kernel_host import CONV, FL, F

    n, c_in, h, w, c_out, kernel, stride, pad, groups, bias = CONV_CASES[case]
    s = conv_shape(n, c_in, h, w, c_out, kernel, stride, pad, groups)
    rng = np.random.default_rng(7)
    x, wt = rand(rng, n, c_in, h, w), rand(rng, c_out, c_in // groups, *kernel)
    b, dy = rand(rng, c_out), rand(rng, n, c_out, s.h_out, s.w_out)
    gw, gb = np.zeros_like(wt), np.zeros_like(b)
    k.conv2d_backward_params(ptr(gw), ptr(gb), ptr(dy), ptr(x), C.byref(s))
    want_w, want_b = wt.copy(), b.copy()
    k.sgd_step(ptr(want_w), ptr(gw), want_w.size, 0.01)
    k.sgd_step(ptr(want_b), ptr(gb), want_b.size, 0.01)
    fused = k.lib.poet_conv2d_backward_params_sgd
    fused.restype, fused.argtypes = None, [F, F, F, F, CONV, FL]
    fused(ptr(wt), ptr(b), ptr(dy), ptr(x), C.byref(s), 0.01)
    assert np.array_equal(wt, want_w) and np.array_equal(b, want_b)


def test_shape_checks(k):
    good = conv_shape(2, 4, 7, 5, 6, (3, 3), (2, 2), (1, 1), 2)
    assert k.conv2d_shape_ok(C.byref(good))
    for field, value in [("h_out", 5), ("groups", 3), ("stride_w", 0), ("k_h", 12)]:
        bad = conv_shape(2, 4, 7, 5, 6, (3, 3), (2, 2), (1, 1), 2)
        setattr(bad, field, value)
        assert not k.conv2d_shape_ok(C.byref(bad)), field
    assert k.pool2d_shape_ok(C.byref(pool_shape(1, 2, 7, 5, (3, 3), (2, 2), (1, 1))))
    assert not k.pool2d_shape_ok(C.byref(pool_shape(1, 2, 7, 5, (2, 2), (2, 2), (2, 0))))  # pad > kernel / 2


# ---- pooling ----

POOL_CASES = {
    # name: n, c, h, w, kernel, stride, pad
    "2x2 stride 2 odd input": (2, 3, 7, 5, (2, 2), (2, 2), (0, 0)),
    "3x3 stride 2 pad 1": (2, 2, 7, 5, (3, 3), (2, 2), (1, 1)),
    "3x3 overlapping": (1, 3, 6, 6, (3, 3), (1, 1), (1, 1)),
    "rectangular": (2, 2, 5, 9, (2, 3), (1, 2), (1, 1)),
}


@pytest.mark.parametrize("case", POOL_CASES)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_maxpool2d(k, case, ties):
    n, c, h, w, kernel, stride, pad = POOL_CASES[case]
    rng = np.random.default_rng(7)
    # small integers make most windows hold several equal maxima: the gradient must go to the first
    x = rng.integers(0, 3, (n, c, h, w)).astype(np.float32) if ties else rand(rng, n, c, h, w)
    s = pool_shape(n, c, h, w, kernel, stride, pad)
    assert k.pool2d_shape_ok(C.byref(s))
    tx = t64(x, True)
    ty = Fn.max_pool2d(tx, kernel, stride, pad)
    dy = rand(rng, *ty.shape)
    ty.backward(t64(dy))
    y = np.full(ty.shape, np.nan, np.float32)
    k.maxpool2d_forward(ptr(y), ptr(x), C.byref(s))
    check("maxpool2d forward", y, ty)
    dx0 = rand(rng, *x.shape)
    dx = dx0.copy()
    k.maxpool2d_backward(ptr(dx), ptr(dy), ptr(x), C.byref(s))
    check("maxpool2d backward", dx, dx0 + grad_of(tx))


@pytest.mark.parametrize("case", POOL_CASES)
def test_avgpool2d(k, case):
    n, c, h, w, kernel, stride, pad = POOL_CASES[case]
    rng = np.random.default_rng(8)
    x = rand(rng, n, c, h, w)
    s = pool_shape(n, c, h, w, kernel, stride, pad)
    tx = t64(x, True)
    ty = Fn.avg_pool2d(tx, kernel, stride, pad)  # count_include_pad=True
    dy = rand(rng, *ty.shape)
    ty.backward(t64(dy))
    y = np.full(ty.shape, np.nan, np.float32)
    k.avgpool2d_forward(ptr(y), ptr(x), C.byref(s))
    check("avgpool2d forward", y, ty)
    dx0 = rand(rng, *x.shape)
    dx = dx0.copy()
    k.avgpool2d_backward(ptr(dx), ptr(dy), C.byref(s))
    check("avgpool2d backward", dx, dx0 + grad_of(tx))


def test_global_avgpool(k):
    rng = np.random.default_rng(9)
    x = rand(rng, 3, 4, 7, 5, offset=2.0)
    tx = t64(x, True)
    ty = Fn.adaptive_avg_pool2d(tx, 1)
    dy = rand(rng, *ty.shape)
    ty.backward(t64(dy))
    y = np.full(ty.shape, np.nan, np.float32)
    k.global_avgpool_forward(ptr(y), ptr(x), 12, 35)
    check("global avgpool forward", y, ty)
    dx0 = rand(rng, *x.shape)
    dx = dx0.copy()
    k.global_avgpool_backward(ptr(dx), ptr(dy), 12, 35)
    check("global avgpool backward", dx, dx0 + grad_of(tx))


# ---- normalisation ----

@pytest.mark.parametrize("shape,affine,running", [
    ((4, 3, 7, 5), True, True),
    ((2, 5, 3, 3), False, False),
    ((6, 4), True, True),  # BatchNorm1d: one value per channel per sample
    ((1, 2, 9, 7), True, False),
])
def test_batchnorm(k, shape, affine, running):
    rng = np.random.default_rng(10)
    n, c = shape[:2]
    spatial = int(np.prod(shape[2:], dtype=np.int64))
    # an offset mean against a modest spread: the case a one-pass variance gets wrong
    x = rand(rng, *shape, scale=2.0, offset=3.0)
    gamma, beta = (rand(rng, c, offset=1.0), rand(rng, c)) if affine else (None, None)
    rm0, rv0 = rand(rng, c), np.abs(rand(rng, c)) + 0.5
    eps, momentum = 1e-5, 0.1
    tx = t64(x, True)
    tg, tb = (t64(gamma, True), t64(beta, True)) if affine else (None, None)
    trm, trv = t64(rm0), t64(rv0)
    ty = Fn.batch_norm(tx, trm, trv, tg, tb, training=True, momentum=momentum, eps=eps)
    dy = rand(rng, *shape)
    ty.backward(t64(dy))
    axes = (0, *range(2, len(shape)))
    x64 = x.astype(np.float64)
    mean_ref = x64.mean(axis=axes)
    invstd_ref = 1.0 / np.sqrt(x64.var(axis=axes) + eps)

    s = BatchNormShape(n, c, spatial, eps, momentum)
    y = np.full(shape, np.nan, np.float32)
    mean, invstd = np.full(c, np.nan, np.float32), np.full(c, np.nan, np.float32)
    rm, rv = rm0.copy(), rv0.copy()
    k.batchnorm_forward(ptr(y), ptr(mean), ptr(invstd), ptr(rm) if running else None,
                        ptr(rv) if running else None, ptr(x), ptr(gamma), ptr(beta), C.byref(s))
    check("batchnorm forward", y, ty)
    check("batchnorm saved mean", mean, mean_ref)
    check("batchnorm saved invstd", invstd, invstd_ref)
    if running:
        check("batchnorm running mean", rm, trm)
        check("batchnorm running var", rv, trv)

    dx0, dg0, db0 = rand(rng, *shape), rand(rng, c), rand(rng, c)
    dx, dg, db = dx0.copy(), dg0.copy(), db0.copy()
    k.batchnorm_backward(ptr(dx), ptr(dg) if affine else None, ptr(db) if affine else None, ptr(dy), ptr(x),
                         ptr(mean), ptr(invstd), ptr(gamma), C.byref(s))
    check("batchnorm backward input", dx, dx0 + grad_of(tx))
    if affine:
        check("batchnorm backward gamma", dg, dg0 + grad_of(tg))
        check("batchnorm backward beta", db, db0 + grad_of(tb))

    # eval mode (model.eval()): the running statistics normalise, each sample alone, also in place
    want = Fn.batch_norm(t64(x), t64(rm0), t64(rv0), tg, tb, training=False, eps=eps)
    ye = np.full(shape, np.nan, np.float32)
    k.batchnorm_eval_forward(ptr(ye), ptr(x), ptr(rm0), ptr(rv0), ptr(gamma), ptr(beta), n, c, spatial, eps)
    check("batchnorm eval forward", ye, want)
    inplace = x.copy()
    k.batchnorm_eval_forward(ptr(inplace), ptr(inplace), ptr(rm0), ptr(rv0), ptr(gamma), ptr(beta), n, c, spatial, eps)
    np.testing.assert_array_equal(inplace, ye)


@pytest.mark.parametrize("shape,affine", [((6, 10), True), ((2, 3, 16), True), ((5, 7), False)])
def test_layernorm(k, shape, affine):
    rng = np.random.default_rng(11)
    d = shape[-1]
    rows = int(np.prod(shape[:-1]))
    x = rand(rng, *shape, scale=1.5, offset=-2.0)
    gamma, beta = (rand(rng, d, offset=1.0), rand(rng, d)) if affine else (None, None)
    eps = 1e-5
    tx = t64(x, True)
    tg, tb = (t64(gamma, True), t64(beta, True)) if affine else (None, None)
    ty = Fn.layer_norm(tx, (d,), tg, tb, eps)
    dy = rand(rng, *shape)
    ty.backward(t64(dy))

    y = np.full(shape, np.nan, np.float32)
    mean, invstd = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    k.layernorm_forward(ptr(y), ptr(mean), ptr(invstd), ptr(x), ptr(gamma), ptr(beta), rows, d, eps)
    check("layernorm forward", y, ty)
    dx0, dg0, db0 = rand(rng, *shape), rand(rng, d), rand(rng, d)
    dx, dg, db = dx0.copy(), dg0.copy(), db0.copy()
    k.layernorm_backward(ptr(dx), ptr(dg) if affine else None, ptr(db) if affine else None, ptr(dy), ptr(x),
                         ptr(mean), ptr(invstd), ptr(gamma), rows, d)
    check("layernorm backward input", dx, dx0 + grad_of(tx))
    if affine:
        check("layernorm backward gamma", dg, dg0 + grad_of(tg))
        check("layernorm backward beta", db, db0 + grad_of(tb))


# ---- dense layers ----

# The kernels run in tiles of 4 rows by 4 outputs over a reduction unrolled by 4: (9, 13) -> 11 has
# a remainder of every one (rows 4 + 4 + 1, outputs 4 + 4 + 3, inputs 12 + 1), (8, 16) -> 8 none.
@pytest.mark.parametrize("x_shape,out,bias", [((5, 7), 3, True), ((2, 3, 8), 6, False), ((1, 33), 10, True),
                                              ((9, 13), 11, True), ((8, 16), 8, False), ((3, 2, 6), 5, True),
                                              ((1, 7), 3, False), ((1, 9), 1, True), ((1, 6), 2, True),
                                              ((1, 13), 4, False), ((1, 64), 2, True), ((1, 1), 2, False),
                                              ((1, 3), 5, True)])
def test_linear(k, x_shape, out, bias):
    rng = np.random.default_rng(12)
    d_in = x_shape[-1]
    rows = int(np.prod(x_shape[:-1]))
    x, w = rand(rng, *x_shape), rand(rng, out, d_in, scale=0.3)
    b = rand(rng, out) if bias else None
    tx, tw = t64(x, True), t64(w, True)
    tb = t64(b, True) if bias else None
    ty = Fn.linear(tx, tw, tb)
    dy = rand(rng, *ty.shape)
    ty.backward(t64(dy))
    y = np.full(ty.shape, np.nan, np.float32)
    k.linear_forward(ptr(y), ptr(x), ptr(w), ptr(b), rows, d_in, out)
    check("linear forward", y, ty)
    dx0 = rand(rng, *x.shape)
    dx = dx0.copy()
    k.linear_backward_input(ptr(dx), ptr(dy), ptr(w), rows, d_in, out)
    check("linear backward input", dx, dx0 + grad_of(tx))
    dx = np.full(x.shape, np.nan, np.float32)  # written (dx =): an element left unwritten shows
    k.linear_backward_input_set(ptr(dx), ptr(dy), ptr(w), rows, d_in, out)
    check("linear backward input (dx =)", dx, grad_of(tx))
    gw0, gb0 = rand(rng, out, d_in), rand(rng, out)
    gw, gb = gw0.copy(), gb0.copy()
    k.linear_backward_params(ptr(gw), ptr(gb) if bias else None, ptr(dy), ptr(x), rows, d_in, out)
    check("linear backward weight", gw, gw0 + grad_of(tw))
    if bias:
        check("linear backward bias", gb, gb0 + grad_of(tb))


@pytest.mark.parametrize("batch,m,kk,n", [(3, 4, 5, 6), (1, 7, 1, 3), (2, 1, 9, 1)])
def test_matmul(k, batch, m, kk, n):
    rng = np.random.default_rng(13)
    a, b = rand(rng, batch, m, kk), rand(rng, batch, kk, n)
    ta, tb = t64(a, True), t64(b, True)
    tc = ta @ tb
    dc = rand(rng, *tc.shape)
    tc.backward(t64(dc))
    c = np.full(tc.shape, np.nan, np.float32)
    k.matmul_forward(ptr(c), ptr(a), ptr(b), batch, m, kk, n)
    check("matmul forward", c, tc)
    da0, db0 = rand(rng, *a.shape), rand(rng, *b.shape)
    da, db = da0.copy(), db0.copy()
    k.matmul_backward_a(ptr(da), ptr(dc), ptr(b), batch, m, kk, n)
    k.matmul_backward_b(ptr(db), ptr(a), ptr(dc), batch, m, kk, n)
    check("matmul backward a", da, da0 + grad_of(ta))
    check("matmul backward b", db, db0 + grad_of(tb))


@pytest.mark.parametrize("rows,d,scale,offset", [(5, 7, 1.0, 0.0), (3, 16, 10.0, 50.0), (4, 1, 1.0, 0.0)])
def test_softmax(k, rows, d, scale, offset):
    rng = np.random.default_rng(14)
    x = rand(rng, rows, d, scale=scale, offset=offset)
    tx = t64(x, True)
    ty = torch.softmax(tx, dim=-1)
    dy = rand(rng, rows, d)
    ty.backward(t64(dy))
    y = np.full(x.shape, np.nan, np.float32)
    k.softmax_forward(ptr(y), ptr(x), rows, d)
    check("softmax forward", y, ty)
    inplace = x.copy()
    k.softmax_forward(ptr(inplace), ptr(inplace), rows, d)
    assert np.array_equal(inplace, y)
    dx0 = rand(rng, rows, d)
    dx = dx0.copy()
    k.softmax_backward(ptr(dx), ptr(dy), ptr(y), rows, d)
    check("softmax backward", dx, dx0 + grad_of(tx))


# ---- elementwise ----

def activation_inputs(rng):
    # both clamp points of relu6 exactly (and hardswish's, -3 and 3), a stretch where GELU's tail is
    # tiny, and SiLU's sigmoid far out on both sides
    return np.concatenate([rng.uniform(-9, 9, 2000), [0.0, -0.0, 6.0, 1e-30, -1e-30, -8.5, 7.0, -3.0, 3.0, -95.0,
                                                      95.0]]).astype(np.float32)


@pytest.mark.parametrize("name", ["relu", "relu6", "gelu", "silu", "hardswish", "tanh"])
def test_activation(k, name):
    rng = np.random.default_rng(15)
    x = activation_inputs(rng)
    tx = t64(x, True)
    ty = {"relu": torch.relu, "relu6": Fn.relu6, "gelu": Fn.gelu, "silu": Fn.silu, "hardswish": Fn.hardswish,
          "tanh": torch.tanh}[name](tx)
    dy = rand(rng, x.size)
    ty.backward(t64(dy))
    forward, backward = getattr(k, f"{name}_forward"), getattr(k, f"{name}_backward")
    y = np.full(x.shape, np.nan, np.float32)
    forward(ptr(y), ptr(x), x.size)
    check(f"{name} forward", y, ty)
    # relu and relu6 may read the input or the output: the masks agree; tanh reads its output, the
    # others their input
    for source in ((x, y) if name in ("relu", "relu6") else (y,) if name == "tanh" else (x,)):
        dx0 = rand(rng, x.size)
        dx = dx0.copy()
        backward(ptr(dx), ptr(dy), ptr(source), x.size)
        check(f"{name} backward", dx, dx0 + grad_of(tx))
    inplace = x.copy()
    forward(ptr(inplace), ptr(inplace), x.size)
    assert np.array_equal(inplace, y)


def test_relu_propagates_nan_like_torch(k):
    x = np.array([np.nan, -1.0, 2.0], np.float32)
    for name, ref in [("relu", torch.relu), ("relu6", Fn.relu6)]:
        y = np.zeros(3, np.float32)
        getattr(k, f"{name}_forward")(ptr(y), ptr(x), 3)
        np.testing.assert_array_equal(y, ref(torch.tensor(x)).numpy())


def test_add_and_flatten(k):
    rng = np.random.default_rng(16)
    a, b = rand(rng, 2, 3, 5), rand(rng, 2, 3, 5)
    ta, tb = t64(a, True), t64(b, True)
    ty = (ta + tb).flatten(1)
    dy = rand(rng, *ty.shape)
    ty.backward(t64(dy))
    y, flat = np.empty_like(a), np.empty((2, 15), np.float32)
    k.add_forward(ptr(y), ptr(a), ptr(b), a.size)
    k.copy(ptr(flat), ptr(y), y.size)
    check("add forward", flat, ty)
    dflat = np.zeros_like(y)
    k.accumulate(ptr(dflat), ptr(dy), dy.size)
    check("flatten backward", dflat.reshape(2, 15), dy)
    da0, db0 = rand(rng, *a.shape), rand(rng, *b.shape)
    da, db = da0.copy(), db0.copy()
    k.add_backward(ptr(da), ptr(db), ptr(dflat), a.size)
    check("add backward", da, da0 + grad_of(ta))
    check("add backward", db, db0 + grad_of(tb))
    # y = x + x: one buffer given for both operands receives both contributions
    tx = t64(a, True)
    (tx + tx).backward(t64(dflat))
    dx = da0.copy()
    k.add_backward(ptr(dx), ptr(dx), ptr(dflat), a.size)
    check("add backward", dx, da0 + grad_of(tx))
    z = rand(rng, 7)
    k.zero(ptr(z), 7)
    assert not z.any()


# ---- loss ----

@pytest.mark.parametrize("batch,classes,ignored", [(5, 7, 0), (8, 3, 2), (1, 10, 0)])
def test_cross_entropy(k, batch, classes, ignored):
    rng = np.random.default_rng(17)
    z = rand(rng, batch, classes, scale=3.0, offset=20.0)
    target = rng.integers(0, classes, batch).astype(np.int32)
    target[:ignored] = -100  # torch's default ignore_index
    tz = t64(z, True)
    tloss = Fn.cross_entropy(tz, torch.tensor(target, dtype=torch.int64))
    tloss.backward()
    loss = np.full(1, np.nan, np.float32)
    k.cross_entropy_forward(ptr(loss), ptr(z), iptr(target), batch, classes)
    check("cross-entropy forward", loss, tloss.reshape(1))
    dz0 = rand(rng, batch, classes, scale=0.1)
    dz = dz0.copy()
    k.cross_entropy_backward(ptr(dz), ptr(z), iptr(target), batch, classes)
    check("cross-entropy backward", dz, dz0 + grad_of(tz))


def test_cross_entropy_all_ignored_is_nan_with_zero_gradient(k):
    z = np.ones((2, 3), np.float32)
    target = np.array([-100, 3], np.int32)  # 3 is out of range for 3 classes: ignored too
    loss = np.zeros(1, np.float32)
    k.cross_entropy_forward(ptr(loss), ptr(z), iptr(target), 2, 3)
    assert np.isnan(loss[0])
    dz = np.zeros_like(z)
    k.cross_entropy_backward(ptr(dz), ptr(z), iptr(target), 2, 3)
    assert not dz.any()


# ---- embeddings ----

@pytest.mark.parametrize("first, rows", [(0, 10), (4, 3)])
def test_embedding_gathers_and_sums_rows_as_torch(k, first, rows):
    """A whole table (first 0), and a tile of rows 4..6: the forward gathers the rows of the ids it
    holds and leaves the others' rows of y as they were; the table's gradient sums each row's dy
    as torch's embedding backward does (repeated ids included), and the fused SGD step equals the
    gradient then poet_sgd_step bit for bit, moving no row no id selects. Ids outside the table
    (-1, 10) select nothing."""
    rng = np.random.default_rng(21)
    vocab, d = 10, 5
    ids = np.array([3, 4, 4, 9, -1, 6, 10, 4, 5, 0, 6], np.int32)
    table, dy = rand(rng, vocab, d), rand(rng, ids.size, d)
    tile = table[first:first + rows].copy()
    held = (ids >= first) & (ids < first + rows)
    y = np.full((ids.size, d), 7.0, np.float32)
    k.embedding_forward(ptr(y), iptr(ids), ptr(tile), ids.size, first, rows, d)
    want = np.where(held[:, None], table[np.clip(ids, 0, vocab - 1)], 7.0)
    assert np.array_equal(y, want)
    tt = t64(table, True)
    torch.nn.functional.embedding(torch.from_numpy(np.where(held, ids, 0)).long(), tt).backward(
        t64(dy * held[:, None]))
    gw = np.zeros_like(tile)
    k.embedding_backward_params(ptr(gw), ptr(dy), iptr(ids), ids.size, first, rows, d)
    check("embedding weight gradient", gw, tt.grad[first:first + rows])
    want_w = tile.copy()
    k.sgd_step(ptr(want_w), ptr(gw), want_w.size, 0.05)
    k.embedding_backward_params_sgd(ptr(tile), ptr(dy), iptr(ids), ids.size, first, rows, d, 0.05)
    assert np.array_equal(tile, want_w)
    untouched = [r for r in range(rows) if first + r not in ids]
    assert np.array_equal(tile[untouched], table[first:first + rows][untouched])


# ---- optimisers ----

def test_sgd(k):
    rng = np.random.default_rng(18)
    w, g = rand(rng, 50), rand(rng, 50)
    tw = t64(w, True)
    tw.grad = t64(g)
    torch.optim.SGD([tw], lr=0.05).step()
    out = w.copy()
    k.sgd_step(ptr(out), ptr(g), 50, 0.05)
    check("sgd step", out, tw)


def test_adam(k):
    """Five steps, then step 1000, against torch.optim.Adam in float64 with the float32 betas. The
    weights start at the scale of one update, so the comparison sees the update itself."""
    rng = np.random.default_rng(19)
    n, lr = 64, 1e-3
    beta1, beta2 = float(np.float32(0.9)), float(np.float32(0.999))
    w = rand(rng, n, scale=1e-3)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    tw = t64(w, True)
    opt = torch.optim.Adam([tw], lr=lr, betas=(beta1, beta2), eps=1e-8)
    cfg = AdamConfig(lr, beta1, beta2, 1e-8)
    for step in [1, 2, 3, 4, 5, 1000]:
        g = rand(rng, n, scale=0.1 if step % 2 else 3.0)
        if step == 1000:
            opt.state[tw]["step"] = torch.tensor(999.0)
        tw.grad = t64(g)
        opt.step()
        k.adam_step(ptr(w), ptr(m), ptr(v), ptr(g), n, C.byref(cfg), step)
        check("adam step weight", w, tw)
        check("adam step exp_avg", m, opt.state[tw]["exp_avg"])
        check("adam step exp_avg_sq", v, opt.state[tw]["exp_avg_sq"])
