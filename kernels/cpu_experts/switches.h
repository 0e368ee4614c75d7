/* Part of experts.c (included once, where it stands): the kernel's switches, set between jobs by tests and
   measurements (evals/scripts/kernel_variants.py) to compare its paths, and what this build and CPU have. */

/* The int16-activation Q8_0 path on (default) or off, for tests and measurements against the fp32 path. */
void ft_set_q16(int on) { q16_disabled = !on; }

/* From how many tokens per expert block formats (Q8_0, MXFP4, FP8_B32) of a bf16 model take the bf16 dot path
   (a large number keeps them on the fp32 path), for tests and measurements; returns the setting it replaces. */
int ft_set_block_bf16(int min_tokens) {
    int before = block_bf16_min_tokens;
    block_bf16_min_tokens = min_tokens;
    return before;
}

/* The 8-lane dot products (dots_avx2.h, and the int16 path's q16_avx2.h) on or off; on by default only where
   AVX-512 is missing. Returns the setting it replaces, or -1 where the build has no AVX2 (the switch does nothing
   there). */
int ft_set_avx2_dots(int on) {
#if HAVE_AVX2_DOTS
    int before = avx2_dots;
    avx2_dots = on;
    return before;
#else
    (void)on;
    return -1;
#endif
}

/* Up to how many and from how many tokens per expert (2 at least) a bf16 model's Q8_0 rows take the int16 path 16
   rows at a time (q16_rows.h; max 1: never), and its software prefetch distance in each row (bytes; 0: off); each
   returns the setting it replaces (-1 where the build has no such path). */
int ft_set_q16_rows(int max_tokens) {
    int before = q16_rows_max_tokens;
    q16_rows_max_tokens = max_tokens;
    return HAVE_Q16_ROWS ? before : -1;
}

int ft_set_q16_rows_from(int min_tokens) {
    int before = q16_rows_min_tokens;
    q16_rows_min_tokens = min_tokens;
    return HAVE_Q16_ROWS ? before : -1;
}

int ft_set_q16_rows_prefetch(int bytes) {
#if HAVE_Q16_ROWS
    int before = q16_rows_prefetch;
    q16_rows_prefetch = bytes;
    return before;
#else
    (void)bytes;
    return -1;
#endif
}

/* Owned rows on or off (default): see owned_rows; returns the setting it replaces. */
int ft_set_owned_rows(int on) {
    int before = owned_rows;
    owned_rows = on;
    return before;
}

/* Whether the int16-activation path dots rows in interleaved pairs (default) or one at a time, for measuring. */
void ft_set_q16_form(int two_rows) { q16_two_rows = two_rows; }

/* AMX tuning: the fewest tokens per expert worth tiles for bf16 and for block-format weights (defaults 2 and 6),
   and a switch for measuring without them. */

void ft_set_amx(int min_tokens, int block_min_tokens, int disabled) {
#if HAVE_AMX
    amx_min_tokens = min_tokens;
    amx_block_min_tokens = block_min_tokens;
    amx_disabled = disabled;
#else
    (void)min_tokens, (void)block_min_tokens, (void)disabled;
#endif
}

/* The token counts per expert (the most of any expert in a job) that take Q8_0's int8 tiles (defaults 2 and 32;
   max 0: never), for tuning and for measuring against the other paths. */
void ft_set_amx_q8(int min_tokens, int max_tokens) {
#if HAVE_AMX_Q8
    amx_q8_min_tokens = min_tokens;
    amx_q8_max_tokens = max_tokens;
#else
    (void)min_tokens, (void)max_tokens;
#endif
}

/* Software prefetch distance of the tile paths' weight rows, in k-chunks of 32 weights (0: off), for measuring. */
void ft_set_amx_prefetch(int chunks) {
#if HAVE_AMX || HAVE_AMX_Q8
    amx_prefetch = chunks < 0 ? 0 : chunks;
#else
    (void)chunks;
#endif
}

/* The interleaved runs of rows a 16-row block of block-format rows is dequantized as for the bf16 tiles (amx.h
   amx_dequant_streams: 1, 2, 4 (default), 8 or 16; other values change nothing); returns the setting it replaces (-1
   where the build has no tiles). */
int ft_set_amx_dequant_streams(int streams) {
#if HAVE_AMX
    int before = amx_dequant_streams;
    if (streams > 0 && streams <= 16 && 16 % streams == 0) amx_dequant_streams = streams;
    return before;
#else
    (void)streams;
    return -1;
#endif
}

/* Software prefetch distance in bytes while block-format rows are dequantized for the bf16 tiles (0: off; 4 KiB by
   default); returns the distance it replaces. */
int ft_set_amx_dequant_prefetch(int bytes) {
#if HAVE_AMX
    int before = amx_dequant_prefetch;
    amx_dequant_prefetch = bytes < 0 ? 0 : bytes;
    return before;
#else
    (void)bytes;
    return 0;
#endif
}

/* Software prefetch distance in bytes in each weight row while the vector paths (and the int16 path) dot it (0:
   off; the default in dots.h); returns the distance it replaces. */
int ft_set_dots_prefetch(int bytes) {
    int before = dots_prefetch;
    dots_prefetch = bytes < 0 ? 0 : bytes;
    return before;
}

/* Whether the experts' epilogues (act.h: activations, each pair's output) take a row's values LANES at a time
   (1, default) or one by one (0), for measuring; returns the setting it replaces. */
int ft_set_vector_act(int on) {
    int before = vector_act;
    vector_act = on != 0;
    return before;
}

/* Whether a bf16 tile pass takes two of an expert's token tiles at once (1, default) or one (0); returns the
   setting it replaces. */
int ft_set_amx_tile_pairs(int on) {
#if HAVE_AMX
    int before = amx_tile_pairs;
    amx_tile_pairs = on != 0;
    return before;
#else
    (void)on;
    return 0;
#endif
}

/* The weight rows one pass of Q8_0's int8 tiles takes: 16 or 32 (two A tiles against the same activations). */
void ft_set_amx_q8_rows(int rows) {
#if HAVE_AMX_Q8
    amx_q8_rows = rows == 32 ? 32 : 16;
#else
    (void)rows;
#endif
}

/* Whether Q8_0's int8 tiles are compiled in and usable: 1 on real tiles, 2 emulated (FT_AMX_EMULATE), 0 not. */
int ft_has_amx_q8(void) {
#if HAVE_AMX_Q8 && defined(AMX_Q8_EMULATED)
    return 2;
#elif HAVE_AMX_Q8
    return amx_q8_permitted();
#else
    return 0;
#endif
}

/* Whether AMX tiles are compiled in and the OS lets this process use them. */
int ft_has_amx(void) {
#if HAVE_AMX
    return tiles_permitted();
#else
    return 0;
#endif
}

/* Whether this build has the bf16 dot path (AVX-512-BF16). */
int ft_has_bf16_dot(void) { return HAVE_BF16_DOT; }

/* Whether block formats (Q8_0, MXFP4) of a bf16 model can dot int16 activations at one token per expert: 0 no,
   1 on 8 lanes (AVX2), 2 on 16 lanes too (AVX-512BW; ft_set_avx2_dots picks the 8-lane form). */
int ft_has_q16(void) { return HAVE_Q16_AVX512 ? 2 : HAVE_Q16; }
