/* The int4 and int2 page formats' encoders (hf_paged/kv_formats.py) for a step's writes on the CPU.
 *
 * encode_page_keys: KIVI keys, `PageChannelCodec.encode_pages`: per page, KV head and channel a float16 minimum
 *   and a float8 e4m3 step (rounded up so the range fits), `bits`-bit codes (4 or 2) 8 / bits to a byte.
 * encode_packed_values: values, `PackedCodec(None, bits=bits).encode` of already rotated rows: per token and KV head
 *   one group, a float16 scale and an int8 zero point after the codes.
 *
 * Bit-exact with the torch encoders for finite input: the same float32 operations in the same order, rounding
 * half to even (nearbyintf), float16 and float8 e4m3 conversions rounding to nearest even; built without
 * fast-math or contraction. Input holding a non-finite value makes a call return 1 before writing anything
 * (the caller then uses the torch encoder, which keeps such values out of the other tokens' ranges).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define FP16_MAX 65504.0f
#define FP8_MAX 448.0f
#define FP8_MAX_BITS 0x7E

/* float -> float16 bits, round to nearest even; |f| <= FP16_MAX (callers clamp). */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax < 0x38800000u) { /* below 2^-14, the smallest normal half: multiples of 2^-24 */
        float v;
        memcpy(&v, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(v * 16777216.0f)); /* 0x400 is the smallest normal */
    }
    uint32_t h = (ax - 0x38000000u) >> 13; /* exponent rebiased 127 -> 15, mantissa cut to 10 bits */
    const uint32_t rest = ax & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    float v = e == 0 ? (float)m * 5.9604644775390625e-08f /* 2^-24 */ : ldexpf((float)(m | 0x400u), (int)e - 25);
    uint32_t x;
    memcpy(&x, &v, 4);
    x |= sign;
    memcpy(&v, &x, 4);
    return v;
}

/* 0 <= f <= FP8_MAX -> float8 e4m3fn bits, round to nearest even. */
static uint8_t float_to_e4m3(float f) {
    if (f < 0.015625f) return (uint8_t)nearbyintf(f * 512.0f); /* below 2^-6: multiples of 2^-9 (8: 2^-6) */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t q = ((((x >> 23) & 0xFFu) - 120u) << 3) | ((x >> 20) & 7u); /* exponent rebiased 127 -> 7 */
    const uint32_t rest = x & 0xFFFFFu;
    if (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) q++;
    return (uint8_t)q;
}

static float e4m3_to_float(uint8_t b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    return e == 0 ? (float)m * 0.001953125f /* 2^-9 */ : ldexpf((float)(8 + m), e - 10);
}

static int all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

static uint8_t code_of(float v, float top) { /* round half to even, clamped to [0, top] */
    v = nearbyintf(v);
    return (uint8_t)(v < 0.0f ? 0.0f : v > top ? top : v);
}

/* Code c of element d into a row of packed codes: element d at bits (d % per) * bits of byte d / per, per = 8 / bits
 * (a byte's first element, written first, clears it). */
static void put_code(uint8_t *row, int64_t d, uint8_t c, int bits) {
    const int64_t per = 8 / bits, at = d % per;
    row[d / per] = at ? (uint8_t)(row[d / per] | (c << (bits * at))) : c;
}

/* Keys keys [T, H, D] (float32) into the flat slots targets[t] of the residual [R * S, H, D], then pages
 * pages[u] (u < U) of a pool of S-slot pages encoded from their residual rows residual[rows[u]] ([S, H, D] each),
 * of which the first filled[u] slots hold tokens (a slot after them reads as slot 0, so it widens no range):
 * codes [P, S, H, D * bits / 8] and parameters [P, H, D + D / 2] (float16: D minima, then the D steps' bytes).
 * index holds rows[U], filled[U], pages[U], targets[T]. Returns 1 when a key is not finite: the residual then
 * holds the new keys, nothing else is written. */
