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

#define PARALLEL_MIN_BYTES (4 << 20)

static int threads_for(int64_t bytes, int nthreads) {
    return bytes >= PARALLEL_MIN_BYTES && nthreads > 1 ? nthreads : 1;
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
 * (block, head) slab, K is dim-major (element (t, j) at j * bs + t) and V token-major (t * hs + j).
 * Layer l uses the slot row layer_rows[l] (each KV cache group has its own block table). Slots < 0
 * are skipped when scattering (tokens the engine already has) and give zero rows when gathering
 * (tokens the layer's group does not hold). elem is 2 or 4 bytes.
 * Work items are (layer, chunk): each moves whole blob rows (all heads of a token) at once, so
 * every cache line of the blob is written by one thread in one pass. For 2-byte KV, runs of 8
 * consecutive slots in one block move K with SSE2 8x8 transposes. */
#define COPY_ONE_TOKEN(T, slab, bs, hs, o, k, v, direction)                                         \
    do {                                                                                            \
        T *pv_ = (slab) + (bs) * (hs) + (o) * (hs);                                                 \
        if ((direction) == 0) {                                                                     \
            for (int64_t j = 0; j < (hs); j++) (k)[j] = (slab)[j * (bs) + (o)];                     \
            memcpy((v), pv_, (hs) * sizeof(T));                                                     \
        } else {                                                                                    \
            for (int64_t j = 0; j < (hs); j++) (slab)[j * (bs) + (o)] = (k)[j];                     \
            memcpy(pv_, (v), (hs) * sizeof(T));                                                     \
        }                                                                                           \
    } while (0)

static void vec_packed_uint32_t(char *const *layers, int64_t L, int64_t H, int64_t hs, int64_t bs,
                                const int64_t *slots, const int64_t *layer_rows,
                                const int64_t *chunk_starts, const uint64_t *chunk_bufs, int64_t n_chunks,
                                int direction, int nt) {
    int64_t row = H * hs, slab_len = 2 * bs * hs, n_tokens = chunk_starts[n_chunks];
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t l = 0; l < L; l++) {
        for (int64_t c = 0; c < n_chunks; c++) {
            const int64_t *cs = slots + layer_rows[l] * n_tokens + chunk_starts[c];
            int64_t n = chunk_starts[c + 1] - chunk_starts[c];
            uint32_t *blob = (uint32_t *)(uintptr_t)chunk_bufs[c];
            for (int64_t i = 0; i < n; i++) {
                int64_t s = cs[i];
                uint32_t *k = blob + (l * n + i) * row;
                uint32_t *v = blob + ((L + l) * n + i) * row;
                if (s < 0) {
                    if (direction == 0) {
                        memset(k, 0, row * sizeof(uint32_t));
                        memset(v, 0, row * sizeof(uint32_t));
                    }
                    continue;
                }
                uint32_t *block = (uint32_t *)layers[l] + (s / bs) * H * slab_len;
                for (int64_t h = 0; h < H; h++)
                    COPY_ONE_TOKEN(uint32_t, block + h * slab_len, bs, hs, s % bs, k + h * hs, v + h * hs,
                                   direction);
            }
        }
    }
}

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

/* K of `r` tokens (a multiple of 8) at block offsets o..o+r-1, rows k (stride row): 8x8 tiles,
 * dims outermost so each of the 8 slab rows of a tile row is read front to back. */
static inline void k_tiles_u16(uint16_t *slab, int64_t bs, int64_t hs, int64_t o, int64_t r, uint16_t *k,
                               int64_t row, int direction) {
    __m128i x[8];
    for (int64_t j0 = 0; j0 < hs; j0 += 8) {
        for (int64_t t = 0; t < r; t += 8) {
            uint16_t *src = slab + j0 * bs + o + t, *dst = k + t * row + j0;
            if (direction == 0) {
                for (int q = 0; q < 8; q++) x[q] = _mm_loadu_si128((const __m128i *)(src + q * bs));
                transpose8x8_u16(x);
                for (int q = 0; q < 8; q++) _mm_storeu_si128((__m128i *)(dst + q * row), x[q]);
            } else {
                for (int q = 0; q < 8; q++) x[q] = _mm_loadu_si128((const __m128i *)(dst + q * row));
                transpose8x8_u16(x);
                for (int q = 0; q < 8; q++) _mm_storeu_si128((__m128i *)(src + q * bs), x[q]);
            }
        }
    }
}
#endif

/* Length of the run of consecutive slots from slots[i] that stays inside its block (>= 1). */
static int64_t block_run(const int64_t *slots, int64_t i, int64_t n, int64_t bs) {
    int64_t s = slots[i], room = bs - s % bs, r = 1;
    while (r < room && i + r < n && slots[i + r] == s + r) r++;
    return r;
}

static void vec_packed_uint16_t(char *const *layers, int64_t L, int64_t H, int64_t hs, int64_t bs,
                                const int64_t *slots, const int64_t *layer_rows,
                                const int64_t *chunk_starts, const uint64_t *chunk_bufs, int64_t n_chunks,
                                int direction, int nt) {
    int64_t row = H * hs, slab_len = 2 * bs * hs, n_tokens = chunk_starts[n_chunks];
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* Gathering a whole block, a head's K (bs * hs values, dim-major) is first copied here
         * front to back, then transposed from L1 instead of from 8 strided streams in memory. */
        uint16_t *k_slab = direction == 0 ? (uint16_t *)malloc(bs * hs * sizeof(uint16_t)) : NULL;
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t l = 0; l < L; l++) {
            for (int64_t c = 0; c < n_chunks; c++) {
                const int64_t *cs = slots + layer_rows[l] * n_tokens + chunk_starts[c];
                int64_t n = chunk_starts[c + 1] - chunk_starts[c];
                uint16_t *blob = (uint16_t *)(uintptr_t)chunk_bufs[c];
                for (int64_t i = 0; i < n;) {
                    if (cs[i] < 0) {
                        if (direction == 0) {
                            memset(blob + (l * n + i) * row, 0, row * sizeof(uint16_t));
                            memset(blob + ((L + l) * n + i) * row, 0, row * sizeof(uint16_t));
                        }
                        i++;
                        continue;
                    }
                    /* A run inside one block, one head at a time. */
                    int64_t r = block_run(cs, i, n, bs), o = cs[i] % bs, tiled = 0;
                    uint16_t *block = (uint16_t *)layers[l] + (cs[i] / bs) * H * slab_len;
                    uint16_t *k = blob + (l * n + i) * row;
                    uint16_t *v = blob + ((L + l) * n + i) * row;
#if defined(__SSE2__)
                    if (hs % 8 == 0) tiled = r - r % 8;
#endif
                    for (int64_t h = 0; h < H; h++) {
                        uint16_t *slab = block + h * slab_len;
                        int64_t t = 0;
#if defined(__SSE2__)
                        if (k_slab != NULL && tiled == bs) {
                            memcpy(k_slab, slab, bs * hs * sizeof(uint16_t));
                            k_tiles_u16(k_slab, bs, hs, o, tiled, k + h * hs, row, direction);
                        } else {
                            k_tiles_u16(slab, bs, hs, o, tiled, k + h * hs, row, direction);
                        }
                        for (; t < tiled; t++) {
                            uint16_t *pv = slab + bs * hs + (o + t) * hs, *bv = v + t * row + h * hs;
                            if (direction == 0) memcpy(bv, pv, hs * sizeof(uint16_t));
                            else memcpy(pv, bv, hs * sizeof(uint16_t));
                        }
#endif
                        for (; t < r; t++)
                            COPY_ONE_TOKEN(uint16_t, slab, bs, hs, o + t, k + t * row + h * hs,
                                           v + t * row + h * hs, direction);
                    }
                    i += r;
                }
            }
        }
        free(k_slab);
    }
}

