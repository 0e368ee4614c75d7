/* Part of experts.c (included once, where it stands): Q8_0 and MXFP4 rows against int16 activations. */

static int q16_two_rows = 1;  /* ft_set_q16_form: rows dotted in interleaved pairs (1) or one at a time (0) */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "q16_avx2.h"  /* the 8-lane form: the default without AVX-512, and where ft_set_avx2_dots turns it on */
#else
#define HAVE_Q16_AVX2 0
#endif

#if defined(__AVX512BW__) && defined(__AVX512F__) && HAVE_Q16_AVX2
/* Block-format weights against int16 activations (a bf16 model's Q8_0 or MXFP4 experts at one token per expert:
   decode; Q8_0 at 3-5 tokens takes q16_rows.h, other token counts the fp32 path or tiles).
   The fp32 path spends ~14 vector ops per block and row widening int8 to fp32 and scaling; here a block is one
   widening to int16 (MXFP4: its codes looked up as the doubled e2m1 integers first) and one vpmaddwd (exact int32
   products), and the per-block scale is applied to 16 blocks at once: their 16 partial vectors are summed into
   one vector of 16 block sums by a transpose-add tree, scaled by the 16 gathered scales (f16 for Q8_0, E8M0 for
   MXFP4, both exact in fp32), and accumulated. Activations are quantized per 32-block with a power-of-two scale:
   a bf16 value within 2^8 of its block's largest is exact, smaller ones err by at most 2^-16 of that largest (far
   below bf16's own rounding). Rows are dotted one at a time (one DRAM stream), or two interleaved (q16_dot2).
   `type` (FT_Q8_0 or FT_MXFP4) is a compile-time constant wherever these inline. */
#define HAVE_Q16_AVX512 1
INLINE __m512i q16_pairs(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
INLINE __m512i q16_quads(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
INLINE __m512i q16_lanes(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

/* A block's 32 weights as int16, in value order (MXFP4: low nibbles are values 0..15, high nibbles 16..31, each
   code looked up as its doubled e2m1 value, as load_mxfp4 does). */
INLINE __m512i q16_weights(int type, const uint8_t *blk) {
    if (type == FT_MXFP4)
        return _mm512_cvtepi8_epi16(_mm256_set_m128i(mxfp4_half(blk + 1, 1), mxfp4_half(blk + 1, 0)));
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2)));
}

/* One block's int32 products summed in pairs (vpmaddwd), zero for a block past the row's end. */
INLINE __m512i q16_madd(int type, const uint8_t *blk, const int16_t *xq, int live) {
    if (!live) return _mm512_setzero_si512();
    return _mm512_madd_epi16(q16_weights(type, blk), _mm512_loadu_si512(xq));
}

/* Blocks b..b+3 of 16 (from blk, activations xq) reduced as far as a quad of the tree: summed four at a time,
   so two rows' trees fit in registers at once. */
INLINE __m512i q16_quad(int type, const uint8_t *blk, const int16_t *xq, int b, int n) {
    size_t bytes = block_bytes(type);
    __m512i p0 = q16_pairs(q16_madd(type, blk + b * bytes, xq + b * Q8_BLOCK, b < n),
                           q16_madd(type, blk + (b + 1) * bytes, xq + (b + 1) * Q8_BLOCK, b + 1 < n));
    __m512i p1 = q16_pairs(q16_madd(type, blk + (b + 2) * bytes, xq + (b + 2) * Q8_BLOCK, b + 2 < n),
                           q16_madd(type, blk + (b + 3) * bytes, xq + (b + 3) * Q8_BLOCK, b + 3 < n));
    return q16_quads(p0, p1);
}

/* Lane i of the result = sum of the lanes of block i's products (the tree keeps block order: checked by the
   tests). */
INLINE __m512i q16_block_sums(int type, const uint8_t *blk, const int16_t *xq, int n) {
    __m512i q0 = q16_quad(type, blk, xq, 0, n), q1 = q16_quad(type, blk, xq, 4, n);
    __m512i q2 = q16_quad(type, blk, xq, 8, n), q3 = q16_quad(type, blk, xq, 12, n);
    return q16_lanes(q16_lanes(q0, q1), q16_lanes(q2, q3));
}

/* The scales of the n <= 16 blocks from blk, as floats (zero past n): one gather (16 scalar loads measured the
   same on the H200 host, 71.4 against 71.2 GB/s). Q8_0's are f16; MXFP4's E8M0 byte e is 2^(e - 128) here (the
   codes are doubled), exact as mxfp4_scale computes it: (e - 1) << 23 as float bits, the two smallest
   subnormal. */
INLINE __m512 q16_scales(int type, const uint8_t *blk, int n) {
    const __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i offsets = _mm512_mullo_epi32(index, _mm512_set1_epi32((int)block_bytes(type)));
    __m512i raw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << n) - 1), offsets, blk, 1);
    if (type == FT_MXFP4) {
        __m512i e = _mm512_and_si512(raw, _mm512_set1_epi32(0xFF));
        __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
        __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
        return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
    }
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
}

