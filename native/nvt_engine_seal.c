/*
 * nvt_engine_seal: encryption at rest in the io_uring engine
 * (nvt_seal_config): sealing a write's row into its slot image and opening
 * a read's row, both through the store's key table (nvt_seal.c: the one
 * definition of the trailer, the nonces and the authenticated data, shared
 * with the thread engine). Sealing and opening run on a worker's I/O
 * thread; nvt_engine_auth_failures on any thread. The key table's read lock
 * (held while a key is copied out) is the only lock shared between workers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "nvt_engine_internal.h"

/* Page-aligned memory for sealed slot images and trailers, kept out of core
 * dumps (it holds ciphertext and, opened in place, never plaintext; the
 * advice keeps dumps small and free of key-dependent bytes). */
static void *seal_buffer(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, NVT_PAGE_BYTES, n) != 0)
        return NULL;
    (void)madvise(p, n, MADV_DONTDUMP);
    return p;
}

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
    uint64_t slot = e->seal.slot_bytes;
    if (!s->stage && !s->bounce) {
        s->bounce = seal_buffer((size_t)slot);
        if (!s->bounce)
            return -ENOMEM;
    }
    return nvt_keys_seal(e->seal.keys, (uint64_t)s->op.seed, (uint32_t)s->op.file_idx, (uint64_t)s->op.file_offset,
                         e->buf + s->op.buf_offset, nvt_seal_out(s), e->seal.row_bytes, slot, &s->checksum);
}

/* A read's trailer page (allocated at the slot's first read). 0 or -ENOMEM. */
int nvt_seal_read_ready(nvt_engine *e, nvt_slot *s) {
    if (!s->trail) {
        size_t n = (size_t)((e->seal.slot_bytes - e->seal.row_bytes + NVT_PAGE_BYTES - 1) & ~(NVT_PAGE_BYTES - 1));
        s->trail = seal_buffer(n);
        if (!s->trail)
            return -ENOMEM;
    }
    return 0;
}

/* Open a sealed read into its row (from its arena span, or in place): its
 * length, with the tag's head as checksum; -EBADMSG when the trailer or the
 * tag does not verify or its epoch never existed (a decryption whose tag
 * failed leaves the row zeroed; a refusal before any decryption leaves it
 * as it was; the table never serves it; counted in auth_failures); -EKEYREVOKED
 * when its epoch is known destroyed (a purge or a retention: not an
 * authentication failure, not counted); -ENOKEY for an epoch not loaded
 * yet. */
int64_t nvt_seal_open(nvt_engine *e, nvt_read_done *r, uint64_t *checksum) {
    uint8_t *out = r->dst ? r->dst : r->data;
    int rc = nvt_keys_open(e->seal.keys, r->seed, r->file_idx, r->file_off, r->trailer, r->data, out, r->length,
                           checksum);
    if (rc == 0)
        return (int64_t)r->length;
    if (rc == -EBADMSG)
        __atomic_fetch_add(&e->auth_failures, 1, __ATOMIC_RELAXED);
    return rc;
}

uint64_t nvt_engine_auth_failures(const nvt_engine *e) {
    return __atomic_load_n(&e->auth_failures, __ATOMIC_RELAXED);
}
