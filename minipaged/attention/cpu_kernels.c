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

int minipaged_decode_abi(void) { return 5; }

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

void minipaged_exp_f32(const float *x, float *out, int64_t n) { /* for the accuracy test */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = fast_expf(x[i]);
}

int minipaged_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                               float *out, int64_t S, int64_t H, int64_t H_kv, int64_t D, int64_t BS,
                               int64_t num_blocks, int64_t max_blocks, float scale) {
    if (H_kv <= 0 || H % H_kv != 0 || D <= 0 || BS <= 0) return -1;
    const int64_t G = H / H_kv;
    const int64_t row = H_kv * D;      /* floats between two positions of one block */
    const int64_t block = BS * row;    /* floats in one block */
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 2) reduction(| : bad)
    for (int64_t s = 0; s < S; s++) {
        const int64_t L = context_lens[s];
        float *o = out + s * H * D;
        memset(o, 0, sizeof(float) * H * D);
        if (L <= 0) continue;
        if ((L + BS - 1) / BS > max_blocks) { /* the context runs past its table row */
            bad |= 8;
            continue;
        }
        float *scores = (float *)malloc(sizeof(float) * H * L); /* scores[h * L + t] */
        if (!scores) {
            bad |= 2;
            continue;
        }
        const float *qs = q + s * H * D;
        const int32_t *table = block_tables + s * bt_stride;
        int out_of_range = 0;
        for (int64_t i = 0; i < (L + BS - 1) / BS; i++)
            if (table[i] < 0 || table[i] >= num_blocks) out_of_range = 1;
        if (out_of_range) {
            bad |= 4;
            free(scores);
            continue;
        }
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
        /* softmax per query head, max-subtracted */
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
        free(scores);
    }
    return bad ? -bad : 0;
}

/* ---- fused elementwise ops of a Llama layer (fp32, contiguous rows) ----------------------- */

/* out[n] = w * x[n] / sqrt(mean(x[n]^2) + eps); with residual: residual[n] += x[n] first and the
 * norm is of the sum (the residual stream is updated in place, as the layer needs it). */
void minipaged_rmsnorm_f32(const float *x, float *residual, const float *w, float *out, int64_t N, int64_t C,
                           float eps) {
#pragma omp parallel for schedule(static) if (N * C > (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const float *xn = x + n * C;
        float *on = out + n * C;
        float ss = 0.f;
        if (residual) {
            float *rn = residual + n * C;
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
}

/* out (N, I) = silu(gate) * up: SwiGLU's middle. out may be gate itself. */
void minipaged_silu_mul_f32(const float *gate, const float *up, float *out, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static) if (N * I > (1 << 14))
    for (int64_t n = 0; n < N; n++) {
        const float *g = gate + n * I, *u = up + n * I;
        float *o = out + n * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + fast_expf(-g[i])) * u[i];
    }
}

/* RoPE in place, rotate_half layout: x (N, heads, D) with row stride x_stride (floats between
 * tokens); dims i and i + D/2 of a head turn together by the token's angle. cos, sin: (N, D),
 * each token's row already looked up by its position. */
void minipaged_rope_f32(float *x, int64_t x_stride, int64_t N, int64_t heads, int64_t D, const float *cos_t,
                        const float *sin_t) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (N * heads * D > (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos_t + n * D, *s = sin_t + n * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + n * x_stride + h * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
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

/* ---- matmul on GGUF's quantized blocks (small batches: decode at batch 1, 2, ...) ----------
 *
 * y (M, N) = x (M, K) @ W^T where W (N, K) is kept as llama.cpp stores it: blocks of 32 weights
 * along K, each a few bytes of small integers and one or two fp32 scales (their fp16 values,
 * widened once when the model is loaded). A block's weights are rebuilt in fp32 exactly as
 * gguf.quants dequantizes them (the fp32 copy the model keeps): an fp16 scale times a 4- or
 * 8-bit integer is exact in fp32, so each weight is rounded once (by the add of m, Q4_1) or not
 * at all, fused or not. So this is the same fp32 matmul over the same weights, reading 5-6x
 * fewer bytes: at batch 1 a token must read every weight once, and that is what bounds it.
 *
 *   kind 0, Q4_0: w = d * (q - 8),  q a nibble;      qs (N, K/32, 16) bytes; d (N, K/32)
 *   kind 1, Q4_1: w = d * q + m,    q a nibble;      qs (N, K/32, 16);       d, m (N, K/32)
 *   kind 2, Q8_0: w = q * d,        q a signed byte; qs (N, K/32, 32);       d (N, K/32)
 * Nibbles as in GGML: byte j of a block holds weight j (low 4 bits) and weight j + 16 (high).
 * x's rows are x_stride floats apart; y is (M, N) contiguous. Returns -1 for a bad kind or a K
 * that is not a multiple of 32. */
#define QBLOCK 32
#define QAHEAD 8 /* rows ahead to prefetch */
#define QROWS 8 /* rows of x per pass over a weight row: their 8 x 32 accumulators stay in registers */

static inline void dequant_block(int kind, const uint8_t *qs, float d, float m, float *w) {
    if (kind == 1) {
#pragma omp simd
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(qs[j] & 15) + m;
            w[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
    } else if (kind == 0) {
#pragma omp simd
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)((int)(qs[j] & 15) - 8);
            w[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
    } else {
        const int8_t *q8 = (const int8_t *)qs;
#pragma omp simd
        for (int j = 0; j < QBLOCK; j++) w[j] = (float)q8[j] * d;
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* One block of one weight row against `ROWS` rows of x, AVX-512: the block's 32 weights are
 * rebuilt in two registers (as gguf.quants rebuilds them), then each
 * x row adds its 32 products into its own two accumulators. */
static inline __attribute__((always_inline)) void qblock_avx512(int kind, const uint8_t *q, float d, float m,
                                                                const float *x, int64_t x_stride, int ROWS,
                                                                __m512 acc[][2]) {
    __m512 w0, w1;
    const __m512 vd = _mm512_set1_ps(d);
    if (kind == 2) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)q);
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))), vd);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))), vd);
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
        __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, low));
        __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
        if (kind == 0) {
            lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
            hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
        }
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), vd);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), vd);
        if (kind == 1) {
            const __m512 vm = _mm512_set1_ps(m);
            w0 = _mm512_add_ps(w0, vm);
            w1 = _mm512_add_ps(w1, vm);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * x_stride), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * x_stride + 16), acc[r][1]);
    }
}

