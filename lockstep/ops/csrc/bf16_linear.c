/* bf16 linear without AMX: AVX-512 fp32 FMAs where the CPU has avx512_bf16, plain C otherwise
 * (lockstep/ops/decode_linear.py). Also the packing every bf16 C kernel reads (amx_linear.c too).
 *
 * out[M, N] = x[M, K] @ W[N, K]^T (+ bias), products and sums in fp32, one bf16 rounding at the end.
 *
 * Why: the batch-invariant bf16 linear (trainer and generator) on CPUs without AMX, and the
 * engine's packed decode linears there: each output's arithmetic is fixed by K alone, so a row's
 * bits do not depend on the other rows of the call, where it sits, the thread count or the register
 * block that computes it; any N and K (no padding of rows, no fixed-shape tiles).
 *
 * Packed layout (bf16_pack; the B operand layout of AMX's TDPBF16PS and of vdpbf16ps): N padded to
 * a multiple of 16 and K to a multiple of 32 with zeros; for each block j of 16 output columns, K/2
 * "pair rows" of 32 bf16, pair row p holding W[16j + c][2p + i] at [c][i]. A block is one
 * contiguous run (the AMX kernel reads it as K/32 tiles of 16 pair rows).
 *
 * Arithmetic order, per output element (x, w its row of x and of W; P = ceil(K / 2); a missing
 * x[K] for odd K is +0):
 *   acc = +0
 *   for p = 0, 1, ..., P-1:  acc = fma(x[2p+1], w[2p+1], acc); acc = fma(x[2p], w[2p], acc)
 *   out = bf16_round_nearest_even(acc + bias)          (bias fp32, or nothing)
 * with vdpbf16ps's rules in every fma: bf16 inputs that are denormal read as 0 (DAZ), a denormal
 * result becomes a zero of its sign (FTZ); the final rounding also reads a denormal sum as 0
 * (vcvtneps2bf16). That is vdpbf16ps's arithmetic (per its specification the odd product first),
 * which the AVX-512 path ran until this file's chunked rewrite; it now runs the same operations as
 * two fp32 FMAs per pair row (bf16 widened to fp32 by a shift: exact) with MXCSR's DAZ and FTZ set
 * for the thread's FMAs (the caller's MXCSR is restored, and is the one in force for the bias sum):
 * vdpbf16ps issues at a quarter of the FMA rate on the Xeon this was written on (about 0.5 vs 2 a
 * cycle), so the FMAs do the same work ~1.4x faster at 16 rows. The plain C path spells the same
 * operations out, compiled with -ffp-contract=off (the fmaf calls are the only fused operations),
 * so both give the same bits (tested, denormals included), and the same bits as the vdpbf16ps
 * kernel before them (compared on SmolLM2's shapes: benchmarks/decode_kernels.py --baseline). Neither
 * gives oneDNN's or the AMX kernel's bits (other summation orders).
 *
 * Loop order: threads (torch's OpenMP runtime) take work items of up to 48 rows x 3 column blocks
 * (plain C: 4); an item walks K in chunks of 32 pair rows (plain C: K whole), every register block
 * of up to 8 rows x 3 column blocks (24 accumulators; plain C: 6 x 4) over one chunk before the
 * next (the running sums parked in memory between chunks: exact), so the chunk's weights (6 KB)
 * come from memory once and from L1 for the other row blocks, and the first row block prefetches
 * each block's stream 2 KB ahead.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AVX512_PATH
#define RB 8        /* rows per register block (32 zmm registers: 24 accumulators, 6 widened weights) */
#define CB 3        /* column blocks of 16 per register block and per work item */
#define K_CHUNK 32  /* pair rows per chunk */
#else
#define RB 6        /* the plain C path: 6 x 4 (its speed at 1 row: ~1.2x that of 8 x 3), */
#define CB 4
#define K_CHUNK ((int64_t)1 << 40) /* and K whole (it is compute-bound: chunks only cost it) */
#endif
#define M_ITEM 48   /* rows per work item */
#define PREFETCH 2048 /* bytes ahead in each column block's stream */

static inline int64_t pair_rows(int64_t k) { return (k + 31) / 32 * 16; }

void bf16_pack(const uint16_t *weight, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t blocks = (n + 15) / 16, pairs = pair_rows(k);
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < blocks; j++)
        for (int64_t p = 0; p < pairs; p++) {
            uint16_t *row = packed + (j * pairs + p) * 32;
            for (int c = 0; c < 16; c++)
                for (int i = 0; i < 2; i++) {
                    const int64_t col = j * 16 + c, kk = 2 * p + i;
                    row[c * 2 + i] = (col < n && kk < k) ? weight[col * k + kk] : 0;
                }
        }
}

