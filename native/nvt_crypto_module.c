/*
 * nvmetier._crypto: AES-256-GCM sealing and opening of chunk buffers
 * (nvt_crypto.c, OpenSSL libcrypto) for Python, with the GIL released while
 * the bytes are processed, so engine worker threads seal and open chunks in
 * parallel with each other and with vLLM's threads.
 *
 * Threads: any; buffers must not change size while a call runs (the buffer
 * protocol holds an export for the call's length).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/crypto.h>

#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "nvt_crypto.h"
#include "nvt_seal.h"

/* A buffer argument of exactly `want` bytes (0: any), read-only or writable. */
static int get_buf(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t want, const char *name) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (want && view->len != want) {
        PyErr_Format(PyExc_ValueError, "%s must be %zd bytes, not %zd", name, want, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(seal_doc, "seal(key, nonce, aad, src, dst) -> tag\n\n"
                       "AES-256-GCM: encrypt src into dst (len(dst) >= len(src); src is only read),\n"
                       "authenticating aad; returns the 16-byte tag. key: 32 bytes, nonce: 12.");

static PyObject *py_seal(PyObject *m, PyObject *args) {
    PyObject *ko, *no, *ao, *so, *dobj;
    if (!PyArg_ParseTuple(args, "OOOOO", &ko, &no, &ao, &so, &dobj))
        return NULL;
    Py_buffer k, n, a, s, d;
    if (get_buf(ko, &k, 0, NVT_GCM_KEY_BYTES, "key") < 0)
        return NULL;
    if (get_buf(no, &n, 0, NVT_GCM_NONCE_BYTES, "nonce") < 0)
        goto fail_k;
    if (get_buf(ao, &a, 0, 0, "aad") < 0)
        goto fail_n;
    if (get_buf(so, &s, 0, 0, "src") < 0)
        goto fail_a;
    if (get_buf(dobj, &d, 1, 0, "dst") < 0)
        goto fail_s;
    PyObject *out = NULL;
    if (d.len < s.len) {
        PyErr_SetString(PyExc_ValueError, "dst is shorter than src");
    } else {
        uint8_t tag[NVT_GCM_TAG_BYTES];
        int rc;
        Py_BEGIN_ALLOW_THREADS rc = nvt_gcm_seal(k.buf, n.buf, a.buf, (size_t)a.len, s.buf, d.buf, (size_t)s.len, tag);
        Py_END_ALLOW_THREADS if (rc == 0) out = PyBytes_FromStringAndSize((const char *)tag, NVT_GCM_TAG_BYTES);
        else PyErr_SetString(PyExc_OSError, "libcrypto failed to seal the chunk (AES-256-GCM)");
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    PyBuffer_Release(&a);
    PyBuffer_Release(&n);
    PyBuffer_Release(&k);
    return out;
fail_s:
    PyBuffer_Release(&s);
fail_a:
    PyBuffer_Release(&a);
fail_n:
    PyBuffer_Release(&n);
fail_k:
    PyBuffer_Release(&k);
    return NULL;
}

PyDoc_STRVAR(open_doc, "open(key, nonce, aad, src, dst, tag) -> bool\n\n"
                       "AES-256-GCM: decrypt src into dst (len(dst) >= len(src); dst may be src: in\n"
                       "place) and check tag over it and aad. False when the tag does not verify (dst\n"
                       "then holds garbage: never use it).");

static PyObject *py_open(PyObject *m, PyObject *args) {
    PyObject *ko, *no, *ao, *so, *dobj, *to;
    if (!PyArg_ParseTuple(args, "OOOOOO", &ko, &no, &ao, &so, &dobj, &to))
        return NULL;
    Py_buffer k, n, a, s, d, t;
    int rc = -2;
    if (get_buf(ko, &k, 0, NVT_GCM_KEY_BYTES, "key") < 0)
        return NULL;
    if (get_buf(no, &n, 0, NVT_GCM_NONCE_BYTES, "nonce") < 0)
        goto fail_k;
    if (get_buf(ao, &a, 0, 0, "aad") < 0)
        goto fail_n;
    if (get_buf(dobj, &d, 1, 0, "dst") < 0)
        goto fail_a;
    /* src may be dst itself (a writable buffer): a read-only view of it. */
    if (get_buf(so, &s, 0, 0, "src") < 0)
        goto fail_d;
    if (get_buf(to, &t, 0, NVT_GCM_TAG_BYTES, "tag") < 0)
        goto fail_s;
    if (d.len < s.len) {
        PyErr_SetString(PyExc_ValueError, "dst is shorter than src");
    } else {
        Py_BEGIN_ALLOW_THREADS rc = nvt_gcm_open(k.buf, n.buf, a.buf, (size_t)a.len, s.buf, d.buf, (size_t)s.len, t.buf);
        Py_END_ALLOW_THREADS if (rc == -1) PyErr_SetString(PyExc_OSError, "libcrypto failed to open the chunk (AES-256-GCM)");
    }
    PyBuffer_Release(&t);
fail_s:
    PyBuffer_Release(&s);
fail_d:
    PyBuffer_Release(&d);
fail_a:
    PyBuffer_Release(&a);
fail_n:
    PyBuffer_Release(&n);
fail_k:
    PyBuffer_Release(&k);
    if (rc < 0)
        return NULL;
    return PyBool_FromLong(rc == 0);
}

/* ---- KeyMac: HMAC-SHA256 of offload keys, optionally handed straight on */
typedef struct {
    PyObject_HEAD nvt_hmac_key *key; /* secret memory (MADV_DONTDUMP), zeroed when freed */
    PyObject *then;                  /* NULL: return the MAC; else then(mac) */
} KeyMacObject;

static void keymac_dealloc(KeyMacObject *self) {
    nvt_secret_free(self->key, sizeof(*self->key));
    Py_CLEAR(self->then);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *keymac_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"mac_key", "then", NULL};
    Py_buffer k;
    PyObject *then = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|O", kwlist, &k, &then))
        return NULL;
    if (then != Py_None && !PyCallable_Check(then)) {
        PyBuffer_Release(&k);
        PyErr_SetString(PyExc_TypeError, "then must be callable or None");
        return NULL;
    }
    KeyMacObject *self = (KeyMacObject *)type->tp_alloc(type, 0);
    if (!self) {
        PyBuffer_Release(&k);
        return NULL;
    }
    self->key = nvt_secret_alloc(sizeof(*self->key));
    int rc = self->key ? nvt_hmac_init(self->key, k.buf, (size_t)k.len) : -1;
    PyBuffer_Release(&k);
    if (rc != 0) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_OSError, "libcrypto failed to key HMAC-SHA256");
        return NULL;
    }
    if (then != Py_None) {
        Py_INCREF(then);
        self->then = then;
    }
    return (PyObject *)self;
}

