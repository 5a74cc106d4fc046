/* Paged attention on the CPU for query rows that continue a cached sequence: decodes,
 * drafts being verified, and the chunks of a long prompt, read straight from the paged KV
 * cache.
 *
 * The torch backend gathers every sequence's blocks into a padded buffer and runs two
 * batched matmuls over it: K and V cross memory twice (the gather writes them, the matmuls
 * read them back), the padding is read too, and a batched matmul of a few query rows is far
 * from the copy rate.  Here each (sequence, key range) is one work item that reads its keys
 * and values once, in place, block after block (the next one prefetched), with an online
 * softmax (one rescale per block), accumulating in fp32.  The query rows that share a KV head
 * (the G = H / Hkv heads of each of the sequence's rows) take each key and value row from one
 * load; bf16 is widened in registers.  So that every thread stays busy (a long prompt's
 * first token, a small batch, a chunk beside a few decodes), a sequence's blocks are split
 * into ranges by its share of the work, whose partial results are merged at the end (as
 * flash-decoding does).  Runs of
 * many rows (a chunk) take the tile path instead (see tile_block): 16 rows per vector, as a
 * matrix product would.
 *
 * Row j (0-based) of a sequence with r query rows and ctx keys sees keys [0, ctx - r + 1 + j),
 * or with a sliding window W > 0 the last W of them: [max(0, ctx - r + 1 + j - W),
 * ctx - r + 1 + j) (the row's position p = ctx - r + j sees p - W + 1 .. p). Blocks wholly
 * before the first row's window are never read: a sequence's work covers only the blocks
 * its windows reach. softcap c > 0: each scaled score s becomes c * tanh(s / c) before the
 * softmax (0: none). sinks (NULL: none): one logit per query head (GPT-OSS's attention
 * sinks) joins every row's softmax denominator, exp(sinks[h]), with no value: applied once,
 * where a row's key ranges are merged.
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
                                int64_t D, float cap, stat_t *st, float *restrict acc) {
    float s[MAX_BLOCK];
    float mx = st->m;
    for (int64_t t = 0; t < n; t++) {
        const float *restrict kt = k + t * kstride;
        float dot = 0.f;
        for (int64_t d = 0; d < D; d++) dot += q[d] * kt[d];
        if (cap > 0.f) dot = cap * tanhf(dot / cap);
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

/* The vector path, for D = 32, 64, 128 or 256 and blocks of at most 16 tokens: in
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

/* c * tanh(x / c) of 16 lanes (the soft-cap), as 1 - 2 / (exp(2y) + 1) with y = x / c clamped
 * to [-9, 9] (tanh is 1 to fp32's precision past 9): absolute error about 2e-7 * c. */
