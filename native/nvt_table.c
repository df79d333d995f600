/*
 * nvmetier._table: the per-process job path over the process-shared slot
 * table, and its CPython type. The table's rules (layout, set locks, ways,
 * leases, records, sharers, rebuild, sweep) are nvt_core.c, with no Python
 * in them; nvt_table.h has the shared layout and its lock rules.
 *
 * Owns, per process (a `Table` object): an nvt_core (this process's view of
 * the table: its registry entry and counters), the in-flight op slab and job
 * slab, watches, deferred completions, and the submit/poll binding to an
 * engine. The shared table and the index records belong to the store (mapped
 * by files.py).
 *
 * Threads: every method is called with the GIL held by the store's caller
 * (vLLM's scheduler thread, under its manager lock). Methods take set
 * mutexes for a few hundred nanoseconds each and never wait for I/O. Nothing
 * waits without bound on another process: a set mutex held by another
 * process is waited for at most SET_LOCK_WAIT_MS (the GIL released; a set
 * that timed out is only tried, not waited for, for SET_STALL_MS), after
 * which the key is a miss or a dropped store and a completion is retried at
 * later polls (for the watch timeout at most: then its key fails, and the
 * completion is applied without a job once the set can be locked); a store of
 * a key another sharer is writing waits at most the watch timeout, then
 * fails. A holder that dies is recovered through EOWNERDEAD (nvt_core.c).
 *
 * The data path turns a job's keys into an array of nvt_op (nvt_engine.h's
 * layout, op_id = an index into the op slab) that an engine takes as one
 * buffer, and applies an array of nvt_completion in one call: no Python
 * object per chunk on the caller's thread beyond the keys vLLM hands us.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvt_core.h"
#include "nvt_engine.h"
#include "nvt_hash.h"


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
    char key[REC_KEY_MAX];
} op_info;

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
} job_info;


typedef struct {
    PyObject_HEAD
    Py_buffer tbuf, ibuf;
    int have_tbuf, have_ibuf;
    nvt_core core; /* the table itself: mappings, geometry, registry entry, counters */
    int64_t n_paths, slot_bytes, row_bytes, n_rows;
    op_info *ops;
    uint32_t n_ops_cap, *op_free, n_op_free;
    job_info *jobs;
    uint32_t n_jobs_cap, *job_free, n_job_free, jobs_live;
    uint64_t *held; /* (slot, lease end) pairs of this step's lookup hits */
    size_t n_held, cap_held;
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
    PyObject *done, *events;
} TableObject;

/* ------------------------------------------------------------------ helpers */

static int key_arg(PyObject *key, const char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a key must be bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *p = PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
}

/* Fingerprints of a job's keys (into `local` when they fit, else a new
 * array: free it with free_fps), with the sets of the first keys prefetched.
 * NULL with an exception set on a bad key or out of memory. */
static uint64_t *job_fps(TableObject *t, PyObject *seq, Py_ssize_t m, uint64_t *local, Py_ssize_t n_local,
                         int scan) {
    uint64_t *fps = m <= n_local ? local : PyMem_Malloc((size_t)m * sizeof(uint64_t));
    if (!fps) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        const char *k;
        Py_ssize_t n;
        if (key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n) < 0) {
            if (fps != local)
                PyMem_Free(fps);
            return NULL;
        }
        fps[i] = nvt_xxh3(k, (size_t)n, 0);
        if (i < PREFETCH_AHEAD)
            prefetch_set(&t->core, fps[i] % t->core.n_sets, scan);
    }
    return fps;
}

static inline void free_fps(uint64_t *fps, uint64_t *local) {
    if (fps && fps != local)
        PyMem_Free(fps);
}


/* Parse `key`, lock its set and find the key in the states of `mask`.
 * Returns 0 with the set locked (*w: the way, or -1), 1 when the set could not
 * be locked (*w = -1, nothing held), or -1 with an exception set. */
static int locate(TableObject *t, PyObject *key, unsigned mask, uint64_t *set, int *w) {
    const char *k;
    Py_ssize_t n;
    if (key_arg(key, &k, &n) < 0)
        return -1;
    uint64_t fp = nvt_xxh3(k, (size_t)n, 0);
    *set = fp % t->core.n_sets;
    *w = -1;
    if (nvt_set_lock(&t->core, *set) != 0)
        return 1;
    *w = nvt_find_way(&t->core, *set, fp, k, n, mask);
    return 0;
}

/* ------------------------------------------------------------------ slabs */
/* Double a slab of `size`-byte entries (first: `first` entries) and its free
 * list; new entries are zeroed (so free: in_use = 0, which a stale completion
 * id must find). Returns -1 when out of memory, the slab unchanged. */
static int slab_grow(void **items, size_t size, uint32_t **free_list, uint32_t *n_free, uint32_t *cap,
                     uint32_t first) {
    uint32_t old = *cap, grown = old ? old * 2 : first;
    char *it = PyMem_Realloc(*items, (size_t)grown * size);
    if (!it)
        return -1;
    *items = it;
    uint32_t *fr = PyMem_Realloc(*free_list, (size_t)grown * sizeof(uint32_t));
    if (!fr)
        return -1;
    *free_list = fr;
    memset(it + (size_t)old * size, 0, (size_t)(grown - old) * size);
    for (uint32_t i = grown; i > old; i--)
        fr[(*n_free)++] = i - 1;
    *cap = grown;
    return 0;
}

static int64_t op_alloc(TableObject *t) {
    if (!t->n_op_free && slab_grow((void **)&t->ops, sizeof(op_info), &t->op_free, &t->n_op_free,
                                   &t->n_ops_cap, 1024) < 0)
        return -1;
    uint32_t i = t->op_free[--t->n_op_free];
    t->ops[i].in_use = 1;
    return i;
}

static void op_release(TableObject *t, uint32_t i) {
    t->ops[i].in_use = 0;
    t->op_free[t->n_op_free++] = i;
}

static int64_t job_alloc(TableObject *t, int64_t job_id, int is_load) {
    if (!t->n_job_free && slab_grow((void **)&t->jobs, sizeof(job_info), &t->job_free, &t->n_job_free,
                                    &t->n_jobs_cap, 64) < 0)
        return -1;
    uint32_t i = t->job_free[--t->n_job_free];
    job_info *j = &t->jobs[i];
    j->job_id = job_id;
    j->remaining = 0;
    j->is_load = (uint8_t)is_load;
    j->in_use = 1;
    j->first_fail = FAIL_NONE;
    j->first_errno = 0;
    j->moved = 0;
    j->n_failed = 0;
    j->keys = NULL;
    j->start_ns = 0;
    t->jobs_live++;
    return i;
}

static void job_release(TableObject *t, uint32_t i) {
    Py_CLEAR(t->jobs[i].keys);
    t->jobs[i].in_use = 0;
    t->job_free[t->n_job_free++] = i;
    t->jobs_live--;
}

static int job_fail(job_info *j, uint32_t pos, int kind, int err) {
    if (!j->in_use)
        return 0; /* the stand-in job of an abandoned op (apply_one) */
    if (j->n_failed == j->cap_failed) {
        uint32_t cap = j->cap_failed ? j->cap_failed * 2 : 8;
        uint32_t *f = PyMem_Realloc(j->failed, cap * sizeof(uint32_t));
        if (!f)
            return -1;
        j->failed = f;
        j->cap_failed = cap;
    }
    j->failed[j->n_failed++] = pos;
    if (j->first_fail == FAIL_NONE || (fail_quiet(j->first_fail) && !fail_quiet(kind))) {
        j->first_fail = (uint8_t)kind;
        j->first_errno = err;
    }
    return 0;
}

/* Rows: a C-contiguous buffer of int32 or int64 (vLLM's chunk_ids, read in
 * place), or else any sequence of ints (copied into an int64 array that the
 * view then owns, so PyBuffer_Release frees it like any view). */
static int rows_arg(PyObject *obj, Py_buffer *view, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        const char *f = view->format ? view->format : "";
        char c = f[0] == '<' || f[0] == '=' || f[0] == '@' ? f[1] : f[0];
        if ((view->itemsize == 4 || view->itemsize == 8) && view->len / view->itemsize == n && c &&
            strchr("iqlIQL", c))
            return 0;
        PyBuffer_Release(view);
    }
    PyErr_Clear();
    PyObject *seq = PySequence_Fast(obj, "rows must be a sequence of ints");
    if (!seq)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "rows must be %zd ints, one per key", n);
        return -1;
    }
    PyObject *packed = PyBytes_FromStringAndSize(NULL, (n ? n : 1) * 8);
    if (!packed) {
        Py_DECREF(seq);
        return -1;
    }
    int64_t *out = (int64_t *)PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            Py_DECREF(packed);
            return -1;
        }
        out[i] = v;
    }
    Py_DECREF(seq);
    int rc = PyObject_GetBuffer(packed, view, PyBUF_SIMPLE);
    Py_DECREF(packed); /* the view holds it */
    if (rc < 0)
        return -1;
    view->itemsize = 8;
    view->len = n * 8;
    return 0;
}

static inline int64_t row_at(Py_buffer *v, Py_ssize_t i) {
    return v->itemsize == 4 ? (int64_t)((int32_t *)v->buf)[i] : ((int64_t *)v->buf)[i];
}

