/* Paged decode attention on the CPU, float32: one query token per sequence, read
 * straight from the paged KV cache (no gather into a padded copy).
 *
 * One work item is a sequence. Its blocks are visited in table order, each read front to
 * back (every KV head in turn) with an online softmax (running max and denominator per
 * query head); the query heads that share a KV head are scored together, so each K/V
 * row is read once.
 * Work items are spread over OpenMP threads; loaded after torch, this library shares
 * torch's OpenMP runtime (same soname), so it adds no threads of its own.
 *
 * Built by kvpilot/engine/cpu_decode_kernel.py with the host's C compiler. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (a score minus the running max), vectorisable: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n
 * written into the exponent. libm's expf is a scalar call per score, and was the
 * kernel's largest cost. Below -87 the result is flushed to 0. */
#pragma omp declare simd
static inline float exp_nonpositive(float x)
{
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = rintf(clamped * 1.44269504088896341f);
    const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* p[g * stride + t] = q_g . k_t for t < n, g < group. */
static void block_scores(const float *q, const float *kb, int64_t row, int64_t n,
                         int64_t group, int64_t head_dim, float *p, int64_t stride)
{
    int64_t g0 = 0;
#ifdef __AVX512F__
    /* Four heads per pass over each K row: the four dot products end as four 16-lane
     * partial sums, folded together into one 128-bit vector (one reduction, not four). */
    if (head_dim % 16 == 0) {
        for (; g0 + 4 <= group; g0 += 4) {
            const float *q0 = q + g0 * head_dim;
            for (int64_t t = 0; t < n; ++t) {
                const float *kt = kb + t * row;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t d = 0; d < head_dim; d += 16) {
                    const __m512 k = _mm512_loadu_ps(kt + d);
                    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), k, a0);
                    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + head_dim + d), k, a1);
                    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 2 * head_dim + d), k, a2);
                    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 3 * head_dim + d), k, a3);
                }
                /* per 128-bit lane: [a0 a1 a2 a3] partials, then the four lanes added */
                const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
                const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
                const __m512 s = _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
                const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
                const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                float out[4];
                _mm_storeu_ps(out, r);
                p[(g0 + 0) * stride + t] = out[0];
                p[(g0 + 1) * stride + t] = out[1];
                p[(g0 + 2) * stride + t] = out[2];
                p[(g0 + 3) * stride + t] = out[3];
            }
        }
    }
#endif
    for (int64_t g = g0; g < group; ++g) {
        const float *qg = q + g * head_dim;
        for (int64_t t = 0; t < n; ++t) {
            const float *kt = kb + t * row;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d)
                dot += qg[d] * kt[d];
            p[g * stride + t] = dot;
        }
    }
}

/* acc[g] += sum_t p[g * stride + t] * v_t for t < n, g < group. */
static void block_values(const float *p, int64_t stride, const float *vb, int64_t row, int64_t n,
                         int64_t group, int64_t head_dim, float *acc)
{
    int64_t g0 = 0;
#ifdef __AVX512F__
    /* Four heads' accumulators stay in registers over the block's tokens, 16 dims at a time. */
    if (head_dim % 16 == 0) {
        for (; g0 + 4 <= group; g0 += 4) {
            const float *p0 = p + g0 * stride;
            for (int64_t d = 0; d < head_dim; d += 16) {
                float *a = acc + g0 * head_dim + d;
                __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + head_dim);
                __m512 a2 = _mm512_loadu_ps(a + 2 * head_dim), a3 = _mm512_loadu_ps(a + 3 * head_dim);
                for (int64_t t = 0; t < n; ++t) {
                    const __m512 v = _mm512_loadu_ps(vb + t * row + d);
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[t]), v, a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(p0[stride + t]), v, a1);
                    a2 = _mm512_fmadd_ps(_mm512_set1_ps(p0[2 * stride + t]), v, a2);
                    a3 = _mm512_fmadd_ps(_mm512_set1_ps(p0[3 * stride + t]), v, a3);
                }
                _mm512_storeu_ps(a, a0);
                _mm512_storeu_ps(a + head_dim, a1);
                _mm512_storeu_ps(a + 2 * head_dim, a2);
                _mm512_storeu_ps(a + 3 * head_dim, a3);
            }
        }
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
        const float *vt = vb + t * row;
        for (int64_t g = g0; g < group; ++g) {
            const float w = p[g * stride + t];
            float *ag = acc + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d)
                ag[d] += w * vt[d];
        }
    }
}

