/* bf16 linear on Intel AMX tiles (lockstep/ops/decode_linear.py): the generation engine's decode steps and,
 * at isa level "amx", the batch-invariant bf16 linear.
 *
 * out[M, N] = x[M, K] @ W[N, K]^T (+ bias), products and sums in fp32, one bf16 rounding at the end
 * (round to nearest even, as every bf16 GEMM here).
 *
 * Why: at decode sizes (a few to 64 rows) the product streams the weight once and does little
 * arithmetic, so its speed is how fast the weight is read. oneDNN's prepacked linear reads
 * SmolLM2's weights at 20-33 GB/s; this kernel, on a layout where every thread reads one contiguous
 * stretch of 1 KB tiles, at 36-52 GB/s on the same host.
 *
 * Packed layout (bf16_pack, csrc/bf16_linear.c): for each block of 16 output columns, the K/32 tiles of that block one
 * after another; tile (n-block j, k-block b) holds W[16j + c][32b + 2r + i] at [r][c][i]
 * (16 rows of 16 column pairs), the B operand layout TDPBF16PS multiplies with.
 *
 * Arithmetic order, per output element: for k-block b = 0, 1, ... the tile instruction adds the 32
 * products of that block to the fp32 accumulator; then the bias is added in fp32 and the sum rounded
 * to bf16. It depends on K alone: a row's result is the same whatever other rows are in the call or
 * where it sits (tested), not the same bits as oneDNN's kernels.
 *
 * Threads (torch's OpenMP runtime, its thread count) split the column blocks evenly; each thread
 * works through its blocks 4 at a time (4 accumulator tiles, one x tile, 3 weight tiles: the 8 tile
 * registers), over rows 16 at a time (a second 16 rows re-reads those weight tiles from cache).
 * Callers guarantee K % 32 == 0 and N % 16 == 0.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX tile state only to processes that ask for it; 0 on success. */
int amx_request_permission(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tmm0: x (rows x 32 bf16); tmm1-3: weight tiles; tmm4-7: fp32 accumulators (rows x 16). */
static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (t == 0 || t >= 4) ? rows : 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static void write_rows(const float *acc, const float *bias, uint16_t *out, int64_t rows, int64_t n, int64_t col) {
    __m512 b = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; m++) {
        __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc + m * 16), b));
        _mm256_storeu_si256((__m256i *)(out + m * n + col), (__m256i)h);
    }
}

void amx_linear(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *out,
                int64_t m, int64_t n, int64_t k) {
    const int64_t kb = k / 32, blocks = n / 16, x_stride = k * 2;
    #pragma omp parallel
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = blocks * me / threads, end = blocks * (me + 1) / threads;
        float acc[4][16 * 16] __attribute__((aligned(64)));
        int configured = 0;
        for (int64_t j0 = first; j0 < end; j0 += 4) {
            const int64_t nj = end - j0 < 4 ? end - j0 : 4;
            const uint16_t *w = packed + j0 * kb * 512;
            for (int64_t m0 = 0; m0 < m; m0 += 16) {
                const int rows = m - m0 < 16 ? (int)(m - m0) : 16;
                if (rows != configured) {
                    configure(rows);
                    configured = rows;
                }
                const uint16_t *xa = x + m0 * k;
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                if (nj == 4) {
                    for (int64_t b = 0; b < kb; b++) {
                        _tile_loadd(0, xa + b * 32, x_stride);
                        _tile_loadd(1, w + b * 512, 64);
                        _tile_loadd(2, w + (kb + b) * 512, 64);
                        _tile_dpbf16ps(4, 0, 1);
                        _tile_loadd(3, w + (2 * kb + b) * 512, 64);
                        _tile_dpbf16ps(5, 0, 2);
                        _tile_loadd(1, w + (3 * kb + b) * 512, 64);
                        _tile_dpbf16ps(6, 0, 3);
                        _tile_dpbf16ps(7, 0, 1);
                    }
                } else {
                    for (int64_t b = 0; b < kb; b++) {
                        _tile_loadd(0, xa + b * 32, x_stride);
                        _tile_loadd(1, w + b * 512, 64);
                        _tile_dpbf16ps(4, 0, 1);
                        if (nj > 1) {
                            _tile_loadd(2, w + (kb + b) * 512, 64);
                            _tile_dpbf16ps(5, 0, 2);
                        }
                        if (nj > 2) {
                            _tile_loadd(3, w + (2 * kb + b) * 512, 64);
                            _tile_dpbf16ps(6, 0, 3);
                        }
                    }
                }
                _tile_stored(4, acc[0], 64);
                _tile_stored(5, acc[1], 64);
                _tile_stored(6, acc[2], 64);
                _tile_stored(7, acc[3], 64);
                for (int64_t j = 0; j < nj; j++)
                    write_rows(acc[j], bias, out + m0 * n, rows, n, (j0 + j) * 16);
            }
        }
        if (configured)
            _tile_release();
    }
}
