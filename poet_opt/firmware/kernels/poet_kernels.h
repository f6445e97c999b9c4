/* poet_kernels: reference fp32 kernels, forward and backward, for training on a microcontroller.
 *
 * Freestanding C99 for bare-metal targets (Cortex-M4F first): no libc, no libm, no malloc. A
 * generated training step places every tensor in one static arena and hands the kernels pointers
 * into it, so no kernel allocates, and the few per-channel statistics a backward pass needs are
 * written to caller buffers.
 *
 * Layout. Tensors are dense, row-major, batch first; images are NCHW. Parameters keep PyTorch's
 * layout (conv weight [c_out][c_in/groups][k_h][k_w], linear weight [out][in]), so each parameter
 * and each gradient maps 1:1 onto a tensor of `named_parameters()` and can be loaded or checked
 * without reshuffling. Sizes are uint32_t element counts, and index arithmetic is 32-bit: every
 * tensor holds fewer than 2^32 elements, as any microcontroller's does.
 *
 * Gradients ACCUMULATE. Every backward kernel adds into its outputs (dx += ..., gw += ...):
 *   - an activation used by several operators (a residual branch, x + x) receives one contribution
 *     per user, and the sum is its gradient without a separate add node;
 *   - weight and bias gradients can be built up over tiles or micro-batches.
 * The caller zeroes each gradient buffer once (poet_zero) before its first contribution, or makes
 * that contribution with a kernel that writes instead (poet_conv2d_backward_input_set,
 * poet_linear_backward_input_set). Where one kernel yields several gradients (weight and bias, a
 * norm's dx, dgamma and dbeta, add's two inputs), a NULL pointer skips the one not needed: a layer
 * without bias, a network input's dx.
 *
 * Aliasing. Elementwise forwards (copy, add, relu, relu6, gelu, softmax) may write in place
 * (y == x, or y == a or b for add); every other kernel needs its outputs disjoint from its inputs.
 * A backward that reads the forward's input (gelu, max pooling, norms, conv, linear, matmul)
 * needs that input intact, so it must not have been overwritten in place.
 *
 * Numerics. Arithmetic is float throughout (a double on an M4 is a slow software call). Dot
 * products and reductions run in a register and touch their destination once, which keeps the
 * rounding of long sums down. Every kernel agrees with PyTorch autograd in float64 on the same
 * inputs to within 1e-6 of the output's largest magnitude (tests/test_kernels.py).
 */
#ifndef POET_KERNELS_H
#define POET_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- maths (poet_math.c): libm's float functions with C99's special values. expf, logf and erff
 * are within 1 ulp of the exact result; expm1f, log1pf and erfcf within 3, as glibc's are. ---- */

float poet_expf(float x);
float poet_expm1f(float x); /* exp(x) - 1, accurate near 0 */
float poet_logf(float x);
float poet_log1pf(float x); /* log(1 + x), accurate near 0 */
/* correctly rounded; the FPU's vsqrt.f32 where there is one, integer arithmetic elsewhere
 * (Cortex-M0+), or always when built with -DPOET_SOFT_SQRT */
float poet_sqrtf(float x);
float poet_erff(float x);
float poet_erfcf(float x);  /* 1 - erf(x) without the cancellation, for GELU's negative side */

/* ---- buffers (poet_kernels_basic.c) ---- */

void poet_zero(float *x, uint32_t n);
/* flatten/reshape forward when the arena holds the view in a separate slot */
void poet_copy(float *y, const float *x, uint32_t n);
/* dst += src: flatten/reshape backward, and any gradient that passes through unchanged */
void poet_accumulate(float *dst, const float *src, uint32_t n);
/* `outer` blocks of `count` floats, block o at dst + o * dst_stride and src + o * src_stride:
 * a tiled layer's concat (a slice into the whole output) and its slices' gradients (+=, out of
 * the whole gradient). dst and src must not overlap. */
void poet_copy_strided(float *dst, const float *src, uint32_t outer, uint32_t count, uint32_t dst_stride,
                       uint32_t src_stride);
void poet_accumulate_strided(float *dst, const float *src, uint32_t outer, uint32_t count, uint32_t dst_stride,
                             uint32_t src_stride);

