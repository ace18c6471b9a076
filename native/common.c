/* The run-time machinery fzero's native kernels share (fz_internal.h): the instruction-set path's choice, the
 * split of work into chunks for the OpenMP threads, and the checks every entry point makes before it writes.
 */
#include "fz_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------------------------------------------------------
 * Run-time dispatch
 * ------------------------------------------------------------------------------------------------------------- */

static int fz_supported(int isa) {
    if (isa == FZ_ISA_SCALAR) return 1;
#if defined(FZ_EMULATE_AVX512)
    return isa == FZ_ISA_AVX512 || isa == FZ_ISA_AVX512BF16;
#elif FZ_HAVE_AVX2
    __builtin_cpu_init();
    /* GCC's and Clang's checks include the OS's support for the wider registers (XCR0), not only CPUID */
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == FZ_ISA_AVX2) return avx2;
    int avx512 = avx2 && __builtin_cpu_supports("avx512f");
    if (isa == FZ_ISA_AVX512) return avx512;
    /* (GCC 12's name for the feature; like avx512f, reported only where the OS saves the 512-bit state) */
    if (isa == FZ_ISA_AVX512BF16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
    return 0;
}

int fz_isa_detected(void) {
    if (fz_supported(FZ_ISA_AVX512BF16)) return FZ_ISA_AVX512BF16;
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
size_t fz_chunk(size_t n) {
    size_t c = ((n + FZ_MAX_CHUNKS - 1) / FZ_MAX_CHUNKS + 63) & ~(size_t)63;
    return c < FZ_MIN_CHUNK ? FZ_MIN_CHUNK : c;
}

void fz_run(size_t n, int nthreads, fz_task task, void *ctx) {
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

/* 0 if the table is valid for n elements and ngroups groups, else -2. Checked here too (not only by the Python
 * wrapper), so no caller can make a kernel read outside hypers or the buffers. */
int fz_check_segments(int ngroups, const int64_t *ends, const int64_t *group, size_t nseg, size_t n) {
    if (nseg == 0) return n == 0 ? 0 : -2;
    int64_t prev = 0;
    for (size_t s = 0; s < nseg; s++) {
        if (ends[s] < prev || group[s] < 0 || group[s] >= ngroups) return -2;
        prev = ends[s];
    }
    return (uint64_t)prev == (uint64_t)n ? 0 : -2;
}

int fz_check_dtypes(int g_dtype, int out16_dtype) {
    if (g_dtype < FZ_F32 || g_dtype > FZ_F16) return -1;
    if (out16_dtype != FZ_NONE && out16_dtype != FZ_BF16 && out16_dtype != FZ_F16) return -1;
    return 0;
}

/* Order a chunk's streamed (non-temporal) stores before whoever reads the copy next: once per chunk, not per piece
 * (a fence per 16-element segment would cost more than the segment's arithmetic). */
void fz_fence(void) {
#if FZ_X86
    _mm_sfence();
#endif
}
