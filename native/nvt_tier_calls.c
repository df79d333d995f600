/*
 * nvt_tier_calls: vLLM's per-step and per-request calls of a secondary tier
 * answered in C, with no Python frame of ours on vLLM's scheduler thread in
 * the usual case: the types FinishedJobs (get_finished_jobs), NewRequest
 * (on_new_request), ScheduleEnd (on_schedule_end) and SubmitStore
 * (submit_store) of nvmetier._table. NvmeTierManager sets one of each as its
 * instance's method (a subclass that overrides the method keeps it).
 *
 * FinishedJobs:
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
 * With `make` (vLLM's JobResult class), the result is a list and the usual
 * entry, a store job that succeeded with no error (the table's raw outcome
 * tuple: job_id, success, ok_keys, secs, moved, error, is_load), becomes
 * `make(job_id, True, ok_keys or None, secs, moved)` here, with no Python
 * frame; every other entry (a load, a failure, anything not such a tuple)
 * goes to `report([entry])`, whose results join the list in its place.
 *
 * NewRequest(track, answer): callable as on_new_request(req_context): calls
 * `track(req_context.req_id, req_context)` (the promotion guard's waiting
 * map's __setitem__) and returns `answer` (the tier's RequestOffloadingContext).
 *
 * ScheduleEnd(release, end_step): callable as on_schedule_end(context):
 * `release()` (the table's release_leases), then
 * `end_step(context.new_req_ids, context.preempted_req_ids)` (the guard's).
 *
 * SubmitStore(submit, refused, once=None): callable as
 * submit_store(job_metadata): `once()` first if set (cleared before it runs:
 * the tier's first-transfer check, which may replace `submit`), then
 * `err = submit(job.job_id, job.keys, job.chunk_ids)` (the table's native
 * submit_store), and `refused(job.job_id, err)` when err is not None (the
 * engine refused the ops: the job fails, logged). Returns None.
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
    PyObject *make;   /* None, or callable(job_id, success, ok_keys, secs, moved) */
    vectorcallfunc vectorcall;
} FinishedObject;

/* Whether `raw` is a plain successful store's outcome: a 7-tuple whose
 * success is True, error None and is_load False. */
static int plain_store(PyObject *raw) {
    return PyTuple_CheckExact(raw) && PyTuple_GET_SIZE(raw) == 7 && PyTuple_GET_ITEM(raw, 1) == Py_True &&
           PyTuple_GET_ITEM(raw, 5) == Py_None && PyTuple_GET_ITEM(raw, 6) == Py_False;
}

/* The answer with `make`: see the file's comment. */
static PyObject *finished_made(FinishedObject *self, PyObject *done) {
    PyObject *seq = PySequence_Fast(done, "poll() must return a sequence");
    if (!seq)
        return NULL;
    PyObject *out = PyList_New(0);
    PyObject *make = Py_NewRef(self->make), *report = Py_NewRef(self->report);
    /* When poll() returned a list, `seq` is that list: make, report or an
     * ok_keys' __bool__ may change it while this runs (Python code). Its
     * size is read again at each entry, and the entry held while in use. */
    for (Py_ssize_t i = 0; out && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *raw = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        if (plain_store(raw)) {
            PyObject *ok_keys = PyTuple_GET_ITEM(raw, 2);
            int truth = ok_keys == Py_None ? 0 : PyObject_IsTrue(ok_keys);
            PyObject *args[5] = {PyTuple_GET_ITEM(raw, 0), Py_True, truth > 0 ? ok_keys : Py_None,
                                 PyTuple_GET_ITEM(raw, 3), PyTuple_GET_ITEM(raw, 4)};
            PyObject *r = truth < 0 ? NULL : PyObject_Vectorcall(make, args, 5, NULL);
            Py_DECREF(raw);
            if (!r || PyList_Append(out, r) < 0)
                Py_CLEAR(out);
            Py_XDECREF(r);
            continue;
        }
        PyObject *one = PyList_New(1);
        if (!one) {
            Py_DECREF(raw);
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(one, 0, raw); /* the list takes the entry's reference */
        PyObject *r = PyObject_CallOneArg(report, one);
        Py_DECREF(one);
        PyObject *rs = r ? PySequence_Fast(r, "report() must return a sequence") : NULL;
        Py_XDECREF(r);
        if (!rs) {
            Py_CLEAR(out);
            break;
        }
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(rs); k++) {
            if (PyList_Append(out, PySequence_Fast_GET_ITEM(rs, k)) < 0) {
                Py_CLEAR(out);
                break;
            }
        }
        Py_DECREF(rs);
    }
    Py_DECREF(make);
    Py_DECREF(report);
    Py_DECREF(seq);
    return out;
}

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
    if (self->make && self->make != Py_None) {
        PyObject *out = finished_made(self, done);
        Py_DECREF(done);
        return out;
    }
    PyObject *report = Py_NewRef(self->report);
    PyObject *out = PyObject_CallOneArg(report, done);
    Py_DECREF(report);
    Py_DECREF(done);
    return out;
}

