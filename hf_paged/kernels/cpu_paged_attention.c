/* Paged attention on the CPU: reads K/V in place from a page pool through a page table.
 *
 * Semantics are those of hf_paged/kernels/reference.py (masking rules, sinks, softcap, page mass);
 * the Python side (cpu_paged_attention.py) checks shapes and fills a PagedArgs.
 *
 * Work item = (batch row, split): the Q queries of all Hq heads form R = Q * Hq rows; each slot's
 * K and V rows (all KV heads, contiguous in the pool) are read once, in page order, so that the
 * hardware prefetcher sees a sequential stream. A split covers a range of page-table entries;
 * it walks their slots in chunks of CHUNK slots (a chunk spans several entries when pages are smaller,
 * and part of one when they are larger): scores for the chunk, one rescale of the running (max, sum,
 * acc) per row, then the weighted sum of V. Slots that no row may attend are never read
 * into the result (they may hold garbage, even NaN). Splits write unnormalised partials that
 * `finalize` merges, adding the sink logit and the page mass (and, asked for, each row's log-sum-exp: a caller merges
 * attention over other tokens with it). Everything accumulates in fp32.
 * With `mass_output` (pages of one token) the page "mass" is how far the head's output would move if
 * the token were dropped, p / (1 - p) * |v - out| for its probability p: `add_page_mass` reads its value.
 *
 * Pool formats (hf_paged/kv_formats.py): float32, bfloat16, int8 (x = scale * code, a float16 scale per token
 * and head) and int4. int4 values: two codes a byte, then an int8 zero point, x = scale * (code - zero) with a
 * float16 scale per token and head, stored rotated (x R for a block-Hadamard R: the output is rotated back,
 * R R = I, in place by a fast Walsh-Hadamard transform). int4 keys: two codes a byte, x = low + step * code per
 * page, head and channel; a page's parameters [P, Hkv, D + D / 2] float16 hold the D float16 minima, then the
 * D float8 e4m3 steps as bytes (passed with a slot stride of 0, so a slot's "scales" are its page's). Quantized
 * rows are dequantized to fp32 as they are read, 16 lanes at a time (keys: once per slot and KV head, into a
 * row that the group's query heads share). int4 keys' parameters go into the queries once per page instead
 * (q . x = q . low + (q * step) . code, `page_query`), so a slot costs dot products with its bare codes; int4 codes
 * are read 32 at a time split by parity (`nibbles32`), the operands in the same order. int4 keys per token (the cold
 * pages of a two-tier layer in pages under 16 tokens): like int4 values, in groups of gcd(D, 16), stored rotated
 * (k_page_params = 0). int2 (FMT_I2): int4's layouts with four 2-bit codes a byte (element d at bits 2 (d % 4) of
 * byte d / 4, `code_at`), read 16 at a time in order (`codes16`: one 32-bit word shifted per lane).
 *
 * Two tiers (hf_paged/demotion.py, `ColdTier`): the pools are a layer's hot float pages, `cold` points at a copy of
 * the arguments whose pool fields hold its cold int8 / int4 pages, and table ids are page ids that hot_row /
 * cold_row map to a row of either. A work item walks its entries twice, in the same running (max, sum, acc): the
 * hot pages first, skipping cold ones like holes, then the cold ones, after rotating the query (q.k = (q R).(k R))
 * and the accumulator (sum p v R = (sum p v) R) into the cold basis when that format is rotated; `finalize`
 * rotates the output back. Nothing is copied at full precision: cold rows are dequantized as they are read.
 */
#include <float.h>
#include <math.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 32
#define MASKED (-1e30f) /* score of a slot a row may not attend: exp() of it minus any max is 0 */
#define LEAVE_OUT_FLOOR 1e-6f /* 1 - p below this (a token holding all the attention) counts as this */

#define DO_PRAGMA(x) _Pragma(#x)
/* Run CALL (which may use the item index ``i`` and its thread's scratch ``work`` of work_bytes) for items 0..n on
 * ``threads`` threads, dynamically scheduled; ``failed`` set (and no item run) when a scratch cannot be allocated. */
#define PARALLEL_ITEMS(threads, n, work_bytes, failed, CALL)                \
    DO_PRAGMA(omp parallel num_threads(threads)) {                          \
        float *work = aligned_alloc(64, ((work_bytes) + 63) / 64 * 64);     \
        if (work == NULL) {                                                 \
            DO_PRAGMA(omp atomic write)                                     \
            failed = 1;                                                     \
        }                                                                   \
        DO_PRAGMA(omp barrier)                                              \
        if (!failed) {                                                      \
            DO_PRAGMA(omp for schedule(dynamic))                            \
            for (int64_t i = 0; i < (n); i++) CALL;                         \
        }                                                                   \
        free(work);                                                         \
    }

enum { FMT_F32, FMT_BF16, FMT_I8, FMT_I4, FMT_I2 }; /* pool formats, one compiled entry point each; from FMT_I4 on:
                                                       * packed codes with int8 zero points (per token) */

typedef struct PagedArgs {
    const float *q;        /* [B, Hq, Q, D] fp32, strides q_stride */
    int64_t q_stride[4];
    const void *k, *v;     /* [P, S, Hkv, W] in format `format`, last stride 1; W = D, or D / 2 + groups for int4 */
    int64_t k_stride[3], v_stride[3];
    int64_t format;        /* FMT_*: what the pools hold */
    const uint16_t *k_scale, *v_scale; /* [P, S, Hkv, D / group] float16, last stride 1; NULL for float pools
                                        * (int4 keys: [P, S (stride 0), Hkv, D + D / 2], the page parameters) */
    int64_t ks_stride[3], vs_stride[3];
    int64_t k_group, v_group; /* elements per scale group */
    int64_t k_width, v_width; /* W of each pool */
    int64_t k_rotated, v_rotated; /* 1: the keys / values are stored rotated */
    const int64_t *table;  /* [B, N] page ids, -1 = skip */
    const int64_t *page_pos; /* [B, N] position of slot 0 */
    const int64_t *q_pos;  /* [B, Q] */
    int64_t B, Hq, Hkv, Q, D, S, N;
    float scale, softcap;  /* softcap 0 = none */
    int64_t window;        /* 0 = none */
    const uint8_t *mask;   /* [B|1, Hq|1, Q, M], stride 0 on broadcast dims; NULL = none */
    int64_t mask_stride[4];
    int64_t mask_offset, mask_len;
    int64_t mask_per_head; /* mask_stride[1] != 0 */
    const float *sinks;    /* [Hq] or NULL */
    float *out;            /* [B, Q, Hq, D] fp32 contiguous */
    float *page_mass;      /* [B, Hq, N] or NULL; [B, N] when mass_heads != 0 */
    int64_t mass_heads;    /* 0: per head; 1: the heads' mean; 2: the heads' max */
    int64_t mass_output;   /* 1 (S = 1 only): the output each token moves instead of its probability */
    int64_t splits;
    int64_t threads;
    float *partial;        /* set by run(): [B, splits, R, D + 2]: acc | max | sum, R = Q * Hq */
    float *entry_stats;    /* set by run() when page_mass: [B, R, N, 2]: max | sum of each entry */
    int64_t k_page_params; /* 1: int4 keys per channel within a page (page parameters); 0: per token in groups */
    /* Two tiers (hf_paged/demotion.py): table ids are page ids; hot_row[id] (its row in k/v, -1: none) and
     * cold_row[id] (its row in cold's pools) say where each page is; NULL for one pool read directly. */
    const int64_t *hot_row, *cold_row;
    const struct PagedArgs *cold; /* the cold pools: a copy of these args with the pool fields of its format */
    float *lse;            /* [B, Q, Hq] or NULL: each row's log-sum-exp of its scores (and sink); -inf: none */
} PagedArgs;

/* exp(x) for x <= 88, ~2 ulp; plain arithmetic so that loops over it vectorise. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

static inline float load_bf16(const uint16_t *p, int64_t i) {
    union { uint32_t u; float f; } x = { .u = (uint32_t)p[i] << 16 };
    return x.f;
}

/* float16 bits -> float (exact: every float16 is a float) */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    union { uint32_t u; float f; } x;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        const float f = (float)mantissa * 0x1p-24f;
        return sign ? -f : f;
    }
    x.u = sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
    return x.f;
#endif
}

/* float8 e4m3 bits -> float (exact; the steps of int4 keys are never negative or NaN) */
static inline float fp8_to_float(uint8_t b) {
    const uint32_t exponent = (b >> 3) & 15, mantissa = b & 7;
    union { uint32_t u; float f; } x = { .u = (exponent + 120) << 23 | mantissa << 20 }; /* 2^(e-7) * 1.m */
    const float f = exponent ? x.f : (float)mantissa * 0x1p-9f; /* subnormal: m * 2^-9 */
    return b & 0x80 ? -f : f;
}

/* Where one token's row of one KV head starts: its codes in the pool and its scales (element offsets). */
typedef struct {
    int64_t row, scales;
} Row;

/* Bytes of the packed codes of a row of D elements (int4: two a byte, int2: four), before its zero points. */
static inline int64_t code_bytes(int64_t D, int fmt) { return fmt == FMT_I2 ? D / 4 : D / 2; }

/* The code of element d of a packed (int4 / int2) row whose bytes start at ``row``. */
static inline __attribute__((always_inline)) float code_at(const uint8_t *row, int64_t d, int fmt) {
    return (float)(fmt == FMT_I2 ? (row[d / 4] >> (2 * (d % 4))) & 3 : d % 2 ? row[d / 2] >> 4 : row[d / 2] & 15);
}

/* The scale and the zero point (int4 / int2; 0 otherwise) of the group holding element d of a quantized row. */
static inline __attribute__((always_inline)) void group_of(const PagedArgs *a, int value, Row at, int64_t d,
                                                           int fmt, float *scale, float *zero) {
    const int64_t g = d / (value ? a->v_group : a->k_group);
    *scale = half_to_float((value ? a->v_scale : a->k_scale)[at.scales + g]);
    *zero = fmt >= FMT_I4 ? (float)((const int8_t *)(value ? a->v : a->k))[at.row + code_bytes(a->D, fmt) + g]
                          : 0.0f;
}

