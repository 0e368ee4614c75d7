/* Part of experts.c (included once, where it stands): one layer's experts on AMX tiles. */

/* ---- AMX (Sapphire Rapids and later): 16 rows x 32 weights x 16 tokens per tile instruction ----
   With tiles the arithmetic is nearly free, so the kernel stays bound by DRAM reads at any decode batch and
   stays far ahead of the vector path for the 20-100 tokens per expert of a short prefill chunk. An expert's
   tokens are packed in tiles of 16 into the VNNI layout a B tile wants ([K/2][16 tokens][2], unused token columns
   zero), the tiles of all experts back to back (`tile_base[e]` is expert e's first): phase 0 packs x, phase 1
   writes act packed. Each 16-row weight block is read from DRAM once; further token tiles find it in L2 (Q8_0
   blocks are dequantized once into a bf16 copy of the block's rows). Used for bf16 activations of bf16 models. */
#if HAVE_AMX
enum { AMX_TOKENS = 16 };
/* tuning: the fewest tokens per expert worth tiles (bf16 weights, block-format weights), and a switch to measure
   without them */
static int amx_min_tokens = 2, amx_block_min_tokens = 6, amx_disabled;
/* Software prefetch of the 16 weight rows this many k-chunks (32 weights) ahead of the tile loads, 0 off: a tile
   load waits for all its 16 rows, and the tiles keep few loads in flight, so DRAM latency is paid per chunk
   unless the lines are on their way already. */
static int amx_prefetch;
/* Software prefetch this many bytes ahead while a block format's 16-row block is dequantized for the tiles (0:
   off): the block is one run of ~35 KB (Q8_0 gate/up rows), and the L2 streamer stops at each 4 KiB page, where the
   loop then waits on DRAM; one core computes that block 2.4x faster from L2 than the pool reads it. 4 KiB ahead
   read Q8_0 at 6/8/16 tokens 1.18/1.20/1.16x faster than none on an H100 host (57d4689,
   evals/results/cpu-expert-kernel-h200.md); 1 KiB 1.12/1.13/1.11x. Shared among the runs of amx_dequant_streams
   (4: 1 KiB ahead in each). */
static int amx_dequant_prefetch = 4096;
/* Two token tiles a pass (17+ tokens per expert, a prefill chunk's share): both multiply the weight tiles of one
   load, where a pass per token tile loaded the whole 16-row block again from L2 for each (0: one a pass). At 32
   tokens BF16 1.09x, Q8_0 0.96x (its dequantization dominates) on an H200 host (8c5b29f,
   evals/results/cpu-expert-kernel-h200.md). */
static int amx_tile_pairs = 1;
/* A 16-row block of block-format rows is dequantized as this many interleaved runs of consecutive rows (1, 2, 4, 8
   or 16), the prefetch distance shared among them: one core then has several independent DRAM streams in flight
   where one run kept too few, as the dequantization's arithmetic filled its window. On a 2-core Sapphire
   Rapids-class VM, Q8_0 at 6-16 tokens per expert: 4 runs (1 KiB ahead each) read 1.13-1.16x one run (4 KiB
   ahead), 2 runs 1.10x, 8 1.05x, 16 0.9x (evals/results/cpu-kernel-dequant-streams-ci-class.md). */
static int amx_dequant_streams = 4;

INLINE void amx_prefetch_rows(const uint8_t *w, size_t stride) {
    for (int r = 0; r < 16; r++) __builtin_prefetch(w + r * stride, 0, 3);
}
/* Tiles 0-1 and 5-6 accumulators, 2-3 weights, 4 and 7 activations. Loaded at every use and released after it:
   other code on the same thread (oneDNN inside torch uses AMX too) releases the tiles when it is done, which would
   leave a configuration cached per thread dangling (the next tile instruction would fault). */
static void amx_configure(void) {
    tile_config cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    TILE_CONFIG(&cfg);
}

static uint16_t *amx_scratch(size_t elements) {  /* one job at a time: a growing buffer serves every job */
    static growing_buffer scratch;
    return grow_to(&scratch, elements * 2);
}

/* Expert e's tokens as B tiles: tile i of e holds its tokens 16i..16i+15 as [k/2][t][k%2] = x[token][k]. */
static void amx_pack_x(const moe_job *j, const uint16_t *xb, uint16_t *xp, const int32_t *tile_base, int e) {
    int p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0;
    size_t tile_elems = (size_t)j->hidden * AMX_TOKENS;
    uint16_t *dst = xp + tile_base[e] * tile_elems;
    memset(dst, 0, (tile_base[e + 1] - tile_base[e]) * tile_elems * 2);
    for (int t = 0; t < n; t++) {
        const uint16_t *src = xb + (size_t)j->pair_tokens[p0 + t] * j->hidden;
        uint16_t *tile = dst + (t / AMX_TOKENS) * tile_elems + (t % AMX_TOKENS) * 2;
        for (int k = 0; k < j->hidden; k++) tile[(size_t)(k / 2) * AMX_TOKENS * 2 + (k & 1)] = src[k];
    }
}

