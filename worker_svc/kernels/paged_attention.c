/* Paged attention on CPU, one query token ("row") at a time, reading K/V straight from the
 * block cache: no gathered copy, no padding, float32 arithmetic throughout, online softmax
 * over tiles of keys. Decodes and the tokens of prefill chunks go through the same loop.
 *
 * Built at run time by worker_svc/kernels/build.py for one model shape and dtype, with
 *   -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head> -DLANES=<floats per vector>
 *   -DELEM_BF16=<1: bfloat16 tensors, 0: float32>
 *   -DKV_FP8=<0: the cache holds elem_t, 1: float8 e4m3fn bytes, 2: float8 e5m2 bytes>
 * and the CPU level's -march, so that every loop below has constant bounds and GCC keeps q, the
 * accumulators and a K/V row in vector registers. Plain C with GCC vector extensions (no
 * intrinsics but an 8-bit cache's widening in vec.h, which has a portable fallback): the same
 * source compiles for any CPU GCC targets.
 *
 * Cache layout (see worker_svc/attention.py): [2, num_blocks, block_size, num_kv_heads,
 * head_dim], keys then values; token t of a request lives in block table[t / block_size] at
 * offset t % block_size. Query head h * GROUP + g reads KV head h.
 *
 * Sliding window (window > 0): a row of kv_len keys attends keys [max(0, kv_len - window),
 * kv_len) only, and reads no key before that start: kvcache_svc frees the blocks wholly before
 * it and the table holds the null block (garbage) there. window 0 = every key.
 *
 * An 8-bit cache (KV_FP8, vec.h): the write quantizes the step's K/V rows with 1 / k_scale and
 * 1 / v_scale (bit for bit as kv_quant.quantize); reads widen a row's bytes to float32 in the
 * tile loops, and the scales cost nothing there: k_scale (times the power of two a read
 * leaves out, FP8_READ_SCALE) is folded into q's scale, v_scale (likewise) into the final
 * normalization (both 1 for a cache in elem_t).
 *
 * Work item = a row's KV heads (all of them where rows are plenty, else one): each head's
 * GROUP query heads are scored against the row's keys, TILE tokens at a time; the softmax is
 * rescaled per tile (running max and sum), so no buffer grows with the context. Items are
 * spread over OpenMP threads one at a time; each head's result depends only on its own
 * inputs, so it is the same whichever thread, item or TP rank computes it.
 */
#include <omp.h>

#include "vec.h"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef GROUP
#error "GROUP must be defined"
#endif
#if HEAD_DIM % LANES != 0
#error "HEAD_DIM must be a multiple of LANES"
#endif

#if !KV_FP8
typedef elem_t kv_t;
#define FP8_READ_SCALE 1.f
static inline vf load_kv(const kv_t *src) { return load_vec(src); }
#else
static inline vf load_kv(const kv_t *src) { return load_fp8_vec(src); }
#endif

#define NVEC (HEAD_DIM / LANES) /* vectors per head row */
#define TILE 32                 /* tokens scored before each softmax update */

/* ---- one head row (HEAD_DIM elements) as NVEC float vectors ---- */
static inline void load_row(const elem_t *src, vf *dst) {
  for (int j = 0; j < NVEC; j++) dst[j] = load_vec(src + j * LANES);
}

static inline void load_kv_row(const kv_t *src, vf *dst) {
  for (int j = 0; j < NVEC; j++) dst[j] = load_kv(src + j * LANES);
}

static inline void store_row(const vf *src, elem_t *dst) {
  for (int j = 0; j < NVEC; j++) store_vec(src[j], dst + j * LANES);
}

/* Where token t of a request lives, walked in order without a division per token. */
typedef struct {
  const kv_t *base; /* the cache */
  const int64_t *table;
  int64_t block_size, row_stride, block, offset;
} cursor_t;

static inline const kv_t *next_row(cursor_t *c) {
  const kv_t *row = c->base + (c->table[c->block] * c->block_size + c->offset) * c->row_stride;
  if (++c->offset == c->block_size) {
    c->offset = 0;
    c->block++;
  }
  return row;
}