static int append_pos(PyObject **list, Py_ssize_t pos) {
    if (!*list && !(*list = PyList_New(0)))
        return -1;
    PyObject *v = PyLong_FromSsize_t(pos);
    if (!v)
        return -1;
    int r = PyList_Append(*list, v);
    Py_DECREF(v);
    return r;
}

static int append_key(PyObject **list, const char *key, Py_ssize_t n) {
    if (!*list && !(*list = PyList_New(0)))
        return -1;
    PyObject *v = PyBytes_FromStringAndSize(key, n);
    if (!v)
        return -1;
    int r = PyList_Append(*list, v);
    Py_DECREF(v);
    return r;
}

static void fill_op(TableObject *t, nvt_op *op, uint32_t op_idx, uint64_t slot, int64_t row, int kind,
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

/* ------------------------------------------------------------------ type */
static void Table_dealloc(TableObject *self) {
    if (self->jobs) {
        for (uint32_t i = 0; i < self->n_jobs_cap; i++) {
            PyMem_Free(self->jobs[i].failed);
            Py_XDECREF(self->jobs[i].keys);
        }
    }
    Py_XDECREF(self->eng_submit);
    Py_XDECREF(self->eng_wait);
    Py_XDECREF(self->done);
    Py_XDECREF(self->events);
    PyMem_Free(self->jobs);
    PyMem_Free(self->job_free);
    PyMem_Free(self->ops);
    PyMem_Free(self->op_free);
    PyMem_Free(self->held);
    PyMem_Free(self->watches);
    PyMem_Free(self->deferred);
    if (self->have_tbuf)
        PyBuffer_Release(&self->tbuf);
    if (self->have_ibuf)
        PyBuffer_Release(&self->ibuf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}


/* The core's hooks around a wait for another process: the GIL is released. */
static void *gil_release(void) { return PyEval_SaveThread(); }

static void gil_restore(void *state) { PyEval_RestoreThread(state); }

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"table", "index", "lock_fd", "n_paths", "slot_bytes", "row_bytes",
                             "n_rows", "lease_ns", "watch_timeout_ns", NULL};
    PyObject *tobj, *iobj;
    int lock_fd;
    long long n_paths, slot_bytes, row_bytes, n_rows;
    unsigned long long lease_ns, watch_ns;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOi$LLLLKK", kwlist, &tobj, &iobj, &lock_fd, &n_paths,
                                     &slot_bytes, &row_bytes, &n_rows, &lease_ns, &watch_ns))
        return NULL;
    TableObject *self = (TableObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->core.me = -1;
    self->done = PyList_New(0);
    self->events = PyList_New(0);
    if (!self->done || !self->events)
        goto fail;
    if (PyObject_GetBuffer(tobj, &self->tbuf, PyBUF_WRITABLE) < 0)
        goto fail;
    self->have_tbuf = 1;
    if (PyObject_GetBuffer(iobj, &self->ibuf, PyBUF_WRITABLE) < 0)
        goto fail;
    self->have_ibuf = 1;
    /* Every header field is read once, checked, and only the checked copies
     * used (another process may write the header; a corrupt one is refused). */
    const char *why = nvt_core_init(&self->core, self->tbuf.buf, (uint64_t)self->tbuf.len, self->ibuf.buf,
                                    (uint64_t)self->ibuf.len, lock_fd);
    if (why) {
        PyErr_Format(PyExc_ValueError, "the table is not usable: %s (format() it, or remove the store)", why);
        goto fail;
    }
    if (n_paths < 1 || self->core.n_slots % (uint64_t)n_paths || row_bytes < 1 || slot_bytes < row_bytes ||
        n_rows < 0) {
        PyErr_SetString(PyExc_ValueError, "table, index and geometry do not match");
        goto fail;
    }
    self->core.unblock = gil_release;
    self->core.reblock = gil_restore;
    self->n_paths = n_paths;
    self->slot_bytes = slot_bytes;
    self->row_bytes = row_bytes;
    self->n_rows = n_rows;
    self->core.lease_ms = lease_ns / 1000000ULL > 0x40000000ULL ? 0x40000000u
                     : (uint32_t)(lease_ns / 1000000ULL ? lease_ns / 1000000ULL : 1);
    self->core.watch_timeout_ms = watch_ns / 1000000ULL;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

PyDoc_STRVAR(attach_doc, "attach() -> (index, incarnation)\n\n"
                         "Claim a free entry of the sharer registry: an OFD write lock on its byte\n"
                         "of the lock file (dropped by the kernel when this process dies), then\n"
                         "pid, incarnation and time. Raises OSError when all entries are taken.");

static PyObject *Table_attach(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    int i = nvt_attach(&self->core);
    if (i == -EUSERS) {
        errno = EUSERS;
        return PyErr_Format(PyExc_OSError, "the store already has %d sharers attached", NVT_MAX_SHARERS);
    }
    if (i < 0) {
        errno = -i;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(iI)", i, self->core.my_inc);
}

PyDoc_STRVAR(detach_doc, "detach()\n\nLeave the sharer registry (pid cleared, OFD lock released).");

static PyObject *Table_detach(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    nvt_detach(&self->core);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lookup_doc, "lookup(key) -> bool\n\n"
                         "Whether key is READY (its record holds this key). A hit is leased:\n"
                         "no sharer evicts it for lease_ns, and counts as an access.");

static PyObject *Table_lookup(TableObject *self, PyObject *key) {
    uint64_t set;
    int w, hit = 0;
    int r = locate(self, key, 1u << NVT_READY, &set, &w);
    if (r < 0)
        return NULL;
    if (r == 0) {
        if (w >= 0) {
            slot_ref s = slot_at(&self->core, set, (uint32_t)w);
            uint64_t now = nvt_now_ms();
            uint32_t epoch;
            int pinned = lease_grant(s, now, now + self->core.lease_ms, &epoch);
            *s.last = tick(&self->core, set);
            hit = 1;
            if (pinned && self->n_held == self->cap_held) {
                size_t cap = self->cap_held ? self->cap_held * 2 : 256;
                uint64_t *h = PyMem_Realloc(self->held, cap * 2 * sizeof(uint64_t));
                if (h) {
                    self->held = h;
                    self->cap_held = cap;
                }
            }
            if (pinned && self->n_held < self->cap_held) {
                self->held[2 * self->n_held] = set * self->core.ways + (uint64_t)w;
                self->held[2 * self->n_held + 1] = (uint64_t)*s.gen << 32 | epoch;
                self->n_held++;
            } else if (pinned) { /* no memory to remember it: the lease runs out on its own */
                PyErr_Clear();
            }
        }
        set_unlock(&self->core, set);
    }
    if (hit) {
        self->core.c.hits++;
        Py_RETURN_TRUE;
    }
    self->core.c.misses++;
    Py_RETURN_FALSE;
}

/* The slot holding key READY, -1 when none, or -2 with an exception set. */
static int64_t ready_slot(TableObject *self, PyObject *key) {
    uint64_t set;
    int w, r = locate(self, key, 1u << NVT_READY, &set, &w);
    if (r < 0)
        return -2;
    if (r == 0)
        set_unlock(&self->core, set);
    return w < 0 ? -1 : (int64_t)(set * self->core.ways + (uint64_t)w);
}

PyDoc_STRVAR(contains_doc, "contains(key) -> bool\n\nWhether key is READY; no lease, no count.");

static PyObject *Table_contains(TableObject *self, PyObject *key) {
    int64_t slot = ready_slot(self, key);
    return slot == -2 ? NULL : PyBool_FromLong(slot >= 0);
}

PyDoc_STRVAR(slot_of_doc, "slot_of(key) -> int | None\n\nThe slot holding key READY, or None.");

static PyObject *Table_slot_of(TableObject *self, PyObject *key) {
    int64_t slot = ready_slot(self, key);
    if (slot == -2)
        return NULL;
    if (slot < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(slot);
}

PyDoc_STRVAR(touch_doc, "touch(keys)\n\nMark READY keys most recently used.");

static PyObject *Table_touch(TableObject *self, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t set;
        int w, r = locate(self, PySequence_Fast_GET_ITEM(seq, i), 1u << NVT_READY, &set, &w);
        if (r < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (r)
            continue;
        if (w >= 0)
            *slot_at(&self->core, set, (uint32_t)w).last = tick(&self->core, set);
        set_unlock(&self->core, set);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}


/* The common arguments of a job: keys as a fast sequence, rows as an int
 * buffer of as many, and an output buffer for one op per key. Returns the key
 * count, or -1 with an exception set and nothing held. */
static Py_ssize_t job_args(PyObject *keys, PyObject *rows_obj, PyObject **seq, Py_buffer *rows,
                           PyObject **out) {
    *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!*seq)
        return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(*seq);
    if (rows_arg(rows_obj, rows, m) < 0) {
        Py_DECREF(*seq);
        return -1;
    }
    *out = PyBytes_FromStringAndSize(NULL, (m ? m : 1) * (Py_ssize_t)sizeof(nvt_op));
    if (!*out) {
        PyBuffer_Release(rows);
        Py_DECREF(*seq);
        return -1;
    }
    return m;
}

PyDoc_STRVAR(store_ops_doc,
             "store_ops(job_id, keys, rows, max_ops, events) -> (ops, failed, evicted, pending)\n\n"
             "Claim a slot for every key to write (rows: int32/int64 buffer) and return the\n"
             "ops as packed nvt_op (bytes). Keys already stored or being stored by any sharer\n"
             "are skipped (success); keys beyond max_ops or whose set is all busy are dropped\n"
             "(counted, and failed). failed: positions of keys that are not stored (bad key or\n"
             "row, or dropped), or None. evicted: keys displaced (when events), or None. Each claimed\n"
             "slot is WRITING and its old record zeroed before its op exists. pending: ops\n"
             "plus keys waiting for another write of the same key (0: the job is done).");

/* A key of a store job left out for lack of resources (a full queue, a set
 * whose ways are all busy or leased, a set lock that could not be taken): it
 * is not stored, so the job reports it failed (quiet: no error text). Goes to
 * `*failed` (store_ops) or the job (submit_store). -1 on out of memory. */
static int store_dropped(TableObject *self, int64_t job, Py_ssize_t i, PyObject **failed) {
    if (failed)
        return append_pos(failed, i);
    if (job_fail(&self->jobs[job], (uint32_t)i, FAIL_DROPPED, 0) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Claim a slot and build an op for every key of a store job (store_ops and
 * submit_store). `*job` is the job (-1: allocated here at the first op or
 * watch). Keys with a bad length or row go to `*failed` (store_ops), or fail
 * in the job when `failed` is NULL (submit_store). Positions whose `skip`
 * byte is set are left out (success). Returns 0, or -1 with an exception set
 * (unwind with store_unwind). */
static int store_loop(TableObject *self, int64_t job_id, PyObject *seq, Py_ssize_t m, Py_buffer *rows,
                      long long max_ops, int events, const char *skip, nvt_op *ops, Py_ssize_t *n_ops_io,
                      int64_t *job_io, PyObject **failed, PyObject **evicted) {
    Py_ssize_t n_ops = *n_ops_io;
    int64_t job = *job_io;
    int rc = 0;
    uint64_t now = nvt_now_ms();
    uint64_t fps_local[64], *fps = job_fps(self, seq, m, fps_local, 64, 1);
    if (!fps)
        goto error;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + PREFETCH_AHEAD < m)
            prefetch_set(&self->core, fps[i + PREFETCH_AHEAD] % self->core.n_sets, 1);
        if (skip && skip[i])
            continue;
        const char *k = NULL;
        Py_ssize_t n = 0;
        key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n); /* checked in the first pass */
        int64_t row = row_at(rows, i);
        if (n > REC_KEY_MAX || row < 0 || row >= self->n_rows) {
            if (failed ? append_pos(failed, i) < 0
                       : job_fail(&self->jobs[job], (uint32_t)i, FAIL_BADARG, 0) < 0) {
                if (!failed)
                    PyErr_NoMemory();
                goto error;
            }
            continue;
        }
        if (n_ops >= max_ops) {
            self->core.c.stores_dropped_queue_full++;
            if (store_dropped(self, job, i, failed) < 0)
                goto error;
            continue;
        }
        uint64_t fp = fps[i], set = fp % self->core.n_sets;
        if (nvt_set_lock(&self->core, set) != 0) {
            self->core.c.stores_dropped_set_busy++;
            if (store_dropped(self, job, i, failed) < 0)
                goto error;
            continue;
        }
        int evict;
        int w = nvt_claim_way(&self->core, set, fp, k, n, now, &evict);
        if (w <= -3) { /* being written: finish this job only once that write is done */
            uint32_t ww = (uint32_t)(-3 - w);
            uint32_t gen = *slot_at(&self->core, set, ww).gen;
            set_unlock(&self->core, set);
            self->core.c.stores_skipped_present++;
            if (job < 0 && (job = job_alloc(self, job_id, 0)) < 0) {
                PyErr_NoMemory();
                goto error;
            }
            if (self->n_watches == self->cap_watches) {
                size_t cap = self->cap_watches ? self->cap_watches * 2 : 64;
                struct watch *wl = PyMem_Realloc(self->watches, cap * sizeof(struct watch));
                if (!wl) {
                    PyErr_NoMemory();
                    goto error;
                }
                self->watches = wl;
                self->cap_watches = cap;
            }
            struct watch *wt = &self->watches[self->n_watches++];
            wt->slot = (uint32_t)(set * self->core.ways + ww);
            wt->gen = gen;
            wt->job = (uint32_t)job;
            wt->pos = (uint32_t)i;
            wt->deadline_ms = now + self->core.watch_timeout_ms;
            self->jobs[job].remaining++;
            continue;
        }
        if (w < 0) {
            set_unlock(&self->core, set);
            if (w == -2) {
                self->core.c.stores_skipped_present++;
            } else {
                self->core.c.stores_dropped_set_busy++;
                if (store_dropped(self, job, i, failed) < 0)
                    goto error;
            }
            continue;
        }
        uint64_t slot = set * self->core.ways + (uint64_t)w;
        slot_ref s = slot_at(&self->core, set, (uint32_t)w);
        if (evict) {
            self->core.c.evictions++;
            const unsigned char *r = record(&self->core, slot);
            if (events && r[5] <= REC_KEY_MAX && nvt_record_has_key(&self->core, slot, (const char *)r + REC_KEY_OFFSET, r[5]) &&
                append_key(evicted, (const char *)r + REC_KEY_OFFSET, r[5]) < 0) {
                set_unlock(&self->core, set);
                goto error;
            }
        }
        if (job < 0 && (job = job_alloc(self, job_id, 0)) < 0) {
            set_unlock(&self->core, set);
            PyErr_NoMemory();
            goto error;
        }
        int64_t oi = op_alloc(self);
        if (oi < 0) {
            set_unlock(&self->core, set);
            PyErr_NoMemory();
            goto error;
        }
        /* Mark the slot ours before its record changes: a death from here on
         * leaves a WRITING slot of a dead sharer, which is reclaimed. */
        uint8_t old = *s.state;
        if (old == NVT_EMPTY)
            self->core.d_used++;
        else if (old == NVT_READY)
            self->core.d_ready--;
        *s.owner = (uint8_t)(self->core.me < 0 ? 0 : self->core.me);
        *s.owner_inc = (uint16_t)self->core.my_inc;
        *s.stamp = now;
        *s.pins = 0; /* an evicted slot's lease had ended */
        (*s.epoch)++;
        (*s.gen)++;
        *s.fp = fp;
        *s.tag = tag_of(fp);
        __atomic_store_n(s.state, NVT_WRITING, __ATOMIC_RELEASE);
        /* The old record stops being visible before the data changes. An
         * EMPTY slot has none: every way to EMPTY zeroes the record first
         * (clear_slot_locked; the rebuild zeroes every record it does not
         * load), so a fresh claim leaves the index page alone. */
        if (old != NVT_EMPTY)
            zero_record(&self->core, slot);
        op_info *o = &self->ops[oi];
        o->slot = (uint32_t)slot;
        o->gen = *s.gen;
        set_unlock(&self->core, set);
        o->expected = 0;
        o->job = (uint32_t)job;
        o->pos = (uint32_t)i;
        o->kind = NVT_OP_WRITE;
        o->key_len = (uint8_t)n;
        memcpy(o->key, k, (size_t)n);
        fill_op(self, &ops[n_ops++], (uint32_t)oi, slot, row, NVT_OP_WRITE, fp, 1);
        self->jobs[job].remaining++;
    }
    goto done;
error:
    rc = -1;
done:
    free_fps(fps, fps_local);
    publish_counts(&self->core);
    *n_ops_io = n_ops;
    *job_io = job;
    return rc;
}

/* Undo a store_loop that failed: ops already claimed stay claimed until
 * their WRITING slots are released here; the job and its watches go. */
static void store_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job) {
    for (Py_ssize_t i = 0; i < n_ops; i++) {
        uint32_t oi = (uint32_t)(uintptr_t)ops[i].op_id;
        op_info *o = &self->ops[oi];
        uint64_t set = o->slot / self->core.ways;
        if (nvt_set_lock(&self->core, set) == 0) {
            slot_ref s = slot_at(&self->core, set, o->slot % self->core.ways);
            if (*s.state == NVT_WRITING && *s.gen == o->gen)
                nvt_clear_slot_locked(&self->core, s, o->slot);
            set_unlock(&self->core, set);
        }
        op_release(self, oi);
    }
    if (job >= 0) {
        size_t keep = 0;
        for (size_t i = 0; i < self->n_watches; i++)
            if (self->watches[i].job != (uint32_t)job)
                self->watches[keep++] = self->watches[i];
        self->n_watches = keep;
        job_release(self, (uint32_t)job);
    }
    publish_counts(&self->core);
}

static PyObject *Table_store_ops(TableObject *self, PyObject *args) {
    long long job_id, max_ops;
    PyObject *keys, *rows_obj;
    int events;
    if (!PyArg_ParseTuple(args, "LOOLp", &job_id, &keys, &rows_obj, &max_ops, &events))
        return NULL;
    PyObject *seq, *out;
    Py_buffer rows;
    Py_ssize_t m = job_args(keys, rows_obj, &seq, &rows, &out);
    if (m < 0)
        return NULL;
    PyObject *failed = NULL, *evicted = NULL;
    int64_t job = -1;
    Py_ssize_t n_ops = 0;
    nvt_op *ops = (nvt_op *)PyBytes_AS_STRING(out);
    int rc = store_loop(self, job_id, seq, m, &rows, max_ops, events, NULL, ops, &n_ops, &job, &failed, &evicted);
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    if (rc < 0) {
        store_unwind(self, ops, n_ops, job);
        Py_DECREF(out);
        Py_XDECREF(failed);
        Py_XDECREF(evicted);
        return NULL;
    }
    if (_PyBytes_Resize(&out, n_ops * (Py_ssize_t)sizeof(nvt_op)) < 0) {
        Py_XDECREF(failed);
        Py_XDECREF(evicted);
        return NULL;
    }
    unsigned int pending = job >= 0 ? self->jobs[job].remaining : 0;
    PyObject *res = Py_BuildValue("(NOOI)", out, failed ? failed : Py_None, evicted ? evicted : Py_None,
                                  pending);
    Py_XDECREF(failed);
    Py_XDECREF(evicted);
    return res;
}

PyDoc_STRVAR(load_ops_doc,
             "load_ops(job_id, keys, rows, verify) -> (ops, missing)\n\n"
             "Ops (packed nvt_op) reading every READY key into its row; each slot is leased\n"
             "and touched. An op checks its payload checksum when verify, and always on a\n"
             "slot still unverified (rebuilt after an unclean shutdown, or reclaimed from\n"
             "a dead writer) until one check passed. missing: positions of keys not READY\n"
             "(or a bad row), or None.");

/* Lease every READY key of a load job and build its read op (load_ops and
 * submit_load). Keys not READY (or with a bad row) go to `*missing`
 * (load_ops), or fail in the job as MISSING when `missing` is NULL
 * (submit_load). Returns 0, or -1 with an exception set (unwind with
 * load_unwind). */
static int load_loop(TableObject *self, int64_t job_id, PyObject *seq, Py_ssize_t m, Py_buffer *rows,
                     int verify, nvt_op *ops, Py_ssize_t *n_ops_io, int64_t *job_io, PyObject **missing) {
    Py_ssize_t n_ops = *n_ops_io;
    int64_t job = *job_io;
    int rc = 0;
    uint64_t now = nvt_now_ms(), until = now + self->core.lease_ms;
    uint64_t fps_local[64], *fps = job_fps(self, seq, m, fps_local, 64, 0);
    if (!fps)
        goto error;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + PREFETCH_AHEAD < m)
            prefetch_set(&self->core, fps[i + PREFETCH_AHEAD] % self->core.n_sets, 0);
        const char *k = NULL;
        Py_ssize_t n = 0;
        key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n); /* checked by job_fps */
        int64_t row = row_at(rows, i);
        uint64_t fp = fps[i], set = fp % self->core.n_sets;
        int w = -1, leased = 0, check = verify;
        uint32_t gen = 0, epoch = 0;
        uint64_t expected = 0;
        if (n <= REC_KEY_MAX && row >= 0 && row < self->n_rows && nvt_set_lock(&self->core, set) == 0) {
            w = nvt_find_way(&self->core, set, fp, k, n, 1u << NVT_READY);
            if (w >= 0) {
                slot_ref s = slot_at(&self->core, set, (uint32_t)w);
                leased = lease_grant(s, now, until, &epoch); /* released at its completion */
                check |= (*s.flags & NVT_FLAG_UNVERIFIED) != 0;
                *s.last = tick(&self->core, set);
                gen = *s.gen;
                expected = record_payload(&self->core, set * self->core.ways + (uint64_t)w);
            }
            set_unlock(&self->core, set);
        }
        if (w < 0) {
            self->core.c.load_keys_missing++;
            if (missing ? append_pos(missing, i) < 0
                        : job_fail(&self->jobs[job], (uint32_t)i, FAIL_MISSING, 0) < 0) {
                if (!missing)
                    PyErr_NoMemory();
                goto error;
            }
            continue;
        }
        if (job < 0 && (job = job_alloc(self, job_id, 1)) < 0) {
            PyErr_NoMemory();
            goto error;
        }
        int64_t oi = op_alloc(self);
        if (oi < 0) {
            PyErr_NoMemory();
            goto error;
        }
        uint64_t slot = set * self->core.ways + (uint64_t)w;
        op_info *o = &self->ops[oi];
        o->slot = (uint32_t)slot;
        o->gen = gen;
        o->expected = expected;
        o->epoch = epoch;
        o->leased = (uint8_t)leased;
        o->verify = (uint8_t)check;
        o->job = (uint32_t)job;
        o->pos = (uint32_t)i;
        o->kind = NVT_OP_READ;
        o->key_len = 0;
        fill_op(self, &ops[n_ops++], (uint32_t)oi, slot, row, NVT_OP_READ, fp, check);
        self->jobs[job].remaining++;
    }
    goto done;
