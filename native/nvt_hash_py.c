/*
 * The hash functions of nvmetier._table and nvmetier._uring (see
 * nvt_hash_py.h). Called by any Python thread: the thread engine's workers
 * hash and copy here with the GIL released; never blocks otherwise.
 */
#include "nvt_hash_py.h"

#include "nvt_hash.h"

#include <stdint.h>
#include <string.h>

/* From here up the GIL is released: another thread may run while we hash. */
#define NVT_PY_NOGIL_BYTES (64u << 10)

PyDoc_STRVAR(xxh3_doc, "xxh3(data, seed=0) -> int\n\n"
                       "XXH3-64 of a buffer with a seed (the checksum of every op), at the\n"
                       "widest vector unit the CPU has; the GIL is released for large buffers.");

static PyObject *py_xxh3(PyObject *m, PyObject *args) {
    Py_buffer v;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "y*|K", &v, &seed))
        return NULL;
    uint64_t sum;
    if ((size_t)v.len >= NVT_PY_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS sum = nvt_xxh3(v.buf, (size_t)v.len, seed);
        Py_END_ALLOW_THREADS
    } else {
        sum = nvt_xxh3(v.buf, (size_t)v.len, seed);
    }
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(sum);
}

/* dst and src (and the seed, where `seed` is not NULL: copy takes none). */
static int two_buffers(PyObject *args, Py_buffer *dst, Py_buffer *src, unsigned long long *seed) {
    if (seed ? !PyArg_ParseTuple(args, "w*y*|K:xxh3_copy", dst, src, seed)
             : !PyArg_ParseTuple(args, "w*y*:copy", dst, src))
        return -1;
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into a buffer of %zd bytes: give two buffers of one size",
                     src->len, dst->len);
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    /* memcpy on overlapping ranges is undefined: it has left dst unlike src
     * (and the fused hash that of neither) on every build here. */
    uintptr_t d = (uintptr_t)dst->buf, s = (uintptr_t)src->buf;
    if (src->len > 0 && d < s + (uintptr_t)src->len && s < d + (uintptr_t)dst->len) {
        PyErr_Format(PyExc_ValueError,
                     "copy of %zd bytes between overlapping buffers (dst starts %zd bytes %s src): "
                     "give two separate buffers",
                     src->len, (Py_ssize_t)(d >= s ? d - s : s - d), d >= s ? "after" : "before");
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(xxh3_copy_doc, "xxh3_copy(dst, src, seed=0) -> int\n\n"
                            "Copy src into dst (same size, not overlapping: ValueError if they do) and\n"
                            "return XXH3-64(seed) of the bytes copied, in one pass; the GIL is released\n"
                            "for large buffers.");

static PyObject *py_xxh3_copy(PyObject *m, PyObject *args) {
    Py_buffer dst, src;
    unsigned long long seed = 0;
    if (two_buffers(args, &dst, &src, &seed) < 0)
        return NULL;
    uint64_t sum;
    if ((size_t)src.len >= NVT_PY_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS sum = nvt_xxh3_copy(dst.buf, src.buf, (size_t)src.len, seed);
        Py_END_ALLOW_THREADS
    } else {
        sum = nvt_xxh3_copy(dst.buf, src.buf, (size_t)src.len, seed);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(sum);
}

PyDoc_STRVAR(copy_doc, "copy(dst, src)\n\n"
                       "Copy src into dst (same size, not overlapping: ValueError if they do),\n"
                       "counted as a staging copy while profiling; the GIL is released for large\n"
                       "buffers.");

static PyObject *py_copy(PyObject *m, PyObject *args) {
    Py_buffer dst, src;
    if (two_buffers(args, &dst, &src, NULL) < 0)
        return NULL;
    if ((size_t)src.len >= NVT_PY_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS nvt_copy(dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    } else {
        nvt_copy(dst.buf, src.buf, (size_t)src.len);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(xxh3_impl_doc, "xxh3_impl() -> str\n\nThe XXH3 build in use: 'avx512', 'avx2' or 'baseline'.");

static PyObject *py_xxh3_impl(PyObject *m, PyObject *noargs) { return PyUnicode_FromString(nvt_xxh3_impl()); }

PyDoc_STRVAR(xxh3_force_doc, "_xxh3_force(impl)\n\n"
                             "Tests and benchmarks only: use 'avx512', 'avx2' or 'baseline' from now on\n"
                             "in this module. ValueError if this CPU or build lacks it.");

static PyObject *py_xxh3_force(PyObject *m, PyObject *arg) {
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "_xxh3_force takes the build's name ('avx512', 'avx2' or 'baseline'), not %s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t n;
    const char *impl = PyUnicode_AsUTF8AndSize(arg, &n);
    if (!impl)
        return NULL;
    /* "avx2\0..." would otherwise pass as "avx2". */
    if ((size_t)n != strlen(impl) || nvt_xxh3_force(impl) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "XXH3 build %R is not available here (this CPU/build has up to %s); use 'avx512', "
                     "'avx2' or 'baseline' within that",
                     arg, nvt_xxh3_impl());
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hash_profile_doc, "hash_profile(on)\n\n"
                               "Count the CPU time (of the calling threads) and bytes of every hash, fused\n"
                               "copy+hash and staging copy from now on (on=True zeroes the counters), or\n"
                               "stop counting (on=False). Process-wide for this module's native code.");

static PyObject *py_hash_profile(PyObject *m, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    nvt_hash_profile(on);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hash_profile_read_doc,
             "hash_profile_read() -> dict\n\n"
             "The profiling counters: hash_ns, hash_bytes, copy_hash_ns, copy_hash_bytes,\n"
             "copy_ns, copy_bytes (thread CPU ns and bytes since hash_profile(True)).");

static PyObject *py_hash_profile_read(PyObject *m, PyObject *noargs) {
    nvt_hash_profile_t p;
    nvt_hash_profile_read(&p);
    return Py_BuildValue("{sKsKsKsKsKsK}", "hash_ns", (unsigned long long)p.hash_ns, "hash_bytes",
                         (unsigned long long)p.hash_bytes, "copy_hash_ns", (unsigned long long)p.copy_hash_ns,
                         "copy_hash_bytes", (unsigned long long)p.copy_hash_bytes, "copy_ns",
                         (unsigned long long)p.copy_ns, "copy_bytes", (unsigned long long)p.copy_bytes);
}

static PyMethodDef nvt_hash_py_methods[] = {
    {"xxh3", py_xxh3, METH_VARARGS, xxh3_doc},
    {"xxh3_copy", py_xxh3_copy, METH_VARARGS, xxh3_copy_doc},
    {"copy", py_copy, METH_VARARGS, copy_doc},
    {"xxh3_impl", py_xxh3_impl, METH_NOARGS, xxh3_impl_doc},
    {"_xxh3_force", py_xxh3_force, METH_O, xxh3_force_doc},
    {"hash_profile", py_hash_profile, METH_O, hash_profile_doc},
    {"hash_profile_read", py_hash_profile_read, METH_NOARGS, hash_profile_read_doc},
    {NULL, NULL, 0, NULL},
};

int nvt_hash_py_add(PyObject *m) { return PyModule_AddFunctions(m, nvt_hash_py_methods); }