int encode_page_keys(const float *keys, float *residual, const int64_t *index, int64_t T, int64_t U, int64_t S,
                     int64_t H, int64_t D, int64_t bits, uint8_t *codes, uint16_t *params) {
    const int64_t page_len = S * H * D, *rows = index, *filled = index + U, *pages = index + 2 * U;
    const int64_t width = D * bits / 8;
    const float top = (float)((1 << bits) - 1);
    for (int64_t t = 0; t < T; t++)
        memcpy(residual + index[3 * U + t] * H * D, keys + t * H * D, sizeof(float) * H * D);
    for (int64_t u = 0; u < U; u++)
        if (!all_finite(residual + rows[u] * page_len, filled[u] * H * D)) return 1;
    for (int64_t u = 0; u < U; u++) {
        const float *x = residual + rows[u] * page_len;
        for (int64_t h = 0; h < H; h++) {
            uint16_t *low_out = params + (pages[u] * H + h) * (D + D / 2);
            uint8_t *step_out = (uint8_t *)(low_out + D);
            for (int64_t d = 0; d < D; d++) {
                float low = x[h * D + d], high = low;
                for (int64_t s = 1; s < filled[u]; s++) {
                    const float v = x[(s * H + h) * D + d];
                    low = v < low ? v : low;
                    high = v > high ? v : high;
                }
                const uint16_t low16 = float_to_half(low < -FP16_MAX ? -FP16_MAX : low > FP16_MAX ? FP16_MAX : low);
                const float lowf = half_to_float(low16);
                float need = (high - lowf) / top;
                need = need < 0.0f ? 0.0f : need > FP8_MAX ? FP8_MAX : need;
                uint8_t step8 = float_to_e4m3(need);
                if (e4m3_to_float(step8) < need && step8 < FP8_MAX_BITS) step8++;
                const float step = e4m3_to_float(step8);
                low_out[d] = low16;
                step_out[d] = step8;
                for (int64_t s = 0; s < S; s++) {
                    const float v = x[((s < filled[u] ? s : 0) * H + h) * D + d];
                    const uint8_t c = step > 0.0f ? code_of((v - lowf) / step, top) : 0;
                    put_code(codes + ((pages[u] * S + s) * H + h) * width, d, c, (int)bits);
                }
            }
        }
    }
    return 0;
}

/* Rows x [T, H, D] (float32, rotated) into the flat slots slots[t] of a pool with H heads: codes [P * S, H,
 * D * bits / 8 + 1] (`bits`-bit codes 8 / bits a byte, then the int8 zero point) and float16 scales [P * S, H, 1].
 * Returns 1, writing nothing, when x holds a non-finite value. */
int encode_packed_values(const float *x, const int64_t *slots, int64_t T, int64_t H, int64_t D, int64_t bits,
                       uint8_t *codes, uint16_t *scales) {
    if (!all_finite(x, T * H * D)) return 1;
    const int64_t width = D * bits / 8 + 1;
    const float top = (float)((1 << bits) - 1);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            const float *row = x + (t * H + h) * D;
            float low = row[0], high = row[0];
            for (int64_t d = 1; d < D; d++) {
                low = row[d] < low ? row[d] : low;
                high = row[d] > high ? row[d] : high;
            }
            const float wide = (high - low) / top, room = fabsf(low) / 120.0f;
            float value = wide > room ? wide : room;
            value = value > FP16_MAX ? FP16_MAX : value;
            const uint16_t scale16 = float_to_half(value);
            const float s = half_to_float(scale16);
            float zero = s > 0.0f ? nearbyintf(-low / s) : 0.0f;
            zero = zero < -128.0f ? -128.0f : zero > 127.0f ? 127.0f : zero;
            uint8_t *out = codes + (slots[t] * H + h) * width;
            for (int64_t d = 0; d < D; d++)
                put_code(out, d, code_of((s > 0.0f ? row[d] / s : 0.0f) + zero, top), (int)bits);
            out[width - 1] = (uint8_t)(int8_t)zero;
            scales[slots[t] * H + h] = scale16;
        }
    }
    return 0;
}
