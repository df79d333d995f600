/*
 * nvt_crypto: sealing and opening chunks with AES-256-GCM (96-bit nonce,
 * 128-bit tag) through OpenSSL libcrypto's EVP AEAD interface; no
 * cryptography by hand. No Python here: the I/O engines call it from their
 * threads, and nvmetier._crypto (nvt_crypto_module.c) exposes it to Python
 * with the GIL released.
 *
 * Threads: every function is reentrant (a cipher context per call); keys and
 * buffers are the caller's.
 */
#ifndef NVT_CRYPTO_H
#define NVT_CRYPTO_H

#include <stddef.h>
#include <stdint.h>

#define NVT_GCM_KEY_BYTES 32
#define NVT_GCM_NONCE_BYTES 12
#define NVT_GCM_TAG_BYTES 16

/* Encrypt `len` bytes of `src` into `dst` (may be `src`: in place) with
 * `aad` authenticated, and write the tag. `src` is only read. Returns 0, or
 * -1 when libcrypto failed (nothing in `dst` or `tag` is then meaningful). */
int nvt_gcm_seal(const uint8_t key[NVT_GCM_KEY_BYTES], const uint8_t nonce[NVT_GCM_NONCE_BYTES],
                 const uint8_t *aad, size_t aad_len, const uint8_t *src, uint8_t *dst, size_t len,
                 uint8_t tag[NVT_GCM_TAG_BYTES]);

/* Decrypt `len` bytes of `src` into `dst` (may be `src`: in place) and
 * check the tag over them and `aad`. Returns 0 when the tag verifies, 1 when
 * it does not (the bytes in `dst` are then garbage and must not be used), -1
 * when libcrypto failed. */
int nvt_gcm_open(const uint8_t key[NVT_GCM_KEY_BYTES], const uint8_t nonce[NVT_GCM_NONCE_BYTES],
                 const uint8_t *aad, size_t aad_len, const uint8_t *src, uint8_t *dst, size_t len,
                 const uint8_t tag[NVT_GCM_TAG_BYTES]);

/* HMAC-SHA256 under a fixed key, keyed once: the SHA-256 states after the
 * key's inner and outer pads, so each MAC costs two short hashes and no
 * allocation (the offload keys' names in a sealed store's index). */
#define NVT_HMAC_BYTES 32
typedef struct {
    uint8_t inner[128]; /* SHA256_CTX after ipad (opaque storage) */
    uint8_t outer[128]; /* SHA256_CTX after opad */
} nvt_hmac_key;

/* Key `k` with `key` (any length). Returns 0, or -1 if libcrypto failed. */
int nvt_hmac_init(nvt_hmac_key *k, const uint8_t *key, size_t key_len);

/* HMAC-SHA256 of `msg` under `k` into `out`. Reentrant: `k` is only read. */
void nvt_hmac(const nvt_hmac_key *k, const uint8_t *msg, size_t len, uint8_t out[NVT_HMAC_BYTES]);

/* HKDF-SHA256 (RFC 5869, no salt: HashLen zeros) of `ikm` with `info` into
 * `out` (`out_len` bytes), through libcrypto's EVP_PKEY HKDF. 0, or -1 when
 * libcrypto failed (`out` then zeroed). */
int nvt_hkdf_sha256(const uint8_t *ikm, size_t ikm_len, const uint8_t *info, size_t info_len, uint8_t *out,
                    size_t out_len);

#endif /* NVT_CRYPTO_H */
