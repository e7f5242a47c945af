/* int8 matmul on AMX tiles (TDPBSSD): c[m, n] = a[m, k] @ w[n, k]^T with w quantized at load
 * (int8, one float32 scale per output column) and a quantized here per row, exactly as
 * gemm_int8.c does (same rounding, same int32 sums, same float32 epilogue, so the two kernels
 * and the torch twin in gemm_int8.py agree bit for bit):
 *   c[r, j] = (qa @ qw^T)[r, j] * a_scale[r] * w_scale[j], rounded once to c's type.
 *
 * One TDPBSSD multiplies a 16 x 64 int8 tile of qa by a 64 x 16 tile of qw^T into a 16 x 16
 * int32 tile: 16,384 multiply-adds an instruction, signed by signed (no shift, unlike
 * VPDPBUSD). Eight tile registers as in gemm_amx.c: tmm0-3 a 2 x 2 block of c (32 rows x 32
 * columns), tmm4-5 two row tiles of qa, tmm6-7 two column tiles of qw. Sums stay below
 * 127 * 127 * k: exact in int32 for k up to 133,000 (the wrapper checks).
 *
 * Not yet run: written on a machine without AMX (it compiles at level amx everywhere:
 * tests/worker_svc/test_kernel_build.py). tests/worker_svc/test_gemm_int8.py holds it to the
 * torch twin bit for bit where AMX is, and bench/int8_gemm.py measures it.
 *
 * Packed weight layout (pack_weight): k padded with zeros to kp, a multiple of 64; n padded
 * with zero columns to a multiple of NR = 32; panels of 32 columns, each [kp / 64][2][16][16]
 * [4]: per step of 64 inputs, two tiles of 16 columns, each 16 rows of 64 bytes, row i holding
 * the 16 columns' weights for inputs 4i .. 4i + 3 side by side (the layout TDPBSSD reads its
 * second operand in). A tile is one contiguous kilobyte, a panel one contiguous run.
 *
 * Rows: the activations are quantized into a buffer the calling thread keeps, [mp][kp] with
 * mp = m rounded up to 16 and zeros past m and k, so every tile is whole; rows past m are not
 * stored. Work split: each OpenMP thread takes a contiguous range of panels and configures its
 * own tiles; rows go in chunks of MC so a chunk stays in L2 across panels; while a thread
 * multiplies one panel it prefetches the next into L2.
 *
 * Built by worker_svc/kernels/build.py at CPU level amx only, AMX-INT8 switched on for this
 * file (the wrapper checks the CPU's amx_int8 flag). The process must hold Linux's leave to
 * use the tiles (worker_svc.kernels.cpu.request_amx) before the first tile instruction.
 */
#include <float.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-int8"))), apply_to = function)
#else
#pragma GCC target("amx-int8")
#endif

#include "int8_rows.h" /* the row quantization and epilogue, shared with gemm_int8.c */

#define NR 32           /* output columns per panel: two tiles of 16 */
#define KS 64           /* inputs per tile step */
#define TILE_BYTES 1024 /* one 16 x 64-byte tile */
#define MC 256          /* rows per chunk kept in L2 */


int64_t packed_size(int64_t n, int64_t k) { return round_up(n, NR) * round_up(k, KS); }

/* q [n, k] int8 -> packed [np / NR][kp / 64][2][16][16][4], zeros past n and k. */
void pack_weight(const int8_t *q, int8_t *packed, int64_t n, int64_t k) {
  const int64_t steps = round_up(k, KS) / KS;
#pragma omp parallel for
  for (int64_t panel = 0; panel < round_up(n, NR) / NR; panel++)
    for (int64_t s = 0; s < steps; s++)
      for (int64_t h = 0; h < 2; h++) {
        int8_t *tile = packed + ((panel * steps + s) * 2 + h) * TILE_BYTES;
        for (int64_t i = 0; i < 16; i++)
          for (int64_t j = 0; j < 16; j++)
            for (int64_t t = 0; t < 4; t++) {
              const int64_t col = panel * NR + h * 16 + j, in = s * KS + 4 * i + t;
              tile[i * 64 + j * 4 + t] = col < n && in < k ? q[col * k + in] : 0;
            }
      }
}


/* ---- the tile products ---- */

