/* CacheGen's CPU kernels: the quantizer's data passes and the interleaved rANS coder.
 *
 * Python (`lmcache/cachegen/kernels.py`) holds the reference of every
 * function here in numpy; both produce bit-identical results, so the arithmetic below is fixed:
 * float32 operations in the stated order, no fused multiply-add (built with -ffp-contract=off),
 * round-half-to-even everywhere.
 *
 * KV is [G][T][C] (G = 2 * layers (K/V, layer) pairs, T tokens, C channels), dtype code
 * 0 = bf16, 1 = fp16, 2 = fp32. Symbols q are int16 [G][T][C].
 *
 * rANS (see lmcache/cachegen/rans.py for the format): 64-bit states in [L, 2^32 L), L = 2^31, 32-bit
 * words, PROB_BITS-bit frequencies, LANES interleaved states per substream. A substream codes the
 * symbols of one (token block, pair) token-major over the pair's coded channels; symbol i uses
 * lane i % LANES. Words are read front to back: first the LANES initial states (high word, then
 * low word), then one word whenever a lane's state drops below L after decoding a symbol. A
 * substream is valid only if every lane ends at L with every word consumed.
 *
 * Work is split over pairs / substreams with OpenMP (dynamic schedule); ctypes releases the GIL.
 * The file is built once per vector path (`lmcache.native`: baseline x86-64, x86-64-v3 with AVX2
 * and BMI2, x86-64-v4 with 512-bit vectors); the arithmetic is the same IEEE operations in every
 * build (no FMA).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROB_BITS 12
#define PROB_SCALE (1u << PROB_BITS)
#define LANES 8 /* the coding loops below hold the 8 states in 8 variables */
#define RANS_L (1ull << 31)
#define QLIMIT 32767.0f
#define ANCHOR_LIMIT 2048.0f /* QMAX + 1 (cachegen.quant) */
#define RINT_MAGIC 12582912.0f /* 1.5 * 2^23: (v + M) - M rounds |v| < 2^22 half to even */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round half to even; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One row of C values of any supported dtype -> float32. */
static inline void load_row(const void *base, int dtype, int64_t offset, int64_t C,
                            float *restrict out) {
    if (dtype == 0) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t c = 0; c < C; c++) out[c] = bf16_to_f32(p[c]);
    } else if (dtype == 1) {
        const _Float16 *p = (const _Float16 *)base + offset;
        for (int64_t c = 0; c < C; c++) out[c] = (float)p[c];
    } else {
        memcpy(out, (const float *)base + offset, C * sizeof(float));
    }
}

/* Work on one pair g, inlined into the exported kernels below (so compiled per CPU with them). */
#define PAIR static inline __attribute__((always_inline))

/* Pass 1 on pair g. colsum[c] = sum over t (ascending) of x, in float32. sumsq[t] = sum over c of
 * x * x in float64 with 8 partial sums (partial j takes c = j, j + 8, ... in order), combined as
 * ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). row: room for C floats. */
PAIR void stats_pair(const void *x, int dtype, int64_t g, int64_t T, int64_t C, float *row,
                     float *colsum, double *sumsq) {
    for (int64_t c = 0; c < C; c++) colsum[c] = 0.0f;
    for (int64_t t = 0; t < T; t++) {
        load_row(x, dtype, (g * T + t) * C, C, row);
        for (int64_t c = 0; c < C; c++) colsum[c] += row[c];
        double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t c = 0;
        for (; c + 8 <= C; c += 8)
            for (int j = 0; j < 8; j++) p[j] += (double)row[c + j] * (double)row[c + j];
        for (int j = 0; c < C; c++, j++) p[j] += (double)row[c] * (double)row[c];
        sumsq[t] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    }
}

int cg_stats(const void *x, int dtype, int64_t G, int64_t T, int64_t C, float *colsum,
             double *sumsq, int nthreads) {
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && G > 1)
    {
        float *row = (float *)malloc(sizeof(float) * C);
        if (!row) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++)
            if (row) stats_pair(x, dtype, g, T, C, row, colsum + g * C, sumsq + g * T);
        free(row);
    }
    return failed ? -2 : 0;
}

/* Per-thread buffers of pass 2. */
typedef struct {
    float *row;
    int32_t *acc;
    int16_t *lo, *hi;
} quant_buf;

static int quant_buf_alloc(quant_buf *b, int64_t C) {
    b->row = (float *)malloc(sizeof(float) * C);
    b->acc = (int32_t *)malloc(sizeof(int32_t) * C);
    b->lo = (int16_t *)malloc(sizeof(int16_t) * C);
    b->hi = (int16_t *)malloc(sizeof(int16_t) * C);
    return b->row && b->acc && b->lo && b->hi ? 0 : -1;
}

static void quant_buf_free(quant_buf *b) {
    free(b->row);
    free(b->acc);
    free(b->lo);
    free(b->hi);
}

/* Pass 2 on pair g: q[t][c] (the pair's rows) = rint(clamp((x - mean[c]) * inv_steps[t],
 * +-32767)), except on anchor tokens (anchor_of[t] = a >= 0): there fine = rint(clamp(that
 * product, +-(QMAX + 1)) * 8), q = fine >> 3 (floor) and refine[a * G * C + c] = fine & 7 (refine:
 * anchor 0's channels of this pair). Per channel: abs_sum (sum |q|), qmin, qmax; per token: qpeak
 * (max |q|). */
