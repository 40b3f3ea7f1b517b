/* Token copies between serving-engine KV caches and contiguous KV blobs, for CPU tensors.
 *
 * A blob holds [2][n_layers][n_tokens][row] (K of every layer, then V), row = heads * head_size
 * elements. Threads: work is split over independent pieces with dynamic scheduling, and only when
 * there is enough of it (PARALLEL_MIN_BYTES): a parallel region waits for its slowest thread, so
 * small copies on a busy machine are faster on one thread.
 * direction 0: cache -> blob (gather); direction 1: blob -> cache (scatter). Both take all chunks of
 * a request in one call; a negative slot is skipped when scattering. lmc_paged_copy rejects it when
 * gathering; lmc_packed_copy writes zeros for it (a token a layer's KV cache group does not
 * hold). Both return 0, or -1 if a slot is out of range (nothing is copied then).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86_PATHS 1
#endif

#define PARALLEL_MIN_BYTES (4 << 20)
/* Packed copies at least this large write whole 64-byte lines with non-temporal stores: a copy
 * that does not fit in the caches then moves each line once instead of reading it first. */
#define STREAM_MIN_BYTES (8 << 20)

/* Each thread that streamed orders its lines before the parallel region ends (the region's
 * barrier does not order non-temporal stores on every CPU). */
#if defined(HAVE_X86_PATHS)
#define STREAM_FENCE(stream) do { if (stream) _mm_sfence(); } while (0)
#else
#define STREAM_FENCE(stream) do { (void)(stream); } while (0)
#endif

static int threads_for(int64_t bytes, int nthreads) {
    return bytes >= PARALLEL_MIN_BYTES && nthreads > 1 ? nthreads : 1;
}

/* The widest vector instructions the packed copies use on this CPU (checked at run time: the
 * library is built without -march). LMCACHE_COPY_ISA=sse2 caps it, so every path can be
 * tested (and compared) on one machine. */
enum { ISA_SSE2 = 0, ISA_AVX512 = 1 };
static int copy_isa(void) {
    int level = ISA_SSE2;
#if defined(HAVE_X86_PATHS)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) level = ISA_AVX512;
#endif
    const char *cap = getenv("LMCACHE_COPY_ISA");
    if (cap != NULL && strcmp(cap, "sse2") == 0) level = ISA_SSE2;
    return level;
}

/* Paged caches where each source s (2 * n_layers of them) is [num_slots][row_bytes]. A batch of
 * chunks: chunk c covers slots[chunk_starts[c] .. chunk_starts[c+1]) and its blob (at
 * chunk_bufs[c]) holds source s's rows at s * n_c * row_bytes. Within a chunk the slots are cut
 * into runs of consecutive ids and each run moves with one memcpy, so a block-aligned slot mapping
 * copies whole blocks (or more) at a time; the whole batch is one parallel region. Negative slots
 * are rejected when gathering and skipped when scattering (tokens the engine already holds). */