static PyObject *finished_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"poll", "report", "empty", "make", NULL};
    PyObject *poll, *report, *empty = NULL, *make = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OO:FinishedJobs", kwlist, &poll, &report, &empty, &make))
        return NULL;
    if (!PyCallable_Check(poll) || !PyCallable_Check(report) || (make != Py_None && !PyCallable_Check(make))) {
        PyErr_SetString(PyExc_TypeError, "FinishedJobs: poll, report and make (or None) must be callable");
        return NULL;
    }
    FinishedObject *self = (FinishedObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->vectorcall = finished_vectorcall;
    self->poll = Py_NewRef(poll);
    self->report = Py_NewRef(report);
    self->make = Py_NewRef(make);
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
    Py_VISIT(self->make);
    return 0;
}

static int finished_clear(FinishedObject *self) {
    Py_CLEAR(self->poll);
    Py_CLEAR(self->report);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->make);
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
    {"make", T_OBJECT, offsetof(FinishedObject, make), 0,
     "None, or callable(job_id, success, ok_keys, secs, moved): a plain store's result, made here"},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(finished_doc, "FinishedJobs(poll, report, empty=(), make=None)\n\n"
                           "Callable with no arguments, as a tier's get_finished_jobs(): calls\n"
                           "poll(); returns `empty` when it found nothing, else report(found).\n"
                           "With make: a list, each successful store's raw outcome (job_id, True,\n"
                           "ok_keys, secs, moved, None, False) as make(job_id, True, ok_keys or\n"
                           "None, secs, moved), every other entry as the items of report([entry]).");

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

/* ------------------------------------------------------------ NewRequest */

/* "req_id", interned once (nvt_tier_calls_add): no string made per call. */
static PyObject *str_req_id;

typedef struct {
    PyObject_HEAD
    PyObject *track;  /* callable(req_id, req_context) */
    PyObject *answer; /* what the call returns */
    vectorcallfunc vectorcall;
} NewRequestObject;

/* The one argument of a call, positional or by `name`; NULL with TypeError. */
static PyObject *one_arg(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *name,
                         const char *what) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs == 1 && !nkw)
        return args[0];
    if (nargs == 0 && nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), name) == 0)
        return args[0];
    PyErr_Format(PyExc_TypeError, "%s() takes one argument, %s", what, name);
    return NULL;
}

static PyObject *new_request_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    NewRequestObject *self = (NewRequestObject *)callable;
    PyObject *ctx = one_arg(args, nargsf, kwnames, "req_context", "on_new_request");
    if (!ctx)
        return NULL;
    if (!self->track || !self->answer) {
        PyErr_SetString(PyExc_TypeError, "NewRequest: track and answer must be set");
        return NULL;
    }
    PyObject *req_id = PyObject_GetAttr(ctx, str_req_id);
    if (!req_id)
        return NULL;
    PyObject *track = Py_NewRef(self->track);
    PyObject *targs[2] = {req_id, ctx};
    PyObject *r = PyObject_Vectorcall(track, targs, 2, NULL);
    Py_DECREF(track);
    Py_DECREF(req_id);
    if (!r)
        return NULL;
    Py_DECREF(r);
    if (!self->answer) { /* track() deleted it */
        PyErr_SetString(PyExc_TypeError, "NewRequest: track and answer must be set");
        return NULL;
    }
    return Py_NewRef(self->answer);
}

static PyObject *new_request_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"track", "answer", NULL};
    PyObject *track, *answer;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:NewRequest", kwlist, &track, &answer))
        return NULL;
    if (!PyCallable_Check(track)) {
        PyErr_SetString(PyExc_TypeError, "NewRequest: track must be callable");
        return NULL;
    }
    NewRequestObject *self = (NewRequestObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->vectorcall = new_request_vectorcall;
    self->track = Py_NewRef(track);
    self->answer = Py_NewRef(answer);
    return (PyObject *)self;
}

static int new_request_traverse(NewRequestObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->track);
    Py_VISIT(self->answer);
    return 0;
}

static int new_request_clear(NewRequestObject *self) {
    Py_CLEAR(self->track);
    Py_CLEAR(self->answer);
    return 0;
}

