/*
 * nvt_core: the rules of the process-shared slot table (nvt_layout.h has the
 * layout), with no Python in them: a process's view of one table (nvt_core),
 * set locks with their bounds and dead-holder recovery, the ways of a set
 * (find, claim, evict, clear, reclaim), leases, index records, the sharer
 * registry, the rebuild and the sweep. nvt_jobs.h is the job path over it
 * and nvt_table_type.h the CPython type; the core could be driven from C alone.
 *
 * Threads: one thread per nvt_core at a time (the caller's). A wait for a
 * set mutex held by another process calls unblock() before and reblock()
 * after (the binding releases the GIL there); nothing else waits.
 */
#ifndef NVT_CORE_H
#define NVT_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "nvt_layout.h"

/* Index record layout (format.py; changing it requires bumping FORMAT_VERSION). */
#define REC_BYTES 128
#define REC_BODY_BYTES 120
#define REC_MAGIC 0x5254564Eu
#define REC_KEY_OFFSET 32
#define REC_KEY_MAX 88
#define REC_STATE_VALID 1
/* A WRITING slot older than this has its owner's liveness checked. */
#define DEAD_CHECK_AGE_MS 200u
/* The longest one wait for a set mutex held by another process (a holder
 * holds it for nanoseconds unless it is stopped, or preempted on a busy
 * machine), and how long a set whose wait timed out is then only tried. */
#define SET_LOCK_WAIT_MS 20u
#define SET_STALL_MS 1000u
#define N_STALLED 8
/* Sharers this process saw die (EOWNERDEAD named them), remembered: their
 * WRITING slots are rechecked at every look, not only after
 * DEAD_CHECK_AGE_MS. And how long the locker that saw the death waits (the
 * set's mutex released, the GIL too) for the dead sharer's OFD lock to go. */
#define N_DYING 16
#define DYING_WAIT_MS 50u

typedef struct {
    unsigned long long hits, misses, evictions, checksum_failures, read_errors, write_errors,
        loads_raced, stores_skipped_present, stores_dropped_set_busy, stores_dropped_queue_full,
        load_keys_missing, ops_written, ops_read, bytes_written, bytes_read, dead_reclaimed,
        lock_recoveries, load_jobs_failed, store_jobs_failed, loads_cancelled, stores_dropped_watch_timeout,
        stores_dropped_watch_failed, set_lock_timeouts, completions_deferred, loads_verified_unverified,
        completions_abandoned, retention_expired, stores_purged, auth_failures, stores_skipped_no_epoch,
        loads_key_destroyed, load_leases_taken;
} nvt_counters;

/* A process's view of one table: the mappings and geometry (checked by
 * nvt_bad_header before use), its registry entry, its counters, and the
 * state of its bounded waits. */
typedef struct nvt_core {
    char *base;  /* table mapping */
    char *index; /* index record mapping */
    nvt_table_header *hdr;
    uint64_t n_slots, n_sets;
    uint32_t ways, set_bytes;
    nvt_set_layout layout;
    int lock_fd;
    int me; /* registry index, -1 before attach */
    uint32_t my_inc;
    uint32_t lease_ms;
    uint64_t watch_timeout_ms;
    /* Sets whose mutex wait timed out: only tried until `until_ms`. */
    struct nvt_stalled {
        uint64_t set, until_ms;
    } stalled[N_STALLED];
    /* Sharers seen dying by EOWNERDEAD (registry index, incarnation), whose
     * OFD lock the kernel may not have released yet. */
    struct nvt_dying {
        uint16_t idx, inc;
    } dying[N_DYING];
    uint32_t n_dying;
    nvt_counters c;
    /* Changes to the header's used/ready gauges not yet published: added with
     * one atomic each per call (publish_counts), not one per op. */
    int64_t d_used, d_ready;
    /* Retention (0: off): a READY slot whose record was stored longer ago
     * than this (wall clock) is never found, and is evicted first. */
    uint64_t retention_ns;
    /* Called (the set locked) with the record of a READY slot cleared because
     * its retention passed, before the record is zeroed (may be NULL): the
     * caller's KV removal event. */
    void (*on_expired)(void *ctx, const unsigned char *rec);
    void *expired_ctx;
    /* Called around a bounded wait for another process (may be NULL). */
    void *(*unblock)(void);
    void (*reblock)(void *);
    /* Set while a call waits with unblock() in effect (the GIL released): the
     * core is mid-operation, and a caller must not enter it from another
     * thread until reblock() (the CPython type refuses such calls). */
    int waiting;
} nvt_core;

static inline uint64_t now_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static inline uint64_t now_wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static inline nvt_set_head *set_head(char *base, uint32_t set_bytes, uint64_t set) {
    return (nvt_set_head *)(base + NVT_TABLE_HEADER_BYTES + set * (uint64_t)set_bytes);
}

