/* Causal attention of virtual sequences over vLLM's CPU KV pages, merged with a compensation
 * token and sinks (RazorAttention eq. 5; gpt-oss sinks): what vLLM's CPU kernel cannot do, as it
 * returns no log-sum-exp. Built and loaded by vllm_kvcomp/kernels/cpu_native.py; its torch twin
 * is CpuPagedCache._attend_merged_torch (vllm_kvcomp/engine/cache.py). float32 throughout.
 *
 * Page p starts at pages + p * page_elems: K^T [D][bs], then V [bs][D] (vLLM's "vec" layout).
 * Sequence s (one KV head of a request) holds ends[s] cells in the pages table[s * table_stride ..];
 * its T query rows are q rows row_start[s] .. + T (each [G][D], G query heads), the last T tokens:
 * row t sees cells [0, ends[s] - T + t]. counts[s] = 0: no compensation token. sinks [S][G] or NULL.
 * Only the sequences listed in seqs [C] are attended; their rows of out are overwritten.
 * observe [S] (or NULL): addresses of float rows (0 = none); a listed sequence's row gets, added to
 * its cell v, the softmax weight of cell v among its cells alone (soft-capped logits where the layer
 * caps; no token, no sink), the mean over its G query heads: the attention H2O accumulates. Only
 * sequences of one query row (T = 1) observe.
 */
#include <stdlib.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 256
#define INLINE static inline __attribute__((always_inline))

static float soft_cap(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

/* exp(r) - ... for |r| <= ln2 / 2: the polynomial both exps share (r a float or a v8; a scalar
 * coefficient broadcasts over the lanes). */
#define EXP_POLYNOMIAL(r) \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) * (r) \
       + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)

/* exp(x) for x <= 0 (Cephes' expf polynomial, relative error < 2e-7; below -87: 2^-126), in
 * plain arithmetic so that the compiler vectorizes the loops that call it. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = EXP_POLYNOMIAL(r);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

INLINE float dot_row(const float *x, const float *y, const int D) {
    float dot = 0.0f;
    for (int d = 0; d < D; d++) dot += x[d] * y[d];
    return dot;
}

/* The log-sum-exp merge of a row's kept cells (running max m, sum l) with the compensation token
 * (its logit, weighted by `count`; none when count is 0) and the learned sink logit: out =
 * a * acc + b * v_hat. */
INLINE void merge_factors(float m, float l, float token_logit, float count, float sink, float *a, float *b) {
    float kept = l > 0.0f ? m + logf(l) : -INFINITY;
    float token = count > 0.0f ? token_logit + logf(count) : -INFINITY;
    float top = fmaxf(kept, fmaxf(token, sink));
    float wk = expf(kept - top), wt = expf(token - top), ws = expf(sink - top);
    float norm = wk + wt + ws;
    *a = l > 0.0f ? wk / (norm * l) : 0.0f;
    *b = wt / norm;
}

/* A row's observed attention (see observe above): each page's exponentials exp(x - top) of every
 * head are stashed with that page's running max `top` while the row is attended, then weighed by
 * exp(top - m) / (l G) once the row's final max m and sum l are known, and added up over the heads. */
typedef struct {
    float *row;   /* the sequence's observed row, NULL: nothing observed */
    float *exps;  /* [G][pages][bs] */
    float *tops;  /* [G][pages] */
    int64_t pages;
} Observed;

INLINE Observed observed_start(float *row, int G, int64_t pages, int bs) {
    Observed o = {row, NULL, NULL, pages};
    if (row) {
        o.exps = malloc(sizeof(float) * (size_t)G * (size_t)pages * (size_t)(bs + 1));
        if (!o.exps) o.row = NULL; /* no memory: the caller's row stays as it was */
        else o.tops = o.exps + (size_t)G * (size_t)pages * (size_t)bs;
    }
    return o;
}

INLINE void observed_page(Observed *o, int g, int64_t w, const float *exps, float top, int bs) {
    if (!o->row) return;
    memcpy(o->exps + ((size_t)g * o->pages + w) * bs, exps, sizeof(float) * bs);
    o->tops[g * o->pages + w] = top;
}

INLINE void observed_finish(Observed *o, const float *m, const float *l, int G, int64_t visible, int bs) {
    if (!o->row) return;
    for (int g = 0; g < G; g++) {
        for (int64_t w = 0; w < o->pages; w++) {
            float weight = expf(o->tops[g * o->pages + w] - m[g]) / (l[g] * (float)G);
            const float *e = o->exps + ((size_t)g * o->pages + w) * bs;
            int n = visible - w * bs < bs ? (int)(visible - w * bs) : bs;
            for (int j = 0; j < n; j++) o->row[w * bs + j] += e[j] * weight;
        }
    }
    free(o->exps);
}

