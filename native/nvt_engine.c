/*
 * nvt_engine: the io_uring I/O engine core (see nvt_engine.h for the thread
 * and lock rules). One native I/O thread owns the ring: it takes ops from the
 * pending queue, hashes write payloads, preps and submits SQEs, reaps CQEs,
 * hashes read payloads, continues short transfers and publishes completions.
 *
 * Each round of the I/O thread: take pending ops (within the queue-depth and
 * byte caps), hash the writes and submit them, hash the reads reaped last
 * round, publish completions, then wait for at least one CQE and reap. Reads
 * are hashed after the ring was refilled so the device never idles while the
 * thread hashes.
 *
 * The I/O thread has a single wait point, io_uring_submit_and_wait(1). To be
 * woken for new ops it keeps a read on an eventfd armed in the ring; a
 * submitter writes the eventfd only when the thread said it may sleep with
 * nothing pending (`sleeping`), so a busy engine costs no wake-up syscalls.
 */
#define _GNU_SOURCE
#include "nvt_engine.h"

#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "nvt_hash.h"

/* user_data of the eventfd read; op SQEs carry their slot index. */
#define NVT_WAKE_TAG UINT64_MAX
/* Largest single SQE of an unregistered transfer (the kernel moves at most
 * ~2 GiB per read/write call); longer ops continue in further SQEs. */
#define NVT_MAX_SQE_BYTES (1ULL << 30)
/* Hash this many write bytes, then submit what is prepped, so the first
 * writes of a large batch reach the device while the rest are hashed. */
#define NVT_SUBMIT_EVERY_BYTES (256ULL << 10)
#define NVT_MAX_QUEUE_DEPTH 32767u
#define NVT_PAGE_BYTES 4096ull

typedef struct {
    nvt_op op;
    uint64_t moved;     /* bytes transferred so far */
    uint64_t checksum;  /* writes: hash of the payload, taken before the first SQE */
} nvt_slot;

/* A read that has left the ring and waits to be hashed. */
typedef struct {
    void *op_id;
    const uint8_t *data;
    uint64_t length;
    uint64_t seed;
} nvt_read_done;

struct nvt_engine {
    /* Immutable after nvt_engine_open returns. */
    uint8_t *buf;
    size_t buf_len;
    int *fds;
    unsigned nfds;
    nvt_config cfg;
    int wake_fd;
    pthread_t thread;
    nvt_engine_info info; /* written by the I/O thread before `ready` */

    pthread_mutex_t lock;
    pthread_cond_t cv; /* completions published, setup finished, thread exited */
    /* Guarded by lock. */
    nvt_op *pend; /* FIFO ring buffer of queued ops; pend_cap is a power of 2 */
    size_t pend_head;
    size_t pend_len;
    size_t pend_cap;
    nvt_completion_batch done;
    int sleeping; /* the I/O thread may block with nothing pending: wake it */
    int closing;  /* submit refuses; the I/O thread drains the ring and exits */
    int ready;    /* ring setup finished, successfully or not */
    int setup_err;
    int exited; /* the I/O thread published its last completion */

    pthread_mutex_t close_lock; /* serializes nvt_engine_close */
    int joined;                 /* guarded by close_lock */

    /* Owned by the I/O thread. */
    struct io_uring ring;
    nvt_slot *slots;       /* queue_depth slots, indexed by SQE user_data */
    unsigned *free_slots;  /* stack of free slot indices */
    unsigned n_free;
    unsigned *taken;       /* slots taken this round, prepped after unlocking */
    nvt_read_done *reads;  /* reads reaped this round (at most queue_depth) */
    unsigned n_reads;
    uint64_t inflight_bytes;
    uint64_t wake_value; /* target of the eventfd read */
    int wake_armed;
    nvt_completion_batch out; /* completions reaped but not yet published */
};

/* ---- small helpers ------------------------------------------------------ */