/* y[r * N] for ROWS rows of x against one weight row of nb blocks. */
static inline __attribute__((always_inline)) void qrow_avx512(int kind, const uint8_t *qrow, int64_t qbytes,
                                                              const float *drow, const float *mrow, int64_t nb,
                                                              const float *x, int64_t x_stride, float *y, int64_t N,
                                                              int ROWS) {
    __m512 acc[QROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        qblock_avx512(kind, qrow + b * qbytes, drow[b], mrow ? mrow[b] : 0.f, x + b * QBLOCK, x_stride, ROWS, acc);
    for (int r = 0; r < ROWS; r++) y[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#endif

int minipaged_qmatmul_f32(const float *x, int64_t x_stride, const uint8_t *qs, const float *dscale,
                          const float *mscale, int64_t kind, float *y, int64_t M, int64_t N, int64_t K) {
    if (K % QBLOCK || kind < 0 || kind > 2 || (kind == 1 && !mscale)) return -1;
    const int64_t nb = K / QBLOCK, qbytes = kind == 2 ? QBLOCK : QBLOCK / 2;
#pragma omp parallel for schedule(static) if (N * K * (M < 4 ? M : 4) > (1 << 15))
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qrow = qs + n * nb * qbytes;
        const float *drow = dscale + n * nb, *mrow = mscale ? mscale + n * nb : NULL;
        if (n + QAHEAD < N) { /* a row is a few hundred bytes: ask for a later one while this one computes */
            const char *qa = (const char *)(qs + (n + QAHEAD) * nb * qbytes);
            for (int64_t c = 0; c < nb * qbytes; c += 64) __builtin_prefetch(qa + c);
            for (int64_t c = 0; c < nb * 4; c += 64) __builtin_prefetch((const char *)(dscale + (n + QAHEAD) * nb) + c);
            if (mscale)
                for (int64_t c = 0; c < nb * 4; c += 64) __builtin_prefetch((const char *)(mscale + (n + QAHEAD) * nb) + c);
        }
#if defined(__AVX512F__)
        int64_t m0 = 0;
        for (; m0 + 8 <= M; m0 += 8)
            qrow_avx512((int)kind, qrow, qbytes, drow, mrow, nb, x + m0 * x_stride, x_stride, y + m0 * N + n, N, 8);
        if (M - m0 >= 4) {
            qrow_avx512((int)kind, qrow, qbytes, drow, mrow, nb, x + m0 * x_stride, x_stride, y + m0 * N + n, N, 4);
            m0 += 4;
        }
        if (M - m0 >= 2) {
            qrow_avx512((int)kind, qrow, qbytes, drow, mrow, nb, x + m0 * x_stride, x_stride, y + m0 * N + n, N, 2);
            m0 += 2;
        }
        if (M - m0 >= 1)
            qrow_avx512((int)kind, qrow, qbytes, drow, mrow, nb, x + m0 * x_stride, x_stride, y + m0 * N + n, N, 1);
#else
        for (int64_t m0 = 0; m0 < M; m0 += QROWS) {
            const int64_t rows = M - m0 < QROWS ? M - m0 : QROWS;
            float acc[QROWS][QBLOCK];
            memset(acc, 0, sizeof acc);
            for (int64_t b = 0; b < nb; b++) {
                float w[QBLOCK];
                dequant_block((int)kind, qrow + b * qbytes, drow[b], mrow ? mrow[b] : 0.f, w);
                for (int64_t r = 0; r < rows; r++) {
                    const float *xr = x + (m0 + r) * x_stride + b * QBLOCK;
#pragma omp simd
                    for (int j = 0; j < QBLOCK; j++) acc[r][j] = fmaf(w[j], xr[j], acc[r][j]);
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                float s = 0.f;
                for (int j = 0; j < QBLOCK; j++) s += acc[r][j];
                y[(m0 + r) * N + n] = s;
            }
        }
#endif
    }
    return 0;
}

