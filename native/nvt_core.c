/*
 * nvt_core: the rules of the process-shared slot table, no Python (see
 * nvt_core.h; the layout and lock rules are in nvt_layout.h).
 */
#define _GNU_SOURCE /* F_OFD_GETLK, pthread_mutex_clocklock */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nvt_core.h"
#include "nvt_hash.h"

/* The table's clock: CLOCK_MONOTONIC milliseconds in 64 bits (no wrap), plus
 * an offset that only tests set (_set_clock_offset_ns: a lease or a watch runs
 * out without waiting). Stamps of 0 mean none. */
static int64_t clock_offset_ns;

uint64_t nvt_now_ms(void) {
    return ((uint64_t)((int64_t)now_mono_ns() + clock_offset_ns)) / 1000000ULL + 1;
}

/* Wall-clock time (CLOCK_REALTIME ns) of record stamps, plus an offset that
 * only tests set (_set_wall_clock_offset_ns: a chunk ages without waiting,
 * or the clock steps back). */
static int64_t wall_offset_ns;

/* Atomic: an engine's worker writes records too (nvt_job_worker.c). */
uint64_t nvt_wall_ns(void) {
    return (uint64_t)((int64_t)now_wall_ns() + __atomic_load_n(&wall_offset_ns, __ATOMIC_RELAXED));
}

void nvt_set_wall_offset_ns(int64_t ns) { __atomic_store_n(&wall_offset_ns, ns, __ATOMIC_RELAXED); }

/* Whether a chunk stored at `stored_ns` (wall clock) is past `retention_ns`
 * at `now_ns` (0: no retention). The wall clock can step: a stamp ahead of
 * now by more than the retention (or NVT_CLOCK_HORIZON_MS) was made by a
 * clock we cannot compare with, so its age is unknown and it counts as
 * expired (a miss is always safe); a smaller step back lets a chunk live at
 * most that much longer, a step forward only expires chunks early. */
int nvt_stamp_expired(uint64_t stored_ns, uint64_t now_ns, uint64_t retention_ns) {
    if (!retention_ns)
        return 0;
    if (stored_ns > now_ns) {
        uint64_t bound = NVT_CLOCK_HORIZON_MS * 1000000ULL;
        return stored_ns - now_ns > (retention_ns < bound ? retention_ns : bound);
    }
    return now_ns - stored_ns > retention_ns;
}

/* Whether READY/BAD `slot`'s record is past this process's retention. */
int nvt_expired_locked(nvt_core *t, uint64_t slot, uint64_t now_ns) {
    return t->retention_ns && nvt_stamp_expired(record_stored_ns(t, slot), now_ns, t->retention_ns);
}

int nvt_record_has_key(nvt_core *t, uint64_t slot, const char *key, size_t n) {
    const unsigned char *r = record(t, slot);
    uint32_t magic;
    memcpy(&magic, r, 4);
    return n <= REC_KEY_MAX && magic == REC_MAGIC && r[4] == REC_STATE_VALID && r[5] == (unsigned char)n &&
           memcmp(r + REC_KEY_OFFSET, key, (size_t)n) == 0;
}

void nvt_write_record(nvt_core *t, uint64_t slot, const char *key, uint8_t key_len,
                         uint64_t payload) {
    unsigned char body[REC_BYTES];
    memset(body, 0, sizeof(body));
    uint32_t magic = REC_MAGIC, slot32 = (uint32_t)slot;
    uint64_t stored = nvt_wall_ns();
    memcpy(body, &magic, 4);
    body[4] = REC_STATE_VALID;
    body[5] = key_len;
    memcpy(body + 8, &payload, 8);
    memcpy(body + 16, &stored, 8);
    memcpy(body + 28, &slot32, 4);
    memcpy(body + REC_KEY_OFFSET, key, key_len);
    uint64_t sum = nvt_xxh3(body, REC_BODY_BYTES, slot);
    memcpy(body + REC_BODY_BYTES, &sum, 8);
    memcpy(record(t, slot), body, REC_BYTES);
}

/* The OFD lock request for registry entry `index` (its byte of the lock file). */
static struct flock registry_flock(int index, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = NVT_REGISTRY_LOCK_BASE + index;
    fl.l_len = 1;
    return fl;
}