/* One positional bytes-like argument; no argument tuple parsing beyond that. */
static PyObject *keymac_call(KeyMacObject *self, PyObject *args, PyObject *kwds) {
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "KeyMac takes no keyword arguments");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 1) {
        PyErr_SetString(PyExc_TypeError, "KeyMac takes one argument (the key)");
        return NULL;
    }
    PyObject *arg = PyTuple_GET_ITEM(args, 0);
    uint8_t mac[NVT_HMAC_BYTES];
    if (PyBytes_CheckExact(arg)) {
        nvt_hmac(self->key, (const uint8_t *)PyBytes_AS_STRING(arg), (size_t)PyBytes_GET_SIZE(arg), mac);
    } else {
        Py_buffer b;
        if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
            return NULL;
        nvt_hmac(self->key, b.buf, (size_t)b.len, mac);
        PyBuffer_Release(&b);
    }
    PyObject *out = PyBytes_FromStringAndSize((const char *)mac, NVT_HMAC_BYTES);
    if (!out || !self->then)
        return out;
    PyObject *r = PyObject_CallOneArg(self->then, out);
    Py_DECREF(out);
    return r;
}

static PyObject *keymac_many(KeyMacObject *self, PyObject *keys) {
    PyObject *it = PyObject_GetIter(keys), *list = PyList_New(0), *item;
    if (!it || !list)
        goto fail;
    while ((item = PyIter_Next(it))) {
        Py_buffer b;
        uint8_t mac[NVT_HMAC_BYTES];
        int rc = PyObject_GetBuffer(item, &b, PyBUF_SIMPLE);
        Py_DECREF(item);
        if (rc < 0)
            goto fail;
        nvt_hmac(self->key, b.buf, (size_t)b.len, mac);
        PyBuffer_Release(&b);
        PyObject *m = PyBytes_FromStringAndSize((const char *)mac, NVT_HMAC_BYTES);
        if (!m || PyList_Append(list, m) < 0) {
            Py_XDECREF(m);
            goto fail;
        }
        Py_DECREF(m);
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(it);
    return list;
fail:
    Py_XDECREF(it);
    Py_XDECREF(list);
    return NULL;
}

static PyMethodDef keymac_methods[] = {
    {"many", (PyCFunction)keymac_many, METH_O, "many(keys) -> list of the keys' MACs (then is not applied)."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(keymac_doc, "KeyMac(mac_key, then=None)\n\n"
                         "HMAC-SHA256 under mac_key, keyed once. km(key) -> the 32-byte MAC, or\n"
                         "then(mac) when then is given (a sealed store's table lookup without a\n"
                         "Python frame). The GIL is held: a MAC of a short key takes ~0.3 us.");

static PyTypeObject KeyMacType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._crypto.KeyMac",
    .tp_basicsize = sizeof(KeyMacObject),
    .tp_dealloc = (destructor)keymac_dealloc,
    .tp_call = (ternaryfunc)keymac_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = keymac_doc,
    .tp_methods = keymac_methods,
    .tp_new = keymac_new,
};


/* ---- Keys: a store's data keys per epoch (nvt_seal.h), for both engines */
typedef struct {
    PyObject_HEAD nvt_keys *keys;
    Py_buffer gen_view; /* the table mapping holding keys_gen, while watched */
    int watching;
} KeysObject;

static void keys_unwatch(KeysObject *self) {
    if (self->watching) {
        nvt_keys_watch(self->keys, NULL);
        PyBuffer_Release(&self->gen_view);
        self->watching = 0;
    }
}

static void keys_dealloc(KeysObject *self) {
    if (self->keys)
        keys_unwatch(self);
    nvt_keys_unref(self->keys);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *keys_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"store_id", "layout_digest", NULL};
    Py_buffer id;
    unsigned long long digest;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*K", kwlist, &id, &digest))
        return NULL;
    if (id.len != NVT_STORE_ID_BYTES) {
        PyBuffer_Release(&id);
        PyErr_Format(PyExc_ValueError, "store_id must be %d bytes", NVT_STORE_ID_BYTES);
        return NULL;
    }
    KeysObject *self = (KeysObject *)type->tp_alloc(type, 0);
    if (self && !(self->keys = nvt_keys_new(id.buf, digest))) {
        Py_DECREF(self);
        self = NULL;
        PyErr_NoMemory();
    }
    PyBuffer_Release(&id);
    return (PyObject *)self;
}

static PyObject *keys_set(KeysObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"entries", "seal_epoch", "seal_until_ns", "seal_limit", "max_epoch", "gen_seen",
                             "destroyed", NULL};
    PyObject *list;
    long long seal_epoch;
    unsigned long long until, limit;
    unsigned int max_epoch, gen_seen = 0;
    PyObject *gone_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OLKKI|IO", kwlist, &list, &seal_epoch, &until, &limit, &max_epoch,
                                     &gen_seen, &gone_obj))
        return NULL;
    /* The keys file's destroyed epochs (a sequence of ints; none: empty). */
    uint32_t *gone = PyMem_Malloc(NVT_MAX_EPOCHS * sizeof(*gone));
    if (!gone)
        return PyErr_NoMemory();
    Py_ssize_t n_gone = 0;
    if (gone_obj && gone_obj != Py_None) {
        PyObject *gs = PySequence_Fast(gone_obj, "destroyed must be a sequence of epochs");
        if (!gs)
            goto fail;
        n_gone = PySequence_Fast_GET_SIZE(gs);
        if (n_gone > NVT_MAX_EPOCHS) {
            Py_DECREF(gs);
            PyErr_SetString(PyExc_ValueError, "too many destroyed epochs");
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n_gone; i++) {
            unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(gs, i));
            if (v == (unsigned long)-1 && PyErr_Occurred()) {
                Py_DECREF(gs);
                goto fail;
            }
            if (v > UINT32_MAX) {
                Py_DECREF(gs);
                PyErr_SetString(PyExc_ValueError, "a destroyed epoch is a u32");
                goto fail;
            }
            gone[i] = (uint32_t)v;
        }
        Py_DECREF(gs);
    }
    PyObject *seq = PySequence_Fast(list, "entries must be a sequence of (epoch, key, fingerprint)");
    if (!seq)
        goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > NVT_MAX_EPOCHS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many epochs");
        goto fail;
    }
    size_t bytes = (size_t)(n ? n : 1) * sizeof(nvt_epoch_key);
    nvt_epoch_key *ents = nvt_secret_alloc(bytes);
    if (!ents) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        goto fail;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        unsigned int epoch;
        Py_buffer kb, fb;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Iy*y*;an entry is (epoch, key, fingerprint)", &epoch,
                              &kb, &fb)) {
            rc = -1;
            break;
        }
        if (kb.len != NVT_KEY_BYTES || fb.len != NVT_FP_BYTES) {
            PyErr_SetString(PyExc_ValueError, "an entry's key is 32 bytes and its fingerprint 8");
            rc = -1;
        } else {
            ents[i].epoch = epoch;
            memcpy(ents[i].key, kb.buf, NVT_KEY_BYTES);
            memcpy(ents[i].fingerprint, fb.buf, NVT_FP_BYTES);
        }
        PyBuffer_Release(&kb);
        PyBuffer_Release(&fb);
    }
    Py_DECREF(seq);
    int set_rc = rc ? 0
                    : nvt_keys_set(self->keys, ents, (uint32_t)n, seal_epoch, until, limit, max_epoch, gen_seen, gone,
                                   (uint32_t)n_gone);
    if (set_rc == -ENOMEM) {
        PyErr_NoMemory();
        rc = -1;
    } else if (set_rc != 0) {
        PyErr_SetString(PyExc_ValueError, "the key table refused the entries (a forked child's table?)");
        rc = -1;
    }
    nvt_secret_free(ents, bytes);
    PyMem_Free(gone);
    if (rc)
        return NULL;
    Py_RETURN_NONE;
