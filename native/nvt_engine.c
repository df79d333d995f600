/*
 * nvt_engine: the io_uring I/O engine core (see nvt_engine.h for the thread
 * and lock rules). Each worker's native I/O thread owns its ring: it takes ops
 * from its pending queue, hashes write payloads, preps and submits SQEs, reaps
 * CQEs, hashes read payloads, continues short transfers and publishes
 * completions to the engine's one done queue. nvt_engine_submit routes each
 * op to a worker of its file (see nvt_engine.h).
 *
 * This unit is the public API: open (the workers, each thread started and
 * set up in turn), submit, wait, close, free, the stats and the test hooks,
 * and the routing of ops to workers. It runs on the caller's threads:
 * submit takes the engine's lock briefly and never waits for I/O, wait
 * blocks up to its timeout, close joins the I/O threads. The I/O thread is
 * nvt_engine_io.c; nvt_engine_internal.h lists the other units.
 */
#define _GNU_SOURCE
#include "nvt_engine.h"

#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "nvt_engine_internal.h"
#include "nvt_hash.h"

#define NVT_MAX_QUEUE_DEPTH 32767u

/* ---- small helpers ------------------------------------------------------ */

static int pend_reserve_locked(nvt_worker *w, size_t extra) {
    if (w->pend_len + extra <= w->pend_cap)
        return 0;
    size_t cap = w->pend_cap ? w->pend_cap : 256;
    while (cap < w->pend_len + extra)
        cap *= 2;
    nvt_op *ops = malloc(cap * sizeof(*ops));
    if (!ops)
        return -ENOMEM;
    /* Unwrap the ring into the new array in FIFO order. */
    for (size_t i = 0; i < w->pend_len; i++)
        ops[i] = w->pend[(w->pend_head + i) & (w->pend_cap - 1)];
    free(w->pend);
    w->pend = ops;
    w->pend_head = 0;
    w->pend_cap = cap;
    return 0;
}

static void wake_io_thread(nvt_worker *w) {
    uint64_t one = 1;
    while (write(w->wake_fd, &one, sizeof(one)) < 0 && errno == EINTR)
        ;
}

/* 0 if the op can run, else the -errno it completes with at once. */
static int validate_op(const nvt_engine *e, const nvt_op *op) {
    if (op->kind != NVT_OP_READ && op->kind != NVT_OP_WRITE)
        return -EINVAL;
    if (op->file_idx < 0 || op->file_idx >= (int64_t)e->nfds)
        return -EBADF;
    if (op->buf_offset < 0 || op->length < 0 || (uint64_t)op->buf_offset > e->buf_len ||
        (uint64_t)op->length > e->buf_len - (uint64_t)op->buf_offset)
        return -EFAULT;
    if (op->file_offset < 0 || op->length > INT64_MAX - op->file_offset)
        return -EINVAL;
    if (e->sealed && (uint64_t)op->length != e->seal.row_bytes)
        return -EFAULT; /* a sealed slot holds exactly one chunk */
    return 0;
}

/* ---- workers and files -------------------------------------------------- */

/* How many workers serve file `f`, and the k-th of them (see nvt_engine.h). */
static unsigned file_n_workers(const nvt_engine *e, unsigned f) {
    unsigned W = e->n_workers, F = e->nfds;
    if (W < F)
        return 1;
    return W / F + (f < W % F ? 1u : 0u);
}

static unsigned file_worker(const nvt_engine *e, unsigned f, unsigned k) {
    unsigned W = e->n_workers, F = e->nfds;
    return W < F ? f % W : f + k * F;
}

/* A worker's share of the drives, in drives (its files, each divided by the
 * number of workers serving it): sizes its queue depth and bytes in flight. */
static double worker_share(const nvt_engine *e, unsigned w) {
    unsigned W = e->n_workers, F = e->nfds ? e->nfds : 1;
    if (W >= F)
        return 1.0 / (double)file_n_workers(e, w % F);
    unsigned files = F / W + (w < F % W ? 1u : 0u);
    return (double)files;
}

/* The worker for the next op on file f: the file's workers in turn, skipping
 * failed rings while a healthy one serves the file. Called with e->lock. */
