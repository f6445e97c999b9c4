/* Convolution and pooling over NCHW tensors.
 *
 * Zero padding is never materialised: for each output position the kernel taps that land inside
 * the input are worked out once, so the inner loops run without bounds checks and no padded copy
 * of the input takes arena space. Index arithmetic is unsigned; an expression such as
 * `ow * stride + kw - pad` may wrap in its middle but is only evaluated for taps proven inside the
 * input, where the modular result is the true index.
 */
#include "poet_kernels.h"

/* Taps [*lo, *hi) of a k-wide window starting at o * stride - pad that land in [0, in) */
static void tap_range(uint32_t o, uint32_t stride, uint32_t pad, uint32_t k, uint32_t in, uint32_t *lo,
                      uint32_t *hi)
{
    const uint32_t base = o * stride;
    const uint32_t first = pad > base ? pad - base : 0;
    uint32_t end = in + pad > base ? in + pad - base : 0;
    if (end > k)
        end = k;
    *lo = first;
    *hi = end > first ? end : first;
}

/* Outputs [*lo, *hi) whose tap t lands in [0, in): 0 <= o * stride + t - pad < in */
static void out_range(uint32_t t, uint32_t stride, uint32_t pad, uint32_t in, uint32_t out, uint32_t *lo,
                      uint32_t *hi)
{
    const uint32_t first = t >= pad ? 0 : (pad - t + stride - 1) / stride;
    uint32_t end = in + pad > t ? (in + pad - t + stride - 1) / stride : 0;
    if (end > out)
        end = out;
    *lo = first;
    *hi = end > first ? end : first;
}

static int extent_ok(uint32_t in, uint32_t out, uint32_t k, uint32_t stride, uint32_t pad)
{
    return k >= 1 && stride >= 1 && in >= 1 && in + 2 * pad >= k && out == (in + 2 * pad - k) / stride + 1;
}

int poet_conv2d_shape_ok(const poet_conv2d_shape *s)
{
    return s->n >= 1 && s->groups >= 1 && s->c_in >= 1 && s->c_out >= 1 && s->c_in % s->groups == 0 &&
           s->c_out % s->groups == 0 && extent_ok(s->h_in, s->h_out, s->k_h, s->stride_h, s->pad_h) &&
           extent_ok(s->w_in, s->w_out, s->k_w, s->stride_w, s->pad_w);
}

/* ---- register tiles ----
 *
 * The convolutions below spend their time in two tiles. Both hold up to 16 sums in registers and
 * load each operand once per step for several of them, where a lone dot product loads two values
 * per multiply-add; with 16 accumulators, a few weights and a window of inputs they stay within the
 * 32 single-precision registers of an FPv4/FPv5 FPU. Their sizes, and the kernel width and stride
 * of the common layers (3x3 and 1x1, stride 1 and 2), are constants at each call, so the compiler
 * unrolls the tap loop, turns the window's reads into immediate offsets and loads a column shared
 * by neighbouring outputs once. Each sum runs in a register and its destination is touched once
 * per call; the terms are added in the tiles' order (window_tile: kernel rows, then channels),
 * which differs from a plain loop's only in rounding. */
/* Flash. The copies compiled for fixed kernel sizes and strides make this file about 100 KB of
 * Thumb-2 code, ten times a plain loop's. POET_KERNELS_SMALL keeps only the general copies (the
 * same tiles with sizes and strides read at run time: slower for 3x3 and 1x1 layers, 40% of the
 * code). It is the default on ARMv6-M (Cortex-M0/M0+, POET_KERNELS_FAST overrides it), whose
 * parts have little flash and no FPU, so that soft-float calls, not addressing, dominate there. */
#if !defined(POET_KERNELS_SMALL) && !defined(POET_KERNELS_FAST) && defined(__ARM_ARCH_6M__)
#define POET_KERNELS_SMALL 1
#endif

#if defined(__GNUC__)
#define POET_INLINE static inline __attribute__((always_inline))
#define POET_OUTLINE static __attribute__((noinline))
#else
#define POET_INLINE static inline
#define POET_OUTLINE static
#endif

/* acc[c * Q + q] = sum over u < nu, v < nv, t < T of a[u au + v av + t at + q aq] * w[c wc + u wu + v wv + t wt]:
 * C output channels by Q output columns, reducing over kernel rows (v), channels (u) and kernel
 * columns (t), in that order. Strides are signed: the data gradient walks dy backwards. */
POET_INLINE void window_tile(float *acc, const float *a, int32_t au, int32_t av, const int32_t at, const int32_t aq,
                             const float *w, int32_t wc, int32_t wu, int32_t wv, const int32_t wt, uint32_t nu,
                             uint32_t nv, const uint32_t T, const uint32_t C, const uint32_t Q)
{
    float s[16], xv[24];
    /* one pointer into the data and one per channel's weights, stepped along the channels with
     * constant strides: the taps' loads take immediate offsets and no address is recomputed. The
     * rows are the outer loop (at most the kernel's height), so each sum adds its terms row by
     * row, channel by channel within a row. */
    const float *xp, *wp[4];
    uint32_t u, v, t, c, q;
    for (c = 0; c < C * Q; ++c)
        s[c] = 0.0f;
    for (v = 0; v < nv; ++v) {
        xp = a + (int32_t)v * av;
        for (c = 0; c < C; ++c)
            wp[c] = w + (int32_t)c * wc + (int32_t)v * wv;
        for (u = 0; u < nu; ++u) {
            for (t = 0; t < T; ++t) {
                for (q = 0; q < Q; ++q)
                    xv[q] = xp[(int32_t)t * at + (int32_t)q * aq];
                for (c = 0; c < C; ++c) {
                    const float wt_c = wp[c][(int32_t)t * wt];
                    for (q = 0; q < Q; ++q)
                        s[c * Q + q] += wt_c * xv[q];
                }
            }
            xp += au;
            for (c = 0; c < C; ++c)
                wp[c] += wu;
        }
    }
    for (c = 0; c < C * Q; ++c)
        acc[c] = s[c];
}

/* acc[c * Q + q] = sum over u < nu, v < nv, t < nt of a[c ac + u au + v av + t at] * b[q bq + u bu + v bv + t bt]:
 * a long reduction (batch, rows, columns) for C x Q weight gradients at once, columns unrolled by 4 */
POET_INLINE void reduce_tile(float *acc, const float *a, int32_t ac, int32_t au, int32_t av, const int32_t at,
                             const float *b, int32_t bq, int32_t bu, int32_t bv, const int32_t bt, uint32_t nu,
                             uint32_t nv, uint32_t nt, const uint32_t C, const uint32_t Q)
{
    float s[16], av_[4], bv_[4];
    uint32_t u, v, t, c, q, k;
    for (c = 0; c < C * Q; ++c)
        s[c] = 0.0f;
    for (u = 0; u < nu; ++u)
        for (v = 0; v < nv; ++v) {
            /* one pointer per row, stepped along it: the loads take immediate offsets */
            const float *pa[4], *pb[4];
            for (c = 0; c < C; ++c)
                pa[c] = a + (int32_t)u * au + (int32_t)v * av + (int32_t)c * ac;
            for (q = 0; q < Q; ++q)
                pb[q] = b + (int32_t)u * bu + (int32_t)v * bv + (int32_t)q * bq;
            for (t = nt; t >= 4; t -= 4) {
                for (k = 0; k < 4; ++k) {
                    for (c = 0; c < C; ++c)
                        av_[c] = pa[c][(int32_t)k * at];
                    for (q = 0; q < Q; ++q)
                        bv_[q] = pb[q][(int32_t)k * bt];
                    for (c = 0; c < C; ++c)
                        for (q = 0; q < Q; ++q)
                            s[c * Q + q] += av_[c] * bv_[q];
                }
                for (c = 0; c < C; ++c)
                    pa[c] += 4 * at;
                for (q = 0; q < Q; ++q)
                    pb[q] += 4 * bt;
            }
            for (; t > 0; --t) {
                for (c = 0; c < C; ++c)
                    av_[c] = *pa[c];
                for (q = 0; q < Q; ++q)
                    bv_[q] = *pb[q];
                for (c = 0; c < C; ++c)
                    for (q = 0; q < Q; ++q)
                        s[c * Q + q] += av_[c] * bv_[q];
                for (c = 0; c < C; ++c)
                    pa[c] += at;
                for (q = 0; q < Q; ++q)
                    pb[q] += bt;
            }
        }
    for (c = 0; c < C * Q; ++c)
        acc[c] = s[c];
}

/* Output columns [*lo, *hi) whose whole k-wide window lies inside [0, in) */
static void interior(uint32_t stride, uint32_t pad, uint32_t k, uint32_t in, uint32_t out, uint32_t *lo,
                     uint32_t *hi)
{
    uint32_t first = (pad + stride - 1) / stride, end = in + pad >= k ? (in + pad - k) / stride + 1 : 0;
    if (first > out)
        first = out;
    if (end > out)
        end = out;
    *lo = first;
    *hi = end > first ? end : first;
}

/* A 1x1 convolution with stride 1 and no padding maps each input plane to an output plane of
 * the same layout, so it runs as if each plane were one row: the tiles then fill across what
 * would be short rows (mcu-vww's 6x6 and 3x3 planes). Returns s, or *flat holding that view. */
static const poet_conv2d_shape *as_one_row(const poet_conv2d_shape *s, poet_conv2d_shape *flat)
{
    if (s->k_h != 1 || s->k_w != 1 || s->stride_h != 1 || s->stride_w != 1 || s->pad_h || s->pad_w)
        return s;
    *flat = *s;
    flat->w_in = flat->w_out = s->h_in * s->w_in;
    flat->h_in = flat->h_out = 1;
    return flat;
}

/* C output channels x Q columns from column col on, of one output row, into y (+ bias): xr and wr
 * point at the first kernel row that lands inside the input, nv rows do; kw0 .. kw0 + nt are the
 * kernel columns that do (all of them, T, away from the padding) */
POET_INLINE void forward_tile(float *yo, const float *b, const float *xr, uint32_t col, const float *wr,
                              const poet_conv2d_shape *s,
                              uint32_t nv, uint32_t kw0, uint32_t nt, const uint32_t KH, const uint32_t KW,
                              const uint32_t SW, const uint32_t T, const uint32_t C, const uint32_t Q)
{
    const uint32_t cin_g = s->c_in / s->groups, out_plane = s->h_out * s->w_out;
    const uint32_t k_w = KW ? KW : s->k_w, taps = (KH ? KH : s->k_h) * k_w;
    const int32_t in_plane = (int32_t)(s->h_in * s->w_in), aq = (int32_t)(SW ? SW : s->stride_w);
    float acc[16];
    uint32_t c, q;
    if (KH == 1 && T == 1 && nv == 1) /* a 1x1 kernel on an input row: no row or column loop */
        window_tile(acc, xr + col, in_plane, 0, 1, aq, wr, (int32_t)(cin_g * taps), (int32_t)taps, 0, 1, cin_g, 1, 1, C, Q);
    else
        window_tile(acc, xr + (col + kw0), in_plane, (int32_t)s->w_in, 1, aq, wr + kw0, (int32_t)(cin_g * taps), (int32_t)taps,
                    (int32_t)k_w, 1, cin_g, nv, T ? T : nt, C, Q);
    for (c = 0; c < C; ++c)
        for (q = 0; q < Q; ++q)
            yo[c * out_plane + q] = b ? acc[c * Q + q] + b[c] : acc[c * Q + q];
}

/* A column next to the padding, with its own run of kernel columns: one out-of-line copy for
 * every kernel size, since these columns are few and the specialised copies would only add code */
POET_OUTLINE void forward_edge4(float *yo, const float *b, const float *xr, uint32_t col, const float *wr,
                                const poet_conv2d_shape *s, uint32_t nv, uint32_t kw0, uint32_t nt)
{
    if (nt == 2) /* a 3-wide kernel beside one column of padding */
        forward_tile(yo, b, xr, col, wr, s, nv, kw0, nt, 0, 0, 0, 2, 4, 1);
    else
        forward_tile(yo, b, xr, col, wr, s, nv, kw0, nt, 0, 0, 0, 0, 4, 1);
}

/* The same for one channel, as a plain loop: a depthwise layer has no channels to share a tile's
 * set-up over, and its planes are small enough for these columns to be a third of the work */
static void forward_edge1(float *yo, const float *b, const float *xr, uint32_t col, const float *wr,
                          const poet_conv2d_shape *s, uint32_t nv, uint32_t kw0, uint32_t nt)
{
    const uint32_t cin_g = s->c_in / s->groups, in_plane = s->h_in * s->w_in, taps = s->k_h * s->k_w;
    uint32_t u, v, t;
    float acc = 0.0f;
    for (u = 0; u < cin_g; ++u)
        for (v = 0; v < nv; ++v) {
            const float *xp = xr + u * in_plane + v * s->w_in + (col + kw0), *wp = wr + u * taps + v * s->k_w + kw0;
            for (t = 0; t < nt; ++t)
                acc += xp[t] * wp[t];
        }
    *yo = b ? acc + b[0] : acc;
}

/* Output channels [co, co + C) of sample n. KH, KW, SW: the kernel's size and column stride when
 * the call fixes them, 0 when they are read from the shape. Columns next to the padding take
 * the kernel columns that land inside the input, a runtime count; the others take all of them. */
POET_INLINE void forward_channels(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s,
                                  uint32_t n, uint32_t co, const uint32_t KH, const uint32_t KW, const uint32_t SW,
                                  const uint32_t C)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups, sw = SW ? SW : s->stride_w;
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out, k_w = KW ? KW : s->k_w;
    const uint32_t taps = (KH ? KH : s->k_h) * k_w;
    const float *xg = x + (n * s->c_in + (co / cout_g) * cin_g) * in_plane;
    const float *wo = w + co * cin_g * taps;
    const float *bo = b ? b + co : b;
    float *yo = y + (n * s->c_out + co) * out_plane;
    uint32_t oh, ow, kh0, kh1, kw0, kw1, lo, hi;
    interior(sw, s->pad_w, k_w, s->w_in, s->w_out, &lo, &hi);
    for (oh = 0; oh < s->h_out; ++oh) {
        float *yr = yo + oh * s->w_out;
        const float *xr, *wr;
        uint32_t nv;
        tap_range(oh, s->stride_h, s->pad_h, s->k_h, s->h_in, &kh0, &kh1);
        nv = kh1 - kh0;
        /* column ow's window starts at column ow * sw - pad of row xr; the unsigned index wraps
         * around in the padding, and is only used once the first tap inside is added */
        xr = xg + (oh * s->stride_h + kh0 - s->pad_h) * s->w_in;
        wr = wo + kh0 * k_w;
        for (ow = 0; ow < lo; ++ow) {
            tap_range(ow, sw, s->pad_w, k_w, s->w_in, &kw0, &kw1);
            if (C == 4)
                forward_edge4(yr + ow, bo, xr, ow * sw - s->pad_w, wr, s, nv, kw0, kw1 - kw0);
            else
                forward_edge1(yr + ow, bo, xr, ow * sw - s->pad_w, wr, s, nv, kw0, kw1 - kw0);
        }
        if (C == 1)
            for (; ow + 8 <= hi; ow += 8)
                forward_tile(yr + ow, bo, xr, ow * sw - s->pad_w, wr, s, nv, 0, k_w, KH, KW, SW, KW, C, 8);
        for (; ow + 4 <= hi; ow += 4)
            forward_tile(yr + ow, bo, xr, ow * sw - s->pad_w, wr, s, nv, 0, k_w, KH, KW, SW, KW, C, 4);
        for (; ow < hi; ++ow)
            forward_tile(yr + ow, bo, xr, ow * sw - s->pad_w, wr, s, nv, 0, k_w, KH, KW, SW, KW, C, 1);
        for (; ow < s->w_out; ++ow) {
            tap_range(ow, sw, s->pad_w, k_w, s->w_in, &kw0, &kw1);
            if (C == 4)
                forward_edge4(yr + ow, bo, xr, ow * sw - s->pad_w, wr, s, nv, kw0, kw1 - kw0);
            else
                forward_edge1(yr + ow, bo, xr, ow * sw - s->pad_w, wr, s, nv, kw0, kw1 - kw0);
        }
    }
}

POET_OUTLINE void forward_one_channel(float *y, const float *x, const float *w, const float *b,
                                      const poet_conv2d_shape *s, uint32_t n, uint32_t co)
{
    forward_channels(y, x, w, b, s, n, co, 0, 0, 0, 1);
}

/* Any padding: each input row adds its three taps to a whole output row (the row itself holds
 * the sums), and the columns next to the padding are bounds-checked */
POET_INLINE void depthwise3_rows_any(float *yc, const float *xc, const float *wc, const float *b,
                                 const poet_conv2d_shape *s, const uint32_t SW, const int accumulate)
{
    const uint32_t pw = s->pad_w, w_in = s->w_in, w_out = s->w_out;
    uint32_t oh, ow, kh, kh0, kh1, lo, hi, kw;
    interior(SW, pw, 3, w_in, w_out, &lo, &hi);
    for (oh = 0; oh < s->h_out; ++oh) {
        float *yr = yc + oh * w_out;
        tap_range(oh, s->stride_h, s->pad_h, 3, s->h_in, &kh0, &kh1);
        if (!accumulate) /* y = the sums; else y += them, row by row */
            for (ow = 0; ow < w_out; ++ow)
                yr[ow] = 0.0f;
        for (kh = kh0; kh < kh1; ++kh) {
            const float *xr = xc + (oh * s->stride_h + kh - s->pad_h) * w_in, *wk = wc + kh * 3;
            const float w0 = wk[0], w1 = wk[1], w2 = wk[2];
            const float *xp = xr + (lo * SW - pw);
            for (ow = 0; ow < lo; ++ow)
                for (kw = 0; kw < 3; ++kw)
                    if (ow * SW + kw - pw < w_in) /* unsigned: a column in the padding wraps above */
                        yr[ow] += xr[ow * SW + kw - pw] * wk[kw];
            for (ow = lo; ow + 2 <= hi; ow += 2, xp += 2 * SW) {
                yr[ow] += xp[0] * w0 + xp[1] * w1 + xp[2] * w2;
                yr[ow + 1] += xp[SW] * w0 + xp[SW + 1] * w1 + xp[SW + 2] * w2;
            }
            if (ow < hi) {
                yr[ow] += xp[0] * w0 + xp[1] * w1 + xp[2] * w2;
                ++ow;
            }
            for (ow = hi > lo ? hi : lo; ow < w_out; ++ow)
                for (kw = 0; kw < 3; ++kw)
                    if (ow * SW + kw - pw < w_in)
                        yr[ow] += xr[ow * SW + kw - pw] * wk[kw];
        }
        if (b)
            for (ow = 0; ow < w_out; ++ow)
                yr[ow] += b[0];
    }
}


