/* The CPU expert kernel's vector dot paths with their weights in L2 (no DRAM): one thread's arithmetic ceiling
   per format and tokens per pass, to set against what the pool reaches from DRAM (kernels/cpu_experts/bench.py).
   Includes the kernel's one translation unit, so it measures exactly the shipped code.

     cc -O3 -march=native -std=gnu11 -pthread -o /tmp/dots evals/scripts/dots_in_cache.c -lm && /tmp/dots */
#include "../../kernels/cpu_experts/experts.c"
#include <stdio.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

/* Best of 5 rounds: G weights/s over `rows` rows of k weights, two rows a call (as the kernel's tasks go). */
static double rate(int type, int bf16_path, const uint8_t *w, size_t row_bytes, int rows, int k,
                   const uint16_t *const *xb, const float *const *xf, int n) {
    float out[2 * 16];
    int calls = (int)(2e8 / ((double)k * rows)) + 1;
    double best = 1e30;
    for (int round = 0; round < 5; round++) {
        double t0 = now();
        for (int c = 0; c < calls; c++)
            for (int r = 0; r + 1 < rows; r += 2) {
                const void *pair[2] = {w + r * row_bytes, w + (r + 1) * row_bytes};
                if (bf16_path) rows_dots_bf16_n(type, pair, 2, xb, k, n, out);
                else rows_dots_n(type, pair, 2, xf, k, n, out);
            }
        double dt = now() - t0;
        if (dt < best) best = dt;
        if (out[0] == 12345.0f) printf(" ");  /* keeps the results live */
    }
    return (double)k * rows * calls / best / 1e9;
}

#if HAVE_AMX
/* The bf16 tile path as amx_gate_up runs one task (16 rows of gate and of up, one tile of up to 16 tokens: its
   time does not depend on the token count): block formats dequantized to bf16 rows first, then the tiles. */
static void amx_rate(int type, const uint8_t *w, size_t row_bytes, int rows, int k) {
    uint16_t *packed = aligned_alloc(64, (size_t)k * AMX_TOKENS * 2);
    for (int i = 0; i < k * AMX_TOKENS; i++) packed[i] = (uint16_t)(0x3c00 + i % 89);
    float g[16][16], u[16][16];
    for (int part = 0; part < 2; part++) {  /* 0: dequantization (block formats) alone, 1: the whole task */
        if (part == 0 && type == FT_BF16) continue;
        int calls = (int)(2e8 / ((double)k * rows)) + 1;
        double best = 1e30;
        for (int round = 0; round < 5; round++) {
            double t0 = now();
            for (int c = 0; c < calls; c++)
                for (int r = 0; r + 31 < rows; r += 32) {
                    int gt = type, ut = type;
                    size_t gb = row_bytes, ub = row_bytes;
                    const uint8_t *gate = amx_block_rows(w + r * row_bytes, &gt, &gb, k, 0);
                    const uint8_t *up = amx_block_rows(w + (r + 16) * row_bytes, &ut, &ub, k, 1);
                    if (part) amx_rows_x_tokens2(gt, gate, gb, ut, up, ub, packed, 1, k, &g[0][0], &u[0][0]);
                }
            double dt = now() - t0;
            if (dt < best) best = dt;
        }
        if (g[0][0] == 12345.0f) printf(" ");
        printf("| %s | %s | %.1f G weights/s (any 1-16 tokens) |\n", type == FT_BF16 ? "BF16" : "Q8_0",
               part ? "amx tiles, whole task" : "amx: dequantize to bf16 only", (double)k * rows * calls / best / 1e9);
    }
    free(packed);
}
#endif

int main(void) {
    static const int counts[] = {1, 2, 4, 6, 8, 16};
    const int k = 2048, rows = 64;  /* 256 KiB of bf16 weights: L2 on every x86 core since Skylake */
    uint16_t *xb[16];
    float *xf[16];
    for (int t = 0; t < 16; t++) {
        xb[t] = aligned_alloc(64, k * 2), xf[t] = aligned_alloc(64, k * 4);
        for (int i = 0; i < k; i++) xf[t][i] = (float)((i * 7 + t) % 13 - 6) / 8, xb[t][i] = (uint16_t)(0x3c00 + i % 97);
    }
    printf("one thread, rows of %d weights in L2, two rows a call; G weights/s (G multiply-adds/s)\n", k);
    printf("| format | path | %s\n", "tokens: 1 | 2 | 4 | 6 | 8 | 16 |");
    const int types[] = {FT_BF16, FT_Q8_0};
    for (int f = 0; f < 2; f++) {
        int type = types[f];
        size_t row_bytes = type == FT_BF16 ? (size_t)k * 2 : (size_t)k / Q8_BLOCK * Q8_BYTES;
        uint8_t *w = aligned_alloc(64, row_bytes * rows);
        for (size_t i = 0; i < row_bytes * rows; i++) w[i] = (uint8_t)(i * 2654435761u >> 13);
        if (type == FT_BF16)
            for (size_t i = 0; i < (size_t)k * rows; i++) ((uint16_t *)w)[i] = (uint16_t)(0x3c00 + i % 101);
        else
            for (int b = 0; b < k / Q8_BLOCK * rows; b++) { uint16_t s = 0x2000; memcpy(w + b * Q8_BYTES, &s, 2); }
        for (int bf16_path = HAVE_BF16_DOT; bf16_path >= 0; bf16_path--) {
            printf("| %s | %s |", type == FT_BF16 ? "BF16" : "Q8_0", bf16_path ? "bf16 dot" : "fp32");
            for (int c = 0; c < 6; c++) {
                double g = rate(type, bf16_path, w, row_bytes, rows, k, (const uint16_t *const *)xb,
                                (const float *const *)xf, counts[c]);
                printf(" %.1f (%.0f) |", g, g * counts[c]);
                fflush(stdout);
            }
            printf("\n");
        }
#if HAVE_AMX
        if (tiles_permitted()) amx_rate(type, w, row_bytes, rows, k);
#endif
        free(w);
    }
    return 0;
}
