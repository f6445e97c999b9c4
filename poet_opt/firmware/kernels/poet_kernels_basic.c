/* Buffers, elementwise operators, dense layers, softmax, the loss and the optimisers. */
#include "poet_kernels.h"

void poet_zero(float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        x[i] = 0.0f;
}

void poet_copy(float *y, const float *x, uint32_t n)
{
    uint32_t i;
    if (y == x) /* a reshape in place: nothing to move */
        return;
    for (i = 0; i < n; ++i)
        y[i] = x[i];
}

void poet_accumulate(float *dst, const float *src, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        dst[i] += src[i];
}

/* A tiled layer's slices live in slots of their own; these move one slice into or out of the
 * whole tensor, whose feature axis it interleaves with the batch (and, for a convolution, with
 * the spatial positions). */
void poet_copy_strided(float *dst, const float *src, uint32_t outer, uint32_t count, uint32_t dst_stride,
                       uint32_t src_stride)
{
    uint32_t o, i;
    for (o = 0; o < outer; ++o)
        for (i = 0; i < count; ++i)
            dst[o * dst_stride + i] = src[o * src_stride + i];
}

void poet_accumulate_strided(float *dst, const float *src, uint32_t outer, uint32_t count, uint32_t dst_stride,
                             uint32_t src_stride)
{
    uint32_t o, i;
    for (o = 0; o < outer; ++o)
        for (i = 0; i < count; ++i)
            dst[o * dst_stride + i] += src[o * src_stride + i];
}

void poet_add_forward(float *y, const float *a, const float *b, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        y[i] = a[i] + b[i];
}

void poet_add_backward(float *da, float *db, const float *dy, uint32_t n)
{
    if (da)
        poet_accumulate(da, dy, n);
    if (db)
        poet_accumulate(db, dy, n);
}

/* Comparisons are written so that NaN takes torch's branch: relu(NaN) = NaN, and the backward
 * lets the gradient through a NaN, as threshold_backward's `t <= 0 ? 0 : dy` does. */
void poet_relu_forward(float *y, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

void poet_relu_backward(float *dx, const float *dy, const float *t, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        if (!(t[i] <= 0.0f))
            dx[i] += dy[i];
}

void poet_relu6_forward(float *y, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        y[i] = x[i] < 0.0f ? 0.0f : (x[i] > 6.0f ? 6.0f : x[i]);
}

/* hardtanh_backward's mask: the gradient stops at both clamps, including exactly 0 and 6 */
void poet_relu6_backward(float *dx, const float *dy, const float *t, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        if (!(t[i] <= 0.0f || t[i] >= 6.0f))
            dx[i] += dy[i];
}

#define POET_SQRT1_2 0.70710678118654752f
#define POET_INV_SQRT_2PI 0.39894228040143268f

/* Phi(x) = erfc(-x / sqrt 2) / 2 rather than (1 + erf(x / sqrt 2)) / 2: on the negative side the
 * latter cancels to a few correct bits by x = -5, where erfc keeps full relative precision. */
static float normal_cdf(float x) { return 0.5f * poet_erfcf(-x * POET_SQRT1_2); }

void poet_gelu_forward(float *y, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        y[i] = x[i] * normal_cdf(x[i]);
}

void poet_gelu_backward(float *dx, const float *dy, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i) {
        const float v = x[i];
        const float pdf = POET_INV_SQRT_2PI * poet_expf(-0.5f * v * v);
        dx[i] += dy[i] * (normal_cdf(v) + v * pdf);
    }
}

/* Dense layers as register tiles. Each kernel is a set of dot products, and a tile of up to 4 x 4
 * of them shares its loads: per step along the reduction it loads 4 values of each operand and
 * issues 16 multiply-adds, where a lone dot product loads 2 values per multiply-add. Sixteen
 * accumulators and eight operands fit the 32 single-precision registers of an FPv4/FPv5 FPU; on a
 * core without one the tile is still correct, and only the soft-float calls cost. Each sum still
 * runs in one register in the order of its reduction index from 0, so the results are the bits a
 * plain loop gives, and its destination is touched once. The reduction is unrolled by 4 so that
 * the loads take immediate offsets and one pointer step serves four of them. */
#if defined(__GNUC__)
#define POET_INLINE static inline __attribute__((always_inline))
#define POET_OUTLINE static __attribute__((noinline))
#else
#define POET_INLINE static inline
#define POET_OUTLINE static
#endif

/* acc[r * C + c] = sum over k < n of a[r * ar + k * ak] * b[c * bc + k * bk], for r < R, c < C
 * (R, C at most 4 and constant at every call, so the tile lives in registers) */