static int batch_reserve(nvt_completion_batch *b, size_t extra) {
    if (b->len + extra <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra)
        cap *= 2;
    nvt_completion *items = realloc(b->items, cap * sizeof(*items));
    if (!items)
        return -ENOMEM;
    b->items = items;
    b->cap = cap;
    return 0;
}

/* Reserve without failing: completions must never be dropped, so out of
 * memory waits for memory (the only alternative would be losing an op). */
static void batch_reserve_hard(nvt_completion_batch *b, size_t extra) {
    while (batch_reserve(b, extra) != 0)
        usleep(1000);
}

static void batch_push(nvt_completion_batch *b, void *op_id, int64_t result, uint64_t checksum) {
    nvt_completion *c = &b->items[b->len++];
    c->op_id = op_id;
    c->result = result;
    c->checksum = checksum;
}

static int pend_reserve_locked(nvt_engine *e, size_t extra) {
    if (e->pend_len + extra <= e->pend_cap)
        return 0;
    size_t cap = e->pend_cap ? e->pend_cap : 256;
    while (cap < e->pend_len + extra)
        cap *= 2;
    nvt_op *ops = malloc(cap * sizeof(*ops));
    if (!ops)
        return -ENOMEM;
    /* Unwrap the ring into the new array in FIFO order. */
    for (size_t i = 0; i < e->pend_len; i++)
        ops[i] = e->pend[(e->pend_head + i) & (e->pend_cap - 1)];
    free(e->pend);
    e->pend = ops;
    e->pend_head = 0;
    e->pend_cap = cap;
    return 0;
}

static void wake_io_thread(nvt_engine *e) {
    uint64_t one = 1;
    while (write(e->wake_fd, &one, sizeof(one)) < 0 && errno == EINTR)
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
    return 0;
}

/* ---- I/O thread --------------------------------------------------------- */

static struct io_uring_sqe *io_get_sqe(nvt_engine *e) {
    struct io_uring_sqe *sqe;
    /* The SQ holds queue_depth + 1 entries and at most one SQE per slot plus
     * the wake read is ever unsubmitted, so this loop is a safety net. */
    while (!(sqe = io_uring_get_sqe(&e->ring)))
        io_uring_submit(&e->ring);
    return sqe;
}

static void io_arm_wake(nvt_engine *e) {
    struct io_uring_sqe *sqe = io_get_sqe(e);
    io_uring_prep_read(sqe, e->wake_fd, &e->wake_value, sizeof(e->wake_value), 0);
    io_uring_sqe_set_data64(sqe, NVT_WAKE_TAG);
    e->wake_armed = 1;
}

/* Prep the SQE moving the next part of slot `idx` (all of it, unless it
 * crosses a registered-buffer boundary or exceeds one SQE). */
static void io_prep(nvt_engine *e, unsigned idx) {
    nvt_slot *s = &e->slots[idx];
    uint64_t off = (uint64_t)s->op.buf_offset + s->moved;
    uint64_t n = (uint64_t)s->op.length - s->moved;
    uint64_t file_off = (uint64_t)s->op.file_offset + s->moved;
    void *addr = e->buf + off;
    int fd = e->info.fixed_files ? (int)s->op.file_idx : e->fds[s->op.file_idx];
    struct io_uring_sqe *sqe = io_get_sqe(e);

    if (e->info.registered_buffers) {
        uint64_t chunk = e->cfg.register_chunk_bytes;
        uint64_t chunk_end = (off / chunk + 1) * chunk;
        int buf_index = (int)(off / chunk);
        if (n > chunk_end - off)
            n = chunk_end - off;
        if (s->op.kind == NVT_OP_WRITE)
            io_uring_prep_write_fixed(sqe, fd, addr, (unsigned)n, file_off, buf_index);
        else
            io_uring_prep_read_fixed(sqe, fd, addr, (unsigned)n, file_off, buf_index);
    } else {
        if (n > NVT_MAX_SQE_BYTES)
            n = NVT_MAX_SQE_BYTES;
        if (s->op.kind == NVT_OP_WRITE)
            io_uring_prep_write(sqe, fd, addr, (unsigned)n, file_off);
        else
            io_uring_prep_read(sqe, fd, addr, (unsigned)n, file_off);
    }
    if (e->info.fixed_files)
        sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, idx);
}

