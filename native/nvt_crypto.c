/*
 * nvt_crypto: AES-256-GCM through libcrypto's EVP interface (nvt_crypto.h).
 */
#include "nvt_crypto.h"

#include <limits.h>
#include <openssl/evp.h>

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