POET_INLINE void dot_tile(float *acc, const float *a, uint32_t ar, uint32_t ak, const float *b, uint32_t bc,
                          uint32_t bk, uint32_t n, const uint32_t R, const uint32_t C)
{
    float s[16], av[4], bv[4];
    uint32_t k, r, c, u;
    for (r = 0; r < R * C; ++r)
        s[r] = 0.0f;
    for (k = 0; k + 4 <= n; k += 4) {
        for (u = 0; u < 4; ++u) {
            for (r = 0; r < R; ++r)
                av[r] = a[r * ar + (k + u) * ak];
            for (c = 0; c < C; ++c)
                bv[c] = b[c * bc + (k + u) * bk];
            for (r = 0; r < R; ++r)
                for (c = 0; c < C; ++c)
                    s[r * C + c] += av[r] * bv[c];
        }
    }
    for (; k < n; ++k) {
        for (r = 0; r < R; ++r)
            av[r] = a[r * ar + k * ak];
        for (c = 0; c < C; ++c)
            bv[c] = b[c * bc + k * bk];
        for (r = 0; r < R; ++r)
            for (c = 0; c < C; ++c)
                s[r * C + c] += av[r] * bv[c];
    }
    for (r = 0; r < R * C; ++r)
        acc[r] = s[r];
}

/* What a tile of dot products does with its sums: store (+ bias), accumulate, or an SGD step */
enum { TILE_STORE, TILE_ADD, TILE_SGD };

/* The R x C tile of y[r][c] (row stride ldy) from the dot products a-row r by b-row c */
POET_INLINE void tile_out(float *y, uint32_t ldy, const float *bias, const float *a, uint32_t ar, uint32_t ak,
                          const float *b, uint32_t bc, uint32_t bk, uint32_t n, float lr, const int mode,
                          const uint32_t R, const uint32_t C)
{
    float acc[16];
    uint32_t r, c;
    dot_tile(acc, a, ar, ak, b, bc, bk, n, R, C);
    for (r = 0; r < R; ++r)
        for (c = 0; c < C; ++c) {
            float *at = y + r * ldy + c;
            if (mode == TILE_STORE)
                *at = bias ? acc[r * C + c] + bias[c] : acc[r * C + c];
            else if (mode == TILE_ADD)
                *at += acc[r * C + c];
            else
                *at -= lr * acc[r * C + c];
        }
}

/* y[r][c] for r < rows, c < cols as tiles of 4 x 4, then the edges: a-row r starts at a + r * ar,
 * b-row c at b + c * bc, the reduction steps are ak and bk, and the bias (mode TILE_STORE only)
 * is indexed by c. The constant strides a caller passes as 1 become immediate offsets. */
POET_INLINE void tiled(float *y, uint32_t ldy, const float *bias, const float *a, uint32_t ar, uint32_t ak,
                       const float *b, uint32_t bc, uint32_t bk, uint32_t rows, uint32_t cols, uint32_t n,
                       float lr, const int mode)
{
    uint32_t r = 0, c;
    for (; r + 4 <= rows; r += 4) {
        for (c = 0; c + 4 <= cols; c += 4)
            tile_out(y + r * ldy + c, ldy, bias ? bias + c : bias, a + r * ar, ar, ak, b + c * bc, bc, bk, n, lr,
                     mode, 4, 4);
        for (; c < cols; ++c)
            tile_out(y + r * ldy + c, ldy, bias ? bias + c : bias, a + r * ar, ar, ak, b + c * bc, bc, bk, n, lr,
                     mode, 4, 1);
    }
    for (; r < rows; ++r) {
        for (c = 0; c + 4 <= cols; c += 4)
            tile_out(y + r * ldy + c, ldy, bias ? bias + c : bias, a + r * ar, ar, ak, b + c * bc, bc, bk, n, lr,
                     mode, 1, 4);
        for (; c < cols; ++c)
            tile_out(y + r * ldy + c, ldy, bias ? bias + c : bias, a + r * ar, ar, ak, b + c * bc, bc, bk, n, lr,
                     mode, 1, 1);
    }
}

/* Column sums of dy, for the bias gradient, one register each */
static float column_sum(const float *dy, uint32_t rows, uint32_t out, uint32_t o)
{
    uint32_t r;
    float acc = 0.0f;
    for (r = 0; r < rows; ++r)
        acc += dy[r * out + o];
    return acc;
}