error:
    rc = -1;
done:
    free_fps(fps, fps_local);
    *n_ops_io = n_ops;
    *job_io = job;
    return rc;
}

/* Undo a load_loop that failed (its leases run out on their own). */
static void load_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job) {
    for (Py_ssize_t i = 0; i < n_ops; i++)
        op_release(self, (uint32_t)(uintptr_t)ops[i].op_id);
    if (job >= 0)
        job_release(self, (uint32_t)job);
}

static PyObject *Table_load_ops(TableObject *self, PyObject *args) {
    long long job_id;
    PyObject *keys, *rows_obj;
    int verify;
    if (!PyArg_ParseTuple(args, "LOOp", &job_id, &keys, &rows_obj, &verify))
        return NULL;
    PyObject *seq, *out;
    Py_buffer rows;
    Py_ssize_t m = job_args(keys, rows_obj, &seq, &rows, &out);
    if (m < 0)
        return NULL;
    PyObject *missing = NULL;
    int64_t job = -1;
    Py_ssize_t n_ops = 0;
    nvt_op *ops = (nvt_op *)PyBytes_AS_STRING(out);
    int rc = load_loop(self, job_id, seq, m, &rows, verify, ops, &n_ops, &job, &missing);
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    if (rc < 0) {
        load_unwind(self, ops, n_ops, job);
        Py_DECREF(out);
        Py_XDECREF(missing);
        return NULL;
    }
    if (_PyBytes_Resize(&out, n_ops * (Py_ssize_t)sizeof(nvt_op)) < 0) {
        Py_XDECREF(missing);
        return NULL;
    }
    PyObject *res = Py_BuildValue("(NO)", out, missing ? missing : Py_None);
    Py_XDECREF(missing);
    return res;
}

