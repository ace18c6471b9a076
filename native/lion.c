/* fzero's CPU Lion: scalar, AVX2+FMA+F16C and AVX-512F paths chosen at run time (see fzero_native.h), built like
 * adam.c (fz_internal.h): the SIMD loops perform the scalar step's operations lane by lane, in the same order, so
 * all paths agree bitwise, on any thread count, grouped or not.
 *
 * The element step (every path, every element), in float32 with one rounding per operation:
 *
 *     g' = g * grad_scale
 *     c  = fma(g', 1 - beta1, m * beta1)                 the interpolation whose sign is the update
 *     u  = c > 0 ? 0 - lr : c < 0 ? lr : +0              -lr * sign(c); sign(0) = sign(NaN) = 0, as torch.sign
 *                                                        (0 - lr: +0, not -0, for lr = 0)
 *     p  = fma(p, decay, u)                              decay = 1 - lr * wd (exactly 1 without decay: p + u)
 *     m  = fma(g', 1 - beta2, m * beta2)
 *
 * This is DeepSpeed's CPU Lion (csrc/includes/cpu_lion.h, Lion_Optimizer::Step_AVX: `tmp = m * betta1;
 * tmp = fma(grad, betta1_minus1, tmp)`; `param = fma(param, after_decay, tmp)`, or `param + tmp` without decay,
 * which is the same rounding since decay is then exactly 1; `momentum = fma(grad, betta2_minus1, momentum *
 * betta2)`), with two differences: the sign of an exactly zero (or NaN) c is 0, not DeepSpeed's `-copysign(lr, c)`
 * (its scalar path, csrc/lion/cpu_lion_impl.cpp), so a zero padding stays zero; and the sign is taken by
 * comparisons, not by DeepSpeed's AVX bit trick (`and` with the bits of -1.0f, `xor` with those of -lr), which
 * gives -copysign(lr, c) only for some exponents of c. The scalars are computed in double by the caller and
 * rounded once to float (DeepSpeed computes 1 - beta and 1 - lr * wd in float).
 */
#include "fz_internal.h"

typedef struct {
    fz_lion_hyper h;
    const float *p_in, *m_in;
    const void *g;
    float *p_out, *m_out;
    void *out16;
    int g_dtype, out_dtype;
    int stream; /* non-temporal stores of the copy (see adam.c) */
} fz_lion_args;

typedef struct fz_lion_task {
    void (*fn)(const struct fz_lion_task *, size_t, size_t);
    fz_lion_args args;
    const fz_lion_hyper *hypers;
    const int64_t *ends, *group;
    size_t nseg;
} fz_lion_task;

FZ_INLINE void fz_lion1(const fz_lion_args a, size_t i, const int dt, const int odt, const int unused) {
    (void)unused;
    const fz_lion_hyper h = a.h;
    float g = fz_load1(a.g, dt, i) * h.grad_scale;
    float m = a.m_in[i];
    float c = fmaf(g, h.one_minus_beta1, m * h.beta1);
    float u = c > 0.0f ? 0.0f - h.lr : c < 0.0f ? h.lr : 0.0f;
    float p = fmaf(a.p_in[i], h.decay, u);
    m = fmaf(g, h.one_minus_beta2, m * h.beta2);
    a.m_out[i] = m;
    a.p_out[i] = p;
    fz_store1(a.out16, odt, i, p);
}

FZ_INLINE void fz_lion_prefetch(const fz_lion_args a, const int dt, size_t i) {
    FZ_PF(a.p_in + i);
    FZ_PF((const char *)a.g + i * (dt == FZ_F32 ? 4 : 2));
    FZ_PF(a.m_in + i);
}

FZ_INLINE void fz_lion_loop_scalar(const fz_lion_args a, size_t b, size_t e, const int dt, const int odt,
                                   const int variant) {
    for (size_t i = b; i < e; i++) fz_lion1(a, i, dt, odt, variant);
}

static void fz_lion_range_scalar(const fz_lion_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_lion_args, fz_lion_loop_scalar, FZ_NO_VARIANT, t, b, e);
}

#if FZ_HAVE_AVX2
typedef struct {
    __m256 b1, omb1, b2, omb2, lr, nlr, decay, scale, zero;
} fz_lion_consts8;

FZ_AVX2 FZ_INLINE void fz_lion8(const fz_lion_args a, const fz_lion_consts8 k, size_t i, const int dt,
                                const int odt, const int stream) {
    __m256 g = _mm256_mul_ps(fz_load8(a.g, dt, i), k.scale);
    __m256 m = _mm256_loadu_ps(a.m_in + i);
    __m256 c = _mm256_fmadd_ps(g, k.omb1, _mm256_mul_ps(m, k.b1));
    /* -lr where c > 0, lr where c < 0, +0 elsewhere (zero, NaN): ordered comparisons are false for NaN */
    __m256 u = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(c, k.zero, _CMP_GT_OQ), k.nlr),
                            _mm256_and_ps(_mm256_cmp_ps(c, k.zero, _CMP_LT_OQ), k.lr));
    __m256 p = _mm256_fmadd_ps(_mm256_loadu_ps(a.p_in + i), k.decay, u);
    m = _mm256_fmadd_ps(g, k.omb2, _mm256_mul_ps(m, k.b2));
    _mm256_storeu_ps(a.m_out + i, m);
    _mm256_storeu_ps(a.p_out + i, p);
    fz_store8(a.out16, odt, i, p, stream);
}