/* As in poet_kernels_conv.c: ARMv6-M (no FPU, little flash) keeps only the tiles */
#if !defined(POET_KERNELS_SMALL) && !defined(POET_KERNELS_FAST) && defined(__ARM_ARCH_6M__)
#define POET_KERNELS_SMALL 1
#endif

#ifndef POET_KERNELS_SMALL
/* One row (batch 1: a classifier head). The 4 x 4 tiles then run as 1 x 1 or 1 x 4 tiles, whose
 * set-up, for a reduction as short as a two-class head's, costs more than their multiply-adds:
 * these loops hold the row's few shared values in registers instead. The sums are the tiles',
 * each in the order of its reduction index from the first product. */

/* y[o] = x . w[o] (+ b[o]) for OUT (1 or 2) outputs, a classifier head's: each output's sum
 * in a register through one pass over x, the OUT rows of w stepped beside it eight inputs at a
 * time (each pointer step and the loop's count serve 8 OUT multiply-adds), no loop over outputs */
POET_INLINE void linear_row_forward_few(float *y, const float *x, const float *w, const float *b, uint32_t in,
                                        const uint32_t OUT)
{
    const float *wr[4];
    float s[4];
    uint32_t o, k, j;
    for (o = 0; o < OUT; ++o)
        wr[o] = w + o * in, s[o] = 0.0f;
    for (k = in / 8; k > 0; --k, x += 8) {
        for (j = 0; j < 8; ++j)
            for (o = 0; o < OUT; ++o)
                s[o] += x[j] * wr[o][j];
        for (o = 0; o < OUT; ++o)
            wr[o] += 8;
    }
    for (k = in % 8; k > 0; --k, ++x)
        for (o = 0; o < OUT; ++o)
            s[o] += x[0] * *wr[o]++;
    for (o = 0; o < OUT; ++o)
        y[o] = b ? s[o] + b[o] : s[o];
}

/* y[o] = x . w[o] (+ b[o]), two outputs on each loaded x */
static void linear_row_forward(float *y, const float *x, const float *w, const float *b, uint32_t in, uint32_t out)
{
    uint32_t o = 0, k, j;
    if (out <= 2) { /* (three and four outputs keep the pairs below: each OUT is one more copy) */
        if (out == 2)
            linear_row_forward_few(y, x, w, b, in, 2);
        else
            linear_row_forward_few(y, x, w, b, in, 1);
        return;
    }
    for (; o + 2 <= out; o += 2) {
        const float *w0 = w + o * in, *w1 = w0 + in, *xp = x;
        float s0 = 0.0f, s1 = 0.0f;
        /* pointers stepped eight floats at a time: the loads take immediate offsets, and the
         * three pointer steps and the loop's count serve sixteen multiply-adds */
        for (k = in / 8; k > 0; --k, xp += 8, w0 += 8, w1 += 8)
            for (j = 0; j < 8; ++j)
                s0 += xp[j] * w0[j], s1 += xp[j] * w1[j];
        if (in & 4) {
            for (j = 0; j < 4; ++j)
                s0 += xp[j] * w0[j], s1 += xp[j] * w1[j];
            xp += 4, w0 += 4, w1 += 4;
        }
        for (k = in % 4; k > 0; --k, ++xp, ++w0, ++w1)
            s0 += xp[0] * w0[0], s1 += xp[0] * w1[0];
        y[o] = b ? s0 + b[o] : s0;
        y[o + 1] = b ? s1 + b[o + 1] : s1;
    }
    if (o < out) {
        const float *w0 = w + o * in;
        float s0 = 0.0f;
        for (k = 0; k < in; ++k)
            s0 += x[k] * w0[k];
        y[o] = b ? s0 + b[o] : s0;
    }
}

/* The same for at most four outputs (a classifier head): every dy in a register and one pass over
 * the rows of w side by side, so that no input pays a loop over the outputs of its own. SET: dx =
 * the sums (a gradient's first contribution: dx neither loaded nor zeroed), else dx +=. */