static PyObject *fail_text(job_info *j) {
    switch (j->first_fail) {
    case FAIL_READ_IO:
        return PyUnicode_FromFormat("read failed: %s (errno %d)", strerror(j->first_errno), j->first_errno);
    case FAIL_WRITE_IO:
        return PyUnicode_FromFormat("write failed: %s (errno %d)", strerror(j->first_errno), j->first_errno);
    case FAIL_CHECKSUM:
        return PyUnicode_FromString("checksum mismatch");
    case FAIL_RACED:
        return PyUnicode_FromString("slot reused by another store while loading");
    case FAIL_BADARG:
        return PyUnicode_FromString("bad key length or row");
    default: /* none, or only keys that were not there: a miss, not an error */
        Py_RETURN_NONE;
    }
}

/* Apply one completion. Returns 0, 1 when its set could not be locked
 * (nothing changed: apply it again later, see defer), or -1 on out of memory. */
static int apply_one(TableObject *t, const nvt_completion *c, int events, PyObject **stored,
                     PyObject **removed) {
    uintptr_t raw = (uintptr_t)c->op_id;
    uint32_t oi = (uint32_t)raw;
    if (raw >= t->n_ops_cap || !t->ops[oi].in_use)
        return 0; /* not ours (a stale completion): ignore */
    op_info *o = &t->ops[oi];
    job_info none; /* an abandoned op's job: not in use, so job_fail ignores it */
    memset(&none, 0, sizeof(none));
    job_info *j = o->job == JOB_NONE ? &none : &t->jobs[o->job];
    uint64_t set = o->slot / t->core.ways;
    slot_ref s = slot_at(&t->core, set, o->slot % t->core.ways);
    int ok = c->result == t->row_bytes;
    if (nvt_set_lock(&t->core, set) != 0)
        return 1; /* its holder is stopped or slow: the op stays in flight */
    if (o->kind == NVT_OP_WRITE) {
        if (ok && (*s.state) == NVT_WRITING && (*s.gen) == o->gen) {
            /* The data is written: only now does the record appear, then the slot. */
            nvt_write_record(&t->core, o->slot, o->key, o->key_len, c->checksum);
            (*s.stamp) = 0;
            (*s.pins) = 0;
            (*s.owner) = 0;
            (*s.last) = tick(&t->core, set);
            __atomic_store_n(s.state, NVT_READY, __ATOMIC_RELEASE);
            t->core.d_ready++;
            set_unlock(&t->core, set);
            t->core.c.ops_written++;
            t->core.c.bytes_written += (unsigned long long)t->row_bytes;
            j->moved += (uint64_t)t->row_bytes;
            if (events && append_key(stored, o->key, o->key_len) < 0)
                return -1;
        } else {
            if ((*s.state) == NVT_WRITING && (*s.gen) == o->gen)
                nvt_clear_slot_locked(&t->core, s, o->slot); /* the record is still zero */
            set_unlock(&t->core, set);
            t->core.c.write_errors++;
            if (job_fail(j, o->pos, FAIL_WRITE_IO, ok ? EIO : (int)-c->result) < 0)
                return -1;
        }
    } else {
        int same = (*s.gen) == o->gen && (*s.state) == NVT_READY;
        if (o->leased)
            lease_release(s, o->gen, o->epoch); /* this load's own pin; others' stay */
        if (!same) {
            set_unlock(&t->core, set);
            t->core.c.loads_raced++;
            if (job_fail(j, o->pos, FAIL_RACED, 0) < 0)
                return -1;
        } else if (c->result == -ECANCELED) {
            /* Never read (the engine refused or cancelled the op): nothing is
             * known about the slot, which stays READY for every sharer. */
            set_unlock(&t->core, set);
            t->core.c.loads_cancelled++;
            if (job_fail(j, o->pos, FAIL_READ_IO, ECANCELED) < 0)
                return -1;
        } else if (!ok) {
            /* A read error: a miss until rewritten (BAD, not freed: a
             * transient error is not proven corruption). */
            (*s.state) = NVT_BAD;
            t->core.d_ready--;
            set_unlock(&t->core, set);
            t->core.c.read_errors++;
            if (job_fail(j, o->pos, FAIL_READ_IO, (int)-c->result) < 0)
                return -1;
        } else if (o->verify && c->checksum != o->expected) {
            /* Proven corruption of this very slot: a miss, and the slot is freed. */
            const unsigned char *r = record(&t->core, o->slot);
            int kl = r[5];
            if (events && kl <= REC_KEY_MAX && append_key(removed, (const char *)r + REC_KEY_OFFSET, kl) < 0) {
                set_unlock(&t->core, set);
                return -1;
            }
            nvt_clear_slot_locked(&t->core, s, o->slot);
            set_unlock(&t->core, set);
            t->core.c.checksum_failures++;
            if (job_fail(j, o->pos, FAIL_CHECKSUM, 0) < 0)
                return -1;
        } else {
            if (o->verify && (*s.flags & NVT_FLAG_UNVERIFIED)) {
                *s.flags &= (uint8_t)~NVT_FLAG_UNVERIFIED; /* verified once: trusted now */
                t->core.c.loads_verified_unverified++;
            }
            set_unlock(&t->core, set);
            t->core.c.ops_read++;
            t->core.c.bytes_read += (unsigned long long)t->row_bytes;
            j->moved += (uint64_t)t->row_bytes;
        }
    }
    op_release(t, oi);
    j->remaining--;
    return 0;
}

