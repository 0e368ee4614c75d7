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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
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

enum { FT_F32 = 0, FT_BF16 = 1, FT_Q8_0 = 2 };
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

INLINE vf load_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

INLINE vf load_bf16(const uint16_t *p) {  /* bf16 is the top half of an f32 */
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    vu16 h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu32) << 16);
#endif
}

/* GCC scalarises a generic int8 → float vector conversion, so x86 gets the widening instructions by name. */
INLINE vf load_q8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
    vf v;
    memcpy(&v, halves, sizeof v);
    return v;
#else
    vi8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
#endif
}

INLINE float bf16_scalar(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* Rounds to the nearest bf16 (ties to even), for callers whose GPU path rounds there too. */
INLINE float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

INLINE float f16_scalar(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  /* subnormal: renormalise */
        int shift = 0;
        while (!(man & 0x400)) { man <<= 1; shift++; }
        u = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE float hsum(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

/* out[r * TILE + t] = rows[r] . xs[t] for r < nr, t < nt. nr and nt are compile-time constants at every call
   site (always_inline), so the nr * nt accumulators live in registers; two rows give the FMA units independent
   chains even at batch 1 and share each activation load. k is the row length in weights. */
INLINE void rows_dots(int type, const void *const *rows, int nr, const float *const *xs, int k, int nt,
                      float *out) {
    vf acc[2][TILE], acc_hi[2][TILE];  /* Q8_0: a block's two halves accumulate apart (independent FMAs) */
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = acc_hi[r][t] = (vf){0};
    int kv = 0;
    if (type == FT_Q8_0 && nt == 1) {
        /* one token: the block's two halves dotted first, then scaled into the sum (3 vector ops per block and
           row instead of 4: the scale multiplies one partial sum, not both weight halves) */
        for (size_t b = 0; kv < k; kv += Q8_BLOCK, b += Q8_BYTES) {
            vf x0 = load_f32(xs[0] + kv), x1 = load_f32(xs[0] + kv + LANES);
            for (int r = 0; r < nr; r++) {
                const uint8_t *blk = (const uint8_t *)rows[r] + b;
                vf s = load_q8((const int8_t *)blk + 2) * x0;
                s += load_q8((const int8_t *)blk + 2 + LANES) * x1;
                if (b / Q8_BYTES & 1) acc_hi[r][0] += s * f16_scalar(blk);
                else acc[r][0] += s * f16_scalar(blk);
            }
        }
        for (int r = 0; r < nr; r++) acc[r][0] += acc_hi[r][0];
    } else if (type == FT_Q8_0) {
        for (size_t b = 0; kv < k; kv += Q8_BLOCK, b += Q8_BYTES) {
            vf x0[TILE], x1[TILE];
            for (int t = 0; t < nt; t++) x0[t] = load_f32(xs[t] + kv), x1[t] = load_f32(xs[t] + kv + LANES);
            for (int r = 0; r < nr; r++) {
                const uint8_t *blk = (const uint8_t *)rows[r] + b;
                vf d = (vf){0} + f16_scalar(blk);
                vf w0 = load_q8((const int8_t *)blk + 2) * d, w1 = load_q8((const int8_t *)blk + 2 + LANES) * d;
                for (int t = 0; t < nt; t++) acc[r][t] += w0 * x0[t], acc_hi[r][t] += w1 * x1[t];
            }
        }
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < nt; t++) acc[r][t] += acc_hi[r][t];
    } else {
        for (; kv + LANES <= k; kv += LANES) {
            vf x[TILE];
            for (int t = 0; t < nt; t++) x[t] = load_f32(xs[t] + kv);
            for (int r = 0; r < nr; r++) {
                vf w = type == FT_BF16 ? load_bf16((const uint16_t *)rows[r] + kv)
                                       : load_f32((const float *)rows[r] + kv);
                for (int t = 0; t < nt; t++) acc[r][t] += w * x[t];
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float s = hsum(acc[r][t]);
            for (int j = kv; j < k; j++)  /* tail of rows whose length is not a multiple of LANES */
                s += (type == FT_BF16 ? bf16_scalar(((const uint16_t *)rows[r])[j]) : ((const float *)rows[r])[j])
                     * xs[t][j];
            out[r * TILE + t] = s;
        }
}

/* rows_dots over any number of tokens, in tiles of TILE; each row is read from DRAM once, later tiles find it
   in L1. nr is 1 or 2; both rows have the same format. */
static void rows_dots_n(int type, const void *const *rows, int nr, const float *const *xs, int k, int n,
                        float *out) {
    for (int t0 = 0; t0 < n; t0 += TILE) {
        int nt = n - t0 < TILE ? n - t0 : TILE;
        float tile[2 * TILE];
#define CASES(NR)                                                                              \
    switch (nt) {                                                                             \
        case 1: rows_dots(type, rows, NR, xs + t0, k, 1, tile); break;                        \
        case 2: rows_dots(type, rows, NR, xs + t0, k, 2, tile); break;                        \
        case 3: rows_dots(type, rows, NR, xs + t0, k, 3, tile); break;                        \
        default: rows_dots(type, rows, NR, xs + t0, k, 4, tile); break;                       \
    }
#define FORMATS(NR)                       \
    if (type == FT_Q8_0) { CASES(NR) }    \
    else if (type == FT_BF16) { CASES(NR) } \
    else { CASES(NR) }
        if (nr == 2) { FORMATS(2) } else { FORMATS(1) }
#undef FORMATS
#undef CASES
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < nt; t++) out[r * n + t0 + t] = tile[r * TILE + t];
    }
}

#if defined(__AVX512BF16__)
/* bf16 weights times bf16 activations with vdpbf16ps: 32 products per instruction, exact in fp32, no widening.
   Used when the model runs in bf16, where the activations are bf16 values anyway. */
INLINE void rows_dots_bf16(const void *const *rows, int nr, const uint16_t *const *xs, int k, int nt, float *out) {
    __m512 acc[2][TILE];
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = _mm512_setzero_ps();
    int kv = 0;
    for (; kv + 32 <= k; kv += 32) {
        __m512bh x[TILE];
        for (int t = 0; t < nt; t++) x[t] = (__m512bh)_mm512_loadu_si512(xs[t] + kv);
        for (int r = 0; r < nr; r++) {
            __m512bh w = (__m512bh)_mm512_loadu_si512((const uint16_t *)rows[r] + kv);
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w, x[t]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float s = _mm512_reduce_add_ps(acc[r][t]);
            for (int j = kv; j < k; j++) s += bf16_scalar(((const uint16_t *)rows[r])[j]) * bf16_scalar(xs[t][j]);
            out[r * TILE + t] = s;
        }
}

static void rows_dots_bf16_n(const void *const *rows, int nr, const uint16_t *const *xs, int k, int n, float *out) {
    for (int t0 = 0; t0 < n; t0 += TILE) {
        int nt = n - t0 < TILE ? n - t0 : TILE;
        float tile[2 * TILE];
#define CASES(NR)                                                               \
    switch (nt) {                                                              \
        case 1: rows_dots_bf16(rows, NR, xs + t0, k, 1, tile); break;          \
        case 2: rows_dots_bf16(rows, NR, xs + t0, k, 2, tile); break;          \
        case 3: rows_dots_bf16(rows, NR, xs + t0, k, 3, tile); break;          \
        default: rows_dots_bf16(rows, NR, xs + t0, k, 4, tile); break;         \
    }
        if (nr == 2) { CASES(2) } else { CASES(1) }
#undef CASES
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < nt; t++) out[r * n + t0 + t] = tile[r * TILE + t];
    }
}
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
static void rows_dots_bf16_n(const void *const *rows, int nr, const uint16_t *const *xs, int k, int n, float *out) {
    (void)rows, (void)nr, (void)xs, (void)k, (void)n, (void)out;  /* never called: xb is NULL without it */
}
#endif

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

static size_t row_bytes(int type, int k) {
    return type == FT_Q8_0 ? (size_t)(k / Q8_BLOCK) * Q8_BYTES : (size_t)k * (type == FT_BF16 ? 2 : 4);
}

/* ---- persistent thread pool: workers spin briefly, then sleep on a condition variable ---- */

typedef void (*task_fn)(void *ctx, int task);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_t threads[MAX_THREADS];
    int nworkers;
    atomic_uint generation;
    atomic_int next, busy;
    task_fn fn;
    void *ctx;
    int ntasks;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static void run_tasks(void) {
    for (int i; (i = atomic_fetch_add(&pool.next, 1)) < pool.ntasks;) pool.fn(pool.ctx, i);
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *worker(void *arg) {
    /* The generation current when the pool was started, not when this thread first runs: a job posted in
       between must not be mistaken for one already done. */
    unsigned seen = (unsigned)(uintptr_t)arg;
    for (;;) {
        long until = now_ns() + SPIN_NS;
        for (int spin = 0; atomic_load(&pool.generation) == seen; spin++) {
            CPU_RELAX();
            if ((spin & 63) == 63 && now_ns() > until) break;
        }
        if (atomic_load(&pool.generation) == seen) {
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.generation);
        run_tasks();
        atomic_fetch_sub(&pool.busy, 1);
    }
    return NULL;
}

/* Starts the pool once; the calling thread works too, so `threads` counts it. Returns the size in use. */
int ft_pool_start(int threads) {
    pthread_mutex_lock(&pool.mu);
    if (pool.nworkers == 0 && threads > 1) {
        if (threads > MAX_THREADS) threads = MAX_THREADS;
        for (int i = 0; i < threads - 1; i++) {
            void *generation = (void *)(uintptr_t)atomic_load(&pool.generation);
            if (pthread_create(&pool.threads[i], NULL, worker, generation) != 0) break;
            pthread_detach(pool.threads[i]);
            pool.nworkers++;
        }
    }
    pthread_mutex_unlock(&pool.mu);
    return pool.nworkers + 1;
}

/* Posts fn(ctx, 0..ntasks-1) to the workers and returns at once; `parallel_wait` joins in and returns when all
   are done. Not reentrant: one job at a time, posted and waited for by one caller. */
static void parallel_start(task_fn fn, void *ctx, int ntasks) {
    pool.fn = fn;
    pool.ctx = ctx;
    pool.ntasks = ntasks;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.busy, pool.nworkers);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
}

static void parallel_wait(void) {
    run_tasks();
    while (atomic_load(&pool.busy) > 0) CPU_RELAX();
}

static void parallel_for(task_fn fn, void *ctx, int ntasks) {
    parallel_start(fn, ctx, ntasks);
    parallel_wait();
}

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
    const int16_t *xq;                    /* [T, H] x as int16 with scales xqs [T, H/32], or NULL (Q8_0 gate/up) */
    const float *xqs;
    int16_t *actq;                        /* [P, I] act as int16 with scales actqs (written in phase 1), or NULL */
    float *actqs;
    int gate_rows;                        /* rows of gate/up per phase-1 task (whole blocks of act with actq) */
    /* the expert function where it is not plain SwiGLU: fp32 biases by expert id (gate/up [E, I], down [E, H],
       or NULL) and gpt-oss's clamped SwiGLU, (clamp(u, ±limit) + 1) * g * sigmoid(alpha * g), g = min(g, limit) */
    const float *gate_bias, *up_bias, *down_bias;
    int clamped;
    float alpha, limit;
} moe_job;

/* act of one (row, pair) from its gate and up dots: silu(g) * u, or the job's form (biases, clamped SwiGLU).
   With bf16 rounding it rounds where a bf16 GPU expert rounds: the dots, (then the biased values,) the result. */
INLINE float expert_act(const moe_job *j, int expert, int row, float g, float u) {
    if (!j->gate_bias && !j->clamped) {
        if (!j->bf16_rounding) return g / (1.0f + expf(-g)) * u;
        g = round_bf16(g);
        return round_bf16(round_bf16(g / (1.0f + expf(-g))) * round_bf16(u));
    }
    if (j->bf16_rounding) g = round_bf16(g), u = round_bf16(u);
    if (j->gate_bias) {
        g += j->gate_bias[(size_t)expert * j->inter + row];
        u += j->up_bias[(size_t)expert * j->inter + row];
        if (j->bf16_rounding) g = round_bf16(g), u = round_bf16(u);
    }
    float a;
    if (j->clamped) {
        g = fminf(g, j->limit);
        u = fmaxf(fminf(u, j->limit), -j->limit);
        a = (u + 1.0f) * (g / (1.0f + expf(-j->alpha * g)));
    } else {
        a = g / (1.0f + expf(-g)) * u;
    }
    return j->bf16_rounding ? round_bf16(a) : a;
}

/* One pair's contribution to output row h: its down dot (plus the expert's bias) times its routing weight. */
INLINE float expert_out(const moe_job *j, int expert, int h, float v, float w) {
    if (j->down_bias) {
        v = j->bf16_rounding ? round_bf16(v) : v;
        v += j->down_bias[(size_t)expert * j->hidden + h];
    }
    return j->bf16_rounding ? round_bf16(round_bf16(v) * round_bf16(w)) : v * w;
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
        for (int r = r0; r < r1; r++) {
            const void *rows[2] = {gate + r * gb, up + r * ub};
            if (j->xq && nt == 1) {  /* several tokens share the fp32 path's widened weights: faster there */
#if HAVE_Q16
                for (int t = 0; t < nt; t++) {
                    size_t token = (size_t)j->pair_tokens[p0 + t0 + t];
                    const int16_t *xq = j->xq + token * j->hidden;
                    const float *xqs = j->xqs + token * (j->hidden / Q8_BLOCK);
                    gu[t] = q16_dot(rows[0], xq, xqs, j->hidden);
                    gu[nt + t] = q16_dot(rows[1], xq, xqs, j->hidden);
                }
#endif
            } else if (j->xb) {
                rows_dots_bf16_n(rows, 2, xbs, j->hidden, nt, gu);
            } else if (j->gate_type == j->up_type) {  /* the gate and up rows of one unit share activation loads */
                rows_dots_n(j->gate_type, rows, 2, xs, j->hidden, nt, gu);
            } else {
                rows_dots_n(j->gate_type, rows, 1, xs, j->hidden, nt, gu);
                rows_dots_n(j->up_type, rows + 1, 1, xs, j->hidden, nt, gu + nt);
            }
            for (int t = 0; t < nt; t++) {
                float a = expert_act(j, expert, r, gu[t], gu[nt + t]);
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
            int q16 = j->actq && nt == 1, step = q16 ? 1 : 2;  /* two rows interleave on the other paths */
            for (int h = h0; h < h1; h += step) {
                const void *rows[2] = {down + h * db, down + (h + 1) * db};
                int nr = h + 1 < h1 && step == 2 ? 2 : 1;
                if (q16) {
#if HAVE_Q16
                    for (int t = 0; t < nt; t++)
                        d[t] = q16_dot(rows[0], j->actq + (size_t)(p0 + t) * j->inter,
                                       j->actqs + (size_t)(p0 + t) * (j->inter / Q8_BLOCK), j->inter);
#endif
                } else if (j->actb)
                    rows_dots_bf16_n(rows, nr, abs_, j->inter, nt, d);
                else
                    rows_dots_n(j->down_type, rows, nr, as, j->inter, nt, d);
                for (int r = 0; r < nr; r++)
                    for (int t = 0; t < nt; t++) {
                        float v = expert_out(j, j->experts[e], h + r, d[r * nt + t], j->pair_weights[p0 + t]);
                        j->y[(size_t)j->pair_tokens[p0 + t] * j->hidden + h + r] += v;
                    }
            }
        }
    }
}

/* ---- AMX (Sapphire Rapids and later): 16 rows x 32 weights x 16 tokens per tile instruction ----
   With tiles the arithmetic is nearly free, so the kernel stays bound by DRAM reads at any decode batch and
   stays far ahead of the vector path for the 20-100 tokens per expert of a short prefill chunk. An expert's
   tokens are packed in tiles of 16 into the VNNI layout a B tile wants ([K/2][16 tokens][2], unused token columns
   zero), the tiles of all experts back to back (`tile_base[e]` is expert e's first): phase 0 packs x, phase 1
   writes act packed. Each 16-row weight block is read from DRAM once; further token tiles find it in L2 (Q8_0
   blocks are then dequantized once per block into a bf16 copy). Used for bf16 activations of bf16 models. */
#if HAVE_AMX
enum { AMX_TOKENS = 16, AMX_Q8_MIN_TOKENS = 6 };
static int amx_min_tokens = 2, amx_disabled;  /* tuning: fewest tokens worth tiles; a switch to measure without */
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_permitted(void) {  /* the kernel must enable the tile state for this process, once */
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* Tiles 0-1 accumulators, 2-3 weights, 4 activations. Loaded at every use and released after it: other code on
   the same thread (oneDNN inside torch uses AMX too) releases the tiles when it is done, which would leave a
   configuration cached per thread dangling (the next tile instruction would fault). */
static void amx_configure(void) {
    tile_config cfg = {.palette = 1};
    for (int t = 0; t < 5; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

static uint16_t *amx_scratch(size_t elements) {  /* one job at a time: a growing buffer serves every job */
    static uint16_t *buf;
    static size_t capacity;
    if (elements > capacity) {
        free(buf);
        capacity = elements + elements / 2;
        buf = aligned_alloc(64, (capacity * 2 + 63) / 64 * 64);
        if (!buf) capacity = 0;
    }
    return buf;
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

/* Q8_0 rows r..r+15, block kc, as bf16 at `tile` (16 rows, `pitch` elements apart): q * d rounded to bf16,
   exactly the weights a bf16 GPU expert computes with after dequantization. One Q8_0 block is one tile row. */
static void amx_q8_tile(const uint8_t *w, size_t stride, int kc, uint16_t *tile, size_t pitch) {
    for (int r = 0; r < 16; r++) {
        const uint8_t *blk = w + r * stride + (size_t)kc * Q8_BYTES;
        __m512 d = _mm512_set1_ps(f16_scalar(blk));
        __m512bh b = _mm512_cvtne2ps_pbh((__m512)(load_q8((const int8_t *)blk + 2 + LANES) * (vf)d),
                                         (__m512)(load_q8((const int8_t *)blk + 2) * (vf)d));
        _mm512_storeu_si512(tile + r * pitch, (__m512i)b);
    }
}

/* A 16-row block of Q8_0 weights over k columns as bf16 rows (a per-thread buffer, `which` of two), for blocks
   used by several token tiles: each Q8_0 block is then dequantized once, not once per tile. Returns the rows;
   their stride is k * 2 bytes. */
static const uint8_t *amx_dequant_rows(const uint8_t *w, size_t stride, int k, int which) {
    static __thread uint16_t *buf[2];
    static __thread size_t capacity[2];
    size_t need = (size_t)16 * k;
    if (need > capacity[which]) {
        free(buf[which]);
        buf[which] = aligned_alloc(64, (need * 2 + 63) / 64 * 64);
        capacity[which] = buf[which] ? need : 0;
        if (!buf[which]) return NULL;
    }
    for (int kc = 0; kc < k / 32; kc++) amx_q8_tile(w, stride, kc, buf[which] + (size_t)kc * 32, k);
    return (const uint8_t *)buf[which];
}

/* Loads weight tile `t` for rows at w (stride bytes per row), k-chunk kc of 32, from bf16 or Q8_0 rows. */
static inline void amx_load_weights(int t, int type, const uint8_t *w, size_t stride, int kc, uint16_t *scratch) {
    if (type == FT_Q8_0) {
        amx_q8_tile(w, stride, kc, scratch, 32);
        if (t == 2) _tile_loadd(2, scratch, 64); else _tile_loadd(3, scratch, 64);
    } else if (t == 2) {
        _tile_loadd(2, w + (size_t)kc * 64, stride);
    } else {
        _tile_loadd(3, w + (size_t)kc * 64, stride);
    }
}

/* out[r][t] (16 x 16) = rows r0..r0+15 of w (stride bytes per row) . packed activations over k weights. */
static void amx_rows_x_tokens(int type, const uint8_t *w, size_t stride, const uint16_t *packed, int k, float *out) {
    uint16_t scratch[16 * 32] __attribute__((aligned(64)));
    amx_configure();
    _tile_zero(0);
    for (int kc = 0; kc < k / 32; kc++) {
        amx_load_weights(2, type, w, stride, kc, scratch);
        _tile_loadd(4, packed + (size_t)kc * 16 * AMX_TOKENS * 2, 64);
        _tile_dpbf16ps(0, 2, 4);
    }
    _tile_stored(0, out, 64);
    _tile_release();
}

static void amx_rows_x_tokens2(int t0, const uint8_t *w0, size_t s0, int t1, const uint8_t *w1, size_t s1,
                               const uint16_t *packed, int k, float *out0, float *out1) {
    uint16_t scratch0[16 * 32] __attribute__((aligned(64))), scratch1[16 * 32] __attribute__((aligned(64)));
    amx_configure();
    _tile_zero(0);
    _tile_zero(1);
    for (int kc = 0; kc < k / 32; kc++) {
        _tile_loadd(4, packed + (size_t)kc * 16 * AMX_TOKENS * 2, 64);
        amx_load_weights(2, t0, w0, s0, kc, scratch0);
        amx_load_weights(3, t1, w1, s1, kc, scratch1);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, out0, 64);
    _tile_stored(1, out1, 64);
    _tile_release();
}

/* A 16-row weight block for `tiles` token tiles: Q8_0 rows dequantized once when several tiles share them.
   Sets *type/*stride to how the returned rows are read. */
static const uint8_t *amx_block_rows(const uint8_t *w, int *type, size_t *stride, int k, int tiles, int which) {
    if (*type != FT_Q8_0 || tiles < 2) return w;
    const uint8_t *rows = amx_dequant_rows(w, *stride, k, which);
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
    const uint8_t *gate = amx_block_rows(j->gate + expert * j->gate_stride + r0 * gb, &gt, &gb, j->hidden, tiles, 0);
    const uint8_t *up = amx_block_rows(j->up + expert * j->up_stride + r0 * ub, &ut, &ub, j->hidden, tiles, 1);
    float g[16][16], u[16][16];
    for (int tile = 0; tile < tiles; tile++) {
        size_t base = (size_t)(tile_base[e] + tile);
        amx_rows_x_tokens2(gt, gate, gb, ut, up, ub, xp + base * j->hidden * AMX_TOKENS, j->hidden,
                           &g[0][0], &u[0][0]);
        uint16_t *dst = actp + base * j->inter * AMX_TOKENS;
        for (int r = 0; r < ROW_BLOCK; r++)
            for (int c = 0; c < AMX_TOKENS; c++) {
                int row = r0 + r, t = tile * AMX_TOKENS + c;
                float a = 0.0f;
                if (t < n) {
                    a = expert_act(j, expert, row, g[r][c], u[r][c]);  /* bf16 rounding is on with tiles */
                    j->act[(size_t)(p0 + t) * j->inter + row] = a;
                }
                uint32_t bits;
                memcpy(&bits, &a, 4);
                dst[(size_t)(row / 2) * AMX_TOKENS * 2 + c * 2 + (row & 1)] = (uint16_t)(bits >> 16);
            }
    }
}

static void amx_down(const moe_job *j, const uint16_t *actp, const int32_t *tile_base, int task) {
    int h0 = task * ROW_BLOCK;
    float d[16][16];
    for (int h = h0; h < h0 + ROW_BLOCK; h++)
        for (int t = 0; t < j->tokens; t++) j->y[(size_t)t * j->hidden + h] = 0.0f;
    for (int e = 0; e < j->n_experts; e++) {
        int p0 = j->pair_offsets[e], n = j->pair_offsets[e + 1] - p0, tiles = tile_base[e + 1] - tile_base[e];
        int dt = j->down_type;
        size_t db = row_bytes(dt, j->inter);
        const uint8_t *down = amx_block_rows(j->down + j->experts[e] * j->down_stride + h0 * db, &dt, &db,
                                             j->inter, tiles, 0);
        for (int tile = 0; tile < tiles; tile++) {
            amx_rows_x_tokens(dt, down, db, actp + (size_t)(tile_base[e] + tile) * j->inter * AMX_TOKENS,
                              j->inter, &d[0][0]);
            for (int r = 0; r < ROW_BLOCK; r++)
                for (int c = 0; c < AMX_TOKENS && tile * AMX_TOKENS + c < n; c++) {
                    int p = p0 + tile * AMX_TOKENS + c;
                    float v = expert_out(j, j->experts[e], h0 + r, d[r][c], j->pair_weights[p]);
                    j->y[(size_t)j->pair_tokens[p] * j->hidden + h0 + r] += v;
                }
        }
    }
}
#endif

/* Both phases as one job: phase-1 tasks are numbered first, and a worker that draws a phase-2 task waits until
   every phase-1 task has finished (all were drawn before it, so this cannot deadlock). One wake-up per layer. */
typedef struct {
    moe_job job;
    int phase0_tasks, phase1_tasks, phase2_tasks;  /* phase 0 (packing) only on the AMX path */
    atomic_int phase0_done, phase1_done, phase2_done;
    long start_ns, end_ns;  /* when the job was posted and when its last task finished */
    uint16_t *xp, *actp;    /* AMX: packed activations per expert, or NULL */
    int32_t *tile_base;     /* AMX: [n_experts + 1] first token tile of each expert in xp/actp */
    const uint16_t *xb_amx; /* bf16 x the AMX path packs (bf16 or Q8_0 weights), or NULL */
} moe_run;

static moe_run current;  /* the job in flight between ft_moe_start and ft_moe_wait */

static void moe_task(void *ctx, int task) {
    moe_run *run = ctx;
    if (task < run->phase0_tasks) {
#if HAVE_AMX
        if (run->xp) amx_pack_x(&run->job, run->xb_amx, run->xp, run->tile_base, task);
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
        phase_gate_up(&run->job, task);
        atomic_fetch_add(&run->phase1_done, 1);
        return;
    }
    while (atomic_load(&run->phase1_done) < run->phase1_tasks) CPU_RELAX();
#if HAVE_AMX
    if (run->xp) amx_down(&run->job, run->actp, run->tile_base, task - run->phase1_tasks); else
#endif
    phase_down(&run->job, task - run->phase1_tasks);
    if (atomic_fetch_add(&run->phase2_done, 1) + 1 == run->phase2_tasks) run->end_ns = now_ns();
}

/* Whether this job can run on AMX tiles: bf16 path on, shapes in whole tiles, and at least AMX_MIN tokens on
   some expert (below that the AVX-512 path is as fast and needs no packing). */
static int use_amx(const moe_job *j, const uint16_t *xb_amx) {
#if HAVE_AMX
    if (!xb_amx || j->hidden % 32 || j->inter % 32 || amx_disabled) return 0;
    int most = 0;
    for (int e = 0; e < j->n_experts; e++) {
        int n = j->pair_offsets[e + 1] - j->pair_offsets[e];
        most = n > most ? n : most;
    }
    /* Q8_0 rows are dequantized into a scratch tile first, which costs what the vector path costs at a few
       tokens: tiles pay for them only from about 6 tokens on (measured on a Sapphire Rapids-class core). */
    int q8 = j->gate_type == FT_Q8_0 || j->up_type == FT_Q8_0 || j->down_type == FT_Q8_0;
    int least = q8 && amx_min_tokens < AMX_Q8_MIN_TOKENS ? AMX_Q8_MIN_TOKENS : amx_min_tokens;
    return most >= least && amx_permitted();
#else
    (void)j, (void)xb_amx;
    return 0;
#endif
}

static int q16_disabled;  /* ft_set_q16(0): the fp32 path instead, to compare against */

/* The int16-activation path for Q8_0 projections of a bf16 model not on tiles: x and act get int16 copies in a
   scratch buffer (one job at a time), and phase-1 tasks own whole 32-row blocks of act. */
static void start_q16(moe_job *j, int tokens, int pairs) {
#if HAVE_Q16
    int q8_gate_up = j->gate_type == FT_Q8_0 && j->up_type == FT_Q8_0, q8_down = j->down_type == FT_Q8_0;
    if (!q8_gate_up && !q8_down) return;
    static uint8_t *buf;
    static size_t capacity;
    size_t xq = (size_t)tokens * j->hidden * 2, xs = (size_t)tokens * (j->hidden / Q8_BLOCK) * 4;
    size_t aq = (size_t)pairs * j->inter * 2, as = (size_t)pairs * (j->inter / Q8_BLOCK) * 4;
    size_t need = xq + xs + aq + as + 256;
    if (need > capacity) {
        free(buf);
        capacity = need + need / 2;
        buf = aligned_alloc(64, (capacity + 63) / 64 * 64);
        if (!buf) { capacity = 0; return; }
    }
    uint8_t *at = buf;
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
                 const float *down_bias, int clamped, float alpha, float limit) {
    if (!gate_bias != !up_bias) return -1;
    for (int i = 0; i < 3; i++) {
        int type = (int[]){gate_type, up_type, down_type}[i], k = i < 2 ? hidden : inter;
        if (type < FT_F32 || type > FT_Q8_0 || (type == FT_Q8_0 && k % Q8_BLOCK)) return -1;
    }
    current.job = (moe_job){gate, up, down, gate_stride, up_stride, down_stride, gate_type, up_type, down_type,
                            experts, n_experts, pair_offsets, pair_tokens, pair_weights, x, act, y, tokens, hidden,
                            inter, bf16_rounding, NULL, NULL, NULL, NULL, NULL, NULL, ROW_BLOCK,
                            gate_bias, up_bias, down_bias, clamped, alpha, limit};
    /* the bf16 dot path: bf16 weights, bf16 rounding on (so act is bf16-exact), and the caller's bf16 x */
    if (HAVE_BF16_DOT && xb && actb && bf16_rounding && gate_type == FT_BF16 && up_type == FT_BF16 &&
        down_type == FT_BF16) {
        current.job.xb = xb;
        current.job.actb = actb;
    }
    current.xp = current.actp = NULL;
    current.phase0_tasks = 0;
    /* AMX takes bf16 activations against bf16 or Q8_0 weights (dequantized to bf16 in a tile, as on the GPU) */
    current.xb_amx = xb && bf16_rounding && gate_type != FT_F32 && up_type != FT_F32 && down_type != FT_F32
                         ? xb : NULL;
#if HAVE_AMX
    if (use_amx(&current.job, current.xb_amx)) {
        static int32_t *tile_base;
        static int tile_base_capacity;
        if (n_experts + 1 > tile_base_capacity) {
            free(tile_base);
            tile_base = malloc(sizeof(int32_t) * (n_experts + 1));
            tile_base_capacity = tile_base ? n_experts + 1 : 0;
        }
        if (tile_base) {
            tile_base[0] = 0;
            for (int e = 0; e < n_experts; e++)
                tile_base[e + 1] = tile_base[e] + (pair_offsets[e + 1] - pair_offsets[e] + AMX_TOKENS - 1) / AMX_TOKENS;
            size_t tiles = (size_t)tile_base[n_experts];
            uint16_t *scratch = amx_scratch(tiles * (hidden + inter) * AMX_TOKENS);
            if (scratch) {
                current.xp = scratch;
                current.actp = scratch + tiles * hidden * AMX_TOKENS;
                current.tile_base = tile_base;
                current.phase0_tasks = n_experts;
            }
        }
    }
#endif
    if (!current.xp && current.xb_amx && !q16_disabled) start_q16(&current.job, tokens, pair_offsets[n_experts]);
    if (current.job.xq) current.phase0_tasks = tokens;
    current.phase1_tasks = n_experts * ((inter + current.job.gate_rows - 1) / current.job.gate_rows);
    current.phase2_tasks = (hidden + ROW_BLOCK - 1) / ROW_BLOCK;
    atomic_store(&current.phase0_done, 0);
    atomic_store(&current.phase1_done, 0);
    atomic_store(&current.phase2_done, 0);
    current.start_ns = now_ns();
    parallel_start(moe_task, &current, current.phase0_tasks + current.phase1_tasks + current.phase2_tasks);
    return 0;
}

/* AMX tuning: the fewest tokens per expert worth tiles, and a switch for measuring without them. */
/* The int16-activation Q8_0 path on (default) or off, for tests and measurements against the fp32 path. */
void ft_set_q16(int on) { q16_disabled = !on; }

void ft_set_amx(int min_tokens, int disabled) {
#if HAVE_AMX
    amx_min_tokens = min_tokens;
    amx_disabled = disabled;
#else
    (void)min_tokens, (void)disabled;
#endif
}

/* Whether AMX tiles are compiled in and the OS lets this process use them. */
int ft_has_amx(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* Whether this build has the bf16 dot path (AVX-512-BF16). */
int ft_has_bf16_dot(void) { return HAVE_BF16_DOT; }

/* Waits for the started job; returns the seconds it took from posting to its last task (the compute time,
   whatever the caller did meanwhile). */
double ft_moe_wait(void) {
    parallel_wait();
    return (current.end_ns - current.start_ns) / 1e9;
}

/* ---- DRAM read bandwidth probe: the ceiling the expert kernel is judged against ---- */

typedef struct { const uint8_t *buf; size_t chunk, n; _Atomic uint64_t sum; } read_job;

static void read_task(void *ctx, int task) {
    read_job *j = ctx;
    size_t lo = task * j->chunk, hi = lo + j->chunk < j->n ? lo + j->chunk : j->n;
    vu64 acc = {0};
    for (size_t i = lo; i + 64 <= hi; i += 64) { vu64 v; memcpy(&v, j->buf + i, 64); acc ^= v; }
    uint64_t s = 0;
    for (int i = 0; i < 8; i++) s ^= acc[i];
    atomic_fetch_xor(&j->sum, s);  /* keeps the loads alive */
}

/* Reads n bytes once with every pool thread; returns a checksum so the reads cannot be optimised away. */
uint64_t ft_read_bytes(const void *buf, size_t n) {
    read_job j = {.buf = buf, .n = n, .chunk = 1 << 20};
    parallel_for(read_task, &j, (int)((n + j.chunk - 1) / j.chunk));
    return atomic_load(&j.sum);
}
