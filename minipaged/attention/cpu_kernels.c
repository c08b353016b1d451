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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

int minipaged_decode_abi(void) { return 7; }

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

/* ---- fused elementwise ops of a Llama layer (fp32, contiguous rows) ----------------------- */

/* out[n] = w * x[n] / sqrt(mean(x[n]^2) + eps); with residual: residual[n] += x[n] first and the
 * norm is of the sum (the residual stream is updated in place, as the layer needs it). One row: */
static inline void rmsnorm_row(const float *xn, float *rn, const float *w, float *on, int64_t C, float eps) {
    float ss = 0.f;
    if (rn) {
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; c++) {
            const float v = rn[c] + xn[c];
            rn[c] = v;
            ss += v * v;
        }
        xn = rn;
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; c++) ss += xn[c] * xn[c];
    }
    const float r = 1.f / sqrtf(ss / (float)C + eps);
#pragma omp simd
    for (int64_t c = 0; c < C; c++) on[c] = w[c] * (xn[c] * r);
}

void minipaged_rmsnorm_f32(const float *x, float *residual, const float *w, float *out, int64_t N, int64_t C,
                           float eps) {
#pragma omp parallel for schedule(static) if (N * C > (1 << 18))
    for (int64_t n = 0; n < N; n++) rmsnorm_row(x + n * C, residual ? residual + n * C : NULL, w, out + n * C, C, eps);
}

/* out (N, I) = silu(gate) * up: SwiGLU's middle. out may be gate itself. One row: */
static inline void silu_mul_row(const float *g, const float *u, float *o, int64_t I) {
#pragma omp simd
    for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + fast_expf(-g[i])) * u[i];
}

void minipaged_silu_mul_f32(const float *gate, const float *up, float *out, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static) if (N * I > (1 << 14))
    for (int64_t n = 0; n < N; n++) silu_mul_row(gate + n * I, up + n * I, out + n * I, I);
}

/* RoPE in place, rotate_half layout: x (N, heads, D) with row stride x_stride (floats between
 * tokens); dims i and i + D/2 of a head turn together by the token's angle. cos, sin: (N, D),
 * each token's row already looked up by its position. One token's row: */
static inline void rope_row(float *xn, int64_t heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = xn + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * c[i] - b * s[i];
            v[i + half] = b * c[i + half] + a * s[i + half];
        }
    }
}