/* Element d of a row as fp32. */
static inline __attribute__((always_inline)) float load1(const PagedArgs *a, int value, Row at, int64_t d, int fmt) {
    const void *pool = value ? a->v : a->k;
    if (fmt == FMT_F32) return ((const float *)pool)[at.row + d];
    if (fmt == FMT_BF16) return load_bf16((const uint16_t *)pool, at.row + d);
    float scale, zero;
    if (fmt >= FMT_I4 && !value && a->k_page_params) { /* x = low + step * code, the page's parameters of channel d */
        const float step = fp8_to_float(((const uint8_t *)(a->k_scale + at.scales + a->D))[d]);
        return code_at((const uint8_t *)pool + at.row, d, fmt) * step + half_to_float(a->k_scale[at.scales + d]);
    }
    group_of(a, value, at, d, fmt, &scale, &zero);
    if (fmt == FMT_I8) return (float)((const int8_t *)pool)[at.row + d] * scale;
    return (code_at((const uint8_t *)pool + at.row, d, fmt) - zero) * scale;
}

/* x <- x R for the rotation of rotated formats (hf_paged/kv_formats.py `rotation`): blocks of the largest power of
 * two dividing D, each a Sylvester-Hadamard transform scaled to be orthogonal. */
static void rotate(float *x, int64_t D) {
    const int64_t block = D & -D;
    const float norm = 1.0f / sqrtf((float)block);
    for (int64_t b0 = 0; b0 < D; b0 += block) {
        for (int64_t h = 1; h < block; h *= 2)
            for (int64_t i = b0; i < b0 + block; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float u = x[j], v = x[j + h];
                    x[j] = u + v;
                    x[j + h] = u - v;
                }
        for (int64_t i = b0; i < b0 + block; i++) x[i] *= norm;
    }
}

/* The slots of one chunk: where each slot's K and V rows start in the pools (element offsets), the
 * position of its token, and the page-table entry it belongs to. */
typedef struct {
    int64_t C;
    int64_t k_off[CHUNK], v_off[CHUNK], ks_off[CHUNK], vs_off[CHUNK], pos[CHUNK], entry[CHUNK];
} Chunk;

/* The scales and zero points of a chunk's quantized key rows as floats, [CHUNK][Hkv][groups] each (converted once
 * per chunk, for the slots some row attends; the others' entries are stale and never read; none for int4 keys per
 * page). Values' are read by `add_values` as it needs them. */
typedef struct {
    float *k_scale, *k_zero;
    int64_t k_groups;
} ChunkScales;

/* Slot c's row of KV head kvh in the keys (value = 0) or the values (value = 1). */
static inline __attribute__((always_inline)) Row slot_row(const PagedArgs *a, const Chunk *ch, int64_t c, int64_t kvh,
                                                          int value) {
    return value ? (Row){ch->v_off[c] + kvh * a->v_stride[2], ch->vs_off[c] + kvh * a->vs_stride[2]}
                 : (Row){ch->k_off[c] + kvh * a->k_stride[2], ch->ks_off[c] + kvh * a->ks_stride[2]};
}

/* ok[c] = 1 iff query qi of head h in row b may attend the token of the chunk's slot c. */
static inline void allowed_slots(const PagedArgs *a, int64_t b, int64_t h, int64_t qi, const Chunk *ch,
                                 uint8_t *ok) {
    const int64_t qp = a->q_pos[b * a->Q + qi], C = ch->C;
    for (int64_t c = 0; c < C; c++) ok[c] = ch->pos[c] <= qp;
    if (a->window > 0)
        for (int64_t c = 0; c < C; c++) ok[c] &= qp - ch->pos[c] < a->window;
    if (a->mask) {
        const int64_t *ms = a->mask_stride;
        const uint8_t *row = a->mask + b * ms[0] + h * ms[1] + qi * ms[2];
        for (int64_t c = 0; c < C; c++) {
            int64_t mi = ch->pos[c] - a->mask_offset;
            ok[c] &= mi >= 0 && mi < a->mask_len && row[mi * ms[3]];
        }
    }
}

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
static const float ZEROS[CHUNK];

/* Elements d..d+15 of a float row as fp32 lanes (bf16 widened exactly). */
static inline __attribute__((always_inline)) v16 load16(const PagedArgs *a, int value, Row at, int64_t d, int fmt) {
    const void *pool = value ? a->v : a->k;
    v16 x;
    if (fmt == FMT_BF16) {
        u16x16 h;
        memcpy(&h, (const uint16_t *)pool + at.row + d, sizeof h);
        u32x16 w = __builtin_convertvector(h, u32x16) << 16;
        memcpy(&x, &w, sizeof x);
    } else {
        memcpy(&x, (const float *)pool + at.row + d, sizeof x);
    }
    return x;
}

/* The codes of elements d..d+15 of a quantized row as fp32 lanes (int8: -127..127; int4: 0..15; int2: 0..3), before
 * their group's zero point and scale. With AVX-512 one widening and one conversion each (gcc lowers the portable
 * vector conversions lane by lane); int2: the row's 32-bit word of the 16 codes in every lane, shifted by 2 i in
 * lane i. */
static inline __attribute__((always_inline)) v16 codes16(const PagedArgs *a, int value, Row at, int64_t d, int fmt) {
    const void *pool = value ? a->v : a->k;
    v16 x;
    if (fmt == FMT_I8) {
#if defined(__AVX512F__)
        const __m128i codes = _mm_loadu_si128((const void *)((const int8_t *)pool + at.row + d));
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
        memcpy(&x, &f, sizeof x);
#else
        i8x16 codes;
        memcpy(&codes, (const int8_t *)pool + at.row + d, sizeof codes);
        x = __builtin_convertvector(__builtin_convertvector(codes, i32x16), v16);
#endif
        return x;
    }
    if (fmt == FMT_I2) {
        const i32x16 shifts = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
        uint32_t word;
        memcpy(&word, (const uint8_t *)pool + at.row + d / 4, sizeof word);
        const u32x16 codes = ((u32x16){0} + word) >> (u32x16)shifts & 3;
        return __builtin_convertvector((i32x16)codes, v16);
    }
#if defined(__AVX512F__)
    const __m128i bytes = _mm_loadl_epi64((const void *)((const uint8_t *)pool + at.row + d / 2));
    const __m128i low = _mm_set1_epi8(15);
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
    memcpy(&x, &f, sizeof x);
#else
    u8x16 bytes = {0};
    memcpy(&bytes, (const uint8_t *)pool + at.row + d / 2, 8);
    const u8x16 interleave = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const u8x16 codes = __builtin_shuffle(bytes & 15, bytes >> 4, interleave);
    x = __builtin_convertvector(__builtin_convertvector(codes, i32x16), v16);
#endif
    return x;
}

/* The codes of 32 elements of an int4 row (its 16 bytes at ``bytes``) as fp32 lanes, split by parity: even[i] is
 * element 2i's (a low nibble), odd[i] element 2i + 1's (a high one). Sums over the 32 elements against operands in
 * the same order (`split_parity`) need no interleaving: one widening, one mask or shift and one conversion a vector. */
static inline __attribute__((always_inline)) void nibbles32(const uint8_t *bytes, v16 *even, v16 *odd) {
#if defined(__AVX512F__)
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)bytes));
    const __m512 e = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
    const __m512 o = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
    memcpy(even, &e, sizeof e);
    memcpy(odd, &o, sizeof o);
#else
    u8x16 b;
    memcpy(&b, bytes, sizeof b);
    *even = __builtin_convertvector(__builtin_convertvector(b & 15, i32x16), v16);
    *odd = __builtin_convertvector(__builtin_convertvector(b >> 4, i32x16), v16);
#endif
}

/* 32 consecutive elements (lo: 0..15, hi: 16..31) <-> split by parity (lo: the even ones, hi: the odd ones). */
static inline __attribute__((always_inline)) void split_parity(v16 *lo, v16 *hi) {
    const i32x16 even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16 e = __builtin_shuffle(*lo, *hi, even), o = __builtin_shuffle(*lo, *hi, even + 1);
    *lo = e, *hi = o;
}

static inline __attribute__((always_inline)) void merge_parity(v16 *lo, v16 *hi) {
    const i32x16 low = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const v16 l = __builtin_shuffle(*lo, *hi, low), h = __builtin_shuffle(*lo, *hi, low + 8);
    *lo = l, *hi = h;
}

/* acc[r] += p[r][c] * V[c] for the chunk's slots: for each KV head, blocks of NR rows (4, or the 3 left over: GQA
 * groups of 3 or 7 need no padding row) x NB * 16 lanes of acc stay in registers while the slots stream by (each V
 * row is read from memory once, then from L1).
 * Quantized rows (one group a row): pw = p * scale multiplies the codes, and sum(pw * zero) is taken off. int4 rows
 * are added 32 lanes at a time in `nibbles32`'s order: acc is split by parity for the chunk, merged back after. */
#define ADD_VALUES_BLOCK(NR, NB)                                                                          \
    for (; d0 + 16 * (NB) <= D; d0 += 16 * (NB)) {                                                        \
        const int split = fmt == FMT_I4 && (NB) % 2 == 0;                                                 \
        v16 t[NR][NB];                                                                                    \
        for (int j = 0; j < (NR); j++)                                                                    \
            for (int k = 0; k < (NB); k++) memcpy(&t[j][k], ar[j] + d0 + 16 * k, sizeof(v16));            \
        for (int j = 0; j < (NR) && split; j++)                                                           \
            for (int k = 0; k < (NB); k += 2) split_parity(&t[j][k], &t[j][k + 1]);                       \
        for (int64_t c = 0; c < C; c++) {                                                                 \
            if (!slot_used[c]) continue;                                                                  \
            const Row at = slot_row(a, ch, c, kvh, 1);                                                    \
            v16 v[NB];                                                                                    \
            for (int k = 0; k < (NB); k += 1 + split)                                                     \
                if (split)                                                                                \
                    nibbles32((const uint8_t *)a->v + at.row + (d0 + 16 * k) / 2, &v[k], &v[k + 1]);      \
                else                                                                                      \
                    v[k] = fmt >= FMT_I8 ? codes16(a, 1, at, d0 + 16 * k, fmt) : load16(a, 1, at, d0 + 16 * k, fmt); \
            for (int j = 0; j < (NR); j++) {                                                              \
                const float p = pw[j][c];                                                                 \
                for (int k = 0; k < (NB); k++) t[j][k] += p * v[k];                                       \
            }                                                                                             \
        }                                                                                                 \
        if (fmt >= FMT_I4)                                                                                \
            for (int j = 0; j < (NR); j++)                                                                \
                for (int k = 0; k < (NB); k++) t[j][k] -= zero_sum[j];                                    \
        for (int j = 0; j < (NR) && split; j++)                                                           \
            for (int k = 0; k < (NB); k += 2) merge_parity(&t[j][k], &t[j][k + 1]);                       \
        for (int j = 0; j < (NR); j++)                                                                    \
            for (int k = 0; k < (NB); k++) memcpy(ar[j] + d0 + 16 * k, &t[j][k], sizeof(v16));            \
    }