/* x's pair p of a row (x[2p] low, x[2p+1] high), +0 past K */
static inline uint32_t x_pair(const uint16_t *x, int64_t p, int64_t k) {
    if (2 * p + 1 < k) {
        uint32_t both;
        memcpy(&both, x + 2 * p, sizeof both);
        return both;
    }
    return x[2 * p];
}

static inline float daz_widen(uint16_t h) {
    uint32_t u = (h & 0x7f80u) ? (uint32_t)h << 16 : (uint32_t)(h & 0x8000u) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    if (!(u & 0x7f800000u))
        return (uint16_t)((u >> 16) & 0x8000u); /* a denormal reads as 0 */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef AVX512_PATH
#include <immintrin.h>

/* R rows x C column blocks over pair rows [p0, p1) as fp32 FMAs (MXCSR DAZ|FTZ: csr_enter): the sums start at 0
 * (p0 = 0) or from keep, and go back to keep or, after the last pair row, plus the bias (under the caller's MXCSR,
 * csr) rounded to out; cols: live columns of the last block (16 if full); PRE: prefetch the blocks' streams. */
static inline __attribute__((always_inline)) void block(const int R, const int C, const int PRE, const uint16_t *x,
                                                        const uint16_t *w, const float *bias, uint16_t *out, int64_t n,
                                                        int64_t k, int64_t col0, int cols, int64_t p0, int64_t p1,
                                                        float *keep, unsigned csr) {
    const int64_t pairs = pair_rows(k), live = (k + 1) / 2;
    /* x's pairs [p0, p1) of each row widened to fp32 (exact; x[K] of an odd K is +0) */
    float xf[RB][2 * K_CHUNK] __attribute__((aligned(64)));
    const int64_t lo = 2 * p0, hi = 2 * p1 < k ? 2 * p1 : k;
    for (int r = 0; r < R; r++)
        for (int64_t i = lo; i < 2 * p1; i += 16) {
            const int64_t take = hi - i < 16 ? (hi - i > 0 ? hi - i : 0) : 16;
            const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << take) - 1), x + r * k + i);
            _mm512_storeu_ps(xf[r] + (i - lo), _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
    __m512 acc[RB][CB];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = p0 ? _mm512_loadu_ps(keep + (r * CB + c) * 16) : _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t p = p0; p < p1; p++) {
        __m512 odd[CB], even[CB];
        for (int c = 0; c < C; c++) {
            if (PRE) _mm_prefetch((const char *)(w + (c * pairs + p) * 32) + PREFETCH, _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512(w + (c * pairs + p) * 32);  /* lane l: w[2p] low, w[2p+1] high */
            odd[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        }
        const int64_t q = 2 * (p - p0);
        for (int r = 0; r < R; r++) {
            const __m512 x1 = _mm512_set1_ps(xf[r][q + 1]), x0 = _mm512_set1_ps(xf[r][q]);
            for (int c = 0; c < C; c++)  /* the odd product first, as vdpbf16ps */
                acc[r][c] = _mm512_fmadd_ps(x0, even[c], _mm512_fmadd_ps(x1, odd[c], acc[r][c]));
        }
    }
    if (p1 < live) {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) _mm512_storeu_ps(keep + (r * CB + c) * 16, acc[r][c]);
        return;
    }
    const unsigned flush = _mm_getcsr();
    if (bias) _mm_setcsr(csr);  /* a denormal bias is added as it is (vcvtneps2bf16 itself ignores MXCSR) */
    for (int c = 0; c < C; c++) {
        const int64_t col = col0 + c * 16;
        const __mmask16 mask = (c == C - 1 && cols < 16) ? (__mmask16)((1u << cols) - 1) : (__mmask16)0xffff;
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m256bh h = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(acc[r][c], b) : acc[r][c]);
            _mm256_mask_storeu_epi16(out + r * n + col, mask, (__m256i)h);
        }
    }
    if (bias) _mm_setcsr(flush);
}
#else
static inline float ftz(float v) { return fabsf(v) < 0x1p-126f ? copysignf(0.0f, v) : v; }

