/* Vector helpers shared by the CPU kernels: float vectors of LANES lanes (GCC vector
 * extensions, lowered to whatever SIMD the CPU level's -march offers), the tensor element
 * type chosen by ELEM_BF16, and a vectorized exp.
 *
 * bfloat16 is the top half of a float: widening is a shift; narrowing rounds to nearest even
 * exactly as torch does, and keeps NaN a NaN. */
#ifndef SPLITSERVE_VEC_H
#define SPLITSERVE_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef LANES /* one register's worth of floats for the target */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#endif
#ifndef ELEM_BF16
#error "ELEM_BF16 must be defined (1: bfloat16 tensors, 0: float32)"
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu32 __attribute__((vector_size(LANES * 4)));
typedef int32_t vi32 __attribute__((vector_size(LANES * 4)));
typedef uint16_t vu16 __attribute__((vector_size(LANES * 2)));

#if ELEM_BF16
typedef uint16_t elem_t;

static inline vf load_vec(const uint16_t *src) {
  vu16 raw;
  memcpy(&raw, src, sizeof raw);
  return (vf)(__builtin_convertvector(raw, vu32) << 16);
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && LANES == 16
#include <immintrin.h>
/* One instruction: VCVTNEPS2BF16 rounds to nearest even like the code below and keeps a NaN
 * a NaN (made quiet); it differs only below float32's smallest normal (~1.2e-38), which it
 * flushes to zero. */
static inline void store_vec(vf v, uint16_t *dst) {
  __m256bh narrow = _mm512_cvtneps_pbh((__m512)v);
  memcpy(dst, &narrow, sizeof narrow);
}
#else
static inline void store_vec(vf v, uint16_t *dst) {
  vu32 bits = (vu32)v;
  vu32 rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
  vi32 is_nan = (bits & 0x7fffffff) > 0x7f800000;
  rounded = (vu32)((vi32)rounded & ~is_nan) | ((vu32)is_nan & ((bits >> 16) | 0x40));
  vu16 narrow = __builtin_convertvector(rounded, vu16);
  memcpy(dst, &narrow, sizeof narrow);
}
#endif

static inline float load_one(const uint16_t *src) {
  uint32_t bits = (uint32_t)*src << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline void store_one(float f, uint16_t *dst) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffff) > 0x7f800000)
    *dst = (uint16_t)((bits >> 16) | 0x40);
  else
    *dst = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}
#else
typedef float elem_t;

static inline vf load_vec(const float *src) {
  vf v;
  memcpy(&v, src, sizeof v);
  return v;
}

static inline void store_vec(vf v, float *dst) { memcpy(dst, &v, sizeof v); }
static inline float load_one(const float *src) { return *src; }
static inline void store_one(float f, float *dst) { *dst = f; }
#endif

#ifdef __has_builtin
#if __has_builtin(__builtin_shufflevector)
#define VEC_HAS_SHUFFLEVECTOR 1
#endif
#endif

/* Sum of a vector's lanes by halving (log2(LANES) dependent adds, not LANES - 1). */
static inline float hsum(vf v) {
  typedef float vf4 __attribute__((vector_size(16)));
#if LANES == 4
  vf4 b = v;
#elif defined(VEC_HAS_SHUFFLEVECTOR)
#if LANES == 16
  typedef float vf8 __attribute__((vector_size(32)));
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
  vf4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#endif
#else
  /* GCC before 12 has no __builtin_shufflevector: the same halves through memcpy, which it
   * folds into the same lane extracts (GCC 12 would spill to the stack, hence the builtin). */
  typedef float vf8 __attribute__((vector_size(32)));
  vf8 a;
  memcpy(&a, &v, sizeof a);
#if LANES == 16
  vf8 a_high;
  memcpy(&a_high, (const char *)&v + sizeof a, sizeof a);
  a += a_high;
#endif
  vf4 b, b_high;
  memcpy(&b, &a, sizeof b);
  memcpy(&b_high, (const char *)&a + sizeof b, sizeof b);
  b += b_high;
#endif
  return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (scores minus their running max), vectorized: x = k ln2 + r with
 * |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (relative error below 2e-7), 2^k built in
 * the exponent bits. Inputs below -87 give 0. */
static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.0f;
  vi32 tiny = x < lo;
  x = (vf)((vi32)x & ~tiny) + (vf)((vi32)lo & tiny); /* max(x, -87) */
  vf kf = x * 1.44269504088896341f;
  vi32 k = __builtin_convertvector(kf - 0.5f, vi32);  /* floor(kf + 0.5) for kf <= 0.5 */
  kf = __builtin_convertvector(k, vf);
  vf r = x - kf * 0.693359375f + kf * 2.12194440e-4f;  /* x - k ln2, ln2 in two parts */
  vf p = (vf){0} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi32 scale = (k + 127) << 23;
  vf result = p * (vf)scale;
  return (vf)((vi32)result & ~tiny);
}

/* ---- An 8-bit float KV cache (KV_FP8: 1 = float8 e4m3fn, 2 = float8 e5m2; 0 or undefined:
 * the cache holds elem_t), as worker_svc/kernels/kv_quant.py defines it: stored =
 * saturate(x / scale) rounded to nearest even, read = stored * scale. Only the attention
 * kernels define KV_FP8; nothing above depends on it.
 *
 * Reading (load_fp8_vec): as float16, which holds every value of both formats, converted by
 * F16C; without it, a byte s.eeee.mmm (e5m2: s.eeeee.mm) sign-extended to 32 bits and masked
 * to the sign and its 7 low bits at float32's sign, exponent and mantissa positions is the
 * same number times 2^-120 (e5m2: 2^-112), for subnormals too (they land on float32
 * subnormals), and one multiply makes it exact as long as subnormals are not flushed (no
 * -ffast-math, no DAZ). A NaN byte reads as NaN through F16C in e5m2, as 480 in e4m3fn: a
 * write never stores one from finite inputs (it saturates).
 *
 * Writing rounds exactly as torch's float32 -> float8 conversion after the clamp (tests compare
 * the bytes): magnitudes past the largest finite value saturate to it (infinities too), NaN
 * stays NaN (0x7f with its sign), normals round their mantissa to nearest even by integer
 * arithmetic on the float's bits (a carry moves into the exponent, as it should), subnormals
 * as x / step rounded by one float32 add of 2^23 (nearest even: the default rounding mode). */
