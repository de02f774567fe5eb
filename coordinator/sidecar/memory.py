"""Keeping the sidecar's resident memory close to what it holds: few malloc arenas, and freed
memory given back to the operating system after a heavy read.

glibc gives each thread that allocates its own arena (up to 8 a core), and an arena keeps what was
freed in it. The sidecar's worker threads (heavy reads, log appends) each grew one: under
ops/bench/hostile.py's attacks it grew by 70 MiB, by 38 MiB with two arenas (`limit_arenas`,
called once when the sidecar starts, before any worker thread allocates).

A heavy read (a Lookup of 262,144 token ids decoded and hashed, a catch-up batch) allocates tens
of MiB in a worker thread and frees them. glibc's malloc keeps what was freed in the thread's
arena for reuse, so the sidecar's resident memory grew by every worker thread's high-water mark
(ops/bench/hostile.py, lookups alone: +33 MiB; +24 MiB when this runs after heavy reads).
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
ARENAS = 2
_M_ARENA_MAX = -8
"""mallopt's parameter number for the arena limit (glibc's malloc.h)."""


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _function(name: str) -> Callable[..., int] | None:
    libc = _libc()
    return getattr(libc, name, None) if libc is not None else None  # musl has neither function


_TRIM = _function("malloc_trim")
_MALLOPT = _function("mallopt")


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc arenas for the whole process; whether glibc took the limit."""
    return bool(_MALLOPT(_M_ARENA_MAX, arenas)) if _MALLOPT is not None else False


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
