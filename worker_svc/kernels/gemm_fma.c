/* Matmul with float32 FMA, for every x86-64 level with AVX2: c[m, n] = a[m, k] @ w[n, k]^T.
 *
 * Defines: ELEM_BF16 (a and c: 1 bfloat16, 0 float32) and W_BF16 (w: 1 bfloat16, 0 float32).
 * Every product and sum is float32; c is rounded once to its dtype. On CPUs without a bfloat16
 * dot product (AVX2; AVX-512 without AVX512-BF16) this is how bfloat16 runs: the weights stay
 * bfloat16 in memory (half the bytes of float32) and are widened in registers, which is exact.
 * torch's own bfloat16 matmul on such a CPU runs at a few GFLOP/s, and oneDNN's needs AVX-512.
 * It also serves float32 weights, where it replaces MKL/oneDNN if it measures faster.
 *
 * Built by worker_svc/kernels/build.py for one CPU level (-march=x86-64-v3 for AVX2,
 * x86-64-v4 for AVX-512): GCC vector extensions, LANES floats per vector (vec.h picks 8 on
 * AVX2, 16 on AVX-512), so the one source fits either register file.
 *
 * Packed weight layout (pack_weight): panels of NR = NV * LANES output columns. A panel is
 * [steps][NR][KSTEP]: for each step, the NR columns' KSTEP consecutive inputs side by side.
 * bfloat16 weights come in pairs (KSTEP 2): one 32-bit lane holds w[j, 2p] in its low half and
 * w[j, 2p + 1] in its high half, so `lane << 16` and `lane & 0xffff0000` are the two weights
 * as float32, one instruction each (this is also the layout VDPBF16PS reads, gemm_bf16.c).
 * Columns past n and inputs past k are zero, so any n and k work.
 *
 * Work split: each OpenMP thread takes a contiguous range of panels. Rows go in chunks sized
 * to stay in L2 across panels, and within a chunk MR rows at a time, with MR x NV vector
 * accumulators in registers (AVX2: 6 x 2 of 16 registers; AVX-512: 8 x 3 of 32). A panel (at
 * most 576 x 16 bfloat16 = 18 KiB for SmolLM2 on AVX2) stays in L1 across a chunk's tiles;
 * while a thread multiplies one panel it prefetches its next one, which hides the weight
 * stream at decode sizes. Every output element is one dot product in input order, so results
 * do not depend on the thread count.
 */
#include <omp.h>
#include <stdlib.h>

#include "vec.h"

#ifndef W_BF16
#error "W_BF16 must be defined (1: bfloat16 weights, 0: float32)"
#endif

/* Register blocking: MR x NV accumulators, plus the weight vectors of one step (bfloat16:
 * both halves of a pair, 2 * NV) and a broadcast row value. More rows than fit spill the
 * accumulators to the stack: bfloat16 at 6 x 2 on AVX2 ran at 85 GFLOP/s, at 5 x 2 at 160,
 * measured (2 Zen 2 cores). AVX-512 has 32 registers. */
#if LANES == 16
#define NV 3
#define MR (W_BF16 ? 6 : 8)
#else
#define NV 2
#define MR (W_BF16 ? 5 : 6)
#endif
#define NR (NV * LANES)
#define CHUNK_BYTES (192 * 1024) /* float32 rows of a kept in L2 across panels */

#if W_BF16
typedef uint16_t w_t;
#define KSTEP 2
#else
typedef float w_t;
#define KSTEP 1
#endif

int64_t panel_columns(void) { return NR; }

/* Elements of the packed form of an [n, k] weight. */
int64_t packed_size(int64_t n, int64_t k) {
  return (n + NR - 1) / NR * ((k + KSTEP - 1) / KSTEP) * NR * KSTEP;
}

/* w [n, k] row-major -> packed (packed_size(n, k) elements), zero-padded. */
void pack_weight(const w_t *w, w_t *packed, int64_t n, int64_t k) {
  const int64_t steps = (k + KSTEP - 1) / KSTEP, panels = (n + NR - 1) / NR;
#pragma omp parallel for
  for (int64_t panel = 0; panel < panels; panel++)
    for (int64_t p = 0; p < steps; p++)
      for (int64_t j = 0; j < NR; j++)
        for (int64_t s = 0; s < KSTEP; s++) {
          const int64_t col = panel * NR + j, in = p * KSTEP + s;
          packed[((panel * steps + p) * NR + j) * KSTEP + s] =
              col < n && in < k ? w[col * k + in] : (w_t)0;
        }
}

/* The NV weight vectors of input `s` (0 or 1 within the pair) at one step of a panel. */
static inline void weight_vectors(const w_t *row, int s, vf *b) {
#if W_BF16
  for (int j = 0; j < NV; j++) {
    vu32 raw;
    memcpy(&raw, row + j * LANES * 2, sizeof raw);
    b[j] = s ? (vf)(raw & 0xffff0000u) : (vf)(raw << 16);
  }
#else
  (void)s;
  for (int j = 0; j < NV; j++) memcpy(&b[j], row + j * LANES, sizeof b[j]);
#endif
}

