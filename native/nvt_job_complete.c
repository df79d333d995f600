/*
 * nvt_job_complete: the completion side of the job path (see nvt_jobs.h):
 * applying what an engine completed (a write's record, then its slot,
 * published; a read checked), finishing and reporting jobs (each exactly once,
 * out of memory included), watches on keys another write is storing,
 * completions deferred while their set cannot be locked, KV events, and
 * collecting from the bound engine for poll(). Called by the CPython type
 * (nvt_table.c) and by nvt_job_submit.c with the GIL held, on the scheduler
 * thread; the engine's wait_raw releases the GIL while it waits. With the
 * io_uring engine's hook installed (nvt_job_worker.c) the slot side of the
 * common completions was applied by the engine's worker before they were
 * published: nvt_apply_one then only does this process's bookkeeping.
 */
#include "nvt_jobs.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

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
        if (j->oom)
            return PyUnicode_FromString("out of memory recording the failed keys (all reported failed)");
        Py_RETURN_NONE;
    }
}

/* A slot no load can ever read (its payload or tag proven bad, or its key
 * epoch destroyed): its removed KV event, then freed. Under its set's lock. */
static void free_unreadable(TableObject *t, slot_ref s, uint64_t slot, int events, PyObject **removed) {
    const unsigned char *r = record(&t->core, slot);
    int kl = r[5];
    if (events && kl <= REC_KEY_MAX && nvt_append_key(removed, (const char *)r + REC_KEY_OFFSET, kl) < 0)
        event_lost(t);
    nvt_clear_slot_locked(&t->core, s, slot);
}

/* Apply one completion: the slot is published or freed, the op released and
 * its job counted down, with nothing that can fail in between (a failed key
 * marks the job, a lost KV event is counted). Returns 0, or 1 when its set
 * could not be locked (nothing changed: apply it again later, see nvt_defer).
 * A completion whose slot side the engine's worker applied already
 * (op_info.applied, nvt_job_worker.c) is only accounted for here: the
 * counters, its job, its KV event; it never needs the set. */
