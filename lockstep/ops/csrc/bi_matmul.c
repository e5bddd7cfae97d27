/* Batch-invariant fp32 matmul out[m, n] = sum_k x[m, k] * wt[k, n] (lockstep.ops.bi_kernel).
 *
 * Compiled like bi_attention.c (no -ffast-math, -ffp-contract=off, explicit fmaf), so the source
 * order is the arithmetic order. Every output element is one fma chain over k = 0, 1, ..., K-1
 * starting from +0, whatever M, its row, its column block and the thread that computes it: the
 * vector lanes run over output columns, never over k, so nothing is reassociated.
 * Register blocking: RB rows x NB columns (RB = 4 where rows fill a block, else 1).
 */
#include <stdint.h>
#include <math.h>

#define NB 64 /* output columns per block; wt's columns are padded to a multiple of NB */

static inline __attribute__((always_inline)) void block(const int RB, const float *restrict x,
                                                        const float *restrict wt, int64_t k,
                                                        int64_t ldw, float *restrict out,
                                                        int64_t ldo, int64_t cols) {
    float acc[4][NB];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = 0.0f;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *restrict wk = wt + kk * ldw;
        for (int r = 0; r < RB; r++) {
            float xr = x[r * k + kk];
#pragma omp simd
            for (int c = 0; c < NB; c++) acc[r][c] = fmaf(xr, wk[c], acc[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < cols; c++) out[r * ldo + c] = acc[r][c];
}

static void block_4(const float *x, const float *wt, int64_t k, int64_t ldw, float *out,
                    int64_t ldo, int64_t cols) {
    block(4, x, wt, k, ldw, out, ldo, cols);
}

static void block_1(const float *x, const float *wt, int64_t k, int64_t ldw, float *out,
                    int64_t ldo, int64_t cols) {
    block(1, x, wt, k, ldw, out, ldo, cols);
}

#define M_CHUNK 64

/* x [M, K], wt [K, ldw] (ldw = N rounded up to NB, zero columns past N), out [M, N];
   all contiguous. */
void bi_matmul(const float *x, const float *wt, float *out, int64_t m, int64_t n, int64_t k,
               int64_t ldw) {
    int64_t panels = (n + NB - 1) / NB, chunks = (m + M_CHUNK - 1) / M_CHUNK;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t ch = 0; ch < chunks; ch++)
        for (int64_t p = 0; p < panels; p++) {
            int64_t n0 = p * NB, cols = n - n0 < NB ? n - n0 : NB;
            int64_t m0 = ch * M_CHUNK, m1 = m0 + M_CHUNK < m ? m0 + M_CHUNK : m, i = m0;
            for (; i + 4 <= m1; i += 4) block_4(x + i * k, wt + n0, k, ldw, out + i * n + n0, n, cols);
            for (; i < m1; i++) block_1(x + i * k, wt + n0, k, ldw, out + i * n + n0, n, cols);
        }
}
