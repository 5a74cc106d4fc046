/* Paged attention for short query runs on the CPU: decodes, drafts being verified, and
 * the short tail of a prompt, read straight from the paged KV cache.
 *
 * The torch backend gathers every sequence's blocks into a padded buffer and runs two
 * batched matmuls over it: K and V cross memory twice (the gather writes them, the matmuls
 * read them back), the padding is read too, and a batched matmul of a few query rows is far
 * from the copy rate.  Here each (sequence, KV head, key range) is one work item that reads
 * its keys and values once, in place, with an online softmax over blocks (one rescale per
 * block), accumulating in fp32.  A sequence's G = H / Hkv query heads share the pass over
 * their KV head.  When there are too few items to keep every thread busy (a long prompt's
 * first token, a small batch), each sequence's blocks are split into ranges whose partial
 * results are merged at the end (as flash-decoding does).
 *
 * Row j (0-based) of a sequence with r query rows and ctx keys sees keys [0, ctx - r + 1 + j).
 * Layouts: q, out [T, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int64
 * [num_seqs, table_stride]; q_start int64 [num_seqs + 1]; ctx_lens int64 [num_seqs].
 * dtype 0: float32 q/caches/out; 1: bfloat16.  Returns 0, or a code for arguments the
 * kernel does not take (the caller falls back to torch).
 * Compiled at first use by chunkserve/attention/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BLOCK 64  /* tokens per KV block */
#define MAX_DIM 256   /* head_dim */

typedef struct {
    float m, l;  /* running max of the scores, sum of their exponentials */
} stat_t;

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = ((uint32_t)x) << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* Copy n rows of D values (source rows `stride` elements apart) into a dense fp32 [n, D]. */
static inline void rows_to_f32(float *restrict dst, const void *src, int dtype, int64_t n,
                               int64_t D, int64_t stride) {
    if (dtype == 0) {
        const float *s = (const float *)src;
        for (int64_t t = 0; t < n; t++) memcpy(dst + t * D, s + t * stride, sizeof(float) * D);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *restrict row = s + t * stride;
            float *restrict out = dst + t * D;
            for (int64_t d = 0; d < D; d++) out[d] = bf16_to_f32(row[d]);
        }
    }
}

/* One block for one query row: scores of its n keys (K dense fp32 [n, D] or in place),
 * then the online-softmax update of (m, l, acc). */
static inline void block_update(const float *restrict q, const float *restrict k,
                                const float *restrict v, int64_t kstride, int64_t n,
                                int64_t D, stat_t *st, float *restrict acc) {
    float s[MAX_BLOCK];
    float mx = st->m;
    for (int64_t t = 0; t < n; t++) {
        const float *restrict kt = k + t * kstride;
        float dot = 0.f;
        for (int64_t d = 0; d < D; d++) dot += q[d] * kt[d];
        s[t] = dot;
        mx = dot > mx ? dot : mx;
    }
    const float corr = expf(st->m - mx); /* 0 on the first block (m = -inf) */
    for (int64_t t = 0; t < n; t++) s[t] = expf(s[t] - mx);
    float l = 0.f;
    for (int64_t t = 0; t < n; t++) l += s[t];
    st->l = st->l * corr + l;
    st->m = mx;
    for (int64_t d = 0; d < D; d++) acc[d] *= corr;
    for (int64_t t = 0; t < n; t++) {
        const float p = s[t];
        const float *restrict vt = v + t * kstride;
        for (int64_t d = 0; d < D; d++) acc[d] += p * vt[d];
    }
}

/* The block update again for D a multiple of 16, in 16-lane vectors (one AVX-512 register,
 * or two AVX2 ones): the n <= 16 scores of a block land in the lanes of one vector through a
 * tree of shuffles (4 levels) instead of a horizontal sum per key, and the accumulator stays
 * in registers across the block's keys. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f loadu(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storeu(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* Lanes of a and b combined so that each output lane pair sums one half of the inputs'
 * groups: the level-`w` step of the tree (groups of w lanes -> groups of w/2). */
#define FOLD(a, b, lo, hi) (__builtin_shuffle((a), (b), (lo)) + __builtin_shuffle((a), (b), (hi)))

static inline v16f reduce16(v16f v[16]) {
    /* level 1: pairs (t, t+1), halves of 8 lanes -> lanes 0-7 token t, 8-15 token t+1 */
    const v16i l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i l1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i l2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i l2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i l3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i l3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i l4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i l4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) x[i] = FOLD(v[2 * i], v[2 * i + 1], l1a, l1b);
    /* x[i]: lanes 0-7 token 2i, 8-15 token 2i+1 */
    for (int i = 0; i < 4; i++) y[i] = FOLD(x[2 * i], x[2 * i + 1], l2a, l2b);
    /* y[i]: groups of 4 lanes: tokens 4i, 4i+1, 4i+2, 4i+3 */
    for (int i = 0; i < 2; i++) z[i] = FOLD(y[2 * i], y[2 * i + 1], l3a, l3b);
    /* z[i]: groups of 2 lanes: tokens 8i .. 8i+7 */
    return FOLD(z[0], z[1], l4a, l4b); /* lane t: token t */
}