void minipaged_rope_f32(float *x, int64_t x_stride, int64_t N, int64_t heads, int64_t D, const float *cos_t,
                        const float *sin_t) {
#pragma omp parallel for schedule(static) if (N * heads * D > (1 << 18))
    for (int64_t n = 0; n < N; n++) rope_row(x + n * x_stride, heads, D, cos_t + n * D, sin_t + n * D);
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

/* ---- matmul on GGUF's quantized weights (decode batches) --------------------------------
 *
 * y (M, N) = x (M, K) @ W^T where W (N, K) is kept as the GGUF file's small integers and fp32
 * scales (their fp16 values, widened once when the model is loaded), re-arranged for this
 * kernel when the model is loaded (model/gguf_blocks.py): output features in groups of 16
 * lanes, so one vector holds 16 neighbouring outputs' weights at one k. Each weight is rebuilt
 * in fp32 exactly as gguf.quants dequantizes it (the fp32 copy the model keeps): an fp16 scale
 * times a 4- or 8-bit integer is exact in fp32, so each weight is rounded once (by the add of m,
 * Q4_1) or not at all. So this is the same fp32 matmul over the same weights, reading 5-6x
 * fewer bytes (at batch 1 a token reads every weight once, and that bounds its speed).
 *
 * Layout, G = ceil(N / 16) groups, lane i of group g = output feature 16 g + i (lanes past N
 * have zero scales, so zero weights):
 *   kind 0, Q4_0: w = d * (q - 8)   qt (G, K/2, 16) bytes: byte i = q(k=2kk) | q(k=2kk+1) << 4
 *   kind 1, Q4_1: w = d * q + m     qt as Q4_0;                   dt, mt (G, K/32, 16) fp32
 *   kind 2, Q8_0: w = q * d         qt (G, K, 16) signed bytes;   dt (G, K/32, 16) fp32
 * x's rows are x_stride floats apart; y is (M, N) contiguous. Returns -1 for a bad kind or a K
 * that is not a multiple of 32, -2 when out of memory.
 *
 * A GEMM: each thread takes pairs of groups (32 outputs), rebuilds a QKC-long stretch of the
 * pair's weights at a time into an fp32 panel that stays in L1, and multiplies every QM-row tile
 * of x against it, with QM x 32 accumulators in registers. (Up to 8 rows of x the row layout's
 * minipaged_qmatvec_f32 below serves instead: it streams better.) A prefill's long batch goes
 * QROWS rows at a time, so that the rows every pair reads again stay near in cache; each row's
 * sums are the same whichever chunk and tile it falls in. */
#define QBLOCK 32
#define QM 8       /* rows of x per tile: 8 x 2 accumulator registers */
#define QKC 256    /* k per panel stretch: 256 x 32 floats = 32 KB, in L1 */
#define QROWS 1024 /* rows of x per pass over the weights (a multiple of QM) */

static inline float q_weight(int kind, const uint8_t *qt, const float *dt, const float *mt, int64_t K, int64_t n,
                             int64_t k) {
    const int64_t g = n / 16, i = n % 16, b = k / QBLOCK;
    const float d = dt[(g * (K / QBLOCK) + b) * 16 + i];
    if (kind == 2) return (float)((const int8_t *)qt)[(g * K + k) * 16 + i] * d;
    const uint8_t byte = qt[(g * (K / 2) + k / 2) * 16 + i];
    const int q = (k & 1) ? byte >> 4 : byte & 15;
    return kind == 1 ? d * (float)q + mt[(g * (K / QBLOCK) + b) * 16 + i] : d * (float)(q - 8);
}

#if defined(__AVX512F__)
/* 16 bytes of nibbles -> the 16 low and the 16 high ones as floats (Q4_0: minus its 8). */
static inline __attribute__((always_inline)) void nibbles_to_floats(int kind, const uint8_t *p, __m512 *lo,
                                                                    __m512 *hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    __m512i a = _mm512_cvtepu8_epi32(_mm_and_si128(raw, low));
    __m512i b = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
    if (kind == 0) {
        a = _mm512_sub_epi32(a, _mm512_set1_epi32(8));
        b = _mm512_sub_epi32(b, _mm512_set1_epi32(8));
    }
    *lo = _mm512_cvtepi32_ps(a);
    *hi = _mm512_cvtepi32_ps(b);
}

/* 16 signed bytes -> 16 floats. */
static inline __attribute__((always_inline)) __m512 bytes_to_floats(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The integers of one group at k and k + 1 (nibble kinds, Q4_0 minus its 8) or at k alone
 * (Q8_0: *i1 untouched), as floats: the weights without their scales. */
static inline __attribute__((always_inline)) void q_ints(int kind, const uint8_t *qt, int64_t K, int64_t g, int64_t k,
                                                         __m512 *i0, __m512 *i1) {
    if (kind == 2)
        *i0 = bytes_to_floats(qt + (g * K + k) * 16);
    else
        nibbles_to_floats(kind, qt + (g * (K / 2) + k / 2) * 16, i0, i1);
}

/* Weights of one group at k and k + 1 (nibble kinds) or at k alone (Q8_0: *w1 untouched):
 * the integers times d (plus m, Q4_1), as gguf.quants rebuilds them. */
static inline __attribute__((always_inline)) void q_lanes(int kind, const uint8_t *qt, int64_t K, int64_t g,
                                                          int64_t k, __m512 vd, __m512 vm, __m512 *w0, __m512 *w1) {
    __m512 i0, i1 = _mm512_setzero_ps();
    q_ints(kind, qt, K, g, k, &i0, &i1);
    if (kind == 1) { /* d * q is exact in fp32, so one fused rounding of d * q + m is the add's */
        *w0 = _mm512_fmadd_ps(i0, vd, vm);
        *w1 = _mm512_fmadd_ps(i1, vd, vm);
        return;
    }
    *w0 = _mm512_mul_ps(i0, vd);
    if (kind == 2) return;
    *w1 = _mm512_mul_ps(i1, vd);
}

/* Ask for block b of group g (its integers and scales) ahead of its use. */
static inline void q_prefetch_block(int kind, const uint8_t *qt, const float *dt, const float *mt, int64_t K,
                                    int64_t G, int64_t g, int64_t b) {
    if (g >= G) return;
    const int64_t nb = K / QBLOCK, qb = kind == 2 ? QBLOCK * 16 : QBLOCK * 8; /* bytes of one block in a group */
    const char *q = (const char *)qt + g * nb * qb + b * qb;
    for (int64_t c = 0; c < qb; c += 64) _mm_prefetch(q + c, _MM_HINT_T0);
    _mm_prefetch((const char *)(dt + (g * nb + b) * 16), _MM_HINT_T0);
    if (mt) _mm_prefetch((const char *)(mt + (g * nb + b) * 16), _MM_HINT_T0);
}

/* acc[r] += x[r][k] * panel[k] over a stretch of K k's, for the ROWS (at most QM) rows of a
 * tile; the panel is K x 32 (groups g and g + 1 side by side). */
static inline __attribute__((always_inline)) void q_tile_panel(const float *panel, const float *const *xr, int ROWS,
                                                               int64_t K, __m512 acc[][2]) {
    for (int64_t k = 0; k < K; k++) {
        const __m512 wa = _mm512_load_ps(panel + k * 32), wb = _mm512_load_ps(panel + k * 32 + 16);
        for (int r = 0; r < ROWS; r++) {
            const __m512 xv = _mm512_set1_ps(xr[r][k]);
            acc[r][0] = _mm512_fmadd_ps(xv, wa, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, wb, acc[r][1]);
        }
    }
}

static void q_store(float *y, int64_t N, int64_t m0, int rows, int64_t n0, __m512 acc[][2]) {
    const int64_t left = N - n0;
    const __mmask16 k0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 k1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, k0, acc[r][0]);
        if (k1) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0 + 16, k1, acc[r][1]);
    }
}

