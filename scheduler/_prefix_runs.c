/* The walk of scheduler/kv_index.py's prefix match, without a Python loop per block.
 *
 * prefix_runs(holders, hashes) -> [(i, value), ...]: walking hashes in order, each position i where
 * holders.get(hashes[i]) is not the same object as at i - 1 (position 0 always), with that value. The walk
 * ends at the first hash holders lacks, reported with the value None: chained hashes, so no instance holds
 * a later block of the prompt as part of its prefix. The index interns its values (blocks held by the same
 * instances share one tuple), so along a shared prefix a run is long and the list short: a 100k-token prompt
 * is 6,250 lookups and a few runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int append_run(PyObject *runs, Py_ssize_t i, PyObject *value) {
    PyObject *run = Py_BuildValue("(nO)", i, value);
    if (run == NULL) return -1;
    int failed = PyList_Append(runs, run);
    Py_DECREF(run);
    return failed;
}

static PyObject *prefix_runs(PyObject *self, PyObject *args) {
    PyObject *holders, *hashes;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &holders, &hashes)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *runs = PyList_New(0);
    if (runs == NULL) goto fail;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *current = NULL; /* borrowed from holders; compared by identity only */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyDict_GetItemWithError(holders, items[i]);
        if (value == NULL) {
            if (PyErr_Occurred() || append_run(runs, i, Py_None) < 0) goto fail;
            break;
        }
        if (value != current) {
            if (append_run(runs, i, value) < 0) goto fail;
            current = value;
        }
    }
    Py_DECREF(seq);
    return runs;
fail:
    Py_XDECREF(runs);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"prefix_runs", prefix_runs, METH_VARARGS,
     "prefix_runs(holders, hashes) -> [(i, holders.get(hashes[i]))] where the value changes, until a miss"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefix_runs", "The prefix match's walk, in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__prefix_runs(void) { return PyModule_Create(&module); }