/* Rows r..r+15 of a block format (Q8_0, MXFP4, FP8_B32), block kc, as bf16 at `tile` (16 rows, `pitch` elements
   apart): the scaled values rounded to bf16, exactly the weights a bf16 GPU expert computes with after
   dequantization. One 32-value block is one tile row. */
static void amx_block_tile(int type, const uint8_t *w, size_t stride, int kc, uint16_t *tile, size_t pitch) {
    size_t bytes = block_bytes(type);
    for (int r = 0; r < 16; r++) {
        vf w0, w1;
        block_weights(type, w + r * stride + (size_t)kc * bytes, &w0, &w1);
        _mm512_storeu_si512(tile + r * pitch, (__m512i)_mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0));
    }
}

/* A 16-row block of block-format weights over k columns as bf16 rows (a per-thread buffer, `which` of two), each
   block dequantized once whatever the number of token tiles, as amx_dequant_streams interleaved runs of rows. Row by
   row within a run: one sequential stream per run (walking
   the 16 rows block column by block column stalled on every load: 1.4x slower at 6-8 tokens on a Sapphire
   Rapids-class core), and the tiles then load rows that were stored long before (a tile loaded right after the
   stores that wrote it waits for them). Returns the rows; their stride is k * 2 bytes. */
static const uint8_t *amx_dequant_rows(int type, const uint8_t *w, size_t stride, int k, int which) {
    static __thread uint16_t *buf[2];
    static __thread size_t capacity[2];
    size_t need = (size_t)16 * k;
    if (need > capacity[which]) {
        free(buf[which]);
        buf[which] = aligned_alloc(64, (need * 2 + 63) / 64 * 64);
        capacity[which] = buf[which] ? need : 0;
        if (!buf[which]) return NULL;
    }
    int streams = amx_dequant_streams, per = 16 / streams, nb = k / 32;
    size_t bytes = block_bytes(type), ahead = (size_t)amx_dequant_prefetch / streams / 64 * 64;
    const uint8_t *from[16], *end[16];  /* run s: rows s * per .. s * per + per - 1, one run of bytes */
    for (int s = 0; s < streams; s++) {
        from[s] = w + (size_t)s * per * stride, end[s] = from[s] + (size_t)(per - 1) * stride + (size_t)nb * bytes;
        for (size_t at = 0; at < ahead && from[s] + at < end[s]; at += 64) __builtin_prefetch(from[s] + at, 0, 3);
    }
    for (int ri = 0; ri < per; ri++)
        for (int kc = 0; kc < nb; kc++)
            for (int s = 0; s < streams; s++) {
                vf w0, w1;
                const uint8_t *blk = from[s] + ri * stride + (size_t)kc * bytes;
                if (ahead && blk + ahead < end[s]) __builtin_prefetch(blk + ahead, 0, 3);
                block_weights(type, blk, &w0, &w1);
                _mm512_storeu_si512(buf[which] + (size_t)(s * per + ri) * k + (size_t)kc * 32,
                                    (__m512i)_mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0));
            }
    return (const uint8_t *)buf[which];
}

/* Loads weight tile `t` for rows at w (stride bytes per row), k-chunk kc of 32, from bf16 or block-format rows. */
static inline void amx_load_weights(int t, int type, const uint8_t *w, size_t stride, int kc, uint16_t *scratch) {
    if (type != FT_BF16) {
        amx_block_tile(type, w, stride, kc, scratch, 32);
        if (t == 2) TILE_LOAD(2, scratch, 64); else TILE_LOAD(3, scratch, 64);
    } else if (t == 2) {
        TILE_LOAD(2, w + (size_t)kc * 64, stride);
    } else {
        TILE_LOAD(3, w + (size_t)kc * 64, stride);
    }
}

/* out[i][r][t] (tiles x 16 x 16) = rows r0..r0+15 of w (stride bytes per row) . token tile i of packed (tiles of
   k * 16 elements back to back; 1 or 2 tiles) over k weights. */
