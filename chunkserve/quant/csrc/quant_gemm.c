/* Products with GGML block-quantized weights (chunkserve/quant/kernels.py builds this file).
 *
 * quant_gemm: out[M, N] = x[M, K] . W[N, K]^T for every M, x quantized to int8 per row and per
 * 32 values, integer dot products per weight group (vpdpbusd), one float32 chain per output
 * element in a fixed order: batch-invariant (see "int8-activation GEMM" below for the exact
 * arithmetic, which every path follows).
 *
 * With 16 or more x rows and AMX-INT8 here, the integer dots of 16 output rows x 16 x rows x
 * one group are one tile product (tdpbusd), the float chains the same operations.
 *
 * quant_gemm_f32 (the float opt-in for decode rows): W's values dequantized exactly in
 * registers, float32 products and sums (see "float decode rows").
 *
 * quant_dequant: rows of W dequantized to float32 or bfloat16 with gguf-py's exact float32
 * arithmetic (this file is built with -ffp-contract=off and no fast-math), for a float matmul
 * in torch.
 *
 * Paths: AVX512-VNNI + AVX512BW (+VL) intrinsics where the compiler targets them (built with
 * -march=native), else AVX2 + FMA + F16C intrinsics (256-bit AVX-VNNI vpdpbusd where there is
 * AVX-VNNI, vpmaddubsw otherwise: see "AVX2 decoding"), else portable C. The portable path is
 * also exported (the *_portable entry points); tests run both, and builds with -mno-avx512f
 * (with and without -mno-avxvnni), and compare their bits.
 *
 * Block layouts: see chunkserve/quant/formats.py. All pointers are to little-endian data.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#define QG_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1
#include <immintrin.h>
#endif

/* fn##_FMT(...) for the weight format ``fmt`` (each SIMD section defines its per-format
 * functions with PER_FORMAT*). */
#define DISPATCH(fmt, fn, ...)                                                                 \
    switch (fmt) {                                                                             \
    case Q4_0: fn##_Q4_0(__VA_ARGS__); break;                                                  \
    case Q4_1: fn##_Q4_1(__VA_ARGS__); break;                                                  \
    case Q5_0: fn##_Q5_0(__VA_ARGS__); break;                                                  \
    case Q5_1: fn##_Q5_1(__VA_ARGS__); break;                                                  \
    case Q8_0: fn##_Q8_0(__VA_ARGS__); break;                                                  \
    case Q4_K: fn##_Q4_K(__VA_ARGS__); break;                                                  \
    case Q5_K: fn##_Q5_K(__VA_ARGS__); break;                                                  \
    default: fn##_Q6_K(__VA_ARGS__);                                                           \
    }

/* The same for the packable formats (see "packed weights"). */
#define DISPATCH_PACKED(fmt, fn, ...)                                                          \
    switch (fmt) {                                                                             \
    case Q4_0: fn##_Q4_0(__VA_ARGS__); break;                                                  \
    case Q4_1: fn##_Q4_1(__VA_ARGS__); break;                                                  \
    case Q5_0: fn##_Q5_0(__VA_ARGS__); break;                                                  \
    case Q5_1: fn##_Q5_1(__VA_ARGS__); break;                                                  \
    default: fn##_Q8_0(__VA_ARGS__);                                                           \
    }

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { F32 = 0, BF16 = 1 };


static int block_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static int block_values(int fmt) { return fmt >= Q4_K ? 256 : 32; }

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline float f16(const uint8_t *p) {
    uint16_t h = rd16(p);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Q4_K / Q5_K: scale and min j (0..7) from the 12 packed bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---------------------------------------------------------------- int8-activation GEMM */
/* quant_gemm: out[M, N] = x[M, K] . W[N, K]^T with x quantized to int8, for every M (one
 * decode row or a prefill chunk of hundreds), with one arithmetic per output element whatever
 * M, the thread count or the SIMD path (AVX512-VNNI, AVX2, portable C), so a row's result does
 * not depend on the rows beside it in its step (chunked == unchunked == TP):
 *
 * - each x row is quantized alone, per 32 values ("chunk"): dx = max|x| / 127, codes
 *   qx = round-to-nearest-even(x * (127 / max|x|)) (all zero for a zero chunk);
 * - the weight is seen per "group" of GV values (32; 16 for Q6_K, whose scales are per 16) as
 *   w = sc * (q - OFF) + t: q an unsigned code, OFF a constant of the format (8 Q4_0, 16 Q5_0,
 *   128 Q8_0, 32 Q6_K, else 0), sc and t floats per group (t only for the formats with a min:
 *   Q4_1, Q5_1, Q4_K, Q5_K), sc and t computed as in gguf-py (see group_scales);
 * - per group g the integer dot idot = sum (q - OFF) * qx is exact (int32);
 * - per output element, in group order 0, 1, ..., K / GV - 1, one float32 chain:
 *       acc = fma((float)idot, sc * dx, acc);   then, with a min,  acc = fma(t, dx * sum qx, acc)
 *   (sc * dx and dx * sum qx rounded to float32 first), acc starting at 0; the result is acc
 *   (rounded to bf16, nearest even, for bf16 x).
 *
 * Threads split the output rows (in groups of NR), never K. The kernels take NR = 16 output
 * rows at a time: their codes are decoded once into a scratch tile laid out for vpdpbusd
 * ([K / 4][NR][4] bytes: four consecutive codes of each of the 16 rows per 64 bytes) with
 * their sc and t ([K / GV][NR] floats), then every x row (in register tiles of up to MR rows)
 * runs its chains against the tile, so the weight is decoded once per call whatever M. Its
 * error is that of the int8 activations (as llama.cpp's q8 paths): ~0.5% of the output. */
#define NR 16
#define MR 6 /* x rows per register tile (6 x (1 int + 1 float) accumulators + 8 codes) */

static inline int fmt_off(const int fmt) {
    return fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : fmt == Q8_0 ? 128 : fmt == Q6_K ? 32 : 0;
}

static inline int fmt_has_t(const int fmt) {
    return fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K;
}

static inline int group_values(const int fmt) { return fmt == Q6_K ? 16 : 32; }

#if defined(__F16C__)
#include <immintrin.h>
static inline float half(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
#else
static inline float half(const uint8_t *p) { return f16(p); }
#endif

/* sc and t of the groups of 32-value chunk c of a weight row (1 group, 2 for Q6_K). */
static inline void group_scales(const int fmt, const uint8_t *row, int64_t c, float *sc,
                                float *t) {
    if (fmt < Q4_K) {
        const uint8_t *b = row + c * block_bytes(fmt);
        sc[0] = half(b);
        t[0] = fmt == Q4_1 || fmt == Q5_1 ? half(b + 2) : 0.0f;
    } else if (fmt == Q6_K) {
        const uint8_t *b = row + (c / 8) * 210;
        int cc = (int)(c % 8);
        float d = half(b + 208);
        sc[0] = d * (float)(int8_t)b[192 + 2 * cc];
        sc[1] = d * (float)(int8_t)b[192 + 2 * cc + 1];
        t[0] = t[1] = 0.0f;
    } else { /* Q4_K, Q5_K */
        const uint8_t *b = row + (c / 8) * block_bytes(fmt);
        int isc, imn;
        k_scale_min(b + 4, (int)(c % 8), &isc, &imn);
        sc[0] = half(b) * (float)isc;
        t[0] = -(half(b + 2) * (float)imn);
    }
}

/* The 32 codes of chunk c of a weight row, in value order. */
static void chunk_codes(const int fmt, const uint8_t *row, int64_t c, uint8_t *q) {
    if (fmt < Q4_K) {
        const uint8_t *b = row + c * block_bytes(fmt);
        if (fmt == Q8_0) {
            for (int i = 0; i < 32; i++) q[i] = b[2 + i] ^ 0x80;
            return;
        }
        const uint8_t *nib = b + (fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : fmt == Q5_0 ? 6 : 8);
        for (int i = 0; i < 16; i++) {
            q[i] = nib[i] & 0x0f;
            q[i + 16] = nib[i] >> 4;
        }
        if (fmt == Q5_0 || fmt == Q5_1) {
            uint32_t hb = rd32(b + (fmt == Q5_0 ? 2 : 4));
            for (int i = 0; i < 32; i++) q[i] |= ((hb >> i) & 1) << 4;
        }
    } else if (fmt == Q4_K || fmt == Q5_K) {
        const uint8_t *b = row + (c / 8) * block_bytes(fmt);
        int sub = (int)(c % 8);
        const uint8_t *nib = b + (fmt == Q4_K ? 16 : 48) + 32 * (sub / 2);
        for (int i = 0; i < 32; i++) q[i] = (nib[i] >> (4 * (sub % 2))) & 0x0f;
        if (fmt == Q5_K)
            for (int i = 0; i < 32; i++) q[i] |= ((b[16 + i] >> sub) & 1) << 4;
    } else { /* Q6_K */
        const uint8_t *b = row + (c / 8) * 210;
        int cc = (int)(c % 8), half_ = cc / 4, k = cc % 4;
        const uint8_t *ql = b + 64 * half_ + 32 * (k % 2), *hi = b + 128 + 32 * half_;
        for (int i = 0; i < 32; i++)
            q[i] = ((ql[i] >> (4 * (k / 2))) & 0x0f) | (((hi[i] >> (2 * k)) & 3) << 4);
    }
}

/* Quantized activations: q [M, K] int8; per row and group d (dx), s (dx * sum of the group's
 * codes), o (-OFF * sum of the group's codes), each [M, K / GV]. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *o;
    int64_t K, ng;
} QX;

static void quantize_row(const int fmt, const void *x, int dtype, int64_t m, const QX *qx) {
    const int64_t K = qx->K, gv = group_values(fmt), per = 32 / gv;
    int8_t *q = qx->q + m * K;
    float v[32];
    for (int64_t c = 0; c < K / 32; c++) {
        if (dtype == F32) {
            memcpy(v, (const float *)x + m * K + 32 * c, sizeof v);
        } else {
            const uint16_t *xb = (const uint16_t *)x + m * K + 32 * c;
            for (int i = 0; i < 32; i++) v[i] = from_bf16(xb[i]);
        }
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) { /* a NaN is skipped, as by fmaxf (no libm call) */
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; i++) q[32 * c + i] = (int8_t)nearbyintf(v[i] * inv);
        for (int64_t h = 0; h < per; h++) {
            int32_t sum = 0;
            for (int64_t i = gv * h; i < gv * (h + 1); i++) sum += q[32 * c + i];
            int64_t at = m * qx->ng + per * c + h;
            qx->d[at] = dx;
            qx->s[at] = dx * (float)sum;
            qx->o[at] = -fmt_off(fmt) * sum;
        }
    }
}

/* ---------------------------------------------------------------- packed weights */
/* A packed weight (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 with N a multiple of NR): the same bytes as the file's
 * rows, reordered at load so that a batch-1 product reads its vpdpbusd operands straight from
 * memory, with no decoding and no 16 x 16 transpose per pair of chunks (what one x row spent
 * most of its time on). Per group of NR output rows and per 32-value chunk c, NR blocks'
 * bytes (the chunk's ``cb = NR * block_bytes``), in this order:
 *   sc  f16 [NR]          the rows' d;
 *   t   f16 [NR]          Q4_1 / Q5_1: the rows' m;
 *   high bits 64 bytes    Q5_0 / Q5_1: byte 4 r + b, bit j = the fifth bit of code (4 j + b);
 *   codes                 Q4_x / Q5_x: 4 x 64 bytes, vector v byte 4 r + b = code (4 v + b) of
 *                         row r in its low nibble, code (4 v + 16 + b) in its high nibble (the
 *                         tile's [K / 4][NR][4] layout, two 4-value steps per byte; the low four
 *                         bits of Q5's codes);
 *                         Q8_0: 8 x 64 bytes, vector j byte 4 r + b = code (4 j + b) of row r
 *                         as an unsigned code (q + 128, the tile's).
 * Groups one after another, chunks in order within a group: a group is contiguous. Products
 * with more x rows build the file layout's tiles from it (the VNNI tile: the vectors as they
 * are; AMX's row-major codes: one 16 x 16 transpose per pair of chunks); the portable C and
 * AVX2 paths unpack a few groups at a time back to the file's rows (``quant_unpack``'s bytes).
 * Every path computes each output element with the same arithmetic as on the file's layout
 * (the same bits). Packing is offered (``quant_packable``) only by AVX512-VNNI builds. */
static int packable(const int fmt) { return fmt < Q4_K; }

/* Byte offsets in a packed chunk: the high bits (Q5_x) and the codes. */
static inline int packed_hb_at(const int fmt) { return fmt == Q5_1 ? 4 * NR : 2 * NR; }
static inline int packed_codes_at(const int fmt) {
    return fmt == Q4_1 ? 4 * NR : fmt == Q5_0 ? 2 * NR + 64 : fmt == Q5_1 ? 4 * NR + 64 : 2 * NR;
}

static void pack_rows(const int fmt, const uint8_t *w, int64_t row_bytes, int64_t rg, int64_t K,
                      uint8_t *out) {
    const int bb = block_bytes(fmt), at = packed_codes_at(fmt);
    const int64_t chunks = K / 32, cb = (int64_t)NR * bb;
    uint8_t q[32];
    for (int64_t c = 0; c < chunks; c++) {
        uint8_t *dst = out + (rg * chunks + c) * cb;
        for (int r = 0; r < NR; r++) {
            const uint8_t *row = w + (rg * NR + r) * row_bytes, *b = row + c * bb;
            memcpy(dst + 2 * r, b, 2);
            if (fmt == Q4_1 || fmt == Q5_1) memcpy(dst + 2 * NR + 2 * r, b + 2, 2);
            chunk_codes(fmt, row, c, q);
            for (int v = 0; v < (fmt == Q8_0 ? 8 : 4); v++)
                for (int i = 0; i < 4; i++)
                    dst[at + 64 * v + 4 * r + i] =
                        fmt == Q8_0 ? q[4 * v + i]
                                    : (uint8_t)((q[4 * v + i] & 15) | (q[4 * v + 16 + i] & 15) << 4);
            if (fmt == Q5_0 || fmt == Q5_1)
                for (int i = 0; i < 4; i++) {
                    uint8_t hb = 0;
                    for (int j = 0; j < 8; j++) hb |= (uint8_t)(((q[4 * j + i] >> 4) & 1) << j);
                    dst[packed_hb_at(fmt) + 4 * r + i] = hb;
                }
        }
    }
}

