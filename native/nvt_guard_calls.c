/*
 * nvt_guard_calls: the type GuardCall of nvmetier._table, the promotion
 * guard's end of step and request finish (nvmetier.vllm.promotion:
 * PromotionGuard.end_step and finish) answered in C while the guard has no
 * round, and its own Python method called otherwise.
 *
 * vLLM ends a scheduler step, and finishes a request, far more often than a
 * request promotes anything: a server storing its prefills, or loading
 * between its promotions, runs each step with no round of the guard open
 * (no request planned a promotion or holds a pin). Then the guard's
 * end_step only takes the step's scheduled requests out of its waiting map
 * and counts the step, and finish only takes the request out of it: as
 * Python methods, one frame (and a few more inside) per step and per
 * request, run cold between vLLM's own work.
 *
 * GuardCall(kind, guard, slow, waiting, rounds, protect_spent, pending,
 * unloaded, hot), kind "end_step" or "finish", is callable as the method
 * `slow` is (the guard's bound end_step(new_req_ids=(),
 * preempted_req_ids=()) or finish(req_id)). The containers are the guard's
 * own objects (never replaced: the guard clears them in place): `waiting`
 * and `rounds` (dicts), `protect_spent` (a set), `pending` (a list),
 * `unloaded` (a dict), and `hot` (its HotRequest). A call takes the fast
 * path only when, at the call, `rounds`, `protect_spent` (and for end_step
 * `pending`, `unloaded` and the preempted ids) are empty and `hot` holds no
 * request; it then does what the Python method does in that state:
 *   end_step: guard._quiet = False; guard._step += 1; each scheduled id
 *     taken out of `waiting` (absent ids ignored);
 *   finish: guard._quiet = False; req_id taken out of `waiting`.
 * Before either, an end of step that schedules and preempts nothing while
 * the guard is quiet, with the CPU tier's generation unchanged, only counts
 * the step, as the method's first lines do (quiet_step), rounds open or not.
 * (What an id's __hash__/__eq__ or a context's finalizer fills during the
 * pops is then handled as the method does: finish_rest, end_step's tail.)
 * (The Python end_step in that state ends by recording its quiet state, an
 * optimisation of its next call only; clearing it instead makes that call
 * take its full path, which finds the same.) Every other call is
 * `slow(...)` with the same arguments.
 *
 * Threads: called with the GIL held, on vLLM's scheduler thread (under the
 * orchestrator's lock); nothing waits, nothing does I/O.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stddef.h>
#include <string.h>

#include "nvt_table_type.h"

enum { GUARD_END_STEP = 0, GUARD_FINISH = 1 };

typedef struct {
    PyObject_HEAD
    int kind;
    PyObject *guard;         /* the PromotionGuard (its _step and _quiet are set) */
    PyObject *slow;          /* its bound method, for every other call */
    PyObject *waiting;       /* dict: req_id -> context */
    PyObject *rounds;        /* dict: req_id -> round */
    PyObject *protect_spent; /* set */
    PyObject *pending;       /* list */
    PyObject *unloaded;      /* dict */
    PyObject *hot;           /* HotRequest */
    vectorcallfunc vectorcall;
} GuardCallObject;

static PyObject *str_step, *str_quiet, *str_generation, *str_quiet_generation, *one;

/* Whether the guard has nothing but its waiting map in use (see above). The
 * types were checked when the object was made. */
static int guard_idle(GuardCallObject *self) {
    if (PyDict_GET_SIZE(self->rounds) || PySet_GET_SIZE(self->protect_spent) || !nvt_hot_request_idle(self->hot))
        return 0;
    return self->kind == GUARD_FINISH || (PyList_GET_SIZE(self->pending) == 0 && PyDict_GET_SIZE(self->unloaded) == 0);
}

