/* Included by kernels.c (one translation unit). */
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
 * sums are the same whichever chunk and tile it falls in. On a CPU with AMX tiles the same work
 * runs on them instead (qmatmul_amx, below the AVX-512 kernels). */
#define QBLOCK 32
#define QM 8       /* rows of x per tile: 8 x 2 accumulator registers */
#define QKC 256    /* k per panel stretch: 256 x 32 floats = 32 KB, in L1 */
#define QROWS 256  /* rows of x per pass over the weights (a multiple of QM) */

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

/* Fold one thread's argmaxes (mine, mine_at) into the team's (best, at), inside a critical section:
 * the larger wins; on a tie, the earlier position; a row with a NaN (-2) stays so. */
static void q_argmax_merge(float *best, int64_t *at, const float *mine, const int64_t *mine_at, int64_t M) {
    for (int64_t m = 0; m < M; m++) {
        if (mine_at[m] == -1 || at[m] == -2) continue;
        if (mine_at[m] == -2 || at[m] == -1 || mine[m] > best[m] || (mine[m] == best[m] && mine_at[m] < at[m])) {
            best[m] = mine[m];
            at[m] = mine_at[m];
        }
    }
}

/* at[r] = argmax over n of (x @ W^T)[r, n], the first position of the largest, without writing
 * the product (greedy sampling from the LM head: at batch 64 its logits are 12 MB a step).
 * The same accumulators as qmatmul_avx512, so the same values; each row's largest so far is
 * folded into best/at (at[r] = -1 before: minipaged_qmatmul_argmax_f32 sets them and reads a
 * NaN's -2 out). Returns -2 when out of memory. */
static int qmatmul_argmax_avx512(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt, const float *mt,
                                 int kind, int64_t M, int64_t N, int64_t K, float *best, int64_t *at) {
    const int64_t G = (N + 15) / 16, pairs = (G + 1) / 2;
    int bad = 0;
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
        if (mine && mine_at) q_argmax_merge(best, at, mine, mine_at, M);
        free(panel);
        free(accs);
        free(mine);
        free(mine_at);
    }
    return bad ? -2 : 0;
}
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* ---- the lane kernel on AMX tiles (a CPU with AMX-BF16: Sapphire Rapids and later) ----------
 *
 * Where the CPU has AMX, every lane-layout product (more than 8 rows: the GEMMs, the head's
 * argmax, the whole-step decode's linears) runs here instead of on the AVX-512 panel above.
 * Each fp32 x is cut, by truncation, into three bf16 parts whose sum is x exactly (8 + 8 + 8
 * significand bits), and each weight's integer q is exact in bf16, so every product q * part
 * the tile unit makes is exact; it sums 32 of them (one GGUF block) in fp32 for 16 rows and 16
 * outputs at a time. Each block's sums are then scaled by the block's d in fp32 (plus m times
 * the block's sum of x, Q4_1): y = sum over blocks of d S + m X. That is the dot product over
 * the fp32 weights regrouped by block, not rounded weight by weight: as accurate as an fp32
 * matmul (more: d q + m is not rounded first), but not the same bits as the AVX-512 panel, so
 * one process takes one kernel (MINIPAGED_AMX=0 or minipaged_set_amx(0) keeps the panel).
 * Each row's sums are the same whichever chunk, tile or batch it falls in (rows past M are
 * zero and never stored). */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ON 1
#ifndef AMX_ROWS
#define AMX_ROWS 64 /* rows of x per pass over the weights: their split (6 bytes a value) stays near */
#endif
static int mp_amx = -1; /* -1 not asked yet, 0 off, 1 on */

static int amx_available(void) {
    static int granted = -1; /* Linux hands out the tile state to a process that asks (ARCH_REQ_XCOMP_PERM) */
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
}

/* MINIPAGED_AMX=0 (or false, off, no: any case) keeps the AVX-512 kernel; unset or anything else: on where it can be. */
static int amx_env_off(void) {
    const char *e = getenv("MINIPAGED_AMX");
    if (!e) return 0;
    static const char *const off[] = {"0", "false", "off", "no"};
    for (int i = 0; i < 4; i++) {
        const char *a = e, *b = off[i];
        while (*a && *b && (*a | 32) == *b) a++, b++;
        if (!*a && !*b) return 1;
    }
    return 0;
}

static int amx_on(void) {
    if (mp_amx < 0) mp_amx = amx_env_off() ? 0 : amx_available();
    return mp_amx;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Every tile 16 rows x 64 bytes: C 16 x 16 fp32, A 16 rows x 32 bf16, B 16 pairs x 16 lanes. */
static void amx_configure(void) {
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* x split for the tiles: rows padded to 16, three bf16 planes (Mp, ld) and each block's sum of x.
 * A plane's rows are ld = K + 32 values apart: K alone (1536 = 3 KB a row) would put a tile's 16
 * rows in 4 of L1's 64 sets, and they would evict one another. */
typedef struct {
    uint16_t *h, *m, *l;
    float *xs;
    int64_t Mp, K, ld;
} amx_x;

static int64_t amx_rows(int64_t M) { return (M + 15) / 16 * 16; }

/* The split's memory, kept by each calling thread and grown as needed: a fresh allocation of a
 * prefill's split (hundreds of KB: mapped and faulted in anew each time) cost more than the split. */
static void *amx_buffer(size_t bytes) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 65535) / 65536 * 65536;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}
static size_t amx_bytes(int64_t M, int64_t K) { return (size_t)amx_rows(M) * (K + 32) * 6 + sizeof(float) * amx_rows(M) * (K / QBLOCK) + 256; }

static void amx_x_at(amx_x *s, void *buf, int64_t M, int64_t K) {
    const int64_t Mp = amx_rows(M), ld = K + 32;
    s->h = (uint16_t *)buf, s->m = s->h + Mp * ld, s->l = s->m + Mp * ld;
    s->xs = (float *)(s->l + Mp * ld), s->Mp = Mp, s->K = K, s->ld = ld;
}

/* Row r of x (r >= M: zeros) into the planes: h = x's top 16 bits, m = the top 16 of what is
 * left, l = the rest (at most 8 significant bits, so exact in bf16). */
static void amx_split_row(const float *x, int64_t x_stride, int64_t M, int64_t r, amx_x *s) {
    const int64_t K = s->K, nb = K / QBLOCK, ld = s->ld;
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t b = 0; b < nb; b++) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = b * QBLOCK; k < (b + 1) * QBLOCK; k += 16) {
            const __m512 v = r < M ? _mm512_loadu_ps(x + r * x_stride + k) : _mm512_setzero_ps();
            const __m512i hi = _mm512_and_si512(_mm512_castps_si512(v), top);
            const __m512 r1 = _mm512_sub_ps(v, _mm512_castsi512_ps(hi));
            const __m512i mi = _mm512_and_si512(_mm512_castps_si512(r1), top);
            const __m512i lo = _mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(mi)));
            _mm256_storeu_si256((__m256i *)(s->h + r * ld + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
            _mm256_storeu_si256((__m256i *)(s->m + r * ld + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(mi, 16)));
            _mm256_storeu_si256((__m256i *)(s->l + r * ld + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16)));
            sum = _mm512_add_ps(sum, v);
        }
        s->xs[r * nb + b] = _mm512_reduce_add_ps(sum);
    }
}

