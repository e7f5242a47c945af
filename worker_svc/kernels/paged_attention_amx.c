/* Paged attention in bfloat16 on AMX tiles: the score and value products of up to 16 query
 * vectors of one request at once (a decode's query heads, or several rows of a prefill chunk),
 * with keys and values read straight from the block cache. Same entry arguments and cache
 * effects as paged_attention.c (its twin for every other level, dtype and block size).
 *
 * Built by worker_svc/kernels/build.py at CPU level amx only, with -DHEAD_DIM=<64, 128, ...:
 * a multiple of 32> -DGROUP=<query heads per KV head, at most 16> -DELEM_BF16=1, and for an
 * 8-bit cache -DKV_FP8=<1: e4m3fn, 2: e5m2> (vec.h). The process
 * must hold Linux's leave to use the tiles (cpu.request_amx, called by paged_attention.py)
 * before the first tile instruction, else it dies on SIGILL. Needs block_size % 16 == 0 (a
 * tile of 16 keys lies in one block); paged_attention.py sends other block sizes to the twin.
 *
 * Cache layout (see worker_svc/attention.py): [2, num_blocks, block_size, num_kv_heads,
 * head_dim], keys then values; token t of a request lives in block table[t / block_size] at
 * offset t % block_size. Query head h * GROUP + g reads KV head h.
 *
 * Work item = (up to RUN_TILES * ROWS_PER_TILE consecutive rows of one request, KV head): a
 * decode is one row, a prefill chunk many. Its query vectors n = (row, query head of the
 * group) go 16 to a query tile (a decode: GROUP of them). Per query tile, with len = its
 * longest row's keys and first = its earliest window start (0 without a window), in two
 * passes over the keys [first rounded down to 16, len):
 *   1. scores: C [16 keys][16 n] = K Q^T with A = 16 key rows loaded straight from their
 *      block (tileloadd, stride num_kv_heads * head_dim), B = Q with pairs of dims side by
 *      side (built once per tile); each C is transposed (16 x 16 dwords) into rows
 *      scores[n][t], scaled, -inf outside the vector's own keys (causal masking is each
 *      row's length; a window, its own start per vector), and their max kept;
 *   2. values: P = exp(score - max) in float32 (vexp, vec.h), summed, rounded to bfloat16;
 *      out [16 n][head_dim] = P V with B = 16 keys x 32 dims of V loaded straight from the
 *      block too, and A = P placed beside zeros so that the pair sum of TDPBF16PS keeps the
 *      even and the odd dims apart (weigh_values).
 * Results are normalized by the sum and rounded to bfloat16 on store.
 *
 * Why: the twin attends one row at a time with a horizontal sum per (key, query head), which
 * bounds it by instructions; here one TDPBF16PS does 16 keys x 16 query vectors x 32 dims.
 * Measured (bench/cpu_kernels.py, SmolLM2's 9/3 heads x 64, 30 layers, 2 threads of a Xeon
 * with AMX, family 6 model 207), ms per step, twin -> this: decodes of 64 requests x 180
 * keys 30 -> 20 (now at the machine's memory bandwidth: every key is read once, 256 bytes),
 * 1 x 2000 keys 7.5 -> 2.8; prefill of one 512-token chunk 162 -> 32, 16 prompts x 176 285
 * -> 83 (also below torch's SDPA, 39 and 111). Tried and dropped: V repacked into pairs of
 * keys once per item (half the tile products, but a load, permute and store per key and 32
 * dims into a buffer that outgrows L1: slower for decodes, no faster for prefill); the
 * softmax on the tile layout (a key's 16 query vectors as one vector: no transposes, but
 * 16 lanes of exp per key where a decode needs GROUP): 2x slower for decodes.
 *
 * Sliding window (window > 0): a row of kv_len keys attends [max(0, kv_len - window), kv_len).
 * No block wholly before first is read (kvcache_svc frees those and the table holds the null
 * block, garbage, there); the first run's keys before first lie in first's own block, and
 * their V comes from a zeroed copy like a last partial run's (copy_edge).
 *
 * Precision: P is rounded to bfloat16 before the value product (the twin keeps float32);
 * against a float32 reference the largest difference stays within an output's bfloat16
 * rounding plus one ulp (tests/worker_svc/test_paged_attention_amx.py).
 *
 * An 8-bit cache: the write quantizes as paged_attention.c's does; each run of 16 keys' K
 * rows, and of V rows, is widened to bfloat16 (exact: every e4m3 and e5m2 value is one) in a
 * per-thread buffer that the tiles load from, instead of from the block; k_scale is folded
 * into the scores' scale and v_scale into the final normalization (each times vec.h's
 * FP8_READ_SCALE, the power of two its reads leave out).
 *
 * The two passes (scores; softmax and values) live in paged_attention_amx_passes.h, included
 * once, here; this file holds the work items, their split over threads and the entry point.
 *
 * Each thread configures its own tiles (palette 1, all eight 16 rows x 64 bytes) and keeps
 * its buffers; an output element depends only on its own row's inputs (other query vectors
 * of a tile, and keys outside its row's window, add exact zeros), so results do not depend on
 * the thread count or on how rows are grouped.
 *
 * Items go out to the threads a request's KV heads together where there are enough requests
 * (see the loop), each with its next item's first keys asked for ahead. Measured against
 * handing out single items (dynamic, 1), in one process with the two builds alternating,
 * bench-style caches of 30 layers, Xeon family 6 model 207, 2 threads: decodes of 64 x 176
 * keys 1.08x (contiguous blocks) and 1.09x (scattered), 16 x 1,000 1.05x, 16 prompts x 176
 * prefill 1.07x, 1 x 2,000 and one 512-token chunk unchanged (0.98x, 0.99x: noise).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "vec.h"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef GROUP
#error "GROUP must be defined"
#endif
#if HEAD_DIM % 32 != 0 || GROUP > 16 || LANES != 16 || !ELEM_BF16
#error "needs HEAD_DIM % 32 == 0, GROUP <= 16, bfloat16, AVX-512"
#endif

#define KSTEPS (HEAD_DIM / 32)          /* tile products over the head dim in the scores */
#define ROWS_PER_TILE (16 / GROUP)      /* query rows whose heads fill one query tile */
#define RUN_TILES 4                     /* query tiles per work item */
#define TILE_BYTES 1024

