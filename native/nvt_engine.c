/*
 * nvt_engine: the io_uring I/O engine core (see nvt_engine.h for the thread
 * and lock rules). Each worker's native I/O thread owns its ring: it takes ops
 * from its pending queue, hashes write payloads, preps and submits SQEs, reaps
 * CQEs, hashes read payloads, continues short transfers and publishes
 * completions to the engine's one done queue. nvt_engine_submit routes each
 * op to a worker of its file (see nvt_engine.h).
 *
 * Each round of an I/O thread: take pending ops (within the queue-depth and
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "nvt_crypto.h"
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
/* Sealing engines: writes taken (and sealed) per round of the I/O thread. */
#define NVT_SEAL_BATCH 2u
/* A ring whose io_uring_enter fails this many times in a row (1 ms apart)
 * with an error that is not transient is declared failed. */
#define NVT_RING_FAIL_TRIES 100
/* An error that is normally transient (EAGAIN: no memory for requests,
 * EBUSY, EINTR, ETIME) that keeps coming with nothing completing is no
 * progress either: the thread backs off 1 ms from the second in a row (no
 * busy spin), and after this many in a row with no completion reaped the
 * ring is declared failed, so its ops fail and close() returns. */
#define NVT_RING_TRANSIENT_TRIES 1000
/* Once close began, a failed ring waits this long at most for the ops the
 * kernel took to come back; then they fail and the thread exits anyway (its
 * ring's teardown cancels them in the kernel), so close() always returns. */
#define NVT_STOP_GRACE_MS 5000
/* The staging arena is handed out in spans of this many bytes; it is mapped
 * 2 MiB-aligned so that each transparent huge page is one whole piece. */
#define NVT_STAGE_UNIT_BYTES (64ULL << 10)
#define NVT_HUGE_PAGE_BYTES (2ULL << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* liburing 2.3 predates buffer cloning: the opcode and argument of
 * IORING_REGISTER_CLONE_BUFFERS (kernel 6.12+), called by raw syscall. */
#define NVT_REGISTER_CLONE_BUFFERS 30
struct nvt_clone_buffers {
    uint32_t src_fd;
    uint32_t flags;
    uint32_t src_off; /* 6.13+; 0 (and nr 0): every buffer, on 6.12 too */
    uint32_t dst_off;
    uint32_t nr;
    uint32_t pad[3];
};

typedef struct {
    nvt_op op;
    uint64_t moved;     /* bytes transferred so far */
    uint64_t checksum;  /* writes: hash of the payload (sealed: the tag's head), taken before the first SQE */
    uint8_t *stage;     /* the op's span of the staging arena, or NULL: moves directly (always when sealed) */
    uint32_t stage_first, stage_units;
    /* Sealing engines only: the sealed slot of a write (slot_bytes, page
     * aligned, allocated at the slot's first write) and the trailer page of
     * a read (slot_bytes - row_bytes); both kept for the slot's life. */
    uint8_t *bounce;
    uint8_t *trail;
    struct iovec iov[2]; /* a sealed read's readv: the row, then the trailer */
} nvt_slot;

/* A read that has left the ring and waits to be hashed. */
typedef struct {
    void *op_id;
    uint8_t *data;
    uint64_t length;
    uint64_t seed;
    uint8_t *dst;       /* staged: where the bytes go in the buffer (NULL: data is there) */
    uint32_t stage_first, stage_units;
    int sealed;                           /* open `data` in place with `trailer` */
    uint8_t trailer[NVT_TRAILER_BYTES];   /* copied: the slot's page is reused at once */
} nvt_read_done;

typedef struct nvt_worker {
    /* Immutable after nvt_engine_open returns. */
    nvt_engine *e;
    unsigned idx;
    unsigned qd;
    uint64_t max_inflight_bytes;
    int wake_fd;
    pthread_t thread;
    int started;
    nvt_engine_info info; /* written by the I/O thread before `ready` */

    pthread_mutex_t lock;
    /* Guarded by lock. */
    nvt_op *pend; /* FIFO ring buffer of queued ops; pend_cap is a power of 2 */
    size_t pend_head;
    size_t pend_len;
    size_t pend_cap;
    int sleeping; /* the I/O thread may block with nothing pending: wake it */
    int closing;  /* the I/O thread drains the ring and exits */
    int failed;   /* errno the ring failed with: taken ops fail with it */

    /* Owned by the I/O thread (failed_hint and the stats are also read racily). */
    struct io_uring ring;
    nvt_slot *slots;       /* qd slots, indexed by SQE user_data */
    unsigned *free_slots;  /* stack of free slot indices */
    unsigned n_free;
    unsigned *taken;       /* slots taken this round, prepped after unlocking */
    nvt_read_done *reads;  /* reads reaped this round (at most qd) */
    unsigned n_reads;
    uint64_t inflight_bytes;
    uint64_t wake_value; /* target of the eventfd read */
    int wake_armed;
    int enter_errors; /* consecutive non-transient io_uring_enter failures */
    int enter_stalls; /* consecutive transient failures with nothing reaped */
    int sq_abandoned; /* failed: the SQEs the kernel never took were failed */
    uint64_t stop_ms; /* failed and closing: when the thread first saw both */
    /* Tests only (nvt_engine_inject_enter_error): every io_uring_enter of the
     * thread fails with this errno instead of being made (0: none). Atomic. */
    int inject_enter_err;
    /* The ring's fd, for a forked child to close (-1: none). Written under
     * engines_lock, so a fork sees it either set or not yet created. */
    int ring_fd_fork;
    nvt_completion_batch out; /* completions reaped but not yet published */
    uint64_t n_ops, n_bytes, n_hashed; /* atomics: stats */
    int failed_hint; /* atomic copy of `failed` for routing without the lock */
    /* The staging arena (see nvt_config.staging_bytes), owned by the I/O
     * thread: mapped in io_setup, unmapped by worker_destroy. */
    void *stage_map;
    size_t stage_map_len;
    uint8_t *stage;        /* 2 MiB-aligned start */
    uint32_t stage_units;  /* spans of NVT_STAGE_UNIT_BYTES */
    uint8_t *stage_used;   /* per unit: 1 while an op holds it */
    uint32_t stage_hint;   /* where the next first-fit search starts */
    uint64_t n_staged;     /* atomic: bytes of ops that moved through the arena */
} nvt_worker;

