/* Float maths without libm: a bare-metal image has no libm to link, and the few functions the
 * kernels need are small. All arithmetic is float: on a Cortex-M4F a double operation is a
 * software call.
 *
 * expf and logf use Cephes' minimax polynomials (Stephen L. Moshier, Cephes Math Library, freely
 * distributable). erff and erfcf follow FreeBSD's s_erff.c (as in musl), which carries this notice:
 *
 * ====================================================
 * Copyright (C) 1993 by Sun Microsystems, Inc. All rights reserved.
 *
 * Developed at SunPro, a Sun Microsystems, Inc. business.
 * Permission to use, copy, modify, and distribute this
 * software is freely granted, provided that this notice
 * is preserved.
 * ====================================================
 *
 * The integer square root follows the same library's e_sqrtf.c under the same notice.
 */
#include "poet_kernels.h"

/* Bit access through a union is defined behaviour in C99 (TC3) and, unlike memcpy, needs no
 * library call on a freestanding target. */
typedef union {
    float f;
    uint32_t u;
} poet_float_bits;

static float from_bits(uint32_t u)
{
    poet_float_bits b;
    b.u = u;
    return b.f;
}

static uint32_t to_bits(float f)
{
    poet_float_bits b;
    b.f = f;
    return b.u;
}

#define POET_INF_BITS 0x7f800000u
#define POET_NAN_BITS 0x7fc00000u

static float fabs_(float x) { return from_bits(to_bits(x) & 0x7fffffffu); }

/* 2^k for k in [-126, 127], built in the exponent field */
static float pow2i(int32_t k) { return from_bits((uint32_t)(k + 127) << 23); }

float poet_expf(float x)
{
    float fk, kf, r, z, p;
    int32_t k;

    if (x != x)
        return x + x;
    if (x > 0x1.62e42ep+6f) /* largest x whose exp is finite */
        return from_bits(POET_INF_BITS);
    if (x < -0x1.9fe368p+6f) /* exp below 2^-150 rounds to zero */
        return 0.0f;

    /* x = k ln2 + r with |r| <= ln2 / 2; ln2 split in two so k * hi is exact */
    fk = x * 0x1.715476p+0f;
    k = (int32_t)(fk + (fk < 0.0f ? -0.5f : 0.5f));
    kf = (float)k;
    r = x - kf * 0x1.63p-1f;
    r = r - kf * -0x1.bd0106p-13f;
    z = r * r;
    p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
          1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r + 1.0f;

    /* 2^k may fall outside the normal range at either end; scale in two steps so the final
     * product rounds once (to a subnormal, or to the largest finite values) */
    if (k > 127)
        return (p * pow2i(k - 1)) * 2.0f;
    if (k < -126)
        return (p * pow2i(k + 64)) * 0x1p-64f;
    return p * pow2i(k);
}

float poet_logf(float x)
{
    uint32_t u = to_bits(x);
    int32_t e = 0;
    float m, z, y, fe, r;

    if (x != x)
        return x + x;
    if (x < 0.0f)
        return from_bits(POET_NAN_BITS);
    if (x == 0.0f)
        return from_bits(0x80000000u | POET_INF_BITS);
    if (u >= POET_INF_BITS)
        return x;
    if (u < 0x00800000u) { /* subnormal: normalise so the exponent field is meaningful */
        u = to_bits(x * 0x1p23f);
        e = -23;
    }

    /* x = m 2^e with m in [sqrt(1/2), sqrt(2)), then log(x) = log1p(m - 1) + e ln2 */
    e += (int32_t)(u >> 23) - 126;
    m = from_bits((u & 0x007fffffu) | 0x3f000000u);
    if (m < 0x1.6a09e6p-1f) {
        e -= 1;
        m = m + m - 1.0f;
    } else {
        m = m - 1.0f;
    }
    z = m * m;
    y = ((((((((7.0376836292e-2f * m - 1.1514610310e-1f) * m + 1.1676998740e-1f) * m - 1.2420140846e-1f) * m +
             1.4249322787e-1f) * m - 1.6668057665e-1f) * m + 2.0000714765e-1f) * m - 2.4999993993e-1f) * m +
         3.3333331174e-1f) * m * z;
    fe = (float)e;
    y += -2.12194440e-4f * fe;
    y += -0.5f * z;
    r = m + y;
    r += 0.693359375f * fe;
    return r;
}

/* Goldberg's trick: u - 1 is exact for u = fl(1 + x), and log(u) / (u - 1) varies slowly, so
 * scaling it by x restores the bits that rounding 1 + x lost. */
float poet_log1pf(float x)
{
    float u = 1.0f + x;
    if (u == 1.0f)
        return x;
    if (u == from_bits(POET_INF_BITS))
        return u;
    return poet_logf(u) * (x / (u - 1.0f));
}