/* Whether the sharer that claimed a WRITING slot is still attached. */
int nvt_owner_alive(nvt_core *t, uint8_t owner, uint16_t inc) {
    if (t->me >= 0 && owner == (uint8_t)t->me && inc == (uint16_t)t->my_inc)
        return 1;
    nvt_sharer *s = &sharers(t->base)[owner];
    if ((uint16_t)__atomic_load_n(&s->incarnation, __ATOMIC_ACQUIRE) != inc)
        return 0; /* the entry was claimed again: the old owner detached or died */
    if (t->lock_fd < 0)
        return 1;
    struct flock fl = registry_flock(owner, F_WRLCK);
    if (fcntl(t->lock_fd, F_OFD_GETLK, &fl) != 0)
        return 1; /* cannot tell: assume alive (the slot stays busy, never wrong) */
    return fl.l_type != F_UNLCK;
}

/* Whether the sharer that claimed a WRITING slot was seen dying (its OFD
 * lock, which outlives its threads' I/O, is then rechecked at every look). */
static int owner_dying(nvt_core *t, uint8_t owner, uint16_t inc) {
    for (uint32_t i = 0; i < t->n_dying && i < N_DYING; i++)
        if (t->dying[i].idx == owner && t->dying[i].inc == inc)
            return 1;
    return 0;
}

/* Whether a WRITING slot claimed at `stamp` has its owner's liveness checked now. */
static inline int check_owner(nvt_core *t, uint64_t now, uint64_t stamp, uint8_t owner, uint16_t inc) {
    return age_ms(now, stamp) >= DEAD_CHECK_AGE_MS || owner_dying(t, owner, inc);
}

/* Free a slot (its record first). The set lock is held. */
void nvt_clear_slot_locked(nvt_core *t, slot_ref s, uint64_t slot) {
    zero_record(t, slot);
    if (*s.state == NVT_READY)
        t->d_ready--;
    if (*s.state != NVT_EMPTY)
        t->d_used--;
    __atomic_store_n(s.state, NVT_EMPTY, __ATOMIC_RELEASE);
    *s.tag = 0;
    *s.fp = 0;
    (*s.gen)++;
    (*s.epoch)++;
    *s.stamp = 0;
    *s.pins = 0;
    *s.owner = 0;
    *s.flags &= (uint8_t)~NVT_FLAG_PURGED;
}

/* Free the WRITING slot of a sharer that is gone (the set is held). The slot
 * stays unverified (its next loads check the payload checksum whatever
 * verify_checksums says, until one passes): a write of the dead sharer that
 * was still queued could land on it after this. */
void nvt_reclaim_dead_locked(nvt_core *t, slot_ref s, uint64_t slot) {
    nvt_clear_slot_locked(t, s, slot);
    *s.flags |= NVT_FLAG_UNVERIFIED;
}

/* Reclaim WRITING slots of dead sharers in one set (held). */
int nvt_repair_set_locked(nvt_core *t, uint64_t set, uint64_t min_age_ms, uint64_t now) {
    int n = 0;
    for (uint32_t w = 0; w < t->ways; w++) {
        slot_ref s = slot_at(t, set, w);
        if (*s.state == NVT_WRITING && (age_ms(now, *s.stamp) >= min_age_ms || owner_dying(t, *s.owner, *s.owner_inc)) &&
            !nvt_owner_alive(t, *s.owner, *s.owner_inc)) {
            nvt_reclaim_dead_locked(t, s, set * t->ways + w);
            n++;
        }
    }
    t->c.dead_reclaimed += (unsigned long long)n;
    return n;
}

/* Whether `set` is marked stalled (its last wait timed out) and still is. */
static int set_stalled(nvt_core *t, uint64_t set, uint64_t now, int *slot) {
    *slot = -1;
    for (int i = 0; i < N_STALLED; i++) {
        if (t->stalled[i].until_ms && t->stalled[i].set == set) {
            *slot = i;
            return now < t->stalled[i].until_ms;
        }
    }
    return 0;
}

