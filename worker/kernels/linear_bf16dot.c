/* y = x W^T (+ bias) with bfloat16 products: the linear layers of a batch-invariant bfloat16 engine on a CPU
   with AVX-512 BF16 (VDPBF16PS). Linked into every library with linear.c (native_linear.SOURCES); linear.c's
   batchq_linear_part_w sends it the weights marked bf16_products (linear.h).

   Why: a bfloat16 engine's speed on such a CPU is the doubled multiply rate of bfloat16 products, which
   torch reaches through oneDNN, whose GEMM picks its kernel (and so a row's sums) by the step's row count.
   Here every output is one accumulator that adds x's pairs of bf16 products in the order of K, whatever
   the step's rows, tile or thread: a row's bits never depend on what shares its step.

   Numerics: x is rounded to bfloat16 (to nearest even, as torch's .to() rounds), each VDPBF16PS adds two
   exact products of bf16 values to a float32 accumulator; then, as linear.c stores, the scale per output
   (int8, FP8), the bias (float32) and the residual where the caller accumulates. A weight of another type
   is dequantised as linear.c dequantises it (Q4, Q8: s * q - o, one fused rounding in float32) and
   rounded to bfloat16 (VCVTNE2PS2BF16: to nearest even; a denormal counts as zero, as VDPBF16PS counts
   it anyway), as a bfloat16 model dequantises it; int8 and FP8 values are exact in bfloat16.

   The weight is linear.c's packed layout, unchanged ([ceil(N / PANEL), K, PANEL], zeros past N). A
   bfloat16 panel's rows 2k and 2k + 1 are interleaved in registers into the column pairs the instruction
   takes (unpacklo/hi within 128-bit lanes), which permutes the accumulators' columns, undone once per tile
   at the store. Another type's panel is made into pairs once per call (bf16_pairs) and read by every tile
   of rows; steps of at most QMR rows make the same pairs in registers as they go (quant_tile), with the
   same instructions, so a row's bits are the same either way. The x rows are rounded into pairs once per
   call and thread. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"

#define PANEL 32 /* linear.c's PANEL */
#define DMR 12   /* x rows per tile: 24 accumulators, 2 interleaved weight vectors and 2 loaded rows of 32 */

int batchq_linear_has_bf16dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* A thread's rounded x, kept for its next call (a fresh allocation every call faults its pages again). */
static __thread uint32_t *pairs_buf;
static __thread size_t pairs_len;

/* A float32's bits -> the nearest bfloat16's (ties to even) in the low 16 bits. */
static inline uint32_t round_bf16(const uint32_t f) { return (f + 0x7FFFu + ((f >> 16) & 1u)) >> 16; }

/* x [M, K] float32 -> [M, K2] bf16 pairs (element 2k in the low half), rounded to nearest even; an odd K's
   last pair has a zero high half. Integer rounding, vectorised by the compiler: the same bits as torch's
   float32 -> bfloat16 for every finite value. */
static const uint32_t *round_pairs(const float *x, const int M, const int K, const int K2) {
    const size_t need = (size_t)M * K2;
    if (need > pairs_len) {
        free(pairs_buf);
        pairs_buf = aligned_alloc(64, ((need * 4 + 63) / 64) * 64);
        pairs_len = pairs_buf ? need : 0;
        if (!pairs_buf) return NULL;
    }
    for (int m = 0; m < M; m++) {
        const uint32_t *src = (const uint32_t *)(x + (size_t)m * K);
        uint32_t *dst = pairs_buf + (size_t)m * K2;
        for (int k = 0; k < K / 2; k++) dst[k] = round_bf16(src[2 * k]) | (round_bf16(src[2 * k + 1]) << 16);
        if (K & 1) dst[K2 - 1] = round_bf16(src[K - 1]);
    }
    return pairs_buf;
}

/* Where a tile's weight pairs come from: linear.c's packed bfloat16 panel, rows 2k and 2k + 1 interleaved
   in registers (the accumulators' columns permuted, undone at the store), or a panel already in pairs
   ([K2, PANEL] uint32, column order: what bf16_pairs makes of any other weight). */
enum { FROM_BF16 = 0, FROM_PAIRS = 1 };

/* mr rows of x pairs (row stride K2) against one panel: their sums, in column order, to out [mr, PANEL].
   Every row runs the same instructions on an accumulator of its own, whatever mr is. */
