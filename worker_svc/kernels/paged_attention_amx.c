/* Paged attention in bfloat16 on AMX tiles: the score and value products of up to 16 query
 * vectors of one request at once (a decode's query heads, or several rows of a prefill chunk),
 * with keys and values read straight from the block cache. Same entry arguments and cache
 * effects as paged_attention.c (its twin for every other level, dtype and block size).
 *
 * Built by worker_svc/kernels/build.py at CPU level amx only, with -DHEAD_DIM=<64, 128, ...:
 * a multiple of 32> -DGROUP=<query heads per KV head, at most 16> -DELEM_BF16=1. The process
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
 * Each thread configures its own tiles (palette 1, all eight 16 rows x 64 bytes) and keeps
 * its buffers; an output element depends only on its own row's inputs (other query vectors
 * of a tile, and keys outside its row's window, add exact zeros), so results do not depend on
 * the thread count or on how rows are grouped.
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

/* One step's inputs, fixed for the call. */
typedef struct {
  const uint16_t *q, *kv;
  const int64_t *kv_lens;
  int64_t window; /* > 0: a row of len keys attends keys [len - window, len) only */
  int64_t q_stride, num_kv_heads, block_size, row_stride, value_offset;
  float scale;
  uint16_t *out;
} step_t;

/* Per-thread buffers. */
typedef struct {
  int64_t keys;         /* the step's longest row, rounded up to 16 */
  float *raw;           /* [4][16 keys][16 n]: score tiles as stored */
  float *scores;        /* [16 n][keys] */
  uint32_t *queries;    /* [KSTEPS][16 dim pairs][16 n]: Q as B tiles */
  uint32_t *probs;      /* [keys / 16][2][16 n][16 keys]: P as the value product's A tiles */
  uint16_t *edge;       /* [2][16 keys][HEAD_DIM]: the first and last partial runs of V,
                           zero outside the keys */
  float *acc;           /* [16 n][HEAD_DIM] */
  float *tile;          /* [2][16][16]: output tiles stored for the vector units */
} scratch_t;

/* Key t of a request in KV head `head` (K; V at + value_offset). A run of 16 keys starting
 * at a multiple of 16 is 16 rows at stride row_stride in one block (block_size % 16 == 0). */
static inline const uint16_t *key_row(const step_t *s, const int64_t *table, int64_t head,
                                      int64_t t) {
  return s->kv + (table[t / s->block_size] * s->block_size + t % s->block_size) * s->row_stride
         + head * HEAD_DIM;
}

/* Asks for the 16 rows of keys [t0, t0 + 16) (K, or V with offset = value_offset) where
 * t0 < len. A tile load waits for its rows and the tile registers are not renamed, so the
 * next keys are requested while these are multiplied. */
static inline void prefetch_run(const step_t *s, const int64_t *table, int64_t head,
                                int64_t t0, int64_t len, int64_t offset) {
  if (t0 >= len) return;
  const char *row = (const char *)(key_row(s, table, head, t0) + offset);
  for (int t = 0; t < 16; t++, row += s->row_stride * 2)
    for (int c = 0; c < HEAD_DIM * 2; c += 64) _mm_prefetch(row + c, _MM_HINT_T0);
}

/* 16 x 16 dwords: r[i][j] -> r[j][i]. */
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  /* r[4a + j], 128-bit lane L: element 4L + j of rows 4a..4a+3 */
  for (int a = 0; a < 16; a += 4) {
    r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int j = 0; j < 4; j++) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_i32x4(u0, w0, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(u1, w1, 0x88);
    t[8 + j] = _mm512_shuffle_i32x4(u0, w0, 0xdd);
    t[12 + j] = _mm512_shuffle_i32x4(u1, w1, 0xdd);
  }
  for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Q of rows [r0, r0 + rows) in KV head `head` as B tiles in tmm4..: dword (st, p, n) = dims
 * 32 st + 2p, +1 of query vector n (pairs of dims side by side, as TDPBF16PS reads B);
 * vectors past the rows are zeros. */
static void load_queries(const step_t *s, int64_t r0, int rows, int64_t head, uint32_t *buf) {
  memset(buf, 0, KSTEPS * TILE_BYTES);
  for (int n = 0; n < rows * GROUP; n++) {
    const uint16_t *qn = s->q + (r0 + n / GROUP) * s->q_stride + (head * GROUP + n % GROUP)
                         * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM / 2; d++) {
      uint32_t pair;
      memcpy(&pair, qn + 2 * d, 4);
      buf[(d / 16) * 256 + (d % 16) * 16 + n] = pair;
    }
  }
  _tile_loadd(4, buf, 64);
