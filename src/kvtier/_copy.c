/* Batched piece copies for the CPU data path.
 *
 * copy_indexed(dst_base, dst_stride, dst_ids, src_base, src_stride, src_ids, sizes, threads)
 * copies piece p of every block b, sizes[p] bytes, from src_base[p] + src_ids[b] * src_stride[p]
 * to the same place on the destination side, computing the addresses here; split across up to
 * num_threads threads by whole blocks. The arguments are contiguous int64 buffers (numpy
 * arrays). It is one pass over the bytes: a gather from per-layer device tensors and a scatter
 * into page-first host blocks happen in the same memcpy, which torch's index_select/index_copy_
 * can only do in two passes through a staging buffer. A copy under 1 MiB on one thread keeps the
 * GIL: it takes microseconds, and a thread that lets the GIL go may wait for another thread's
 * whole switch interval (5 ms) to get it back; larger copies release it.
 *
 * copy_blocks_hashed and copy_blocks_verified take pointer lists (dst_ptrs, src_ptrs, sizes)
 * and hash each block's source pieces as they copy them.
 *
 * copy_scattered(contiguous, pieces, to_pieces, hashes_out, num_threads) copies each object i
 * between one contiguous buffer and its list of piece buffers (a stored object's payload and the
 * device block pieces it spreads over), in order, and hashes each object's source as it goes:
 * hashes_out[i] is the XXH3-64 of the payload either way. Buffers are taken through the buffer
 * protocol (memoryviews, numpy arrays, bytearrays), so their sizes are checked here.
 *
 * The caller guarantees every range is valid and that no two destination ranges overlap; the
 * Python side (kvtier.copier) validates block ids before computing any pointer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include "third_party/xxhash.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#define KV_NAME(x) x##_base
#define KV_KERNEL static
#include "copy_kernels.h"

#if defined(__GNUC__)
__attribute__((visibility("hidden")))
#endif
int kv_streaming_stores = 1;

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_KERNELS 1
/* _copy_avx2.c: the same kernels with AVX2 */
void *copy_hash_span_avx2(void *arg);
void *verify_copy_span_avx2(void *arg);
void *copy_objects_span_avx2(void *arg);
#endif

/* The kernels in use: the baseline ones (SSE2 on x86-64) unless the CPU has AVX2 (chosen in
 * PyInit__copy). */
static void *(*copy_hash_span)(void *) = copy_hash_span_base;
static void *(*verify_copy_span)(void *) = verify_copy_span_base;
static void *(*copy_objects_span)(void *) = copy_objects_span_base;
static const char *kernels = "base";

