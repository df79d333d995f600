/*
 * nvt_job_worker: the slot-table side of a completion, applied by the io_uring
 * engine's worker thread that completed the op (nvt_engine_set_apply), so
 * that vLLM's scheduler thread only accounts for it (nvt_apply_one: counters,
 * the job's count-down, KV events, the op's release). Owns the hook's
 * installation on a bound engine (Table.bind(..., apply_hook)) and its
 * removal (bind(None, ...), detach, dealloc).
 *
 * Threads: nvt_worker_apply runs on the engine's I/O threads, several at once
 * (each with its own batch), with no GIL and no Python. It never blocks: a
 * set is only tried (pthread_mutex_trylock), and it reads nothing of the
 * Table but what is fixed while the hook is installed (the mappings and
 * geometry of `core`, row_bytes, apply_holder) and the entries of the ops it
 * was handed, which the scheduler thread wrote before submitting them (the
 * engine's queue lock orders that) and leaves alone until it collects their
 * completions (the done queue's lock orders the worker's writes of
 * `applied` before that). It writes the shared table under the set's mutex
 * exactly as nvt_apply_one would, and never the per-process fields of the
 * core (counters, the gauges' pending changes d_used/d_ready, the stalled and
 * dying sets: the scheduler thread's); a slot it publishes is added to the
 * shared `ready` gauge at once (one atomic), not left to the collect.
 * Install and remove run on the scheduler thread with the GIL; removal
 * blocks until no worker is inside the hook.
 *
 * Only the common cases are applied here (a write that landed on the slot it
 * claimed, unpurged: its record, then READY; a load that verified on the
 * slot it read: its pin released). Anything else (a busy set, a failure, a
 * checksum mismatch, a race, a purge) is left as it is (NVT_APPLIED_NONE), and
 * nvt_apply_one applies it as it always did, deferral included. The
 * durability order is unchanged: a write's record is written after its data
 * completed, and the slot published after its record.
 */
#include "nvt_jobs.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

/* Take the set's mutex without waiting: 0 (held), 1 (busy: leave it to the
 * scheduler thread), or 2 (its holder died: the mutex is made consistent and
 * released here, the repair left to the scheduler thread, see RECOVER). */
static int worker_lock(TableObject *t, uint64_t set, op_info *o) {
    nvt_set_head *h = set_head(t->core.base, t->core.set_bytes, set);
    int r = pthread_mutex_trylock(&h->mu);
    if (r == EOWNERDEAD) {
        /* Its repair (reclaiming the dead sharer's WRITING slots, waiting
         * for its OFD lock) changes this process's dying set and counters
         * and may wait: the scheduler thread does it (nvt_apply_one). Until
         * then the set is as the dead holder left it, which every critical
         * section keeps valid for readers. */
        o->dead_holder = h->holder;
        o->dead_inc = h->holder_inc;
        pthread_mutex_consistent(&h->mu);
        pthread_mutex_unlock(&h->mu);
        return 2;
    }
    if (r != 0)
        return 1;
    h->holder = t->apply_holder;
    h->holder_inc = t->apply_holder_inc;
    return 0;
}