struct nvt_engine {
    /* Immutable after nvt_engine_open returns. */
    uint8_t *buf;
    size_t buf_len;
    int *fds;
    unsigned nfds;
    nvt_config cfg;
    unsigned n_workers;
    nvt_worker *workers;
    /* Set up by nvt_engine_open when several workers register the buffer:
     * a plain ring (no single issuer, so any thread may clone from it) that
     * registers the buffer once; every worker clones its table, and it is
     * closed once they have (cloned buffers hold their own references). */
    struct io_uring src_ring;
    int src_ring_ok;   /* src_ring exists and holds the registered buffer */
    int src_errno;     /* why its registration failed */

    pthread_mutex_t lock;
    pthread_cond_t cv; /* completions published, setup finished, a thread exited */
    /* Guarded by lock. */
    unsigned *rr; /* per file: ops routed so far (rotation over its workers) */
    nvt_completion_batch done;
    int closing; /* submit refuses */
    unsigned n_exited; /* I/O threads that published their last completion */
    int setup_done;    /* setup of the worker being started finished */

    pthread_mutex_t close_lock; /* serializes nvt_engine_close */
    int joined;                 /* guarded by close_lock */

    /* Every open engine (engines_lock), for the fork handler; src_ring's fd
     * for a child to close (-1: none); `forked`: this is a forked child's
     * copy, whose threads do not exist (set in the child before any call). */
    struct nvt_engine *next_engine;
    int src_ring_fd_fork;
    int forked;

    /* Sealing (cfg.seal copied here; sealed: 0 when none). */
    int sealed;
    nvt_seal_config seal;
    pthread_mutex_t nonce_lock;
    uint64_t nonce_next, nonce_end;   /* current range; guarded by nonce_lock */
    uint64_t spare_start, spare_n;    /* next range (spare_n 0: free) */
    uint64_t auth_failures;           /* atomic */
};

/* ---- fork --------------------------------------------------------------- */
/* A child forked without exec inherits every ring fd (and, in the child's
 * copy of each engine, I/O threads that do not exist there). A ring's
 * registered files hold the store's data files and lock open, so a child
 * that kept a ring would keep its parent's sharer lock alive after the
 * parent died. Rings are mapped MADV_DONTFORK (io_uring_ring_dontfork), and
 * the child closes every inherited ring and wake fd at once: it drops only
 * its own references, so the parent's rings are untouched. The child's copy
 * of an engine then refuses submits, returns nothing from waits and closes
 * at once (never joining threads that are not there). */
static pthread_mutex_t engines_lock = PTHREAD_MUTEX_INITIALIZER;
static nvt_engine *engines;
static pthread_once_t engines_atfork_once = PTHREAD_ONCE_INIT;

static void engines_prepare(void) { pthread_mutex_lock(&engines_lock); }

static void engines_parent(void) { pthread_mutex_unlock(&engines_lock); }

static void engines_child(void) {
    for (nvt_engine *e = engines; e; e = e->next_engine) {
        e->forked = 1;
        for (unsigned i = 0; i < e->n_workers; i++) {
            nvt_worker *w = &e->workers[i];
            if (w->ring_fd_fork >= 0)
                close(w->ring_fd_fork);
            w->ring_fd_fork = -1;
            if (w->wake_fd >= 0)
                close(w->wake_fd);
            w->wake_fd = -1;
            w->started = 0;
        }
        if (e->src_ring_fd_fork >= 0)
            close(e->src_ring_fd_fork);
        e->src_ring_fd_fork = -1;
    }
    pthread_mutex_unlock(&engines_lock); /* taken by engines_prepare in this thread */
}

static void engines_atfork_install(void) {
    pthread_atfork(engines_prepare, engines_parent, engines_child);
}

static void engines_add(nvt_engine *e) {
    pthread_once(&engines_atfork_once, engines_atfork_install);
    pthread_mutex_lock(&engines_lock);
    e->next_engine = engines;
    engines = e;
    pthread_mutex_unlock(&engines_lock);
}

static void engines_remove(nvt_engine *e) {
    pthread_mutex_lock(&engines_lock);
    for (nvt_engine **p = &engines; *p; p = &(*p)->next_engine) {
        if (*p == e) {
            *p = e->next_engine;
            break;
        }
    }
    pthread_mutex_unlock(&engines_lock);
}

/* Create a ring that a forked child will not map, its fd recorded for the
 * child to close (under engines_lock: no fork in between). */
static int ring_create(struct io_uring *ring, unsigned entries, struct io_uring_params *p, int *fd_fork) {
    pthread_mutex_lock(&engines_lock);
    int ret = io_uring_queue_init_params(entries, ring, p);
    if (ret == 0) {
        io_uring_ring_dontfork(ring);
        *fd_fork = ring->ring_fd;
    }
    pthread_mutex_unlock(&engines_lock);
    return ret;
}

/* Close a ring made by ring_create (under engines_lock: a fork sees the
 * ring either recorded or closed, never open and forgotten). */
static void ring_destroy(struct io_uring *ring, int *fd_fork) {
    pthread_mutex_lock(&engines_lock);
    *fd_fork = -1;
    io_uring_queue_exit(ring);
    pthread_mutex_unlock(&engines_lock);
}

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

/* ---- I/O thread --------------------------------------------------------- */

/* io_uring_submit, or the tests' injected failure (nvt_engine_inject_enter_error). */
static int io_submit(nvt_worker *w) {
    int inj = __atomic_load_n(&w->inject_enter_err, __ATOMIC_RELAXED);
    return inj ? -inj : io_uring_submit(&w->ring);
}

static struct io_uring_sqe *io_get_sqe(nvt_worker *w) {
    struct io_uring_sqe *sqe;
    /* The SQ holds qd + 1 entries and at most one SQE per slot plus the wake
     * read is ever unsubmitted, so this loop is a safety net. */
    while (!(sqe = io_uring_get_sqe(&w->ring))) {
        if (io_submit(w) < 0)
            usleep(1000);
    }
    return sqe;
}

