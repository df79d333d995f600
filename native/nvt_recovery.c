/*
 * Batch scan of the index records at open (see nvt_recovery.h and
 * nvmetier/recovery.py, which owns the semantics and has a pure-Python twin
 * of this loop that must give identical results).
 *
 * Record layout (nvmetier/format.py, docs/format.md; little-endian, 128 bytes):
 *   0 magic u32 | 4 state u8 | 5 key_len u8 | 6 reserved u16 | 8 payload u64 |
 *   16 stored_ns u64 | 24 reserved u32 | 28 slot u32 | 32 key[88] | 120 checksum u64
 * checksum = XXH3-64(bytes [0,120), seed = slot position); key seed = XXH3-64(key).
 * Changing this layout requires bumping FORMAT_VERSION (and this file).
 */
#include "nvt_recovery.h"

#include <stdint.h>
#include <string.h>

#include "nvt_hash.h"

#define NVT_RECORD_BYTES 128
#define NVT_RECORD_BODY_BYTES 120
#define NVT_RECORD_MAGIC 0x5254564Eu
#define NVT_KEY_OFFSET 32
#define NVT_KEY_MAX_BYTES 88
#define NVT_STATE_VALID 1

/* Reason codes; the same numbers as recovery.py's _CODE_* constants. */
enum {
    NVT_REC_OK = 0,
    NVT_REC_BAD_MAGIC = 1,
    NVT_REC_CHECKSUM = 2,
    NVT_REC_BAD_STATE = 3,
    NVT_REC_WRONG_SLOT = 4,
    NVT_REC_KEY_LEN = 5,
    NVT_REC_MISPLACED = 6,
};

_Static_assert(NVT_KEY_OFFSET + NVT_KEY_MAX_BYTES == NVT_RECORD_BODY_BYTES, "record layout");

static inline uint32_t nvt_le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t nvt_le64(const unsigned char *p) {
    return (uint64_t)nvt_le32(p) | (uint64_t)nvt_le32(p + 4) << 32;
}

static inline int nvt_record_is_zero(const unsigned char *rec) {
    uint64_t acc = 0;
    for (int i = 0; i < NVT_RECORD_BYTES; i += 8) {
        uint64_t w;
        memcpy(&w, rec + i, 8);
        acc |= w;
    }
    return acc == 0;
}

/* Classify one non-empty record; *seed is the key seed when the result is
 * OK or MISPLACED, else 0. Check order follows format.unpack_record. */
static int nvt_classify(const unsigned char *rec, uint64_t slot, uint64_t ways, uint64_t n_sets,
                        uint64_t *seed) {
    *seed = 0;
    if (nvt_le32(rec) != NVT_RECORD_MAGIC)
        return NVT_REC_BAD_MAGIC;
    if (nvt_le64(rec + NVT_RECORD_BODY_BYTES) != nvt_xxh3(rec, NVT_RECORD_BODY_BYTES, slot))
        return NVT_REC_CHECKSUM;
    if (rec[4] != NVT_STATE_VALID)
        return NVT_REC_BAD_STATE;
    if ((uint64_t)nvt_le32(rec + 28) != slot)
        return NVT_REC_WRONG_SLOT;
    unsigned key_len = rec[5];
    if (key_len > NVT_KEY_MAX_BYTES)
        return NVT_REC_KEY_LEN;
    *seed = nvt_xxh3(rec + NVT_KEY_OFFSET, key_len, 0);
    if (*seed % n_sets != slot / ways)
        return NVT_REC_MISPLACED;
    return NVT_REC_OK;
}

static int nvt_get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t min_bytes,
                          const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len < min_bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs at least %zd", what, view->len,
                     min_bytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

const char nvt_scan_records_doc[] =
    "scan_records(index, n_slots, ways, out_slots, out_codes, out_seeds) -> int\n\n"
    "Scan the first n_slots 128-byte records of index (a readable buffer). For each\n"
    "record that is not all zeros, in slot order, write its slot (int64) to out_slots,\n"
    "its reason code (uint8: 0 valid and placed in its key's set, 1 bad magic, 2 record\n"
    "checksum mismatch, 3 bad state, 4 wrong slot, 5 key_len > 88, 6 misplaced) to\n"
    "out_codes and its key seed (uint64, XXH3-64 of the key; 0 for codes 1-5) to\n"
    "out_seeds. The outputs are writable buffers of at least n_slots items. Returns the\n"
    "number of records written. Does not modify index; releases the GIL.";

