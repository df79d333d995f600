/*
 * nvt_job_submit: the submit side of the job path (see nvt_jobs.h): a job's
 * keys to fingerprints and sets, its rows, the store and load loops that claim
 * or lease a slot and build one nvt_op per key (and undo a loop that failed),
 * and submit_store/submit_load, which hand those ops to the bound engine as
 * one job. What the engine completes comes back through nvt_job_complete.c.
 * Called by the CPython type (nvt_table.c) with the GIL held, on the
 * scheduler thread; a set wait releases the GIL (nvt_core.c).
 */
#include "nvt_jobs.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "nvt_hash.h"

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
 * array: free it with free_fps), with the sets of the first keys prefetched;
 * a key with skip[i] >= 0 (a load's grant taken over) is left unread, its
 * fingerprint 0. NULL with an exception set on a bad key or out of memory. */
static uint64_t *job_fps(TableObject *t, PyObject *seq, Py_ssize_t m, uint64_t *local, Py_ssize_t n_local,
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
/* How many keys ahead nvt_ready_keys prefetches the matching ways (and twice
 * that, the sets). 8, 16 and 32 measured alike (docs/bench.md). */
#define READY_AHEAD 16
Py_ssize_t nvt_ready_keys(TableObject *self, PyObject *seq, Py_ssize_t m, uint8_t *out, int mode) {
    uint64_t fps_local[256], *fps = job_fps(self, seq, m, fps_local, 256, 0, NULL);
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
    for (Py_ssize_t i = PREFETCH_AHEAD; i < m && i < 2 * READY_AHEAD; i++)
        prefetch_set(&self->core, fps[i] % self->core.n_sets, scan);
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + 2 * READY_AHEAD < m)
            prefetch_set(&self->core, fps[i + 2 * READY_AHEAD] % self->core.n_sets, scan);
        if (i + READY_AHEAD < m)
            prefetch_ways(&self->core, fps[i + READY_AHEAD] % self->core.n_sets, fps[i + READY_AHEAD], ways_fields);
        const char *k = NULL;
        Py_ssize_t n = 0;
        key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n); /* checked by job_fps */
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
    free_fps(fps, fps_local);
    return ready;
}

/* Parse `key`, lock its set and find the key in the states of `mask`.
 * Returns 0 with the set locked (*w: the way, or -1), 1 when the set could not
 * be locked (*w = -1, nothing held), or -1 with an exception set. */