int lmc_paged_copy(const uint64_t *paged_ptrs, int64_t n_src, int64_t num_slots,
                   const int64_t *slots, const int64_t *chunk_starts, const uint64_t *chunk_bufs,
                   int64_t n_chunks, int64_t row_bytes, int direction, int nthreads) {
    int64_t n_tokens = chunk_starts[n_chunks];
    if (n_tokens <= 0) return 0;
    for (int64_t t = 0; t < n_tokens; t++)
        if (slots[t] >= num_slots || (slots[t] < 0 && direction == 0)) return -1;
    int64_t *run_start = (int64_t *)malloc(sizeof(int64_t) * n_tokens);
    int64_t *run_len = (int64_t *)malloc(sizeof(int64_t) * n_tokens);
    int64_t *run_chunk = (int64_t *)malloc(sizeof(int64_t) * n_tokens);
    if (!run_start || !run_len || !run_chunk) {
        free(run_start);
        free(run_len);
        free(run_chunk);
        return -2;
    }
    int64_t n_runs = 0;
    for (int64_t c = 0; c < n_chunks; c++)
        for (int64_t t = chunk_starts[c]; t < chunk_starts[c + 1]; t++) {
            if (slots[t] < 0) continue;
            if (t > chunk_starts[c] && slots[t - 1] >= 0 && slots[t] == slots[t - 1] + 1) {
                run_len[n_runs - 1]++;
                continue;
            }
            run_chunk[n_runs] = c;
            run_start[n_runs] = t;
            run_len[n_runs++] = 1;
        }

    int64_t total = n_src * n_runs;
    int nt = threads_for(n_src * n_tokens * row_bytes, nthreads);
    #pragma omp parallel for schedule(dynamic, 16) num_threads(nt) if (nt > 1)
    for (int64_t w = 0; w < total; w++) {
        int64_t s = w / n_runs, r = w % n_runs, c = run_chunk[r];
        int64_t t0 = run_start[r], len = run_len[r];
        int64_t chunk_len = chunk_starts[c + 1] - chunk_starts[c];
        char *paged = (char *)(uintptr_t)paged_ptrs[s] + slots[t0] * row_bytes;
        char *flat = (char *)(uintptr_t)chunk_bufs[c]
                     + (s * chunk_len + (t0 - chunk_starts[c])) * row_bytes;
        if (direction == 0) memcpy(flat, paged, len * row_bytes);
        else memcpy(paged, flat, len * row_bytes);
    }
    free(run_start);
    free(run_len);
    free(run_chunk);
    return 0;
}

/* vLLM-CPU's packed caches, "vec" ISA layout: layer l is [num_blocks][heads][2][bs * hs]; inside a
 * (block, head) slab, K is dim-major (element (t, j) at j * bs + t) and V token-major (t * hs + j);
 * elem is 2 or 4 bytes. Runs of consecutive slots in one block move K with transposes: 8x8 (2-byte)
 * or 4x4 (4-byte) with SSE2, 32x32 / 16x16 with AVX-512 where hs allows. `packed_runs` (below)
 * walks a batch for either layout. */
#if defined(__SSE2__)
static inline void transpose8x8_u16(__m128i r[8]) {
    __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
    __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
    __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    r[0] = _mm_unpacklo_epi64(b0, b4); r[1] = _mm_unpackhi_epi64(b0, b4);
    r[2] = _mm_unpacklo_epi64(b1, b5); r[3] = _mm_unpackhi_epi64(b1, b5);
    r[4] = _mm_unpacklo_epi64(b2, b6); r[5] = _mm_unpackhi_epi64(b2, b6);
    r[6] = _mm_unpacklo_epi64(b3, b7); r[7] = _mm_unpackhi_epi64(b3, b7);
}

