/* Part of experts.c (included once, where it stands): the persistent worker pool. */

/* ---- persistent thread pool: workers spin briefly, then sleep ----
   Waking sleeping workers costs the waker a system call that wakes each of them in turn (tens of µs on a
   16-core host), on the decode step's critical path when it happens as a job is posted. Two remedies:
   - `ft_pool_wake` moves it earlier: the caller wakes them while it waits anyway (for the GPU's routing), and
     they spin for the job for a bounded time. Spinning through every gap instead made the kernel slower (see
     SPIN_NS).
   - the tree wake-up (`ft_pool_set_tree_wake`, Linux): each worker sleeps on its own futex word, and the poster
     wakes only the first two; every worker that wakes (or finds the job while spinning) wakes the next two, so
     the poster returns after two wake-ups and the rest fan out over the workers, as a binary tree.
   Without it workers sleep on one condition variable that the poster broadcasts to.

   A job is done when its last task is, not when every worker has checked in: a worker the OS has descheduled
   (the host's other threads, a client on the same machine, outnumber the cores now and then) is not waited for
   unless it holds a task; the others take its share. `ft_pool_set_join(0)` waits for every worker as before,
   for measuring the difference. */

typedef void (*task_fn)(void *ctx, int task);

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_TREE_WAKE 1
#else
#define HAVE_TREE_WAKE 0
#endif

/* One per worker, a cache line each: the futex word it sleeps on in tree mode, and whether it sleeps there. */
typedef struct {
    atomic_uint bell;
    atomic_int asleep;
    atomic_uint finished;  /* the generation of the last job this worker looked for tasks in (the every-worker join) */
    char pad[52];
} doorbell;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_t threads[MAX_THREADS];
    int nworkers;
    atomic_uint generation, wake_requests;
    /* the current job's task count (high 32 bits) and next unclaimed task (low 32): a claim is one compare-and-swap
       on both, so a worker descheduled between reading the count and claiming cannot claim past the job's end */
    _Atomic uint64_t claim;
    atomic_int done;  /* tasks of the current job finished */
    atomic_int join_all;  /* ft_pool_set_join(0): the job also waits for every worker to check in */
    atomic_int sleepers;
    atomic_int cond_sleepers;  /* of the sleepers, those on the condition variable (not on their doorbell) */
    atomic_int tree_wake;      /* new sleeps go to the doorbells (ft_pool_set_tree_wake) */
    atomic_long spin_until;  /* now_ns() until which workers woken ahead of a job spin for it */
    task_fn fn;
    void *ctx;
    int ntasks;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static doorbell bells[MAX_THREADS];

/* Worker w wakes workers 2w+2 and 2w+3; the poster (w = -1) wakes workers 0 and 1. A child that is not asleep on
   its doorbell costs one load: it is spinning (it sees the job itself and wakes its own children) or on its way to
   sleep (it checks for a new job after saying so, and finds this one; see `sleep_on_bell`). */