/* One query row (G heads) over its first `visible` cells. Inlined into one copy per (bs, D)
 * the dispatcher names, so that those loops have constant trip counts (a page's logits stay in
 * registers); `bs`/`D` of any other value take the generic copy. */
INLINE void attend_row(const float *pages, int64_t page_elems, const float *q, const int32_t *table,
                       int64_t visible, const float *k_hat, const float *v_hat, float count,
                       const float *sinks, float *out, float *seen, int G, const int D, const int bs, float scale,
                       float cap) {
    float m[MAX_G], l[MAX_G], acc[MAX_G][MAX_D], qs[MAX_G][MAX_D], p[MAX_BS];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int d = 0; d < D; d++) {
            acc[g][d] = 0.0f;
            qs[g][d] = q[g * D + d] * scale;
        }
    }
    int64_t num_pages = (visible + bs - 1) / bs;
    Observed observed = observed_start(seen, G, num_pages, bs);
    for (int64_t w = 0; w < num_pages; w++) {
        const float *kt = pages + (int64_t)table[w] * page_elems, *v = kt + (int64_t)D * bs;
        int n = visible - w * bs < bs ? (int)(visible - w * bs) : bs;
        for (int g = 0; g < G; g++) {
            float row[MAX_BS];
            for (int j = 0; j < bs; j++) row[j] = 0.0f;
            for (int d = 0; d < D; d++) {
                float qd = qs[g][d];
                const float *krow = kt + (int64_t)d * bs;
                for (int j = 0; j < bs; j++) row[j] += qd * krow[j];
            }
            if (cap > 0.0f)
                for (int j = 0; j < n; j++) row[j] = soft_cap(row[j], cap);
            float top = m[g];
            for (int j = 0; j < n; j++) top = row[j] > top ? row[j] : top;
            if (top > m[g]) {
                float shrink = expf(m[g] - top);  /* exp(-inf) = 0 on the first page */
                l[g] *= shrink;
                for (int d = 0; d < D; d++) acc[g][d] *= shrink;
                m[g] = top;
            }
            float sum = 0.0f;
            for (int j = 0; j < bs; j++) {  /* cells past the end weigh 0 (their values are never read) */
                p[j] = j < n ? exp_nonpositive(row[j] - top) : 0.0f;
                sum += p[j];
            }
            l[g] += sum;
            observed_page(&observed, g, w, p, top, bs);
            for (int j = 0; j < n; j++) {
                const float *vrow = v + (int64_t)j * D;
                for (int d = 0; d < D; d++) acc[g][d] += p[j] * vrow[d];
            }
        }
    }
    observed_finish(&observed, m, l, G, visible, bs);
    for (int g = 0; g < G; g++) {
        float a, b;
        merge_factors(m[g], l[g], count > 0.0f ? soft_cap(dot_row(qs[g], k_hat, D), cap) : 0.0f, count,
                      sinks ? sinks[g] : -INFINITY, &a, &b);
        for (int d = 0; d < D; d++) out[g * D + d] = a * acc[g][d] + (count > 0.0f ? b * v_hat[d] : 0.0f);
    }
}

/* The same row for block sizes that are multiples of 32 (or 8, 16, 24) and head dims that are
 * multiples of 8, without soft-capping, in 8-float vectors (GCC vector extensions: one AVX2
 * register each with -march=native) whose accumulators stay in registers: per page the logits of
 * a tile of up to 32 cells x QH query heads (12 accumulators hide the FMA latency; one read of
 * K^T feeds every head of the tile), then each head's acc[D] += p[j] * V[j] over the page in
 * 64-wide tiles of 8 registers. Same arithmetic as attend_row: f32, online softmax,
 * exp_nonpositive; cells past the end weigh 0 and their values are not read. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define QK_VECTORS 12 /* logit accumulators of a tile: query heads x cells / 8 */
#define MAX_PAD (MAX_G + QK_VECTORS)

INLINE v8 load8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
INLINE void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
INLINE v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
INLINE v8 max8(v8 a, v8 b) { /* lane-wise a > b ? a : b, by mask (C has no vector ?:) */
    v8i take_a = a > b;
    return (v8)((take_a & (v8i)a) | (~take_a & (v8i)b));
}

/* exp_nonpositive on 8 lanes (round-to-nearest by the 1.5 * 2^23 shift instead of floor(x + 0.5):
 * the same reduced range, |r| <= ln2 / 2). */