static inline void transpose4x4_u32(__m128i r[4]) {
    __m128i a0 = _mm_unpacklo_epi32(r[0], r[1]), a1 = _mm_unpackhi_epi32(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi32(r[2], r[3]), a3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(a0, a2); r[1] = _mm_unpackhi_epi64(a0, a2);
    r[2] = _mm_unpacklo_epi64(a1, a3); r[3] = _mm_unpackhi_epi64(a1, a3);
}

/* K of `r` tokens (a multiple of w = 16 / elem) at block offsets o..o+r-1 <-> blob rows k (stride
 * `row` bytes), in w x w tiles of one register per row (8x8 2-byte or 4x4 4-byte values), dims
 * outermost so each slab row of a tile row is read front to back. Inline: callers pass elem as a
 * constant, so each element size gets its own unrolled loop. */
static inline void k_tiles_sse2(char *slab, int64_t bs, int64_t hs, int64_t elem, int64_t o, int64_t r,
                                char *k, int64_t row, int direction) {
    const int64_t w = 16 / elem;
    __m128i x[8];
    for (int64_t j0 = 0; j0 < hs; j0 += w) {
        for (int64_t t = 0; t < r; t += w) {
            char *cache = slab + (j0 * bs + o + t) * elem, *blob = k + t * row + j0 * elem;
            char *from = direction == 0 ? cache : blob, *to = direction == 0 ? blob : cache;
            int64_t from_stride = direction == 0 ? bs * elem : row, to_stride = direction == 0 ? row : bs * elem;
            for (int64_t q = 0; q < w; q++) x[q] = _mm_loadu_si128((const __m128i *)(from + q * from_stride));
            if (elem == 2) transpose8x8_u16(x);
            else transpose4x4_u32(x);
            for (int64_t q = 0; q < w; q++) _mm_storeu_si128((__m128i *)(to + q * to_stride), x[q]);
        }
    }
}
#endif

#if defined(HAVE_X86_PATHS)
/* AVX-512 (F + BW) forms, on CPUs that have it (every CPU with AMX does): whole 64-byte rows. */
#define AVX512 __attribute__((target("avx512f,avx512bw")))

/* A 64-byte store; non-temporal (no read of the line first, not kept in the caches) when `stream`
 * is set and the line is whole. Callers that stream end with _mm_sfence. */
AVX512 static inline void store_line(void *p, __m512i x, int stream) {
    if (stream && ((uintptr_t)p & 63) == 0) _mm512_stream_si512(p, x);
    else _mm512_storeu_si512(p, x);
}

/* Lane L of result q is lane q of s[L] (a 4x4 transpose of 128-bit lanes). */
AVX512 static inline void transpose_lanes4(__m512i s[4]) {
    __m512i x0 = _mm512_shuffle_i32x4(s[0], s[1], 0x44), x1 = _mm512_shuffle_i32x4(s[0], s[1], 0xEE);
    __m512i x2 = _mm512_shuffle_i32x4(s[2], s[3], 0x44), x3 = _mm512_shuffle_i32x4(s[2], s[3], 0xEE);
    s[0] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    s[1] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    s[2] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    s[3] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
}

/* dst[m][i] = src[i][m] for a 32 x 32 block of 2-byte values (row strides in elements): an 8x8
 * transpose inside each 128-bit lane of 8 rows at a time, then the lanes of 4 such groups. */
AVX512 static void transpose32x32_u16(const uint16_t *src, int64_t ss, uint16_t *dst, int64_t ds, int stream) {
    __m512i s[4][8];
    for (int g = 0; g < 4; g++) {
        __m512i r[8], a[8], b[8];
        for (int q = 0; q < 8; q++) r[q] = _mm512_loadu_si512(src + (8 * g + q) * ss);
        for (int q = 0; q < 8; q += 2) {
            a[q] = _mm512_unpacklo_epi16(r[q], r[q + 1]);
            a[q + 1] = _mm512_unpackhi_epi16(r[q], r[q + 1]);
        }
        for (int q = 0; q < 8; q += 4) {
            b[q] = _mm512_unpacklo_epi32(a[q], a[q + 2]);
            b[q + 1] = _mm512_unpackhi_epi32(a[q], a[q + 2]);
            b[q + 2] = _mm512_unpacklo_epi32(a[q + 1], a[q + 3]);
            b[q + 3] = _mm512_unpackhi_epi32(a[q + 1], a[q + 3]);
        }
        for (int q = 0; q < 4; q++) {
            s[g][2 * q] = _mm512_unpacklo_epi64(b[q], b[q + 4]);
            s[g][2 * q + 1] = _mm512_unpackhi_epi64(b[q], b[q + 4]);
        }
    }
    for (int q = 0; q < 8; q++) {
        __m512i x[4] = {s[0][q], s[1][q], s[2][q], s[3][q]};
        transpose_lanes4(x);
        for (int l = 0; l < 4; l++) store_line(dst + (8 * l + q) * ds, x[l], stream);
    }
}

/* The same for a 16 x 16 block of 4-byte values (4x4 inside each lane, then the lanes). */
AVX512 static void transpose16x16_u32(const uint32_t *src, int64_t ss, uint32_t *dst, int64_t ds, int stream) {
    __m512i s[4][4];
    for (int g = 0; g < 4; g++) {
        __m512i r[4];
        for (int q = 0; q < 4; q++) r[q] = _mm512_loadu_si512(src + (4 * g + q) * ss);
        __m512i a0 = _mm512_unpacklo_epi32(r[0], r[1]), a1 = _mm512_unpackhi_epi32(r[0], r[1]);
        __m512i a2 = _mm512_unpacklo_epi32(r[2], r[3]), a3 = _mm512_unpackhi_epi32(r[2], r[3]);
        s[g][0] = _mm512_unpacklo_epi64(a0, a2);
        s[g][1] = _mm512_unpackhi_epi64(a0, a2);
        s[g][2] = _mm512_unpacklo_epi64(a1, a3);
        s[g][3] = _mm512_unpackhi_epi64(a1, a3);
    }
    for (int q = 0; q < 4; q++) {
        __m512i x[4] = {s[0][q], s[1][q], s[2][q], s[3][q]};
        transpose_lanes4(x);
        for (int l = 0; l < 4; l++) store_line(dst + (4 * l + q) * ds, x[l], stream);
    }
}

#endif

#if defined(HAVE_X86_PATHS)
/* One square block of 64-byte rows (32x32 2-byte or 16x16 4-byte values; strides in values). */
static void transpose_block64(int64_t elem, char *src, int64_t ss, char *dst, int64_t ds, int stream) {
    if (elem == 2) transpose32x32_u16((uint16_t *)src, ss, (uint16_t *)dst, ds, stream);
    else transpose16x16_u32((uint32_t *)src, ss, (uint32_t *)dst, ds, stream);
}
#endif

/* K of `r` tokens (a multiple of 16 / elem) at block offsets o..o+r-1 <-> blob rows k (stride `row`
 * bytes): blocks of 64-byte rows where the CPU has AVX-512 and hs allows, the rest in SSE2 tiles. */
static void k_tiles(int isa, int stream, char *slab, int64_t bs, int64_t hs, int64_t elem, int64_t o, int64_t r,
                    char *k, int64_t row, int direction) {
    int64_t t = 0;
#if defined(HAVE_X86_PATHS)
    const int64_t w = 64 / elem;
    for (; isa == ISA_AVX512 && hs % w == 0 && t + w <= r; t += w) {
        for (int64_t j0 = 0; j0 < hs; j0 += w) {
            char *cache = slab + (j0 * bs + o + t) * elem, *blob = k + t * row + j0 * elem;
            if (direction == 0) transpose_block64(elem, cache, bs, blob, row / elem, stream);
            else transpose_block64(elem, blob, row / elem, cache, bs, stream);
        }
    }
#endif
#if defined(__SSE2__)
    if (elem == 2) k_tiles_sse2(slab, bs, hs, 2, o + t, r - t, k + t * row, row, direction);
    else k_tiles_sse2(slab, bs, hs, 4, o + t, r - t, k + t * row, row, direction);
#endif
}

/* Length of the run of consecutive slots from slots[i] that stays inside its block (>= 1). */
static int64_t block_run(const int64_t *slots, int64_t i, int64_t n, int64_t bs) {
    int64_t s = slots[i], room = bs - s % bs, r = 1;
    while (r < room && i + r < n && slots[i + r] == s + r) r++;
    return r;
}

/* One token's K (dim-major in the slab: value j at j * bs + o) <-> a blob row slice k. */
static void k_token(char *slab, int64_t bs, int64_t hs, int64_t elem, int64_t o, char *k, int direction) {
    for (int64_t j = 0; j < hs; j++) {
        char *x = slab + (j * bs + o) * elem, *y = k + j * elem;
        if (direction == 0) memcpy(y, x, elem);
        else memcpy(x, y, elem);
    }
}

#if defined(HAVE_X86_PATHS)
AVX512 static void copy_rows_streamed(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n, int64_t bytes) {
    for (int64_t i = 0; i < n; i++) {
        char *d = dst + i * ds;
        const char *x = src + i * ss;
        int64_t off = (int64_t)((64 - (uintptr_t)d % 64) % 64);
        if (off > bytes) off = bytes;
        memcpy(d, x, off);
        for (; off + 64 <= bytes; off += 64) _mm512_stream_si512((__m512i *)(d + off), _mm512_loadu_si512(x + off));
        memcpy(d + off, x + off, bytes - off);
    }
}
#endif

/* n rows of `bytes` bytes, dst + i * ds <- src + i * ss; with `stream`, dst's whole 64-byte lines
 * are written non-temporally. */
static void copy_rows(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n, int64_t bytes, int stream) {
#if defined(HAVE_X86_PATHS)
    if (stream) {
        copy_rows_streamed(dst, ds, src, ss, n, bytes);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) memcpy(dst + i * ds, src + i * ss, bytes);
}

/* What one packed copy moves and how (sizes in values, `row` a blob row in bytes). */
typedef struct {
    int64_t hs, bs, elem, row;
    int isa, stream, direction;
} packed_copy;

/* Tokens o .. o + r - 1 of one (block, head) slab <-> blob rows k and v, in the vec layout: K in
 * tiles (single tokens at the end of the run), V row by row. `scratch` (bs * hs * elem bytes, when
 * gathering): a whole block's K is first copied there front to back, then transposed from L1
 * instead of from many strided streams in memory. */
static void vec_slab(const packed_copy *pc, char *slab, int64_t o, int64_t r, char *k, char *v, char *scratch) {
    int64_t hs = pc->hs, bs = pc->bs, elem = pc->elem, row = pc->row, tiled = 0;
#if defined(__SSE2__)
    int64_t tile = 16 / elem;  /* the SSE2 transposes' tile side */
    if (hs % tile == 0) tiled = r - r % tile;
#endif
    char *from = slab, *pv = slab + (bs + o) * hs * elem;
    if (scratch != NULL && tiled == bs) {
        memcpy(scratch, slab, bs * hs * elem);
        from = scratch;
    }
    k_tiles(pc->isa, pc->stream, from, bs, hs, elem, o, tiled, k, row, pc->direction);
    for (int64_t t = tiled; t < r; t++) k_token(slab, bs, hs, elem, o + t, k + t * row, pc->direction);
    /* (V rows go through the caches when scattering: streamed, that measured slower) */
    if (pc->direction == 0) copy_rows(v, row, pv, hs * elem, r, hs * elem, pc->stream);
    else copy_rows(pv, hs * elem, v, row, r, hs * elem, 0);
}

/* vLLM-CPU's packed caches, "amx" ISA layout (bf16 only): layer l is [num_blocks][heads][2][bs * hs];
 * inside a (block, head) slab, K is in 16-token tiles [hs/2][16][2] (element (t, j) at
 * (t / 16) * 16 * hs + (j / 2) * 32 + (t % 16) * 2 + j % 2) and V in 16-dim tiles [bs/2][16][2]
 * (at bs * hs + (j / 16) * bs * 16 + (t / 2) * 32 + (j % 16) * 2 + t % 2). No run of one token's K
 * or V is longer than two values, so whole tiles move at once: a K tile is a 4-byte-unit transpose
 * (hs/2 x 16 <-> 16 x hs/2), a pair of tokens' V a 2-byte interleave per 16 dims (with AVX-512,
 * where hs % 32 == 0: 16 x 16 transposes and two V tiles per step). Tokens that do not fill a tile
 * (a run starting or ending inside one) move one at a time. */
static inline void amx_k_token(uint16_t *slab, int64_t hs, int64_t t, uint16_t *k, int direction) {
    uint32_t *tile = (uint32_t *)slab + (t / 16) * 8 * hs + t % 16, *row = (uint32_t *)k;
    for (int64_t p = 0; p < hs / 2; p++) {
        if (direction == 0) row[p] = tile[p * 16];
        else tile[p * 16] = row[p];
    }
}

static inline void amx_v_token(uint16_t *slab, int64_t bs, int64_t hs, int64_t t, uint16_t *v,
                               int direction) {
    uint16_t *base = slab + bs * hs + (t / 2) * 32 + t % 2;
    for (int64_t j = 0; j < hs; j++) {
        uint16_t *x = base + (j / 16) * bs * 16 + (j % 16) * 2;
        if (direction == 0) v[j] = *x;
        else *x = v[j];
    }
}

#if defined(__SSE2__)
/* K of the 16 tokens of tile `first / 16` (rows k, k + row, ...; `row` in 2-byte units). */
static inline void amx_k_tile(uint16_t *slab, int64_t hs, int64_t first, uint16_t *k, int64_t row,
                              int direction) {
    uint32_t *tile = (uint32_t *)slab + (first / 16) * 8 * hs;
    __m128i x[4];
    for (int64_t p0 = 0; p0 < hs / 2; p0 += 4) {
        for (int64_t t0 = 0; t0 < 16; t0 += 4) {
            if (direction == 0) {
                for (int q = 0; q < 4; q++) x[q] = _mm_loadu_si128((const __m128i *)(tile + (p0 + q) * 16 + t0));
                transpose4x4_u32(x);
                for (int q = 0; q < 4; q++) _mm_storeu_si128((__m128i *)(k + (t0 + q) * row + 2 * p0), x[q]);
            } else {
                for (int q = 0; q < 4; q++) x[q] = _mm_loadu_si128((const __m128i *)(k + (t0 + q) * row + 2 * p0));
                transpose4x4_u32(x);
                for (int q = 0; q < 4; q++) _mm_storeu_si128((__m128i *)(tile + (p0 + q) * 16 + t0), x[q]);
            }
        }
    }
}

/* V of the token pair (t, t + 1), t even: each 16-dim tile holds the pair interleaved per dim. */
static inline void amx_v_pair(uint16_t *slab, int64_t bs, int64_t hs, int64_t t, uint16_t *v0, uint16_t *v1,
                              int direction) {
    const int order = _MM_SHUFFLE(3, 1, 2, 0);
    for (int64_t j0 = 0; j0 < hs; j0 += 16) {
        __m128i *pair = (__m128i *)(slab + bs * hs + (j0 / 16) * bs * 16 + (t / 2) * 32);
        for (int h = 0; h < 2; h++) { /* dims j0 + 8h .. j0 + 8h + 7 */
            if (direction == 0) {
                __m128i a = _mm_loadu_si128(pair + 2 * h), b = _mm_loadu_si128(pair + 2 * h + 1);
                a = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(a, order), order), order);
                b = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(b, order), order), order);
                _mm_storeu_si128((__m128i *)(v0 + j0 + 8 * h), _mm_unpacklo_epi64(a, b));
                _mm_storeu_si128((__m128i *)(v1 + j0 + 8 * h), _mm_unpackhi_epi64(a, b));
            } else {
                __m128i a = _mm_loadu_si128((const __m128i *)(v0 + j0 + 8 * h));
                __m128i b = _mm_loadu_si128((const __m128i *)(v1 + j0 + 8 * h));
                _mm_storeu_si128(pair + 2 * h, _mm_unpacklo_epi16(a, b));
                _mm_storeu_si128(pair + 2 * h + 1, _mm_unpackhi_epi16(a, b));
            }
        }
    }
}
#endif

