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
 *
 * Vector paths: SSE2 (16-byte registers), AVX2 (32) and AVX-512 F + BW (64), the widest the CPU
 * has picked at run time (the library is built without -march); every path moves the same bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86_PATHS 1
#endif

#define PARALLEL_MIN_BYTES (4 << 20)
/* Copies at least this large write whole 64-byte lines with non-temporal stores on the AVX2 and
 * AVX-512 paths: a copy that does not fit in the caches then moves each line once instead of
 * reading it first. */
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

/* The copies' vector paths, narrowest first. LMCACHE_COPY_ISA=sse2|avx2|avx512 caps the path at
 * that one (never above what the CPU has), so every path can be tested and compared on one
 * machine. */
enum { ISA_NONE = -1, ISA_SSE2 = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *const ISA_NAMES[] = {"sse2", "avx2", "avx512"};

static int cpu_isa(void) {
#if defined(HAVE_X86_PATHS)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2")) return ISA_AVX2;
    return ISA_SSE2;
#else
    return ISA_NONE;
#endif
}

static int copy_isa(void) {
    int level = cpu_isa();
    const char *cap = getenv("LMCACHE_COPY_ISA");
    for (int i = 0; cap != NULL && i < level; i++)
        if (strcmp(cap, ISA_NAMES[i]) == 0) return i;
    return level;
}

/* The path the copies take now, and the widest this CPU has (ISA_NONE: scalar code only). */
int lmc_copy_isa(void) { return copy_isa(); }
int lmc_cpu_isa(void) { return cpu_isa(); }

#if defined(HAVE_X86_PATHS)
#define ATTR_sse2
#define ATTR_avx2 __attribute__((target("avx2")))
#define ATTR_avx512 __attribute__((target("avx512f,avx512bw")))
#define INLINE static inline __attribute__((always_inline))

/* Per path: one register's load and store (non-temporal, i.e. without a read of the line first and
 * not kept in the caches, when `stream` is set and p is aligned), and the transpose of 128-bit
 * lanes across registers (lane L of register q becomes lane q of register L). */
INLINE __m128i load_sse2(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
INLINE void store_sse2(void *p, __m128i x, int stream) {
    if (stream && ((uintptr_t)p & 15) == 0) _mm_stream_si128((__m128i *)p, x);
    else _mm_storeu_si128((__m128i *)p, x);
}
INLINE void lanes_sse2(__m128i *x) { (void)x; }

ATTR_avx2 INLINE __m256i load_avx2(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
ATTR_avx2 INLINE void store_avx2(void *p, __m256i x, int stream) {
    if (stream && ((uintptr_t)p & 31) == 0) _mm256_stream_si256((__m256i *)p, x);
    else _mm256_storeu_si256((__m256i *)p, x);
}
ATTR_avx2 INLINE void lanes_avx2(__m256i *x) {
    __m256i a = _mm256_permute2x128_si256(x[0], x[1], 0x20), b = _mm256_permute2x128_si256(x[0], x[1], 0x31);
    x[0] = a;
    x[1] = b;
}

ATTR_avx512 INLINE __m512i load_avx512(const void *p) { return _mm512_loadu_si512(p); }
ATTR_avx512 INLINE void store_avx512(void *p, __m512i x, int stream) {
    if (stream && ((uintptr_t)p & 63) == 0) _mm512_stream_si512(p, x);
    else _mm512_storeu_si512(p, x);
}
ATTR_avx512 INLINE void lanes_avx512(__m512i *x) {
    __m512i x0 = _mm512_shuffle_i32x4(x[0], x[1], 0x44), x1 = _mm512_shuffle_i32x4(x[0], x[1], 0xEE);
    __m512i x2 = _mm512_shuffle_i32x4(x[2], x[3], 0x44), x3 = _mm512_shuffle_i32x4(x[2], x[3], 0xEE);
    x[0] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    x[1] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    x[2] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    x[3] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
}

/* Transposes inside each 128-bit lane of registers of any width (P: the intrinsics' prefix): 8
 * rows r[0..7] of 2-byte values (8x8 per lane), or 4 rows of 4-byte values (4x4 per lane). */
#define LANE_TRANSPOSE_U16(P, r)                                                              \
    do {                                                                                      \
        __typeof__((r)[0]) a_[8], b_[8];                                                      \
        for (int q_ = 0; q_ < 8; q_ += 2) {                                                   \
            a_[q_] = P##_unpacklo_epi16((r)[q_], (r)[q_ + 1]);                                \
            a_[q_ + 1] = P##_unpackhi_epi16((r)[q_], (r)[q_ + 1]);                            \
        }                                                                                     \
        for (int q_ = 0; q_ < 8; q_ += 4) {                                                   \
            b_[q_] = P##_unpacklo_epi32(a_[q_], a_[q_ + 2]);                                  \
            b_[q_ + 1] = P##_unpackhi_epi32(a_[q_], a_[q_ + 2]);                              \
            b_[q_ + 2] = P##_unpacklo_epi32(a_[q_ + 1], a_[q_ + 3]);                          \
            b_[q_ + 3] = P##_unpackhi_epi32(a_[q_ + 1], a_[q_ + 3]);                          \
        }                                                                                     \
        for (int q_ = 0; q_ < 4; q_++) {                                                      \
            (r)[2 * q_] = P##_unpacklo_epi64(b_[q_], b_[q_ + 4]);                             \
            (r)[2 * q_ + 1] = P##_unpackhi_epi64(b_[q_], b_[q_ + 4]);                         \
        }                                                                                     \
    } while (0)

#define LANE_TRANSPOSE_U32(P, r)                                                              \
    do {                                                                                      \
        __typeof__((r)[0]) a0_ = P##_unpacklo_epi32((r)[0], (r)[1]);                          \
        __typeof__((r)[0]) a1_ = P##_unpackhi_epi32((r)[0], (r)[1]);                          \
        __typeof__((r)[0]) a2_ = P##_unpacklo_epi32((r)[2], (r)[3]);                          \
        __typeof__((r)[0]) a3_ = P##_unpackhi_epi32((r)[2], (r)[3]);                          \
        (r)[0] = P##_unpacklo_epi64(a0_, a2_);                                                \
        (r)[1] = P##_unpackhi_epi64(a0_, a2_);                                                \
        (r)[2] = P##_unpacklo_epi64(a1_, a3_);                                                \
        (r)[3] = P##_unpackhi_epi64(a1_, a3_);                                                \
    } while (0)

/* The square transposes of path ISA (V: its register, P: its intrinsics' prefix, W: its register
 * bytes), for elem-byte values (2 or 4, a constant where they are inlined) and strides in bytes:
 * - square: n = W / elem registers of n values each, transposed in place (in-lane transposes of
 *   groups of 16 / elem rows, then the lanes across the groups);
 * - tile: dst[m][i] = src[i][m] for one n x n tile;
 * - k_tiles: vLLM-CPU vec K (see vec_slab) of tokens o .. o + r - 1 <-> blob rows k in n x n tiles,
 *   dims outermost so each slab row of a tile row is read front to back; returns the tokens moved
 *   (r rounded down to n; none if hs is not a multiple of n);
 * - amx_k_tiles: an amx K tile of 16 tokens from `first` (see amx_slab) <-> blob rows k (stride
 *   `row` 2-byte values) in n x n tiles of 4-byte pairs (hs / 2 a multiple of n). */
#define SQUARE_PATH(ISA, V, P, W)                                                             \
    ATTR_##ISA INLINE void square_##ISA(V *r, int64_t elem) {                                 \
        const int group = (int)(16 / elem);                                                   \
        for (int g = 0; g < W / 16; g++) {                                                    \
            if (elem == 2) LANE_TRANSPOSE_U16(P, r + 8 * g);                                  \
            else LANE_TRANSPOSE_U32(P, r + 4 * g);                                            \
        }                                                                                     \
        for (int q = 0; q < group; q++) {                                                     \
            V x[W / 16];                                                                      \
            for (int l = 0; l < W / 16; l++) x[l] = r[group * l + q];                         \
            lanes_##ISA(x);                                                                   \
            for (int l = 0; l < W / 16; l++) r[group * l + q] = x[l];                         \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA INLINE void tile_##ISA(int64_t elem, const char *src, int64_t ss, char *dst,   \
                                      int64_t ds) {                                           \
        V r[W / 2];                                                                           \
        for (int64_t q = 0; q < W / elem; q++) r[q] = load_##ISA(src + q * ss);               \
        square_##ISA(r, elem);                                                                \
        for (int64_t q = 0; q < W / elem; q++) store_##ISA(dst + q * ds, r[q], 0);            \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA INLINE int64_t k_tiles_of_##ISA(char *slab, int64_t bs, int64_t hs, int64_t elem, \
                                               int64_t o, int64_t r, char *k, int64_t row,    \
                                               int direction) {                               \
        const int64_t n = W / elem, tiled = r - r % n;                                        \
        if (hs % n) return 0;                                                                 \
        for (int64_t j0 = 0; j0 < hs; j0 += n)                                                \
            for (int64_t t = 0; t < tiled; t += n) {                                          \
                char *cache = slab + (j0 * bs + o + t) * elem, *blob = k + t * row + j0 * elem; \
                if (direction == 0) tile_##ISA(elem, cache, bs * elem, blob, row);            \
                else tile_##ISA(elem, blob, row, cache, bs * elem);                           \
            }                                                                                 \
        return tiled;                                                                         \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA static inline int64_t k_tiles_##ISA(char *slab, int64_t bs, int64_t hs,       \
                                                   int64_t elem, int64_t o, int64_t r, char *k, \
                                                   int64_t row, int direction) {              \
        return elem == 2 ? k_tiles_of_##ISA(slab, bs, hs, 2, o, r, k, row, direction)         \
                         : k_tiles_of_##ISA(slab, bs, hs, 4, o, r, k, row, direction);        \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA static inline void amx_k_tiles_##ISA(uint16_t *slab, int64_t hs, int64_t first, \
                                                    uint16_t *k, int64_t row, int direction) { \
        const int64_t n = W / 4;                                                              \
        char *tile = (char *)((uint32_t *)slab + (first / 16) * 8 * hs), *rows = (char *)k;  \
        for (int64_t p0 = 0; p0 < hs / 2; p0 += n)                                            \
            for (int64_t t0 = 0; t0 < 16; t0 += n) {                                          \
                char *in_tile = tile + (p0 * 16 + t0) * 4, *in_rows = rows + (t0 * row + 2 * p0) * 2; \
                if (direction == 0) tile_##ISA(4, in_tile, 64, in_rows, row * 2);             \
                else tile_##ISA(4, in_rows, row * 2, in_tile, 64);                            \
            }                                                                                 \
    }

/* The whole-line kernels of path ISA (the AVX2 and AVX-512 paths; strides in bytes):
 * - block64: dst[m][i] = src[i][m] for a block of 64-byte rows (n = 64 / elem values), built from
 *   the path's squares and written row by row, so each 64-byte line is whole (non-temporal with
 *   `stream` where dst rows are aligned);
 * - k_lines: as k_tiles in such blocks (hs a multiple of n), tokens outermost;
 * - amx_k_lines: as amx_k_tiles in such blocks (hs a multiple of 32);
 * - stream_rows: n rows of `bytes` bytes, dst + i * ds <- src + i * ss, dst's whole 64-byte lines
 *   written non-temporally. */
#define LINE_PATH(ISA, V, W)                                                                  \
    ATTR_##ISA INLINE void block64_##ISA(int64_t elem, const char *src, int64_t ss, char *dst, \
                                         int64_t ds, int stream) {                            \
        const int64_t n = W / elem;                                                           \
        V r[64 / W][W / 2];                                                                   \
        for (int64_t h = 0; h < 64 / W; h++) { /* dst rows h * n ..: src columns h * n .. */  \
            for (int64_t g = 0; g < 64 / W; g++) {                                            \
                for (int64_t q = 0; q < n; q++) r[g][q] = load_##ISA(src + (g * n + q) * ss + h * W); \
                square_##ISA(r[g], elem);                                                     \
            }                                                                                 \
            for (int64_t q = 0; q < n; q++)                                                   \
                for (int64_t g = 0; g < 64 / W; g++)                                          \
                    store_##ISA(dst + (h * n + q) * ds + g * W, r[g][q], stream);             \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA INLINE int64_t k_lines_of_##ISA(int stream, char *slab, int64_t bs, int64_t hs, \
                                               int64_t elem, int64_t o, int64_t r, char *k,   \
                                               int64_t row, int direction) {                  \
        const int64_t n = 64 / elem, tiled = r - r % n;                                       \
        if (hs % n) return 0;                                                                 \
        for (int64_t t = 0; t < tiled; t += n)                                                \
            for (int64_t j0 = 0; j0 < hs; j0 += n) {                                          \
                char *cache = slab + (j0 * bs + o + t) * elem, *blob = k + t * row + j0 * elem; \
                if (direction == 0) block64_##ISA(elem, cache, bs * elem, blob, row, stream); \
                else block64_##ISA(elem, blob, row, cache, bs * elem, stream);                \
            }                                                                                 \
        return tiled;                                                                         \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA static int64_t k_lines_##ISA(int stream, char *slab, int64_t bs, int64_t hs,   \
                                            int64_t elem, int64_t o, int64_t r, char *k,      \
                                            int64_t row, int direction) {                     \
        return elem == 2 ? k_lines_of_##ISA(stream, slab, bs, hs, 2, o, r, k, row, direction) \
                         : k_lines_of_##ISA(stream, slab, bs, hs, 4, o, r, k, row, direction); \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA static void amx_k_lines_##ISA(int stream, uint16_t *slab, int64_t hs,          \
                                             int64_t first, uint16_t *k, int64_t row,         \
                                             int direction) {                                 \
        char *tile = (char *)((uint32_t *)slab + (first / 16) * 8 * hs), *rows = (char *)k;  \
        for (int64_t p0 = 0; p0 < hs / 2; p0 += 16) {                                         \
            if (direction == 0) block64_##ISA(4, tile + p0 * 64, 64, rows + p0 * 4, row * 2, stream); \
            else block64_##ISA(4, rows + p0 * 4, row * 2, tile + p0 * 64, 64, stream);        \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    ATTR_##ISA static void stream_rows_##ISA(char *dst, int64_t ds, const char *src, int64_t ss, \
                                             int64_t n, int64_t bytes) {                      \
        for (int64_t i = 0; i < n; i++) {                                                     \
            char *d = dst + i * ds;                                                           \
            const char *x = src + i * ss;                                                     \
            int64_t off = (int64_t)((64 - (uintptr_t)d % 64) % 64);                           \
            if (off > bytes) off = bytes;                                                     \
            memcpy(d, x, off);                                                                \
            for (; off + 64 <= bytes; off += 64)                                              \
                for (int g = 0; g < 64 / W; g++)                                              \
                    store_##ISA(d + off + g * W, load_##ISA(x + off + g * W), 1);             \
            memcpy(d + off, x + off, bytes - off);                                            \
        }                                                                                     \
    }

SQUARE_PATH(sse2, __m128i, _mm, 16)
SQUARE_PATH(avx2, __m256i, _mm256, 32)
SQUARE_PATH(avx512, __m512i, _mm512, 64)
LINE_PATH(avx2, __m256i, 32)
LINE_PATH(avx512, __m512i, 64)
#endif

/* n rows of `bytes` bytes, dst + i * ds <- src + i * ss; with `stream` (AVX2 / AVX-512 paths),
 * dst's whole 64-byte lines are written non-temporally. */
static void copy_rows(int isa, int stream, char *dst, int64_t ds, const char *src, int64_t ss, int64_t n,
                      int64_t bytes) {
#if defined(HAVE_X86_PATHS)
    if (stream && isa == ISA_AVX512) {
        stream_rows_avx512(dst, ds, src, ss, n, bytes);
        return;
    }
    if (stream && isa == ISA_AVX2) {
        stream_rows_avx2(dst, ds, src, ss, n, bytes);
        return;
    }
#endif
    (void)isa, (void)stream;
    for (int64_t i = 0; i < n; i++) memcpy(dst + i * ds, src + i * ss, bytes);
}

/* Paged caches where each source s (2 * n_layers of them) is [num_slots][row_bytes]. A batch of
 * chunks: chunk c covers slots[chunk_starts[c] .. chunk_starts[c+1]) and its blob (at
 * chunk_bufs[c]) holds source s's rows at s * n_c * row_bytes. Within a chunk the slots are cut
 * into runs of consecutive ids and each run moves as one piece, so a block-aligned slot mapping
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

    int64_t total = n_src * n_runs, bytes = n_src * n_tokens * row_bytes;
    int nt = threads_for(bytes, nthreads), isa = copy_isa();
    int stream = isa >= ISA_AVX2 && bytes >= STREAM_MIN_BYTES;
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        #pragma omp for schedule(dynamic, 16)
        for (int64_t w = 0; w < total; w++) {
            int64_t s = w / n_runs, r = w % n_runs, c = run_chunk[r];
            int64_t t0 = run_start[r], len = run_len[r];
            int64_t chunk_len = chunk_starts[c + 1] - chunk_starts[c];
            char *paged = (char *)(uintptr_t)paged_ptrs[s] + slots[t0] * row_bytes;
            char *flat = (char *)(uintptr_t)chunk_bufs[c]
                         + (s * chunk_len + (t0 - chunk_starts[c])) * row_bytes;
            if (direction == 0) copy_rows(isa, stream, flat, 0, paged, 0, 1, len * row_bytes);
            else copy_rows(isa, stream, paged, 0, flat, 0, 1, len * row_bytes);
        }
        STREAM_FENCE(stream);
    }
    free(run_start);
    free(run_len);
    free(run_chunk);
    return 0;
}

/* vLLM-CPU's packed caches, "vec" ISA layout: layer l is [num_blocks][heads][2][bs * hs]; inside a
 * (block, head) slab, K is dim-major (element (t, j) at j * bs + t) and V token-major (t * hs + j);
 * elem is 2 or 4 bytes. Runs of consecutive slots in one block move K with transposes (see
 * k_tiles), V row by row. `packed_runs` (below) walks a batch for either layout. */

/* K of `r` tokens (a multiple of 16 / elem) at block offsets o..o+r-1 <-> blob rows k (stride `row`
 * bytes): 64-byte blocks on the AVX2 and AVX-512 paths where hs allows, then AVX2 tiles on the AVX2
 * path, then SSE2 tiles (on an Intel Xeon, AVX2 tiles made the AVX-512 path's vec16 gather ~10%
 * slower than SSE2 ones). */
static void k_tiles(int isa, int stream, char *slab, int64_t bs, int64_t hs, int64_t elem, int64_t o, int64_t r,
                    char *k, int64_t row, int direction) {
#if defined(HAVE_X86_PATHS)
    int64_t t = 0;
    if (isa == ISA_AVX512) t = k_lines_avx512(stream, slab, bs, hs, elem, o, r, k, row, direction);
    if (isa == ISA_AVX2) {
        t = k_lines_avx2(stream, slab, bs, hs, elem, o, r, k, row, direction);
        t += k_tiles_avx2(slab, bs, hs, elem, o + t, r - t, k + t * row, row, direction);
    }
    k_tiles_sse2(slab, bs, hs, elem, o + t, r - t, k + t * row, row, direction);
#else
    (void)isa, (void)stream, (void)slab, (void)bs, (void)hs, (void)elem, (void)o, (void)r, (void)k,
        (void)row, (void)direction;
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

/* What one packed copy moves and how (sizes in values, `row` a blob row in bytes). `staged`: a
 * scatter that reads each run's blob rows from a buffer (see packed_runs) and streams V rows too. */
typedef struct {
    int64_t hs, bs, elem, row;
    int isa, stream, direction, staged;
} packed_copy;

/* Whether a packed scatter on path `isa` of heads `head` bytes wide is staged: on AMD CPUs on the
 * AVX2 and AVX-512 paths, on others on the AVX2 path where heads are whole cache lines. Measured on
 * 189-377 MB of vec KV: on an AMD Zen 3 (AVX2 only) staging makes the scatter 1.2-1.3x faster
 * (strided reads from memory run at half speed there, slower still beside streamed stores), on an
 * AMD Zen 4 (AVX-512) 1.1x (bf16) and 1.2x (fp32). On an Intel Xeon it made the AVX-512 path 12-14%
 * slower and, on the AVX2 path, vec16's 80-wide bf16 heads (whose whole blocks are built in a
 * buffer anyway) 0.83 -> 0.72x a copy, while vec's 64-wide heads gain (bf16 0.64 -> 0.72x). */
static int staged_scatter(int isa, int64_t head) {
#if defined(HAVE_X86_PATHS)
    if (__builtin_cpu_is("amd")) return isa == ISA_AVX2 || isa == ISA_AVX512;
    return isa == ISA_AVX2 && head % 64 == 0;
#else
    (void)isa, (void)head;
    return 0;
#endif
}

/* Tokens o .. o + r - 1 of one (block, head) slab <-> blob rows k and v, in the vec layout: K in
 * tiles (single tokens at the end of the run), V row by row. `scratch` (bs * hs * elem bytes, when
 * gathering): a whole block's K is first copied there front to back, then transposed from L1
 * instead of from many strided streams in memory. */
static void vec_slab(const packed_copy *pc, char *slab, int64_t o, int64_t r, char *k, char *v, char *scratch) {
    int64_t hs = pc->hs, bs = pc->bs, elem = pc->elem, row = pc->row, tiled = 0;
#if defined(HAVE_X86_PATHS)
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
    if (pc->direction == 0) copy_rows(pc->isa, pc->stream, v, row, pv, hs * elem, r, hs * elem);
    else copy_rows(pc->isa, pc->staged ? pc->stream : 0, pv, hs * elem, v, row, r, hs * elem);
}

/* vLLM-CPU's packed caches, "amx" ISA layout (bf16 only): layer l is [num_blocks][heads][2][bs * hs];
 * inside a (block, head) slab, K is in 16-token tiles [hs/2][16][2] (element (t, j) at
 * (t / 16) * 16 * hs + (j / 2) * 32 + (t % 16) * 2 + j % 2) and V in 16-dim tiles [bs/2][16][2]
 * (at bs * hs + (j / 16) * bs * 16 + (t / 2) * 32 + (j % 16) * 2 + t % 2). No run of one token's K
 * or V is longer than two values, so whole tiles move at once: a K tile is a 4-byte-unit transpose
 * (hs/2 x 16 <-> 16 x hs/2), a pair of tokens' V a 2-byte interleave per 16 dims (on the AVX2 and
 * AVX-512 paths, where hs % 32 == 0: 64-byte blocks and two V tiles per step, whole lines). Tokens
 * that do not fill a tile (a run starting or ending inside one) move one at a time. */
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

#if defined(HAVE_X86_PATHS)
/* amx V of the token pair (t, t + 1), t even, rows v0 and v1: each 16-dim tile holds the pair
 * interleaved per dim. SSE2: 8 dims at a time. */
static void amx_v_pair_sse2(uint16_t *slab, int64_t bs, int64_t hs, int64_t t, uint16_t *v0, uint16_t *v1,
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

/* AVX2 (hs % 32 == 0): two 16-dim tiles at a time. Gathering, a byte shuffle puts each lane's 4
 * dims of the first token before those of the second and a qword permute gathers each token's 8
 * dims into one lane; scattering, the pair's dims are interleaved in lanes and the lanes put in
 * order. */
ATTR_avx2 static void amx_v_pair_avx2(int stream, uint16_t *slab, int64_t bs, int64_t hs, int64_t t, uint16_t *v0,
                                      uint16_t *v1, int direction) {
    const __m256i split = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    for (int64_t j0 = 0; j0 < hs; j0 += 32) {
        uint16_t *pair = slab + bs * hs + (j0 / 16) * bs * 16 + (t / 2) * 32;
        if (direction == 0) {
            __m256i x[4]; /* dims j0 + 8q .. j0 + 8q + 7: the first token's in the low lane */
            for (int q = 0; q < 4; q++)
                x[q] = _mm256_permute4x64_epi64(
                    _mm256_shuffle_epi8(load_avx2(pair + (q / 2) * bs * 16 + (q % 2) * 16), split), 0xD8);
            for (int h = 0; h < 2; h++) {
                store_avx2(v0 + j0 + 16 * h, _mm256_permute2x128_si256(x[2 * h], x[2 * h + 1], 0x20), stream);
                store_avx2(v1 + j0 + 16 * h, _mm256_permute2x128_si256(x[2 * h], x[2 * h + 1], 0x31), stream);
            }
        } else {
            for (int h = 0; h < 2; h++) { /* the tile of dims j0 + 16h .. */
                __m256i a = load_avx2(v0 + j0 + 16 * h), b = load_avx2(v1 + j0 + 16 * h);
                __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
                store_avx2(pair + h * bs * 16, _mm256_permute2x128_si256(lo, hi, 0x20), stream);
                store_avx2(pair + h * bs * 16 + 16, _mm256_permute2x128_si256(lo, hi, 0x31), stream);
            }
        }
    }
}

/* AVX-512 (hs % 32 == 0): two 16-dim tiles at a time; a byte shuffle puts each lane's 4 dims of
 * the first token before those of the second, a qword permute across the two registers then
 * collects each token's 32 dims. */
ATTR_avx512 static void amx_v_pair_avx512(int stream, uint16_t *slab, int64_t bs, int64_t hs, int64_t t,
                                          uint16_t *v0, uint16_t *v1, int direction) {
    const __m512i split = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m512i join = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
    const __m512i first = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), second = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
    const __m512i low = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), high = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    for (int64_t j0 = 0; j0 < hs; j0 += 32) {
        uint16_t *a_at = slab + bs * hs + (j0 / 16) * bs * 16 + (t / 2) * 32, *b_at = a_at + bs * 16;
        if (direction == 0) {
            __m512i a = _mm512_shuffle_epi8(load_avx512(a_at), split);
            __m512i b = _mm512_shuffle_epi8(load_avx512(b_at), split);
            store_avx512(v0 + j0, _mm512_permutex2var_epi64(a, first, b), stream);
            store_avx512(v1 + j0, _mm512_permutex2var_epi64(a, second, b), stream);
        } else {
            __m512i x0 = load_avx512(v0 + j0), x1 = load_avx512(v1 + j0);
            store_avx512(a_at, _mm512_shuffle_epi8(_mm512_permutex2var_epi64(x0, low, x1), join), stream);
            store_avx512(b_at, _mm512_shuffle_epi8(_mm512_permutex2var_epi64(x0, high, x1), join), stream);
        }
    }
}
#endif

/* One amx K tile (16 tokens from `first`, a multiple of 16), with the widest path hs allows. */
static void amx_k_tile(int isa, int stream, uint16_t *slab, int64_t hs, int64_t first, uint16_t *k, int64_t row,
                       int direction) {
#if defined(HAVE_X86_PATHS)
    if (isa == ISA_AVX512 && hs % 32 == 0) {
        amx_k_lines_avx512(stream, slab, hs, first, k, row, direction);
        return;
    }
    if (isa == ISA_AVX2 && hs % 32 == 0) {
        amx_k_lines_avx2(stream, slab, hs, first, k, row, direction);
        return;
    }
    if (hs % 8 == 0) {
        amx_k_tiles_sse2(slab, hs, first, k, row, direction);
        return;
    }
#endif
    (void)isa, (void)stream;
    for (int64_t q = 0; q < 16; q++) amx_k_token(slab, hs, first + q, k + q * row, direction);
}

/* amx V of the token pair (t, t + 1), t even, rows v0 and v1, with the widest path hs allows. */
static void amx_v_pair(int isa, int stream, uint16_t *slab, int64_t bs, int64_t hs, int64_t t, uint16_t *v0,
                       uint16_t *v1, int direction) {
#if defined(HAVE_X86_PATHS)
    if (isa == ISA_AVX512 && hs % 32 == 0) {
        amx_v_pair_avx512(stream, slab, bs, hs, t, v0, v1, direction);
        return;
    }
    if (isa == ISA_AVX2 && hs % 32 == 0) {
        amx_v_pair_avx2(stream, slab, bs, hs, t, v0, v1, direction);
        return;
    }
    if (hs % 16 == 0) {
        amx_v_pair_sse2(slab, bs, hs, t, v0, v1, direction);
        return;
    }
#endif
    (void)isa, (void)stream;
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
            amx_k_tile(isa, stream, slab, hs, t, kt, row, direction);
            for (int64_t q = 0; q < 16; q += 2)
                amx_v_pair(isa, stream, slab, bs, hs, t + q, vt + q * row, vt + (q + 1) * row, direction);
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
 * of the blob is written by one thread in one pass. A staged scatter first copies a run's blob rows
 * front to back into a per-thread buffer (each head reads a slice of every row). Where heads are not
 * whole cache lines (hs * elem not a multiple of 64, e.g. vec16's 80-wide bf16 heads), a streamed
 * scatter of a whole block builds each slab in a second buffer and streams it out in one piece, and
 * a streamed gather builds a run's blob rows (every head) in that per-thread buffer and streams them
 * out in one piece, so no line of the blob is written partly, twice or read for ownership. */
static void packed_runs(char *const *layers, int64_t L, int64_t H, const int64_t *slots,
                        const int64_t *layer_rows, const int64_t *chunk_starts, const uint64_t *chunk_bufs,
                        int64_t n_chunks, int nt, const packed_copy *pc,
                        void (*slab_fn)(const packed_copy *, char *, int64_t, int64_t, char *, char *, char *)) {
    int64_t bs = pc->bs, row = pc->row, head = pc->hs * pc->elem, slab_len = 2 * bs * head;
    int64_t n_tokens = chunk_starts[n_chunks];
    int partial_lines = pc->stream && head % 64;  /* streamed, heads not whole lines */
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* Each buffer only saves time: a thread that cannot allocate one copies without it. */
        char *scratch = pc->direction == 0 ? (char *)malloc(bs * head) : NULL;
        char *rows = pc->staged || (partial_lines && pc->direction == 0) ? (char *)malloc(2 * bs * row) : NULL;
        char *whole = partial_lines && pc->direction == 1 ? (char *)malloc(slab_len) : NULL;
        int gather_rows = partial_lines && pc->direction == 0 && rows != NULL;
        packed_copy unstreamed = *pc;  /* writes into a buffer: nothing to stream */
        unstreamed.stream = 0;
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
                    char *k_rows = k, *v_rows = v;
                    if (rows != NULL) {
                        if (pc->staged) {
                            memcpy(rows, k, r * row);
                            memcpy(rows + bs * row, v, r * row);
                        }
                        k_rows = rows;
                        v_rows = rows + bs * row;
                    }
                    for (int64_t h = 0; h < H; h++) {
                        if (whole != NULL && r == bs) {
                            slab_fn(&unstreamed, whole, 0, bs, k_rows + h * head, v_rows + h * head, NULL);
                            copy_rows(pc->isa, pc->stream, block + h * slab_len, 0, whole, 0, 1, slab_len);
                        } else {
                            slab_fn(gather_rows ? &unstreamed : pc, block + h * slab_len, o, r, k_rows + h * head,
                                    v_rows + h * head, scratch);
                        }
                    }
                    if (gather_rows) {
                        copy_rows(pc->isa, pc->stream, k, 0, k_rows, 0, 1, r * row);
                        copy_rows(pc->isa, pc->stream, v, 0, v_rows, 0, 1, r * row);
                    }
                    i += r;
                }
            }
        }
        free(scratch);
        free(rows);
        free(whole);
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
    int nt = threads_for(bytes, nthreads), isa = copy_isa(), stream = isa >= ISA_AVX2 && bytes >= STREAM_MIN_BYTES;
    char *const *layers = (char *const *)layer_ptrs;
    packed_copy pc = {head_size, block_size, elem, heads * head_size * elem, isa, stream, direction,
                      direction == 1 && staged_scatter(isa, head_size * elem)};
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