/* A depthwise 3x3 channel with one column of padding each side (every depthwise layer of the
 * zoo, and their stride-1 data gradients), output row by output row. Each row is a window of
 * three input columns by up to three input rows slid along in registers, so every input is
 * loaded once per output row it feeds and the nine weights once per channel; the first and last
 * outputs leave out the padding column instead of bounds-checking it. mcu-vww's depthwise
 * planes are 3x3 to 24x24: with the sums in memory and the padding checked, the rows' set-up and
 * borders cost as much as their multiply-adds. accumulate: y += the sums (the data gradient),
 * else y = the sums, the bias added by a second pass over the row where there is one (the zoo's
 * convolutions have none: batch norm follows them). */

POET_INLINE void dw3_load(float *c, const float *const *p, const uint32_t j, const uint32_t NV)
{
    uint32_t v;
    for (v = 0; v < NV; ++v)
        c[v] = p[v][j];
}

POET_INLINE void dw3_store(float *y, float acc, const int accumulate)
{
    if (accumulate)
        *y += acc;
    else
        *y = acc;
}

/* One output from the window's columns a, b, c and the NV kernel rows wv. accumulate 2, the
 * weight gradient: wv holds the gradient's sums, y is dy, and the window's inputs times dy are
 * added to them (the same walk over the plane, the roles of y and w exchanged). */
POET_INLINE void dw3_out(float *y, const float *a, const float *b, const float *c, float *wv,
                         const int accumulate, const uint32_t NV)
{
    float acc;
    uint32_t v;
    if (accumulate == 2) {
        const float d = *y;
        for (v = 0; v < NV; ++v) {
            wv[3 * v] += a[v] * d;
            wv[3 * v + 1] += b[v] * d;
            wv[3 * v + 2] += c[v] * d;
        }
        return;
    }
    acc = a[0] * wv[0] + b[0] * wv[1] + c[0] * wv[2];
    for (v = 1; v < NV; ++v)
        acc += a[v] * wv[3 * v] + b[v] * wv[3 * v + 1] + c[v] * wv[3 * v + 2];
    dw3_store(y, acc, accumulate);
}

/* An output beside the padding: two columns, a and b, against kernel columns wv[0] and wv[1] */
POET_INLINE void dw3_out2(float *y, const float *a, const float *b, float *wv,
                          const int accumulate, const uint32_t NV)
{
    float acc;
    uint32_t v;
    if (accumulate == 2) {
        const float d = *y;
        for (v = 0; v < NV; ++v) {
            wv[3 * v] += a[v] * d;
            wv[3 * v + 1] += b[v] * d;
        }
        return;
    }
    acc = a[0] * wv[0] + b[0] * wv[1];
    for (v = 1; v < NV; ++v)
        acc += a[v] * wv[3 * v] + b[v] * wv[3 * v + 1];
    dw3_store(y, acc, accumulate);
}

/* One output row from the NV input rows from row0 on (w_in >= 3) and kernel rows wv; hi: the end
 * of the outputs whose window lies inside the row. The unrolled bodies rotate the window's
 * registers instead of moving them: three outputs at stride 1 (each loads one column), two at
 * stride 2 (two each). With PAIR, two output rows at once, which share the loads of 3 - SW
 * input rows and the row's set-up. */
#define DW3_OUT(y, a, b, c)                                                                                        \
    do {                                                                                                           \
        for (o = 0; o < CO; ++o) {                                                                                 \
            dw3_out((y) + o * ys, a, b, c, wv + 9 * o, accumulate, NV);                                            \
            if (PAIR)                                                                                              \
                dw3_out((y) + w_out, (a) + SW, (b) + SW, (c) + SW, wv, accumulate, 3);                             \
        }                                                                                                          \
    } while (0)
#define DW3_OUT2(y, a, b, w2)                                                                                      \
    do {                                                                                                           \
        for (o = 0; o < CO; ++o) {                                                                                 \
            dw3_out2((y) + o * ys, a, b, (w2) + 9 * o, accumulate, NV);                                            \
            if (PAIR)                                                                                              \
                dw3_out2((y) + w_out, (a) + SW, (b) + SW, w2, accumulate, 3);                                      \
        }                                                                                                          \
    } while (0)
/* CO: output channels that read the same input (a layer with one input channel a group and
 * several outputs, mcu-vww's stem), each input loaded once for all of them: channel o's output at
 * yr + o ys, its weights (or sums) at wv + 9 o. PAIR only with CO 1. */
POET_INLINE void dw3_row(float *yr, const float *row0, float *wv, uint32_t w_in, uint32_t w_out,
                         uint32_t hi, const uint32_t SW, const int accumulate, const uint32_t NV, const uint32_t PAIR,
                         const uint32_t CO, uint32_t ys)
{
    /* a pair of output rows (PAIR, NV 3) reads 3 + SW input rows, the second row's from SW on */
    const uint32_t NL = PAIR ? 3 + SW : NV;
    float A[5], B[5], C[5];
    const float *r[5];
    uint32_t ow = 1, v, i, o;
    for (v = 0; v < NL; ++v)
        r[v] = row0 + v * w_in;
    dw3_load(B, r, 0, NL);
    dw3_load(C, r, 1, NL);
    DW3_OUT2(yr, B, C, wv + 1);
    /* r: the first column the next output loads, 2 either way */
    for (v = 0; v < NL; ++v)
        r[v] += 2;
    if (SW == 1) {
        for (v = 0; v < NL; ++v)
            A[v] = B[v], B[v] = C[v];
        for (; ow + 3 <= hi; ow += 3) {
            dw3_load(C, r, 0, NL);
            DW3_OUT(yr + ow, A, B, C);
            dw3_load(A, r, 1, NL);
            DW3_OUT(yr + ow + 1, B, C, A);
            dw3_load(B, r, 2, NL);
            DW3_OUT(yr + ow + 2, C, A, B);
            for (v = 0; v < NL; ++v)
                r[v] += 3;
        }
        for (i = 0; i < 2; ++i) /* at most two left: unrolled, not a loop the compiler unrolls again */
            if (ow < hi) {
                dw3_load(C, r, 0, NL);
                DW3_OUT(yr + ow, A, B, C);
                for (v = 0; v < NL; ++v)
                    A[v] = B[v], B[v] = C[v], r[v] += 1;
                ++ow;
            }
        if (ow < w_out) /* the last column, beside the padding */
            DW3_OUT2(yr + ow, A, B, wv);
    } else {
        for (v = 0; v < NL; ++v)
            A[v] = C[v];
        for (; ow + 2 <= hi; ow += 2) {
            dw3_load(B, r, 0, NL);
            dw3_load(C, r, 1, NL);
            DW3_OUT(yr + ow, A, B, C);
            dw3_load(B, r, 2, NL);
            dw3_load(A, r, 3, NL);
            DW3_OUT(yr + ow + 1, C, B, A);
            for (v = 0; v < NL; ++v)
                r[v] += 4;
        }
        if (ow < hi) { /* at most one left */
            dw3_load(B, r, 0, NL);
            dw3_load(C, r, 1, NL);
            DW3_OUT(yr + ow, A, B, C);
            for (v = 0; v < NL; ++v)
                A[v] = C[v], r[v] += 2;
            ++ow;
        }
        if (ow < w_out) { /* an odd row's last column, beside the padding */
            dw3_load(B, r, 0, NL);
            DW3_OUT2(yr + ow, A, B, wv);
        }
    }
}
#undef DW3_OUT
#undef DW3_OUT2

#ifndef POET_KERNELS_SMALL
/* ---- depthwise 3x3 column strips ----
 *
 * A depthwise 3x3 channel with one row and column of padding and the same stride along both axes
 * (1 or 2), as strips of Q output columns walked down the plane: each step loads one input row's
 * (Q - 1) SW + 3 columns at immediate offsets from one pointer, and the window's three rows rotate
 * through registers, so an input is loaded once per strip it feeds (at stride 1, (Q + 2) / Q
 * times), the nine weights (or the weight gradient's nine sums) stay in registers for the whole
 * plane, and the only address arithmetic is one addition per row read or written. The padding
 * never reaches the inner loop: the strip against the left edge, the one against the right edge
 * and the first and last rows of each strip are their own unrolled copies that leave out the
 * taps in the padding, so on mcu-vww's 6x6 planes, where those are most of the outputs, they cost
 * no tests and no set-up of their own. MODE 0: y = the sums (no bias: the caller adds it); 1:
 * y += the sums (the data gradient); 2: y is dy, read only, and wv the weight gradient's sums, to
 * which each window times its dy is added. The sums run kernel row by kernel row, column by
 * column. */
#define DWC_NC(Q, SW) (((Q) - 1) * (SW) + 3)

/* v[j] = p[j - 1]: a window row's NC input columns, from the one left of p on; the first (LEFT)
 * or the last (RIGHT) lies in the padding, is not loaded and is never read */
POET_INLINE void dwc_load(float *v, const float *p, const uint32_t NC, const uint32_t LEFT, const uint32_t RIGHT)
{
    uint32_t j;
    for (j = LEFT ? 1 : 0; j < (RIGHT ? NC - 1 : NC); ++j)
        v[j] = p[(int32_t)j - 1];
}

/* Tap (v, t) of output q: MODE 2 adds window times dy into the sum, else window times weight
 * into the output's; the first product starts a sum (no zero, no first addition) */
POET_INLINE void dwc_tap(float *acc, int *first, float *wv, const float *const *rows, const float *d, uint32_t q,
                         uint32_t v, uint32_t t, const int MODE, const uint32_t SW, const uint32_t NC,
                         const uint32_t LEFT, const uint32_t RIGHT, const uint32_t TOP, const uint32_t BOT)
{
    const uint32_t j = q * SW + t; /* the window column */
    if (v < TOP || v + BOT > 2 || (LEFT && j == 0) || (RIGHT && j == NC - 1))
        return;
    if (MODE == 2)
        wv[3 * v + t] += rows[v][j] * d[q];
    else if (first[q])
        acc[q] = rows[v][j] * wv[3 * v + t], first[q] = 0;
    else
        acc[q] += rows[v][j] * wv[3 * v + t];
}

/* Q outputs of one row from window rows a, b, c (kernel rows 0, 1, 2): TOP, BOT: the first TOP
 * rows, the last BOT, lie in the padding (1 or 2). ROWS: kernel row by kernel row for all Q outputs, so that a window row is
 * done with before the next is needed (at stride 2 the three rows and the weight gradient's sums
 * would not fit the registers at once); else output by output. Each sum takes the same terms in
 * the same order either way, which only changes how the compiler schedules and allocates; by
 * measurement on the M4F, ROWS but for the stride-1 forward. */
POET_INLINE void dwc_out(float *y, const float *a, const float *b, const float *c, float *wv, const int MODE,
                         const uint32_t SW, const uint32_t Q, const uint32_t LEFT, const uint32_t RIGHT,
                         const uint32_t TOP, const uint32_t BOT)
{
    const uint32_t NC = DWC_NC(Q, SW);
    const int ROWS = SW == 2 || (MODE != 0 && MODE != 3);
    const float *rows[3];
    float acc[3], d[3];
    int first[3];
    uint32_t q, v, t;
    rows[0] = a, rows[1] = b, rows[2] = c;
    for (q = 0; q < Q; ++q) {
        d[q] = MODE == 2 ? y[q] : 0.0f;
        acc[q] = 0.0f, first[q] = 1;
    }
    if (ROWS)
        for (v = 0; v < 3; ++v)
            for (q = 0; q < Q; ++q)
                for (t = 0; t < 3; ++t)
                    dwc_tap(acc, first, wv, rows, d, q, v, t, MODE, SW, NC, LEFT, RIGHT, TOP, BOT);
    else
        for (q = 0; q < Q; ++q) { /* (the stride-1 forward only: one scalar sum at a time, which
                                    * the compiler keeps in registers better than acc[q]) */
            float s = 0.0f;
            int f = 1;
            for (v = TOP; v + BOT < 3; ++v)
                for (t = 0; t < 3; ++t) {
                    const uint32_t j = q * SW + t;
                    if ((LEFT && j == 0) || (RIGHT && j == NC - 1))
                        continue;
                    if (f)
                        s = rows[v][j] * wv[3 * v + t], f = 0;
                    else
                        s += rows[v][j] * wv[3 * v + t];
                }
            acc[q] = s;
        }
    for (q = 0; q < Q; ++q) {
        if (MODE == 1)
            y[q] += acc[q];
        else if (MODE == 0 || MODE == 3)
            y[q] = acc[q];
    }
}

/* Output columns c0 .. c0 + Q of every row. PADH: the rows of padding above and below (1; 2 at
 * stride 1 for the data gradient of a strip of rows whose halo is given, h_in >= 2; such a strip's
 * forward and weight gradient, padding 0, take the window walk, dwr_pass). The unrolled steps
 * rotate the window's rows through A, B and C instead of moving them: three output rows at
 * stride 1 (each loads one input row), two at stride 2 (two each, the last carried into the next);
 * the rows left after them, and the last ones with rows in the padding, take the registers where
 * the rotation left the window. */
POET_INLINE void dwc_tail1(float *yp, const float *X, const float *Y, float *wv, uint32_t w_out, const int MODE,
                           const uint32_t Q, const uint32_t LEFT, const uint32_t RIGHT, const uint32_t PADH)
{
    /* stride 1, below the last full row: X and Y the input's last two rows */
    if (PADH >= 1)
        dwc_out(yp, X, Y, Y, wv, MODE, 1, Q, LEFT, RIGHT, 0, 1);
    if (PADH == 2)
        dwc_out(yp + w_out, Y, Y, Y, wv, MODE, 1, Q, LEFT, RIGHT, 0, 2);
}