static inline void prefetch_lines(const char **next, const char *end, int64_t count) {
  const char *p = *next;
  for (int64_t i = 0; i < count && p < end; i++, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  *next = p;
}

/* The int32 tiles of `row_tiles` (1 or 2) row tiles x 2 column tiles -> c: rows from `r0`
 * (valid up to m), columns from `col0` (valid up to n). */
static void store_block(const int32_t *acc, int row_tiles, int64_t r0, int64_t m,
                        int64_t col0, int64_t n, const float *a_scale, const float *w_scale,
                        void *c, int kind) {
  for (int t = 0; t < row_tiles; t++)
    for (int h = 0; h < 2; h++) {
      const int64_t col = col0 + h * 16;
      const __mmask16 mask = col < n ? tail_mask(n - col) : 0;
      const __m512 ws = _mm512_loadu_ps(w_scale + col);
      for (int64_t i = 0; i < 16 && r0 + t * 16 + i < m; i++) {
        const int64_t r = r0 + t * 16 + i;
        store_exact(_mm512_loadu_si512(acc + (t * 2 + h) * 256 + i * 16), a_scale[r], ws, c,
                  kind, r * n + col, mask);
      }
    }
}

/* Two row tiles (a0, a1) times one panel -> acc (tiles 0-3, 64-byte rows). */
static inline void tiles_2x2(const int8_t *a0, const int8_t *a1, int64_t lda,
                             const int8_t *panel, int64_t steps, int32_t *acc,
                             const char **next, const char *next_end, int64_t per_step) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; s++) {
    prefetch_lines(next, next_end, per_step);
    const int8_t *b = panel + s * 2 * TILE_BYTES;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE_BYTES, 64);
    _tile_loadd(4, a0 + s * KS, lda);
    _tile_loadd(5, a1 + s * KS, lda);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
  _tile_stored(2, acc + 512, 64);
  _tile_stored(3, acc + 768, 64);
}

/* One row tile times one panel -> acc (tiles 0-1). */
static inline void tiles_1x2(const int8_t *a0, int64_t lda, const int8_t *panel,
                             int64_t steps, int32_t *acc, const char **next,
                             const char *next_end, int64_t per_step) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t s = 0; s < steps; s++) {
    prefetch_lines(next, next_end, per_step);
    const int8_t *b = panel + s * 2 * TILE_BYTES;
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + TILE_BYTES, 64);
    _tile_loadd(4, a0 + s * KS, lda);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
  }
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
}

/* The calling thread's panels, every row. Not inlined: clang's OpenMP region bodies do not
 * inherit this file's AMX-INT8 target. */
static __attribute__((noinline)) void multiply_share(
    const int8_t *qa, int64_t kp, const float *a_scale, const int8_t *packed,
    const float *w_scale, void *c, int kind, int64_t m, int64_t n) {
  config_matmul_tiles(16);
  int32_t acc[4 * 256] __attribute__((aligned(64)));
  const int64_t steps = kp / KS, row_tiles = (m + 15) / 16, panels = round_up(n, NR) / NR;
  const int64_t panel_bytes = steps * 2 * TILE_BYTES, panel_lines = panel_bytes / 64;
  int64_t first, end;
  thread_share(panels, &first, &end);
  for (int64_t t0 = 0; t0 < row_tiles; t0 += MC / 16) {
    const int64_t t1 = t0 + MC / 16 < row_tiles ? t0 + MC / 16 : row_tiles;
    const int64_t per_step = lines_per_step(panel_lines, (t1 - t0 + 1) / 2, steps);
    for (int64_t panel = first; panel < end; panel++) {
      const int8_t *w = packed + panel * panel_bytes;
      const char *next = (const char *)(w + panel_bytes);
      const char *next_end = panel + 1 < end ? next + panel_bytes : next;
      for (int64_t t = t0; t < t1; t += 2) {
        const int64_t r0 = t * 16;
        if (t + 1 < t1) {
          tiles_2x2(qa + r0 * kp, qa + (r0 + 16) * kp, kp, w, steps, acc, &next, next_end,
                    per_step);
          store_block(acc, 2, r0, m, panel * NR, n, a_scale, w_scale, c, kind);
        } else {
          tiles_1x2(qa + r0 * kp, kp, w, steps, acc, &next, next_end, per_step);
          store_block(acc, 1, r0, m, panel * NR, n, a_scale, w_scale, c, kind);
        }
      }
    }
  }
  _tile_release();
}

/* c [m, n] = a [m, k] @ w^T with w packed by pack_weight (scales [np]); a bfloat16 (a_bf16)
 * or float32, c float32, bfloat16 or int32 (the exact sums) by `kind`. */
void gemm_int8_amx(const void *a, int a_bf16, const int8_t *packed, const float *w_scale,
                   void *c, int kind, int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp = round_up(k, KS), mp = round_up(m, 16), a_row_bytes = a_bf16 ? 2 * k : 4 * k;
  const int64_t scale_bytes = round_up(m * 4, 64);
  uint8_t *buffer = thread_buffer((size_t)(scale_bytes + mp * kp));
  float *a_scale = (float *)buffer;
  int8_t *qa = (int8_t *)(buffer + scale_bytes);
#pragma omp parallel
  {
#pragma omp for
    for (int64_t r = 0; r < mp; r++) {
      if (r < m)
        quantize_row((const char *)a + r * a_row_bytes, a_bf16, k, kp, 0,
                     (uint8_t *)qa + r * kp, a_scale + r);
      else
        memset(qa + r * kp, 0, (size_t)kp);
    }
    multiply_share(qa, kp, a_scale, packed, w_scale, c, kind, m, n);
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