PAIR void quantize_pair(const void *x, int dtype, int64_t g, int64_t G, int64_t T, int64_t C,
                        const float *restrict mean, const float *inv_steps,
                        const int64_t *anchor_of, int16_t *q, uint8_t *refine, int64_t *asum,
                        int32_t *qmin, int32_t *qmax, int32_t *qpeak, quant_buf *b) {
    int16_t *restrict lo = b->lo, *restrict hi = b->hi;
    int32_t *restrict acc = b->acc;
    for (int64_t c = 0; c < C; c++) {
        asum[c] = 0;
        acc[c] = 0;
        lo[c] = 32767;
        hi[c] = -32767;
    }
    for (int64_t t = 0; t < T; t++) {
        load_row(x, dtype, (g * T + t) * C, C, b->row);
        const float inv = inv_steps[t];
        int16_t *restrict out = q + t * C;
        const float *restrict in = b->row;
        if (anchor_of[t] >= 0) {
            uint8_t *restrict ref = refine + anchor_of[t] * G * C;
            for (int64_t c = 0; c < C; c++) {
                float v = (in[c] - mean[c]) * inv;
                v = v < ANCHOR_LIMIT ? v : ANCHOR_LIMIT;
                v = v > -ANCHOR_LIMIT ? v : -ANCHOR_LIMIT;
                int32_t fine = (int32_t)((v * 8.0f + RINT_MAGIC) - RINT_MAGIC);
                out[c] = (int16_t)(fine >> 3); /* arithmetic shift: floor(fine / 8) */
                ref[c] = (uint8_t)(fine & 7);
            }
        } else {
            for (int64_t c = 0; c < C; c++) {
                float v = (in[c] - mean[c]) * inv; /* finite: the stats pass checked */
                v = v < QLIMIT ? v : QLIMIT;
                v = v > -QLIMIT ? v : -QLIMIT;
                out[c] = (int16_t)(int32_t)((v + RINT_MAGIC) - RINT_MAGIC);
            }
        }
        int16_t peak = 0;
        for (int64_t c = 0; c < C; c++) {
            int16_t s = out[c], neg = (int16_t)-s, a = s > neg ? s : neg;
            acc[c] += a;
            peak = a > peak ? a : peak;
            lo[c] = s < lo[c] ? s : lo[c];
            hi[c] = s > hi[c] ? s : hi[c];
        }
        qpeak[t] = peak;
        if ((t & 0xFFFF) == 0xFFFF || t == T - 1)  /* 65536 * 32767 fits in int32 ... */
            for (int64_t c = 0; c < C; c++) {   /* ... so flush every 65536 tokens */
                asum[c] += acc[c];
                acc[c] = 0;
            }
    }
    for (int64_t c = 0; c < C; c++) {
        qmin[c] = lo[c];
        qmax[c] = hi[c];
    }
}

/* Pass 2 on every pair (see quantize_pair), with means [G][C] and inv_steps [G][T]. */
int cg_quantize(const void *x, int dtype, int64_t G, int64_t T, int64_t C, const float *means,
                const float *inv_steps, const int64_t *anchor_of, int16_t *q, int64_t *abs_sum,
                int32_t *qmin, int32_t *qmax, int32_t *qpeak, uint8_t *refine, int nthreads) {
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && G > 1)
    {
        quant_buf b;
        if (quant_buf_alloc(&b, C)) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++) {
            if (failed) continue;
            quantize_pair(x, dtype, g, G, T, C, means + g * C, inv_steps + g * T, anchor_of,
                          q + g * T * C, refine + g * C, abs_sum + g * C, qmin + g * C,
                          qmax + g * C, qpeak + g * T, &b);
        }
        quant_buf_free(&b);
    }
    return failed ? -2 : 0;
}

/* Pass 3 on pair g: out[e - lo] = the number of (t, c) with sym_base[c] + q[t][c] = e, for the
 * pair's table entries [lo, lo + n). part: HIST_COPIES * n int32 scratch; at: C pointers of
 * scratch. */
#define HIST_COPIES 8
PAIR void histogram_pair(const int16_t *q, int64_t T, int64_t C, const int64_t *base, int64_t lo,
                         int64_t n, int32_t *part, int32_t **at, int64_t *out) {
    /* HIST_COPIES copies (channel c counts into copy c % HIST_COPIES): the many equal symbols of
     * a row's channels do not wait on each other's increments (a store-to-load chain each).
     * at[c]: channel c's counter of symbol 0 in its copy, so that a count is one load of a
     * pointer, one of a symbol and one increment */
    memset(part, 0, sizeof(int32_t) * HIST_COPIES * n);
    for (int64_t c = 0; c < C; c++) at[c] = part + (c % HIST_COPIES) * n - lo + base[c];
    for (int64_t t = 0; t < T; t++) {
        const int16_t *row = q + t * C;
        for (int64_t c = 0; c < C; c++) at[c][row[c]]++;
    }
    for (int64_t e = 0; e < n; e++) {
        int64_t sum = 0;
        for (int k = 0; k < HIST_COPIES; k++) sum += part[k * n + e];
        out[e] = sum;
    }
}

/* Pass 3. counts[sym_base[g][c] + q[g][t][c]] += 1 over all tokens (sym_base: the channel's
 * group's first table entry minus its lowest symbol). Pair g's entries are the range
 * [pair_entries[g], pair_entries[g + 1]), so pairs run in parallel without conflicts. */
int cg_histogram(const int16_t *q, int64_t G, int64_t T, int64_t C, const int64_t *sym_base,
                 const int64_t *pair_entries, int64_t *counts, int nthreads) {
    int64_t width = 1;
    for (int64_t g = 0; g < G; g++)
        if (pair_entries[g + 1] - pair_entries[g] > width) width = pair_entries[g + 1] - pair_entries[g];
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && G > 1)
    {
        int32_t *part = (int32_t *)malloc(sizeof(int32_t) * HIST_COPIES * width);
        int32_t **at = (int32_t **)malloc(sizeof(int32_t *) * C);
        if (!part || !at) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++) {
            if (!part || !at) continue;
            const int64_t lo = pair_entries[g];
            histogram_pair(q + g * T * C, T, C, sym_base + g * C, lo, pair_entries[g + 1] - lo,
                           part, at, counts + lo);
        }
        free(part);
        free(at);
    }
    return failed ? -2 : 0;
}

/* Symbol groups (cachegen.layout): channel c of pair g is in class classes[g][c] < NUM_CLASSES;
 * a pair's groups are its classes that occur, in increasing order, numbered across pairs in pair
 * order. */
#define NUM_CLASSES 16

/* Pair g's groups: each one's lowest symbol and alphabet size from its channels' qmin / qmax into
 * low / size (room for NUM_CLASSES), and each class's group size into class_size (0: absent).
 * Returns the number of groups. */
PAIR int64_t group_ranges_pair(const uint8_t *classes, const int32_t *qmin, const int32_t *qmax,
                               int64_t C, int32_t *low, int64_t *size, int64_t *class_size) {
    int32_t lo[NUM_CLASSES], hi[NUM_CLASSES];
    for (int k = 0; k < NUM_CLASSES; k++) {
        lo[k] = INT32_MAX;
        hi[k] = INT32_MIN;
    }
    for (int64_t c = 0; c < C; c++) {
        int k = classes[c] & (NUM_CLASSES - 1);
        lo[k] = qmin[c] < lo[k] ? qmin[c] : lo[k];
        hi[k] = qmax[c] > hi[k] ? qmax[c] : hi[k];
    }
    int64_t n = 0;
    for (int k = 0; k < NUM_CLASSES; k++) {
        class_size[k] = 0;
        if (lo[k] <= hi[k]) {
            low[n] = lo[k];
            size[n++] = class_size[k] = (int64_t)hi[k] - lo[k] + 1;
        }
    }
    return n;
}