POET_INLINE void linear_row_backward_input_few(float *dx, const float *dy, const float *w, uint32_t in,
                                               const uint32_t OUT, const int SET)
{
    const float d0 = dy[0], d1 = OUT > 1 ? dy[1] : 0.0f, d2 = OUT > 2 ? dy[2] : 0.0f, d3 = OUT > 3 ? dy[3] : 0.0f;
    const float *w0 = w, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
    uint32_t k, j;
    for (k = in / 4; k > 0; --k, dx += 4, w0 += 4, w1 += 4, w2 += 4, w3 += 4)
        for (j = 0; j < 4; ++j) {
            float s0 = d0 * w0[j];
            if (OUT > 1)
                s0 += d1 * w1[j];
            if (OUT > 2)
                s0 += d2 * w2[j];
            if (OUT > 3)
                s0 += d3 * w3[j];
            if (SET)
                dx[j] = s0;
            else
                dx[j] += s0;
        }
    for (k = in % 4; k > 0; --k, ++dx, ++w0, ++w1, ++w2, ++w3) {
        float s0 = d0 * w0[0];
        if (OUT > 1)
            s0 += d1 * w1[0];
        if (OUT > 2)
            s0 += d2 * w2[0];
        if (OUT > 3)
            s0 += d3 * w3[0];
        if (SET)
            dx[0] = s0;
        else
            dx[0] += s0;
    }
}

/* dx[i] += dy . w[.][i], four inputs at a time */
static void linear_row_backward_input(float *dx, const float *dy, const float *w, uint32_t in, uint32_t out)
{
    uint32_t i = 0, o;
    switch (out) {
    case 1: linear_row_backward_input_few(dx, dy, w, in, 1, 0); return;
    case 2: linear_row_backward_input_few(dx, dy, w, in, 2, 0); return;
    case 3: linear_row_backward_input_few(dx, dy, w, in, 3, 0); return;
    case 4: linear_row_backward_input_few(dx, dy, w, in, 4, 0); return;
    default: break;
    }
    for (; i + 4 <= in; i += 4) {
        const float *wp = w + i, *dp = dy + 1;
        float d = dy[0], s0 = d * wp[0], s1 = d * wp[1], s2 = d * wp[2], s3 = d * wp[3];
        for (o = out - 1; o > 0; --o) {
            wp += in, d = *dp++;
            s0 += d * wp[0], s1 += d * wp[1], s2 += d * wp[2], s3 += d * wp[3];
        }
        dx[i] += s0, dx[i + 1] += s1, dx[i + 2] += s2, dx[i + 3] += s3;
    }
    for (; i < in; ++i) {
        float s0 = dy[0] * w[i];
        for (o = 1; o < out; ++o)
            s0 += dy[o] * w[o * in + i];
        dx[i] += s0;
    }
}

/* dx = dy . w[.][i] for a classifier head's row (up to four outputs); 0 for other shapes */
POET_OUTLINE int linear_row_backward_input_set(float *dx, const float *dy, const float *w, uint32_t in, uint32_t out)
{
    switch (out) {
    case 1: linear_row_backward_input_few(dx, dy, w, in, 1, 1); return 1;
    case 2: linear_row_backward_input_few(dx, dy, w, in, 2, 1); return 1;
    case 3: linear_row_backward_input_few(dx, dy, w, in, 3, 1); return 1;
    case 4: linear_row_backward_input_few(dx, dy, w, in, 4, 1); return 1;
    default: return 0;
    }
}

/* The same for OUT (1 or 2) outputs: every dy in a register, the OUT rows of gw (or w)
 * stepped side by side eight inputs at a time on one pass over x, no loop over outputs */
POET_INLINE void linear_row_outer_few(float *gw, const float *dy, const float *x, uint32_t in, float lr,
                                      const int sgd, const uint32_t OUT)
{
    float *g[4], d[4];
    uint32_t o, i, k;
    for (o = 0; o < OUT; ++o)
        g[o] = gw + o * in, d[o] = dy[o];
    for (i = in / 8; i > 0; --i, x += 8) {
        for (k = 0; k < 8; ++k) {
            const float xv = x[k]; /* once: a store into gw might alias x, as far as the compiler knows */
            for (o = 0; o < OUT; ++o) {
                if (sgd)
                    g[o][k] -= lr * (d[o] * xv);
                else
                    g[o][k] += d[o] * xv;
            }
        }
        for (o = 0; o < OUT; ++o)
            g[o] += 8;
    }
    for (i = in % 8; i > 0; --i, ++x) {
        const float xv = x[0];
        for (o = 0; o < OUT; ++o) {
            if (sgd)
                *g[o] -= lr * (d[o] * xv);
            else
                *g[o] += d[o] * xv;
            ++g[o];
        }
    }
}

