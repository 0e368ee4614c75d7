/* Part of experts.c (included once, where it stands): the AMX tile instructions the tile paths use (amx.h: bf16,
   amx_q8.h: int8), as the instructions themselves, or under FT_AMX_EMULATE emulated in C with the semantics of
   Intel's SDM, so the tile paths' layouts are tested on any AVX-512 machine (the emulated build is a separate
   library, for tests only). Tile numbers are compile-time constants for the real instructions. */

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#if defined(FT_AMX_EMULATE)
#define TILES_EMULATED 1
/* 8 tiles of up to 16 rows x 64 bytes, per thread. */
static __thread struct { uint8_t data[8][16][64]; int rows[8], colsb[8]; } tq;
static int tiles_permitted(void) { return 1; }
static void tiles_config(const tile_config *cfg) {
    for (int t = 0; t < 8; t++) tq.rows[t] = cfg->rows[t], tq.colsb[t] = cfg->colsb[t];
}
static void tiles_load(int t, const void *p, size_t stride) {
    for (int r = 0; r < tq.rows[t]; r++) memcpy(tq.data[t][r], (const uint8_t *)p + r * stride, tq.colsb[t]);
}
static void tiles_store(int t, void *p, size_t stride) {
    for (int r = 0; r < tq.rows[t]; r++) memcpy((uint8_t *)p + r * stride, tq.data[t][r], tq.colsb[t]);
}
static void tiles_zero(int t) { memset(tq.data[t], 0, sizeof tq.data[t]); }
/* TDPBSSD / TDPBSUD: c[m][n] += sum over k of a[m][k] * b[k/4][4n + k%4]; a signed, b signed or unsigned */
static void tiles_dot_int8(int c, int a, int b, int b_signed) {
    for (int m = 0; m < tq.rows[a]; m++)
        for (int n = 0; n < tq.colsb[b] / 4; n++) {
            int32_t sum;
            memcpy(&sum, &tq.data[c][m][n * 4], 4);
            for (int k = 0; k < tq.colsb[a]; k++) {
                int bv = b_signed ? (int8_t)tq.data[b][k / 4][n * 4 + k % 4] : tq.data[b][k / 4][n * 4 + k % 4];
                sum += (int8_t)tq.data[a][m][k] * bv;
            }
            memcpy(&tq.data[c][m][n * 4], &sum, 4);
        }
}
/* TDPBF16PS: c[m][n] += sum over k of a[m][k] * b[k/2][2n + k%2], bf16 values, fp32 sums in k order (each product
   of two bf16 values is exact in fp32) */
static void tiles_dot_bf16(int c, int a, int b) {
    for (int m = 0; m < tq.rows[a]; m++)
        for (int n = 0; n < tq.colsb[b] / 4; n++) {
            float sum;
            memcpy(&sum, &tq.data[c][m][n * 4], 4);
            for (int k = 0; k < tq.colsb[a] / 2; k++) {
                uint16_t av, bv;
                memcpy(&av, &tq.data[a][m][k * 2], 2);
                memcpy(&bv, &tq.data[b][k / 2][n * 4 + (k % 2) * 2], 2);
                sum += bf16_scalar(av) * bf16_scalar(bv);
            }
            memcpy(&tq.data[c][m][n * 4], &sum, 4);
        }
}
#define TILE_CONFIG(cfg) tiles_config(cfg)
#define TILE_LOAD(t, p, stride) tiles_load(t, p, stride)
#define TILE_STORE(t, p, stride) tiles_store(t, p, stride)
#define TILE_ZERO(t) tiles_zero(t)
#define TILE_BF16(c, a, b) tiles_dot_bf16(c, a, b)
#define TILE_SS(c, a, b) tiles_dot_int8(c, a, b, 1)
#define TILE_SU(c, a, b) tiles_dot_int8(c, a, b, 0)
#define TILE_RELEASE() ((void)0)
#elif HAVE_AMX
static int tiles_permitted(void) {  /* the kernel must enable the tile state for this process, once */
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}
#define TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#if defined(__AMX_INT8__)
#define TILE_SS(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_SU(c, a, b) _tile_dpbsud(c, a, b)
#endif
#define TILE_RELEASE() _tile_release()
#endif