static inline __attribute__((always_inline)) void add_values(const PagedArgs *a, const Chunk *ch,
                                                              const uint8_t *slot_used, const float *score,
                                                              float *acc, int fmt) {
    const int64_t G = a->Hq / a->Hkv, Hq = a->Hq, D = a->D, rows = a->Q * G, C = ch->C;
    const int vector = fmt < FMT_I8 || a->v_group == D; /* quantized: one group a row, folded into the weights */
    float spare[4][D]; /* accumulators of the padding rows of a block */
    float weight[4][CHUNK], scale[CHUNK], zero[CHUNK]; /* the head's scales and zero points, 0 for unused slots */
    for (int64_t kvh = 0; kvh < a->Hkv; kvh++) {
        for (int64_t c = 0; c < C && fmt >= FMT_I8 && vector; c++) {
            scale[c] = zero[c] = 0.0f;
            if (slot_used[c]) group_of(a, 1, slot_row(a, ch, c, kvh, 1), 0, fmt, &scale[c], &zero[c]);
        }
        for (int64_t i0 = 0; i0 < rows; i0 += 4) {
            float *ar[4];
            const float *pr[4], *pw[4];
            float zero_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int j = 0; j < 4; j++) {
                const int64_t i = i0 + j, r = (i / G) * Hq + kvh * G + i % G; /* (query, head) row */
                ar[j] = i < rows ? acc + r * D : spare[j];
                pr[j] = pw[j] = i < rows ? score + r * CHUNK : ZEROS;
            }
            if (fmt >= FMT_I8 && vector)
                for (int j = 0; j < 4; j++) {
                    float zeros = 0.0f; /* in a register: a sum through zero_sum[j] waits on memory each slot */
#pragma omp simd reduction(+ : zeros)
                    for (int64_t c = 0; c < C; c++) {
                        weight[j][c] = pr[j][c] * scale[c];
                        zeros += weight[j][c] * zero[c];
                    }
                    zero_sum[j] = zeros;
                    pw[j] = weight[j];
                }
            int64_t d0 = 0;
            if (vector && rows - i0 == 3) {
                ADD_VALUES_BLOCK(3, 4)
                ADD_VALUES_BLOCK(3, 1)
            } else if (vector) {
                ADD_VALUES_BLOCK(4, 4)
                ADD_VALUES_BLOCK(4, 1)
            }
            for (int64_t c = 0; c < C; c++) /* head dims that are not a multiple of 16, smaller groups */
                if (slot_used[c])
                    for (int64_t d = d0; d < D; d++) {
                        const float v = load1(a, 1, slot_row(a, ch, c, kvh, 1), d, fmt);
                        for (int j = 0; j < 4; j++) ar[j][d] += pr[j][c] * v;
                    }
        }
    }
}

/* A key row as fp32: in place for fp32 pools, else converted into ``buffer`` (D floats). */
static inline __attribute__((always_inline)) const float *load_key_row(const PagedArgs *a, Row at, int fmt,
                                                                        float *buffer) {
    if (fmt == FMT_F32) return (const float *)a->k + at.row;
    for (int64_t d = 0; d < a->D; d++) buffer[d] = load1(a, 0, at, d, fmt);
    return buffer;
}

/* Prefetch the rows of every KV head of the keys' (value = 0) or values' (value = 1) slot whose first row
 * starts at element offset ``off`` (scales at ``scale_off``). */
static inline __attribute__((always_inline)) void prefetch_slot(const PagedArgs *a, int value, int64_t off,
                                                                int64_t scale_off, int fmt) {
    const int64_t elem = fmt == FMT_F32 ? 4 : fmt == FMT_BF16 ? 2 : 1;
    const int64_t head_stride = (value ? a->v_stride : a->k_stride)[2] * elem;
    const int64_t width = value ? a->v_width : a->k_width;
    const char *row = (const char *)(value ? a->v : a->k) + off * elem;
    for (int64_t h = 0; h < a->Hkv; h++)
        for (int64_t byte = 0; byte < width * elem; byte += 64) __builtin_prefetch(row + h * head_stride + byte);
    if (fmt >= FMT_I8) __builtin_prefetch((value ? a->v_scale : a->k_scale) + scale_off);
}

/* The prefetches made while the scores of the chunk ``ch``'s slot c are taken: its V rows when some row attends it
 * (add_values reads them head by head after the chunk's scores), and the K rows of slot c of the ``next`` chunk
 * (never more slots than ``ch``): spread over the scores' work, not in a burst that stalls it. */
static inline __attribute__((always_inline)) void prefetch_rows(const PagedArgs *a, const Chunk *ch, const Chunk *next,
                                                                int64_t c, int used, int fmt) {
    if (used) prefetch_slot(a, 1, ch->v_off[c], ch->vs_off[c], fmt);
    if (c < next->C) prefetch_slot(a, 0, next->k_off[c], next->ks_off[c], fmt);
}

/* Lane sums of x[0..15], in order: a transpose-and-add tree (in-lane shuffles first, then 128-bit
 * blocks), 45 vector operations for 16 dot products instead of a horizontal sum each. */
static inline __attribute__((always_inline)) v16 sum_lanes16(const v16 x[16]) {
    const i32x16 unpack_lo = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
    const i32x16 unpack_hi = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31};
    const i32x16 pairs_lo = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i32x16 pairs_hi = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i32x16 blocks_lo = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i32x16 blocks_hi = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i32x16 halves_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i32x16 halves_hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    v16 y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], unpack_lo) + __builtin_shuffle(x[2 * i], x[2 * i + 1], unpack_hi);
    for (int i = 0; i < 4; i++)
        z[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], pairs_lo) + __builtin_shuffle(y[2 * i], y[2 * i + 1], pairs_hi);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shuffle(z[2 * i], z[2 * i + 1], blocks_lo) + __builtin_shuffle(z[2 * i], z[2 * i + 1], blocks_hi);
    return __builtin_shuffle(w[0], w[1], halves_lo) + __builtin_shuffle(w[0], w[1], halves_hi);
}

/* score[r][c] = scale * q[r] . K[slot c] (softcapped), or MASKED where row r may not attend slot c. */
static inline __attribute__((always_inline)) void store_scores(const PagedArgs *a, int64_t r, int64_t c0, int64_t n,
                                                                const float *dots, const uint8_t *allowed,
                                                                float *score) {
    for (int64_t j = 0; j < n; j++) {
        float x = dots[j] * a->scale;
        if (a->softcap > 0.0f) x = a->softcap * tanhf(x / a->softcap);
        score[r * CHUNK + c0 + j] = allowed[r * CHUNK + c0 + j] ? x : MASKED;
    }
}

/* The queries against int4 (int2) keys' page whose parameters start at element offset ``off`` of k_scale: with
 * x = low + step * code per channel, q . x = q . low + (q * step) . code, so row r's page_q[r] = q[r] * step (int4:
 * its full blocks of 32 channels split by parity, `nibbles32`'s order, a last block of 16 in order; int2: in order),
 * and page_base[r] = q[r] . low; *page_at = off. */
static inline void page_query(const PagedArgs *a, int64_t off, const float *q, float *page_q, float *page_base,
                              int64_t *page_at, int fmt) {
    const int64_t G = a->Hq / a->Hkv, Hq = a->Hq, D = a->D; /* a multiple of 16 */
    float step[D], low[D];
    for (int64_t kvh = 0; kvh < a->Hkv; kvh++) {
        const uint16_t *row = a->k_scale + off + kvh * a->ks_stride[2];
        const uint8_t *steps = (const uint8_t *)(row + D);
        for (int64_t d = 0; d < D; d += 16) { /* fp8_to_float, 16 lanes at a time (steps are never negative) */
            u8x16 b8;
            memcpy(&b8, steps + d, sizeof b8);
#if defined(__AVX512F__)
            const __m512i wide = _mm512_cvtepu8_epi32((__m128i)b8);
            i32x16 b;
            memcpy(&b, &wide, sizeof b);
#else
            const i32x16 b = __builtin_convertvector(b8, i32x16);
#endif
            const i32x16 exponent = (b >> 3) & 15, mantissa = b & 7;
            const i32x16 normal = (exponent + 120) << 23 | mantissa << 20, normal_of = exponent != 0;
            const v16 sub = __builtin_convertvector(mantissa, v16) * 0x1p-9f;
            i32x16 sub_bits, bits;
            memcpy(&sub_bits, &sub, sizeof sub_bits);
            bits = (normal & normal_of) | (sub_bits & ~normal_of);
            memcpy(step + d, &bits, sizeof bits);
        }
        int64_t d = 0;
#if defined(__F16C__)
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(low + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + d))));
#endif
        for (; d < D; d++) low[d] = half_to_float(row[d]);
        v16 x[D / 16], y[D / 16]; /* steps, then queries, in page_q's order */
        memcpy(x, step, sizeof x);
        for (d = 0; d + 32 <= D && fmt == FMT_I4; d += 32) split_parity(&x[d / 16], &x[d / 16 + 1]);
        for (int64_t qi = 0; qi < a->Q; qi++)
            for (int64_t r = qi * Hq + kvh * G; r < qi * Hq + (kvh + 1) * G; r++) {
                v16 base = {0}, l;
                memcpy(y, q + r * D, sizeof y);
                for (int64_t b = 0; b < D / 16; b++) {
                    memcpy(&l, low + 16 * b, sizeof l);
                    base += y[b] * l;
                }
                float sum = 0.0f;
                for (int e = 0; e < 16; e++) sum += base[e];
                page_base[r] = sum;
                for (d = 0; d + 32 <= D && fmt == FMT_I4; d += 32) split_parity(&y[d / 16], &y[d / 16 + 1]);
                for (int64_t b = 0; b < D / 16; b++) y[b] *= x[b];
                memcpy(page_q + r * D, y, sizeof y);
            }
    }
    *page_at = off;
}

/* partial[r * 16] = q[r] . key (lanes to sum; int8: times ``after``, the row's scale) for the query rows r of KV head
 * kvh, ``key`` a row of `blocks` 16-lane blocks (D = 16 * blocks) held in registers while the group's rows pass;
 * two sums, to halve the chain of dependent additions. */