static inline v16f softcap16(v16f x, float c) {
    const v16f zero = {0};
    v16f y = x * (2.f / c);
    y = select16(y > 18.f, zero + 18.f, y);
    y = select16(y < -18.f, zero - 18.f, y);
    return (1.f - 2.f / (exp16(y) + 1.f)) * c;
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
 * online-softmax rescale per row and block. Row i sees keys lo[i] .. n[i] - 1 of the block
 * (lo[i] < n[i]); cap > 0: scores soft-capped. */
#define MR 4
#define BLOCK_ROWS(NAME, ET, LOAD, NV)                                                         \
    static void NAME(const float **q, int nr, const ET *restrict k, const ET *restrict v,      \
                     int64_t stride, const int64_t *lo, const int64_t *n, float cap,            \
                     stat_t **st, float **acc) {                                                \
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
            if (cap > 0.f) sc = softcap16(sc, cap);                                            \
            sc = select16((lane >= (float)n[i]) | (lane < (float)lo[i]), (v16f){0} - INFINITY, \
                          sc);                                                                 \
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
BLOCK_ROWS(rows_f32_v2, float, loadu, 2)
BLOCK_ROWS(rows_bf16_v2, uint16_t, load_bf16, 2)
BLOCK_ROWS(rows_f32_v4, float, loadu, 4)
BLOCK_ROWS(rows_f32_v8, float, loadu, 8)
BLOCK_ROWS(rows_bf16_v4, uint16_t, load_bf16, 4)
BLOCK_ROWS(rows_bf16_v8, uint16_t, load_bf16, 8)
BLOCK_ROWS(rows_f32_v16, float, loadu, 16)
BLOCK_ROWS(rows_bf16_v16, uint16_t, load_bf16, 16)

static void run_rows(const float **q, int nr, const char *k, const char *v, int dtype,
                     int64_t D, int64_t stride, const int64_t *lo, const int64_t *n, float cap,
                     stat_t **st, float **acc) {
    const float *kf = (const float *)k, *vf = (const float *)v;
    const uint16_t *kh = (const uint16_t *)k, *vh = (const uint16_t *)v;
    if (dtype == 0 && D == 32)
        rows_f32_v2(q, nr, kf, vf, stride, lo, n, cap, st, acc);
    else if (dtype == 0 && D == 64)
        rows_f32_v4(q, nr, kf, vf, stride, lo, n, cap, st, acc);
    else if (dtype == 0 && D == 128)
        rows_f32_v8(q, nr, kf, vf, stride, lo, n, cap, st, acc);
    else if (dtype == 0)
        rows_f32_v16(q, nr, kf, vf, stride, lo, n, cap, st, acc);
    else if (D == 32)
        rows_bf16_v2(q, nr, kh, vh, stride, lo, n, cap, st, acc);
    else if (D == 64)
        rows_bf16_v4(q, nr, kh, vh, stride, lo, n, cap, st, acc);
    else if (D == 128)
        rows_bf16_v8(q, nr, kh, vh, stride, lo, n, cap, st, acc);
    else
        rows_bf16_v16(q, nr, kh, vh, stride, lo, n, cap, st, acc);
}

/* The loops over a sequence's blocks prefetch the block PREFETCH_AHEAD blocks ahead into L2
 * (hint 2): a block's keys and values are ~6-12 KB at random places in
 * the pool, and prefetching the next one into L1 (hint 3) stalled on the fill buffers and
 * evicted the block at work. On the 2-core AMD EPYC, 64 decodes (9/3 heads, D 64, 1 thread)
 * per layer: 1,024 keys bf16 12.5 -> 9.0 ms (rows), 11.7 -> 8.4 (packed narrow tiles),
 * fp32 17.2 -> 14.5 (rows), 22.5 -> 15.3 (tiles); 4,096 keys 1.2-1.35x; 256 keys 1.0-1.4x
 * (distances 1-8 and hints 0-3 tried). Chunks of 16 and 512 rows (compute-bound): the same
 * within noise. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 2
#endif
static inline void prefetch_block(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, PREFETCH_HINT);
}

/* n rows of `bytes` each, `stride` bytes apart (one KV head's rows of a block). */
static inline void prefetch_rows(const char *p, int64_t n, int64_t bytes, int64_t stride) {
    for (int64_t t = 0; t < n; t++, p += stride)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, PREFETCH_HINT);
}

/* The tile path, for runs of many rows (a prefill chunk): the rows that share a KV head
 * are taken 16 at a time, one per lane, so a block's scores for them are 16 vectors (one per
 * key) built by broadcasting each key value against a column of the transposed queries: no
 * horizontal sums, and the softmax (max, exp, sums, rescale) runs lane-wise for 16 rows at
 * once. Products per score and per output value are those of a matrix product (the
 * arithmetic floor); the row loop above spends about as much again on its reductions.
 * fp32: the block's keys and values are widened to fp32 once for all the KV head's tiles.
 * bf16 on a CPU with AVX512-BF16: pairs of bf16 products summed in fp32 by one instruction
 * (vdpbf16ps), twice the products per instruction, keys read in place; the probabilities
 * are rounded to bf16 for the values' product, as torch's bf16 matmuls round them. */
#define TL 16 /* rows per tile: the lanes of one vector */
#define DC 8  /* output columns accumulated per pass over the block's values */
#define TILE_MIN_ROWS 8
#define TILE_GROUP 16 /* tiles per pass over the blocks: 256 KB of queries and sums at D = 128 */

static inline v16f max16v(v16f a, v16f b) { return select16(a > b, a, b); }

/* The online-softmax step of a tile over one block of n keys: s[t] the (scaled) scores of
 * key first + t, soft-capped (cap > 0), masked past the block's end and where the lane's row
 * does not see it (keys [low, lim) of each lane), turned into their exponentials; m and l
 * updated. Returns the factor the accumulators are rescaled by. */
static inline v16f tile_softmax(v16f *s, int64_t n, int64_t first, v16f low, v16f lim,
                                float cap, v16f *m, v16f *l) {
    const v16f zero = {0}, ninf = zero - INFINITY;
    v16f bmax = ninf;
    for (int t = 0; t < TL; t++) {
        const v16f key = zero + (float)(first + t);
        if (cap > 0.f && t < n) s[t] = softcap16(s[t], cap);
        s[t] = t < n ? select16((key < lim) & (key >= low), s[t], ninf) : ninf;
        bmax = max16v(bmax, s[t]);
    }
    const v16f mnew = max16v(*m, bmax);
    const v16f base = select16(mnew == ninf, zero, mnew); /* rows that saw no key yet */
    const v16f corr = exp16(*m - base);                    /* 0 while m is -inf */
    v16f sum = zero;
    for (int t = 0; t < TL; t++) {
        s[t] = exp16(s[t] - base); /* 0 where masked */
        sum += s[t];
    }
    *l = *l * corr + sum;
    *m = mnew;
    return corr;
}

/* fp32: qt [D][16] a tile's queries (scaled), kf and vf [16][D] the block's keys and
 * values (rows past the block's end zero); acct [D][16] the tile's accumulators. */
static void tile_block(const float *restrict qt, const float *restrict kf,
                       const float *restrict vf, int64_t D, int64_t n, int64_t first, v16f low,
                       v16f lim, float cap, v16f *m, v16f *l, float *restrict acct) {
    v16f s[TL];
    for (int t = 0; t < TL; t++) s[t] = (v16f){0};
    for (int64_t d = 0; d < D; d++) {
        const v16f qd = loadu(qt + TL * d);
        for (int t = 0; t < TL; t++) s[t] += qd * kf[t * D + d];
    }
    const v16f corr = tile_softmax(s, n, first, low, lim, cap, m, l);
    for (int64_t d0 = 0; d0 < D; d0 += DC) {
        v16f a[DC];
        for (int c = 0; c < DC; c++) a[c] = loadu(acct + TL * (d0 + c)) * corr;
        for (int t = 0; t < TL; t++)
            for (int c = 0; c < DC; c++) a[c] += s[t] * vf[t * D + d0 + c];
        for (int c = 0; c < DC; c++) storeu(acct + TL * (d0 + c), a[c]);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BF16_TILES 1

static inline __m512 to_m512(v16f x) {
    __m512 y;
    memcpy(&y, &x, sizeof y);
    return y;
}

static inline v16f from_m512(__m512 x) {
    v16f y;
    memcpy(&y, &x, sizeof y);
    return y;
}

/* bf16: qt2 [D/2][16] a tile's queries, lane-wise pairs (q[d], q[d+1]) as 32 bits; k[t] the
 * block's key rows in place (a zero row past the block's end); vp [8][D] the block's values
 * paired over keys (v[2u][d], v[2u+1][d]), zero past its end. */
static void tile_block_bf16(const uint32_t *restrict qt2, const uint16_t *const *k,
                            const uint32_t *restrict vp, int64_t D, float scale, int64_t n,
                            int64_t first, v16f low, v16f lim, float cap, v16f *m, v16f *l,
                            float *restrict acct) {
    __m512 acc_s[TL];
    for (int t = 0; t < TL; t++) acc_s[t] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D / 2; d2++) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(qt2 + TL * d2);
        for (int t = 0; t < TL; t++) {
            int32_t pair;
            memcpy(&pair, k[t] + 2 * d2, sizeof pair);
            acc_s[t] = _mm512_dpbf16_ps(acc_s[t], qd, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    v16f s[TL];
    for (int t = 0; t < TL; t++) s[t] = from_m512(acc_s[t]) * scale;
    const v16f corr = tile_softmax(s, n, first, low, lim, cap, m, l);
    /* p2[u], lane i: (p[2u][i], p[2u+1][i]) as bf16 */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    __m512bh p2[TL / 2];
    for (int u = 0; u < TL / 2; u++) {
        const __m512bh both = _mm512_cvtne2ps_pbh(to_m512(s[2 * u + 1]), to_m512(s[2 * u]));
        p2[u] = (__m512bh)_mm512_permutexvar_epi16(inter, (__m512i)both);
    }
    for (int64_t d0 = 0; d0 < D; d0 += DC) {
        __m512 a[DC];
        for (int c = 0; c < DC; c++) a[c] = to_m512(loadu(acct + TL * (d0 + c)) * corr);
        for (int u = 0; u < TL / 2; u++)
            for (int c = 0; c < DC; c++)
                a[c] = _mm512_dpbf16_ps(
                    a[c], p2[u], (__m512bh)_mm512_set1_epi32((int32_t)vp[u * D + d0 + c]));
        for (int c = 0; c < DC; c++) storeu(acct + TL * (d0 + c), from_m512(a[c]));
    }
}

/* The same for a tile of at most NARROW rows (a decode's G heads, a chunk's last few rows),
 * at a quarter of the work or less: its lanes computed exactly as tile_block_bf16 computes
 * them, the products summed in the same pairs in the same order, only the vectors laid the
 * other way. Scores: one vector of the block's 16 keys per row (kt2 [D/2][16] the block's
 * keys transposed, as pairs; zero past its end), moved into the tile's lanes for the same
 * softmax; values: one vector of 16 output columns per row (accr [16][D]: a row's
 * accumulators together). vdpbf16ps sums each lane's two products in a fixed order whichever
 * operand is broadcast, and bf16 products are exact in fp32. */
#define NARROW 4
/* raw[r] the scores of row r (lane r of qt2) with the block's 16 keys (kt2 [D/2][16]). */
static inline __attribute__((always_inline)) void
narrow_scores(const uint32_t *restrict qt2, const uint32_t *restrict kt2, int64_t D, int lanes,
              float raw[NARROW][TL]) {
    __m512 sc[NARROW];
    for (int r = 0; r < lanes; r++) sc[r] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D / 2; d2++) {
        const __m512bh kd = (__m512bh)_mm512_loadu_si512(kt2 + TL * d2);
        for (int r = 0; r < lanes; r++)
            sc[r] = _mm512_dpbf16_ps(sc[r], kd, (__m512bh)_mm512_set1_epi32((int32_t)qt2[TL * d2 + r]));
    }
    for (int r = 0; r < lanes; r++) _mm512_storeu_ps(raw[r], sc[r]);
}

static inline void narrow_block_scores(const uint32_t *restrict qt2,
                                       const uint32_t *restrict kt2, int64_t D, int lanes,
                                       float raw[NARROW][TL]) {
    switch (lanes) { /* a loop per row count: the sums stay in registers */
    case 1: narrow_scores(qt2, kt2, D, 1, raw); break;
    case 2: narrow_scores(qt2, kt2, D, 2, raw); break;
    case 3: narrow_scores(qt2, kt2, D, 3, raw); break;
    default: narrow_scores(qt2, kt2, D, 4, raw); break;
    }
}

/* tile_block_bf16's softmax step for lanes whose scores s[t] (key first + t) were built
 * elsewhere; p2[u][lane]: (p[2u], p[2u+1]) of the lane rounded to bf16, as that function
 * pairs them. Returns the lanes' rescale factors. */
static inline v16f narrow_softmax(v16f *s, int64_t n, int64_t first, v16f low, v16f lim,
                                  float cap, v16f *m, v16f *l, uint32_t p2[TL / 2][TL]) {
    const v16f corr = tile_softmax(s, n, first, low, lim, cap, m, l);
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    for (int u = 0; u < TL / 2; u++) {
        const __m512bh both = _mm512_cvtne2ps_pbh(to_m512(s[2 * u + 1]), to_m512(s[2 * u]));
        _mm512_storeu_si512(p2[u], _mm512_permutexvar_epi16(inter, (__m512i)both));
    }
    return corr;
}

/* Lane `lane`'s accumulators row [D] rescaled by c and given the block's values (vp [8][D],
 * paired over keys) weighted by its probabilities p2[.][lane]. */
static inline void narrow_values(const uint32_t *restrict vp, int64_t D,
                                 uint32_t p2[TL / 2][TL], int lane, float c,
                                 float *restrict row) {
    const v16f cr = (v16f){0} + c;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 a = to_m512(loadu(row + d0) * cr);
        for (int u = 0; u < TL / 2; u++)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(vp + u * D + d0),
                                 (__m512bh)_mm512_set1_epi32((int32_t)p2[u][lane]));
        storeu(row + d0, from_m512(a));
    }
}

static void tile_block_bf16_narrow(const uint32_t *restrict qt2, const uint32_t *restrict kt2,
                                   const uint32_t *restrict vp, int64_t D, float scale,
                                   int64_t n, int64_t first, v16f low, v16f lim, float cap,
                                   v16f *m, v16f *l, float *restrict accr, int lanes) {
    float raw[NARROW][TL];
    narrow_block_scores(qt2, kt2, D, lanes, raw);
    v16f s[TL];
    for (int t = 0; t < TL; t++) {
        v16f x = {0};
        for (int r = 0; r < lanes; r++) x[r] = raw[r][t];
        s[t] = x * scale;
    }
    uint32_t p2[TL / 2][TL];
    const v16f corr = narrow_softmax(s, n, first, low, lim, cap, m, l, p2);
    for (int r = 0; r < lanes; r++) narrow_values(vp, D, p2, r, corr[r], accr + r * D);
}

static inline void transpose16x16(__m512i *r) { /* 16 rows of 16 dwords, in place */
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int a = 0; a < 16; a += 4) {
        r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int b = 0; b < 4; b++) {
        const __m512i s0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xee);
        const __m512i s2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xee);
        t[b] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        t[4 + b] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        t[8 + b] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        t[12 + b] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
    for (int j = 0; j < 16; j++) r[j] = t[j];
}