static void new_request_dealloc(NewRequestObject *self) {
    PyObject_GC_UnTrack(self);
    new_request_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef new_request_members[] = {
    {"track", T_OBJECT_EX, offsetof(NewRequestObject, track), 0, "callable(req_id, req_context)"},
    {"answer", T_OBJECT_EX, offsetof(NewRequestObject, answer), 0, "what a call returns"},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(new_request_doc, "NewRequest(track, answer)\n\n"
                              "Callable as a tier's on_new_request(req_context): calls\n"
                              "track(req_context.req_id, req_context), returns `answer`.");

static PyTypeObject NewRequestType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._table.NewRequest",
    .tp_basicsize = sizeof(NewRequestObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = new_request_doc,
    .tp_new = new_request_new,
    .tp_dealloc = (destructor)new_request_dealloc,
    .tp_traverse = (traverseproc)new_request_traverse,
    .tp_clear = (inquiry)new_request_clear,
    .tp_members = new_request_members,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(NewRequestObject, vectorcall),
};

/* ------------------------------------------ ScheduleEnd and SubmitStore */

/* Attribute names read per call, interned once (nvt_tier_calls_add). */
static PyObject *str_new_req_ids, *str_preempted_req_ids, *str_job_id, *str_keys, *str_chunk_ids;

/* Both types hold two callables, `first` and `second`; SubmitStore also
 * `once` (None, or a callable run before the next call's submit). */
typedef struct {
    PyObject_HEAD
    PyObject *first;
    PyObject *second;
    PyObject *once;
    vectorcallfunc vectorcall;
} PairObject;

static int pair_members_set(PairObject *self, const char *type) {
    if (self->first && self->second)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: both callables must be set", type);
    return -1;
}

static PyObject *schedule_end_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                         PyObject *kwnames) {
    PairObject *self = (PairObject *)callable;
    PyObject *ctx = one_arg(args, nargsf, kwnames, "context", "on_schedule_end");
    if (!ctx || pair_members_set(self, "ScheduleEnd") < 0)
        return NULL;
    PyObject *release = Py_NewRef(self->first), *end_step = Py_NewRef(self->second);
    PyObject *r = PyObject_CallNoArgs(release);
    PyObject *out = NULL;
    if (r) {
        Py_DECREF(r);
        PyObject *fresh = PyObject_GetAttr(ctx, str_new_req_ids);
        PyObject *preempted = fresh ? PyObject_GetAttr(ctx, str_preempted_req_ids) : NULL;
        if (preempted) {
            PyObject *eargs[2] = {fresh, preempted};
            out = PyObject_Vectorcall(end_step, eargs, 2, NULL);
        }
        Py_XDECREF(fresh);
        Py_XDECREF(preempted);
    }
    Py_DECREF(release);
    Py_DECREF(end_step);
    if (!out)
        return NULL;
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyObject *submit_store_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                         PyObject *kwnames) {
    PairObject *self = (PairObject *)callable;
    PyObject *job = one_arg(args, nargsf, kwnames, "job_metadata", "submit_store");
    if (!job)
        return NULL;
    if (self->once && self->once != Py_None) {
        PyObject *once = self->once;
        self->once = Py_NewRef(Py_None); /* cleared before it runs: once */
        PyObject *r = PyObject_CallNoArgs(once);
        Py_DECREF(once);
        if (!r)
            return NULL;
        Py_DECREF(r);
    }
    if (pair_members_set(self, "SubmitStore") < 0)
        return NULL;
    PyObject *sargs[3] = {NULL, NULL, NULL};
    PyObject *out = NULL;
    if ((sargs[0] = PyObject_GetAttr(job, str_job_id)) && (sargs[1] = PyObject_GetAttr(job, str_keys)) &&
        (sargs[2] = PyObject_GetAttr(job, str_chunk_ids))) {
        PyObject *submit = Py_NewRef(self->first), *refused = Py_NewRef(self->second);
        PyObject *err = PyObject_Vectorcall(submit, sargs, 3, NULL);
        if (err == Py_None) {
            out = Py_NewRef(Py_None);
        } else if (err) {
            PyObject *rargs[2] = {sargs[0], err};
            PyObject *r = PyObject_Vectorcall(refused, rargs, 2, NULL);
            if (r) {
                Py_DECREF(r);
                out = Py_NewRef(Py_None);
            }
        }
        Py_XDECREF(err);
        Py_DECREF(submit);
        Py_DECREF(refused);
    }
    for (int i = 0; i < 3; i++)
        Py_XDECREF(sargs[i]);
    return out;
}

static PyObject *pair_new(PyTypeObject *type, PyObject *args, PyObject *kwds, const char *format, char **kwlist,
                          vectorcallfunc call) {
    PyObject *first, *second, *once = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, format, kwlist, &first, &second, &once))
        return NULL;
    if (!PyCallable_Check(first) || !PyCallable_Check(second) || (once != Py_None && !PyCallable_Check(once))) {
        PyErr_Format(PyExc_TypeError, "%s and %s must be callable", kwlist[0], kwlist[1]);
        return NULL;
    }
    PairObject *self = (PairObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->vectorcall = call;
    self->first = Py_NewRef(first);
    self->second = Py_NewRef(second);
    self->once = Py_NewRef(once);
    return (PyObject *)self;
}