/* gw[o][i] += dy[o] x[i] (sgd 0), or w[o][i] -= lr dy[o] x[i] (sgd 1): two rows on each loaded x */
POET_INLINE void linear_row_outer(float *gw, const float *dy, const float *x, uint32_t in, uint32_t out, float lr,
                                  const int sgd)
{
    uint32_t o = 0, i;
    if (out <= 2) {
        if (out == 2)
            linear_row_outer_few(gw, dy, x, in, lr, sgd, 2);
        else
            linear_row_outer_few(gw, dy, x, in, lr, sgd, 1);
        return;
    }
    for (; o + 2 <= out; o += 2) {
        float *g0 = gw + o * in, *g1 = g0 + in;
        const float *xp = x;
        const float d0 = dy[o], d1 = dy[o + 1];
        uint32_t k;
        for (i = in / 4; i > 0; --i, xp += 4, g0 += 4, g1 += 4)
            for (k = 0; k < 4; ++k) {
                const float xv = xp[k];
                if (sgd)
                    g0[k] -= lr * (d0 * xv), g1[k] -= lr * (d1 * xv);
                else
                    g0[k] += d0 * xv, g1[k] += d1 * xv;
            }
        for (i = in % 4; i > 0; --i, ++xp, ++g0, ++g1) {
            if (sgd)
                g0[0] -= lr * (d0 * xp[0]), g1[0] -= lr * (d1 * xp[0]);
            else
                g0[0] += d0 * xp[0], g1[0] += d1 * xp[0];
        }
    }
    if (o < out) {
        float *g0 = gw + o * in;
        const float d0 = dy[o];
        for (i = 0; i < in; ++i) {
            if (sgd)
                g0[i] -= lr * (d0 * x[i]);
            else
                g0[i] += d0 * x[i];
        }
    }
}

/* One row's weight and bias gradients (sgd 0) or SGD step (sgd 1). Each entry point below only
 * chooses between these one-row loops and the tiles, each out of line: inlined in one function,
 * a two-class head's 128 multiply-adds paid the tiles' prologue and register spills (0.2-0.5
 * instructions a multiply-add), and the tiles' code moved with the row loops beside it */
POET_OUTLINE void linear_row_grad(float *gw, float *gb, const float *dy, const float *x, uint32_t in, uint32_t out)
{
    uint32_t o;
    if (gw)
        linear_row_outer(gw, dy, x, in, out, 0.0f, 0);
    if (gb)
        for (o = 0; o < out; ++o)
            gb[o] += column_sum(dy, 1, out, o);
}

POET_OUTLINE void linear_row_sgd(float *w, float *b, const float *dy, const float *x, uint32_t in, uint32_t out,
                                 float lr)
{
    uint32_t o;
    linear_row_outer(w, dy, x, in, out, lr, 1);
    if (b)
        for (o = 0; o < out; ++o)
            b[o] -= lr * column_sum(dy, 1, out, o);
}

#endif

POET_OUTLINE void linear_forward_tiled(float *y, const float *x, const float *w, const float *b, uint32_t rows,
                                       uint32_t in, uint32_t out)
{
    tiled(y, out, b, x, in, 1, w, in, 1, rows, out, in, 0.0f, TILE_STORE);
}

POET_OUTLINE void linear_backward_input_tiled(float *dx, const float *dy, const float *w, uint32_t rows, uint32_t in,
                                              uint32_t out)
{
    tiled(dx, in, NULL, dy, out, 1, w, 1, in, rows, in, out, 0.0f, TILE_ADD);
}

/* y[r][o] = x[r][.] . w[o][.] + b[o] */
void poet_linear_forward(float *y, const float *x, const float *w, const float *b, uint32_t rows,
                         uint32_t in, uint32_t out)
{
#ifndef POET_KERNELS_SMALL
    if (rows == 1)
        linear_row_forward(y, x, w, b, in, out);
    else
#endif
        linear_forward_tiled(y, x, w, b, rows, in, out);
}

/* dx[r][i] += dy[r][.] . w[.][i]: the weight column is strided, but on a cacheless
 * microcontroller's SRAM a strided read costs what a contiguous one does */
void poet_linear_backward_input(float *dx, const float *dy, const float *w, uint32_t rows, uint32_t in,
                                uint32_t out)
{
#ifndef POET_KERNELS_SMALL
    if (rows == 1)
        linear_row_backward_input(dx, dy, w, in, out);
    else
#endif
        linear_backward_input_tiled(dx, dy, w, rows, in, out);
}

/* dx = the data gradient: the first contribution, which then needs no poet_zero */
void poet_linear_backward_input_set(float *dx, const float *dy, const float *w, uint32_t rows, uint32_t in,
                                    uint32_t out)
{
#ifndef POET_KERNELS_SMALL
    if (rows == 1 && linear_row_backward_input_set(dx, dy, w, in, out))
        return;
#endif
    poet_zero(dx, rows * in);
    poet_linear_backward_input(dx, dy, w, rows, in, out);
}