INLINE v8 exp8_nonpositive(v8 x) {
    x = max8(x, splat8(-87.0f));
    v8 shifted = x * 1.44269504088896341f + 12582912.0f, n = shifted - 12582912.0f;
    v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = EXP_POLYNOMIAL(r);
    v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

INLINE float hmax8(v8 x) {
    float m = x[0];
    for (int i = 1; i < 8; i++) m = x[i] > m ? x[i] : m;
    return m;
}

INLINE float hsum8(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* logits[g][0..bs) = qs[g] . K^T of one page, for the first `heads` query heads (a multiple of QH),
 * in tiles of QH heads x JT vectors of cells. */
INLINE void page_logits(const float *kt, float qs[][MAX_D], float logits[][MAX_BS], int heads,
                        const int D, const int bs, const int QH, const int JT) {
    for (int g0 = 0; g0 < heads; g0 += QH)
        for (int j0 = 0; j0 < bs; j0 += 8 * JT) {
            v8 row[QK_VECTORS];
            for (int i = 0; i < QH * JT; i++) row[i] = splat8(0.0f);
            for (int d = 0; d < D; d++) {
                const float *krow = kt + (int64_t)d * bs + j0;
                for (int i = 0; i < JT; i++) {
                    v8 k = load8(krow + 8 * i);
                    for (int h = 0; h < QH; h++) row[h * JT + i] += splat8(qs[g0 + h][d]) * k;
                }
            }
            for (int h = 0; h < QH; h++)
                for (int i = 0; i < JT; i++) store8(&logits[g0 + h][j0 + 8 * i], row[h * JT + i]);
        }
}

/* Ask for the next page while this one is attended: a sequence's pages lie anywhere in the cache
 * and the hardware prefetcher stops at each. With it, the bundled model's pages read from memory
 * took 13-17 % less time (2 threads, 512-2000 cells, pages drawn at random). */
INLINE void prefetch_page(const float *page, const int D, const int bs) {
    const char *bytes = (const char *)page;
    for (int64_t b = 0; b < (int64_t)2 * D * bs * (int64_t)sizeof(float); b += 64) __builtin_prefetch(bytes + b, 0, 1);
}

INLINE void attend_row_vec(const float *pages, int64_t page_elems, const float *q, const int32_t *table,
                           int64_t visible, const float *k_hat, const float *v_hat, float count,
                           const float *sinks, float *out, float *seen, int G, const int D, const int bs,
                           float scale) {
    const int B8 = bs / 8, JT = B8 < 4 ? B8 : 4; /* cell vectors of a tile */
    const int most = QK_VECTORS / JT < 6 ? QK_VECTORS / JT : 6, QH = G < most ? G : most; /* its query heads */
    float m[MAX_PAD], l[MAX_PAD], qs[MAX_PAD][MAX_D];
    float logits[MAX_PAD][MAX_BS] __attribute__((aligned(32)));
    v8 acc[MAX_G][MAX_D / 8];
    int padded = (G + QH - 1) / QH * QH; /* extra heads of zero queries: computed, never used */
    for (int g = 0; g < padded; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int d = 0; d < D; d++) qs[g][d] = g < G ? q[g * D + d] * scale : 0.0f;
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D / 8; i++) acc[g][i] = splat8(0.0f);
    int64_t num_pages = (visible + bs - 1) / bs;
    Observed observed = observed_start(seen, G, num_pages, bs);
    for (int64_t w = 0; w < num_pages; w++) {
        const float *kt = pages + (int64_t)table[w] * page_elems, *v = kt + (int64_t)D * bs;
        int n = visible - w * bs < bs ? (int)(visible - w * bs) : bs;
        if (w + 1 < num_pages) prefetch_page(pages + (int64_t)table[w + 1] * page_elems, D, bs);
        switch (QH) { /* a constant tile each, so that its accumulators stay in registers */
            case 1: page_logits(kt, qs, logits, padded, D, bs, 1, JT); break;
            case 2: page_logits(kt, qs, logits, padded, D, bs, 2, JT); break;
            case 3: page_logits(kt, qs, logits, padded, D, bs, 3, JT); break;
            case 4: page_logits(kt, qs, logits, padded, D, bs, 4, JT); break;
            case 5: page_logits(kt, qs, logits, padded, D, bs, 5, JT); break;
            default: page_logits(kt, qs, logits, padded, D, bs, 6, JT); break;
        }
        for (int g = 0; g < G; g++) {
            float *row = logits[g];
            for (int j = n; j < bs; j++) row[j] = -INFINITY; /* past the end (unwritten cells may be NaN) */
            v8 top8 = load8(row);
            for (int i = 1; i < B8; i++) {
                top8 = max8(load8(row + 8 * i), top8);
            }
            float top = hmax8(top8);
            top = top > m[g] ? top : m[g];
            if (top > m[g]) {
                float shrink = expf(m[g] - top); /* exp(-inf) = 0 on the first page */
                l[g] *= shrink;
                for (int i = 0; i < D / 8; i++) acc[g][i] *= shrink;
                m[g] = top;
            }
            for (int i = 0; i < B8; i++) store8(row + 8 * i, exp8_nonpositive(load8(row + 8 * i) - top));
            for (int j = n; j < bs; j++) row[j] = 0.0f; /* cells past the end weigh 0 */
            v8 sum8 = load8(row);
            for (int i = 1; i < B8; i++) sum8 += load8(row + 8 * i);
            l[g] += hsum8(sum8);
            observed_page(&observed, g, w, row, top, bs);
            for (int t = 0; t < D / 8; t += 8) { /* 64 values at a time: 8 accumulators in registers */
                int width = D / 8 - t < 8 ? D / 8 - t : 8;
                v8 a[8];
                for (int i = 0; i < width; i++) a[i] = acc[g][t + i];
                for (int j = 0; j < n; j++) {
                    v8 pj = splat8(row[j]);
                    const float *vrow = v + (int64_t)j * D + 8 * t;
                    for (int i = 0; i < width; i++) a[i] += pj * load8(vrow + 8 * i);
                }
                for (int i = 0; i < width; i++) acc[g][t + i] = a[i];
            }
        }
    }
    observed_finish(&observed, m, l, G, visible, bs);
    for (int g = 0; g < G; g++) {
        float a, b;
        merge_factors(m[g], l[g], count > 0.0f ? dot_row(qs[g], k_hat, D) : 0.0f, count,
                      sinks ? sinks[g] : -INFINITY, &a, &b);
        for (int i = 0; i < D / 8; i++) {
            v8 o = acc[g][i] * a;
            if (count > 0.0f) o += load8(v_hat + 8 * i) * b;
            store8(out + g * D + 8 * i, o);
        }
    }
}

#define ROW_ARGS pages, page_elems, q_row, row_table, visible, k_row, v_row, count, sink_row, out_row, seen, G

static void attend_row_any(const float *pages, int64_t page_elems, const float *q_row, const int32_t *row_table,
                           int64_t visible, const float *k_row, const float *v_row, float count,
                           const float *sink_row, float *out_row, float *seen, int G, int D, int bs, float scale,
                           float cap) {
    if (cap > 0.0f || D % 8 || (bs % 32 && (bs > 24 || bs % 8))) attend_row(ROW_ARGS, D, bs, scale, cap);
    else if (bs == 16 && D == 64) attend_row_vec(ROW_ARGS, 64, 16, scale);
    else if (bs == 32 && D == 64) attend_row_vec(ROW_ARGS, 64, 32, scale);
    else if (bs == 16 && D == 128) attend_row_vec(ROW_ARGS, 128, 16, scale);
    else if (bs == 32 && D == 128) attend_row_vec(ROW_ARGS, 128, 32, scale);
    else if (bs == 128 && D == 64) attend_row_vec(ROW_ARGS, 64, 128, scale);
    else if (bs == 128 && D == 128) attend_row_vec(ROW_ARGS, 128, 128, scale);
    else attend_row_vec(ROW_ARGS, D, bs, scale);
}

/* Returns 0, or 1 when a size is past the limits above (nothing written). */
int kvcomp_merged_attention(const float *pages, int64_t page_elems, const float *q, float *out,
                            const int32_t *seqs, int64_t num_seqs, int64_t T, const int32_t *row_start,
                            const int32_t *table, int64_t table_stride, const int32_t *ends,
                            const float *k_hat, const float *v_hat, const float *counts, const float *sinks,
                            const int64_t *observe, int G, int D, int bs, float scale, float cap, int threads) {
    if (G > MAX_G || D > MAX_D || bs > MAX_BS) return 1;
    int64_t tasks = num_seqs * T;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t s = seqs[task / T], t = task % T, row = (int64_t)row_start[s] + t;
        attend_row_any(pages, page_elems, q + row * G * D, table + s * table_stride, (int64_t)ends[s] - T + t + 1,
                       k_hat + s * D, v_hat + s * D, counts[s], sinks ? sinks + s * G : NULL, out + row * G * D,
                       observe && T == 1 ? (float *)(uintptr_t)observe[s] : NULL, G, D, bs, scale, cap);
    }
    return 0;
}