/* The fields of one way, as pointers into its set's arrays (nvt_layout.h). */
typedef struct {
    uint8_t *tag, *state, *owner, *flags;
    uint16_t *owner_inc, *pins;
    uint32_t *last, *gen, *epoch;
    uint64_t *stamp, *fp;
} slot_ref;

static inline slot_ref slot_at(nvt_core *t, uint64_t set, uint32_t w) {
    char *b = (char *)set_head(t->base, t->set_bytes, set);
    const nvt_set_layout *L = &t->layout;
    slot_ref r = {
        (uint8_t *)(b + L->tag) + w,        (uint8_t *)(b + L->state) + w, (uint8_t *)(b + L->owner) + w,
        (uint8_t *)(b + L->flags) + w,      (uint16_t *)(b + L->owner_inc) + w, (uint16_t *)(b + L->pins) + w, (uint32_t *)(b + L->last) + w,
        (uint32_t *)(b + L->gen) + w,       (uint32_t *)(b + L->epoch) + w, (uint64_t *)(b + L->stamp) + w,
        (uint64_t *)(b + L->fp) + w,
    };
    return r;
}

/* Start loading the cache lines of `set` that a claim or lookup reads first:
 * its head (the mutex), tags and states, and when `scan` the recency and
 * lease stamps a full set's eviction reads. A job's keys land in random sets
 * and a poll's completions in random slots, so the data path walks them
 * twice: a first pass that only computes where each goes and prefetches, so
 * that the misses of a whole job overlap instead of following each other. */
static inline void prefetch_set(nvt_core *t, uint64_t set, int scan) {
    const char *b = (const char *)set_head(t->base, t->set_bytes, set);
    const nvt_set_layout *L = &t->layout;
    __builtin_prefetch(b, 1);
    __builtin_prefetch(b + L->tag, 1);
    __builtin_prefetch(b + L->state, 1);
    if (scan) {
        for (uint32_t off = 0; off < 4 * t->ways; off += 64)
            __builtin_prefetch(b + L->last + off, 1);
        for (uint32_t off = 0; off < 8 * t->ways; off += 64)
            __builtin_prefetch(b + L->stamp + off, 1);
        for (uint32_t off = 0; off < 2 * t->ways; off += 64)
            __builtin_prefetch(b + L->pins + off, 1);
    }
}

/* How many keys ahead of the one being applied a job prefetches. */
#define PREFETCH_AHEAD 8

static inline uint8_t *set_tags(nvt_core *t, uint64_t set) {
    return (uint8_t *)set_head(t->base, t->set_bytes, set) + t->layout.tag;
}

static inline uint8_t *set_states(nvt_core *t, uint64_t set) {
    return (uint8_t *)set_head(t->base, t->set_bytes, set) + t->layout.state;
}

/* Milliseconds since `stamp` (0 when the stamp is in the future). */
/* CLOCK_MONOTONIC is one clock for every process of a machine, except across
 * time namespaces (containers may offset it). A stamp further than this
 * ahead of our now was not made by our clock: treat it as long past rather
 * than trust it (a sharer whose clock runs days ahead must not pin slots, nor
 * hide its dead claims, for days). Also the longest lease a Table grants. */
#define NVT_CLOCK_HORIZON_MS (3600ULL * 1000ULL)

static inline uint64_t age_ms(uint64_t now, uint64_t stamp) {
    if (stamp > now)
        return stamp - now > NVT_CLOCK_HORIZON_MS ? UINT64_MAX : 0;
    return now - stamp;
}

/* A lease whose end passed is zeroed where it is seen (the set is locked):
 * its grants' late releases then name an old epoch and take no pin. */
static inline void lease_expire_locked(slot_ref s, uint64_t now) {
    if (*s.pins && (*s.stamp <= now || *s.stamp - now > NVT_CLOCK_HORIZON_MS)) {
        *s.pins = 0;
        *s.stamp = 0;
        (*s.epoch)++;
    }
}

/* Whether a READY/BAD slot is leased (the set is locked). */
static inline int leased_locked(slot_ref s, uint64_t now) {
    lease_expire_locked(s, now);
    return *s.pins != 0;
}

/* Grant a lease ending at `until` or later (the set is locked): one pin of
 * its own, released by lease_release with the returned epoch. Returns 0 when
 * the pin count is full (the lease then only runs out: nothing to release). */
static inline int lease_grant(slot_ref s, uint64_t now, uint64_t until, uint32_t *epoch) {
    lease_expire_locked(s, now);
    if (*s.stamp < until)
        *s.stamp = until;
    *epoch = *s.epoch;
    if (*s.pins == UINT16_MAX)
        return 0;
    (*s.pins)++;
    return 1;
}