PyDoc_STRVAR(complete_doc,
             "complete(completions, events) -> (finished, stored, removed)\n\n"
             "Apply packed nvt_completion records. A write publishes its record, then its\n"
             "slot READY; a read succeeds only when its slot's generation is unchanged and,\n"
             "when its op was verified (load_ops' verify, or an unverified slot), the\n"
             "checksum matches. finished: (job_id, is_load, moved_bytes,\n"
             "failed_positions or None, first_error or None) per job whose last op this was.\n"
             "stored/removed: keys for KV events (events), or None.");

/* A job of the submit/poll path is done: its entry joins `done` for the next
 * poll(), and the job is freed. The entry: (job_id, success, successful_keys
 * or None, transfer_time_s, moved_bytes, error or None, is_load); error is
 * None when every failed key was only missing (a miss, not a fault). */
static int finish_submitted(TableObject *self, uint32_t ji) {
    job_info *j = &self->jobs[ji];
    PyObject *ok = Py_None;
    Py_INCREF(ok);
    if (j->n_failed) {
        if (j->is_load)
            self->core.c.load_jobs_failed++;
        else
            self->core.c.store_jobs_failed++;
    }
    if (j->n_failed && j->keys) {
        Py_ssize_t m = PySequence_Fast_GET_SIZE(j->keys);
        char *bad = PyMem_Calloc((size_t)(m ? m : 1), 1);
        Py_DECREF(ok);
        ok = bad ? PyList_New(0) : NULL;
        if (!ok) {
            PyMem_Free(bad);
            if (!PyErr_Occurred())
                PyErr_NoMemory();
            return -1;
        }
        for (uint32_t f = 0; f < j->n_failed; f++)
            if ((Py_ssize_t)j->failed[f] < m)
                bad[j->failed[f]] = 1;
        for (Py_ssize_t i = 0; i < m; i++) {
            if (!bad[i] && PyList_Append(ok, PySequence_Fast_GET_ITEM(j->keys, i)) < 0) {
                PyMem_Free(bad);
                Py_DECREF(ok);
                return -1;
            }
        }
        PyMem_Free(bad);
    }
    PyObject *text = fail_text(j);
    if (!text) {
        Py_DECREF(ok);
        return -1;
    }
    double secs = (double)(now_mono_ns() - j->start_ns) / 1e9;
    PyObject *item = Py_BuildValue("(LONdKNO)", (long long)j->job_id, j->n_failed ? Py_False : Py_True, ok,
                                   j->start_ns ? secs : 0.0, (unsigned long long)j->moved, text,
                                   j->is_load ? Py_True : Py_False);
    job_release(self, ji);
    if (!item || PyList_Append(self->done, item) < 0) {
        Py_XDECREF(item);
        return -1;
    }
    Py_DECREF(item);
    return 0;
}

/* Append job ji to `finished` (and free it) when its last op or watch is done
 * (a submit/poll job, or any job when `finished` is NULL: to `done`). */
static int maybe_finish(TableObject *self, uint32_t ji, PyObject *finished) {
    job_info *j = &self->jobs[ji];
    if (j->remaining)
        return 0;
    if (j->keys || !finished)
        return finish_submitted(self, ji);
    PyObject *failed = Py_None, *text;
    Py_INCREF(failed);
    if (j->n_failed) {
        Py_DECREF(failed);
        if (!(failed = PyList_New(j->n_failed)))
            return -1;
        for (uint32_t f = 0; f < j->n_failed; f++)
            PyList_SET_ITEM(failed, f, PyLong_FromUnsignedLong(j->failed[f]));
    }
    if (!(text = fail_text(j))) {
        Py_DECREF(failed);
        return -1;
    }
    PyObject *item = Py_BuildValue("(LOKNN)", (long long)j->job_id, j->is_load ? Py_True : Py_False,
                                   (unsigned long long)j->moved, failed, text);
    job_release(self, ji);
    if (!item || PyList_Append(finished, item) < 0) {
        Py_XDECREF(item);
        return -1;
    }
    Py_DECREF(item);
    return 0;
}

/* Resolve watches (stores of keys another write was already writing). A
 * watched key counts as stored by this job only if its slot is READY with
 * the generation the watch saw (that write published it). It fails (quiet:
 * not stored by this job, counted) when that write failed, was cancelled or
 * its writer died (the slot left WRITING at that generation), or when it is
 * still WRITING past the watch's deadline (a stopped or hung writer). A set
 * that cannot be locked leaves the watch pending until its deadline. */
static int check_watches(TableObject *self, PyObject *finished) {
    size_t keep = 0;
    uint64_t now = nvt_now_ms();
    for (size_t i = 0; i < self->n_watches; i++) {
        struct watch wt = self->watches[i];
        uint64_t set = wt.slot / self->core.ways;
        int pending = 1, stored = 0;
        if (nvt_set_lock(&self->core, set) == 0) {
            slot_ref s = slot_at(&self->core, set, wt.slot % self->core.ways);
            if ((*s.gen) == wt.gen)
                nvt_reclaim_if_dead_locked(&self->core, s, wt.slot, now);
            pending = (*s.state) == NVT_WRITING && (*s.gen) == wt.gen;
            stored = (*s.state) == NVT_READY && (*s.gen) == wt.gen;
            set_unlock(&self->core, set);
        }
        if (pending && now < wt.deadline_ms) {
            self->watches[keep++] = wt;
            continue;
        }
        if (!stored) {
            if (pending)
                self->core.c.stores_dropped_watch_timeout++;
            else
                self->core.c.stores_dropped_watch_failed++;
            if (job_fail(&self->jobs[wt.job], wt.pos, FAIL_DROPPED, 0) < 0) {
                PyErr_NoMemory();
                pending = -1;
            }
        }
        self->jobs[wt.job].remaining--;
        if (pending < 0 || maybe_finish(self, wt.job, finished) < 0) {
            /* keep the rest consistent: compact what is left, then fail */
            for (size_t r = i + 1; r < self->n_watches; r++)
                self->watches[keep++] = self->watches[r];
            self->n_watches = keep;
            return -1;
        }
    }
    self->n_watches = keep;
    return 0;
}

/* Keep a completion whose set could not be locked, to apply at a later
 * poll (its op stays in flight, its job unfinished until `deadline_ms`, 0: a
 * new deferral). -1 on out of memory. */
static int defer(TableObject *self, const nvt_completion *c, uint64_t deadline_ms) {
    if (self->n_deferred == self->cap_deferred) {
        size_t cap = self->cap_deferred ? self->cap_deferred * 2 : 64;
        struct deferred *d = PyMem_Realloc(self->deferred, cap * sizeof(struct deferred));
        if (!d) {
            PyErr_NoMemory();
            return -1;
        }
        self->deferred = d;
        self->cap_deferred = cap;
    }
    if (!deadline_ms) {
        deadline_ms = nvt_now_ms() + self->core.watch_timeout_ms;
        self->core.c.completions_deferred++;
    }
    self->deferred[self->n_deferred].c = *c;
    self->deferred[self->n_deferred].deadline_ms = deadline_ms;
    self->n_deferred++;
    return 0;
}

/* A deferred completion past its deadline: its job stops waiting for it (the
 * key fails quietly: not stored, or not loaded) and may finish; the op stays,
 * jobless, until its set can be locked (then its slot is published or freed,
 * or its lease released). -1 on out of memory. */
