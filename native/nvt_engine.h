/*
 * nvt_engine: positioned reads and writes between one memory buffer and a set
 * of open files, driven by one or more workers: each worker is one io_uring
 * owned by one native I/O thread.
 *
 * Workers and files: with W workers and F files (one file per drive), a file
 * is served by the workers w with w % F == f when W >= F (a fast drive can
 * have several; ops of the file alternate between them), else by worker
 * f % W (a worker serves several drives). Each worker's ring holds
 * queue_depth ops and max_inflight_bytes / F bytes per drive it serves (its
 * share when a drive has several workers), so every drive keeps its queue
 * depth whatever the worker count. Each worker hashes the ops it completes.
 *
 * This layer knows nothing of Python: the binding (nvt_module.c) converts
 * objects to nvt_op and back. An op's `op_id` is an opaque pointer that the
 * engine only copies; it comes back in exactly one nvt_completion.
 *
 * Threads and locks:
 *   - nvt_engine_open/close/free are called by one owner thread; open and
 *     close block (ring setup and buffer registration; joining the I/O thread).
 *   - nvt_engine_submit may be called from any thread, concurrently with
 *     everything but nvt_engine_free. It takes `lock` briefly and never waits
 *     for the kernel.
 *   - nvt_engine_wait may be called from any thread; it blocks up to its
 *     timeout on `done_cv`.
 *   - Each worker's I/O thread alone touches its ring, in-flight slots and
 *     counters. It takes its worker's lock to move ops out of its pending
 *     queue, and the engine's `lock` to move completions into the shared done
 *     queue, never both at once and never while hashing or in a syscall.
 *     Lock order: engine `lock`, then a worker's lock (submit and close).
 *   - A completion hook (nvt_engine_set_apply) runs on each worker's I/O
 *     thread, under the engine's apply_lock held for reading and no other
 *     lock, before the worker publishes its batch; set_apply takes it for
 *     writing, so a removed hook has no caller left when it returns.
 *   - No function here needs the Python GIL; the binding releases it around
 *     every call that can block.
 */
#ifndef NVT_ENGINE_H
#define NVT_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#define NVT_OP_READ 0
#define NVT_OP_WRITE 1

/* The kernel refuses registered buffers larger than 1 GiB each. */
#define NVT_MAX_REGISTER_CHUNK_BYTES (1ULL << 30)

typedef struct nvt_engine nvt_engine;

/* One positioned transfer, as submitted. Signed fields are validated by
 * nvt_engine_submit, so callers may pass whatever the user gave them. */
typedef struct {
    void *op_id;          /* opaque, echoed in the completion */
    int64_t file_offset;  /* byte offset in the file */
    int64_t buf_offset;   /* byte offset in the buffer */
    int64_t length;       /* bytes to move */
    int64_t file_idx;     /* index into the engine's fd list */
    uint64_t seed;        /* XXH3-64 seed */
    int kind;             /* NVT_OP_READ or NVT_OP_WRITE */
    int checksum;         /* 0: skip the hash (the completion's checksum is 0) */
} nvt_op;

/* The outcome of one op: result = length or -errno (a short transfer is -EIO);
 * checksum = XXH3-64(seed) of the bytes moved, 0 on failure or when the op
 * asked for none. */
typedef struct {
    void *op_id;
    int64_t result;
    uint64_t checksum;
} nvt_completion;

/* A completion hook (nvt_engine_set_apply): called by a worker's I/O thread
 * with a batch of its completions, after their ops completed (hashed, or
 * opened when sealed) and before they are published to the done queue, with
 * no lock of the engine held and no GIL. It must not block, must not keep
 * `cs`, and may not change what the completions say (they are published as
 * they are). Several workers may call it at once, each with its own batch. */
typedef void (*nvt_apply_fn)(void *ctx, const nvt_completion *cs, size_t n);

/* A growable array of completions owned by whoever holds it. */
typedef struct {
    nvt_completion *items;
    size_t len;
    size_t cap;
} nvt_completion_batch;

/* At most this many workers (rings and I/O threads) per engine. */
#define NVT_MAX_WORKERS 64

/* Encryption at rest inside the engine (nvmetier/engine/sealed.py's slot
 * format): every op moves one chunk (`row_bytes`, an op of another length
 * fails with -EFAULT). A write seals the row (only read) into a bounce
 * buffer followed by the trailer, in the worker thread before its SQE is
 * prepared, and writes the sealed slot (`slot_bytes`); its completion's
 * checksum is the tag's first 8 bytes (LE). A read reads the slot straight
 * into the row plus the trailer into a small buffer (one readv of both) and
 * opens the row in place in the worker thread before the completion is
 * published: a tag that does not verify completes with -EBADMSG, an epoch
 * known destroyed with -EKEYREVOKED, an epoch the key table does not hold
 * yet with -ENOKEY. The slot format, the
 * nonces and the authenticated data are nvt_seal.h's (one definition for
 * both engines). */