void paged_decode_attention_f32(
    const float *query,          /* [num_seqs, num_heads, head_dim], contiguous */
    const float *k_cache,        /* [num_blocks, block_size, kv_heads, head_dim], contiguous */
    const float *v_cache,        /* same shape as k_cache */
    const int32_t *block_tables, /* [num_seqs, table_width], contiguous */
    const int32_t *seq_lens,     /* [num_seqs], each >= 1 */
    float *out,                  /* [num_seqs, num_heads, head_dim], contiguous */
    int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, int64_t table_width, float scale, int num_threads)
{
    const int64_t group = num_heads / kv_heads;
    const int64_t row = kv_heads * head_dim; /* floats between consecutive tokens */
    const int64_t block_floats = block_size * row; /* one block of one cache: contiguous */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = seq_lens[s];
        /* head h = kvh * group + g: a KV head's query heads are consecutive */
        float q[num_heads * head_dim], acc[num_heads * head_dim];
        float m[num_heads], l[num_heads], p[group * block_size];
        for (int64_t i = 0; i < num_heads * head_dim; ++i) {
            q[i] = query[s * num_heads * head_dim + i] * scale;
            acc[i] = 0.0f;
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            m[h] = -INFINITY;
            l[h] = 0.0f;
        }
        for (int64_t start = 0; start < len; start += block_size) {
            const int64_t block = block_tables[s * table_width + start / block_size];
            const int64_t n = len - start < block_size ? len - start : block_size;
            if (start + 2 * block_size < len) {
                /* Later blocks sit anywhere in the cache, out of the hardware prefetcher's
                 * sight: ask for the one after next, into L2 rather than L1 (this block's
                 * K and V fill much of L1). Microbenchmark, 37 rows of 50..650 tokens, 8
                 * layers: 11.3-12.8 ms with the next block into L1, 8.9-9.4 ms so. */
                const int64_t ahead = block_tables[s * table_width + start / block_size + 2];
                for (int64_t i = 0; i < block_floats; i += 16) {
                    __builtin_prefetch(k_cache + ahead * block_floats + i, 0, 1);
                    __builtin_prefetch(v_cache + ahead * block_floats + i, 0, 1);
                }
            }
            /* every KV head of the block in turn: the block is read front to back */
            for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
                const float *kb = k_cache + block * block_floats + kvh * head_dim;
                const float *vb = v_cache + block * block_floats + kvh * head_dim;
                float *qk = q + kvh * group * head_dim, *ak = acc + kvh * group * head_dim;
                block_scores(qk, kb, row, n, group, head_dim, p, block_size);
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t h = kvh * group + g;
                    float *pg = p + g * block_size;
                    float block_max = -INFINITY;
                    for (int64_t t = 0; t < n; ++t)
                        block_max = pg[t] > block_max ? pg[t] : block_max;
                    const float new_max = block_max > m[h] ? block_max : m[h];
                    const float correction = expf(m[h] - new_max); /* 0 on the first block */
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t t = 0; t < n; ++t) {
                        const float e = exp_nonpositive(pg[t] - new_max);
                        pg[t] = e;
                        sum += e;
                    }
                    l[h] = l[h] * correction + sum;
                    m[h] = new_max;
                    float *ag = ak + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d)
                        ag[d] *= correction;
                }
                block_values(p, block_size, vb, row, n, group, head_dim, ak);
            }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            float *dst = out + (s * num_heads + h) * head_dim;
            const float inv = 1.0f / l[h];
            for (int64_t d = 0; d < head_dim; ++d)
                dst[d] = acc[h * head_dim + d] * inv;
        }
    }
}