static nvt_worker *route_locked(nvt_engine *e, unsigned f) {
    unsigned n = file_n_workers(e, f);
    unsigned start = e->rr[f]++;
    for (unsigned i = 0; i < n; i++) {
        nvt_worker *w = &e->workers[file_worker(e, f, (start + i) % n)];
        if (!__atomic_load_n(&w->failed_hint, __ATOMIC_RELAXED))
            return w;
    }
    return &e->workers[file_worker(e, f, start % n)];
}

/* ---- public API --------------------------------------------------------- */

static void worker_destroy(nvt_worker *w) {
    if (w->wake_fd >= 0)
        close(w->wake_fd);
    pthread_mutex_destroy(&w->lock);
    for (unsigned i = 0; w->slots && i < w->qd; i++) {
        free(w->slots[i].bounce); /* ciphertext and trailers only */
        free(w->slots[i].trail);
    }
    free(w->slots);
    free(w->free_slots);
    free(w->taken);
    free(w->reads);
    free(w->pend);
    free(w->out.items);
    free(w->stage_used);
    if (w->stage_map)
        munmap(w->stage_map, w->stage_map_len);
}

static void engine_destroy(nvt_engine *e) {
    nvt_engines_remove(e);
    for (unsigned i = 0; e->workers && i < e->n_workers; i++)
        worker_destroy(&e->workers[i]);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->close_lock);
    pthread_rwlock_destroy(&e->apply_lock);
    if (e->sealed)
        nvt_keys_unref(e->seal.keys);
    explicit_bzero(&e->seal, sizeof(e->seal));
    pthread_cond_destroy(&e->cv);
    free(e->workers);
    free(e->rr);
    free(e->fds);
    free(e->done.items);
    free(e);
}

static int worker_init(nvt_engine *e, unsigned idx) {
    nvt_worker *w = &e->workers[idx];
    double share = worker_share(e, idx);
    double qd = (double)e->cfg.queue_depth * share;
    w->qd = qd < 1.0 ? 1u : (qd > NVT_MAX_QUEUE_DEPTH ? NVT_MAX_QUEUE_DEPTH : (unsigned)(qd + 0.999));
    double bytes = (double)e->cfg.max_inflight_bytes * share / (double)(e->nfds ? e->nfds : 1);
    w->max_inflight_bytes = bytes < 1.0 ? 1 : (uint64_t)bytes;
    w->info.queue_depth = w->qd;
    w->info.max_inflight_bytes = w->max_inflight_bytes;
    unsigned n = w->qd;
    w->slots = calloc(n, sizeof(*w->slots));
    w->free_slots = malloc(n * sizeof(unsigned));
    w->taken = malloc(n * sizeof(unsigned));
    w->reads = malloc(n * sizeof(*w->reads));
    if (!w->slots || !w->free_slots || !w->taken || !w->reads || batch_reserve(&w->out, 2 * (size_t)n + 2))
        return -ENOMEM;
    for (unsigned i = 0; i < n; i++)
        w->free_slots[i] = n - 1 - i;
    w->n_free = n;
    /* Blocking eventfd on purpose: io_uring completes a read of an O_NONBLOCK
     * file with -EAGAIN instead of waiting for it to become readable. */
    pthread_mutex_lock(&nvt_engines_lock); /* a fork sees it recorded or not made */
    w->wake_fd = eventfd(0, EFD_CLOEXEC);
    int err = w->wake_fd < 0 ? -errno : 0;
    pthread_mutex_unlock(&nvt_engines_lock);
    return err;
}

/* Start worker w's thread and wait for its ring setup. */
static int worker_start(nvt_engine *e, nvt_worker *w) {
    /* The I/O threads block every signal: they belong to the application's
     * threads (Python handles them on its main thread). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_mutex_lock(&e->lock);
    e->setup_done = 0;
    pthread_mutex_unlock(&e->lock);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int ret = pthread_create(&w->thread, NULL, nvt_io_main, w);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (ret != 0)
        return -ret;
    pthread_mutex_lock(&e->lock);
    while (!e->setup_done)
        pthread_cond_wait(&e->cv, &e->lock);
    ret = e->setup_done < 0 ? e->setup_done : 0;
    pthread_mutex_unlock(&e->lock);
    if (ret != 0) {
        pthread_join(w->thread, NULL); /* it returned after the failed setup */
        return ret;
    }
    w->started = 1;
    return 0;
}

