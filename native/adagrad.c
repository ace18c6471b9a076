/* fzero's CPU Adagrad: scalar, AVX2+FMA+F16C and AVX-512F paths chosen at run time (see fzero_native.h), built
 * like adam.c (fz_internal.h): the SIMD loops perform the scalar step's operations lane by lane, in the same order,
 * so all paths agree bitwise, on any thread count, grouped or not.
 *
 * The element step (every path, every element), in float32 with one rounding per operation:
 *
 *     g' = g * grad_scale                ; g' = fma(l2, p, g')   (L2 weight decay, when l2 != 0)
 *     s  = fma(g', g', s)                                         the running sum of squares
 *     d  = sqrt(s) + eps
 *     p  = fma(g' / d, -clr, p)                                   clr = lr / (1 + (t - 1) * lr_decay)
 *
 * This is DeepSpeed's CPU Adagrad (csrc/includes/cpu_adagrad.h, Adagrad_Optimizer::Step_AVX: `fma(param,
 * weight_decay, grad)`; `variance = fma(grad, grad, variance)`; `sqrt`, `+ eps`, `/`; `param = fma(grad,
 * step_size = -lr, param)`), with one difference: DeepSpeed divides the gradient as loaded (`momentum_4`, read
 * before the weight decay is added), fzero the decayed one, as torch.optim.Adagrad does (`param.addcdiv_(grad, std,
 * value=-clr)` after `grad = grad.add(param, alpha=weight_decay)`); without weight decay the two agree. DeepSpeed
 * has no lr_decay; the caller computes clr in double and rounds it once to float. Without weight decay the L2 fma
 * is skipped, not done with 0 (fma(0, p, g) is NaN for an infinite p and turns a -0 gradient into +0).
 */
#include "fz_internal.h"

typedef struct {
    fz_adagrad_hyper h;
    const float *p_in, *s_in;
    const void *g;
    float *p_out, *s_out;
    void *out16;
    int g_dtype, out_dtype;
    int stream; /* non-temporal stores of the copy (see adam.c) */
} fz_adagrad_args;

typedef struct fz_adagrad_task {
    void (*fn)(const struct fz_adagrad_task *, size_t, size_t);
    fz_adagrad_args args;
    const fz_adagrad_hyper *hypers;
    const int64_t *ends, *group;
    size_t nseg;
} fz_adagrad_task;

FZ_INLINE void fz_adagrad1(const fz_adagrad_args a, size_t i, const int dt, const int odt, const int l2) {
    const fz_adagrad_hyper h = a.h;
    float p = a.p_in[i];
    float g = fz_load1(a.g, dt, i) * h.grad_scale;
    if (l2) g = fmaf(h.l2, p, g);
    float s = fmaf(g, g, a.s_in[i]);
    float d = sqrtf(s) + h.eps;
    p = fmaf(g / d, -h.step_size, p);
    a.s_out[i] = s;
    a.p_out[i] = p;
    fz_store1(a.out16, odt, i, p);
}

FZ_INLINE void fz_adagrad_prefetch(const fz_adagrad_args a, const int dt, size_t i) {
    FZ_PF(a.p_in + i);
    FZ_PF((const char *)a.g + i * (dt == FZ_F32 ? 4 : 2));
    FZ_PF(a.s_in + i);
}

FZ_INLINE void fz_adagrad_loop_scalar(const fz_adagrad_args a, size_t b, size_t e, const int dt, const int odt,
                                      const int l2) {
    for (size_t i = b; i < e; i++) fz_adagrad1(a, i, dt, odt, l2);
}

/* Two loops: with the L2 term and without. */
#define FZ_ADAGRAD_L2(h) ((h).l2 != 0.0f)

static void fz_adagrad_range_scalar(const fz_adagrad_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_adagrad_args, fz_adagrad_loop_scalar, FZ_ADAGRAD_L2, t, b, e);
}

#if FZ_HAVE_AVX2
typedef struct {
    __m256 eps, nclr, wd, scale;
} fz_adagrad_consts8;

FZ_AVX2 FZ_INLINE void fz_adagrad8(const fz_adagrad_args a, const fz_adagrad_consts8 k, size_t i, const int dt,
                                   const int odt, const int l2, const int stream) {
    __m256 p = _mm256_loadu_ps(a.p_in + i);
    __m256 g = _mm256_mul_ps(fz_load8(a.g, dt, i), k.scale);
    if (l2) g = _mm256_fmadd_ps(k.wd, p, g);
    __m256 s = _mm256_fmadd_ps(g, g, _mm256_loadu_ps(a.s_in + i));
    __m256 d = _mm256_add_ps(_mm256_sqrt_ps(s), k.eps);
    p = _mm256_fmadd_ps(_mm256_div_ps(g, d), k.nclr, p);
    _mm256_storeu_ps(a.s_out + i, s);
    _mm256_storeu_ps(a.p_out + i, p);
    fz_store8(a.out16, odt, i, p, stream);
}