/* Release one grant of (gen, epoch), if the slot still carries it. */
static inline void lease_release(slot_ref s, uint32_t gen, uint32_t epoch) {
    if (*s.gen != gen || *s.epoch != epoch || !*s.pins || (*s.state != NVT_READY && *s.state != NVT_BAD))
        return;
    if (--(*s.pins) == 0)
        *s.stamp = 0;
}

static inline void publish_counts(nvt_core *t) {
    if (t->d_used) {
        __atomic_add_fetch(&t->hdr->used, t->d_used, __ATOMIC_RELAXED);
        t->d_used = 0;
    }
    if (t->d_ready) {
        __atomic_add_fetch(&t->hdr->ready, t->d_ready, __ATOMIC_RELAXED);
        t->d_ready = 0;
    }
}

static inline uint8_t tag_of(uint64_t fp) { return (uint8_t)(fp >> 56) | 1; }

/* Eight tags at a time (SWAR): the tag array is 8-byte aligned and padded
 * to a multiple of 8 bytes with zeros, which no tag (its low bit set) ever
 * equals. tag_word_matches gives the high bit of each byte of `word` that may
 * equal `tag`: every byte that does is flagged; a byte just above a true
 * match may be flagged too (the borrow of the zero test), which the caller's
 * fingerprint check rejects. tag_next walks the candidate ways of one tag
 * in ascending order:
 *   nvt_tag_iter it = tag_iter(tags, ways, tag);
 *   for (int w; (w = tag_next(&it)) >= 0;) ... */
typedef uint64_t __attribute__((may_alias)) nvt_u64_alias;
#define NVT_BYTES_LOW 0x0101010101010101ULL
#define NVT_BYTES_HIGH 0x8080808080808080ULL

static inline uint64_t tag_word(const uint8_t *tags, uint32_t base) {
    return __atomic_load_n((const nvt_u64_alias *)(tags + base), __ATOMIC_RELAXED);
}

static inline uint64_t tag_word_matches(uint64_t word, uint8_t tag) {
    uint64_t x = word ^ (NVT_BYTES_LOW * tag);
    return (x - NVT_BYTES_LOW) & ~x & NVT_BYTES_HIGH;
}

static inline uint32_t tag_way(uint64_t m) { return (uint32_t)__builtin_ctzll(m) >> 3; }

typedef struct {
    const uint8_t *tags;
    uint32_t ways, base; /* base: the first way of the word in `m` */
    uint8_t tag;
    uint64_t m; /* that word's flagged bytes not yet visited */
} nvt_tag_iter;

static inline nvt_tag_iter tag_iter(const uint8_t *tags, uint32_t ways, uint8_t tag) {
    nvt_tag_iter it = {tags, ways, 0, tag, ways ? tag_word_matches(tag_word(tags, 0), tag) : 0};
    return it;
}

/* The next way whose tag may be `tag`, or -1 when none is left (a flag in
 * the padding past `ways` ends the walk: it is in the last word). */
static inline int tag_next(nvt_tag_iter *it) {
    while (!it->m) {
        it->base += 8;
        if (it->base >= it->ways)
            return -1;
        it->m = tag_word_matches(tag_word(it->tags, it->base), it->tag);
    }
    uint32_t w = it->base + tag_way(it->m);
    it->m &= it->m - 1;
    return w < it->ways ? (int)w : -1;
}

static inline nvt_sharer *sharers(char *base) { return (nvt_sharer *)(base + NVT_SHARERS_OFFSET); }

static inline unsigned char *record(nvt_core *t, uint64_t slot) {
    return (unsigned char *)t->index + slot * REC_BYTES;
}

/* The second prefetch stage of a lookup of `fp` in `set`, once the set's
 * tags are in cache (prefetch_set a few keys earlier): the fingerprint and
 * the index record of each way whose tag matches, which nvt_find_way reads
 * next, a record being a dependent miss in another mapping. The tags are
 * read without the set lock: a hint only (a stale tag prefetches a line for
 * nothing, or misses one), never used to decide anything. */
/* What else of a matching way prefetch_ways loads: the fields the call will
 * write under the set's lock (each in a line of its own array). A lease
 * (lease_grant) reads and writes pins, stamp and epoch; a load also marks
 * the recency (last) and reads gen; a touch marks the recency only. */
enum { NVT_PF_LEASE = 1, NVT_PF_LAST = 2, NVT_PF_GEN = 4 };