/* Rows idx[0..n-1] of a packed weight as the file stores them (row_bytes each) into out. */
static void unpack_rows(const int fmt, const uint8_t *pk, int64_t row_bytes, int64_t K,
                        const int64_t *idx, int64_t first, int64_t n, uint8_t *out) {
    const int bb = block_bytes(fmt), at = packed_codes_at(fmt);
    const int64_t chunks = K / 32, cb = (int64_t)NR * bb;
    for (int64_t i = 0; i < n; i++) {
        const int64_t o = idx ? idx[i] : first + i, rg = o / NR, r = o % NR;
        for (int64_t c = 0; c < chunks; c++) {
            const uint8_t *src = pk + (rg * chunks + c) * cb;
            uint8_t *b = out + i * row_bytes + c * bb;
            memcpy(b, src + 2 * r, 2);
            if (fmt == Q8_0) {
                for (int j = 0; j < 8; j++)
                    for (int k = 0; k < 4; k++)
                        b[2 + 4 * j + k] = src[at + 64 * j + 4 * r + k] ^ 0x80;
                continue;
            }
            if (fmt == Q4_1 || fmt == Q5_1) memcpy(b + 2, src + 2 * NR + 2 * r, 2);
            if (fmt == Q5_0 || fmt == Q5_1) {
                uint32_t qh = 0;
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 8; j++)
                        qh |= (uint32_t)((src[packed_hb_at(fmt) + 4 * r + i] >> j) & 1) << (4 * j + i);
                memcpy(b + (fmt == Q5_0 ? 2 : 4), &qh, 4);
            }
            uint8_t *nib = b + (fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : fmt == Q5_0 ? 6 : 8);
            for (int v = 0; v < 4; v++) /* byte 4 v + k: codes 4 v + k (low), 4 v + 16 + k */
                for (int k = 0; k < 4; k++) nib[4 * v + k] = src[at + 64 * v + 4 * r + k];
        }
    }
}

/* Packed groups per thread unpacked at a time for the file layout's paths (8 x 16 rows:
 * 123 KB at the embedded model's widest rows, in L2). */
#define UNPACK_GROUPS 8

/* Groups b0..b1-1 of a packed weight unpacked into dst; returns the base pointer the file
 * layout's code takes for them (row o at base + o * row_bytes, for o in the groups' rows). */
static const uint8_t *unpack_groups(const int fmt, const uint8_t *pk, int64_t row_bytes,
                                    int64_t K, int64_t b0, int64_t b1, uint8_t *dst) {
    unpack_rows(fmt, pk, row_bytes, K, NULL, b0 * NR, (b1 - b0) * NR, dst);
    return (const uint8_t *)((uintptr_t)dst - (uintptr_t)(b0 * NR * row_bytes));
}

/* The scratch tile of NR weight rows: q [K / 4][NR][4] codes (rows past the weight's end are
 * zeros), sc and t [K / GV][NR]. */
typedef struct {
    uint8_t *q;
    float *sc, *t;
} Tile;

static void tile_scales(const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0,
                        int64_t rows, int64_t K, const Tile *tl) {
    const int64_t per = 32 / group_values(fmt);
    for (int64_t r = 0; r < NR; r++) {
        for (int64_t c = 0; c < K / 32; c++) {
            float sc[2] = {0.0f, 0.0f}, t[2] = {0.0f, 0.0f};
            if (r < rows) group_scales(fmt, w + (o0 + r) * row_bytes, c, sc, t);
            for (int64_t h = 0; h < per; h++) {
                tl->sc[(per * c + h) * NR + r] = sc[h];
                tl->t[(per * c + h) * NR + r] = t[h];
            }
        }
    }
}

static void tile_portable(const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0,
                          int64_t rows, int64_t K, const Tile *tl) {
    uint8_t q[32];
    for (int64_t r = 0; r < NR; r++) {
        for (int64_t c = 0; c < K / 32; c++) {
            if (r < rows)
                chunk_codes(fmt, w + (o0 + r) * row_bytes, c, q);
            else
                memset(q, 0, sizeof q);
            for (int j = 0; j < 8; j++) memcpy(tl->q + ((8 * c + j) * NR + r) * 4, q + 4 * j, 4);
        }
    }
    tile_scales(fmt, w, row_bytes, o0, rows, K, tl);
}

static void store(void *out, int dtype, int64_t i, float v) {
    if (dtype == F32)
        ((float *)out)[i] = v;
    else
        ((uint16_t *)out)[i] = to_bf16(v);
}

/* x rows m0..m0+mt-1 against a tile (output rows o0..o0+rows-1), in portable C. */
static void dots_portable(const int fmt, const Tile *tl, const QX *qx, int64_t m0, int64_t mt,
                          void *out, int out_dtype, int64_t N, int64_t o0, int64_t rows) {
    const int64_t gv = group_values(fmt), K = qx->K;
    const int off = fmt_off(fmt) != 0, has_t = fmt_has_t(fmt);
    for (int64_t i = 0; i < mt; i++) {
        const int64_t m = m0 + i;
        const int8_t *xq = qx->q + m * K;
        float acc[NR] = {0};
        for (int64_t g = 0; g < qx->ng; g++) {
            const int64_t at = m * qx->ng + g;
            const float dx = qx->d[at], xs = qx->s[at];
            for (int r = 0; r < NR; r++) {
                int32_t idot = off ? qx->o[at] : 0;
                for (int64_t v = 0; v < gv; v++)
                    idot += (int32_t)tl->q[((g * gv + v) / 4 * NR + r) * 4 + v % 4] *
                            xq[g * gv + v];
                acc[r] = fmaf((float)idot, tl->sc[g * NR + r] * dx, acc[r]);
                if (has_t) acc[r] = fmaf(tl->t[g * NR + r], xs, acc[r]);
            }
        }
        for (int64_t r = 0; r < rows; r++) store(out, out_dtype, m * N + o0 + r, acc[r]);
    }
}

/* ---------------------------------------------------------------- AVX512-VNNI decoding */
#ifdef QG_AVX512
/* Tiles read ahead of the one decoded (``gemm_avx512``): a decode row's weight comes from
 * memory (the model does not fit the caches), and with the next tile's lines requested
 * before they are decoded the embedded model's 120 layer products took ~15-20% less time
 * (1 thread; 2 and 4 tiles ahead no better). 0: none. */
#ifndef QG_PF
#define QG_PF 1
#endif
static const uint8_t ZERO_BLOCK[256] = {0}; /* stands in for the missing chunk of an odd row */

/* Two 32-value chunks of a weight row ("a pair"): 64 codes q in value order, and per 4
 * values ("a lane") sc and t, w = (q - OFF) * sc + t (see fmt_off, fmt_has_t): dequantizing,
 * gguf-py's float32 arithmetic exactly; the int8 GEMM takes the codes only. */
typedef struct {
    __m512i q;
    __m512 sc, t;
} Pair;

static inline float h2f(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

static inline __m512 lanes2(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

static inline __m512i cat(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* 16 bytes of nibbles -> 32 codes in value order (low nibbles, then high). */
static inline __m256i nib16(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

static inline __attribute__((always_inline)) Pair decode_avx512(const int fmt, const uint8_t *row,
                                                                int64_t p, int64_t chunks) {
    Pair r;
    r.t = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), bit5 = _mm512_set1_epi8(0x10);
    if (fmt < Q4_K) {
        const int bb = fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : fmt == Q5_0 ? 22 : fmt == Q5_1 ? 24 : 34;
        const uint8_t *a = row + 2 * p * bb, *b = 2 * p + 1 < chunks ? a + bb : ZERO_BLOCK;
        r.sc = lanes2(h2f(a), h2f(b));
        if (fmt == Q4_0) {
            r.q = cat(nib16(a + 2), nib16(b + 2));
        } else if (fmt == Q4_1) {
            r.q = cat(nib16(a + 4), nib16(b + 4));
            r.t = lanes2(h2f(a + 2), h2f(b + 2));
        } else if (fmt == Q5_0) {
            uint64_t hb = rd32(a + 2) | (uint64_t)rd32(b + 2) << 32;
            r.q = _mm512_or_si512(cat(nib16(a + 6), nib16(b + 6)), _mm512_maskz_mov_epi8(hb, bit5));
        } else if (fmt == Q5_1) {
            uint64_t hb = rd32(a + 4) | (uint64_t)rd32(b + 4) << 32;
            r.q = _mm512_or_si512(cat(nib16(a + 8), nib16(b + 8)), _mm512_maskz_mov_epi8(hb, bit5));
            r.t = lanes2(h2f(a + 2), h2f(b + 2));
        } else { /* Q8_0: int8 + 128 as unsigned codes */
            r.q = _mm512_xor_si512(cat(_mm256_loadu_si256((const __m256i *)(a + 2)),
                                       _mm256_loadu_si256((const __m256i *)(b + 2))),
                                   _mm512_set1_epi8((char)0x80));
        }
        return r;
    }
    int64_t c = 2 * p;
    int sub = (int)(c % 8);
    if (fmt == Q6_K) {
        const uint8_t *b = row + (c / 8) * 210;
        int half = sub / 4, k = sub % 4; /* k is 0 or 2 */
        __m512i lo = _mm512_loadu_si512((const void *)(b + 64 * half));
        if (k) lo = _mm512_srli_epi16(lo, 4);
        __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        __m256i m3 = _mm256_set1_epi8(3);
        __m256i ha = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), m3);
        __m256i hc = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k + 2), m3);
        r.q = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_slli_epi16(cat(ha, hc), 4));
        int32_t s4;
        memcpy(&s4, b + 192 + 2 * sub, 4);
        __m128 f = _mm_mul_ps(_mm_set1_ps(h2f(b + 208)),
                              _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(s4))));
        const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        r.sc = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
        return r;
    }
    /* Q4_K, Q5_K: sub-blocks sub and sub + 1 share 32 bytes of nibbles (low, high). */
    const uint8_t *b = row + (c / 8) * (fmt == Q4_K ? 144 : 176);
    int sa, ma, sb, mb;
    k_scale_min(b + 4, sub, &sa, &ma);
    k_scale_min(b + 4, sub + 1, &sb, &mb);
    float d = h2f(b), dmin = h2f(b + 2);
    r.sc = lanes2(d * (float)sa, d * (float)sb);
    r.t = lanes2(-(dmin * (float)ma), -(dmin * (float)mb));
    __m256i v = _mm256_loadu_si256((const __m256i *)(b + (fmt == Q4_K ? 16 : 48) + 16 * sub));
    __m256i m4h = _mm256_set1_epi8(0x0f);
    r.q = cat(_mm256_and_si256(v, m4h), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4h));
    if (fmt == Q5_K) {
        __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 16));
        uint64_t bits = _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(1 << sub))) |
                        (uint64_t)_mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(2 << sub)))
                            << 32;
        r.q = _mm512_or_si512(r.q, _mm512_maskz_mov_epi8(bits, bit5));
    }
    return r;
}

/* quantize_row with AVX512: the same operations on 16 values at a time (max and the integer
 * sums are exact in any order; v * inv and the rounding to nearest even are per value). */
static void quantize_row_avx512(const int fmt, const void *x, int dtype, int64_t m,
                                const QX *qx) {
    const int64_t K = qx->K, per = 32 / group_values(fmt);
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    int8_t *q = qx->q + m * K;
    for (int64_t c = 0; c < K / 32; c++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            if (dtype == F32) {
                v[h] = _mm512_loadu_ps((const float *)x + m * K + 32 * c + 16 * h);
            } else {
                __m256i b = _mm256_loadu_si256(
                    (const __m256i *)((const uint16_t *)x + m * K + 32 * c + 16 * h));
                v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            }
        }
        float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(v[0], absmask), _mm512_and_ps(v[1], absmask)));
        float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qi[2];
        for (int h = 0; h < 2; h++) {
            qi[h] = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(q + 32 * c + 16 * h), _mm512_cvtepi32_epi8(qi[h]));
        }
        int32_t sums[2];
        if (per == 1) {
            sums[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(qi[0], qi[1]));
        } else {
            sums[0] = _mm512_reduce_add_epi32(qi[0]);
            sums[1] = _mm512_reduce_add_epi32(qi[1]);
        }
        for (int64_t h = 0; h < per; h++) {
            int64_t at = m * qx->ng + per * c + h;
            qx->d[at] = dx;
            qx->s[at] = dx * (float)sums[h];
            qx->o[at] = -fmt_off(fmt) * sums[h];
        }
    }
}

/* tile_scales with AVX512: the NR rows' scale bytes gathered per block, the same float
 * operations as group_scales on 16 rows at a time. */
static inline __m512 half16(__m512i v) { /* the low 16 bits of each dword, an f16 */
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
}

static inline __m512i byte_of(__m512i v, int k) {
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xff));
}

static inline __attribute__((always_inline)) void tile_scales_avx512(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t rows, int64_t K,
    const Tile *tl) {
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)row_bytes));
    const __m512i zero = _mm512_setzero_si512();
    const uint8_t *base = w + o0 * row_bytes;
#define GATHER(off) _mm512_mask_i32gather_epi32(zero, keep, idx, (const void *)(base + (off)), 1)
    if (fmt < Q4_K) {
        const int bb = block_bytes(fmt);
        for (int64_t c = 0; c < K / 32; c++) {
            __m512i g = GATHER(c * bb);
            _mm512_store_ps(tl->sc + c * NR, half16(g));
            if (fmt_has_t(fmt)) _mm512_store_ps(tl->t + c * NR, half16(_mm512_srli_epi32(g, 16)));
        }
    } else if (fmt == Q6_K) {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            __m512 d = half16(_mm512_srli_epi32(GATHER(sb * 210 + 206), 16));
            for (int k = 0; k < 4; k++) {
                __m512i s4 = GATHER(sb * 210 + 192 + 4 * k);
                for (int b = 0; b < 4; b++) {
                    __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(s4, 24 - 8 * b), 24);
                    _mm512_store_ps(tl->sc + (sb * 16 + 4 * k + b) * NR,
                                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
                }
            }
        }
    } else { /* Q4_K, Q5_K */
        const int bb = block_bytes(fmt);
        const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15);
        const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
        for (int64_t sb = 0; sb < K / 256; sb++) {
            __m512i dd = GATHER(sb * bb), s0 = GATHER(sb * bb + 4), s1 = GATHER(sb * bb + 8),
                    s2 = GATHER(sb * bb + 12);
            __m512 d = half16(dd), dmin = half16(_mm512_srli_epi32(dd, 16));
            for (int j = 0; j < 8; j++) {
                __m512i isc, imn;
                if (j < 4) {
                    isc = _mm512_and_si512(byte_of(s0, j), m63);
                    imn = _mm512_and_si512(byte_of(s1, j), m63);
                } else {
                    __m512i hi = byte_of(s2, j - 4);
                    isc = _mm512_or_si512(
                        _mm512_and_si512(hi, m15),
                        _mm512_slli_epi32(_mm512_srli_epi32(byte_of(s0, j - 4), 6), 4));
                    imn = _mm512_or_si512(
                        _mm512_srli_epi32(hi, 4),
                        _mm512_slli_epi32(_mm512_srli_epi32(byte_of(s1, j - 4), 6), 4));
                }
                _mm512_store_ps(tl->sc + (sb * 8 + j) * NR,
                                _mm512_mul_ps(d, _mm512_cvtepi32_ps(isc)));
                _mm512_store_ps(tl->t + (sb * 8 + j) * NR,
                                _mm512_xor_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(imn)), sign));
            }
        }
    }
#undef GATHER
}

