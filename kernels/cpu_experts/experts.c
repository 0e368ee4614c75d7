/* SwiGLU routed experts on the CPU, reading their weights where they live in host memory.

   Decode on the CPU is bound by DRAM reads: every weight byte is read once per step and used for at most a
   few tokens. So the kernel streams each weight row once, keeps the activations (fp32, a few KiB per token)
   in cache, and accumulates in fp32. Weight formats: f32, bf16 and GGUF Q8_0 (34-byte blocks: an f16 scale
   and 32 int8); quantized weights are dequantized in registers, never expanded in memory. Activations stay
   fp32 (no activation quantization), so results match a float reference to rounding.

   One call computes one layer's experts for their tokens in two phases over a persistent thread pool:
     1. act[p, i] = silu(gate_e[i] . x[t_p]) * (up_e[i] . x[t_p])   tasks: (expert, block of I rows)
     2. y[t, h]  = sum over pairs p of token t: w_p * (down_e[h] . act[p])   tasks: blocks of H rows
   Phase 2 gives each task whole output rows, so there are no races and the sum order is fixed
   (deterministic results whatever the thread count).

   Vectors are GCC/Clang vector extensions, so one source compiles to AVX-512, AVX2 or NEON under
   -march=native. Shapes: T tokens, H hidden, I expert intermediate, P (token, expert) pairs. */

#include <math.h>
#include <pthread.h>
#include <time.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#if defined(FT_AMX_EMULATE) && defined(__AVX512BF16__)
#define HAVE_AMX 1  /* over tiles emulated in C (tiles.h): a build for tests */
#elif defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { FT_F32 = 0, FT_BF16 = 1, FT_Q8_0 = 2, FT_MXFP4 = 3, FT_FP8 = 4 };
/* MXFP4: an E8M0 scale byte, then 32 four-bit codes (low nibbles 0..15, high 16..31); FP8_B32 (block-FP8
   checkpoints' experts): an fp32 scale, then 32 e4m3 bytes */
enum { MX_BYTES = 17, FP8_BYTES = 36 };
/* TILE tokens share one pass over a row in registers; up to MAX_PAIRS tokens share its trip from DRAM. */
enum { LANES = 16, TILE = 4, MAX_PAIRS = 64, ROW_BLOCK = 16, MAX_THREADS = 256, Q8_BLOCK = 32, Q8_BYTES = 34 };

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint16_t vu16 __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu32 __attribute__((vector_size(LANES * 4)));
typedef int8_t vi8 __attribute__((vector_size(LANES)));
typedef int32_t vi32 __attribute__((vector_size(LANES * 4)));
typedef uint64_t vu64 __attribute__((vector_size(64)));

