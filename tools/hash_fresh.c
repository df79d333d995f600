/*
 * hash_fresh: what one XXH3 pass over a 2 MiB chunk costs on this machine, in
 * CPU seconds per GB, by where the chunk's bytes are when it is hashed:
 *   - warm:   the same chunk hashed again (in the cache);
 *   - cold:   chunks not touched for a while (from memory);
 *   - fresh, same thread: a chunk hashed right after this thread wrote it;
 *   - fresh, other core:  a chunk hashed right after a thread pinned to the
 *     other core wrote it (what an I/O worker meets when the kernel's loop
 *     driver, on another core, has just copied a read into the buffer).
 * docs/bench.md ("Loads on two loop drives: the hash on fresh bytes") uses it
 * to bound what a verified load can reach against fio on 2 cores.
 *
 *   cc -O2 -mavx2 -pthread -Inative tools/hash_fresh.c -o /tmp/hash_fresh && /tmp/hash_fresh
 *
 * xxHash's own header (native/xxhash.h), its dispatch-free AVX2 build; one
 * thread hashes, one writes; nothing else.
 */
#define _GNU_SOURCE
#define XXH_INLINE_ALL
#include "xxhash.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHUNK (2u << 20)
#define N 200

static char *bufs[N];
static int ready = -1;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *writer(void *arg) {
    pin(*(int *)arg);
    for (int i = 0; i < N; i++) {
        memset(bufs[i], i, CHUNK);
        __atomic_store_n(&ready, i, __ATOMIC_RELEASE);
        while (__atomic_load_n(&ready, __ATOMIC_ACQUIRE) == i)
            ;
    }
    return NULL;
}

static void report(const char *what, double seconds, double chunks) {
    printf("%-22s %.4f s/GB\n", what, seconds / (chunks * CHUNK) * 1e9);
}

int main(void) {
    unsigned long long h = 0;
    for (int i = 0; i < N; i++) {
        if (!(bufs[i] = aligned_alloc(4096, CHUNK)))
            return 1;
        memset(bufs[i], 1, CHUNK);
    }
    pin(0);
    /* warm: one chunk, a new seed each pass (no pass can be folded away) */
    h += XXH3_64bits_withSeed(bufs[0], CHUNK, 0);
    double t0 = now_s();
    for (int r = 1; r <= 50; r++)
        h += XXH3_64bits_withSeed(bufs[0], CHUNK, (unsigned long long)r);
    report("warm", now_s() - t0, 50);
    /* cold: every other chunk, each written long before (at allocation) */
    t0 = now_s();
    for (int i = 1; i < N; i++)
        h += XXH3_64bits(bufs[i], CHUNK);
    report("cold", now_s() - t0, N - 1);
    /* fresh, same thread */
    double t = 0;
    for (int i = 0; i < N; i++) {
        memset(bufs[i], i + 7, CHUNK);
        double a = now_s();
        h += XXH3_64bits(bufs[i], CHUNK);
        t += now_s() - a;
    }
    report("fresh, same thread", t, N);
    /* fresh, written on the other core */
    int other = 1;
    pthread_t th;
    if (pthread_create(&th, NULL, writer, &other) != 0)
        return 1;
    t = 0;
    for (int i = 0; i < N; i++) {
        while (__atomic_load_n(&ready, __ATOMIC_ACQUIRE) != i)
            ;
        double a = now_s();
        h += XXH3_64bits(bufs[i], CHUNK);
        t += now_s() - a;
        __atomic_store_n(&ready, -2 - i, __ATOMIC_RELEASE);
    }
    pthread_join(th, NULL);
    report("fresh, other core", t, N);
    fprintf(stderr, "(checksum %llx)\n", h);
    return 0;
}
