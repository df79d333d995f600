/*
 * nvt_refresh: a finished request's refresh of the disk's recency, less the
 * chunks its own loads already marked (Table.touch(keys, loaded)).
 *
 * vLLM's tier refreshes every chunk a request used when it finishes
 * (nvmetier.vllm.recency): tail first, head last, so that of two chunks of
 * the request in one set the head ends up the more recent. The chunks the
 * request promoted from disk were marked by their load (nvt_load_loop: last
 * to first, the same order) moments before, in the same request. Marking
 * them again costs vLLM's scheduler thread a set lock and the set's cold
 * lines per chunk, for an order they already have: except in a set that also
 * holds a chunk of the request the refresh does mark (a GPU or CPU tier hit,
 * a computed tail, a chunk no load took). There a chunk marked now would end
 * up more recent than the loaded chunks before it in the request, so every
 * chunk of the request in such a set is marked, in the refresh's order, as a
 * full refresh would. So is a set whose loads left its chunks in another
 * order than the refresh's: a request of several load jobs (a later step's
 * load of its tail, a preempted request's second load) marked the later
 * job's chunks after the earlier one's head. The loads' marks are replayed
 * (jobs in order, each last to first, by content) to tell.
 *
 * Which chunks a load took is told by identity: `loaded` holds the request's
 * load jobs' key lists, whose key objects are the ones the request's context
 * records (vLLM passes the same objects along); a key that is only equal is
 * marked as before. The keys' sets come from their fingerprints alone (no
 * table memory is read to choose).
 *
 * Threads: Table.touch's (defined here, in the CPython type), with the GIL
 * held, on vLLM's scheduler thread; a set wait inside the touch is bounded
 * (nvt_core.c).
 */
#include "nvt_jobs.h"
#include "nvt_table_type.h"

#include <stdint.h>
#include <string.h>

#include "nvt_hash.h"

/* Open addressing over pointers (the loaded key objects), the loaded keys'
 * contents (their fingerprints) or set numbers: capacity a power of two, at
 * least twice the entries. */
static size_t pow2_at_least(size_t n) {
    size_t c = 64;
    while (c < n)
        c <<= 1;
    return c;
}

static inline size_t mix(uint64_t v, size_t mask) {
    return (size_t)((v * 0x9E3779B97F4A7C15ull) >> 17) & mask;
}

/* Add `p` (not NULL). */
static void ptr_add(const void **tab, size_t mask, const void *p) {
    for (size_t i = mix((uint64_t)(uintptr_t)p, mask);; i = (i + 1) & mask) {
        if (tab[i] == p)
            return;
        if (!tab[i]) {
            tab[i] = p;
            return;
        }
    }
}

static int ptr_has(const void **tab, size_t mask, const void *p) {
    for (size_t i = mix((uint64_t)(uintptr_t)p, mask);; i = (i + 1) & mask) {
        if (tab[i] == p)
            return 1;
        if (!tab[i])
            return 0;
    }
}

/* A loaded key's content: the last mark the loads gave it (`seq`, counted
 * over the jobs in order, each last to first, as nvt_load_loop marks), and
 * whether the refresh's walk from its end met it already. */
typedef struct {
    PyObject *key; /* NULL: empty */
    uint64_t fp;
    uint64_t seq;
    uint8_t seen;
} loaded_key;

static loaded_key *key_entry(loaded_key *tab, size_t mask, PyObject *key, uint64_t fp) {
    for (size_t i = mix(fp, mask);; i = (i + 1) & mask) {
        loaded_key *e = &tab[i];
        if (!e->key ||
            (e->fp == fp && (e->key == key || (PyBytes_GET_SIZE(e->key) == PyBytes_GET_SIZE(key) &&
                                               !memcmp(PyBytes_AS_STRING(e->key), PyBytes_AS_STRING(key),
                                                       (size_t)PyBytes_GET_SIZE(key))))))
            return e;
    }
}