static inline __attribute__((always_inline)) void tile(const uint32_t *xp, const size_t K2, const int K,
                                                       const void *w, const int mr, float *out, const int from) {
    __m512 acc[DMR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < (int)K2; k++) {
        __m512i lo, hi;
        if (from == FROM_BF16) {
            const uint16_t *r0 = (const uint16_t *)w + (size_t)(2 * k) * PANEL;
            __builtin_prefetch((const char *)r0 + 2048, 0, 0);
            __builtin_prefetch((const char *)r0 + 2048 + 64, 0, 0);
            /* an odd K's last row pairs with zeros */
            const __m512i a = _mm512_loadu_si512(r0);
            const __m512i b = 2 * k + 1 < K ? _mm512_loadu_si512(r0 + PANEL) : _mm512_setzero_si512();
            lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
        } else {
            const uint32_t *pr = (const uint32_t *)w + (size_t)k * PANEL;
            lo = _mm512_loadu_si512(pr), hi = _mm512_loadu_si512(pr + 16);
        }
        for (int r = 0; r < mr; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[(size_t)r * K2 + k]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)lo, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)hi, xb);
        }
    }
    if (from == FROM_PAIRS) {
        for (int r = 0; r < mr; r++) {
            _mm512_storeu_ps(out + (size_t)r * PANEL, acc[r][0]);
            _mm512_storeu_ps(out + (size_t)r * PANEL + 16, acc[r][1]);
        }
        return;
    }
    /* dword 4L + j of lo holds column 8L + j, of hi column 8L + 4 + j (128-bit lane L, j < 4) */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out + (size_t)r * PANEL, _mm512_permutex2var_ps(acc[r][0], first, acc[r][1]));
        _mm512_storeu_ps(out + (size_t)r * PANEL + 16, _mm512_permutex2var_ps(acc[r][0], second, acc[r][1]));
    }
}

/* One function per row count and weight source, so that each unrolls its rows with the accumulators in
   registers. */
#define TILE_FN(R)                                                                                          \
    static __attribute__((noinline)) void tile_##R(const uint32_t *xp, size_t K2, int K, const void *w,     \
                                                   float *out) {                                            \
        tile(xp, K2, K, w, R, out, FROM_BF16);                                                              \
    }                                                                                                       \
    static __attribute__((noinline)) void pairs_##R(const uint32_t *xp, size_t K2, int K, const void *w,    \
                                                    float *out) {                                           \
        tile(xp, K2, K, w, R, out, FROM_PAIRS);                                                             \
    }
TILE_FN(1) TILE_FN(2) TILE_FN(3) TILE_FN(4) TILE_FN(5) TILE_FN(6)
TILE_FN(7) TILE_FN(8) TILE_FN(9) TILE_FN(10) TILE_FN(11) TILE_FN(12)
typedef void (*tile_fn)(const uint32_t *, size_t, int, const void *, float *);
static const tile_fn TILES[2][DMR] = {
    {tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8, tile_9, tile_10, tile_11, tile_12},
    {pairs_1, pairs_2, pairs_3, pairs_4, pairs_5, pairs_6, pairs_7, pairs_8, pairs_9, pairs_10, pairs_11, pairs_12}};

/* Row k of panel p of a weight that is not bfloat16, as float32 in two halves of 16 columns: F32 as stored;
   I8 and FP8 unscaled (exact in bfloat16; the scale comes at the store); Q4 and Q8 s * q - o with the
   group's s and o (sv, ov: its two halves each; linear.h's layouts: Q4's byte j holds column j low, j + 16
   high). Inlined with a literal elem. */
static inline __attribute__((always_inline)) void weight_row(const LinearWeight *lw, const size_t row,
                                                             const int elem, const __m512 *sv, const __m512 *ov,
                                                             __m512 *out) {
    const uint8_t *w = (const uint8_t *)lw->w;
    if (elem == F32) {
        out[0] = _mm512_loadu_ps((const float *)w + row * PANEL);
        out[1] = _mm512_loadu_ps((const float *)w + row * PANEL + 16);
    } else if (elem == FP8) {
        for (int h = 0; h < 2; h++) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + row * PANEL + h * 16)));
            const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20),
                                                 _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
            out[h] = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f)); /* exact: a power of two */
        }
    } else if (elem == Q4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + row * (PANEL / 2))));
        out[0] = _mm512_fmsub_ps(sv[0], _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF))), ov[0]);
        out[1] = _mm512_fmsub_ps(sv[1], _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), ov[1]);
    } else { /* I8, Q8 */
        for (int h = 0; h < 2; h++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(w + row * PANEL + h * 16));
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
            out[h] = elem == Q8 ? _mm512_fmsub_ps(sv[h], q, ov[h]) : q;
        }
    }
}

