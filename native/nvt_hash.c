/*
 * XXH3-64 dispatch (see nvt_hash.h). The choice is made once per process.
 */
#include "nvt_hash.h"

#include <pthread.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

/* Below this the vector width does not matter and the check would dominate. */
#define NVT_DISPATCH_MIN_BYTES 1024

static pthread_once_t nvt_hash_once = PTHREAD_ONCE_INIT;
static int nvt_hash_use_avx2;

static void nvt_hash_choose(void) {
#ifdef NVT_HAVE_AVX2_HASH
    __builtin_cpu_init();
    nvt_hash_use_avx2 = __builtin_cpu_supports("avx2");
#endif
}

uint64_t nvt_xxh3(const void *data, size_t len, uint64_t seed) {
    if (len < NVT_DISPATCH_MIN_BYTES)
        return XXH3_64bits_withSeed(data, len, seed);
    pthread_once(&nvt_hash_once, nvt_hash_choose);
#ifdef NVT_HAVE_AVX2_HASH
    if (nvt_hash_use_avx2)
        return nvt_xxh3_avx2(data, len, seed);
#endif
    return XXH3_64bits_withSeed(data, len, seed);
}

/* The block a fused copy hashes at a time: small enough to stay in L2. */
#define NVT_COPY_BLOCK (64u << 10)

static uint64_t xxh3_copy_baseline(void *dst, const void *src, size_t len, uint64_t seed) {
    XXH3_state_t st;
    memset(&st, 0, sizeof(st)); /* reset leaves fields GCC cannot see set */
    XXH3_64bits_reset_withSeed(&st, seed);
    for (size_t off = 0; off < len; off += NVT_COPY_BLOCK) {
        size_t n = len - off < NVT_COPY_BLOCK ? len - off : NVT_COPY_BLOCK;
        memcpy((uint8_t *)dst + off, (const uint8_t *)src + off, n);
        XXH3_64bits_update(&st, (const uint8_t *)dst + off, n);
    }
    return XXH3_64bits_digest(&st);
}

uint64_t nvt_xxh3_copy(void *dst, const void *src, size_t len, uint64_t seed) {
    if (len < NVT_DISPATCH_MIN_BYTES) {
        memcpy(dst, src, len);
        return XXH3_64bits_withSeed(dst, len, seed);
    }
    pthread_once(&nvt_hash_once, nvt_hash_choose);
#ifdef NVT_HAVE_AVX2_HASH
    if (nvt_hash_use_avx2)
        return nvt_xxh3_copy_avx2(dst, src, len, seed);
#endif
    return xxh3_copy_baseline(dst, src, len, seed);
}

const char *nvt_xxh3_impl(void) {
    pthread_once(&nvt_hash_once, nvt_hash_choose);
    return nvt_hash_use_avx2 ? "avx2" : "baseline";
}
