/*
 * nvt_hash: XXH3-64 with a seed, the checksum of every op, dispatched at run
 * time to the widest vector unit the CPU has (AVX-512 or AVX2 on x86-64, else
 * the compile-time baseline: SSE2 on x86-64, NEON on arm64). Every variant
 * returns the same value. Thread-safe, no locks, never blocks.
 *
 * Profiling (nvt_hash_profile): while it is on, every hash, fused copy and
 * staging copy of at least 1 KiB adds the calling thread's CPU time
 * (CLOCK_THREAD_CPUTIME_ID) and its bytes to process-wide counters, so a
 * benchmark can say how much of a thread's CPU was hashing and copying. Off
 * (the default) it costs one relaxed load per call.
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

/* Copy `len` bytes (not overlapping): memcpy, counted while profiling. */
void nvt_copy(void *dst, const void *src, size_t len);

/* Which implementation nvt_xxh3 uses: "avx512", "avx2" or "baseline". */
const char *nvt_xxh3_impl(void);
/* Force the implementation ("avx512", "avx2", "baseline") where the CPU has
 * it, for tests and benchmarks; 0 on success, -1 if unavailable here. */
int nvt_xxh3_force(const char *impl);

/* The profiling counters: CPU ns and bytes of hashing alone, of fused
 * copy+hash, and of plain (staging) copies. */
typedef struct {
    uint64_t hash_ns, hash_bytes, copy_hash_ns, copy_hash_bytes, copy_ns, copy_bytes;
} nvt_hash_profile_t;
/* Turn profiling on (1) or off (0); on also zeroes the counters. */
void nvt_hash_profile(int on);
void nvt_hash_profile_read(nvt_hash_profile_t *out);

/* The block a fused copy hashes at a time: small enough to stay in L2. */
#define NVT_HASH_COPY_BLOCK (64u << 10)

#if defined(__x86_64__) && defined(__GNUC__)
#define NVT_HAVE_AVX2_HASH 1
/* In nvt_hash_avx2.c; call only where the CPU supports AVX2. */
uint64_t nvt_xxh3_avx2(const void *data, size_t len, uint64_t seed);
uint64_t nvt_xxh3_copy_avx2(void *dst, const void *src, size_t len, uint64_t seed);
#if defined(__clang__) ? (__clang_major__ >= 8) : (__GNUC__ >= 7)
#define NVT_HAVE_AVX512_HASH 1
/* In nvt_hash_avx512.c; call only where the CPU supports AVX-512F/BW/VL. */
uint64_t nvt_xxh3_avx512(const void *data, size_t len, uint64_t seed);
uint64_t nvt_xxh3_copy_avx512(void *dst, const void *src, size_t len, uint64_t seed);
#endif
#endif

#endif /* NVT_HASH_H */