/* row (Q8_0 or MXFP4, k weights) . x (int16 xq with per-block scales xs). */
INLINE float q16_dot_of(int type, const uint8_t *row, const int16_t *xq, const float *xs, int k) {
    __m512 acc = _mm512_setzero_ps();
    int blocks = k / Q8_BLOCK;
    for (int b0 = 0; b0 < blocks; b0 += 16) {
        int n = blocks - b0 < 16 ? blocks - b0 : 16;
        const uint8_t *blk = row + (size_t)b0 * block_bytes(type);
        const int16_t *x = xq + (size_t)b0 * Q8_BLOCK;
        __m512 scales = _mm512_mul_ps(q16_scales(type, blk, n),
                                      _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), xs + b0));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q16_block_sums(type, blk, x, n)), scales, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Two rows against the same activations, interleaved: two DRAM streams, as the other paths read (one stream at a
   time was slower on the H200 host). out[0], out[1]. */
INLINE void q16_dot2_of(int type, const uint8_t *row0, const uint8_t *row1, const int16_t *xq, const float *xs,
                        int k, float *out) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int blocks = k / Q8_BLOCK;
    for (int b0 = 0; b0 < blocks; b0 += 16) {
        int n = blocks - b0 < 16 ? blocks - b0 : 16;
        size_t at = (size_t)b0 * block_bytes(type);
        const uint8_t *blk0 = row0 + at, *blk1 = row1 + at;
        const int16_t *x = xq + (size_t)b0 * Q8_BLOCK;
        if (dots_prefetch)  /* the 16 blocks' lines this far ahead in both rows */
            for (size_t line = 0; line < 16 * block_bytes(type); line += 64)
                prefetch_ahead(blk0, line), prefetch_ahead(blk1, line);
        __m512 xsc = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), xs + b0);
        __m512i q00 = q16_quad(type, blk0, x, 0, n), q10 = q16_quad(type, blk1, x, 0, n);
        __m512i q01 = q16_quad(type, blk0, x, 4, n), q11 = q16_quad(type, blk1, x, 4, n);
        __m512i h0 = q16_lanes(q00, q01), h1 = q16_lanes(q10, q11);
        __m512i q02 = q16_quad(type, blk0, x, 8, n), q12 = q16_quad(type, blk1, x, 8, n);
        __m512i q03 = q16_quad(type, blk0, x, 12, n), q13 = q16_quad(type, blk1, x, 12, n);
        __m512i s0 = q16_lanes(h0, q16_lanes(q02, q03)), s1 = q16_lanes(h1, q16_lanes(q12, q13));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(q16_scales(type, blk0, n), xsc), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(q16_scales(type, blk1, n), xsc), acc1);
    }
    out[0] = _mm512_reduce_add_ps(acc0);
    out[1] = _mm512_reduce_add_ps(acc1);
}

/* x[0..32) → q (int16) and its scale: a power of two, so q * scale is x exactly for bf16 values near the max. */
INLINE void q16_quantize_block(const float *x, int16_t *q, float *scale) {
    __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    float most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    int e = 0;
    if (!(most > 0.0f) || !isfinite(most)) {  /* zeros (or a non-finite value: keep the fp32 path's NaN) */
        memset(q, 0, Q8_BLOCK * 2);
        *scale = most > 0.0f || most != most ? most : 0.0f;
        return;
    }
    frexpf(most, &e);  /* most < 2^e, so x * 2^(15 - e) < 2^15 */
    __m512 inv = _mm512_set1_ps(ldexpf(1.0f, 15 - e));
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv))));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv))));
    *scale = ldexpf(1.0f, e - 15);
}

#include "q16_rows.h"
#else
#define HAVE_Q16_AVX512 0
#endif
#if !HAVE_Q16_AVX512
#define HAVE_Q16_ROWS 0
#endif

/* The path's entry points: the 16-lane form where the build has it, unless the 8-lane dots are switched on (both
   forms quantize to the same int16 values; their sums differ in order only). */
#define HAVE_Q16 HAVE_Q16_AVX2
#if HAVE_Q16
static float q16_dot(int type, const uint8_t *row, const int16_t *xq, const float *xs, int k) {
#if HAVE_Q16_AVX512
    if (!avx2_dots)
        return type == FT_MXFP4 ? q16_dot_of(FT_MXFP4, row, xq, xs, k) : q16_dot_of(FT_Q8_0, row, xq, xs, k);
#endif
    return type == FT_MXFP4 ? q16_dot_avx2_of(FT_MXFP4, row, xq, xs, k) : q16_dot_avx2_of(FT_Q8_0, row, xq, xs, k);
}

static void q16_dot2(int type, const uint8_t *row0, const uint8_t *row1, const int16_t *xq, const float *xs, int k,
                     float *out) {
#if HAVE_Q16_AVX512
    if (!avx2_dots) {
        if (type == FT_MXFP4) q16_dot2_of(FT_MXFP4, row0, row1, xq, xs, k, out);
        else q16_dot2_of(FT_Q8_0, row0, row1, xq, xs, k, out);
        return;
    }
#endif
    if (type == FT_MXFP4) q16_dot2_avx2_of(FT_MXFP4, row0, row1, xq, xs, k, out);
    else q16_dot2_avx2_of(FT_Q8_0, row0, row1, xq, xs, k, out);
}

static void q16_quantize(const float *x, int16_t *q, float *scales, int k) {
#if HAVE_Q16_AVX512
    if (!avx2_dots) {
        for (int b = 0; b < k / Q8_BLOCK; b++) q16_quantize_block(x + b * Q8_BLOCK, q + b * Q8_BLOCK, scales + b);
        return;
    }
#endif
    for (int b = 0; b < k / Q8_BLOCK; b++) q16_quantize_block_avx2(x + b * Q8_BLOCK, q + b * Q8_BLOCK, scales + b);
}
#endif