static void mark_stalled(nvt_core *t, uint64_t set, uint64_t now, int slot) {
    if (slot < 0) { /* a free entry, else the one that ends first */
        slot = 0;
        for (int i = 0; i < N_STALLED; i++) {
            if (!t->stalled[i].until_ms) {
                slot = i;
                break;
            }
            if (t->stalled[i].until_ms < t->stalled[slot].until_ms)
                slot = i;
        }
    }
    t->stalled[slot].set = set;
    t->stalled[slot].until_ms = now + SET_STALL_MS;
}

/* ThreadSanitizer (gcc 12's, at least) does not intercept
 * pthread_mutex_clocklock: an acquisition through it is invisible to TSan,
 * which then reports the holder's writes as races and its unlock as one of an
 * unlocked mutex (an engine's worker holding a set the scheduler thread waits
 * for, nvt_job_worker.c). Sanitized builds wait with the intercepted
 * pthread_mutex_timedlock on CLOCK_REALTIME instead; others are unchanged. */
#if defined(__SANITIZE_THREAD__)
#define NVT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define NVT_TSAN 1
#endif
#endif

/* Take a set's mutex within the bound: 0 or EOWNERDEAD (held), or -1
 * (counted; nothing held). The first try never waits; a contended mutex is
 * waited for SET_LOCK_WAIT_MS at most with the GIL released, and a set whose
 * wait timed out is only tried (no wait) for SET_STALL_MS, so a stopped
 * holder costs each call one wait per set it holds (a sharer holds one set
 * at a time), not one per key. */
static int lock_bounded(nvt_core *t, uint64_t set) {
    nvt_set_head *h = set_head(t->base, t->set_bytes, set);
    int r = pthread_mutex_trylock(&h->mu);
    if (r == EBUSY) {
        uint64_t now = nvt_now_ms();
        int st;
        if (set_stalled(t, set, now, &st)) {
            t->c.set_lock_timeouts++;
            return -1;
        }
        struct timespec until;
#ifdef NVT_TSAN
        clock_gettime(CLOCK_REALTIME, &until);
#else
        clock_gettime(CLOCK_MONOTONIC, &until);
#endif
        until.tv_nsec += (long)SET_LOCK_WAIT_MS * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        t->waiting = 1;
        void *gil = t->unblock ? t->unblock() : NULL;
#ifdef NVT_TSAN
        r = pthread_mutex_timedlock(&h->mu, &until);
#else
        r = pthread_mutex_clocklock(&h->mu, CLOCK_MONOTONIC, &until);
#endif
        if (t->reblock)
            t->reblock(gil);
        t->waiting = 0;
        if (r == ETIMEDOUT) {
            mark_stalled(t, set, now, st);
            t->c.set_lock_timeouts++;
            return -1;
        }
        if (st >= 0 && (r == 0 || r == EOWNERDEAD))
            t->stalled[st].until_ms = 0; /* taken again: no longer stalled */
    }
    return r == 0 || r == EOWNERDEAD ? r : -1; /* ENOTRECOVERABLE: never held */
}

/* Whether the set (held) has a WRITING slot of sharer (idx, inc). */
static int set_has_writing_of(nvt_core *t, uint64_t set, uint16_t idx, uint16_t inc) {
    for (uint32_t w = 0; w < t->ways; w++) {
        slot_ref s = slot_at(t, set, w);
        if (*s.state == NVT_WRITING && *s.owner == idx && *s.owner_inc == inc)
            return 1;
    }
    return 0;
}

/* DYING_WAIT_MS, or what a test set (nvt_set_dying_wait_ms): a loaded test
 * machine can take longer than 50 ms to run the process that closes a dying
 * sharer's lock file, so a test that proves the wait lengthens it. */
static uint32_t dying_wait_ms = DYING_WAIT_MS;

uint32_t nvt_set_dying_wait_ms(uint32_t ms) { return __atomic_exchange_n(&dying_wait_ms, ms, __ATOMIC_RELAXED); }

/* Recover a set whose holder died (EOWNERDEAD: held, inconsistent). Every
 * state the dead sharer can have left is a WRITING slot of its own (claims
 * mark the slot before touching the record): those are reclaimed once its
 * OFD lock is gone. The kernel walks a dying process's robust mutexes before
 * its other threads' I/O has drained and its files are closed, so that lock
 * is often still held here: the dead sharer (named by the holder fields,
 * unless it died between taking the mutex and writing them) is remembered as
 * dying, and the set's mutex released while its lock is awaited for
 * DYING_WAIT_MS at most, then the set is repaired again. Returns 0 with the
 * set held, or -1 (nothing held). */