/* group_ranges: every pair's groups into low / size (room for G * NUM_CLASSES groups); returns
 * the number of groups. */
int cg_group_ranges(const uint8_t *classes, const int32_t *qmin, const int32_t *qmax, int64_t G,
                    int64_t C, int32_t *low, int64_t *size) {
    int64_t n = 0, class_size[NUM_CLASSES];
    for (int64_t g = 0; g < G; g++)
        n += group_ranges_pair(classes + g * C, qmin + g * C, qmax + g * C, C, low + n, size + n,
                               class_size);
    return (int)n;
}

/* Pair g's part of `CodeLayout.build` (see CodeLayout), its groups numbered from n0 (their
 * group_start filled): group_of, sym_base, chans, cchans [C], and its numbers of coded and
 * single-symbol channels. Returns its number of groups, or -1 if a class is out of range or its
 * groups would pass the N groups there are. */
PAIR int64_t layout_pair(const uint8_t *classes, int64_t C, int64_t n0, int64_t N,
                         const int32_t *low, const int64_t *size, const int64_t *group_start,
                         int64_t *group_of, int64_t *sym_base, int64_t *chans, int64_t *cchans,
                         int64_t *ncoded, int64_t *nconst) {
    int64_t id[NUM_CLASSES], n = n0;
    for (int k = 0; k < NUM_CLASSES; k++) id[k] = -1;
    for (int64_t c = 0; c < C; c++) {
        if (classes[c] >= NUM_CLASSES) return -1;
        id[classes[c]] = 0;
    }
    for (int k = 0; k < NUM_CLASSES; k++)
        if (id[k] == 0) {
            if (n == N) return -1;
            id[k] = n++;
        }
    int64_t nc = 0, nk = 0;
    for (int64_t c = 0; c < C; c++) {
        int64_t grp = id[classes[c]];
        group_of[c] = grp;
        sym_base[c] = group_start[grp] - low[grp];
        if (size[grp] > 1)
            chans[nc++] = c;
        else
            cchans[nk++] = c;
    }
    for (int64_t c = 0, j = nc, k = nk; c < C; c++) /* then the others, in channel order */
        if (size[id[classes[c]]] > 1)
            cchans[k++] = c;
        else
            chans[j++] = c;
    *ncoded = nc;
    *nconst = nk;
    return n - n0;
}

/* `CodeLayout.build`'s arrays from the classes and the groups' low / size (see CodeLayout):
 * group_start [N], and per pair ncoded, nconst and per channel group_of, chans, cchans, sym_base.
 * Returns 0, or -1 if a class is out of range or the classes imply other than N groups. */
int cg_layout(const uint8_t *classes, int64_t G, int64_t C, int64_t N, const int32_t *low,
              const int64_t *size, int64_t *group_start, int64_t *group_of, int64_t *ncoded,
              int64_t *chans, int64_t *nconst, int64_t *cchans, int64_t *sym_base) {
    for (int64_t n = 0, start = 0; n < N; n++) {
        group_start[n] = start;
        start += size[n];
    }
    int64_t n = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t k = layout_pair(classes + g * C, C, n, N, low, size, group_start, group_of + g * C,
                                sym_base + g * C, chans + g * C, cchans + g * C, ncoded + g,
                                nconst + g);
        if (k < 0) return -1;
        n += k;
    }
    return n == N ? 0 : -1;
}

/* `cachegen.rans.normalize` of one group: its counts cnt [size] -> f, scaled to sum to
 * PROB_SCALE, 1 + count * (PROB_SCALE - k) / total (floor) for the k symbols that occur, 0 for the
 * others, the remainder added to the group's most frequent symbol (the first of ties). Returns 0,
 * or -1 if the group has no counts. */
static int normalize_group(const int64_t *cnt, int64_t size, uint32_t *f) {
    int64_t total = 0, k = 0, top = 0, used = 0;
    for (int64_t e = 0; e < size; e++) {
        total += cnt[e];
        k += cnt[e] > 0;
        top = cnt[e] > cnt[top] ? e : top;
    }
    if (total == 0) return -1;
    for (int64_t e = 0; e < size; e++) {
        f[e] = cnt[e] > 0 ? (uint32_t)(1 + cnt[e] * (PROB_SCALE - k) / total) : 0;
        used += f[e];
    }
    f[top] += (uint32_t)(PROB_SCALE - used);
    return 0;
}

/* counts [entries] -> freq for the N groups at group_start / group_size. Returns 0, or -1 if a
 * group has no counts. */
int cg_normalize(const int64_t *counts, int64_t N, const int64_t *group_start,
                 const int64_t *group_size, uint32_t *freq) {
    for (int64_t n = 0; n < N; n++)
        if (normalize_group(counts + group_start[n], group_size[n], freq + group_start[n]))
            return -1;
    return 0;
}

/* One table entry for the encoder. x / f is exact for x < 2^63, 1 <= f <= 2^PROB_BITS as
 * floor(x * m / 2^(64 + l - 1)) with l = ceil(log2 f) and m = ceil(2^(63 + l) / f) < 2^64
 * (Granlund-Montgomery, N = 63). Then
 * x' = (x / f) << PROB_BITS | x % f + cum = x + (x / f) * (2^PROB_BITS - f) + cum. f = 1 uses
 * m = 2^64 - 1, l - 1 = 0, which gives x - 1 instead of x (x >= 1): its bias adds the missing
 * 2^PROB_BITS - 1. 32-byte entries (an entry's address is one shift and add from its symbol;
 * cmpl is 64-bit for a multiply from memory), one pointer per coded channel to its group's
 * entries. */
typedef struct {
    uint64_t m;
    uint64_t x_max; /* renormalize (emit a word) while x >= x_max */
    uint64_t cmpl;  /* 2^PROB_BITS - f */
    uint32_t shift; /* l - 1 */
    uint32_t bias;  /* cum, plus 2^PROB_BITS - 1 when f = 1 (see enc_put) */
} enc_sym;

