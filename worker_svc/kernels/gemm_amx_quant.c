/* float32 matmul on a GGUF's quantized blocks on AMX tiles: c[m, n] = a[m, k] @ w[n, k]^T with
 *   w = scale * q + offset per block of 32 inputs of an output row (Q4_0, Q4_1: q in 0..15;
 *   Q8_0: q in -128..127, offset 0),
 * every product exact and every sum in float32: a float32 matmul, on bfloat16 tiles.
 *
 * How: q is an integer of at most 8 bits, so bfloat16 (8 significant bits) holds it exactly.
 * Each row of a is split into three bfloat16 parts, a = hi + mid + lo: hi = a rounded to
 * bfloat16, mid = (a - hi) rounded, lo = a - hi - mid, which has at most 8 significant bits
 * left and is exact (float32's 24 = 3 x 8; bfloat16 has float32's exponent range). A product
 * of a part and q then has at most 16 bits and is exact in float32, and TDPBF16PS adds the
 * products into float32 sums. Per block b, with the block's sums of a precomputed (asum):
 *   c += scale_b * (sum over the block of (hi + mid + lo) q) + offset_b * asum_b
 * which is gemm_quant.c's factoring (the small-step kernel), and its result up to the order of
 * the float32 sums. The tiles' float32 arithmetic rounds to nearest
 * even and treats denormals as zero (a part below 2^-126, where a is below ~2^-110: none in a
 * model's activations).
 *
 * Why: a float32 matmul of 64 rows or more on float32 FMA is bound by the FMA units (~300
 * GFLOP/s on 2 Emerald Rapids cores), not by memory. Here the packed q take 2 bytes a weight
 * against float32's 4, and the tiles do the products: 1.2-1.9x gemm_fma.c at 64-128 rows and
 * 1.2-1.5x at 2,816 (bench/amx_gemm.py --dtype float32). Bounds: three tile products per
 * block where bfloat16 needs one, and the fold (a tile store and 16 rows of vector work per
 * tile and block), about a quarter of the time. Folding block s after block s + 1's products
 * were issued (a double buffer) measured no faster.
 *
 * Built by worker_svc/kernels/build.py at CPU level amx only (it needs AVX512-BF16 for the
 * split and AMX-BF16 for the products). The process must hold Linux's leave to use the tiles
 * (worker_svc.kernels.cpu.request_amx, called by gemm_amx_quant.py) before the first tile
 * instruction, else it dies on SIGILL.
 *
 * Packed layout (pack_values, pack_block_floats): panels of NR = 32 output columns; a panel's
 * q are [k / 32][2][16][16][2] bfloat16, as gemm_amx.c packs a dense weight (per block of 32
 * inputs two tiles of 16 columns, row i holding inputs 2i and 2i + 1 of the 16 columns side by
 * side), and its scales and offsets [k / 32][32] float32. n must be a multiple of NR and k of
 * 32 (the caller checks).
 *
 * Per 2 x 2 block of c tiles (32 rows x 32 columns) and block of inputs: the three parts'
 * products go into four zeroed tiles, which are stored and folded into float32 sums in memory
 * (fold: scale and offset per column, asum per row). The split parts lie tile by tile (each A
 * tile one contiguous kilobyte, rows past m zero, their results not stored), in a scratch the
 * calling thread keeps. Each OpenMP thread takes a contiguous range of panels; while it
 * multiplies one panel it prefetches the next into L2. Every output is one fixed chain of
 * sums, so results do not depend on the thread count.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "thread_buffer.h"

#define NR 32          /* output columns per panel: two tiles of 16 */
#define KS 32          /* inputs per block, and per tile product */
#define TILE_ELEMS 512 /* bfloat16 values in one 16 x 64-byte tile */
#define MC 128         /* rows per chunk kept in L2 */

/* q [n, k] (one value a byte: uint8 for bits 4, int8 for bits 8) -> [n / NR][k / 32][2][16]
 * [16][2] bfloat16, each value exact. */
void pack_values(const uint8_t *q, int bits, uint16_t *packed, int64_t n, int64_t k) {
  const int64_t steps = k / KS;
#pragma omp parallel for
  for (int64_t panel = 0; panel < n / NR; panel++)
    for (int64_t s = 0; s < steps; s++)
      for (int64_t h = 0; h < 2; h++) {
        uint16_t *tile = packed + ((panel * steps + s) * 2 + h) * TILE_ELEMS;
        for (int64_t i = 0; i < 16; i++)
          for (int64_t j = 0; j < 16; j++)
            for (int64_t t = 0; t < 2; t++) {
              const uint8_t raw = q[(panel * NR + h * 16 + j) * k + s * KS + 2 * i + t];
              const float v = bits == 8 ? (float)(int8_t)raw : (float)raw;
              uint32_t u;
              memcpy(&u, &v, 4);
              tile[i * 32 + j * 2 + t] = (uint16_t)(u >> 16); /* exact: no bits below */
            }
      }
}

