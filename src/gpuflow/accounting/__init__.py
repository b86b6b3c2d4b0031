"""The accounting layer: the tally the transfer and data layers report copies to, the transfer
ledger, budgets, the profiler cross-check, the seeds' transfer metrics, and the pytest plugin
built on them."""
