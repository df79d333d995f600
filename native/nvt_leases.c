/*
 * nvt_leases: the leases this process's Table granted in the current step
 * (lookup hits and lease_many, a plan's read of a request's keys), which
 * release_leases drops at the step's end, and their hand-over to a load of
 * the same key in that step.
 *
 * Owns, per Table: `held` (one nvt_held per grant: the slot, its generation
 * and lease epoch, the grant's end, what the slot's record said then, and a
 * reference to the key object leased) and `held_map`, an open-addressed map
 * from a key object's address to its newest grant.
 *
 * Why a hand-over. A promotion's plan leases a request's chunks on disk
 * (lease_many) and vLLM submits their load moments later, in the same step,
 * with the same key objects. The load used to find every key again (hash,
 * set, tags, fingerprint, record, lease lines: ~8 cache lines a key, cold by
 * then) and grant a second lease that its completion releases, while
 * release_leases walked the plan's grants once more. Now the load takes the
 * plan's grant over (nvt_take_grant): it locks the set, checks the slot's
 * generation, state and lease epoch (the slot still holds the key, the
 * grant still pins it) and marks its recency, from the grant's own record of
 * where the key is; its completion releases that grant, and release_leases
 * leaves it alone. Anything that changed since (another sharer freed or
 * rewrote the slot, it went BAD, retention expired it) sends the key down
 * the load's ordinary path, which finds it again or fails it, the grant's
 * pin (if the slot still has it) given back first; a grant whose lease ran
 * out is replaced by a new one. A load that fails before its ops are out
 * gives back the grants it took (nvt_load_loop, nvt_load_unwind): a grant
 * taken over is released exactly once, by that load.
 *
 * Identity, not equality: a grant is handed over only to the very object
 * leased (vLLM passes a request's own key objects to its lookups and its
 * load jobs). The grant holds a reference to it, so its address cannot be
 * another object's until release_leases drops it. A sealed store's keys are
 * MACs made per call, so its loads never match (they take the ordinary path).
 *
 * Threads: the Table's owner thread only (vLLM's scheduler thread), with the
 * GIL held; set mutexes as nvt_core takes them.
 */
#include "nvt_jobs.h"

#include <stdint.h>
#include <string.h>

static inline size_t map_slot(const TableObject *t, const PyObject *key) {
    return (size_t)(((uint64_t)(uintptr_t)key * 0x9E3779B97F4A7C15ULL) >> (64 - t->map_bits));
}

/* Put grant `h` in the map under its key (a newer grant of the same object
 * replaces an older one). The map has room (map_room). */
static void map_put(TableObject *t, size_t h) {
    PyObject *key = t->held[h].key;
    size_t mask = t->map_cap - 1;
    for (size_t i = map_slot(t, key);; i = (i + 1) & mask) {
        uint32_t v = t->held_map[i];
        if (v == 0 || t->held[v - 1].key == key) {
            t->held_map[i] = (uint32_t)h + 1;
            return;
        }
    }
}

/* Grow the map to hold n grants at half load at most, rehashed from `held`.
 * Returns 0, or -1 (no memory: the map is dropped, and the grants made while
 * it is missing are only released at the step's end, never handed over). */
static int map_room(TableObject *t, size_t n) {
    if (t->map_cap && 2 * n <= t->map_cap)
        return 0;
    unsigned bits = 9;
    while (((size_t)1 << bits) < 2 * n)
        bits++;
    uint32_t *m = nvt_alloc_fails() ? NULL : PyMem_Calloc((size_t)1 << bits, sizeof(uint32_t));
    PyMem_Free(t->held_map);
    t->held_map = m;
    t->map_cap = m ? (size_t)1 << bits : 0;
    t->map_bits = bits;
    if (!m)
        return -1;
    for (size_t h = 0; h < t->n_held; h++)
        if (t->held[h].key)
            map_put(t, h);
    return 0;
}