/* kt2 [D/2][16]: the n key rows (row stride `stride`) as pairs, transposed; zero past n.
 * 16 pairs (32 dims) of the 16 rows at a time through registers; a last 8 pairs (D an odd
 * multiple of 16) one by one. */
static void transpose_keys(uint32_t *restrict kt2, const uint16_t *k, int64_t n, int64_t D,
                           int64_t stride) {
    const int64_t whole = D / 32 * 16; /* pairs moved 16 at a time */
    for (int64_t c = 0; c < whole; c += 16) {
        __m512i rows[TL];
        for (int64_t t = 0; t < TL; t++)
            rows[t] = t < n ? _mm512_loadu_si512(k + t * stride + 2 * c) : _mm512_setzero_si512();
        transpose16x16(rows);
        for (int64_t j = 0; j < TL; j++) _mm512_storeu_si512(kt2 + TL * (c + j), rows[j]);
    }
    for (int64_t t = 0; t < TL; t++) {
        const uint32_t *row = (const uint32_t *)(k + t * stride);
        for (int64_t d2 = whole; d2 < D / 2; d2++) kt2[TL * d2 + t] = t < n ? row[d2] : 0u;
    }
}

/* vp [8][D]: the n value rows (row stride `stride`) paired over keys, zero past n. */
static void pair_values(uint32_t *restrict vp, const uint16_t *v, int64_t n, int64_t D,
                        int64_t stride) {
    for (int64_t u = 0; u < TL / 2; u++) {
        const uint16_t *a = 2 * u < n ? v + 2 * u * stride : NULL;
        const uint16_t *b = 2 * u + 1 < n ? v + (2 * u + 1) * stride : NULL;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(a + d)))
                                 : _mm512_setzero_si512();
            const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(b + d)))
                                 : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + u * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* Every KV head's rows in one narrow tile (a decode's G <= NARROW heads, a draft's few rows
 * of a small G): the tiles' lanes packed 16 to a vector for the softmax (lane x of the pack:
 * row x % R of KV head x / R), one softmax step a block for all heads instead of one per
 * head. Each lane computed exactly as in its own tile (tile_block_bf16_narrow): the softmax
 * is lane-wise, and a lane whose row does not see the block is left as it was (scores -inf,
 * factor exp16(0) = 1, probabilities 0). m, l, low, lim, acct: the tiles' (lanes 0 .. R-1
 * each), read and written back; kt2 [D/2][16] and vp [8][D] scratch. */