/* Block b of group g as a B tile: row kk holds, for each of the 16 lanes, the pair
 * (q at k = 32 b + 2 kk, q at k + 1) as two bf16 (Q4_0: minus its 8). */
static inline void amx_btile(int kind, const uint8_t *qt, int64_t K, int64_t g, int64_t b, uint32_t *B) {
    const __m512i m15 = _mm512_set1_epi32(15), top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int kk = 0; kk < 16; kk++) {
        __m512i lo, hi;
        if (kind == 2) {
            const uint8_t *p = qt + (g * K + b * QBLOCK + 2 * kk) * 16;
            lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
            hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
        } else {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qt + (g * (K / 2) + b * 16 + kk) * 16)));
            lo = _mm512_and_si512(v, m15);
            hi = _mm512_srli_epi32(v, 4);
            if (kind == 0) {
                lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
                hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
            }
        }
        const __m512i fl = _mm512_castps_si512(_mm512_cvtepi32_ps(lo)), fh = _mm512_castps_si512(_mm512_cvtepi32_ps(hi));
        _mm512_store_si512((__m512i *)(B + kk * 16), _mm512_or_si512(_mm512_srli_epi32(fl, 16), _mm512_and_si512(fh, top)));
    }
}

/* acc rows += C tile rows * d (+ xs * m): one tile's block sums scaled into its 16 rows x 16 outputs */
static inline void amx_scale(const float *C, float *acc, const float *xs, int64_t nb, int64_t b, __m512 d, __m512 m,
                             int with_m) {
    for (int r = 0; r < 16; r++) {
        __m512 a = _mm512_fmadd_ps(_mm512_load_ps(C + r * 16), d, _mm512_load_ps(acc + r * 32));
        if (with_m) a = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * nb + b]), m, a);
        _mm512_store_ps(acc + r * 32, a);
    }
}

/* Pair pr (outputs 32 pr .. 32 pr + 31) for the rows r0 .. r0 + rows - 1 of the split x (r0 a
 * multiple of 16, rows padded up to 16): acc (rows padded, 32) = those rows' outputs.
 * B: 2 KB, C: 4 KB, acc: 64-byte aligned. */
