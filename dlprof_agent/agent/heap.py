"""The daemon's C heap: buffers of a megabyte and more go back to the system
when freed.

Why: glibc serves a large allocation with mmap and unmaps it when freed, but it
then raises its mmap threshold to that size (up to 32 MiB), so that the next
buffers of that size come from the heap and stay there. A daemon decoding
multi-megabyte probe replies (a tenant's reply of 4,096 layers with
510-character names is 2.9 MB, copied a few times as it is decoded) grew by
10-12 MiB that way and never shrank: 72 MiB against 60 MiB with the threshold
fixed, three such tenants, same machine. Fixing it (``M_MMAP_THRESHOLD``, as
the ``MALLOC_MMAP_THRESHOLD_`` environment variable would) keeps large buffers
out of the heap. And glibc gives each thread that allocates while another does
an arena of its own, which keeps what that thread freed; the daemon's threads
(probe exchanges, the render, the server) allocate under the GIL, so one arena
(``M_ARENA_MAX``, as ``MALLOC_ARENA_MAX=1``) costs them little: three such
tenants, 57 MiB peak against 53-54. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 256 * 1024  # above the buffers of a usual reply or scrape


def return_large_buffers() -> bool:
    """Whether the threshold was set (glibc only)."""
    # The process's own symbols, libc's among them: ctypes.util.find_library would
    # run ldconfig in a subprocess, and import subprocess and more to do it.
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused")
    # One arena for every thread: they allocate under the GIL all the same, and an
    # arena of its own per probe-exchange and serving thread kept what each freed.
    if not mallopt(_M_ARENA_MAX, 1):
        log.debug("mallopt(M_ARENA_MAX) refused")
    return done