/* d.pop(k, None), a new reference (NULL with an exception set). */
static PyObject *dict_pop_or_none(PyObject *d, PyObject *k) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *v;
    int r = PyDict_Pop(d, k, &v);
    return r < 0 ? NULL : r ? v : Py_NewRef(Py_None);
#else
    return _PyDict_Pop(d, k, Py_None);
#endif
}

/* waiting.pop(req_id, None). 0, or -1 with an exception set. */
static int waiting_pop(PyObject *waiting, PyObject *req_id) {
    /* Not PyDict_DelItem less its KeyError: a KeyError the id's own __hash__
     * or __eq__ raises propagates from dict.pop, as it must from here. */
    PyObject *gone = dict_pop_or_none(waiting, req_id);
    if (!gone)
        return -1;
    Py_DECREF(gone); /* the context (its finalizer runs here, as after pop) */
    return 0;
}

/* `guard._step += 1`. 0, or -1 with an exception set. */
static int add_step(GuardCallObject *self) {
    PyObject *now = PyObject_GetAttr(self->guard, str_step);
    if (!now)
        return -1;
    PyObject *next = PyNumber_InPlaceAdd(now, one);
    Py_DECREF(now);
    if (!next)
        return -1;
    int r = PyObject_SetAttr(self->guard, str_step, next);
    Py_DECREF(next);
    return r;
}

/* guard._quiet = False, then (with `step`) guard._step += 1. 0, or -1 with
 * an exception set. */
static int count_step(GuardCallObject *self, int step) {
    if (PyObject_SetAttr(self->guard, str_quiet, Py_False) < 0)
        return -1;
    return step ? add_step(self) : 0;
}

/* obj.name(arg) (or obj.name()), its result dropped. 0, or -1 with an
 * exception set. */
