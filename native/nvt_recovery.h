/*
 * nvt_recovery: the batch index-record scan behind nvmetier/recovery.py.
 *
 * Module-level functions of nvmetier._uring (registered in nvt_module.c).
 * They read the caller's index buffer, never modify it, and keep no state.
 * scan_records releases the GIL for its loop; record_keys holds it (it
 * creates the bytes objects). Any Python thread may call them.
 */
#ifndef NVT_RECOVERY_H
#define NVT_RECOVERY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern const char nvt_scan_records_doc[];
extern const char nvt_record_keys_doc[];

PyObject *nvt_py_scan_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *nvt_py_record_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif /* NVT_RECOVERY_H */
