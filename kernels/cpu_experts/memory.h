/* Part of experts.c (included once, where it stands): whole-buffer passes beside the expert kernel: the DRAM read
   probe, the activations' bf16 conversion, and seeded random fills for synthetic models. */

/* ---- DRAM read bandwidth probe: the ceiling the expert kernel is judged against ---- */

typedef struct { const uint8_t *buf; size_t chunk, n; _Atomic uint64_t sum; } read_job;
typedef uint64_t probe_vec __attribute__((vector_size(32)));  /* a YMM register (two 16-byte ones on NEON) */

static void read_task(void *ctx, int task) {
    read_job *j = ctx;
    size_t lo = task * j->chunk, hi = lo + j->chunk < j->n ? lo + j->chunk : j->n;
    /* two register-wide accumulators: without AVX-512 GCC moves a 64-byte vector through the stack, and the probe
       read 9 GB/s where the loads alone reach 23 (Zen 3, 2 threads) */
    probe_vec acc[2] = {{0}, {0}};
    for (size_t i = lo; i + 64 <= hi; i += 64)
        for (int h = 0; h < 2; h++) {
            probe_vec v;
            memcpy(&v, j->buf + i + h * sizeof v, sizeof v);
            acc[h] ^= v;
        }
    uint64_t s = 0;
    for (int i = 0; i < (int)(sizeof acc[0] / 8); i++) s ^= acc[0][i] ^ acc[1][i];
    atomic_fetch_xor(&j->sum, s);  /* keeps the loads alive */
}

/* Reads n bytes once with every pool thread; returns a checksum so the reads cannot be optimised away. */
uint64_t ft_read_bytes(const void *buf, size_t n) {
    read_job j = {.buf = buf, .n = n, .chunk = 1 << 20};
    parallel_for(read_task, &j, (int)((n + j.chunk - 1) / j.chunk));
    return atomic_load(&j.sum);
}

/* ---- Warming: experts' rows read into the caches ahead of the job that computes them ----
   Posted as a background job while the caller waits for something else (decode: the GPU's routing); the job that
   computes the rows cancels what is left of it. Chunks of WARM_CHUNK bytes a task, the cancel checked every 4 KiB. */

enum { WARM_MAX = 64, WARM_CHUNK = 64 << 10 };
typedef struct {
    const uint8_t *ptr[WARM_MAX];
    size_t bytes[WARM_MAX], first_task[WARM_MAX + 1];
    _Atomic uint64_t sum;
} warm_job;
static warm_job warming;

/* One load a line of n bytes at `at`, folded into acc; stops early once the job is cancelled (checked every 4 KiB). */
static probe_vec read_lines(const uint8_t *at, size_t n, probe_vec acc) {
    for (size_t page = 0; page < n; page += 4096) {
        if (atomic_load_explicit(&background_cancel, memory_order_relaxed)) break;
        size_t end = page + 4096 < n ? page + 4096 : n;
        for (size_t i = page; i + sizeof acc <= end; i += 64) {
            probe_vec v;
            memcpy(&v, at + i, sizeof v);
            acc ^= v;
        }
    }
    return acc;
}

static void warm_task(void *ctx, int task) {
    warm_job *j = ctx;
    int r = 0;
    while (j->first_task[r + 1] <= (size_t)task) r++;
    size_t lo = (task - j->first_task[r]) * (size_t)WARM_CHUNK;
    size_t hi = lo + WARM_CHUNK < j->bytes[r] ? lo + WARM_CHUNK : j->bytes[r];
    probe_vec acc = read_lines(j->ptr[r] + lo, hi - lo, (probe_vec){0});
    atomic_fetch_xor(&j->sum, acc[0]);  /* keeps the loads alive */
}

/* Starts reading n regions (ptrs[i], bytes[i]) into the workers' caches and returns at once; the next job posted
   cancels the rest. Returns the regions taken (at most WARM_MAX; none where the pool has no workers). */
int ft_warm(const void *const *ptrs, const int64_t *bytes, int n) {
    if (pool.nworkers == 0 || n <= 0) return 0;
    drain_background();  /* the previous warming: its regions are about to be replaced */
    if (n > WARM_MAX) n = WARM_MAX;
    warming.first_task[0] = 0;
    for (int i = 0; i < n; i++) {
        warming.ptr[i] = ptrs[i];
        warming.bytes[i] = bytes[i] > 0 ? (size_t)bytes[i] : 0;
        warming.first_task[i + 1] = warming.first_task[i] + (warming.bytes[i] + WARM_CHUNK - 1) / WARM_CHUNK;
    }
    if (warming.first_task[n] > 0) parallel_start_background(warm_task, &warming, (int)warming.first_task[n]);
    return n;
}

/* The same, owned: the rows a one-token job on `experts` will read, each by the worker that will compute it there
   (ft_set_owned_rows(1) must be on for that job): phase 1 reads gate and up rows by blocks of the job's phase-1
   rows, phase 2 the down rows by ROW_BLOCK, shared out as the job's tasks are (pool.h's owned tasks). */
typedef struct {
    const uint8_t *gate, *up, *down;
    size_t gate_stride, up_stride, down_stride, gate_row, up_row, down_row;
    int32_t experts[WARM_MAX];
    int n_experts, rows, blocks, hidden;
    _Atomic uint64_t sum;
} warm_rows_job;
static warm_rows_job warming_rows;