static void io_arm_wake(nvt_worker *w) {
    struct io_uring_sqe *sqe = io_get_sqe(w);
    io_uring_prep_read(sqe, w->wake_fd, &w->wake_value, sizeof(w->wake_value), 0);
    io_uring_sqe_set_data64(sqe, NVT_WAKE_TAG);
    w->wake_armed = 1;
}

/* Map the staging arena: private memory advised for huge pages (refused
 * where THP is off: the arena still works, in whatever pieces it gets), and
 * faulted in now so the first ops do not pay for it. */
static int stage_open(nvt_worker *w, uint64_t bytes) {
    uint64_t len = (bytes + NVT_HUGE_PAGE_BYTES - 1) / NVT_HUGE_PAGE_BYTES * NVT_HUGE_PAGE_BYTES;
    if (len / NVT_STAGE_UNIT_BYTES > UINT32_MAX)
        return -EINVAL;
    size_t map_len = (size_t)(len + NVT_HUGE_PAGE_BYTES);
    void *m = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return -errno;
    uint8_t *base = (uint8_t *)(((uintptr_t)m + NVT_HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(NVT_HUGE_PAGE_BYTES - 1));
    uint32_t units = (uint32_t)(len / NVT_STAGE_UNIT_BYTES);
    uint8_t *used = calloc(units, 1);
    if (!used) {
        munmap(m, map_len);
        return -ENOMEM;
    }
    (void)madvise(base, (size_t)len, MADV_HUGEPAGE);
    if (madvise(base, (size_t)len, MADV_POPULATE_WRITE) != 0)
        memset(base, 0, (size_t)len);
    w->stage_map = m;
    w->stage_map_len = map_len;
    w->stage = base;
    w->stage_units = units;
    w->stage_used = used;
    w->info.staging_bytes = len;
    w->info.staging_addr = (uint64_t)(uintptr_t)base;
    return 0;
}

/* Give slot `s` a span of `bytes` of the arena for its op (first fit from a
 * rotating start), or leave it direct when none is free. I/O thread only. */
static void stage_take(nvt_worker *w, nvt_slot *s, uint64_t bytes) {
    s->stage = NULL;
    if (!w->stage_units || bytes == 0)
        return;
    uint64_t need64 = (bytes + NVT_STAGE_UNIT_BYTES - 1) / NVT_STAGE_UNIT_BYTES;
    if (need64 > w->stage_units)
        return;
    uint32_t need = (uint32_t)need64, n = w->stage_units;
    uint32_t start = w->stage_hint + need <= n ? w->stage_hint : 0;
    for (int pass = 0; pass < 2; pass++) {
        uint32_t run = 0;
        uint32_t lo = pass ? 0 : start, hi = pass ? start + need - 1 : n;
        if (hi > n)
            hi = n;
        for (uint32_t i = lo; i < hi; i++) {
            if (w->stage_used[i]) {
                run = 0;
                continue;
            }
            if (++run == need) {
                uint32_t first = i + 1 - need;
                memset(w->stage_used + first, 1, need);
                w->stage_hint = i + 1 < n ? i + 1 : 0;
                s->stage = w->stage + (uint64_t)first * NVT_STAGE_UNIT_BYTES;
                s->stage_first = first;
                s->stage_units = need;
                __atomic_fetch_add(&w->n_staged, (uint64_t)s->op.length, __ATOMIC_RELAXED);
                return;
            }
        }
    }
}

static void stage_give(nvt_worker *w, uint32_t first, uint32_t units) {
    memset(w->stage_used + first, 0, units);
}

/* ---- sealing (nvt_seal_config) ----------------------------------------- */

static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* The next nonce (prefix, counter; LE), or -EAGAIN when none is left. */
static int nonce_take(nvt_engine *e, uint8_t nonce[NVT_GCM_NONCE_BYTES]) {
    uint64_t ctr;
    pthread_mutex_lock(&e->nonce_lock);
    if (e->nonce_next == e->nonce_end && e->spare_n) {
        e->nonce_next = e->spare_start;
        e->nonce_end = e->spare_start + e->spare_n;
        e->spare_n = 0;
    }
    if (e->nonce_next == e->nonce_end) {
        pthread_mutex_unlock(&e->nonce_lock);
        return -EAGAIN;
    }
    ctr = e->nonce_next++;
    pthread_mutex_unlock(&e->nonce_lock);
    put_le(nonce, e->seal.nonce_prefix, 4);
    put_le(nonce + 4, ctr, 8);
    return 0;
}

/* A chunk's authenticated data: its seed (the key's fingerprint in the
 * table) and the layout digest (sealed.py's chunk_aad). */
static void seal_aad(const nvt_engine *e, uint64_t seed, uint8_t aad[16]) {
    put_le(aad, seed, 8);
    put_le(aad + 8, e->seal.layout_digest, 8);
}

/* Trailer layout (sealed.py's _TRAILER): magic, version, nonce, tag, key fingerprint. */
#define TRL_VERSION 4
#define TRL_NONCE 8
#define TRL_TAG 20
#define TRL_FINGERPRINT 36

/* Where a sealed op's slot image is: its span of the staging arena (huge
 * pages: the device moves it in a few large pieces), else its bounce buffer
 * (write) / the row and trailer page (read). */
static uint8_t *seal_out(nvt_slot *s) {
    return s->stage ? s->stage : s->bounce;
}

/* Seal a write's row into its slot image (arena span or bounce buffer),
 * trailer included (the row is only read). 0 or -errno; the op then fails
 * with it. */
static int seal_write(nvt_engine *e, nvt_slot *s) {
    uint64_t row = e->seal.row_bytes, slot = e->seal.slot_bytes;
    uint8_t nonce[NVT_GCM_NONCE_BYTES], aad[16], tag[NVT_GCM_TAG_BYTES];
    if (!s->stage && !s->bounce) {
        void *p = NULL;
        if (posix_memalign(&p, NVT_PAGE_BYTES, (size_t)slot) != 0)
            return -ENOMEM;
        s->bounce = p;
    }
    int err = nonce_take(e, nonce);
    if (err)
        return err;
    seal_aad(e, (uint64_t)s->op.seed, aad);
    uint8_t *out = seal_out(s);
    if (nvt_gcm_seal(e->seal.key, nonce, aad, sizeof(aad), e->buf + s->op.buf_offset, out, (size_t)row, tag) != 0)
        return -EIO;
    uint8_t *t = out + row;
    memset(t, 0, (size_t)(slot - row));
    memcpy(t, "NVTS", 4);
    put_le(t + TRL_VERSION, 1, 4);
    memcpy(t + TRL_NONCE, nonce, sizeof(nonce));
    memcpy(t + TRL_TAG, tag, sizeof(tag));
    memcpy(t + TRL_FINGERPRINT, e->seal.fingerprint, sizeof(e->seal.fingerprint));
    s->checksum = get_le64(tag);
    return 0;
}

/* A read's trailer page (allocated at the slot's first read). 0 or -ENOMEM. */
static int seal_read_ready(nvt_engine *e, nvt_slot *s) {
    if (!s->trail) {
        size_t n = (size_t)((e->seal.slot_bytes - e->seal.row_bytes + NVT_PAGE_BYTES - 1) & ~(NVT_PAGE_BYTES - 1));
        void *p = NULL;
        if (posix_memalign(&p, NVT_PAGE_BYTES, n) != 0)
            return -ENOMEM;
        s->trail = p;
    }
    return 0;
}

/* Open a sealed read into its row (from its arena span, or in place): its
 * length, with the tag's head as checksum, or -EBADMSG when the trailer or
 * the tag does not verify (the row then holds garbage the table never
 * serves). */
static int64_t seal_open(nvt_engine *e, nvt_read_done *r, uint64_t *checksum) {
    const uint8_t *t = r->trailer;
    uint8_t aad[16];
    *checksum = 0;
    if (memcmp(t, "NVTS", 4) != 0 || get_le64(t + TRL_VERSION) % (1ull << 32) != 1) {
        __atomic_fetch_add(&e->auth_failures, 1, __ATOMIC_RELAXED);
        return -EBADMSG;
    }
    seal_aad(e, r->seed, aad);
    /* From the arena into the row (no copy), or in place in the row. */
    uint8_t *out = r->dst ? r->dst : r->data;
    int rc = nvt_gcm_open(e->seal.key, t + TRL_NONCE, aad, sizeof(aad), r->data, out, (size_t)r->length,
                          t + TRL_TAG);
    if (rc == 0) {
        *checksum = get_le64(t + TRL_TAG);
        return (int64_t)r->length;
    }
    if (rc == 1)
        __atomic_fetch_add(&e->auth_failures, 1, __ATOMIC_RELAXED);
    return rc == 1 ? -EBADMSG : -EIO;
}

int nvt_engine_add_nonces(nvt_engine *e, uint64_t start, uint64_t n) {
    int ret = 0;
    if (!e->sealed || n == 0 || start + n < start)
        return -EINVAL;
    pthread_mutex_lock(&e->nonce_lock);
    if (e->nonce_next == e->nonce_end) {
        e->nonce_next = start;
        e->nonce_end = start + n;
    } else if (!e->spare_n) {
        e->spare_start = start;
        e->spare_n = n;
    } else {
        ret = -EBUSY;
    }
    pthread_mutex_unlock(&e->nonce_lock);
    return ret;
}

uint64_t nvt_engine_nonces_left(nvt_engine *e, int *spare_free) {
    uint64_t left;
    pthread_mutex_lock(&e->nonce_lock);
    left = e->nonce_end - e->nonce_next + e->spare_n;
    *spare_free = e->sealed && e->spare_n == 0;
    pthread_mutex_unlock(&e->nonce_lock);
    return left;
}

uint64_t nvt_engine_auth_failures(const nvt_engine *e) {
    return __atomic_load_n(&e->auth_failures, __ATOMIC_RELAXED);
}

/* Prep the SQE moving the next part of slot `idx` (all of it, unless it
 * crosses a registered-buffer boundary or exceeds one SQE). */
static void io_prep(nvt_worker *w, unsigned idx) {
    nvt_engine *e = w->e;
    nvt_slot *s = &w->slots[idx];
    uint64_t off = (uint64_t)s->op.buf_offset + s->moved;
    uint64_t n = (uint64_t)s->op.length - s->moved;
    uint64_t file_off = (uint64_t)s->op.file_offset + s->moved;
    void *addr = e->buf + off;
    int fd = w->info.fixed_files ? (int)s->op.file_idx : e->fds[s->op.file_idx];
    struct io_uring_sqe *sqe = io_get_sqe(w);

    if (e->sealed) {
        /* The sealed slot: from its image (write), into its arena span or
         * else the row and the trailer page (readv); `moved` counts slot
         * bytes. */
        uint64_t slot = e->seal.slot_bytes, row = e->seal.row_bytes;
        file_off = (uint64_t)s->op.file_offset + s->moved;
        if (s->op.kind == NVT_OP_WRITE) {
            io_uring_prep_write(sqe, fd, seal_out(s) + s->moved, (unsigned)(slot - s->moved), file_off);
        } else if (s->stage) {
            io_uring_prep_read(sqe, fd, s->stage + s->moved, (unsigned)(slot - s->moved), file_off);
        } else {
            unsigned nv = 0;
            if (s->moved < row) {
                s->iov[nv].iov_base = e->buf + s->op.buf_offset + s->moved;
                s->iov[nv++].iov_len = (size_t)(row - s->moved);
                s->iov[nv].iov_base = s->trail;
                s->iov[nv++].iov_len = (size_t)(slot - row);
            } else {
                s->iov[nv].iov_base = s->trail + (s->moved - row);
                s->iov[nv++].iov_len = (size_t)(slot - s->moved);
            }
            io_uring_prep_readv(sqe, fd, s->iov, nv, file_off);
        }
    } else if (s->stage) {
        /* The arena is not registered: a plain transfer (its huge pages
         * pin in a few steps each). */
        addr = s->stage + s->moved;
        if (n > NVT_MAX_SQE_BYTES)
            n = NVT_MAX_SQE_BYTES;
        if (s->op.kind == NVT_OP_WRITE)
            io_uring_prep_write(sqe, fd, addr, (unsigned)n, file_off);
        else
            io_uring_prep_read(sqe, fd, addr, (unsigned)n, file_off);
    } else if (w->info.registered_buffers) {
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
    if (w->info.fixed_files)
        sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, idx);
}

static void io_count(nvt_worker *w, int64_t result) {
    __atomic_fetch_add(&w->n_ops, 1, __ATOMIC_RELAXED);
    if (result > 0)
        __atomic_fetch_add(&w->n_bytes, (uint64_t)result, __ATOMIC_RELAXED);
}

static void io_finish(nvt_worker *w, unsigned idx, int64_t result, uint64_t checksum) {
    nvt_slot *s = &w->slots[idx];
    if (s->stage) {
        /* A staged read that asked for no hash lands in the buffer now; a
         * failed op leaves the buffer untouched (as a direct op's might not). */
        if (s->op.kind == NVT_OP_READ && result > 0 && !w->e->sealed)
            memcpy(w->e->buf + s->op.buf_offset, s->stage, (size_t)s->op.length);
        stage_give(w, s->stage_first, s->stage_units);
        s->stage = NULL;
    }
    batch_reserve_hard(&w->out, 1);
    batch_push(&w->out, s->op.op_id, result, checksum);
    io_count(w, result);
    w->inflight_bytes -= (uint64_t)s->op.length;
    w->free_slots[w->n_free++] = idx;
}

static void io_on_cqe(nvt_worker *w, unsigned idx, int res) {
    nvt_slot *s = &w->slots[idx];
    nvt_engine *e = w->e;
    uint64_t length = e->sealed ? e->seal.slot_bytes : (uint64_t)s->op.length;

    if (res > 0) {
        s->moved += (uint64_t)res;
        if (s->moved < length) {
            /* Short transfer (or a capped SQE): continue with the rest. A
             * retry that moves nothing or fails ends the op with -EIO. A
             * failed ring submits nothing more: the op fails (short: -EIO). */
            if (w->sq_abandoned) {
                io_finish(w, idx, -EIO, 0);
                return;
            }
            io_prep(w, idx);
            return;
        }
        if (s->op.kind == NVT_OP_READ && e->sealed) {
            /* Opened next round, after the ring was refilled (as a hash). */
            nvt_read_done *r = &w->reads[w->n_reads++];
            r->op_id = s->op.op_id;
            r->data = s->stage ? s->stage : e->buf + s->op.buf_offset;
            r->dst = s->stage ? e->buf + s->op.buf_offset : NULL;
            r->stage_first = s->stage_first;
            r->stage_units = s->stage_units;
            r->length = e->seal.row_bytes;
            r->seed = s->op.seed;
            r->sealed = 1;
            memcpy(r->trailer, s->stage ? s->stage + e->seal.row_bytes : s->trail, NVT_TRAILER_BYTES);
            /* The span stays with the read until it is opened (as above). */
            s->stage = NULL;
            w->inflight_bytes -= (uint64_t)s->op.length;
            w->free_slots[w->n_free++] = idx;
            return;
        }
        if (s->op.kind == NVT_OP_READ && s->op.checksum) {
            /* Hashed next round, after the ring was refilled; the slot is free
             * now (the caller owns the buffer range until the completion). */
            nvt_read_done *r = &w->reads[w->n_reads++];
            r->op_id = s->op.op_id;
            r->data = s->stage ? s->stage : w->e->buf + s->op.buf_offset;
            r->dst = s->stage ? w->e->buf + s->op.buf_offset : NULL;
            r->stage_first = s->stage_first;
            r->stage_units = s->stage_units;
            r->length = length;
            r->seed = s->op.seed;
            r->sealed = 0;
            /* A staged read keeps its span until it is copied out, but its
             * bytes leave the cap now, so the ring is refilled before the
             * copy; the arena holds twice the cap for that. */
            w->inflight_bytes -= length;
            s->stage = NULL;
            w->free_slots[w->n_free++] = idx;
            return;
        }
        io_finish(w, idx, (int64_t)s->op.length, s->checksum);
        return;
    }
    /* res == 0: end of file or no space, nothing moved. An error after some
     * bytes moved is a short transfer, which every engine reports as -EIO. */
    io_finish(w, idx, (res == 0 || s->moved > 0) ? -EIO : res, 0);
}

/* Hand a worker's reaped completions to waiters. Takes e->lock. */
static void io_publish(nvt_worker *w) {
    nvt_engine *e = w->e;
    if (!w->out.len)
        return;
    pthread_mutex_lock(&e->lock);
    if (!e->done.len) {
        nvt_completion_batch t = e->done;
        e->done = w->out;
        w->out = t;
    } else {
        batch_reserve_hard(&e->done, w->out.len);
        memcpy(e->done.items + e->done.len, w->out.items, w->out.len * sizeof(*w->out.items));
        e->done.len += w->out.len;
    }
    w->out.len = 0;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
}

static uint64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* A failed ring submits nothing more (nor re-arms its wake read): the ops
 * whose SQEs the kernel never took (between its head and our tail) fail now
 * with -err, once; the kernel never takes them later, since every later
 * io_uring_enter of this thread submits nothing (io_uring_get_events). */
static void io_fail_unsubmitted(nvt_worker *w, int err) {
    if (w->sq_abandoned)
        return;
    w->sq_abandoned = 1;
    struct io_uring_sq *sq = &w->ring.sq;
    unsigned head = __atomic_load_n(sq->khead, __ATOMIC_ACQUIRE);
    for (unsigned i = head; i != sq->sqe_tail; i++) {
        uint64_t tag = sq->sqes[i & sq->ring_mask].user_data;
        if (tag == NVT_WAKE_TAG)
            w->wake_armed = 0;
        else
            io_finish(w, (unsigned)tag, -err, 0);
    }
    sq->sqe_head = sq->sqe_tail;
}

/* A failed ring past NVT_STOP_GRACE_MS of close: every op still in a slot
 * (taken by the kernel, never reaped) fails with -err. */
static void io_fail_slots(nvt_worker *w, int err) {
    char *busy = calloc(w->qd, 1);
    if (!busy)
        return; /* keep waiting: the next round tries again */
    for (unsigned i = 0; i < w->n_free; i++)
        busy[w->free_slots[i]] = 1; /* free, in fact */
    for (unsigned i = 0; i < w->qd; i++)
        if (!busy[i])
            io_finish(w, i, -err, 0);
    free(busy);
}

/* Register the buffer (in pieces of register_chunk_bytes) on `ring`. */
static int ring_register_buffers(const nvt_engine *e, struct io_uring *ring) {
    uint64_t chunk = e->cfg.register_chunk_bytes;
    size_t n = (e->buf_len + chunk - 1) / chunk;
    struct iovec *iov = calloc(n, sizeof(*iov));
    if (!iov)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        uint64_t start = (uint64_t)i * chunk;
        uint64_t left = e->buf_len - start;
        iov[i].iov_base = e->buf + start;
        iov[i].iov_len = left < chunk ? left : chunk;
    }
    int ret = io_uring_register_buffers(ring, iov, (unsigned)n);
    free(iov);
    return ret;
}