/* `rows` (<= MR) rows of a (float32, row stride lda) times one panel -> the first `cols`
 * columns of c. Meanwhile prefetch up to `per_step` lines per step from *next on (the next
 * panel), stopping at next_end. Inlined with rows == MR and cols == NR as constants too, so
 * that full tiles run without a test per row. */
static inline __attribute__((always_inline)) void
tile_rows(const float *a, int64_t lda, const w_t *panel, int64_t steps, elem_t *c, int64_t ldc,
          const int rows, const int cols, const char **next, const char *next_end,
          int64_t per_step) {
  vf acc[MR][NV];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NV; j++) acc[r][j] = (vf){0};
  const char *pf = *next;
  for (int64_t p = 0; p < steps; p++) {
    for (int64_t i = 0; i < per_step && pf < next_end; i++, pf += 64)
      __builtin_prefetch(pf, 0, 2);
    const w_t *row = panel + p * NR * KSTEP;
#pragma GCC unroll 2
    for (int s = 0; s < KSTEP; s++) {
      vf b[NV];
      weight_vectors(row, s, b);
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        if (r < rows) {
          /* vector * scalar: GCC broadcasts the scalar straight from memory (VBROADCASTSS);
           * (vf){0} + x would cost an add and a register shuffle per row */
          const float x = a[r * lda + p * KSTEP + s];
          for (int j = 0; j < NV; j++) acc[r][j] += b[j] * x;
        }
      }
    }
  }
  *next = pf;
  for (int r = 0; r < rows; r++) {
    elem_t *out = c + r * ldc;
    if (cols == NR) {
      for (int j = 0; j < NV; j++) store_vec(acc[r][j], out + j * LANES);
    } else {
      float tail[NR];
      memcpy(tail, acc[r], sizeof tail);
      for (int j = 0; j < cols; j++) store_one(tail[j], out + j);
    }
  }
}

/* c [m, n] = a [m, k] @ w^T, w given packed by pack_weight; a and c row-major, contiguous. */
void gemm(const elem_t *a, const w_t *packed, elem_t *c, int64_t m, int64_t n, int64_t k) {
  const int64_t steps = (k + KSTEP - 1) / KSTEP, kpad = steps * KSTEP;
  const int64_t panels = (n + NR - 1) / NR;
  const int64_t panel_elems = steps * NR * KSTEP, panel_bytes = panel_elems * sizeof(w_t);
  int64_t chunk = CHUNK_BYTES / (kpad * 4) / MR * MR;
  if (chunk < MR) chunk = MR;
  /* Rows as float32 with k padded to whole steps (the padding is zero, as in the weights):
   * widened once here instead of once per panel. */
  float *af = NULL;
  const float *arows = (const float *)a;
  if (ELEM_BF16 || kpad != k) {
    af = malloc((size_t)(m * kpad) * sizeof(float));
    if (!af) abort();
    arows = af;
  }
#pragma omp parallel
  {
    if (af) {
#pragma omp for
      for (int64_t r = 0; r < m; r++) {
        int64_t i = 0;
        for (; i + LANES <= k; i += LANES) {
          const vf v = load_vec(a + r * k + i);
          memcpy(af + r * kpad + i, &v, sizeof v);
        }
        for (; i < k; i++) af[r * kpad + i] = load_one(a + r * k + i);
        for (; i < kpad; i++) af[r * kpad + i] = 0.f;
      }
    }
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = panels * t / threads, end = panels * (t + 1) / threads;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
      const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
      const int64_t tiles = (m1 - m0 + MR - 1) / MR;
      /* lines of the next panel per step, so that this panel's tiles fetch all of it */
      const int64_t per_step = (panel_bytes / 64 + tiles * steps - 1) / (tiles * steps);
      for (int64_t panel = first; panel < end; panel++) {
        const w_t *weights = packed + panel * panel_elems;
        const char *next = (const char *)(weights + panel_elems);
        const char *next_end = panel + 1 < end ? next + panel_bytes : next;
        const int cols = panel * NR + NR <= n ? NR : (int)(n - panel * NR);
        for (int64_t r0 = m0; r0 < m1; r0 += MR) {
          const float *rows_a = arows + r0 * kpad;
          elem_t *rows_c = c + r0 * n + panel * NR;
          const int rows = m1 - r0 >= MR ? MR : (int)(m1 - r0);
          if (rows == MR && cols == NR) /* constants: the full-tile copy of the loop */
            tile_rows(rows_a, kpad, weights, steps, rows_c, n, MR, NR, &next, next_end,
                      per_step);
          else
            tile_rows(rows_a, kpad, weights, steps, rows_c, n, rows, cols, &next, next_end,
                      per_step);
        }
      }
    }
  }
  free(af);
}
