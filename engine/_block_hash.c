/* Native chained block hashes: the definition of engine/block_hash.py, without a Python loop per block.
 *
 *   hash_0 = sha256(root        || le_u32(tokens[0:bs]))
 *   hash_i = sha256(hash_{i-1}  || le_u32(tokens[i*bs:(i+1)*bs]))
 *
 * chain(token_ids, block_size, root) -> list of 32-byte hashes of every full block. token_ids is any
 * sequence of ints in [0, 2**32), or bytes of little-endian uint32 (as packed_ids gives); anything else
 * raises ValueError (or TypeError for a non-int). SHA-256 is OpenSSL's (libcrypto), which uses the CPU's
 * SHA extensions where there are some. The GIL is released while hashing.
 *
 * packed_ids(wire, limit) -> bytes of little-endian uint32: the ids of a serialized message whose field 1 is
 * `repeated uint32` (TokenIds), packed or not; other fields are skipped. An id >= limit raises ValueError.
 * It reads a prompt's ids without a Python int per token: the Conductor receives 100k-token prompts as
 * protobuf, and turning them into a list of ints cost more than hashing them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_Init/Update/Final: the fastest calls for many small inputs */
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define HASH_BYTES 32

static int pack_tokens(PyObject *seq, Py_ssize_t count, unsigned char *out) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long long value = PyLong_AsUnsignedLongLong(items[i]);
        if (value == (unsigned long long)-1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_SetString(PyExc_ValueError, "token_ids must all fit in an unsigned 32-bit integer");
            }
            return -1;
        }
        if (value > UINT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "token_ids must all fit in an unsigned 32-bit integer");
            return -1;
        }
        unsigned char *p = out + 4 * i;
        p[0] = (unsigned char)value;
        p[1] = (unsigned char)(value >> 8);
        p[2] = (unsigned char)(value >> 16);
        p[3] = (unsigned char)(value >> 24);
    }
    return 0;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size;
    Py_buffer root;
    if (!PyArg_ParseTuple(args, "Ony*", &tokens, &block_size, &root)) return NULL;
    PyObject *result = NULL, *seq = NULL;
    unsigned char *payload = NULL, *digests = NULL;
    if (block_size <= 0 || root.len != HASH_BYTES) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive and root 32 bytes");
        goto done;
    }
    Py_ssize_t num_blocks, block_bytes = 4 * block_size;
    const unsigned char *packed;
    if (PyBytes_Check(tokens)) {
        if (PyBytes_GET_SIZE(tokens) % 4) {
            PyErr_SetString(PyExc_ValueError, "packed token_ids must be whole uint32s");
            goto done;
        }
        num_blocks = PyBytes_GET_SIZE(tokens) / block_bytes;
        packed = (const unsigned char *)PyBytes_AS_STRING(tokens);
    } else {
        seq = PySequence_Fast(tokens, "token_ids must be a sequence");
        if (seq == NULL) goto done;
        num_blocks = PySequence_Fast_GET_SIZE(seq) / block_size;
        payload = PyMem_Malloc((size_t)(num_blocks * block_bytes + HASH_BYTES));
        if (payload == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (pack_tokens(seq, num_blocks * block_size, payload) < 0) goto done;
        packed = payload;
    }
    digests = PyMem_Malloc((size_t)(num_blocks * HASH_BYTES + 1));
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *parent = root.buf;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, parent, HASH_BYTES);
        SHA256_Update(&ctx, packed + i * block_bytes, (size_t)block_bytes);
        SHA256_Final(digests + i * HASH_BYTES, &ctx);
        parent = digests + i * HASH_BYTES;
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(num_blocks);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + i * HASH_BYTES, HASH_BYTES);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, digest);
    }
done:
    PyMem_Free(payload);
    PyMem_Free(digests);
    Py_XDECREF(seq);
    PyBuffer_Release(&root);
    return result;
}

/* One varint at *p (advanced past it); -1 when it runs past end or over 10 bytes. */
static int read_varint(const unsigned char **p, const unsigned char *end, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; *p < end && shift < 70; shift += 7) {
        unsigned char byte = *(*p)++;
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return -1;
}

static PyObject *packed_ids(PyObject *self, PyObject *args) {
    Py_buffer wire;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "y*K", &wire, &limit)) return NULL;
    const unsigned char *p = wire.buf, *end = p + wire.len;
    /* every id takes at least one byte of the wire */
    unsigned char *out = PyMem_Malloc((size_t)wire.len * 4 + 1);
    PyObject *result = NULL;
    Py_ssize_t count = 0;
    uint64_t tag, value, length;
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    while (p < end) {
        if (read_varint(&p, end, &tag) < 0) goto malformed;
        const unsigned char *ids = p, *ids_end = p;
        switch (tag & 7) {
            case 0: /* varint: one id (field 1 unpacked) or a field to skip */
                if (read_varint(&p, end, &value) < 0) goto malformed;
                ids_end = p;
                break;
            case 1:
                if (end - p < 8) goto malformed;
                p += 8;
                break;
            case 5:
                if (end - p < 4) goto malformed;
                p += 4;
                break;
            case 2: /* length-delimited: field 1 packed, or a field to skip */
                if (read_varint(&p, end, &length) < 0 || length > (uint64_t)(end - p)) goto malformed;
                ids = p;
                p += length;
                ids_end = p;
                break;
            default: goto malformed;
        }
        if (tag >> 3 != 1) continue;
        while (ids < ids_end) {
            if (read_varint(&ids, ids_end, &value) < 0) goto malformed;
            if (value >= limit) {
                PyErr_Format(PyExc_ValueError, "token id %llu is outside the vocabulary (size %llu)",
                             (unsigned long long)value, limit);
                goto done;
            }
            unsigned char *o = out + 4 * count++;
            o[0] = (unsigned char)value;
            o[1] = (unsigned char)(value >> 8);
            o[2] = (unsigned char)(value >> 16);
            o[3] = (unsigned char)(value >> 24);
        }
    }
    result = PyBytes_FromStringAndSize((const char *)out, count * 4);
    goto done;
malformed:
    PyErr_SetString(PyExc_ValueError, "malformed repeated uint32 field");
done:
    PyMem_Free(out);
    PyBuffer_Release(&wire);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "chain(token_ids, block_size, root) -> chained SHA-256 of every full block"},
    {"packed_ids", packed_ids, METH_VARARGS, "packed_ids(wire, limit) -> field 1's uint32 ids, little-endian"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_hash", "Native chained block hashes.", -1, methods};

PyMODINIT_FUNC PyInit__block_hash(void) { return PyModule_Create(&module); }