static int recover_named(nvt_core *t, uint64_t set, uint16_t holder, uint16_t holder_inc) {
    nvt_set_head *h = set_head(t->base, t->set_bytes, set);
    int named = holder && holder - 1 < NVT_MAX_SHARERS &&
                !(t->me >= 0 && holder - 1 == t->me && holder_inc == (uint16_t)t->my_inc);
    if (named && !owner_dying(t, (uint8_t)(holder - 1), holder_inc)) {
        t->dying[t->n_dying % N_DYING].idx = (uint16_t)(holder - 1);
        t->dying[t->n_dying % N_DYING].inc = holder_inc;
        t->n_dying++;
    }
    nvt_repair_set_locked(t, set, 0, nvt_now_ms());
    pthread_mutex_consistent(&h->mu);
    t->c.lock_recoveries++;
    if (!named || !set_has_writing_of(t, set, (uint16_t)(holder - 1), holder_inc))
        return 0;
    h->holder = 0;
    pthread_mutex_unlock(&h->mu);
    uint64_t until = now_mono_ns() + (uint64_t)__atomic_load_n(&dying_wait_ms, __ATOMIC_RELAXED) * 1000000ULL;
    t->waiting = 1;
        void *gil = t->unblock ? t->unblock() : NULL;
    while (nvt_owner_alive(t, (uint8_t)(holder - 1), holder_inc) && now_mono_ns() < until) {
        struct timespec d = {0, 500000L};
        nanosleep(&d, NULL);
    }
    if (t->reblock)
        t->reblock(gil);
    t->waiting = 0;
    int r = lock_bounded(t, set);
    if (r < 0)
        return -1;
    if (r == EOWNERDEAD) { /* another death meanwhile: no second wait */
        pthread_mutex_consistent(&h->mu);
        t->c.lock_recoveries++;
    }
    nvt_repair_set_locked(t, set, 0, nvt_now_ms());
    return 0;
}

static int recover_set(nvt_core *t, uint64_t set) {
    nvt_set_head *h = set_head(t->base, t->set_bytes, set);
    return recover_named(t, set, h->holder, h->holder_inc);
}

/* The set (just locked) names this process as its holder. */
static void mark_holder(nvt_core *t, uint64_t set) {
    nvt_set_head *h = set_head(t->base, t->set_bytes, set);
    h->holder = (uint16_t)(t->me >= 0 ? t->me + 1 : 0);
    h->holder_inc = (uint16_t)t->my_inc;
}

/* nvt_set_lock for a set whose holder another thread of this process (an
 * engine's worker, which must not wait nor touch this core's state) found
 * dead: it took EOWNERDEAD, marked the mutex consistent and handed over the
 * holder fields it found (`holder`, `holder_inc`). The recovery that
 * EOWNERDEAD would have started here runs now (pthread_mutex_consistent on a
 * consistent mutex is a harmless EINVAL). *recovered says whether it ran
 * (the set could be locked). Returns as nvt_set_lock. */
int nvt_set_lock_after_death(nvt_core *t, uint64_t set, uint16_t holder, uint16_t holder_inc, int *recovered) {
    int r = lock_bounded(t, set);
    *recovered = r == 0 || r == EOWNERDEAD;
    if (r == EOWNERDEAD)
        r = recover_set(t, set); /* another death since */
    else if (r == 0)
        r = recover_named(t, set, holder, holder_inc);
    if (r != 0)
        return -1;
    mark_holder(t, set);
    return 0;
}

/* Lock a set's mutex (lock_bounded; a dead holder's set is recovered).
 * Returns 0 with the set held, or -1 when it could not be taken within the
 * bound (nothing held): the caller turns the key into a miss, a dropped
 * store, or a completion retried later. */
int nvt_set_lock(nvt_core *t, uint64_t set) {
    int r = lock_bounded(t, set);
    if (r == EOWNERDEAD)
        r = recover_set(t, set);
    if (r != 0)
        return -1;
    mark_holder(t, set);
    return 0;
}