#if defined(HAVE_X86_PATHS)
/* amx K tile (hs % 32 == 0): 16 tile rows of 16 tokens' 4-byte pairs at a time. */
AVX512 static void amx_k_tile_avx512(int stream, uint16_t *slab, int64_t hs, int64_t first, uint16_t *k, int64_t row,
                                     int direction) {
    uint32_t *tile = (uint32_t *)slab + (first / 16) * 8 * hs, *rows = (uint32_t *)k;
    for (int64_t p0 = 0; p0 < hs / 2; p0 += 16) {
        if (direction == 0) transpose16x16_u32(tile + p0 * 16, 16, rows + p0, row / 2, stream);
        else transpose16x16_u32(rows + p0, row / 2, tile + p0 * 16, 16, stream);
    }
}

/* amx V of the token pair (t, t + 1) (hs % 32 == 0): two 16-dim tiles at a time; a byte shuffle
 * puts each lane's 4 dims of the first token before those of the second, a qword permute across
 * the two registers then collects each token's 32 dims. */
AVX512 static void amx_v_pair_avx512(int stream, uint16_t *slab, int64_t bs, int64_t hs, int64_t t, uint16_t *v0,
                                     uint16_t *v1, int direction) {
    const __m512i split = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m512i join = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
    const __m512i first = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), second = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
    const __m512i low = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), high = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    for (int64_t j0 = 0; j0 < hs; j0 += 32) {
        uint16_t *a_at = slab + bs * hs + (j0 / 16) * bs * 16 + (t / 2) * 32, *b_at = a_at + bs * 16;
        if (direction == 0) {
            __m512i a = _mm512_shuffle_epi8(_mm512_loadu_si512(a_at), split);
            __m512i b = _mm512_shuffle_epi8(_mm512_loadu_si512(b_at), split);
            store_line(v0 + j0, _mm512_permutex2var_epi64(a, first, b), stream);
            store_line(v1 + j0, _mm512_permutex2var_epi64(a, second, b), stream);
        } else {
            __m512i x0 = _mm512_loadu_si512(v0 + j0), x1 = _mm512_loadu_si512(v1 + j0);
            store_line(a_at, _mm512_shuffle_epi8(_mm512_permutex2var_epi64(x0, low, x1), join), stream);
            store_line(b_at, _mm512_shuffle_epi8(_mm512_permutex2var_epi64(x0, high, x1), join), stream);
        }
    }
}

