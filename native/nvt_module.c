/*
 * nvmetier._uring: the CPython binding of nvt_engine (io_uring I/O engine).
 *
 * Owns the conversion between Python objects and nvt_op / nvt_completion, and
 * the reference to the caller's buffer (held from construction to close()).
 * The engine's I/O thread never touches Python objects: an op_id is passed
 * through as a strong reference that submit() takes and wait() hands to the
 * returned tuple.
 *
 * Threads: any Python thread may call submit(), wait() and close(). The GIL
 * is released while the constructor sets up the rings, while wait() blocks
 * and while close() joins the I/O threads; submit() holds it (it only takes a
 * mutex that the I/O thread holds for a few instructions).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "nvt_hash_py.h"

#include <errno.h>
#include <string.h>

#include "nvt_engine.h"
#include "nvt_seal.h"
#include "nvt_hash.h"
#include "nvt_recovery.h" /* scan_records, record_keys (index recovery) */

/* wait() blocks in slices this long so Ctrl-C reaches the main thread. */
#define NVT_WAIT_SLICE_S 0.1
#define NVT_STACK_OPS 64

typedef struct {
    PyObject_HEAD
    nvt_engine *eng;
    Py_buffer view;
    int have_view;
    nvt_config cfg;
    nvt_completion_batch spare; /* reused by wait(); guarded by the GIL */
    int spare_busy;
    int mode; /* 0: no op yet, 1: object ops (submit/wait), 2: raw ops (submit_raw/wait_raw) */
} NvtEngineObject;

/* An engine carries either op objects (op_id = a strong reference) or raw
 * ops (op_id = the caller's integer); mixing them would decref integers. */
static int nvt_use_mode(NvtEngineObject *self, int mode) {
    if (self->mode && self->mode != mode) {
        PyErr_SetString(PyExc_ValueError, mode == 2 ? "raw ops on an engine that carries op objects"
                                                    : "op objects on an engine that carries raw ops");
        return -1;
    }
    self->mode = mode;
    return 0;
}

/* Interned attribute names of base.Op; set at module init. */
static PyObject *nvt_str_op_id, *nvt_str_kind, *nvt_str_file_idx, *nvt_str_file_offset,
    *nvt_str_buf_offset, *nvt_str_length, *nvt_str_seed, *nvt_str_checksum;

static PyObject *nvt_getattr_or_item(PyObject *obj, int is_tuple, Py_ssize_t i, PyObject *name) {
    if (is_tuple) {
        PyObject *v = PyTuple_GET_ITEM(obj, i);
        Py_INCREF(v);
        return v;
    }
    return PyObject_GetAttr(obj, name);
}

static int nvt_get_i64(PyObject *obj, int is_tuple, Py_ssize_t i, PyObject *name, int64_t *out) {
    PyObject *v = nvt_getattr_or_item(obj, is_tuple, i, name);
    if (!v)
        return -1;
    long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)x;
    return 0;
}

/* Fill `op` from a base.Op (a tuple subclass, read by position), a 7- or
 * 8-tuple in Op's field order, or any object with Op's attributes. On success
 * the op owns a new reference to op_id. */