POET_INLINE void dwc_strip(float *y, const float *x, float *wv, uint32_t c0, const poet_conv2d_shape *s,
                           const int MODE, const uint32_t SW, const uint32_t Q, const uint32_t LEFT,
                           const uint32_t RIGHT, const uint32_t PADH)
{
    const uint32_t NC = DWC_NC(Q, SW), w_in = s->w_in, w_out = s->w_out, h_in = s->h_in;
    const float *xp = x + c0 * SW; /* row 0, the column right of the window's first */
    float *yp = y + c0;
    float A[DWC_NC(3, 2)], B[DWC_NC(3, 2)], C[DWC_NC(3, 2)];
    uint32_t r, i;
    if (SW == 1) {
        /* output row r from input rows r - PADH .. r + 2 - PADH: A and B hold the first two, xp the
         * third; the h_in - 2 rows whose window lies inside the input in steps of three */
        dwc_load(A, xp, NC, LEFT, RIGHT);
        dwc_load(B, xp + w_in, NC, LEFT, RIGHT);
        if (PADH == 2) /* row 0: only its bottom row inside */
            dwc_out(yp, A, A, A, wv, MODE, SW, Q, LEFT, RIGHT, 2, 0), yp += w_out;
        if (PADH >= 1) /* its top row in the padding */
            dwc_out(yp, A, A, B, wv, MODE, SW, Q, LEFT, RIGHT, 1, 0), yp += w_out;
        xp += 2 * w_in;
        /* one pointer each, stepped a row at a time, and a count down: no other address arithmetic */
        for (i = (h_in - 2) / 3, r = 2 + 3 * i; i; --i) { /* r: the input rows the steps read */
            dwc_load(C, xp, NC, LEFT, RIGHT);
            xp += w_in;
            dwc_out(yp, A, B, C, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
            yp += w_out;
            dwc_load(A, xp, NC, LEFT, RIGHT);
            xp += w_in;
            dwc_out(yp, B, C, A, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
            yp += w_out;
            dwc_load(B, xp, NC, LEFT, RIGHT);
            xp += w_in;
            dwc_out(yp, C, A, B, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
            yp += w_out;
        }
        /* 0, 1 or 2 full rows more, then those with bottom rows in the padding */
        if (r == h_in) {
            dwc_tail1(yp, A, B, wv, w_out, MODE, Q, LEFT, RIGHT, PADH);
            return;
        }
        dwc_load(C, xp, NC, LEFT, RIGHT);
        dwc_out(yp, A, B, C, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
        if (r + 1 == h_in) {
            dwc_tail1(yp + w_out, B, C, wv, w_out, MODE, Q, LEFT, RIGHT, PADH);
            return;
        }
        dwc_load(A, xp + w_in, NC, LEFT, RIGHT);
        dwc_out(yp + w_out, B, C, A, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
        dwc_tail1(yp + 2 * w_out, C, A, wv, w_out, MODE, Q, LEFT, RIGHT, PADH);
    } else {
        /* output row r from input rows 2r - 1 (carried in A) .. 2r + 1; xp at row 2r */
        dwc_load(B, xp, NC, LEFT, RIGHT);
        dwc_load(A, xp + w_in, NC, LEFT, RIGHT);
        dwc_out(yp, B, B, A, wv, MODE, SW, Q, LEFT, RIGHT, 1, 0); /* row 0: its top row in the padding */
        xp += 2 * w_in, yp += w_out;
        for (i = (h_in - 2) / 4, r = 1 + 2 * i; i; --i) {
            dwc_load(B, xp, NC, LEFT, RIGHT);
            xp += w_in;
            dwc_load(C, xp, NC, LEFT, RIGHT);
            xp += w_in;
            dwc_out(yp, A, B, C, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
            yp += w_out;
            dwc_load(B, xp, NC, LEFT, RIGHT);
            xp += w_in;
            dwc_load(A, xp, NC, LEFT, RIGHT);
            xp += w_in;
            dwc_out(yp, C, B, A, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
            yp += w_out;
        }
        /* input rows 2r .. h_in - 1 left: none, one (the last output row's bottom one in the
         * padding), two (a full row), or three (a full row and such a last one) */
        if (2 * r < h_in)
            dwc_load(B, xp, NC, LEFT, RIGHT);
        if (2 * r + 1 == h_in)
            dwc_out(yp, A, B, B, wv, MODE, SW, Q, LEFT, RIGHT, 0, 1);
        else if (2 * r + 1 < h_in) {
            dwc_load(C, xp + w_in, NC, LEFT, RIGHT);
            dwc_out(yp, A, B, C, wv, MODE, SW, Q, LEFT, RIGHT, 0, 0);
            if (2 * r + 2 < h_in) {
                dwc_load(B, xp + 2 * w_in, NC, LEFT, RIGHT);
                dwc_out(yp + w_out, C, B, B, wv, MODE, SW, Q, LEFT, RIGHT, 0, 1);
            }
        }
    }
}

/* Whether the strips take the plane: 3x3, padding 1 along W, the same stride 1 or 2 along both
 * axes, a plane wide enough for a left strip of two columns away from the right edge, and along
 * H padding 1 (h_in >= 2) or, at stride 1, 2 (the data gradient of a strip of rows with its halo,
 * h_in >= 2) */
static int dwc_ok(const poet_conv2d_shape *s, uint32_t SW)
{
    return s->k_h == 3 && s->k_w == 3 && s->pad_w == 1 && s->stride_h == SW && s->stride_w == SW &&
           (SW == 1 || SW == 2) && s->w_in >= SW + 2 &&
           ((s->pad_h == 1 && s->h_in >= 2) || (s->pad_h == 2 && SW == 1 && s->h_in >= 2));
}

/* One plane: the left strip of two columns, strips of QM, then what is left against the right
 * edge. QM: 2 at stride 1 (the window's 12 inputs, 9 weights or sums and the temporaries fill
 * the registers at 3), 3 at stride 2. */
POET_INLINE void dwc_plane(float *y, const float *x, float *wv, const poet_conv2d_shape *s, const int MODE,
                           const uint32_t SW, const uint32_t PADH)
{
    const uint32_t w_in = s->w_in, w_out = s->w_out, QM = SW == 1 ? 2 : 3;
    uint32_t c0 = 2;
    dwc_strip(y, x, wv, 0, s, MODE, SW, 2, 1, 0, PADH);
    for (; c0 + QM <= w_out && (c0 + QM - 1) * SW + 1 < w_in; c0 += QM)
        dwc_strip(y, x, wv, c0, s, MODE, SW, QM, 0, 0, PADH);
    /* left: none, a strip of QM against the edge, or fewer columns, against it or not */
    if (c0 + QM <= w_out)
        dwc_strip(y, x, wv, c0, s, MODE, SW, QM, 0, 1, PADH);
    else if (QM == 3 && c0 + 2 == w_out && (w_out - 1) * SW + 1 < w_in)
        dwc_strip(y, x, wv, c0, s, MODE, SW, 2, 0, 0, PADH);
    else if (QM == 3 && c0 + 2 == w_out)
        dwc_strip(y, x, wv, c0, s, MODE, SW, 2, 0, 1, PADH);
    else if (c0 + 1 == w_out && (w_out - 1) * SW + 1 < w_in)
        dwc_strip(y, x, wv, c0, s, MODE, SW, 1, 0, 0, PADH);
    else if (c0 + 1 == w_out)
        dwc_strip(y, x, wv, c0, s, MODE, SW, 1, 0, 1, PADH);
}

/* A whole depthwise layer (one input and one output channel a group) in column strips, all its
 * planes in one call, so that mcu-vww's small ones do not pay a call and the checks each. MODE 0:
 * the forward, out = y from in = x, bias b; 1: the data gradient, out = dx += from in = dy with
 * each kernel turned around, t the walk's geometry (the layer's with input and output exchanged,
 * the padding 2 - 1 = 1); 3: the data gradient written (dx =, every element: the forward's walk
 * on the kernels turned around, for poet_conv2d_backward_input_set). */
POET_INLINE void dwc_layer(float *out, const float *in, const float *w, const float *b, const poet_conv2d_shape *shape,
                           const int MODE, const uint32_t SW, const uint32_t PADH)
{
    /* a copy: the stores into out might otherwise alias the shape, re-read every plane */
    const poet_conv2d_shape copy = *shape, *t = &copy;
    const uint32_t in_plane = t->h_in * t->w_in, out_plane = t->h_out * t->w_out, C = t->c_out;
    uint32_t n, c, k;
    for (n = 0; n < t->n; ++n)
        for (c = 0; c < C; ++c) {
            float wv[9], *o = out + (n * C + c) * out_plane;
            for (k = 0; k < 9; ++k)
                wv[k] = MODE == 1 || MODE == 3 ? w[c * 9 + 8 - k] : w[c * 9 + k];
            dwc_plane(o, in + (n * C + c) * in_plane, wv, t, MODE, SW, PADH);
            if (b)
                for (k = 0; k < out_plane; ++k)
                    o[k] += b[c];
        }
}

/* the layers' (padding 1 along H; a strip's rows with their halo take dwr_forward) */
POET_OUTLINE void dwc_forward_s1(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
    dwc_layer(y, x, w, b, s, 0, 1, 1);
}

POET_OUTLINE void dwc_forward_s2(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
    dwc_layer(y, x, w, b, s, 0, 2, 1);
}

/* The data gradient written (dx =) at stride 1: a layer's (padding 1 turned around) and a strip's
 * of rows (padding 0 along H: 2 turned around) */
POET_OUTLINE void dwc_backward_input_set_s1(float *dx, const float *dy, const float *w, const poet_conv2d_shape *t)
{
    dwc_layer(dx, dy, w, NULL, t, 3, 1, 1);
}

POET_OUTLINE void dwc_backward_input_set_s1_p2(float *dx, const float *dy, const float *w, const poet_conv2d_shape *t)
{
    dwc_layer(dx, dy, w, NULL, t, 3, 1, 2);
}

POET_OUTLINE void dwc_backward_input_s1(float *dx, const float *dy, const float *w, const poet_conv2d_shape *t)
{
    dwc_layer(dx, dy, w, NULL, t, 1, 1, 1);
}

/* The layer's forward by its stride */
static void dwc_forward(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
    if (s->stride_w == 1)
        dwc_forward_s1(y, x, w, b, s);
    else
        dwc_forward_s2(y, x, w, b, s);
}

/* The weight gradient of such a layer: channel by channel, its nine sums in registers over the
 * batch's planes; gw += them (sgd 0), or w -= lr them */
POET_INLINE void dwc_grad_layer(float *gw, const float *dy, const float *x, const poet_conv2d_shape *shape, float lr,
                                int sgd, const uint32_t SW, const uint32_t PADH)
{
    /* a copy: the stores into gw might otherwise alias the shape, re-read every channel */
    const poet_conv2d_shape copy = *shape, *s = &copy;
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out, C = s->c_out;
    uint32_t n, c, k;
    for (c = 0; c < C; ++c) {
        float acc[9], *at = gw + c * 9;
        for (k = 0; k < 9; ++k)
            acc[k] = 0.0f;
        for (n = 0; n < s->n; ++n) /* dy is only read */
            dwc_plane((float *)(uintptr_t)(dy + (n * C + c) * out_plane), x + (n * C + c) * in_plane, acc, s, 2, SW, PADH);
        for (k = 0; k < 9; ++k) {
            if (sgd)
                at[k] -= lr * acc[k];
            else
                at[k] += acc[k];
        }
    }
}

POET_OUTLINE void dwc_grad_s1(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s, float lr, int sgd)
{
    dwc_grad_layer(gw, dy, x, s, lr, sgd, 1, 1);
}

POET_OUTLINE void dwc_grad_s2(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s, float lr, int sgd)
{
    dwc_grad_layer(gw, dy, x, s, lr, sgd, 2, 1);
}

/* Whether a layer is depthwise (one input and one output channel a group) with padding 1 along
 * H and the strips take it (a strip of rows with its halo, padding 0, takes the window walk below,
 * dwr_ok; padding 2 is only a data gradient's geometry) */
static int dwc_layer_ok(const poet_conv2d_shape *s, uint32_t SW)
{
    return s->groups == s->c_in && s->groups == s->c_out && s->pad_h == 1 && dwc_ok(s, SW);
}

/* ---- depthwise 3x3 windows of a few rows ----
 *
 * The strip executor's depthwise windows: a few output rows (3 or 4 in mcu-vww's) with their
 * input rows given (padding 0 along H, 1 along W), the same stride 1 or 2 along both axes. Column
 * strips pay their set-up and first rows once a strip, and the row walks once a row; these walk
 * R output rows at once along the columns (R 3 at stride 1; at stride 2, 4 for a plane of four
 * rows, mcu-vww's, else 2: the (R - 1) SW + 3 input rows' window columns, the nine weights or the
 * weight gradient's nine sums and the temporaries fill the registers), so that mcu-vww's windows
 * take one pass a plane. Each output column loads SW new columns of the NL input rows (one
 * pointer each, immediate offsets along the row), the window's three columns rotate through
 * registers, and the padding columns (the first output's left, the last one's right where it
 * reaches past the row) are their own copies. MODE 0: y = the sums (the bias, if any, added by the caller); 2: y is dy, read only, and
 * wv the weight gradient's sums, each window times its dy added to them. An output's sum runs
 * kernel row by kernel row, column by column, the first product starting it; the weight
 * gradient's sums run over the outputs in the walk's order. The passes are out of line, each over
 * a layer's channels; where a plane takes several, at stride 2, a channel's passes are one call,
 * its weights or sums in registers through them. On the M4F the steps of four rows at stride 2
 * cost 2.76 instructions a multiply-add in the weight gradient (two rows: 2.81), the left and
 * right columns and each pass's set-up the rest (benchmarks/FIRMWARE.md). */
#define DWR_NL(R, SW) (((R) - 1) * (SW) + 3)

/* Output column q of the R rows yr[] from window columns a, b, c (NL input rows each); LEFT: a
 * lies in the padding and is never read, RIGHT: c. SET (the weight gradient's first pass): the
 * kernel columns t (bit t) whose sums this output's first row starts, = instead of +=. */
POET_INLINE void dwr_out(float *const *yr, uint32_t q, const float *a, const float *b, const float *c, float *wv,
                         const int MODE, const uint32_t SW, const uint32_t R, const uint32_t LEFT,
                         const uint32_t RIGHT, const uint32_t SET)
{
    uint32_t r, v, t;
    const float *col[3];
    col[0] = a, col[1] = b, col[2] = c;
    for (r = 0; r < R; ++r) {
        const uint32_t i = r * SW; /* the output row's first input row */
        if (MODE == 2) {
            const float d = yr[r][q];
            for (v = 0; v < 3; ++v)
                for (t = 0; t < 3; ++t) {
                    if ((LEFT && t == 0) || (RIGHT && t == 2))
                        continue;
                    if (r == 0 && (SET >> t & 1))
                        wv[3 * v + t] = col[t][i + v] * d;
                    else
                        wv[3 * v + t] += col[t][i + v] * d;
                }
        } else {
            float s = LEFT ? b[i] * wv[1] : a[i] * wv[0];
            if (!LEFT)
                s += b[i] * wv[1];
            if (!RIGHT)
                s += c[i] * wv[2];
            for (v = 1; v < 3; ++v) {
                if (!LEFT)
                    s += a[i + v] * wv[3 * v];
                s += b[i + v] * wv[3 * v + 1];
                if (!RIGHT)
                    s += c[i + v] * wv[3 * v + 2];
            }
            yr[r][q] = s;
        }
    }
}

/* dwr_out at stride 2 for an output away from the padding whose new window columns b and c are
 * loaded, from columns jb and jc of the rows p, as its rows need them: with four output rows a
 * pass the window's 27 values would not fit the registers beside the nine weights or sums, and
 * only the rows in use and the column carried to the next output (c) are live this way */
POET_INLINE void dwr_out_lazy(float *const *yr, uint32_t q, const float *a, float *b, float *c,
                              const float *const *p, const uint32_t jb, const uint32_t jc, float *wv, const int MODE,
                              const uint32_t SW, const uint32_t R)
{
    uint32_t r, v;
    for (r = 0; r < R; ++r) {
        const uint32_t i = r * SW;
        const float d = MODE == 2 ? yr[r][q] : 0.0f;
        float s = 0.0f;
        for (v = 0; v < 3; ++v) {
            if (r == 0 || v >= 3 - SW)
                b[i + v] = p[i + v][jb], c[i + v] = p[i + v][jc];
            if (MODE == 2) {
                wv[3 * v] += a[i + v] * d;
                wv[3 * v + 1] += b[i + v] * d;
                wv[3 * v + 2] += c[i + v] * d;
            } else {
                if (v == 0)
                    s = a[i] * wv[0];
                else
                    s += a[i + v] * wv[3 * v];
                s += b[i + v] * wv[3 * v + 1];
                s += c[i + v] * wv[3 * v + 2];
            }
        }
        if (MODE != 2)
            yr[r][q] = s;
    }
}

/* Outputs q and q + 1 at stride 2 from the carried column A and columns j to j + 3 of the rows p;
 * A carries the last of them to the next pair */
POET_INLINE void dwr_pair(float *const *yr, uint32_t q, float *A, float *B, float *C, const float *const *p,
                          const uint32_t j, float *wv, const int MODE, const uint32_t R)
{
    dwr_out_lazy(yr, q, A, B, C, p, j, j + 1, wv, MODE, 2, R);
    dwr_out_lazy(yr, q + 1, C, B, A, p, j + 2, j + 3, wv, MODE, 2, R);
}

POET_INLINE void dwr_load(float *col, const float *const *p, const uint32_t j, const uint32_t NL)
{
    uint32_t v;
    for (v = 0; v < NL; ++v)
        col[v] = p[v][j];
}

/* The end of a row at stride 2, from output ow (at yr[] + q, its window's new columns from j on
 * in the rows p, its first in A): at most one output left inside, then the last column, beside
 * the padding */
POET_INLINE void dwr_s2_end(float *const *yr, const uint32_t q, float *A, float *B, float *C, const float *const *p,
                            const uint32_t j, uint32_t ow, uint32_t hi, uint32_t w_out, float *wv, const int MODE,
                            const uint32_t R)
{
    const uint32_t NL = DWR_NL(R, 2);
    if (ow < hi) {
        dwr_load(B, p, j, NL);
        dwr_load(C, p, j + 1, NL);
        dwr_out(yr, q, A, B, C, wv, MODE, 2, R, 0, 0, 0);
        if (ow + 1 < w_out) {
            dwr_load(B, p, j + 2, NL);
            dwr_out(yr, q + 1, C, B, B, wv, MODE, 2, R, 0, 1, 0);
        }
    } else if (ow < w_out) {
        dwr_load(B, p, j, NL);
        dwr_out(yr, q, A, B, B, wv, MODE, 2, R, 0, 1, 0);
    }
}

/* A pass's start: the row pointers (NL input rows from x, R output rows from y), and output 0,
 * whose window is columns -1 (the padding), 0 and 1, left in B and C */
POET_INLINE void dwr_first(const float **p, float **yr, float *B, float *C, const float *x, float *y, float *wv,
                           uint32_t w_in, uint32_t w_out, const int MODE, const uint32_t SW, const uint32_t R,
                           const uint32_t INIT)
{
    const uint32_t NL = DWR_NL(R, SW);
    uint32_t v;
    for (v = 0; v < NL; ++v)
        p[v] = x + v * w_in;
    for (v = 0; v < R; ++v)
        yr[v] = y + v * w_out;
    dwr_load(B, p, 0, NL);
    dwr_load(C, p, 1, NL);
    dwr_out(yr, 0, B, B, C, wv, MODE, SW, R, 1, 0, INIT ? 6 : 0);
}

/* dwr_pass at stride 1: output ow's window in A, B and the column p points at */
POET_INLINE void dwr_pass_s1(float *y, const float *x, float *wv, uint32_t w_in, uint32_t w_out, const int MODE,
                             const uint32_t R, const uint32_t INIT)
{
    const uint32_t SW = 1;
    const uint32_t NL = DWR_NL(R, SW);
    /* the outputs whose window lies inside the row: ow SW + 1 < w_in (2 or more: w_in >= SW + 2) */
    const uint32_t hi = (w_in - 2) / SW + 1 < w_out ? (w_in - 2) / SW + 1 : w_out;
    float A[DWR_NL(3, 1)], B[DWR_NL(3, 1)], C[DWR_NL(3, 1)];
    const float *p[DWR_NL(3, 1)];
    float *yr[3];
    uint32_t v, r, i, ow;
    dwr_first(p, yr, B, C, x, y, wv, w_in, w_out, MODE, SW, R, INIT);
    for (v = 0; v < NL; ++v)
        A[v] = B[v], B[v] = C[v], p[v] += 2;
    /* output 1 on its own, where INIT starts the kernel's column 0 */
    dwr_load(C, p, 0, NL);
    dwr_out(yr, 1, A, B, C, wv, MODE, SW, R, 0, 0, INIT ? 1 : 0);
    for (v = 0; v < NL; ++v)
        A[v] = B[v], B[v] = C[v], p[v] += 1;
    for (r = 0; r < R; ++r)
        yr[r] += 2;
    for (i = (hi - 2) / 3; i; --i) {
        dwr_load(C, p, 0, NL);
        dwr_out(yr, 0, A, B, C, wv, MODE, SW, R, 0, 0, 0);
        dwr_load(A, p, 1, NL);
        dwr_out(yr, 1, B, C, A, wv, MODE, SW, R, 0, 0, 0);
        dwr_load(B, p, 2, NL);
        dwr_out(yr, 2, C, A, B, wv, MODE, SW, R, 0, 0, 0);
        for (v = 0; v < NL; ++v)
            p[v] += 3;
        for (r = 0; r < R; ++r)
            yr[r] += 3;
    }
    /* at most two left, then the last column, beside the padding: each its own copy, so
     * that the window's columns stay where the rotation left them */
    ow = 2 + (hi - 2) / 3 * 3;
    if (ow + 2 <= hi) {
        dwr_load(C, p, 0, NL);
        dwr_out(yr, 0, A, B, C, wv, MODE, SW, R, 0, 0, 0);
        dwr_load(A, p, 1, NL);
        dwr_out(yr, 1, B, C, A, wv, MODE, SW, R, 0, 0, 0);
        if (ow + 2 < w_out)
            dwr_out(yr, 2, C, A, A, wv, MODE, SW, R, 0, 1, 0);
    } else if (ow < hi) {
        dwr_load(C, p, 0, NL);
        dwr_out(yr, 0, A, B, C, wv, MODE, SW, R, 0, 0, 0);
        if (ow + 1 < w_out)
            dwr_out(yr, 1, B, C, C, wv, MODE, SW, R, 0, 1, 0);
    } else if (ow < w_out)
        dwr_out(yr, 0, A, B, B, wv, MODE, SW, R, 0, 1, 0);
}

/* dwr_pass at stride 2: output ow's window in A and the two columns p points at (its own arrays:
 * four rows need nine, and the stride-1 walk sized for them measured 2% slower) */
POET_INLINE void dwr_pass_s2(float *y, const float *x, float *wv, uint32_t w_in, uint32_t w_out, const int MODE,
                             const uint32_t R, const uint32_t INIT)
{
    const uint32_t SW = 2;
    const uint32_t NL = DWR_NL(R, SW);
    /* the outputs whose window lies inside the row: ow SW + 1 < w_in (2 or more: w_in >= SW + 2) */
    const uint32_t hi = (w_in - 2) / SW + 1 < w_out ? (w_in - 2) / SW + 1 : w_out;
    float A[DWR_NL(4, 2)], B[DWR_NL(4, 2)], C[DWR_NL(4, 2)];
    const float *p[DWR_NL(4, 2)];
    float *yr[4];
    uint32_t v, r, i, ow;
    dwr_first(p, yr, B, C, x, y, wv, w_in, w_out, MODE, SW, R, INIT);
    for (v = 0; v < NL; ++v)
        A[v] = C[v], p[v] += 2;
    dwr_load(B, p, 0, NL); /* output 1 on its own, where INIT starts the kernel's column 0 */
    dwr_load(C, p, 1, NL);
    dwr_out(yr, 1, A, B, C, wv, MODE, SW, R, 0, 0, INIT ? 1 : 0);
    for (v = 0; v < NL; ++v)
        A[v] = C[v], p[v] += 2;
    for (r = 0; r < R; ++r)
        yr[r] += 2;
    /* pairs of outputs; at four rows two pairs a step, which share the steps of the 13 rows'
     * pointers (one pair a step, and the compiler's own unrolling, measured worse) */
    for (i = R == 4 ? (hi - 2) / 4 : 0; i; --i) {
        dwr_pair(yr, 0, A, B, C, p, 0, wv, MODE, R);
        dwr_pair(yr, 2, A, B, C, p, 4, wv, MODE, R);
        for (v = 0; v < NL; ++v)
            p[v] += 8;
        for (r = 0; r < R; ++r)
            yr[r] += 4;
    }
    for (i = R == 4 ? 0 : (hi - 2) / 2; i; --i) {
        dwr_pair(yr, 0, A, B, C, p, 0, wv, MODE, R);
        for (v = 0; v < NL; ++v)
            p[v] += 4;
        for (r = 0; r < R; ++r)
            yr[r] += 2;
    }
    ow = 2 + (hi - 2) / 2 * 2;
    if (R == 4 && (hi - 2) & 2) { /* a pair left, at immediate offsets: no pointer steps after it */
        dwr_pair(yr, 0, A, B, C, p, 0, wv, MODE, R);
        dwr_s2_end(yr, 2, A, B, C, p, 4, ow, hi, w_out, wv, MODE, R);
    } else
        dwr_s2_end(yr, 0, A, B, C, p, 0, ow, hi, w_out, wv, MODE, R);
}

/* R output rows from y on (rows w_out apart) from the NL input rows from x on (w_in apart). INIT
 * (the weight gradient): the sums start with the first outputs' products (outputs 0 and 1, whose
 * first rows hold a term of each), not from wv. */
POET_INLINE void dwr_pass(float *y, const float *x, float *wv, uint32_t w_in, uint32_t w_out, const int MODE,
                          const uint32_t SW, const uint32_t R, const uint32_t INIT)
{
    if (SW == 1)
        dwr_pass_s1(y, x, wv, w_in, w_out, MODE, R, INIT);
    else
        dwr_pass_s2(y, x, wv, w_in, w_out, MODE, R, INIT);
}

/* The passes out of line, one for each stride and number of rows: a walk has the registers to
 * itself, with nothing of the layer's loops live across it.
 *
 * The forward's, over C channels (planes xs and ys apart, their weights 9): R rows of each. */
#define DWR_FWD(NAME, SW, R)                                                                                   \
    POET_OUTLINE void NAME(float *y, const float *x, const float *w, uint32_t w_in, uint32_t w_out, uint32_t C,   \
                           uint32_t ys, uint32_t xs)                                                          \
    {                                                                                                        \
        float wv[9];                                                                                         \
        uint32_t k;                                                                                          \
        for (; C; --C, y += ys, x += xs, w += 9) {                                                           \
            for (k = 0; k < 9; ++k)                                                                          \
                wv[k] = w[k];                                                                                \
            dwr_pass(y, x, wv, w_in, w_out, 0, SW, R, 0);                                                    \
        }                                                                                                    \
    }
/* The weight gradient's, over a channel's planes one pass after another: its nine sums start at
 * zero (flags DWR_INIT) or at acc[], and at the end are stored to acc[], or (DWR_APPLY, the
 * channel's last pass) added to gw[] or, with DWR_SGD, subtracted from it times lr. */
#define DWR_INIT 1u
#define DWR_APPLY 2u
#define DWR_SGD 4u
#define DWR_GRAD(NAME, SW, R)                                                                                  \
    POET_OUTLINE void NAME(const float *dy, const float *x, float *acc, uint32_t w_in, uint32_t w_out, float *gw, \
                           float lr, uint32_t flags)                                                          \
    {                                                                                                        \
        float wv[9];                                                                                         \
        uint32_t k;                                                                                          \
        for (k = 0; k < 9; ++k)                                                                              \
            wv[k] = flags & DWR_INIT ? 0.0f : acc[k];                                                        \
        dwr_pass((float *)(uintptr_t)dy, x, wv, w_in, w_out, 2, SW, R, 0);                                   \
        if (!(flags & DWR_APPLY))                                                                            \
            for (k = 0; k < 9; ++k)                                                                          \
                acc[k] = wv[k];                                                                              \
        else if (flags & DWR_SGD)                                                                            \
            for (k = 0; k < 9; ++k)                                                                          \
                gw[k] -= lr * wv[k];                                                                         \
        else                                                                                                 \
            for (k = 0; k < 9; ++k)                                                                          \
                gw[k] += wv[k];                                                                              \
    }
/* The weight gradient's over C channels (a batch of one whose planes are one pass each): each
 * channel's sums start with its first products, and gw += them, or (sgd) w -= lr them. */
#define DWR_GRAD1(NAME, SW, R)                                                                                 \
    POET_OUTLINE void NAME(const float *dy, const float *x, float *gw, uint32_t w_in, uint32_t w_out, uint32_t C, \
                           uint32_t ys, uint32_t xs, float lr, int sgd)                                       \
    {                                                                                                        \
        float wv[9];                                                                                         \
        uint32_t k;                                                                                          \
        for (; C; --C, dy += ys, x += xs, gw += 9) {                                                         \
            for (k = 0; k < 9; ++k) /* (each overwritten by its first product) */                            \
                wv[k] = 0.0f;                                                                                \
            dwr_pass((float *)(uintptr_t)dy, x, wv, w_in, w_out, 2, SW, R, 1);                               \
            if (sgd)                                                                                         \
                for (k = 0; k < 9; ++k)                                                                      \
                    gw[k] -= lr * wv[k];                                                                     \
            else                                                                                             \
                for (k = 0; k < 9; ++k)                                                                      \
                    gw[k] += wv[k];                                                                          \
        }                                                                                                    \
    }
/* The weight gradient's over C channels (a batch of one) whose planes take one or more passes
 * (h_out >= R): the sums stay in registers from a channel's first pass, which starts them with its
 * first products, to its last; ys_r and xs_r a pass's rows apart. */
#define DWR_GRADN(NAME, SW, R)                                                                                 \
    POET_OUTLINE void NAME(const float *dy, const float *x, float *gw, uint32_t w_in, uint32_t w_out, uint32_t C, \
                           uint32_t ys, uint32_t xs, uint32_t h_out, float lr, int sgd)                       \
    {                                                                                                        \
        const uint32_t ys_r = R * w_out, xs_r = R * SW * w_in;                                               \
        float wv[9];                                                                                         \
        uint32_t k, r;                                                                                       \
        for (; C; --C, dy += ys, x += xs, gw += 9) {                                                         \
            const float *d = dy, *xr = x;                                                                    \
            for (k = 0; k < 9; ++k)                                                                          \
                wv[k] = 0.0f;                                                                                \
            dwr_pass((float *)(uintptr_t)d, xr, wv, w_in, w_out, 2, SW, R, 1);                               \
            for (r = h_out - R, d += ys_r, xr += xs_r; r >= R; r -= R, d += ys_r, xr += xs_r)                \
                dwr_pass((float *)(uintptr_t)d, xr, wv, w_in, w_out, 2, SW, R, 0);                           \
            if (r)                                                                                           \
                dwr_pass((float *)(uintptr_t)d, xr, wv, w_in, w_out, 2, SW, 1, 0);                           \
            if (sgd)                                                                                         \
                for (k = 0; k < 9; ++k)                                                                      \
                    gw[k] -= lr * wv[k];                                                                     \
            else                                                                                             \
                for (k = 0; k < 9; ++k)                                                                      \
                    gw[k] += wv[k];                                                                          \
        }                                                                                                    \
    }
/* The forward's over C channels whose planes take several passes, a channel's weights in
 * registers through them: h_out rows, ys_r and xs_r a pass's rows apart. */
#define DWR_FWDN(NAME, SW, R)                                                                                  \
    POET_OUTLINE void NAME(float *y, const float *x, const float *w, uint32_t w_in, uint32_t w_out, uint32_t C,   \
                           uint32_t ys, uint32_t xs, uint32_t h_out)                                          \
    {                                                                                                        \
        const uint32_t ys_r = R * w_out, xs_r = R * SW * w_in;                                               \
        float wv[9];                                                                                         \
        uint32_t k, r;                                                                                       \
        for (; C; --C, y += ys, x += xs, w += 9) {                                                           \
            float *yp = y;                                                                                   \
            const float *xr = x;                                                                             \
            for (k = 0; k < 9; ++k)                                                                          \
                wv[k] = w[k];                                                                                \
            for (r = h_out; r >= R; r -= R, yp += ys_r, xr += xs_r)                                          \
                dwr_pass(yp, xr, wv, w_in, w_out, 0, SW, R, 0);                                              \
            if (r)                                                                                           \
                dwr_pass(yp, xr, wv, w_in, w_out, 0, SW, 1, 0);                                              \
        }                                                                                                    \
    }
DWR_FWD(dwr_fwd_s1_r3, 1, 3)
DWR_FWD(dwr_fwd_s1_r2, 1, 2)
DWR_FWD(dwr_fwd_s1_r1, 1, 1)
DWR_FWD(dwr_fwd_s2_r2, 2, 2)
DWR_FWD(dwr_fwd_s2_r1, 2, 1)
DWR_GRAD(dwr_grad_s1_r3, 1, 3)
DWR_GRAD(dwr_grad_s1_r2, 1, 2)
DWR_GRAD(dwr_grad_s1_r1, 1, 1)
DWR_GRAD(dwr_grad_s2_r2, 2, 2)
DWR_GRAD(dwr_grad_s2_r1, 2, 1)
DWR_GRAD1(dwr_grad1_s1_r3, 1, 3)
DWR_GRADN(dwr_gradn_s2_r2, 2, 2)
DWR_GRAD1(dwr_grad1_s2_r4, 2, 4)
DWR_FWD(dwr_fwd_s2_r4, 2, 4)
DWR_FWDN(dwr_fwdn_s2_r2, 2, 2)
#undef DWR_FWD
#undef DWR_GRAD
#undef DWR_GRAD1
#undef DWR_GRADN
#undef DWR_FWDN

/* Whether a layer is such a window: depthwise 3x3, padding 0 along H and 1 along W, the same
 * stride 1 or 2 along both axes, rows of at least SW + 2 inputs */
static int dwr_ok(const poet_conv2d_shape *s)
{
    /* (every convolution's call pays this test: the tests that other layers fail come first) */
    return s->pad_h == 0 && s->k_h == 3 && s->groups == s->c_out && s->groups == s->c_in && s->k_w == 3 &&
           s->pad_w == 1 && s->stride_h == s->stride_w && s->stride_w - 1u <= 1u && s->w_in >= s->stride_w + 2 &&
           s->h_in >= 3;
}

/* y[n][c] += b[c] over planes of P, out of line (a layer without a bias, the zoo's, skips it) */
POET_OUTLINE void dwr_bias(float *y, const float *b, uint32_t N, uint32_t C, uint32_t P)
{
    uint32_t n, c, k;
    for (n = 0; n < N; ++n)
        for (c = 0; c < C; ++c, y += P)
            for (k = 0; k < P; ++k)
                y[k] += b[c];
}

/* The forward of such a layer: each sample's rows in passes of R (3 at stride 1, 2 at stride 2)
 * and the rows left, each pass over all the channels, or at stride 2 with several passes a plane,
 * channel by channel; the bias, if any, added after */
POET_INLINE void dwr_forward_layer(float *y, const float *x, const float *w, const float *b,
                                   const poet_conv2d_shape *s, const uint32_t SW)
{
    /* the fields read once, before any call (which might otherwise write to the shape) */
    const uint32_t h_out = s->h_out, w_in = s->w_in, w_out = s->w_out, C = s->c_out, N = s->n, R = SW == 1 ? 3 : 2;
    const uint32_t in_plane = s->h_in * w_in, out_plane = h_out * w_out;
    uint32_t n, r;
    float *yn = y;
    const float *xn = x;
    for (n = 0; n < N; ++n, yn += C * out_plane, xn += C * in_plane) {
        if (SW == 2 && h_out == 4) {
            dwr_fwd_s2_r4(yn, xn, w, w_in, w_out, C, out_plane, in_plane);
            continue;
        }
        if (SW == 2 && h_out > R) {
            dwr_fwdn_s2_r2(yn, xn, w, w_in, w_out, C, out_plane, in_plane, h_out);
            continue;
        }
        for (r = 0; r + R <= h_out; r += R)
            (SW == 1 ? dwr_fwd_s1_r3 : dwr_fwd_s2_r2)(yn + r * w_out, xn + r * SW * w_in, w, w_in, w_out, C,
                                                      out_plane, in_plane);
        if (SW == 1 && r + 2 == h_out)
            dwr_fwd_s1_r2(yn + r * w_out, xn + r * SW * w_in, w, w_in, w_out, C, out_plane, in_plane);
        else if (r < h_out)
            (SW == 1 ? dwr_fwd_s1_r1 : dwr_fwd_s2_r1)(yn + r * w_out, xn + r * SW * w_in, w, w_in, w_out, C,
                                                      out_plane, in_plane);
    }
    if (b)
        dwr_bias(y, b, N, C, out_plane);
}

/* One plane's weight gradient for dwr_grad_layer: passes of R rows, then the rows left, first's
 * flags on the first, last's on the last */
POET_INLINE void dwr_grad_plane(const float *dy, const float *x, float *acc, uint32_t h_out, uint32_t w_in,
                                uint32_t w_out, float *gw, float lr, uint32_t first, uint32_t last, const uint32_t SW)
{
    const uint32_t R = SW == 1 ? 3 : 2, ys = R * w_out, xs = R * SW * w_in;
    uint32_t r = h_out;
    for (; r >= R; r -= R, dy += ys, x += xs, first = 0)
        (SW == 1 ? dwr_grad_s1_r3 : dwr_grad_s2_r2)(dy, x, acc, w_in, w_out, gw, lr, first | (r == R ? last : 0));
    if (SW == 1 && r == 2)
        dwr_grad_s1_r2(dy, x, acc, w_in, w_out, gw, lr, first | last);
    else if (r == 1)
        (SW == 1 ? dwr_grad_s1_r1 : dwr_grad_s2_r1)(dy, x, acc, w_in, w_out, gw, lr, first | last);
}

/* The weight gradient: channel by channel, its nine sums over the batch's planes (in registers
 * within a pass, in acc between them); gw += them, or (sgd) w -= lr them. A batch of one whose
 * planes are one pass each (mcu-vww's stride-1 windows) in one call. */
POET_INLINE void dwr_grad_layer(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s, float lr,
                                int sgd, const uint32_t SW)
{
    /* the fields read once, before any call (which might otherwise write to the shape) */
    const uint32_t h_out = s->h_out, w_in = s->w_in, w_out = s->w_out, C = s->c_out, N = s->n;
    const uint32_t in_plane = s->h_in * w_in, out_plane = h_out * w_out;
    const uint32_t last = sgd ? DWR_APPLY | DWR_SGD : DWR_APPLY;
    float acc[9];
    uint32_t n, c;
    for (c = 0; c < C; ++c, gw += 9)
        for (n = 0; n < N; ++n)
            dwr_grad_plane(dy + (n * C + c) * out_plane, x + (n * C + c) * in_plane, acc, h_out, w_in, w_out, gw, lr,
                           n == 0 ? DWR_INIT : 0, n + 1 == N ? last : 0, SW);
}

/* (out of line: the callers test dwr_ok before their own set-up, which these shapes skip) */
POET_OUTLINE void dwr_forward(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
    if (s->stride_w == 1)
        dwr_forward_layer(y, x, w, b, s, 1);
    else
        dwr_forward_layer(y, x, w, b, s, 2);
}

POET_OUTLINE void dwr_grad(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s, float lr, int sgd)
{
    /* a batch of one, whose channels' sums stay in registers through their passes, in one call:
     * planes of one pass (3 rows at stride 1, 4 at stride 2: mcu-vww's), and at stride 2 passes
     * of 2 rows for the other heights */
    if (s->n == 1 && s->stride_w == 2 && s->h_out == 4)
        dwr_grad1_s2_r4(dy, x, gw, s->w_in, s->w_out, s->c_out, 4 * s->w_out, s->h_in * s->w_in, lr, sgd);
    else if (s->n == 1 && s->stride_w == 1 && s->h_out == 3)
        dwr_grad1_s1_r3(dy, x, gw, s->w_in, s->w_out, s->c_out, 3 * s->w_out, s->h_in * s->w_in, lr, sgd);
    else if (s->n == 1 && s->stride_w == 2 && s->h_out >= 2)
        dwr_gradn_s2_r2(dy, x, gw, s->w_in, s->w_out, s->c_out, s->h_out * s->w_out, s->h_in * s->w_in, s->h_out, lr,
                        sgd);
    else if (s->stride_w == 1)
        dwr_grad_layer(gw, dy, x, s, lr, sgd, 1);
    else
        dwr_grad_layer(gw, dy, x, s, lr, sgd, 2);
}
#endif

POET_INLINE void depthwise3_rows(float *yc, const float *xc, const float *wc, const float *b,
                                 const poet_conv2d_shape *s, const uint32_t SW, const int accumulate, const uint32_t CO)
{
    const uint32_t w_in = s->w_in, w_out = s->w_out, ys = s->h_out * w_out;
    float wl[18];
    uint32_t oh, ow, v, o, kh0, kh1, lo, hi;
#ifdef POET_KERNELS_SMALL
    if (1) { /* the row walks' copies are 20 KB of code: the plain row pass on small parts */
#else
    if (s->pad_w != 1 || w_in < 3) {
#endif
        for (o = 0; o < CO; ++o)
            depthwise3_rows_any(yc + o * ys, xc, wc + 9 * o, b ? b + o : b, s, SW, accumulate);
        return;
    }
    for (v = 0; v < 9 * CO; ++v)
        wl[v] = wc[v];
    interior(SW, 1, 3, w_in, w_out, &lo, &hi);
    for (oh = 0; oh < s->h_out; ++oh) {
        float *yr = yc + oh * w_out;
        const float *r;
        tap_range(oh, s->stride_h, s->pad_h, 3, s->h_in, &kh0, &kh1);
        r = xc + (oh * s->stride_h + kh0 - s->pad_h) * w_in;
        /* the weights' offsets constants, so that they stay in registers */
        if (CO == 1 && kh1 - kh0 == 3 && oh + 1 < s->h_out && s->stride_h == SW &&
            (oh + 1) * SW + 2 < s->h_in + s->pad_h) { /* this row and the next, all three kernel rows each */
            dw3_row(yr, r, wl, w_in, w_out, hi, SW, accumulate, 3, 1, 1, ys);
            if (b && !accumulate)
                for (ow = 0; ow < w_out; ++ow)
                    yr[ow] += b[0];
            yr += w_out, ++oh;
        } else if (kh1 - kh0 == 3)
            dw3_row(yr, r, wl, w_in, w_out, hi, SW, accumulate, 3, 0, CO, ys);
        else if (kh1 - kh0 == 2 && kh0 == 0)
            dw3_row(yr, r, wl, w_in, w_out, hi, SW, accumulate, 2, 0, CO, ys);
        else if (kh1 - kh0 == 2)
            dw3_row(yr, r, wl + 3, w_in, w_out, hi, SW, accumulate, 2, 0, CO, ys);
        else if (kh1 - kh0 == 1)
        {
            float w1[18]; /* a copy: an offset into wl known only at run time would keep wl in memory */
            for (o = 0; o < CO; ++o)
                for (v = 0; v < 3; ++v)
                    w1[9 * o + v] = wc[9 * o + 3 * kh0 + v];
            dw3_row(yr, r, w1, w_in, w_out, hi, SW, accumulate, 1, 0, CO, ys);
        }
        else if (!accumulate) /* a row whose window lies wholly in the padding */
            for (o = 0; o < CO; ++o)
                for (ow = 0; ow < w_out; ++ow)
                    yr[o * ys + ow] = 0.0f;
        if (b && !accumulate)
            for (o = 0; o < CO; ++o)
                for (ow = 0; ow < w_out; ++ow)
                    yr[o * ys + ow] += b[o];
    }
}

#ifndef POET_KERNELS_SMALL
/* The weight gradient of a depthwise 3x3 channel with one column of padding each side (w_in >= 3):
 * the forward's walk over the plane, adding each window times its dy into nine sums held in
 * registers over the whole channel and batch (CO channels reading the same input: 9 CO sums,
 * channel o's dy at dyc + o ys). */
POET_INLINE void depthwise3_grad_rows(float *g, const float *dyc, const float *xc, const poet_conv2d_shape *s,
                                      const uint32_t SW, const uint32_t CO, uint32_t ys)
{
    const uint32_t w_in = s->w_in, w_out = s->w_out;
    uint32_t oh, v, o, kh0, kh1, lo, hi;
    interior(SW, 1, 3, w_in, w_out, &lo, &hi);
    for (oh = 0; oh < s->h_out; ++oh) {
        /* read only: dw3_row takes y writable for the forward, which shares its walk */
        float *dyr = (float *)(uintptr_t)(dyc + oh * w_out);
        const float *r;
        tap_range(oh, s->stride_h, s->pad_h, 3, s->h_in, &kh0, &kh1);
        r = xc + (oh * s->stride_h + kh0 - s->pad_h) * w_in;
        /* pairs of rows at stride 1 only: at stride 2 a pair's fifteen inputs, the nine sums and
         * the temporaries spill out of the 32 registers */
        if (CO == 1 && SW == 1 && kh1 - kh0 == 3 && oh + 1 < s->h_out && s->stride_h == 1 &&
            oh + 3 < s->h_in + s->pad_h) {
            dw3_row(dyr, r, g, w_in, w_out, hi, SW, 2, 3, 1, 1, ys);
            ++oh;
        } else if (kh1 - kh0 == 3)
            dw3_row(dyr, r, g, w_in, w_out, hi, SW, 2, 3, 0, CO, ys);
        else if (kh1 - kh0 == 2 && kh0 == 0)
            dw3_row(dyr, r, g, w_in, w_out, hi, SW, 2, 2, 0, CO, ys);
        else if (kh1 - kh0 == 2)
            dw3_row(dyr, r, g + 3, w_in, w_out, hi, SW, 2, 2, 0, CO, ys);
        else if (kh1 - kh0 == 1) {
            float g1[18];
            for (v = 0; v < 9 * CO; ++v)
                g1[v] = 0.0f;
            dw3_row(dyr, r, g1, w_in, w_out, hi, SW, 2, 1, 0, CO, ys);
            for (o = 0; o < CO; ++o)
                for (v = 0; v < 3; ++v) /* constant indices into g, so that g stays in registers */
                    if (kh0 == 0)
                        g[9 * o + v] += g1[9 * o + v];
                    else if (kh0 == 1)
                        g[9 * o + 3 + v] += g1[9 * o + v];
                    else
                        g[9 * o + 6 + v] += g1[9 * o + v];
        }
    }
}

/* Output channels co .. co + CO of one group (one input channel), g[9 o + k] their sums */
POET_INLINE void depthwise3_grad(float *g, const float *dy, const float *x, const poet_conv2d_shape *s, uint32_t co,
                                 const uint32_t SW, const uint32_t CO)
{
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out;
    const uint32_t ci = co / (s->c_out / s->groups);
    float acc[18];
    uint32_t n, k;
    for (k = 0; k < 9 * CO; ++k)
        acc[k] = 0.0f;
    for (n = 0; n < s->n; ++n)
        depthwise3_grad_rows(acc, dy + (n * s->c_out + co) * out_plane, x + (n * s->c_in + ci) * in_plane, s, SW, CO,
                             out_plane);
    for (k = 0; k < 9 * CO; ++k)
        g[k] = acc[k];
}

POET_OUTLINE void depthwise3_grad_s2(float *g, const float *dy, const float *x, const poet_conv2d_shape *s,
                                     uint32_t co)
{
    depthwise3_grad(g, dy, x, s, co, 2, 1);
}

POET_OUTLINE void depthwise3_grad_s1_x2(float *g, const float *dy, const float *x, const poet_conv2d_shape *s,
                                        uint32_t co)
{
    depthwise3_grad(g, dy, x, s, co, 1, 2);
}

POET_OUTLINE void depthwise3_grad_s2_x2(float *g, const float *dy, const float *x, const poet_conv2d_shape *s,
                                        uint32_t co)
{
    depthwise3_grad(g, dy, x, s, co, 2, 2);
}
#endif

/* Depthwise 3x3 channels (one input channel a group), out of line: CO output channels from co on
 * that read the same input channel, or (CO 1) count channels from co on, one call for a whole
 * depthwise layer so that its small planes do not pay a call each */
POET_INLINE void forward_channel3(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s,
                                  uint32_t n, uint32_t co, uint32_t count, const uint32_t SW, const uint32_t CO)
{
    const uint32_t cout_g = s->c_out / s->groups, out_plane = s->h_out * s->w_out, in_plane = s->h_in * s->w_in;
    uint32_t i;
    for (i = 0; i < count; ++i, ++co)
        /* one input channel a group: channel co reads input channel co / (c_out / groups) */
        depthwise3_rows(y + (n * s->c_out + co) * out_plane, x + (n * s->c_in + co / cout_g) * in_plane, w + co * 9,
                        b ? b + co : b, s, SW, 0, CO);
}

/* at stride 2 a call a channel: the planes are larger, and the loop over channels costs the row
 * walk registers */
POET_OUTLINE void forward_channel3_s2(float *y, const float *x, const float *w, const float *b,
                                      const poet_conv2d_shape *s, uint32_t n, uint32_t co)
{
    forward_channel3(y, x, w, b, s, n, co, 1, 2, 1);
}

#ifndef POET_KERNELS_SMALL
POET_OUTLINE void forward_channel3_s1_x2(float *y, const float *x, const float *w, const float *b,
                                         const poet_conv2d_shape *s, uint32_t n, uint32_t co)
{
    forward_channel3(y, x, w, b, s, n, co, 1, 1, 2);
}

POET_OUTLINE void forward_channel3_s2_x2(float *y, const float *x, const float *w, const float *b,
                                         const poet_conv2d_shape *s, uint32_t n, uint32_t co)
{
    forward_channel3(y, x, w, b, s, n, co, 1, 2, 2);
}
#endif

/* Four output channels of a 1x1 stride-1 layer (as one row) with CIN <= 4 input channels a
 * group, mcu-vww's first pointwise layers: the 4 x CIN weights stay in registers over the whole
 * plane and each input is loaded once for the four outputs, where the tiles reload the weights
 * for every four columns and their reduction over so few channels is as short as their set-up.
 * yo[c P + p] (+)= sum over u < CIN of xg[u P + p] w[c wc + u wu]; the data gradient runs in it
 * too, four output channels at a time, with the weights transposed by their strides. */
POET_INLINE void pointwise_few_at(float *const *yp, const float *const *xp, const float *wr, uint32_t k,
                                  const int accumulate, const uint32_t CIN)
{
    float xv[4];
    uint32_t c, u;
    for (u = 0; u < CIN; ++u)
        xv[u] = xp[u][k];
    for (c = 0; c < 4; ++c) {
        float acc = xv[0] * wr[c * 4];
        for (u = 1; u < CIN; ++u)
            acc += xv[u] * wr[c * 4 + u];
        if (accumulate)
            yp[c][k] += acc;
        else
            yp[c][k] = acc;
    }
}

/* the plane's positions four at a time, at immediate offsets from a pointer a row */
POET_INLINE void pointwise_few(float *yo, const float *xg, uint32_t P, const float *w, uint32_t wc, uint32_t wu,
                               const int accumulate, const uint32_t CIN)
{
    float wr[16], *yp[4];
    const float *xp[4];
    uint32_t c, u, p;
    for (c = 0; c < 4; ++c)
        for (u = 0; u < CIN; ++u)
            wr[c * 4 + u] = w[c * wc + u * wu];
    for (c = 0; c < 4; ++c)
        yp[c] = yo + c * P;
    for (u = 0; u < CIN; ++u)
        xp[u] = xg + u * P;
    for (p = 0; p + 4 <= P; p += 4) {
        pointwise_few_at(yp, xp, wr, 0, accumulate, CIN);
        pointwise_few_at(yp, xp, wr, 1, accumulate, CIN);
        pointwise_few_at(yp, xp, wr, 2, accumulate, CIN);
        pointwise_few_at(yp, xp, wr, 3, accumulate, CIN);
        for (c = 0; c < 4; ++c)
            yp[c] += 4;
        for (u = 0; u < CIN; ++u)
            xp[u] += 4;
    }
    for (; p < P; ++p) {
        pointwise_few_at(yp, xp, wr, 0, accumulate, CIN);
        for (c = 0; c < 4; ++c)
            ++yp[c];
        for (u = 0; u < CIN; ++u)
            ++xp[u];
    }
}

POET_OUTLINE void pointwise_few_forward(float *y, const float *x, const float *w, const float *b,
                                        const poet_conv2d_shape *s, uint32_t n, uint32_t co, uint32_t cin_g)
{
    const uint32_t P = s->w_out;
    const float *xg = x + (n * s->c_in + (co / (s->c_out / s->groups)) * cin_g) * P;
    float *yo = y + (n * s->c_out + co) * P;
    const float *wo = w + co * cin_g;
    uint32_t c, p;
    if (cin_g == 4)
        pointwise_few(yo, xg, P, wo, 4, 1, 0, 4);
    else if (cin_g == 3)
        pointwise_few(yo, xg, P, wo, 3, 1, 0, 3);
    else if (cin_g == 2)
        pointwise_few(yo, xg, P, wo, 2, 1, 0, 2);
    else
        pointwise_few(yo, xg, P, wo, 1, 1, 0, 1);
    if (b) /* a second pass, so that a layer without a bias pays nothing for it */
        for (c = 0; c < 4; ++c)
            for (p = 0; p < P; ++p)
                yo[c * P + p] += b[co + c];
}

#ifndef POET_KERNELS_SMALL
/* The data gradient of such a layer with 4 inputs a group and outputs in fours: dx of a group's
 * four input channels += its output channels' dy, four at a time. Returns 0 for other shapes. */
POET_OUTLINE int pointwise_few_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups, P = s->w_out;
    uint32_t n, g, co;
    if (s->k_h != 1 || s->k_w != 1 || s->stride_w != 1 || s->h_out != 1 || s->pad_w || cin_g != 4 || cout_g % 4)
        return 0;
    for (n = 0; n < s->n; ++n)
        for (g = 0; g < s->groups; ++g)
            for (co = 0; co < cout_g; co += 4)
                pointwise_few(dx + (n * s->c_in + g * cin_g) * P, dy + (n * s->c_out + g * cout_g + co) * P, P,
                              w + (g * cout_g + co) * cin_g, 1, cin_g, 1, 4);
    return 1;
}
#endif

#ifndef POET_KERNELS_SMALL
/* A 1x1 stride-1 layer as one row is a matrix product over the plane's P positions:
 * y[c P + q] (+)= sum over u < U of w[c wc + u wu] x[u P + q], in tiles of 4 channels by Q
 * positions. The forward (wu 1) reads the four channels' weights at immediate offsets from a
 * pointer each, four u at a time; the data gradient (wc 1, the weights transposed) reads them
 * from one pointer stepped along u. The first product starts each sum. The general tiles step
 * five pointers every u, a third of an instruction per multiply-add on these short rows. */
POET_INLINE void pw_mm_step(float *s, const float *xp, const float *const *wq, const float *w1, int32_t k,
                            const int WC1, const int INIT, const uint32_t Q)
{
    float xv[4], wv[4];
    uint32_t c, q;
    for (q = 0; q < Q; ++q)
        xv[q] = xp[q];
    for (c = 0; c < 4; ++c)
        wv[c] = WC1 ? w1[c] : wq[c][k];
    for (c = 0; c < 4; ++c)
        for (q = 0; q < Q; ++q)
            s[c * Q + q] = INIT ? wv[c] * xv[q] : s[c * Q + q] + wv[c] * xv[q];
}

POET_INLINE void pw_mm_tile(float *yo, uint32_t P, const float *x, const float *w, uint32_t U, uint32_t wc,
                            uint32_t wu, const int accumulate, const int WC1, const uint32_t Q)
{
    float s[16];
    const float *wq[4], *w1 = w + wu, *xp = x + P;
    uint32_t u = 1, c, q;
    for (c = 0; c < 4; ++c)
        wq[c] = w + c * wc + 1;
    pw_mm_step(s, x, wq, w, -1, WC1, 1, Q);
    if (WC1)
        for (; u < U; ++u, xp += P, w1 += wu)
            pw_mm_step(s, xp, wq, w1, 0, 1, 0, Q);
    else {
        for (; u + 4 <= U; u += 4) {
            pw_mm_step(s, xp, wq, w1, 0, 0, 0, Q);
            pw_mm_step(s, xp + P, wq, w1, 1, 0, 0, Q);
            pw_mm_step(s, xp + 2 * P, wq, w1, 2, 0, 0, Q);
            pw_mm_step(s, xp + 3 * P, wq, w1, 3, 0, 0, Q);
            xp += 4 * P;
            for (c = 0; c < 4; ++c)
                wq[c] += 4;
        }
        for (; u < U; ++u, xp += P) {
            pw_mm_step(s, xp, wq, w1, 0, 0, 0, Q);
            for (c = 0; c < 4; ++c)
                ++wq[c];
        }
    }
    for (c = 0; c < 4; ++c)
        for (q = 0; q < Q; ++q) {
            if (accumulate)
                yo[c * P + q] += s[c * Q + q];
            else
                yo[c * P + q] = s[c * Q + q];
        }
}

/* Four channels' rows of the product across the plane: tiles of 4 positions, or of 3 where P is
 * a multiple of 3 but not of 4 (mcu-vww's 3x3 plane), the rest one at a time */
POET_INLINE void pw_mm_rows(float *yo, uint32_t P, const float *x, const float *w, uint32_t U, uint32_t wc,
                            uint32_t wu, const int accumulate, const int WC1)
{
    uint32_t p = 0;
    if (P % 4 && P % 3 == 0)
        for (; p < P; p += 3)
            pw_mm_tile(yo + p, P, x + p, w, U, wc, wu, accumulate, WC1, 3);
    for (; p + 4 <= P; p += 4)
        pw_mm_tile(yo + p, P, x + p, w, U, wc, wu, accumulate, WC1, 4);
    for (; p < P; ++p)
        pw_mm_tile(yo + p, P, x + p, w, U, wc, wu, accumulate, WC1, 1);
}

POET_OUTLINE void pw_mm_rows_forward(float *yo, uint32_t P, const float *x, const float *w, uint32_t U)
{
    pw_mm_rows(yo, P, x, w, U, U, 1, 0, 0);
}

POET_OUTLINE void pw_mm_rows_backward(float *dxo, uint32_t P, const float *dy, const float *w, uint32_t U, uint32_t wu)
{
    pw_mm_rows(dxo, P, dy, w, U, 1, wu, 1, 1);
}

/* The forward of such a layer with more than 4 inputs and outputs in fours; 0 for other shapes */
static int pointwise_mm_forward(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups, P = s->w_out;
    uint32_t n, g, co, p;
    if (s->k_h != 1 || s->k_w != 1 || s->stride_w != 1 || s->h_out != 1 || s->pad_w || cin_g <= 4 || cout_g % 4)
        return 0;
    for (n = 0; n < s->n; ++n)
        for (g = 0; g < s->groups; ++g)
            for (co = g * cout_g; co < (g + 1) * cout_g; co += 4)
                pw_mm_rows_forward(y + (n * s->c_out + co) * P, P, x + (n * s->c_in + g * cin_g) * P, w + co * cin_g,
                                   cin_g);
    if (b) /* a second pass, so that a layer without a bias pays nothing for it */
        for (n = 0; n < s->n; ++n)
            for (co = 0; co < s->c_out; ++co)
                for (p = 0; p < P; ++p)
                    y[(n * s->c_out + co) * P + p] += b[co];
    return 1;
}

/* The data gradient of such a layer with inputs in fours (more than 4: pointwise_few has those) */
static int pointwise_mm_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups, P = s->w_out;
    uint32_t n, g, ci;
    if (s->k_h != 1 || s->k_w != 1 || s->stride_w != 1 || s->h_out != 1 || s->pad_w || cin_g <= 4 || cin_g % 4)
        return 0;
    for (n = 0; n < s->n; ++n)
        for (g = 0; g < s->groups; ++g)
            for (ci = 0; ci < cin_g; ci += 4)
                pw_mm_rows_backward(dx + (n * s->c_in + g * cin_g + ci) * P, P, dy + (n * s->c_out + g * cout_g) * P,
                                    w + g * cout_g * cin_g + ci, cout_g, cin_g);
    return 1;
}
#endif

/* Output channels in tiles of 4 within each group, then one at a time */
POET_INLINE void forward_all(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s,
                             const uint32_t KH, const uint32_t KW, const uint32_t SW)
{
    const uint32_t cout_g = s->c_out / s->groups, cin_g = s->c_in / s->groups;
    uint32_t n, g, co;
    for (n = 0; n < s->n; ++n) {
        for (g = 0; g < s->groups; ++g) {
            co = 0;
#ifndef POET_KERNELS_SMALL
            /* a 3x3 layer with one input channel a group and several outputs (mcu-vww's stem):
             * the depthwise row walk, two output channels on each input window */
            if (KH == 3 && SW == 1 && cin_g == 1)
                for (; co + 2 <= cout_g; co += 2)
                    forward_channel3_s1_x2(y, x, w, b, s, n, g * cout_g + co);
            else if (KH == 3 && SW == 2 && cin_g == 1)
                for (; co + 2 <= cout_g; co += 2)
                    forward_channel3_s2_x2(y, x, w, b, s, n, g * cout_g + co);
#endif
            for (; co + 4 <= cout_g; co += 4)
                if (KH == 1 && SW == 1 && s->h_out == 1 && cin_g <= 4) /* 1x1 as one row, few inputs */
                    pointwise_few_forward(y, x, w, b, s, n, g * cout_g + co, cin_g);
                else
                    forward_channels(y, x, w, b, s, n, g * cout_g + co, KH, KW, SW, 4);
            for (; co < cout_g; ++co) {
                /* (a depthwise layer at stride 1 takes the column strips or the window walk,
                 * dwc_layer_ok and dwr_ok: the shapes they leave, no zoo layer's, the general tile) */
                if (KH == 3 && SW == 2 && cin_g == 1)
                    forward_channel3_s2(y, x, w, b, s, n, g * cout_g + co);
                else /* the odd channel left over after tiles of 4 */
                    forward_one_channel(y, x, w, b, s, n, g * cout_g + co);
            }
        }
    }
}

/* (out of line: a depthwise window, below, skips its set-up) */
POET_OUTLINE void forward_any(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
    poet_conv2d_shape flat;
    s = as_one_row(s, &flat);
#ifndef POET_KERNELS_SMALL
    if (pointwise_mm_forward(y, x, w, b, s))
        return;
    if (dwc_layer_ok(s, 1) || dwc_layer_ok(s, 2)) { /* depthwise 3x3: the column strips */
        dwc_forward(y, x, w, b, s);
        return;
    }
    if (s->k_h == 3 && s->k_w == 3 && s->stride_w == 1)
        forward_all(y, x, w, b, s, 3, 3, 1);
    else if (s->k_h == 3 && s->k_w == 3 && s->stride_w == 2)
        forward_all(y, x, w, b, s, 3, 3, 2);
    else if (s->k_h == 1 && s->k_w == 1 && s->stride_w == 1)
        forward_all(y, x, w, b, s, 1, 1, 1);
    else if (s->k_h == 1 && s->k_w == 1 && s->stride_w == 2)
        forward_all(y, x, w, b, s, 1, 1, 2);
    else
#endif
        forward_all(y, x, w, b, s, 0, 0, 0);
}

void poet_conv2d_forward(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
#ifndef POET_KERNELS_SMALL
    if (dwr_ok(s)) { /* a depthwise 3x3 window of a few rows: the rows' column walk */
        dwr_forward(y, x, w, b, s);
        return;
    }
#endif
    forward_any(y, x, w, b, s);
}

/* The data gradient, gathered: dx (ih, iw) += dy (oh, ow) w (kh, kw) over ih + pad = oh * stride + kh.
 * Along a row, the columns iw with the same (iw + pad) mod stride form a class: each member reads
 * the kernel columns kw = p, p + stride, ... (p its phase), at ow = (iw + pad - kw) / stride, and the
 * next member of its class reads the next column of dy with the same kernel columns. So a class
 * is a correlation of dy with every stride-th kernel column, turned around, and runs in the same
 * tiles as the forward: C input channels by Q members of a class, the sum over output channels,
 * then kernel rows, then kernel columns, each destination touched once. Members whose taps reach
 * past dy take the contiguous run of taps that stays inside. */
POET_INLINE void backward_input_tile(float *dxr, uint32_t in_plane, uint32_t dq, const float *ar, const float *wr,
                                     const poet_conv2d_shape *s, uint32_t nv, uint32_t nt, const uint32_t T,
                                     const uint32_t SW, const uint32_t C, const uint32_t Q)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups, taps = s->k_h * s->k_w;
    float acc[16];
    uint32_t c, q;
    window_tile(acc, ar, (int32_t)(s->h_out * s->w_out), -(int32_t)s->w_out, -1, 1, wr, (int32_t)taps,
                (int32_t)(cin_g * taps), (int32_t)(s->stride_h * s->k_w), (int32_t)(SW ? SW : s->stride_w), cout_g, nv,
                T ? T : nt, C, Q);
    for (c = 0; c < C; ++c)
        for (q = 0; q < Q; ++q)
            dxr[c * in_plane + q * dq] += acc[c * Q + q];
}

/* A member whose taps reach past dy, with the run of taps inside: out of line, as forward_edge4 */
POET_OUTLINE void backward_input_edge4(float *dxr, uint32_t in_plane, const float *ar, const float *wr,
                                       const poet_conv2d_shape *s, uint32_t nv, uint32_t nt)
{
    if (nt == 2 && s->stride_w == 1) /* a 3-wide kernel beside one column of padding */
        backward_input_tile(dxr, in_plane, 1, ar, wr, s, nv, nt, 2, 1, 4, 1);
    else
        backward_input_tile(dxr, in_plane, 1, ar, wr, s, nv, nt, 0, 0, 4, 1);
}

POET_OUTLINE void backward_input_edge1(float *dxr, uint32_t in_plane, const float *ar, const float *wr,
                                       const poet_conv2d_shape *s, uint32_t nv, uint32_t nt)
{
    if (nt == 2 && s->stride_w == 1)
        backward_input_tile(dxr, in_plane, 1, ar, wr, s, nv, nt, 2, 1, 1, 1);
    else
        backward_input_tile(dxr, in_plane, 1, ar, wr, s, nv, nt, 0, 0, 1, 1);
}

/* Members m .. hi of a class, all of whose taps land inside dy, in tiles; returns hi */
POET_INLINE uint32_t backward_input_run(float *dxr, uint32_t in_plane, uint32_t sw, const float *ar, const float *wr,
                                        const poet_conv2d_shape *s, uint32_t nv, uint32_t nt, uint32_t m, uint32_t hi,
                                        const uint32_t T, const uint32_t SW, const uint32_t C)
{
    if (C == 1)
        for (; m + 8 <= hi; m += 8)
            backward_input_tile(dxr + m * sw, in_plane, sw, ar + m, wr, s, nv, nt, T, SW, C, 8);
    for (; m + 4 <= hi; m += 4)
        backward_input_tile(dxr + m * sw, in_plane, sw, ar + m, wr, s, nv, nt, T, SW, C, 4);
    for (; m < hi; ++m)
        backward_input_tile(dxr + m * sw, in_plane, sw, ar + m, wr, s, nv, nt, T, SW, C, 1);
    return m;
}

/* Input channels ci .. ci + C (one group) of sample n. SW: the column stride when the call fixes
 * it, and with it the taps of a class (1 or 3 at stride 1, 1 or 2 at stride 2) are constants. */
POET_INLINE void backward_input_channels(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s,
                                         uint32_t n, uint32_t ci, const uint32_t SW, const uint32_t C)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups, g = ci / cin_g;
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out, taps = s->k_h * s->k_w;
    const uint32_t sh = s->stride_h, sw = SW ? SW : s->stride_w;
    const float *dyg = dy + (n * s->c_out + g * cout_g) * out_plane;
    const float *wg = w + (g * cout_g * cin_g + ci % cin_g) * taps;
    float *dxc = dx + (n * s->c_in + ci) * in_plane;
    uint32_t ih, first;
    for (ih = 0; ih < s->h_in; ++ih) {
        /* kernel rows kh = kh0 + v sh, v in [v0, v1), reach output row oh0 - v inside dy */
        const uint32_t kh0 = (ih + s->pad_h) % sh, oh0 = (ih + s->pad_h) / sh;
        const uint32_t v0 = oh0 >= s->h_out ? oh0 - s->h_out + 1 : 0;
        uint32_t v1 = kh0 < s->k_h ? (s->k_h - kh0 + sh - 1) / sh : 0;
        if (v1 > oh0 + 1)
            v1 = oh0 + 1;
        if (v1 <= v0)
            continue;
        for (first = 0; first < sw && first < s->w_in; ++first) {
            /* the class of columns first, first + sw, ...: phase p, taps t < nt at kw = p + t sw */
            const uint32_t p = (first + s->pad_w) % sw, ow0 = (first + s->pad_w) / sw;
            const uint32_t nt = p < s->k_w ? (s->k_w - p + sw - 1) / sw : 0;
            const uint32_t members = (s->w_in - first + sw - 1) / sw;
            /* members m with every tap inside dy: ow0 + m - (nt - 1) >= 0 and ow0 + m < w_out */
            uint32_t lo = nt - 1 > ow0 ? nt - 1 - ow0 : 0, hi = s->w_out > ow0 ? s->w_out - ow0 : 0, m;
            const float *ar = dyg + (oh0 - v0) * s->w_out + ow0;
            const float *wr = wg + (kh0 + v0 * sh) * s->k_w + p;
            float *dxr = dxc + ih * s->w_in + first;
            if (nt == 0)
                continue;
            if (hi > members)
                hi = members;
            if (lo > hi)
                lo = hi;
            for (m = 0; m < members; ++m) {
                /* taps t in [t0, t1) land inside dy: 0 <= ow0 + m - t < w_out */
                uint32_t t0, t1;
                if (m == lo && lo < hi) {
                    /* the tap count a constant where the layers have it: 3 at stride 1 (3x3), 1 or
                     * 2 at stride 2 (1x1 and 3x3) */
                    if (SW == 1 && nt == 3)
                        m = backward_input_run(dxr, in_plane, sw, ar, wr, s, v1 - v0, nt, m, hi, 3, SW, C);
                    else if (SW == 1)
                        m = backward_input_run(dxr, in_plane, sw, ar, wr, s, v1 - v0, nt, m, hi, 1, SW, C);
                    else if (SW == 2 && nt == 1)
                        m = backward_input_run(dxr, in_plane, sw, ar, wr, s, v1 - v0, nt, m, hi, 1, SW, C);
                    else if (SW == 2)
                        m = backward_input_run(dxr, in_plane, sw, ar, wr, s, v1 - v0, nt, m, hi, 2, SW, C);
                    else
                        m = backward_input_run(dxr, in_plane, sw, ar, wr, s, v1 - v0, nt, m, hi, 0, SW, C);
                    if (m >= members)
                        break;
                }
                t0 = ow0 + m >= s->w_out ? ow0 + m - s->w_out + 1 : 0;
                t1 = ow0 + m + 1 < nt ? ow0 + m + 1 : nt;
                if (t1 > t0 && C == 4)
                    backward_input_edge4(dxr + m * sw, in_plane, ar + m - t0, wr + t0 * sw, s, v1 - v0, t1 - t0);
                else if (t1 > t0)
                    backward_input_edge1(dxr + m * sw, in_plane, ar + m - t0, wr + t0 * sw, s, v1 - v0, t1 - t0);
            }
        }
    }
}

POET_OUTLINE void backward_input_one_channel(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s,
                                             uint32_t n, uint32_t ci)
{
    backward_input_channels(dx, dy, w, s, n, ci, 0, 1);
}

POET_INLINE void backward_input_all(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s,
                                    const uint32_t SW)
{
    const uint32_t cin_g = s->c_in / s->groups;
    uint32_t n, g, ci;
    for (n = 0; n < s->n; ++n)
        for (g = 0; g < s->groups; ++g) {
            for (ci = 0; ci + 4 <= cin_g; ci += 4)
                backward_input_channels(dx, dy, w, s, n, g * cin_g + ci, SW, 4);
            for (; ci < cin_g; ++ci) {
                if (cin_g == 1) /* depthwise layers, one channel a group: their own tiles */
                    backward_input_channels(dx, dy, w, s, n, g * cin_g + ci, SW, 1);
                else /* the odd channel left over after tiles of 4 */
                    backward_input_one_channel(dx, dy, w, s, n, g * cin_g + ci);
            }
        }
}

/* A depthwise 3x3 layer at stride 2 with one row and column of padding: input (2m + a, 2j + b)
 * takes its taps from dy (m, j) and, for a or b odd, (m + 1, j) and (m, j + 1): in a 2x2 block
 * of dx per dy position, walked along a pair of dy rows with those rows' values in registers,
 * each block's four sums add into dx once. D1: dy row m + 1 exists; X1: dx row 2m + 1 does. */
POET_INLINE void dw3_s2_block(float *x0, float *x1, const float *a0, const float *a1, const float *b0,
                              const float *b1, const float *w, const int D1, const int X1, const uint32_t CO)
{
    float s00 = a0[0] * w[4], s01 = a0[0] * w[5] + b0[0] * w[3], s10, s11;
    uint32_t o;
    for (o = 1; o < CO; ++o) {
        s00 += a0[o] * w[9 * o + 4];
        s01 += a0[o] * w[9 * o + 5] + b0[o] * w[9 * o + 3];
    }
    x0[0] += s00;
    x0[1] += s01;
    if (X1) {
        s10 = D1 ? a0[0] * w[7] + a1[0] * w[1] : a0[0] * w[7];
        s11 = D1 ? a0[0] * w[8] + b0[0] * w[6] + (a1[0] * w[2] + b1[0] * w[0]) : a0[0] * w[8] + b0[0] * w[6];
        for (o = 1; o < CO; ++o) {
            const float *wo = w + 9 * o;
            s10 += D1 ? a0[o] * wo[7] + a1[o] * wo[1] : a0[o] * wo[7];
            s11 += D1 ? a0[o] * wo[8] + b0[o] * wo[6] + (a1[o] * wo[2] + b1[o] * wo[0]) : a0[o] * wo[8] + b0[o] * wo[6];
        }
        x1[0] += s10;
        x1[1] += s11;
    }
}

/* CO output channels (dy rows d0 + o ds, d1 + o ds; weights w + 9 o) into the same dx rows */
POET_INLINE void dw3_s2_rows(float *x0, float *x1, const float *d0, const float *d1, uint32_t ds, const float *w,
                             uint32_t w_in, uint32_t w_out, const int D1, const int X1, const uint32_t CO)
{
    float a0[2], a1[2], b0[2], b1[2];
    uint32_t j = 0, o;
    for (o = 0; o < CO; ++o)
        a0[o] = d0[o * ds], a1[o] = D1 ? d1[o * ds] : 0.0f;
    /* blocks 0 .. w_out - 2 have dy column j + 1 and dx column 2j + 1; two a step, their roles
     * swapped, so that the carried column is not moved */
    for (; j + 3 <= w_out; j += 2) {
        for (o = 0; o < CO; ++o)
            b0[o] = d0[o * ds + j + 1], b1[o] = D1 ? d1[o * ds + j + 1] : 0.0f;
        dw3_s2_block(x0 + 2 * j, x1 + 2 * j, a0, a1, b0, b1, w, D1, X1, CO);
        for (o = 0; o < CO; ++o)
            a0[o] = d0[o * ds + j + 2], a1[o] = D1 ? d1[o * ds + j + 2] : 0.0f;
        dw3_s2_block(x0 + 2 * j + 2, x1 + 2 * j + 2, b0, b1, a0, a1, w, D1, X1, CO);
    }
    if (j + 2 <= w_out) {
        for (o = 0; o < CO; ++o)
            b0[o] = d0[o * ds + j + 1], b1[o] = D1 ? d1[o * ds + j + 1] : 0.0f;
        dw3_s2_block(x0 + 2 * j, x1 + 2 * j, a0, a1, b0, b1, w, D1, X1, CO);
        for (o = 0; o < CO; ++o)
            a0[o] = b0[o], a1[o] = b1[o];
        ++j;
    }
    /* the last block: no dy column after it, and dx column 2j + 1 only for an even width */
    for (o = 0; o < CO; ++o) {
        const float *wo = w + 9 * o;
        x0[2 * j] += a0[o] * wo[4];
        if (X1)
            x1[2 * j] += D1 ? a0[o] * wo[7] + a1[o] * wo[1] : a0[o] * wo[7];
        if (2 * j + 1 < w_in) {
            x0[2 * j + 1] += a0[o] * wo[5];
            if (X1)
                x1[2 * j + 1] += D1 ? a0[o] * wo[8] + a1[o] * wo[2] : a0[o] * wo[8];
        }
    }
}

/* dx channel dxc += the data gradient of CO output channels from dyc on (plane apart), weights wc */
POET_INLINE void dw3_s2_backward_input(float *dxc, const float *dyc, const float *wc, const poet_conv2d_shape *s,
                                       const uint32_t CO)
{
    const uint32_t w_in = s->w_in, w_out = s->w_out, ds = s->h_out * w_out;
    float w[18];
    uint32_t m, i;
    for (i = 0; i < 9 * CO; ++i)
        w[i] = wc[i];
    for (m = 0; m < s->h_out; ++m) {
        float *x0 = dxc + 2 * m * w_in, *x1 = x0 + w_in;
        const float *d0 = dyc + m * w_out, *d1 = d0 + w_out;
        if (m + 1 < s->h_out && 2 * m + 1 < s->h_in)
            dw3_s2_rows(x0, x1, d0, d1, ds, w, w_in, w_out, 1, 1, CO);
        else if (2 * m + 1 < s->h_in) /* the last dy row, an even height */
            dw3_s2_rows(x0, x1, d0, d0, ds, w, w_in, w_out, 0, 1, CO);
        else /* the last dy row, an odd height: its dx row has no row after it */
            dw3_s2_rows(x0, x0, d0, d0, ds, w, w_in, w_out, 0, 0, CO);
    }
}

POET_OUTLINE void dw3_s2_backward_input_channel(float *dxc, const float *dyc, const float *wc,
                                                const poet_conv2d_shape *s)
{
    dw3_s2_backward_input(dxc, dyc, wc, s, 1);
}

#ifndef POET_KERNELS_SMALL
POET_OUTLINE void dw3_s2_backward_input_channels2(float *dxc, const float *dyc, const float *wc,
                                                  const poet_conv2d_shape *s)
{
    dw3_s2_backward_input(dxc, dyc, wc, s, 2);
}
#endif

#ifndef POET_KERNELS_SMALL
/* The data gradient of a depthwise layer at stride 2 (one input and one output channel a group,
 * 3x3, padding 1) in column strips: Q dy columns, dx's 2Q columns above them, walked down a pair
 * of dx rows per dy row. dx (2m + a, 2j + b) takes dy (m, j), and for a or b odd also (m + 1, j)
 * and (m, j + 1); each dy row's Q + 1 values are loaded once per strip and carried to the next
 * pair, each dx element is loaded, added to once with all its terms and stored. The last block of
 * a row (RIGHT 1: no dy column j + 1; 2: nor dx column 2j + 1, an odd width) and the last dy row
 * (BOT 1: no dy row m + 1; 2: nor dx row 2m + 1) are their own copies. */
POET_INLINE void dws2_put(float *x, float v, const int SET)
{
    if (SET)
        *x = v;
    else
        *x += v;
}

POET_INLINE void dws2_out(float *x0, float *x1, const float *d0, const float *d1, const float *w, const uint32_t Q,
                          const uint32_t RIGHT, const uint32_t BOT, const int SET)
{
    uint32_t q;
    for (q = 0; q < Q; ++q) {
        const int nr = RIGHT && q == Q - 1, nx = RIGHT == 2 && q == Q - 1;
        const float a = d0[q];
        dws2_put(&x0[2 * q], a * w[4], SET);
        if (!nx)
            dws2_put(&x0[2 * q + 1], nr ? a * w[5] : a * w[5] + d0[q + 1] * w[3], SET);
        if (BOT == 0) {
            dws2_put(&x1[2 * q], a * w[7] + d1[q] * w[1], SET);
            if (!nx)
                dws2_put(&x1[2 * q + 1], nr ? a * w[8] + d1[q] * w[2]
                                            : a * w[8] + d0[q + 1] * w[6] + (d1[q] * w[2] + d1[q + 1] * w[0]), SET);
        } else if (BOT == 1) {
            dws2_put(&x1[2 * q], a * w[7], SET);
            if (!nx)
                dws2_put(&x1[2 * q + 1], nr ? a * w[8] : a * w[8] + d0[q + 1] * w[6], SET);
        }
    }
}

POET_INLINE void dws2_load(float *d, const float *p, const uint32_t N)
{
    uint32_t j;
    for (j = 0; j < N; ++j)
        d[j] = p[j];
}

/* dy columns j0 .. j0 + Q (the blocks above them) of one plane, every row */
POET_INLINE void dws2_strip(float *dx, const float *dy, const float *w, uint32_t j0, const poet_conv2d_shape *s,
                            const uint32_t Q, const uint32_t RIGHT, const int SET)
{
    const uint32_t w_in = s->w_in, w_out = s->w_out, N = RIGHT ? Q : Q + 1;
    const float *dp = dy + j0;
    float *xp = dx + 2 * j0;
    float D[5], E[5];
    uint32_t i;
    dws2_load(D, dp, N);
    dp += w_out;
    /* dy rows in D and E by turns; one pointer each, stepped, and a count down */
    for (i = (s->h_out - 1) / 2; i; --i) {
        dws2_load(E, dp, N);
        dp += w_out;
        dws2_out(xp, xp + w_in, D, E, w, Q, RIGHT, 0, SET);
        xp += 2 * w_in;
        dws2_load(D, dp, N);
        dp += w_out;
        dws2_out(xp, xp + w_in, E, D, w, Q, RIGHT, 0, SET);
        xp += 2 * w_in;
    }
    if ((s->h_out - 1) % 2) {
        dws2_load(E, dp, N);
        dws2_out(xp, xp + w_in, D, E, w, Q, RIGHT, 0, SET);
        xp += 2 * w_in;
        if (2 * s->h_out - 1 < s->h_in) /* the last dy row, and the dx row below it */
            dws2_out(xp, xp + w_in, E, E, w, Q, RIGHT, 1, SET);
        else
            dws2_out(xp, xp, E, E, w, Q, RIGHT, 2, SET);
    } else if (2 * s->h_out - 1 < s->h_in)
        dws2_out(xp, xp + w_in, D, D, w, Q, RIGHT, 1, SET);
    else
        dws2_out(xp, xp, D, D, w, Q, RIGHT, 2, SET);
}

/* Every plane of the layer: strips of four blocks, what is left but the last block, the last.
 * SET: dx = the gradient (every element of dx is written), else dx += it. Padding 0 along H (a
 * strip of rows with its halo, h_in >= 3): dx row 0 takes dy row 0 through kernel row 0 alone; dx
 * rows 1 .. are the padded layer's rows 0 .. (dx row 2m + 1 from dy row m through kernel row 1,
 * 2m + 2 from rows m and m + 1 through kernel rows 2 and 0), so the walk runs on the plane from
 * row 1 on; an even height's last row is read by no window, its gradient 0. */
POET_INLINE void dws2_top(float *x0, const float *d0, const float *w, uint32_t w_in, uint32_t w_out, const int SET)
{
    uint32_t j;
    for (j = 0; j + 1 < w_out; ++j) {
        dws2_put(&x0[2 * j], d0[j] * w[1], SET);
        dws2_put(&x0[2 * j + 1], d0[j] * w[2] + d0[j + 1] * w[0], SET);
    }
    dws2_put(&x0[2 * j], d0[j] * w[1], SET);
    if (2 * j + 1 < w_in)
        dws2_put(&x0[2 * j + 1], d0[j] * w[2], SET);
}

POET_INLINE void dws2_layer(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s, const int SET)
{
    const uint32_t w_in = s->w_in, w_out = s->w_out, in_plane = s->h_in * w_in, out_plane = s->h_out * w_out;
    const uint32_t C = s->c_in, top = s->pad_h == 0;
    poet_conv2d_shape walk = *s; /* the rows the padded layer's walk covers */
    uint32_t n, c, k, j0;
    if (top)
        walk.h_in = s->h_in % 2 ? s->h_in - 1 : s->h_in - 2;
    for (n = 0; n < s->n; ++n)
        for (c = 0; c < C; ++c) {
            float wv[9], *xc = dx + (n * C + c) * in_plane;
            const float *dc = dy + (n * C + c) * out_plane;
            for (k = 0; k < 9; ++k)
                wv[k] = w[c * 9 + k];
            if (top) {
                dws2_top(xc, dc, wv, w_in, w_out, SET);
                if (SET && s->h_in % 2 == 0)
                    for (k = 0; k < w_in; ++k)
                        xc[in_plane - w_in + k] = 0.0f;
                xc += w_in;
            }
            for (j0 = 0; j0 + 4 < w_out; j0 += 4)
                dws2_strip(xc, dc, wv, j0, &walk, 4, 0, SET);
            if (j0 + 4 == w_out)
                dws2_strip(xc, dc, wv, j0, &walk, 3, 0, SET), j0 += 3;
            else if (j0 + 3 == w_out)
                dws2_strip(xc, dc, wv, j0, &walk, 2, 0, SET), j0 += 2;
            else if (j0 + 2 == w_out)
                dws2_strip(xc, dc, wv, j0, &walk, 1, 0, SET), j0 += 1;
            if (2 * j0 + 1 < w_in)
                dws2_strip(xc, dc, wv, j0, &walk, 1, 1, SET);
            else
                dws2_strip(xc, dc, wv, j0, &walk, 1, 2, SET);
        }
}

/* Whether the stride-2 strips take a layer: depthwise, 3x3, padding 1 along W and 1 along H (any
 * size) or 0 (h_in >= 3) */
static int dws2_ok(const poet_conv2d_shape *s)
{
    return s->groups == s->c_in && s->groups == s->c_out && s->k_h == 3 && s->k_w == 3 && s->stride_h == 2 &&
           s->stride_w == 2 && s->pad_w == 1 && (s->pad_h == 1 || (s->pad_h == 0 && s->h_in >= 3));
}

POET_OUTLINE void dws2_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    dws2_layer(dx, dy, w, s, 0);
}

/* The same writing dx instead of adding to it: each dx element is stored once with all its terms,
 * neither loaded nor zeroed first (a 2 x 2 block: 9 multiplies, 5 additions, 4 stores) */
POET_OUTLINE void dws2_backward_input_set(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    dws2_layer(dx, dy, w, s, 1);
}
#endif

/* One input channel a group (depthwise layers, and the stem's one input to several outputs),
 * 3x3, stride 2, one row and column of padding: each group's dx from its output channels, two at
 * a time where the build has the copy for them */
static int depthwise3_s2_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    const uint32_t cout_g = s->c_out / s->groups;
    uint32_t n, c, co;
#ifndef POET_KERNELS_SMALL
    if (dws2_ok(s)) { /* depthwise: the column strips */
        dws2_backward_input(dx, dy, w, s);
        return 1;
    }
#endif
    if (s->groups != s->c_in || s->k_h != 3 || s->k_w != 3 || s->stride_h != 2 || s->stride_w != 2 ||
        s->pad_h != 1 || s->pad_w != 1)
        return 0;
    for (n = 0; n < s->n; ++n)
        for (c = 0; c < s->c_in; ++c) {
            float *dxc = dx + (n * s->c_in + c) * s->h_in * s->w_in;
            co = 0;
#ifndef POET_KERNELS_SMALL
            for (; co + 2 <= cout_g; co += 2)
                dw3_s2_backward_input_channels2(dxc, dy + (n * s->c_out + c * cout_g + co) * s->h_out * s->w_out,
                                                w + (c * cout_g + co) * 9, s);
#endif
            for (; co < cout_g; ++co)
                dw3_s2_backward_input_channel(dxc, dy + (n * s->c_out + c * cout_g + co) * s->h_out * s->w_out,
                                              w + (c * cout_g + co) * 9, s);
        }
    return 1;
}

/* A depthwise 3x3 layer at stride 1 (one input and one output channel a group): dx is dy
 * correlated with the kernel turned around, padded by 2 - pad, which is the forward's row pass */
static int depthwise3_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    poet_conv2d_shape t;
    float flipped[9];
    uint32_t n, c, i;
    if (s->groups != s->c_in || s->groups != s->c_out || s->k_h != 3 || s->k_w != 3 || s->stride_h != 1 ||
        s->stride_w != 1 || s->pad_h > 2 || s->pad_w > 2)
        return 0;
    t = *s;
    t.h_in = s->h_out, t.w_in = s->w_out, t.h_out = s->h_in, t.w_out = s->w_in;
    t.pad_h = 2 - s->pad_h, t.pad_w = 2 - s->pad_w;
#ifndef POET_KERNELS_SMALL
    if (t.pad_h == 1 && dwc_ok(&t, 1)) { /* the column strips, the whole layer in one call */
        dwc_backward_input_s1(dx, dy, w, &t);
        return 1;
    }
#endif
    for (n = 0; n < s->n; ++n)
        for (c = 0; c < s->c_in; ++c) {
            for (i = 0; i < 9; ++i)
                flipped[i] = w[c * 9 + 8 - i];
            depthwise3_rows(dx + (n * s->c_in + c) * s->h_in * s->w_in, dy + (n * s->c_out + c) * s->h_out * s->w_out,
                            flipped, NULL, &t, 1, 1, 1);
        }
    return 1;
}

void poet_conv2d_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    poet_conv2d_shape flat;
    if (depthwise3_backward_input(dx, dy, w, s) || depthwise3_s2_backward_input(dx, dy, w, s))
        return;
    s = as_one_row(s, &flat);
#ifndef POET_KERNELS_SMALL
    if (pointwise_few_backward_input(dx, dy, w, s) || pointwise_mm_backward_input(dx, dy, w, s))
        return;
    if ((s->k_w == 3 || s->k_w == 1) && s->stride_w == 1)
        backward_input_all(dx, dy, w, s, 1);
    else if (s->stride_w == 2 && s->k_w <= 4) /* every class has 1 or 2 taps */
        backward_input_all(dx, dy, w, s, 2);
    else
#endif
        backward_input_all(dx, dy, w, s, 0);
}

