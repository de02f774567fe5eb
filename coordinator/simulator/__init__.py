"""`kvledger simulate`: an engine simulator on the real sidecar and real workers, with the seeds'
failures as named fault scenarios, each run with kvledger's protection on and off."""
