/* The small per-token operations of a decoder layer, each one pass over memory instead of
 * several torch kernels (and their per-call overhead, which dominates at decode sizes).
 *
 * Built by worker_svc/kernels/build.py with -DELEM_BF16=<1|0> and the CPU level's -march. Every
 * result is computed in float32 and rounded once to the tensor dtype. Rows are spread over
 * OpenMP threads only when there are enough of them to pay for waking the threads.
 */
#include "vec.h"

#define PARALLEL_MIN_ELEMENTS (1 << 14) /* 64-row decode norms: 27 -> 21 us a call, measured */

/* new_residual = x + residual (x alone when residual is NULL), rounded to the dtype;
 * normed = new_residual * rsqrt(mean(new_residual^2) + eps) * weight. All [rows, dim]
 * contiguous, weight [dim]. As HF: the norm reads the residual as stored (rounded). */
void add_rms_norm(const elem_t *x, const elem_t *residual, const elem_t *weight, float eps,
                  elem_t *new_residual, elem_t *normed, int64_t rows, int64_t dim) {
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const elem_t *xr = x + r * dim;
    const elem_t *rr = residual ? residual + r * dim : NULL;
    elem_t *sum = new_residual + r * dim, *out = normed + r * dim;
    vf squares = (vf){0};
    float tail = 0.f;
    int64_t i = 0;
    for (; i + LANES <= dim; i += LANES) {
      vf v = load_vec(xr + i);
      if (rr) {
        store_vec(v + load_vec(rr + i), sum + i);
        v = load_vec(sum + i); /* the rounded value */
      } else {
        store_vec(v, sum + i);
      }
      squares += v * v;
    }
    for (; i < dim; i++) {
      float v = load_one(xr + i);
      if (rr) {
        store_one(v + load_one(rr + i), sum + i);
        v = load_one(sum + i);
      } else {
        store_one(v, sum + i);
      }
      tail += v * v;
    }
    const float scale = 1.f / sqrtf((hsum(squares) + tail) / (float)dim + eps);
    for (i = 0; i + LANES <= dim; i += LANES)
      store_vec(load_vec(sum + i) * scale * load_vec(weight + i), out + i);
    for (; i < dim; i++) store_one(load_one(sum + i) * scale * load_one(weight + i), out + i);
  }
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:]; gate_up [rows, 2 * inter],
 * out [rows, inter]. silu(g) = g * sigmoid(g), with sigmoid from exp(-|g|) (never overflows). */
static inline vf vsilu(vf g) {
  vi32 negative = g < 0;
  vf e = vexp((vf)((vi32)g | ((vi32){0} + INT32_MIN))); /* exp(-|g|): set the sign bit */
  vf one = (vf){0} + 1.f;
  vf numerator = (vf)(((vi32)e & negative) | ((vi32)one & ~negative));
  return g * numerator / (one + e);
}

static inline float silu_one(float g) {
  float e = expf(-fabsf(g));
  return g * (g < 0 ? e : 1.f) / (1.f + e);
}

void silu_mul(const elem_t *gate_up, elem_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const elem_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
    elem_t *o = out + r * inter;
    int64_t i = 0;
    for (; i + LANES <= inter; i += LANES)
      store_vec(vsilu(load_vec(gate + i)) * load_vec(up + i), o + i);
    for (; i < inter; i++) store_one(silu_one(load_one(gate + i)) * load_one(up + i), o + i);
  }
}

/* Rotary embedding in place (HF convention: dimension i pairs with i + head_dim / 2) on the
 * first `heads` heads of each row of x; row r starts at x + r * row_stride. cos and sin are
 * [max_positions, head_dim] tables; sin has its first half negated, so that
 * out = x * cos + rotate(x) * sin with rotate(x) = (x[half:], x[:half]). */
void rotary(elem_t *x, int64_t row_stride, const int64_t *positions, const elem_t *cos_table,
            const elem_t *sin_table, int64_t rows, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const elem_t *c = cos_table + positions[r] * head_dim;
    const elem_t *s = sin_table + positions[r] * head_dim;
    for (int64_t h = 0; h < heads; h++) {
      elem_t *v = x + r * row_stride + h * head_dim;
      int64_t i = 0;
      for (; i + LANES <= half; i += LANES) {
        vf a = load_vec(v + i), b = load_vec(v + half + i);
        store_vec(a * load_vec(c + i) + b * load_vec(s + i), v + i);
        store_vec(b * load_vec(c + half + i) + a * load_vec(s + half + i), v + half + i);
      }
      for (; i < half; i++) {
        float a = load_one(v + i), b = load_one(v + half + i);
        store_one(a * load_one(c + i) + b * load_one(s + i), v + i);
        store_one(b * load_one(c + half + i) + a * load_one(s + half + i), v + half + i);
      }
    }
  }
}

/* Greedy sampling: out[r] = the column of row r's largest element, the first one on ties, as
 * torch.argmax (which also counts NaN as the largest: a row holding NaN gives its first NaN).
 * x [rows, cols] contiguous, cols < 2^31. One pass: every lane keeps its largest value and the
 * first column it was seen at (strictly greater replaces), then the lanes' maxima are merged,
 * lowest column first on ties. Reading bfloat16 logits directly saves widening the whole
 * [rows, vocab] matrix to float32 first. */
void argmax_rows(const elem_t *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for if (rows * cols >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const elem_t *row = x + r * cols;
    vf best;
    vi32 at, column, nan = {0};
    for (int l = 0; l < LANES; l++) {
      best[l] = -INFINITY;
      at[l] = l;
      column[l] = l;
    }
    int64_t c = 0;
    for (; c + LANES <= cols; c += LANES, column += LANES) {
      const vf v = load_vec(row + c);
      const vi32 greater = v > best;
      best = (vf)(((vi32)v & greater) | ((vi32)best & ~greater));
      at = (column & greater) | (at & ~greater);
      nan |= v != v;
    }
    /* (A row shorter than a vector leaves every lane at -inf, column 0 winning: right.) */
    float top = best[0];
    int64_t found = at[0], has_nan = nan[0] != 0;
    for (int l = 1; l < LANES; l++) {
      if (best[l] > top || (best[l] == top && at[l] < found)) {
        top = best[l];
        found = at[l];
      }
      has_nan |= nan[l] != 0;
    }
    for (int64_t t = c; t < cols; t++) {
      const float v = load_one(row + t);
      has_nan |= v != v;
      if (v > top) {
        top = v;
        found = t;
      }
    }
    if (has_nan) {
      for (int64_t t = 0; t < cols; t++) {
        const float v = load_one(row + t);
        if (v != v) {
          found = t;
          break;
        }
      }
    }
    out[r] = found;
  }
}
