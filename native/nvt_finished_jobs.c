/*
 * nvt_finished_jobs: the type FinishedJobs of nvmetier._table, the tier's
 * answer to vLLM's get_finished_jobs() with no Python frame when no job
 * finished.
 *
 * vLLM calls get_finished_jobs() on every tier at every scheduler step, and
 * most steps no job of ours finished (ops in flight, or none). As a Python
 * method that is one frame per step run cold between vLLM's own work, around
 * the table's poll. A FinishedJobs(poll, report, empty) is callable with no
 * arguments: it calls `poll()` (the table's poll, or a sealed store's); an
 * empty result returns `empty` (vLLM's "nothing finished"), anything else
 * returns `report(result)` (the tier's Python code that logs failures,
 * tells the promotion guard and builds vLLM's JobResults). NvmeTierManager
 * sets one as its instance's get_finished_jobs.
 *
 * Threads: called with the GIL held, on vLLM's scheduler thread (under the
 * orchestrator's lock); nothing waits, nothing does I/O beyond poll's own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stddef.h>

#include "nvt_table_type.h"

typedef struct {
    PyObject_HEAD
    PyObject *poll;   /* callable(): the finished jobs, a sized sequence */
    PyObject *report; /* callable(done): what a non-empty poll returns */
    PyObject *empty;  /* returned when nothing finished */
    vectorcallfunc vectorcall;
} FinishedObject;

static PyObject *finished_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    FinishedObject *self = (FinishedObject *)callable;
    if (PyVectorcall_NARGS(nargsf) || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "get_finished_jobs() takes no arguments");
        return NULL;
    }
    if (!self->poll || !self->report || !self->empty) {
        PyErr_SetString(PyExc_TypeError, "FinishedJobs: poll, report and empty must be set");
        return NULL;
    }
    /* Strong references for the calls: either may replace the members. */
    PyObject *poll = Py_NewRef(self->poll);
    PyObject *done = PyObject_CallNoArgs(poll);
    Py_DECREF(poll);
    if (!done)
        return NULL;
    Py_ssize_t n = (PyTuple_CheckExact(done) || PyList_CheckExact(done)) ? Py_SIZE(done) : PyObject_Length(done);
    if (n < 0) {
        Py_DECREF(done);
        return NULL;
    }
    /* poll() may have deleted a member (T_OBJECT_EX: NULL now). */
    if (!(n == 0 ? self->empty : self->report)) {
        Py_DECREF(done);
        PyErr_SetString(PyExc_TypeError, "FinishedJobs: poll, report and empty must be set");
        return NULL;
    }
    if (n == 0) {
        Py_DECREF(done);
        return Py_NewRef(self->empty);
    }
    PyObject *report = Py_NewRef(self->report);
    PyObject *out = PyObject_CallOneArg(report, done);
    Py_DECREF(report);
    Py_DECREF(done);
    return out;
}

static PyObject *finished_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"poll", "report", "empty", NULL};
    PyObject *poll, *report, *empty = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O:FinishedJobs", kwlist, &poll, &report, &empty))
        return NULL;
    if (!PyCallable_Check(poll) || !PyCallable_Check(report)) {
        PyErr_SetString(PyExc_TypeError, "FinishedJobs: poll and report must be callable");
        return NULL;
    }
    FinishedObject *self = (FinishedObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->vectorcall = finished_vectorcall;
    self->poll = Py_NewRef(poll);
    self->report = Py_NewRef(report);
    self->empty = empty ? Py_NewRef(empty) : PyTuple_New(0);
    if (!self->empty) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int finished_traverse(FinishedObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->poll);
    Py_VISIT(self->report);
    Py_VISIT(self->empty);
    return 0;
}

static int finished_clear(FinishedObject *self) {
    Py_CLEAR(self->poll);
    Py_CLEAR(self->report);
    Py_CLEAR(self->empty);
    return 0;
}

static void finished_dealloc(FinishedObject *self) {
    PyObject_GC_UnTrack(self);
    finished_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* T_OBJECT_EX: a deleted member raises AttributeError when read, and a call
 * with one missing raises TypeError (never a NULL dereference). */
static PyMemberDef finished_members[] = {
    {"poll", T_OBJECT_EX, offsetof(FinishedObject, poll), 0, "callable(): the finished jobs"},
    {"report", T_OBJECT_EX, offsetof(FinishedObject, report), 0,
     "callable(done): the answer when some job finished"},
    {"empty", T_OBJECT_EX, offsetof(FinishedObject, empty), 0, "the answer when none did"},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(finished_doc, "FinishedJobs(poll, report, empty=())\n\n"
                           "Callable with no arguments, as a tier's get_finished_jobs(): calls\n"
                           "poll(); returns `empty` when it found nothing, else report(found).");

static PyTypeObject FinishedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._table.FinishedJobs",
    .tp_basicsize = sizeof(FinishedObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = finished_doc,
    .tp_new = finished_new,
    .tp_dealloc = (destructor)finished_dealloc,
    .tp_traverse = (traverseproc)finished_traverse,
    .tp_clear = (inquiry)finished_clear,
    .tp_members = finished_members,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FinishedObject, vectorcall),
};

int nvt_finished_jobs_add(PyObject *m) {
    if (PyType_Ready(&FinishedType) < 0)
        return -1;
    Py_INCREF(&FinishedType);
    if (PyModule_AddObject(m, "FinishedJobs", (PyObject *)&FinishedType) < 0) {
        Py_DECREF(&FinishedType);
        return -1;
    }
    return 0;
}