FZ_AVX2 FZ_INLINE void fz_lion_loop_avx2(const fz_lion_args a, size_t b, size_t e, const int dt, const int odt,
                                         const int variant) {
    const fz_lion_hyper *h = &a.h;
    const fz_lion_consts8 k = {_mm256_set1_ps(h->beta1), _mm256_set1_ps(h->one_minus_beta1),
                               _mm256_set1_ps(h->beta2), _mm256_set1_ps(h->one_minus_beta2), _mm256_set1_ps(h->lr),
                               _mm256_set1_ps(0.0f - h->lr), _mm256_set1_ps(h->decay), _mm256_set1_ps(h->grad_scale),
                               _mm256_setzero_ps()};
    const int stream = a.stream && odt != FZ_NONE && ((uintptr_t)((uint16_t *)a.out16 + b) & 15) == 0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
        fz_lion_prefetch(a, dt, i + FZ_PREFETCH);
        fz_lion8(a, k, i, dt, odt, stream);
        fz_lion8(a, k, i + 8, dt, odt, stream);
    }
    for (; i + 8 <= e; i += 8) fz_lion8(a, k, i, dt, odt, stream);
    for (; i < e; i++) fz_lion1(a, i, dt, odt, variant);
}

FZ_AVX2 static void fz_lion_range_avx2(const fz_lion_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_lion_args, fz_lion_loop_avx2, FZ_NO_VARIANT, t, b, e);
}
#endif /* FZ_HAVE_AVX2 */

#if FZ_X86
FZ_AVX512 FZ_INLINE void fz_lion_loop_avx512(const fz_lion_args a, size_t b, size_t e, const int dt,
                                             const int odt, const int variant) {
    const fz_lion_hyper *h = &a.h;
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 lr = _mm512_set1_ps(h->lr), nlr = _mm512_set1_ps(0.0f - h->lr), decay = _mm512_set1_ps(h->decay);
    const __m512 scale = _mm512_set1_ps(h->grad_scale), zero = _mm512_setzero_ps();
    const int stream = a.stream && odt != FZ_NONE && ((uintptr_t)((uint16_t *)a.out16 + b) & 31) == 0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
        fz_lion_prefetch(a, dt, i + FZ_PREFETCH);
        __m512 g = _mm512_mul_ps(fz_load16(a.g, dt, i), scale);
        __m512 m = _mm512_loadu_ps(a.m_in + i);
        __m512 c = _mm512_fmadd_ps(g, omb1, _mm512_mul_ps(m, b1));
        __mmask16 pos = _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), neg = _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ);
        __m512 u = _mm512_mask_mov_ps(_mm512_maskz_mov_ps(neg, lr), pos, nlr);
        __m512 p = _mm512_fmadd_ps(_mm512_loadu_ps(a.p_in + i), decay, u);
        m = _mm512_fmadd_ps(g, omb2, _mm512_mul_ps(m, b2));
        _mm512_storeu_ps(a.m_out + i, m);
        _mm512_storeu_ps(a.p_out + i, p);
        fz_store16(a.out16, odt, i, p, stream);
    }
    for (; i < e; i++) fz_lion1(a, i, dt, odt, variant);
}

FZ_AVX512 static void fz_lion_range_avx512(const fz_lion_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_lion_args, fz_lion_loop_avx512, FZ_NO_VARIANT, t, b, e);
}

FZ_AVX512 static void fz_lion_range_avx512bf16(const fz_lion_task *t, size_t b, size_t e) {
    FZ_DISPATCH_BF16_HW(fz_lion_args, fz_lion_loop_avx512, FZ_NO_VARIANT, t, b, e);
}
#endif /* FZ_X86 */

static void fz_lion_chunk(void *ctx, size_t k, size_t b, size_t e) {
    (void)k;
    const fz_lion_task *t = (const fz_lion_task *)ctx;
    t->fn(t, b, e);
    if (t->args.stream) fz_fence();
}

int fz_lion_step_segments(const fz_lion_hyper *hypers, int ngroups, const int64_t *ends, const int64_t *group,
                          size_t nseg, size_t n, const float *p_in, const void *g, int g_dtype, const float *m_in,
                          float *p_out, float *m_out, void *out16, int out16_dtype, int nthreads) {
    if (fz_check_dtypes(g_dtype, out16_dtype) != 0) return -1;
    if (fz_check_segments(ngroups, ends, group, nseg, n) != 0) return -2;
    if (n == 0) return 0;
    fz_lion_task t = {fz_lion_range_scalar,
                      {hypers[0], p_in, m_in, g, p_out, m_out, out16, g_dtype, out16_dtype, n >= FZ_STREAM_MIN},
                      hypers, ends, group, nseg};
    FZ_PICK(t.fn, out16_dtype, fz_lion_range_scalar, fz_lion_range_avx2, fz_lion_range_avx512,
            fz_lion_range_avx512bf16);
    fz_run(n, nthreads, fz_lion_chunk, &t);
    return 0;
}

int fz_lion_step(const fz_lion_hyper *h, size_t n, const float *p_in, const void *g, int g_dtype, const float *m_in,
                 float *p_out, float *m_out, void *out16, int out16_dtype, int nthreads) {
    const int64_t end = (int64_t)n, group = 0;
    return fz_lion_step_segments(h, 1, &end, &group, 1, n, p_in, g, g_dtype, m_in, p_out, m_out, out16, out16_dtype,
                                 nthreads);
}
