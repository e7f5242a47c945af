/* bfloat16 matmul for decode-sized batches: c[m, n] = a[m, k] @ w[n, k]^T, float32 sums
 * rounded once to bfloat16, on CPUs with AVX512-BF16 (VDPBF16PS: 16 float32 lanes, each adding
 * the products of two bfloat16 pairs).
 *
 * Why our own: at decode sizes (tens of rows) a step streams every weight from memory once, and
 * oneDNN's kernels leave that stream exposed: 30 SmolLM2 layers at 64 rows take 42 ms with each
 * layer's own weights, 35 ms when one layer's weights are reused from cache (measured). Here
 * each thread prefetches its next weight panel while it multiplies the current one, which hides
 * most of it (35 ms with distinct weights). For hundreds of rows and more, oneDNN's blocking is
 * faster and the caller uses it (worker_svc.model.llama.Linear).
 *
 * Built by worker_svc/kernels/build.py at CPU level avx512_bf16 only (-march=x86-64-v4
 * -mavx512bf16). Intrinsics, not GCC vector extensions: VDPBF16PS has no generic form.
 *
 * Packed weight layout (pack_weight): panels of NR = 48 output columns, each [k / 2][48][2]:
 * for every pair of inputs (2i, 2i + 1), 48 columns' two weights side by side, so one 64-byte
 * row of a panel is the three vector operands of one VDPBF16PS step. n must be a multiple of
 * 48 and k even (the caller checks; other shapes use oneDNN).
 *
 * Work split: each OpenMP thread takes a contiguous range of panels; within a panel, rows go
 * MR = 8 at a time (24 accumulators in registers), and rows in chunks of MC so a chunk of a
 * stays in L2 across panels. Every output element is one dot product in a fixed order, so
 * results do not depend on the thread count. Full row tiles run a copy of the loop compiled
 * for exactly MR rows (no test per row; GCC then keeps the row pointers in registers): 5-15%
 * faster than one loop for any row count, measured at 13 to 128 rows.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#ifndef __AVX512BF16__
#error "gemm_bf16.c needs AVX512-BF16 (CPU level avx512_bf16)"
#endif

#define NR 48  /* output columns per panel: three 16-lane vectors */
#define MR 8   /* rows per micro-tile */
#define MC 256 /* rows per chunk kept in L2 */

/* w [n, k] row-major -> packed [n / NR][k / 2][NR][2]. */
void pack_weight(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
  const int64_t pairs = k / 2;
#pragma omp parallel for
  for (int64_t panel = 0; panel < n / NR; panel++)
    for (int64_t p = 0; p < pairs; p++)
      for (int64_t j = 0; j < NR; j++) {
        const uint16_t *src = w + (panel * NR + j) * k + 2 * p;
        uint16_t *dst = packed + ((panel * pairs + p) * NR + j) * 2;
        dst[0] = src[0];
        dst[1] = src[1];
      }
}

/* `rows` (<= MR) rows of a times one panel -> c. Meanwhile prefetch up to `per_step` lines
 * per pair step from *next on (the next panel), stopping at next_end. Inlined twice: with
 * rows == MR a constant, so that full tiles run without a test per row. */
static inline __attribute__((always_inline)) void
tile_rows(const uint16_t *a, int64_t lda, const uint16_t *panel, int64_t pairs, uint16_t *c,
          int64_t ldc, const int rows, const char **next, const char *next_end,
          int64_t per_step) {
  __m512 acc[MR][3];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < 3; j++) acc[r][j] = _mm512_setzero_ps();
  const char *pf = *next;
  for (int64_t p = 0; p < pairs; p++) {
    for (int64_t i = 0; i < per_step && pf < next_end; i++, pf += 64)
      _mm_prefetch(pf, _MM_HINT_T1);
    const uint16_t *row = panel + p * NR * 2;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(row);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(row + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(row + 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
      if (r < rows) {
        int32_t pair; /* a[r, 2p], a[r, 2p + 1] */
        memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, b2);
      }
    }
  }
  *next = pf;
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < 3; j++) /* round to nearest even, as torch */
      _mm256_storeu_si256((__m256i *)(c + r * ldc + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

/* c [m, n] = a [m, k] @ w^T, w given packed by pack_weight; a and c row-major, contiguous. */
void gemm_bf16(const uint16_t *a, const uint16_t *packed, uint16_t *c, int64_t m, int64_t n,
               int64_t k) {
  const int64_t pairs = k / 2, panels = n / NR;
  const int64_t panel_elems = pairs * NR * 2, panel_bytes = panel_elems * 2;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = panels * t / threads, end = panels * (t + 1) / threads;
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
      const int64_t m1 = m0 + MC < m ? m0 + MC : m;
      const int64_t tiles = (m1 - m0 + MR - 1) / MR;
      /* lines of the next panel per pair step, so that this panel's tiles fetch all of it */
      const int64_t per_step = (panel_bytes / 64 + tiles * pairs - 1) / (tiles * pairs);
      for (int64_t panel = first; panel < end; panel++) {
        const uint16_t *weights = packed + panel * panel_elems;
        const char *next = (const char *)(weights + panel_elems);
        const char *next_end = panel + 1 < end ? next + panel_bytes : next;
        for (int64_t r0 = m0; r0 < m1; r0 += MR) {
          const uint16_t *rows_a = a + r0 * k;
          uint16_t *rows_c = c + r0 * n + panel * NR;
          if (m1 - r0 >= MR) /* MR as a constant: the full-tile copy of the loop */
            tile_rows(rows_a, k, weights, pairs, rows_c, n, MR, &next, next_end, per_step);
          else
            tile_rows(rows_a, k, weights, pairs, rows_c, n, (int)(m1 - r0), &next, next_end,
                      per_step);
        }
      }
    }
  }
}
