/* bfloat16 matmul on AMX tiles: c[m, n] = a[m, k] @ w[n, k]^T, float32 sums in the tile
 * registers, rounded once to bfloat16 (round to nearest even, as torch).
 *
 * One TDPBF16PS multiplies a 16 x 32 bfloat16 tile of a by a 32 x 16 tile of w^T into a 16 x 16
 * float32 tile: 8192 multiply-adds in one instruction, 16 times VDPBF16PS's work. Eight tile
 * registers: tmm0-3 hold a 2 x 2 block of c (32 rows x 32 columns), tmm4-5 two row tiles of a,
 * tmm6-7 two column tiles of w. Each a tile then serves two products and each w tile two.
 *
 * Why our own (bench/amx_gemm.py, 2 Emerald Rapids cores, weights from memory): up to 32 rows
 * a step is bound by the weight stream, which this kernel keeps at ~40 GB/s (prefetching the
 * next panel) where oneDNN's AMX matmul reaches 15-30: 1.2-2.4x oneDNN from 1 to 32 rows,
 * 1.1-1.2x at 64 and 128 on qkv, gate_up and down (even or behind on o and the LM head there). From 256 rows on the tiles, not memory, bound both, and oneDNN's
 * blocking is as fast or faster (this kernel reaches ~1,300 GFLOP/s a core with the weights in
 * cache, half the TDPBF16PS peak: every 2 x 2 block drains its tiles through memory to round
 * them to bfloat16), so the caller uses oneDNN there.
 *
 * Built by worker_svc/kernels/build.py at CPU level amx only. The process must hold Linux's
 * leave to use the tiles (worker_svc.kernels.cpu.request_amx, called by gemm_amx.py) before
 * the first tile instruction, else it dies on SIGILL.
 *
 * Packed weight layout (pack_weight): k padded with zeros to kp, a multiple of 32; panels of
 * NR = 32 output columns, each [kp / 32][2][16][16][2]: per step of 32 inputs, two tiles of
 * 16 columns, each 16 rows of 64 bytes, row i holding the 16 columns' weights for inputs
 * (2i, 2i + 1) side by side (the pair-interleaved layout TDPBF16PS reads its second operand
 * in). A tile is then one contiguous kilobyte, loaded with stride 64, and a panel is one
 * contiguous run, so a thread's panels stream from memory in order. n must be a multiple of
 * NR; any k (the caller checks; other shapes use oneDNN).
 *
 * Rows: tiles of 16 rows read straight from a (stride k); a last partial tile is moved back
 * to end at row m, overlapping the one before (its rows are computed twice, identically), so
 * no copy of a is made. Under 16 rows the tiles are configured with m rows. Only where k is
 * not a multiple of 32 does a staged copy of a, padded with zeros, exist.
 *
 * Work split: each OpenMP thread takes a contiguous range of panels and configures its own
 * tiles; rows go in chunks of MC so a chunk of a stays in L2 across panels, and within a
 * chunk every panel is read from memory once (its later row tiles find it in cache). While a
 * thread multiplies one panel it prefetches the next into L2. Every output element is one
 * chain of tile products over k in a fixed order, so results do not depend on the thread
 * count.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "thread_buffer.h"

#define NR 32          /* output columns per panel: two tiles of 16 */
#define KS 32          /* inputs per tile step */
#define TILE_ELEMS 512 /* bfloat16 values in one 16 x 64-byte tile */
#define MC 256         /* rows per chunk kept in L2 */

int64_t packed_size(int64_t n, int64_t k) { return n * round_up(k, KS); }

