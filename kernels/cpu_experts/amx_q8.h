/* Part of experts.c (included once, where it stands): Q8_0 experts at several tokens per expert on AMX int8
   tiles, straight from their blocks.

   Why: the vector paths spend their time on arithmetic at 2-8 tokens per expert (the fp32 path widens every
   weight to fp32; the bf16 tile path first dequantizes each 16-row block to bf16), so Q8_0 ran at 27-42 % of the
   DRAM probe there (evals/results/cpu-expert-kernel-h200.md). Here the weight bytes go into a tile as they lie in
   memory: a 16-row A tile is one 32-weight block of 16 rows (its int8 values, the row stride skipping the
   scales), so no weight is touched by a vector instruction. The activations are the int16 ones of the
   one-token path (q16.h: per 32-block, power-of-two scale), split into a signed high byte and an unsigned low
   byte, two B tiles: TDPBSSD and TDPBSUD give, per (row, token), the block's exact int32 dot with each half,
   combined as hi * 256 + lo. The per-block scales (f16 weight scale per row, activation scale per token) are
   applied to the 16 x 16 block sums on the vector units, the previous block's while the tiles compute the next.

   Layout of one tile of an expert's tokens (16 columns; unused ones zero), K weights a row:
     hi [K/4][16][4] int8, lo [K/4][16][4] uint8 (the VNNI B layout: byte k of token t at (k/4)*64 + t*4 + k%4),
     then scales [K/32][16] fp32: Q8T_BYTES(K) bytes. Block kc is rows kc*8..kc*8+7 of hi and lo.
   Phase 0 packs x per expert; phase 1 (tasks: expert x 32 rows, one block of act) writes act packed the same
   way; phase 2 (tasks: 16 output rows) reads it.

   FT_AMX_EMULATE builds the same code over tiles emulated in C (tiles.h), so the layouts are tested on any
   AVX-512 machine (tests/kernels/test_cpu_expert_tiles.py); real tiles run on Sapphire Rapids and later. */
#if HAVE_Q16_AVX512 && ((HAVE_AMX && defined(__AMX_INT8__)) || defined(FT_AMX_EMULATE))
#define HAVE_AMX_Q8 1
#if !HAVE_AMX
static int amx_prefetch;  /* amx.h's, where it is not compiled */
INLINE void amx_prefetch_rows(const uint8_t *w, size_t stride) {
    for (int r = 0; r < 16; r++) __builtin_prefetch(w + r * stride, 0, 3);
}
#endif
#define Q8T_BYTES(k) ((size_t)(k) * 34)

/* tuning: the token counts per expert (most of any expert in a job) that take these tiles. Off by default: on
   the H200 test machine's host they lost to the fp32-weight vector path at every batch (2-16 tokens, 1 and 15
   threads; evals/results/cpu-expert-kernel-h200.md); ft_set_amx_q8(2, 32) turns them on for measuring. */
static int amx_q8_min_tokens = 2, amx_q8_max_tokens = 0;

#if defined(TILES_EMULATED)
#define AMX_Q8_EMULATED 1
#endif
static int amx_q8_permitted(void) { return tiles_permitted(); }

/* Tile 0: A, 16 weight rows x one block (32 int8), and tile 7 the next 16 rows where a pass takes 32; 1-2: B, the
   block's activations (hi, lo: 8 rows x 16 tokens x 4 bytes); 3-6: C, the block sums (hi, lo) of the even and odd
   blocks of 16 rows (the vector units read one pair while the tiles fill the other), or of the two 16-row halves
   of 32. */