fail:
    PyMem_Free(gone);
    return NULL;
}

static PyObject *keys_seals(KeysObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(nvt_keys_seals(self->keys));
}

static PyObject *errno_error(int err) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *keys_seal(KeysObject *self, PyObject *args) {
    unsigned long long seed, off;
    unsigned int file_idx;
    PyObject *so, *dobj;
    if (!PyArg_ParseTuple(args, "KIKOO", &seed, &file_idx, &off, &so, &dobj))
        return NULL;
    Py_buffer s, d;
    if (get_buf(so, &s, 0, 0, "row") < 0)
        return NULL;
    if (get_buf(dobj, &d, 1, 0, "slot") < 0) {
        PyBuffer_Release(&s);
        return NULL;
    }
    int rc;
    uint64_t sum = 0;
    if (d.len < s.len + NVT_TRAILER_BYTES) {
        rc = -EINVAL;
    } else {
        Py_BEGIN_ALLOW_THREADS rc = nvt_keys_seal(self->keys, seed, file_idx, off, s.buf, d.buf, (uint64_t)s.len,
                                                  (uint64_t)d.len, &sum);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    if (rc)
        return errno_error(-rc);
    return PyLong_FromUnsignedLongLong(sum);
}

static PyObject *keys_open(KeysObject *self, PyObject *args) {
    unsigned long long seed, off;
    unsigned int file_idx;
    PyObject *to, *so, *dobj;
    if (!PyArg_ParseTuple(args, "KIKOOO", &seed, &file_idx, &off, &to, &so, &dobj))
        return NULL;
    Py_buffer t, s, d;
    if (get_buf(to, &t, 0, 0, "trailer") < 0)
        return NULL;
    if (get_buf(dobj, &d, 1, 0, "dst") < 0) {
        PyBuffer_Release(&t);
        return NULL;
    }
    if (get_buf(so, &s, 0, 0, "src") < 0) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&t);
        return NULL;
    }
    int rc;
    uint64_t sum = 0;
    if (t.len < NVT_TRAILER_BYTES || d.len < s.len) {
        rc = -EINVAL;
    } else {
        Py_BEGIN_ALLOW_THREADS rc =
            nvt_keys_open(self->keys, seed, file_idx, off, t.buf, s.buf, d.buf, (uint64_t)s.len, &sum);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    PyBuffer_Release(&t);
    if (rc)
        return errno_error(-rc);
    return PyLong_FromUnsignedLongLong(sum);
}