/* w [n, k] row-major -> packed [n / NR][kp / 32][2][16][16][2], zeros past k. */
void pack_weight(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
  const int64_t steps = round_up(k, KS) / KS;
#pragma omp parallel for
  for (int64_t panel = 0; panel < n / NR; panel++)
    for (int64_t s = 0; s < steps; s++)
      for (int64_t h = 0; h < 2; h++) {
        uint16_t *tile = packed + ((panel * steps + s) * 2 + h) * TILE_ELEMS;
        for (int64_t i = 0; i < 16; i++)
          for (int64_t j = 0; j < 16; j++)
            for (int64_t t = 0; t < 2; t++) {
              const int64_t col = panel * NR + h * 16 + j, in = s * KS + 2 * i + t;
              tile[i * 32 + j * 2 + t] = in < k ? w[col * k + in] : 0;
            }
      }
}

/* One 16 x 16 float32 tile (stored to `acc`, 64-byte rows) -> `rows` rows of c, rounded. */
static inline void store_tile(const float *acc, uint16_t *c, int64_t ldc, int rows) {
  for (int r = 0; r < rows; r++)
    _mm256_storeu_si256((__m256i *)(c + r * ldc),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + r * 16)));
}

/* Prefetches up to `count` lines from *next on (stopping at end) into L2. */
static inline void prefetch_lines(const char **next, const char *end, int64_t count) {
  const char *p = *next;
  for (int64_t i = 0; i < count && p < end; i++, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  *next = p;
}

/* Two row tiles (a0, a1) times one panel -> c rows r0.., r1.. (32 columns). */
static inline void tiles_2x2(const uint16_t *a0, const uint16_t *a1, int64_t lda,
                             const uint16_t *panel, int64_t steps, uint16_t *c0, uint16_t *c1,
                             int64_t ldc, int rows, float *acc, const char **next,
                             const char *next_end, int64_t per_step) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; s++) {
    prefetch_lines(next, next_end, per_step);
    const uint16_t *b = panel + s * 2 * TILE_ELEMS;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE_ELEMS, 64);
    _tile_loadd(4, a0 + s * KS, lda * 2);
    _tile_loadd(5, a1 + s * KS, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
  _tile_stored(2, acc + 512, 64);
  _tile_stored(3, acc + 768, 64);
  store_tile(acc, c0, ldc, rows);
  store_tile(acc + 256, c0 + 16, ldc, rows);
  store_tile(acc + 512, c1, ldc, rows);
  store_tile(acc + 768, c1 + 16, ldc, rows);
}

/* One row tile times one panel. */
static inline void tiles_1x2(const uint16_t *a0, int64_t lda, const uint16_t *panel,
                             int64_t steps, uint16_t *c0, int64_t ldc, int rows, float *acc,
                             const char **next, const char *next_end, int64_t per_step) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t s = 0; s < steps; s++) {
    prefetch_lines(next, next_end, per_step);
    const uint16_t *b = panel + s * 2 * TILE_ELEMS;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE_ELEMS, 64);
    _tile_loadd(4, a0 + s * KS, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
  store_tile(acc, c0, ldc, rows);
  store_tile(acc + 256, c0 + 16, ldc, rows);
}

/* First row of row tile t: tiles of 16, the last moved back to end at row m. */
static inline int64_t tile_row(int64_t t, int64_t m) {
  return m <= 16 ? 0 : (16 * t < m - 16 ? 16 * t : m - 16);
}

