/* Part of experts.c (included once, where it stands): Q8_0 rows against int16 activations. */

#if defined(__AVX512BW__) && defined(__AVX512F__)
/* Q8_0 weights against int16 activations (a bf16 model's Q8_0 experts at one token per expert:
   decode; several tokens share the fp32 path's widened weights, which is faster there).
   The fp32 path spends ~14 vector ops per block and row widening int8 to fp32 and scaling; here a block is one
   sign extension to int16 and one vpmaddwd (exact int32 products), and the per-block scale is applied to 16
   blocks at once: their 16 partial vectors are summed into one vector of 16 block sums by a transpose-add tree,
   scaled by the 16 gathered f16 scales, and accumulated. Activations are quantized per 32-block with a
   power-of-two scale: a bf16 value within 2^8 of its block's largest is exact, smaller ones err by at most
   2^-16 of that largest (far below bf16's own rounding). Rows are dotted one at a time (one DRAM stream). */
#define HAVE_Q16 1
INLINE __m512i q16_pairs(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
INLINE __m512i q16_quads(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
INLINE __m512i q16_lanes(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

/* Lane i of the result = sum of the lanes of v[i] (the tree keeps block order: checked by the tests). */
INLINE __m512i q16_block_sums(const __m512i *v) {
    __m512i pairs[8], quads[4];
    for (int i = 0; i < 8; i++) pairs[i] = q16_pairs(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 4; i++) quads[i] = q16_quads(pairs[2 * i], pairs[2 * i + 1]);
    return q16_lanes(q16_lanes(quads[0], quads[1]), q16_lanes(quads[2], quads[3]));
}

/* row (Q8_0, k weights) . x (int16 xq with per-block scales xs). */
static float q16_dot(const uint8_t *row, const int16_t *xq, const float *xs, int k) {
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(Q8_BYTES));
    __m512 acc = _mm512_setzero_ps();
    int blocks = k / Q8_BLOCK;
    for (int b0 = 0; b0 < blocks; b0 += 16) {
        int n = blocks - b0 < 16 ? blocks - b0 : 16;
        const uint8_t *blk = row + (size_t)b0 * Q8_BYTES;
        __m512i v[16];
        for (int i = 0; i < 16; i++)
            v[i] = i < n ? _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + i * Q8_BYTES + 2))),
                                             _mm512_loadu_si512(xq + (size_t)(b0 + i) * Q8_BLOCK))
                         : _mm512_setzero_si512();
        __mmask16 live = (__mmask16)((1u << n) - 1);
        __m512i raw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, blk, 1);
        __m512 scales = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw)), _mm512_maskz_loadu_ps(live, xs + b0));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q16_block_sums(v)), scales, acc);
    }
    return _mm512_reduce_add_ps(acc);
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

static void q16_quantize(const float *x, int16_t *q, float *scales, int k) {
    for (int b = 0; b < k / Q8_BLOCK; b++) q16_quantize_block(x + b * Q8_BLOCK, q + b * Q8_BLOCK, scales + b);
}
#else
#define HAVE_Q16 0
#endif
