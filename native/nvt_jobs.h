/*
 * nvt_jobs: the per-process job path of nvmetier._table over the shared
 * table (nvt_core): ops and jobs (slabs), watches, deferred completions, and
 * the submit/poll path to an engine. Internal to the _table module: it works
 * on the CPython type's object (TableObject) and on the keys and lists vLLM
 * hands over, so it includes Python.h; the table's rules stay in nvt_core.
 *
 * Six units: nvt_jobs.c (the op and job slabs, a job's failed keys, the
 * allocation-failure test hook), nvt_job_submit.c (a job's keys and rows,
 * the store loop, submit_store/submit_load), nvt_job_load.c (the load loop:
 * keys to read ops, leases taken over), nvt_job_complete.c (completions,
 * job reports, watches, deferred completions, KV events, collect),
 * nvt_job_worker.c (the slot side of a completion, applied by an io_uring
 * worker before it publishes it) and nvt_leases.c (the step's lease grants:
 * lookup hits and lease_many, which release_leases drops and a load of the
 * same key object takes over). All but nvt_worker_apply run with the GIL
 * held on the thread that owns the Table (the scheduler thread);
 * nvt_worker_apply runs on the engine's I/O threads, without the GIL, and
 * reads only what nvt_job_worker.c lists.
 */
#ifndef NVT_JOBS_H
#define NVT_JOBS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "nvt_core.h"
#include "nvt_engine.h"

/* Why a key of a job failed; the first reason names the job's error, except
 * that a quiet one (MISSING: a load of a key that is not there; DROPPED: a
 * store left out for lack of resources, a full queue or an all-busy set) is
 * replaced by any fault that follows. A job whose failures are all quiet has
 * no error text: vLLM still sees success=False and exact successful_keys
 * (which its backpressure acts on), but nothing is logged as a fault. */
enum {
    FAIL_NONE = 0,
    FAIL_READ_IO,
    FAIL_WRITE_IO,
    FAIL_CHECKSUM,
    FAIL_RACED,
    FAIL_MISSING,
    FAIL_BADARG,
    FAIL_DROPPED
};

static inline int fail_quiet(int kind) { return kind == FAIL_MISSING || kind == FAIL_DROPPED; }

/* op_info.job of an op whose job stopped waiting for it (abandon_op). */
#define JOB_NONE UINT32_MAX

/* What an engine's worker did with an op's completion (op_info.applied;
 * nvt_job_worker.c), which nvt_apply_one then only accounts for:
 *   NONE       nothing: nvt_apply_one applies it (the thread engine, a busy
 *              set, anything but the common cases);
 *   PUBLISHED  a write that landed: its record written, then the slot READY;
 *   LOADED     a load that verified (or asked for no check) of the slot it
 *              leased: its pin released;
 *   LOADED_VERIFIED  the same, and that load was the slot's first verified
 *              one (its UNVERIFIED flag cleared);
 *   RECOVER    nothing, but the worker found the set's holder dead
 *              (EOWNERDEAD: it marked the mutex consistent, the repair is
 *              the scheduler thread's, see nvt_set_lock_after_death). */
enum { NVT_APPLIED_NONE = 0, NVT_APPLIED_PUBLISHED, NVT_APPLIED_LOADED, NVT_APPLIED_LOADED_VERIFIED, NVT_APPLIED_RECOVER };

/* One op in flight. Written by the scheduler thread before the op is
 * submitted and not changed while it is in flight (a worker reads it then,
 * and writes `applied`, `dead_holder` and `dead_inc` only), read back when
 * its completion is collected. */
typedef struct {
    uint32_t slot;
    uint32_t gen;
    uint64_t expected;
    uint32_t epoch; /* a read's lease grant: released at completion (leased) */
    uint8_t leased;
    uint8_t verify; /* a read's checksum is checked (configured, or the slot is unverified) */
    uint32_t job;
    uint32_t pos;
    uint8_t kind;
    uint8_t key_len;
    uint8_t in_use;
    uint8_t applied; /* NVT_APPLIED_*, by the worker (zeroed at alloc) */
    uint16_t dead_holder, dead_inc; /* RECOVER: the set's holder fields as the worker found them */
    char key[REC_KEY_MAX];
} op_info;