static int tail_call(PyObject *obj, const char *name, PyObject *arg) {
    PyObject *r = arg ? PyObject_CallMethod(obj, name, "O", arg) : PyObject_CallMethod(obj, name, NULL);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *end_step_fast(GuardCallObject *self, PyObject *fresh) {
    if (count_step(self, 1) < 0)
        return NULL;
    if (!fresh)
        Py_RETURN_NONE;
    PyObject *it = PyObject_GetIter(fresh);
    if (!it)
        return NULL;
    PyObject *req_id;
    while ((req_id = PyIter_Next(it))) {
        int r = waiting_pop(self->waiting, req_id);
        Py_DECREF(req_id);
        if (r < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    /* An id's __hash__/__eq__ or a context's finalizer may have filled what
     * the method tests after its pops: do what it then does. */
    if (PySet_GET_SIZE(self->protect_spent) && tail_call(self->protect_spent, "difference_update", fresh) < 0)
        return NULL;
    if (PyList_GET_SIZE(self->pending) && tail_call(self->guard, "_note_pending", NULL) < 0)
        return NULL;
    if (PyDict_GET_SIZE(self->unloaded) && tail_call(self->guard, "_count_unloaded", NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* finish after its pop: what the method does when protect_spent or rounds
 * were filled meanwhile (by the id's __hash__/__eq__ or the context's
 * finalizer): discard the id, and release its round. */
static PyObject *finish_rest(GuardCallObject *self, PyObject *req_id) {
    if (PySet_GET_SIZE(self->protect_spent) && PySet_Discard(self->protect_spent, req_id) < 0)
        return NULL;
    if (PyDict_GET_SIZE(self->rounds)) {
        PyObject *rnd = dict_pop_or_none(self->rounds, req_id);
        if (!rnd)
            return NULL;
        int r = rnd == Py_None ? 0 : tail_call(self->guard, "_release", rnd);
        Py_DECREF(rnd);
        if (r < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* Whether `ids` is absent or a built-in collection (what vLLM passes: a
 * list, a set or ()), whose truth and iteration run no Python code and match
 * the method's `if ids:` then walk: anything else (None, a falsy
 * non-iterable, a __bool__ that raises or mutates) goes to the method. */
static int plain_ids(PyObject *ids) {
    return !ids || PyList_CheckExact(ids) || PyTuple_CheckExact(ids) || PySet_CheckExact(ids) ||
           PyFrozenSet_CheckExact(ids);
}

/* The method's first lines, for an end of step with both id collections
 * plain (plain_ids): one that schedules and preempts nothing, after an end
 * of step that found the guard quiet (`guard._quiet`), with the CPU tier's
 * generation unchanged since (`guard._generation()`, a C callable the guard
 * keeps beside its view, or None without a view, against
 * `guard._quiet_generation`), only counts the step, whatever rounds are
 * open. 1 when so answered, 0 when not, -1 with an exception set. */
static int quiet_step(GuardCallObject *self, PyObject *fresh, PyObject *preempted) {
    if ((fresh && PyObject_Length(fresh) != 0) || (preempted && PyObject_Length(preempted) != 0))
        return 0;
    PyObject *quiet = PyObject_GetAttr(self->guard, str_quiet);
    if (!quiet)
        return -1;
    int is_quiet = PyObject_IsTrue(quiet);
    Py_DECREF(quiet);
    if (is_quiet <= 0)
        return is_quiet;
    PyObject *generation = PyObject_GetAttr(self->guard, str_generation);
    if (!generation)
        return -1;
    int same = 1;
    if (generation != Py_None) {
        PyObject *now = PyObject_CallNoArgs(generation);
        PyObject *then = now ? PyObject_GetAttr(self->guard, str_quiet_generation) : NULL;
        same = then ? PyObject_RichCompareBool(now, then, Py_EQ) : -1;
        Py_XDECREF(now);
        Py_XDECREF(then);
    }
    Py_DECREF(generation);
    if (same <= 0)
        return same;
    return add_step(self) < 0 ? -1 : 1; /* the step alone: the guard stays quiet */
}

/* The call's arguments by position or by the method's names: `names` lists
 * them, `out` gets each (NULL when not given). -1 with TypeError when a name
 * is not the method's, repeated, or more are given. */
static int call_args(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *const *names, int n,
                     PyObject **out) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    for (int i = 0; i < n; i++)
        out[i] = i < nargs ? args[i] : NULL;
    if (nargs > n)
        return -1;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        int found = -1;
        for (int i = 0; i < n && found < 0; i++)
            if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), names[i]) == 0)
                found = i;
        if (found < 0 || out[found])
            return -1;
        out[found] = args[nargs + k];
    }
    return 0;
}

static PyObject *guard_call_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                       PyObject *kwnames) {
    GuardCallObject *self = (GuardCallObject *)callable;
    static const char *const end_names[] = {"new_req_ids", "preempted_req_ids"};
    static const char *const finish_names[] = {"req_id"};
    PyObject *given[2] = {NULL, NULL};
    int fast = 0;
    if (self->kind == GUARD_END_STEP) {
        if (call_args(args, nargsf, kwnames, end_names, 2, given) == 0 && plain_ids(given[0]) &&
            plain_ids(given[1])) {
            int quiet = quiet_step(self, given[0], given[1]);
            if (quiet)
                return quiet < 0 ? NULL : Py_NewRef(Py_None);
            fast = guard_idle(self) && (!given[1] || PyObject_Length(given[1]) == 0);
        }
    } else if (call_args(args, nargsf, kwnames, finish_names, 1, given) == 0 && given[0] && guard_idle(self)) {
        fast = 1;
    }
    if (!fast) /* the guard's own method (it raises on bad arguments) */
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    if (self->kind == GUARD_END_STEP)
        return end_step_fast(self, given[0]);
    if (count_step(self, 0) < 0 || waiting_pop(self->waiting, given[0]) < 0)
        return NULL;
    return finish_rest(self, given[0]);
}

static PyObject *guard_call_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"kind", "guard", "slow", "waiting", "rounds", "protect_spent", "pending",
                             "unloaded", "hot", NULL};
    const char *kind;
    PyObject *guard, *slow, *waiting, *rounds, *spent, *pending, *unloaded, *hot;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOOO!O!O!O!O!O:GuardCall", kwlist, &kind, &guard, &slow,
                                     &PyDict_Type, &waiting, &PyDict_Type, &rounds, &PySet_Type, &spent,
                                     &PyList_Type, &pending, &PyDict_Type, &unloaded, &hot))
        return NULL;
    int k = strcmp(kind, "end_step") == 0 ? GUARD_END_STEP : strcmp(kind, "finish") == 0 ? GUARD_FINISH : -1;
    if (k < 0) {
        PyErr_Format(PyExc_ValueError, "GuardCall: kind must be 'end_step' or 'finish', not '%s'", kind);
        return NULL;
    }
    if (!PyCallable_Check(slow) || nvt_hot_request_idle(hot) < 0)
        return PyErr_Format(PyExc_TypeError, "GuardCall: slow must be callable and hot a HotRequest");
    GuardCallObject *self = (GuardCallObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->kind = k;
    self->guard = Py_NewRef(guard);
    self->slow = Py_NewRef(slow);
    self->waiting = Py_NewRef(waiting);
    self->rounds = Py_NewRef(rounds);
    self->protect_spent = Py_NewRef(spent);
    self->pending = Py_NewRef(pending);
    self->unloaded = Py_NewRef(unloaded);
    self->hot = Py_NewRef(hot);
    self->vectorcall = guard_call_vectorcall;
    return (PyObject *)self;
}