/* ---- elementwise (poet_kernels_basic.c) ---- */

void poet_add_forward(float *y, const float *a, const float *b, uint32_t n);
/* da += dy, db += dy; da == db (y = x + x) gets both contributions */
void poet_add_backward(float *da, float *db, const float *dy, uint32_t n);

/* ReLU and ReLU6 propagate NaN like torch. Their backward takes either the forward's input or its
 * output as `t`: both give the same mask (dy passes where 0 < t, and t < 6 for ReLU6), so a
 * schedule may keep whichever tensor it already holds. */
void poet_relu_forward(float *y, const float *x, uint32_t n);
void poet_relu_backward(float *dx, const float *dy, const float *t, uint32_t n);
void poet_relu6_forward(float *y, const float *x, uint32_t n);
void poet_relu6_backward(float *dx, const float *dy, const float *t, uint32_t n);
/* exact GELU, x * Phi(x), as torch.nn.GELU(); the backward reads the forward's INPUT x */
void poet_gelu_forward(float *y, const float *x, uint32_t n);
void poet_gelu_backward(float *dx, const float *dy, const float *x, uint32_t n);

/* ---- dense layers (poet_kernels_basic.c) ---- */

/* y[rows][out] = x[rows][in] W^T + b, W [out][in] as nn.Linear; b may be NULL. Leading dimensions
 * of a 3-D input (batch, sequence) fold into rows. */
void poet_linear_forward(float *y, const float *x, const float *w, const float *b, uint32_t rows,
                         uint32_t in, uint32_t out);
/* dx += dy W */
void poet_linear_backward_input(float *dx, const float *dy, const float *w, uint32_t rows, uint32_t in,
                                uint32_t out);
/* dx = the same: the first contribution to dx, which then needs no poet_zero */
#define POET_LINEAR_BACKWARD_INPUT_SET 1
void poet_linear_backward_input_set(float *dx, const float *dy, const float *w, uint32_t rows, uint32_t in,
                                    uint32_t out);
/* gw += dy^T x, gb += column sums of dy (gb may be NULL) */
void poet_linear_backward_params(float *gw, float *gb, const float *dy, const float *x, uint32_t rows,
                                 uint32_t in, uint32_t out);
/* The same gradients folded straight into an SGD step, w -= lr * (dy^T x), b -= lr * (column sums of
 * dy), one weight at a time: streamed weights are updated in place without a gradient buffer. Each
 * weight sees exactly the sum poet_linear_backward_params forms and the rounding of poet_sgd_step. */
void poet_linear_backward_params_sgd(float *w, float *b, const float *dy, const float *x, uint32_t rows,
                                     uint32_t in, uint32_t out, float lr);

/* c[batch][m][n] = a[batch][m][k] b[batch][k][n]; both operands carry the batch dimension */
void poet_matmul_forward(float *c, const float *a, const float *b, uint32_t batch, uint32_t m, uint32_t k,
                         uint32_t n);
/* da += dc b^T */
void poet_matmul_backward_a(float *da, const float *dc, const float *b, uint32_t batch, uint32_t m,
                            uint32_t k, uint32_t n);
/* db += a^T dc */
void poet_matmul_backward_b(float *db, const float *a, const float *dc, uint32_t batch, uint32_t m,
                            uint32_t k, uint32_t n);

/* softmax over the last dimension d of x[rows][d]; the backward reads the forward's OUTPUT y */
void poet_softmax_forward(float *y, const float *x, uint32_t rows, uint32_t d);
void poet_softmax_backward(float *dx, const float *dy, const float *y, uint32_t rows, uint32_t d);

/* ---- embeddings (poet_kernels_basic.c): nn.Embedding's table [rows][d], indexed by int32 token ids.
 * The table may be a tile that holds rows first .. first + rows - 1 of the whole (row tiles, where a
 * tile also holds a piece of d features); an id outside those rows selects nothing, so a tile reads
 * and moves its own rows only, and a whole table (first 0) is never read outside itself whatever
 * the ids (the library refuses ids outside the table before a step). The ids of a batch are the
 * network's input: the arena holds their int32 bits in the input's slot. ---- */

