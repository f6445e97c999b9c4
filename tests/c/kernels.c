#include <math.h>

#include "kernels.h"

void k_zero(float *y, uint32_t n) {
    uint32_t i;
    for (i = 0; i < n; i++) y[i] = 0.0f;
}

void k_copy(float *y, const float *x, uint32_t n) {
    uint32_t i;
    for (i = 0; i < n; i++) y[i] = x[i];
}

void k_linear(float *y, const float *x, const float *w, const float *b, uint32_t rows, uint32_t in, uint32_t out) {
    uint32_t r, o, i;
    for (r = 0; r < rows; r++)
        for (o = 0; o < out; o++) {
            float acc = b[o];
            for (i = 0; i < in; i++) acc += w[o * in + i] * x[r * in + i];
            y[r * out + o] = acc;
        }
}

void k_relu(float *y, const float *x, uint32_t n) {
    uint32_t i;
    for (i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void k_add(float *y, const float *a, const float *b, uint32_t n) {
    uint32_t i;
    for (i = 0; i < n; i++) y[i] = a[i] + b[i];
}

void k_loss(float *loss, const float *z, const int32_t *target, uint32_t rows, uint32_t classes) {
    uint32_t r, c;
    for (r = 0; r < rows; r++) {
        const float *zr = z + r * classes;
        float top = zr[0], sum = 0.0f;
        for (c = 1; c < classes; c++) top = zr[c] > top ? zr[c] : top;
        for (c = 0; c < classes; c++) sum += expf(zr[c] - top);
        loss[r] = top + logf(sum) - zr[target[r]];
    }
}

void k_loss_grad_acc(float *dz, const float *z, const float *loss, const int32_t *target, uint32_t rows,
                     uint32_t classes) {
    uint32_t r, c;
    for (r = 0; r < rows; r++) {
        const float *zr = z + r * classes;
        float lse = loss[r] + zr[target[r]];
        for (c = 0; c < classes; c++)
            dz[r * classes + c] += (expf(zr[c] - lse) - ((int32_t)c == target[r] ? 1.0f : 0.0f)) / (float)rows;
    }
}

void k_linear_data_grad_acc(float *dx, const float *dy, const float *w, uint32_t rows, uint32_t in, uint32_t out) {
    uint32_t r, o, i;
    for (r = 0; r < rows; r++)
        for (i = 0; i < in; i++) {
            float acc = 0.0f;
            for (o = 0; o < out; o++) acc += w[o * in + i] * dy[r * out + o];
            dx[r * in + i] += acc;
        }
}

void k_relu_grad_acc(float *dx, const float *dy, const float *y, uint32_t n) {
    uint32_t i;
    for (i = 0; i < n; i++) dx[i] += y[i] > 0.0f ? dy[i] : 0.0f;
}

void k_add_grad_acc(float *dx, const float *dy, uint32_t n) {
    uint32_t i;
    for (i = 0; i < n; i++) dx[i] += dy[i];
}

void k_linear_weight_grad(float *gw, float *gb, const float *dy, const float *x, uint32_t rows, uint32_t in,
                          uint32_t out) {
    uint32_t r, o, i;
    for (o = 0; o < out; o++) {
        float acc = 0.0f;
        for (r = 0; r < rows; r++) acc += dy[r * out + o];
        gb[o] = acc;
        for (i = 0; i < in; i++) {
            acc = 0.0f;
            for (r = 0; r < rows; r++) acc += dy[r * out + o] * x[r * in + i];
            gw[o * in + i] = acc;
        }
    }
}