/* rows (1 .. QM) as a constant, so that each tile height gets its own unrolled loop */
#define Q_DISPATCH(CALL)                                                                     \
    switch (rows) {                                                                          \
    case 8: CALL(8); break;                                                                  \
    case 7: CALL(7); break;                                                                  \
    case 6: CALL(6); break;                                                                  \
    case 5: CALL(5); break;                                                                  \
    case 4: CALL(4); break;                                                                  \
    case 3: CALL(3); break;                                                                  \
    case 2: CALL(2); break;                                                                  \
    default: CALL(1); break;                                                                 \
    }

/* One pair of groups (outputs 32 pr .. 32 pr + 31) of y = x @ W^T. panel: 32 x QKC floats, accs:
 * 32 x QM x ceil(M / QM) floats, both 64-byte aligned (each thread's own). */
/* Each row's largest output so far and its first position (best[r], at[r]; at[r] < 0: none yet,
 * -2: a NaN was met), over the 32 outputs of a finished tile, instead of storing them. */
static void q_argmax(float *best, int64_t *at, int64_t N, int64_t m0, int rows, int64_t n0, __m512 acc[][2]) {
    const int64_t left = N - n0;
    const __mmask16 k0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 k1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    for (int r = 0; r < rows; r++) {
        const int64_t m = m0 + r;
        if (at[m] == -2) continue;
        if (_mm512_mask_cmp_ps_mask(k0, acc[r][0], acc[r][0], _CMP_UNORD_Q) ||
            _mm512_mask_cmp_ps_mask(k1, acc[r][1], acc[r][1], _CMP_UNORD_Q)) {
            at[m] = -2;
            continue;
        }
        float v = _mm512_mask_reduce_max_ps(k0, acc[r][0]);
        if (k1) {
            const float v1 = _mm512_mask_reduce_max_ps(k1, acc[r][1]);
            v = v1 > v ? v1 : v;
        }
        if (at[m] >= 0 && !(v > best[m])) continue; /* ties keep the earlier position */
        const __mmask16 e0 = _mm512_mask_cmp_ps_mask(k0, acc[r][0], _mm512_set1_ps(v), _CMP_EQ_OQ);
        const __mmask16 e1 = _mm512_mask_cmp_ps_mask(k1, acc[r][1], _mm512_set1_ps(v), _CMP_EQ_OQ);
        best[m] = v;
        at[m] = e0 ? n0 + __builtin_ctz(e0) : n0 + 16 + __builtin_ctz(e1);
    }
}

