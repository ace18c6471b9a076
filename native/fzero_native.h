/* fzero's native CPU kernels: the Adam/AdamW, Lion and Adagrad steps on float32 master weights and state, the
 * gradient statistics (sum of squares, non-finite flag), and a bandwidth-ceiling kernel for the benchmark.
 *
 * Every kernel has three implementations (scalar, AVX2+FMA+F16C, AVX-512F) chosen at run time from the CPU's
 * features (never from the build machine's), and runs on `nthreads` OpenMP threads above a size threshold. A fourth
 * path, avx512bf16, is the AVX-512F one with the bfloat16 copy-out by VCVTNEPS2BF16 (where the CPU has AVX512_BF16).
 * The optimizer steps' paths perform the same IEEE operations (multiply, fused multiply-add, square root, divide,
 * compare, round to nearest even) on every element in the same order, so all of them give bitwise identical results.
 * Each step also takes its hyper-parameters per segment of the buffer (parameter groups: fz_*_step_segments), each
 * segment bitwise what an ungrouped call on it gives. Sources: adam.c, lion.c, adagrad.c (the steps; their element
 * arithmetic is stated at the top of each), common.c and fz_internal.h (what they share).
 *
 * The declarations between FZ_CDEF_BEGIN and FZ_CDEF_END are also read by cffi (native/build.py): keep them
 * free of preprocessor directives.
 */
#ifndef FZERO_NATIVE_H
#define FZERO_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* FZ_CDEF_BEGIN */
typedef struct fz_adam_hyper {
    float beta1;           /* m <- beta1 * m + (1 - beta1) * g */
    float one_minus_beta1;
    float beta2;           /* v <- beta2 * v + (1 - beta2) * g * g */
    float one_minus_beta2;
    float eps;             /* added after the bias correction, as torch.optim.Adam does */
    float step_size;       /* lr / (1 - beta1^t), or lr without bias correction */
    float inv_sqrt_bc2;    /* 1 / sqrt(1 - beta2^t), or 1 */
    float decay;           /* 1 - lr * weight_decay for AdamW's decoupled decay, else 1 */
    float l2;              /* weight_decay for Adam's L2 mode (g <- g + l2 * p), else 0 */
    float grad_scale;      /* multiplies every gradient on load (1 / loss scale times the clip coefficient) */
} fz_adam_hyper;

typedef struct fz_lion_hyper {
    float beta1;           /* c <- beta1 * m + (1 - beta1) * g, whose sign is the update */
    float one_minus_beta1;
    float beta2;           /* m <- beta2 * m + (1 - beta2) * g */
    float one_minus_beta2;
    float lr;              /* p <- p * decay - lr * sign(c) */
    float decay;           /* 1 - lr * weight_decay (decoupled), else 1 */
    float grad_scale;      /* multiplies every gradient on load */
} fz_lion_hyper;

typedef struct fz_adagrad_hyper {
    float eps;             /* added to sqrt(sum) */
    float step_size;       /* this step's lr / (1 + (t - 1) * lr_decay) */
    float l2;              /* weight_decay (g <- g + l2 * p), else 0 */
    float grad_scale;      /* multiplies every gradient on load */
} fz_adagrad_hyper;

/* dtype codes of gradients and of the low-precision copy-out */
enum { FZ_NONE = -1, FZ_F32 = 0, FZ_BF16 = 1, FZ_F16 = 2 };
/* instruction-set paths */
enum { FZ_ISA_AUTO = -1, FZ_ISA_SCALAR = 0, FZ_ISA_AVX2 = 1, FZ_ISA_AVX512 = 2, FZ_ISA_AVX512BF16 = 3 };

/* One Adam step over n elements. p_out, m_out, v_out may equal p_in, m_in, v_in (in place). g has dtype g_dtype
 * (FZ_F32, FZ_BF16 or FZ_F16). If out16_dtype is FZ_BF16 or FZ_F16, out16 receives the updated parameters
 * rounded to nearest even (what torch's .to(dtype) gives). Returns 0, or -1 for an unknown dtype code. */
int fz_adam_step(const fz_adam_hyper *h, size_t n, const float *p_in, const void *g, int g_dtype,
                 const float *m_in, const float *v_in, float *p_out, float *m_out, float *v_out,
                 void *out16, int out16_dtype, int nthreads);