static inline __attribute__((always_inline)) void group_dots(const PagedArgs *a, const v16 *key, int64_t kvh,
                                                              int64_t blocks, const float *q, float after, int fmt,
                                                              v16 *partial) {
    const int64_t G = a->Hq / a->Hkv;
    for (int64_t r0 = kvh * G; r0 < a->Q * a->Hq; r0 += a->Hq) /* (query, head) rows of the group: no division */
        for (int64_t r = r0; r < r0 + G; r++) {
            const float *qr = q + r * 16 * blocks;
            v16 x = {0}, y = {0}, q0, q1;
            int64_t b = 0;
            for (; b + 2 <= blocks; b += 2) {
                memcpy(&q0, qr + 16 * b, sizeof q0);
                memcpy(&q1, qr + 16 * b + 16, sizeof q1);
                x += q0 * key[b];
                y += q1 * key[b + 1];
            }
            if (b < blocks) {
                memcpy(&q0, qr + 16 * b, sizeof q0);
                x += q0 * key[b];
            }
            partial[r * 16] = fmt == FMT_I8 ? (x + y) * after : x + y;
        }
}

/* The dot products (`group_dots`) of chunk slot c's key row of KV head kvh, read once into `blocks` 16-lane blocks
 * (a constant where D is 64): float rows as fp32, int8 as bare codes, int4 / int2 per token dequantized, per page as
 * codes in page_q's order against `page_query`'s rows (slot_base[r * 16] = page_base[r]). */
static inline __attribute__((always_inline)) void slot_dots(const PagedArgs *a, const Chunk *ch, int64_t c,
                                                             int64_t kvh, int64_t blocks, const ChunkScales *cs,
                                                             const float *q, const float *page_q,
                                                             const float *page_base, v16 *partial, float *slot_base,
                                                             int fmt) {
    const Row at = slot_row(a, ch, c, kvh, 0);
    v16 key[blocks];
    float after = 1.0f;
    if (fmt >= FMT_I4 && a->k_page_params) {
        int64_t b = 0;
        for (; b + 2 <= blocks && fmt == FMT_I4; b += 2)
            nibbles32((const uint8_t *)a->k + at.row + 8 * b, &key[b], &key[b + 1]);
        for (; b < blocks; b++) key[b] = codes16(a, 0, at, 16 * b, fmt);
        const int64_t G = a->Hq / a->Hkv;
        for (int64_t r0 = kvh * G; r0 < a->Q * a->Hq; r0 += a->Hq)
            for (int64_t r = r0; r < r0 + G; r++) slot_base[r * 16] = page_base[r];
        group_dots(a, key, kvh, blocks, page_q, after, fmt, partial);
        return;
    }
    if (fmt >= FMT_I4) { /* per token: a group of 16 is a block of 16 lanes */
        const int64_t at_scale = (c * a->Hkv + kvh) * cs->k_groups;
        for (int64_t b = 0; b < blocks; b++)
            key[b] = (codes16(a, 0, at, 16 * b, fmt) - cs->k_zero[at_scale + b]) * cs->k_scale[at_scale + b];
    } else if (fmt == FMT_I8) { /* one group a row: its scale multiplies the dot products instead */
        after = cs->k_scale[c * a->Hkv + kvh];
        for (int64_t b = 0; b < blocks; b++) key[b] = codes16(a, 0, at, 16 * b, fmt);
    } else {
        for (int64_t b = 0; b < blocks; b++) key[b] = load16(a, 0, at, 16 * b, fmt);
    }
    group_dots(a, key, kvh, blocks, q, after, fmt, partial);
}

/* Scores of a chunk, head dims a multiple of 16: slots in order (each K row, all heads, read once), 16 at a
 * time; each (row, slot) dot product leaves a 16-lane partial in `partial` [R][16 slots][16 lanes], and one
 * lane-sum tree per row turns 16 partials into 16 scores. */
static inline __attribute__((always_inline)) void chunk_scores16(const PagedArgs *a, const Chunk *ch,
                                                                  const Chunk *next, const uint8_t *slot_used,
                                                                  const uint8_t *allowed, const float *q,
                                                                  const ChunkScales *cs, float *score, int fmt,
                                                                  v16 *partial, float *page_q, float *page_base,
                                                                  float *slot_base, int64_t *page_at) {
    const int64_t D = a->D, R = a->Q * a->Hq, C = ch->C;
    const int page_keys = fmt >= FMT_I4 && a->k_page_params;
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
        const int64_t n = C - c0 < 16 ? C - c0 : 16;
        if (page_keys) /* [R][16]: q . low of each row and slot's page, added to the lane sums */
            memset(slot_base, 0, sizeof(float) * R * 16);
        for (int64_t j = 0; j < 16; j++) {
            const int used = j < n && slot_used[c0 + j];
            prefetch_rows(a, ch, next, c0 + j, used, fmt);
            if (!used) { /* never read: may be garbage */
                for (int64_t r = 0; r < R; r++) partial[r * 16 + j] = (v16){0};
                continue;
            }
            if (page_keys && ch->ks_off[c0 + j] != *page_at) /* a new page: its queries */
                page_query(a, ch->ks_off[c0 + j], q, page_q, page_base, page_at, fmt);
            for (int64_t kvh = 0; kvh < a->Hkv; kvh++)
                if (D == 64)
                    slot_dots(a, ch, c0 + j, kvh, 4, cs, q, page_q, page_base, partial + j, slot_base + j, fmt);
                else
                    slot_dots(a, ch, c0 + j, kvh, D / 16, cs, q, page_q, page_base, partial + j, slot_base + j, fmt);
        }
        for (int64_t r = 0; r < R; r++) {
            v16 dots = sum_lanes16(partial + r * 16), base;
            if (page_keys) {
                memcpy(&base, slot_base + r * 16, sizeof base);
                dots += base;
            }
            float lanes[16];
            memcpy(lanes, &dots, sizeof lanes);
            store_scores(a, r, c0, n, lanes, allowed, score);
        }
    }
}

/* Scores of a chunk, any head dim: one dot product (and horizontal sum) per row and slot. */
static inline __attribute__((always_inline)) void chunk_scores(const PagedArgs *a, const Chunk *ch,
                                                                const Chunk *next, const uint8_t *slot_used,
                                                                const uint8_t *allowed, const float *q,
                                                                float *score, int fmt, float *slot) {
    const int64_t G = a->Hq / a->Hkv, Hq = a->Hq, D = a->D, C = ch->C;
    for (int64_t c = 0; c < C; c++) {
        prefetch_rows(a, ch, next, c, slot_used[c], fmt);
        if (!slot_used[c]) { /* never read: may be garbage */
            for (int64_t r = 0; r < a->Q * Hq; r++) score[r * CHUNK + c] = MASKED;
            continue;
        }
        for (int64_t kvh = 0; kvh < a->Hkv; kvh++) {
            const float *kr = load_key_row(a, slot_row(a, ch, c, kvh, 0), fmt, slot);
            for (int64_t i = 0; i < a->Q * G; i++) {
                const int64_t r = (i / G) * Hq + kvh * G + i % G;
                const float *qr = q + r * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
                store_scores(a, r, c, 1, &dot, allowed, score);
            }
        }
    }
}

/* Fill ``ch`` with the next CHUNK slots (fewer at the end, none past n_end) of row b's entries from slot *s0
 * of entry *n, skipping -1 entries (and, with ``rows``, ids whose row there is -1: pages of the other tier);
 * *n and *s0 then name the slot after the chunk. */
static inline void next_chunk(const PagedArgs *a, const int64_t *rows, int64_t b, int64_t *n, int64_t *s0,
                              int64_t n_end, Chunk *ch) {
    const int64_t S = a->S;
    ch->C = 0;
    while (*n < n_end && ch->C < CHUNK) {
        int64_t page = a->table[b * a->N + *n];
        if (page >= 0 && rows) page = rows[page];
        if (page < 0) {
            ++*n;
            *s0 = 0;
            continue;
        }
        const int64_t first = a->page_pos[b * a->N + *n];
        const int64_t end = S - *s0 < CHUNK - ch->C ? S : *s0 + CHUNK - ch->C;
        for (int64_t s = *s0; s < end; s++, ch->C++) {
            ch->k_off[ch->C] = page * a->k_stride[0] + s * a->k_stride[1];
            ch->v_off[ch->C] = page * a->v_stride[0] + s * a->v_stride[1];
            ch->ks_off[ch->C] = page * a->ks_stride[0] + s * a->ks_stride[1];
            ch->vs_off[ch->C] = page * a->vs_stride[0] + s * a->vs_stride[1];
            ch->pos[ch->C] = first + s;
            ch->entry[ch->C] = *n;
        }
        *s0 = end;
        if (end == S) {
            ++*n;
            *s0 = 0;
        }
    }
}

/* Fold row r's probability weights ``p`` of a chunk (relative to ``max``) into its entries' (max, sum),
 * entry_stats [B, R, N, 2] (sum 0: nothing seen yet); an entry's slots are consecutive in the chunk. Pages of one
 * token: each entry is one slot, seen once (a split's walk of a tier reads it once), so its stats are (max, p). */
static inline void add_entry_stats(const PagedArgs *a, float *entry_stats, int64_t b, int64_t r, const Chunk *ch,
                                   const float *p, float max) {
    const int64_t R = a->Q * a->Hq;
    if (a->S == 1) {
        float *st = entry_stats + (b * R + r) * a->N * 2;
        for (int64_t c = 0; c < ch->C; c++)
            if (p[c] > 0.0f) {
                st[2 * ch->entry[c]] = max;
                st[2 * ch->entry[c] + 1] = p[c];
            }
        return;
    }
    for (int64_t c = 0; c < ch->C;) {
        const int64_t e = ch->entry[c];
        float sum = 0.0f;
        for (; c < ch->C && ch->entry[c] == e; c++) sum += p[c];
        if (sum <= 0.0f) continue;
        float *st = entry_stats + ((b * R + r) * a->N + e) * 2;
        if (st[1] <= 0.0f) {
            st[0] = max;
            st[1] = sum;
        } else {
            const float m = st[0] > max ? st[0] : max;
            st[1] = st[1] * exp_approx(st[0] - m) + sum * exp_approx(max - m);
            st[0] = m;
        }
    }
}

/* Fill ``cs`` with the float scales and zero points of the chunk's attended quantized key rows. */
static inline void chunk_scales(const PagedArgs *a, const Chunk *ch, const uint8_t *slot_used, ChunkScales *cs) {
    const int64_t groups = cs->k_groups;
    for (int64_t c = 0; c < ch->C && groups; c++) {
        if (!slot_used[c]) continue;
        for (int64_t kvh = 0; kvh < a->Hkv; kvh++) {
            const Row row = slot_row(a, ch, c, kvh, 0);
            for (int64_t g = 0; g < groups; g++)
                group_of(a, 0, row, g * a->k_group, (int)a->format, cs->k_scale + (c * a->Hkv + kvh) * groups + g,
                         cs->k_zero + (c * a->Hkv + kvh) * groups + g);
        }
    }
}

