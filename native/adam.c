/* fzero's CPU Adam, gradient statistics and bandwidth ceiling: scalar, AVX2+FMA+F16C and AVX-512F paths chosen at
 * run time (see fzero_native.h).
 *
 * Build with portable base flags and -ffp-contract=off: the compiler must not fuse or reorder floating-point
 * operations on its own, because the scalar path is the operation order that the SIMD paths reproduce lane by lane
 * (and so bitwise). The SIMD paths live in functions with target attributes, so one binary built on any x86-64
 * machine runs the best path its host supports and never an instruction the host lacks.
 *
 * The element step (every path, every element), in float32 with one rounding per operation:
 *
 *     g' = g * grad_scale                  ; g' = fma(l2, p, g')        (Adam's L2 mode only)
 *     m  = fma(beta1, m, (1 - beta1) * g')
 *     v  = fma(beta2, v, (1 - beta2) * (g' * g'))
 *     d  = fma(sqrt(v), 1 / sqrt(1 - beta2^t), eps)
 *     p  = fma(-lr / (1 - beta1^t), m / d, p * decay)                    (decay = 1 - lr * wd for AdamW)
 *
 * The scalar factors are computed in double by the caller and rounded once to float.
 *
 * Parameter groups (fz_adam_step_segments): the scalars may differ per segment of the buffer. Since every path
 * computes each element alone, cutting the buffer into pieces changes no result, so one parallel pass runs the
 * vector loop once per piece with that piece's scalars, and each segment comes out bitwise as an ungrouped call on
 * it would; fz_adam_step is the one-segment case of the same code.
 */
#include "fzero_native.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(FZ_EMULATE_AVX512)
/* Development only (native/emulate_avx512.py): the AVX-512 path's own source compiled against SIMDe's portable
 * implementations of the intrinsics, so a machine without AVX-512 can check it bitwise against the scalar path.
 * The AVX2 path is left out of such a build. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#define FZ_X86 1
#define FZ_AVX512
/* Two instructions SIMDe lacks, by their definitions: VPMOVDW truncates each 32-bit lane to 16 bits; VCVTPS2PH
 * converts each lane (here with SIMDe's own F16C conversion, not fzero's). */
static inline __m256i fz_emu_cvtepi32_epi16(__m512i x) {
    int32_t in[16];
    uint16_t out[16];
    _mm512_storeu_si512((void *)in, x);
    for (int k = 0; k < 16; k++) out[k] = (uint16_t)in[k];
    return _mm256_loadu_si256((const __m256i *)out);
}
static inline __m256i fz_emu_cvtps_ph(__m512 x, int imm) {
    float in[16];
    uint16_t out[16];
    _mm512_storeu_ps(in, x);
    for (int k = 0; k < 16; k += 4) _mm_storel_epi64((__m128i *)(out + k), _mm_cvtps_ph(_mm_loadu_ps(in + k), imm));
    return _mm256_loadu_si256((const __m256i *)out);
}
static inline __m512d fz_emu_cvtps_pd(__m256 x) {
    float in[8];
    double out[8];
    _mm256_storeu_ps(in, x);
    for (int k = 0; k < 8; k++) out[k] = (double)in[k];
    return _mm512_loadu_pd(out);
}
#define _mm512_cvtepi32_epi16 fz_emu_cvtepi32_epi16
#define _mm512_cvtps_ph fz_emu_cvtps_ph
#define _mm512_cvtps_pd fz_emu_cvtps_pd
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#elif (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FZ_X86 1
#define FZ_HAVE_AVX2 1
#include <immintrin.h>
#define FZ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FZ_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#else
#define FZ_X86 0
#endif
#ifndef FZ_HAVE_AVX2
#define FZ_HAVE_AVX2 0
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#define FZ_INLINE static __forceinline
#else
#define FZ_INLINE static inline __attribute__((always_inline))
#endif

/* Chunks of work (see fz_run): below FZ_MIN_CHUNK elements a second thread costs more (fork/join) than it saves. */
#define FZ_MIN_CHUNK ((size_t)1 << 15)
#define FZ_MAX_CHUNKS 1024
/* From this many elements on, the low-precision copy is written with non-temporal stores. */
#define FZ_STREAM_MIN ((size_t)1 << 20)

