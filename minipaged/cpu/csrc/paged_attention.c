/* Included by kernels.c (one translation unit): paged decode attention and the K/V write. */

/* Paged decode attention for the CPU: one query per sequence, read straight from the pages.
 *
 * The PyTorch path gathers every sequence's blocks into a padded copy, then runs SDPA over
 * that copy: the K/V bytes cross memory twice and the padding is computed. This kernel walks
 * each sequence's block table and reads each cached K and V row once, where it lies.
 *
 * Shapes (all fp32, contiguous unless a stride is given):
 *   q           (S, H, D)             one query per sequence
 *   k_cache     (num_blocks, BS, H_kv, D)   this layer's pages; v_cache the same
 *   block_tables(S, bt_stride) int32  the first ceil(ctx / BS) entries of a row are used (at most
 *                                     max_blocks; every id is checked against num_blocks)
 *   context_lens(S,) int32            tokens each sequence attends to, its new one included
 *   out         (S, H, D)
 * Grouped-query attention: query head h reads KV head h / (H / H_kv).
 *
 * Work item = one sequence. A cached position's K (or V) row holds all KV heads side by side,
 * so it is read once, contiguously, for all H query heads. Two passes per sequence: scores
 * (q . k * scale) for every position, a max-subtracted softmax per head, then the weighted sum
 * of V rows. OpenMP splits the sequences over the cores. Every block id is range-checked first.
 */

/* e^x for float x, written so the compiler vectorizes it (libm's expf is a scalar call).
 * Cephes' expf: n = round(x log2 e), r = x - n ln 2 (ln 2 split in two for precision),
 * e^r by a degree-7 polynomial, times 2^n built in the exponent bits. Relative error about
 * 2e-7 (tests/test_cpu_kernels.py checks it). x is clamped to [-87.3, 88.7]: no overflow to
 * inf, and e^x of a very negative x is about 1e-38 instead of 0. */
static inline float fast_expf(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    const float z = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* scores (H, L): each head's row becomes its max-subtracted softmax, in place. */
static void softmax_rows(float *scores, int64_t H, int64_t L) {
    for (int64_t h = 0; h < H; h++) {
        float *sh = scores + h * L;
        float m = sh[0];
        for (int64_t t = 1; t < L; t++) m = sh[t] > m ? sh[t] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) {
            sh[t] = fast_expf(sh[t] - m);
            sum += sh[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; t++) sh[t] *= inv;
    }
}

void minipaged_exp_f32(const float *x, float *out, int64_t n) { /* for the accuracy test */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = fast_expf(x[i]);
}

#if defined(__AVX512F__)
/* One sequence, head_dim 64, AVX-512: the same two passes as the portable loop below, with
 * registers held across positions. Pass 1 walks the positions once, reading each whole cached
 * K row (all KV heads, contiguous) for every query head; pass 2 goes KV head by KV head and
 * keeps that group's query heads' outputs in registers (at most 4 heads x 4 registers), adding
 * p * V row by row. scores: (H, L), filled here. */
static void decode_seq_d64(const float *qs, const float *k_cache, const float *v_cache, const int32_t *table,
                           int64_t L, int64_t H, int64_t H_kv, int64_t BS, float scale, float *scores, float *o) {
    const int64_t G = H / H_kv, row = H_kv * 64, block = BS * row;
    for (int64_t t = 0; t < L; t++) {
        const int64_t b = t / BS, i = t % BS;
        const float *krow = k_cache + (int64_t)table[b] * block + i * row;
        if (t + 2 * BS < L) {
            const float *ahead = k_cache + (int64_t)table[b + 2] * block + i * row;
            for (int64_t c = 0; c < row; c += 16) _mm_prefetch((const char *)(ahead + c), _MM_HINT_T0);
        }
        const float *vnow = v_cache + (int64_t)table[b] * block + i * row;
        for (int64_t c = 0; c < row; c += 16) _mm_prefetch((const char *)(vnow + c), _MM_HINT_T1);
        for (int64_t g = 0; g < H_kv; g++) {
            const float *k = krow + g * 64;
            const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                         k3 = _mm512_loadu_ps(k + 48);
            for (int64_t h = g * G; h < (g + 1) * G; h++) {
                const float *qh = qs + h * 64;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), k0);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16), k1, a);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 32), k2, a);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 48), k3, a);
                scores[h * L + t] = _mm512_reduce_add_ps(a) * scale;
            }
        }
    }
    softmax_rows(scores, H, L);
    for (int64_t g = 0; g < H_kv; g++) {
        for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += 4) {
            const int64_t nh = (g + 1) * G - h0 < 4 ? (g + 1) * G - h0 : 4;
            __m512 acc[4][4];
            for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = _mm512_setzero_ps();
            for (int64_t t = 0; t < L; t++) {
                const float *v = v_cache + (int64_t)table[t / BS] * block + (t % BS) * row + g * 64;
                const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                             v3 = _mm512_loadu_ps(v + 48);
#define MP_ADD_HEAD(j)                                                      \
    if (j < nh) {                                                           \
        const __m512 p = _mm512_set1_ps(scores[(h0 + j) * L + t]);          \
        acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);                      \
        acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);                      \
        acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);                      \
        acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);                      \
    }
                MP_ADD_HEAD(0) MP_ADD_HEAD(1) MP_ADD_HEAD(2) MP_ADD_HEAD(3)
