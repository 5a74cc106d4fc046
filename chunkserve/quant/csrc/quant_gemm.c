/* Products with GGML block-quantized weights (chunkserve/quant/kernels.py builds this file).
 *
 * Decode rows (quant_gemm): out[M, N] = x[M, K] . W[N, K]^T for small M, bound by reading W.
 * The activations are quantized first, per row and per 32 values, to int8 with a float scale
 * (dx = max|x| / 127, round to nearest even). Every weight format is then seen the same way,
 * two 32-value chunks ("a pair") at a time, as
 *
 *     64 unsigned 8-bit codes q, and per 4 consecutive values ("a lane", 16 lanes) a float
 *     scale sc and a float offset mn, so that  w = sc * q + mn  for each value,
 *
 * e.g. Q4_0: q = nibble, sc = d, mn = -8 d; Q8_0: q = int8 ^ 0x80, sc = d, mn = -128 d;
 * Q4_K: sc = d * scale[s], mn = -dmin * min[s]; Q6_K: sc = d * scale[j], mn = -32 sc. Then
 *
 *     sum_values w * x  =  sum_lanes  sc * dx * (sum_4 q * qx)  +  mn * (dx * sum_4 qx)
 *
 * where the integer sums are one VNNI instruction (vpdpbusd: u8 x s8 -> s32 per lane) for a
 * pair, and dx and dx * sum_4 qx are per-lane vectors precomputed once per activation row.
 * The weight is read once per call: each thread owns a contiguous range of output rows, and
 * a row's pair is decoded once and dotted with up to 16 activation rows held in registers.
 * The error is that of the int8 activations (as llama.cpp's q8 path): ~0.5% relative.
 *
 * Prefill rows (quant_dequant): rows of W dequantized to float32 or bfloat16 with gguf-py's
 * exact float32 arithmetic (this file is built with -ffp-contract=off and no fast-math), for
 * a float matmul in torch.
 *
 * Paths: AVX512-VNNI + AVX512BW (+VL) intrinsics where the compiler targets them (built with
 * -march=native), else AVX2 + FMA (the portable decoding, 256-bit integer dots), else
 * portable C (vectorized by the compiler where it can). The portable path is also exported
 * as quant_gemm_portable; tests run all three (AVX2 in a build with -mno-avx512f).
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
#elif defined(__AVX2__) && defined(__FMA__)
#define QG_AVX2 1
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { F32 = 0, BF16 = 1 };
#define MAX_ROWS 16 /* activation rows dotted per pass over a weight row */


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

/* ---------------------------------------------------------------- activation quantization */
/* Row m of x -> per pair p: xq[64] int8, xd[16] (dx per lane), xs[16] (dx * sum of the lane's
 * 4 codes), xo[16] (-off * sum of the lane's codes). A pair's second chunk past the row's end
 * is zeros. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *o; /* -OFF * the lane's sum of codes (see Pair) */
    int64_t pairs;
} QX;

static void quantize_row(const void *x, int dtype, int64_t K, int64_t m, int off, const QX *qx) {
    int64_t chunks = K / 32;
    int8_t *q = qx->q + m * qx->pairs * 64;
    float *d = qx->d + m * qx->pairs * 16, *s = qx->s + m * qx->pairs * 16;
    int32_t *o = qx->o + m * qx->pairs * 16;
    float v[32];
    for (int64_t c = 0; c < 2 * qx->pairs; c++) {
        int8_t *qc = q + 32 * c;
        float *dc = d + 16 * (c / 2) + 8 * (c % 2), *sc = s + 16 * (c / 2) + 8 * (c % 2);
        int32_t *oc = o + 16 * (c / 2) + 8 * (c % 2);
        if (c >= chunks) {
            memset(qc, 0, 32);
            for (int j = 0; j < 8; j++) dc[j] = sc[j] = 0.0f, oc[j] = 0;
            continue;
        }
        if (dtype == F32) {
            memcpy(v, (const float *)x + m * K + 32 * c, sizeof v);
        } else {
            const uint16_t *xb = (const uint16_t *)x + m * K + 32 * c;
            for (int i = 0; i < 32; i++) v[i] = from_bf16(xb[i]);
        }
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; i++) qc[i] = (int8_t)nearbyintf(v[i] * inv);
        for (int j = 0; j < 8; j++) {
            int sum = qc[4 * j] + qc[4 * j + 1] + qc[4 * j + 2] + qc[4 * j + 3];
            dc[j] = dx;
            sc[j] = dx * (float)sum;
            oc[j] = -off * sum;
        }
    }
}

