/* What fzero's native kernels (adam.c, lion.c, adagrad.c) share, internal to the extension (cffi reads only
 * fzero_native.h): the platform's intrinsics and target attributes, the bit-exact conversions between float32 and
 * bfloat16 / float16, the 8- and 16-lane loads and stores, the walk over a segment table, and the run-time
 * machinery (common.c: the instruction-set choice, the split of work into chunks for the OpenMP threads, the
 * segment table's check).
 *
 * Every kernel follows one pattern, so that its paths agree bitwise: a scalar element step (fz_<k>1) whose
 * operations the AVX2 and AVX-512 loops perform lane by lane in the same order (tails run the scalar step), under
 * -ffp-contract=off so the compiler fuses nothing on its own. The avx512bf16 path is the AVX-512 loops with the
 * bfloat16 copy-out done by VCVTNEPS2BF16 (FZ_BF16_HW below); every other case runs the AVX-512 code itself.
 */
#ifndef FZ_INTERNAL_H
#define FZ_INTERNAL_H

#include "fzero_native.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(FZ_EMULATE_AVX512)
/* Development only (native/emulate_avx512.py): the AVX-512 path's own source compiled against SIMDe's portable
 * implementations of the intrinsics, so a machine without AVX-512 can check it bitwise against the scalar path.
 * The AVX2 path is left out of such a build. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#define FZ_X86 1
#define FZ_AVX512
/* Instructions SIMDe lacks, by their definitions: VPMOVDW truncates each 32-bit lane to 16 bits; VCVTPS2PH
 * converts each lane (here with SIMDe's own F16C conversion, not fzero's); VPTESTNMD sets the lanes whose AND is
 * zero. */
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
static inline __mmask16 fz_emu_testn_epi32_mask(__m512i a, __m512i b) {
    return (__mmask16)~_mm512_test_epi32_mask(a, b);
}
#define _mm512_cvtepi32_epi16 fz_emu_cvtepi32_epi16
#define _mm512_testn_epi32_mask fz_emu_testn_epi32_mask
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
/* Chunks whose sum of squares one core computes at once (fz_grad_stats): eight streams read 1.5x faster than one. */
#define FZ_STREAMS 8
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

/* An internal copy-out code, never accepted from a caller (fz_check_dtypes): bfloat16 written by VCVTNEPS2BF16
 * (fz_to_bf16_16_hw), which the avx512bf16 path's loops are instantiated with (FZ_DISPATCH_BF16_HW). The scalar
 * step (the loops' tails) writes it as FZ_BF16: the same bits. */
#define FZ_BF16_HW 3

FZ_INLINE void fz_store1(void *out, int odt, size_t i, float x) {
    if (odt == FZ_BF16 || odt == FZ_BF16_HW) ((uint16_t *)out)[i] = fz_to_bf16(x);
    else if (odt == FZ_F16) ((uint16_t *)out)[i] = fz_to_f16(x);
}

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

/* Software prefetch FZ_PREFETCH elements (512 bytes of float32) ahead on the input streams: the loop's
 * arithmetic keeps the out-of-order window from running far enough ahead on its own, and on the development
 * machine (Zen 3) this distance took one thread from 91% to the full bandwidth-ceiling speed (Adam). A prefetch
 * never faults, so running past the end is harmless. */
#define FZ_PREFETCH 128
#if FZ_X86
#define FZ_PF(ptr) _mm_prefetch((const char *)(ptr), _MM_HINT_T0)
#elif defined(__GNUC__) || defined(__clang__)
#define FZ_PF(ptr) __builtin_prefetch((ptr), 0, 3)
#else
#define FZ_PF(ptr) ((void)(ptr))
#endif

/* A kernel's task is a struct with the fields fn (its path's range function), args (an ARGS struct, passed by
 * value into the loops, whose field h is the hyper struct in use, and which has g_dtype and out_dtype), hypers,
 * ends, group and nseg (the segment table).
 *
 * FZ_WALK runs `LOOP(args, b, e, dt, odt, variant)` over the elements [b, e) of task t: once per run of
 * consecutive segments of one group (the first found by binary search), with that group's hyper struct, and
 * `variant` the 0 / 1 value of `VARIANT(h)` (a mode whose loop is compiled apart, e.g. Adam's L2 term). Cutting a
 * range into pieces never changes a result (every path computes each element alone, lane by lane the scalar
 * step), so a piece gives bitwise what an ungrouped call on it would. The walk sits inside the (dtype, copy-out)
 * dispatch, so a piece costs a few loads and one predictable branch, not a call and a switch. */