#if KSTEPS > 1
  _tile_loadd(5, buf + 256, 64);
#endif
#if KSTEPS > 2
  _tile_loadd(6, buf + 512, 64);
#endif
#if KSTEPS > 3
  _tile_loadd(7, buf + 768, 64);
#endif
}

/* Scores of keys [lo, len) for the query tile's first nq vectors (Q in tmm4..), lo = first
 * rounded down to 16, as rows scores[n][t - lo] (row stride w->keys, up to len rounded to
 * 16): scaled, -inf where t is outside the vector's own keys [starts[n], lens[n]); max[n] =
 * their maximum. A tile product yields 16 keys x 16
 * query vectors (keys as rows: A is K as it lies in the block); one 16 x 16 transpose per 16
 * keys turns them into query rows, so that the softmax runs on nq rows (a decode's GROUP),
 * not on all 16 lanes of every key. The tile unit runs one pair of runs ahead of the vector
 * units (w->raw holds two pairs), so that neither waits for the other. */
static void score_keys(const step_t *s, const scratch_t *w, const int64_t *table, int64_t head,
                       int64_t first, int64_t len, int nq, const int32_t *starts,
                       const int32_t *lens, float *max) {
  const int64_t lo = first / 16 * 16, runs = (round_up(len, 16) - lo) / 16;
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(s->scale);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 row_max[16];
  for (int n = 0; n < nq; n++) row_max[n] = neg_inf;
  for (int64_t t = lo + 32; t < lo + 64; t += 16) prefetch_run(s, table, head, t, len, 0);
  for (int64_t i = 0; i < runs + 2; i += 2) {
    if (i < runs) { /* the tile unit works on runs i, i + 1 ... */
      const int two = i + 1 < runs;
      const int64_t t0 = lo + i * 16;
      const uint16_t *k0 = key_row(s, table, head, t0);
      const uint16_t *k1 = two ? key_row(s, table, head, t0 + 16) : NULL;
      prefetch_run(s, table, head, t0 + 64, len, 0);
      prefetch_run(s, table, head, t0 + 80, len, 0);
      _tile_zero(0);
      _tile_zero(1);
      for (int st = 0; st < KSTEPS; st++) {
        _tile_loadd(2, k0 + st * 32, s->row_stride * 2);
        if (two) _tile_loadd(3, k1 + st * 32, s->row_stride * 2);
        switch (st) { /* tile numbers must be constants */
          case 0: _tile_dpbf16ps(0, 2, 4); if (two) _tile_dpbf16ps(1, 3, 4); break;
          case 1: _tile_dpbf16ps(0, 2, 5); if (two) _tile_dpbf16ps(1, 3, 5); break;
          case 2: _tile_dpbf16ps(0, 2, 6); if (two) _tile_dpbf16ps(1, 3, 6); break;
          default: _tile_dpbf16ps(0, 2, 7); if (two) _tile_dpbf16ps(1, 3, 7); break;
        }
      }
      _tile_stored(0, w->raw + (i % 4) * 256, 64);
      if (two) _tile_stored(1, w->raw + (i % 4) * 256 + 256, 64);
    }
    /* ... while the vector units take the two before (stored one iteration ago) */
    for (int64_t j = i - 2; j >= 0 && j < i && j < runs; j++) {
      __m512i rows[16]; /* rows[t][n] -> rows[n][t] */
      for (int t = 0; t < 16; t++) rows[t] = _mm512_loadu_si512(w->raw + (j % 4) * 256 + t * 16);
      transpose16(rows);
      const __m512i t_vec = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(lo + j * 16)));
      for (int n = 0; n < nq; n++) {
        const __mmask16 visible = _mm512_cmplt_epi32_mask(t_vec, _mm512_set1_epi32(lens[n]))
                                  & _mm512_cmpge_epi32_mask(t_vec, _mm512_set1_epi32(starts[n]));
        const __m512 v = _mm512_mask_mul_ps(neg_inf, visible, (__m512)rows[n], scale);
        _mm512_storeu_ps(w->scores + n * w->keys + j * 16, v);
        row_max[n] = _mm512_max_ps(row_max[n], v);
      }
    }
  }
  for (int64_t t = lo; t < lo + 64; t += 16) /* for weigh_values */
    prefetch_run(s, table, head, t, len, s->value_offset);
  for (int n = 0; n < nq; n++) max[n] = _mm512_reduce_max_ps(row_max[n]);
}

