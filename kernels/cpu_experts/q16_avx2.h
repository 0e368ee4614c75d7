/* Part of experts.c (included by q16.h wherever AVX2, FMA and F16C are): the int16-activation path on 8-lane
   registers. The default without AVX-512 (desktop Intel since Alder Lake, AMD before Zen 4); with AVX-512,
   ft_set_avx2_dots turns it on so tests check it against the 16-lane form on any x86 CI machine.
   The same arithmetic as q16.h's 16-lane form: a block's 32 weights widened to int16 and multiplied by the
   quantized activations in two vpmaddwd (exact int32), 8 blocks' sums gathered into one vector by a hadd tree and
   scaled at once. The 8-lane fp32 path spends ~20 ops per block and row widening int8 to fp32; this one ~8. The
   activations are quantized as q16.h does (the same int16 values and scales); only the order in which block sums
   are added differs. */
#define HAVE_Q16_AVX2 1

/* One block's int32 products, summed in pairs then across its halves (8 lanes), zero for a block past the row's
   end. Values 0..15 come from the first 16 weights (Q8_0) or the low nibbles (MXFP4), 16..31 from the rest. */
INLINE __m256i q16_madd_avx2(int type, const uint8_t *blk, const int16_t *xq, int live) {
    if (!live) return _mm256_setzero_si256();
    __m128i lo, hi;
    if (type == FT_MXFP4) {
        lo = mxfp4_half(blk + 1, 0), hi = mxfp4_half(blk + 1, 1);
    } else {
        lo = _mm_loadu_si128((const __m128i *)(blk + 2)), hi = _mm_loadu_si128((const __m128i *)(blk + 18));
    }
    __m256i p0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(lo), _mm256_loadu_si256((const __m256i *)xq));
    __m256i p1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(hi), _mm256_loadu_si256((const __m256i *)(xq + 16)));
    return _mm256_add_epi32(p0, p1);
}

/* Lane i of the result = the sum of block i's products, for the n <= 8 blocks from blk (each 128-bit half of
   hadd(hadd(a, b), hadd(c, d)) holds a, b, c, d's four-lane sums in order; the halves are added last). */
INLINE __m256i q16_block_sums_avx2(int type, const uint8_t *blk, const int16_t *xq, int n) {
    size_t bytes = block_bytes(type);
    __m256i v[8];
    for (int i = 0; i < 8; i++) v[i] = q16_madd_avx2(type, blk + i * bytes, xq + i * Q8_BLOCK, i < n);
    __m256i lo = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* The weight scales of the n <= 8 blocks from blk as floats, zero past n (f16 for Q8_0; E8M0 for MXFP4, as
   mxfp4_scale reads it). Scalar loads: an AVX2 gather is no cheaper for 8 lanes on Zen 3. */
INLINE __m256 q16_scales_avx2(int type, const uint8_t *blk, int n) {
    size_t bytes = block_bytes(type);
    if (type == FT_MXFP4) {
        float s[8] = {0};
        for (int i = 0; i < n; i++) s[i] = mxfp4_scale(blk[i * bytes]);
        return _mm256_loadu_ps(s);
    }
    uint16_t h[8] = {0};
    for (int i = 0; i < n; i++) memcpy(&h[i], blk + i * bytes, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* The activations' scales of the n <= 8 blocks from xs, zero past n (never read beyond the row). */
INLINE __m256 q16_x_scales_avx2(const float *xs, int n) {
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(xs, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
}

/* A group of n <= 8 blocks from blk dotted with their activations and scaled, added to acc. */
INLINE __m256 q16_group_avx2(int type, const uint8_t *blk, const int16_t *xq, __m256 x_scales, int n, __m256 acc) {
    __m256 scales = _mm256_mul_ps(q16_scales_avx2(type, blk, n), x_scales);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q16_block_sums_avx2(type, blk, xq, n)), scales, acc);
}

/* row (Q8_0 or MXFP4, k weights) . x (int16 xq with per-block scales xs). */
INLINE float q16_dot_avx2_of(int type, const uint8_t *row, const int16_t *xq, const float *xs, int k) {
    __m256 acc = _mm256_setzero_ps();
    int blocks = k / Q8_BLOCK;
    for (int b0 = 0; b0 < blocks; b0 += 8) {
        int n = blocks - b0 < 8 ? blocks - b0 : 8;
        size_t at = (size_t)b0 * block_bytes(type);
        if (dots_prefetch)
            for (size_t line = 0; line < 8 * block_bytes(type); line += 64) prefetch_ahead(row + at, line);
        acc = q16_group_avx2(type, row + at, xq + (size_t)b0 * Q8_BLOCK, q16_x_scales_avx2(xs + b0, n), n, acc);
    }
    return avx2_hsum(acc);
}


/* Two rows against the same activations, interleaved (two DRAM streams): the same sums as q16_dot's, in the same
   order, so both forms agree bit for bit. out[0], out[1]. */
INLINE void q16_dot2_avx2_of(int type, const uint8_t *row0, const uint8_t *row1, const int16_t *xq, const float *xs,
                        int k, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int blocks = k / Q8_BLOCK;
    for (int b0 = 0; b0 < blocks; b0 += 8) {
        int n = blocks - b0 < 8 ? blocks - b0 : 8;
        size_t at = (size_t)b0 * block_bytes(type);
        const int16_t *x = xq + (size_t)b0 * Q8_BLOCK;
        if (dots_prefetch)
            for (size_t line = 0; line < 8 * block_bytes(type); line += 64)
                prefetch_ahead(row0 + at, line), prefetch_ahead(row1 + at, line);
        __m256 x_scales = q16_x_scales_avx2(xs + b0, n);
        acc0 = q16_group_avx2(type, row0 + at, x, x_scales, n, acc0);
        acc1 = q16_group_avx2(type, row1 + at, x, x_scales, n, acc1);
    }
    out[0] = avx2_hsum(acc0);
    out[1] = avx2_hsum(acc1);
}


/* x[0..32) → q (int16) and its power-of-two scale, as q16.h's 16-lane form computes them. */
INLINE void q16_quantize_block_avx2(const float *x, int16_t *q, float *scale) {
    __m256 v[4], most = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        most = _mm256_max_ps(most, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    if (_mm256_movemask_ps(nan)) top = NAN;  /* keep the fp32 path's NaN: the scale carries it */
    int e = 0;
    if (!(top > 0.0f) || !isfinite(top)) {
        memset(q, 0, Q8_BLOCK * 2);
        *scale = top > 0.0f || top != top ? top : 0.0f;
        return;
    }
    frexpf(top, &e);  /* top < 2^e, so x * 2^(15 - e) < 2^15 (rounding may reach it: packs saturates) */
    __m256 inv = _mm256_set1_ps(ldexpf(1.0f, 15 - e));
    __m256i i[4];
    for (int h = 0; h < 4; h++) i[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], inv));
    /* packs interleaves its operands per 128-bit half; the 64-bit permute puts values back in order */
    _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xD8));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xD8));
    *scale = ldexpf(1.0f, e - 15);
}