/* The op slab grows by blocks that never move (a worker reads an op's entry
 * while the scheduler thread allocates others): block 0 holds ops
 * [0, NVT_OP_BLOCK0), block b >= 1 ops [NVT_OP_BLOCK0 << (b-1), NVT_OP_BLOCK0 << b),
 * so the capacity doubles as it did when the slab was one array. */
#define NVT_OP_BLOCK0_SHIFT 10u
#define NVT_OP_BLOCK0 (1u << NVT_OP_BLOCK0_SHIFT)
#define NVT_OP_BLOCKS (33u - NVT_OP_BLOCK0_SHIFT) /* up to 2^32 ops */

static inline unsigned op_block_of(uint32_t i, uint32_t *first) {
    if (i < NVT_OP_BLOCK0) {
        *first = 0;
        return 0;
    }
    unsigned b = 32u - (unsigned)__builtin_clz(i >> NVT_OP_BLOCK0_SHIFT);
    *first = NVT_OP_BLOCK0 << (b - 1);
    return b;
}

typedef struct {
    int64_t job_id;
    uint32_t remaining;
    uint8_t is_load;
    uint8_t in_use;
    uint8_t first_fail;
    int first_errno;
    uint64_t moved;
    uint32_t *failed;
    uint32_t n_failed, cap_failed;
    /* Jobs of the submit/poll path only (NULL/0 for store_ops/load_ops jobs):
     * the job's keys as submitted (for successful_keys) and its start. */
    PyObject *keys;
    uint64_t start_ns;
    /* A store job of the submit/poll path with KV events on: its stored
     * event, placed in TableObject.events when it was submitted (ev_seq) and
     * holding the keys its writes published so far (`stored`, owned; the
     * event's list). Closed (NULL) once its last op is done: nvt_take_events
     * hands out nothing at or past an open one (see TableObject.events). */
    PyObject *stored;
    uint64_t ev_seq;
    /* A failed key could not be recorded (out of memory): every key of the
     * job is reported failed. */
    uint8_t oom;
    /* Done, but its report could not be built (out of memory): reported at
     * a later apply (TableObject.n_unreported). */
    uint8_t unreported;
} job_info;


/* One lease grant (nvt_leases.c): where, and what the slot and its record
 * said when it was granted; what a load that takes it over reads. */
typedef struct {
    uint64_t slot;      /* set * ways + way */
    uint64_t until_ms;  /* the grant's end (nvt_now_ms clock) */
    uint64_t payload;   /* the record's payload checksum */
    uint64_t stored_ns; /* the record's store time (retention) */
    uint64_t fp;        /* the key's fingerprint (a load's checksum seed) */
    uint32_t gen, epoch;
} nvt_grant;

/* A grant of this step, remembered for release_leases, and the key object
 * it was granted to. */
typedef struct nvt_held {
    nvt_grant grant;
    PyObject *key;    /* a reference to the key object leased, or NULL */
    uint32_t adopted; /* a load took it over: its completion releases it */
} nvt_held;

