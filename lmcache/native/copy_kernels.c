/* Token copies between paged KV caches and contiguous buffers, for CPU tensors.
 *
 * A paged source s is viewed as [num_slots, row_bytes] (one row per token slot). `slots` lists
 * the slot of each of n_tokens tokens. Consecutive slots are adjacent in memory, so the slots are
 * cut into runs of consecutive ids and each run moves with one memcpy: a block-aligned slot
 * mapping copies whole blocks (or more) at a time. Work is split over (source, run) pairs.
 *
 * buf holds source s's tokens at buf + s * buf_src_stride + t * row_bytes.
 * direction 0: paged -> buf (gather); direction 1: buf -> paged (scatter).
 * Returns 0, or -1 if a slot is negative or >= num_slots (nothing is copied then).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int lmc_paged_copy(const uint64_t *paged_ptrs, int64_t n_src, int64_t num_slots,
                   const int64_t *slots, int64_t n_tokens, int64_t row_bytes,
                   char *buf, int64_t buf_src_stride, int direction, int nthreads) {
    if (n_tokens <= 0) return 0;
    for (int64_t t = 0; t < n_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    int64_t *run_start = (int64_t *)malloc(sizeof(int64_t) * (n_tokens + 1));
    if (!run_start) return -2;
    int64_t n_runs = 0;
    for (int64_t t = 0; t < n_tokens; t++)
        if (t == 0 || slots[t] != slots[t - 1] + 1) run_start[n_runs++] = t;
    run_start[n_runs] = n_tokens;

    int64_t total = n_src * n_runs;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (total > 1)
    for (int64_t w = 0; w < total; w++) {
        int64_t s = w / n_runs, r = w % n_runs;
        int64_t t0 = run_start[r], len = run_start[r + 1] - t0;
        char *paged = (char *)(uintptr_t)paged_ptrs[s] + slots[t0] * row_bytes;
        char *flat = buf + s * buf_src_stride + t0 * row_bytes;
        if (direction == 0) memcpy(flat, paged, len * row_bytes);
        else memcpy(paged, flat, len * row_bytes);
    }
    free(run_start);
    return 0;
}