#endif

/* One amx K tile (16 tokens from `first`, a multiple of 16), with the widest instructions the
 * CPU and hs allow. */
static void amx_k_tile_at(int isa, int stream, uint16_t *slab, int64_t hs, int64_t first, uint16_t *k, int64_t row,
                          int direction) {
#if defined(HAVE_X86_PATHS)
    if (isa == ISA_AVX512 && hs % 32 == 0) {
        amx_k_tile_avx512(stream, slab, hs, first, k, row, direction);
        return;
    }
#endif
#if defined(__SSE2__)
    if (hs % 8 == 0) {
        amx_k_tile(slab, hs, first, k, row, direction);
        return;
    }
#endif
    for (int64_t q = 0; q < 16; q++) amx_k_token(slab, hs, first + q, k + q * row, direction);
}

/* amx V of the token pair (t, t + 1), t even, rows v0 and v1. */
static void amx_v_pair_at(int isa, int stream, uint16_t *slab, int64_t bs, int64_t hs, int64_t t, uint16_t *v0,
                          uint16_t *v1, int direction) {
#if defined(HAVE_X86_PATHS)
    if (isa == ISA_AVX512 && hs % 32 == 0) {
        amx_v_pair_avx512(stream, slab, bs, hs, t, v0, v1, direction);
        return;
    }
#endif
#if defined(__SSE2__)
    if (hs % 16 == 0) {
        amx_v_pair(slab, bs, hs, t, v0, v1, direction);
        return;
    }
#endif
    amx_v_token(slab, bs, hs, t, v0, direction);
    amx_v_token(slab, bs, hs, t + 1, v1, direction);
}

