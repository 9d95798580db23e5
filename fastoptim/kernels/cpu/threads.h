/* Part of fused_cpu.c, which includes its parts in this order as one translation unit: common.h,
   formats.h, algorithms.h, walk.h, clip.h, threads.h. */

/* --- Threads: torch's OpenMP runtime, or pthreads ------------------------------------------ */

static void *work_share(void *arg) {
    const Share *s = arg;
    const Work *w = s->work;
    for (int64_t k = s->chunk_begin; k < s->chunk_end; k++)
        w->chunk(w, k);
    return NULL;
}

/* torch's OpenMP runtime, if fastoptim_use_openmp found it: GOMP_parallel is the entry point GCC
   compiles `#pragma omp parallel` to, offered by libgomp and by LLVM's and Intel's runtimes. */
static void (*gomp_parallel)(void (*)(void *), void *, unsigned, unsigned);
static int (*omp_get_thread_num_)(void), (*omp_get_num_threads_)(void);

/* Use the OpenMP runtime at ``path`` if it is loaded; NULL: use pthreads. */
int fastoptim_use_openmp(const char *path) {
    gomp_parallel = NULL;
    if (!path) return 0;
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);  /* only if already loaded */
    if (!library) return -1;
    gomp_parallel = (void (*)(void (*)(void *), void *, unsigned, unsigned))dlsym(library, "GOMP_parallel");
    omp_get_thread_num_ = (int (*)(void))dlsym(library, "omp_get_thread_num");
    omp_get_num_threads_ = (int (*)(void))dlsym(library, "omp_get_num_threads");
    if (!gomp_parallel || !omp_get_thread_num_ || !omp_get_num_threads_) {
        gomp_parallel = NULL;
        return -1;
    }
    return 0;
}

typedef struct { Share *shares; int64_t n; } Team;

static void team_member(void *arg) {
    const Team *team = arg;
    for (int64_t k = omp_get_thread_num_(); k < team->n; k += omp_get_num_threads_()) work_share(&team->shares[k]);
}

#define MAX_THREADS 256
/* Elements per thread below which another thread is not woken: waking a parked thread can cost
   milliseconds on a shared machine, far more than such a share of work (torch's elementwise ops keep
   a grain of 32k elements for the same reason). Small steps run on the calling thread alone. */
#define GRAIN_NUMEL (1 << 16)

/* The first chunk in [begin, end) that does not start before element ``target``. */
static int64_t chunk_at(const int64_t *chunks, int64_t begin, int64_t end, int64_t target) {
    while (begin < end) {
        int64_t mid = begin + (end - begin) / 2;
        if (chunks[4 * mid + 3] < target) begin = mid + 1; else end = mid;
    }
    return begin;
}

/* Runs chunks [chunk_begin, chunk_end) on up to n_threads threads (the caller is one of them), one
   per GRAIN_NUMEL elements at most. */
static int run(ChunkFn chunk, const int64_t *pointers, int64_t n_tensors, const int64_t *chunks,
               int64_t chunk_begin, int64_t chunk_end, const int64_t *layouts, const Scalar *scalars,
               void *extra, int32_t n_threads) {
    if (!chunk) return -1;
    if (scalars && scalars[FOUND_INF].values[0] != 0) return 0;  /* GradScaler found inf: skip */
    const Work w = {.pointers = pointers, .n_tensors = n_tensors, .chunks = chunks, .layouts = layouts,
                    .scalars = scalars, .chunk = chunk, .extra = extra};
    const int64_t n_chunks = chunk_end - chunk_begin;
    const int64_t first = n_chunks ? chunks[4 * chunk_begin + 3] : 0;
    const int64_t total = n_chunks ? chunks[4 * (chunk_end - 1) + 3] + chunks[4 * (chunk_end - 1) + 2] - first : 0;
    int64_t n = n_threads < n_chunks ? n_threads : n_chunks;
    if (n > total / GRAIN_NUMEL) n = total / GRAIN_NUMEL;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n < 1) n = 1;
    Share shares[MAX_THREADS];
    for (int64_t k = 0; k < n; k++)
        shares[k] = (Share){&w, chunk_at(chunks, chunk_begin, chunk_end, first + total * k / n),
                            chunk_at(chunks, chunk_begin, chunk_end, first + total * (k + 1) / n)};
    if (n == 1) {
        work_share(&shares[0]);
    } else if (gomp_parallel) {
        Team team = {shares, n};
        gomp_parallel(team_member, &team, (unsigned)n, 0);
    } else {
        pthread_t threads[MAX_THREADS];
        int64_t started = 1;  /* share 0 is the caller's; a thread that fails to start leaves its share to it */
        for (; started < n && pthread_create(&threads[started], NULL, work_share, &shares[started]) == 0; started++) {}
        for (int64_t k = started; k < n; k++) work_share(&shares[k]);
        work_share(&shares[0]);
        for (int64_t k = 1; k < started; k++) pthread_join(threads[k], NULL);
    }
    return 0;
}
