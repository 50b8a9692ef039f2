/* Native chained block hashes: the definition of engine/block_hash.py, without a Python loop per block.
 *
 *   hash_0 = sha256(root        || le_u32(tokens[0:bs]))
 *   hash_i = sha256(hash_{i-1}  || le_u32(tokens[i*bs:(i+1)*bs]))
 *
 * chain(token_ids, block_size, root) -> list of 32-byte hashes of every full block. token_ids is any
 * sequence of ints in [0, 2**32); anything else raises ValueError (or TypeError for a non-int). SHA-256
 * is OpenSSL's (libcrypto), which uses the CPU's SHA extensions where there are some. The GIL is
 * released while hashing.
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
    seq = PySequence_Fast(tokens, "token_ids must be a sequence");
    if (seq == NULL) goto done;
    Py_ssize_t num_blocks = PySequence_Fast_GET_SIZE(seq) / block_size;
    Py_ssize_t block_bytes = 4 * block_size;
    payload = PyMem_Malloc((size_t)(num_blocks * block_bytes + HASH_BYTES));
    digests = PyMem_Malloc((size_t)(num_blocks * HASH_BYTES + 1));
    if (payload == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (pack_tokens(seq, num_blocks * block_size, payload) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *parent = root.buf;
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, parent, HASH_BYTES);
        SHA256_Update(&ctx, payload + i * block_bytes, (size_t)block_bytes);
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

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "chain(token_ids, block_size, root) -> chained SHA-256 of every full block"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_hash", "Native chained block hashes.", -1, methods};

PyMODINIT_FUNC PyInit__block_hash(void) { return PyModule_Create(&module); }