/* Copy the source ring's registered buffers into this ring (no second pin).
 * The kernel refuses a source ring bound to another thread (single issuer),
 * hence the plain source ring rather than worker 0's. */
static int io_clone_buffers(nvt_worker *w) {
    struct nvt_clone_buffers arg;
    memset(&arg, 0, sizeof(arg));
    arg.src_fd = (uint32_t)w->e->src_ring.ring_fd;
    long ret = syscall(__NR_io_uring_register, w->ring.ring_fd, NVT_REGISTER_CLONE_BUFFERS, &arg, 1);
    return ret < 0 ? -errno : 0;
}

static int io_setup(nvt_worker *w) {
    nvt_engine *e = w->e;
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
        ret = ring_create(&w->ring, w->qd + 1, &p, &w->ring_fd_fork);
        if (ret == 0) {
            w->info.setup_flags = flag_sets[i];
            w->info.ring_entries = p.sq_entries;
            break;
        }
        if (ret != -EINVAL)
            return ret;
    }
    if (ret < 0)
        return ret;

    if (e->cfg.staging_bytes) {
        /* Without an arena every op moves directly, as before. */
        /* Twice the worker's byte cap: what it has in flight, plus reads
         * reaped and still waiting for their copy out. */
        uint64_t cap2 = 2 * w->max_inflight_bytes;
        uint64_t want = e->cfg.staging_bytes < cap2 ? e->cfg.staging_bytes : cap2;
        if (e->sealed) {
            /* A sealed op's span is its whole slot (row and trailer page),
             * rounded to whole units: as many spans as rows fit in `want`,
             * but no more than the worker ever holds (qd ops in flight and
             * qd reads reaped, not yet opened): small rows would otherwise
             * map many times `want` (4 KiB rows: 16x). */
            uint64_t span = (e->seal.slot_bytes + NVT_STAGE_UNIT_BYTES - 1) / NVT_STAGE_UNIT_BYTES *
                            NVT_STAGE_UNIT_BYTES;
            uint64_t spans = want / e->seal.row_bytes + 1;
            if (spans > 2 * (uint64_t)w->qd)
                spans = 2 * (uint64_t)w->qd;
            want = spans * span;
        }
        int sret = stage_open(w, want);
        if (sret < 0)
            w->info.staging_errno = -sret;
    }
    if (e->cfg.register_buffers && e->buf_len > 0) {
        if (e->n_workers == 1) {
            ret = ring_register_buffers(e, &w->ring);
            if (ret == 0)
                w->info.registered_buffers = NVT_BUFFERS_REGISTERED;
            else
                w->info.buffers_errno = -ret;
        } else if (e->src_ring_ok) {
            ret = io_clone_buffers(w);
            if (ret == 0) {
                w->info.registered_buffers = NVT_BUFFERS_CLONED;
            } else {
                /* A kernel before 6.12: pin again for this ring
                 * (RLIMIT_MEMLOCK counts it again; refused, it stays plain). */
                w->info.clone_errno = -ret;
                ret = ring_register_buffers(e, &w->ring);
                if (ret == 0)
                    w->info.registered_buffers = NVT_BUFFERS_REGISTERED;
                else
                    w->info.buffers_errno = -ret;
            }
        } else {
            /* The one registration was refused (memlock): so would this be. */
            w->info.buffers_errno = e->src_errno;
        }
    }
    /* The data files (op file_idx i is entry i), then the keepalive fd. */
    int keep = e->cfg.keepalive_fd;
    if (e->cfg.fixed_files && e->nfds > 0) {
        unsigned n = e->nfds + (keep >= 0 ? 1u : 0u);
        int *all = malloc(n * sizeof(int));
        if (all) {
            memcpy(all, e->fds, e->nfds * sizeof(int));
            if (keep >= 0)
                all[e->nfds] = keep;
            ret = io_uring_register_files(&w->ring, all, n);
            free(all);
        } else {
            ret = -ENOMEM;
        }
        if (ret == 0) {
            w->info.fixed_files = 1;
            w->info.keepalive = keep >= 0;
        } else {
            w->info.files_errno = -ret;
        }
    }
    if (keep >= 0 && !w->info.keepalive && io_uring_register_files(&w->ring, &keep, 1) == 0)
        w->info.keepalive = 1; /* registered alone: ops then name their fds */
    return 0;
}

