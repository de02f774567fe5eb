"""The ledger: the pure core (coordinator/core/) on the durable log (events/log/). ledger.py
decides, commits in groups and folds; recovery.py rebuilds the state from a snapshot and the log
and reads stored steps back (the sidecar's hub reads decisions through it)."""
