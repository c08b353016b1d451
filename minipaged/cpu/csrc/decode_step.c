/* Included by kernels.c (one translation unit). */
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

#if AMX_ON
#define AMX_PASS AMX_ROWS
#else
#define AMX_PASS QROWS
#endif
/* The AMX kernel's shared split of a call's x and each thread's scratch (AMX_ON builds only). */
typedef struct {
    void *buf;     /* the split's memory, shared by the team (amx_x_at lays it out per call) */
    void *scratch; /* this thread's amx_scratch */
} mp_amx_ctx;

static inline void qlinear_unit(const mp_job *j, int64_t M, int64_t u, float *panel, float *accs, int64_t m0,
                                int64_t mc, const mp_amx_ctx *amx, const void *split) {
    const mp_qlinear *w = j->w;
#if AMX_ON
    if (M > 8 && amx) {
        amx_scratch *sc = (amx_scratch *)amx->scratch;
        amx_pair((const amx_x *)split, m0, mc, w->qt, w->dt, w->mt, (int)w->kind, w->N, u, sc->acc, sc->B, sc->C);
        amx_finish(sc->acc, m0, mc, w->N, u, j->y, NULL, NULL);
        return;
    }
#endif
    (void)amx, (void)split;
#if defined(__AVX512F__)
    if (M > 8) {
        qlane_pair(j->x + m0 * w->K, w->K, w->qt, w->dt, w->mt, (int)w->kind, j->y + m0 * w->N, mc, w->N, w->K, u,
                   panel, accs, NULL, NULL);
        return;
    }
#endif
    (void)panel, (void)accs;
    if (M <= 8) {
        qrow_one(j->x, w->K, w->rq, w->rd, w->rm, (int)w->kind, j->y, M, w->N, w->K, u);
        return;
    }
    for (int64_t r = m0; r < m0 + mc; r++) { /* portable, more than 8 rows: the lane layout's rule, this chunk's rows */
        const float *xr = j->x + r * w->K;
        float acc = 0.f;
        for (int64_t k = 0; k < w->K; k++) acc += xr[k] * q_weight((int)w->kind, w->qt, w->dt, w->mt, w->K, u, k);
        j->y[r * w->N + u] = acc;
    }
}

/* Inside a parallel region: every job's y = x @ W^T (+ bias), the jobs' units split over the team,
 * QROWS rows of x at a time (AMX_ROWS on the tiles, after the team splits x once for all the jobs:
 * a prefill's long step, so the rows every unit reads stay in cache, as in qmatmul_avx512 and
 * qmatmul_amx; each row's sums are the same whichever chunk it falls in). */
static void qlinear_jobs(const mp_job *jobs, int nj, int64_t M, float *panel, float *accs, const mp_amx_ctx *amx) {
    int64_t total = 0;
    for (int j = 0; j < nj; j++) total += qlinear_units(jobs[j].w, M);
    const void *split = NULL;
#if AMX_ON
    amx_x s;
    if (M > 8 && amx) { /* the jobs of one call read the same x: split it once, all rows */
        amx_x_at(&s, amx->buf, M, jobs[0].w->K);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < s.Mp; r++) amx_split_row(jobs[0].x, jobs[0].w->K, M, r, &s);
        split = &s;
    }
#endif
    const int64_t pass = split ? AMX_PASS : QROWS; /* rows of x per pass over the weights */
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t mc = M - m0 < pass ? M - m0 : pass;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < total; i++) {
            int j = 0;
            int64_t u = i;
            while (u >= qlinear_units(jobs[j].w, M)) u -= qlinear_units(jobs[j].w, M), j++;
            qlinear_unit(&jobs[j], M, u, panel, accs, m0, mc, amx, split);
        }
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
#if AMX_ON
    /* the AMX kernel's split of each linear's x: room for the widest (C, H D or I) */
    const int64_t Kmax = C > I ? (C > HD ? C : HD) : (I > HD ? I : HD);
    void *split_buf = (M > 8 && amx_on()) ? amx_buffer(amx_bytes(M, Kmax)) : NULL;
    if (M > 8 && amx_on() && !split_buf) return -2;
#endif
#pragma omp parallel
    {
        const mp_amx_ctx *amx = NULL;
#if AMX_ON
        amx_scratch scratch = {NULL, NULL, NULL};
        mp_amx_ctx amx_ctx = {split_buf, &scratch};
        if (split_buf) {
            if (!amx_scratch_alloc(&scratch, M < AMX_ROWS ? M : AMX_ROWS)) {
#pragma omp atomic write
                failed = 1;
            }
            amx = &amx_ctx;
        }
#endif
        float *panel = (float *)aligned_alloc(64, sizeof(float) * 32 * QKC);
        const int64_t rows_max = M < QROWS ? M : QROWS; /* the GEMMs take a long step QROWS rows at a time */
        float *accs = (float *)aligned_alloc(64, sizeof(float) * 32 * ((rows_max + QM - 1) / QM) * QM);
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
            qlinear_jobs(qkv, 3, M, panel, accs, amx);
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
            qlinear_jobs(o_job, 1, M, panel, accs, amx);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                rmsnorm_row(st->a + m * C, st->x + m * C, ly->post_norm, st->h + m * C, C, st->eps);
            const mp_job gate_up[2] = {{&ly->gate, st->h, st->g}, {&ly->up, st->h, st->u}};
            qlinear_jobs(gate_up, 2, M, panel, accs, amx);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) silu_mul_row(st->g + m * I, st->u + m * I, st->g + m * I, I);
            const mp_job down[1] = {{&ly->down, st->g, st->a}};
            qlinear_jobs(down, 1, M, panel, accs, amx);
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
#if AMX_ON
        amx_scratch_free(&scratch);
#endif
    }
    return failed ? -2 : 0;
}