typedef struct {
    PyObject_HEAD
    Py_buffer tbuf, ibuf;
    int have_tbuf, have_ibuf;
    nvt_core core; /* the table itself: mappings, geometry, registry entry, counters */
    int64_t n_paths, slot_bytes, row_bytes, n_rows;
    /* The op slab (op_at): blocks that never move; n_ops_cap is written
     * atomically (a worker checks op ids against it). */
    op_info *op_blocks[NVT_OP_BLOCKS];
    uint32_t n_ops_cap, *op_free, n_op_free;
    job_info *jobs;
    uint32_t n_jobs_cap, *job_free, n_job_free, jobs_live;
    /* This step's lease grants (lookup hits, lease_many) and the map from a
     * leased key object to its newest grant (nvt_leases.c). */
    struct nvt_held *held;
    size_t n_held, cap_held;
    uint32_t *held_map; /* held index + 1, 0: empty; map_cap entries */
    size_t map_cap;
    unsigned map_bits;
    uint64_t held_round; /* release_leases so far: a held index is of one round */
    /* Stores of keys another write (any sharer's) was already writing: the
     * job finishes only once that write is no longer in flight, so a finished
     * store job always means its keys are there for everyone. */
    struct watch {
        uint32_t slot, gen, job, pos;
        uint64_t deadline_ms; /* past it the key fails (not stored by this job) */
    } *watches;
    size_t n_watches, cap_watches;
    /* Completions whose set could not be locked: applied at a later poll.
     * Past its deadline (watch_timeout_ms after it was first deferred) its
     * job gives up on it (the key fails) and it is applied jobless later. */
    struct deferred {
        nvt_completion c;
        uint64_t deadline_ms;
    } *deferred;
    size_t n_deferred, cap_deferred;
    /* The submit/poll path (bind): the engine's submit_raw and wait_raw, ops
     * handed to it and not yet collected, finished jobs not yet polled, and
     * KV events not yet taken. */
    PyObject *eng_submit, *eng_wait;
    uint32_t outstanding, max_queued_ops;
    int verify, events_on;
    PyObject *done;
    /* KV events, in the order a consumer must replay them: (removed, keys)
     * tuples, numbered in push order (events[0] is number ev_first, the next
     * push ev_next). A store job's one stored event takes its place when the
     * job is submitted and fills as its writes complete (job_info.stored);
     * the numbers of those still open, ascending, are ev_open. Why that
     * order is the truth for every key: a key's write completes after its
     * job's submit, so its removal (eviction at a later submit, invalidate,
     * checksum failure, expiry) always comes after that job's event; and a
     * key written again was claimed by a later submit, after the removal was
     * pushed (expired keys are pushed before a store job's event is placed).
     * take_events hands out the events before the first open one only: a
     * later removal may name one of its keys. */
    PyObject *events;
    uint64_t ev_first, ev_next;
    uint64_t *ev_open;
    size_t n_ev_open, cap_ev_open;
    /* Jobs done but not yet reported (job_info.unreported), and KV event
     * keys lost to out of memory (counted: kv_events_lost). */
    uint32_t n_unreported;
    unsigned long long events_lost;
    /* Keys whose slot this process freed because their retention passed
     * (the core's on_expired): one removal event at the next take_events. */
    PyObject *expired;
    /* The engine's completion hook (bind(..., apply_hook)): the capsule
     * (nvt_engine.h's nvt_apply_hook_api, a reference to the engine) while
     * installed, and the registry entry the worker names as a set's holder
     * (copied at install: detach() removes the hook first). */
    PyObject *apply_cap;
    uint16_t apply_holder, apply_holder_inc;
    /* The hooked engine's count of completions waiting (its done_hint, while
     * the hook is installed; NULL otherwise): nvt_collect's poll skips the
     * engine call while it reads 0. */
    const size_t *done_hint;
    /* The module's fork count when this Table was made: a forked child that
     * inherits it shares the parent's registry entry and OFD lock, so it must
     * not use it (the CPython type refuses; the child opens its own). */
    unsigned fork_gen;
} TableObject;

/* ------------------------------------------------------------ nvt_jobs.c */
int64_t nvt_op_alloc(TableObject *t);
int64_t nvt_job_alloc(TableObject *t, int64_t job_id, int is_load);
void nvt_job_fail(job_info *j, uint32_t pos, int kind, int err);
PyObject *nvt_seq_snapshot(PyObject *obj, const char *msg);
/* Tests only: after `after` more allocation points of the job path, the
 * next `count` fail as out of memory (count 0: none). Returns the points
 * passed since the previous call. */
unsigned long long nvt_test_fail_allocs(long long after, long long count);
/* An allocation point of the job path: 1 when the test hook above says this
 * one fails (the caller then acts as out of memory). */
int nvt_alloc_fails(void);

/* Op i of the slab (i < n_ops_cap). */
static inline op_info *op_at(const TableObject *t, uint32_t i) {
    uint32_t first;
    unsigned b = op_block_of(i, &first);
    return &t->op_blocks[b][i - first];
}

/* Slab entries go back to their free list (both sides of the job path). */
static inline void op_release(TableObject *t, uint32_t i) {
    op_at(t, i)->in_use = 0;
    t->op_free[t->n_op_free++] = i;
}

