/* Part of experts.c (included once, where it stands): the persistent worker pool. */

/* ---- persistent thread pool: workers spin briefly, then sleep on a condition variable ----
   Waking sleeping workers costs the waker a system call that wakes each of them in turn (tens of µs on a
   16-core host), on the decode step's critical path when it happens as a job is posted. `ft_pool_wake` moves
   it earlier: the caller wakes them while it waits anyway (for the GPU's routing), and they spin for the job
   for a bounded time. Spinning through every gap instead made the kernel slower (see SPIN_NS). */

typedef void (*task_fn)(void *ctx, int task);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_t threads[MAX_THREADS];
    int nworkers;
    atomic_uint generation, wake_requests;
    atomic_int next, busy, sleepers;
    atomic_long spin_until;  /* now_ns() until which workers woken ahead of a job spin for it */
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

/* Spins until a job newer than `seen` is posted or the clock passes `until`; whether one was. */
static int spin_for_job(unsigned seen, long until) {
    for (int spin = 0; atomic_load(&pool.generation) == seen; spin++) {
        CPU_RELAX();
        if ((spin & 63) == 63 && now_ns() > until) return 0;
    }
    return 1;
}

static void *worker(void *arg) {
    /* The generation current when the pool was started, not when this thread first runs: a job posted in
       between must not be mistaken for one already done. */
    unsigned seen = (unsigned)(uintptr_t)arg;
    int spin_first = 1;  /* after a job: spin SPIN_NS before sleeping; after an early wake-up that found none: not */
    for (;;) {
        if (!(spin_first && spin_for_job(seen, now_ns() + SPIN_NS))) {
            pthread_mutex_lock(&pool.mu);
            unsigned requests = atomic_load(&pool.wake_requests);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.generation) == seen && atomic_load(&pool.wake_requests) == requests)
                pthread_cond_wait(&pool.wake, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
            /* woken ahead of a job (ft_pool_wake): spin for it until the waker's deadline, else sleep again */
            if (!spin_for_job(seen, atomic_load(&pool.spin_until))) {
                spin_first = 0;
                continue;
            }
        }
        spin_first = 1;
        seen = atomic_load(&pool.generation);
        run_tasks();
        atomic_fetch_sub(&pool.busy, 1);
    }
    return NULL;
}

/* Wakes sleeping workers to spin for up to `spin_ns` for a job the caller is about to post (a hint; nothing
   happens when none sleeps). */
void ft_pool_wake(long spin_ns) {
    if (atomic_load(&pool.sleepers) == 0) return;
    atomic_store(&pool.spin_until, now_ns() + spin_ns);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add(&pool.wake_requests, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
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