/* A work item's scratch (carved from `work` by `attend_split`). */
typedef struct {
    float *partial16, *q, *acc, *run_max, *run_sum, *slot, *score, *page_q, *page_base, *slot_base;
    float *block_score;   /* `walk_float`'s scores, then weights: [R][BLOCK] */
    float *entry_stats; /* run()'s, or NULL (the cold tier's args are a copy made before run() set it) */
    uint8_t *allowed;
    ChunkScales cs;
} Scratch;

/* Fold a row's scores ``sr[0..n)`` (MASKED where it may not attend) into its running (max, sum) and accumulator
 * ``acc`` [D] (rescaled to the new max): ``sr`` becomes the probability weights relative to the new max, 0 where
 * masked. Returns 0, with ``sr`` all 0 and the running state untouched, when no score is attended. */
static inline __attribute__((always_inline)) int update_softmax(float *sr, int64_t n, float *run_max, float *run_sum,
                                                                float *acc, int64_t D) {
    float chunk_max = MASKED;
#pragma omp simd reduction(max : chunk_max)
    for (int64_t c = 0; c < n; c++) chunk_max = sr[c] > chunk_max ? sr[c] : chunk_max;
    if (chunk_max <= MASKED) {
        for (int64_t c = 0; c < n; c++) sr[c] = 0.0f;
        return 0;
    }
    const float new_max = *run_max > chunk_max ? *run_max : chunk_max;
    const float rescale = exp_approx(*run_max - new_max);
    float chunk_sum = 0.0f;
#pragma omp simd reduction(+ : chunk_sum)
    for (int64_t c = 0; c < n; c++) {
        const float p = sr[c] <= MASKED ? 0.0f : exp_approx(sr[c] - new_max);
        sr[c] = p;
        chunk_sum += p;
    }
    *run_sum = *run_sum * rescale + chunk_sum;
    if (rescale != 1.0f)
        for (int64_t d = 0; d < D; d++) acc[d] *= rescale;
    *run_max = new_max;
    return 1;
}

/* Fold entries [n_begin, n_end) of row b held in the pools of ``a`` (format fmt) into the running (max, sum, acc):
 * ``rows`` maps a table id to its row of these pools (-1: not here, skipped like a hole), NULL: ids are rows. */
static inline __attribute__((always_inline)) void walk_entries(const PagedArgs *a, const int64_t *rows, int64_t b,
                                                                int64_t n_begin, int64_t n_end, int fmt,
                                                                Scratch *w) {
    const int64_t Hq = a->Hq, R = a->Q * Hq, D = a->D;
    float *q = w->q, *acc = w->acc, *run_max = w->run_max, *run_sum = w->run_sum, *score = w->score;
    uint8_t *allowed = w->allowed;
    int64_t page_at = -1;
    uint8_t slot_used[CHUNK];
    /* the chunk being read, and the next one, whose K rows its scores fetch meanwhile (pages may lie anywhere) */
    Chunk chunks[2];
    int64_t n = n_begin, s0 = 0; /* the slot after the next chunk: slot s0 of entry n */
    next_chunk(a, rows, b, &n, &s0, n_end, &chunks[0]);
    for (int cur = 0; chunks[cur].C > 0; cur ^= 1) {
        const Chunk *ch = &chunks[cur];
        Chunk *next = &chunks[cur ^ 1];
        next_chunk(a, rows, b, &n, &s0, n_end, next);
        const int64_t C = ch->C;
        int any = 0;
        memset(slot_used, 0, CHUNK);
        for (int64_t r = 0; r < R; r++) {
            uint8_t *ok = allowed + r * CHUNK;
            if (r % Hq && !a->mask_per_head) { /* same query, another head: same pattern */
                memcpy(ok, ok - CHUNK, C);
                continue;
            }
            allowed_slots(a, b, r % Hq, r / Hq, ch, ok);
            for (int64_t c = 0; c < C; c++) { slot_used[c] |= ok[c]; any |= ok[c]; }
        }
        if (!any) continue;
        if (fmt >= FMT_I8) chunk_scales(a, ch, slot_used, &w->cs);
        if (D % 16 == 0) /* int8 keys: one group a row; int4 keys: a step per channel, or groups of 16 */
            chunk_scores16(a, ch, next, slot_used, allowed, q, &w->cs, score, fmt, (v16 *)w->partial16, w->page_q,
                           w->page_base, w->slot_base, &page_at);
        else
            chunk_scores(a, ch, next, slot_used, allowed, q, score, fmt, w->slot);
        for (int64_t r = 0; r < R; r++) /* one rescale per row and chunk; score becomes the probability weight */
            if (update_softmax(score + r * CHUNK, C, run_max + r, run_sum + r, acc + r * D, D) && w->entry_stats)
                add_entry_stats(a, w->entry_stats, b, r, ch, score + r * CHUNK, run_max[r]);
        add_values(a, ch, slot_used, score, acc, fmt);
    }
}

#define BLOCK 256 /* slots whose scores `walk_float` takes before one softmax update a row */

/* `walk_entries` for float pools (fp32, bf16) with no mask, window, softcap, page mass or cold tier, head dims a
 * multiple of 16 (``blocks`` of 16 lanes, a constant where D is 64): the slots BLOCK at a time, in two passes. First
 * every row's scores into ``w->block_score`` [R][BLOCK] (16 slots at a time, a slot's KV heads in turn as they lie
 * in memory, each key row read once for its KV head's query rows, `group_dots`; one lane-sum tree a row); then per
 * row one softmax update over the block (its max, one rescale, the weights), and the weighted value rows, the
 * accumulators of up to 4 rows held in registers while the block's value rows pass (its slots: BLOCK / CHUNK chunks
 * of `next_chunk`). One update per BLOCK slots instead of one per chunk is what makes it faster (0.83-0.87x the
 * time on cached pages, docs/kernels.md). Slots no query attends are never read into the result (their scores are
 * masked, their values skipped). Same results as `walk_entries` up to the order of float additions. */
static inline __attribute__((always_inline)) void walk_float(const PagedArgs *a, int64_t b, int64_t n_begin,
                                                              int64_t n_end, int fmt, int64_t blocks, Scratch *w) {
    const int64_t G = a->Hq / a->Hkv, Hq = a->Hq, D = a->D, rows = a->Q * G, R = a->Q * Hq;
    float *acc = w->acc, *score = w->block_score;
    v16 *partial = (v16 *)w->partial16; /* [R][16] */
    Chunk chunks[BLOCK / CHUNK]; /* slot t of the block: slot t % CHUNK of chunk t / CHUNK (all full but the last) */
#define SLOT(field, t) chunks[(t) / CHUNK].field[(t) % CHUNK]
    int64_t n = n_begin, s0 = 0;
    while (n < n_end) {
        int64_t m = 0; /* the block's slots: the next BLOCK of the entries' (-1 entries skipped) */
        for (int i = 0; i < BLOCK / CHUNK && n < n_end; i++) {
            next_chunk(a, NULL, b, &n, &s0, n_end, &chunks[i]);
            m += chunks[i].C;
        }
        const int64_t m16 = (m + 15) / 16, lanes = 16 * m16;
        uint32_t allowed[a->Q][m16 ? m16 : 1], used[m16 ? m16 : 1]; /* bit t: slot 16 c + t */
        int any = 0;
        for (int64_t c = 0; c < m16; c++) {
            used[c] = 0;
            for (int64_t qi = 0; qi < a->Q; qi++) {
                const int64_t qp = a->q_pos[b * a->Q + qi];
                uint32_t bits = 0;
                for (int64_t t = 0; t < 16 && 16 * c + t < m; t++) bits |= (uint32_t)(SLOT(pos, 16 * c + t) <= qp) << t;
                allowed[qi][c] = bits;
                used[c] |= bits;
            }
            any |= used[c] != 0;
        }
        if (!any) continue;
        for (int64_t c = 0; c < m16; c++) { /* scores, 16 slots at a time, a slot's KV heads in turn */
            for (int64_t t = 0; t < 16; t++) {
                if (!(used[c] >> t & 1)) { /* never read: may be garbage */
                    for (int64_t r = 0; r < R; r++) partial[r * 16 + t] = (v16){0};
                    continue;
                }
                for (int64_t kvh = 0; kvh < a->Hkv; kvh++) {
                    const Row at = {SLOT(k_off, 16 * c + t) + kvh * a->k_stride[2], 0};
                    v16 key[blocks];
                    for (int64_t k = 0; k < blocks; k++) key[k] = load16(a, 0, at, 16 * k, fmt);
                    group_dots(a, key, kvh, blocks, w->q, 1.0f, fmt, partial + t);
                }
            }
            for (int64_t r = 0; r < R; r++) {
                const v16 dots = sum_lanes16(partial + r * 16) * a->scale;
                const uint32_t bits = allowed[r / Hq][c];
                float *sr = score + r * BLOCK + 16 * c;
                memcpy(sr, &dots, sizeof dots);
                for (int t = 0; t < 16; t++) sr[t] = bits >> t & 1 ? sr[t] : MASKED;
            }
        }
        for (int64_t r = 0; r < R; r++) /* one softmax update a row: its scores become its weights */
            update_softmax(score + r * BLOCK, lanes, w->run_max + r, w->run_sum + r, acc + r * D, D);
        for (int64_t kvh = 0; kvh < a->Hkv; kvh++) /* the weighted values: 4 rows x 4 blocks of lanes at a time */
            for (int64_t i0 = 0; i0 < rows; i0 += 4) {
                const int64_t nr = rows - i0 < 4 ? rows - i0 : 4;
                const float *pr[4];
                float *ar[4];
                uint32_t attended[m16 ? m16 : 1];
                for (int64_t j = 0; j < nr; j++) {
                    const int64_t r = ((i0 + j) / G) * Hq + kvh * G + (i0 + j) % G; /* (query, head) row */
                    pr[j] = score + r * BLOCK;
                    ar[j] = acc + r * D;
                }
                for (int64_t c = 0; c < m16; c++) {
                    attended[c] = 0;
                    for (int64_t j = 0; j < nr; j++) attended[c] |= allowed[(i0 + j) / G][c];
                }
                for (int64_t k0 = 0; k0 < blocks; k0 += 4) {
                    const int64_t kn = blocks - k0 < 4 ? blocks - k0 : 4;
                    v16 sum[4][4];
                    for (int64_t j = 0; j < nr; j++)
                        for (int64_t k = 0; k < kn; k++) memcpy(&sum[j][k], ar[j] + 16 * (k0 + k), sizeof(v16));
                    for (int64_t t = 0; t < m; t++) {
                        if (!(attended[t / 16] >> (t % 16) & 1)) continue;
                        const Row at = {SLOT(v_off, t) + kvh * a->v_stride[2], 0};
                        v16 v[4];
                        for (int64_t k = 0; k < kn; k++) v[k] = load16(a, 1, at, 16 * (k0 + k), fmt);
                        for (int64_t j = 0; j < nr; j++)
                            for (int64_t k = 0; k < kn; k++) sum[j][k] += pr[j][t] * v[k];
                    }
                    for (int64_t j = 0; j < nr; j++)
                        for (int64_t k = 0; k < kn; k++) memcpy(ar[j] + 16 * (k0 + k), &sum[j][k], sizeof(v16));
                }
            }
    }
#undef SLOT
}