static void amx_q8_configure(void) {
    tile_config cfg = {.palette = 1};
    cfg.rows[0] = cfg.rows[7] = 16, cfg.colsb[0] = cfg.colsb[7] = 32;
    for (int t = 1; t <= 2; t++) cfg.rows[t] = 8, cfg.colsb[t] = 64;
    for (int t = 3; t <= 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    TILE_CONFIG(&cfg);
}

/* Weight rows a pass takes: 16, or 32 (two A tiles against the same B tiles: two independent tile chains, twice
   the bytes in flight a block), for measuring. */
static int amx_q8_rows = 16;

static uint8_t *amx_q8_scratch(size_t bytes) {  /* one job at a time: a growing buffer serves every job */
    static growing_buffer scratch;
    return grow_to(&scratch, bytes);
}

/* One 32-block of one token's int16 activations into column t of a packed tile: hi and lo bytes, and the scale. */
INLINE void amx_q8_put_block(uint8_t *tile, int k, int kc, int t, const int16_t *q, float scale) {
    int8_t *hi = (int8_t *)tile;
    uint8_t *lo = tile + (size_t)k * 16;
    for (int i = 0; i < Q8_BLOCK; i++) {
        size_t at = (size_t)(kc * Q8_BLOCK + i) / 4 * 64 + t * 4 + i % 4;
        hi[at] = (int8_t)(q[i] >> 8);
        lo[at] = (uint8_t)(q[i] & 0xFF);
    }
    ((float *)(tile + (size_t)k * 32))[kc * 16 + t] = scale;
}

/* Phase 0, task e: expert e's tokens' x, quantized per block to int16, into its packed tiles; its act tiles
   zeroed, so the columns past its last token hold zeros (left as they were, their garbage would run through the
   vector units as denormals and NaNs: microcode assists, slower by several times). */
static void amx_q8_pack_x(const moe_job *j, uint8_t *xp, uint8_t *actp, const int32_t *tile_base, int e) {
    int p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0, k = j->hidden, tiles = tile_base[e + 1] - tile_base[e];
    uint8_t *dst = xp + tile_base[e] * Q8T_BYTES(k);
    memset(dst, 0, tiles * Q8T_BYTES(k));
    memset(actp + tile_base[e] * Q8T_BYTES(j->inter), 0, tiles * Q8T_BYTES(j->inter));
    int16_t q[Q8_BLOCK];
    float scale;
    for (int t = 0; t < n; t++) {
        const float *x = j->x + (size_t)j->pair_tokens[p0 + t] * k;
        uint8_t *tile = dst + (t / 16) * Q8T_BYTES(k);
        for (int kc = 0; kc < k / Q8_BLOCK; kc++) {
            q16_quantize_block(x + kc * Q8_BLOCK, q, &scale);
            amx_q8_put_block(tile, k, kc, t % 16, q, scale);
        }
    }
}

/* acc[r] += (hi[r] * 256 + lo[r]) * wscale[r] * xscale, for the 16 rows of one block's sums (vectors over the
   16 tokens). */
INLINE void amx_q8_accumulate(__m512 acc[16], const int32_t *hi, const int32_t *lo, const float *wscale,
                              __m512 xscale) {
    for (int r = 0; r < 16; r++) {
        __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi + r * 16), 8),
                                       _mm512_load_si512(lo + r * 16));
        __m512 s = _mm512_mul_ps(_mm512_set1_ps(wscale[r]), xscale);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, acc[r]);
    }
}

/* The f16 scales of block kc of 16 rows (w row r at w + r * stride) as floats. */
INLINE void amx_q8_row_scales(const uint8_t *w, size_t stride, int kc, float *out) {
    __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)stride));
    __m512i raw = _mm512_i32gather_epi32(offsets, w + (size_t)kc * Q8_BYTES, 1);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw)));
}

/* out[r][t] (16 or 32 rows: 16 * halves) = rows r of Q8_0 weights w (stride bytes a row, k weights) . token t of
   a packed tile. (Reading a block's sums two or three blocks after their tile store instead of one measured the
   same: H200 host, commit 3214449.) */
static void amx_q8_rows_x_tokens(const uint8_t *w, size_t stride, int k, const uint8_t *tile, int halves,
                                 float (*out)[16]) {
    const uint8_t *hi = tile, *lo = tile + (size_t)k * 16, *w1 = w + 16 * stride;
    const float *xs = (const float *)(tile + (size_t)k * 32);
    int32_t sums[2][2][2][256] __attribute__((aligned(64)));  /* [block % 2][half][hi, lo][row * 16 + token] */
    float wscale[2][2][16];
    __m512 acc[32];
    for (int r = 0; r < 16 * halves; r++) acc[r] = _mm512_setzero_ps();
    int blocks = k / Q8_BLOCK;
    amx_q8_configure();
    for (int kc = 0; kc < blocks; kc++) {
        int b = kc & 1;
        size_t at = (size_t)kc * Q8_BYTES;
        if (amx_prefetch && kc + amx_prefetch < blocks) {
            amx_prefetch_rows(w + at + amx_prefetch * Q8_BYTES, stride);
            if (halves == 2) amx_prefetch_rows(w1 + at + amx_prefetch * Q8_BYTES, stride);
        }
        TILE_LOAD(1, hi + (size_t)kc * 512, 64);
        TILE_LOAD(2, lo + (size_t)kc * 512, 64);
        TILE_LOAD(0, w + at + 2, stride);
        if (halves == 2) {
            TILE_LOAD(7, w1 + at + 2, stride);
            TILE_ZERO(3);
            TILE_ZERO(4);
            TILE_ZERO(5);
            TILE_ZERO(6);
            TILE_SS(3, 0, 1);
            TILE_SU(4, 0, 2);
            TILE_SS(5, 7, 1);
            TILE_SU(6, 7, 2);
            TILE_STORE(3, sums[b][0][0], 64);
            TILE_STORE(4, sums[b][0][1], 64);
            TILE_STORE(5, sums[b][1][0], 64);
            TILE_STORE(6, sums[b][1][1], 64);
        } else if (b) {
            TILE_ZERO(5);
            TILE_ZERO(6);
            TILE_SS(5, 0, 1);
            TILE_SU(6, 0, 2);
            TILE_STORE(5, sums[b][0][0], 64);
            TILE_STORE(6, sums[b][0][1], 64);
        } else {
            TILE_ZERO(3);
            TILE_ZERO(4);
            TILE_SS(3, 0, 1);
            TILE_SU(4, 0, 2);
            TILE_STORE(3, sums[b][0][0], 64);
            TILE_STORE(4, sums[b][0][1], 64);
        }
        for (int h = 0; h < halves; h++) amx_q8_row_scales(h ? w1 : w, stride, kc, wscale[b][h]);
        if (kc > 0)  /* the previous block's sums, while the tiles work on this one */
            for (int h = 0; h < halves; h++)
                amx_q8_accumulate(acc + 16 * h, sums[b ^ 1][h][0], sums[b ^ 1][h][1], wscale[b ^ 1][h],
                                  _mm512_loadu_ps(xs + (kc - 1) * 16));
    }
    TILE_RELEASE();
    int last = (blocks - 1) & 1;
    for (int h = 0; h < halves; h++)
        amx_q8_accumulate(acc + 16 * h, sums[last][h][0], sums[last][h][1], wscale[last][h],
                          _mm512_loadu_ps(xs + (blocks - 1) * 16));
    for (int r = 0; r < 16 * halves; r++) _mm512_storeu_ps(out[r], acc[r]);
}

