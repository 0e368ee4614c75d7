/* Part of experts.c (included once, where it stands): the persistent worker pool. */

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
