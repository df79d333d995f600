/*
 * nvt_engine_internal: what the io_uring engine's compilation units share.
 * Not installed, and included by native/nvt_engine*.c only (the binding,
 * nvt_module.c, sees nvt_engine.h alone). It owns the constants more than
 * one unit uses, the slot, read, worker and engine types (with the thread
 * and lock rules of their fields), the completion-batch helpers, and the
 * internal functions one unit calls in another: those are nvt_-prefixed and,
 * like every symbol of the module but PyInit__uring, hidden (setup.py
 * builds with -fvisibility=hidden).
 *
 * The units, and the threads that run them (nvt_engine.h has the rules):
 *   nvt_engine.c        the public API: open, submit, wait, close, free,
 *                       stats and test hooks; routing ops to workers.
 *                       The caller's threads.
 *   nvt_engine_io.c     a worker's I/O thread: its loop and everything it
 *                       does per op. That worker's thread only.
 *   nvt_engine_ring.c   rings: creation, buffer registration and cloning,
 *                       fixed files (the I/O thread, at its setup), the
 *                       fork handler (the forking thread), nvt_probe.
 *   nvt_engine_stage.c  the staging arena. The I/O thread only.
 *   nvt_engine_seal.c   sealing and opening (the I/O thread) through the
 *                       store's key table (nvt_seal.h).
 */
#ifndef NVT_ENGINE_INTERNAL_H
#define NVT_ENGINE_INTERNAL_H

#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>

#include "nvt_engine.h"
#include "nvt_seal.h"
#include "nvt_seal.h"

/* Largest single SQE of an unregistered transfer (the kernel moves at most
 * ~2 GiB per read/write call); longer ops continue in further SQEs. */
#define NVT_MAX_SQE_BYTES (1ULL << 30)
#define NVT_PAGE_BYTES 4096ull
/* The staging arena is handed out in spans of this many bytes; it is mapped
 * 2 MiB-aligned so that each transparent huge page is one whole piece. */
#define NVT_STAGE_UNIT_BYTES (64ULL << 10)
#define NVT_HUGE_PAGE_BYTES (2ULL << 20)

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
    uint64_t file_off;  /* sealed: the slot's place, bound into the tag */
    uint32_t file_idx;
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
    /* Atomic hint: the thread is in (or entering) its wait in the ring, so
     * an eventfd write reaches it at once (nvt_engine_submit's choice of the
     * idle worker it wakes itself; see nvt_engine_relay_wakes). */
    int in_wait;
    /* The ring's fd, for a forked child to close (-1: none). Written under
     * nvt_engines_lock, so a fork sees it either set or not yet created. */
    int ring_fd_fork;
    nvt_completion_batch out; /* completions reaped but not yet published */
    uint64_t n_ops, n_bytes, n_hashed; /* atomics: stats */
    int failed_hint; /* atomic copy of `failed` for routing without the lock */
    /* The staging arena (see nvt_config.staging_bytes), owned by the I/O
     * thread: mapped in nvt_io_setup, unmapped by worker_destroy. */
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
    /* done.len, stored atomically after every change of it (under lock):
     * the lock-free poll of nvt_engine_wait reads this, never done.len,
     * which the lock's holders write plainly. */
    size_t done_hint;
    /* Wake-ups a submit left to the first I/O thread it woke (atomics, no
     * lock): wake_due[i] for each other sleeping worker it gave ops to, then
     * wake_any; every I/O thread relays them at the top of its round
     * (nvt_engine_relay_wakes), so that a job spread over N idle workers
     * costs vLLM's thread one eventfd write, not N. */
    int wake_due[NVT_MAX_WORKERS];
    int wake_any;
    /* Submits between their unlock of `lock` and their last eventfd write
     * (atomic): engine_stop waits for none before it closes a wake fd. */
    unsigned submitting;
    int closing; /* submit refuses */
    unsigned n_exited; /* I/O threads that published their last completion */
    int setup_done;    /* setup of the worker being started finished */

    pthread_mutex_t close_lock; /* serializes nvt_engine_close */
    int joined;                 /* guarded by close_lock */

    /* Every open engine (nvt_engines_lock), for the fork handler; src_ring's fd
     * for a child to close (-1: none); `forked`: this is a forked child's
     * copy, whose threads do not exist (set in the child before any call). */
    struct nvt_engine *next_engine;
    int src_ring_fd_fork;
    int forked;

    /* Sealing (cfg.seal copied here; sealed: 0 when none). */
    int sealed;
    nvt_seal_config seal;
    uint64_t auth_failures;           /* atomic */

    /* The completion hook (nvt_engine_set_apply): written under apply_lock
     * held for writing, called under it held for reading (by each worker
     * with its batch); apply_on is an atomic hint that spares a hookless
     * engine the lock. */
    pthread_rwlock_t apply_lock;
    nvt_apply_fn apply_fn;
    void *apply_ctx;
    int apply_on;
};

/* ---- completion batches ------------------------------------------------ */
/* A worker's `out` (its I/O thread) and the engine's `done` (under e->lock):
 * filled by nvt_engine.c and nvt_engine_io.c, hence static inline here. */

static inline int batch_reserve(nvt_completion_batch *b, size_t extra) {
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
static inline void batch_reserve_hard(nvt_completion_batch *b, size_t extra) {
    while (batch_reserve(b, extra) != 0)
        usleep(1000);
}

/* After a change of e->done (under e->lock): its length for lock-free pollers. */
static inline void done_changed_locked(nvt_engine *e) {
    __atomic_store_n(&e->done_hint, e->done.len, __ATOMIC_RELEASE);
}

static inline void batch_push(nvt_completion_batch *b, void *op_id, int64_t result, uint64_t checksum) {
    nvt_completion *c = &b->items[b->len++];
    c->op_id = op_id;
    c->result = result;
    c->checksum = checksum;
}

/* ---- across units (each documented where it is defined) ---------------- */

/* nvt_engine.c */
void nvt_engine_relay_wakes(nvt_engine *e);

/* nvt_engine_ring.c */
extern pthread_mutex_t nvt_engines_lock;
void nvt_engines_add(nvt_engine *e);
void nvt_engines_remove(nvt_engine *e);
void nvt_ring_destroy(struct io_uring *ring, int *fd_fork);
int nvt_io_setup(nvt_worker *w);
void nvt_src_ring_open(nvt_engine *e);

/* nvt_engine_stage.c */
int nvt_stage_open(nvt_worker *w, uint64_t bytes);
void nvt_stage_take(nvt_worker *w, nvt_slot *s, uint64_t bytes);
void nvt_stage_give(nvt_worker *w, uint32_t first, uint32_t units);

/* nvt_engine_seal.c */
uint8_t *nvt_seal_out(nvt_slot *s);
int nvt_seal_write(nvt_engine *e, nvt_slot *s);
int nvt_seal_read_ready(nvt_engine *e, nvt_slot *s);
int64_t nvt_seal_open(nvt_engine *e, nvt_read_done *r, uint64_t *checksum);

/* nvt_engine_io.c */
void *nvt_io_main(void *arg);

#endif /* NVT_ENGINE_INTERNAL_H */
