/* Token copies between serving-engine KV caches and contiguous KV blobs, for CPU tensors.
 *
 * A blob holds [2][n_layers][n_tokens][row] (K of every layer, then V), row = heads * head_size
 * elements. Threads: work is split over independent pieces with dynamic scheduling, and only when
 * there is enough of it (PARALLEL_MIN_BYTES): a parallel region waits for its slowest thread, so
 * small copies on a busy machine are faster on one thread.
 * direction 0: cache -> blob (gather); direction 1: blob -> cache (scatter).
 * Both return 0, or -1 if a slot is out of range (nothing is copied then).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PARALLEL_MIN_BYTES (4 << 20)

static int threads_for(int64_t bytes, int nthreads) {
    return bytes >= PARALLEL_MIN_BYTES && nthreads > 1 ? nthreads : 1;
}

/* Paged caches where each source s (2 * n_layers of them) is [num_slots][row_bytes]. A batch of
 * chunks: chunk c covers slots[chunk_starts[c] .. chunk_starts[c+1]) and its blob (at
 * chunk_bufs[c]) holds source s's rows at s * n_c * row_bytes. Within a chunk the slots are cut
 * into runs of consecutive ids and each run moves with one memcpy, so a block-aligned slot mapping
 * copies whole blocks (or more) at a time; the whole batch is one parallel region. */
int lmc_paged_copy(const uint64_t *paged_ptrs, int64_t n_src, int64_t num_slots,
                   const int64_t *slots, const int64_t *chunk_starts, const uint64_t *chunk_bufs,
                   int64_t n_chunks, int64_t row_bytes, int direction, int nthreads) {
    int64_t n_tokens = chunk_starts[n_chunks];
    if (n_tokens <= 0) return 0;
    for (int64_t t = 0; t < n_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    int64_t *run_start = (int64_t *)malloc(sizeof(int64_t) * (n_tokens + 1));
    int64_t *run_chunk = (int64_t *)malloc(sizeof(int64_t) * n_tokens);
    if (!run_start || !run_chunk) {
        free(run_start);
        free(run_chunk);
        return -2;
    }
    int64_t n_runs = 0;
    for (int64_t c = 0; c < n_chunks; c++)
        for (int64_t t = chunk_starts[c]; t < chunk_starts[c + 1]; t++)
            if (t == chunk_starts[c] || slots[t] != slots[t - 1] + 1) {
                run_chunk[n_runs] = c;
                run_start[n_runs++] = t;
            }
    run_start[n_runs] = n_tokens;

    int64_t total = n_src * n_runs;
    int nt = threads_for(n_src * n_tokens * row_bytes, nthreads);
    #pragma omp parallel for schedule(dynamic, 16) num_threads(nt) if (nt > 1)
    for (int64_t w = 0; w < total; w++) {
        int64_t s = w / n_runs, r = w % n_runs, c = run_chunk[r];
        int64_t t0 = run_start[r], len = run_start[r + 1] - t0;
        int64_t chunk_len = chunk_starts[c + 1] - chunk_starts[c];
        char *paged = (char *)(uintptr_t)paged_ptrs[s] + slots[t0] * row_bytes;
        char *flat = (char *)(uintptr_t)chunk_bufs[c]
                     + (s * chunk_len + (t0 - chunk_starts[c])) * row_bytes;
        if (direction == 0) memcpy(flat, paged, len * row_bytes);
        else memcpy(paged, flat, len * row_bytes);
    }
    free(run_start);
    free(run_chunk);
    return 0;
}

/* vLLM-CPU's packed caches, "vec" ISA layout: layer l is [num_blocks][heads][2][bs * hs]; inside a
 * (block, head) slab, K is dim-major (element (t, j) at j * bs + t) and V token-major (t * hs + j).
 * Slots < 0 are skipped when scattering (tokens the engine already has). elem is 2 or 4 bytes. */
#define VEC_PACKED_COPY(T)                                                                          \
    static void vec_packed_##T(char *const *layers, int64_t L, int64_t H, int64_t hs, int64_t bs,    \
                               const int64_t *slots, int64_t n, T *blob, int direction, int nt) {    \
        int64_t row = H * hs;                                                                       \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nt) if (nt > 1)")   \
        for (int64_t l = 0; l < L; l++) {                                                           \
            for (int64_t h = 0; h < H; h++) {                                                       \
                T *k_rows = blob + l * n * row + h * hs;                                            \
                T *v_rows = blob + (L + l) * n * row + h * hs;                                      \
                for (int64_t i = 0; i < n; i++) {                                                   \
                    int64_t s = slots[i];                                                           \
                    if (s < 0) continue;                                                            \
                    T *slab = (T *)layers[l] + ((s / bs) * H + h) * 2 * bs * hs;                    \
                    int64_t o = s % bs;                                                             \
                    T *k = k_rows + i * row, *v = v_rows + i * row;                                 \
                    T *pv = slab + bs * hs + o * hs;                                                \
                    if (direction == 0) {                                                           \
                        for (int64_t j = 0; j < hs; j++) k[j] = slab[j * bs + o];                   \
                        memcpy(v, pv, hs * sizeof(T));                                              \
                    } else {                                                                        \
                        for (int64_t j = 0; j < hs; j++) slab[j * bs + o] = k[j];                   \
                        memcpy(pv, v, hs * sizeof(T));                                              \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

VEC_PACKED_COPY(uint16_t)
VEC_PACKED_COPY(uint32_t)

int lmc_vec_packed_copy(const uint64_t *layer_ptrs, int64_t n_layers, int64_t num_blocks,
                        int64_t heads, int64_t head_size, int64_t block_size, int64_t elem,
                        const int64_t *slots, int64_t n_tokens, char *blob, int direction,
                        int nthreads) {
    for (int64_t t = 0; t < n_tokens; t++)
        if (slots[t] >= num_blocks * block_size || (direction == 0 && slots[t] < 0)) return -1;
    int nt = threads_for(2 * n_layers * n_tokens * heads * head_size * elem, nthreads);
    char *const *layers = (char *const *)layer_ptrs;
    if (elem == 2)
        vec_packed_uint16_t(layers, n_layers, heads, head_size, block_size, slots, n_tokens,
                            (uint16_t *)blob, direction, nt);
    else if (elem == 4)
        vec_packed_uint32_t(layers, n_layers, heads, head_size, block_size, slots, n_tokens,
                            (uint32_t *)blob, direction, nt);
    else
        return -3;
    return 0;
}