/* Stop and join every started worker (queued ops cancelled). */
static void engine_stop(nvt_engine *e) {
    pthread_mutex_lock(&e->lock);
    e->closing = 1;
    for (unsigned i = 0; i < e->n_workers; i++) {
        nvt_worker *w = &e->workers[i];
        pthread_mutex_lock(&w->lock);
        /* Queued ops never reached a ring: cancel them. */
        batch_reserve_hard(&e->done, w->pend_len);
        for (size_t j = 0; j < w->pend_len; j++)
            batch_push(&e->done, w->pend[(w->pend_head + j) & (w->pend_cap - 1)].op_id, -ECANCELED, 0);
        w->pend_len = 0;
        done_changed_locked(e);
        w->closing = 1;
        pthread_mutex_unlock(&w->lock);
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    /* A submit that queued its ops before `closing` may still be waking
     * workers (outside the lock): let it finish before any wake fd closes,
     * or its write could reach a number reused for another file. */
    while (__atomic_load_n(&e->submitting, __ATOMIC_ACQUIRE))
        sched_yield();
    for (unsigned i = 0; i < e->n_workers; i++) {
        nvt_worker *w = &e->workers[i];
        if (!w->started)
            continue;
        /* Unconditionally: the thread may be waiting on the ring. */
        wake_io_thread(w);
    }
    /* Every thread joined before any wake fd closes: a thread still running
     * may relay a wake-up a submit left (nvt_engine_relay_wakes) to any
     * worker's fd, the joined ones' included. */
    for (unsigned i = 0; i < e->n_workers; i++) {
        nvt_worker *w = &e->workers[i];
        if (w->started)
            pthread_join(w->thread, NULL);
    }
    for (unsigned i = 0; i < e->n_workers; i++) {
        nvt_worker *w = &e->workers[i];
        if (!w->started)
            continue;
        w->started = 0;
        /* Under nvt_engines_lock: a fork between the close and the -1 would have
         * the child close this number again, by then maybe another file. */
        pthread_mutex_lock(&nvt_engines_lock);
        close(w->wake_fd);
        w->wake_fd = -1;
        pthread_mutex_unlock(&nvt_engines_lock);
    }
}

int nvt_engine_open(nvt_engine **out, void *buf, size_t buf_len, const int *fds,
                    unsigned nfds, const nvt_config *cfg) {
    if (cfg->queue_depth < 1 || cfg->queue_depth > NVT_MAX_QUEUE_DEPTH || cfg->max_inflight_bytes == 0 ||
        cfg->register_chunk_bytes < NVT_PAGE_BYTES ||
        cfg->register_chunk_bytes > NVT_MAX_REGISTER_CHUNK_BYTES ||
        cfg->register_chunk_bytes % NVT_PAGE_BYTES != 0 || cfg->workers < 1 ||
        cfg->workers > NVT_MAX_WORKERS)
        return -EINVAL;
    if (cfg->seal && (cfg->seal->row_bytes == 0 || cfg->seal->row_bytes > buf_len ||
                      cfg->seal->slot_bytes < cfg->seal->row_bytes + NVT_TRAILER_BYTES ||
                      cfg->seal->slot_bytes - cfg->seal->row_bytes > NVT_MAX_SQE_BYTES ||
                      cfg->seal->slot_bytes > NVT_MAX_SQE_BYTES))
        return -EINVAL;

    nvt_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->buf = buf;
    e->buf_len = buf_len;
    e->nfds = nfds;
    e->cfg = *cfg;
    e->n_workers = cfg->workers;
    e->src_ring_fd_fork = -1;
    e->cfg.seal = NULL;
    if (cfg->seal) {
        /* The sealed I/O moves a bounce buffer and a trailer page, neither
         * in the registered buffer: register nothing (no pin for nothing). */
        e->sealed = 1;
        e->seal = *cfg->seal;
        nvt_keys_ref(e->seal.keys); /* released in engine_destroy */
        e->cfg.register_buffers = 0;
    }
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->close_lock, NULL);
    /* Writers first: several workers' read holds may overlap without end
     * under load, and set_apply (a bind or detach) must not starve. */
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&e->apply_lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);

    e->fds = malloc((nfds ? nfds : 1) * sizeof(int));
    e->rr = calloc(nfds ? nfds : 1, sizeof(unsigned));
    e->workers = calloc(e->n_workers, sizeof(*e->workers));
    if (!e->fds || !e->rr || !e->workers) {
        e->n_workers = 0; /* no worker mutex was initialized yet */
        engine_destroy(e);
        return -ENOMEM;
    }
    if (nfds)
        memcpy(e->fds, fds, nfds * sizeof(int));
    /* Every worker gets what engine_destroy releases before any can fail. */
    for (unsigned i = 0; i < e->n_workers; i++) {
        e->workers[i].e = e;
        e->workers[i].idx = i;
        e->workers[i].wake_fd = -1;
        e->workers[i].ring_fd_fork = -1;
        pthread_mutex_init(&e->workers[i].lock, NULL);
    }
    nvt_engines_add(e); /* before any ring exists */
    int ret = 0;
    for (unsigned i = 0; i < e->n_workers && ret == 0; i++)
        ret = worker_init(e, i);
    if (ret == 0 && e->n_workers > 1 && e->cfg.register_buffers && buf_len > 0)
        nvt_src_ring_open(e);
    /* One at a time: each sets up its ring (and clones) before the next. */
    for (unsigned i = 0; i < e->n_workers && ret == 0; i++)
        ret = worker_start(e, &e->workers[i]);
    if (e->src_ring_ok) {
        nvt_ring_destroy(&e->src_ring, &e->src_ring_fd_fork);
        e->src_ring_ok = 0;
    }
    if (ret != 0) {
        engine_stop(e);
        engine_destroy(e);
        return ret;
    }
    *out = e;
    return 0;
}

