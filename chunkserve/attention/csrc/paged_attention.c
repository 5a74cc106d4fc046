/* Paged attention for short query runs on the CPU: decodes, drafts being verified, and
 * the short tail of a prompt, read straight from the paged KV cache.
 *
 * The torch backend gathers every sequence's blocks into a padded buffer and runs two
 * batched matmuls over it: K and V cross memory twice (the gather writes them, the matmuls
 * read them back), the padding is read too, and a batched matmul of a few query rows is far
 * from the copy rate.  Here each (sequence, key range) is one work item that reads its keys
 * and values once, in place, block after block (the next one prefetched), with an online
 * softmax (one rescale per block), accumulating in fp32.  The query rows that share a KV head
 * (the G = H / Hkv heads of each of the sequence's rows) take each key and value row from one
 * load; bf16 is widened in registers.  When there are too few sequences to keep every thread
 * busy (a long prompt's first token, a small batch), each sequence's blocks are split into
 * ranges whose partial results are merged at the end (as flash-decoding does).
 *
 * Row j (0-based) of a sequence with r query rows and ctx keys sees keys [0, ctx - r + 1 + j).
 * Layouts: q, out [T, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int64
 * [num_seqs, table_stride]; q_start int64 [num_seqs + 1]; ctx_lens int64 [num_seqs].
 * dtype 0: float32 q/caches/out; 1: bfloat16.  Returns 0, or a code for arguments the
 * kernel does not take (the caller only sends what it takes: a code is a bug there).
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

/* The vector path, for D a multiple of 16 (64 or 128) and blocks of at most 16 tokens: in
 * 16-lane vectors (one AVX-512 register, or two AVX2 ones); the n <= 16 scores of a block
 * land in the lanes of one vector through a tree of shuffles (4 levels) instead of a
 * horizontal sum per key, and the accumulators stay in registers across the block's keys. */
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