static void amx_pair(const amx_x *s, int64_t r0, int64_t rows, const uint8_t *qt, const float *dt, const float *mt,
                     int kind, int64_t N, int64_t pr, float *acc, uint32_t *B, float *C) {
    const int64_t K = s->K, G = (N + 15) / 16, nb = K / QBLOCK, g = 2 * pr, ld = s->ld, st = ld * 2;
    const int64_t R = (rows + 15) / 16 * 16;
    const int two = g + 1 < G;
    memset(acc, 0, sizeof(float) * R * 32);
    amx_configure();
    for (int64_t b = 0; b < nb; b++) {
        amx_btile(kind, qt, K, g, b, B);
        if (two)
            amx_btile(kind, qt, K, g + 1, b, B + 256);
        else
            memset(B + 256, 0, 1024);
        _tile_loadd(4, B, 64);
        _tile_loadd(5, B + 256, 64);
        const __m512 d0 = _mm512_loadu_ps(dt + (g * nb + b) * 16);
        const __m512 d1 = two ? _mm512_loadu_ps(dt + ((g + 1) * nb + b) * 16) : _mm512_setzero_ps();
        __m512 m0 = _mm512_setzero_ps(), m1 = m0;
        if (kind == 1) {
            m0 = _mm512_loadu_ps(mt + (g * nb + b) * 16);
            if (two) m1 = _mm512_loadu_ps(mt + ((g + 1) * nb + b) * 16);
        }
        const int64_t o = b * QBLOCK;
        int64_t t = 0;
        for (; t + 32 <= R; t += 32) { /* two row tiles x two groups: four sums in flight */
            const int64_t a0 = (r0 + t) * ld + o, a1 = a0 + 16 * ld;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            _tile_loadd(6, s->h + a0, st); _tile_loadd(7, s->h + a1, st);
            _tile_dpbf16ps(0, 6, 4); _tile_dpbf16ps(1, 6, 5); _tile_dpbf16ps(2, 7, 4); _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(6, s->m + a0, st); _tile_loadd(7, s->m + a1, st);
            _tile_dpbf16ps(0, 6, 4); _tile_dpbf16ps(1, 6, 5); _tile_dpbf16ps(2, 7, 4); _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(6, s->l + a0, st); _tile_loadd(7, s->l + a1, st);
            _tile_dpbf16ps(0, 6, 4); _tile_dpbf16ps(1, 6, 5); _tile_dpbf16ps(2, 7, 4); _tile_dpbf16ps(3, 7, 5);
            _tile_stored(0, C, 64); _tile_stored(1, C + 256, 64); _tile_stored(2, C + 512, 64); _tile_stored(3, C + 768, 64);
            const float *xs = s->xs + (r0 + t) * nb;
            amx_scale(C, acc + t * 32, xs, nb, b, d0, m0, kind == 1);
            amx_scale(C + 256, acc + t * 32 + 16, xs, nb, b, d1, m1, kind == 1);
            amx_scale(C + 512, acc + (t + 16) * 32, xs + 16 * nb, nb, b, d0, m0, kind == 1);
            amx_scale(C + 768, acc + (t + 16) * 32 + 16, xs + 16 * nb, nb, b, d1, m1, kind == 1);
        }
        if (t < R) { /* one row tile left */
            const int64_t a0 = (r0 + t) * ld + o;
            _tile_zero(0); _tile_zero(1);
            _tile_loadd(6, s->h + a0, st); _tile_dpbf16ps(0, 6, 4); _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(7, s->m + a0, st); _tile_dpbf16ps(0, 7, 4); _tile_dpbf16ps(1, 7, 5);
            _tile_loadd(6, s->l + a0, st); _tile_dpbf16ps(0, 6, 4); _tile_dpbf16ps(1, 6, 5);
            _tile_stored(0, C, 64); _tile_stored(1, C + 256, 64);
            const float *xs = s->xs + (r0 + t) * nb;
            amx_scale(C, acc + t * 32, xs, nb, b, d0, m0, kind == 1);
            amx_scale(C + 256, acc + t * 32 + 16, xs, nb, b, d1, m1, kind == 1);
        }
    }
    _tile_release();
}

/* The pair's finished outputs: stored into y's rows r0 .., or (best/at) each row's argmax kept. */
static void amx_finish(const float *acc, int64_t r0, int64_t rows, int64_t N, int64_t pr, float *y, float *best,
                       int64_t *at) {
    for (int64_t t = 0; t < rows; t += QM) {
        const int n = (int)(rows - t < QM ? rows - t : QM);
        __m512 a[QM][2];
        for (int r = 0; r < n; r++) a[r][0] = _mm512_load_ps(acc + (t + r) * 32), a[r][1] = _mm512_load_ps(acc + (t + r) * 32 + 16);
        if (at)
            q_argmax(best, at, N, r0 + t, n, pr * 32, a);
        else
            q_store(y, N, r0 + t, n, pr * 32, a);
    }
}