static void *copy_span(void *arg) {
    const Span *s = (const Span *)arg;
    for (Py_ssize_t i = s->begin; i < s->end; i++) {
        prefetch_next(s->src, i + 1, s->end);
        copy_piece((char *)(intptr_t)s->dst[i], (const char *)(intptr_t)s->src[i],
                   (size_t)s->size[i]);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are visible to other threads before we report done */
#endif
    return NULL;
}

/* Run work(span t) for every t < n: spans 1..n-1 on threads of their own, span 0 (and any span
 * whose thread could not be created) on the calling thread. Call with the GIL released. */
static void run_spans(void *(*work)(void *), void *spans, size_t span_size, int n) {
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    char *base = (char *)spans;
    for (int t = 1; t < n; t++) {
        started[t] = pthread_create(&threads[t], NULL, work, base + t * span_size) == 0;
    }
    work(base);
    for (int t = 1; t < n; t++) {
        if (started[t]) {
            pthread_join(threads[t], NULL);
        } else {
            work(base + t * span_size);
        }
    }
}

static int get_int64_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
         strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0 &&
         strcmp(view->format, "=q") != 0 && strcmp(view->format, "=l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The three int64 arrays of a piece list; on failure nothing stays acquired. */
static int get_piece_buffers(PyObject *dst_obj, PyObject *src_obj, PyObject *size_obj,
                             Py_buffer *dst, Py_buffer *src, Py_buffer *size) {
    if (get_int64_buffer(dst_obj, dst, "dst_ptrs") < 0) return -1;
    if (get_int64_buffer(src_obj, src, "src_ptrs") < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    if (get_int64_buffer(size_obj, size, "sizes") < 0) {
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

/* Pieces of blocks addressed by id: piece p of block b lies at base[p] + id[b] * stride[p]. */
typedef struct {
    const int64_t *base;
    const int64_t *stride;
    const int64_t *ids;
} Indexed;

static int get_indexed(PyObject *base_obj, PyObject *stride_obj, PyObject *ids_obj,
                       Py_buffer views[3], Indexed *out, const char *const names[3]) {
    PyObject *objs[3] = {base_obj, stride_obj, ids_obj};
    for (int k = 0; k < 3; k++) {
        if (get_int64_buffer(objs[k], &views[k], names[k]) < 0) {
            for (int j = 0; j < k; j++) PyBuffer_Release(&views[j]);
            return -1;
        }
    }
    *out = (Indexed){views[0].buf, views[1].buf, views[2].buf};
    return 0;
}

static void release_views(Py_buffer *views, int n) {
    for (int k = 0; k < n; k++) PyBuffer_Release(&views[k]);
}

/* Run copy_span over pointer lists built here, block-major: no temporary arrays in Python. */
static PyObject *copy_indexed(PyObject *self, PyObject *args) {
    PyObject *db, *ds, *di, *sb, *ss, *si, *size_obj;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOi", &db, &ds, &di, &sb, &ss, &si, &size_obj,
                          &num_threads)) {
        return NULL;
    }
    Py_buffer views[7];
    Indexed dst, src;
    static const char *const dst_names[3] = {"dst_base", "dst_stride", "dst_ids"};
    static const char *const src_names[3] = {"src_base", "src_stride", "src_ids"};
    if (get_indexed(db, ds, di, views, &dst, dst_names) < 0) return NULL;
    if (get_indexed(sb, ss, si, views + 3, &src, src_names) < 0) {
        release_views(views, 3);
        return NULL;
    }
    if (get_int64_buffer(size_obj, &views[6], "sizes") < 0) {
        release_views(views, 6);
        return NULL;
    }
    Py_ssize_t pieces = views[6].len / 8, blocks = views[2].len / 8;
    const int64_t *sz = (const int64_t *)views[6].buf;
    if (views[0].len / 8 != pieces || views[1].len / 8 != pieces || views[3].len / 8 != pieces ||
        views[4].len / 8 != pieces || views[5].len / 8 != blocks) {
        PyErr_SetString(PyExc_ValueError,
                        "bases, strides and sizes differ in length, or the id lists do");
        release_views(views, 7);
        return NULL;
    }
    Py_ssize_t n = pieces * blocks;
    int64_t *table = PyMem_Malloc((size_t)(n > 0 ? n : 1) * 3 * sizeof(int64_t));
    if (table == NULL) {
        release_views(views, 7);
        return PyErr_NoMemory();
    }
    int64_t *dp = table, *sp = table + n, *np_ = table + 2 * n, total = 0;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        for (Py_ssize_t p = 0; p < pieces; p++) {
            Py_ssize_t i = b * pieces + p;
            dp[i] = dst.base[p] + dst.ids[b] * dst.stride[p];
            sp[i] = src.base[p] + src.ids[b] * src.stride[p];
            np_[i] = sz[p];
            total += sz[p];
        }
    }
    release_views(views, 7);
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > blocks) num_threads = (int)(blocks > 0 ? blocks : 1);
    Span spans[MAX_THREADS];
    for (int t = 0; t < num_threads; t++) {  /* whole blocks per thread: sizes repeat per block */
        spans[t] = (Span){dp, sp, np_, pieces * (blocks * t / num_threads),
                          pieces * (blocks * (t + 1) / num_threads)};
    }
    if (num_threads == 1 && total < (1 << 20)) {
        run_spans(copy_span, spans, sizeof(Span), 1); /* microseconds: keep the GIL */
    } else {
        Py_BEGIN_ALLOW_THREADS
        run_spans(copy_span, spans, sizeof(Span), num_threads);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(table);
    return PyLong_FromLongLong(total);
}

static PyObject *copy_blocks_hashed(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *size_obj, *hash_obj;
    Py_ssize_t per_block;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOnOi", &dst_obj, &src_obj, &size_obj, &per_block, &hash_obj,
                          &num_threads)) {
        return NULL;
    }
    Py_buffer dst, src, size, hashes;
    if (get_piece_buffers(dst_obj, src_obj, size_obj, &dst, &src, &size) < 0) return NULL;
    if (PyObject_GetBuffer(hash_obj, &hashes, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyBuffer_Release(&size);
        return NULL;
    }
    Py_ssize_t n = dst.len / 8;
    Py_ssize_t blocks = per_block > 0 ? n / per_block : 0;
    PyObject *result = NULL;
    if (src.len / 8 != n || size.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "dst_ptrs, src_ptrs and sizes differ in length");
    } else if (per_block <= 0 || blocks * per_block != n) {
        PyErr_SetString(PyExc_ValueError, "piece count is not a multiple of pieces per block");
    } else if (hashes.len != blocks * 8) {
        PyErr_SetString(PyExc_ValueError, "hashes must hold one uint64 per block");
    } else {
        if (num_threads < 1) num_threads = 1;
        if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
        if (num_threads > blocks) num_threads = (int)(blocks > 0 ? blocks : 1);
        BlockSpan spans[MAX_THREADS];
        for (int t = 0; t < num_threads; t++) {
            spans[t] = (BlockSpan){(const int64_t *)dst.buf, (const int64_t *)src.buf,
                                   (const int64_t *)size.buf, (uint64_t *)hashes.buf, per_block,
                                   blocks * t / num_threads, blocks * (t + 1) / num_threads};
        }
        Py_BEGIN_ALLOW_THREADS
        run_spans(copy_hash_span, spans, sizeof(BlockSpan), num_threads);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(blocks);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&size);
    PyBuffer_Release(&hashes);
    return result;
}