void nvt_hold_lease(TableObject *self, uint64_t set, int w, uint64_t now, PyObject *key) {
    slot_ref s = slot_at(&self->core, set, (uint32_t)w);
    uint32_t epoch;
    uint64_t until = now + self->core.lease_ms;
    int pinned = lease_grant(s, now, until, &epoch);
    if (!pinned)
        return;
    if (self->n_held == self->cap_held) {
        size_t cap = self->cap_held ? self->cap_held * 2 : 256;
        nvt_held *h = nvt_alloc_fails() ? NULL : PyMem_Realloc(self->held, cap * sizeof(nvt_held));
        if (!h) /* no memory to remember it: the lease runs out on its own */
            return;
        self->held = h;
        self->cap_held = cap;
    }
    uint64_t slot = set * self->core.ways + (uint64_t)w;
    nvt_held *e = &self->held[self->n_held++];
    e->grant = (nvt_grant){
        .slot = slot,
        .until_ms = until,
        .payload = record_payload(&self->core, slot),
        .stored_ns = record_stored_ns(&self->core, slot),
        .fp = *s.fp,
        .gen = *s.gen,
        .epoch = epoch,
    };
    e->adopted = 0;
    e->key = NULL;
    if (key && map_room(self, self->n_held) == 0) {
        e->key = Py_NewRef(key);
        map_put(self, self->n_held - 1);
    }
}

int64_t nvt_find_grant(TableObject *self, PyObject *key) {
    if (!self->map_cap)
        return -1;
    size_t mask = self->map_cap - 1;
    for (size_t i = map_slot(self, key);; i = (i + 1) & mask) {
        uint32_t v = self->held_map[i];
        if (v == 0)
            return -1;
        nvt_held *e = &self->held[v - 1];
        if (e->key == key)
            return e->adopted ? -1 : (int64_t)v - 1;
    }
}

void nvt_take_grant(TableObject *self, int64_t h, nvt_grant *g) {
    *g = self->held[h].grant;
    self->held[h].adopted = 1;
}

void nvt_release_held(TableObject *self) {
    /* The grants no load took over lose their pin; then the key references
     * go, from an array taken off the Table first (a key's release may run
     * Python code that leases again). */
    nvt_held *held = self->held;
    size_t n = self->n_held;
    self->held_round++;
    for (size_t i = 0; i < n; i++) {
        nvt_held *e = &held[i];
        if (e->adopted)
            continue; /* its load's completion releases it */
        const nvt_grant *g = &e->grant;
        uint64_t set = g->slot / self->core.ways;
        if (nvt_set_lock(&self->core, set) != 0)
            continue; /* the lease runs out on its own */
        lease_release(slot_at(&self->core, set, (uint32_t)(g->slot % self->core.ways)), g->gen, g->epoch);
        set_unlock(&self->core, set);
    }
    if (!n)
        return;
    if (self->map_cap > 8 * (2 * n > 512 ? 2 * n : 512)) {
        /* Grown for a step of many more grants (one long request's plan):
         * dropped rather than cleared at every step from now on; the next
         * grant makes one of its own size. */
        PyMem_Free(self->held_map);
        self->held_map = NULL;
        self->map_cap = 0;
    } else if (self->map_cap) {
        memset(self->held_map, 0, self->map_cap * sizeof(uint32_t));
    }
    int keys = 0;
    for (size_t i = 0; i < n && !keys; i++)
        keys = held[i].key != NULL;
    self->n_held = 0;
    if (!keys)
        return;
    size_t cap = self->cap_held;
    self->held = NULL;
    self->cap_held = 0;
    for (size_t i = 0; i < n; i++)
        Py_CLEAR(held[i].key);
    if (self->held == NULL) { /* nothing leased meanwhile: keep the array */
        self->held = held;
        self->cap_held = cap;
    } else {
        PyMem_Free(held);
    }
}

void nvt_held_free(TableObject *self) {
    for (size_t i = 0; i < self->n_held; i++)
        Py_CLEAR(self->held[i].key);
    self->n_held = 0;
    PyMem_Free(self->held);
    self->held = NULL;
    PyMem_Free(self->held_map);
    self->held_map = NULL;
    self->map_cap = 0;
}