/* ---------------------------------------------------------------------------------------------------------------
 * Conversions, bit-exact with the hardware instructions the SIMD paths use (VCVTPS2PH, VCVTPH2PS) and with
 * torch's round-to-nearest-even for bfloat16; NaNs stay NaN (quieted, sign and top payload bits kept).
 * ------------------------------------------------------------------------------------------------------------- */

FZ_INLINE uint32_t fz_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

FZ_INLINE float fz_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

FZ_INLINE uint16_t fz_to_bf16(float f) {
    uint32_t x = fz_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x0040u); /* NaN: quiet it */
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);                    /* round to nearest even */
}

FZ_INLINE uint16_t fz_to_f16(float f) {
    uint32_t x = fz_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu)); /* NaN, as VCVTPS2PH */
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* inf, or rounds to it (>= 65520) */
    if (ax < 0x38800000u) {
        /* |f| < 2^-14: a subnormal half. Adding 0.5 puts |f| where float's spacing is 2^-24, the half subnormal
         * quantum, so the hardware addition rounds it to nearest even; its mantissa is the half's. */
        return (uint16_t)(sign | (fz_bits(fz_float(ax) + 0.5f) - 0x3F000000u));
    }
    /* normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | ((ax + 0xC8000FFFu + ((ax >> 13) & 1u)) >> 13));
}

FZ_INLINE float fz_from_bf16(uint16_t h) { return fz_float((uint32_t)h << 16); }

FZ_INLINE float fz_from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return fz_float(sign | 0x7F800000u | (m << 13) | (m ? 0x00400000u : 0u));
    if (e == 0) return fz_float(sign | fz_bits((float)m * 0x1p-24f)); /* zero or subnormal: exact */
    return fz_float(sign | ((e + 112u) << 23) | (m << 13));
}

