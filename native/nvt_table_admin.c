/*
 * nvt_table_admin: the methods of the CPython type `Table` off the data path
 * (the type itself is nvt_table.c): the rebuild (load) and the sweep around
 * an open and a close, retention and the live purge, the counters and the
 * gauges (usage, inflight), and the tests' hold of a set mutex. Called with
 * the GIL held by the store's caller (vLLM's scheduler thread, or the CLI);
 * a purge takes each set's lock with the bounded wait (the GIL released).
 */
#include "nvt_table_type.h"

#include <stdint.h>
#include <string.h>
#include <unistd.h>

NVT_DOCSTR(nvt_set_retention_doc,
           "set_retention(retention_ns)\n\n"
           "This process's retention (0: off): a READY chunk whose record was stored\n"
           "longer ago than this (wall clock) is a miss (counted in retention_expired), its\n"
           "slot freed unless leased (a removal event when events are on) and evicted\n"
           "first. Also written to the table header (seconds) for nvmetier info.");

PyObject *nvt_Table_set_retention(TableObject *self, PyObject *arg) {
    GUARD(self);
    unsigned long long ns = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    self->core.retention_ns = ns;
    unsigned long long secs = (ns + 999999999ULL) / 1000000000ULL;
    __atomic_store_n(&self->core.hdr->retention_s, secs > UINT32_MAX ? UINT32_MAX : (uint32_t)secs,
                     __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* What a purge overwrites of each slot it removes (wipe): zeros over
 * [wipe_offset, wipe_offset + wipe_bytes) of the slot, in its data file. */
typedef struct {
    PyObject *keys;
    int *fds;
    unsigned n_paths;
    uint64_t slot_bytes, wipe_offset, wipe_bytes;
    const uint8_t *zeros;
    uint8_t *seen; /* wipe_bytes: an empty slot's bytes read back */
    uint64_t wiped, wipe_errors, stale_wiped;
} purge_ctx;

/* Purge's removed-record callback, under the set's lock: the key joins the
 * list; with a wipe, the slot's bytes that name its nonce and tag are
 * overwritten before any sharer can claim the slot again (a claim takes
 * this lock), so no new chunk's bytes are ever overwritten. */
static void purge_removed(void *ctx, const unsigned char *rec) {
    purge_ctx *p = ctx;
    if (p->keys && nvt_append_record_key(&p->keys, rec) < 0) {
        PyErr_Clear();
        Py_CLEAR(p->keys); /* out of memory: the caller reports the keys as unknown */
    }
    if (p->fds) {
        uint32_t slot = (uint32_t)rec[28] | (uint32_t)rec[29] << 8 | (uint32_t)rec[30] << 16 | (uint32_t)rec[31] << 24;
        int fd = p->fds[slot % p->n_paths];
        off_t at = (off_t)((slot / p->n_paths) * p->slot_bytes + p->wipe_offset);
        if (pwrite(fd, p->zeros, (size_t)p->wipe_bytes, at) == (ssize_t)p->wipe_bytes)
            p->wiped++;
        else
            p->wipe_errors++;
    }
}

/* Purge's empty-slot callback, under the set's lock (so no sharer claims
 * the slot meanwhile): a chunk that left the table before the purge
 * (invalidated, evicted, expired, its record dropped at open) left its
 * sealed image, nonce and tag included, and its epoch key may live on for
 * newer chunks: its nonce and tag are overwritten too (only when not zero
 * already: a slot never written costs a read, not a write). */
static void purge_empty(void *ctx, uint64_t slot) {
    purge_ctx *p = ctx;
    int fd = p->fds[slot % p->n_paths];
    off_t at = (off_t)((slot / p->n_paths) * p->slot_bytes + p->wipe_offset);
    ssize_t got = pread(fd, p->seen, (size_t)p->wipe_bytes, at);
    if (got < 0) {
        p->wipe_errors++;
        return;
    }
    if (got == 0 || memcmp(p->seen, p->zeros, (size_t)got) == 0)
        return;
    if (pwrite(fd, p->zeros, (size_t)p->wipe_bytes, at) == (ssize_t)p->wipe_bytes)
        p->stale_wiped++;
    else
        p->wipe_errors++;
}

NVT_DOCSTR(nvt_purge_doc,
           "purge(older_than_ns, all, sets=None) -> (keys, cleared, writing_marked, writing_skipped, busy)\n\n"
           "Clear every READY or BAD slot stored older_than_ns ago or longer (wall clock),\n"
           "or every one when all, in the given sets (None: every set), leased or not (a\n"
           "load in flight fails by its generation). With all, WRITING slots are marked so\n"
           "their writes are never published. Each set's lock is taken with the bounded\n"
           "wait; busy lists the sets that could not be locked (a stopped holder). keys:\n"
           "the removed keys (None if out of memory). wipe=(fds, slot_bytes, offset, nbytes): zeros\n"
           "are written over [offset, offset + nbytes) of every removed slot under its set's lock\n"
           "(fds: one per data file), and, unless all, over every EMPTY slot whose range is not zero\n"
           "(a chunk that left before the purge); wiped, wipe_errors and stale_wiped (those empty\n"
           "slots) are then appended to the result.");

PyObject *nvt_Table_purge(TableObject *self, PyObject *args) {
    GUARD(self);
    unsigned long long older;
    int all;
    PyObject *sets_obj = Py_None, *wipe_obj = Py_None, *fds_obj = NULL, *out = NULL;
    if (!PyArg_ParseTuple(args, "Kp|OO", &older, &all, &sets_obj, &wipe_obj))
        return NULL;
    purge_ctx p;
    memset(&p, 0, sizeof(p));
    unsigned long long sb = 0, woff = 0, wn = 0;
    if (wipe_obj != Py_None) {
        if (!PyArg_ParseTuple(wipe_obj, "OKKK;wipe is (fds, slot_bytes, offset, nbytes)", &fds_obj, &sb, &woff, &wn))
            return NULL;
        PyObject *fseq = PySequence_Fast(fds_obj, "wipe's fds must be a sequence");
        if (!fseq)
            return NULL;
        Py_ssize_t nf = PySequence_Fast_GET_SIZE(fseq);
        if (nf < 1 || sb == 0 || wn == 0 || woff + wn > sb || wn > (64u << 20)) {
            Py_DECREF(fseq);
            PyErr_SetString(PyExc_ValueError, "wipe: at least one fd, and the range inside a slot");
            return NULL;
        }
        p.fds = PyMem_Calloc((size_t)nf, sizeof(int));
        p.zeros = PyMem_Calloc(1, (size_t)wn);
        p.seen = PyMem_Malloc((size_t)wn);
        if (!p.fds || !p.zeros || !p.seen) {
            Py_DECREF(fseq);
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t i = 0; i < nf; i++) {
            p.fds[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fseq, i));
            if (p.fds[i] == -1 && PyErr_Occurred()) {
                Py_DECREF(fseq);
                goto fail;
            }
        }
        Py_DECREF(fseq);
        p.n_paths = (unsigned)nf;
        p.slot_bytes = sb;
        p.wipe_offset = woff;
        p.wipe_bytes = wn;
    }
    PyObject *seq = NULL;
    Py_ssize_t m = (Py_ssize_t)self->core.n_sets;
    if (sets_obj != Py_None) {
        if (!(seq = nvt_seq_snapshot(sets_obj, "sets must be a sequence of set numbers")))
            goto fail;
        m = PySequence_Fast_GET_SIZE(seq);
    }
    p.keys = PyList_New(0);
    PyObject *busy = PyList_New(0);
    nvt_purge_counts n = {0, 0, 0};
    if (!p.keys || !busy)
        goto fail_sets;
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t set = (uint64_t)i;
        if (seq) {
            set = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
            if (PyErr_Occurred())
                goto fail_sets;
            if (set >= self->core.n_sets) {
                PyErr_SetString(PyExc_ValueError, "no such set");
                goto fail_sets;
            }
        }
        if (nvt_set_lock(&self->core, set) != 0) {
            PyObject *v = PyLong_FromUnsignedLongLong(set);
            int rc = v ? PyList_Append(busy, v) : -1;
            Py_XDECREF(v);
            if (rc < 0)
                goto fail_sets;
            continue;
        }
        nvt_purge_set_locked(&self->core, set, older, all, &n, purge_removed, p.fds ? purge_empty : NULL, &p);
        set_unlock(&self->core, set);
    }
    publish_counts(&self->core);
    if (p.fds)
        out = Py_BuildValue("(OKKKOKKK)", p.keys ? p.keys : Py_None, (unsigned long long)n.cleared,
                            (unsigned long long)n.writing_marked, (unsigned long long)n.writing_skipped, busy,
                            (unsigned long long)p.wiped, (unsigned long long)p.wipe_errors,
                            (unsigned long long)p.stale_wiped);
    else
        out = Py_BuildValue("(OKKKO)", p.keys ? p.keys : Py_None, (unsigned long long)n.cleared,
                            (unsigned long long)n.writing_marked, (unsigned long long)n.writing_skipped, busy);
fail_sets:
    if (!out)
        publish_counts(&self->core);
    Py_XDECREF(seq);
    Py_XDECREF(busy);
fail:
    Py_XDECREF(p.keys);
    PyMem_Free(p.fds);
    PyMem_Free((void *)p.zeros);
    PyMem_Free(p.seen);
    return out;
}

