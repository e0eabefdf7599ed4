/* Vector helpers shared by the CPU kernels (cpu_decode.c, cpu_elementwise.c, cpu_argmax.c, ...):
 * GCC vector extensions of VW floats (16 with AVX-512, 8 with AVX, else 4) plus FMA / max
 * intrinsics where the target has them, bf16 loads and rounding, int8 loads; -std=c11 keeps gcc from
 * contracting a * b + c by itself. */
#ifndef ACTORSERVE_CPU_VEC_H
#define ACTORSERVE_CPU_VEC_H

#include <stdint.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
/* The same vector in memory at any float alignment, aliasing anything. */
typedef float vf_mem __attribute__((vector_size(4 * VW), aligned(4), may_alias));
/* VW bf16 (their bits), and VW 32-bit lanes to widen them into. */
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
typedef uint16_t vh __attribute__((vector_size(2 * VW)));
typedef uint16_t vh_mem __attribute__((vector_size(2 * VW), aligned(2), may_alias));

#define INLINE static inline __attribute__((always_inline))

INLINE vf load(const float *p) { return *(const vf_mem *)p; }
INLINE void store(float *p, vf v) { *(vf_mem *)p = v; }
INLINE vf splat(float x) { return x - (vf){0}; } /* exact for every x, unlike (vf){0} + x */
INLINE vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* VW bf16 at p, widened to fp32 (exact: a bf16 is the high half of its fp32). */
INLINE vf load_bf16(const uint16_t *p) {
#if VW == 16
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16);
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16);
#else
    return (vf)(__builtin_convertvector(*(const vh_mem *)p, vu) << 16);
#endif
}

/* VW int8 at p (any alignment), widened to fp32 (exact): vpmovsxbd + vcvtdq2ps. */
typedef int8_t vc_mem __attribute__((vector_size(VW), aligned(1), may_alias));
INLINE vf load_int8(const int8_t *p) {
#if VW == 16
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
#elif VW == 8 && defined(__AVX2__)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p)));
#else
    return __builtin_convertvector(*(const vc_mem *)p, vf);
#endif
}

/* One bf16 (its bits) -> fp32, exactly. */
INLINE float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v = {(uint32_t)x << 16};
    return v.f;
}

/* fp32 -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN): c10's conversion. */
INLINE vh round_bf16(vf x) {
    const vu u = (vu)x;
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu nan = (vu)(x != x);
    return __builtin_convertvector((rounded & ~nan) | (0x7fc0u & nan), vh);
}

INLINE vf vmax(vf a, vf b) {
#if VW == 16
    return _mm512_max_ps(a, b);
#elif VW == 8
    return _mm256_max_ps(a, b);
#elif defined(__SSE__)
    return _mm_max_ps(a, b);
#else
    return vselect(a > b, a, b);
#endif
}

INLINE vf vmin(vf a, vf b) {
#if VW == 16
    return _mm512_min_ps(a, b);
#elif VW == 8
    return _mm256_min_ps(a, b);
#elif defined(__SSE__)
    return _mm_min_ps(a, b);
#else
    return vselect(a < b, a, b);
#endif
}

INLINE vf fmadd(vf a, vf b, vf c) { /* a * b + c */
#if VW == 16
    return _mm512_fmadd_ps(a, b, c);
#elif VW == 8 && defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return a * b + c;
#endif
}

/* Whether any lane of a comparison's result is set. */
INLINE int any_lane(vi mask) {
#if VW == 16
    return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif VW == 8
    return !_mm256_testz_si256((__m256i)mask, (__m256i)mask);
#else
    int any = 0;
    for (int l = 0; l < VW; l++) any |= mask[l];
    return any;
#endif
}

/* exp(x) for x <= 0 (-inf included: gives 0), Cephes' expf polynomial: within 2 ulp of expf
 * down to x = -87.3; below that (where expf goes subnormal) 0. */
INLINE vf vexp(vf x) {
    const vf lo = splat(-87.33654f), magic = splat(12582912.0f); /* 1.5 * 2^23 */
    const vi underflow = x < lo;
    x = vmax(x, lo);
    /* n = round(x / ln 2) via the magic number: its low mantissa bits hold n */
    const vf t = x * splat(1.44269504088896341f) + magic;
    const vf n = t - magic;
    const vi ni = (vi)t - (vi)magic;
    x = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f); /* ln 2, hi + lo parts */
    vf y = splat(1.9875691500e-4f);
    y = y * x + splat(1.3981999507e-3f);
    y = y * x + splat(8.3334519073e-3f);
    y = y * x + splat(4.1665795894e-2f);
    y = y * x + splat(1.6666665459e-1f);
    y = y * x + splat(5.0000001201e-1f);
    y = y * (x * x) + x + splat(1.0f);
    y *= (vf)((ni + 127) << 23); /* 2^n, n in [-126, 0] */
    return (vf)(~underflow & (vi)y);
}

#endif
