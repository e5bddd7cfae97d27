/* Batch-invariant causal attention forward, fp32 (lockstep.ops.bi_kernel).
 *
 * Every output row is computed by the same sequence of IEEE operations whatever the batch, the
 * row's neighbours, the context padding or the thread that runs it: compiled without -ffast-math
 * and with -ffp-contract=off (-fno-trapping-math only allows vectorising the exp), the compiler may
 * vectorise but not reorder or fuse, so the source order below *is* the arithmetic order. For a query row that sees keys 0..n-1 (key j at absolute
 * position j):
 *   s_j = scale * fma-chain over d of q[d] * k[d][j]       (d = 0, 1, ..., D-1, one accumulator)
 *   m   = max_j s_j                                          (exact in any order)
 *   p_j = exp(s_j - m)                                       (one polynomial, see exp_block)
 *   l   = 16 lanes by j mod 16, each summed in increasing j, then a fixed pairwise tree
 *   o_e = fma-chain over j of p_j * v[j][e]                  (j = 0, 1, ..., n-1)
 *   out = o_e / l
 * Rows are processed RB at a time (register blocking) and keys up to the largest n in the block;
 * a key a row cannot see gets p = +0, and adding +0 (or fma(+0, v, acc) with finite v) leaves an
 * accumulator unchanged bit for bit (accumulators start at +0, so they are never -0), so the block
 * size and its other rows do not matter. A sliding window (window > 0) hides keys j < n - window the
 * same way (key 0 stays visible with keep0: an attention sink placed there as a key); the row max
 * starts from the row's first visible key.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KB 16 /* lanes of the row sum and max (lane = key position mod KB) */
#define QB 32 /* keys per score block (s_pad is a multiple of it) */
#define EB 32 /* value columns per output block */

/* p[l] = exp(x[l]) for l < live, +0 for the rest, x <= 0 (Cephes expf: range reduction by ln 2,
   degree-5 polynomial, 2^n from its bits; ~1 ulp; +0 below -87, where exp underflows anyway
   relative to a row sum >= 1). Written over a whole lane block so that it vectorises. */
static inline void exp_block(const float *restrict x, int live, float *restrict p) {
    float y[KB], two_n[KB];
    int32_t bits[KB];
#pragma omp simd
    for (int l = 0; l < KB; l++) {
        float xc = x[l] < -87.0f ? -87.0f : x[l];
        float n = floorf(fmaf(xc, 1.44269504088896341f, 0.5f));
        float r = fmaf(n, -0.693359375f, xc);
        r = fmaf(n, 2.12194440e-4f, r);
        float e = 1.9875691500e-4f;
        e = fmaf(e, r, 1.3981999507e-3f);
        e = fmaf(e, r, 8.3334519073e-3f);
        e = fmaf(e, r, 4.1665795894e-2f);
        e = fmaf(e, r, 1.6666665459e-1f);
        e = fmaf(e, r, 5.0000001201e-1f);
        e = fmaf(e, r * r, r);
        y[l] = e + 1.0f;
        bits[l] = ((int32_t)n + 127) << 23;
    }
    memcpy(two_n, bits, sizeof(two_n));
#pragma omp simd
    for (int l = 0; l < KB; l++) p[l] = (l < live && x[l] >= -87.0f) ? y[l] * two_n[l] : 0.0f;
}

/* One block of RB consecutive rows of one (batch, kv head): q [RB, d], n[r] visible keys,
   kt [d, s_pad], v [s_pad, dv_pad], scores [RB, s_pad] scratch, out [RB, dv], lse [RB] or NULL. */