/* Two float32 rows' 16 columns -> 16 bf16 pairs (row a's value in the low half), rounded to nearest even. */
static inline __m512i pair(const __m512 a, const __m512 b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a)); /* [a0 .. a15, b0 .. b15] */
}

/* A thread's panel of a weight that is not bfloat16, dequantised, rounded and paired: [K2, PANEL] uint32,
   pair (row 2k, row 2k + 1) of column c at [k, c]. */
static __thread uint32_t *pairs_panel;
static __thread size_t pairs_panel_rows;

/* The s and o halves of the group holding row k of panel p (Q4, Q8). */
static inline __attribute__((always_inline)) void group_of(const LinearWeight *lw, const int K, const int p,
                                                           const int k, __m512 *sv, __m512 *ov) {
    const size_t ge = lw->group_elem == F32 ? 4 : 2;
    const size_t g = (size_t)p * (K / lw->group) + (size_t)(k / lw->group);
    const char *gp = (const char *)lw->groups + g * 2 * PANEL * ge;
    for (int h = 0; h < 2; h++)
        if (lw->group_elem == F32) {
            sv[h] = _mm512_loadu_ps((const float *)gp + h * 16);
            ov[h] = _mm512_loadu_ps((const float *)gp + PANEL + h * 16);
        } else {
            sv[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp + h * 32)));
            ov[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp + PANEL * 2 + h * 32)));
        }
}

/* Pair k of panel p (rows 2k and 2k + 1; an odd K's last row pairs with zeros) as two vectors of 16 columns'
   bf16 pairs. sv, ov: the current group's halves, reloaded where a group starts (groups hold an even number
   of rows, so both rows of a pair share one). */
static inline __attribute__((always_inline)) void pair_at(const LinearWeight *lw, const int K, const int p,
                                                          const int k, const int elem, __m512 *sv, __m512 *ov,
                                                          __m512i *lo, __m512i *hi) {
    if ((elem == Q4 || elem == Q8) && (2 * k) % lw->group == 0) group_of(lw, K, p, 2 * k, sv, ov);
    __m512 a[2], b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    weight_row(lw, (size_t)p * K + 2 * k, elem, sv, ov, a);
    if (2 * k + 1 < K) weight_row(lw, (size_t)p * K + 2 * k + 1, elem, sv, ov, b);
    *lo = pair(a[0], b[0]);
    *hi = pair(a[1], b[1]);
}

static inline __attribute__((always_inline)) void fill_pairs(const LinearWeight *lw, const int K, const int K2,
                                                             const int p, const int elem) {
    __m512 sv[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, ov[2] = {sv[0], sv[1]};
    for (int k = 0; k < K2; k++) {
        __m512i lo, hi;
        pair_at(lw, K, p, k, elem, sv, ov, &lo, &hi);
        _mm512_storeu_si512(pairs_panel + (size_t)k * PANEL, lo);
        _mm512_storeu_si512(pairs_panel + (size_t)k * PANEL + 16, hi);
    }
}

/* Up to QMR rows against a panel of a weight that is not bfloat16, its pairs made in registers as fill_pairs
   makes them (the same bits as the pairs panel's tiles: decode-sized steps skip its store and reload). */
#define QMR 4
static inline __attribute__((always_inline)) void quant_tile(const uint32_t *xp, const size_t K2, const int K,
                                                             const LinearWeight *lw, const int p, const int mr,
                                                             float *out, const int elem) {
    __m512 acc[QMR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    __m512 sv[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, ov[2] = {sv[0], sv[1]};
    const size_t rb = elem == Q4 ? PANEL / 2 : elem == F32 ? PANEL * 4 : PANEL;
    for (int k = 0; k < (int)K2; k++) {
        __builtin_prefetch((const char *)lw->w + ((size_t)p * K + 2 * k) * rb + 1024, 0, 0);
        __m512i lo, hi;
        pair_at(lw, K, p, k, elem, sv, ov, &lo, &hi);
        for (int r = 0; r < mr; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[(size_t)r * K2 + k]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)lo, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)hi, xb);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out + (size_t)r * PANEL, acc[r][0]);
        _mm512_storeu_ps(out + (size_t)r * PANEL + 16, acc[r][1]);
    }
}