#define FZ_WALK(ARGS, LOOP, VARIANT, t, b, e, dt, odt)                                                          \
    do {                                                                                                        \
        ARGS a_ = (t)->args;                                                                                    \
        const int64_t *ends_ = (t)->ends, *group_ = (t)->group;                                                 \
        const size_t e_ = (e), last_ = (t)->nseg - 1;                                                           \
        size_t b_ = (b);                                                                                        \
        for (size_t s_ = fz_segment_of(ends_, (t)->nseg, b_); b_ < e_; s_++) {                                  \
            const int64_t k_ = group_[s_];                                                                      \
            while (s_ < last_ && (size_t)ends_[s_] < e_ && group_[s_ + 1] == k_) s_++;                         \
            size_t end_ = (size_t)ends_[s_] < e_ ? (size_t)ends_[s_] : e_;                                      \
            if (end_ <= b_) continue; /* an empty segment */                                                    \
            a_.h = (t)->hypers[k_];                                                                             \
            if (VARIANT(a_.h)) LOOP(a_, b_, end_, dt, odt, 1);                                                  \
            else LOOP(a_, b_, end_, dt, odt, 0);                                                                \
            b_ = end_;                                                                                          \
        }                                                                                                       \
    } while (0)
/* Instantiate the walk for every (gradient dtype, copy-out dtype) combination, and with it the loop for both
 * variants, so each inner loop is compiled with its branches folded away. */
#define FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, dt, odt)                                                          \
    case (dt) * 4 + (odt) + 1:                                                                                  \
        FZ_WALK(ARGS, LOOP, VARIANT, t, b, e, dt, odt);                                                         \
        break
#define FZ_DISPATCH(ARGS, LOOP, VARIANT, t, b, e)                                                               \
    do {                                                                                                        \
        switch ((t)->args.g_dtype * 4 + (t)->args.out_dtype + 1) {                                              \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_F32, FZ_NONE);                                             \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_F32, FZ_BF16);                                             \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_F32, FZ_F16);                                              \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_BF16, FZ_NONE);                                            \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_BF16, FZ_BF16);                                            \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_BF16, FZ_F16);                                             \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_F16, FZ_NONE);                                             \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_F16, FZ_BF16);                                             \
            FZ_CASE(ARGS, LOOP, VARIANT, t, b, e, FZ_F16, FZ_F16);                                              \
        default: break;                                                                                         \
        }                                                                                                       \
    } while (0)
/* The avx512bf16 path's walk: only the bfloat16 copy-out differs from the AVX-512 path, so only those three
 * (gradient dtype, FZ_BF16) cases are instantiated again, with the copy-out code FZ_BF16_HW. */
#define FZ_DISPATCH_BF16_HW(ARGS, LOOP, VARIANT, t, b, e)                                                       \
    do {                                                                                                        \
        switch ((t)->args.g_dtype) {                                                                            \
        case FZ_F32: FZ_WALK(ARGS, LOOP, VARIANT, t, b, e, FZ_F32, FZ_BF16_HW); break;                          \
        case FZ_BF16: FZ_WALK(ARGS, LOOP, VARIANT, t, b, e, FZ_BF16, FZ_BF16_HW); break;                        \
        case FZ_F16: FZ_WALK(ARGS, LOOP, VARIANT, t, b, e, FZ_F16, FZ_BF16_HW); break;                          \
        default: break;                                                                                         \
        }                                                                                                       \
    } while (0)
/* For a kernel with one loop only. */
#define FZ_NO_VARIANT(h) 0

/* Pick the chosen path's function into `dst` (the scalar one unless the path is a SIMD one this build has). The
 * avx512bf16 path runs its own function (`avx512bf16`) for a bfloat16 copy-out (odt), the AVX-512 one otherwise. */
#if FZ_X86 && FZ_HAVE_AVX2
#define FZ_PICK(dst, odt, scalar, avx2, avx512, avx512bf16)                                                     \
    do {                                                                                                        \
        int isa_ = fz_isa();                                                                                    \
        dst = isa_ == FZ_ISA_AVX512BF16 && (odt) == FZ_BF16 ? (avx512bf16)                                      \
              : isa_ >= FZ_ISA_AVX512                       ? (avx512)                                          \
              : isa_ == FZ_ISA_AVX2                         ? (avx2)                                            \
                                                            : (scalar);                                         \
    } while (0)
#elif FZ_X86
#define FZ_PICK(dst, odt, scalar, avx2, avx512, avx512bf16)                                                     \
    do {                                                                                                        \
        int isa_ = fz_isa();                                                                                    \
        dst = isa_ == FZ_ISA_AVX512BF16 && (odt) == FZ_BF16 ? (avx512bf16)                                      \
              : isa_ >= FZ_ISA_AVX512                       ? (avx512)                                          \
                                                            : (scalar);                                         \
    } while (0)
#else
#define FZ_PICK(dst, odt, scalar, avx2, avx512, avx512bf16) dst = (scalar)
#endif

#if FZ_HAVE_AVX2
/* ---------------------------------------------------------------------------------------------------------------
 * AVX2 + FMA + F16C: 8 lanes (loads and stores; each kernel's arithmetic is in its own file)
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
#endif /* FZ_HAVE_AVX2 */