FZ_INLINE float fz_load1(const void *g, int dt, size_t i) {
    if (dt == FZ_BF16) return fz_from_bf16(((const uint16_t *)g)[i]);
    if (dt == FZ_F16) return fz_from_f16(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

FZ_INLINE void fz_store1(void *out, int odt, size_t i, float x) {
    if (odt == FZ_BF16) ((uint16_t *)out)[i] = fz_to_bf16(x);
    else if (odt == FZ_F16) ((uint16_t *)out)[i] = fz_to_f16(x);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Kernel arguments and the scalar element step
 * ------------------------------------------------------------------------------------------------------------- */

/* Passed by value into the inlined loops: a local copy, which the compiler knows no store through the float
 * pointers can change, so it keeps the pointers and scalars in registers instead of reloading them. */
typedef struct {
    fz_adam_hyper h;
    const float *p_in, *m_in, *v_in;
    const void *g;
    float *p_out, *m_out, *v_out;
    void *out16;
    int g_dtype, out_dtype;
    int stream; /* write the low-precision copy with non-temporal stores where aligned (large calls: see
                 * fz_adam_step_segments); fz_adam_chunk fences them */
} fz_adam_args;

/* One call's work: the arguments, and the segment table (fz_adam_step_segments) whose hyper structs replace
 * args.h piece by piece. */
typedef struct fz_adam_task {
    void (*fn)(const struct fz_adam_task *, size_t, size_t); /* the chosen path's fz_adam_range_* */
    fz_adam_args args;
    const fz_adam_hyper *hypers;
    const int64_t *ends, *group;
    size_t nseg;
} fz_adam_task;

/* The segment that holds element i: the first whose end is above i (so never an empty one). The table is valid
 * (ends non-decreasing, ends[nseg - 1] == n > i), so one exists. */
FZ_INLINE size_t fz_segment_of(const int64_t *ends, size_t nseg, size_t i) {
    size_t lo = 0, hi = nseg - 1;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if ((size_t)ends[mid] > i) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

FZ_INLINE void fz_adam1(const fz_adam_args a, size_t i, const int dt, const int odt, const int l2) {
    const fz_adam_hyper h = a.h;
    float p = a.p_in[i];
    float g = fz_load1(a.g, dt, i) * h.grad_scale;
    if (l2) g = fmaf(h.l2, p, g);
    float m = fmaf(h.beta1, a.m_in[i], h.one_minus_beta1 * g);
    float v = fmaf(h.beta2, a.v_in[i], h.one_minus_beta2 * (g * g));
    float d = fmaf(sqrtf(v), h.inv_sqrt_bc2, h.eps);
    p = fmaf(-h.step_size, m / d, p * h.decay);
    a.m_out[i] = m;
    a.v_out[i] = v;
    a.p_out[i] = p;
    fz_store1(a.out16, odt, i, p);
}

/* Software prefetch FZ_PREFETCH elements (512 bytes of float32) ahead on the four input streams: the loop's
 * arithmetic keeps the out-of-order window from running far enough ahead on its own, and on the development
 * machine (Zen 3) this distance took one thread from 91% to the full bandwidth-ceiling speed. A prefetch never
 * faults, so running past the end is harmless. */
#define FZ_PREFETCH 128
#if FZ_X86
#define FZ_PF(ptr) _mm_prefetch((const char *)(ptr), _MM_HINT_T0)
#elif defined(__GNUC__) || defined(__clang__)
#define FZ_PF(ptr) __builtin_prefetch((ptr), 0, 3)
#else
#define FZ_PF(ptr) ((void)(ptr))
#endif

FZ_INLINE void fz_prefetch(const fz_adam_args a, const int dt, size_t i) {
    FZ_PF(a.p_in + i);
    FZ_PF((const char *)a.g + i * (dt == FZ_F32 ? 4 : 2));
    FZ_PF(a.m_in + i);
    FZ_PF(a.v_in + i);
}

FZ_INLINE void fz_adam_loop_scalar(const fz_adam_args a, size_t b, size_t e, const int dt, const int odt,
                                   const int l2) {
    for (size_t i = b; i < e; i++) fz_adam1(a, i, dt, odt, l2);
}

/* Run `LOOP(args, b, e, dt, odt, l2)` over the elements [b, e) of task t: once per run of consecutive segments
 * of one group (the first found by binary search), with that group's hyper struct. Cutting a range into pieces
 * never changes a result (every path computes each element alone, lane by lane the scalar step), so a piece
 * gives bitwise what an ungrouped call on it would. The walk sits inside the (dtype, copy-out) dispatch, so a
 * piece costs a few loads and one predictable branch (L2 or not), not a call and a switch. */
#define FZ_WALK(LOOP, t, b, e, dt, odt)                                                                         \
    do {                                                                                                        \
        fz_adam_args a_ = (t)->args;                                                                            \
        const int64_t *ends_ = (t)->ends, *group_ = (t)->group;                                                 \
        const size_t e_ = (e), last_ = (t)->nseg - 1;                                                           \
        size_t b_ = (b);                                                                                        \
        for (size_t s_ = fz_segment_of(ends_, (t)->nseg, b_); b_ < e_; s_++) {                                  \
            const int64_t k_ = group_[s_];                                                                      \
            while (s_ < last_ && (size_t)ends_[s_] < e_ && group_[s_ + 1] == k_) s_++;                         \
            size_t end_ = (size_t)ends_[s_] < e_ ? (size_t)ends_[s_] : e_;                                      \
            if (end_ <= b_) continue; /* an empty segment */                                                    \
            a_.h = (t)->hypers[k_];                                                                             \
            if (a_.h.l2 != 0.0f) LOOP(a_, b_, end_, dt, odt, 1);                                                \
            else LOOP(a_, b_, end_, dt, odt, 0);                                                                \
            b_ = end_;                                                                                          \
        }                                                                                                       \
    } while (0)
/* Instantiate the walk for every (gradient dtype, copy-out dtype) combination, and with it the loop for both
 * L2 modes, so each inner loop is compiled with its branches folded away. */
#define FZ_CASE(LOOP, t, b, e, dt, odt)                                                                         \
    case (dt) * 4 + (odt) + 1:                                                                                  \
        FZ_WALK(LOOP, t, b, e, dt, odt);                                                                        \
        break
#define FZ_DISPATCH(LOOP, t, b, e)                                                                              \
    do {                                                                                                        \
        switch ((t)->args.g_dtype * 4 + (t)->args.out_dtype + 1) {                                              \
            FZ_CASE(LOOP, t, b, e, FZ_F32, FZ_NONE);                                                            \
            FZ_CASE(LOOP, t, b, e, FZ_F32, FZ_BF16);                                                            \
            FZ_CASE(LOOP, t, b, e, FZ_F32, FZ_F16);                                                             \
            FZ_CASE(LOOP, t, b, e, FZ_BF16, FZ_NONE);                                                           \
            FZ_CASE(LOOP, t, b, e, FZ_BF16, FZ_BF16);                                                           \
            FZ_CASE(LOOP, t, b, e, FZ_BF16, FZ_F16);                                                            \
            FZ_CASE(LOOP, t, b, e, FZ_F16, FZ_NONE);                                                            \
            FZ_CASE(LOOP, t, b, e, FZ_F16, FZ_BF16);                                                            \
            FZ_CASE(LOOP, t, b, e, FZ_F16, FZ_F16);                                                             \
        default: break;                                                                                         \
        }                                                                                                       \
    } while (0)

static void fz_adam_range_scalar(const fz_adam_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_adam_loop_scalar, t, b, e);
}

/* Gradient statistics: the sum of squares in double, on four accumulators to keep the adds off one dependency
 * chain. */
static double fz_sumsq_range_scalar(const void *g, int dt, size_t b, size_t e) {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    size_t i = b;
    for (; i + 4 <= e; i += 4)
        for (int k = 0; k < 4; k++) {
            double x = (double)fz_load1(g, dt, i + k);
            acc[k] = fma(x, x, acc[k]);
        }
    for (; i < e; i++) {
        double x = (double)fz_load1(g, dt, i);
        acc[0] = fma(x, x, acc[0]);
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

typedef struct {
    float *p, *m, *v;
    const float *g;
    float a;
} fz_ceiling_args;

static void fz_ceiling_range_scalar(const fz_ceiling_args *c, size_t b, size_t e) {
    float *p = c->p, *m = c->m, *v = c->v, a = c->a; /* locals: stores through p, m, v cannot change them */
    const float *g = c->g;
    for (size_t i = b; i < e; i++) {
        p[i] = fmaf(g[i], a, p[i]);
        m[i] = fmaf(g[i], a, m[i]);
        v[i] = fmaf(g[i], a, v[i]);
    }
}

#if FZ_HAVE_AVX2
/* ---------------------------------------------------------------------------------------------------------------
 * AVX2 + FMA + F16C: 8 lanes
 * ------------------------------------------------------------------------------------------------------------- */

FZ_AVX2 FZ_INLINE __m256 fz_load8(const void *g, int dt, size_t i) {
    if (dt == FZ_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == FZ_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
    return _mm256_loadu_ps((const float *)g + i);
}

FZ_AVX2 FZ_INLINE __m128i fz_to_bf16_8(__m256 x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x0040)); /* quieted NaN */
    r = _mm256_blendv_epi8(r, q, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    /* 8 x u32 (each <= 0xFFFF) -> 8 x u16: pack within 128-bit lanes, then gather lanes 0 and 2 */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

FZ_AVX2 FZ_INLINE void fz_store8(void *out, int odt, size_t i, __m256 x, int stream) {
    __m128i h;
    if (odt == FZ_BF16) h = fz_to_bf16_8(x);
    else if (odt == FZ_F16) h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else return;
    __m128i *dst = (__m128i *)((uint16_t *)out + i);
    if (stream) _mm_stream_si128(dst, h); /* 16-byte aligned: checked by the caller */
    else _mm_storeu_si128(dst, h);
}

typedef struct {
    __m256 b1, omb1, b2, omb2, eps, ibc2, nstep, decay, wd, scale;
} fz_consts8;

FZ_AVX2 FZ_INLINE void fz_adam8(const fz_adam_args a, const fz_consts8 k, size_t i, const int dt, const int odt,
                                const int l2, const int stream) {
    __m256 p = _mm256_loadu_ps(a.p_in + i);
    __m256 g = _mm256_mul_ps(fz_load8(a.g, dt, i), k.scale);
    if (l2) g = _mm256_fmadd_ps(k.wd, p, g);
    __m256 m = _mm256_fmadd_ps(k.b1, _mm256_loadu_ps(a.m_in + i), _mm256_mul_ps(k.omb1, g));
    __m256 v = _mm256_fmadd_ps(k.b2, _mm256_loadu_ps(a.v_in + i), _mm256_mul_ps(k.omb2, _mm256_mul_ps(g, g)));
    __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), k.ibc2, k.eps);
    p = _mm256_fmadd_ps(k.nstep, _mm256_div_ps(m, d), _mm256_mul_ps(p, k.decay));
    _mm256_storeu_ps(a.m_out + i, m);
    _mm256_storeu_ps(a.v_out + i, v);
    _mm256_storeu_ps(a.p_out + i, p);
    fz_store8(a.out16, odt, i, p, stream);
}

FZ_AVX2 FZ_INLINE void fz_adam_loop_avx2(const fz_adam_args a, size_t b, size_t e, const int dt, const int odt,
                                         const int l2) {
    const fz_adam_hyper *h = &a.h;
    const fz_consts8 k = {_mm256_set1_ps(h->beta1), _mm256_set1_ps(h->one_minus_beta1), _mm256_set1_ps(h->beta2),
                          _mm256_set1_ps(h->one_minus_beta2), _mm256_set1_ps(h->eps), _mm256_set1_ps(h->inv_sqrt_bc2),
                          _mm256_set1_ps(-h->step_size), _mm256_set1_ps(h->decay), _mm256_set1_ps(h->l2),
                          _mm256_set1_ps(h->grad_scale)};
    const int stream = a.stream && odt != FZ_NONE && ((uintptr_t)((uint16_t *)a.out16 + b) & 15) == 0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) { /* one cache line of each float32 stream per iteration */
        fz_prefetch(a, dt, i + FZ_PREFETCH);
        fz_adam8(a, k, i, dt, odt, l2, stream);
        fz_adam8(a, k, i + 8, dt, odt, l2, stream);
    }
    for (; i + 8 <= e; i += 8) fz_adam8(a, k, i, dt, odt, l2, stream);
    for (; i < e; i++) fz_adam1(a, i, dt, odt, l2); /* the tail: the same operations, one lane */
}

FZ_AVX2 static void fz_adam_range_avx2(const fz_adam_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_adam_loop_avx2, t, b, e);
}

FZ_AVX2 FZ_INLINE void fz_sumsq8(__m256 x, __m256d *lo, __m256d *hi) {
    __m256d l = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), u = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    *lo = _mm256_fmadd_pd(l, l, *lo);
    *hi = _mm256_fmadd_pd(u, u, *hi);
}

FZ_AVX2 static double fz_sumsq_range_avx2(const void *g, int dt, size_t b, size_t e) {
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
        fz_sumsq8(fz_load8(g, dt, i), &a0, &a1);
        fz_sumsq8(fz_load8(g, dt, i + 8), &a2, &a3);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + fz_sumsq_range_scalar(g, dt, i, e);
}

FZ_AVX2 static void fz_ceiling_range_avx2(const fz_ceiling_args *c, size_t b, size_t e) {
    const __m256 a = _mm256_set1_ps(c->a);
    float *p = c->p, *m = c->m, *v = c->v;
    const float *gp = c->g;
    size_t i = b;
    for (; i + 8 <= e; i += 8) {
        __m256 g = _mm256_loadu_ps(gp + i);
        _mm256_storeu_ps(p + i, _mm256_fmadd_ps(g, a, _mm256_loadu_ps(p + i)));
        _mm256_storeu_ps(m + i, _mm256_fmadd_ps(g, a, _mm256_loadu_ps(m + i)));
        _mm256_storeu_ps(v + i, _mm256_fmadd_ps(g, a, _mm256_loadu_ps(v + i)));
    }
    fz_ceiling_range_scalar(c, i, e);
}

#endif /* FZ_HAVE_AVX2 */

#if FZ_X86
/* ---------------------------------------------------------------------------------------------------------------
 * AVX-512F: 16 lanes
 * ------------------------------------------------------------------------------------------------------------- */

FZ_AVX512 FZ_INLINE __m512 fz_load16(const void *g, int dt, size_t i) {
    if (dt == FZ_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == FZ_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
    return _mm512_loadu_ps((const float *)g + i);
}

FZ_AVX512 FZ_INLINE __m256i fz_to_bf16_16(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x0040)); /* quieted NaN */
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), q);
    return _mm512_cvtepi32_epi16(r); /* truncate each u32 (<= 0xFFFF) to u16 */
}

