/*
 * nvt_hash: XXH3-64 with a seed, the checksum of every op, dispatched at run
 * time to the widest vector unit the CPU has (AVX2 on x86-64, else the
 * compile-time baseline: SSE2 on x86-64, NEON on arm64). Every variant
 * returns the same value. Thread-safe, no locks, never blocks.
 */
#ifndef NVT_HASH_H
#define NVT_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t nvt_xxh3(const void *data, size_t len, uint64_t seed);

/* Copy `len` bytes from `src` to `dst` (not overlapping) and return
 * XXH3-64(seed) of them, in one pass: each 64 KiB block is hashed from `dst`
 * right after it was copied, while it is still in cache. Equal to
 * memcpy + nvt_xxh3(dst, len, seed). */
uint64_t nvt_xxh3_copy(void *dst, const void *src, size_t len, uint64_t seed);

/* Which implementation nvt_xxh3 uses: "avx2" or "baseline". */
const char *nvt_xxh3_impl(void);

#if defined(__x86_64__) && defined(__GNUC__)
#define NVT_HAVE_AVX2_HASH 1
/* In nvt_hash_avx2.c; call only where the CPU supports AVX2. */
uint64_t nvt_xxh3_avx2(const void *data, size_t len, uint64_t seed);
uint64_t nvt_xxh3_copy_avx2(void *dst, const void *src, size_t len, uint64_t seed);
#endif

#endif /* NVT_HASH_H */
