"""Opening a log for forensics (the audit, verify, export, replay, timeline and namespace
commands): never creating one, and never writing next to what --log names."""

from __future__ import annotations

from pathlib import Path

from coordinator.audit.fleet import open_for_audit
from events.log import SqlEventLog, check_sqlite_file, is_kafka, normalize, open_log


async def open_existing(log_url: str | None, *, read_only: bool = False) -> SqlEventLog:
    """The log to examine. Forensics never creates one: a SQLite file that is not there is an
    error naming the path (a typo must not answer "0 events, all fine"), and one that is not a
    SQLite database is refused before anything opens it (NotALog: `kvledger verify --log
    /etc/passwd` left /etc/passwd.lock). `read_only` (verify, export, a replay that needs no
    index): the file is opened read-only and nothing is created anywhere. A Kafka log's topic must
    exist, and its index lives in its state store (coordinator/audit/fleet.py, open_for_audit)."""
    if is_kafka(log_url):
        return await open_for_audit(str(log_url))
    target = normalize(log_url)
    if target.get_backend_name() == "sqlite" and target.database:
        await check_sqlite_file(Path(target.database))
    return await open_log(log_url, read_only=read_only)