static PyObject *schedule_end_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"release", "end_step", NULL};
    return pair_new(type, args, kwds, "OO:ScheduleEnd", kwlist, schedule_end_vectorcall);
}

static PyObject *submit_store_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"submit", "refused", "once", NULL};
    return pair_new(type, args, kwds, "OO|O:SubmitStore", kwlist, submit_store_vectorcall);
}

static int pair_traverse(PairObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->first);
    Py_VISIT(self->second);
    Py_VISIT(self->once);
    return 0;
}

static int pair_clear(PairObject *self) {
    Py_CLEAR(self->first);
    Py_CLEAR(self->second);
    Py_CLEAR(self->once);
    return 0;
}

static void pair_dealloc(PairObject *self) {
    PyObject_GC_UnTrack(self);
    pair_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef schedule_end_members[] = {
    {"release", T_OBJECT_EX, offsetof(PairObject, first), 0, "callable(): the step's leases released"},
    {"end_step", T_OBJECT_EX, offsetof(PairObject, second), 0, "callable(new_req_ids, preempted_req_ids)"},
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef submit_store_members[] = {
    {"submit", T_OBJECT_EX, offsetof(PairObject, first), 0, "callable(job_id, keys, chunk_ids) -> error or None"},
    {"refused", T_OBJECT_EX, offsetof(PairObject, second), 0, "callable(job_id, error): the ops refused"},
    {"once", T_OBJECT, offsetof(PairObject, once), 0, "None, or callable(): run (and cleared) before the next submit"},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(schedule_end_doc, "ScheduleEnd(release, end_step)\n\n"
                               "Callable as a tier's on_schedule_end(context): release(), then\n"
                               "end_step(context.new_req_ids, context.preempted_req_ids).");

PyDoc_STRVAR(submit_store_doc, "SubmitStore(submit, refused, once=None)\n\n"
                               "Callable as a tier's submit_store(job_metadata): once() first when\n"
                               "set (cleared before it runs), then err =\n"
                               "submit(job.job_id, job.keys, job.chunk_ids); refused(job.job_id, err)\n"
                               "when err is not None. Returns None.");

static PyTypeObject ScheduleEndType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._table.ScheduleEnd",
    .tp_basicsize = sizeof(PairObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = schedule_end_doc,
    .tp_new = schedule_end_new,
    .tp_dealloc = (destructor)pair_dealloc,
    .tp_traverse = (traverseproc)pair_traverse,
    .tp_clear = (inquiry)pair_clear,
    .tp_members = schedule_end_members,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(PairObject, vectorcall),
};

static PyTypeObject SubmitStoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._table.SubmitStore",
    .tp_basicsize = sizeof(PairObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = submit_store_doc,
    .tp_new = submit_store_new,
    .tp_dealloc = (destructor)pair_dealloc,
    .tp_traverse = (traverseproc)pair_traverse,
    .tp_clear = (inquiry)pair_clear,
    .tp_members = submit_store_members,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(PairObject, vectorcall),
};

/* ------------------------------------------------------------ the module */

int nvt_tier_calls_add(PyObject *m) {
    struct {
        PyObject **slot;
        const char *text;
    } names_in[] = {{&str_req_id, "req_id"},       {&str_new_req_ids, "new_req_ids"},
                    {&str_preempted_req_ids, "preempted_req_ids"}, {&str_job_id, "job_id"},
                    {&str_keys, "keys"},           {&str_chunk_ids, "chunk_ids"}};
    for (size_t i = 0; i < sizeof(names_in) / sizeof(names_in[0]); i++)
        if (!*names_in[i].slot && !(*names_in[i].slot = PyUnicode_InternFromString(names_in[i].text)))
            return -1;
    PyTypeObject *types[] = {&FinishedType, &NewRequestType, &ScheduleEndType, &SubmitStoreType};
    const char *names[] = {"FinishedJobs", "NewRequest", "ScheduleEnd", "SubmitStore"};
    for (int i = 0; i < 4; i++) {
        if (PyType_Ready(types[i]) < 0)
            return -1;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            return -1;
        }
    }
    return 0;
}