/* gw[o][i] += dy[.][o] . x[.][i], a sum over the rows */
POET_OUTLINE void linear_params_tiled(float *gw, float *gb, const float *dy, const float *x, uint32_t rows,
                                      uint32_t in, uint32_t out)
{
    uint32_t o;
    if (gw)
        tiled(gw, in, NULL, dy, 1, out, x, 1, in, out, in, rows, 0.0f, TILE_ADD);
    if (gb)
        for (o = 0; o < out; ++o)
            gb[o] += column_sum(dy, rows, out, o);
}

/* The same tiles and sums, applied as poet_sgd_step applies them */
POET_OUTLINE void linear_sgd_tiled(float *w, float *b, const float *dy, const float *x, uint32_t rows,
                                   uint32_t in, uint32_t out, float lr)
{
    uint32_t o;
    tiled(w, in, NULL, dy, 1, out, x, 1, in, out, in, rows, lr, TILE_SGD);
    if (b)
        for (o = 0; o < out; ++o)
            b[o] -= lr * column_sum(dy, rows, out, o);
}

void poet_linear_backward_params(float *gw, float *gb, const float *dy, const float *x, uint32_t rows,
                                 uint32_t in, uint32_t out)
{
#ifndef POET_KERNELS_SMALL
    if (rows == 1)
        linear_row_grad(gw, gb, dy, x, in, out);
    else
#endif
        linear_params_tiled(gw, gb, dy, x, rows, in, out);
}

void poet_linear_backward_params_sgd(float *w, float *b, const float *dy, const float *x, uint32_t rows,
                                     uint32_t in, uint32_t out, float lr)
{
#ifndef POET_KERNELS_SMALL
    if (rows == 1)
        linear_row_sgd(w, b, dy, x, in, out, lr);
    else
#endif
        linear_sgd_tiled(w, b, dy, x, rows, in, out, lr);
}

void poet_matmul_forward(float *c, const float *a, const float *b, uint32_t batch, uint32_t m, uint32_t k,
                         uint32_t n)
{
    uint32_t t, i, j, p;
    for (t = 0; t < batch; ++t) {
        const float *at = a + t * m * k, *bt = b + t * k * n;
        float *ct = c + t * m * n;
        for (i = 0; i < m; ++i)
            for (j = 0; j < n; ++j) {
                float acc = 0.0f;
                for (p = 0; p < k; ++p)
                    acc += at[i * k + p] * bt[p * n + j];
                ct[i * n + j] = acc;
            }
    }
}

void poet_matmul_backward_a(float *da, const float *dc, const float *b, uint32_t batch, uint32_t m,
                            uint32_t k, uint32_t n)
{
    uint32_t t, i, j, p;
    for (t = 0; t < batch; ++t) {
        const float *dct = dc + t * m * n, *bt = b + t * k * n;
        float *dat = da + t * m * k;
        for (i = 0; i < m; ++i)
            for (p = 0; p < k; ++p) {
                float acc = 0.0f;
                for (j = 0; j < n; ++j)
                    acc += dct[i * n + j] * bt[p * n + j];
                dat[i * k + p] += acc;
            }
    }
}

void poet_matmul_backward_b(float *db, const float *a, const float *dc, uint32_t batch, uint32_t m,
                            uint32_t k, uint32_t n)
{
    uint32_t t, i, j, p;
    for (t = 0; t < batch; ++t) {
        const float *at = a + t * m * k, *dct = dc + t * m * n;
        float *dbt = db + t * k * n;
        for (p = 0; p < k; ++p)
            for (j = 0; j < n; ++j) {
                float acc = 0.0f;
                for (i = 0; i < m; ++i)
                    acc += at[i * k + p] * dct[i * n + j];
                dbt[p * n + j] += acc;
            }
    }
}

static float row_max(const float *x, uint32_t d)
{
    float mx = x[0];
    uint32_t j;
    for (j = 1; j < d; ++j)
        if (x[j] > mx)
            mx = x[j];
    return mx;
}

/* sum of exp(x - max): every term is at most 1 and one of them is exactly 1, so nothing overflows
 * and the sum never underflows to zero */
static float row_sum_exp(const float *x, uint32_t d, float mx)
{
    float s = 0.0f;
    uint32_t j;
    for (j = 0; j < d; ++j)
        s += poet_expf(x[j] - mx);
    return s;
}

