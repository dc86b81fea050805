"""Keep freed activation memory mapped between steps (glibc's malloc, Linux).

A 4,096-token prefill step allocates and frees tens of megabytes of
activations in every layer. Under glibc's defaults the top of the heap is
handed back to the kernel once enough of it is free, so the next step
faults every page in again (hundreds of thousands of minor faults on a long
prefill; docs/performance-notes.md). With a high trim
threshold, the mmap threshold fixed at its maximum and some padding on each
heap growth, the heap stays at its high-water mark, as under tcmalloc or
jemalloc, and a step reuses the pages the one before it touched.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# <malloc.h> parameter numbers, and the values set for them.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
HEAP_SETTINGS = {
    M_TRIM_THRESHOLD: 1 << 30,  # free heap top kept before trimming: far above a step's activations
    M_TOP_PAD: 64 << 20,  # extra asked for on each growth: fewer brk calls while the heap grows
    M_MMAP_THRESHOLD: 32 << 20,  # glibc's maximum on 64-bit; blocks below it come from the heap
}


def keep_freed_memory_mapped() -> bool:
    """Apply HEAP_SETTINGS to this process's malloc; False where that is not glibc's (or not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl has no such tunables)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = all(mallopt(param, value) == 1 for param, value in HEAP_SETTINGS.items())
    if not applied:
        logger.debug("mallopt refused a heap setting; freed memory may be returned to the kernel between steps")
    return applied
