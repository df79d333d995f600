/*
 * nvt_table_type: internal to the CPython type `Table` of nvmetier._table,
 * whose code is three units: nvt_table.c (the type: its life, its data path,
 * its method table and the module's init), nvt_table_admin.c (its methods off
 * the data path) and nvt_table_module.c (the module's functions, no Table).
 * What one unit defines and another names is declared here. Every method and
 * function runs with the GIL held on the caller's thread (see nvt_table.c).
 */
#ifndef NVT_TABLE_TYPE_H
#define NVT_TABLE_TYPE_H

#include "nvt_jobs.h"

/* A docstring defined beside its method, in its own unit, and named by the
 * type's method table in nvt_table.c: PyDoc_STRVAR, but not static. */
#define NVT_DOCSTR(name, str) const char name[] = PyDoc_STR(str)

/* ------------------------------------------------------------ nvt_table.c */
/* Forks of this process so far, counted in the child (pthread_atfork). */
extern unsigned nvt_forks;
/* Each sets the RuntimeError of a refused call and returns NULL. */
PyObject *nvt_table_forked(void);
PyObject *nvt_table_busy(void);
PyObject *nvt_table_detached(void);
int nvt_append_record_key(PyObject **list, const unsigned char *rec);

/* First in every method: refuse a Table used from a second thread during a
 * set wait, or inherited through fork(); GUARD_ATTACHED also one not attached
 * (the data path; see nvt_table_detached). */
#define GUARD(self)                                                                                            \
    do {                                                                                                       \
        if ((self)->core.waiting)                                                                              \
            return nvt_table_busy();                                                                           \
        if ((self)->fork_gen != nvt_forks)                                                                     \
            return nvt_table_forked();                                                                         \
    } while (0)

#define GUARD_ATTACHED(self)                                                                                   \
    do {                                                                                                       \
        GUARD(self);                                                                                           \
        if ((self)->core.me < 0)                                                                               \
            return nvt_table_detached();                                                                       \
    } while (0)

/* ------------------------------------------------------ nvt_hot_request.c */
/* Adds the type HotRequest to the module (its init). */
int nvt_hot_request_add(PyObject *m);
/* Whether `hot` (a HotRequest) holds no request (its ctx is None): 1, 0, or
 * -1 (no exception set) when `hot` is not a HotRequest. */
int nvt_hot_request_idle(PyObject *hot);

/* ------------------------------------------------------ nvt_guard_calls.c */
/* Adds the type GuardCall to the module (its init). */
int nvt_guard_calls_add(PyObject *m);

/* ------------------------------------------------------- nvt_tier_calls.c */
/* Adds the types FinishedJobs, NewRequest, ScheduleEnd and SubmitStore to
 * the module (its init). */
int nvt_tier_calls_add(PyObject *m);

/* ------------------------------------------------------ nvt_table_admin.c */
PyObject *nvt_Table_set_retention(TableObject *self, PyObject *arg);
PyObject *nvt_Table_purge(TableObject *self, PyObject *args);
PyObject *nvt_Table_purge_generation(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_bump_purge(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_keys_generation(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_bump_keys(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_claim_purge_events(TableObject *self, PyObject *args);
PyObject *nvt_Table_inflight(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_sweep(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_load(TableObject *self, PyObject *args);
PyObject *nvt_Table_counters(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_usage(TableObject *self, PyObject *Py_UNUSED(ignored));
PyObject *nvt_Table_hold_set(TableObject *self, PyObject *arg);
PyObject *nvt_Table_release_set(TableObject *self, PyObject *arg);
PyObject *nvt_Table_touch(TableObject *self, PyObject *const *args, Py_ssize_t nargs); /* nvt_refresh.c */
extern const char nvt_set_retention_doc[];
extern const char nvt_purge_doc[];
extern const char nvt_purge_generation_doc[];
extern const char nvt_bump_purge_doc[];
extern const char nvt_keys_generation_doc[];
extern const char nvt_bump_keys_doc[];
extern const char nvt_claim_purge_events_doc[];
extern const char nvt_inflight_doc[];
extern const char nvt_sweep_doc[];
extern const char nvt_load_doc[];
extern const char nvt_counters_doc[];
extern const char nvt_usage_doc[];
extern const char nvt_hold_set_doc[];
extern const char nvt_release_set_doc[];
extern const char nvt_touch_doc[];

/* ----------------------------------------------------- nvt_table_module.c */
extern struct PyModuleDef nvt_table_module;

#endif /* NVT_TABLE_TYPE_H */