/* A per-block table [n, k / 32] float32 (scales or offsets) -> [n / NR][k / 32][NR]. */
void pack_block_floats(const float *src, float *packed, int64_t n, int64_t blocks) {
  for (int64_t panel = 0; panel < n / NR; panel++)
    for (int64_t b = 0; b < blocks; b++)
      for (int64_t j = 0; j < NR; j++)
        packed[(panel * blocks + b) * NR + j] = src[(panel * NR + j) * blocks + b];
}

static inline __m512 widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* Rows of a [m, k] float32 -> parts, tile by tile: [m / 16 rounded up][k / 32][3][16][32]
 * bfloat16 (hi, mid, lo of 16 rows x 32 inputs; a = hi + mid + lo exactly; rows past m
 * zero), so that each A tile is one contiguous kilobyte; and asum [m][k / 32], each block's
 * float32 sum (its two halves added lane by lane, then the lanes in a fixed tree). */
static void split_rows(const float *a, int64_t m, int64_t k, uint16_t *parts, float *asum) {
  const int64_t blocks = k / KS, tiles = (m + 15) / 16;
#pragma omp parallel for
  for (int64_t rt = 0; rt < tiles; rt++)
    for (int64_t b = 0; b < blocks; b++) {
      uint16_t *dst = parts + (rt * blocks + b) * 3 * TILE_ELEMS;
      for (int64_t i = 0; i < 16; i++) {
        const int64_t r = rt * 16 + i;
        if (r >= m) {
          for (int p = 0; p < 3; p++) memset(dst + p * TILE_ELEMS + i * KS, 0, KS * 2);
          continue;
        }
        __m512 sum = _mm512_setzero_ps();
        for (int64_t v = 0; v < KS; v += 16) {
          const __m512 x = _mm512_loadu_ps(a + r * k + b * KS + v);
          const __m256i hi = (__m256i)_mm512_cvtneps_pbh(x);
          const __m512 rest = _mm512_sub_ps(x, widen_bf16(hi));
          const __m256i mid = (__m256i)_mm512_cvtneps_pbh(rest);
          const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(rest, widen_bf16(mid)));
          _mm256_storeu_si256((__m256i *)(dst + i * KS + v), hi);
          _mm256_storeu_si256((__m256i *)(dst + TILE_ELEMS + i * KS + v), mid);
          _mm256_storeu_si256((__m256i *)(dst + 2 * TILE_ELEMS + i * KS + v), lo);
          sum = _mm512_add_ps(sum, x);
        }
        asum[r * blocks + b] = _mm512_reduce_add_ps(sum);
      }
    }
}

/* sums[r] (16 columns) += offset * asum[r] + scale * t[r], for `rows` rows of one tile. */
static inline void fold(const float *t, float *sums, const float *scale, const float *offset,
                        const float *asum, int64_t blocks, int rows) {
  const __m512 d = _mm512_loadu_ps(scale);
  if (offset) {
    const __m512 o = _mm512_loadu_ps(offset);
    for (int r = 0; r < rows; r++) {
      const __m512 acc = _mm512_fmadd_ps(o, _mm512_set1_ps(asum[r * blocks]),
                                         _mm512_load_ps(sums + r * 16));
      _mm512_store_ps(sums + r * 16, _mm512_fmadd_ps(_mm512_load_ps(t + r * 16), d, acc));
    }
  } else {
    for (int r = 0; r < rows; r++)
      _mm512_store_ps(sums + r * 16, _mm512_fmadd_ps(_mm512_load_ps(t + r * 16), d,
                                                     _mm512_load_ps(sums + r * 16)));
  }
}

/* Rows of the tile starting at row r that are rows of a (`rows`: the tiles' configured rows). */
static inline int valid(int64_t r, int64_t m, int rows) {
  return m - r < rows ? (int)(m - r) : rows;
}

