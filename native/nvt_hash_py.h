/*
 * nvt_hash_py: the Python face of nvt_hash, added to both nvmetier._table and
 * nvmetier._uring (each module links its own copy of nvt_hash, so each has
 * its own profiling counters): xxh3, xxh3_copy and copy on buffers (the GIL
 * released from 64 KiB up), the implementation's name, and the profiling
 * switch and counters.
 */
#ifndef NVT_HASH_PY_H
#define NVT_HASH_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add the functions to module `m`; 0 on success, -1 with an exception set. */
int nvt_hash_py_add(PyObject *m);

#endif /* NVT_HASH_PY_H */