/* One completion: NVT_APPLIED_* (NONE: left to nvt_apply_one). */
static uint8_t worker_apply_one(TableObject *t, const nvt_completion *c, op_info *o) {
    if (c->result != t->row_bytes)
        return NVT_APPLIED_NONE; /* failed, refused or cancelled */
    uint64_t set = o->slot / t->core.ways;
    slot_ref s = slot_at(&t->core, set, o->slot % t->core.ways);
    int r = worker_lock(t, set, o);
    if (r)
        return r == 2 ? NVT_APPLIED_RECOVER : NVT_APPLIED_NONE;
    uint8_t done = NVT_APPLIED_NONE;
    if (o->kind == NVT_OP_WRITE) {
        if (*s.state == NVT_WRITING && *s.gen == o->gen && !(*s.flags & NVT_FLAG_PURGED)) {
            /* The data is written: only now does the record appear, then the slot. */
            nvt_write_record(&t->core, o->slot, o->key, o->key_len, c->checksum);
            *s.stamp = 0;
            *s.pins = 0;
            *s.owner = 0;
            *s.last = tick(&t->core, set);
            __atomic_store_n(s.state, NVT_READY, __ATOMIC_RELEASE);
            /* The shared gauge counts it now, with the slot: a process that
             * never collects this completion (killed, or unbound after its
             * engine's close landed the write) must not leave it short. */
            __atomic_add_fetch(&t->core.hdr->ready, 1, __ATOMIC_RELAXED);
            done = NVT_APPLIED_PUBLISHED;
        }
    } else if (*s.gen == o->gen && *s.state == NVT_READY && (!o->verify || c->checksum == o->expected)) {
        if (o->leased)
            lease_release(s, o->gen, o->epoch); /* this load's own pin; others' stay */
        done = NVT_APPLIED_LOADED;
        if (o->verify && (*s.flags & NVT_FLAG_UNVERIFIED)) {
            *s.flags &= (uint8_t)~NVT_FLAG_UNVERIFIED; /* verified once: trusted now */
            done = NVT_APPLIED_LOADED_VERIFIED;
        }
    }
    set_unlock(&t->core, set);
    return done;
}

/* The engine's hook (nvt_apply_fn). Two passes of prefetches first, as
 * nvt_apply_batch does: each op's entry, then its set's head and state
 * line and its record, so the misses of a batch overlap. */
void nvt_worker_apply(void *ctx, const nvt_completion *cs, size_t n) {
    TableObject *t = ctx;
    uint32_t cap = __atomic_load_n(&t->n_ops_cap, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < n; i++) {
        uintptr_t raw = (uintptr_t)cs[i].op_id;
        if (raw < cap)
            __builtin_prefetch(op_at(t, (uint32_t)raw), 0);
    }
    for (size_t i = 0; i < n; i++) {
        uintptr_t raw = (uintptr_t)cs[i].op_id;
        if (raw < cap && cs[i].result == t->row_bytes) {
            const op_info *o = op_at(t, (uint32_t)raw);
            prefetch_set(&t->core, o->slot / t->core.ways, 0);
            if (o->kind == NVT_OP_WRITE)
                __builtin_prefetch(record(&t->core, o->slot), 1);
        }
    }
    for (size_t i = 0; i < n; i++) {
        uintptr_t raw = (uintptr_t)cs[i].op_id;
        if (raw >= cap)
            continue; /* not one of this table's ops */
        op_info *o = op_at(t, (uint32_t)raw);
        if (o->in_use && o->applied == NVT_APPLIED_NONE)
            o->applied = worker_apply_one(t, &cs[i], o);
    }
}

/* Install the completion hook of the engine behind `capsule` (its
 * apply_hook()), replacing any. 0, or -1 with an exception set (not such a
 * capsule; the Table not attached). */
int nvt_apply_hook_install(TableObject *t, PyObject *capsule) {
    nvt_apply_hook_api *api = PyCapsule_GetPointer(capsule, NVT_APPLY_HOOK_CAPSULE);
    if (!api)
        return -1;
    if (t->core.me < 0) {
        nvt_table_detached();
        return -1;
    }
    nvt_apply_hook_remove(t);
    t->apply_holder = (uint16_t)(t->core.me + 1);
    t->apply_holder_inc = (uint16_t)t->core.my_inc;
    t->apply_cap = Py_NewRef(capsule);
    t->done_hint = api->done_hint;
    api->set_apply(api->engine, nvt_worker_apply, t);
    return 0;
}

/* Remove the hook (if installed): once this returns, no worker is inside it
 * nor enters it again. Blocks for the length of one worker's batch at most,
 * with the GIL held (a worker never waits for the GIL nor for this thread).
 * In a forked child the engine's copy runs no worker: nothing to wait for. */
void nvt_apply_hook_remove(TableObject *t) {
    if (!t->apply_cap)
        return;
    nvt_apply_hook_api *api = PyCapsule_GetPointer(t->apply_cap, NVT_APPLY_HOOK_CAPSULE);
    if (api)
        api->set_apply(api->engine, NULL, NULL);
    t->done_hint = NULL;
    Py_CLEAR(t->apply_cap);
}
