/*
 * nvmetier._table: the CPython type `Table` (argument parsing, tuples, the
 * GIL hooks): its life (new, attach, detach, dealloc, the fork and thread
 * guards), its data path (lookup, store/load ops, completions, submit/poll,
 * KV events, leases, invalidation), its method table and the module's init.
 * Its methods off the data path (rebuild, sweep, retention, purge, counters,
 * gauges) are nvt_table_admin.c and the module's functions nvt_table_module.c
 * (nvt_table_type.h joins them). The job path over the shared table (ops,
 * jobs, watches, completions, submit/poll) is nvt_jobs.c, nvt_job_submit.c
 * and nvt_job_complete.c (nvt_jobs.h); the table's rules (set locks, ways,
 * leases, records, sharers, rebuild, sweep) are nvt_core.c, with no Python in
 * them; nvt_layout.h has the shared layout and its lock rules.
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
 * With the io_uring engine bound with its apply hook, that engine's I/O
 * threads also write the shared table (nvt_job_worker.c: a finished write's
 * record and READY, a verified load's lease), under the same set mutexes,
 * only tried; bind, detach and dealloc remove the hook first.
 *
 * The data path turns a job's keys into an array of nvt_op (nvt_engine.h's
 * layout, op_id = an index into the op slab) that an engine takes as one
 * buffer, and applies an array of nvt_completion in one call: no Python
 * object per chunk on the caller's thread beyond the keys vLLM hands us.
 */
#include "nvt_table_type.h"
#include "nvt_hash_py.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ type */
static void Table_dealloc(TableObject *self) {
    if (self->jobs) {
        for (uint32_t i = 0; i < self->n_jobs_cap; i++) {
            PyMem_Free(self->jobs[i].failed);
            Py_XDECREF(self->jobs[i].keys);
            Py_XDECREF(self->jobs[i].stored);
        }
    }
    Py_XDECREF(self->eng_submit);
    Py_XDECREF(self->eng_wait);
    Py_XDECREF(self->done);
    Py_XDECREF(self->events);
    Py_XDECREF(self->expired);
    PyMem_Free(self->jobs);
    PyMem_Free(self->job_free);
    nvt_apply_hook_remove(self); /* before anything the hook reads goes */
    for (unsigned b = 0; b < NVT_OP_BLOCKS; b++)
        PyMem_Free(self->op_blocks[b]);
    PyMem_Free(self->op_free);
    nvt_held_free(self);
    PyMem_Free(self->watches);
    PyMem_Free(self->deferred);
    PyMem_Free(self->ev_open);
    if (self->have_tbuf)
        PyBuffer_Release(&self->tbuf);
    if (self->have_ibuf)
        PyBuffer_Release(&self->ibuf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}


/* The core's hooks around a wait for another process: the GIL is released. */
static void *gil_release(void) { return PyEval_SaveThread(); }

static void gil_restore(void *state) { PyEval_RestoreThread(state); }

/* A record's key as bytes, appended to `list` (created when NULL); errors
 * are left set for the caller to report. -1 on error. */
int nvt_append_record_key(PyObject **list, const unsigned char *rec) {
    uint8_t kl = rec[5] <= REC_KEY_MAX ? rec[5] : REC_KEY_MAX;
    if (!*list && !(*list = PyList_New(0)))
        return -1;
    PyObject *k = PyBytes_FromStringAndSize((const char *)rec + REC_KEY_OFFSET, kl);
    int rc = k ? PyList_Append(*list, k) : -1;
    Py_XDECREF(k);
    return rc;
}

/* The core's on_expired: remember the key for a removal event (events on).
 * Out of memory loses the event, never the clear. */
static void expired_event(void *ctx, const unsigned char *rec) {
    TableObject *self = ctx;
    if (self->events_on && nvt_append_record_key(&self->expired, rec) < 0)
        PyErr_Clear();
}

/* Forks of this process so far, counted in the child (pthread_atfork). */
unsigned nvt_forks;

static void count_fork_in_child(void) { nvt_forks++; }

PyObject *nvt_table_forked(void) {
    PyErr_SetString(PyExc_RuntimeError,
                    "nvmetier Table inherited through fork(): it would act as the parent's sharer "
                    "(its registry entry and lock); open the store again in the child");
    return NULL;
}

/* A Table belongs to one thread at a time (the store's caller). While one of
 * its calls waits for another process with the GIL released, another thread
 * could run Python and call in: refuse that, since the slabs and the set
 * being worked on are mid-change (it would corrupt them). */
PyObject *nvt_table_busy(void) {
    PyErr_SetString(PyExc_RuntimeError,
                    "nvmetier Table used from two threads at once (a call of another thread is "
                    "waiting for a set lock); a Table belongs to one thread at a time");
    return NULL;
}

/* The data path acts as this process's sharer (its registry entry owns the
 * slots it claims, its leases and writes): on a Table not attached (before
 * attach(), or after detach()) a claimed slot would name no live sharer, or
 * another process's registry entry, and be reclaimed under a write still in
 * flight. Those calls are refused; the rebuild (load), the last closer's
 * sweep and the read-only counters stay allowed. */
PyObject *nvt_table_detached(void) {
    PyErr_SetString(PyExc_RuntimeError,
                    "nvmetier Table is not attached to the store's sharer registry (call attach() "
                    "first; after detach() the store is closed: open it again)");
    return NULL;
}

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
    self->fork_gen = nvt_forks;
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
    self->core.on_expired = expired_event;
    self->core.expired_ctx = self;
    self->n_paths = n_paths;
    self->slot_bytes = slot_bytes;
    self->row_bytes = row_bytes;
    self->n_rows = n_rows;
    self->core.lease_ms = lease_ns / 1000000ULL > NVT_CLOCK_HORIZON_MS ? (uint32_t)NVT_CLOCK_HORIZON_MS
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
    GUARD(self);
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
    GUARD(self);
    nvt_apply_hook_remove(self); /* a worker names this registry entry as a set's holder */
    nvt_detach(&self->core);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lookup_doc, "lookup(key) -> bool\n\n"
                         "Whether key is READY (its record holds this key). A hit is leased:\n"
                         "no sharer evicts it for lease_ns, and counts as an access.");

