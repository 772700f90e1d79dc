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
/* A streaming copy walks this many 4 KiB pages side by side, a cache line of each in turn, as
 * glibc's own copy of ranges beyond its non-temporal threshold does. On stop 52's host, 1 MiB
 * pieces on one thread: line after line of one page (stop 51's loop) 5.3 GB/s, four pages
 * interleaved 10.4, memcpy (rep movsb below glibc's threshold) 6.5; two threads: 10.7 / 20 /
 * 12.6; two or eight pages: a little slower than four. */
#define STREAM_PAGE 4096
#define STREAM_PAGES 4
/* Each line's source is fetched this far ahead into all cache levels: a far (1 KiB) fetch that
 * skips the outer caches was what made line after line slow. */
#define STREAM_FETCH 128

typedef struct {
    const int64_t *dst;
    const int64_t *src;
    const int64_t *size;
    Py_ssize_t begin;
    Py_ssize_t end;
} Span;

#if defined(__SSE2__)
/* One 64-byte line into dst (16-byte aligned; whole lines when 64-byte aligned) with
 * non-temporal stores, the source `fetch` bytes ahead fetched into all cache levels. */
static inline void stream_line_ahead(char *dst, const char *src, size_t fetch) {
    _mm_prefetch(src + fetch, _MM_HINT_T0);
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}

static inline void stream_line(char *dst, const char *src) {
    stream_line_ahead(dst, src, STREAM_FETCH);
}

/* The whole lines from src to its next page boundary (as near as whole lines get), at most
 * n's whole lines. A streaming copy walks pages of the source: groups that straddle page
 * boundaries (a store's payloads sit 64 bytes past each slot's header) ran 8-11 % slower on
 * stop 53's host, 1 MiB objects at every 64-byte offset: 20.2 GB/s, hashed 18.9; page-aligned
 * 21.9 / 21.2. (The destination's offset made no difference.) */
static inline size_t to_source_page(const char *src, size_t n) {
    size_t head = (STREAM_PAGE - ((uintptr_t)src & (STREAM_PAGE - 1))) & (STREAM_PAGE - 1);
    head &= ~(size_t)63;
    return head < n ? head : n & ~(size_t)63;
}

/* Whole pages left from done: a group of up to STREAM_PAGES of them (0: less than a page). */
static inline size_t group_pages(size_t n, size_t done) {
    size_t pages = (n - done) / STREAM_PAGE;
    return pages < STREAM_PAGES ? pages : STREAM_PAGES;
}

/* n bytes into dst (64-byte aligned) with non-temporal stores: lines up to the source's next
 * page, then groups of up to STREAM_PAGES pages a line of each page in turn, then the lines
 * left one after another, then the last bytes through memcpy. */
static inline void stream_copy(char *dst, const char *src, size_t n) {
    size_t done = to_source_page(src, n), pages;
    for (size_t at = 0; at < done; at += 64) stream_line(dst + at, src + at);
    for (; (pages = group_pages(n, done)) != 0; done += pages * STREAM_PAGE) {
        for (size_t off = 0; off < STREAM_PAGE; off += 64) {
            for (size_t p = 0; p < pages; p++) {
                size_t at = done + p * STREAM_PAGE + off;
                stream_line(dst + at, src + at);
            }
        }
    }
    for (; done + 64 <= n; done += 64) stream_line(dst + done, src + done);
    memcpy(dst + done, src + done, n - done);
}
#endif

static inline void copy_piece(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= STREAM_MIN_BYTES && kv_streaming_stores) {
        size_t head = (64 - ((uintptr_t)dst & 63)) & 63; /* whole lines from here on */
        memcpy(dst, src, head);
        stream_copy(dst + head, src + head, n - head);
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

#if defined(__SSE2__)
/* Lines a fused copy (below) copies and hashes one by one fetch their source this far ahead. */
#define FUSED_FETCH 1024

/* The bytes of pieces [first, last) when a fused copy can take them (else 0): streaming stores
 * are in use and every piece is whole 64-byte lines (so no XXH3 stripe straddles two pieces) at
 * a 64-byte aligned destination (streamed lines that straddle two cache lines ran at half the
 * speed): a device block's pieces, a store's payload. */
static inline size_t fusable_bytes(const int64_t *dst, const int64_t *size, Py_ssize_t first,
                                   Py_ssize_t last) {
    if (!kv_streaming_stores) return 0;
    size_t total = 0;
    for (Py_ssize_t i = first; i < last; i++) {
        if (size[i] % 64 != 0 || ((uintptr_t)dst[i] & 63) != 0) return 0;
        total += (size_t)size[i];
    }
    return total >= STREAM_MIN_BYTES ? total : 0;
}

/* XXH3-64 over a fused copy: XXH3_hashLong_64b's steps with the default secret, fed one 64-byte
 * stripe at a time (the accumulators scrambled after every 16 stripes; the object's last line is
 * also its "last stripe"), so the value is XXH3_64bits of the bytes (the tests compare). */
typedef struct {
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB];
    size_t stripe;   /* stripes fed so far */
    size_t last;     /* the index of the object's last line */
    const char *lag; /* lines copied and not yet hashed (a group of pages), */
    size_t lagging;  /* how many */
} FusedHash;