unsigned nvt_engine_workers(const nvt_engine *e) {
    return e->n_workers;
}

void nvt_engine_get_info(const nvt_engine *e, unsigned w, nvt_engine_info *info) {
    *info = e->workers[w].info;
}

void nvt_engine_worker_stats(nvt_engine *e, unsigned w, nvt_worker_stats *out) {
    nvt_worker *wk = &e->workers[w];
    out->ops = __atomic_load_n(&wk->n_ops, __ATOMIC_RELAXED);
    out->bytes = __atomic_load_n(&wk->n_bytes, __ATOMIC_RELAXED);
    out->hashed = __atomic_load_n(&wk->n_hashed, __ATOMIC_RELAXED);
    out->staged = __atomic_load_n(&wk->n_staged, __ATOMIC_RELAXED);
    out->failed_errno = __atomic_load_n(&wk->failed_hint, __ATOMIC_RELAXED);
    out->cpu_s = 0;
    if (e->forked)
        return; /* no threads here; a parent's thread may hold close_lock */
    clockid_t cid;
    struct timespec ts;
    /* close_lock: the thread must not be joined (its id freed) meanwhile. */
    pthread_mutex_lock(&e->close_lock);
    if (!e->joined && wk->started && pthread_getcpuclockid(wk->thread, &cid) == 0 &&
        clock_gettime(cid, &ts) == 0)
        out->cpu_s = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    pthread_mutex_unlock(&e->close_lock);
}

int nvt_engine_inject_enter_error(nvt_engine *e, unsigned w, int err) {
    if (w >= e->n_workers || err < 0)
        return -EINVAL;
    if (e->forked)
        return -ESHUTDOWN;
    __atomic_store_n(&e->workers[w].inject_enter_err, err, __ATOMIC_RELAXED);
    wake_io_thread(&e->workers[w]); /* out of a wait in the ring */
    return 0;
}