static int abandon_op(TableObject *self, uint32_t oi, PyObject *finished) {
    op_info *o = &self->ops[oi];
    uint32_t ji = o->job;
    o->job = JOB_NONE;
    self->core.c.completions_abandoned++;
    job_info *j = &self->jobs[ji];
    if (job_fail(j, o->pos, FAIL_DROPPED, 0) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    j->remaining--;
    return maybe_finish(self, ji, finished);
}

/* Apply one completion, or defer it; then finish its job if that was its last op. */
static int apply_or_defer(TableObject *self, const nvt_completion *c, uint64_t deadline_ms, int events,
                          PyObject *finished, PyObject **stored, PyObject **removed) {
    uintptr_t raw = (uintptr_t)c->op_id;
    uint32_t oi = (uint32_t)raw;
    int live = raw < self->n_ops_cap && self->ops[oi].in_use;
    uint32_t ji = live ? self->ops[oi].job : JOB_NONE;
    int r = apply_one(self, c, events, stored, removed);
    if (r < 0)
        return -1;
    if (r > 0) {
        if (deadline_ms && ji != JOB_NONE && nvt_now_ms() >= deadline_ms && abandon_op(self, oi, finished) < 0)
            return -1;
        return defer(self, c, deadline_ms);
    }
    if (ji != JOB_NONE && maybe_finish(self, ji, finished) < 0)
        return -1;
    return 0;
}

/* Apply the completions deferred by earlier calls (each is tried once). */
static int apply_deferred(TableObject *self, int events, PyObject *finished, PyObject **stored,
                          PyObject **removed) {
    size_t n = self->n_deferred;
    if (!n)
        return 0;
    struct deferred *old = self->deferred;
    self->deferred = NULL;
    self->n_deferred = self->cap_deferred = 0;
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        if (rc == 0 &&
            apply_or_defer(self, &old[i].c, old[i].deadline_ms, events, finished, stored, removed) < 0)
            rc = -1;
        else if (rc < 0 && defer(self, &old[i].c, old[i].deadline_ms) < 0) /* keep the rest for later */
            PyErr_Clear();
    }
    PyMem_Free(old);
    return rc;
}

/* Apply `n` completions, then resolve watches; finished jobs go to
 * `finished` (store_ops/load_ops jobs) or `done` (submitted jobs). */
