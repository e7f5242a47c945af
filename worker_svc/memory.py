"""Keeps freed memory inside the worker process.

glibc hands large freed buffers back to the kernel (munmap, heap trim) and the next step's
allocation faults them in again, page by page. A step allocates the same activation sizes
over and over, and on the small VMs we run on (memory reclaim daemons, expensive faults) that
made identical steps 10x slower at random. Raising the mmap and trim thresholds keeps the
buffers in the heap for reuse. Measured: a 1,840-token prefill step went from 1.3-15 s to a
steady 1.3 s; batch-64 decode from up to 3.7 s to 0.11 s.

The one time freed memory must go back: a worker placed again frees its KV cache and then
measures the host's available memory for the next one (`return_freed_memory`).
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20     # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 16 << 30     # never give the heap back while serving
TOP_PAD = 512 << 20           # grow the heap in large steps


def keep_freed_memory() -> bool:
    """Tunes glibc malloc; returns False (and changes nothing) on other C libraries."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.warning("mallopt refused a setting; freed memory may be returned to the kernel")
    return ok


def return_freed_memory() -> bool:
    """Hands the heap's free memory back to the kernel (glibc malloc_trim), so that
    MemAvailable counts it again; False (nothing done) on other C libraries."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