static void amx_rows_x_tokens(int type, const uint8_t *w, size_t stride, const uint16_t *packed, int tiles, int k,
                              float *out) {
    uint16_t scratch[16 * 32] __attribute__((aligned(64)));
    const uint16_t *second = packed + (size_t)k * AMX_TOKENS;
    amx_configure();
    TILE_ZERO(0);
    TILE_ZERO(1);
    for (int kc = 0; kc < k / 32; kc++) {
        if (amx_prefetch && type == FT_BF16 && kc + amx_prefetch < k / 32)
            amx_prefetch_rows(w + (size_t)(kc + amx_prefetch) * 64, stride);
        amx_load_weights(2, type, w, stride, kc, scratch);
        TILE_LOAD(4, packed + (size_t)kc * 16 * AMX_TOKENS * 2, 64);
        TILE_BF16(0, 2, 4);
        if (tiles > 1) {
            TILE_LOAD(5, second + (size_t)kc * 16 * AMX_TOKENS * 2, 64);
            TILE_BF16(1, 2, 5);
        }
    }
    TILE_STORE(0, out, 64);
    if (tiles > 1) TILE_STORE(1, out + 256, 64);
    TILE_RELEASE();
}

/* The same for two weight blocks (gate and up) against the same token tiles: out0 and out1 as out above. */
static void amx_rows_x_tokens2(int t0, const uint8_t *w0, size_t s0, int t1, const uint8_t *w1, size_t s1,
                               const uint16_t *packed, int tiles, int k, float *out0, float *out1) {
    uint16_t scratch0[16 * 32] __attribute__((aligned(64))), scratch1[16 * 32] __attribute__((aligned(64)));
    const uint16_t *second = packed + (size_t)k * AMX_TOKENS;
    amx_configure();
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(5);
    TILE_ZERO(6);
    for (int kc = 0; kc < k / 32; kc++) {
        if (amx_prefetch && t0 == FT_BF16 && t1 == FT_BF16 && kc + amx_prefetch < k / 32) {
            amx_prefetch_rows(w0 + (size_t)(kc + amx_prefetch) * 64, s0);
            amx_prefetch_rows(w1 + (size_t)(kc + amx_prefetch) * 64, s1);
        }
        TILE_LOAD(4, packed + (size_t)kc * 16 * AMX_TOKENS * 2, 64);
        amx_load_weights(2, t0, w0, s0, kc, scratch0);
        amx_load_weights(3, t1, w1, s1, kc, scratch1);
        TILE_BF16(0, 2, 4);
        TILE_BF16(1, 3, 4);
        if (tiles > 1) {
            TILE_LOAD(7, second + (size_t)kc * 16 * AMX_TOKENS * 2, 64);
            TILE_BF16(5, 2, 7);
            TILE_BF16(6, 3, 7);
        }
    }
    TILE_STORE(0, out0, 64);
    TILE_STORE(1, out1, 64);
    if (tiles > 1) {
        TILE_STORE(5, out0 + 256, 64);
        TILE_STORE(6, out1 + 256, 64);
    }
    TILE_RELEASE();
}

/* How many of an expert's token tiles, from `tile` of `tiles`, the next pass takes. */
static inline int amx_pass_tiles(int tile, int tiles) { return amx_tile_pairs && tiles - tile >= 2 ? 2 : 1; }

/* A 16-row weight block as the tiles read it: block-format rows dequantized to bf16 rows first (block by block
   into a scratch tile where that buffer cannot be had). Sets *type and *stride to how the returned rows are read. */
static const uint8_t *amx_block_rows(const uint8_t *w, int *type, size_t *stride, int k, int which) {
    if (*type == FT_BF16) return w;
    const uint8_t *rows = amx_dequant_rows(*type, w, *stride, k, which);
    if (!rows) return w;
    *type = FT_BF16;
    *stride = (size_t)k * 2;
    return rows;
}