static int nvt_parse_op(PyObject *obj, nvt_op *op) {
    int is_tuple = PyTuple_Check(obj);
    Py_ssize_t fields = is_tuple ? PyTuple_GET_SIZE(obj) : 8;
    int64_t kind;
    if (fields != 7 && fields != 8) {
        PyErr_SetString(PyExc_TypeError, "an op tuple must have 7 or 8 fields (op_id, kind, file_idx, "
                                         "file_offset, buf_offset, length, seed[, checksum])");
        return -1;
    }
    if (nvt_get_i64(obj, is_tuple, 1, nvt_str_kind, &kind) || nvt_get_i64(obj, is_tuple, 2, nvt_str_file_idx, &op->file_idx) ||
        nvt_get_i64(obj, is_tuple, 3, nvt_str_file_offset, &op->file_offset) ||
        nvt_get_i64(obj, is_tuple, 4, nvt_str_buf_offset, &op->buf_offset) ||
        nvt_get_i64(obj, is_tuple, 5, nvt_str_length, &op->length))
        return -1;
    op->kind = (kind == NVT_OP_READ || kind == NVT_OP_WRITE) ? (int)kind : -1;
    PyObject *seed = nvt_getattr_or_item(obj, is_tuple, 6, nvt_str_seed);
    if (!seed)
        return -1;
    op->seed = PyLong_AsUnsignedLongLong(seed);
    Py_DECREF(seed);
    if (op->seed == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    op->checksum = 1;
    if (fields == 8) {
        PyObject *flag = nvt_getattr_or_item(obj, is_tuple, 7, nvt_str_checksum);
        if (!flag) {
            if (is_tuple || !PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear(); /* an object without the attribute: checksummed */
        } else {
            op->checksum = PyObject_IsTrue(flag);
            Py_DECREF(flag);
            if (op->checksum < 0)
                return -1;
        }
    }
    op->op_id = nvt_getattr_or_item(obj, is_tuple, 0, nvt_str_op_id);
    return op->op_id ? 0 : -1;
}

static void nvt_drop_completions(nvt_completion_batch *b) {
    for (size_t i = 0; i < b->len; i++)
        Py_DECREF((PyObject *)b->items[i].op_id);
    b->len = 0;
}

static PyObject *NvtEngine_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer", "fds", "queue_depth", "max_inflight_bytes", "register_buffers",
                             "fixed_files", "register_chunk_bytes", "workers", "keepalive_fd", "staging_bytes",
                             "sealing", NULL};
    PyObject *buffer, *fds_obj, *sealing = Py_None;
    nvt_seal_config seal;
    int queue_depth = 64, register_buffers = 1, fixed_files = 1, workers = 1, keepalive_fd = -1;
    long long max_inflight_bytes = 64LL << 20, chunk_bytes = (long long)NVT_MAX_REGISTER_CHUNK_BYTES;
    long long staging_bytes = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|$iLppLiiLO", kwlist, &buffer, &fds_obj, &queue_depth,
                                     &max_inflight_bytes, &register_buffers, &fixed_files, &chunk_bytes,
                                     &workers, &keepalive_fd, &staging_bytes, &sealing))
        return NULL;
    if (staging_bytes < 0 || staging_bytes > (1LL << 40)) {
        PyErr_Format(PyExc_ValueError, "staging_bytes must be in 0..1 TiB, got %lld", staging_bytes);
        return NULL;
    }
    if (sealing != Py_None) {
        /* (keys capsule, row_bytes, slot_bytes): nvmetier._crypto.Keys.capsule() */
        PyObject *cap;
        unsigned long long row, slot;
        if (!PyArg_ParseTuple(sealing, "OKK;sealing is (keys capsule, row_bytes, slot_bytes)", &cap, &row, &slot))
            return NULL;
        seal.keys = PyCapsule_GetPointer(cap, "nvmetier._crypto.keys");
        if (!seal.keys)
            return NULL;
        if (row == 0 || slot < row + NVT_TRAILER_BYTES) {
            PyErr_SetString(PyExc_ValueError, "sealing: slot_bytes >= row_bytes + 64");
            return NULL;
        }
        seal.row_bytes = row;
        seal.slot_bytes = slot;
    }
    if (workers < 1 || workers > NVT_MAX_WORKERS) {
        PyErr_Format(PyExc_ValueError, "workers must be in 1..%d, got %d", NVT_MAX_WORKERS, workers);
        return NULL;
    }
    if (queue_depth < 1 || queue_depth > 32767) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be in 1..32767, got %d", queue_depth);
        return NULL;
    }
    if (max_inflight_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "max_inflight_bytes must be >= 1, got %lld", max_inflight_bytes);
        return NULL;
    }
    if (chunk_bytes < 4096 || chunk_bytes > (long long)NVT_MAX_REGISTER_CHUNK_BYTES || chunk_bytes % 4096) {
        PyErr_Format(PyExc_ValueError,
                     "register_chunk_bytes must be a multiple of 4096 in 4096..%llu, got %lld",
                     (unsigned long long)NVT_MAX_REGISTER_CHUNK_BYTES, chunk_bytes);
        return NULL;
    }

    PyObject *fds_seq = PySequence_Fast(fds_obj, "fds must be a sequence of file descriptors");
    if (!fds_seq)
        return NULL;
    Py_ssize_t nfds = PySequence_Fast_GET_SIZE(fds_seq);
    int *fds = PyMem_Malloc((nfds ? nfds : 1) * sizeof(int));
    if (!fds) {
        Py_DECREF(fds_seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nfds; i++) {
        fds[i] = PyObject_AsFileDescriptor(PySequence_Fast_GET_ITEM(fds_seq, i));
        if (fds[i] < 0) {
            PyMem_Free(fds);
            Py_DECREF(fds_seq);
            return NULL;
        }
    }
    Py_DECREF(fds_seq);

    NvtEngineObject *self = (NvtEngineObject *)type->tp_alloc(type, 0);
    if (!self) {
        PyMem_Free(fds);
        return NULL;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0) {
        PyMem_Free(fds);
        Py_DECREF(self);
        return NULL;
    }
    self->have_view = 1;
    self->cfg.queue_depth = (unsigned)queue_depth;
    self->cfg.max_inflight_bytes = (uint64_t)max_inflight_bytes;
    self->cfg.register_buffers = register_buffers;
    self->cfg.fixed_files = fixed_files;
    self->cfg.register_chunk_bytes = (uint64_t)chunk_bytes;
    self->cfg.workers = (unsigned)workers;
    self->cfg.keepalive_fd = keepalive_fd < 0 ? -1 : keepalive_fd;
    self->cfg.staging_bytes = (uint64_t)staging_bytes;
    self->cfg.seal = sealing != Py_None ? &seal : NULL;

    int ret;
    nvt_engine *eng = NULL;
    /* Registration pins the whole buffer: seconds for a large one. */
    Py_BEGIN_ALLOW_THREADS
    ret = nvt_engine_open(&eng, self->view.buf, (size_t)self->view.len, fds, (unsigned)nfds, &self->cfg);
    Py_END_ALLOW_THREADS
    PyMem_Free(fds);
    self->cfg.seal = NULL; /* copied by the engine; `seal` is this frame's */
    explicit_bzero(&seal, sizeof(seal));
    if (ret < 0) {
        errno = -ret;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    self->eng = eng;
    return (PyObject *)self;
}

static void NvtEngine_dealloc(NvtEngineObject *self) {
    if (self->eng) {
        nvt_completion_batch left = {0};
        Py_BEGIN_ALLOW_THREADS
        nvt_engine_close(self->eng);
        Py_END_ALLOW_THREADS
        nvt_engine_wait(self->eng, 0, &left);
        if (self->mode != 2)
            nvt_drop_completions(&left);
        free(left.items);
        nvt_engine_free(self->eng);
        self->eng = NULL;
    }
    if (self->have_view) {
        self->have_view = 0;
        PyBuffer_Release(&self->view);
    }
    free(self->spare.items);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(submit_doc, "submit(ops) -> bool\n\n"
                         "Queue ops (base.Op objects, or 7- or 8-tuples in Op's field order).\n"
                         "Returns False, queuing nothing, once close() has begun. Never blocks\n"
                         "on I/O.");

static PyObject *NvtEngine_submit(NvtEngineObject *self, PyObject *ops) {
    nvt_op stack_ops[NVT_STACK_OPS];
    if (nvt_use_mode(self, 1) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(ops, "ops must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    nvt_op *arr = n <= NVT_STACK_OPS ? stack_ops : PyMem_Malloc(n * sizeof(nvt_op));
    if (!arr) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t parsed = 0;
    for (; parsed < n; parsed++) {
        if (nvt_parse_op(PySequence_Fast_GET_ITEM(seq, parsed), &arr[parsed]) < 0)
            break;
    }
    int ret = parsed == n ? nvt_engine_submit(self->eng, arr, (size_t)n) : -EINVAL;
    if (ret != 0) {
        for (Py_ssize_t i = 0; i < parsed; i++)
            Py_DECREF((PyObject *)arr[i].op_id);
    }
    if (arr != stack_ops)
        PyMem_Free(arr);
    Py_DECREF(seq);
    if (ret == -EINVAL)
        return NULL; /* the parse error is set */
    if (ret == -ENOMEM)
        return PyErr_NoMemory();
    return PyBool_FromLong(ret == 0);
}

/* Take the engine's completions into *batch (the reusable spare when it is
 * free: *own_spare says so), waiting up to timeout_s in slices with the GIL
 * released so Ctrl-C gets through. On return an exception may be set (a
 * signal); the caller still owns the batch and hands it to nvt_put_batch. */
static void nvt_take_batch(NvtEngineObject *self, double timeout_s, nvt_completion_batch *batch,
                           int *own_spare) {
    nvt_completion_batch empty = {0};
    *batch = empty;
    *own_spare = !self->spare_busy;
    if (*own_spare) {
        *batch = self->spare;
        self->spare_busy = 1;
    }
    batch->len = 0;
    if (timeout_s <= 0) {
        /* A poll takes the engine mutex for a few instructions: keep the GIL. */
        nvt_engine_wait(self->eng, 0, batch);
        return;
    }
    double left = timeout_s;
    while (!batch->len && left > 0) {
        double slice = left < NVT_WAIT_SLICE_S ? left : NVT_WAIT_SLICE_S;
        Py_BEGIN_ALLOW_THREADS
        nvt_engine_wait(self->eng, slice, batch);
        Py_END_ALLOW_THREADS
        left -= slice;
        if (!batch->len && left > 0 && PyErr_CheckSignals() < 0)
            break;
    }
}

/* Give back a batch from nvt_take_batch (its completions already taken). */
static void nvt_put_batch(NvtEngineObject *self, nvt_completion_batch *batch, int own_spare) {
    batch->len = 0;
    if (own_spare) {
        self->spare = *batch;
        self->spare_busy = 0;
    } else {
        free(batch->items);
    }
}

PyDoc_STRVAR(wait_doc, "wait(timeout_s) -> list[tuple[op_id, result, checksum]]\n\n"
                       "Wait up to timeout_s (<= 0: poll) for completions, releasing the GIL.\n"
                       "Returns [] on timeout, and at once once the engine is closed and drained.");

static PyObject *NvtEngine_wait(NvtEngineObject *self, PyObject *arg) {
    double timeout_s = PyFloat_AsDouble(arg);
    if (timeout_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (self->mode == 2) {
        PyErr_SetString(PyExc_ValueError, "wait() on an engine that carries raw ops: use wait_raw()");
        return NULL;
    }

    nvt_completion_batch batch;
    int own_spare;
    nvt_take_batch(self, timeout_s, &batch, &own_spare);

    PyObject *list = NULL;
    if (!PyErr_Occurred())
        list = PyList_New((Py_ssize_t)batch.len);
    size_t i = 0;
    if (list) {
        for (; i < batch.len; i++) {
            nvt_completion *c = &batch.items[i];
            PyObject *t = PyTuple_New(3);
            PyObject *res = PyLong_FromLongLong(c->result);
            PyObject *sum = PyLong_FromUnsignedLongLong(c->checksum);
            if (!t || !res || !sum) {
                Py_XDECREF(t);
                Py_XDECREF(res);
                Py_XDECREF(sum);
                Py_CLEAR(list);
                break;
            }
            PyTuple_SET_ITEM(t, 0, (PyObject *)c->op_id); /* steals the op's reference */
            PyTuple_SET_ITEM(t, 1, res);
            PyTuple_SET_ITEM(t, 2, sum);
            PyList_SET_ITEM(list, (Py_ssize_t)i, t);
        }
    }
    /* Out of memory or interrupted: these completions are lost with the error. */
    for (; i < batch.len; i++)
        Py_DECREF((PyObject *)batch.items[i].op_id);
    nvt_put_batch(self, &batch, own_spare);
    return list;
}

PyDoc_STRVAR(submit_raw_doc, "submit_raw(ops) -> bool\n\n"
                             "Queue packed nvt_op records (a bytes-like object, OP_BYTES each; op_id is\n"
                             "the caller's integer, echoed in wait_raw()). Returns False, queuing\n"
                             "nothing, once close() has begun. Never blocks on I/O.");

static PyObject *NvtEngine_submit_raw(NvtEngineObject *self, PyObject *arg) {
    if (nvt_use_mode(self, 2) < 0)
        return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    if (v.len % (Py_ssize_t)sizeof(nvt_op)) {
        PyBuffer_Release(&v);
        PyErr_Format(PyExc_ValueError, "packed ops must be a multiple of %zu bytes", sizeof(nvt_op));
        return NULL;
    }
    size_t n = (size_t)v.len / sizeof(nvt_op);
    int ret = 0;
    if (n) {
        /* The engine copies the ops; the buffer may be unaligned, so copy first when it is. */
        if (((uintptr_t)v.buf % _Alignof(nvt_op)) == 0) {
            ret = nvt_engine_submit(self->eng, (const nvt_op *)v.buf, n);
        } else {
            nvt_op *tmp = PyMem_Malloc(v.len);
            if (!tmp) {
                PyBuffer_Release(&v);
                return PyErr_NoMemory();
            }
            memcpy(tmp, v.buf, (size_t)v.len);
            ret = nvt_engine_submit(self->eng, tmp, n);
            PyMem_Free(tmp);
        }
    }
    PyBuffer_Release(&v);
    if (ret == -ENOMEM)
        return PyErr_NoMemory();
    return PyBool_FromLong(ret == 0);
}

PyDoc_STRVAR(wait_raw_doc, "wait_raw(timeout_s) -> bytes\n\n"
                           "Like wait(), for raw ops: packed nvt_completion records (COMPLETION_BYTES\n"
                           "each: op_id u64, result i64, checksum u64). b'' on timeout.");

static PyObject *NvtEngine_wait_raw(NvtEngineObject *self, PyObject *arg) {
    double timeout_s = PyFloat_AsDouble(arg);
    if (timeout_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (self->mode == 1) {
        PyErr_SetString(PyExc_ValueError, "wait_raw() on an engine that carries op objects");
        return NULL;
    }
    nvt_completion_batch batch;
    int own_spare;
    nvt_take_batch(self, timeout_s, &batch, &own_spare);
    PyObject *out = NULL;
    if (!PyErr_Occurred())
        out = PyBytes_FromStringAndSize((const char *)batch.items,
                                        (Py_ssize_t)(batch.len * sizeof(nvt_completion)));
    nvt_put_batch(self, &batch, own_spare);
    return out;
}

PyDoc_STRVAR(close_doc, "close()\n\n"
                        "Cancel queued ops (-ECANCELED), let ops in the ring finish, join the I/O\n"
                        "thread, close the ring and release the buffer. Idempotent.");

static PyObject *NvtEngine_close(NvtEngineObject *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    nvt_engine_close(self->eng);
    Py_END_ALLOW_THREADS
    /* The I/O thread is gone: nothing touches the buffer any more. */
    if (self->have_view) {
        self->have_view = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(info_doc, "info() -> dict\n\n"
                       "What the engine set up: limits, and per worker (key 'workers', a list)\n"
                       "its registration ('registered', 'cloned' or 'plain'), ring size, queue\n"
                       "depth and byte cap. The top-level registered_buffers/fixed_files are\n"
                       "true when every worker has them; buffers_errno/files_errno the first\n"
                       "failure.");

static PyObject *NvtEngine_info(NvtEngineObject *self, PyObject *Py_UNUSED(ignored)) {
    static const char *modes[] = {"plain", "registered", "cloned"};
    unsigned n = nvt_engine_workers(self->eng);
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    int all_bufs = 1, all_files = 1, all_keep = 1, buf_err = 0, file_err = 0;
    for (unsigned i = 0; i < n; i++) {
        nvt_engine_info in;
        nvt_engine_get_info(self->eng, i, &in);
        all_bufs &= in.registered_buffers != NVT_BUFFERS_PLAIN;
        all_files &= in.fixed_files;
        all_keep &= in.keepalive;
        if (!buf_err)
            buf_err = in.buffers_errno;
        if (!file_err)
            file_err = in.files_errno;
        PyObject *d = Py_BuildValue("{s:s,s:i,s:i,s:O,s:i,s:I,s:I,s:I,s:K,s:K,s:K,s:i}", "buffers",
                                    modes[in.registered_buffers], "buffers_errno", in.buffers_errno,
                                    "clone_errno", in.clone_errno, "fixed_files",
                                    in.fixed_files ? Py_True : Py_False, "files_errno", in.files_errno,
                                    "ring_entries", in.ring_entries, "setup_flags", in.setup_flags,
                                    "queue_depth", in.queue_depth, "max_inflight_bytes",
                                    (unsigned long long)in.max_inflight_bytes, "staging_bytes",
                                    (unsigned long long)in.staging_bytes, "staging_addr",
                                    (unsigned long long)in.staging_addr, "staging_errno",
                                    in.staging_errno);
        if (!d) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, d);
    }
    nvt_engine_info first;
    nvt_engine_get_info(self->eng, 0, &first);
    return Py_BuildValue("{s:O,s:i,s:O,s:i,s:O,s:I,s:I,s:I,s:K,s:K,s:s,s:N}", "registered_buffers",
                         all_bufs ? Py_True : Py_False, "buffers_errno", buf_err, "fixed_files",
                         all_files ? Py_True : Py_False, "files_errno", file_err, "lock_registered",
                         all_keep && self->cfg.keepalive_fd >= 0 ? Py_True : Py_False, "queue_depth",
                         self->cfg.queue_depth, "ring_entries", first.ring_entries, "setup_flags",
                         first.setup_flags, "max_inflight_bytes",
                         (unsigned long long)self->cfg.max_inflight_bytes, "register_chunk_bytes",
                         (unsigned long long)self->cfg.register_chunk_bytes, "checksum_impl",
                         nvt_xxh3_impl(), "workers", list);
}

PyDoc_STRVAR(worker_stats_doc, "worker_stats() -> list[dict]\n\n"
                               "Per worker: ops completed, bytes moved, bytes hashed, bytes staged\n"
                               "(moved through the staging arena), CPU seconds of\n"
                               "its thread, and failed_errno (0 unless its ring failed). Read without\n"
                               "locks: for rates, not for accounting.");

static PyObject *NvtEngine_worker_stats(NvtEngineObject *self, PyObject *Py_UNUSED(ignored)) {
    unsigned n = nvt_engine_workers(self->eng);
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    for (unsigned i = 0; i < n; i++) {
        nvt_worker_stats st;
        nvt_engine_worker_stats(self->eng, i, &st);
        PyObject *d = Py_BuildValue("{s:K,s:K,s:K,s:K,s:d,s:i}", "ops", (unsigned long long)st.ops, "bytes",
                                    (unsigned long long)st.bytes, "hashed_bytes",
                                    (unsigned long long)st.hashed, "staged_bytes",
                                    (unsigned long long)st.staged, "cpu_s", st.cpu_s, "failed_errno",
                                    st.failed_errno);
        if (!d) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, d);
    }
    return list;
}

PyDoc_STRVAR(fail_worker_doc, "fail_worker(worker, errno)\n\n"
                              "Test hook: mark one worker's ring failed (see nvt_engine_fail_worker):\n"
                              "its queued ops, and ops later routed to it while no healthy worker\n"
                              "serves their file, complete with -errno.");

static PyObject *NvtEngine_fail_worker(NvtEngineObject *self, PyObject *args) {
    unsigned w;
    int err;
    if (!PyArg_ParseTuple(args, "Ii", &w, &err))
        return NULL;
    int ret = nvt_engine_fail_worker(self->eng, w, err);
    if (ret == -ESHUTDOWN) {
        PyErr_SetString(PyExc_RuntimeError, "an engine inherited through fork() has no workers");
        return NULL;
    }
    if (ret != 0) {
        PyErr_Format(PyExc_ValueError, "no worker %u, or errno %d is not positive", w, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(inject_enter_error_doc,
             "_inject_enter_error(worker, errno)\n\n"
             "Tests only: every io_uring_enter of the worker's thread fails with -errno from\n"
             "now on (0: stop), as a ring the kernel keeps refusing; enough of them fail\n"
             "the worker (see fail_worker).");

static PyObject *NvtEngine_inject_enter_error(NvtEngineObject *self, PyObject *args) {
    unsigned w;
    int err;
    if (!PyArg_ParseTuple(args, "Ii", &w, &err))
        return NULL;
    int ret = nvt_engine_inject_enter_error(self->eng, w, err);
    if (ret == -ESHUTDOWN) {
        PyErr_SetString(PyExc_RuntimeError, "an engine inherited through fork() has no workers");
        return NULL;
    }
    if (ret != 0) {
        PyErr_Format(PyExc_ValueError, "no worker %u, or errno %d is negative", w, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* apply_hook(): what the slot table (nvmetier._table, another extension
 * module, which cannot link against this one) needs to install its
 * completion hook on this engine: a capsule named NVT_APPLY_HOOK_CAPSULE
 * over an nvt_apply_hook_api (nvt_engine.h). The capsule holds a reference
 * to this Engine, so the nvt_engine outlives whoever holds the capsule. */
static void nvt_apply_hook_free(PyObject *cap) {
    nvt_apply_hook_api *api = PyCapsule_GetPointer(cap, NVT_APPLY_HOOK_CAPSULE);
    PyObject *owner = PyCapsule_GetContext(cap);
    PyMem_Free(api);
    Py_XDECREF(owner);
}

PyDoc_STRVAR(apply_hook_doc, "apply_hook() -> capsule\n\n"
                             "The engine's completion hook for nvmetier._table.Table.bind(): its I/O\n"
                             "threads then apply the slot table's side of each completion before\n"
                             "publishing it (see nvt_engine_set_apply). Raw ops only.");

static PyObject *NvtEngine_apply_hook(NvtEngineObject *self, PyObject *Py_UNUSED(ignored)) {
    if (nvt_use_mode(self, 2) < 0)
        return NULL;
    nvt_apply_hook_api *api = PyMem_Malloc(sizeof(*api));
    if (!api)
        return PyErr_NoMemory();
    api->engine = self->eng;
    api->set_apply = nvt_engine_set_apply;
    api->done_hint = nvt_engine_done_hint(self->eng);
    PyObject *cap = PyCapsule_New(api, NVT_APPLY_HOOK_CAPSULE, nvt_apply_hook_free);
    if (!cap) {
        PyMem_Free(api);
        return NULL;
    }
    if (PyCapsule_SetContext(cap, Py_NewRef((PyObject *)self)) < 0) {
        Py_DECREF(self);
        Py_DECREF(cap);
        return NULL;
    }
    return cap;
}

PyDoc_STRVAR(auth_failures_doc, "auth_failures() -> int: sealed reads whose tag did not verify.");

static PyObject *NvtEngine_auth_failures(NvtEngineObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(nvt_engine_auth_failures(self->eng));
}

static PyMethodDef NvtEngine_methods[] = {
    {"auth_failures", (PyCFunction)NvtEngine_auth_failures, METH_NOARGS, auth_failures_doc},
    {"apply_hook", (PyCFunction)NvtEngine_apply_hook, METH_NOARGS, apply_hook_doc},
    {"submit", (PyCFunction)NvtEngine_submit, METH_O, submit_doc},
    {"wait", (PyCFunction)NvtEngine_wait, METH_O, wait_doc},
    {"submit_raw", (PyCFunction)NvtEngine_submit_raw, METH_O, submit_raw_doc},
    {"wait_raw", (PyCFunction)NvtEngine_wait_raw, METH_O, wait_raw_doc},
    {"close", (PyCFunction)NvtEngine_close, METH_NOARGS, close_doc},
    {"info", (PyCFunction)NvtEngine_info, METH_NOARGS, info_doc},
    {"worker_stats", (PyCFunction)NvtEngine_worker_stats, METH_NOARGS, worker_stats_doc},
    {"fail_worker", (PyCFunction)NvtEngine_fail_worker, METH_VARARGS, fail_worker_doc},
    {"_inject_enter_error", (PyCFunction)NvtEngine_inject_enter_error, METH_VARARGS, inject_enter_error_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(engine_doc,
             "Engine(buffer, fds, *, queue_depth=64, max_inflight_bytes=64 MiB,\n"
             "       register_buffers=True, fixed_files=True, register_chunk_bytes=1 GiB,\n"
             "       workers=1, keepalive_fd=-1, staging_bytes=0, sealing=None)\n\n"
             "`workers` io_urings, each driven by its own native thread, over a writable\n"
             "buffer and open fds (queue_depth is per drive, i.e. per fd).\n"
             "staging_bytes > 0 gives each worker a huge-page staging arena that ops move\n"
             "through (read there, copied into the buffer; see nvt_engine.h).\n"
             "sealing=(keys capsule, row_bytes, slot_bytes)\n"
             "seals writes and opens reads in the workers (no staging then).\n"
             "Registration failures fall back to unregistered I/O (see info()). Raises OSError\n"
             "if the ring cannot be created.");

static PyTypeObject NvtEngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmetier._uring.Engine",
    .tp_basicsize = sizeof(NvtEngineObject),
    .tp_dealloc = (destructor)NvtEngine_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = engine_doc,
    .tp_methods = NvtEngine_methods,
    .tp_new = NvtEngine_new,
};

PyDoc_STRVAR(probe_doc, "probe() -> tuple[int, str | None]\n\n"
                        "Create a tiny ring and run one NOP. Returns (0, None) when io_uring works,\n"
                        "else (errno, stage) naming the step that failed. Never raises OSError.");

static PyObject *nvt_py_probe(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    const char *stage = NULL;
    int ret;
    Py_BEGIN_ALLOW_THREADS
    ret = nvt_probe(&stage);
    Py_END_ALLOW_THREADS
    if (ret == 0)
        return Py_BuildValue("(iO)", 0, Py_None);
    return Py_BuildValue("(is)", -ret, stage);
}

static PyMethodDef nvt_module_methods[] = {
    {"probe", nvt_py_probe, METH_NOARGS, probe_doc},
    /* Index recovery at open (nvt_recovery.c, used by nvmetier/recovery.py). */
    {"scan_records", (PyCFunction)(void (*)(void))nvt_py_scan_records, METH_FASTCALL,
     nvt_scan_records_doc},
    {"record_keys", (PyCFunction)(void (*)(void))nvt_py_record_keys, METH_FASTCALL,
     nvt_record_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef nvt_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nvmetier._uring",
    .m_doc = "io_uring I/O engine core of nvmetier (see nvmetier/engine/uring.py).",
    .m_size = -1,
    .m_methods = nvt_module_methods,
};

PyMODINIT_FUNC PyInit__uring(void) {
    if (!(nvt_str_op_id = PyUnicode_InternFromString("op_id")) ||
        !(nvt_str_kind = PyUnicode_InternFromString("kind")) ||
        !(nvt_str_file_idx = PyUnicode_InternFromString("file_idx")) ||
        !(nvt_str_file_offset = PyUnicode_InternFromString("file_offset")) ||
        !(nvt_str_buf_offset = PyUnicode_InternFromString("buf_offset")) ||
        !(nvt_str_length = PyUnicode_InternFromString("length")) ||
        !(nvt_str_seed = PyUnicode_InternFromString("seed")) ||
        !(nvt_str_checksum = PyUnicode_InternFromString("checksum")))
        return NULL;
    if (PyType_Ready(&NvtEngineType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&nvt_module);
    if (!m)
        return NULL;
    Py_INCREF(&NvtEngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&NvtEngineType) < 0 ||
        PyModule_AddIntConstant(m, "OP_READ", NVT_OP_READ) < 0 ||
        PyModule_AddIntConstant(m, "OP_WRITE", NVT_OP_WRITE) < 0 || nvt_hash_py_add(m) < 0) {
        Py_DECREF(&NvtEngineType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