static inline __attribute__((always_inline)) void attend_split(const PagedArgs *a, int64_t item, int fmt,
                                                                int cold_fmt, float *work) {
    const PagedArgs *c = cold_fmt < 0 ? a : a->cold; /* the args whose quantized layout sizes the scratch */
    const int64_t Hq = a->Hq, R = a->Q * Hq, D = a->D, N = a->N;
    const int64_t split = item % a->splits, b = item / a->splits;
    const int64_t per_split = (N + a->splits - 1) / a->splits;
    const int64_t n_begin = split * per_split, n_end = n_begin + per_split < N ? n_begin + per_split : N;
    const int scaled = cold_fmt < 0 ? fmt : cold_fmt;
    Scratch w;
    w.entry_stats = a->entry_stats;
    w.partial16 = work;                                   /* [R][16][16], 64-byte aligned at the start */
    w.q = w.partial16 + R * 256, w.acc = w.q + R * D, w.run_max = w.acc + R * D, w.run_sum = w.run_max + R;
    w.slot = w.run_sum + R;                               /* Hkv * D */
    w.score = w.slot + a->Hkv * D;                        /* [R][CHUNK] */
    w.allowed = (uint8_t *)(w.score + R * CHUNK);         /* [R][CHUNK] */
    w.cs = (ChunkScales){.k_groups = scaled >= FMT_I4 && c->k_page_params ? 0 : D / c->k_group};
    w.cs.k_scale = (float *)(w.allowed + R * CHUNK);      /* [CHUNK][Hkv][groups] each */
    w.cs.k_zero = w.cs.k_scale + CHUNK * a->Hkv * w.cs.k_groups;
    w.page_q = w.cs.k_zero + CHUNK * a->Hkv * w.cs.k_groups; /* int4 keys: [R][D], of one page */
    w.page_base = w.page_q + R * D;                            /* [R] */
    w.slot_base = w.page_base + R;                              /* [R][16] */
    w.block_score = w.slot_base + R * 16;                       /* [R][BLOCK] */
    float *q = w.q, *acc = w.acc;

    for (int64_t r = 0; r < R; r++) { /* row r = (query r / Hq, head r % Hq) */
        const float *src = a->q + b * a->q_stride[0] + (r % Hq) * a->q_stride[1] + (r / Hq) * a->q_stride[2];
        for (int64_t d = 0; d < D; d++) q[r * D + d] = src[d * a->q_stride[3]];
        if (a->k_rotated) rotate(q + r * D, D);
        w.run_max[r] = MASKED;
        w.run_sum[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * R * D);
    if (cold_fmt < 0 && fmt <= FMT_BF16 && !a->mask && a->window <= 0 && a->softcap <= 0.0f && !a->entry_stats
        && !a->hot_row && D % 16 == 0) /* the common case: float pages, no mask, window, softcap or page mass */
        D == 64 ? walk_float(a, b, n_begin, n_end, fmt, 4, &w) : walk_float(a, b, n_begin, n_end, fmt, D / 16, &w);
    else
        walk_entries(a, a->hot_row, b, n_begin, n_end, fmt, &w);
    if (cold_fmt >= 0) { /* then the cold tier, in its basis: q.k = (q R).(k R), sum p v R = (sum p v) R */
        for (int64_t r = 0; r < R; r++) {
            if (c->k_rotated) rotate(q + r * D, D);
            if (c->v_rotated) rotate(acc + r * D, D);
        }
        walk_entries(c, a->cold_row, b, n_begin, n_end, cold_fmt, &w);
    }
    float *dst = a->partial + (b * a->splits + split) * R * (D + 2);
    for (int64_t r = 0; r < R; r++) {
        memcpy(dst + r * (D + 2), acc + r * D, sizeof(float) * D);
        dst[r * (D + 2) + D] = w.run_max[r];
        dst[r * (D + 2) + D + 1] = w.run_sum[r];
    }
}

/* A value row of ``t``'s pools (format fmt) as fp32: in place for fp32 pools, else converted into ``buf`` (D floats;
 * a group's scale and zero point read once). */
static const float *value_row(const PagedArgs *t, Row at, int fmt, float *buf) {
    const int64_t D = t->D;
    if (fmt == FMT_F32) return (const float *)t->v + at.row;
    if (fmt == FMT_BF16) {
        for (int64_t d = 0; d < D; d++) buf[d] = load_bf16((const uint16_t *)t->v, at.row + d);
        return buf;
    }
    for (int64_t g0 = 0; g0 < D; g0 += t->v_group) {
        float scale, zero;
        group_of(t, 1, at, g0, fmt, &scale, &zero);
        if (t->v_group % 16 == 0) { /* 16 lanes at a time */
            for (int64_t d = g0; d < g0 + t->v_group; d += 16) {
                const v16 x = fmt == FMT_I8   ? codes16(t, 1, at, d, FMT_I8)
                              : fmt == FMT_I4 ? codes16(t, 1, at, d, FMT_I4)
                                              : codes16(t, 1, at, d, FMT_I2);
                const v16 y = (x - zero) * scale;
                memcpy(buf + d, &y, sizeof y);
            }
        } else if (fmt == FMT_I8) {
            const int8_t *codes = (const int8_t *)t->v + at.row;
            for (int64_t d = g0; d < g0 + t->v_group; d++) buf[d] = (float)codes[d] * scale;
        } else {
            for (int64_t d = g0; d < g0 + t->v_group; d++)
                buf[d] = (code_at((const uint8_t *)t->v + at.row, d, fmt) - zero) * scale;
        }
    }
    return buf;
}

/* Merge the splits of row r = (query, head) of batch row b: sink, normalisation. With a page mass the row's max and
 * total weight go to norm[2 item..] for `add_page_mass`, which rotates the output back. */
static void finalize(const PagedArgs *a, int64_t item, float *norm) {
    const int64_t R = a->Q * a->Hq, D = a->D;
    const int64_t r = item % R, b = item / R, qi = r / a->Hq, h = r % a->Hq;
    const float *part = a->partial + (b * a->splits * R + r) * (D + 2);
    const int64_t step = R * (D + 2);
    float m = MASKED;
    for (int64_t s = 0; s < a->splits; s++)
        if (part[s * step + D + 1] > 0.0f && part[s * step + D] > m) m = part[s * step + D];
    if (a->sinks && a->sinks[h] > m) m = a->sinks[h];
    float total = a->sinks ? exp_approx(a->sinks[h] - m) : 0.0f;
    float *out = a->out + ((b * a->Q + qi) * a->Hq + h) * D;
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t s = 0; s < a->splits; s++) {
        const float *p = part + s * step;
        if (p[D + 1] <= 0.0f) continue;
        const float w = exp_approx(p[D] - m);
        total += p[D + 1] * w;
        for (int64_t d = 0; d < D; d++) out[d] += p[d] * w;
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
    if (a->lse) a->lse[(b * a->Q + qi) * a->Hq + h] = total > 0.0f ? m + logf(total) : -INFINITY;
    if (a->page_mass) {
        norm[2 * item] = m;
        norm[2 * item + 1] = total;
        return;
    }
    if (a->cold ? a->cold->v_rotated : a->v_rotated) rotate(out, D);
}

/* |x - y|^2 of D floats. D a multiple of 16: summed in a fixed order, 16 lanes (x - y)^2 + lane, then the upper
 * half of the lanes added to the lower down to one (the order of the plain loop below, vectorised with AVX-512). */
static inline float distance2(const float *x, const float *y, int64_t D) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    if (D % 16) {
        float d2 = 0.0f;
#pragma omp simd reduction(+ : d2)
        for (int64_t d = 0; d < D; d++) d2 += (x[d] - y[d]) * (x[d] - y[d]);
        return d2;
    }
    v16 acc = {0};
    for (int64_t d = 0; d < D; d += 16) {
        v16 u, w;
        memcpy(&u, x + d, sizeof u);
        memcpy(&w, y + d, sizeof w);
        acc += (u - w) * (u - w);
    }
    const v8 h8 = __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15)
                  + __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7);
    const v4 h4 = __builtin_shufflevector(h8, h8, 4, 5, 6, 7) + __builtin_shufflevector(h8, h8, 0, 1, 2, 3);
    return (h4[3] + h4[1]) + (h4[2] + h4[0]);
}

/* Entry n's value row of KV head kvh in batch row b, as fp32 (in place, or dequantized into ``row``), and in
 * ``basis`` the outputs it is compared with: two tiers, ``model`` (the outputs in the model's basis) for a hot page. */
static const float *entry_value(const PagedArgs *a, int64_t b, int64_t n, int64_t kvh, const float *model,
                                const float **basis, float *row) {
    int64_t page = a->table[b * a->N + n];
    const PagedArgs *t = a; /* the pools holding the page */
    if (a->cold) {
        const int hot = a->hot_row[page] >= 0;
        page = hot ? a->hot_row[page] : a->cold_row[page];
        t = hot ? a : a->cold;
        if (hot) *basis = model;
    }
    const Row at = {page * t->v_stride[0] + kvh * t->v_stride[2], page * t->vs_stride[0] + kvh * t->vs_stride[2]};
    return value_row(t, at, (int)t->format, row);
}

/* The page mass of batch row b, once `finalize` has normalised its rows (norm: their max and total weight): each
 * attended entry's probability p per head, or with `mass_output` (pages of one token) its token's p / (1 - p) *
 * |v - out|, averaged over the queries; then the outputs are rotated back (the distances are measured in the values'
 * basis; two tiers: out is in the cold values' basis, and `model` [R, D] scratch holds it in the model's, for the hot
 * values). Passes over a row's entry stats, in place: p into the max slot, and 0 into the sum slot of an attended
 * entry, -1 of another (16 entries at a time); |v - out| into the sum slot (a token's value row of a KV head read,
 * dequantized, once for the rows of all of its heads); the mass (16 at a time). Each value is computed as a loop over
 * the entries of one row at a time did, bit for bit. */