static void enc_sym_init(enc_sym *s, uint32_t freq, uint32_t cum) {
    uint32_t l = 0;
    while ((1u << l) < freq) l++;
    s->cmpl = PROB_SCALE - freq;
    if (freq == 1) {
        s->m = ~0ull;
        s->shift = 0;
        s->bias = cum + (uint32_t)s->cmpl;
    } else {
        unsigned __int128 num = (unsigned __int128)1 << (63 + l);
        s->m = (uint64_t)((num + freq - 1) / freq);
        s->shift = l - 1;
        s->bias = cum;
    }
    s->x_max = ((RANS_L >> PROB_BITS) << 32) * (uint64_t)freq;
}

static inline uint64_t enc_put(uint64_t x, const enc_sym *s) {
    uint64_t quot = (uint64_t)(((unsigned __int128)x * s->m) >> 64) >> s->shift;
    return x + quot * s->cmpl + s->bias;
}

/* One encoder step on state X for the row's coded channel J (column COL(J) of the row): emit a
 * word if needed (written ahead into out[at - 1] always, kept only when emitted: branch-free; the
 * count `at += kept - 1` compiles to one add with carry), then code the symbol. */
#define ENC_STEP(X, J, COL)                                                                 \
    do {                                                                                    \
        const enc_sym *e_ = base[J] + row[COL(J)];                                          \
        int keep_ = (X) < e_->x_max;                                                        \
        out[at - 1] = (uint32_t)(X);                                                        \
        at += keep_ - 1;                                                                    \
        (X) = keep_ ? (X) : (X) >> 32;                                                      \
        (X) = enc_put((X), e_);                                                             \
    } while (0)

#define ENC_ANY_LANE(I, J, COL)                                                             \
    do {                                                                                    \
        switch ((I) & (LANES - 1)) {                                                        \
        case 0: ENC_STEP(x0, J, COL); break;                                                \
        case 1: ENC_STEP(x1, J, COL); break;                                                \
        case 2: ENC_STEP(x2, J, COL); break;                                                \
        case 3: ENC_STEP(x3, J, COL); break;                                                \
        case 4: ENC_STEP(x4, J, COL); break;                                                \
        case 5: ENC_STEP(x5, J, COL); break;                                                \
        case 6: ENC_STEP(x6, J, COL); break;                                                \
        default: ENC_STEP(x7, J, COL); break;                                               \
        }                                                                                   \
    } while (0)

/* Code one row's channels, last to first (i: the substream index of channel j's symbol). A pair
 * whose channels are all coded reads column j directly (COL_ALL); otherwise through its list of
 * coded channels (COL_LISTED): the indirection costs ~15% of the coder's time. */
#define COL_ALL(J) (J)
#define COL_LISTED(J) ch[J]
#define ENC_ROW(COL)                                                                        \
    do {                                                                                    \
        int64_t j = nc - 1;                                                                 \
        for (; j >= 0 && (i & (LANES - 1)) != LANES - 1; j--, i--) ENC_ANY_LANE(i, j, COL); \
        for (; j >= LANES - 1; j -= LANES, i -= LANES) {                                    \
            ENC_STEP(x7, j, COL);                                                           \
            ENC_STEP(x6, j - 1, COL);                                                       \
            ENC_STEP(x5, j - 2, COL);                                                       \
            ENC_STEP(x4, j - 3, COL);                                                       \
            ENC_STEP(x3, j - 4, COL);                                                       \
            ENC_STEP(x2, j - 5, COL);                                                       \
            ENC_STEP(x1, j - 6, COL);                                                       \
            ENC_STEP(x0, j - 7, COL);                                                       \
        }                                                                                   \
        for (; j >= 0; j--, i--) ENC_ANY_LANE(i, j, COL);                                   \
    } while (0)


/* The encoder entries of one group's table freq [size] (entries with f = 0 are never used). */
static void enc_group(const uint32_t *freq, int64_t size, enc_sym *tab) {
    uint32_t cum = 0;
    for (int64_t e = 0; e < size; e++) {
        if (freq[e]) enc_sym_init(&tab[e], freq[e], cum);
        cum += freq[e];
    }
}

/* Pass 4 on one substream: the symbols of tokens [t0, t1) of a pair (q: its rows [T][C]) over its
 * nc >= 1 coded channels ch[j], whose table entries are base[j][symbol], written backwards from
 * end. Returns where its words begin, or NULL if they would reach below lo. */
PAIR uint32_t *encode_substream(const int16_t *q, int64_t C, int64_t t0, int64_t t1, int64_t nc,
                                const int64_t *ch, const enc_sym **base, uint32_t *lo,
                                uint32_t *end) {
    uint64_t x0 = RANS_L, x1 = RANS_L, x2 = RANS_L, x3 = RANS_L, x4 = RANS_L, x5 = RANS_L,
             x6 = RANS_L, x7 = RANS_L;
    uint32_t *out = lo;
    int64_t i = (t1 - t0) * nc - 1, at = end - lo; /* the words so far: out[at ..] */
    for (int64_t t = t1 - 1; t >= t0; t--) {
        if (at < nc + 1) return NULL; /* a row emits <= nc words (+ the slot written ahead) */
        const int16_t *row = q + t * C;
        if (t - 2 >= t0) /* rows are read backwards, long after quantize wrote them */
            for (int64_t c = 0; c < C; c += 32) __builtin_prefetch(row - 2 * C + c);
        if (nc == C)
            ENC_ROW(COL_ALL);
        else
            ENC_ROW(COL_LISTED);
    }
    if (at < 2 * LANES) return NULL;
    uint32_t *ptr = out + at;
    uint64_t x[LANES] = {x0, x1, x2, x3, x4, x5, x6, x7};
    for (int l = LANES - 1; l >= 0; l--) {
        *--ptr = (uint32_t)x[l];
        *--ptr = (uint32_t)(x[l] >> 32);
    }
    return ptr;
}

/* Substream s's words at out[stream_start[s], region_start[s + 1]) moved together to the start
 * of out, s in order; lengths[s] receives each one's bytes. Returns the number of words. */
static int64_t compact_substreams(uint32_t *out, const int64_t *region_start,
                                  const int64_t *stream_start, int64_t n, int64_t *lengths) {
    int64_t total = 0;
    for (int64_t s = 0; s < n; s++) {
        const int64_t len = region_start[s + 1] - stream_start[s];
        memmove(out + total, out + stream_start[s], sizeof(uint32_t) * len);
        lengths[s] = 4 * len;
        total += len;
    }
    return total;
}

/* Pass 4. Encode substream (b, g) for every b, g (block b covers tokens [block_starts[b],
 * block_starts[b + 1]); pair g codes its ncoded[g] channels chans[g * C + j], j < ncoded[g],
 * whose table entries start at sym_base[g * C + chan]) into out[region_start[s], region_start[s + 1])
 * (s = b * G + g), written backwards from the region's end, then moved together to the start of
 * out (compact_substreams). freq: per table entry, the N groups' tables at group_start[n],
 * group_size[n] entries each.
 * Returns the number of words, or -1 if a region was too small, -2 on allocation failure. */