/* y[t][0..d) = table[ids[t] - first][0..d) for each of the `count` ids the table holds; the other
 * rows of y are left as they are (zero them first, or let another tile write them) */
void poet_embedding_forward(float *y, const int32_t *ids, const float *table, uint32_t count, uint32_t first,
                            uint32_t rows, uint32_t d);
/* gw[ids[t] - first] += dy[t], token by token in order, as torch's embedding backward sums them */
void poet_embedding_backward_params(float *gw, const float *dy, const int32_t *ids, uint32_t count, uint32_t first,
                                   uint32_t rows, uint32_t d);
/* The same gradient folded into an SGD step, table[r] -= lr * (sum of dy[t] over ids[t] == first + r):
 * each row's sum formed as poet_embedding_backward_params forms it, with the rounding of
 * poet_sgd_step; a row no id selects is not touched. Streamed tables need no gradient buffer. */
void poet_embedding_backward_params_sgd(float *table, const float *dy, const int32_t *ids, uint32_t count,
                                        uint32_t first, uint32_t rows, uint32_t d, float lr);

/* ---- loss and optimiser (poet_kernels_basic.c) ---- */

/* Mean softmax cross-entropy of logits[batch][classes] against class indices, as
 * nn.CrossEntropyLoss(). Targets are int32: PyTorch's int64 labels narrow losslessly (a class index
 * is far below 2^31), and int32 halves their arena slot. A target outside [0, classes), such as
 * torch's ignore_index -100, contributes nothing and is left out of the mean, as torch does for
 * ignore_index (torch raises on other out-of-range targets; a microcontroller cannot, and must not
 * read outside the row). All rows ignored gives NaN, as in torch. */
void poet_cross_entropy_forward(float *loss, const float *logits, const int32_t *target, uint32_t batch,
                                uint32_t classes);
/* dlogits += (softmax(logits) - onehot(target)) / (rows counted); the loss is the root, dloss = 1 */
void poet_cross_entropy_backward(float *dlogits, const float *logits, const int32_t *target, uint32_t batch,
                                 uint32_t classes);

/* w -= lr * g, as torch.optim.SGD without momentum or weight decay */
void poet_sgd_step(float *w, const float *g, uint32_t n, float lr);

/* torch.optim.Adam without weight decay or amsgrad. The betas are taken as given in float: pass
 * the float32 values (0.9f, 0.999f) to torch too when comparing, since 1 - 0.999f differs from
 * 1 - 0.999 at the 1e-5 level. */
typedef struct {
    float lr;    /* 1e-3 */
    float beta1; /* 0.9 */
    float beta2; /* 0.999 */
    float eps;   /* 1e-8 */
} poet_adam_config;

/* One step over n weights; m, v (exp_avg, exp_avg_sq) start at zero and persist between steps.
 * `step` counts from 1 and is this update's number, like torch's state["step"] after increment. */
void poet_adam_step(float *w, float *m, float *v, const float *g, uint32_t n, const poet_adam_config *cfg,
                    uint32_t step);

/* ---- convolution and pooling (poet_kernels_conv.c) ---- */

/* Geometry of nn.Conv2d with dilation 1 and zero padding. The output size is stored rather than
 * derived so a generated step can keep each layer's shape in a static const table; check it once
 * with poet_conv2d_shape_ok. */
typedef struct {
    uint32_t n;                  /* batch */
    uint32_t c_in, h_in, w_in;   /* input [n][c_in][h_in][w_in] */
    uint32_t c_out, h_out, w_out;/* output [n][c_out][h_out][w_out] */
    uint32_t k_h, k_w;
    uint32_t stride_h, stride_w;
    uint32_t pad_h, pad_w;
    uint32_t groups;             /* 1: dense; c_in: depthwise; divides c_in and c_out */
} poet_conv2d_shape;

/* 1 when every field is consistent (h_out = (h_in + 2 pad_h - k_h) / stride_h + 1, ...), else 0 */
int poet_conv2d_shape_ok(const poet_conv2d_shape *s);