FZ_AVX2 FZ_INLINE void fz_adagrad_loop_avx2(const fz_adagrad_args a, size_t b, size_t e, const int dt,
                                            const int odt, const int l2) {
    const fz_adagrad_hyper *h = &a.h;
    const fz_adagrad_consts8 k = {_mm256_set1_ps(h->eps), _mm256_set1_ps(-h->step_size), _mm256_set1_ps(h->l2),
                                  _mm256_set1_ps(h->grad_scale)};
    const int stream = a.stream && odt != FZ_NONE && ((uintptr_t)((uint16_t *)a.out16 + b) & 15) == 0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
        fz_adagrad_prefetch(a, dt, i + FZ_PREFETCH);
        fz_adagrad8(a, k, i, dt, odt, l2, stream);
        fz_adagrad8(a, k, i + 8, dt, odt, l2, stream);
    }
    for (; i + 8 <= e; i += 8) fz_adagrad8(a, k, i, dt, odt, l2, stream);
    for (; i < e; i++) fz_adagrad1(a, i, dt, odt, l2);
}

FZ_AVX2 static void fz_adagrad_range_avx2(const fz_adagrad_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_adagrad_args, fz_adagrad_loop_avx2, FZ_ADAGRAD_L2, t, b, e);
}
#endif /* FZ_HAVE_AVX2 */

#if FZ_X86
FZ_AVX512 FZ_INLINE void fz_adagrad_loop_avx512(const fz_adagrad_args a, size_t b, size_t e, const int dt,
                                                const int odt, const int l2) {
    const fz_adagrad_hyper *h = &a.h;
    const __m512 eps = _mm512_set1_ps(h->eps), nclr = _mm512_set1_ps(-h->step_size);
    const __m512 wd = _mm512_set1_ps(h->l2), scale = _mm512_set1_ps(h->grad_scale);
    const int stream = a.stream && odt != FZ_NONE && ((uintptr_t)((uint16_t *)a.out16 + b) & 31) == 0;
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
        fz_adagrad_prefetch(a, dt, i + FZ_PREFETCH);
        __m512 p = _mm512_loadu_ps(a.p_in + i);
        __m512 g = _mm512_mul_ps(fz_load16(a.g, dt, i), scale);
        if (l2) g = _mm512_fmadd_ps(wd, p, g);
        __m512 s = _mm512_fmadd_ps(g, g, _mm512_loadu_ps(a.s_in + i));
        __m512 d = _mm512_add_ps(_mm512_sqrt_ps(s), eps);
        p = _mm512_fmadd_ps(_mm512_div_ps(g, d), nclr, p);
        _mm512_storeu_ps(a.s_out + i, s);
        _mm512_storeu_ps(a.p_out + i, p);
        fz_store16(a.out16, odt, i, p, stream);
    }
    for (; i < e; i++) fz_adagrad1(a, i, dt, odt, l2);
}

FZ_AVX512 static void fz_adagrad_range_avx512(const fz_adagrad_task *t, size_t b, size_t e) {
    FZ_DISPATCH(fz_adagrad_args, fz_adagrad_loop_avx512, FZ_ADAGRAD_L2, t, b, e);
}

FZ_AVX512 static void fz_adagrad_range_avx512bf16(const fz_adagrad_task *t, size_t b, size_t e) {
    FZ_DISPATCH_BF16_HW(fz_adagrad_args, fz_adagrad_loop_avx512, FZ_ADAGRAD_L2, t, b, e);
}
#endif /* FZ_X86 */

static void fz_adagrad_chunk(void *ctx, size_t k, size_t b, size_t e) {
    (void)k;
    const fz_adagrad_task *t = (const fz_adagrad_task *)ctx;
    t->fn(t, b, e);
    if (t->args.stream) fz_fence();
}

int fz_adagrad_step_segments(const fz_adagrad_hyper *hypers, int ngroups, const int64_t *ends,
                             const int64_t *group, size_t nseg, size_t n, const float *p_in, const void *g,
                             int g_dtype, const float *s_in, float *p_out, float *s_out, void *out16,
                             int out16_dtype, int nthreads) {
    if (fz_check_dtypes(g_dtype, out16_dtype) != 0) return -1;
    if (fz_check_segments(ngroups, ends, group, nseg, n) != 0) return -2;
    if (n == 0) return 0;
    fz_adagrad_task t = {fz_adagrad_range_scalar,
                         {hypers[0], p_in, s_in, g, p_out, s_out, out16, g_dtype, out16_dtype, n >= FZ_STREAM_MIN},
                         hypers, ends, group, nseg};
    FZ_PICK(t.fn, out16_dtype, fz_adagrad_range_scalar, fz_adagrad_range_avx2, fz_adagrad_range_avx512,
            fz_adagrad_range_avx512bf16);
    fz_run(n, nthreads, fz_adagrad_chunk, &t);
    return 0;
}

int fz_adagrad_step(const fz_adagrad_hyper *h, size_t n, const float *p_in, const void *g, int g_dtype,
                    const float *s_in, float *p_out, float *s_out, void *out16, int out16_dtype, int nthreads) {
    const int64_t end = (int64_t)n, group = 0;
    return fz_adagrad_step_segments(h, 1, &end, &group, 1, n, p_in, g, g_dtype, s_in, p_out, s_out, out16,
                                    out16_dtype, nthreads);
}
