/*
 * nvt_seal: the one definition of a sealed slot (its trailer and its
 * authenticated data), the one nonce allocator, and the table of data keys
 * (epochs) both I/O engines seal and open with. Compiled into
 * nvmetier._crypto (which owns the tables: nvmetier._crypto.Keys) and into
 * nvmetier._uring (whose workers borrow one through a capsule).
 *
 * Keys: a store's data keys are per *epoch* (nvmetier/crypto.py: Keyring):
 * random 256-bit AES-GCM keys, each wrapped in the store's `keys` file. A
 * process seals only under its own current epoch, and opens under any epoch
 * its table holds. Nonces are 96 random bits from the kernel's CSPRNG
 * (getrandom), drawn per seal: nothing about them depends on a counter or a
 * file surviving a copy, a restore or a rollback. A table refuses to seal
 * past `seal_limit` seals (2^28 by default) or past `seal_until_ns` under
 * one epoch key, so the random nonces stay far inside NIST SP 800-38D's
 * 2^32 invocations per key (collision probability below 2^-41 per epoch).
 *
 * Memory: a table lives in its own anonymous mapping advised MADV_DONTDUMP
 * (no core dump holds the keys) and MADV_WIPEONFORK (a forked child finds an
 * empty table: it can neither seal nor open), zeroed before it is unmapped.
 *
 * Threads: nvt_keys_seal/nvt_keys_open on any thread (a read lock held
 * while the key is copied out, never across the cipher); nvt_keys_set under
 * the write lock. Changing the trailer or the authenticated data requires
 * bumping FORMAT_VERSION (nvmetier/format.py).
 */
#ifndef NVT_SEAL_H
#define NVT_SEAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* ---- the trailer, after the sealed bytes of a slot (64 bytes) ---------- */
#define NVT_TRAILER_BYTES 64
#define NVT_TRAILER_VERSION 2
#define NVT_TRL_MAGIC 0        /* "NVTS" */
#define NVT_TRL_VERSION 4      /* u32 */
#define NVT_TRL_NONCE 8        /* 12 random bytes */
#define NVT_TRL_TAG 20         /* 16 */
#define NVT_TRL_EPOCH 36       /* u32: the data key's epoch */
#define NVT_TRL_FINGERPRINT 40 /* 8: the epoch key's fingerprint */
#define NVT_TRL_USED 48        /* bytes 48..63 are zero */

/* ---- the authenticated data of a chunk (48 bytes, LE) ------------------ */
#define NVT_AAD_BYTES 48 /* seed u64, layout digest u64, store id [16], epoch u32, file u32, offset u64 */

#define NVT_KEY_BYTES 32
#define NVT_NONCE_BYTES 12
#define NVT_FP_BYTES 8
#define NVT_STORE_ID_BYTES 16
#define NVT_MAX_EPOCHS 8192
#define NVT_SEAL_LIMIT_DEFAULT (1ull << 28)

typedef struct {
    uint32_t epoch;
    uint32_t pad;
    uint8_t key[NVT_KEY_BYTES];
    uint8_t fingerprint[NVT_FP_BYTES];
} nvt_epoch_key;

typedef struct nvt_keys {
    /* All zero is a valid empty table (a forked child's, after WIPEONFORK):
     * glibc's PTHREAD_RWLOCK_INITIALIZER is all zeros. */
    pthread_rwlock_t lock;
    uint32_t n;            /* entries in `ents`, sorted by epoch; under lock */
    int32_t seal_at;       /* index of the sealing epoch + 1 (0: none); under lock */
    uint64_t seal_until_ns;/* CLOCK_REALTIME: no seal after it */
    uint64_t seal_limit;   /* no seal past this many under one epoch */
    uint64_t seals;        /* atomic: seals under the sealing epoch */
    uint32_t max_epoch;    /* the keys file's highest epoch when read (live or destroyed) */
    uint32_t refs;         /* atomic */
    /* The store's shared keys_gen (nvt_table_header, advanced after every
     * new epoch is durable and before its first seal; NULL: no other process
     * makes epochs for this table) and its value read before the `keys` file
     * was read for the current entries. Under lock. */
    const uint32_t *gen;
    uint32_t gen_seen;
    /* Set while the table is being replaced and may lack a sealing epoch
     * for a moment (a rotation): a seal finding none waits for it (bounded,
     * NVT_HOLD_WAIT_MS) instead of failing. Under hold_mu; zero is valid. */
    uint32_t hold;
    pthread_mutex_t hold_mu;
    pthread_cond_t hold_cv;
    uint64_t layout_digest;
    uint8_t store_id[NVT_STORE_ID_BYTES];
    uint64_t map_bytes;
    /* Epochs known to have existed and been destroyed (sorted, unique; the
     * newest NVT_MAX_EPOCHS kept): the `keys` file's destroyed entries, and
     * any epoch this table held that a later nvt_keys_set left out. A
     * trailer naming one opens as -EKEYREVOKED. Under lock. */
    uint32_t n_gone;
    uint32_t gone[NVT_MAX_EPOCHS];
    nvt_epoch_key ents[];
} nvt_keys;

