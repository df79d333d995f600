/*
 * The AVX-512 build of XXH3-64 (see nvt_hash.h): xxHash's own AVX-512 code
 * (XXH_VECTOR=XXH_AVX512), compiled for AVX-512F/BW/VL by the pragma below
 * whatever the global flags say, and called only after the CPU was checked
 * (nvt_hash.c), so the module still loads on CPUs without AVX-512. A compiler
 * that cannot target AVX-512 leaves this unit empty (NVT_HAVE_AVX512_HASH is
 * then unset, and AVX2 or the baseline is used).
 */
#include "nvt_hash.h"

#include <string.h>

#ifdef NVT_HAVE_AVX512_HASH
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR 3 /* XXH_AVX512 */
#include "xxhash.h"
#include "nvt_hash_copy.h"

uint64_t nvt_xxh3_avx512(const void *data, size_t len, uint64_t seed) {
    return XXH3_64bits_withSeed(data, len, seed);
}

uint64_t nvt_xxh3_copy_avx512(void *dst, const void *src, size_t len, uint64_t seed) {
    return nvt_xxh3_copy_loop(dst, src, len, seed);
}
#else
/* ISO C wants at least one declaration in a translation unit. */
typedef int nvt_hash_avx512_unused;
#endif
