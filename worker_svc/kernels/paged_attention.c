/* Paged attention on CPU, one query token ("row") at a time, reading K/V straight from the
 * block cache: no gathered copy, no padding, float32 arithmetic throughout, online softmax
 * over tiles of keys. Decodes and the tokens of prefill chunks go through the same loop.
 *
 * Built at run time by worker_svc/kernels/__init__.py for one model shape and dtype, with
 *   -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head> -DLANES=<floats per vector>
 *   -DELEM_BF16=<1: bfloat16 tensors, 0: float32>
 * and -march=native, so that every loop below has constant bounds and GCC keeps q, the
 * accumulators and a K/V row in vector registers. Plain C with GCC vector extensions (no
 * intrinsics): the same source compiles for any CPU GCC targets.
 *
 * Cache layout (see worker_svc/attention.py): [2, num_blocks, block_size, num_kv_heads,
 * head_dim], keys then values; token t of a request lives in block table[t / block_size] at
 * offset t % block_size. Query head h * GROUP + g reads KV head h.
 *
 * Work item = (row, KV head): its GROUP query heads are scored against the row's keys, TILE
 * tokens at a time; the softmax is rescaled per tile (running max and sum), so no buffer
 * grows with the context. Items are spread over OpenMP threads; each item's result depends
 * only on its own inputs, so it is the same whichever thread or TP rank computes it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef GROUP
#error "GROUP must be defined"
#endif
#ifndef LANES
#define LANES 16
#endif
#ifndef ELEM_BF16
#error "ELEM_BF16 must be defined (1: bfloat16 tensors, 0: float32)"
#endif
#if HEAD_DIM % LANES != 0
#error "HEAD_DIM must be a multiple of LANES"
#endif

#define NVEC (HEAD_DIM / LANES) /* vectors per head row */
#define TILE 32                 /* tokens scored before each softmax update */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu32 __attribute__((vector_size(LANES * 4)));
typedef int32_t vi32 __attribute__((vector_size(LANES * 4)));
typedef uint16_t vu16 __attribute__((vector_size(LANES * 2)));

/* ---- loads and stores of one head row (HEAD_DIM elements) as NVEC float vectors ---- */


#if ELEM_BF16
typedef uint16_t elem_t;
static inline void load_row(const uint16_t *src, vf *dst) {
  for (int j = 0; j < NVEC; j++) {
    vu16 raw;
    memcpy(&raw, src + j * LANES, sizeof raw);
    vu32 wide = __builtin_convertvector(raw, vu32) << 16; /* bfloat16 = top half of a float */
    memcpy(&dst[j], &wide, sizeof wide);
  }
}

static inline void store_row(const vf *src, uint16_t *dst) {
  for (int j = 0; j < NVEC; j++) {
    vu32 bits;
    memcpy(&bits, &src[j], sizeof bits);
    /* round to nearest even; NaN stays NaN (quiet bit set) */
    vu32 rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
    vi32 is_nan = (bits & 0x7fffffff) > 0x7f800000;
    rounded = (vu32)((vi32)rounded & ~is_nan) | ((vu32)is_nan & ((bits >> 16) | 0x40));
    vu16 narrow = __builtin_convertvector(rounded, vu16);
    memcpy(dst + j * LANES, &narrow, sizeof narrow);
  }
}

#else
typedef float elem_t;
static inline void load_row(const float *src, vf *dst) {
  for (int j = 0; j < NVEC; j++) memcpy(&dst[j], src + j * LANES, sizeof(vf));
}

static inline void store_row(const vf *src, float *dst) {
  for (int j = 0; j < NVEC; j++) memcpy(dst + j * LANES, &src[j], sizeof(vf));
}
#endif

/* Sum of a vector's lanes by halving (log2(LANES) dependent adds, not LANES - 1). */
static inline float hsum(vf v) {
#if LANES == 16
  typedef float vf8 __attribute__((vector_size(32)));
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif LANES == 8
  typedef float vf8 __attribute__((vector_size(32)));
  vf8 a = v;
#endif
#if LANES >= 8
  typedef float vf4 __attribute__((vector_size(16)));
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
  typedef float vf4 __attribute__((vector_size(16)));
  vf4 b = v;
#endif
  return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (scores minus their running max), vectorized: x = k ln2 + r with
 * |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (relative error below 2e-7), 2^k built in
 * the exponent bits. Inputs below -87 give 0. */
static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.0f;
  vi32 tiny = x < lo;
  x = (vf)((vi32)x & ~tiny) + (vf)((vi32)lo & tiny); /* max(x, -87) */
  vf kf = x * 1.44269504088896341f;
  vi32 k = __builtin_convertvector(kf - 0.5f, vi32);  /* floor(kf + 0.5) for kf <= 0.5 */
  kf = __builtin_convertvector(k, vf);
  vf r = x - kf * 0.693359375f + kf * 2.12194440e-4f;  /* x - k ln2, ln2 in two parts */
  vf p = (vf){0} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  vi32 scale = (k + 127) << 23;
  vf result = p * (vf)scale;
  return (vf)((vi32)result & ~tiny);
}

/* Where token t of a request lives, walked in order without a division per token. */
typedef struct {
  const elem_t *base; /* the cache, offset to this item's KV head */
  const int64_t *table;
  int64_t block_size, row_stride, block, offset;
} cursor_t;