static void run(const uint16_t *a, int64_t lda, const uint16_t *packed, uint16_t *c, int64_t m,
                int64_t n, int64_t steps) {
  const int rows = m < 16 ? (int)m : 16;
  const int64_t row_tiles = (m + 15) / 16, panels = n / NR;
  const int64_t panel_elems = steps * 2 * TILE_ELEMS, panel_lines = panel_elems * 2 / 64;
#pragma omp parallel
  {
    config_matmul_tiles(rows);
    float acc[4 * 256] __attribute__((aligned(64)));
    int64_t first, end;
    thread_share(panels, &first, &end);
    for (int64_t t0 = 0; t0 < row_tiles; t0 += MC / 16) {
      const int64_t t1 = t0 + MC / 16 < row_tiles ? t0 + MC / 16 : row_tiles;
      const int64_t per_step = lines_per_step(panel_lines, (t1 - t0 + 1) / 2, steps);
      for (int64_t panel = first; panel < end; panel++) {
        const uint16_t *w = packed + panel * panel_elems;
        const char *next = (const char *)(w + panel_elems);
        const char *next_end = panel + 1 < end ? next + panel_lines * 64 : next;
        for (int64_t t = t0; t < t1; t += 2) {
          const int64_t r0 = tile_row(t, m);
          uint16_t *c0 = c + r0 * n + panel * NR;
          if (t + 1 < t1) {
            const int64_t r1 = tile_row(t + 1, m);
            tiles_2x2(a + r0 * lda, a + r1 * lda, lda, w, steps, c0, c + r1 * n + panel * NR,
                      n, rows, acc, &next, next_end, per_step);
          } else {
            tiles_1x2(a + r0 * lda, lda, w, steps, c0, n, rows, acc, &next, next_end,
                      per_step);
          }
        }
      }
    }
    _tile_release();
  }
}

/* ---- bfloat16 activations on a GGUF's quantized blocks (gemm_amx_blocks) ----
 *
 * The weight stays in its blocks, w = scale * q + offset per 32 inputs of an output column,
 * and each thread dequantizes one panel at a time into pack_weight's layout in a buffer it
 * keeps in L1/L2, then runs the same tile products over it. A decode step of 64 rows is
 * bound by the weight stream; the blocks are 0.625 bytes a weight at 4 bits (1.06 at 8)
 * against bfloat16's 2. The dequantized values are those of the dense path's
 * bfloat16(scale * q + offset) (float32, then rounded to nearest even: scale * q is exact, so
 * one FMA rounds as its multiply-then-add), and the products run in the same order, so the
 * result is gemm_amx's on that dense weight, bit for bit.
 *
 * Block layout (made by gemm_amx.py): per panel, per step of 32 inputs, per tile half, per
 * tile row i: the row's 32 values (16 columns x inputs 2i, 2i + 1, pack_weight's order) as 32
 * int8 (8 bits), or as 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31 (4
 * bits, 0..15); scales and offsets [panel][step][32 columns] float16 (offsets may be NULL:
 * all zero). k must be a multiple of 32, n of NR. */

/* One tile row's 32 values -> 32 bfloat16 of scale * q + offset (scale and offset already
 * spread to the row's element order: columns repeat twice). */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *src, int bits,
                                                              __m512 d0, __m512 d1, __m512 o0,
                                                              __m512 o1, uint16_t *dst) {
  __m512i v0, v1;
  if (bits == 4) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src), nib = _mm_set1_epi8(0x0F);
    v0 = _mm512_cvtepu8_epi32(_mm_and_si128(b, nib));
    v1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), nib));
  } else {
    v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src));
    v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16)));
  }
  const __m512 f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), d0, o0);
  const __m512 f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), d1, o1);
  _mm512_store_si512((__m512i *)dst, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
}

/* One panel's blocks (`steps` steps of 32 inputs) -> pack_weight's layout in `out`. */
static inline __attribute__((always_inline)) void dequant_panel(
    const uint8_t *q, int bits, const uint16_t *scales, const uint16_t *offsets,
    int64_t steps, uint16_t *out) {
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const int64_t row_bytes = bits == 4 ? 16 : 32;
  for (int64_t s = 0; s < steps; s++)
    for (int64_t h = 0; h < 2; h++) {
      const int64_t at = s * NR + h * 16;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + at)));
      const __m512 o = offsets ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(offsets + at)))
                               : _mm512_setzero_ps();
      const __m512 d0 = _mm512_permutexvar_ps(first, d), d1 = _mm512_permutexvar_ps(second, d);
      const __m512 o0 = _mm512_permutexvar_ps(first, o), o1 = _mm512_permutexvar_ps(second, o);
      const uint8_t *src = q + (s * 2 + h) * 16 * row_bytes;
      uint16_t *dst = out + (s * 2 + h) * TILE_ELEMS;
      for (int64_t i = 0; i < 16; i++)
        dequant_row(src + i * row_bytes, bits, d0, d1, o0, o1, dst + i * 32);
    }
}