/* Run i (keys 16i..16i+15) of P = exp(score - max[n]), rounded to bfloat16, into the value
 * product's two A tiles (see weigh_values): P[n][t] in the low half of dword (n, t) of one,
 * in the high half of the other, zeros beside; total[n] += the float32 values. Rows from nq
 * on are left as they are: they only feed output rows that are not stored. */
static inline void softmax_run(const scratch_t *w, int64_t i, int nq, const float *max,
                               __m512 *total) {
  for (int n = 0; n < nq; n++) {
    const __m512 x = _mm512_loadu_ps(w->scores + n * w->keys + i * 16);
    const __m512 e = (__m512)vexp((vf)_mm512_sub_ps(x, _mm512_set1_ps(max[n])));
    total[n] = _mm512_add_ps(total[n], e);
    const __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e));
    _mm512_storeu_si512(w->probs + i * 512 + n * 16, low);
    _mm512_storeu_si512(w->probs + i * 512 + 256 + n * 16, _mm512_slli_epi32(low, 16));
  }
}

/* V rows of the run [t0, t0 + 16) into buf [16][HEAD_DIM], zeros outside keys [first, len):
 * their slots may hold anything (stale keys, slots not yet written), and P = 0 times NaN
 * would not be 0. The run's block holds first or len - 1, so it is one a row reads. */
static void copy_edge(const step_t *s, const int64_t *table, int64_t head, int64_t t0,
                      int64_t first, int64_t len, uint16_t *buf) {
  const uint16_t *v = key_row(s, table, head, t0) + s->value_offset;
  memset(buf, 0, 16 * HEAD_DIM * 2);
  for (int64_t t = t0 > first ? t0 : first; t < t0 + 16 && t < len; t++)
    memcpy(buf + (t - t0) * HEAD_DIM, v + (t - t0) * s->row_stride, HEAD_DIM * 2);
}

/* P = exp(score - max[n]) (softmax_run; sum[n] = its float32 sums) and acc[n][d] = sum_t
 * P[n][t] V[t][d] over keys [lo, len), lo = first rounded down to 16, with V's tiles loaded
 * where they lie: B = 16 keys x 32 dims of V (a key's dims d, d + 1 side by side, as
 * stored), so TDPBF16PS would sum over pairs of dims; A = P with each value beside a zero
 * instead (dword n, t = P[n][t] in its low half for the even dims, its high half for the
 * odd), which makes the pair sum one term: C_even[n][j] = sum_t P[n][t] V[t][2j], C_odd the
 * same for 2j + 1. That costs twice the tile products of a repacked V, and saves the
 * repacking (a load, a permute and a store per key and 32 dims, and a buffer that outgrows
 * L1). A run with keys before first or from len on comes from a copy with zeros there
 * (copy_edge). The vector units make run i + 1's P while the tile unit multiplies run i's. */