/* A token's V row is read after its tile's softmax: ask for it as its K row is read (one at
 * a time: a burst of prefetches for the whole tile, or prefetching K rows ahead, measured
 * slower; they compete with the misses being waited on). */
#define PREFETCH_VALUE(key_row)                                                                \
  for (int c = 0; c < HEAD_DIM * (int)sizeof(kv_t); c += 64)                                   \
  __builtin_prefetch((const char *)((key_row) + value_offset) + c)

/* The running state of one (row, KV head): its GROUP query heads (scaled), their output sums,
 * and the online softmax's running max and sum. */
typedef struct {
  vf qv[GROUP][NVEC], acc[GROUP][NVEC];
  float run_max[GROUP], run_sum[GROUP];
} head_state_t;

static inline void start_head(head_state_t *st, const elem_t *q, float scale) {
  for (int g = 0; g < GROUP; g++) {
    load_row(q + g * HEAD_DIM, st->qv[g]);
    for (int j = 0; j < NVEC; j++) {
      st->qv[g][j] *= scale;
      st->acc[g][j] = (vf){0};
    }
    st->run_max[g] = -INFINITY;
    st->run_sum[g] = 0.f;
  }
}

/* A tile's scores (scaled q . k) and its value sums, in one of two orders; both sum each
 * head's products in the same order, so the results are the same.
 * - Key by key: each K/V row loaded (and widened) once and used by every query head. Where
 *   the GROUP heads' q and sums do not fit in the vector registers (AVX2's 16 in float32)
 *   they are reloaded and stored for every key.
 * - Query head by query head, for float32 where they do not fit: that head's q and sums stay
 *   in registers while every key of the tile is read (from L1 after the first head). On 2 Zen
 *   3 cores (bench/cpu_kernels.py) 1.2-1.3x the other order on decodes and prefill chunks
 *   in float32; in bfloat16 0.9-0.97x (it widens each row GROUP times), hence bfloat16 stays
 *   key by key, and so does an 8-bit cache (level avx2, float32, e4m3, 1 thread of a Zen 5,
 *   head by head against key by key: a 512-token prefill chunk 1.5x the time, a decode of
 *   2000 keys 1.2x, 64 decodes of 180 the same). */
#define VECTOR_REGISTERS (LANES == 16 ? 32 : 16)
#if ELEM_BF16 || KV_FP8 || (2 * GROUP + 1) * NVEC <= VECTOR_REGISTERS
/* (q and the sums copied to locals: through the state's pointer, every store to scores or
 * read of a float32 row could alias them, and GCC would keep them in memory) */
static inline void tile_scores(const head_state_t *st, const kv_t *const *rows, int n,
                               int64_t head, int64_t value_offset, float scores[GROUP][TILE]) {
  vf qv[GROUP][NVEC];
  memcpy(qv, st->qv, sizeof qv);
  for (int i = 0; i < n; i++) {
    PREFETCH_VALUE(rows[i] + head);
    vf k[NVEC];
    load_kv_row(rows[i] + head, k);
    for (int g = 0; g < GROUP; g++) {
      vf dot = qv[g][0] * k[0];
      for (int j = 1; j < NVEC; j++) dot += qv[g][j] * k[j];
      scores[g][i] = hsum(dot);
    }
  }
}

static inline void tile_values(head_state_t *st, const kv_t *const *rows, int n,
                               const float scores[GROUP][TILE], int64_t value) {
  vf acc[GROUP][NVEC];
  memcpy(acc, st->acc, sizeof acc);
  for (int i = 0; i < n; i++) {
    vf v[NVEC];
    load_kv_row(rows[i] + value, v);
    for (int g = 0; g < GROUP; g++)
      for (int j = 0; j < NVEC; j++) acc[g][j] += scores[g][i] * v[j];
  }
  memcpy(st->acc, acc, sizeof acc);
}
#else
static inline void tile_scores(const head_state_t *st, const kv_t *const *rows, int n,
                               int64_t head, int64_t value_offset, float scores[GROUP][TILE]) {
  for (int g = 0; g < GROUP; g++) {
    vf qg[NVEC];
    for (int j = 0; j < NVEC; j++) qg[j] = st->qv[g][j];
    for (int i = 0; i < n; i++) {
      const kv_t *key = rows[i] + head;
      if (g == 0) PREFETCH_VALUE(key);
      vf dot = qg[0] * load_kv(key);
      for (int j = 1; j < NVEC; j++) dot += qg[j] * load_kv(key + j * LANES);
      scores[g][i] = hsum(dot);
    }
  }
}

