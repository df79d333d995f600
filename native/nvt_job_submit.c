/*
 * nvt_job_submit: the submit side of the job path (see nvt_jobs.h): a job's
 * keys to fingerprints and sets, its rows, the store loop that claims a slot
 * and builds one nvt_op per key (and undoes a loop that failed), and
 * submit_store/submit_load, which hand a job's ops to the bound engine as
 * one job (the load loop is nvt_job_load.c). What the engine completes comes
 * back through nvt_job_complete.c.
 * Called by the CPython type (nvt_table.c) with the GIL held, on the
 * scheduler thread; a set wait releases the GIL (nvt_core.c).
 */
#include "nvt_jobs.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "nvt_hash.h"

/* ------------------------------------------------------------------ helpers */

/* See nvt_jobs.h. */
uint64_t *nvt_job_fps(TableObject *t, PyObject *seq, Py_ssize_t m, uint64_t *local, Py_ssize_t n_local,
                     int scan, const int64_t *skip) {
    uint64_t *fps = m <= n_local ? local : nvt_alloc_fails() ? NULL : PyMem_Malloc((size_t)m * sizeof(uint64_t));
    if (!fps) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        const char *k;
        Py_ssize_t n;
        if (skip && skip[i] >= 0) {
            fps[i] = 0;
            continue;
        }
        if (nvt_key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n) < 0) {
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

/* Which keys of `seq` (a snapshot of m keys) are READY: out[i] = 1 or 0 when
 * `out`; with mode NVT_READY_TOUCH each READY key marked most recently used,
 * in order, with NVT_READY_LEASE each leased as a lookup hit is
 * (nvt_hold_lease: lease_many), with NVT_READY_CONTAINS nothing changed. No
 * count (contains_many/touch/lease_many). Every key is parsed and hashed first
 * (a bad key raises before any set is locked), and each set is prefetched
 * PREFETCH_AHEAD keys ahead, so that the index's cache misses of a request's
 * keys overlap instead of following each other. A set that cannot be locked
 * is not READY (as nvt_locate). Returns how many keys were READY, or -1 with
 * an exception set. */
Py_ssize_t nvt_ready_keys(TableObject *self, PyObject *seq, Py_ssize_t m, uint8_t *out, int mode) {
    uint64_t fps_local[256], *fps = nvt_job_fps(self, seq, m, fps_local, 256, 0, NULL);
    if (!fps)
        return -1;
    Py_ssize_t ready = 0;
    uint64_t now = mode == NVT_READY_LEASE ? nvt_now_ms() : 0;
    /* A lease writes the set's lease stamps, and the load that follows it
     * the recency: their lines come with the set's (the load then finds
     * them in cache). */
    int scan = mode == NVT_READY_LEASE;
    unsigned mask = mode == NVT_READY_STATES ? (1u << NVT_READY | 1u << NVT_WRITING) : 1u << NVT_READY;
    unsigned ways_fields = mode == NVT_READY_LEASE ? NVT_PF_LEASE | NVT_PF_GEN : mode == NVT_READY_TOUCH ? NVT_PF_LAST : 0;
    /* Two stages ahead: the set's lines 2 * PREFETCH_AHEAD keys ahead, then,
     * once its tags are in, the matching ways' lines PREFETCH_AHEAD ahead. */
    for (Py_ssize_t i = PREFETCH_AHEAD; i < m && i < 2 * NVT_READY_AHEAD; i++)
        prefetch_set(&self->core, fps[i] % self->core.n_sets, scan);
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + 2 * NVT_READY_AHEAD < m)
            prefetch_set(&self->core, fps[i + 2 * NVT_READY_AHEAD] % self->core.n_sets, scan);
        if (i + NVT_READY_AHEAD < m)
            prefetch_ways(&self->core, fps[i + NVT_READY_AHEAD] % self->core.n_sets, fps[i + NVT_READY_AHEAD], ways_fields);
        const char *k = NULL;
        Py_ssize_t n = 0;
        nvt_key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n); /* checked by nvt_job_fps */
        uint64_t fp = fps[i], set = fp % self->core.n_sets;
        int w = -1;
        uint8_t state = NVT_STATE_UNKNOWN;
        if (nvt_set_lock(&self->core, set) == 0) {
            w = nvt_find_way(&self->core, set, fp, k, n, mask);
            state = w >= 0 ? *slot_at(&self->core, set, (uint32_t)w).state : 0;
            if (w >= 0 && mode == NVT_READY_TOUCH)
                *slot_at(&self->core, set, (uint32_t)w).last = tick(&self->core, set);
            else if (w >= 0 && mode == NVT_READY_LEASE)
                nvt_hold_lease(self, set, w, now, PySequence_Fast_GET_ITEM(seq, i));
            set_unlock(&self->core, set);
        }
        if (out)
            out[i] = mode == NVT_READY_STATES ? state : w >= 0;
        ready += state == NVT_READY;
    }
    nvt_free_fps(fps, fps_local);
    return ready;
}