/* 16 vectors of 16 dwords transposed in place: r[j] lane i = the input's r[i] lane j. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int a = 0; a < 16; a += 4) { /* r[a + b] 128-bit lane L: rows a..a+3, dword 4L + b */
        r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int b = 0; b < 4; b++) {
        __m512i s0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x44);
        __m512i s1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xee);
        __m512i s2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x44);
        __m512i s3 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xee);
        t[b] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        t[4 + b] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        t[8 + b] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        t[12 + b] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
    for (int j = 0; j < 16; j++) r[j] = t[j];
}

/* A tile's codes: the NR rows' pairs decoded as dequant_avx512 does (a pair's 16 dwords:
 * four codes each), transposed to the tile's [K / 4][NR][4] layout (a last odd chunk's zero
 * half lands past K / 4, in the tile's slack; rows past the weight's end are zeros). */
static inline __attribute__((always_inline)) void tile_avx512(const int fmt, const uint8_t *w,
                                                              int64_t row_bytes, int64_t o0,
                                                              int64_t rows, int64_t K,
                                                              const Tile *tl) {
    const int64_t chunks = K / 32, pairs = (chunks + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512i r[16];
        for (int64_t i = 0; i < NR; i++)
            r[i] = i < rows ? decode_avx512(fmt, w + (o0 + i) * row_bytes, p, chunks).q
                            : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; j++)
            _mm512_store_si512((void *)(tl->q + (16 * p + j) * 64), r[j]);
    }
    tile_scales_avx512(fmt, w, row_bytes, o0, rows, K, tl);
}

/* MT x rows from m0 against a tile: acc[i] lane r = the chain of x row m0 + i and output row
 * o0 + r (see quant_gemm). Two integer accumulators per row (exact, added at the end) halve
 * the vpdpbusd dependency chain. */
static inline __attribute__((always_inline)) void dots_avx512(const int fmt, const Tile *tl,
                                                              const QX *qx, int64_t m0,
                                                              const int MT, __m512 *acc) {
    const int gv = group_values(fmt), nq = gv / 4;
    const int64_t K = qx->K, ng = qx->ng;
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i W[8];
#pragma GCC unroll 8
        for (int j = 0; j < nq; j++)
            W[j] = _mm512_load_si512((const void *)(tl->q + (g * nq + j) * 64));
        const __m512 scv = _mm512_load_ps(tl->sc + g * NR);
        const __m512 tv = fmt_has_t(fmt) ? _mm512_load_ps(tl->t + g * NR) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            const int64_t at = (m0 + i) * ng + g;
            const int8_t *xq = qx->q + (m0 + i) * K + g * gv;
            __m512i a0 = fmt_off(fmt) ? _mm512_set1_epi32(qx->o[at]) : _mm512_setzero_si512();
            __m512i a1 = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int j = 0; j < nq; j += 2) {
                a0 = _mm512_dpbusd_epi32(a0, W[j], _mm512_set1_epi32((int)rd32((const uint8_t *)xq + 4 * j)));
                a1 = _mm512_dpbusd_epi32(a1, W[j + 1],
                                         _mm512_set1_epi32((int)rd32((const uint8_t *)xq + 4 * j + 4)));
            }
            __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
            acc[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(scv, _mm512_set1_ps(qx->d[at])), acc[i]);
            if (fmt_has_t(fmt))
                acc[i] = _mm512_fmadd_ps(tv, _mm512_set1_ps(qx->s[at]), acc[i]);
        }
    }
}

/* One x row (a batch-1 decode step): each pair's decoded and transposed codes go straight
 * into vpdpbusd (no tile stored and read back), with the same exact integer dots and the
 * same float32 chain per output, group after group, as dots_avx512: the same bits. */
static inline __attribute__((always_inline)) void gemv_avx512(const int fmt, const uint8_t *w,
                                                              int64_t row_bytes, int64_t o0,
                                                              int64_t rows, const QX *qx,
                                                              const Tile *tl, __m512 *out) {
    const int gv = group_values(fmt), nq = gv / 4, per = 64 / gv;
    const int64_t K = qx->K, ng = qx->ng, chunks = K / 32, pairs = (chunks + 1) / 2;
    tile_scales_avx512(fmt, w, row_bytes, o0, rows, K, tl);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i r[16];
        for (int64_t i = 0; i < NR; i++)
            r[i] = i < rows ? decode_avx512(fmt, w + (o0 + i) * row_bytes, p, chunks).q
                            : _mm512_setzero_si512();
        transpose16(r);
#pragma GCC unroll 4
        for (int gi = 0; gi < per; gi++) {
            const int64_t g = p * per + gi;
            if (g >= ng) break; /* the zero half of an odd last chunk */
            const int8_t *xq = qx->q + g * gv;
            __m512i a0 = fmt_off(fmt) ? _mm512_set1_epi32(qx->o[g]) : _mm512_setzero_si512();
            __m512i a1 = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int j = 0; j < nq; j += 2) {
                a0 = _mm512_dpbusd_epi32(a0, r[gi * nq + j],
                                         _mm512_set1_epi32((int)rd32((const uint8_t *)xq + 4 * j)));
                a1 = _mm512_dpbusd_epi32(
                    a1, r[gi * nq + j + 1],
                    _mm512_set1_epi32((int)rd32((const uint8_t *)xq + 4 * j + 4)));
            }
            const __m512 scv = _mm512_load_ps(tl->sc + g * NR);
            __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
            acc = _mm512_fmadd_ps(f, _mm512_mul_ps(scv, _mm512_set1_ps(qx->d[g])), acc);
            if (fmt_has_t(fmt))
                acc = _mm512_fmadd_ps(_mm512_load_ps(tl->t + g * NR), _mm512_set1_ps(qx->s[g]),
                                      acc);
        }
    }
    *out = acc;
}

/* One x row against a packed group (see "packed weights"): gemv_avx512's integer dots and
 * float chain, group after group, with the codes loaded as they lie (Q4: a mask and a shift
 * per two vectors) and the scales as 16 halves: the same bits, no decode, no transpose. */
/* A packed chunk's codes (at p) as the tile's 8 vectors: W[j] byte 4 r + b = code 4 j + b of
 * row r. */
static inline __attribute__((always_inline)) void packed_codes_avx512(const int fmt,
                                                                      const uint8_t *p,
                                                                      __m512i *W) {
    const int at = packed_codes_at(fmt);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    if (fmt == Q8_0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) W[j] = _mm512_loadu_si512((const void *)(p + at + 64 * j));
        return;
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        __m512i b = _mm512_loadu_si512((const void *)(p + at + 64 * v));
        W[v] = _mm512_and_si512(b, m4);
        W[v + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
    }
    if (fmt == Q5_0 || fmt == Q5_1) {
        const __m512i hb = _mm512_loadu_si512((const void *)(p + packed_hb_at(fmt)));
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            W[j] = _mm512_or_si512(
                W[j], _mm512_maskz_mov_epi8(
                          _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << j))),
                          _mm512_set1_epi8(0x10)));
    }
}

/* A packed group's scales into a tile's sc and t ([chunk][NR] floats). */
static inline __attribute__((always_inline)) void packed_scales_avx512(const int fmt,
                                                                       const uint8_t *pk,
                                                                       int64_t chunks,
                                                                       const Tile *tl) {
    const int64_t cb = (int64_t)NR * block_bytes(fmt);
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t *p = pk + c * cb;
        _mm512_store_ps(tl->sc + c * NR, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
        if (fmt_has_t(fmt))
            _mm512_store_ps(tl->t + c * NR,
                            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * NR))));
    }
}

/* tile_avx512 from a packed group (pk: its first byte): the same tile. */
static inline __attribute__((always_inline)) void tile_packed_avx512(const int fmt,
                                                                     const uint8_t *pk, int64_t K,
                                                                     const Tile *tl) {
    const int64_t chunks = K / 32, cb = (int64_t)NR * block_bytes(fmt);
    for (int64_t c = 0; c < chunks; c++) {
        __m512i W[8];
        packed_codes_avx512(fmt, pk + c * cb, W);
        for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(tl->q + (8 * c + j) * 64), W[j]);
    }
    packed_scales_avx512(fmt, pk, chunks, tl);
}

static inline __attribute__((always_inline)) void gemv_packed_avx512(const int fmt,
                                                                     const uint8_t *pk,
                                                                     const QX *qx, __m512 *out) {
    const int64_t chunks = qx->K / 32, cb = (int64_t)NR * block_bytes(fmt);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t *p = pk + c * cb;
        __m512i W[8];
        packed_codes_avx512(fmt, p, W);
        const int8_t *xq = qx->q + c * 32;
        __m512i a0 = fmt_off(fmt) ? _mm512_set1_epi32(qx->o[c]) : _mm512_setzero_si512();
        __m512i a1 = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j += 2) {
            a0 = _mm512_dpbusd_epi32(a0, W[j], _mm512_set1_epi32((int)rd32((const uint8_t *)xq + 4 * j)));
            a1 = _mm512_dpbusd_epi32(a1, W[j + 1],
                                     _mm512_set1_epi32((int)rd32((const uint8_t *)xq + 4 * j + 4)));
        }
        const __m512 scv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
        acc = _mm512_fmadd_ps(f, _mm512_mul_ps(scv, _mm512_set1_ps(qx->d[c])), acc);
        if (fmt_has_t(fmt))
            acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * NR))),
                                  _mm512_set1_ps(qx->s[c]), acc);
    }
    *out = acc;
}

/* Row groups g0..g1-1 of a packed weight against one x row. */
static inline __attribute__((always_inline)) void gemv_packed_groups(
    const int fmt, const uint8_t *pk, int64_t g0, int64_t g1, const QX *qx, void *out,
    int out_dtype) {
    const int64_t gb = qx->K / 32 * NR * block_bytes(fmt); /* a group's bytes */
    for (int64_t rg = g0; rg < g1; rg++) {
        if (QG_PF && rg + QG_PF < g1) { /* a later group (contiguous), read ahead */
            const uint8_t *nx = pk + (rg + QG_PF) * gb;
            for (int64_t b = 0; b < gb; b += 64) _mm_prefetch((const char *)nx + b, _MM_HINT_T0);
        }
        __m512 acc;
        gemv_packed_avx512(fmt, pk + rg * gb, qx, &acc);
        if (out_dtype == F32) {
            _mm512_storeu_ps((float *)out + rg * NR, acc);
        } else {
            float tmp[NR];
            _mm512_storeu_ps(tmp, acc);
            for (int r = 0; r < NR; r++) ((uint16_t *)out)[rg * NR + r] = to_bf16(tmp[r]);
        }
    }
}

#ifndef QG_GEMV
#define QG_GEMV 1 /* 0: one x row takes the tile path too (tests compare the two) */
#endif

static inline __attribute__((always_inline)) void gemm_avx512(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t N,
    const QX *qx, int64_t M, void *out, int out_dtype, const Tile *tl, const int packed) {
    __m512 acc[MR];
    for (int64_t rg = g0; rg < g1; rg++) {
        const int64_t o0 = rg * NR, rows = N - o0 < NR ? N - o0 : NR;
        if (QG_PF && rg + QG_PF < g1) { /* a later tile's rows (contiguous), read ahead */
            const int64_t p0 = o0 + QG_PF * NR, prow = N - p0 < NR ? N - p0 : NR;
            const uint8_t *nx = w + p0 * row_bytes;
            for (int64_t b = 0; b < prow * row_bytes; b += 64)
                _mm_prefetch((const char *)nx + b, _MM_HINT_T0);
        }
        const __mmask16 keep = (__mmask16)((1u << rows) - 1);
        if (QG_GEMV && M == 1 && !packed) {
            gemv_avx512(fmt, w, row_bytes, o0, rows, qx, tl, acc);
            if (out_dtype == F32) {
                _mm512_mask_storeu_ps((float *)out + o0, keep, acc[0]);
            } else {
                float tmp[NR];
                _mm512_storeu_ps(tmp, acc[0]);
                for (int64_t r = 0; r < rows; r++) ((uint16_t *)out)[o0 + r] = to_bf16(tmp[r]);
            }
            continue;
        }
        if (packed) /* a group is NR rows' bytes, at the file layout's offset of its rows */
            tile_packed_avx512(fmt, w + o0 * row_bytes, qx->K, tl);
        else
            tile_avx512(fmt, w, row_bytes, o0, rows, qx->K, tl);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mt = M - m0 < MR ? M - m0 : MR;
            switch (mt) {
            case 1: dots_avx512(fmt, tl, qx, m0, 1, acc); break;
            case 2: dots_avx512(fmt, tl, qx, m0, 2, acc); break;
            case 3: dots_avx512(fmt, tl, qx, m0, 3, acc); break;
            case 4: dots_avx512(fmt, tl, qx, m0, 4, acc); break;
            case 5: dots_avx512(fmt, tl, qx, m0, 5, acc); break;
            default: dots_avx512(fmt, tl, qx, m0, MR, acc);
            }
            for (int64_t i = 0; i < mt; i++) {
                if (out_dtype == F32) {
                    _mm512_mask_storeu_ps((float *)out + (m0 + i) * N + o0, keep, acc[i]);
                } else {
                    float tmp[NR];
                    _mm512_storeu_ps(tmp, acc[i]);
                    for (int64_t r = 0; r < rows; r++)
                        ((uint16_t *)out)[(m0 + i) * N + o0 + r] = to_bf16(tmp[r]);
                }
            }
        }
    }
}

/* Rows o0..o1-1 dequantized: ((q - OFF) * sc) [+ t], gguf-py's float32 operations. */
static inline __attribute__((always_inline)) void dequant_avx512(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t K,
    void *out, int out_dtype) {
    int64_t chunks = K / 32, pairs = (chunks + 1) / 2;
    const float off = (float)fmt_off(fmt);
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = w + o * row_bytes;
        for (int64_t p = 0; p < pairs; p++) {
            Pair r = decode_avx512(fmt, row, p, chunks);
            int quarters = 2 * p + 1 < chunks ? 4 : 2;
            for (int qi = 0; qi < quarters; qi++) {
                const __m512i idx = _mm512_set_epi32(
                    4 * qi + 3, 4 * qi + 3, 4 * qi + 3, 4 * qi + 3, 4 * qi + 2, 4 * qi + 2,
                    4 * qi + 2, 4 * qi + 2, 4 * qi + 1, 4 * qi + 1, 4 * qi + 1, 4 * qi + 1, 4 * qi,
                    4 * qi, 4 * qi, 4 * qi);
                __m128i q16 = qi == 0   ? _mm512_extracti32x4_epi32(r.q, 0)
                              : qi == 1 ? _mm512_extracti32x4_epi32(r.q, 1)
                              : qi == 2 ? _mm512_extracti32x4_epi32(r.q, 2)
                                        : _mm512_extracti32x4_epi32(r.q, 3);
                __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q16));
                if (fmt_off(fmt)) v = _mm512_sub_ps(v, _mm512_set1_ps(off));
                v = _mm512_mul_ps(v, _mm512_permutexvar_ps(idx, r.sc));
                if (fmt_has_t(fmt)) v = _mm512_add_ps(v, _mm512_permutexvar_ps(idx, r.t));
                int64_t at = o * K + 64 * p + 16 * qi;
                if (out_dtype == F32) {
                    _mm512_storeu_ps((float *)out + at, v);
                } else {
#ifdef __AVX512BF16__
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                                        (__m256i)_mm512_cvtneps_pbh(v));
#else
                    float tmp[16];
                    _mm512_storeu_ps(tmp, v);
                    for (int i = 0; i < 16; i++) ((uint16_t *)out)[at + i] = to_bf16(tmp[i]);
#endif
                }
            }
        }
    }
}