FZ_AVX512 FZ_INLINE void fz_store16(void *out, int odt, size_t i, __m512 x, int stream) {
    __m256i h;
    if (odt == FZ_BF16) h = fz_to_bf16_16(x);
    else if (odt == FZ_F16) h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else return;
    __m256i *dst = (__m256i *)((uint16_t *)out + i);
    if (stream) _mm256_stream_si256(dst, h); /* 32-byte aligned: checked by the caller */
    else _mm256_storeu_si256(dst, h);
}

FZ_AVX512 FZ_INLINE void fz_adam_loop_avx512(const fz_adam_args a, size_t b, size_t e, const int dt,
                                             const int odt, const int l2) {
    const fz_adam_hyper *h = &a.h;
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 eps = _mm512_set1_ps(h->eps), ibc2 = _mm512_set1_ps(h->inv_sqrt_bc2);
    const __m512 nstep = _mm512_set1_ps(-h->step_size), decay = _mm512_set1_ps(h->decay);
    const __m512 wd = _mm512_set1_ps(h->l2), scale = _mm512_set1_ps(h->grad_scale);
    const int stream = a.stream && odt != FZ_NONE && ((uintptr_t)((uint16_t *)a.out16 + b) & 31) == 0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) { /* one cache line of each float32 stream per iteration */
        fz_prefetch(a, dt, i + FZ_PREFETCH);
        __m512 p = _mm512_loadu_ps(a.p_in + i);
        __m512 g = _mm512_mul_ps(fz_load16(a.g, dt, i), scale);
        if (l2) g = _mm512_fmadd_ps(wd, p, g);
        __m512 m = _mm512_fmadd_ps(b1, _mm512_loadu_ps(a.m_in + i), _mm512_mul_ps(omb1, g));
        __m512 v = _mm512_fmadd_ps(b2, _mm512_loadu_ps(a.v_in + i), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
        __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), ibc2, eps);
        p = _mm512_fmadd_ps(nstep, _mm512_div_ps(m, d), _mm512_mul_ps(p, decay));
        _mm512_storeu_ps(a.m_out + i, m);
        _mm512_storeu_ps(a.v_out + i, v);
        _mm512_storeu_ps(a.p_out + i, p);
        fz_store16(a.out16, odt, i, p, stream);
    }
    for (; i < e; i++) fz_adam1(a, i, dt, odt, l2);
}