static void add_page_mass(const PagedArgs *a, int64_t b, const float *norm, float *model) {
    const int64_t Hq = a->Hq, R = a->Q * Hq, D = a->D, N = a->N, group = Hq / a->Hkv;
    const int v_rotated = a->cold ? (int)a->cold->v_rotated : (int)a->v_rotated;
    float *outs = a->out + b * R * D, *stats = a->entry_stats + b * R * N * 2, row[D];
    if (model) {
        memcpy(model, outs, sizeof(float) * R * D);
        for (int64_t r = 0; r < R && v_rotated; r++) rotate(model + r * D, D);
    }
    for (int64_t r = 0; r < R; r++) {
        const float m = norm[2 * (b * R + r)], total = norm[2 * (b * R + r) + 1];
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        float *st = stats + r * N * 2;
#pragma omp simd
        for (int64_t n = 0; n < N; n++) {
            const int seen = total > 0.0f && st[2 * n + 1] > 0.0f; /* nothing attended in the row: no mass */
            st[2 * n] = seen ? st[2 * n + 1] * exp_approx(st[2 * n] - m) * inv : 0.0f;
            st[2 * n + 1] = seen ? 0.0f : -1.0f;
        }
    }
    const float queries = (float)a->Q;
    for (int64_t r = 0; r < R && !a->mass_output; r++) {
        const float *st = stats + r * N * 2;
        float *mass = a->page_mass + (b * Hq + r % Hq) * N;
#pragma omp simd
        for (int64_t n = 0; n < N; n++) { /* (+ 0 leaves a mass unchanged: it is never -0) */
            const float share = st[2 * n] / queries;
            mass[n] += st[2 * n + 1] < 0.0f ? 0.0f : share;
        }
    }
    int64_t rows[R]; /* the rows of one KV head's heads */
    for (int64_t kvh = 0; kvh < a->Hkv && a->mass_output; kvh++) {
        int64_t count = 0;
        for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
            for (int64_t qi = 0; qi < a->Q; qi++) rows[count++] = qi * Hq + h;
        for (int64_t n = 0; n < N; n++) {
            const float *v = NULL, *basis = outs; /* the value row, once a row attended the token */
            for (int64_t i = 0; i < count; i++) {
                float *st = stats + (rows[i] * N + n) * 2;
                if (st[1] < 0.0f) continue;
                if (v == NULL) v = entry_value(a, b, n, kvh, model, &basis, row);
                st[1] = sqrtf(distance2(v, basis + rows[i] * D, D));
            }
        }
    }
    for (int64_t r = 0; r < R && a->mass_output; r++) {
        const float *st = stats + r * N * 2;
        float *mass = a->page_mass + (b * Hq + r % Hq) * N;
#pragma omp simd
        for (int64_t n = 0; n < N; n++) { /* (+ 0 leaves a mass unchanged: it is never -0) */
            const float p = st[2 * n], rest = 1.0f - p;
            const float moved = p / (rest > LEAVE_OUT_FLOOR ? rest : LEAVE_OUT_FLOOR) * st[2 * n + 1] / queries;
            mass[n] += st[2 * n + 1] < 0.0f ? 0.0f : moved;
        }
    }
    for (int64_t r = 0; r < R && v_rotated; r++) rotate(outs + r * D, D);
}

/* The heads' mean or max of the page mass per head [B, Hq, N] into out [B, N]. */
static void reduce_heads(const PagedArgs *a, const float *per_head, float *out) {
    const int64_t Hq = a->Hq, N = a->N;
    for (int64_t b = 0; b < a->B; b++) {
        float *o = out + b * N;
        memcpy(o, per_head + b * Hq * N, sizeof(float) * N);
        for (int64_t h = 1; h < Hq; h++) {
            const float *m = per_head + (b * Hq + h) * N;
            if (a->mass_heads == 1)
                for (int64_t n = 0; n < N; n++) o[n] += m[n];
            else
                for (int64_t n = 0; n < N; n++) o[n] = m[n] > o[n] ? m[n] : o[n];
        }
        if (a->mass_heads == 1)
            for (int64_t n = 0; n < N; n++) o[n] /= (float)Hq;
    }
}

/* Returns 0, or -1 when scratch memory cannot be allocated (nothing written). Inlined into each entry below, so
 * that an entry's one-thread path holds only its formats' code (a decode call's code comes from memory after the
 * layer's matrix products: 21 KB for float32 pages instead of 62 KB shared by all formats). */
static inline __attribute__((always_inline)) int run(PagedArgs *a, int fmt, int cold_fmt) {
    float *reduced = NULL; /* with mass_heads: the caller's [B, N]; the page mass per head goes to scratch */
    if (a->page_mass && a->mass_heads) {
        reduced = a->page_mass;
        a->page_mass = calloc((size_t)(a->B * a->Hq * a->N), sizeof(float));
        if (a->page_mass == NULL) return -1;
    }
    const int64_t R = a->Q * a->Hq, items = a->B * a->splits;
    const PagedArgs *c = cold_fmt < 0 ? a : a->cold; /* the pools whose scales a chunk converts */
    const int scaled = cold_fmt < 0 ? fmt : cold_fmt;
    const int64_t groups = scaled >= FMT_I4 && c->k_page_params ? 0 : a->D / c->k_group; /* of keys */
    const size_t work_bytes = sizeof(float) * (256 * R + 2 * R * a->D + 2 * R + a->Hkv * a->D + R * CHUNK
                                               + 2 * CHUNK * a->Hkv * groups + R * a->D + 17 * R + R * BLOCK)
                              + R * CHUNK;
    a->partial = malloc(sizeof(float) * items * R * (a->D + 2));
    a->entry_stats = a->page_mass ? calloc((size_t)(a->B * R * a->N * 2), sizeof(float)) : NULL;
    /* `add_page_mass`'s scratch: norm [B, R, 2], and model [R, D] for the output signal of two tiers */
    float *norm = a->page_mass ? malloc(sizeof(float) * a->B * R * 2) : NULL;
    float *model = a->page_mass && a->mass_output && a->cold ? malloc(sizeof(float) * R * a->D) : NULL;
    int failed = a->partial == NULL || (a->page_mass && (a->entry_stats == NULL || norm == NULL))
                 || (a->page_mass && a->mass_output && a->cold && model == NULL);
    if (!failed && a->threads <= 1) { /* no parallel region: a decode step of a short row takes microseconds */
        float *work = aligned_alloc(64, (work_bytes + 63) / 64 * 64);
        failed = work == NULL;
        for (int64_t i = 0; i < items && !failed; i++) attend_split(a, i, fmt, cold_fmt, work);
        for (int64_t i = 0; i < a->B * R && !failed; i++) finalize(a, i, norm);
        free(work);
    } else if (!failed) {
        PARALLEL_ITEMS(a->threads, items, work_bytes, failed, attend_split(a, i, fmt, cold_fmt, work));
        /* with page mass, the queries of a head add to the same entries: run those rows in one thread */
        if (!failed) {
#pragma omp parallel for num_threads(a->threads) if (a->page_mass == NULL)
            for (int64_t i = 0; i < a->B * R; i++) finalize(a, i, norm);
        }
    }
    for (int64_t b = 0; b < a->B && a->page_mass && !failed; b++) add_page_mass(a, b, norm, model);
    free(a->partial);
    free(a->entry_stats);
    free(norm);
    free(model);
    a->partial = a->entry_stats = NULL;
    if (reduced) {
        if (!failed) reduce_heads(a, a->page_mass, reduced);
        free(a->page_mass);
        a->page_mass = reduced;
    }
    return failed ? -1 : 0;
}

int paged_attention_f32(PagedArgs *a) { return run(a, FMT_F32, -1); }
int paged_attention_bf16(PagedArgs *a) { return run(a, FMT_BF16, -1); }
int paged_attention_int8(PagedArgs *a) { return run(a, FMT_I8, -1); }
int paged_attention_int4(PagedArgs *a) { return run(a, FMT_I4, -1); }
int paged_attention_int2(PagedArgs *a) { return run(a, FMT_I2, -1); }
/* Two tiers: hot pages in float32 / bfloat16 (a's pools), cold pages in int8 / int4 / int2 (a->cold's). */
int paged_attention_f32_int8(PagedArgs *a) { return run(a, FMT_F32, FMT_I8); }
int paged_attention_f32_int4(PagedArgs *a) { return run(a, FMT_F32, FMT_I4); }
int paged_attention_bf16_int8(PagedArgs *a) { return run(a, FMT_BF16, FMT_I8); }
int paged_attention_bf16_int4(PagedArgs *a) { return run(a, FMT_BF16, FMT_I4); }
int paged_attention_f32_int2(PagedArgs *a) { return run(a, FMT_F32, FMT_I2); }
int paged_attention_bf16_int2(PagedArgs *a) { return run(a, FMT_BF16, FMT_I2); }

/* ---- Prefill chunks: a packed step's multi-token segments, each over its sequence's pages, causal ----
 *
 * Work item = (segment, KV head). Its T = past + length keys and values are copied once from the pages into scratch as
 * fp32 (quantized codes dequantized as they are copied), the keys transposed (`[D][Tp]`: keys of one dimension side by
 * side, so 16 keys' scores are plain FMAs, no lane sums) and the values as rows (`[T][D]`). Then its length x G query
 * rows, 8 at a time (row r: query r / G of the segment, head kvh * G + r % G, position past + r / G): their scores
 * against 32 keys at a time in 16 register accumulators (each key vector read once for the 8 rows) up to the block's
 * last causal key; one softmax a row over all the keys it sees (its scores fit the scratch: no running rescale); the
 * weighted values, 4 rows x 64 lanes held in registers while the value rows pass. Keys after a query's position never
 * enter its result. */
typedef struct PrefillArgs {
    const float *q;       /* [T, Hq, D] fp32: the step's packed queries, strides q_stride */
    int64_t q_stride[3];
    const void *k, *v;    /* [P, S, Hkv, width] pools in the entry point's format (fp32, bf16, int8, int4 / int2 codes),
                           * strides (page, slot, head) */
    int64_t k_stride[3], v_stride[3];
    const uint16_t *k_scale, *v_scale; /* int8: [P, S, Hkv] float16 scales (x = scale * code); int4 / int2: keys'
                                        * page parameters [P, Hkv, D + D / 2] (slot stride 0), values' scales
                                        * [P, S, Hkv] (the layouts of the paged kernel), strides below */
    int64_t ks_stride[3], vs_stride[3];
    const int64_t *table; /* [segments, width]: each segment's page table (ids checked by the caller) */
    int64_t width;
    const int64_t *segment; /* [segments][3]: first packed query, queries, tokens before this step */
    int64_t segments, Hq, Hkv, D, S, threads;
    float scale;
    float *out;           /* [T, Hq, D] fp32, strides out_stride: each segment's rows written, the others untouched */
    int64_t out_stride[3];
    int64_t v_rotated;    /* values stored rotated (int4, int2): each output row is rotated back */
} PrefillArgs;

