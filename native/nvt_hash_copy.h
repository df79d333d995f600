/*
 * The fused copy + XXH3-64 loop, one body for every build of the hash
 * (nvt_hash.c's baseline, nvt_hash_avx2.c, nvt_hash_avx512.c). Include it
 * after xxhash.h (XXH_INLINE_ALL) in a unit that set its own XXH_VECTOR and
 * target pragma: the loop is then compiled with that unit's vector code.
 * Each block of NVT_HASH_COPY_BLOCK bytes is hashed from the destination just
 * written, while it is still in the cache.
 */
#ifndef NVT_HASH_COPY_H
#define NVT_HASH_COPY_H

#include <string.h>

#include "nvt_hash.h"

static inline uint64_t nvt_xxh3_copy_loop(void *dst, const void *src, size_t len, uint64_t seed) {
    XXH3_state_t st;
    memset(&st, 0, sizeof(st)); /* reset leaves fields GCC cannot see set */
    XXH3_64bits_reset_withSeed(&st, seed);
    for (size_t off = 0; off < len; off += NVT_HASH_COPY_BLOCK) {
        size_t n = len - off < NVT_HASH_COPY_BLOCK ? len - off : NVT_HASH_COPY_BLOCK;
        memcpy((uint8_t *)dst + off, (const uint8_t *)src + off, n);
        XXH3_64bits_update(&st, (const uint8_t *)dst + off, n);
    }
    return XXH3_64bits_digest(&st);
}

#endif