NVT_DOCSTR(nvt_keys_generation_doc, "keys_generation() -> int: changes of the store's keys file announced so far.");

PyObject *nvt_Table_keys_generation(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    return PyLong_FromUnsignedLong(__atomic_load_n(&self->core.hdr->keys_gen, __ATOMIC_ACQUIRE));
}

NVT_DOCSTR(nvt_bump_keys_doc, "bump_keys() -> int\n\n"
                              "The store's keys file changed (and is durable): advance keys_generation.");

PyObject *nvt_Table_bump_keys(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    return PyLong_FromUnsignedLong(__atomic_add_fetch(&self->core.hdr->keys_gen, 1, __ATOMIC_ACQ_REL));
}

NVT_DOCSTR(nvt_purge_generation_doc, "purge_generation() -> (purge_gen, purge_events_gen)\n\n"
                                     "Purges logged so far, and the latest whose removal events a sharer took.");

PyObject *nvt_Table_purge_generation(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    return Py_BuildValue("(II)", __atomic_load_n(&self->core.hdr->purge_gen, __ATOMIC_ACQUIRE),
                         __atomic_load_n(&self->core.hdr->purge_events_gen, __ATOMIC_ACQUIRE));
}

NVT_DOCSTR(nvt_bump_purge_doc, "bump_purge() -> int\n\n"
                               "A purge's removals are logged: advance purge_gen (returns the new value).");