/* Tokens o .. o + r - 1 of one (block, head) slab <-> blob rows k and v (stride row): whole tiles
 * and pairs where the run covers them, single tokens at its ends. */
static void amx_slab(const packed_copy *pc, char *slab_bytes, int64_t o, int64_t r, char *k_bytes,
                     char *v_bytes, char *scratch) {
    (void)scratch;
    int64_t bs = pc->bs, hs = pc->hs, row = pc->row / 2;
    int isa = pc->isa, stream = pc->stream, direction = pc->direction;
    uint16_t *slab = (uint16_t *)slab_bytes, *k = (uint16_t *)k_bytes, *v = (uint16_t *)v_bytes;
    for (int64_t t = o; t < o + r;) {
        uint16_t *kt = k + (t - o) * row, *vt = v + (t - o) * row;
        if (t % 16 == 0 && t + 16 <= o + r) {
            amx_k_tile_at(isa, stream, slab, hs, t, kt, row, direction);
            for (int64_t q = 0; q < 16; q += 2)
                amx_v_pair_at(isa, stream, slab, bs, hs, t + q, vt + q * row, vt + (q + 1) * row, direction);
            t += 16;
        } else {
            amx_k_token(slab, hs, t, kt, direction);
            amx_v_token(slab, bs, hs, t, vt, direction);
            t++;
        }
    }
}