void poet_softmax_forward(float *y, const float *x, uint32_t rows, uint32_t d)
{
    uint32_t r, j;
    if (d == 0)
        return;
    for (r = 0; r < rows; ++r) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        const float mx = row_max(xr, d);
        float s = 0.0f, inv;
        for (j = 0; j < d; ++j) { /* reads xr[j] before writing yr[j]: safe in place */
            const float e = poet_expf(xr[j] - mx);
            yr[j] = e;
            s += e;
        }
        inv = 1.0f / s;
        for (j = 0; j < d; ++j)
            yr[j] *= inv;
    }
}

void poet_softmax_backward(float *dx, const float *dy, const float *y, uint32_t rows, uint32_t d)
{
    uint32_t r, j;
    for (r = 0; r < rows; ++r) {
        const float *dyr = dy + r * d, *yr = y + r * d;
        float *dxr = dx + r * d;
        float dot = 0.0f;
        for (j = 0; j < d; ++j)
            dot += dyr[j] * yr[j];
        for (j = 0; j < d; ++j)
            dxr[j] += yr[j] * (dyr[j] - dot);
    }
}

static int target_counts(int32_t t, uint32_t classes) { return t >= 0 && (uint32_t)t < classes; }

void poet_cross_entropy_forward(float *loss, const float *logits, const int32_t *target, uint32_t batch,
                                uint32_t classes)
{
    float total = 0.0f;
    uint32_t r, counted = 0;
    for (r = 0; r < batch; ++r) {
        const float *z = logits + r * classes;
        float mx;
        if (!target_counts(target[r], classes))
            continue;
        mx = row_max(z, classes);
        /* logsumexp(z) - z[t] = (max - z[t]) + log(sum exp(z - max)): both terms are
         * non-negative, so a large max cancels exactly instead of losing the loss's bits */
        total += (mx - z[target[r]]) + poet_logf(row_sum_exp(z, classes, mx));
        ++counted;
    }
    *loss = total / (float)counted;
}

void poet_cross_entropy_backward(float *dlogits, const float *logits, const int32_t *target, uint32_t batch,
                                 uint32_t classes)
{
    uint32_t r, j, counted = 0;
    float scale;
    for (r = 0; r < batch; ++r)
        counted += (uint32_t)target_counts(target[r], classes);
    if (counted == 0) /* torch's gradient is zero when every row is ignored */
        return;
    scale = 1.0f / (float)counted;
    for (r = 0; r < batch; ++r) {
        const float *z = logits + r * classes;
        float *dz = dlogits + r * classes;
        float mx, inv;
        if (!target_counts(target[r], classes))
            continue;
        mx = row_max(z, classes);
        inv = scale / row_sum_exp(z, classes, mx);
        for (j = 0; j < classes; ++j)
            dz[j] += poet_expf(z[j] - mx) * inv;
        dz[target[r]] -= scale;
    }
}

void poet_sgd_step(float *w, const float *g, uint32_t n, float lr)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        w[i] -= lr * g[i];
}

/* 1 - beta^step as -expm1(step * log(beta)): computed directly, 1 - 0.999^1 would keep only the
 * few bits of 0.999^1 below 1, and the early steps are where Adam's correction matters most.
 * beta - 1 is exact for beta in [0.5, 1], which log1p turns into an accurate log(beta). */
static float bias_correction(float beta, uint32_t step)
{
    const float log_beta = beta >= 0.5f ? poet_log1pf(beta - 1.0f) : poet_logf(beta);
    return -poet_expm1f((float)step * log_beta);
}

void poet_adam_step(float *w, float *m, float *v, const float *g, uint32_t n, const poet_adam_config *cfg,
                    uint32_t step)
{
    const float beta1 = cfg->beta1, beta2 = cfg->beta2, eps = cfg->eps;
    const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;
    const float step_size = cfg->lr / bias_correction(beta1, step);
    const float inv_sqrt_bc2 = 1.0f / poet_sqrtf(bias_correction(beta2, step));
    uint32_t i;
    for (i = 0; i < n; ++i) {
        const float gi = g[i];
        float mi = m[i], vi = v[i];
        /* torch's lerp: the form whose weight is below one half rounds better */
        mi = one_minus_beta1 < 0.5f ? mi + one_minus_beta1 * (gi - mi) : gi - (gi - mi) * beta1;
        vi = vi * beta2 + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] -= step_size * (mi / (poet_sqrtf(vi) * inv_sqrt_bc2 + eps));
    }
}

/* ---- SiLU and hardswish (MobileNetV3, EfficientNet), added through the operator registry ---- */

/* sigmoid(x) without overflow: exp of a non-positive argument only */
static float poet_sigmoid1(float x)
{
    float e;
    if (x >= 0.0f)
        return 1.0f / (1.0f + poet_expf(-x));
    e = poet_expf(x);
    return e / (1.0f + e);
}