#define PER_FORMAT(F)                                                                          \
    static void gemm_avx512_##F(const uint8_t *w, int64_t rb, int64_t g0, int64_t g1, int64_t N, \
                                const QX *qx, int64_t M, void *out, int dt, const Tile *tl) {    \
        gemm_avx512(F, w, rb, g0, g1, N, qx, M, out, dt, tl, 0);                               \
    }                                                                                          \
    PER_FORMAT_PACKED_##F                                                                      \
    static void dequant_avx512_##F(const uint8_t *w, int64_t rb, int64_t o0, int64_t o1,         \
                                   int64_t K, void *out, int dt) {                             \
        dequant_avx512(F, w, rb, o0, o1, K, out, dt);                                          \
    }
/* The packed variants, for the packable formats only (``DISPATCH_PACKED``). */
#define PACKED_AVX512(F)                                                                       \
    static void gemm_avx512_packed_##F(const uint8_t *w, int64_t rb, int64_t g0, int64_t g1,     \
                                       int64_t N, const QX *qx, int64_t M, void *out, int dt,  \
                                       const Tile *tl) {                                       \
        gemm_avx512(F, w, rb, g0, g1, N, qx, M, out, dt, tl, 1);                               \
    }                                                                                          \
    static void gemv_packed_##F(const uint8_t *pk, int64_t g0, int64_t g1, const QX *qx,       \
                                void *out, int dt) {                                           \
        gemv_packed_groups(F, pk, g0, g1, qx, out, dt);                                        \
    }
#define PER_FORMAT_PACKED_Q4_0 PACKED_AVX512(Q4_0)
#define PER_FORMAT_PACKED_Q4_1 PACKED_AVX512(Q4_1)
#define PER_FORMAT_PACKED_Q5_0 PACKED_AVX512(Q5_0)
#define PER_FORMAT_PACKED_Q5_1 PACKED_AVX512(Q5_1)
#define PER_FORMAT_PACKED_Q8_0 PACKED_AVX512(Q8_0)
#define PER_FORMAT_PACKED_Q4_K
#define PER_FORMAT_PACKED_Q5_K
#define PER_FORMAT_PACKED_Q6_K
PER_FORMAT(Q4_0)
PER_FORMAT(Q4_1)
PER_FORMAT(Q5_0)
PER_FORMAT(Q5_1)
PER_FORMAT(Q8_0)
PER_FORMAT(Q4_K)
PER_FORMAT(Q5_K)
PER_FORMAT(Q6_K)

#endif

/* ---------------------------------------------------------------- AVX2 decoding */
/* Machines without AVX512 (AVX2 + FMA + F16C): the same tile, the same arithmetic as the
 * portable path, 8 output rows per 256-bit vector (a tile's 16 rows are two halves).
 *
 * Integer dots: with AVX-VNNI (__AVXVNNI__), vpdpbusd on 256 bits (u8 codes x s8 x codes,
 * exact int32 sums, as AVX512-VNNI). Without it, vpmaddubsw (u8 x s8, pairs summed into
 * int16 with SATURATION) and vpmaddwd by ones (int16 pairs into int32, exact). No saturation
 * can happen, so the int32 dots are exact and the same as every other path's:
 * - the x codes are in [-127, 127]: round(v * (127 / max|v|)) with |v| <= max|v| is at most
 *   127 * (1 + 2^-23) before rounding, so 127 (never -128);
 * - codes up to 63 (4-, 5- and 6-bit formats): one vpmaddubsw lane is |q0 x0 + q1 x1| <=
 *   2 * 63 * 127 = 16002, and the lanes of two steps added in int16 (vpaddw) <= 32004 <
 *   32767: exact;
 * - Q8_0 (codes q = w + 128 up to 255: 2 * 255 * 127 = 64770 would saturate): the signed
 *   weight w = q ^ 0x80 in [-128, 127], dotted as |w| (u8, <= 128) times sign(x, w) (x with
 *   w's sign, |.| <= 127; zero where w is 0): a lane is <= 2 * 128 * 127 = 32512 < 32767,
 *   exact, and not added to another before vpmaddwd. That dot is sum w x, which is the
 *   other paths' sum (q - 128) x = o + sum q x: the same integer, so o is not added. */
#ifdef QG_AVX2
#if defined(__AVXVNNI__)
#define QG_AVX2_VNNI 1
#endif
#define MR2 4 /* x rows per register tile (4 x (1 int + 1 float) accumulators) */

/* 16 bytes of nibbles -> 32 codes in value order (low nibbles, then high). */
static inline __m256i nib16_avx2(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* 32 bits -> 32 bytes: byte i is 0x10 where bit i is set (Q5_0 / Q5_1's fifth bits). */
static inline __m256i bit5_avx2(uint32_t bits) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* The 32 codes of chunk c of a weight row, in value order (chunk_codes' values). */
static inline __attribute__((always_inline)) __m256i codes_avx2(const int fmt, const uint8_t *row,
                                                                int64_t c) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (fmt < Q4_K) {
        const uint8_t *b = row + c * block_bytes(fmt);
        switch (fmt) {
        case Q4_0: return nib16_avx2(b + 2);
        case Q4_1: return nib16_avx2(b + 4);
        case Q5_0: return _mm256_or_si256(nib16_avx2(b + 6), bit5_avx2(rd32(b + 2)));
        case Q5_1: return _mm256_or_si256(nib16_avx2(b + 8), bit5_avx2(rd32(b + 4)));
        default: /* Q8_0: int8 + 128 as unsigned codes */
            return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)),
                                    _mm256_set1_epi8((char)0x80));
        }
    }
    const int sub = (int)(c % 8);
    if (fmt == Q6_K) {
        const uint8_t *b = row + (c / 8) * 210;
        const int half_ = sub / 4, k = sub % 4;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * half_ + 32 * (k % 2)));
        if (k / 2) lo = _mm256_srli_epi16(lo, 4);
        __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half_));
        hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), _mm256_set1_epi8(3));
        return _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(hi, 4));
    }
    /* Q4_K, Q5_K: sub-blocks 2j and 2j + 1 share 32 bytes of nibbles (low, high). */
    const uint8_t *b = row + (c / 8) * block_bytes(fmt);
    __m256i v = _mm256_loadu_si256((const __m256i *)(b + (fmt == Q4_K ? 16 : 48) + 32 * (sub / 2)));
    if (sub % 2) v = _mm256_srli_epi16(v, 4);
    v = _mm256_and_si256(v, m4);
    if (fmt == Q5_K) {
        const __m256i bit = _mm256_set1_epi8((char)(1 << sub));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 16));
        hb = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
    }
    return v;
}

/* 8 vectors of 8 dwords transposed in place: r[j] lane i = the input's r[i] lane j. */
static inline __attribute__((always_inline)) void transpose8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int a = 0; a < 8; a += 4) { /* u[a + b] 128-bit lane L: rows a..a+3, dword 4L + b */
        u[a] = _mm256_unpacklo_epi64(t[a], t[a + 2]);
        u[a + 1] = _mm256_unpackhi_epi64(t[a], t[a + 2]);
        u[a + 2] = _mm256_unpacklo_epi64(t[a + 1], t[a + 3]);
        u[a + 3] = _mm256_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int b = 0; b < 4; b++) {
        r[b] = _mm256_permute2x128_si256(u[b], u[4 + b], 0x20);
        r[4 + b] = _mm256_permute2x128_si256(u[b], u[4 + b], 0x31);
    }
}

/* quantize_row with AVX2: the same operations on 8 values at a time (the max skips a NaN as
 * quantize_row's comparison does, and is exact in any order; the integer sums too; v * inv
 * and the rounding to nearest even, MXCSR's default, are per value). */
static void quantize_row_avx2(const int fmt, const void *x, int dtype, int64_t m, const QX *qx) {
    const int64_t K = qx->K, per = 32 / group_values(fmt);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int8_t *q = qx->q + m * K;
    for (int64_t c = 0; c < K / 32; c++) {
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int h = 0; h < 4; h++) {
            if (dtype == F32) {
                v[h] = _mm256_loadu_ps((const float *)x + m * K + 32 * c + 8 * h);
            } else {
                __m128i b = _mm_loadu_si128(
                    (const __m128i *)((const uint16_t *)x + m * K + 32 * c + 8 * h));
                v[h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
            }
            mx = _mm256_max_ps(_mm256_and_ps(v[h], absmask), mx); /* NaN: keeps mx */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float amax = _mm_cvtss_f32(m4);
        const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i qi[4];
        for (int h = 0; h < 4; h++) qi[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], _mm256_set1_ps(inv)));
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                            _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * c), _mm256_permutevar8x32_epi32(packed, order));
        __m256i s01 = _mm256_add_epi32(qi[0], qi[1]), s23 = _mm256_add_epi32(qi[2], qi[3]);
        int32_t sums[2], tmp[8];
        if (per == 1) {
            _mm256_storeu_si256((__m256i *)tmp, _mm256_add_epi32(s01, s23));
            sums[0] = tmp[0] + tmp[1] + tmp[2] + tmp[3] + tmp[4] + tmp[5] + tmp[6] + tmp[7];
        } else {
            _mm256_storeu_si256((__m256i *)tmp, s01);
            sums[0] = tmp[0] + tmp[1] + tmp[2] + tmp[3] + tmp[4] + tmp[5] + tmp[6] + tmp[7];
            _mm256_storeu_si256((__m256i *)tmp, s23);
            sums[1] = tmp[0] + tmp[1] + tmp[2] + tmp[3] + tmp[4] + tmp[5] + tmp[6] + tmp[7];
        }
        for (int64_t h = 0; h < per; h++) {
            int64_t at = m * qx->ng + per * c + h;
            qx->d[at] = dx;
            qx->s[at] = dx * (float)sums[h];
            qx->o[at] = -fmt_off(fmt) * sums[h];
        }
    }
}

/* tile_scales with AVX2: 8 rows' scale bytes gathered per block, group_scales' float
 * operations on 8 rows at a time (as tile_scales_avx512 on 16). */
static inline __m256 half8(__m256i v) { /* the low 16 bits of each dword, an f16 */
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1,
                                          -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
                                          -1, -1);
    __m256i p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(p));
}

static inline __m256i byte8(__m256i v, int k) {
    return _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(0xff));
}

static inline __attribute__((always_inline)) void tile_scales_avx2(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t rows, int64_t K,
    const Tile *tl) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32((int)row_bytes));
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t h = 0; h < 2; h++) {
        const int64_t left = rows - 8 * h;
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 0 ? 0 : left)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const uint8_t *base = w + (o0 + 8 * h) * row_bytes;
        float *sc = tl->sc + 8 * h, *t = tl->t + 8 * h;
#define GATHER8(off) _mm256_mask_i32gather_epi32(zero, (const int *)(base + (off)), idx, keep, 1)
        if (fmt < Q4_K) {
            const int bb = block_bytes(fmt);
            for (int64_t c = 0; c < K / 32; c++) {
                __m256i g = GATHER8(c * bb);
                _mm256_store_ps(sc + c * NR, half8(g));
                if (fmt_has_t(fmt)) _mm256_store_ps(t + c * NR, half8(_mm256_srli_epi32(g, 16)));
            }
        } else if (fmt == Q6_K) {
            for (int64_t sb = 0; sb < K / 256; sb++) {
                __m256 d = half8(_mm256_srli_epi32(GATHER8(sb * 210 + 206), 16));
                for (int k = 0; k < 4; k++) {
                    __m256i s4 = GATHER8(sb * 210 + 192 + 4 * k);
                    for (int b = 0; b < 4; b++) {
                        __m256i s = _mm256_srai_epi32(_mm256_slli_epi32(s4, 24 - 8 * b), 24);
                        _mm256_store_ps(sc + (sb * 16 + 4 * k + b) * NR,
                                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(s)));
                    }
                }
            }
        } else { /* Q4_K, Q5_K: k_scale_min's unpacking */
            const int bb = block_bytes(fmt);
            const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15);
            const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
            for (int64_t sb = 0; sb < K / 256; sb++) {
                __m256i dd = GATHER8(sb * bb), s0 = GATHER8(sb * bb + 4),
                        s1 = GATHER8(sb * bb + 8), s2 = GATHER8(sb * bb + 12);
                __m256 d = half8(dd), dmin = half8(_mm256_srli_epi32(dd, 16));
                for (int j = 0; j < 8; j++) {
                    __m256i isc, imn;
                    if (j < 4) {
                        isc = _mm256_and_si256(byte8(s0, j), m63);
                        imn = _mm256_and_si256(byte8(s1, j), m63);
                    } else {
                        __m256i hi = byte8(s2, j - 4);
                        isc = _mm256_or_si256(
                            _mm256_and_si256(hi, m15),
                            _mm256_slli_epi32(_mm256_srli_epi32(byte8(s0, j - 4), 6), 4));
                        imn = _mm256_or_si256(
                            _mm256_srli_epi32(hi, 4),
                            _mm256_slli_epi32(_mm256_srli_epi32(byte8(s1, j - 4), 6), 4));
                    }
                    _mm256_store_ps(sc + (sb * 8 + j) * NR,
                                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(isc)));
                    _mm256_store_ps(t + (sb * 8 + j) * NR,
                                    _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(imn)),
                                                  sign));
                }
            }
        }
#undef GATHER8
    }
}

/* A tile's codes: per chunk, each half's 8 rows decoded (32 codes each) and transposed to
 * the tile's [K / 4][NR][4] layout (rows past the weight's end are zeros). */
static inline __attribute__((always_inline)) void tile_avx2(const int fmt, const uint8_t *w,
                                                            int64_t row_bytes, int64_t o0,
                                                            int64_t rows, int64_t K,
                                                            const Tile *tl) {
    for (int64_t c = 0; c < K / 32; c++) {
        for (int64_t h = 0; h < 2; h++) {
            __m256i r[8];
            for (int64_t i = 0; i < 8; i++)
                r[i] = 8 * h + i < rows ? codes_avx2(fmt, w + (o0 + 8 * h + i) * row_bytes, c)
                                        : _mm256_setzero_si256();
            transpose8(r);
            for (int j = 0; j < 8; j++)
                _mm256_store_si256((__m256i *)(tl->q + (8 * c + j) * 64 + 32 * h), r[j]);
        }
    }
    tile_scales_avx2(fmt, w, row_bytes, o0, rows, K, tl);
}

/* MT x rows from m0 against half h of a tile (its output rows 8 h .. 8 h + 7): acc[i] lane r
 * = the chain of x row m0 + i and output row o0 + 8 h + r (see quant_gemm). */