static inline float hmax16(v16f v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum16(v16f v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* D = 16 * NV. Requires block_size <= 16. */
#define BLOCK_UPDATE_VEC(NV)                                                                  \
    static void block_update_v##NV(const float *restrict q, const float *restrict k,          \
                                   const float *restrict v, int64_t kstride, int64_t n,       \
                                   stat_t *st, float *restrict acc) {                         \
        v16f qv[NV], av[NV], parts[16];                                                       \
        for (int c = 0; c < NV; c++) qv[c] = loadu(q + 16 * c);                               \
        for (int64_t t = 0; t < 16; t++) {                                                    \
            if (t < n) {                                                                      \
                const float *kt = k + t * kstride;                                            \
                v16f sum = qv[0] * loadu(kt);                                                 \
                for (int c = 1; c < NV; c++) sum += qv[c] * loadu(kt + 16 * c);               \
                parts[t] = sum;                                                               \
            } else {                                                                          \
                parts[t] = (v16f){0};                                                         \
            }                                                                                 \
        }                                                                                     \
        v16f s = reduce16(parts);                                                             \
        for (int64_t t = n; t < 16; t++) s[t] = -INFINITY;                                    \
        const float bmax = hmax16(s);                                                         \
        const float mx = bmax > st->m ? bmax : st->m;                                         \
        const float corr = expf(st->m - mx);                                                  \
        float pe[16];                                                                         \
        for (int t = 0; t < 16; t++) pe[t] = expf(s[t] - mx);                                 \
        v16f p = loadu(pe);                                                                   \
        st->l = st->l * corr + hsum16(p);                                                     \
        st->m = mx;                                                                           \
        for (int c = 0; c < NV; c++) av[c] = loadu(acc + 16 * c) * corr;                      \
        for (int64_t t = 0; t < n; t++) {                                                     \
            const float *vt = v + t * kstride;                                                \
            for (int c = 0; c < NV; c++) av[c] += p[t] * loadu(vt + 16 * c);                  \
        }                                                                                     \
        for (int c = 0; c < NV; c++) storeu(acc + 16 * c, av[c]);                             \
    }
BLOCK_UPDATE_VEC(4)
BLOCK_UPDATE_VEC(8)

static inline void prefetch_block(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* One work item: a sequence's r query rows (all H heads) over blocks [blk0, blk1). Its
 * scratch: qf [r * H, D] (scaled queries), st [r * H], acc [r * H, D]. The block's keys and
 * values for all KV heads lie together (bs * Hkv * D), read in order, the next block
 * prefetched while this one is worked on. */
static void run_item(const void *q, const void *kc, const void *vc, int dtype,
                     const int64_t *table, int64_t r, int64_t q0, int64_t ctx, int64_t H,
                     int64_t Hkv, int64_t D, int64_t bs, int64_t blk0, int64_t blk1,
                     float scale, float *restrict qf, stat_t *st, float *restrict acc) {
    const int64_t G = H / Hkv, rows = r * H, esize = dtype ? 2 : 4;
    float kbuf[MAX_BLOCK * MAX_DIM], vbuf[MAX_BLOCK * MAX_DIM];
    /* row i = j * H + h: query row j, head h (KV head h / G) */
    rows_to_f32(qf, (const char *)q + q0 * H * D * esize, dtype, rows, D, D);
    for (int64_t i = 0; i < rows * D; i++) qf[i] *= scale;
    for (int64_t i = 0; i < rows; i++) {
        st[i].m = -INFINITY;
        st[i].l = 0.f;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    const int64_t row_stride = Hkv * D, block_stride = bs * Hkv * D;
    const int64_t block_bytes = block_stride * esize;
    for (int64_t b = blk0; b < blk1; b++) {
        const int64_t first = b * bs;
        if (b + 1 < blk1) {
            prefetch_block((const char *)kc + table[b + 1] * block_bytes, block_bytes);
            prefetch_block((const char *)vc + table[b + 1] * block_bytes, block_bytes);
        }
        int64_t n_block = ctx - first; /* the last row sees the most keys */
        if (n_block > bs) n_block = bs;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const char *kb = (const char *)kc + (table[b] * block_stride + kvh * D) * esize;
            const char *vb = (const char *)vc + (table[b] * block_stride + kvh * D) * esize;
            const float *k, *v;
            int64_t kstride;
            if (dtype == 0) {
                k = (const float *)kb;
                v = (const float *)vb;
                kstride = row_stride;
            } else {
                rows_to_f32(kbuf, kb, dtype, n_block, D, row_stride);
                rows_to_f32(vbuf, vb, dtype, n_block, D, row_stride);
                k = kbuf;
                v = vbuf;
                kstride = D;
            }
            for (int64_t j = 0; j < r; j++) {
                int64_t n = ctx - r + 1 + j - first; /* keys of this block row j sees */
                if (n <= 0) continue;
                if (n > bs) n = bs;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t i = j * H + kvh * G + g;
                    if (D == 64 && bs <= 16)
                        block_update_v4(qf + i * D, k, v, kstride, n, st + i, acc + i * D);
                    else if (D == 128 && bs <= 16)
                        block_update_v8(qf + i * D, k, v, kstride, n, st + i, acc + i * D);
                    else
                        block_update(qf + i * D, k, v, kstride, n, D, st + i, acc + i * D);
                }
            }
        }
    }
}

int paged_attention(const void *q, const void *kc, const void *vc, void *out, int dtype,
                    const int64_t *tables, int64_t table_stride, const int64_t *q_start,
                    const int64_t *q_len, const int64_t *ctx_lens, int64_t num_seqs,
                    int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                    int64_t num_threads) {
    if (bs > MAX_BLOCK || D > MAX_DIM || Hkv <= 0 || H % Hkv || (dtype != 0 && dtype != 1))
        return 1;
    int64_t max_rows = 0, max_blocks = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t nb = (ctx_lens[s] + bs - 1) / bs;
        if (q_len[s] < 1 || q_len[s] > ctx_lens[s]) return 2;
        if (q_len[s] * H > max_rows) max_rows = q_len[s] * H;
        if (nb > max_blocks) max_blocks = nb;
    }
    if (num_seqs == 0) return 0;
    /* Split each sequence's blocks into ranges of at least 8 blocks when there are too few
     * sequences to balance over the threads. */
    int64_t splits = 1;
    if (num_seqs < 4 * num_threads) {
        splits = (4 * num_threads + num_seqs - 1) / num_seqs;
        const int64_t most = (max_blocks + 7) / 8;
        if (splits > most) splits = most;
        if (splits < 1) splits = 1;
    }
    const int64_t items = num_seqs * splits;
    stat_t *st = (stat_t *)malloc(sizeof(stat_t) * items * max_rows);
    float *acc = (float *)malloc(sizeof(float) * items * max_rows * D);
    float *qf = (float *)malloc(sizeof(float) * items * max_rows * D);
    if (!st || !acc || !qf) {
        free(st);
        free(acc);
        free(qf);
        return 4;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t it = 0; it < items; it++) {
        const int64_t s = it / splits, part = it % splits;
        const int64_t nb = (ctx_lens[s] + bs - 1) / bs;
        const int64_t per = (nb + splits - 1) / splits;
        const int64_t b0 = part * per, b1 = b0 + per < nb ? b0 + per : nb;
        stat_t *ist = st + it * max_rows;
        if (b0 >= b1) {
            for (int64_t i = 0; i < q_len[s] * H; i++) {
                ist[i].m = -INFINITY;
                ist[i].l = 0.f;
            }
            continue;
        }
        run_item(q, kc, vc, dtype, tables + s * table_stride, q_len[s], q_start[s],
                 ctx_lens[s], H, Hkv, D, bs, b0, b1, scale, qf + it * max_rows * D, ist,
                 acc + it * max_rows * D);
    }
    /* Merge each sequence's ranges and write its rows. */
#pragma omp parallel for num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t i = 0; i < q_len[s] * H; i++) {
            float m = -INFINITY, l = 0.f, o[MAX_DIM];
            for (int64_t p = 0; p < splits; p++) {
                const stat_t *x = st + (s * splits + p) * max_rows + i;
                if (x->l > 0.f && x->m > m) m = x->m;
            }
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
            for (int64_t p = 0; p < splits; p++) {
                const int64_t at = (s * splits + p) * max_rows + i;
                if (st[at].l == 0.f) continue;
                const float w = expf(st[at].m - m);
                l += st[at].l * w;
                const float *a = acc + at * D;
                for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
            }
            const float inv = 1.f / l;
            const int64_t row = q_start[s] * H + i; /* rows of a sequence are contiguous */
            if (dtype == 0) {
                float *dst = (float *)out + row * D;
                for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
            } else {
                uint16_t *dst = (uint16_t *)out + row * D;
                for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(o[d] * inv);
            }
        }
    }
    free(st);
    free(acc);
    free(qf);
    return 0;
}
