/* The two passes of paged_attention_amx.c over one query tile's keys: the score product
 * (score_keys) and the value product with its softmax (weigh_values), with the step and
 * per-thread types they share. A private part of that one file, split along its data flow
 * (the passes here; the work items, their split over threads and the entry point there);
 * it needs the macros that file defines before including it (HEAD_DIM, GROUP, KSTEPS,
 * TILE_BYTES, and vec.h's, amx.h's). See paged_attention_amx.c for the layout, the work
 * items and why. */
#ifndef PAGED_ATTENTION_AMX_PASSES_H
#define PAGED_ATTENTION_AMX_PASSES_H

#if !defined(HEAD_DIM) || !defined(GROUP) || !defined(KSTEPS) || !defined(TILE_BYTES)
#error "include from paged_attention_amx.c, after its macros"
#endif

/* One step's inputs, fixed for the call. */
typedef struct {
  const uint16_t *q;
  const kv_t *kv;
  const int64_t *kv_lens;
  int64_t window; /* > 0: a row of len keys attends keys [len - window, len) only */
  int64_t q_stride, num_kv_heads, block_size, row_stride, value_offset;
  float scale;   /* of the scores: 1 / sqrt(HEAD_DIM), times k_scale */
  float v_scale; /* of the outputs (1 unless the cache is 8-bit) */
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
#if KV_FP8
  uint16_t *wide_keys;   /* [2][16 keys][HEAD_DIM]: two runs of K rows widened to bfloat16 */
  uint16_t *wide_values; /* [16 keys][64]: a run's V rows, 64 dims of them, widened */
#endif
} scratch_t;

#if KV_FP8
#define KV_FP8_BUFFER_BYTES (2 * 16 * HEAD_DIM * 2 + 16 * 64 * 2)

/* 16 rows of `cols` stored bytes (src, row stride src_stride) as bfloat16 rows of dst (row
 * stride dst_stride elements); rows outside [from, to) are zeros (see copy_edge: V's slots
 * there may hold anything). Exact: the widened float32 values are bfloat16 numbers. */
static inline void widen_run(const kv_t *src, int64_t src_stride, uint16_t *dst,
                             int dst_stride, int cols, int64_t from, int64_t to) {
  for (int t = 0; t < 16; t++, src += src_stride, dst += dst_stride) {
    if (t < from || t >= to) {
      memset(dst, 0, cols * 2);
      continue;
    }
    for (int d = 0; d < cols; d += 16) store_vec(load_fp8_vec(src + d), dst + d);
  }
}
#else
#define KV_FP8_BUFFER_BYTES 0
#endif

/* Key t of a request in KV head `head` (K; V at + value_offset). A run of 16 keys starting
 * at a multiple of 16 is 16 rows at stride row_stride in one block (block_size % 16 == 0). */
static inline const kv_t *key_row(const step_t *s, const int64_t *table, int64_t head,
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
  for (int t = 0; t < 16; t++, row += s->row_stride * sizeof(kv_t))
    for (int c = 0; c < HEAD_DIM * (int)sizeof(kv_t); c += 64) _mm_prefetch(row + c, _MM_HINT_T0);
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
#if KV_FP8
      const int64_t k_stride = HEAD_DIM * 2;
      const uint16_t *k0 = w->wide_keys, *k1 = w->wide_keys + 16 * HEAD_DIM;
      widen_run(key_row(s, table, head, t0), s->row_stride, w->wide_keys, HEAD_DIM, HEAD_DIM,
                0, 16);
      if (two)
        widen_run(key_row(s, table, head, t0 + 16), s->row_stride, w->wide_keys + 16 * HEAD_DIM,
                  HEAD_DIM, HEAD_DIM, 0, 16);
#else
      const int64_t k_stride = s->row_stride * 2;
      const uint16_t *k0 = key_row(s, table, head, t0);
      const uint16_t *k1 = two ? key_row(s, table, head, t0 + 16) : NULL;
#endif
      prefetch_run(s, table, head, t0 + 64, len, 0);
      prefetch_run(s, table, head, t0 + 80, len, 0);
      _tile_zero(0);
      _tile_zero(1);
      for (int st = 0; st < KSTEPS; st++) {
        _tile_loadd(2, k0 + st * 32, k_stride);
        if (two) _tile_loadd(3, k1 + st * 32, k_stride);
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

#if !KV_FP8
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
#endif

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
#if !KV_FP8
  const int64_t stride = s->row_stride * 2;
  const int head_edge = first % 16 != 0 || (runs == 1 && len % 16 != 0);
  const int tail_edge = len % 16 != 0 && runs > 1;
  if (head_edge) copy_edge(s, table, head, lo, first, len, w->edge);
  if (tail_edge) copy_edge(s, table, head, len / 16 * 16, first, len, w->edge + 16 * HEAD_DIM);
#endif
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
#if KV_FP8
      /* (the run's V rows outside [first, len) widened as zeros, as copy_edge does) */
      const uint16_t *v = w->wide_values;
      const int64_t v_stride = 64 * 2;
      widen_run(key_row(s, table, head, t0) + s->value_offset + d0, s->row_stride, w->wide_values,
                64, pair ? 64 : 32, first - t0, len - t0);
#else
      const int edge = (i == 0 && head_edge) || (i == runs - 1 && tail_edge);
      const uint16_t *v = (!edge ? key_row(s, table, head, t0) + s->value_offset
                                 : w->edge + (i == 0 && head_edge ? 0 : 16 * HEAD_DIM)) + d0;
      const int64_t v_stride = edge ? HEAD_DIM * 2 : stride;
#endif
      _tile_loadd(6, v, v_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (pair) {
        _tile_loadd(7, v + 32, v_stride);
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

#endif