static int init_mutex(pthread_mutex_t *mu) {
    pthread_mutexattr_t a;
    if (pthread_mutexattr_init(&a))
        return -1;
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int r = pthread_mutex_init(mu, &a);
    pthread_mutexattr_destroy(&a);
    return r ? -1 : 0;
}

/* nvt_find_way's check of way `w`, whose tag may match: the way, or -1. */
static int check_way(nvt_core *t, uint64_t set, uint32_t w, uint64_t fp, const char *key, size_t n,
                     unsigned mask) {
    slot_ref s = slot_at(t, set, w);
    if (*s.fp != fp || !((1u << *s.state) & mask))
        return -1;
    if (*s.state == NVT_READY && !nvt_record_has_key(t, set * t->ways + w, key, n))
        return -1; /* a fingerprint collision: another key */
    if (t->retention_ns && *s.state == NVT_READY && nvt_expired_locked(t, set * t->ways + w, nvt_wall_ns())) {
        /* Past retention: never served. Freed at once unless a lease (a
         * lookup hit of an earlier step) still covers it; the caller's
         * claim then finds it evicted first. */
        t->c.retention_expired++;
        if (!leased_locked(s, nvt_now_ms())) {
            if (t->on_expired)
                t->on_expired(t->expired_ctx, record(t, set * t->ways + w));
            nvt_clear_slot_locked(t, s, set * t->ways + w);
        }
        return -1;
    }
    return (int)w;
}

/* Way of `fp`/key in `set` in one of the states of `mask`, or -1: the tags
 * filter, the fingerprint and (READY) the record's key confirm. */
int nvt_find_way(nvt_core *t, uint64_t set, uint64_t fp, const char *key, size_t n,
                    unsigned mask) {
    nvt_tag_iter it = tag_iter(set_tags(t, set), t->ways, tag_of(fp));
    for (int w; (w = tag_next(&it)) >= 0;) {
        int r = check_way(t, set, (uint32_t)w, fp, key, n, mask);
        if (r >= 0)
            return r;
    }
    return -1;
}

/* Choose the way to write `fp` into (the set is locked). Returns the way, or
 * -1 when every way is being written or leased, or -2 when the key is already
 * present or being written. *evict is set when a READY/BAD key is displaced. */
int nvt_claim_way(nvt_core *t, uint64_t set, uint64_t fp, const char *k, size_t n,
                     uint64_t now, int *evict) {
    const uint8_t *tags = set_tags(t, set), *states = set_states(t, set), tag = tag_of(fp);
    int empty = -1;
    *evict = 0;
    /* This key in any state (tags filter, eight ways at a time), then the
     * first empty way (an EMPTY way's tag is 0: never this key's). */
    nvt_tag_iter it = tag_iter(tags, t->ways, tag);
    for (int w; (w = tag_next(&it)) >= 0;) {
        slot_ref s = slot_at(t, set, (uint32_t)w);
        uint8_t st = *s.state;
        if (st == NVT_EMPTY || *s.fp != fp)
            continue;
        if (st == NVT_WRITING)
            return -3 - w; /* another store of this key is in flight (any sharer) */
        if (st == NVT_READY && nvt_record_has_key(t, set * t->ways + (uint64_t)w, k, n)) {
            if (!nvt_expired_locked(t, set * t->ways + (uint64_t)w, nvt_wall_ns()))
                return -2;
            if (!leased_locked(s, now)) /* past retention: stored again, in place */
                return w;
            continue;
        }
        if (st == NVT_BAD) /* a failed load left it: rewrite in place */
            return w;
    }
    /* The lowest flagged byte of a zero test is exact (a false flag only
     * ever sits above a true zero); the padding past `ways` is zero too. */
    for (uint32_t base = 0; base < t->ways && empty < 0; base += 8) {
        uint64_t z = tag_word_matches(tag_word(states, base), NVT_EMPTY);
        if (z && base + tag_way(z) < t->ways)
            empty = (int)(base + tag_way(z));
    }
    if (empty >= 0)
        return empty;
    /* A full set: the least recently used way no lease protects, BAD first;
     * WRITING ways of sharers that died are reclaimed on the way. */
    const uint32_t clock = set_head(t->base, t->set_bytes, set)->clock;
    const uint64_t wall = t->retention_ns ? nvt_wall_ns() : 0;
    int victim = -1, victim_bad = 0;
    uint32_t victim_age = 0;
    for (uint32_t w = 0; w < t->ways; w++) {
        slot_ref s = slot_at(t, set, w);
        uint8_t st = states[w];
        if (st == NVT_WRITING) {
            if (check_owner(t, now, *s.stamp, *s.owner, *s.owner_inc) && !nvt_owner_alive(t, *s.owner, *s.owner_inc)) {
                nvt_reclaim_dead_locked(t, s, set * t->ways + w);
                t->c.dead_reclaimed++;
                return (int)w;
            }
            continue;
        }
        if (st == NVT_EMPTY)
            return (int)w;
        if (leased_locked(s, now))
            continue; /* a lookup hit or a load in flight */
        /* BAD ways and ways past retention go first (one record read per
         * way, only with a retention set), then the least recently used. */
        int bad = st == NVT_BAD || (wall && nvt_expired_locked(t, set * t->ways + w, wall));
        uint32_t age = clock - *s.last;
        if (victim < 0 || bad > victim_bad || (bad == victim_bad && age > victim_age)) {
            victim = (int)w;
            victim_bad = bad;
            victim_age = age;
        }
    }
    if (victim >= 0)
        *evict = 1;
    return victim;
}