static void io_finish(nvt_engine *e, unsigned idx, int64_t result, uint64_t checksum) {
    nvt_slot *s = &e->slots[idx];
    batch_reserve_hard(&e->out, 1);
    batch_push(&e->out, s->op.op_id, result, checksum);
    e->inflight_bytes -= (uint64_t)s->op.length;
    e->free_slots[e->n_free++] = idx;
}

static void io_on_cqe(nvt_engine *e, unsigned idx, int res) {
    nvt_slot *s = &e->slots[idx];
    uint64_t length = (uint64_t)s->op.length;

    if (res > 0) {
        s->moved += (uint64_t)res;
        if (s->moved < length) {
            /* Short transfer (or a capped SQE): continue with the rest. A
             * retry that moves nothing or fails ends the op with -EIO. */
            io_prep(e, idx);
            return;
        }
        if (s->op.kind == NVT_OP_READ && s->op.checksum) {
            /* Hashed next round, after the ring was refilled; the slot is free
             * now (the caller owns the buffer range until the completion). */
            nvt_read_done *r = &e->reads[e->n_reads++];
            r->op_id = s->op.op_id;
            r->data = e->buf + s->op.buf_offset;
            r->length = length;
            r->seed = s->op.seed;
            e->inflight_bytes -= length;
            e->free_slots[e->n_free++] = idx;
            return;
        }
        io_finish(e, idx, (int64_t)length, s->checksum);
        return;
    }
    /* res == 0: end of file or no space, nothing moved. An error after some
     * bytes moved is a short transfer, which every engine reports as -EIO. */
    io_finish(e, idx, (res == 0 || s->moved > 0) ? -EIO : res, 0);
}

/* Hand reaped completions to waiters. Called with e->lock held. */
static void io_publish_locked(nvt_engine *e) {
    if (!e->out.len)
        return;
    if (!e->done.len) {
        nvt_completion_batch t = e->done;
        e->done = e->out;
        e->out = t;
    } else {
        batch_reserve_hard(&e->done, e->out.len);
        memcpy(e->done.items + e->done.len, e->out.items, e->out.len * sizeof(*e->out.items));
        e->done.len += e->out.len;
    }
    e->out.len = 0;
    pthread_cond_broadcast(&e->cv);
}

static int io_setup(nvt_engine *e) {
    /* Best first: the ring is private to this thread, so completion work can
     * wait until it asks (DEFER_TASKRUN); then cooperative task work; then
     * whatever the kernel has. */
    static const unsigned flag_sets[] = {
        IORING_SETUP_SUBMIT_ALL | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
        IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
        0,
    };
    int ret = -EINVAL;
    for (size_t i = 0; i < sizeof(flag_sets) / sizeof(flag_sets[0]); i++) {
        struct io_uring_params p;
        memset(&p, 0, sizeof(p));
        p.flags = flag_sets[i];
        ret = io_uring_queue_init_params(e->cfg.queue_depth + 1, &e->ring, &p);
        if (ret == 0) {
            e->info.setup_flags = flag_sets[i];
            e->info.ring_entries = p.sq_entries;
            break;
        }
        if (ret != -EINVAL)
            return ret;
    }
    if (ret < 0)
        return ret;

    if (e->cfg.register_buffers && e->buf_len > 0) {
        uint64_t chunk = e->cfg.register_chunk_bytes;
        size_t n = (e->buf_len + chunk - 1) / chunk;
        struct iovec *iov = calloc(n, sizeof(*iov));
        if (!iov) {
            e->info.buffers_errno = ENOMEM;
        } else {
            for (size_t i = 0; i < n; i++) {
                uint64_t start = (uint64_t)i * chunk;
                uint64_t left = e->buf_len - start;
                iov[i].iov_base = e->buf + start;
                iov[i].iov_len = left < chunk ? left : chunk;
            }
            ret = io_uring_register_buffers(&e->ring, iov, (unsigned)n);
            free(iov);
            if (ret == 0)
                e->info.registered_buffers = 1;
            else
                e->info.buffers_errno = -ret;
        }
    }
    if (e->cfg.fixed_files && e->nfds > 0) {
        ret = io_uring_register_files(&e->ring, e->fds, e->nfds);
        if (ret == 0)
            e->info.fixed_files = 1;
        else
            e->info.files_errno = -ret;
    }
    return 0;
}