/* A set of the refresh: whether it is marked in full, and the load mark of
 * the key its walk from the end met last (the next must be older). */
typedef struct {
    uint64_t set1; /* set + 1; 0: empty */
    uint64_t min_seq;
    uint8_t full;
} refresh_set;

static refresh_set *set_entry(refresh_set *tab, size_t mask, uint64_t set) {
    for (size_t i = mix(set, mask);; i = (i + 1) & mask) {
        refresh_set *e = &tab[i];
        if (!e->set1) {
            e->set1 = set + 1;
            e->min_seq = UINT64_MAX;
            return e;
        }
        if (e->set1 == set + 1)
            return e;
    }
}

Py_ssize_t nvt_touch_refresh(TableObject *self, PyObject *seq, Py_ssize_t m, PyObject *loaded) {
    PyObject *lists = nvt_seq_snapshot(loaded, "loaded must be a sequence of key sequences");
    if (!lists)
        return -1;
    Py_ssize_t n_lists = PySequence_Fast_GET_SIZE(lists);
    PyObject **jobs = n_lists ? PyMem_Calloc((size_t)n_lists, sizeof(PyObject *)) : NULL;
    Py_ssize_t n_loaded = 0, out = -1;
    const void **ptrs = NULL;
    loaded_key *contents = NULL;
    refresh_set *sets = NULL;
    uint64_t *fps = NULL;
    uint8_t *skip = NULL;
    PyObject *marked = NULL;
    if (n_lists && !jobs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < n_lists; j++) {
        jobs[j] = nvt_seq_snapshot(PySequence_Fast_GET_ITEM(lists, j), "loaded must be a sequence of key sequences");
        if (!jobs[j])
            goto done;
        n_loaded += PySequence_Fast_GET_SIZE(jobs[j]);
    }
    if (!n_loaded || !m) { /* nothing loaded: every key is marked */
        out = nvt_ready_keys(self, seq, m, NULL, NVT_READY_TOUCH);
        goto done;
    }
    size_t pcap = pow2_at_least(2 * (size_t)n_loaded), scap = pow2_at_least(2 * (size_t)m);
    ptrs = nvt_alloc_fails() ? NULL : PyMem_Calloc(pcap, sizeof(*ptrs));
    contents = nvt_alloc_fails() ? NULL : PyMem_Calloc(pcap, sizeof(*contents));
    sets = nvt_alloc_fails() ? NULL : PyMem_Calloc(scap, sizeof(*sets));
    fps = nvt_alloc_fails() ? NULL : PyMem_Malloc((size_t)m * sizeof(*fps));
    skip = nvt_alloc_fails() ? NULL : PyMem_Malloc((size_t)m);
    if (!ptrs || !contents || !sets || !fps || !skip) {
        PyErr_NoMemory();
        goto done;
    }
    /* The loads' marks, replayed: jobs in order, each last to first. A key
     * that several jobs (or one twice) loaded keeps its last mark, whichever
     * object carried it (the table marks the content). */
    uint64_t clock = 0;
    for (Py_ssize_t j = 0; j < n_lists; j++) {
        for (Py_ssize_t i = PySequence_Fast_GET_SIZE(jobs[j]) - 1; i >= 0; i--) {
            PyObject *key = PySequence_Fast_GET_ITEM(jobs[j], i);
            if (!PyBytes_Check(key))
                continue; /* no load took it (a load refuses it), and no key of `keys` is it */
            ptr_add(ptrs, pcap - 1, key);
            uint64_t fp = nvt_xxh3(PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key), 0);
            loaded_key *e = key_entry(contents, pcap - 1, key, fp);
            e->key = key; /* the snapshot `jobs[j]` holds it */
            e->fp = fp;
            e->seq = ++clock;
        }
    }
    /* Every key's set; the sets of the keys no load marked are marked in full. */
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "a key must be bytes, not %.100s", Py_TYPE(key)->tp_name);
            goto done;
        }
        fps[i] = nvt_xxh3(PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key), 0);
        skip[i] = (uint8_t)ptr_has(ptrs, pcap - 1, key);
        refresh_set *s = set_entry(sets, scap - 1, fps[i] % self->core.n_sets);
        if (!skip[i])
            s->full = 1;
    }
    /* The loads' order must be the refresh's: walked from its end (the most
     * recent it leaves), each key's last load mark older than the one after
     * it in its set. A set where it is not (several jobs: a later one took
     * chunks after an earlier one's head) is marked in full. A key met again
     * (`keys` lists it twice) counts at its last place, as a touch leaves it. */
    for (Py_ssize_t i = m - 1; i >= 0; i--) {
        if (!skip[i])
            continue;
        refresh_set *s = set_entry(sets, scap - 1, fps[i] % self->core.n_sets);
        if (s->full)
            continue;
        loaded_key *e = key_entry(contents, pcap - 1, PySequence_Fast_GET_ITEM(seq, i), fps[i]);
        if (e->seen)
            continue;
        e->seen = 1;
        if (e->seq >= s->min_seq)
            s->full = 1;
        else
            s->min_seq = e->seq;
    }
    Py_ssize_t n_mark = 0, n_skip = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (skip[i] && set_entry(sets, scap - 1, fps[i] % self->core.n_sets)->full)
            skip[i] = 0;
        n_skip += skip[i];
        n_mark += !skip[i];
    }
    if (!n_skip) {
        out = nvt_ready_keys(self, seq, m, NULL, NVT_READY_TOUCH);
        goto done;
    }
    marked = PyList_New(n_mark);
    if (!marked)
        goto done;
    for (Py_ssize_t i = 0, k = 0; i < m; i++)
        if (!skip[i])
            PyList_SET_ITEM(marked, k++, Py_NewRef(PySequence_Fast_GET_ITEM(seq, i)));
    out = n_mark ? nvt_ready_keys(self, marked, n_mark, NULL, NVT_READY_TOUCH) : 0;
    if (out >= 0)
        out += n_skip; /* marked by their load, for this request */