FZ_AVX512 static void fz_adam_range_avx512(const fz_adam_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_adam_loop_avx512, t, b, e);
}

FZ_AVX512 FZ_INLINE void fz_sumsq16(__m512 x, __m512d *lo, __m512d *hi) {
    __m512d l = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d u = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    *lo = _mm512_fmadd_pd(l, l, *lo);
    *hi = _mm512_fmadd_pd(u, u, *hi);
}

FZ_AVX512 static double fz_sumsq_range_avx512(const void *g, int dt, size_t b, size_t e) {
    __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = b;
    for (; i + 32 <= e; i += 32) {
        fz_sumsq16(fz_load16(g, dt, i), &a0, &a1);
        fz_sumsq16(fz_load16(g, dt, i + 16), &a2, &a3);
    }
    double lanes[8];
    _mm512_storeu_pd(lanes, _mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
    double s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    return s + fz_sumsq_range_scalar(g, dt, i, e);
}

FZ_AVX512 static void fz_ceiling_range_avx512(const fz_ceiling_args *c, size_t b, size_t e) {
    const __m512 a = _mm512_set1_ps(c->a);
    float *p = c->p, *m = c->m, *v = c->v;
    const float *gp = c->g;
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
        __m512 g = _mm512_loadu_ps(gp + i);
        _mm512_storeu_ps(p + i, _mm512_fmadd_ps(g, a, _mm512_loadu_ps(p + i)));
        _mm512_storeu_ps(m + i, _mm512_fmadd_ps(g, a, _mm512_loadu_ps(m + i)));
        _mm512_storeu_ps(v + i, _mm512_fmadd_ps(g, a, _mm512_loadu_ps(v + i)));
    }
    fz_ceiling_range_scalar(c, i, e);
}
#endif /* FZ_X86 */