static PyObject *keys_watch(KeysObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t offset = 0;
    if (!PyArg_ParseTuple(args, "O|n", &obj, &offset))
        return NULL;
    keys_unwatch(self);
    if (obj == Py_None)
        Py_RETURN_NONE;
    if (PyObject_GetBuffer(obj, &self->gen_view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (offset < 0 || offset % 4 || offset + 4 > self->gen_view.len) {
        PyBuffer_Release(&self->gen_view);
        PyErr_SetString(PyExc_ValueError, "keys_gen offset outside the buffer or unaligned");
        return NULL;
    }
    self->watching = 1;
    nvt_keys_watch(self->keys, (const uint32_t *)((const char *)self->gen_view.buf + offset));
    Py_RETURN_NONE;
}

static PyObject *keys_hold(KeysObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS nvt_keys_hold(self->keys, on);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static void keys_capsule_free(PyObject *cap) {
    nvt_keys_unref(PyCapsule_GetPointer(cap, "nvmetier._crypto.keys"));
}

static PyObject *keys_capsule(KeysObject *self, PyObject *unused) {
    nvt_keys_ref(self->keys);
    PyObject *cap = PyCapsule_New(self->keys, "nvmetier._crypto.keys", keys_capsule_free);
    if (!cap)
        nvt_keys_unref(self->keys);
    return cap;
}

static PyMethodDef keys_methods[] = {
    {"set", (PyCFunction)(void (*)(void))keys_set, METH_VARARGS | METH_KEYWORDS,
     "set(entries, seal_epoch, seal_until_ns, seal_limit, max_epoch, gen_seen=0, destroyed=()): replace\n"
     "the table; entries are (epoch, key, fingerprint); seal_epoch -1: no sealing; gen_seen: the watched\n"
     "keys_gen read before the keys file was; destroyed: the keys file's destroyed epochs (they, and any\n"
     "epoch held before and left out now, open as EKEYREVOKED)."},
    {"hold", (PyCFunction)keys_hold, METH_O,
     "hold(on): a table replacement that may leave no sealing epoch for a moment begins (True) or ends\n"
     "(False); a seal finding none meanwhile waits for the end (at most 2 s) instead of failing."},
    {"watch", (PyCFunction)keys_watch, METH_VARARGS,
     "watch(buffer, offset) / watch(None): the store's shared keys_gen (a u32 at offset of buffer, held\n"
     "until unwatched): an epoch newer than the table opens as ENOKEY only while it moved since set()."},
    {"seals", (PyCFunction)keys_seals, METH_NOARGS, "seals() -> seals made under the sealing epoch."},
    {"seal", (PyCFunction)keys_seal, METH_VARARGS,
     "seal(seed, file_idx, file_offset, row, slot) -> checksum: seal row into slot (ciphertext, trailer,\n"
     "zeros); OSError(EAGAIN) when no epoch may seal. The GIL is released."},
    {"open", (PyCFunction)keys_open, METH_VARARGS,
     "open(seed, file_idx, file_offset, trailer, src, dst) -> checksum: open src into dst (may be src);\n"
     "OSError(EBADMSG) when it does not verify (or its epoch never existed), OSError(EKEYREVOKED) for an\n"
     "epoch known destroyed, OSError(ENOKEY) for an epoch announced since the table was read (reload,\n"
     "then retry)."},
    {"capsule", (PyCFunction)keys_capsule, METH_NOARGS, "capsule() -> the table for nvmetier._uring."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KeysType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._crypto.Keys",
    .tp_basicsize = sizeof(KeysObject),
    .tp_dealloc = (destructor)keys_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Keys(store_id, layout_digest): a store's data keys per epoch (nvt_seal.h), in memory\n"
              "excluded from core dumps and wiped in a forked child.",
    .tp_methods = keys_methods,
    .tp_new = keys_new,
};

/* ---- WrapKey: one AES-256-GCM key for small secrets (a store's epoch
 * keys), derived (HKDF-SHA256) straight into memory excluded from core
 * dumps and wiped in a forked child: never a Python object. */
typedef struct {
    PyObject_HEAD uint8_t *key; /* NVT_GCM_KEY_BYTES in nvt_secret_alloc memory, WIPEONFORK */
} WrapKeyObject;

static void wrapkey_dealloc(WrapKeyObject *self) {
    nvt_secret_free(self->key, NVT_GCM_KEY_BYTES);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *wrapkey_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ikm", "info", NULL};
    Py_buffer ikm, info;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*y*", kwlist, &ikm, &info))
        return NULL;
    WrapKeyObject *self = (WrapKeyObject *)type->tp_alloc(type, 0);
    if (self) {
        self->key = nvt_secret_alloc(NVT_GCM_KEY_BYTES);
        if (!self->key) {
            Py_CLEAR(self);
            PyErr_NoMemory();
        } else {
#ifdef MADV_WIPEONFORK
            (void)madvise(self->key, 4096, MADV_WIPEONFORK); /* a forked child holds no key */
#endif
            if (nvt_hkdf_sha256(ikm.buf, (size_t)ikm.len, info.buf, (size_t)info.len, self->key,
                                NVT_GCM_KEY_BYTES) != 0) {
                Py_CLEAR(self);
                PyErr_SetString(PyExc_OSError, "libcrypto failed to derive a key (HKDF-SHA256)");
            }
        }
    }
    PyBuffer_Release(&info);
    PyBuffer_Release(&ikm);
    return (PyObject *)self;
}

static PyObject *wrapkey_seal(WrapKeyObject *self, PyObject *args) {
    Py_buffer n, p, a;
    if (!PyArg_ParseTuple(args, "y*y*y*", &n, &p, &a))
        return NULL;
    PyObject *out = NULL;
    if (n.len != NVT_GCM_NONCE_BYTES) {
        PyErr_SetString(PyExc_ValueError, "nonce must be 12 bytes");
    } else if ((out = PyBytes_FromStringAndSize(NULL, p.len + NVT_GCM_TAG_BYTES))) {
        uint8_t *o = (uint8_t *)PyBytes_AS_STRING(out);
        if (nvt_gcm_seal(self->key, n.buf, a.buf, (size_t)a.len, p.buf, o, (size_t)p.len, o + p.len) != 0) {
            Py_CLEAR(out);
            PyErr_SetString(PyExc_OSError, "libcrypto failed to wrap a key (AES-256-GCM)");
        }
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&p);
    PyBuffer_Release(&n);
    return out;
}

static PyObject *wrapkey_open(WrapKeyObject *self, PyObject *args) {
    Py_buffer n, c, a, d;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &n, &c, &a, &d))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t len = c.len - NVT_GCM_TAG_BYTES;
    if (n.len != NVT_GCM_NONCE_BYTES || len < 0 || d.len != len) {
        PyErr_SetString(PyExc_ValueError, "nonce must be 12 bytes and dst the wrapped length less the tag");
    } else {
        int rc = nvt_gcm_open(self->key, n.buf, a.buf, (size_t)a.len, c.buf, d.buf, (size_t)len,
                              (const uint8_t *)c.buf + len);
        if (rc < 0)
            PyErr_SetString(PyExc_OSError, "libcrypto failed to unwrap a key (AES-256-GCM)");
        else {
            if (rc)
                OPENSSL_cleanse(d.buf, (size_t)len);
            out = PyBool_FromLong(rc == 0);
        }
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&a);
    PyBuffer_Release(&c);
    PyBuffer_Release(&n);
    return out;
}

static PyMethodDef wrapkey_methods[] = {
    {"seal", (PyCFunction)wrapkey_seal, METH_VARARGS,
     "seal(nonce, plaintext, aad) -> ciphertext + tag (AES-256-GCM)."},
    {"open", (PyCFunction)wrapkey_open, METH_VARARGS,
     "open(nonce, ciphertext + tag, aad, dst) -> bool: the plaintext into the writable dst (the\n"
     "caller's memory, e.g. a bytearray it wipes); False (dst zeroed) when the tag does not verify."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WrapKeyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmetier._crypto.WrapKey",
    .tp_basicsize = sizeof(WrapKeyObject),
    .tp_dealloc = (destructor)wrapkey_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "WrapKey(ikm, info): HKDF-SHA256(ikm, info) as an AES-256-GCM key held only in native\n"
              "memory (MADV_DONTDUMP, MADV_WIPEONFORK, zeroed when freed).",
    .tp_methods = wrapkey_methods,
    .tp_new = wrapkey_new,
};

PyDoc_STRVAR(hkdf_into_doc, "hkdf_into(ikm, info, out): HKDF-SHA256 (no salt) of ikm with info into the writable\n"
                            "buffer out (its length: the output's), through libcrypto.");

static PyObject *py_hkdf_into(PyObject *m, PyObject *args) {
    Py_buffer ikm, info, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &ikm, &info, &out))
        return NULL;
    int rc = nvt_hkdf_sha256(ikm.buf, (size_t)ikm.len, info.buf, (size_t)info.len, out.buf, (size_t)out.len);
    PyBuffer_Release(&out);
    PyBuffer_Release(&info);
    PyBuffer_Release(&ikm);
    if (rc) {
        PyErr_SetString(PyExc_OSError, "libcrypto failed to derive a key (HKDF-SHA256)");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(parse_trailer_doc, "parse_trailer(buf) -> (nonce, tag, epoch, fingerprint) or None");

static PyObject *py_parse_trailer(PyObject *m, PyObject *arg) {
    Py_buffer b;
    if (get_buf(arg, &b, 0, 0, "trailer") < 0)
        return NULL;
    PyObject *out;
    const uint8_t *t = b.buf;
    if (b.len < NVT_TRAILER_BYTES || memcmp(t, "NVTS", 4) != 0 ||
        (t[4] | t[5] << 8 | t[6] << 16 | (uint32_t)t[7] << 24) != NVT_TRAILER_VERSION) {
        out = Py_NewRef(Py_None);
    } else {
        uint32_t epoch = t[36] | t[37] << 8 | t[38] << 16 | (uint32_t)t[39] << 24;
        out = Py_BuildValue("(y#y#Iy#)", t + NVT_TRL_NONCE, (Py_ssize_t)NVT_NONCE_BYTES, t + NVT_TRL_TAG,
                            (Py_ssize_t)NVT_GCM_TAG_BYTES, epoch, t + NVT_TRL_FINGERPRINT, (Py_ssize_t)NVT_FP_BYTES);
    }
    PyBuffer_Release(&b);
    return out;
}

PyDoc_STRVAR(random_doc, "random(n) -> n bytes from the kernel's CSPRNG (the nonce allocator's source)");

static PyObject *py_random(PyObject *m, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "n must be >= 0");
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (!out)
        return NULL;
    int rc = nvt_random((uint8_t *)PyBytes_AS_STRING(out), (size_t)n);
    if (rc) {
        Py_DECREF(out);
        return errno_error(-rc);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"seal", py_seal, METH_VARARGS, seal_doc},
    {"parse_trailer", py_parse_trailer, METH_O, parse_trailer_doc},
    {"random", py_random, METH_O, random_doc},
    {"hkdf_into", py_hkdf_into, METH_VARARGS, hkdf_into_doc},
    {"open", py_open, METH_VARARGS, open_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef crypto_module = {
    PyModuleDef_HEAD_INIT, "nvmetier._crypto",
    "AES-256-GCM for chunk buffers through OpenSSL libcrypto, the GIL released (nvt_crypto.h).", -1, methods,
};

PyMODINIT_FUNC PyInit__crypto(void) {
    PyObject *m = PyModule_Create(&crypto_module);
    if (m && PyModule_AddStringConstant(m, "OPENSSL_VERSION", OpenSSL_version(OPENSSL_VERSION)) < 0)
        Py_CLEAR(m);
    if (m && (PyType_Ready(&KeyMacType) < 0 || PyModule_AddObjectRef(m, "KeyMac", (PyObject *)&KeyMacType) < 0))
        Py_CLEAR(m);
    if (m && (PyType_Ready(&KeysType) < 0 || PyModule_AddObjectRef(m, "Keys", (PyObject *)&KeysType) < 0 ||
              PyType_Ready(&WrapKeyType) < 0 || PyModule_AddObjectRef(m, "WrapKey", (PyObject *)&WrapKeyType) < 0 ||
              PyModule_AddIntConstant(m, "TRAILER_BYTES", NVT_TRAILER_BYTES) < 0 ||
              PyModule_AddIntConstant(m, "TRAILER_VERSION", NVT_TRAILER_VERSION) < 0 ||
              PyModule_AddIntConstant(m, "MAX_EPOCHS", NVT_MAX_EPOCHS) < 0 ||
              PyModule_AddIntConstant(m, "SEAL_LIMIT", (long)NVT_SEAL_LIMIT_DEFAULT) < 0))
        Py_CLEAR(m);
    return m;
}