/* Purge one set (held): every READY or BAD slot stored `older_than_ns` ago
 * or longer (wall clock), or every one when `all`, is cleared (record first) whether
 * or not a lease covers it: a load in flight then fails by its generation,
 * like a load that raced an eviction, and the bytes it read are never
 * reported. `removed` gets each cleared record first (may be NULL). With
 * `all`, a WRITING slot is marked PURGED: its write completes but is never
 * published (it may hold KV computed before the purge); without, a write in
 * flight is newer than any cutoff and is left. `empty` (may be NULL) gets
 * every EMPTY slot's number without `all`: a chunk invalidated, evicted or
 * expired before the purge left its sealed image there. */
void nvt_purge_set_locked(nvt_core *t, uint64_t set, uint64_t older_than_ns, int all, nvt_purge_counts *n,
                          void (*removed)(void *ctx, const unsigned char *rec),
                          void (*empty)(void *ctx, uint64_t slot), void *ctx) {
    const uint64_t now = nvt_wall_ns();
    for (uint32_t w = 0; w < t->ways; w++) {
        slot_ref s = slot_at(t, set, w);
        uint64_t slot = set * t->ways + w;
        uint8_t st = *s.state;
        if (st == NVT_WRITING) {
            if (all) {
                *s.flags |= NVT_FLAG_PURGED;
                n->writing_marked++;
            } else {
                n->writing_skipped++;
            }
            continue;
        }
        if (st == NVT_EMPTY && empty && !all)
            empty(ctx, slot); /* a chunk that left before (invalidated, evicted, expired) */
        if (st != NVT_READY && st != NVT_BAD)
            continue;
        uint64_t at = record_stored_ns(t, slot);
        if (!all && at <= now + NVT_CLOCK_HORIZON_MS * 1000000ULL && (at > now || now - at < older_than_ns))
            continue; /* newer than the cutoff (a stamp far in the future has no known age: purged) */
        if (removed)
            removed(ctx, record(t, slot));
        nvt_clear_slot_locked(t, s, slot);
        n->cleared++;
    }
}

uint64_t nvt_table_bytes(uint64_t n_slots, uint32_t ways) {
    return NVT_TABLE_HEADER_BYTES + (n_slots / ways) * (uint64_t)nvt_layout(ways).set_bytes;
}

/* Whether a geometry is one this table can index: ways from 1 to
 * NVT_MAX_WAYS, n_slots a positive multiple of ways below 2^32 (slot numbers
 * are 32-bit). NULL when it is, else why not. */
const char *nvt_bad_geometry(uint64_t n_slots, uint64_t ways) {
    if (ways < 1 || ways > NVT_MAX_WAYS)
        return "ways must be from 1 to 4096";
    if (n_slots == 0 || n_slots % ways)
        return "n_slots must be a positive multiple of ways";
    if (n_slots >= NVT_MAX_SLOTS)
        return "n_slots must be below 2^32 (slot numbers are 32-bit): use larger chunks or less capacity";
    return NULL;
}