/* dx = the data gradient, for its first contribution: the depthwise 3x3 layers (padding 1) write
 * every element of dx themselves, so the buffer needs no zeroing and no element is loaded; the
 * others zero dx and add into it */
void poet_conv2d_backward_input_set(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
#ifndef POET_KERNELS_SMALL
    poet_conv2d_shape t;
    if (dws2_ok(s)) {
        dws2_backward_input_set(dx, dy, w, s);
        return;
    }
    if (s->groups == s->c_in && s->groups == s->c_out && s->stride_h == 1 && s->stride_w == 1 && s->pad_h <= 2 &&
        s->pad_w <= 2) {
        t = *s; /* the forward's walk on the kernels turned around: geometry as in depthwise3_backward_input */
        t.h_in = s->h_out, t.w_in = s->w_out, t.h_out = s->h_in, t.w_out = s->w_in;
        t.pad_h = 2 - s->pad_h, t.pad_w = 2 - s->pad_w;
        if (dwc_ok(&t, 1) && t.pad_h == 1) {
            dwc_backward_input_set_s1(dx, dy, w, &t);
            return;
        }
        if (dwc_ok(&t, 1) && t.pad_h == 2) {
            dwc_backward_input_set_s1_p2(dx, dy, w, &t);
            return;
        }
    }
#endif
    poet_zero(dx, s->n * s->c_in * s->h_in * s->w_in);
    poet_conv2d_backward_input(dx, dy, w, s);
}

