/* int8 matmul with AVX512-VNNI: c[m, n] = a[m, k] @ w[n, k]^T, where w was quantized at load
 * (int8, one float32 scale per output column) and a is quantized here, per row, on the fly:
 *   a_scale[r] = max |a[r, :]| / 127, qa[r, i] = round(a[r, i] * 127 / max |a[r, :]|)
 * (nearest even, clamped to +-127), acc = qa @ qw^T in int32 (exact), and
 *   c[r, j] = acc[r, j] * a_scale[r] * w_scale[j]
 * in float32, in that order, rounded once to c's type (bfloat16 by integer round to nearest
 * even, torch's conversion, denormals kept). worker_svc/kernels/gemm_int8.py holds the torch
 * twin of every step; the tests compare bit for bit.
 *
 * VPDPBUSD multiplies unsigned by signed bytes, four pairs per 32-bit lane: 64 multiply-adds
 * an instruction, twice VDPBF16PS's. The activations are stored shifted, qa + 128 (0..255;
 * the byte is qa ^ 0x80), so each sum carries 128 * sum_i qw[j, i] extra, which pack_weight
 * computes once per column (`corr`) and the epilogue subtracts. Every lane's sum stays below
 * 255 * 127 * k: exact in int32 for k up to 66,000 (the wrapper checks). Integer sums do not
 * depend on their order, so results do not depend on the thread count.
 *
 * Measured (bench/int8_gemm.py, 2 threads of an AMD EPYC Zen 5, SmolLM2's layer shapes, 30
 * distinct weights each): 1.4-2.7x the bfloat16 model's matmuls (gemm_bf16.c, oneDNN) from 1
 * to 2,048 rows; small steps stream half bfloat16's bytes, large ones run ~880 GOP/s a core
 * with the weights in cache (VDPBF16PS: ~490).
 *
 * Packed weight layout (pack_weight): k padded with zeros to kp, a multiple of 4; n padded
 * with zero columns to a multiple of NR = 48; panels of 48 columns, each [kp / 4][48][4]: per
 * group of four inputs, 48 columns' four bytes side by side, so one 192-byte row of a panel
 * is the three vector operands of one VPDPBUSD step, and a panel streams in order.
 *
 * Work split: the activation rows are quantized in parallel into a buffer the calling thread
 * keeps; then the OpenMP threads split the panels (and the rows too when there are fewer
 * panels than threads). Within a panel rows go MR = 8 at a time (24 accumulators in
 * registers), in chunks of MC rows that stay in L2 across panels, and each thread prefetches
 * its next panel while it multiplies the current one (as gemm_bf16.c does).
 *
 * Built by worker_svc/kernels/build.py at levels avx512_bf16 and amx; VNNI is switched on for
 * this file only (every CPU seen with AVX512-BF16 has it; the wrapper checks the CPU flag).
 */
#include <float.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "gemm_int8.c needs AVX-512 BW and VL (CPU level avx512_bf16)"
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx512vnni")
#endif

#include "int8_rows.h" /* the row quantization and epilogue, shared with gemm_int8_amx.c */

#define NR 48  /* output columns per panel: three 16-lane vectors */
#define MR 8   /* rows per micro-tile */
#define MC 256 /* rows per chunk kept in L2 */


static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

int64_t packed_size(int64_t n, int64_t k) { return round_up(n, NR) * round_up(k, 4); }

/* q [n, k] int8 -> packed [np / NR][kp / 4][NR][4] (zeros past n and k) and corr [np] =
 * 128 * the column's sum of q. */
void pack_weight(const int8_t *q, int8_t *packed, int32_t *corr, int64_t n, int64_t k) {
  const int64_t kp = round_up(k, 4), np = round_up(n, NR), quads = kp / 4;
#pragma omp parallel for
  for (int64_t panel = 0; panel < np / NR; panel++) {
    for (int64_t j = 0; j < NR; j++) {
      const int64_t col = panel * NR + j;
      int32_t sum = 0;
      for (int64_t i = 0; col < n && i < k; i++) sum += q[col * k + i];
      corr[col] = 128 * sum;
    }
    for (int64_t g = 0; g < quads; g++)
      for (int64_t j = 0; j < NR; j++)
        for (int64_t t = 0; t < 4; t++) {
          const int64_t col = panel * NR + j, in = 4 * g + t;
          packed[((panel * quads + g) * NR + j) * 4 + t] =
              col < n && in < k ? q[col * k + in] : 0;
        }
  }
}

/* One 16-column vector of results: int32 sums less the shift's share -> c's type. */
static inline void store_vec(__m512i acc, __m512i corr, float a_scale, __m512 w_scale,
                             void *c, int kind, int64_t at, __mmask16 mask) {
  store_exact(_mm512_sub_epi32(acc, corr), a_scale, w_scale, c, kind, at, mask);
}

/* `rows` (<= MR) rows of qa (shifted) times one panel -> c. Meanwhile prefetch up to
 * `per_step` lines per step from *next on (the next panel), stopping at next_end. Inlined
 * twice: with rows == MR a constant, so that full tiles run without a test per row. */
