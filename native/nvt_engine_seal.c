/*
 * nvt_engine_seal: encryption at rest in the io_uring engine
 * (nvt_seal_config): nonce ranges, sealing a write's row into its slot image
 * with its trailer, and opening a read's row (nvt_gcm_* of nvt_crypto.c,
 * libcrypto). Sealing and opening run on a worker's I/O thread;
 * nvt_engine_add_nonces, nvt_engine_nonces_left and nvt_engine_auth_failures
 * on any thread. The nonce range (nonce_lock, held briefly) is the only
 * lock shared between workers; nothing else here waits.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "nvt_crypto.h"
#include "nvt_engine_internal.h"

static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* The next nonce (prefix, counter; LE), or -EAGAIN when none is left. */
static int nonce_take(nvt_engine *e, uint8_t nonce[NVT_GCM_NONCE_BYTES]) {
    uint64_t ctr;
    pthread_mutex_lock(&e->nonce_lock);
    if (e->nonce_next == e->nonce_end && e->spare_n) {
        e->nonce_next = e->spare_start;
        e->nonce_end = e->spare_start + e->spare_n;
        e->spare_n = 0;
    }
    if (e->nonce_next == e->nonce_end) {
        pthread_mutex_unlock(&e->nonce_lock);
        return -EAGAIN;
    }
    ctr = e->nonce_next++;
    pthread_mutex_unlock(&e->nonce_lock);
    put_le(nonce, e->seal.nonce_prefix, 4);
    put_le(nonce + 4, ctr, 8);
    return 0;
}

/* A chunk's authenticated data: its seed (the key's fingerprint in the
 * table) and the layout digest (sealed.py's chunk_aad). */
static void seal_aad(const nvt_engine *e, uint64_t seed, uint8_t aad[16]) {
    put_le(aad, seed, 8);
    put_le(aad + 8, e->seal.layout_digest, 8);
}

/* Trailer layout (sealed.py's _TRAILER): magic, version, nonce, tag, key fingerprint. */
#define TRL_VERSION 4
#define TRL_NONCE 8
#define TRL_TAG 20
#define TRL_FINGERPRINT 36

/* Where a sealed op's slot image is: its span of the staging arena (huge
 * pages: the device moves it in a few large pieces), else its bounce buffer
 * (write) / the row and trailer page (read). */
uint8_t *nvt_seal_out(nvt_slot *s) {
    return s->stage ? s->stage : s->bounce;
}

/* Seal a write's row into its slot image (arena span or bounce buffer),
 * trailer included (the row is only read). 0 or -errno; the op then fails
 * with it. */
int nvt_seal_write(nvt_engine *e, nvt_slot *s) {
    uint64_t row = e->seal.row_bytes, slot = e->seal.slot_bytes;
    uint8_t nonce[NVT_GCM_NONCE_BYTES], aad[16], tag[NVT_GCM_TAG_BYTES];
    if (!s->stage && !s->bounce) {
        void *p = NULL;
        if (posix_memalign(&p, NVT_PAGE_BYTES, (size_t)slot) != 0)
            return -ENOMEM;
        s->bounce = p;
    }
    int err = nonce_take(e, nonce);
    if (err)
        return err;
    seal_aad(e, (uint64_t)s->op.seed, aad);
    uint8_t *out = nvt_seal_out(s);
    if (nvt_gcm_seal(e->seal.key, nonce, aad, sizeof(aad), e->buf + s->op.buf_offset, out, (size_t)row, tag) != 0)
        return -EIO;
    uint8_t *t = out + row;
    memset(t, 0, (size_t)(slot - row));
    memcpy(t, "NVTS", 4);
    put_le(t + TRL_VERSION, 1, 4);
    memcpy(t + TRL_NONCE, nonce, sizeof(nonce));
    memcpy(t + TRL_TAG, tag, sizeof(tag));
    memcpy(t + TRL_FINGERPRINT, e->seal.fingerprint, sizeof(e->seal.fingerprint));
    s->checksum = get_le64(tag);
    return 0;
}

/* A read's trailer page (allocated at the slot's first read). 0 or -ENOMEM. */
int nvt_seal_read_ready(nvt_engine *e, nvt_slot *s) {
    if (!s->trail) {
        size_t n = (size_t)((e->seal.slot_bytes - e->seal.row_bytes + NVT_PAGE_BYTES - 1) & ~(NVT_PAGE_BYTES - 1));
        void *p = NULL;
        if (posix_memalign(&p, NVT_PAGE_BYTES, n) != 0)
            return -ENOMEM;
        s->trail = p;
    }
    return 0;
}

/* Open a sealed read into its row (from its arena span, or in place): its
 * length, with the tag's head as checksum, or -EBADMSG when the trailer or
 * the tag does not verify (the row then holds garbage the table never
 * serves). */
int64_t nvt_seal_open(nvt_engine *e, nvt_read_done *r, uint64_t *checksum) {
    const uint8_t *t = r->trailer;
    uint8_t aad[16];
    *checksum = 0;
    if (memcmp(t, "NVTS", 4) != 0 || get_le64(t + TRL_VERSION) % (1ull << 32) != 1) {
        __atomic_fetch_add(&e->auth_failures, 1, __ATOMIC_RELAXED);
        return -EBADMSG;
    }
    seal_aad(e, r->seed, aad);
    /* From the arena into the row (no copy), or in place in the row. */
    uint8_t *out = r->dst ? r->dst : r->data;
    int rc = nvt_gcm_open(e->seal.key, t + TRL_NONCE, aad, sizeof(aad), r->data, out, (size_t)r->length,
                          t + TRL_TAG);
    if (rc == 0) {
        *checksum = get_le64(t + TRL_TAG);
        return (int64_t)r->length;
    }
    if (rc == 1)
        __atomic_fetch_add(&e->auth_failures, 1, __ATOMIC_RELAXED);
    return rc == 1 ? -EBADMSG : -EIO;
}

int nvt_engine_add_nonces(nvt_engine *e, uint64_t start, uint64_t n) {
    int ret = 0;
    if (!e->sealed || n == 0 || start + n < start)
        return -EINVAL;
    pthread_mutex_lock(&e->nonce_lock);
    if (e->nonce_next == e->nonce_end) {
        e->nonce_next = start;
        e->nonce_end = start + n;
    } else if (!e->spare_n) {
        e->spare_start = start;
        e->spare_n = n;
    } else {
        ret = -EBUSY;
    }
    pthread_mutex_unlock(&e->nonce_lock);
    return ret;
}

uint64_t nvt_engine_nonces_left(nvt_engine *e, int *spare_free) {
    uint64_t left;
    pthread_mutex_lock(&e->nonce_lock);
    left = e->nonce_end - e->nonce_next + e->spare_n;
    *spare_free = e->sealed && e->spare_n == 0;
    pthread_mutex_unlock(&e->nonce_lock);
    return left;
}

uint64_t nvt_engine_auth_failures(const nvt_engine *e) {
    return __atomic_load_n(&e->auth_failures, __ATOMIC_RELAXED);
}
