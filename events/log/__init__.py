"""The durable log: one interface (EventLog), a SQL backend (SQLite default, PostgreSQL), a Kafka backend."""

from __future__ import annotations

from events.log._contract import (
    AppendBatch,
    AppendInFlight,
    AppendRejected,
    AppendResult,
    EventLog,
    HeadMoved,
    LogDiverged,
    LogError,
    LogUnavailable,
    NotALog,
    PendingEvent,
    PipelinedLog,
    ProjectionTransaction,
    SchemaMismatch,
    Snapshot,
    StoredEvent,
    StoredStep,
    WriterFenced,
    WrongExpectedVersion,
)
from events.log._kafka import KafkaEventLog
from events.log._open import check_sqlite_file, open_log, schema_revision, upgrade_log
from events.log._sql import PAGE_CACHE_KIB, SqlEventLog, is_outage
from events.log._urls import data_dir, is_kafka, mask, normalize

__all__ = [
    "AppendBatch",
    "AppendInFlight",
    "AppendRejected",
    "AppendResult",
    "EventLog",
    "KafkaEventLog",
    "LogDiverged",
    "LogError",
    "LogUnavailable",
    "PAGE_CACHE_KIB",
    "PendingEvent",
    "PipelinedLog",
    "ProjectionTransaction",
    "NotALog",
    "SchemaMismatch",
    "Snapshot",
    "SqlEventLog",
    "is_outage",
    "StoredEvent",
    "StoredStep",
    "WriterFenced",
    "WrongExpectedVersion",
    "HeadMoved",
    "data_dir",
    "is_kafka",
    "mask",
    "normalize",
    "check_sqlite_file",
    "open_log",
    "schema_revision",
    "upgrade_log",
]