/* Weight gradients of output channels co .. co + C by input channels ci .. ci + Q (within co's
 * group) at tap (kh, kw): dy of each co against the input rows and columns the tap read, summed
 * over the batch, the rows and the columns in that order. One function for the gradient and the
 * fused SGD kernels, so the two stay bit-identical. */
POET_INLINE void weight_grad_tile(float *acc, const float *dy, const float *x, const poet_conv2d_shape *s, uint32_t co,
                                  uint32_t ci, uint32_t kh, uint32_t kw, const uint32_t SW, const uint32_t C,
                                  const uint32_t Q)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups;
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out, sw = SW ? SW : s->stride_w;
    uint32_t oh0, oh1, ow0, ow1;
    out_range(kh, s->stride_h, s->pad_h, s->h_in, s->h_out, &oh0, &oh1);
    out_range(kw, sw, s->pad_w, s->w_in, s->w_out, &ow0, &ow1);
    if (oh1 == oh0 || ow1 == ow0) {
        uint32_t i;
        for (i = 0; i < C * Q; ++i)
            acc[i] = 0.0f;
        return;
    }
    reduce_tile(acc, dy + co * out_plane + oh0 * s->w_out + ow0, (int32_t)out_plane, (int32_t)(s->c_out * out_plane),
                (int32_t)s->w_out, 1,
                x + ((co / cout_g) * cin_g + ci) * in_plane + (oh0 * s->stride_h + kh - s->pad_h) * s->w_in +
                    ow0 * sw + kw - s->pad_w,
                (int32_t)in_plane, (int32_t)(s->c_in * in_plane), (int32_t)(s->stride_h * s->w_in), (int32_t)sw, s->n,
                oh1 - oh0, ow1 - ow0, C, Q);
}