/* Per-thread scratch of the AMX kernel for chunks of at most `rows` rows. */
typedef struct {
    float *acc, *C;
    uint32_t *B;
} amx_scratch;

static int amx_scratch_alloc(amx_scratch *w, int64_t rows) {
    w->acc = (float *)aligned_alloc(64, sizeof(float) * 32 * amx_rows(rows));
    w->C = (float *)aligned_alloc(64, 4096);
    w->B = (uint32_t *)aligned_alloc(64, 2048);
    return w->acc && w->C && w->B;
}

static void amx_scratch_free(amx_scratch *w) { free(w->acc), free(w->C), free(w->B); }

/* y = x @ W^T (best/at NULL) or each row's argmax folded into best/at, on the tiles; AMX_ROWS rows
 * at a time after the team splits x once. */
static int qmatmul_amx(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt, const float *mt, int kind,
                       float *y, int64_t M, int64_t N, int64_t K, float *best, int64_t *at) {
    const int64_t G = (N + 15) / 16, pairs = (G + 1) / 2;
    void *buf = amx_buffer(amx_bytes(M, K));
    if (!buf) return -2;
    amx_x s;
    amx_x_at(&s, buf, M, K);
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        amx_scratch w;
        float *mine = at ? (float *)malloc(sizeof(float) * M) : NULL;
        int64_t *mine_at = at ? (int64_t *)malloc(sizeof(int64_t) * M) : NULL;
        const int ok = amx_scratch_alloc(&w, M < AMX_ROWS ? M : AMX_ROWS) && (!at || (mine && mine_at));
        if (!ok) bad = 1;
        if (mine_at)
            for (int64_t m = 0; m < M; m++) mine_at[m] = -1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < s.Mp; r++) amx_split_row(x, x_stride, M, r, &s);
        for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
            const int64_t mc = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
#pragma omp for schedule(static)
            for (int64_t pr = 0; pr < pairs; pr++)
                if (ok) {
                    amx_pair(&s, m0, mc, qt, dt, mt, kind, N, pr, w.acc, w.B, w.C);
                    amx_finish(w.acc, m0, mc, N, pr, y, mine, mine_at);
                }
        }
        if (at) {
#pragma omp critical
            if (ok) q_argmax_merge(best, at, mine, mine_at, M);
        }
        free(mine);
        free(mine_at);
        amx_scratch_free(&w);
    }
    return bad ? -2 : 0;
}
#else
#define AMX_ON 0
static int amx_on(void) { return 0; }
static int amx_available(void) { return 0; }
static int mp_amx = 0;
#endif

/* 1 when the lane kernel runs on AMX tiles in this process (see above), else 0. */
int minipaged_qmatmul_amx(void) { return amx_on(); }

/* Turn the AMX kernel on (1) or off (0) for this process; returns the previous state, or -1
 * when it cannot be turned on here (no AMX in this build or CPU). */
int minipaged_set_amx(int on) {
    const int was = amx_on();
    if (on && !amx_available()) return -1;
    mp_amx = on ? 1 : 0;
    return was;
}

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
    float *best = (float *)malloc(sizeof(float) * M);
    if (!best) return -2;
    for (int64_t m = 0; m < M; m++) at[m] = -1;
    int rc;
#if AMX_ON
    if (amx_on())
        rc = qmatmul_amx(x, x_stride, qt, dt, mt, (int)kind, NULL, M, N, K, best, at);
    else
#endif
        rc = qmatmul_argmax_avx512(x, x_stride, qt, dt, mt, (int)kind, M, N, K, best, at);
    free(best);
    if (rc) return rc;
    for (int64_t m = 0; m < M; m++)
        if (at[m] < 0) return -3;
    return 0;
#else
    (void)x, (void)x_stride, (void)qt, (void)dt, (void)at;
    return -4; /* no fast kernel here: the caller computes the logits */
#endif
}

int minipaged_qmatmul_f32(const float *x, int64_t x_stride, const uint8_t *qt, const float *dt, const float *mt,
                          int64_t kind, float *y, int64_t M, int64_t N, int64_t K) {
    if (K % QBLOCK || kind < 0 || kind > 2 || (kind == 1 && !mt)) return -1;
#if AMX_ON
    if (amx_on()) return qmatmul_amx(x, x_stride, qt, dt, mt, (int)kind, y, M, N, K, NULL, NULL);
#endif
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

