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

#endif
