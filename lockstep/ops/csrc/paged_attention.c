/* Decode attention straight from the paged KV cache (lockstep/ops/paged_attention.py).
 *
 * One query token per sequence: q [B, H, D]; keys/values live in block pools, logically [blocks,
 * block_size, Hkv, D] with any strides but a contiguous D (struct layout: the engine's pools are
 * head-major, [Hkv, blocks, block_size, D], so a kv head's rows in consecutive blocks form one run),
 * and sequence b's context position s is row (tables[b][s / block_size], s % block_size).
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
 * Arithmetic: fp32 throughout (bf16 inputs widened exactly). Scores: (q * scale) . k, the dot product
 * in 16 lanes by d mod 16, then the 16 lanes summed: in lane order (portable build), or pairwise for
 * 16 positions at once (AVX-512: sum_lanes16, a transposed reduction with about a third of the
 * instructions of a horizontal sum per key; the order differs, not the precision). Softmax with the
 * row maximum subtracted (AVX-512: a polynomial exp within 2 ulp of expf). out = sum_s p_s v_s
 * accumulated in position order, over sum_s p_s (portable: p_s divided first); bf16 outputs rounded
 * to nearest even. Close to SDPA over the gathered context, not its bits, and no caller asks for
 * bits (the batch-invariant backend never takes this kernel). The pools' strides change where rows
 * are read, not this order: every layout of the same values gives the same bits. D must be a multiple
 * of 16 (the caller checks). Tasks run on torch's OpenMP threads.
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

/* A query at `position` attends keys lo .. n - 1: n = position + 1 clamped to [1, capacity] (the table's
 * positions), lo = n - window under a sliding window (else 0). Returns n, writes lo. */
static inline int64_t context_range(int64_t position, int64_t capacity, int64_t window, int64_t *lo) {
    int64_t n = position + 1;
    if (n > capacity)
        n = capacity;
    if (n < 1)
        n = 1;
    *lo = window > 0 && n > window ? n - window : 0;
    return n;
}

/* Where row r (0 .. block_size - 1) of kv head h in pool block t starts, in elements:
 * t * block_stride + r * row_stride + h * head_stride; its d elements are contiguous. K and V share it. */
struct layout {
    int64_t d, block_size, block_stride, row_stride, head_stride;
};

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
#define MAX_CHUNKS 16 /* head dims up to 256 */

/* The next task's rows (each kv head's keys, then its values), prefetched into L2 one row per row the
 * current task reads: a steady trickle a whole task ahead. In a decode step the weights' stream has
 * evicted the pools, and the hardware prefetcher starts late on each task's runs; asking for whole
 * blocks at once (two blocks ahead) recovered less of that wait. */
struct ahead {
    const char *pool[2];
    const int64_t *table;
    int64_t lo, n, s, block, left, at, kv, kv_end, which;
};

static inline void ahead_start(struct ahead *a, const struct layout *lay) {
    a->s = a->lo, a->block = a->lo / lay->block_size, a->left = lay->block_size - a->lo % lay->block_size;
    a->at = a->table[a->block] * lay->block_stride + a->kv * lay->head_stride + a->lo % lay->block_size * lay->row_stride;
}

static inline void ahead_step(struct ahead *a, const struct layout *lay, int64_t elem) {
    if (a->kv >= a->kv_end)
        return;
    const char *p = a->pool[a->which] + a->at * elem;
    for (int64_t off = 0; off < lay->d * elem; off += 64)
        _mm_prefetch(p + off, _MM_HINT_T1);
    a->at += lay->row_stride;
    if (++a->s == a->n) {
        if (++a->which == 2)
            a->which = 0, a->kv++;
        if (a->kv < a->kv_end)
            ahead_start(a, lay);
    } else if (--a->left == 0) {
        a->at = a->table[++a->block] * lay->block_stride + a->kv * lay->head_stride, a->left = lay->block_size;
    }
}

/* v[j] -> the sum of v[j]'s 16 lanes, as lane j of the result (a transposed reduction: 45 instructions
 * for the 16 sums, where a horizontal sum takes about 8 per vector). Each 128-bit quarter sums as
 * (l0 + l2) + (l1 + l3), then the quarters as (q0 + q1) + (q2 + q3). */
