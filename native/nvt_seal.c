/*
 * nvt_seal: sealed slots, the nonce allocator and the key tables (nvt_seal.h).
 */
#define _GNU_SOURCE
#include "nvt_seal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>

#include "nvt_crypto.h"

_Static_assert(NVT_TRL_USED <= NVT_TRAILER_BYTES, "trailer fields overflow the trailer");
_Static_assert(NVT_KEY_BYTES == NVT_GCM_KEY_BYTES && NVT_NONCE_BYTES == NVT_GCM_NONCE_BYTES, "AES-256-GCM sizes");
_Static_assert(sizeof(nvt_epoch_key) == 48, "nvt_epoch_key layout");

static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

int nvt_random(uint8_t *out, size_t n) {
    while (n) {
        ssize_t got = getrandom(out, n, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        out += got;
        n -= (size_t)got;
    }
    return 0;
}

static size_t page_round(size_t n) {
    return (n + 4095) & ~(size_t)4095;
}

void *nvt_secret_alloc(size_t n) {
    void *p = mmap(NULL, page_round(n), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    (void)madvise(p, page_round(n), MADV_DONTDUMP); /* best effort: the kernel may lack it */
    return p;
}

void nvt_secret_free(void *p, size_t n) {
    if (!p)
        return;
    explicit_bzero(p, n);
    munmap(p, page_round(n));
}

nvt_keys *nvt_keys_new(const uint8_t store_id[NVT_STORE_ID_BYTES], uint64_t layout_digest) {
    size_t bytes = sizeof(nvt_keys) + NVT_MAX_EPOCHS * sizeof(nvt_epoch_key);
    nvt_keys *k = nvt_secret_alloc(bytes);
    if (!k)
        return NULL;
#ifdef MADV_WIPEONFORK
    (void)madvise(k, page_round(bytes), MADV_WIPEONFORK); /* a forked child holds no keys */
#endif
    memset(k, 0, sizeof(*k)); /* fresh anonymous pages are zero already */
    pthread_rwlock_init(&k->lock, NULL);
    pthread_mutex_init(&k->hold_mu, NULL);
    pthread_cond_init(&k->hold_cv, NULL);
    k->refs = 1;
    k->layout_digest = layout_digest;
    memcpy(k->store_id, store_id, NVT_STORE_ID_BYTES);
    k->map_bytes = bytes;
    return k;
}

void nvt_keys_ref(nvt_keys *k) {
    __atomic_add_fetch(&k->refs, 1, __ATOMIC_RELAXED);
}

void nvt_keys_unref(nvt_keys *k) {
    if (!k || !k->map_bytes) /* a forked child's wiped table: leave it */
        return;
    if (__atomic_sub_fetch(&k->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    size_t bytes = (size_t)k->map_bytes;
    pthread_rwlock_destroy(&k->lock);
    pthread_cond_destroy(&k->hold_cv);
    pthread_mutex_destroy(&k->hold_mu);
    nvt_secret_free(k, bytes);
}

static int by_epoch(const void *a, const void *b) {
    uint32_t x = ((const nvt_epoch_key *)a)->epoch, y = ((const nvt_epoch_key *)b)->epoch;
    return x < y ? -1 : x > y;
}

static int by_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* The epochs known destroyed after a set: those known before, the `keys`
 * file's destroyed ones, and the table's current ones the new table lacks
 * (`now`, its `n` epochs, sorted). Sorted, unique, the newest NVT_MAX_EPOCHS
 * kept. `tmp`: room for 3 * NVT_MAX_EPOCHS. Under the write lock. */
static void merge_gone_locked(nvt_keys *k, uint32_t *tmp, const uint32_t *now, uint32_t n, const uint32_t *destroyed,
                              uint32_t n_destroyed) {
    uint32_t m = k->n_gone;
    memcpy(tmp, k->gone, (size_t)m * sizeof(*tmp));
    memcpy(tmp + m, destroyed, (size_t)n_destroyed * sizeof(*tmp));
    m += n_destroyed;
    for (uint32_t i = 0, j = 0; i < k->n; i++) {
        while (j < n && now[j] < k->ents[i].epoch)
            j++;
        if (j == n || now[j] != k->ents[i].epoch)
            tmp[m++] = k->ents[i].epoch; /* held, now gone */
    }
    qsort(tmp, m, sizeof(*tmp), by_u32);
    uint32_t u = 0;
    for (uint32_t i = 0; i < m; i++)
        if (u == 0 || tmp[u - 1] != tmp[i])
            tmp[u++] = tmp[i];
    uint32_t from = u > NVT_MAX_EPOCHS ? u - NVT_MAX_EPOCHS : 0;
    memmove(k->gone, tmp + from, (size_t)(u - from) * sizeof(*tmp));
    k->n_gone = u - from;
}

int nvt_keys_set(nvt_keys *k, const nvt_epoch_key *ents, uint32_t n, int64_t seal_epoch, uint64_t seal_until_ns,
                 uint64_t seal_limit, uint32_t max_epoch, uint32_t gen_seen, const uint32_t *destroyed,
                 uint32_t n_destroyed) {
    if (n > NVT_MAX_EPOCHS || n_destroyed > NVT_MAX_EPOCHS || !k->map_bytes)
        return -EINVAL;
    /* The merge's room (3 tables' worth), then the new epochs, sorted. */
    uint32_t *tmp = malloc(4 * (size_t)NVT_MAX_EPOCHS * sizeof(*tmp));
    if (!tmp)
        return -ENOMEM;
    uint32_t *now = tmp + 3 * (size_t)NVT_MAX_EPOCHS;
    for (uint32_t i = 0; i < n; i++)
        now[i] = ents[i].epoch;
    qsort(now, n, sizeof(*now), by_u32);
    pthread_rwlock_wrlock(&k->lock);
    merge_gone_locked(k, tmp, now, n, destroyed, n_destroyed);
    uint32_t old_epoch = k->seal_at ? k->ents[k->seal_at - 1].epoch : 0;
    int had = k->seal_at != 0;
    memcpy(k->ents, ents, (size_t)n * sizeof(*ents));
    if (n < k->n)
        explicit_bzero(k->ents + n, (size_t)(k->n - n) * sizeof(*ents));
    qsort(k->ents, n, sizeof(*ents), by_epoch);
    k->n = n;
    k->seal_at = 0;
    for (uint32_t i = 0; seal_epoch >= 0 && i < n; i++)
        if (k->ents[i].epoch == (uint32_t)seal_epoch)
            k->seal_at = (int32_t)i + 1;
    if (!k->seal_at || !had || old_epoch != (uint32_t)seal_epoch)
        __atomic_store_n(&k->seals, 0, __ATOMIC_RELAXED);
    k->seal_until_ns = seal_until_ns;
    k->seal_limit = seal_limit;
    k->max_epoch = max_epoch;
    k->gen_seen = gen_seen;
    pthread_rwlock_unlock(&k->lock);
    free(tmp);
    return 0;
}

void nvt_keys_hold(nvt_keys *k, int on) {
    if (!k->map_bytes)
        return;
    pthread_mutex_lock(&k->hold_mu);
    k->hold = on != 0;
    if (!on)
        pthread_cond_broadcast(&k->hold_cv);
    pthread_mutex_unlock(&k->hold_mu);
}

/* A seal found no sealing epoch: wait for a rotation under way to end.
 * 1 when one ended (try again), 0 when none was under way or it is late. */
static int wait_hold(nvt_keys *k) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += NVT_HOLD_WAIT_MS / 1000;
    until.tv_nsec += (long)(NVT_HOLD_WAIT_MS % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&k->hold_mu);
    int was = k->hold != 0, rc = 0;
    while (k->hold && rc == 0)
        rc = pthread_cond_timedwait(&k->hold_cv, &k->hold_mu, &until);
    int ended = was && !k->hold;
    pthread_mutex_unlock(&k->hold_mu);
    return ended;
}

void nvt_keys_watch(nvt_keys *k, const uint32_t *gen) {
    if (!k->map_bytes) /* a forked child's wiped table */
        return;
    pthread_rwlock_wrlock(&k->lock);
    k->gen = gen;
    pthread_rwlock_unlock(&k->lock);
}

uint64_t nvt_keys_seals(nvt_keys *k) {
    return __atomic_load_n(&k->seals, __ATOMIC_RELAXED);
}

/* The authenticated data: what the tag binds besides the bytes. */
static void make_aad(const nvt_keys *k, uint64_t seed, uint32_t epoch, uint32_t file_idx, uint64_t file_off,
                     uint8_t aad[NVT_AAD_BYTES]) {
    put_le(aad, seed, 8);
    put_le(aad + 8, k->layout_digest, 8);
    memcpy(aad + 16, k->store_id, NVT_STORE_ID_BYTES);
    put_le(aad + 32, epoch, 4);
    put_le(aad + 36, file_idx, 4);
    put_le(aad + 40, file_off, 8);
}

static uint64_t wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int nvt_keys_seal(nvt_keys *k, uint64_t seed, uint32_t file_idx, uint64_t file_off, const uint8_t *row, uint8_t *out,
                  uint64_t row_bytes, uint64_t slot_bytes, uint64_t *checksum) {
    uint8_t key[NVT_KEY_BYTES], fp[NVT_FP_BYTES], nonce[NVT_NONCE_BYTES], aad[NVT_AAD_BYTES], tag[NVT_GCM_TAG_BYTES];
    uint32_t epoch;
    if (slot_bytes < row_bytes + NVT_TRAILER_BYTES)
        return -EINVAL;
    for (int tries = 0;; tries++) {
        pthread_rwlock_rdlock(&k->lock);
        if (k->seal_at && wall_ns() <= k->seal_until_ns &&
            __atomic_fetch_add(&k->seals, 1, __ATOMIC_RELAXED) < k->seal_limit)
            break; /* holding the read lock */
        pthread_rwlock_unlock(&k->lock);
        /* No sealing epoch, or it is used up: wait once for a rotation under
         * way (e.g. after a purge destroyed this process's epoch). */
        if (tries > 0 || !k->map_bytes || !wait_hold(k))
            return -EAGAIN; /* the rotation is late: the write is skipped */
    }
    const nvt_epoch_key *e = &k->ents[k->seal_at - 1];
    epoch = e->epoch;
    memcpy(key, e->key, sizeof(key));
    memcpy(fp, e->fingerprint, sizeof(fp));
    make_aad(k, seed, epoch, file_idx, file_off, aad);
    pthread_rwlock_unlock(&k->lock);
    int rc = nvt_random(nonce, sizeof(nonce));
    if (rc == 0 && nvt_gcm_seal(key, nonce, aad, sizeof(aad), row, out, (size_t)row_bytes, tag) != 0)
        rc = -EIO;
    explicit_bzero(key, sizeof(key));
    if (rc)
        return rc;
    uint8_t *t = out + row_bytes;
    memset(t, 0, (size_t)(slot_bytes - row_bytes));
    memcpy(t + NVT_TRL_MAGIC, "NVTS", 4);
    put_le(t + NVT_TRL_VERSION, NVT_TRAILER_VERSION, 4);
    memcpy(t + NVT_TRL_NONCE, nonce, sizeof(nonce));
    memcpy(t + NVT_TRL_TAG, tag, sizeof(tag));
    put_le(t + NVT_TRL_EPOCH, epoch, 4);
    memcpy(t + NVT_TRL_FINGERPRINT, fp, sizeof(fp));
    *checksum = get_le(tag, 8);
    return 0;
}

int nvt_keys_open(nvt_keys *k, uint64_t seed, uint32_t file_idx, uint64_t file_off, const uint8_t *trailer,
                  const uint8_t *src, uint8_t *dst, uint64_t len, uint64_t *checksum) {
    uint8_t key[NVT_KEY_BYTES], aad[NVT_AAD_BYTES];
    *checksum = 0;
    if (memcmp(trailer + NVT_TRL_MAGIC, "NVTS", 4) != 0 || get_le(trailer + NVT_TRL_VERSION, 4) != NVT_TRAILER_VERSION)
        return -EBADMSG;
    uint32_t epoch = (uint32_t)get_le(trailer + NVT_TRL_EPOCH, 4);
    pthread_rwlock_rdlock(&k->lock);
    uint32_t lo = 0, hi = k->n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (k->ents[mid].epoch < epoch)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == k->n || k->ents[lo].epoch != epoch) {
        /* Newer than the table: not loaded yet, unless no epoch was announced
         * since the table was read (then it never existed: nvt_seal.h). A
         * forked child's wiped table proves nothing. Known destroyed: its
         * own code (not corruption). Any other: never existed. */
        int unknown = epoch > k->max_epoch &&
                      (!k->map_bytes || (k->gen && __atomic_load_n(k->gen, __ATOMIC_ACQUIRE) != k->gen_seen));
        int gone = !unknown && bsearch(&epoch, k->gone, k->n_gone, sizeof(epoch), by_u32) != NULL;
        pthread_rwlock_unlock(&k->lock);
        return unknown ? -ENOKEY : gone ? -EKEYREVOKED : -EBADMSG;
    }
    memcpy(key, k->ents[lo].key, sizeof(key));
    make_aad(k, seed, epoch, file_idx, file_off, aad);
    pthread_rwlock_unlock(&k->lock);
    int rc = nvt_gcm_open(key, trailer + NVT_TRL_NONCE, aad, sizeof(aad), src, dst, (size_t)len, trailer + NVT_TRL_TAG);
    explicit_bzero(key, sizeof(key));
    if (rc == 0) {
        *checksum = get_le(trailer + NVT_TRL_TAG, 8);
        return 0;
    }
    /* GCM decrypts before it verifies: `dst` holds the ciphertext's bytes
     * under the keystream, unauthenticated (a flipped bit on disk is the
     * same bit flipped here). None of it stays where a reader could take
     * it: zeroed, as the whole load fails. */
    memset(dst, 0, (size_t)len);
    return rc == 1 ? -EBADMSG : -EIO;
}