int nvt_locate(TableObject *t, PyObject *key, unsigned mask, uint64_t *set, int *w) {
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

static inline int64_t row_at(Py_buffer *v, Py_ssize_t i) {
    return v->itemsize == 4 ? (int64_t)((int32_t *)v->buf)[i] : ((int64_t *)v->buf)[i];
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
static int key_failed(TableObject *self, int64_t job, Py_ssize_t i, PyObject **list, int kind) {
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
    uint64_t fps_local[64], *fps = job_fps(self, seq, m, fps_local, 64, 1, NULL);
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
            if (key_failed(self, job, i, failed, FAIL_BADARG) < 0)
                goto error;
            continue;
        }
        if (n_ops >= max_ops) {
            self->core.c.stores_dropped_queue_full++;
            if (key_failed(self, job, i, failed, FAIL_DROPPED) < 0)
                goto error;
            continue;
        }
        uint64_t fp = fps[i], set = fp % self->core.n_sets;
        if (nvt_set_lock(&self->core, set) != 0) {
            self->core.c.stores_dropped_set_busy++;
            if (key_failed(self, job, i, failed, FAIL_DROPPED) < 0)
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
                if (key_failed(self, job, i, failed, FAIL_DROPPED) < 0)
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

/* Lease every READY key of a load job and build its read op (load_ops and
 * submit_load). Keys not READY (or with a bad row) go to `*missing`
 * (load_ops), or fail in the job as MISSING when `missing` is NULL
 * (submit_load). Returns 0, or -1 with an exception set (unwind with
 * load_unwind).
 *
 * A key object this step's plan or lookup leased is taken over from its
 * grant (nvt_leases.c): its set locked, the slot checked (same generation,
 * READY, the grant's pin still there and not past retention) and its
 * recency marked, from the grant's record of where it is; the grant is the
 * op's, released at its completion. Any other key (or one whose slot
 * changed since) is found in its set and leased as before.
 *
 * The keys are taken last to first: a job lists a request's chunks head
 * first, and the recency each load marks (the set's clock) then leaves the
 * head the most recent of the chunks that share a set, as the refresh of a
 * finished request marks them (nvmetier.vllm.recency: tail first, head
 * last; with the refresh off, the load's marks are the only ones). The ops
 * are built from the end of `ops` down and moved to its front at the end:
 * they stay in the keys' order, and so do the positions in `*missing`. */

/* The lines a taken-over grant's check reads and writes: the set's head (the
 * mutex and clock), its states and flags, and the way's recency, generation
 * and lease epoch. */
static inline void prefetch_grant(nvt_core *t, uint64_t slot) {
    uint64_t set = slot / t->ways;
    slot_ref s = slot_at(t, set, (uint32_t)(slot % t->ways));
    __builtin_prefetch(set_head(t->base, t->set_bytes, set), 1);
    __builtin_prefetch(s.state, 0);
    __builtin_prefetch(s.last, 1);
    __builtin_prefetch(s.gen, 0);
    __builtin_prefetch(s.epoch, 0);
}

/* Release grant `g`'s pin, if its slot still carries it (a grant a load took
 * over but holds no op for: the load failed, or the slot changed). */
static void drop_grant_locked(TableObject *self, const nvt_grant *g) {
    lease_release(slot_at(&self->core, g->slot / self->core.ways, (uint32_t)(g->slot % self->core.ways)), g->gen,
                  g->epoch);
}

static void drop_grant(TableObject *self, const nvt_grant *g) {
    uint64_t set = g->slot / self->core.ways;
    if (nvt_set_lock(&self->core, set) != 0)
        return; /* the lease runs out on its own */
    drop_grant_locked(self, g);
    set_unlock(&self->core, set);
}

/* Take grant `g` over for a load (the set is locked): 1 with *leased,
 * *epoch, *check (or'ed), *gen and *expected set, or 0 when the slot no
 * longer holds what the grant leased (the key then takes the ordinary path;
 * the grant's pin, if still there, is released first: no load holds it,
 * and release_leases leaves a taken grant alone). */
static int take_over_locked(TableObject *self, const nvt_grant *g, uint64_t now, uint64_t until, uint64_t wall_ns,
                            int *leased, uint32_t *epoch, int *check, uint32_t *gen, uint64_t *expected) {
    uint64_t set = g->slot / self->core.ways;
    slot_ref s = slot_at(&self->core, set, (uint32_t)(g->slot % self->core.ways));
    if (*s.gen != g->gen || *s.state != NVT_READY ||
        (self->core.retention_ns && nvt_stamp_expired(g->stored_ns, wall_ns, self->core.retention_ns))) {
        /* Freed, rewritten or gone BAD; or past retention, which the
         * ordinary path counts and frees once no lease covers it. */
        drop_grant_locked(self, g);
        return 0;
    }
    int ours = *s.epoch == g->epoch;
    if (ours && g->until_ms <= now) {
        /* The grant's own end passed: its pin is still there only if a
         * later grant kept the slot's lease going (no expiry seen since,
         * and none due now). The usual load, moments after its plan,
         * reads neither the pins' nor the stamp's line. */
        lease_expire_locked(s, now);
        ours = *s.epoch == g->epoch;
    }
    if (ours) {
        /* The slot's lease never ran out since the grant (its epoch is the
         * same): the grant's pin is there, the op's now. Its end is pushed
         * out only once half of it is spent (the stamp's line is left
         * alone in the usual load). */
        *leased = 1;
        *epoch = g->epoch;
        if (g->until_ms < now + self->core.lease_ms / 2 && *s.stamp < until)
            *s.stamp = until;
    } else {
        *leased = lease_grant(s, now, until, epoch); /* it ran out: a new one */
    }
    *check |= (*s.flags & NVT_FLAG_UNVERIFIED) != 0;
    *s.last = tick(&self->core, set);
    *gen = g->gen;
    *expected = g->payload;
    return 1;
}

int nvt_load_loop(TableObject *self, int64_t job_id, PyObject *seq, Py_ssize_t m, Py_buffer *rows,
                     int verify, nvt_op *ops, Py_ssize_t *n_ops_io, int64_t *job_io, PyObject **missing) {
    Py_ssize_t n_ops = *n_ops_io;
    int64_t job = *job_io;
    int rc = 0;
    uint64_t now = nvt_now_ms(), until = now + self->core.lease_ms;
    /* ops[top..n_ops + built) fill from the end down (the call's buffer has
     * room for one op per key past the n_ops already there). */
    Py_ssize_t top = n_ops + m, built = 0;
    Py_ssize_t missing_from = missing && *missing ? PyList_GET_SIZE(*missing) : 0;
    /* The grants taken over, by key (taken[i] < 0: none), found by the key
     * objects' addresses alone: such a key's bytes are not read again. */
    int64_t taken_local[64], *taken = NULL;
    nvt_grant grants_local[64], *grants = NULL;
    /* The keys below `unreached` are not reached yet by the loop (last to
     * first): on an error, their taken grants are released (no op holds them). */
    Py_ssize_t n_taken = 0, unreached = 0;
    uint64_t wall_ns = 0, fps_local[64], *fps = NULL, round = self->held_round;
    if (self->n_held && self->map_cap) {
        taken = m <= 64 ? taken_local : nvt_alloc_fails() ? NULL : PyMem_Malloc((size_t)m * sizeof(int64_t));
        if (!taken) {
            PyErr_NoMemory();
            goto error;
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            int64_t row = row_at(rows, i);
            int64_t h = row >= 0 && row < self->n_rows ? nvt_find_grant(self, PySequence_Fast_GET_ITEM(seq, i)) : -1;
            if (h >= 0 && !grants) {
                grants = m <= 64 ? grants_local : nvt_alloc_fails() ? NULL : PyMem_Malloc((size_t)m * sizeof(nvt_grant));
                if (!grants) { /* none taken yet */
                    PyErr_NoMemory();
                    goto error;
                }
            }
            if (h >= 0) {
                /* Taken at once, as a copy: the same key twice in the job
                 * takes it once (the other finds it the ordinary way), and
                 * Python code run from here on may end the step. */
                nvt_take_grant(self, h, &grants[i]);
                n_taken++;
            }
            taken[i] = h;
        }
    }
    /* Every other key parsed and hashed (a bad key raises before any grant
     * is used). On a failure the grants taken go back to release_leases;
     * but if Python code run meanwhile (an exception's allocation collecting
     * garbage) already ended the step, held_round moved and that
     * release_leases left them alone: they are released here. */
    fps = job_fps(self, seq, m, fps_local, 64, 0, n_taken ? taken : NULL);
    if (!fps) {
        for (Py_ssize_t i = 0; i < m && n_taken; i++) {
            if (taken[i] < 0)
                continue;
            if (self->held_round == round)
                self->held[taken[i]].adopted = 0;
            else
                drop_grant(self, &grants[i]);
        }
        n_taken = 0;
        goto error;
    }
    if (n_taken && self->core.retention_ns)
        wall_ns = nvt_wall_ns();
#define TAKEN(i) (n_taken && taken[i] >= 0)
    /* Two stages ahead, as nvt_ready_keys: the sets' lines 2 * READY_AHEAD
     * keys ahead, then, once their tags are in, the matching ways' lines
     * (fingerprint, record, lease, recency, gen) READY_AHEAD ahead. The
     * plan's lease read them in this step, but vLLM's own work since (a CPU
     * tier slot for each HIT) leaves them out of the near caches: through
     * vLLM, submit_load 0.34 -> 0.315 us a chunk (8 rounds alternated). A
     * key whose grant is taken over: the lines its check reads, from the
     * grant's slot, 2 * READY_AHEAD ahead. */
    for (Py_ssize_t i = m - 1; i >= 0 && i >= m - 2 * READY_AHEAD; i--) {
        if (TAKEN(i))
            prefetch_grant(&self->core, grants[i].slot);
        else
            prefetch_set(&self->core, fps[i] % self->core.n_sets, 0);
    }
    for (Py_ssize_t i = m - 1; i >= 0; i--) {
        Py_ssize_t far = i - 2 * READY_AHEAD, near = i - READY_AHEAD;
        unreached = i;
        if (far >= 0) {
            if (TAKEN(far))
                prefetch_grant(&self->core, grants[far].slot);
            else
                prefetch_set(&self->core, fps[far] % self->core.n_sets, 0);
        }
        if (near >= 0 && !TAKEN(near))
            prefetch_ways(&self->core, fps[near] % self->core.n_sets, fps[near],
                          NVT_PF_LEASE | NVT_PF_LAST | NVT_PF_GEN);
        const char *k = NULL;
        Py_ssize_t n = 0;
        int64_t row = row_at(rows, i);
        uint64_t fp = fps[i], set = fp % self->core.n_sets;
        int w = -1, leased = 0, check = verify;
        uint32_t gen = 0, epoch = 0;
        uint64_t expected = 0;
        if (TAKEN(i)) {
            const nvt_grant *g = &grants[i];
            uint64_t gset = g->slot / self->core.ways;
            if (nvt_set_lock(&self->core, gset) == 0) {
                if (take_over_locked(self, g, now, until, wall_ns, &leased, &epoch, &check, &gen, &expected)) {
                    set = gset;
                    w = (int)(g->slot % self->core.ways);
                    fp = g->fp; /* the read's checksum seed */
                } /* else take_over_locked released the grant's pin */
                set_unlock(&self->core, gset);
            } else if (self->held_round == round && (size_t)taken[i] < self->n_held) {
                self->held[taken[i]].adopted = 0; /* its set is busy: the step's end releases it */
            }
            if (w >= 0) {
                self->core.c.load_leases_taken++;
            } else { /* the ordinary path: its bytes now (a leased key is bytes) */
                key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n);
                fp = nvt_xxh3(k, (size_t)n, 0);
                set = fp % self->core.n_sets;
            }
        } else {
            key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n); /* checked by job_fps */
        }
        if (w < 0 && n <= REC_KEY_MAX && row >= 0 && row < self->n_rows && nvt_set_lock(&self->core, set) == 0) {
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
            if (key_failed(self, job, i, missing, FAIL_MISSING) < 0)
                goto error;
            continue;
        }
        int64_t oi = -1;
        if ((job < 0 && (job = nvt_job_alloc(self, job_id, 1)) < 0) || (oi = nvt_op_alloc(self)) < 0) {
            if (leased) { /* no op to release it: given back now */
                nvt_grant mine = {.slot = set * self->core.ways + (uint64_t)w, .gen = gen, .epoch = epoch};
                drop_grant(self, &mine);
            }
            PyErr_NoMemory();
            goto error;
        }
        uint64_t slot = set * self->core.ways + (uint64_t)w;
        op_info *o = op_at(self, (uint32_t)oi);
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
        fill_op(self, &ops[--top], (uint32_t)oi, slot, row, NVT_OP_READ, fp, check);
        built++;
        self->jobs[job].remaining++;
    }
    goto done;
error:
    rc = -1;
    for (Py_ssize_t i = 0; i < unreached; i++) /* grants taken, never reached */
        if (TAKEN(i))
            drop_grant(self, &grants[i]);
done:
#undef TAKEN
    free_fps(fps, fps_local);
    if (taken && taken != taken_local)
        PyMem_Free(taken);
    if (grants && grants != grants_local)
        PyMem_Free(grants);
    if (built && top != n_ops)
        memmove(&ops[n_ops], &ops[top], (size_t)built * sizeof(nvt_op));
    n_ops += built;
    if (rc == 0 && missing && *missing && PyList_GET_SIZE(*missing) - missing_from > 1) {
        /* Appended last to first: back to the keys' order. */
        PyObject *tail = PyList_GetSlice(*missing, missing_from, PyList_GET_SIZE(*missing));
        if (!tail || PyList_Reverse(tail) < 0 ||
            PyList_SetSlice(*missing, missing_from, PyList_GET_SIZE(*missing), tail) < 0) {
            if (rc == 0)
                rc = -1;
        }
        Py_XDECREF(tail);
    }
    *n_ops_io = n_ops;
    *job_io = job;
    return rc;
}

/* Undo a load_loop that failed: each op's lease released (a grant it took
 * over from the step's plan, or its own), and its op and job freed. */
void nvt_load_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job) {
    for (Py_ssize_t i = 0; i < n_ops; i++) {
        const op_info *o = op_at(self, (uint32_t)(uintptr_t)ops[i].op_id);
        if (o->leased) {
            nvt_grant mine = {.slot = o->slot, .gen = o->gen, .epoch = o->epoch};
            drop_grant(self, &mine);
        }
        op_release(self, (uint32_t)(uintptr_t)ops[i].op_id);
    }
    if (job >= 0)
        job_release(self, (uint32_t)job);
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