/* The bias gradient of channel co: the sum of dy over co's planes, a partial per plane to keep
 * the rounding of long sums down */
static float conv2d_bias_grad(const float *dy, const poet_conv2d_shape *s, uint32_t co)
{
    const uint32_t out_plane = s->h_out * s->w_out;
    uint32_t n, i;
    float acc = 0.0f;
    for (n = 0; n < s->n; ++n) {
        const float *dyo = dy + (n * s->c_out + co) * out_plane;
        float plane = 0.0f;
        for (i = 0; i < out_plane; ++i)
            plane += dyo[i];
        acc += plane;
    }
    return acc;
}

/* gw (sgd 0: gw += g) or w (sgd 1: w -= lr * g) for C x Q channels at every tap */
/* gw += g (sgd 0) or w -= lr * g (sgd 1), element (co, ci, kh, kw) */
static void apply_grad(float *gw, const poet_conv2d_shape *s, uint32_t co, uint32_t ci, uint32_t kh, uint32_t kw,
                       float g, float lr, int sgd)
{
    float *at = gw + ((co * (s->c_in / s->groups) + ci) * s->k_h + kh) * s->k_w + kw;
    if (sgd)
        *at -= lr * g;
    else
        *at += g;
}

/* C x Q channels at every tap */
POET_INLINE void weight_grad_channels(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s,
                                      uint32_t co, uint32_t ci, float lr, int sgd, const uint32_t SW,
                                      const uint32_t C, const uint32_t Q)
{
    const uint32_t taps = s->k_h * s->k_w, row = (s->c_in / s->groups) * taps;
    float acc[16];
    uint32_t kh, kw, c, q;
    for (kh = 0; kh < s->k_h; ++kh)
        for (kw = 0; kw < s->k_w; ++kw) {
            float *at = gw + co * row + ci * taps + kh * s->k_w + kw;
            weight_grad_tile(acc, dy, x, s, co, ci, kh, kw, SW, C, Q);
            for (c = 0; c < C; ++c)
                for (q = 0; q < Q; ++q) {
                    if (sgd)
                        at[c * row + q * taps] -= lr * acc[c * Q + q];
                    else
                        at[c * row + q * taps] += acc[c * Q + q];
                }
        }
}