void nvt_close_stored_event(TableObject *t, job_info *j);

static inline void job_release(TableObject *t, uint32_t i) {
    nvt_close_stored_event(t, &t->jobs[i]); /* a job freed unfinished (unwound) too */
    Py_CLEAR(t->jobs[i].keys);
    t->jobs[i].in_use = 0;
    t->job_free[t->n_job_free++] = i;
    t->jobs_live--;
}

/* A KV event key that could not be recorded (out of memory): the op is
 * applied all the same, and the loss counted (kv_events_lost). */
static inline void event_lost(TableObject *t) {
    PyErr_Clear();
    t->events_lost++;
}

/* ------------------------------------------------------ nvt_job_submit.c */
/* A job's key as bytes (TypeError otherwise). */
static inline int nvt_key_arg(PyObject *key, const char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a key must be bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *p = PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
}

/* Row i of a job's rows (int32 or int64, rows_arg's view). */
static inline int64_t nvt_row_at(Py_buffer *v, Py_ssize_t i) {
    return v->itemsize == 4 ? (int64_t)((int32_t *)v->buf)[i] : ((int64_t *)v->buf)[i];
}

/* One op of a job: slot `slot`'s place in the data files, row `row` of the
 * primary, its checksum seed and whether its checksum is checked. */
static inline void nvt_fill_op(TableObject *t, nvt_op *op, uint32_t op_idx, uint64_t slot, int64_t row, int kind,
                    uint64_t seed, int checksum) {
    op->op_id = (void *)(uintptr_t)op_idx;
    op->file_idx = (int64_t)(slot % (uint64_t)t->n_paths);
    op->file_offset = (int64_t)(slot / (uint64_t)t->n_paths) * t->slot_bytes;
    op->buf_offset = row * t->row_bytes;
    op->length = t->row_bytes;
    op->seed = seed;
    op->kind = kind;
    op->checksum = checksum;
}

/* Fingerprints of a job's keys (into `local` when they fit, else a new
 * array: free it with nvt_free_fps), with the sets of the first keys
 * prefetched; a key with skip[i] >= 0 (a load's grant taken over) is left
 * unread, its fingerprint 0. NULL with an exception set on a bad key or out
 * of memory. */
uint64_t *nvt_job_fps(TableObject *t, PyObject *seq, Py_ssize_t m, uint64_t *local, Py_ssize_t n_local, int scan,
                      const int64_t *skip);
static inline void nvt_free_fps(uint64_t *fps, uint64_t *local) {
    if (fps && fps != local)
        PyMem_Free(fps);
}

/* Key `i` of a job fails for `kind` (see nvt_job_submit.c). */
int nvt_key_failed(TableObject *self, int64_t job, Py_ssize_t i, PyObject **list, int kind);
/* How many keys ahead nvt_ready_keys and the load loop prefetch the matching
 * ways (and twice that, the sets). 8, 16 and 32 measured alike
 * (docs/bench.md). */
#define NVT_READY_AHEAD 16
int nvt_locate(TableObject *t, PyObject *key, unsigned mask, uint64_t *set, int *w);
/* nvt_ready_keys' modes: READY only (contains_many), each READY key made the
 * most recent (touch), leased as a lookup hit is (lease_many), or each key's
 * state, READY or WRITING (states_many: out[i] is NVT_READY, NVT_WRITING, 0
 * when neither, or NVT_STATE_UNKNOWN when its set could not be locked). */
enum { NVT_READY_CONTAINS = 0, NVT_READY_TOUCH = 1, NVT_READY_LEASE = 2, NVT_READY_STATES = 3 };
#define NVT_STATE_UNKNOWN 0xFF
Py_ssize_t nvt_ready_keys(TableObject *self, PyObject *seq, Py_ssize_t m, uint8_t *out, int mode);

/* nvt_refresh.c: touch() of a finished request's `m` keys (`seq`, a tuple)
 * less those its load jobs (`loaded`: their key lists) marked, except in
 * the sets where another of its keys is marked. Returns the keys touched
 * READY plus those left to their load's mark, or -1 with an exception set. */