static void warm_rows_task(void *ctx, int task) {
    warm_rows_job *j = ctx;
    probe_vec acc = {0};
    if (task < j->n_experts * j->blocks) {  /* gate and up rows of one block of one expert */
        int e = j->experts[task / j->blocks], r0 = (task % j->blocks) * j->rows;
        acc = read_lines(j->gate + e * j->gate_stride + r0 * j->gate_row, (size_t)j->rows * j->gate_row, acc);
        acc = read_lines(j->up + e * j->up_stride + r0 * j->up_row, (size_t)j->rows * j->up_row, acc);
    } else {  /* ROW_BLOCK down rows of every expert */
        int h0 = (task - j->n_experts * j->blocks) * ROW_BLOCK;
        int rows = h0 + ROW_BLOCK < j->hidden ? ROW_BLOCK : j->hidden - h0;
        for (int i = 0; i < j->n_experts; i++)
            acc = read_lines(j->down + j->experts[i] * j->down_stride + h0 * j->down_row,
                             (size_t)rows * j->down_row, acc);
    }
    atomic_fetch_xor(&j->sum, acc[0]);  /* keeps the loads alive */
}

/* Starts the owned warming of `experts` (at most WARM_MAX) and returns at once; returns the experts taken (none
   where the pool has no workers or the shapes are bad). */
int ft_warm_rows(const void *gate, const void *up, const void *down, int64_t gate_stride, int64_t up_stride,
                 int64_t down_stride, int gate_type, int up_type, int down_type, const int32_t *experts,
                 int n_experts, int hidden, int inter) {
    if (pool.nworkers == 0 || n_experts <= 0 || hidden <= 0 || inter <= 0) return 0;
    drain_background();
    if (n_experts > WARM_MAX) n_experts = WARM_MAX;
    warm_rows_job *j = &warming_rows;
    j->gate = gate, j->up = up, j->down = down;
    j->gate_stride = gate_stride, j->up_stride = up_stride, j->down_stride = down_stride;
    j->gate_row = row_bytes(gate_type, hidden), j->up_row = row_bytes(up_type, hidden);
    j->down_row = row_bytes(down_type, inter);
    memcpy(j->experts, experts, n_experts * sizeof *experts);
    j->n_experts = n_experts, j->hidden = hidden;
    /* the job's phase-1 rows: whole 32-blocks of act where the int16 path quantizes it (start_q16) */
    j->rows = HAVE_Q16 && !q16_disabled && (down_type == FT_Q8_0 || down_type == FT_MXFP4) ? Q8_BLOCK : ROW_BLOCK;
    j->blocks = (inter + j->rows - 1) / j->rows;
    int tasks[2] = {n_experts * j->blocks, (hidden + ROW_BLOCK - 1) / ROW_BLOCK}, period[2] = {j->blocks, tasks[1]};
    parallel_start_owned_background(warm_rows_task, j, 2, tasks, period);
    return n_experts;
}

/* x's high halves into out (bf16 by truncation); returns 1 when every low half is zero, i.e. x held bf16 values
   exactly. On the calling thread, one pass: the same done with torch ops over more than 32k values wakes torch's
   OpenMP pool, whose threads then spin for milliseconds on the cores the kernel's workers need (a call with 17+
   tokens at hidden 2048 ran 3-10x slower on the H200 host). */
int ft_to_bf16_exact(const float *x, uint16_t *out, size_t n) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t low = 0;
    for (size_t i = 0; i < n; i++) {
        low |= bits[i] & 0xFFFFu;
        out[i] = (uint16_t)(bits[i] >> 16);
    }
    return low == 0;
}

/* ---- Seeded random fills for synthetic models (freetoken/bench/random_fill.py has the same in torch) ----
   Word i of a fill is splitmix64's finaliser of i * GOLDEN + seed: counter-based, so the bytes do not depend on
   the thread count or the chunking, and every pool thread fills at memory speed. */

#define FILL_GOLDEN 0x9E3779B97F4A7C15ull

INLINE uint64_t fill_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct { uint8_t *buf; size_t n, chunk; uint64_t seed; int dtype; float bound; } fill_job;

static void fill_task(void *ctx, int task) {
    fill_job *j = ctx;
    size_t lo = task * j->chunk, hi = lo + j->chunk < j->n ? lo + j->chunk : j->n;
    if (j->dtype < 0) {  /* bytes: 8 a word */
        for (size_t w = lo / 8; w * 8 < hi; w++) {
            uint64_t v = fill_mix(w * FILL_GOLDEN + j->seed);
            size_t at = w * 8, take = hi - at < 8 ? hi - at : 8;
            memcpy(j->buf + at, &v, take);
        }
        return;
    }
    float scale = 2.0f * j->bound / (float)(1 << 24);
    for (size_t i = lo; i < hi; i++) {  /* values: 24 random bits each, uniform in [-bound, bound) */
        float f = (float)((fill_mix(i * FILL_GOLDEN + j->seed) >> 40) & 0xFFFFFF) * scale - j->bound;
        if (j->dtype == FT_F32) {
            ((float *)j->buf)[i] = f;
        } else {  /* bf16, rounded to nearest even (as torch converts) */
            uint32_t bits;
            memcpy(&bits, &f, 4);
            ((uint16_t *)j->buf)[i] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
        }
    }
}

/* Fills n bytes (dtype -1) or n values (FT_F32 / FT_BF16, uniform in [-bound, bound)) of buf from seed. Chunks
   are whole words of bytes (a multiple of 8) so that each word is written by one task. */
void ft_random_fill(void *buf, size_t n, uint64_t seed, int dtype, float bound) {
    fill_job j = {.buf = buf, .n = n, .chunk = 1 << 20, .seed = seed, .dtype = dtype, .bound = bound};
    parallel_for(fill_task, &j, (int)((n + j.chunk - 1) / j.chunk));
}
