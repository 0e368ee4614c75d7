/* Part of experts.c (included once, where it stands): weight rows dotted with activations on the vector
   units, for every format (fp32 activations; bf16 x bf16 where AVX-512-BF16 is there). */

INLINE vf load_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

/* Bytes of one 32-weight block of a block format (Q8_0, MXFP4, FP8_B32). */
INLINE size_t block_bytes(int type) {
    return type == FT_Q8_0 ? Q8_BYTES : type == FT_MXFP4 ? MX_BYTES : FP8_BYTES;
}

INLINE vf load_bf16(const uint16_t *p) {  /* bf16 is the top half of an f32 */
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    vu16 h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu32) << 16);
#endif
}

/* GCC scalarises a generic int8 → float vector conversion, so x86 gets the widening instructions by name. */
INLINE vf load_q8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
    vf v;
    memcpy(&v, halves, sizeof v);
    return v;
#else
    vi8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
#endif
}

INLINE float bf16_scalar(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* Rounds to the nearest bf16 (ties to even), for callers whose GPU path rounds there too. */
INLINE float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

INLINE float f16_scalar(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  /* subnormal: renormalise */
        int shift = 0;
        while (!(man & 0x400)) { man <<= 1; shift++; }
        u = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* An f16 scale in every lane. On x86 a broadcast and one vector conversion: the scalar conversion's insert and
   broadcast took the shuffle port that the int8 widening of each block also needs. */
INLINE vf f16_splat(const uint8_t *p) {
#if defined(__AVX512F__)
    uint16_t h;
    memcpy(&h, p, 2);
    return (vf)_mm512_cvtph_ps(_mm256_set1_epi16((short)h));
#else
    return (vf){0} + f16_scalar(p);
#endif
}

/* MXFP4's 16 nibble values as the doubled e2m1 codes ±{0, 1, 2, 3, 4, 6, 8, 12} (the block's scale is halved). */
static const int8_t mxfp4_codes[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#if defined(__SSSE3__)
/* One half of an MXFP4 block's 16 code bytes `qs` looked up as int8 (`high`: the high nibbles, values 16..31). */
INLINE __m128i mxfp4_half(const uint8_t *qs, int high) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i nib = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F));
    return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)mxfp4_codes), nib);
}
#endif

/* The 16 values one half of an MXFP4 block codes (`high`: the high nibbles, values 16..31), unscaled. */
INLINE vf load_mxfp4(const uint8_t *qs, int high) {
#if defined(__AVX512F__) && defined(__SSSE3__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(mxfp4_half(qs, high)));
#else
    vf out;
    for (int i = 0; i < LANES; i++) out[i] = mxfp4_codes[high ? qs[i] >> 4 : qs[i] & 0x0F];
    return out;
#endif
}

/* 16 e4m3 values (sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities) as floats, exactly:
   a normal one's exponent and mantissa move into place with the bias made 127's, a subnormal one is m · 2^-9. */