int nvt_apply_one(TableObject *t, const nvt_completion *c, int events, PyObject **stored,
                  PyObject **removed) {
    uintptr_t raw = (uintptr_t)c->op_id;
    uint32_t oi = (uint32_t)raw;
    if (raw >= t->n_ops_cap || !op_at(t, (uint32_t)oi)->in_use)
        return 0; /* not ours (a stale completion): ignore */
    op_info *o = op_at(t, (uint32_t)oi);
    job_info none; /* an abandoned op's job: not in use, so nvt_job_fail ignores it */
    memset(&none, 0, sizeof(none));
    job_info *j = o->job == JOB_NONE ? &none : &t->jobs[o->job];
    uint64_t set = o->slot / t->core.ways;
    slot_ref s = slot_at(&t->core, set, o->slot % t->core.ways);
    int ok = c->result == t->row_bytes;
    if (o->applied == NVT_APPLIED_PUBLISHED) {
        /* Its worker wrote the record, published the slot and counted it
         * in the shared ready gauge (nvt_job_worker.c). */
        t->core.c.ops_written++;
        t->core.c.bytes_written += (unsigned long long)t->row_bytes;
        j->moved += (uint64_t)t->row_bytes;
        PyObject **into = j->stored ? &j->stored : stored; /* as below */
        if (events && nvt_append_key(into, o->key, o->key_len) < 0)
            event_lost(t);
        goto done;
    }
    if (o->applied == NVT_APPLIED_LOADED || o->applied == NVT_APPLIED_LOADED_VERIFIED) {
        /* Its worker checked the slot and released this load's pin. */
        if (o->applied == NVT_APPLIED_LOADED_VERIFIED)
            t->core.c.loads_verified_unverified++;
        t->core.c.ops_read++;
        t->core.c.bytes_read += (unsigned long long)t->row_bytes;
        j->moved += (uint64_t)t->row_bytes;
        goto done;
    }
    int locked;
    if (o->applied == NVT_APPLIED_RECOVER) {
        /* Its worker found the set's holder dead: the recovery is ours. */
        int recovered;
        locked = nvt_set_lock_after_death(&t->core, set, o->dead_holder, o->dead_inc, &recovered) == 0;
        if (recovered)
            o->applied = NVT_APPLIED_NONE;
    } else {
        locked = nvt_set_lock(&t->core, set) == 0;
    }
    if (!locked)
        return 1; /* its holder is stopped or slow: the op stays in flight */
    if (o->kind == NVT_OP_WRITE) {
        if ((*s.state) == NVT_WRITING && (*s.gen) == o->gen && (*s.flags & NVT_FLAG_PURGED)) {
            /* `nvmetier purge --all` ran during the write: never published. */
            nvt_clear_slot_locked(&t->core, s, o->slot); /* the record is still zero */
            set_unlock(&t->core, set);
            t->core.c.stores_purged++;
            nvt_job_fail(j, o->pos, FAIL_DROPPED, 0);
        } else if (ok && (*s.state) == NVT_WRITING && (*s.gen) == o->gen) {
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
            /* Into its job's one stored event (open since the job's submit,
             * see TableObject.events), or, for an abandoned op's write, into
             * this call's own (pushed at its end: the key is there now). */
            PyObject **into = j->stored ? &j->stored : stored;
            if (events && nvt_append_key(into, o->key, o->key_len) < 0)
                event_lost(t);
        } else if (c->result == -EAGAIN) {
            /* A sealed store with no epoch to seal under at this instant (a
             * rotation under way, e.g. after `purge --all` destroyed this
             * process's epoch): nothing was written. Skipped, never an error. */
            if ((*s.state) == NVT_WRITING && (*s.gen) == o->gen)
                nvt_clear_slot_locked(&t->core, s, o->slot); /* the record is still zero */
            set_unlock(&t->core, set);
            t->core.c.stores_skipped_no_epoch++;
            nvt_job_fail(j, o->pos, FAIL_DROPPED, 0);
        } else {
            if ((*s.state) == NVT_WRITING && (*s.gen) == o->gen)
                nvt_clear_slot_locked(&t->core, s, o->slot); /* the record is still zero */
            set_unlock(&t->core, set);
            t->core.c.write_errors++;
            nvt_job_fail(j, o->pos, FAIL_WRITE_IO, ok ? EIO : (int)-c->result);
        }
    } else {
        int same = (*s.gen) == o->gen && (*s.state) == NVT_READY;
        if (o->leased)
            lease_release(s, o->gen, o->epoch); /* this load's own pin; others' stay */
        if (!same) {
            set_unlock(&t->core, set);
            t->core.c.loads_raced++;
            nvt_job_fail(j, o->pos, FAIL_RACED, 0);
        } else if (c->result == -ECANCELED || c->result == -ENOKEY) {
            /* Never read (the engine refused or cancelled the op), or sealed
             * under an epoch announced since this process's key table was
             * read (nvt_keys_open; one that never existed is -EBADMSG, one
             * destroyed -EKEYREVOKED, below):
             * nothing is known against the slot, which stays READY. */
            set_unlock(&t->core, set);
            t->core.c.loads_cancelled++;
            nvt_job_fail(j, o->pos, FAIL_READ_IO, ECANCELED);
        } else if (c->result == -EKEYREVOKED) {
            /* Sealed under an epoch known destroyed (nvt_keys_open: a purge,
             * a retention or a rotation destroyed it while this load was in
             * flight, or since the slot was published): nothing can ever
             * open the slot. A miss, freed with its removed event as a
             * corrupt one is, but not corruption: its own counter, and the
             * job fails quietly as for a key that is not there. */
            free_unreadable(t, s, o->slot, events, removed);
            set_unlock(&t->core, set);
            t->core.c.loads_key_destroyed++;
            nvt_job_fail(j, o->pos, FAIL_MISSING, 0);
        } else if (c->result == -EBADMSG || (o->verify && ok && c->checksum != o->expected)) {
            /* Proven corruption of this very slot (a payload checksum, or an
             * encrypted chunk's tag, that does not verify): a miss, freed. */
            free_unreadable(t, s, o->slot, events, removed);
            set_unlock(&t->core, set);
            t->core.c.checksum_failures++;
            if (c->result == -EBADMSG)
                t->core.c.auth_failures++;
            nvt_job_fail(j, o->pos, FAIL_CHECKSUM, 0);
        } else if (!ok) {
            /* A read error: a miss until rewritten (BAD, not freed: a
             * transient error is not proven corruption). */
            (*s.state) = NVT_BAD;
            t->core.d_ready--;
            set_unlock(&t->core, set);
            t->core.c.read_errors++;
            nvt_job_fail(j, o->pos, FAIL_READ_IO, (int)-c->result);
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
done:
    op_release(t, oi);
    j->remaining--;
    return 0;
}

/* A job of the submit/poll path is done: its entry joins `done` for the next
 * poll(), and the job is freed. The entry: (job_id, success, successful_keys
 * or None, transfer_time_s, moved_bytes, error or None, is_load); error is
 * None when every failed key was only missing (a miss, not a fault). -1 (out
 * of memory) leaves the job as it was, to be reported later. */
static int finish_submitted(TableObject *self, uint32_t ji) {
    job_info *j = &self->jobs[ji];
    int failed = j->n_failed || j->oom;
    if (nvt_alloc_fails()) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *ok;
    if (!failed || !j->keys) {
        ok = Py_NewRef(Py_None); /* no keys kept (a store_ops job): none to name */
    } else if (j->oom) {
        ok = PyList_New(0); /* which keys failed is not known: none succeeded */
    } else {
        Py_ssize_t m = PySequence_Fast_GET_SIZE(j->keys);
        char *bad = PyMem_Calloc((size_t)(m ? m : 1), 1);
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
    if (!ok)
        return -1;
    PyObject *text = fail_text(j);
    if (!text) {
        Py_DECREF(ok);
        return -1;
    }
    double secs = (double)(now_mono_ns() - j->start_ns) / 1e9;
    PyObject *item = Py_BuildValue("(LONdKNO)", (long long)j->job_id, failed ? Py_False : Py_True, ok,
                                   j->start_ns ? secs : 0.0, (unsigned long long)j->moved, text,
                                   j->is_load ? Py_True : Py_False);
    if (!item)
        return -1;
    if (PyList_Append(self->done, item) < 0) {
        Py_DECREF(item);
        return -1;
    }
    Py_DECREF(item);
    if (failed) {
        if (j->is_load)
            self->core.c.load_jobs_failed++;
        else
            self->core.c.store_jobs_failed++;
    }
    job_release(self, ji);
    return 0;
}

/* A job of store_ops/load_ops is done: its entry joins `finished`, and the
 * job is freed. -1 (out of memory) leaves the job as it was. */
static int finish_op_job(TableObject *self, uint32_t ji, PyObject *finished) {
    job_info *j = &self->jobs[ji];
    if (nvt_alloc_fails()) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *failed, *text;
    if (j->n_failed || j->oom) {
        if (!(failed = PyList_New(j->n_failed)))
            return -1;
        for (uint32_t f = 0; f < j->n_failed; f++) {
            PyObject *v = PyLong_FromUnsignedLong(j->failed[f]);
            if (!v) {
                Py_DECREF(failed);
                return -1;
            }
            PyList_SET_ITEM(failed, f, v);
        }
    } else {
        failed = Py_NewRef(Py_None);
    }
    if (!(text = fail_text(j))) {
        Py_DECREF(failed);
        return -1;
    }
    PyObject *item = Py_BuildValue("(LOKNN)", (long long)j->job_id, j->is_load ? Py_True : Py_False,
                                   (unsigned long long)j->moved, failed, text);
    if (!item)
        return -1;
    if (PyList_Append(finished, item) < 0) {
        Py_DECREF(item);
        return -1;
    }
    Py_DECREF(item);
    job_release(self, ji);
    return 0;
}

/* Report job ji (to `finished`: a store_ops/load_ops job, or any job when
 * `finished` is NULL: to `done`) and free it when its last op or watch is
 * done. Never fails: a report that cannot be built (out of memory) leaves
 * the job `unreported`, and report_unreported retries it at every later
 * apply, so each job is reported exactly once. */
void nvt_maybe_finish(TableObject *self, uint32_t ji, PyObject *finished) {
    job_info *j = &self->jobs[ji];
    if (j->remaining)
        return;
    /* Every write done: its stored event is final, whether or not the report
     * can be built now (the events behind it are not held up by that). */
    nvt_close_stored_event(self, j);
    int was = j->unreported;
    int rc = (j->keys || !finished) ? finish_submitted(self, ji) : finish_op_job(self, ji, finished);
    if (rc == 0) {
        if (was)
            self->n_unreported--;
        return;
    }
    PyErr_Clear();
    if (!was) {
        j->unreported = 1;
        self->n_unreported++;
    }
}

/* Retry the reports that ran out of memory (nvt_maybe_finish). A store_ops or
 * load_ops job waits for a call with its `finished` list (complete()). */
static void report_unreported(TableObject *self, PyObject *finished) {
    for (uint32_t i = 0; i < self->n_jobs_cap && self->n_unreported; i++) {
        job_info *j = &self->jobs[i];
        if (j->in_use && j->unreported && (j->keys || finished))
            nvt_maybe_finish(self, i, finished);
    }
}

/* Resolve watches (stores of keys another write was already writing). A
 * watched key counts as stored by this job only if its slot is READY with
 * the generation the watch saw (that write published it). It fails (quiet:
 * not stored by this job, counted) when that write failed, was cancelled or
 * its writer died (the slot left WRITING at that generation), or when it is
 * still WRITING past the watch's deadline (a stopped or hung writer). A set
 * that cannot be locked leaves the watch pending until its deadline. */
static void check_watches(TableObject *self, PyObject *finished) {
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
            nvt_job_fail(&self->jobs[wt.job], wt.pos, FAIL_DROPPED, 0);
        }
        self->jobs[wt.job].remaining--;
        nvt_maybe_finish(self, wt.job, finished);
    }
    self->n_watches = keep;
}

/* Room for `n` deferred completions in all, so that nvt_defer() never fails
 * while completions are being applied. -1 on out of memory (nothing changed). */
int nvt_defer_reserve(TableObject *self, size_t n) {
    if (n <= self->cap_deferred)
        return 0;
    size_t cap = self->cap_deferred ? self->cap_deferred : 64;
    while (cap < n)
        cap *= 2;
    struct deferred *d = nvt_alloc_fails() ? NULL : PyMem_Realloc(self->deferred, cap * sizeof(struct deferred));
    if (!d) {
        PyErr_NoMemory();
        return -1;
    }
    self->deferred = d;
    self->cap_deferred = cap;
    return 0;
}

/* Keep a completion whose set could not be locked, to apply at a later
 * poll (its op stays in flight, its job unfinished until `deadline_ms`, 0: a
 * new deferral). The room was reserved (nvt_defer_reserve). */
void nvt_defer(TableObject *self, const nvt_completion *c, uint64_t deadline_ms) {
    if (!deadline_ms) {
        deadline_ms = nvt_now_ms() + self->core.watch_timeout_ms;
        self->core.c.completions_deferred++;
    }
    self->deferred[self->n_deferred].c = *c;
    self->deferred[self->n_deferred].deadline_ms = deadline_ms;
    self->n_deferred++;
}

/* A deferred completion past its deadline: its job stops waiting for it (the
 * key fails quietly: not stored, or not loaded) and may finish; the op stays,
 * jobless, until its set can be locked (then its slot is published or freed,
 * or its lease released). */
static void abandon_op(TableObject *self, uint32_t oi, PyObject *finished) {
    op_info *o = op_at(self, (uint32_t)oi);
    uint32_t ji = o->job;
    o->job = JOB_NONE;
    self->core.c.completions_abandoned++;
    job_info *j = &self->jobs[ji];
    nvt_job_fail(j, o->pos, FAIL_DROPPED, 0);
    j->remaining--;
    nvt_maybe_finish(self, ji, finished);
}

/* Apply one completion, or defer it (room reserved); then finish its job if
 * that was its last op. Never fails. */
static void apply_or_defer(TableObject *self, const nvt_completion *c, uint64_t deadline_ms, int events,
                           PyObject *finished, PyObject **stored, PyObject **removed) {
    uintptr_t raw = (uintptr_t)c->op_id;
    uint32_t oi = (uint32_t)raw;
    int live = raw < self->n_ops_cap && op_at(self, (uint32_t)oi)->in_use;
    uint32_t ji = live ? op_at(self, (uint32_t)oi)->job : JOB_NONE;
    if (nvt_apply_one(self, c, events, stored, removed) > 0) {
        if (deadline_ms && ji != JOB_NONE && nvt_now_ms() >= deadline_ms)
            abandon_op(self, oi, finished);
        nvt_defer(self, c, deadline_ms);
        return;
    }
    if (ji != JOB_NONE)
        nvt_maybe_finish(self, ji, finished);
}

/* Apply the completions deferred by earlier calls (each is tried once). Those
 * deferred again go back in place (the array only shrinks meanwhile: no
 * allocation). */
static void apply_deferred(TableObject *self, int events, PyObject *finished, PyObject **stored,
                           PyObject **removed) {
    size_t n = self->n_deferred;
    self->n_deferred = 0;
    for (size_t i = 0; i < n; i++) {
        struct deferred d = self->deferred[i]; /* nvt_defer() writes at an index <= i */
        apply_or_defer(self, &d.c, d.deadline_ms, events, finished, stored, removed);
    }
}

/* Apply `n` completions, then resolve watches; finished jobs go to
 * `finished` (store_ops/load_ops jobs) or `done` (submitted jobs). Returns
 * -1 (out of memory) only before anything was applied; after that, nothing
 * fails: every completion is applied or deferred and every job whose last op
 * this was is reported (now or, out of memory, at a later call). */
int nvt_apply_batch(TableObject *self, const nvt_completion *cs, Py_ssize_t n, int events,
                       PyObject *finished, PyObject **stored, PyObject **removed) {
    if (nvt_defer_reserve(self, self->n_deferred + (size_t)n) < 0)
        return -1;
    if (self->n_unreported)
        report_unreported(self, finished);
    apply_deferred(self, events, finished, stored, removed);
    /* Prefetch (prefetch_set's comment): each op's slab entry, then once
     * those arrive, its set's head and state line and its record, unless
     * the engine's worker applied it already (then only the entry is read). */
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t raw = (uintptr_t)cs[i].op_id;
        if (raw < self->n_ops_cap)
            __builtin_prefetch(op_at(self, (uint32_t)raw), 0);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t raw = (uintptr_t)cs[i].op_id;
        const op_info *o = raw < self->n_ops_cap ? op_at(self, (uint32_t)raw) : NULL;
        if (o && o->in_use && (o->applied == NVT_APPLIED_NONE || o->applied == NVT_APPLIED_RECOVER)) {
            uint32_t slot = o->slot;
            prefetch_set(&self->core, slot / self->core.ways, 0);
            __builtin_prefetch(record(&self->core, slot), 1);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        apply_or_defer(self, &cs[i], 0, events, finished, stored, removed);
    if (self->n_watches)
        check_watches(self, finished);
    return 0;
}

/* Append the event (removed, keys) to `events` (keys: a list, referenced).
 * -1 with an exception set (out of memory): nothing appended. */
int nvt_push_event(TableObject *self, int removed, PyObject *keys) {
    if (nvt_alloc_fails()) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *ev = Py_BuildValue("(OO)", removed ? Py_True : Py_False, keys);
    int rc = ev ? PyList_Append(self->events, ev) : -1;
    Py_XDECREF(ev);
    if (rc == 0)
        self->ev_next++;
    return rc;
}

/* Place store job ji's one stored event at the end of `events` (its submit:
 * see TableObject.events), empty and open until its last op is done. -1 with
 * an exception set (out of memory): nothing placed, the job as it was. */
int nvt_open_stored_event(TableObject *self, uint32_t ji) {
    job_info *j = &self->jobs[ji];
    if (self->n_ev_open == self->cap_ev_open) {
        size_t cap = self->cap_ev_open ? self->cap_ev_open * 2 : 64;
        uint64_t *o = nvt_alloc_fails() ? NULL : PyMem_Realloc(self->ev_open, cap * sizeof(uint64_t));
        if (!o) {
            PyErr_NoMemory();
            return -1;
        }
        self->ev_open = o;
        self->cap_ev_open = cap;
    }
    PyObject *keys = nvt_alloc_fails() ? NULL : PyList_New(0);
    if (!keys) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    if (nvt_push_event(self, 0, keys) < 0) {
        Py_DECREF(keys);
        return -1;
    }
    j->stored = keys;
    j->ev_seq = self->ev_next - 1;
    self->ev_open[self->n_ev_open++] = j->ev_seq; /* numbers only grow: stays ascending */
    return 0;
}

/* Job j's stored event is final (its last op done, or the job freed): the
 * events up to the next open one may be handed out. Never fails. */
void nvt_close_stored_event(TableObject *self, job_info *j) {
    if (!j->stored)
        return;
    size_t lo = 0, hi = self->n_ev_open;
    while (lo < hi) { /* ev_open is ascending: find j's number */
        size_t mid = lo + (hi - lo) / 2;
        if (self->ev_open[mid] < j->ev_seq)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < self->n_ev_open && self->ev_open[lo] == j->ev_seq) {
        memmove(&self->ev_open[lo], &self->ev_open[lo + 1], (self->n_ev_open - lo - 1) * sizeof(uint64_t));
        self->n_ev_open--;
    }
    Py_CLEAR(j->stored);
}

/* The removals of keys whose retention passed (the core's on_expired, which
 * runs under a set lock and only remembers them) as one event at the end of
 * `events`. Called before a store job's event is placed (a key expired and
 * written again must be removed before it is stored) and by take_events. A
 * push that fails (out of memory) is counted per key. */
void nvt_flush_expired(TableObject *self) {
    if (!self->expired || !PyList_GET_SIZE(self->expired))
        return;
    PyObject *keys = self->expired;
    self->expired = NULL;
    if (nvt_push_event(self, 1, keys) < 0) {
        PyErr_Clear();
        self->events_lost += (unsigned long long)PyList_GET_SIZE(keys);
    }
    Py_DECREF(keys);
}

/* take_events(): the events before the first stored event still open, in
 * order; a job's event that stayed empty (nothing it wrote was published) is
 * left out. NULL with an exception set (out of memory): nothing taken. */
PyObject *nvt_take_events(TableObject *self) {
    nvt_flush_expired(self);
    Py_ssize_t n = PyList_GET_SIZE(self->events);
    Py_ssize_t upto = self->n_ev_open ? (Py_ssize_t)(self->ev_open[0] - self->ev_first) : n;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < upto; i++) {
        PyObject *ev = PyList_GET_ITEM(self->events, i);
        if (!PyList_GET_SIZE(PyTuple_GET_ITEM(ev, 1)))
            continue;
        if (PyList_Append(out, ev) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    if (upto && PyList_SetSlice(self->events, 0, upto, NULL) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    self->ev_first += (uint64_t)upto;
    return out;
}

/* Apply what the engine completed, waiting up to `timeout` (a float) for it,
 * and the completions deferred earlier, and resolve watches. -1 only when
 * nothing was taken from the engine (its call failed, or no room for what it
 * may return could be reserved): what it completed stays there. */
int nvt_collect(TableObject *self, PyObject *timeout) {
    PyObject *comps = NULL;
    Py_buffer b = {0};
    Py_ssize_t n = 0;
    /* A poll (timeout 0) of the hooked io_uring engine whose hint reads no
     * completion waiting: nothing to take, and no call into the engine (the
     * scheduler thread polls every step, mostly while ops are in flight). A
     * completion published after the read is taken by the next poll, as the
     * engine's own hint check would leave it. */
    int idle = self->done_hint && PyFloat_CheckExact(timeout) && PyFloat_AS_DOUBLE(timeout) <= 0 &&
               !__atomic_load_n(self->done_hint, __ATOMIC_ACQUIRE);
    if (self->outstanding && self->eng_wait && !idle) {
        /* Every completion taken may have to be deferred: room first. */
        if (nvt_defer_reserve(self, self->n_deferred + self->outstanding) < 0)
            return -1;
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
    if (n || self->n_deferred || self->n_watches || self->n_unreported) {
        PyObject *stored = NULL, *removed = NULL;
        rc = nvt_apply_batch(self, n ? b.buf : NULL, n, self->events_on, NULL, &stored, &removed);
        if (stored && nvt_push_event(self, 0, stored) < 0)
            event_lost(self);
        if (removed && nvt_push_event(self, 1, removed) < 0)
            event_lost(self);
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

/* Hand over the list in *slot, leaving a new empty one there. */
PyObject *nvt_take_list(PyObject **slot) {
    PyObject *fresh = PyList_New(0);
    if (!fresh)
        return NULL;
    PyObject *out = *slot;
    *slot = fresh;
    return out;
}
