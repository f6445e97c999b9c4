/* fp32 operators of the zoo's MLPs (linear, relu, add, softmax cross-entropy) and their backward
 * rules, as tests/test_c_execution.py runs them under a poet-opt schedule. Shapes are row-major,
 * one row per sample; W is [out][in] like PyTorch's nn.Linear. The *_acc functions add into dx,
 * because a gradient node sums the contributions of every user of its forward tensor. */
#ifndef POET_TEST_KERNELS_H
#define POET_TEST_KERNELS_H

#include <stdint.h>

void k_zero(float *y, uint32_t n);
void k_copy(float *y, const float *x, uint32_t n);
void k_linear(float *y, const float *x, const float *w, const float *b, uint32_t rows, uint32_t in, uint32_t out);
void k_relu(float *y, const float *x, uint32_t n);
void k_add(float *y, const float *a, const float *b, uint32_t n);
/* per-sample cross-entropy: loss[r] = logsumexp(z[r]) - z[r][target[r]] */
void k_loss(float *loss, const float *z, const int32_t *target, uint32_t rows, uint32_t classes);

/* d(mean loss)/dz, from the logits and the per-sample loss: softmax = exp(z - (loss + z[target])) */
void k_loss_grad_acc(float *dz, const float *z, const float *loss, const int32_t *target, uint32_t rows,
                     uint32_t classes);
void k_linear_data_grad_acc(float *dx, const float *dy, const float *w, uint32_t rows, uint32_t in, uint32_t out);
/* the relu's backward reads its output y: dx += dy where y > 0 */
void k_relu_grad_acc(float *dx, const float *dy, const float *y, uint32_t n);
void k_add_grad_acc(float *dx, const float *dy, uint32_t n);
/* weight and bias gradients, assigned (a recomputed gradient node writes them again, identically) */
void k_linear_weight_grad(float *gw, float *gb, const float *dy, const float *x, uint32_t rows, uint32_t in,
                          uint32_t out);

#endif
