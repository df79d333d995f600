/*
 * nvt_jobs: the job path of nvmetier._table (see nvt_jobs.h). Called by the
 * CPython type (nvt_table.c) with the GIL held, on the scheduler thread.
 */
#include "nvt_jobs.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nvt_hash.h"

/* ------------------------------------------------- allocation-failure tests */
/* Tests only (the module's _fail_allocs): every allocation of the job path
 * first asks alloc_fails(); after `fail_after` more such points, the next
 * `fail_count` fail as out of memory. `alloc_points` counts the points
 * passed, so a test can walk every one of them in turn. */
static long long fail_after = -1, fail_count;
static unsigned long long alloc_points;

unsigned long long nvt_test_fail_allocs(long long after, long long count) {
    unsigned long long seen = alloc_points;
    alloc_points = 0;
    fail_after = count > 0 ? after : -1;
    fail_count = count;
    return seen;
}

static int alloc_fails(void) {
    alloc_points++;
    if (fail_after < 0)
        return 0;
    if (fail_after > 0) {
        fail_after--;
        return 0;
    }
    if (--fail_count <= 0)
        fail_after = -1;
    return 1;
}

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
    uint64_t *fps = m <= n_local ? local : alloc_fails() ? NULL : PyMem_Malloc((size_t)m * sizeof(uint64_t));
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

/* ------------------------------------------------------------------ slabs */
/* Double a slab of `size`-byte entries (first: `first` entries) and its free
 * list; new entries are zeroed (so free: in_use = 0, which a stale completion
 * id must find). Returns -1 when out of memory, the slab unchanged. */
static int slab_grow(void **items, size_t size, uint32_t **free_list, uint32_t *n_free, uint32_t *cap,
                     uint32_t first) {
    uint32_t old = *cap, grown = old ? old * 2 : first;
    if (alloc_fails())
        return -1;
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
    j->oom = 0;
    j->unreported = 0;
    t->jobs_live++;
    return i;
}

static void job_release(TableObject *t, uint32_t i) {
    Py_CLEAR(t->jobs[i].keys);
    t->jobs[i].in_use = 0;
    t->job_free[t->n_job_free++] = i;
    t->jobs_live--;
}

/* Key `pos` of job `j` failed for `kind`. Never fails: when the list of
 * failed positions cannot grow, the job is marked `oom` and reports every key
 * failed (successful_keys empty), so no failed key is ever reported stored or
 * loaded, and nothing on the completion path has to be undone. */
static void job_fail(job_info *j, uint32_t pos, int kind, int err) {
    if (!j->in_use)
        return; /* the stand-in job of an abandoned op (apply_one) */
    if (j->n_failed == j->cap_failed) {
        uint32_t cap = j->cap_failed ? j->cap_failed * 2 : 8;
        uint32_t *f = alloc_fails() ? NULL : PyMem_Realloc(j->failed, cap * sizeof(uint32_t));
        if (f) {
            j->failed = f;
            j->cap_failed = cap;
        }
    }
    if (j->n_failed < j->cap_failed)
        j->failed[j->n_failed++] = pos;
    else
        j->oom = 1;
    if (j->first_fail == FAIL_NONE || (fail_quiet(j->first_fail) && !fail_quiet(kind))) {
        j->first_fail = (uint8_t)kind;
        j->first_errno = err;
    }
}

/* A snapshot of a sequence argument (keys, rows) as a tuple: its items are
 * owned by it, so neither another thread (while a set wait releases the GIL)
 * nor an item's __index__ can shrink or edit what this call walks, and a
 * job keeps the keys it was given. NULL with TypeError(msg) when `obj` is not
 * iterable. */