Py_ssize_t nvt_touch_refresh(TableObject *self, PyObject *seq, Py_ssize_t m, PyObject *loaded);
/* ------------------------------------------------------ nvt_leases.c */
/* Lease way w of set (locked) as a lookup hit, remembered for release_leases
 * (out of memory to remember it: it runs out on its own) and, with `key`,
 * for a load of that very key object to take over. */
void nvt_hold_lease(TableObject *self, uint64_t set, int w, uint64_t now, PyObject *key);
/* The newest grant of this step to the object `key` that no load took over
 * yet (its index in `held`), or -1. */
int64_t nvt_find_grant(TableObject *self, PyObject *key);
/* A load takes grant h over: copied to *g, left alone by release_leases. */
void nvt_take_grant(TableObject *self, int64_t h, nvt_grant *g);
/* End of a step: every grant no load took over released; the map emptied. */
void nvt_release_held(TableObject *self);
void nvt_held_free(TableObject *self);
int nvt_append_key(PyObject **list, const char *key, Py_ssize_t n);
PyObject *nvt_table_detached(void);
/* Whether the Table was detached while its arguments were read (a generator
 * or a sequence's __iter__/__getitem__/__index__ runs Python, which may call
 * detach()): the data path re-checks after reading them, since a slot
 * claimed then would name no live sharer (GUARD_ATTACHED checked before).
 * 1 with the RuntimeError set. */
static inline int nvt_args_detached(const TableObject *t) {
    if (t->core.me >= 0)
        return 0;
    nvt_table_detached();
    return 1;
}
/* A call's keys as a tuple (nvt_seq_snapshot), re-checked for a detach
 * while they were read (nvt_args_detached): a new reference, or NULL with
 * the exception set. contains_many, lease_many, states_many and touch. */
static inline PyObject *nvt_keys_arg(const TableObject *t, PyObject *keys) {
    PyObject *seq = nvt_seq_snapshot(keys, "keys must be a sequence");
    if (seq && nvt_args_detached(t))
        Py_CLEAR(seq);
    return seq;
}
Py_ssize_t nvt_job_args(TableObject *self, PyObject *keys, PyObject *rows_obj, PyObject **seq, Py_buffer *rows, PyObject **out);
int nvt_store_loop(TableObject *self, int64_t job_id, PyObject *seq, Py_ssize_t m, Py_buffer *rows, long long max_ops, int events, const char *skip, nvt_op *ops, Py_ssize_t *n_ops_io, int64_t *job_io, PyObject **failed, PyObject **evicted);
void nvt_store_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job);
PyObject *nvt_submit_job(TableObject *self, PyObject *args, int is_load);

/* ------------------------------------------------------ nvt_job_load.c */
int nvt_load_loop(TableObject *self, int64_t job_id, PyObject *seq, Py_ssize_t m, Py_buffer *rows, int verify, nvt_op *ops, Py_ssize_t *n_ops_io, int64_t *job_io, PyObject **missing);
void nvt_load_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job);

/* ------------------------------------------------------ nvt_job_worker.c */
int nvt_apply_hook_install(TableObject *t, PyObject *capsule);
void nvt_apply_hook_remove(TableObject *t);
void nvt_worker_apply(void *ctx, const nvt_completion *cs, size_t n);

/* ---------------------------------------------------- nvt_job_complete.c */
int nvt_apply_one(TableObject *t, const nvt_completion *c, int events, PyObject **stored, PyObject **removed);
void nvt_maybe_finish(TableObject *self, uint32_t ji, PyObject *finished);
int nvt_defer_reserve(TableObject *self, size_t n);
void nvt_defer(TableObject *self, const nvt_completion *c, uint64_t deadline_ms);
int nvt_apply_batch(TableObject *self, const nvt_completion *cs, Py_ssize_t n, int events, PyObject *finished, PyObject **stored, PyObject **removed);
int nvt_push_event(TableObject *self, int removed, PyObject *keys);
int nvt_open_stored_event(TableObject *self, uint32_t ji);
void nvt_flush_expired(TableObject *self);
PyObject *nvt_take_events(TableObject *self);
int nvt_collect(TableObject *self, PyObject *timeout);
PyObject *nvt_take_list(PyObject **slot);

#endif /* NVT_JOBS_H */