static inline void tile_values(head_state_t *st, const kv_t *const *rows, int n,
                               const float scores[GROUP][TILE], int64_t value) {
  for (int g = 0; g < GROUP; g++) {
    vf acc[NVEC];
    for (int j = 0; j < NVEC; j++) acc[j] = st->acc[g][j];
    for (int i = 0; i < n; i++)
      for (int j = 0; j < NVEC; j++) acc[j] += scores[g][i] * load_kv(rows[i] + value + j * LANES);
    for (int j = 0; j < NVEC; j++) st->acc[g][j] = acc[j];
  }
}
#endif

/* One tile of n keys (rows[i] + head: key i's K row for this head) into the state: scores,
 * the online softmax's update, then the value sums. */
static inline void attend_tile(head_state_t *st, const kv_t *const *rows, int n, int64_t head,
                               int64_t value_offset) {
  float scores[GROUP][TILE];
  tile_scores(st, rows, n, head, value_offset, scores);
  for (int g = 0; g < GROUP; g++) {
    float tile_max = st->run_max[g];
    for (int i = 0; i < n; i++) tile_max = scores[g][i] > tile_max ? scores[g][i] : tile_max;
    const float rescale = expf(st->run_max[g] - tile_max); /* 0 on the first tile */
    st->run_max[g] = tile_max;
    st->run_sum[g] *= rescale;
    for (int j = 0; j < NVEC; j++) st->acc[g][j] *= rescale;
    for (int i = n; i < TILE; i++) scores[g][i] = -INFINITY;
    for (int i = 0; i < TILE; i += LANES) {
      vf s;
      memcpy(&s, &scores[g][i], sizeof s);
      s = vexp(s - tile_max);
      memcpy(&scores[g][i], &s, sizeof s);
      st->run_sum[g] += hsum(s);
    }
  }
  tile_values(st, rows, n, scores, head + value_offset);
}

static inline void finish_head(head_state_t *st, float v_scale, elem_t *out) {
  for (int g = 0; g < GROUP; g++) {
    const float inv = v_scale / st->run_sum[g];
    for (int j = 0; j < NVEC; j++) st->acc[g][j] *= inv;
    store_row(st->acc[g], out + g * HEAD_DIM);
  }
}

/* KV heads [h0, h1) of one row: q = the row's query heads (KV head h's GROUP of them
 * contiguous), table = its request's block ids, keys [first, kv_len) the tokens it attends
 * to, out = the row's output heads. Tile by tile, each head of the tile's tokens in turn: a
 * token's heads lie side by side, so with every head in one item a tile reads one contiguous
 * run per token.
 * Reading K/V rows dominates (each is a few cache lines in a scattered block). Measured
 * no faster: summing 8 or 16 tokens' dot products with one transposing shuffle tree instead
 * of a horizontal sum each; prefetching the next tile's keys (Zen 3: the hardware prefetcher
 * already streams a block's rows). */