/* w [c_out][c_in/groups][k_h][k_w]; b [c_out] or NULL */
void poet_conv2d_forward(float *y, const float *x, const float *w, const float *b, const poet_conv2d_shape *s);
/* dx += conv2d's transpose of dy */
void poet_conv2d_backward_input(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s);
/* dx = conv2d's transpose of dy: the first contribution to dx, which then needs no poet_zero (where
 * a layer has its own walk, dx is written and never read; else it is zeroed here and added to) */
#define POET_CONV2D_BACKWARD_INPUT_SET 1
void poet_conv2d_backward_input_set(float *dx, const float *dy, const float *w, const poet_conv2d_shape *s);
/* gw += correlation of x with dy; gb += per-channel sums of dy (gb may be NULL) */
void poet_conv2d_backward_params(float *gw, float *gb, const float *dy, const float *x,
                                 const poet_conv2d_shape *s);
/* w -= lr * gw, b -= lr * gb with the gradients of poet_conv2d_backward_params, in place and without
 * a gradient buffer (b may be NULL) */
void poet_conv2d_backward_params_sgd(float *w, float *b, const float *dy, const float *x,
                                     const poet_conv2d_shape *s, float lr);

/* Geometry of nn.MaxPool2d / nn.AvgPool2d with ceil_mode=False and dilation 1. As in torch, the
 * padding is at most half the kernel, so every window holds at least one input element. */
typedef struct {
    uint32_t n, c;
    uint32_t h_in, w_in;
    uint32_t h_out, w_out;
    uint32_t k_h, k_w;
    uint32_t stride_h, stride_w;
    uint32_t pad_h, pad_w;
} poet_pool2d_shape;

int poet_pool2d_shape_ok(const poet_pool2d_shape *s);

/* Padding never wins a max. The backward reads the forward's INPUT x and routes each dy to the
 * first maximum of its window in row-major scan order (torch's tie rule; a NaN counts as a max),
 * which spares the arena an index tensor. */
void poet_maxpool2d_forward(float *y, const float *x, const poet_pool2d_shape *s);
void poet_maxpool2d_backward(float *dx, const float *dy, const float *x, const poet_pool2d_shape *s);
/* count_include_pad=True (torch's default): every window divides by k_h * k_w */
void poet_avgpool2d_forward(float *y, const float *x, const poet_pool2d_shape *s);
void poet_avgpool2d_backward(float *dx, const float *dy, const poet_pool2d_shape *s);

/* nn.AdaptiveAvgPool2d(1): x [planes][spatial] -> y [planes], planes = n * c, spatial = h * w */
void poet_global_avgpool_forward(float *y, const float *x, uint32_t planes, uint32_t spatial);
void poet_global_avgpool_backward(float *dx, const float *dy, uint32_t planes, uint32_t spatial);

/* ---- normalisation (poet_kernels_norm.c) ---- */

/* nn.BatchNorm1d/2d in training mode over x [n][c][spatial] (spatial = h * w, or 1) */
typedef struct {
    uint32_t n, c, spatial;
    float eps;      /* torch default 1e-5 */
    float momentum; /* torch default 0.1; only read when running statistics are given */
} poet_batchnorm_shape;

/* Normalises with the batch's mean and biased variance and saves mean[c] and invstd[c] =
 * 1/sqrt(var + eps) for the backward. gamma and beta may be NULL (affine=False). running_mean and
 * running_var may be NULL; when given they move by `momentum` towards the batch mean and the
 * UNBIASED batch variance, as torch's running statistics do. */
void poet_batchnorm_forward(float *y, float *mean, float *invstd, float *running_mean, float *running_var,
                            const float *x, const float *gamma, const float *beta,
                            const poet_batchnorm_shape *s);
/* dx += ..., dgamma += sum(dy * xhat), dbeta += sum(dy), from the forward's INPUT x and its saved
 * mean and invstd. Any of dx, dgamma, dbeta may be NULL; gamma NULL means 1. */
void poet_batchnorm_backward(float *dx, float *dgamma, float *dbeta, const float *dy, const float *x,
                             const float *mean, const float *invstd, const float *gamma,
                             const poet_batchnorm_shape *s);

/* gamma -= lr * dgamma, beta -= lr * dbeta with poet_batchnorm_backward's parameter gradients, in
 * place (either may be NULL) */