/* best/at NULL: store y; else y is not written and each row's argmax is kept in best/at instead. */
static void qlane_pair(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt, const float *mt,
                       int kind, float *y, int64_t M, int64_t N, int64_t K, int64_t pr, float *panel, float *accs,
                       float *best, int64_t *at) {
    const int64_t G = (N + 15) / 16, nb = K / QBLOCK;
    const int64_t g = 2 * pr;
    const int two = g + 1 < G;
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += QKC) {
        const int64_t kc = K - k0 < QKC ? K - k0 : QKC;
        for (int64_t h = 0; h < 2; h++) { /* rebuild this stretch of the pair's weights */
            if (h == 1 && !two) {
                for (int64_t k = 0; k < kc; k++) _mm512_store_ps(panel + k * 32 + 16, zero);
                break;
            }
            for (int64_t b = k0 / QBLOCK; b < (k0 + kc) / QBLOCK; b++) {
                q_prefetch_block(kind, qt, dt, mt, K, G, g + h + 2, b);
                const __m512 d = _mm512_loadu_ps(dt + ((g + h) * nb + b) * 16);
                const __m512 m = mt ? _mm512_loadu_ps(mt + ((g + h) * nb + b) * 16) : zero;
                for (int64_t k = b * QBLOCK; k < (b + 1) * QBLOCK; k += (kind == 2 ? 1 : 2)) {
                    __m512 w0, w1;
                    q_lanes(kind, qt, K, g + h, k, d, m, &w0, &w1);
                    _mm512_store_ps(panel + (k - k0) * 32 + h * 16, w0);
                    if (kind != 2) _mm512_store_ps(panel + (k + 1 - k0) * 32 + h * 16, w1);
                }
            }
        }
        for (int64_t m0 = 0, t = 0; m0 < M; m0 += QM, t++) {
            const int rows = (int)(M - m0 < QM ? M - m0 : QM);
            const float *xr[QM];
            for (int r = 0; r < QM; r++) xr[r] = x + (m0 + (r < rows ? r : rows - 1)) * x_stride + k0;
            float *keep = accs + t * QM * 32;
            __m512 acc[QM][2];
            for (int r = 0; r < QM; r++) {
                acc[r][0] = k0 ? _mm512_load_ps(keep + r * 32) : zero;
                acc[r][1] = k0 ? _mm512_load_ps(keep + r * 32 + 16) : zero;
            }
#define Q_PANEL(R) q_tile_panel(panel, xr, R, kc, acc)
            Q_DISPATCH(Q_PANEL)
#undef Q_PANEL
            if (k0 + kc < K) {
                for (int r = 0; r < QM; r++) {
                    _mm512_store_ps(keep + r * 32, acc[r][0]);
                    _mm512_store_ps(keep + r * 32 + 16, acc[r][1]);
                }
            } else {
                if (at)
                    q_argmax(best, at, N, m0, rows, g * 16, acc);
                else
                    q_store(y, N, m0, rows, g * 16, acc);
            }
        }
    }
}

static int qmatmul_avx512(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt, const float *mt,
                          int kind, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t G = (N + 15) / 16, pairs = (G + 1) / 2;
    int bad = 0;
#pragma omp parallel reduction(| : bad) if (pairs > 1 && M * N * K > (1 << 15))
    {
        /* the pair's weights, one QKC-long stretch of k at a time; each tile's accumulators wait
         * in accs between stretches */
        const int64_t rows_max = M < QROWS ? M : QROWS;
        float *panel = (float *)aligned_alloc(64, sizeof(float) * 32 * QKC);
        float *accs = (float *)aligned_alloc(64, sizeof(float) * 32 * ((rows_max + QM - 1) / QM) * QM);
        if (!panel || !accs) bad = 1;
        for (int64_t m0 = 0; m0 < M; m0 += QROWS) {
            const int64_t mc = M - m0 < QROWS ? M - m0 : QROWS;
#pragma omp for schedule(static)
            for (int64_t pr = 0; pr < pairs; pr++)
                if (panel && accs)
                    qlane_pair(x + m0 * x_stride, x_stride, qt, dt, mt, kind, y + m0 * N, mc, N, K, pr, panel, accs,
                               NULL, NULL);
        }
        free(panel);
        free(accs);
    }
    return bad ? -2 : 0;
}

/* at[r] = argmax over n of (x @ W^T)[r, n], the first position of the largest, without writing
 * the product (greedy sampling from the LM head: at batch 64 its logits are 12 MB a step).
 * The same accumulators as qmatmul_avx512, so the same values. Returns -3 when a row holds a
 * NaN (the caller computes the logits and asks PyTorch), -2 out of memory. */