/* The same step with hyper-parameters per segment: elements [ends[s-1], ends[s]) (ends[-1] = 0) use
 * hypers[group[s]]. ends must be non-decreasing (an empty segment is skipped) with ends[nseg - 1] == n, and
 * 0 <= group[s] < ngroups; nseg may be 0 only when n is 0. Each segment's result is bitwise fz_adam_step's on that
 * slice with that hyper struct (fz_adam_step is this call with one segment), on every path and thread count.
 * One parallel region covers the whole buffer: each chunk of work finds its first segment by binary search and
 * runs the vector loop once per piece of a segment it holds. Returns 0, -1 for an unknown dtype code, or -2 for
 * an invalid segment table. */
int fz_adam_step_segments(const fz_adam_hyper *hypers, int ngroups, const int64_t *ends, const int64_t *group,
                          size_t nseg, size_t n, const float *p_in, const void *g, int g_dtype, const float *m_in,
                          const float *v_in, float *p_out, float *m_out, float *v_out, void *out16, int out16_dtype,
                          int nthreads);

/* One Lion step over n elements (lion.c states the arithmetic): p, m as fz_adam_step's (p_out, m_out may equal
 * p_in, m_in), the same gradient and copy-out dtypes. Returns 0, or -1 for an unknown dtype code. */
int fz_lion_step(const fz_lion_hyper *h, size_t n, const float *p_in, const void *g, int g_dtype, const float *m_in,
                 float *p_out, float *m_out, void *out16, int out16_dtype, int nthreads);

/* The Lion step with hyper-parameters per segment, as fz_adam_step_segments (the same table, the same guarantees).
 * Returns 0, -1 for an unknown dtype code, or -2 for an invalid segment table. */
int fz_lion_step_segments(const fz_lion_hyper *hypers, int ngroups, const int64_t *ends, const int64_t *group,
                          size_t nseg, size_t n, const float *p_in, const void *g, int g_dtype, const float *m_in,
                          float *p_out, float *m_out, void *out16, int out16_dtype, int nthreads);

/* One Adagrad step over n elements (adagrad.c states the arithmetic): s is the running sum of squared gradients
 * (s_out may equal s_in, p_out p_in); dtypes as fz_adam_step's. Returns 0, or -1 for an unknown dtype code. */
int fz_adagrad_step(const fz_adagrad_hyper *h, size_t n, const float *p_in, const void *g, int g_dtype,
                    const float *s_in, float *p_out, float *s_out, void *out16, int out16_dtype, int nthreads);

/* The Adagrad step with hyper-parameters per segment, as fz_adam_step_segments. Returns 0, -1 or -2. */
int fz_adagrad_step_segments(const fz_adagrad_hyper *hypers, int ngroups, const int64_t *ends,
                             const int64_t *group, size_t nseg, size_t n, const float *p_in, const void *g,
                             int g_dtype, const float *s_in, float *p_out, float *s_out, void *out16,
                             int out16_dtype, int nthreads);

/* Sum of squares of n gradients (accumulated in double, by chunks added in order: the result depends on the path
 * and n, not on the thread count) and whether any is inf or nan. Returns 0 or -1. */
int fz_grad_stats(const void *g, int g_dtype, size_t n, double *sumsq, int *nonfinite, int nthreads);

/* Adam's exact memory pattern with fused multiply-adds only: x <- x + a * g for x in p, m, v (read p, g, m, v;
 * write p, m, v). The ceiling that memory bandwidth sets for any Adam kernel; a = 0 leaves the values as they are. */
void fz_ceiling(size_t n, float *p, const float *g, float *m, float *v, float a, int nthreads);

int fz_isa(void);                 /* the path in use */
int fz_isa_detected(void);        /* the best path this CPU supports */
int fz_set_isa(int isa);          /* force a path (FZ_ISA_AUTO: the detected one); -1 if this CPU lacks it */
int fz_openmp(void);              /* 1 if built with OpenMP */
size_t fz_parallel_threshold(void); /* calls on fewer elements run on one thread */
/* FZ_CDEF_END */

#endif