static inline __attribute__((always_inline)) void block(
    const int RB, const float *restrict q, const int64_t *restrict n, const int64_t *restrict lo, int keep0,
    const float *restrict kt, const float *restrict v, int64_t d, int64_t s_pad, int64_t dv, int64_t dv_pad,
    float scale, float *restrict scores, float *restrict out, float *restrict lse) {
    int64_t n_max = 0;
    for (int r = 0; r < RB; r++) n_max = n[r] > n_max ? n[r] : n_max;
    int64_t n_keys = (n_max + KB - 1) / KB * KB;
    for (int64_t jb = 0; jb < n_keys; jb += QB) {
        float acc[4][QB];
        for (int r = 0; r < RB; r++)
            for (int l = 0; l < QB; l++) acc[r][l] = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            const float *restrict kv = kt + i * s_pad + jb;
            for (int r = 0; r < RB; r++) {
                float qi = q[r * d + i];
                #pragma omp simd
                for (int l = 0; l < QB; l++) acc[r][l] = fmaf(qi, kv[l], acc[r][l]);
            }
        }
        for (int r = 0; r < RB; r++)
            #pragma omp simd
            for (int l = 0; l < QB; l++) scores[r * s_pad + jb + l] = acc[r][l] * scale;
    }
    float total[4];
    for (int r = 0; r < RB; r++) {
        float *restrict s = scores + r * s_pad;
        float lane_max[KB];
        const int64_t low = lo[r];
        for (int l = 0; l < KB; l++) lane_max[l] = s[keep0 ? 0 : low];
        for (int64_t jb = 0; jb < n_keys; jb += KB) {
            int64_t live = n[r] - jb;
            #pragma omp simd
            for (int l = 0; l < KB; l++)
                lane_max[l] = (l < live && (jb + l >= low || (keep0 && jb + l == 0)) && s[jb + l] > lane_max[l])
                                  ? s[jb + l] : lane_max[l];
        }
        float m = lane_max[0]; /* a max is exact in any order */
        for (int l = 1; l < KB; l++) m = lane_max[l] > m ? lane_max[l] : m;
        float lanes[KB];
        for (int l = 0; l < KB; l++) lanes[l] = 0.0f;
        for (int64_t jb = 0; jb < n_keys; jb += KB) {
            float x[KB];
            #pragma omp simd
            for (int l = 0; l < KB; l++) x[l] = (jb + l >= low || (keep0 && jb + l == 0)) ? s[jb + l] - m : -100.0f;
            int64_t live = n[r] - jb;
            exp_block(x, live < KB ? (int)live : KB, s + jb);
            #pragma omp simd
            for (int l = 0; l < KB; l++) lanes[l] += s[jb + l];
        }
        for (int w = KB / 2; w > 0; w /= 2)
            for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];
        total[r] = lanes[0];
        if (lse) lse[r] = m + logf(total[r]); /* for the backward only */
    }
    for (int64_t eb = 0; eb < dv_pad; eb += EB) {
        float o[4][EB];
        for (int r = 0; r < RB; r++)
            for (int e = 0; e < EB; e++) o[r][e] = 0.0f;
        for (int64_t j = 0; j < n_max; j++) {
            const float *restrict vj = v + j * dv_pad + eb;
            for (int r = 0; r < RB; r++) {
                float p = scores[r * s_pad + j];
                #pragma omp simd
                for (int e = 0; e < EB; e++) o[r][e] = fmaf(p, vj[e], o[r][e]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int e = 0; e < EB && eb + e < dv; e++) out[r * dv + eb + e] = o[r][e] / total[r];
    }
}

static void block_1(const float *restrict q, const int64_t *restrict n, const int64_t *restrict lo, int keep0,
                    const float *restrict kt, const float *restrict v, int64_t d, int64_t s_pad, int64_t dv,
                    int64_t dv_pad, float scale, float *restrict scores, float *restrict out, float *restrict lse) {
    block(1, q, n, lo, keep0, kt, v, d, s_pad, dv, dv_pad, scale, scores, out, lse);
}

static void block_4(const float *restrict q, const int64_t *restrict n, const int64_t *restrict lo, int keep0,
                    const float *restrict kt, const float *restrict v, int64_t d, int64_t s_pad, int64_t dv,
                    int64_t dv_pad, float scale, float *restrict scores, float *restrict out, float *restrict lse) {
    block(4, q, n, lo, keep0, kt, v, d, s_pad, dv, dv_pad, scale, scores, out, lse);
}

/* q [B, Hkv, R, D] (row r is query t = r % T), kt [B, Hkv, D, s_pad], v [B, Hkv, s_pad, dv_pad],
   pos [B, T] (row sees keys 0..pos, capped at s), out [B, Hkv, R, dv], lse [B, Hkv, R] or NULL
   (each row's log-sum-exp of its scaled scores, for the backward); all contiguous.
   rb: rows per block, 1 or 4 (any choice gives the same bits). window > 0: a row sees only keys
   n - window .. n - 1 of its n (and key 0 too with keep0). */
void bi_attention_forward(const float *q, const float *kt, const float *v, const int64_t *pos,
                          float *out, float *lse, int64_t b, int64_t hkv, int64_t rows, int64_t t, int64_t d,
                          int64_t s, int64_t s_pad, int64_t dv, int64_t dv_pad, float scale,
                          int64_t rb, int64_t window, int64_t keep0) {
    int64_t row_blocks = (rows + rb - 1) / rb;
    int64_t items = b * hkv * row_blocks;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * 4 * s_pad);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            int64_t bh = it / row_blocks, r0 = (it % row_blocks) * rb, bi = bh / hkv;
            int64_t n[4], lo[4];
            int nr = r0 + rb <= rows ? (int)rb : (int)(rows - r0);
            for (int r = 0; r < nr; r++) {
                int64_t p = pos[bi * t + (r0 + r) % t] + 1;
                n[r] = p < 1 ? 1 : (p > s ? s : p);
                lo[r] = window > 0 && n[r] > window ? n[r] - window : 0;
            }
            const float *q_blk = q + (bh * rows + r0) * d;
            const float *kt_bh = kt + bh * d * s_pad, *v_bh = v + bh * s_pad * dv_pad;
            float *out_blk = out + (bh * rows + r0) * dv;
            float *lse_blk = lse ? lse + bh * rows + r0 : NULL;
            if (nr == 4)
                block_4(q_blk, n, lo, (int)keep0, kt_bh, v_bh, d, s_pad, dv, dv_pad, scale, scores, out_blk,
                        lse_blk);
            else
                for (int r = 0; r < nr; r++)
                    block_1(q_blk + r * d, n + r, lo + r, (int)keep0, kt_bh, v_bh, d, s_pad, dv, dv_pad, scale,
                            scores, out_blk + r * dv, lse_blk ? lse_blk + r : NULL);
        }
        free(scores);
    }
}
