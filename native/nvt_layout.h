/*
 * nvt_layout: the on-disk layout of the process-shared slot table of a store
 * (nvmetier._table): byte offsets, field sizes, the header and its registry.
 * The bottom of the native include order: nvt_core (the rules) includes this
 * file, nvt_jobs.h (the job path) the core, nvt_table_type.h (the CPython
 * type) the jobs; never back.
 *
 * The table lives in the store's `table` file, mapped MAP_SHARED by every
 * process attached to the store, so every sharer reads and writes the same
 * slots. It is derived state: the index records (format.py) stay the durable
 * truth, and the table is rebuilt from them whenever its consistency cannot be
 * proven (the first process to attach after a crash).
 *
 * Layout (little-endian, changing it requires bumping NVT_TABLE_VERSION and
 * FORMAT_VERSION in nvmetier/format.py; docs/format.md has the same table):
 *   header, NVT_TABLE_HEADER_BYTES:
 *     0 magic u64 "NVTTABLE" | 8 version u32 | 12 header_bytes u32 |
 *     16 n_slots u64 | 24 ways u32 | 28 set_bytes u32 | 32 n_sets u64 |
 *     40 purge_gen u32 | 44 purge_events_gen u32 | 48 used i64 | 56 ready i64 |
 *     64 retention_s u32 | 68 max_sharers u32 | 72 key_fingerprint u8[8] | ... |
 *     256 sharers[NVT_MAX_SHARERS] of {pid u32, incarnation u32, attached_ns u64}
 *   then n_sets sets of set_bytes (nvt_set_layout below): a head of 64 bytes
 *   (a robust, process-shared pthread mutex; the set's recency clock u32; the
 *   holder u16 and holder_inc u16 of the mutex), then one array per field,
 *   each starting 8-byte aligned, the set padded to 64 bytes:
 *     tag u8[ways] | state u8[ways] | owner u8[ways] | flags u8[ways] |
 *     owner_inc u16[ways] | pins u16[ways] | last u32[ways] | gen u32[ways] |
 *     epoch u32[ways] | stamp u64[ways] | fp u64[ways]
 *
 * Field arrays instead of slot structs keep the scans short: a lookup reads
 * the tags (one cache line for up to 64 ways) and the fingerprint of a tag
 * match only; a claim finds an empty way in the states line; only a full set
 * reads stamps, pins and recencies.
 *
 * Slot fields: fp is the key's fingerprint, XXH3-64(key) (also the payload
 * checksum seed); tag is its top byte with the low bit set, 0 for an EMPTY
 * way; gen changes on every claim and every clear; last is the recency (the
 * set's own clock, in its head beside the mutex; ages are clock - last, exact
 * modulo 2^32); flags holds NVT_FLAG_UNVERIFIED (below).
 *
 * Times are CLOCK_MONOTONIC milliseconds in 64 bits (no wrap): stamp is a
 * WRITING slot's claim time, or a READY/BAD slot's lease end. Leases: pins
 * counts the leases granted on the slot and not yet released (a lookup hit,
 * until its step ends; a load, until it completes), stamp the latest end
 * among them. A slot is leased (no sharer evicts or invalidates it) while
 * pins > 0 and stamp is in the future. Every grant names itself by the slot's
 * (gen, epoch) and releases one pin, so two overlapping loads each keep their
 * own protection. A lease whose end passed (its holder died or hung) is
 * zeroed when seen, and epoch advances, so no late release of an expired
 * grant can take a pin of a newer one. owner/owner_inc name the sharer
 * writing a WRITING slot (registry index and the low 16 bits of its
 * incarnation).
 *
 * Records: an EMPTY or WRITING slot's index record is all zero (a WRITING
 * slot gets its record when its write completed, then turns READY). Every
 * way to EMPTY zeroes the record first, and the rebuild zeroes each record it
 * does not load, so claiming an EMPTY slot need not touch the index.
 *
 * Locks: every read-modify-write of a set's slots holds the set's mutex. The
 * mutexes are robust: a sharer that dies holding one leaves EOWNERDEAD to the
 * next locker, which repairs the set (reclaims the dead sharer's WRITING
 * slots) and marks the mutex consistent. The holder fields name the sharer
 * holding the mutex (written just after it is taken, cleared just before it
 * is released: 0 = unknown), so EOWNERDEAD names the dead sharer. The
 * kernel walks robust futexes before the dying process's other threads have
 * drained their I/O and before its files (its OFD lock) are closed, so its
 * WRITING slots are reclaimed only once that OFD lock is gone (an O_DIRECT
 * write still in flight must not land on a reclaimed slot): the locker waits
 * a bounded time for it, and the dying sharer's slots are rechecked at every
 * later look. A mutex is waited for a
 * bounded time (SET_LOCK_WAIT_MS in nvt_core.h): a holder that is stopped
 * (SIGSTOP, a frozen cgroup) costs a miss or a dropped store, never a hang. Sharer liveness is an OFD byte lock
 * on the store's lock file at NVT_REGISTRY_LOCK_BASE + registry index, which
 * the kernel drops when the process dies (F_OFD_GETLK tells). Counters in the
 * header are atomics and may drift after a crash; they are recounted when the
 * table is rebuilt or swept.
 */