static inline __attribute__((always_inline)) void block(const int R, const int C, const int PRE, const uint16_t *x,
                                                        const uint16_t *w, const float *bias, uint16_t *out, int64_t n,
                                                        int64_t k, int64_t col0, int cols, int64_t p0, int64_t p1,
                                                        float *keep, unsigned csr) {
    (void)PRE;
    (void)csr;
    const int64_t pairs = pair_rows(k), live = (k + 1) / 2;
    float acc[RB][CB][16];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int l = 0; l < 16; l++) acc[r][c][l] = p0 ? keep[(r * CB + c) * 16 + l] : 0.0f;
    for (int64_t p = p0; p < p1; p++)
        for (int r = 0; r < R; r++) {
            const uint32_t xp = x_pair(x + r * k, p, k);
            const float x0 = daz_widen((uint16_t)xp), x1 = daz_widen((uint16_t)(xp >> 16));
            for (int c = 0; c < C; c++) {
                const uint16_t *wr = w + (c * pairs + p) * 32;
                float *a = acc[r][c];
#pragma omp simd
                for (int l = 0; l < 16; l++) {
                    float v = ftz(fmaf(x1, daz_widen(wr[2 * l + 1]), a[l]));
                    a[l] = ftz(fmaf(x0, daz_widen(wr[2 * l]), v));
                }
            }
        }
    if (p1 < live) {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                for (int l = 0; l < 16; l++) keep[(r * CB + c) * 16 + l] = acc[r][c][l];
        return;
    }
    for (int c = 0; c < C; c++) {
        const int64_t col = col0 + c * 16;
        const int live_cols = c == C - 1 ? cols : 16;
        for (int r = 0; r < R; r++)
            for (int l = 0; l < live_cols; l++)
                out[r * n + col + l] = round_bf16(bias ? acc[r][c][l] + bias[col + l] : acc[r][c][l]);
    }
}
#endif

#ifdef AVX512_PATH
/* DAZ (bit 6) and FTZ (bit 15) for this thread's FMAs, vdpbf16ps's rules; returns the caller's MXCSR (csr_leave) */
static inline unsigned csr_enter(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
    return csr;
}
static inline void csr_leave(unsigned csr) { _mm_setcsr(csr); }
#else
static inline unsigned csr_enter(void) { return 0; }
static inline void csr_leave(unsigned csr) { (void)csr; }
#endif

#define CALL(R, C)                                                                                     \
    (pre ? block(R, C, 1, x, w, bias, out, n, k, col0, cols, p0, p1, keep, csr)                        \
         : block(R, C, 0, x, w, bias, out, n, k, col0, cols, p0, p1, keep, csr))
#define ROWS_CASE(R)                                                                                   \
    case R:                                                                                            \
        switch (c) {                                                                                   \
            case 1: CALL(R, 1); break;                                                                 \
            case 2: CALL(R, 2); break;                                                                 \
            case 3: CALL(R, 3); break;                                                                 \
            default: CALL(R, CB); break;                                                               \
        }                                                                                              \
        break;

static void dispatch(int r, int c, int pre, const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                     int64_t n, int64_t k, int64_t col0, int cols, int64_t p0, int64_t p1, float *keep, unsigned csr) {
    switch (r) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#if RB == 8
        ROWS_CASE(7) ROWS_CASE(8)
#endif
    }
}

/* x [M, K] bf16 contiguous, packed = bf16_pack(W), bias fp32 [N] or NULL, out [M, N] bf16. */
void bf16_linear(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *out, int64_t m, int64_t n,
                 int64_t k) {
    const int64_t blocks = (n + 15) / 16, groups = (blocks + CB - 1) / CB, items_m = (m + M_ITEM - 1) / M_ITEM;
    const int64_t pairs = pair_rows(k), live = (k + 1) / 2;
    #pragma omp parallel
    {
        const unsigned csr = csr_enter();
        float keep[M_ITEM / RB][RB * CB * 16] __attribute__((aligned(64)));
        #pragma omp for schedule(static) collapse(2)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t im = 0; im < items_m; im++) {
                const int64_t j0 = g * CB, c = blocks - j0 < CB ? blocks - j0 : CB;
                const int64_t col0 = j0 * 16, last = n - (j0 + c - 1) * 16;
                const int cols = last < 16 ? (int)last : 16;
                const int64_t i0 = im * M_ITEM, i1 = i0 + M_ITEM < m ? i0 + M_ITEM : m;
                const uint16_t *w = packed + j0 * pairs * 32;
                for (int64_t p0 = 0; p0 < live; p0 += K_CHUNK) {
                    const int64_t p1 = live - p0 < K_CHUNK ? live : p0 + K_CHUNK;
                    for (int64_t m0 = i0; m0 < i1; m0 += RB) {
                        const int r = i1 - m0 < RB ? (int)(i1 - m0) : RB;
                        dispatch(r, (int)c, m0 == i0, x + m0 * k, w, bias, out + m0 * n, n, k, col0, cols, p0, p1,
                                 keep[(m0 - i0) / RB], csr);
                    }
                }
            }
        csr_leave(csr);
    }
}