#if FZ_X86
/* ---------------------------------------------------------------------------------------------------------------
 * AVX-512F: 16 lanes (loads and stores)
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

/* VCVTNEPS2BF16 (AVX512_BF16), as inline assembly rather than the intrinsic: the instruction must sit inside the
 * AVX-512F loops (fz_store16 is inlined into them), and GCC and Clang refuse to inline a target("avx512bf16")
 * intrinsic into a function compiled for less; giving the AVX-512 path that target instead would let the compiler
 * use the instruction where the avx512 path runs on a CPU without it. Only the avx512bf16 path, which the run-time
 * check admits where the CPU has the instruction, reaches this (odt FZ_BF16_HW). The emulated build (SIMDe, which
 * cannot run it) follows the instruction's definition in the SDM instead. */
#if defined(FZ_EMULATE_AVX512)
static inline __m256i fz_cvtneps2bf16(__m512 x) {
    uint32_t in[16];
    uint16_t out[16];
    _mm512_storeu_si512((void *)in, _mm512_castps_si512(x));
    for (int k = 0; k < 16; k++) {
        uint32_t u = in[k];
        if ((u & 0x7F800000u) == 0) out[k] = (uint16_t)((u >> 16) & 0x8000u); /* zero or subnormal: signed zero */
        else out[k] = fz_to_bf16(fz_float(u)); /* NaN quieted, or round to nearest even (inf stays inf) */
    }
    return _mm256_loadu_si256((const __m256i *)out);
}
#else
FZ_AVX512 FZ_INLINE __m256i fz_cvtneps2bf16(__m512 x) {
    __m256i h;
    __asm__("vcvtneps2bf16 {%1, %0|%0, %1}" : "=v"(h) : "v"(x)); /* {AT&T | Intel} operand order */
    return h;
}
#endif

/* torch's bfloat16 rounding by VCVTNEPS2BF16. The instruction rounds to nearest even whatever MXCSR says and
 * quiets a NaN exactly as fz_to_bf16 does (x >> 16 | 0x40), but flushes a subnormal input to a signed zero (the
 * SDM's definition) where torch rounds it (0x00400000 -> 0x0040). Checked against fz_to_bf16 for all 2^32 inputs
 * on a Zen 4: those subnormals are the only difference. So a vector with a subnormal lane (exponent 0, mantissa
 * not 0; never in practice) takes the integer rounding of fz_to_bf16_16 as a whole, and the rest costs the
 * conversion, two mask tests and a branch that is always predicted. */
FZ_AVX512 FZ_INLINE __m256i fz_to_bf16_16_hw(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __mmask16 zero_exp = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x7F800000));
    __mmask16 subnormal = _mm512_mask_test_epi32_mask(zero_exp, b, _mm512_set1_epi32(0x007FFFFF));
    if (__builtin_expect(subnormal != 0, 0)) return fz_to_bf16_16(x);
    return fz_cvtneps2bf16(x);
}

FZ_AVX512 FZ_INLINE void fz_store16(void *out, int odt, size_t i, __m512 x, int stream) {
    __m256i h;
    if (odt == FZ_BF16) h = fz_to_bf16_16(x);
    else if (odt == FZ_BF16_HW) h = fz_to_bf16_16_hw(x);
    else if (odt == FZ_F16) h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else return;
    __m256i *dst = (__m256i *)((uint16_t *)out + i);
    if (stream) _mm256_stream_si256(dst, h); /* 32-byte aligned: checked by the caller */
    else _mm256_storeu_si256(dst, h);
}
#endif /* FZ_X86 */

/* ---------------------------------------------------------------------------------------------------------------
 * The run-time machinery (common.c)
 * ------------------------------------------------------------------------------------------------------------- */

/* One chunk [b, e) of the work, k its index in order. */
typedef void (*fz_task)(void *ctx, size_t k, size_t b, size_t e);

/* The chunk size for n elements (a multiple of 64, at least FZ_MIN_CHUNK, at most FZ_MAX_CHUNKS chunks). */
size_t fz_chunk(size_t n);
/* Run task over [0, n) in chunks of fz_chunk(n) elements, on up to nthreads OpenMP threads. */
void fz_run(size_t n, int nthreads, fz_task task, void *ctx);
/* 0 if the table is valid for n elements and ngroups groups, else -2. */
int fz_check_segments(int ngroups, const int64_t *ends, const int64_t *group, size_t nseg, size_t n);
/* 0 if g_dtype is a gradient dtype and out16_dtype FZ_NONE or a copy-out dtype, else -1. */
int fz_check_dtypes(int g_dtype, int out16_dtype);
/* Fence the non-temporal stores of a chunk (a no-op off x86). */
void fz_fence(void);

#endif /* FZ_INTERNAL_H */