int64_t cg_encode(const int16_t *q, int64_t G, int64_t T, int64_t C, int64_t B,
                      const int64_t *block_starts, const int64_t *ncoded, const int64_t *chans,
                      const int64_t *sym_base, const uint32_t *freq, int64_t N,
                      const int64_t *group_start, const int64_t *group_size, uint32_t *out,
                      const int64_t *region_start, int64_t *lengths, int nthreads) {
    int64_t nsym = N ? group_start[N - 1] + group_size[N - 1] : 0;
    enc_sym *tab = (enc_sym *)malloc(sizeof(enc_sym) * (nsym > 0 ? nsym : 1));
    int64_t *stream_start = (int64_t *)malloc(sizeof(int64_t) * (B * G > 0 ? B * G : 1));
    if (!tab || !stream_start) {
        free(tab);
        free(stream_start);
        return -2;
    }
    for (int64_t n = 0; n < N; n++) enc_group(freq + group_start[n], group_size[n], tab + group_start[n]);
    int status = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t s = 0; s < B * G; s++) {
        int64_t b = s / G, g = s % G, nc = ncoded[g];
        stream_start[s] = region_start[s + 1];
        if (nc == 0 || block_starts[b + 1] == block_starts[b]) continue;
        const int64_t *ch = chans + g * C, *sb = sym_base + g * C;
        const enc_sym **base = (const enc_sym **)malloc(sizeof(enc_sym *) * nc);
        if (!base) {
            #pragma omp atomic write
            status = -2;
            continue;
        }
        for (int64_t j = 0; j < nc; j++) base[j] = tab + sb[ch[j]];
        uint32_t *start = encode_substream(q + g * T * C, C, block_starts[b], block_starts[b + 1],
                                           nc, ch, base, out + region_start[s],
                                           out + region_start[s + 1]);
        free(base);
        if (!start) {
            #pragma omp atomic write
            status = -1;
            continue;
        }
        stream_start[s] = start - out;
    }
    const int64_t total = status ? status : compact_substreams(out, region_start, stream_start,
                                                                B * G, lengths);
    free(tab);
    free(stream_start);
    return total;
}

/* The whole encoder in one call (`NativeKernels.encode_chunk`): the results of the passes above
 * and of the numpy steps between them (`cachegen.quant`, `cachegen.layout`), each pair's passes
 * back to back on its own symbols while they are in cache. */
#define EXP_LIMIT 800     /* cachegen.quant: exponents e in [-EXP_LIMIT, EXP_LIMIT] ... */
#define EXP_WINDOW 255    /* ... within EXP_WINDOW of their pair's largest */
#define QMAX 2047
#define MAX_ALPHABET 4095 /* cachegen.format: symbols per group */
#define PAIR_ENTRIES (NUM_CLASSES * MAX_ALPHABET) /* table entries a pair can have */

/* A per-thread buffer grown to the largest need seen (0, or -1 if it cannot grow). */
static int grow(void **buf, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    void *p = realloc(*buf, item * (size_t)need);
    if (!p) return -1;
    *buf = p;
    *cap = need;
    return 0;
}

/* For each pair g (in parallel):
 * - pass 1; means[g][c] = colsum / T rounded to bf16;
 * - exponents exps[g][t] = (the number of exp_thr [2 * EXP_LIMIT] entries <= (sumsq / C) * s * s,
 *   s = 8 / bins[g]) - EXP_LIMIT, raised to the pair's largest - EXP_WINDOW;
 * - pass 2 with inv_step_of[e + EXP_LIMIT] (anchors and refine as cg_quantize);
 * - classes[g][c] = the number of class_thr [NUM_CLASSES - 1] entries <= abs_sum / T + 1/4;
 * - its groups: low / size at [g * NUM_CLASSES + k], k < ngroups[g];
 * - its layout, pass 3, its groups' frequency tables (cg_normalize) and pass 4 of its substreams
 *   (b, g), s = b * G + g, into out[region_start[s], region_start[s + 1]) (as cg_encode).
 * Then the pairs' tables are moved together to the start of freq (room for G * PAIR_ENTRIES; pair
 * g's are written at g * PAIR_ENTRIES first), and the substreams to the start of out
 * (compact_substreams, lengths[s] receiving each one's bytes). Returns the number of words; -1 if a region was too
 * small, -2 on allocation failure, -3 for non-finite sums, -4 if a token's symbols reach QMAX
 * (its step needs raising: `cachegen.quant.bound_exponents`, which the passes do), -5 for a group
 * of more than MAX_ALPHABET symbols. */