static PyObject *Table_lookup(TableObject *self, PyObject *key) {
    GUARD_ATTACHED(self);
    uint64_t set;
    int w, hit = 0;
    int r = nvt_locate(self, key, 1u << NVT_READY, &set, &w);
    if (r < 0)
        return NULL;
    if (r == 0) {
        if (w >= 0) {
            nvt_hold_lease(self, set, w, nvt_now_ms(), key);
            *slot_at(&self->core, set, (uint32_t)w).last = tick(&self->core, set); /* an access */
            hit = 1;
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
    int w, r = nvt_locate(self, key, 1u << NVT_READY, &set, &w);
    if (r < 0)
        return -2;
    if (r == 0)
        set_unlock(&self->core, set);
    return w < 0 ? -1 : (int64_t)(set * self->core.ways + (uint64_t)w);
}

PyDoc_STRVAR(contains_doc, "contains(key) -> bool\n\nWhether key is READY; no lease, no count.");

static PyObject *Table_contains(TableObject *self, PyObject *key) {
    GUARD_ATTACHED(self);
    int64_t slot = ready_slot(self, key);
    return slot == -2 ? NULL : PyBool_FromLong(slot >= 0);
}

PyDoc_STRVAR(slot_of_doc, "slot_of(key) -> int | None\n\nThe slot holding key READY, or None.");

static PyObject *Table_slot_of(TableObject *self, PyObject *key) {
    GUARD_ATTACHED(self);
    int64_t slot = ready_slot(self, key);
    if (slot == -2)
        return NULL;
    if (slot < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(slot);
}

PyDoc_STRVAR(contains_many_doc,
             "contains_many(keys) -> bytes\n\n"
             "contains() of each key in one call: one byte per key, 1 when READY, else 0;\n"
             "no lease, no count. The keys' sets are prefetched ahead, so their cache\n"
             "misses overlap (a request's keys land in random sets).");

/* contains_many and lease_many: one byte per key from nvt_ready_keys in `mode`. */
static PyObject *ready_bytes(TableObject *self, PyObject *keys, int mode) {
    GUARD_ATTACHED(self);
    PyObject *seq = nvt_keys_arg(self, keys);
    if (!seq)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, m);
    if (out && nvt_ready_keys(self, seq, m, (uint8_t *)PyBytes_AS_STRING(out), mode) < 0)
        Py_CLEAR(out);
    Py_DECREF(seq);
    return out;
}

static PyObject *Table_contains_many(TableObject *self, PyObject *keys) {
    return ready_bytes(self, keys, NVT_READY_CONTAINS);
}

PyDoc_STRVAR(lease_many_doc,
             "lease_many(keys) -> bytes\n\n"
             "contains_many() that also leases each READY key as lookup() leases a hit\n"
             "(no sharer evicts it until release_leases, or lease_ns): one byte per key,\n"
             "1 when READY and leased, else 0. Unlike lookup it counts no hit or miss and\n"
             "leaves the key's recency alone (a plan leases the keys it may answer HIT\n"
             "for before the walk asks; the caller counts the HITs it answers, and the\n"
             "load or touch() refreshes recency). The keys' sets are prefetched ahead.");

static PyObject *Table_lease_many(TableObject *self, PyObject *keys) {
    return ready_bytes(self, keys, NVT_READY_LEASE);
}

PyDoc_STRVAR(states_many_doc,
             "states_many(keys) -> bytes\n\n"
             "Each key's state in one call, one byte per key: 2 READY, 1 being written (by\n"
             "any sharer), 0 neither, 255 unknown (its set could not be locked in its\n"
             "bound). No lease, no count, recency left alone.");

static PyObject *Table_states_many(TableObject *self, PyObject *keys) {
    return ready_bytes(self, keys, NVT_READY_STATES);
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

static PyObject *Table_store_ops(TableObject *self, PyObject *args) {
    GUARD_ATTACHED(self);
    long long job_id, max_ops;
    PyObject *keys, *rows_obj;
    int events;
    if (!PyArg_ParseTuple(args, "LOOLp", &job_id, &keys, &rows_obj, &max_ops, &events))
        return NULL;
    PyObject *seq, *out;
    Py_buffer rows;
    Py_ssize_t m = nvt_job_args(self, keys, rows_obj, &seq, &rows, &out);
    if (m < 0)
        return NULL;
    PyObject *failed = NULL, *evicted = NULL;
    int64_t job = -1;
    Py_ssize_t n_ops = 0;
    nvt_op *ops = (nvt_op *)PyBytes_AS_STRING(out);
    int rc = nvt_store_loop(self, job_id, seq, m, &rows, max_ops, events, NULL, ops, &n_ops, &job, &failed, &evicted);
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    if (rc < 0) {
        nvt_store_unwind(self, ops, n_ops, job);
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

static PyObject *Table_load_ops(TableObject *self, PyObject *args) {
    GUARD_ATTACHED(self);
    long long job_id;
    PyObject *keys, *rows_obj;
    int verify;
    if (!PyArg_ParseTuple(args, "LOOp", &job_id, &keys, &rows_obj, &verify))
        return NULL;
    PyObject *seq, *out;
    Py_buffer rows;
    Py_ssize_t m = nvt_job_args(self, keys, rows_obj, &seq, &rows, &out);
    if (m < 0)
        return NULL;
    PyObject *missing = NULL;
    int64_t job = -1;
    Py_ssize_t n_ops = 0;
    nvt_op *ops = (nvt_op *)PyBytes_AS_STRING(out);
    int rc = nvt_load_loop(self, job_id, seq, m, &rows, verify, ops, &n_ops, &job, &missing);
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    if (rc < 0) {
        nvt_load_unwind(self, ops, n_ops, job);
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

PyDoc_STRVAR(complete_doc,
             "complete(completions, events) -> (finished, stored, removed)\n\n"
             "Apply packed nvt_completion records. A write publishes its record, then its\n"
             "slot READY; a read succeeds only when its slot's generation is unchanged and,\n"
             "when its op was verified (load_ops' verify, or an unverified slot), the\n"
             "checksum matches. finished: (job_id, is_load, moved_bytes,\n"
             "failed_positions or None, first_error or None) per job whose last op this was.\n"
             "stored/removed: keys for KV events (events), or None.");

static PyObject *Table_complete(TableObject *self, PyObject *args) {
    GUARD_ATTACHED(self);
    Py_buffer comps;
    int events;
    if (!PyArg_ParseTuple(args, "y*p", &comps, &events))
        return NULL;
    Py_ssize_t n = comps.len / (Py_ssize_t)sizeof(nvt_completion);
    PyObject *finished = PyList_New(0), *stored = NULL, *removed = NULL;
    if (!finished)
        goto error;
    if (nvt_apply_batch(self, comps.buf, n, events, finished, &stored, &removed) < 0)
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

PyDoc_STRVAR(apply_as_worker_doc,
             "_apply_as_worker(completions)\n\n"
             "Tests only: what an io_uring worker with this Table's hook does with these\n"
             "packed completions before it publishes them (nvt_job_worker.c), run on this\n"
             "thread: the slot side of the common ones; complete() then accounts for them.");

static PyObject *Table_apply_as_worker(TableObject *self, PyObject *arg) {
    GUARD_ATTACHED(self);
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    if (!self->apply_cap) { /* as nvt_apply_hook_install would name this process */
        self->apply_holder = (uint16_t)(self->core.me + 1);
        self->apply_holder_inc = (uint16_t)self->core.my_inc;
    }
    nvt_worker_apply(self, b.buf, (size_t)b.len / sizeof(nvt_completion));
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------ submit/poll path */
/* The calls vLLM makes once per job (submit_store, submit_load) and once per
 * poll (poll) each cross into C once: the ops go to the bound engine's
 * submit_raw, its completions come back through wait_raw, and a finished job
 * comes out as one tuple, so vLLM's threads pay per job and per poll, not per
 * Python statement. store_ops/load_ops/complete stay the primitives that the
 * table's model test drives one step at a time. */
static PyObject *py_zero_s, *py_empty_tuple;

PyDoc_STRVAR(bind_doc, "bind(submit_raw, wait_raw, max_queued_ops, verify, events, apply_hook=None)\n\n"
                       "The engine the submit/poll path uses (None, None: unbind; a submit_raw that\n"
                       "returns False refused the ops, as one that raises), how many ops may\n"
                       "be outstanding before stores are dropped, checksum verification of loads,\n"
                       "and whether KV events are kept for take_events(). apply_hook: the io_uring\n"
                       "engine's apply_hook() capsule: its I/O threads then apply the slot side of\n"
                       "each common completion (a write's record and READY, a verified load's lease)\n"
                       "before publishing it, and poll() only accounts for it (nvt_job_worker.c);\n"
                       "when wait_raw is that engine's own, a poll skips it while the engine has\n"
                       "no completion waiting. Needs the Table attached; any previous hook is removed first (waiting for\n"
                       "a worker inside it), as by every bind and by detach().");

static PyObject *Table_bind(TableObject *self, PyObject *args) {
    GUARD(self);
    PyObject *submit, *wait, *hook = Py_None;
    unsigned int max_q;
    int verify, events;
    if (!PyArg_ParseTuple(args, "OOIpp|O", &submit, &wait, &max_q, &verify, &events, &hook))
        return NULL;
    /* The old hook goes first: its worker may be applying into this table. */
    nvt_apply_hook_remove(self);
    if (hook != Py_None && nvt_apply_hook_install(self, hook) < 0)
        return NULL;
    Py_XSETREF(self->eng_submit, submit == Py_None ? NULL : Py_NewRef(submit));
    Py_XSETREF(self->eng_wait, wait == Py_None ? NULL : Py_NewRef(wait));
    /* The hook's hint counts the hook's engine's completions: a poll skips
     * wait only when wait is that engine's own (its wait_raw, no wrapper),
     * else another engine's completions would never be taken. */
    if (self->done_hint &&
        !(PyCFunction_Check(wait) && PyCFunction_GET_SELF(wait) == PyCapsule_GetContext(hook)))
        self->done_hint = NULL;
    self->max_queued_ops = max_q;
    self->verify = verify;
    self->events_on = events;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(submit_store_doc,
             "submit_store(job_id, keys, rows, skip=None) -> None or str\n\n"
             "store_ops, then the ops to the bound engine, as one job that poll() reports.\n"
             "Keys with a bad length or row fail the job, and so do keys dropped for lack of\n"
             "resources (over max_queued_ops, or an all-busy set; no error text). Keys already\n"
             "stored, being stored (the job then waits for that write) or whose skip byte is\n"
             "set (admission) are left out and succeed. Returns None, or the engine's error\n"
             "when it refused the ops (they then fail).");

static PyObject *Table_submit_store(TableObject *self, PyObject *args) {
    GUARD_ATTACHED(self);
    return nvt_submit_job(self, args, 0);
}

PyDoc_STRVAR(submit_load_doc,
             "submit_load(job_id, keys, rows) -> None or str\n\n"
             "load_ops, then the ops to the bound engine, as one job that poll() reports.\n"
             "A key not READY fails at once (as missing: the job's error stays None).");

static PyObject *Table_submit_load(TableObject *self, PyObject *args) {
    GUARD_ATTACHED(self);
    return nvt_submit_job(self, args, 1);
}

PyDoc_STRVAR(poll_doc, "poll() -> list of finished jobs, or ()\n\n"
                       "Apply the engine's completions (never waits) and return the jobs that\n"
                       "finished since the last poll: (job_id, success, successful_keys or None,\n"
                       "transfer_time_s, moved_bytes, error or None, is_load).");

static PyObject *Table_poll(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD_ATTACHED(self);
    if ((self->outstanding || self->n_watches || self->n_deferred || self->n_unreported) &&
        nvt_collect(self, py_zero_s) < 0)
        return NULL;
    if (!PyList_GET_SIZE(self->done))
        return Py_NewRef(py_empty_tuple);
    return nvt_take_list(&self->done);
}

PyDoc_STRVAR(collect_doc, "nvt_collect(timeout_s)\n\n"
                          "Apply the engine's completions, waiting up to timeout_s for the first\n"
                          "(the engine's wait_raw releases the GIL); finished jobs wait for poll().");

static PyObject *Table_collect(TableObject *self, PyObject *timeout) {
    GUARD_ATTACHED(self);
    if (!PyFloat_Check(timeout)) {
        PyErr_SetString(PyExc_TypeError, "timeout_s must be a float");
        return NULL;
    }
    if (nvt_collect(self, timeout) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(take_events_doc, "take_events() -> list of (removed, keys)\n\n"
                              "KV events (stores, evictions, removals) since the last call\n"
                              "(bind(events=True)), in the order to replay them: one stored\n"
                              "event per store job, naming every key it wrote, handed out once\n"
                              "the job's ops are done (with the events that follow it).");

static PyObject *Table_take_events(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    return nvt_take_events(self);
}

PyDoc_STRVAR(push_removed_doc, "push_removed(keys)\n\n"
                               "A removal event for keys removed outside this Table (a purge by\n"
                               "another process), queued behind the events already here, so it\n"
                               "follows the stored event of the job that wrote a key even while\n"
                               "that job's event is still open (take_events).");

/* push_removed and push_stored: one event of `keys`, queued behind the rest. */
static PyObject *push_keys(TableObject *self, PyObject *keys, int removed) {
    GUARD(self);
    PyObject *list = PySequence_List(keys);
    if (!list)
        return NULL;
    int rc = PyList_GET_SIZE(list) ? nvt_push_event(self, removed, list) : 0;
    Py_DECREF(list);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Table_push_removed(TableObject *self, PyObject *keys) {
    return push_keys(self, keys, 1);
}

PyDoc_STRVAR(push_stored_doc, "push_stored(keys)\n\n"
                              "A stored event for keys held, queued behind the events already here:\n"
                              "the keys a purge's removal (push_removed) named that were written\n"
                              "again since, so that a replay ends with them held.");

static PyObject *Table_push_stored(TableObject *self, PyObject *keys) {
    return push_keys(self, keys, 0);
}

PyDoc_STRVAR(release_leases_doc, "release_leases()\n\n"
                                 "End of a step: drop the leases of this step's lookup hits and\n"
                                 "lease_many that no load took over (a load's completion releases\n"
                                 "the grant it took over).");

static PyObject *Table_release_leases(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD_ATTACHED(self);
    nvt_release_held(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(invalidate_doc, "invalidate(key) -> bool\n\n"
                             "Free key's slot (record first). False when absent, being written, or\n"
                             "leased by a lookup or load. A removal is a KV event (bind(events=True)).");

static PyObject *Table_invalidate(TableObject *self, PyObject *key) {
    GUARD_ATTACHED(self);
    uint64_t set;
    int w, done = 0;
    int r = nvt_locate(self, key, (1u << NVT_READY) | (1u << NVT_BAD), &set, &w);
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
        int rc = keys ? nvt_push_event(self, 1, keys) : -1;
        Py_XDECREF(keys);
        if (rc < 0) { /* the removal happened: only its event is lost */
            PyErr_Clear();
            self->events_lost++;
        }
    }
    return PyBool_FromLong(done);
}

static PyMethodDef Table_methods[] = {
    {"_hold_set", (PyCFunction)nvt_Table_hold_set, METH_O, nvt_hold_set_doc},
    {"_release_set", (PyCFunction)nvt_Table_release_set, METH_O, nvt_release_set_doc},
    {"attach", (PyCFunction)Table_attach, METH_NOARGS, attach_doc},
    {"detach", (PyCFunction)Table_detach, METH_NOARGS, detach_doc},
    {"lookup", (PyCFunction)Table_lookup, METH_O, lookup_doc},
    {"contains", (PyCFunction)Table_contains, METH_O, contains_doc},
    {"contains_many", (PyCFunction)Table_contains_many, METH_O, contains_many_doc},
    {"lease_many", (PyCFunction)Table_lease_many, METH_O, lease_many_doc},
    {"states_many", (PyCFunction)Table_states_many, METH_O, states_many_doc},
    {"touch", (PyCFunction)(void (*)(void))nvt_Table_touch, METH_FASTCALL, nvt_touch_doc},
    {"slot_of", (PyCFunction)Table_slot_of, METH_O, slot_of_doc},
    {"store_ops", (PyCFunction)Table_store_ops, METH_VARARGS, store_ops_doc},
    {"load_ops", (PyCFunction)Table_load_ops, METH_VARARGS, load_ops_doc},
    {"complete", (PyCFunction)Table_complete, METH_VARARGS, complete_doc},
    {"_apply_as_worker", (PyCFunction)Table_apply_as_worker, METH_O, apply_as_worker_doc},
    {"invalidate", (PyCFunction)Table_invalidate, METH_O, invalidate_doc},
    {"release_leases", (PyCFunction)Table_release_leases, METH_NOARGS, release_leases_doc},
    {"sweep", (PyCFunction)nvt_Table_sweep, METH_NOARGS, nvt_sweep_doc},
    {"load", (PyCFunction)nvt_Table_load, METH_VARARGS, nvt_load_doc},
    {"counters", (PyCFunction)nvt_Table_counters, METH_NOARGS, nvt_counters_doc},
    {"usage", (PyCFunction)nvt_Table_usage, METH_NOARGS, nvt_usage_doc},
    {"bind", (PyCFunction)Table_bind, METH_VARARGS, bind_doc},
    {"submit_store", (PyCFunction)Table_submit_store, METH_VARARGS, submit_store_doc},
    {"submit_load", (PyCFunction)Table_submit_load, METH_VARARGS, submit_load_doc},
    {"poll", (PyCFunction)Table_poll, METH_NOARGS, poll_doc},
    {"collect", (PyCFunction)Table_collect, METH_O, collect_doc},
    {"take_events", (PyCFunction)Table_take_events, METH_NOARGS, take_events_doc},
    {"push_removed", (PyCFunction)Table_push_removed, METH_O, push_removed_doc},
    {"push_stored", (PyCFunction)Table_push_stored, METH_O, push_stored_doc},
    {"inflight", (PyCFunction)nvt_Table_inflight, METH_NOARGS, nvt_inflight_doc},
    {"set_retention", (PyCFunction)nvt_Table_set_retention, METH_O, nvt_set_retention_doc},
    {"purge", (PyCFunction)nvt_Table_purge, METH_VARARGS, nvt_purge_doc},
    {"purge_generation", (PyCFunction)nvt_Table_purge_generation, METH_NOARGS, nvt_purge_generation_doc},
    {"bump_purge", (PyCFunction)nvt_Table_bump_purge, METH_NOARGS, nvt_bump_purge_doc},
    {"keys_generation", (PyCFunction)nvt_Table_keys_generation, METH_NOARGS, nvt_keys_generation_doc},
    {"bump_keys", (PyCFunction)nvt_Table_bump_keys, METH_NOARGS, nvt_bump_keys_doc},
    {"claim_purge_events", (PyCFunction)nvt_Table_claim_purge_events, METH_VARARGS, nvt_claim_purge_events_doc},
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

/* ------------------------------------------------------------- module init */
/* The module's functions are nvt_table_module.c. */
PyMODINIT_FUNC PyInit__table(void) {
    static int atfork_done;
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    if (!atfork_done) {
        if (pthread_atfork(NULL, NULL, count_fork_in_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return NULL;
        }
        atfork_done = 1;
    }
    if (!py_zero_s && !(py_zero_s = PyFloat_FromDouble(0.0)))
        return NULL;
    if (!py_empty_tuple && !(py_empty_tuple = PyTuple_New(0)))
        return NULL;
    PyObject *m = PyModule_Create(&nvt_table_module);
    if (!m)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddIntConstant(m, "OP_BYTES", (long)sizeof(nvt_op)) < 0 ||
        PyModule_AddIntConstant(m, "COMPLETION_BYTES", (long)sizeof(nvt_completion)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SHARERS", NVT_MAX_SHARERS) < 0 ||
        PyModule_AddIntConstant(m, "REGISTRY_LOCK_BASE", (long)NVT_REGISTRY_LOCK_BASE) < 0 ||
        nvt_hash_py_add(m) < 0 || nvt_hot_request_add(m) < 0 || nvt_tier_calls_add(m) < 0 ||
        nvt_guard_calls_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