/* ---------------------------------------------------------------- portable pair decoding */
/* Pair p (chunks 2p, 2p + 1) of a weight row -> q[64], sc[16], mn[16]; `chunks`: the row's
 * number of 32-value chunks (an odd count leaves the last pair half zero). */
static void decode_pair(int fmt, const uint8_t *row, int64_t p, int64_t chunks, uint8_t *q,
                        float *sc, float *mn) {
    for (int h = 0; h < 2; h++) {
        int64_t c = 2 * p + h;
        uint8_t *qh = q + 32 * h;
        float *sh = sc + 8 * h, *mh = mn + 8 * h;
        float s = 0.0f, m = 0.0f;
        if (c >= chunks) {
            memset(qh, 0, 32);
            for (int j = 0; j < 8; j++) sh[j] = mh[j] = 0.0f;
            continue;
        }
        if (fmt < Q4_K) {
            const uint8_t *b = row + c * block_bytes(fmt);
            const uint8_t *nib = b + (fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : fmt == Q5_0 ? 6 : 8);
            s = f16(b);
            if (fmt == Q8_0) {
                for (int i = 0; i < 32; i++) qh[i] = b[2 + i] ^ 0x80;
                m = -128.0f * s;
            } else {
                for (int i = 0; i < 16; i++) {
                    qh[i] = nib[i] & 0x0f;
                    qh[i + 16] = nib[i] >> 4;
                }
                if (fmt == Q5_0 || fmt == Q5_1) {
                    uint32_t hb = rd32(b + (fmt == Q5_0 ? 2 : 4));
                    for (int i = 0; i < 32; i++) qh[i] |= ((hb >> i) & 1) << 4;
                }
                m = fmt == Q4_0 ? -8.0f * s : fmt == Q5_0 ? -16.0f * s : f16(b + 2);
            }
            for (int j = 0; j < 8; j++) {
                sh[j] = s;
                mh[j] = m;
            }
        } else if (fmt == Q4_K || fmt == Q5_K) {
            const uint8_t *b = row + (c / 8) * block_bytes(fmt);
            int sub = (int)(c % 8), isc, imn;
            k_scale_min(b + 4, sub, &isc, &imn);
            const uint8_t *nib = b + (fmt == Q4_K ? 16 : 48) + 32 * (sub / 2);
            for (int i = 0; i < 32; i++) qh[i] = (nib[i] >> (4 * (sub % 2))) & 0x0f;
            if (fmt == Q5_K)
                for (int i = 0; i < 32; i++) qh[i] |= ((b[16 + i] >> sub) & 1) << 4;
            s = f16(b) * (float)isc;
            m = -f16(b + 2) * (float)imn;
            for (int j = 0; j < 8; j++) {
                sh[j] = s;
                mh[j] = m;
            }
        } else { /* Q6_K */
            const uint8_t *b = row + (c / 8) * 210;
            int cc = (int)(c % 8), half = cc / 4, k = cc % 4;
            const uint8_t *ql = b + 64 * half + 32 * (k % 2), *hi = b + 128 + 32 * half;
            for (int i = 0; i < 32; i++)
                qh[i] = ((ql[i] >> (4 * (k / 2))) & 0x0f) | (((hi[i] >> (2 * k)) & 3) << 4);
            float d = f16(b + 208);
            for (int j = 0; j < 8; j++) {
                sh[j] = d * (float)(int8_t)b[192 + 2 * cc + j / 4];
                mh[j] = -32.0f * sh[j];
            }
        }
    }
}