#define QUANT_FN(E, R)                                                                                          \
    static __attribute__((noinline)) void quant_##E##_##R(const uint32_t *xp, size_t K2, int K,                 \
                                                          const LinearWeight *lw, int p, float *out) {          \
        quant_tile(xp, K2, K, lw, p, R, out, E);                                                                \
    }
#define QUANT_FNS(E) QUANT_FN(E, 1) QUANT_FN(E, 2) QUANT_FN(E, 3) QUANT_FN(E, 4)
QUANT_FNS(F32) QUANT_FNS(I8) QUANT_FNS(FP8) QUANT_FNS(Q4) QUANT_FNS(Q8)
typedef void (*quant_fn)(const uint32_t *, size_t, int, const LinearWeight *, int, float *);
#define QROW(E) {quant_##E##_1, quant_##E##_2, quant_##E##_3, quant_##E##_4}
static const quant_fn QUANT_TILES[6][QMR] = {QROW(F32), QROW(F32), QROW(I8), QROW(FP8), QROW(Q4), QROW(Q8)};

static const uint32_t *bf16_pairs(const LinearWeight *lw, const int K, const int K2, const int p) {
    if ((size_t)K2 > pairs_panel_rows) {
        free(pairs_panel);
        pairs_panel = aligned_alloc(64, (size_t)K2 * PANEL * 4);
        pairs_panel_rows = pairs_panel ? (size_t)K2 : 0;
        if (!pairs_panel) return NULL;
    }
    switch (lw->elem) {
    case Q4: fill_pairs(lw, K, K2, p, Q4); break;
    case Q8: fill_pairs(lw, K, K2, p, Q8); break;
    case I8: fill_pairs(lw, K, K2, p, I8); break;
    case FP8: fill_pairs(lw, K, K2, p, FP8); break;
    default: fill_pairs(lw, K, K2, p, F32); break;
    }
    return pairs_panel;
}
#endif

/* Panels p0 .. p1 - 1 of y = x W^T (+ bias) (added to y with accumulate), as linear.c's parts are called:
   inside a parallel region, one contiguous range of panels per thread. Returns nonzero where this build
   has no VDPBF16PS, or its scratch could not be allocated. */
int batchq_linear_bf16dot_part(const float *x, const LinearWeight *lw, float *y, int M, int K, int N, int p0,
                               int p1, int accumulate) {
#ifdef __AVX512BF16__
    if (p0 >= p1 || M < 1) return 0;
    const int K2 = (K + 1) / 2;
    const uint32_t *xp = round_pairs(x, M, K, K2);
    if (!xp) return 1;
    float tot[DMR * PANEL] __attribute__((aligned(64)));
    const int from = lw->elem == BF16 ? FROM_BF16 : FROM_PAIRS;
    if (from == FROM_PAIRS && M <= QMR) { /* decode-sized: the pairs made in registers, no panel of them */
        for (int p = p0; p < p1; p++) {
            QUANT_TILES[lw->elem][M - 1](xp, (size_t)K2, K, lw, p, tot);
            batchq_linear_store_panel(tot, lw, y, M, N, p * PANEL, accumulate);
        }
        return 0;
    }
    for (int p = p0; p < p1; p++) {
        const void *w = from == FROM_BF16 ? (const void *)((const uint16_t *)lw->w + (size_t)p * K * PANEL)
                                          : (const void *)bf16_pairs(lw, K, K2, p);
        if (!w) return 1;
        for (int m0 = 0; m0 < M; m0 += DMR) {
            const int mr = M - m0 < DMR ? M - m0 : DMR;
            TILES[from][mr - 1](xp + (size_t)m0 * K2, (size_t)K2, K, w, tot);
            batchq_linear_store_panel(tot, lw, y + (size_t)m0 * N, mr, N, p * PANEL, accumulate);
        }
    }
    return 0;
#else
    (void)x, (void)lw, (void)y, (void)M, (void)K, (void)N, (void)p0, (void)p1, (void)accumulate;
    return 1;
#endif
}
