/*
 * nvt_table_module: the functions of the module nvmetier._table that take no
 * Table (the type is nvt_table.c, which also runs the module's init): the
 * table file's size, format, header and live sharers, the tests' hooks
 * (clock offsets, the dying wait, allocation failures), and chunk_run (the
 * promotion plan's layout of a request, on vLLM's scheduler thread). Called with the GIL
 * held, by whichever thread opens, checks or inspects a store; none waits.
 */
#include "nvt_table_type.h"

#include <limits.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ module */
PyDoc_STRVAR(table_bytes_doc, "table_bytes(n_slots, ways) -> int\n\nSize of the table file.");

static PyObject *py_table_bytes(PyObject *m, PyObject *args) {
    unsigned long long n_slots;
    unsigned int ways;
    if (!PyArg_ParseTuple(args, "KI", &n_slots, &ways))
        return NULL;
    const char *why = nvt_bad_geometry(n_slots, ways);
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(nvt_table_bytes(n_slots, ways));
}

PyDoc_STRVAR(format_doc,
             "format(table, n_slots, ways)\n\n"
             "Zero the table, write its header and initialize every set's mutex (the\n"
             "first process to attach, before load()). Only while no other process is\n"
             "attached.");

static PyObject *py_format(PyObject *m, PyObject *args) {
    Py_buffer v;
    unsigned long long n_slots;
    unsigned int ways;
    if (!PyArg_ParseTuple(args, "w*KI", &v, &n_slots, &ways))
        return NULL;
    const char *why = nvt_format(v.buf, (uint64_t)v.len, n_slots, ways);
    PyBuffer_Release(&v);
    if (why) {
        PyErr_SetString(strncmp(why, "pthread", 7) ? PyExc_ValueError : PyExc_OSError, why);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(header_doc, "header(table) -> dict\n\nThe table header (for open checks, info, fsck).");

static PyObject *py_header(PyObject *m, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    if (v.len < NVT_TABLE_HEADER_BYTES) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "table shorter than its header");
        return NULL;
    }
    nvt_table_header h;
    memcpy(&h, v.buf, sizeof(h));
    const char *why = nvt_bad_header(&h, (uint64_t)v.len);
    PyBuffer_Release(&v);
    return Py_BuildValue("{sKsIsKsIsLsLsOszsIsIsI}", "magic", (unsigned long long)h.magic, "version", h.version,
                         "n_slots", (unsigned long long)h.n_slots, "ways", h.ways, "used", (long long)h.used,
                         "ready", (long long)h.ready, "valid", why ? Py_False : Py_True, "problem", why,
                         "retention_s", h.retention_s, "purge_gen", h.purge_gen, "purge_events_gen",
                         h.purge_events_gen);
}

PyDoc_STRVAR(sharers_doc, "sharers(table, lock_fd) -> list[(index, pid, attached_ns)]\n\n"
                          "Registry entries whose OFD lock is held by a live process (another\n"
                          "open file description than lock_fd's).");

