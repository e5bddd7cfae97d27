/* Decode attention straight from the paged KV cache (lockstep/ops/paged_attention.py).
 *
 * One query token per sequence: q [B, H, D]; keys/values live in block pools [blocks, block_size,
 * Hkv, D] and sequence b's context position s is row (tables[b][s / block_size], s % block_size).
 * Query b attends context positions 0..positions[b]. out [B, H, D]. Optional (GPT-OSS): sinks [H]
 * (fp32 logits, NULL for none) join every softmax denominator and attend to nothing; window > 0 limits
 * query b to its last `window` positions (lo = positions[b] + 1 - window on), so blocks before lo are
 * never read (they may be the null block).
 *
 * Why: the generic path gathers every sequence's context into a contiguous [B, Hkv, S, D] copy per
 * layer and then runs SDPA on it; at decode sizes both are per-call overhead more than arithmetic.
 * Here each (sequence, kv head) task reads its keys and values once, in place, for all the query
 * heads that share them (grouped-query attention), and writes its heads' outputs.
 *
 * Arithmetic: fp32 throughout (bf16 inputs widened exactly). Scores: q . k * scale, the dot product in
 * 16 lanes by d mod 16 then the lanes summed in order; softmax with the row maximum subtracted;
 * out = sum_s p_s v_s / sum_s p_s, accumulated in position order; bf16 outputs rounded to nearest
 * even. D must be a multiple of 16 (the caller checks). Tasks run on torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define LANES 16

static inline float widen_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* element i of a bf16 (is_bf16) or fp32 array, as fp32 */
static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? widen_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float dot(const float *q, const void *k, int64_t at, int64_t d, int is_bf16) {
    float lane[LANES] = {0};
    for (int64_t d0 = 0; d0 < d; d0 += LANES)
        for (int l = 0; l < LANES; l++)
            lane[l] += q[d0 + l] * load(k, at + d0 + l, is_bf16);
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++)
        sum += lane[l];
    return sum;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 elements of a bf16 (is_bf16) or fp32 array as fp32 lanes */
