"""`kvledger`, the command line: main.py composes the commands (serve, worker, db, simulate, demo
and the subcommand groups); _common.py holds what every command shares (logs, addresses)."""