/* ---------------------------------------------------------------------------------------------------------------
 * Run-time dispatch
 * ------------------------------------------------------------------------------------------------------------- */

static int fz_supported(int isa) {
    if (isa == FZ_ISA_SCALAR) return 1;
#if defined(FZ_EMULATE_AVX512)
    return isa == FZ_ISA_AVX512;
#elif FZ_HAVE_AVX2
    __builtin_cpu_init();
    /* GCC's and Clang's checks include the OS's support for the wider registers (XCR0), not only CPUID */
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == FZ_ISA_AVX2) return avx2;
    if (isa == FZ_ISA_AVX512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

int fz_isa_detected(void) {
    if (fz_supported(FZ_ISA_AVX512)) return FZ_ISA_AVX512;
    if (fz_supported(FZ_ISA_AVX2)) return FZ_ISA_AVX2;
    return FZ_ISA_SCALAR;
}

static int fz_current = -2; /* not chosen yet */

int fz_isa(void) {
    if (fz_current < 0) fz_current = fz_isa_detected();
    return fz_current;
}

int fz_set_isa(int isa) {
    if (isa == FZ_ISA_AUTO) {
        fz_current = fz_isa_detected();
        return 0;
    }
    if (!fz_supported(isa)) return -1;
    fz_current = isa;
    return 0;
}

int fz_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

size_t fz_parallel_threshold(void) { return FZ_MIN_CHUNK + 1; }

/* Work is cut into chunks whose size depends on n only (a multiple of 64 elements, so cache lines are never
 * shared between chunks when the buffers are aligned; at least FZ_MIN_CHUNK elements, at most FZ_MAX_CHUNKS
 * chunks), handed to the threads dynamically: a thread the OS preempts holds back only the chunk it has, and a
 * sum added chunk by chunk in chunk order does not depend on the thread count. */
static size_t fz_chunk(size_t n) {
    size_t c = ((n + FZ_MAX_CHUNKS - 1) / FZ_MAX_CHUNKS + 63) & ~(size_t)63;
    return c < FZ_MIN_CHUNK ? FZ_MIN_CHUNK : c;
}

typedef void (*fz_task)(void *ctx, size_t k, size_t b, size_t e);

static void fz_run(size_t n, int nthreads, fz_task task, void *ctx) {
    size_t chunk = fz_chunk(n), count = (n + chunk - 1) / chunk;
    int threads = nthreads < 1 ? 1 : nthreads;
    if ((size_t)threads > count) threads = count > 0 ? (int)count : 1;
#ifdef _OPENMP
    if (threads > 1) {
        const long long chunks = (long long)count;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (long long k = 0; k < chunks; k++) {
            size_t b = (size_t)k * chunk;
            task(ctx, (size_t)k, b, b + chunk < n ? b + chunk : n);
        }
        return;
    }
#endif
    for (size_t k = 0; k < count; k++) {
        size_t b = k * chunk;
        task(ctx, k, b, b + chunk < n ? b + chunk : n);
    }
}

/* One chunk [b, e) of the buffer: the chosen path walks the segments it intersects (FZ_WALK). */
static void fz_adam_chunk(void *ctx, size_t k, size_t b, size_t e) {
    (void)k;
    const fz_adam_task *t = (const fz_adam_task *)ctx;
    t->fn(t, b, e);
#if FZ_X86
    /* Order the streamed stores before whoever reads the copy next: once per chunk, not per piece (a fence per
     * 16-element segment would cost more than the segment's arithmetic). */
    if (t->args.stream) _mm_sfence();
#endif
}

/* 0 if the table is valid for n elements and ngroups groups, else -2. Checked here too (not only by the Python
 * wrapper), so no caller can make the kernel read outside hypers or the buffers. */
static int fz_check_segments(int ngroups, const int64_t *ends, const int64_t *group, size_t nseg, size_t n) {
    if (nseg == 0) return n == 0 ? 0 : -2;
    int64_t prev = 0;
    for (size_t s = 0; s < nseg; s++) {
        if (ends[s] < prev || group[s] < 0 || group[s] >= ngroups) return -2;
        prev = ends[s];
    }
    return (uint64_t)prev == (uint64_t)n ? 0 : -2;
}

int fz_adam_step_segments(const fz_adam_hyper *hypers, int ngroups, const int64_t *ends, const int64_t *group,
                          size_t nseg, size_t n, const float *p_in, const void *g, int g_dtype, const float *m_in,
                          const float *v_in, float *p_out, float *m_out, float *v_out, void *out16, int out16_dtype,
                          int nthreads) {
    if (g_dtype < FZ_F32 || g_dtype > FZ_F16) return -1;
    if (out16_dtype != FZ_NONE && out16_dtype != FZ_BF16 && out16_dtype != FZ_F16) return -1;
    if (fz_check_segments(ngroups, ends, group, nseg, n) != 0) return -2;
    if (n == 0) return 0;
    /* Above a few MiB the copy will not stay in cache anyway: stream it to memory and skip reading its old
     * contents first (a write-allocate costs a read of every line written). */
    int stream = n >= FZ_STREAM_MIN;
    fz_adam_task t = {fz_adam_range_scalar,
                      {hypers[0], p_in, m_in, v_in, g, p_out, m_out, v_out, out16, g_dtype, out16_dtype, stream},
                      hypers, ends, group, nseg};
#if FZ_X86
    int isa = fz_isa();
    if (isa == FZ_ISA_AVX512) t.fn = fz_adam_range_avx512;
#if FZ_HAVE_AVX2
    else if (isa == FZ_ISA_AVX2) t.fn = fz_adam_range_avx2;
#endif
#endif
    fz_run(n, nthreads, fz_adam_chunk, &t);
    return 0;
}

int fz_adam_step(const fz_adam_hyper *h, size_t n, const float *p_in, const void *g, int g_dtype,
                 const float *m_in, const float *v_in, float *p_out, float *m_out, float *v_out, void *out16,
                 int out16_dtype, int nthreads) {
    const int64_t end = (int64_t)n, group = 0;
    return fz_adam_step_segments(h, 1, &end, &group, 1, n, p_in, g, g_dtype, m_in, v_in, p_out, m_out, v_out, out16,
                                 out16_dtype, nthreads);
}

typedef struct {
    double (*fn)(const void *, int, size_t, size_t);
    const void *g;
    int g_dtype;
    double partial[FZ_MAX_CHUNKS];
} fz_stats_task;

static void fz_stats_chunk(void *ctx, size_t k, size_t b, size_t e) {
    fz_stats_task *t = (fz_stats_task *)ctx;
    t->partial[k] = t->fn(t->g, t->g_dtype, b, e);
}

int fz_grad_stats(const void *g, int g_dtype, size_t n, double *sumsq, int *nonfinite, int nthreads) {
    if (g_dtype < FZ_F32 || g_dtype > FZ_F16) return -1;
    fz_stats_task t;
    t.fn = fz_sumsq_range_scalar;
    t.g = g;
    t.g_dtype = g_dtype;
#if FZ_X86
    int isa = fz_isa();
    if (isa == FZ_ISA_AVX512) t.fn = fz_sumsq_range_avx512;
#if FZ_HAVE_AVX2
    else if (isa == FZ_ISA_AVX2) t.fn = fz_sumsq_range_avx2;
#endif
#endif
    fz_run(n, nthreads, fz_stats_chunk, &t);
    size_t count = (n + fz_chunk(n) - 1) / fz_chunk(n);
    double s = 0.0;
    for (size_t k = 0; k < count; k++) s += t.partial[k]; /* in chunk order: the same for any thread count */
    *sumsq = s;
    /* Squares of finite floats are below 1.2e77 in double, so no sum of them overflows: the sum is inf or nan
     * exactly when some element is. */
    *nonfinite = !isfinite(s);
    return 0;
}

typedef struct {
    void (*fn)(const fz_ceiling_args *, size_t, size_t);
    fz_ceiling_args args;
} fz_ceiling_task;

static void fz_ceiling_chunk(void *ctx, size_t k, size_t b, size_t e) {
    (void)k;
    fz_ceiling_task *t = (fz_ceiling_task *)ctx;
    t->fn(&t->args, b, e);
}

void fz_ceiling(size_t n, float *p, const float *g, float *m, float *v, float a, int nthreads) {
    fz_ceiling_task t = {fz_ceiling_range_scalar, {p, m, v, g, a}};
#if FZ_X86
    int isa = fz_isa();
    if (isa == FZ_ISA_AVX512) t.fn = fz_ceiling_range_avx512;
#if FZ_HAVE_AVX2
    else if (isa == FZ_ISA_AVX2) t.fn = fz_ceiling_range_avx2;
#endif
#endif
    fz_run(n, nthreads, fz_ceiling_chunk, &t);
}
