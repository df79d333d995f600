/*
 * nvt_jobs: the job path's state (see nvt_jobs.h): the op and job slabs, the
 * failed keys of a job (nvt_job_fail: it never fails), the tuple snapshot of
 * a sequence argument, and the allocation-failure test hook that every
 * allocation of the job path asks. The submit side is nvt_job_submit.c, the
 * completion side nvt_job_complete.c. Called by the CPython type
 * (nvt_table.c) with the GIL held, on the scheduler thread.
 */
#include "nvt_jobs.h"

#include <stdint.h>
#include <string.h>

/* ------------------------------------------------- allocation-failure tests */
/* Tests only (the module's _fail_allocs): every allocation of the job path
 * first asks nvt_alloc_fails(); after `fail_after` more such points, the next
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

int nvt_alloc_fails(void) {
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

/* ------------------------------------------------------------------ slabs */
/* Double a slab of `size`-byte entries (first: `first` entries) and its free
 * list; new entries are zeroed (so free: in_use = 0, which a stale completion
 * id must find). Returns -1 when out of memory, the slab unchanged. */
static int slab_grow(void **items, size_t size, uint32_t **free_list, uint32_t *n_free, uint32_t *cap,
                     uint32_t first) {
    uint32_t old = *cap, grown = old ? old * 2 : first;
    if (nvt_alloc_fails())
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

/* One more block of the op slab (op_block_of): the capacity doubles, and
 * no entry moves. -1 when out of memory (or at 2^32 ops), nothing changed. */
static int op_slab_grow(TableObject *t) {
    uint32_t old = t->n_ops_cap, add = old ? old : NVT_OP_BLOCK0, first;
    if (old > UINT32_MAX - add || nvt_alloc_fails())
        return -1;
    unsigned b = op_block_of(old, &first);
    uint32_t *fr = PyMem_Realloc(t->op_free, (size_t)(old + add) * sizeof(uint32_t));
    if (!fr)
        return -1;
    t->op_free = fr;
    op_info *blk = PyMem_Calloc(add, sizeof(op_info)); /* zeroed: in_use = 0, which a stale id must find */
    if (!blk)
        return -1;
    t->op_blocks[b] = blk;
    for (uint32_t i = old + add; i > old; i--)
        fr[t->n_op_free++] = i - 1;
    __atomic_store_n(&t->n_ops_cap, old + add, __ATOMIC_RELEASE);
    return 0;
}

int64_t nvt_op_alloc(TableObject *t) {
    if (!t->n_op_free && op_slab_grow(t) < 0)
        return -1;
    uint32_t i = t->op_free[--t->n_op_free];
    op_info *o = op_at(t, i);
    o->in_use = 1;
    o->applied = NVT_APPLIED_NONE;
    return i;
}

int64_t nvt_job_alloc(TableObject *t, int64_t job_id, int is_load) {
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
    j->stored = NULL;
    j->ev_seq = 0;
    j->start_ns = 0;
    j->oom = 0;
    j->unreported = 0;
    t->jobs_live++;
    return i;
}

/* Key `pos` of job `j` failed for `kind`. Never fails: when the list of
 * failed positions cannot grow, the job is marked `oom` and reports every key
 * failed (successful_keys empty), so no failed key is ever reported stored or
 * loaded, and nothing on the completion path has to be undone. */
void nvt_job_fail(job_info *j, uint32_t pos, int kind, int err) {
    if (!j->in_use)
        return; /* the stand-in job of an abandoned op (nvt_apply_one) */
    if (j->n_failed == j->cap_failed) {
        uint32_t cap = j->cap_failed ? j->cap_failed * 2 : 8;
        uint32_t *f = nvt_alloc_fails() ? NULL : PyMem_Realloc(j->failed, cap * sizeof(uint32_t));
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