static void weigh_values(const step_t *s, const scratch_t *w, const int64_t *table,
                         int64_t head, int64_t first, int64_t len, int nq, const float *max,
                         float *sum) {
  const int64_t lo = first / 16 * 16, runs = (round_up(len, 16) - lo) / 16;
  const int64_t stride = s->row_stride * 2;
  const int head_edge = first % 16 != 0 || (runs == 1 && len % 16 != 0);
  const int tail_edge = len % 16 != 0 && runs > 1;
  if (head_edge) copy_edge(s, table, head, lo, first, len, w->edge);
  if (tail_edge) copy_edge(s, table, head, len / 16 * 16, first, len, w->edge + 16 * HEAD_DIM);
  uint16_t interleave[32]; /* word 2j <- even output j, 2j + 1 <- odd output j */
  for (int j = 0; j < 16; j++) interleave[2 * j] = j, interleave[2 * j + 1] = 16 + j;
  const __m512i pick_lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)interleave));
  const __m512i pick_hi =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(interleave + 16)));
  __m512 total[16];
  for (int n = 0; n < nq; n++) total[n] = _mm512_setzero_ps();
  softmax_run(w, 0, nq, max, total);
  for (int d0 = 0; d0 < HEAD_DIM; d0 += 64) { /* two 32-dim tiles of V at a time */
    const int pair = d0 + 32 < HEAD_DIM;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < runs; i++) {
      const int64_t t0 = lo + i * 16;
      if (d0 == 0 && i + 1 < runs) softmax_run(w, i + 1, nq, max, total);
      prefetch_run(s, table, head, t0 + 64, len, s->value_offset);
      _tile_loadd(4, w->probs + i * 512, 64);
      _tile_loadd(5, w->probs + i * 512 + 256, 64);
      const int edge = (i == 0 && head_edge) || (i == runs - 1 && tail_edge);
      const uint16_t *v = !edge ? key_row(s, table, head, t0) + s->value_offset
                                : w->edge + (i == 0 && head_edge ? 0 : 16 * HEAD_DIM);
      const int64_t v_stride = edge ? HEAD_DIM * 2 : stride;
      _tile_loadd(6, v + d0, v_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (pair) {
        _tile_loadd(7, v + d0 + 32, v_stride);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    for (int h = 0; h < 1 + pair; h++) {
      if (h == 0) {
        _tile_stored(0, w->tile, 64);
        _tile_stored(1, w->tile + 256, 64);
      } else {
        _tile_stored(2, w->tile, 64);
        _tile_stored(3, w->tile + 256, 64);
      }
      for (int n = 0; n < nq; n++) {
        const __m512 even = _mm512_loadu_ps(w->tile + n * 16);
        const __m512 odd = _mm512_loadu_ps(w->tile + 256 + n * 16);
        float *dst = w->acc + n * HEAD_DIM + d0 + h * 32;
        _mm512_storeu_ps(dst, _mm512_permutex2var_ps(even, pick_lo, odd));
        _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(even, pick_hi, odd));
      }
    }
  }
  for (int n = 0; n < nq; n++) sum[n] = _mm512_reduce_add_ps(total[n]);
}

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
      const __m512 inv = _mm512_set1_ps(1.f / sums[n]);
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

/* Same arguments and contract as paged_attention() in paged_attention.c (bfloat16 only),
 * with block_size % 16 == 0. */
void paged_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                         int64_t k_stride, const uint16_t *v, int64_t v_stride,
                         const int64_t *slots, uint16_t *kv_cache, const int64_t *block_tables,
                         int64_t max_blocks, const int64_t *row_request, const int64_t *kv_lens,
                         int64_t window, int64_t num_rows, int64_t num_kv_heads, int64_t num_blocks,
                         int64_t block_size, float scale, uint16_t *out) {
  const int64_t row_stride = num_kv_heads * HEAD_DIM;
  const step_t step = {q, kv_cache, kv_lens, window, q_stride, num_kv_heads, block_size,
                       row_stride, num_blocks * block_size * row_stride, scale, out};
  run_t *runs = malloc((num_rows + 1) * sizeof *runs);
  const int64_t num_runs = split_runs(row_request, num_rows, runs);
  int64_t longest = 1;
  for (int64_t r = 0; r < num_rows; r++) longest = kv_lens[r] > longest ? kv_lens[r] : longest;
  const int64_t keys = round_up(longest, 16);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
      memcpy(kv_cache + slots[r] * row_stride, k + r * k_stride, row_stride * 2);
      memcpy(kv_cache + step.value_offset + slots[r] * row_stride, v + r * v_stride,
             row_stride * 2);
    }
    /* (the implicit barrier here: every slot is written before any row reads) */
    tile_config config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.colsb[i] = 64, config.rows[i] = 16;
    _tile_loadconfig(&config);
    scratch_t w = {.keys = keys};
    char *memory = aligned_alloc(64, 4 * TILE_BYTES + keys * (16 * 4 + 32 * 4)
                                         + KSTEPS * TILE_BYTES + 2 * 16 * HEAD_DIM * 2
                                         + 16 * HEAD_DIM * 4 + 2 * TILE_BYTES);
    w.raw = (float *)memory;
    w.scores = w.raw + 4 * 256;
    w.queries = (uint32_t *)(w.scores + 16 * keys);
    w.probs = w.queries + KSTEPS * 256;
    w.edge = (uint16_t *)(w.probs + keys * 32);
    w.acc = (float *)(w.edge + 2 * 16 * HEAD_DIM);
    w.tile = w.acc + 16 * HEAD_DIM;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_runs * num_kv_heads; item++) {
      const run_t run = runs[item / num_kv_heads];
      attend_item(&step, &w, run.start, run.end, item % num_kv_heads,
                  block_tables + row_request[run.start] * max_blocks);
    }
    free(memory);
    _tile_release();
  }
  free(runs);
}