static inline __m512 load16(const void *p, int64_t i, int is_bf16) {
    if (is_bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}

/* exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial after x = n ln2 + r,
 * then scaled by 2^n; within 2 ulp of expf, and 0 below -87. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

#define MAX_GROUPS 16
#define MAX_TASK_HEADS 32
#define MAX_CHUNKS 16 /* head dims up to 256 */

/* One task: sequence b, kv heads kv0 .. kv0 + kv_count - 1 (adjacent in a pool row, so a task with
 * every kv head reads each context row as one contiguous run). groups and chunks are compile-time
 * constants in the common cases (attend_avx512 dispatches), so the loops over them unroll. */
static inline __attribute__((always_inline)) void attend_task(
        const void *q, const void *k_pool, const void *v_pool, const int64_t *table, int64_t lo, int64_t n,
        void *out, int64_t b, int64_t kv0, int64_t kv_count, int64_t heads, int64_t kv_heads, int64_t d,
        int64_t block_size, float scale, int is_bf16, const float *sinks, const int64_t groups,
        const int64_t chunks) {
    const int64_t rows = kv_count * groups, head0 = b * heads + kv0 * groups, row_stride = kv_heads * d;
    const int64_t m = n - lo; /* keys lo .. n - 1, scores stored from 0 */
    const int64_t stride = (m + LANES - 1) / LANES * LANES;
    float *scores = malloc(sizeof(float) * (size_t)(rows * stride));
    __m512 qv[MAX_TASK_HEADS][MAX_CHUNKS], acc[MAX_TASK_HEADS][MAX_CHUNKS];
    for (int64_t h = 0; h < rows; h++)
        for (int64_t c = 0; c < chunks; c++) {
            qv[h][c] = _mm512_mul_ps(load16(q, (head0 + h) * d + c * LANES, is_bf16), _mm512_set1_ps(scale));
            acc[h][c] = _mm512_setzero_ps();
        }
    for (int64_t s = lo, row = table[lo / block_size] * block_size + lo % block_size; s < n; s++, row++) {
        if (s % block_size == 0)
            row = table[s / block_size] * block_size;
        for (int64_t kv = 0; kv < kv_count; kv++) {
            const int64_t at = row * row_stride + (kv0 + kv) * d;
            __m512 lane[MAX_GROUPS];
            for (int64_t g = 0; g < groups; g++)
                lane[g] = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                __m512 kc = load16(k_pool, at + c * LANES, is_bf16);
                for (int64_t g = 0; g < groups; g++)
                    lane[g] = _mm512_fmadd_ps(qv[kv * groups + g][c], kc, lane[g]);
            }
            for (int64_t g = 0; g < groups; g++)
                scores[(kv * groups + g) * stride + s - lo] = _mm512_reduce_add_ps(lane[g]);
        }
    }
    float total[MAX_TASK_HEADS];
    for (int64_t h = 0; h < rows; h++) {
        float *row_scores = scores + h * stride, top = row_scores[0];
        for (int64_t s = 1; s < m; s++)
            top = row_scores[s] > top ? row_scores[s] : top;
        const float sink = sinks ? sinks[kv0 * groups + h] : 0.0f;
        if (sinks && sink > top)
            top = sink;
        __m512 sum = _mm512_setzero_ps(), topv = _mm512_set1_ps(top);
        for (int64_t s0 = 0; s0 < m; s0 += LANES) {
            __mmask16 live = m - s0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (m - s0)) - 1);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row_scores + s0), topv));
            e = _mm512_maskz_mov_ps(live, e);
            _mm512_storeu_ps(row_scores + s0, e);
            sum = _mm512_add_ps(sum, e);
        }
        total[h] = _mm512_reduce_add_ps(sum) + (sinks ? expf(sink - top) : 0.0f);
    }
    for (int64_t s = lo, row = table[lo / block_size] * block_size + lo % block_size; s < n; s++, row++) {
        if (s % block_size == 0)
            row = table[s / block_size] * block_size;
        for (int64_t kv = 0; kv < kv_count; kv++) {
            const int64_t at = row * row_stride + (kv0 + kv) * d;
            for (int64_t c = 0; c < chunks; c++) {
                __m512 vc = load16(v_pool, at + c * LANES, is_bf16);
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t h = kv * groups + g;
                    acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h * stride + s - lo]), vc, acc[h][c]);
                }
            }
        }
    }
    for (int64_t h = 0; h < rows; h++) {
        __m512 inv = _mm512_set1_ps(1.0f / total[h]);
        for (int64_t c = 0; c < chunks; c++) {
            __m512 o = _mm512_mul_ps(acc[h][c], inv);
            const int64_t at = (head0 + h) * d + c * LANES;
            if (is_bf16) {
                float lanes[LANES];
                _mm512_storeu_ps(lanes, o);
                for (int l = 0; l < LANES; l++)
                    ((uint16_t *)out)[at + l] = round_bf16(lanes[l]);
            } else {
                _mm512_storeu_ps((float *)out + at, o);
            }
        }
    }
    free(scores);
}

static inline __attribute__((always_inline)) void attend_fixed(
        const void *q, const void *k_pool, const void *v_pool, const int64_t *tables, const int64_t *positions,
        void *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size,
        int64_t table_width, float scale, int is_bf16, const float *sinks, int64_t window, const int64_t groups,
        const int64_t chunks) {
    /* whole rows per task when there are sequences enough to keep every thread busy */
    int64_t kv_per_task = batch >= 2 * omp_get_max_threads() ? kv_heads : 1;
    while (kv_per_task > 1 && (kv_heads % kv_per_task || kv_per_task * groups > MAX_TASK_HEADS))
        kv_per_task--;
    const int64_t per_seq = kv_heads / kv_per_task;
    #pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < batch * per_seq; task++) {
        const int64_t b = task / per_seq, kv0 = task % per_seq * kv_per_task;
        int64_t n = positions[b] + 1;
        if (n > block_size * table_width)
            n = block_size * table_width;
        if (n < 1)
            n = 1;
        const int64_t lo = window > 0 && n > window ? n - window : 0;
        attend_task(q, k_pool, v_pool, tables + b * table_width, lo, n, out, b, kv0, kv_per_task, heads, kv_heads,
                    d, block_size, scale, is_bf16, sinks, groups, chunks);
    }
}

static void attend_avx512(const void *q, const void *k_pool, const void *v_pool, const int64_t *tables,
                          const int64_t *positions, void *out, int64_t batch, int64_t heads, int64_t kv_heads,
                          int64_t d, int64_t block_size, int64_t table_width, float scale, int is_bf16,
                          const float *sinks, int64_t window) {
    const int64_t groups = heads / kv_heads, chunks = d / LANES;
#define FIXED(G, C)                                                                                         \
    if (groups == G && chunks == C) {                                                                       \
        if (is_bf16)                                                                                        \
            attend_fixed(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, d, block_size,  \
                         table_width, scale, 1, sinks, window, G, C);                                       \
        else                                                                                                \
            attend_fixed(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, d, block_size,  \
                         table_width, scale, 0, sinks, window, G, C);                                       \
        return;                                                                                             \
    }
    FIXED(1, 4) FIXED(2, 4) FIXED(3, 4) FIXED(4, 4) FIXED(1, 8) FIXED(2, 8) FIXED(4, 8) FIXED(8, 8)
#undef FIXED
    attend_fixed(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, d, block_size, table_width,
                 scale, is_bf16, sinks, window, groups, chunks);
}
#endif