static void io_run(nvt_worker *w) {
    nvt_engine *e = w->e;
    unsigned qd = w->qd;

    io_arm_wake(w);
    for (;;) {
        unsigned n_taken = 0, n_seal = 0;
        int stop, failed, more = 0;

        io_publish(w);
        pthread_mutex_lock(&w->lock);
        failed = w->failed;
        while (w->pend_len && (w->n_free || failed)) {
            nvt_op *op = &w->pend[w->pend_head];
            if (failed) {
                /* The ring failed: the op fails without I/O. */
                batch_reserve_hard(&w->out, 1);
                batch_push(&w->out, op->op_id, -failed, 0);
                io_count(w, -failed);
            } else {
                /* Sealing: a few writes a round, so the ring is reaped and
                 * completions published between seals (each ~0.5 ms). */
                if (e->sealed && op->kind == NVT_OP_WRITE && n_seal++ >= NVT_SEAL_BATCH) {
                    more = 1;
                    break;
                }
                /* One op larger than the cap still runs, alone. */
                if (w->inflight_bytes && w->inflight_bytes + (uint64_t)op->length > w->max_inflight_bytes)
                    break;
                unsigned idx = w->free_slots[--w->n_free];
                w->slots[idx].op = *op;
                w->slots[idx].moved = 0;
                w->slots[idx].checksum = 0;
                w->inflight_bytes += (uint64_t)op->length;
                w->taken[n_taken++] = idx;
            }
            w->pend_head = (w->pend_head + 1) & (w->pend_cap - 1);
            w->pend_len--;
        }
        stop = w->closing;
        /* While ops are in flight (or still pending) a completion wakes us
         * soon and we take new ops then, so a submitter need not pay for a
         * wake-up (an eventfd write that costs vLLM's thread several us).
         * Only an idle worker, with nothing in flight, needs the eventfd. */
        w->sleeping = !stop && !failed && w->pend_len == 0 && w->n_free == qd;
        pthread_mutex_unlock(&w->lock);
        if (failed)
            io_publish(w);

        uint64_t hashed = 0;
        int refused = 0; /* ops failed before their SQE (sealing) */
        for (unsigned i = 0; i < n_taken; i++) {
            nvt_slot *s = &w->slots[w->taken[i]];
            stage_take(w, s, e->sealed ? e->seal.slot_bytes : (uint64_t)s->op.length);
            if (s->stage && s->op.kind == NVT_OP_WRITE && !s->op.checksum && !e->sealed)
                memcpy(s->stage, e->buf + s->op.buf_offset, (size_t)s->op.length);
            if (e->sealed) {
                /* Sealed here, on this worker, before the SQE (the nonce's
                 * lock is the only one shared with other workers). */
                int err = s->op.kind == NVT_OP_WRITE ? seal_write(e, s)
                          : s->stage                 ? 0
                                                     : seal_read_ready(e, s);
                if (err) {
                    io_finish(w, w->taken[i], err, 0);
                    refused = 1;
                    continue;
                }
                if (s->op.kind == NVT_OP_WRITE) {
                    hashed += (uint64_t)s->op.length;
                    __atomic_fetch_add(&w->n_hashed, (uint64_t)s->op.length, __ATOMIC_RELAXED);
                    if (hashed >= NVT_SUBMIT_EVERY_BYTES && i + 1 < n_taken) {
                        io_submit(w);
                        hashed = 0;
                    }
                }
            } else if (s->op.kind == NVT_OP_WRITE && s->op.checksum) {
                /* Staged: hash the copy, in the same pass as the copy, so the
                 * bytes written are the bytes hashed even if the caller
                 * touches its row meanwhile. */
                s->checksum = s->stage ? nvt_xxh3_copy(s->stage, e->buf + s->op.buf_offset,
                                                       (size_t)s->op.length, s->op.seed)
                                       : nvt_xxh3(e->buf + s->op.buf_offset, (size_t)s->op.length,
                                                  s->op.seed);
                hashed += (uint64_t)s->op.length;
                __atomic_fetch_add(&w->n_hashed, (uint64_t)s->op.length, __ATOMIC_RELAXED);
                if (hashed >= NVT_SUBMIT_EVERY_BYTES && i + 1 < n_taken) {
                    io_submit(w);
                    hashed = 0;
                }
            }
            io_prep(w, w->taken[i]);
        }
        if (refused) {
            /* Their completions must not wait for another op's CQE (there
             * may be none): round again, which publishes them first and
             * recomputes `sleeping` (the SQEs prepped are submitted then). */
            continue;
        }

        if (w->n_reads) {
            if (!failed && io_uring_sq_ready(&w->ring))
                io_submit(w);
            batch_reserve_hard(&w->out, w->n_reads);
            for (unsigned i = 0; i < w->n_reads; i++) {
                nvt_read_done *r = &w->reads[i];
                if (r->sealed) {
                    uint64_t sum;
                    int64_t res = seal_open(e, r, &sum);
                    if (r->dst)
                        stage_give(w, r->stage_first, r->stage_units);
                    batch_reserve_hard(&w->out, 1); /* io_publish may have swapped it */
                    batch_push(&w->out, r->op_id, res, sum);
                    io_count(w, res);
                    io_publish(w); /* each opened chunk at once (~0.5 ms each) */
                } else {
                    uint64_t sum;
                    if (r->dst) {
                        /* Copy out and hash the copy in one pass: the checksum
                         * covers the bytes the caller gets. The span and its
                         * bytes in flight are given back only now. */
                        sum = nvt_xxh3_copy(r->dst, r->data, (size_t)r->length, r->seed);
                        stage_give(w, r->stage_first, r->stage_units);
                    } else {
                        sum = nvt_xxh3(r->data, r->length, r->seed);
                    }
                    batch_push(&w->out, r->op_id, (int64_t)r->length, sum);
                    io_count(w, (int64_t)r->length);
                }
                __atomic_fetch_add(&w->n_hashed, r->length, __ATOMIC_RELAXED);
            }
            w->n_reads = 0;
            io_publish(w);
        }

        if (failed) {
            /* Nothing more is submitted: what the kernel never took fails
             * now, what it took is reaped as it completes (polled: no wake
             * read). Closing, that wait is bounded. */
            io_fail_unsubmitted(w, failed);
            if (stop && w->n_free != qd) {
                uint64_t now = mono_ms();
                if (!w->stop_ms)
                    w->stop_ms = now;
                else if (now - w->stop_ms >= NVT_STOP_GRACE_MS)
                    io_fail_slots(w, failed);
            }
            io_publish(w);
        }

        if (stop && w->n_free == qd)
            break; /* closing, and nothing left in the ring */

        int inj = __atomic_load_n(&w->inject_enter_err, __ATOMIC_RELAXED);
        int ret;
        if (failed) {
            ret = inj ? -inj : io_uring_get_events(&w->ring);
            usleep(1000);
        } else {
            /* Ops left in the queue for the next round: submit, reap what
             * has completed, and come back without waiting. */
            ret = inj ? -inj : io_uring_submit_and_wait(&w->ring, more ? 0 : 1);
        }
        if (failed) {
            /* already failed: its errors change nothing */
        } else if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME) {
            /* Not expected with a ring this thread sized itself; back off
             * rather than spin, and keep reaping what completes. A ring that
             * keeps failing fails its ops from now on (only its own). */
            if (++w->enter_errors >= NVT_RING_FAIL_TRIES && !w->failed)
                nvt_engine_fail_worker(e, w->idx, -ret);
            usleep(1000);
        } else if (ret < 0) {
            /* Transient, unless it keeps coming with nothing completing
             * (counted down below when a completion is reaped). */
            if (++w->enter_stalls >= NVT_RING_TRANSIENT_TRIES && !w->failed)
                nvt_engine_fail_worker(e, w->idx, -ret);
            else if (w->enter_stalls > 1)
                usleep(1000);
        } else {
            w->enter_errors = 0;
            w->enter_stalls = 0;
        }

        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&w->ring, head, cqe) {
            uint64_t tag = io_uring_cqe_get_data64(cqe);
            seen++;
            if (tag == NVT_WAKE_TAG)
                w->wake_armed = 0;
            else
                io_on_cqe(w, (unsigned)tag, cqe->res);
        }
        io_uring_cq_advance(&w->ring, seen);
        if (seen)
            w->enter_stalls = 0; /* progress: the errors were transient */
        if (!w->wake_armed && !stop && !failed)
            io_arm_wake(w);
    }
}