static void run_narrow_heads(const char *kc, const char *vc, const int64_t *table, int64_t ctx,
                             int64_t Hkv, int64_t D, int64_t bs, int64_t blk0, int64_t blk1,
                             float scale, float cap, int64_t R, const uint32_t *qt2, v16f *m,
                             v16f *l, const v16f *low, const v16f *lim, float top, float bottom,
                             float *acct, uint32_t *kt2, uint32_t *vp) {
    const int64_t L = Hkv * R, packs = (L + TL - 1) / TL;
    const int64_t row_stride = Hkv * D, block_stride = bs * Hkv * D;
    v16f pm[packs], pl[packs], plow[packs], plim[packs], corr[packs];
    float raw[Hkv][NARROW][TL];
    uint32_t p2[packs][TL / 2][TL];
    for (int64_t x = 0; x < packs * TL; x++) { /* padding lanes: no key, never read */
        const int64_t g = x / TL, lane = x % TL, kvh = x / R, r = x % R;
        pm[g][lane] = x < L ? m[kvh][r] : -INFINITY;
        pl[g][lane] = x < L ? l[kvh][r] : 0.f;
        plow[g][lane] = x < L ? low[kvh][r] : 0.f;
        plim[g][lane] = x < L ? lim[kvh][r] : 0.f;
    }
    for (int64_t b = blk0; b < blk1; b++) {
        const int64_t first = b * bs;
        if (b + PREFETCH_AHEAD < blk1) {
            const int64_t next = table[b + PREFETCH_AHEAD] * block_stride * 2;
            prefetch_block(kc + next, block_stride * 2);
            prefetch_block(vc + next, block_stride * 2);
        }
        if (top <= (float)first) break; /* no row sees it */
        int64_t n = ctx - first;
        if (n > bs) n = bs;
        if (bottom >= (float)(first + n)) continue; /* before every row's window */
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const uint16_t *k0 = (const uint16_t *)kc + table[b] * block_stride + kvh * D;
            transpose_keys(kt2, k0, n, D, row_stride);
            narrow_block_scores(qt2 + kvh * D * TL, kt2, D, (int)R, raw[kvh]);
        }
        for (int64_t g = 0; g < packs; g++) {
            v16f sv[TL];
            for (int t = 0; t < TL; t++) {
                v16f x = {0};
                for (int lane = 0; lane < TL && g * TL + lane < L; lane++) {
                    const int64_t at = g * TL + lane;
                    x[lane] = raw[at / R][at % R][t];
                }
                sv[t] = x * scale;
            }
            corr[g] = narrow_softmax(sv, n, first, plow[g], plim[g], cap, pm + g, pl + g, p2[g]);
        }
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            pair_values(vp, (const uint16_t *)vc + table[b] * block_stride + kvh * D, n, D,
                        row_stride);
            for (int64_t r = 0; r < R; r++) {
                const int64_t x = kvh * R + r, g = x / TL;
                narrow_values(vp, D, p2[g], (int)(x % TL), corr[g][x % TL],
                              acct + (kvh * TL + r) * D);
            }
        }
    }
    for (int64_t x = 0; x < L; x++) {
        m[x / R][x % R] = pm[x / TL][x % TL];
        l[x / R][x % R] = pl[x / TL][x % TL];
    }
}

/* AMX-BF16 (the deterministic mode's bf16 tiles, where the CPU has AMX and the OS grants it):
 * a tile's 16 rows over a group of AMX_KEYS keys (4 blocks of 16, aligned on multiples of 4
 * blocks: the same groups for every row) as tile products (tdpbf16ps), one online-softmax
 * step per group. Scores transposed, S^T [keys][16 rows] = K Q^T: A = 16 key rows as they lie
 * in the pool (32 dims a step), B = the tile's queries as pairs (qt2, the vdpbf16ps tiles'
 * layout), so each key's scores land in one vector over the rows. Values: O [16 rows][D] =
 * P V into zeroed tiles, A = the probabilities rounded to bf16 (a row's keys: p2 transposed),
 * B = the values paired over keys; then acc = acc * corr + O per row. A tile product computes
 * each output from its own row and column only (the other rows of a tile, real or padding,
 * do not enter it), so a row's arithmetic is the same in a tile of 16 rows or of 1: a decode,
 * a draft, a chunk's row and a whole prompt's row give the same bits. Keys of a group outside
 * the item's blocks, past the sequence or outside a row's window are masked out of its
 * softmax (their probability 0; absent blocks read as zeros). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_BLOCKS 4         /* blocks of 16 keys per group */
#define AMX_KEYS (16 * AMX_BLOCKS)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config_t;

static int amx_state = -1; /* -1 unknown, 0 refused by the OS, 1 usable */

static int amx_usable(void) {
    if (amx_state < 0) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: once per process */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

/* Every tile 16 rows of 64 bytes: C [16][16] fp32, A [16][32] bf16, B [16 pairs][16] pairs. */
static void amx_configure(void) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}


/* One tile over one group: kb[i] the group's block i's 16 key rows (row stride ks[i]
 * elements; a zero block for one outside the item), vp [32 key pairs][D] its values paired;
 * keys [kmin, kmax) of the sequence are the item's (the rest masked); acc [16][D] the tile's
 * accumulators, row-major; pv [16][D] scratch. */
#define QK_STEP(T, K) /* scores of block T into tile T, its keys through tile K */          \
    do {                                                                                       \
        _tile_loadd(K, kb[T] + 32 * c, ks[T] * 2);                                             \
        _tile_dpbf16ps(T, K, 5);                                                               \
    } while (0)
#define PV_STEP(T)                                                                             \
    do {                                                                                       \
        _tile_zero(T);                                                                         \
        _tile_loadd(6, vp + d0 + 16 * T, D * 4);                                                \
        _tile_dpbf16ps(T, 4, 6);                                                               \
        _tile_loadd(7, vp + 16 * D + d0 + 16 * T, D * 4);                                       \
        _tile_dpbf16ps(T, 5, 7);                                                               \
        _tile_stored(T, pv + d0 + 16 * T, D * 4);                                               \
    } while (0)
static void tile_group_amx(const uint32_t *restrict qt2, const uint16_t *const *kb,
                           const int64_t *ks, const uint32_t *restrict vp, int64_t D,
                           float scale, int64_t first, int64_t kmin, int64_t kmax, v16f low,
                           v16f lim, int inside, float cap, v16f *m, v16f *l,
                           float *restrict acc, float *restrict pv) {
    float raw[AMX_KEYS][TL] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < D / 32; c++) {
        _tile_loadd(5, qt2 + TL * 16 * c, 64);
        QK_STEP(0, 6);
        QK_STEP(1, 7);
        QK_STEP(2, 6);
        QK_STEP(3, 7);
    }
    _tile_stored(0, raw[0], 64);
    _tile_stored(1, raw[16], 64);
    _tile_stored(2, raw[32], 64);
    _tile_stored(3, raw[48], 64);
    const v16f zero = {0}, ninf = zero - INFINITY;
    v16f s[AMX_KEYS], bmax = ninf;
    for (int t = 0; t < AMX_KEYS; t++) {
        const int64_t key = first + t;
        if (key < kmin || key >= kmax) {
            s[t] = ninf;
            continue;
        }
        v16f x = loadu(raw[t]) * scale;
        if (cap > 0.f) x = softcap16(x, cap);
        if (!inside) { /* else every row sees every key of the group: the mask keeps all */
            const v16f kv = zero + (float)key;
            x = select16((kv < lim) & (kv >= low), x, ninf);
        }
        s[t] = x;
        bmax = max16v(bmax, s[t]);
    }
    const v16f mnew = max16v(*m, bmax);
    const v16f base = select16(mnew == ninf, zero, mnew); /* rows that saw no key yet */
    const v16f corr = exp16(*m - base);                    /* 0 while m is -inf */
    v16f sum = zero;
    for (int t = 0; t < AMX_KEYS; t++) {
        s[t] = exp16(s[t] - base); /* 0 where masked */
        sum += s[t];
    }
    *l = *l * corr + sum;
    *m = mnew;
    /* p2[u], lane i: (p[2u][i], p[2u+1][i]) as bf16; transposed, row i: its 16 pairs */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    uint32_t pa[2][TL][TL] __attribute__((aligned(64)));
    for (int h = 0; h < 2; h++) {
        __m512i r[TL];
        for (int u = 0; u < TL; u++) {
            const int t = 32 * h + 2 * u;
            const __m512bh both = _mm512_cvtne2ps_pbh(to_m512(s[t + 1]), to_m512(s[t]));
            r[u] = _mm512_permutexvar_epi16(inter, (__m512i)both);
        }
        transpose16x16(r);
        for (int i = 0; i < TL; i++) _mm512_store_si512(pa[h][i], r[i]);
    }
    _tile_loadd(4, pa[0], 64);
    _tile_loadd(5, pa[1], 64);
    for (int64_t d0 = 0; d0 < D; d0 += 32) { /* two column tiles, four value tiles */
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, vp + d0, D * 4);
        _tile_loadd(6, vp + d0 + 16, D * 4);
        _tile_loadd(3, vp + 16 * D + d0, D * 4);
        _tile_loadd(7, vp + 16 * D + d0 + 16, D * 4);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(0, 5, 3);
        _tile_dpbf16ps(1, 5, 7);
        _tile_stored(0, pv + d0, D * 4);
        _tile_stored(1, pv + d0 + 16, D * 4);
    }
    for (int i = 0; i < TL; i++) {
        const __m512 cr = _mm512_set1_ps(corr[i]);
        float *restrict row = acc + i * D;
        const float *restrict add = pv + i * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(row + d, _mm512_fmadd_ps(_mm512_loadu_ps(row + d), cr,
                                                      _mm512_loadu_ps(add + d)));
    }
}
#endif
#endif