#undef MP_ADD_HEAD
            }
            for (int64_t j = 0; j < nh; j++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + (h0 + j) * 64 + c * 16, acc[j][c]);
        }
    }
}
#endif

/* One sequence s's decode attention into out[s] (its H x D floats, zeroed first); scores: room
 * for H x context_lens[s] floats. Returns the bad bits (4: a block id out of range, 8: the context
 * runs past its table row; out[s] is then left zero). */
static int decode_one_seq(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                          int64_t bt_stride, const int32_t *context_lens, float *out, int64_t s, int64_t H,
                          int64_t H_kv, int64_t D, int64_t BS, int64_t num_blocks, int64_t max_blocks, float scale,
                          float *scores) {
    const int64_t G = H / H_kv;
    const int64_t row = H_kv * D;      /* floats between two positions of one block */
    const int64_t block = BS * row;    /* floats in one block */
    const int64_t L = context_lens[s];
    float *o = out + s * H * D;
    memset(o, 0, sizeof(float) * H * D);
    if (L <= 0) return 0;
    if ((L + BS - 1) / BS > max_blocks) return 8; /* the context runs past its table row */
    const float *qs = q + s * H * D;
    const int32_t *table = block_tables + s * bt_stride;
    for (int64_t i = 0; i < (L + BS - 1) / BS; i++)
        if (table[i] < 0 || table[i] >= num_blocks) return 4;
#if defined(__AVX512F__)
    if (D == 64) {
        decode_seq_d64(qs, k_cache, v_cache, table, L, H, H_kv, BS, scale, scores, o);
        return 0;
    }
#endif
    /* pass 1: scores; each position's row (all KV heads) is contiguous, read once */
    for (int64_t t = 0; t < L; t++) {
        const float *krow = k_cache + (int64_t)table[t / BS] * block + (t % BS) * row;
        /* Pages are scattered, so the hardware prefetcher stalls at every block boundary: ask
         * for the K row two blocks ahead, and for this position's V row (pass 2 then finds the
         * sequence's V, a few tens of KB, in cache). */
        if (t + 2 * BS < L) {
            const float *ahead = k_cache + (int64_t)table[(t + 2 * BS) / BS] * block + (t % BS) * row;
            for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(ahead + c);
        }
        const float *vnow = v_cache + (int64_t)table[t / BS] * block + (t % BS) * row;
        for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(vnow + c);
        for (int64_t h = 0; h < H; h++) {
            const float *k = krow + (h / G) * D, *qh = qs + h * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qh[d] * k[d];
            scores[h * L + t] = acc * scale;
        }
    }
    softmax_rows(scores, H, L);
    /* pass 2: weighted sum of V rows */
    for (int64_t t = 0; t < L; t++) {
        const float *vrow = v_cache + (int64_t)table[t / BS] * block + (t % BS) * row;
        for (int64_t h = 0; h < H; h++) {
            const float p = scores[h * L + t], *v = vrow + (h / G) * D;
            float *oh = o + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) oh[d] += p * v[d];
        }
    }
    return 0;
}

int minipaged_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                               float *out, int64_t S, int64_t H, int64_t H_kv, int64_t D, int64_t BS,
                               int64_t num_blocks, int64_t max_blocks, float scale) {
    if (H_kv <= 0 || H % H_kv != 0 || D <= 0 || BS <= 0) return -1;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 2) reduction(| : bad)
    for (int64_t s = 0; s < S; s++) {
        const int64_t L = context_lens[s] > 0 ? context_lens[s] : 1;
        float *scores = (float *)malloc(sizeof(float) * H * L); /* scores[h * L + t] */
        if (!scores) {
            memset(out + s * H * D, 0, sizeof(float) * H * D);
            bad |= 2;
            continue;
        }
        bad |= decode_one_seq(q, k_cache, v_cache, block_tables, bt_stride, context_lens, out, s, H, H_kv, D, BS,
                              num_blocks, max_blocks, scale, scores);
        free(scores);
    }
    return bad ? -bad : 0;
}

/* Store N new tokens' K and V rows (row = H_kv * D floats each) at their slots of the flat
 * caches (num_slots = num_blocks * block_size rows). k and v rows are k_stride / v_stride floats
 * apart. Every slot is checked before anything is written: returns -1 and writes nothing if one
 * is outside the cache. */
int minipaged_write_kv_f32(float *k_cache, float *v_cache, const float *k, const float *v, int64_t k_stride,
                           int64_t v_stride, const int64_t *slots, int64_t N, int64_t row, int64_t num_slots) {
    for (int64_t n = 0; n < N; n++)
        if (slots[n] < 0 || slots[n] >= num_slots) return -1;
    for (int64_t n = 0; n < N; n++) {
        memcpy(k_cache + slots[n] * row, k + n * k_stride, sizeof(float) * row);
        memcpy(v_cache + slots[n] * row, v + n * v_stride, sizeof(float) * row);
    }
    return 0;
}

