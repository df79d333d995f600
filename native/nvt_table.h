/*
 * nvt_table: the process-shared slot table of a store (nvmetier._table).
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
 *     40 clock u64 (recency counter, atomic) | 48 used i64 | 56 ready i64 |
 *     64 clean u32 | 68 max_sharers u32 | ... |
 *     256 sharers[NVT_MAX_SHARERS] of {pid u32, incarnation u32, attached_ns u64}
 *   then n_sets sets of set_bytes = 64 + ways * 32:
 *     set head: a robust, process-shared pthread mutex (padded to 64 bytes)
 *     ways slots: {fp u64, last_used u64, stamp_ns u64, gen u32, state u8,
 *                  owner u8, owner_inc u16}
 *
 * Slot fields: fp is the key's fingerprint, XXH3-64(key) (also the payload
 * checksum seed); gen changes on every claim and every clear; stamp_ns is the
 * HIT lease end (READY: CLOCK_MONOTONIC ns until which eviction skips the
 * slot) or the claim time (WRITING); owner/owner_inc name the sharer writing
 * it (registry index and the low 16 bits of its incarnation). For a READY
 * slot, owner is 1 while a load's lease is on it (an end-of-step release of
 * lookup leases then leaves it alone; the load's completion drops it).
 *
 * Locks: every read-modify-write of a set's slots holds the set's mutex. The
 * mutexes are robust: a sharer that dies holding one leaves EOWNERDEAD to the
 * next locker, which repairs the set (reclaims the dead sharer's WRITING
 * slots) and marks the mutex consistent. Sharer liveness is an OFD byte lock
 * on the store's lock file at NVT_REGISTRY_LOCK_BASE + registry index, which
 * the kernel drops when the process dies (F_OFD_GETLK tells). Counters in the
 * header are atomics and may drift after a crash; they are recounted when the
 * table is rebuilt or swept.
 */
#ifndef NVT_TABLE_H
#define NVT_TABLE_H

#include <pthread.h>
#include <stdint.h>

#define NVT_TABLE_MAGIC 0x454C42415454564EULL /* "NVTTABLE" little-endian */
#define NVT_TABLE_VERSION 1
#define NVT_TABLE_HEADER_BYTES 8192
#define NVT_MAX_SHARERS 256
#define NVT_SHARERS_OFFSET 256
#define NVT_SET_HEAD_BYTES 64
#define NVT_SLOT_BYTES 32
#define NVT_REGISTRY_LOCK_BASE (1LL << 20)

enum { NVT_EMPTY = 0, NVT_WRITING = 1, NVT_READY = 2, NVT_BAD = 3 };

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
    uint64_t clock;
    int64_t used;
    int64_t ready;
    uint32_t clean;
    uint32_t max_sharers;
} nvt_table_header;

typedef struct {
    uint64_t fp;
    uint64_t last_used;
    uint64_t stamp_ns;
    uint32_t gen;
    uint8_t state;
    uint8_t owner;
    uint16_t owner_inc;
} nvt_slot;

typedef struct {
    pthread_mutex_t mu;
    char pad[NVT_SET_HEAD_BYTES - sizeof(pthread_mutex_t)];
} nvt_set_head;

_Static_assert(sizeof(nvt_slot) == NVT_SLOT_BYTES, "slot layout");
_Static_assert(sizeof(nvt_set_head) == NVT_SET_HEAD_BYTES, "set head layout");
_Static_assert(sizeof(nvt_table_header) <= NVT_SHARERS_OFFSET, "header layout");
_Static_assert(NVT_SHARERS_OFFSET + NVT_MAX_SHARERS * sizeof(nvt_sharer) <= NVT_TABLE_HEADER_BYTES,
               "sharer registry fits the header");

#endif /* NVT_TABLE_H */
