/* What the AMX kernels (gemm_amx.c, paged_attention_amx.c) share: the feature check, the tile
 * configuration's layout, and a rounding helper.
 *
 * A process may execute tile instructions only after Linux granted it the tile state
 * (worker_svc.kernels.cpu.request_amx); the kernels' Python wrappers check that first. */
#ifndef SPLITSERVE_AMX_H
#define SPLITSERVE_AMX_H

#include <immintrin.h>
#include <stdint.h>

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

#endif