/* a where m (all bits set), else b */
static inline v16f select16(v16i m, v16f a, v16f b) {
    v16i ai, bi, r;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    r = (ai & m) | (bi & ~m);
    v16f out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp of 16 lanes at once (scalar expf calls were a tenth of the kernel's time): x = k ln2 + r
 * with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (relative error under 2e-7),
 * 2^k put in the exponent bits. Lanes below -87 (and -inf) give 0. */
static inline v16f exp16(v16f x) {
    const v16f zero = {0};
    const v16i under = x < -87.f;
    x = select16(under, zero - 87.f, x);
    const v16f t = x * 1.44269504088896341f;
    const v16i k = __builtin_convertvector(t + select16(t < 0.f, zero - 0.5f, zero + 0.5f), v16i);
    const v16f kf = __builtin_convertvector(k, v16f);
    const v16f r = x - kf * 0.693145751953125f - kf * 1.428606765330187e-06f;
    v16f p = zero + 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const v16i bits = (k + 127) << 23;
    v16f scale;
    memcpy(&scale, &bits, sizeof scale);
    return select16(under, zero, p * scale);
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

static inline v16f load_bf16(const uint16_t *p) { /* 16 bf16 -> fp32 in registers */
    typedef uint16_t v16h __attribute__((vector_size(32)));
    typedef uint32_t v16u __attribute__((vector_size(64)));
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Up to MR query rows that share a KV head, over one block of keys (D = 16 * NV, block_size
 * <= 16), K and V read as they lie in the pool (fp32, or bf16 widened in registers): each
 * key row is loaded once for all the rows, its dot products reduced 16 keys at a time, one
 * online-softmax rescale per row and block. n[i]: keys of the block row i sees. */
#define MR 4
#define BLOCK_ROWS(NAME, ET, LOAD, NV)                                                         \
    static void NAME(const float **q, int nr, const ET *restrict k, const ET *restrict v,      \
                     int64_t stride, const int64_t *n, stat_t **st, float **acc) {              \
        const v16f lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};              \
        v16f qv[MR][NV], parts[MR][16], p[MR];                                                 \
        float corr[MR];                                                                        \
        int64_t nmax = 0;                                                                      \
        for (int i = 0; i < nr; i++) {                                                         \
            for (int c = 0; c < NV; c++) qv[i][c] = loadu(q[i] + 16 * c);                      \
            if (n[i] > nmax) nmax = n[i];                                                      \
        }                                                                                      \
        for (int64_t t = 0; t < 16; t++) {                                                     \
            if (t < nmax) {                                                                    \
                v16f kr[NV];                                                                   \
                for (int c = 0; c < NV; c++) kr[c] = LOAD(k + t * stride + 16 * c);            \
                for (int i = 0; i < nr; i++) {                                                 \
                    v16f sum = qv[i][0] * kr[0];                                               \
                    for (int c = 1; c < NV; c++) sum += qv[i][c] * kr[c];                      \
                    parts[i][t] = sum;                                                         \
                }                                                                              \
            } else {                                                                           \
                for (int i = 0; i < nr; i++) parts[i][t] = (v16f){0};                          \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < nr; i++) {                                                         \
            v16f sc = reduce16(parts[i]);                                                      \
            sc = select16(lane >= (float)n[i], (v16f){0} - INFINITY, sc);                      \
            const float bmax = hmax16(sc);                                                     \
            const float mx = bmax > st[i]->m ? bmax : st[i]->m;                                \
            corr[i] = expf(st[i]->m - mx);                                                     \
            p[i] = exp16(sc - mx); /* 0 where masked */                                        \
            st[i]->l = st[i]->l * corr[i] + hsum16(p[i]);                                      \
            st[i]->m = mx;                                                                     \
        }                                                                                      \
        v16f av[MR][NV];                                                                       \
        for (int i = 0; i < nr; i++)                                                           \
            for (int c = 0; c < NV; c++) av[i][c] = loadu(acc[i] + 16 * c) * corr[i];         \
        for (int64_t t = 0; t < nmax; t++) {                                                   \
            v16f vr[NV];                                                                       \
            for (int c = 0; c < NV; c++) vr[c] = LOAD(v + t * stride + 16 * c);                \
            for (int i = 0; i < nr; i++)                                                       \
                for (int c = 0; c < NV; c++) av[i][c] += p[i][t] * vr[c];                      \
        }                                                                                      \
        for (int i = 0; i < nr; i++)                                                           \
            for (int c = 0; c < NV; c++) storeu(acc[i] + 16 * c, av[i][c]);                    \
    }
BLOCK_ROWS(rows_f32_v4, float, loadu, 4)
BLOCK_ROWS(rows_f32_v8, float, loadu, 8)
BLOCK_ROWS(rows_bf16_v4, uint16_t, load_bf16, 4)
BLOCK_ROWS(rows_bf16_v8, uint16_t, load_bf16, 8)

static void run_rows(const float **q, int nr, const char *k, const char *v, int dtype,
                     int64_t D, int64_t stride, const int64_t *n, stat_t **st, float **acc) {
    if (dtype == 0 && D == 64)
        rows_f32_v4(q, nr, (const float *)k, (const float *)v, stride, n, st, acc);
    else if (dtype == 0)
        rows_f32_v8(q, nr, (const float *)k, (const float *)v, stride, n, st, acc);
    else if (D == 64)
        rows_bf16_v4(q, nr, (const uint16_t *)k, (const uint16_t *)v, stride, n, st, acc);
    else
        rows_bf16_v8(q, nr, (const uint16_t *)k, (const uint16_t *)v, stride, n, st, acc);
}

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
    const int vector = (D == 64 || D == 128) && bs <= 16; /* else the scalar loops */
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
            if (vector) { /* the KV head's rows (j, g), in groups of up to MR */
                const int group = D == 64 ? MR : 2; /* 16 (or 32) query vectors at most */
                const float *qp[MR];
                int64_t n[MR];
                stat_t *ist[MR];
                float *iacc[MR];
                int nr = 0;
                for (int64_t j = 0; j < r; j++) {
                    int64_t nj = ctx - r + 1 + j - first; /* keys of this block row j sees */
                    if (nj <= 0) continue;
                    if (nj > bs) nj = bs;
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t i = j * H + kvh * G + g;
                        qp[nr] = qf + i * D;
                        n[nr] = nj;
                        ist[nr] = st + i;
                        iacc[nr] = acc + i * D;
                        if (++nr == group) {
                            run_rows(qp, nr, kb, vb, dtype, D, row_stride, n, ist, iacc);
                            nr = 0;
                        }
                    }
                }
                if (nr) run_rows(qp, nr, kb, vb, dtype, D, row_stride, n, ist, iacc);
                continue;
            }
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