INLINE vf load_fp8(const uint8_t *p) {
#if defined(__AVX512F__)
    vu32 b = (vu32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    vu32 b;
    for (int i = 0; i < LANES; i++) b[i] = p[i];
#endif
    vu32 em = b & 0x7F, sign = (b & 0x80) << 24;
    vu32 normal = (em << 20) + (120u << 23);
    vf sub = __builtin_convertvector(em, vf) * (1.0f / 512.0f);
    vu32 subnormal = (vu32)(em < 8);  /* all ones where the exponent field is 0 */
    return (vf)(((subnormal & (vu32)sub) | (~subnormal & normal)) | sign);
}

/* An MXFP4 block's scale, 2^(e - 128) (ggml's E8M0 halved, the codes being doubled), exactly. */
INLINE float mxfp4_scale(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One 32-value block of a block format (Q8_0, MXFP4, FP8_B32) as its two scaled halves, values 0..15 and 16..31.
   `type` is a compile-time constant where rows_dots inlines it, so the branches fold away. */
INLINE void block_weights(int type, const uint8_t *blk, vf *w0, vf *w1) {
    if (type == FT_Q8_0) {
        vf d = f16_splat(blk);
        *w0 = load_q8((const int8_t *)blk + 2) * d, *w1 = load_q8((const int8_t *)blk + 2 + LANES) * d;
    } else if (type == FT_MXFP4) {
        vf d = (vf){0} + mxfp4_scale(blk[0]);
        *w0 = load_mxfp4(blk + 1, 0) * d, *w1 = load_mxfp4(blk + 1, 1) * d;
    } else {
        float scale;
        memcpy(&scale, blk, 4);
        vf d = (vf){0} + scale;
        *w0 = load_fp8(blk + 4) * d, *w1 = load_fp8(blk + 4 + LANES) * d;
    }
}

INLINE float hsum(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

/* Software prefetch this many bytes ahead in each weight row while the vector paths dot it (0: off; set by
   ft_set_dots_prefetch). The L2 streamer stalls at each 4 KiB page of a row, and the more arithmetic a byte takes
   (more tokens, block formats) the less the core's own requests make up for it. 4 KiB ahead, everywhere: on a
   Zen 3 VM (8-lane dots, 2 threads) BF16 1.02-1.24x and Q8_0 1.0-1.29x at 1-8 tokens, CPU-only Mixtral decode
   1.11x (evals/results/cpu-kernel-avx2-ci-class.md); on the H100 test machine's host (15 threads) BF16 1.19x and
   Q8_0 1.15x at one token, equal at 2-8, and D1 decode at expert budget 0 1.10x (Q8_0) and 1.12x (bf16)
   (evals/results/cpu-kernel-q16-rows.md). */
static int dots_prefetch = 4096;

INLINE void prefetch_ahead(const void *row, size_t at) {
    if (dots_prefetch) __builtin_prefetch((const uint8_t *)row + at + dots_prefetch, 0, 3);
}

/* out[r * TILE + t] = rows[r] . xs[t] for r < nr, t < nt. nr and nt are compile-time constants at every call
   site (always_inline), so the nr * nt accumulators live in registers; two rows give the FMA units independent
   chains even at batch 1 and share each activation load. k is the row length in weights. */
INLINE void rows_dots(int type, const void *const *rows, int nr, const float *const *xs, int k, int nt,
                      float *out) {
    vf acc[2][TILE], acc_hi[2][TILE];  /* Q8_0: a block's two halves accumulate apart (independent FMAs) */
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = acc_hi[r][t] = (vf){0};
    int kv = 0;
    if (type == FT_Q8_0 && nt == 1) {
        /* one token: the block's two halves dotted first, then scaled into the sum (3 vector ops per block and
           row instead of 4: the scale multiplies one partial sum, not both weight halves) */
        for (size_t b = 0; kv < k; kv += Q8_BLOCK, b += Q8_BYTES) {
            vf x0 = load_f32(xs[0] + kv), x1 = load_f32(xs[0] + kv + LANES);
            for (int r = 0; r < nr; r++) {
                const uint8_t *blk = (const uint8_t *)rows[r] + b;
                prefetch_ahead(rows[r], b);
                vf s = load_q8((const int8_t *)blk + 2) * x0;
                s += load_q8((const int8_t *)blk + 2 + LANES) * x1;
                if (b / Q8_BYTES & 1) acc_hi[r][0] += s * f16_splat(blk);
                else acc[r][0] += s * f16_splat(blk);
            }
        }
        for (int r = 0; r < nr; r++) acc[r][0] += acc_hi[r][0];
    } else if (type == FT_Q8_0 || type == FT_MXFP4 || type == FT_FP8) {
        size_t bytes = block_bytes(type);
        for (size_t b = 0; kv < k; kv += Q8_BLOCK, b += bytes) {
            vf x0[TILE], x1[TILE];
            for (int t = 0; t < nt; t++) x0[t] = load_f32(xs[t] + kv), x1[t] = load_f32(xs[t] + kv + LANES);
            for (int r = 0; r < nr; r++) {
                vf w0, w1;
                prefetch_ahead(rows[r], b);
                block_weights(type, (const uint8_t *)rows[r] + b, &w0, &w1);
                for (int t = 0; t < nt; t++) acc[r][t] += w0 * x0[t], acc_hi[r][t] += w1 * x1[t];
            }
        }
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < nt; t++) acc[r][t] += acc_hi[r][t];
    } else {
        for (; kv + LANES <= k; kv += LANES) {
            vf x[TILE];
            for (int t = 0; t < nt; t++) x[t] = load_f32(xs[t] + kv);
            for (int r = 0; r < nr; r++) {
                if (type == FT_BF16 && !(kv & 31)) prefetch_ahead(rows[r], (size_t)kv * 2);
                vf w = type == FT_BF16 ? load_bf16((const uint16_t *)rows[r] + kv)
                                       : load_f32((const float *)rows[r] + kv);
                for (int t = 0; t < nt; t++) acc[r][t] += w * x[t];
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float s = hsum(acc[r][t]);
            for (int j = kv; j < k; j++)  /* tail of rows whose length is not a multiple of LANES */
                s += (type == FT_BF16 ? bf16_scalar(((const uint16_t *)rows[r])[j]) : ((const float *)rows[r])[j])
                     * xs[t][j];
            out[r * TILE + t] = s;
        }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "dots_avx2.h"
#define ROWS_DOTS(NR, NT)                                                       \
    do {                                                                        \
        if (avx2_dots) rows_dots_avx2(type, rows, NR, xs + t0, k, NT, tile);    \
        else rows_dots(type, rows, NR, xs + t0, k, NT, tile);                   \
    } while (0)
#define HAVE_AVX2_DOTS 1
#else
#define ROWS_DOTS(NR, NT) rows_dots(type, rows, NR, xs + t0, k, NT, tile)
#define HAVE_AVX2_DOTS 0
#endif

/* rows_dots over any number of tokens, in tiles of TILE; each row is read from DRAM once, later tiles find it
   in L1. nr is 1 or 2; both rows have the same format. */
static void rows_dots_n(int type, const void *const *rows, int nr, const float *const *xs, int k, int n,
                        float *out) {
    for (int t0 = 0; t0 < n; t0 += TILE) {
        int nt = n - t0 < TILE ? n - t0 : TILE;
        float tile[2 * TILE];
#define CASES(NR)                                                                              \
    switch (nt) {                                                                             \
        case 1: ROWS_DOTS(NR, 1); break;                                                      \
        case 2: ROWS_DOTS(NR, 2); break;                                                      \
        case 3: ROWS_DOTS(NR, 3); break;                                                      \
        default: ROWS_DOTS(NR, 4); break;                                                     \
    }
#define FORMATS(NR)                       \
    if (type == FT_Q8_0) { CASES(NR) }    \
    else if (type == FT_MXFP4) { CASES(NR) } \
    else if (type == FT_FP8) { CASES(NR) } \
    else if (type == FT_BF16) { CASES(NR) } \
    else { CASES(NR) }
        if (nr == 2) { FORMATS(2) } else { FORMATS(1) }
#undef FORMATS
#undef CASES
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < nt; t++) out[r * n + t0 + t] = tile[r * TILE + t];
    }
}

#if defined(__AVX512BF16__)
enum { BF16_TILE = 8 };  /* tokens a pass: 2 rows x 8 tokens of accumulators, 8 activations, the weights: 26 of 32 */

/* 32 weights of a row from column kv as bf16: bf16 rows as they are; a block format's block dequantized in
   registers and rounded to bf16, the weights a bf16 GPU expert computes with after dequantization (and the AMX
   path's, amx_block_tile). */
INLINE __m512bh row_bf16(int type, const void *row, int kv) {
    if (type == FT_BF16) return (__m512bh)_mm512_loadu_si512((const uint16_t *)row + kv);
    vf w0, w1;
    block_weights(type, (const uint8_t *)row + (size_t)(kv / Q8_BLOCK) * block_bytes(type), &w0, &w1);
    return _mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0);
}

/* bf16 weights (or block-format weights dequantized to bf16 once per pass, shared by the pass's tokens) times
   bf16 activations with vdpbf16ps: 32 products per instruction, exact in fp32. Used when the model runs in
   bf16, where the activations are bf16 values anyway. At several tokens this is what keeps a block format off
   the fp32 path's per-token widening: Q8_0 at 8 tokens ran there at 20-33 % of DRAM. */
INLINE void rows_dots_bf16(int type, const void *const *rows, int nr, const uint16_t *const *xs, int k, int nt,
                           float *out) {
    __m512 acc[2][BF16_TILE];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = _mm512_setzero_ps();
    int kv = 0;
    for (; kv + 32 <= k; kv += 32) {
        __m512bh x[BF16_TILE];
        for (int t = 0; t < nt; t++) x[t] = (__m512bh)_mm512_loadu_si512(xs[t] + kv);
        for (int r = 0; r < nr; r++) {
            prefetch_ahead(rows[r], type == FT_BF16 ? kv * 2u : kv / Q8_BLOCK * block_bytes(type));
            __m512bh w = row_bf16(type, rows[r], kv);
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w, x[t]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float s = _mm512_reduce_add_ps(acc[r][t]);
            for (int j = kv; j < k; j++) s += bf16_scalar(((const uint16_t *)rows[r])[j]) * bf16_scalar(xs[t][j]);
            out[r * BF16_TILE + t] = s;  /* (a tail only in bf16 rows: block formats come in whole blocks) */
        }
}

/* rows_dots_bf16 over any number of tokens, BF16_TILE a pass; nr is 1 or 2, both rows in format `type`. */
static void rows_dots_bf16_n(int type, const void *const *rows, int nr, const uint16_t *const *xs, int k, int n,
                             float *out) {
    for (int t0 = 0; t0 < n; t0 += BF16_TILE) {
        int nt = n - t0 < BF16_TILE ? n - t0 : BF16_TILE;
        float tile[2 * BF16_TILE];
#define CASES(TYPE, NR)                                                                     \
    switch (nt) {                                                                          \
        case 1: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 1, tile); break;                \
        case 2: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 2, tile); break;                \
        case 3: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 3, tile); break;                \
        case 4: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 4, tile); break;                \
        case 5: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 5, tile); break;                \
        case 6: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 6, tile); break;                \
        case 7: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 7, tile); break;                \
        default: rows_dots_bf16(TYPE, rows, NR, xs + t0, k, 8, tile); break;               \
    }
#define FORMATS(NR)                                \
    if (type == FT_Q8_0) { CASES(FT_Q8_0, NR) }    \
    else if (type == FT_MXFP4) { CASES(FT_MXFP4, NR) } \
    else if (type == FT_FP8) { CASES(FT_FP8, NR) } \
    else { CASES(FT_BF16, NR) }
        if (nr == 2) { FORMATS(2) } else { FORMATS(1) }
#undef FORMATS
#undef CASES
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < nt; t++) out[r * n + t0 + t] = tile[r * BF16_TILE + t];
    }
}
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
static void rows_dots_bf16_n(int type, const void *const *rows, int nr, const uint16_t *const *xs, int k, int n,
                             float *out) {
    (void)type, (void)rows, (void)nr, (void)xs, (void)k, (void)n, (void)out;  /* never called: xb is NULL without it */
}
#endif
