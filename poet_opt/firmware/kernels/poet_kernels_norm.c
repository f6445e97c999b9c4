/* Batch norm (training and eval mode) and layer norm.
 *
 * The variance takes two passes (mean first, then squared deviations): the one-pass
 * E[x^2] - E[x]^2 cancels catastrophically in float when the mean is large against the spread.
 * The backward recomputes xhat from the forward's input and the saved mean and 1/std rather than
 * keeping xhat, which would cost a second activation-sized tensor in the arena.
 */
#include "poet_kernels.h"

/* sum of x[n][c][0..spatial) over n, one partial per plane */
static float channel_sum(const float *x, const poet_batchnorm_shape *s, uint32_t c)
{
    float total = 0.0f;
    uint32_t n, i;
    for (n = 0; n < s->n; ++n) {
        const float *xc = x + (n * s->c + c) * s->spatial;
        float plane = 0.0f;
        for (i = 0; i < s->spatial; ++i)
            plane += xc[i];
        total += plane;
    }
    return total;
}

static float channel_squared_deviation(const float *x, const poet_batchnorm_shape *s, uint32_t c, float mean)
{
    float total = 0.0f;
    uint32_t n, i;
    for (n = 0; n < s->n; ++n) {
        const float *xc = x + (n * s->c + c) * s->spatial;
        float plane = 0.0f;
        for (i = 0; i < s->spatial; ++i) {
            const float d = xc[i] - mean;
            plane += d * d;
        }
        total += plane;
    }
    return total;
}

void poet_batchnorm_forward(float *y, float *mean, float *invstd, float *running_mean, float *running_var,
                            const float *x, const float *gamma, const float *beta,
                            const poet_batchnorm_shape *s)
{
    const uint32_t count = s->n * s->spatial;
    uint32_t c, n, i;
    for (c = 0; c < s->c; ++c) {
        const float mu = channel_sum(x, s, c) / (float)count;
        const float var = channel_squared_deviation(x, s, c, mu) / (float)count;
        const float inv = 1.0f / poet_sqrtf(var + s->eps);
        const float scale = gamma ? gamma[c] * inv : inv;
        const float shift = beta ? beta[c] : 0.0f;
        mean[c] = mu;
        invstd[c] = inv;
        if (running_mean)
            running_mean[c] = (1.0f - s->momentum) * running_mean[c] + s->momentum * mu;
        if (running_var && count > 1) /* torch refuses a single value per channel in training */
            running_var[c] = (1.0f - s->momentum) * running_var[c] +
                             s->momentum * (var * ((float)count / (float)(count - 1)));
        for (n = 0; n < s->n; ++n) {
            const float *xc = x + (n * s->c + c) * s->spatial;
            float *yc = y + (n * s->c + c) * s->spatial;
            for (i = 0; i < s->spatial; ++i)
                yc[i] = (xc[i] - mu) * scale + shift;
        }
    }
}

/* Channel c's sums of dy and dy * xhat over the batch: the parameter gradients (and part of the
 * data gradient). One function for the gradient and the fused SGD kernels, so the two stay
 * bit-identical. */
static void batchnorm_channel_sums(float *sum_dy, float *sum_dy_xhat, const float *dy, const float *x, float mu,
                                   float inv, uint32_t c, const poet_batchnorm_shape *s)
{
    uint32_t n, i;
    *sum_dy = 0.0f;
    *sum_dy_xhat = 0.0f;
    for (n = 0; n < s->n; ++n) {
        const float *xc = x + (n * s->c + c) * s->spatial;
        const float *dyc = dy + (n * s->c + c) * s->spatial;
        float plane_dy = 0.0f, plane_dy_xhat = 0.0f;
        for (i = 0; i < s->spatial; ++i) {
            plane_dy += dyc[i];
            plane_dy_xhat += dyc[i] * ((xc[i] - mu) * inv);
        }
        *sum_dy += plane_dy;
        *sum_dy_xhat += plane_dy_xhat;
    }
}

void poet_batchnorm_backward(float *dx, float *dgamma, float *dbeta, const float *dy, const float *x,
                             const float *mean, const float *invstd, const float *gamma,
                             const poet_batchnorm_shape *s)
{
    const uint32_t count = s->n * s->spatial;
    uint32_t c, n, i;
    for (c = 0; c < s->c; ++c) {
        const float mu = mean[c], inv = invstd[c];
        float sum_dy, sum_dy_xhat;
        batchnorm_channel_sums(&sum_dy, &sum_dy_xhat, dy, x, mu, inv, c, s);
        if (dgamma)
            dgamma[c] += sum_dy_xhat;
        if (dbeta)
            dbeta[c] += sum_dy;
        if (dx) {
            /* the batch statistics depend on every x, hence the two mean terms */
            const float mean_dy = sum_dy / (float)count, mean_dy_xhat = sum_dy_xhat / (float)count;
            const float scale = gamma ? gamma[c] * inv : inv;
            for (n = 0; n < s->n; ++n) {
                const float *xc = x + (n * s->c + c) * s->spatial;
                const float *dyc = dy + (n * s->c + c) * s->spatial;
                float *dxc = dx + (n * s->c + c) * s->spatial;
                for (i = 0; i < s->spatial; ++i)
                    dxc[i] += scale * (dyc[i] - mean_dy - (xc[i] - mu) * inv * mean_dy_xhat);
            }
        }
    }
}