struct nvt_keys;
typedef struct {
    struct nvt_keys *keys;    /* the store's key table (nvt_seal.h); the engine holds a reference */
    uint64_t row_bytes;       /* bytes of one chunk: every op's length */
    uint64_t slot_bytes;      /* bytes moved per op; slot_bytes - row_bytes >= 64 */
} nvt_seal_config;

typedef struct {
    unsigned queue_depth;           /* ops in flight per drive (file), >= 1 */
    uint64_t max_inflight_bytes;    /* bytes in flight over all drives (one op may exceed it) */
    int register_buffers;           /* try READ_FIXED/WRITE_FIXED */
    int fixed_files;                /* try registered files */
    uint64_t register_chunk_bytes;  /* bytes per registered iovec, <= 1 GiB */
    unsigned workers;               /* rings and I/O threads, 1..NVT_MAX_WORKERS */
    /* An fd registered in every ring beside the data files and never used
     * for I/O (-1: none): the store's lock fd, whose OFD locks say this
     * process is alive. A ring holds its registered files until its queued
     * I/O is done, so when this process dies the lock outlives its in-flight
     * writes, and no other process reclaims a slot those writes may still
     * land on. */
    int keepalive_fd;
    /* Staging memory per worker, at most this many bytes and at most twice
     * the worker's max_inflight_bytes (0: none). An op that gets a span
     * of it moves through it: a read lands there, is hashed there and is
     * copied into the buffer; a write is copied there, hashed and written
     * from there. The arena is private memory advised for transparent huge
     * pages, so each 2 MiB of it is one physically contiguous piece: a
     * buffer of scattered 4 KiB pages (vLLM's /dev/shm primary) costs one
     * block-device segment per page, and a virtio disk without indirect
     * descriptors (or an NVMe drive's PRP/SGL limits) then splits a 2 MiB op
     * into several requests and fills its ring with one op. An op that finds
     * no free span (or is larger than the arena) moves directly. */
    uint64_t staging_bytes;
    /* Sealing (NULL: none). Copied by nvt_engine_open (a reference to the
     * key table taken); a write the table refuses fails with -EAGAIN.
     * With staging a sealed op's slot image is a span of the arena (sealed
     * into it from the row, or read into it and opened into the row); an op
     * that finds no span uses its slot's bounce buffer (write) or reads into
     * the row plus a trailer page and opens in place (read). */
    const nvt_seal_config *seal;
} nvt_config;

/* How a worker's ring got the buffer registered. */
#define NVT_BUFFERS_PLAIN 0      /* not registered: READ/WRITE */
#define NVT_BUFFERS_REGISTERED 1 /* registered (pinned) by this ring */
#define NVT_BUFFERS_CLONED 2     /* IORING_REGISTER_CLONE_BUFFERS from worker 0: no second pin */

/* What nvt_engine_open achieved for one worker; fixed for the engine's life. */
typedef struct {
    int registered_buffers;  /* NVT_BUFFERS_*: READ_FIXED/WRITE_FIXED unless PLAIN */
    int buffers_errno;       /* why registration failed (0: not tried or ok) */
    int clone_errno;         /* why cloning from worker 0 failed (0: not tried or ok) */
    int fixed_files;         /* 1 if the fds are registered */
    int files_errno;         /* why file registration failed */
    int keepalive;           /* 1 if the keepalive fd is registered in this ring */
    unsigned ring_entries;   /* SQ size */
    unsigned setup_flags;    /* IORING_SETUP_* the ring was created with */
    unsigned queue_depth;    /* ops in this ring at once */
    uint64_t max_inflight_bytes; /* bytes in this ring at once */
    uint64_t staging_bytes;  /* the worker's staging arena (0: none) */
    uint64_t staging_addr;   /* its address, for /proc/self/smaps look-ups */
    int staging_errno;       /* why the arena could not be mapped (0: ok or not asked) */
} nvt_engine_info;

/* Running counters of one worker (read racily: for rates, not accounting). */
typedef struct {
    uint64_t ops;        /* ops completed */
    uint64_t bytes;      /* bytes moved by successful ops */
    uint64_t hashed;     /* bytes hashed */
    uint64_t staged;     /* bytes of ops that moved through the staging arena */
    double cpu_s;        /* CPU time of the worker's thread */
    int failed_errno;    /* != 0: the ring failed; its ops fail with -failed_errno */
} nvt_worker_stats;

/*
 * Create the engine: start the workers' I/O threads, which create their rings
 * and register the buffer and files (falling back to unregistered on
 * failure). Worker 0 registers the buffer; the others clone its registration
 * (IORING_REGISTER_CLONE_BUFFERS, kernel 6.12+: nothing pinned twice) or,
 * where the kernel lacks it, register again (counted against RLIMIT_MEMLOCK
 * once per ring). A registration refused for memory leaves that ring plain.
 * `buf` and `fds` are borrowed and must outlive nvt_engine_close; `fds` is
 * copied. Blocks until the ring is ready.
 *
 * Returns 0 and sets *out, or -errno (a ring's setup failed, out of memory,
 * thread creation failed) with nothing left behind.
 */
int nvt_engine_open(nvt_engine **out, void *buf, size_t buf_len, const int *fds,
                    unsigned nfds, const nvt_config *cfg);