PyObject *nvt_py_scan_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "scan_records() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t n_slots = PyLong_AsSsize_t(args[1]);
    if (n_slots == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t ways = PyLong_AsSsize_t(args[2]);
    if (ways == -1 && PyErr_Occurred())
        return NULL;
    if (n_slots < 0 || n_slots > (Py_ssize_t)UINT32_MAX + 1 || ways < 1 || n_slots % ways) {
        PyErr_Format(PyExc_ValueError,
                     "n_slots=%zd must be a multiple of ways=%zd (ways >= 1, n_slots < 2**32)",
                     n_slots, ways);
        return NULL;
    }
    if (n_slots > PY_SSIZE_T_MAX / NVT_RECORD_BYTES) {
        PyErr_SetString(PyExc_OverflowError, "n_slots too large");
        return NULL;
    }
    Py_buffer index, slots_v, codes_v, seeds_v;
    if (nvt_get_buffer(args[0], &index, 0, n_slots * NVT_RECORD_BYTES, "index") < 0)
        return NULL;
    if (nvt_get_buffer(args[3], &slots_v, 1, n_slots * 8, "out_slots") < 0)
        goto fail_index;
    if (nvt_get_buffer(args[4], &codes_v, 1, n_slots, "out_codes") < 0)
        goto fail_slots;
    if (nvt_get_buffer(args[5], &seeds_v, 1, n_slots * 8, "out_seeds") < 0)
        goto fail_codes;

    const unsigned char *base = index.buf;
    unsigned char *out_slots = slots_v.buf, *out_codes = codes_v.buf, *out_seeds = seeds_v.buf;
    uint64_t n = (uint64_t)n_slots, w = (uint64_t)ways, n_sets = n ? n / w : 1;
    uint64_t m = 0;
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t slot = 0; slot < n; slot++) {
        const unsigned char *rec = base + slot * NVT_RECORD_BYTES;
        if (nvt_record_is_zero(rec))
            continue;
        uint64_t seed;
        int64_t s = (int64_t)slot;
        out_codes[m] = (unsigned char)nvt_classify(rec, slot, w, n_sets, &seed);
        memcpy(out_slots + m * 8, &s, 8);
        memcpy(out_seeds + m * 8, &seed, 8);
        m++;
    }
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&seeds_v);
    PyBuffer_Release(&codes_v);
    PyBuffer_Release(&slots_v);
    PyBuffer_Release(&index);
    return PyLong_FromUnsignedLongLong(m);

fail_codes:
    PyBuffer_Release(&codes_v);
fail_slots:
    PyBuffer_Release(&slots_v);
fail_index:
    PyBuffer_Release(&index);
    return NULL;
}

const char nvt_record_keys_doc[] =
    "record_keys(index, slots) -> list[bytes]\n\n"
    "The keys (exactly key_len bytes, trailing zero bytes kept) of the records at\n"
    "slots (an int64 buffer) of index. Raises IndexError for a slot outside index and\n"
    "ValueError for a key_len over 88 (pass only slots that scan_records found valid).";

PyObject *nvt_py_record_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "record_keys() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_buffer index, slots_v;
    if (nvt_get_buffer(args[0], &index, 0, 0, "index") < 0)
        return NULL;
    if (nvt_get_buffer(args[1], &slots_v, 0, 0, "slots") < 0) {
        PyBuffer_Release(&index);
        return NULL;
    }
    PyObject *keys = NULL;
    if (slots_v.len % 8) {
        PyErr_SetString(PyExc_ValueError, "slots must be an int64 buffer");
        goto done;
    }
    Py_ssize_t count = slots_v.len / 8;
    int64_t n_records = index.len / NVT_RECORD_BYTES;
    const unsigned char *base = index.buf, *sp = slots_v.buf;
    keys = PyList_New(count);
    if (!keys)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t slot;
        memcpy(&slot, sp + i * 8, 8);
        if (slot < 0 || slot >= n_records) {
            PyErr_Format(PyExc_IndexError, "slot %lld outside an index of %lld records",
                         (long long)slot, (long long)n_records);
            goto fail;
        }
        const unsigned char *rec = base + slot * NVT_RECORD_BYTES;
        if (rec[5] > NVT_KEY_MAX_BYTES) {
            PyErr_Format(PyExc_ValueError, "slot %lld: key_len %d > %d", (long long)slot,
                         (int)rec[5], NVT_KEY_MAX_BYTES);
            goto fail;
        }
        PyObject *key = PyBytes_FromStringAndSize((const char *)rec + NVT_KEY_OFFSET, rec[5]);
        if (!key)
            goto fail;
        PyList_SET_ITEM(keys, i, key);
    }
    goto done;
fail:
    Py_CLEAR(keys);
done:
    PyBuffer_Release(&slots_v);
    PyBuffer_Release(&index);
    return keys;
}
