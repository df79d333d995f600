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
 * full refresh would.
 *
 * Which chunks a load took is told by identity: `loaded` holds the request's
 * load jobs' key lists, whose key objects are the ones the request's context
 * records (vLLM passes the same objects along); a key that is only equal is
 * marked as before. The keys' sets come from their fingerprints alone (no
 * table memory is read to choose).
 *
 * Threads: the CPython type's (nvt_table.c), with the GIL held, on vLLM's
 * scheduler thread; a set wait inside the touch is bounded (nvt_core.c).
 */
#include "nvt_jobs.h"

#include <stdint.h>
#include <string.h>

#include "nvt_hash.h"

/* Open addressing over pointers (the loaded keys) or set numbers (the sets
 * to mark in full): capacity a power of two, at least twice the entries. */
static size_t pow2_at_least(size_t n) {
    size_t c = 64;
    while (c < n)
        c <<= 1;
    return c;
}

static inline size_t mix(uint64_t v, size_t mask) {
    return (size_t)((v * 0x9E3779B97F4A7C15ull) >> 17) & mask;
}

/* Add `p` (not NULL); 1 when it was not there. */
static int ptr_add(const void **tab, size_t mask, const void *p) {
    for (size_t i = mix((uint64_t)(uintptr_t)p, mask);; i = (i + 1) & mask) {
        if (tab[i] == p)
            return 0;
        if (!tab[i]) {
            tab[i] = p;
            return 1;
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

/* Sets are stored + 1 (0: empty). */
static void set_add(uint64_t *tab, size_t mask, uint64_t set) {
    for (size_t i = mix(set, mask);; i = (i + 1) & mask) {
        if (tab[i] == set + 1)
            return;
        if (!tab[i]) {
            tab[i] = set + 1;
            return;
        }
    }
}

static int set_has(const uint64_t *tab, size_t mask, uint64_t set) {
    for (size_t i = mix(set, mask);; i = (i + 1) & mask) {
        if (tab[i] == set + 1)
            return 1;
        if (!tab[i])
            return 0;
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
    uint64_t *fps = NULL, *sets = NULL;
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
    sets = nvt_alloc_fails() ? NULL : PyMem_Calloc(scap, sizeof(*sets));
    fps = nvt_alloc_fails() ? NULL : PyMem_Malloc((size_t)m * sizeof(*fps));
    skip = nvt_alloc_fails() ? NULL : PyMem_Malloc((size_t)m);
    if (!ptrs || !sets || !fps || !skip) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < n_lists; j++)
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(jobs[j]); i++)
            ptr_add(ptrs, pcap - 1, PySequence_Fast_GET_ITEM(jobs[j], i));
    /* Every key's set; the sets of the keys no load marked are marked in full. */
    Py_ssize_t n_skip = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "a key must be bytes, not %.100s", Py_TYPE(key)->tp_name);
            goto done;
        }
        fps[i] = nvt_xxh3(PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key), 0);
        skip[i] = (uint8_t)ptr_has(ptrs, pcap - 1, key);
        n_skip += skip[i];
        if (!skip[i])
            set_add(sets, scap - 1, fps[i] % self->core.n_sets);
    }
    Py_ssize_t n_mark = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (skip[i] && set_has(sets, scap - 1, fps[i] % self->core.n_sets)) {
            skip[i] = 0;
            n_skip--;
        }
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
    PyMem_Free(ptrs);
    if (jobs) {
        for (Py_ssize_t j = 0; j < n_lists; j++)
            Py_XDECREF(jobs[j]);
        PyMem_Free(jobs);
    }
    Py_DECREF(lists);
    return out;
}
