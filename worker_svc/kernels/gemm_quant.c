/* Matmul on a GGUF file's own quantized blocks, for steps of a few rows (single-stream decode):
 * c[m, n] = a[m, k] @ w[n, k]^T, where w is stored as ggml keeps it, 32 inputs per block:
 *   BITS 4 (Q4_0, Q4_1): w = scale * q + offset, q in 0..15, two per byte
 *   BITS 8 (Q8_0):       w = scale * q,          q in -128..127
 * with one float32 scale (and offset) per block of each output row.
 *
 * Why: a step of one row reads every weight once and does two flops with it, so its time is
 * the weight bytes over memory bandwidth. Q4 blocks are 0.75 bytes a weight here (16 bytes
 * of values, float32 scale and offset per 32), against 4 in float32 and 2 in bfloat16.
 * torch's own int4 kernel on AVX2 was no faster than our dense bfloat16 kernel at one row,
 * and 15x slower with float32 inputs (measured on Zen 2).
 *
 * Each block's sum is factored: sum_i a_i (s q_i + o) = s * sum_i a_i q_i + o * sum_i a_i,
 * so the loop over weights only widens q and multiplies-adds; the sums of a per block are
 * computed once per call. Products and sums are float32; c is rounded once to its dtype.
 *
 * Defines: ELEM_BF16 (a and c dtype), BITS (4 or 8). Built for a CPU level's -march with GCC
 * vector extensions (LANES from vec.h), and one x86 intrinsic to widen bytes. Output columns are spread over OpenMP threads; each
 * output is one fixed-order sum, so results do not depend on the thread count.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#include "vec.h"

#if BITS != 4 && BITS != 8
#error "BITS must be 4 or 8"
#endif

#define BLOCK 32               /* inputs per block */
#define QBYTES (BLOCK * BITS / 8)
#define VPB (BLOCK / LANES)    /* vectors per block */
#define ROWS 4                 /* rows of a per pass over the weights */

#if BITS == 4
typedef uint8_t q_t;
#define HALF (BLOCK / 2)       /* Q4: bytes of a block; byte i holds inputs i and i + 16 */
#else
typedef int8_t q_t;
#endif
static inline vf load_f32(const float *src) {
  vf v;
  memcpy(&v, src, sizeof v);
  return v;
}

/* LANES bytes widened to 32-bit lanes (VPMOVZXBD / VPMOVSXBD: GCC's generic conversion of a
 * byte vector goes through scalar registers, 2x slower here). */
static inline vi32 widen(const q_t *src) {
#if LANES == 16
  const __m128i raw = _mm_loadu_si128((const __m128i *)src);
  return (vi32)(BITS == 4 ? _mm512_cvtepu8_epi32(raw) : _mm512_cvtepi8_epi32(raw));
#else
  const __m128i raw = _mm_loadl_epi64((const __m128i *)src);
  return (vi32)(BITS == 4 ? _mm256_cvtepu8_epi32(raw) : _mm256_cvtepi8_epi32(raw));
#endif
}

/* One block's 32 values as VPB float vectors, in input order. Q4: ggml's byte i holds input
 * i in its low nibble and input i + 16 in its high one, so each group of LANES bytes,
 * widened once to 32 bits, gives two vectors: `& 15` (inputs i..) and `>> 4` (i + 16..). */
static inline void block_values(const q_t *q, vf *out) {
#if BITS == 4
  for (int v = 0; v < HALF / LANES; v++) {
    const vi32 wide = widen(q + v * LANES);
    out[v] = __builtin_convertvector(wide & 15, vf);
    out[v + HALF / LANES] = __builtin_convertvector(wide >> 4, vf);
  }
#else
  for (int v = 0; v < VPB; v++) out[v] = __builtin_convertvector(widen(q + v * LANES), vf);
#endif
}

/* `rows` (<= ROWS) rows of a (float32, kpad = blocks * 32 each) times output column j. */
static inline __attribute__((always_inline)) void
column(const float *a, const float *asum, int64_t blocks, const q_t *q, const float *scale,
       const float *offset, elem_t *c, int64_t ldc, const int rows) {
  vf acc[ROWS];
  float zero_part[ROWS];
  for (int r = 0; r < ROWS; r++) {
    acc[r] = (vf){0};
    zero_part[r] = 0.f;
  }
  for (int64_t b = 0; b < blocks; b++) {
    vf w[VPB];
    block_values(q + b * QBYTES, w);
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++) {
      if (r < rows) {
        const float *x = a + r * blocks * BLOCK + b * BLOCK;
        vf t = load_f32(x) * w[0];
        for (int v = 1; v < VPB; v++) t += load_f32(x + v * LANES) * w[v];
        acc[r] += t * scale[b];
#if BITS == 4
        zero_part[r] += offset[b] * asum[r * blocks + b];
#endif
      }
    }
  }
  (void)offset;
  (void)asum;
  for (int r = 0; r < rows; r++) store_one(hsum(acc[r]) + zero_part[r], c + r * ldc);
}

/* a [m, k] row-major contiguous; q [n][k / 32][QBYTES]; scale, offset [n][k / 32]
 * (offset unused for BITS 8); c [m, n]. k must be a multiple of 32 (the caller checks). */
void gemm_quant(const elem_t *a, const q_t *q, const float *scale, const float *offset,
                elem_t *c, int64_t m, int64_t n, int64_t k) {
  const int64_t blocks = k / BLOCK;
  float *af = malloc((size_t)(m * k + m * blocks) * sizeof(float));
  if (!af) abort();
  float *asum = af + m * k;
  for (int64_t r = 0; r < m; r++)
    for (int64_t b = 0; b < blocks; b++) {
      float sum = 0.f;
      for (int64_t i = 0; i < BLOCK; i++) {
        const float x = load_one(a + r * k + b * BLOCK + i);
        af[r * k + b * BLOCK + i] = x;
        sum += x;
      }
      asum[r * blocks + b] = sum;
    }
  for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
    const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
      const q_t *qj = q + j * blocks * QBYTES;
      const float *sj = scale + j * blocks, *oj = offset + j * blocks;
      const float *ar = af + r0 * k, *sr = asum + r0 * blocks;
      elem_t *cr = c + r0 * n + j;
      switch (rows) {  /* the row count as a constant: one copy of the loop each */
      case 1: column(ar, sr, blocks, qj, sj, oj, cr, n, 1); break;
      case 2: column(ar, sr, blocks, qj, sj, oj, cr, n, 2); break;
      case 3: column(ar, sr, blocks, qj, sj, oj, cr, n, 3); break;
      default: column(ar, sr, blocks, qj, sj, oj, cr, n, ROWS); break;
      }
    }
  }
  free(af);
}