static int qmatmul_argmax_avx512(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt, const float *mt,
                                 int kind, int64_t M, int64_t N, int64_t K, int64_t *at) {
    const int64_t G = (N + 15) / 16, pairs = (G + 1) / 2;
    int bad = 0;
    for (int64_t m = 0; m < M; m++) at[m] = -1;
    float *best = (float *)malloc(sizeof(float) * M);
    if (!best) return -2;
#pragma omp parallel reduction(| : bad)
    {
        float *panel = (float *)aligned_alloc(64, sizeof(float) * 32 * QKC);
        float *accs = (float *)aligned_alloc(64, sizeof(float) * 32 * ((M + QM - 1) / QM) * QM);
        float *mine = (float *)malloc(sizeof(float) * M);
        int64_t *mine_at = (int64_t *)malloc(sizeof(int64_t) * M);
        if (!panel || !accs || !mine || !mine_at) bad = 1;
        if (mine_at)
            for (int64_t m = 0; m < M; m++) mine_at[m] = -1;
#pragma omp for schedule(static)
        for (int64_t pr = 0; pr < pairs; pr++)
            if (panel && accs && mine && mine_at)
                qlane_pair(x, x_stride, qt, dt, mt, kind, NULL, M, N, K, pr, panel, accs, mine, mine_at);
#pragma omp critical
        if (mine && mine_at)
            for (int64_t m = 0; m < M; m++) { /* the larger wins; on a tie, the earlier position */
                if (mine_at[m] == -1 || at[m] == -2) continue;
                if (mine_at[m] == -2 || at[m] == -1 || mine[m] > best[m] || (mine[m] == best[m] && mine_at[m] < at[m])) {
                    best[m] = mine[m];
                    at[m] = mine_at[m];
                }
            }
        free(panel);
        free(accs);
        free(mine);
        free(mine_at);
    }
    free(best);
    if (bad) return -2;
    for (int64_t m = 0; m < M; m++)
        if (at[m] < 0) return -3;
    return 0;
}
#endif

#if defined(__AVX512F__)
/* The row layout (the file's own: row n's blocks in turn, GGML's nibble order, fp32 scales
 * rd/rm (N, K/32)), for at most 8 rows of x: one weight row at a time, its 32 weights per block
 * rebuilt in two registers (as gguf.quants rebuilds them) and multiplied into each x row's two
 * accumulators; one sum per output at the end. One weight row is a few hundred contiguous
 * bytes, so the three streams (integers, d, m) run straight through memory, prefetched a few
 * rows ahead: at batch 1, where every byte counts, this beats the lane layout's two groups. */
static inline __attribute__((always_inline)) void qrow_avx512(int kind, const uint8_t *qrow, int64_t qbytes,
                                                              const float *drow, const float *mrow, int64_t nb,
                                                              const float *x, int64_t x_stride, float *y, int64_t N,
                                                              int ROWS) {
    __m512 acc[8][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = qrow + b * qbytes;
        const __m512 vd = _mm512_set1_ps(drow[b]);
        __m512 w0, w1;
        if (kind == 2) {
            w0 = _mm512_mul_ps(bytes_to_floats(q), vd);
            w1 = _mm512_mul_ps(bytes_to_floats(q + 16), vd);
        } else {
            nibbles_to_floats(kind, q, &w0, &w1);
            if (kind == 1) { /* d * q is exact in fp32: one fused rounding is the add's */
                const __m512 vm = _mm512_set1_ps(mrow[b]);
                w0 = _mm512_fmadd_ps(w0, vd, vm);
                w1 = _mm512_fmadd_ps(w1, vd, vm);
            } else {
                w0 = _mm512_mul_ps(w0, vd);
                w1 = _mm512_mul_ps(w1, vd);
            }
        }
        const float *xb = x + b * QBLOCK;
        for (int r = 0; r < ROWS; r++) {
            acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + r * x_stride), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + r * x_stride + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < ROWS; r++) y[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#endif

/* Output n of y (M, N) = x (M, K) @ W^T from the row layout, M from 1 to 8. rq: (N, K/32, 16)
 * nibble bytes (byte j: weight j low, weight j + 16 high) or (N, K/32, 32) signed bytes for
 * Q8_0; rd, rm: (N, K/32) fp32. */
static inline void qrow_one(const float *x, int64_t x_stride, const uint8_t *rq, const float *rd, const float *rm,
                            int kind, float *y, int64_t M, int64_t N, int64_t K, int64_t n) {
    const int64_t nb = K / QBLOCK, qbytes = kind == 2 ? QBLOCK : QBLOCK / 2;
    const uint8_t *qrow = rq + n * nb * qbytes;
    const float *drow = rd + n * nb, *mrow = rm ? rm + n * nb : NULL;
    if (n + 8 < N) { /* a row is a few hundred bytes: ask for one 8 rows on while this one computes */
        const char *qa = (const char *)(rq + (n + 8) * nb * qbytes);
        for (int64_t c = 0; c < nb * qbytes; c += 64) __builtin_prefetch(qa + c);
        for (int64_t c = 0; c < nb * 4; c += 64) __builtin_prefetch((const char *)(rd + (n + 8) * nb) + c);
        if (rm)
            for (int64_t c = 0; c < nb * 4; c += 64) __builtin_prefetch((const char *)(rm + (n + 8) * nb) + c);
    }
#if defined(__AVX512F__)
    switch (M) {
    case 8: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 8); break;
    case 7: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 7); break;
    case 6: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 6); break;
    case 5: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 5); break;
    case 4: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 4); break;
    case 3: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 3); break;
    case 2: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 2); break;
    default: qrow_avx512(kind, qrow, qbytes, drow, mrow, nb, x, x_stride, y + n, N, 1); break;
    }
