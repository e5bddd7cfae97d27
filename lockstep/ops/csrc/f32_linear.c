/* fp32 linear for decode-sized calls on AVX-512 (lockstep/ops/decode_linear.py).
 *
 * out[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32.
 *
 * Why: a decode step's fp32 product streams each weight once (SmolLM2-135M: 540 MB a step) and does
 * little arithmetic; the BLAS GEMM behind F.linear reads it well below the memory's speed at 1-16
 * rows. Here each thread streams one contiguous run of the packed weight.
 *
 * Packed layout (f32_pack): for each block of 16 output columns, K rows of 16 floats:
 * packed[(j * K + k) * 16 + c] = W[16j + c][k].
 *
 * Arithmetic order, per output element: one fused multiply-add chain over k = 0, 1, ..., K-1 from 0,
 * then + bias. It depends on K alone: a row's result is the same whatever other rows are in the call
 * (tested), not the same bits as F.linear. (The chunks below only park the running sum in memory
 * between k = 64c + 63 and 64c + 64: exact, the chain is unchanged.)
 *
 * Loop order, and why: threads (torch's OpenMP runtime) split the column blocks evenly; each thread
 * takes 2 blocks at a time and up to 48 rows at a time, in row groups of up to 12 (24 accumulators).
 * K is walked in chunks of 64: every row group runs over one chunk before the next chunk, so a
 * chunk's weights (8 KB) are read from memory once and from L1 by the other row groups, and the
 * memory is read evenly through the whole computation; the first row group prefetches the weights
 * 2 KB ahead. (Row groups over the whole K, the earlier order, left the memory idle while the later
 * groups re-read the blocks from L2: 16 rows took ~1.5x the time the weight stream needs.)
 * Callers guarantee N % 16 == 0.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#define ROWS 12       /* rows per register block */
#define M_ITEM 48     /* rows sharing one pass over a pair of column blocks */
#define K_CHUNK 64    /* k per chunk */
#define PREFETCH 2048 /* bytes ahead in each block's stream */

void f32_pack(const float *weight, float *packed, int64_t n, int64_t k) {
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n / 16; j++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < 16; c++)
                packed[(j * k + kk) * 16 + c] = weight[(j * 16 + c) * k + kk];
}

/* rows x (1 or 2 blocks of 16 columns) over k in [k0, k1): the sums start at 0 (k0 = 0) or from keep, and go
 * back to keep or, at k1 = K, plus the bias to out; rows, two_blocks and prefetch are constants after inlining */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, const float *bias, float *out,
                                                        int64_t n, int64_t k, int64_t col, const int rows,
                                                        const int two_blocks, const int prefetch, int64_t k0,
                                                        int64_t k1, __m512 *keep) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 1 + two_blocks; h++)
            acc[r][h] = k0 ? keep[r * 2 + h] : _mm512_setzero_ps();
    const float *w1 = w + k * 16;
    for (int64_t kk = k0; kk < k1; kk++) {
        if (prefetch) {
            _mm_prefetch((const char *)(w + kk * 16) + PREFETCH, _MM_HINT_T0);
            if (two_blocks)
                _mm_prefetch((const char *)(w1 + kk * 16) + PREFETCH, _MM_HINT_T0);
        }
        const __m512 a = _mm512_loadu_ps(w + kk * 16);
        const __m512 b = two_blocks ? _mm512_loadu_ps(w1 + kk * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * k + kk]);
            acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
            if (two_blocks)
                acc[r][1] = _mm512_fmadd_ps(xv, b, acc[r][1]);
        }
    }
    if (k1 < k) {
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < 1 + two_blocks; h++)
                keep[r * 2 + h] = acc[r][h];
        return;
    }
    for (int half = 0; half < 1 + two_blocks; half++) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + col + 16 * half) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm512_storeu_ps(out + r * n + col + 16 * half, _mm512_add_ps(acc[r][half], bv));
    }
}

#define CALL(R, TWO) \
    (prefetch ? block(x, w, bias, out, n, k, col, R, TWO, 1, k0, k1, keep) \
              : block(x, w, bias, out, n, k, col, R, TWO, 0, k0, k1, keep))
#define CASE(R)        \
    case R:            \
        if (two)       \
            CALL(R, 1); \
        else           \
            CALL(R, 0); \
        break;

static void dispatch(const float *x, const float *w, const float *bias, float *out, int64_t n, int64_t k,
                     int64_t col, int rows, int two, int prefetch, int64_t k0, int64_t k1, __m512 *keep) {
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
    }
}

void f32_linear(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n, int64_t k) {
    const int64_t blocks = n / 16;
    #pragma omp parallel
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = blocks * me / threads, end = blocks * (me + 1) / threads;
        __m512 keep[M_ITEM / ROWS][ROWS * 2];
        for (int64_t j = first; j < end; j += 2) {
            const int two = end - j >= 2;
            const float *w = packed + j * k * 16;
            for (int64_t i0 = 0; i0 < m; i0 += M_ITEM) {
                const int64_t i1 = m - i0 < M_ITEM ? m : i0 + M_ITEM;
                for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK) {
                    const int64_t k1 = k - k0 < K_CHUNK ? k : k0 + K_CHUNK;
                    for (int64_t m0 = i0; m0 < i1; m0 += ROWS) {
                        const int rows = i1 - m0 < ROWS ? (int)(i1 - m0) : ROWS;
                        dispatch(x + m0 * k, w, bias, out + m0 * n, n, k, j * 16, rows, two, m0 == 0, k0, k1,
                                 keep[(m0 - i0) / ROWS]);
                    }
                }
            }
        }
    }
}