static inline __attribute__((always_inline)) void dots_avx2(const int fmt, const Tile *tl,
                                                            const QX *qx, int64_t m0,
                                                            const int MT, const int64_t h,
                                                            __m256 *acc) {
    const int gv = group_values(fmt), nq = gv / 4;
    const int64_t K = qx->K, ng = qx->ng;
#ifndef QG_AVX2_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
#pragma GCC unroll 4
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wq = tl->q + g * nq * 64 + 32 * h;
        const int8_t *xq = qx->q + m0 * K + g * gv;
        __m256i ai[MR2];
#ifdef QG_AVX2_VNNI
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++)
            ai[i] = fmt_off(fmt) ? _mm256_set1_epi32(qx->o[(m0 + i) * ng + g])
                                 : _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < nq; j++) {
            const __m256i wv = _mm256_load_si256((const __m256i *)(wq + 64 * j));
#pragma GCC unroll 4
            for (int i = 0; i < MT; i++)
                ai[i] = _mm256_dpbusd_avx_epi32(
                    ai[i], wv, _mm256_set1_epi32((int)rd32((const uint8_t *)xq + i * K + 4 * j)));
        }
#else
        if (fmt == Q8_0) { /* |w| . sign(x, w): no o (see above) */
#pragma GCC unroll 4
            for (int i = 0; i < MT; i++) ai[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < nq; j++) {
                const __m256i ws = _mm256_xor_si256(
                    _mm256_load_si256((const __m256i *)(wq + 64 * j)), _mm256_set1_epi8((char)0x80));
                const __m256i wa = _mm256_abs_epi8(ws);
#pragma GCC unroll 4
                for (int i = 0; i < MT; i++) {
                    __m256i xv = _mm256_set1_epi32((int)rd32((const uint8_t *)xq + i * K + 4 * j));
                    __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, ws));
                    ai[i] = _mm256_add_epi32(ai[i], _mm256_madd_epi16(p, ones));
                }
            }
        } else { /* codes <= 63: two steps' int16 lanes added exactly (see above) */
#pragma GCC unroll 4
            for (int i = 0; i < MT; i++)
                ai[i] = fmt_off(fmt) ? _mm256_set1_epi32(qx->o[(m0 + i) * ng + g])
                                     : _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 0; j < nq; j += 2) {
                const __m256i w0 = _mm256_load_si256((const __m256i *)(wq + 64 * j));
                const __m256i w1 = _mm256_load_si256((const __m256i *)(wq + 64 * j + 64));
#pragma GCC unroll 4
                for (int i = 0; i < MT; i++) {
                    const uint8_t *xp = (const uint8_t *)xq + i * K + 4 * j;
                    __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w0, _mm256_set1_epi32((int)rd32(xp))),
                        _mm256_maddubs_epi16(w1, _mm256_set1_epi32((int)rd32(xp + 4))));
                    ai[i] = _mm256_add_epi32(ai[i], _mm256_madd_epi16(p, ones));
                }
            }
        }
#endif
        const __m256 scv = _mm256_load_ps(tl->sc + g * NR + 8 * h);
        const __m256 tv = fmt_has_t(fmt) ? _mm256_load_ps(tl->t + g * NR + 8 * h)
                                         : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < MT; i++) {
            const int64_t at = (m0 + i) * ng + g;
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[i]),
                                     _mm256_mul_ps(scv, _mm256_set1_ps(qx->d[at])), acc[i]);
            if (fmt_has_t(fmt)) acc[i] = _mm256_fmadd_ps(tv, _mm256_set1_ps(qx->s[at]), acc[i]);
        }
    }
}

static inline __attribute__((always_inline)) void gemm_avx2(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t N,
    const QX *qx, int64_t M, void *out, int out_dtype, const Tile *tl) {
    __m256 acc[MR2];
    float tmp[8];
    for (int64_t rg = g0; rg < g1; rg++) {
        const int64_t o0 = rg * NR, rows = N - o0 < NR ? N - o0 : NR;
        tile_avx2(fmt, w, row_bytes, o0, rows, qx->K, tl);
        for (int64_t h = 0; h < 2 && 8 * h < rows; h++) {
            const int64_t hr = rows - 8 * h < 8 ? rows - 8 * h : 8;
            for (int64_t m0 = 0; m0 < M; m0 += MR2) {
                const int64_t mt = M - m0 < MR2 ? M - m0 : MR2;
                switch (mt) {
                case 1: dots_avx2(fmt, tl, qx, m0, 1, h, acc); break;
                case 2: dots_avx2(fmt, tl, qx, m0, 2, h, acc); break;
                case 3: dots_avx2(fmt, tl, qx, m0, 3, h, acc); break;
                default: dots_avx2(fmt, tl, qx, m0, MR2, h, acc);
                }
                for (int64_t i = 0; i < mt; i++) {
                    const int64_t at = (m0 + i) * N + o0 + 8 * h;
                    if (out_dtype == F32 && hr == 8) {
                        _mm256_storeu_ps((float *)out + at, acc[i]);
                    } else {
                        _mm256_storeu_ps(tmp, acc[i]);
                        for (int64_t r = 0; r < hr; r++) store(out, out_dtype, at + r, tmp[r]);
                    }
                }
            }
        }
    }
}

/* The 32 values of chunk c of a row as floats in 4 vectors of 8: quant_dequant's operations,
 * ((q - OFF) * sc) [+ t], sc and t from group_scales (Q6_K: one per 16 values). */
static inline __attribute__((always_inline)) void fchunk_avx2(const int fmt, const uint8_t *row,
                                                              int64_t c, __m256 *v) {
    const __m256i q = codes_avx2(fmt, row, c);
    float sc[2], t[2];
    group_scales(fmt, row, c, sc, t);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[k]));
        if (fmt_off(fmt)) f = _mm256_sub_ps(f, _mm256_set1_ps((float)fmt_off(fmt)));
        f = _mm256_mul_ps(f, _mm256_set1_ps(sc[fmt == Q6_K ? k / 2 : 0]));
        if (fmt_has_t(fmt)) f = _mm256_add_ps(f, _mm256_set1_ps(t[0]));
        v[k] = f;
    }
}

/* Round to nearest even bf16 and widen back (the weights are finite: no NaN case). */
static inline __m256 round_bf16_avx2(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

/* Rows o0..o1-1 dequantized as quant_dequant's portable path, bit for bit. */
static inline __attribute__((always_inline)) void dequant_avx2(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t K,
    void *out, int out_dtype) {
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = w + o * row_bytes;
        for (int64_t c = 0; c < K / 32; c++) {
            __m256 v[4];
            fchunk_avx2(fmt, row, c, v);
            const int64_t at = o * K + 32 * c;
            if (out_dtype == F32) {
                for (int k = 0; k < 4; k++) _mm256_storeu_ps((float *)out + at + 8 * k, v[k]);
            } else {
                for (int k = 0; k < 4; k += 2) { /* the high halves of the rounded values */
                    __m256i a = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_avx2(v[k])), 16);
                    __m256i b = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_avx2(v[k + 1])), 16);
                    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + 8 * k), p);
                }
            }
        }
    }
}

#define PER_FORMAT_AVX2(F)                                                                     \
    static void gemm_avx2_##F(const uint8_t *w, int64_t rb, int64_t g0, int64_t g1, int64_t N,  \
                              const QX *qx, int64_t M, void *out, int dt, const Tile *tl) {     \
        gemm_avx2(F, w, rb, g0, g1, N, qx, M, out, dt, tl);                                    \
    }                                                                                          \
    static void dequant_avx2_##F(const uint8_t *w, int64_t rb, int64_t o0, int64_t o1,          \
                                 int64_t K, void *out, int dt) {                               \
        dequant_avx2(F, w, rb, o0, o1, K, out, dt);                                            \
    }
PER_FORMAT_AVX2(Q4_0)
PER_FORMAT_AVX2(Q4_1)
PER_FORMAT_AVX2(Q5_0)
PER_FORMAT_AVX2(Q5_1)
PER_FORMAT_AVX2(Q8_0)
PER_FORMAT_AVX2(Q4_K)
PER_FORMAT_AVX2(Q5_K)
PER_FORMAT_AVX2(Q6_K)

#endif

/* ---------------------------------------------------------------- AMX-INT8 (M >= AMX_ROWS) */
/* The same arithmetic as dots_avx512 with the integer dots of 16 output rows x 16 x rows x
 * one group in one tdpbusd: A = the 16 output rows' codes of the group (u8, row-major), B = the
 * 16 x rows' codes of the group in the VNNI layout ([GV / 4][16][4], s8), C = int32 [16 out][16
 * x rows]; then per output row o the chain of every x row at once (lanes = x rows):
 * acc[o] = fma(float(C[o] + o_x), sc[o] * dx, acc[o]) [+ fma(t[o], dx * sum qx, acc[o])],
 * the very operations of dots_avx512 (sc[o] * dx is one product either way). */
#if defined(QG_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QG_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16 /* fewer x rows: the VNNI path (the same bits) */
#define AMX_GROUPS 16 /* groups whose integer dots run before their float chains */
#define AMX_MB 8      /* x blocks (of 16 rows) per pass over a thread's row groups */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

static int amx_state = -1; /* -1 unknown, 0 refused by the OS, 1 usable */

static int amx_usable(void) {
    if (amx_state < 0) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: once per process */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

/* x codes for AMX: per block of 16 x rows (zeros past M) and 4 values, the 16 rows' 4 codes:
 * [M / 16][K / 4][16][4]; and per block and group the 16 rows' o, d and s: [M / 16][ng][16]. */
typedef struct {
    uint8_t *q;
    int32_t *o;
    float *d, *s;
    int64_t blocks, kq; /* kq: 4-value steps per block, whole pairs (the slack of an odd chunk) */
} XT;

static void x_for_amx(const QX *qx, int64_t M, const XT *xt, int64_t b) {
    const int64_t K = qx->K, pairs = (K / 32 + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; i++) {
            int64_t m = 16 * b + i;
            /* the last chunk of an odd count reads 32 bytes of slack: they land past K / 4 */
            r[i] = m < M ? _mm512_loadu_si512((const void *)(qx->q + m * K + 64 * p))
                         : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int j = 0; j < 16; j++)
            _mm512_store_si512((void *)(xt->q + (b * xt->kq + 16 * p + j) * 64), r[j]);
    }
    for (int64_t g = 0; g < qx->ng; g++)
        for (int64_t i = 0; i < 16; i++) {
            int64_t m = 16 * b + i, at = (b * qx->ng + g) * 16 + i;
            xt->o[at] = m < M ? qx->o[m * qx->ng + g] : 0;
            xt->d[at] = m < M ? qx->d[m * qx->ng + g] : 0.0f;
            xt->s[at] = m < M ? qx->s[m * qx->ng + g] : 0.0f;
        }
}

/* The NR output rows' codes row-major ([NR][kpad], kpad = whole pairs of chunks) and scales. */
static inline __attribute__((always_inline)) void tile_rows_avx512(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t rows, int64_t K,
    uint8_t *a, int64_t kpad, const Tile *tl) {
    const int64_t chunks = K / 32, pairs = (chunks + 1) / 2;
    for (int64_t i = 0; i < NR; i++)
        for (int64_t p = 0; p < pairs; p++)
            _mm512_store_si512((void *)(a + i * kpad + 64 * p),
                               i < rows ? decode_avx512(fmt, w + (o0 + i) * row_bytes, p, chunks).q
                                        : _mm512_setzero_si512());
    tile_scales_avx512(fmt, w, row_bytes, o0, rows, K, tl);
}

/* tile_rows_avx512 from a packed group (pk: its first byte): a pair's two chunks' tile vectors
 * transposed back to each row's 64 codes in value order, the same rows. */
static inline __attribute__((always_inline)) void tile_rows_packed_avx512(
    const int fmt, const uint8_t *pk, int64_t K, uint8_t *a, int64_t kpad, const Tile *tl) {
    const int64_t chunks = K / 32, pairs = (chunks + 1) / 2, cb = (int64_t)NR * block_bytes(fmt);
    for (int64_t p = 0; p < pairs; p++) {
        __m512i r[16];
        packed_codes_avx512(fmt, pk + 2 * p * cb, r);
        if (2 * p + 1 < chunks)
            packed_codes_avx512(fmt, pk + (2 * p + 1) * cb, r + 8);
        else
            for (int j = 8; j < 16; j++) r[j] = _mm512_setzero_si512();
        transpose16(r);
        for (int64_t i = 0; i < NR; i++) _mm512_store_si512((void *)(a + i * kpad + 64 * p), r[i]);
    }
    packed_scales_avx512(fmt, pk, chunks, tl);
}

/* 16 floats rounded to bf16 as to_bf16 (nearest even; a NaN kept quiet), for a masked store. */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(hi, _mm512_set1_epi32(1)))),
        16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline __attribute__((always_inline)) void gemm_amx(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t N,
    const QX *qx, const XT *xt, int64_t M, void *out, int out_dtype, const Tile *tl,
    uint8_t *a, int32_t *cbuf, const int packed) {
    const int gv = group_values(fmt);
    const int64_t K = qx->K, ng = qx->ng, kpad = xt->kq * 4;
    /* AMX_MB x blocks (128 rows) at a time over all the thread's row groups, each group's
     * codes decoded again per pass: the output lines they write stay in the cache (a long
     * prefill's whole 16-column strip at a time, a line per row, did not: M = 2,048, N =
     * 1,536, K = 576, Q4_1 22.6 -> 18.2 ms at 1 thread; integer dots exact, chains in the same
     * order: the same bits) */
    for (int64_t m0 = 0; m0 < xt->blocks; m0 += AMX_MB)
        for (int64_t rg = g0; rg < g1; rg++) {
        const int64_t o0 = rg * NR, rows = N - o0 < NR ? N - o0 : NR;
        const int64_t m1 = m0 + AMX_MB < xt->blocks ? m0 + AMX_MB : xt->blocks;
        if (packed)
            tile_rows_packed_avx512(fmt, w + o0 * row_bytes, K, a, kpad, tl);
        else
            tile_rows_avx512(fmt, w, row_bytes, o0, rows, K, a, kpad, tl);
        for (int64_t b = m0; b < m1; b++) {
            __m512 acc[NR];
            for (int o = 0; o < NR; o++) acc[o] = _mm512_setzero_ps();
            const uint8_t *xb = xt->q + b * xt->kq * 64;
            for (int64_t gc = 0; gc < ng; gc += AMX_GROUPS) {
                const int64_t ge = gc + AMX_GROUPS < ng ? gc + AMX_GROUPS : ng;
                /* the integer dots of AMX_GROUPS groups first, then their float chains: the
                 * tile unit and the vector units work apart */
                for (int64_t g = gc; g < ge; g++) {
                    int32_t *c = cbuf + (g - gc) * 256;
                    if (g & 1) {
                        _tile_zero(3);
                        _tile_loadd(1, a + g * gv, kpad);
                        _tile_loadd(2, xb + g * gv * 16, 64);
                        _tile_dpbusd(3, 1, 2);
                        _tile_stored(3, c, 64);
                    } else {
                        _tile_zero(0);
                        _tile_loadd(4, a + g * gv, kpad);
                        _tile_loadd(5, xb + g * gv * 16, 64);
                        _tile_dpbusd(0, 4, 5);
                        _tile_stored(0, c, 64);
                    }
                }
                for (int64_t g = gc; g < ge; g++) {
                    const int32_t *c = cbuf + (g - gc) * 256;
                    const int64_t at = (b * ng + g) * 16;
                    const __m512i ov = _mm512_loadu_si512((const void *)(xt->o + at));
                    const __m512 dv = _mm512_loadu_ps(xt->d + at);
                    const __m512 sv = _mm512_loadu_ps(xt->s + at);
                    const float *sc = tl->sc + g * NR, *t = tl->t + g * NR;
#pragma GCC unroll 16
                    for (int o = 0; o < NR; o++) {
                        __m512i ci = _mm512_load_si512((const void *)(c + 16 * o));
                        if (fmt_off(fmt)) ci = _mm512_add_epi32(ci, ov);
                        acc[o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ci),
                                                 _mm512_mul_ps(_mm512_set1_ps(sc[o]), dv), acc[o]);
                        if (fmt_has_t(fmt))
                            acc[o] = _mm512_fmadd_ps(_mm512_set1_ps(t[o]), sv, acc[o]);
                    }
                }
            }
            /* acc[o] lane i = (x row 16 b + i, output o0 + o): transposed to rows of out */
            __m512i r[16];
            for (int o = 0; o < 16; o++) r[o] = _mm512_castps_si512(acc[o]);
            transpose16(r);
            const __mmask16 keep = (__mmask16)((1u << rows) - 1);
            for (int64_t i = 0; i < 16 && 16 * b + i < M; i++) {
                float *dst = (float *)out + (16 * b + i) * N + o0;
                if (out_dtype == F32) {
                    _mm512_mask_storeu_ps(dst, keep, _mm512_castsi512_ps(r[i]));
                } else {
                    float tmp[16];
                    _mm512_storeu_ps(tmp, _mm512_castsi512_ps(r[i]));
                    for (int64_t o = 0; o < rows; o++)
                        ((uint16_t *)out)[(16 * b + i) * N + o0 + o] = to_bf16(tmp[o]);
                }
            }
        }
    }
}

