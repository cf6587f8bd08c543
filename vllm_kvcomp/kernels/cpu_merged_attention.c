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
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 256
#define INLINE static inline __attribute__((always_inline))

static float soft_cap(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

/* exp(x) for x <= 0 (Cephes' expf polynomial, relative error < 2e-7; below -87: 2^-126), in
 * plain arithmetic so that the compiler vectorizes the loops that call it. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One query row (G heads) over its first `visible` cells. Inlined into one copy per (bs, D)
 * the dispatcher names, so that those loops have constant trip counts (a page's logits stay in
 * registers); `bs`/`D` of any other value take the generic copy. */
INLINE void attend_row(const float *pages, int64_t page_elems, const float *q, const int32_t *table,
                       int64_t visible, const float *k_hat, const float *v_hat, float count,
                       const float *sinks, float *out, int G, const int D, const int bs, float scale, float cap) {
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
            for (int j = 0; j < n; j++) {
                const float *vrow = v + (int64_t)j * D;
                for (int d = 0; d < D; d++) acc[g][d] += p[j] * vrow[d];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float kept = l[g] > 0.0f ? m[g] + logf(l[g]) : -INFINITY;
        float token = -INFINITY, sink = sinks ? sinks[g] : -INFINITY;
        if (count > 0.0f) {
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += qs[g][d] * k_hat[d];
            token = soft_cap(dot, cap) + logf(count);
        }
        float top = fmaxf(kept, fmaxf(token, sink));
        float wk = expf(kept - top), wt = expf(token - top), ws = expf(sink - top);
        float norm = wk + wt + ws, a = l[g] > 0.0f ? wk / (norm * l[g]) : 0.0f, b = wt / norm;
        for (int d = 0; d < D; d++) out[g * D + d] = a * acc[g][d] + (count > 0.0f ? b * v_hat[d] : 0.0f);
    }
}

#define ROW_ARGS pages, page_elems, q_row, row_table, visible, k_row, v_row, count, sink_row, out_row, G

static void attend_row_any(const float *pages, int64_t page_elems, const float *q_row, const int32_t *row_table,
                           int64_t visible, const float *k_row, const float *v_row, float count,
                           const float *sink_row, float *out_row, int G, int D, int bs, float scale, float cap) {
    if (bs == 16 && D == 64) attend_row(ROW_ARGS, 64, 16, scale, cap);
    else if (bs == 32 && D == 64) attend_row(ROW_ARGS, 64, 32, scale, cap);
    else if (bs == 16 && D == 128) attend_row(ROW_ARGS, 128, 16, scale, cap);
    else if (bs == 32 && D == 128) attend_row(ROW_ARGS, 128, 32, scale, cap);
    else attend_row(ROW_ARGS, D, bs, scale, cap);
}

/* Returns 0, or 1 when a size is past the limits above (nothing written). */
int kvcomp_merged_attention(const float *pages, int64_t page_elems, const float *q, float *out,
                            const int32_t *seqs, int64_t num_seqs, int64_t T, const int32_t *row_start,
                            const int32_t *table, int64_t table_stride, const int32_t *ends,
                            const float *k_hat, const float *v_hat, const float *counts, const float *sinks,
                            int G, int D, int bs, float scale, float cap, int threads) {
    if (G > MAX_G || D > MAX_D || bs > MAX_BS) return 1;
    int64_t tasks = num_seqs * T;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t s = seqs[task / T], t = task % T, row = (int64_t)row_start[s] + t;
        attend_row_any(pages, page_elems, q + row * G * D, table + s * table_stride, (int64_t)ends[s] - T + t + 1,
                       k_hat + s * D, v_hat + s * D, counts[s], sinks ? sinks + s * G : NULL, out + row * G * D,
                       G, D, bs, scale, cap);
    }
    return 0;
}