PyObject *nvt_seq_snapshot(PyObject *obj, const char *msg) {
    PyObject *t = PySequence_Tuple(obj);
    if (!t && PyErr_ExceptionMatches(PyExc_TypeError))
        PyErr_SetString(PyExc_TypeError, msg);
    return t;
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
    if (alloc_fails()) {
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

static int append_key(PyObject **list, const char *key, Py_ssize_t n) {
    if (alloc_fails()) {
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
Py_ssize_t nvt_job_args(PyObject *keys, PyObject *rows_obj, PyObject **seq, Py_buffer *rows,
                           PyObject **out) {
    *seq = nvt_seq_snapshot(keys, "keys must be a sequence");
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

/* Key `i` of a job fails for `kind`: to `*list` as a position (store_ops,
 * load_ops: the model test's primitives) or into the job (submit_store,
 * submit_load). Used for bad arguments, keys missing from a load, and keys
 * of a store left out for lack of resources (a full queue, a set whose ways
 * are all busy or leased, a set lock not taken in its bound: DROPPED, quiet,
 * no error text). -1 with an exception set on out of memory. */
static int key_failed(TableObject *self, int64_t job, Py_ssize_t i, PyObject **list, int kind) {
    if (list)
        return append_pos(list, i);
    job_fail(&self->jobs[job], (uint32_t)i, kind, 0);
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
            if (job < 0 && (job = job_alloc(self, job_id, 0)) < 0) {
                PyErr_NoMemory();
                goto error;
            }
            if (self->n_watches == self->cap_watches) {
                size_t cap = self->cap_watches ? self->cap_watches * 2 : 64;
                struct watch *wl = alloc_fails() ? NULL : PyMem_Realloc(self->watches, cap * sizeof(struct watch));
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
void nvt_store_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job) {
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

/* Lease every READY key of a load job and build its read op (load_ops and
 * submit_load). Keys not READY (or with a bad row) go to `*missing`
 * (load_ops), or fail in the job as MISSING when `missing` is NULL
 * (submit_load). Returns 0, or -1 with an exception set (unwind with
 * load_unwind). */
int nvt_load_loop(TableObject *self, int64_t job_id, PyObject *seq, Py_ssize_t m, Py_buffer *rows,
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
            if (key_failed(self, job, i, missing, FAIL_MISSING) < 0)
                goto error;
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
void nvt_load_unwind(TableObject *self, const nvt_op *ops, Py_ssize_t n_ops, int64_t job) {
    for (Py_ssize_t i = 0; i < n_ops; i++)
        op_release(self, (uint32_t)(uintptr_t)ops[i].op_id);
    if (job >= 0)
        job_release(self, (uint32_t)job);
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
        if (j->oom)
            return PyUnicode_FromString("out of memory recording the failed keys (all reported failed)");
        Py_RETURN_NONE;
    }
}

/* A KV event key that could not be recorded (out of memory): the op is
 * applied all the same, and the loss counted (kv_events_lost). */
static void event_lost(TableObject *t) {
    PyErr_Clear();
    t->events_lost++;
}

/* Apply one completion: the slot is published or freed, the op released and
 * its job counted down, with nothing that can fail in between (a failed key
 * marks the job, a lost KV event is counted). Returns 0, or 1 when its set
 * could not be locked (nothing changed: apply it again later, see defer). */
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
        if ((*s.state) == NVT_WRITING && (*s.gen) == o->gen && (*s.flags & NVT_FLAG_PURGED)) {
            /* `nvmetier purge --all` ran during the write: never published. */
            nvt_clear_slot_locked(&t->core, s, o->slot); /* the record is still zero */
            set_unlock(&t->core, set);
            t->core.c.stores_purged++;
            job_fail(j, o->pos, FAIL_DROPPED, 0);
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
            if (events && append_key(stored, o->key, o->key_len) < 0)
                event_lost(t);
        } else {
            if ((*s.state) == NVT_WRITING && (*s.gen) == o->gen)
                nvt_clear_slot_locked(&t->core, s, o->slot); /* the record is still zero */
            set_unlock(&t->core, set);
            t->core.c.write_errors++;
            job_fail(j, o->pos, FAIL_WRITE_IO, ok ? EIO : (int)-c->result);
        }
    } else {
        int same = (*s.gen) == o->gen && (*s.state) == NVT_READY;
        if (o->leased)
            lease_release(s, o->gen, o->epoch); /* this load's own pin; others' stay */
        if (!same) {
            set_unlock(&t->core, set);
            t->core.c.loads_raced++;
            job_fail(j, o->pos, FAIL_RACED, 0);
        } else if (c->result == -ECANCELED) {
            /* Never read (the engine refused or cancelled the op): nothing is
             * known about the slot, which stays READY for every sharer. */
            set_unlock(&t->core, set);
            t->core.c.loads_cancelled++;
            job_fail(j, o->pos, FAIL_READ_IO, ECANCELED);
        } else if (c->result == -EBADMSG || (o->verify && ok && c->checksum != o->expected)) {
            /* Proven corruption of this very slot (a payload checksum, or an
             * encrypted chunk's tag, that does not verify): a miss, freed. */
            const unsigned char *r = record(&t->core, o->slot);
            int kl = r[5];
            if (events && kl <= REC_KEY_MAX && append_key(removed, (const char *)r + REC_KEY_OFFSET, kl) < 0)
                event_lost(t);
            nvt_clear_slot_locked(&t->core, s, o->slot);
            set_unlock(&t->core, set);
            t->core.c.checksum_failures++;
            if (c->result == -EBADMSG)
                t->core.c.auth_failures++;
            job_fail(j, o->pos, FAIL_CHECKSUM, 0);
        } else if (!ok) {
            /* A read error: a miss until rewritten (BAD, not freed: a
             * transient error is not proven corruption). */
            (*s.state) = NVT_BAD;
            t->core.d_ready--;
            set_unlock(&t->core, set);
            t->core.c.read_errors++;
            job_fail(j, o->pos, FAIL_READ_IO, (int)-c->result);
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

/* A job of the submit/poll path is done: its entry joins `done` for the next
 * poll(), and the job is freed. The entry: (job_id, success, successful_keys
 * or None, transfer_time_s, moved_bytes, error or None, is_load); error is
 * None when every failed key was only missing (a miss, not a fault). -1 (out
 * of memory) leaves the job as it was, to be reported later. */
static int finish_submitted(TableObject *self, uint32_t ji) {
    job_info *j = &self->jobs[ji];
    int failed = j->n_failed || j->oom;
    if (alloc_fails()) {
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
    if (alloc_fails()) {
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
static void maybe_finish(TableObject *self, uint32_t ji, PyObject *finished) {
    job_info *j = &self->jobs[ji];
    if (j->remaining)
        return;
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

/* Retry the reports that ran out of memory (maybe_finish). A store_ops or
 * load_ops job waits for a call with its `finished` list (complete()). */
static void report_unreported(TableObject *self, PyObject *finished) {
    for (uint32_t i = 0; i < self->n_jobs_cap && self->n_unreported; i++) {
        job_info *j = &self->jobs[i];
        if (j->in_use && j->unreported && (j->keys || finished))
            maybe_finish(self, i, finished);
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
            job_fail(&self->jobs[wt.job], wt.pos, FAIL_DROPPED, 0);
        }
        self->jobs[wt.job].remaining--;
        maybe_finish(self, wt.job, finished);
    }
    self->n_watches = keep;
}

/* Room for `n` deferred completions in all, so that defer() never fails
 * while completions are being applied. -1 on out of memory (nothing changed). */
static int defer_reserve(TableObject *self, size_t n) {
    if (n <= self->cap_deferred)
        return 0;
    size_t cap = self->cap_deferred ? self->cap_deferred : 64;
    while (cap < n)
        cap *= 2;
    struct deferred *d = alloc_fails() ? NULL : PyMem_Realloc(self->deferred, cap * sizeof(struct deferred));
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
 * new deferral). The room was reserved (defer_reserve). */
static void defer(TableObject *self, const nvt_completion *c, uint64_t deadline_ms) {
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
    op_info *o = &self->ops[oi];
    uint32_t ji = o->job;
    o->job = JOB_NONE;
    self->core.c.completions_abandoned++;
    job_info *j = &self->jobs[ji];
    job_fail(j, o->pos, FAIL_DROPPED, 0);
    j->remaining--;
    maybe_finish(self, ji, finished);
}

/* Apply one completion, or defer it (room reserved); then finish its job if
 * that was its last op. Never fails. */
static void apply_or_defer(TableObject *self, const nvt_completion *c, uint64_t deadline_ms, int events,
                           PyObject *finished, PyObject **stored, PyObject **removed) {
    uintptr_t raw = (uintptr_t)c->op_id;
    uint32_t oi = (uint32_t)raw;
    int live = raw < self->n_ops_cap && self->ops[oi].in_use;
    uint32_t ji = live ? self->ops[oi].job : JOB_NONE;
    if (apply_one(self, c, events, stored, removed) > 0) {
        if (deadline_ms && ji != JOB_NONE && nvt_now_ms() >= deadline_ms)
            abandon_op(self, oi, finished);
        defer(self, c, deadline_ms);
        return;
    }
    if (ji != JOB_NONE)
        maybe_finish(self, ji, finished);
}

/* Apply the completions deferred by earlier calls (each is tried once). Those
 * deferred again go back in place (the array only shrinks meanwhile: no
 * allocation). */
static void apply_deferred(TableObject *self, int events, PyObject *finished, PyObject **stored,
                           PyObject **removed) {
    size_t n = self->n_deferred;
    self->n_deferred = 0;
    for (size_t i = 0; i < n; i++) {
        struct deferred d = self->deferred[i]; /* defer() writes at an index <= i */
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
    if (defer_reserve(self, self->n_deferred + (size_t)n) < 0)
        return -1;
    if (self->n_unreported)
        report_unreported(self, finished);
    apply_deferred(self, events, finished, stored, removed);
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
        apply_or_defer(self, &cs[i], 0, events, finished, stored, removed);
    if (self->n_watches)
        check_watches(self, finished);
    return 0;
}

int nvt_push_event(TableObject *self, int removed, PyObject *keys) {
    if (alloc_fails()) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *ev = Py_BuildValue("(OO)", removed ? Py_True : Py_False, keys);
    int rc = ev ? PyList_Append(self->events, ev) : -1;
    Py_XDECREF(ev);
    return rc;
}

/* Apply what the engine completed, waiting up to `timeout` (a float) for it,
 * and the completions deferred earlier, and resolve watches. -1 only when
 * nothing was taken from the engine (its call failed, or no room for what it
 * may return could be reserved): what it completed stays there. */
int nvt_collect(TableObject *self, PyObject *timeout) {
    PyObject *comps = NULL;
    Py_buffer b = {0};
    Py_ssize_t n = 0;
    if (self->outstanding && self->eng_wait) {
        /* Every completion taken may have to be deferred: room first. */
        if (defer_reserve(self, self->n_deferred + self->outstanding) < 0)
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
    Py_ssize_t m = nvt_job_args(keys, rows_obj, &seq, &rows, &out);
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
        rc = nvt_load_loop(self, job_id, seq, m, &rows, self->verify, ops, &n_ops, &job, NULL);
    } else {
        long long room = (long long)self->max_queued_ops - (long long)self->outstanding;
        rc = nvt_store_loop(self, job_id, seq, m, &rows, room > 0 ? room : 0, self->events_on, skip, ops, &n_ops,
                        &job, NULL, &evicted);
    }
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    if (rc == 0 && evicted && nvt_push_event(self, 1, evicted) < 0)
        event_lost(self); /* the evictions happened: the store goes on */
    Py_XDECREF(evicted);
    /* Room to defer every op, should the engine refuse them (below). */
    if (rc == 0 && n_ops && defer_reserve(self, self->n_deferred + (size_t)n_ops) < 0)
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
                if (apply_one(self, &c, 0, NULL, NULL) > 0)
                    defer(self, &c, 0);
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
    maybe_finish(self, (uint32_t)job, NULL);
    return err;
fail_args:
    PyBuffer_Release(&rows);
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
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