static int apply_batch(TableObject *self, const nvt_completion *cs, Py_ssize_t n, int events,
                       PyObject *finished, PyObject **stored, PyObject **removed) {
    if (apply_deferred(self, events, finished, stored, removed) < 0)
        return -1;
    /* Prefetch (prefetch_set's comment): each op's slab entry, then once
     * those arrive, its set's head and state line and its record. */
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t raw = (uintptr_t)cs[i].op_id;
        if (raw < self->n_ops_cap)
            __builtin_prefetch(&self->ops[raw], 0);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t raw = (uintptr_t)cs[i].op_id;
        if (raw < self->n_ops_cap && self->ops[raw].in_use) {
            uint32_t slot = self->ops[raw].slot;
            prefetch_set(&self->core, slot / self->core.ways, 0);
            __builtin_prefetch(record(&self->core, slot), 1);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (apply_or_defer(self, &cs[i], 0, events, finished, stored, removed) < 0)
            return -1;
    if (self->n_watches && check_watches(self, finished) < 0)
        return -1;
    return 0;
}

static PyObject *Table_complete(TableObject *self, PyObject *args) {
    Py_buffer comps;
    int events;
    if (!PyArg_ParseTuple(args, "y*p", &comps, &events))
        return NULL;
    Py_ssize_t n = comps.len / (Py_ssize_t)sizeof(nvt_completion);
    PyObject *finished = PyList_New(0), *stored = NULL, *removed = NULL;
    if (!finished)
        goto error;
    if (apply_batch(self, comps.buf, n, events, finished, &stored, &removed) < 0)
        goto error;
    PyBuffer_Release(&comps);
    publish_counts(&self->core);
    PyObject *res = Py_BuildValue("(NOO)", finished, stored ? stored : Py_None, removed ? removed : Py_None);
    Py_XDECREF(stored);
    Py_XDECREF(removed);
    return res;
error:
    PyBuffer_Release(&comps);
    publish_counts(&self->core);
    Py_XDECREF(finished);
    Py_XDECREF(stored);
    Py_XDECREF(removed);
    return NULL;
}

/* ------------------------------------------------------ submit/poll path */
/* The calls vLLM makes once per job (submit_store, submit_load) and once per
 * poll (poll) each cross into C once: the ops go to the bound engine's
 * submit_raw, its completions come back through wait_raw, and a finished job
 * comes out as one tuple, so vLLM's threads pay per job and per poll, not per
 * Python statement. store_ops/load_ops/complete stay the primitives that the
 * table's model test drives one step at a time. */
static PyObject *py_zero_s, *py_empty_tuple;

PyDoc_STRVAR(bind_doc, "bind(submit_raw, wait_raw, max_queued_ops, verify, events)\n\n"
                       "The engine the submit/poll path uses (None, None: unbind), how many ops may\n"
                       "be outstanding before stores are dropped, checksum verification of loads,\n"
                       "and whether KV events are kept for take_events().");

static PyObject *Table_bind(TableObject *self, PyObject *args) {
    PyObject *submit, *wait;
    unsigned int max_q;
    int verify, events;
    if (!PyArg_ParseTuple(args, "OOIpp", &submit, &wait, &max_q, &verify, &events))
        return NULL;
    Py_XSETREF(self->eng_submit, submit == Py_None ? NULL : Py_NewRef(submit));
    Py_XSETREF(self->eng_wait, wait == Py_None ? NULL : Py_NewRef(wait));
    self->max_queued_ops = max_q;
    self->verify = verify;
    self->events_on = events;
    Py_RETURN_NONE;
}

static int push_event(TableObject *self, int removed, PyObject *keys) {
    PyObject *ev = Py_BuildValue("(OO)", removed ? Py_True : Py_False, keys);
    int rc = ev ? PyList_Append(self->events, ev) : -1;
    Py_XDECREF(ev);
    return rc;
}

/* Apply what the engine completed, waiting up to `timeout` (a float) for it,
 * and the completions deferred earlier, and resolve watches. */
static int collect(TableObject *self, PyObject *timeout) {
    PyObject *comps = NULL;
    Py_buffer b = {0};
    Py_ssize_t n = 0;
    if (self->outstanding && self->eng_wait) {
        comps = PyObject_CallOneArg(self->eng_wait, timeout);
        if (!comps)
            return -1;
        if (PyObject_GetBuffer(comps, &b, PyBUF_SIMPLE) < 0) {
            Py_DECREF(comps);
            return -1;
        }
        n = b.len / (Py_ssize_t)sizeof(nvt_completion);
        self->outstanding = (uint64_t)n >= self->outstanding ? 0 : self->outstanding - (uint32_t)n;
    }
    int rc = 0;
    if (n || self->n_deferred || self->n_watches) {
        PyObject *stored = NULL, *removed = NULL;
        rc = apply_batch(self, n ? b.buf : NULL, n, self->events_on, NULL, &stored, &removed);
        if (rc == 0 && stored)
            rc = push_event(self, 0, stored);
        if (rc == 0 && removed)
            rc = push_event(self, 1, removed);
        Py_XDECREF(stored);
        Py_XDECREF(removed);
        publish_counts(&self->core);
    }
    if (comps) {
        PyBuffer_Release(&b);
        Py_DECREF(comps);
    }
    return rc;
}

/* submit_store / submit_load: see their docs. */
static PyObject *submit_job(TableObject *self, PyObject *args, int is_load) {
    long long job_id;
    PyObject *keys, *rows_obj, *skip_obj = Py_None;
    if (!PyArg_ParseTuple(args, is_load ? "LOO" : "LOO|O", &job_id, &keys, &rows_obj, &skip_obj))
        return NULL;
    if (!self->eng_submit) {
        PyErr_SetString(PyExc_RuntimeError, "no engine bound to the table (bind() first)");
        return NULL;
    }
    PyObject *seq, *out;
    Py_buffer rows;
    Py_ssize_t m = job_args(keys, rows_obj, &seq, &rows, &out);
    if (m < 0)
        return NULL;
    const char *skip = NULL;
    if (skip_obj != Py_None) {
        if (!PyBytes_Check(skip_obj) || PyBytes_GET_SIZE(skip_obj) != m) {
            PyErr_Format(PyExc_ValueError, "skip must be None or %zd bytes", m);
            goto fail_args;
        }
        skip = PyBytes_AS_STRING(skip_obj);
    }
    int64_t job = job_alloc(self, job_id, is_load);
    if (job < 0) {
        PyErr_NoMemory();
        goto fail_args;
    }
    self->jobs[job].keys = Py_NewRef(seq);
    self->jobs[job].start_ns = now_mono_ns();
    nvt_op *ops = (nvt_op *)PyBytes_AS_STRING(out);
    Py_ssize_t n_ops = 0;
    PyObject *evicted = NULL;
    int rc;
    if (is_load) {
        rc = load_loop(self, job_id, seq, m, &rows, self->verify, ops, &n_ops, &job, NULL);
    } else {
        long long room = (long long)self->max_queued_ops - (long long)self->outstanding;
        rc = store_loop(self, job_id, seq, m, &rows, room > 0 ? room : 0, self->events_on, skip, ops, &n_ops,
                        &job, NULL, &evicted);
    }
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    if (rc == 0 && evicted)
        rc = push_event(self, 1, evicted);
    Py_XDECREF(evicted);
    if (rc < 0) {
        if (is_load)
            load_unwind(self, ops, n_ops, job);
        else
            store_unwind(self, ops, n_ops, job);
        Py_DECREF(out);
        return NULL;
    }
    PyObject *err = Py_None;
    Py_INCREF(err);
    if (n_ops) {
        /* The engine takes exactly this job's ops: `out` itself when every key
         * got one, else a copy of the used part (out stays, so a failed copy
         * can still be unwound). */
        Py_ssize_t used = n_ops * (Py_ssize_t)sizeof(nvt_op);
        PyObject *batch = used == PyBytes_GET_SIZE(out) ? Py_NewRef(out)
                                                        : PyBytes_FromStringAndSize(PyBytes_AS_STRING(out), used);
        PyObject *r = batch ? PyObject_CallOneArg(self->eng_submit, batch) : NULL;
        Py_XDECREF(batch);
        if (r) {
            Py_DECREF(r);
            self->outstanding += (uint32_t)n_ops;
        } else {
            /* The engine refused (closed), or no memory for the copy: the job
             * fails, never the caller; its slots are released at once. */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            for (Py_ssize_t i = 0; i < n_ops; i++) {
                nvt_completion c = {ops[i].op_id, -ECANCELED, 0};
                int r = apply_one(self, &c, 0, NULL, NULL);
                if (r < 0 || (r > 0 && defer(self, &c, 0) < 0)) /* only out of memory */
                    PyErr_Clear();
            }
            publish_counts(&self->core);
            Py_DECREF(err);
            err = value ? PyObject_Str(value) : NULL;
            if (!err) {
                PyErr_Clear();
                err = PyUnicode_FromString("engine refused the ops");
            }
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (!err) {
                Py_DECREF(out);
                return NULL;
            }
        }
    }
    Py_DECREF(out);
    if (maybe_finish(self, (uint32_t)job, NULL) < 0) {
        Py_DECREF(err);
        return NULL;
    }
    return err;
fail_args:
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(submit_store_doc,
             "submit_store(job_id, keys, rows, skip=None) -> None or str\n\n"
             "store_ops, then the ops to the bound engine, as one job that poll() reports.\n"
             "Keys with a bad length or row fail the job, and so do keys dropped for lack of\n"
             "resources (over max_queued_ops, or an all-busy set; no error text). Keys already\n"
             "stored, being stored (the job then waits for that write) or whose skip byte is\n"
             "set (admission) are left out and succeed. Returns None, or the engine's error\n"
             "when it refused the ops (they then fail).");

static PyObject *Table_submit_store(TableObject *self, PyObject *args) { return submit_job(self, args, 0); }

PyDoc_STRVAR(submit_load_doc,
             "submit_load(job_id, keys, rows) -> None or str\n\n"
             "load_ops, then the ops to the bound engine, as one job that poll() reports.\n"
             "A key not READY fails at once (as missing: the job's error stays None).");

static PyObject *Table_submit_load(TableObject *self, PyObject *args) { return submit_job(self, args, 1); }

PyDoc_STRVAR(poll_doc, "poll() -> list of finished jobs, or ()\n\n"
                       "Apply the engine's completions (never waits) and return the jobs that\n"
                       "finished since the last poll: (job_id, success, successful_keys or None,\n"
                       "transfer_time_s, moved_bytes, error or None, is_load).");

/* Hand over the list in *slot, leaving a new empty one there. */
static PyObject *take_list(PyObject **slot) {
    PyObject *fresh = PyList_New(0);
    if (!fresh)
        return NULL;
    PyObject *out = *slot;
    *slot = fresh;
    return out;
}

static PyObject *Table_poll(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    if ((self->outstanding || self->n_watches || self->n_deferred) && collect(self, py_zero_s) < 0)
        return NULL;
    if (!PyList_GET_SIZE(self->done))
        return Py_NewRef(py_empty_tuple);
    return take_list(&self->done);
}

PyDoc_STRVAR(collect_doc, "collect(timeout_s)\n\n"
                          "Apply the engine's completions, waiting up to timeout_s for the first\n"
                          "(the engine's wait_raw releases the GIL); finished jobs wait for poll().");

static PyObject *Table_collect(TableObject *self, PyObject *timeout) {
    if (!PyFloat_Check(timeout)) {
        PyErr_SetString(PyExc_TypeError, "timeout_s must be a float");
        return NULL;
    }
    if (collect(self, timeout) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_events_doc, "take_events() -> list of (removed, keys)\n\n"
                              "KV events (stores, evictions, removals) since the last call\n"
                              "(bind(events=True)).");

static PyObject *Table_take_events(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    return take_list(&self->events);
}

PyDoc_STRVAR(inflight_doc, "inflight() -> (ops_outstanding, jobs_in_flight)\n\n"
                           "Ops handed to the engine and not yet collected; jobs not yet finished.");

static PyObject *Table_inflight(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(II)", self->outstanding, self->jobs_live);
}

PyDoc_STRVAR(release_leases_doc, "release_leases()\n\n"
                                 "End of a step: drop the leases of this step's lookup hits that no\n"
                                 "load (and no other sharer) extended since.");

static PyObject *Table_release_leases(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    for (size_t i = 0; i < self->n_held; i++) {
        uint64_t slot = self->held[2 * i], grant = self->held[2 * i + 1], set = slot / self->core.ways;
        if (nvt_set_lock(&self->core, set) != 0)
            continue; /* the lease runs out on its own */
        lease_release(slot_at(&self->core, set, (uint32_t)(slot % self->core.ways)), (uint32_t)(grant >> 32),
                      (uint32_t)grant);
        set_unlock(&self->core, set);
    }
    self->n_held = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(invalidate_doc, "invalidate(key) -> bool\n\n"
                             "Free key's slot (record first). False when absent, being written, or\n"
                             "leased by a lookup or load. A removal is a KV event (bind(events=True)).");

static PyObject *Table_invalidate(TableObject *self, PyObject *key) {
    uint64_t set;
    int w, done = 0;
    int r = locate(self, key, (1u << NVT_READY) | (1u << NVT_BAD), &set, &w);
    if (r < 0)
        return NULL;
    if (r == 0) {
        if (w >= 0) {
            slot_ref s = slot_at(&self->core, set, (uint32_t)w);
            if (!leased_locked(s, nvt_now_ms())) {
                nvt_clear_slot_locked(&self->core, s, set * self->core.ways + (uint64_t)w);
                done = 1;
            }
        }
        set_unlock(&self->core, set);
    }
    publish_counts(&self->core);
    if (done && self->events_on) {
        PyObject *keys = Py_BuildValue("[O]", key);
        int rc = keys ? push_event(self, 1, keys) : -1;
        Py_XDECREF(keys);
        if (rc < 0)
            return NULL;
    }
    return PyBool_FromLong(done);
}

PyDoc_STRVAR(sweep_doc, "sweep() -> int\n\n"
                        "Reclaim the WRITING slots of sharers that are gone, in every set, and\n"
                        "recount the used/ready gauges. Returns the slots reclaimed.");

static PyObject *Table_sweep(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(nvt_sweep(&self->core));
}

PyDoc_STRVAR(load_doc,
             "load(slots, unverified)\n\n"
             "Rebuild: mark READY every slot of `slots` (int64 buffer) whose record the\n"
             "caller proved valid, with its fingerprint from the record's key; `slots` in\n"
             "the order of the records' store times, oldest first (the recency order).\n"
             "unverified: the store was not closed cleanly (a crash or a power loss may have\n"
             "left a record over another key's bytes): every loaded slot is checked at its\n"
             "next load, whatever verify_checksums says. Only while no other sharer is attached.");

static PyObject *Table_load(TableObject *self, PyObject *args) {
    PyObject *arg;
    int unverified;
    if (!PyArg_ParseTuple(args, "Op", &arg, &unverified))
        return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (v.itemsize != 8) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "slots must be an int64 buffer");
        return NULL;
    }
    nvt_rebuild(&self->core, v.buf, (size_t)(v.len / 8), unverified);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(counters_doc, "counters() -> dict\n\nThis process's cumulative counters.");

static PyObject *Table_counters(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    nvt_counters *c = &self->core.c;
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "hits", c->hits, "misses", c->misses, "evictions",
        c->evictions, "checksum_failures", c->checksum_failures, "read_errors", c->read_errors,
        "write_errors", c->write_errors, "loads_raced", c->loads_raced, "stores_skipped_present",
        c->stores_skipped_present, "stores_dropped_set_busy", c->stores_dropped_set_busy,
        "stores_dropped_queue_full", c->stores_dropped_queue_full, "load_keys_missing",
        c->load_keys_missing, "ops_written", c->ops_written, "ops_read", c->ops_read, "bytes_written",
        c->bytes_written, "bytes_read", c->bytes_read, "dead_slots_reclaimed", c->dead_reclaimed,
        "lock_recoveries", c->lock_recoveries, "load_jobs_failed", c->load_jobs_failed,
        "store_jobs_failed", c->store_jobs_failed, "loads_cancelled", c->loads_cancelled,
        "loads_verified_unverified", c->loads_verified_unverified,
        "stores_dropped_watch_timeout", c->stores_dropped_watch_timeout, "stores_dropped_watch_failed",
        c->stores_dropped_watch_failed, "set_lock_timeouts", c->set_lock_timeouts, "completions_deferred",
        c->completions_deferred, "completions_abandoned", c->completions_abandoned);
}

PyDoc_STRVAR(usage_doc, "usage() -> (used, ready, watches, jobs_in_flight)\n\n"
                        "Slots holding a key and READY slots over all sharers (gauges), and this\n"
                        "process's stores waiting for another write of their key, and jobs in flight.");

static PyObject *Table_usage(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    publish_counts(&self->core);
    int64_t used = __atomic_load_n(&self->core.hdr->used, __ATOMIC_RELAXED);
    int64_t ready = __atomic_load_n(&self->core.hdr->ready, __ATOMIC_RELAXED);
    return Py_BuildValue("(LLII)", (long long)(used < 0 ? 0 : used), (long long)(ready < 0 ? 0 : ready),
                         (unsigned int)self->n_watches, self->jobs_live);
}

PyDoc_STRVAR(hold_set_doc, "_hold_set(set) -> bool\n\n"
                           "Tests only: take a set's mutex and keep it (as a sharer stopped or\n"
                           "killed inside a critical section would). False when not taken.");

static PyObject *Table_hold_set(TableObject *self, PyObject *arg) {
    unsigned long long set = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (set >= self->core.n_sets) {
        PyErr_SetString(PyExc_ValueError, "no such set");
        return NULL;
    }
    return PyBool_FromLong(nvt_set_lock(&self->core, set) == 0);
}

PyDoc_STRVAR(release_set_doc, "_release_set(set)\n\nTests only: release a mutex _hold_set took.");

static PyObject *Table_release_set(TableObject *self, PyObject *arg) {
    unsigned long long set = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (set >= self->core.n_sets) {
        PyErr_SetString(PyExc_ValueError, "no such set");
        return NULL;
    }
    set_unlock(&self->core, set);
    Py_RETURN_NONE;
}

static PyMethodDef Table_methods[] = {
    {"_hold_set", (PyCFunction)Table_hold_set, METH_O, hold_set_doc},
    {"_release_set", (PyCFunction)Table_release_set, METH_O, release_set_doc},
    {"attach", (PyCFunction)Table_attach, METH_NOARGS, attach_doc},
    {"detach", (PyCFunction)Table_detach, METH_NOARGS, detach_doc},
    {"lookup", (PyCFunction)Table_lookup, METH_O, lookup_doc},
    {"contains", (PyCFunction)Table_contains, METH_O, contains_doc},
    {"touch", (PyCFunction)Table_touch, METH_O, touch_doc},
    {"slot_of", (PyCFunction)Table_slot_of, METH_O, slot_of_doc},
    {"store_ops", (PyCFunction)Table_store_ops, METH_VARARGS, store_ops_doc},
    {"load_ops", (PyCFunction)Table_load_ops, METH_VARARGS, load_ops_doc},
    {"complete", (PyCFunction)Table_complete, METH_VARARGS, complete_doc},
    {"invalidate", (PyCFunction)Table_invalidate, METH_O, invalidate_doc},
    {"release_leases", (PyCFunction)Table_release_leases, METH_NOARGS, release_leases_doc},
    {"sweep", (PyCFunction)Table_sweep, METH_NOARGS, sweep_doc},
    {"load", (PyCFunction)Table_load, METH_VARARGS, load_doc},
    {"counters", (PyCFunction)Table_counters, METH_NOARGS, counters_doc},
    {"usage", (PyCFunction)Table_usage, METH_NOARGS, usage_doc},
    {"bind", (PyCFunction)Table_bind, METH_VARARGS, bind_doc},
    {"submit_store", (PyCFunction)Table_submit_store, METH_VARARGS, submit_store_doc},
    {"submit_load", (PyCFunction)Table_submit_load, METH_VARARGS, submit_load_doc},
    {"poll", (PyCFunction)Table_poll, METH_NOARGS, poll_doc},
    {"collect", (PyCFunction)Table_collect, METH_O, collect_doc},
    {"take_events", (PyCFunction)Table_take_events, METH_NOARGS, take_events_doc},
    {"inflight", (PyCFunction)Table_inflight, METH_NOARGS, inflight_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._table.Table",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The process-shared slot table of one store, and this process's data path over it.",
    .tp_new = Table_new,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
};

/* ------------------------------------------------------------------ module */
PyDoc_STRVAR(table_bytes_doc, "nvt_table_bytes(n_slots, ways) -> int\n\nSize of the table file.");

static PyObject *py_table_bytes(PyObject *m, PyObject *args) {
    unsigned long long n_slots;
    unsigned int ways;
    if (!PyArg_ParseTuple(args, "KI", &n_slots, &ways))
        return NULL;
    const char *why = nvt_bad_geometry(n_slots, ways);
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(nvt_table_bytes(n_slots, ways));
}

PyDoc_STRVAR(format_doc,
             "format(table, n_slots, ways)\n\n"
             "Zero the table, write its header and initialize every set's mutex (the\n"
             "first process to attach, before load()). Only while no other process is\n"
             "attached.");

static PyObject *py_format(PyObject *m, PyObject *args) {
    Py_buffer v;
    unsigned long long n_slots;
    unsigned int ways;
    if (!PyArg_ParseTuple(args, "w*KI", &v, &n_slots, &ways))
        return NULL;
    const char *why = nvt_format(v.buf, (uint64_t)v.len, n_slots, ways);
    PyBuffer_Release(&v);
    if (why) {
        PyErr_SetString(strncmp(why, "pthread", 7) ? PyExc_ValueError : PyExc_OSError, why);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(header_doc, "header(table) -> dict\n\nThe table header (for open checks, info, fsck).");

static PyObject *py_header(PyObject *m, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    if (v.len < NVT_TABLE_HEADER_BYTES) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "table shorter than its header");
        return NULL;
    }
    nvt_table_header h;
    memcpy(&h, v.buf, sizeof(h));
    const char *why = nvt_bad_header(&h, (uint64_t)v.len);
    PyBuffer_Release(&v);
    return Py_BuildValue("{sKsIsKsIsLsLsOsz}", "magic", (unsigned long long)h.magic, "version", h.version,
                         "n_slots", (unsigned long long)h.n_slots, "ways", h.ways, "used", (long long)h.used,
                         "ready", (long long)h.ready, "valid", why ? Py_False : Py_True, "problem", why);
}

PyDoc_STRVAR(sharers_doc, "sharers(table, lock_fd) -> list[(index, pid, attached_ns)]\n\n"
                          "Registry entries whose OFD lock is held by a live process (another\n"
                          "open file description than lock_fd's).");

static PyObject *py_sharers(PyObject *m, PyObject *args) {
    Py_buffer v;
    int fd;
    if (!PyArg_ParseTuple(args, "y*i", &v, &fd))
        return NULL;
    if (v.len < NVT_TABLE_HEADER_BYTES) {
        PyBuffer_Release(&v);
        return PyList_New(0);
    }
    PyObject *out = PyList_New(0);
    const nvt_sharer *sh = (const nvt_sharer *)((const char *)v.buf + NVT_SHARERS_OFFSET);
    for (int i = 0; out && i < NVT_MAX_SHARERS; i++) {
        if (!sh[i].pid)
            continue; /* never used, or detached */
        if (!nvt_sharer_live(fd, i))
            continue;
        PyObject *t = Py_BuildValue("(iIK)", i, sh[i].pid, (unsigned long long)sh[i].attached_ns);
        if (!t || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    PyBuffer_Release(&v);
    return out;
}

PyDoc_STRVAR(set_clock_offset_doc, "_set_clock_offset_ns(ns)\n\n"
                                    "Tests only: add ns to this process's table clock (leases, claim\n"
                                    "stamps, watch deadlines), so a lease or a watch runs out without\n"
                                    "waiting, or the clock stands days after boot.");

static PyObject *py_set_clock_offset(PyObject *m, PyObject *arg) {
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred())
        return NULL;
    nvt_set_clock_offset_ns(ns);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_set_clock_offset_ns", py_set_clock_offset, METH_O, set_clock_offset_doc},
    {"table_bytes", py_table_bytes, METH_VARARGS, table_bytes_doc},
    {"format", py_format, METH_VARARGS, format_doc},
    {"header", py_header, METH_O, header_doc},
    {"sharers", py_sharers, METH_VARARGS, sharers_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef table_module = {
    PyModuleDef_HEAD_INIT, "nvmetier._table",
    "The process-shared slot table of an nvmetier store (see nvt_table.h).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__table(void) {
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    if (!py_zero_s && !(py_zero_s = PyFloat_FromDouble(0.0)))
        return NULL;
    if (!py_empty_tuple && !(py_empty_tuple = PyTuple_New(0)))
        return NULL;
    PyObject *m = PyModule_Create(&table_module);
    if (!m)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddIntConstant(m, "OP_BYTES", (long)sizeof(nvt_op)) < 0 ||
        PyModule_AddIntConstant(m, "COMPLETION_BYTES", (long)sizeof(nvt_completion)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SHARERS", NVT_MAX_SHARERS) < 0 ||
        PyModule_AddIntConstant(m, "REGISTRY_LOCK_BASE", (long)NVT_REGISTRY_LOCK_BASE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