static PyObject *copy_blocks_verified(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *size_obj, *expected_obj, *ok_obj;
    Py_ssize_t per_block;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOnOOi", &dst_obj, &src_obj, &size_obj, &per_block,
                          &expected_obj, &ok_obj, &num_threads)) {
        return NULL;
    }
    Py_buffer dst, src, size, expected, ok;
    if (get_piece_buffers(dst_obj, src_obj, size_obj, &dst, &src, &size) < 0) return NULL;
    if (PyObject_GetBuffer(expected_obj, &expected, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyBuffer_Release(&size);
        return NULL;
    }
    if (PyObject_GetBuffer(ok_obj, &ok, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyBuffer_Release(&size);
        PyBuffer_Release(&expected);
        return NULL;
    }
    Py_ssize_t n = dst.len / 8;
    Py_ssize_t blocks = per_block > 0 ? n / per_block : 0;
    PyObject *result = NULL;
    if (src.len / 8 != n || size.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "dst_ptrs, src_ptrs and sizes differ in length");
    } else if (per_block <= 0 || blocks * per_block != n) {
        PyErr_SetString(PyExc_ValueError, "piece count is not a multiple of pieces per block");
    } else if (expected.len != blocks * 8 || ok.len != blocks) {
        PyErr_SetString(PyExc_ValueError, "expected needs one uint64 and ok one uint8 per block");
    } else {
        if (num_threads < 1) num_threads = 1;
        if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
        if (num_threads > blocks) num_threads = (int)(blocks > 0 ? blocks : 1);
        VerifySpan spans[MAX_THREADS];
        for (int t = 0; t < num_threads; t++) {
            spans[t] = (VerifySpan){(const int64_t *)dst.buf,      (const int64_t *)src.buf,
                                    (const int64_t *)size.buf,     (const uint64_t *)expected.buf,
                                    (uint8_t *)ok.buf,             per_block,
                                    blocks * t / num_threads,      blocks * (t + 1) / num_threads};
        }
        Py_BEGIN_ALLOW_THREADS
        run_spans(verify_copy_span, spans, sizeof(VerifySpan), num_threads);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(blocks);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&size);
    PyBuffer_Release(&expected);
    PyBuffer_Release(&ok);
    return result;
}

