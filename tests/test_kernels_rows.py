"""The row-tile kernels (poet_kernels_rows.c) against PyTorch in float64, as tests/test_kernels.py
checks the others: a strided product of sub-matrices, layer norm chained over a token's pieces
(statistics, forward, the backward's sums, data and parameter gradients), and a mean over tokens
summed block by block. Gradients accumulate, so each buffer starts with random values."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_host import Kernels, ptr

from poet_opt.firmware import toolchain

torch = pytest.importorskip("torch")
RTOL = 1e-5


@pytest.fixture(scope="module")
def k(tmp_path_factory) -> Kernels:
    return Kernels(toolchain.compile_host_library(tmp_path_factory.mktemp("kernels") / "libpoet_kernels.so"))


def close(actual, expected, rtol: float = RTOL) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(float(np.abs(expected).max()), 1e-30)
    assert float(np.abs(np.asarray(actual, np.float64) - expected).max()) <= rtol * scale


def rand(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _at(a: np.ndarray, offset: int):
    """A float* ``offset`` floats into the array's own memory."""
    import ctypes as C

    return C.cast(a.ctypes.data + 4 * offset, C.POINTER(C.c_float))


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (False, True), (True, False), (True, True)])
def test_gemm_multiplies_strided_sub_matrices_in_place_and_accumulates(k, transpose_a, transpose_b):
    """Windows of larger tiles, read in place (transposed ones by their strides), added into a window
    of the output: what attention's products and their gradients do on the row tiles."""
    rng = np.random.default_rng(0)
    m, n, kk = 3, 5, 4
    a_store, b_store, c_store = rand(rng, 7, 9), rand(rng, 8, 11), rand(rng, 6, 10)
    a = a_store[2:2 + kk, 1:1 + m].T if transpose_a else a_store[2:2 + m, 1:1 + kk]
    b = b_store[3:3 + n, 2:2 + kk].T if transpose_b else b_store[3:3 + kk, 2:2 + n]
    want = c_store.astype(np.float64)
    want[1:1 + m, 3:3 + n] += 0.5 * (a.astype(np.float64) @ b.astype(np.float64))
    k.gemm(_at(c_store, 1 * 10 + 3), 10, _at(a_store, 2 * 9 + 1), *((1, 9) if transpose_a else (9, 1)),
           _at(b_store, 3 * 11 + 2), *((1, 11) if transpose_b else (11, 1)), m, n, kk, 0.5)
    close(c_store, want)


@pytest.mark.parametrize("widths", [(8,), (5, 3), (3, 4, 2)])
def test_layernorm_chained_over_pieces_equals_torch(k, widths):
    rng = np.random.default_rng(1)
    rows, d, eps = 6, sum(widths), 1e-5
    x, gamma, beta, dy = rand(rng, rows, d) * 3 + 1, rand(rng, d), rand(rng, d), rand(rng, rows, d)
    tx, tg, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, gamma, beta))
    ty = torch.nn.functional.layer_norm(tx, (d,), tg, tb, eps)
    ty.backward(torch.tensor(dy, dtype=torch.float64))
    cuts = np.cumsum((0, *widths))
    pieces = [(int(a), int(b)) for a, b in zip(cuts, cuts[1:])]

    def piece(v, a, b):
        return np.ascontiguousarray(v[..., a:b])

    stats = None
    for a, b in pieces:  # statistics chained over the pieces, as the graph's lnstats links
        out = np.zeros(2 * rows, np.float32)
        k.layernorm_rows_stats(ptr(out), ptr(stats), ptr(piece(x, a, b)), rows, b - a, a)
        stats = out
    sums = None
    for a, b in pieces:
        y = np.zeros((rows, b - a), np.float32)
        k.layernorm_rows_forward(ptr(y), ptr(piece(x, a, b)), ptr(stats), ptr(piece(gamma, a, b)),
                                 ptr(piece(beta, a, b)), rows, b - a, d, eps)
        close(y, ty.detach().numpy()[:, a:b])
        out = np.zeros(2 * rows, np.float32)
        k.layernorm_rows_grad_stats(ptr(out), ptr(sums), ptr(piece(dy, a, b)), ptr(piece(x, a, b)), ptr(stats),
                                    ptr(piece(gamma, a, b)), rows, b - a, d, eps)
        sums = out
    for a, b in pieces:
        dx0, dg0, db0 = rand(rng, rows, b - a), rand(rng, b - a), rand(rng, b - a)
        dx, dg, db = dx0.copy(), dg0.copy(), db0.copy()
        k.layernorm_rows_backward(ptr(dx), ptr(piece(dy, a, b)), ptr(piece(x, a, b)), ptr(stats), ptr(sums),
                                  ptr(piece(gamma, a, b)), rows, b - a, d, eps)
        k.layernorm_rows_backward_params(ptr(dg), ptr(db), ptr(piece(dy, a, b)), ptr(piece(x, a, b)), ptr(stats),
                                         rows, b - a, d, eps)
        close(dx - dx0, tx.grad.numpy()[:, a:b])
        close(dg - dg0, tg.grad.numpy()[a:b])
        close(db - db0, tb.grad.numpy()[a:b])


def test_mean_over_tokens_block_by_block_equals_torch(k):
    rng = np.random.default_rng(2)
    n, seq, cols = 2, 7, 5
    x, dy = rand(rng, n, seq, cols), rand(rng, n, cols)
    y = np.zeros((n, cols), np.float32)
    for r0, r1 in ((0, 3), (3, 7)):  # blocks of tokens, summed into the one mean
        k.rows_mean_forward(ptr(y), ptr(np.ascontiguousarray(x[:, r0:r1])), n, r1 - r0, cols, seq)
    close(y, x.astype(np.float64).mean(axis=1))
    for r0, r1 in ((0, 3), (3, 7)):
        dx0 = rand(rng, n, r1 - r0, cols)
        dx = dx0.copy()
        k.rows_mean_backward(ptr(dx), ptr(dy), n, r1 - r0, cols, seq)
        close(dx - dx0, np.broadcast_to(dy[:, None, :] / seq, dx.shape))