/* A work item on the tile path (block_size <= 16, D a multiple of 16): qf (fp32, scaled),
 * st, acc as run_item sets them up, read into tiles and written back for the merge; q the
 * raw query rows of the sequence (the bf16 path's). Returns 4 if its scratch cannot be
 * allocated. */
static int run_item_tiled(const void *q, const void *kc, const void *vc, int dtype,
                          const int64_t *table, int64_t r, int64_t ctx, int64_t H,
                          int64_t Hkv, int64_t D, int64_t bs, int64_t blk0, int64_t blk1,
                          float scale, int64_t window, float cap, int amx,
                          const float *restrict qf, stat_t *st, float *restrict acc) {
    const int64_t G = H / Hkv, R = r * G, nt = (R + TL - 1) / TL, tiles = Hkv * nt;
    const int64_t group = D > 128 ? TILE_GROUP * 128 / D : TILE_GROUP; /* at most 256 KB */
    const int64_t esize = dtype ? 2 : 4, row_stride = Hkv * D, block_stride = bs * Hkv * D;
    const int64_t block_bytes = block_stride * esize;
#ifdef BF16_TILES
    const int pairs = dtype == 1;
#else
    const int pairs = 0;
    (void)q;
    (void)scale;
#endif
#ifndef AMX_TILES
    amx = 0;
#endif
    /* queries [tiles][D][16] (fp32, or bf16 pairs in the first half), accumulators
     * [tiles][D][16], the block's fp32 keys and values [16][D] (or its paired values) */
    float *qt = (float *)calloc((size_t)(2 * tiles * D * TL + 3 * TL * D), sizeof(float));
    /* m, l, lim, low of each tile (vectors: 64-byte aligned) */
    v16f *state = (v16f *)aligned_alloc(sizeof(v16f), sizeof(v16f) * 4 * tiles);
    if (!qt || !state) {
        free(qt);
        free(state);
        return 4;
    }
    float *acct = qt + tiles * D * TL, *kf = acct + tiles * D * TL, *vf = kf + TL * D;
    v16f *m = state, *l = state + tiles, *lim = state + 2 * tiles, *low = state + 3 * tiles;
    uint32_t *kt2 = (uint32_t *)(vf + TL * D); /* the narrow tiles' transposed keys */
    int narrow[tiles]; /* rows of a tile of at most NARROW rows (its accumulators [16][D]) */
    const int rowmajor = amx && pairs; /* AMX: every tile's accumulators [16][D] */
    float top[tiles];    /* the most keys a row of the tile sees */
    float bottom[tiles]; /* the first key a row of the tile sees */
    float hilow[tiles];  /* the last row's first key (rows in order: the most) */
    for (int64_t kvh = 0; kvh < Hkv; kvh++)
        for (int64_t x = 0; x < nt * TL; x++) { /* lane x % TL of tile x / TL: row (j, g) */
            const int64_t tile = kvh * nt + x / TL, lane = x % TL, j = x / G;
            if (lane == 0) {
                const int64_t used = R - (x % (nt * TL));
                narrow[tile] = pairs && !rowmajor && used <= NARROW ? (int)used : 0;
                m[tile] = (v16f){0} - INFINITY;
                l[tile] = (v16f){0};
                lim[tile] = (v16f){0};
                low[tile] = (v16f){0};
                top[tile] = 0.f;
            }
            if (x >= R) continue; /* padding lanes see no key */
            const int64_t i = j * H + kvh * G + x % G;
            if (rowmajor) {
                /* its queries below, 16 lanes at a time */
            } else if (pairs) {
                const uint32_t *row = (const uint32_t *)q + i * D / 2;
                uint32_t *q2 = (uint32_t *)qt + tile * D * TL;
                for (int64_t d2 = 0; d2 < D / 2; d2++) q2[d2 * TL + lane] = row[d2];
            } else {
                for (int64_t d = 0; d < D; d++) qt[(tile * D + d) * TL + lane] = qf[i * D + d];
            }
            lim[tile][lane] = (float)(ctx - r + 1 + j);
            low[tile][lane] = window > 0 && lim[tile][lane] > window ? lim[tile][lane] - window : 0;
            top[tile] = lim[tile][lane];
            if (lane == 0) bottom[tile] = low[tile][lane]; /* rows in order: the least */
            hilow[tile] = low[tile][lane];
        }
#ifdef AMX_TILES
    if (rowmajor) /* the tiles' queries as pairs, [D / 2][16]: 16 rows' 16 pairs transposed */
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t kvh = tile / nt, x0 = (tile % nt) * TL;
            uint32_t *q2 = (uint32_t *)qt + tile * D * TL;
            for (int64_t c = 0; c < D / 32; c++) {
                __m512i rows[TL];
                for (int64_t lane = 0; lane < TL; lane++) {
                    const int64_t x = x0 + lane, i = x / G * H + kvh * G + x % G;
                    rows[lane] = x < R ? _mm512_loadu_si512((const uint32_t *)q + i * D / 2 + 16 * c)
                                       : _mm512_setzero_si512();
                }
                transpose16x16(rows);
                for (int64_t d2 = 0; d2 < TL; d2++)
                    _mm512_storeu_si512(q2 + (16 * c + d2) * TL, rows[d2]);
            }
        }
    if (rowmajor) { /* AMX: groups of AMX_BLOCKS blocks (aligned), see tile_group_amx */
        static const uint16_t zeros[TL * MAX_DIM];
        uint32_t *vp4 = (uint32_t *)kf; /* [32 key pairs][D] (kf and vf) */
        float *pv = vf + TL * D;        /* [16][D] */
        const int64_t kmin = blk0 * bs, kmax = blk1 * bs < ctx ? blk1 * bs : ctx;
        amx_configure();
        for (int64_t kvh = 0; kvh < Hkv; kvh++)
            for (int64_t t0 = kvh * nt; t0 < (kvh + 1) * nt; t0 += group) {
                const int64_t t1 = t0 + group < (kvh + 1) * nt ? t0 + group : (kvh + 1) * nt;
                for (int64_t g = blk0 / AMX_BLOCKS * AMX_BLOCKS; g < blk1; g += AMX_BLOCKS) {
                    const int64_t first = g * bs, end = first + AMX_KEYS;
                    if (top[t1 - 1] <= (float)first) break; /* no row of the group sees it */
                    const int64_t lo = first > kmin ? first : kmin, hi = end < kmax ? end : kmax;
                    if (bottom[t0] >= (float)hi) continue; /* before every row's window */
                    const uint16_t *kb[AMX_BLOCKS];
                    int64_t ks[AMX_BLOCKS];
                    for (int i = 0; i < AMX_BLOCKS; i++) {
                        const int64_t b = g + i;
                        uint32_t *vpi = vp4 + (int64_t)i * (TL / 2) * D;
                        if (b < blk0 || b >= blk1) { /* another item's, or past the sequence */
                            kb[i] = zeros;
                            ks[i] = D;
                            memset(vpi, 0, sizeof(uint32_t) * (TL / 2) * D);
                            continue;
                        }
                        const int64_t at = (table[b] * block_stride + kvh * D) * esize;
                        int64_t n = ctx - b * bs;
                        if (n > bs) n = bs;
                        /* a last block's rows past n: its own slots, masked (never past it) */
                        kb[i] = (const uint16_t *)((const char *)kc + at);
                        ks[i] = row_stride;
                        pair_values(vpi, (const uint16_t *)((const char *)vc + at), n, D,
                                    row_stride);
                    }
                    for (int64_t tile = t0; tile < t1; tile++) {
                        if (!(top[tile] > (float)lo && bottom[tile] < (float)hi)) continue;
                        /* the group's keys all the item's, and seen by every row (padding
                         * lanes included: their results are never read) */
                        const int inside = lo == first && hi == end && lim[tile][0] >= (float)end &&
                                           hilow[tile] <= (float)first;
                        tile_group_amx((const uint32_t *)qt + tile * D * TL, kb, ks, vp4, D,
                                       scale, first, kmin, kmax, low[tile], lim[tile], inside,
                                       cap, m + tile, l + tile, acct + tile * D * TL, pv);
                    }
                }
            }
        _tile_release();
    }