static void io_run(nvt_engine *e) {
    unsigned qd = e->cfg.queue_depth;

    io_arm_wake(e);
    for (;;) {
        unsigned n_taken = 0;
        int stop;

        pthread_mutex_lock(&e->lock);
        io_publish_locked(e);
        while (e->pend_len && e->n_free) {
            nvt_op *op = &e->pend[e->pend_head];
            /* One op larger than the cap still runs, alone. */
            if (e->inflight_bytes && e->inflight_bytes + (uint64_t)op->length > e->cfg.max_inflight_bytes)
                break;
            unsigned idx = e->free_slots[--e->n_free];
            e->slots[idx].op = *op;
            e->slots[idx].moved = 0;
            e->slots[idx].checksum = 0;
            e->inflight_bytes += (uint64_t)op->length;
            e->taken[n_taken++] = idx;
            e->pend_head = (e->pend_head + 1) & (e->pend_cap - 1);
            e->pend_len--;
        }
        stop = e->closing;
        /* While ops are in flight (or still pending) a completion wakes us
         * soon and we take new ops then, so a submitter need not pay for a
         * wake-up (an eventfd write that costs vLLM's thread several us).
         * Only an idle engine, with nothing in flight, needs the eventfd. */
        e->sleeping = !stop && e->pend_len == 0 && e->n_free == qd;
        pthread_mutex_unlock(&e->lock);

        uint64_t hashed = 0;
        for (unsigned i = 0; i < n_taken; i++) {
            nvt_slot *s = &e->slots[e->taken[i]];
            if (s->op.kind == NVT_OP_WRITE && s->op.checksum) {
                s->checksum = nvt_xxh3(e->buf + s->op.buf_offset, (size_t)s->op.length, s->op.seed);
                hashed += (uint64_t)s->op.length;
                if (hashed >= NVT_SUBMIT_EVERY_BYTES && i + 1 < n_taken) {
                    io_uring_submit(&e->ring);
                    hashed = 0;
                }
            }
            io_prep(e, e->taken[i]);
        }

        if (e->n_reads) {
            if (io_uring_sq_ready(&e->ring))
                io_uring_submit(&e->ring);
            batch_reserve_hard(&e->out, e->n_reads);
            for (unsigned i = 0; i < e->n_reads; i++) {
                nvt_read_done *r = &e->reads[i];
                batch_push(&e->out, r->op_id, (int64_t)r->length, nvt_xxh3(r->data, r->length, r->seed));
            }
            e->n_reads = 0;
            pthread_mutex_lock(&e->lock);
            io_publish_locked(e);
            pthread_mutex_unlock(&e->lock);
        }

        if (stop && e->n_free == qd)
            break; /* closing, and nothing left in the ring */

        int ret = io_uring_submit_and_wait(&e->ring, 1);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME) {
            /* Not expected with a ring this thread sized itself; back off
             * rather than spin, and keep reaping what completes. */
            usleep(1000);
        }

        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&e->ring, head, cqe) {
            uint64_t tag = io_uring_cqe_get_data64(cqe);
            seen++;
            if (tag == NVT_WAKE_TAG)
                e->wake_armed = 0;
            else
                io_on_cqe(e, (unsigned)tag, cqe->res);
        }
        io_uring_cq_advance(&e->ring, seen);
        if (!e->wake_armed && !stop)
            io_arm_wake(e);
    }
}