static void *io_main(void *arg) {
    nvt_worker *w = arg;
    nvt_engine *e = w->e;
    char name[16];
    snprintf(name, sizeof(name), "nvt-uring-%u", w->idx);
    pthread_setname_np(pthread_self(), name);
    int err = io_setup(w);

    pthread_mutex_lock(&e->lock);
    e->setup_done = err ? err : 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    if (err)
        return NULL;
    /* An open that fails after this worker started stops it through `closing`. */
    io_run(w);
    /* Exiting the ring cancels the wake read and unregisters buffers/files. */
    ring_destroy(&w->ring, &w->ring_fd_fork);

    io_publish(w);
    pthread_mutex_lock(&e->lock);
    e->n_exited++;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    return NULL;
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
    engines_remove(e);
    for (unsigned i = 0; e->workers && i < e->n_workers; i++)
        worker_destroy(&e->workers[i]);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->close_lock);
    pthread_mutex_destroy(&e->nonce_lock);
    explicit_bzero(&e->seal, sizeof(e->seal)); /* the key */
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
    pthread_mutex_lock(&engines_lock); /* a fork sees it recorded or not made */
    w->wake_fd = eventfd(0, EFD_CLOEXEC);
    int err = w->wake_fd < 0 ? -errno : 0;
    pthread_mutex_unlock(&engines_lock);
    return err;
}