/* vLLM-CPU's packed caches, "amx" ISA layout (bf16 only): layer l is [num_blocks][heads][2][bs * hs];
 * inside a (block, head) slab, K is in 16-token tiles [hs/2][16][2] (element (t, j) at
 * (t / 16) * 16 * hs + (j / 2) * 32 + (t % 16) * 2 + j % 2) and V in 16-dim tiles [bs/2][16][2]
 * (at bs * hs + (j / 16) * bs * 16 + (t / 2) * 32 + (j % 16) * 2 + t % 2). No run of one token's K
 * or V is longer than two values, so whole tiles move at once: a K tile is a 4-byte-unit transpose
 * (hs/2 x 16 <-> 16 x hs/2), a pair of tokens' V a 2-byte interleave per 16 dims. Tokens that do
 * not fill a tile (a run starting or ending inside one) move one at a time. */
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
static inline void transpose4x4_u32(__m128i r[4]) {
    __m128i a0 = _mm_unpacklo_epi32(r[0], r[1]), a1 = _mm_unpackhi_epi32(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi32(r[2], r[3]), a3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(a0, a2); r[1] = _mm_unpackhi_epi64(a0, a2);
    r[2] = _mm_unpacklo_epi64(a1, a3); r[3] = _mm_unpackhi_epi64(a1, a3);
}

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

static void amx_packed(char *const *layers, int64_t L, int64_t H, int64_t hs, int64_t bs,
                       const int64_t *slots, const int64_t *layer_rows, const int64_t *chunk_starts,
                       const uint64_t *chunk_bufs, int64_t n_chunks, int direction, int nt) {
    int64_t row = H * hs, slab_len = 2 * bs * hs, n_tokens = chunk_starts[n_chunks];
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t l = 0; l < L; l++) {
        for (int64_t c = 0; c < n_chunks; c++) {
            const int64_t *cs = slots + layer_rows[l] * n_tokens + chunk_starts[c];
            int64_t n = chunk_starts[c + 1] - chunk_starts[c];
            uint16_t *blob = (uint16_t *)(uintptr_t)chunk_bufs[c];
            for (int64_t i = 0; i < n;) {
                uint16_t *k = blob + (l * n + i) * row, *v = blob + ((L + l) * n + i) * row;
                if (cs[i] < 0) {
                    if (direction == 0) {
                        memset(k, 0, row * sizeof(uint16_t));
                        memset(v, 0, row * sizeof(uint16_t));
                    }
                    i++;
                    continue;
                }
                /* a run of consecutive slots inside one block: tokens o .. o + r - 1 of it */
                int64_t r = block_run(cs, i, n, bs), o = cs[i] % bs;
                uint16_t *block = (uint16_t *)layers[l] + (cs[i] / bs) * H * slab_len;
                for (int64_t h = 0; h < H; h++) {
                    uint16_t *slab = block + h * slab_len;
                    for (int64_t t = o; t < o + r;) {
                        uint16_t *kt = k + (t - o) * row + h * hs;
#if defined(__SSE2__)
                        if (t % 16 == 0 && t + 16 <= o + r && hs % 8 == 0) {
                            amx_k_tile(slab, hs, t, kt, row, direction);
                            t += 16;
                            continue;
                        }
#endif
                        amx_k_token(slab, hs, t, kt, direction);
                        t++;
                    }
                    for (int64_t t = o; t < o + r;) {
                        uint16_t *vt = v + (t - o) * row + h * hs;
#if defined(__SSE2__)
                        if (t % 2 == 0 && t + 2 <= o + r && hs % 16 == 0) {
                            amx_v_pair(slab, bs, hs, t, vt, vt + row, direction);
                            t += 2;
                            continue;
                        }
#endif
                        amx_v_token(slab, bs, hs, t, vt, direction);
                        t++;
                    }
                }
                i += r;
            }
        }
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
    int nt = threads_for(2 * n_layers * n_tokens * heads * head_size * elem, nthreads);
    char *const *layers = (char *const *)layer_ptrs;
    if (layout == 1 && elem == 2 && head_size % 2 == 0 && block_size % 16 == 0)
        amx_packed(layers, n_layers, heads, head_size, block_size, slots, layer_rows, chunk_starts,
                   chunk_bufs, n_chunks, direction, nt);
    else if (layout == 0 && elem == 2)
        vec_packed_uint16_t(layers, n_layers, heads, head_size, block_size, slots, layer_rows,
                            chunk_starts, chunk_bufs, n_chunks, direction, nt);
    else if (layout == 0 && elem == 4)
        vec_packed_uint32_t(layers, n_layers, heads, head_size, block_size, slots, layer_rows,
                            chunk_starts, chunk_bufs, n_chunks, direction, nt);
    else
        return -3;
    return 0;
}