void poet_silu_forward(float *y, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        y[i] = x[i] * poet_sigmoid1(x[i]);
}

/* torch's silu_backward: dy * s * (1 + x (1 - s)), s = sigmoid(x) */
void poet_silu_backward(float *dx, const float *dy, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i) {
        const float s = poet_sigmoid1(x[i]);
        dx[i] += dy[i] * s * (1.0f + x[i] * (1.0f - s));
    }
}

/* x * min(max(x + 3, 0), 6) / 6, as torch computes it */
void poet_hardswish_forward(float *y, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i) {
        const float v = x[i];
        const float r = v + 3.0f < 0.0f ? 0.0f : (v + 3.0f > 6.0f ? 6.0f : v + 3.0f);
        y[i] = v * r / 6.0f;
    }
}

/* torch's hardswish_backward, boundaries included: 0 up to -3, dy (x / 3 + 1/2) strictly between -3
 * and 3, dy from 3 on */
void poet_hardswish_backward(float *dx, const float *dy, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i) {
        const float v = x[i];
        if (v <= -3.0f)
            continue;
        dx[i] += v < 3.0f ? dy[i] * (v / 3.0f + 0.5f) : dy[i];
    }
}

/* tanh |x| = expm1(2|x|) / (expm1(2|x|) + 2), with expm1's accuracy near 0; from |x| = 9 on it
 * rounds to 1 in float (1 - tanh 9 is 3e-8, under half an ulp of 1), and expm1 would overflow far
 * out; the sign as x's (tanh -0 is -0, NaN stays NaN) */
void poet_tanh_forward(float *y, const float *x, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i) {
        const float v = x[i];
        const float a = v < 0.0f ? -v : v;
        float t;
        if (a >= 9.0f) {
            t = 1.0f;
        } else {
            const float e = poet_expm1f(2.0f * a);
            t = e / (e + 2.0f);
        }
        y[i] = v < 0.0f ? -t : (v > 0.0f ? t : v);
    }
}

void poet_tanh_backward(float *dx, const float *dy, const float *y, uint32_t n)
{
    uint32_t i;
    for (i = 0; i < n; ++i)
        dx[i] += dy[i] * (1.0f - y[i] * y[i]);
}

/* ---- embeddings ---- */

/* whether the table (rows first .. first + rows - 1) holds the row of id */
static int embedding_holds(int32_t id, uint32_t first, uint32_t rows)
{
    return id >= 0 && (uint32_t)id >= first && (uint32_t)id - first < rows;
}

void poet_embedding_forward(float *y, const int32_t *ids, const float *table, uint32_t count, uint32_t first,
                            uint32_t rows, uint32_t d)
{
    uint32_t t, j;
    for (t = 0; t < count; ++t) {
        const float *row;
        if (!embedding_holds(ids[t], first, rows))
            continue;
        row = table + ((uint32_t)ids[t] - first) * d;
        for (j = 0; j < d; ++j)
            y[t * d + j] = row[j];
    }
}

void poet_embedding_backward_params(float *gw, const float *dy, const int32_t *ids, uint32_t count, uint32_t first,
                                   uint32_t rows, uint32_t d)
{
    uint32_t t, j;
    for (t = 0; t < count; ++t) {
        float *g;
        if (!embedding_holds(ids[t], first, rows))
            continue;
        g = gw + ((uint32_t)ids[t] - first) * d;
        for (j = 0; j < d; ++j)
            g[j] += dy[t * d + j];
    }
}

void poet_embedding_backward_params_sgd(float *table, const float *dy, const int32_t *ids, uint32_t count,
                                        uint32_t first, uint32_t rows, uint32_t d, float lr)
{
    uint32_t t, u, j;
    for (t = 0; t < count; ++t) {
        const int32_t id = ids[t];
        float *w;
        int seen = 0, again = 0;
        if (!embedding_holds(id, first, rows))
            continue;
        for (u = 0; u < t && !seen; ++u) /* an earlier token of the same id updated the row already */
            seen = ids[u] == id;
        if (seen)
            continue;
        for (u = t + 1; u < count && !again; ++u)
            again = ids[u] == id;
        w = table + ((uint32_t)id - first) * d;
        for (j = 0; j < d; ++j) {
            float g = dy[t * d + j];
            if (again) /* the later tokens of this id, in order, as the gradient buffer would sum them */
                for (u = t + 1; u < count; ++u)
                    if (ids[u] == id)
                        g += dy[u * d + j];
            w[j] -= lr * g;
        }
    }
}