/* Kahan's companion trick for exp(x) - 1 */
float poet_expm1f(float x)
{
    float u = poet_expf(x), um1;
    if (u == 1.0f)
        return x;
    um1 = u - 1.0f;
    if (um1 == -1.0f)
        return -1.0f;
    if (u == from_bits(POET_INF_BITS))
        return u;
    return um1 * (x / poet_logf(u));
}

/* A hardware square root where the compiler has one to inline; without -fno-math-errno the
 * compiler may still call libm's sqrtf for negative inputs, so build with it (toolchain.py does). */
#if !defined(POET_SOFT_SQRT) && (defined(__GNUC__) || defined(__clang__)) &&                               \
    ((defined(__ARM_FP) && (__ARM_FP & 4)) || defined(__SSE_MATH__) || defined(__aarch64__) ||              \
     (defined(__riscv_flen) && __riscv_flen >= 32))

float poet_sqrtf(float x) { return __builtin_sqrtf(x); }

#else

/* Correctly rounded (to nearest) square root, one result bit per step, integer operations only */
float poet_sqrtf(float x)
{
    uint32_t ux = to_bits(x), ix, q, s, r, t;
    int32_t m;

    if ((ux & POET_INF_BITS) == POET_INF_BITS)
        return x * x + x; /* NaN stays NaN, +inf stays +inf, -inf becomes NaN */
    if ((ux & 0x7fffffffu) == 0)
        return x; /* keeps the sign of zero */
    if (ux >> 31)
        return from_bits(POET_NAN_BITS);

    m = (int32_t)(ux >> 23);
    ix = ux & 0x007fffffu;
    if (m == 0) { /* subnormal: shift the leading one up to the implicit bit */
        while ((ix & 0x00800000u) == 0) {
            ix <<= 1;
            m -= 1;
        }
        m += 1;
    } else {
        ix |= 0x00800000u;
    }
    m -= 127;
    if (m & 1) /* make the exponent even so it halves exactly */
        ix += ix;
    m = (m - (m & 1)) / 2;

    ix += ix;
    q = s = 0;
    r = 0x01000000u;
    while (r != 0) {
        t = s + r;
        if (t <= ix) {
            s = t + r;
            ix -= t;
            q += r;
        }
        ix += ix;
        r >>= 1;
    }
    if (ix != 0) /* a remainder: round half to even on the extra bit */
        q += (q & 1);
    ux = (q >> 1) + 0x3f000000u;
    ux += (uint32_t)m << 23;
    return from_bits(ux);
}

#endif

/* ---- erf and erfc (FreeBSD s_erff.c) ---- */

static const float erx = 8.4506291151e-01f;
static const float efx = 1.2837916613e-01f;
static const float efx8 = 1.0270333290e+00f;
/* erf on [0, 0.84375] */
static const float pp0 = 1.2837916613e-01f, pp1 = -3.2504209876e-01f, pp2 = -2.8481749818e-02f,
                   pp3 = -5.7702702470e-03f, pp4 = -2.3763017452e-05f;
static const float qq1 = 3.9791721106e-01f, qq2 = 6.5022252500e-02f, qq3 = 5.0813062117e-03f,
                   qq4 = 1.3249473704e-04f, qq5 = -3.9602282413e-06f;
/* erf on [0.84375, 1.25] */
static const float pa0 = -2.3621185683e-03f, pa1 = 4.1485610604e-01f, pa2 = -3.7220788002e-01f,
                   pa3 = 3.1834661961e-01f, pa4 = -1.1089469492e-01f, pa5 = 3.5478305072e-02f,
                   pa6 = -2.1663755178e-03f;
static const float qa1 = 1.0642088205e-01f, qa2 = 5.4039794207e-01f, qa3 = 7.1828655899e-02f,
                   qa4 = 1.2617121637e-01f, qa5 = 1.3637083583e-02f, qa6 = 1.1984500103e-02f;
/* erfc on [1.25, 1/0.35] */
static const float ra0 = -9.8649440333e-03f, ra1 = -6.9385856390e-01f, ra2 = -1.0558626175e+01f,
                   ra3 = -6.2375331879e+01f, ra4 = -1.6239666748e+02f, ra5 = -1.8460508728e+02f,
                   ra6 = -8.1287437439e+01f, ra7 = -9.8143291473e+00f;
static const float sa1 = 1.9651271820e+01f, sa2 = 1.3765776062e+02f, sa3 = 4.3456588745e+02f,
                   sa4 = 6.4538726807e+02f, sa5 = 4.2900814819e+02f, sa6 = 1.0863500214e+02f,
                   sa7 = 6.5702495575e+00f, sa8 = -6.0424413532e-02f;
/* erfc on [1/0.35, 28] */
static const float rb0 = -9.8649431020e-03f, rb1 = -7.9928326607e-01f, rb2 = -1.7757955551e+01f,
                   rb3 = -1.6063638306e+02f, rb4 = -6.3756646729e+02f, rb5 = -1.0250950928e+03f,
                   rb6 = -4.8351919556e+02f;
