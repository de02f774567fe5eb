"""Alembic environment: always runs on the connection kvledger passes in."""

from __future__ import annotations

from alembic import context

from events.log.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with `kvledger db upgrade --log URL`, not with alembic directly")
context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