int64_t cg_encode_chunk(const void *x, int dtype, int64_t G, int64_t T, int64_t C, int64_t B,
                            const int64_t *block_starts, const int64_t *anchor_of,
                            const int64_t *bins, const double *exp_thr, const float *inv_step_of,
                            const double *class_thr, float *means, int32_t *exps, uint8_t *refine,
                            uint8_t *classes, int32_t *low, int64_t *size, int64_t *ngroups,
                            uint32_t *freq, uint32_t *out, const int64_t *region_start,
                            int64_t *lengths, int nthreads) {
    int64_t *stream_start = (int64_t *)malloc(sizeof(int64_t) * (B * G > 0 ? B * G : 1));
    int64_t *entries = (int64_t *)malloc(sizeof(int64_t) * (G > 0 ? G : 1));
    if (!stream_start || !entries) {
        free(stream_start);
        free(entries);
        return -2;
    }
    int status = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && G > 1)
    {
        quant_buf b;
        int16_t *q = (int16_t *)malloc(sizeof(int16_t) * T * C);
        float *colsum = (float *)malloc(sizeof(float) * C), *inv = (float *)malloc(sizeof(float) * T);
        double *sumsq = (double *)malloc(sizeof(double) * T);
        int64_t *asum = (int64_t *)malloc(sizeof(int64_t) * C);
        int64_t *chan_buf = (int64_t *)malloc(sizeof(int64_t) * 4 * C);
        int32_t *qmin = (int32_t *)malloc(sizeof(int32_t) * C), *qmax = (int32_t *)malloc(sizeof(int32_t) * C);
        int32_t *qpeak = (int32_t *)malloc(sizeof(int32_t) * T);
        const enc_sym **base = (const enc_sym **)malloc(sizeof(enc_sym *) * C);
        int32_t **hist_at = (int32_t **)malloc(sizeof(int32_t *) * C);
        int64_t *counts = NULL, counts_cap = 0, part_cap = 0, tab_cap = 0;
        int32_t *part = NULL;
        enc_sym *tab = NULL;
        if (quant_buf_alloc(&b, C) || !q || !colsum || !inv || !sumsq || !asum || !chan_buf ||
            !qmin || !qmax || !qpeak || !base || !hist_at) {
            #pragma omp atomic write
            status = -2;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < G; g++) {
            if (status) continue;
            stats_pair(x, dtype, g, T, C, b.row, colsum, sumsq);
            int finite = 1;
            for (int64_t c = 0; c < C; c++) finite &= __builtin_isfinite(colsum[c]);
            for (int64_t t = 0; t < T; t++) finite &= __builtin_isfinite(sumsq[t]);
            if (!finite) {
                #pragma omp atomic write
                status = -3;
                continue;
            }
            float *mean = means + g * C;
            for (int64_t c = 0; c < C; c++) mean[c] = bf16_to_f32(f32_to_bf16(colsum[c] / (float)T));
            const double s = 8.0 / (double)bins[g], s2 = s * s;
            int32_t *e = exps + g * T, top = -EXP_LIMIT;
            for (int64_t t = 0; t < T; t++) {
                const double r2 = (sumsq[t] / (double)C) * s2;
                int64_t lo = 0, hi = 2 * EXP_LIMIT; /* the number of thresholds <= r2 */
                while (lo < hi) {
                    int64_t mid = (lo + hi) / 2;
                    if (exp_thr[mid] <= r2)
                        lo = mid + 1;
                    else
                        hi = mid;
                }
                e[t] = (int32_t)(lo - EXP_LIMIT);
                top = e[t] > top ? e[t] : top;
            }
            for (int64_t t = 0; t < T; t++) {
                e[t] = e[t] > top - EXP_WINDOW ? e[t] : top - EXP_WINDOW;
                inv[t] = inv_step_of[e[t] + EXP_LIMIT];
            }
            quantize_pair(x, dtype, g, G, T, C, mean, inv, anchor_of, q, refine + g * C, asum, qmin,
                          qmax, qpeak, &b);
            int32_t peak = 0;
            for (int64_t t = 0; t < T; t++) peak = qpeak[t] > peak ? qpeak[t] : peak;
            if (peak >= QMAX) {
                #pragma omp atomic write
                status = -4;
                continue;
            }
            uint8_t *cls = classes + g * C;
            for (int64_t c = 0; c < C; c++) {
                const double spread = (double)asum[c] / (double)T + 0.25;
                int k = 0;
                while (k < NUM_CLASSES - 1 && class_thr[k] <= spread) k++;
                cls[c] = (uint8_t)k;
            }
            int32_t *lw = low + g * NUM_CLASSES;
            int64_t *sz = size + g * NUM_CLASSES, class_size[NUM_CLASSES], start[NUM_CLASSES], n = 0;
            const int64_t ng = ngroups[g] = group_ranges_pair(cls, qmin, qmax, C, lw, sz, class_size);
            for (int64_t k = 0; k < ng; k++) {
                start[k] = n;
                n += sz[k];
                if (sz[k] > MAX_ALPHABET) {
                    #pragma omp atomic write
                    status = -5;
                }
            }
            if (status) continue;
            int64_t *group_of = chan_buf, *sym_base = chan_buf + C, *chans = chan_buf + 2 * C,
                    *cchans = chan_buf + 3 * C, nc = 0, nk = 0;
            layout_pair(cls, C, 0, ng, lw, sz, start, group_of, sym_base, chans, cchans, &nc, &nk);
            if (grow((void **)&counts, &counts_cap, n, sizeof(int64_t)) ||
                grow((void **)&part, &part_cap, HIST_COPIES * n, sizeof(int32_t)) ||
                grow((void **)&tab, &tab_cap, n, sizeof(enc_sym))) {
                #pragma omp atomic write
                status = -2;
                continue;
            }
            histogram_pair(q, T, C, sym_base, 0, n, part, hist_at, counts);
            uint32_t *f = freq + g * PAIR_ENTRIES;
            for (int64_t k = 0; k < ng; k++) { /* every group has symbols: normalize succeeds */
                normalize_group(counts + start[k], sz[k], f + start[k]);
                enc_group(f + start[k], sz[k], tab + start[k]);
            }
            entries[g] = n;
            for (int64_t j = 0; j < nc; j++) base[j] = tab + sym_base[chans[j]];
            for (int64_t blk = 0; blk < B; blk++) {
                const int64_t sub = blk * G + g;
                stream_start[sub] = region_start[sub + 1];
                if (nc == 0 || block_starts[blk + 1] == block_starts[blk]) continue;
                uint32_t *first = encode_substream(q, C, block_starts[blk], block_starts[blk + 1],
                                                   nc, chans, base, out + region_start[sub],
                                                   out + region_start[sub + 1]);
                if (!first) {
                    #pragma omp atomic write
                    status = -1;
                    break;
                }
                stream_start[sub] = first - out;
            }
        }
        quant_buf_free(&b);
        free(q);
        free(colsum);
        free(inv);
        free(sumsq);
        free(asum);
        free(chan_buf);
        free(qmin);
        free(qmax);
        free(qpeak);
        free(base);
        free(hist_at);
        free(counts);
        free(part);
        free(tab);
    }
    int64_t total = status;
    if (status == 0) {
        for (int64_t g = 0, at = 0; g < G; g++) {
            memmove(freq + at, freq + g * PAIR_ENTRIES, sizeof(uint32_t) * entries[g]);
            at += entries[g];
        }
        total = compact_substreams(out, region_start, stream_start, B * G, lengths);
    }
    free(stream_start);
    free(entries);
    return total;
}

/* A coded word as the decoder reads it: in place in the stream, which need not be 4-byte aligned
 * (where it starts in a blob depends on the tables before it; x86 loads it as fast either way). */
typedef uint32_t word32 __attribute__((aligned(1), may_alias));

/* One decoder step on state X for coded channel J (column COL(J) of the row, as in ENC_ROW;
 * IDX: the type of its slot index, see dec_tables): decode, renormalize branch-free (reading the
 * next word always; CHECKED: guard the read and mark the substream broken past its end). */