#if defined(KV_FP8) && KV_FP8 != 0
#include <immintrin.h>
#if KV_FP8 == 1
#define FP8_MANT_BITS 3
#define FP8_BIAS 7
#define FP8_UNBIAS 0x1p120f             /* 2^(float32's bias 127 - 7) */
#define FP8_MAX_BITS 0x43e00000u        /* 448.0f */
#define FP8_MIN_NORMAL_BITS 0x3c800000u /* 2^-6 */
#define FP8_INV_STEP 0x1p9f             /* 1 / the subnormal step 2^-9 */
#elif KV_FP8 == 2
#define FP8_MANT_BITS 2
#define FP8_BIAS 15
#define FP8_UNBIAS 0x1p112f             /* 2^(127 - 15) */
#define FP8_MAX_BITS 0x47600000u        /* 57344.0f */
#define FP8_MIN_NORMAL_BITS 0x38800000u /* 2^-14 */
#define FP8_INV_STEP 0x1p16f            /* 1 / 2^-16 */
#else
#error "KV_FP8 must be 0 (none), 1 (e4m3fn) or 2 (e5m2)"
#endif
#define FP8_SHIFT (23 - FP8_MANT_BITS) /* float32 mantissa bits the format drops */

typedef uint8_t kv_t;
typedef int8_t vi8 __attribute__((vector_size(LANES)));
typedef uint8_t vu8 __attribute__((vector_size(LANES)));

/* LANES stored bytes as float32 values divided by FP8_READ_SCALE (a power of two the
 * kernels fold into the scales), not yet times the cache's scale: through the F16C
 * conversion where the level has it (every level does: x86-64-v3), else by the multiply
 * described above. e5m2 is the upper byte of a float16; e4m3's 7 bits sit one place lower
 * in float16's, with the exponent 8 short (hence 256). Measured, 2 Zen 5 cores: the
 * multiply on float32 subnormals (e4m3's 2^-9 .. 2^-7, 1.2% of normal-distributed values) costs
 * a microcode assist each, 1.5x the whole decode step's time; the conversion takes float16
 * subnormals at full speed. (GCC 12 also widens a plain C vector of bytes lane by lane through
 * general registers, ~40 instructions for 16 lanes, hence intrinsics here.) */
#if KV_FP8 == 1
#define FP8_READ_SCALE 256.f
/* the byte sign-extended to 16 bits, moved up 7 places and masked to its sign and 7 low bits */
#define FP8_HALF(words, and, shift, set1) and(shift(words, 7), set1((short)0xbf80))
#else
#define FP8_READ_SCALE 1.f
/* (moved up 8 places, nothing of the sign extension is left: no mask; 0.95x the time of a
 * float32 prefill chunk of 512 tokens with it, 1 thread of a Zen 5) */
#define FP8_HALF(words, and, shift, set1) shift(words, 8)
#endif

static inline vf load_fp8_vec(const uint8_t *src) {
#if LANES == 16 && defined(__AVX512F__)
  const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src));
  return (vf)_mm512_cvtph_ps(
      FP8_HALF(words, _mm256_and_si256, _mm256_slli_epi16, _mm256_set1_epi16));
#elif LANES == 8 && defined(__AVX2__) && defined(__F16C__)
  const __m128i words = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)src));
  return (vf)_mm256_cvtph_ps(FP8_HALF(words, _mm_and_si128, _mm_slli_epi16, _mm_set1_epi16));
#else
  vi8 raw;
  memcpy(&raw, src, sizeof raw);
  const vu32 wide = (vu32)__builtin_convertvector(raw, vi32);
  return (vf)((wide << FP8_SHIFT) & (0x80000000u | (0x7fu << FP8_SHIFT)))
         * (FP8_UNBIAS / FP8_READ_SCALE);
#endif
}

/* LANES float32 values (already divided by the scale) as stored bytes. */
static inline void store_fp8_vec(vf x, uint8_t *dst) {
  const vu32 bits = (vu32)x, sign = (bits >> 24) & 0x80;
  vu32 mag = bits & 0x7fffffff;
  const vu32 nan = (vu32)(mag > 0x7f800000u);
  const vu32 big = (vu32)(mag > FP8_MAX_BITS);
  mag = (mag & ~big) | (FP8_MAX_BITS & big);
  const vu32 normal = ((mag + ((1u << (FP8_SHIFT - 1)) - 1) + ((mag >> FP8_SHIFT) & 1))
                       >> FP8_SHIFT) - ((127u - FP8_BIAS) << FP8_MANT_BITS);
  const vf steps = (vf)mag * FP8_INV_STEP + 0x1p23f; /* 2^23 + round(|x| / step) */
  const vu32 subnormal = (vu32)steps - 0x4b000000u;
  const vu32 tiny = (vu32)(mag < FP8_MIN_NORMAL_BITS);
  vu32 out = ((normal & ~tiny) | (subnormal & tiny)) & 0x7f;
  out = ((out & ~nan) | (0x7f & nan)) | sign;
  const vu8 narrow = __builtin_convertvector(out, vu8);
  memcpy(dst, &narrow, sizeof narrow);
}
#endif

#endif