static inline __m512 sum_lanes16(const __m512 v[LANES]) {
    __m512 two[8], four[4], eight[2];
    for (int i = 0; i < 8; i++)
        two[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        four[i] = _mm512_add_ps(_mm512_shuffle_ps(two[2 * i], two[2 * i + 1], 0x44),
                                _mm512_shuffle_ps(two[2 * i], two[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++)
        eight[i] = _mm512_add_ps(_mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(eight[0], eight[1], 0x88),
                         _mm512_shuffle_f32x4(eight[0], eight[1], 0xdd));
}

/* One task: sequence b, kv heads kv0 .. kv0 + kv_count - 1, one kv head at a time (its query heads'
 * q and accumulators then fit in registers). groups, chunks and is_bf16 are literals in the common
 * cases (the task_G_C_BF functions below), so the loops over them unroll. */
static inline __attribute__((always_inline)) void attend_task(
        const void *q, const void *k_pool, const void *v_pool, const int64_t *table, int64_t lo, int64_t n,
        void *out, int64_t b, int64_t kv0, int64_t kv_count, int64_t heads, const struct layout *lay,
        float scale, int is_bf16, const float *sinks, const int64_t groups, const int64_t chunks, float *scores,
        struct ahead *next) {
    const int64_t d = lay->d, block_size = lay->block_size, block_stride = lay->block_stride;
    const int64_t row_stride = lay->row_stride, elem = is_bf16 ? 2 : 4;
    const int64_t m = n - lo; /* keys lo .. n - 1, scores stored from 0 */
    const int64_t stride = (m + LANES - 1) / LANES * LANES;
    for (int64_t kv = kv0; kv < kv0 + kv_count; kv++) {
        const int64_t head0 = b * heads + kv * groups;
        __m512 qv[MAX_GROUPS][MAX_CHUNKS], acc[MAX_GROUPS][MAX_CHUNKS], lane[MAX_GROUPS][LANES];
        for (int64_t g = 0; g < groups; g++)
            for (int64_t c = 0; c < chunks; c++) {
                qv[g][c] = _mm512_mul_ps(load16(q, (head0 + g) * d + c * LANES, is_bf16), _mm512_set1_ps(scale));
                acc[g][c] = _mm512_setzero_ps();
            }
        /* scores, 16 positions at a time; positions past n - 1 score 0 and are masked below */
        const int64_t head_at = kv * lay->head_stride;
        int64_t block = lo / block_size, left = block_size - lo % block_size; /* rows of this block still to read */
        int64_t at = table[block] * block_stride + head_at + lo % block_size * row_stride;
        for (int64_t s0 = lo; s0 < n; s0 += LANES) {
            for (int64_t j = 0; j < LANES; j++) {
                const int64_t s = s0 + j;
                for (int64_t g = 0; g < groups; g++)
                    lane[g][j] = _mm512_setzero_ps();
                if (s >= n)
                    continue;
                if (left == 0)
                    at = table[++block] * block_stride + head_at, left = block_size;
                left--;
                for (int64_t c = 0; c < chunks; c++) {
                    __m512 kc = load16(k_pool, at + c * LANES, is_bf16);
                    for (int64_t g = 0; g < groups; g++)
                        lane[g][j] = _mm512_fmadd_ps(qv[g][c], kc, lane[g][j]);
                }
                at += row_stride;
                ahead_step(next, lay, elem);
            }
            for (int64_t g = 0; g < groups; g++)
                _mm512_storeu_ps(scores + g * stride + s0 - lo, sum_lanes16(lane[g]));
        }
        float total[MAX_GROUPS];
        for (int64_t g = 0; g < groups; g++) {
            float *row_scores = scores + g * stride;
            __m512 topv = _mm512_set1_ps(-INFINITY);
            for (int64_t s0 = 0; s0 < m; s0 += LANES) {
                __mmask16 live = m - s0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (m - s0)) - 1);
                topv = _mm512_mask_max_ps(topv, live, topv, _mm512_loadu_ps(row_scores + s0));
            }
            float top = _mm512_reduce_max_ps(topv);
            const float sink = sinks ? sinks[kv * groups + g] : 0.0f;
            if (sinks && sink > top)
                top = sink;
            __m512 sum = _mm512_setzero_ps();
            topv = _mm512_set1_ps(top);
            for (int64_t s0 = 0; s0 < m; s0 += LANES) {
                __mmask16 live = m - s0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (m - s0)) - 1);
                __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row_scores + s0), topv));
                e = _mm512_maskz_mov_ps(live, e);
                _mm512_storeu_ps(row_scores + s0, e);
                sum = _mm512_add_ps(sum, e);
            }
            total[g] = _mm512_reduce_add_ps(sum) + (sinks ? expf(sink - top) : 0.0f);
        }
        block = lo / block_size, left = block_size - lo % block_size;
        at = table[block] * block_stride + head_at + lo % block_size * row_stride;
        for (int64_t s = lo; s < n; s++, at += row_stride, left--) {
            if (left == 0)
                at = table[++block] * block_stride + head_at, left = block_size;
            ahead_step(next, lay, elem);
            for (int64_t c = 0; c < chunks; c++) {
                __m512 vc = load16(v_pool, at + c * LANES, is_bf16);
                for (int64_t g = 0; g < groups; g++)
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * stride + s - lo]), vc, acc[g][c]);
            }
        }
        for (int64_t g = 0; g < groups; g++) {
            __m512 inv = _mm512_set1_ps(1.0f / total[g]);
            for (int64_t c = 0; c < chunks; c++) {
                __m512 o = _mm512_mul_ps(acc[g][c], inv);
                const int64_t at = (head0 + g) * d + c * LANES;
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
    }
}

