/* Part of experts.c (included by q16.h with its 16-lane form): Q8_0 rows against int16 activations at 2-5 tokens
   per expert, 16 rows at a time.

   Why: at several tokens the one-token form's cost grows with the tokens where it hurts: every token's products
   of a block pass through the transpose-add tree that moves block sums into lanes (~3 ops per block, row and
   token), and the fp32 path instead widens every weight to fp32 and spends two FMAs per block, row and token.
   Here the weights are moved into lanes once, shared by the tokens: block b of 16 rows is transposed so that a
   vector holds four weights of every row (dword q of the block: weights 4q..4q+3), widened to int16, and each
   token's four activations are broadcast against it with vpdpwssd (exact int32). A block then costs ~3 shuffles
   a row whatever the tokens, plus per token one vpdpwssd a row and the block's scaling on vectors of 8 rows.

   Lanes: a widened vector holds 8 rows, two lanes each (lane 2i + h: row i's weights 4q + 2h, 4q + 2h + 1); the
   block's two lanes of a row share its scale, and they are added once per row, at the end. Same activations
   and scales as the one-token form (q16_quantize); the block sums are the same integers, scaled and added in
   another order. */
#define HAVE_Q16_ROWS 1
enum { Q16_ROWS = 16, Q16_ROWS_TOKENS = 4 };
/* Software prefetch this far ahead in each of the 16 rows, every other block (a line holds ~2 blocks). Sixteen
   short streams at once keep the L2 streamer from covering them: 256 bytes ahead read 1.1-1.4x none at 2-4
   tokens on a Sapphire Rapids-class VM (2 threads; 128 and 512-1024 less). ft_set_q16_rows_prefetch moves it. */
static int q16_rows_prefetch = 256;

#if defined(__AVX512VNNI__)
#define Q16_DPWSSD(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define Q16_DPWSSD(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif

/* Block b of 16 Q8_0 rows (row r's block at blk + r * stride) as 8 vectors: t[q] holds dword q of every row, the
   even rows 0, 2, .., 14 in its low half and the odd rows in its high half (an 8x8 dword transpose in each
   half: unpack by dwords, by qwords, then 128-bit lanes paired across registers). */
INLINE void q16_rows_transpose(const uint8_t *blk, size_t stride, __m512i t[8]) {
    __m512i z[8], s[8];
    for (int i = 0; i < 8; i++) {
        const uint8_t *even = blk + 2 + (size_t)(2 * i) * stride;
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)even)),
                                  _mm256_loadu_si256((const __m256i *)(even + stride)), 1);
    }
    for (int i = 0; i < 8; i += 2) {  /* per 128-bit lane: rows i, i+1 interleaved by dwords */
        s[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        s[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)  /* per 128-bit lane: dword j of rows i..i+3 */
        for (int h = 0; h < 2; h++) {
            z[i + 2 * h] = _mm512_unpacklo_epi64(s[i + h], s[i + 2 + h]);
            z[i + 2 * h + 1] = _mm512_unpackhi_epi64(s[i + h], s[i + 2 + h]);
        }
    /* z[0..3]: rows 0-3 (as z's low halves order them), z[4..7]: rows 4-7; register j's 128-bit lane L holds
       dword 4 * (L & 1) + j of its 4 rows. Pair them across the two groups of rows. */
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_permutex2var_epi64(z[j], lo, z[4 + j]);
        t[j + 4] = _mm512_permutex2var_epi64(z[j], hi, z[4 + j]);
    }
}

/* out[r * nt + i] = row r . token i, for the 16 Q8_0 rows from w (stride bytes apart, k weights) and nt <= 4
   tokens' int16 activations xq[i] with block scales xs[i]. nt is a compile-time constant at every call site. */
INLINE void q16_rows_dots(const uint8_t *w, size_t stride, const int16_t *const *xq, const float *const *xs, int k,
                          int nt, float *out) {
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)stride));
    const __m512i even = _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    const __m512i odd = _mm512_setr_epi32(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
    __m512 fe[Q16_ROWS_TOKENS], fo[Q16_ROWS_TOKENS];  /* lanes 2i + h: even row 2i / odd row 2i + 1 */
    for (int i = 0; i < nt; i++) fe[i] = fo[i] = _mm512_setzero_ps();
    for (int b = 0; b < k / Q8_BLOCK; b++) {
        const uint8_t *blk = w + (size_t)b * Q8_BYTES;
        if (q16_rows_prefetch > 0 && !(b & 1))
            for (int r = 0; r < Q16_ROWS; r++) __builtin_prefetch(blk + r * stride + q16_rows_prefetch, 0, 3);
        __m512i t[8], ae[Q16_ROWS_TOKENS], ao[Q16_ROWS_TOKENS];
        q16_rows_transpose(blk, stride, t);
        for (int i = 0; i < nt; i++) ae[i] = ao[i] = _mm512_setzero_si512();
        for (int q = 0; q < 8; q++) {
            __m512i we = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(t[q]));
            __m512i wo = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(t[q], 1));
            for (int i = 0; i < nt; i++) {
                long long four;  /* activations 4q..4q+3 of the block: lane 2i + h takes pair h */
                memcpy(&four, xq[i] + (size_t)b * Q8_BLOCK + 4 * q, 8);
                __m512i x = _mm512_set1_epi64(four);
                ae[i] = Q16_DPWSSD(ae[i], we, x);
                ao[i] = Q16_DPWSSD(ao[i], wo, x);
            }
        }
        __m512 scales = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(offsets, blk, 1)));
        __m512 se = _mm512_permutexvar_ps(even, scales), so = _mm512_permutexvar_ps(odd, scales);
        for (int i = 0; i < nt; i++) {
            __m512 xscale = _mm512_set1_ps(xs[i][b]);
            fe[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ae[i]), _mm512_mul_ps(se, xscale), fe[i]);
            fo[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ao[i]), _mm512_mul_ps(so, xscale), fo[i]);
        }
    }
    for (int i = 0; i < nt; i++) {
        float e[16], o[16];
        _mm512_storeu_ps(e, fe[i]);
        _mm512_storeu_ps(o, fo[i]);
        for (int r = 0; r < 8; r++) {
            out[(2 * r) * nt + i] = e[2 * r] + e[2 * r + 1];
            out[(2 * r + 1) * nt + i] = o[2 * r] + o[2 * r + 1];
        }
    }
}

/* q16_rows_dots over any n tokens, in balanced passes of up to 4 (a second pass finds the rows in cache):
   out[r * n + i]. */
static void q16_rows_dots_n(const uint8_t *w, size_t stride, const int16_t *const *xq, const float *const *xs, int k,
                            int n, float *out) {
    int passes = (n + Q16_ROWS_TOKENS - 1) / Q16_ROWS_TOKENS;
    for (int i0 = 0; i0 < n;) {
        int nt = (n - i0 + passes - 1) / passes;  /* balanced: 5 tokens as 3 + 2, not 4 + 1 */
        passes--;
        float part[Q16_ROWS * Q16_ROWS_TOKENS];
        switch (nt) {
            case 1: q16_rows_dots(w, stride, xq + i0, xs + i0, k, 1, part); break;
            case 2: q16_rows_dots(w, stride, xq + i0, xs + i0, k, 2, part); break;
            case 3: q16_rows_dots(w, stride, xq + i0, xs + i0, k, 3, part); break;
            default: q16_rows_dots(w, stride, xq + i0, xs + i0, k, 4, part); break;
        }
        for (int r = 0; r < Q16_ROWS; r++)
            for (int i = 0; i < nt; i++) out[r * n + i0 + i] = part[r * nt + i];
        i0 += nt;
    }
}
