/*
 * The AVX2 build of XXH3-64 (see nvt_hash.h). Compiled for AVX2 by the pragma
 * below whatever the global flags say, and called only after the CPU was
 * checked, so the module still loads on CPUs without AVX2.
 */
#include "nvt_hash.h"

#include <string.h>

#ifdef NVT_HAVE_AVX2_HASH
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR 2 /* XXH_AVX2 */
#include "xxhash.h"
#include "nvt_hash_copy.h"

uint64_t nvt_xxh3_avx2(const void *data, size_t len, uint64_t seed) {
    return XXH3_64bits_withSeed(data, len, seed);
}

uint64_t nvt_xxh3_copy_avx2(void *dst, const void *src, size_t len, uint64_t seed) {
    return nvt_xxh3_copy_loop(dst, src, len, seed);
}
#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int nvt_hash_avx2_unused;
#endif