static void wake_children(int w) {
#if HAVE_TREE_WAKE
    for (int c = 2 * w + 2; c <= 2 * w + 3 && c < pool.nworkers; c++) {
        if (atomic_load(&bells[c].asleep)) {
            atomic_fetch_add(&bells[c].bell, 1);
            syscall(SYS_futex, &bells[c].bell, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
        }
    }
#else
    (void)w;
#endif
}

/* ---- Owned tasks: a job that says which worker should run each of its tasks ----
   Its tasks come in phases (a task may wait for every task of the phases before its own); worker w runs its own
   tasks of a phase first, then takes the other owners' unclaimed ones of that phase, then goes on to the next
   phase, so every task of a phase is claimed before any of the next (none waits for a task nobody holds). The
   caller and late workers only take. Why: a warming job and the job that then computes the same rows give each
   byte the same owner, so each worker computes from its own L2 what it read into it. */
enum { OWNED_PHASES = 3, OWNED_MAX_TASKS = 8192 };
typedef struct {
    _Atomic uint64_t range[OWNED_PHASES];  /* (end << 32) | next: positions into owned_order, claimed as pool.claim */
    char pad[64 - OWNED_PHASES * 8];
} owned_claims;
static owned_claims owned[MAX_THREADS];
static int32_t owned_order[OWNED_MAX_TASKS];  /* the job's tasks by phase, then owner */
static atomic_int owned_job;  /* the posted job is claimed through `owned`, not pool.claim */
static int owned_phases;

/* A position in a range, or -1 when the range is exhausted: one compare-and-swap on (end, next), so a claim on a
   range of an earlier job (all claimed before it ended) cannot succeed. */
static int claim_in(_Atomic uint64_t *range) {
    uint64_t word = atomic_load(range);
    while ((uint32_t)word < (uint32_t)(word >> 32))
        if (atomic_compare_exchange_weak(range, &word, word + 1)) return (int)(uint32_t)word;
    return -1;
}

static void run_owned(int w) {
    int owners = pool.nworkers;
    for (int p = 0; p < owned_phases; p++)
        for (int i = 0; i < owners; i++) {
            _Atomic uint64_t *range = &owned[w < 0 ? i : (w + i) % owners].range[p];
            for (int at; (at = claim_in(range)) >= 0;) {
                pool.fn(pool.ctx, owned_order[at]);
                atomic_fetch_add(&pool.done, 1);
            }
        }
}

/* Claims and runs tasks of the current job until none is left; `w` is the worker, -1 the caller. fn and ctx are
   read only after a claim succeeds: the job cannot end (and the next one replace them) before the claimed task
   has run. */
static void run_tasks(int w) {
    if (atomic_load(&owned_job)) {
        run_owned(w);
        return;
    }
    uint64_t word = atomic_load(&pool.claim);
    for (;;) {
        if ((uint32_t)word >= (uint32_t)(word >> 32)) return;
        if (!atomic_compare_exchange_weak(&pool.claim, &word, word + 1)) continue;  /* word reloaded */
        pool.fn(pool.ctx, (int)(uint32_t)word);
        atomic_fetch_add(&pool.done, 1);
        word = atomic_load(&pool.claim);
    }
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Spins until a job newer than `seen` is posted or the clock passes `until`; whether one was. */
static int spin_for_job(unsigned seen, long until) {
    for (int spin = 0; atomic_load(&pool.generation) == seen; spin++) {
        CPU_RELAX();
        if ((spin & 63) == 63 && now_ns() > until) return 0;
    }
    return 1;
}

/* Sleeps until a job newer than `seen` or a wake request newer than `requests` (loaded before) is posted. */
static void sleep_on_condvar(unsigned seen, unsigned requests) {
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add(&pool.cond_sleepers, 1);
    while (atomic_load(&pool.generation) == seen && atomic_load(&pool.wake_requests) == requests)
        pthread_cond_wait(&pool.wake, &pool.mu);
    atomic_fetch_sub(&pool.cond_sleepers, 1);
    pthread_mutex_unlock(&pool.mu);
}

#if HAVE_TREE_WAKE
/* The same on worker w's doorbell. `asleep` is set before the job is checked and a waker checks `asleep` after
   posting (both sequentially consistent), so either this worker sees the job or its waker sees it asleep and
   rings; a ring between the check and the wait changes the word, and the wait returns at once. */
static void sleep_on_bell(int w, unsigned seen, unsigned requests) {
    doorbell *d = &bells[w];
    unsigned rung = atomic_load(&d->bell);
    atomic_store(&d->asleep, 1);
    while (atomic_load(&pool.generation) == seen && atomic_load(&pool.wake_requests) == requests) {
        syscall(SYS_futex, &d->bell, FUTEX_WAIT_PRIVATE, rung, NULL, NULL, 0);
        rung = atomic_load(&d->bell);
    }
    atomic_store(&d->asleep, 0);
}
#endif

typedef struct {
    int index;
    unsigned generation;
} worker_start;

static void *worker(void *arg) {
    /* The generation current when the pool was started, not when this thread first runs: a job posted in
       between must not be mistaken for one already done. */
    worker_start start = *(worker_start *)arg;
    free(arg);
    int w = start.index;
    unsigned seen = start.generation;
    int spin_first = 1;  /* after a job: spin SPIN_NS before sleeping; after an early wake-up that found none: not */
    for (;;) {
        if (!(spin_first && spin_for_job(seen, now_ns() + SPIN_NS))) {
            unsigned requests = atomic_load(&pool.wake_requests);
            atomic_fetch_add(&pool.sleepers, 1);
#if HAVE_TREE_WAKE
            if (atomic_load(&pool.tree_wake))
                sleep_on_bell(w, seen, requests);
            else
#endif
                sleep_on_condvar(seen, requests);
            atomic_fetch_sub(&pool.sleepers, 1);
            wake_children(w);  /* a job or a wake request: pass it down the tree */
            /* woken ahead of a job (ft_pool_wake): spin for it until the waker's deadline, else sleep again */
            if (!spin_for_job(seen, atomic_load(&pool.spin_until))) {
                spin_first = 0;
                continue;
            }
        }
        /* Found the job (spinning, or awake from a wake request or the job itself): its children may be asleep.
           Again after a wake request, since a child woken by it may have given up spinning and slept again before
           the job came: left asleep, it would hang the job (the pool waits for every worker). */
        wake_children(w);
        spin_first = 1;
        seen = atomic_load(&pool.generation);
        run_tasks(w);
        atomic_store(&bells[w].finished, seen);
    }
    return NULL;
}

/* Wakes whoever sleeps: the doorbells' tree from its root, and the condition variable's sleepers (those that
   went to sleep before a switch of mode). Called after the generation or the wake requests moved on. */
static void wake_sleepers(void) {
    wake_children(-1);
    if (atomic_load(&pool.cond_sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }
}

/* The tree wake-up on (1) or off (0); returns whether it is on (never where it is not built: off Linux). Workers
   asleep when it changes are still woken the way they went to sleep. */
int ft_pool_set_tree_wake(int on) {
    atomic_store(&pool.tree_wake, on && HAVE_TREE_WAKE);
    return atomic_load(&pool.tree_wake);
}

/* Wakes sleeping workers to spin for up to `spin_ns` for a job the caller is about to post (a hint; nothing
   happens when none sleeps). */
void ft_pool_wake(long spin_ns) {
    if (atomic_load(&pool.sleepers) == 0) return;
    atomic_store(&pool.spin_until, now_ns() + spin_ns);
    atomic_fetch_add(&pool.wake_requests, 1);
    wake_sleepers();
}

/* Starts the pool once; the calling thread works too, so `threads` counts it. Returns the size in use. */
int ft_pool_start(int threads) {
    pthread_mutex_lock(&pool.mu);
    if (pool.nworkers == 0 && threads > 1) {
        if (threads > MAX_THREADS) threads = MAX_THREADS;
        for (int i = 0; i < threads - 1; i++) {
            worker_start *start = malloc(sizeof *start);
            if (!start) break;
            *start = (worker_start){i, atomic_load(&pool.generation)};
            if (pthread_create(&pool.threads[i], NULL, worker, start) != 0) {
                free(start);
                break;
            }
            pthread_detach(pool.threads[i]);
            pool.nworkers++;
        }
    }
    pthread_mutex_unlock(&pool.mu);
    return pool.nworkers + 1;
}

/* A background job (`parallel_start_background`) is one nobody waits for: the next job posted cancels what is left
   of it (its tasks check `background_cancel` and return early) and drains it first. */
static int background;  /* such a job is posted and not yet drained (the posting thread's state) */
static atomic_int background_cancel;

static void drain_background(void) {
    if (!background) return;
    atomic_store(&background_cancel, 1);
    run_tasks(-1);  /* the tasks nobody has claimed yet return at once */
    while (atomic_load(&pool.done) < pool.ntasks) CPU_RELAX();
    background = 0;
    atomic_store(&background_cancel, 0);
}

/* Posts fn(ctx, 0..ntasks-1) to the workers and returns at once; `parallel_wait` joins in and returns when all
   are done. Not reentrant: one job at a time, posted and waited for by one caller. */
static void parallel_start(task_fn fn, void *ctx, int ntasks) {
    drain_background();
    pool.fn = fn;
    pool.ctx = ctx;
    pool.ntasks = ntasks;
    atomic_store(&pool.done, 0);
    atomic_store(&owned_job, 0);
    atomic_store(&pool.claim, (uint64_t)(uint32_t)ntasks << 32);  /* publishes fn and ctx with it */
    atomic_fetch_add(&pool.generation, 1);
    wake_sleepers();
}

/* The owner of a phase's task i: each period's tasks shared out in order over the workers. */
static inline int owner_of(int i, int period, int owners) { return (int)((int64_t)(i % period) * owners / period); }

/* parallel_start for a job of owned tasks: `phases` phases of tasks[p] tasks each, numbered phase after phase;
   task i of phase p belongs to worker ((i % period[p]) * workers) / period[p], i.e. each period's tasks are
   shared out in order (a job whose tasks walk an expert's rows in periods gives each worker the same rows of every
   expert). Where the pool has no workers or the job is too large, its tasks are claimed in order as usual. */
static void parallel_start_owned(task_fn fn, void *ctx, int phases, const int *tasks, const int *period) {
    int owners = pool.nworkers, total = 0;
    for (int p = 0; p < phases; p++) total += tasks[p];
    if (owners == 0 || phases > OWNED_PHASES || total > OWNED_MAX_TASKS) {
        parallel_start(fn, ctx, total);
        return;
    }
    drain_background();
    static int32_t count[OWNED_PHASES][MAX_THREADS + 1];  /* the poster's only: one job is posted at a time */
    for (int p = 0, first = 0; p < phases; p++) {  /* counting sort by owner, a phase's positions after the last's */
        memset(count[p], 0, sizeof count[p]);
        for (int i = 0; i < tasks[p]; i++) count[p][owner_of(i, period[p], owners) + 1]++;
        count[p][0] = first;
        for (int o = 0; o < owners; o++) count[p][o + 1] += count[p][o];
        int32_t at[MAX_THREADS];
        memcpy(at, count[p], owners * sizeof *at);
        for (int i = 0; i < tasks[p]; i++) owned_order[at[owner_of(i, period[p], owners)]++] = first + i;
        first += tasks[p];
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.ntasks = total;
    owned_phases = phases;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.claim, 0);  /* nothing to claim in order */
    atomic_store(&owned_job, 1);
    for (int o = 0; o < owners; o++)  /* publish the order, fn and ctx with them */
        for (int p = 0; p < OWNED_PHASES; p++)
            atomic_store(&owned[o].range[p], p < phases ? (uint64_t)(uint32_t)count[p][o + 1] << 32 |
                                                              (uint32_t)count[p][o] : 0);
    atomic_fetch_add(&pool.generation, 1);
    wake_sleepers();
}

static int caller_joins = 1;  /* ft_pool_set_caller_joins */

static void parallel_wait(void) {
    if (caller_joins) run_tasks(-1);
    while (atomic_load(&pool.done) < pool.ntasks) CPU_RELAX();
    if (atomic_load(&pool.join_all)) {
        unsigned generation = atomic_load(&pool.generation);
        for (int w = 0; w < pool.nworkers; w++)
            while (atomic_load(&bells[w].finished) != generation) CPU_RELAX();
    }
}

/* Whether the thread that waits for a job runs its tasks too (1, default) or only waits (0, where workers exist);
   returns the setting it replaces. */
int ft_pool_set_caller_joins(int on) {
    int before = caller_joins;
    caller_joins = on || pool.nworkers == 0;
    return before;
}

/* 1 (default): a job ends with its last task; 0: it also waits until every worker has looked for tasks in it
   (the join before this file's task counting, kept to measure what descheduled workers cost). Returns the mode. */
int ft_pool_set_join(int by_tasks) {
    atomic_store(&pool.join_all, !by_tasks);
    return !atomic_load(&pool.join_all);
}

/* Posts a job that only the workers run and nobody waits for; the next job posted cancels its rest. Where the pool
   has no workers it does nothing (the caller would have to run it). */
static void parallel_start_background(task_fn fn, void *ctx, int ntasks) {
    if (pool.nworkers == 0) return;
    parallel_start(fn, ctx, ntasks);
    background = 1;
}

static void parallel_start_owned_background(task_fn fn, void *ctx, int phases, const int *tasks,
                                            const int *period) {
    if (pool.nworkers == 0) return;
    parallel_start_owned(fn, ctx, phases, tasks, period);
    background = 1;
}

static void parallel_for(task_fn fn, void *ctx, int ntasks) {
    parallel_start(fn, ctx, ntasks);
    parallel_wait();
}