#define INLINE static inline __attribute__((always_inline))

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ volatile("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* How long an idle worker spins before sleeping: a sleeping worker costs tens of microseconds to wake. Short
   enough not to starve other work on the cores (spinning 2 ms instead made the H200 host's decode slower:
   evals/results/d1-qwen3-30b-a3b-bf16-1k-h200.md, commit 9dbf165). */
#define SPIN_NS 200000L

#include "dots.h"

#include "q16.h"

static size_t row_bytes(int type, int k) {
    if (type >= FT_Q8_0)
        return (size_t)(k / Q8_BLOCK) * block_bytes(type);
    return (size_t)k * (type == FT_BF16 ? 2 : 4);
}

/* A buffer that grows to the largest request seen (64-byte aligned, half again as much as asked, so slowly growing
   jobs do not reallocate each time), for scratch that one job at a time uses; NULL when memory runs out. */
typedef struct { void *buf; size_t capacity; } growing_buffer;

static void *grow_to(growing_buffer *g, size_t bytes) {
    if (bytes > g->capacity) {
        free(g->buf);
        g->capacity = bytes + bytes / 2;
        g->buf = aligned_alloc(64, (g->capacity + 63) / 64 * 64);
        if (!g->buf) g->capacity = 0;
    }
    return g->buf;
}

#include "pool.h"
/* ---- one layer's experts ---- */

typedef struct {
    const uint8_t *gate, *up, *down;      /* stacked weights of all experts of the layer */
    size_t gate_stride, up_stride, down_stride;  /* bytes from one expert to the next */
    int gate_type, up_type, down_type;
    const int32_t *experts;               /* [n_experts] expert ids to run */
    int n_experts;
    const int32_t *pair_offsets;          /* [n_experts + 1] CSR over the pairs, grouped by expert */
    const int32_t *pair_tokens;           /* [P] token of each pair */
    const float *pair_weights;            /* [P] routing weight of each pair */
    const float *x;                       /* [T, H] */
    float *act;                           /* [P, I] scratch */
    float *y;                             /* [T, H] output, overwritten */
    int tokens, hidden, inter;
    int bf16_rounding;                    /* round where a bf16 GPU expert rounds: projections, silu, products */
    const uint16_t *xb;                   /* [T, H] x as bf16, or NULL: then the bf16 dot path is off */
    uint16_t *actb;                       /* [P, I] act as bf16 (written in phase 1 when xb is set) */
    const int16_t *xq;                    /* [T, H] x as int16 with scales xqs [T, H/32], or NULL (Q8_0/MXFP4 gate/up) */
    const float *xqs;
    int16_t *actq;                        /* [P, I] act as int16 with scales actqs (written in phase 1), or NULL */
    float *actqs;
    int gate_rows;                        /* rows of gate/up per phase-1 task (whole blocks of act with actq) */
    /* the expert function where it is not plain SwiGLU: fp32 biases by expert id (gate/up [E, I], down [E, H],
       or NULL) and the activation: 0 SwiGLU, 1 gpt-oss's clamped form, (clamp(u, ±limit) + 1) * g *
       sigmoid(alpha * g) with g = min(g, limit), 2 DeepSeek-V4's, silu(min(g, limit)) * clamp(u, ±limit) */
    const float *gate_bias, *up_bias, *down_bias;
    int activation;
    float alpha, limit;
} moe_job;

#include "act.h"

/* tuning: the tokens per expert (in one pass) from which block-format rows of a bf16 model take the bf16 dot
   path (dequantized to bf16 in registers, BF16_TILE tokens a pass) rather than the fp32 path (widened to fp32 per
   TILE tokens). Below it the fp32 path is faster on a Sapphire Rapids host (15 threads, Q8_0 b2 66.7 against
   60.8 GB/s, b4 59.9 against 46.5; MXFP4 likewise); at 8 tokens the bf16 path wins on a Zen 4 core (9.2 against
   7.5 GB/s, 2 threads), and from 5 on the fp32 path needs a second pass over each row
   (evals/results/cpu-expert-kernel-h200.md). Where AMX is compiled in (Sapphire Rapids and later) never: one core
   of such a host ran Q8_0 slower on the bf16 dot path than on the fp32 path at every count of 1-16 tokens, weights
   in L2 (evals/scripts/dots_in_cache.c), and tiles take block formats from 6 tokens. ft_set_block_bf16 moves it. */
static int block_bf16_min_tokens = HAVE_AMX ? 1 << 30 : 5;

/* Whether rows of format `type` dot bf16 activations (the job has them) for a pass of nt tokens. */
INLINE int bf16_dot_takes(const moe_job *j, int type, int nt) {
    return j->xb && (type == FT_BF16 || nt >= block_bf16_min_tokens);
}

/* tuning: the tokens per expert at which a bf16 model's Q8_0 rows take the int16 path 16 rows at a time
   (q16_rows.h): from q16_rows_min_tokens up to q16_rows_max_tokens (the most of any expert in the job decides
   whether x is quantized). 3-5: on the H100 test machine's host (15 threads) it read 1.10x, 1.10x, 1.19x the fp32
   path with its 4 KiB row prefetch at 3, 4, 5 tokens and 0.97x at 2; from 6 the bf16 tiles are faster. (On a
   2-thread VM it read 0.9x at 2-4: its 16 row streams prefetch worse where one core must pull 15 GB/s;
   evals/results/cpu-kernel-q16-rows.md.) ft_set_q16_rows and ft_set_q16_rows_from move them (max 1: never). */
static int q16_rows_min_tokens = 3, q16_rows_max_tokens = 5;
enum { Q16_ROWS_MAX = 16, Q16_ROWS_MAX_TOKENS = 8 };

/* Whether a pass of nt tokens over rows of `type` takes q16_rows (`quantized`: the job's int16 activations for
   these rows, x's or act's, or NULL): where the bf16 dot path does not (it takes block formats from
   block_bf16_min_tokens, never where tiles are compiled in). */
INLINE int q16_rows_take(const moe_job *j, int type, int nt, const int16_t *quantized) {
    return HAVE_Q16_ROWS && quantized && type == FT_Q8_0 && nt >= 2 && nt >= q16_rows_min_tokens &&
           nt <= q16_rows_max_tokens && nt <= Q16_ROWS_MAX_TOKENS && !bf16_dot_takes(j, type, nt);
}

/* The dots of 16 rows (from w, stride bytes apart, k weights) with nt activations' int16 copies, row at[t] of q
   (block scales qs) for token t: out[r * nt + t]. */
static void q16_rows_for(const uint8_t *w, size_t stride, const int16_t *q, const float *qs, const int32_t *at, int k,
                         int nt, float *out) {
#if HAVE_Q16_ROWS
    const int16_t *xq[Q16_ROWS_MAX_TOKENS];
    const float *xs[Q16_ROWS_MAX_TOKENS];
    for (int t = 0; t < nt; t++) xq[t] = q + (size_t)at[t] * k, xs[t] = qs + (size_t)at[t] * (k / Q8_BLOCK);
    q16_rows_dots_n(w, stride, xq, xs, k, nt, out);
#else
    (void)w, (void)stride, (void)q, (void)qs, (void)at, (void)k, (void)nt, (void)out;
#endif
}

static void phase_gate_up(void *ctx, int task) {
    const moe_job *j = ctx;
    int blocks = (j->inter + j->gate_rows - 1) / j->gate_rows, e = task / blocks, r0 = (task % blocks) * j->gate_rows;
    int r1 = r0 + j->gate_rows < j->inter ? r0 + j->gate_rows : j->inter, expert = j->experts[e];
    int p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0;
    size_t gb = row_bytes(j->gate_type, j->hidden), ub = row_bytes(j->up_type, j->hidden);
    const uint8_t *gate = j->gate + expert * j->gate_stride, *up = j->up + expert * j->up_stride;
    const float *xs[MAX_PAIRS];
    const uint16_t *xbs[MAX_PAIRS];
    float gu[2 * MAX_PAIRS];  /* gate dots, then up dots */
    for (int t0 = 0; t0 < n; t0 += MAX_PAIRS) {
        int nt = n - t0 < MAX_PAIRS ? n - t0 : MAX_PAIRS;
        for (int t = 0; t < nt; t++) {
            xs[t] = j->x + (size_t)j->pair_tokens[p0 + t0 + t] * j->hidden;
            if (j->xb) xbs[t] = j->xb + (size_t)j->pair_tokens[p0 + t0 + t] * j->hidden;
        }
        float grouped[2][Q16_ROWS_MAX * Q16_ROWS_MAX_TOKENS];  /* gate, up dots of rows group_r0.. (q16_rows) */
        int group_r0 = r0, group_r1 = r0;
        for (int r = r0; r < r1; r++) {
            const void *rows[2] = {gate + r * gb, up + r * ub};
            if (r == group_r1 && r + Q16_ROWS_MAX <= r1 && j->up_type == j->gate_type &&
                q16_rows_take(j, j->gate_type, nt, j->xq)) {
                const int32_t *tokens = j->pair_tokens + p0 + t0;
                q16_rows_for(rows[0], gb, j->xq, j->xqs, tokens, j->hidden, nt, grouped[0]);
                q16_rows_for(rows[1], ub, j->xq, j->xqs, tokens, j->hidden, nt, grouped[1]);
                group_r0 = r, group_r1 = r + Q16_ROWS_MAX;
            }
            if (r < group_r1) {
                for (int t = 0; t < nt; t++)
                    gu[t] = grouped[0][(r - group_r0) * nt + t], gu[nt + t] = grouped[1][(r - group_r0) * nt + t];
            } else if (j->xq && nt == 1) {  /* several tokens share the fp32 path's widened weights: faster there */
#if HAVE_Q16
                size_t token = (size_t)j->pair_tokens[p0 + t0];
                const int16_t *xq = j->xq + token * j->hidden;
                const float *xqs = j->xqs + token * (j->hidden / Q8_BLOCK);
                if (q16_two_rows) {
                    q16_dot2(j->gate_type, rows[0], rows[1], xq, xqs, j->hidden, gu);
                } else {
                    gu[0] = q16_dot(j->gate_type, rows[0], xq, xqs, j->hidden);
                    gu[1] = q16_dot(j->gate_type, rows[1], xq, xqs, j->hidden);
                }
#endif
            } else if (bf16_dot_takes(j, j->gate_type, nt) && j->gate_type == j->up_type) {
                rows_dots_bf16_n(j->gate_type, rows, 2, xbs, j->hidden, nt, gu);
            } else if (bf16_dot_takes(j, j->gate_type, nt) && bf16_dot_takes(j, j->up_type, nt)) {
                rows_dots_bf16_n(j->gate_type, rows, 1, xbs, j->hidden, nt, gu);
                rows_dots_bf16_n(j->up_type, rows + 1, 1, xbs, j->hidden, nt, gu + nt);
            } else if (j->gate_type == j->up_type) {  /* the gate and up rows of one unit share activation loads */
                rows_dots_n(j->gate_type, rows, 2, xs, j->hidden, nt, gu);
            } else {
                rows_dots_n(j->gate_type, rows, 1, xs, j->hidden, nt, gu);
                rows_dots_n(j->up_type, rows + 1, 1, xs, j->hidden, nt, gu + nt);
            }
            float acts[MAX_PAIRS];
            expert_acts(j, expert, r, gu, gu + nt, nt, acts);
            for (int t = 0; t < nt; t++) {
                float a = acts[t];
                j->act[(size_t)(p0 + t0 + t) * j->inter + r] = a;
                if (j->actb) {  /* a is a bf16 value here (bf16 rounding is on): its top half is exact */
                    uint32_t bits;
                    memcpy(&bits, &a, 4);
                    j->actb[(size_t)(p0 + t0 + t) * j->inter + r] = (uint16_t)(bits >> 16);
                }
            }
        }
    }
#if HAVE_Q16
    if (j->actq)  /* this task owns whole 32-blocks of act (gate_rows is a multiple of 32): quantize them */
        for (int p = p0; p < p0 + n; p++)
            q16_quantize(j->act + (size_t)p * j->inter + r0, j->actq + (size_t)p * j->inter + r0,
                         j->actqs + (size_t)p * (j->inter / Q8_BLOCK) + r0 / Q8_BLOCK, r1 - r0);
#endif
}

static void phase_down(void *ctx, int task) {
    const moe_job *j = ctx;
    int h0 = task * ROW_BLOCK, h1 = h0 + ROW_BLOCK < j->hidden ? h0 + ROW_BLOCK : j->hidden;
    size_t db = row_bytes(j->down_type, j->inter);
    const float *as[MAX_PAIRS];
    const uint16_t *abs_[MAX_PAIRS];
    float d[2 * MAX_PAIRS];
    for (int h = h0; h < h1; h++)
        for (int t = 0; t < j->tokens; t++) j->y[(size_t)t * j->hidden + h] = 0.0f;
    for (int e = 0; e < j->n_experts; e++) {
        const uint8_t *down = j->down + j->experts[e] * j->down_stride;
        for (int p0 = j->pair_offsets[e]; p0 < j->pair_offsets[e + 1]; p0 += MAX_PAIRS) {
            int nt = j->pair_offsets[e + 1] - p0 < MAX_PAIRS ? j->pair_offsets[e + 1] - p0 : MAX_PAIRS;
            for (int t = 0; t < nt; t++) {
                as[t] = j->act + (size_t)(p0 + t) * j->inter;
                if (j->actb) abs_[t] = j->actb + (size_t)(p0 + t) * j->inter;
            }
            int q16 = j->actq && nt == 1, step = q16 && !q16_two_rows ? 1 : 2;  /* rows interleave in pairs */
            float grouped[Q16_ROWS_MAX * Q16_ROWS_MAX_TOKENS];  /* the task's 16 rows at once (q16_rows) */
            int group = h1 - h0 == Q16_ROWS_MAX && q16_rows_take(j, j->down_type, nt, j->actq);
            if (group) {
                int32_t pairs[Q16_ROWS_MAX_TOKENS];
                for (int t = 0; t < nt; t++) pairs[t] = p0 + t;
                q16_rows_for(down + h0 * db, db, j->actq, j->actqs, pairs, j->inter, nt, grouped);
                step = 2;
            }
            for (int h = h0; h < h1; h += step) {
                const void *rows[2] = {down + h * db, down + (h + 1) * db};
                int nr = h + 1 < h1 && step == 2 ? 2 : 1;
                if (group) {
                    for (int i = 0; i < nr * nt; i++) d[i] = grouped[(h - h0) * nt + i];
                } else if (q16) {
#if HAVE_Q16
                    const int16_t *aq = j->actq + (size_t)p0 * j->inter;
                    const float *aqs = j->actqs + (size_t)p0 * (j->inter / Q8_BLOCK);
                    if (nr == 2) q16_dot2(j->down_type, rows[0], rows[1], aq, aqs, j->inter, d);
                    else d[0] = q16_dot(j->down_type, rows[0], aq, aqs, j->inter);
#endif
                } else if (j->actb && bf16_dot_takes(j, j->down_type, nt))
                    rows_dots_bf16_n(j->down_type, rows, nr, abs_, j->inter, nt, d);
                else
                    rows_dots_n(j->down_type, rows, nr, as, j->inter, nt, d);
                for (int r = 0; r < nr; r++) {
                    float v[MAX_PAIRS];
                    expert_outs(j, j->experts[e], h + r, d + r * nt, j->pair_weights + p0, nt, v);
                    for (int t = 0; t < nt; t++) j->y[(size_t)j->pair_tokens[p0 + t] * j->hidden + h + r] += v[t];
                }
            }
        }
    }
}

#include "tiles.h"
#include "amx.h"

#include "amx_q8.h"

#if HAVE_AMX
#define AMX_SWITCHED_OFF amx_disabled
#else
#define AMX_SWITCHED_OFF 0
#endif

/* Both phases as one job: phase-1 tasks are numbered first, and a worker that draws a phase-2 task waits until
   every phase-1 task has finished (all were drawn before it, so this cannot deadlock). One wake-up per layer. */
typedef struct {
    moe_job job;
    int phase0_tasks, phase1_tasks, phase2_tasks;  /* phase 0 (packing) only on the AMX path */
    atomic_int phase0_done, phase1_done, phase2_done;
    long start_ns, end_ns;  /* when the job was posted and when its last task finished */
    atomic_long first_ns;   /* when a worker (or the caller) began the job's first task: the wake-up's cost */
    long phase1_end_ns;     /* when the last gate/up task finished (the down rows wait for it) */
    uint16_t *xp, *actp;    /* AMX: packed activations per expert, or NULL */
    int32_t *tile_base;     /* AMX: [n_experts + 1] first token tile of each expert in xp/actp */
    const uint16_t *xb_amx; /* bf16 x the AMX path packs (bf16 or Q8_0 weights), or NULL */
    uint8_t *q8x, *q8act;   /* AMX int8 (amx_q8.h): packed int16 activations per expert, or NULL */
} moe_run;

static moe_run current;  /* the job in flight between ft_moe_start and ft_moe_wait */
static double timing[4];  /* ft_moe_timing's sums (written by the one thread that waits) */

static void moe_task(void *ctx, int task) {
    moe_run *run = ctx;
    if (atomic_load_explicit(&run->first_ns, memory_order_relaxed) == 0) {
        long none = 0;
        atomic_compare_exchange_strong(&run->first_ns, &none, now_ns());
    }
    if (task < run->phase0_tasks) {
#if HAVE_AMX
        if (run->xp) amx_pack_x(&run->job, run->xb_amx, run->xp, run->tile_base, task);
#endif
#if HAVE_AMX_Q8
        if (run->q8x) amx_q8_pack_x(&run->job, run->q8x, run->q8act, run->tile_base, task);
#endif
#if HAVE_Q16
        if (run->job.xq) {  /* one token's x quantized for the Q8_0 gate/up rows */
            const moe_job *j = &run->job;
            q16_quantize(j->x + (size_t)task * j->hidden, (int16_t *)j->xq + (size_t)task * j->hidden,
                         (float *)j->xqs + (size_t)task * (j->hidden / Q8_BLOCK), j->hidden);
        }
#endif
        atomic_fetch_add(&run->phase0_done, 1);
        return;
    }
    task -= run->phase0_tasks;
    if (task < run->phase1_tasks) {
        while (atomic_load(&run->phase0_done) < run->phase0_tasks) CPU_RELAX();
#if HAVE_AMX
        if (run->xp) amx_gate_up(&run->job, run->xp, run->actp, run->tile_base, task); else
#endif
#if HAVE_AMX_Q8
        if (run->q8x) amx_q8_gate_up(&run->job, run->q8x, run->q8act, run->tile_base, task); else
#endif
        phase_gate_up(&run->job, task);
        if (atomic_fetch_add(&run->phase1_done, 1) + 1 == run->phase1_tasks) run->phase1_end_ns = now_ns();
        return;
    }
    while (atomic_load(&run->phase1_done) < run->phase1_tasks) CPU_RELAX();
#if HAVE_AMX
    if (run->xp) amx_down(&run->job, run->actp, run->tile_base, task - run->phase1_tasks); else
#endif
#if HAVE_AMX_Q8
    if (run->q8x) amx_q8_down(&run->job, run->q8act, run->tile_base, task - run->phase1_tasks); else
#endif
    phase_down(&run->job, task - run->phase1_tasks);
    if (atomic_fetch_add(&run->phase2_done, 1) + 1 == run->phase2_tasks) run->end_ns = now_ns();
}

/* The most tokens any of the job's experts takes. */
static int most_tokens(const moe_job *j) {
    int most = 0;
    for (int e = 0; e < j->n_experts; e++) {
        int n = j->pair_offsets[e + 1] - j->pair_offsets[e];
        most = n > most ? n : most;
    }
    return most;
}

/* Whether this job can run on AMX tiles: bf16 path on, shapes in whole tiles, and at least AMX_MIN tokens on
   some expert (below that the AVX-512 path is as fast and needs no packing). */
static int use_amx(const moe_job *j, const uint16_t *xb_amx) {
#if HAVE_AMX
    if (!xb_amx || j->hidden % 32 || j->inter % 32 || amx_disabled) return 0;
    int most = most_tokens(j);
    /* Block-format rows (Q8_0, MXFP4, FP8_B32) are dequantized to bf16 rows first, which costs what the vector
       path costs at a few tokens: tiles pay for them only from about 6 tokens on (measured for Q8_0 on a Sapphire
       Rapids-class core). */
    int q8 = j->gate_type >= FT_Q8_0 || j->up_type >= FT_Q8_0 || j->down_type >= FT_Q8_0;
    int least = q8 ? amx_block_min_tokens : amx_min_tokens;
    return most >= least && tiles_permitted();
#else
    (void)j, (void)xb_amx;
    return 0;
#endif
}

#if HAVE_AMX || HAVE_AMX_Q8
/* The first 16-token tile of each expert in the packed activations ([n_experts + 1], a buffer reused by every job),
   or NULL when it cannot be had. */
static int32_t *tile_bases(const int32_t *pair_offsets, int n_experts) {
    static int32_t *bases;
    static int capacity;
    if (n_experts + 1 > capacity) {
        free(bases);
        bases = malloc(sizeof(int32_t) * (n_experts + 1));
        capacity = bases ? n_experts + 1 : 0;
        if (!bases) return NULL;
    }
    bases[0] = 0;
    for (int e = 0; e < n_experts; e++) bases[e + 1] = bases[e] + (pair_offsets[e + 1] - pair_offsets[e] + 15) / 16;
    return bases;
}
#endif

#if HAVE_AMX_Q8
/* Whether this job runs on int8 tiles: a bf16 model's Q8_0 experts (all three projections), within the token
   counts set for them (beyond, the bf16 tiles dequantize each row block once for all its token tiles). */
static int use_amx_q8(const moe_job *j, const uint16_t *xb_amx) {
    if (!xb_amx || AMX_SWITCHED_OFF || j->gate_type != FT_Q8_0 || j->up_type != FT_Q8_0 || j->down_type != FT_Q8_0)
        return 0;
    int most = most_tokens(j);
    return most >= amx_q8_min_tokens && most <= amx_q8_max_tokens && amx_q8_permitted();
}
#endif

static int q16_disabled;  /* ft_set_q16(0): the fp32 path instead, to compare against */
/* ft_set_owned_rows(1): jobs on the vector paths give each worker the same share of every expert's rows (pool.h's
   owned tasks), the share ft_warm_rows reads ahead into that worker's caches */
static int owned_rows;

/* The int16-activation path for Q8_0 and MXFP4 projections of a bf16 model not on tiles: x and act get int16 copies in a
   scratch buffer (one job at a time), and phase-1 tasks own whole 32-row blocks of act. */
static void start_q16(moe_job *j, int tokens, int pairs) {
#if HAVE_Q16
    int q8_gate_up = j->gate_type == j->up_type && (j->gate_type == FT_Q8_0 || j->gate_type == FT_MXFP4);
    int q8_down = j->down_type == FT_Q8_0 || j->down_type == FT_MXFP4;
    if (!q8_gate_up && !q8_down) return;
    static growing_buffer scratch;
    size_t xq = (size_t)tokens * j->hidden * 2, xs = (size_t)tokens * (j->hidden / Q8_BLOCK) * 4;
    size_t aq = (size_t)pairs * j->inter * 2, as = (size_t)pairs * (j->inter / Q8_BLOCK) * 4;
    uint8_t *at = grow_to(&scratch, xq + xs + aq + as + 256);
    if (!at) return;
    if (q8_gate_up) {
        j->xq = (const int16_t *)at, at += (xq + 63) / 64 * 64;
        j->xqs = (const float *)at, at += (xs + 63) / 64 * 64;
    }
    if (q8_down) {
        j->actq = (int16_t *)at, at += (aq + 63) / 64 * 64;
        j->actqs = (float *)at;
        j->gate_rows = Q8_BLOCK;
    }
#else
    (void)j, (void)tokens, (void)pairs;
#endif
}

/* Starts y[T, H] = sum over the given experts of routing weight * expert(x) (SwiGLU, or the form the bias and
   clamp arguments give: see expert_act) on the pool's workers and
   returns at once (the caller may queue GPU work meanwhile); ft_moe_wait joins in and returns when y is ready.
   Every buffer must stay alive until then. Returns 0, or -1 on bad arguments (nothing started). */
int ft_moe_start(const void *gate, const void *up, const void *down,
                 int64_t gate_stride, int64_t up_stride, int64_t down_stride,
                 int gate_type, int up_type, int down_type,
                 const int32_t *experts, int n_experts, const int32_t *pair_offsets,
                 const int32_t *pair_tokens, const float *pair_weights,
                 const float *x, float *act, float *y, int tokens, int hidden, int inter, int bf16_rounding,
                 const uint16_t *xb, uint16_t *actb, const float *gate_bias, const float *up_bias,
                 const float *down_bias, int activation, float alpha, float limit) {
    if (!gate_bias != !up_bias) return -1;
    for (int i = 0; i < 3; i++) {
        int type = (int[]){gate_type, up_type, down_type}[i], k = i < 2 ? hidden : inter;
        if (type < FT_F32 || type > FT_FP8 || (type >= FT_Q8_0 && k % Q8_BLOCK)) return -1;
    }
    current.job = (moe_job){gate, up, down, gate_stride, up_stride, down_stride, gate_type, up_type, down_type,
                            experts, n_experts, pair_offsets, pair_tokens, pair_weights, x, act, y, tokens, hidden,
                            inter, bf16_rounding, NULL, NULL, NULL, NULL, NULL, NULL, ROW_BLOCK,
                            gate_bias, up_bias, down_bias, activation, alpha, limit};
    /* the bf16 dot path: bf16 or block-format weights (dequantized to bf16, as on the GPU), bf16 rounding on (so
       act is bf16-exact), and the caller's bf16 x */
    if (HAVE_BF16_DOT && xb && actb && bf16_rounding && gate_type != FT_F32 && up_type != FT_F32 &&
        down_type != FT_F32) {
        current.job.xb = xb;
        current.job.actb = actb;
    }
    current.xp = current.actp = NULL;
    current.q8x = current.q8act = NULL;
    current.phase0_tasks = 0;
    /* AMX takes bf16 activations against bf16 or block-format weights (dequantized to bf16 in a tile, as on the
       GPU) */
    current.xb_amx = xb && bf16_rounding && gate_type != FT_F32 && up_type != FT_F32 && down_type != FT_F32
                         ? xb : NULL;
#if HAVE_AMX_Q8
    if (use_amx_q8(&current.job, current.xb_amx)) {
        int32_t *bases = tile_bases(pair_offsets, n_experts);
        size_t tiles = bases ? (size_t)bases[n_experts] : 0;
        uint8_t *scratch = bases ? amx_q8_scratch(tiles * (Q8T_BYTES(hidden) + Q8T_BYTES(inter))) : NULL;
        if (scratch) {
            current.q8x = scratch;
            current.q8act = scratch + tiles * Q8T_BYTES(hidden);
            current.tile_base = bases;
            current.phase0_tasks = n_experts;
            current.job.gate_rows = Q8_BLOCK;  /* a phase-1 task owns one 32-block of act */
        }
    }
#endif
#if HAVE_AMX
    if (!current.q8x && use_amx(&current.job, current.xb_amx)) {
        int32_t *bases = tile_bases(pair_offsets, n_experts);
        if (bases) {
            size_t tiles = (size_t)bases[n_experts];
            uint16_t *scratch = amx_scratch(tiles * (hidden + inter) * AMX_TOKENS);
            if (scratch) {
                current.xp = scratch;
                current.actp = scratch + tiles * hidden * AMX_TOKENS;
                current.tile_base = bases;
                current.phase0_tasks = n_experts;
            }
        }
    }
#endif
    /* int16 copies where every expert takes one token, or (Q8_0, 16-lane builds) the most any takes is in
       q16_rows' range; quantizing for experts that take the fp32 path anyway cost batches of 2-4 up to a sixth of their rate (H200
       host, evals/results/cpu-expert-kernel-h200.md) */
    int most = most_tokens(&current.job), q8 = gate_type == FT_Q8_0 && up_type == FT_Q8_0 && down_type == FT_Q8_0;
    int rows = HAVE_Q16_ROWS && q8 && most >= q16_rows_min_tokens && most <= q16_rows_max_tokens &&
               most <= Q16_ROWS_MAX_TOKENS;
    if (!current.xp && !current.q8x && current.xb_amx && !q16_disabled && (most == 1 || rows))
        start_q16(&current.job, tokens, pair_offsets[n_experts]);
    if (current.job.xq) current.phase0_tasks = tokens;
    current.phase1_tasks = n_experts * ((inter + current.job.gate_rows - 1) / current.job.gate_rows);
    current.phase2_tasks = (hidden + ROW_BLOCK - 1) / ROW_BLOCK;
#if HAVE_AMX_Q8
    if (current.q8x) current.phase2_tasks = hidden / amx_q8_rows;
#endif
    atomic_store(&current.phase0_done, 0);
    atomic_store(&current.phase1_done, 0);
    atomic_store(&current.phase2_done, 0);
    atomic_store(&current.first_ns, 0);
    current.phase1_end_ns = 0;
    current.start_ns = now_ns();
    if (owned_rows && !current.xp && !current.q8x) {  /* vector paths: each worker the same rows of every expert */
        int blocks = (inter + current.job.gate_rows - 1) / current.job.gate_rows;
        int tasks[3] = {current.phase0_tasks, current.phase1_tasks, current.phase2_tasks};
        int period[3] = {current.phase0_tasks > 0 ? current.phase0_tasks : 1, blocks, current.phase2_tasks};
        parallel_start_owned(moe_task, &current, 3, tasks, period);
    } else {
        parallel_start(moe_task, &current, current.phase0_tasks + current.phase1_tasks + current.phase2_tasks);
    }
    return 0;
}

#include "switches.h"

/* Waits for the started job; returns the seconds it took from posting to its last task (the compute time,
   whatever the caller did meanwhile). */
double ft_moe_wait(void) {
    parallel_wait();
    long first = atomic_load(&current.first_ns);
    timing[0] += 1;
    timing[1] += (first - current.start_ns) / 1e9;
    timing[2] += ((current.phase1_end_ns ? current.phase1_end_ns : first) - current.start_ns) / 1e9;
    timing[3] += (current.end_ns - current.start_ns) / 1e9;
    return (current.end_ns - current.start_ns) / 1e9;
}

/* Sums over every job waited for so far: [jobs, seconds from posting to the first task's start (the workers'
   wake-up), to the last gate/up task's end, to the job's end]; callers take differences. */
void ft_moe_timing(double *out) {
    for (int i = 0; i < 4; i++) out[i] = timing[i];
}

#include "memory.h"