static void store(void *out, int dtype, int64_t i, float v) {
    if (dtype == F32)
        ((float *)out)[i] = v;
    else
        ((uint16_t *)out)[i] = to_bf16(v);
}

static void rows_portable(int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1,
                          int64_t K, const QX *qx, int64_t M, void *out, int out_dtype, int64_t N) {
    int64_t chunks = K / 32;
    uint8_t q[64];
    float sc[16], mn[16];
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = w + o * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            int64_t mt = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            float acc[MAX_ROWS] = {0};
            for (int64_t p = 0; p < qx->pairs; p++) {
                decode_pair(fmt, row, p, chunks, q, sc, mn);
                for (int64_t i = 0; i < mt; i++) {
                    const int8_t *xq = qx->q + ((m0 + i) * qx->pairs + p) * 64;
                    const float *xd = qx->d + ((m0 + i) * qx->pairs + p) * 16;
                    const float *xs = qx->s + ((m0 + i) * qx->pairs + p) * 16;
                    float a = 0.0f;
                    for (int j = 0; j < 16; j++) {
                        int32_t dot = 0;
                        for (int t = 0; t < 4; t++) dot += (int32_t)q[4 * j + t] * xq[4 * j + t];
                        a += (float)dot * (sc[j] * xd[j]) + mn[j] * xs[j];
                    }
                    acc[i] += a;
                }
            }
            for (int64_t i = 0; i < mt; i++) store(out, out_dtype, (m0 + i) * N + o, acc[i]);
        }
    }
}

/* ---------------------------------------------------------------- AVX2 */
#ifdef QG_AVX2
/* The portable decoding, one 32-value chunk per 256-bit vector; u8 x s8 products summed in
 * pairs by vpmaddubsw (saturating at 16 bits: fine for codes up to 63, so Q8_0 multiplies its
 * signed int8 values directly, |q| * sign(x, q), and drops the -128 offset term). */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static void rows_avx2(int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1,
                      int64_t K, const QX *qx, int64_t M, void *out, int out_dtype, int64_t N) {
    int64_t chunks = K / 32;
    _Alignas(32) uint8_t q[64];
    _Alignas(32) float sc[16], mn[16];
    const int q8 = fmt == Q8_0;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = w + o * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t mt = M - m0 < 4 ? M - m0 : 4;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t p = 0; p < qx->pairs; p++) {
                decode_pair(fmt, row, p, chunks, q, sc, mn);
                for (int h = 0; h < 2; h++) {
                    __m256i vq = _mm256_load_si256((const __m256i *)(q + 32 * h));
                    __m256i sq = _mm256_xor_si256(vq, flip); /* Q8_0: the signed values */
                    __m256 vsc = _mm256_load_ps(sc + 8 * h), vmn = _mm256_load_ps(mn + 8 * h);
                    for (int64_t i = 0; i < mt; i++) {
                        int64_t at = (m0 + i) * qx->pairs + p;
                        __m256i xq = _mm256_loadu_si256((const __m256i *)(qx->q + at * 64 + 32 * h));
                        __m256i prod = q8 ? _mm256_maddubs_epi16(_mm256_sign_epi8(sq, sq),
                                                                 _mm256_sign_epi8(xq, sq))
                                          : _mm256_maddubs_epi16(vq, xq);
                        __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
                        __m256 xd = _mm256_loadu_ps(qx->d + at * 16 + 8 * h);
                        acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(vsc, xd), acc[i]);
                        if (!q8)
                            acc[i] = _mm256_fmadd_ps(vmn, _mm256_loadu_ps(qx->s + at * 16 + 8 * h),
                                                     acc[i]);
                    }
                }
            }
            for (int64_t i = 0; i < mt; i++) store(out, out_dtype, (m0 + i) * N + o, hsum256(acc[i]));
        }
    }
}
#endif

