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

void poet_conv2d_forward(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups;
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out, taps = s->k_h * s->k_w;
    uint32_t n, co, oh, ow, ci, kh, kw, kh0, kh1, kw0, kw1;

    for (n = 0; n < s->n; ++n)
        for (co = 0; co < s->c_out; ++co) {
            const float *xg = x + (n * s->c_in + (co / cout_g) * cin_g) * in_plane;
            const float *wo = w + co * cin_g * taps;
            float *yo = y + (n * s->c_out + co) * out_plane;
            for (oh = 0; oh < s->h_out; ++oh) {
                tap_range(oh, s->stride_h, s->pad_h, s->k_h, s->h_in, &kh0, &kh1);
                for (ow = 0; ow < s->w_out; ++ow) {
                    const uint32_t col = ow * s->stride_w - s->pad_w;
                    float acc = 0.0f;
                    tap_range(ow, s->stride_w, s->pad_w, s->k_w, s->w_in, &kw0, &kw1);
                    for (ci = 0; ci < cin_g; ++ci)
                        for (kh = kh0; kh < kh1; ++kh) {
                            const float *xr = xg + ci * in_plane + (oh * s->stride_h + kh - s->pad_h) * s->w_in;
                            const float *wr = wo + (ci * s->k_h + kh) * s->k_w;
                            for (kw = kw0; kw < kw1; ++kw)
                                acc += xr[col + kw] * wr[kw];
                        }
                    yo[oh * s->w_out + ow] = b ? acc + b[co] : acc;
                }
            }
        }
}

/* Gathered per input element rather than scattered per output, so each dx element is one register
 * sum and one read-modify-write. Along each axis the taps that reach input i are those congruent
 * to i + pad modulo the stride; stepping the tap by the stride steps the output back by one. */
void poet_conv2d_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups;
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out, taps = s->k_h * s->k_w;
    uint32_t n, ci, ih, iw, kh, kw, oh, ow, co;

    for (n = 0; n < s->n; ++n)
        for (ci = 0; ci < s->c_in; ++ci) {
            const uint32_t g = ci / cin_g, ci_local = ci % cin_g;
            const float *dyg = dy + (n * s->c_out + g * cout_g) * out_plane;
            const float *wg = w + (g * cout_g * cin_g + ci_local) * taps;
            float *dxc = dx + (n * s->c_in + ci) * in_plane;
            for (ih = 0; ih < s->h_in; ++ih) {
                const uint32_t kh_first = (ih + s->pad_h) % s->stride_h;
                const uint32_t oh_first = (ih + s->pad_h) / s->stride_h;
                for (iw = 0; iw < s->w_in; ++iw) {
                    const uint32_t kw_first = (iw + s->pad_w) % s->stride_w;
                    const uint32_t ow_first = (iw + s->pad_w) / s->stride_w;
                    float acc = 0.0f;
                    for (kh = kh_first, oh = oh_first; kh < s->k_h; kh += s->stride_h, --oh) {
                        if (oh < s->h_out)
                            for (kw = kw_first, ow = ow_first; kw < s->k_w; kw += s->stride_w, --ow) {
                                if (ow < s->w_out)
                                    for (co = 0; co < cout_g; ++co)
                                        acc += dyg[co * out_plane + oh * s->w_out + ow] *
                                               wg[co * cin_g * taps + kh * s->k_w + kw];
                                if (ow == 0)
                                    break;
                            }
                        if (oh == 0)
                            break;
                    }
                    dxc[ih * s->w_in + iw] += acc;
                }
            }
        }
}

/* The gradient of weight (co, ci, kh, kw): dy of channel co against the input taps it read, over
 * the batch. One function for the gradient and the fused SGD kernels, so the two stay
 * bit-identical. */
static float conv2d_weight_grad(const float *dy, const float *x, const poet_conv2d_shape *s, uint32_t co,
                                uint32_t ci, uint32_t kh, uint32_t kw)
{
    const uint32_t cin_g = s->c_in / s->groups, cout_g = s->c_out / s->groups;
    const uint32_t in_plane = s->h_in * s->w_in, out_plane = s->h_out * s->w_out;
    const uint32_t x_channel = (co / cout_g) * cin_g;
    uint32_t n, oh, ow, oh0, oh1, ow0, ow1;
    float acc = 0.0f;
    out_range(kh, s->stride_h, s->pad_h, s->h_in, s->h_out, &oh0, &oh1);
    out_range(kw, s->stride_w, s->pad_w, s->w_in, s->w_out, &ow0, &ow1);
    for (n = 0; n < s->n; ++n) {
        const float *dyo = dy + (n * s->c_out + co) * out_plane;
        const float *xc = x + (n * s->c_in + x_channel + ci) * in_plane;
        for (oh = oh0; oh < oh1; ++oh) {
            const float *dyr = dyo + oh * s->w_out;
            const float *xr = xc + (oh * s->stride_h + kh - s->pad_h) * s->w_in;
            for (ow = ow0; ow < ow1; ++ow)
                acc += dyr[ow] * xr[ow * s->stride_w + kw - s->pad_w];
        }
    }
    return acc;
}

/* The gradient of bias co: the sum of dy over channel co's planes. */
static float conv2d_bias_grad(const float *dy, const poet_conv2d_shape *s, uint32_t co)
{
    const uint32_t out_plane = s->h_out * s->w_out;
    uint32_t n, i;
    float acc = 0.0f;
    for (n = 0; n < s->n; ++n) {
        const float *dyo = dy + (n * s->c_out + co) * out_plane;
        float plane = 0.0f; /* a partial per plane keeps the rounding of long sums down */
        for (i = 0; i < out_plane; ++i)
            plane += dyo[i];
        acc += plane;
    }
    return acc;
}

void poet_conv2d_backward_params(float *gw, float *gb, const float *dy, const float *x,
                                 const poet_conv2d_shape *s)
{
    const uint32_t cin_g = s->c_in / s->groups, taps = s->k_h * s->k_w;
    uint32_t co, ci, kh, kw;

    for (co = 0; co < s->c_out; ++co) {
        if (gw)
            for (ci = 0; ci < cin_g; ++ci)
                for (kh = 0; kh < s->k_h; ++kh)
                    for (kw = 0; kw < s->k_w; ++kw)
                        gw[(co * cin_g + ci) * taps + kh * s->k_w + kw] += conv2d_weight_grad(dy, x, s, co, ci, kh, kw);
        if (gb)
            gb[co] += conv2d_bias_grad(dy, s, co);
    }
}

void poet_conv2d_backward_params_sgd(float *w, float *b, const float *dy, const float *x,
                                     const poet_conv2d_shape *s, float lr)
{
    const uint32_t cin_g = s->c_in / s->groups, taps = s->k_h * s->k_w;
    uint32_t co, ci, kh, kw;

    for (co = 0; co < s->c_out; ++co) {
        for (ci = 0; ci < cin_g; ++ci)
            for (kh = 0; kh < s->k_h; ++kh)
                for (kw = 0; kw < s->k_w; ++kw)
                    w[(co * cin_g + ci) * taps + kh * s->k_w + kw] -= lr * conv2d_weight_grad(dy, x, s, co, ci, kh, kw);
        if (b)
            b[co] -= lr * conv2d_bias_grad(dy, s, co);
    }
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