#define PREFILL_ROWS 8 /* query rows whose scores share each key vector */

static inline int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

/* Segment s's keys (transposed, `kT [D][Tp]`, zero after T) and values (`vr [T][D]`) of KV head kvh as fp32. */
static void prefill_kv(const PrefillArgs *a, int64_t s, int64_t kvh, int64_t T, int64_t Tp, int fmt, float *kT,
                     float *vr) {
    const int64_t D = a->D;
    for (int64_t t = 0; t < T; t++) {
        const int64_t page = a->table[s * a->width + t / a->S], slot = t % a->S;
        const int64_t k0 = page * a->k_stride[0] + slot * a->k_stride[1] + kvh * a->k_stride[2];
        const int64_t v0 = page * a->v_stride[0] + slot * a->v_stride[1] + kvh * a->v_stride[2];
        if (fmt == FMT_F32) {
            const float *key = (const float *)a->k + k0;
            for (int64_t d = 0; d < D; d++) kT[d * Tp + t] = key[d];
            memcpy(vr + t * D, (const float *)a->v + v0, sizeof(float) * D);
        } else if (fmt == FMT_I8) {
            const int64_t at = page * a->ks_stride[0] + slot * a->ks_stride[1] + kvh * a->ks_stride[2];
            const int64_t av = page * a->vs_stride[0] + slot * a->vs_stride[1] + kvh * a->vs_stride[2];
            const float ks = half_to_float(a->k_scale[at]), vs = half_to_float(a->v_scale[av]);
            const int8_t *key = (const int8_t *)a->k + k0, *value = (const int8_t *)a->v + v0;
            for (int64_t d = 0; d < D; d++) kT[d * Tp + t] = (float)key[d] * ks;
            for (int64_t d = 0; d < D; d++) vr[t * D + d] = (float)value[d] * vs;
        } else if (fmt >= FMT_I4) { /* keys x = low + step * code per page and channel; values scale * (code - zero) */
            const uint16_t *params = a->k_scale + page * a->ks_stride[0] + kvh * a->ks_stride[2];
            const uint8_t *steps = (const uint8_t *)(params + D), *key = (const uint8_t *)a->k + k0;
            const uint8_t *value = (const uint8_t *)a->v + v0;
            const int64_t av = page * a->vs_stride[0] + slot * a->vs_stride[1] + kvh * a->vs_stride[2];
            const float vs = half_to_float(a->v_scale[av]), zero = (float)(int8_t)value[code_bytes(D, fmt)];
            for (int64_t d = 0; d < D; d++)
                kT[d * Tp + t] = code_at(key, d, fmt) * fp8_to_float(steps[d]) + half_to_float(params[d]);
            for (int64_t d = 0; d < D; d++) vr[t * D + d] = (code_at(value, d, fmt) - zero) * vs;
        } else {
            for (int64_t d = 0; d < D; d++) kT[d * Tp + t] = load_bf16((const uint16_t *)a->k, k0 + d);
            for (int64_t d = 0; d < D; d++) vr[t * D + d] = load_bf16((const uint16_t *)a->v, v0 + d);
        }
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t t = T; t < Tp; t++) kT[d * Tp + t] = 0.0f;
}

/* sc[j][0..lp) = qt[j] . key, for the PREFILL_ROWS rows of qt [PREFILL_ROWS][D] (scaled) and the keys of kT, 32 at a
 * time (lp a multiple of 32). */
static inline __attribute__((always_inline)) void prefill_scores(const float *qt, const float *kT, int64_t D,
                                                                int64_t Tp, int64_t lp, float *sc) {
    for (int64_t j0 = 0; j0 < lp; j0 += 32) {
        v16 lo[PREFILL_ROWS], hi[PREFILL_ROWS];
        for (int j = 0; j < PREFILL_ROWS; j++) lo[j] = hi[j] = (v16){0};
        for (int64_t d = 0; d < D; d++) {
            v16 k0, k1;
            memcpy(&k0, kT + d * Tp + j0, sizeof k0);
            memcpy(&k1, kT + d * Tp + j0 + 16, sizeof k1);
            for (int j = 0; j < PREFILL_ROWS; j++) {
                const float x = qt[j * D + d];
                lo[j] += x * k0;
                hi[j] += x * k1;
            }
        }
        for (int j = 0; j < PREFILL_ROWS; j++) {
            memcpy(sc + j * Tp + j0, &lo[j], sizeof lo[j]);
            memcpy(sc + j * Tp + j0 + 16, &hi[j], sizeof hi[j]);
        }
    }
}

/* Row scores s[0..n) become their softmax weights, s[n..lp) zero; returns 1 / their sum of exponentials. */
static inline float prefill_softmax(float *s, int64_t n, int64_t lp) {
    float m = MASKED, sum = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        const float p = exp_approx(s[t] - m);
        s[t] = p;
        sum += p;
    }
    for (int64_t t = n; t < lp; t++) s[t] = 0.0f;
    return 1.0f / sum;
}

/* out[j][c0 .. c0 + 16 nc) = inv[j] * sum_t p[j][t] vr[t][c0 ..], 4 rows (those of `o` not NULL written) over keys
 * 0..n; nc (1-4) a constant where inlined. */
static inline __attribute__((always_inline)) void prefill_values(const float *p, int64_t Tp, const float *vr,
                                                                int64_t D, int64_t n, int64_t c0, int nc,
                                                                float *const *o, const float *inv) {
    v16 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < nc; c++) acc[j][c] = (v16){0};
    for (int64_t t = 0; t < n; t++) {
        v16 x[4];
        for (int c = 0; c < nc; c++) memcpy(&x[c], vr + t * D + c0 + 16 * c, sizeof x[c]);
        for (int j = 0; j < 4; j++) {
            const float w = p[j * Tp + t];
            for (int c = 0; c < nc; c++) acc[j][c] += w * x[c];
        }
    }
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < nc && o[j]; c++) {
            const v16 y = acc[j][c] * inv[j];
            memcpy(o[j] + c0 + 16 * c, &y, sizeof y);
        }
}

static void prefill_item(const PrefillArgs *a, int64_t item, int fmt, float *work) {
    const int64_t s = item / a->Hkv, kvh = item % a->Hkv, G = a->Hq / a->Hkv, D = a->D;
    const int64_t start = a->segment[3 * s], L = a->segment[3 * s + 1], past = a->segment[3 * s + 2];
    const int64_t T = past + L, Tp = round32(T), R = L * G;
    float *kT = work, *vr = kT + D * Tp, *sc = vr + D * Tp, *qt = sc + PREFILL_ROWS * Tp;
    prefill_kv(a, s, kvh, T, Tp, fmt, kT, vr);
    for (int64_t r0 = 0; r0 < R; r0 += PREFILL_ROWS) {
        const int64_t nr = R - r0 < PREFILL_ROWS ? R - r0 : PREFILL_ROWS;
        int64_t seen[PREFILL_ROWS]; /* keys row j sees: its position + 1 (past rows repeat the last row) */
        float inv[PREFILL_ROWS], *o[PREFILL_ROWS];
        for (int64_t j = 0; j < PREFILL_ROWS; j++) {
            const int64_t r = r0 + (j < nr ? j : nr - 1), qi = r / G, head = kvh * G + r % G;
            const float *src = a->q + (start + qi) * a->q_stride[0] + head * a->q_stride[1];
            for (int64_t d = 0; d < D; d++) qt[j * D + d] = src[d * a->q_stride[2]] * a->scale;
            seen[j] = past + qi + 1;
            o[j] = j < nr ? a->out + (start + qi) * a->out_stride[0] + head * a->out_stride[1] : NULL;
        }
        const int64_t lp = round32(seen[PREFILL_ROWS - 1]);
        prefill_scores(qt, kT, D, Tp, lp, sc);
        for (int j = 0; j < PREFILL_ROWS; j++) inv[j] = prefill_softmax(sc + j * Tp, seen[j], lp);
        for (int j0 = 0; j0 < nr; j0 += 4)
            for (int64_t c0 = 0; c0 < D; c0 += 64) {
                const int64_t nc = (D - c0) / 16 < 4 ? (D - c0) / 16 : 4;
                const float *p = sc + j0 * Tp;
                if (nc == 4) prefill_values(p, Tp, vr, D, seen[j0 + 3], c0, 4, o + j0, inv + j0);
                else if (nc == 3) prefill_values(p, Tp, vr, D, seen[j0 + 3], c0, 3, o + j0, inv + j0);
                else if (nc == 2) prefill_values(p, Tp, vr, D, seen[j0 + 3], c0, 2, o + j0, inv + j0);
                else prefill_values(p, Tp, vr, D, seen[j0 + 3], c0, 1, o + j0, inv + j0);
            }
    }
    for (int64_t r = 0; r < R && a->v_rotated; r++) /* sum p (v R) = (sum p v) R, and R R = I */
        rotate(a->out + (start + r / G) * a->out_stride[0] + (kvh * G + r % G) * a->out_stride[1], D);
}

static int run_prefill(const PrefillArgs *a, int fmt) {
    int64_t most = 0; /* the longest segment's keys */
    for (int64_t s = 0; s < a->segments; s++) {
        const int64_t T = a->segment[3 * s + 2] + a->segment[3 * s + 1];
        most = T > most ? T : most;
    }
    const int64_t Tp = round32(most);
    const size_t work_bytes = sizeof(float) * (2 * a->D * Tp + PREFILL_ROWS * Tp + PREFILL_ROWS * a->D);
    int failed = 0;
    PARALLEL_ITEMS(a->threads > 1 ? a->threads : 1, a->segments * a->Hkv, work_bytes, failed,
                   prefill_item(a, i, fmt, work));
    return failed ? -1 : 0;
}

int prefill_attention_f32(PrefillArgs *a) { return run_prefill(a, FMT_F32); }
int prefill_attention_bf16(PrefillArgs *a) { return run_prefill(a, FMT_BF16); }
int prefill_attention_i8(PrefillArgs *a) { return run_prefill(a, FMT_I8); }
int prefill_attention_i4(PrefillArgs *a) { return run_prefill(a, FMT_I4); }
int prefill_attention_i2(PrefillArgs *a) { return run_prefill(a, FMT_I2); }
