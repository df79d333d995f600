/*
 * The shared table's rules driven from C alone (nvt_core, no Python): a
 * small program in the way liburing's test/ drives its own library. Built
 * and run by tests/native/test_core_c.py; prints one line per check and
 * exits non-zero at the first failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nvt_core.h"
#include "nvt_hash.h"

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);          \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

enum { N_SLOTS = 16, WAYS = 4 };

static char *table, *index_map;
static uint64_t table_len;

static void open_core(nvt_core *t, int fd) {
    CHECK(nvt_core_init(t, table, table_len, index_map, N_SLOTS * REC_BYTES, fd) == NULL);
    CHECK(nvt_attach(t) >= 0);
}

/* Claim and publish `key` in `t`: the way it went to, or -1. */
static int store(nvt_core *t, const char *key) {
    uint64_t fp = nvt_xxh3(key, strlen(key), 0), set = fp % t->n_sets;
    int evict;
    CHECK(nvt_set_lock(t, set) == 0);
    int w = nvt_claim_way(t, set, fp, key, strlen(key), nvt_now_ms(), &evict);
    if (w >= 0) {
        slot_ref s = slot_at(t, set, (uint32_t)w);
        *s.state = NVT_READY;
        *s.fp = fp;
        *s.tag = tag_of(fp);
        nvt_write_record(t, set * t->ways + (uint64_t)w, key, (uint8_t)strlen(key), 7);
    }
    set_unlock(t, set);
    return w;
}

static void *hold_and_wait(void *arg) {
    nvt_core *t = arg;
    CHECK(nvt_set_lock(t, 0) == 0);
    usleep(200 * 1000);
    set_unlock(t, 0);
    return NULL;
}

/* Another thread of this process (an io_uring worker applying a completion)
 * holds set 1 for a few ms and writes a slot under it. */
static int held_flag;

static void *hold_briefly(void *arg) {
    nvt_core *t = arg;
    CHECK(pthread_mutex_lock(&set_head(t->base, t->set_bytes, 1)->mu) == 0);
    __atomic_store_n(&held_flag, 1, __ATOMIC_RELEASE);
    usleep(5 * 1000);
    *slot_at(t, 1, 0).last = 42;
    set_unlock(t, 1);
    return NULL;
}

int main(void) {
    table_len = nvt_table_bytes(N_SLOTS, WAYS);
    table = mmap(NULL, table_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    index_map = mmap(NULL, N_SLOTS * REC_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(table != MAP_FAILED && index_map != MAP_FAILED);
    char lock_path[] = "/tmp/nvt-core-test-XXXXXX";
    int fd_a = mkstemp(lock_path);
    int fd_b = open(lock_path, O_RDWR);
    CHECK(fd_a >= 0 && fd_b >= 0);
    unlink(lock_path);

    /* Geometry and header checks. */
    CHECK(nvt_format(table, table_len, N_SLOTS, WAYS) == NULL);
    CHECK(nvt_bad_geometry(1ULL << 32, 1) != NULL);
    CHECK(nvt_bad_geometry(N_SLOTS, 0) != NULL);
    nvt_table_header h = *(nvt_table_header *)table;
    CHECK(nvt_bad_header(&h, table_len) == NULL);
    h.n_sets++;
    CHECK(nvt_bad_header(&h, table_len) != NULL);
    printf("ok header checks\n");

    /* Two sharers (two open file descriptions of one lock file). */
    nvt_core a, b;
    open_core(&a, fd_a);
    open_core(&b, fd_b);
    CHECK(a.me != b.me);
    CHECK(nvt_sharer_live(fd_a, b.me) && nvt_sharer_live(fd_b, a.me));
    printf("ok two sharers attach\n");

    /* A store of a present key is refused (-2); another key finds a way. */
    CHECK(store(&a, "k1") >= 0);
    uint64_t fp = nvt_xxh3("k1", 2, 0), set = fp % a.n_sets;
    CHECK(nvt_set_lock(&b, set) == 0);
    int evict;
    CHECK(nvt_claim_way(&b, set, fp, "k1", 2, nvt_now_ms(), &evict) == -2);
    int w = nvt_find_way(&b, set, fp, "k1", 2, 1u << NVT_READY);
    CHECK(w >= 0);
    set_unlock(&b, set);
    printf("ok claim and find\n");

    /* Two leases of one slot: releasing one keeps the other's protection. */
    CHECK(nvt_set_lock(&a, set) == 0);
    slot_ref s = slot_at(&a, set, (uint32_t)w);
    uint64_t now = nvt_now_ms();
    uint32_t e1, e2;
    CHECK(lease_grant(s, now, now + 1000, &e1) && lease_grant(s, now, now + 1000, &e2));
    lease_release(s, *s.gen, e1);
    CHECK(leased_locked(s, now));
    lease_release(s, *s.gen, e2);
    CHECK(!leased_locked(s, now));
    CHECK(lease_grant(s, now, now + 1000, &e1));
    nvt_set_clock_offset_ns(2000LL * 1000000LL); /* the lease ran out */
    CHECK(!leased_locked(s, nvt_now_ms()));
    lease_release(s, *s.gen, e1); /* a late release of the expired grant: nothing */
    CHECK(*s.pins == 0);
    nvt_set_clock_offset_ns(0);
    set_unlock(&a, set);
    printf("ok leases per grant, expiring\n");

    /* A set mutex held by another thread costs a bounded wait, then a stall mark. */
    pthread_t th;
    CHECK(pthread_create(&th, NULL, hold_and_wait, &a) == 0);
    usleep(20 * 1000);
    uint64_t t0 = now_mono_ns();
    CHECK(nvt_set_lock(&b, 0) == -1);
    uint64_t waited_ms = (now_mono_ns() - t0) / 1000000ULL;
    CHECK(waited_ms >= SET_LOCK_WAIT_MS / 2 && waited_ms < 150);
    t0 = now_mono_ns();
    CHECK(nvt_set_lock(&b, 0) == -1); /* stalled: tried, not waited for */
    CHECK((now_mono_ns() - t0) / 1000000ULL < 5);
    CHECK(b.c.set_lock_timeouts == 2);
    pthread_join(th, NULL);
    printf("ok bounded set lock\n");

    /* Held briefly by another thread: waited for (not tried only), and what
     * that thread wrote under the mutex is seen once it is taken (under TSan
     * too: the wait must be one TSan sees as an acquisition). */
    CHECK(pthread_create(&th, NULL, hold_briefly, &a) == 0);
    while (!__atomic_load_n(&held_flag, __ATOMIC_ACQUIRE))
        usleep(100);
    CHECK(nvt_set_lock(&b, 1) == 0);
    CHECK(*slot_at(&b, 1, 0).last == 42);
    set_unlock(&b, 1);
    pthread_join(th, NULL);
    printf("ok set lock awaited\n");

    nvt_detach(&a);
    CHECK(!nvt_sharer_live(fd_b, 0) || b.me == 0);
    nvt_detach(&b);
    printf("ok detach\n");
    return 0;
}