#ifndef NVT_LAYOUT_H
#define NVT_LAYOUT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define NVT_TABLE_MAGIC 0x454C42415454564EULL /* "NVTTABLE" little-endian */
#define NVT_TABLE_VERSION 3
#define NVT_TABLE_HEADER_BYTES 8192
#define NVT_MAX_SHARERS 256
#define NVT_SHARERS_OFFSET 256
#define NVT_SET_HEAD_BYTES 64
#define NVT_REGISTRY_LOCK_BASE (1LL << 20)
/* Slot numbers are 32-bit in ops and watches; ways bounded so that every
 * layout offset fits 32 bits. */
#define NVT_MAX_SLOTS 0xFFFFFFFFULL
#define NVT_MAX_WAYS 4096

enum { NVT_EMPTY = 0, NVT_WRITING = 1, NVT_READY = 2, NVT_BAD = 3 };
/* Slot flags. UNVERIFIED: the slot's bytes may not be its record's (it was
 * rebuilt after an unclean shutdown, or reclaimed from a writer that died):
 * loads check its payload checksum whatever verify_checksums says, until one
 * check passes. Sticky across claims and writes of the slot. */
/* PURGED: `nvmetier purge --all` ran while the slot was WRITING: its write
 * is not published (the slot is cleared at completion, the key fails), since
 * it may hold KV computed before the purge. Cleared with the slot. */
enum { NVT_FLAG_UNVERIFIED = 1, NVT_FLAG_PURGED = 2 };

typedef struct {
    uint32_t pid;
    uint32_t incarnation;
    uint64_t attached_ns;
} nvt_sharer;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t header_bytes;
    uint64_t n_slots;
    uint32_t ways;
    uint32_t set_bytes;
    uint64_t n_sets;
    /* Purges so far (nvmetier purge bumps it once its removals are logged),
     * and the purge whose removals a sharer took to emit as KV events
     * (compare-and-swap: one sharer emits each purge's removals). */
    uint32_t purge_gen;
    uint32_t purge_events_gen;
    int64_t used;
    int64_t ready;
    /* The retention (seconds, 0: off) of the latest process to open the
     * store: what `nvmetier info` measures ages against. */
    uint32_t retention_s;
    uint32_t max_sharers;
    /* The key fingerprint of the latest process to open an encrypted store
     * (written by nvmetier/store.py; 0: none). */
    uint8_t key_fingerprint[8];
    /* Encrypted stores: advanced (atomically) after every change of the
     * store's `keys` file, so sharers reload their key tables. */
    uint32_t keys_gen;
} nvt_table_header;

typedef struct {
    pthread_mutex_t mu;
    uint32_t clock;      /* the set's recency counter (ways' `last` are its values) */
    uint16_t holder;     /* registry index + 1 of the sharer holding mu, 0: unknown */
    uint16_t holder_inc; /* its incarnation's low 16 bits */
    char pad[NVT_SET_HEAD_BYTES - sizeof(pthread_mutex_t) - 2 * sizeof(uint32_t)];
} nvt_set_head;

/* Byte offsets of a set's field arrays from the start of the set. */
typedef struct {
    uint32_t tag, state, owner, flags, owner_inc, pins, last, gen, epoch, stamp, fp, set_bytes;
} nvt_set_layout;

static inline uint32_t nvt_align(uint32_t n, uint32_t a) { return (n + a - 1) / a * a; }

static inline nvt_set_layout nvt_layout(uint32_t ways) {
    nvt_set_layout L;
    L.tag = NVT_SET_HEAD_BYTES;
    L.state = L.tag + nvt_align(ways, 8);
    L.owner = L.state + nvt_align(ways, 8);
    L.flags = L.owner + nvt_align(ways, 8);
    L.owner_inc = L.flags + nvt_align(ways, 8);
    L.pins = L.owner_inc + nvt_align(2 * ways, 8);
    L.last = L.pins + nvt_align(2 * ways, 8);
    L.gen = L.last + nvt_align(4 * ways, 8);
    L.epoch = L.gen + nvt_align(4 * ways, 8);
    L.stamp = L.epoch + nvt_align(4 * ways, 8);
    L.fp = L.stamp + 8 * ways;
    L.set_bytes = nvt_align(L.fp + 8 * ways, 64);
    return L;
}

_Static_assert(sizeof(nvt_set_head) == NVT_SET_HEAD_BYTES, "set head layout");
_Static_assert(offsetof(nvt_table_header, purge_gen) == 40 && offsetof(nvt_table_header, used) == 48 &&
                   offsetof(nvt_table_header, retention_s) == 64 && offsetof(nvt_table_header, max_sharers) == 68 &&
                   offsetof(nvt_table_header, key_fingerprint) == 72 &&
                   offsetof(nvt_table_header, keys_gen) == 80,
               "header layout");
_Static_assert(sizeof(nvt_table_header) <= NVT_SHARERS_OFFSET, "header layout");
_Static_assert(NVT_SHARERS_OFFSET + NVT_MAX_SHARERS * sizeof(nvt_sharer) <= NVT_TABLE_HEADER_BYTES,
               "sharer registry fits the header");

#endif /* NVT_LAYOUT_H */