#endif
#ifdef BF16_TILES
    if (pairs && !rowmajor && nt == 1 && narrow[0]) { /* every KV head's rows one narrow tile */
        float most = 0.f, least = bottom[0];
        for (int64_t tile = 0; tile < tiles; tile++) {
            most = top[tile] > most ? top[tile] : most;
            least = bottom[tile] < least ? bottom[tile] : least;
        }
        run_narrow_heads((const char *)kc, (const char *)vc, table, ctx, Hkv, D, bs, blk0, blk1,
                         scale, cap, R, (const uint32_t *)qt, m, l, low, lim, most, least, acct,
                         kt2, (uint32_t *)kf);
        goto done;
    }
#endif
    /* A KV head's tiles in groups whose queries and accumulators stay in the core's cache
     * (a long chunk's all would not), each group over the item's blocks. */
    for (int64_t kvh = 0; kvh < Hkv && !rowmajor; kvh++)
        for (int64_t t0 = kvh * nt; t0 < (kvh + 1) * nt; t0 += group) {
            const int64_t t1 = t0 + group < (kvh + 1) * nt ? t0 + group : (kvh + 1) * nt;
            for (int64_t b = blk0; b < blk1; b++) {
                const int64_t first = b * bs;
                if (b + PREFETCH_AHEAD < blk1) { /* this KV head's rows of a next block */
                    const int64_t next =
                        (table[b + PREFETCH_AHEAD] * block_stride + kvh * D) * esize;
                    prefetch_rows((const char *)kc + next, bs, D * esize, row_stride * esize);
                    prefetch_rows((const char *)vc + next, bs, D * esize, row_stride * esize);
                }
                if (top[t1 - 1] <= (float)first) break; /* no row of the group sees it */
                int64_t n = ctx - first;
                if (n > bs) n = bs;
                if (bottom[t0] >= (float)(first + n)) continue; /* before every row's window */
                const int64_t at = (table[b] * block_stride + kvh * D) * esize;
#ifdef BF16_TILES
                if (pairs) {
                    static const uint16_t zeros[MAX_DIM];
                    const uint16_t *krows[TL];
                    const uint16_t *k0 = (const uint16_t *)((const char *)kc + at);
                    for (int64_t t = 0; t < TL; t++) krows[t] = t < n ? k0 + t * row_stride : zeros;
                    uint32_t *vp = (uint32_t *)kf;
                    pair_values(vp, (const uint16_t *)((const char *)vc + at), n, D, row_stride);
                    int transposed = 0;
                    for (int64_t tile = t0; tile < t1; tile++) {
                        if (!(top[tile] > (float)first && bottom[tile] < (float)(first + n)))
                            continue;
                        if (narrow[tile]) {
                            if (!transposed) transpose_keys(kt2, k0, n, D, row_stride);
                            transposed = 1;
                            tile_block_bf16_narrow((const uint32_t *)qt + tile * D * TL, kt2, vp,
                                                   D, scale, n, first, low[tile], lim[tile], cap,
                                                   m + tile, l + tile, acct + tile * D * TL,
                                                   narrow[tile]);
                        } else {
                            tile_block_bf16((const uint32_t *)qt + tile * D * TL, krows, vp, D,
                                            scale, n, first, low[tile], lim[tile], cap, m + tile,
                                            l + tile, acct + tile * D * TL);
                        }
                    }
                    continue;
                }
#endif
                rows_to_f32(kf, (const char *)kc + at, dtype, n, D, row_stride);
                rows_to_f32(vf, (const char *)vc + at, dtype, n, D, row_stride);
                memset(kf + n * D, 0, sizeof(float) * (TL - n) * D);
                memset(vf + n * D, 0, sizeof(float) * (TL - n) * D);
                for (int64_t tile = t0; tile < t1; tile++)
                    if (top[tile] > (float)first && bottom[tile] < (float)(first + n))
                        tile_block(qt + tile * D * TL, kf, vf, D, n, first, low[tile], lim[tile],
                                   cap, m + tile, l + tile, acct + tile * D * TL);
            }
        }
#ifdef BF16_TILES
done:
#endif
    for (int64_t kvh = 0; kvh < Hkv; kvh++)
        for (int64_t x = 0; x < R; x++) {
            const int64_t tile = kvh * nt + x / TL, lane = x % TL;
            const int64_t i = (x / G) * H + kvh * G + x % G;
            st[i].m = m[tile][lane];
            st[i].l = l[tile][lane];
            if (narrow[tile] || rowmajor)
                for (int64_t d = 0; d < D; d++) acc[i * D + d] = acct[(tile * TL + lane) * D + d];
            else
                for (int64_t d = 0; d < D; d++) acc[i * D + d] = acct[(tile * D + d) * TL + lane];
        }
    free(qt);
    free(state);
    return 0;
}

/* One work item: a sequence's r query rows (all H heads) over blocks [blk0, blk1). Its
 * scratch: qf [r * H, D] (scaled queries), st [r * H], acc [r * H, D]. The block's keys and
 * values for all KV heads lie together (bs * Hkv * D), read in order, the next block
 * prefetched while this one is worked on. */