static inline __attribute__((always_inline)) void
tile_rows(const uint8_t *qa, int64_t lda, const float *a_scale, const int8_t *panel,
          int64_t quads, const int32_t *corr, const float *w_scale, void *c, int64_t ldc,
          int kind, int64_t cols, const int rows, const char **next, const char *next_end,
          int64_t per_step) {
  __m512i acc[MR][3];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < 3; j++) acc[r][j] = _mm512_setzero_si512();
  const char *pf = *next;
  for (int64_t g = 0; g < quads; g++) {
    for (int64_t i = 0; i < per_step && pf < next_end; i++, pf += 64)
      _mm_prefetch(pf, _MM_HINT_T1);
    const int8_t *row = panel + g * NR * 4;
    const __m512i b0 = _mm512_loadu_si512(row);
    const __m512i b1 = _mm512_loadu_si512(row + 64);
    const __m512i b2 = _mm512_loadu_si512(row + 128);
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
      if (r < rows) {
        int32_t quad; /* qa[r, 4g .. 4g + 3] */
        memcpy(&quad, qa + r * lda + 4 * g, sizeof quad);
        const __m512i av = _mm512_set1_epi32(quad);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, b0);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, b1);
        acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], av, b2);
      }
    }
  }
  *next = pf;
  for (int j = 0; j < 3; j++) {
    const __mmask16 mask = cols > j * 16 ? tail_mask(cols - j * 16) : 0;
    const __m512i cj = _mm512_loadu_si512(corr + j * 16);
    const __m512 sj = _mm512_loadu_ps(w_scale + j * 16);
    for (int r = 0; r < rows; r++) store_vec(acc[r][j], cj, a_scale[r], sj, c, kind,
                                             r * ldc + j * 16, mask);
  }
}

/* The calling thread's share of the products: threads as a grid, column groups taking
 * panels and row groups (only when panels are fewer than threads) row tiles. Not inlined:
 * clang's OpenMP region bodies do not inherit this file's VNNI target. */
static __attribute__((noinline)) void multiply_share(
    const uint8_t *qa, int64_t kp, const float *a_scale, const int8_t *packed,
    const int32_t *corr, const float *w_scale, void *c, int kind, int64_t m, int64_t n) {
  const int64_t quads = kp / 4, panels = round_up(n, NR) / NR, panel_bytes = kp * NR;
  const int64_t out_elem = kind == OUT_BF16 ? 2 : 4;
  const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
  const int64_t col_groups = threads < panels ? threads : panels;
  const int64_t row_groups = threads / col_groups, tiles = (m + MR - 1) / MR;
  if (id >= col_groups * row_groups) return;
  const int64_t gc = id % col_groups, gr = id / col_groups;
  const int64_t first = panels * gc / col_groups, end = panels * (gc + 1) / col_groups;
  const int64_t row0 = tiles * gr / row_groups * MR;
  const int64_t row_end_tile = tiles * (gr + 1) / row_groups * MR;
  const int64_t row_end = row_end_tile < m ? row_end_tile : m;
  for (int64_t m0 = row0; m0 < row_end; m0 += MC) {
    const int64_t m1 = m0 + MC < row_end ? m0 + MC : row_end;
    const int64_t chunk_tiles = (m1 - m0 + MR - 1) / MR;
    /* lines of the next panel per step, so that this panel's tiles fetch all of it */
    const int64_t per_step =
        (panel_bytes / 64 + chunk_tiles * quads - 1) / (chunk_tiles * quads);
    for (int64_t panel = first; panel < end; panel++) {
      const int8_t *weights = packed + panel * panel_bytes;
      const char *next = (const char *)(weights + panel_bytes);
      const char *next_end = panel + 1 < end ? next + panel_bytes : next;
      const int64_t col0 = panel * NR, cols = n - col0;
      for (int64_t r0 = m0; r0 < m1; r0 += MR) {
        char *rows_c = (char *)c + (r0 * n + col0) * out_elem;
        const uint8_t *rows_a = qa + r0 * kp;
        if (m1 - r0 >= MR) /* MR as a constant: the full-tile copy of the loop */
          tile_rows(rows_a, kp, a_scale + r0, weights, quads, corr + col0, w_scale + col0,
                    rows_c, n, kind, cols, MR, &next, next_end, per_step);
        else
          tile_rows(rows_a, kp, a_scale + r0, weights, quads, corr + col0, w_scale + col0,
                    rows_c, n, kind, cols, (int)(m1 - r0), &next, next_end, per_step);
      }
    }
  }
}

/* c [m, n] = a [m, k] @ w^T with w packed by pack_weight (scales [np], corr [np]); a is
 * bfloat16 (a_bf16) or float32, c float32, bfloat16 or int32 (the exact sums) by `kind`. */
void gemm_int8(const void *a, int a_bf16, const int8_t *packed, const int32_t *corr,
               const float *w_scale, void *c, int kind, int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = round_up(k, 4), a_row_bytes = a_bf16 ? 2 * k : 4 * k;
  const int64_t scale_bytes = round_up(m * 4, 64);
  uint8_t *buffer = thread_buffer((size_t)(scale_bytes + m * kp));
  float *a_scale = (float *)buffer;
  uint8_t *qa = buffer + scale_bytes;
#pragma omp parallel
  {
#pragma omp for
    for (int64_t r = 0; r < m; r++)
      quantize_row((const char *)a + r * a_row_bytes, a_bf16, k, kp, 0x80, qa + r * kp,
                   a_scale + r);
    multiply_share(qa, kp, a_scale, packed, corr, w_scale, c, kind, m, n);
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
