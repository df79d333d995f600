/*
 * nvt_crypto: AES-256-GCM through libcrypto's EVP interface (nvt_crypto.h).
 */
/* SHA256_Init/Update/Final are deprecated in OpenSSL 3 for EVP_Digest*,
 * which allocate per call: the keyed HMAC midstates (nvt_hmac) need the
 * plain context struct that can be copied. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include "nvt_crypto.h"

#include <limits.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <string.h>

_Static_assert(sizeof(SHA256_CTX) <= sizeof(((nvt_hmac_key *)0)->inner), "nvt_hmac_key too small");

/* EVP takes int lengths: longer buffers go through in pieces of this. */
#define PIECE_BYTES (1 << 30)

static EVP_CIPHER_CTX *begin(int enc, const uint8_t *key, const uint8_t *nonce, const uint8_t *aad,
                             size_t aad_len) {
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    int out;
    if (!ctx)
        return NULL;
    if (EVP_CipherInit_ex(ctx, EVP_aes_256_gcm(), NULL, NULL, NULL, enc) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN, NVT_GCM_NONCE_BYTES, NULL) != 1 ||
        EVP_CipherInit_ex(ctx, NULL, NULL, key, nonce, enc) != 1)
        goto fail;
    while (aad_len) {
        int n = aad_len > PIECE_BYTES ? PIECE_BYTES : (int)aad_len;
        if (EVP_CipherUpdate(ctx, NULL, &out, aad, n) != 1)
            goto fail;
        aad += n;
        aad_len -= (size_t)n;
    }
    return ctx;
fail:
    EVP_CIPHER_CTX_free(ctx);
    return NULL;
}

static int update(EVP_CIPHER_CTX *ctx, const uint8_t *src, uint8_t *dst, size_t len) {
    while (len) {
        int n = len > PIECE_BYTES ? PIECE_BYTES : (int)len, out = 0;
        if (EVP_CipherUpdate(ctx, dst, &out, src, n) != 1 || out != n)
            return -1; /* GCM is a stream mode: every byte comes out at once */
        src += n;
        dst += n;
        len -= (size_t)n;
    }
    return 0;
}

int nvt_gcm_seal(const uint8_t key[NVT_GCM_KEY_BYTES], const uint8_t nonce[NVT_GCM_NONCE_BYTES],
                 const uint8_t *aad, size_t aad_len, const uint8_t *src, uint8_t *dst, size_t len,
                 uint8_t tag[NVT_GCM_TAG_BYTES]) {
    EVP_CIPHER_CTX *ctx = begin(1, key, nonce, aad, aad_len);
    int out = 0, rc = -1;
    if (!ctx)
        return -1;
    if (update(ctx, src, dst, len) == 0 && EVP_EncryptFinal_ex(ctx, dst + len, &out) == 1 && out == 0 &&
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, NVT_GCM_TAG_BYTES, tag) == 1)
        rc = 0;
    EVP_CIPHER_CTX_free(ctx);
    return rc;
}

int nvt_gcm_open(const uint8_t key[NVT_GCM_KEY_BYTES], const uint8_t nonce[NVT_GCM_NONCE_BYTES],
                 const uint8_t *aad, size_t aad_len, const uint8_t *src, uint8_t *dst, size_t len,
                 const uint8_t tag[NVT_GCM_TAG_BYTES]) {
    EVP_CIPHER_CTX *ctx = begin(0, key, nonce, aad, aad_len);
    int out = 0, rc = -1;
    uint8_t want[NVT_GCM_TAG_BYTES];
    if (!ctx)
        return -1;
    for (int i = 0; i < NVT_GCM_TAG_BYTES; i++)
        want[i] = tag[i]; /* SET_TAG takes a non-const pointer */
    if (update(ctx, src, dst, len) == 0 &&
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, NVT_GCM_TAG_BYTES, want) == 1)
        rc = EVP_DecryptFinal_ex(ctx, dst + len, &out) == 1 ? 0 : 1;
    EVP_CIPHER_CTX_free(ctx);
    return rc;
}

int nvt_hmac_init(nvt_hmac_key *k, const uint8_t *key, size_t key_len) {
    uint8_t block[SHA256_CBLOCK], pad[SHA256_CBLOCK];
    SHA256_CTX c;
    memset(block, 0, sizeof(block));
    if (key_len > SHA256_CBLOCK) {
        if (!SHA256(key, key_len, block))
            return -1;
    } else if (key_len) {
        memcpy(block, key, key_len);
    }
    for (int i = 0; i < SHA256_CBLOCK; i++)
        pad[i] = block[i] ^ 0x36;
    if (SHA256_Init(&c) != 1 || SHA256_Update(&c, pad, sizeof(pad)) != 1)
        return -1;
    memset(k, 0, sizeof(*k));
    memcpy(k->inner, &c, sizeof(c));
    for (int i = 0; i < SHA256_CBLOCK; i++)
        pad[i] = block[i] ^ 0x5c;
    if (SHA256_Init(&c) != 1 || SHA256_Update(&c, pad, sizeof(pad)) != 1)
        return -1;
    memcpy(k->outer, &c, sizeof(c));
    OPENSSL_cleanse(block, sizeof(block));
    OPENSSL_cleanse(pad, sizeof(pad));
    OPENSSL_cleanse(&c, sizeof(c));
    return 0;
}

void nvt_hmac(const nvt_hmac_key *k, const uint8_t *msg, size_t len, uint8_t out[NVT_HMAC_BYTES]) {
    SHA256_CTX c;
    uint8_t inner[SHA256_DIGEST_LENGTH];
    memcpy(&c, k->inner, sizeof(c));
    SHA256_Update(&c, msg, len);
    SHA256_Final(inner, &c);
    memcpy(&c, k->outer, sizeof(c));
    SHA256_Update(&c, inner, sizeof(inner));
    SHA256_Final(out, &c);
}

int nvt_hkdf_sha256(const uint8_t *ikm, size_t ikm_len, const uint8_t *info, size_t info_len, uint8_t *out,
                    size_t out_len) {
    if (ikm_len > INT_MAX || info_len > INT_MAX)
        return -1;
    EVP_PKEY_CTX *c = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
    size_t got = out_len;
    int ok = c && EVP_PKEY_derive_init(c) > 0 && EVP_PKEY_CTX_set_hkdf_md(c, EVP_sha256()) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_key(c, ikm, (int)ikm_len) > 0 &&
             EVP_PKEY_CTX_add1_hkdf_info(c, info, (int)info_len) > 0 && EVP_PKEY_derive(c, out, &got) > 0 &&
             got == out_len;
    EVP_PKEY_CTX_free(c); /* libcrypto cleanses its copy of the key */
    if (!ok) {
        OPENSSL_cleanse(out, out_len);
        return -1;
    }
    return 0;
}
