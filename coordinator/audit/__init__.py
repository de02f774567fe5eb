"""Forensics: the audit index projection (index.py, pure), building it from the log (store.py)
and the queries over it (queries.py)."""