/* Every (layer, chunk) of a batch, split into runs of consecutive slots inside one block, each
 * moved head by head by `slab_fn` (the layout's). Layer l uses the slot row layer_rows[l] (each KV
 * cache group has its own block table). Slots < 0 are skipped when scattering (tokens the engine
 * already has) and give zero rows when gathering (tokens the layer's group does not hold). Work
 * items are (layer, chunk): each moves whole blob rows (all heads of a token), so every cache line
 * of the blob is written by one thread in one pass. */
static void packed_runs(char *const *layers, int64_t L, int64_t H, const int64_t *slots,
                        const int64_t *layer_rows, const int64_t *chunk_starts, const uint64_t *chunk_bufs,
                        int64_t n_chunks, int nt, const packed_copy *pc,
                        void (*slab_fn)(const packed_copy *, char *, int64_t, int64_t, char *, char *, char *)) {
    int64_t bs = pc->bs, row = pc->row, head = pc->hs * pc->elem, slab_len = 2 * bs * head;
    int64_t n_tokens = chunk_starts[n_chunks];
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        char *scratch = pc->direction == 0 ? (char *)malloc(bs * head) : NULL;
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t l = 0; l < L; l++) {
            for (int64_t c = 0; c < n_chunks; c++) {
                const int64_t *cs = slots + layer_rows[l] * n_tokens + chunk_starts[c];
                int64_t n = chunk_starts[c + 1] - chunk_starts[c];
                char *blob = (char *)(uintptr_t)chunk_bufs[c];
                for (int64_t i = 0; i < n;) {
                    char *k = blob + (l * n + i) * row, *v = blob + ((L + l) * n + i) * row;
                    if (cs[i] < 0) {
                        if (pc->direction == 0) {
                            memset(k, 0, row);
                            memset(v, 0, row);
                        }
                        i++;
                        continue;
                    }
                    int64_t r = block_run(cs, i, n, bs), o = cs[i] % bs;
                    char *block = layers[l] + (cs[i] / bs) * H * slab_len;
                    for (int64_t h = 0; h < H; h++)
                        slab_fn(pc, block + h * slab_len, o, r, k + h * head, v + h * head, scratch);
                    i += r;
                }
            }
        }
        free(scratch);
        STREAM_FENCE(pc->stream);
    }
}

