/*
 * XXH3-64 dispatch (see nvt_hash.h). The choice is made once per process;
 * the profiling counters are process-wide atomics.
 */
#include "nvt_hash.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

#define XXH_INLINE_ALL
#include "xxhash.h"
#include "nvt_hash_copy.h"

/* Below this the vector width does not matter and the check would dominate. */
#define NVT_DISPATCH_MIN_BYTES 1024

enum { NVT_IMPL_BASELINE, NVT_IMPL_AVX2, NVT_IMPL_AVX512 };

static pthread_once_t nvt_hash_once = PTHREAD_ONCE_INIT;
static int nvt_hash_impl;

static int nvt_hash_best(void) {
#ifdef NVT_HAVE_AVX2_HASH
    __builtin_cpu_init();
#ifdef NVT_HAVE_AVX512_HASH
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return NVT_IMPL_AVX512;
#endif
    if (__builtin_cpu_supports("avx2"))
        return NVT_IMPL_AVX2;
#endif
    return NVT_IMPL_BASELINE;
}

static void nvt_hash_choose(void) { __atomic_store_n(&nvt_hash_impl, nvt_hash_best(), __ATOMIC_RELAXED); }

static inline int impl_now(void) {
    pthread_once(&nvt_hash_once, nvt_hash_choose);
    return __atomic_load_n(&nvt_hash_impl, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------ profiling */
static int nvt_prof_on;
static nvt_hash_profile_t nvt_prof;

static inline uint64_t thread_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void prof_add(uint64_t *ns, uint64_t *bytes, uint64_t t0, size_t len) {
    __atomic_fetch_add(ns, thread_ns() - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(bytes, (uint64_t)len, __ATOMIC_RELAXED);
}

void nvt_hash_profile(int on) {
    if (on) {
        __atomic_store_n(&nvt_prof.hash_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&nvt_prof.hash_bytes, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&nvt_prof.copy_hash_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&nvt_prof.copy_hash_bytes, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&nvt_prof.copy_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&nvt_prof.copy_bytes, 0, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&nvt_prof_on, on ? 1 : 0, __ATOMIC_RELAXED);
}

void nvt_hash_profile_read(nvt_hash_profile_t *out) {
    out->hash_ns = __atomic_load_n(&nvt_prof.hash_ns, __ATOMIC_RELAXED);
    out->hash_bytes = __atomic_load_n(&nvt_prof.hash_bytes, __ATOMIC_RELAXED);
    out->copy_hash_ns = __atomic_load_n(&nvt_prof.copy_hash_ns, __ATOMIC_RELAXED);
    out->copy_hash_bytes = __atomic_load_n(&nvt_prof.copy_hash_bytes, __ATOMIC_RELAXED);
    out->copy_ns = __atomic_load_n(&nvt_prof.copy_ns, __ATOMIC_RELAXED);
    out->copy_bytes = __atomic_load_n(&nvt_prof.copy_bytes, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------ hashing */
static uint64_t xxh3_any(int impl, const void *data, size_t len, uint64_t seed) {
#ifdef NVT_HAVE_AVX512_HASH
    if (impl == NVT_IMPL_AVX512)
        return nvt_xxh3_avx512(data, len, seed);
#endif
#ifdef NVT_HAVE_AVX2_HASH
    if (impl == NVT_IMPL_AVX2)
        return nvt_xxh3_avx2(data, len, seed);
#endif
    (void)impl;
    return XXH3_64bits_withSeed(data, len, seed);
}

uint64_t nvt_xxh3(const void *data, size_t len, uint64_t seed) {
    if (len < NVT_DISPATCH_MIN_BYTES)
        return XXH3_64bits_withSeed(data, len, seed);
    int impl = impl_now();
    if (__builtin_expect(!__atomic_load_n(&nvt_prof_on, __ATOMIC_RELAXED), 1))
        return xxh3_any(impl, data, len, seed);
    uint64_t t0 = thread_ns();
    uint64_t sum = xxh3_any(impl, data, len, seed);
    prof_add(&nvt_prof.hash_ns, &nvt_prof.hash_bytes, t0, len);
    return sum;
}

static uint64_t xxh3_copy_baseline(void *dst, const void *src, size_t len, uint64_t seed) {
    return nvt_xxh3_copy_loop(dst, src, len, seed);
}

static uint64_t xxh3_copy_any(int impl, void *dst, const void *src, size_t len, uint64_t seed) {
#ifdef NVT_HAVE_AVX512_HASH
    if (impl == NVT_IMPL_AVX512)
        return nvt_xxh3_copy_avx512(dst, src, len, seed);
#endif
#ifdef NVT_HAVE_AVX2_HASH
    if (impl == NVT_IMPL_AVX2)
        return nvt_xxh3_copy_avx2(dst, src, len, seed);
#endif
    (void)impl;
    return xxh3_copy_baseline(dst, src, len, seed);
}

uint64_t nvt_xxh3_copy(void *dst, const void *src, size_t len, uint64_t seed) {
    if (len < NVT_DISPATCH_MIN_BYTES) {
        memcpy(dst, src, len);
        return XXH3_64bits_withSeed(dst, len, seed);
    }
    int impl = impl_now();
    if (__builtin_expect(!__atomic_load_n(&nvt_prof_on, __ATOMIC_RELAXED), 1))
        return xxh3_copy_any(impl, dst, src, len, seed);
    uint64_t t0 = thread_ns();
    uint64_t sum = xxh3_copy_any(impl, dst, src, len, seed);
    prof_add(&nvt_prof.copy_hash_ns, &nvt_prof.copy_hash_bytes, t0, len);
    return sum;
}

void nvt_copy(void *dst, const void *src, size_t len) {
    if (len < NVT_DISPATCH_MIN_BYTES || !__atomic_load_n(&nvt_prof_on, __ATOMIC_RELAXED)) {
        memcpy(dst, src, len);
        return;
    }
    uint64_t t0 = thread_ns();
    memcpy(dst, src, len);
    prof_add(&nvt_prof.copy_ns, &nvt_prof.copy_bytes, t0, len);
}

static const char *impl_name(int impl) {
    return impl == NVT_IMPL_AVX512 ? "avx512" : impl == NVT_IMPL_AVX2 ? "avx2" : "baseline";
}

const char *nvt_xxh3_impl(void) { return impl_name(impl_now()); }

int nvt_xxh3_force(const char *impl) {
    int want;
    (void)impl_now(); /* the one-time choice first, so it cannot undo this */
    if (!strcmp(impl, "avx512"))
        want = NVT_IMPL_AVX512;
    else if (!strcmp(impl, "avx2"))
        want = NVT_IMPL_AVX2;
    else if (!strcmp(impl, "baseline"))
        want = NVT_IMPL_BASELINE;
    else
        return -1;
    /* What the CPU has (best) bounds what may be forced: each level implies
     * the ones below it here. */
    if (want > nvt_hash_best())
        return -1;
    __atomic_store_n(&nvt_hash_impl, want, __ATOMIC_RELAXED);
    return 0;
}