#else
    for (int64_t r = 0; r < M; r++) { /* portable: the same rule, one weight at a time */
        const float *xr = x + r * x_stride;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = qrow + b * qbytes;
            for (int j = 0; j < QBLOCK; j++) {
                const int v = kind == 2 ? ((const int8_t *)q)[j] : j < 16 ? q[j] & 15 : q[j - 16] >> 4;
                const float w = kind == 1 ? drow[b] * (float)v + mrow[b]
                              : kind == 0 ? drow[b] * (float)(v - 8) : (float)v * drow[b];
                acc += xr[b * QBLOCK + j] * w;
            }
        }
        y[r * N + n] = acc;
    }
#endif
}

/* y (M, N) = x (M, K) @ W^T from the row layout, M at most 8 (returns -1 otherwise, or for a bad
 * kind or K). */
int minipaged_qmatvec_f32(const float *x, int64_t x_stride, const uint8_t *rq, const float *rd, const float *rm,
                          int64_t kind, float *y, int64_t M, int64_t N, int64_t K) {
    if (K % QBLOCK || kind < 0 || kind > 2 || (kind == 1 && !rm) || M < 1 || M > 8) return -1;
#pragma omp parallel for schedule(static) if (N * K * M > (1 << 15))
    for (int64_t n = 0; n < N; n++) qrow_one(x, x_stride, rq, rd, rm, (int)kind, y, M, N, K, n);
    return 0;
}

/* 1 when the vectorized GGUF matmul is compiled in (AVX-512 here); the portable loop below is
 * only for checking it: far too slow to serve with. */
int minipaged_qmatmul_fast(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int minipaged_qmatmul_argmax_f32(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt,
                                 const float *mt, int64_t kind, int64_t M, int64_t N, int64_t K, int64_t *at) {
    if (K % QBLOCK || kind < 0 || kind > 2 || (kind == 1 && !mt) || M < 1 || N < 1) return -1;
#if defined(__AVX512F__)
    return qmatmul_argmax_avx512(x, x_stride, qt, dt, mt, (int)kind, M, N, K, at);
#else
    (void)x, (void)x_stride, (void)qt, (void)dt, (void)at;
    return -4; /* no fast kernel here: the caller computes the logits */
#endif
}

int minipaged_qmatmul_f32(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt, const float *mt,
                          int64_t kind, float *y, int64_t M, int64_t N, int64_t K) {
    if (K % QBLOCK || kind < 0 || kind > 2 || (kind == 1 && !mt)) return -1;
#if defined(__AVX512F__)
    return qmatmul_avx512(x, x_stride, qt, dt, mt, (int)kind, y, M, N, K);
#else
    /* portable: one output at a time, weights rebuilt by the same rule */
#pragma omp parallel for schedule(static) if (M * N * K > (1 << 17))
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < M; r++) {
            const float *xr = x + r * x_stride;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += xr[k] * q_weight((int)kind, qt, dt, mt, K, n, k);
            y[r * N + n] = acc;
        }
    return 0;
#endif
}

/* ---- a decode step's decoder layers in one call ------------------------------------------
 *
 * Every token of the step is a decode (sequence s has exactly one new token, row s), and every
 * linear layer multiplies from its GGUF blocks. Then each layer is: RMSNorm; q, k, v; RoPE; K and
 * V stored at their slots; paged decode attention; o; the residual add and the second RMSNorm;
 * gate and up; SiLU(gate) * up; down; the residual add. Each is the very routine the
 * one-op-at-a-time calls above run, on the same rows in the same order, so the result is the
 * same to the bit; what goes is the interpreter between ops (about 30 calls into PyTorch and C
 * per layer) and a thread start per op: here one team of threads runs the whole step, with a
 * barrier between ops, and q, k and v (and gate and up) share one split of the work.
 * Everything is checked before anything is written: slots, block ids and context lengths. */