static inline void fused_stripe(FusedHash *h, const char *line) {
    const xxh_u8 *secret = XXH3_kSecret;
    const size_t per_block = (XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    if (h->stripe < h->last) {
        XXH3_accumulate_512(h->acc, line,
                            secret + (h->stripe % per_block) * XXH_SECRET_CONSUME_RATE);
        if ((h->stripe + 1) % per_block == 0) {
            XXH3_scrambleAcc(h->acc, secret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN);
        }
    } else {
        XXH3_accumulate_512(h->acc, line,
                            secret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN -
                                XXH_SECRET_LASTACC_START);
    }
    h->stripe++;
}

static inline void fused_flush(FusedHash *h) {
    for (size_t k = 0; k < h->lagging; k++) fused_stripe(h, h->lag + k * XXH_STRIPE_LEN);
    h->lagging = 0;
}

/* Lines copied and hashed one by one (the source fetched further ahead), the lag first. */
static inline void fused_lines(FusedHash *h, char *dst, const char *src, size_t n) {
    fused_flush(h);
    for (size_t at = 0; at < n; at += XXH_STRIPE_LEN) {
        stream_line_ahead(dst + at, src + at, FUSED_FETCH);
        fused_stripe(h, src + at);
    }
}

/* One piece (whole lines) of a fused copy, walking the source's pages as stream_copy does.
 * Groups of pages are copied a line of each page in turn while the previous group, read a
 * moment ago and still in L1, is hashed in order (as many of its lines per turn as the group
 * has pages): the copy keeps its pace and the hash runs beside it. Lines before the source's
 * first page boundary and after its last whole page are copied and hashed one by one. */
static inline void fused_piece(FusedHash *h, char *dst, const char *src, size_t n) {
    size_t done = to_source_page(src, n), pages;
    if (done != 0) fused_lines(h, dst, src, done);
    for (; (pages = group_pages(n, done)) != 0; done += pages * STREAM_PAGE) {
        const char *group = src + done;
        char *to = dst + done;
        for (size_t off = 0; off < STREAM_PAGE; off += 64) {
            for (size_t p = 0; p < pages; p++) {
                stream_line(to + p * STREAM_PAGE + off, group + p * STREAM_PAGE + off);
            }
            for (size_t p = 0; p < pages && h->lagging != 0; p++, h->lagging--) {
                fused_stripe(h, h->lag);
                h->lag += XXH_STRIPE_LEN;
            }
        }
        fused_flush(h); /* what a smaller group left of a larger lag */
        h->lag = group;
        h->lagging = pages * STREAM_PAGE / XXH_STRIPE_LEN;
    }
    if (done != n) fused_lines(h, dst + done, src + done, n - done);
}

/* Copy pieces [first, last) (fusable_bytes: len in all) and return the XXH3-64 of their bytes
 * in order, each line read from memory once. On stop 52's host, two threads, 1 MiB objects in
 * 4 KiB pages: copy then hash 15.5-16 GB/s, line by line (copy and hash each line) 13.5, this
 * 18.3-19.1 (copy alone 19.6). */
static inline uint64_t copy_hash_fused(const int64_t *dst, const int64_t *src, const int64_t *size,
                                       Py_ssize_t first, Py_ssize_t last, size_t len) {
    FusedHash h = {XXH3_INIT_ACC, 0, len / XXH_STRIPE_LEN - 1, NULL, 0};
    for (Py_ssize_t i = first; i < last; i++) {
        fused_piece(&h, (char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i],
                    (size_t)size[i]);
    }
    fused_flush(&h);
    return XXH3_mergeAccs(h.acc, XXH3_kSecret + XXH_SECRET_MERGEACCS_START,
                          (xxh_u64)len * XXH_PRIME64_1);
}
#endif

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
#if defined(__SSE2__)
        size_t fused = fusable_bytes(s->dst, s->size, b * s->per_block, (b + 1) * s->per_block);
        if (fused) {
            s->hashes[b] = copy_hash_fused(s->dst, s->src, s->size, b * s->per_block,
                                           (b + 1) * s->per_block, fused);
            continue;
        }
#endif
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
            /* Just hashed, so in cache: streamed from there (stop 52's host: 8.5-9.4 GB/s with
             * memcpy, 10.5-12.5 with copy_piece's streaming stores, two threads). */
            copy_piece((char *)(intptr_t)s->dst[i], (const char *)(intptr_t)s->src[i],
                       (size_t)s->size[i]);
        }
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
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
#if defined(__SSE2__)
        size_t fused = s->hashes != NULL ? fusable_bytes(s->dst, s->size, s->first[o],
                                                         s->first[o + 1])
                                         : 0;
        if (fused) {
            s->hashes[o] =
                copy_hash_fused(s->dst, s->src, s->size, s->first[o], s->first[o + 1], fused);
            continue;
        }
#endif
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
