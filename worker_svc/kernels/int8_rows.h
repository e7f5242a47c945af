/* The per-row activation quantization and the float epilogue that gemm_int8.c (VNNI) and
 * gemm_int8_amx.c (AMX-INT8) share, so that both round exactly as one torch twin
 * (worker_svc/kernels/gemm_int8.py) does. Included once by each, after its target pragma (the
 * functions here then carry that file's instruction set). Needs AVX-512 F/BW/VL. */
#ifndef INT8_ROWS_H
#define INT8_ROWS_H

#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "thread_buffer.h"
#include <string.h>

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_I32 = 2 };

/* 16 values of a row from `at` (bfloat16 or float32), lanes past `mask` zero. */
static inline __m512 load16(const void *row, int bf16, int64_t at, __mmask16 mask) {
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)row + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(mask, (const float *)row + at);
}

static inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* One row of k values -> kp bytes of round(x * 127 / max|x|) clamped to +-127, each XORed
 * with `flip` (0x80: stored as qa + 128), bytes past k the flip of 0; and the row's scale. */
static void quantize_row(const void *row, int bf16, int64_t k, int64_t kp, uint8_t flip,
                         uint8_t *q, float *scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row, bf16, i, tail_mask(k - i))));
  const float top = _mm512_reduce_max_ps(amax);
  /* 127 / top overflows for a denormal top: FLT_MAX keeps x * inv finite */
  float inv = top > 0 ? 127.0f / top : 0.0f;
  if (inv > FLT_MAX) inv = FLT_MAX;
  *scale = top / 127.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m128i vflip = _mm_set1_epi8((char)flip);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = tail_mask(k - i);
    /* VCVTPS2DQ rounds as MXCSR says: to nearest even unless someone changed it */
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row, bf16, i, mask), vinv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    _mm_mask_storeu_epi8(q + i, mask, _mm_xor_si128(_mm512_cvtepi32_epi8(v), vflip));
  }
  memset(q + k, flip, (size_t)(kp - k));
}

/* Rows of x [m, k] -> q [m, k] int8 and scales [m], as the matmul quantizes (the wrapper
 * quantizes weights with it too: ~10x faster than torch's ops, measured). */
void quantize_rows(const void *x, int bf16, int8_t *q, float *scales, int64_t m, int64_t k) {
  const int64_t row_bytes = bf16 ? 2 * k : 4 * k;
#pragma omp parallel for
  for (int64_t r = 0; r < m; r++)
    quantize_row((const char *)x + r * row_bytes, bf16, k, k, 0, (uint8_t *)q + r * k,
                 scales + r);
}

/* float32 -> bfloat16 bits, round to nearest even as torch (NaN stays a quiet NaN). */
static inline __m256i to_bf16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16),
                                 _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

/* One 16-column vector of exact int32 sums -> c's type: times the row's and the columns'
 * scales in float32, rounded once (or the sums themselves, OUT_I32, for the tests). */
static inline void store_exact(__m512i exact, float a_scale, __m512 w_scale, void *c, int kind,
                               int64_t at, __mmask16 mask) {
  if (kind == OUT_I32) {
    _mm512_mask_storeu_epi32((int32_t *)c + at, mask, exact);
    return;
  }
  const __m512 f =
      _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(a_scale)), w_scale);
  if (kind == OUT_F32)
    _mm512_mask_storeu_ps((float *)c + at, mask, f);
  else
    _mm256_mask_storeu_epi16((uint16_t *)c + at, mask, to_bf16(f));
}

#endif