/* Check every header field against this version and the mapping's size
 * before any of them is used as an index. NULL when valid, else why not. */
const char *nvt_bad_header(const nvt_table_header *h, uint64_t len) {
    if (len < NVT_TABLE_HEADER_BYTES)
        return "the table is shorter than its header";
    if (h->magic != NVT_TABLE_MAGIC || h->version != NVT_TABLE_VERSION)
        return "the table is not formatted by this version (magic or version)";
    if (h->header_bytes != NVT_TABLE_HEADER_BYTES || h->max_sharers != NVT_MAX_SHARERS)
        return "the table header's size or registry size is not this version's";
    const char *why = nvt_bad_geometry(h->n_slots, h->ways);
    if (why)
        return why;
    if (h->n_sets != h->n_slots / h->ways)
        return "the table header's n_sets is not n_slots / ways";
    if (h->set_bytes != nvt_layout(h->ways).set_bytes)
        return "the table header's set size is not this version's layout";
    if (len < nvt_table_bytes(h->n_slots, h->ways))
        return "the table is shorter than its header's geometry";
    return NULL;
}

void nvt_set_clock_offset_ns(int64_t ns) { clock_offset_ns = ns; }

/* Reclaim a WRITING slot whose writer is gone (checked once it is old
 * enough, or its writer was seen dying). Returns 1 when reclaimed. */
int nvt_reclaim_if_dead_locked(nvt_core *t, slot_ref s, uint64_t slot, uint64_t now) {
    if (*s.state != NVT_WRITING || !check_owner(t, now, *s.stamp, *s.owner, *s.owner_inc) ||
        nvt_owner_alive(t, *s.owner, *s.owner_inc))
        return 0;
    nvt_reclaim_dead_locked(t, s, slot);
    t->c.dead_reclaimed++;
    return 1;
}

/* Set up `t` over a table and an index mapping: every header field is
 * checked (nvt_bad_header) and only the checked copies are used. NULL, or why
 * the table cannot be used. */
const char *nvt_core_init(nvt_core *t, char *table, uint64_t table_len, char *index, uint64_t index_len,
                          int lock_fd) {
    memset(t, 0, sizeof(*t));
    t->me = -1;
    nvt_table_header h;
    memset(&h, 0, sizeof(h));
    if (table_len >= sizeof(h))
        memcpy(&h, table, sizeof(h));
    const char *why = nvt_bad_header(&h, table_len);
    if (why)
        return why;
    if (index_len / REC_BYTES < h.n_slots)
        return "the index is shorter than the table's slots";
    t->base = table;
    t->index = index;
    t->hdr = (nvt_table_header *)table;
    t->n_slots = h.n_slots;
    t->ways = h.ways;
    t->n_sets = h.n_sets;
    t->set_bytes = h.set_bytes;
    t->layout = nvt_layout(t->ways);
    t->lock_fd = lock_fd;
    return NULL;
}