#define DEC_STEP(X, J, CHECKED, COL, IDX)                                                    \
    do {                                                                                     \
        const IDX *t_ = (const IDX *)tab[J];                                                 \
        uint32_t slot_ = (uint32_t)((X) & (PROB_SCALE - 1));                                 \
        uint32_t k_ = t_[slot_];                                                             \
        uint32_t e_ = ((const uint32_t *)(t_ + PROB_SCALE))[k_];                             \
        (X) = (uint64_t)(e_ >> 16) * ((X) >> PROB_BITS) + slot_ - (e_ & 0xFFFFu);            \
        if (CHECKED)                                                                         \
            REFILL_CHECKED(X);                                                               \
        else                                                                                 \
            REFILL(X);                                                                       \
        sym[COL(J)] = (int32_t)k_;                                                           \
    } while (0)

/* Renormalize state X after a decode step: while X < RANS_L, X = X << 32 | w[ptr++] (at most
 * once). Whether a lane refills is data (about one step in ten, at random): a branch would be
 * mispredicted that often, so this is a select. On x86-64 it is written out (compare, cmov, add
 * with carry: GCC otherwise emits a branch, or a masked select of twice the instructions). */
#if defined(__x86_64__)
#define REFILL(X)                                                                            \
    do {                                                                                     \
        uint64_t refill_ = ((X) << 32) | w[ptr], high_ = (X) >> 31;                          \
        __asm__("cmpq $1, %[h]\n\tcmovb %[r], %[x]\n\tadcq $0, %[p]"                        \
                : [x] "+r"(X), [p] "+r"(ptr) : [h] "r"(high_), [r] "r"(refill_) : "cc");      \
    } while (0)
#else
#define REFILL(X)                                                                            \
    do {                                                                                     \
        uint64_t need_ = (X) < RANS_L, refill_ = ((X) << 32) | w[ptr];                       \
        (X) = need_ ? refill_ : (X);                                                         \
        ptr += (int64_t)need_;                                                               \
    } while (0)
#endif
/* The same where the substream may run out of words: a lane that needs one past the end marks
 * it broken instead. */
#define REFILL_CHECKED(X)                                                                    \
    do {                                                                                     \
        uint64_t need_ = (X) < RANS_L;                                                       \
        if (ptr >= len) {                                                                    \
            broken |= (int)need_;                                                            \
            need_ = 0;                                                                       \
        }                                                                                    \
        uint64_t refill_ = ((X) << 32) | w[ptr >= len ? 0 : ptr];                            \
        (X) = need_ ? refill_ : (X);                                                         \
        ptr += (int64_t)need_;                                                               \
    } while (0)

#define DEC_ANY_LANE(I, J, CHECKED, COL, IDX)                                                \
    do {                                                                                     \
        switch ((I) & (LANES - 1)) {                                                         \
        case 0: DEC_STEP(x0, J, CHECKED, COL, IDX); break;                                   \
        case 1: DEC_STEP(x1, J, CHECKED, COL, IDX); break;                                   \
        case 2: DEC_STEP(x2, J, CHECKED, COL, IDX); break;                                   \
        case 3: DEC_STEP(x3, J, CHECKED, COL, IDX); break;                                   \
        case 4: DEC_STEP(x4, J, CHECKED, COL, IDX); break;                                   \
        case 5: DEC_STEP(x5, J, CHECKED, COL, IDX); break;                                   \
        case 6: DEC_STEP(x6, J, CHECKED, COL, IDX); break;                                   \
        default: DEC_STEP(x7, J, CHECKED, COL, IDX); break;                                  \
        }                                                                                    \
    } while (0)

/* Decode one row's coded channels into sym (see ENC_ROW for COL). */
#define DEC_ROW(COL, IDX)                                                                    \
    do {                                                                                     \
        int64_t j = 0;                                                                       \
        if (len - ptr >= nc) { /* the row cannot run out of words: no bounds checks */       \
            for (; j < nc && (i & (LANES - 1)); j++, i++) DEC_ANY_LANE(i, j, 0, COL, IDX);   \
            for (; j + LANES <= nc; j += LANES, i += LANES) {                                \
                DEC_STEP(x0, j, 0, COL, IDX);                                                \
                DEC_STEP(x1, j + 1, 0, COL, IDX);                                            \
                DEC_STEP(x2, j + 2, 0, COL, IDX);                                            \
                DEC_STEP(x3, j + 3, 0, COL, IDX);                                            \
                DEC_STEP(x4, j + 4, 0, COL, IDX);                                            \
                DEC_STEP(x5, j + 5, 0, COL, IDX);                                            \
                DEC_STEP(x6, j + 6, 0, COL, IDX);                                            \
                DEC_STEP(x7, j + 7, 0, COL, IDX);                                            \
            }                                                                                \
        }                                                                                    \
        for (; j < nc; j++, i++) DEC_ANY_LANE(i, j, 1, COL, IDX);                            \
    } while (0)

/* The decoder table of each group of [first, last] (one pair's groups), DEC_TABLE(narrow) bytes
 * apart in tables: per slot the local index k owning it (PROB_SCALE of them, uint8_t where
 * `narrow`, i.e. every group has at most 256 symbols: the tables then take half the cache, else
 * uint16_t), then per k its entry f << 16 | cum (uint32_t). freq: the concatenated tables
 * (`cachegen.rans.check_tables` has checked that each sums to PROB_SCALE; checked again here, so
 * that no caller can make this write past the tables). Returns 0, or -1 for a group whose
 * frequencies do not sum to PROB_SCALE. */
#define DEC_TABLE(narrow) ((narrow) ? PROB_SCALE + 4 * 256 : 2 * PROB_SCALE + 4 * PROB_SCALE)

static int dec_tables(const uint32_t *freq, const int64_t *group_start, const int64_t *group_size,
                      int64_t first, int64_t last, int narrow, char *tables) {
    for (int64_t grp = first; grp <= last; grp++) {
        char *table = tables + (grp - first) * DEC_TABLE(narrow);
        uint8_t *ix8 = (uint8_t *)table;
        uint16_t *ix16 = (uint16_t *)table;
        uint32_t *en = (uint32_t *)(table + PROB_SCALE * (narrow ? 1 : 2));
        const uint32_t *f = freq + group_start[grp];
        uint32_t slot = 0;
        for (int64_t k = 0; k < group_size[grp]; k++) {
            if (f[k] > PROB_SCALE - slot) return -1;
            en[k] = f[k] << 16 | slot;
            if (narrow) memset(ix8 + slot, (int)k, f[k]);
            else for (uint32_t r = 0; r < f[k]; r++) ix16[slot + r] = (uint16_t)k;
            slot += f[k];
        }
        if (slot != PROB_SCALE) return -1;
    }
    return 0;
}

