/* Part of experts.c (included by dots.h where the compiler targets AVX2 and FMA): rows_dots on 8-lane registers,
   for CPUs without AVX-512 (most desktop Intel cores since Alder Lake, AMD before Zen 4).
   rows_dots is written on 16-lane vectors (vf); without AVX-512 GCC moves each such vector through the stack and
   general registers (one Zen 3 thread: BF16 3.3 GB/s where a plain 8-lane loop reads 18 GB/s in L2, Q8_0 1.1).
   These are the same dot products on __m256, each block format's weights widened 8 at a time.
   Summation differs from rows_dots only in order (8 partial sums a row and token instead of 16). */

/* Taken where AVX-512 is missing; ft_set_avx2_dots turns it on elsewhere so tests can run it on any x86 CPU. */
#if defined(__AVX512F__)
static int avx2_dots = 0;
#else
static int avx2_dots = 1;
#endif

INLINE __m256 avx2_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

INLINE __m256 avx2_q8(const int8_t *p) {  /* 8 int8 weights as floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

INLINE __m256 avx2_f16_splat(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
}

INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 e4m3 bytes as floats, exactly (load_fp8's arithmetic on 8 lanes). */
INLINE __m256 avx2_fp8(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
    __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em);
    __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, _mm256_castsi256_ps(is_sub));
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

/* One 32-value block of a block format as four scaled quarters (values 0..7, 8..15, 16..23, 24..31). */
INLINE void avx2_block(int type, const uint8_t *blk, __m256 w[4]) {
    if (type == FT_Q8_0) {
        __m256 d = avx2_f16_splat(blk);
        for (int q = 0; q < 4; q++) w[q] = _mm256_mul_ps(avx2_q8((const int8_t *)blk + 2 + 8 * q), d);
    } else if (type == FT_MXFP4) {  /* codes looked up as the doubled e2m1 integers, as load_mxfp4 does */
        __m128i half[2] = {mxfp4_half(blk + 1, 0), mxfp4_half(blk + 1, 1)};
        __m256 d = _mm256_set1_ps(mxfp4_scale(blk[0]));
        for (int q = 0; q < 4; q++) {
            __m128i v = q & 1 ? _mm_srli_si128(half[q >> 1], 8) : half[q >> 1];
            w[q] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
        }
    } else {
        float scale;
        memcpy(&scale, blk, 4);
        __m256 d = _mm256_set1_ps(scale);
        for (int q = 0; q < 4; q++) w[q] = _mm256_mul_ps(avx2_fp8(blk + 4 + 8 * q), d);
    }
}

/* rows_dots on __m256 (same arguments and result). nr and nt are compile-time constants at every call site, so
   the accumulators stay in registers; with few of them (nr * nt <= 2) a second set gives the FMA units 4
   independent chains. */
INLINE void rows_dots_avx2(int type, const void *const *rows, int nr, const float *const *xs, int k, int nt,
                           float *out) {
    const int twice = nr * nt <= 2;
    __m256 acc[2][TILE], acc2[2][TILE];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = acc2[r][t] = _mm256_setzero_ps();
    int kv = 0;
    if (type == FT_Q8_0 && nt == 1) {
        /* one token: a block's products summed first, then scaled into the sum once (as rows_dots does) */
        for (size_t b = 0; kv < k; kv += Q8_BLOCK, b += Q8_BYTES) {
            __m256 x[4];
            for (int q = 0; q < 4; q++) x[q] = _mm256_loadu_ps(xs[0] + kv + 8 * q);
            for (int r = 0; r < nr; r++) {
                const uint8_t *blk = (const uint8_t *)rows[r] + b;
                prefetch_ahead(rows[r], b);
                __m256 s = _mm256_mul_ps(avx2_q8((const int8_t *)blk + 2), x[0]);
                for (int q = 1; q < 4; q++) s = _mm256_fmadd_ps(avx2_q8((const int8_t *)blk + 2 + 8 * q), x[q], s);
                if (twice && (b / Q8_BYTES & 1)) acc2[r][0] = _mm256_fmadd_ps(s, avx2_f16_splat(blk), acc2[r][0]);
                else acc[r][0] = _mm256_fmadd_ps(s, avx2_f16_splat(blk), acc[r][0]);
            }
        }
    } else if (type == FT_Q8_0 || type == FT_MXFP4 || type == FT_FP8) {
        size_t bytes = block_bytes(type);
        for (size_t b = 0; kv < k; kv += Q8_BLOCK, b += bytes)
            for (int r = 0; r < nr; r++) {
                __m256 w[4];
                prefetch_ahead(rows[r], b);
                avx2_block(type, (const uint8_t *)rows[r] + b, w);
                for (int q = 0; q < 4; q++)
                    for (int t = 0; t < nt; t++) {
                        __m256 x = _mm256_loadu_ps(xs[t] + kv + 8 * q);
                        if (twice && (q & 1)) acc2[r][t] = _mm256_fmadd_ps(w[q], x, acc2[r][t]);
                        else acc[r][t] = _mm256_fmadd_ps(w[q], x, acc[r][t]);
                    }
            }
    } else {
        for (; kv + 8 <= k; kv += 8) {
            int second = twice && (kv & 8);
            for (int r = 0; r < nr; r++) {
                if (type == FT_BF16 && !(kv & 31)) prefetch_ahead(rows[r], (size_t)kv * 2);
                __m256 w = type == FT_BF16 ? avx2_bf16((const uint16_t *)rows[r] + kv)
                                           : _mm256_loadu_ps((const float *)rows[r] + kv);
                for (int t = 0; t < nt; t++) {
                    __m256 x = _mm256_loadu_ps(xs[t] + kv);
                    if (second) acc2[r][t] = _mm256_fmadd_ps(w, x, acc2[r][t]);
                    else acc[r][t] = _mm256_fmadd_ps(w, x, acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float s = avx2_hsum(_mm256_add_ps(acc[r][t], acc2[r][t]));
            for (int j = kv; j < k; j++)  /* tail of rows whose length is not a multiple of 8 */
                s += (type == FT_BF16 ? bf16_scalar(((const uint16_t *)rows[r])[j]) : ((const float *)rows[r])[j])
                     * xs[t][j];
            out[r * TILE + t] = s;
        }
}