static inline void prefetch_ways(nvt_core *t, uint64_t set, uint64_t fp, unsigned fields) {
    const uint8_t *tags = (const uint8_t *)set_head(t->base, t->set_bytes, set) + t->layout.tag;
    nvt_tag_iter it = tag_iter(tags, t->ways, tag_of(fp));
    for (int w; (w = tag_next(&it)) >= 0;) {
        slot_ref s = slot_at(t, set, (uint32_t)w);
        __builtin_prefetch(s.fp, 0);
        __builtin_prefetch(record(t, set * t->ways + (uint64_t)w), 0);
        if (fields & NVT_PF_LEASE) {
            __builtin_prefetch(s.pins, 1);
            __builtin_prefetch(s.stamp, 1);
            __builtin_prefetch(s.epoch, 1);
        }
        if (fields & NVT_PF_LAST)
            __builtin_prefetch(s.last, 1);
        if (fields & NVT_PF_GEN)
            __builtin_prefetch(s.gen, 0);
    }
}

static inline uint64_t record_stored_ns(nvt_core *t, uint64_t slot) {
    uint64_t v;
    memcpy(&v, record(t, slot) + 16, 8);
    return v;
}

static inline uint64_t record_payload(nvt_core *t, uint64_t slot) {
    uint64_t v;
    memcpy(&v, record(t, slot) + 8, 8);
    return v;
}

static inline void zero_record(nvt_core *t, uint64_t slot) { memset(record(t, slot), 0, REC_BYTES); }

/* The recency clock of one set (in its head line, beside the mutex; the set
 * is locked): eviction compares ways of one set only, so each set counts its
 * own accesses and no line is shared between sets or processes. */
static inline uint32_t tick(nvt_core *t, uint64_t set) {
    return ++set_head(t->base, t->set_bytes, set)->clock;
}

static inline void set_unlock(nvt_core *t, uint64_t set) {
    nvt_set_head *h = set_head(t->base, t->set_bytes, set);
    h->holder = 0;
    pthread_mutex_unlock(&h->mu);
}

/* ------------------------------------------------------------ nvt_core.c */
uint64_t nvt_now_ms(void);
void nvt_set_clock_offset_ns(int64_t ns);
uint64_t nvt_wall_ns(void);
void nvt_set_wall_offset_ns(int64_t ns);
int nvt_stamp_expired(uint64_t stored_ns, uint64_t now_ns, uint64_t retention_ns);
int nvt_expired_locked(nvt_core *t, uint64_t slot, uint64_t now_ns);
/* What nvt_purge_set_locked did in one set. */
typedef struct {
    uint64_t cleared, writing_marked, writing_skipped;
} nvt_purge_counts;
void nvt_purge_set_locked(nvt_core *t, uint64_t set, uint64_t older_than_ns, int all, nvt_purge_counts *n,
                          void (*removed)(void *ctx, const unsigned char *rec),
                          void (*empty)(void *ctx, uint64_t slot), void *ctx);
/* Tests only: the dying wait (DYING_WAIT_MS by default); returns the previous one. */
uint32_t nvt_set_dying_wait_ms(uint32_t ms);
int nvt_record_has_key(nvt_core *t, uint64_t slot, const char *key, size_t n);
void nvt_write_record(nvt_core *t, uint64_t slot, const char *key, uint8_t key_len, uint64_t payload);
int nvt_owner_alive(nvt_core *t, uint8_t owner, uint16_t inc);
void nvt_clear_slot_locked(nvt_core *t, slot_ref s, uint64_t slot);
void nvt_reclaim_dead_locked(nvt_core *t, slot_ref s, uint64_t slot);
int nvt_reclaim_if_dead_locked(nvt_core *t, slot_ref s, uint64_t slot, uint64_t now);
int nvt_repair_set_locked(nvt_core *t, uint64_t set, uint64_t min_age_ms, uint64_t now);
int nvt_set_lock(nvt_core *t, uint64_t set);
int nvt_set_lock_after_death(nvt_core *t, uint64_t set, uint16_t holder, uint16_t holder_inc, int *recovered);
int nvt_find_way(nvt_core *t, uint64_t set, uint64_t fp, const char *key, size_t n, unsigned mask);
int nvt_claim_way(nvt_core *t, uint64_t set, uint64_t fp, const char *k, size_t n, uint64_t now, int *evict);
uint64_t nvt_table_bytes(uint64_t n_slots, uint32_t ways);
const char *nvt_bad_geometry(uint64_t n_slots, uint64_t ways);
const char *nvt_bad_header(const nvt_table_header *h, uint64_t len);
const char *nvt_core_init(nvt_core *t, char *table, uint64_t table_len, char *index, uint64_t index_len,
                          int lock_fd);
int nvt_attach(nvt_core *t);
void nvt_detach(nvt_core *t);
int64_t nvt_sweep(nvt_core *t);
void nvt_rebuild(nvt_core *t, const int64_t *slots, size_t n, int unverified);
const char *nvt_format(char *table, uint64_t len, uint64_t n_slots, uint32_t ways);
int nvt_sharer_live(int lock_fd, int index);

#endif /* NVT_CORE_H */
