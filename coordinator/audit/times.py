"""The times a forensic command or the audit API accepts: epoch seconds (or an ISO 8601 time) that
a datetime can show (years 1..9999), so every answer and message can print them as dates. Past
those bounds `datetime.fromtimestamp` raises, and no step of any log lies there: such a time is
bad input (exit 2, HTTP 422), not a query that finds nothing."""

from __future__ import annotations

import datetime as dt
import math

from coordinator.audit.answers import AuditError
from coordinator.audit.queries import parse_time

EARLIEST = dt.datetime(1, 1, 1, tzinfo=dt.UTC).timestamp()
"""0001-01-01T00:00:00Z, the first second a datetime shows."""
LATEST = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC).timestamp()
"""9999-12-31T23:59:59Z, the last whole second a datetime shows."""
RANGE = "0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z"


def time_problem(seconds: float) -> str | None:
    """What is wrong with `seconds` as a point in time, or None when nothing is."""
    if not math.isfinite(seconds):
        return "expected a finite time"
    if not EARLIEST <= seconds <= LATEST:
        return f"expected a time between {RANGE}"
    return None


def read_time(text: str, option: str = "") -> float:
    """`text` (ISO 8601, UTC unless it names a zone, or seconds since the epoch) as epoch seconds,
    within EARLIEST..LATEST; AuditError naming `option` (when given) and `text` otherwise."""
    prefix = f"{option}: " if option else ""
    try:
        seconds = parse_time(text)
    except AuditError as error:
        raise AuditError(f"{prefix}{error}") from None
    except (ValueError, OverflowError):  # an ISO time whose zone offset takes it past year 1 or 9999
        raise AuditError(f"{prefix}time {text!r}: expected a time between {RANGE}") from None
    problem = time_problem(seconds)
    if problem is not None:
        raise AuditError(f"{prefix}time {text!r}: {problem}")
    return seconds