typedef void (*task_fn)(const void *, const void *, const void *, const int64_t *, int64_t, int64_t, void *, int64_t,
                        int64_t, int64_t, int64_t, const struct layout *, float, int, const float *, int64_t, int64_t,
                        float *, struct ahead *);

/* attend_task with groups, chunks and the dtype as literals: a function each, called through a pointer
 * from the OpenMP loop (GCC outlines a parallel region before inlining, so constants passed into an
 * inlined function holding the region would not reach the loops inside it). */
#define TASK(G, C, BF)                                                                                     \
    static void task_##G##_##C##_##BF(const void *q, const void *k_pool, const void *v_pool, const int64_t *table, \
                                      int64_t lo, int64_t n, void *out, int64_t b, int64_t kv0, int64_t kv_count,  \
                                      int64_t heads, const struct layout *lay, float scale, int is_bf16,           \
                                      const float *sinks, int64_t groups, int64_t chunks, float *scores,           \
                                      struct ahead *next) {                                                        \
        (void)is_bf16, (void)groups, (void)chunks;                                                                 \
        attend_task(q, k_pool, v_pool, table, lo, n, out, b, kv0, kv_count, heads, lay, scale, BF, sinks, G, C,    \
                    scores, next);                                                                                 \
    }
#define FIXED_SHAPES(X) X(1, 4) X(2, 4) X(3, 4) X(4, 4) X(1, 8) X(2, 8) X(4, 8) X(8, 8)
#define TASKS(G, C) TASK(G, C, 0) TASK(G, C, 1)
FIXED_SHAPES(TASKS)
#undef TASKS

static void task_any(const void *q, const void *k_pool, const void *v_pool, const int64_t *table, int64_t lo,
                     int64_t n, void *out, int64_t b, int64_t kv0, int64_t kv_count, int64_t heads,
                     const struct layout *lay, float scale, int is_bf16, const float *sinks, int64_t groups,
                     int64_t chunks, float *scores, struct ahead *next) {
    attend_task(q, k_pool, v_pool, table, lo, n, out, b, kv0, kv_count, heads, lay, scale, is_bf16, sinks, groups,
                chunks, scores, next);
}