/* c [m, n] = a [m, k] @ w^T, w as blocks (layout above); a and c row-major, contiguous. */
void gemm_amx_blocks(const uint16_t *a, const uint8_t *values, int bits,
                     const uint16_t *scales, const uint16_t *offsets, uint16_t *c, int64_t m,
                     int64_t n, int64_t k) {
  if (m <= 0 || n <= 0) return;
  const int rows = m < 16 ? (int)m : 16;
  const int64_t steps = k / KS, row_tiles = (m + 15) / 16, panels = n / NR;
  const int64_t value_bytes = steps * 2 * 16 * (bits == 4 ? 16 : 32), float_elems = steps * NR;
  const int64_t panel_lines = value_bytes / 64;
#pragma omp parallel
  {
    config_matmul_tiles(rows);
    float acc[4 * 256] __attribute__((aligned(64)));
    uint16_t *w = thread_buffer((size_t)steps * 2 * TILE_ELEMS * 2);
    int64_t first, end;
    thread_share(panels, &first, &end);
    for (int64_t t0 = 0; t0 < row_tiles; t0 += MC / 16) {
      const int64_t t1 = t0 + MC / 16 < row_tiles ? t0 + MC / 16 : row_tiles;
      const int64_t per_step = lines_per_step(panel_lines, (t1 - t0 + 1) / 2, steps);
      for (int64_t panel = first; panel < end; panel++) {
        const uint8_t *q = values + panel * value_bytes;
        const uint16_t *d = scales + panel * float_elems;
        const uint16_t *o = offsets ? offsets + panel * float_elems : NULL;
        if (panel + 1 < end) {
          for (int64_t l = 0; l < float_elems * 2; l += 64) {
            _mm_prefetch((const char *)(d + float_elems) + l, _MM_HINT_T0);
            if (o) _mm_prefetch((const char *)(o + float_elems) + l, _MM_HINT_T0);
          }
        }
        if (bits == 4)
          dequant_panel(q, 4, d, o, steps, w);
        else
          dequant_panel(q, 8, d, o, steps, w);
        const char *next = (const char *)(q + value_bytes);
        const char *next_end = panel + 1 < end ? next + value_bytes : next;
        for (int64_t t = t0; t < t1; t += 2) {
          const int64_t r0 = tile_row(t, m);
          uint16_t *c0 = c + r0 * n + panel * NR;
          if (t + 1 < t1) {
            const int64_t r1 = tile_row(t + 1, m);
            tiles_2x2(a + r0 * k, a + r1 * k, k, w, steps, c0, c + r1 * n + panel * NR, n,
                      rows, acc, &next, next_end, per_step);
          } else {
            tiles_1x2(a + r0 * k, k, w, steps, c0, n, rows, acc, &next, next_end, per_step);
          }
        }
      }
    }
    _tile_release();
  }
}

/* c [m, n] = a [m, k] @ w^T, w given packed by pack_weight; a and c row-major, contiguous. */
void gemm_amx(const uint16_t *a, const uint16_t *packed, uint16_t *c, int64_t m, int64_t n,
              int64_t k) {
  const int64_t kp = round_up(k, KS);
  if (m <= 0 || n <= 0) return;
  if (kp == k) {
    run(a, k, packed, c, m, n, kp / KS);
    return;
  }
  /* k not a multiple of 32: the tiles read whole steps, so a is copied with zeros past k */
  uint16_t *staged = aligned_alloc(64, round_up(m * kp * 2, 64));
  if (staged == NULL) abort();
  for (int64_t r = 0; r < m; r++) {
    memcpy(staged + r * kp, a + r * k, k * 2);
    memset(staged + r * kp + k, 0, (kp - k) * 2);
  }
  run(staged, kp, packed, c, m, n, kp / KS);
  free(staged);
}
