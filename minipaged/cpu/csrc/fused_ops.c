/* Included by kernels.c (one translation unit). */
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