static void attend_avx512(const void *q, const void *k_pool, const void *v_pool, const int64_t *tables,
                          const int64_t *positions, void *out, int64_t batch, int64_t heads, int64_t kv_heads,
                          const struct layout *lay, int64_t table_width, float scale, int is_bf16,
                          const float *sinks, int64_t window) {
    const int64_t groups = heads / kv_heads, chunks = lay->d / LANES, block_size = lay->block_size;
    task_fn task_body = task_any;
#define PICK(G, C)                                                                                          \
    if (groups == G && chunks == C)                                                                         \
        task_body = is_bf16 ? task_##G##_##C##_1 : task_##G##_##C##_0;
    FIXED_SHAPES(PICK)
#undef PICK
    /* whole rows per task when there are sequences enough to keep every thread busy */
    const int64_t kv_per_task = batch >= 2 * omp_get_max_threads() ? kv_heads : 1, per_seq = kv_heads / kv_per_task;
    const int64_t longest = (block_size * table_width + LANES - 1) / LANES * LANES;
    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(groups * longest)); /* one per thread */
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * per_seq; task++) {
            const int64_t b = task / per_seq, kv0 = task % per_seq * kv_per_task;
            int64_t lo;
            const int64_t n = context_range(positions[b], block_size * table_width, window, &lo);
            struct ahead next = {{k_pool, v_pool}, NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0};
            if (task + 1 < batch * per_seq) {
                const int64_t b1 = (task + 1) / per_seq;
                next.table = tables + b1 * table_width;
                next.n = context_range(positions[b1], block_size * table_width, window, &next.lo);
                next.kv = (task + 1) % per_seq * kv_per_task, next.kv_end = next.kv + kv_per_task;
                ahead_start(&next, lay);
            }
            task_body(q, k_pool, v_pool, tables + b * table_width, lo, n, out, b, kv0, kv_per_task, heads, lay, scale,
                      is_bf16, sinks, groups, chunks, scores, &next);
        }
        free(scores);
    }
}
#endif

static inline void attend(const void *q, const void *k_pool, const void *v_pool, const int64_t *tables,
                          const int64_t *positions, void *out, int64_t batch, int64_t heads, int64_t kv_heads,
                          const struct layout *lay, int64_t table_width, float scale, int is_bf16,
                          const float *sinks, int64_t window) {
    const int64_t groups = heads / kv_heads, d = lay->d, block_size = lay->block_size;
    #pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        const int64_t b = task / kv_heads, kvh = task % kv_heads;
        int64_t lo;
        const int64_t n = context_range(positions[b], block_size * table_width, window, &lo);
        float *qf = malloc(sizeof(float) * (size_t)(groups * (2 * d + n)));
        float *acc = qf + groups * d, *scores = acc + groups * d;
        const int64_t head0 = b * heads + kvh * groups;
        for (int64_t g = 0; g < groups; g++)
            for (int64_t i = 0; i < d; i++)
                qf[g * d + i] = load(q, (head0 + g) * d + i, is_bf16) * scale;
        for (int64_t s = lo; s < n; s++) {
            const int64_t at = tables[b * table_width + s / block_size] * lay->block_stride
                               + s % block_size * lay->row_stride + kvh * lay->head_stride;
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
            const int64_t at = tables[b * table_width + s / block_size] * lay->block_stride
                               + s % block_size * lay->row_stride + kvh * lay->head_stride;
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

/* is_bf16: q, pools and out are bf16 (else fp32); strides in elements (struct layout); sinks: NULL or
 * [heads] fp32; window: 0 for none */
void paged_decode_attention(const void *q, const void *k_pool, const void *v_pool, const int64_t *tables,
                            const int64_t *positions, void *out, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t d, int64_t block_size, int64_t table_width, int64_t block_stride,
                            int64_t row_stride, int64_t head_stride, float scale, int is_bf16, const float *sinks,
                            int64_t window) {
    const struct layout lay = {d, block_size, block_stride, row_stride, head_stride};
#ifdef __AVX512F__
    if (heads / kv_heads <= MAX_GROUPS && d / LANES <= MAX_CHUNKS) {
        attend_avx512(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, &lay, table_width, scale,
                      is_bf16, sinks, window);
        return;
    }
#endif
    if (is_bf16) /* literal flags: each call inlines a copy of attend() without the per-element branch */
        attend(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, &lay, table_width, scale, 1, sinks,
               window);
    else
        attend(q, k_pool, v_pool, tables, positions, out, batch, heads, kv_heads, &lay, table_width, scale, 0, sinks,
               window);
}