/* Register the buffer once on a plain ring that the workers clone from. */
static void src_ring_open(nvt_engine *e) {
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    int ret = ring_create(&e->src_ring, 1, &p, &e->src_ring_fd_fork);
    if (ret < 0) {
        e->src_errno = -ret;
        return;
    }
    ret = ring_register_buffers(e, &e->src_ring);
    if (ret < 0) {
        e->src_errno = -ret;
        ring_destroy(&e->src_ring, &e->src_ring_fd_fork);
        return;
    }
    e->src_ring_ok = 1;
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
    int ret = pthread_create(&w->thread, NULL, io_main, w);
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
        w->closing = 1;
        pthread_mutex_unlock(&w->lock);
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    for (unsigned i = 0; i < e->n_workers; i++) {
        nvt_worker *w = &e->workers[i];
        if (!w->started)
            continue;
        /* Unconditionally: the thread may be waiting on the ring. */
        wake_io_thread(w);
    }
    for (unsigned i = 0; i < e->n_workers; i++) {
        nvt_worker *w = &e->workers[i];
        if (!w->started)
            continue;
        pthread_join(w->thread, NULL);
        w->started = 0;
        /* Under engines_lock: a fork between the close and the -1 would have
         * the child close this number again, by then maybe another file. */
        pthread_mutex_lock(&engines_lock);
        close(w->wake_fd);
        w->wake_fd = -1;
        pthread_mutex_unlock(&engines_lock);
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
        e->cfg.register_buffers = 0;
    }
    pthread_mutex_init(&e->nonce_lock, NULL);
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->close_lock, NULL);
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
    engines_add(e); /* before any ring exists */
    int ret = 0;
    for (unsigned i = 0; i < e->n_workers && ret == 0; i++)
        ret = worker_init(e, i);
    if (ret == 0 && e->n_workers > 1 && e->cfg.register_buffers && buf_len > 0)
        src_ring_open(e);
    /* One at a time: each sets up its ring (and clones) before the next. */
    for (unsigned i = 0; i < e->n_workers && ret == 0; i++)
        ret = worker_start(e, &e->workers[i]);
    if (e->src_ring_ok) {
        ring_destroy(&e->src_ring, &e->src_ring_fd_fork);
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
    if (immediate)
        pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->lock);
    for (unsigned i = 0; i < e->n_workers; i++) {
        if (wake[i])
            wake_io_thread(&e->workers[i]);
    }
    if (route != stack_route)
        free(route);
    return 0;
}

void nvt_engine_wait(nvt_engine *e, double timeout_s, nvt_completion_batch *batch) {
    /* A poll that finds nothing skips the mutex the I/O threads keep taking:
     * done.len is read racily as a hint; a completion it misses is found by
     * the next poll (the store is polled at every engine step). */
    if (e->forked || (timeout_s <= 0 && !__atomic_load_n(&e->done.len, __ATOMIC_ACQUIRE)))
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
        *batch = t;
    }
    pthread_mutex_unlock(&e->lock);
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

static int probe_locked(const char **stage);

int nvt_probe(const char **stage) {
    /* Under engines_lock, as every ring: a fork never inherits this one. */
    pthread_once(&engines_atfork_once, engines_atfork_install);
    pthread_mutex_lock(&engines_lock);
    int ret = probe_locked(stage);
    pthread_mutex_unlock(&engines_lock);
    return ret;
}

static int probe_locked(const char **stage) {
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