/* Decode every substream and dequantize straight into out ([G][T][C] of dtype):
 * value = (float)symbol * step[g][t] + mean[g][c] rounded to the output dtype. Channel c of pair g
 * belongs to group gid = group_of_chan[g * C + c] (a pair's groups are consecutive, at most
 * NUM_CLASSES); its symbol is group_low[gid] + the decoded local index (coded channels) or
 * group_low[gid] (channels listed in cchans[g * C + k], k < nconst[g], whose group has a single
 * symbol). Group gid's frequencies: freq[group_start[gid] .. + group_size[gid]]. The first token
 * of block b (its anchor) adds refine[(b * G + g) * C + c] to each symbol before dequantizing.
 * Substream s's words: words[stream_off[s], + stream_len[s]). Returns the number of substreams
 * that failed to decode (0 = all valid). */
int cg_decode(const word32 *words, const int64_t *stream_off, const int64_t *stream_len,
              int64_t G, int64_t T, int64_t C, int64_t B, const int64_t *block_starts,
              const int64_t *ncoded, const int64_t *chans, const int64_t *nconst,
              const int64_t *cchans, const int64_t *group_of_chan, const int64_t *group_start,
              const int64_t *group_size, const int32_t *group_low, const uint32_t *freq,
              const float *means, const float *steps, const float *refine, void *out, int dtype,
              int nthreads) {
    int bad = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const char **tab = (const char **)malloc(sizeof(char *) * C); /* coded channel j's table */
        int32_t *restrict sym = (int32_t *)malloc(sizeof(int32_t) * C); /* the row's local indices */
        int32_t *restrict low = (int32_t *)malloc(sizeof(int32_t) * C); /* + low[c]: its symbols */
        char *tables = (char *)malloc(NUM_CLASSES * DEC_TABLE(0));
        int ok = tab && sym && low && tables;
        int64_t built = -1; /* the pair whose tables `tables` holds */
        #pragma omp for schedule(dynamic, 1) reduction(+ : bad)
        for (int64_t s = 0; s < B * G; s++) {
            if (!ok) {
                bad++;
                continue;
            }
            int64_t b = s / G, g = s % G, nc = ncoded[g], nk = nconst[g];
            int64_t t0 = block_starts[b], t1 = block_starts[b + 1];
            const float *restrict mean = means + g * C;
            const int64_t *ch = chans + g * C, *cc = cchans + g * C, *gid = group_of_chan + g * C;
            int64_t first = gid[0], last = gid[0];
            for (int64_t c = 1; c < C; c++) {
                first = gid[c] < first ? gid[c] : first;
                last = gid[c] > last ? gid[c] : last;
            }
            if (last - first >= NUM_CLASSES) { /* CodeLayout never builds such a pair */
                bad++;
                continue;
            }
            int narrow = 1;
            for (int64_t grp = first; grp <= last; grp++) narrow &= group_size[grp] <= 256;
            if (built != g && nc) {
                built = -1;
                if (dec_tables(freq, group_start, group_size, first, last, narrow, tables)) {
                    bad++;
                    continue;
                }
                built = g;
            }
            for (int64_t c = 0; c < C; c++) low[c] = group_low[gid[c]];
            for (int64_t k = 0; k < nk; k++) sym[cc[k]] = 0;
            for (int64_t j = 0; j < nc; j++) tab[j] = tables + (gid[ch[j]] - first) * DEC_TABLE(narrow);
            int64_t n = (t1 - t0) * nc, len = stream_len[s];
            const word32 *w = words + stream_off[s];
            int broken = n == 0 ? len != 0 : len < 2 * LANES;
            uint64_t x0, x1, x2, x3, x4, x5, x6, x7;
            x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = RANS_L;
            if (n && !broken) {
                x0 = ((uint64_t)w[0] << 32) | w[1];
                x1 = ((uint64_t)w[2] << 32) | w[3];
                x2 = ((uint64_t)w[4] << 32) | w[5];
                x3 = ((uint64_t)w[6] << 32) | w[7];
                x4 = ((uint64_t)w[8] << 32) | w[9];
                x5 = ((uint64_t)w[10] << 32) | w[11];
                x6 = ((uint64_t)w[12] << 32) | w[13];
                x7 = ((uint64_t)w[14] << 32) | w[15];
            }
            int64_t ptr = n ? 2 * LANES : 0, i = 0;
            for (int64_t t = t0; t < t1 && !broken; t++) {
                if (nc == C && narrow)
                    DEC_ROW(COL_ALL, uint8_t);
                else if (narrow)
                    DEC_ROW(COL_LISTED, uint8_t);
                else if (nc == C)
                    DEC_ROW(COL_ALL, uint16_t);
                else
                    DEC_ROW(COL_LISTED, uint16_t);
                const float step = steps[g * T + t];
                int64_t o = (g * T + t) * C;
                if (t == t0) {
                    const float *ref = refine + (b * G + g) * C;
                    for (int64_t c = 0; c < C; c++) {
                        float v = ((float)(sym[c] + low[c]) + ref[c]) * step + mean[c];
                        if (dtype == 0) ((uint16_t *)out)[o + c] = f32_to_bf16(v);
                        else if (dtype == 1) ((_Float16 *)out)[o + c] = (_Float16)v;
                        else ((float *)out)[o + c] = v;
                    }
                } else if (dtype == 0) {
                    uint16_t *restrict dst = (uint16_t *)out + o;
                    for (int64_t c = 0; c < C; c++) dst[c] = f32_to_bf16((float)(sym[c] + low[c]) * step + mean[c]);
                } else if (dtype == 1) {
                    _Float16 *restrict dst = (_Float16 *)out + o;
                    for (int64_t c = 0; c < C; c++) dst[c] = (_Float16)((float)(sym[c] + low[c]) * step + mean[c]);
                } else {
                    float *restrict dst = (float *)out + o;
                    for (int64_t c = 0; c < C; c++) dst[c] = (float)(sym[c] + low[c]) * step + mean[c];
                }
            }
            broken |= (x0 != RANS_L) | (x1 != RANS_L) | (x2 != RANS_L) | (x3 != RANS_L) |
                      (x4 != RANS_L) | (x5 != RANS_L) | (x6 != RANS_L) | (x7 != RANS_L);
            bad += broken || ptr != len;
        }
        free(tab);
        free(sym);
        free(low);
        free(tables);
    }
    return bad;
}