/* The channels left over after tiles of 4 x 4: few, so one out-of-line copy for every stride */
POET_OUTLINE void weight_grad_edge(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s,
                                   uint32_t co, uint32_t ci, float lr, int sgd, uint32_t c_count, uint32_t q_count)
{
    if (c_count == 4)
        weight_grad_channels(gw, dy, x, s, co, ci, lr, sgd, 0, 4, 1);
    else if (q_count == 4)
        weight_grad_channels(gw, dy, x, s, co, ci, lr, sgd, 0, 1, 4);
    else
        weight_grad_channels(gw, dy, x, s, co, ci, lr, sgd, 0, 1, 1);
}

/* A depthwise channel (one input channel a group) with a 3-wide kernel: its three kernel columns
 * in one tile, over the output columns all three reach, then each column's own remainder */
POET_OUTLINE void weight_grad_depthwise3(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s,
                                         uint32_t co, float lr, int sgd)
{
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out, sw = s->stride_w;
    uint32_t kh, kw, oh0, oh1, lo = 0, hi = s->w_out, r0[3], r1[3];
#ifndef POET_KERNELS_SMALL
    /* (stride 1 takes the column strips or the window walk, dwc_layer_ok and dwr_ok; the shapes
     * they leave, this) */
    if (s->k_h == 3 && s->pad_w == 1 && s->w_in >= 3 && sw == 2) {
        float g[9], *at = gw + co * 9; /* one input channel, 3x3: channel co's nine weights */
        depthwise3_grad_s2(g, dy, x, s, co);
        for (kh = 0; kh < 9; ++kh) {
            if (sgd)
                at[kh] -= lr * g[kh];
            else
                at[kh] += g[kh];
        }
        return;
    }
#endif
    for (kw = 0; kw < 3; ++kw) {
        out_range(kw, sw, s->pad_w, s->w_in, s->w_out, &r0[kw], &r1[kw]);
        lo = r0[kw] > lo ? r0[kw] : lo;
        hi = r1[kw] < hi ? r1[kw] : hi;
    }
    if (hi < lo)
        hi = lo;
    for (kh = 0; kh < s->k_h; ++kh) {
        float acc[3] = {0.0f, 0.0f, 0.0f}, part[1];
        const float *dyr, *xr;
        out_range(kh, s->stride_h, s->pad_h, s->h_in, s->h_out, &oh0, &oh1);
        if (oh1 > oh0) {
            dyr = dy + co * out_plane + oh0 * s->w_out;
            xr = x + co * in_plane + (oh0 * s->stride_h + kh - s->pad_h) * s->w_in;
            if (hi > lo)
                reduce_tile(acc, dyr + lo, 0, (int32_t)(s->c_out * out_plane), (int32_t)s->w_out, 1,
                            xr + (lo * sw - s->pad_w), 1, (int32_t)(s->c_in * in_plane),
                            (int32_t)(s->stride_h * s->w_in), (int32_t)sw, s->n, oh1 - oh0, hi - lo, 1, 3);
            for (kw = 0; kw < 3; ++kw) {
                /* the columns this kernel column reaches outside [lo, hi): [r0, lo) and [hi, r1) */
                const uint32_t left_end = lo < r1[kw] ? lo : r1[kw], right = hi > r0[kw] ? hi : r0[kw];
                if (left_end > r0[kw]) {
                    reduce_tile(part, dyr + r0[kw], 0, (int32_t)(s->c_out * out_plane), (int32_t)s->w_out, 1,
                                xr + (r0[kw] * sw + kw - s->pad_w), 0, (int32_t)(s->c_in * in_plane),
                                (int32_t)(s->stride_h * s->w_in), (int32_t)sw, s->n, oh1 - oh0, left_end - r0[kw], 1,
                                1);
                    acc[kw] += part[0];
                }
                if (r1[kw] > right) {
                    reduce_tile(part, dyr + right, 0, (int32_t)(s->c_out * out_plane), (int32_t)s->w_out, 1,
                                xr + (right * sw + kw - s->pad_w), 0, (int32_t)(s->c_in * in_plane),
                                (int32_t)(s->stride_h * s->w_in), (int32_t)sw, s->n, oh1 - oh0, r1[kw] - right, 1, 1);
                    acc[kw] += part[0];
                }
            }
        }
        for (kw = 0; kw < 3; ++kw)
            apply_grad(gw, s, co, 0, kh, kw, acc[kw], lr, sgd);
    }
}

