/*
 * nvt_job_load: the load side of the job path (see nvt_jobs.h): a load job's
 * keys to read ops, each slot leased for its read (or the lease this step's
 * plan or lookup granted to the same key object taken over: nvt_leases.c),
 * its recency marked; and the undoing of a load that failed. submit_load
 * (nvt_job_submit.c) hands the ops to the bound engine; the completions come
 * back through nvt_job_complete.c. Called with the GIL held, on the
 * scheduler thread; a set wait releases the GIL (nvt_core.c).
 */
#include "nvt_jobs.h"

#include <stdint.h>
#include <string.h>

#include "nvt_hash.h"

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
            int64_t row = nvt_row_at(rows, i);
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
    fps = nvt_job_fps(self, seq, m, fps_local, 64, 0, n_taken ? taken : NULL);
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
    /* Two stages ahead, as nvt_ready_keys: the sets' lines 2 * NVT_READY_AHEAD
     * keys ahead, then, once their tags are in, the matching ways' lines
     * (fingerprint, record, lease, recency, gen) NVT_READY_AHEAD ahead. The
     * plan's lease read them in this step, but vLLM's own work since (a CPU
     * tier slot for each HIT) leaves them out of the near caches: through
     * vLLM, submit_load 0.34 -> 0.315 us a chunk (8 rounds alternated). A
     * key whose grant is taken over: the lines its check reads, from the
     * grant's slot, 2 * NVT_READY_AHEAD ahead. */
    for (Py_ssize_t i = m - 1; i >= 0 && i >= m - 2 * NVT_READY_AHEAD; i--) {
        if (TAKEN(i))
            prefetch_grant(&self->core, grants[i].slot);
        else
            prefetch_set(&self->core, fps[i] % self->core.n_sets, 0);
    }
    for (Py_ssize_t i = m - 1; i >= 0; i--) {
        Py_ssize_t far = i - 2 * NVT_READY_AHEAD, near = i - NVT_READY_AHEAD;
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
        int64_t row = nvt_row_at(rows, i);
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
                nvt_key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n);
                fp = nvt_xxh3(k, (size_t)n, 0);
                set = fp % self->core.n_sets;
            }
        } else {
            nvt_key_arg(PySequence_Fast_GET_ITEM(seq, i), &k, &n); /* checked by nvt_job_fps */
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
            if (nvt_key_failed(self, job, i, missing, FAIL_MISSING) < 0)
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
        nvt_fill_op(self, &ops[--top], (uint32_t)oi, slot, row, NVT_OP_READ, fp, check);
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
    nvt_free_fps(fps, fps_local);
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