/* A batch of chunks, as in lmc_paged_copy: chunk c covers tokens chunk_starts[c] .. chunk_starts[c+1]
 * of each of the n_rows slot rows (slots is [n_rows][n_tokens]; layer l reads row layer_rows[l]) and
 * its [2][n_layers][n_c][heads * head_size] blob is at chunk_bufs[c]. `layout`: 0 vec (vec16 too),
 * 1 amx (2-byte elements only). */
int lmc_packed_copy(const uint64_t *layer_ptrs, int64_t n_layers, int64_t num_blocks,
                    int64_t heads, int64_t head_size, int64_t block_size, int64_t elem, int layout,
                    const int64_t *slots, int64_t n_rows, const int64_t *layer_rows,
                    const int64_t *chunk_starts, const uint64_t *chunk_bufs, int64_t n_chunks,
                    int direction, int nthreads) {
    int64_t n_tokens = chunk_starts[n_chunks];
    for (int64_t t = 0; t < n_rows * n_tokens; t++)
        if (slots[t] >= num_blocks * block_size) return -1;
    for (int64_t l = 0; l < n_layers; l++)
        if (layer_rows[l] < 0 || layer_rows[l] >= n_rows) return -1;
    int64_t bytes = 2 * n_layers * n_tokens * heads * head_size * elem;
    int nt = threads_for(bytes, nthreads), isa = copy_isa(), stream = isa == ISA_AVX512 && bytes >= STREAM_MIN_BYTES;
    char *const *layers = (char *const *)layer_ptrs;
    packed_copy pc = {head_size, block_size, elem, heads * head_size * elem, isa, stream, direction};
    if (layout == 1 && elem == 2 && head_size % 2 == 0 && block_size % 16 == 0)
        packed_runs(layers, n_layers, heads, slots, layer_rows, chunk_starts, chunk_bufs, n_chunks, nt, &pc,
                    amx_slab);
    else if (layout == 0 && (elem == 2 || elem == 4))
        packed_runs(layers, n_layers, heads, slots, layer_rows, chunk_starts, chunk_bufs, n_chunks, nt, &pc,
                    vec_slab);
    else
        return -3;
    return 0;
}