static const float sb1 = 3.0338060379e+01f, sb2 = 3.2579251099e+02f, sb3 = 1.5367296143e+03f,
                   sb4 = 3.1998581543e+03f, sb5 = 2.5530502930e+03f, sb6 = 4.7452853394e+02f,
                   sb7 = -2.2440952301e+01f;

/* erfc(a) * a for a = |x| in [1.25, 28): exp(-a^2 - 0.5625 + R/S). a^2 is split as z^2 + (a^2 - z^2)
 * with z = a cut to 11 significant bits, so z^2 + 0.5625 fits in 24 bits and is exact; with the 12
 * bits of the original float port, the sum rounds wherever it crosses a power of two, which costs
 * up to 64 ulp by x = 8. */
static float erfc_tail(float a, uint32_t ia)
{
    float s = 1.0f / (a * a), R, S, z;
    if (ia < 0x4036db6eu) { /* a < 1/0.35 */
        R = ra0 + s * (ra1 + s * (ra2 + s * (ra3 + s * (ra4 + s * (ra5 + s * (ra6 + s * ra7))))));
        S = 1.0f + s * (sa1 + s * (sa2 + s * (sa3 + s * (sa4 + s * (sa5 + s * (sa6 + s * (sa7 + s * sa8)))))));
    } else {
        R = rb0 + s * (rb1 + s * (rb2 + s * (rb3 + s * (rb4 + s * (rb5 + s * rb6)))));
        S = 1.0f + s * (sb1 + s * (sb2 + s * (sb3 + s * (sb4 + s * (sb5 + s * (sb6 + s * sb7))))));
    }
    z = from_bits(ia & 0xffffe000u);
    return poet_expf(-z * z - 0.5625f) * poet_expf((z - a) * (z + a) + R / S);
}

/* P/Q on [0.84375, 1.25], where erf(a) = erx + P/Q */
static float erf_mid(float a)
{
    float s = a - 1.0f;
    float P = pa0 + s * (pa1 + s * (pa2 + s * (pa3 + s * (pa4 + s * (pa5 + s * pa6)))));
    float Q = 1.0f + s * (qa1 + s * (qa2 + s * (qa3 + s * (qa4 + s * (qa5 + s * qa6)))));
    return P / Q;
}

/* erf(x) / x - 1 on [0, 0.84375] */
static float erf_small(float x)
{
    float z = x * x;
    float r = pp0 + z * (pp1 + z * (pp2 + z * (pp3 + z * pp4)));
    float s = 1.0f + z * (qq1 + z * (qq2 + z * (qq3 + z * (qq4 + z * qq5))));
    return r / s;
}

float poet_erff(float x)
{
    uint32_t hx = to_bits(x), ix = hx & 0x7fffffffu;
    int negative = (hx >> 31) != 0;
    float a, r;

    if (ix >= POET_INF_BITS) /* NaN stays NaN, erf(+-inf) = +-1 */
        return x != x ? x + x : (negative ? -1.0f : 1.0f);
    if (ix < 0x3f580000u) { /* |x| < 0.84375 */
        if (ix < 0x31800000u) { /* |x| < 2^-28 */
            if (ix < 0x04000000u)
                return 0.125f * (8.0f * x + efx8 * x); /* keeps tiny x out of underflow */
            return x + efx * x;
        }
        return x + x * erf_small(x);
    }
    if (ix < 0x3fa00000u) { /* |x| < 1.25 */
        r = erx + erf_mid(fabs_(x));
        return negative ? -r : r;
    }
    if (ix >= 0x40c00000u) /* |x| >= 6: erf rounds to +-1 */
        return negative ? -1.0f : 1.0f;
    a = fabs_(x);
    r = 1.0f - erfc_tail(a, ix) / a;
    return negative ? -r : r;
}

float poet_erfcf(float x)
{
    uint32_t hx = to_bits(x), ix = hx & 0x7fffffffu;
    int negative = (hx >> 31) != 0;
    float a, r, y;

    if (ix >= POET_INF_BITS) /* NaN stays NaN, erfc(+inf) = 0, erfc(-inf) = 2 */
        return x != x ? x + x : (negative ? 2.0f : 0.0f);
    if (ix < 0x3f580000u) { /* |x| < 0.84375 */
        if (ix < 0x23800000u) /* |x| < 2^-56 */
            return 1.0f - x;
        y = erf_small(x);
        if (negative || hx < 0x3e800000u) /* x < 1/4 */
            return 1.0f - (x + x * y);
        r = x * y + (x - 0.5f);
        return 0.5f - r;
    }
    if (ix < 0x3fa00000u) { /* |x| < 1.25 */
        r = erf_mid(fabs_(x));
        return negative ? 1.0f + (erx + r) : (1.0f - erx) - r;
    }
    if (ix < 0x41e00000u) { /* |x| < 28 */
        if (negative && ix >= 0x40c00000u) /* x <= -6: rounds to 2 */
            return 2.0f;
        a = fabs_(x);
        r = erfc_tail(a, ix) / a;
        return negative ? 2.0f - r : r;
    }
    return negative ? 2.0f : 0.0f;
}
