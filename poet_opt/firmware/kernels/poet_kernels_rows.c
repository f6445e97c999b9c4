/* Row tiles of a transformer (poet_opt/model/rows.py; docs/streaming.md, "Row tiling"). A tile holds
 * a block of tokens by a piece of features of an [n][tokens][d] tensor, laid out [n][block][piece],
 * so the batch's samples fold into `rows` wherever a kernel treats rows alike.
 *
 * Attention's products read a head's columns out of pieces and a block's columns out of a score
 * row: poet_gemm takes every operand with its own row and column strides, so the generator hands it
 * sub-matrices of the tiles in place (transposed ones too) instead of gathering them into scratch
 * RAM beside the arena, and a product whose inner dimension spans several pieces or blocks is the
 * sum of one call per part (it accumulates).
 *
 * Layer norm normalises a token over its d features, which lie in several pieces: its statistics
 * are chained piece by piece as the graph plans them (stats [2][rows]: each row's mean, then its sum
 * of squared deviations, merged with the pairwise update of Chan et al., which stays exact in float
 * where E[x^2] - E[x]^2 would cancel), and each piece is normalised from the last link. Its
 * backward's sums of dy * gamma and dy * gamma * xhat over a row's features are chained the same
 * way (sums [2][rows]).
 */
#include "poet_kernels.h"

void poet_gemm(float *c, uint32_t ldc, const float *a, uint32_t a_row, uint32_t a_col, const float *b,
               uint32_t b_row, uint32_t b_col, uint32_t m, uint32_t n, uint32_t k, float alpha)
{
    uint32_t i, j, p;
    for (i = 0; i < m; ++i) {
        const float *ai = a + i * a_row;
        for (j = 0; j < n; ++j) {
            const float *bj = b + j * b_col;
            float acc = 0.0f;
            for (p = 0; p < k; ++p)
                acc += ai[p * a_col] * bj[p * b_row];
            c[i * ldc + j] += alpha * acc;
        }
    }
}

static float row_inv(const float *stats, uint32_t r, uint32_t rows, uint32_t d, float eps)
{
    return 1.0f / poet_sqrtf(stats[rows + r] / (float)d + eps);
}

void poet_layernorm_rows_stats(float *stats, const float *prev, const float *x, uint32_t rows, uint32_t piece,
                               uint32_t before)
{
    uint32_t r, i;
    for (r = 0; r < rows; ++r) {
        const float *xr = x + r * piece;
        float sum = 0.0f, m2 = 0.0f, mean;
        for (i = 0; i < piece; ++i)
            sum += xr[i];
        mean = sum / (float)piece;
        for (i = 0; i < piece; ++i) {
            const float dev = xr[i] - mean;
            m2 += dev * dev;
        }
        if (prev) {
            const float merged = (float)(before + piece);
            const float delta = mean - prev[r];
            stats[r] = prev[r] + delta * (float)piece / merged;
            stats[rows + r] = prev[rows + r] + m2 + delta * delta * (float)before * (float)piece / merged;
        } else {
            stats[r] = mean;
            stats[rows + r] = m2;
        }
    }
}

void poet_layernorm_rows_forward(float *y, const float *x, const float *stats, const float *gamma, const float *beta,
                                 uint32_t rows, uint32_t piece, uint32_t d, float eps)
{
    uint32_t r, i;
    for (r = 0; r < rows; ++r) {
        const float mu = stats[r], inv = row_inv(stats, r, rows, d, eps);
        for (i = 0; i < piece; ++i)
            y[r * piece + i] = (x[r * piece + i] - mu) * inv * gamma[i] + beta[i];
    }
}

void poet_layernorm_rows_grad_stats(float *sums, const float *prev, const float *dy, const float *x,
                                    const float *stats, const float *gamma, uint32_t rows, uint32_t piece,
                                    uint32_t d, float eps)
{
    uint32_t r, i;
    for (r = 0; r < rows; ++r) {
        const float mu = stats[r], inv = row_inv(stats, r, rows, d, eps);
        float s1 = 0.0f, s2 = 0.0f;
        for (i = 0; i < piece; ++i) {
            const float g = dy[r * piece + i] * gamma[i];
            s1 += g;
            s2 += g * ((x[r * piece + i] - mu) * inv);
        }
        sums[r] = prev ? prev[r] + s1 : s1;
        sums[rows + r] = prev ? prev[rows + r] + s2 : s2;
    }
}

void poet_layernorm_rows_backward(float *dx, const float *dy, const float *x, const float *stats, const float *sums,
                                  const float *gamma, uint32_t rows, uint32_t piece, uint32_t d, float eps)
{
    uint32_t r, i;
    for (r = 0; r < rows; ++r) {
        const float mu = stats[r], inv = row_inv(stats, r, rows, d, eps);
        /* the token's mean and variance depend on all d of its features, hence the whole row's sums */
        const float m1 = sums[r] / (float)d, m2 = sums[rows + r] / (float)d;
        for (i = 0; i < piece; ++i) {
            const float xhat = (x[r * piece + i] - mu) * inv;
            dx[r * piece + i] += (dy[r * piece + i] * gamma[i] - m1 - xhat * m2) * inv;
        }
    }
}

void poet_layernorm_rows_backward_params(float *dgamma, float *dbeta, const float *dy, const float *x,
                                         const float *stats, uint32_t rows, uint32_t piece, uint32_t d, float eps)
{
    uint32_t r, i;
    for (i = 0; i < piece; ++i) {
        float sg = 0.0f, sb = 0.0f;
        for (r = 0; r < rows; ++r) {
            const float g = dy[r * piece + i];
            sg += g * ((x[r * piece + i] - stats[r]) * row_inv(stats, r, rows, d, eps));
            sb += g;
        }
        dgamma[i] += sg;
        dbeta[i] += sb;
    }
}

void poet_rows_mean_forward(float *y, const float *x, uint32_t n, uint32_t rows, uint32_t cols, uint32_t whole)
{
    uint32_t s, r, c;
    for (s = 0; s < n; ++s)
        for (c = 0; c < cols; ++c) {
            float acc = 0.0f;
            for (r = 0; r < rows; ++r)
                acc += x[(s * rows + r) * cols + c];
            y[s * cols + c] += acc / (float)whole;
        }
}

void poet_rows_mean_backward(float *dx, const float *dy, uint32_t n, uint32_t rows, uint32_t cols, uint32_t whole)
{
    uint32_t s, r, c;
    for (s = 0; s < n; ++s)
        for (c = 0; c < cols; ++c) {
            const float g = dy[s * cols + c] / (float)whole;
            for (r = 0; r < rows; ++r)
                dx[(s * rows + r) * cols + c] += g;
        }
}
