/*
 * nvt_hot_request: the type HotRequest of nvmetier._table, the promotion
 * guard's state of the request whose lookups are answered from its plan's
 * leased set (nvmetier.vllm.promotion: PromotionGuard._heat sets it, _cool
 * clears it), and the tier's answer to vLLM's lookup(key, req_context) for
 * that request's leased keys, in C.
 *
 * vLLM asks a secondary tier about each chunk of a request, one call per
 * key, on its scheduler thread. Once a request's plan has leased its HITs on
 * disk (one native call for the whole request), every further lookup of the
 * request in the step is one set removal and a list append; as a Python
 * method that is one frame per key, run cold between vLLM's own work. A
 * HotRequest is callable (vectorcall): NvmeTierManager sets it as its
 * instance's `lookup`, so vLLM's call of a leased key runs no Python code at
 * all; anything else (another request, a key not leased, no hot request) goes
 * to `fallback(key, req_context)`, the guard's Python path, unchanged.
 *
 * The attributes are the Python class's it replaces (plain members, read and
 * written by the guard as slots were): ctx, req_id, rnd, planned, leased,
 * n_leased, hits; plus fallback (the callable for everything but the fast
 * path), hit (what a HIT returns: vLLM's LookupResult.HIT) and miss (None:
 * the fallback's result is returned as it is; else the fallback answers a
 * truth value, returned as hit or miss).
 *
 * Threads: called with the GIL held, on vLLM's scheduler thread (under the
 * orchestrator's lock); nothing waits, nothing does I/O.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stddef.h>

#include "nvt_table_type.h"

typedef struct {
    PyObject_HEAD
    PyObject *ctx;      /* the hot request's ReqContext, or None */
    PyObject *req_id;   /* its req_id ("" when none) */
    PyObject *rnd;      /* its round (the guard's _Round), or None */
    PyObject *planned;  /* set: planned keys not leased (the disk is asked) */
    PyObject *leased;   /* set: leased keys not yet answered HIT */
    Py_ssize_t n_leased;
    PyObject *hits;     /* list: the keys answered HIT while hot, in order */
    PyObject *fallback; /* callable(key, ctx): every other lookup */
    PyObject *hit;      /* returned for a leased key */
    PyObject *miss;     /* None, or: the fallback answers a truth value, mapped to hit or miss */
    vectorcallfunc vectorcall;
} HotObject;

/* vLLM's lookup(key, req_context) of the hot request's leased key: remove it
 * from `leased` (one hash probe: the membership test and the removal), note it
 * in `hits`, answer `hit`. The identity test of the context is the Python
 * path's (`req_context is hot.ctx`). */
static PyObject *hot_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    HotObject *self = (HotObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    /* (A member deleted from Python is NULL: never the fast path, and never
     * dereferenced.) */
    if (nargs == 2 && kwnames == NULL && args[1] == self->ctx && self->ctx != Py_None && self->leased &&
        PySet_CheckExact(self->leased) && self->hits && PyList_CheckExact(self->hits) && self->hit) {
        /* Strong references for the call: a key's own __hash__ or __eq__
         * (Python code, for a key that is not bytes) may replace the members. */
        PyObject *leased = Py_NewRef(self->leased), *hits = Py_NewRef(self->hits);
        PyObject *out = NULL;
        int found = PySet_Discard(leased, args[0]);
        if (found > 0) {
            if (PyList_Append(hits, args[0]) == 0) {
                out = Py_NewRef(self->hit ? self->hit : Py_True);
            } else {
                /* Keep the key leased: the HIT was not answered. */
                PyObject *exc, *val, *tb;
                PyErr_Fetch(&exc, &val, &tb);
                (void)PySet_Add(leased, args[0]);
                PyErr_Restore(exc, val, tb);
            }
        }
        Py_DECREF(leased);
        Py_DECREF(hits);
        if (found != 0)
            return out; /* the HIT, or NULL with the exception */
    }
    if (!self->fallback || self->fallback == Py_None) {
        PyErr_SetString(PyExc_TypeError, "HotRequest: no fallback set for a lookup it does not answer");
        return NULL;
    }
    /* A strong reference for the call: the fallback may replace itself. */
    PyObject *fallback = Py_NewRef(self->fallback);
    PyObject *r = PyObject_Vectorcall(fallback, args, nargsf, kwnames);
    Py_DECREF(fallback);
    if (!r || !self->miss || self->miss == Py_None || !self->hit)
        return r;
    /* The guard's own answer (a bool): vLLM's HIT or MISS, with no Python
     * frame of the tier's between vLLM and the guard. Strong references to
     * both first: the result's truth (its __bool__) and its release (its
     * __del__) may run Python code that replaces or deletes them. */
    PyObject *hit = Py_NewRef(self->hit), *miss = Py_NewRef(self->miss);
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    PyObject *out = truth < 0 ? NULL : Py_NewRef(truth ? hit : miss);
    Py_DECREF(hit);
    Py_DECREF(miss);
    return out;
}