void poet_batchnorm_backward_params_sgd(float *gamma, float *beta, const float *dy, const float *x,
                                        const float *mean, const float *invstd, const poet_batchnorm_shape *s,
                                        float lr)
{
    uint32_t c;
    for (c = 0; c < s->c; ++c) {
        const float mu = mean[c], inv = invstd[c];
        float sum_dy, sum_dy_xhat;
        batchnorm_channel_sums(&sum_dy, &sum_dy_xhat, dy, x, mu, inv, c, s);
        if (gamma)
            gamma[c] -= lr * sum_dy_xhat;
        if (beta)
            beta[c] -= lr * sum_dy;
    }
}

void poet_batchnorm_eval_forward(float *y, const float *x, const float *running_mean, const float *running_var,
                                 const float *gamma, const float *beta, uint32_t n, uint32_t channels,
                                 uint32_t spatial, float eps)
{
    uint32_t c;
    for (c = 0; c < channels; ++c) {
        const float inv = 1.0f / poet_sqrtf(running_var[c] + eps);
        poet_channel_affine(y, x, c, running_mean[c], gamma ? gamma[c] * inv : inv, beta ? beta[c] : 0.0f, n,
                            channels, spatial);
    }
}

void poet_channel_affine(float *y, const float *x, uint32_t c, float mu, float scale, float shift, uint32_t n,
                         uint32_t channels, uint32_t spatial)
{
    uint32_t b, i;
    for (b = 0; b < n; ++b) {
        const float *xc = x + (b * channels + c) * spatial;
        float *yc = y + (b * channels + c) * spatial;
        for (i = 0; i < spatial; ++i)
            yc[i] = (xc[i] - mu) * scale + shift;
    }
}

void poet_layernorm_forward(float *y, float *mean, float *invstd, const float *x, const float *gamma,
                            const float *beta, uint32_t rows, uint32_t d, float eps)
{
    uint32_t r, j;
    for (r = 0; r < rows; ++r) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float sum = 0.0f, sq = 0.0f, mu, inv;
        for (j = 0; j < d; ++j)
            sum += xr[j];
        mu = sum / (float)d;
        for (j = 0; j < d; ++j) {
            const float dev = xr[j] - mu;
            sq += dev * dev;
        }
        inv = 1.0f / poet_sqrtf(sq / (float)d + eps);
        mean[r] = mu;
        invstd[r] = inv;
        for (j = 0; j < d; ++j) {
            float v = (xr[j] - mu) * inv;
            if (gamma)
                v *= gamma[j];
            if (beta)
                v += beta[j];
            yr[j] = v;
        }
    }
}

/* Column j's sums of dy and dy * xhat over the rows: the parameter gradients, shared by the
 * gradient and the fused SGD kernels so the two stay bit-identical. */
static void layernorm_column_sums(float *sum_dy, float *sum_dy_xhat, const float *dy, const float *x,
                                  const float *mean, const float *invstd, uint32_t rows, uint32_t d, uint32_t j)
{
    uint32_t r;
    *sum_dy = 0.0f;
    *sum_dy_xhat = 0.0f;
    for (r = 0; r < rows; ++r) {
        const float dyj = dy[r * d + j];
        *sum_dy += dyj;
        *sum_dy_xhat += dyj * ((x[r * d + j] - mean[r]) * invstd[r]);
    }
}

void poet_layernorm_backward(float *dx, float *dgamma, float *dbeta, const float *dy, const float *x,
                             const float *mean, const float *invstd, const float *gamma, uint32_t rows,
                             uint32_t d)
{
    uint32_t r, j;
    if (dx)
        for (r = 0; r < rows; ++r) {
            const float *xr = x + r * d, *dyr = dy + r * d;
            float *dxr = dx + r * d;
            const float mu = mean[r], inv = invstd[r];
            float sum_g = 0.0f, sum_g_xhat = 0.0f, mean_g, mean_g_xhat;
            for (j = 0; j < d; ++j) {
                const float gj = gamma ? dyr[j] * gamma[j] : dyr[j];
                sum_g += gj;
                sum_g_xhat += gj * ((xr[j] - mu) * inv);
            }
            mean_g = sum_g / (float)d;
            mean_g_xhat = sum_g_xhat / (float)d;
            for (j = 0; j < d; ++j) {
                const float gj = gamma ? dyr[j] * gamma[j] : dyr[j];
                dxr[j] += inv * (gj - mean_g - (xr[j] - mu) * inv * mean_g_xhat);
            }
        }
    /* the parameter gradients sum over rows: one register sum per column */
    if (dgamma || dbeta)
        for (j = 0; j < d; ++j) {
            float sum_dy, sum_dy_xhat;
            layernorm_column_sums(&sum_dy, &sum_dy_xhat, dy, x, mean, invstd, rows, d, j);
            if (dgamma)
                dgamma[j] += sum_dy_xhat;
            if (dbeta)
                dbeta[j] += sum_dy;
        }
}

void poet_layernorm_backward_params_sgd(float *gamma, float *beta, const float *dy, const float *x,
                                        const float *mean, const float *invstd, uint32_t rows, uint32_t d,
                                        float lr)
{
    uint32_t j;
    for (j = 0; j < d; ++j) {
        float sum_dy, sum_dy_xhat;
        layernorm_column_sums(&sum_dy, &sum_dy_xhat, dy, x, mean, invstd, rows, d, j);
        if (gamma)
            gamma[j] -= lr * sum_dy_xhat;
        if (beta)
            beta[j] -= lr * sum_dy;
    }
}