static void *io_main(void *arg) {
    nvt_engine *e = arg;
    pthread_setname_np(pthread_self(), "nvmetier-uring");
    int err = io_setup(e);

    pthread_mutex_lock(&e->lock);
    e->setup_err = err;
    e->ready = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    if (err)
        return NULL;

    io_run(e);
    /* Exiting the ring cancels the wake read and unregisters buffers/files. */
    io_uring_queue_exit(&e->ring);

    pthread_mutex_lock(&e->lock);
    io_publish_locked(e);
    e->exited = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

/* ---- public API --------------------------------------------------------- */

static void engine_destroy(nvt_engine *e) {
    if (e->wake_fd >= 0)
        close(e->wake_fd);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->close_lock);
    pthread_cond_destroy(&e->cv);
    free(e->fds);
    free(e->slots);
    free(e->free_slots);
    free(e->taken);
    free(e->reads);
    free(e->pend);
    free(e->done.items);
    free(e->out.items);
    free(e);
}

int nvt_engine_open(nvt_engine **out, void *buf, size_t buf_len, const int *fds,
                    unsigned nfds, const nvt_config *cfg) {
    if (cfg->queue_depth < 1 || cfg->queue_depth > NVT_MAX_QUEUE_DEPTH || cfg->max_inflight_bytes == 0 ||
        cfg->register_chunk_bytes < NVT_PAGE_BYTES ||
        cfg->register_chunk_bytes > NVT_MAX_REGISTER_CHUNK_BYTES ||
        cfg->register_chunk_bytes % NVT_PAGE_BYTES != 0)
        return -EINVAL;

    nvt_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->buf = buf;
    e->buf_len = buf_len;
    e->nfds = nfds;
    e->cfg = *cfg;
    e->wake_fd = -1;
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->close_lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);

    unsigned qd = cfg->queue_depth;
    e->fds = malloc((nfds ? nfds : 1) * sizeof(int));
    e->slots = calloc(qd, sizeof(*e->slots));
    e->free_slots = malloc(qd * sizeof(unsigned));
    e->taken = malloc(qd * sizeof(unsigned));
    e->reads = malloc(qd * sizeof(*e->reads));
    if (!e->fds || !e->slots || !e->free_slots || !e->taken || !e->reads || batch_reserve(&e->out, 2 * (size_t)qd + 2)) {
        engine_destroy(e);
        return -ENOMEM;
    }
    if (nfds)
        memcpy(e->fds, fds, nfds * sizeof(int));
    for (unsigned i = 0; i < qd; i++)
        e->free_slots[i] = qd - 1 - i;
    e->n_free = qd;

    /* Blocking eventfd on purpose: io_uring completes a read of an O_NONBLOCK
     * file with -EAGAIN instead of waiting for it to become readable. */
    e->wake_fd = eventfd(0, EFD_CLOEXEC);
    if (e->wake_fd < 0) {
        int err = -errno;
        engine_destroy(e);
        return err;
    }

    /* The I/O thread blocks every signal: they belong to the application's
     * threads (Python handles them on its main thread). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int ret = pthread_create(&e->thread, NULL, io_main, e);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (ret != 0) {
        engine_destroy(e);
        return -ret;
    }

    pthread_mutex_lock(&e->lock);
    while (!e->ready)
        pthread_cond_wait(&e->cv, &e->lock);
    ret = e->setup_err;
    pthread_mutex_unlock(&e->lock);
    if (ret != 0) {
        pthread_join(e->thread, NULL);
        engine_destroy(e);
        return ret;
    }
    *out = e;
    return 0;
}

void nvt_engine_get_info(const nvt_engine *e, nvt_engine_info *info) {
    *info = e->info;
}

int nvt_engine_submit(nvt_engine *e, const nvt_op *ops, size_t n) {
    int wake = 0;
    size_t queued = 0, immediate = 0;

    pthread_mutex_lock(&e->lock);
    if (e->closing) {
        pthread_mutex_unlock(&e->lock);
        return -ESHUTDOWN;
    }
    /* Reserve first so that an op is either queued or refused with the whole
     * call, never half-submitted. */
    if (pend_reserve_locked(e, n) != 0 || batch_reserve(&e->done, n) != 0) {
        pthread_mutex_unlock(&e->lock);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        int err = validate_op(e, &ops[i]);
        if (err != 0) {
            batch_push(&e->done, ops[i].op_id, err, 0);
            immediate++;
        } else if (ops[i].length == 0) {
            batch_push(&e->done, ops[i].op_id, 0, ops[i].checksum ? nvt_xxh3(NULL, 0, ops[i].seed) : 0);
            immediate++;
        } else {
            e->pend[(e->pend_head + e->pend_len) & (e->pend_cap - 1)] = ops[i];
            e->pend_len++;
            queued++;
        }
    }
    if (immediate)
        pthread_cond_broadcast(&e->cv);
    if (queued && e->sleeping) {
        e->sleeping = 0;
        wake = 1;
    }
    pthread_mutex_unlock(&e->lock);
    if (wake)
        wake_io_thread(e);
    return 0;
}