/* Prefetches up to `count` lines from *next on (stopping at end) into L2. */
static inline void prefetch_lines(const char **next, const char *end, int64_t count) {
  const char *p = *next;
  for (int64_t i = 0; i < count && p < end; i++, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  *next = p;
}

typedef struct {
  const uint16_t *parts; /* split_rows' tiles */
  const float *asum;     /* [m][blocks] */
  int64_t m, k, blocks;
} rows_t;

/* Row tiles starting at r0 and r1 (r1 < 0: one tile) times one panel -> c. */
static void panel_tiles(const rows_t *x, int64_t r0, int64_t r1, const uint16_t *panel,
                        const float *scales, const float *offsets, float *c, int64_t ldc,
                        int rows, float *t, float *sums, const char **next,
                        const char *next_end, int64_t per_step) {
  const int tiles = r1 < 0 ? 2 : 4;
  const uint16_t *a0 = x->parts + r0 / 16 * x->blocks * 3 * TILE_ELEMS;
  const uint16_t *a1 = x->parts + (r1 < 0 ? 0 : r1 / 16) * x->blocks * 3 * TILE_ELEMS;
  memset(sums, 0, (size_t)tiles * 256 * sizeof(float));
  for (int64_t s = 0; s < x->blocks; s++) {
    prefetch_lines(next, next_end, per_step);
    const uint16_t *b = panel + s * 2 * TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE_ELEMS, 64);
    if (r1 >= 0) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int p = 0; p < 3; p++) {
      _tile_loadd(4, a0 + (s * 3 + p) * TILE_ELEMS, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (r1 >= 0) {
        _tile_loadd(5, a1 + (s * 3 + p) * TILE_ELEMS, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, t, 64);
    _tile_stored(1, t + 256, 64);
    if (r1 >= 0) {
      _tile_stored(2, t + 512, 64);
      _tile_stored(3, t + 768, 64);
    }
    const float *d = scales + s * NR, *o = offsets ? offsets + s * NR : NULL;
    for (int i = 0; i < tiles; i++) {
      const int64_t r = i < 2 ? r0 : r1;
      fold(t + i * 256, sums + i * 256, d + (i & 1) * 16, o ? o + (i & 1) * 16 : NULL,
           x->asum + r * x->blocks + s, x->blocks, valid(r, x->m, rows));
    }
  }
  for (int i = 0; i < tiles; i++) {
    const int64_t r0i = i < 2 ? r0 : r1;
    float *dst = c + r0i * ldc + (i & 1) * 16;
    for (int r = 0; r < valid(r0i, x->m, rows); r++)
      _mm512_storeu_ps(dst + r * ldc, _mm512_load_ps(sums + i * 256 + r * 16));
  }
}

/* c [m, n] float32 = a [m, k] float32 @ w^T, w packed by pack_values (q) and
 * pack_block_floats (scales; offsets, or NULL where every offset is 0, as in Q8_0). */
void gemm_amx_quant(const float *a, const uint16_t *values, const float *scales,
                    const float *offsets, float *c, int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0) return;
  const int64_t blocks = k / KS;
  const size_t parts_bytes = (size_t)((m + 15) / 16 * blocks * 3 * TILE_ELEMS * 2);
  char *buffer = thread_buffer(parts_bytes + (size_t)round_up(m * blocks * 4, 64));
  uint16_t *parts = (uint16_t *)buffer;
  float *asum = (float *)(buffer + parts_bytes);
  split_rows(a, m, k, parts, asum);
  const rows_t x = {parts, asum, m, k, blocks};
  const int rows = m < 16 ? (int)m : 16;
  const int64_t row_tiles = (m + 15) / 16, panels = n / NR;
  const int64_t panel_elems = blocks * 2 * TILE_ELEMS, panel_lines = panel_elems * 2 / 64;
#pragma omp parallel
  {
    config_matmul_tiles(rows);
    float t[4 * 256] __attribute__((aligned(64)));
    float sums[4 * 256] __attribute__((aligned(64)));
    int64_t first, end;
    thread_share(panels, &first, &end);
    for (int64_t t0 = 0; t0 < row_tiles; t0 += MC / 16) {
      const int64_t t1 = t0 + MC / 16 < row_tiles ? t0 + MC / 16 : row_tiles;
      const int64_t per_step = lines_per_step(panel_lines, (t1 - t0 + 1) / 2, blocks);
      for (int64_t panel = first; panel < end; panel++) {
        const uint16_t *w = values + panel * panel_elems;
        const char *next = (const char *)(w + panel_elems);
        const char *next_end = panel + 1 < end ? next + panel_lines * 64 : next;
        const float *d = scales + panel * blocks * NR;
        const float *o = offsets ? offsets + panel * blocks * NR : NULL;
        for (int64_t tt = t0; tt < t1; tt += 2)
          panel_tiles(&x, 16 * tt, tt + 1 < t1 ? 16 * (tt + 1) : -1, w, d, o,
                      c + panel * NR, n, rows, t, sums, &next, next_end, per_step);
      }
    }
    _tile_release();
  }
}