static PyObject *py_sharers(PyObject *m, PyObject *args) {
    Py_buffer v;
    int fd;
    if (!PyArg_ParseTuple(args, "y*i", &v, &fd))
        return NULL;
    if (v.len < NVT_TABLE_HEADER_BYTES) {
        PyBuffer_Release(&v);
        return PyList_New(0);
    }
    PyObject *out = PyList_New(0);
    const nvt_sharer *sh = (const nvt_sharer *)((const char *)v.buf + NVT_SHARERS_OFFSET);
    for (int i = 0; out && i < NVT_MAX_SHARERS; i++) {
        if (!sh[i].pid)
            continue; /* never used, or detached */
        if (!nvt_sharer_live(fd, i))
            continue;
        PyObject *t = Py_BuildValue("(iIK)", i, sh[i].pid, (unsigned long long)sh[i].attached_ns);
        if (!t || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    PyBuffer_Release(&v);
    return out;
}

PyDoc_STRVAR(set_clock_offset_doc, "_set_clock_offset_ns(ns)\n\n"
                                    "Tests only: add ns to this process's table clock (leases, claim\n"
                                    "stamps, watch deadlines), so a lease or a watch runs out without\n"
                                    "waiting, or the clock stands days after boot.");

static PyObject *py_set_clock_offset(PyObject *m, PyObject *arg) {
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred())
        return NULL;
    nvt_set_clock_offset_ns(ns);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_dying_wait_doc, "_set_dying_wait_ms(ms) -> int\n\n"
                                 "Tests only: how long a locker that saw a sharer die waits for its lock\n"
                                 "file to close (DYING_WAIT_MS by default). Returns the previous value.");

static PyObject *py_set_dying_wait(PyObject *m, PyObject *arg) {
    unsigned long ms = PyLong_AsUnsignedLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (ms > 600000UL) {
        PyErr_SetString(PyExc_ValueError, "the dying wait is at most 600000 ms (a wait must stay bounded)");
        return NULL;
    }
    return PyLong_FromUnsignedLong(nvt_set_dying_wait_ms((uint32_t)ms));
}

PyDoc_STRVAR(fail_allocs_doc,
             "_fail_allocs(after, count) -> int\n\n"
             "Tests only: after `after` more allocation points of the job path (slabs, lists,\n"
             "reports, deferrals), the next `count` fail as out of memory (count 0: none).\n"
             "Returns the points passed since the previous call.");

static PyObject *py_fail_allocs(PyObject *m, PyObject *args) {
    long long after, count;
    if (!PyArg_ParseTuple(args, "LL", &after, &count))
        return NULL;
    return PyLong_FromUnsignedLongLong(nvt_test_fail_allocs(after, count));
}

PyDoc_STRVAR(set_wall_offset_doc, "_set_wall_clock_offset_ns(ns)\n\n"
                                   "Tests only: add ns to this process's wall clock for record stamps and\n"
                                   "retention (a chunk ages without waiting, or the clock steps back).");

static PyObject *py_set_wall_offset(PyObject *m, PyObject *arg) {
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred())
        return NULL;
    nvt_set_wall_offset_ns(ns);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(chunk_run_doc,
             "chunk_run(positions, suffix, tokens_per_chunk) -> list | None\n\n"
             "The keys of `positions` (a dict: key -> end token), in its order, when every\n"
             "key is bytes ending with `suffix` and the i-th value is the int\n"
             "(i + 1) * tokens_per_chunk (one KV group recorded chunk after chunk from the\n"
             "first); else None (the caller's general path decides). The promotion\n"
             "guard's plan lays a request out with it, on vLLM's scheduler thread.");

/* One pass over the dict's entries, no object made but the list: the
 * promotion plan's layout of a one-group request (nvmetier.vllm.
 * promotion_plan._layout_one_group), which in Python sliced every key. */
static PyObject *py_chunk_run(PyObject *m, PyObject *args) {
    PyObject *positions;
    const char *suffix;
    Py_ssize_t suffix_len;
    long long tpc;
    if (!PyArg_ParseTuple(args, "O!y#L", &PyDict_Type, &positions, &suffix, &suffix_len, &tpc))
        return NULL;
    Py_ssize_t n = PyDict_GET_SIZE(positions);
    if (tpc <= 0 || n > LLONG_MAX / tpc)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(positions, &pos, &key, &value)) {
        if (i >= n || !PyBytes_Check(key) || !PyLong_CheckExact(value))
            goto no_run;
        Py_ssize_t len = PyBytes_GET_SIZE(key);
        if (len < suffix_len || memcmp(PyBytes_AS_STRING(key) + len - suffix_len, suffix, (size_t)suffix_len))
            goto no_run;
        int overflow = 0;
        long long end = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow || end != (long long)(i + 1) * tpc)
            goto no_run;
        Py_INCREF(key);
        PyList_SET_ITEM(out, i, key);
        i++;
    }
    if (i == n)
        return out;
no_run:
    Py_DECREF(out); /* unset items are NULL, which list dealloc skips */
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"chunk_run", py_chunk_run, METH_VARARGS, chunk_run_doc},
    {"_set_clock_offset_ns", py_set_clock_offset, METH_O, set_clock_offset_doc},
    {"_fail_allocs", py_fail_allocs, METH_VARARGS, fail_allocs_doc},
    {"_set_wall_clock_offset_ns", py_set_wall_offset, METH_O, set_wall_offset_doc},
    {"_set_dying_wait_ms", py_set_dying_wait, METH_O, set_dying_wait_doc},
    {"table_bytes", py_table_bytes, METH_VARARGS, table_bytes_doc},
    {"format", py_format, METH_VARARGS, format_doc},
    {"header", py_header, METH_O, header_doc},
    {"sharers", py_sharers, METH_VARARGS, sharers_doc},
    {NULL, NULL, 0, NULL},
};

struct PyModuleDef nvt_table_module = {
    PyModuleDef_HEAD_INIT, "nvmetier._table",
    "The process-shared slot table of an nvmetier store (see nvt_layout.h).", -1, module_methods,
};