typedef struct {
    const uint8_t *qt; const float *dt; const float *mt; /* lane layout (GGUFBlocks.pointers) */
    const uint8_t *rq; const float *rd; const float *rm; /* row layout (GGUFBlocks.row_pointers) */
    const float *bias;                                   /* (N,) or NULL */
    int64_t kind, N, K;
} mp_qlinear;

typedef struct {
    const float *input_norm, *post_norm; /* (C,) each */
    mp_qlinear q, k, v, o, gate, up, down;
    float *k_cache, *v_cache; /* (num_blocks, BS, H_kv, D) each */
} mp_layer;

typedef struct {
    int64_t M, C, H, H_kv, D, I, BS, num_blocks, bt_stride, max_blocks;
    float eps, scale;
    float *x;                 /* (M, C): the residual stream, read and updated in place */
    const float *cos, *sin;   /* (M, D): each token's row */
    const int64_t *slots;     /* (M,) */
    const int32_t *tables;    /* (M, bt_stride) */
    const int32_t *lens;      /* (M,) */
    const int32_t *qsl;       /* (M + 1,): must be 0, 1, ..., M */
    float *h, *q, *k, *v, *o, *a, *g, *u; /* scratch: (M, C), (M, H D), (M, H_kv D) x 2, (M, H D), (M, C), (M, I) x 2 */
} mp_decode_step;

typedef struct {
    const mp_qlinear *w;
    const float *x; /* (M, w->K) contiguous */
    float *y;       /* (M, w->N) contiguous */
} mp_job;

static int qlinear_ok(const mp_qlinear *w, int64_t N, int64_t K) {
    return w->N == N && w->K == K && K % QBLOCK == 0 && w->kind >= 0 && w->kind <= 2 && w->qt && w->dt && w->rq &&
           w->rd && (w->kind != 1 || (w->mt && w->rm));
}

/* The work units of one linear layer: a pair of lane groups (AVX-512, more than 8 rows), else one output. */
static inline int64_t qlinear_units(const mp_qlinear *w, int64_t M) {
#if defined(__AVX512F__)
    if (M > 8) return ((w->N + 15) / 16 + 1) / 2;
#endif
    (void)M;
    return w->N;
}

static inline void qlinear_unit(const mp_job *j, int64_t M, int64_t u, float *panel, float *accs) {
    const mp_qlinear *w = j->w;
#if defined(__AVX512F__)
    if (M > 8) {
        qlane_pair(j->x, w->K, w->qt, w->dt, w->mt, (int)w->kind, j->y, M, w->N, w->K, u, panel, accs, NULL, NULL);
        return;
    }
#endif
    (void)panel, (void)accs;
    if (M <= 8) {
        qrow_one(j->x, w->K, w->rq, w->rd, w->rm, (int)w->kind, j->y, M, w->N, w->K, u);
        return;
    }
    for (int64_t r = 0; r < M; r++) { /* portable, more than 8 rows: the lane layout's rule */
        const float *xr = j->x + r * w->K;
        float acc = 0.f;
        for (int64_t k = 0; k < w->K; k++) acc += xr[k] * q_weight((int)w->kind, w->qt, w->dt, w->mt, w->K, u, k);
        j->y[r * w->N + u] = acc;
    }
}

/* Inside a parallel region: every job's y = x @ W^T (+ bias), the jobs' units split over the team. */
static void qlinear_jobs(const mp_job *jobs, int nj, int64_t M, float *panel, float *accs) {
    int64_t total = 0;
    for (int j = 0; j < nj; j++) total += qlinear_units(jobs[j].w, M);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < total; i++) {
        int j = 0;
        int64_t u = i;
        while (u >= qlinear_units(jobs[j].w, M)) u -= qlinear_units(jobs[j].w, M), j++;
        qlinear_unit(&jobs[j], M, u, panel, accs);
    }
    int biased = 0;
    for (int j = 0; j < nj; j++) biased |= jobs[j].w->bias != NULL;
    if (!biased) return;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < nj; j++) {
            const mp_qlinear *w = jobs[j].w;
            if (!w->bias) continue;
            float *y = jobs[j].y + m * w->N;
            for (int64_t n = 0; n < w->N; n++) y[n] += w->bias[n];
        }
}

/* Returns 0, or: -1 a shape that does not fit, -2 out of memory, -3 a sequence with other than
 * one new token, -4 a block id outside the cache, -8 a context past its table row or empty,
 * -16 a slot outside the cache. Nothing is written unless it returns 0 (save -2). */
