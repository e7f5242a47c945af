/* What the AMX kernels (gemm_amx.c, paged_attention_amx.c) share: the feature check, the tile
 * configuration's layout, and a rounding helper.
 *
 * A process may execute tile instructions only after Linux granted it the tile state
 * (worker_svc.kernels.cpu.request_amx); the kernels' Python wrappers check that first. */
#ifndef SPLITSERVE_AMX_H
#define SPLITSERVE_AMX_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* GCC defines __AMX_TILE__ and __AMX_BF16__; clang 14 spells them __AMXTILE__, __AMXBF16__. */
#if !(defined(__AMX_TILE__) || defined(__AMXTILE__)) || \
    !(defined(__AMX_BF16__) || defined(__AMXBF16__))
#error "the AMX kernels need AMX-TILE and AMX-BF16 (CPU level amx: -mamx-tile -mamx-bf16)"
#endif

/* LDTILECFG's 64-byte operand, palette 1. */
typedef struct {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16]; /* bytes per row of each tile */
  uint8_t rows[16];
} tile_config;

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* The calling OpenMP thread's contiguous share [*first, *end) of `count` items. */
static inline void thread_share(int64_t count, int64_t *first, int64_t *end) {
  const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
  *first = count * id / threads;
  *end = count * (id + 1) / threads;
}

/* Lines of the next weight panel to prefetch per step of `steps`, so that `passes` passes
 * over this panel fetch all `panel_lines` of the next. */
static inline int64_t lines_per_step(int64_t panel_lines, int64_t passes, int64_t steps) {
  return (panel_lines + passes * steps - 1) / (passes * steps);
}

/* The matmul kernels' tiles for the calling thread: palette 1, eight tiles of 64-byte rows,
 * tiles 0-5 (c and a) of `rows` rows, 6-7 (w: 16 input pairs) of 16. */
static inline void config_matmul_tiles(int rows) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t < 6 ? rows : 16;
  }
  _tile_loadconfig(&cfg);
}

#endif
