"""Giving freed memory back to the operating system after a heavy read.

A heavy read (a Lookup of 262,144 token ids decoded and hashed, a catch-up batch) allocates tens
of MiB in a worker thread and frees them. glibc's malloc keeps what was freed in the thread's
arena for reuse, so the sidecar's resident memory grew by every worker thread's high-water mark
(ops/bench/hostile.py: +56 MiB under attack; +24 MiB when this runs after each heavy read).
`malloc_trim(0)` hands the free pages back, at most once every TRIM_SECONDS: it takes each
arena's lock while it runs, and a trim after every heavy read cost the event loop's own mallocs
(a legitimate engine's step p99 under attack 7-10 ms, against 5-6 ms without). Elsewhere than
glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Callable

TRIM_SECONDS = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


_TRIM = _malloc_trim()
_last_trim = 0.0


def give_back_free_memory() -> bool:
    """Returns freed heap pages to the OS unless that was done less than TRIM_SECONDS ago; whether
    anything was given back. A ctypes call releases the GIL: run it in a worker thread."""
    global _last_trim
    now = time.monotonic()
    if _TRIM is None or now - _last_trim < TRIM_SECONDS:
        return False
    _last_trim = now
    return bool(_TRIM(0))