static void attend_heads(const elem_t *q, const kv_t *kv, const int64_t *table, int64_t first,
                         int64_t kv_len, int64_t value_offset, int64_t block_size,
                         int64_t num_kv_heads, int64_t h0, int64_t h1, float scale,
                         float v_scale, elem_t *out) {
  const int64_t row_stride = num_kv_heads * HEAD_DIM;
  head_state_t states[h1 - h0];
  for (int64_t h = h0; h < h1; h++)
    start_head(&states[h - h0], q + h * GROUP * HEAD_DIM, scale);
  cursor_t cursor = {kv, table, block_size, row_stride, first / block_size,
                     first % block_size};
  for (int64_t start = first; start < kv_len; start += TILE) {
    const int n = kv_len - start < TILE ? (int)(kv_len - start) : TILE;
    const kv_t *rows[TILE];
    for (int i = 0; i < n; i++) rows[i] = next_row(&cursor);
    for (int64_t h = h0; h < h1; h++)
      attend_tile(&states[h - h0], rows, n, h * HEAD_DIM, value_offset);
  }
  for (int64_t h = h0; h < h1; h++)
    finish_head(&states[h - h0], v_scale, out + h * GROUP * HEAD_DIM);
}

/* One row's n elements into the cache: copied, or (8-bit cache) x / scale in float32 stored as
 * kv_quant.quantize stores it (n is a multiple of LANES). */
static inline void write_row(const elem_t *src, kv_t *dst, int64_t n, float scale) {
#if !KV_FP8
  (void)scale;
  memcpy(dst, src, n * sizeof(elem_t));
#else
  for (int64_t j = 0; j < n; j += LANES) store_fp8_vec(load_vec(src + j) / scale, dst + j);
#endif
}

/* Writes the step's new K/V rows into their cache slots, then attends every row's KV heads.
 * A row is one query token: a decode, or one token of a prefill chunk, which attends
 * to its request's first kv_lens[row] tokens (its own included), so causal masking is just
 * each row's length (a window > 0 also moves its first key, see above); rows may read slots
 * other rows wrote in this call (the write finishes first). q: row r starts at q + r *
 * q_stride (elements), heads and dims contiguous; k, v likewise with their strides ([rows,
 * num_kv_heads, HEAD_DIM] each); slots [rows]: each row's cache slot (block * block_size +
 * offset); kv_cache as above (8-bit: k_scale, v_scale its scales; else both 1); block_tables [requests, max_blocks]; row_request [rows]: each
 * row's request (table row); out [rows, heads, HEAD_DIM]. Items are handed out one at a
 * time: a chunk's later rows cost more, and a single decode's heads must spread over the
 * threads. */
void paged_attention(const elem_t *q, int64_t q_stride, const elem_t *k, int64_t k_stride,
                     const elem_t *v, int64_t v_stride, const int64_t *slots, kv_t *kv_cache,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *row_request,
                     const int64_t *kv_lens, int64_t window, int64_t num_rows,
                     int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, float scale,
                     float k_scale, float v_scale, elem_t *out) {
  const int64_t row_stride = num_kv_heads * HEAD_DIM;
  const int64_t value_offset = num_blocks * block_size * row_stride;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
      write_row(k + r * k_stride, kv_cache + slots[r] * row_stride, row_stride, k_scale);
      write_row(v + r * v_stride, kv_cache + value_offset + slots[r] * row_stride, row_stride,
                v_scale);
    }
    /* (the implicit barrier here: every slot is written before any row reads) */
    /* An item is a row's KV heads where rows are plenty (as many as divide num_kv_heads and
     * keep their states within 32 KB of the stack), else one KV head of a row. */
    int64_t heads = 1;
    if (num_rows >= 4 * omp_get_num_threads())
      for (int64_t h = num_kv_heads; h > 1; h--)
        if (num_kv_heads % h == 0 && h * (int64_t)sizeof(head_state_t) <= 32768) {
          heads = h;
          break;
        }
    const int64_t parts = num_kv_heads / heads; /* items per row */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_rows * parts; item++) {
      const int64_t r = item / parts, h0 = item % parts * heads;
      const int64_t first = window > 0 && kv_lens[r] > window ? kv_lens[r] - window : 0;
      attend_heads(q + r * q_stride, kv_cache, block_tables + row_request[r] * max_blocks, first,
                   kv_lens[r], value_offset, block_size, num_kv_heads, h0, h0 + heads,
                   scale * k_scale * FP8_READ_SCALE, v_scale * FP8_READ_SCALE,
                   out + r * num_kv_heads * GROUP * HEAD_DIM);
    }
  }
}