/* Worker count, and what worker `w` set up (w < nvt_engine_workers(e)). */
unsigned nvt_engine_workers(const nvt_engine *e);
void nvt_engine_get_info(const nvt_engine *e, unsigned w, nvt_engine_info *info);
/* Blocks while nvt_engine_close joins the threads (cpu_s is 0 once closed). */
void nvt_engine_worker_stats(nvt_engine *e, unsigned w, nvt_worker_stats *out);

/*
 * Mark worker `w`'s ring failed with `err` (> 0), as the I/O thread does when
 * its ring keeps refusing io_uring_enter: ops queued to it, and ops routed to
 * it later while no other worker serves their file, complete with -err; ops
 * already in its ring are reaped as usual. Other workers are untouched.
 * Returns 0 or -EINVAL. Exposed for tests of that path.
 */
int nvt_engine_fail_worker(nvt_engine *e, unsigned w, int err);

/*
 * Tests only: from now on every io_uring_enter of worker `w`'s thread fails
 * with -err instead of being made (0: stop failing), as a ring the kernel
 * keeps refusing would; NVT_RING_FAIL_TRIES of them fail the worker.
 * Returns 0, -EINVAL, or -ESHUTDOWN in a forked child.
 */
int nvt_engine_inject_enter_error(nvt_engine *e, unsigned w, int err);

/*
 * Queue `n` ops. Ops that fail validation (bad file_idx -> -EBADF, range
 * outside the buffer -> -EFAULT, negative file offset or bad kind -> -EINVAL)
 * and zero-length ops complete at once without I/O. Never blocks on I/O.
 *
 * Returns 0, -ESHUTDOWN after nvt_engine_close began (nothing queued), or
 * -ENOMEM (nothing queued).
 */
int nvt_engine_submit(nvt_engine *e, const nvt_op *ops, size_t n);

/*
 * Wait up to `timeout_s` (<= 0: do not wait) for at least one completion, then
 * swap the engine's done queue with `batch` (whose len must be 0): the caller
 * owns every completion now in `batch`. Returns at once with nothing once the
 * engine is closed and drained. A poll (timeout <= 0) that finds the done
 * queue empty returns without taking the mutex (a racy read of its length:
 * a completion queued meanwhile is returned by the next call).
 */
void nvt_engine_wait(nvt_engine *e, double timeout_s, nvt_completion_batch *batch);

/*
 * Stop: queued ops complete with -ECANCELED, ops in the rings finish, the I/O
 * threads exit (closing their rings, which unregisters everything). Blocks until
 * then, which is bounded: a failed ring (see nvt_engine_fail_worker) fails the
 * ops the kernel never took at once, and the ones it took after
 * NVT_STOP_GRACE_MS. Idempotent and safe to call from several threads.
 * Completions stay available to nvt_engine_wait. In a child forked from the
 * engine's process (whose copy has no threads, its rings closed at the fork:
 * see nvt_engine_ring.c), close, submit (-ESHUTDOWN) and wait do nothing.
 */
void nvt_engine_close(nvt_engine *e);

/*
 * Install (fn != NULL) or remove (fn == NULL) the completion hook. Blocks
 * until no worker is inside the hook it replaces, so once a removal returns
 * `ctx` is never touched again. Any thread; a no-op in a forked child (whose
 * copy runs no worker). The completions that submit or close complete at
 * once (refused, cancelled) never reach the hook.
 */
void nvt_engine_set_apply(nvt_engine *e, nvt_apply_fn fn, void *ctx);

/* How another extension module (nvmetier._table) reaches
 * nvt_engine_set_apply: a PyCapsule of this name (Engine.apply_hook() in
 * nvt_module.c) over this struct. */
#define NVT_APPLY_HOOK_CAPSULE "nvmetier._uring.apply_hook"
typedef struct {
    nvt_engine *engine;
    void (*set_apply)(nvt_engine *e, nvt_apply_fn fn, void *ctx);
    /* The count of completions published and not yet taken (atomic, read
     * with acquire as a hint: nvt_engine_done_hint): a poll that reads 0 need
     * not call the engine (a completion it misses is found by the next). */
    const size_t *done_hint;
} nvt_apply_hook_api;

/* Where the engine keeps its hint of completions waiting to be taken (see
 * nvt_apply_hook_api.done_hint); valid until nvt_engine_free. */
const size_t *nvt_engine_done_hint(const nvt_engine *e);

/* Free a closed engine. Completions not yet taken are dropped: take them
 * first with nvt_engine_wait(e, 0, ...) if their op_ids own resources. */
void nvt_engine_free(nvt_engine *e);

/*
 * Check that io_uring works: create a tiny ring and run one NOP.
 * Returns 0, or -errno with *stage naming the step that failed.
 */
int nvt_probe(const char **stage);

/* Ops that failed their tag (-EBADMSG; not -EKEYREVOKED), since open (racy counter). */
uint64_t nvt_engine_auth_failures(const nvt_engine *e);

#endif /* NVT_ENGINE_H */
