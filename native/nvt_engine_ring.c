/*
 * nvt_engine_ring: the engine's io_uring rings: creating and closing them
 * (fork-safe), a worker's ring setup (setup flags, its staging arena,
 * registered or cloned buffers, fixed files and the keepalive fd), the
 * source ring that registers the buffer once for the workers to clone, the
 * fork handler that keeps rings out of forked children, and nvt_probe.
 *
 * Threads: nvt_io_setup runs on the worker's own I/O thread (its ring may
 * be single issuer); nvt_src_ring_open and nvt_engines_add/remove on the
 * thread in nvt_engine_open/free; the fork handlers in the forking thread
 * and the child; nvt_probe on any thread. Nothing waits but for
 * nvt_engines_lock, held briefly (a ring made or closed, a fork).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "nvt_engine_internal.h"

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
pthread_mutex_t nvt_engines_lock = PTHREAD_MUTEX_INITIALIZER;
static nvt_engine *engines;
static pthread_once_t engines_atfork_once = PTHREAD_ONCE_INIT;

static void engines_prepare(void) { pthread_mutex_lock(&nvt_engines_lock); }

static void engines_parent(void) { pthread_mutex_unlock(&nvt_engines_lock); }

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
    pthread_mutex_unlock(&nvt_engines_lock); /* taken by engines_prepare in this thread */
}

static void engines_atfork_install(void) {
    pthread_atfork(engines_prepare, engines_parent, engines_child);
}

void nvt_engines_add(nvt_engine *e) {
    pthread_once(&engines_atfork_once, engines_atfork_install);
    pthread_mutex_lock(&nvt_engines_lock);
    e->next_engine = engines;
    engines = e;
    pthread_mutex_unlock(&nvt_engines_lock);
}

void nvt_engines_remove(nvt_engine *e) {
    pthread_mutex_lock(&nvt_engines_lock);
    for (nvt_engine **p = &engines; *p; p = &(*p)->next_engine) {
        if (*p == e) {
            *p = e->next_engine;
            break;
        }
    }
    pthread_mutex_unlock(&nvt_engines_lock);
}

/* Create a ring that a forked child will not map, its fd recorded for the
 * child to close (under nvt_engines_lock: no fork in between). */
static int ring_create(struct io_uring *ring, unsigned entries, struct io_uring_params *p, int *fd_fork) {
    pthread_mutex_lock(&nvt_engines_lock);
    int ret = io_uring_queue_init_params(entries, ring, p);
    if (ret == 0) {
        io_uring_ring_dontfork(ring);
        *fd_fork = ring->ring_fd;
    }
    pthread_mutex_unlock(&nvt_engines_lock);
    return ret;
}

/* Close a ring made by ring_create (under nvt_engines_lock: a fork sees the
 * ring either recorded or closed, never open and forgotten). */
void nvt_ring_destroy(struct io_uring *ring, int *fd_fork) {
    pthread_mutex_lock(&nvt_engines_lock);
    *fd_fork = -1;
    io_uring_queue_exit(ring);
    pthread_mutex_unlock(&nvt_engines_lock);
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

int nvt_io_setup(nvt_worker *w) {
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
        int sret = nvt_stage_open(w, want);
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

/* Register the buffer once on a plain ring that the workers clone from. */
void nvt_src_ring_open(nvt_engine *e) {
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
        nvt_ring_destroy(&e->src_ring, &e->src_ring_fd_fork);
        return;
    }
    e->src_ring_ok = 1;
}

static int probe_locked(const char **stage);

int nvt_probe(const char **stage) {
    /* Under nvt_engines_lock, as every ring: a fork never inherits this one. */
    pthread_once(&engines_atfork_once, engines_atfork_install);
    pthread_mutex_lock(&nvt_engines_lock);
    int ret = probe_locked(stage);
    pthread_mutex_unlock(&nvt_engines_lock);
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
