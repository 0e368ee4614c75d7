/* Part of experts.c (included once, where it stands): the experts' epilogues. The expert function between the
   projections, act = silu(g) * u or a model's form of it, and each pair's output (its down dot times its routing
   weight); per value, and over a vector of values, where the sigmoid's exp is a vector polynomial instead of one
   libm call a value (a tile's epilogue computes 256 values). */

/* e^x in every lane, within ~1 ulp of expf: n = round(x / ln 2) by the 1.5 * 2^23 trick, r = x - n ln 2 in two
   parts (Cody-Waite), Cephes' degree-7 polynomial for e^r, 2^n built in the exponent bits. x is clamped to
   [-87.3, 88.7], so the result is +inf from ~88.4 up (expf's from 88.73) and ~1e-38 below -87.3: silu(g) is then
   exactly g above 87.3, and -0 instead of a value under 4e-37 below -88.4. */
INLINE vf vexpf(vf x) {
    vi32 low = x < -87.3f, high = x > 88.7f;
    x = (vf)((low & (vi32)((vf){0} - 87.3f)) | (high & (vi32)((vf){0} + 88.7f)) | (~(low | high) & (vi32)x));
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits */
    vf t = x * 1.44269504088896341f + magic, n = t - magic;
    vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi32 e = ((vi32)t - (vi32)((vf){0} + magic) + 127) << 23;  /* n + 127 in the exponent field */
    return p * (vf)e;
}

INLINE vf vround_bf16(vf f) {  /* round_bf16 in every lane */
    vu32 u = (vu32)f;
    return (vf)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

INLINE vf vmin_s(vf v, float c) {
    vi32 below = v < c;
    return (vf)((below & (vi32)v) | (~below & (vi32)((vf){0} + c)));
}

INLINE vf vmax_s(vf v, float c) {
    vi32 above = v > c;
    return (vf)((above & (vi32)v) | (~above & (vi32)((vf){0} + c)));
}

/* act of one (row, pair) from its gate and up dots: silu(g) * u, or the job's form (biases, clamped SwiGLU).
   With bf16 rounding it rounds where a bf16 GPU expert rounds: the dots, (then the biased values,) the result. */
INLINE float expert_act(const moe_job *j, int expert, int row, float g, float u) {
    if (!j->gate_bias && j->activation != 1) {  /* SwiGLU, V4's with its clamps first: rounded as a plain expert */
        if (j->bf16_rounding) g = round_bf16(g), u = round_bf16(u);
        if (j->activation == 2) g = fminf(g, j->limit), u = fmaxf(fminf(u, j->limit), -j->limit);
        if (!j->bf16_rounding) return g / (1.0f + expf(-g)) * u;
        return round_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
    }
    if (j->bf16_rounding) g = round_bf16(g), u = round_bf16(u);
    if (j->gate_bias) {
        g += j->gate_bias[(size_t)expert * j->inter + row];
        u += j->up_bias[(size_t)expert * j->inter + row];
        if (j->bf16_rounding) g = round_bf16(g), u = round_bf16(u);
    }
    float a;
    if (j->activation == 2) {
        g = fminf(g, j->limit);
        u = fmaxf(fminf(u, j->limit), -j->limit);
        a = g / (1.0f + expf(-g)) * u;
    } else if (j->activation) {
        g = fminf(g, j->limit);
        u = fmaxf(fminf(u, j->limit), -j->limit);
        a = (u + 1.0f) * (g / (1.0f + expf(-j->alpha * g)));
    } else {
        a = g / (1.0f + expf(-g)) * u;
    }
    return j->bf16_rounding ? round_bf16(a) : a;
}

/* One pair's contribution to output row h: its down dot (plus the expert's bias) times its routing weight. */
INLINE float expert_out(const moe_job *j, int expert, int h, float v, float w) {
    if (j->down_bias) {
        v = j->bf16_rounding ? round_bf16(v) : v;
        v += j->down_bias[(size_t)expert * j->hidden + h];
    }
    return j->bf16_rounding ? round_bf16(round_bf16(v) * round_bf16(w)) : v * w;
}

/* Switch for measuring: expert_acts and expert_outs compute their values one by one (0) instead of LANES at a
   time (1). */
static int vector_act = 1;

/* Whether expert_acts takes the job's values LANES at a time: the common forms (SwiGLU and DeepSeek-V4's clamped
   one, no biases). */
INLINE int acts_in_vectors(const moe_job *j) { return vector_act && !j->gate_bias && j->activation != 1; }

/* expert_act for n values of one row (g[i], u[i] -> out[i]): LANES at a time where acts_in_vectors, the rest one
   by one. */
INLINE void expert_acts(const moe_job *j, int expert, int row, const float *g, const float *u, int n, float *out) {
    int i = 0;
    if (acts_in_vectors(j))
        for (; i + LANES <= n; i += LANES) {
            vf gv = load_f32(g + i), uv = load_f32(u + i), a;
            if (j->bf16_rounding) gv = vround_bf16(gv), uv = vround_bf16(uv);
            if (j->activation == 2) gv = vmin_s(gv, j->limit), uv = vmax_s(vmin_s(uv, j->limit), -j->limit);
            a = gv / (1.0f + vexpf(-gv));
            a = j->bf16_rounding ? vround_bf16(vround_bf16(a) * uv) : a * uv;
            memcpy(out + i, &a, sizeof a);
        }
    for (; i < n; i++) out[i] = expert_act(j, expert, row, g[i], u[i]);
}

/* Whether expert_outs takes the job's values LANES at a time: experts without a down bias. */
INLINE int outs_in_vectors(const moe_job *j) { return vector_act && !j->down_bias; }

/* expert_out for n pairs of one output row (down dots d[i], routing weights w[i] -> out[i]): LANES at a time where
   outs_in_vectors, the rest one by one. */
INLINE void expert_outs(const moe_job *j, int expert, int h, const float *d, const float *w, int n, float *out) {
    int i = 0;
    if (outs_in_vectors(j))
        for (; i + LANES <= n; i += LANES) {
            vf v = load_f32(d + i), wv = load_f32(w + i);
            v = j->bf16_rounding ? vround_bf16(vround_bf16(v) * vround_bf16(wv)) : v * wv;
            memcpy(out + i, &v, sizeof v);
        }
    for (; i < n; i++) out[i] = expert_out(j, expert, h, d[i], w[i]);
}