static int run_item(const void *q, const void *kc, const void *vc, int dtype,
                     const int64_t *table, int64_t r, int64_t q0, int64_t ctx, int64_t H,
                     int64_t Hkv, int64_t D, int64_t bs, int64_t blk0, int64_t blk1,
                     float scale, int64_t window, float cap, int tiles_always, int amx,
                     float *restrict qf, stat_t *st, float *restrict acc) {
    const int64_t G = H / Hkv, rows = r * H, esize = dtype ? 2 : 4;
    /* The tile path takes any D that is a multiple of 16, the row path D = 32, 64, 128 or
     * 256; else the scalar loops (about 5x slower than the tiles: a chunk at D = 32 ran
     * there until Nov 2026, 4-10x slower than torch's SDPA). The deterministic mode
     * (tiles_always) keeps the paths it was measured with, so its bits do not change: the
     * tiles at D = 64, 128 and 256, the scalar loops at any other D. */
    const int legacy = (D == 64 || D == 128 || D == 256) && bs <= 16;
    const int tiles = tiles_always ? legacy : D % 16 == 0 && bs <= 16 && r * G >= TILE_MIN_ROWS;
    const int vector = !tiles_always && (legacy || (D == 32 && bs <= 16));
    float kbuf[MAX_BLOCK * MAX_DIM], vbuf[MAX_BLOCK * MAX_DIM];
    for (int64_t i = 0; i < rows; i++) {
        st[i].m = -INFINITY;
        st[i].l = 0.f;
    }
    if (tiles) {
        /* Only the rows that see a key of the blocks (row j sees keys before
         * ctx - r + 1 + j): a later range of a long chunk is seen by its last rows only; the
         * others keep l = 0 (nothing to merge). A lane's arithmetic is its row's alone. */
        int64_t j0 = blk0 * bs - ctx + r;
        if (j0 < 0) j0 = 0;
        if (j0 >= r) return 0;
        const int64_t skip = j0 * H;
#ifdef BF16_TILES
        if (dtype == 0) /* bf16 tiles read the raw queries, fp32 ones the scaled */
#endif
        {
            rows_to_f32(qf + skip * D, (const char *)q + (q0 + j0) * H * D * esize, dtype,
                        rows - skip, D, D);
            for (int64_t i = skip * D; i < rows * D; i++) qf[i] *= scale;
        }
        return run_item_tiled((const char *)q + (q0 + j0) * H * D * esize, kc, vc, dtype,
                              table, r - j0, ctx, H, Hkv, D, bs, blk0, blk1, scale, window, cap,
                              amx, qf + skip * D, st + skip, acc + skip * D);
    }
    /* row i = j * H + h: query row j, head h (KV head h / G) */
    rows_to_f32(qf, (const char *)q + q0 * H * D * esize, dtype, rows, D, D);
    for (int64_t i = 0; i < rows * D; i++) qf[i] *= scale;
    memset(acc, 0, sizeof(float) * rows * D);
    const int64_t row_stride = Hkv * D, block_stride = bs * Hkv * D;
    const int64_t block_bytes = block_stride * esize;
    for (int64_t b = blk0; b < blk1; b++) {
        const int64_t first = b * bs;
        if (b + PREFETCH_AHEAD < blk1) {
            prefetch_block((const char *)kc + table[b + PREFETCH_AHEAD] * block_bytes, block_bytes);
            prefetch_block((const char *)vc + table[b + PREFETCH_AHEAD] * block_bytes, block_bytes);
        }
        int64_t n_block = ctx - first; /* the last row sees the most keys */
        if (n_block > bs) n_block = bs;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const char *kb = (const char *)kc + (table[b] * block_stride + kvh * D) * esize;
            const char *vb = (const char *)vc + (table[b] * block_stride + kvh * D) * esize;
            if (vector) { /* the KV head's rows (j, g), in groups of up to MR */
                /* 16, 16 or 32 query vectors: at D = 256 two rows still beat one (and the
                 * scalar loops): each key row loaded (and widened from bf16) once for both */
                const int group = D <= 64 ? MR : 2;
                const float *qp[MR];
                int64_t lo[MR], n[MR];
                stat_t *ist[MR];
                float *iacc[MR];
                int nr = 0;
                for (int64_t j = 0; j < r; j++) {
                    const int64_t hi = ctx - r + 1 + j; /* row j sees keys [lo_j, hi) */
                    int64_t nj = hi - first;            /* keys of this block row j sees */
                    if (nj <= 0) continue;
                    if (nj > bs) nj = bs;
                    int64_t lj = window > 0 ? hi - window - first : 0; /* its first */
                    if (lj >= nj) continue;
                    if (lj < 0) lj = 0;
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t i = j * H + kvh * G + g;
                        qp[nr] = qf + i * D;
                        lo[nr] = lj;
                        n[nr] = nj;
                        ist[nr] = st + i;
                        iacc[nr] = acc + i * D;
                        if (++nr == group) {
                            run_rows(qp, nr, kb, vb, dtype, D, row_stride, lo, n, cap, ist, iacc);
                            nr = 0;
                        }
                    }
                }
                if (nr) run_rows(qp, nr, kb, vb, dtype, D, row_stride, lo, n, cap, ist, iacc);
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
                const int64_t hi = ctx - r + 1 + j; /* row j sees keys [lo_j, hi) */
                int64_t n = hi - first;             /* keys of this block row j sees */
                if (n <= 0) continue;
                if (n > bs) n = bs;
                int64_t o = window > 0 ? hi - window - first : 0; /* its first */
                if (o >= n) continue;
                if (o < 0) o = 0;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t i = j * H + kvh * G + g;
                    block_update(qf + i * D, k + o * kstride, v + o * kstride, kstride, n - o, D,
                                 cap, st + i, acc + i * D);
                }
            }
        }
    }
    return 0;
}

static int amx_allowed = 1; /* paged_attention_allow_amx */

/* allow 0: the deterministic mode's bf16 tiles never run on AMX in this process (the
 * AVX512-BF16 tiles, the bits of a machine without AMX); 1: where they can (the default). */
void paged_attention_allow_amx(int allow) { amx_allowed = allow != 0; }

/* 1 if the deterministic mode's bf16 tiles run on AMX here for this head size and block size
 * (allowed, the build has AMX-BF16, the OS grants the tile state, D a multiple of 64, blocks
 * of 16 tokens), else 0: they run on AVX512-BF16 (other bits: a machine runs one or the
 * other). */
int paged_attention_amx(int64_t D, int64_t bs) {
#ifdef AMX_TILES
    return amx_allowed && D % 64 == 0 && D <= MAX_DIM && bs == TL && amx_usable();
#else
    (void)D;
    (void)bs;
    return 0;
#endif
}