/* Fill `out` with `n` bytes from the kernel's CSPRNG (getrandom, retried on
 * EINTR). The one nonce allocator: thread-safe, fork-safe. 0 or -errno. */
int nvt_random(uint8_t *out, size_t n);

/* Secret memory: page-granular, MADV_DONTDUMP, zeroed before unmapping. */
void *nvt_secret_alloc(size_t n);
void nvt_secret_free(void *p, size_t n);

nvt_keys *nvt_keys_new(const uint8_t store_id[NVT_STORE_ID_BYTES], uint64_t layout_digest);
void nvt_keys_ref(nvt_keys *k);
void nvt_keys_unref(nvt_keys *k);

/* Replace the table (entries need not be sorted; at most NVT_MAX_EPOCHS).
 * seal_epoch < 0: no sealing. The seal count restarts when the sealing
 * epoch changes. `destroyed` (`n_destroyed` epochs, any order) are the
 * `keys` file's destroyed entries; they join the epochs known destroyed,
 * as does every epoch the table held before this call and `ents` lacks
 * (a new epoch is 1 + the highest in the file, so a number is not reused
 * while its entry lasts; one that is live again opens as live: the live
 * entries are looked up first). 0, -EINVAL or -ENOMEM. */
int nvt_keys_set(nvt_keys *k, const nvt_epoch_key *ents, uint32_t n, int64_t seal_epoch, uint64_t seal_until_ns,
                 uint64_t seal_limit, uint32_t max_epoch, uint32_t gen_seen, const uint32_t *destroyed,
                 uint32_t n_destroyed);

/* Begin (1) or end (0) a replacement of the table during which it may lack
 * a sealing epoch: seals wait for its end (at most NVT_HOLD_WAIT_MS). */
#define NVT_HOLD_WAIT_MS 2000
void nvt_keys_hold(nvt_keys *k, int on);

/* Watch the store's shared keys_gen at `gen` (NULL: stop; the caller keeps
 * the mapping alive while it is watched). */
void nvt_keys_watch(nvt_keys *k, const uint32_t *gen);

/* Seals made under the current sealing epoch. */
uint64_t nvt_keys_seals(nvt_keys *k);

/* Seal `row` (`row_bytes`, only read) into `out` (`slot_bytes`): the
 * ciphertext, the trailer, zeros. `checksum`: the tag's first 8 bytes (LE).
 * 0, -EAGAIN (no sealing epoch, or its limit or time passed, and no
 * rotation under way that ended in NVT_HOLD_WAIT_MS), -EIO. */
int nvt_keys_seal(nvt_keys *k, uint64_t seed, uint32_t file_idx, uint64_t file_off, const uint8_t *row, uint8_t *out,
                  uint64_t row_bytes, uint64_t slot_bytes, uint64_t *checksum);

/* Open `len` sealed bytes of `src` into `dst` (may be `src`) with the
 * slot's `trailer`. 0 (checksum set), -EBADMSG (not a trailer, a tag that
 * does not verify, an epoch that never existed: dst untouched before a
 * decryption, zeroed after one whose tag failed: no unauthenticated
 * plaintext is left in it),
 * -EKEYREVOKED (an epoch this table knows existed and was destroyed, by a
 * purge, a retention or a full `keys` file: nothing can open it, dst
 * untouched), -ENOKEY (an epoch newer than this table knows while keys_gen
 * moved since the table was read: reload, then retry), -EIO (libcrypto;
 * dst zeroed as for a tag that failed).
 *
 * -EKEYREVOKED is decided from the trailer's epoch alone (no key, so no tag
 * to check): whoever can write the data files can make any chunk claim a
 * destroyed epoch. That changes which counter its load lands in
 * (loads_key_destroyed instead of auth_failures), never its outcome: a
 * miss, no byte served. An epoch is classified destroyed only when the
 * `keys` file says so or this table held it: a number below the newest that
 * is neither (never existed, or its entry torn before this table read it)
 * stays -EBADMSG.
 *
 * An epoch newer than the table knows while keys_gen has not moved since the
 * table's `keys` file was read is -EBADMSG: every epoch is durable in `keys`
 * and announced (keys_gen advanced) before its first seal, so a slot sealed
 * under it was published after that announcement; with no announcement since
 * the read, the trailer's epoch was never a real one (a tampered or corrupt
 * slot: a miss, never a load that fails for ever). */
int nvt_keys_open(nvt_keys *k, uint64_t seed, uint32_t file_idx, uint64_t file_off, const uint8_t *trailer,
                  const uint8_t *src, uint8_t *dst, uint64_t len, uint64_t *checksum);

#endif /* NVT_SEAL_H */