static int guard_call_traverse(GuardCallObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->guard);
    Py_VISIT(self->slow);
    Py_VISIT(self->waiting);
    Py_VISIT(self->rounds);
    Py_VISIT(self->protect_spent);
    Py_VISIT(self->pending);
    Py_VISIT(self->unloaded);
    Py_VISIT(self->hot);
    return 0;
}

static int guard_call_clear(GuardCallObject *self) {
    Py_CLEAR(self->guard);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->waiting);
    Py_CLEAR(self->rounds);
    Py_CLEAR(self->protect_spent);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->unloaded);
    Py_CLEAR(self->hot);
    return 0;
}

static void guard_call_dealloc(GuardCallObject *self) {
    PyObject_GC_UnTrack(self);
    guard_call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(guard_call_doc, "GuardCall(kind, guard, slow, waiting, rounds, protect_spent, pending, unloaded, hot)\n\n"
                             "The promotion guard's end_step (kind 'end_step') or finish (kind 'finish')\n"
                             "in C while the guard has no round; `slow(...)` otherwise (native/nvt_guard_calls.c).");

static PyTypeObject GuardCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._table.GuardCall",
    .tp_basicsize = sizeof(GuardCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = guard_call_doc,
    .tp_new = guard_call_new,
    .tp_dealloc = (destructor)guard_call_dealloc,
    .tp_traverse = (traverseproc)guard_call_traverse,
    .tp_clear = (inquiry)guard_call_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(GuardCallObject, vectorcall),
};

int nvt_guard_calls_add(PyObject *m) {
    if ((!str_step && !(str_step = PyUnicode_InternFromString("_step"))) ||
        (!str_quiet && !(str_quiet = PyUnicode_InternFromString("_quiet"))) ||
        (!str_generation && !(str_generation = PyUnicode_InternFromString("_generation"))) ||
        (!str_quiet_generation && !(str_quiet_generation = PyUnicode_InternFromString("_quiet_generation"))) || (!one && !(one = PyLong_FromLong(1))))
        return -1;
    if (PyType_Ready(&GuardCallType) < 0)
        return -1;
    Py_INCREF(&GuardCallType);
    if (PyModule_AddObject(m, "GuardCall", (PyObject *)&GuardCallType) < 0) {
        Py_DECREF(&GuardCallType);
        return -1;
    }
    return 0;
}