/* Tiles of 4 output by 4 input channels within each group, then the edges */
POET_INLINE void weight_grad_all(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s, float lr,
                                 int sgd, const uint32_t SW)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups;
    uint32_t g, co, ci;
#ifndef POET_KERNELS_SMALL
    if (dwc_layer_ok(s, 1) || dwc_layer_ok(s, 2)) { /* depthwise 3x3: the column strips */
        if (s->stride_w == 1)
            dwc_grad_s1(gw, dy, x, s, lr, sgd);
        else
            dwc_grad_s2(gw, dy, x, s, lr, sgd);
        return;
    }
#endif
    for (g = 0; g < s->groups; ++g) {
        const uint32_t co0 = g * cout_g;
        co = 0;
        if (cin_g == 1 && cout_g == 1 && s->k_w == 3) {
            weight_grad_depthwise3(gw, dy, x, s, co0, lr, sgd);
            continue;
        }
#ifndef POET_KERNELS_SMALL
        /* one input channel, several outputs (the stem): the depthwise walk, two outputs a pass */
        if (cin_g == 1 && s->k_h == 3 && s->k_w == 3 && s->pad_w == 1 && s->w_in >= 3 &&
            (s->stride_w == 1 || s->stride_w == 2))
            for (; co + 2 <= cout_g; co += 2) {
                float g[18], *at = gw + (co0 + co) * 9; /* the two channels' 18 weights */
                uint32_t k;
                if (s->stride_w == 1)
                    depthwise3_grad_s1_x2(g, dy, x, s, co0 + co);
                else
                    depthwise3_grad_s2_x2(g, dy, x, s, co0 + co);
                for (k = 0; k < 18; ++k) {
                    if (sgd)
                        at[k] -= lr * g[k];
                    else
                        at[k] += g[k];
                }
            }
#endif
        for (; co + 4 <= cout_g; co += 4) {
            for (ci = 0; ci + 4 <= cin_g; ci += 4)
                weight_grad_channels(gw, dy, x, s, co0 + co, ci, lr, sgd, SW, 4, 4);
            for (; ci < cin_g; ++ci)
                weight_grad_edge(gw, dy, x, s, co0 + co, ci, lr, sgd, 4, 1);
        }
        for (; co < cout_g; ++co) {
            for (ci = 0; ci + 4 <= cin_g; ci += 4)
                weight_grad_edge(gw, dy, x, s, co0 + co, ci, lr, sgd, 1, 4);
            for (; ci < cin_g; ++ci)
                weight_grad_edge(gw, dy, x, s, co0 + co, ci, lr, sgd, 1, 1);
        }
    }
}

#ifndef POET_KERNELS_SMALL
/* One step of a 4 x 4 block of pointwise weight gradients: s[c 4 + q] (INIT: =, else +=)
 * pa[c][k] pb[q][kb] */
POET_INLINE void pw_grad_step(float *s, const float *const *pa, const float *const *pb, int32_t k, int32_t kb,
                              const int INIT)
{
    float av[4], bv[4];
    uint32_t c, q;
    for (c = 0; c < 4; ++c)
        av[c] = pa[c][k], bv[c] = pb[c][kb];
    for (c = 0; c < 4; ++c)
        for (q = 0; q < 4; ++q)
            s[c * 4 + q] = INIT ? av[c] * bv[q] : s[c * 4 + q] + av[c] * bv[q];
}

/* s[c 4 + q] (INIT: =, else +=) sum over p < P of a[c ca + p] b[q cb + p SB], P >= 1. PC: P (and
 * ca, cb) when the call fixes it (mcu-vww's 3x3 planes), and then every load is an immediate
 * offset from a and b; else four pointers a side, stepped four positions at a time. SB: the
 * stride along the input row (a 1x1 stride-2 downsample). INIT: the first product starts the sum,
 * neither a zero nor its addition. */
POET_INLINE void pw_grad_block(float *s, const float *a, const float *b, uint32_t P, uint32_t ca, uint32_t cb,
                               const uint32_t PC, const uint32_t SB, const int INIT)
{
    const float *pa[4], *pb[4];
    uint32_t c, p = 0;
    if (PC) {
        for (c = 0; c < 4; ++c)
            pa[c] = a + c * PC, pb[c] = b + c * PC;
        if (INIT)
            pw_grad_step(s, pa, pb, 0, 0, 1), p = 1;
        for (; p < PC; ++p)
            pw_grad_step(s, pa, pb, (int32_t)p, (int32_t)p, 0);
        return;
    }
    for (c = 0; c < 4; ++c)
        pa[c] = a + c * ca, pb[c] = b + c * cb;
    if (INIT) {
        pw_grad_step(s, pa, pb, 0, 0, 1);
        for (c = 0; c < 4; ++c)
            ++pa[c], pb[c] += SB;
        p = 1;
    }
    if (SB == 2) /* a downsample's short rows (ResNet's 8 outputs wide) in one step of eight */
        for (; p + 8 <= P; p += 8) {
            for (c = 0; c < 8; ++c)
                pw_grad_step(s, pa, pb, (int32_t)c, (int32_t)(c * SB), 0);
            for (c = 0; c < 4; ++c)
                pa[c] += 8, pb[c] += 8 * SB;
        }
    for (; p + 4 <= P; p += 4) {
        pw_grad_step(s, pa, pb, 0, 0, 0);
        pw_grad_step(s, pa, pb, 1, (int32_t)SB, 0);
        pw_grad_step(s, pa, pb, 2, 2 * (int32_t)SB, 0);
        pw_grad_step(s, pa, pb, 3, 3 * (int32_t)SB, 0);
        for (c = 0; c < 4; ++c)
            pa[c] += 4, pb[c] += 4 * SB;
    }
    for (; p < P; ++p) {
        pw_grad_step(s, pa, pb, 0, 0, 0);
        for (c = 0; c < 4; ++c)
            ++pa[c], pb[c] += SB;
    }
}

/* Weight gradients of a 1x1 layer without padding, stride 1 (as one row) or 2, with channels in
 * fours: 4 x 4 blocks of sums over the batch and the plane's positions, each input loaded once
 * for four of them, with no per-tap set-up (the general tiles' output ranges and eight row
 * pointers cost as much as a reduction over mcu-vww's 6x6 and 3x3 planes). */
POET_INLINE void pointwise_weight_grad_p(float *gw, const float *dy, const float *x, const poet_conv2d_shape *shape,
                                         float lr, int sgd, const uint32_t PC, const uint32_t SB)
{
    /* a copy: the stores into gw might otherwise alias the shape, re-read every block */
    const poet_conv2d_shape copy = *shape, *s = &copy;
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups, P = PC ? PC : s->w_out;
    const uint32_t out_plane = s->h_out * s->w_out, in_plane = s->h_in * s->w_in;
    const uint32_t brow = s->stride_h * s->w_in;
    uint32_t g, co, ci, n, c, q, oh;
    for (g = 0; g < s->groups; ++g)
        for (co = g * cout_g; co < (g + 1) * cout_g; co += 4)
            for (ci = 0; ci < cin_g; ci += 4) {
                float acc[16], *at = gw + co * cin_g + ci;
                const float *a = dy + co * out_plane, *bx = x + (g * cin_g + ci) * in_plane;
                pw_grad_block(acc, a, bx, P, out_plane, in_plane, PC, SB, 1);
                for (oh = 1; oh < s->h_out; ++oh)
                    pw_grad_block(acc, a + oh * s->w_out, bx + oh * brow, P, out_plane, in_plane, PC, SB, 0);
                for (n = 1; n < s->n; ++n)
                    for (oh = 0; oh < s->h_out; ++oh)
                        pw_grad_block(acc, a + n * s->c_out * out_plane + oh * s->w_out,
                                      bx + n * s->c_in * in_plane + oh * brow, P, out_plane, in_plane, PC, SB, 0);
                /* one test a block, not one a weight */
                if (sgd)
                    for (c = 0; c < 4; ++c)
                        for (q = 0; q < 4; ++q)
                            at[c * cin_g + q] -= lr * acc[c * 4 + q];
                else
                    for (c = 0; c < 4; ++c)
                        for (q = 0; q < 4; ++q)
                            at[c * cin_g + q] += acc[c * 4 + q];
            }
}

POET_OUTLINE int pointwise_weight_grad(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s,
                                       float lr, int sgd)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups;
    if (s->k_h != 1 || s->k_w != 1 || s->pad_h || s->pad_w || cin_g % 4 || cout_g % 4)
        return 0;
    if (s->stride_w == 1 && s->h_out == 1 && s->w_out == 9)
        pointwise_weight_grad_p(gw, dy, x, s, lr, sgd, 9, 1);
    else if (s->stride_w == 1 && s->h_out == 1)
        pointwise_weight_grad_p(gw, dy, x, s, lr, sgd, 0, 1);
    else if (s->stride_w == 2)
        pointwise_weight_grad_p(gw, dy, x, s, lr, sgd, 0, 2);
    else
        return 0;
    return 1;
}
#endif

/* (out of line: a depthwise window, below, skips its set-up) */
POET_OUTLINE void weight_grad_any(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s, float lr,
                                  int sgd)
{
    poet_conv2d_shape flat;
    s = as_one_row(s, &flat);
#ifndef POET_KERNELS_SMALL
    if (pointwise_weight_grad(gw, dy, x, s, lr, sgd))
        return;
    if (s->stride_w == 1)
        weight_grad_all(gw, dy, x, s, lr, sgd, 1);
    else if (s->stride_w == 2)
        weight_grad_all(gw, dy, x, s, lr, sgd, 2);
    else
#endif
        weight_grad_all(gw, dy, x, s, lr, sgd, 0);
}

static void weight_grad(float *gw, const float *dy, const float *x, const poet_conv2d_shape *s, float lr, int sgd)
{
#ifndef POET_KERNELS_SMALL
    if (dwr_ok(s)) { /* a depthwise 3x3 window of a few rows: the rows' column walk */
        dwr_grad(gw, dy, x, s, lr, sgd);
        return;
    }
#endif
    weight_grad_any(gw, dy, x, s, lr, sgd);
}

void poet_conv2d_backward_params(float *gw, float *gb, const float *dy, const float *x,
                                 const poet_conv2d_shape *s)
{
    uint32_t co;
    if (gw)
        weight_grad(gw, dy, x, s, 0.0f, 0);
    if (gb)
        for (co = 0; co < s->c_out; ++co)
            gb[co] += conv2d_bias_grad(dy, s, co);
}

void poet_conv2d_backward_params_sgd(float *w, float *b, const float *dy, const float *x,
                                     const poet_conv2d_shape *s, float lr)
{
    uint32_t co;
    weight_grad(w, dy, x, s, lr, 1);
    if (b)
        for (co = 0; co < s->c_out; ++co)
            b[co] -= lr * conv2d_bias_grad(dy, s, co);
}

int poet_pool2d_shape_ok(const poet_pool2d_shape *s)
{
    return s->n >= 1 && s->c >= 1 && 2 * s->pad_h <= s->k_h && 2 * s->pad_w <= s->k_w &&
           extent_ok(s->h_in, s->h_out, s->k_h, s->stride_h, s->pad_h) &&
           extent_ok(s->w_in, s->w_out, s->k_w, s->stride_w, s->pad_w);
}

/* Index within the plane of the window's maximum: the first in scan order, a NaN replacing it as
 * torch's `val > max || isnan(val)` does */
static uint32_t window_argmax(const float *xc, const poet_pool2d_shape *s, uint32_t oh, uint32_t ow)
{
    uint32_t kh0, kh1, kw0, kw1, kh, kw, best_at;
    float best;
    tap_range(oh, s->stride_h, s->pad_h, s->k_h, s->h_in, &kh0, &kh1);
    tap_range(ow, s->stride_w, s->pad_w, s->k_w, s->w_in, &kw0, &kw1);
    best_at = (oh * s->stride_h + kh0 - s->pad_h) * s->w_in + ow * s->stride_w + kw0 - s->pad_w;
    best = xc[best_at];
    for (kh = kh0; kh < kh1; ++kh)
        for (kw = kw0; kw < kw1; ++kw) {
            const uint32_t at = (oh * s->stride_h + kh - s->pad_h) * s->w_in + ow * s->stride_w + kw - s->pad_w;
            const float v = xc[at];
            if (v > best || v != v) {
                best = v;
                best_at = at;
            }
        }
    return best_at;
}

void poet_maxpool2d_forward(float *y, const float *x, const poet_pool2d_shape *s)
{
    const uint32_t planes = s->n * s->c, in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out;
    uint32_t p, oh, ow;
    for (p = 0; p < planes; ++p) {
        const float *xc = x + p * in_plane;
        float *yc = y + p * out_plane;
        for (oh = 0; oh < s->h_out; ++oh)
            for (ow = 0; ow < s->w_out; ++ow)
                yc[oh * s->w_out + ow] = xc[window_argmax(xc, s, oh, ow)];
    }
}

void poet_maxpool2d_backward(float *dx, const float *dy, const float *x, const poet_pool2d_shape *s)
{
    const uint32_t planes = s->n * s->c, in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out;
    uint32_t p, oh, ow;
    for (p = 0; p < planes; ++p) {
        const float *xc = x + p * in_plane;
        const float *dyc = dy + p * out_plane;
        float *dxc = dx + p * in_plane;
        for (oh = 0; oh < s->h_out; ++oh)
            for (ow = 0; ow < s->w_out; ++ow)
                dxc[window_argmax(xc, s, oh, ow)] += dyc[oh * s->w_out + ow];
    }
}

void poet_avgpool2d_forward(float *y, const float *x, const poet_pool2d_shape *s)
{
    const uint32_t planes = s->n * s->c, in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out;
    const float divisor = (float)(s->k_h * s->k_w);
    uint32_t p, oh, ow, kh, kw, kh0, kh1, kw0, kw1;
    for (p = 0; p < planes; ++p) {
        const float *xc = x + p * in_plane;
        float *yc = y + p * out_plane;
        for (oh = 0; oh < s->h_out; ++oh) {
            tap_range(oh, s->stride_h, s->pad_h, s->k_h, s->h_in, &kh0, &kh1);
            for (ow = 0; ow < s->w_out; ++ow) {
                const uint32_t col = ow * s->stride_w - s->pad_w;
                float acc = 0.0f;
                tap_range(ow, s->stride_w, s->pad_w, s->k_w, s->w_in, &kw0, &kw1);
                for (kh = kh0; kh < kh1; ++kh)
                    for (kw = kw0; kw < kw1; ++kw)
                        acc += xc[(oh * s->stride_h + kh - s->pad_h) * s->w_in + col + kw];
                yc[oh * s->w_out + ow] = acc / divisor;
            }
        }
    }
}

void poet_avgpool2d_backward(float *dx, const float *dy, const poet_pool2d_shape *s)
{
    const uint32_t planes = s->n * s->c, in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out;
    const float divisor = (float)(s->k_h * s->k_w);
    uint32_t p, oh, ow, kh, kw, kh0, kh1, kw0, kw1;
    for (p = 0; p < planes; ++p) {
        const float *dyc = dy + p * out_plane;
        float *dxc = dx + p * in_plane;
        for (oh = 0; oh < s->h_out; ++oh) {
            tap_range(oh, s->stride_h, s->pad_h, s->k_h, s->h_in, &kh0, &kh1);
            for (ow = 0; ow < s->w_out; ++ow) {
                const uint32_t col = ow * s->stride_w - s->pad_w;
                const float g = dyc[oh * s->w_out + ow] / divisor;
                tap_range(ow, s->stride_w, s->pad_w, s->k_w, s->w_in, &kw0, &kw1);
                for (kh = kh0; kh < kh1; ++kh)
                    for (kw = kw0; kw < kw1; ++kw)
                        dxc[(oh * s->stride_h + kh - s->pad_h) * s->w_in + col + kw] += g;
            }
        }
    }
}

void poet_global_avgpool_forward(float *y, const float *x, uint32_t planes, uint32_t spatial)
{
    uint32_t p, i;
    for (p = 0; p < planes; ++p) {
        const float *xc = x + p * spatial;
        float acc = 0.0f;
        for (i = 0; i < spatial; ++i)
            acc += xc[i];
        y[p] = acc / (float)spatial;
    }
}

void poet_global_avgpool_backward(float *dx, const float *dy, uint32_t planes, uint32_t spatial)
{
    uint32_t p, i;
    for (p = 0; p < planes; ++p) {
        const float g = dy[p] / (float)spatial;
        float *dxc = dx + p * spatial;
        for (i = 0; i < spatial; ++i)
            dxc[i] += g;
    }
}