/* The buffers of one scattered copy, held until the copy is done. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t held;
    int64_t *table; /* dst, src, size: 3 * pieces */
    Py_ssize_t *first;
} Scatter;

static void scatter_free(Scatter *sc) {
    for (Py_ssize_t k = 0; k < sc->held; k++) PyBuffer_Release(&sc->views[k]);
    PyMem_Free(sc->views);
    PyMem_Free(sc->table);
    PyMem_Free(sc->first);
}

/* Take every buffer and lay out the piece table; -1 with an exception set on failure. */
static int scatter_take(Scatter *sc, PyObject *whole, PyObject *parts, int to_pieces,
                        Py_ssize_t *pieces_out, int64_t *total_out) {
    Py_ssize_t n = PyList_GET_SIZE(whole), pieces = 0;
    for (Py_ssize_t o = 0; o < n; o++) {
        PyObject *row = PyList_GET_ITEM(parts, o);
        if (!PyList_Check(row) && !PyTuple_Check(row)) {
            PyErr_Format(PyExc_TypeError, "pieces[%zd] must be a list of buffers", o);
            return -1;
        }
        pieces += PySequence_Fast_GET_SIZE(row);
    }
    sc->views = PyMem_Calloc((size_t)(n + pieces + 1), sizeof(Py_buffer));
    sc->table = PyMem_Malloc((size_t)(pieces + 1) * 3 * sizeof(int64_t));
    sc->first = PyMem_Malloc((size_t)(n + 1) * sizeof(Py_ssize_t));
    if (sc->views == NULL || sc->table == NULL || sc->first == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int whole_flags = to_pieces ? PyBUF_SIMPLE : PyBUF_WRITABLE;
    int piece_flags = to_pieces ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    int64_t *dst = sc->table, *src = sc->table + pieces, *size = sc->table + 2 * pieces;
    Py_ssize_t i = 0;
    int64_t total = 0;
    for (Py_ssize_t o = 0; o < n; o++) {
        Py_buffer *object = &sc->views[sc->held];
        if (PyObject_GetBuffer(PyList_GET_ITEM(whole, o), object, whole_flags) < 0) return -1;
        sc->held++;
        PyObject *row = PyList_GET_ITEM(parts, o);
        Py_ssize_t count = PySequence_Fast_GET_SIZE(row), offset = 0;
        sc->first[o] = i;
        for (Py_ssize_t k = 0; k < count; k++, i++) {
            Py_buffer *piece = &sc->views[sc->held];
            PyObject *item = PySequence_Fast_GET_ITEM(row, k);
            if (PyObject_GetBuffer(item, piece, piece_flags) < 0) return -1;
            sc->held++;
            if (offset + piece->len > object->len) break;
            char *at = (char *)object->buf + offset;
            dst[i] = (int64_t)(intptr_t)(to_pieces ? (char *)piece->buf : at);
            src[i] = (int64_t)(intptr_t)(to_pieces ? at : (char *)piece->buf);
            size[i] = piece->len;
            offset += piece->len;
        }
        if (offset != object->len || i != sc->first[o] + count) {
            PyErr_Format(PyExc_ValueError, "object %zd: its pieces do not add up to its %zd bytes",
                         o, object->len);
            return -1;
        }
        total += offset;
    }
    sc->first[n] = i;
    *pieces_out = pieces;
    *total_out = total;
    return 0;
}

static PyObject *copy_scattered(PyObject *self, PyObject *args) {
    PyObject *whole, *parts, *hash_obj;
    int to_pieces, num_threads;
    if (!PyArg_ParseTuple(args, "O!O!pOi", &PyList_Type, &whole, &PyList_Type, &parts,
                          &to_pieces, &hash_obj, &num_threads)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(whole);
    if (PyList_GET_SIZE(parts) != n) {
        PyErr_SetString(PyExc_ValueError, "one list of pieces per contiguous buffer");
        return NULL;
    }
    Py_buffer hashes = {0};
    if (hash_obj != Py_None) {
        if (PyObject_GetBuffer(hash_obj, &hashes, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            return NULL;
        }
        if (hashes.len != n * 8) {
            PyBuffer_Release(&hashes);
            PyErr_SetString(PyExc_ValueError, "hashes_out must hold one uint64 per object");
            return NULL;
        }
    }
    Scatter sc = {0};
    Py_ssize_t pieces = 0;
    int64_t total = 0;
    PyObject *result = NULL;
    if (scatter_take(&sc, whole, parts, to_pieces, &pieces, &total) == 0) {
        if (num_threads < 1) num_threads = 1;
        if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
        if (num_threads > n) num_threads = (int)(n > 0 ? n : 1);
        ObjectSpan spans[MAX_THREADS];
        for (int t = 0; t < num_threads; t++) {
            spans[t] = (ObjectSpan){sc.table, sc.table + pieces, sc.table + 2 * pieces, sc.first,
                                    hash_obj != Py_None ? (uint64_t *)hashes.buf : NULL,
                                    n * t / num_threads, n * (t + 1) / num_threads};
        }
        if (num_threads == 1 && total < (1 << 20)) {
            run_spans(copy_objects_span, spans, sizeof(ObjectSpan), 1); /* keep the GIL */
        } else {
            Py_BEGIN_ALLOW_THREADS
            run_spans(copy_objects_span, spans, sizeof(ObjectSpan), num_threads);
            Py_END_ALLOW_THREADS
        }
        result = PyLong_FromLongLong(total);
    }
    scatter_free(&sc);
    if (hash_obj != Py_None) PyBuffer_Release(&hashes);
    return result;
}

static PyObject *set_streaming(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    int previous = kv_streaming_stores;
    kv_streaming_stores = flag;
    return PyBool_FromLong(previous);
}

static PyObject *streaming(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(kv_streaming_stores);
}

static PyMethodDef methods[] = {
    {"set_streaming", set_streaming, METH_VARARGS,
     "set_streaming(flag) -> the previous setting; pieces of 4 KiB or more are written with"
     " streaming (non-temporal) stores when set, through the cache otherwise"},
    {"streaming", streaming, METH_NOARGS, "streaming() -> whether streaming stores are used"},
    {"copy_blocks_hashed", copy_blocks_hashed, METH_VARARGS,
     "copy_blocks_hashed(dst_ptrs, src_ptrs, sizes, pieces_per_block, hashes_out, num_threads)"
     " -> blocks copied; hashes_out[b] = XXH3-64 of block b's source pieces in order"},
    {"copy_blocks_verified", copy_blocks_verified, METH_VARARGS,
     "copy_blocks_verified(dst_ptrs, src_ptrs, sizes, pieces_per_block, expected, ok, threads)"
     " -> blocks; block b is copied only if ok[b] on entry and its source hashes to expected[b]"},
    {"copy_indexed", copy_indexed, METH_VARARGS,
     "copy_indexed(dst_base, dst_stride, dst_ids, src_base, src_stride, src_ids, sizes, threads)"
     " -> total bytes; piece p of block b: base[p] + ids[b] * stride[p], sizes[p] bytes"},
    {"copy_scattered", copy_scattered, METH_VARARGS,
     "copy_scattered(contiguous, pieces, to_pieces, hashes_out, num_threads) -> total bytes;"
     " object i: contiguous[i] <-> the buffers of pieces[i] in order; hashes_out[i] (or None) ="
     " XXH3-64 of object i's bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

/* KVTIER_COPY_BASELINE=1 keeps the baseline kernels (the tests compare both sets). */
PyMODINIT_FUNC PyInit__copy(void) {
#ifdef HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    const char *baseline = getenv("KVTIER_COPY_BASELINE");
    if (__builtin_cpu_supports("avx2") && (baseline == NULL || baseline[0] == '\0')) {
        copy_hash_span = copy_hash_span_avx2;
        verify_copy_span = verify_copy_span_avx2;
        copy_objects_span = copy_objects_span_avx2;
        kernels = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "kernels", kernels) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