#define PER_FORMAT_AMX(F)                                                                      \
    static void gemm_amx_##F(const uint8_t *w, int64_t rb, int64_t g0, int64_t g1, int64_t N,   \
                             const QX *qx, const XT *xt, int64_t M, void *out, int dt,          \
                             const Tile *tl, uint8_t *a, int32_t *c) {                          \
        gemm_amx(F, w, rb, g0, g1, N, qx, xt, M, out, dt, tl, a, c, 0);                        \
    }
#define PACKED_AMX(F)                                                                          \
    static void gemm_amx_packed_##F(const uint8_t *w, int64_t rb, int64_t g0, int64_t g1,        \
                                    int64_t N, const QX *qx, const XT *xt, int64_t M, void *out, \
                                    int dt, const Tile *tl, uint8_t *a, int32_t *c) {           \
        gemm_amx(F, w, rb, g0, g1, N, qx, xt, M, out, dt, tl, a, c, 1);                        \
    }
PACKED_AMX(Q4_0)
PACKED_AMX(Q4_1)
PACKED_AMX(Q5_0)
PACKED_AMX(Q5_1)
PACKED_AMX(Q8_0)
PER_FORMAT_AMX(Q4_0)
PER_FORMAT_AMX(Q4_1)
PER_FORMAT_AMX(Q5_0)
PER_FORMAT_AMX(Q5_1)
PER_FORMAT_AMX(Q8_0)
PER_FORMAT_AMX(Q4_K)
PER_FORMAT_AMX(Q5_K)
PER_FORMAT_AMX(Q6_K)
#endif

/* ---------------------------------------------------------------- entry points */
#if defined(QG_AMX)
/* quant_gemm's AMX path: x laid out for tdpbusd, then each thread's row groups. */
static int gemm_amx_all(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, const QX *qx,
                        int64_t M, void *out, int x_dtype, int nthreads, int64_t groups,
                        char *tiles, size_t tq, size_t ts, int packed) {
    const int64_t K = qx->K, ng = qx->ng, pairs = (K / 32 + 1) / 2, gv = group_values(fmt);
    XT xt;
    xt.blocks = (M + 15) / 16;
    xt.kq = pairs * 16;
    size_t xbytes = (size_t)(xt.blocks * xt.kq * 64), nb = (size_t)(xt.blocks * ng * 16);
    char *xbuf = (char *)aligned_alloc(64, xbytes + nb * 12);
    /* per thread: the row group's codes row-major and two C tiles */
    size_t abytes = (size_t)(NR * pairs * 64) + AMX_GROUPS * 256 * 4;
    char *abuf = (char *)aligned_alloc(64, (size_t)nthreads * abytes);
    if (!xbuf || !abuf) {
        free(xbuf);
        free(abuf);
        return 3;
    }
    xt.q = (uint8_t *)xbuf;
    xt.o = (int32_t *)(xbuf + xbytes);
    xt.d = (float *)(xt.o + nb);
    xt.s = xt.d + nb;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < xt.blocks; b++) x_for_amx(qx, M, &xt, b);
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        char *mine = tiles + (size_t)t * (tq + 2 * ts);
        Tile tl = {(uint8_t *)mine, (float *)(mine + tq), (float *)(mine + tq + ts)};
        uint8_t *a = (uint8_t *)(abuf + (size_t)t * abytes);
        int32_t *c = (int32_t *)(a + NR * pairs * 64);
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 6; i++) {
            int kind = i % 3; /* 0: C [16][16] int32, 1: A [16][gv] u8, 2: B [gv / 4][64] s8 */
            cfg.rows[i] = (uint8_t)(kind == 2 ? gv / 4 : 16);
            cfg.colsb[i] = (uint16_t)(kind == 1 ? gv : 64);
        }
        _tile_loadconfig(&cfg);
        if (packed) {
            DISPATCH_PACKED(fmt, gemm_amx_packed, w, row_bytes, g0, g1, N, qx, &xt, M, out, x_dtype,
                     &tl, a, c)
        } else {
            DISPATCH(fmt, gemm_amx, w, row_bytes, g0, g1, N, qx, &xt, M, out, x_dtype, &tl, a, c)
        }
        _tile_release();
    }
    free(abuf);
    free(xbuf);
    return 0;
}
#endif

#if defined(QG_AMX) && defined(__AMX_BF16__)
/* gemm_bf16's buffers (x laid out for the tiles, the dequantized weight) kept per calling
 * thread from one call to the next and grown when a call needs more: a prefill's are
 * megabytes, which malloc would map fresh and the kernel fault in page by page on every call.
 * A thread keeps its largest call's buffers until the process ends. */
enum { SCRATCH_XT, SCRATCH_A, SCRATCH_SLOTS };
static __thread char *scratch_ptr[SCRATCH_SLOTS];
static __thread size_t scratch_len[SCRATCH_SLOTS];

static void *scratch_get(int slot, size_t bytes) {
    if (bytes > scratch_len[slot]) {
        free(scratch_ptr[slot]);
        size_t n = (bytes + 4095) / 4096 * 4096;
        scratch_ptr[slot] = (char *)aligned_alloc(4096, n);
        scratch_len[slot] = scratch_ptr[slot] ? n : 0;
    }
    return scratch_ptr[slot];
}

/* quant_gemm_bf16: out[M, N] = x[M, K] . bf16(dequant(W))^T with x bf16 (not quantized), on
 * AMX-BF16 tiles: W's rows dequantized to bf16 as quant_dequant does (gguf-py's float32
 * values rounded to bf16), 16 at a time; x laid out per block of 16 rows as tdpbf16ps's B
 * ([K / 2][16 rows][2]); each output element is one fp32 tile accumulator over K in 32-value
 * steps in the order 0, 1, ... (one tdpbf16ps each), then rounded to bf16. The tile unit
 * computes every element of C alike, so a row's result does not depend on M (a row alone is a
 * block with zero rows beside it), on its place in its block, or on the threads (they split
 * the output rows). With more than BF_MB blocks the whole weight is dequantized once (the
 * blocks then run in passes of BF_MB, the output rows they write staying in the cache); with
 * fewer, each thread dequantizes its 16 rows as it reaches them: the same bf16 values. */
#ifndef BF_MB
#define BF_MB 8
#endif
/* Rows 0..rows-1 of w dequantized to bf16 as dequant_avx512 does, for the formats whose codes
 * are under 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K): per 32-value chunk the 32 values a code
 * can take, ((j - OFF) * sc) [+ t] for j = 0..31 in float32 and rounded to bf16 (the same
 * operations per value), then one 16-bit permute looks the chunk's codes up: ~half the work
 * of dequantizing value by value (a decode step dequantizes its whole weight). */
static inline __attribute__((always_inline)) void dequant_lut_bf16(const int fmt,
                                                                   const uint8_t *w,
                                                                   int64_t row_bytes,
                                                                   int64_t rows, int64_t K,
                                                                   uint16_t *a) {
    const int64_t chunks = K / 32, pairs = (chunks + 1) / 2;
    const float off = (float)fmt_off(fmt);
    const __m512 j0 = _mm512_sub_ps(
        _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_ps(off));
    const __m512 j1 = _mm512_sub_ps(
        _mm512_set_ps(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16),
        _mm512_set1_ps(off));
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t p = 0; p < pairs; p++) {
            Pair P = decode_avx512(fmt, row, p, chunks);
            for (int h = 0; h < 2 && 2 * p + h < chunks; h++) {
                const __m512i lane = _mm512_set1_epi32(8 * h);
                const __m512 sc = _mm512_permutexvar_ps(lane, P.sc);
                __m512 v0 = _mm512_mul_ps(j0, sc), v1 = _mm512_mul_ps(j1, sc);
                if (fmt_has_t(fmt)) {
                    const __m512 t = _mm512_permutexvar_ps(lane, P.t);
                    v0 = _mm512_add_ps(v0, t);
                    v1 = _mm512_add_ps(v1, t);
                }
                const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
                const __m512i idx = _mm512_cvtepu8_epi16(
                    h ? _mm512_extracti64x4_epi64(P.q, 1) : _mm512_castsi512_si256(P.q));
                _mm512_storeu_si512((void *)(a + r * K + 32 * (2 * p + h)),
                                    _mm512_permutexvar_epi16(idx, table));
            }
        }
    }
}

#define PER_FORMAT_LUT(F)                                                                      \
    static void lut_##F(const uint8_t *w, int64_t rb, int64_t rows, int64_t K, uint16_t *a) {  \
        dequant_lut_bf16(F, w, rb, rows, K, a);                                                \
    }
PER_FORMAT_LUT(Q4_0)
PER_FORMAT_LUT(Q4_1)
PER_FORMAT_LUT(Q5_0)
PER_FORMAT_LUT(Q5_1)
PER_FORMAT_LUT(Q4_K)
PER_FORMAT_LUT(Q5_K)

/* Q8_0 rows to bf16 as dequant_avx512 does ((q + 128) - 128 is q exactly, then * sc), 32
 * values at a time. */
static void q8_bf16(const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t K, uint16_t *a) {
    const int64_t chunks = K / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks; c++) {
            const uint8_t *b = w + r * row_bytes + 34 * c;
            const __m512 sc = _mm512_set1_ps(h2f(b));
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
            const __m512 v0 = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), sc);
            const __m512 v1 = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), sc);
            _mm512_storeu_si512((void *)(a + r * K + 32 * c), (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
        }
}

/* Rows 0..rows-1 of w to bf16: by table where the codes are under 32, Q8_0 by q8_bf16, Q6_K
 * value by value (dequant_avx512). */
static void dequant_rows_bf16(int fmt, const uint8_t *w, int64_t rb, int64_t rows, int64_t K,
                              uint16_t *a);

#define PER_FORMAT_DQ(F)                                                                       \
    static void dq_##F(const uint8_t *w, int64_t rb, int64_t o0, int64_t o1, int64_t K,       \
                       void *out) {                                                            \
        dequant_avx512(F, w, rb, o0, o1, K, out, BF16);                                        \
    }
PER_FORMAT_DQ(Q4_0)
PER_FORMAT_DQ(Q4_1)
PER_FORMAT_DQ(Q5_0)
PER_FORMAT_DQ(Q5_1)
PER_FORMAT_DQ(Q8_0)
PER_FORMAT_DQ(Q4_K)
PER_FORMAT_DQ(Q5_K)
PER_FORMAT_DQ(Q6_K)

static void dequant_rows_bf16(int fmt, const uint8_t *w, int64_t rb, int64_t rows, int64_t K,
                              uint16_t *a) {
    switch (fmt) {
    case Q4_0: lut_Q4_0(w, rb, rows, K, a); break;
    case Q4_1: lut_Q4_1(w, rb, rows, K, a); break;
    case Q5_0: lut_Q5_0(w, rb, rows, K, a); break;
    case Q5_1: lut_Q5_1(w, rb, rows, K, a); break;
    case Q4_K: lut_Q4_K(w, rb, rows, K, a); break;
    case Q5_K: lut_Q5_K(w, rb, rows, K, a); break;
    case Q8_0: q8_bf16(w, rb, rows, K, a); break;
    default: DISPATCH(fmt, dq, w, rb, 0, rows, K, a)
    }
}