int nvt_engine_fail_worker(nvt_engine *e, unsigned w, int err) {
    if (w >= e->n_workers || err <= 0)
        return -EINVAL;
    if (e->forked)
        return -ESHUTDOWN;
    nvt_worker *wk = &e->workers[w];
    pthread_mutex_lock(&wk->lock);
    if (!wk->failed) {
        wk->failed = err;
        __atomic_store_n(&wk->failed_hint, err, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&wk->lock);
    return 0;
}

int nvt_engine_submit(nvt_engine *e, const nvt_op *ops, size_t n) {
    size_t immediate = 0;
    /* Small batches route on the stack; larger ones allocate. */
    uint16_t stack_route[256];
    uint16_t *route = n <= 256 ? stack_route : malloc(n * sizeof(uint16_t));
    size_t counts[NVT_MAX_WORKERS];
    if (!route)
        return -ENOMEM;

    if (e->forked) {
        if (route != stack_route)
            free(route);
        return -ESHUTDOWN;
    }
    pthread_mutex_lock(&e->lock);
    if (e->closing) {
        pthread_mutex_unlock(&e->lock);
        if (route != stack_route)
            free(route);
        return -ESHUTDOWN;
    }
    memset(counts, 0, sizeof(size_t) * e->n_workers);
    for (size_t i = 0; i < n; i++) {
        if (validate_op(e, &ops[i]) != 0 || ops[i].length == 0) {
            route[i] = UINT16_MAX; /* completes at once, below */
            continue;
        }
        nvt_worker *w = route_locked(e, (unsigned)ops[i].file_idx);
        route[i] = (uint16_t)w->idx;
        counts[w->idx]++;
    }
    /* Reserve first so that an op is either queued or refused with the whole
     * call, never half-submitted. Only the workers that get ops are locked
     * (in index order, under e->lock). */
    int err = batch_reserve(&e->done, n);
    unsigned locked = 0;
    while (!err && locked < e->n_workers) {
        nvt_worker *w = &e->workers[locked++];
        if (!counts[w->idx])
            continue;
        pthread_mutex_lock(&w->lock);
        if (pend_reserve_locked(w, counts[w->idx]) != 0)
            err = -ENOMEM;
    }
    if (err) {
        for (unsigned i = 0; i < locked; i++) {
            if (counts[i])
                pthread_mutex_unlock(&e->workers[i].lock);
        }
        pthread_mutex_unlock(&e->lock);
        if (route != stack_route)
            free(route);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        if (route[i] == UINT16_MAX) {
            int verr = validate_op(e, &ops[i]);
            if (verr != 0)
                batch_push(&e->done, ops[i].op_id, verr, 0);
            else
                batch_push(&e->done, ops[i].op_id, 0, ops[i].checksum ? nvt_xxh3(NULL, 0, ops[i].seed) : 0);
            immediate++;
            continue;
        }
        nvt_worker *w = &e->workers[route[i]];
        w->pend[(w->pend_head + w->pend_len) & (w->pend_cap - 1)] = ops[i];
        w->pend_len++;
    }
    int wake[NVT_MAX_WORKERS];
    for (unsigned i = 0; i < e->n_workers; i++) {
        nvt_worker *w = &e->workers[i];
        wake[i] = 0;
        if (!counts[i])
            continue;
        wake[i] = w->sleeping;
        w->sleeping = 0;
        pthread_mutex_unlock(&w->lock);
    }
    if (immediate) {
        done_changed_locked(e);
        pthread_cond_broadcast(&e->cv);
    }
    /* Counted under the lock, before a close can set `closing`: close waits
     * for the wake-ups below before it closes the wake fds. */
    __atomic_fetch_add(&e->submitting, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&e->lock);
    /* One eventfd write on this (vLLM's) thread: one idle worker that got
     * ops is woken here and wakes the others (nvt_engine_relay_wakes).
     * Their due flags are set before its wake-up, so it finds them. An idle
     * worker may still be hashing or opening the reads it reaped last (it
     * relays between two of them): one already waiting in its ring is
     * preferred, so the others' wake-ups wait for no hash. */
    int first = -1;
    for (unsigned i = 0; i < e->n_workers; i++) {
        if (wake[i] && (first < 0 || (!__atomic_load_n(&e->workers[first].in_wait, __ATOMIC_RELAXED) &&
                                      __atomic_load_n(&e->workers[i].in_wait, __ATOMIC_RELAXED))))
            first = (int)i;
    }
    for (unsigned i = 0; i < e->n_workers; i++) {
        if (!wake[i] || (int)i == first)
            continue;
        __atomic_store_n(&e->wake_due[i], 1, __ATOMIC_RELAXED);
        __atomic_store_n(&e->wake_any, 1, __ATOMIC_RELEASE);
    }
    if (first >= 0)
        wake_io_thread(&e->workers[first]);
    __atomic_fetch_sub(&e->submitting, 1, __ATOMIC_RELEASE);
    if (route != stack_route)
        free(route);
    return 0;
}

/* An I/O thread's relay of the wake-ups a submit left it (the top of each
 * round of nvt_engine_io.c's loop; any thread may do it, each due wake-up is
 * done once). A worker woken for nothing (it took its ops already) just
 * re-arms its eventfd read. */
void nvt_engine_relay_wakes(nvt_engine *e) {
    if (!__atomic_load_n(&e->wake_any, __ATOMIC_ACQUIRE) || !__atomic_exchange_n(&e->wake_any, 0, __ATOMIC_ACQ_REL))
        return;
    for (unsigned i = 0; i < e->n_workers; i++)
        if (__atomic_load_n(&e->wake_due[i], __ATOMIC_RELAXED) && __atomic_exchange_n(&e->wake_due[i], 0, __ATOMIC_ACQ_REL))
            wake_io_thread(&e->workers[i]);
}

void nvt_engine_wait(nvt_engine *e, double timeout_s, nvt_completion_batch *batch) {
    /* A poll that finds nothing skips the mutex the I/O threads keep taking:
     * done_hint (done.len's atomic copy) is read as a hint; a completion it misses is found by
     * the next poll (the store is polled at every engine step). */
    if (e->forked || (timeout_s <= 0 && !__atomic_load_n(&e->done_hint, __ATOMIC_ACQUIRE)))
        return;
    pthread_mutex_lock(&e->lock);
    /* Every I/O thread exited (only after close began): nothing will come. */
    if (!e->done.len && e->n_exited < e->n_workers && timeout_s > 0) {
        struct timespec deadline;
        if (timeout_s > 1e7)
            timeout_s = 1e7;
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        time_t secs = (time_t)timeout_s;
        long nsec = (long)((timeout_s - (double)secs) * 1e9);
        deadline.tv_sec += secs;
        deadline.tv_nsec += nsec;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
        while (!e->done.len && e->n_exited < e->n_workers) {
            if (pthread_cond_timedwait(&e->cv, &e->lock, &deadline) == ETIMEDOUT)
                break;
        }
    }
    if (e->done.len) {
        nvt_completion_batch t = e->done;
        e->done = *batch;
        e->done.len = 0;
        done_changed_locked(e);
        *batch = t;
    }
    pthread_mutex_unlock(&e->lock);
}

const size_t *nvt_engine_done_hint(const nvt_engine *e) {
    return &e->done_hint;
}

void nvt_engine_set_apply(nvt_engine *e, nvt_apply_fn fn, void *ctx) {
    if (e->forked)
        return; /* no worker here; a parent's worker may have held the lock at the fork */
    pthread_rwlock_wrlock(&e->apply_lock);
    e->apply_fn = fn;
    e->apply_ctx = fn ? ctx : NULL;
    __atomic_store_n(&e->apply_on, fn != NULL, __ATOMIC_RELEASE);
    pthread_rwlock_unlock(&e->apply_lock);
}

void nvt_engine_close(nvt_engine *e) {
    if (e->forked)
        return; /* a forked child's copy: no threads to stop, rings closed at the fork */
    pthread_mutex_lock(&e->close_lock);
    if (!e->joined) {
        engine_stop(e);
        e->joined = 1;
    }
    pthread_mutex_unlock(&e->close_lock);
}

void nvt_engine_free(nvt_engine *e) {
    if (e)
        engine_destroy(e);
}