static void amx_gate_up(const moe_job *j, const uint16_t *xp, uint16_t *actp, const int32_t *tile_base, int task) {
    int blocks = j->inter / ROW_BLOCK, e = task / blocks, r0 = (task % blocks) * ROW_BLOCK, expert = j->experts[e];
    int p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0, tiles = tile_base[e + 1] - tile_base[e];
    int gt = j->gate_type, ut = j->up_type;
    size_t gb = row_bytes(gt, j->hidden), ub = row_bytes(ut, j->hidden);
    const uint8_t *gate = amx_block_rows(j->gate + expert * j->gate_stride + r0 * gb, &gt, &gb, j->hidden, 0);
    const uint8_t *up = amx_block_rows(j->up + expert * j->up_stride + r0 * ub, &ut, &ub, j->hidden, 1);
    float g[2][16][16], u[2][16][16];
    for (int tile = 0, now; tile < tiles; tile += now) {
        now = amx_pass_tiles(tile, tiles);
        size_t base = (size_t)(tile_base[e] + tile);
        amx_rows_x_tokens2(gt, gate, gb, ut, up, ub, xp + base * j->hidden * AMX_TOKENS, now, j->hidden,
                           &g[0][0][0], &u[0][0][0]);
        for (int i = 0; i < now; i++) {
            uint16_t *dst = actp + (base + i) * j->inter * AMX_TOKENS;
            int valid = n - (tile + i) * AMX_TOKENS < AMX_TOKENS ? n - (tile + i) * AMX_TOKENS : AMX_TOKENS;
            for (int r = 0; r < ROW_BLOCK; r++) {
                int row = r0 + r;
                float acts[AMX_TOKENS];
                /* in vectors all 16 columns (unused ones are zero and dropped); bf16 rounding is on with tiles */
                expert_acts(j, expert, row, g[i][r], u[i][r], acts_in_vectors(j) ? AMX_TOKENS : valid, acts);
                for (int c = 0; c < AMX_TOKENS; c++) {  /* (fp32 act stays unwritten: amx_down reads actp) */
                    float a = c < valid ? acts[c] : 0.0f;
                    uint32_t bits;
                    memcpy(&bits, &a, 4);
                    dst[(size_t)(row / 2) * AMX_TOKENS * 2 + c * 2 + (row & 1)] = (uint16_t)(bits >> 16);
                }
            }
        }
    }
}

/* A per-thread [tokens][ROW_BLOCK] accumulator for amx_down's rows (NULL when memory runs out). */
static float *amx_down_rows(int tokens) {
    static __thread float *buf;
    static __thread size_t capacity;
    size_t need = (size_t)tokens * ROW_BLOCK;
    if (need > capacity) {
        free(buf);
        buf = aligned_alloc(64, (need * 4 + 63) / 64 * 64);
        capacity = buf ? need : 0;
    }
    return buf;
}

/* Phase 2 on tiles: a task's 16 output rows over every expert. Their sums build up in a [token][16 rows] buffer
   (one cache line a token) and are copied into y at the end: added in y itself, each row's tokens lie a row of y
   apart (8 KiB for hidden 2048), so every update missed L1 (the updates took ~30% of this function at 32 tokens
   on a Sapphire Rapids-class core). Same additions in the same order: the same bits. */
static void amx_down(const moe_job *j, const uint16_t *actp, const int32_t *tile_base, int task) {
    int h0 = task * ROW_BLOCK;
    float d[2][16][16];
    float *acc = amx_down_rows(j->tokens), *y = acc ? acc : j->y;
    size_t pitch = acc ? ROW_BLOCK : (size_t)j->hidden, col = acc ? 0 : (size_t)h0;
    for (int t = 0; t < j->tokens; t++)
        for (int r = 0; r < ROW_BLOCK; r++) y[(size_t)t * pitch + col + r] = 0.0f;
    for (int e = 0; e < j->n_experts; e++) {
        int p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0, tiles = tile_base[e + 1] - tile_base[e];
        int dt = j->down_type;
        size_t db = row_bytes(dt, j->inter);
        const uint8_t *down = amx_block_rows(j->down + j->experts[e] * j->down_stride + h0 * db, &dt, &db,
                                             j->inter, 0);
        for (int tile = 0, now; tile < tiles; tile += now) {
            now = amx_pass_tiles(tile, tiles);
            amx_rows_x_tokens(dt, down, db, actp + (size_t)(tile_base[e] + tile) * j->inter * AMX_TOKENS, now,
                              j->inter, &d[0][0][0]);
            for (int i = 0; i < now; i++) {
                int first = p0 + (tile + i) * AMX_TOKENS, left = p0 + n - first;
                int valid = left < AMX_TOKENS ? left : AMX_TOKENS;
                float w[AMX_TOKENS] = {0};  /* the tile's routing weights, unused columns zero */
                memcpy(w, j->pair_weights + first, (size_t)valid * sizeof *w);
                for (int r = 0; r < ROW_BLOCK; r++) {
                    float v[AMX_TOKENS];
                    expert_outs(j, j->experts[e], h0 + r, d[i][r], w, outs_in_vectors(j) ? AMX_TOKENS : valid, v);
                    for (int c = 0; c < valid; c++) y[(size_t)j->pair_tokens[first + c] * pitch + col + r] += v[c];
                }
            }
        }
    }
    if (acc)
        for (int t = 0; t < j->tokens; t++)
            memcpy(j->y + (size_t)t * j->hidden + h0, acc + (size_t)t * ROW_BLOCK, ROW_BLOCK * sizeof *acc);
}
#endif