/* ---------------------------------------------------------------- AVX512-VNNI decoding */
#ifdef QG_AVX512
static const uint8_t ZERO_BLOCK[256] = {0}; /* stands in for the missing chunk of an odd row */

/* A pair seen as w = (q - OFF) * sc + t per lane: OFF a constant of the format (8 for Q4_0,
 * 16 Q5_0, 128 Q8_0, 32 Q6_K, else 0) and t present only for the formats with a min (Q4_1,
 * Q5_1, Q4_K, Q5_K). In the dot the OFF term is integer (the accumulator starts at
 * -OFF * the lane's sum of codes) and t costs one more FMA; dequantizing, it is gguf-py's
 * float32 arithmetic exactly. */
typedef struct {
    __m512i q;
    __m512 sc, t;
} Pair;

static inline __attribute__((always_inline)) int fmt_off(const int fmt) {
    return fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : fmt == Q8_0 ? 128 : fmt == Q6_K ? 32 : 0;
}

static inline __attribute__((always_inline)) int fmt_has_t(const int fmt) {
    return fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K;
}

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

/* G weight rows against MT activation rows (fmt, G and MT constants in each instance): each
 * pair of activation codes loaded once serves the G rows. */
static inline __attribute__((always_inline)) void rows_tile(const int fmt, const uint8_t *row,
                                                            int64_t row_bytes, const int G,
                                                            int64_t chunks, const QX *qx,
                                                            int64_t m0, const int MT, float *res) {
    __m512 acc[2][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < MT; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < qx->pairs; p++) {
        Pair w[2];
        for (int g = 0; g < G; g++) w[g] = decode_avx512(fmt, row + g * row_bytes, p, chunks);
        for (int i = 0; i < MT; i++) {
            int64_t at = (m0 + i) * qx->pairs + p;
            __m512i init = fmt_has_t(fmt) ? _mm512_setzero_si512()
                                          : _mm512_loadu_si512((const void *)(qx->o + at * 16));
            __m512i xq = _mm512_loadu_si512((const void *)(qx->q + at * 64));
            __m512 xd = _mm512_loadu_ps(qx->d + at * 16);
            __m512 xs = fmt_has_t(fmt) ? _mm512_loadu_ps(qx->s + at * 16) : _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                __m512i dot = _mm512_dpbusd_epi32(init, w[g].q, xq);
                acc[g][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w[g].sc, xd),
                                            acc[g][i]);
                if (fmt_has_t(fmt)) acc[g][i] = _mm512_fmadd_ps(w[g].t, xs, acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < MT; i++) res[g * 4 + i] = _mm512_reduce_add_ps(acc[g][i]);
}

/* Rows o0..o1-1 of the weight against all M activation rows: two weight rows at a time, in
 * activation tiles of 4, 2, 1 (a tile's codes, 32 KiB at K = 2048, stay in L1; wider tiles
 * spill registers or stream the codes from L2 once per weight row, measured 2-3x slower). */
static inline __attribute__((always_inline)) void rows_avx512(
    const int fmt, const uint8_t *w, int64_t row_bytes, int64_t o0, int64_t o1, int64_t K,
    const QX *qx, int64_t M, void *out, int out_dtype, int64_t N) {
    int64_t chunks = K / 32;
    float res[8];
    for (int64_t o = o0; o < o1;) {
        const uint8_t *row = w + o * row_bytes;
        int g = o + 1 < o1 ? 2 : 1;
        for (int64_t m0 = 0; m0 < M;) {
            int64_t left = M - m0;
            int mt = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (g == 2) {
                if (mt == 4) rows_tile(fmt, row, row_bytes, 2, chunks, qx, m0, 4, res);
                else if (mt == 2) rows_tile(fmt, row, row_bytes, 2, chunks, qx, m0, 2, res);
                else rows_tile(fmt, row, row_bytes, 2, chunks, qx, m0, 1, res);
            } else {
                if (mt == 4) rows_tile(fmt, row, row_bytes, 1, chunks, qx, m0, 4, res);
                else if (mt == 2) rows_tile(fmt, row, row_bytes, 1, chunks, qx, m0, 2, res);
                else rows_tile(fmt, row, row_bytes, 1, chunks, qx, m0, 1, res);
            }
            for (int r = 0; r < g; r++)
                for (int i = 0; i < mt; i++)
                    store(out, out_dtype, (m0 + i) * N + o + r, res[r * 4 + i]);
            m0 += mt;
        }
        o += g;
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
    static void rows_avx512_##F(const uint8_t *w, int64_t rb, int64_t o0, int64_t o1, int64_t K, \
                                const QX *qx, int64_t M, void *out, int dt, int64_t N) {         \
        rows_avx512(F, w, rb, o0, o1, K, qx, M, out, dt, N);                                   \
    }                                                                                          \
    static void dequant_avx512_##F(const uint8_t *w, int64_t rb, int64_t o0, int64_t o1,         \
                                   int64_t K, void *out, int dt) {                             \
        dequant_avx512(F, w, rb, o0, o1, K, out, dt);                                          \
    }
PER_FORMAT(Q4_0)
PER_FORMAT(Q4_1)
PER_FORMAT(Q5_0)
PER_FORMAT(Q5_1)
PER_FORMAT(Q8_0)
PER_FORMAT(Q4_K)
PER_FORMAT(Q5_K)
PER_FORMAT(Q6_K)

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
#endif

/* ---------------------------------------------------------------- entry points */
static int gemm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const void *x,
                int x_dtype, int64_t M, void *out, int nthreads, int portable) {
    (void)portable; /* unused in a build without SIMD paths */
    int bb = block_bytes(fmt);
    if (!bb || K % block_values(fmt) || row_bytes != K / block_values(fmt) * bb) return 1;
    if ((x_dtype != F32 && x_dtype != BF16) || M < 1 || N < 1) return 2;
    QX qx;
    qx.pairs = (K / 32 + 1) / 2;
    size_t n = (size_t)(M * qx.pairs);
    void *buf = aligned_alloc(64, n * 256);
    if (!buf) return 3;
    qx.q = (int8_t *)buf;
    qx.d = (float *)((char *)buf + n * 64);
    qx.s = (float *)((char *)buf + n * 128);
    qx.o = (int32_t *)((char *)buf + n * 192);
    int off = fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : fmt == Q8_0 ? 128 : fmt == Q6_K ? 32 : 0;
    for (int64_t m = 0; m < M; m++) quantize_row(x, x_dtype, K, m, off, &qx);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > N) nthreads = (int)N;
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t o0 = N * t / nt, o1 = N * (t + 1) / nt;
#if defined(QG_AVX512)
        if (!portable) {
            DISPATCH(fmt, rows_avx512, w, row_bytes, o0, o1, K, &qx, M, out, x_dtype, N)
        } else
#elif defined(QG_AVX2)
        if (!portable)
            rows_avx2(fmt, w, row_bytes, o0, o1, K, &qx, M, out, x_dtype, N);
        else
#endif
            rows_portable(fmt, w, row_bytes, o0, o1, K, &qx, M, out, x_dtype, N);
    }
    free(buf);
    return 0;
}

/* out[M, N] (x's dtype) = x[M, K] . dequant(w[N, row_bytes])^T, x float32 (0) or bf16 (1). */
int quant_gemm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const void *x,
               int x_dtype, int64_t M, void *out, int nthreads) {
    return gemm(fmt, w, row_bytes, N, K, x, x_dtype, M, out, nthreads, 0);
}

int quant_gemm_portable(int fmt, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K,
                        const void *x, int x_dtype, int64_t M, void *out, int nthreads) {
    return gemm(fmt, w, row_bytes, N, K, x, x_dtype, M, out, nthreads, 1);
}

/* Which decode path quant_gemm runs: 2 AVX512-VNNI, 1 AVX2, 0 portable C. */
int quant_gemm_simd(void) {
#if defined(QG_AVX512)
    return 2;
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