static inline void attend(const void *q, const void *k_pool, const void *v_pool, const int64_t *tables,
                          const int64_t *positions, void *out, int64_t batch, int64_t heads, int64_t kv_heads,
                          int64_t d, int64_t block_size, int64_t table_width, float scale, int is_bf16,
                          const float *sinks, int64_t window) {
    const int64_t groups = heads / kv_heads;
    #pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        const int64_t b = task / kv_heads, kvh = task % kv_heads;
        int64_t n = positions[b] + 1;
        if (n > block_size * table_width)
            n = block_size * table_width;
        if (n < 1)
            n = 1;
        const int64_t lo = window > 0 && n > window ? n - window : 0;
        float *qf = malloc(sizeof(float) * (size_t)(groups * (2 * d + n)));
        float *acc = qf + groups * d, *scores = acc + groups * d;
        const int64_t head0 = b * heads + kvh * groups;
        for (int64_t g = 0; g < groups; g++)
            for (int64_t i = 0; i < d; i++)
                qf[g * d + i] = load(q, (head0 + g) * d + i, is_bf16) * scale;
        for (int64_t s = lo; s < n; s++) {
            const int64_t row = tables[b * table_width + s / block_size] * block_size + s % block_size;
            const int64_t at = (row * kv_heads + kvh) * d;
            for (int64_t g = 0; g < groups; g++)
                scores[g * n + s] = dot(qf + g * d, k_pool, at, d, is_bf16);
        }
        for (int64_t g = 0; g < groups; g++) {
            float *row_scores = scores + g * n, top = row_scores[lo], total = 0.0f;
            const float sink = sinks ? sinks[kvh * groups + g] : 0.0f;
            for (int64_t s = lo + 1; s < n; s++)
                top = row_scores[s] > top ? row_scores[s] : top;
            if (sinks && sink > top)
                top = sink;
            for (int64_t s = lo; s < n; s++) {
                row_scores[s] = expf(row_scores[s] - top);
                total += row_scores[s];
            }
            if (sinks)
                total += expf(sink - top);
            for (int64_t s = lo; s < n; s++)
                row_scores[s] /= total;
        }
        memset(acc, 0, sizeof(float) * (size_t)(groups * d));
        for (int64_t s = lo; s < n; s++) {
            const int64_t row = tables[b * table_width + s / block_size] * block_size + s % block_size;
            const int64_t at = (row * kv_heads + kvh) * d;
            for (int64_t g = 0; g < groups; g++) {
                const float p = scores[g * n + s];
                for (int64_t i = 0; i < d; i++)
                    acc[g * d + i] += p * load(v_pool, at + i, is_bf16);
            }
        }
        for (int64_t g = 0; g < groups; g++)
            for (int64_t i = 0; i < d; i++) {
                const int64_t o = (head0 + g) * d + i;
                if (is_bf16)
                    ((uint16_t *)out)[o] = round_bf16(acc[g * d + i]);
                else
                    ((float *)out)[o] = acc[g * d + i];
            }
        free(qf);
    }
}

/* is_bf16: q, pools and out are bf16 (else fp32); sinks: NULL or [heads] fp32; window: 0 for none */
void paged_decode_attention(const void *q, const void *k_pool, const void *v_pool, const int64_t *tables,
                            const int64_t *positions, void *out, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t d, int64_t block_size, int64_t table_width, float scale, int is_bf16,
                            const float *sinks, int64_t window) {
#ifdef __AVX512F__
    if (heads / kv_heads <= MAX_GROUPS && d / LANES <= MAX_CHUNKS) {
        attend_avx512(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, d, block_size, table_width,
                      scale, is_bf16, sinks, window);
        return;
    }
#endif
    if (is_bf16) /* literal flags: each call inlines a copy of attend() without the per-element branch */
        attend(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, d, block_size, table_width, scale, 1,
               sinks, window);
    else
        attend(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, d, block_size, table_width, scale, 0,
               sinks, window);
}