static PyObject *hot_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "HotRequest() takes no arguments");
        return NULL;
    }
    HotObject *self = (HotObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->vectorcall = hot_vectorcall;
    self->n_leased = 0;
    Py_INCREF(Py_None);
    self->ctx = Py_None;
    Py_INCREF(Py_None);
    self->rnd = Py_None;
    Py_INCREF(Py_None);
    self->fallback = Py_None;
    Py_INCREF(Py_True);
    self->hit = Py_True;
    Py_INCREF(Py_None);
    self->miss = Py_None;
    if (!(self->req_id = PyUnicode_FromString("")) || !(self->planned = PySet_New(NULL)) ||
        !(self->leased = PySet_New(NULL)) || !(self->hits = PyList_New(0))) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int hot_traverse(HotObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->ctx);
    Py_VISIT(self->req_id);
    Py_VISIT(self->rnd);
    Py_VISIT(self->planned);
    Py_VISIT(self->leased);
    Py_VISIT(self->hits);
    Py_VISIT(self->fallback);
    Py_VISIT(self->hit);
    Py_VISIT(self->miss);
    return 0;
}

static int hot_clear(HotObject *self) {
    Py_CLEAR(self->ctx);
    Py_CLEAR(self->req_id);
    Py_CLEAR(self->rnd);
    Py_CLEAR(self->planned);
    Py_CLEAR(self->leased);
    Py_CLEAR(self->hits);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->hit);
    Py_CLEAR(self->miss);
    return 0;
}

static void hot_dealloc(HotObject *self) {
    PyObject_GC_UnTrack(self);
    hot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* T_OBJECT: a member deleted or never set reads as None, as the guard's
 * resets expect; every one is always set (hot_new). */
static PyMemberDef hot_members[] = {
    {"ctx", T_OBJECT, offsetof(HotObject, ctx), 0, "the hot request's context, or None"},
    {"req_id", T_OBJECT, offsetof(HotObject, req_id), 0, "its req_id"},
    {"rnd", T_OBJECT, offsetof(HotObject, rnd), 0, "its round, or None"},
    {"planned", T_OBJECT, offsetof(HotObject, planned), 0, "planned keys not leased (the disk is asked)"},
    {"leased", T_OBJECT, offsetof(HotObject, leased), 0, "leased keys not yet answered HIT"},
    {"n_leased", T_PYSSIZET, offsetof(HotObject, n_leased), 0, "leased keys when heated"},
    {"hits", T_OBJECT, offsetof(HotObject, hits), 0, "keys answered HIT while hot, in order"},
    {"fallback", T_OBJECT, offsetof(HotObject, fallback), 0, "callable(key, ctx) for every other lookup"},
    {"hit", T_OBJECT, offsetof(HotObject, hit), 0, "what a leased key's lookup returns"},
    {"miss", T_OBJECT, offsetof(HotObject, miss), 0,
     "None (the fallback's result is returned as is), or what a false result of the fallback becomes "
     "(a true one becomes hit)"},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(hot_doc, "HotRequest()\n\n"
                      "The promotion guard's hot request (nvmetier.vllm.promotion), callable as\n"
                      "the tier's lookup(key, ctx): a key of `leased` asked with `ctx` leaves it,\n"
                      "joins `hits`, and is answered `hit`; any other call is `fallback(key, ctx)`\n"
                      "(mapped to `hit` or `miss` by its truth when `miss` is not None).");

static PyTypeObject HotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._table.HotRequest",
    .tp_basicsize = sizeof(HotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = hot_doc,
    .tp_new = hot_new,
    .tp_dealloc = (destructor)hot_dealloc,
    .tp_traverse = (traverseproc)hot_traverse,
    .tp_clear = (inquiry)hot_clear,
    .tp_members = hot_members,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HotObject, vectorcall),
};

int nvt_hot_request_idle(PyObject *hot) {
    if (!PyObject_TypeCheck(hot, &HotType))
        return -1;
    return ((HotObject *)hot)->ctx == Py_None;
}

int nvt_hot_request_add(PyObject *m) {
    if (PyType_Ready(&HotType) < 0)
        return -1;
    Py_INCREF(&HotType);
    if (PyModule_AddObject(m, "HotRequest", (PyObject *)&HotType) < 0) {
        Py_DECREF(&HotType);
        return -1;
    }
    return 0;
}