/* Phase 1, task (expert, 32 rows): gate and up of rows r0..r0+31 for each token tile, act from them, and act's
   block r0/32 quantized into the expert's packed act tiles. */
static void amx_q8_gate_up(const moe_job *j, const uint8_t *xp, uint8_t *actp, const int32_t *tile_base,
                           int task) {
    int blocks = j->inter / Q8_BLOCK, e = task / blocks, kc = task % blocks, r0 = kc * Q8_BLOCK;
    int expert = j->experts[e], p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0;
    size_t gb = row_bytes(FT_Q8_0, j->hidden), ub = row_bytes(FT_Q8_0, j->hidden);
    const uint8_t *gate = j->gate + expert * j->gate_stride + r0 * gb, *up = j->up + expert * j->up_stride + r0 * ub;
    float g[32][16], u[32][16], a[16][Q8_BLOCK] __attribute__((aligned(64)));  /* a: [token][row] */
    int16_t q[Q8_BLOCK];
    float scale;
    int halves = amx_q8_rows / 16;
    for (int tile = 0; tile < tile_base[e + 1] - tile_base[e]; tile++) {
        size_t base = (size_t)(tile_base[e] + tile);
        const uint8_t *x_tile = xp + base * Q8T_BYTES(j->hidden);
        for (int h = 0; h < 2; h += halves) {
            amx_q8_rows_x_tokens(gate + h * 16 * gb, gb, j->hidden, x_tile, halves, g + h * 16);
            amx_q8_rows_x_tokens(up + h * 16 * ub, ub, j->hidden, x_tile, halves, u + h * 16);
        }
        for (int r = 0; r < Q8_BLOCK; r++)
            for (int c = 0; c < 16 && tile * 16 + c < n; c++) {
                float v = expert_act(j, expert, r0 + r, g[r][c], u[r][c]);
                a[c][r] = v;
                j->act[(size_t)(p0 + tile * 16 + c) * j->inter + r0 + r] = v;
            }
        uint8_t *act_tile = actp + base * Q8T_BYTES(j->inter);
        for (int c = 0; c < 16 && tile * 16 + c < n; c++) {
            q16_quantize_block(a[c], q, &scale);
            amx_q8_put_block(act_tile, j->inter, kc, c, q, scale);
        }
    }
}

/* Phase 2, task: amx_q8_rows output rows from h0, every expert's down rows against its packed act. */
static void amx_q8_down(const moe_job *j, const uint8_t *actp, const int32_t *tile_base, int task) {
    int rows = amx_q8_rows, h0 = task * rows;
    size_t db = row_bytes(FT_Q8_0, j->inter);
    float d[32][16];
    for (int h = h0; h < h0 + rows; h++)
        for (int t = 0; t < j->tokens; t++) j->y[(size_t)t * j->hidden + h] = 0.0f;
    for (int e = 0; e < j->n_experts; e++) {
        int p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0;
        const uint8_t *down = j->down + j->experts[e] * j->down_stride + h0 * db;
        for (int tile = 0; tile < tile_base[e + 1] - tile_base[e]; tile++) {
            amx_q8_rows_x_tokens(down, db, j->inter, actp + (size_t)(tile_base[e] + tile) * Q8T_BYTES(j->inter),
                                 rows / 16, d);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < 16 && tile * 16 + c < n; c++) {
                    int p = p0 + tile * 16 + c;
                    float v = expert_out(j, j->experts[e], h0 + r, d[r][c], j->pair_weights[p]);
                    j->y[(size_t)j->pair_tokens[p] * j->hidden + h0 + r] += v;
                }
        }
    }
}
#else
#define HAVE_AMX_Q8 0
#endif
