"""Forensics: the audit index projection (index.py, pure), building it from the log (store.py),
the queries over it (queries.py) and the read-only HTTP API that serves them (api.py)."""