PyObject *nvt_Table_bump_purge(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    return PyLong_FromUnsignedLong(__atomic_add_fetch(&self->core.hdr->purge_gen, 1, __ATOMIC_ACQ_REL));
}

NVT_DOCSTR(nvt_claim_purge_events_doc,
           "claim_purge_events(expected=None, upto=None) -> int or None\n\n"
           "Take the purges whose removal events no sharer took yet: purge_events_gen moves\n"
           "to purge_gen (compare-and-swap: one sharer wins each). Returns the previous\n"
           "purge_events_gen (the purges after it are this caller's to emit), or None.\n"
           "With expected and upto: move it from expected to upto only (the last purge\n"
           "covered by the log the caller read), returning expected, or None when another\n"
           "sharer moved it first.");

PyObject *nvt_Table_claim_purge_events(TableObject *self, PyObject *args) {
    GUARD(self);
    PyObject *expected_obj = Py_None, *upto_obj = Py_None;
    if (!PyArg_ParseTuple(args, "|OO", &expected_obj, &upto_obj))
        return NULL;
    if ((expected_obj == Py_None) != (upto_obj == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "claim_purge_events: give both expected and upto, or neither");
        return NULL;
    }
    if (expected_obj != Py_None) {
        unsigned long expected = PyLong_AsUnsignedLong(expected_obj), upto = PyLong_AsUnsignedLong(upto_obj);
        if (PyErr_Occurred())
            return NULL;
        if (expected > UINT32_MAX || upto > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "claim_purge_events: generations are u32 (got %lu, %lu)", expected,
                         upto);
            return NULL;
        }
        uint32_t seen = (uint32_t)expected;
        if (__atomic_compare_exchange_n(&self->core.hdr->purge_events_gen, &seen, (uint32_t)upto, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return PyLong_FromUnsignedLong(expected);
        Py_RETURN_NONE;
    }
    uint32_t gen = __atomic_load_n(&self->core.hdr->purge_gen, __ATOMIC_ACQUIRE);
    uint32_t seen = __atomic_load_n(&self->core.hdr->purge_events_gen, __ATOMIC_ACQUIRE);
    while (seen != gen) {
        if (__atomic_compare_exchange_n(&self->core.hdr->purge_events_gen, &seen, gen, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return PyLong_FromUnsignedLong(seen);
    }
    Py_RETURN_NONE;
}

NVT_DOCSTR(nvt_inflight_doc, "inflight() -> (ops_outstanding, jobs_in_flight)\n\n"
                             "Ops handed to the engine and not yet collected; jobs not yet finished.");

PyObject *nvt_Table_inflight(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    return Py_BuildValue("(II)", self->outstanding, self->jobs_live);
}

NVT_DOCSTR(nvt_sweep_doc, "sweep() -> int\n\n"
                          "Reclaim the WRITING slots of sharers that are gone, in every set, and\n"
                          "recount the used/ready gauges. Returns the slots reclaimed.");

PyObject *nvt_Table_sweep(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    return PyLong_FromLongLong(nvt_sweep(&self->core));
}

NVT_DOCSTR(nvt_load_doc,
           "load(slots, unverified)\n\n"
           "Rebuild: mark READY every slot of `slots` (int64 buffer) whose record the\n"
           "caller proved valid, with its fingerprint from the record's key; `slots` in\n"
           "the order of the records' store times, oldest first (the recency order).\n"
           "unverified: the store was not closed cleanly (a crash or a power loss may have\n"
           "left a record over another key's bytes): every loaded slot is checked at its\n"
           "next load, whatever verify_checksums says. Only while no other sharer is attached.");

PyObject *nvt_Table_load(TableObject *self, PyObject *args) {
    GUARD(self);
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

NVT_DOCSTR(nvt_counters_doc, "counters() -> dict\n\nThis process's cumulative counters.");

PyObject *nvt_Table_counters(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    nvt_counters *c = &self->core.c;
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "hits", c->hits, "misses", c->misses, "evictions",
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
        c->completions_deferred, "completions_abandoned", c->completions_abandoned, "kv_events_lost",
        self->events_lost, "retention_expired", c->retention_expired, "stores_purged", c->stores_purged,
        "auth_failures", c->auth_failures, "stores_skipped_no_epoch", c->stores_skipped_no_epoch,
        "loads_key_destroyed", c->loads_key_destroyed, "load_leases_taken", c->load_leases_taken);
}

NVT_DOCSTR(nvt_usage_doc, "usage() -> (used, ready, watches, jobs_in_flight)\n\n"
                          "Slots holding a key and READY slots over all sharers (gauges), and this\n"
                          "process's stores waiting for another write of their key, and jobs in flight.");

PyObject *nvt_Table_usage(TableObject *self, PyObject *Py_UNUSED(ignored)) {
    GUARD(self);
    publish_counts(&self->core);
    int64_t used = __atomic_load_n(&self->core.hdr->used, __ATOMIC_RELAXED);
    int64_t ready = __atomic_load_n(&self->core.hdr->ready, __ATOMIC_RELAXED);
    return Py_BuildValue("(LLII)", (long long)(used < 0 ? 0 : used), (long long)(ready < 0 ? 0 : ready),
                         (unsigned int)self->n_watches, self->jobs_live);
}

NVT_DOCSTR(nvt_hold_set_doc, "_hold_set(set) -> bool\n\n"
                             "Tests only: take a set's mutex and keep it (as a sharer stopped or\n"
                             "killed inside a critical section would). False when not taken.");

/* A set index argument (tests' hold/release): 0, or -1 with an exception. */
static int set_arg(TableObject *self, PyObject *arg, uint64_t *set) {
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return -1;
    if (v >= self->core.n_sets) {
        PyErr_SetString(PyExc_ValueError, "no such set");
        return -1;
    }
    *set = v;
    return 0;
}

PyObject *nvt_Table_hold_set(TableObject *self, PyObject *arg) {
    GUARD(self);
    uint64_t set;
    if (set_arg(self, arg, &set) < 0)
        return NULL;
    return PyBool_FromLong(nvt_set_lock(&self->core, set) == 0);
}

NVT_DOCSTR(nvt_release_set_doc, "_release_set(set)\n\nTests only: release a mutex _hold_set took.");

PyObject *nvt_Table_release_set(TableObject *self, PyObject *arg) {
    GUARD(self);
    uint64_t set;
    if (set_arg(self, arg, &set) < 0)
        return NULL;
    set_unlock(&self->core, set);
    Py_RETURN_NONE;
}