#if !KV_FP8
typedef uint16_t kv_t;
#define FP8_READ_SCALE 1.f
#endif

#include "paged_attention_amx_passes.h"

/* One item: rows [r0, r1) of one request (block ids `table`), KV head `head`. */
static void attend_item(const step_t *s, const scratch_t *w, int64_t r0, int64_t r1,
                        int64_t head, const int64_t *table) {
  const int64_t num_heads = s->num_kv_heads * GROUP;
  for (int64_t first = r0; first < r1; first += ROWS_PER_TILE) {
    const int rows = r1 - first < ROWS_PER_TILE ? (int)(r1 - first) : ROWS_PER_TILE;
    const int nq = rows * GROUP;
    int32_t lens[16], starts[16]; /* each vector's keys: [starts[n], lens[n]) */
    int64_t len = 0, start = INT64_MAX;
    for (int n = 0; n < nq; n++) {
      lens[n] = (int32_t)s->kv_lens[first + n / GROUP];
      starts[n] = s->window > 0 && lens[n] > s->window ? lens[n] - (int32_t)s->window : 0;
      len = lens[n] > len ? lens[n] : len;
      start = starts[n] < start ? starts[n] : start;
    }
    float max[16], sums[16];
    load_queries(s, first, rows, head, w->queries);
    score_keys(s, w, table, head, start, len, nq, starts, lens, max);
    weigh_values(s, w, table, head, start, len, nq, max, sums);
    for (int n = 0; n < nq; n++) {
      const int64_t r = first + n / GROUP;
      uint16_t *dst = s->out + (r * num_heads + head * GROUP + n % GROUP) * HEAD_DIM;
      const __m512 inv = _mm512_set1_ps(s->v_scale / sums[n]);
      for (int d = 0; d < HEAD_DIM; d += 16)
        store_vec((vf)_mm512_mul_ps(_mm512_loadu_ps(w->acc + n * HEAD_DIM + d), inv), dst + d);
    }
  }
}

/* Rows [start, end) of one request: one item per KV head. */
typedef struct {
  int64_t start, end;
} run_t;

/* Cuts each request's rows into runs of at most RUN_TILES query tiles. */
static int64_t split_runs(const int64_t *row_request, int64_t num_rows, run_t *runs) {
  const int64_t most = RUN_TILES * ROWS_PER_TILE;
  int64_t count = 0;
  for (int64_t r = 0; r < num_rows;) {
    int64_t end = r + 1;
    while (end < num_rows && end - r < most && row_request[end] == row_request[r]) end++;
    runs[count++] = (run_t){r, end};
    r = end;
  }
  return count;
}

/* Asks for the first 64 keys (K) an item reads: from its earliest row's window start. */
static void prefetch_item_start(const step_t *s, run_t run, int64_t head,
                                const int64_t *table) {
  int64_t len = 0, first = INT64_MAX;
  for (int64_t r = run.start; r < run.end; r++) {
    const int64_t n = s->kv_lens[r], start = s->window > 0 && n > s->window ? n - s->window : 0;
    len = n > len ? n : len;
    first = start < first ? start : first;
  }
  for (int64_t t = first / 16 * 16; t < first / 16 * 16 + 64; t += 16)
    prefetch_run(s, table, head, t, len, 0);
}

