/* Activation strips: the pieces of batch norm and global pooling that need the whole tensor, for a
 * tensor held as strips of rows (docs/streaming.md, "Activation strips"). A strip of an
 * [n][c][h][w] tensor holds rows [a, b) of every plane, laid out [n][c][b - a][w], so a strip is
 * a smaller tensor of the same layout and `spatial` below is (b - a) * w.
 *
 * Batch norm's statistics are chained strip by strip as poet_opt/model/strips.py plans them: a
 * stats buffer holds each channel's mean, then its sum of squared deviations (m2), of the strips
 * so far; each strip's own mean and m2 are merged into the previous ones with the pairwise update
 * of Chan et al., which stays exact in float where E[x^2] - E[x]^2 would cancel. Its backward's
 * sums of dy and dy * xhat are chained the same way (sum dy first, then sum dy * xhat), plain
 * sums. `total` is the element count per channel of the whole tensor (n * h * w).
 */
#include "poet_kernels.h"

void poet_fill_strided(float *dst, float value, uint32_t outer, uint32_t count, uint32_t stride)
{
    uint32_t o, i;
    for (o = 0; o < outer; ++o)
        for (i = 0; i < count; ++i)
            dst[o * stride + i] = value;
}

static float strip_inv(const float *stats, uint32_t c, uint32_t channels, uint32_t total, float eps)
{
    return 1.0f / poet_sqrtf(stats[channels + c] / (float)total + eps);
}

void poet_batchnorm_strip_stats(float *stats, const float *prev, const float *x, uint32_t n, uint32_t channels,
                                uint32_t spatial, uint32_t before)
{
    const uint32_t count = n * spatial;
    uint32_t c, b, i;
    for (c = 0; c < channels; ++c) {
        float sum = 0.0f, m2 = 0.0f, mean;
        for (b = 0; b < n; ++b) {
            const float *xc = x + (b * channels + c) * spatial;
            float plane = 0.0f;
            for (i = 0; i < spatial; ++i)
                plane += xc[i];
            sum += plane;
        }
        mean = sum / (float)count;
        for (b = 0; b < n; ++b) {
            const float *xc = x + (b * channels + c) * spatial;
            float plane = 0.0f;
            for (i = 0; i < spatial; ++i) {
                const float d = xc[i] - mean;
                plane += d * d;
            }
            m2 += plane;
        }
        if (prev) {
            const float n_a = (float)before, merged = (float)(before + count);
            const float delta = mean - prev[c];
            stats[c] = prev[c] + delta * (float)count / merged;
            stats[channels + c] = prev[channels + c] + m2 + delta * delta * n_a * (float)count / merged;
        } else {
            stats[c] = mean;
            stats[channels + c] = m2;
        }
    }
}

void poet_batchnorm_strip_forward(float *y, const float *x, const float *stats, const float *gamma,
                                  const float *beta, uint32_t n, uint32_t channels, uint32_t spatial,
                                  uint32_t total, float eps)
{
    uint32_t c;
    for (c = 0; c < channels; ++c) {
        const float inv = strip_inv(stats, c, channels, total, eps);
        poet_channel_affine(y, x, c, stats[c], gamma ? gamma[c] * inv : inv, beta ? beta[c] : 0.0f, n, channels,
                            spatial);
    }
}

void poet_batchnorm_strip_running(float *running_mean, float *running_var, const float *stats, uint32_t channels,
                                  uint32_t total, float momentum)
{
    uint32_t c;
    for (c = 0; c < channels; ++c) {
        running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * stats[c];
        if (total > 1) /* torch's running variance is the unbiased one */
            running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (stats[channels + c] / (float)(total - 1));
    }
}

void poet_batchnorm_strip_grad_stats(float *sums, const float *prev, const float *dy, const float *x,
                                     const float *stats, uint32_t n, uint32_t channels, uint32_t spatial,
                                     uint32_t total, float eps)
{
    uint32_t c, b, i;
    for (c = 0; c < channels; ++c) {
        const float mu = stats[c], inv = strip_inv(stats, c, channels, total, eps);
        float sum_dy = 0.0f, sum_dy_xhat = 0.0f;
        for (b = 0; b < n; ++b) {
            const float *xc = x + (b * channels + c) * spatial;
            const float *dyc = dy + (b * channels + c) * spatial;
            float plane_dy = 0.0f, plane_dy_xhat = 0.0f;
            for (i = 0; i < spatial; ++i) {
                plane_dy += dyc[i];
                plane_dy_xhat += dyc[i] * ((xc[i] - mu) * inv);
            }
            sum_dy += plane_dy;
            sum_dy_xhat += plane_dy_xhat;
        }
        sums[c] = prev ? prev[c] + sum_dy : sum_dy;
        sums[channels + c] = prev ? prev[channels + c] + sum_dy_xhat : sum_dy_xhat;
    }
}

void poet_batchnorm_strip_backward(float *dx, const float *dy, const float *x, const float *stats, const float *sums,
                                   const float *gamma, uint32_t n, uint32_t channels, uint32_t spatial,
                                   uint32_t total, float eps)
{
    uint32_t c, b, i;
    for (c = 0; c < channels; ++c) {
        const float mu = stats[c], inv = strip_inv(stats, c, channels, total, eps);
        /* the batch statistics depend on every x of the whole tensor, hence its sums */
        const float mean_dy = sums[c] / (float)total, mean_dy_xhat = sums[channels + c] / (float)total;
        const float scale = gamma ? gamma[c] * inv : inv;
        for (b = 0; b < n; ++b) {
            const float *xc = x + (b * channels + c) * spatial;
            const float *dyc = dy + (b * channels + c) * spatial;
            float *dxc = dx + (b * channels + c) * spatial;
            for (i = 0; i < spatial; ++i)
                dxc[i] += scale * (dyc[i] - mean_dy - (xc[i] - mu) * inv * mean_dy_xhat);
        }
    }
}

void poet_global_avgpool_strip_forward(float *y, const float *x, uint32_t planes, uint32_t spatial, uint32_t whole)
{
    uint32_t p, i;
    for (p = 0; p < planes; ++p) {
        const float *xc = x + p * spatial;
        float acc = 0.0f;
        for (i = 0; i < spatial; ++i)
            acc += xc[i];
        y[p] += acc / (float)whole;
    }
}

void poet_global_avgpool_strip_backward(float *dx, const float *dy, uint32_t planes, uint32_t spatial, uint32_t whole)
{
    uint32_t p, i;
    for (p = 0; p < planes; ++p) {
        const float g = dy[p] / (float)whole;
        float *dxc = dx + p * spatial;
        for (i = 0; i < spatial; ++i)
            dxc[i] += g;
    }
}
