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
#include "fz_internal.h"

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

/* Adam compiles its loop twice: with the L2 term (Adam) and without (AdamW, or no decay). */
#define FZ_ADAM_L2(h) ((h).l2 != 0.0f)

static void fz_adam_range_scalar(const fz_adam_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_adam_args, fz_adam_loop_scalar, FZ_ADAM_L2, t, b, e);
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
    FZ_DISPATCH(fz_adam_args, fz_adam_loop_avx2, FZ_ADAM_L2, t, b, e);
}

FZ_AVX2 FZ_INLINE void fz_sumsq8(__m256 x, __m256d *lo, __m256d *hi) {
    __m256d l = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), u = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    *lo = _mm256_fmadd_pd(l, l, *lo);
    *hi = _mm256_fmadd_pd(u, u, *hi);
}

/* The four accumulators' total, in the one order every AVX2 sum of squares uses (range and group alike). */
FZ_AVX2 FZ_INLINE double fz_sumsq_total_avx2(__m256d a0, __m256d a1, __m256d a2, __m256d a3) {
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

FZ_AVX2 static double fz_sumsq_range_avx2(const void *g, int dt, size_t b, size_t e) {
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
        fz_sumsq8(fz_load8(g, dt, i), &a0, &a1);
        fz_sumsq8(fz_load8(g, dt, i + 8), &a2, &a3);
    }
    return fz_sumsq_total_avx2(a0, a1, a2, a3) + fz_sumsq_range_scalar(g, dt, i, e);
}

/* FZ_STREAMS whole chunks of c elements from b at once, each on its own four accumulators in
 * fz_sumsq_range_avx2's order (each partial bitwise that function's): one core reading several streams at once
 * gets more of the memory's bandwidth than reading one. */
FZ_AVX2 static void fz_sumsq_group_avx2(const void *g, int dt, size_t b, size_t c, double *out) {
    __m256d a[FZ_STREAMS][4];
    for (int k = 0; k < FZ_STREAMS; k++)
        for (int j = 0; j < 4; j++) a[k][j] = _mm256_setzero_pd();
    size_t i = 0;
    for (; i + 16 <= c; i += 16)
        for (int k = 0; k < FZ_STREAMS; k++) {
            const size_t at = b + (size_t)k * c + i;
            fz_sumsq8(fz_load8(g, dt, at), &a[k][0], &a[k][1]);
            fz_sumsq8(fz_load8(g, dt, at + 8), &a[k][2], &a[k][3]);
        }
    for (int k = 0; k < FZ_STREAMS; k++) {
        const size_t at = b + (size_t)k * c;
        const double s = fz_sumsq_total_avx2(a[k][0], a[k][1], a[k][2], a[k][3]);
        out[k] = s + fz_sumsq_range_scalar(g, dt, at + i, at + c);
    }
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
    FZ_DISPATCH(fz_adam_args, fz_adam_loop_avx512, FZ_ADAM_L2, t, b, e);
}

/* The avx512bf16 path with a bfloat16 copy-out: the same loop, the copy by VCVTNEPS2BF16 (fz_store16). */
FZ_AVX512 static void fz_adam_range_avx512bf16(const fz_adam_task *t, size_t b, size_t e) {
    FZ_DISPATCH_BF16_HW(fz_adam_args, fz_adam_loop_avx512, FZ_ADAM_L2, t, b, e);
}

FZ_AVX512 FZ_INLINE void fz_sumsq16(__m512 x, __m512d *lo, __m512d *hi) {
    __m512d l = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d u = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    *lo = _mm512_fmadd_pd(l, l, *lo);
    *hi = _mm512_fmadd_pd(u, u, *hi);
}