void poet_batchnorm_backward_params_sgd(float *gamma, float *beta, const float *dy, const float *x,
                                        const float *mean, const float *invstd, const poet_batchnorm_shape *s,
                                        float lr);

/* y = (x - mu) * scale + shift over channel c of x [n][channels][spatial]: batch norm's last pass,
 * whichever statistics gave mu and scale (the batch's over strips, or the running ones) */
void poet_channel_affine(float *y, const float *x, uint32_t c, float mu, float scale, float shift, uint32_t n,
                         uint32_t channels, uint32_t spatial);

/* nn.BatchNorm1d/2d in eval mode over x [n][c][spatial] (a strip's rows, or the whole tensor): y =
 * (x - running_mean) / sqrt(running_var + eps) * gamma + beta, as torch after model.eval(). Each
 * sample is normalised alone, so a prediction does not depend on the rest of its batch, and no
 * statistics are saved or moved. gamma and beta may be NULL; y may be x. */
void poet_batchnorm_eval_forward(float *y, const float *x, const float *running_mean, const float *running_var,
                                 const float *gamma, const float *beta, uint32_t n, uint32_t channels,
                                 uint32_t spatial, float eps);

/* nn.LayerNorm(d) over the last d elements of x [rows][d]; mean[rows] and invstd[rows] saved as for
 * batch norm; gamma/beta [d] may be NULL (elementwise_affine=False) */
void poet_layernorm_forward(float *y, float *mean, float *invstd, const float *x, const float *gamma,
                            const float *beta, uint32_t rows, uint32_t d, float eps);
void poet_layernorm_backward(float *dx, float *dgamma, float *dbeta, const float *dy, const float *x,
                             const float *mean, const float *invstd, const float *gamma, uint32_t rows,
                             uint32_t d);
/* gamma -= lr * dgamma, beta -= lr * dbeta with poet_layernorm_backward's parameter gradients */
void poet_layernorm_backward_params_sgd(float *gamma, float *beta, const float *dy, const float *x,
                                        const float *mean, const float *invstd, uint32_t rows, uint32_t d,
                                        float lr);

/* ---- activation strips (poet_kernels_strips.c): a strip holds rows [a, b) of an [n][c][h][w]
 * tensor as [n][c][b - a][w]; spatial = (b - a) * w, total = n * h * w of the whole tensor ---- */

/* `outer` blocks of `count` floats set to value, block o at dst + o * stride: a window's padding rows */
void poet_fill_strided(float *dst, float value, uint32_t outer, uint32_t count, uint32_t stride);
/* stats [2][c]: each channel's mean and sum of squared deviations over the strips so far; prev
 * (NULL for the first strip) holds them for the `before` elements per channel of the strips before */
void poet_batchnorm_strip_stats(float *stats, const float *prev, const float *x, uint32_t n, uint32_t channels,
                                uint32_t spatial, uint32_t before);
/* y = (x - mean) / sqrt(m2 / total + eps) * gamma + beta, from the whole tensor's stats */
void poet_batchnorm_strip_forward(float *y, const float *x, const float *stats, const float *gamma,
                                  const float *beta, uint32_t n, uint32_t channels, uint32_t spatial,
                                  uint32_t total, float eps);
/* the running statistics' move, as poet_batchnorm_forward makes it, from the whole tensor's stats */
void poet_batchnorm_strip_running(float *running_mean, float *running_var, const float *stats, uint32_t channels,
                                  uint32_t total, float momentum);
/* sums [2][c]: sum dy and sum dy * xhat over the strips so far (prev: the strips before, or NULL) */
void poet_batchnorm_strip_grad_stats(float *sums, const float *prev, const float *dy, const float *x,
                                     const float *stats, uint32_t n, uint32_t channels, uint32_t spatial,
                                     uint32_t total, float eps);
/* dx += gamma / std * (dy - sum dy / total - xhat * sum dy xhat / total), the whole tensor's sums */
void poet_batchnorm_strip_backward(float *dx, const float *dy, const float *x, const float *stats, const float *sums,
                                   const float *gamma, uint32_t n, uint32_t channels, uint32_t spatial,
                                   uint32_t total, float eps);