static inline const elem_t *next_row(cursor_t *c) {
  const elem_t *row = c->base + (c->table[c->block] * c->block_size + c->offset) * c->row_stride;
  if (++c->offset == c->block_size) {
    c->offset = 0;
    c->block++;
  }
  return row;
}

/* One (row, KV head) item: q = its GROUP query heads (contiguous), table = its request's
 * block ids, kv_len = the tokens it attends to, out = its GROUP output heads. Reading K/V rows dominates (each is a
 * couple of cache lines in a scattered block). */
static void attend_item(const elem_t *q, const elem_t *kv, const int64_t *table, int64_t kv_len,
                        int64_t value_offset, int64_t block_size, int64_t row_stride,
                        int64_t head, float scale, elem_t *out) {
  vf qv[GROUP][NVEC], acc[GROUP][NVEC];
  float run_max[GROUP], run_sum[GROUP];
  for (int g = 0; g < GROUP; g++) {
    load_row(q + g * HEAD_DIM, qv[g]);
    for (int j = 0; j < NVEC; j++) {
      qv[g][j] *= scale;
      acc[g][j] = (vf){0};
    }
    run_max[g] = -INFINITY;
    run_sum[g] = 0.f;
  }
  cursor_t cursor = {kv + head * HEAD_DIM, table, block_size, row_stride, 0, 0};
  const elem_t *rows[2][TILE]; /* this tile's K rows and the next one's */
  int n_next = kv_len < TILE ? (int)kv_len : TILE;
  for (int i = 0; i < n_next; i++) rows[0][i] = next_row(&cursor);
  for (int64_t start = 0, tile = 0; start < kv_len; start += TILE, tile ^= 1) {
    const int n = n_next;
    const elem_t **here = (const elem_t **)rows[tile], **ahead = (const elem_t **)rows[tile ^ 1];
    const int64_t left = kv_len - start - n;
    n_next = left < TILE ? (int)left : TILE;
    for (int i = 0; i < n_next; i++) ahead[i] = next_row(&cursor);
    float scores[GROUP][TILE];
    for (int i = 0; i < n; i++) {
      /* this token's V is read after the tile's softmax: ask for it now. (Prefetching the
       * next tile's K as well measured slower: it competes with this tile's misses.) */
      for (int c = 0; c < HEAD_DIM * (int)sizeof(elem_t); c += 64)
        __builtin_prefetch((const char *)(here[i] + value_offset) + c);
      vf k[NVEC];
      load_row(here[i], k);
      for (int g = 0; g < GROUP; g++) {
        vf dot = qv[g][0] * k[0];
        for (int j = 1; j < NVEC; j++) dot += qv[g][j] * k[j];
        scores[g][i] = hsum(dot);
      }
    }
    for (int g = 0; g < GROUP; g++) {
      float tile_max = run_max[g];
      for (int i = 0; i < n; i++) tile_max = scores[g][i] > tile_max ? scores[g][i] : tile_max;
      const float rescale = expf(run_max[g] - tile_max); /* 0 on the first tile */
      run_max[g] = tile_max;
      run_sum[g] *= rescale;
      for (int j = 0; j < NVEC; j++) acc[g][j] *= rescale;
      for (int i = n; i < TILE; i++) scores[g][i] = -INFINITY;
      for (int i = 0; i < TILE; i += LANES) {
        vf s;
        memcpy(&s, &scores[g][i], sizeof s);
        s = vexp(s - tile_max);
        memcpy(&scores[g][i], &s, sizeof s);
        run_sum[g] += hsum(s);
      }
    }
    for (int i = 0; i < n; i++) {
      vf v[NVEC];
      load_row(here[i] + value_offset, v);
      for (int g = 0; g < GROUP; g++)
        for (int j = 0; j < NVEC; j++) acc[g][j] += scores[g][i] * v[j];
    }
  }
  for (int g = 0; g < GROUP; g++) {
    const float inv = 1.f / run_sum[g];
    for (int j = 0; j < NVEC; j++) acc[g][j] *= inv;
    store_row(acc[g], out + g * HEAD_DIM);
  }
}

/* Every (row, KV head) item. A row is one query token: a decode, or one token of a prefill
 * chunk, which attends to its request's first kv_lens[row] tokens (its own included), so
 * causal masking is just each row's length. q: row r starts at q + r * q_stride (elements),
 * heads and dims contiguous; kv_cache as above; block_tables [requests, max_blocks];
 * row_request [rows]: the request (table row) of each row; out [rows, heads, HEAD_DIM].
 * Rows are handed out a few at a time: a prefill chunk's later rows cost more. */
void paged_attention(const elem_t *q, int64_t q_stride, const elem_t *kv_cache,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *row_request,
                     const int64_t *kv_lens, int64_t num_rows, int64_t num_kv_heads,
                     int64_t num_blocks, int64_t block_size, float scale, elem_t *out) {
  const int64_t row_stride = num_kv_heads * HEAD_DIM;
  const int64_t value_offset = num_blocks * block_size * row_stride;
  const int64_t items = num_rows * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t item = 0; item < items; item++) {
    const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
    attend_item(q + r * q_stride + h * GROUP * HEAD_DIM, kv_cache,
                block_tables + row_request[r] * max_blocks, kv_lens[r], value_offset, block_size,
                row_stride, h, scale, out + (r * num_kv_heads + h) * GROUP * HEAD_DIM);
  }
}
