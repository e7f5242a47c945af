/* A per-thread scratch buffer for the matmul kernels (gemm_amx.c, gemm_amx_quant.c and the
 * int8 kernels through int8_rows.h). */
#ifndef SPLITSERVE_THREAD_BUFFER_H
#define SPLITSERVE_THREAD_BUFFER_H

#include <stdlib.h>

/* The calling thread's buffer of at least `bytes`, 64-byte aligned, kept between calls: a
 * prefill step's rows or panels are megabytes, and a fresh allocation each call would fault
 * in every page again. It only grows (to whole 4 KiB pages); out of memory aborts. One per
 * thread per kernel library, as each library compiles this header on its own. */
static inline void *thread_buffer(size_t bytes) {
  static __thread void *buffer;
  static __thread size_t size;
  if (bytes > size) {
    free(buffer);
    size = (bytes + 4095) / 4096 * 4096;
    buffer = aligned_alloc(64, size);
    if (buffer == NULL) abort();
  }
  return buffer;
}

#endif