/* Parse `key`, lock its set and find the key in the states of `mask`.
 * Returns 0 with the set locked (*w: the way, or -1), 1 when the set could not
 * be locked (*w = -1, nothing held), or -1 with an exception set. */
int nvt_locate(TableObject *t, PyObject *key, unsigned mask, uint64_t *set, int *w) {
    const char *k;
    Py_ssize_t n;
    if (nvt_key_arg(key, &k, &n) < 0)
        return -1;
    uint64_t fp = nvt_xxh3(k, (size_t)n, 0);
    *set = fp % t->core.n_sets;
    *w = -1;
    if (nvt_set_lock(&t->core, *set) != 0)
        return 1;
    *w = nvt_find_way(&t->core, *set, fp, k, n, mask);
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
    PyObject *seq = nvt_seq_snapshot(obj, "rows must be a sequence of ints");
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

static int append_pos(PyObject **list, Py_ssize_t pos) {
    if (nvt_alloc_fails()) {
        PyErr_NoMemory();
        return -1;
    }
    if (!*list && !(*list = PyList_New(0)))
        return -1;
    PyObject *v = PyLong_FromSsize_t(pos);
    if (!v)
        return -1;
    int r = PyList_Append(*list, v);
    Py_DECREF(v);
    return r;
}

int nvt_append_key(PyObject **list, const char *key, Py_ssize_t n) {
    if (nvt_alloc_fails()) {
        PyErr_NoMemory();
        return -1;
    }
    if (!*list && !(*list = PyList_New(0)))
        return -1;
    PyObject *v = PyBytes_FromStringAndSize(key, n);
    if (!v)
        return -1;
    int r = PyList_Append(*list, v);
    Py_DECREF(v);
    return r;
}


/* The common arguments of a job: keys as a fast sequence, rows as an int
 * buffer of as many, and an output buffer for one op per key. Returns the key
 * count, or -1 with an exception set and nothing held. */
Py_ssize_t nvt_job_args(TableObject *self, PyObject *keys, PyObject *rows_obj, PyObject **seq, Py_buffer *rows,
                           PyObject **out) {
    *seq = nvt_seq_snapshot(keys, "keys must be a sequence");
    if (!*seq)
        return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(*seq);
    if (rows_arg(rows_obj, rows, m) < 0) {
        Py_DECREF(*seq);
        return -1;
    }
    if (nvt_args_detached(self)) {
        PyBuffer_Release(rows);
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

/* Key `i` of a job fails for `kind`: to `*list` as a position (store_ops,
 * load_ops: the model test's primitives) or into the job (submit_store,
 * submit_load). Used for bad arguments, keys missing from a load, and keys
 * of a store left out for lack of resources (a full queue, a set whose ways
 * are all busy or leased, a set lock not taken in its bound: DROPPED, quiet,
 * no error text). -1 with an exception set on out of memory. */
int nvt_key_failed(TableObject *self, int64_t job, Py_ssize_t i, PyObject **list, int kind) {
    if (list)
        return append_pos(list, i);
    nvt_job_fail(&self->jobs[job], (uint32_t)i, kind, 0);
    return 0;
}

/* Claim a slot and build an op for every key of a store job (store_ops and
 * submit_store). `*job` is the job (-1: allocated here at the first op or
 * watch). Keys with a bad length or row go to `*failed` (store_ops), or fail
 * in the job when `failed` is NULL (submit_store). Positions whose `skip`
 * byte is set are left out (success). Returns 0, or -1 with an exception set
 * (unwind with store_unwind). */
int nvt_store_loop(TableObject *self, int64_t job_id, PyObject *seq, Py_ssize_t m, Py_buffer *rows,
                      long long max_ops, int events, const char *skip, nvt_op *ops, Py_ssize_t *n_ops_io,
                      int64_t *job_io, PyObject **failed, PyObject **evicted) {
    Py_ssize_t n_ops = *n_ops_io;
    int64_t job = *job_io;
    int rc = 0;
    uint64_t now = nvt_now_ms();
    uint64_t fps_local[64], *fps = nvt_job_fps(self, seq, m, fps_local, 64, 1, NULL);
    if (!fps)
        goto error;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + PREFETCH_AHEAD < m)
            prefetch_set(&self->core, fps[i + PREFETCH_AHEAD] % self->core.n_sets, 1);
        if (skip && skip[i])
            continue;
        const char *k = NULL;
        Py_ssize_t n = 0;
        nvt_key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n); /* checked in the first pass */
        int64_t row = nvt_row_at(rows, i);
        if (n > REC_KEY_MAX || row < 0 || row >= self->n_rows) {
            if (nvt_key_failed(self, job, i, failed, FAIL_BADARG) < 0)
                goto error;
            continue;
        }
        if (n_ops >= max_ops) {
            self->core.c.stores_dropped_queue_full++;
            if (nvt_key_failed(self, job, i, failed, FAIL_DROPPED) < 0)
                goto error;
            continue;
        }
        uint64_t fp = fps[i], set = fp % self->core.n_sets;
        if (nvt_set_lock(&self->core, set) != 0) {
            self->core.c.stores_dropped_set_busy++;
            if (nvt_key_failed(self, job, i, failed, FAIL_DROPPED) < 0)
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
            if (job < 0 && (job = nvt_job_alloc(self, job_id, 0)) < 0) {
                PyErr_NoMemory();
                goto error;
            }
            if (self->n_watches == self->cap_watches) {
                size_t cap = self->cap_watches ? self->cap_watches * 2 : 64;
                struct watch *wl = nvt_alloc_fails() ? NULL : PyMem_Realloc(self->watches, cap * sizeof(struct watch));
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
                if (nvt_key_failed(self, job, i, failed, FAIL_DROPPED) < 0)
                    goto error;
            }
            continue;
        }
        uint64_t slot = set * self->core.ways + (uint64_t)w;
        slot_ref s = slot_at(&self->core, set, (uint32_t)w);
        if (job < 0 && (job = nvt_job_alloc(self, job_id, 0)) < 0) {
            set_unlock(&self->core, set);
            PyErr_NoMemory();
            goto error;
        }
        int64_t oi = nvt_op_alloc(self);
        if (oi < 0) {
            set_unlock(&self->core, set);
            PyErr_NoMemory();
            goto error;
        }
        if (evict) {
            /* Its removal event last, after every step that can fail: a key
             * in `evicted` is one this loop did evict (the caller announces
             * them even when the loop fails: unwinding frees those slots). */
            const unsigned char *r = record(&self->core, slot);
            if (events && r[5] <= REC_KEY_MAX && nvt_record_has_key(&self->core, slot, (const char *)r + REC_KEY_OFFSET, r[5]) &&
                nvt_append_key(evicted, (const char *)r + REC_KEY_OFFSET, r[5]) < 0) {
                set_unlock(&self->core, set);
                op_release(self, (uint32_t)oi);
                goto error;
            }
            self->core.c.evictions++;
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
        op_info *o = op_at(self, (uint32_t)oi);
        o->slot = (uint32_t)slot;
        o->gen = *s.gen;
        set_unlock(&self->core, set);
        o->expected = 0;
        o->job = (uint32_t)job;
        o->pos = (uint32_t)i;
        o->kind = NVT_OP_WRITE;
        o->key_len = (uint8_t)n;
        memcpy(o->key, k, (size_t)n);
        nvt_fill_op(self, &ops[n_ops++], (uint32_t)oi, slot, row, NVT_OP_WRITE, fp, 1);
        self->jobs[job].remaining++;
    }
    goto done;
error:
    rc = -1;
done:
    nvt_free_fps(fps, fps_local);
    publish_counts(&self->core);
    *n_ops_io = n_ops;
    *job_io = job;
    return rc;
}

/* Undo a store_loop that failed: ops already claimed stay claimed until
 * their WRITING slots are released here; the job and its watches go. */
void nvt_store_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job) {
    for (Py_ssize_t i = 0; i < n_ops; i++) {
        uint32_t oi = (uint32_t)(uintptr_t)ops[i].op_id;
        op_info *o = op_at(self, (uint32_t)oi);
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

/* submit_store / submit_load: see their docs. */
PyObject *nvt_submit_job(TableObject *self, PyObject *args, int is_load) {
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
    Py_ssize_t m = nvt_job_args(self, keys, rows_obj, &seq, &rows, &out);
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
    int64_t job = nvt_job_alloc(self, job_id, is_load);
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
        rc = nvt_load_loop(self, job_id, seq, m, &rows, self->verify, ops, &n_ops, &job, NULL);
    } else {
        long long room = (long long)self->max_queued_ops - (long long)self->outstanding;
        rc = nvt_store_loop(self, job_id, seq, m, &rows, room > 0 ? room : 0, self->events_on, skip, ops, &n_ops,
                        &job, NULL, &evicted);
    }
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    if (evicted && PyList_GET_SIZE(evicted)) {
        /* The evictions happened, whether or not the loop then failed (its
         * unwinding frees those slots): their removals are announced all
         * the same, the loop's exception kept for the caller. */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (nvt_push_event(self, 1, evicted) < 0) {
            PyErr_Clear();
            self->events_lost += (unsigned long long)PyList_GET_SIZE(evicted);
        }
        PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(evicted);
    /* The job's one stored event takes its place now, after every removal
     * that came before its claims (this submit's evictions, keys expired so
     * far), and fills as its writes complete (see TableObject.events). */
    if (rc == 0 && !is_load && self->events_on) {
        nvt_flush_expired(self);
        if (n_ops && nvt_open_stored_event(self, (uint32_t)job) < 0)
            rc = -1;
    }
    /* Room to defer every op, should the engine refuse them (below). */
    if (rc == 0 && n_ops && nvt_defer_reserve(self, self->n_deferred + (size_t)n_ops) < 0)
        rc = -1;
    if (rc < 0) {
        if (is_load)
            nvt_load_unwind(self, ops, n_ops, job);
        else
            nvt_store_unwind(self, ops, n_ops, job);
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
        if (r == Py_False) {
            /* The native engine's own submit_raw answers False, queuing
             * nothing, once its close began: a refusal, as the Python
             * engines' EngineClosedError. */
            Py_DECREF(r);
            r = NULL;
            PyErr_SetString(PyExc_RuntimeError, "the I/O engine is closed");
        }
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
                if (nvt_apply_one(self, &c, 0, NULL, NULL) > 0)
                    nvt_defer(self, &c, 0);
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
            if (!err) { /* out of memory: the job fails all the same, untold why */
                PyErr_Clear();
                err = Py_NewRef(Py_None);
            }
        }
    }
    Py_DECREF(out);
    /* The job is accepted from here on: reported by a poll, now or later. */
    nvt_maybe_finish(self, (uint32_t)job, NULL);
    return err;
fail_args:
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}