static int gemm_bf16(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                     const uint16_t *x, int64_t M, uint16_t *out, int nthreads) {
    int bb = block_bytes(fmt);
    if (!bb || K % block_values(fmt) || row_bytes != K / block_values(fmt) * bb) return 1;
    if (M < 1 || N < 1 || K % 32) return 2;
    if (!amx_usable()) return 4;
    if (nthreads < 1) nthreads = 1;
    const int64_t blocks = (M + 15) / 16, groups = (N + NR - 1) / NR, kc = K / 32;
    if (nthreads > groups) nthreads = (int)groups;
    /* x per block of 16 rows and pair of values: the 16 rows' pairs, [blocks][K / 2][16][2] */
    uint16_t *xb = (uint16_t *)scratch_get(SCRATCH_XT, (size_t)(blocks * K * 16 * 2));
    /* the weight dequantized: whole when several passes, else per thread 16 rows */
    const int whole = blocks > BF_MB;
    size_t per = (size_t)(16 * K * 2);
    uint16_t *wb = (uint16_t *)scratch_get(SCRATCH_A, (size_t)(whole ? groups : nthreads) * per);
    if (!xb || !wb) return 3;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t c = 0; c < kc; c++) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++) {
                int64_t m = 16 * b + i;
                r[i] = m < M ? _mm512_loadu_si512((const void *)(x + m * K + 32 * c))
                             : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int j = 0; j < 16; j++)
                _mm512_store_si512((void *)(xb + ((b * kc + c) * 16 + j) * 32), r[j]);
        }
    if (whole) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t rg = 0; rg < groups; rg++) {
            int64_t o0 = rg * NR, o1 = o0 + NR < N ? o0 + NR : N;
            uint16_t *a = wb + rg * 16 * K;
            DISPATCH(fmt, dq, w + o0 * row_bytes, row_bytes, 0, o1 - o0, K, a)
            if (o1 - o0 < 16) memset(a + (o1 - o0) * K, 0, (size_t)((16 - (o1 - o0)) * K * 2));
        }
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 5; i++) {
            cfg.rows[i] = 16;
            cfg.colsb[i] = 64;
        }
        _tile_loadconfig(&cfg);
        float cbuf[2][256] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < blocks; m0 += BF_MB)
            for (int64_t rg = g0; rg < g1; rg++) {
                const int64_t o0 = rg * NR, rows = N - o0 < NR ? N - o0 : NR;
                const int64_t m1 = m0 + BF_MB < blocks ? m0 + BF_MB : blocks;
                const __mmask16 keep = (__mmask16)((1u << rows) - 1);
                uint16_t *a;
                if (whole) {
                    a = wb + rg * 16 * K;
                } else {
                    a = wb + (size_t)t * 16 * K;
                    dequant_rows_bf16(fmt, w + o0 * row_bytes, row_bytes, rows, K, a);
                    if (rows < 16) memset(a + rows * K, 0, (size_t)((16 - rows) * K * 2));
                }
                for (int64_t b = m0; b < m1; b += 2) {
                    const int two = b + 1 < m1;
                    const uint16_t *x0 = xb + b * kc * 512, *x1 = x0 + kc * 512;
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int64_t c = 0; c < kc; c++) {
                        _tile_loadd(2, a + 32 * c, K * 2);
                        _tile_loadd(3, x0 + c * 512, 64);
                        _tile_dpbf16ps(0, 2, 3);
                        if (two) {
                            _tile_loadd(4, x1 + c * 512, 64);
                            _tile_dpbf16ps(1, 2, 4);
                        }
                    }
                    _tile_stored(0, cbuf[0], 64);
                    if (two) _tile_stored(1, cbuf[1], 64);
                    for (int h = 0; h <= two; h++) {
                        __m512i r[16];
                        for (int o = 0; o < 16; o++)
                            r[o] = _mm512_load_si512((const void *)(cbuf[h] + 16 * o));
                        transpose16(r);
                        const int64_t bb2 = b + h;
                        for (int64_t i = 0; i < 16 && 16 * bb2 + i < M; i++)
                            _mm256_mask_storeu_epi16(out + (16 * bb2 + i) * N + o0, keep,
                                                     bf16x16(_mm512_castsi512_ps(r[i])));
                    }
                }
            }
        _tile_release();
    }
    return 0;
}
#endif

/* Whether quant_gemm_bf16 runs here (built for AMX-BF16 and the OS lets this process use it). */
int quant_gemm_bf16_available(void) {
#if defined(QG_AMX) && defined(__AMX_BF16__)
    return amx_usable();
#else
    return 0;
#endif
}

/* out[M, N] (bf16) = x[M, K] (bf16) . bf16(dequant(w[N, row_bytes]))^T on AMX-BF16 tiles, each
 * output element's arithmetic the same whatever M or the threads (see gemm_bf16); 5 where
 * not built for AMX-BF16, 4 where the OS refuses it. */
int quant_gemm_bf16(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                    const void *x, int64_t M, void *out, int nthreads) {
#if defined(QG_AMX) && defined(__AMX_BF16__)
    return gemm_bf16(fmt, w, row_bytes, N, K, (const uint16_t *)x, M, (uint16_t *)out, nthreads);
#else
    (void)fmt, (void)w, (void)row_bytes, (void)N, (void)K, (void)x, (void)M, (void)out;
    (void)nthreads;
    return 5;
#endif
}

static int gemm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const void *x,
                int x_dtype, int64_t M, void *out, int nthreads, int portable, int packed) {
    (void)portable; /* unused in a build without SIMD paths */
    int bb = block_bytes(fmt);
    if (!bb || K % block_values(fmt) || row_bytes != K / block_values(fmt) * bb) return 1;
    if (packed && (!packable(fmt) || N % NR)) return 1;
    if ((x_dtype != F32 && x_dtype != BF16) || M < 1 || N < 1) return 2;
    QX qx;
    qx.K = K;
    qx.ng = K / group_values(fmt);
    /* 64 bytes of slack: AMX's x layout reads a last odd chunk's pair whole */
    size_t xq_bytes = ((size_t)(M * K) + 127) / 64 * 64, ngm = (size_t)(M * qx.ng);
    char *buf = (char *)aligned_alloc(64, xq_bytes + ngm * 12 + 64);
    if (!buf) return 3;
    qx.q = (int8_t *)buf;
    qx.d = (float *)(buf + xq_bytes);
    qx.s = qx.d + ngm;
    qx.o = (int32_t *)(qx.s + ngm);
    if (nthreads < 1) nthreads = 1;
    int64_t groups = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
#if defined(QG_AVX512)
        if (!portable) {
            quantize_row_avx512(fmt, x, x_dtype, m, &qx);
            continue;
        }
#elif defined(QG_AVX2)
        if (!portable) {
            quantize_row_avx2(fmt, x, x_dtype, m, &qx);
            continue;
        }
#endif
        quantize_row(fmt, x, x_dtype, m, &qx);
    }
    if (nthreads > groups) nthreads = (int)groups;
#if defined(QG_AVX512)
    if (packed && M == 1 && !portable && QG_GEMV) {
#pragma omp parallel num_threads(nthreads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
            DISPATCH_PACKED(fmt, gemv_packed, w, g0, g1, &qx, out, x_dtype);
        }
        free(buf);
        return 0;
    }
#endif
    /* A packed weight's groups unpacked to the file's rows, UNPACK_GROUPS at a time per
     * thread, for the paths without a packed variant (portable C, AVX2). */
    uint8_t *unpacked = NULL;
#if defined(QG_AVX512)
    if (packed && portable) {
#else
    if (packed) {
#endif
        unpacked = (uint8_t *)aligned_alloc(
            64, ((size_t)nthreads * UNPACK_GROUPS * NR * row_bytes + 63) / 64 * 64);
        if (!unpacked) {
            free(buf);
            return 3;
        }
    }
    /* A tile per thread: codes for whole pairs of chunks (the slack of an odd last chunk). */
    size_t tq = (size_t)((K / 32 + 1) / 2) * 64 * NR, ts = (size_t)qx.ng * NR * 4;
    char *tiles = (char *)aligned_alloc(64, (size_t)nthreads * (tq + 2 * ts));
    if (!tiles) {
        free(unpacked);
        free(buf);
        return 3;
    }
#if defined(QG_AMX)
    if (!portable && M >= AMX_ROWS && amx_usable()) {
        int rc = gemm_amx_all(fmt, w, row_bytes, N, &qx, M, out, x_dtype, nthreads, groups,
                              tiles, tq, ts, packed);
        free(unpacked);
        free(tiles);
        free(buf);
        return rc;
    }
#endif
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        char *mine = tiles + (size_t)t * (tq + 2 * ts);
        Tile tl = {(uint8_t *)mine, (float *)(mine + tq), (float *)(mine + tq + ts)};
        uint8_t *mine_u = unpacked ? unpacked + (size_t)t * UNPACK_GROUPS * NR * row_bytes : NULL;
        const int64_t step = unpacked ? UNPACK_GROUPS : (g1 > g0 ? g1 - g0 : 1);
        for (int64_t b0 = g0; b0 < g1; b0 += step) {
            const int64_t b1 = b0 + step < g1 ? b0 + step : g1;
            const uint8_t *wv = unpacked ? unpack_groups(fmt, w, row_bytes, K, b0, b1, mine_u) : w;
#if defined(QG_AVX512)
            if (!portable && packed) {
                DISPATCH_PACKED(fmt, gemm_avx512_packed, wv, row_bytes, b0, b1, N, &qx, M, out, x_dtype,
                         &tl)
            } else if (!portable) {
                DISPATCH(fmt, gemm_avx512, wv, row_bytes, b0, b1, N, &qx, M, out, x_dtype, &tl)
            } else
#elif defined(QG_AVX2)
            if (!portable) {
                DISPATCH(fmt, gemm_avx2, wv, row_bytes, b0, b1, N, &qx, M, out, x_dtype, &tl)
            } else
#endif
            {
                for (int64_t rg = b0; rg < b1; rg++) {
                    int64_t o0 = rg * NR, rows = N - o0 < NR ? N - o0 : NR;
                    tile_portable(fmt, wv, row_bytes, o0, rows, K, &tl);
                    dots_portable(fmt, &tl, &qx, 0, M, out, x_dtype, N, o0, rows);
                }
            }
        }
    }
    free(unpacked);
    free(tiles);
    free(buf);
    return 0;
}

/* out[M, N] (x's dtype) = x[M, K] . dequant(w[N, row_bytes])^T, x float32 (0) or bf16 (1). */
int quant_gemm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const void *x,
               int x_dtype, int64_t M, void *out, int nthreads) {
    return gemm(fmt, w, row_bytes, N, K, x, x_dtype, M, out, nthreads, 0, 0);
}

int quant_gemm_portable(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                        const void *x, int x_dtype, int64_t M, void *out, int nthreads) {
    return gemm(fmt, w, row_bytes, N, K, x, x_dtype, M, out, nthreads, 1, 0);
}

/* quant_gemm and quant_gemm_portable with a packed weight ``pk`` (see "packed weights"):
 * the same bits. */
int quant_gemm_packed(int fmt, const uint8_t *pk, int64_t row_bytes, int64_t N, int64_t K,
                      const void *x, int x_dtype, int64_t M, void *out, int nthreads) {
    return gemm(fmt, pk, row_bytes, N, K, x, x_dtype, M, out, nthreads, 0, 1);
}

int quant_gemm_packed_portable(int fmt, const uint8_t *pk, int64_t row_bytes, int64_t N,
                               int64_t K, const void *x, int x_dtype, int64_t M, void *out,
                               int nthreads) {
    return gemm(fmt, pk, row_bytes, N, K, x, x_dtype, M, out, nthreads, 1, 1);
}

/* Whether a weight of this format and N rows is worth packing (``quant_pack``): only where
 * this build has the packed SIMD paths (AVX512-VNNI; elsewhere every product would unpack). */
int quant_packable(int fmt, int64_t N) {
#if defined(QG_AVX512)
    return packable(fmt) && N % NR == 0 && N > 0;
#else
    (void)fmt;
    (void)N;
    return 0;
#endif
}

/* w [N, row_bytes] (the file's rows) packed into out (N * row_bytes bytes). */
int quant_pack(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, uint8_t *out) {
    int bb = block_bytes(fmt);
    if (!packable(fmt) || N % NR || K % 32 || row_bytes != K / 32 * bb) return 1;
    for (int64_t rg = 0; rg < N / NR; rg++) pack_rows(fmt, w, row_bytes, rg, K, out);
    return 0;
}

/* Rows idx[0..n-1] of a packed weight (N rows), as the file stores them, into out [n,
 * row_bytes]; idx NULL: rows first..first+n-1. */
int quant_unpack(int fmt, const uint8_t *pk, int64_t row_bytes, int64_t N, int64_t K,
                 const int64_t *idx, int64_t first, int64_t n, uint8_t *out) {
    int bb = block_bytes(fmt);
    if (!packable(fmt) || N % NR || K % 32 || row_bytes != K / 32 * bb) return 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t o = idx ? idx[i] : first + i;
        if (o < 0 || o >= N) return 2;
    }
    unpack_rows(fmt, pk, row_bytes, K, idx, first, n, out);
    return 0;
}

/* Whether quant_gemm multiplies AMX_ROWS or more x rows with AMX-INT8 tiles (built for them,
 * and the OS lets this process use them). */
int quant_gemm_amx(void) {
#if defined(QG_AMX)
    return amx_usable();
#else
    return 0;
#endif
}

/* Which decode path quant_gemm runs: 2 AVX512-VNNI, 3 AVX2 with AVX-VNNI's 256-bit vpdpbusd,
 * 1 AVX2 (vpmaddubsw), 0 portable C. */
int quant_gemm_simd(void) {
#if defined(QG_AVX512)
    return 2;
#elif defined(QG_AVX2) && defined(QG_AVX2_VNNI)
    return 3;
#elif defined(QG_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* One block of 32 or 256 values, exactly as gguf-py computes them in float32. */
static void dequant_block(int fmt, const uint8_t *b, float *v) {
    switch (fmt) {
    case Q4_0: {
        float d = f16(b);
        for (int i = 0; i < 16; i++) {
            v[i] = ((float)(b[2 + i] & 0x0f) - 8.0f) * d;
            v[i + 16] = ((float)(b[2 + i] >> 4) - 8.0f) * d;
        }
        break;
    }
    case Q4_1: {
        float d = f16(b), m = f16(b + 2);
        for (int i = 0; i < 16; i++) {
            v[i] = (float)(b[4 + i] & 0x0f) * d + m;
            v[i + 16] = (float)(b[4 + i] >> 4) * d + m;
        }
        break;
    }
    case Q5_0:
    case Q5_1: {
        int one = fmt == Q5_1;
        float d = f16(b), m = one ? f16(b + 2) : 0.0f;
        uint32_t hb = rd32(b + (one ? 4 : 2));
        const uint8_t *nib = b + (one ? 8 : 6);
        for (int i = 0; i < 32; i++) {
            int q = (i < 16 ? nib[i] & 0x0f : nib[i - 16] >> 4) | (((hb >> i) & 1) << 4);
            v[i] = one ? (float)q * d + m : ((float)q - 16.0f) * d;
        }
        break;
    }
    case Q8_0: {
        float d = f16(b);
        for (int i = 0; i < 32; i++) v[i] = (float)(int8_t)b[2 + i] * d;
        break;
    }
    case Q4_K:
    case Q5_K: {
        float d = f16(b), dmin = f16(b + 2);
        const uint8_t *nib = b + (fmt == Q4_K ? 16 : 48);
        for (int s = 0; s < 8; s++) {
            int isc, imn;
            k_scale_min(b + 4, s, &isc, &imn);
            float ds = d * (float)isc, dm = dmin * (float)imn;
            for (int l = 0; l < 32; l++) {
                int q = (nib[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f;
                if (fmt == Q5_K) q |= ((b[16 + l] >> s) & 1) << 4;
                v[32 * s + l] = ds * (float)q - dm;
            }
        }
        break;
    }
    case Q6_K: {
        float d = f16(b + 208);
        for (int i = 0; i < 256; i++) {
            int half = i / 128, k = i % 128;
            int lo = (b[64 * half + k % 64] >> (4 * (k / 64))) & 0x0f;
            int hi = (b[128 + 32 * half + k % 32] >> (2 * (k / 32))) & 3;
            v[i] = (d * (float)(int8_t)b[192 + i / 16]) * (float)((lo | (hi << 4)) - 32);
        }
        break;
    }
    }
}

/* Rows [0, N) of w dequantized into out [N, K] as float32 (0) or bf16 (1). */
static int dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, void *out,
                   int out_dtype, int nthreads, int portable) {
    (void)portable;
    int bb = block_bytes(fmt), bv = block_values(fmt);
    if (!bb || K % bv || row_bytes != K / bv * bb) return 1;
    if (out_dtype != F32 && out_dtype != BF16) return 2;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > N) nthreads = (int)N;
#ifdef QG_AVX512
    if (!portable) {
#pragma omp parallel num_threads(nthreads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int64_t o0 = N * t / nt, o1 = N * (t + 1) / nt;
            DISPATCH(fmt, dequant_avx512, w, row_bytes, o0, o1, K, out, out_dtype)
        }
        return 0;
    }
#elif defined(QG_AVX2)
    if (!portable) {
#pragma omp parallel num_threads(nthreads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int64_t o0 = N * t / nt, o1 = N * (t + 1) / nt;
            DISPATCH(fmt, dequant_avx2, w, row_bytes, o0, o1, K, out, out_dtype)
        }
        return 0;
    }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < N; o++) {
        float v[256];
        for (int64_t blk = 0; blk < K / bv; blk++) {
            dequant_block(fmt, w + o * row_bytes + blk * bb, v);
            int64_t at = o * K + blk * bv;
            if (out_dtype == F32)
                memcpy((float *)out + at, v, (size_t)bv * 4);
            else
                for (int i = 0; i < bv; i++) ((uint16_t *)out)[at + i] = to_bf16(v[i]);
        }
    }
    return 0;
}