int minipaged_decode_layers_f32(const mp_layer *layers, int64_t num_layers, const mp_decode_step *st) {
    const int64_t M = st->M, C = st->C, H = st->H, H_kv = st->H_kv, D = st->D, I = st->I, BS = st->BS;
    if (M < 1 || C <= 0 || H_kv <= 0 || H % H_kv || D <= 0 || D % 2 || I <= 0 || BS <= 0 || st->max_blocks < 1 ||
        st->bt_stride < st->max_blocks || num_layers < 0)
        return -1;
    for (int64_t l = 0; l < num_layers; l++) {
        const mp_layer *ly = layers + l;
        if (!ly->input_norm || !ly->post_norm || !ly->k_cache || !ly->v_cache || !qlinear_ok(&ly->q, H * D, C) ||
            !qlinear_ok(&ly->k, H_kv * D, C) || !qlinear_ok(&ly->v, H_kv * D, C) || !qlinear_ok(&ly->o, C, H * D) ||
            !qlinear_ok(&ly->gate, I, C) || !qlinear_ok(&ly->up, I, C) || !qlinear_ok(&ly->down, C, I))
            return -1;
    }
    for (int64_t s = 0; s <= M; s++)
        if (st->qsl[s] != s) return -3;
    int64_t max_len = 1;
    const int64_t num_slots = st->num_blocks * BS;
    for (int64_t s = 0; s < M; s++) {
        const int64_t L = st->lens[s];
        if (L < 1 || (L + BS - 1) / BS > st->max_blocks) return -8;
        const int32_t *table = st->tables + s * st->bt_stride;
        for (int64_t i = 0; i < (L + BS - 1) / BS; i++)
            if (table[i] < 0 || table[i] >= st->num_blocks) return -4;
        if (st->slots[s] < 0 || st->slots[s] >= num_slots) return -16;
        max_len = L > max_len ? L : max_len;
    }
    const int64_t HD = H * D, row = H_kv * D;
    int failed = 0;
#pragma omp parallel
    {
        float *panel = (float *)aligned_alloc(64, sizeof(float) * 32 * QKC);
        float *accs = (float *)aligned_alloc(64, sizeof(float) * 32 * ((M + QM - 1) / QM) * QM);
        float *scores = (float *)malloc(sizeof(float) * H * max_len);
        if (!panel || !accs || !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int f;
#pragma omp atomic read
        f = failed;
        const int go = !f;
        for (int64_t l = 0; go && l < num_layers; l++) {
            const mp_layer *ly = layers + l;
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) rmsnorm_row(st->x + m * C, NULL, ly->input_norm, st->h + m * C, C, st->eps);
            const mp_job qkv[3] = {{&ly->q, st->h, st->q}, {&ly->k, st->h, st->k}, {&ly->v, st->h, st->v}};
            qlinear_jobs(qkv, 3, M, panel, accs);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                rope_row(st->q + m * HD, H, D, st->cos + m * D, st->sin + m * D);
                rope_row(st->k + m * row, H_kv, D, st->cos + m * D, st->sin + m * D);
                memcpy(ly->k_cache + st->slots[m] * row, st->k + m * row, sizeof(float) * row);
                memcpy(ly->v_cache + st->slots[m] * row, st->v + m * row, sizeof(float) * row);
            }
#pragma omp for schedule(dynamic, 2)
            for (int64_t s = 0; s < M; s++)
                decode_one_seq(st->q, ly->k_cache, ly->v_cache, st->tables, st->bt_stride, st->lens, st->o, s, H, H_kv,
                               D, BS, st->num_blocks, st->max_blocks, st->scale, scores);
            const mp_job o_job[1] = {{&ly->o, st->o, st->a}};
            qlinear_jobs(o_job, 1, M, panel, accs);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                rmsnorm_row(st->a + m * C, st->x + m * C, ly->post_norm, st->h + m * C, C, st->eps);
            const mp_job gate_up[2] = {{&ly->gate, st->h, st->g}, {&ly->up, st->h, st->u}};
            qlinear_jobs(gate_up, 2, M, panel, accs);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) silu_mul_row(st->g + m * I, st->u + m * I, st->g + m * I, I);
            const mp_job down[1] = {{&ly->down, st->g, st->a}};
            qlinear_jobs(down, 1, M, panel, accs);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                float *xm = st->x + m * C;
                const float *am = st->a + m * C;
#pragma omp simd
                for (int64_t c = 0; c < C; c++) xm[c] += am[c];
            }
        }
        free(panel);
        free(accs);
        free(scores);
    }
    return failed ? -2 : 0;
}