/* fz_sumsq_total_avx2's, for the AVX-512 accumulators. */
FZ_AVX512 FZ_INLINE double fz_sumsq_total_avx512(__m512d a0, __m512d a1, __m512d a2, __m512d a3) {
    double lanes[8];
    _mm512_storeu_pd(lanes, _mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

FZ_AVX512 static double fz_sumsq_range_avx512(const void *g, int dt, size_t b, size_t e) {
    __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = b;
    for (; i + 32 <= e; i += 32) {
        fz_sumsq16(fz_load16(g, dt, i), &a0, &a1);
        fz_sumsq16(fz_load16(g, dt, i + 16), &a2, &a3);
    }
    return fz_sumsq_total_avx512(a0, a1, a2, a3) + fz_sumsq_range_scalar(g, dt, i, e);
}

/* fz_sumsq_group_avx2's, on fz_sumsq_range_avx512's accumulators and order. */
FZ_AVX512 static void fz_sumsq_group_avx512(const void *g, int dt, size_t b, size_t c, double *out) {
    __m512d a[FZ_STREAMS][4];
    for (int k = 0; k < FZ_STREAMS; k++)
        for (int j = 0; j < 4; j++) a[k][j] = _mm512_setzero_pd();
    size_t i = 0;
    for (; i + 32 <= c; i += 32)
        for (int k = 0; k < FZ_STREAMS; k++) {
            const size_t at = b + (size_t)k * c + i;
            fz_sumsq16(fz_load16(g, dt, at), &a[k][0], &a[k][1]);
            fz_sumsq16(fz_load16(g, dt, at + 16), &a[k][2], &a[k][3]);
        }
    for (int k = 0; k < FZ_STREAMS; k++) {
        const size_t at = b + (size_t)k * c;
        const double s = fz_sumsq_total_avx512(a[k][0], a[k][1], a[k][2], a[k][3]);
        out[k] = s + fz_sumsq_range_scalar(g, dt, at + i, at + c);
    }
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
 * Entry points
 * ------------------------------------------------------------------------------------------------------------- */

/* One chunk [b, e) of the buffer: the chosen path walks the segments it intersects (FZ_WALK). */
static void fz_adam_chunk(void *ctx, size_t k, size_t b, size_t e) {
    (void)k;
    const fz_adam_task *t = (const fz_adam_task *)ctx;
    t->fn(t, b, e);
    if (t->args.stream) fz_fence();
}

int fz_adam_step_segments(const fz_adam_hyper *hypers, int ngroups, const int64_t *ends, const int64_t *group,
                          size_t nseg, size_t n, const float *p_in, const void *g, int g_dtype, const float *m_in,
                          const float *v_in, float *p_out, float *m_out, float *v_out, void *out16, int out16_dtype,
                          int nthreads) {
    if (fz_check_dtypes(g_dtype, out16_dtype) != 0) return -1;
    if (fz_check_segments(ngroups, ends, group, nseg, n) != 0) return -2;
    if (n == 0) return 0;
    /* Above a few MiB the copy will not stay in cache anyway: stream it to memory and skip reading its old
     * contents first (a write-allocate costs a read of every line written). */
    int stream = n >= FZ_STREAM_MIN;
    fz_adam_task t = {fz_adam_range_scalar,
                      {hypers[0], p_in, m_in, v_in, g, p_out, m_out, v_out, out16, g_dtype, out16_dtype, stream},
                      hypers, ends, group, nseg};
    FZ_PICK(t.fn, out16_dtype, fz_adam_range_scalar, fz_adam_range_avx2, fz_adam_range_avx512,
            fz_adam_range_avx512bf16);
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
    void (*group)(const void *, int, size_t, size_t, double *); /* FZ_STREAMS whole chunks at once, or NULL */
    const void *g;
    int g_dtype;
    size_t whole; /* chunks of the full size (all but a shorter last one) */
    double partial[FZ_MAX_CHUNKS];
} fz_stats_task;

/* A chunk in a group of FZ_STREAMS whole chunks: the group's first computes all of them (bitwise what each would
 * alone), the others nothing; the chunks after the last whole group, one by one. */
static void fz_stats_chunk(void *ctx, size_t k, size_t b, size_t e) {
    fz_stats_task *t = (fz_stats_task *)ctx;
    const size_t first = k - k % FZ_STREAMS;
    if (t->group != NULL && first + FZ_STREAMS <= t->whole) {
        if (k == first) t->group(t->g, t->g_dtype, b, e - b, t->partial + k);
        return;
    }
    t->partial[k] = t->fn(t->g, t->g_dtype, b, e);
}

int fz_grad_stats(const void *g, int g_dtype, size_t n, double *sumsq, int *nonfinite, int nthreads) {
    if (g_dtype < FZ_F32 || g_dtype > FZ_F16) return -1;
    fz_stats_task t;
    t.fn = fz_sumsq_range_scalar;
    t.group = NULL;
    t.g = g;
    t.g_dtype = g_dtype;
    t.whole = n / fz_chunk(n);
#if FZ_X86
    int isa = fz_isa();
    if (isa >= FZ_ISA_AVX512) { /* (avx512bf16 adds nothing here) */
        t.fn = fz_sumsq_range_avx512;
        t.group = fz_sumsq_group_avx512;
    }
#if FZ_HAVE_AVX2
    else if (isa == FZ_ISA_AVX2) {
        t.fn = fz_sumsq_range_avx2;
        t.group = fz_sumsq_group_avx2;
    }
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
    if (isa >= FZ_ISA_AVX512) t.fn = fz_ceiling_range_avx512;
#if FZ_HAVE_AVX2
    else if (isa == FZ_ISA_AVX2) t.fn = fz_ceiling_range_avx2;
#endif
#endif
    fz_run(n, nthreads, fz_ceiling_chunk, &t);
}