int quant_dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, void *out,
                  int out_dtype, int nthreads) {
    return dequant(fmt, w, row_bytes, N, K, out, out_dtype, nthreads, 0);
}

int quant_dequant_portable(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                           void *out, int out_dtype, int nthreads) {
    return dequant(fmt, w, row_bytes, N, K, out, out_dtype, nthreads, 1);
}

/* ---------------------------------------------------------------- float decode rows */
/* quant_gemm_f32: out[M, N] = x[M, K] . W[N, K]^T with W's values dequantized exactly as
 * quant_dequant does (gguf-py's float32 arithmetic: the same products d * q, then + m), rounded
 * to bf16 when x is bf16 (the weight in x's dtype, as the prefill path multiplies it), times x
 * in float32 (bf16 x widened, exactly), accumulated in float32, the result in x's dtype. No
 * activation quantization: it differs from a float matmul of the dequantized weight only in
 * the order of the sums, so a row's result does not depend on how many rows share its step.
 * Each thread owns a contiguous range of output rows; a weight row is decoded once per tile of
 * up to FMAX activation rows (once per call for M <= FMAX). */
#define FMAX 8

static inline float round_bf16(float v) { return from_bf16(to_bf16(v)); }

/* Portable C (the compiler vectorizes the 16 running sums; -march=native gives AVX2 where
 * there is no AVX512). */
static void frows_portable(int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1,
                           int64_t K, const float *xf, int64_t M, void *out, int out_dtype,
                           int64_t N) {
    int bb = block_bytes(fmt), bv = block_values(fmt);
    float v[256];
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = w + o * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += FMAX) {
            int64_t mt = M - m0 < FMAX ? M - m0 : FMAX;
            float acc[FMAX][16];
            memset(acc, 0, sizeof acc);
            for (int64_t blk = 0; blk < K / bv; blk++) {
                dequant_block(fmt, row + blk * bb, v);
                if (out_dtype == BF16)
                    for (int j = 0; j < bv; j++) v[j] = round_bf16(v[j]);
                for (int64_t i = 0; i < mt; i++) {
                    const float *xr = xf + (m0 + i) * K + blk * bv;
                    for (int j0 = 0; j0 < bv; j0 += 16)
                        for (int l = 0; l < 16; l++) acc[i][l] += v[j0 + l] * xr[j0 + l];
                }
            }
            for (int64_t i = 0; i < mt; i++) {
                float s = 0.0f;
                for (int l = 0; l < 16; l++) s += acc[i][l];
                store(out, out_dtype, (m0 + i) * N + o, s);
            }
        }
    }
}

#ifdef QG_AVX512
/* Round to nearest even bf16 and widen back (the weights are finite: no NaN case). */
static inline __m512 round_bf16_ps(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Values 16 qi .. 16 qi + 15 of a decoded pair: ((q - OFF) * sc) [+ t], as dequant_avx512. */
static inline __attribute__((always_inline)) __m512 fquarter(const int fmt, const Pair *r,
                                                             const int qi, int bf) {
    const __m512i idx = _mm512_set_epi32(4 * qi + 3, 4 * qi + 3, 4 * qi + 3, 4 * qi + 3,
                                         4 * qi + 2, 4 * qi + 2, 4 * qi + 2, 4 * qi + 2,
                                         4 * qi + 1, 4 * qi + 1, 4 * qi + 1, 4 * qi + 1, 4 * qi,
                                         4 * qi, 4 * qi, 4 * qi);
    __m128i q16 = qi == 0   ? _mm512_extracti32x4_epi32(r->q, 0)
                  : qi == 1 ? _mm512_extracti32x4_epi32(r->q, 1)
                  : qi == 2 ? _mm512_extracti32x4_epi32(r->q, 2)
                            : _mm512_extracti32x4_epi32(r->q, 3);
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q16));
    if (fmt_off(fmt)) v = _mm512_sub_ps(v, _mm512_set1_ps((float)fmt_off(fmt)));
    v = _mm512_mul_ps(v, _mm512_permutexvar_ps(idx, r->sc));
    if (fmt_has_t(fmt)) v = _mm512_add_ps(v, _mm512_permutexvar_ps(idx, r->t));
    return bf ? round_bf16_ps(v) : v;
}

/* One weight row against MT activation rows (MT constant in each instance). Few rows get
 * several accumulators each (NA: one per quarter of a pair for one row), so the FMAs do not
 * wait on one another. */
static inline __attribute__((always_inline)) void frow_tile(const int fmt, const uint8_t *row,
                                                            int64_t chunks, int64_t K,
                                                            const float *x, const int MT,
                                                            int bf, float *res) {
    const int NA = MT == 1 ? 4 : MT <= 3 ? 2 : 1;
    __m512 acc[FMAX]; /* acc[i * NA + a]; MT * NA <= FMAX */
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++)
        for (int a = 0; a < NA; a++) acc[i * NA + a] = _mm512_setzero_ps();
    int64_t pairs = (chunks + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        Pair r = decode_avx512(fmt, row, p, chunks);
        const float *xp = x + 64 * p;
        __m512 v0 = fquarter(fmt, &r, 0, bf), v1 = fquarter(fmt, &r, 1, bf);
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            acc[i * NA] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xp + i * K), acc[i * NA]);
            acc[i * NA + 1 % NA] =
                _mm512_fmadd_ps(v1, _mm512_loadu_ps(xp + i * K + 16), acc[i * NA + 1 % NA]);
        }
        if (2 * p + 1 < chunks) {
            __m512 v2 = fquarter(fmt, &r, 2, bf), v3 = fquarter(fmt, &r, 3, bf);
#pragma GCC unroll 8
            for (int i = 0; i < MT; i++) {
                acc[i * NA + 2 % NA] =
                    _mm512_fmadd_ps(v2, _mm512_loadu_ps(xp + i * K + 32), acc[i * NA + 2 % NA]);
                acc[i * NA + 3 % NA] =
                    _mm512_fmadd_ps(v3, _mm512_loadu_ps(xp + i * K + 48), acc[i * NA + 3 % NA]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
        __m512 s = acc[i * NA];
        for (int a = 1; a < NA; a++) s = _mm512_add_ps(s, acc[i * NA + a]);
        res[i] = _mm512_reduce_add_ps(s);
    }
}

static inline __attribute__((always_inline)) void frows_avx512(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t K,
    const float *xf, int64_t M, void *out, int out_dtype, int64_t N) {
    int64_t chunks = K / 32;
    int bf = out_dtype == BF16;
    float res[FMAX];
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = w + o * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += FMAX) {
            int64_t mt = M - m0 < FMAX ? M - m0 : FMAX;
            const float *x = xf + m0 * K;
            switch (mt) {
            case 1: frow_tile(fmt, row, chunks, K, x, 1, bf, res); break;
            case 2: frow_tile(fmt, row, chunks, K, x, 2, bf, res); break;
            case 3: frow_tile(fmt, row, chunks, K, x, 3, bf, res); break;
            case 4: frow_tile(fmt, row, chunks, K, x, 4, bf, res); break;
            case 5: frow_tile(fmt, row, chunks, K, x, 5, bf, res); break;
            case 6: frow_tile(fmt, row, chunks, K, x, 6, bf, res); break;
            case 7: frow_tile(fmt, row, chunks, K, x, 7, bf, res); break;
            default: frow_tile(fmt, row, chunks, K, x, 8, bf, res);
            }
            for (int64_t i = 0; i < mt; i++) store(out, out_dtype, (m0 + i) * N + o, res[i]);
        }
    }
}

#define PER_FORMAT_F(F)                                                                        \
    static void frows_avx512_##F(const uint8_t *w, int64_t rb, int64_t o0, int64_t o1,         \
                                 int64_t K, const float *xf, int64_t M, void *out, int dt,     \
                                 int64_t N) {                                                  \
        frows_avx512(F, w, rb, o0, o1, K, xf, M, out, dt, N);                                  \
    }
PER_FORMAT_F(Q4_0)
PER_FORMAT_F(Q4_1)
PER_FORMAT_F(Q5_0)
PER_FORMAT_F(Q5_1)
PER_FORMAT_F(Q8_0)
PER_FORMAT_F(Q4_K)
PER_FORMAT_F(Q5_K)
PER_FORMAT_F(Q6_K)
#endif

#ifdef QG_AVX2
/* frows_portable with AVX2, bit for bit: each chunk's values as quant_dequant computes them
 * (rounded to bf16 for bf16 x), the same 16 running sums per x row (values 0-7 and 16-23 of
 * a chunk into the low 8, 8-15 and 24-31 into the high 8, in order), products and sums
 * rounded apart (no FMA: the portable path is built without contraction), then the same
 * sequential sum of the 16. A weight row is decoded once per FMAX x rows (16 accumulators
 * for 8 rows: some live in L1, cheaper than decoding the row twice). */
static inline __attribute__((always_inline)) void frow_tile_avx2(const int fmt,
                                                                 const uint8_t *row, int64_t K,
                                                                 const float *x, const int MT,
                                                                 int bf, float *res) {
    __m256 lo[FMAX], hi[FMAX];
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K / 32; c++) {
        __m256 v[4];
        fchunk_avx2(fmt, row, c, v);
        if (bf)
            for (int k = 0; k < 4; k++) v[k] = round_bf16_avx2(v[k]);
        const float *xp = x + 32 * c;
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            lo[i] = _mm256_add_ps(lo[i], _mm256_mul_ps(v[0], _mm256_loadu_ps(xp + i * K)));
            hi[i] = _mm256_add_ps(hi[i], _mm256_mul_ps(v[1], _mm256_loadu_ps(xp + i * K + 8)));
            lo[i] = _mm256_add_ps(lo[i], _mm256_mul_ps(v[2], _mm256_loadu_ps(xp + i * K + 16)));
            hi[i] = _mm256_add_ps(hi[i], _mm256_mul_ps(v[3], _mm256_loadu_ps(xp + i * K + 24)));
        }
    }
    float lanes[16];
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
        _mm256_storeu_ps(lanes, lo[i]);
        _mm256_storeu_ps(lanes + 8, hi[i]);
        float s = 0.0f;
        for (int l = 0; l < 16; l++) s += lanes[l];
        res[i] = s;
    }
}

static inline __attribute__((always_inline)) void frows_avx2(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t K,
    const float *xf, int64_t M, void *out, int out_dtype, int64_t N) {
    const int bf = out_dtype == BF16;
    float res[FMAX];
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = w + o * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += FMAX) {
            const int64_t mt = M - m0 < FMAX ? M - m0 : FMAX;
            const float *x = xf + m0 * K;
            switch (mt) {
            case 1: frow_tile_avx2(fmt, row, K, x, 1, bf, res); break;
            case 2: frow_tile_avx2(fmt, row, K, x, 2, bf, res); break;
            case 3: frow_tile_avx2(fmt, row, K, x, 3, bf, res); break;
            case 4: frow_tile_avx2(fmt, row, K, x, 4, bf, res); break;
            case 5: frow_tile_avx2(fmt, row, K, x, 5, bf, res); break;
            case 6: frow_tile_avx2(fmt, row, K, x, 6, bf, res); break;
            case 7: frow_tile_avx2(fmt, row, K, x, 7, bf, res); break;
            default: frow_tile_avx2(fmt, row, K, x, FMAX, bf, res);
            }
            for (int64_t i = 0; i < mt; i++) store(out, out_dtype, (m0 + i) * N + o, res[i]);
        }
    }
}

#define PER_FORMAT_F_AVX2(F)                                                                   \
    static void frows_avx2_##F(const uint8_t *w, int64_t rb, int64_t o0, int64_t o1, int64_t K, \
                               const float *xf, int64_t M, void *out, int dt, int64_t N) {     \
        frows_avx2(F, w, rb, o0, o1, K, xf, M, out, dt, N);                                    \
    }
PER_FORMAT_F_AVX2(Q4_0)
PER_FORMAT_F_AVX2(Q4_1)
PER_FORMAT_F_AVX2(Q5_0)
PER_FORMAT_F_AVX2(Q5_1)
PER_FORMAT_F_AVX2(Q8_0)
PER_FORMAT_F_AVX2(Q4_K)
PER_FORMAT_F_AVX2(Q5_K)
PER_FORMAT_F_AVX2(Q6_K)
#endif

static int gemm_f32(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                    const void *x, int x_dtype, int64_t M, void *out, int nthreads, int portable) {
    (void)portable;
    int bb = block_bytes(fmt);
    if (!bb || K % block_values(fmt) || row_bytes != K / block_values(fmt) * bb) return 1;
    if ((x_dtype != F32 && x_dtype != BF16) || M < 1 || N < 1) return 2;
    const float *xf = (const float *)x;
    float *buf = NULL;
    if (x_dtype == BF16) { /* widened once: exact */
        buf = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!buf) return 3;
        for (int64_t i = 0; i < M * K; i++) buf[i] = from_bf16(((const uint16_t *)x)[i]);
        xf = buf;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > N) nthreads = (int)N;
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t o0 = N * t / nt, o1 = N * (t + 1) / nt;
#ifdef QG_AVX512
        if (!portable) {
            DISPATCH(fmt, frows_avx512, w, row_bytes, o0, o1, K, xf, M, out, x_dtype, N)
        } else
#elif defined(QG_AVX2)
        if (!portable) {
            DISPATCH(fmt, frows_avx2, w, row_bytes, o0, o1, K, xf, M, out, x_dtype, N)
        } else
#endif
            frows_portable(fmt, w, row_bytes, o0, o1, K, xf, M, out, x_dtype, N);
    }
    free(buf);
    return 0;
}

/* out[M, N] (x's dtype) = x[M, K] . dequant(w[N, row_bytes])^T in float arithmetic. */
int quant_gemm_f32(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                   const void *x, int x_dtype, int64_t M, void *out, int nthreads) {
    return gemm_f32(fmt, w, row_bytes, N, K, x, x_dtype, M, out, nthreads, 0);
}

int quant_gemm_f32_portable(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                            const void *x, int x_dtype, int64_t M, void *out, int nthreads) {
    return gemm_f32(fmt, w, row_bytes, N, K, x, x_dtype, M, out, nthreads, 1);
}
