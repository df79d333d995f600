/*
 * nvt_engine_stage: a worker's staging arena (see nvt_config.staging_bytes):
 * mapping it (nvt_stage_open, from the ring setup) and handing spans of it
 * to ops and taking them back. The arena is owned by the worker's I/O
 * thread, the only thread that calls these; worker_destroy (nvt_engine.c)
 * unmaps it. Nothing here waits (nvt_stage_open faults the arena in).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "nvt_engine_internal.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Map the staging arena: private memory advised for huge pages (refused
 * where THP is off: the arena still works, in whatever pieces it gets), and
 * faulted in now so the first ops do not pay for it. */
int nvt_stage_open(nvt_worker *w, uint64_t bytes) {
    uint64_t len = (bytes + NVT_HUGE_PAGE_BYTES - 1) / NVT_HUGE_PAGE_BYTES * NVT_HUGE_PAGE_BYTES;
    if (len / NVT_STAGE_UNIT_BYTES > UINT32_MAX)
        return -EINVAL;
    size_t map_len = (size_t)(len + NVT_HUGE_PAGE_BYTES);
    void *m = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return -errno;
    uint8_t *base = (uint8_t *)(((uintptr_t)m + NVT_HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(NVT_HUGE_PAGE_BYTES - 1));
    uint32_t units = (uint32_t)(len / NVT_STAGE_UNIT_BYTES);
    uint8_t *used = calloc(units, 1);
    if (!used) {
        munmap(m, map_len);
        return -ENOMEM;
    }
    (void)madvise(base, (size_t)len, MADV_HUGEPAGE);
    if (w->e->sealed) /* a sealing engine's arena holds slot images: kept out of core dumps */
        (void)madvise(m, map_len, MADV_DONTDUMP);
    if (madvise(base, (size_t)len, MADV_POPULATE_WRITE) != 0)
        memset(base, 0, (size_t)len);
    w->stage_map = m;
    w->stage_map_len = map_len;
    w->stage = base;
    w->stage_units = units;
    w->stage_used = used;
    w->info.staging_bytes = len;
    w->info.staging_addr = (uint64_t)(uintptr_t)base;
    return 0;
}

/* Give slot `s` a span of `bytes` of the arena for its op (first fit from a
 * rotating start), or leave it direct when none is free. I/O thread only. */
void nvt_stage_take(nvt_worker *w, nvt_slot *s, uint64_t bytes) {
    s->stage = NULL;
    if (!w->stage_units || bytes == 0)
        return;
    uint64_t need64 = (bytes + NVT_STAGE_UNIT_BYTES - 1) / NVT_STAGE_UNIT_BYTES;
    if (need64 > w->stage_units)
        return;
    uint32_t need = (uint32_t)need64, n = w->stage_units;
    uint32_t start = w->stage_hint + need <= n ? w->stage_hint : 0;
    for (int pass = 0; pass < 2; pass++) {
        uint32_t run = 0;
        uint32_t lo = pass ? 0 : start, hi = pass ? start + need - 1 : n;
        if (hi > n)
            hi = n;
        for (uint32_t i = lo; i < hi; i++) {
            if (w->stage_used[i]) {
                run = 0;
                continue;
            }
            if (++run == need) {
                uint32_t first = i + 1 - need;
                memset(w->stage_used + first, 1, need);
                w->stage_hint = i + 1 < n ? i + 1 : 0;
                s->stage = w->stage + (uint64_t)first * NVT_STAGE_UNIT_BYTES;
                s->stage_first = first;
                s->stage_units = need;
                __atomic_fetch_add(&w->n_staged, (uint64_t)s->op.length, __ATOMIC_RELAXED);
                return;
            }
        }
    }
}

void nvt_stage_give(nvt_worker *w, uint32_t first, uint32_t units) {
    memset(w->stage_used + first, 0, units);
}