int paged_attention(const void *q, const void *kc, const void *vc, void *out, int dtype,
                    const int64_t *tables, int64_t table_stride, const int64_t *q_start,
                    const int64_t *q_len, const int64_t *ctx_lens, int64_t num_seqs,
                    int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                    int64_t window, float softcap, const float *sinks, int64_t num_threads,
                    int64_t fixed_range) {
    if (bs > MAX_BLOCK || D > MAX_DIM || Hkv <= 0 || H % Hkv || (dtype != 0 && dtype != 1) ||
        window < 0 || !(softcap >= 0.f))
        return 1;
    if (num_seqs == 0) return 0;
    /* The deterministic mode's bf16 tiles on AMX where it is there (every row of every call:
     * the mode pins one path per machine, see paged_attention_amx). */
    const int amx = fixed_range > 0 && dtype == 1 && paged_attention_amx(D, bs);
    /* fixed_range F > 0 (deterministic mode): every query row is computed the same way
     * whatever the batch, the chunk it is in, the cached prefix or the thread count: the
     * tile path for every run of rows (a lane's arithmetic depends only on its own row; a
     * block wholly outside a lane's keys leaves it exactly as it was: scores -inf, factor
     * exp16(0) = 1), and a sequence's blocks split into ranges aligned on multiples of F
     * (absolute block indices), merged in order; a range where a row sees no key adds
     * nothing to its merge. bf16 there runs AMX tiles (tile_group_amx) where the CPU has
     * them, for every row, else the AVX512-BF16 tiles: two paths with different bits, one per
     * machine (paged_attention_amx says which). Else: */
    /* Work items: a sequence's blocks (from the first its windows reach) split into ranges
     * (of 8 blocks at least) by its share of the work (rows x blocks), about 4 items per
     * thread in all, so a long prompt's chunk beside a few decodes, or a lone long decode,
     * keeps every thread busy. Item it's scratch starts at row base[it] (rows: query rows x
     * heads). */
    int64_t *split = (int64_t *)malloc(sizeof(int64_t) * (4 * num_seqs + 2));
    if (!split) return 4;
    int64_t *first = split + num_seqs;  /* [num_seqs + 1]: each sequence's first item */
    int64_t *rows0 = first + num_seqs + 1; /* [num_seqs + 1]: its first row of all rows */
    int64_t *blk_lo = rows0 + num_seqs + 1; /* [num_seqs]: the first block it reads */
    int64_t work = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (q_len[s] < 1 || q_len[s] > ctx_lens[s]) {
            free(split);
            return 2;
        }
        const int64_t lo = window > 0 ? ctx_lens[s] - q_len[s] + 1 - window : 0; /* row 0's */
        blk_lo[s] = lo > 0 ? lo / bs : 0;
        work += q_len[s] * ((ctx_lens[s] + bs - 1) / bs - blk_lo[s]);
    }
    const int64_t share = (work + 4 * num_threads - 1) / (4 * num_threads);
    first[0] = rows0[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t nb = (ctx_lens[s] + bs - 1) / bs - blk_lo[s], most = (nb + 7) / 8;
        const int64_t n = (q_len[s] * nb + share - 1) / share;
        split[s] = n < 1 ? 1 : (n > most ? most : n);
        if (fixed_range > 0) /* the aligned ranges its blocks touch */
            split[s] = (blk_lo[s] + nb - 1) / fixed_range - blk_lo[s] / fixed_range + 1;
        first[s + 1] = first[s] + split[s];
        rows0[s + 1] = rows0[s] + q_len[s] * H;
    }
    const int64_t items = first[num_seqs], total = rows0[num_seqs];
    /* item it's scratch: rows [base[it], base[it] + q_len * H) of st, acc, qf */
    int64_t *item_seq = (int64_t *)malloc(sizeof(int64_t) * (2 * items + 1));
    if (!item_seq) {
        free(split);
        return 4;
    }
    int64_t *base = item_seq + items;
    base[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t it = first[s]; it < first[s + 1]; it++) {
            item_seq[it] = s;
            base[it + 1] = base[it] + q_len[s] * H;
        }
    stat_t *st = (stat_t *)malloc(sizeof(stat_t) * base[items]);
    float *acc = (float *)malloc(sizeof(float) * base[items] * D);
    float *qf = (float *)malloc(sizeof(float) * base[items] * D);
    int failed = !st || !acc || !qf;
    if (!failed) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t it = 0; it < items; it++) {
            const int64_t s = item_seq[it], part = it - first[s], splits = split[s];
            const int64_t nb = (ctx_lens[s] + bs - 1) / bs, from = blk_lo[s];
            const int64_t per = (nb - from + splits - 1) / splits;
            int64_t b0 = from + part * per, b1 = b0 + per < nb ? b0 + per : nb;
            if (fixed_range > 0) { /* aligned range from / F + part, cut to [from, nb) */
                const int64_t a = (from / fixed_range + part) * fixed_range;
                b0 = a > from ? a : from;
                b1 = a + fixed_range < nb ? a + fixed_range : nb;
            }
            stat_t *ist = st + base[it];
            if (b0 >= b1) {
                for (int64_t i = 0; i < q_len[s] * H; i++) {
                    ist[i].m = -INFINITY;
                    ist[i].l = 0.f;
                }
                continue;
            }
            if (run_item(q, kc, vc, dtype, tables + s * table_stride, q_len[s], q_start[s],
                         ctx_lens[s], H, Hkv, D, bs, b0, b1, scale, window, softcap,
                         fixed_range > 0, amx,
                         qf + base[it] * D, ist, acc + base[it] * D)) {
#pragma omp atomic write
                failed = 1;
            }
        }
    }
    if (!failed) {
        /* Merge each sequence's ranges and write its rows, 64 rows per task (a long chunk's
         * rows spread over the threads too). */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t g = 0; g < (total + 63) / 64; g++) {
            int64_t s = 0;
            for (int64_t row = 64 * g; row < 64 * g + 64 && row < total; row++) {
                while (rows0[s + 1] <= row) s++;
                const int64_t i = row - rows0[s], rows = q_len[s] * H;
                const int64_t at0 = base[first[s]] + i; /* the row in the first range */
                float m = -INFINITY, l = 0.f, o[MAX_DIM];
                for (int64_t p = 0; p < split[s]; p++) {
                    const stat_t *x = st + at0 + p * rows;
                    if (x->l > 0.f && x->m > m) m = x->m;
                }
                for (int64_t d = 0; d < D; d++) o[d] = 0.f;
                for (int64_t p = 0; p < split[s]; p++) {
                    const int64_t at = at0 + p * rows;
                    if (st[at].l == 0.f) continue;
                    const float w = expf(st[at].m - m);
                    l += st[at].l * w;
                    const float *a = acc + at * D;
                    for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
                }
                float inv = 1.f / l;
                if (sinks) { /* the sink's share: l += exp(sink - m), taken at max(m, sink) */
                    const float sk = sinks[i % H], top = m > sk ? m : sk;
                    const float c = expf(m - top); /* 0 when no key was seen (m = -inf) */
                    inv = c / (l * c + expf(sk - top));
                }
                const int64_t dst_row = q_start[s] * H + i; /* a sequence's rows: contiguous */
                if (dtype == 0) {
                    float *dst = (float *)out + dst_row * D;
                    for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
                } else {
                    uint16_t *dst = (uint16_t *)out + dst_row * D;
                    for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(o[d] * inv);
                }
            }
        }
    }
    free(st);
    free(acc);
    free(qf);
    free(item_seq);
    free(split);
    return failed ? 4 : 0;
}

/* 1 if this build has the bf16 tile path (AVX512-BF16), else 0. */
int paged_attention_bf16_tiles(void) {
#ifdef BF16_TILES
    return 1;
#else
    return 0;
#endif
}