done:
    Py_XDECREF(marked);
    PyMem_Free(skip);
    PyMem_Free(fps);
    PyMem_Free(sets);
    PyMem_Free(contents);
    PyMem_Free(ptrs);
    if (jobs) {
        for (Py_ssize_t j = 0; j < n_lists; j++)
            Py_XDECREF(jobs[j]);
        PyMem_Free(jobs);
    }
    Py_DECREF(lists);
    return out;
}

/* Table.touch: see its doc. */
NVT_DOCSTR(nvt_touch_doc, "touch(keys, loaded=None) -> int\n\n"
                        "Mark READY keys most recently used, in order (within a set, the last key\n"
                        "touched is the most recent). Returns how many keys were READY and touched;\n"
                        "a key that is not READY (absent, being written, bad) is left alone.\n"
                        "loaded: the key lists of the request's load jobs, whose keys (the same\n"
                        "objects, by identity) their load marked already: those are left as\n"
                        "they are and counted, except in a set where a key of `keys` not loaded\n"
                        "is marked, or where the loads (jobs in order, each last to first) left\n"
                        "its keys in another order than `keys` (there every key is marked in\n"
                        "order, as without `loaded`).");

PyObject *nvt_Table_touch(TableObject *self, PyObject *const *args, Py_ssize_t nargs) {
    GUARD_ATTACHED(self);
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "touch(keys, loaded=None) takes 1 or 2 arguments");
        return NULL;
    }
    PyObject *seq = nvt_keys_arg(self, args[0]);
    if (!seq)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t touched = nargs == 2 && args[1] != Py_None ? nvt_touch_refresh(self, seq, m, args[1])
                                                          : nvt_ready_keys(self, seq, m, NULL, NVT_READY_TOUCH);
    Py_DECREF(seq);
    return touched < 0 ? NULL : PyLong_FromSsize_t(touched);
}