static int registry_lock(int fd, int index, short type) {
    struct flock fl = registry_flock(index, type);
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* Claim a free entry of the sharer registry: an OFD write lock on its byte
 * of the lock file (dropped by the kernel when this process dies), then pid,
 * incarnation and time. Returns the index, or -errno (-EUSERS: all taken). */
int nvt_attach(nvt_core *t) {
    if (t->me >= 0)
        return t->me;
    for (int i = 0; i < NVT_MAX_SHARERS; i++) {
        if (registry_lock(t->lock_fd, i, F_WRLCK) != 0) {
            if (errno == EAGAIN || errno == EACCES)
                continue;
            return -errno;
        }
        nvt_sharer *s = &sharers(t->base)[i];
        uint32_t inc = s->incarnation + 1;
        if ((inc & 0xffff) == 0)
            inc++;
        s->pid = (uint32_t)getpid();
        s->attached_ns = now_wall_ns();
        __atomic_store_n(&s->incarnation, inc, __ATOMIC_RELEASE);
        t->me = i;
        t->my_inc = inc;
        return i;
    }
    return -EUSERS;
}

/* Leave the sharer registry (pid cleared, OFD lock released). */
void nvt_detach(nvt_core *t) {
    if (t->me < 0)
        return;
    sharers(t->base)[t->me].pid = 0;
    registry_lock(t->lock_fd, t->me, F_UNLCK);
    t->me = -1;
}

/* Whether registry entry `index` is held by a live process (an open file
 * description other than lock_fd's). */
int nvt_sharer_live(int lock_fd, int index) {
    struct flock fl = registry_flock(index, F_WRLCK);
    return fcntl(lock_fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

/* Reclaim the WRITING slots of sharers that are gone, in every set, and
 * recount the used/ready gauges. Returns the slots reclaimed. */
int64_t nvt_sweep(nvt_core *t) {
    uint64_t now = nvt_now_ms();
    int64_t used = 0, ready = 0, reclaimed = 0;
    for (uint64_t set = 0; set < t->n_sets; set++) {
        if (nvt_set_lock(t, set) != 0)
            continue;
        reclaimed += nvt_repair_set_locked(t, set, 0, now);
        const uint8_t *states = set_states(t, set);
        for (uint32_t w = 0; w < t->ways; w++) {
            used += states[w] != NVT_EMPTY;
            ready += states[w] == NVT_READY;
        }
        set_unlock(t, set);
    }
    t->d_used = t->d_ready = 0; /* counted afresh */
    __atomic_store_n(&t->hdr->used, used, __ATOMIC_RELAXED);
    __atomic_store_n(&t->hdr->ready, ready, __ATOMIC_RELAXED);
    return reclaimed;
}

/* Rebuild: mark READY every slot of `slots` whose record the caller proved
 * valid (in recency order, oldest first); UNVERIFIED when the store was not
 * closed cleanly. Only while no other sharer is attached. */
void nvt_rebuild(nvt_core *t, const int64_t *slots, size_t n, int unverified) {
    for (size_t i = 0; i < n; i++) {
        if (slots[i] < 0 || (uint64_t)slots[i] >= t->n_slots)
            continue;
        uint64_t slot = (uint64_t)slots[i];
        const unsigned char *r = record(t, slot);
        uint8_t kl = r[5] <= REC_KEY_MAX ? r[5] : REC_KEY_MAX;
        slot_ref s = slot_at(t, slot / t->ways, (uint32_t)(slot % t->ways));
        if ((*s.state) == NVT_EMPTY)
            t->hdr->used++;
        if ((*s.state) != NVT_READY)
            t->hdr->ready++;
        (*s.fp) = nvt_xxh3(r + REC_KEY_OFFSET, kl, 0);
        (*s.tag) = tag_of(*s.fp);
        (*s.last) = tick(t, slot / t->ways);
        (*s.stamp) = 0;
        (*s.pins) = 0;
        (*s.owner) = 0;
        (*s.flags) = unverified ? NVT_FLAG_UNVERIFIED : 0;
        (*s.gen)++;
        (*s.state) = NVT_READY;
    }
}

/* Zero the table, initialize every set's mutex and write the header (the
 * first process to attach, before nvt_rebuild; only while no other process
 * is attached). NULL, or why not. */
const char *nvt_format(char *base, uint64_t len, uint64_t n_slots, uint32_t ways) {
    const char *why = nvt_bad_geometry(n_slots, ways);
    if (why)
        return why;
    if (len < nvt_table_bytes(n_slots, ways))
        return "the table buffer is too small for n_slots and ways";
    nvt_table_header *h = (nvt_table_header *)base;
    uint32_t set_bytes = nvt_layout(ways).set_bytes;
    uint64_t n_sets = n_slots / ways;
    memset(base, 0, nvt_table_bytes(n_slots, ways));
    for (uint64_t s = 0; s < n_sets; s++)
        if (init_mutex(&set_head(base, set_bytes, s)->mu))
            return "pthread_mutex_init failed for a process-shared robust mutex";
    h->magic = NVT_TABLE_MAGIC;
    h->version = NVT_TABLE_VERSION;
    h->header_bytes = NVT_TABLE_HEADER_BYTES;
    h->n_slots = n_slots;
    h->ways = ways;
    h->set_bytes = set_bytes;
    h->n_sets = n_sets;
    h->max_sharers = NVT_MAX_SHARERS;
    return NULL;
}
