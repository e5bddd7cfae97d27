/* fp32 linear for decode-sized calls on AVX-512 (lockstep/ops/f32_linear.py).
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
 * (tested), not the same bits as F.linear. Threads (torch's OpenMP runtime) split the column
 * blocks evenly; each thread takes 2 blocks and up to 12 rows at a time (24 accumulators).
 * Callers guarantee N % 16 == 0.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#define ROWS 12

void f32_pack(const float *weight, float *packed, int64_t n, int64_t k) {
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n / 16; j++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < 16; c++)
                packed[(j * k + kk) * 16 + c] = weight[(j * 16 + c) * k + kk];
}

/* rows x (1 or 2 blocks of 16 columns); rows and two_blocks are constants after inlining */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, const float *bias, float *out,
                                                        int64_t n, int64_t k, int64_t col, const int rows,
                                                        const int two_blocks) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *w1 = w + k * 16;
    for (int64_t kk = 0; kk < k; kk++) {
        const __m512 a = _mm512_loadu_ps(w + kk * 16);
        const __m512 b = two_blocks ? _mm512_loadu_ps(w1 + kk * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * k + kk]);
            acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
            if (two_blocks)
                acc[r][1] = _mm512_fmadd_ps(xv, b, acc[r][1]);
        }
    }
    for (int half = 0; half < 1 + two_blocks; half++) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + col + 16 * half) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm512_storeu_ps(out + r * n + col + 16 * half, _mm512_add_ps(acc[r][half], bv));
    }
}

#define CASE(R)                                                                          \
    case R:                                                                              \
        if (two)                                                                         \
            block(x, w, bias, out, n, k, col, R, 1);                                     \
        else                                                                             \
            block(x, w, bias, out, n, k, col, R, 0);                                     \
        break;

static void dispatch(const float *x, const float *w, const float *bias, float *out, int64_t n, int64_t k,
                     int64_t col, int rows, int two) {
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
        for (int64_t j = first; j < end; j += 2) {
            const int two = end - j >= 2;
            for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
                const int rows = m - m0 < ROWS ? (int)(m - m0) : ROWS;
                dispatch(x + m0 * k, packed + j * k * 16, bias, out + m0 * n, n, k, j * 16, rows, two);
            }
        }
    }
}
