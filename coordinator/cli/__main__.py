"""`python -m coordinator.cli ...` is `kvledger ...`."""

from coordinator.cli.main import app

app()
