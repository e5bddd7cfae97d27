/* Batch-invariant fp32 linear out[m, n] = sum_k x[m, k] * w[n, k] (lockstep.ops.bi_kernel).
 *
 * Reads nn.Linear's weight [N, K] where it lies (no transposed copy, no packing, no cache): both x's
 * rows and w's rows are contiguous in k, so each output is a dot product of two contiguous rows.
 * The arithmetic order of every output element is fixed by K alone (compiled like bi_attention.c:
 * no -ffast-math, -ffp-contract=off, explicit fused multiply-adds):
 *   lane l (0..15) = fma-chain over k = l, l+16, l+32, ... < K16 (K16 = K rounded down to 16),
 *                    starting from +0
 *   then for k = K16 + l < K (the tail): lane l = fma(x[k], w[k], lane l)
 *   out = ((lanes 0..7 + 8..15) pairwise: a[i] + a[i+8], then + a[i+4], + a[i+2], + a[i+1])
 * whatever M, the row's place, the other rows, the register block that computes it and the thread.
 * An fma is one correctly rounded IEEE operation, so the AVX-512 path and the portable path give
 * the same bits.
 */
#include <math.h>
#include <stdint.h>

#define L 16 /* lanes: k mod 16 */

/* The lanes a[L] of one output after the full chunks: the tail k16 <= k < K (lane k - k16), then the
   fixed pairwise tree; x and w are the output's row of x and row of w. */
static inline float tail_and_tree(float *restrict a, const float *restrict x, const float *restrict w, int64_t k16,
                                  int64_t k) {
    for (int64_t kk = k16; kk < k; kk++) a[kk - k16] = fmaf(x[kk], w[kk], a[kk - k16]);
    for (int h = L / 2; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) a[i] = a[i] + a[i + h];
    return a[0];
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

/* R rows of x times C rows of w over the full 16-lane chunks, then tail and tree in scalar. */
static inline __attribute__((always_inline)) void tile(const int R, const int C, const float *restrict x,
                                                       const float *restrict w, int64_t k, float *restrict out,
                                                       int64_t ldo) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t k16 = k / L * L;
    for (int64_t kk = 0; kk < k16; kk += L) {
        __m512 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm512_loadu_ps(x + r * k + kk);
        for (int c = 0; c < C; c++) {
            __m512 wv = _mm512_loadu_ps(w + c * k + kk);
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    if (k16 == k) { /* the same tree as below, four vector adds per output */
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                __m512 v = acc[r][c];
                __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
                __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
                __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
                out[r * ldo + c] = _mm_cvtss_f32(s1);
            }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float a[L];
            _mm512_storeu_ps(a, acc[r][c]);
            out[r * ldo + c] = tail_and_tree(a, x + r * k, w + c * k, k16, k);
        }
}
#else
static inline __attribute__((always_inline)) void tile(const int R, const int C, const float *restrict x,
                                                       const float *restrict w, int64_t k, float *restrict out,
                                                       int64_t ldo) {
    float acc[4][4][L];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int l = 0; l < L; l++) acc[r][c][l] = 0.0f;
    const int64_t k16 = k / L * L;
    for (int64_t kk = 0; kk < k16; kk += L)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
#pragma omp simd
                for (int l = 0; l < L; l++) acc[r][c][l] = fmaf(x[r * k + kk + l], w[c * k + kk + l], acc[r][c][l]);
            }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r * ldo + c] = tail_and_tree(acc[r][c], x + r * k, w + c * k, k16, k);
}
#endif

static void tile_4x4(const float *x, const float *w, int64_t k, float *out, int64_t ldo) { tile(4, 4, x, w, k, out, ldo); }
static void tile_1x4(const float *x, const float *w, int64_t k, float *out, int64_t ldo) { tile(1, 4, x, w, k, out, ldo); }
static void tile_4x1(const float *x, const float *w, int64_t k, float *out, int64_t ldo) { tile(4, 1, x, w, k, out, ldo); }
static void tile_1x1(const float *x, const float *w, int64_t k, float *out, int64_t ldo) { tile(1, 1, x, w, k, out, ldo); }

#define M_CHUNK 64  /* rows of x kept hot while a panel of w streams past */
#define N_PANEL 64  /* rows of w per parallel work item */

/* x [M, K], w [N, K], out [M, N]; all contiguous. */
void bi_linear(const float *x, const float *w, float *out, int64_t m, int64_t n, int64_t k) {
    const int64_t chunks = (m + M_CHUNK - 1) / M_CHUNK, panels = (n + N_PANEL - 1) / N_PANEL;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t ch = 0; ch < chunks; ch++)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t m0 = ch * M_CHUNK, m1 = m0 + M_CHUNK < m ? m0 + M_CHUNK : m;
            const int64_t n0 = p * N_PANEL, n1 = n0 + N_PANEL < n ? n0 + N_PANEL : n;
            int64_t j = n0;
            for (; j + 4 <= n1; j += 4) {
                int64_t i = m0;
                for (; i + 4 <= m1; i += 4) tile_4x4(x + i * k, w + j * k, k, out + i * n + j, n);
                for (; i < m1; i++) tile_1x4(x + i * k, w + j * k, k, out + i * n + j, n);
            }
            for (; j < n1; j++) {
                int64_t i = m0;
                for (; i + 4 <= m1; i += 4) tile_4x1(x + i * k, w + j * k, k, out + i * n + j, n);
                for (; i < m1; i++) tile_1x1(x + i * k, w + j * k, k, out + i * n + j, n);
            }
        }
}