/* One row's n elements into the cache: copied, or (8-bit cache) stored as paged_attention.c
 * stores them. */
static inline void write_row(const uint16_t *src, kv_t *dst, int64_t n, float scale) {
#if !KV_FP8
  (void)scale;
  memcpy(dst, src, n * 2);
#else
  for (int64_t j = 0; j < n; j += 16) store_fp8_vec(load_vec(src + j) / scale, dst + j);
#endif
}

/* Same arguments and contract as paged_attention() in paged_attention.c (bfloat16 only),
 * with block_size % 16 == 0. */
void paged_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                         int64_t k_stride, const uint16_t *v, int64_t v_stride,
                         const int64_t *slots, kv_t *kv_cache, const int64_t *block_tables,
                         int64_t max_blocks, const int64_t *row_request, const int64_t *kv_lens,
                         int64_t window, int64_t num_rows, int64_t num_kv_heads, int64_t num_blocks,
                         int64_t block_size, float scale, float k_scale, float v_scale,
                         uint16_t *out) {
  const int64_t row_stride = num_kv_heads * HEAD_DIM;
  const step_t step = {q, kv_cache, kv_lens, window, q_stride, num_kv_heads, block_size,
                       row_stride, num_blocks * block_size * row_stride,
                       scale * k_scale * FP8_READ_SCALE, v_scale * FP8_READ_SCALE, out};
  run_t *runs = malloc((num_rows + 1) * sizeof *runs);
  const int64_t num_runs = split_runs(row_request, num_rows, runs);
  int64_t longest = 1;
  for (int64_t r = 0; r < num_rows; r++) longest = kv_lens[r] > longest ? kv_lens[r] : longest;
  const int64_t keys = round_up(longest, 16);
  int64_t claimed = 0; /* items handed out */
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
      write_row(k + r * k_stride, kv_cache + slots[r] * row_stride, row_stride, k_scale);
      write_row(v + r * v_stride, kv_cache + step.value_offset + slots[r] * row_stride,
                row_stride, v_scale);
    }
    /* (the implicit barrier here: every slot is written before any row reads) */
    tile_config config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.colsb[i] = 64, config.rows[i] = 16;
    _tile_loadconfig(&config);
    scratch_t w = {.keys = keys};
    char *memory = aligned_alloc(64, 4 * TILE_BYTES + keys * (16 * 4 + 32 * 4)
                                         + KSTEPS * TILE_BYTES + 2 * 16 * HEAD_DIM * 2
                                         + 16 * HEAD_DIM * 4 + 2 * TILE_BYTES
                                         + KV_FP8_BUFFER_BYTES);
    w.raw = (float *)memory;
    w.scores = w.raw + 4 * 256;
    w.queries = (uint32_t *)(w.scores + 16 * keys);
    w.probs = w.queries + KSTEPS * 256;
    w.edge = (uint16_t *)(w.probs + keys * 32);
    w.acc = (float *)(w.edge + 2 * 16 * HEAD_DIM);
    w.tile = w.acc + 16 * HEAD_DIM;
#if KV_FP8
    w.wide_keys = (uint16_t *)(w.tile + 2 * 256);
    w.wide_values = w.wide_keys + 2 * 16 * HEAD_DIM;
#endif
    /* Items go out in groups of `per` consecutive ones: a decode's KV heads of one request
     * together when there are enough requests to share (the heads' rows interleave in the
     * cache, so the lines the hardware fetches ahead for one head serve the next), one item
     * at a time otherwise. A group is claimed one ahead, and every item's first keys are asked
     * for before the item before it is attended, so that they arrive meanwhile. */
    const int64_t items = num_runs * num_kv_heads;
    const int64_t per = num_runs >= 4 * omp_get_num_threads() ? num_kv_heads : 1;
    int64_t group = __atomic_fetch_add(&claimed, per, __ATOMIC_RELAXED);
    while (group < items) {
      const int64_t next = __atomic_fetch_add(&claimed, per, __ATOMIC_RELAXED);
      const int64_t end = group + per < items ? group + per : items;
      for (int64_t item = group; item < end; item++) {
        const int64_t ahead = item + 1 < end ? item + 1 : next;
        if (ahead < items) {
          const run_t run = runs[ahead / num_kv_heads];
          prefetch_item_start(&step, run, ahead % num_kv_heads,
                              block_tables + row_request[run.start] * max_blocks);
        }
        const run_t run = runs[item / num_kv_heads];
        attend_item(&step, &w, run.start, run.end, item % num_kv_heads,
                    block_tables + row_request[run.start] * max_blocks);
      }
      group = next;
    }
    free(memory);
    _tile_release();
  }
  free(runs);
}