/* y[p] += (sum of the strip's plane p) / whole (y zeroed before the first strip) */
void poet_global_avgpool_strip_forward(float *y, const float *x, uint32_t planes, uint32_t spatial, uint32_t whole);
/* dx[p][..] += dy[p] / whole over the strip */
void poet_global_avgpool_strip_backward(float *dx, const float *dy, uint32_t planes, uint32_t spatial, uint32_t whole);

/* ---- SiLU, hardswish and tanh (poet_kernels_basic.c) ---- */

/* SiLU x * sigmoid(x) and hardswish x * relu6(x + 3) / 6, as torch.nn.SiLU() and nn.Hardswish();
 * the forwards may write in place, the backwards read the forward's INPUT x */
void poet_silu_forward(float *y, const float *x, uint32_t n);
void poet_silu_backward(float *dx, const float *dy, const float *x, uint32_t n);
void poet_hardswish_forward(float *y, const float *x, uint32_t n);
void poet_hardswish_backward(float *dx, const float *dy, const float *x, uint32_t n);

/* tanh, as torch.tanh (BERT's pooler): the forward may write in place; the backward reads the
 * forward's OUTPUT y, dx += dy * (1 - y * y), as torch's tanh_backward */
void poet_tanh_forward(float *y, const float *x, uint32_t n);
void poet_tanh_backward(float *dx, const float *dy, const float *y, uint32_t n);

/* ---- row tiles of a transformer (poet_kernels_rows.c): a tile holds a block of tokens by a piece
 * of features, [n][block][piece]; `rows` counts the block's rows of every sample ---- */

/* c[i][j] += alpha * sum_p A(i, p) B(p, j), A(i, p) = a[i * a_row + p * a_col] and B(p, j) =
 * b[p * b_row + j * b_col], c's rows ldc apart: a sub-matrix of a tile, transposed or not, in place */
void poet_gemm(float *c, uint32_t ldc, const float *a, uint32_t a_row, uint32_t a_col, const float *b,
               uint32_t b_row, uint32_t b_col, uint32_t m, uint32_t n, uint32_t k, float alpha);
/* stats [2][rows]: each row's mean and sum of squared deviations over the pieces so far; prev (NULL
 * for a token's first piece) holds them for the `before` features of the pieces before */
void poet_layernorm_rows_stats(float *stats, const float *prev, const float *x, uint32_t rows, uint32_t piece,
                               uint32_t before);
/* y = (x - mean) / sqrt(m2 / d + eps) * gamma + beta over one piece, from a token's whole stats */
void poet_layernorm_rows_forward(float *y, const float *x, const float *stats, const float *gamma, const float *beta,
                                 uint32_t rows, uint32_t piece, uint32_t d, float eps);
/* sums [2][rows]: sum dy * gamma and sum dy * gamma * xhat over the pieces so far (prev as above) */
void poet_layernorm_rows_grad_stats(float *sums, const float *prev, const float *dy, const float *x,
                                    const float *stats, const float *gamma, uint32_t rows, uint32_t piece,
                                    uint32_t d, float eps);
/* dx += (dy * gamma - sum1 / d - xhat * sum2 / d) / std over one piece, from a token's whole sums */
void poet_layernorm_rows_backward(float *dx, const float *dy, const float *x, const float *stats, const float *sums,
                                  const float *gamma, uint32_t rows, uint32_t piece, uint32_t d, float eps);
/* dgamma += sum over rows of dy * xhat, dbeta += sum over rows of dy, one piece's */
void poet_layernorm_rows_backward_params(float *dgamma, float *dbeta, const float *dy, const float *x,
                                         const float *stats, uint32_t rows, uint32_t piece, uint32_t d, float eps);
/* y[s][c] += (sum of x[s][.][c] over the block's rows) / whole: a mean over tokens, block by block */
void poet_rows_mean_forward(float *y, const float *x, uint32_t n, uint32_t rows, uint32_t cols, uint32_t whole);
/* dx[s][r][c] += dy[s][c] / whole */
void poet_rows_mean_backward(float *dx, const float *dy, uint32_t n, uint32_t rows, uint32_t cols, uint32_t whole);

#ifdef __cplusplus
}
#endif

#endif /* POET_KERNELS_H */