void nvt_engine_wait(nvt_engine *e, double timeout_s, nvt_completion_batch *batch) {
    /* A poll that finds nothing skips the mutex the I/O thread keeps taking:
     * done.len is read racily as a hint; a completion it misses is found by
     * the next poll (the store is polled at every engine step). */
    if (timeout_s <= 0 && !__atomic_load_n(&e->done.len, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&e->lock);
    if (!e->done.len && !e->exited && timeout_s > 0) {
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
        while (!e->done.len && !e->exited) {
            if (pthread_cond_timedwait(&e->cv, &e->lock, &deadline) == ETIMEDOUT)
                break;
        }
    }
    if (e->done.len) {
        nvt_completion_batch t = e->done;
        e->done = *batch;
        e->done.len = 0;
        *batch = t;
    }
    pthread_mutex_unlock(&e->lock);
}

void nvt_engine_close(nvt_engine *e) {
    pthread_mutex_lock(&e->close_lock);
    if (!e->joined) {
        pthread_mutex_lock(&e->lock);
        e->closing = 1;
        /* Queued ops never reached the ring: cancel them. */
        batch_reserve_hard(&e->done, e->pend_len);
        for (size_t i = 0; i < e->pend_len; i++)
            batch_push(&e->done, e->pend[(e->pend_head + i) & (e->pend_cap - 1)].op_id, -ECANCELED, 0);
        e->pend_len = 0;
        pthread_cond_broadcast(&e->cv);
        pthread_mutex_unlock(&e->lock);
        /* Unconditionally: the thread may be waiting on the ring. */
        wake_io_thread(e);
        pthread_join(e->thread, NULL);
        close(e->wake_fd);
        e->wake_fd = -1;
        e->joined = 1;
    }
    pthread_mutex_unlock(&e->close_lock);
}

void nvt_engine_free(nvt_engine *e) {
    if (e)
        engine_destroy(e);
}

int nvt_probe(const char **stage) {
    struct io_uring ring;
    struct io_uring_cqe *cqe;
    int ret = io_uring_queue_init(2, &ring, 0);
    if (ret < 0) {
        *stage = "io_uring_setup";
        return ret;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
    io_uring_prep_nop(sqe);
    ret = io_uring_submit_and_wait(&ring, 1);
    if (ret < 0) {
        *stage = "io_uring_enter";
        io_uring_queue_exit(&ring);
        return ret;
    }
    ret = io_uring_peek_cqe(&ring, &cqe);
    if (ret == 0) {
        ret = cqe->res < 0 ? cqe->res : 0;
        io_uring_cqe_seen(&ring, cqe);
    }
    io_uring_queue_exit(&ring);
    if (ret < 0)
        *stage = "IORING_OP_NOP";
    return ret;
}
