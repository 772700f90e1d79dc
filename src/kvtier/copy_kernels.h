/* The copy kernels of kvtier._copy, compiled twice into one module: in _copy.c for any x86-64
 * (SSE2) and in _copy_avx2.c with AVX2 enabled, where XXH3 hashes a wider stripe per step (a
 * hashed copy on one thread: ~20 % faster here). _copy.c picks one set when it is imported, from
 * the CPU's features. The includer defines KV_NAME(x) (this set's function names) and
 * KV_KERNEL (their linkage), and includes Python.h, xxhash.h (XXH_INLINE_ALL), stdint.h,
 * string.h and, with SSE2, emmintrin.h / xmmintrin.h first. */

#define MAX_THREADS 64
/* Pieces at least this large are written with non-temporal stores: they skip the
 * read-for-ownership of the destination, so a copy moves 2 bytes of memory traffic per byte
 * instead of 3. Swapped-out blocks are not read again soon, so bypassing the cache costs nothing.
 */
#define STREAM_MIN_BYTES 4096
/* Whether such pieces are written with streaming stores (1) or through the cache (0): which is
 * faster depends on the host, so kvtier.memory.stores times both and sets this (set_streaming).
 * Both write the same bytes; a copy that reads it while it changes uses either kind. */
extern int kv_streaming_stores;
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1024
#endif

typedef struct {
    const int64_t *dst;
    const int64_t *src;
    const int64_t *size;
    Py_ssize_t begin;
    Py_ssize_t end;
} Span;

static inline void copy_piece(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= STREAM_MIN_BYTES && kv_streaming_stores) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t off = 0; off < body; off += 64) {
            _mm_prefetch(src + off + PREFETCH_AHEAD, _MM_HINT_NTA);
            __m128i a = _mm_loadu_si128((const __m128i *)(src + off));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + off + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + off + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + off + 48));
            _mm_stream_si128((__m128i *)(dst + off), a);
            _mm_stream_si128((__m128i *)(dst + off + 16), b);
            _mm_stream_si128((__m128i *)(dst + off + 32), c);
            _mm_stream_si128((__m128i *)(dst + off + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Start fetching the next piece while this one is copied: pieces of a gather are scattered. */
static inline void prefetch_next(const int64_t *src, Py_ssize_t next, Py_ssize_t end) {
#if defined(__SSE2__)
    if (next < end) {
        const char *p = (const char *)(intptr_t)src[next];
        for (int k = 0; k < PREFETCH_AHEAD; k += 64) _mm_prefetch(p + k, _MM_HINT_NTA);
    }
#else
    (void)src, (void)next, (void)end;
#endif
}

/* Blocks [begin, end) of a hashed copy: each block is `per_block` consecutive pieces. */
typedef struct {
    const int64_t *dst;
    const int64_t *src;
    const int64_t *size;
    uint64_t *hashes;
    Py_ssize_t per_block;
    Py_ssize_t begin;
    Py_ssize_t end;
} BlockSpan;

/* Copy each piece, then hash its source while it is still in cache: the XXH3-64 of a block's
 * pieces in order equals the XXH3-64 of the page-first block, with no second pass over memory. */
KV_KERNEL void *KV_NAME(copy_hash_span)(void *arg) {
    const BlockSpan *s = (const BlockSpan *)arg;
    XXH3_state_t state;
    for (Py_ssize_t b = s->begin; b < s->end; b++) {
        XXH3_64bits_reset(&state);
        for (Py_ssize_t i = b * s->per_block; i < (b + 1) * s->per_block; i++) {
            const char *src = (const char *)(intptr_t)s->src[i];
            copy_piece((char *)(intptr_t)s->dst[i], src, (size_t)s->size[i]);
            XXH3_64bits_update(&state, src, (size_t)s->size[i]);
        }
        s->hashes[b] = XXH3_64bits_digest(&state);
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return NULL;
}

/* Blocks [begin, end) of a verified copy: each block's source pieces are hashed first (which
 * brings them into cache) and copied only when the hash equals the expected one, so a block
 * that fails verification never reaches its destination. ok[b] says which blocks were copied. */
typedef struct {
    const int64_t *dst;
    const int64_t *src;
    const int64_t *size;
    const uint64_t *expected;
    uint8_t *ok;
    Py_ssize_t per_block;
    Py_ssize_t begin;
    Py_ssize_t end;
} VerifySpan;

KV_KERNEL void *KV_NAME(verify_copy_span)(void *arg) {
    const VerifySpan *s = (const VerifySpan *)arg;
    XXH3_state_t state;
    for (Py_ssize_t b = s->begin; b < s->end; b++) {
        Py_ssize_t first = b * s->per_block, last = (b + 1) * s->per_block;
        XXH3_64bits_reset(&state);
        for (Py_ssize_t i = first; i < last; i++) {
            XXH3_64bits_update(&state, (const char *)(intptr_t)s->src[i], (size_t)s->size[i]);
        }
        s->ok[b] = s->ok[b] && XXH3_64bits_digest(&state) == s->expected[b];
        if (!s->ok[b]) continue;
        for (Py_ssize_t i = first; i < last; i++) {
            /* Just hashed, so still in cache: a plain memcpy beats streaming stores here. */
            memcpy((char *)(intptr_t)s->dst[i], (const char *)(intptr_t)s->src[i],
                   (size_t)s->size[i]);
        }
    }
    return NULL;
}

/* A piece is copied and hashed this many bytes at a time: hashed right after its copy, the
 * source is still in cache (a whole 1 MiB piece is not). */
#define HASH_CHUNK (32 << 10)

/* Objects [begin, end) of a scattered copy: object o is pieces first[o] .. first[o + 1] - 1,
 * each hashed (its source, still in cache) right after it is copied. */
typedef struct {
    const int64_t *dst;
    const int64_t *src;
    const int64_t *size;
    const Py_ssize_t *first;
    uint64_t *hashes; /* NULL: no hashes wanted */
    Py_ssize_t begin;
    Py_ssize_t end;
} ObjectSpan;

KV_KERNEL void *KV_NAME(copy_objects_span)(void *arg) {
    const ObjectSpan *s = (const ObjectSpan *)arg;
    XXH3_state_t state;
    for (Py_ssize_t o = s->begin; o < s->end; o++) {
        if (s->hashes != NULL) XXH3_64bits_reset(&state);
        for (Py_ssize_t i = s->first[o]; i < s->first[o + 1]; i++) {
            const char *src = (const char *)(intptr_t)s->src[i];
            char *dst = (char *)(intptr_t)s->dst[i];
            size_t size = (size_t)s->size[i];
            if (s->hashes == NULL) {
                copy_piece(dst, src, size);
                continue;
            }
            for (size_t off = 0; off < size; off += HASH_CHUNK) { /* hashed while in L1/L2 */
                size_t n = size - off < HASH_CHUNK ? size - off : HASH_CHUNK;
                copy_piece(dst + off, src + off, n);
                XXH3_64bits_update(&state, src + off, n);
            }
        }
        if (s->hashes != NULL) s->hashes[o] = XXH3_64bits_digest(&state);
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return NULL;
}
